"""Matrix multiply and its backward products.

    out[M,N]  (+)=  op(a)[M,K] . op(b)[K,N]  (+ bias[N])      op(x) = x or x^T

Every linear layer of the model is one call (activations [B,T,C] are viewed as [B*T, C] rows):
    forward      Y[M,N]  = X[M,K] . W[K,N] + b          (W stored [in, out], as GPT-2 does)
    backward     dX[M,K] = dY[M,N] . W^T                transpose_b=True
                 dW[K,N] += X^T . dY                    transpose_a=True, accumulate=True
                 db[N]   += sum of dY's rows            reduce.sum_rows
    LM head      logits[M,V] = X[M,C] . wte[V,C]^T      transpose_b=True (tied to the embedding)
    MLP up       H[M,4C] = X . W + b, G = gelu(H)       gelu_out=G: GELU in the epilogue
    MLP down     dH[M,4C] = (dY . W^T) * gelu'(H)       gelu_input=H: GELU's backward in the
                                                        epilogue (the product is dG)
    q, k, v      dX = dQ . W_Q^T + dK . W_K^T           products_in_turn (backend.matmul_sum):
                      + dV . W_V^T                      one input, three products' gradients
`accumulate` says whether out is overwritten (=) or added to (+=): gradients of parameters
accumulate into the flat gradient buffer, and a tensor used twice sums its two gradients.

Two kernels compute the same function as the NumPy twin, matmul_numpy:
  matmul_tiled_kernel   the reference: one thread per output element, 16 x 16 tiles of both
                        operands staged through shared memory. Any shape, any alignment.
  matmul_kernel(...)    the fast kernel, the register-blocked SGEMM of the optimisation ladder
                        (tools/dev/matmul/ walks there one idea at a time):
      block tile   a 128 x 128 tile of out, 256 threads; each thread keeps an 8 x 8 tile of
                   it in registers: rows ty*4 + {0..3} and 64 + ty*4 + {0..3}, columns
                   likewise, so its fragments are runs of 4 floats
      k slices     K advances 8 at a time; both operands' slices sit k-major in shared memory
                   (a_tiles[k, m], b_tiles[k, n]), so a step of k is 4 16-byte shared loads
                   feeding 64 fused multiply-adds; an operand stored with k contiguous is
                   transposed on its way in, into tiles padded by 4 floats (no bank conflicts)
      16-byte      every global load and store moves 4 floats (vector.load4 / store4)
      double       slice s+1 is loaded from global memory into registers while slice s is
      buffering    multiplied out of shared memory, then parked in the other buffer
      epilogue     the bias, GELU (forward: gelu(out) also written; backward: the product
                   times gelu'(hidden)) and what out already holds (accumulate), added in
                   registers before the one store
      split-K      grid z takes a slice of K; the partial products are summed in a fixed order
                   (sum_splits), so the result does not depend on the schedule
It is built per (transpose_a, transpose_b, epilogue), so the transposes cost nothing at run time.

matmul() is the one dispatch point:
  1. the reference kernel where an operand's rows are not whole 16-byte runs (a width that is
     not a multiple of 4 floats): the fast kernel's 16-byte loads need them (and, under the
     CUDA simulator, always: it is the quicker of the two there);
  2. with transpose_b and at least TRANSPOSED_COPY_MIN_ROWS rows, b^T copied first (transpose)
     and the plain product run: the kernel that transposes both operands' slices runs ~10%
     slower, and the copy costs a pass over W against 2M flops per weight;
  3. split-K where the M x N grid alone would leave multiprocessors idle (split_count): the
     weight gradients, whose K = B*T is long and whose M x N is small.
"""
from numba import cuda, float32

import numpy as np

from .gelu import (gelu_backward, gelu_backward_numpy, gelu_derivative, gelu_forward,
                   gelu_forward_numpy, gelu_value)
from .launch import (MULTIPROCESSORS, SIMULATOR, blocks, check, check_float32, check_shape,
                     current_stream, elementwise_grid, inlined, kernel_factory,
                     launch)
