"""Matrix multiply and its backward products.

    out[M,N]  (+)=  op(a)[M,K] . op(b)[K,N]  (+ bias[N])      op(x) = x or x^T

Every linear layer of the model is one call (activations [B,T,C] are viewed as [B*T, C] rows):
    forward      Y[M,N]  = X[M,K] . W[K,N] + b          (W stored [in, out], as GPT-2 does)
    backward     dX[M,K] = dY[M,N] . W^T                transpose_b=True
                 dW[K,N] += X^T . dY                    transpose_a=True, accumulate=True
                 db[N]   += sum of dY's rows            sum_rows
    LM head      logits[M,V] = X[M,C] . wte[V,C]^T      transpose_b=True (tied to the embedding)
    MLP up       H[M,4C] = X . W + b, G = gelu(H)       gelu_out=G: GELU in the epilogue
    MLP down     dH[M,4C] = (dY . W^T) * gelu'(H)       gelu_input=H: GELU's backward in the
                                                        epilogue (the product is dG)

`accumulate` says whether out is overwritten (=) or added to (+=): gradients of parameters
accumulate into the flat gradient buffer, and a tensor used twice sums its two gradients.

Two kernels compute the same function:
  matmul_tiled_kernel     the readable reference: one thread per output element,
                          16x16 tiles of both operands staged through shared memory.
  blocked matmul kernels  the fast path: a 128x128 block tile, each of 256 threads keeps an
                          8x8 tile of the output in registers, fed by 16-byte loads (load4,
                          kernels/vector.py); shared memory is double-buffered (the next
                          K-slice is loaded from global memory while the current one is
                          multiplied). Built per (transpose_a, transpose_b) and per operand
                          alignment by make_blocked_matmul_kernel, so the transposes cost
                          nothing at run time.
Both are correct for any M, N, K (edges are zero-filled), and both pass the same tests.
With transpose_b (the input gradients, the LM head) and many rows, the blocked path first
makes a transposed copy of b (transpose, at the end of this file) and runs the plain product:
faster than transposing b's slices in the kernel (copies_b_transposed says when and why).
Operands whose rows are not whole 16-byte runs (the LM head at GPT-2's V = 50257) are read 4
bytes at a time, or, when the product is large enough (pads_unaligned), in place in four
classes of rows (row_class_matmul: the rows 4 apart start at the same place in a 16-byte run),
or where those do not apply on padded copies.
"""
from numba import cuda, float32

import numpy as np

from .asynccopy import commit_copies, copy4_async, copy16_async, wait_copies
from .gelu import (gelu_backward, gelu_backward_numpy, gelu_derivative, gelu_forward,
                   gelu_forward_numpy, gelu_value)
from .pad import pad, padded_length, unpad
from .launch import (MULTIPROCESSORS, SIMULATOR, blocks, check, check_float32, check_shape,
                     current_stream, elementwise_grid, inlined, inlined_by_numba,
                     is_contiguous, launch)
from .vector import aligned16, load1, load4, store1, store4
from .reduce import (COLUMNS, ROW_GROUPS, chunk_rows, column_partials_sum,
                     finish_column_sums_kernel, row_chunks)

TILE = 16


@cuda.jit
def matmul_tiled_kernel(out, a, b, bias, has_bias, transpose_a, transpose_b, accumulate):
    # out[M,N] (+)= op(a)[M,K] . op(b)[K,N] (+ bias[N] if has_bias);  grid (N/16, M/16), block (16, 16)
    a_tile = cuda.shared.array((TILE, TILE), float32)      # a_tile[i, k] = op(a)[row0+i, k0+k]
    b_tile = cuda.shared.array((TILE, TILE), float32)      # b_tile[k, j] = op(b)[k0+k, col0+j]
    M, N = out.shape
    K = a.shape[0] if transpose_a else a.shape[1]
    ty = cuda.threadIdx.y
    tx = cuda.threadIdx.x
    row = cuda.blockIdx.y * TILE + ty
    col = cuda.blockIdx.x * TILE + tx
    total = float32(0.0)
    for k0 in range(0, K, TILE):
        k = k0 + tx                     # this thread loads op(a)[row, k] ...
        value = float32(0.0)
        if row < M and k < K:
            value = a[k, row] if transpose_a else a[row, k]
        a_tile[ty, tx] = value
        k = k0 + ty                     # ... and op(b)[k, col]
        value = float32(0.0)
        if k < K and col < N:
            value = b[col, k] if transpose_b else b[k, col]
        b_tile[ty, tx] = value
        cuda.syncthreads()
        for kk in range(TILE):
            total += a_tile[ty, kk] * b_tile[kk, tx]
        cuda.syncthreads()
    if row < M and col < N:
        if has_bias:
            total += bias[col]
        if accumulate:
            total += out[row, col]
        out[row, col] = total


