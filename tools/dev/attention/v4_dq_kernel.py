"""Backward in v3's tiles: a dq kernel beside the dk/dv kernel.
H100 2026-12-07: fwd+bwd 0.69x SDPA float32 at [16,12,1024,64] (fwd 1.01x)

The backward in two kernels, without atomics. After delta_i = dout_i . out_i,
  dq kernel    a block takes a tile of queries and walks the key tiles up to the diagonal:
               S = Q K^T and dP = dout V^T (two products), dS = P (dP - delta) with P =
               exp(S - lse), then dq += dS K (a third), dS exchanged through shared memory.
  dk/dv kernel the roles swapped: a block takes a tile of keys and walks the query tiles from
               its first key on: S^T = K Q^T, dP^T = V dout^T, then dv += P^T dout and
               dk += dS^T Q (four products).
Both are v3's tiles (tile_functions: 4x4 patches in registers, 16-byte shared loads), and each
gradient is a sum in a fixed order, so dq, dk and dv are reproducible to the bit. The cost:
S and dP are computed twice, 7 products a pair of tiles where 5 make all three gradients,
and both kernels stage q, k, v and dout. v5 computes them once. The forward is v3's.
"""
import math
from typing import NamedTuple

import numpy as np
from numba import cuda, float32, uint64

from nanoandrea.kernels.attention import attention_forward
from nanoandrea.kernels.ptx.vector import load4, store4
from nanoandrea.kernels.ptx.warp import WARP, warp_barrier, warp_sum
from nanoandrea.kernels.runtime.launch import SIMULATOR, blocks, inlined, kernel_factory, launch

LOG2E = float32(1.0 / math.log(2.0))


class Tile(NamedTuple):
    """A kernel's tile: a block owns `rows` rows (queries; keys in dk/dv) and streams
    tiles of `cols` columns (keys; queries in dk/dv) through shared memory; each of its
    (rows/thread_rows) x (cols/thread_cols) threads owns thread_rows x thread_cols scores."""
    rows: int
    cols: int
    thread_rows: int = 4
    thread_cols: int = 4
    blocks_per_sm: int = 0      # launch bounds: that many blocks a multiprocessor; 0 no cap
    score_steps: int = 2        # steps of 4 d per trip of the scores products' loop


HEAD_SIZES = (32, 64)
# (dq tile, dk/dv tile) per head size; in the simulator small and unequal (T=40 crosses them)
ONE_STEP = dict(score_steps=1)
GPU_TILES = {64: (Tile(32, 32, 4, 4, **ONE_STEP), Tile(32, 32, 4, 4, 6, **ONE_STEP)),
             32: (Tile(64, 32, 4, 4, **ONE_STEP), Tile(32, 32, 4, 4, 6, **ONE_STEP))}
TILES = ({D: (Tile(16, 8, 8, 2, **ONE_STEP), Tile(8, 8, 4, 2, **ONE_STEP)) for D in HEAD_SIZES}
         if SIMULATOR else GPU_TILES)


