"""wgmma on 128 x 256 tiles: a quarter fewer bytes from L2 a flop, one block an SM.
H100 2026-12-07: 0.39x cuBLAS bf16 at 16384x3072x768

    out[M,N] = a[M,K] @ b[K,N]     as v12: a, b bf16 (uint32 pairs), out float32;
                                   M multiple of 128, N of 256, K of 64

v12 and v13 run at the same speed, so waiting for each slice's wgmma's is not what holds them
(the SM's second block fills that wait). What a 128 x 128 tile does cost is bytes: each K slice
of 64 brings 32 KB from L2 for 2 MFLOP, 64 flops a byte, ~4.5 TB/s of L2 reads at the 290
TFLOP/s they reach. A 128 x 256 tile brings 48 KB a slice for 4 MFLOP: 85 flops a byte, 3/4 of
the L2 traffic at the same speed.

The block is still 2 warpgroups, each now 64 rows x 256 columns: two m64n128 accumulators (acc
for columns 0-127, acc_right for 128-255), 128 float32 a thread, two wgmma's a k16 step that
share their A. ~170 registers a thread: one block an SM, so no second block hides anything,
and the slice's wait must not stall the tensor cores itself. So v14 keeps a wgmma group in
flight, as v13 does, in 4 stages of 48 KB (193 KB of dynamic shared memory), which makes one
barrier a slice enough again:
  - top of slice s: wait for this thread's copies of s, fence.proxy.async, barrier: slice s's
    copies are in for all, and both warpgroups have waited in slice s - 1 for their wgmma's
    of s - 2;
  - wgmma.fence, 8 wgmma's on stage s, commit;
  - the copies of slice s + 2 go into the stage slice s - 2 held (s + 2 = s - 2 mod 4), free by
    the barrier, while slice s's wgmma's run;
  - wait for all groups but this one (slice s - 1's are done).
The epilogue writes each accumulator as v12 does.
"""
from numba import cuda, float32

from nanoandrea.kernels.ptx.asynccopy import commit_copies, copy16_async, wait_copies
from nanoandrea.kernels.ptx.wgmma import (ACCUMULATORS, ATOM_BYTES, K_MAJOR, MN_MAJOR, atom_start,
                                          dynamic_shared_words, fence_proxy_async, wgmma_commit,
                                          wgmma_fence, wgmma_m64n128k16, wgmma_wait,
                                          wgmma_wait_but_one)
from nanoandrea.kernels.runtime.launch import SIMULATOR, inlined, launch

