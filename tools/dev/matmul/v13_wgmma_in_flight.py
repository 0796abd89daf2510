"""wgmma with one group in flight: the next slice's wgmma's issue before this one's are done.
H200 2026-12-02: 0.41x cuBLAS bf16, 286 TFLOP/s at 16384x3072x768 (v12's: the wait is not it)

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

from nanoandrea.kernels.asynccopy import commit_copies
from nanoandrea.kernels.launch import launch
from v12_wgmma import (A_WORDS, BK, BM, BN, BOUNDS, MULTIPLE_OF, ROW_WORDS,  # noqa: F401
                       STAGE_WORDS, STAGES, THREADS, WAIT_FOR_OLDEST, copy_slice, multiply,
                       store_tile)                  # (MULTIPLE_OF: what run.py reads)
from nanoandrea.kernels.wgmma import (ACCUMULATORS, ATOM_BYTES, atom_start, dynamic_shared_words,
                   fence_proxy_async, wgmma_commit, wgmma_fence, wgmma_wait,
                   wgmma_wait_but_one)

PRECISION = "bf16"


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

def matmul(out, a, b):
    M, N = out.shape
    launch(wgmma_in_flight_kernel, (N // BN, M // BM), THREADS, out, a, b,
           shared_bytes=4 * STAGES * STAGE_WORDS + ATOM_BYTES)
