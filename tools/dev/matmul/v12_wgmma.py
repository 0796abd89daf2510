"""Hopper's warpgroup mma (wgmma): operands from swizzled shared memory, cp.async pipeline.
H100 2026-12-07: 0.43x cuBLAS bf16 at 16384x3072x768

    out[M,N] = a[M,K] @ b[K,N]     a, b bf16 (uint32 arrays of pairs: [M, K/2], [K, N/2]),
                                   out float32; M, N multiples of 128, K of 64

mma.sync (v11 and the package's matmul/mma_sync.py) is a warp's instruction on operands in its
registers: every fragment is first loaded from shared memory by ldmatrix, and the H200 gives it
at most about 530-570 TFLOP/s. Hopper's own instruction is wgmma (kernels/ptx/wgmma.py): one
instruction for a warpgroup of 128 threads, D [64,128] += A [64,16] B [16,128], A and B read by
the tensor cores straight from shared memory, named by matrix descriptors, the instruction
asynchronous (issued, then waited for). No ldmatrix, no fragment registers; what it asks for is
shared memory in one of its canonical layouts: here the 128-byte swizzle, for a K-major (each
row of a slice: 64 k, 128 bytes) and for b n-major (as b lies in memory: rows of 64 n, 128
bytes).

A block of 2 warpgroups (256 threads) computes a 128 x 128 tile of out, warpgroup w rows 64w
.. 64w+63, all 128 columns: one m64n128 accumulator of 64 float32 a thread. K advances 64 at
a time through STAGES = 3 slices in dynamic shared memory (32 KB a slice, from the array's
first 1024-byte boundary on: 97 KB asked for, two blocks an SM), filled by cp.async 16 bytes a
copy, each copy's 16-byte chunk placed at its swizzled position (chunk c of row r at
c ^ (r % 8)), as v7 fills its stages:
  - top of slice s: wait for this thread's copies of s (at most STAGES - 2 groups still in
    flight), fence.proxy.async (cp.async writes through the generic proxy, wgmma reads through
    the async proxy), then the block's barrier: every copy of s is in and visible to wgmma,
    and every warpgroup is done with the stage slice s - 1 used;
  - the copies of slice s + STAGES - 1 go into that free stage (an empty group past K, so the
    count of groups in flight stays the same);
  - wgmma.fence, 4 wgmma's (k 0-15, ..., 48-63 of the slice), commit, wait for them.
The epilogue writes acc by wgmma's D layout (kernels/ptx/wgmma.py), two floats a store.

What it leaves for later: each warpgroup waits for its wgmma's before the next slice (the
tensor cores idle during the barrier and the copies' issue; the second block on the SM fills
some of it), every thread issues copies (no producer warp, no TMA, no mbarriers), and the
epilogue goes straight from registers to global memory.
"""
from numba import cuda, float32

from nanoandrea.kernels.ptx.asynccopy import commit_copies, copy16_async, wait_copies
from nanoandrea.kernels.runtime.launch import SIMULATOR, inlined, launch
from nanoandrea.kernels.ptx.wgmma import (ACCUMULATORS, ATOM_BYTES, K_MAJOR, MN_MAJOR, atom_start,
                   dynamic_shared_words, fence_proxy_async, wgmma_commit, wgmma_fence,
                   wgmma_m64n128k16, wgmma_wait)

