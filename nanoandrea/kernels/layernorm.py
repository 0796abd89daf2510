"""Layer normalisation over the last axis, with a learned weight and bias (eps 1e-5, as GPT-2).

    x, out      : [N, C]     (activations [B,T,C] viewed as N = B*T rows)
    mean, rstd  : [N]        saved by forward for backward: rstd = 1/sqrt(var + eps)
    weight, bias: [C]

    xhat = (x - mean) * rstd,   out = xhat * weight + bias
Backward, with g = dout * weight:
    dx      = rstd * (g - mean(g) - xhat * mean(g * xhat))          (means over the row)
    dweight += sum over rows of dout * xhat,   dbias += sum over rows of dout
Fused with the residual add before it (llm.c's fused_residual_forward), for a, b, resid [N, C]:
    resid = a + b,   out = layernorm(resid) * weight + bias      (a and b read once)
"""
import math

import numpy as np
from numba import cuda, float32

from .launch import (SIMULATOR, blocks, check_float32, check_shape, current_stream,
                     elementwise_grid, launch)
from .matmul import sum_rows
from .reduce import (COLUMNS, MAX_THREADS, ROW_GROUPS, block_sum, chunk_rows, column_partials_sum,
                     finish_column_sums_kernel, row_chunks)

EPS = 1e-5
THREADS = 8 if SIMULATOR else 128        # threads per row
ROW_CACHE = 1024        # a row's first ROW_CACHE values stay in shared memory between passes


@cuda.jit(device=True, inline="always")
def normalize_row(out, mean, rstd, x, weight, bias, eps, total, row_cache, scratch):
    # The forward's last two passes over row blockIdx.x of x[N,C]: this thread's columns (c =
    # threadIdx.x + k * blockDim.x) add up to `total`; those below ROW_CACHE are also in the
    # shared row_cache, written by this same thread (so no barrier), the rest are read again.
    row = cuda.blockIdx.x
    C = x.shape[1]
    row_mean = block_sum(total, scratch) / C
    total = float32(0.0)
    for c in range(cuda.threadIdx.x, C, cuda.blockDim.x):
        centered = (row_cache[c] if c < ROW_CACHE else x[row, c]) - row_mean
        total += centered * centered
    row_rstd = float32(1.0) / math.sqrt(block_sum(total, scratch) / C + eps)
    for c in range(cuda.threadIdx.x, C, cuda.blockDim.x):
        value = row_cache[c] if c < ROW_CACHE else x[row, c]
        out[row, c] = (value - row_mean) * row_rstd * weight[c] + bias[c]
    if cuda.threadIdx.x == 0:
        mean[row] = row_mean
        rstd[row] = row_rstd


@cuda.jit
def layernorm_forward_kernel(out, mean, rstd, x, weight, bias, eps):
    # out[N,C], mean[N], rstd[N] from x[N,C]; one block per row, threads stride over C
    row_cache = cuda.shared.array(ROW_CACHE, float32)
    scratch = cuda.shared.array(MAX_THREADS, float32)
    row = cuda.blockIdx.x
    total = float32(0.0)
    for c in range(cuda.threadIdx.x, x.shape[1], cuda.blockDim.x):
        value = x[row, c]
        if c < ROW_CACHE:
            row_cache[c] = value
        total += value
    normalize_row(out, mean, rstd, x, weight, bias, eps, total, row_cache, scratch)


@cuda.jit
def residual_layernorm_forward_kernel(resid, out, mean, rstd, a, b, weight, bias, eps):
    # resid[N,C] = a[N,C] + b[N,C]; out[N,C], mean[N], rstd[N] its layernorm, as
    # layernorm_forward_kernel; one block per row. a and b are read once, resid only written
    # (read back only for columns past ROW_CACHE).
    row_cache = cuda.shared.array(ROW_CACHE, float32)
    scratch = cuda.shared.array(MAX_THREADS, float32)
    row = cuda.blockIdx.x
    total = float32(0.0)
    for c in range(cuda.threadIdx.x, a.shape[1], cuda.blockDim.x):
        value = a[row, c] + b[row, c]
        resid[row, c] = value
        if c < ROW_CACHE:
            row_cache[c] = value
        total += value
    normalize_row(out, mean, rstd, resid, weight, bias, eps, total, row_cache, scratch)


@cuda.jit
def layernorm_backward_kernel(dx, dout, x, weight, mean, rstd, accumulate):
    # dx[N,C] (+)= the input gradient; one block per row
    scratch = cuda.shared.array(MAX_THREADS, float32)
    row = cuda.blockIdx.x
    C = x.shape[1]
    row_mean = mean[row]
    row_rstd = rstd[row]
    sum_g = float32(0.0)
    sum_g_xhat = float32(0.0)
    for c in range(cuda.threadIdx.x, C, cuda.blockDim.x):
        g = dout[row, c] * weight[c]
        sum_g += g
        sum_g_xhat += g * (x[row, c] - row_mean) * row_rstd
    mean_g = block_sum(sum_g, scratch) / C
    mean_g_xhat = block_sum(sum_g_xhat, scratch) / C
    for c in range(cuda.threadIdx.x, C, cuda.blockDim.x):
        xhat = (x[row, c] - row_mean) * row_rstd
        value = row_rstd * (dout[row, c] * weight[c] - mean_g - xhat * mean_g_xhat)
        if accumulate:
            value += dx[row, c]
        dx[row, c] = value


