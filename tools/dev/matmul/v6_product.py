"""The package's float32 kernel (kernels/matmul/float32.py): v5 + edges, split-K, epilogues.
H100 2026-12-07: 0.89x cuBLAS float32 at 16384x3072x768

    out[M,N] = a[M,K] @ b[K,N]          float32, row-major; rows of 4k floats (16-byte runs)

The package's register-blocked SGEMM, through its launcher (matmul_float32): v5's main loop,
built per transpose of either operand, with edge checks (any M, N, K whose rows are 16-byte
runs), split-K for products whose M x N tiles alone would leave multiprocessors idle (the weight
gradients), and the bias, GELU and accumulation folded into the epilogue. For this NN product
without bias it is v5 with edge checks; where it is slower or faster than v5, that is their cost
or gain.
"""
from nanoandrea.kernels.matmul.float32 import matmul_float32

MULTIPLE_OF = (1, 4, 4)     # M, N, K: rows of a, b and out whole 16-byte runs


def matmul(out, a, b):
    matmul_float32(out, a, b)
