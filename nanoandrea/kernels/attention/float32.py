"""Causal attention on the CUDA cores in float32: flash-attention-2 tiles for heads of 16, 32 and 64.

The family's function (attention/reference.py: the math, the arguments, the dropout), by fast
kernels with D a compile-time constant, computed like a register-blocked SGEMM
(tiles.tile_functions): a block takes a tile of query rows, stages it in shared memory and
walks the key tiles up to the diagonal. Per key tile S = Q K^T is a small matrix product in
which each thread owns a patch of S in registers, its operands read from shared memory 16
bytes at a time; the softmax is online (running row max and sum); P goes through shared memory
and O += P V is a second product. Backward: a dk/dv kernel per key tile walks the query tiles,
recomputes P from lse, and also makes dq's share of each (query tile, key tile) pair, dS K,
which attention_dq_sum_kernel adds up in a fixed order: S and dP are computed once for all
three gradients, and dq is reproducible to the bit. Grid (B*H, row tiles), the heaviest row
tiles (most keys) launched first. delta comes first (attention_delta4_kernel): a warp per
DELTA_ROWS rows. tools/dev/attention/ v1-v7 hold the versions on the way here (and those not
kept: a dq kernel of its own, dq's shares added atomically, the forward on the tensor cores),
each timed.
"""
import math

import numpy as np
from numba import cuda, float32

from ..ptx.sharedmem import dynamic_shared_floats, shared_tile
from ..ptx.vector import aligned16, load4, store4
from ..ptx.warp import WARP, warp_barrier, warp_sum
from ..runtime.device import SIMULATOR
from ..runtime.launch import (STATIC_SHARED_BYTES, blocks, check, check_float32,
                              check_float32_rows, elementwise_grid, inlined, kernel_factory,
                              launch)
from ..runtime.memory import scratch
from .reference import check_attention, dropout_arguments, dropout_factor, no_dropout
from .tiles import (NEG_INF, Tile, block_rows, fast_exp, labelled, launch_bounds, padded,
                    tile_functions)

HEAD_SIZES = (16, 32, 64)


# --- fast kernels: D known at compile time, flash-attention-2 tiles ------------------------

