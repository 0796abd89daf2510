"""Not kept: the scores' A in registers, each score wgmma reading only B from shared memory.
H100 2026-12-07: fwd+bwd 0.51x SDPA bf16 at [16,12,1024,64] (fwd 0.44x)

Measured as the package's kernels then (tools/bench.py --only attention --precision bf16):
0.518 ms against v11's 0.466 at [16,12,1024,64]; at [64,12,256,32] 0.97x against v11's 1.09x.
Correct, and the same bits as the mma.sync kernels.

v11 (the package's kernels) with the scores' A, the block's own rows (Q and dO; K and V in
dk/dv), loaded into registers once, in the RS form that P's A already takes: a score wgmma
m64n64k16 then reads 2 KB of shared memory for its 32 cycles of tensor-core work, where it read
4 KB, all the 128 bytes a cycle a multiprocessor's shared memory gives. The own rows are no
longer staged. Registers (offline, sm_90a, D = 64): forward 124, dq 175 (at 2 blocks a
multiprocessor: at 3, ptxas serializes its wgmma for registers, C7512), dk/dv 218. Slower
than v11 in both shapes: shared memory's bandwidth is not what holds v11, and dq loses a block
a multiprocessor to the registers. Here it runs as the ladder calls it: float32 q, k, v, dout,
each call rounding them. Shared memory (`words`), rows and offsets are counted in words (a word:
32 bits, here a bf16 pair).
"""
import math

import numpy as np
from numba import cuda, float32, int32, uint32

from nanoandrea.kernels.ptx.asynccopy import commit_copies, copy16_async, wait_copies
from nanoandrea.kernels.ptx.mma import bf16_pair, store4_u32
from nanoandrea.kernels.ptx.sfu import exp2_fast
from nanoandrea.kernels.ptx.vector import flat, load2, load4, store2
from nanoandrea.kernels.ptx.warp import WARP, quad_max, quad_sum, warp_sum
from nanoandrea.kernels.ptx.wgmma import (ATOM_BYTES, K_MAJOR, MN_MAJOR, REGISTERS, atom_start,
                                          descriptor_high, dynamic_shared_words, fence_for,
                                          fence_proxy_async, shared_descriptor, wait_for,
                                          wgmma_by_descriptors, wgmma_commit)
from nanoandrea.kernels.runtime.launch import SIMULATOR, blocks, inlined, kernel_factory, launch

LOG2E = float32(1.0 / math.log(2.0))
NEG_INF = float32(-math.inf)
PRECISION = "bf16"

HEAD_SIZES = (32, 64)
ROWS = 64                           # a block's own rows: wgmma's M, one warpgroup
THREADS = 128
COLS = 16 if SIMULATOR else 64      # a streamed tile's rows: the score products' N
ROW_WORDS = 32                      # a staged row: 128 bytes, 8 chunks of 16 (D = 32: 4 used)
TILE_WORDS = COLS * ROW_WORDS       # one streamed tile
NT = COLS // 8                      # n8 column groups of the scores
S_ACC = COLS // 2                   # a thread's floats of the scores [64, COLS]
STEPS = COLS // 16                  # k16 steps of a product over a streamed tile's rows
FRAG_WORDS = 4 * STEPS              # a thread's A fragments of scores [64, COLS] in bf16
ROW_FRAG_WORDS = 4 * 4              # ... of the block's own rows [64, D], D <= 64: the scores' A
TWO_TILES_ROWS = 2 * COLS           # dk/dv's -lse and delta of two stages of query tiles
LN2 = float32(math.log(2.0))
WAIT_ALL = wait_copies(0)
# Descriptors (kernels/ptx/wgmma.py): a start-address field in 16-byte units | a layout's bits. A
# k16 step along a row is 32 bytes on (2 units), one down a tile's rows 16 rows of 128 bytes
# (128 units); the two stages of streamed tiles are STAGE_UNITS apart
MN_LAYOUT = MN_MAJOR(4 * TILE_WORDS)    # (one block of 64 columns: D <= 64; LBO unused)
K_BITS, MN_BITS = descriptor_high(K_MAJOR), descriptor_high(MN_LAYOUT)
ALONG, DOWN = 2, 128
TILE_UNITS, STAGE_UNITS = TILE_WORDS // 4, 2 * TILE_WORDS // 4
multiply_scores = wgmma_by_descriptors(COLS, REGISTERS, K_MAJOR)
first_scores = wgmma_by_descriptors(COLS, REGISTERS, K_MAJOR, scale_d=0)  # (D = A B)


def shared_bytes(streams):
    """The dynamic shared memory of a kernel with `streams` streamed matrices two stages deep,
    from the first 1024-byte boundary on (atom_start)."""
    return 4 * 2 * streams * TILE_WORDS + ATOM_BYTES


