"""Small elementwise ops the graph needs: the residual add, gradient copy-or-add, fill, scale.

All arrays are viewed flat ([n]); one thread per element.
    add(out, a, b)                   out = a + b                  (the residual stream)
    add_into(out, x, accumulate)     out (+)= x                   (a gradient reaching a tensor)
    fill(out, value)                 out = value                  (zeroing gradient buffers)
"""
import numpy as np
from numba import cuda

from .launch import check, check_float32, elementwise_grid, launch



@cuda.jit
def add_kernel(out, a, b):
    # out[n] = a[n] + b[n]
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        out[i] = a[i] + b[i]


@cuda.jit
def add_into_kernel(out, x, accumulate):
    # out[n] (+)= x[n]
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        if accumulate:
            out[i] += x[i]
        else:
            out[i] = x[i]


@cuda.jit
def fill_kernel(out, value):
    # out[n] = value
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        out[i] = value


def flat(name, *arrays):
    """The arrays as 1-D views, after checking they all have one shape."""
    check(all(a.shape == arrays[0].shape for a in arrays),
          f"{name}: shapes differ: " + ", ".join(str(a.shape) for a in arrays))
    return [a.reshape(a.size) for a in arrays]


def add(out, a, b):
    check_float32(out=out, a=a, b=b)
    out, a, b = flat("add", out, a, b)
    launch(add_kernel, *elementwise_grid(out.size), out, a, b)


def add_into(out, x, accumulate=False):
    check_float32(out=out, x=x)
    out, x = flat("add_into", out, x)
    launch(add_into_kernel, *elementwise_grid(out.size), out, x, accumulate)


def fill(out, value):
    check_float32(out=out)
    out, = flat("fill", out)
    launch(fill_kernel, *elementwise_grid(out.size), out, np.float32(value))


def add_numpy(out, a, b):
    flat("add", out, a, b)
    np.add(a, b, out=out)


def add_into_numpy(out, x, accumulate=False):
    flat("add_into", out, x)
    if accumulate:
        out += x
    else:
        out[...] = x


def fill_numpy(out, value):
    out[...] = value
