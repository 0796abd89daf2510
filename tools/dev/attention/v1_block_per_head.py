"""One block per (batch, head), a thread per row, global memory.
H100 2026-12-07: fwd+bwd 0.00x SDPA float32 at [16,12,1024,64] (fwd 0.01x)

The starting point, and the design of the package's first reference kernels (any D), without
dropout (attention.py's reference kernels are now a warp a row: lanes split D). A block
takes one (batch, head) pair; its threads share out the rows. A thread walks the keys of its
row twice: first for the softmax normaliser (a running max m and sum l of exp(S - m), so
that no exp overflows), then for the weighted sum of the values, recomputing every score.
Each score costs 2D loads from global memory, and nothing is shared between the threads
(each reads every key and value of its row itself, through the caches), so the kernel is bound
by loads; and B*H blocks leave most of the GPU's 132 multiprocessors idle when B*H is small.
The backward takes the same shape: after delta_i = dout_i . out_i, a thread per query row
makes dq, then a thread per key row makes dk and dv, each recomputing P from lse.

    S_ij = q_i . k_j / sqrt(D) (j <= i), P_ij = exp(S_ij - lse_i), out_i = sum_j P_ij v_j
    dv_j = sum_i P_ij dout_i, dS_ij = P_ij (dout_i . v_j - delta_i),
    dq_i = sum_j dS_ij k_j / sqrt(D), dk_j = sum_i dS_ij q_i / sqrt(D)
"""
import math

import numpy as np
from numba import cuda, float32

from nanoandrea.kernels.runtime.launch import SIMULATOR, inlined, launch

HEAD_SIZES = None                       # any D
THREADS = 32 if SIMULATOR else 128      # a block's threads, sharing out the head's rows
NEG_INF = float32(-np.inf)


@inlined
def row_dot(x, y, b, h, i, j, D):
    # x[b,h,i,:] . y[b,h,j,:]
    total = float32(0.0)
    for d in range(D):
        total += x[b, h, i, d] * y[b, h, j, d]
    return total


@cuda.jit
def forward_kernel(out, lse, q, k, v, scale):
    # out[B,H,T,D], lse[B,H,T] from q, k, v [B,H,T,D]; grid B*H, block THREADS
    B, H, T, D = q.shape
    b = cuda.blockIdx.x // H
    h = cuda.blockIdx.x % H
    for i in range(cuda.threadIdx.x, T, cuda.blockDim.x):
        m = NEG_INF                                 # pass 1: the normaliser
        l = float32(0.0)
        for j in range(i + 1):
            s = row_dot(q, k, b, h, i, j, D) * scale
            m_new = max(m, s)
            l = l * math.exp(m - m_new) + math.exp(s - m_new)
            m = m_new
        row_lse = m + math.log(l)
        lse[b, h, i] = row_lse
        for d in range(D):                          # pass 2: out_i = sum_j P_ij v_j
            out[b, h, i, d] = float32(0.0)
        for j in range(i + 1):
            p = math.exp(row_dot(q, k, b, h, i, j, D) * scale - row_lse)
            for d in range(D):
                out[b, h, i, d] += p * v[b, h, j, d]


@cuda.jit
def backward_kernel(dq, dk, dv, delta, dout, q, k, v, out, lse, scale):
    # dq, dk, dv [B,H,T,D] = gradients; delta[B,H,T] scratch; grid B*H, block THREADS.
    # The block owns its head, so the phases need only block-wide barriers between them.
    B, H, T, D = q.shape
    b = cuda.blockIdx.x // H
    h = cuda.blockIdx.x % H
    first = cuda.threadIdx.x
    stride = cuda.blockDim.x
    for i in range(first, T, stride):                       # delta_i = dout_i . out_i
        delta[b, h, i] = row_dot(dout, out, b, h, i, i, D)
        for d in range(D):
            dq[b, h, i, d] = float32(0.0)
            dk[b, h, i, d] = float32(0.0)
            dv[b, h, i, d] = float32(0.0)
    cuda.syncthreads()
    for i in range(first, T, stride):                       # dq_i: a thread per query row
        for j in range(i + 1):
            p = math.exp(row_dot(q, k, b, h, i, j, D) * scale - lse[b, h, i])
            ds = p * (row_dot(dout, v, b, h, i, j, D) - delta[b, h, i]) * scale
            for d in range(D):
                dq[b, h, i, d] += ds * k[b, h, j, d]
    for j in range(first, T, stride):                       # dk_j, dv_j: a thread per key row
        for i in range(j, T):
            p = math.exp(row_dot(q, k, b, h, i, j, D) * scale - lse[b, h, i])
            ds = p * (row_dot(dout, v, b, h, i, j, D) - delta[b, h, i]) * scale
            for d in range(D):
                dv[b, h, j, d] += p * dout[b, h, i, d]
                dk[b, h, j, d] += ds * q[b, h, i, d]


def forward(out, lse, q, k, v):
    B, H, T, D = q.shape
    launch(forward_kernel, B * H, THREADS, out, lse, q, k, v, np.float32(1 / math.sqrt(D)))


_deltas = {}


def backward(dq, dk, dv, dout, q, k, v, out, lse):
    B, H, T, D = q.shape
    if (B, H, T) not in _deltas:
        _deltas[B, H, T] = cuda.device_array((B, H, T), np.float32)
    launch(backward_kernel, B * H, THREADS, dq, dk, dv, _deltas[B, H, T], dout, q, k, v, out,
           lse, np.float32(1 / math.sqrt(D)))
