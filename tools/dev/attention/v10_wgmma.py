"""wgmma: a warpgroup's [64, N] x [N, 16] products, P and dS as A from the registers.
H200: not yet measured (predicted in docs/perf.md, "Attention on wgmma")

The package's attention on Hopper (nanoandrea/kernels/attention_wgmma.py): v9's walk, each
product one instruction for a warpgroup (4 warps, 128 threads) in place of a warp's mma.sync.
The tensor cores read B straight from the shared tiles (no ldmatrix); the A of the second
product of each pair, P or dS, comes from the registers the first product left its scores in.
A block is one warpgroup and 64 rows; the streamed tiles are 64 rows of 128 bytes, and each
serves two products through two descriptors (K-major for the scores, MN-major for O, dQ, dK,
dV). Three kernels as before (forward, dq, dk/dv), no atomics.
Here it runs as the ladder calls it: float32 q, k, v, dout, each call rounding them, no dropout.
"""
import numpy as np
from numba import cuda

from nanoandrea.kernels.attention_bf16 import attention_backward_bf16, attention_forward_bf16
from nanoandrea.kernels.attention_wgmma import HEAD_SIZES  # noqa: F401

PRECISION = "bf16"


def forward(out, lse, q, k, v):
    attention_forward_bf16(out, lse, q, k, v, kernel="wgmma")


_deltas = {}


def backward(dq, dk, dv, dout, q, k, v, out, lse):
    B, H, T, D = q.shape
    if (B, H, T) not in _deltas:      # (delta_i = dout_i . out_i, the backward's scratch)
        _deltas[B, H, T] = cuda.device_array((B, H, T), np.float32)
    attention_backward_bf16(dq, dk, dv, _deltas[B, H, T], dout, q, k, v, out, lse,
                            kernel="wgmma")