PRECISION = "bf16"
MULTIPLE_OF = (128, 256, 64)
BM, BN, BK = 128, 256, 64       # block tile, K slice
ROW_WORDS = 32                  # a swizzled row: 128 bytes, 32 uint32 words (8 chunks of 4)
B_HALF_WORDS = BK * ROW_WORDS   # a block of 64 columns of b's slice: 64 rows (k) x 64 n, 8 KB
ACC_COLUMNS = 128               # an accumulator's columns (an m64n128 wgmma's)
THREADS = 256                   # 2 warpgroups, each 64 rows x 256 columns
STAGES = 4                      # slices in shared memory
AHEAD = 2                       # slices whose copies are in flight beyond the one multiplied
A_WORDS = BM * ROW_WORDS        # a's slice: 128 rows (m) x 64 k                       16 KB
B_WORDS = 4 * B_HALF_WORDS      # b's: four blocks of 64 columns, each 64 k x 64 n, 32 KB
STAGE_WORDS = A_WORDS + B_WORDS                                                      # 48 KB
A_COPIES = BM * (BK // 8) // THREADS        # 16-byte copies a thread makes of a (4)
B_COPIES = BK * (BN // 8) // THREADS        # ... and of b (8)
WAIT_FOR_SLICE = wait_copies(AHEAD - 1)
BOUNDS = {} if SIMULATOR else dict(launch_bounds=(THREADS, 1))
multiply = wgmma_m64n128k16(K_MAJOR, MN_MAJOR(4 * B_HALF_WORDS))


@cuda.jit(**BOUNDS)
def wgmma_wide_tile_kernel(out, a, b):
    # out[M,N] = a . b; grid (N/256, M/128), block 256; dynamic shared STAGES x STAGE_WORDS
    # from its first 1024-byte boundary: a stage is a's [128 m, 64 k], then b's four
    # [64 k, 64 n] blocks, in swizzled 128-byte rows (v12's layout, b twice as wide)
    tiles = dynamic_shared_words()
    first = atom_start(tiles)
    acc = cuda.local.array(ACCUMULATORS, float32)            # columns 0-127 of the tile
    acc_right = cuda.local.array(ACCUMULATORS, float32)      # columns 128-255
    K = 2 * a.shape[1]
    tid = cuda.threadIdx.x
    group, thread = tid // 128, tid % 128
    m0, n0 = cuda.blockIdx.y * BM, cuda.blockIdx.x * BN
    for e in range(ACCUMULATORS):
        acc[e] = float32(0.0)
        acc_right[e] = float32(0.0)
    slices = K // BK
    for s in range(AHEAD):
        if s < slices:
            copy_slice(tiles, first + s * STAGE_WORDS, a, b, m0, n0, s * BK, tid)
        commit_copies()
    for s in range(slices):
        WAIT_FOR_SLICE()
        fence_proxy_async()
        cuda.syncthreads()
        stage = first + (s % STAGES) * STAGE_WORDS
        wgmma_fence(acc)
        wgmma_fence(acc_right)
        for kk in range(BK // 16):
            a_word = stage + group * 64 * ROW_WORDS + 8 * kk
            b_word = stage + A_WORDS + 16 * kk * ROW_WORDS
            multiply(acc, tiles, a_word, tiles, b_word)
            multiply(acc_right, tiles, a_word, tiles, b_word + 2 * B_HALF_WORDS)
        wgmma_commit()
        ahead = s + AHEAD
        if ahead < slices:
            copy_slice(tiles, first + (ahead % STAGES) * STAGE_WORDS, a, b, m0, n0, ahead * BK,
                       tid)
        commit_copies()
        wgmma_wait_but_one(acc)
        wgmma_wait_but_one(acc_right)
    wgmma_wait(acc)
    wgmma_wait(acc_right)
    store_tile(out, acc, m0 + 64 * group, n0, thread)
    store_tile(out, acc_right, m0 + 64 * group, n0 + 128, thread)


@inlined
def copy_slice(tiles, stage, a, b, m0, n0, k0, tid):
    """Start the copies of a[m0:+128, k0:+64] and b[k0:+64, n0:+256] into the stage at word
    `stage`, each 16-byte chunk at its swizzled place (v12's, b in four column blocks)."""
    for r in range(A_COPIES):
        c = tid + r * THREADS
        i, q = c // 8, c % 8                       # a: row i, chunk q of its 64 k
        copy16_async(tiles, (stage + i * ROW_WORDS + 4 * (q ^ (i % 8)),),
                     a, (m0 + i, k0 // 2 + 4 * q), True)
    for r in range(B_COPIES):
        c = tid + r * THREADS
        k, q = c // 32, c % 32                     # b: row k, chunk q of its 256 n
        block, q8 = q // 8, q % 8
        copy16_async(tiles, (stage + A_WORDS + block * B_HALF_WORDS + k * ROW_WORDS
                             + 4 * (q8 ^ (k % 8)),),
                     b, (k0 + k, n0 // 2 + 4 * q), True)


@inlined
def store_tile(out, acc, row0, col0, thread):
    """out[row0:+64, col0:+128] = a warpgroup's accumulator, by wgmma's D layout: thread
    32 w + 4 g + t holds rows 16 w + g and 16 w + g + 8, columns 8 j + 2 t and 8 j + 2 t + 1."""
    warp, lane = thread // 32, thread % 32
    row = row0 + 16 * warp + lane // 4
    col = col0 + 2 * (lane % 4)
    for j in range(ACC_COLUMNS // 8):
        out[row, col + 8 * j], out[row, col + 8 * j + 1] = acc[4 * j], acc[4 * j + 1]
        out[row + 8, col + 8 * j], out[row + 8, col + 8 * j + 1] = acc[4 * j + 2], acc[4 * j + 3]


def matmul(out, a, b):
    M, N = out.shape
    launch(wgmma_wide_tile_kernel, (N // BN, M // BM), THREADS, out, a, b,
           shared_bytes=4 * STAGES * STAGE_WORDS + ATOM_BYTES)