@cuda.jit
def layernorm_weight_grad_kernel(partials, dout, x, mean, rstd):
    # partials[R, C]: the r-th chunk of rows' sum of dout * xhat (stage 1 of dweight, as
    # sum_rows_kernel); grid (C/32, R), block (32, ROW_GROUPS)
    partial = cuda.shared.array((ROW_GROUPS, COLUMNS), float32)
    N, C = x.shape
    first, end = chunk_rows(N)
    col = cuda.blockIdx.x * COLUMNS + cuda.threadIdx.x
    total = float32(0.0)
    if col < C:
        for row in range(first + cuda.threadIdx.y, end, ROW_GROUPS):
            total += dout[row, col] * (x[row, col] - mean[row]) * rstd[row]
    total = column_partials_sum(total, partial)
    if cuda.threadIdx.y == 0 and col < C:
        partials[cuda.blockIdx.y, col] = total


def _check(x, weight, **rows):
    check_shape("layernorm x", x, (None, None))
    N, C = x.shape
    check_shape("layernorm weight", weight, (C,))
    for name, array in rows.items():
        check_shape(f"layernorm {name}", array, (N,) if name in ("mean", "rstd") else (N, C))


def layernorm_forward(out, mean, rstd, x, weight, bias):
    """out = layernorm(x) * weight + bias, row by row; mean and rstd saved for backward."""
    check_float32(out=out, mean=mean, rstd=rstd, x=x, weight=weight, bias=bias)
    _check(x, weight, out=out, mean=mean, rstd=rstd)
    launch(layernorm_forward_kernel, x.shape[0], THREADS, out, mean, rstd, x, weight, bias,
           np.float32(EPS))


def residual_layernorm_forward(resid, out, mean, rstd, a, b, weight, bias):
    """resid = a + b, then out = layernorm(resid) * weight + bias: the residual add and the
    layernorm that follows it in one kernel; mean and rstd saved for backward."""
    check_float32(resid=resid, out=out, mean=mean, rstd=rstd, a=a, b=b, weight=weight, bias=bias)
    _check(a, weight, b=b, resid=resid, out=out, mean=mean, rstd=rstd)
    launch(residual_layernorm_forward_kernel, a.shape[0], THREADS, resid, out, mean, rstd, a, b,
           weight, bias, np.float32(EPS))


def layernorm_backward(dx, dweight, dbias, dout, x, weight, mean, rstd, accumulate=False):
    """dx (+)= input gradient; dweight, dbias += parameter gradients (always accumulated)."""
    check_float32(dx=dx, dweight=dweight, dbias=dbias, dout=dout, x=x, weight=weight)
    _check(x, weight, dx=dx, dout=dout, mean=mean, rstd=rstd)
    launch(layernorm_backward_kernel, x.shape[0], THREADS, dx, dout, x, weight, mean, rstd,
           accumulate)
    N, C = x.shape
    partials = cuda.device_array((row_chunks(N, C), C), np.float32, stream=current_stream())
    launch(layernorm_weight_grad_kernel, (blocks(C, COLUMNS), partials.shape[0]),
           (COLUMNS, ROW_GROUPS), partials, dout, x, mean, rstd)
    launch(finish_column_sums_kernel, *elementwise_grid(C), dweight, partials, True)
    sum_rows(dbias, dout, accumulate=True)


def layernorm_forward_numpy(out, mean, rstd, x, weight, bias):
    _check(x, weight, out=out, mean=mean, rstd=rstd)
    mean[...] = x.mean(axis=1)
    rstd[...] = 1.0 / np.sqrt(((x - mean[:, None]) ** 2).mean(axis=1) + EPS)
    out[...] = (x - mean[:, None]) * rstd[:, None] * weight + bias


def residual_layernorm_forward_numpy(resid, out, mean, rstd, a, b, weight, bias):
    _check(a, weight, b=b, resid=resid)
    np.add(a, b, out=resid)
    layernorm_forward_numpy(out, mean, rstd, resid, weight, bias)


def layernorm_backward_numpy(dx, dweight, dbias, dout, x, weight, mean, rstd, accumulate=False):
    _check(x, weight, dx=dx, dout=dout, mean=mean, rstd=rstd)
    xhat = (x - mean[:, None]) * rstd[:, None]
    g = dout * weight
    value = rstd[:, None] * (g - g.mean(axis=1, keepdims=True)
                             - xhat * (g * xhat).mean(axis=1, keepdims=True))
    if accumulate:
        dx += value
    else:
        dx[...] = value
    dweight += (dout * xhat).sum(axis=0)
    dbias += dout.sum(axis=0)
