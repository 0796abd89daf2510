"""Causal softmax attention: the definition, the NumPy twins, the reference kernels (any head size).

    q, k, v, out : [B,H,T,D]      (after split_heads: each head's T x D slice is contiguous;
                                   the kernels take any strides whose rows are contiguous, so
                                   out, and backward's dq, dk, dv, may be heads_view's of the
                                   [B,T,C] concat: the store merges the heads)
    lse          : [B,H,T]        log-sum-exp of each row's scaled scores, saved for backward
    delta        : [B,H,T]        scratch of the backward: delta_i = dout_i . out_i

    S_ij = (q_i . k_j) / sqrt(D)  for j <= i   (causal: a position sees itself and the past)
    P_ij = exp(S_ij - lse_i)      lse_i = log sum_{j<=i} exp(S_ij)
    out_i = sum_j P_ij v_j

Backward (dout given), with delta_i = sum_j P_ij (dout_i . v_j) = dout_i . out_i:
    dv_j = sum_{i>=j} P_ij dout_i
    dS_ij = P_ij (dout_i . v_j - delta_i)
    dq_i = sum_{j<=i} dS_ij k_j / sqrt(D)        dk_j = sum_{i>=j} dS_ij q_i / sqrt(D)

Forward saves only lse (B*H*T floats), never the T x T matrix: backward recomputes P from it.

Dropout on the attention probabilities (as GPT-2 trains): out_i = sum_j P_ij G_ij v_j with
G_ij = 0 or 1/(1-p), a hash of (seed, site, ((b*H + h)*T + i)*T + j) - the counter-based
generator of kernels/dropout.py, so backward recomputes G instead of storing it. Then
    dv_j = sum_i P_ij G_ij dout_i,   dS_ij = P_ij (G_ij dout_i . v_j - delta_i),
and delta_i = dout_i . out_i still holds. `drop` = (seed int64[1], site, threshold, keep) as made
by dropout_arguments; threshold 0 means no dropout.

The kernels do not know about heads: a thread block takes one (batch, head) pair (and a range
of its rows), and the launch grid supplies the parallelism over all B*H. The reference kernels
give a warp to a row, its lanes splitting the row's D values: the forward and dq walk a query's
keys, dk/dv a key's queries, one pair at a time, a dot product a warp_sum. Readable, correct
for any D, and the fallback where no fast kernel takes the head size (72, or 384).
"""
import math

import numpy as np
from numba import cuda, float32

from ..dropout import dropout_constants, keep_scale, keep_scale_numpy
from ..operands import Bf16Heads
from ..ptx.mma import bf16_values, pack_bf16
from ..ptx.warp import WARP, warp_sum
from ..runtime.device import SIMULATOR
from ..runtime.launch import (blocks, check, check_float32, check_float32_rows, check_shape,
                              inlined, kernel_factory, launch)
from .tiles import NEG_INF


# --- NumPy twins: the definition -----------------------------------------------------------

def causal_probabilities(q, k, lse=None):
    """P [B,H,T,T] (causal softmax of the scaled scores) and lse [B,H,T]."""
    T, D = q.shape[-2:]
    scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(D)
    scores = np.where(np.tril(np.ones((T, T), dtype=bool)), scores, -np.inf)
    if lse is None:
        m = scores.max(axis=-1, keepdims=True)
        lse = (m + np.log(np.exp(scores - m).sum(axis=-1, keepdims=True)))[..., 0]
    return np.exp(scores - lse[..., None]), lse


def _dropout_factors(shape, dropout_p, seed, site):
    """G [B,H,T,T]: the same hash of (seed, site, flat index) as the kernels; 1 without dropout."""
    if dropout_p == 0.0:
        return 1.0
    return keep_scale_numpy(shape, dropout_p, seed, site)


