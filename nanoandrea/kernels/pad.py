"""Copies with padded rows: a matrix whose rows are not whole 16-byte runs, made into one
whose rows are, and back.

    pad(out, x)                  out[R4, C4] = x[R, C] in the corner, zeros elsewhere
    unpad(out, x, accumulate)    out[R, C] (+)= x[:R, :C]

A row of an array [R, C] starts 16-byte aligned only if C is a multiple of 4 floats. The LM head
at GPT-2's vocabulary (V = 50257) has such rows in W, in the logits and in their gradient, and
there the blocked matmul must read and write 4 bytes at a time (0.70-0.77x cuBLAS, against
0.89-0.95x for the same product at V = 50304). matmul runs a large enough product of such
operands on padded copies instead (matmul.pads_unaligned says when): zeros in the padding add
nothing to a sum over k, and padded rows or columns of the output are dropped by unpad (or,
with matmul's pad_unaligned="operands", the output is not copied and is stored 4 bytes at a
time: slower, the LM head's forward 0.80x cuBLAS against 0.82x padded, docs/perf.md v13).

One kernel does both: copy_corner_kernel writes every element of its output, from x where x
has one, zeros elsewhere. A thread moves 4 floats of a row, THREADS apart, so that each of its
4-byte loads and stores covers 128 consecutive bytes across a warp, and does so for two rows
at a time, all 8 loads in flight before the stores; the rows are walked grid-stride.
"""
from numba import cuda, float32

from .launch import (ELEMENTWISE_MAX_BLOCKS, ELEMENTWISE_THREADS as THREADS, blocks, check,
                     check_float32, inlined, launch)
from .vector import aligned16


def padded_length(n):
    """n rounded up to a multiple of 4 floats (a row of 16-byte runs)."""
    return -(-n // 4) * 4


MAX_BLOCKS = ELEMENTWISE_MAX_BLOCKS     # a grid of about as many blocks as stay resident,
                                       # each walking rows (grid-stride)
RUN = 4 * THREADS                       # the columns a block takes of a row


@inlined
def put(out_row, c, value, accumulate):
    if accumulate:
        out_row[c] += value
    else:
        out_row[c] = value


@inlined
def read_run(x, r, c):
    # x[r, c + {0, 1, 2, 3} * THREADS], zeros past x's rows and columns
    RX, CX = x.shape
    inside = r < RX                     # (rows past x's end read nothing)
    x_row = x[r if inside else 0]       # a row view: the row's address worked out once
    x0 = x_row[c] if inside and c < CX else float32(0.0)
    x1 = x_row[c + THREADS] if inside and c + THREADS < CX else float32(0.0)
    x2 = x_row[c + 2 * THREADS] if inside and c + 2 * THREADS < CX else float32(0.0)
    x3 = x_row[c + 3 * THREADS] if inside and c + 3 * THREADS < CX else float32(0.0)
    return x0, x1, x2, x3


@inlined
def write_run(out, r, c, values, accumulate):
    # out[r, c + {0, 1, 2, 3} * THREADS] (+)= values, those inside out's columns
    # (written out: a loop indexing the tuple made the old unpad's loop 427 instructions)
    C = out.shape[1]
    out_row = out[r]
    x0, x1, x2, x3 = values
    if c < C:
        put(out_row, c, x0, accumulate)
    if c + THREADS < C:
        put(out_row, c + THREADS, x1, accumulate)
    if c + 2 * THREADS < C:
        put(out_row, c + 2 * THREADS, x2, accumulate)
    if c + 3 * THREADS < C:
        put(out_row, c + 3 * THREADS, x3, accumulate)


@cuda.jit
def copy_corner_kernel(out, x, accumulate):
    # out[R, C] (+)= x[r, c] where r < RX and c < CX (x: [RX, CX]), else 0. grid (C / RUN, some
    # rows): a block takes RUN consecutive columns of a row (the grid covers a row: no loop over
    # columns), a thread 4 of them THREADS apart, in two rows gridDim.y apart at a time: 8
    # loads in flight before the stores; the rows grid-stride in a while loop.
    # (The first pad and unpad kernels walked the columns in a range loop inside the row loop,
    # whose trip count is a 64-bit division on every row, and unpad stored through a loop over
    # a tuple: loops of 346 and 427 instructions in SASS for a thread's 4 floats of a row, the
    # one-row kernel's 118 and 131 (sm_90, 2026-11-29). Timed alone, one row at a time (H200,
    # 2026-11-30, session 9): pad 2.70 ms (2.4 TB/s, torch's F.pad 3.0 ms), unpad 3.45 ms
    # (1.9 TB/s, torch's slice copy 2.3 ms): 4 loads of 4 bytes a thread in flight, 32 KB a
    # multiprocessor, about what the H200's bandwidth times its latency needs, hence two rows.
    # Two rows timed in session 11: 2.94 and 3.66 ms, no better; docs/perf.md v13.)
    R = out.shape[0]
    c = cuda.blockIdx.x * RUN + cuda.threadIdx.x
    r = cuda.blockIdx.y
    while r < R:
        second = r + cuda.gridDim.y     # (past R: x has no such row, nothing is stored)
        first_values = read_run(x, r, c)
        second_values = read_run(x, second, c)
        write_run(out, r, c, first_values, accumulate)
        if second < R:
            write_run(out, second, c, second_values, accumulate)
        r += 2 * cuda.gridDim.y


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


def copy_corner(out, x, accumulate):
    """out (+)= x's corner of out's shape, zeros where x has none (both matrices)."""
    rows, columns = out.shape
    blocks_a_row = blocks(columns, RUN)
    launch(copy_corner_kernel, (blocks_a_row, max(1, min(rows, MAX_BLOCKS // blocks_a_row))),
           THREADS, out, x, accumulate)


def pad(out, x):
    """out (a fresh, aligned array, rows padded to 4k floats) = x in its corner, zeros elsewhere;
    x and out both [rows, columns] or both vectors."""
    out, x = _check_pad("pad", out, x)
    copy_corner(out, x, False)


def unpad(out, x, accumulate=False):
    """out (+)= x's corner of out's shape (x: rows padded to 4k floats, aligned)."""
    x, out = _check_pad("unpad", x, out)
    copy_corner(out, x, accumulate)


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
