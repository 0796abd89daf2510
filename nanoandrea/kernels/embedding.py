"""Token + learned position embedding.

    idx  : int32 [B,T]  token ids        wte: [V,C] token table      wpe: [block_size,C] positions
    out  : [B,T,C]      out[b,t] = wte[idx[b,t]] + wpe[t]
Backward:
    dwte[v] += sum of dout[b,t] over the positions where idx[b,t] == v     (a scatter-add)
    dwpe[t] += sum over b of dout[b,t]

A token can occur many times in a batch, so the scatter-add must sum repeated ids. We do it
without atomics, so the result is bit-for-bit reproducible: `group_positions_by_token` sorts
the positions by token id on the host (the ids come from the host anyway), and the kernel gives
each distinct token one block that adds its positions' rows in that fixed order.
    token_order    : int32 [B*T]     positions (b*T + t) sorted by token id, stable
    segment_starts : int32 [U+1]     token_order[segment_starts[u]:segment_starts[u+1]] all hold
                                     the u-th distinct token (empty segments at the end pad it
                                     to a fixed size: they are skipped)
"""
import numpy as np
from numba import cuda, float32

from .runtime.device import SIMULATOR
from .runtime.launch import blocks, check, check_float32, check_shape, launch
from .reduce import sum_rows

THREADS = 32 if SIMULATOR else 128


@cuda.jit
def embedding_forward_kernel(out, idx, wte, wpe):
    # out[B,T,C] = wte[idx] + wpe[t]; grid (C/threads, T, B), one thread per element of out
    c = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    t = cuda.blockIdx.y
    b = cuda.blockIdx.z
    if c < out.shape[2]:
        out[b, t, c] = wte[idx[b, t], c] + wpe[t, c]


@cuda.jit
def embedding_token_grad_kernel(dwte, dout, idx, token_order, segment_starts):
    # dwte[V,C] += dout rows summed per token; grid (U, C/threads): block u owns token u
    B, T, C = dout.shape
    u = cuda.blockIdx.x
    c = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    start = segment_starts[u]
    end = segment_starts[u + 1]
    if c < C and start < end:           # padding segments (start == end == B*T) do nothing
        first = token_order[start]
        token = idx[first // T, first % T]
        total = float32(0.0)
        for s in range(start, end):
            position = token_order[s]
            total += dout[position // T, position % T, c]
        dwte[token, c] += total


def group_positions_by_token(idx, segments=None):
    """Host side: (token_order, segment_starts) for an int array of token ids (any shape).

    segments: pad segment_starts with empty segments to this many (segments + 1 entries), so
    its size, and the backward's grid, is the same for every batch (a CUDA graph replays one
    fixed grid); min(V, B*T) always suffices."""
    flat_ids = np.asarray(idx).reshape(-1)
    order = np.argsort(flat_ids, kind="stable").astype(np.int32)
    sorted_ids = flat_ids[order]
    boundaries = np.flatnonzero(sorted_ids[1:] != sorted_ids[:-1]) + 1
    starts = np.concatenate(([0], boundaries, [flat_ids.size])).astype(np.int32)
    if segments is not None:
        if segments < starts.size - 1:
            raise ValueError(f"{starts.size - 1} distinct tokens, more than {segments} segments")
        starts = np.concatenate((starts, np.full(segments + 1 - starts.size, flat_ids.size,
                                                 dtype=np.int32)))
    return order, starts


def _check(out, idx, wte, wpe):
    check(len(out.shape) == 3, f"embedding: out must be [B,T,C], got {out.shape}")
    B, T, C = out.shape
    check_shape("embedding idx", idx, (B, T))
    check_shape("embedding wte", wte, (None, C))
    check_shape("embedding wpe", wpe, (None, C))
    check(T <= wpe.shape[0], f"embedding: sequence length {T} exceeds the block size {wpe.shape[0]}")


def embedding_forward(out, idx, wte, wpe):
    check_float32(out=out, wte=wte, wpe=wpe)
    check(idx.dtype == np.int32, f"embedding: idx must be int32, got {idx.dtype}")
    _check(out, idx, wte, wpe)
    B, T, C = out.shape
    launch(embedding_forward_kernel, (blocks(C, THREADS), T, B), THREADS, out, idx, wte, wpe)


def embedding_backward(dwte, dwpe, dout, idx, token_order, segment_starts):
    """dwte, dwpe += the gradients (parameters' gradients always accumulate)."""
    check_float32(dwte=dwte, dwpe=dwpe, dout=dout)
    _check(dout, idx, dwte, dwpe)
    B, T, C = dout.shape
    check_shape("embedding token_order", token_order, (B * T,))
    segments = segment_starts.shape[0] - 1
    launch(embedding_token_grad_kernel, (segments, blocks(C, THREADS)), THREADS,
           dwte, dout, idx, token_order, segment_starts)
    sum_rows(dwpe[:T].reshape(T * C), dout.reshape(B, T * C), accumulate=True)


def embedding_forward_numpy(out, idx, wte, wpe):
    _check(out, idx, wte, wpe)
    out[...] = wte[idx] + wpe[: idx.shape[1]]


def embedding_backward_numpy(dwte, dwpe, dout, idx, token_order=None, segment_starts=None):
    _check(dout, idx, dwte, dwpe)
    B, T, C = dout.shape
    np.add.at(dwte, idx.reshape(-1), dout.reshape(B * T, C))
    dwpe[:T] += dout.sum(axis=0)
