"""Small elementwise ops the graph needs: the residual add, gradient copy-or-add, fill, scale.

All arrays are viewed flat ([n]).
    add(out, a, b)                   out = a + b                  (the residual stream)
    add_into(out, x, accumulate)     out (+)= x                   (a gradient reaching a tensor)
    fill(out, value)                 out = value                  (zeroing gradient buffers)

They only move memory, so each has two kernels: a 4-wide one (one 16-byte load or store per
array for elements i..i+3, vector.load4/store4), used when `vectorizable` (every array 16-byte
aligned, n a multiple of 4: [B,T,C] activations always are), and a one-element fallback.
gelu.py and dropout.py follow the same pattern.
"""
import numpy as np
from numba import cuda

from .ptx.vector import aligned16, load4, store4
from .runtime.launch import check, check_float32, elementwise_grid, launch


def vectorizable(*arrays):
    """True when the 4-wide kernels may run on these flat arrays."""
    return all(aligned16(a) for a in arrays)


def pick(kernel, kernel4, *arrays):
    """(kernel, blocks, threads) for a grid-stride loop over flat arrays of n elements: kernel4
    over n/4 groups of 4 when they are vectorizable, else kernel over the n elements."""
    n = arrays[0].size
    if vectorizable(*arrays):
        return (kernel4, *elementwise_grid(n // 4))
    return (kernel, *elementwise_grid(n))


@cuda.jit
def add_kernel(out, a, b):
    # out[n] = a[n] + b[n]
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        out[i] = a[i] + b[i]


@cuda.jit
def add4_kernel(out, a, b):
    # out[n] = a[n] + b[n], 4 elements per thread and step
    for i in range(4 * cuda.grid(1), out.size, 4 * cuda.gridsize(1)):
        a0, a1, a2, a3 = load4(a, (i,))
        b0, b1, b2, b3 = load4(b, (i,))
        store4(out, (i,), a0 + b0, a1 + b1, a2 + b2, a3 + b3)


@cuda.jit
def add_into_kernel(out, x, accumulate):
    # out[n] (+)= x[n]
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        if accumulate:
            out[i] += x[i]
        else:
            out[i] = x[i]


@cuda.jit
def add_into4_kernel(out, x, accumulate):
    # out[n] (+)= x[n], 4 elements per thread and step
    for i in range(4 * cuda.grid(1), out.size, 4 * cuda.gridsize(1)):
        x0, x1, x2, x3 = load4(x, (i,))
        if accumulate:
            o0, o1, o2, o3 = load4(out, (i,))
            x0, x1, x2, x3 = o0 + x0, o1 + x1, o2 + x2, o3 + x3
        store4(out, (i,), x0, x1, x2, x3)


@cuda.jit
def fill_kernel(out, value):
    # out[n] = value
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        out[i] = value


@cuda.jit
def fill4_kernel(out, value):
    # out[n] = value, 4 elements per thread and step
    for i in range(4 * cuda.grid(1), out.size, 4 * cuda.gridsize(1)):
        store4(out, (i,), value, value, value, value)


def flat(name, *arrays):
    """The arrays as 1-D views, after checking they all have one shape."""
    check(all(a.shape == arrays[0].shape for a in arrays),
          f"{name}: shapes differ: " + ", ".join(str(a.shape) for a in arrays))
    return [a.reshape(a.size) for a in arrays]


def add(out, a, b):
    check_float32(out=out, a=a, b=b)
    out, a, b = flat("add", out, a, b)
    launch(*pick(add_kernel, add4_kernel, out, a, b), out, a, b)


def add_into(out, x, accumulate=False):
    check_float32(out=out, x=x)
    out, x = flat("add_into", out, x)
    launch(*pick(add_into_kernel, add_into4_kernel, out, x), out, x, accumulate)


def fill(out, value):
    check_float32(out=out)
    out, = flat("fill", out)
    launch(*pick(fill_kernel, fill4_kernel, out), out, np.float32(value))


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
