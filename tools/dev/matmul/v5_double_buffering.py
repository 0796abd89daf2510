"""Double buffering (next slice loads meanwhile), 8 steps unrolled.
H100 2026-12-07: 0.90x cuBLAS float32 at 16384x3072x768

    out[M,N] = a[M,K] @ b[K,N]          float32, row-major; M, N multiples of 128, K of 16

In v4 a slice's global loads are issued, and then the whole block waits for them (hundreds of
cycles) before it multiplies anything. Here shared memory holds two buffers of each tile. At
the top of a slice every thread issues its loads of the NEXT slice into registers (a_next,
b_next), multiplies the current slice out of one buffer while those loads are in flight, and
only then stores them into the other buffer ("parks" them) and meets the block at the one
barrier of the slice: the load latency hides behind 512 multiply-adds. The next slice is
loaded every slice, after the last one too (zeros past K then, parked in a buffer nobody reads
again): a condition chooses the values, not whether the loads and the parking happen; behind
an `if there is a next slice` around both, the compiler moves the loads next to the stores
that use them, and then nothing hides their latency.
The slice's 8 steps of k are written out (outer_product called with kk = 0 .. 7): a rolled loop
spends its counter and its address arithmetic on every step, and written out, the shared
addresses become constant offsets of one register.
Launch bounds (256 threads, 2 blocks a multiprocessor) keep it at 128 registers a thread, what
two blocks need to share a multiprocessor's 64K: then one block's warps multiply while the
other's wait at a barrier. Left to itself ptxas lands on either side of 128 with small changes
to this code (126 to 149 registers for variants of the loop), and with one block the 8 warps
all wait at the same barriers.
This is the main loop of the package's float32 kernel (kernels/matmul/float32.py; v6 runs it).
"""
from numba import cuda, float32

from nanoandrea.kernels.runtime.launch import SIMULATOR, inlined, launch
from nanoandrea.kernels.ptx.vector import load4, store4

MULTIPLE_OF = (128, 128, 16)    # M, N, K (no edge checks)
BM, BN, BK = 128, 128, 8        # block tile, K slice
THREADS_N = 16                  # 16 x 16 threads, each 8 x 8 of out
THREADS = 256
HALF = 64                       # a thread's rows: two runs of 4, HALF apart (its columns too)
A_PAD = BM + 4                  # a_tiles' padded rows (conflict-free transposing stores)
# two blocks a multiprocessor: at most 128 registers a thread (the simulator takes no bounds)
BOUNDS = {} if SIMULATOR else dict(launch_bounds=(THREADS, 2))


@inlined
def outer_product(acc, a_frag, b_frag, a_tiles, b_tiles, buffer, kk, ty, tx):
    # one step of k: acc[8,8] += a_tiles[buffer, kk, thread's rows] (outer) b_tiles[buffer, kk,
    # thread's columns]: 4 16-byte shared loads, 64 multiply-adds
    for half in range(2):
        x = load4(a_tiles, (buffer, kk, half * HALF + ty * 4))
        y = load4(b_tiles, (buffer, kk, half * HALF + tx * 4))
        for e in range(4):
            a_frag[half * 4 + e] = x[e]
            b_frag[half * 4 + e] = y[e]
    for i in range(8):
        for j in range(8):
            acc[i, j] += a_frag[i] * b_frag[j]


