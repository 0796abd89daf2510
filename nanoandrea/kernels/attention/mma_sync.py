"""Causal softmax attention on the tensor cores: bf16 operands, float32 sums and softmax.

The family's function (attention/reference.py: the math, the arguments, the dropout); what
changes is where the multiplications happen and what they read:
    q, k, v, dout    rounded to bf16 where a kernel first reads them (their arrays stay float32)
    P G, dS          rounded to bf16 before the products that read them (P V, dS K, ...)
    the scores, the softmax's running max and sum, lse, delta, every sum: float32
so a result differs from the float32 kernels' by about bf16's 2^-9 relative a rounding, ~1e-2
at worst. Heads of D = 32 or 64 (16-byte aligned rows) take the tensor-core kernels: on a GPU
of compute capability 9.0 (the H100, the H200) attention/wgmma.py's, on Hopper's warpgroup
instruction (faster: docs/perf.md), elsewhere (8.x) the kernels here (the family's dispatch
chooses); any other D (72 among them) the float32 kernels, which stay correct for any D.

Each kernel here gives a warp 16 rows and multiplies with `mma.sync.m16n8k16` (ptx/mma.py):
    forward      a block of 64 query rows (4 warps) walks the key tiles of 64 up to the
                 diagonal: S = Q K^T, the online softmax, O += P V
    dq           the same walk: S = Q K^T, P = exp(S - lse), dP = dO V^T, dS = P (G dP - delta),
                 dQ += dS K
    dk, dv       a block of 64 key rows walks the query tiles from the diagonal on, the products
                 transposed so that its warps own key rows: S^T = K Q^T, dP^T = V dO^T,
                 dV += (P G)^T dO, dK += dS^T Q
dq has a kernel of its own (7 products a pair of tiles where one kernel for all three makes 5)
so that each gradient is one block's sum, in order, with no atomics and no partial sums to add:
reproducible to the bit, as attention/reference.py's.

Why P never leaves the registers: an accumulator of a 16 x 8 tile of S gives lane (g, t) =
(lane // 4, lane % 4) the scores (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1); an A fragment of
a 16 x 16 tile takes from it the pairs (g, 2t:2t+2), (g+8, 2t:2t+2), (g, 2t+8:2t+10),
(g+8, 2t+8:2t+10). So two neighbouring score tiles, their pairs rounded to bf16 (`pairs`), ARE
the A fragment of P for the next product: no shared memory, no shuffle. A row's max and sum
meet across the 4 lanes t of its g (ptx/warp.quad_max, quad_sum).

Why the softmax is written the way it is: with 64 HMMA a tile of the forward, the kernel is
bound by how many other instructions it issues (docs/perf.md), so each score costs one FFMA
and one MUFU: the max is taken of the raw scores, S scale - m is one cuda.fma, and 2^x is
ex2.approx.ftz (exp2_fast; libdevice's exp2f adds a test and two multiplies a value to keep
results under 2^-126, which add nothing to a row's sum). The causal mask is applied only on a
tile that crosses the diagonal, by 32-bit compares of constants against one per-lane limit
(masker); every other tile's keys all lie in the past.

The family's dispatch first rounds q, k, v to bf16 pairs in device memory (operands.heads_bf16,
[B,H,T,D/2] uint32: one pass, half the bytes; the model's attention makes q's, k's and v's
once, `heads_operand`, and its backward reads the forward's; dout's is made here in the pass
that sums delta, `delta_and_dout_bf16`), so that a streamed tile (k and v; q and dout in dk/dv) is
a run of whole 16-byte chunks that cp.async copies into shared memory without registers, one
tile ahead of the products (two stages): while the warps multiply tile i, tile
i + 1 is on its way, and one barrier a tile separates the two. The chunks are swizzled as
the mma.sync product's are (ptx/sharedmem.swizzle), and ldmatrix reads them: as they lie for S = Q K^T (K's rows are n,
their pairs run along k), with .trans for O += P V (V's rows are k). The rows a warp
multiplies by every tile (q and dout; k and v in dk/dv) are loaded into A fragments once.
Rows, tiles and offsets are counted in words (a word: 32 bits, here a bf16 pair).

Under the CUDA simulator a block is 2 warps and a tile 16 rows: the same code, small enough.
"""

