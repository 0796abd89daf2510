"""v19 with registers moved from the producer to the consumers (setmaxnreg): no spills.
H100 2026-12-07: 0.70x cuBLAS bf16 at 16384x3072x768

    out[M,N] = a[M,K] @ b[K,N]     as v19

A block of 384 threads, one an SM, gets 65,536 / 384 = 168 registers a thread (the launch
bounds say so, and ptxas keeps to it). The consumers need more: 128 sums, the slice's
addresses, and in the epilogue the boxes' addresses, so ptxas spills the epilogue's values
to local memory (v19: 208 bytes stored and 376 loaded), and the warps wait on those loads
(Nsight Compute: 39% of v19's stalls are on the L1TEX scoreboard). The producer's one
working thread needs a few dozen. Hopper lets a warpgroup give registers back and take them
(setmaxnreg, sm_90a, every thread of the warpgroup together): the producer warpgroup drops
to 40 a thread, the consumers rise to 232, (40 + 2 x 232) x 128 = 64,512 of the 65,536. ptxas
allocates the code after each setmaxnreg within its count. Under the simulator they do
nothing. The rest is v19's.
"""
import numpy as np
from numba import cuda, float32, int32, uint64

from nanoandrea.kernels.ptx.sharedmem import dynamic_shared_floats
from nanoandrea.kernels.ptx.tma import (arrive_expect_tx, barrier_sync, box_load, box_store,
                                        bulk_commit, bulk_reads_done, bulk_wait_all,
                                        encode_tensor_map, mbarrier_arrive, mbarrier_init,
                                        registers_down, registers_up, tensormap_acquire,
                                        wait_phase)
from nanoandrea.kernels.ptx.wgmma import (ATOM_BYTES, K_MAJOR, MN_MAJOR, atom_start,
                                          dynamic_shared_words, fence_for, fence_proxy_async,
                                          wait_for, wgmma_commit, wgmma_m64nNk16)
from nanoandrea.kernels.runtime import device
from nanoandrea.kernels.runtime.launch import SIMULATOR, inlined, launch

PRECISION = "bf16"
MULTIPLE_OF = (128, 256, 64)
EXTRA_ARGUMENTS = (uint64[:, ::1],)             # the kernel's after (out, a, b): the maps
BM, BN, BK = 128, 256, 64       # block tile, K slice
ROW_WORDS = 32                  # a swizzled row: 128 bytes, 32 uint32 words (8 chunks of 4)
B_HALF_WORDS = BK * ROW_WORDS   # a block of 64 columns of b's slice: 64 rows (k) x 64 n, 8 KB
GROUP = 128                     # threads a warpgroup
THREADS = 3 * GROUP             # the producer, then two consumers of 64 rows each
STAGES = 4
A_WORDS = BM * ROW_WORDS        # a's slice: 128 rows (m) x 64 k                       16 KB
STAGE_WORDS = A_WORDS + 4 * B_HALF_WORDS    # then b's four blocks of 64 k x 64 n     48 KB
STAGE_BYTES = 4 * STAGE_WORDS                   # what a slice's five copies bring: 48 KB
SUMS = BN // 2                  # a consumer thread's float32s of its 64 x 256 (128)
BOX_COLUMNS, BOX_ROWS = 32, 64                  # a box of out: 32 float32s (128 bytes) x 64
BOX_WORDS = BOX_ROWS * BOX_COLUMNS              # 8 KB
OUT_WORDS = 2 * 2 * BOX_WORDS                   # the two consumers' two buffers each: 32 KB
BOUNDS = {} if SIMULATOR else dict(launch_bounds=(THREADS, 1))
multiply = wgmma_m64nNk16(BN, K_MAJOR, MN_MAJOR(4 * B_HALF_WORDS))
fence_sums, wait_all, wait_but_one = fence_for(SUMS), wait_for(SUMS), wait_for(SUMS, pending=1)

