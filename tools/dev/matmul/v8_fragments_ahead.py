"""Not kept: shared-memory fragments read a step ahead (two sets).
H100 2026-12-07: 0.93x cuBLAS float32 at 16384x3072x768

    out[M,N] = a[M,K] @ b[K,N]          float32, row-major; M, N multiples of 128, K of 16

Tried after v5: faster than v5 but not than the product's kernel (v6, 0.97x in the run
above, which also gathers its epilogue and runs its plain product unbounded; built into it,
the idea was 6-8% slower on every plain product, docs/perf.md). The idea:
in v5 every step of k loads its fragments from shared memory and then multiplies them, so the
FFMAs wait on those loads; worst after each slice's barrier, where every warp of the block
reads its first fragments at once and waits on them together. Here a thread keeps two sets of
fragment registers (a0, b0 and a1, b1): while the FFMAs of step kk run on one set, the loads
of step kk + 1 fill the other, and the next slice's first fragments are read right after the
barrier, under the last step of this slice. Why it did not pay: the register moves between
the two sets lengthen the loop, and the latency they were to hide was mostly hidden already
by the other block's warps on the multiprocessor.
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
def load_fragments(a_frag, b_frag, a_tiles, b_tiles, buffer, kk, ty, tx):
    # the thread's 8 values of a's column kk and 8 of b's row kk: 4 16-byte shared loads
    for half in range(2):
        x = load4(a_tiles, (buffer, kk, half * HALF + ty * 4))
        y = load4(b_tiles, (buffer, kk, half * HALF + tx * 4))
        for e in range(4):
            a_frag[half * 4 + e] = x[e]
            b_frag[half * 4 + e] = y[e]


@inlined
def multiply(acc, a_frag, b_frag):
    # acc[8,8] += a_frag (outer) b_frag: 64 multiply-adds
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
def fragments_ahead_kernel(out, a, b):
    # out[M,N] = a[M,K] @ b[K,N]; grid (N/128, M/128), block 256: thread (ty, tx) computes rows
    # m0 + {0, 64} + ty*4 + {0..3} and columns n0 + {0, 64} + tx*4 + {0..3} of out
    a_tiles = cuda.shared.array((2, BK, A_PAD), float32)    # [buffer, k, i]: a[m0 + i, k]
    b_tiles = cuda.shared.array((2, BK, BN), float32)       # [buffer, k, j]: b[k, n0 + j]
    acc = cuda.local.array((8, 8), float32)
    a0 = cuda.local.array(8, float32)                       # two sets of fragments: the
    b0 = cuda.local.array(8, float32)                       # even steps of k in a0, b0, the
    a1 = cuda.local.array(8, float32)                       # odd ones in a1, b1
    b1 = cuda.local.array(8, float32)
    a_next = cuda.local.array(4, float32)                  # the next slice, on its way
    b_next = cuda.local.array(4, float32)
    K = a.shape[1]
    tid = cuda.threadIdx.x
    ty, tx = tid // THREADS_N, tid % THREADS_N
    m0, n0 = cuda.blockIdx.y * BM, cuda.blockIdx.x * BN
    for i in range(8):
        for j in range(8):
            acc[i, j] = float32(0.0)

    load_slices(a_next, b_next, a, b, 0, m0, n0, tid, K)
    park(a_tiles, b_tiles, 0, a_next, b_next, tid)
    cuda.syncthreads()
    load_fragments(a0, b0, a_tiles, b_tiles, 0, 0, ty, tx)     # step 0 of the first slice
    buffer = 0
    for k0 in range(0, K, BK):
        load_slices(a_next, b_next, a, b, k0 + BK, m0, n0, tid, K)
        # steps 0-6 multiplied, each while the next one's fragments are read
        load_fragments(a1, b1, a_tiles, b_tiles, buffer, 1, ty, tx)
        multiply(acc, a0, b0)
        load_fragments(a0, b0, a_tiles, b_tiles, buffer, 2, ty, tx)
        multiply(acc, a1, b1)
        load_fragments(a1, b1, a_tiles, b_tiles, buffer, 3, ty, tx)
        multiply(acc, a0, b0)
        load_fragments(a0, b0, a_tiles, b_tiles, buffer, 4, ty, tx)
        multiply(acc, a1, b1)
        load_fragments(a1, b1, a_tiles, b_tiles, buffer, 5, ty, tx)
        multiply(acc, a0, b0)
        load_fragments(a0, b0, a_tiles, b_tiles, buffer, 6, ty, tx)
        multiply(acc, a1, b1)
        load_fragments(a1, b1, a_tiles, b_tiles, buffer, 7, ty, tx)
        multiply(acc, a0, b0)
        park(a_tiles, b_tiles, 1 - buffer, a_next, b_next, tid)
        cuda.syncthreads()
        # the next slice's step 0 read while this slice's step 7 is multiplied
        load_fragments(a0, b0, a_tiles, b_tiles, 1 - buffer, 0, ty, tx)
        multiply(acc, a1, b1)
        buffer = 1 - buffer

    for i in range(8):
        row = m0 + (i // 4) * HALF + ty * 4 + i % 4
        for half in range(2):
            j = half * 4
            store4(out, (row, n0 + half * HALF + tx * 4),
                   acc[i, j], acc[i, j + 1], acc[i, j + 2], acc[i, j + 3])


def matmul(out, a, b):
    M, N = out.shape
    launch(fragments_ahead_kernel, (N // BN, M // BM), THREADS, out, a, b)
