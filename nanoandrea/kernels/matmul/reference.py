"""Matrix multiply and its backward products: the definition, the NumPy twin, the reference kernel.

    out[M,N]  (+)=  op(a)[M,K] . op(b)[K,N]  (+ bias[N])      op(x) = x or x^T

Every linear layer of the model is one call (activations [B,T,C] are viewed as [B*T, C] rows):
    forward      Y[M,N]  = X[M,K] . W[K,N] + b          (W stored [in, out], as GPT-2 does)
    backward     dX[M,K] = dY[M,N] . W^T                transpose_b=True
                 dW[K,N] += X^T . dY                    transpose_a=True, accumulate=True
                 db[N]   += sum of dY's rows            reduce.sum_rows
    LM head      logits[M,V] = X[M,C] . wte[V,C]^T      transpose_b=True (tied to the embedding)
    MLP up       H[M,4C] = X . W + b, G = gelu(H)       gelu_out=G: GELU in the epilogue
    MLP down     dH[M,4C] = (dY . W^T) * gelu'(H)       gelu_input=H: GELU's backward in the
                                                        epilogue (the product is dG)
    q, k, v      dX = dQ . W_Q^T + dK . W_K^T           matmul_sum: one input, three products'
                      + dV . W_V^T                      gradients
`accumulate` says whether out is overwritten (=) or added to (+=): gradients of parameters
accumulate into the flat gradient buffer, and a tensor used twice sums its two gradients.

matmul_numpy is the definition every kernel of the family is tested against. The reference
kernel, matmul_tiled_kernel, computes it with one thread per output element and 16 x 16 tiles of
both operands staged through shared memory: any shape, any alignment, and the quicker kernel in
the simulator. Its launcher, matmul_reference, takes the family's arguments (GELU's epilogues
as passes of their own after the product).
"""
import numpy as np
from numba import cuda, float32

from ..gelu import gelu_backward, gelu_backward_numpy, gelu_forward, gelu_forward_numpy
from ..operands import (Bf16Matrix, bf16_matrix_values, round_bf16_numpy,
                        tf32_matrix_values)
from ..runtime.launch import (blocks, check, check_float32, check_shape, current_stream,
                              launch)

EPILOGUES = (None, "gelu", "gelu_grad")



# --- the NumPy twins: the definition -------------------------------------------------------

def matmul_numpy(out, a, b, bias=None, transpose_a=False, transpose_b=False, accumulate=False,
                 gelu_out=None, gelu_input=None, kernel="auto", b_transposed=None):
    check_matmul(out, a, b, bias, transpose_a, transpose_b, gelu_out, gelu_input)
    product = (a.T if transpose_a else a) @ (b.T if transpose_b else b)
    if bias is not None:
        product += bias
    if gelu_input is not None:
        gelu_backward_numpy(out, product, gelu_input, accumulate)
    elif accumulate:
        out += product
    else:
        out[...] = product
    if gelu_out is not None:
        gelu_forward_numpy(gelu_out, out)


def matmul_bf16_numpy(out, a, b, bias=None, transpose_a=False, transpose_b=False,
                      accumulate=False, gelu_out=None, gelu_input=None, b_transposed=None,
                      kernel="auto"):
    """matmul_numpy of a and b rounded to bf16 (Bf16Matrix operands, or float32 ones rounded
    here), the sums in out's precision. out may be a Bf16Matrix: the product (the sums in
    float32) rounded to bf16, as the next products read it; then not accumulated, and gelu_out,
    if given, is one too. gelu_out may be a Bf16Matrix: GELU of out as written, rounded to
    bf16. gelu_input may be a Bf16Matrix: its values are GELU's input."""
    if isinstance(gelu_input, Bf16Matrix):
        gelu_input = bf16_matrix_values(gelu_input)
    if isinstance(out, Bf16Matrix):
        check_bf16_out(accumulate, gelu_out)
        values = np.empty(out.shape, np.float32)
        product_of_values(bf16_matrix_values, values, a, b, bias, transpose_a, transpose_b,
                          False, None, gelu_input)
        round_bf16_numpy(out, values)
        if gelu_out is not None:
            gelu_forward_numpy(values, bf16_matrix_values(out))
            round_bf16_numpy(gelu_out, values)
        return
    gelu_array = np.empty(out.shape, out.dtype) if isinstance(gelu_out, Bf16Matrix) else gelu_out
    product_of_values(bf16_matrix_values, out, a, b, bias, transpose_a, transpose_b, accumulate,
                      gelu_array, gelu_input)
    if gelu_array is not gelu_out:
        round_bf16_numpy(gelu_out, gelu_array)


def check_bf16_out(accumulate, gelu_out):
    """What a product written as a Bf16Matrix allows: nothing to add to, GELU's output in bf16."""
    check(not accumulate, "matmul_bf16: a product in bf16 is not added to")
    check(gelu_out is None or isinstance(gelu_out, Bf16Matrix),
          "matmul_bf16: with out a Bf16Matrix, gelu_out is one too")


def product_of_values(values, out, a, b, bias, transpose_a, transpose_b, accumulate, gelu_out,
                      gelu_input):
    """matmul_numpy of values(a), values(b) (what the tensor cores multiply), in out's
    precision."""
    matmul_numpy(out, values(a).astype(out.dtype), values(b).astype(out.dtype), bias,
                 transpose_a, transpose_b, accumulate, gelu_out, gelu_input)


