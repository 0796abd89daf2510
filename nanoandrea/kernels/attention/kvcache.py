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

attention_cached is split over the keys (flash-decoding): a token's query against 1024 keys
is one (batch, head) of work, B x H blocks in all, too few to read the cache at the memory's
speed, and one block summing p_j v_j over a thousand keys in order waits for a thousand loads
one after another. So:
  attention_cached_kernel   grid (Tmax / CHUNK, Tq x H, B): a block takes CHUNK keys of one
                            query, WARPS warps of CHUNK / WARPS keys each. A warp's 32 lanes
                            split the head's D columns (a key's row is read by consecutive
                            lanes: coalesced); its score q . k_j meets in a butterfly of
                            shuffles (ptx/warp.warp_sum); each lane holds 4 of the columns, or
                            ceil(D / 32) past D = 128 (the kernel is made for the count: any D
                            is taken). The warp keeps the online softmax of its keys as the
                            flash attention forward does: the running max m, the sum l of
                            exp(s_j - m) and o = the sum of exp(s_j - m) v_j, both rescaled by
                            exp(m_old - m_new) when the max grows. The block's warps then meet
                            in shared memory, and it writes its chunk's (m, l) and o. Chunks
                            past the query's last key return at once: the grid does not depend
                            on start, so a captured decode step replays it unchanged.
  attention_combine_kernel  grid (Tq, H, B): the chunks of a query, in order: with M the
                            largest m_c, out = sum_c exp(m_c - M) o_c / sum_c exp(m_c - M) l_c.
Every sum runs in a fixed order: the same bits at every call.
"""
import math

import numpy as np
from numba import cuda, float32

from ..ptx.warp import WARP, warp_sum
from ..runtime.device import SIMULATOR
from ..runtime.launch import (blocks, check, check_float32, check_shape, current_stream,
                              kernel_factory, launch)

THREADS = 32 if SIMULATOR else 128      # kv_store's block
WARPS = 2 if SIMULATOR else 4           # attention_cached_kernel's block
CHUNK = 4 if SIMULATOR else 64          # keys a block: WARPS warps of CHUNK / WARPS keys
MAX_CHUNKS = 1024                       # (the combine's weights sit in shared memory)
COMBINE_THREADS = 32 if SIMULATOR else 64


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


def lane_columns(D):
    """A head's columns each lane of attention_cached's warps holds (lane, lane + 32, ...): 4
    up to D = 128, so that one kernel serves every usual head size; past it, ceil(D / 32)."""
    return max(4, -(-D // WARP))


@kernel_factory
def attention_cached_kernel(LANE_COLUMNS):
    """attention_cached's first pass for heads of up to 32 x LANE_COLUMNS dimensions."""
    D_MAX = WARP * LANE_COLUMNS

    @cuda.jit
    def attention_cached_kernel(m_l, partial, q, cache, start, scale):
        # grid (chunks, Tq * H, B), block WARPS * 32: chunk c's keys for query i of (b, h);
        # m_l [B,H,Tq,chunks,2] gets the chunk's (m, l), partial [B,H,Tq,chunks,D] its o
        B, H, Tq, D = q.shape
        c, b = cuda.blockIdx.x, cuda.blockIdx.z
        i, h = cuda.blockIdx.y // H, cuda.blockIdx.y % H
        first = c * CHUNK
        keys = start[0] + i + 1                 # query i sees keys 0 .. start + i
        if first >= keys:
            return
        warp_m = cuda.shared.array(WARPS, float32)
        warp_l = cuda.shared.array(WARPS, float32)
        warp_o = cuda.shared.array((WARPS, D_MAX), float32)
        warp, lane = cuda.threadIdx.x // WARP, cuda.threadIdx.x % WARP
        qs = cuda.local.array(LANE_COLUMNS, float32)    # q's columns lane, lane + 32, ...
        o = cuda.local.array(LANE_COLUMNS, float32)
        for r in range(LANE_COLUMNS):
            d = lane + WARP * r
            qs[r] = q[b, h, i, d] * scale if d < D else float32(0.0)
            o[r] = float32(0.0)
        m, l = float32(-math.inf), float32(0.0)
        for j in range(first + warp, min(keys, first + CHUNK), WARPS):
            dot = float32(0.0)
            for r in range(LANE_COLUMNS):
                d = lane + WARP * r
                if d < D:
                    dot += qs[r] * cache[0, b, h, j, d]
            s = warp_sum(dot)                   # (all lanes: j is the same across the warp)
            grown = max(m, s)
            rescale, p = math.exp(m - grown), math.exp(s - grown)
            l = l * rescale + p
            for r in range(LANE_COLUMNS):
                d = lane + WARP * r
                if d < D:
                    o[r] = o[r] * rescale + p * cache[1, b, h, j, d]
            m = grown
        if lane == 0:
            warp_m[warp], warp_l[warp] = m, l
        for r in range(LANE_COLUMNS):
            d = lane + WARP * r
            if d < D:
                warp_o[warp, d] = o[r]
        cuda.syncthreads()
        # the warps' softmaxes as one, in warp order (a warp without keys has m = -inf: weight 0)
        top = warp_m[0]
        for w in range(1, WARPS):
            top = max(top, warp_m[w])
        for d in range(cuda.threadIdx.x, D, cuda.blockDim.x):
            acc = float32(0.0)
            for w in range(WARPS):
                acc += math.exp(warp_m[w] - top) * warp_o[w, d]
            partial[b, h, i, c, d] = acc
        if cuda.threadIdx.x == 0:
            total = float32(0.0)
            for w in range(WARPS):
                total += math.exp(warp_m[w] - top) * warp_l[w]
            m_l[b, h, i, c, 0], m_l[b, h, i, c, 1] = top, total

    return attention_cached_kernel


@cuda.jit
def attention_combine_kernel(out, m_l, partial, start):
    # grid (Tq, H, B), block COMBINE_THREADS: out[b, i, h*D:(h+1)*D] from query i's chunks
    B, H, Tq, chunks, D = partial.shape
    i, h, b = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
    used = (start[0] + i + CHUNK) // CHUNK          # the chunks holding its start + i + 1 keys
    weight = cuda.shared.array(MAX_CHUNKS, float32)
    top = float32(-math.inf)
    for c in range(used):
        top = max(top, m_l[b, h, i, c, 0])
    for c in range(cuda.threadIdx.x, used, cuda.blockDim.x):
        weight[c] = math.exp(m_l[b, h, i, c, 0] - top)
    cuda.syncthreads()
    total = float32(0.0)
    for c in range(used):
        total += weight[c] * m_l[b, h, i, c, 1]
    inverse = float32(1.0) / total
    for d in range(cuda.threadIdx.x, D, cuda.blockDim.x):
        acc = float32(0.0)
        for c in range(used):
            acc += weight[c] * partial[b, h, i, c, d]
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
    chunks = blocks(cache.shape[3], CHUNK)
    check(chunks <= MAX_CHUNKS, f"attention_cached: {cache.shape[3]} positions (at most "
          f"{MAX_CHUNKS * CHUNK})")
    stream = current_stream()
    m_l = cuda.device_array((B, H, Tq, chunks, 2), np.float32, stream=stream)
    partial = cuda.device_array((B, H, Tq, chunks, D), np.float32, stream=stream)
    launch(attention_cached_kernel(lane_columns(D)), (chunks, Tq * H, B), WARPS * WARP, m_l,
           partial, q, cache, start, np.float32(1.0 / math.sqrt(D)))
    launch(attention_combine_kernel, (Tq, H, B), COMBINE_THREADS, out, m_l, partial, start)


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
