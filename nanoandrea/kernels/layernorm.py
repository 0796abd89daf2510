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

Two families of kernels compute this:
  - warp kernels (warp_kernel(V, ...), for C <= 128 V, C % 4 == 0, 16-byte aligned rows): one warp
    per row; lane l keeps columns 4 (l + 32 k) .. 4 (l + 32 k) + 3, k < V, in registers (C = 768:
    24 floats, six 16-byte loads), so each row is read from global memory exactly once, and the
    row's sums meet in warp shuffles (warp_sum). The backward also adds each lane's dout * xhat
    and dout over its rows in registers, so dweight and dbias need no second pass over the rows.
  - block kernels (below them), for every other C: one block per row, shared-memory sums. They
    are the readable reference, and the fallback.
In bf16 training out is a Bf16Matrix, the rows as the products after the layer norm read them
(the backward reads x, not out): the warp kernels write its bf16 pairs, 8 bytes a lane
(C % 8 == 0); other widths go through float32 and a rounding pass.
"""
import math
from contextlib import contextmanager

import numpy as np
from numba import cuda, float32

from .reduce import (COLUMNS, MAX_THREADS, ROW_GROUPS, block_sum, chunk_rows,
                     column_partials_sum, finish_column_sums_kernel, row_chunks, sum_rows)
from .runtime import device
from .runtime.device import SIMULATOR
from .runtime.launch import (blocks, check_float32, check_shape, current_stream, elementwise_grid,
                             inlined, kernel_factory, launch)
from .ptx.mma import bf16_pair, store2_u32
from .ptx.vector import aligned16, load4, store4
from .ptx.warp import WARP, warp_sum

EPS = 1e-5
THREADS = 8 if SIMULATOR else 128        # block kernels: threads per row
ROW_CACHE = 1024        # a row's first ROW_CACHE values stay in shared memory between passes
WARPS = 2 if SIMULATOR else 4            # warp kernels: rows (warps) per block
MAX_VECTORS = 8                          # warp kernels take C <= 4 * WARP * MAX_VECTORS = 1024


def backward_blocks_per_sm(V):
    """Blocks of the warp backward that fit on one multiprocessor: it keeps 16 V floats per lane
    (xhat, g and the dweight, dbias sums), 128 registers in all up to V = 6 (no spills; 4 blocks
    of 128 threads), 168 at V = 8 (3 blocks; at 128 it spills)."""
    return 4 if V <= 6 else 3


# --- warp kernels ---------------------------------------------------------------------------

@kernel_factory
def warp_kernel(V, which, bf16_out=False):
    """The warp kernel `which` ("forward", "residual_forward" or "backward") for rows of
    C <= 128 V columns (C % 4 == 0). V fixes the size of each lane's register arrays (4 V
    floats), which must be known when the kernel is compiled. bf16_out (C % 8 == 0): in the
    forwards out is a Bf16Matrix's bf16 pairs [N, C/2], the normalized rows as the next products
    read them (bf16 training: half float32's bytes, and no rounding pass after); in the backward
    dx is written also as such pairs, dx_pairs (the residual stream's gradient, which the
    products of W_O and W_proj read in bf16), else dx_pairs is not touched (the launcher
    passes dx's own bits as uint32)."""
    SIZE = 4 * V       # floats per lane: values[4 k + i] is column 4 (lane + 32 k) + i
    MAX_C = WARP * SIZE
    # (the simulator's cuda.jit takes no launch_bounds)
    bounds = ({} if SIMULATOR else
              dict(launch_bounds=(WARP * WARPS, backward_blocks_per_sm(V))))

    @inlined
    def load_row(values, x, row):
        # values[4 k + i] = x[row, 4 (lane + 32 k) + i]: this lane's groups of 4 columns
        lane = cuda.threadIdx.x
        for k in range(V):
            col = 4 * (lane + WARP * k)
            if col < x.shape[1]:
                values[4 * k], values[4 * k + 1], values[4 * k + 2], values[4 * k + 3] = \
                    load4(x, (row, col))

    @inlined
    def normalize_warp_row(out, mean, rstd, values, weight, bias, eps, row):
        # The forward after a row is loaded into values (this lane's columns of row `row`):
        # writes out[row, :], mean[row], rstd[row]. Every lane of the warp calls it.
        C = out.shape[1] * (2 if bf16_out else 1)
        lane = cuda.threadIdx.x
        total = float32(0.0)
        for k in range(V):
            if 4 * (lane + WARP * k) < C:
                for i in range(4):
                    total += values[4 * k + i]
        row_mean = warp_sum(total) / float32(C)
        total = float32(0.0)
        for k in range(V):
            if 4 * (lane + WARP * k) < C:
                for i in range(4):
                    centered = values[4 * k + i] - row_mean
                    total += centered * centered
        row_rstd = float32(1.0) / math.sqrt(warp_sum(total) / float32(C) + eps)
        for k in range(V):
            col = 4 * (lane + WARP * k)
            if col < C:
                w0, w1, w2, w3 = load4(weight, (col,))
                b0, b1, b2, b3 = load4(bias, (col,))
                y0 = (values[4 * k] - row_mean) * row_rstd * w0 + b0
                y1 = (values[4 * k + 1] - row_mean) * row_rstd * w1 + b1
                y2 = (values[4 * k + 2] - row_mean) * row_rstd * w2 + b2
                y3 = (values[4 * k + 3] - row_mean) * row_rstd * w3 + b3
                if bf16_out:            # (columns col .. col + 3: pairs col/2 and col/2 + 1)
                    store2_u32(out, (row, col >> 1), bf16_pair(y0, y1), bf16_pair(y2, y3))
                else:
                    store4(out, (row, col), y0, y1, y2, y3)
        if lane == 0:
            mean[row] = row_mean
            rstd[row] = row_rstd

    # Each kernel first issues every load of its row and only then uses the values: one trip
    # to memory per row instead of V (a store to resid or dx between two loads would keep the
    # compiler from moving the second load up: the arrays might overlap).

    @cuda.jit
    def forward(out, mean, rstd, x, weight, bias, eps):
        # out[N,C], mean[N], rstd[N] from x[N,C]; block (32, WARPS): warp threadIdx.y takes row
        # blockIdx.x * WARPS + threadIdx.y, each lane its V groups of 4 columns
        row = cuda.blockIdx.x * cuda.blockDim.y + cuda.threadIdx.y
        if row >= x.shape[0]:
            return
        values = cuda.local.array(SIZE, float32)
        load_row(values, x, row)
        normalize_warp_row(out, mean, rstd, values, weight, bias, eps, row)

    @cuda.jit
    def residual_forward(resid, out, mean, rstd, a, b, weight, bias, eps):
        # resid[N,C] = a + b, then out[N,C], mean[N], rstd[N] its layernorm, as forward (the
        # same arithmetic, so the same bits as add + forward); a and b read once, resid written
        row = cuda.blockIdx.x * cuda.blockDim.y + cuda.threadIdx.y
        if row >= a.shape[0]:
            return
        C = a.shape[1]
        lane = cuda.threadIdx.x
        values = cuda.local.array(SIZE, float32)
        other = cuda.local.array(SIZE, float32)
        load_row(values, a, row)
        load_row(other, b, row)
        for k in range(V):
            col = 4 * (lane + WARP * k)
            if col < C:
                for i in range(4):
                    values[4 * k + i] += other[4 * k + i]
                store4(resid, (row, col), values[4 * k], values[4 * k + 1], values[4 * k + 2],
                       values[4 * k + 3])
        normalize_warp_row(out, mean, rstd, values, weight, bias, eps, row)

    @cuda.jit(**bounds)
    def backward(dx, dx_pairs, prior, dweight_partials, dbias_partials, dout, x, weight, mean,
                 rstd, accumulate):
        # dx[N,C] = the input gradient (+ prior[N,C] if accumulate: dx itself, or another
        # array), and (bf16_out) dx_pairs[N, C/2] the same rounded to bf16 pairs, the bits
        # round_bf16 would make of dx; dweight_partials, dbias_partials[BLOCKS, C]: block
        # blockIdx.x's sums of dout * xhat and dout over its rows. block (32, WARPS); warps take
        # rows in a grid-stride loop, adding their lane's share of those sums in registers;
        # then the block's warps add theirs, in order, in shared memory.
        N, C = x.shape
        lane = cuda.threadIdx.x
        warp = cuda.threadIdx.y
        xhat = cuda.local.array(SIZE, float32)           # x, then xhat, then the prior dx
        g = cuda.local.array(SIZE, float32)              # dout, then dout * weight, then dx
        dweight_sum = cuda.local.array(SIZE, float32)
        dbias_sum = cuda.local.array(SIZE, float32)
        for i in range(SIZE):
            dweight_sum[i] = float32(0.0)
            dbias_sum[i] = float32(0.0)
        for row in range(cuda.blockIdx.x * cuda.blockDim.y + warp, N,
                         cuda.gridDim.x * cuda.blockDim.y):
            load_row(xhat, x, row)
            load_row(g, dout, row)
            row_mean = mean[row]
            row_rstd = rstd[row]
            sum_g = float32(0.0)
            sum_g_xhat = float32(0.0)
            for k in range(V):
                col = 4 * (lane + WARP * k)
                if col < C:
                    ws = load4(weight, (col,))
                    for i in range(4):
                        j = 4 * k + i
                        xhat[j] = (xhat[j] - row_mean) * row_rstd
                        dweight_sum[j] += g[j] * xhat[j]
                        dbias_sum[j] += g[j]
                        g[j] *= ws[i]
                        sum_g += g[j]
                        sum_g_xhat += g[j] * xhat[j]
            mean_g = warp_sum(sum_g) / float32(C)
            mean_g_xhat = warp_sum(sum_g_xhat) / float32(C)
            for k in range(V):
                if 4 * (lane + WARP * k) < C:
                    for i in range(4):
                        j = 4 * k + i
                        g[j] = row_rstd * (g[j] - mean_g - xhat[j] * mean_g_xhat)
            if accumulate:
                load_row(xhat, prior, row)
                for k in range(V):
                    if 4 * (lane + WARP * k) < C:
                        for i in range(4):
                            g[4 * k + i] += xhat[4 * k + i]
            for k in range(V):
                col = 4 * (lane + WARP * k)
                if col < C:
                    store4(dx, (row, col), g[4 * k], g[4 * k + 1], g[4 * k + 2], g[4 * k + 3])
                    if bf16_out:
                        store2_u32(dx_pairs, (row, col >> 1), bf16_pair(g[4 * k], g[4 * k + 1]),
                                   bf16_pair(g[4 * k + 2], g[4 * k + 3]))
        block_dweight = cuda.shared.array(MAX_C, float32)
        block_dbias = cuda.shared.array(MAX_C, float32)
        for turn in range(cuda.blockDim.y):              # warp 0 writes, the others add in turn
            if warp == turn:
                for k in range(V):
                    col = 4 * (lane + WARP * k)
                    if col < C:
                        for i in range(4):
                            if turn == 0:
                                block_dweight[col + i] = dweight_sum[4 * k + i]
                                block_dbias[col + i] = dbias_sum[4 * k + i]
                            else:
                                block_dweight[col + i] += dweight_sum[4 * k + i]
                                block_dbias[col + i] += dbias_sum[4 * k + i]
            cuda.syncthreads()
        for col in range(warp * WARP + lane, C, cuda.blockDim.y * WARP):
            dweight_partials[cuda.blockIdx.x, col] = block_dweight[col]
            dbias_partials[cuda.blockIdx.x, col] = block_dbias[col]

    backward.launch_bounds = bounds.get("launch_bounds")
    return dict(forward=forward, residual_forward=residual_forward, backward=backward)[which]


def warp_vectors(C, *arrays):
    """V for the warp kernels on these arrays (rows of C columns), or 0 when they cannot take
    them: C not a multiple of 4, wider than 128 MAX_VECTORS, or an array not 16-byte aligned."""
    V = blocks(C, 4 * WARP)
    if C % 4 or V > MAX_VECTORS or not all(aligned16(a) for a in arrays):
        return 0
    return V


# --- block kernels: one block per row (any C) ---------------------------------------------


@inlined
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
def layernorm_backward_kernel(dx, prior, dout, x, weight, mean, rstd, accumulate):
    # dx[N,C] = the input gradient (+ prior[N,C] if accumulate); one block per row
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
            value += prior[row, c]
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
    """out = layernorm(x) * weight + bias, row by row; mean and rstd saved for backward. out
    may be a Bf16Matrix (bf16 training: the rows as the products read them)."""
    check_float32(mean=mean, rstd=rstd, x=x, weight=weight, bias=bias)
    _check(x, weight, out=out, mean=mean, rstd=rstd)
    N, C = x.shape
    bf16_out = _bf16_out(out, C, x, weight, bias)
    if bf16_out is None:
        with _through_float32(out) as values:
            layernorm_forward(values, mean, rstd, x, weight, bias)
        return
    V = warp_vectors(C, *([] if bf16_out else [out]), x, weight, bias)
    if V:
        launch(warp_kernel(V, "forward", bf16_out), blocks(N, WARPS), (WARP, WARPS),
               out.bf16_pairs if bf16_out else out, mean, rstd, x, weight, bias,
               np.float32(EPS))
    else:
        launch(layernorm_forward_kernel, N, THREADS, out, mean, rstd, x, weight, bias,
               np.float32(EPS))


def residual_layernorm_forward(resid, out, mean, rstd, a, b, weight, bias):
    """resid = a + b, then out = layernorm(resid) * weight + bias: the residual add and the
    layernorm that follows it in one kernel; mean and rstd saved for backward. out may be a
    Bf16Matrix, as layernorm_forward's."""
    check_float32(resid=resid, mean=mean, rstd=rstd, a=a, b=b, weight=weight, bias=bias)
    _check(a, weight, b=b, resid=resid, out=out, mean=mean, rstd=rstd)
    N, C = a.shape
    bf16_out = _bf16_out(out, C, resid, a, b, weight, bias)
    if bf16_out is None:
        with _through_float32(out) as values:
            residual_layernorm_forward(resid, values, mean, rstd, a, b, weight, bias)
        return
    V = warp_vectors(C, resid, *([] if bf16_out else [out]), a, b, weight, bias)
    if V:
        launch(warp_kernel(V, "residual_forward", bf16_out), blocks(N, WARPS), (WARP, WARPS),
               resid, out.bf16_pairs if bf16_out else out, mean, rstd, a, b, weight, bias,
               np.float32(EPS))
    else:
        launch(residual_layernorm_forward_kernel, N, THREADS, resid, out, mean, rstd, a, b,
               weight, bias, np.float32(EPS))


def _bf16_out(out, C, *arrays):
    """For a forward's out: False (float32, any kernel), True (a Bf16Matrix the warp kernel
    writes: C % 8 == 0, the rows whole bf16 pairs and no pad to keep zero) or None (a
    Bf16Matrix no kernel writes: _through_float32)."""
    if not hasattr(out, "bf16_pairs"):
        check_float32(out=out)
        return False
    return True if C % 8 == 0 and warp_vectors(C, out.bf16_pairs, *arrays) else None


@contextmanager
def _through_float32(out):
    """A float32 array for a forward to write, rounded into the Bf16Matrix out after."""
    from .operands import round_bf16
    values = cuda.device_array(out.shape, np.float32, stream=current_stream())
    yield values
    round_bf16(out, values)


def layernorm_backward(dx, dweight, dbias, dout, x, weight, mean, rstd, accumulate=False,
                       prior=None, dx_bf16=None):
    """dx (+)= input gradient; dweight, dbias += parameter gradients (always accumulated).
    prior (with accumulate): dx = prior + the input gradient, prior another array than dx (an
    input gradient that must not be written in place: autograd.grad_out_of_place).
    dx_bf16: a Bf16Matrix [N, C] written too, dx rounded (round_bf16's bits): the residual
    stream's gradient as the products of W_O and W_proj read it (by the warp kernel as it
    stores dx, else a rounding pass)."""
    prior = dx if prior is None else prior
    check_float32(dx=dx, prior=prior, dweight=dweight, dbias=dbias, dout=dout, x=x, weight=weight)
    _check(x, weight, dx=dx, prior=prior, dout=dout, mean=mean, rstd=rstd)
    N, C = x.shape
    if dx_bf16 is not None:
        check_shape("layernorm dx_bf16", dx_bf16, (N, C))
    V = warp_vectors(C, dx, prior, dout, x, weight)
    pairs_in_kernel = V and dx_bf16 is not None and C % 8 == 0
    if V:
        R = min(blocks(N, WARPS), 2 if SIMULATOR else device.current().multiprocessors * backward_blocks_per_sm(V))
        partials = cuda.device_array((2, R, C), np.float32, stream=current_stream())
        pairs = dx_bf16.bf16_pairs if pairs_in_kernel else dx.view(np.uint32)   # (untouched)
        launch(warp_kernel(V, "backward", pairs_in_kernel), R, (WARP, WARPS), dx, pairs,
               prior, partials[0], partials[1], dout, x, weight, mean, rstd, accumulate)
        sum_rows(dweight, partials[0], accumulate=True)
        sum_rows(dbias, partials[1], accumulate=True)
    else:
        launch(layernorm_backward_kernel, N, THREADS, dx, prior, dout, x, weight, mean, rstd,
               accumulate)
        partials = cuda.device_array((row_chunks(N, C), C), np.float32, stream=current_stream())
        launch(layernorm_weight_grad_kernel, (blocks(C, COLUMNS), partials.shape[0]),
               (COLUMNS, ROW_GROUPS), partials, dout, x, mean, rstd)
        launch(finish_column_sums_kernel, *elementwise_grid(C), dweight, partials, True)
        sum_rows(dbias, dout, accumulate=True)
    if dx_bf16 is not None and not pairs_in_kernel:
        from .operands import round_bf16
        round_bf16(dx_bf16, dx)


def layernorm_forward_numpy(out, mean, rstd, x, weight, bias):
    _check(x, weight, out=out, mean=mean, rstd=rstd)
    if hasattr(out, "bf16_pairs"):              # (a Bf16Matrix: the float32 rows rounded)
        from .operands import round_bf16_numpy
        values = np.empty(out.shape, np.float32)
        layernorm_forward_numpy(values, mean, rstd, x, weight, bias)
        round_bf16_numpy(out, values)
        return
    mean[...] = x.mean(axis=1)
    rstd[...] = 1.0 / np.sqrt(((x - mean[:, None]) ** 2).mean(axis=1) + EPS)
    out[...] = (x - mean[:, None]) * rstd[:, None] * weight + bias


def residual_layernorm_forward_numpy(resid, out, mean, rstd, a, b, weight, bias):
    _check(a, weight, b=b, resid=resid)
    np.add(a, b, out=resid)
    layernorm_forward_numpy(out, mean, rstd, resid, weight, bias)


def layernorm_backward_numpy(dx, dweight, dbias, dout, x, weight, mean, rstd, accumulate=False,
                             prior=None, dx_bf16=None):
    prior = dx if prior is None else prior
    _check(x, weight, dx=dx, prior=prior, dout=dout, mean=mean, rstd=rstd)
    xhat = (x - mean[:, None]) * rstd[:, None]
    g = dout * weight
    value = rstd[:, None] * (g - g.mean(axis=1, keepdims=True)
                             - xhat * (g * xhat).mean(axis=1, keepdims=True))
    dx[...] = prior + value if accumulate else value
    dweight += (dout * xhat).sum(axis=0)
    dbias += dout.sum(axis=0)
    if dx_bf16 is not None:
        from .operands import round_bf16_numpy
        round_bf16_numpy(dx_bf16, dx.astype(np.float32))