@kernel_factory
def make_dq_kernel(D, tile):
    (thread_position, row_of, dim_of, stage, _, exchange, output_product, store_rows,
     recompute) = tile_functions(D, *tile[:4], SCORE_STEPS=tile.score_steps)
    ROWS, COLS, TM, TN = tile[:4]
    THREADS_M, THREADS_N, TD, D_ROW, X_ROW = tile_constants(D, ROWS, COLS, TM, TN)

    @cuda.jit(**launch_bounds(THREADS_M * THREADS_N, tile.blocks_per_sm))
    def dq_kernel(dq, dout, q, k, v, lse, delta, scale):
        # dq[B,H,T,D] = dS K / sqrt(D); grid (B*H, T/ROWS), block THREADS_M * THREADS_N.
        # Per tile of COLS keys up to the diagonal:
        #   S = Q K^T / sqrt(D), dP = dout V^T     [ROWS, COLS], TM x TN of each a thread
        #   dS = P (dP - delta), P = exp(S - lse);  acc += dS K   [ROWS, D], TM x TD a thread
        q_tile = cuda.shared.array((ROWS, D_ROW), float32)      # q[row_base + r, d] / sqrt(D)
        dout_tile = cuda.shared.array((ROWS, D_ROW), float32)   # dout[row_base + r, d]
        k_tile = cuda.shared.array((COLS, D_ROW), float32)      # k[j0 + c, d]
        v_tile = cuda.shared.array((COLS, D_ROW), float32)      # v[j0 + c, d]
        ds_t = cuda.shared.array((COLS, X_ROW), float32)        # ds_t[c, r] = dS[r, c]
        s = cuda.local.array((TM, TN), float32)
        dp = cuda.local.array((TM, TN), float32)
        acc = cuda.local.array((TM, TD), float32)
        row_lse = cuda.local.array(TM, float32)
        row_delta = cuda.local.array(TM, float32)
        B, H, T, _ = q.shape
        b, h, row_base = block_tile(H, ROWS, True)
        ty, tx = thread_position()
        stage(q_tile, q[b, h], row_base, ROWS, T, scale)
        stage(dout_tile, dout[b, h], row_base, ROWS, T, float32(1.0))
        for i in range(TM):
            row = row_base + row_of(ty, i)
            row_lse[i] = lse[b, h, row] if row < T else float32(0.0)
            row_delta[i] = delta[b, h, row] if row < T else float32(0.0)
            for j in range(TD):
                acc[i, j] = float32(0.0)
        for j0 in range(0, min(T, row_base + ROWS), COLS):
            stage(k_tile, k[b, h], j0, COLS, T, float32(1.0))
            stage(v_tile, v[b, h], j0, COLS, T, float32(1.0))
            cuda.syncthreads()
            recompute(s, q_tile, k_tile, dp, dout_tile, v_tile)
            for i in range(TM):                                 # dp becomes dS
                row = row_base + row_of(ty, i)
                for j in range(TN):
                    ds = float32(0.0)
                    if j0 + tx + j * THREADS_N <= row:
                        ds = fast_exp(s[i, j] - row_lse[i]) * (dp[i, j] - row_delta[i])
                    dp[i, j] = ds
            exchange(ds_t, dp)
            warp_barrier()                                      # (a thread reads its rows)
            output_product(acc, ds_t, k_tile)
            cuda.syncthreads()                                  # before the next tiles
        store_rows(dq, acc, b, h, row_base, T, scale, False, ty, tx)

    dq_kernel.threads, dq_kernel.rows = THREADS_M * THREADS_N, ROWS
    return dq_kernel


@kernel_factory
def make_dkdv_kernel(D, tile):
    (thread_position, row_of, dim_of, stage, _, exchange, output_product, store_rows,
     recompute) = tile_functions(D, *tile[:4], SCORE_STEPS=tile.score_steps)
    ROWS, COLS, TM, TN = tile[:4]
    THREADS_M, THREADS_N, TD, D_ROW, X_ROW = tile_constants(D, ROWS, COLS, TM, TN)
    THREADS = THREADS_M * THREADS_N
    assert THREADS >= COLS, ("a thread per query of a tile", tile)

    @cuda.jit(**launch_bounds(THREADS, tile.blocks_per_sm))
    def dkdv_kernel(dk, dv, dout, q, k, v, lse, delta, scale):
        # dk, dv [B,H,T,D]; grid (B*H, T/ROWS), block THREADS. Per tile of ROWS keys, for each
        # tile of COLS queries from the tile's first key on:
        #   S^T = K Q^T / sqrt(D), dP^T = V dout^T     [ROWS, COLS], TM x TN of each a thread
        #   dv_acc += (P)^T dout,  dk_acc += dS^T Q / sqrt(D)     [ROWS, D], TM x TD each
        k_tile = cuda.shared.array((ROWS, D_ROW), float32)      # k[key_base + r, d]
        v_tile = cuda.shared.array((ROWS, D_ROW), float32)
        q_tile = cuda.shared.array((COLS, D_ROW), float32)      # q[i0 + c, d] / sqrt(D)
        dout_tile = cuda.shared.array((COLS, D_ROW), float32)
        p_t = cuda.shared.array((COLS, X_ROW), float32)         # p_t[c, r] = P[i0+c, key_base+r]
        ds_t = cuda.shared.array((COLS, X_ROW), float32)        # ds_t[c, r] the same of dS
        stats = cuda.shared.array((2, COLS), float32)           # lse, delta of the queries
        s = cuda.local.array((TM, TN), float32)
        dp = cuda.local.array((TM, TN), float32)
        dk_acc = cuda.local.array((TM, TD), float32)
        dv_acc = cuda.local.array((TM, TD), float32)
        B, H, T, _ = q.shape
        b, h, key_base = block_tile(H, ROWS, False)
        ty, tx = thread_position()
        tid = cuda.threadIdx.x
        stage(k_tile, k[b, h], key_base, ROWS, T, float32(1.0))
        stage(v_tile, v[b, h], key_base, ROWS, T, float32(1.0))
        for i in range(TM):
            for j in range(TD):
                dk_acc[i, j] = float32(0.0)
                dv_acc[i, j] = float32(0.0)
        for i0 in range(key_base, T, COLS):                     # queries i >= key_base only
            stage(q_tile, q[b, h], i0, COLS, T, scale)
            stage(dout_tile, dout[b, h], i0, COLS, T, float32(1.0))
            if tid < COLS:
                query = i0 + tid
                stats[0, tid] = lse[b, h, query] if query < T else float32(0.0)
                stats[1, tid] = delta[b, h, query] if query < T else float32(0.0)
            cuda.syncthreads()
            recompute(s, k_tile, q_tile, dp, v_tile, dout_tile)
            for j in range(TN):                                 # s becomes P^T, dp dS^T
                query = i0 + tx + j * THREADS_N
                query_lse = stats[0, tx + j * THREADS_N]
                query_delta = stats[1, tx + j * THREADS_N]
                for i in range(TM):
                    p = float32(0.0)
                    ds = float32(0.0)
                    if key_base + row_of(ty, i) <= query and query < T:
                        p = fast_exp(s[i, j] - query_lse)
                        ds = p * (dp[i, j] - query_delta)
                    s[i, j] = p
                    dp[i, j] = ds
            exchange(p_t, s)
            exchange(ds_t, dp)
            warp_barrier()                                      # (a thread reads its keys)
            output_product(dv_acc, p_t, dout_tile)
            output_product(dk_acc, ds_t, q_tile)
            cuda.syncthreads()                                  # before the next tiles
        store_rows(dk, dk_acc, b, h, key_base, T, float32(1.0), False, ty, tx)
        store_rows(dv, dv_acc, b, h, key_base, T, float32(1.0), False, ty, tx)

    dkdv_kernel.threads, dkdv_kernel.rows = THREADS, ROWS
    return dkdv_kernel


