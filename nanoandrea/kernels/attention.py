"""Causal softmax attention over all heads in one launch.

    q, k, v, out : [B,H,T,D]      (after split_heads: each head's T x D slice is contiguous)
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

The kernels do not know about heads: a thread block takes one (batch, head) pair, the launch
grid supplies the parallelism over all B*H pairs, and the threads of the block share out the
rows of the head's T x D tile (one query row per thread at a time).
  reference kernels  any D, one block per (batch, head); a thread walks the keys of its row
                     twice (normaliser first, then the weighted sum of values), reading q, k, v
                     straight from global memory. Readable, and the fallback for D=72 or D=8.
  fast kernels       D a compile-time constant (32 or 64, the sizes tensor-core tiles like):
                     a thread keeps its query row and its output row in registers, key and
                     value tiles are staged in shared memory and read by every thread at once
                     (a broadcast), softmax is online (running max and sum, rescaled per tile).
                     grid (B*H, query blocks): with one query block per head this is the
                     one-block-per-(batch, head) layout of the brief.
"""
import math

import numpy as np
from numba import cuda, float32

from .dropout import dropout_constants, keep_scale, keep_scale_numpy
from .launch import SIMULATOR, blocks, check, check_float32, check_shape, launch

NEG_INF = float32(-np.inf)
FAST_HEAD_SIZES = (32, 64)


# --- reference kernels: any head size ------------------------------------------------------

@cuda.jit(device=True, inline="always")
def row_dot(x, y, b, h, i, j, D):
    # x[b,h,i,:] . y[b,h,j,:]
    total = float32(0.0)
    for d in range(D):
        total += x[b, h, i, d] * y[b, h, j, d]
    return total


@cuda.jit(device=True, inline="always")
def dropout_factor(seed, site, threshold, keep, b, h, i, j, H, T):
    # G_ij of (batch b, head h): 1 without dropout, else 0 or 1/(1-p)
    if threshold == 0:
        return float32(1.0)
    return keep_scale(seed[0], site, ((b * H + h) * T + i) * T + j, threshold, keep)


@cuda.jit
def attention_forward_reference_kernel(out, lse, q, k, v, scale, seed, site, threshold, keep):
    # out[B,H,T,D], lse[B,H,T] from q, k, v [B,H,T,D]; grid B*H, block: threads share the rows
    B, H, T, D = q.shape
    b = cuda.blockIdx.x // H
    h = cuda.blockIdx.x % H
    for i in range(cuda.threadIdx.x, T, cuda.blockDim.x):
        # pass 1: the softmax normaliser, as a running max m and sum l of exp(S - m)
        m = NEG_INF
        l = float32(0.0)
        for j in range(i + 1):
            s = row_dot(q, k, b, h, i, j, D) * scale
            m_new = max(m, s)
            l = l * math.exp(m - m_new) + math.exp(s - m_new)
            m = m_new
        row_lse = m + math.log(l)
        lse[b, h, i] = row_lse
        # pass 2: out_i = sum_j P_ij v_j, accumulated in place in out's row
        for d in range(D):
            out[b, h, i, d] = float32(0.0)
        for j in range(i + 1):
            p = math.exp(row_dot(q, k, b, h, i, j, D) * scale - row_lse)
            p *= dropout_factor(seed, site, threshold, keep, b, h, i, j, H, T)
            for d in range(D):
                out[b, h, i, d] += p * v[b, h, j, d]


