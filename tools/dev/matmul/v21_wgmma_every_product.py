"""The package's wgmma kernel (kernels/matmul/wgmma.py): v20 with what training needs.
H100 2026-12-07: 0.69x cuBLAS bf16 at 16384x3072x768 (b^T 0.66x, a^T 0.68x)

    out[M,N] = op(a)[M,K] @ op(b)[K,N]    a, b bf16 (uint32 pairs), stored as they are
                                          transposed or not; out float32; any M, K, and N a
                                          multiple of 8

v20 multiplies a[M,K] by b[K,N] in whole tiles. The package's kernel keeps its block (a TMA
producer, two consumers of 64 x 256, setmaxnreg, each tile stored a box at a time by TMA)
and adds:
  - the transposed operands: other tensor maps and wgmma majors. a^T [K,M] comes as two boxes
    of 64 k x 64 m (MN-major, one a consumer), b^T [N,K] as one box of 256 n x 64 k (K-major);
  - edges: the copy engine's zeros past an operand's edge, and its stores' clipping;
  - split-K, the partial tiles as 3-D boxes of out [S, M, N];
  - the epilogues: bias added from memory, out += by the engine's reduce-add store, GELU and
    its output (a box of each a pass), GELU's backward (its input's box loaded into the buffer
    first), bf16 out (a box of 64 bf16 columns).
Here it runs as the ladder calls it: the plain product of each orientation.
"""
from nanoandrea.kernels.matmul.wgmma import matmul_wgmma
from nanoandrea.kernels.operands import Bf16Matrix

PRECISION = "bf16"
MULTIPLE_OF = (8, 8, 8)                 # (rows of whole 16-byte copies: no pad to add)
TRANSPOSES = ((False, False), (False, True), (True, False))    # x W, dY W^T, x^T dY


def matmul(out, a, b, transpose_a=False, transpose_b=False):
    matmul_wgmma(out, Bf16Matrix(a, 2 * a.shape[1]), Bf16Matrix(b, 2 * b.shape[1]),
                 transpose_a=transpose_a, transpose_b=transpose_b)
