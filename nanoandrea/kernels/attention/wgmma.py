"""Causal softmax attention on Hopper's warpgroup tensor-core instruction (wgmma, sm_90a): bf16
operands, float32 sums and softmax.

The mma.sync attention's function, arguments, rounding and NumPy twins (read
attention/mma_sync.py's doc, and attention/reference.py's for the math), by other kernels: on a
GPU of compute capability 9.0 (the H100, the H200) the family's dispatch sends bf16 heads of D =
32 and 64 here. What changes is who multiplies: the mma.sync kernels' warps issue mma.sync, an m16n8k16 product a warp, each B fragment brought from
shared memory by ldmatrix first; here a warpgroup (4 warps, 128 threads) issues wgmma, a
[64, N] x [N, 16] product the tensor cores run on their own, B read by them straight from
shared memory (ptx/wgmma.py). The softmax between the products is the same arithmetic.

A block is one warpgroup and owns 64 rows (wgmma's M): queries in the forward and dq, keys in
dk/dv. Those rows are copied into shared memory once; the other side's rows stream past in
tiles of COLS = 64, two stages deep (cp.async). Each copy is issued as soon as its stage is
free, so that it has as much of the kernel's work to land behind as two stages give: the
forward's K tile two tiles ahead (free once its scores are), its V tile one (free once its
P V is); the backward's tiles two ahead at D = 64, where a tile's products are all waited for
within it (SECOND_WAITED), one ahead at D = 32. A copy that lands late holds its block at
the wait (docs/perf.md measures it). Every tile is 64 rows of 128 bytes whose 16-byte
chunks are swizzled (chunk c of row r at c ^ r % 8, the layout wgmma reads without bank
conflicts); a row of D = 32 fills half of its 128 bytes, so both head sizes read the same
layout. Shared memory (`words`, the kernel's dynamic shared array), rows and offsets are counted
in words (a word: 32 bits, here a bf16 pair). q, k and v come as contiguous heads [B,H,T,D/2]
or, in bf16 training, as heads views of the rows [B,T,H*D/2] that the products of W_Q, W_K,
W_V wrote (heads_layout): a copy reads from the head's first word plus its row times the words
between rows, so both are the same kernel, and no pass splits the heads.

    forward   S [64, COLS] = Q K^T                 A = Q's rows, B = K's rows (both along D:
                                                   K-major)
              the online softmax, P in registers
              O [64, D] += P V                     A = P from the registers, B = V's rows
                                                   (rows of k, along D: MN-major)
    dq        S = Q K^T, dP = dO V^T; P = exp(S - lse), dS = P (G dP - delta)
              dQ [64, D] += dS K                   A = dS from the registers, B = K's rows
    dk, dv    S^T [64, COLS] = K Q^T, dP^T = V dO^T; P^T, dS^T as above, by columns
              dV [64, D] += (P G)^T dO,  dK += dS^T Q    A from the registers, B = dO's, Q's rows

A streamed tile serves both of its products as it lies: its rows along D are the K-major B of
S (n = its rows) and the MN-major B of O or dQ (k = its rows): the same bytes, two descriptors.

Why P never leaves the registers: a wgmma accumulator gives warp w's lane (g, t) = (lane // 4,
lane % 4) the scores of rows 16w + g and 16w + g + 8 at columns 8j + 2t and 8j + 2t + 1, for
every n8 column group j; the A operand in registers takes, for a k16 step s, the pairs of rows
16w + g, + 8 at columns 16s + 2t and 16s + 8 + 2t: column groups 2s and 2s + 1 of the same
lanes. Rounded in pairs to bf16 (`fragments`), the scores are the next product's A.

dq keeps a kernel of its own, as in mma_sync.py: each gradient is one block's sum, in a fixed
order, with no atomics: reproducible to the bit. It also makes what dk/dv reads besides q, k,
v: a block stages its rows of dout from float32 itself, rounding them to bf16 and summing each
row's delta = dO . O as it goes (`stage_dout`), and writes both out, so the backward has no
pass before its products. Each product is one group of wgmma's. A tile's first product (the
scores) is waited for before the softmax reads it; its second (P V, dS K, dV and dK) runs on
into the next tile, issued behind it and waited for with its scores (in the backward at D = 64
at the end of its own tile instead: SECOND_WAITED), and a second barrier after that wait frees
the stage it read. So that ptxas keeps them in flight, no instruction writes a wgmma's
accumulators while one is: a product's first step overwrites its
scores (scale-d 0) instead of zeroing them, and the causal mask is read into the max and the
probabilities, in a loop of its own for the tiles crossing the diagonal, never written into
the scores (ptxas serializes every wgmma of a kernel that does, its warning C7515).

Under the CUDA simulator a block is the GPU's own (128 threads: the twins of wgmma need a whole
warpgroup) and a streamed tile 16 rows, so that T = 80 walks several tiles.
"""
import math

import numpy as np
from numba import cuda, float32, int32, uint32

from ..ptx.asynccopy import commit_copies, copy16_async, wait_copies
from ..ptx.mma import bf16_pair, store4_u32
from ..ptx.sfu import exp2_fast
from ..ptx.vector import flat_span, load2, store2
from ..ptx.warp import group_sum, quad_max, quad_sum
from ..ptx.wgmma import (ATOM_BYTES, K_MAJOR, MN_MAJOR, REGISTERS, atom_start, descriptor_high,
                         dynamic_shared_words, fence_for, fence_proxy_async, shared_descriptor,
                         wait_for, wgmma_by_descriptors, wgmma_commit)