def attention_forward_numpy(out, lse, q, k, v, dropout_p=0.0, seed=None, site=0, kernel="auto",
                            rows_per_block=None, out_bf16=None):
    """out_bf16: a Bf16Heads also written, out rounded to bf16 (as the tensor-core kernels
    write it)."""
    check_attention(q, k, v, out=out, lse=lse)
    p, lse[...] = causal_probabilities(q, k)
    out[...] = (p * _dropout_factors(p.shape, dropout_p, seed, site)) @ v
    if out_bf16 is not None:
        out_bf16.bf16_pairs[...] = pack_bf16(np.asarray(out, np.float32))


def attention_backward_numpy(dq, dk, dv, delta, dout, q, k, v, out, lse, accumulate=False,
                             dropout_p=0.0, seed=None, site=0, kernel="auto",
                             rows_per_block=None):
    check_attention(q, k, v, dq=dq, dk=dk, dv=dv, dout=dout, out=out, lse=lse, delta=delta)
    D = q.shape[-1]
    p, _ = causal_probabilities(q, k, lse)
    g = _dropout_factors(p.shape, dropout_p, seed, site)
    delta[...] = (dout * out).sum(axis=-1)
    ds = p * (g * (dout @ np.swapaxes(v, -1, -2)) - delta[..., None]) / np.sqrt(D)
    for grad, value in ((dq, ds @ k), (dk, np.swapaxes(ds, -1, -2) @ q),
                        (dv, np.swapaxes(p * g, -1, -2) @ dout)):
        if accumulate:
            grad += value
        else:
            grad[...] = value


def attention_forward_bf16_numpy(out, lse, q, k, v, dropout_p=0.0, seed=None, site=0,
                                 kernel="auto", rows_per_block=None, out_bf16=None):
    """attention_forward_numpy of q, k, v rounded to bf16 (the definition the tensor-core
    kernels meet within bf16's rounding of P)."""
    attention_forward_numpy(out, lse, *(_rounded(x) for x in (q, k, v)),
                                      dropout_p=dropout_p, seed=seed, site=site,
                                      out_bf16=out_bf16)


def attention_backward_bf16_numpy(dq, dk, dv, delta, dout, q, k, v, out, lse, accumulate=False,
                                  dropout_p=0.0, seed=None, site=0, kernel="auto",
                                  rows_per_block=None):
    """attention_backward_numpy of q, k, v and dout rounded to bf16. dq, dk, dv may be
    Bf16Heads (the tensor-core kernels' bf16 gradients): the float32 gradients rounded."""
    in_bf16 = [isinstance(x, Bf16Heads) for x in (dq, dk, dv)]
    check(not (any(in_bf16) and accumulate), "attention: gradients in bf16 are written, not "
          "added to")
    q, k, v, dout = (_rounded(x) for x in (q, k, v, dout))
    grads = [np.empty(x.shape, np.float32) if bf16 else x
             for x, bf16 in zip((dq, dk, dv), in_bf16)]
    attention_backward_numpy(*grads, delta, dout, q, k, v, out, lse, accumulate,
                             dropout_p=dropout_p, seed=seed, site=site)
    for target, values, bf16 in zip((dq, dk, dv), grads, in_bf16):
        if bf16:
            target.bf16_pairs[...] = pack_bf16(values)


def _rounded(x):
    return bf16_values(x).astype(x.dtype)


# --- reference kernels: any head size ------------------------------------------------------
#
# A warp per row: the 32 lanes split the row's D values, lane l holding d = l, l + 32, ...
# (LANE_DIMS = ceil(D / 32) of them, in registers), so a dot product of two rows is each
# lane's LANE_DIMS multiply-adds and one warp_sum, whatever D is. The forward and dq walk
# a query row's keys, dk and dv a key row's queries, one (i, j) pair at a time: no tiles and no
# shared memory, the math of the module's doc line by line, and fast enough to train with at
# a head size the fast kernels do not take (andrea-12m's width as 1 head of 384).
# In the simulator a row's "warp" is one thread (LANES = 1) holding the whole row: the same
# code, where each warp_sum would otherwise stop 32 Python threads at a barrier (50x slower).