import math

import numpy as np
from numba import cuda, float32, int32, uint32

from ..operands import Bf16Heads
from ..ptx.asynccopy import commit_copies, copy16_async, wait_copies
from ..ptx.mma import (bf16_pair, ldmatrix_x4, ldmatrix_x4_trans, mma_bf16, pack_bf16,
                       store4_u32)
from ..ptx.sfu import exp2_fast
from ..ptx.sharedmem import swizzle
from ..ptx.vector import flat
from ..ptx.warp import group_sum, quad_max, quad_sum
from ..runtime.device import SIMULATOR
from ..runtime.launch import blocks, current_stream, inlined, kernel_factory, launch
from .reference import dropout_factor, no_dropout
from .tiles import LOG2E, NEG_INF, column_stager, dout_chunk, pairs_storer

HEAD_SIZES = (32, 64)
WARPS = 2 if SIMULATOR else 4
ROWS = 16 * WARPS                   # a block's rows: queries (forward, dq) or keys (dk, dv)
COLS = 16 if SIMULATOR else 64      # a streamed tile's rows: keys (forward, dq) or queries
THREADS = 32 * WARPS
NT = COLS // 8                      # the n8 tiles of a warp's [16, COLS] scores
TWO_ROWS = 2 * COLS
LN2 = float32(math.log(2.0))
WAIT_ALL = wait_copies(0)


# --- the NumPy twin of delta_and_dout_bf16 -------------------------------------------------

def delta_and_dout_bf16_numpy(delta, dout, out):
    """delta[B,H,T] = dout . out along D; returns dout's bf16 pairs, uint32 [B,H,T,D/2]."""
    delta[...] = np.einsum("bhtd,bhtd->bht", dout, out)
    return pack_bf16(np.asarray(dout, np.float32))


# --- the pieces the kernels are made of --------------------------------------------------------

