"""Matrix multiply and its backward products.

    out[M,N]  (+)=  op(a)[M,K] . op(b)[K,N]  (+ bias[N])      op(x) = x or x^T

Every linear layer of the model is one call (activations [B,T,C] are viewed as [B*T, C] rows):
    forward      Y[M,N]  = X[M,K] . W[K,N] + b          (W stored [in, out], as GPT-2 does)
    backward     dX[M,K] = dY[M,N] . W^T                transpose_b=True
                 dW[K,N] += X^T . dY                    transpose_a=True, accumulate=True
                 db[N]   += sum of dY's rows            sum_rows
    LM head      logits[M,V] = X[M,C] . wte[V,C]^T      transpose_b=True (tied to the embedding)

`accumulate` says whether out is overwritten (=) or added to (+=): gradients of parameters
accumulate into the flat gradient buffer, and a tensor used twice sums its two gradients.

Two kernels compute the same function:
  matmul_tiled_kernel     the readable reference: one thread per output element,
                          16x16 tiles of both operands staged through shared memory.
  blocked matmul kernels  the fast path: a 128x128 block tile, each of 256 threads keeps an
                          8x8 tile of the output in registers; shared memory is double-buffered
                          (the next K-slice is loaded from global memory while the current one
                          is multiplied). Built per (transpose_a, transpose_b) by
                          make_blocked_matmul_kernel, so the transposes cost nothing at run time.
Both are correct for any M, N, K (edges are zero-filled), and both pass the same tests.
"""
from numba import cuda, float32

import numpy as np

from .launch import (SIMULATOR, blocks, check, check_float32, check_shape, current_stream,
                     elementwise_grid, launch)
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


