"""The float32 product on the CUDA cores: the register-blocked SGEMM of the optimisation ladder.

The family's function (matmul/reference.py's doc: shapes, math, epilogues), with every operand
and sum float32. tools/dev/matmul/ v1-v10 walk here one idea at a time; this kernel is v6:
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
                 times gelu'(gelu_array)) and what out already holds (accumulate), added in
                 registers before the one store
    split-K      grid z takes a slice of K (split_k.py), where the M x N grid alone would
                 leave multiprocessors idle: the weight gradients
It is built per (transpose_a, transpose_b, epilogue), so the transposes cost nothing at run
time. Its 16-byte loads need every row a whole number of 16-byte runs (the family's dispatch
sends other widths to the reference kernel).

With transpose_b and at least TRANSPOSED_COPY_MIN_ROWS rows, b^T is copied first (transpose,
below) and the plain product runs: the kernel that transposes both operands' slices runs ~10%
slower, and the copy costs a pass over W against 2M flops per weight. The training step makes
that copy beside the forward (nanoandrea/schedule.py) and hands it in as b_transposed.
"""
import numpy as np
from numba import cuda, float32

from ..gelu import gelu_derivative, gelu_value
from ..ptx.vector import aligned16, load4, store4
from ..runtime import device
from ..runtime.device import SIMULATOR
from ..runtime.launch import (blocks, check, check_float32, check_shape, current_stream,
                              inlined, kernel_factory, launch)
from . import split_k
from .reference import EPILOGUES, bias_argument, check_matmul, epilogue_of


BM, BN, BK = 128, 128, 8        # the block tile of out, and the k of a slice
THREADS_M = THREADS_N = 16      # 256 threads, each an 8 x 8 tile of out
THREADS = THREADS_M * THREADS_N
HALF = 64                       # a thread's rows (and columns): 2 runs of 4, HALF apart
A_CHUNKS = BM * BK // 4 // THREADS      # 4-float chunks of a slice of op(a) a thread loads
B_CHUNKS = BK * BN // 4 // THREADS      # (1 each)
A_STAGED, B_STAGED = 4 * A_CHUNKS, 4 * B_CHUNKS     # their floats, held in registers
A_PAD, B_PAD = BM + 4, BN + 4   # shared tiles' rows: the transposing stores free of bank
                                # conflicts, the rows still 16-byte aligned


