"""Dropout with a counter-based random number generator: no mask is stored.

    x, out: any shape, viewed flat [n];  seed: int64[1] (on the device, set once per step);
    site: an int naming the dropout site in the model (0, 1, 2, ...).

Element n of a site is kept when random_bits(seed, site, n) >= p * 2^32, and scaled by 1/(1-p).
The bits are a hash of (seed, site, n), so backward recomputes the same mask from the same
three numbers, a given seed always drops the same elements, and the GPU and NumPy versions
agree bit for bit (they run the same integer hash). The hash is Chris Wellons' "lowbias32"
32-bit mixer, applied three times; it is written once in plain Python (`mix32`) and compiled
for the GPU from that same source.

As in elementwise.py, a 4-wide kernel (16-byte loads and stores) runs when the arrays allow
it, and a one-element kernel otherwise.
"""
import numpy as np
from numba import cuda, float32

from .elementwise import flat, pick
from .ptx.vector import load4, store4
from .runtime.launch import check, check_float32, inlined, launch

MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9


def mix32(x):
    """lowbias32: a 32-bit integer hash with good avalanche (works on ints and int64 arrays)."""
    x = x & MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & MASK32
    x = x ^ (x >> 16)
    return x


mix32_device = inlined(mix32)


@inlined
def keep_scale(seed, site, n, threshold, scale):
    # the multiplier of element n: 0 (dropped) or 1/(1-p) (kept)
    key = mix32_device(seed + mix32_device(site))
    bits = mix32_device(((n * GOLDEN) & MASK32) ^ key)
    return scale if bits >= threshold else float32(0.0)


@cuda.jit
def dropout_forward_kernel(out, x, seed, site, threshold, scale):
    # out[n] = x[n] * keep(n) / (1 - p)
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        out[i] = x[i] * keep_scale(seed[0], site, i, threshold, scale)


@cuda.jit
def dropout_forward4_kernel(out, x, seed, site, threshold, scale):
    # out[n] = x[n] * keep(n) / (1 - p), 4 elements per thread and step
    s = seed[0]
    for i in range(4 * cuda.grid(1), x.size, 4 * cuda.gridsize(1)):
        x0, x1, x2, x3 = load4(x, (i,))
        store4(out, (i,), x0 * keep_scale(s, site, i, threshold, scale),
               x1 * keep_scale(s, site, i + 1, threshold, scale),
               x2 * keep_scale(s, site, i + 2, threshold, scale),
               x3 * keep_scale(s, site, i + 3, threshold, scale))


@cuda.jit
def dropout_backward_kernel(dx, dout, seed, site, threshold, scale, accumulate):
    # dx[n] (+)= dout[n] * keep(n) / (1 - p): the same mask, recomputed
    for i in range(cuda.grid(1), dout.size, cuda.gridsize(1)):
        value = dout[i] * keep_scale(seed[0], site, i, threshold, scale)
        if accumulate:
            value += dx[i]
        dx[i] = value


@cuda.jit
def dropout_backward4_kernel(dx, dout, seed, site, threshold, scale, accumulate):
    # dx[n] (+)= dout[n] * keep(n) / (1 - p), 4 elements per thread and step
    s = seed[0]
    for i in range(4 * cuda.grid(1), dout.size, 4 * cuda.gridsize(1)):
        d0, d1, d2, d3 = load4(dout, (i,))
        d0 *= keep_scale(s, site, i, threshold, scale)
        d1 *= keep_scale(s, site, i + 1, threshold, scale)
        d2 *= keep_scale(s, site, i + 2, threshold, scale)
        d3 *= keep_scale(s, site, i + 3, threshold, scale)
        if accumulate:
            p0, p1, p2, p3 = load4(dx, (i,))
            d0, d1, d2, d3 = d0 + p0, d1 + p1, d2 + p2, d3 + p3
        store4(dx, (i,), d0, d1, d2, d3)


def dropout_constants(p):
    """(threshold, keep): element kept when its 32 random bits >= threshold, then scaled by keep."""
    check(0.0 <= p < 1.0, f"dropout: p must be in [0, 1), got {p}")
    return np.int64(round(p * 2.0 ** 32)), np.float32(1.0 / (1.0 - p))


def dropout_forward(out, x, p, seed, site):
    check_float32(out=out, x=x)
    out, x = flat("dropout", out, x)
    threshold, scale = dropout_constants(p)
    launch(*pick(dropout_forward_kernel, dropout_forward4_kernel, out, x),
           out, x, seed, np.int64(site), threshold, scale)


def dropout_backward(dx, dout, p, seed, site, accumulate=False):
    check_float32(dx=dx, dout=dout)
    dx, dout = flat("dropout backward", dx, dout)
    threshold, scale = dropout_constants(p)
    launch(*pick(dropout_backward_kernel, dropout_backward4_kernel, dx, dout),
           dx, dout, seed, np.int64(site), threshold, scale, accumulate)


def keep_scale_numpy(shape, p, seed, site):
    """The mask times 1/(1-p), as an array of `shape` (what the kernels compute element-wise)."""
    threshold, scale = dropout_constants(p)
    n = np.arange(int(np.prod(shape)), dtype=np.int64)
    key = mix32(int(seed[0]) + mix32(int(site)))
    bits = mix32(((n * GOLDEN) & MASK32) ^ key)
    return np.where(bits >= threshold, scale, 0.0).reshape(shape)


def dropout_forward_numpy(out, x, p, seed, site):
    flat("dropout", out, x)
    out[...] = x * keep_scale_numpy(x.shape, p, seed, site).astype(x.dtype)


def dropout_backward_numpy(dx, dout, p, seed, site, accumulate=False):
    flat("dropout backward", dx, dout)
    value = dout * keep_scale_numpy(dout.shape, p, seed, site).astype(dout.dtype)
    if accumulate:
        dx += value
    else:
        dx[...] = value
