"""Register blocking: 128x128 a block, 8x8 a thread, in registers.
H100 2026-12-07: 0.30x cuBLAS float32 at 16384x3072x768

    out[M,N] = a[M,K] @ b[K,N]          float32, row-major; M, N multiples of 128, K of 16

A block of 256 threads computes a 128 x 128 tile of out (BM x BN); K advances in slices of
BK = 8. Each slice of a (128 x 8) and of b (8 x 128) is copied into shared memory, four floats
a thread, 4 bytes at a time; then each step of k a thread reads 8 values of a's column
(its fragment: the rows of its tile) and 8 of b's row (its columns) into registers and does
their outer product: 64 multiply-adds into its 8 x 8 accumulators for 16 shared-memory
loads, where v2 did one multiply-add per two. A value loaded from global memory now serves
128 multiply-adds (the tile's width), and one loaded from shared memory 8.

What it still costs: 16 scalar shared loads per 64 FMAs, some of them bank conflicts (the 16
threads of a half-warp read b_tile 8 floats apart: 4 of them land on each bank they use);
4-byte global loads; about 170 registers a thread (ptxas), so that one block of 8 warps fills
a multiprocessor; and the block waits at a barrier twice a slice, with nothing to do while
the next slice arrives from global memory.
"""
from numba import cuda, float32

from nanoandrea.kernels.runtime.launch import launch

MULTIPLE_OF = (128, 128, 16)    # M, N, K (no edge checks)
BM, BN, BK = 128, 128, 8        # block tile, K slice
TM = TN = 8                     # a thread's tile of out
THREADS_N = BN // TN            # 16 x 16 threads
THREADS = (BM // TM) * THREADS_N
A_LOADS = BM * BK // THREADS    # floats of a slice each thread copies (4)
B_LOADS = BK * BN // THREADS    # (4)


@cuda.jit
def register_blocked_kernel(out, a, b):
    # out[M,N] = a[M,K] @ b[K,N]; grid (N/128, M/128), block 256: thread (ty, tx) computes
    # out[m0 + ty*8 : +8, n0 + tx*8 : +8]
    a_tile = cuda.shared.array((BM, BK), float32)   # a_tile[i, k] = a[m0 + i, k0 + k]
    b_tile = cuda.shared.array((BK, BN), float32)   # b_tile[k, j] = b[k0 + k, n0 + j]
    acc = cuda.local.array((TM, TN), float32)       # (registers: every index is a constant
    a_frag = cuda.local.array(TM, float32)          # once the loops are unrolled)
    b_frag = cuda.local.array(TN, float32)
    K = a.shape[1]
    tid = cuda.threadIdx.x
    ty, tx = tid // THREADS_N, tid % THREADS_N
    m0, n0 = cuda.blockIdx.y * BM, cuda.blockIdx.x * BN
    for i in range(TM):
        for j in range(TN):
            acc[i, j] = float32(0.0)
    for k0 in range(0, K, BK):
        # copy the slices: consecutive threads take consecutive floats (coalesced)
        for r in range(A_LOADS):
            e = tid + r * THREADS
            a_tile[e // BK, e % BK] = a[m0 + e // BK, k0 + e % BK]
        for r in range(B_LOADS):
            e = tid + r * THREADS
            b_tile[e // BN, e % BN] = b[k0 + e // BN, n0 + e % BN]
        cuda.syncthreads()
        for kk in range(BK):
            for i in range(TM):
                a_frag[i] = a_tile[ty * TM + i, kk]
            for j in range(TN):
                b_frag[j] = b_tile[kk, tx * TN + j]
            for i in range(TM):
                for j in range(TN):
                    acc[i, j] += a_frag[i] * b_frag[j]
        cuda.syncthreads()                  # before the next slice overwrites the tiles
    for i in range(TM):
        for j in range(TN):
            out[m0 + ty * TM + i, n0 + tx * TN + j] = acc[i, j]


def matmul(out, a, b):
    M, N = out.shape
    launch(register_blocked_kernel, (N // BN, M // BM), THREADS, out, a, b)