def tile_functions(D):
    """The inlined device functions of the kernels for heads of D (32 or 64)."""
    KD, DN = D // 16, D // 8            # k16 steps along D; n8 tiles across D
    ROW_WORDS, CHUNKS = D // 2, D // 8  # a staged row: D bf16 in pairs, 16-byte chunks
    LOG_CHUNKS = CHUNKS.bit_length() - 1
    COPIES = COLS * CHUNKS // THREADS   # the 16-byte chunks a thread stages of a tile
    swizzled = swizzle(CHUNKS)

    @inlined
    def stage(tiles, base, x, bh, row0, T, tid):
        # start copying the bf16 rows x[bh, row0 : row0 + COLS] (x: heads_bf16's pairs, flat)
        # into tiles[base:], COLS rows of ROW_WORDS words; zeros past row T
        for r in range(COPIES):
            c = tid + r * THREADS
            i, chunk = c >> LOG_CHUNKS, c & (CHUNKS - 1)
            inside = row0 + i < T
            at = ((bh * T + row0 + i) * ROW_WORDS + 4 * chunk) if inside else 0
            copy16_async(tiles, (base + i * ROW_WORDS + 4 * swizzled(i, chunk),), x, (at,),
                         inside)

    @inlined
    def pair_at(x, bh, row, word, T):
        # the bf16 pair at word `word` of row `row` of x[bh] (flat words); zeros past row T
        return x[(bh * T + row) * ROW_WORDS + word] if row < T else uint32(0)

    @inlined
    def load_rows(frag, x, bh, row0, T, lane):
        # frag[KD, 4] = the A fragments of x[bh, row0 : row0 + 16, :] (16 x D bf16)
        g, t = lane >> 2, lane & 3
        for s in range(KD):
            word = 8 * s + t
            frag[s, 0] = pair_at(x, bh, row0 + g, word, T)
            frag[s, 1] = pair_at(x, bh, row0 + g + 8, word, T)
            frag[s, 2] = pair_at(x, bh, row0 + g, word + 4, T)
            frag[s, 3] = pair_at(x, bh, row0 + g + 8, word + 4, T)

    @inlined
    def mma_into(acc, j, a0, a1, a2, a3, b0, b1):
        acc[j, 0], acc[j, 1], acc[j, 2], acc[j, 3] = mma_bf16(
            a0, a1, a2, a3, b0, b1, acc[j, 0], acc[j, 1], acc[j, 2], acc[j, 3])

    @inlined
    def scores(acc, frag, tiles, base, lane):
        # acc[NT, 4] = the warp's rows (frag) . the tile's rows, along D: a [16, COLS] product.
        # The tile is B^T as it lies (rows n, pairs along k): ldmatrix gives B's fragments
        # of n8 tiles j, j + 1 in one; lanes 8q .. 8q+7 address matrix q's rows, q's high bit
        # picks the tile, its low bit the chunk (the mma.sync product's high_bit_rows). Row 8 j + row_in
        # is swizzled as row_in is (j even: a multiple of 16 rows), so a lane's address is one
        # sum a k16 step, and each n8 pair adds a constant to it
        row_in, chunk_in = (lane & 7) + 8 * (lane >> 4), (lane >> 3) & 1
        for j in range(NT):
            for e in range(4):
                acc[j, e] = float32(0.0)
        for s in range(KD):
            at = base + row_in * ROW_WORDS + 4 * swizzled(row_in, 2 * s + chunk_in)
            for j in range(0, NT, 2):
                b0, b1, b2, b3 = ldmatrix_x4(tiles, (at + 8 * j * ROW_WORDS,))
                mma_into(acc, j, frag[s, 0], frag[s, 1], frag[s, 2], frag[s, 3], b0, b1)
                mma_into(acc, j + 1, frag[s, 0], frag[s, 1], frag[s, 2], frag[s, 3], b2, b3)

    def masker(future):
        @inlined
        def mask(acc, limit):
            # acc[NT, 4] = a warp's scores, 16 rows by COLS columns: lane (g, t) holds (row g +
            # 8 (e >> 1), column 8 j + 2 t + (e & 1)) in acc[j, e]. limit = the lane's row g less
            # its column 2 t (the tile's offsets in): a score's column less its row is then a
            # constant less limit. -inf where the column lies after the row (`future`: a key
            # after its query) or before it (a query before its key, in dk/dv's S^T). Only the
            # tiles that cross the diagonal take this; the test is 32-bit (int32 both sides)
            for j in range(NT):
                for e in range(4):
                    ahead = int32(8 * j + (e & 1) - 8 * (e >> 1))
                    if (ahead > limit) if future else (ahead < limit):
                        acc[j, e] = NEG_INF
        return mask

    @inlined
    def pairs(acc, j, half):
        # the bf16 pair of accumulator tile j's row g (half 0) or g + 8 (half 1)
        return bf16_pair(acc[j, 2 * half], acc[j, 2 * half + 1])

    @inlined
    def accumulate_product(acc, weights, tiles, base, lane):
        # acc[DN, 4] += weights . the tile: weights [16, COLS] as score accumulators (NT, 4),
        # rounded to bf16 into A fragments (two n8 tiles a k16 step, the module's doc), times
        # the tile's COLS rows of D (rows k, pairs along n: ldmatrix.trans; q's low bit picks
        # the half of the rows, its high bit the chunk). Row 16 s + row_in is swizzled as
        # row_in is: a lane's address for an n8 pair is the same sum at every s, plus a constant
        row_in, chunk_in = (lane & 7) + 8 * ((lane >> 3) & 1), lane >> 4
        for s in range(NT // 2):
            a0, a1 = pairs(weights, 2 * s, 0), pairs(weights, 2 * s, 1)
            a2, a3 = pairs(weights, 2 * s + 1, 0), pairs(weights, 2 * s + 1, 1)
            for j in range(0, DN, 2):
                at = base + row_in * ROW_WORDS + 4 * swizzled(row_in, j + chunk_in)
                b0, b1, b2, b3 = ldmatrix_x4_trans(tiles, (at + 16 * s * ROW_WORDS,))
                mma_into(acc, j, a0, a1, a2, a3, b0, b1)
                mma_into(acc, j + 1, a0, a1, a2, a3, b2, b3)

    @inlined
    def store_rows(x, acc, factor0, factor1, accumulate, b, h, row0, T, lane):
        # x[b, h, row0 : row0 + 16, :] (+)= acc (DN, 4) times factor0 (row g) or factor1 (g + 8)
        g, t = lane >> 2, lane & 3
        for j in range(DN):
            col = 8 * j + 2 * t
            for half in range(2):
                row = row0 + g + 8 * half
                factor = factor0 if half == 0 else factor1
                if row < T:
                    y0, y1 = acc[j, 2 * half] * factor, acc[j, 2 * half + 1] * factor
                    if accumulate:
                        y0 += x[b, h, row, col]
                        y1 += x[b, h, row, col + 1]
                    x[b, h, row, col], x[b, h, row, col + 1] = y0, y1

    return (stage, load_rows, scores, masker(True), masker(False), accumulate_product,
            (store_rows, pairs_storer(DN, accumulator)), KD, DN, D * COLS // 2)


@inlined
def accumulator(acc, j, e):
    # the lane's e-th float of column group j of an [16, D] product's accumulators [DN, 4]
    return acc[j, e]


BOUNDS = {} if SIMULATOR else dict(launch_bounds=(THREADS, 2))


def kernel_pieces(D, dropout, bf16_grads=False):
    """tile_functions(D), its store_rows the one writing bf16 pairs where bf16_grads, then the
    dropout factor's function (dropout: the hash; else 1, compiled to nothing) and the words of
    a tile's two stages (a shared array's size)."""
    pieces = list(tile_functions(D))
    pieces[6] = pieces[6][1] if bf16_grads else pieces[6][0]
    return tuple(pieces) + (dropout_factor if dropout else no_dropout, 2 * pieces[-1])


@kernel_factory
def forward_kernel(D, dropout, bf16_copy=False):
    """The forward for heads of D; dropout: built with the dropout hash, else without.
    bf16_copy: out is also written rounded to bf16 pairs (out_pairs), as the product after
    attention (W_O) reads it."""
    (stage, load_rows, scores, mask_future, mask_past, accumulate_product, store_rows, KD, DN,
     TILE_WORDS, factor, TWO_TILES) = kernel_pieces(D, dropout)
    store_pairs = pairs_storer(DN, accumulator)
    BF16_COPY = bf16_copy

    @cuda.jit(**BOUNDS)
    def attention_forward_bf16_kernel(out, lse, q_pairs, k_pairs, v_pairs, scale_log2, seed,
                                      site, threshold, keep, out_pairs):
        # q, k, v: heads_bf16's pairs [B,H,T,D/2]; out_pairs: out's bf16 pairs [B,H,T,D/2]
        # (BF16_COPY; else not read). grid (B*H, T/ROWS), the last rows (the most keys)
        # first; scores in log2 units (S / sqrt(D) / ln 2): exp is the hardware's exp2
        k_tiles = cuda.shared.array(TWO_TILES, uint32)     # two stages each
        v_tiles = cuda.shared.array(TWO_TILES, uint32)
        q_frag = cuda.local.array((KD, 4), uint32)
        s_acc = cuda.local.array((NT, 4), float32)
        o_acc = cuda.local.array((DN, 4), float32)
        q, k, v = flat(q_pairs), flat(k_pairs), flat(v_pairs)
        H, T = out.shape[1], out.shape[2]
        bh = cuda.blockIdx.x
        b, h = bh // H, bh % H
        row0 = (cuda.gridDim.y - 1 - cuda.blockIdx.y) * ROWS
        tid = cuda.threadIdx.x
        warp, lane = tid >> 5, tid & 31
        g, t = lane >> 2, lane & 3
        wrow = row0 + 16 * warp                 # the warp's rows; the lane's: wrow + g (+ 8)
        stage(k_tiles, 0, k, bh, 0, T, tid)     # (the first tile on its way)
        stage(v_tiles, 0, v, bh, 0, T, tid)
        commit_copies()
        load_rows(q_frag, q, bh, wrow, T, lane)
        for j in range(DN):
            for e in range(4):
                o_acc[j, e] = float32(0.0)
        m0 = m1 = NEG_INF                       # each row's running max and sum (of this
        l0 = l1 = float32(0.0)                  # lane's columns: summed over the quad at the end)
        tiles = (min(row0 + ROWS, T) + COLS - 1) // COLS
        for i in range(tiles):
            n0 = i * COLS
            WAIT_ALL()                          # tile i has landed, for every thread, and
            cuda.syncthreads()                  # everyone is done with tile i - 1's stage
            if i + 1 < tiles:                   # tile i + 1 into it
                stage(k_tiles, ((i + 1) & 1) * TILE_WORDS, k, bh, n0 + COLS, T, tid)
                stage(v_tiles, ((i + 1) & 1) * TILE_WORDS, v, bh, n0 + COLS, T, tid)
            commit_copies()
            base = (i & 1) * TILE_WORDS
            if n0 <= wrow + 15:                 # (else every key of the tile is in the future)
                scores(s_acc, q_frag, k_tiles, base, lane)
                if n0 + COLS > wrow + 1:        # (a key after a row of the warp's)
                    mask_future(s_acc, int32(wrow + g - n0 - 2 * t))
                max0 = max1 = NEG_INF           # the rows' largest scores, unscaled (scale > 0)
                for j in range(NT):
                    max0 = max(max0, max(s_acc[j, 0], s_acc[j, 1]))
                    max1 = max(max1, max(s_acc[j, 2], s_acc[j, 3]))
                new0 = max(m0, quad_max(max0) * scale_log2)
                new1 = max(m1, quad_max(max1) * scale_log2)
                shrink0, shrink1 = exp2_fast(m0 - new0), exp2_fast(m1 - new1)
                m0, m1 = new0, new1
                l0, l1 = l0 * shrink0, l1 * shrink1
                for j in range(DN):
                    o_acc[j, 0] *= shrink0
                    o_acc[j, 1] *= shrink0
                    o_acc[j, 2] *= shrink1
                    o_acc[j, 3] *= shrink1
                for j in range(NT):
                    key = n0 + 8 * j + 2 * t
                    for e in range(4):
                        query = wrow + g + 8 * (e >> 1)
                        # (one FFMA and one MUFU a probability)
                        p = exp2_fast(cuda.fma(s_acc[j, e], scale_log2, -(m0 if e < 2 else m1)))
                        if e < 2:
                            l0 += p
                        else:
                            l1 += p
                        s_acc[j, e] = p * factor(seed, site, threshold, keep, b, h, query,
                                                 key + (e & 1), H, T)
                accumulate_product(o_acc, s_acc, v_tiles, base, lane)
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

    return attention_forward_bf16_kernel


@kernel_factory
def dq_kernel(D, dropout, bf16_grads=False):
    """dq for heads of D: the forward's walk over the key tiles, P from lse. bf16_grads: dq is
    written as bf16 pairs, else float32."""
    (stage, load_rows, scores, mask_future, mask_past, accumulate_product, store_rows, KD, DN,
     TILE_WORDS, factor, TWO_TILES) = kernel_pieces(D, dropout, bf16_grads)

    @cuda.jit(**BOUNDS)
    def attention_dq_bf16_kernel(dq, dout_pairs, q_pairs, k_pairs, v_pairs, lse, delta,
                                 scale_log2, scale, seed, site, threshold, keep, accumulate):
        k_tiles = cuda.shared.array(TWO_TILES, uint32)
        v_tiles = cuda.shared.array(TWO_TILES, uint32)
        q_frag = cuda.local.array((KD, 4), uint32)
        dout_frag = cuda.local.array((KD, 4), uint32)
        s_acc = cuda.local.array((NT, 4), float32)
        dp_acc = cuda.local.array((NT, 4), float32)
        dq_acc = cuda.local.array((DN, 4), float32)
        dout, q, k, v = flat(dout_pairs), flat(q_pairs), flat(k_pairs), flat(v_pairs)
        H, T = dq.shape[1], dq.shape[2]
        bh = cuda.blockIdx.x
        b, h = bh // H, bh % H
        row0 = (cuda.gridDim.y - 1 - cuda.blockIdx.y) * ROWS
        tid = cuda.threadIdx.x
        warp, lane = tid >> 5, tid & 31
        g, t = lane >> 2, lane & 3
        wrow = row0 + 16 * warp
        stage(k_tiles, 0, k, bh, 0, T, tid)
        stage(v_tiles, 0, v, bh, 0, T, tid)
        commit_copies()
        load_rows(q_frag, q, bh, wrow, T, lane)
        load_rows(dout_frag, dout, bh, wrow, T, lane)
        # the lane's two rows' -lse (log2 units: P = 2^(S scale - lse), an FFMA's addend) and
        # delta; rows past T: P = 0
        neg_lse0 = -lse[b, h, wrow + g] * LOG2E if wrow + g < T else NEG_INF
        neg_lse1 = -lse[b, h, wrow + g + 8] * LOG2E if wrow + g + 8 < T else NEG_INF
        delta0 = delta[b, h, wrow + g] if wrow + g < T else float32(0.0)
        delta1 = delta[b, h, wrow + g + 8] if wrow + g + 8 < T else float32(0.0)
        for j in range(DN):
            for e in range(4):
                dq_acc[j, e] = float32(0.0)
        tiles = (min(row0 + ROWS, T) + COLS - 1) // COLS
        for i in range(tiles):
            n0 = i * COLS
            WAIT_ALL()
            cuda.syncthreads()
            if i + 1 < tiles:
                stage(k_tiles, ((i + 1) & 1) * TILE_WORDS, k, bh, n0 + COLS, T, tid)
                stage(v_tiles, ((i + 1) & 1) * TILE_WORDS, v, bh, n0 + COLS, T, tid)
            commit_copies()
            base = (i & 1) * TILE_WORDS
            if n0 <= wrow + 15:
                scores(s_acc, q_frag, k_tiles, base, lane)          # S
                scores(dp_acc, dout_frag, v_tiles, base, lane)      # dP = dO V^T
                if n0 + COLS > wrow + 1:
                    mask_future(s_acc, int32(wrow + g - n0 - 2 * t))
                for j in range(NT):
                    key = n0 + 8 * j + 2 * t
                    for e in range(4):
                        query = wrow + g + 8 * (e >> 1)
                        p = exp2_fast(cuda.fma(s_acc[j, e], scale_log2,
                                               neg_lse0 if e < 2 else neg_lse1))
                        gf = factor(seed, site, threshold, keep, b, h, query, key + (e & 1), H, T)
                        s_acc[j, e] = p * (gf * dp_acc[j, e] - (delta0 if e < 2 else delta1))
                accumulate_product(dq_acc, s_acc, k_tiles, base, lane)  # dQ += dS K
        store_rows(dq, dq_acc, scale, scale, accumulate, b, h, wrow, T, lane)

    return attention_dq_bf16_kernel


@kernel_factory
def dkdv_kernel(D, dropout, bf16_grads=False):
    """dk and dv for heads of D: a block of key rows walks the query tiles from the diagonal.
    bf16_grads: dk and dv are written as bf16 pairs, else float32."""
    (stage, load_rows, scores, mask_future, mask_past, accumulate_product, store_rows, KD, DN,
     TILE_WORDS, factor, TWO_TILES) = kernel_pieces(D, dropout, bf16_grads)

    stage_rows = column_stager(COLS)

    @cuda.jit(**BOUNDS)
    def attention_dkdv_bf16_kernel(dk, dv, dout_pairs, q_pairs, k_pairs, v_pairs, lse, delta,
                                   scale_log2, scale, seed, site, threshold, keep, accumulate):
        # grid (B*H, T/ROWS), the first key rows (the most queries) first
        q_tiles = cuda.shared.array(TWO_TILES, uint32)
        dout_tiles = cuda.shared.array(TWO_TILES, uint32)
        neg_lse_tiles = cuda.shared.array(TWO_ROWS, float32)
        delta_tiles = cuda.shared.array(TWO_ROWS, float32)
        k_frag = cuda.local.array((KD, 4), uint32)
        v_frag = cuda.local.array((KD, 4), uint32)
        s_acc = cuda.local.array((NT, 4), float32)
        dp_acc = cuda.local.array((NT, 4), float32)
        dk_acc = cuda.local.array((DN, 4), float32)
        dv_acc = cuda.local.array((DN, 4), float32)
        dout, q, k, v = flat(dout_pairs), flat(q_pairs), flat(k_pairs), flat(v_pairs)
        H, T = dk.shape[1], dk.shape[2]
        bh = cuda.blockIdx.x
        b, h = bh // H, bh % H
        row0 = cuda.blockIdx.y * ROWS
        tid = cuda.threadIdx.x
        warp, lane = tid >> 5, tid & 31
        g, t = lane >> 2, lane & 3
        wrow = row0 + 16 * warp                 # the warp's key rows
        first = row0 - row0 % COLS              # the query tile holding the diagonal
        stage(q_tiles, 0, q, bh, first, T, tid)
        stage(dout_tiles, 0, dout, bh, first, T, tid)
        commit_copies()
        stage_rows(neg_lse_tiles, delta_tiles, 0, lse, delta, b, h, first, T, tid)
        load_rows(k_frag, k, bh, wrow, T, lane)
        load_rows(v_frag, v, bh, wrow, T, lane)
        for j in range(DN):
            for e in range(4):
                dk_acc[j, e] = float32(0.0)
                dv_acc[j, e] = float32(0.0)
        tiles = (T - first + COLS - 1) // COLS
        for i in range(tiles):
            n0 = first + i * COLS
            WAIT_ALL()
            cuda.syncthreads()
            if i + 1 < tiles:
                at = ((i + 1) & 1) * TILE_WORDS
                stage(q_tiles, at, q, bh, n0 + COLS, T, tid)
                stage(dout_tiles, at, dout, bh, n0 + COLS, T, tid)
                stage_rows(neg_lse_tiles, delta_tiles, ((i + 1) & 1) * COLS, lse, delta, b, h,
                           n0 + COLS, T, tid)
            commit_copies()
            base, rows = (i & 1) * TILE_WORDS, (i & 1) * COLS
            if n0 + COLS > wrow:                # (else every query of the tile is in the past)
                scores(s_acc, k_frag, q_tiles, base, lane)          # S^T
                scores(dp_acc, v_frag, dout_tiles, base, lane)      # dP^T = V dO^T
                if n0 < wrow + 16:              # (a query before a key of the warp's)
                    mask_past(s_acc, int32(wrow + g - n0 - 2 * t))
                for j in range(NT):             # P^T, then dS^T and (P G)^T: two loops,
                    col = 8 * j + 2 * t         # each short enough to be unrolled whole
                    for e in range(4):
                        s_acc[j, e] = exp2_fast(cuda.fma(s_acc[j, e], scale_log2,
                                                         neg_lse_tiles[rows + col + (e & 1)]))
                for j in range(NT):
                    col = 8 * j + 2 * t
                    for e in range(4):
                        query, key = n0 + col + (e & 1), wrow + g + 8 * (e >> 1)
                        gf = factor(seed, site, threshold, keep, b, h, query, key, H, T)
                        p = s_acc[j, e]
                        dp_acc[j, e] = p * (gf * dp_acc[j, e] - delta_tiles[rows + col + (e & 1)])
                        s_acc[j, e] = p * gf
                accumulate_product(dv_acc, s_acc, dout_tiles, base, lane)  # dV += (P G)^T dO
                accumulate_product(dk_acc, dp_acc, q_tiles, base, lane)    # dK += dS^T Q
        store_rows(dk, dk_acc, scale, scale, accumulate, b, h, wrow, T, lane)
        store_rows(dv, dv_acc, float32(1.0), float32(1.0), accumulate, b, h, wrow, T, lane)

    return attention_dkdv_bf16_kernel


@kernel_factory
def delta_and_dout_kernel(D):
    """delta and dout's bf16 copy for heads of D, in one pass over dout."""
    CHUNKS = D // 8                     # a row's threads: 8 values each

    @cuda.jit
    def delta_and_dout_bf16_kernel(delta, dout_pairs, dout, out):
        # delta[B,H,T] = dout . out along D and dout_pairs[B,H,T,D/2] = dout in bf16 pairs: the two
        # passes the backward needs before its products (attention.attention_delta, heads_bf16)
        # made one, so dout is read once. A thread takes 8 values of a row (two 16-byte loads
        # of each array, one 16-byte store), a row's CHUNKS threads are consecutive lanes and
        # their partial sums meet in shuffles (group_sum). Every lane shuffles: one past the
        # last row takes the last row again and stores nothing.
        B, H, T, _ = dout.shape
        rows = B * H * T
        c = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        row = min(c // CHUNKS, rows - 1)
        d = 8 * (c % CHUNKS)
        b, h, i = row // (H * T), (row // T) % H, row % T
        partial, w0, w1, w2, w3 = dout_chunk(dout, out, b, h, i, d)
        total = group_sum(partial, CHUNKS)
        if c < rows * CHUNKS:
            store4_u32(dout_pairs, (b, h, i, d // 2), w0, w1, w2, w3)
            if d == 0:
                delta[b, h, i] = total

    return delta_and_dout_bf16_kernel


# --- launchers (the family's dispatch checks the arguments and rounds q, k, v) ---------------

def attention_forward_mma(out, lse, q_pairs, k_pairs, v_pairs, scale_log2, dropout, drop,
                          out_pairs=None):
    """The forward's launch: q, k, v as their Bf16Heads pairs; dropout: whether dropout_p > 0,
    drop: reference.dropout_arguments; out_pairs: out's bf16 pairs, written too (or None)."""
    B, H, T, D = out.shape
    launch(forward_kernel(D, dropout, out_pairs is not None), (B * H, blocks(T, ROWS)),
           THREADS, out, lse, q_pairs, k_pairs, v_pairs, scale_log2, *drop,
           q_pairs if out_pairs is None else out_pairs)


def attention_backward_mma(dq, dk, dv, delta, dout, out, qkv_pairs, lse, scale_log2, scale,
                           dropout, drop, accumulate, bf16_grads=False):
    """The backward's launches: delta and dout's bf16 copy first (one pass,
    delta_and_dout_bf16), then the dq kernel and the dk/dv kernel, which read the same bf16
    copies. qkv_pairs: the Bf16Heads pairs of q, k, v. bf16_grads: dq, dk, dv are the bf16
    pairs [B,H,T,D/2] of the gradients, written so."""
    B, H, T, D = dout.shape
    heads_pairs = [delta_and_dout_bf16(delta, dout, out).bf16_pairs, *qkv_pairs]  # dout, q, k, v
    grid = (B * H, blocks(T, ROWS))
    launch(dq_kernel(D, dropout, bf16_grads), grid, THREADS, dq, *heads_pairs, lse, delta,
           scale_log2, scale, *drop, accumulate)
    launch(dkdv_kernel(D, dropout, bf16_grads), grid, THREADS, dk, dv, *heads_pairs, lse, delta,
           scale_log2, scale, *drop, accumulate)


def delta_and_dout_bf16(delta, dout, out):
    """delta[B,H,T] = dout . out along D (as attention.attention_delta) and dout [B,H,T,D]
    rounded to bf16 pairs (as heads_bf16), in one pass: the Bf16Heads of dout. dout and out:
    float32 heads (views of the concat among them), 16-byte aligned rows, D % 8 == 0."""
    B, H, T, D = dout.shape
    dout_pairs = cuda.device_array((B, H, T, D // 2), np.uint32, stream=current_stream())
    launch(delta_and_dout_kernel(D), blocks(B * H * T * D // 8, 128), 128, delta, dout_pairs,
           dout, out)
    return Bf16Heads(dout_pairs)
