"""The package's wgmma attention (nanoandrea/kernels/attention_wgmma.py): v10, its second wait deferred.
H200 2026-12-03: fwd 0.089 ms (0.93x SDPA bf16), fwd+bwd 0.466 ms (0.76x) at [16,12,1024,64],
q, k, v given in bf16 (v10: 0.090 / 0.460, the same within a run's spread); 0.030 / 0.158 ms
(1.30x / 1.09x) at [64,12,256,32] (tools/bench.py --only attention --precision bf16,
docs/runs/2026-12-03/v11-*.log). No faster than v10, for 15-25% fewer instructions: what holds
both is not their issue; the package keeps this one, whose tiles already overlap their
products, the shape a deeper pipeline needs

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
