"""wgmma with one group in flight: the next slice's wgmma's issue before this one's are done.
H100 2026-12-07: 0.43x cuBLAS bf16 at 16384x3072x768

    out[M,N] = a[M,K] @ b[K,N]     as v12: a, b bf16 (uint32 pairs), out float32;
                                   M, N multiples of 128, K of 64

v12's slice ends by waiting for its own wgmma's (wgmma.wait_group 0): from then until the next
slice's first wgmma, through the barrier and the issue of the copies, the warpgroup's tensor
cores have nothing to do, unless the SM's other block has its wgmma's in flight. v13 changes
only the loop: it waits for all but the newest group (wgmma.wait_group 1), so slice s's
wgmma's run while the warpgroup meets the others and issues copies, and slice s + 1's are
queued behind them. The tile, the stages, the copies and the epilogue are v12's.

The stage slice s + 2 is copied into held slice s - 1, and slice s - 1's wgmma's are now only
known to be done after slice s's wait: so each slice has two barriers, not one:
  - top of slice s: wait for this thread's copies of s, fence.proxy.async, barrier A: every
    copy of s is in and visible to the async proxy;
  - wgmma.fence, 4 wgmma's on stage s, commit; wait for all groups but this one: slice
    s - 1's wgmma's are done in this warpgroup;
  - barrier B: ... and in the other one, so stage (s - 1) % 3 is free; the copies of slice
    s + 2 go into it while slice s's wgmma's run.
After the last slice, wgmma.wait_group 0, then the epilogue.
"""
from numba import cuda, float32

from nanoandrea.kernels.ptx.asynccopy import commit_copies, copy16_async, wait_copies
from nanoandrea.kernels.ptx.wgmma import (ACCUMULATORS, ATOM_BYTES, K_MAJOR, MN_MAJOR, atom_start,
                                          dynamic_shared_words, fence_proxy_async, wgmma_commit,
                                          wgmma_fence, wgmma_m64n128k16, wgmma_wait,
                                          wgmma_wait_but_one)
from nanoandrea.kernels.runtime.launch import SIMULATOR, inlined, launch

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
BOUNDS = {} if SIMULATOR else dict(launch_bounds=(THREADS, 2))    # 2 blocks an SM
multiply = wgmma_m64n128k16(K_MAJOR, MN_MAJOR(4 * B_HALF_WORDS))


@cuda.jit(**BOUNDS)
def wgmma_in_flight_kernel(out, a, b):
    # out[M,N] = a . b; grid (N/128, M/128), block 256; shared memory as v12's
    tiles = dynamic_shared_words()
    first = atom_start(tiles)
    acc = cuda.local.array(ACCUMULATORS, float32)
    K = 2 * a.shape[1]
    tid = cuda.threadIdx.x
    group, thread = tid // 128, tid % 128
    m0, n0 = cuda.blockIdx.y * BM, cuda.blockIdx.x * BN
    for e in range(ACCUMULATORS):
        acc[e] = float32(0.0)
    slices = K // BK
    for s in range(STAGES - 1):
        if s < slices:
            copy_slice(tiles, first + s * STAGE_WORDS, a, b, m0, n0, s * BK, tid)
        commit_copies()
    for s in range(slices):
        WAIT_FOR_OLDEST()
        fence_proxy_async()
        cuda.syncthreads()                         # A: slice s's copies are in, for all
        stage = first + (s % STAGES) * STAGE_WORDS
        wgmma_fence(acc)
        for kk in range(BK // 16):
            multiply(acc, tiles, stage + group * 64 * ROW_WORDS + 8 * kk,
                     tiles, stage + A_WORDS + 16 * kk * ROW_WORDS)
        wgmma_commit()
        wgmma_wait_but_one(acc)                    # slice s - 1's are done; s's run on
        cuda.syncthreads()                         # B: ... in both warpgroups
        ahead = s + STAGES - 1                     # (its stage is slice s - 1's)
        if ahead < slices:
            copy_slice(tiles, first + (ahead % STAGES) * STAGE_WORDS, a, b, m0, n0, ahead * BK,
                       tid)
        commit_copies()
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
    launch(wgmma_in_flight_kernel, (N // BN, M // BM), THREADS, out, a, b,
           shared_bytes=4 * STAGES * STAGE_WORDS + ATOM_BYTES)
