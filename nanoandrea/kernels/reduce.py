"""Reductions shared by the kernels that reduce along a row (or down columns), and sum_rows.

A block of threads (a power of two, at most MAX_THREADS) each holds one partial value; the
partials meet in shared memory and halve in a fixed tree (block_sum, block_max). A warp's 32
lanes meet in register shuffles instead (warp_sum). The fixed orders make every result
bit-for-bit reproducible: no atomics anywhere in nanoandrea's training step.
"""
import numpy as np
from numba import cuda, float32

from .ptx.mma import bf16_unpair, load4_u32, unpack_bf16
from .ptx.vector import aligned16, load4
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
#
# out[N] (+)= x[M, N] summed over its rows. The reference kernel (any N, any alignment) is the
# two stages above: a thread a column, 32 columns a block. The fast kernel, for rows of 8k
# columns 16-byte aligned (every bias gradient: the bf16 dY the products read, or float32),
# gives a thread 8 adjacent columns, one 16-byte load a row in bf16 (two in float32), so that a
# warp reads 512 bytes of a row at once where the reference's reads 64 (bf16) or 128; the
# block's SUM_THREADS_Y threads of a column group meet in shared memory, in a fixed order.
# Its partials [R, N] (a few hundred rows) are then summed by the same kernel as one chunk,
# into out: two launches, no atomics, reproducible to the bit.

@kernel_factory
def sum_rows_kernel(bf16_in=False):
    """The reference kernel of sum_rows; bf16_in: x is a Bf16Matrix's bf16 pairs [M, P/2]
    (column c the low half of 32-bit word c/2 for an even c, the high half for an odd one)."""

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


SUM_THREADS_X = 4 if SIMULATOR else 32      # threads along a row: 8 columns each
SUM_THREADS_Y = 2 if SIMULATOR else 16      # threads down the columns: a row each in turn
SUM_COLUMNS = 8 * SUM_THREADS_X             # a block's columns
SUM_BLOCKS_PER_SM = 2


@kernel_factory
def sum_rows8_kernel(bf16_in=False):
    """The fast kernel of sum_rows: 8 columns a thread (above); bf16_in: x is a Bf16Matrix's
    bf16 pairs [M, P/2], else float32 [M, N]."""

    @inlined
    def add_row(acc, x, row, col):
        # acc[0:8] += x[row, col : col + 8]: one 16-byte load of 4 bf16 pairs, or two of floats
        if bf16_in:
            w0, w1, w2, w3 = load4_u32(x, (row, col >> 1))
            a0, a1 = bf16_unpair(w0)
            a2, a3 = bf16_unpair(w1)
            a4, a5 = bf16_unpair(w2)
            a6, a7 = bf16_unpair(w3)
        else:
            a0, a1, a2, a3 = load4(x, (row, col))
            a4, a5, a6, a7 = load4(x, (row, col + 4))
        acc[0] += a0
        acc[1] += a1
        acc[2] += a2
        acc[3] += a3
        acc[4] += a4
        acc[5] += a5
        acc[6] += a6
        acc[7] += a7

    @cuda.jit
    def sum_rows8_kernel(partials, x, accumulate):
        # partials[R, N] (+)= the sums of the R chunks of x[M, N]'s rows (chunk r: blockIdx.y);
        # grid (N / SUM_COLUMNS, R), block (SUM_THREADS_X, SUM_THREADS_Y). Thread (tx, ty) adds
        # rows ty, ty + SUM_THREADS_Y, ... of its chunk at columns 8 tx .. 8 tx + 7; the block
        # then adds its SUM_THREADS_Y sums of each column in order, a thread a column
        sums = cuda.shared.array((SUM_THREADS_Y, SUM_COLUMNS), float32)
        acc = cuda.local.array(8, float32)
        tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
        M, N = x.shape[0], partials.shape[1]
        first, end = chunk_rows(M)
        block_col = cuda.blockIdx.x * SUM_COLUMNS
        col = block_col + 8 * tx
        for e in range(8):
            acc[e] = float32(0.0)
        if col < N:
            for row in range(first + ty, end, SUM_THREADS_Y):
                add_row(acc, x, row, col)
        for e in range(8):              # (column 8 tx + e at e * SUM_THREADS_X + tx: the
            sums[ty, e * SUM_THREADS_X + tx] = acc[e]       # threads of a warp, apart)
        cuda.syncthreads()
        for c in range(ty * SUM_THREADS_X + tx, SUM_COLUMNS, SUM_THREADS_X * SUM_THREADS_Y):
            if block_col + c < N:
                at = (c & 7) * SUM_THREADS_X + (c >> 3)
                total = float32(0.0)
                for y in range(SUM_THREADS_Y):
                    total += sums[y, at]
                if accumulate:
                    total += partials[cuda.blockIdx.y, block_col + c]
                partials[cuda.blockIdx.y, block_col + c] = total

    return sum_rows8_kernel


