"""Ping-pong: each consumer a tile of its own, its epilogue beside the other's mainloop.
not measured

    out[M,N] = op(a)[M,K] @ op(b)[K,N]    a, b bf16 (uint32 pairs), stored as they are
                                          transposed or not; out float32; any M, K, and N a
                                          multiple of 8

v21's two consumers share each 128 x 256 tile, 64 rows each: they multiply together, then both
write their sums out, and while they do the tensor cores wait. With K = 768 (a 768-wide
layer's products, the MLP up) a tile is 12 slices of 64, and the epilogue costs about two
slices' time, GELU's about four: the products of short K ran at 0.58-0.77x cuBLAS where those
of K = 3072 ran at 0.85x. Here the block's tiles are 64 x 256 and the consumers take them in
turns (tiles 0, 2, 4, ... the first, 1, 3, 5, ... the second), as CUTLASS's "ping-pong"
kernels do. The producer fills the stages in the tiles' order, so the ring of stages itself
staggers the consumers: the second's first slice lands once the first has released the stages
before it, and while one writes its tile out the other's wgmma's keep the tensor cores busy.
What it costs: a stage carries op(a)'s 64 rows for 256 columns of op(b) (40 KB for 64 x 256 x
64 of work, where v21's 48 KB served 128 x 256 x 64), so more bytes from the L2 a flop. The
package's kernel with pingpong=True (kernels/matmul/wgmma.py), as v21 is it with False.
"""
from nanoandrea.kernels.matmul.wgmma import matmul_wgmma
from nanoandrea.kernels.operands import Bf16Matrix

PRECISION = "bf16"
MULTIPLE_OF = (8, 8, 8)                 # (rows of whole 16-byte copies: no pad to add)
TRANSPOSES = ((False, False), (False, True), (True, False))    # x W, dY W^T, x^T dY


def matmul(out, a, b, transpose_a=False, transpose_b=False):
    matmul_wgmma(out, Bf16Matrix(a, 2 * a.shape[1]), Bf16Matrix(b, 2 * b.shape[1]),
                 transpose_a=transpose_a, transpose_b=transpose_b, pingpong=True)