from .vector import aligned16, load4, store4


# --- the NumPy twin: the definition -------------------------------------------------------

def matmul_numpy(out, a, b, bias=None, transpose_a=False, transpose_b=False, accumulate=False,
                 gelu_out=None, gelu_input=None, kernel="auto", b_transposed=None):
    _check_matmul(out, a, b, bias, transpose_a, transpose_b, gelu_out, gelu_input)
    product = (a.T if transpose_a else a) @ (b.T if transpose_b else b)
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


# --- the reference kernel ------------------------------------------------------------------

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


# --- the fast kernel -----------------------------------------------------------------------

BM, BN, BK = 128, 128, 8        # the block tile of out, and the k of a slice
THREADS_M = THREADS_N = 16      # 256 threads, each an 8 x 8 tile of out
THREADS = THREADS_M * THREADS_N
HALF = 64                       # a thread's rows (and columns): 2 runs of 4, HALF apart
A_CHUNKS = BM * BK // 4 // THREADS      # 4-float chunks of a slice of op(a) a thread loads
B_CHUNKS = BK * BN // 4 // THREADS      # (1 each)
A_STAGED, B_STAGED = 4 * A_CHUNKS, 4 * B_CHUNKS     # their floats, held in registers
A_PAD, B_PAD = BM + 4, BN + 4   # shared tiles' rows: the transposing stores free of bank
                                # conflicts, the rows still 16-byte aligned
EPILOGUES = (None, "gelu", "gelu_grad")


