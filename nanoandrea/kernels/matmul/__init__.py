"""Matrix multiply: the family, and the one dispatch that chooses the kernel of each product.

    out[M,N]  (+)=  op(a)[M,K] . op(b)[K,N]  (+ bias[N])      op(x) = x or x^T

reference.py holds the math: the model's products, GELU's epilogues, `accumulate`, the NumPy
twins. The operands say the precision: float32 arrays, or copies rounded once to bf16 or tf32
(operands.py's Bf16Matrix, Tf32Matrix). `choose` picks the kernel:

    wgmma      bf16 operands on a GPU that runs wgmma (compute capability 9.0: the H100, the
               H200), out's rows a multiple of 8, every array 16-byte aligned: Hopper's
               warpgroup instruction fed by its copy engine, the fastest (wgmma.py)
    mma        every other bf16 product (the 8.x GPUs; other widths) and every tf32 one:
               mma.sync, from any GPU of compute capability 8.0 on (mma_sync.py)
    float32    float32 operands whose rows are whole 16-byte runs, on a GPU: the
               register-blocked SGEMM (float32.py)
    reference  other float32 products, and every float32 product in the simulator, where it
               is the quicker: 16 x 16 tiles, one thread an output (reference.py)

`kernel=` names one of them instead (the tests, the benchmark, the mma.sync kernels forced
on an H100). A product the kernels write in bf16 (out or GELU's array a Bf16Matrix: the MLP in
bf16 training) comes from wgmma's epilogue; where wgmma does not take it, the product runs in
float32 and is rounded after (through_float32). Products of few rows without gradients (a
sampled token's) are matvec.py's: ops.linear asks takes_matvec first.

The backend's functions (nanoandrea/backend.py), each with its NumPy twin in reference.py:
    matmul, matmul_bf16, matmul_tf32    a product in the backend's precision (the last two
                                        round float32 operands first)
    matmul_sum                          out (+)= the sum of op(a_j) . op(b_j) over pairs: the
                                        gradient of an input several products read (attention's
                                        q, k and v of one x); on wgmma in one pass
"""
from ..operands import Bf16Matrix, Tf32Matrix, bf16_values, device_empty, round_bf16
from ..operands import rounded_bf16, rounded_tf32
from ..gelu import gelu_forward
from ..ptx.vector import aligned16
from ..runtime.device import SIMULATOR
from ..runtime.launch import check
from . import float32, mma_sync, reference, wgmma
from .float32 import copies_b_transposed, transpose, transpose_numpy  # noqa: F401 (the backend's)
from .reference import (check_bf16_out, matmul_bf16_numpy, matmul_numpy,  # noqa: F401
                        matmul_tf32_numpy)

KERNELS = ("wgmma", "mma", "float32", "reference")


def choose(out, a, b, bias=None, gelu_array=None):
    """The kernel that takes this product (the module's doc); gelu_array: GELU's array, if any."""
    if isinstance(a, Tf32Matrix):
        return "mma"                            # (tf32: mma.sync alone)
    if isinstance(a, Bf16Matrix):
        # wgmma writes out and GELU's array both in float32 or both in bf16
        alike = gelu_array is None or isinstance(gelu_array, Bf16Matrix) == isinstance(out, Bf16Matrix)
        return "wgmma" if alike and wgmma.takes(out, bias, gelu_array, a, b) else "mma"
    rows_aligned = all(aligned16(x) for x in (out, a, b, bias, gelu_array) if x is not None)
    return "float32" if rows_aligned and not SIMULATOR else "reference"


def matmul(out, a, b, bias=None, transpose_a=False, transpose_b=False, accumulate=False,
           gelu_out=None, gelu_input=None, kernel="auto", b_transposed=None):
    """out[M,N] (+)= op(a) . op(b) (+ bias) by the kernel `choose` picks (or `kernel` names).
    gelu_out[M,N]: also gelu(out), the MLP's activation. gelu_input[M,N]: GELU's backward too:
    out (+)= gelu'(gelu_input) * (op(a) . op(b) + bias). b_transposed: with transpose_b, a copy
    of b^T made already (the float32 kernel's; the tensor-core kernels read b^T as it lies)."""
    gelu_array = gelu_out if gelu_out is not None else gelu_input
    if kernel == "auto":
        kernel = choose(out, a, b, bias, gelu_array)
    check(kernel in KERNELS, f"matmul: unknown kernel {kernel!r}: one of {', '.join(KERNELS)}")
    if kernel == "wgmma":
        wgmma.matmul_wgmma(out, a, b, bias, transpose_a, transpose_b, accumulate, gelu_out,
                           gelu_input)
    elif kernel == "mma" and (isinstance(out, Bf16Matrix) or isinstance(gelu_array, Bf16Matrix)):
        through_float32(out, a, b, bias, transpose_a, transpose_b, accumulate, gelu_out,
                        gelu_input)
    elif kernel == "mma":
        element = "tf32" if isinstance(a, Tf32Matrix) else "bf16"
        mma_sync.matmul_mma(out, a, b, bias, transpose_a, transpose_b, accumulate, gelu_out,
                            gelu_input, element)
    elif kernel == "float32":
        float32.matmul_float32(out, a, b, bias, transpose_a, transpose_b, accumulate, gelu_out,
                               gelu_input, b_transposed)
    else:
        reference.matmul_reference(out, a, b, bias, transpose_a, transpose_b, accumulate,
                                   gelu_out, gelu_input)


