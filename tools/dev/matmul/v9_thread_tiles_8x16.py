"""Not kept: 8x16 a thread, 128x256 a block (CUTLASS's SIMT tile).
H100 2026-12-07: 0.76x cuBLAS float32 at 16384x3072x768

    out[M,N] = a[M,K] @ b[K,N]          float32, row-major; M a multiple of 128, N of 256, K of 16

Tried after v5 and NOT faster: 0.80x cuBLAS in the run above, where the product's 8 x 8 tiles
(v6) run 0.97x. The idea: a bigger thread tile reuses each fragment more. A thread owns 8 rows
(two runs of 4, 64 apart) and 16 columns (four runs of 4, 64 apart), so a step of k is 6
16-byte shared loads for 128 multiply-adds (v5: 4 for 64), and each slice brought in from
global memory serves a 128 x 256 tile, 1.33 times the flops per byte of 128 x 128. It is the
tile of the CUTLASS kernel cuBLAS picks for these products. Why it did not pay: 128
accumulators, their fragments and the staged slices take about 240 registers, so one block of
8 warps fits a multiprocessor where v5 runs two blocks (16 warps), and two warps a scheduler
do not hide the shared loads' latency with the instruction order ptxas gives this code.
"""
from numba import cuda, float32

from nanoandrea.kernels.runtime.launch import inlined, launch
from nanoandrea.kernels.ptx.vector import load4, store4

MULTIPLE_OF = (128, 256, 16)    # M, N, K (no edge checks)
BM, BN, BK = 128, 256, 8        # block tile, K slice
TN = 16                         # a thread's columns: RUNS runs of 4, RUN apart
RUNS, RUN = TN // 4, BN // (TN // 4)
THREADS_N = BN // TN            # 16 x 16 threads, each 8 x 16 of out
THREADS = 256
HALF = 64                       # a thread's rows: two runs of 4, HALF apart
A_PAD = BM + 4                  # a_tiles' padded rows (conflict-free transposing stores)
B_RUNS = BK * BN // 4 // THREADS    # runs of 4 of b's slice a thread loads (2) ...
B_STAGED = 4 * B_RUNS               # ... floats of them in registers


@inlined
def outer_product(acc, a_frag, b_frag, a_tiles, b_tiles, buffer, kk, ty, tx):
    # one step of k: acc[8,16] += a_tiles[buffer, kk, thread's rows] (outer) b_tiles[buffer,
    # kk, thread's columns]: 6 16-byte shared loads, 128 multiply-adds
    for half in range(2):
        x = load4(a_tiles, (buffer, kk, half * HALF + ty * 4))
        for e in range(4):
            a_frag[half * 4 + e] = x[e]
    for run in range(RUNS):
        y = load4(b_tiles, (buffer, kk, run * RUN + tx * 4))
        for e in range(4):
            b_frag[run * 4 + e] = y[e]
    for i in range(8):
        for j in range(TN):
            acc[i, j] += a_frag[i] * b_frag[j]


@inlined
def load_slices(a_next, b_next, a, b, k0, m0, n0, tid, K):
    # this thread's runs of the slices k0 .. k0+8 into registers: 4 k of a row of a, and
    # B_RUNS runs of 4 n of b's rows; zeros past K
    x = (float32(0.0), float32(0.0), float32(0.0), float32(0.0))
    if k0 < K:
        x = load4(a, (m0 + tid // 2, k0 + (tid % 2) * 4))
    for e in range(4):
        a_next[e] = x[e]
    for r in range(B_RUNS):
        run = tid + r * THREADS
        y = (float32(0.0), float32(0.0), float32(0.0), float32(0.0))
        if k0 < K:
            y = load4(b, (k0 + run // (BN // 4), n0 + (run % (BN // 4)) * 4))
        for e in range(4):
            b_next[4 * r + e] = y[e]


@inlined
def park(a_tiles, b_tiles, buffer, a_next, b_next, tid):
    # registers -> shared memory: a's run transposed (k-major), b's runs as they are
    for e in range(4):
        a_tiles[buffer, (tid % 2) * 4 + e, tid // 2] = a_next[e]
    for r in range(B_RUNS):
        run = tid + r * THREADS
        store4(b_tiles, (buffer, run // (BN // 4), (run % (BN // 4)) * 4), b_next[4 * r],
               b_next[4 * r + 1], b_next[4 * r + 2], b_next[4 * r + 3])


@cuda.jit
def thread_tiles_8x16_kernel(out, a, b):
    # out[M,N] = a[M,K] @ b[K,N]; grid (N/256, M/128), block 256: thread (ty, tx) computes rows
    # m0 + {0, 64} + ty*4 + {0..3} and columns n0 + {0, 64, 128, 192} + tx*4 + {0..3} of out
    a_tiles = cuda.shared.array((2, BK, A_PAD), float32)    # [buffer, k, i]: a[m0 + i, k]
    b_tiles = cuda.shared.array((2, BK, BN), float32)       # [buffer, k, j]: b[k, n0 + j]
    acc = cuda.local.array((8, TN), float32)
    a_frag = cuda.local.array(8, float32)
    b_frag = cuda.local.array(TN, float32)
    a_next = cuda.local.array(4, float32)                  # the next slice, on its way
    b_next = cuda.local.array(B_STAGED, float32)
    K = a.shape[1]
    tid = cuda.threadIdx.x
    ty, tx = tid // THREADS_N, tid % THREADS_N
    m0, n0 = cuda.blockIdx.y * BM, cuda.blockIdx.x * BN
    for i in range(8):
        for j in range(TN):
            acc[i, j] = float32(0.0)

    load_slices(a_next, b_next, a, b, 0, m0, n0, tid, K)
    park(a_tiles, b_tiles, 0, a_next, b_next, tid)
    cuda.syncthreads()
    buffer = 0
    for k0 in range(0, K, BK):
        load_slices(a_next, b_next, a, b, k0 + BK, m0, n0, tid, K)
        outer_product(acc, a_frag, b_frag, a_tiles, b_tiles, buffer, 0, ty, tx)
        outer_product(acc, a_frag, b_frag, a_tiles, b_tiles, buffer, 1, ty, tx)
        outer_product(acc, a_frag, b_frag, a_tiles, b_tiles, buffer, 2, ty, tx)
        outer_product(acc, a_frag, b_frag, a_tiles, b_tiles, buffer, 3, ty, tx)
        outer_product(acc, a_frag, b_frag, a_tiles, b_tiles, buffer, 4, ty, tx)
        outer_product(acc, a_frag, b_frag, a_tiles, b_tiles, buffer, 5, ty, tx)
        outer_product(acc, a_frag, b_frag, a_tiles, b_tiles, buffer, 6, ty, tx)
        outer_product(acc, a_frag, b_frag, a_tiles, b_tiles, buffer, 7, ty, tx)
        park(a_tiles, b_tiles, 1 - buffer, a_next, b_next, tid)
        cuda.syncthreads()
        buffer = 1 - buffer

    for i in range(8):
        row = m0 + (i // 4) * HALF + ty * 4 + i % 4
        for run in range(RUNS):
            j = run * 4
            store4(out, (row, n0 + run * RUN + tx * 4),
                   acc[i, j], acc[i, j + 1], acc[i, j + 2], acc[i, j + 3])


def matmul(out, a, b):
    M, N = out.shape
    launch(thread_tiles_8x16_kernel, (N // BN, M // BM), THREADS, out, a, b)