# --- v3's tiles (the package's forward: kernels/attention/tiles.py), and recompute ----------

@inlined
def fast_exp(x):
    # e^x as 2^(x log2 e): a multiply and the hardware's ex2 (math.exp2), where math.exp costs
    # about ten instructions of range reduction. A few float32 ulps off where it matters (x near
    # 0, the weights a softmax row is made of); x = -inf gives 0
    return math.exp2(x * LOG2E)


def padded(n):
    """Row length of a shared tile whose rows hold n floats (n a multiple of 4), accessed 16
    bytes at a time: a multiple of 4 (rows stay 16-byte aligned) whose quarter is odd. A 16-byte
    access is served 8 threads at a time, and 8 threads that touch 8 consecutive rows at the
    same column then hit the 8 different groups of 4 banks."""
    return n + 4 if n % 8 == 0 else n


def launch_bounds(threads, blocks_per_sm):
    """cuda.jit's arguments asking that blocks_per_sm blocks fit on a multiprocessor (which caps
    the registers per thread at 65536 / (threads * blocks_per_sm)); 0: no cap. The simulator
    has no registers to cap (and its jit takes no launch_bounds)."""
    return dict(launch_bounds=(threads, blocks_per_sm)) if blocks_per_sm and not SIMULATOR else {}


@inlined
def block_tile(H, ROWS, heavy_first):
    # (b, h, first row) of this block's tile: grid (B*H, T/ROWS). heavy_first: block y takes
    # the y-th tile from the end, so the longest causal rows (the most key tiles) start first
    y = cuda.gridDim.y - 1 - cuda.blockIdx.y if heavy_first else cuda.blockIdx.y
    return cuda.blockIdx.x // H, cuda.blockIdx.x % H, y * ROWS


def tile_constants(D, ROWS, COLS, TM, TN):
    """THREADS_M, THREADS_N, TD as in tile_functions; the row lengths of a staged tile [n, D]
    and of an exchange tile [COLS, ROWS]."""
    THREADS_N = COLS // TN
    return ROWS // TM, THREADS_N, D // THREADS_N, padded(D), padded(ROWS)


