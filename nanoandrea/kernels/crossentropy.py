"""Softmax cross-entropy over the vocabulary, fused: the probabilities are never stored.

    logits : [N,V]    (N = B*T positions)      targets: int32 [N]
    losses : [N]      losses[n] = lse[n] - logits[n, targets[n]]
    lse    : [N]      log sum_v exp(logits[n, v]), saved for backward
    loss   : [1]      mean of losses
Backward of the mean loss (dloss: [1], the upstream gradient, usually 1):
    dlogits[n, v] = (exp(logits[n, v] - lse[n]) - [v == targets[n]]) * dloss / N
The max is subtracted before exp, so logits of magnitude 100 (or 1e4) are fine in float32.
"""
import math

import numpy as np
from numba import cuda, float32

from .launch import SIMULATOR, check, check_float32, check_shape, launch
from .reduce import MAX_THREADS, block_max, block_sum

THREADS = 32 if SIMULATOR else 256
NEG_INF = float32(-np.inf)


@cuda.jit
def crossentropy_forward_kernel(losses, lse, logits, targets):
    # losses[N], lse[N] from logits[N,V]; one block per row, threads stride over V
    scratch = cuda.shared.array(MAX_THREADS, float32)
    n = cuda.blockIdx.x
    V = logits.shape[1]
    row_max = NEG_INF
    for v in range(cuda.threadIdx.x, V, cuda.blockDim.x):
        row_max = max(row_max, logits[n, v])
    row_max = block_max(row_max, scratch)
    total = float32(0.0)
    for v in range(cuda.threadIdx.x, V, cuda.blockDim.x):
        total += math.exp(logits[n, v] - row_max)
    row_lse = row_max + math.log(block_sum(total, scratch))
    if cuda.threadIdx.x == 0:
        lse[n] = row_lse
        losses[n] = row_lse - logits[n, targets[n]]


@cuda.jit
def crossentropy_backward_kernel(dlogits, logits, lse, targets, dloss, accumulate):
    # dlogits[N,V] (+)= (softmax - onehot) * dloss[0] / N; one block per row
    n = cuda.blockIdx.x
    N, V = logits.shape
    scale = dloss[0] / N
    row_lse = lse[n]
    target = targets[n]
    for v in range(cuda.threadIdx.x, V, cuda.blockDim.x):
        grad = math.exp(logits[n, v] - row_lse)
        if v == target:
            grad -= float32(1.0)
        grad *= scale
        if accumulate:
            grad += dlogits[n, v]
        dlogits[n, v] = grad


@cuda.jit
def mean_kernel(out, x):
    # out[0] = mean of x[N]; a single block, fixed order
    scratch = cuda.shared.array(MAX_THREADS, float32)
    total = float32(0.0)
    for i in range(cuda.threadIdx.x, x.shape[0], cuda.blockDim.x):
        total += x[i]
    total = block_sum(total, scratch)
    if cuda.threadIdx.x == 0:
        out[0] = total / x.shape[0]


def _check(logits, targets, **rows):
    check(len(logits.shape) == 2, f"cross-entropy: logits must be [N,V], got {logits.shape}")
    N = logits.shape[0]
    check_shape("cross-entropy targets", targets, (N,))
    for name, array in rows.items():
        check_shape(f"cross-entropy {name}", array, logits.shape if name == "dlogits" else (N,))


def crossentropy_forward(loss, losses, lse, logits, targets):
    """loss[1] = mean cross-entropy; losses[N] per position; lse[N] saved for backward."""
    check_float32(loss=loss, losses=losses, lse=lse, logits=logits)
    check(targets.dtype == np.int32, f"cross-entropy: targets must be int32, got {targets.dtype}")
    _check(logits, targets, losses=losses, lse=lse)
    launch(crossentropy_forward_kernel, logits.shape[0], THREADS, losses, lse, logits, targets)
    launch(mean_kernel, 1, THREADS, loss, losses)


def crossentropy_backward(dlogits, dloss, logits, lse, targets, accumulate=False):
    check_float32(dlogits=dlogits, dloss=dloss, logits=logits, lse=lse)
    _check(logits, targets, dlogits=dlogits, lse=lse)
    launch(crossentropy_backward_kernel, logits.shape[0], THREADS,
           dlogits, logits, lse, targets, dloss, accumulate)


def crossentropy_forward_numpy(loss, losses, lse, logits, targets):
    _check(logits, targets, losses=losses, lse=lse)
    m = logits.max(axis=1, keepdims=True)
    lse[...] = (m + np.log(np.exp(logits - m).sum(axis=1, keepdims=True)))[:, 0]
    losses[...] = lse - logits[np.arange(logits.shape[0]), targets]
    loss[...] = losses.mean()


def crossentropy_backward_numpy(dlogits, dloss, logits, lse, targets, accumulate=False):
    _check(logits, targets, dlogits=dlogits, lse=lse)
    grad = np.exp(logits - lse[:, None])
    grad[np.arange(logits.shape[0]), targets] -= 1.0
    grad *= dloss[0] / logits.shape[0]
    if accumulate:
        dlogits += grad
    else:
        dlogits[...] = grad
