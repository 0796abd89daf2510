"""Backward in v3's tiles: a dq kernel beside the dk/dv kernel.
H200 2026-12-01: fwd 1.03x, fwd+bwd 0.68x SDPA float32 at [16,12,1024,64] (tools/dev/run.py)

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

import numpy as np
from numba import cuda, float32

from flash_tiles import (Tile, block_tile, delta, fast_exp, launch_bounds,
                         tile_constants, tile_functions)
from nanoandrea.kernels.attention import attention_forward
from nanoandrea.kernels.launch import SIMULATOR, blocks, kernel_factory, launch
from nanoandrea.kernels.reduce import warp_barrier

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


_kernels = {}


def forward(out, lse, q, k, v):
    attention_forward(out, lse, q, k, v, kernel="fast")


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
