"""Not kept: dq's shares added atomically (red.global.add.v4.f32).
H200 2026-12-01: fwd 1.03x, fwd+bwd 0.97x SDPA float32 at [16,12,1024,64] (tools/dev/run.py)

v5's dk/dv kernel with one change: each (query tile, key tile) pair's share of dq, dS K, is
added into dq where v5 stores it for the sum kernel. dq is zeroed in the delta kernel's
pass; then every block adds its shares, 4 floats an instruction (one red.global.add.v4.f32,
a reduction the memory system performs: no value comes back, so the thread does not wait for
it). No shares in memory, no second pass over them, no sum kernel (the flash-attention-2
way); yet in the run above it is not faster than v5 (0.97x against 0.99x; it was 1-3%
faster in earlier runs, docs/perf.md). Not kept either way: the shares of a query row
land in whatever order the blocks of its key tiles finish, and float addition is not
associative, so dq's last bits (and a training step's) vary from run to run. The product
keeps v5's fixed order, reproducible to the bit. The forward is v3's.
"""
import math

import numpy as np
from numba import cuda, float32

from flash_tiles import (Tile, block_tile, delta, fast_exp, launch_bounds,
                         tile_constants, tile_functions)
from instructions import add4
from nanoandrea.kernels.attention import attention_forward
from nanoandrea.kernels.launch import (SIMULATOR, STATIC_SHARED_BYTES, blocks, inlined,
                                      kernel_factory, launch)
from nanoandrea.kernels.reduce import warp_barrier
from nanoandrea.kernels.sharedmem import dynamic_shared_floats, shared_tile
from nanoandrea.kernels.vector import load4

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


_kernels = {}


def forward(out, lse, q, k, v):
    attention_forward(out, lse, q, k, v, kernel="fast")


def backward(dq, dk, dv, dout, q, k, v, out, lse):
    B, H, T, D = q.shape
    if D not in _kernels:
        _kernels[D] = make_dkdv_kernel(D, TILES[D])
    kernel = _kernels[D]
    row_delta = delta(dout, out, zeroed=dq)                     # (dq = 0 in the same pass)
    launch(kernel, (B * H, blocks(T, kernel.rows)), kernel.threads, dk, dv, dq, dout, q, k, v,
           lse, row_delta, np.float32(1 / math.sqrt(D)), shared_bytes=kernel.shared_bytes)
