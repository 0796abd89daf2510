"""Copies with padded rows: a matrix whose rows are not whole 16-byte runs, made into one
whose rows are, and back.

    pad(out, x)                  out[R4, C4] = x[R, C] in the corner, zeros elsewhere
    unpad(out, x, accumulate)    out[R, C] (+)= x[:R, :C]

A row of an array [R, C] starts 16-byte aligned only if C is a multiple of 4 floats. The LM head
at GPT-2's vocabulary (V = 50257) has such rows in W, in the logits and in their gradient, and
there the blocked matmul must read and write 4 bytes at a time (0.70-0.77x cuBLAS, against
0.89-0.95x for the same product at V = 50304). matmul runs a large enough product of such
operands on padded copies instead (matmul.pads_unaligned says when): zeros in the padding add
nothing to a sum over k, and padded rows or columns of the output are dropped by unpad.

pad writes 4 floats at a time (one 16-byte store) and reads 4 bytes at a time, a thread per
chunk of 4 of the padded array; unpad moves 4 floats a thread, THREADS apart, each access
coalesced across a warp. Both keep 16 bytes a thread in flight.
"""
from numba import cuda, float32

from .launch import (ELEMENTWISE_MAX_BLOCKS, ELEMENTWISE_THREADS as THREADS, blocks, check,
                     check_float32, launch)
from .vector import aligned16, store4


def padded_length(n):
    """n rounded up to a multiple of 4 floats (a row of 16-byte runs)."""
    return -(-n // 4) * 4


MAX_BLOCKS = ELEMENTWISE_MAX_BLOCKS     # a grid of about as many blocks as stay resident,
                                       # each walking rows (grid-stride)


@cuda.jit
def pad_kernel(out, x):
    # out[R4, C4] = x[r, c] for r < R, c < C, else 0; out's rows 16-byte aligned, x any rows.
    # grid (chunks of a row / THREADS, some rows): a thread per 4 floats of out (one 16-byte
    # store, four 4-byte loads), no division per element
    R, C = x.shape
    R4, C4 = out.shape
    for r in range(cuda.blockIdx.y, R4, cuda.gridDim.y):
        for c in range(4 * cuda.grid(1), C4, 4 * cuda.gridsize(1)):
            inside = r < R
            x0 = x[r, c] if inside and c < C else float32(0.0)
            x1 = x[r, c + 1] if inside and c + 1 < C else float32(0.0)
            x2 = x[r, c + 2] if inside and c + 2 < C else float32(0.0)
            x3 = x[r, c + 3] if inside and c + 3 < C else float32(0.0)
            store4(out, (r, c), x0, x1, x2, x3)


@cuda.jit
def unpad_kernel(out, x, accumulate):
    # out[R, C] (+)= x[r, c] for r < R, c < C (x: [R4, C4]). grid (C / (4 THREADS), some rows):
    # a block takes 4 THREADS consecutive columns of a row, a thread 4 of them THREADS apart,
    # so that each of its 4 loads (all in flight at once) reads 128 consecutive bytes a warp
    R, C = out.shape
    for r in range(cuda.blockIdx.y, R, cuda.gridDim.y):
        for c in range(cuda.blockIdx.x * 4 * THREADS + cuda.threadIdx.x, C,
                       cuda.gridDim.x * 4 * THREADS):
            x0 = x[r, c]
            x1 = x[r, c + THREADS] if c + THREADS < C else float32(0.0)
            x2 = x[r, c + 2 * THREADS] if c + 2 * THREADS < C else float32(0.0)
            x3 = x[r, c + 3 * THREADS] if c + 3 * THREADS < C else float32(0.0)
            for e, value in enumerate((x0, x1, x2, x3)):
                column = c + e * THREADS
                if column < C:
                    if accumulate:
                        out[r, column] += value
                    else:
                        out[r, column] = value


def _as_matrix(name, x):
    check(len(x.shape) in (1, 2), f"{name}: a vector or a matrix, got {x.shape}")
    return x.reshape(1, x.shape[0]) if len(x.shape) == 1 else x


def _check_pad(name, padded, x, on_device=True):
    if on_device:
        check_float32(**{name: padded, "x": x})
    P, X = _as_matrix(name, padded), _as_matrix(name, x)
    check(P.shape[0] >= X.shape[0] and P.shape[1] >= X.shape[1] and P.shape[1] % 4 == 0,
          f"{name}: the padded array {padded.shape} must hold {x.shape}, rows of 4k floats")
    check(not on_device or aligned16(P), f"{name}: the padded array's rows must be 16-byte "
          "aligned")
    return P, X


def row_grid(rows, blocks_a_row):
    """(blocks_a_row, blocks down the rows): about MAX_BLOCKS blocks in all, which walk the rows
    grid-stride. unpad of the LM head's logits (6.6 GB moved), H200, 2026-11-29, session 7:
    four floats a thread with 4-byte stores 16 bytes apart across a warp, ~5 ms (run 3); a
    block per 256 elements, a float a thread, 3.2 million blocks, ~8 ms (run 4); this grid and
    unpad_kernel, ~4 ms (run 5), still about half of what a copy should take."""
    return blocks_a_row, max(1, min(rows, MAX_BLOCKS // blocks_a_row))


def pad(out, x):
    """out (a fresh, aligned array, rows padded to 4k floats) = x in its corner, zeros elsewhere;
    x and out both [rows, columns] or both vectors."""
    out, x = _check_pad("pad", out, x)
    launch(pad_kernel, row_grid(out.shape[0], blocks(out.shape[1] // 4, THREADS)), THREADS,
           out, x)


def unpad(out, x, accumulate=False):
    """out (+)= x's corner of out's shape (x: rows padded to 4k floats, aligned)."""
    x, out = _check_pad("unpad", x, out)
    launch(unpad_kernel, row_grid(out.shape[0], blocks(out.shape[1], 4 * THREADS)), THREADS,
           out, x, accumulate)


def pad_numpy(out, x):
    out, x = _check_pad("pad", out, x, on_device=False)
    out[...] = 0
    out[:x.shape[0], :x.shape[1]] = x


def unpad_numpy(out, x, accumulate=False):
    x, out = _check_pad("unpad", x, out, on_device=False)
    corner = x[:out.shape[0], :out.shape[1]]
    if accumulate:
        out += corner
    else:
        out[...] = corner