def make_blocked_matmul_kernel(transpose_a, transpose_b, BM=128, BN=128, BK=8, TM=8, TN=8,
                               blocks_per_sm=1):
    """The register-blocked kernel for one (transpose_a, transpose_b) and one tile shape.

    blocks_per_sm > 1 asks the compiler (launch bounds) to fit that many blocks on a
    multiprocessor, which caps the registers per thread.

    Block tile BM x BN of the output, BM/TM x BN/TN threads, each owning TM x TN outputs at rows
    ty + i*(BM/TM) and columns tx + j*(BN/TN) (strided, so a warp reads consecutive shared-memory
    words and writes consecutive output columns). K advances in slices of BK.
    """
    THREADS_M = BM // TM
    THREADS_N = BN // TN
    THREADS = THREADS_M * THREADS_N
    A_PER_THREAD = BM * BK // THREADS       # elements of each A slice one thread loads
    B_PER_THREAD = BK * BN // THREADS
    A_PAD = BM + 4                          # padded rows: the transposing stores avoid bank conflicts
    B_PAD = BN + 4

    @cuda.jit(device=True, inline="always")
    def a_slot(e):
        # where element e (of BM*BK) of an op(a) slice sits: (k, m). Consecutive threads take
        # consecutive addresses of a in global memory, whichever way a is stored.
        if transpose_a:                     # a is [K, M]
            return e // BM, e % BM
        return e % BK, e // BK              # a is [M, K]

    @cuda.jit(device=True, inline="always")
    def b_slot(e):
        # where element e (of BK*BN) of an op(b) slice sits: (k, n)
        if transpose_b:                     # b is [N, K]
            return e % BK, e // BK
        return e // BN, e % BN              # b is [K, N]

    @cuda.jit(device=True, inline="always")
    def read_a(a, M, K, m, k):
        # op(a)[m, k], zero outside the matrix
        if m < M and k < K:
            return a[k, m] if transpose_a else a[m, k]
        return float32(0.0)

    @cuda.jit(device=True, inline="always")
    def read_b(b, N, K, k, n):
        # op(b)[k, n], zero outside the matrix
        if k < K and n < N:
            return b[n, k] if transpose_b else b[k, n]
        return float32(0.0)

    bounds = dict(launch_bounds=(THREADS, blocks_per_sm)) if blocks_per_sm > 1 else {}

    @cuda.jit(**bounds)
    def blocked_matmul_kernel(out, a, b, bias, has_bias, accumulate, k_per_split):
        # out[S,M,N]: out[z] (+)= op(a)[:, Kz] . op(b)[Kz, :] (+ bias[N] if has_bias), where Kz is
        # the z-th slice of k_per_split columns of K (split-K; S = 1 when K is not split).
        # grid (N/BN, M/BM, S), block THREADS
        a_tiles = cuda.shared.array((2, BK, A_PAD), float32)   # two buffers of op(a) slices, k-major
        b_tiles = cuda.shared.array((2, BK, B_PAD), float32)
        acc = cuda.local.array((TM, TN), float32)
        a_frag = cuda.local.array(TM, float32)
        b_frag = cuda.local.array(TN, float32)
        a_next = cuda.local.array(A_PER_THREAD, float32)
        b_next = cuda.local.array(B_PER_THREAD, float32)
        M, N = out.shape[1], out.shape[2]
        K = a.shape[0] if transpose_a else a.shape[1]
        z = cuda.blockIdx.z
        k_start = z * k_per_split
        k_end = min(K, k_start + k_per_split)
        tid = cuda.threadIdx.x
        ty = tid // THREADS_N
        tx = tid % THREADS_N
        m0 = cuda.blockIdx.y * BM
        n0 = cuda.blockIdx.x * BN
        for i in range(TM):
            for j in range(TN):
                acc[i, j] = float32(0.0)

        # the first K-slice goes straight to buffer 0
        for r in range(A_PER_THREAD):
            k, m = a_slot(tid + r * THREADS)
            a_tiles[0, k, m] = read_a(a, M, k_end, m0 + m, k_start + k)
        for r in range(B_PER_THREAD):
            k, n = b_slot(tid + r * THREADS)
            b_tiles[0, k, n] = read_b(b, N, k_end, k_start + k, n0 + n)
        cuda.syncthreads()

        buffer = 0
        for k0 in range(k_start, k_end, BK):
            more = k0 + BK < k_end
            if more:                        # issue the next slice's global loads now ...
                for r in range(A_PER_THREAD):
                    k, m = a_slot(tid + r * THREADS)
                    a_next[r] = read_a(a, M, k_end, m0 + m, k0 + BK + k)
                for r in range(B_PER_THREAD):
                    k, n = b_slot(tid + r * THREADS)
                    b_next[r] = read_b(b, N, k_end, k0 + BK + k, n0 + n)
            for kk in range(BK):            # ... and multiply the current one meanwhile
                for i in range(TM):
                    a_frag[i] = a_tiles[buffer, kk, ty + i * THREADS_M]
                for j in range(TN):
                    b_frag[j] = b_tiles[buffer, kk, tx + j * THREADS_N]
                for i in range(TM):
                    for j in range(TN):
                        acc[i, j] += a_frag[i] * b_frag[j]
            if more:                        # park the next slice in the other buffer
                for r in range(A_PER_THREAD):
                    k, m = a_slot(tid + r * THREADS)
                    a_tiles[1 - buffer, k, m] = a_next[r]
                for r in range(B_PER_THREAD):
                    k, n = b_slot(tid + r * THREADS)
                    b_tiles[1 - buffer, k, n] = b_next[r]
            cuda.syncthreads()
            buffer = 1 - buffer

        for j in range(TN):                 # the bias of this thread's columns, or zeros
            col = n0 + tx + j * THREADS_N
            b_frag[j] = bias[col] if has_bias and col < N else float32(0.0)
        for i in range(TM):
            row = m0 + ty + i * THREADS_M
            for j in range(TN):
                col = n0 + tx + j * THREADS_N
                if row < M and col < N:
                    value = acc[i, j] + b_frag[j]
                    if accumulate:
                        value += out[z, row, col]
                    out[z, row, col] = value

    blocked_matmul_kernel.threads = THREADS
    blocked_matmul_kernel.tile = (BM, BN, BK)
    return blocked_matmul_kernel


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


