"""Not kept: dq's shares added atomically (red.global.add.v4.f32).
H100 2026-12-07: fwd+bwd 0.99x SDPA float32 at [16,12,1024,64] (fwd 1.01x)

v5's dk/dv kernel with one change: each (query tile, key tile) pair's share of dq, dS K, is
added into dq where v5 stores it for the sum kernel. dq is zeroed in the delta kernel's
pass; then every block adds its shares, 4 floats an instruction (one red.global.add.v4.f32,
a reduction the memory system performs: no value comes back, so the thread does not wait for
it). No shares in memory, no second pass over them, no sum kernel (the flash-attention-2
way); yet in the run above it is not faster than v5 (0.97x against 0.99x; it was 1-3%
faster in other runs). Not kept either way: the shares of a query row
land in whatever order the blocks of its key tiles finish, and float addition is not
associative, so dq's last bits (and a training step's) vary from run to run. The product
keeps v5's fixed order, reproducible to the bit. The forward is v3's.
"""
import math
from typing import NamedTuple

import numpy as np
from numba import cuda, float32, uint64

from nanoandrea.kernels.attention import attention_forward
from nanoandrea.kernels.ptx.sharedmem import dynamic_shared_floats, shared_tile
from nanoandrea.kernels.ptx.vector import load4, store4
from nanoandrea.kernels.ptx.warp import WARP, warp_barrier, warp_sum
from nanoandrea.kernels.runtime.launch import (SIMULATOR, STATIC_SHARED_BYTES, blocks, inlined,
                                               kernel_factory, launch)

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
# v5's tiles: at D=64 64 keys x 32 queries (dynamic shared memory), two score steps a trip;
# in the simulator small, and two query tiles a key tile as at D=64
TILES = ({D: Tile(16, 8, 8, 2, score_steps=1) for D in HEAD_SIZES} if SIMULATOR else
         {64: Tile(64, 32, 4, 4, 3, 2), 32: Tile(32, 32, 4, 4, 6, score_steps=1)})


