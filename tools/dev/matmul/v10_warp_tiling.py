"""Not kept: warp tiling, a warp on 4 x 8 threads of the grid.
H100 2026-12-07: 0.93x cuBLAS float32 at 16384x3072x768

    out[M,N] = a[M,K] @ b[K,N]          float32, row-major; M, N multiples of 128, K of 16

Tried after v5: faster than v5, 5% slower than the product's kernel (v6: 0.97x in the run
above; built into it, 3-6% slower on every product, docs/perf.md). Only the map of
threads onto the 16 x 16 grid changes. In v5 a warp is two rows of the grid (2 x 16 threads):
each step it reads 2 runs of a_tiles (one wavefront a load) and 16 of b_tiles (256 bytes, two
wavefronts a load), 6 wavefronts for its 4 loads. Here a warp covers a 4 x 8 block of the grid
(warp w at rows 4 (w // 2) + lane // 8, columns 8 (w % 2) + lane % 8), so it reads 4 runs of
a and 8 of b, 128 bytes or less: one wavefront a load, 4 a step. Why it did not pay: shared
memory bandwidth was not what held v5 back, and the new map costs elsewhere (its epilogue
stores and the order in which the warps' loads meet memory are the candidates; not profiled).
"""
from numba import cuda, float32

from nanoandrea.kernels.runtime.launch import SIMULATOR, inlined, launch
from nanoandrea.kernels.ptx.vector import load4, store4

MULTIPLE_OF = (128, 128, 16)    # M, N, K (no edge checks)
BM, BN, BK = 128, 128, 8        # block tile, K slice
THREADS = 256                   # 16 x 16 threads, each 8 x 8 of out
WARP_ROWS, WARP_COLS = 4, 8     # a warp's threads on the grid
WARPS_N = 16 // WARP_COLS       # warps side by side along a row of the grid
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
def warp_tiled_kernel(out, a, b):
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
    warp, lane = tid // 32, tid % 32            # (the one change from v5: where a thread sits)
    ty = (warp // WARPS_N) * WARP_ROWS + lane // WARP_COLS
    tx = (warp % WARPS_N) * WARP_COLS + lane % WARP_COLS
    m0, n0 = cuda.blockIdx.y * BM, cuda.blockIdx.x * BN
    for i in range(8):
        for j in range(8):
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
        for half in range(2):
            j = half * 4
            store4(out, (row, n0 + half * HALF + tx * 4),
                   acc[i, j], acc[i, j + 1], acc[i, j + 2], acc[i, j + 3])


def matmul(out, a, b):
    M, N = out.shape
    launch(warp_tiled_kernel, (N // BN, M // BM), THREADS, out, a, b)
