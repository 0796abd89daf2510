"""bf16 mma.sync m16n8k16, a warp per 16 rows, rounded as staged.
H100 2026-12-07: fwd+bwd 0.20x SDPA bf16 at [16,12,1024,64] (fwd 0.16x)

The first bf16 version of the package's attention (kernels/attention/mma_sync.py today is its
successor), here without dropout (measured as the package's kernels then, built with it:
tools/bench.py --only attention --precision bf16). q, k, v and dout arrive as float32 and are rounded to bf16 where
a kernel reads them; the scores, the softmax's max and sum, lse, delta and every sum stay
float32. Three kernels, each a block of WARPS warps, a warp 16 rows, every product one warp's
mma.sync of 16 x 8 x 16 (nanoandrea/kernels/ptx/mma.py):
    forward   a block of query rows walks the key tiles of COLS up to the diagonal:
              S = Q K^T, the online softmax, O += P V
    dq        the same walk, P from lse: S = Q K^T, dP = dO V^T, dS = P (dP - delta),
              dQ += dS K
    dk, dv    a block of key rows walks the query tiles from the diagonal on, the products
              transposed so that its warps own key rows: S^T = K Q^T, dP^T = V dO^T,
              dV += P^T dO, dK += dS^T Q
dq has a kernel of its own, as in v5, so that no gradient needs atomics or partial sums.

P never leaves the registers: an accumulator of a 16 x 8 tile of S gives lane (g, t) =
(lane // 4, lane % 4) the scores (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1); an A fragment of
a 16 x 16 tile takes from it the pairs (g, 2t:2t+2), (g+8, 2t:2t+2), (g, 2t+8:2t+10),
(g+8, 2t+8:2t+10). So two neighbouring score tiles, their pairs rounded to bf16 (`pairs`), are
the A fragment of P for the next product: no shared memory, no shuffle. A row's max and sum
meet across the 4 lanes t of its g (quad_max, quad_sum).

The rows a warp multiplies by every tile (q and dout; k and v in dk/dv) are read once into A
fragments, rounded as they are read. The streamed tiles (k and v; q and dout in dk/dv) go
through registers: a thread loads 8 floats (two 16-byte loads), rounds them to four bf16 pairs
and stores them as one 16-byte chunk of a shared tile, the chunks swizzled (ptx/sharedmem.py),
so that ldmatrix reads them without bank conflicts: as they lie for S = Q K^T (K's rows are n,
their pairs run along k), with .trans for O += P V (V's rows are k).

What it leaves undone: pipelining. A tile is staged between two barriers, its loads waited
for before any product starts, and every kernel rounds the same q, k, v again as it stages
them. The package's kernel (attention/mma_sync.py, v9) rounds q, k, v and dout once into bf16
pairs in device memory and copies the tiles with cp.async, one tile ahead of the products.
"""
import math

import numpy as np
from numba import cuda, float32, uint32

from nanoandrea.kernels.ptx.mma import (bf16_pair, ldmatrix_x4, ldmatrix_x4_trans, mma_bf16,
                                        store4_u32)
from nanoandrea.kernels.ptx.sharedmem import swizzle
from nanoandrea.kernels.ptx.vector import load4
from nanoandrea.kernels.ptx.warp import WARP, quad_max, quad_sum, warp_sum
from nanoandrea.kernels.runtime.launch import SIMULATOR, blocks, inlined, kernel_factory, launch

LOG2E, LN2 = float32(1.0 / math.log(2.0)), float32(math.log(2.0))
NEG_INF = float32(-np.inf)

PRECISION = "bf16"          # (tools/dev/run.py: checked against attention of the rounded
HEAD_SIZES = (32, 64)       # inputs, within bf16's tolerance; SDPA bf16 beside)
# a block's warps and a streamed tile's rows; in the simulator 2 warps and 16 rows, so that
# T=40 crosses two blocks of rows and three tiles
WARPS, COLS = (2, 16) if SIMULATOR else (4, 64)
ROWS = 16 * WARPS           # a block's rows: queries (forward, dq) or keys (dk, dv)
THREADS = 32 * WARPS
NT = COLS // 8              # the n8 tiles of a warp's [16, COLS] scores
INF = float32(np.inf)
BOUNDS = {} if SIMULATOR else dict(launch_bounds=(THREADS, 2))