def make_stage(D, THREADS):
    """(stage, R_STEP): the device function that copies rows of one head's [T, D] into a shared
    tile, 16 bytes a load, for a block of THREADS threads, which copies R_STEP rows a pass
    (tiles hold a multiple of R_STEP rows)."""
    CHUNKS = D // 4                     # 4-float chunks in a row of D; a pass of the block
    C_STEP = min(CHUNKS, THREADS)       # copies R_STEP rows, C_STEP chunks of each row per
    R_STEP = THREADS // C_STEP          # thread step
    assert CHUNKS % C_STEP == 0, (D, THREADS)

    @inlined
    def stage(tile, x, row0, n_rows, T, scale):
        # tile[r, d] = x[row0 + r, d] * scale for r < n_rows (x: one head's [T, D]), zeros past T,
        # in 4-float chunks, one 16-byte store each. Consecutive threads take consecutive chunks
        # of a row (a warp reads 512 consecutive bytes): thread t copies chunks t % C_STEP +
        # s*C_STEP of rows t // C_STEP + n*R_STEP. Indices are uint64: for a signed index Numba
        # adds a negative-index wraparound (a compare and a select) the compiler cannot drop.
        d_first = uint64(cuda.threadIdx.x % C_STEP * 4)
        r_first = uint64(cuda.threadIdx.x // C_STEP)
        for n in range(n_rows // R_STEP):
            r = r_first + uint64(n * R_STEP)
            row = uint64(row0) + r
            inside = row < uint64(T)
            for step in range(CHUNKS // C_STEP):
                d = d_first + uint64(step * C_STEP * 4)
                if inside:
                    x4 = load4(x, (row, d))
                    store4(tile, (r, d), x4[0] * scale, x4[1] * scale, x4[2] * scale,
                           x4[3] * scale)
                else:
                    zero = float32(0.0)
                    store4(tile, (r, d), zero, zero, zero, zero)

    return stage, R_STEP


def tile_functions(D, ROWS, COLS, TM, TN, SCORE_STEPS=1):
    """The device functions a tiled kernel is built from, for one tile shape (Tile's fields):
    v3's, the package's forward's (kernels/attention/tiles.py), and recompute.

    Thread (ty, tx) of the THREADS_M x THREADS_N grid owns, in registers,
        the TM x TN scores   rows row_of(ty, i), columns tx + j*THREADS_N
        the TM x TD outputs  the same rows, head dimensions dim_of(tx, j)   (TD = D/THREADS_N)
    where row_of and dim_of make runs of 4 consecutive indices, as in the blocked SGEMM, so that
    a thread reads 4 of its rows (or head dimensions) with one 16-byte load. A row's scores and
    its outputs live in the same THREADS_N threads, consecutive lanes of one warp: the softmax
    statistics of a row rescale that row's outputs without moving them, and what they exchange
    about their own rows needs only that warp's barrier (warp_barrier).
      scores_product  S += X Y^T, the sum over d: per 4 d, TM + TN 16-byte loads feed 4 TM TN
                      multiply-adds. The score columns are strided (tx + j*THREADS_N) so that
                      the 8 threads of a 16-byte access phase read 8 rows of Y: 8 bank groups.
      exchange        the thread's TM x TN values (P, dS) into a shared tile e[c, r],
                      transposed, 4 rows r per 16-byte store.
      output_product  O += E^T Y, the sum over the COLS columns: per c, TM/4 + TD/4 16-byte
                      loads feed TM TD multiply-adds, the SGEMM's outer product.
      recompute       what a backward kernel computes again for a pair of tiles: S = X Y^T
                      and dP = U W^T.
    Every tile's row length is padded(n): 16-byte aligned rows, no bank conflicts."""
    THREADS_M = ROWS // TM
    THREADS_N = COLS // TN
    TD = D // THREADS_N
    THREADS = THREADS_M * THREADS_N
    assert ROWS % TM == 0 and COLS % TN == 0 and D % THREADS_N == 0, (D, ROWS, COLS, TM, TN)
    assert TM % 4 == 0 and TD % 4 == 0, ("runs of 4 rows and head dimensions", D, TM, TD)
    stage, R_STEP = make_stage(D, THREADS)
    assert ROWS % R_STEP == 0 and COLS % R_STEP == 0, (D, ROWS, COLS)
    assert SCORE_STEPS in (1, 2) and D % (4 * SCORE_STEPS) == 0 and COLS % 4 == 0, \
        ("steps per loop trip", D, COLS, SCORE_STEPS)
    assert WARP % THREADS_N == 0, ("a row's threads in one warp", COLS, TN)

    @inlined
    def thread_position():
        # (ty, tx) of this thread on the THREADS_M x THREADS_N grid
        return cuda.threadIdx.x // THREADS_N, cuda.threadIdx.x % THREADS_N

    @inlined
    def row_of(ty, i):
        # the tile row of this thread's i-th row (of TM): runs of 4, 4*THREADS_M rows apart
        return (i // 4) * (4 * THREADS_M) + ty * 4 + i % 4

    @inlined
    def dim_of(tx, j):
        # the head dimension of this thread's j-th output column (of TD): runs of 4, 4*THREADS_N
        # dimensions apart
        return (j // 4) * (4 * THREADS_N) + tx * 4 + j % 4

    @inlined
    def scores_step(acc, x, y, y_frag, d, ty, tx):
        # acc[TM, TN] += sum_{d <= e < d+4} x[row_of(ty, i), e] y[tx + j*THREADS_N, e] (y's 4 x TN
        # values held while x's rows stream through)
        for j in range(TN):
            y4 = load4(y, (tx + j * THREADS_N, d))
            for u in range(4):
                y_frag[j, u] = y4[u]
        for i in range(TM):
            x4 = load4(x, (row_of(ty, i), d))
            for u in range(4):
                for j in range(TN):
                    acc[i, j] += x4[u] * y_frag[j, u]

    @inlined
    def scores_product(acc, x, y):
        # acc[TM, TN] += sum_d x[row_of(ty, i), d] y[tx + j*THREADS_N, d] over d < D, in
        # SCORE_STEPS steps per loop trip (unrolled by hand: the compiler does not unroll a loop
        # this large, and a trip's counting costs ~13 instructions)
        ty, tx = thread_position()
        y_frag = cuda.local.array((TN, 4), float32)
        for d in range(0, D, 4 * SCORE_STEPS):
            scores_step(acc, x, y, y_frag, d, ty, tx)
            if SCORE_STEPS == 2:
                scores_step(acc, x, y, y_frag, d + 4, ty, tx)

    @inlined
    def exchange(tile, values):
        # tile[tx + j*THREADS_N, row_of(ty, i)] = values[i, j]: transposed, so output_product
        # reads it along r; the 8 threads of an access phase write 8 rows: 8 bank groups
        ty, tx = thread_position()
        for j in range(TN):
            c = tx + j * THREADS_N
            for a in range(TM // 4):
                store4(tile, (c, row_of(ty, 4 * a)), values[4 * a, j], values[4 * a + 1, j],
                       values[4 * a + 2, j], values[4 * a + 3, j])

    @inlined
    def output_step(acc, e, y, e_frag, y_frag, c, ty, tx):
        # acc[TM, TD] += e[c, row_of(ty, i)] y[c, dim_of(tx, j)]: the SGEMM's outer product
        for a in range(TM // 4):
            e4 = load4(e, (c, row_of(ty, 4 * a)))
            for u in range(4):
                e_frag[4 * a + u] = e4[u]
        for a in range(TD // 4):
            y4 = load4(y, (c, dim_of(tx, 4 * a)))
            for u in range(4):
                y_frag[4 * a + u] = y4[u]
        for i in range(TM):
            for j in range(TD):
                acc[i, j] += e_frag[i] * y_frag[j]

    @inlined
    def output_product(acc, e, y):
        # acc[TM, TD] += sum_c e[c, row_of(ty, i)] y[c, dim_of(tx, j)] over c < COLS (e: an
        # exchange tile, y a staged tile [COLS, D]). Four steps per loop trip, as above
        ty, tx = thread_position()
        e_frag = cuda.local.array(TM, float32)
        y_frag = cuda.local.array(TD, float32)
        for c in range(0, COLS, 4):
            output_step(acc, e, y, e_frag, y_frag, c, ty, tx)
            output_step(acc, e, y, e_frag, y_frag, c + 1, ty, tx)
            output_step(acc, e, y, e_frag, y_frag, c + 2, ty, tx)
            output_step(acc, e, y, e_frag, y_frag, c + 3, ty, tx)

    @inlined
    def store_rows(x, acc, b, h, first, end, scale, accumulate, ty, tx):
        # x[b, h, first + row_of(ty, i), dim_of(tx, j)] (+)= acc[i, j] * scale, rows below end
        for i in range(TM):
            row = first + row_of(ty, i)
            if row < end:
                for j in range(TD):
                    d = dim_of(tx, j)
                    value = acc[i, j] * scale
                    if accumulate:
                        value += x[b, h, row, d]
                    x[b, h, row, d] = value

    @inlined
    def recompute(s, x, y, dp, u, w):
        # s = x y^T, dp = u w^T (TM x TN each)
        for i in range(TM):
            for j in range(TN):
                s[i, j] = float32(0.0)
                dp[i, j] = float32(0.0)
        scores_product(s, x, y)
        scores_product(dp, u, w)

    return (thread_position, row_of, dim_of, stage, scores_product, exchange,
            output_product, store_rows, recompute)


# --- delta_i = dout_i . out_i, before the backward kernels --------------------------------

DELTA_WARPS = 2 if SIMULATOR else 4     # warps a block, and rows a warp (all their loads in
DELTA_ROWS = 4                          # flight at once)


@cuda.jit
def delta_kernel(delta, dout, out, zeroed, zero):
    # delta[B,H,T] = dout . out along D (D % 4 == 0, D <= 4 WARP); with zero, zeroed[B,H,T,D] = 0
    # too (dq, before atomic adds land in it). grid (T / (DELTA_WARPS DELTA_ROWS), B*H), block
    # (WARP, DELTA_WARPS): lane l holds d = 4l .. 4l+3 of a row, the lanes' sums meet in warp_sum
    _, H, T, D = out.shape
    b = cuda.blockIdx.y // H
    h = cuda.blockIdx.y - b * H
    lane = cuda.threadIdx.x
    d = 4 * lane
    first = (cuda.blockIdx.x * cuda.blockDim.y + cuda.threadIdx.y) * DELTA_ROWS
    g = cuda.local.array((DELTA_ROWS, 4), float32)
    o = cuda.local.array((DELTA_ROWS, 4), float32)
    partial = cuda.local.array(DELTA_ROWS, float32)
    for r in range(DELTA_ROWS):
        partial[r] = float32(0.0)
    if d < D:
        for r in range(DELTA_ROWS):                      # every load first (a row past T is
            t = min(first + r, T - 1)                    # row T-1 again, not stored) ...
            g[r, 0], g[r, 1], g[r, 2], g[r, 3] = load4(dout, (b, h, t, d))
            o[r, 0], o[r, 1], o[r, 2], o[r, 3] = load4(out, (b, h, t, d))
        for r in range(DELTA_ROWS):                      # ... then the products
            for i in range(4):
                partial[r] += g[r, i] * o[r, i]
        if zero:
            for r in range(DELTA_ROWS):
                if first + r < T:
                    store4(zeroed, (b, h, first + r, d), float32(0.0), float32(0.0),
                           float32(0.0), float32(0.0))
    for r in range(DELTA_ROWS):
        total = warp_sum(partial[r])                     # (every lane of the warp calls it)
        if lane == 0 and first + r < T:
            delta[b, h, first + r] = total


_deltas = {}


def delta(dout, out, zeroed=None):
    """delta [B,H,T] = dout . out (a buffer kept per shape, reused by the next backward);
    zeroed [B,H,T,D] (or None) set to zeros in the same pass."""
    B, H, T, D = out.shape
    assert D % 4 == 0 and D <= 4 * WARP, D
    if (B, H, T) not in _deltas:
        _deltas[B, H, T] = cuda.device_array((B, H, T), np.float32)
    buffer = _deltas[B, H, T]
    launch(delta_kernel, (blocks(T, DELTA_WARPS * DELTA_ROWS), B * H), (WARP, DELTA_WARPS),
           buffer, dout, out, out if zeroed is None else zeroed, zeroed is not None)
    return buffer


_kernels = {}


def forward(out, lse, q, k, v):
    attention_forward(out, lse, q, k, v, kernel="float32")


def backward(dq, dk, dv, dout, q, k, v, out, lse):
    B, H, T, D = q.shape
    if D not in _kernels:
        dq_tile, dkdv_tile = TILES[D]
        _kernels[D] = make_dq_kernel(D, dq_tile), make_dkdv_kernel(D, dkdv_tile)
    dq_kernel, dkdv_kernel = _kernels[D]
    scale = np.float32(1 / math.sqrt(D))
    row_delta = delta(dout, out)
    launch(dq_kernel, (B * H, blocks(T, dq_kernel.rows)), dq_kernel.threads,
           dq, dout, q, k, v, lse, row_delta, scale)
    launch(dkdv_kernel, (B * H, blocks(T, dkdv_kernel.rows)), dkdv_kernel.threads,
           dk, dv, dout, q, k, v, lse, row_delta, scale)
