"""GELU, in the tanh approximation GPT-2 uses.

    x, out: any shape (the MLP's hidden activations, [B,T,4C])
    gelu(x)  = 0.5 x (1 + tanh(u)),   u = sqrt(2/pi) (x + 0.044715 x^3)
    gelu'(x) = 0.5 (1 + tanh(u)) + 0.5 x (1 - tanh(u)^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)

The kernels use the same formulas with s = 0.5 (1 + tanh(u)) = 1 / (1 + exp(-2u)), the logistic
sigmoid of 2u (so 1 - tanh(u)^2 = 4 s (1 - s)):
    gelu(x)  = x s,      gelu'(x) = s + 2 x s (1 - s) sqrt(2/pi) (1 + 3 * 0.044715 x^2)
One exp and one division instead of tanh, and more accurate: 1 + tanh(u) cancels where gelu(x)
is tiny (x << 0) and 1 - tanh(u)^2 where tanh(u) is close to 1, while 1 + exp(-2u) does not and
1 - s = e s with e = exp(-2u). The NumPy twin uses the same form; tests/test_kernels.py checks
both element by element against float64. gelu_value_sfu and gelu_derivative_sfu are the same
formulas with exp and the division on the special-function unit (kernels/sfu.py) and their
constants folded: the bf16 products' epilogues, where a result is rounded to 8 bits of
mantissa.

The work is four bytes read and four written per element, so the kernels are bound by memory
bandwidth: when every array is 16-byte aligned and the size a multiple of 4 (always so for
[B,T,4C]), each thread moves 4 elements with one 16-byte load and store (vector.load4/store4);
otherwise the one-element kernels run (elementwise.pick chooses).
"""
import math

import numpy as np
from numba import cuda, float32

from .elementwise import flat, pick
from .ptx.sfu import exp2_fast, reciprocal_fast
from .ptx.vector import load4, store4
from .runtime.launch import check_float32, inlined, launch

SQRT_2_OVER_PI = float32(math.sqrt(2.0 / math.pi))
CUBIC = float32(0.044715)
# exp(88) = 1.65e38 still fits a float32; past it s < 6.1e-39, below the smallest normal float32,
# so the clamp costs no accuracy and keeps e finite: e s is never inf * 0 (and the simulator runs
# Python's math.exp, which raises where the GPU's would give inf).
EXP_LIMIT = float32(88.0)
EXP2_LIMIT = float32(88.0 / math.log(2.0))
# e^(-2u) = 2^t, t = -2u log2 e = x (EXPONENT + EXPONENT_CUBIC x^2); 2 du = SLOPE + SLOPE_CUBIC x^2
EXPONENT = float32(-2.0 / math.log(2.0) * math.sqrt(2.0 / math.pi))
EXPONENT_CUBIC = float32(-2.0 / math.log(2.0) * math.sqrt(2.0 / math.pi) * 0.044715)
SLOPE = float32(2.0 * math.sqrt(2.0 / math.pi))
SLOPE_CUBIC = float32(2.0 * math.sqrt(2.0 / math.pi) * 3 * 0.044715)


@inlined
def sigmoid_parts(x):
    # (s, e) for one x: e = exp(-2u), s = 1 / (1 + e) = 0.5 (1 + tanh(u))
    u = SQRT_2_OVER_PI * (x + CUBIC * x * x * x)
    e = math.exp(min(float32(-2.0) * u, EXP_LIMIT))
    return float32(1.0) / (float32(1.0) + e), e


@inlined
def sigmoid_parts_sfu(x):
    # sigmoid_parts on the special-function unit (kernels/sfu.py): e = 2^t, one MUFU.EX2 where
    # math.exp is ten instructions, and s by one MUFU.RCP where a division is a dozen. Each
    # errs by ~2^-22, 1/30,000 of bf16's rounding; past the clamp s flushes to 0. The
    # exponent t = -2u log2 e = x (EXPONENT + EXPONENT_CUBIC x^2), its constants folded: three
    # instructions, where -2 log2 e sqrt(2/pi) (x + 0.044715 x^3) as written is five
    # (float32's products are not reassociated for us)
    t = x * (EXPONENT + EXPONENT_CUBIC * (x * x))
    e = exp2_fast(min(t, EXP2_LIMIT))
    return reciprocal_fast(float32(1.0) + e), e


@inlined
def derivative_of_parts(x, s, e):
    # s + 2 x s (1 - s) du, with 1 - s = e s (no cancellation where s is close to 1)
    du = SQRT_2_OVER_PI * (float32(1.0) + float32(3.0) * CUBIC * x * x)
    return s + float32(2.0) * x * du * s * (e * s)


