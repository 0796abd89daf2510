"""Matrix operands in bf16 and tf32: a float32 x [R, C] rounded once, as the tensor cores read it.

    Bf16Matrix   `bf16_pairs` uint32 [R, P/2]: the values rounded to bf16 (to nearest, ties
                 to even), two in each 32-bit word, the lower index in the low half
                 (ptx/mma.py's layout); each row padded with zeros to P, C rounded up to 8
    Bf16Heads    `bf16_pairs` uint32 [B,H,T,D/2]: attention's heads [B,H,T,D] rounded to
                 bf16, two a word, contiguous (heads_bf16), so that a tile of them is a run of
                 whole 16-byte chunks
    Tf32Matrix   `values` float32 [R, P] (`tf32_bits` the same memory as uint32, one tf32 a
                 32-bit word): the values rounded to tf32 (float32 with the 13 low bits of its
                 mantissa zero: to nearest, ties away from zero, as cvt.rna.tf32.f32); P = C
                 rounded up to 4

Every copy a product kernel makes of such a row is then a whole, aligned 16 bytes, whatever C
is, and the pad's zeros add nothing to a sum. bf16 keeps float32's 8-bit exponent and 7 bits of
mantissa, tf32 10: a product of two is exact in float32 and the sums are float32, so a product
differs from the float32 one by the operands' rounding alone (about 2^-9 relative an operand
in bf16, 2^-11 in tf32), and neither needs loss scaling.

The backend's `operand(x)` makes one (round_bf16, round_tf32) where a product first reads x,
and the backward's products read the same copy. The weight matrices' bf16 copies are the
parameter store's, written by AdamW's kernel as it writes the weights (the bits round_bf16
makes of them: params.py, adamw.py). A product written in bf16 (the MLP's
pre-activation, GELU's output, their gradients) is a Bf16Matrix from the product's epilogue;
bf16_values makes its float32 values where something reads them after all.
"""
import numpy as np
from numba import cuda, float32

from .ptx.mma import (bf16_pair, bf16_unpair, pack_bf16, store4_u32, tf32_value, tf32_values,
                      unpack_bf16)
from .ptx.vector import aligned16, load4, store4
from .runtime.launch import blocks, check, check_float32, current_stream, launch


# --- bf16 ------------------------------------------------------------------------------------

