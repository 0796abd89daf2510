"""The package's wgmma attention (kernels/attention/wgmma.py): v10, its second wait deferred.
H100 2026-12-07: fwd+bwd 0.67x SDPA bf16 at [16,12,1024,64] (fwd 0.45x)

As first kept (H200, 2026-12-03) it was no faster than v10, for 15-25% fewer instructions:
what held both was not their issue; the package kept this one, whose tiles already overlap
their products, the shape a deeper pipeline needs. The figure above is the package's kernel
as it is now: called as the ladder calls it, each call rounding float32 q, k, v and dout
(0.561 ms); given q, k, v in bf16 already, as the model and SDPA have them, 0.389 ms, 0.96x
(forward 0.86x; tools/bench.py --only attention --precision bf16).

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
Offline (sm_90a, `python tools/profile/kernel_report.py --sass --only "attention wgmma"`):
instructions a tile off the diagonal at D = 64, forward 324 (v10: ~390), dq 288 (~380), dk/dv
456 (~530). Later, in the package: at D = 64 the backward's second product waited for within
its tile under launch bounds of 4 (dq) and 3 (dk/dv) blocks a multiprocessor (kept in flight,
ptxas serialized every wgmma: its warning C7512); dq stages dout itself, rounding it and
summing each row's delta while its K and V tiles are on their way; each copy issued as soon
as its stage is free; every load before the stores in dq.
Here it runs as the ladder calls it: float32 q, k, v, dout, each call rounding them, no dropout.
"""
import numpy as np
from numba import cuda

from nanoandrea.kernels.attention import attention_backward_bf16, attention_forward_bf16
from nanoandrea.kernels.attention.wgmma import HEAD_SIZES  # noqa: F401 (what run.py reads)

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