load_a, load_b = box_load(BM, True), box_load(BK, True)   # a's box: 128 rows of m; b's: 64 of k
store_box, bulk_wait_read_but_one = box_store(False), bulk_reads_done[1]


@cuda.jit(**BOUNDS)
def wgmma_registers_kernel(out, a, b, maps):
    # out[M,N] = a . b; maps: [3, 16] uint64, a's, b's and out's tensor maps; as v19's kernel,
    # each warpgroup's registers set first
    tiles = dynamic_shared_words()
    first, barriers, tiles_m, items, slices, group, thread = start_block(tiles, out, a, 1,
                                                                         OUT_WORDS)
    if group == 0:
        registers_down()
        if thread == 0:
            produce(tiles, a, b, maps, first, barriers, tiles_m, items, slices)
    else:
        registers_up()
        consume_by_boxes(out, tiles, maps, first, barriers, tiles_m, items, slices, group,
                         thread)


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


@inlined
def produce(tiles, a, b, maps, first, barriers, tiles_m, items, slices):
    """The producer's one thread: each slice of each of the block's tiles copied into its
    stage by TMA, once the stage's last slice is released (see the module's doc)."""
    n = int32(0)                                # the block's slice count, over its tiles
    tensormap_acquire(maps, 0)
    tensormap_acquire(maps, 1)
    for item in range(cuda.blockIdx.x, items, cuda.gridDim.x):
        m0, n0 = (item % tiles_m) * BM, (item // tiles_m) * BN
        for s in range(slices):
            stage = n % STAGES
            full = barriers + 2 * stage
            wait_phase(tiles, barriers + 2 * (STAGES + stage), ((n // STAGES) & 1) ^ 1)
            arrive_expect_tx(tiles, full, STAGE_BYTES)
            at = first + stage * STAGE_WORDS
            load_a(tiles, at, maps, 0, a, s * BK // 2, m0, 0, full)     # (columns in words:
            for j in range(BN // 64):                                 # a bf16 pair each)
                load_b(tiles, at + A_WORDS + j * B_HALF_WORDS, maps, 1, b, (n0 + 64 * j) // 2,
                       s * BK, 0, full)
            n += 1


@inlined
def consume_by_boxes(out, tiles, maps, first, barriers, tiles_m, items, slices, group, thread):
    """Consumer `group`'s 64 rows of each of the block's tiles, each tile stored by boxes."""
    values = dynamic_shared_floats()            # (the same shared memory, as float32s)
    buffers = first + STAGES * STAGE_WORDS + (group - 1) * 2 * BOX_WORDS
    sums = cuda.local.array(SUMS, float32)
    n = int32(0)                                # the block's slice count, over its tiles
    for item in range(cuda.blockIdx.x, items, cuda.gridDim.x):
        m0, n0 = (item % tiles_m) * BM, (item // tiles_m) * BN
        n = multiply_tile(tiles, sums, first, barriers, group, n, slices)
        store_by_boxes(values, buffers, maps, out, sums, m0 + (group - 1) * 64, n0, group,
                       thread)
    if thread == 0:
        bulk_wait_all()                         # (out's last boxes written)


@inlined
def store_by_boxes(values, buffers, maps, out, sums, row0, col0, group, thread):
    """out[row0:+64, col0:+256] = a consumer's sums, in 8 boxes of 32 columns through the
    consumer's two buffers. (One call a box, each with its number a constant: the sums are
    registers only while every index into them is a constant, and a loop over the boxes
    this long is not unrolled.)"""
    store_box_of(values, buffers, maps, out, sums, row0, col0, group, thread, 0)
    store_box_of(values, buffers, maps, out, sums, row0, col0, group, thread, 1)
    store_box_of(values, buffers, maps, out, sums, row0, col0, group, thread, 2)
    store_box_of(values, buffers, maps, out, sums, row0, col0, group, thread, 3)
    store_box_of(values, buffers, maps, out, sums, row0, col0, group, thread, 4)
    store_box_of(values, buffers, maps, out, sums, row0, col0, group, thread, 5)
    store_box_of(values, buffers, maps, out, sums, row0, col0, group, thread, 6)
    store_box_of(values, buffers, maps, out, sums, row0, col0, group, thread, 7)


@inlined
def store_box_of(values, buffers, maps, out, sums, row0, col0, group, thread, p):
    """Box p (columns 32 p .. 32 p + 31) of the consumer's 64 x 256: written into buffer p % 2
    once its last box has been read, then stored. wgmma's D layout: thread `thread` holds
    rows 16 warp + lane / 4 and 8 more, columns 8 j + 2 (lane % 4) and the next, in sums[4 j ..
    4 j + 3]."""
    warp, lane = thread // 32, thread % 32
    row = 16 * warp + lane // 4                 # in the box; and row + 8
    buffer = buffers + (p % 2) * BOX_WORDS
    if thread == 0:
        bulk_wait_read_but_one()                # (this buffer's last box has been read)
    barrier_sync(group, GROUP)
    for jj in range(BOX_COLUMNS // 8):
        j = 4 * p + jj                          # columns 8 j .. 8 j + 7 of the 256
        x = 8 * jj + 2 * (lane % 4)             # the thread's first column in the box
        chunk, within = x // 4, x % 4
        for h in range(2):
            r = row + 8 * h
            at = buffer + r * BOX_COLUMNS + 4 * (chunk ^ (r % 8)) + within
            values[at], values[at + 1] = sums[4 * j + 2 * h], sums[4 * j + 2 * h + 1]
    fence_proxy_async()                         # (the writes, seen by the copy engine)
    barrier_sync(group, GROUP)
    if thread == 0:
        store_box(values, buffer, maps, 2, out, col0 + BOX_COLUMNS * p, row0, 0)
        bulk_commit()


@inlined
def multiply_tile(tiles, sums, first, barriers, group, n, slices):
    """Consumer `group`'s sums of one tile, slices n .. n + slices - 1 of the block's count
    (returned: the count after them), each slice's stage released once its wgmma's are done.
    (No proxy fence after the wait, as v17's cp.async copies need: TMA writes through the
    async proxy, the one wgmma reads through.)"""
    rows = (group - 1) * 64 * ROW_WORDS         # the consumer's 64 rows of a's slice
    for e in range(SUMS):
        sums[e] = float32(0.0)
    for s in range(slices):
        stage = n % STAGES
        wait_phase(tiles, barriers + 2 * stage, (n // STAGES) & 1)
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


_maps = {}      # (a's, b's and out's addresses and shapes): their tensor maps on the device


def maps_of(out, a, b):
    """a's, b's and out's tensor maps, a [3, 16] uint64 device array, made once for the
    arrays' memory (v18's maps_of, with out's: boxes of 32 float32s x 64 rows)."""
    maps = np.zeros((3, 16), np.uint64)
    if SIMULATOR:                   # (the twins read and write the arrays: no maps)
        return cuda.to_device(maps)
    key = tuple((x.device_ctypes_pointer.value, x.shape) for x in (out, a, b))
    if key not in _maps:
        maps[0], maps[1] = encode_tensor_map(a, True, BM), encode_tensor_map(b, True, 64)
        maps[2] = encode_tensor_map(out, False, BOX_ROWS)
        _maps[key] = cuda.to_device(maps)
    return _maps[key]


def resident_blocks():
    """One block an SM (the simulator's one, taking every tile)."""
    return 1 if SIMULATOR else device.current().multiprocessors


def matmul(out, a, b):
    M, N = out.shape
    launch(wgmma_registers_kernel, min(resident_blocks(), (M // BM) * (N // BN)), THREADS, out,
           a, b, maps_of(out, a, b),
           shared_bytes=4 * (STAGES * STAGE_WORDS + OUT_WORDS) + ATOM_BYTES + 16 * STAGES)
