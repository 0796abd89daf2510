"""The package's wgmma attention (nanoandrea/kernels/attention_wgmma.py): v10, its second wait deferred.
H200: not yet measured (predicted in docs/perf.md, "Attention on wgmma")

What changed since v10, all in the package:
  deferred wait  each tile's second product (O += P V; dQ += dS K; dV, dK) is left running:
                 the next tile's scores are issued behind it and one wait covers both, so the
                 tensor cores run them back to back. A second barrier a tile, after that wait,
                 tells every warp that the last tile's stage is free for the next copies
  masks read     the causal mask is read into the max and the probabilities (a score of a
                 masked pair counts as -inf, its probability as 0), never written into the
                 scores: ptxas serializes every wgmma of a kernel in which another
                 instruction writes a wgmma's accumulators while one is in flight (its
                 warning C7515), and with the deferred wait one always is. The tiles that
                 cross the diagonal have a loop of their own, the others no mask at all
  descriptors    made once a kernel; a k16 step, a stage, the second way of reading a tile
                 are constants added to them (v10 built each wgmma's two from its addresses)
  copies         a thread's copy offsets made once (v10 recomputed them each tile)
Offline (sm_90a, `python tools/kernel_report.py --sass --only "attention wgmma"`): instructions
a tile off the diagonal at D = 64, forward 324 (v10: ~390), dq 288 (~380), dk/dv 456 (~530).
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