def matmul_tf32_numpy(out, a, b, bias=None, transpose_a=False, transpose_b=False,
                      accumulate=False, gelu_out=None, gelu_input=None, b_transposed=None,
                      kernel="auto"):
    """matmul_numpy of a and b rounded to tf32 (Tf32Matrix operands, or float32 ones rounded
    here), the sums in out's precision."""
    product_of_values(tf32_matrix_values, out, a, b, bias, transpose_a, transpose_b, accumulate,
                      gelu_out, gelu_input)


# --- the reference kernel ------------------------------------------------------------------

TILE = 16


@cuda.jit
def matmul_tiled_kernel(out, a, b, bias, has_bias, transpose_a, transpose_b, accumulate):
    # out[M,N] (+)= op(a)[M,K] . op(b)[K,N] (+ bias[N] if has_bias);  grid (N/16, M/16), block (16, 16)
    a_tile = cuda.shared.array((TILE, TILE), float32)      # a_tile[i, k] = op(a)[row0+i, k0+k]
    b_tile = cuda.shared.array((TILE, TILE), float32)      # b_tile[k, j] = op(b)[k0+k, col0+j]
    M, N = out.shape
    K = a.shape[0] if transpose_a else a.shape[1]
    ty = cuda.threadIdx.y
    tx = cuda.threadIdx.x
    row = cuda.blockIdx.y * TILE + ty
    col = cuda.blockIdx.x * TILE + tx
    total = float32(0.0)
    for k0 in range(0, K, TILE):
        k = k0 + tx                     # this thread loads op(a)[row, k] ...
        value = float32(0.0)
        if row < M and k < K:
            value = a[k, row] if transpose_a else a[row, k]
        a_tile[ty, tx] = value
        k = k0 + ty                     # ... and op(b)[k, col]
        value = float32(0.0)
        if k < K and col < N:
            value = b[col, k] if transpose_b else b[k, col]
        b_tile[ty, tx] = value
        cuda.syncthreads()
        for kk in range(TILE):
            total += a_tile[ty, kk] * b_tile[kk, tx]
        cuda.syncthreads()
    if row < M and col < N:
        if has_bias:
            total += bias[col]
        if accumulate:
            total += out[row, col]
        out[row, col] = total



# --- the launcher and what every launcher of the family shares --------------------------

def matmul_reference(out, a, b, bias=None, transpose_a=False, transpose_b=False,
                     accumulate=False, gelu_out=None, gelu_input=None):
    """out (+)= op(a) . op(b) (+ bias) by the reference kernel, then GELU's forward or backward
    as a pass of its own (float32 arrays, any shapes)."""
    check_float32(out=out, a=a, b=b, bias=bias, gelu_out=gelu_out, gelu_input=gelu_input)
    M, N, _ = check_matmul(out, a, b, bias, transpose_a, transpose_b, gelu_out, gelu_input)
    bias, has_bias = bias_argument(out, bias)
    grid, threads = (blocks(N, TILE), blocks(M, TILE)), (TILE, TILE)
    if gelu_input is not None:              # the product, then GELU's backward
        product = cuda.device_array((M, N), dtype=np.float32, stream=current_stream())
        launch(matmul_tiled_kernel, grid, threads, product, a, b, bias, has_bias, transpose_a,
               transpose_b, False)
        gelu_backward(out, product, gelu_input, accumulate)
        return
    launch(matmul_tiled_kernel, grid, threads, out, a, b, bias, has_bias, transpose_a,
           transpose_b, accumulate)
    if gelu_out is not None:
        gelu_forward(gelu_out, out)


def bias_argument(out, bias):
    """(the bias array a kernel is given, has_bias): kernels take arrays, not None, so
    without a bias a placeholder that is never read."""
    if bias is None:            # (out's first float; of a Bf16Matrix's pairs, their bits)
        first = out.reshape(out.size)[:1]
        return (first if first.dtype == np.float32 else first.view(np.float32)), False
    return bias, True



def epilogue_of(gelu_out, gelu_input):
    """The kernels' epilogue for these arguments: "gelu", "gelu_grad" or None."""
    if gelu_out is not None:
        return "gelu"
    return "gelu_grad" if gelu_input is not None else None


def check_matmul(out, a, b, bias, transpose_a, transpose_b, gelu_out, gelu_input):
    check(len(out.shape) == 2 and len(a.shape) == 2 and len(b.shape) == 2,
          f"matmul: out, a, b must be 2-D, got {out.shape}, {a.shape}, {b.shape}")
    M, N = out.shape
    K = a.shape[0] if transpose_a else a.shape[1]
    check_shape("matmul a", a, (K, M) if transpose_a else (M, K))
    check_shape("matmul b", b, (N, K) if transpose_b else (K, N))
    if bias is not None:
        check_shape("matmul bias", bias, (N,))
    check(gelu_out is None or gelu_input is None, "matmul: gelu_out or gelu_input, not both")
    for name, gelu_array in (("gelu_out", gelu_out), ("gelu_input", gelu_input)):
        if gelu_array is not None:
            check_shape(f"matmul {name}", gelu_array, (M, N))
    return M, N, K


