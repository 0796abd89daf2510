"""The pieces the flash-style versions (v4, v6, v7) are built from, copied from the package's
nanoandrea/kernels/attention.py so that the versions keep running as the package changes.

    stage           one head's rows [row0, row0 + n) of q, k, v or dout into a padded shared tile
    tile_functions  a tile of ROWS rows against tiles of COLS columns, computed like a
                    register-blocked SGEMM: each thread a TM x TN patch of S in registers, 16-byte
                    shared loads (load4), P (or dS) exchanged through a transposed shared tile
                    and multiplied by the next operand (O += P V, dq += dS K, ...)
    delta           delta_i = dout_i . out_i, a warp per DELTA_ROWS rows, before the backward

A block takes one tile of rows (ROWS) of one (batch, head): grid (B*H, T/ROWS). The docstring
of tile_functions says where each thread's values sit.
"""
import math
from collections import namedtuple

import numpy as np
from numba import cuda, float32, uint64

from nanoandrea.kernels.launch import SIMULATOR, blocks, inlined, launch
from nanoandrea.kernels.reduce import WARP, warp_sum
from nanoandrea.kernels.vector import load4, store4

NEG_INF = float32(-np.inf)
LOG2E = float32(1.0 / math.log(2.0))
LN2 = float32(math.log(2.0))

# A kernel's tile: a block owns `rows` rows and streams tiles of `cols` columns; a thread holds
# thread_rows x thread_cols scores; blocks_per_sm (0: no bound) caps its registers so that so
# many blocks fit on a multiprocessor; score_steps: steps of 4 d per trip of the scores loops
Tile = namedtuple("Tile", "rows cols thread_rows thread_cols blocks_per_sm score_steps",
                  defaults=(0, 1))


@inlined
def fast_exp(x):
    # e^x as 2^(x log2 e): a multiply and the hardware's ex2, where math.exp costs about ten
    # instructions of range reduction; exp(-inf) = 0
    return math.exp2(x * LOG2E)


@inlined
def block_tile(H, ROWS, heavy_first):
    # (b, h, first row) of this block's tile: grid (B*H, T/ROWS). heavy_first: block y takes
    # the y-th tile from the end, so the longest causal rows (the most key tiles) start first
    y = cuda.gridDim.y - 1 - cuda.blockIdx.y if heavy_first else cuda.blockIdx.y
    return cuda.blockIdx.x // H, cuda.blockIdx.x % H, y * ROWS


def launch_bounds(threads, blocks_per_sm):
    """cuda.jit's arguments asking that blocks_per_sm blocks fit on a multiprocessor (registers
    capped at 65536 / (threads * blocks_per_sm)); 0: no cap. The simulator has no registers."""
    return dict(launch_bounds=(threads, blocks_per_sm)) if blocks_per_sm and not SIMULATOR else {}


def padded(n):
    """Row length of a shared tile of n floats a row, read 16 bytes at a time: a multiple of 4
    whose quarter is odd, so that 8 threads reading 8 consecutive rows at one column (a 16-byte
    access phase) hit 8 different groups of 4 banks."""
    return n + 4 if n % 8 == 0 else n


def tile_constants(D, ROWS, COLS, TM, TN):
    """THREADS_M, THREADS_N, TD as in tile_functions; the row lengths of a staged tile [n, D]
    and of an exchange tile [COLS, ROWS]."""
    THREADS_N = COLS // TN
    return ROWS // TM, THREADS_N, D // THREADS_N, padded(D), padded(ROWS)


def make_stage(D, THREADS, put=store4):
    """(stage, R_STEP): copies rows of one head's [T, D] into a shared tile with a block of
    THREADS threads, R_STEP rows a pass; put(tile, (r, d), x0, x1, x2, x3) stores 4 floats."""
    CHUNKS = D // 4                     # 4-float chunks of a row; a pass copies R_STEP rows,
    C_STEP = min(CHUNKS, THREADS)       # C_STEP chunks of each per thread step
    R_STEP = THREADS // C_STEP
    assert CHUNKS % C_STEP == 0, (D, THREADS)

    @inlined
    def stage(tile, x, row0, n_rows, T, scale):
        # tile[r, d] = x[row0 + r, d] * scale for r < n_rows, zeros past T: 16-byte loads,
        # consecutive threads on consecutive chunks of a row (coalesced). uint64 indices: a
        # signed index makes Numba add a negative-index wraparound (a compare and a select)
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
                    put(tile, (r, d), x4[0] * scale, x4[1] * scale, x4[2] * scale,
                        x4[3] * scale)
                else:
                    zero = float32(0.0)
                    put(tile, (r, d), zero, zero, zero, zero)

    return stage, R_STEP


