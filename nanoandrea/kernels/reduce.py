"""Block-wide reductions shared by the kernels that reduce along a row.

A block of threads (a power of two, at most MAX_THREADS) each holds one partial value; the
partials meet in shared memory and halve in a fixed tree. The fixed order makes every result
bit-for-bit reproducible: no atomics anywhere in nanoandrea's training step.
"""
from numba import cuda, float32

from .launch import SIMULATOR

MAX_THREADS = 1024


@cuda.jit(device=True, inline="always")
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


@cuda.jit(device=True, inline="always")
def block_sum(value, scratch):
    return block_reduce(value, scratch, False)


@cuda.jit(device=True, inline="always")
def block_max(value, scratch):
    return block_reduce(value, scratch, True)


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
    wanted = (4 * 132 + column_blocks - 1) // column_blocks
    return max(1, min(wanted, rows // MIN_CHUNK_ROWS))


@cuda.jit(device=True, inline="always")
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