PRECISION = "bf16"              # (tools/dev/run.py: operands packed bf16, cuBLAS bf16 beside)
MULTIPLE_OF = (128, 128, 64)
BM, BN, BK = 128, 128, 64       # block tile, K slice (bf16 elements; BK: one 128-byte row)
THREADS = 256                   # 2 warpgroups, each 64 rows x 128 columns of the tile
STAGES = 3                      # slices in shared memory: one multiplied, two in flight
ROW_WORDS = 32                  # a swizzled row: 128 bytes, 32 uint32 words (8 chunks of 4)
A_WORDS = BM * ROW_WORDS        # a slice of a: 128 rows (m) x 64 k          16 KB
B_HALF_WORDS = BK * ROW_WORDS   # b: two blocks of 64 columns, each 64 rows (k) x 64 n, 8 KB
STAGE_WORDS = A_WORDS + 2 * B_HALF_WORDS                                    # 32 KB
COPIES = BM * (BK // 8) // THREADS      # 16-byte copies a thread makes of each operand (4)
WAIT_FOR_OLDEST = wait_copies(STAGES - 2)
BOUNDS = {} if SIMULATOR else dict(launch_bounds=(THREADS, 2))    # 2 blocks an SM: at most
                                                                  # 128 registers a thread
multiply = wgmma_m64n128k16(K_MAJOR, MN_MAJOR(4 * B_HALF_WORDS))


@cuda.jit(**BOUNDS)
def wgmma_kernel(out, a, b):
    # out[M,N] = a . b; grid (N/128, M/128), block 256; dynamic shared STAGES x STAGE_WORDS
    # from its first 1024-byte boundary (`first`): stage s at first + s * STAGE_WORDS, a's
    # slice [128 m, 64 k], then b's two [64 k, 64 n] blocks, all in swizzled 128-byte rows
    tiles = dynamic_shared_words()
    first = atom_start(tiles)
    acc = cuda.local.array(ACCUMULATORS, float32)
    K = 2 * a.shape[1]
    tid = cuda.threadIdx.x
    group, thread = tid // 128, tid % 128          # the warpgroup, the thread in it
    m0, n0 = cuda.blockIdx.y * BM, cuda.blockIdx.x * BN
    for e in range(ACCUMULATORS):
        acc[e] = float32(0.0)
    slices = K // BK
    for s in range(STAGES - 1):                    # the pipeline's first slices
        if s < slices:
            copy_slice(tiles, first + s * STAGE_WORDS, a, b, m0, n0, s * BK, tid)
        commit_copies()
    for s in range(slices):
        WAIT_FOR_OLDEST()
        fence_proxy_async()
        cuda.syncthreads()
        ahead = s + STAGES - 1
        if ahead < slices:
            copy_slice(tiles, first + (ahead % STAGES) * STAGE_WORDS, a, b, m0, n0, ahead * BK, tid)
        commit_copies()
        stage = first + (s % STAGES) * STAGE_WORDS
        wgmma_fence(acc)
        for kk in range(BK // 16):                 # a: 32 bytes on along its rows; b: 16 rows
            multiply(acc, tiles, stage + group * 64 * ROW_WORDS + 8 * kk,
                     tiles, stage + A_WORDS + 16 * kk * ROW_WORDS)
        wgmma_commit()
        wgmma_wait(acc)
    store_tile(out, acc, m0 + 64 * group, n0, thread)


@inlined
def store_tile(out, acc, row0, col0, thread):
    """out[row0:+64, col0:+128] = a warpgroup's acc, by wgmma's D layout: thread 32 w + 4 g + t
    holds rows 16 w + g and 16 w + g + 8, columns 8 j + 2 t and 8 j + 2 t + 1."""
    warp, lane = thread // 32, thread % 32
    row = row0 + 16 * warp + lane // 4
    col = col0 + 2 * (lane % 4)
    for j in range(BN // 8):
        out[row, col + 8 * j], out[row, col + 8 * j + 1] = acc[4 * j], acc[4 * j + 1]
        out[row + 8, col + 8 * j], out[row + 8, col + 8 * j + 1] = acc[4 * j + 2], acc[4 * j + 3]


@inlined
def copy_slice(tiles, stage, a, b, m0, n0, k0, tid):
    """Start the copies of a[m0:+128, k0:+64] and b[k0:+64, n0:+128] into the stage at word
    `stage`: a's as 128 rows of k, b's as 64 rows of n."""
    copy_k_rows(tiles, stage, a, m0, k0, tid)
    copy_mn_rows(tiles, stage + A_WORDS, b, k0, n0, tid)


@inlined
def copy_k_rows(tiles, at, x, row0, k0, tid):
    """x[row0:+128, k0:+64] (x's rows along k) into 128 swizzled rows of 128 bytes at word
    `at`, each 16-byte chunk at its place; 8 consecutive threads copy one row (coalesced)."""
    for r in range(COPIES):
        c = tid + r * THREADS
        i, q = c // 8, c % 8                       # row i, chunk q of its 64 k
        copy16_async(tiles, (at + i * ROW_WORDS + 4 * (q ^ (i % 8)),),
                     x, (row0 + i, k0 // 2 + 4 * q), True)


@inlined
def copy_mn_rows(tiles, at, x, k0, col0, tid):
    """x[k0:+64, col0:+128] (x's rows along m or n) into two blocks of 64 columns at word
    `at`, each 64 swizzled rows of 128 bytes; 16 consecutive threads copy one row."""
    for r in range(COPIES):
        c = tid + r * THREADS
        k, q = c // 16, c % 16                     # row k, chunk q of its 128 columns
        block, q8 = q // 8, q % 8                  # (chunks 0-7 the first 64 columns)
        copy16_async(tiles, (at + block * B_HALF_WORDS + k * ROW_WORDS + 4 * (q8 ^ (k % 8)),),
                     x, (k0 + k, col0 // 2 + 4 * q), True)


def matmul(out, a, b):
    M, N = out.shape
    launch(wgmma_kernel, (N // BN, M // BM), THREADS, out, a, b,
           shared_bytes=4 * STAGES * STAGE_WORDS + ATOM_BYTES)
