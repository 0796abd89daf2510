"""16-byte loads and stores, k-major tiles, padded transposed a.
H100 2026-12-07: 0.69x cuBLAS float32 at 16384x3072x768

    out[M,N] = a[M,K] @ b[K,N]          float32, row-major; M, N multiples of 128, K of 16

v3 spent 16 shared-memory loads on every 64 multiply-adds. Here a thread's 8 rows are two runs
of 4, rows ty*4 + {0..3} and 64 + ty*4 + {0..3}, and its 8 columns likewise, and both slices
sit k-major in shared memory (a_tile[k, m], b_tile[k, n]): a step of k reads each run of 4 with
one 16-byte load (load4, ld.shared.v4.f32), 4 loads for 64 FMAs. The runs are also what the
banks want: the 16 threads of a half-warp read 16 consecutive runs of b_tile (256 bytes, two
passes of the 32 banks) and two of a_tile, where v3's reads 8 floats apart collided.
Global memory is read and out written 16 bytes at a time too: a's slice is 256 runs of 4
consecutive k (one a thread), b's 256 runs of 4 consecutive n.
a is stored with k contiguous, so its runs are transposed on their way into a_tile: four 4-byte
stores, down a column. Rows of 128 floats would put the two runs of a warp that share a row
of a on the same banks; rows padded to 132 floats (16-byte aligned still) shift each row of
a_tile by 4 banks, and the warp's 32 stores land on 32 different banks.
Fewer, wider loads also need fewer registers for their addresses: about 100 a thread against
v3's 170 (ptxas), so two blocks (16 warps) share a multiprocessor.
"""
from numba import cuda, float32

from nanoandrea.kernels.runtime.launch import launch
from nanoandrea.kernels.ptx.vector import load4, store4

MULTIPLE_OF = (128, 128, 16)    # M, N, K (no edge checks)
BM, BN, BK = 128, 128, 8        # block tile, K slice
THREADS_N = 16                  # 16 x 16 threads, each 8 x 8 of out
THREADS = 256
HALF = 64                       # a thread's rows: two runs of 4, HALF apart (its columns too)
A_PAD = BM + 4                  # a_tile's padded rows


@cuda.jit
def vector_loads_kernel(out, a, b):
    # out[M,N] = a[M,K] @ b[K,N]; grid (N/128, M/128), block 256: thread (ty, tx) computes rows
    # m0 + {0, 64} + ty*4 + {0..3} and columns n0 + {0, 64} + tx*4 + {0..3} of out
    a_tile = cuda.shared.array((BK, A_PAD), float32)    # a_tile[k, i] = a[m0 + i, k0 + k]
    b_tile = cuda.shared.array((BK, BN), float32)       # b_tile[k, j] = b[k0 + k, n0 + j]
    acc = cuda.local.array((8, 8), float32)
    a_frag = cuda.local.array(8, float32)
    b_frag = cuda.local.array(8, float32)
    K = a.shape[1]
    tid = cuda.threadIdx.x
    ty, tx = tid // THREADS_N, tid % THREADS_N
    m0, n0 = cuda.blockIdx.y * BM, cuda.blockIdx.x * BN
    a_row, a_k = tid // 2, (tid % 2) * 4        # this thread's run of a's slice: 4 k of a row
    b_k, b_col = tid // 32, (tid % 32) * 4      # ... and of b's: 4 n of a row
    for i in range(8):
        for j in range(8):
            acc[i, j] = float32(0.0)
    for k0 in range(0, K, BK):
        x = load4(a, (m0 + a_row, k0 + a_k))
        for e in range(4):                      # transposed: a_tile[a_k + e, a_row]
            a_tile[a_k + e, a_row] = x[e]
        y = load4(b, (k0 + b_k, n0 + b_col))
        store4(b_tile, (b_k, b_col), y[0], y[1], y[2], y[3])
        cuda.syncthreads()
        for kk in range(BK):
            for half in range(2):
                x = load4(a_tile, (kk, half * HALF + ty * 4))
                y = load4(b_tile, (kk, half * HALF + tx * 4))
                for e in range(4):
                    a_frag[half * 4 + e] = x[e]
                    b_frag[half * 4 + e] = y[e]
            for i in range(8):
                for j in range(8):
                    acc[i, j] += a_frag[i] * b_frag[j]
        cuda.syncthreads()
    for i in range(8):
        row = m0 + (i // 4) * HALF + ty * 4 + i % 4
        for half in range(2):
            j = half * 4
            store4(out, (row, n0 + half * HALF + tx * 4),
                   acc[i, j], acc[i, j + 1], acc[i, j + 2], acc[i, j + 3])


def matmul(out, a, b):
    M, N = out.shape
    launch(vector_loads_kernel, (N // BN, M // BM), THREADS, out, a, b)