def make_blocked_matmul_kernel(transpose_a, transpose_b, vector_a=True, vector_b=True,
                               vector_out=True, BM=128, BN=128, BK=8, blocks_per_sm=1,
                               gelu=False, gelu_grad=False, stages=0, gather_epilogue=True,
                               thread_cols=8, warp_rows=None, fragments_ahead=False):
    """The register-blocked kernel for one (transpose_a, transpose_b) and one tile shape.

    Block tile BM x BN of the output, computed by (BM/8) x (BN/8) threads that each own an 8x8
    tile of it in registers (or 8 x 16: thread_cols): rows ty*4 + {0..3} and BM/2 + ty*4 +
    {0..3}, columns likewise, so a thread's fragments are 4-wide runs that it reads from
    shared memory with one 16-byte load (`load4`): 4 loads feed 64 fused multiply-adds per
    step of k. K advances in slices of BK, double-buffered: slice s+1 is loaded from global
    memory into registers while slice s is multiplied out of shared memory.

    Shared memory holds both operands k-major, a_tiles[k, m] and b_tiles[k, n], whichever way
    they are stored in global memory: an operand whose contiguous axis is k (a not transposed,
    b transposed) is transposed on its way in (four 4-byte stores into a padded tile, free of
    bank conflicts); the others go in with one 16-byte store.
    vector_a, vector_b: read that operand from global memory 16 bytes at a time (its rows a
    multiple of 4 floats, 16-byte aligned), else 4 bytes at a time. vector_out: the same for
    the output (and the bias). blocks_per_sm > 1: launch bounds that cap the registers so that
    many blocks fit on a multiprocessor (2: at most 128 registers a thread). gelu: the
    epilogue also writes gelu(out) to `hidden` (the MLP's activation); gelu_grad: it multiplies
    out by gelu'(hidden) (hidden the MLP's pre-activation, read 16 bytes at a time as out is
    written), so that the product of GELU's output gradient is its input's gradient. Separate
    kernels, so that the others keep an epilogue small enough to be unrolled (with GELU in every
    kernel behind a run-time flag, the row loop stayed rolled and the accumulators went to the
    stack).
    gather_epilogue: the bias, gelu' and the accumulated output go into the accumulators
    before the first store, four rows' loads in flight at once (else each row's are added as it
    is stored); gelu_grad always gathers.
    thread_cols (8 or 16): the columns of a thread's tile, in runs of 4 BN/(thread_cols/4)
    apart; 16 makes a 128 x 256 block tile of 256 threads, each 8 x 16 (128 accumulators: 6
    shared loads feed 128 multiply-adds per step of k), the shape of CUTLASS's SIMT SGEMM.
    warp_rows: the rows of the THREADS_M x THREADS_N thread grid that one warp covers (32 /
    warp_rows columns of it); None: whole rows of the grid (thread tid at row tid // THREADS_N).
    A warp's fragment loads from shared memory touch as many distinct 16-byte runs as it
    covers rows (of a_tiles) and columns (of b_tiles): 2 x 16 threads read 2 + 16 runs a step
    of k (1 + 2 wavefronts a load), 4 x 8 threads 4 + 8 (1 + 1).
    fragments_ahead (register-staged slices of 8): each step's fragments are read from shared
    memory while the step before is multiplied (two sets of fragment registers), and the next
    slice's first ones right after the barrier, before the last step of this slice is
    multiplied: its 64 multiply-adds cover the shared loads' latency where, without, every warp
    of the block leaves the barrier at once and waits on its loads together. (Timed: 6-8%
    slower on every plain product, 2% on those with GELU's backward fused, docs/perf.md v13;
    a variant, not a default.)
    stages >= 2: the slices go from global to shared memory with cp.async (asynccopy.py), not
    through registers, `stages` of them in flight (a pipeline): 16 bytes a copy for an operand
    whose rows run along M or N (a transposed, b not) and are 16-byte runs (vector), else 4
    bytes a copy, which may land anywhere: a slice whose rows run along k is transposed by
    its copies, and rows of any alignment are read (the LM head at V = 50257 without padded
    copies).
    """
    THREADS_M = BM // 8
    TC = thread_cols                        # a thread's columns: RUNS_N runs of 4, RUN_N apart
    RUNS_N, RUN_N = TC // 4, BN // (TC // 4)
    THREADS_N = BN // TC
    THREADS = THREADS_M * THREADS_N
    # warp_rows: a warp is WARP_ROWS x WARP_COLS threads, WARPS_N of them side by side in the
    # grid. (block_start branches on WARP_TILED, a bool: a branch on warp_rows itself, None by
    # default, made compiling without a GPU fail in tools/kernel_report.py.)
    WARP_TILED = bool(warp_rows)
    WARP_ROWS = warp_rows or 1
    WARP_COLS = 32 // WARP_ROWS
    WARPS_N = THREADS_N // WARP_COLS
    assert not WARP_TILED or (WARP_ROWS * WARP_COLS == 32 and THREADS_N % WARP_COLS == 0
                             and THREADS % 32 == 0), ("warp", warp_rows, THREADS_M, THREADS_N)
    HALF_M = BM // 2                        # (its rows: 2 runs of 4, HALF_M apart)
    GATHERED = 4 * TC                       # the epilogue gathers 4 rows' values at a time
    assert TC % 4 == 0 and BN % TC == 0, ("runs of 4 columns", BN, TC)
    A_TOTAL, B_TOTAL = BM * BK // 4, BK * BN // 4      # 4-float chunks in a slice of A, of B
    A_CHUNKS = -(-A_TOTAL // THREADS)       # how many of them one thread loads (the last
    B_CHUNKS = -(-B_TOTAL // THREADS)       # round partly idle when THREADS does not divide)
    A_STAGED, B_STAGED = 4 * A_CHUNKS, 4 * B_CHUNKS     # floats of them, held in registers
    A_PAD = BM + 4                          # padded rows: the transposing stores avoid bank
    B_PAD = BN + 4                          # conflicts, and rows stay 16-byte aligned
    A_ALONG_K = not transpose_a             # a[M,K]: its 4-float chunks run along k
    B_ALONG_K = transpose_b                 # b[N,K]: likewise
    if gelu and gelu_grad:
        raise ValueError("matmul: one GELU epilogue, forward (gelu) or backward (gelu_grad)")
    gather_epilogue = gather_epilogue or gelu_grad
    if stages and (stages < 2 or BK not in (8, 16) or THREADS % BK != 0):
        raise ValueError("matmul: the cp.async pipeline takes 2 or more stages of BK = 8 or 16 "
                         "(and threads a multiple of BK)")
    if fragments_ahead and (stages or BK != 8):
        raise ValueError("matmul: fragments_ahead takes register-staged slices of 8")
    LINE = THREADS // BK                    # its 4-byte copies: threads on a line of a slice
    WAIT_FOR_OLDEST = wait_copies(stages - 2) if stages else None
    WAIT_FOR_ALL = wait_copies(0)

    @inlined
    def read_chunk(x, rows, cols, r, c, vector, dr, dc):
        # x[dr + r, dc + c:dc + c+4], zeros where r, c are outside [:rows, :cols] (dr, dc: where
        # the operand starts in x; 0 but in class_matmul_kernel); 16 bytes at once when vector
        # (then cols % 4 == 0, so a chunk is all in or all out). (Rows that are not 16-byte runs
        # read through the two 16-byte runs around a chunk and ten selects were 6-12% slower
        # than these four 4-byte loads on the LM head at V = 50257: docs/perf.md, v12.)
        if vector:
            if r < rows and c < cols:
                return load4(x, (dr + r, dc + c))
            return float32(0.0), float32(0.0), float32(0.0), float32(0.0)
        x0 = x[dr + r, dc + c] if r < rows and c < cols else float32(0.0)
        x1 = x[dr + r, dc + c + 1] if r < rows and c + 1 < cols else float32(0.0)
        x2 = x[dr + r, dc + c + 2] if r < rows and c + 2 < cols else float32(0.0)
        x3 = x[dr + r, dc + c + 3] if r < rows and c + 3 < cols else float32(0.0)
        return x0, x1, x2, x3

    @inlined
    def read_spread(x, rows, cols, r, c, apart, dr, dc):
        # x[dr + r, dc + c + apart * e] for e < 4, zeros outside [:rows, :cols]: 4-byte loads
        # whose warp reads 32 consecutive floats each, however x's rows are aligned
        x0, x1, x2, x3 = float32(0.0), float32(0.0), float32(0.0), float32(0.0)
        if r < rows:
            x0 = load1(x, (dr + r, dc + c)) if c < cols else x0
            x1 = load1(x, (dr + r, dc + c + apart)) if c + apart < cols else x1
            x2 = load1(x, (dr + r, dc + c + 2 * apart)) if c + 2 * apart < cols else x2
            x3 = load1(x, (dr + r, dc + c + 3 * apart)) if c + 3 * apart < cols else x3
        return x0, x1, x2, x3

    @inlined
    def load_slice(staged, x, chunks, total, along_k, width, vector, size, k_end, first, k0, tid,
                   dr, dc):
        # one operand's slice into registers, 4-float chunks: op(x)[first:first+width, k0:k0+BK]
        # (A: size M, width BM) or op(x)[k0:k0+BK, first:first+width] (B: size N, width BN),
        # the operand x[dr:, dc:]
        for r in range(chunks):
            chunk = tid + r * THREADS
            if total % THREADS != 0 and chunk >= total:
                continue                    # (idle in the last round)
            if along_k:                     # x[size, K]: a chunk is 4 consecutive k
                i, k = chunk // (BK // 4), (chunk % (BK // 4)) * 4
                x4 = read_chunk(x, size, k_end, first + i, k0 + k, vector, dr, dc)
            elif vector:                    # x[K, size]: a chunk is 4 consecutive m (or n)
                k, i = chunk // (width // 4), (chunk % (width // 4)) * 4
                x4 = read_chunk(x, k_end, size, k0 + k, first + i, True, dr, dc)
            else:                           # ... or, 4 bytes at a time, 4 columns width / 4
                k, i = chunk // (width // 4), chunk % (width // 4)      # apart: each load of
                x4 = read_spread(x, k_end, size, k0 + k, first + i, width // 4, dr, dc)  # a warp
            for e in range(4):                                  # then reads consecutive floats
                staged[4 * r + e] = x4[e]

    @inlined
    def park(tiles, buffer, staged, chunks, total, along_k, width, vector, tid):
        # registers -> shared memory tiles[buffer, k, m]; chunks along k are transposed here
        for r in range(chunks):
            chunk = tid + r * THREADS
            if total % THREADS != 0 and chunk >= total:
                continue                    # (idle in the last round)
            if along_k:
                m, k = chunk // (BK // 4), (chunk % (BK // 4)) * 4
                for i in range(4):
                    tiles[buffer, k + i, m] = staged[4 * r + i]
            elif not vector:                # (read_spread's columns, width / 4 apart)
                k, m = chunk // (width // 4), chunk % (width // 4)
                for i in range(4):
                    store1(tiles, (buffer, k, m + i * (width // 4)), staged[4 * r + i])
            else:
                k, m = chunk // (width // 4), (chunk % (width // 4)) * 4
                store4(tiles, (buffer, k, m), staged[4 * r], staged[4 * r + 1],
                       staged[4 * r + 2], staged[4 * r + 3])

    @inlined
    def load_fragments(a_frag, b_frag, a_tiles, b_tiles, buffer, kk, ty, tx):
        # the thread's 8 values of op(a)[:, kk] and its TC of op(b)[kk, :]: 2 + TC/4 16-byte
        # shared-memory loads
        for half in range(2):
            x = load4(a_tiles, (buffer, kk, half * HALF_M + ty * 4))
            for i in range(4):
                a_frag[half * 4 + i] = x[i]
        for run in range(RUNS_N):
            y = load4(b_tiles, (buffer, kk, run * RUN_N + tx * 4))
            for i in range(4):
                b_frag[run * 4 + i] = y[i]

    @inlined
    def multiply_fragments(acc, a_frag, b_frag):
        # acc[8,TC] += a_frag (outer) b_frag: 8*TC multiply-adds (64 at TC = 8)
        for i in range(8):
            for j in range(TC):
                acc[i, j] += a_frag[i] * b_frag[j]

    @inlined
    def outer_product(acc, a_frag, b_frag, a_tiles, b_tiles, buffer, kk, ty, tx):
        # one step of k: acc[8,TC] += op(a)[thread's rows, kk] (outer) op(b)[kk, thread's cols]
        load_fragments(a_frag, b_frag, a_tiles, b_tiles, buffer, kk, ty, tx)
        multiply_fragments(acc, a_frag, b_frag)

    @inlined
    def step_ahead(acc, a_now, b_now, a_next, b_next, a_tiles, b_tiles, buffer, kk_next, ty, tx):
        # step kk_next's fragments read while the step before (in a_now, b_now) is multiplied
        load_fragments(a_next, b_next, a_tiles, b_tiles, buffer, kk_next, ty, tx)
        multiply_fragments(acc, a_now, b_now)

    @inlined
    def slice_product_ahead(acc, a0, b0, a1, b1, a_tiles, b_tiles, buffer, ty, tx):
        # steps 0-6 of a slice of 8 whose step 0 is in (a0, b0); leaves step 7 in (a1, b1)
        step_ahead(acc, a0, b0, a1, b1, a_tiles, b_tiles, buffer, 1, ty, tx)
        step_ahead(acc, a1, b1, a0, b0, a_tiles, b_tiles, buffer, 2, ty, tx)
        step_ahead(acc, a0, b0, a1, b1, a_tiles, b_tiles, buffer, 3, ty, tx)
        step_ahead(acc, a1, b1, a0, b0, a_tiles, b_tiles, buffer, 4, ty, tx)
        step_ahead(acc, a0, b0, a1, b1, a_tiles, b_tiles, buffer, 5, ty, tx)
        step_ahead(acc, a1, b1, a0, b0, a_tiles, b_tiles, buffer, 6, ty, tx)
        step_ahead(acc, a0, b0, a1, b1, a_tiles, b_tiles, buffer, 7, ty, tx)

    @inlined
    def slice_product(acc, a_frag, b_frag, a_tiles, b_tiles, buffer, kk, ty, tx):
        # eight steps of k, kk .. kk+7, written out: as a rolled loop, its counter and address
        # arithmetic cost 6% of the k loop's instructions (SASS), and the shared-memory
        # addresses become constant offsets
        outer_product(acc, a_frag, b_frag, a_tiles, b_tiles, buffer, kk, ty, tx)
        outer_product(acc, a_frag, b_frag, a_tiles, b_tiles, buffer, kk + 1, ty, tx)
        outer_product(acc, a_frag, b_frag, a_tiles, b_tiles, buffer, kk + 2, ty, tx)
        outer_product(acc, a_frag, b_frag, a_tiles, b_tiles, buffer, kk + 3, ty, tx)
        outer_product(acc, a_frag, b_frag, a_tiles, b_tiles, buffer, kk + 4, ty, tx)
        outer_product(acc, a_frag, b_frag, a_tiles, b_tiles, buffer, kk + 5, ty, tx)
        outer_product(acc, a_frag, b_frag, a_tiles, b_tiles, buffer, kk + 6, ty, tx)
        outer_product(acc, a_frag, b_frag, a_tiles, b_tiles, buffer, kk + 7, ty, tx)

    @inlined
    def gather_rows(values, x, i0, m0, n0, ty, tx, M, N, dc):
        # values[TC * r + j] = x[row of the thread's (i0 + r)-th, dc + its j-th column] for r <
        # 4, j < TC (zero outside x[:M, dc:dc + N]): its loads issued together, before any is
        # used
        for r in range(4):
            row = m0 + (i0 // 4) * HALF_M + ty * 4 + r
            for run in range(RUNS_N):
                col = n0 + run * RUN_N + tx * 4
                for e in range(4):
                    values[TC * r + 4 * run + e] = float32(0.0)
                if vector_out:
                    if row < M and col < N:
                        x4 = load4(x, (row, dc + col))
                        for e in range(4):
                            values[TC * r + 4 * run + e] = x4[e]
                else:
                    for e in range(4):
                        if row < M and col + e < N:
                            values[TC * r + 4 * run + e] = x[row, dc + col + e]

    @inlined
    def fold_rows(acc, values, x, b_frag, i0, m0, n0, ty, tx, M, N, dc, with_gelu_grad):
        # acc[i0 .. i0+3, :] = (acc + bias) * gelu'(x) if with_gelu_grad, else (acc + bias) + x
        # (x's columns from dc on)
        gather_rows(values, x, i0, m0, n0, ty, tx, M, N, dc)
        for r in range(4):
            for j in range(TC):
                if with_gelu_grad:
                    acc[i0 + r, j] = (acc[i0 + r, j] + b_frag[j]) * gelu_derivative(values[TC * r + j])
                else:
                    acc[i0 + r, j] = (acc[i0 + r, j] + b_frag[j]) + values[TC * r + j]

    @inlined
    def store_row(out, hidden, acc, b_frag, i, z, m0, n0, ty, tx, M, N, dc, accumulate):
        # out[z, the thread's i-th row, dc + its TC columns] = acc[i, :], plus its bias (b_frag)
        # and (accumulate) what out holds when the epilogue did not gather those in already;
        # with gelu, gelu of it into hidden too
        row = m0 + (i // 4) * HALF_M + ty * 4 + i % 4
        if vector_out:                  # 16 bytes at a time: out[row, col:col+4]
            for run in range(RUNS_N):
                col = n0 + run * RUN_N + tx * 4
                j = run * 4
                if row < M and col < N:
                    v0, v1, v2, v3 = acc[i, j], acc[i, j + 1], acc[i, j + 2], acc[i, j + 3]
                    if not gather_epilogue:
                        v0 += b_frag[j]
                        v1 += b_frag[j + 1]
                        v2 += b_frag[j + 2]
                        v3 += b_frag[j + 3]
                        if accumulate:
                            o = load4(out, (z, row, dc + col))
                            v0 += o[0]
                            v1 += o[1]
                            v2 += o[2]
                            v3 += o[3]
                    store4(out, (z, row, dc + col), v0, v1, v2, v3)
                    if gelu:
                        store4(hidden, (row, col), gelu_value(v0), gelu_value(v1),
                               gelu_value(v2), gelu_value(v3))
        else:                           # 4 bytes at a time
            for j in range(TC):
                col = n0 + (j // 4) * RUN_N + tx * 4 + j % 4
                if row < M and col < N:
                    value = acc[i, j]
                    if not gather_epilogue:
                        value += b_frag[j]
                        if accumulate:
                            value += out[z, row, dc + col]
                    out[z, row, dc + col] = value
                    if gelu:
                        hidden[row, col] = gelu_value(value)

    @inlined
    def block_start(acc):
        # zeroes the accumulators; returns where this block and thread work: the thread's index
        # tid and its place (ty, tx) on the THREADS_M x THREADS_N grid, the output tile's first
        # row m0 and column n0
        for i in range(8):
            for j in range(TC):
                acc[i, j] = float32(0.0)
        tid = cuda.threadIdx.x
        ty, tx = tid // THREADS_N, tid % THREADS_N
        if WARP_TILED:
            warp, lane = tid // 32, tid % 32
            ty = (warp // WARPS_N) * WARP_ROWS + lane // WARP_COLS
            tx = (warp % WARPS_N) * WARP_COLS + lane % WARP_COLS
        return tid, ty, tx, cuda.blockIdx.y * BM, cuda.blockIdx.x * BN

    @inlined
    def epilogue(out, hidden, acc, b_frag, bias, has_bias, accumulate, z, m0, n0, ty, tx, M, N,
                 dc):
        # the bias of this thread's columns (or zeros) into b_frag, then its 8 rows of out
        # (out[z, :, dc:], dc 0 but in class_matmul_kernel)
        for run in range(RUNS_N):
            col = n0 + run * RUN_N + tx * 4
            for j in range(4):
                b_frag[run * 4 + j] = float32(0.0)
            if has_bias and vector_out and col < N:
                y = load4(bias, (col,))
                for j in range(4):
                    b_frag[run * 4 + j] = y[j]
            elif has_bias:
                for j in range(4):
                    if col + j < N:
                        b_frag[run * 4 + j] = bias[col + j]
        # Then, in order: the bias, gelu' (gelu_grad), what out holds (accumulate). With
        # gather_epilogue they go into acc first, rows 0-3 and 4-7 each gathered with all their
        # loads in flight at once (a load of hidden or out placed after a store to out must
        # wait for it: the compiler cannot tell the arrays apart, and the SASS had 16 load ->
        # store round trips in a row per thread); else store_row adds them row by row.
        # Every row is written out (as slice_product), so that acc is indexed by constants and
        # stays in registers however long the epilogue (with GELU, a rolled loop put it on the
        # stack).
        if gather_epilogue:
            values = cuda.local.array(GATHERED, float32)
            if gelu_grad:
                fold_rows(acc, values, hidden, b_frag, 0, m0, n0, ty, tx, M, N, 0, True)
                fold_rows(acc, values, hidden, b_frag, 4, m0, n0, ty, tx, M, N, 0, True)
                for j in range(TC):
                    b_frag[j] = float32(0.0)
            if accumulate:
                fold_rows(acc, values, out[z], b_frag, 0, m0, n0, ty, tx, M, N, dc, False)
                fold_rows(acc, values, out[z], b_frag, 4, m0, n0, ty, tx, M, N, dc, False)
            elif not gelu_grad:
                for i in range(8):
                    for j in range(TC):
                        acc[i, j] += b_frag[j]
        store_row(out, hidden, acc, b_frag, 0, z, m0, n0, ty, tx, M, N, dc, accumulate)
        store_row(out, hidden, acc, b_frag, 1, z, m0, n0, ty, tx, M, N, dc, accumulate)
        store_row(out, hidden, acc, b_frag, 2, z, m0, n0, ty, tx, M, N, dc, accumulate)
        store_row(out, hidden, acc, b_frag, 3, z, m0, n0, ty, tx, M, N, dc, accumulate)
        store_row(out, hidden, acc, b_frag, 4, z, m0, n0, ty, tx, M, N, dc, accumulate)
        store_row(out, hidden, acc, b_frag, 5, z, m0, n0, ty, tx, M, N, dc, accumulate)
        store_row(out, hidden, acc, b_frag, 6, z, m0, n0, ty, tx, M, N, dc, accumulate)
        store_row(out, hidden, acc, b_frag, 7, z, m0, n0, ty, tx, M, N, dc, accumulate)

    # (inlined by Numba, not NVVM: so the row classes' NN kernel fits 128 registers; inlined by
    # NVVM, it took 143, ptxas sm_90)
    @inlined_by_numba
    def outside_step(acc, a_frag, b_frag, a, b, k, m0, n0, ty, tx, M, N, a_dc, b_dr, b_dc):
        # one step of k read from global memory, not from the staged slices: the thread's 8
        # values of a[:, a_dc + k] and TC of b[b_dr + k, b_dc:] (neither transposed), zeros
        # outside [:M], [:N]; the row classes' k outside a row's window (class_matmul_kernel)
        for i in range(8):
            row = m0 + (i // 4) * HALF_M + ty * 4 + i % 4
            a_frag[i] = float32(0.0)
            if row < M:
                a_frag[i] = a[row, a_dc + k]
        for run in range(RUNS_N):           # (b's row b_dr + k is there: k + 1 rows checked)
            x4 = read_chunk(b, k + 1, N, k, n0 + run * RUN_N + tx * 4, vector_b, b_dr, b_dc)
            for e in range(4):
                b_frag[run * 4 + e] = x4[e]
        multiply_fragments(acc, a_frag, b_frag)

    # (the simulator's cuda.jit takes no launch_bounds)
    # (and a block of more than 256 threads must fit its registers: at most 128 a thread for 512)
    capped = blocks_per_sm > 1 or THREADS > 256
    bounds = dict(launch_bounds=(THREADS, blocks_per_sm)) if capped and not SIMULATOR else {}

    @inlined
    def staged_product(out, a, b, bias, has_bias, accumulate, hidden, z, k_start, k_end, M, N,
                       a_dc, b_dr, b_dc, o_dc, before, after):
        # out[z, this block's tile] (+)= op(a)[tile's rows, k_start:k_end] . op(b)[k_start:k_end,
        # tile's columns] (+ bias) for an M x N output, the slices staged through registers:
        # the body of blocked_matmul_kernel and class_matmul_kernel. The operands and the output
        # start that many columns (dc) and rows (dr) into a, b and out, and the `before` k
        # before k_start and `after` after k_end are added one by one (0 in
        # blocked_matmul_kernel, where the compiler drops them).
        a_tiles = cuda.shared.array((2, BK, A_PAD), float32)   # op(a) slices, k-major
        b_tiles = cuda.shared.array((2, BK, B_PAD), float32)   # op(b) slices
        acc = cuda.local.array((8, TC), float32)
        a_frag = cuda.local.array(8, float32)
        b_frag = cuda.local.array(TC, float32)
        a_frag_ahead = cuda.local.array(8, float32)        # (fragments_ahead: the second set)
        b_frag_ahead = cuda.local.array(TC, float32)
        a_next = cuda.local.array(A_STAGED, float32)
        b_next = cuda.local.array(B_STAGED, float32)
        tid, ty, tx, m0, n0 = block_start(acc)
        # the k outside [k_start, k_end) first (none in blocked_matmul_kernel; a not
        # transposed only: compiled into TN, the code held 158 registers, ptxas sm_90): before
        # the slices, so that nothing they need stays live through the k loop (after it, the
        # row classes' NN kernel needed 133 registers and a loop of 623 instructions)
        if not transpose_a:
            for k in range(k_start - before, k_start):
                outside_step(acc, a_frag, b_frag, a, b, k, m0, n0, ty, tx, M, N, a_dc, b_dr, b_dc)
            for k in range(k_end, k_end + after):
                outside_step(acc, a_frag, b_frag, a, b, k, m0, n0, ty, tx, M, N, a_dc, b_dr, b_dc)

        # the first slice goes straight to buffer 0
        load_slice(a_next, a, A_CHUNKS, A_TOTAL, A_ALONG_K, BM, vector_a, M, k_end, m0, k_start,
                   tid, 0, a_dc)
        load_slice(b_next, b, B_CHUNKS, B_TOTAL, B_ALONG_K, BN, vector_b, N, k_end, n0, k_start,
                   tid, b_dr, b_dc)
        park(a_tiles, 0, a_next, A_CHUNKS, A_TOTAL, A_ALONG_K, BM, vector_a, tid)
        park(b_tiles, 0, b_next, B_CHUNKS, B_TOTAL, B_ALONG_K, BN, vector_b, tid)
        cuda.syncthreads()
        if fragments_ahead:
            load_fragments(a_frag, b_frag, a_tiles, b_tiles, 0, 0, ty, tx)

        # Unconditionally, even after the last slice (its "next" is zeros from beyond k_end, parked
        # in a buffer nobody reads again): loads guarded by `if there is a next slice` were
        # sunk by the compiler to the end of the slice, next to the stores that use them, and
        # then nothing hid their latency (SASS).
        buffer = 0
        for k0 in range(k_start, k_end, BK):
            # issue the next slice's global loads now ...
            load_slice(a_next, a, A_CHUNKS, A_TOTAL, A_ALONG_K, BM, vector_a, M, k_end, m0,
                       k0 + BK, tid, 0, a_dc)
            load_slice(b_next, b, B_CHUNKS, B_TOTAL, B_ALONG_K, BN, vector_b, N, k_end, n0,
                       k0 + BK, tid, b_dr, b_dc)
            if fragments_ahead:             # ... and multiply the current one meanwhile
                slice_product_ahead(acc, a_frag, b_frag, a_frag_ahead, b_frag_ahead, a_tiles,
                                    b_tiles, buffer, ty, tx)
            else:
                for kk in range(0, BK, 8):
                    slice_product(acc, a_frag, b_frag, a_tiles, b_tiles, buffer, kk, ty, tx)
            # park the next slice in the other buffer
            park(a_tiles, 1 - buffer, a_next, A_CHUNKS, A_TOTAL, A_ALONG_K, BM,
                 vector_a, tid)
            park(b_tiles, 1 - buffer, b_next, B_CHUNKS, B_TOTAL, B_ALONG_K, BN,
                 vector_b, tid)
            cuda.syncthreads()
            if fragments_ahead:             # the next slice's first step, then this one's last
                load_fragments(a_frag, b_frag, a_tiles, b_tiles, 1 - buffer, 0, ty, tx)
                multiply_fragments(acc, a_frag_ahead, b_frag_ahead)
            buffer = 1 - buffer

        epilogue(out, hidden, acc, b_frag, bias, has_bias, accumulate, z, m0, n0, ty, tx, M, N,
                 o_dc)

    @cuda.jit(**bounds)
    def blocked_matmul_kernel(out, a, b, bias, has_bias, accumulate, k_per_split, hidden):
        # out[S,M,N]: out[z] (+)= op(a)[:, Kz] . op(b)[Kz, :] (+ bias[N] if has_bias), where Kz is
        # the z-th slice of k_per_split columns of K (split-K; S = 1 when K is not split).
        # hidden[M,N], S = 1: with gelu, gelu(out[0]) is written to it; with gelu_grad, the
        # product (+ bias) is multiplied by gelu'(hidden) before it is added or stored; else
        # not read.
        # grid (N/BN, M/BM, S), block THREADS
        K = a.shape[0] if transpose_a else a.shape[1]
        z = cuda.blockIdx.z
        k_start = z * k_per_split
        staged_product(out, a, b, bias, has_bias, accumulate, hidden, z, k_start,
                       min(K, k_start + k_per_split), out.shape[1], out.shape[2], 0, 0, 0, 0, 0,
                       0)

    @cuda.jit(**bounds)
    def class_matmul_kernel(out, a, b, M, N, K, accumulate, a_dc, b_dr, b_dc, o_dc):
        # S products of M x N x K side by side in one launch, the z-th (z = blockIdx.z) on
        # operands and output that start further into a, b and out, each by where + z * step
        # (the pairs a_dc, b_dr, b_dc, o_dc: columns of a, rows and columns of b, columns of
        # out): out[0, :M, o_dc:o_dc + N] (+)= op(a[:, a_dc:])[:M, :K] . b[b_dr:, b_dc:][:K, :N];
        # NN only: b's rows before b_dr and after b_dr + K too, with a's columns beside them
        # (the k outside a class's window). No bias, no GELU. The four classes of rows of the
        # LM head at V = 50257, in views of a, b, out as C-contiguous arrays of rows 4 times
        # as long (row_class_matmul).
        # grid (N/BN, M/BM, S), block THREADS
        z = cuda.blockIdx.z
        b_row = b_dr[0] + z * b_dr[1]
        staged_product(out, a, b, b[0], False, accumulate, a, 0, 0, K, M, N,
                       a_dc[0] + z * a_dc[1], b_row, b_dc[0] + z * b_dc[1], o_dc[0] + z * o_dc[1],
                       b_row, b.shape[0] - b_row - K)

    @inlined
    def copy_slice(tiles, stage, x, chunks, total, along_k, width, vector, size, k_end, first,
                   k0, tid):
        # one operand's slice into tiles[stage, k, i] with cp.async, zeros outside x[:size,
        # :k_end] (along_k: x[size, K], the slice x[first:first+width, k0:k0+BK]) or x[:k_end,
        # :size] (x[K, size], the slice x[k0:k0+BK, first:first+width])
        if vector and not along_k:      # 16 bytes a copy
            for r in range(chunks):
                chunk = tid + r * THREADS
                if total % THREADS != 0 and chunk >= total:
                    continue
                k, i = chunk // (width // 4), (chunk % (width // 4)) * 4
                valid = k0 + k < k_end and first + i < size
                copy16_async(tiles, (stage, k, i), x, (k0 + k if valid else 0,
                                                       first + i if valid else 0), valid)
            return
        # 4 bytes a copy: the slice is BK lines of width floats (rows of x along M or N, or
        # its columns along k), LINE = THREADS / BK threads on each, consecutive threads on
        # consecutive floats of x. Each copy's address is a row's (the same every slice, or
        # once a slice) plus a column, so that the k loop spends few instructions on them
        # (SASS: 665 against the 16-byte pipeline's 609 for TN, where an index worked out whole
        # for each copy took 696).
        copies = -(-width // LINE)
        if along_k:
            # x[size, K]: a thread copies column k0 + k of rows LINE apart; a warp 8 floats of
            # each of 4 rows, which land transposed on 32 different banks (the tiles' rows are
            # width + 4 floats)
            k = tid % BK
            column = k0 + k if k0 + k < k_end else 0
            for r in range(copies):
                i = tid // BK + r * LINE
                if width % LINE != 0 and i >= width:
                    continue
                row = first + i
                copy4_async(tiles, (stage, k, i), x[row if row < size else 0], (column,),
                            k0 + k < k_end and row < size)
            return
        # x[K, size], rows along M or N: a thread's copies all in one row of x, LINE floats
        # apart; a warp's 32 on consecutive floats of a row
        k, c = tid // LINE, tid % LINE
        row = x[k0 + k if k0 + k < k_end else 0]
        for r in range(copies):
            i = c + r * LINE
            if width % LINE != 0 and i >= width:
                continue
            column = first + i          # (its clamp the same every slice: worked out once)
            copy4_async(tiles, (stage, k, i), row, (column if column < size else 0,),
                        k0 + k < k_end and column < size)

    @cuda.jit(**bounds)
    def pipelined_matmul_kernel(out, a, b, bias, has_bias, accumulate, k_per_split, hidden):
        # as blocked_matmul_kernel; `stages` slices in flight
        a_tiles = cuda.shared.array((stages, BK, A_PAD), float32)
        b_tiles = cuda.shared.array((stages, BK, B_PAD), float32)
        acc = cuda.local.array((8, TC), float32)
        a_frag = cuda.local.array(8, float32)
        b_frag = cuda.local.array(TC, float32)
        M, N = out.shape[1], out.shape[2]
        K = a.shape[0] if transpose_a else a.shape[1]
        tid, ty, tx, m0, n0 = block_start(acc)
        z = cuda.blockIdx.z
        k_start = z * k_per_split
        k_end = min(K, k_start + k_per_split)

        # the first stages - 1 slices start on their way, a group each
        for s in range(stages - 1):
            copy_slice(a_tiles, s, a, A_CHUNKS, A_TOTAL, A_ALONG_K, BM, vector_a, M,
                       k_end, m0, k_start + s * BK, tid)
            copy_slice(b_tiles, s, b, B_CHUNKS, B_TOTAL, B_ALONG_K, BN, vector_b, N,
                       k_end, n0, k_start + s * BK, tid)
            commit_copies()
        stage = 0
        for k0 in range(k_start, k_end, BK):
            WAIT_FOR_OLDEST()       # this thread's copies of slice k0 have landed ...
            cuda.syncthreads()      # ... and everyone's; everyone is done with the last slice
            # so its stage takes the slice stages - 1 ahead (zeros past k_end: groups stay even)
            ahead = stage - 1 if stage > 0 else stages - 1      # (stage + stages - 1) % stages
            copy_slice(a_tiles, ahead, a, A_CHUNKS, A_TOTAL, A_ALONG_K, BM, vector_a,
                       M, k_end, m0, k0 + (stages - 1) * BK, tid)
            copy_slice(b_tiles, ahead, b, B_CHUNKS, B_TOTAL, B_ALONG_K, BN, vector_b,
                       N, k_end, n0, k0 + (stages - 1) * BK, tid)
            commit_copies()
            # (BK = 16 written out: as a loop over kk it stayed rolled in SASS, 1234
            # instructions a slice for its 1024 FFMA, against 1191 so)
            slice_product(acc, a_frag, b_frag, a_tiles, b_tiles, stage, 0, ty, tx)
            if BK == 16:
                slice_product(acc, a_frag, b_frag, a_tiles, b_tiles, stage, 8, ty, tx)
            stage = stage + 1 if stage + 1 < stages else 0       # (no 64-bit modulo)
        WAIT_FOR_ALL()              # no copy may land in shared memory after the block ends

        epilogue(out, hidden, acc, b_frag, bias, has_bias, accumulate, z, m0, n0, ty, tx, M, N, 0)

    kernel = pipelined_matmul_kernel if stages else blocked_matmul_kernel
    for each in (kernel, class_matmul_kernel):
        each.threads = THREADS
        each.launch_bounds = bounds.get("launch_bounds")
        each.tile = (BM, BN, BK)
        each.thread_outputs = 8 * TC
    kernel.classes = class_matmul_kernel        # (the register-staged kernel's, in any case)
    return kernel


@cuda.jit
def sum_splits_kernel(out, partials, bias, has_bias, accumulate):
    # out[M,N] (+)= sum over z of partials[z, M, N] (+ bias[N]), in order z = 0, 1, ...
    M, N = out.shape
    for i in range(cuda.grid(1), M * N, cuda.gridsize(1)):
        row = i // N
        col = i % N
        total = bias[col] if has_bias else float32(0.0)
        for z in range(partials.shape[0]):
            total += partials[z, row, col]
        if accumulate:
            total += out[row, col]
        out[row, col] = total


@cuda.jit
def sum_splits4_kernel(out, partials, bias, has_bias, accumulate, N):
    # sum_splits_kernel on flat views, 4 consecutive elements per step (16-byte loads and
    # stores, no division per element): out[M*N] (+)= sum over z of partials[z, M*N] (+ bias
    # along each row of N); N % 4 == 0, so the 4 are in one row. The same additions in the
    # same order as sum_splits_kernel.
    for i in range(cuda.grid(1) * 4, out.shape[0], cuda.gridsize(1) * 4):
        t0 = t1 = t2 = t3 = float32(0.0)
        if has_bias:
            t0, t1, t2, t3 = load4(bias, (i % N,))
        for z in range(partials.shape[0]):
            x = load4(partials, (z, i))
            t0, t1, t2, t3 = t0 + x[0], t1 + x[1], t2 + x[2], t3 + x[3]
        if accumulate:
            x = load4(out, (i,))
            t0, t1, t2, t3 = t0 + x[0], t1 + x[1], t2 + x[2], t3 + x[3]
        store4(out, (i,), t0, t1, t2, t3)


def sum_splits(out, partials, bias, has_bias, accumulate):
    """out[M,N] (+)= the split-K partials [S,M,N] summed in order (+ bias): 16 bytes at a time
    where rows and arrays allow it (the 120m step's 72 sums took 1.9 ms with the 4-byte kernel,
    session 5), else sum_splits_kernel."""
    M, N = out.shape
    S = partials.shape[0]
    if (N % 4 == 0 and aligned16(out) and aligned16(partials) and is_contiguous(out)
            and (not has_bias or aligned16(bias))):
        launch(sum_splits4_kernel, *elementwise_grid(M * N // 4), out.reshape(M * N),
               partials.reshape(S, M * N), bias, has_bias, accumulate, N)
    else:
        launch(sum_splits_kernel, *elementwise_grid(M * N), out, partials, bias, has_bias,
               accumulate)


def resident_blocks(threads, thread_outputs=64):
    """Blocks of `threads` threads that the H200 runs at once (64K registers per
    multiprocessor), counting ~2 registers per output a thread accumulates (8 x 8: <= 128):
    2 per multiprocessor for the 256-thread kernels of 8 x 8, 1 for 512 threads or for 8 x 16
    (254 registers)."""
    return MULTIPROCESSORS * max(1, 2 * 256 * 64 // (threads * thread_outputs))


RESIDENT_BLOCKS = resident_blocks(256)      # of the default kernels'
L2_BYTES = 50 * 2**20          # the H200's L2 cache


def k_per_slice(K, splits, BK):
    """Rows of K in each of `splits` slices: K / splits, rounded up to whole BK-slices."""
    return blocks(blocks(K, splits), BK) * BK


def split_count(M, N, K, tile, slots=RESIDENT_BLOCKS, l2_bytes=L2_BYTES):
    """How many slices of K to compute in parallel (split-K). Only when the M x N grid alone
    leaves multiprocessors idle (the weight gradients: M x N = C x C or C x 4C, K = B*T), and
    never slices thinner than 256. A grid runs in waves of `slots` blocks, so 288 blocks take
    as long as 528: the count chosen is the smallest whose last wave is at least 90% full and
    whose slice of both operands' rows, k_per_slice x (M + N) floats, fits in half the L2
    (else the smallest well-filled one; else the one that fills its waves best).

    The L2 condition comes from H200 measurements of dW = X^T . dY, K = 16384 (2026-11-29;
    128 x 128 tiles, 264 resident blocks; first the count the waves alone pick):
        M x N        tiles   ms at that many splits             MiB of X and dY rows a slice
        768 x 3072   144     5: 1.958   2: 2.52    10: 1.809    48 at 5, 24 at 10
        (3072 x 768 the same)
        768 x 768    36      7: 0.483   3: 0.657   14: 0.489    14 at 7
        384 x 1536   36      7: 0.484   3: 0.657   14: 0.489    17 at 7
        384 x 384    9       27: 0.138  13: 0.166  54: 0.149    2 at 27
    Twice the slices cost 1-8% where a slice's rows fit in the L2 with room to spare (more
    partial sums to write and add), and gained 8% where they filled the 50 MiB L2: a likely
    reading (not profiled) is that rows then leave the L2 before all the blocks of the slice
    that read them have. Hence the budget of half the L2, and up to 8 waves of blocks, not 4,
    so that the 768 x 3072 product may take its 10 slices (5.5 waves)."""
    BM, BN, BK = tile
    output_blocks = blocks(M, BM) * blocks(N, BN)
    if output_blocks >= slots:
        return 1

    def fill(splits):                   # busy fraction of the waves the grid needs
        total = output_blocks * splits
        return total / (blocks(total, slots) * slots)

    def fits(splits):                   # the slice's rows of both operands in half the L2
        return 4 * k_per_slice(K, splits, BK) * (M + N) <= l2_bytes // 2

    candidates = range(1, max(1, min(K // 256, 8 * slots // output_blocks)) + 1)
    good = [s for s in candidates if fill(s) >= 0.9]
    return ([s for s in good if fits(s)] or good or [max(candidates, key=fill)])[0]


_blocked_kernels = {}


def _blocked_kernel(transpose_a, transpose_b, vectors, tiles=None, gelu=False, gelu_grad=False):
    """The blocked kernel for these transposes, these (vector_a, vector_b, vector_out) and tile
    parameters (make_blocked_matmul_kernel's keyword arguments; None = the defaults), with or
    without a GELU epilogue (forward: gelu, backward: gelu_grad)."""
    # Launch bounds of 2 blocks per multiprocessor (at most 128 registers a thread) where they
    # pay: the plain product (NN) fits in 128 registers unbounded and runs 5% slower bounded;
    # the transposed ones needed 139-143 and ran 11-14% faster bounded, and so did the 4-byte
    # kernels (H200, 2026-11-29: docs/perf.md, v4). Since its epilogue gathers (no spills at
    # 128), the weight gradient (TN, 16-byte) runs 6-9% faster unbounded (session 5, run 1:
    # 0.478 -> 0.447 ms at 768 x 768 x 16384, 1.794 -> 1.653 ms at 768 x 3072). The plain
    # product with gelu' in its epilogue needs 160 registers unbounded and ran 17-23% slower
    # so (1 block per multiprocessor) than bounded (8 bytes of spills at 128).
    # The gathered epilogue, where it measured faster (H200, 2026-11-29, session 4, against the
    # same kernels storing row by row): the plain product 3.5% (0.455 -> 0.440 ms at 16384 x
    # 768 x 768), the weight gradient 1-2%; the input gradient (NT) 5-6% slower (0.462 ->
    # 0.489 ms), so it stores row by row, except with gelu' (fused: 6-10% faster than the
    # product and a gelu_backward pass).
    tiles = dict(tiles or {})
    unbounded = not transpose_b and all(vectors) and not gelu_grad
    tiles.setdefault("blocks_per_sm", 1 if unbounded else 2)
    tiles.setdefault("gather_epilogue", not (transpose_b and not transpose_a))
    tiles["gelu"] = gelu
    tiles["gelu_grad"] = gelu_grad
    key = (transpose_a, transpose_b, vectors, tuple(sorted(tiles.items())))
    if key not in _blocked_kernels:
        _blocked_kernels[key] = make_blocked_matmul_kernel(transpose_a, transpose_b, *vectors,
                                                           **tiles)
    return _blocked_kernels[key]


def _check_matmul(out, a, b, bias, transpose_a, transpose_b, gelu_out, gelu_input):
    check(len(out.shape) == 2 and len(a.shape) == 2 and len(b.shape) == 2,
          f"matmul: out, a, b must be 2-D, got {out.shape}, {a.shape}, {b.shape}")
    M, N = out.shape
    K = a.shape[0] if transpose_a else a.shape[1]
    # an operand whose rows run along M or N may hold them padded to 4k floats (see matmul)
    a_width = a.shape[1] if transpose_a and a.shape == (K, padded_length(M)) else M
    b_width = b.shape[1] if not transpose_b and b.shape == (K, padded_length(N)) else N
    check_shape("matmul a", a, (K, a_width) if transpose_a else (M, K))
    check_shape("matmul b", b, (N, K) if transpose_b else (K, b_width))
    if bias is not None:
        check_shape("matmul bias", bias, (N,))
    check(gelu_out is None or gelu_input is None, "matmul: gelu_out or gelu_input, not both")
    for name, hidden in (("gelu_out", gelu_out), ("gelu_input", gelu_input)):
        if hidden is not None:
            check_shape(f"matmul {name}", hidden, (M, N))
    return M, N, K


# The input gradient dX = dY . W^T (and the tied LM head's logits = X . wte^T) read W^T, an
# operand whose contiguous axis is k: its slices are transposed on their way into shared memory,
# as the plain product's a is, so the product transposes both operands and ran 10% slower than
# the plain one of the same size (H200, 2026-11-29, run 5: 1.92 against 1.73 ms at 16384 x 768
# x 3072, 0.49 against 0.44 ms at 16384 x 768 x 768). A transposed copy of W costs two passes
# over W (8 bytes a weight), against 2 M flops a weight for the product: below 2048 rows the
# copy would cost more than ~3% of the product (sampling reads a row at a time: there W^T is
# read directly). Measured with the copy (session 5, run 2): 0.448 ms and 1.74 ms for those
# two products; the 73 copies of an andrea-120m step take 0.76 ms in all (run 3's profile).
TRANSPOSED_COPY_MIN_ROWS = 2048


def copies_b_transposed(M, N, transpose_a, transpose_b, copy_b_transposed=None):
    """Whether the blocked product reads op(b) = b^T from a transposed copy (the plain kernel)
    rather than through the kernel that transposes both operands. None: when there are at
    least TRANSPOSED_COPY_MIN_ROWS rows and the copy's rows, N floats, are 16-byte multiples."""
    if not transpose_b or transpose_a:
        return False
    if copy_b_transposed is None:
        return M >= TRANSPOSED_COPY_MIN_ROWS and N % 4 == 0
    return bool(copy_b_transposed)


# A product whose operands' rows are not whole 16-byte runs (the LM head at V = 50257) runs
# the 4-byte kernels at 0.70-0.77x cuBLAS, the same product padded (V = 50304) at 0.89-0.95x
# (H200, 2026-11-29, session 6). Padded copies (kernels/pad.py) cost a pass over each operand
# copied, ~8 bytes a float, against 2 flops per (m, n, k) for the product; they are made when
# the bytes copied are under 1/PAD_MIN_FLOPS_PER_BYTE of M N K, about a tenth of the product's
# time at 45 TFLOP/s and ~3 TB/s of copying.
PAD_MIN_FLOPS_PER_BYTE = 75


def pads_unaligned(M, N, K, out, a, b, transpose_a, transpose_b, pad_unaligned=None,
                   aligned=None):
    """Whether the blocked product runs on padded copies: {name: padded shape} for those of
    out, a, b that are copied; None when none is (all aligned, or the copies too dear for the
    product's size; pad_unaligned True / False forces the choice). Only the extents that are
    some operand's row length are padded (N, M with transpose_a, K unless a is transposed and
    b is not). pad_unaligned "operands": the operands only, never the output, which is then
    stored 4 bytes at a time (the operands whose rows run along M or N keep their padded
    width; slower than padding the output too, docs/perf.md v13). aligned: aligned16 of out,
    a, b if known."""
    if pad_unaligned is False:
        return None
    with_out = pad_unaligned != "operands"
    M4 = padded_length(M) if transpose_a else M
    K4 = padded_length(K) if transpose_b or not transpose_a else K
    N4 = padded_length(N)
    aligned = aligned or dict(out=aligned16(out), a=aligned16(a), b=aligned16(b))
    wanted = dict(a=(a, (K4, M4) if transpose_a else (M4, K4)),
                  b=(b, (N4 if with_out else N, K4) if transpose_b else (K4, N4)))
    if with_out:
        wanted["out"] = (out, (M4, N4))
    copied = {name: shape for name, (array, shape) in wanted.items()
              if array.shape != shape or not aligned[name]}
    if not copied:
        return None
    copy_bytes = sum(8 * rows * cols for rows, cols in copied.values())
    if pad_unaligned is None and copy_bytes * PAD_MIN_FLOPS_PER_BYTE > M * N * K:
        return None
    return copied


def padded_matmul(out, a, b, bias, transpose_a, transpose_b, accumulate, copied, **options):
    """out (+)= op(a) . op(b) (+ bias), computed on copies of those of out, a, b in `copied`
    whose rows are padded with zeros to whole 16-byte runs (pads_unaligned's answer): along k
    the zeros add nothing to the sums; along M or N they make rows or columns of the product
    that unpad drops (or, the output not copied, that are never stored)."""
    operands = dict(out=out, a=a, b=b)
    for name, shape in copied.items():
        copy = cuda.device_array(shape, dtype=np.float32, stream=current_stream())
        if name != "out":
            pad(copy, operands[name])
        operands[name] = copy
    if "out" in copied and bias is not None and bias.shape[0] != copied["out"][1]:
        padded_bias = cuda.device_array(copied["out"][1], dtype=np.float32,
                                        stream=current_stream())
        pad(padded_bias, bias)
        bias = padded_bias
    matmul(operands["out"], operands["a"], operands["b"], bias, transpose_a, transpose_b,
           accumulate and "out" not in copied, pad_unaligned=False, **options)
    if "out" in copied:
        unpad(out, operands["out"], accumulate)


# --- rows that are not 16-byte runs, read and written in place: four classes of rows ---------
# Row i of a matrix [R, L] starts i*L floats past the first. When L is not a multiple of 4 the
# rows do not all start on a 16-byte boundary, but rows i and i + 4 start at the same place in
# one: the rows of a class j = i mod 4 (x[j::4], rows 4L floats apart) all have whole aligned
# runs of 4 floats from the same column on. With step = (-L) % 4, class j's window of columns
# may start at first + j * step (first: where row 0's runs start), so that the four windows
# are at column offsets first + j (L + step) of one C-contiguous [R/4, 4L] view (as_classes,
# row i holding rows 4i .. 4i+3). A product whose operand or output has such rows is then one
# launch of class_matmul_kernel (grid z = the class, offsets as numbers), 16-byte loads and
# stores throughout and no padded copy of the large operand, plus the few columns outside the
# windows (at most 12 on either side), apart. Three cases (b not transposed; the LM head at
# V = 50257 has one of each):
#   a rows   out[M,N] (+)= a[M,K] . b[K,N], a's rows not runs (dlogits . W, with W^T copied):
#            a's classes of rows and out's, windows along k (b's rows shifted with them); the
#            k outside a row's window added one by one, before its slices (outside_step)
#   k rows   out[M,N] (+)= a[K,M]^T . b[K,N], b's rows not runs (X^T . dlogits): classes of
#            the rows of a and b (of k), each class's product into partials over its window of
#            n, which sum_windows adds up; the columns outside some window by a product of
#            their own
#   out rows out[M,N] (+)= a[M,K] . b[K,N], out's rows not runs (X . W): out's classes of rows
#            and a's, each over its window of n on a copy of b's columns there
#            (copy_windows_kernel); the columns outside the windows by a product of their own
# The default for such products when large (matmul's pad_unaligned=None), where the case
# applies. History (docs/perf.md v14, v15, v17): four launches, one a class, on views made with
# numba-cuda's x[j::4], which walks all 4096 rows of such a view in Python (~4 ms of host
# time each, that the GPU waited through): 0.71 / 0.73 / 0.68x cuBLAS (fwd / dX / dW); with
# the views made in O(1), 0.85 / 0.83 / 0.81x (v17, run 1); in one launch on strided
# [4, R/4, W] views, dW 0.88x but fwd and dX no faster (NN needed 132 registers there; v17, run 2).

ROW_CLASSES = 4
EDGE = 16       # columns outside the windows, at most, on either side (12 at most: 3 + 3 * 3)


def float_offset(x):
    """Where x's first element sits in its 16-byte run, in floats (0-3). (0 in the simulator:
    there any window is correct, alignment only matters to the hardware.)"""
    return 0 if SIMULATOR else (x.device_ctypes_pointer.value // 4) % 4


def class_window(x):
    """(first, step, count) of a contiguous x[R, L]: class j's rows, x[j::4], are whole aligned
    16-byte runs over columns [first + j * step, first + j * step + count)."""
    L = x.shape[1]
    step = -L % 4
    first = -float_offset(x) % 4
    return first, step, max(0, (L - first - 3 * step) // 4 * 4)


def as_classes(x):
    """x[R, L] (contiguous, R % 4 == 0) as [R/4, 4L], C-contiguous too: row i holds x's rows
    4i .. 4i+3 side by side, so class j's rows x[j::4] are its columns [jL, jL + L) and class
    j's window (class_window) its columns from first + j (L + step): a column offset for
    class_matmul_kernel, whose loads and stores then index a C-contiguous array (on strided
    [4, R/4, W] views, NN needed 132 registers, ptxas sm_90)."""
    R, L = x.shape
    return x.reshape(R // ROW_CLASSES, ROW_CLASSES * L)


def row_class_case(M, N, K, transpose_a, transpose_b, aligned, has_bias, hidden):
    """Which of the three row-class products computes this one ("a rows", "k rows", "out
    rows"), or None (then the 4-byte kernels do). The classes' rows must be as many in each
    class (a multiple of 4) and their windows wider than the edges."""
    if (has_bias or hidden is not None or transpose_b
            or min(M, N, K) < 2 * EDGE or (K if transpose_a else M) % ROW_CLASSES):
        return None
    if not transpose_a and not aligned["a"] and aligned["b"] and aligned["out"]:
        return "a rows"
    if transpose_a and aligned["a"] and not aligned["b"]:
        return "k rows"
    if not transpose_a and aligned["a"] and not aligned["out"]:
        return "out rows"
    return None


# The row classes' small kernels take whole, contiguous arrays and the windows as numbers
# (copies through strided views of the 3.3 GB operands, with pad.copy_corner, took 48 ms for
# the 2 x 16384 x 3 floats of dW's edge columns on the H200 in session 12, likely the same
# host time as above).
ROWS_THREADS = 32 if SIMULATOR else 256


def rows_grid(R, C):
    """(grid, block) for the row-class kernels' loops: rows along grid y, columns along x."""
    across = min(blocks(C, ROWS_THREADS), 4 if SIMULATOR else 256)
    return (across, max(1, min(R, (4 if SIMULATOR else 4096) // across))), ROWS_THREADS


@inlined
def row_columns():
    # (first row, row step, first column, column step) of this thread's grid-stride loops
    return (cuda.blockIdx.y, cuda.gridDim.y, cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x,
            cuda.gridDim.x * cuda.blockDim.x)


@cuda.jit
def copy_windows_kernel(out, x, first, step):
    # out[R, 4C]: out[:, jC:jC + C] = x[:, first + j * step : + C], each class's window of x's
    # columns, side by side
    R, C = out.shape[0], out.shape[1] // ROW_CLASSES
    r0, r_step, c0, c_step = row_columns()
    for r in range(r0, R, r_step):
        for c in range(c0, C, c_step):
            for j in range(ROW_CLASSES):
                out[r, j * C + c] = x[r, first + j * step + c]


@cuda.jit
def gather_edges_kernel(edges, x, lo, hi):
    # edges[R, 2E] = x's columns [0, lo) in edges' first E, [hi, L) in its last E, zeros after
    R, L = x.shape
    E = edges.shape[1] // 2
    r0, r_step, c0, c_step = row_columns()
    for r in range(r0, R, r_step):
        for c in range(c0, 2 * E, c_step):
            col = c if c < E else hi + c - E
            inside = col < lo if c < E else col < L
            edges[r, c] = x[r, col] if inside else float32(0.0)


@cuda.jit
def scatter_edges_kernel(out, edges, first, step, count, hi, accumulate):
    # out[r, c] (+)= edges[r, c] for c < class j's window's first column (j = r % 4), and
    # edges[r, E + c - hi] for c at or past its end: each row's columns outside its window
    R, N = out.shape
    E = edges.shape[1] // 2
    r0, r_step, c0, c_step = row_columns()
    for r in range(r0, R, r_step):
        begin = first + (r % ROW_CLASSES) * step
        for slot in range(c0, 2 * E, c_step):
            col = slot if slot < E else hi + slot - E
            if (slot < E and col < begin) or (slot >= E and begin + count <= col and col < N):
                value = edges[r, slot]
                if accumulate:
                    value += out[r, col]
                out[r, col] = value


@cuda.jit
def sum_windows_kernel(out, partials, first, step, count, lo, hi, accumulate):
    # out[m, n] (+)= sum over j of partials[m, j * count + n - first - j * step], for lo <= n <
    # hi: the k-row classes' partial products side by side, each over its own window of columns
    M = out.shape[0]
    r0, r_step, c0, c_step = row_columns()
    for m in range(r0, M, r_step):
        for n in range(lo + c0, hi, c_step):
            c = n - first
            total = ((partials[m, c] + partials[m, count + c - step])
                     + partials[m, 2 * (count - step) + c]) + partials[m, 3 * (count - step) + c]
            if accumulate:
                total += out[m, n]
            out[m, n] = total


def _split_plan(fast, M, N, K, k_splits):
    """(k_per_split, grid) of the blocked kernel `fast` for an M x N x K product: K in
    k_splits slices (None: split_count's), computed side by side along grid z."""
    BM, BN, BK = fast.tile
    splits = k_splits or split_count(M, N, K, fast.tile,
                                     resident_blocks(fast.threads, fast.thread_outputs))
    k_per_split = k_per_slice(K, splits, BK)
    return k_per_split, (blocks(N, BN), blocks(M, BM), blocks(K, k_per_split))


def _sum_of_slices(fast, grid, k_per_split, out, a, b, bias, has_bias, accumulate):
    """out (+)= the product as grid[2] partial products over slices of K, then their sum in a
    fixed order (+ bias)."""
    M, N = out.shape
    partials = cuda.device_array((grid[2], M, N), dtype=np.float32, stream=current_stream())
    launch(fast, grid, fast.threads, partials, a, b, bias, False, False, k_per_split, a)
    sum_splits(out, partials, bias, has_bias, accumulate)


def takes_row_classes(M, N, K, transpose_a, transpose_b, aligned, has_bias, hidden,
                      copy_b_transposed=None):
    """row_class_case of the product that matmul runs, b^T first copied where matmul copies it
    (copies_b_transposed: the copy's rows aligned)."""
    if transpose_b:
        if not copies_b_transposed(M, N, transpose_a, transpose_b, copy_b_transposed):
            return None
        aligned, transpose_b = dict(aligned, b=True), False
    return row_class_case(M, N, K, transpose_a, transpose_b, aligned, has_bias, hidden)


def row_class_matmul(case, out, a, b, transpose_a, accumulate, tiles=None):
    """out (+)= op(a) . b in four classes of rows, one launch (row_class_case's case; above)."""
    M, N = out.shape
    fast = _blocked_kernel(bool(transpose_a), False, (True, True, True), tiles).classes
    BM, BN, _ = fast.tile

    def classes(out2, a2, b2, rows, cols, inner, accumulate, a_dc, b_dr, b_dc, o_dc):
        # the four classes' rows x cols x inner products, one launch (class_matmul_kernel)
        launch(fast, (blocks(cols, BN), blocks(rows, BM), ROW_CLASSES), fast.threads,
               out2.reshape(1, *out2.shape), a2, b2, rows, cols, inner, accumulate, a_dc, b_dr,
               b_dc, o_dc)

    if case == "a rows":                    # windows along k: a's and out's classes of rows
        K = a.shape[1]                      # (and b's rows with them), out's rows written
        first, step, count = class_window(a)    # whole, the k outside each row's window (b's
        classes(as_classes(out), as_classes(a), b, M // 4, N, count, accumulate,  # rows outside
                (first, K + step), (first, step), (0, 0), (0, N))   # its own) in the same launch
        return
    if case == "k rows":                    # classes of k: partials over each window, summed
        K = a.shape[0]
        first, step, count = class_window(b)
        partials = cuda.device_array((M, ROW_CLASSES * count), dtype=np.float32,
                                     stream=current_stream())
        classes(partials, as_classes(a), as_classes(b), M, count, K // 4, False, (0, M),
                (0, 0), (first, N + step), (0, count))
        lo, hi = first + 3 * step, first + count
        launch(sum_windows_kernel, *rows_grid(M, hi - lo), out, partials, first, step, count,
               lo, hi, accumulate)
        first, step, count = lo, 0, hi - lo     # (every row's window, for the edges)
    else:                                   # "out rows": out's (and a's) classes of rows, b's
        K = a.shape[1]                      # columns in each class's window side by side
        first, step, count = class_window(out)
        b_windows = cuda.device_array((K, ROW_CLASSES * count), dtype=np.float32,
                                      stream=current_stream())
        launch(copy_windows_kernel, *rows_grid(K, count), b_windows, b, first, step)
        classes(as_classes(out), as_classes(a), b_windows, M // 4, count, K, accumulate,
                (0, K), (0, 0), (0, count), (first, N + step))
    # the columns outside some row's window, [0, lo) and [hi, N), computed whole, after the
    # classes' product (the GPU runs it while the host launches these)
    lo, hi = first + 3 * step, first + count
    check(lo <= EDGE and N - hi <= EDGE, "matmul: row classes' edges wider than EDGE")
    edge_columns = cuda.device_array((b.shape[0], 2 * EDGE), dtype=np.float32,
                                     stream=current_stream())
    launch(gather_edges_kernel, *rows_grid(b.shape[0], 2 * EDGE), edge_columns, b, lo, hi)
    edges = cuda.device_array((M, 2 * EDGE), dtype=np.float32, stream=current_stream())
    matmul(edges, a, edge_columns, transpose_a=transpose_a, kernel="blocked", tiles=tiles,
           pad_unaligned=False)
    launch(scatter_edges_kernel, *rows_grid(M, 2 * EDGE), out, edges, first, step, count, hi,
           accumulate)


def matmul(out, a, b, bias=None, transpose_a=False, transpose_b=False, accumulate=False,
           kernel="auto", k_splits=None, tiles=None, gelu_out=None, gelu_input=None,
           copy_b_transposed=None, pad_unaligned=None):
    """out[M,N] (+)= op(a) . op(b) (+ bias). kernel: "auto", "blocked" or "tiled" (the reference).
    gelu_out[M,N]: also gelu(out), the MLP's activation: written by the blocked kernel's
    epilogue (the pre-activation out is kept for GELU's backward), by a GELU kernel after the
    others.
    gelu_input[M,N]: GELU's backward too: the product is the gradient of gelu(gelu_input)
    (dG = dY . W_proj^T, the MLP's hidden layer) and out gets that of gelu_input (H, the
    pre-activation): out (+)= gelu'(gelu_input) * (op(a) . op(b) + bias), in the blocked
    kernel's epilogue, else the product first and gelu_backward after it.

    Blocked kernel only: k_splits, slices of K computed in parallel (None: split_count chooses;
    the row classes below do not split K);
    tiles, a dict of make_blocked_matmul_kernel's tile parameters (None: the defaults);
    copy_b_transposed, with transpose_b: multiply by a transposed copy of b (True), or read b
    transposed in the kernel (False); None: copies_b_transposed decides;
    pad_unaligned, when some operand's rows are not 16-byte runs: run on padded copies (True),
    on padded copies of a and b only ("operands"), in place in four classes of rows ("row
    classes": row_class_matmul, where row_class_case finds a case, else the 4-byte kernels), or
    with the 4-byte kernels (False); None: where pads_unaligned would pad (a product large
    enough, never with GELU), the row classes if they take it, else the padded copies.
    An operand whose rows run along M or N (a transposed: [K, M]; b not: [K, N]) may hold them
    padded to 4k floats ([K, M4], [K, N4]), the padding read by the blocked kernel (16 bytes at
    a time) and left out of out: how padded copies are multiplied, and how a model that keeps
    its weights padded can use them."""
    check_float32(out=out, a=a, b=b, bias=bias, gelu_out=gelu_out, gelu_input=gelu_input)
    M, N, K = _check_matmul(out, a, b, bias, transpose_a, transpose_b, gelu_out, gelu_input)
    if kernel == "auto":
        kernel = "tiled" if SIMULATOR else "blocked"
    if kernel not in ("tiled", "blocked"):
        raise ValueError(f"matmul: unknown kernel {kernel!r}")
    has_bias = bias is not None
    if not has_bias:            # kernels take arrays, not None: a placeholder the kernel never reads
        bias = out.reshape(out.size)[:1]
    hidden = gelu_out if gelu_out is not None else gelu_input
    if kernel == "blocked":     # (each operand's alignment looked at once)
        aligned = dict(out=aligned16(out), a=aligned16(a), b=aligned16(b))
        by_classes = pad_unaligned == "row classes"
        copied = hidden is None and not all(aligned.values()) and not by_classes and (
            pads_unaligned(M, N, K, out, a, b, transpose_a, transpose_b, pad_unaligned, aligned))
        if copied and pad_unaligned is None and takes_row_classes(
                M, N, K, transpose_a, transpose_b, aligned, has_bias, hidden, copy_b_transposed):
            by_classes, copied = True, None     # (faster than the padded copies: see above)
        if copied:
            padded_matmul(out, a, b, bias if has_bias else None, transpose_a, transpose_b,
                          accumulate, copied, kernel=kernel, k_splits=k_splits, tiles=tiles,
                          copy_b_transposed=copy_b_transposed)
            return
        if copies_b_transposed(M, N, transpose_a, transpose_b, copy_b_transposed):
            b_transposed = cuda.device_array((K, N), dtype=np.float32, stream=current_stream())
            transpose(b_transposed, b)
            b, transpose_b = b_transposed, False
            aligned["b"] = aligned16(b)
        case = by_classes and row_class_case(M, N, K, transpose_a, transpose_b, aligned,
                                             has_bias, hidden)
        if case:
            row_class_matmul(case, out, a, b, transpose_a, accumulate, tiles)
            return
        vectors = (aligned["a"], aligned["b"], aligned["out"]
                   and (not has_bias or aligned16(bias)) and (hidden is None or aligned16(hidden)))
        fast = _blocked_kernel(bool(transpose_a), bool(transpose_b), vectors, tiles)
        k_per_split, grid = _split_plan(fast, M, N, K, k_splits)
        if grid[2] == 1:        # one pass, GELU's forward or backward in its epilogue
            if hidden is not None:
                fast = _blocked_kernel(bool(transpose_a), bool(transpose_b), vectors, tiles,
                                       gelu=gelu_out is not None, gelu_grad=gelu_input is not None)
            launch(fast, grid, fast.threads, out.reshape(1, M, N), a, b, bias, has_bias,
                   accumulate, k_per_split, a if hidden is None else hidden)
            return
    if gelu_input is not None:  # (the tiled kernel, or split-K): gelu' after the whole product
        product = cuda.device_array((M, N), dtype=np.float32, stream=current_stream())
        matmul(product, a, b, bias if has_bias else None, transpose_a, transpose_b,
               kernel=kernel, k_splits=k_splits, tiles=tiles)
        gelu_backward(out, product, gelu_input, accumulate)
        return
    if kernel == "tiled":
        launch(matmul_tiled_kernel, (blocks(N, TILE), blocks(M, TILE)), (TILE, TILE),
               out, a, b, bias, has_bias, transpose_a, transpose_b, accumulate)
    else:                       # partial products per K slice, then their sum in a fixed order
        _sum_of_slices(fast, grid, k_per_split, out, a, b, bias, has_bias, accumulate)
    if gelu_out is not None:    # (the tiled kernel, or split-K: GELU after the sum)
        gelu_forward(gelu_out, out)


def matmul_numpy(out, a, b, bias=None, transpose_a=False, transpose_b=False, accumulate=False,
                 kernel="auto", k_splits=None, tiles=None, gelu_out=None, gelu_input=None,
                 copy_b_transposed=None, pad_unaligned=None):
    M, N, _ = _check_matmul(out, a, b, bias, transpose_a, transpose_b, gelu_out, gelu_input)
    product = (a.T if transpose_a else a)[:M] @ (b.T if transpose_b else b)[:, :N]
    if bias is not None:
        product += bias
    if gelu_input is not None:
        gelu_backward_numpy(out, product, gelu_input, accumulate)
    elif accumulate:
        out += product
    else:
        out[...] = product
    if gelu_out is not None:
        gelu_forward_numpy(gelu_out, out)


# --- sum over rows: the bias gradient (and the position-embedding gradient) ----------------

@cuda.jit
def sum_rows_kernel(partials, x):
    # partials[R, N]: partials[r] = sum of the r-th chunk of x[M, N]'s rows; grid (N/32, R),
    # block (32, ROW_GROUPS). Stage 1 of two (reduce.py); no atomics, so the sum is reproducible.
    partial = cuda.shared.array((ROW_GROUPS, COLUMNS), float32)
    M, N = x.shape
    first, end = chunk_rows(M)
    col = cuda.blockIdx.x * COLUMNS + cuda.threadIdx.x
    total = float32(0.0)
    if col < N:
        for row in range(first + cuda.threadIdx.y, end, ROW_GROUPS):
            total += x[row, col]
    total = column_partials_sum(total, partial)
    if cuda.threadIdx.y == 0 and col < N:
        partials[cuda.blockIdx.y, col] = total


def sum_rows(out, x, accumulate=False):
    """out[N] (+)= x[M,N] summed over its M rows."""
    check_float32(out=out, x=x)
    check(len(x.shape) == 2, f"sum_rows: x must be 2-D, got {x.shape}")
    check_shape("sum_rows out", out, (x.shape[1],))
    M, N = x.shape
    partials = cuda.device_array((row_chunks(M, N), N), np.float32, stream=current_stream())
    launch(sum_rows_kernel, (blocks(N, COLUMNS), partials.shape[0]), (COLUMNS, ROW_GROUPS),
           partials, x)
    launch(finish_column_sums_kernel, *elementwise_grid(N), out, partials, accumulate)


def sum_rows_numpy(out, x, accumulate=False):
    check_shape("sum_rows out", out, (x.shape[1],))
    if accumulate:
        out += x.sum(axis=0)
    else:
        out[...] = x.sum(axis=0)


# --- transposed copy: out = x^T, the operand of the input-gradient product -----------------

TRANSPOSE_TILE = 32         # a block moves a 32 x 32 tile,
TRANSPOSE_ROWS = 8          # 8 rows of threads, 4 elements each
TRANSPOSE_PADDED = 33       # the shared tile's row: 32 floats and a pad


@cuda.jit
def transpose_kernel(out, x):
    # out[C,R] = x[R,C]^T; grid (C/32, R/32), block (32, 8). The tile goes through shared
    # memory so that both the reads (along x's rows) and the writes (along out's rows) are
    # coalesced; its rows are padded to 33 floats, so that reading it down a column touches 32
    # different banks.
    tile = cuda.shared.array((TRANSPOSE_TILE, TRANSPOSE_PADDED), float32)
    R, C = x.shape
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    r0 = cuda.blockIdx.y * TRANSPOSE_TILE
    c0 = cuda.blockIdx.x * TRANSPOSE_TILE
    for i in range(ty, TRANSPOSE_TILE, TRANSPOSE_ROWS):     # tile[i, j] = x[r0 + i, c0 + j]
        if r0 + i < R and c0 + tx < C:
            tile[i, tx] = x[r0 + i, c0 + tx]
    cuda.syncthreads()
    for j in range(ty, TRANSPOSE_TILE, TRANSPOSE_ROWS):     # out[c0 + j, r0 + i] = tile[i, j]
        if c0 + j < C and r0 + tx < R:
            out[c0 + j, r0 + tx] = tile[tx, j]


def transpose(out, x):
    """out[C,R] = x[R,C]^T."""
    check_float32(out=out, x=x)
    check(len(x.shape) == 2, f"transpose: x must be 2-D, got {x.shape}")
    R, C = x.shape
    check_shape("transpose out", out, (C, R))
    launch(transpose_kernel, (blocks(C, TRANSPOSE_TILE), blocks(R, TRANSPOSE_TILE)),
           (TRANSPOSE_TILE, TRANSPOSE_ROWS), out, x)


def transpose_numpy(out, x):
    check_shape("transpose out", out, x.shape[::-1])
    out[...] = x.T