@inlined
def load_slices(a_next, b_next, a, b, k0, m0, n0, tid, K):
    # this thread's runs of the slices k0 .. k0+8 into registers: 4 k of a row of a (a[m0 +
    # tid/2, k0 + 4 (tid%2) :+4]) and 4 n of a row of b (b[k0 + tid/32, n0 + 4 (tid%32) :+4]);
    # zeros past K
    x = y = (float32(0.0), float32(0.0), float32(0.0), float32(0.0))
    if k0 < K:
        x = load4(a, (m0 + tid // 2, k0 + (tid % 2) * 4))
        y = load4(b, (k0 + tid // 32, n0 + (tid % 32) * 4))
    for e in range(4):
        a_next[e] = x[e]
        b_next[e] = y[e]


@inlined
def park(a_tiles, b_tiles, buffer, a_next, b_next, tid):
    # registers -> shared memory: a's run transposed (k-major), b's run as it is
    for e in range(4):
        a_tiles[buffer, (tid % 2) * 4 + e, tid // 2] = a_next[e]
    store4(b_tiles, (buffer, tid // 32, (tid % 32) * 4), b_next[0], b_next[1], b_next[2],
           b_next[3])


@cuda.jit(**BOUNDS)
def double_buffered_kernel(out, a, b):
    # out[M,N] = a[M,K] @ b[K,N]; grid (N/128, M/128), block 256: thread (ty, tx) computes rows
    # m0 + {0, 64} + ty*4 + {0..3} and columns n0 + {0, 64} + tx*4 + {0..3} of out
    a_tiles = cuda.shared.array((2, BK, A_PAD), float32)    # [buffer, k, i]: a[m0 + i, k]
    b_tiles = cuda.shared.array((2, BK, BN), float32)       # [buffer, k, j]: b[k, n0 + j]
    acc = cuda.local.array((8, 8), float32)
    a_frag = cuda.local.array(8, float32)
    b_frag = cuda.local.array(8, float32)
    a_next = cuda.local.array(4, float32)                  # the next slice, on its way
    b_next = cuda.local.array(4, float32)
    K = a.shape[1]
    tid = cuda.threadIdx.x
    ty, tx = tid // THREADS_N, tid % THREADS_N
    m0, n0 = cuda.blockIdx.y * BM, cuda.blockIdx.x * BN
    for i in range(8):
        for j in range(8):
            acc[i, j] = float32(0.0)

    # the first slice straight into buffer 0
    load_slices(a_next, b_next, a, b, 0, m0, n0, tid, K)
    park(a_tiles, b_tiles, 0, a_next, b_next, tid)
    cuda.syncthreads()
    buffer = 0
    for k0 in range(0, K, BK):
        # issue the next slice's loads ...
        load_slices(a_next, b_next, a, b, k0 + BK, m0, n0, tid, K)
        # ... multiply this one meanwhile ...
        outer_product(acc, a_frag, b_frag, a_tiles, b_tiles, buffer, 0, ty, tx)
        outer_product(acc, a_frag, b_frag, a_tiles, b_tiles, buffer, 1, ty, tx)
        outer_product(acc, a_frag, b_frag, a_tiles, b_tiles, buffer, 2, ty, tx)
        outer_product(acc, a_frag, b_frag, a_tiles, b_tiles, buffer, 3, ty, tx)
        outer_product(acc, a_frag, b_frag, a_tiles, b_tiles, buffer, 4, ty, tx)
        outer_product(acc, a_frag, b_frag, a_tiles, b_tiles, buffer, 5, ty, tx)
        outer_product(acc, a_frag, b_frag, a_tiles, b_tiles, buffer, 6, ty, tx)
        outer_product(acc, a_frag, b_frag, a_tiles, b_tiles, buffer, 7, ty, tx)
        # ... then park the next one in the other buffer. One barrier a slice: after it, the
        # next slice is complete, and everyone is done reading this buffer, which the slice
        # after next overwrites.
        park(a_tiles, b_tiles, 1 - buffer, a_next, b_next, tid)
        cuda.syncthreads()
        buffer = 1 - buffer

    for i in range(8):
        row = m0 + (i // 4) * HALF + ty * 4 + i % 4
        for half in range(2):
            j = half * 4
            store4(out, (row, n0 + half * HALF + tx * 4),
                   acc[i, j], acc[i, j + 1], acc[i, j + 2], acc[i, j + 3])


def matmul(out, a, b):
    M, N = out.shape
    launch(double_buffered_kernel, (N // BN, M // BM), THREADS, out, a, b)
