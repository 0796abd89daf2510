"""GELU, in the tanh approximation GPT-2 uses.

    x, out: any shape (the MLP's hidden activations, [B,T,4C])
    gelu(x)  = 0.5 x (1 + tanh(u)),   u = sqrt(2/pi) (x + 0.044715 x^3)
    gelu'(x) = 0.5 (1 + tanh(u)) + 0.5 x (1 - tanh(u)^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)
"""
import math

import numpy as np
from numba import cuda, float32

from .elementwise import flat
from .launch import check_float32, elementwise_grid, launch

SQRT_2_OVER_PI = float32(math.sqrt(2.0 / math.pi))
CUBIC = float32(0.044715)


@cuda.jit
def gelu_forward_kernel(out, x):
    # out[n] = gelu(x[n]) over the flattened arrays; one thread per element
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        value = x[i]
        u = SQRT_2_OVER_PI * (value + CUBIC * value * value * value)
        out[i] = float32(0.5) * value * (float32(1.0) + math.tanh(u))


@cuda.jit
def gelu_backward_kernel(dx, dout, x, accumulate):
    # dx[n] (+)= dout[n] * gelu'(x[n])
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        value = x[i]
        u = SQRT_2_OVER_PI * (value + CUBIC * value * value * value)
        t = math.tanh(u)
        du = SQRT_2_OVER_PI * (float32(1.0) + float32(3.0) * CUBIC * value * value)
        grad = dout[i] * (float32(0.5) * (float32(1.0) + t)
                          + float32(0.5) * value * (float32(1.0) - t * t) * du)
        if accumulate:
            grad += dx[i]
        dx[i] = grad


def gelu_forward(out, x):
    check_float32(out=out, x=x)
    out, x = flat("gelu", out, x)
    launch(gelu_forward_kernel, *elementwise_grid(x.size), out, x)


def gelu_backward(dx, dout, x, accumulate=False):
    check_float32(dx=dx, dout=dout, x=x)
    dx, dout, x = flat("gelu backward", dx, dout, x)
    launch(gelu_backward_kernel, *elementwise_grid(x.size), dx, dout, x, accumulate)


def gelu_forward_numpy(out, x):
    flat("gelu", out, x)
    out[...] = 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x * x * x)))


def gelu_backward_numpy(dx, dout, x, accumulate=False):
    flat("gelu backward", dx, dout, x)
    t = np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x * x * x))      # x*x*x: far faster
    du = np.sqrt(2.0 / np.pi) * (1.0 + 3.0 * 0.044715 * x * x)           # than x**3 in float32
    grad = dout * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du)
    if accumulate:
        dx += grad
    else:
        dx[...] = grad
