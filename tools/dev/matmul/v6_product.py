"""The package's fast kernel: v5 + edges, split-K, epilogues.
H200 2026-12-01: 0.97x cuBLAS float32, 46.0 TFLOP/s at 16384x3072x768 (tools/dev/run.py)

    out[M,N] = a[M,K] @ b[K,N]          float32, row-major; rows of 4k floats (16-byte runs)

nanoandrea.kernels.matmul.matmul with kernel="fast": v5's main loop, built per transpose of
either operand, with edge checks (any M, N, K whose rows are 16-byte runs), split-K for
products whose M x N tiles alone would leave multiprocessors idle (the weight gradients), and
the bias, GELU and accumulation folded into the epilogue. For this NN product without bias it
is v5 with edge checks; where it is slower or faster than v5, that is their cost or gain.
"""
from nanoandrea.kernels.matmul import matmul as product_matmul

MULTIPLE_OF = (1, 4, 4)     # M, N, K: rows of a, b and out whole 16-byte runs


def matmul(out, a, b):
    product_matmul(out, a, b, kernel="fast")
