"""Sampling with a key/value cache: each new token's attention against the keys and values of
every token before it, kept from the steps that made them.

    cache   [2, B, H, Tmax, D]   one layer's K (cache[0]) and V (cache[1]), all heads, the
                                 first `start` positions filled
    start   int32 [1]            the position of the first new token, on the device: a
                                 captured decode step (sample.py) reads it at every replay
    kv_store(cache, k, v, start)          cache[0][:, :, start:start+T] = k, likewise v
                                          (k, v [B,H,T,D]: the new tokens' heads)
    attention_cached(out, q, cache, start)  out[b, i, h*D:(h+1)*D] = softmax(q_i . K^T /
                                          sqrt(D)) V over the keys 0 .. start + i of (b, h),
                                          for the queries q [B,H,Tq,D] at positions start + i:
                                          causal, as the full forward's attention

A new token then costs O(T) (its one row of scores) instead of a forward over the whole
context. `out` is [B,Tq,C], the heads side by side (the concat of step 4): W_O reads it as it
is. No dropout: sampling only.

attention_cached_kernel: one block per (batch, head, query), all heads in one launch. The
block's threads take the keys in turn for the scores (a dot product of D each), find the
row's maximum and sum with a tree in shared memory, then take the D output columns, each
summing p_j v_j over the keys in order: one key's row of v is read by consecutive threads
(coalesced). The scores sit in dynamic shared memory, 4 bytes a key of the whole cache (a launch
that does not depend on start: the same for every token).
"""
import math

import numpy as np
from numba import cuda, float32

from .launch import SIMULATOR, blocks, check, check_float32, check_shape, launch
from .sharedmem import dynamic_shared_floats

THREADS = 32 if SIMULATOR else 128


# --- the NumPy twins ---------------------------------------------------------------------------

def kv_store_numpy(cache, k, v, start):
    T = k.shape[2]
    start = int(start[0])
    _check_store(cache, k, v, start)
    cache[0, :, :, start:start + T] = k
    cache[1, :, :, start:start + T] = v


def attention_cached_numpy(out, q, cache, start):
    B, H, Tq, D = q.shape
    end = int(start[0]) + Tq
    _check_attention(out, q, cache, end)
    keys, values = cache[0, :, :, :end], cache[1, :, :, :end]              # [B,H,end,D]
    scores = q @ np.swapaxes(keys, -1, -2) / math.sqrt(D)                   # [B,H,Tq,end]
    positions = end - Tq + np.arange(Tq)
    scores = np.where(np.arange(end)[None, :] <= positions[:, None], scores, -np.inf)
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    out[...] = np.swapaxes(p @ values, 1, 2).reshape(B, Tq, H * D)


# --- the kernels -----------------------------------------------------------------------------

@cuda.jit
def kv_store_kernel(cache, k, v, start):
    # cache[0/1, b, h, start + t, :] = k/v[b, h, t, :]; grid (D*T/threads, H, B)
    B, H, T, D = k.shape
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    h, b = cuda.blockIdx.y, cuda.blockIdx.z
    if i < T * D:
        t, d = i // D, i % D
        cache[0, b, h, start[0] + t, d] = k[b, h, t, d]
        cache[1, b, h, start[0] + t, d] = v[b, h, t, d]


@cuda.jit
def attention_cached_kernel(out, q, cache, start, scale):
    # grid (Tq, H, B), block THREADS; dynamic shared: Tmax floats of scores
    B, H, Tq, D = q.shape
    i, h, b = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
    tid = cuda.threadIdx.x
    scores = dynamic_shared_floats()
    tree = cuda.shared.array(THREADS, float32)
    keys = start[0] + i + 1                 # query i sees keys 0 .. start + i
    # the scores, and each thread's largest
    largest = float32(-math.inf)
    for j in range(tid, keys, THREADS):
        dot = float32(0.0)
        for d in range(D):
            dot += q[b, h, i, d] * cache[0, b, h, j, d]
        dot *= scale
        scores[j] = dot
        largest = max(largest, dot)
    tree[tid] = largest
    cuda.syncthreads()
    half = THREADS // 2
    while half > 0:                         # the row's maximum, to every thread
        if tid < half:
            tree[tid] = max(tree[tid], tree[tid + half])
        cuda.syncthreads()
        half //= 2
    row_max = tree[0]
    cuda.syncthreads()
    total = float32(0.0)
    for j in range(tid, keys, THREADS):
        e = math.exp(scores[j] - row_max)
        scores[j] = e
        total += e
    tree[tid] = total
    cuda.syncthreads()
    half = THREADS // 2
    while half > 0:                         # the row's sum
        if tid < half:
            tree[tid] += tree[tid + half]
        cuda.syncthreads()
        half //= 2
    inverse = float32(1.0) / tree[0]
    for d in range(tid, D, THREADS):        # out = p . V, column d
        acc = float32(0.0)
        for j in range(keys):
            acc += scores[j] * cache[1, b, h, j, d]
        out[b, i, h * D + d] = acc * inverse


# --- the launchers -----------------------------------------------------------------------------

def kv_store(cache, k, v, start):
    """(start: int32 [1] on the device; its value is not checked here, which would wait for
    the GPU: the caller's, sample.KVCache, is)"""
    check_float32(cache=cache, k=k, v=v)
    _check_store(cache, k, v, 0)
    B, H, T, D = k.shape
    launch(kv_store_kernel, (blocks(T * D, THREADS), H, B), THREADS, cache, k, v, start)


def attention_cached(out, q, cache, start):
    check_float32(out=out, q=q, cache=cache)
    B, H, Tq, D = q.shape
    _check_attention(out, q, cache, Tq)
    launch(attention_cached_kernel, (Tq, H, B), THREADS, out, q, cache, start,
           np.float32(1.0 / math.sqrt(D)), shared_bytes=4 * cache.shape[3])


def _check_store(cache, k, v, start):
    check(len(cache.shape) == 5 and cache.shape[0] == 2, f"kv cache: expected [2,B,H,Tmax,D], "
          f"got {cache.shape}")
    B, H, T, D = k.shape
    check_shape("kv cache v", v, k.shape)
    check(tuple(cache.shape[1:3]) == (B, H) and cache.shape[4] == D,
          f"kv cache {cache.shape} does not hold heads {k.shape}")
    check(0 <= start and start + T <= cache.shape[3],
          f"kv cache: positions {start}..{start + T - 1} beyond its {cache.shape[3]}")


def _check_attention(out, q, cache, end):
    B, H, Tq, D = q.shape
    check_shape("attention_cached out", out, (B, Tq, H * D))
    check(tuple(cache.shape[1:3]) == (B, H) and cache.shape[4] == D,
          f"kv cache {cache.shape} does not hold heads {q.shape}")
    check(Tq <= end <= cache.shape[3], f"attention_cached: end {end} for {Tq} queries and a "
          f"cache of {cache.shape[3]}")