from ..runtime.device import SIMULATOR
from ..heads import heads_view
from ..runtime.launch import blocks, check, current_stream, inlined, kernel_factory, launch
from .reference import dropout_factor, no_dropout
from .tiles import LOG2E, NEG_INF, column_loader, dout_chunk, pairs_storer

HEAD_SIZES = (32, 64)
ROWS = 64                           # a block's own rows: wgmma's M, one warpgroup
THREADS = 128
COLS = 16 if SIMULATOR else 64      # a streamed tile's rows: the score products' N
ROW_WORDS = 32                      # a staged row: 128 bytes, 8 chunks of 16 (D = 32: 4 used)
OWN_WORDS = ROWS * ROW_WORDS        # one staged matrix of the block's own rows: 8 KB
TILE_WORDS = COLS * ROW_WORDS       # one streamed tile
NT = COLS // 8                      # n8 column groups of the scores
S_ACC = COLS // 2                   # a thread's floats of the scores [64, COLS]
STEPS = COLS // 16                  # k16 steps of a product over a streamed tile's rows
FRAG_WORDS = 4 * STEPS              # a thread's A fragments of scores [64, COLS] in bf16
TWO_TILES_ROWS = 2 * COLS           # dk/dv's -lse and delta of two stages of query tiles
LN2 = float32(math.log(2.0))
# Descriptors (ptx/wgmma.py): a start-address field in 16-byte units | a layout's bits. A
# k16 step along a row is 32 bytes on (2 units), one down a tile's rows 16 rows of 128 bytes
# (128 units); the two stages of streamed tiles are STAGE_UNITS apart
MN_LAYOUT = MN_MAJOR(OWN_WORDS * 4)     # (one block of 64 columns: D <= 64; LBO unused)
K_BITS, MN_BITS = descriptor_high(K_MAJOR), descriptor_high(MN_LAYOUT)
ALONG, DOWN = 2, 128
TILE_UNITS, STAGE_UNITS = TILE_WORDS // 4, 2 * TILE_WORDS // 4
multiply_scores = wgmma_by_descriptors(COLS, K_MAJOR, K_MAJOR)
first_scores = wgmma_by_descriptors(COLS, K_MAJOR, K_MAJOR, scale_d=0)    # (D = A B)


def copies_landed(pending):
    """landed(): every thread's copies have landed, but for its last `pending` groups, and are
    visible to wgmma (each thread waits for its own, then the block meets)."""
    wait = wait_copies(pending)

    @inlined
    def landed():
        wait()
        fence_proxy_async()
        cuda.syncthreads()
    return landed


# The backward's kernels at D = 64 wait for a tile's second product (dQ += dS K; dV and dK)
# before the next tile's scores are issued: in flight beside them it keeps ~160 accumulator
# and fragment registers a thread live across the wgmma's, more than the launch bounds leave
# (`bounds`), and ptxas then serializes every wgmma of the kernel (its warning C7512), each one
# waited for before the next is issued. At D = 32 the products are half as wide and fit.
SECOND_WAITED = (64,)


def shared_bytes(own, streams):
    """The dynamic shared memory of a kernel with `own` matrices of its rows and `streams`
    streamed matrices two stages deep, from the first 1024-byte boundary on (atom_start)."""
    return 4 * (own * OWN_WORDS + 2 * streams * TILE_WORDS) + ATOM_BYTES