@inlined
def gelu_value(x):
    s, _ = sigmoid_parts(x)
    return x * s


@inlined
def gelu_derivative(x):
    s, e = sigmoid_parts(x)
    return derivative_of_parts(x, s, e)


@inlined
def gelu_value_sfu(x):
    # gelu(x) to ~2^-21: the tensor-core products' epilogues, whose results are rounded to bf16
    # or feed bf16 operands (matmul/mma_sync.py, matmul/wgmma.py); there the exact form's
    # instructions are a third of a tile's work
    s, _ = sigmoid_parts_sfu(x)
    return x * s


@inlined
def gelu_derivative_sfu(x):
    # derivative_of_parts with 2 du = SLOPE + SLOPE_CUBIC x^2 folded likewise
    s, e = sigmoid_parts_sfu(x)
    return s + x * (SLOPE + SLOPE_CUBIC * (x * x)) * s * (e * s)


@cuda.jit
def gelu_forward_kernel(out, x):
    # out[n] = gelu(x[n]) over the flattened arrays; one element per thread and step
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        out[i] = gelu_value(x[i])


@cuda.jit
def gelu_forward4_kernel(out, x):
    # out[n] = gelu(x[n]), n % 4 == 0 and 16-byte aligned: elements i..i+3 per thread and step
    for i in range(4 * cuda.grid(1), x.size, 4 * cuda.gridsize(1)):
        x0, x1, x2, x3 = load4(x, (i,))
        store4(out, (i,), gelu_value(x0), gelu_value(x1), gelu_value(x2), gelu_value(x3))


@cuda.jit
def gelu_backward_kernel(dx, dout, x, accumulate):
    # dx[n] (+)= dout[n] * gelu'(x[n]); one element per thread and step
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        grad = dout[i] * gelu_derivative(x[i])
        if accumulate:
            grad += dx[i]
        dx[i] = grad


@cuda.jit
def gelu_backward4_kernel(dx, dout, x, accumulate):
    # dx[n] (+)= dout[n] * gelu'(x[n]), n % 4 == 0 and 16-byte aligned: 4 elements per step
    for i in range(4 * cuda.grid(1), x.size, 4 * cuda.gridsize(1)):
        x0, x1, x2, x3 = load4(x, (i,))
        d0, d1, d2, d3 = load4(dout, (i,))
        g0, g1 = d0 * gelu_derivative(x0), d1 * gelu_derivative(x1)
        g2, g3 = d2 * gelu_derivative(x2), d3 * gelu_derivative(x3)
        if accumulate:
            p0, p1, p2, p3 = load4(dx, (i,))
            g0, g1, g2, g3 = g0 + p0, g1 + p1, g2 + p2, g3 + p3
        store4(dx, (i,), g0, g1, g2, g3)


def gelu_forward(out, x):
    check_float32(out=out, x=x)
    out, x = flat("gelu", out, x)
    launch(*pick(gelu_forward_kernel, gelu_forward4_kernel, out, x), out, x)


def gelu_backward(dx, dout, x, accumulate=False):
    check_float32(dx=dx, dout=dout, x=x)
    dx, dout, x = flat("gelu backward", dx, dout, x)
    launch(*pick(gelu_backward_kernel, gelu_backward4_kernel, dx, dout, x), dx, dout, x,
           accumulate)


def sigmoid_parts_numpy(x):
    """(s, e) of sigmoid_parts, element-wise, in x's dtype."""
    u = np.sqrt(2.0 / np.pi).astype(x.dtype) * (x + x.dtype.type(0.044715) * x * x * x)  # x*x*x:
    e = np.exp(np.minimum(-2 * u, EXP_LIMIT))                                # far faster than x**3
    return 1 / (1 + e), e


def gelu_forward_numpy(out, x):
    flat("gelu", out, x)
    s, _ = sigmoid_parts_numpy(x)
    out[...] = x * s


def gelu_backward_numpy(dx, dout, x, accumulate=False):
    flat("gelu backward", dx, dout, x)
    s, e = sigmoid_parts_numpy(x)
    du = np.sqrt(2.0 / np.pi).astype(x.dtype) * (1 + x.dtype.type(3 * 0.044715) * x * x)
    grad = dout * (s + 2 * x * du * s * (e * s))
    if accumulate:
        dx += grad
    else:
        dx[...] = grad
