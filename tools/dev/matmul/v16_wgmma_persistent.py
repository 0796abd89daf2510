"""The package's wgmma kernel (nanoandrea/kernels/matmul_wgmma.py): v15, persistent.
H200 2026-12-02: 0.62x cuBLAS bf16, 434 TFLOP/s at 16384x3072x768 (tools/bench.py --only matmul)

    out[M,N] = op(a)[M,K] @ op(b)[K,N]    as v15: a, b bf16 (uint32 pairs), stored as they
                                          are transposed or not; out float32; any M, K, and
                                          N a multiple of 8

v12-v15 launch a block a tile, and a tile of 12 slices (K = 768) spends nearly as long
starting and ending as multiplying: its pipeline starts empty, two slices' copies waited for
before the first wgmma, and it ends storing 64 KB of sums four bytes at a time. The package's
kernel keeps v15's block and changes that: the grid is the blocks the GPU holds at once (2 an
SM), each takes every 264th tile, and its copies run on from one tile into the next, so a
tile's first slices arrive while the last tile's last slices multiply and its sums are
stored; the stores are 8 bytes, two sums each. It adds what the training step needs: edges
(zeros copied past M, N and K), bias and GELU epilogues, split-K. Here it runs as the ladder
calls it: the plain product of each orientation.
"""
from nanoandrea.kernels.matmul_bf16 import Bf16Matrix
from nanoandrea.kernels.matmul_wgmma import matmul_wgmma

PRECISION = "bf16"
MULTIPLE_OF = (8, 8, 8)                 # (rows of whole 16-byte copies: no pad to add)
TRANSPOSES = ((False, False), (False, True), (True, False))    # x W, dY W^T, x^T dY


def matmul(out, a, b, transpose_a=False, transpose_b=False):
    matmul_wgmma(out, Bf16Matrix(a, 2 * a.shape[1]), Bf16Matrix(b, 2 * b.shape[1]),
                 transpose_a=transpose_a, transpose_b=transpose_b)
