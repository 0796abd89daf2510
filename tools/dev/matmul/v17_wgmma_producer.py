"""wgmma fed by a producer warpgroup through mbarriers: no block barrier, a group in flight.
H100 2026-12-07: 0.32x cuBLAS bf16 at 16384x3072x768

    out[M,N] = a[M,K] @ b[K,N]     as v12: a, b bf16 (uint32 pairs), out float32;
                                   M multiple of 128, N of 256, K of 64

v12 to v16 stop both warpgroups of a block at a barrier every slice, and each waits for its
slice's wgmma's before that barrier: the tensor cores have work only while the SM's other
block does. v14's wider tile (fewer bytes a flop) lost for that reason: one block an SM, and
nothing to fill the waits. Here the roles are split, as CUTLASS's warp-specialized kernels
split them:
  - warpgroup 0, the producer, only copies: for each slice of each tile the block takes, it
    waits until the stage's last slice is released (the stage's `empty` mbarrier), starts its
    cp.async's into it, and has them arrive at the stage's `full` mbarrier when they land
    (cp.async.mbarrier.arrive.noinc: the arrival is the copies', not the thread's);
  - warpgroups 1 and 2, the consumers, only multiply: each 64 rows x 256 columns of a 128 x 256
    tile (one m64n256k16 a k16 step, 128 float32 sums a thread). For a slice: wait for its
    stage's `full` phase, fence.proxy.async (the copies wrote through the generic proxy, wgmma
    reads through the async one), 4 wgmma's, commit, wait for all groups but this one, and
    release the LAST slice's stage (its wgmma's are done: each thread arrives at `empty`).
    The next slice's wgmma's queue behind this one's while the thread waits, so the tensor
    cores never run dry between slices.
  - persistent: one block an SM (4 stages of 48 KB, 193 KB), each taking every 132nd tile;
    the producer runs on into the next tile while the consumers store the last one.
An mbarrier counts arrivals in phases: it completes a phase when `count` arrivals have come,
and a waiter names the phase by its parity. Slice n (counted over the block's tiles) uses stage
n % 4 in its (n // 4)-th round: the consumers wait for `full` phase parity (n // 4) & 1, the
producer for `empty` parity ((n // 4) & 1) ^ 1 (a fresh barrier counts its "previous" phase,
parity 1, as complete: the first round does not wait).

The mbarrier instructions are the package's (nanoandrea/kernels/ptx/tma.py: inline PTX, sm_80+,
try_wait sm_90; under the simulator a twin keeps each barrier's pending count and phase in a
dict), and the cp.async arrival this version's own; in the simulator it arrives at once (its
copy already has).
"""
from numba import cuda, float32, int32

from nanoandrea.kernels.ptx.asynccopy import copy16_async
from nanoandrea.kernels.ptx.tma import mbarrier_arrive, mbarrier_init, wait_phase
from nanoandrea.kernels.ptx.wgmma import (ATOM_BYTES, K_MAJOR, MN_MAJOR, atom_start,
                                          dynamic_shared_words, fence_for, fence_proxy_async,
                                          wait_for, wgmma_commit, wgmma_m64nNk16)
from nanoandrea.kernels.runtime import device
from nanoandrea.kernels.runtime.launch import SIMULATOR, inlined, launch

