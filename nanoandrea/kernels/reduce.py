"""Reductions shared by the kernels that reduce along a row (or down columns), and sum_rows.

A block of threads (a power of two, at most MAX_THREADS) each holds one partial value; the
partials meet in shared memory and halve in a fixed tree (block_sum, block_max). A warp's 32
lanes meet in register shuffles instead (warp_sum). The fixed orders make every result
bit-for-bit reproducible: no atomics anywhere in nanoandrea's training step.
"""
import threading

import numpy as np
from numba import cuda, float32, int32, uint32

from .launch import (MULTIPROCESSORS, SIMULATOR, blocks, check, check_float32, check_shape,
                     current_stream, elementwise_grid, inlined, kernel_factory, launch)

MAX_THREADS = 1024


@inlined
def block_reduce(value, scratch, take_max):
    # scratch: shared float32[MAX_THREADS]. Returns the sum (or, take_max, the max) of `value`
    # over the block, to every thread: the partials halve in a fixed tree.
    tid = cuda.threadIdx.x
    scratch[tid] = value
    cuda.syncthreads()
    stride = cuda.blockDim.x // 2
    while stride > 0:
        if tid < stride:
            other = scratch[tid + stride]
            scratch[tid] = max(scratch[tid], other) if take_max else scratch[tid] + other
        cuda.syncthreads()
        stride //= 2
    result = scratch[0]
    cuda.syncthreads()          # scratch may be reused right after
    return result


@inlined
def block_sum(value, scratch):
    return block_reduce(value, scratch, False)


@inlined
def block_max(value, scratch):
    return block_reduce(value, scratch, True)


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
        # tensorcores.py's layout), to each of them
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


# Column sums of a [rows, columns] matrix, in two deterministic stages:
#  1. grid (columns/32, R chunks of rows): a block of (COLUMNS, ROW_GROUPS) threads takes 32
#     adjacent columns of one chunk; thread (x, y) adds rows y, y+ROW_GROUPS, ... of column x
#     (a warp reads 32 consecutive floats of a row), the ROW_GROUPS partials meet in a tree
#     (column_partials_sum) and the block writes partials[chunk, column];
#  2. finish_column_sums_kernel adds the R partials of each column in order.
# R is chosen (row_chunks) so that a narrow matrix (C = 384 columns) still fills the GPU.
COLUMNS = 32
ROW_GROUPS = 2 if SIMULATOR else 16


MIN_CHUNK_ROWS = 8 if SIMULATOR else 64


def row_chunks(rows, columns):
    """R: enough blocks for ~4 per multiprocessor, chunks of at least MIN_CHUNK_ROWS rows."""
    column_blocks = (columns + COLUMNS - 1) // COLUMNS
    wanted = (4 * MULTIPROCESSORS + column_blocks - 1) // column_blocks
    return max(1, min(wanted, rows // MIN_CHUNK_ROWS))


@inlined
def chunk_rows(rows):
    # (first, end) rows of this block's chunk: blockIdx.y of gridDim.y chunks
    size = (rows + cuda.gridDim.y - 1) // cuda.gridDim.y
    first = cuda.blockIdx.y * size
    return first, min(rows, first + size)


@cuda.jit
def finish_column_sums_kernel(out, partials, accumulate):
    # out[N] (+)= sum over r of partials[R, N], r in order; one thread per column
    for col in range(cuda.grid(1), out.shape[0], cuda.gridsize(1)):
        total = float32(0.0)
        for r in range(partials.shape[0]):
            total += partials[r, col]
        if accumulate:
            total += out[col]
        out[col] = total


@inlined
def column_partials_sum(total, partial):
    # partial: shared float32[ROW_GROUPS, COLUMNS]. Returns the sum of `total` over threadIdx.y
    # (valid in the threads with threadIdx.y == 0).
    tx = cuda.threadIdx.x
    ty = cuda.threadIdx.y
    partial[ty, tx] = total
    cuda.syncthreads()
    stride = ROW_GROUPS // 2
    while stride > 0:
        if ty < stride:
            partial[ty, tx] += partial[ty + stride, tx]
        cuda.syncthreads()
        stride //= 2
    return partial[0, tx]


# --- sum over rows: the bias gradient (and the position-embedding gradient) ----------------

@kernel_factory
def sum_rows_kernel(words=False):
    """The kernel of sum_rows; words: x is a Bf16Matrix's words [M, P/2] (column c the low half
    of word c/2 for an even c, the high half for an odd one)."""
    from .tensorcores import bf16_unpair       # (here: tensorcores' simulator twin imports us)

    @inlined
    def value(x, row, col):
        if words:
            low, high = bf16_unpair(x[row, col >> 1])
            return high if col & 1 else low
        return x[row, col]

    @cuda.jit
    def sum_rows_kernel(partials, x):
        # partials[R, N]: partials[r] = sum of the r-th chunk of x[M, N]'s rows; grid (N/32, R),
        # block (32, ROW_GROUPS). Stage 1 of two (above); no atomics, so the sum is
        # reproducible.
        partial = cuda.shared.array((ROW_GROUPS, COLUMNS), float32)
        M, N = x.shape[0], partials.shape[1]
        first, end = chunk_rows(M)
        col = cuda.blockIdx.x * COLUMNS + cuda.threadIdx.x
        total = float32(0.0)
        if col < N:
            for row in range(first + cuda.threadIdx.y, end, ROW_GROUPS):
                total += value(x, row, col)
        total = column_partials_sum(total, partial)
        if cuda.threadIdx.y == 0 and col < N:
            partials[cuda.blockIdx.y, col] = total

    return sum_rows_kernel


def sum_rows(out, x, accumulate=False):
    """out[N] (+)= x[M,N] summed over its M rows. x: float32, or a Bf16Matrix (a gradient the
    products wrote in bf16: the MLP's pre-activation's), its values summed in float32."""
    words = hasattr(x, "words")
    check_float32(out=out, **({} if words else dict(x=x)))
    check(len(x.shape) == 2, f"sum_rows: x must be 2-D, got {x.shape}")
    check_shape("sum_rows out", out, (x.shape[1],))
    M, N = x.shape
    partials = cuda.device_array((row_chunks(M, N), N), np.float32, stream=current_stream())
    launch(sum_rows_kernel(words), (blocks(N, COLUMNS), partials.shape[0]),
           (COLUMNS, ROW_GROUPS), partials, x.words if words else x)
    launch(finish_column_sums_kernel, *elementwise_grid(N), out, partials, accumulate)


def sum_rows_numpy(out, x, accumulate=False):
    if hasattr(x, "words"):                     # (a Bf16Matrix's values)
        from .tensorcores import unpack_bf16
        x = unpack_bf16(np.asarray(x.words))[:, :x.shape[1]]
    check_shape("sum_rows out", out, (x.shape[1],))
    if accumulate:
        out += x.sum(axis=0)
    else:
        out[...] = x.sum(axis=0)