def matmul_bf16(out, a, b, bias=None, transpose_a=False, transpose_b=False, accumulate=False,
                gelu_out=None, gelu_input=None, b_transposed=None, kernel="auto"):
    """matmul of a and b rounded to bf16 (Bf16Matrix operands, or float32 device arrays rounded
    here). out, gelu_out and gelu_input may be Bf16Matrix's, as the twin says."""
    a, b = (x if isinstance(x, Bf16Matrix) else rounded_bf16(x) for x in (a, b))
    matmul(out, a, b, bias, transpose_a, transpose_b, accumulate, gelu_out, gelu_input,
           kernel=kernel)


def matmul_tf32(out, a, b, bias=None, transpose_a=False, transpose_b=False, accumulate=False,
                gelu_out=None, gelu_input=None, b_transposed=None, kernel="auto"):
    """matmul of a and b rounded to tf32 (Tf32Matrix operands, or float32 device arrays rounded
    here), on mma.sync."""
    a, b = (x if isinstance(x, Tf32Matrix) else rounded_tf32(x) for x in (a, b))
    matmul(out, a, b, bias, transpose_a, transpose_b, accumulate, gelu_out, gelu_input,
           kernel=kernel)


def through_float32(out, a, b, bias, transpose_a, transpose_b, accumulate, gelu_out,
                    gelu_input):
    """A product written in bf16 (out or GELU's array a Bf16Matrix) that no kernel's epilogue
    takes: the product in float32 by mma.sync (the kernel chosen or named: kernel="mma" on an
    H100 stays on it), then rounded (extra passes, on GPUs without wgmma)."""
    if isinstance(gelu_input, Bf16Matrix):
        values = device_empty(gelu_input.shape, "float32")
        bf16_values(values, gelu_input)
        gelu_input = values
    if not isinstance(out, Bf16Matrix):
        gelu_array = device_empty(out.shape, "float32") if gelu_out is not None else None
        matmul(out, a, b, bias, transpose_a, transpose_b, accumulate, gelu_array, gelu_input,
               kernel="mma")
        if gelu_array is not None:
            round_bf16(gelu_out, gelu_array)
        return
    check_bf16_out(accumulate, gelu_out)
    values = device_empty(out.shape, "float32")
    matmul(values, a, b, bias, transpose_a, transpose_b, False, None, gelu_input,
           kernel="mma")
    round_bf16(out, values)
    if gelu_out is not None:                            # GELU of out as rounded
        bf16_values(values, out)
        gelu_forward(values, values)
        round_bf16(gelu_out, values)


def matmul_sum(out, pairs, transpose_b=False, accumulate=False, b_transposed=None):
    """out (+)= op(a_0) . op(b_0) + op(a_1) . op(b_1) + ... for pairs [(a_j, b_j)] of one
    precision. On wgmma one pass over the pairs' K's, one after another (wgmma.matmul_wgmma's
    more_pairs): the sums stay in float32 registers, and out is written once where each
    product in turn would write it and the next read and write it again. Elsewhere one
    product after another, each after the first added to out. b_transposed: each pair's copy
    of b^T, or None."""
    if (all(isinstance(x, Bf16Matrix) for pair in pairs for x in pair) and wgmma.takes_pairs(pairs)
            and all(wgmma.takes(out, None, None, a, b) for a, b in pairs)):
        (a, b), *more = pairs
        wgmma.matmul_wgmma(out, a, b, transpose_b=transpose_b, accumulate=accumulate,
                           more_pairs=more)
        return
    for j, (a, b) in enumerate(pairs):
        matmul(out, a, b, transpose_b=transpose_b, accumulate=accumulate or j > 0,
               b_transposed=None if b_transposed is None else b_transposed[j])


def matmul_sum_numpy(out, pairs, transpose_b=False, accumulate=False, b_transposed=None):
    """matmul_sum's twin: one product after another, each by the twin of its operands'
    precision."""
    for j, (a, b) in enumerate(pairs):
        twin = (matmul_bf16_numpy if isinstance(a, Bf16Matrix) else
                matmul_tf32_numpy if isinstance(a, Tf32Matrix) else matmul_numpy)
        twin(out, a, b, transpose_b=transpose_b, accumulate=accumulate or j > 0)
