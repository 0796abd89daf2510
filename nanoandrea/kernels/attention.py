"""Causal softmax attention over all heads in one launch.

    q, k, v, out : [B,H,T,D]      (after split_heads: each head's T x D slice is contiguous;
                                   the kernels take any strides whose rows are contiguous, so
                                   out, and backward's dq, dk, dv, may be heads_view's of the
                                   [B,T,C] concat: the store merges the heads)
    lse          : [B,H,T]        log-sum-exp of each row's scaled scores, saved for backward
    delta        : [B,H,T]        scratch of the backward: delta_i = dout_i . out_i

    S_ij = (q_i . k_j) / sqrt(D)  for j <= i   (causal: a position sees itself and the past)
    P_ij = exp(S_ij - lse_i)      lse_i = log sum_{j<=i} exp(S_ij)
    out_i = sum_j P_ij v_j

Backward (dout given), with delta_i = sum_j P_ij (dout_i . v_j) = dout_i . out_i:
    dv_j = sum_{i>=j} P_ij dout_i
    dS_ij = P_ij (dout_i . v_j - delta_i)
    dq_i = sum_{j<=i} dS_ij k_j / sqrt(D)        dk_j = sum_{i>=j} dS_ij q_i / sqrt(D)

Forward saves only lse (B*H*T floats), never the T x T matrix: backward recomputes P from it.

Dropout on the attention probabilities (as GPT-2 trains): out_i = sum_j P_ij G_ij v_j with
G_ij = 0 or 1/(1-p), a hash of (seed, site, ((b*H + h)*T + i)*T + j) - the counter-based
generator of kernels/dropout.py, so backward recomputes G instead of storing it. Then
    dv_j = sum_i P_ij G_ij dout_i,   dS_ij = P_ij (G_ij dout_i . v_j - delta_i),
and delta_i = dout_i . out_i still holds. `drop` = (seed int64[1], site, threshold, keep) as made
by dropout_arguments; threshold 0 means no dropout.

The kernels do not know about heads: a thread block takes one (batch, head) pair (and, in the
fast kernels, a range of its rows), and the launch grid supplies the parallelism over all B*H.
  reference kernels  any D, one block per (batch, head); a thread walks the keys of its row
                     twice (normaliser first, then the weighted sum of values), reading q, k, v
                     straight from global memory. Readable, and the fallback for D=72 or D=8.
  fast kernels       D a compile-time constant (32 or 64), flash-attention-2 tiles computed
                     like a register-blocked SGEMM (tile_functions): a block takes a tile of
                     query rows, stages it in shared memory, and walks the key tiles up to the
                     diagonal. Per key tile, S = Q K^T is a small matrix product in which each
                     thread owns a 4x4 patch in registers, its operands read from shared memory
                     16 bytes (4 floats) at a time; the softmax is online (running row max and
                     sum, the max shared through shared memory by the threads of a row); P goes
                     to shared memory and O += P V is a second product, each thread owning a
                     4 x TD patch of O. Backward, no atomics: dk/dv (a key tile, walking
                     query tiles) recomputes P from lse, and also makes dq's share of each
                     (query tile, key tile) pair, dS K, which attention_dq_sum_kernel adds
                     up in a fixed order (so dq is reproducible); S and dP are computed once
                     for all three gradients. (Or, as the tiles say: a dq kernel of its own, a
                     query tile walking key tiles, computing S and dP again.) Grid (B*H, row
                     tiles), the heaviest row tiles (most keys) launched first.
                     Before them, delta (attention_delta): a warp per DELTA_ROWS rows, 16-byte
                     loads, the lanes' sums met in warp shuffles (reduce.warp_sum); a thread
                     per row for unaligned rows.
  tensor forward     the fast forward's flash tiles on the tensor cores (kernels/mma.py): a
                     warp per 16 query rows, S and O as mma fragments, every product in three
                     TF32 mma's to float32 accuracy (make_tensor_forward_kernel). What "auto"
                     runs without dropout on the GPU; the backward stays the fast one.
"""
import math

import numpy as np
from numba import cuda, float32, int64, uint64

from .dropout import dropout_constants, keep_scale, keep_scale_numpy
from .launch import (SIMULATOR, STATIC_SHARED_BYTES, blocks, check, check_float32,
                     check_float32_rows, check_shape, elementwise_grid, inlined, launch, scratch)
from .mma import mma_tf32, split_tf32
from .reduce import WARP, quad_max, quad_sum, warp_barrier, warp_sum
from .sharedmem import dynamic_shared_floats, shared_tile
from .vector import add4, aligned16, load4, store4

NEG_INF = float32(-np.inf)
LOG2E = float32(1.0 / math.log(2.0))
LN2 = float32(math.log(2.0))
FAST_HEAD_SIZES = (32, 64)


# --- reference kernels: any head size ------------------------------------------------------

@inlined
def row_dot(x, y, b, h, i, j, D):
    # x[b,h,i,:] . y[b,h,j,:]
    total = float32(0.0)
    for d in range(D):
        total += x[b, h, i, d] * y[b, h, j, d]
    return total


@inlined
def dropout_factor(seed, site, threshold, keep, b, h, i, j, H, T):
    # G_ij of (batch b, head h): 1 without dropout, else 0 or 1/(1-p)
    if threshold == 0:
        return float32(1.0)
    return keep_scale(seed[0], site, ((b * H + h) * T + i) * T + j, threshold, keep)


@inlined
def no_dropout(seed, site, threshold, keep, b, h, i, j, H, T):
    # G_ij = 1: the fast kernels built for dropout_p = 0, where the hash and the branch around
    # it are not compiled in at all
    return float32(1.0)


def dropout_function(dropout):
    """What a fast kernel calls for G_ij: dropout_factor, or no_dropout when it is built for
    dropout_p = 0 (dropout False)."""
    return dropout_factor if dropout else no_dropout


@cuda.jit
def attention_forward_reference_kernel(out, lse, q, k, v, scale, seed, site, threshold, keep):
    # out[B,H,T,D], lse[B,H,T] from q, k, v [B,H,T,D]; grid B*H, block: threads share the rows
    B, H, T, D = q.shape
    b = cuda.blockIdx.x // H
    h = cuda.blockIdx.x % H
    for i in range(cuda.threadIdx.x, T, cuda.blockDim.x):
        # pass 1: the softmax normaliser, as a running max m and sum l of exp(S - m)
        m = NEG_INF
        l = float32(0.0)
        for j in range(i + 1):
            s = row_dot(q, k, b, h, i, j, D) * scale
            m_new = max(m, s)
            l = l * math.exp(m - m_new) + math.exp(s - m_new)
            m = m_new
        row_lse = m + math.log(l)
        lse[b, h, i] = row_lse
        # pass 2: out_i = sum_j P_ij v_j, accumulated in place in out's row
        for d in range(D):
            out[b, h, i, d] = float32(0.0)
        for j in range(i + 1):
            p = math.exp(row_dot(q, k, b, h, i, j, D) * scale - row_lse)
            p *= dropout_factor(seed, site, threshold, keep, b, h, i, j, H, T)
            for d in range(D):
                out[b, h, i, d] += p * v[b, h, j, d]


@cuda.jit
def attention_backward_reference_kernel(dq, dk, dv, delta, dout, q, k, v, out, lse, scale,
                                        seed, site, threshold, keep, accumulate):
    # dq, dk, dv [B,H,T,D] (+)= gradients; delta[B,H,T] scratch; grid B*H.
    # The block owns its head, so the phases only need block-wide barriers between them.
    B, H, T, D = q.shape
    b = cuda.blockIdx.x // H
    h = cuda.blockIdx.x % H
    first = cuda.threadIdx.x
    stride = cuda.blockDim.x
    for i in range(first, T, stride):                       # delta_i = dout_i . out_i
        delta[b, h, i] = row_dot(dout, out, b, h, i, i, D)
        if not accumulate:
            for d in range(D):
                dq[b, h, i, d] = float32(0.0)
                dk[b, h, i, d] = float32(0.0)
                dv[b, h, i, d] = float32(0.0)
    cuda.syncthreads()
    for i in range(first, T, stride):                       # dq_i: a thread per query row
        for j in range(i + 1):
            p = math.exp(row_dot(q, k, b, h, i, j, D) * scale - lse[b, h, i])
            g = dropout_factor(seed, site, threshold, keep, b, h, i, j, H, T)
            ds = p * (g * row_dot(dout, v, b, h, i, j, D) - delta[b, h, i]) * scale
            for d in range(D):
                dq[b, h, i, d] += ds * k[b, h, j, d]
    for j in range(first, T, stride):                       # dk_j, dv_j: a thread per key row
        for i in range(j, T):
            p = math.exp(row_dot(q, k, b, h, i, j, D) * scale - lse[b, h, i])
            g = dropout_factor(seed, site, threshold, keep, b, h, i, j, H, T)
            ds = p * (g * row_dot(dout, v, b, h, i, j, D) - delta[b, h, i]) * scale
            for d in range(D):
                dv[b, h, j, d] += p * g * dout[b, h, i, d]
                dk[b, h, j, d] += ds * q[b, h, i, d]