@kernel_factory
def matmul_kernel(transpose_a, transpose_b, epilogue=None):
    """The register-blocked kernel (see the module's doc) for one (transpose_a, transpose_b)
    and epilogue: None, "gelu" (gelu(out) also written to `gelu_array`, the MLP's activation) or
    "gelu_grad" (the product, plus bias, times gelu'(gelu_array) before it is added or stored:
    then the product of GELU's output gradient is its input's)."""
    check(epilogue in EPILOGUES, f"matmul: unknown epilogue {epilogue!r}")
    A_ALONG_K = not transpose_a     # a[M,K]: its 4-float chunks run along k
    B_ALONG_K = transpose_b         # b[N,K]: likewise
    GELU, GELU_GRAD = epilogue == "gelu", epilogue == "gelu_grad"
    # The epilogue gathers (adds the bias, gelu' and what out holds into the accumulators, four
    # rows' loads in flight at once, before the first store) everywhere but the plain input
    # gradient (NT), which runs 5-6% faster storing row by row. (A load of gelu_array or out
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
    def store_row(out, gelu_array, acc, b_frag, i, z, m0, n0, ty, tx, M, N, accumulate):
        # out[z, the thread's i-th row, its 8 columns] = acc[i, :], 16 bytes at a time, plus the
        # bias and (accumulate) what out holds when the epilogue did not gather them in; with
        # GELU, gelu of it into gelu_array too
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
                    store4(gelu_array, (row, col), gelu_value(v0), gelu_value(v1), gelu_value(v2),
                           gelu_value(v3))

    @inlined
    def epilogue_and_store(out, gelu_array, acc, b_frag, bias, has_bias, accumulate, z, m0, n0,
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
                fold_rows(acc, values, gelu_array, b_frag, 0, m0, n0, ty, tx, M, N, True)
                fold_rows(acc, values, gelu_array, b_frag, 4, m0, n0, ty, tx, M, N, True)
                for j in range(8):
                    b_frag[j] = float32(0.0)
            if accumulate:
                fold_rows(acc, values, out[z], b_frag, 0, m0, n0, ty, tx, M, N, False)
                fold_rows(acc, values, out[z], b_frag, 4, m0, n0, ty, tx, M, N, False)
            elif not GELU_GRAD:
                for i in range(8):
                    for j in range(8):
                        acc[i, j] += b_frag[j]
        store_row(out, gelu_array, acc, b_frag, 0, z, m0, n0, ty, tx, M, N, accumulate)
        store_row(out, gelu_array, acc, b_frag, 1, z, m0, n0, ty, tx, M, N, accumulate)
        store_row(out, gelu_array, acc, b_frag, 2, z, m0, n0, ty, tx, M, N, accumulate)
        store_row(out, gelu_array, acc, b_frag, 3, z, m0, n0, ty, tx, M, N, accumulate)
        store_row(out, gelu_array, acc, b_frag, 4, z, m0, n0, ty, tx, M, N, accumulate)
        store_row(out, gelu_array, acc, b_frag, 5, z, m0, n0, ty, tx, M, N, accumulate)
        store_row(out, gelu_array, acc, b_frag, 6, z, m0, n0, ty, tx, M, N, accumulate)
        store_row(out, gelu_array, acc, b_frag, 7, z, m0, n0, ty, tx, M, N, accumulate)

    @cuda.jit(**bounds)
    def matmul_kernel(out, a, b, bias, has_bias, accumulate, k_per_split, gelu_array):
        # out[S,M,N]: out[z] (+)= op(a)[:, Kz] . op(b)[Kz, :] (+ bias[N] if has_bias), Kz the
        # z-th slice of k_per_split rows of K (split-K; S = 1 when K is not split). gelu_array[M,N]
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

        epilogue_and_store(out, gelu_array, acc, b_frag, bias, has_bias, accumulate, z, m0, n0, ty,
                           tx, M, N)

    matmul_kernel.launch_bounds = bounds.get("launch_bounds")  # (tools/kernel_report.py)
    return matmul_kernel


# --- split-K: how many slices, and their sum ----------------------------------------------


BLOCKS_PER_SM = 2           # matmul_kernel's resident blocks a multiprocessor (128 registers)


def resident_blocks():
    """Blocks of matmul_kernel this device runs at once: a wave of the grid."""
    return BLOCKS_PER_SM * device.current().multiprocessors


TRANSPOSED_COPY_MIN_ROWS = 2048


def copies_b_transposed(M, N, transpose_a, transpose_b):
    """Whether matmul multiplies by a transposed copy of b (choice 2 of the module's doc)."""
    return transpose_b and not transpose_a and M >= TRANSPOSED_COPY_MIN_ROWS and N % 4 == 0



def matmul_float32(out, a, b, bias=None, transpose_a=False, transpose_b=False,
                   accumulate=False, gelu_out=None, gelu_input=None, b_transposed=None):
    """out[M,N] (+)= op(a) . op(b) (+ bias) by the register-blocked kernel; GELU's epilogues.
    Every row a whole number of 16-byte runs, 16-byte aligned. b_transposed: with transpose_b,
    a copy of b^T already made (used where this launcher would make one)."""
    check_float32(out=out, a=a, b=b, bias=bias, gelu_out=gelu_out, gelu_input=gelu_input)
    M, N, K = check_matmul(out, a, b, bias, transpose_a, transpose_b, gelu_out, gelu_input)
    check(all(aligned16(x) for x in (out, a, b, bias, gelu_out, gelu_input) if x is not None),
          "matmul: the float32 kernel needs rows of 4k floats, 16-byte aligned")
    if copies_b_transposed(M, N, transpose_a, transpose_b):
        if b_transposed is None:
            b_transposed = cuda.device_array((K, N), dtype=np.float32, stream=current_stream())
            transpose(b_transposed, b)
        b, transpose_b = b_transposed, False
    splits = split_k.split_count(M, N, K, resident_blocks(), BK, 4, (BM, BN))
    k_per_split = split_k.k_per_slice(K, splits, BK)
    grid = (blocks(N, BN), blocks(M, BM), blocks(K, k_per_split))
    bias, has_bias = bias_argument(out, bias)
    gelu_array = gelu_out if gelu_out is not None else gelu_input
    if grid[2] == 1:                    # one pass: the epilogue does the rest
        kernel = matmul_kernel(bool(transpose_a), bool(transpose_b),
                               epilogue_of(gelu_out, gelu_input))
        launch(kernel, grid, THREADS, out.reshape(1, M, N), a, b, bias, has_bias, accumulate,
               k_per_split, a if gelu_array is None else gelu_array)
        return
    partials = split_k.partials(grid[2], M, N)
    launch(matmul_kernel(bool(transpose_a), bool(transpose_b)), grid, THREADS, partials, a, b,
           bias, False, False, k_per_split, a)
    split_k.finish(out, partials, bias, has_bias, accumulate, gelu_out, gelu_input)


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
