"""Block-wide reductions shared by the kernels that reduce along a row.

A block of threads (a power of two, at most MAX_THREADS) each holds one partial value; the
partials meet in shared memory and halve in a fixed tree. The fixed order makes every result
bit-for-bit reproducible: no atomics anywhere in nanoandrea's training step.
"""
from numba import cuda

from .launch import SIMULATOR

MAX_THREADS = 1024


@cuda.jit(device=True, inline="always")
def block_sum(value, scratch):
    # scratch: shared float32[MAX_THREADS]. Returns the sum of `value` over the block, to all.
    tid = cuda.threadIdx.x
    scratch[tid] = value
    cuda.syncthreads()
    stride = cuda.blockDim.x // 2
    while stride > 0:
        if tid < stride:
            scratch[tid] += scratch[tid + stride]
        cuda.syncthreads()
        stride //= 2
    total = scratch[0]
    cuda.syncthreads()          # scratch may be reused right after
    return total


@cuda.jit(device=True, inline="always")
def block_max(value, scratch):
    # scratch: shared float32[MAX_THREADS]. Returns the max of `value` over the block, to all.
    tid = cuda.threadIdx.x
    scratch[tid] = value
    cuda.syncthreads()
    stride = cuda.blockDim.x // 2
    while stride > 0:
        if tid < stride:
            scratch[tid] = max(scratch[tid], scratch[tid + stride])
        cuda.syncthreads()
        stride //= 2
    result = scratch[0]
    cuda.syncthreads()
    return result




# Column sums of a [rows, columns] matrix: a block of (COLUMNS, ROW_GROUPS) threads takes 32
# adjacent columns; thread (x, y) adds rows y, y+ROW_GROUPS, ... of column x (a warp reads 32
# consecutive floats of a row), then the ROW_GROUPS partials of each column meet in a tree.
COLUMNS = 32
ROW_GROUPS = 2 if SIMULATOR else 16


@cuda.jit(device=True, inline="always")
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
