"""The package's mma.sync attention (kernels/attention/mma_sync.py): v8 pipelined, lean softmax.
H100 2026-12-07: fwd+bwd 0.46x SDPA bf16 at [16,12,1024,64] (fwd 0.38x)

Two steps since v8, both in the package:
  staging    q, k, v and dout are rounded once into bf16 pairs in device memory
             (operands.heads_bf16: one pass, half the bytes), so that a streamed tile is a
             run of whole 16-byte chunks that cp.async copies into shared memory without
             registers, one tile ahead of the products (two stages, one barrier a tile):
             0.30x SDPA bf16 with this step alone
  softmax    v8's forward issued 703 instructions a tile for its 64 HMMA (Nsight Compute: 62%
             of cycles issuing, 2.56 IPC): libdevice's exp2f (a test and two multiplies a
             value), a scale multiply and a subtract a score, the causal mask's 64-bit compares
             on every tile, ldmatrix addresses recomputed for each load. Now a score costs one
             FFMA (S scale - m, the max taken of the raw scores) and one ex2.approx; the mask
             runs only on the tiles that cross the diagonal, 32-bit; a lane's ldmatrix address
             is one sum a k16 step (rows 16 apart are swizzled alike): 534 instructions a tile
             (dq 872 -> 532, dk/dv 1,074 -> 730)
Here it runs as the ladder calls it: float32 q, k, v, dout, no dropout. (The model rounds q, k,
v once for its forward and backward, straight from the [B,T,C] products: ops.attention.) The
package takes these kernels on GPUs before Hopper; on Hopper, v10's (kernel="mma" names these).
"""
import numpy as np
from numba import cuda

from nanoandrea.kernels.attention import attention_backward_bf16, attention_forward_bf16
from nanoandrea.kernels.attention.mma_sync import HEAD_SIZES  # noqa: F401 (what run.py reads)

PRECISION = "bf16"


def forward(out, lse, q, k, v):
    attention_forward_bf16(out, lse, q, k, v, kernel="mma")


_deltas = {}


def backward(dq, dk, dv, dout, q, k, v, out, lse):
    B, H, T, D = q.shape
    if (B, H, T) not in _deltas:      # (delta_i = dout_i . out_i, the backward's scratch)
        _deltas[B, H, T] = cuda.device_array((B, H, T), np.float32)
    attention_backward_bf16(dq, dk, dv, _deltas[B, H, T], dout, q, k, v, out, lse, kernel="mma")