def split_count(M, N, K, tile, target_blocks=2 * 132):
    """How many slices of K to compute in parallel: only when the M x N grid alone leaves the
    GPU's 132 multiprocessors idle (the weight gradients: M x N = C x C, K = B*T), and never
    slices thinner than 256."""
    BM, BN, BK = tile
    output_blocks = blocks(M, BM) * blocks(N, BN)
    if output_blocks >= target_blocks:
        return 1
    return max(1, min(blocks(target_blocks, output_blocks), K // 256))


_blocked_kernels = {}


def _blocked_kernel(transpose_a, transpose_b, tiles=None):
    """The blocked kernel for these transposes and tile parameters (make_blocked_matmul_kernel's
    keyword arguments; None = the defaults)."""
    key = (transpose_a, transpose_b, tuple(sorted((tiles or {}).items())))
    if key not in _blocked_kernels:
        _blocked_kernels[key] = make_blocked_matmul_kernel(transpose_a, transpose_b, **(tiles or {}))
    return _blocked_kernels[key]


def _check_matmul(out, a, b, bias, transpose_a, transpose_b):
    check(len(out.shape) == 2 and len(a.shape) == 2 and len(b.shape) == 2,
          f"matmul: out, a, b must be 2-D, got {out.shape}, {a.shape}, {b.shape}")
    M, N = out.shape
    K = a.shape[0] if transpose_a else a.shape[1]
    check_shape("matmul a", a, (K, M) if transpose_a else (M, K))
    check_shape("matmul b", b, (N, K) if transpose_b else (K, N))
    if bias is not None:
        check_shape("matmul bias", bias, (N,))
    return M, N, K


def matmul(out, a, b, bias=None, transpose_a=False, transpose_b=False, accumulate=False,
           kernel="auto", k_splits=None, tiles=None):
    """out[M,N] (+)= op(a) . op(b) (+ bias). kernel: "auto", "blocked" or "tiled" (the reference).

    Blocked kernel only: k_splits, slices of K computed in parallel (None: split_count chooses);
    tiles, a dict of make_blocked_matmul_kernel's tile parameters (None: the defaults)."""
    check_float32(out=out, a=a, b=b, bias=bias)
    M, N, K = _check_matmul(out, a, b, bias, transpose_a, transpose_b)
    if kernel == "auto":
        kernel = "tiled" if SIMULATOR else "blocked"
    has_bias = bias is not None
    if not has_bias:            # kernels take arrays, not None: a placeholder the kernel never reads
        bias = out.reshape(out.size)[:1]
    if kernel == "tiled":
        launch(matmul_tiled_kernel, (blocks(N, TILE), blocks(M, TILE)), (TILE, TILE),
               out, a, b, bias, has_bias, transpose_a, transpose_b, accumulate)
    elif kernel == "blocked":
        fast = _blocked_kernel(bool(transpose_a), bool(transpose_b), tiles)
        BM, BN, BK = fast.tile
        splits = k_splits or split_count(M, N, K, fast.tile)
        k_per_split = blocks(blocks(K, splits), BK) * BK
        splits = blocks(K, k_per_split)
        grid = (blocks(N, BN), blocks(M, BM), splits)
        if splits == 1:
            launch(fast, grid, fast.threads, out.reshape(1, M, N), a, b, bias, has_bias,
                   accumulate, k_per_split)
        else:                   # partial products per K slice, then their sum in a fixed order
            partials = cuda.device_array((splits, M, N), dtype=np.float32, stream=current_stream())
            launch(fast, grid, fast.threads, partials, a, b, bias, False, False, k_per_split)
            launch(sum_splits_kernel, *elementwise_grid(M * N), out, partials, bias, has_bias,
                   accumulate)
    else:
        raise ValueError(f"matmul: unknown kernel {kernel!r}")


def matmul_numpy(out, a, b, bias=None, transpose_a=False, transpose_b=False, accumulate=False,
                 kernel="auto", k_splits=None, tiles=None):
    _check_matmul(out, a, b, bias, transpose_a, transpose_b)
    product = (a.T if transpose_a else a) @ (b.T if transpose_b else b)
    if bias is not None:
        product += bias
    if accumulate:
        out += product
    else:
        out[...] = product


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
