"""The package's backward: dq's shares from dk/dv, summed in order.
H100 2026-12-07: fwd+bwd 0.98x SDPA float32 at [16,12,1024,64] (fwd 1.01x)

This version calls the package's backward (attention_backward, kernel="float32"): it is what
the product runs, and a copy here would only duplicate it. v4 computes S and dP twice, once
in each kernel; here the dk/dv kernel computes them once for all three gradients. For each
pair of a key tile and a query tile it has dS in shared memory already (for dk += dS^T Q),
so it also makes dq's share from that pair, dS K [query tile, D], a fifth product on the
same tiles, and stores it in a buffer of its own, one slot per pair (the pairs of a causal
head packed). A small sum kernel then adds each query row's shares over its key tiles in
order of the key tile: 5 products a pair instead of 7, q and dout staged once instead of
twice, and dq still reproducible to the bit. The price is the shares' round trip through
memory (written once, read once by the sum), which v6 replaces with atomic adds. At D=64 the
key tiles are two query tiles long (64 keys, 68 KB of dynamic shared memory): the staged q
and dout then serve twice the keys, and there are half as many shares. The forward is v3's.
"""
import numpy as np
from numba import cuda

from nanoandrea.kernels.attention import attention_backward, attention_forward

HEAD_SIZES = (32, 64)
_deltas = {}


def forward(out, lse, q, k, v):
    attention_forward(out, lse, q, k, v, kernel="float32")


def backward(dq, dk, dv, dout, q, k, v, out, lse):
    B, H, T, _ = q.shape
    if (B, H, T) not in _deltas:      # (delta_i = dout_i . out_i, the backward's scratch)
        _deltas[B, H, T] = cuda.device_array((B, H, T), np.float32)
    attention_backward(dq, dk, dv, _deltas[B, H, T], dout, q, k, v, out, lse, kernel="float32")