def tile_functions(D):
    """The inlined device functions of the kernels for heads of D (32 or 64)."""
    KD = D // 16                        # k16 steps along D: the score products'
    O_ACC = D // 2                      # a thread's floats of a [64, D] product
    DN = D // 8                         # its n8 column groups
    G_WORDS, CHUNKS = D // 2, D // 8    # a row of x in device memory: words, 16-byte chunks
    LOG_CHUNKS = CHUNKS.bit_length() - 1
    ROW_STEP = THREADS // CHUNKS        # rows between a thread's copies (a multiple of 8: each
                                        # copy's chunk is swizzled as the first's)
    DOUT_PASSES = ROWS // ROW_STEP      # a thread's rows of dO in stage_dout
    DOUT_WORDS = 4 * DOUT_PASSES        # their bf16 pairs, 4 a row
    multiply_rows = wgmma_by_descriptors(D, REGISTERS, MN_LAYOUT)

    @inlined
    def copy_start(b, h, H, T, head_words, row_words, tid):
        # this thread's first copy of a matrix's rows: (its word in a staged matrix, its word
        # of head (b, h) at row 0, its row, the words from a row to the next): chunk tid %
        # CHUNKS of row tid / CHUNKS. Heads [B,H,T,D/2] (head_words T D/2, row_words D/2) or
        # heads side by side in rows [B,T,H,D/2] (D/2 and H D/2): a batch is H T D/2 either way
        row, chunk = int32(tid >> LOG_CHUNKS), int32(tid & (CHUNKS - 1))
        return (int32(row * ROW_WORDS + 4 * (chunk ^ (row & 7))),
                int32(b * H * T * G_WORDS + h * head_words + row * row_words + 4 * chunk), row,
                int32(row_words))

    def copier(count):
        PASSES = -(-count // ROW_STEP)  # a thread's copies of `count` rows
        EXACT = count % ROW_STEP == 0

        @inlined
        def copy_rows(words, at, x, start, row0, T):
            # start copying head (b, h)'s rows row0 .. row0 + count - 1 of x (the heads' bf16
            # pairs, flat_span; start: copy_start's for the head) into words[at:] as swizzled
            # rows of 128 bytes; zeros past T
            place, src, row, row_words = start
            rows_left = int32(T - row0)
            first = int32(src + row0 * row_words)
            step = int32(ROW_STEP * row_words)
            for r in range(PASSES):
                if EXACT or row + r * ROW_STEP < count:
                    inside = row + r * ROW_STEP < rows_left
                    copy16_async(words, (at + place + r * ROW_STEP * ROW_WORDS,), x,
                                 (uint32(first + r * step) if inside else uint32(0),), inside)
        return copy_rows

    @inlined
    def stage_dout(words, at, dout_pairs, delta, delta_rows, dout, out, b, h, row0, T, tid):
        # dO's rows row0 .. row0 + ROWS of head (b, h), from float32: rounded to bf16 into
        # words[at:] (the swizzled rows copy_own makes) and into dout_pairs (dk/dv's copy), and
        # delta = dO . O of each row into delta_rows[ROWS] and delta. A thread takes chunk
        # tid % CHUNKS (8 values) of rows tid / CHUNKS + ROW_STEP r, so a row's CHUNKS threads
        # are adjacent lanes and their sums meet in shuffles (every lane shuffles: a row past T
        # reads row T - 1 and stores zeros in shared memory, nothing in device memory)
        # Every row's loads first, then the sums and the stores: for all the compiler knows a
        # store to device memory may write what the next row's loads read, so a row's loads
        # issued after the last row's stores would each wait out their own latency
        row, chunk = int32(tid >> LOG_CHUNKS), int32(tid & (CHUNKS - 1))
        d = 8 * chunk
        partials = cuda.local.array(DOUT_PASSES, float32)
        pairs = cuda.local.array(DOUT_WORDS, uint32)
        for r in range(DOUT_PASSES):
            i = row0 + row + r * ROW_STEP
            (partials[r], pairs[4 * r], pairs[4 * r + 1], pairs[4 * r + 2],
             pairs[4 * r + 3]) = dout_chunk(dout, out, b, h, min(i, T - 1), d)
        for r in range(DOUT_PASSES):
            local = row + r * ROW_STEP
            i = row0 + local
            inside = i < T
            w0, w1, w2, w3 = pairs[4 * r], pairs[4 * r + 1], pairs[4 * r + 2], pairs[4 * r + 3]
            total = group_sum(partials[r], CHUNKS)
            if not inside:
                w0 = w1 = w2 = w3 = uint32(0)
                total = float32(0.0)
            store4_u32(words, (at + local * ROW_WORDS + 4 * (chunk ^ (local & 7)),),
                       w0, w1, w2, w3)
            if chunk == 0:
                delta_rows[local] = total
            if inside:
                store4_u32(dout_pairs, (b, h, i, 4 * chunk), w0, w1, w2, w3)
                if chunk == 0:
                    delta[b, h, i] = total

    @inlined
    def zero(acc, count):
        for e in range(count):
            acc[e] = float32(0.0)

    @inlined
    def scores(acc, words, a_desc, b_desc):
        # acc = the rows a_desc names [64, D] . those b_desc names [COLS, D]^T (both K-major
        # descriptors): issued, not waited for. The first step overwrites acc: it is never
        # zeroed by an instruction of its own (wgmma.py's wgmma_by_descriptors)
        first_scores(acc, words, a_desc, b_desc)
        for kk in range(1, KD):
            multiply_scores(acc, words, a_desc + ALONG * kk, b_desc + ALONG * kk)

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

    copy_tile = copier(COLS)
    # the backward's tile i + 2 is copied at the end of tile i where its second product is
    # waited for there (SECOND_WAITED): the stage it read is free then, and a tile's copies
    # have a whole tile's work to land in, not only the softmax
    TWO_AHEAD = D in SECOND_WAITED

    @inlined
    def copy_tiles(words, tiles_at, x, y, start, row0, i, tiles, T):
        # the backward's streamed tile i (rows row0 + COLS i on) of x and of y into stage i % 2,
        # as one group of copies (empty past the last tile: every tile then waits for the same
        # count of groups)
        if i < tiles:
            at = tiles_at + (i & 1) * 2 * TILE_WORDS
            copy_tile(words, at, x, start, row0 + i * COLS, T)
            copy_tile(words, at + TILE_WORDS, y, start, row0 + i * COLS, T)
        commit_copies()

    return dict(copy_start=copy_start, copy_own=copier(ROWS), copy_tile=copy_tile,
                copy_tiles=copy_tiles, stage_dout=stage_dout, zero=zero, scores=scores,
                fragments=fragments, rows_product=rows_product, future=masker(True),
                past=masker(False), store_rows=store_rows,
                store_pairs=pairs_storer(DN, accumulator), O_ACC=O_ACC,
                # the backward's tile at its start (two tiles ahead, the next one's group
                # may still be in flight)
                tile_landed=copies_landed(1 if TWO_AHEAD else 0))


@inlined
def accumulator(acc, j, e):
    # the lane's e-th float of column group j of a [64, D] product's flat accumulators
    return acc[4 * j + e]


def bounds(blocks_per_sm):
    """Launch bounds: `blocks_per_sm` blocks of a warpgroup share a multiprocessor, so ptxas
    keeps a thread within 65536 / (128 blocks_per_sm) registers. These kernels are
    latency-bound (a block waits on its wgmma's, its copies and its barrier in turn), and the
    other blocks of the multiprocessor are what hides it: the backward's kernels take as many
    as fit without spills (dq 4 at 124-128 registers, dk/dv 3 at 168; their dropout
    variants, with the hash's registers, one fewer)."""
    return {} if SIMULATOR else dict(launch_bounds=(THREADS, blocks_per_sm))


@kernel_factory
def forward_kernel(D, dropout, bf16_copy=False):
    """The forward for heads of D; dropout: built with the dropout hash, else without.
    bf16_copy: out is also written rounded to bf16 pairs (out_pairs), as the product after
    attention (W_O) reads it."""
    f = tile_functions(D)
    copy_start, copy_own, copy_tile = f["copy_start"], f["copy_own"], f["copy_tile"]
    zero, scores, fragments, rows_product = f["zero"], f["scores"], f["fragments"], f["rows_product"]
    future, store_rows, O_ACC = f["future"], f["store_rows"], f["O_ACC"]
    store_pairs, BF16_COPY = f["store_pairs"], bf16_copy
    factor = dropout_factor if dropout else no_dropout
    fence_s, wait_s = fence_for(), wait_for(S_ACC, O_ACC, FRAG_WORDS)
    fence_o, wait_o = fence_for(O_ACC, FRAG_WORDS), wait_for(O_ACC)
    landed = copies_landed(1)               # (the groups of one tile back: tile_step's doc)

    @inlined
    def tile_step(i, diagonal, tiles, words, descriptors, tiles_at, k, v, start, T, s_acc, o_acc,
                  p_frag, m0, m1, l0, l1, lane_rows, scale_log2, drop):
        # key tile i: S = Q K^T, the online softmax, O += P V (issued; waited for with the next
        # tile's S). diagonal (a constant): the tile crosses the diagonal, and its keys after a
        # query are masked. Returns the rows' new running max and sum. (Arguments in tuples:
        # a call of over 30 is made from a tuple, which Numba's inliner does not take)
        # K's tiles are copied two tiles ahead, V's one (the kernel's doc): tile i's K landed
        # with tile i - 1's V, waited for before that tile's P V
        q_desc, k_desc, v_desc = descriptors
        b, h, H, wrow, g, t = lane_rows
        seed, site, threshold, keep = drop
        n0 = i * COLS
        stage = i & 1
        fence_s()                               # (S = Q K^T reads no registers)
        scores(s_acc, words, q_desc, k_desc + stage * STAGE_UNITS)          # S = Q K^T
        wgmma_commit()
        wait_s(s_acc, o_acc, p_frag)            # S, and the last tile's P V: every warp is
        cuda.syncthreads()                      # done with K's stage and V's other stage
        if i + 2 < tiles:                       # K two tiles on, where tile i's was
            copy_tile(words, tiles_at + stage * 2 * TILE_WORDS, k, start, n0 + 2 * COLS, T)
        if i + 1 < tiles:                       # V one tile on, where the last tile's was
            copy_tile(words, tiles_at + (stage ^ 1) * 2 * TILE_WORDS + TILE_WORDS, v, start,
                      n0 + COLS, T)
        commit_copies()                         # (one group a tile, empty or not)
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
        landed()                                # V's tile i and K's tile i + 1
        fence_o(o_acc, p_frag)
        rows_product(o_acc, p_frag, words, v_desc + stage * STAGE_UNITS)    # O += P V
        wgmma_commit()
        return new0, new1, l0, l1

    @cuda.jit(**bounds(4))
    def attention_forward_wgmma_kernel(out, lse, q_pairs, k_pairs, v_pairs, scale_log2, seed,
                                       site, threshold, keep, out_pairs, head_words, row_words):
        # q, k, v: bf16 pairs [B,H,T,D/2], contiguous heads or heads views of rows (read at
        # head_words and row_words: heads_layout); out_pairs: out's bf16 pairs [B,H,T,D/2]
        # (BF16_COPY; else not read). grid (B*H, T/ROWS), the last rows (the most
        # keys) first; block THREADS; dynamic shared memory shared_bytes(1, 2): Q's rows, then
        # two stages of a K tile and a V tile. Scores in log2 units (S / sqrt(D) / ln 2)
        words = dynamic_shared_words()
        first = atom_start(words)
        s_acc = cuda.local.array(S_ACC, float32)
        o_acc = cuda.local.array(O_ACC, float32)
        p_frag = cuda.local.array(FRAG_WORDS, uint32)
        q, k, v = flat_span(q_pairs), flat_span(k_pairs), flat_span(v_pairs)
        H, T = out.shape[1], out.shape[2]
        bh = cuda.blockIdx.x
        b, h = bh // H, bh % H
        row0 = (cuda.gridDim.y - 1 - cuda.blockIdx.y) * ROWS
        tid = cuda.threadIdx.x
        warp, lane = tid >> 5, tid & 31
        g, t = lane >> 2, lane & 3
        wrow = row0 + 16 * warp                 # the warp's rows; the lane's: wrow + g (+ 8)
        start = copy_start(b, h, H, T, head_words, row_words, tid)
        tiles_at = first + OWN_WORDS            # stage s: a K tile, then a V tile
        tiles = (min(row0 + ROWS, T) + COLS - 1) // COLS
        copy_own(words, first, q, start, row0, T)   # Q and K's tile 0, then K's tile 1 and
        copy_tile(words, tiles_at, k, start, 0, T)  # V's tile 0: two groups, in the order
        commit_copies()                             # tile_step waits for them
        if tiles > 1:
            copy_tile(words, tiles_at + 2 * TILE_WORDS, k, start, COLS, T)
        copy_tile(words, tiles_at + TILE_WORDS, v, start, 0, T)
        commit_copies()
        landed()
        q_desc = shared_descriptor(words, first) | K_BITS
        field = shared_descriptor(words, tiles_at)
        k_desc, v_desc = field | K_BITS, (field + TILE_UNITS) | MN_BITS
        zero(o_acc, O_ACC)
        m0 = m1 = NEG_INF                       # each row's running max and sum (of this
        l0 = l1 = float32(0.0)                  # lane's columns: summed over the quad at the end)
        descriptors = (q_desc, k_desc, v_desc)
        lane_rows, drop = (b, h, H, wrow, g, t), (seed, site, threshold, keep)
        past = row0 // COLS                     # the tiles before the diagonal's, then those
        for i in range(past):                   # crossing it
            m0, m1, l0, l1 = tile_step(i, False, tiles, words, descriptors, tiles_at, k, v,
                                       start, T, s_acc, o_acc, p_frag, m0, m1, l0, l1,
                                       lane_rows, scale_log2, drop)
        for i in range(past, tiles):
            m0, m1, l0, l1 = tile_step(i, True, tiles, words, descriptors, tiles_at, k, v,
                                       start, T, s_acc, o_acc, p_frag, m0, m1, l0, l1,
                                       lane_rows, scale_log2, drop)
        wait_o(o_acc)
        l0, l1 = quad_sum(l0), quad_sum(l1)
        store_rows(out, o_acc, float32(1.0) / l0, float32(1.0) / l1, False, b, h, wrow, T, lane)
        if BF16_COPY:                           # (the same floats, rounded: round_bf16's bits)
            store_pairs(out_pairs, o_acc, float32(1.0) / l0, float32(1.0) / l1, False, b, h,
                        wrow, T, lane)
        if t == 0:
            if wrow + g < T:
                lse[b, h, wrow + g] = (m0 + math.log2(l0)) * LN2
            if wrow + g + 8 < T:
                lse[b, h, wrow + g + 8] = (m1 + math.log2(l1)) * LN2

    return attention_forward_wgmma_kernel


@kernel_factory
def dq_kernel(D, dropout, bf16_grads=False):
    """dq for heads of D: the forward's walk over the key tiles, P from lse. bf16_grads: dq is
    written as bf16 pairs (store_pairs), else float32."""
    f = tile_functions(D)
    copy_start, copy_own = f["copy_start"], f["copy_own"]
    zero, scores, fragments, rows_product = f["zero"], f["scores"], f["fragments"], f["rows_product"]
    future, O_ACC = f["future"], f["O_ACC"]
    store_rows = f["store_pairs"] if bf16_grads else f["store_rows"]
    stage_dout, copy_tiles, tile_landed = f["stage_dout"], f["copy_tiles"], f["tile_landed"]
    factor = dropout_factor if dropout else no_dropout
    fence_s, wait_s = fence_for(), wait_for(S_ACC, S_ACC, O_ACC, FRAG_WORDS)
    fence_q, wait_q = fence_for(O_ACC, FRAG_WORDS), wait_for(O_ACC)
    second_waited = D in SECOND_WAITED

    @inlined
    def tile_step(i, diagonal, tiles, words, descriptors, tiles_at, k, v, start, T, s_acc,
                  dp_acc, dq_acc, ds_frag, rows, lane_rows, scale_log2, drop):
        # key tile i: S = Q K^T, dP = dO V^T, dS, dQ += dS K (issued; waited for with the next
        # tile's S). diagonal (a constant): the tile crosses the diagonal
        q_desc, dout_desc, k_desc, v_desc, k_rows_desc = descriptors
        neg_lse0, neg_lse1, delta0, delta1 = rows
        b, h, H, wrow, g, t = lane_rows
        seed, site, threshold, keep = drop
        n0 = i * COLS
        stage = i & 1
        tile_landed()
        fence_s()
        scores(s_acc, words, q_desc, k_desc + stage * STAGE_UNITS)          # S = Q K^T
        scores(dp_acc, words, dout_desc, v_desc + stage * STAGE_UNITS)      # dP = dO V^T
        wgmma_commit()
        wait_s(s_acc, dp_acc, dq_acc, ds_frag)  # (and the last tile's dS K)
        if not second_waited:                   # every warp is done with the last tile's
            cuda.syncthreads()                  # stage: tile i + 1 goes there
            copy_tiles(words, tiles_at, k, v, start, 0, i + 1, tiles, T)
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
        if second_waited:                       # every warp is done with this tile's stage:
            wait_q(dq_acc)                      # tile i + 2 goes there
            cuda.syncthreads()
            copy_tiles(words, tiles_at, k, v, start, 0, i + 2, tiles, T)

    @cuda.jit(**bounds(3 if dropout else 4))
    def attention_dq_wgmma_kernel(dq, dout_pairs, delta, dout, out, q_pairs, k_pairs, v_pairs,
                                  lse, scale_log2, scale, seed, site, threshold, keep,
                                  accumulate, head_words, row_words):
        # dynamic shared memory shared_bytes(2, 2): Q's and dO's rows, then two stages of a K
        # tile and a V tile. dO comes as float32 (dout, out: float32 heads): the block rounds
        # its rows itself and writes them to dout_pairs, and their delta, for dk/dv
        words = dynamic_shared_words()
        first = atom_start(words)
        delta_rows = cuda.shared.array(ROWS, float32)
        s_acc = cuda.local.array(S_ACC, float32)
        dp_acc = cuda.local.array(S_ACC, float32)
        dq_acc = cuda.local.array(O_ACC, float32)
        ds_frag = cuda.local.array(FRAG_WORDS, uint32)
        q, k, v = flat_span(q_pairs), flat_span(k_pairs), flat_span(v_pairs)
        H, T = dq.shape[1], dq.shape[2]
        bh = cuda.blockIdx.x
        b, h = bh // H, bh % H
        row0 = (cuda.gridDim.y - 1 - cuda.blockIdx.y) * ROWS
        tid = cuda.threadIdx.x
        warp, lane = tid >> 5, tid & 31
        g, t = lane >> 2, lane & 3
        wrow = row0 + 16 * warp
        start = copy_start(b, h, H, T, head_words, row_words, tid)
        tiles_at = first + 2 * OWN_WORDS        # stage s: a K tile, then a V tile
        tiles = (min(row0 + ROWS, T) + COLS - 1) // COLS
        copy_own(words, first, q, start, row0, T)
        copy_tiles(words, tiles_at, k, v, start, 0, 0, tiles, T)
        if second_waited:
            copy_tiles(words, tiles_at, k, v, start, 0, 1, tiles, T)
        # the lane's two rows' lse, loaded before stage_dout's stores (which the compiler
        # cannot move them past) and behind no branch, so that they travel with its loads (a
        # row past T reads row T - 1's)
        lse0, lse1 = lse[b, h, min(wrow + g, T - 1)], lse[b, h, min(wrow + g + 8, T - 1)]
        stage_dout(words, first + OWN_WORDS, dout_pairs, delta, delta_rows, dout, out, b, h,
                   row0, T, tid)        # (while the copies are on their way)
        q_desc = shared_descriptor(words, first) | K_BITS
        dout_desc = shared_descriptor(words, first + OWN_WORDS) | K_BITS
        field = shared_descriptor(words, tiles_at)
        k_desc, k_rows_desc = field | K_BITS, field | MN_BITS   # (K's rows read both ways)
        v_desc = (field + TILE_UNITS) | K_BITS
        # the lane's two rows' -lse (log2 units: P = 2^(S scale - lse), an FFMA's addend; -inf
        # past T) and delta (0 past T, where P = 0)
        neg_lse0 = -lse0 * LOG2E if wrow + g < T else NEG_INF
        neg_lse1 = -lse1 * LOG2E if wrow + g + 8 < T else NEG_INF
        cuda.syncthreads()                      # (delta_rows written)
        delta0, delta1 = delta_rows[16 * warp + g], delta_rows[16 * warp + g + 8]
        zero(dq_acc, O_ACC)
        descriptors = (q_desc, dout_desc, k_desc, v_desc, k_rows_desc)
        rows = (neg_lse0, neg_lse1, delta0, delta1)
        lane_rows, drop = (b, h, H, wrow, g, t), (seed, site, threshold, keep)
        past = row0 // COLS                     # the tiles before the diagonal's, then those
        for i in range(past):                   # crossing it
            tile_step(i, False, tiles, words, descriptors, tiles_at, k, v, start, T, s_acc,
                      dp_acc, dq_acc, ds_frag, rows, lane_rows, scale_log2, drop)
        for i in range(past, tiles):
            tile_step(i, True, tiles, words, descriptors, tiles_at, k, v, start, T, s_acc,
                      dp_acc, dq_acc, ds_frag, rows, lane_rows, scale_log2, drop)
        wait_q(dq_acc)
        store_rows(dq, dq_acc, scale, scale, accumulate, b, h, wrow, T, lane)

    return attention_dq_wgmma_kernel


@kernel_factory
def dkdv_kernel(D, dropout, bf16_grads=False):
    """dk and dv for heads of D: a block of key rows walks the query tiles from the diagonal.
    bf16_grads: dk and dv are written as bf16 pairs (store_pairs), else float32."""
    f = tile_functions(D)
    copy_start, copy_own = f["copy_start"], f["copy_own"]
    zero, scores, fragments, rows_product = f["zero"], f["scores"], f["fragments"], f["rows_product"]
    past, O_ACC = f["past"], f["O_ACC"]
    store_rows = f["store_pairs"] if bf16_grads else f["store_rows"]
    copy_tiles, tile_landed = f["copy_tiles"], f["tile_landed"]
    factor = dropout_factor if dropout else no_dropout
    fence_s = fence_for()
    wait_s = wait_for(S_ACC, S_ACC, O_ACC, O_ACC, FRAG_WORDS, FRAG_WORDS)
    fence_kv, wait_kv = fence_for(O_ACC, O_ACC, FRAG_WORDS, FRAG_WORDS), wait_for(O_ACC, O_ACC)
    second_waited = D in SECOND_WAITED

    load_columns, store_columns = column_loader(COLS)

    @inlined
    def tile_step(i, diagonal, tiles, row0, words, descriptors, tiles_at, q, dout, start, T,
                  columns_at, lse, delta, accumulators, p_frag, ds_frag, lane_rows, tid,
                  scale_log2, drop):
        # query tile i: S^T = K Q^T, dP^T = V dO^T, P^T, dS^T, dV += (P G)^T dO, dK += dS^T Q
        # (issued; waited for with the next tile's S^T). diagonal (a constant): the tile crosses
        # the diagonal, and its queries before a key are masked
        k_desc, v_desc, q_desc, dout_desc, q_rows_desc, dout_rows_desc = descriptors
        neg_lse_tiles, delta_tiles = columns_at
        st_acc, dpt_acc, dk_acc, dv_acc = accumulators
        b, h, H, wrow, g, t = lane_rows
        seed, site, threshold, keep = drop
        n0 = row0 + i * COLS
        stage = i & 1
        columns = stage * COLS
        tile_landed()                           # (and the tile's -lse and delta stored)
        # the next tile's -lse and delta, loaded now and stored after this tile's softmax
        # (their slots were last read by the tile before this one)
        next_columns = load_columns(lse, delta, b, h, n0 + COLS, T, tid)
        fence_s()
        scores(st_acc, words, k_desc, q_desc + stage * STAGE_UNITS)          # S^T = K Q^T
        scores(dpt_acc, words, v_desc, dout_desc + stage * STAGE_UNITS)      # dP^T = V dO^T
        wgmma_commit()
        wait_s(st_acc, dpt_acc, dv_acc, dk_acc, p_frag, ds_frag)   # (and the last dV, dK)
        if not second_waited:                   # every warp is done with the last tile's
            cuda.syncthreads()                  # stage: tile i + 1 goes there
            copy_tiles(words, tiles_at, q, dout, start, row0, i + 1, tiles, T)
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
        store_columns(neg_lse_tiles, delta_tiles, (stage ^ 1) * COLS, next_columns, tid)
        fence_kv(dv_acc, dk_acc, p_frag, ds_frag)
        rows_product(dv_acc, p_frag, words, dout_rows_desc + stage * STAGE_UNITS)  # dV += (P G)^T dO
        rows_product(dk_acc, ds_frag, words, q_rows_desc + stage * STAGE_UNITS)    # dK += dS^T Q
        wgmma_commit()
        if second_waited:                       # every warp is done with this tile's stage:
            wait_kv(dv_acc, dk_acc)             # tile i + 2 goes there
            cuda.syncthreads()
            copy_tiles(words, tiles_at, q, dout, start, row0, i + 2, tiles, T)

    @cuda.jit(**bounds(2 if dropout else 3))
    def attention_dkdv_wgmma_kernel(dk, dv, dout_pairs, q_pairs, k_pairs, v_pairs, lse, delta,
                                    scale_log2, scale, seed, site, threshold, keep, accumulate,
                                    head_words, row_words):
        # grid (B*H, T/ROWS), the first key rows (the most queries) first; dynamic shared
        # memory shared_bytes(2, 2): K's and V's rows, then two stages of a Q tile and a dO tile
        words = dynamic_shared_words()
        first = atom_start(words)
        neg_lse_tiles = cuda.shared.array(TWO_TILES_ROWS, float32)
        delta_tiles = cuda.shared.array(TWO_TILES_ROWS, float32)
        st_acc = cuda.local.array(S_ACC, float32)
        dpt_acc = cuda.local.array(S_ACC, float32)
        dk_acc = cuda.local.array(O_ACC, float32)
        dv_acc = cuda.local.array(O_ACC, float32)
        p_frag = cuda.local.array(FRAG_WORDS, uint32)       # (P G)^T in bf16
        ds_frag = cuda.local.array(FRAG_WORDS, uint32)      # dS^T
        dout, q = flat_span(dout_pairs), flat_span(q_pairs)
        k, v = flat_span(k_pairs), flat_span(v_pairs)
        H, T = dk.shape[1], dk.shape[2]
        bh = cuda.blockIdx.x
        b, h = bh // H, bh % H
        row0 = cuda.blockIdx.y * ROWS
        tid = cuda.threadIdx.x
        warp, lane = tid >> 5, tid & 31
        g, t = lane >> 2, lane & 3
        wrow = row0 + 16 * warp                 # the warp's key rows
        start = copy_start(b, h, H, T, head_words, row_words, tid)
        tiles_at = first + 2 * OWN_WORDS        # stage s: a Q tile, then a dO tile
        tiles = (T - row0 + COLS - 1) // COLS   # (row0 is a multiple of COLS: the first tile
        copy_own(words, first, k, start, row0, T)               # is the diagonal's)
        copy_own(words, first + OWN_WORDS, v, start, row0, T)
        copy_tiles(words, tiles_at, q, dout, start, row0, 0, tiles, T)
        if second_waited:
            copy_tiles(words, tiles_at, q, dout, start, row0, 1, tiles, T)
        store_columns(neg_lse_tiles, delta_tiles, 0,
                      load_columns(lse, delta, b, h, row0, T, tid), tid)
        k_desc = shared_descriptor(words, first) | K_BITS
        v_desc = shared_descriptor(words, first + OWN_WORDS) | K_BITS
        field = shared_descriptor(words, tiles_at)
        q_desc, q_rows_desc = field | K_BITS, field | MN_BITS   # (each tile read both ways)
        dout_desc, dout_rows_desc = (field + TILE_UNITS) | K_BITS, (field + TILE_UNITS) | MN_BITS
        zero(dk_acc, O_ACC)
        zero(dv_acc, O_ACC)
        descriptors = (k_desc, v_desc, q_desc, dout_desc, q_rows_desc, dout_rows_desc)
        columns_at, accumulators = (neg_lse_tiles, delta_tiles), (st_acc, dpt_acc, dk_acc, dv_acc)
        lane_rows, drop = (b, h, H, wrow, g, t), (seed, site, threshold, keep)
        crossing = min(tiles, ROWS // COLS)     # the tiles crossing the diagonal, then the rest
        for i in range(crossing):
            tile_step(i, True, tiles, row0, words, descriptors, tiles_at, q, dout, start, T,
                      columns_at, lse, delta, accumulators, p_frag, ds_frag, lane_rows, tid,
                      scale_log2, drop)
        for i in range(crossing, tiles):
            tile_step(i, False, tiles, row0, words, descriptors, tiles_at, q, dout, start, T,
                      columns_at, lse, delta, accumulators, p_frag, ds_frag, lane_rows, tid,
                      scale_log2, drop)
        wait_kv(dv_acc, dk_acc)
        store_rows(dk, dk_acc, scale, scale, accumulate, b, h, wrow, T, lane)
        store_rows(dv, dv_acc, float32(1.0), float32(1.0), accumulate, b, h, wrow, T, lane)

    return attention_dkdv_wgmma_kernel


# --- launchers -----------------------------------------------------------------------------------

def heads_layout(*heads_pairs):
    """(head_words, row_words), the kernels' strides of the bf16 pairs [B,H,T,D/2] of q, k, v
    (all three alike): contiguous heads (T D/2, D/2), or the heads side by side in rows, a
    heads view of [B,T,H D/2] (D/2, H D/2): the products of W_Q, W_K, W_V write them so in bf16
    training, and attention reads its tiles straight from there, no heads' copy between."""
    B, H, T, G = heads_pairs[0].shape
    strides = [stride // 4 for stride in heads_pairs[0].strides]
    alike = all(tuple(x.shape) == (B, H, T, G) and x.strides == heads_pairs[0].strides
                for x in heads_pairs)
    check(alike and strides in ([H * T * G, T * G, G, 1], [T * H * G, G, H * G, 1]),
          "attention_wgmma: q, k and v's bf16 pairs must be laid out alike, as contiguous heads "
          f"or as heads side by side in rows, got strides {[x.strides for x in heads_pairs]}")
    return strides[1], strides[2]


def attention_forward_wgmma(out, lse, q_pairs, k_pairs, v_pairs, scale_log2, dropout, drop,
                            out_pairs=None):
    """The forward's launch: q, k, v as their Bf16Heads pairs (the family's dispatch checks the
    arguments and rounds them; heads_layout's either way); dropout: whether dropout_p > 0,
    drop: reference.dropout_arguments; out_pairs: out's bf16 pairs, written too (or None)."""
    B, H, T, D = out.shape
    launch(forward_kernel(D, dropout, out_pairs is not None), (B * H, blocks(T, ROWS)), THREADS,
           out, lse, q_pairs, k_pairs, v_pairs, scale_log2, *drop,
           q_pairs if out_pairs is None else out_pairs, *heads_layout(q_pairs, k_pairs, v_pairs),
           shared_bytes=shared_bytes(1, 2))


def attention_backward_wgmma(dq, dk, dv, delta, dout, out, qkv_pairs, lse, scale_log2, scale,
                             dropout, drop, accumulate, bf16_grads=False):
    """The backward's launches (the family's dispatch checks the arguments):
    dout, out float32 heads; qkv_pairs = the Bf16Heads pairs of q, k, v (heads_layout's). The
    dq kernel makes delta and dout's bf16 copy as it stages its rows (no pass of their own), laid
    out as q, k, v are, and dk/dv reads them. bf16_grads: dq, dk, dv are the bf16 pairs
    [B,H,T,D/2] of the gradients, written so."""
    B, H, T, D = dout.shape
    layout = heads_layout(*qkv_pairs)
    if not qkv_pairs[0].is_c_contiguous():      # (heads side by side in rows)
        dout_pairs = heads_view(cuda.device_array((B, T, H * D // 2), np.uint32,
                                                  stream=current_stream()), H)
    else:
        dout_pairs = cuda.device_array((B, H, T, D // 2), np.uint32, stream=current_stream())
    grid = (B * H, blocks(T, ROWS))
    launch(dq_kernel(D, dropout, bf16_grads), grid, THREADS, dq, dout_pairs, delta, dout, out,
           *qkv_pairs, lse, scale_log2, scale, *drop, accumulate, *layout,
           shared_bytes=shared_bytes(2, 2))
    launch(dkdv_kernel(D, dropout, bf16_grads), grid, THREADS, dk, dv, dout_pairs, *qkv_pairs,
           lse, delta, scale_log2, scale, *drop, accumulate, *layout,
           shared_bytes=shared_bytes(2, 2))