@kernel_factory
def make_dkdv_kernel(D, tile):
    (thread_position, row_of, dim_of, stage, _, exchange, output_product, store_rows,
     recompute) = tile_functions(D, *tile[:4], SCORE_STEPS=tile.score_steps)
    ROWS, COLS, TM, TN = tile[:4]
    THREADS_M, THREADS_N, TD, D_ROW, X_ROW = tile_constants(D, ROWS, COLS, TM, TN)
    THREADS = THREADS_M * THREADS_N
    assert THREADS >= COLS and ROWS % COLS == 0, ("key tiles of whole query tiles", tile)
    # dq's share, dS K [COLS, D] summed over the ROWS keys, on a grid of its own for the same
    # threads: COLS/TM query rows (TM each) by the rest (a TM x TD_Q patch each)
    Q_TN = ROWS // (THREADS // (COLS // TM))
    (q_position, q_row_of, q_dim_of, _, _, _, q_output_product, _, _) = tile_functions(
        D, COLS, ROWS, TM, Q_TN)
    _, _, TD_Q, _, K_ROW = tile_constants(D, COLS, ROWS, TM, Q_TN)
    floats = 2 * ROWS * D_ROW + 2 * COLS * D_ROW + 2 * COLS * X_ROW + 2 * COLS
    # dynamic shared memory past 48 KB, and for key tiles of several query tiles (dS keys-major,
    # keys_t, then lies over q and dout: too big for P's place)
    DYNAMIC = 4 * floats > STATIC_SHARED_BYTES or ROWS > COLS
    assert not DYNAMIC or 2 * COLS * D_ROW >= ROWS * K_ROW

    if DYNAMIC:
        @inlined
        def shared_tiles():
            buffer = dynamic_shared_floats()
            k_tile = shared_tile(buffer, 0, ROWS, D_ROW)
            v_tile = shared_tile(buffer, ROWS * D_ROW, ROWS, D_ROW)
            at = 2 * ROWS * D_ROW
            q_tile = shared_tile(buffer, at, COLS, D_ROW)
            dout_tile = shared_tile(buffer, at + COLS * D_ROW, COLS, D_ROW)
            keys_t = shared_tile(buffer, at, ROWS, K_ROW)       # over q_tile and dout_tile
            at += 2 * COLS * D_ROW
            p_t = shared_tile(buffer, at, COLS, X_ROW)
            ds_t = shared_tile(buffer, at + COLS * X_ROW, COLS, X_ROW)
            stats = shared_tile(buffer, at + 2 * COLS * X_ROW, 2, COLS)
            return k_tile, v_tile, q_tile, dout_tile, p_t, ds_t, stats, keys_t
    else:
        @inlined
        def shared_tiles():
            k_tile = cuda.shared.array((ROWS, D_ROW), float32)
            v_tile = cuda.shared.array((ROWS, D_ROW), float32)
            q_tile = cuda.shared.array((COLS, D_ROW), float32)
            dout_tile = cuda.shared.array((COLS, D_ROW), float32)
            p_t = cuda.shared.array((COLS, X_ROW), float32)
            ds_t = cuda.shared.array((COLS, X_ROW), float32)
            stats = cuda.shared.array((2, COLS), float32)
            return k_tile, v_tile, q_tile, dout_tile, p_t, ds_t, stats, p_t    # keys_t: p_t

    @inlined
    def keys_major(tile, ds_t):
        # tile[r, c] = ds_t[c, r] at this thread's TM x TN places (r a key, c a query): dS keys
        # down, so that q_output_product sums it over the keys. A thread reads back what it
        # wrote to ds_t itself, so dS need not stay in registers through the dk, dv products.
        ty, tx = thread_position()
        for j in range(TN):
            c = tx + j * THREADS_N
            for a in range(TM // 4):
                x = load4(ds_t, (c, row_of(ty, 4 * a)))
                for u in range(4):
                    tile[row_of(ty, 4 * a + u), c] = x[u]

    @inlined
    def add_dq_share(dq, acc, b, h, i0, T, scale, ty, tx):
        # dq[b, h, i0 + q_row_of(ty, i), q_dim_of(tx, j)] += scale * acc[i, j], rows below T:
        # 16 bytes at a time, atomically
        for i in range(TM):
            row = i0 + q_row_of(ty, i)
            if row < T:
                for j in range(0, TD_Q, 4):
                    add4(dq, (b, h, row, q_dim_of(tx, j)), scale * acc[i, j],
                         scale * acc[i, j + 1], scale * acc[i, j + 2], scale * acc[i, j + 3])

    @cuda.jit(**launch_bounds(THREADS, tile.blocks_per_sm))
    def dkdv_kernel(dk, dv, dq, dout, q, k, v, lse, delta, scale):
        # dk, dv [B,H,T,D] = gradients, dq [B,H,T,D] += dS K / sqrt(D) (zeroed before); grid
        # (B*H, T/ROWS), block THREADS. Per tile of ROWS keys, for each tile of COLS queries:
        #   S^T = K Q^T / sqrt(D), dP^T = V dout^T           [ROWS, COLS], TM x TN a thread
        #   dv_acc += P^T dout,  dk_acc += dS^T Q / sqrt(D)  [ROWS, D], TM x TD a thread
        #   dq[queries] += dS K / sqrt(D)                    [COLS, D], TM x TD_Q a thread
        k_tile, v_tile, q_tile, dout_tile, p_t, ds_t, stats, keys_t = shared_tiles()
        s = cuda.local.array((TM, TN), float32)
        dp = cuda.local.array((TM, TN), float32)
        dk_acc = cuda.local.array((TM, TD), float32)
        dv_acc = cuda.local.array((TM, TD), float32)
        dq_acc = cuda.local.array((TM, TD_Q), float32)
        B, H, T, _ = q.shape
        b, h, key_base = block_tile(H, ROWS, False)
        ty, tx = thread_position()
        q_ty, q_tx = q_position()
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
            cuda.syncthreads()                                  # every product done with P, q
            keys_major(keys_t, ds_t)                            # dq's share: dS K
            for i in range(TM):
                for j in range(TD_Q):
                    dq_acc[i, j] = float32(0.0)
            cuda.syncthreads()
            q_output_product(dq_acc, keys_t, k_tile)
            add_dq_share(dq, dq_acc, b, h, i0, T, scale, q_ty, q_tx)
            if DYNAMIC:                                         # keys_t lies over q and dout,
                cuda.syncthreads()                              # staged next
        store_rows(dk, dk_acc, b, h, key_base, T, float32(1.0), False, ty, tx)
        store_rows(dv, dv_acc, b, h, key_base, T, float32(1.0), False, ty, tx)

    dkdv_kernel.threads, dkdv_kernel.rows = THREADS, ROWS
    dkdv_kernel.shared_bytes = 4 * floats if DYNAMIC else 0
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


# --- add4: array[i, j:j+4] += x, one red.global.add.v4.f32 (sm_90) ---------------------------
# A reduction into global memory that other threads' adds to the same floats cannot tear, in
# whatever order they land (so a sum made of them is not reproducible to the bit). The
# simulator's twin adds the four floats one atomic add at a time.

if SIMULATOR:
    @cuda.jit(device=True)      # (a device function: `cuda` in it is the simulated one)
    def add4(array, index, x0, x1, x2, x3):
        *outer, j = index
        outer = tuple(outer)
        for e, x in enumerate((x0, x1, x2, x3)):
            cuda.atomic.add(array, outer + (j + e,), x)
else:
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.cuda.extending import intrinsic

    ADD4 = """{
    .reg .u64 global_address;
    cvta.to.global.u64 global_address, $0;
    red.global.add.v4.f32 [global_address], {$1, $2, $3, $4};
}"""

    @intrinsic
    def add4(typingctx, array, index, x0, x1, x2, x3):
        if not (isinstance(array, types.Array) and array.dtype == types.float32
                and isinstance(index, types.BaseTuple) and len(index) == array.ndim):
            raise TypeError(f"add4 needs a float32 array and {getattr(array, 'ndim', '?')} "
                            f"indices, got {array}, {index}")

        def codegen(context, builder, signature, args):
            array_type, index_type = signature.args[:2]
            view = context.make_array(array_type)(context, builder, args[0])
            indices = [context.cast(builder, value, kind, types.intp) for value, kind in
                       zip(cgutils.unpack_tuple(builder, args[1], len(index_type)), index_type)]
            pointer = cgutils.get_item_pointer(context, builder, array_type, view, indices,
                                               wraparound=False)
            values = [context.cast(builder, value, kind, types.float32)
                      for value, kind in zip(args[2:], signature.args[2:])]
            function = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [ir.IntType(64)]
                                                    + [ir.FloatType()] * 4), ADD4,
                                    "l,f,f,f,f,~{memory}", side_effect=True)
            builder.call(function, [builder.ptrtoint(pointer, ir.IntType(64)), *values])

        return types.void(array, index, x0, x1, x2, x3), codegen


_kernels = {}


def forward(out, lse, q, k, v):
    attention_forward(out, lse, q, k, v, kernel="float32")


def backward(dq, dk, dv, dout, q, k, v, out, lse):
    B, H, T, D = q.shape
    if D not in _kernels:
        _kernels[D] = make_dkdv_kernel(D, TILES[D])
    kernel = _kernels[D]
    row_delta = delta(dout, out, zeroed=dq)                     # (dq = 0 in the same pass)
    launch(kernel, (B * H, blocks(T, kernel.rows)), kernel.threads, dk, dv, dq, dout, q, k, v,
           lse, row_delta, np.float32(1 / math.sqrt(D)), shared_bytes=kernel.shared_bytes)
