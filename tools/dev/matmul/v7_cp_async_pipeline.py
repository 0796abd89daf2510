"""Not kept: cp.async, 3 slices in flight, no staging registers.
H100 2026-12-07: 0.89x cuBLAS float32 at 16384x3072x768

    out[M,N] = a[M,K] @ b[K,N]          float32, row-major; M, N multiples of 128, K of 16

Tried after v5 and NOT faster than the product's register staging (v6, 0.97x in the run
above; 3 or 4 stages were slower on every product timed, docs/perf.md), so the product keeps
it. The idea is cuBLAS's: `cp.async`
(asynccopy.py) copies global memory straight into shared memory without passing through
registers, and the thread goes on computing while it lands. With STAGES = 3 buffers, two
slices are on their way while a third is multiplied: at the top of each slice a thread
waits until its copies of this slice have landed (wait_copies(STAGES - 2): at most one group,
the next slice's, still in flight), the block meets at the one barrier of the slice (now
everyone's copies have landed, and everyone is done with the stage the slice before used),
the copies of the slice STAGES - 1 ahead go into that free stage, and the slice is multiplied.
Every slice commits one group, zeros past K included, so that the count of groups in flight
stays the same to the end.
b's runs of 4 floats along n go in with 16-byte copies; a's run along k, and k-major a_tiles
needs them transposed, which a 16-byte copy cannot do: a is copied 4 bytes at a time, a warp's
32 copies on 4 rows x 8 consecutive k, landing on 32 different banks of the padded tile.
Why it did not pay: the register-staged v5 already hides the loads' latency behind a slice's
512 FFMAs, and 4 times as many copy instructions for a (and their addresses) cost issue
slots the FFMAs need.
"""
from numba import cuda, float32

from nanoandrea.kernels.ptx.asynccopy import commit_copies, copy4_async, copy16_async, wait_copies
from nanoandrea.kernels.runtime.launch import SIMULATOR, inlined, launch
from nanoandrea.kernels.ptx.vector import load4, store4

MULTIPLE_OF = (128, 128, 16)    # M, N, K (no edge checks)
BM, BN, BK = 128, 128, 8        # block tile, K slice
STAGES = 3                      # slices in shared memory: one multiplied, two in flight
THREADS_N = 16                  # 16 x 16 threads, each 8 x 8 of out
THREADS = 256
HALF = 64                       # a thread's rows: two runs of 4, HALF apart (its columns too)
A_PAD = BM + 4                  # a_tiles' padded rows (conflict-free transposed copies)
A_LINE = THREADS // BK          # a's 4-byte copies: 32 threads on each k of the slice
WAIT_FOR_OLDEST = wait_copies(STAGES - 2)
WAIT_FOR_ALL = wait_copies(0)
# two blocks a multiprocessor: at most 128 registers a thread (the simulator takes no bounds)
BOUNDS = {} if SIMULATOR else dict(launch_bounds=(THREADS, 2))