def sum_rows_chunks(rows, columns):
    """R for the fast kernel: SUM_BLOCKS_PER_SM blocks a multiprocessor, chunks of at least
    MIN_CHUNK_ROWS rows."""
    column_blocks = (columns + SUM_COLUMNS - 1) // SUM_COLUMNS
    wanted = (SUM_BLOCKS_PER_SM * device.current().multiprocessors + column_blocks - 1
              ) // column_blocks
    return max(1, min(wanted, rows // MIN_CHUNK_ROWS))


def takes_sum_rows8(x):
    """Whether the fast kernel takes x (float32, or a Bf16Matrix's pairs): rows of 8k columns,
    16-byte aligned."""
    return x.shape[1] % 8 == 0 and aligned16(getattr(x, "bf16_pairs", x))


def sum_rows(out, x, accumulate=False):
    """out[N] (+)= x[M,N] summed over its M rows. x: float32, or a Bf16Matrix (a gradient the
    products wrote in bf16: the MLP's pre-activation's), its values summed in float32."""
    bf16_in = hasattr(x, "bf16_pairs")
    check_float32(out=out, **({} if bf16_in else dict(x=x)))
    check(len(x.shape) == 2, f"sum_rows: x must be 2-D, got {x.shape}")
    check_shape("sum_rows out", out, (x.shape[1],))
    M, N = x.shape
    array = x.bf16_pairs if bf16_in else x
    if takes_sum_rows8(x):                  # (out is written a float at a time: any view)
        chunks = sum_rows_chunks(M, N)
        grid = (blocks(N, SUM_COLUMNS), chunks)
        if chunks == 1:
            launch(sum_rows8_kernel(bf16_in), grid, (SUM_THREADS_X, SUM_THREADS_Y),
                   out.reshape(1, N), array, accumulate)
            return
        partials = cuda.device_array((chunks, N), np.float32, stream=current_stream())
        launch(sum_rows8_kernel(bf16_in), grid, (SUM_THREADS_X, SUM_THREADS_Y), partials,
               array, False)
        launch(sum_rows8_kernel(False), (grid[0], 1), (SUM_THREADS_X, SUM_THREADS_Y),
               out.reshape(1, N), partials, accumulate)
        return
    partials = cuda.device_array((row_chunks(M, N), N), np.float32, stream=current_stream())
    launch(sum_rows_kernel(bf16_in), (blocks(N, COLUMNS), partials.shape[0]),
           (COLUMNS, ROW_GROUPS), partials, array)
    launch(finish_column_sums_kernel, *elementwise_grid(N), out, partials, accumulate)


def sum_rows_numpy(out, x, accumulate=False):
    if hasattr(x, "bf16_pairs"):                # (a Bf16Matrix's values)
        x = unpack_bf16(np.asarray(x.bf16_pairs))[:, :x.shape[1]]
    check_shape("sum_rows out", out, (x.shape[1],))
    if accumulate:
        out += x.sum(axis=0)
    else:
        out[...] = x.sum(axis=0)