@cuda.jit
def attention_backward_reference_kernel(dq, dk, dv, delta, dout, q, k, v, out, lse, scale,
                                        seed, site, threshold, keep, accumulate):
    # dq, dk, dv [B,H,T,D] (+)= gradients; delta[B,H,T] scratch; grid B*H.
    # The block owns its head, so the phases only need block-wide barriers between them.
    B, H, T, D = q.shape
    b = cuda.blockIdx.x // H
    h = cuda.blockIdx.x % H
    first = cuda.threadIdx.x
    stride = cuda.blockDim.x
    for i in range(first, T, stride):                       # delta_i = dout_i . out_i
        delta[b, h, i] = row_dot(dout, out, b, h, i, i, D)
        if not accumulate:
            for d in range(D):
                dq[b, h, i, d] = float32(0.0)
                dk[b, h, i, d] = float32(0.0)
                dv[b, h, i, d] = float32(0.0)
    cuda.syncthreads()
    for i in range(first, T, stride):                       # dq_i: a thread per query row
        for j in range(i + 1):
            p = math.exp(row_dot(q, k, b, h, i, j, D) * scale - lse[b, h, i])
            g = dropout_factor(seed, site, threshold, keep, b, h, i, j, H, T)
            ds = p * (g * row_dot(dout, v, b, h, i, j, D) - delta[b, h, i]) * scale
            for d in range(D):
                dq[b, h, i, d] += ds * k[b, h, j, d]
    for j in range(first, T, stride):                       # dk_j, dv_j: a thread per key row
        for i in range(j, T):
            p = math.exp(row_dot(q, k, b, h, i, j, D) * scale - lse[b, h, i])
            g = dropout_factor(seed, site, threshold, keep, b, h, i, j, H, T)
            ds = p * (g * row_dot(dout, v, b, h, i, j, D) - delta[b, h, i]) * scale
            for d in range(D):
                dv[b, h, j, d] += p * g * dout[b, h, i, d]
                dk[b, h, j, d] += ds * q[b, h, i, d]


# --- fast kernels: D known at compile time ---------------------------------------------------