class Bf16Matrix:
    """x [R, C] rounded to bf16, as the kernel reads it: `bf16_pairs` uint32 [R, P/2] (two
    values a 32-bit word, the lower index in the low half), P = C rounded up to 8, zeros from C
    to P. `shape` is x's."""
    __slots__ = ("bf16_pairs", "shape")

    def __init__(self, bf16_pairs, cols):
        self.bf16_pairs, self.shape = bf16_pairs, (bf16_pairs.shape[0], cols)

    @staticmethod
    def pairs_shape(shape):
        rows, cols = shape
        return rows, -(-cols // 8) * 4

    @classmethod
    def allocate(cls, shape, empty):
        """A new one, not yet rounded, for an x of `shape`: its bf16 pairs from
        empty(shape, dtype)."""
        return cls(empty(cls.pairs_shape(shape), np.uint32), shape[1])


def round_bf16_numpy(out, x):
    """out (a Bf16Matrix of x's shape) = x rounded to bf16 (to nearest, ties to even)."""
    rows, cols = x.shape
    padded = np.zeros((rows, 2 * out.bf16_pairs.shape[1]), np.float32)
    padded[:, :cols] = x
    out.bf16_pairs[...] = pack_bf16(padded)


def bf16_matrix_values(x):
    """What the tensor cores multiply: a Bf16Matrix's values, or a float32 x rounded."""
    if isinstance(x, Bf16Matrix):
        return unpack_bf16(np.asarray(x.bf16_pairs))[:, :x.shape[1]]
    rounded = Bf16Matrix(np.empty(Bf16Matrix.pairs_shape(x.shape), np.uint32), x.shape[1])
    round_bf16_numpy(rounded, np.asarray(x, np.float32))
    return bf16_matrix_values(rounded)


@cuda.jit
def round_bf16_kernel(pairs, x, whole_rows):
    # pairs[R, P/2] = x[R, C] in bf16 pairs, zeros past C; one thread 8 values (one 16-byte
    # store). whole_rows: x's rows are 16-byte aligned runs of 4 (then two 16-byte loads)
    chunks = pairs.shape[1] // 4
    c = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    row, first = c // chunks, 8 * (c % chunks)
    if row >= pairs.shape[0]:
        return
    cols = x.shape[1]
    v = cuda.local.array(8, float32)
    if whole_rows and first + 8 <= cols:
        v[0], v[1], v[2], v[3] = load4(x, (row, first))
        v[4], v[5], v[6], v[7] = load4(x, (row, first + 4))
    else:
        for e in range(8):
            v[e] = x[row, first + e] if first + e < cols else float32(0.0)
    store4_u32(pairs, (row, first // 2), bf16_pair(v[0], v[1]), bf16_pair(v[2], v[3]),
               bf16_pair(v[4], v[5]), bf16_pair(v[6], v[7]))


def round_bf16(out, x):
    """round_bf16_numpy on the GPU (out's bf16 pairs a device array)."""
    launch_rounding(round_bf16_kernel, out, out.bf16_pairs, x)


def bf16_values_numpy(out, x):
    """out [R, C] (float32) = the values of x, a Bf16Matrix of that shape."""
    out[...] = bf16_matrix_values(x)


@cuda.jit
def bf16_values_kernel(out, pairs):
    # out[R, C] = the values of pairs[R, P/2] (bf16 pairs) as float32s; a thread a pair
    c = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    row, col = c // pairs.shape[1], 2 * (c % pairs.shape[1])
    if row < out.shape[0] and col < out.shape[1]:
        x0, x1 = bf16_unpair(pairs[row, col >> 1])
        out[row, col] = x0
        if col + 1 < out.shape[1]:
            out[row, col + 1] = x1


def bf16_values(out, x):
    """bf16_values_numpy on the GPU: where a product's bf16 output (a GELU's, written as the
    next product's operand) is read as float32 after all."""
    check_float32(out=out)
    check(tuple(out.shape) == tuple(x.shape), f"bf16_values: out {out.shape}, x {x.shape}")
    launch(bf16_values_kernel, blocks(x.bf16_pairs.size, 128), 128, out, x.bf16_pairs)



def launch_rounding(kernel, out, copy, x):
    """Round x into `copy`, the array of the rounded operand `out` (Bf16Matrix, Tf32Matrix):
    one thread of `kernel` for each 16 bytes of it."""
    check_float32(x=x)
    check(tuple(out.shape) == tuple(x.shape), f"rounding: out {out.shape}, x {x.shape}")
    whole = x.shape[1] % 4 == 0 and aligned16(x)
    launch(kernel, blocks(copy.size // 4, 128), 128, copy, x, whole)


def rounded_bf16(x):
    """A new Bf16Matrix of the float32 device array x (what the backend's `operand` makes)."""
    check(len(x.shape) == 2, f"bf16 operands are 2-D, got {x.shape}")
    out = Bf16Matrix.allocate(x.shape, device_empty)
    round_bf16(out, x)
    return out


# --- bf16 heads: attention's q, k, v, dout ------------------------------------------------------

class Bf16Heads:
    """x [B,H,T,D] rounded to bf16, as the kernels here read it: `bf16_pairs` uint32
    [B,H,T,D/2] (two values a 32-bit word, contiguous); `shape` is x's. The model's attention
    rounds q, k and v once (heads_operand) and hands the same copies to the forward and to the
    backward."""
    __slots__ = ("bf16_pairs", "shape")

    def __init__(self, bf16_pairs):
        self.bf16_pairs = bf16_pairs
        self.shape = (*bf16_pairs.shape[:3], 2 * bf16_pairs.shape[3])


def heads_bf16(x):
    """x [B,H,T,D] (float32, 16-byte aligned rows, D % 8 == 0) rounded to bf16 pairs: a new
    Bf16Heads (a Bf16Heads is returned as it is)."""
    if isinstance(x, Bf16Heads):
        return x
    B, H, T, D = x.shape
    pairs = cuda.device_array((B, H, T, D // 2), np.uint32, stream=current_stream())
    launch(heads_bf16_kernel, blocks(B * H * T * D // 8, 128), 128, pairs, x)
    return Bf16Heads(pairs)


@cuda.jit
def heads_bf16_kernel(pairs, x):
    # pairs[B,H,T,D/2] = x[B,H,T,D] in bf16 pairs: a thread 8 values (two 16-byte loads, one
    # store)
    B, H, T, W = pairs.shape
    chunks = W // 4
    c = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if c >= B * H * T * chunks:
        return
    row, chunk = c // chunks, c % chunks
    b, h, i = row // (H * T), (row // T) % H, row % T
    x0, x1, x2, x3 = load4(x, (b, h, i, 8 * chunk))
    x4, x5, x6, x7 = load4(x, (b, h, i, 8 * chunk + 4))
    store4_u32(pairs, (b, h, i, 4 * chunk), bf16_pair(x0, x1), bf16_pair(x2, x3),
               bf16_pair(x4, x5), bf16_pair(x6, x7))


# --- tf32 ------------------------------------------------------------------------------------

class Tf32Matrix:
    """x [R, C] rounded to tf32, as the kernel reads it: `values` float32 [R, P], P = C rounded
    up to 4, zeros from C to P; `tf32_bits` the same memory as uint32, one tf32 a 32-bit word
    (what the kernel copies).
    `shape` is x's."""
    __slots__ = ("values", "tf32_bits", "shape")

    def __init__(self, values, cols):
        self.values, self.tf32_bits = values, values.view(np.uint32)
        self.shape = values.shape[0], cols

    @staticmethod
    def values_shape(shape):
        return shape[0], -(-shape[1] // 4) * 4

    @classmethod
    def allocate(cls, shape, empty):
        """A new one, not yet rounded, for an x of `shape`: its values from empty(shape, dtype)."""
        return cls(empty(cls.values_shape(shape), np.float32), shape[1])


def round_tf32_numpy(out, x):
    """out (a Tf32Matrix of x's shape) = x rounded to tf32 (to nearest, ties away from zero)."""
    out.values[...] = 0
    out.values[:, :x.shape[1]] = tf32_values(x)


def tf32_matrix_values(x):
    """What the tensor cores multiply: a Tf32Matrix's values, or a float32 x rounded."""
    if isinstance(x, Tf32Matrix):
        return np.asarray(x.values)[:, :x.shape[1]]
    return tf32_values(x)


@cuda.jit
def round_tf32_kernel(out, x, whole_rows):
    # out[R, P] = x[R, C] rounded to tf32, zeros past C; one thread 4 values (one 16-byte
    # store). whole_rows: x's rows are 16-byte aligned runs of 4 (then one 16-byte load)
    at = 4 * cuda.grid(1)               # the first of the thread's values, in out's order
    row, first = at // out.shape[1], at % out.shape[1]
    if row < out.shape[0]:
        cols = x.shape[1]
        if whole_rows and first + 4 <= cols:
            x0, x1, x2, x3 = load4(x, (row, first))
        else:                           # (the last of a row of another width)
            x0 = x[row, first] if first < cols else float32(0.0)
            x1 = x[row, first + 1] if first + 1 < cols else float32(0.0)
            x2 = x[row, first + 2] if first + 2 < cols else float32(0.0)
            x3 = x[row, first + 3] if first + 3 < cols else float32(0.0)
        store4(out, (row, first), tf32_value(x0), tf32_value(x1), tf32_value(x2),
               tf32_value(x3))


def round_tf32(out, x):
    """round_tf32_numpy on the GPU (out's values a device array)."""
    launch_rounding(round_tf32_kernel, out, out.values, x)


def rounded_tf32(x):
    """A new Tf32Matrix of the float32 device array x (what the backend's `operand` makes)."""
    check(len(x.shape) == 2, f"tf32 operands are 2-D, got {x.shape}")
    out = Tf32Matrix.allocate(x.shape, device_empty)
    round_tf32(out, x)
    return out


def device_empty(shape, dtype):
    return cuda.device_array(shape, dtype, stream=current_stream())