@kernel_factory
def forward_kernel(D, tile, dropout):
    """The fast forward for head size D, one Tile, with dropout compiled in or not."""
    ROWS, COLS, TM, TN = tile[:4]
    (thread_position, row_of, dim_of, stage, scores_product, exchange,
     output_product, _) = tile_functions(D, ROWS, COLS, TM, TN, tile.score_steps,
                                         tile.wide_staging)
    factor = dropout_factor if dropout else no_dropout
    THREADS_M, THREADS_N = ROWS // TM, COLS // TN
    TD, D_ROW, P_ROW = D // THREADS_N, padded(D), padded(ROWS)

    @cuda.jit(**launch_bounds(THREADS_M * THREADS_N, tile.blocks_per_sm))
    def attention_forward_kernel(out, lse, q, k, v, scale, seed, site, threshold, keep,
                                 rows_per_block):
        # out[B,H,T,D], lse[B,H,T] from q, k, v [B,H,T,D]; grid (B*H, T/rows_per_block), block
        # THREADS. Per tile of ROWS queries: for each tile of COLS keys up to the diagonal,
        #   S = Q K^T / sqrt(D)     [ROWS, COLS], each thread TM x TN of it in registers
        #   m_new = max(m, rowmax S), P = exp(S - m_new)          (online softmax)
        #   O = O exp(m - m_new) + (P*G) V   [ROWS, D], each thread TM x TD of it
        # and at the end out = O / l, lse = m + log l, l the running sum of P (before dropout).
        q_tile = cuda.shared.array((ROWS, D_ROW), float32)  # q_tile[r, d] = q[row_base+r, d]/sqrt(D)
        k_tile = cuda.shared.array((COLS, D_ROW), float32)  # k_tile[c, d] = k[j0 + c, d]
        v_tile = cuda.shared.array((COLS, D_ROW), float32)  # v_tile[c, d] = v[j0 + c, d]
        p_t = cuda.shared.array((COLS, P_ROW), float32)     # p_t[c, r] = P[r, c] G[r, c]
        partial = cuda.shared.array((ROWS, THREADS_N), float32)  # per-thread row max, row sum
        s = cuda.local.array((TM, TN), float32)
        o = cuda.local.array((TM, TD), float32)
        m = cuda.local.array(TM, float32)                    # running row max (same in all
        l = cuda.local.array(TM, float32)                    # THREADS_N threads), this thread's
        B, H, T, _ = q.shape                                 # part of the running row sum
        b, h, row_start, row_end = block_rows(H, T, rows_per_block, True)
        ty, tx = thread_position()
        for row_base in range(row_start, row_end, ROWS):
            stage(q_tile, q[b, h], row_base, ROWS, T, scale)
            for i in range(TM):
                m[i] = NEG_INF
                l[i] = float32(0.0)
                for j in range(TD):
                    o[i, j] = float32(0.0)
            keys_end = min(row_end, row_base + ROWS)         # the last row here sees keys < this
            for j0 in range(0, keys_end, COLS):
                stage(k_tile, k[b, h], j0, COLS, T, float32(1.0))
                stage(v_tile, v[b, h], j0, COLS, T, float32(1.0))
                cuda.syncthreads()
                for i in range(TM):
                    for j in range(TN):
                        s[i, j] = float32(0.0)
                scores_product(s, q_tile, k_tile)
                for i in range(TM):                          # causal mask, this thread's row max
                    row = row_base + row_of(ty, i)
                    row_max = NEG_INF
                    for j in range(TN):
                        if j0 + tx + j * THREADS_N > row:
                            s[i, j] = NEG_INF
                        row_max = max(row_max, s[i, j])
                    partial[row_of(ty, i), tx] = row_max
                warp_barrier()                               # (a row's threads: one warp)
                for i in range(TM):
                    r = row_of(ty, i)
                    m_new = m[i]                             # finite after the first key tile:
                    for t in range(THREADS_N):               # key j0 = 0 is never masked
                        m_new = max(m_new, partial[r, t])
                    correction = fast_exp(m[i] - m_new)      # exp(-inf) = 0 on the first tile
                    m[i] = m_new
                    l[i] *= correction
                    for j in range(TD):
                        o[i, j] *= correction
                    for j in range(TN):                      # s becomes P G
                        p = fast_exp(s[i, j] - m_new)        # exp(-inf) = 0 for masked keys
                        l[i] += p                            # the normaliser: before dropout
                        s[i, j] = p * factor(seed, site, threshold, keep, b, h,
                                             row_base + r, j0 + tx + j * THREADS_N, H, T)
                exchange(p_t, s)
                warp_barrier()                               # (a thread reads its rows of P)
                output_product(o, p_t, v_tile)
                cuda.syncthreads()                           # before the next tiles are staged
            for i in range(TM):                              # l: the sum of the THREADS_N parts
                partial[row_of(ty, i), tx] = l[i]
            warp_barrier()
            for i in range(TM):
                r = row_of(ty, i)
                row_sum = float32(0.0)
                for t in range(THREADS_N):
                    row_sum += partial[r, t]
                row = row_base + r
                if row < row_end:
                    inv_l = float32(1.0) / row_sum
                    for j in range(TD):
                        out[b, h, row, dim_of(tx, j)] = o[i, j] * inv_l
                    if tx == 0:
                        lse[b, h, row] = m[i] + math.log(row_sum)
            cuda.syncthreads()                               # before q_tile, partial are reused

    return labelled(attention_forward_kernel, THREADS_M * THREADS_N, tile)