@inlined
def copy_slice(a_tiles, b_tiles, stage, a, b, k0, m0, n0, tid, K):
    # the slice k0 .. k0+8 into a_tiles[stage] (transposed, 4 floats a thread, 4 bytes each)
    # and b_tiles[stage] (one 16-byte run a thread); zeros (nothing read) where k0 >= K
    valid = k0 < K
    k_read = k0 if valid else 0                 # (a legal address all the same)
    k, i = tid % BK, tid // BK                  # a[m0 + i + 32 r, k0 + k]
    for r in range(BM // A_LINE):
        copy4_async(a_tiles, (stage, k, i + r * A_LINE), a, (m0 + i + r * A_LINE, k_read + k),
                    valid)
    k, j = tid // 32, (tid % 32) * 4            # b[k0 + k, n0 + j : +4]
    copy16_async(b_tiles, (stage, k, j), b, (k_read + k, n0 + j), valid)


@inlined
def outer_product(acc, a_frag, b_frag, a_tiles, b_tiles, stage, kk, ty, tx):
    # one step of k: acc[8,8] += a_tiles[stage, kk, thread's rows] (outer) b_tiles[stage, kk,
    # thread's columns]: 4 16-byte shared loads, 64 multiply-adds
    for half in range(2):
        x = load4(a_tiles, (stage, kk, half * HALF + ty * 4))
        y = load4(b_tiles, (stage, kk, half * HALF + tx * 4))
        for e in range(4):
            a_frag[half * 4 + e] = x[e]
            b_frag[half * 4 + e] = y[e]
    for i in range(8):
        for j in range(8):
            acc[i, j] += a_frag[i] * b_frag[j]


@cuda.jit(**BOUNDS)
def pipelined_kernel(out, a, b):
    # out[M,N] = a[M,K] @ b[K,N]; grid (N/128, M/128), block 256: thread (ty, tx) computes rows
    # m0 + {0, 64} + ty*4 + {0..3} and columns n0 + {0, 64} + tx*4 + {0..3} of out
    a_tiles = cuda.shared.array((STAGES, BK, A_PAD), float32)  # [stage, k, i]: a[m0 + i, k]
    b_tiles = cuda.shared.array((STAGES, BK, BN), float32)     # [stage, k, j]: b[k, n0 + j]
    acc = cuda.local.array((8, 8), float32)
    a_frag = cuda.local.array(8, float32)
    b_frag = cuda.local.array(8, float32)
    K = a.shape[1]
    tid = cuda.threadIdx.x
    ty, tx = tid // THREADS_N, tid % THREADS_N
    m0, n0 = cuda.blockIdx.y * BM, cuda.blockIdx.x * BN
    for i in range(8):
        for j in range(8):
            acc[i, j] = float32(0.0)

    # the first STAGES - 1 slices on their way, a group each
    for s in range(STAGES - 1):
        copy_slice(a_tiles, b_tiles, s, a, b, s * BK, m0, n0, tid, K)
        commit_copies()
    stage = 0
    for k0 in range(0, K, BK):
        WAIT_FOR_OLDEST()           # this thread's copies of slice k0 have landed ...
        cuda.syncthreads()          # ... and everyone's; the stage before is free
        ahead = stage - 1 if stage > 0 else STAGES - 1          # (stage + STAGES - 1) % STAGES
        copy_slice(a_tiles, b_tiles, ahead, a, b, k0 + (STAGES - 1) * BK, m0, n0, tid, K)
        commit_copies()
        outer_product(acc, a_frag, b_frag, a_tiles, b_tiles, stage, 0, ty, tx)
        outer_product(acc, a_frag, b_frag, a_tiles, b_tiles, stage, 1, ty, tx)
        outer_product(acc, a_frag, b_frag, a_tiles, b_tiles, stage, 2, ty, tx)
        outer_product(acc, a_frag, b_frag, a_tiles, b_tiles, stage, 3, ty, tx)
        outer_product(acc, a_frag, b_frag, a_tiles, b_tiles, stage, 4, ty, tx)
        outer_product(acc, a_frag, b_frag, a_tiles, b_tiles, stage, 5, ty, tx)
        outer_product(acc, a_frag, b_frag, a_tiles, b_tiles, stage, 6, ty, tx)
        outer_product(acc, a_frag, b_frag, a_tiles, b_tiles, stage, 7, ty, tx)
        stage = stage + 1 if stage + 1 < STAGES else 0
    WAIT_FOR_ALL()                  # no copy may land in shared memory after the block ends

    for i in range(8):
        row = m0 + (i // 4) * HALF + ty * 4 + i % 4
        for half in range(2):
            j = half * 4
            store4(out, (row, n0 + half * HALF + tx * 4),
                   acc[i, j], acc[i, j + 1], acc[i, j + 2], acc[i, j + 3])


def matmul(out, a, b):
    M, N = out.shape
    launch(pipelined_kernel, (N // BN, M // BM), THREADS, out, a, b)