# --- fast kernels: D known at compile time, flash-attention-2 tiles ----------------------------

@inlined
def fast_exp(x):
    # e^x as 2^(x log2 e): a multiply and the hardware's ex2 (math.exp2), where math.exp costs
    # about ten instructions of range reduction. A few float32 ulps off where it matters (x near
    # 0, the weights a softmax row is made of); x = -inf gives 0
    return math.exp2(x * LOG2E)


@inlined
def block_rows(H, T, rows_per_block, heavy_first):
    # this block's (batch, head) and its rows [row_start, row_end): grid (B*H, T/rows_per_block).
    # heavy_first: block y takes the y-th range from the end, so the longest causal rows (the
    # most key tiles) start first and the short ones fill the gaps at the end of the launch
    y = cuda.gridDim.y - 1 - cuda.blockIdx.y if heavy_first else cuda.blockIdx.y
    row_start = y * rows_per_block
    return cuda.blockIdx.x // H, cuda.blockIdx.x % H, row_start, min(T, row_start + rows_per_block)


@inlined
def store_split4(tiles, index, x0, x1, x2, x3):
    # tiles = (hi, lo): four floats split into TF32 parts (mma.split_tf32), one 16-byte store
    # into each tile
    hi, lo = tiles
    h0, l0 = split_tf32(x0)
    h1, l1 = split_tf32(x1)
    h2, l2 = split_tf32(x2)
    h3, l3 = split_tf32(x3)
    store4(hi, index, h0, h1, h2, h3)
    store4(lo, index, l0, l1, l2, l3)


