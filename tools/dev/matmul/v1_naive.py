"""Naive: a thread per element of out, read from global memory.
H100 2026-12-07: 0.03x cuBLAS float32 at 16384x3072x768

    out[M,N] = a[M,K] @ b[K,N]          float32, row-major; any M, N, K

Thread (row, col) walks k along a row of a and a column of b. The consecutive threads of a
warp take consecutive columns, so its loads of b[k, col] and its stores of out[row, col] are
coalesced (one 64-byte run for each half-warp of 16 columns), and a[row, k] is one address for
those 16 threads (a broadcast). Still, every multiply-add costs two loads: the kernel asks the
caches for 8 bytes per 2 flops, reading all of a once for each column of out and all of b once
for each row. It is bound by that traffic, not by arithmetic; every later version is about
using a value many times once it has been loaded.
"""
from numba import cuda, float32

from nanoandrea.kernels.runtime.launch import blocks, launch

MULTIPLE_OF = (1, 1, 1)     # M, N, K: any shape
THREADS = 16                # a block of 16 x 16 threads computes a 16 x 16 tile of out


@cuda.jit
def naive_kernel(out, a, b):
    # out[M,N] = a[M,K] @ b[K,N]; grid (N/16, M/16), block (16, 16): a thread per out[row, col]
    M, N = out.shape
    K = a.shape[1]
    row = cuda.blockIdx.y * THREADS + cuda.threadIdx.y
    col = cuda.blockIdx.x * THREADS + cuda.threadIdx.x
    if row < M and col < N:
        total = float32(0.0)
        for k in range(K):
            total += a[row, k] * b[k, col]
        out[row, col] = total


def matmul(out, a, b):
    M, N = out.shape
    launch(naive_kernel, (blocks(N, THREADS), blocks(M, THREADS)), (THREADS, THREADS), out, a, b)