def make_attention_kernels(D, threads, tile=32):
    """Forward, dq and dk/dv kernels for head size D (a constant), `threads` rows at a time.

    tile: keys (or queries) staged in shared memory per step.
    """

    @cuda.jit(device=True, inline="always")
    def block_rows(H, T, rows_per_block):
        # this block's (batch, head) and its rows [row_start, row_end): grid (B*H, T/rows)
        row_start = cuda.blockIdx.y * rows_per_block
        return (cuda.blockIdx.x // H, cuda.blockIdx.x % H, row_start,
                min(T, row_start + rows_per_block))

    @cuda.jit(device=True, inline="always")
    def stage_tiles(first_tile, second_tile, first, second, b, h, row0, T):
        # first_tile[r, :] = first[b, h, row0 + r, :], second_tile likewise, zeros past T;
        # all threads of the block share the tile * D elements (consecutive threads, consecutive d)
        for e in range(cuda.threadIdx.x, tile * D, threads):
            r = e // D
            d = e % D
            inside = row0 + r < T
            first_tile[r, d] = first[b, h, row0 + r, d] if inside else float32(0.0)
            second_tile[r, d] = second[b, h, row0 + r, d] if inside else float32(0.0)

    @cuda.jit
    def attention_forward_kernel(out, lse, q, k, v, scale, seed, site, threshold, keep,
                                 rows_per_block):
        # grid (B*H, T/rows_per_block); block `threads`: one query row per thread at a time
        k_tile = cuda.shared.array((tile, D), float32)
        v_tile = cuda.shared.array((tile, D), float32)
        q_row = cuda.local.array(D, float32)
        acc = cuda.local.array(D, float32)
        scores = cuda.local.array(tile, float32)
        B, H, T, _ = q.shape
        b, h, row_start, row_end = block_rows(H, T, rows_per_block)
        for row_base in range(row_start, row_end, threads):
            i = row_base + cuda.threadIdx.x
            active = i < row_end
            if active:
                for d in range(D):
                    q_row[d] = q[b, h, i, d] * scale
                    acc[d] = float32(0.0)
            m = NEG_INF
            l = float32(0.0)
            keys_end = min(row_end, row_base + threads)       # the last row here sees keys < this
            for j0 in range(0, keys_end, tile):
                stage_tiles(k_tile, v_tile, k, v, b, h, j0, T)
                cuda.syncthreads()
                if active and j0 <= i:
                    tile_max = NEG_INF
                    for jj in range(tile):
                        s = NEG_INF
                        if j0 + jj <= i:
                            s = float32(0.0)
                            for d in range(D):
                                s += q_row[d] * k_tile[jj, d]
                        scores[jj] = s
                        tile_max = max(tile_max, s)
                    m_new = max(m, tile_max)
                    correction = math.exp(m - m_new)
                    l *= correction
                    for d in range(D):
                        acc[d] *= correction
                    for jj in range(tile):
                        p = math.exp(scores[jj] - m_new)       # exp(-inf) = 0 for masked keys
                        l += p                                 # the normaliser: before dropout
                        if threshold != 0 and j0 + jj <= i:
                            p *= dropout_factor(seed, site, threshold, keep, b, h, i, j0 + jj,
                                                H, T)
                        for d in range(D):
                            acc[d] += p * v_tile[jj, d]
                    m = m_new
                cuda.syncthreads()
            if active:
                inv_l = float32(1.0) / l
                for d in range(D):
                    out[b, h, i, d] = acc[d] * inv_l
                lse[b, h, i] = m + math.log(l)

    @cuda.jit
    def attention_dq_kernel(dq, dout, q, k, v, lse, delta, scale, seed, site, threshold, keep,
                            rows_per_block, accumulate):
        # dq[B,H,T,D] (+)= sum_j dS_ij k_j / sqrt(D); grid (B*H, T/rows_per_block)
        k_tile = cuda.shared.array((tile, D), float32)
        v_tile = cuda.shared.array((tile, D), float32)
        q_row = cuda.local.array(D, float32)
        dout_row = cuda.local.array(D, float32)
        dq_acc = cuda.local.array(D, float32)
        B, H, T, _ = q.shape
        b, h, row_start, row_end = block_rows(H, T, rows_per_block)
        for row_base in range(row_start, row_end, threads):
            i = row_base + cuda.threadIdx.x
            active = i < row_end
            row_lse = float32(0.0)
            row_delta = float32(0.0)
            if active:
                for d in range(D):
                    q_row[d] = q[b, h, i, d] * scale
                    dout_row[d] = dout[b, h, i, d]
                    dq_acc[d] = float32(0.0)
                row_lse = lse[b, h, i]
                row_delta = delta[b, h, i]
            keys_end = min(row_end, row_base + threads)
            for j0 in range(0, keys_end, tile):
                stage_tiles(k_tile, v_tile, k, v, b, h, j0, T)
                cuda.syncthreads()
                if active:
                    for jj in range(tile):
                        if j0 + jj <= i:
                            s = float32(0.0)
                            dp = float32(0.0)
                            for d in range(D):
                                s += q_row[d] * k_tile[jj, d]
                                dp += dout_row[d] * v_tile[jj, d]
                            g = dropout_factor(seed, site, threshold, keep, b, h, i, j0 + jj, H, T)
                            ds = math.exp(s - row_lse) * (g * dp - row_delta)
                            for d in range(D):
                                dq_acc[d] += ds * k_tile[jj, d]
                cuda.syncthreads()
            if active:
                for d in range(D):
                    value = dq_acc[d] * scale
                    if accumulate:
                        value += dq[b, h, i, d]
                    dq[b, h, i, d] = value

    @cuda.jit
    def attention_dkdv_kernel(dk, dv, dout, q, k, v, lse, delta, scale, seed, site, threshold,
                              keep, rows_per_block, accumulate):
        # dk, dv [B,H,T,D] (+)= gradients; grid (B*H, T/rows_per_block): one key row per thread
        q_tile = cuda.shared.array((tile, D), float32)
        dout_tile = cuda.shared.array((tile, D), float32)
        lse_tile = cuda.shared.array(tile, float32)
        delta_tile = cuda.shared.array(tile, float32)
        k_row = cuda.local.array(D, float32)
        v_row = cuda.local.array(D, float32)
        dk_acc = cuda.local.array(D, float32)
        dv_acc = cuda.local.array(D, float32)
        B, H, T, _ = q.shape
        b, h, row_start, row_end = block_rows(H, T, rows_per_block)
        for row_base in range(row_start, row_end, threads):
            j = row_base + cuda.threadIdx.x
            active = j < row_end
            if active:
                for d in range(D):
                    k_row[d] = k[b, h, j, d] * scale
                    v_row[d] = v[b, h, j, d]
                    dk_acc[d] = float32(0.0)
                    dv_acc[d] = float32(0.0)
            for i0 in range(row_base - row_base % tile, T, tile):     # queries i >= j only
                stage_tiles(q_tile, dout_tile, q, dout, b, h, i0, T)
                for ii in range(cuda.threadIdx.x, tile, threads):
                    inside = i0 + ii < T
                    lse_tile[ii] = lse[b, h, i0 + ii] if inside else float32(0.0)
                    delta_tile[ii] = delta[b, h, i0 + ii] if inside else float32(0.0)
                cuda.syncthreads()
                if active:
                    for ii in range(tile):
                        i = i0 + ii
                        if i >= j and i < T:
                            s = float32(0.0)
                            dp = float32(0.0)
                            for d in range(D):
                                s += q_tile[ii, d] * k_row[d]
                                dp += dout_tile[ii, d] * v_row[d]
                            p = math.exp(s - lse_tile[ii])
                            g = dropout_factor(seed, site, threshold, keep, b, h, i, j, H, T)
                            ds = p * (g * dp - delta_tile[ii])
                            p *= g
                            for d in range(D):
                                dv_acc[d] += p * dout_tile[ii, d]
                                dk_acc[d] += ds * q_tile[ii, d]
                cuda.syncthreads()
            if active:
                for d in range(D):
                    dk_value = dk_acc[d] * scale
                    dv_value = dv_acc[d]
                    if accumulate:
                        dk_value += dk[b, h, j, d]
                        dv_value += dv[b, h, j, d]
                    dk[b, h, j, d] = dk_value
                    dv[b, h, j, d] = dv_value

    return attention_forward_kernel, attention_dq_kernel, attention_dkdv_kernel