def make_stage(D, THREADS, VECTOR, put=store4):
    """(stage, R_STEP): the device function that copies rows of one head's [T, D] into a shared
    tile, for a block of THREADS threads, which copies R_STEP rows a pass (tiles hold a multiple
    of R_STEP rows); VECTOR as in tile_functions. put(tile, (r, d), x0, x1, x2, x3) stores each
    4 floats: store4, or store_split4 (`tile` then a pair of tiles)."""
    CHUNKS = D // 4                     # 4-float chunks in a row of D; a pass of the block
    C_STEP = min(CHUNKS, THREADS)       # copies R_STEP rows, C_STEP chunks of each row per
    R_STEP = THREADS // C_STEP          # thread step
    assert CHUNKS % C_STEP == 0, (D, THREADS)

    @inlined
    def stage(tile, x, row0, n_rows, T, scale):
        # tile[r, d] = x[row0 + r, d] * scale for r < n_rows (x: one head's [T, D]), zeros past T,
        # in 4-float chunks: one 16-byte load from global memory (VECTOR; else four 4-byte ones,
        # no alignment asked of x), one 16-byte store (put). Consecutive threads take consecutive
        # chunks of a row (a warp reads 512 consecutive bytes): thread t copies
        # chunks t % C_STEP + s*C_STEP of rows t // C_STEP + n*R_STEP. Indices are uint64: for
        # a signed index Numba adds a negative-index wraparound (a compare and a select per
        # index), which the compiler cannot drop here.
        d_first = uint64(cuda.threadIdx.x % C_STEP * 4)
        r_first = uint64(cuda.threadIdx.x // C_STEP)
        for n in range(n_rows // R_STEP):
            r = r_first + uint64(n * R_STEP)
            row = uint64(row0) + r
            inside = row < uint64(T)
            for step in range(CHUNKS // C_STEP):
                d = d_first + uint64(step * C_STEP * 4)
                if inside and VECTOR:
                    x4 = load4(x, (row, d))
                    put(tile, (r, d), x4[0] * scale, x4[1] * scale, x4[2] * scale,
                        x4[3] * scale)
                elif inside:
                    put(tile, (r, d), x[row, d] * scale, x[row, d + uint64(1)] * scale,
                        x[row, d + uint64(2)] * scale, x[row, d + uint64(3)] * scale)
                else:
                    zero = float32(0.0)
                    put(tile, (r, d), zero, zero, zero, zero)

    return stage, R_STEP


def tile_functions(D, ROWS, COLS, TM, TN, SCORE_STEPS=2, VECTOR=True):
    """The device functions a tiled kernel is built from, for one tile shape.

    A block owns ROWS rows (queries; keys in dk/dv) and streams tiles of COLS columns (keys;
    queries in dk/dv) through shared memory. Its THREADS = (ROWS/TM) x (COLS/TN) threads sit on a
    grid of THREADS_M x THREADS_N; thread (ty, tx) owns, in registers,
        the TM x TN scores   rows row_of(ty, i), columns tx + j*THREADS_N
        the TM x TD outputs  the same rows, head dimensions dim_of(tx, j)   (TD = D/THREADS_N)
    where row_of and dim_of make runs of 4 consecutive indices, as in the blocked SGEMM:
        row_of(ty, i) = ty*4 + i%4 + (i//4)*4*THREADS_M    (TM/4 runs: rows ty*4 + {0..3}, ...)
        dim_of(tx, j) = tx*4 + j%4 + (j//4)*4*THREADS_N    (TD/4 runs)
    so that a thread reads 4 of its rows (or head dimensions) with one 16-byte load (load4). A
    row's scores and its outputs live in the same THREADS_N threads, which is what lets the
    softmax statistics of a row rescale that row's outputs without moving them.

    Every staged tile is as in global memory, x_tile[r, d] = x[row0 + r, d]: one copy of each of
    q, k, v, dout serves both products that use it.
      scores_product  S += X Y^T, the sum over d. Both tiles are read along d, 4 d at a time:
                      per 4 d, TM + TN 16-byte loads feed 4*TM*TN fused multiply-adds, the
                      count of an SGEMM whose operands are k-major. The score columns are
                      strided (tx + j*THREADS_N) so that the 8 threads of a 16-byte access
                      phase read 8 consecutive rows of Y: 8 different bank groups (padded).
      exchange        the thread's TM x TN values (P, dS) into a shared tile e[c, r],
                      transposed, 4 rows r per 16-byte store.
      output_product  O += E^T Y, the sum over the COLS columns: e[c, r] and y_tile[c, d] are
                      both k-major (c the outer index), so per c, TM/4 + TD/4 16-byte loads
                      feed TM * TD multiply-adds: the SGEMM's outer product.
    Every tile's row length is padded(n): 16-byte aligned rows, no bank conflicts. The products
    take SCORE_STEPS (1 or 2) steps of 4 d, or 4 columns c, per loop trip, unrolled by hand.
    VECTOR: the tiles are staged from global memory 16 bytes at a time (the heads' rows 16-byte
    aligned: vector.aligned16), else 4 bytes at a time.

    The THREADS_N threads of a row are consecutive lanes of one warp (THREADS_N divides 32), so
    what they exchange about their own rows (row max and sum, their rows of an exchange tile)
    needs only that warp's barrier (warp_barrier), not the block's.
    """
    THREADS_M = ROWS // TM
    THREADS_N = COLS // TN
    TD = D // THREADS_N
    THREADS = THREADS_M * THREADS_N
    assert ROWS % TM == 0 and COLS % TN == 0 and D % THREADS_N == 0, (D, ROWS, COLS, TM, TN)
    assert TM % 4 == 0 and TD % 4 == 0, ("runs of 4 rows and head dimensions", D, TM, TD)
    stage, R_STEP = make_stage(D, THREADS, VECTOR)
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
        # acc[TM, TN] += sum_{d <= e < d+4} x[row_of(ty, i), e] y[tx + j*THREADS_N, e]: TN + TM
        # 16-byte loads feed 4 * TM * TN fused multiply-adds (y's 4 x TN values are held while
        # x's rows stream through, 4 values at a time)
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
        # SCORE_STEPS steps per loop trip (a manual unroll: the compiler does not unroll a loop
        # this large, and a trip's counting costs ~13 instructions)
        ty, tx = thread_position()
        y_frag = cuda.local.array((TN, 4), float32)
        for d in range(0, D, 4 * SCORE_STEPS):
            scores_step(acc, x, y, y_frag, d, ty, tx)
            if SCORE_STEPS == 2:
                scores_step(acc, x, y, y_frag, d + 4, ty, tx)

    @inlined
    def exchange(tile, values):
        # tile[tx + j*THREADS_N, row_of(ty, i)] = values[i, j]: this thread's TM x TN values into
        # a shared tile, transposed (column-major), so output_product reads it along r. One
        # 16-byte store per run of 4 rows; the 8 threads of an access phase write 8 consecutive
        # rows of the tile, 8 different bank groups
        ty, tx = thread_position()
        for j in range(TN):
            c = tx + j * THREADS_N
            for a in range(TM // 4):
                store4(tile, (c, row_of(ty, 4 * a)), values[4 * a, j], values[4 * a + 1, j],
                       values[4 * a + 2, j], values[4 * a + 3, j])

    @inlined
    def output_step(acc, e, y, e_frag, y_frag, c, ty, tx):
        # acc[TM, TD] += e[c, row_of(ty, i)] y[c, dim_of(tx, j)]: TM/4 + TD/4 16-byte loads
        # feed TM * TD fused multiply-adds, the outer product of the blocked SGEMM
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

    return (thread_position, row_of, dim_of, stage, scores_product, exchange,
            output_product, store_rows)


def make_recompute(scores_product, TM, TN):
    """What both backward kernels recompute for each pair of tiles: s = x y^T, dp = u w^T."""
    @inlined
    def recompute(s, x, y, dp, u, w):
        for i in range(TM):
            for j in range(TN):
                s[i, j] = float32(0.0)
                dp[i, j] = float32(0.0)
        scores_product(s, x, y)
        scores_product(dp, u, w)
    return recompute


def make_attention_kernels(D, forward_tile=None, dq_tile=None, dkdv_tile=None, vector=True,
                           dropout=True):
    """Forward, dq and dk/dv kernels for head size D (a compile-time constant).

    Each tile is (ROWS, COLS, TM, TN) as in tile_functions, optionally with a fifth entry
    blocks_per_sm (see launch_bounds); for the forward a sixth, wide_staging (default True:
    16-byte staging loads where the arrays allow); for dk/dv a sixth, its scores steps per
    loop trip (default 1), and a seventh, with_dq (default False: dq's shares made there, so
    that attention_backward runs no dq kernel); the defaults are TILES[D]. Each kernel has
    attributes `threads` (its block) and `rows` (its ROWS: rows of a block when
    rows_per_block is not given).
    vector: q, k, v and dout may be staged 16 bytes at a time (their rows 16-byte aligned;
    the forward only where its tile's wide_staging allows).
    dropout: False builds the kernels for dropout_p = 0 (no_dropout: the drop arguments are
    not read).
    """
    forward_tile, dq_tile, dkdv_tile = (given or default for given, default in
                                        zip((forward_tile, dq_tile, dkdv_tile), TILES[D]))
    return (make_forward_kernel(D, *forward_tile, vector=vector, dropout=dropout),
            make_dq_kernel(D, *dq_tile, vector=vector, dropout=dropout),
            make_dkdv_kernel(D, *dkdv_tile, vector=vector, dropout=dropout))


def tile_constants(D, ROWS, COLS, TM, TN):
    """THREADS_M, THREADS_N, TD as in tile_functions; the row lengths of a staged tile [n, D]
    and of an exchange tile [COLS, ROWS]."""
    THREADS_N = COLS // TN
    return ROWS // TM, THREADS_N, D // THREADS_N, padded(D), padded(ROWS)


def padded(n):
    """Row length of a shared tile whose rows hold n floats (n a multiple of 4), accessed 16
    bytes at a time: a multiple of 4 (rows stay 16-byte aligned) whose quarter is odd. A 16-byte
    access is served 8 threads at a time, and 8 threads that touch 8 consecutive rows at the
    same column then hit the 8 different groups of 4 banks."""
    return n + 4 if n % 8 == 0 else n


def with_shape(kernel, threads, rows, blocks_per_sm):
    """The kernel, labelled with its block size and its tile of rows (for the launchers) and
    its launch bounds (for tools/kernel_report.py, which compiles it again)."""
    kernel.threads = threads
    kernel.rows = rows
    kernel.launch_bounds = launch_bounds(threads, blocks_per_sm).get("launch_bounds")
    return kernel


def launch_bounds(threads, blocks_per_sm):
    """cuda.jit's arguments asking that blocks_per_sm blocks fit on a multiprocessor (which caps
    the registers per thread at 65536 / (threads * blocks_per_sm)); 0: no cap. The simulator
    has no registers to cap (and its jit takes no launch_bounds)."""
    return dict(launch_bounds=(threads, blocks_per_sm)) if blocks_per_sm and not SIMULATOR else {}


def make_forward_kernel(D, ROWS, COLS, TM, TN, blocks_per_sm=0, wide_staging=True, vector=True,
                        dropout=True):
    # wide_staging: stage 16 bytes at a time where the arrays allow it (vector); at D=32 the
    # 4-byte staging kept the kernel at 96 registers (150 with 16-byte loads, which ran 10%
    # slower: session 6, run 2)
    (thread_position, row_of, dim_of, stage, scores_product, exchange,
     output_product, _) = tile_functions(D, ROWS, COLS, TM, TN, VECTOR=vector and wide_staging)
    factor = dropout_function(dropout)
    THREADS_M, THREADS_N, TD, D_ROW, P_ROW = tile_constants(D, ROWS, COLS, TM, TN)

    @cuda.jit(**launch_bounds(THREADS_M * THREADS_N, blocks_per_sm))
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

    return with_shape(attention_forward_kernel, THREADS_M * THREADS_N, ROWS, blocks_per_sm)


# --- tensor-core forward: 3xTF32 mma's, D = 32 or 64, no dropout --------------------------------

def make_tensor_forward_kernel(D, WARPS, COLS, blocks_per_sm=0, vector=True):
    """The forward on the tensor cores (kernels/mma.py), at float32 accuracy: every product
    split in three TF32 mma's (Ahi Bhi + Ahi Blo + Alo Bhi), as PyTorch's float32 attention
    computes. A block of WARPS warps takes ROWS = 16 WARPS query rows, 16 a warp (one mma's
    rows), and walks key tiles of COLS (a multiple of 8); no dropout (the FFMA kernel takes
    dropout_p > 0). The same online softmax as attention_forward_kernel, on mma fragments:

      S = Q K^T   a warp's [16, COLS]: COLS/8 fragments of 16 x 8 in registers (lane (g, t)
                  of the warp holds rows g, g+8 and columns 2t, 2t+1 of each), accumulated
                  over D/8 steps of d. A step reads Q's A fragment (rows x d) from q_tile and
                  splits it, then one mma chain a fragment: COLS/8 independent chains, which
                  is what keeps the tensor cores busy. K's B fragments (d x keys) come split
                  already: k was split into its TF32 parts as it was staged (store_split4,
                  once a block, not once a warp). q is staged times log2(e)/sqrt(D), so that
                  exp2 gives the softmax's exponentials.
      softmax     a row's COLS values are in the 4 lanes of a quad: its max meets in two
                  shuffles (reduce.quad_max); each lane keeps its part of the row sum until
                  the end (reduce.quad_sum).
      O += P V    P goes through the warp's rows of p_tile (which takes the k tiles' place
                  once every warp is done with them) to come back as A fragments; V's B
                  fragments from the v tiles (split as k's); O [16, D] a warp, D/8 fragments
                  in registers, one mma chain each.
    Every array a lane keeps in registers (S, O and a fragment) is indexed only in the inner
    loops, which the compiler unrolls; the outer loops (over d steps, key steps) read shared
    memory only. Shared tiles in dynamic shared memory, rows padded so that the 32 lanes of a
    fragment's read hit 32 banks: q's and the k tiles' rows D + 4 floats (lanes read rows g,
    columns t), the v tiles' D + 8 (rows t, columns g), p_tile's COLS + 4.
    """
    ROWS = 16 * WARPS
    THREADS = WARP * WARPS
    ONE, TWO, FOUR, EIGHT = uint64(1), uint64(2), uint64(4), uint64(8)
    D_STEPS = D // 8            # k-steps of S = Q K^T along d, and O's fragments along d
    KEY_STEPS = COLS // 8       # S's fragments along the keys, k-steps of O += P V
    K_ROW, V_ROW, P_ROW = D + 4, D + 8, COLS + 4
    K_LO, V_HI, V_LO, Q_AT = (COLS * K_ROW, 2 * COLS * K_ROW, COLS * (2 * K_ROW + V_ROW),
                              2 * COLS * (K_ROW + V_ROW))          # (offsets, in floats)
    SHARED_BYTES = 4 * (Q_AT + ROWS * K_ROW)
    stage, R_STEP = make_stage(D, THREADS, vector)
    stage_split, _ = make_stage(D, THREADS, vector, store_split4)
    assert D % 8 == 0 and COLS % 8 == 0 and (ROWS % R_STEP, COLS % R_STEP) == (0, 0), \
        (D, WARPS, COLS)
    assert ROWS * P_ROW <= 2 * COLS * K_ROW, ("p_tile in the k tiles' place", D, WARPS, COLS)

    @inlined
    def mma3(c0, c1, c2, c3, a_hi, a_lo, b_hi0, b_hi1, b_lo0, b_lo1):
        # (c0..c3) + A B in three mma's, the small parts first: A = a_hi + a_lo (4 fragment
        # floats each), B = b_hi + b_lo (2 each)
        c0, c1, c2, c3 = mma_tf32(a_lo[0], a_lo[1], a_lo[2], a_lo[3], b_hi0, b_hi1,
                                  c0, c1, c2, c3)
        c0, c1, c2, c3 = mma_tf32(a_hi[0], a_hi[1], a_hi[2], a_hi[3], b_lo0, b_lo1,
                                  c0, c1, c2, c3)
        return mma_tf32(a_hi[0], a_hi[1], a_hi[2], a_hi[3], b_hi0, b_hi1, c0, c1, c2, c3)

    @inlined
    def read_fragment(hi, lo, tile, row, col):
        # an A fragment at (row, col) of a shared tile, split: rows row, row+8, columns col,
        # col+4 (the lane's g and t already in row and col; uint64 indices, as in stage)
        hi[0], lo[0] = split_tf32(tile[row, col])
        hi[1], lo[1] = split_tf32(tile[row + EIGHT, col])
        hi[2], lo[2] = split_tf32(tile[row, col + FOUR])
        hi[3], lo[3] = split_tf32(tile[row + EIGHT, col + FOUR])

    @inlined
    def store_row(out, lse, o, b, h, row, half, m, total, t):
        # the lane's part of a finished row: out[b, h, row, columns 2t, 2t+1 of each 8] from
        # O's fragments (half 0: their rows g, c0 and c1; half 1: rows g+8, c2 and c3), scaled
        # by 1/total; lse from lane t = 0 (m in log2 units)
        inv_l = float32(1.0) / total
        for i in range(D_STEPS):
            out[b, h, row, i * 8 + 2 * t] = o[i, 2 * half] * inv_l
            out[b, h, row, i * 8 + 2 * t + 1] = o[i, 2 * half + 1] * inv_l
        if t == 0:
            lse[b, h, row] = m * LN2 + math.log(total)

    @cuda.jit(**launch_bounds(THREADS, blocks_per_sm))
    def attention_forward_tensor_kernel(out, lse, q, k, v, scale, rows_per_block):
        # out[B,H,T,D], lse[B,H,T] from q, k, v [B,H,T,D]; grid (B*H, T/rows_per_block), block
        # WARPS warps; warp w owns rows 16w .. 16w+15 of each tile of ROWS rows.
        buffer = dynamic_shared_floats()
        k_hi = shared_tile(buffer, 0, COLS, K_ROW)          # k[j0 + c, d], split
        k_lo = shared_tile(buffer, K_LO, COLS, K_ROW)
        p_tile = shared_tile(buffer, 0, ROWS, P_ROW)        # P, in the k tiles' place
        v_hi = shared_tile(buffer, V_HI, COLS, V_ROW)       # v[j0 + c, d], split
        v_lo = shared_tile(buffer, V_LO, COLS, V_ROW)
        q_tile = shared_tile(buffer, Q_AT, ROWS, K_ROW)     # q[row_base + r, d] log2(e)/sqrt(D)
        a_hi = cuda.local.array(4, float32)                 # an A fragment, split
        a_lo = cuda.local.array(4, float32)
        s = cuda.local.array((KEY_STEPS, 4), float32)       # the lane's S values, then P's
        o = cuda.local.array((D_STEPS, 4), float32)         # O's fragments
        B, H, T, _ = q.shape
        b, h, row_start, row_end = block_rows(H, T, rows_per_block, True)
        lane = uint64(cuda.threadIdx.x % WARP)              # (shared tiles' indices uint64)
        g = lane // FOUR
        t = lane % FOUR
        r = uint64(cuda.threadIdx.x // WARP * 16) + g       # this lane's rows: r, r + 8
        for row_base in range(row_start, row_end, ROWS):
            stage(q_tile, q[b, h], row_base, ROWS, T, scale * LOG2E)
            for i in range(D_STEPS):
                for e in range(4):
                    o[i, e] = float32(0.0)
            m0 = m1 = NEG_INF           # running max of rows r, r + 8 (log2 units)
            l0 = l1 = float32(0.0)      # this lane's part of their running sums
            row0 = row_base + int64(r)
            row1 = row0 + 8
            keys_end = min(row_end, row_base + ROWS)
            for j0 in range(0, keys_end, COLS):
                stage_split((k_hi, k_lo), k[b, h], j0, COLS, T, float32(1.0))
                stage_split((v_hi, v_lo), v[b, h], j0, COLS, T, float32(1.0))
                cuda.syncthreads()
                for n in range(KEY_STEPS):
                    for e in range(4):
                        s[n, e] = float32(0.0)
                for i in range(D_STEPS):                     # S = Q K^T, 8 d at a time
                    d = uint64(i * 8) + t
                    read_fragment(a_hi, a_lo, q_tile, r, d)
                    for n in range(KEY_STEPS):
                        key = uint64(n * 8) + g
                        s[n, 0], s[n, 1], s[n, 2], s[n, 3] = mma3(
                            s[n, 0], s[n, 1], s[n, 2], s[n, 3], a_hi, a_lo, k_hi[key, d],
                            k_hi[key, d + FOUR], k_lo[key, d], k_lo[key, d + FOUR])
                max0 = max1 = NEG_INF                        # causal mask, rows' max
                for n in range(KEY_STEPS):
                    key = j0 + n * 8 + 2 * int64(t)
                    if key > row0:
                        s[n, 0] = NEG_INF
                    if key + 1 > row0:
                        s[n, 1] = NEG_INF
                    if key > row1:
                        s[n, 2] = NEG_INF
                    if key + 1 > row1:
                        s[n, 3] = NEG_INF
                    max0 = max(max0, max(s[n, 0], s[n, 1]))
                    max1 = max(max1, max(s[n, 2], s[n, 3]))
                new0 = max(m0, quad_max(max0))               # finite: key 0 is in every row's
                new1 = max(m1, quad_max(max1))               # first tile (a later tile may
                                                             # mask all of a warp's keys)
                fix0 = math.exp2(m0 - new0)                  # 0 on the first tile
                fix1 = math.exp2(m1 - new1)
                m0, m1 = new0, new1
                l0 *= fix0
                l1 *= fix1
                for i in range(D_STEPS):
                    o[i, 0] *= fix0
                    o[i, 1] *= fix0
                    o[i, 2] *= fix1
                    o[i, 3] *= fix1
                cuda.syncthreads()                           # (every warp done with the k tiles)
                for n in range(KEY_STEPS):                   # P = 2^(S - m): 0 where masked
                    col = uint64(n * 8) + TWO * t
                    p0 = math.exp2(s[n, 0] - m0)
                    p1 = math.exp2(s[n, 1] - m0)
                    p2 = math.exp2(s[n, 2] - m1)
                    p3 = math.exp2(s[n, 3] - m1)
                    l0 += p0 + p1
                    l1 += p2 + p3
                    p_tile[r, col] = p0
                    p_tile[r, col + ONE] = p1
                    p_tile[r + EIGHT, col] = p2
                    p_tile[r + EIGHT, col + ONE] = p3
                warp_barrier()                               # (the warp's own rows of P)
                for n in range(KEY_STEPS):                   # O += P V, 8 keys at a time
                    key = uint64(n * 8) + t
                    read_fragment(a_hi, a_lo, p_tile, r, key)
                    for i in range(D_STEPS):
                        d = uint64(i * 8) + g
                        o[i, 0], o[i, 1], o[i, 2], o[i, 3] = mma3(
                            o[i, 0], o[i, 1], o[i, 2], o[i, 3], a_hi, a_lo, v_hi[key, d],
                            v_hi[key + FOUR, d], v_lo[key, d], v_lo[key + FOUR, d])
                cuda.syncthreads()                           # before the next tiles are staged
            l0 = quad_sum(l0)
            l1 = quad_sum(l1)
            if row0 < row_end:
                store_row(out, lse, o, b, h, row0, 0, m0, l0, int64(t))
            if row1 < row_end:
                store_row(out, lse, o, b, h, row1, 1, m1, l1, int64(t))

    attention_forward_tensor_kernel.shared_bytes = SHARED_BYTES
    return with_shape(attention_forward_tensor_kernel, THREADS, ROWS, blocks_per_sm)


def make_dq_kernel(D, ROWS, COLS, TM, TN, blocks_per_sm=0, vector=True, dropout=True):
    (thread_position, row_of, dim_of, stage, scores_product, exchange,
     output_product, store_rows) = tile_functions(D, ROWS, COLS, TM, TN, VECTOR=vector)
    factor = dropout_function(dropout)
    recompute = make_recompute(scores_product, TM, TN)
    THREADS_M, THREADS_N, TD, D_ROW, X_ROW = tile_constants(D, ROWS, COLS, TM, TN)

    @cuda.jit(**launch_bounds(THREADS_M * THREADS_N, blocks_per_sm))
    def attention_dq_kernel(dq, dout, q, k, v, lse, delta, scale, seed, site, threshold, keep,
                            rows_per_block, accumulate):
        # dq[B,H,T,D] (+)= dS K / sqrt(D); grid (B*H, T/rows_per_block), block THREADS.
        # Per tile of ROWS queries, for each tile of COLS keys up to the diagonal:
        #   S = Q K^T / sqrt(D), dP = dout V^T     [ROWS, COLS], TM x TN of each per thread
        #   dS = P (G dP - delta), P = exp(S - lse)
        #   acc += dS K                            [ROWS, D], TM x TD per thread
        q_tile = cuda.shared.array((ROWS, D_ROW), float32)  # q_tile[r, d] = q[row_base+r, d]/sqrt(D)
        dout_tile = cuda.shared.array((ROWS, D_ROW), float32)   # dout[row_base + r, d]
        k_tile = cuda.shared.array((COLS, D_ROW), float32)  # k_tile[c, d] = k[j0 + c, d]
        v_tile = cuda.shared.array((COLS, D_ROW), float32)  # v_tile[c, d] = v[j0 + c, d]
        ds_t = cuda.shared.array((COLS, X_ROW), float32)    # ds_t[c, r] = dS[r, c]
        s = cuda.local.array((TM, TN), float32)
        dp = cuda.local.array((TM, TN), float32)
        acc = cuda.local.array((TM, TD), float32)
        row_lse = cuda.local.array(TM, float32)
        row_delta = cuda.local.array(TM, float32)
        B, H, T, _ = q.shape
        b, h, row_start, row_end = block_rows(H, T, rows_per_block, True)
        ty, tx = thread_position()
        for row_base in range(row_start, row_end, ROWS):
            stage(q_tile, q[b, h], row_base, ROWS, T, scale)
            stage(dout_tile, dout[b, h], row_base, ROWS, T, float32(1.0))
            for i in range(TM):
                row = row_base + row_of(ty, i)
                row_lse[i] = lse[b, h, row] if row < T else float32(0.0)
                row_delta[i] = delta[b, h, row] if row < T else float32(0.0)
                for j in range(TD):
                    acc[i, j] = float32(0.0)
            keys_end = min(row_end, row_base + ROWS)
            for j0 in range(0, keys_end, COLS):
                stage(k_tile, k[b, h], j0, COLS, T, float32(1.0))
                stage(v_tile, v[b, h], j0, COLS, T, float32(1.0))
                cuda.syncthreads()
                recompute(s, q_tile, k_tile, dp, dout_tile, v_tile)  # S = Q K^T, dP = dout V^T
                for i in range(TM):                          # dp becomes dS
                    row = row_base + row_of(ty, i)
                    for j in range(TN):
                        col = j0 + tx + j * THREADS_N
                        ds = float32(0.0)
                        if col <= row:
                            g = factor(seed, site, threshold, keep, b, h, row, col, H, T)
                            ds = fast_exp(s[i, j] - row_lse[i]) * (g * dp[i, j] - row_delta[i])
                        dp[i, j] = ds
                exchange(ds_t, dp)
                warp_barrier()                               # (a thread reads its rows of dS)
                output_product(acc, ds_t, k_tile)
                cuda.syncthreads()                           # before the next tiles are staged
            store_rows(dq, acc, b, h, row_base, row_end, scale, accumulate, ty, tx)

    return with_shape(attention_dq_kernel, THREADS_M * THREADS_N, ROWS, blocks_per_sm)


def make_dkdv_kernel(D, ROWS, COLS, TM, TN, blocks_per_sm=0, score_steps=1, with_dq=False,
                     dq_atomic=False, vector=True, dropout=True):
    # score_steps per trip of the scores products: one by default; with two, ptxas spills
    # (outside the products) under the 168 registers that 6 blocks of 64 threads leave a thread.
    # with_dq: the kernel also writes dq's share of each (key tile, query tile) pair, summed by
    # attention_dq_sum_kernel; ROWS a multiple of COLS (key tiles of one or more query tiles).
    # dq_atomic (with with_dq): each share is added straight into dq instead (16-byte atomic
    # adds, vector.add4), scaled; no shares in memory and no sum kernel, but the order in which
    # a query's shares land varies from run to run, and so do dq's last bits.
    # Tiles of more than 48 KB in all live in dynamic shared memory (sharedmem.py).
    (thread_position, row_of, dim_of, stage, scores_product, exchange,
     output_product, store_rows) = tile_functions(D, ROWS, COLS, TM, TN,
                                                  SCORE_STEPS=score_steps, VECTOR=vector)
    recompute = make_recompute(scores_product, TM, TN)
    factor = dropout_function(dropout)
    THREADS_M, THREADS_N, TD, D_ROW, X_ROW = tile_constants(D, ROWS, COLS, TM, TN)
    THREADS = THREADS_M * THREADS_N
    assert THREADS >= COLS, ("a thread per query of a tile", ROWS, COLS, TM, TN)
    assert not with_dq or ROWS % COLS == 0, ("key tiles of whole query tiles", ROWS, COLS)
    RATIO = ROWS // COLS
    # dq's share, dS K [COLS, D] summed over the ROWS keys: the same threads on a grid of
    # COLS/TM query rows (TM each) by the rest (a TM x TD_Q tile each); for square tiles the
    # grid of the other products
    Q_THREADS_M = COLS // TM
    Q_TN = ROWS // (THREADS // Q_THREADS_M)
    (q_position, q_row_of, q_dim_of, _, _, _, q_output_product, _) = tile_functions(
        D, COLS, ROWS, TM, Q_TN, VECTOR=vector)
    _, _, TD_Q, _, K_ROW = tile_constants(D, COLS, ROWS, TM, Q_TN)
    floats = 2 * ROWS * D_ROW + 2 * COLS * D_ROW + 2 * COLS * X_ROW + 2 * COLS
    # dynamic shared memory past 48 KB, and for key tiles of several query tiles (their keys_t
    # lies over q and dout: too big for P G's place)
    DYNAMIC = 4 * floats > STATIC_SHARED_BYTES or (with_dq and RATIO > 1)

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
    assert 2 * COLS * D_ROW >= ROWS * K_ROW or not DYNAMIC

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
        # time (4 consecutive head dimensions; dq_shares is attention_backward's own, aligned;
        # (ty, tx) the thread's place on dq's grid, q_position)
        for i in range(TM):
            row = row0 + q_row_of(ty, i)
            for j in range(0, TD_Q, 4):
                store4(dq_shares, (b, h, row, q_dim_of(tx, j)), acc[i, j], acc[i, j + 1],
                       acc[i, j + 2], acc[i, j + 3])

    @inlined
    def add_dq_share(dq, acc, b, h, i0, T, scale, ty, tx):
        # dq[b, h, i0 + q_row_of(ty, i), q_dim_of(tx, j)] += scale * acc[i, j], rows < T, 16
        # bytes at a time, atomically (dq aligned: attention_backward checks)
        for i in range(TM):
            row = i0 + q_row_of(ty, i)
            if row < T:
                for j in range(0, TD_Q, 4):
                    add4(dq, (b, h, row, q_dim_of(tx, j)), scale * acc[i, j],
                         scale * acc[i, j + 1], scale * acc[i, j + 2], scale * acc[i, j + 3])

    @cuda.jit(**launch_bounds(THREADS, blocks_per_sm))
    def attention_dkdv_kernel(dk, dv, dq_shares, dout, q, k, v, lse, delta, scale, seed, site,
                              threshold, keep, rows_per_block, accumulate):
        # dk, dv [B,H,T,D] (+)= gradients; grid (B*H, T/rows_per_block), block THREADS. The roles
        # of the dq kernel swapped: per tile of ROWS keys, for each tile of COLS queries from the
        # tile's first key on,
        #   S^T = K Q^T / sqrt(D), dP^T = V dout^T   [ROWS, COLS], TM x TN of each per thread
        #   dv_acc += (P G)^T dout,  dk_acc += dS^T Q / sqrt(D)   [ROWS, D], TM x TD each
        # with_dq: also dq's share from this pair of tiles, dS K [COLS, D] (unscaled), into
        # dq_shares[b, h, pair * COLS : (pair + 1) * COLS, :], pair = share_pair(qt, kt, RATIO)
        # (query tile qt, key tile kt: the pairs of a causal head, packed); rows_per_block a
        # multiple of ROWS. dq_atomic: dq_shares is dq, and the shares are added into it, scaled.
        # Else dq_shares is not read.
        # k_tile[r, d] = k[key_base + r, d], v_tile the same; q_tile[c, d] = q[i0 + c, d] /
        # sqrt(D), dout_tile[c, d] = dout[i0 + c, d]; pg_t[c, r] = (P G)[i0+c, key_base+r],
        # ds_t[c, r] = dS[i0+c, key_base+r]; stats[0, c] = lse[i0 + c], stats[1, c] =
        # delta[i0 + c] (not in registers: live through the products); keys_t[r, c] = dS again,
        # keys down (dq's product)
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
                recompute(s, k_tile, q_tile, dp, v_tile, dout_tile)  # S^T = K Q^T, dP^T = V dout^T
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
                if with_dq:     # dq's share: dS K, dS keys-major in keys_t (read by all now)
                    keys_major(keys_t, ds_t)
                    for i in range(TM):
                        for j in range(TD_Q):
                            dq_acc[i, j] = float32(0.0)
                    cuda.syncthreads()
                    q_output_product(dq_acc, keys_t, k_tile)
                    if dq_atomic:
                        add_dq_share(dq_shares, dq_acc, b, h, i0, T, scale, q_ty, q_tx)
                    else:
                        pair = share_pair_device(i0 // COLS, key_base // ROWS, RATIO)
                        store_dq_share(dq_shares, dq_acc, b, h, pair * COLS, q_ty, q_tx)
                    if DYNAMIC:     # keys_t lies over q and dout, staged next
                        cuda.syncthreads()
                    # (else keys_t is pg_t, written again only after the next tiles' barrier)
            if with_dq:
                cuda.syncthreads()      # the last dq product has read k_tile: the next may come
            store_rows(dk, dk_acc, b, h, key_base, row_end, float32(1.0), accumulate, ty, tx)
            store_rows(dv, dv_acc, b, h, key_base, row_end, float32(1.0), accumulate, ty, tx)

    kernel = with_shape(attention_dkdv_kernel, THREADS, ROWS, blocks_per_sm)
    kernel.with_dq = with_dq
    kernel.dq_atomic = with_dq and dq_atomic
    kernel.cols = COLS
    kernel.shared_bytes = 4 * floats if DYNAMIC else 0
    return kernel


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
    # qt // ratio, in that order (the dk/dv kernel with_dq wrote them; its key tiles are `ratio`
    # query tiles of `tile` rows). 4 consecutive d of a row at a time: 16-byte loads of the
    # shares (aligned: attention_backward allocates them); grid-stride.
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
        for kt in range(0, last, 2):        # two shares' loads in flight, then both added in
            x = load4(dq_shares, (b, h, first + kt * tile, d))      # order (Nsight Compute: a
            y = load4(dq_shares, (b, h, first + (kt + 1) * tile, d))    # load at a time left
            t0 += x[0]                                              # the warps stalled on it
            t1 += x[1]                                              # 8 cycles an instruction)
            t2 += x[2]
            t3 += x[3]
            t0 += y[0]
            t1 += y[1]
            t2 += y[2]
            t3 += y[3]
        if last % 2 == 0:                   # the last share of an odd count
            x = load4(dq_shares, (b, h, first + last * tile, d))
            t0 += x[0]
            t1 += x[1]
            t2 += x[2]
            t3 += x[3]
        t0, t1, t2, t3 = t0 * scale, t1 * scale, t2 * scale, t3 * scale
        if accumulate:
            t0 += dq[b, h, i, d]
            t1 += dq[b, h, i, d + 1]
            t2 += dq[b, h, i, d + 2]
            t3 += dq[b, h, i, d + 3]
        dq[b, h, i, d] = t0
        dq[b, h, i, d + 1] = t1
        dq[b, h, i, d + 2] = t2
        dq[b, h, i, d + 3] = t3


# --- delta_i = dout_i . out_i, before the fast backward kernels ---------------------------------

DELTA_WARPS = 2 if SIMULATOR else 4     # the warp kernel: warps per block,
DELTA_ROWS = 4                          # and rows per warp (their loads all in flight at once)


@cuda.jit
def attention_delta_kernel(delta, dout, out, zeroed, zero):
    # delta[B,H,T] = dout . out along D; with zero, zeroed[B,H,T,D] = 0 too. One thread per row,
    # 4-byte loads (any D, any alignment, any strides)
    B, H, T, D = out.shape
    r = cuda.grid(1)
    if r < B * H * T:
        b = r // (H * T)
        h = (r // T) % H
        i = r % T
        delta[b, h, i] = row_dot(dout, out, b, h, i, i, D)
        if zero:
            for d in range(D):
                zeroed[b, h, i, d] = float32(0.0)


@cuda.jit
def attention_delta4_kernel(delta, dout, out, zeroed, zero):
    # delta[B,H,T] = dout[B,H,T,D] . out[B,H,T,D] along D, D % 4 == 0, D <= 4 * WARP, rows
    # 16-byte aligned (any strides: out may be a view of the heads' concat); with zero,
    # zeroed[B,H,T,D] = 0 too (dq, before the dk/dv kernel adds its shares into it: one pass
    # fewer). grid (T / (DELTA_WARPS * DELTA_ROWS), B*H), block (WARP, DELTA_WARPS): a warp
    # takes DELTA_ROWS consecutive rows t of head blockIdx.y, lane l holds d = 4l..4l+3 of
    # each (lanes past D/4 count zero), so a row is one coalesced 16-byte load per array and
    # lane; then each row's sum meets in warp_sum.
    # All 2 DELTA_ROWS loads of a lane are in flight at once: no `if` per row (a row past T is
    # row T-1 again, not stored), and every load before the first product (ptxas, sm_90: with
    # the products next to their loads, a row's product waited for its loads before the next
    # rows' loads went out; behind an `if` per row, every row waited for the one before).
    # The sum's order, fixed: each lane adds its 4 products in order of d, then warp_sum's
    # butterfly adds the lanes (not the one-thread kernel's order: the two differ by rounding).
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
        if zero:
            for r in range(DELTA_ROWS):
                if first + r < T:
                    store4(zeroed, (b, h, first + r, d), float32(0.0), float32(0.0),
                           float32(0.0), float32(0.0))
    for r in range(DELTA_ROWS):
        total = warp_sum(partial[r])                     # every lane of the warp calls it
        if lane == 0 and first + r < T:
            delta[b, h, first + r] = total


# --- launchers ---------------------------------------------------------------------------------

THREADS = 32 if SIMULATOR else 128      # the reference kernels' block (and the one-thread delta's)

# The fast kernels' tiles per head size: (forward, dq, dk/dv), each (ROWS, COLS, TM, TN[,
# blocks_per_sm]) as in tile_functions, picked by timing variants on the H200 (2026-11-29);
# the forward's sixth entry is wide_staging, dk/dv's sixth its scores steps per loop trip, its
# seventh with_dq (dq's shares made there, the dq kernel not run), its eighth dq_atomic (those
# shares added into dq at once, not summed after). The forward at D=64 is
# bounded at 4 blocks per multiprocessor (128 registers, 12 bytes spilled; unbounded it takes
# 150 and 3 fit): 0.873 against 0.924 ms at [16,12,1024,64] (session 6, run 2); at D=32 it
# stages 4 bytes at a time (96 registers against 150): 0.172 against 0.190 ms at [64,12,256,32].
# Static shared memory is at most 48 KB a block: 44.5 KB for the forward at D=64 (q 64x68, k,
# v and P 32x68 floats, the row partials 64x8). dk/dv at D=64 takes 64-key tiles in 68 KB of
# dynamic shared memory (sharedmem.py; k, v 64x68 each, q, dout, P G and dS 32x68), 3 blocks
# of 128 threads a multiprocessor (session 8: 3.175 ms fwd+bwd at [16,12,1024,64] against the
# 32-key tiles' 3.531, 43 KB and 5 blocks of 64). TM, COLS and TD = D / (COLS/TN) must
# be multiples of 4 (runs of 4 rows and head dimensions, four steps per trip of the output
# product). In the simulator the tiles are tiny and unequal (ROWS x COLS = 4 x 4, 8 x 4, 4 x 4;
# 1 x 2, 1 x 2 and 1 x 4 threads, the dq tile two runs of rows), so T=7 crosses two tiles of
# most kinds.
GPU_TILES = {64: ((64, 32, 4, 4, 4), (32, 32, 4, 4), (64, 32, 4, 4, 3, 2, True, True)),
             32: ((64, 32, 4, 4, 0, False), (64, 32, 4, 4), (32, 32, 4, 4, 6, 1, True))}
SIMULATOR_TILES = {D: ((4, 4, 4, 2), (8, 4, 8, 2), (4, 4, 4, 1, 0, 1, True))
                   for D in FAST_HEAD_SIZES}
TILES = SIMULATOR_TILES if SIMULATOR else GPU_TILES
# The tensor-core forward's tile per head size: (WARPS, COLS[, blocks_per_sm]), query rows 16
# WARPS a block, keys COLS a tile. In the simulator one warp and 16 keys (T=7 then fits in one
# tile; T=20 crosses two). TENSOR_FORWARD: whether "auto" runs it (dropout_p = 0). Timed on
# the H200 (2026-11-30, session 14, run 4; docs/perf.md v16): 4 warps and 32 keys 0.732 ms at
# [16,12,1024,64] and 0.114 ms at [64,12,256,32], against the FFMA kernel's 0.859 and 0.176;
# 64 keys 1.161 / 0.141 (twice the shared memory: fewer blocks a multiprocessor), 2 warps
# and 32 keys 1.392 / 0.157.
GPU_TENSOR_TILES = {D: (4, 32) for D in FAST_HEAD_SIZES}
TENSOR_TILES = {D: (1, 16) for D in FAST_HEAD_SIZES} if SIMULATOR else GPU_TENSOR_TILES
TENSOR_FORWARD = not SIMULATOR     # (the simulator's mma is slow: tests there ask for it by name)
TENSOR_TILE_VARIANTS = {"tensor 64 keys": (4, 64), "tensor 2 warps": (2, 32)}
_tensor_kernels = {}
# Other tiles worth timing against GPU_TILES (tools/bench.py --variants), as attention_forward's
# `tiles` (forward, dq, dk/dv; None keeps the default). ptxas, sm_90 (2026-11-29): dk/dv with
# two scores steps a trip at 4 blocks per multiprocessor: no spills (at 5 or 6 blocks it
# spills). Measured at [16,12,1024,64] forward+backward (H200, 2026-11-29, session 4), and
# dropped from the list: dq tiles 32x32 4.558 ms (the default), 64x16 4.583, 32x16 4.709;
# forward 32x32 1.059 ms forward against 64x32's 0.979. Session 7 (run 3, no dropout compiled
# in): dk/dv with two scores steps at 5 blocks (16 bytes spilled) 3.544 ms fwd+bwd against
# the default's 3.547. Session 8 (run 1): dk/dv on 64-key tiles of 128 threads (68 KB of
# dynamic shared memory, 3 blocks of 4 warps a multiprocessor against 5 of 2; half the staging
# of q and dout and half the dq shares; ptxas: 168 registers, no spills) 3.175 ms against the
# 32-key tiles' 3.531: the default since. Run 2, dropped from the list: the 32-key tiles at 4
# blocks 3.635 ms; 64 keys x 64 queries, 256 threads (4 x 4 of dk and dv each), 103 KB, 2
# blocks (16 warps) a multiprocessor, ptxas 128 registers and 16 bytes spilled: 3.305 ms
# against the default's 3.177. Session 9 (2026-11-30): dq added atomically (dq_atomic) 3.085
# ms against the shares' 3.175 (run 2), and with two scores steps a trip (ptxas: 168
# registers, 32 bytes spilled; the scores loops 128 FFMA of 156 instructions, not 64 of 85)
# 3.005 against 3.081 (run 3, dq zeroed by the delta kernel): the default since. The shares,
# two scores steps, are what deterministic=True runs ("dq shares": 3.129 ms in run 2).
TILE_VARIANTS = {64: {"forward unbounded": ((64, 32, 4, 4), None, None),
                      "dkdv 2 steps": (None, None, (32, 32, 4, 4, 4, 2, True)),
                      "dq kernel": (None, None, (32, 32, 4, 4, 6)),
                      "dkdv 32 keys": (None, None, (32, 32, 4, 4, 6, 1, True)),
                      "dq shares": (None, None, (64, 32, 4, 4, 3, 2, True)),
                      "dq atomic 1 step": (None, None, (64, 32, 4, 4, 3, 1, True, True))},
                 32: {"forward 16-byte staging": ((64, 32, 4, 4), None, None),
                      "dq kernel": (None, None, (32, 32, 4, 4, 6))}}
_fast_kernels = {}
# Whether attention_backward sums dq's shares in a fixed order where its dk/dv tile would add
# them atomically (deterministic=None takes this; `train --deterministic` sets it). With the
# atomic adds, the order in which a query's shares land varies from run to run, and so do dq's
# last bits; PyTorch's float32 SDPA backward (the memory-efficient kernel) makes the same trade.
DETERMINISTIC = False


def use_deterministic(flag=True):
    """Make attention_backward's dq reproducible to the bit (the shares summed in order) or not
    (added atomically where the tiles say so: ~3% faster at [16,12,1024,64])."""
    global DETERMINISTIC
    DETERMINISTIC = bool(flag)


def deterministic_tiles(D, tiles=None):
    """tiles (as attention_forward takes them) whose dk/dv tile makes dq's shares to be summed
    in a fixed order where it would add them atomically."""
    forward, dq, dkdv = tiles or (None, None, None)
    dkdv = dkdv or TILES[D][2]
    if len(dkdv) > 7 and dkdv[7]:
        dkdv = dkdv[:7] + (False,) + dkdv[8:]
    return forward, dq, dkdv


def _fast(D, tiles=None, arrays=(), dropout=True):
    """The fast kernels (forward, dq, dk/dv) for head size D, compiled once per tiles: None (the
    defaults, TILES[D]) or (forward_tile, dq_tile, dkdv_tile), each None or a tile; staging 16
    bytes at a time when all the staged arrays' rows are 16-byte aligned (else 4 bytes); with
    dropout compiled in or not."""
    vector = all(aligned16(x) for x in arrays)
    key = (D, tiles, vector, dropout)
    if key not in _fast_kernels:
        _fast_kernels[key] = make_attention_kernels(D, *(tiles or ()), vector=vector,
                                                    dropout=dropout)
    return _fast_kernels[key]


def _check_attention(q, k, v, **others):
    check(len(q.shape) == 4, f"attention: q must be [B,H,T,D], got {q.shape}")
    B, H, T, D = q.shape
    for name, array in dict(k=k, v=v, **others).items():
        if array is not None:
            if name in ("lse", "delta"):
                check_shape(f"attention {name}", array, (B, H, T))
            else:
                check_shape(f"attention {name}", array, (B, H, T, D))
    return B, H, T, D


def _pick(D, kernel, dropout_p=0.0, backward=False, tiles=None):
    """The kernels to run: "reference", "fast" (FFMA) or "tensor" (the forward's tensor-core
    kernel, without dropout; its backward is the fast one). "auto": tensor where TENSOR_FORWARD
    says so and no FFMA tiles are given, else fast, for D in FAST_HEAD_SIZES; reference for
    other D."""
    if kernel == "auto":
        tensor = TENSOR_FORWARD and dropout_p == 0 and not tiles
        kernel = ("tensor" if tensor else "fast") if D in FAST_HEAD_SIZES else "reference"
    check(kernel in ("fast", "reference", "tensor"), f"attention: unknown kernel {kernel!r}")
    check(kernel == "reference" or D in FAST_HEAD_SIZES,
          f"attention: the fast kernels take D in {FAST_HEAD_SIZES}, got D={D}")
    check(kernel != "tensor" or dropout_p == 0,
          "attention: the tensor-core forward takes no dropout (kernel='fast' does)")
    return "fast" if kernel == "tensor" and backward else kernel


def _tensor_forward(D, tile=None, arrays=()):
    """The tensor-core forward for head size D, compiled once per tile (WARPS, COLS[,
    blocks_per_sm]; None: TENSOR_TILES[D]) and staging width (16 bytes where q, k, v allow)."""
    tile = tuple(tile or TENSOR_TILES[D])
    vector = all(aligned16(x) for x in arrays)
    key = (D, tile, vector)
    if key not in _tensor_kernels:
        _tensor_kernels[key] = make_tensor_forward_kernel(D, *tile, vector=vector)
    return _tensor_kernels[key]


def dropout_arguments(p, seed, site):
    """The kernels' `drop` arguments for dropout probability p (seed: int64[1] on the device)."""
    threshold, keep = dropout_constants(p)
    return seed, np.int64(site), threshold, keep


def attention_forward(out, lse, q, k, v, kernel="auto", rows_per_block=None, dropout_p=0.0,
                      seed=None, site=0, tiles=None):
    """out = causal softmax(q k^T / sqrt(D)) v for every (batch, head); lse saved for backward.
    dropout_p > 0 drops attention probabilities (seed: int64[1] on the device, site: an int).

    rows_per_block (fast kernels): query rows per thread block, which walks them in tiles of
    the kernel's ROWS; default ROWS (one tile per block, so that B*H*T/ROWS blocks fill the
    GPU); rows_per_block=T gives one block per (batch, head). The backward takes the same
    argument (query rows per dq block, key rows per dk/dv block; default its own ROWS; where
    the dk/dv kernel makes dq's shares too, its key rows are rounded up to whole tiles).
    tiles (fast kernels): other tiles than TILES[D], as make_attention_kernels takes them
    ((forward, dq, dk/dv), None for a default); for trying tile shapes (tools/bench.py).
    """
    check_float32(lse=lse)
    check_float32_rows(out=out, q=q, k=k, v=v)
    B, H, T, D = _check_attention(q, k, v, out=out, lse=lse)
    scale = np.float32(1.0 / math.sqrt(D))
    drop = dropout_arguments(dropout_p, _seed(seed, lse), site)
    picked = _pick(D, kernel, dropout_p, tiles=tiles)
    if picked == "reference":
        launch(attention_forward_reference_kernel, B * H, THREADS, out, lse, q, k, v, scale,
               *drop)
        return
    if picked == "tensor":
        forward = _tensor_forward(D, tiles and tiles[0], (q, k, v))
        rows = min(T, rows_per_block or forward.rows)
        launch(forward, (B * H, blocks(T, rows)), forward.threads, out, lse, q, k, v, scale,
               rows, shared_bytes=forward.shared_bytes)
        return
    forward = _fast(D, tiles, (q, k, v), dropout_p > 0)[0]
    rows = min(T, rows_per_block or forward.rows)
    launch(forward, (B * H, blocks(T, rows)), forward.threads, out, lse, q, k, v, scale, *drop,
           rows)


def attention_delta(delta, dout, out, zeroed=None):
    """delta[B,H,T] = dout . out along D (dout, out [B,H,T,D], rows contiguous, any strides):
    the warp kernel on 16-byte aligned rows of D % 4 == 0, D <= 4 * WARP floats, else a thread
    per row. zeroed (None or [B,H,T,D]): also set to zeros, by the warp kernel in the same pass
    where it can."""
    B, H, T, D = out.shape
    # (without zeroed, out stands in for it: the kernel then leaves it alone)
    arrays = (dout, out, out if zeroed is None else zeroed)
    if D <= 4 * WARP and all(aligned16(x) for x in arrays):
        launch(attention_delta4_kernel, (blocks(T, DELTA_WARPS * DELTA_ROWS), B * H),
               (WARP, DELTA_WARPS), delta, *arrays, zeroed is not None)
        return
    launch(attention_delta_kernel, blocks(B * H * T, THREADS), THREADS, delta, *arrays,
           zeroed is not None)


def attention_backward(dq, dk, dv, delta, dout, q, k, v, out, lse, accumulate=False,
                       kernel="auto", rows_per_block=None, dropout_p=0.0, seed=None, site=0,
                       tiles=None, deterministic=None):
    """dq, dk, dv (+)= the gradients of attention_forward (same dropout and tiles arguments);
    delta [B,H,T] is scratch. deterministic: dq reproducible to the bit (None: DETERMINISTIC);
    else the default tiles at D=64 add its shares atomically."""
    check_float32(delta=delta, lse=lse)
    check_float32_rows(dq=dq, dk=dk, dv=dv, dout=dout, q=q, k=k, v=v, out=out)
    B, H, T, D = _check_attention(q, k, v, dq=dq, dk=dk, dv=dv, dout=dout, out=out, lse=lse,
                                  delta=delta)
    scale = np.float32(1.0 / math.sqrt(D))
    drop = dropout_arguments(dropout_p, _seed(seed, lse), site)
    if _pick(D, kernel, dropout_p, backward=True) == "reference":
        launch(attention_backward_reference_kernel, B * H, THREADS,
               dq, dk, dv, delta, dout, q, k, v, out, lse, scale, *drop, accumulate)
        return
    if kernel == "tensor" and tiles:    # (the forward's tile is the tensor kernel's)
        tiles = (None,) + tuple(tiles[1:])
    if DETERMINISTIC if deterministic is None else deterministic:
        tiles = deterministic_tiles(D, tiles)
    _, dq_kernel, dkdv_kernel = _fast(D, tiles, (q, k, v, dout), dropout_p > 0)
    check(not dkdv_kernel.dq_atomic or aligned16(dq),
          "attention: the atomic dq adds need dq's rows 16-byte aligned")
    zero_dq = dkdv_kernel.dq_atomic and not accumulate      # (the shares are added into dq)
    attention_delta(delta, dout, out, dq if zero_dq else None)
    tile, query_tile = dkdv_kernel.rows, dkdv_kernel.cols
    key_rows = min(T, rows_per_block or tile)
    summed = dkdv_kernel.with_dq and not dkdv_kernel.dq_atomic
    if not dkdv_kernel.with_dq:     # dq by a kernel of its own (the dk/dv kernel's dq unread)
        rows = min(T, rows_per_block or dq_kernel.rows)
        launch(dq_kernel, (B * H, blocks(T, rows)), dq_kernel.threads,
               dq, dout, q, k, v, lse, delta, scale, *drop, rows, accumulate)
        dq_target = dk
    else:       # dq from the dk/dv kernel; a block's keys are whole tiles (rows rounded up)
        key_rows = min(T, blocks(key_rows, tile) * tile)
        if dkdv_kernel.dq_atomic:   # each share added into dq, 16 bytes at a time (dq
            dq_target = dq          # zeroed with delta, unless accumulating)
        else:                       # one share per (query tile, key tile) pair, summed after
            ratio = tile // query_tile
            pairs = share_pair(blocks(T, query_tile), 0, ratio)
            dq_target = scratch("attention dq shares", (B, H, pairs * query_tile, D))
    launch(dkdv_kernel, (B * H, blocks(T, key_rows)), dkdv_kernel.threads, dk, dv, dq_target,
           dout, q, k, v, lse, delta, scale, *drop, key_rows, accumulate,
           shared_bytes=dkdv_kernel.shared_bytes)
    if summed:
        launch(attention_dq_sum_kernel, *elementwise_grid(B * H * T * D // 4), dq, dq_target,
               scale, query_tile, ratio, accumulate)


_no_seeds = {}


def _seed(seed, like):
    """The seed array, or (no dropout) a placeholder on the same backend the kernels never read."""
    if seed is not None:
        return seed
    if "device" not in _no_seeds:
        from numba import cuda
        _no_seeds["device"] = cuda.to_device(np.zeros(1, dtype=np.int64))
    return _no_seeds["device"]


# --- NumPy twins ---------------------------------------------------------------------------------

def _probabilities(q, k, lse=None):
    """P [B,H,T,T] (causal softmax of the scaled scores) and lse [B,H,T]."""
    T, D = q.shape[-2:]
    scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(D)
    scores = np.where(np.tril(np.ones((T, T), dtype=bool)), scores, -np.inf)
    if lse is None:
        m = scores.max(axis=-1, keepdims=True)
        lse = (m + np.log(np.exp(scores - m).sum(axis=-1, keepdims=True)))[..., 0]
    return np.exp(scores - lse[..., None]), lse


def _dropout_factors(shape, dropout_p, seed, site):
    """G [B,H,T,T]: the same hash of (seed, site, flat index) as the kernels; 1 without dropout."""
    if dropout_p == 0.0:
        return 1.0
    return keep_scale_numpy(shape, dropout_p, seed, site)


def attention_forward_numpy(out, lse, q, k, v, kernel="auto", rows_per_block=None,
                            dropout_p=0.0, seed=None, site=0, tiles=None):
    _check_attention(q, k, v, out=out, lse=lse)
    p, lse[...] = _probabilities(q, k)
    out[...] = (p * _dropout_factors(p.shape, dropout_p, seed, site)) @ v


def attention_backward_numpy(dq, dk, dv, delta, dout, q, k, v, out, lse, accumulate=False,
                             kernel="auto", rows_per_block=None, dropout_p=0.0, seed=None,
                             site=0, tiles=None, deterministic=None):
    _check_attention(q, k, v, dq=dq, dk=dk, dv=dv, dout=dout, out=out, lse=lse, delta=delta)
    D = q.shape[-1]
    p, _ = _probabilities(q, k, lse)
    g = _dropout_factors(p.shape, dropout_p, seed, site)
    delta[...] = (dout * out).sum(axis=-1)
    ds = p * (g * (dout @ np.swapaxes(v, -1, -2)) - delta[..., None]) / np.sqrt(D)
    for grad, value in ((dq, ds @ k), (dk, np.swapaxes(ds, -1, -2) @ q),
                        (dv, np.swapaxes(p * g, -1, -2) @ dout)):
        if accumulate:
            grad += value
        else:
            grad[...] = value
