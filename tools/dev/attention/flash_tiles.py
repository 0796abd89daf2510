"""What the flash-style versions (v4, v6, v7) take beside the package's tile toolkit
(nanoandrea/kernels/attention_tiles.py: Tile, the register-blocked products, stage):

    tile_functions  the package's, and `recompute`: what a backward kernel computes again for a
                    pair of tiles (S = X Y^T and dP = U W^T)
    make_stage      the package's stage with a store of one's own (v7's split into TF32 parts)
    block_tile      (b, h, first row) of a block that takes one tile of rows
    delta           delta_i = dout_i . out_i, a warp per DELTA_ROWS rows, zeroing dq in the
                    same pass where its shares are added atomically (v6)
"""
import math

import numpy as np
from numba import cuda, float32, uint64

from nanoandrea.kernels.attention_tiles import (Tile, fast_exp, launch_bounds,  # noqa: F401
                                                padded)
from nanoandrea.kernels.attention_tiles import tile_functions as package_tile_functions
from nanoandrea.kernels.launch import SIMULATOR, blocks, inlined, launch
from nanoandrea.kernels.reduce import WARP, warp_sum
from nanoandrea.kernels.vector import load4, store4

NEG_INF = float32(-np.inf)
LOG2E = float32(1.0 / math.log(2.0))
LN2 = float32(math.log(2.0))


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


def tile_functions(D, ROWS, COLS, TM, TN, SCORE_STEPS=1):
    """The package's tile_functions (its docstring says where each thread's values sit), and
    recompute(s, x, y, dp, u, w): s = x y^T, dp = u w^T."""
    functions = package_tile_functions(D, ROWS, COLS, TM, TN, SCORE_STEPS)
    scores_product = functions[4]

    @inlined
    def recompute(s, x, y, dp, u, w):
        for i in range(TM):
            for j in range(TN):
                s[i, j] = float32(0.0)
                dp[i, j] = float32(0.0)
        scores_product(s, x, y)
        scores_product(dp, u, w)

    return (*functions, recompute)


def make_stage(D, THREADS, put=store4):
    """(stage, R_STEP): the package's stage (16-byte loads, consecutive threads on consecutive
    chunks of a row), each 4 floats stored by put(tile, (r, d), x0, x1, x2, x3)."""
    CHUNKS = D // 4                     # 4-float chunks of a row; a pass copies R_STEP rows,
    C_STEP = min(CHUNKS, THREADS)       # C_STEP chunks of each per thread step
    R_STEP = THREADS // C_STEP
    assert CHUNKS % C_STEP == 0, (D, THREADS)

    @inlined
    def stage(tile, x, row0, n_rows, T, scale):
        # tile[r, d] = x[row0 + r, d] * scale for r < n_rows, zeros past T (uint64 indices: a
        # signed index makes Numba add a negative-index wraparound)
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
