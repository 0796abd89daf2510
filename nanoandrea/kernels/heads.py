"""Split the fused projection into heads, and merge (concatenate) the heads back.

    split_heads:  x[B,T,C] -> view [B,T,H,D] -> transpose -> out[B,H,T,D]
    merge_heads:  x[B,H,T,D] -> transpose -> [B,T,H,D] -> view -> out[B,T,C]      (C = H*D)

Q = X.W_Q computes every head at once: head h is the column block Q[:, :, h*D:(h+1)*D].
split_heads moves each head's T x D slice into one contiguous block, because the attention
kernel reads a head's rows one after another. merge_heads is the exact inverse (the concat of
the heads), so each is the other's backward: the gradient of a permutation is the inverse
permutation. No arithmetic happens here, only data movement; one thread per element.
"""
from numba import cuda

from .launch import ELEMENTWISE_THREADS, blocks, check, check_float32, check_shape, launch



@cuda.jit
def split_heads_kernel(out, x, accumulate):
    # out[B,H,T,D] (+)= x[B,T,C] with C = H*D; grid (C/threads, T, B): a thread per element, the
    # threads of a block along C, so reads of x and writes of each head's row are coalesced.
    B, H, T, D = out.shape
    c = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    t = cuda.blockIdx.y
    b = cuda.blockIdx.z
    if c < H * D:
        h = c // D
        d = c - h * D
        value = x[b, t, c]
        if accumulate:
            value += out[b, h, t, d]
        out[b, h, t, d] = value


@cuda.jit
def merge_heads_kernel(out, x, accumulate):
    # out[B,T,C] (+)= x[B,H,T,D] concatenated over heads; grid (C/threads, T, B)
    B, H, T, D = x.shape
    c = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    t = cuda.blockIdx.y
    b = cuda.blockIdx.z
    if c < H * D:
        h = c // D
        d = c - h * D
        value = x[b, h, t, d]
        if accumulate:
            value += out[b, t, c]
        out[b, t, c] = value


def _grid(B, T, C):
    """(grid, block) of the head kernels: a block of threads along C, one per (t, b)."""
    threads = min(ELEMENTWISE_THREADS, blocks(C, 32) * 32)
    return (blocks(C, threads), T, B), threads


def _check_heads(heads, fused):
    check(len(heads.shape) == 4 and len(fused.shape) == 3,
          f"heads: expected [B,H,T,D] and [B,T,C], got {heads.shape} and {fused.shape}")
    B, H, T, D = heads.shape
    check_shape("heads: the fused tensor", fused, (B, T, H * D))


def split_heads(out, x, accumulate=False):
    """out[B,H,T,D] (+)= x[B,T,C] split into H heads of D = C/H."""
    check_float32(out=out, x=x)
    _check_heads(out, x)
    B, H, T, D = out.shape
    launch(split_heads_kernel, *_grid(B, T, H * D), out, x, accumulate)


def merge_heads(out, x, accumulate=False):
    """out[B,T,C] (+)= the heads of x[B,H,T,D] side by side."""
    check_float32(out=out, x=x)
    _check_heads(x, out)
    B, H, T, D = x.shape
    launch(merge_heads_kernel, *_grid(B, T, H * D), out, x, accumulate)


def split_heads_numpy(out, x, accumulate=False):
    _check_heads(out, x)
    B, H, T, D = out.shape
    heads = x.reshape(B, T, H, D).transpose(0, 2, 1, 3)
    if accumulate:
        out += heads
    else:
        out[...] = heads


def merge_heads_numpy(out, x, accumulate=False):
    _check_heads(x, out)
    B, H, T, D = x.shape
    fused = x.transpose(0, 2, 1, 3).reshape(B, T, H * D)
    if accumulate:
        out += fused
    else:
        out[...] = fused