@kernel_factory
def dkdv_kernel(D, tile, dropout):
    """The fast backward for head size D, one Tile (rows: keys, cols: queries, rows a multiple
    of cols): dk, dv, and dq's shares for attention_dq_sum_kernel. Tiles of more than 48 KB in
    all live in dynamic shared memory (sharedmem.py)."""
    ROWS, COLS, TM, TN = tile[:4]
    (thread_position, row_of, dim_of, stage, scores_product, exchange,
     output_product, store_rows) = tile_functions(D, ROWS, COLS, TM, TN, tile.score_steps,
                                                  tile.wide_staging)
    factor = dropout_factor if dropout else no_dropout
    THREADS_M, THREADS_N = ROWS // TM, COLS // TN
    THREADS = THREADS_M * THREADS_N
    TD, D_ROW, X_ROW = D // THREADS_N, padded(D), padded(ROWS)
    assert THREADS >= COLS and ROWS % COLS == 0, ("a thread per query of a tile", tile)
    RATIO = ROWS // COLS
    # dq's share, dS K [COLS, D] summed over the ROWS keys: the same threads on a grid of
    # COLS/TM query rows (TM each) by the rest (a TM x TD_Q tile each)
    Q_THREADS_M = COLS // TM
    Q_TN = ROWS // (THREADS // Q_THREADS_M)
    (q_position, q_row_of, q_dim_of, _, _, _, q_output_product, _) = tile_functions(
        D, COLS, ROWS, TM, Q_TN, VECTOR=tile.wide_staging)
    TD_Q, K_ROW = D // (ROWS // Q_TN), padded(COLS)
    floats = 2 * ROWS * D_ROW + 2 * COLS * D_ROW + 2 * COLS * X_ROW + 2 * COLS
    # dynamic shared memory past 48 KB, and for key tiles of several query tiles (their keys_t
    # lies over q and dout: too big for P G's place)
    DYNAMIC = 4 * floats > STATIC_SHARED_BYTES or RATIO > 1

    if DYNAMIC:     # one flat array: k, v, q, dout, P G, dS, the row statistics; dS keys-major
        @inlined     # (dq's product) over q and dout
        def shared_tiles():
            buffer = dynamic_shared_floats()
            at = 0
            k_tile = shared_tile(buffer, at, ROWS, D_ROW)
            v_tile = shared_tile(buffer, at + ROWS * D_ROW, ROWS, D_ROW)
            at += 2 * ROWS * D_ROW
            q_tile = shared_tile(buffer, at, COLS, D_ROW)
            dout_tile = shared_tile(buffer, at + COLS * D_ROW, COLS, D_ROW)
            keys_t = shared_tile(buffer, at, ROWS, K_ROW)   # (2 COLS D_ROW >= ROWS K_ROW)
            at += 2 * COLS * D_ROW
            pg_t = shared_tile(buffer, at, COLS, X_ROW)
            ds_t = shared_tile(buffer, at + COLS * X_ROW, COLS, X_ROW)
            stats = shared_tile(buffer, at + 2 * COLS * X_ROW, 2, COLS)
            return k_tile, v_tile, q_tile, dout_tile, pg_t, ds_t, stats, keys_t
        assert 2 * COLS * D_ROW >= ROWS * K_ROW, tile
    else:
        @inlined
        def shared_tiles():
            k_tile = cuda.shared.array((ROWS, D_ROW), float32)
            v_tile = cuda.shared.array((ROWS, D_ROW), float32)
            q_tile = cuda.shared.array((COLS, D_ROW), float32)
            dout_tile = cuda.shared.array((COLS, D_ROW), float32)
            pg_t = cuda.shared.array((COLS, X_ROW), float32)
            ds_t = cuda.shared.array((COLS, X_ROW), float32)
            stats = cuda.shared.array((2, COLS), float32)
            return k_tile, v_tile, q_tile, dout_tile, pg_t, ds_t, stats, pg_t

    @inlined
    def keys_major(tile, ds_t):
        # tile[r, c] = ds_t[c, r] at this thread's TM x TN places (r = row_of(ty, i) a key,
        # c = tx + j*THREADS_N a query): dS keys down, queries across, so that output_product
        # sums it over the keys. The thread reads back what it wrote to ds_t itself (16 bytes
        # per run of 4 keys), so dS need not stay in registers through the dk, dv products.
        ty, tx = thread_position()
        for j in range(TN):
            c = tx + j * THREADS_N
            for a in range(TM // 4):
                x = load4(ds_t, (c, row_of(ty, 4 * a)))
                for u in range(4):
                    tile[row_of(ty, 4 * a + u), c] = x[u]

    @inlined
    def store_dq_share(dq_shares, acc, b, h, row0, ty, tx):
        # dq_shares[b, h, row0 + q_row_of(ty, i), q_dim_of(tx, j)] = acc[i, j], 16 bytes at a
        # time ((ty, tx): the thread's place on dq's grid, q_position)
        for i in range(TM):
            row = row0 + q_row_of(ty, i)
            for j in range(0, TD_Q, 4):
                store4(dq_shares, (b, h, row, q_dim_of(tx, j)), acc[i, j], acc[i, j + 1],
                       acc[i, j + 2], acc[i, j + 3])

    @cuda.jit(**launch_bounds(THREADS, tile.blocks_per_sm))
    def attention_dkdv_kernel(dk, dv, dq_shares, dout, q, k, v, lse, delta, scale, seed, site,
                              threshold, keep, rows_per_block, accumulate):
        # dk, dv [B,H,T,D] (+)= gradients; grid (B*H, T/rows_per_block), block THREADS. Per tile
        # of ROWS keys, for each tile of COLS queries from the tile's first key on,
        #   S^T = K Q^T / sqrt(D), dP^T = V dout^T   [ROWS, COLS], TM x TN of each per thread
        #   dv_acc += (P G)^T dout,  dk_acc += dS^T Q / sqrt(D)   [ROWS, D], TM x TD each
        # and dq's share from this pair of tiles, dS K [COLS, D] (unscaled), into
        # dq_shares[b, h, pair * COLS:, :], pair = share_pair(query tile, key tile, RATIO).
        # Shared: k_tile[r, d] = k[key_base + r, d], v_tile likewise; q_tile[c, d] = q[i0 + c,
        # d] / sqrt(D), dout_tile likewise; pg_t[c, r] = (P G)[i0 + c, key_base + r], ds_t dS
        # likewise; stats = lse and delta of the queries; keys_t[r, c] = dS, keys down.
        k_tile, v_tile, q_tile, dout_tile, pg_t, ds_t, stats, keys_t = shared_tiles()
        s = cuda.local.array((TM, TN), float32)
        dp = cuda.local.array((TM, TN), float32)
        dk_acc = cuda.local.array((TM, TD), float32)
        dv_acc = cuda.local.array((TM, TD), float32)
        dq_acc = cuda.local.array((TM, TD_Q), float32)
        B, H, T, _ = q.shape
        b, h, row_start, row_end = block_rows(H, T, rows_per_block, False)
        ty, tx = thread_position()
        q_ty, q_tx = q_position()
        tid = cuda.threadIdx.x
        for key_base in range(row_start, row_end, ROWS):
            stage(k_tile, k[b, h], key_base, ROWS, T, float32(1.0))
            stage(v_tile, v[b, h], key_base, ROWS, T, float32(1.0))
            for i in range(TM):
                for j in range(TD):
                    dk_acc[i, j] = float32(0.0)
                    dv_acc[i, j] = float32(0.0)
            for i0 in range(key_base, T, COLS):              # queries i >= key_base only
                stage(q_tile, q[b, h], i0, COLS, T, scale)   # (scaled: dk needs the 1/sqrt(D) too)
                stage(dout_tile, dout[b, h], i0, COLS, T, float32(1.0))
                if tid < COLS:
                    query = i0 + tid
                    stats[0, tid] = lse[b, h, query] if query < T else float32(0.0)
                    stats[1, tid] = delta[b, h, query] if query < T else float32(0.0)
                cuda.syncthreads()
                for i in range(TM):                          # S^T = K Q^T, dP^T = V dout^T
                    for j in range(TN):
                        s[i, j] = float32(0.0)
                        dp[i, j] = float32(0.0)
                scores_product(s, k_tile, q_tile)
                scores_product(dp, v_tile, dout_tile)
                for j in range(TN):                          # s becomes (P G)^T, dp dS^T
                    query = i0 + tx + j * THREADS_N
                    query_lse = stats[0, tx + j * THREADS_N]
                    query_delta = stats[1, tx + j * THREADS_N]
                    for i in range(TM):
                        key = key_base + row_of(ty, i)
                        pg = float32(0.0)
                        ds = float32(0.0)
                        if key <= query and query < T:
                            p = fast_exp(s[i, j] - query_lse)
                            g = factor(seed, site, threshold, keep, b, h, query, key, H, T)
                            ds = p * (g * dp[i, j] - query_delta)
                            pg = p * g
                        s[i, j] = pg
                        dp[i, j] = ds
                exchange(pg_t, s)
                exchange(ds_t, dp)
                warp_barrier()                               # (a thread reads its keys' rows)
                output_product(dv_acc, pg_t, dout_tile)
                output_product(dk_acc, ds_t, q_tile)
                cuda.syncthreads()                           # before the next tiles are staged
                keys_major(keys_t, ds_t)                     # dq's share: dS K, dS keys-major
                for i in range(TM):                          # in keys_t (read by all now)
                    for j in range(TD_Q):
                        dq_acc[i, j] = float32(0.0)
                cuda.syncthreads()
                q_output_product(dq_acc, keys_t, k_tile)
                pair = share_pair_device(i0 // COLS, key_base // ROWS, RATIO)
                store_dq_share(dq_shares, dq_acc, b, h, pair * COLS, q_ty, q_tx)
                if DYNAMIC:     # keys_t lies over q and dout, staged next
                    cuda.syncthreads()
                # (else keys_t is pg_t, written again only after the next tiles' barrier)
            cuda.syncthreads()      # the last dq product has read k_tile: the next may come
            store_rows(dk, dk_acc, b, h, key_base, row_end, float32(1.0), accumulate, ty, tx)
            store_rows(dv, dv_acc, b, h, key_base, row_end, float32(1.0), accumulate, ty, tx)

    return labelled(attention_dkdv_kernel, THREADS, tile, 4 * floats if DYNAMIC else 0)


def share_pair(qt, kt, ratio):
    """Where dq's share of (query tile qt, key tile kt) goes among a head's packed pairs, key
    tiles `ratio` query tiles long: the pairs of query tile q are kt = 0 .. q // ratio, in
    order of q, then of kt. (ratio 1: qt (qt + 1) / 2 + kt.) share_pair(n, 0, ratio) is the
    number of pairs of n query tiles."""
    whole = qt // ratio                 # sum over q < qt of (q // ratio + 1)
    return qt + ratio * whole * (whole - 1) // 2 + whole * (qt - whole * ratio) + kt


share_pair_device = inlined(share_pair)


@cuda.jit
def attention_dq_sum_kernel(dq, dq_shares, scale, tile, ratio, accumulate):
    # dq[B,H,T,D] (+)= scale * the sum of query i's shares, i = qt * tile + r:
    #   dq_shares[b, h, share_pair(qt, kt, ratio) * tile + r, :] over key tiles kt = 0 ..
    # qt // ratio, in that order (the dk/dv kernel wrote them; its key tiles are `ratio`
    # query tiles of `tile` rows). 4 consecutive d of a row at a time: 16-byte loads of the
    # shares (aligned: attention_backward allocates them), two shares' loads in flight before
    # either is added; grid-stride.
    B, H, T, D = dq.shape
    for n in range(cuda.grid(1), B * H * T * (D // 4), cuda.gridsize(1)):
        d = (n % (D // 4)) * 4
        row = n // (D // 4)                     # (b * H + h) * T + i
        i = row % T
        b, h = row // (T * H), (row // T) % H
        qt = i // tile
        first = share_pair_device(qt, 0, ratio) * tile + i - qt * tile
        last = qt // ratio                      # the last key tile
        t0 = t1 = t2 = t3 = float32(0.0)
        for kt in range(0, last, 2):
            x = load4(dq_shares, (b, h, first + kt * tile, d))
            y = load4(dq_shares, (b, h, first + (kt + 1) * tile, d))
            t0, t1, t2, t3 = t0 + x[0], t1 + x[1], t2 + x[2], t3 + x[3]
            t0, t1, t2, t3 = t0 + y[0], t1 + y[1], t2 + y[2], t3 + y[3]
        if last % 2 == 0:                   # the last share of an odd count
            x = load4(dq_shares, (b, h, first + last * tile, d))
            t0, t1, t2, t3 = t0 + x[0], t1 + x[1], t2 + x[2], t3 + x[3]
        t0, t1, t2, t3 = t0 * scale, t1 * scale, t2 * scale, t3 * scale
        if accumulate:
            t0, t1 = t0 + dq[b, h, i, d], t1 + dq[b, h, i, d + 1]
            t2, t3 = t2 + dq[b, h, i, d + 2], t3 + dq[b, h, i, d + 3]
        dq[b, h, i, d] = t0
        dq[b, h, i, d + 1] = t1
        dq[b, h, i, d + 2] = t2
        dq[b, h, i, d + 3] = t3


DELTA_WARPS = 2 if SIMULATOR else 4     # warps per block,
DELTA_ROWS = 4                          # and rows per warp (their loads all in flight at once)


@cuda.jit
def attention_delta4_kernel(delta, dout, out):
    # delta[B,H,T] = dout[B,H,T,D] . out[B,H,T,D] along D, D % 4 == 0, D <= 4 * WARP, rows
    # 16-byte aligned (any strides: out may be a view of the heads' concat). grid (T /
    # (DELTA_WARPS * DELTA_ROWS), B*H), block (WARP, DELTA_WARPS): a warp takes DELTA_ROWS
    # consecutive rows t of head blockIdx.y, lane l holds d = 4l..4l+3 of each (lanes past D/4
    # count zero), so a row is one coalesced 16-byte load per array and lane; each row's sum
    # then meets in warp_sum. All of a lane's loads are in flight at once: no `if` per row (a
    # row past T is row T-1 again, not stored), every load before the first product.
    _, H, T, D = out.shape
    b = cuda.blockIdx.y // H
    h = cuda.blockIdx.y - b * H
    lane = cuda.threadIdx.x
    d = 4 * lane
    first = (cuda.blockIdx.x * cuda.blockDim.y + cuda.threadIdx.y) * DELTA_ROWS
    g = cuda.local.array((DELTA_ROWS, 4), float32)       # dout, out of this lane's 4 d
    o = cuda.local.array((DELTA_ROWS, 4), float32)       # in each row
    partial = cuda.local.array(DELTA_ROWS, float32)      # and their dot product
    for r in range(DELTA_ROWS):
        partial[r] = float32(0.0)
    if d < D:
        for r in range(DELTA_ROWS):                      # every load first, ...
            t = min(first + r, T - 1)
            g[r, 0], g[r, 1], g[r, 2], g[r, 3] = load4(dout, (b, h, t, d))
            o[r, 0], o[r, 1], o[r, 2], o[r, 3] = load4(out, (b, h, t, d))
        for r in range(DELTA_ROWS):                      # ... then the products
            for i in range(4):
                partial[r] += g[r, i] * o[r, i]
    for r in range(DELTA_ROWS):
        total = warp_sum(partial[r])                     # every lane of the warp calls it
        if lane == 0 and first + r < T:
            delta[b, h, first + r] = total


# The fast kernels' tiles per head size, (forward, dk/dv), picked by timing on the H200
# (docs/perf.md). The forward at D=64 is bounded at 4 blocks a multiprocessor (128 registers);
# at D=32 it stages 4 bytes at a time (96 registers, against 150 with 16-byte loads). Static
# shared memory is at most 48 KB a block: the forward at D=64 takes 44.5 KB; dk/dv at D=64
# takes 64-key tiles of two 32-query tiles in 68 KB of dynamic shared memory, 3 blocks of 128
# threads a multiprocessor. At D=16 (andrea-12m's width in 24 heads) a thread's 4 head
# dimensions make a 16-column tile forward, and dk/dv takes one warp a block (untuned). In the simulator the tiles are tiny (4 x 4,
# 1 x 2 threads), so T=7 crosses two tiles.
GPU_TILES = {64: (Tile(64, 32, blocks_per_sm=4), Tile(64, 32, blocks_per_sm=3, score_steps=2)),
             32: (Tile(64, 32, wide_staging=False), Tile(32, 32, blocks_per_sm=6, score_steps=1)),
             16: (Tile(64, 16), Tile(32, 32, 4, 8, score_steps=1))}
SIMULATOR_TILES = {D: (Tile(4, 4, 4, 2), Tile(4, 4, 4, 1, score_steps=1)) for D in HEAD_SIZES}
TILES = SIMULATOR_TILES if SIMULATOR else GPU_TILES


def attention_forward_flash(out, lse, q, k, v, dropout_p=0.0, seed=None, site=0,
                            rows_per_block=None):
    """out, lse by the flash forward: D in HEAD_SIZES, 16-byte aligned rows. rows_per_block:
    query rows per thread block, walked in tiles of the kernel's rows (default one tile: the
    most blocks)."""
    check_float32(lse=lse)
    check_float32_rows(out=out, q=q, k=k, v=v)
    B, H, T, D = check_attention(q, k, v, out=out, lse=lse)
    check(takes(D, (out, q, k, v)), f"attention: the float32 flash kernels take D in "
          f"{HEAD_SIZES} and 16-byte aligned rows, got D={D}")
    forward = forward_kernel(D, TILES[D][0], dropout_p > 0)
    rows = min(T, rows_per_block or forward.tile.rows)
    launch(forward, (B * H, blocks(T, rows)), forward.threads, out, lse, q, k, v,
           np.float32(1.0 / math.sqrt(D)), *dropout_arguments(dropout_p, seed, site), rows)


def attention_backward_flash(dq, dk, dv, delta, dout, q, k, v, out, lse, accumulate=False,
                             dropout_p=0.0, seed=None, site=0, rows_per_block=None):
    """dq, dk, dv (+)= the gradients by the flash kernels; delta is scratch. rows_per_block:
    key rows per dk/dv block, rounded up to whole tiles."""
    check_float32(delta=delta, lse=lse)
    check_float32_rows(dq=dq, dk=dk, dv=dv, dout=dout, q=q, k=k, v=v, out=out)
    B, H, T, D = check_attention(q, k, v, dq=dq, dk=dk, dv=dv, dout=dout, out=out, lse=lse,
                                 delta=delta)
    check(takes(D, (dq, dk, dv, dout, q, k, v, out)), f"attention: the float32 flash kernels "
          f"take D in {HEAD_SIZES} and 16-byte aligned rows, got D={D}")
    scale = np.float32(1.0 / math.sqrt(D))
    drop = dropout_arguments(dropout_p, seed, site)
    attention_delta(delta, dout, out)
    backward = dkdv_kernel(D, TILES[D][1], dropout_p > 0)
    key_tile, query_tile = backward.tile.rows, backward.tile.cols
    key_rows = min(T, blocks(min(T, rows_per_block or key_tile), key_tile) * key_tile)
    ratio = key_tile // query_tile
    pairs = share_pair(blocks(T, query_tile), 0, ratio)     # one share per pair of tiles
    shares = scratch("attention dq shares", (B, H, pairs * query_tile, D))
    launch(backward, (B * H, blocks(T, key_rows)), backward.threads, dk, dv, shares, dout, q,
           k, v, lse, delta, scale, *drop, key_rows, accumulate,
           shared_bytes=backward.shared_bytes)
    launch(attention_dq_sum_kernel, *elementwise_grid(B * H * T * D // 4), dq, shares, scale,
           query_tile, ratio, accumulate)


def takes(D, arrays):
    """Whether the flash kernels take heads of D with these arrays: D in HEAD_SIZES, every
    array's rows 16-byte aligned (what split_heads makes)."""
    return D in HEAD_SIZES and all(aligned16(x) for x in arrays)


def attention_delta(delta, dout, out):
    """delta[B,H,T] = dout . out along D (rows 16-byte aligned, D % 4 == 0, D <= 4 * WARP)."""
    B, H, T, D = out.shape
    launch(attention_delta4_kernel, (blocks(T, DELTA_WARPS * DELTA_ROWS), B * H),
           (WARP, DELTA_WARPS), delta, dout, out)