@cuda.jit
def attention_delta_kernel(delta, dout, out):
    # delta[B,H,T] = dout . out along D; one thread per row
    B, H, T, D = out.shape
    r = cuda.grid(1)
    if r < B * H * T:
        b = r // (H * T)
        h = (r // T) % H
        i = r % T
        delta[b, h, i] = row_dot(dout, out, b, h, i, i, D)


# --- launchers ---------------------------------------------------------------------------------

THREADS = 32 if SIMULATOR else 128      # the reference kernels' block; the fast ones' largest
ROWS_PER_BLOCK = 64                      # the fast kernels' default query (or key) tile
_fast_kernels = {}


def _fast(D, rows):
    """The fast kernels for head size D, with a block of threads sized for `rows` rows."""
    threads = min(THREADS, blocks(rows, 32) * 32)
    if (D, threads) not in _fast_kernels:
        _fast_kernels[D, threads] = make_attention_kernels(D, threads)
    return threads, _fast_kernels[D, threads]


def _check_attention(q, k, v, **others):
    check(len(q.shape) == 4, f"attention: q must be [B,H,T,D], got {q.shape}")
    B, H, T, D = q.shape
    for name, array in dict(k=k, v=v, **others).items():
        if array is not None:
            if name in ("lse", "delta"):
                check_shape(f"attention {name}", array, (B, H, T))
            else:
                check_shape(f"attention {name}", array, (B, H, T, D))
    return B, H, T, D


def _pick(D, kernel):
    if kernel == "auto":
        kernel = "fast" if D in FAST_HEAD_SIZES else "reference"
    check(kernel in ("fast", "reference"), f"attention: unknown kernel {kernel!r}")
    check(kernel == "reference" or D in FAST_HEAD_SIZES,
          f"attention: the fast kernels take D in {FAST_HEAD_SIZES}, got D={D}")
    return kernel


def dropout_arguments(p, seed, site):
    """The kernels' `drop` arguments for dropout probability p (seed: int64[1] on the device)."""
    threshold, keep = dropout_constants(p)
    return seed, np.int64(site), threshold, keep


def attention_forward(out, lse, q, k, v, kernel="auto", rows_per_block=None, dropout_p=0.0,
                      seed=None, site=0):
    """out = causal softmax(q k^T / sqrt(D)) v for every (batch, head); lse saved for backward.
    dropout_p > 0 drops attention probabilities (seed: int64[1] on the device, site: an int).

    rows_per_block (fast kernels): query rows per thread block, default ROWS_PER_BLOCK, so that
    B*H*T/64 blocks fill the GPU; rows_per_block=T gives one block per (batch, head).
    """
    check_float32(out=out, lse=lse, q=q, k=k, v=v)
    B, H, T, D = _check_attention(q, k, v, out=out, lse=lse)
    scale = np.float32(1.0 / math.sqrt(D))
    drop = dropout_arguments(dropout_p, _seed(seed, lse), site)
    if _pick(D, kernel) == "reference":
        launch(attention_forward_reference_kernel, B * H, THREADS, out, lse, q, k, v, scale,
               *drop)
        return
    rows = min(T, rows_per_block or ROWS_PER_BLOCK)
    threads, (forward, _, _) = _fast(D, rows)
    launch(forward, (B * H, blocks(T, rows)), threads, out, lse, q, k, v, scale, *drop, rows)


def attention_backward(dq, dk, dv, delta, dout, q, k, v, out, lse, accumulate=False,
                       kernel="auto", rows_per_block=None, dropout_p=0.0, seed=None, site=0):
    """dq, dk, dv (+)= the gradients of attention_forward (same dropout arguments); delta
    [B,H,T] is scratch."""
    check_float32(dq=dq, dk=dk, dv=dv, delta=delta, dout=dout, q=q, k=k, v=v, out=out, lse=lse)
    B, H, T, D = _check_attention(q, k, v, dq=dq, dk=dk, dv=dv, dout=dout, out=out, lse=lse,
                                  delta=delta)
    scale = np.float32(1.0 / math.sqrt(D))
    drop = dropout_arguments(dropout_p, _seed(seed, lse), site)
    if _pick(D, kernel) == "reference":
        launch(attention_backward_reference_kernel, B * H, THREADS,
               dq, dk, dv, delta, dout, q, k, v, out, lse, scale, *drop, accumulate)
        return
    rows = min(T, rows_per_block or ROWS_PER_BLOCK)
    threads, (_, dq_kernel, dkdv_kernel) = _fast(D, rows)
    launch(attention_delta_kernel, blocks(B * H * T, THREADS), THREADS, delta, dout, out)
    grid = (B * H, blocks(T, rows))
    launch(dq_kernel, grid, threads, dq, dout, q, k, v, lse, delta, scale, *drop, rows,
           accumulate)
    launch(dkdv_kernel, grid, threads, dk, dv, dout, q, k, v, lse, delta, scale, *drop, rows,
           accumulate)


_no_seeds = {}


def _seed(seed, like):
    """The seed array, or (no dropout) a placeholder on the same backend the kernels never read."""
    if seed is not None:
        return seed
    if "device" not in _no_seeds:
        from numba import cuda
        _no_seeds["device"] = cuda.to_device(np.zeros(1, dtype=np.int64))
    return _no_seeds["device"]


# --- NumPy twins ---------------------------------------------------------------------------------

def _probabilities(q, k, lse=None):
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


def attention_forward_numpy(out, lse, q, k, v, kernel="auto", rows_per_block=None,
                            dropout_p=0.0, seed=None, site=0):
    _check_attention(q, k, v, out=out, lse=lse)
    p, lse[...] = _probabilities(q, k)
    out[...] = (p * _dropout_factors(p.shape, dropout_p, seed, site)) @ v


def attention_backward_numpy(dq, dk, dv, delta, dout, q, k, v, out, lse, accumulate=False,
                             kernel="auto", rows_per_block=None, dropout_p=0.0, seed=None,
                             site=0):
    _check_attention(q, k, v, dq=dq, dk=dk, dv=dv, dout=dout, out=out, lse=lse, delta=delta)
    D = q.shape[-1]
    p, _ = _probabilities(q, k, lse)
    g = _dropout_factors(p.shape, dropout_p, seed, site)
    delta[...] = (dout * out).sum(axis=-1)
    ds = p * (g * (dout @ np.swapaxes(v, -1, -2)) - delta[..., None]) / np.sqrt(D)
    for grad, value in ((dq, ds @ k), (dk, np.swapaxes(ds, -1, -2) @ q),
                        (dv, np.swapaxes(p * g, -1, -2) @ dout)):
        if accumulate:
            grad += value
        else:
            grad[...] = value