LANES = 1 if SIMULATOR else WARP        # threads a row
ROW_WARPS = 4                           # rows a block


@inlined
def lanes_sum(value):
    # the sum over the row's lanes, to each of them
    return warp_sum(value) if LANES == WARP else value


@inlined
def dropout_factor(seed, site, threshold, keep, b, h, i, j, H, T):
    # G_ij of (batch b, head h): 1 without dropout, else 0 or 1/(1-p)
    if threshold == 0:
        return float32(1.0)
    return keep_scale(seed[0], site, ((b * H + h) * T + i) * T + j, threshold, keep)


@inlined
def no_dropout(seed, site, threshold, keep, b, h, i, j, H, T):
    # G_ij = 1: the fast kernels built for dropout_p = 0, where the hash and the branch around
    # it are not compiled in at all
    return float32(1.0)


def lane_dims(D):
    """The head dimensions each lane of a reference kernel's warp holds."""
    return -(-D // LANES)


def row_functions(LANE_DIMS):
    """load_row, warp_dot, add_row and store_row for rows of up to LANES x LANE_DIMS values."""

    @inlined
    def load_row(row, x, b, h, i, lane, scale):
        # row[n] = x[b, h, i, lane + 32 n] * scale, 0 past D
        for n in range(LANE_DIMS):
            d = lane + LANES * n
            row[n] = x[b, h, i, d] * scale if d < x.shape[3] else float32(0.0)

    @inlined
    def warp_dot(row, x, b, h, j, lane):
        # row . x[b, h, j, :], to every lane of the warp
        partial = float32(0.0)
        for n in range(LANE_DIMS):
            d = lane + LANES * n
            if d < x.shape[3]:
                partial += row[n] * x[b, h, j, d]
        return lanes_sum(partial)

    @inlined
    def add_row(acc, weight, x, b, h, j, lane):
        # acc += weight * x[b, h, j, :]
        for n in range(LANE_DIMS):
            d = lane + LANES * n
            if d < x.shape[3]:
                acc[n] += weight * x[b, h, j, d]

    @inlined
    def store_row(x, b, h, i, lane, row, accumulate):
        # x[b, h, i, :] (+)= row
        for n in range(LANE_DIMS):
            d = lane + LANES * n
            if d < x.shape[3]:
                x[b, h, i, d] = row[n] + (x[b, h, i, d] if accumulate else float32(0.0))

    return load_row, warp_dot, add_row, store_row


@inlined
def warp_row():
    # (b*H + h, r, lane) of grid (B*H, T/ROW_WARPS): warp r of the (batch, head)'s rows, with
    # nothing to do at r >= T (the whole warp: warp_sum needs all 32 lanes or none). The
    # kernels walking a query's keys take row i = T-1-r, the longest first, so that the last
    # blocks to start are the short ones
    return cuda.blockIdx.x, cuda.blockIdx.y * ROW_WARPS + cuda.threadIdx.x // LANES, \
        cuda.threadIdx.x % LANES


@kernel_factory
def reference_forward_kernel(LANE_DIMS):
    """The forward for heads of up to LANES x LANE_DIMS dimensions."""
    load_row, warp_dot, add_row, store_row = row_functions(LANE_DIMS)

    @cuda.jit
    def attention_forward_reference_kernel(out, lse, q, k, v, scale, seed, site, threshold,
                                           keep):
        # out[B,H,T,D], lse[B,H,T] from q, k, v [B,H,T,D]; a warp per query row i, its keys
        # j <= i in order, the softmax online: a running max m and sum l of exp(S - m), and
        # o = sum_j exp(S_ij - m) G_ij v_j, rescaled whenever m grows
        B, H, T, D = q.shape
        bh, r, lane = warp_row()
        if r >= T:
            return
        i = T - 1 - r
        b, h = bh // H, bh % H
        q_row = cuda.local.array(LANE_DIMS, float32)
        o = cuda.local.array(LANE_DIMS, float32)
        load_row(q_row, q, b, h, i, lane, scale)
        for n in range(LANE_DIMS):
            o[n] = float32(0.0)
        m, l = NEG_INF, float32(0.0)
        for j in range(i + 1):
            s = warp_dot(q_row, k, b, h, j, lane)
            m_new = max(m, s)
            rescale, p = math.exp(m - m_new), math.exp(s - m_new)
            l = l * rescale + p
            for n in range(LANE_DIMS):
                o[n] *= rescale
            add_row(o, p * dropout_factor(seed, site, threshold, keep, b, h, i, j, H, T), v, b,
                    h, j, lane)
            m = m_new
        for n in range(LANE_DIMS):
            o[n] /= l
        store_row(out, b, h, i, lane, o, False)
        if lane == 0:
            lse[b, h, i] = m + math.log(l)

    return attention_forward_reference_kernel


@kernel_factory
def reference_dq_kernel(LANE_DIMS):
    """dq and delta (which dk/dv reads), for heads of up to LANES x LANE_DIMS dimensions."""
    load_row, warp_dot, add_row, store_row = row_functions(LANE_DIMS)

    @cuda.jit
    def attention_dq_reference_kernel(dq, delta, dout, q, k, v, out, lse, scale, seed, site,
                                      threshold, keep, accumulate):
        # dq [B,H,T,D] (+)= sum_{j<=i} dS_ij k_j / sqrt(D), delta[B,H,T] = dout_i . out_i; a
        # warp per query row i
        B, H, T, D = q.shape
        bh, r, lane = warp_row()
        if r >= T:
            return
        i = T - 1 - r
        b, h = bh // H, bh % H
        q_row = cuda.local.array(LANE_DIMS, float32)
        g_row = cuda.local.array(LANE_DIMS, float32)
        acc = cuda.local.array(LANE_DIMS, float32)
        load_row(q_row, q, b, h, i, lane, scale)
        load_row(g_row, dout, b, h, i, lane, float32(1.0))
        for n in range(LANE_DIMS):
            acc[n] = float32(0.0)
        row_delta = warp_dot(g_row, out, b, h, i, lane)
        row_lse = lse[b, h, i]
        for j in range(i + 1):
            p = math.exp(warp_dot(q_row, k, b, h, j, lane) - row_lse)
            g = dropout_factor(seed, site, threshold, keep, b, h, i, j, H, T)
            add_row(acc, p * (g * warp_dot(g_row, v, b, h, j, lane) - row_delta) * scale, k,
                    b, h, j, lane)
        store_row(dq, b, h, i, lane, acc, accumulate)
        if lane == 0:
            delta[b, h, i] = row_delta

    return attention_dq_reference_kernel


@kernel_factory
def reference_dkdv_kernel(LANE_DIMS):
    """dk and dv, after reference_dq_kernel (its delta), for heads of up to LANES x LANE_DIMS
    dimensions."""
    load_row, warp_dot, add_row, store_row = row_functions(LANE_DIMS)

    @cuda.jit
    def attention_dkdv_reference_kernel(dk, dv, delta, dout, q, k, v, lse, scale, seed, site,
                                        threshold, keep, accumulate):
        # dk_j (+)= sum_{i>=j} dS_ij q_i / sqrt(D), dv_j (+)= sum_{i>=j} P_ij G_ij dout_i; a warp
        # per key row j
        B, H, T, D = q.shape
        bh, j, lane = warp_row()
        if j >= T:
            return
        b, h = bh // H, bh % H
        k_row = cuda.local.array(LANE_DIMS, float32)
        v_row = cuda.local.array(LANE_DIMS, float32)
        dk_acc = cuda.local.array(LANE_DIMS, float32)
        dv_acc = cuda.local.array(LANE_DIMS, float32)
        load_row(k_row, k, b, h, j, lane, scale)
        load_row(v_row, v, b, h, j, lane, float32(1.0))
        for n in range(LANE_DIMS):
            dk_acc[n] = float32(0.0)
            dv_acc[n] = float32(0.0)
        for i in range(j, T):
            p = math.exp(warp_dot(k_row, q, b, h, i, lane) - lse[b, h, i])
            g = dropout_factor(seed, site, threshold, keep, b, h, i, j, H, T)
            add_row(dv_acc, p * g, dout, b, h, i, lane)
            add_row(dk_acc, p * (g * warp_dot(v_row, dout, b, h, i, lane) - delta[b, h, i])
                    * scale, q, b, h, i, lane)
        store_row(dk, b, h, j, lane, dk_acc, accumulate)
        store_row(dv, b, h, j, lane, dv_acc, accumulate)

    return attention_dkdv_reference_kernel


# --- the launchers, and what every attention launcher shares ---------------------------------

def attention_forward_reference(out, lse, q, k, v, dropout_p=0.0, seed=None, site=0):
    """out, lse by the reference kernels (any D)."""
    check_float32(lse=lse)
    check_float32_rows(out=out, q=q, k=k, v=v)
    B, H, T, D = check_attention(q, k, v, out=out, lse=lse)
    launch(reference_forward_kernel(lane_dims(D)), (B * H, blocks(T, ROW_WARPS)),
           ROW_WARPS * LANES, out, lse, q, k, v, np.float32(1.0 / math.sqrt(D)),
           *dropout_arguments(dropout_p, seed, site))


def attention_backward_reference(dq, dk, dv, delta, dout, q, k, v, out, lse, accumulate=False,
                                 dropout_p=0.0, seed=None, site=0):
    """dq, dk, dv (+)= the gradients by the reference kernels (any D); delta is scratch."""
    check_float32(delta=delta, lse=lse)
    check_float32_rows(dq=dq, dk=dk, dv=dv, dout=dout, q=q, k=k, v=v, out=out)
    B, H, T, D = check_attention(q, k, v, dq=dq, dk=dk, dv=dv, dout=dout, out=out, lse=lse,
                                 delta=delta)
    scale = np.float32(1.0 / math.sqrt(D))
    drop = dropout_arguments(dropout_p, seed, site)
    grid = (B * H, blocks(T, ROW_WARPS))
    launch(reference_dq_kernel(lane_dims(D)), grid, ROW_WARPS * LANES, dq, delta, dout, q, k,
           v, out, lse, scale, *drop, accumulate)
    launch(reference_dkdv_kernel(lane_dims(D)), grid, ROW_WARPS * LANES, dk, dv, delta, dout,
           q, k, v, lse, scale, *drop, accumulate)


def check_attention(q, k, v, **others):
    check(len(q.shape) == 4, f"attention: q must be [B,H,T,D], got {q.shape}")
    B, H, T, D = q.shape
    for name, array in dict(k=k, v=v, **others).items():
        if array is not None:
            if name in ("lse", "delta"):
                check_shape(f"attention {name}", array, (B, H, T))
            else:
                check_shape(f"attention {name}", array, (B, H, T, D))
    return B, H, T, D


def dropout_arguments(p, seed, site):
    """The kernels' `drop` arguments for dropout probability p (seed: int64[1] on the device)."""
    threshold, keep = dropout_constants(p)
    return _seed(seed), np.int64(site), threshold, keep


_no_seed = {}


def _seed(seed):
    """The seed array, or (no dropout) a placeholder on the device the kernels never read."""
    if seed is None:
        if "device" not in _no_seed:
            _no_seed["device"] = cuda.to_device(np.zeros(1, dtype=np.int64))
        seed = _no_seed["device"]
    return seed