@kernel_factory
def matmul_kernel(transpose_a, transpose_b, epilogue=None):
    """The register-blocked kernel (see the module's doc) for one (transpose_a, transpose_b)
    and epilogue: None, "gelu" (gelu(out) also written to `hidden`, the MLP's activation) or
    "gelu_grad" (the product, plus bias, times gelu'(hidden) before it is added or stored:
    then the product of GELU's output gradient is its input's)."""
    check(epilogue in EPILOGUES, f"matmul: unknown epilogue {epilogue!r}")
    A_ALONG_K = not transpose_a     # a[M,K]: its 4-float chunks run along k
    B_ALONG_K = transpose_b         # b[N,K]: likewise
    GELU, GELU_GRAD = epilogue == "gelu", epilogue == "gelu_grad"
    # The epilogue gathers (adds the bias, gelu' and what out holds into the accumulators, four
    # rows' loads in flight at once, before the first store) everywhere but the plain input
    # gradient (NT), which runs 5-6% faster storing row by row. (A load of hidden or out
    # placed after a store to out must wait for it: the compiler cannot tell the arrays apart.)
    GATHER = GELU_GRAD or not (transpose_b and not transpose_a)
    # Registers: the plain product (NN) and the weight gradient (TN) fit unbounded and run
    # fastest so; the transposed operand's kernel (NT) and the GELU-backward epilogue run
    # faster capped at 128 registers a thread, two blocks a multiprocessor.
    blocks_per_sm = 2 if transpose_b or GELU_GRAD else 1
    bounds = {} if SIMULATOR or blocks_per_sm == 1 else dict(launch_bounds=(THREADS,
                                                                             blocks_per_sm))

    @inlined
    def read_chunk(x, rows, cols, r, c):
        # x[r, c:c+4], zeros where (r, c) is outside [:rows, :cols] (cols % 4 == 0)
        if r < rows and c < cols:
            return load4(x, (r, c))
        return float32(0.0), float32(0.0), float32(0.0), float32(0.0)

    @inlined
    def load_slice(staged, x, chunks, along_k, width, size, k_end, first, k0, tid):
        # one operand's slice into registers, `chunks` 4-float chunks a thread: op(x)[first:
        # first + width, k0:k0 + BK] (A: size M, width BM) or op(x)[k0:k0 + BK, first:first +
        # width] (B: size N, width BN)
        for r in range(chunks):
            chunk = tid + r * THREADS
            if along_k:                 # x[size, K]: a chunk is 4 consecutive k
                i, k = chunk // (BK // 4), (chunk % (BK // 4)) * 4
                x4 = read_chunk(x, size, k_end, first + i, k0 + k)
            else:                       # x[K, size]: a chunk is 4 consecutive m (or n)
                k, i = chunk // (width // 4), (chunk % (width // 4)) * 4
                x4 = read_chunk(x, k_end, size, k0 + k, first + i)
            for e in range(4):
                staged[4 * r + e] = x4[e]

    @inlined
    def park(tiles, buffer, staged, chunks, along_k, width, tid):
        # registers -> shared memory tiles[buffer, k, m]; chunks along k are transposed here
        for r in range(chunks):
            chunk = tid + r * THREADS
            if along_k:
                m, k = chunk // (BK // 4), (chunk % (BK // 4)) * 4
                for i in range(4):
                    tiles[buffer, k + i, m] = staged[4 * r + i]
            else:
                k, m = chunk // (width // 4), (chunk % (width // 4)) * 4
                store4(tiles, (buffer, k, m), staged[4 * r], staged[4 * r + 1],
                       staged[4 * r + 2], staged[4 * r + 3])

    @inlined
    def outer_product(acc, a_frag, b_frag, a_tiles, b_tiles, buffer, kk, ty, tx):
        # one step of k: acc[8,8] += op(a)[thread's rows, kk] (outer) op(b)[kk, thread's cols],
        # 4 16-byte shared loads feeding 64 multiply-adds
        for half in range(2):
            x = load4(a_tiles, (buffer, kk, half * HALF + ty * 4))
            for i in range(4):
                a_frag[half * 4 + i] = x[i]
        for half in range(2):
            y = load4(b_tiles, (buffer, kk, half * HALF + tx * 4))
            for i in range(4):
                b_frag[half * 4 + i] = y[i]
        for i in range(8):
            for j in range(8):
                acc[i, j] += a_frag[i] * b_frag[j]

    @inlined
    def slice_product(acc, a_frag, b_frag, a_tiles, b_tiles, buffer, kk, ty, tx):
        # eight steps of k, kk .. kk+7, written out: as a rolled loop, its counter and address
        # arithmetic cost 6% of the k loop's instructions, and the shared-memory addresses
        # become constant offsets
        outer_product(acc, a_frag, b_frag, a_tiles, b_tiles, buffer, kk, ty, tx)
        outer_product(acc, a_frag, b_frag, a_tiles, b_tiles, buffer, kk + 1, ty, tx)
        outer_product(acc, a_frag, b_frag, a_tiles, b_tiles, buffer, kk + 2, ty, tx)
        outer_product(acc, a_frag, b_frag, a_tiles, b_tiles, buffer, kk + 3, ty, tx)
        outer_product(acc, a_frag, b_frag, a_tiles, b_tiles, buffer, kk + 4, ty, tx)
        outer_product(acc, a_frag, b_frag, a_tiles, b_tiles, buffer, kk + 5, ty, tx)
        outer_product(acc, a_frag, b_frag, a_tiles, b_tiles, buffer, kk + 6, ty, tx)
        outer_product(acc, a_frag, b_frag, a_tiles, b_tiles, buffer, kk + 7, ty, tx)

    @inlined
    def fold_rows(acc, values, x, b_frag, i0, m0, n0, ty, tx, M, N, times_gelu_grad):
        # acc[i0 .. i0+3, :] = (acc + bias) * gelu'(x) if times_gelu_grad, else (acc + bias) + x:
        # the four rows' 16-byte loads of x all issued before any is used
        for r in range(4):
            row = m0 + (i0 // 4) * HALF + ty * 4 + r
            for run in range(2):
                col = n0 + run * HALF + tx * 4
                for e in range(4):
                    values[8 * r + 4 * run + e] = float32(0.0)
                if row < M and col < N:
                    x4 = load4(x, (row, col))
                    for e in range(4):
                        values[8 * r + 4 * run + e] = x4[e]
        for r in range(4):
            for j in range(8):
                if times_gelu_grad:
                    acc[i0 + r, j] = (acc[i0 + r, j] + b_frag[j]) * gelu_derivative(values[8 * r + j])
                else:
                    acc[i0 + r, j] = (acc[i0 + r, j] + b_frag[j]) + values[8 * r + j]

    @inlined
    def store_row(out, hidden, acc, b_frag, i, z, m0, n0, ty, tx, M, N, accumulate):
        # out[z, the thread's i-th row, its 8 columns] = acc[i, :], 16 bytes at a time, plus the
        # bias and (accumulate) what out holds when the epilogue did not gather them in; with
        # GELU, gelu of it into hidden too
        row = m0 + (i // 4) * HALF + ty * 4 + i % 4
        for run in range(2):
            col = n0 + run * HALF + tx * 4
            j = run * 4
            if row < M and col < N:
                v0, v1, v2, v3 = acc[i, j], acc[i, j + 1], acc[i, j + 2], acc[i, j + 3]
                if not GATHER:
                    v0 += b_frag[j]
                    v1 += b_frag[j + 1]
                    v2 += b_frag[j + 2]
                    v3 += b_frag[j + 3]
                    if accumulate:
                        o = load4(out, (z, row, col))
                        v0 += o[0]
                        v1 += o[1]
                        v2 += o[2]
                        v3 += o[3]
                store4(out, (z, row, col), v0, v1, v2, v3)
                if GELU:
                    store4(hidden, (row, col), gelu_value(v0), gelu_value(v1), gelu_value(v2),
                           gelu_value(v3))

    @inlined
    def epilogue_and_store(out, hidden, acc, b_frag, bias, has_bias, accumulate, z, m0, n0,
                           ty, tx, M, N):
        # the bias of this thread's columns (or zeros) into b_frag; then, in order, the bias,
        # gelu' and what out holds, into acc (GATHER), rows 0-3 and 4-7 each with their loads
        # in flight at once; then the 8 rows of out. Every row is written out (as in
        # slice_product), so that acc is indexed by constants and stays in registers
        for run in range(2):
            col = n0 + run * HALF + tx * 4
            for j in range(4):
                b_frag[run * 4 + j] = float32(0.0)
            if has_bias and col < N:
                y = load4(bias, (col,))
                for j in range(4):
                    b_frag[run * 4 + j] = y[j]
            elif has_bias:      # (past N: loads nothing. Without this branch ptxas allocates
                for j in range(4):      # the bounded kernels, NT and the GELU backward, with
                    if col + j < N:     # spills in the k loop)
                        b_frag[run * 4 + j] = bias[col + j]
        if GATHER:
            values = cuda.local.array(32, float32)
            if GELU_GRAD:
                fold_rows(acc, values, hidden, b_frag, 0, m0, n0, ty, tx, M, N, True)
                fold_rows(acc, values, hidden, b_frag, 4, m0, n0, ty, tx, M, N, True)
                for j in range(8):
                    b_frag[j] = float32(0.0)
            if accumulate:
                fold_rows(acc, values, out[z], b_frag, 0, m0, n0, ty, tx, M, N, False)
                fold_rows(acc, values, out[z], b_frag, 4, m0, n0, ty, tx, M, N, False)
            elif not GELU_GRAD:
                for i in range(8):
                    for j in range(8):
                        acc[i, j] += b_frag[j]
        store_row(out, hidden, acc, b_frag, 0, z, m0, n0, ty, tx, M, N, accumulate)
        store_row(out, hidden, acc, b_frag, 1, z, m0, n0, ty, tx, M, N, accumulate)
        store_row(out, hidden, acc, b_frag, 2, z, m0, n0, ty, tx, M, N, accumulate)
        store_row(out, hidden, acc, b_frag, 3, z, m0, n0, ty, tx, M, N, accumulate)
        store_row(out, hidden, acc, b_frag, 4, z, m0, n0, ty, tx, M, N, accumulate)
        store_row(out, hidden, acc, b_frag, 5, z, m0, n0, ty, tx, M, N, accumulate)
        store_row(out, hidden, acc, b_frag, 6, z, m0, n0, ty, tx, M, N, accumulate)
        store_row(out, hidden, acc, b_frag, 7, z, m0, n0, ty, tx, M, N, accumulate)

    @cuda.jit(**bounds)
    def matmul_kernel(out, a, b, bias, has_bias, accumulate, k_per_split, hidden):
        # out[S,M,N]: out[z] (+)= op(a)[:, Kz] . op(b)[Kz, :] (+ bias[N] if has_bias), Kz the
        # z-th slice of k_per_split rows of K (split-K; S = 1 when K is not split). hidden[M,N]
        # (S = 1): GELU's output (gelu) or its input (gelu_grad); else not read.
        # grid (N/BN, M/BM, S), block THREADS
        a_tiles = cuda.shared.array((2, BK, A_PAD), float32)   # op(a) slices, k-major
        b_tiles = cuda.shared.array((2, BK, B_PAD), float32)   # op(b) slices
        acc = cuda.local.array((8, 8), float32)
        a_frag = cuda.local.array(8, float32)
        b_frag = cuda.local.array(8, float32)
        a_next = cuda.local.array(A_STAGED, float32)
        b_next = cuda.local.array(B_STAGED, float32)
        M, N = out.shape[1], out.shape[2]
        K = a.shape[0] if transpose_a else a.shape[1]
        z = cuda.blockIdx.z
        k_start = z * k_per_split
        k_end = min(K, k_start + k_per_split)
        for i in range(8):
            for j in range(8):
                acc[i, j] = float32(0.0)
        tid = cuda.threadIdx.x
        ty, tx = tid // THREADS_N, tid % THREADS_N
        m0, n0 = cuda.blockIdx.y * BM, cuda.blockIdx.x * BN

        # the first slice goes straight to buffer 0
        load_slice(a_next, a, A_CHUNKS, A_ALONG_K, BM, M, k_end, m0, k_start, tid)
        load_slice(b_next, b, B_CHUNKS, B_ALONG_K, BN, N, k_end, n0, k_start, tid)
        park(a_tiles, 0, a_next, A_CHUNKS, A_ALONG_K, BM, tid)
        park(b_tiles, 0, b_next, B_CHUNKS, B_ALONG_K, BN, tid)
        cuda.syncthreads()
        # Unconditionally, even after the last slice (its "next" is zeros from beyond k_end,
        # parked in a buffer nobody reads again): loads guarded by `if there is a next slice`
        # were sunk by the compiler next to the stores that use them, and then nothing hid
        # their latency.
        buffer = 0
        for k0 in range(k_start, k_end, BK):
            # issue the next slice's global loads, multiply the current one meanwhile (8 steps
            # of k at a time) ...
            load_slice(a_next, a, A_CHUNKS, A_ALONG_K, BM, M, k_end, m0, k0 + BK, tid)
            load_slice(b_next, b, B_CHUNKS, B_ALONG_K, BN, N, k_end, n0, k0 + BK, tid)
            for kk in range(0, BK, 8):
                slice_product(acc, a_frag, b_frag, a_tiles, b_tiles, buffer, kk, ty, tx)
            # ... and park the next slice in the other buffer
            park(a_tiles, 1 - buffer, a_next, A_CHUNKS, A_ALONG_K, BM, tid)
            park(b_tiles, 1 - buffer, b_next, B_CHUNKS, B_ALONG_K, BN, tid)
            cuda.syncthreads()
            buffer = 1 - buffer

        epilogue_and_store(out, hidden, acc, b_frag, bias, has_bias, accumulate, z, m0, n0, ty,
                           tx, M, N)

    matmul_kernel.launch_bounds = bounds.get("launch_bounds")  # (tools/kernel_report.py)
    return matmul_kernel


# --- split-K: how many slices, and their sum ----------------------------------------------

RESIDENT_BLOCKS = 2 * MULTIPROCESSORS   # blocks of matmul_kernel the H200 runs at once
L2_BYTES = 50 * 2**20                   # the H200's L2 cache


def k_per_slice(K, splits, step=BK):
    """Rows of K in each of `splits` slices: K / splits, rounded up to whole slices of `step`
    (the kernel's k a slice)."""
    return blocks(blocks(K, splits), step) * step


def split_count(M, N, K, slots=RESIDENT_BLOCKS, l2_bytes=L2_BYTES, step=BK, value_bytes=4,
                tile=(BM, BN)):
    """How many slices of K to compute in parallel (split-K). Only when the M x N grid alone
    leaves multiprocessors idle (the weight gradients: M x N = C x C or C x 4C, K = B*T), and
    never slices thinner than 256. A grid runs in waves of `slots` blocks, so 288 blocks take
    as long as 528: the count chosen is the smallest whose last wave is at least 90% full and
    whose slice of both operands' rows, k_per_slice x (M + N) values of `value_bytes` each
    (float32 here, bf16 for the tensor-core kernels), fits in half the L2
    (else the smallest well-filled one; else the one that fills its waves best). Slices whose
    rows overflow the L2 leave it before all the blocks that read them have (docs/perf.md
    gives the measurements behind both rules). tile: a block's tile of out."""
    output_blocks = blocks(M, tile[0]) * blocks(N, tile[1])
    if output_blocks >= slots:
        return 1

    def fill(splits):                   # busy fraction of the waves the grid needs
        total = output_blocks * splits
        return total / (blocks(total, slots) * slots)

    def fits(splits):                   # the slice's rows of both operands in half the L2
        return value_bytes * k_per_slice(K, splits, step) * (M + N) <= l2_bytes // 2

    candidates = range(1, max(1, min(K // 256, 8 * slots // output_blocks)) + 1)
    good = [s for s in candidates if fill(s) >= 0.9]
    return ([s for s in good if fits(s)] or good or [max(candidates, key=fill)])[0]


@cuda.jit
def sum_splits_kernel(out, partials, bias, has_bias, accumulate, N):
    # out[M*N] (+)= sum over z of partials[z, M*N] (+ bias along each row of N), in order z =
    # 0, 1, ...; flat views, 4 consecutive elements a step (N % 4 == 0: the 4 are in one row)
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
    """out[M,N] (+)= the split-K partials [S,M,N] summed in order (+ bias)."""
    M, N = out.shape
    S = partials.shape[0]
    launch(sum_splits_kernel, *elementwise_grid(M * N // 4), out.reshape(M * N),
           partials.reshape(S, M * N), bias, has_bias, accumulate, N)


# --- the launcher ----------------------------------------------------------------------------

# dX = dY . W^T (and the tied LM head's X . wte^T) read W^T: the kernel then transposes both
# operands' slices on their way into shared memory and runs ~10% slower than the plain one.
# A transposed copy of W costs two passes over W (8 bytes a weight) against 2M flops a weight:
# below 2048 rows it would cost more than ~3% of the product (sampling reads a row at a time).
TRANSPOSED_COPY_MIN_ROWS = 2048


def copies_b_transposed(M, N, transpose_a, transpose_b):
    """Whether matmul multiplies by a transposed copy of b (choice 2 of the module's doc)."""
    return transpose_b and not transpose_a and M >= TRANSPOSED_COPY_MIN_ROWS and N % 4 == 0


def matmul(out, a, b, bias=None, transpose_a=False, transpose_b=False, accumulate=False,
           gelu_out=None, gelu_input=None, kernel="auto", b_transposed=None):
    """out[M,N] (+)= op(a) . op(b) (+ bias).
    gelu_out[M,N]: also gelu(out), the MLP's activation (the pre-activation out is kept for
    GELU's backward). gelu_input[M,N]: GELU's backward too: the product is the gradient of
    gelu(gelu_input) and out gets that of gelu_input: out (+)= gelu'(gelu_input) * (op(a) .
    op(b) + bias).
    kernel: "auto" (the module's doc says what it picks), "fast" or "reference".
    b_transposed: with transpose_b, a copy of b^T already made (kernels/transpose below; the
    captured step makes it beside the forward, nanoandrea/schedule.py): used where matmul would
    make one."""
    check_float32(out=out, a=a, b=b, bias=bias, gelu_out=gelu_out, gelu_input=gelu_input)
    M, N, K = _check_matmul(out, a, b, bias, transpose_a, transpose_b, gelu_out, gelu_input)
    check(kernel in ("auto", "fast", "reference"), f"matmul: unknown kernel {kernel!r}")
    hidden = gelu_out if gelu_out is not None else gelu_input
    rows_aligned = all(aligned16(x) for x in (out, a, b, bias, hidden) if x is not None)
    if kernel == "auto":
        kernel = "fast" if rows_aligned and not SIMULATOR else "reference"
    check(kernel == "reference" or rows_aligned,
          "matmul: the fast kernel needs rows of 4k floats, 16-byte aligned")
    if kernel == "reference":
        bias, has_bias = bias_argument(out, bias)
        if gelu_input is not None:              # the product, then GELU's backward
            product = cuda.device_array((M, N), dtype=np.float32, stream=current_stream())
            _reference(product, a, b, bias, has_bias, transpose_a, transpose_b, False)
            gelu_backward(out, product, gelu_input, accumulate)
            return
        _reference(out, a, b, bias, has_bias, transpose_a, transpose_b, accumulate)
        if gelu_out is not None:
            gelu_forward(gelu_out, out)
        return
    if copies_b_transposed(M, N, transpose_a, transpose_b):
        if b_transposed is None:
            b_transposed = cuda.device_array((K, N), dtype=np.float32, stream=current_stream())
            transpose(b_transposed, b)
        b, transpose_b = b_transposed, False
    splits = split_count(M, N, K)
    k_per_split = k_per_slice(K, splits)
    grid = (blocks(N, BN), blocks(M, BM), blocks(K, k_per_split))
    launch_product(matmul_kernel, THREADS, grid, k_per_split, out, a, b, bias, transpose_a,
                   transpose_b, accumulate, gelu_out, gelu_input)


def bias_argument(out, bias):
    """(the bias array a kernel is given, has_bias): kernels take arrays, not None, so
    without a bias a placeholder that is never read."""
    if bias is None:            # (out's first float; of a Bf16Matrix's words, their bits)
        first = out.reshape(out.size)[:1]
        return (first if first.dtype == np.float32 else first.view(np.float32)), False
    return bias, True


def launch_product(make_kernel, threads, grid, k_per_split, out, a, b, bias, transpose_a,
                   transpose_b, accumulate, gelu_out, gelu_input, blocks_at_once=None,
                   shared_bytes=0, words=False, more_arguments=None):
    """The product on `grid` (N tiles, M tiles, slices of K) by the kernel
    make_kernel(transpose_a, transpose_b, epilogue) makes (this module's, matmul_bf16's or
    matmul_wgmma's: the same arguments): one pass whose epilogue does the rest, or, split-K
    (grid z > 1), the partial products of each slice of K, their sum in a fixed order (+ bias),
    then GELU. blocks_at_once: a persistent kernel's, whose blocks each take several tiles:
    launched on that many blocks, or on one a tile where there are fewer. bias: None, or
    the bias [N]. words: out and GELU's array are Bf16Matrix words [M, N/2], which
    matmul_wgmma's bf16 epilogue writes and reads (make_kernel(..., words=True); K unsplit).
    more_arguments(out, hidden): what the kernel takes after those of matmul_kernel, for the
    out [S, M, N] it writes and its GELU array (None if it has none): matmul_wgmma's tensor
    maps. shared_bytes: the kernel's dynamic shared memory, or a function of its epilogue that
    says it."""
    bytes_for = shared_bytes if callable(shared_bytes) else (lambda epilogue: shared_bytes)
    M, N = out.shape
    bias, has_bias = bias_argument(out, bias)
    hidden = gelu_out if gelu_out is not None else gelu_input
    launch_grid = grid if blocks_at_once is None else min(grid[0] * grid[1] * grid[2],
                                                          blocks_at_once)
    if grid[2] == 1:
        epilogue = "gelu" if gelu_out is not None else (
            "gelu_grad" if gelu_input is not None else None)
        kernel = (make_kernel(bool(transpose_a), bool(transpose_b), epilogue, True) if words
                  else make_kernel(bool(transpose_a), bool(transpose_b), epilogue))
        out = out.reshape(1, M, N)
        more = () if more_arguments is None else more_arguments(out, hidden)
        launch(kernel, launch_grid, threads, out, a, b, bias, has_bias, accumulate, k_per_split,
               a if hidden is None else hidden, *more, shared_bytes=bytes_for(epilogue))
        return
    check(not words, "launch_product: a product in bf16 is the epilogue's: K unsplit")
    partials = cuda.device_array((grid[2], M, N), dtype=np.float32, stream=current_stream())
    more = () if more_arguments is None else more_arguments(partials, None)
    launch(make_kernel(bool(transpose_a), bool(transpose_b)), launch_grid, threads, partials, a,
           b, bias, False, False, k_per_split, a, *more, shared_bytes=bytes_for(None))
    if gelu_input is None:
        sum_splits(out, partials, bias, has_bias, accumulate)
    else:
        product = cuda.device_array((M, N), dtype=np.float32, stream=current_stream())
        sum_splits(product, partials, bias, has_bias, False)
        gelu_backward(out, product, gelu_input, accumulate)
    if gelu_out is not None:
        gelu_forward(gelu_out, out)


def products_in_turn(matmul, out, pairs, transpose_b=False, accumulate=False,
                     b_transposed=None):
    """out (+)= op(a_0) . op(b_0) + op(a_1) . op(b_1) + ... for pairs [(a_j, b_j)], by
    `matmul` (any backend's) once a pair, each after the first added to out: the gradient of
    an input that several products read (attention's q, k and v of one x). b_transposed: each
    pair's copy of b^T, or None. (matmul_bf16's matmul_sum_bf16 sums them in one pass.)"""
    for j, (a, b) in enumerate(pairs):
        matmul(out, a, b, transpose_b=transpose_b, accumulate=accumulate or j > 0,
               b_transposed=None if b_transposed is None else b_transposed[j])


def _reference(out, a, b, bias, has_bias, transpose_a, transpose_b, accumulate):
    M, N = out.shape
    launch(matmul_tiled_kernel, (blocks(N, TILE), blocks(M, TILE)), (TILE, TILE),
           out, a, b, bias, has_bias, transpose_a, transpose_b, accumulate)


def _check_matmul(out, a, b, bias, transpose_a, transpose_b, gelu_out, gelu_input):
    check(len(out.shape) == 2 and len(a.shape) == 2 and len(b.shape) == 2,
          f"matmul: out, a, b must be 2-D, got {out.shape}, {a.shape}, {b.shape}")
    M, N = out.shape
    K = a.shape[0] if transpose_a else a.shape[1]
    check_shape("matmul a", a, (K, M) if transpose_a else (M, K))
    check_shape("matmul b", b, (N, K) if transpose_b else (K, N))
    if bias is not None:
        check_shape("matmul bias", bias, (N,))
    check(gelu_out is None or gelu_input is None, "matmul: gelu_out or gelu_input, not both")
    for name, hidden in (("gelu_out", gelu_out), ("gelu_input", gelu_input)):
        if hidden is not None:
            check_shape(f"matmul {name}", hidden, (M, N))
    return M, N, K


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