PRECISION = "bf16"
MULTIPLE_OF = (128, 256, 64)
BM, BN, BK = 128, 256, 64       # block tile, K slice
ROW_WORDS = 32                  # a swizzled row: 128 bytes, 32 uint32 words (8 chunks of 4)
B_HALF_WORDS = BK * ROW_WORDS   # a block of 64 columns of b's slice: 64 rows (k) x 64 n, 8 KB
GROUP = 128                     # threads a warpgroup
THREADS = 3 * GROUP             # the producer, then two consumers of 64 rows each
STAGES = 4
A_WORDS = BM * ROW_WORDS        # a's slice: 128 rows (m) x 64 k                       16 KB
STAGE_WORDS = A_WORDS + 4 * B_HALF_WORDS    # then b's four blocks of 64 k x 64 n     48 KB
A_COPIES = BM * (BK // 8) // GROUP          # 16-byte copies a producer thread makes of a (8)
B_COPIES = BK * (BN // 8) // GROUP          # ... and of b (16)
SUMS = BN // 2                  # a consumer thread's float32s of its 64 x 256 (128)
BOUNDS = {} if SIMULATOR else dict(launch_bounds=(THREADS, 1))
multiply = wgmma_m64nNk16(BN, K_MAJOR, MN_MAJOR(4 * B_HALF_WORDS))
fence_sums, wait_all, wait_but_one = fence_for(SUMS), wait_for(SUMS), wait_for(SUMS, pending=1)

if SIMULATOR:
    copies_arrive = mbarrier_arrive     # (the simulator's copies have landed already)
else:
    from nanoandrea.kernels.ptx.tma import barrier_instruction

    copies_arrive = barrier_instruction("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [$0];")


@inlined
def start_block(tiles, out, a, full_arrivals, more_words):
    """The block's layout and work, its barriers made: (first, the stages' first word;
    barriers, full[s]'s word barriers + 2 s and empty[s]'s barriers + 2 (STAGES + s), 8 bytes
    each, after the stages and `more_words` of the kernel's own; tiles_m, items and slices,
    the tiles down m, all the tiles and a tile's K slices; this thread's group and its thread
    in it). full[s] completes at `full_arrivals` arrivals, empty[s] at the consumers' 2 x 128."""
    first = atom_start(tiles)
    barriers = first + STAGES * STAGE_WORDS + more_words
    M, N, K = out.shape[0], out.shape[1], 2 * a.shape[1]
    tiles_m = M // BM
    tid = int32(cuda.threadIdx.x)
    if tid == 0:
        for s in range(STAGES):
            mbarrier_init(tiles, barriers + 2 * s, full_arrivals)
            mbarrier_init(tiles, barriers + 2 * (STAGES + s), 2 * GROUP)
    cuda.syncthreads()
    return (first, barriers, tiles_m, tiles_m * (N // BN), K // BK, tid // GROUP,
            tid % GROUP)


@cuda.jit(**BOUNDS)
def wgmma_producer_kernel(out, a, b):
    # out[M,N] = a . b; grid: up to resident_blocks() blocks, each taking tiles blockIdx.x,
    # + grid, ... (down m first); block THREADS; dynamic shared STAGES x STAGE_WORDS from the
    # first 1024-byte boundary, then the barriers (start_block); full[s] counts the producer's
    # threads' copies
    tiles = dynamic_shared_words()
    first, barriers, tiles_m, items, slices, group, thread = start_block(tiles, out, a, GROUP, 0)
    if group == 0:
        n = int32(0)                            # the block's slice count, over its tiles
        for item in range(cuda.blockIdx.x, items, cuda.gridDim.x):
            m0, n0 = (item % tiles_m) * BM, (item // tiles_m) * BN
            for s in range(slices):
                stage = n % STAGES
                wait_phase(tiles, barriers + 2 * (STAGES + stage), ((n // STAGES) & 1) ^ 1)
                copy_slice(tiles, first + stage * STAGE_WORDS, a, b, m0, n0, s * BK, thread)
                copies_arrive(tiles, barriers + 2 * stage)
                n += 1
    else:
        consume(out, tiles, cuda.local.array(SUMS, float32), first, barriers, group, thread,
                tiles_m, items, slices, True)


@inlined
def consume(out, tiles, sums, first, barriers, group, thread, tiles_m, items, slices,
            generic_copies):
    """Consumer warpgroup `group` (1 or 2): its 64 rows of each of the block's tiles (see the
    module's doc), its sums in `sums`, each tile stored from its registers."""
    n = int32(0)                                # the block's slice count, over its tiles
    for item in range(cuda.blockIdx.x, items, cuda.gridDim.x):
        m0, n0 = (item % tiles_m) * BM, (item // tiles_m) * BN
        n = multiply_tile(tiles, sums, first, barriers, group, n, slices, generic_copies)
        store_tile(out, sums, m0 + (group - 1) * 64, n0, thread)


@inlined
def multiply_tile(tiles, sums, first, barriers, group, n, slices, generic_copies):
    """Consumer `group`'s sums of one tile, slices n .. n + slices - 1 of the block's count
    (returned: the count after them), each slice's stage released once its wgmma's are done.
    generic_copies: the stages were written through the generic proxy (cp.async), so a proxy
    fence comes between the wait and the wgmma's (TMA writes through the async proxy, as
    wgmma reads: v18 passes False)."""
    rows = (group - 1) * 64 * ROW_WORDS         # the consumer's 64 rows of a's slice
    for e in range(SUMS):
        sums[e] = float32(0.0)
    for s in range(slices):
        stage = n % STAGES
        wait_phase(tiles, barriers + 2 * stage, (n // STAGES) & 1)
        if generic_copies:
            fence_proxy_async()
        at = first + stage * STAGE_WORDS
        fence_sums(sums)
        for kk in range(BK // 16):              # a: 32 bytes on along its rows; b: 16 rows
            multiply(sums, tiles, at + rows + 8 * kk, tiles,
                     at + A_WORDS + 16 * kk * ROW_WORDS)
        wgmma_commit()
        wait_but_one(sums)                      # (slice n - 1's wgmma's are done)
        if s > 0:
            mbarrier_arrive(tiles, barriers + 2 * (STAGES + (n - 1) % STAGES))
        n += 1
    wait_all(sums)
    mbarrier_arrive(tiles, barriers + 2 * (STAGES + (n - 1) % STAGES))
    return n


@inlined
def store_tile(out, sums, row0, col0, thread):
    """out[row0:+64, col0:+256] = a consumer's sums, by wgmma's D layout (v12's, 32 groups of
    8 columns)."""
    warp, lane = thread // 32, thread % 32
    row = row0 + 16 * warp + lane // 4
    col = col0 + 2 * (lane % 4)
    for j in range(BN // 8):
        out[row, col + 8 * j], out[row, col + 8 * j + 1] = sums[4 * j], sums[4 * j + 1]
        out[row + 8, col + 8 * j], out[row + 8, col + 8 * j + 1] = (sums[4 * j + 2],
                                                                    sums[4 * j + 3])


@inlined
def copy_slice(tiles, stage, a, b, m0, n0, k0, thread):
    """The producer's copies of a[m0:+128, k0:+64] and b[k0:+64, n0:+256] into the stage at
    word `stage`, each 16-byte chunk at its swizzled place (v14's layout), started."""
    for r in range(A_COPIES):
        c = thread + r * GROUP
        i, q = c // 8, c % 8                       # a: row i, chunk q of its 64 k
        copy16_async(tiles, (stage + i * ROW_WORDS + 4 * (q ^ (i % 8)),),
                     a, (m0 + i, k0 // 2 + 4 * q), True)
    for r in range(B_COPIES):
        c = thread + r * GROUP
        k, q = c // 32, c % 32                     # b: row k, chunk q of its 256 n
        block, q8 = q // 8, q % 8
        copy16_async(tiles, (stage + A_WORDS + block * B_HALF_WORDS + k * ROW_WORDS
                             + 4 * (q8 ^ (k % 8)),),
                     b, (k0 + k, n0 // 2 + 4 * q), True)


def resident_blocks():
    """One block an SM (the simulator's one, taking every tile)."""
    return 1 if SIMULATOR else device.current().multiprocessors


def matmul(out, a, b):
    M, N = out.shape
    launch(wgmma_producer_kernel, min(resident_blocks(), (M // BM) * (N // BN)), THREADS, out,
           a, b, shared_bytes=4 * STAGES * STAGE_WORDS + ATOM_BYTES + 16 * STAGES)