def tile_functions(D, ROWS, COLS, TM, TN, SCORE_STEPS=1):
    """The device functions of a tiled kernel: a block owns ROWS rows (queries; keys in dk/dv)
    and streams tiles of COLS columns (keys; queries in dk/dv) through shared memory.

    THREADS = (ROWS/TM) x (COLS/TN) threads on a grid THREADS_M x THREADS_N; thread (ty, tx)
    holds in registers
        the TM x TN scores   rows row_of(ty, i), columns tx + j*THREADS_N
        the TM x TD outputs  the same rows, head dimensions dim_of(tx, j)   (TD = D/THREADS_N)
    with row_of(ty, i) = ty*4 + i%4 + (i//4)*4*THREADS_M and dim_of likewise: runs of 4
    consecutive indices, one 16-byte load each. A row's scores and outputs live in the same
    THREADS_N threads (consecutive lanes of one warp), so its softmax statistics rescale its
    outputs in place and what those threads exchange needs only the warp's barrier.
      scores_product  S += X Y^T over d: per 4 d, TM + TN 16-byte loads feed 4 TM TN FFMA
      exchange        the thread's TM x TN values into a shared tile e[c, r], transposed
      output_product  O += E^T Y over the COLS columns: per column, TM/4 + TD/4 loads feed
                      TM TD FFMA (the SGEMM's outer product)
    Every tile row is padded(n) floats. SCORE_STEPS (1 or 2): steps of 4 d per loop trip.
    """
    THREADS_M = ROWS // TM
    THREADS_N = COLS // TN
    TD = D // THREADS_N
    THREADS = THREADS_M * THREADS_N
    assert ROWS % TM == 0 and COLS % TN == 0 and D % THREADS_N == 0, (D, ROWS, COLS, TM, TN)
    assert TM % 4 == 0 and TD % 4 == 0, ("runs of 4 rows and head dimensions", D, TM, TD)
    stage, R_STEP = make_stage(D, THREADS)
    assert ROWS % R_STEP == 0 and COLS % R_STEP == 0, (D, ROWS, COLS)
    assert SCORE_STEPS in (1, 2) and D % (4 * SCORE_STEPS) == 0 and COLS % 4 == 0
    assert WARP % THREADS_N == 0, ("a row's threads in one warp", COLS, TN)

    @inlined
    def thread_position():
        return cuda.threadIdx.x // THREADS_N, cuda.threadIdx.x % THREADS_N

    @inlined
    def row_of(ty, i):
        return (i // 4) * (4 * THREADS_M) + ty * 4 + i % 4

    @inlined
    def dim_of(tx, j):
        return (j // 4) * (4 * THREADS_N) + tx * 4 + j % 4

    @inlined
    def scores_step(acc, x, y, y_frag, d, ty, tx):
        # acc[TM, TN] += sum_{d <= e < d+4} x[row_of(ty, i), e] y[tx + j*THREADS_N, e]
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
        # acc[TM, TN] += x[rows] . y[columns] over d < D (SCORE_STEPS steps a trip, by hand)
        ty, tx = thread_position()
        y_frag = cuda.local.array((TN, 4), float32)
        for d in range(0, D, 4 * SCORE_STEPS):
            scores_step(acc, x, y, y_frag, d, ty, tx)
            if SCORE_STEPS == 2:
                scores_step(acc, x, y, y_frag, d + 4, ty, tx)

    @inlined
    def exchange(tile, values):
        # tile[tx + j*THREADS_N, row_of(ty, i)] = values[i, j]: one 16-byte store a run of 4 rows
        ty, tx = thread_position()
        for j in range(TN):
            c = tx + j * THREADS_N
            for a in range(TM // 4):
                store4(tile, (c, row_of(ty, 4 * a)), values[4 * a, j], values[4 * a + 1, j],
                       values[4 * a + 2, j], values[4 * a + 3, j])

    @inlined
    def output_step(acc, e, y, e_frag, y_frag, c, ty, tx):
        # acc[TM, TD] += e[c, row_of(ty, i)] y[c, dim_of(tx, j)]: the outer product of column c
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
        # acc[TM, TD] += sum over c < COLS of e[c, rows] y[c, dims] (four columns a trip)
        ty, tx = thread_position()
        e_frag = cuda.local.array(TM, float32)
        y_frag = cuda.local.array(TD, float32)
        for c in range(0, COLS, 4):
            output_step(acc, e, y, e_frag, y_frag, c, ty, tx)
            output_step(acc, e, y, e_frag, y_frag, c + 1, ty, tx)
            output_step(acc, e, y, e_frag, y_frag, c + 2, ty, tx)
            output_step(acc, e, y, e_frag, y_frag, c + 3, ty, tx)

    @inlined
    def store_rows(x, acc, b, h, first, T, scale, ty, tx):
        # x[b, h, first + row_of(ty, i), dim_of(tx, j)] = acc[i, j] * scale, rows below T
        for i in range(TM):
            row = first + row_of(ty, i)
            if row < T:
                for j in range(TD):
                    x[b, h, row, dim_of(tx, j)] = acc[i, j] * scale

    @inlined
    def recompute(s, x, y, dp, u, w):
        # what a backward kernel recomputes for a pair of tiles: s = x y^T, dp = u w^T
        for i in range(TM):
            for j in range(TN):
                s[i, j] = float32(0.0)
                dp[i, j] = float32(0.0)
        scores_product(s, x, y)
        scores_product(dp, u, w)

    return (thread_position, row_of, dim_of, stage, scores_product, exchange,
            output_product, store_rows, recompute)


# --- delta_i = dout_i . out_i, before the backward kernels ------------------------------------

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
