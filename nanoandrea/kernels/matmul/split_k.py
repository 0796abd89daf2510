"""Split-K: a product whose M x N grid alone leaves multiprocessors idle is cut along K.

    grid z takes rows [z * k_per_slice, (z + 1) * k_per_slice) of K; each slice's partial
    product goes to partials[z, M, N]; sum_splits adds them in order z = 0, 1, ... (+ bias),
    so the result is the same bits whatever the schedule; GELU's epilogue, if any, follows.

The weight gradients are the products that need it: dW = X^T . dY has K = B*T long and
M x N = C x C or C x 4C small. split_count chooses the slices from the device's
multiprocessors and L2 (runtime/device.py), so the choice follows the card.
"""
import numpy as np
from numba import cuda, float32

from ..gelu import gelu_backward, gelu_forward
from ..ptx.vector import load4, store4
from ..runtime import device
from ..runtime.launch import blocks, current_stream, elementwise_grid, launch


def k_per_slice(K, splits, step):
    """Rows of K in each of `splits` slices: K / splits, rounded up to whole slices of `step`
    (the kernel's k a slice)."""
    return blocks(blocks(K, splits), step) * step


def split_count(M, N, K, slots, step, value_bytes, tile):
    """How many slices of K to compute in parallel. Only when the M x N grid alone leaves
    multiprocessors idle (the weight gradients: M x N = C x C or C x 4C, K = B*T), and never
    slices thinner than 256. A grid runs in waves of `slots` blocks (the kernel's resident
    blocks on this device), so 288 blocks take as long as 528: the count chosen is the smallest
    whose last wave is at least 90% full and whose slice of both operands' rows, k_per_slice x
    (M + N) values of `value_bytes` each (4 for float32 operands, 2 for bf16), fits in half the
    device's L2 (else the smallest well-filled one; else the one that fills its waves best).
    Slices whose rows overflow the L2 leave it before all the blocks that read them have
    (docs/perf.md). step: the kernel's k a slice; tile: a block's tile of out."""
    l2_bytes = device.current().l2_bytes
    output_blocks = blocks(M, tile[0]) * blocks(N, tile[1])
    if output_blocks >= slots:
        return 1

    def fill(splits):                   # busy fraction of the waves the grid needs
        total = output_blocks * splits
        return total / (blocks(total, slots) * slots)

    def fits(splits):                   # the slice's rows of both operands in half the L2
        return value_bytes * k_per_slice(K, splits, step) * (M + N) <= l2_bytes // 2

    candidates = range(1, max(1, min(K // 256, 8 * slots // output_blocks)) + 1)
    good = [s for s in candidates if fill(s) >= 0.9]
    return ([s for s in good if fits(s)] or good or [max(candidates, key=fill)])[0]


@cuda.jit
def sum_splits_kernel(out, partials, bias, has_bias, accumulate, N):
    # out[M*N] (+)= sum over z of partials[z, M*N] (+ bias along each row of N), in order z =
    # 0, 1, ...; flat views, 4 consecutive elements a step (N % 4 == 0: the 4 are in one row)
    for i in range(cuda.grid(1) * 4, out.shape[0], cuda.gridsize(1) * 4):
        t0 = t1 = t2 = t3 = float32(0.0)
        if has_bias:
            t0, t1, t2, t3 = load4(bias, (i % N,))
        for z in range(partials.shape[0]):
            x = load4(partials, (z, i))
            t0, t1, t2, t3 = t0 + x[0], t1 + x[1], t2 + x[2], t3 + x[3]
        if accumulate:
            x = load4(out, (i,))
            t0, t1, t2, t3 = t0 + x[0], t1 + x[1], t2 + x[2], t3 + x[3]
        store4(out, (i,), t0, t1, t2, t3)


def sum_splits(out, partials, bias, has_bias, accumulate):
    """out[M,N] (+)= the split-K partials [S,M,N] summed in order (+ bias)."""
    M, N = out.shape
    S = partials.shape[0]
    launch(sum_splits_kernel, *elementwise_grid(M * N // 4), out.reshape(M * N),
           partials.reshape(S, M * N), bias, has_bias, accumulate, N)


# --- what each launcher of the family calls -------------------------------------------------

def partials(splits, M, N):
    """A new [splits, M, N] float32 array for the slices' partial products."""
    return cuda.device_array((splits, M, N), dtype=np.float32, stream=current_stream())


def finish(out, partial_products, bias, has_bias, accumulate, gelu_out, gelu_input):
    """out (+)= the slices' partial products summed in order (+ bias), then GELU's forward
    (gelu_out = gelu(out)) or backward (out (+)= gelu'(gelu_input) * the sum)."""
    M, N = out.shape
    if gelu_input is None:
        sum_splits(out, partial_products, bias, has_bias, accumulate)
    else:
        product = cuda.device_array((M, N), dtype=np.float32, stream=current_stream())
        sum_splits(product, partial_products, bias, has_bias, False)
        gelu_backward(out, product, gelu_input, accumulate)
    if gelu_out is not None:
        gelu_forward(gelu_out, out)