def tile_functions(D):
    """The inlined device functions of the three kernels for heads of D (32 or 64), and KD,
    DN and the uint32 words of a staged tile."""
    KD, DN = D // 16, D // 8            # k16 steps along D; n8 tiles across D
    ROW_WORDS, CHUNKS = D // 2, D // 8  # a staged row: D bf16 in pairs, 16-byte chunks
    LOG_CHUNKS = CHUNKS.bit_length() - 1
    COPIES = COLS * CHUNKS // THREADS   # the 16-byte chunks a thread stages of a tile
    swizzled = swizzle(CHUNKS)

    @inlined
    def stage(tile, x, b, h, row0, T, tid):
        # tile (shared, COLS rows of ROW_WORDS words) = x[b, h, row0 : row0 + COLS] in bf16,
        # zeros past row T: a thread 8 values a chunk, two 16-byte loads and one store
        for r in range(COPIES):
            c = tid + r * THREADS
            i, chunk = c >> LOG_CHUNKS, c & (CHUNKS - 1)
            row = row0 + i
            x0 = x1 = x2 = x3 = x4 = x5 = x6 = x7 = float32(0.0)
            if row < T:
                x0, x1, x2, x3 = load4(x, (b, h, row, 8 * chunk))
                x4, x5, x6, x7 = load4(x, (b, h, row, 8 * chunk + 4))
            store4_u32(tile, (i * ROW_WORDS + 4 * swizzled(i, chunk),), bf16_pair(x0, x1),
                       bf16_pair(x2, x3), bf16_pair(x4, x5), bf16_pair(x6, x7))

    @inlined
    def pair_at(x, b, h, row, col, T):
        # x[b, h, row, col:col+2] as a bf16 pair; zeros past row T
        if row < T:
            return bf16_pair(x[b, h, row, col], x[b, h, row, col + 1])
        return uint32(0)

    @inlined
    def load_rows(frag, x, b, h, row0, T, lane):
        # frag[KD, 4] = the A fragments of x[b, h, row0 : row0 + 16, :] (16 x D), in bf16
        g, t = lane >> 2, lane & 3
        for s in range(KD):
            col = 16 * s + 2 * t
            frag[s, 0] = pair_at(x, b, h, row0 + g, col, T)
            frag[s, 1] = pair_at(x, b, h, row0 + g + 8, col, T)
            frag[s, 2] = pair_at(x, b, h, row0 + g, col + 8, T)
            frag[s, 3] = pair_at(x, b, h, row0 + g + 8, col + 8, T)

    @inlined
    def mma_into(acc, j, a0, a1, a2, a3, b0, b1):
        acc[j, 0], acc[j, 1], acc[j, 2], acc[j, 3] = mma_bf16(
            a0, a1, a2, a3, b0, b1, acc[j, 0], acc[j, 1], acc[j, 2], acc[j, 3])

    @inlined
    def scores(acc, frag, tile, lane):
        # acc[NT, 4] = the warp's rows (frag) . the tile's rows, along D: a [16, COLS] product.
        # The tile is B^T as it lies (rows n, pairs along k): ldmatrix gives B's fragments
        # of n8 tiles j, j + 1 in one; lanes 8q .. 8q+7 address matrix q's rows, q's high bit
        # picks the tile, its low bit the chunk
        row_in, chunk_in = (lane & 7) + 8 * (lane >> 4), (lane >> 3) & 1
        for j in range(NT):
            for e in range(4):
                acc[j, e] = float32(0.0)
        for s in range(KD):
            for j in range(0, NT, 2):
                r = 8 * j + row_in
                b0, b1, b2, b3 = ldmatrix_x4(
                    tile, (r * ROW_WORDS + 4 * swizzled(r, 2 * s + chunk_in),))
                mma_into(acc, j, frag[s, 0], frag[s, 1], frag[s, 2], frag[s, 3], b0, b1)
                mma_into(acc, j + 1, frag[s, 0], frag[s, 1], frag[s, 2], frag[s, 3], b2, b3)

    @inlined
    def pairs(acc, j, half):
        # the bf16 pair of accumulator tile j's row g (half 0) or g + 8 (half 1)
        return bf16_pair(acc[j, 2 * half], acc[j, 2 * half + 1])

    @inlined
    def accumulate_product(acc, weights, tile, lane):
        # acc[DN, 4] += weights . the tile: weights [16, COLS] as score accumulators (NT, 4),
        # rounded to bf16 into A fragments (two n8 tiles a k16 step, the module's doc), times
        # the tile's COLS rows of D (rows k, pairs along n: ldmatrix.trans; q's low bit picks
        # the half of the rows, its high bit the chunk)
        row_in, chunk_in = (lane & 7) + 8 * ((lane >> 3) & 1), lane >> 4
        for s in range(NT // 2):
            a0, a1 = pairs(weights, 2 * s, 0), pairs(weights, 2 * s, 1)
            a2, a3 = pairs(weights, 2 * s + 1, 0), pairs(weights, 2 * s + 1, 1)
            r = 16 * s + row_in
            for j in range(0, DN, 2):
                b0, b1, b2, b3 = ldmatrix_x4_trans(
                    tile, (r * ROW_WORDS + 4 * swizzled(r, j + chunk_in),))
                mma_into(acc, j, a0, a1, a2, a3, b0, b1)
                mma_into(acc, j + 1, a0, a1, a2, a3, b2, b3)

    @inlined
    def store_rows(x, acc, factor0, factor1, b, h, row0, T, lane):
        # x[b, h, row0 : row0 + 16, :] = acc (DN, 4) times factor0 (row g) or factor1 (g + 8)
        g, t = lane >> 2, lane & 3
        for j in range(DN):
            col = 8 * j + 2 * t
            for half in range(2):
                row = row0 + g + 8 * half
                factor = factor0 if half == 0 else factor1
                if row < T:
                    x[b, h, row, col] = acc[j, 2 * half] * factor
                    x[b, h, row, col + 1] = acc[j, 2 * half + 1] * factor

    return stage, load_rows, scores, accumulate_product, store_rows, KD, DN, D * COLS // 2


@kernel_factory
def forward_kernel(D):
    stage, load_rows, scores, accumulate_product, store_rows, KD, DN, TILE_WORDS = \
        tile_functions(D)

    @cuda.jit(**BOUNDS)
    def attention_forward_v8_kernel(out, lse, q, k, v, scale_log2):
        # out[B,H,T,D], lse[B,H,T] from q, k, v [B,H,T,D] float32; grid (B*H, T/ROWS), the last
        # rows (the most keys) first; scores in log2 units (S / sqrt(D) / ln 2), so that exp is
        # the hardware's exp2
        k_tile = cuda.shared.array(TILE_WORDS, uint32)
        v_tile = cuda.shared.array(TILE_WORDS, uint32)
        q_frag = cuda.local.array((KD, 4), uint32)
        s_acc = cuda.local.array((NT, 4), float32)
        o_acc = cuda.local.array((DN, 4), float32)
        H, T = q.shape[1], q.shape[2]
        b, h = cuda.blockIdx.x // H, cuda.blockIdx.x % H
        row0 = (cuda.gridDim.y - 1 - cuda.blockIdx.y) * ROWS
        tid = cuda.threadIdx.x
        warp, lane = tid >> 5, tid & 31
        g, t = lane >> 2, lane & 3
        wrow = row0 + 16 * warp                 # the warp's rows; the lane's: wrow + g (+ 8)
        load_rows(q_frag, q, b, h, wrow, T, lane)
        for j in range(DN):
            for e in range(4):
                o_acc[j, e] = float32(0.0)
        m0 = m1 = NEG_INF                       # each row's running max and sum (of this
        l0 = l1 = float32(0.0)                  # lane's columns: summed over the quad at the end)
        for n0 in range(0, min(row0 + ROWS, T), COLS):
            cuda.syncthreads()                  # (everyone is done with the last tiles)
            stage(k_tile, k, b, h, n0, T, tid)
            stage(v_tile, v, b, h, n0, T, tid)
            cuda.syncthreads()
            if n0 <= wrow + 15:                 # (else every key of the tile is in the future)
                scores(s_acc, q_frag, k_tile, lane)
                max0 = max1 = NEG_INF
                for j in range(NT):
                    key = n0 + 8 * j + 2 * t
                    for e in range(4):
                        query = wrow + g + 8 * (e >> 1)
                        s = s_acc[j, e] * scale_log2 if key + (e & 1) <= query else NEG_INF
                        s_acc[j, e] = s
                        if e < 2:
                            max0 = max(max0, s)
                        else:
                            max1 = max(max1, s)
                new0, new1 = max(m0, quad_max(max0)), max(m1, quad_max(max1))
                shrink0, shrink1 = math.exp2(m0 - new0), math.exp2(m1 - new1)
                m0, m1 = new0, new1
                l0, l1 = l0 * shrink0, l1 * shrink1
                for j in range(DN):
                    o_acc[j, 0] *= shrink0
                    o_acc[j, 1] *= shrink0
                    o_acc[j, 2] *= shrink1
                    o_acc[j, 3] *= shrink1
                for j in range(NT):
                    for e in range(4):
                        p = math.exp2(s_acc[j, e] - (m0 if e < 2 else m1))
                        if e < 2:
                            l0 += p
                        else:
                            l1 += p
                        s_acc[j, e] = p
                accumulate_product(o_acc, s_acc, v_tile, lane)
        l0, l1 = quad_sum(l0), quad_sum(l1)
        store_rows(out, o_acc, float32(1.0) / l0, float32(1.0) / l1, b, h, wrow, T, lane)
        if t == 0:
            if wrow + g < T:
                lse[b, h, wrow + g] = (m0 + math.log2(l0)) * LN2
            if wrow + g + 8 < T:
                lse[b, h, wrow + g + 8] = (m1 + math.log2(l1)) * LN2

    return attention_forward_v8_kernel


@kernel_factory
def dq_kernel(D):
    stage, load_rows, scores, accumulate_product, store_rows, KD, DN, TILE_WORDS = \
        tile_functions(D)

    @cuda.jit(**BOUNDS)
    def attention_dq_v8_kernel(dq, dout, q, k, v, lse, delta, scale_log2, scale):
        # dq[B,H,T,D]: the forward's walk over the key tiles, P from lse
        k_tile = cuda.shared.array(TILE_WORDS, uint32)
        v_tile = cuda.shared.array(TILE_WORDS, uint32)
        q_frag = cuda.local.array((KD, 4), uint32)
        dout_frag = cuda.local.array((KD, 4), uint32)
        s_acc = cuda.local.array((NT, 4), float32)
        dp_acc = cuda.local.array((NT, 4), float32)
        dq_acc = cuda.local.array((DN, 4), float32)
        H, T = q.shape[1], q.shape[2]
        b, h = cuda.blockIdx.x // H, cuda.blockIdx.x % H
        row0 = (cuda.gridDim.y - 1 - cuda.blockIdx.y) * ROWS
        tid = cuda.threadIdx.x
        warp, lane = tid >> 5, tid & 31
        g, t = lane >> 2, lane & 3
        wrow = row0 + 16 * warp
        load_rows(q_frag, q, b, h, wrow, T, lane)
        load_rows(dout_frag, dout, b, h, wrow, T, lane)
        # the lane's two rows' lse (log2 units) and delta; rows past T: P = 0
        lse0 = lse[b, h, wrow + g] * LOG2E if wrow + g < T else INF
        lse1 = lse[b, h, wrow + g + 8] * LOG2E if wrow + g + 8 < T else INF
        delta0 = delta[b, h, wrow + g] if wrow + g < T else float32(0.0)
        delta1 = delta[b, h, wrow + g + 8] if wrow + g + 8 < T else float32(0.0)
        for j in range(DN):
            for e in range(4):
                dq_acc[j, e] = float32(0.0)
        for n0 in range(0, min(row0 + ROWS, T), COLS):
            cuda.syncthreads()
            stage(k_tile, k, b, h, n0, T, tid)
            stage(v_tile, v, b, h, n0, T, tid)
            cuda.syncthreads()
            if n0 <= wrow + 15:
                scores(s_acc, q_frag, k_tile, lane)         # S
                scores(dp_acc, dout_frag, v_tile, lane)     # dP = dO V^T
                for j in range(NT):
                    key = n0 + 8 * j + 2 * t
                    for e in range(4):
                        query = wrow + g + 8 * (e >> 1)
                        p = float32(0.0)
                        if key + (e & 1) <= query:
                            p = math.exp2(s_acc[j, e] * scale_log2 - (lse0 if e < 2 else lse1))
                        s_acc[j, e] = p * (dp_acc[j, e] - (delta0 if e < 2 else delta1))
                accumulate_product(dq_acc, s_acc, k_tile, lane)     # dQ += dS K
        store_rows(dq, dq_acc, scale, scale, b, h, wrow, T, lane)

    return attention_dq_v8_kernel


@kernel_factory
def dkdv_kernel(D):
    stage, load_rows, scores, accumulate_product, store_rows, KD, DN, TILE_WORDS = \
        tile_functions(D)

    @cuda.jit(**BOUNDS)
    def attention_dkdv_v8_kernel(dk, dv, dout, q, k, v, lse, delta, scale_log2, scale):
        # dk, dv [B,H,T,D]: a block of key rows walks the query tiles from the diagonal on;
        # grid (B*H, T/ROWS), the first key rows (the most queries) first
        q_tile = cuda.shared.array(TILE_WORDS, uint32)
        dout_tile = cuda.shared.array(TILE_WORDS, uint32)
        lse_tile = cuda.shared.array(COLS, float32)
        delta_tile = cuda.shared.array(COLS, float32)
        k_frag = cuda.local.array((KD, 4), uint32)
        v_frag = cuda.local.array((KD, 4), uint32)
        s_acc = cuda.local.array((NT, 4), float32)
        dp_acc = cuda.local.array((NT, 4), float32)
        dk_acc = cuda.local.array((DN, 4), float32)
        dv_acc = cuda.local.array((DN, 4), float32)
        H, T = q.shape[1], q.shape[2]
        b, h = cuda.blockIdx.x // H, cuda.blockIdx.x % H
        row0 = cuda.blockIdx.y * ROWS
        tid = cuda.threadIdx.x
        warp, lane = tid >> 5, tid & 31
        g, t = lane >> 2, lane & 3
        wrow = row0 + 16 * warp                 # the warp's key rows
        load_rows(k_frag, k, b, h, wrow, T, lane)
        load_rows(v_frag, v, b, h, wrow, T, lane)
        for j in range(DN):
            for e in range(4):
                dk_acc[j, e] = float32(0.0)
                dv_acc[j, e] = float32(0.0)
        for n0 in range(row0 - row0 % COLS, T, COLS):
            cuda.syncthreads()
            stage(q_tile, q, b, h, n0, T, tid)
            stage(dout_tile, dout, b, h, n0, T, tid)
            if tid < COLS:                      # the tile's queries' lse (log2) and delta
                lse_tile[tid] = lse[b, h, n0 + tid] * LOG2E if n0 + tid < T else INF
                delta_tile[tid] = delta[b, h, n0 + tid] if n0 + tid < T else float32(0.0)
            cuda.syncthreads()
            if n0 + COLS > wrow:                # (else every query of the tile is in the past)
                scores(s_acc, k_frag, q_tile, lane)         # S^T
                scores(dp_acc, v_frag, dout_tile, lane)     # dP^T = V dO^T
                for j in range(NT):
                    col = 8 * j + 2 * t
                    for e in range(4):
                        query, key = n0 + col + (e & 1), wrow + g + 8 * (e >> 1)
                        p = float32(0.0)
                        if query >= key:
                            p = math.exp2(s_acc[j, e] * scale_log2 - lse_tile[col + (e & 1)])
                        s_acc[j, e] = p                                         # P^T
                        dp_acc[j, e] = p * (dp_acc[j, e] - delta_tile[col + (e & 1)])  # dS^T
                accumulate_product(dv_acc, s_acc, dout_tile, lane)  # dV += P^T dO
                accumulate_product(dk_acc, dp_acc, q_tile, lane)    # dK += dS^T Q
        store_rows(dk, dk_acc, scale, scale, b, h, wrow, T, lane)
        store_rows(dv, dv_acc, float32(1.0), float32(1.0), b, h, wrow, T, lane)

    return attention_dkdv_v8_kernel


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
    launch(forward_kernel(D), (B * H, blocks(T, ROWS)), THREADS, out, lse, q, k, v,
           np.float32(LOG2E / math.sqrt(D)))


_deltas = {}


def backward(dq, dk, dv, dout, q, k, v, out, lse):
    """delta first, then the dq kernel and the dk/dv kernel."""
    B, H, T, D = q.shape
    if (B, H, T) not in _deltas:      # (delta_i = dout_i . out_i, the backward's scratch)
        _deltas[B, H, T] = cuda.device_array((B, H, T), np.float32)
    delta = _deltas[B, H, T]
    scale = np.float32(1.0 / math.sqrt(D))
    scale_log2 = np.float32(LOG2E * scale)
    row_delta(delta, dout, out)
    grid = (B * H, blocks(T, ROWS))
    launch(dq_kernel(D), grid, THREADS, dq, dout, q, k, v, lse, delta, scale_log2, scale)
    launch(dkdv_kernel(D), grid, THREADS, dk, dv, dout, q, k, v, lse, delta, scale_log2, scale)