def tile_functions(D):
    """The inlined device functions of the kernels for heads of D (32 or 64)."""
    KD = D // 16                        # k16 steps along D: the score products'
    O_ACC = D // 2                      # a thread's floats of a [64, D] product
    DN = D // 8                         # its n8 column groups
    G_WORDS, CHUNKS = D // 2, D // 8    # a row of x in device memory: words, 16-byte chunks
    LOG_CHUNKS = CHUNKS.bit_length() - 1
    ROW_STEP = THREADS // CHUNKS        # rows between a thread's copies (a multiple of 8: each
                                        # copy's chunk is swizzled as the first's)
    multiply_rows = wgmma_by_descriptors(D, REGISTERS, MN_LAYOUT)

    @inlined
    def copy_start(bh, T, tid):
        # this thread's first copy of a matrix's rows: (its word in a staged matrix, its word
        # of x[bh] at row 0, its row): chunk tid % CHUNKS of row tid / CHUNKS
        row, chunk = int32(tid >> LOG_CHUNKS), int32(tid & (CHUNKS - 1))
        return (int32(row * ROW_WORDS + 4 * (chunk ^ (row & 7))),
                int32((bh * T + row) * G_WORDS + 4 * chunk), row)

    def copier(count):
        PASSES = -(-count // ROW_STEP)  # a thread's copies of `count` rows
        EXACT = count % ROW_STEP == 0

        @inlined
        def copy_rows(words, at, x, start, row0, T):
            # start copying x[bh, row0 : row0 + count] (x: the heads' bf16 pairs, flat; start:
            # copy_start's for bh) into words[at:] as swizzled rows of 128 bytes; zeros past T
            place, src, row = start
            rows_left = int32(T - row0)
            first = int32(src + row0 * G_WORDS)
            for r in range(PASSES):
                if EXACT or row + r * ROW_STEP < count:
                    inside = row + r * ROW_STEP < rows_left
                    copy16_async(words, (at + place + r * ROW_STEP * ROW_WORDS,), x,
                                 (uint32(first + r * ROW_STEP * G_WORDS) if inside
                                  else uint32(0),), inside)
        return copy_rows

    @inlined
    def zero(acc, count):
        for e in range(count):
            acc[e] = float32(0.0)

    @inlined
    def load_rows(frag, x, bh, wrow, T, lane):
        # frag = the A fragments of x[bh, wrow : wrow + 16] (the heads' bf16 pairs, flat; the
        # warp's 16 rows of the block's 64), 4 words a k16 step along D; zeros past row T
        g, t = lane >> 2, lane & 3
        for s in range(KD):
            for r in range(4):
                row = wrow + g + 8 * (r & 1)
                word = 8 * s + t + 4 * (r >> 1)
                frag[4 * s + r] = x[(bh * T + row) * G_WORDS + word] if row < T else uint32(0)

    @inlined
    def scores(acc, frag, words, b_desc):
        # acc = the rows frag holds [64, D] . those b_desc names [COLS, D]^T (a K-major
        # descriptor): issued, not waited for. The first step overwrites acc: it is never
        # zeroed by an instruction of its own (wgmma.py's wgmma_by_descriptors)
        first_scores(acc, frag[0], frag[1], frag[2], frag[3], words, b_desc)
        for kk in range(1, KD):
            multiply_scores(acc, frag[4 * kk], frag[4 * kk + 1], frag[4 * kk + 2],
                            frag[4 * kk + 3], words, b_desc + ALONG * kk)

    @inlined
    def fragments(frag, acc):
        # frag = acc's scores [64, COLS] rounded to bf16 as A fragments, 4 words a k16 step
        # (the module's doc: column groups 2s and 2s + 1 are step s)
        for s in range(STEPS):
            for r in range(4):
                frag[4 * s + r] = bf16_pair(acc[8 * s + 2 * r], acc[8 * s + 2 * r + 1])

    @inlined
    def rows_product(acc, frag, words, b_desc):
        # acc [64, D] += frag [64, COLS] . the rows b_desc names [COLS, D] (an MN-major
        # descriptor): issued, not waited for
        for s in range(STEPS):
            multiply_rows(acc, frag[4 * s], frag[4 * s + 1], frag[4 * s + 2], frag[4 * s + 3],
                          words, b_desc + DOWN * s)

    def masker(future):
        @inlined
        def masked(j, e, limit):
            # whether score acc[4j + e] is masked: a thread holds acc[4j + e] at (row g + 8 (e >>
            # 1), column 8 j + 2 t + (e & 1)) of its warp's 16 rows; limit = the lane's row g less
            # its column 2 t (less the tile's offsets), so that a score's column less its row is
            # a constant less limit. True where the column lies after the row (future: a key
            # after its query) or before it (a query before its key, dk/dv's S^T); 32-bit
            # compares. (The kernels read the scores through this, and never write -inf into
            # them: ptxas serializes a wgmma whose accumulators another instruction writes while
            # a wgmma is in flight, and the previous tile's last product is)
            ahead = int32(8 * j + (e & 1) - 8 * (e >> 1))
            return (ahead > limit) if future else (ahead < limit)
        return masked

    @inlined
    def store_rows(x, acc, factor0, factor1, accumulate, b, h, wrow, T, lane):
        # x[b, h, wrow + g (+ 8), :] (+)= acc [O_ACC] times factor0 (row g) or factor1 (g + 8):
        # two floats a store
        g, t = lane >> 2, lane & 3
        for j in range(DN):
            col = 8 * j + 2 * t
            for half in range(2):
                row = wrow + g + 8 * half
                factor = factor0 if half == 0 else factor1
                if row < T:
                    y0 = acc[4 * j + 2 * half] * factor
                    y1 = acc[4 * j + 2 * half + 1] * factor
                    if accumulate:
                        x0, x1 = load2(x, (b, h, row, col))
                        y0 += x0
                        y1 += x1
                    store2(x, (b, h, row, col), y0, y1)

    return dict(copy_start=copy_start, copy_tile=copier(COLS), load_rows=load_rows,
                zero=zero, scores=scores, fragments=fragments, rows_product=rows_product,
                future=masker(True), past=masker(False), store_rows=store_rows,
                O_ACC=O_ACC)


def bounds(blocks_per_sm):
    return {} if SIMULATOR else dict(launch_bounds=(THREADS, blocks_per_sm))


@inlined
def no_dropout(seed, site, threshold, keep, b, h, i, j, H, T):
    # the dropout factor G_ij of a kernel built without dropout: 1 (the hash is not compiled in)
    return float32(1.0)


@kernel_factory
def forward_kernel(D):
    """The forward for heads of D (no dropout)."""
    f = tile_functions(D)
    copy_start, copy_tile, load_rows = f["copy_start"], f["copy_tile"], f["load_rows"]
    zero, scores, fragments, rows_product = f["zero"], f["scores"], f["fragments"], f["rows_product"]
    future, store_rows, O_ACC = f["future"], f["store_rows"], f["O_ACC"]
    factor = no_dropout
    fence_s, wait_s = fence_for(), wait_for(S_ACC, O_ACC, FRAG_WORDS)
    fence_o, wait_o = fence_for(O_ACC, FRAG_WORDS), wait_for(O_ACC)

    @inlined
    def tile_step(i, diagonal, tiles, words, q_frag, descriptors, tiles_at, k, v, start, T,
                  s_acc, o_acc, p_frag, m0, m1, l0, l1, lane_rows, scale_log2, drop):
        # key tile i: S = Q K^T, the online softmax, O += P V (issued; waited for with the next
        # tile's S). diagonal (a constant): the tile crosses the diagonal, and its keys after a
        # query are masked. Returns the rows' new running max and sum. (Arguments in tuples:
        # a call of over 30 is made from a tuple, which Numba's inliner does not take)
        k_desc, v_desc = descriptors
        b, h, H, wrow, g, t = lane_rows
        seed, site, threshold, keep = drop
        n0 = i * COLS
        stage = i & 1
        WAIT_ALL()                              # tile i has landed, for every thread, and is
        fence_proxy_async()                     # visible to wgmma
        cuda.syncthreads()
        fence_s()
        scores(s_acc, q_frag, words, k_desc + stage * STAGE_UNITS)          # S = Q K^T
        wgmma_commit()
        wait_s(s_acc, o_acc, p_frag)            # S, and the last tile's P V: every warp is
        cuda.syncthreads()                      # done with its stage, tile i + 1 goes there
        if i + 1 < tiles:
            at = tiles_at + (stage ^ 1) * 2 * TILE_WORDS
            copy_tile(words, at, k, start, n0 + COLS, T)
            copy_tile(words, at + TILE_WORDS, v, start, n0 + COLS, T)
        commit_copies()
        limit = int32(wrow + g - n0 - 2 * t)
        max0 = max1 = NEG_INF                   # the rows' largest scores, unscaled (scale > 0)
        for j in range(NT):
            for e in range(4):
                x = NEG_INF if diagonal and future(j, e, limit) else s_acc[4 * j + e]
                if e < 2:
                    max0 = max(max0, x)
                else:
                    max1 = max(max1, x)
        new0 = max(m0, quad_max(max0) * scale_log2)
        new1 = max(m1, quad_max(max1) * scale_log2)
        shrink0, shrink1 = exp2_fast(m0 - new0), exp2_fast(m1 - new1)
        l0, l1 = l0 * shrink0, l1 * shrink1
        for j in range(O_ACC // 4):
            o_acc[4 * j] *= shrink0
            o_acc[4 * j + 1] *= shrink0
            o_acc[4 * j + 2] *= shrink1
            o_acc[4 * j + 3] *= shrink1
        for j in range(NT):
            key = n0 + 8 * j + 2 * t
            for e in range(4):
                query = wrow + g + 8 * (e >> 1)
                # (one FFMA and one MUFU a probability)
                p = exp2_fast(cuda.fma(s_acc[4 * j + e], scale_log2, -(new0 if e < 2 else new1)))
                if diagonal and future(j, e, limit):
                    p = float32(0.0)
                if e < 2:
                    l0 += p
                else:
                    l1 += p
                s_acc[4 * j + e] = p * factor(seed, site, threshold, keep, b, h, query,
                                              key + (e & 1), H, T)
        fragments(p_frag, s_acc)
        fence_o(o_acc, p_frag)
        rows_product(o_acc, p_frag, words, v_desc + stage * STAGE_UNITS)    # O += P V
        wgmma_commit()
        return new0, new1, l0, l1

    @cuda.jit(**bounds(4))
    def attention_forward_wgmma_kernel(out, lse, q_pairs, k_pairs, v_pairs, scale_log2, seed,
                                       site, threshold, keep):
        # q, k, v: rounded_heads' pairs [B,H,T,D/2]. grid (B*H, T/ROWS), the last rows (the most
        # keys) first; block THREADS; dynamic shared memory shared_bytes(2): two stages of a K
        # tile and a V tile. Scores in log2 units (S / sqrt(D) / ln 2)
        words = dynamic_shared_words()
        first = atom_start(words)
        s_acc = cuda.local.array(S_ACC, float32)
        o_acc = cuda.local.array(O_ACC, float32)
        q_frag = cuda.local.array(ROW_FRAG_WORDS, uint32)
        p_frag = cuda.local.array(FRAG_WORDS, uint32)
        q, k, v = flat(q_pairs), flat(k_pairs), flat(v_pairs)
        H, T = out.shape[1], out.shape[2]
        bh = cuda.blockIdx.x
        b, h = bh // H, bh % H
        row0 = (cuda.gridDim.y - 1 - cuda.blockIdx.y) * ROWS
        tid = cuda.threadIdx.x
        warp, lane = tid >> 5, tid & 31
        g, t = lane >> 2, lane & 3
        wrow = row0 + 16 * warp                 # the warp's rows; the lane's: wrow + g (+ 8)
        start = copy_start(bh, T, tid)
        tiles_at = first                        # stage s: a K tile, then a V tile
        copy_tile(words, tiles_at, k, start, 0, T)
        copy_tile(words, tiles_at + TILE_WORDS, v, start, 0, T)
        commit_copies()
        load_rows(q_frag, q, bh, wrow, T, lane)   # (the scores' A, in registers for the walk)
        field = shared_descriptor(words, tiles_at)
        k_desc, v_desc = field | K_BITS, (field + TILE_UNITS) | MN_BITS
        zero(o_acc, O_ACC)
        m0 = m1 = NEG_INF                       # each row's running max and sum (of this
        l0 = l1 = float32(0.0)                  # lane's columns: summed over the quad at the end)
        tiles = (min(row0 + ROWS, T) + COLS - 1) // COLS
        descriptors = (k_desc, v_desc)
        lane_rows, drop = (b, h, H, wrow, g, t), (seed, site, threshold, keep)
        past = row0 // COLS                     # the tiles before the diagonal's, then those
        for i in range(past):                   # crossing it
            m0, m1, l0, l1 = tile_step(i, False, tiles, words, q_frag, descriptors, tiles_at, k,
                                       v, start, T, s_acc, o_acc, p_frag, m0, m1, l0, l1,
                                       lane_rows, scale_log2, drop)
        for i in range(past, tiles):
            m0, m1, l0, l1 = tile_step(i, True, tiles, words, q_frag, descriptors, tiles_at, k,
                                       v, start, T, s_acc, o_acc, p_frag, m0, m1, l0, l1,
                                       lane_rows, scale_log2, drop)
        wait_o(o_acc)
        l0, l1 = quad_sum(l0), quad_sum(l1)
        store_rows(out, o_acc, float32(1.0) / l0, float32(1.0) / l1, False, b, h, wrow, T, lane)
        if t == 0:
            if wrow + g < T:
                lse[b, h, wrow + g] = (m0 + math.log2(l0)) * LN2
            if wrow + g + 8 < T:
                lse[b, h, wrow + g + 8] = (m1 + math.log2(l1)) * LN2

    return attention_forward_wgmma_kernel


@kernel_factory
def dq_kernel(D):
    """dq for heads of D: the forward's walk over the key tiles, P from lse."""
    f = tile_functions(D)
    copy_start, copy_tile, load_rows = f["copy_start"], f["copy_tile"], f["load_rows"]
    zero, scores, fragments, rows_product = f["zero"], f["scores"], f["fragments"], f["rows_product"]
    future, store_rows, O_ACC = f["future"], f["store_rows"], f["O_ACC"]
    factor = no_dropout
    fence_s, wait_s = fence_for(), wait_for(S_ACC, S_ACC, O_ACC, FRAG_WORDS)
    fence_q, wait_q = fence_for(O_ACC, FRAG_WORDS), wait_for(O_ACC)

    @inlined
    def tile_step(i, diagonal, tiles, words, own_frags, descriptors, tiles_at, k, v, start, T,
                  s_acc, dp_acc, dq_acc, ds_frag, rows, lane_rows, scale_log2, drop):
        # key tile i: S = Q K^T, dP = dO V^T, dS, dQ += dS K (issued; waited for with the next
        # tile's S). diagonal (a constant): the tile crosses the diagonal
        q_frag, dout_frag = own_frags
        k_desc, v_desc, k_rows_desc = descriptors
        neg_lse0, neg_lse1, delta0, delta1 = rows
        b, h, H, wrow, g, t = lane_rows
        seed, site, threshold, keep = drop
        n0 = i * COLS
        stage = i & 1
        WAIT_ALL()
        fence_proxy_async()
        cuda.syncthreads()
        fence_s()
        scores(s_acc, q_frag, words, k_desc + stage * STAGE_UNITS)          # S = Q K^T
        scores(dp_acc, dout_frag, words, v_desc + stage * STAGE_UNITS)      # dP = dO V^T
        wgmma_commit()
        wait_s(s_acc, dp_acc, dq_acc, ds_frag)  # (and the last tile's dS K)
        cuda.syncthreads()
        if i + 1 < tiles:
            at = tiles_at + (stage ^ 1) * 2 * TILE_WORDS
            copy_tile(words, at, k, start, n0 + COLS, T)
            copy_tile(words, at + TILE_WORDS, v, start, n0 + COLS, T)
        commit_copies()
        limit = int32(wrow + g - n0 - 2 * t)
        for j in range(NT):
            key = n0 + 8 * j + 2 * t
            for e in range(4):
                query = wrow + g + 8 * (e >> 1)
                p = exp2_fast(cuda.fma(s_acc[4 * j + e], scale_log2,
                                       neg_lse0 if e < 2 else neg_lse1))
                if diagonal and future(j, e, limit):
                    p = float32(0.0)
                gf = factor(seed, site, threshold, keep, b, h, query, key + (e & 1), H, T)
                s_acc[4 * j + e] = p * (gf * dp_acc[4 * j + e] - (delta0 if e < 2 else delta1))
        fragments(ds_frag, s_acc)
        fence_q(dq_acc, ds_frag)
        rows_product(dq_acc, ds_frag, words, k_rows_desc + stage * STAGE_UNITS)   # dQ += dS K
        wgmma_commit()

    @cuda.jit(**bounds(2))
    def attention_dq_wgmma_kernel(dq, dout_pairs, q_pairs, k_pairs, v_pairs, lse, delta,
                                  scale_log2, scale, seed, site, threshold, keep, accumulate):
        # dynamic shared memory shared_bytes(2): two stages of a K tile and a V tile
        words = dynamic_shared_words()
        first = atom_start(words)
        s_acc = cuda.local.array(S_ACC, float32)
        dp_acc = cuda.local.array(S_ACC, float32)
        dq_acc = cuda.local.array(O_ACC, float32)
        q_frag = cuda.local.array(ROW_FRAG_WORDS, uint32)
        dout_frag = cuda.local.array(ROW_FRAG_WORDS, uint32)
        ds_frag = cuda.local.array(FRAG_WORDS, uint32)
        dout, q, k, v = flat(dout_pairs), flat(q_pairs), flat(k_pairs), flat(v_pairs)
        H, T = dq.shape[1], dq.shape[2]
        bh = cuda.blockIdx.x
        b, h = bh // H, bh % H
        row0 = (cuda.gridDim.y - 1 - cuda.blockIdx.y) * ROWS
        tid = cuda.threadIdx.x
        warp, lane = tid >> 5, tid & 31
        g, t = lane >> 2, lane & 3
        wrow = row0 + 16 * warp
        start = copy_start(bh, T, tid)
        tiles_at = first                        # stage s: a K tile, then a V tile
        copy_tile(words, tiles_at, k, start, 0, T)
        copy_tile(words, tiles_at + TILE_WORDS, v, start, 0, T)
        commit_copies()
        load_rows(q_frag, q, bh, wrow, T, lane)           # (the scores' A, in registers)
        load_rows(dout_frag, dout, bh, wrow, T, lane)
        field = shared_descriptor(words, tiles_at)
        k_desc, k_rows_desc = field | K_BITS, field | MN_BITS   # (K's rows read both ways)
        v_desc = (field + TILE_UNITS) | K_BITS
        # the lane's two rows' -lse (log2 units: P = 2^(S scale - lse), an FFMA's addend) and
        # delta; rows past T: P = 0
        neg_lse0 = -lse[b, h, wrow + g] * LOG2E if wrow + g < T else NEG_INF
        neg_lse1 = -lse[b, h, wrow + g + 8] * LOG2E if wrow + g + 8 < T else NEG_INF
        delta0 = delta[b, h, wrow + g] if wrow + g < T else float32(0.0)
        delta1 = delta[b, h, wrow + g + 8] if wrow + g + 8 < T else float32(0.0)
        zero(dq_acc, O_ACC)
        tiles = (min(row0 + ROWS, T) + COLS - 1) // COLS
        own_frags, descriptors = (q_frag, dout_frag), (k_desc, v_desc, k_rows_desc)
        rows = (neg_lse0, neg_lse1, delta0, delta1)
        lane_rows, drop = (b, h, H, wrow, g, t), (seed, site, threshold, keep)
        past = row0 // COLS                     # the tiles before the diagonal's, then those
        for i in range(past):                   # crossing it
            tile_step(i, False, tiles, words, own_frags, descriptors, tiles_at, k, v, start, T,
                      s_acc, dp_acc, dq_acc, ds_frag, rows, lane_rows, scale_log2, drop)
        for i in range(past, tiles):
            tile_step(i, True, tiles, words, own_frags, descriptors, tiles_at, k, v, start, T,
                      s_acc, dp_acc, dq_acc, ds_frag, rows, lane_rows, scale_log2, drop)
        wait_q(dq_acc)
        store_rows(dq, dq_acc, scale, scale, accumulate, b, h, wrow, T, lane)

    return attention_dq_wgmma_kernel


@kernel_factory
def dkdv_kernel(D):
    """dk and dv for heads of D: a block of key rows walks the query tiles from the diagonal."""
    f = tile_functions(D)
    copy_start, copy_tile, load_rows = f["copy_start"], f["copy_tile"], f["load_rows"]
    zero, scores, fragments, rows_product = f["zero"], f["scores"], f["fragments"], f["rows_product"]
    past, store_rows, O_ACC = f["past"], f["store_rows"], f["O_ACC"]
    factor = no_dropout
    fence_s = fence_for()
    wait_s = wait_for(S_ACC, S_ACC, O_ACC, O_ACC, FRAG_WORDS, FRAG_WORDS)
    fence_kv, wait_kv = fence_for(O_ACC, O_ACC, FRAG_WORDS, FRAG_WORDS), wait_for(O_ACC, O_ACC)

    @inlined
    def stage_columns(neg_lse_tiles, delta_tiles, at, lse, delta, b, h, n0, T, tid):
        # the query tile's -lse (log2 units; past T, -inf: P = 0) and delta into slot `at`
        if tid < COLS:
            neg_lse_tiles[at + tid] = -lse[b, h, n0 + tid] * LOG2E if n0 + tid < T else NEG_INF
            delta_tiles[at + tid] = delta[b, h, n0 + tid] if n0 + tid < T else float32(0.0)

    @inlined
    def tile_step(i, diagonal, tiles, row0, words, own_frags, descriptors, tiles_at, q, dout,
                  start, T, columns_at, lse, delta, accumulators, p_frag, ds_frag, lane_rows,
                  tid, scale_log2, drop):
        # query tile i: S^T = K Q^T, dP^T = V dO^T, P^T, dS^T, dV += (P G)^T dO, dK += dS^T Q
        # (issued; waited for with the next tile's S^T). diagonal (a constant): the tile crosses
        # the diagonal, and its queries before a key are masked
        k_frag, v_frag = own_frags
        q_desc, dout_desc, q_rows_desc, dout_rows_desc = descriptors
        neg_lse_tiles, delta_tiles = columns_at
        st_acc, dpt_acc, dk_acc, dv_acc = accumulators
        b, h, H, wrow, g, t = lane_rows
        seed, site, threshold, keep = drop
        n0 = row0 + i * COLS
        stage = i & 1
        columns = stage * COLS
        WAIT_ALL()
        fence_proxy_async()
        cuda.syncthreads()
        fence_s()
        scores(st_acc, k_frag, words, q_desc + stage * STAGE_UNITS)          # S^T = K Q^T
        scores(dpt_acc, v_frag, words, dout_desc + stage * STAGE_UNITS)      # dP^T = V dO^T
        wgmma_commit()
        wait_s(st_acc, dpt_acc, dv_acc, dk_acc, p_frag, ds_frag)   # (and the last dV, dK)
        cuda.syncthreads()
        if i + 1 < tiles:
            at = tiles_at + (stage ^ 1) * 2 * TILE_WORDS
            copy_tile(words, at, q, start, n0 + COLS, T)
            copy_tile(words, at + TILE_WORDS, dout, start, n0 + COLS, T)
            stage_columns(neg_lse_tiles, delta_tiles, (stage ^ 1) * COLS, lse, delta, b, h,
                          n0 + COLS, T, tid)
        commit_copies()
        limit = int32(wrow + g - n0 - 2 * t)
        for j in range(NT):                 # P^T, then dS^T and (P G)^T: two loops,
            for e in range(4):              # each short enough to be unrolled whole
                c = columns + 8 * j + 2 * t + (e & 1)       # (the query's slot)
                p = exp2_fast(cuda.fma(st_acc[4 * j + e], scale_log2, neg_lse_tiles[c]))
                if diagonal and past(j, e, limit):
                    p = float32(0.0)
                st_acc[4 * j + e] = p
        for j in range(NT):
            for e in range(4):
                c = 8 * j + 2 * t + (e & 1)                 # the query's column in the tile
                gf = factor(seed, site, threshold, keep, b, h, n0 + c, wrow + g + 8 * (e >> 1),
                            H, T)
                p = st_acc[4 * j + e]
                dpt_acc[4 * j + e] = p * (gf * dpt_acc[4 * j + e] - delta_tiles[columns + c])
                st_acc[4 * j + e] = p * gf
        fragments(p_frag, st_acc)
        fragments(ds_frag, dpt_acc)
        fence_kv(dv_acc, dk_acc, p_frag, ds_frag)
        rows_product(dv_acc, p_frag, words, dout_rows_desc + stage * STAGE_UNITS)  # dV += (P G)^T dO
        rows_product(dk_acc, ds_frag, words, q_rows_desc + stage * STAGE_UNITS)    # dK += dS^T Q
        wgmma_commit()

    @cuda.jit(**bounds(2))
    def attention_dkdv_wgmma_kernel(dk, dv, dout_pairs, q_pairs, k_pairs, v_pairs, lse, delta,
                                    scale_log2, scale, seed, site, threshold, keep, accumulate):
        # grid (B*H, T/ROWS), the first key rows (the most queries) first; dynamic shared
        # memory shared_bytes(2): two stages of a Q tile and a dO tile
        words = dynamic_shared_words()
        first = atom_start(words)
        neg_lse_tiles = cuda.shared.array(TWO_TILES_ROWS, float32)
        delta_tiles = cuda.shared.array(TWO_TILES_ROWS, float32)
        st_acc = cuda.local.array(S_ACC, float32)
        dpt_acc = cuda.local.array(S_ACC, float32)
        dk_acc = cuda.local.array(O_ACC, float32)
        dv_acc = cuda.local.array(O_ACC, float32)
        k_frag = cuda.local.array(ROW_FRAG_WORDS, uint32)   # the scores' A: the block's keys
        v_frag = cuda.local.array(ROW_FRAG_WORDS, uint32)   # and values, in registers
        p_frag = cuda.local.array(FRAG_WORDS, uint32)       # (P G)^T in bf16
        ds_frag = cuda.local.array(FRAG_WORDS, uint32)      # dS^T
        dout, q, k, v = flat(dout_pairs), flat(q_pairs), flat(k_pairs), flat(v_pairs)
        H, T = dk.shape[1], dk.shape[2]
        bh = cuda.blockIdx.x
        b, h = bh // H, bh % H
        row0 = cuda.blockIdx.y * ROWS
        tid = cuda.threadIdx.x
        warp, lane = tid >> 5, tid & 31
        g, t = lane >> 2, lane & 3
        wrow = row0 + 16 * warp                 # the warp's key rows
        start = copy_start(bh, T, tid)
        tiles_at = first                        # stage s: a Q tile, then a dO tile
        copy_tile(words, tiles_at, q, start, row0, T)       # (row0 is a multiple of COLS:
        copy_tile(words, tiles_at + TILE_WORDS, dout, start, row0, T)   # the diagonal's tile)
        commit_copies()
        stage_columns(neg_lse_tiles, delta_tiles, 0, lse, delta, b, h, row0, T, tid)
        load_rows(k_frag, k, bh, wrow, T, lane)
        load_rows(v_frag, v, bh, wrow, T, lane)
        field = shared_descriptor(words, tiles_at)
        q_desc, q_rows_desc = field | K_BITS, field | MN_BITS   # (each tile read both ways)
        dout_desc, dout_rows_desc = (field + TILE_UNITS) | K_BITS, (field + TILE_UNITS) | MN_BITS
        zero(dk_acc, O_ACC)
        zero(dv_acc, O_ACC)
        tiles = (T - row0 + COLS - 1) // COLS
        own_frags = (k_frag, v_frag)
        descriptors = (q_desc, dout_desc, q_rows_desc, dout_rows_desc)
        columns_at, accumulators = (neg_lse_tiles, delta_tiles), (st_acc, dpt_acc, dk_acc, dv_acc)
        lane_rows, drop = (b, h, H, wrow, g, t), (seed, site, threshold, keep)
        crossing = min(tiles, ROWS // COLS)     # the tiles crossing the diagonal, then the rest
        for i in range(crossing):
            tile_step(i, True, tiles, row0, words, own_frags, descriptors, tiles_at, q, dout,
                      start, T, columns_at, lse, delta, accumulators, p_frag, ds_frag,
                      lane_rows, tid, scale_log2, drop)
        for i in range(crossing, tiles):
            tile_step(i, False, tiles, row0, words, own_frags, descriptors, tiles_at, q, dout,
                      start, T, columns_at, lse, delta, accumulators, p_frag, ds_frag,
                      lane_rows, tid, scale_log2, drop)
        wait_kv(dv_acc, dk_acc)
        store_rows(dk, dk_acc, scale, scale, accumulate, b, h, wrow, T, lane)
        store_rows(dv, dv_acc, float32(1.0), float32(1.0), accumulate, b, h, wrow, T, lane)

    return attention_dkdv_wgmma_kernel


# --- q, k, v and dout rounded to bf16 pairs, each call ----------------------------------------

@cuda.jit
def round_heads_kernel(pairs, x):
    # pairs[B,H,T,D/2] = x[B,H,T,D] in bf16 pairs: a thread 8 values (two 16-byte loads, one
    # store)
    B, H, T, W = pairs.shape
    chunks = W // 4
    c = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if c >= B * H * T * chunks:
        return
    row, chunk = c // chunks, c % chunks
    b, h, i = row // (H * T), (row // T) % H, row % T
    x0, x1, x2, x3 = load4(x, (b, h, i, 8 * chunk))
    x4, x5, x6, x7 = load4(x, (b, h, i, 8 * chunk + 4))
    store4_u32(pairs, (b, h, i, 4 * chunk), bf16_pair(x0, x1), bf16_pair(x2, x3),
               bf16_pair(x4, x5), bf16_pair(x6, x7))


def rounded_heads(x):
    """x [B,H,T,D] (float32, D % 8 == 0) rounded to bf16: uint32 pairs [B,H,T,D/2]."""
    B, H, T, D = x.shape
    pairs = cuda.device_array((B, H, T, D // 2), np.uint32)
    launch(round_heads_kernel, blocks(B * H * T * D // 8, 128), 128, pairs, x)
    return pairs


_no_seed = []


def no_dropout_arguments():
    """The kernels' dropout arguments (seed, site, threshold, keep) for none: a seed array on
    the device that no_dropout never reads."""
    if not _no_seed:
        _no_seed.append(cuda.to_device(np.zeros(1, dtype=np.int64)))
    return _no_seed[0], np.int64(0), np.int64(0), np.float32(1.0)


# --- delta_i = dout_i . out_i, before the backward's kernels -------------------------------

DELTA_WARPS = 2 if SIMULATOR else 4     # warps a block, and rows a warp (all their loads in
DELTA_ROWS = 4                          # flight at once)


@cuda.jit
def delta_kernel(delta, dout, out):
    # delta[B,H,T] = dout[B,H,T,D] . out[B,H,T,D] along D (D % 4 == 0, D <= 4 WARP); grid
    # (T / (DELTA_WARPS DELTA_ROWS), B*H), block (WARP, DELTA_WARPS): a warp takes DELTA_ROWS
    # consecutive rows, lane l holds d = 4l .. 4l+3 of each (one 16-byte load an array), and
    # each row's sum meets in warp_sum. Every load is issued before the first product (a row
    # past T is row T-1 again, not stored).
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


def row_delta(delta, dout, out):
    """delta[B,H,T] = dout . out along D (the backward's first pass)."""
    B, H, T, D = out.shape
    launch(delta_kernel, (blocks(T, DELTA_WARPS * DELTA_ROWS), B * H), (WARP, DELTA_WARPS),
           delta, dout, out)


def forward(out, lse, q, k, v):
    B, H, T, D = q.shape
    heads_pairs = [rounded_heads(x) for x in (q, k, v)]
    launch(forward_kernel(D), (B * H, blocks(T, ROWS)), THREADS, out, lse, *heads_pairs,
           np.float32(LOG2E / math.sqrt(D)), *no_dropout_arguments(),
           shared_bytes=shared_bytes(2))


_deltas = {}


def backward(dq, dk, dv, dout, q, k, v, out, lse):
    B, H, T, D = q.shape
    if (B, H, T) not in _deltas:      # (delta_i = dout_i . out_i, the backward's scratch)
        _deltas[B, H, T] = cuda.device_array((B, H, T), np.float32)
    delta = _deltas[B, H, T]
    row_delta(delta, dout, out)
    heads_pairs = [rounded_heads(x) for x in (dout, q, k, v)]
    scale = np.float32(1.0 / math.sqrt(D))
    drop = no_dropout_arguments()
    grid = (B * H, blocks(T, ROWS))
    launch(dq_kernel(D), grid, THREADS, dq, *heads_pairs, lse, delta, np.float32(LOG2E * scale),
           scale, *drop, False, shared_bytes=shared_bytes(2))
    launch(dkdv_kernel(D), grid, THREADS, dk, dv, *heads_pairs, lse, delta,
           np.float32(LOG2E * scale), scale, *drop, False, shared_bytes=shared_bytes(2))
