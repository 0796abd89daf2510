"""v17 with the copies made by the tensor memory accelerator (TMA): one thread a slice.
H100 2026-12-07: 0.39x cuBLAS bf16 at 16384x3072x768

    out[M,N] = a[M,K] @ b[K,N]     as v17: a, b bf16 (uint32 pairs), out float32;
                                   M multiple of 128, N of 256, K of 64

v17's producer warpgroup issues a slice's 3,072 cp.async's, 24 a thread with their addressing,
and ran at 0.31x cuBLAS. Hopper copies a tile with one instruction: cp.async.bulk.tensor reads a
box of a 2-D tensor, described by a TENSOR MAP (its base, sizes, row stride, box size and
swizzle, 128 bytes the driver encodes: cuTensorMapEncodeTiled), and writes it into shared
memory in the 128-byte swizzle wgmma reads (chunk c of row r at c ^ r % 8, as the cp.async
versions placed it by hand). When its bytes have landed it counts them off the mbarrier it
names (complete_tx): the producer first tells the stage's `full` barrier how many bytes to
expect (mbarrier.arrive.expect_tx, 48 KB), and the phase completes when they all have. So
one thread of the producer warpgroup does all the copying: a's slice [128 m, 64 k] in one box,
b's [64 k, 256 n] in four boxes of 64 columns (a box's rows are at most 128 bytes under the
swizzle). The consumers are v17's, less its proxy fence a slice: the copy engine writes
through the async proxy, the one wgmma reads through.

The tensor maps are made on the host (ctypes into the CUDA driver) and copied to a small
device array the kernel reads them from (Numba passes no 128-byte structure by value, as a
__grid_constant__ parameter would be); the producer thread runs fence.proxy.tensormap's acquire
on each before its first copy, since the host wrote them through the generic proxy. Under the
simulator the tensor maps are not made: its twin of the copy reads the box from the operand
itself, swizzles it into place and counts its bytes off the barrier. (The instructions, their
twins and the maps' encoding are the package's now, nanoandrea/kernels/ptx/tma.py, whose maps
have a third dimension of one plane here.)
"""
import numpy as np
from numba import cuda, float32, int32, uint64

from nanoandrea.kernels.ptx.tma import (arrive_expect_tx, box_load, encode_tensor_map,
                                        mbarrier_arrive, mbarrier_init, tensormap_acquire,
                                        wait_phase)
from nanoandrea.kernels.ptx.wgmma import (ATOM_BYTES, K_MAJOR, MN_MAJOR, atom_start,
                                          dynamic_shared_words, fence_for, wait_for,
                                          wgmma_commit, wgmma_m64nNk16)
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
BOUNDS = {} if SIMULATOR else dict(launch_bounds=(THREADS, 1))
multiply = wgmma_m64nNk16(BN, K_MAJOR, MN_MAJOR(4 * B_HALF_WORDS))
fence_sums, wait_all, wait_but_one = fence_for(SUMS), wait_for(SUMS), wait_for(SUMS, pending=1)
load_a, load_b = box_load(BM, True), box_load(BK, True)   # a's box: 128 rows of m; b's: 64 of k


@cuda.jit(**BOUNDS)
def wgmma_tma_kernel(out, a, b, maps):
    # out[M,N] = a . b; maps: [2, 16] uint64, a's tensor map then b's; as v17 otherwise, but
    # full[s] waits for one arrival (the producer's, with the stage's bytes to expect)
    tiles = dynamic_shared_words()
    first, barriers, tiles_m, items, slices, group, thread = start_block(tiles, out, a, 1, 0)
    if group == 0 and thread == 0:
        produce(tiles, a, b, maps, first, barriers, tiles_m, items, slices)
    elif group > 0:
        consume(out, tiles, cuda.local.array(SUMS, float32), first, barriers, group, thread,
                tiles_m, items, slices)


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
def consume(out, tiles, sums, first, barriers, group, thread, tiles_m, items, slices):
    """Consumer warpgroup `group` (1 or 2): its 64 rows of each of the block's tiles (see the
    module's doc), its sums in `sums`, each tile stored from its registers."""
    n = int32(0)                                # the block's slice count, over its tiles
    for item in range(cuda.blockIdx.x, items, cuda.gridDim.x):
        m0, n0 = (item % tiles_m) * BM, (item // tiles_m) * BN
        n = multiply_tile(tiles, sums, first, barriers, group, n, slices)
        store_tile(out, sums, m0 + (group - 1) * 64, n0, thread)

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


_maps = {}      # (a's and b's addresses and shapes): their tensor maps on the device


def maps_of(a, b):
    """a's and b's tensor maps, a [2, 16] uint64 device array, made once for the operands'
    memory (a copy from the host at each call would wait for the GPU's queue)."""
    maps = np.zeros((2, 16), np.uint64)
    if SIMULATOR:                   # (its twin reads the operands: no maps)
        return cuda.to_device(maps)
    key = tuple((x.device_ctypes_pointer.value, x.shape) for x in (a, b))
    if key not in _maps:
        maps[0], maps[1] = encode_tensor_map(a, True, BM), encode_tensor_map(b, True, BK)
        _maps[key] = cuda.to_device(maps)
    return _maps[key]


def resident_blocks():
    """One block an SM (the simulator's one, taking every tile)."""
    return 1 if SIMULATOR else device.current().multiprocessors


def matmul(out, a, b):
    M, N = out.shape
    launch(wgmma_tma_kernel, min(resident_blocks(), (M // BM) * (N // BN)), THREADS, out, a, b,
           maps_of(a, b), shared_bytes=4 * STAGES * STAGE_WORDS + ATOM_BYTES + 16 * STAGES)
