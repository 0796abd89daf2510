"""Warp shuffles (shfl.sync, bar.warp.sync): the lanes of a warp exchanging values in registers.

    warp_sum(value)          the sum over the warp's 32 lanes, to every lane (a butterfly)
    group_sum(value, lanes)  the sum over each aligned group of `lanes` lanes
    quad_max, quad_sum       over the 4 lanes 4g .. 4g+3 that hold one row of an mma.sync
                             accumulator (mma.py's layout)
    pair_exchange(value)     the word of the neighbouring lane (lane ^ 1)
    warp_barrier()           the warp's lanes wait for each other (syncwarp)

Every lane adds the same numbers in the same order, so a sum is the same bits on every lane
and in every run. Under the simulator, which has no shuffles, the lanes meet in a list
(`warp_values`) and the same butterflies run over it.
"""
import threading

from numba import cuda, int32, uint32

from ..runtime.device import SIMULATOR
from ..runtime.launch import inlined

WARP = 32

if SIMULATOR:
    # The simulator has no shuffles: lanes meet in a list, with a barrier of the warp's 32
    # threads (each simulated GPU thread is a Python thread) before and after reading it.
    # A device function, so that `cuda` in it is the simulated one when a kernel of another
    # module calls it (the simulator swaps `cuda` in the globals of the kernel's module and of
    # each device function it calls).
    _warps = {}
    _warps_lock = threading.Lock()

    @cuda.jit(device=True)
    def warp_values(value):
        # (the 32 lanes' values, this lane): the lanes meet in a list
        index = cuda.threadIdx.x + cuda.blockDim.x * (cuda.threadIdx.y
                                                      + cuda.blockDim.y * cuda.threadIdx.z)
        warp, lane = divmod(index, WARP)
        with _warps_lock:
            slots, barrier = _warps.setdefault(
                (tuple(cuda.blockIdx), warp), ([None] * WARP, threading.Barrier(WARP, timeout=60)))
        slots[lane] = value
        barrier.wait()
        values = list(slots)
        barrier.wait()                  # (the slots may be refilled right after)
        return values, lane

    def _butterfly(values, lane, offset, combine):
        # the shuffles' butterfly from `offset` down to 1, in the same order as on the GPU
        while offset > 0:
            values = [combine(values[i], values[i ^ offset]) for i in range(WARP)]
            offset //= 2
        return values[lane]

    @cuda.jit(device=True)
    def warp_sum(value):
        values, lane = warp_values(value)
        return _butterfly(values, lane, WARP // 2, lambda x, y: x + y)

    def _quad(value, combine):
        # lanes 4g .. 4g+3 meet: xor 1, then xor 2, as the shuffles below
        values, lane = warp_values(value)
        for offset in (1, 2):
            values = [combine(values[i], values[i ^ offset]) for i in range(WARP)]
        return values[lane]

    @cuda.jit(device=True)
    def quad_max(value):
        return _quad(value, max)

    @cuda.jit(device=True)
    def quad_sum(value):
        return _quad(value, lambda x, y: x + y)

    @cuda.jit(device=True)
    def group_sum(value, lanes):
        values, lane = warp_values(value)
        return _butterfly(values, lane, lanes // 2, lambda x, y: x + y)

    @cuda.jit(device=True)
    def pair_exchange(value):
        values, lane = warp_values(value)
        return values[lane ^ 1]

    @cuda.jit(device=True)
    def warp_barrier():
        # no syncwarp in the simulator: the block's barrier, which is stronger (callers reach
        # warp_barrier with all the block's threads, as syncthreads asks)
        cuda.syncthreads()

else:
    @inlined
    def warp_barrier():
        # the 32 lanes of this warp wait for each other, and their shared-memory writes before
        # it are seen by all of them after it (bar.warp.sync): threads that exchange values only
        # within their warp need no block-wide syncthreads
        cuda.syncwarp(0xFFFFFFFF)


    @inlined
    def quad_max(value):
        # the max of `value` over the 4 lanes 4g .. 4g+3 (one row of an mma accumulator, in
        # ptx/mma.py's layout), to each of them
        value = max(value, cuda.shfl_xor_sync(0xFFFFFFFF, value, 1))
        return max(value, cuda.shfl_xor_sync(0xFFFFFFFF, value, 2))

    @inlined
    def group_sum(value, lanes):
        # the sum of `value` over each group of `lanes` consecutive lanes (a power of two, the
        # groups aligned: lanes 8g .. 8g+7 for 8), to each lane of the group: a butterfly of
        # shuffles from lanes / 2 down (all 32 lanes must call it), so every lane adds the same
        # numbers in one order
        offset = lanes // 2
        while offset > 0:
            value += cuda.shfl_xor_sync(0xFFFFFFFF, value, offset)
            offset //= 2
        return value

    @inlined
    def warp_sum(value):
        # the sum of `value` over the 32 lanes of this warp, to every lane
        return group_sum(value, WARP)

    @inlined
    def pair_exchange(value):
        # the value of the lane next to this one (lane ^ 1), a 32-bit word (all 32 lanes call it)
        return uint32(cuda.shfl_xor_sync(0xFFFFFFFF, int32(value), 1))

    @inlined
    def quad_sum(value):
        # likewise the sum, in the same order on every lane
        value += cuda.shfl_xor_sync(0xFFFFFFFF, value, 1)
        return value + cuda.shfl_xor_sync(0xFFFFFFFF, value, 2)
