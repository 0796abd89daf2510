"""Matrix multiply on the tensor cores in tf32: float32 operands rounded to tf32, float32 sums.

    out[M,N]  (+)=  op(a)[M,K] . op(b)[K,N]  (+ bias[N])      op(x) = x or x^T

matmul_bf16.py's function, arguments, epilogues and split-K, with each element of a and b
rounded to tf32 instead of bf16 before it is multiplied.

tf32 ("TensorFloat-32") is float32 with the 13 low bits of its 23-bit mantissa dropped: a sign,
float32's 8-bit exponent (the same range, so no loss scaling either) and 10 bits of mantissa,
3 more than bf16's 7. In memory it is a float32 whose 13 low bits are zero. Rounding to it is
cvt.rna.tf32.f32: to nearest, ties away from zero (a tie adds half a tf32 step to the
magnitude; not ties to even, as bf16's cvt.rn is); tensorcores.tf32_values is its NumPy twin,
exact to the bit. A product of two tf32 (11 significant bits each) is exact in float32 and the
sums are float32, so the result differs from the float32 product by the operands' rounding
alone: at most 2^-11 relative per operand, ~1e-3 at worst over a row, ~4x closer than bf16. On
the H200 a tf32 mma.sync runs at half bf16's rate (issue 26: 258-276 against 531-567 TFLOP/s
from registers) and the operands take twice the bytes: tf32 is the mode for a product that
wants float32's accuracy more nearly than bf16 gives it, at about half of bf16's speed.

The operands are Tf32Matrix: x [R, C] rounded once by round_tf32 (the backend's `operand`,
where a product first reads x), a float32 copy [R, P], each row padded with zeros to P, C
rounded up to 4, so that every copy the kernel makes is a whole, aligned 16 bytes.

The kernel is matmul_bf16's, mma_matmul_kernel(transpose_a, transpose_b, epilogue, "tf32"):
its block tile, pipeline, epilogue and split-K are the same, in 32-bit words, because the
fragments are. mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 (one warp, A [16,8] times
B [8,8] plus C [16,8]; g = lane // 4, t = lane % 4; PTX ISA, "mma.m16n8k8" fragments for .tf32):
    a0 = A[g, t]    a1 = A[g+8, t]    a2 = A[g, t+4]    a3 = A[g+8, t+4]
    b0 = B[t, g]    b1 = B[t+4, g]
    c0 = C[g, 2t]   c1 = C[g, 2t+1]   c2 = C[g+8, 2t]   c3 = C[g+8, 2t+1]      (D the same)
is word for word bf16's m16n8k16 layout (there each register holds 2 values along k), so a
slice is 16 words of k (16 tf32, two k8 steps) where bf16's is 16 words (32 bf16, two k16
steps), and the shared tiles, copies and swizzles are the same bytes. What differs:
  - an operand whose rows run along k (a[M,K], b[N,K]) gives its fragments through ldmatrix
    as in bf16: an 8 x 8 matrix of 16-bit values is 8 rows of 4 words, and lane l gets word
    l % 4 of row l // 4, which is a0 (b0) above;
  - a k-major operand (a[K,M] of dW = X^T dY, b[K,N] of the forward's X W) cannot: .trans
    moves 16-bit values, and would tear each tf32 in half. Its lanes read their fragments' words
    one by one (32-bit shared loads: 4 a tile of A, 2 of B, where ldmatrix.trans gives 4 words
    for 4 tiles). A warp's load of a0 reads rows k = t (4 rows) by m = g (8 consecutive words):
    with the tile's 16-byte chunk c of row r stored at c XOR 2 (r mod 4) (word_swizzle), the 4
    rows' 8 words fall in the 4 quarters of a bank line: 32 different banks, one pass.
The loads take the same shared-memory bandwidth as ldmatrix's (a word a lane, no conflict),
in four times the instructions, which tf32's mma at half rate leaves room for.

Under the CUDA simulator the block is matmul_bf16's 32 x 32, the same code.
"""
import numpy as np
from numba import cuda, float32

from .launch import check
from .matmul_bf16 import device_empty, launch_rounding, mma_matmul, product_of_values
from .tensorcores import tf32_value, tf32_values
from .vector import load4, store4


# --- tf32 operands ---------------------------------------------------------------------------

class Tf32Matrix:
    """x [R, C] rounded to tf32, as the kernel reads it: `values` float32 [R, P], P = C rounded
    up to 4, zeros from C to P; `words` the same memory as uint32 (what the kernel copies).
    `shape` is x's."""
    __slots__ = ("values", "words", "shape")

    def __init__(self, values, cols):
        self.values, self.words = values, values.view(np.uint32)
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


# --- the NumPy twin: the definition -------------------------------------------------------

def matmul_tf32_numpy(out, a, b, bias=None, transpose_a=False, transpose_b=False,
                      accumulate=False, gelu_out=None, gelu_input=None, b_transposed=None):
    """matmul_numpy of a and b rounded to tf32 (Tf32Matrix operands, or float32 ones rounded
    here), the sums in out's precision."""
    product_of_values(tf32_matrix_values, out, a, b, bias, transpose_a, transpose_b, accumulate,
                      gelu_out, gelu_input)


# --- the launcher ----------------------------------------------------------------------------

def matmul_tf32(out, a, b, bias=None, transpose_a=False, transpose_b=False, accumulate=False,
                gelu_out=None, gelu_input=None, b_transposed=None):
    """out[M,N] (+)= op(a) . op(b) (+ bias) of tf32 operands (Tf32Matrix; a float32 device
    array is rounded first): matmul.matmul's arguments and epilogues, on the tensor cores
    (b_transposed is not needed: the kernel reads either orientation)."""
    a, b = (x if isinstance(x, Tf32Matrix) else rounded(x) for x in (a, b))
    mma_matmul(out, a, b, bias, transpose_a, transpose_b, accumulate, gelu_out, gelu_input,
               "tf32")


def rounded(x):
    """A new Tf32Matrix of the float32 device array x (what the backend's `operand` makes)."""
    check(len(x.shape) == 2, f"matmul_tf32: operands are 2-D, got {x.shape}")
    out = Tf32Matrix.allocate(x.shape, device_empty)
    round_tf32(out, x)
    return out
