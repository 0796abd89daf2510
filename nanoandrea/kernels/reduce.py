"""Reductions shared by the kernels that reduce along a row (or down columns), and sum_rows.

A block of threads (a power of two, at most MAX_THREADS) each holds one partial value; the
partials meet in shared memory and halve in a fixed tree (block_sum, block_max). A warp's 32
lanes meet in register shuffles instead (warp_sum). The fixed orders make every result
bit-for-bit reproducible: no atomics anywhere in nanoandrea's training step.
"""
import numpy as np
from numba import cuda, float32

from .ptx.mma import bf16_unpair, unpack_bf16
from .runtime import device
from .runtime.device import SIMULATOR
from .runtime.launch import (blocks, check, check_float32, check_shape, current_stream,
                             elementwise_grid, inlined, kernel_factory, launch)

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
    wanted = (4 * device.current().multiprocessors + column_blocks - 1) // column_blocks
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
def sum_rows_kernel(bf16_in=False):
    """The kernel of sum_rows; bf16_in: x is a Bf16Matrix's bf16 pairs [M, P/2] (column c the
    low half of 32-bit word c/2 for an even c, the high half for an odd one)."""

    @inlined
    def value(x, row, col):
        if bf16_in:
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
    bf16_in = hasattr(x, "bf16_pairs")
    check_float32(out=out, **({} if bf16_in else dict(x=x)))
    check(len(x.shape) == 2, f"sum_rows: x must be 2-D, got {x.shape}")
    check_shape("sum_rows out", out, (x.shape[1],))
    M, N = x.shape
    partials = cuda.device_array((row_chunks(M, N), N), np.float32, stream=current_stream())
    launch(sum_rows_kernel(bf16_in), (blocks(N, COLUMNS), partials.shape[0]),
           (COLUMNS, ROW_GROUPS), partials, x.bf16_pairs if bf16_in else x)
    launch(finish_column_sums_kernel, *elementwise_grid(N), out, partials, accumulate)


def sum_rows_numpy(out, x, accumulate=False):
    if hasattr(x, "bf16_pairs"):                # (a Bf16Matrix's values)
        x = unpack_bf16(np.asarray(x.bf16_pairs))[:, :x.shape[1]]
    check_shape("sum_rows out", out, (x.shape[1],))
    if accumulate:
        out += x.sum(axis=0)
    else:
        out[...] = x.sum(axis=0)
