"""v17 with the copies made by the tensor memory accelerator (TMA): one thread, five
instructions a slice.
H200 2026-12-03: 0.43x cuBLAS bf16 at 16384x3072x768 (0.254 ms), 0.69x at 16384x768x3072

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
twins and the maps' encoding are the package's now, nanoandrea/kernels/tma.py, whose maps
have a third dimension of one plane here.)
"""
import numpy as np
from numba import cuda, float32, int32, uint64

from nanoandrea.kernels.launch import MULTIPROCESSORS, SIMULATOR, inlined, launch
from nanoandrea.kernels.tma import (arrive_expect_tx, box_load, encode_tensor_map,
                                    tensormap_acquire)
from nanoandrea.kernels.wgmma import ATOM_BYTES, dynamic_shared_words
from v12_wgmma import B_HALF_WORDS, ROW_WORDS
from v17_wgmma_producer import (A_WORDS, BK, BM, BN, STAGE_WORDS, STAGES, SUMS, THREADS, consume,
                                start_block, wait_phase)

PRECISION = "bf16"
MULTIPLE_OF = (128, 256, 64)
STAGE_BYTES = 4 * STAGE_WORDS                   # what a slice's five copies bring: 48 KB
EXTRA_ARGUMENTS = (uint64[:, ::1],)             # the kernel's after (out, a, b): the maps
RESIDENT = 1 if SIMULATOR else MULTIPROCESSORS
BOUNDS = {} if SIMULATOR else dict(launch_bounds=(THREADS, 1))

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
                tiles_m, items, slices, False)


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


def matmul(out, a, b):
    M, N = out.shape
    launch(wgmma_tma_kernel, min(RESIDENT, (M // BM) * (N // BN)), THREADS, out, a, b,
           maps_of(a, b), shared_bytes=4 * STAGES * STAGE_WORDS + ATOM_BYTES + 16 * STAGES)
