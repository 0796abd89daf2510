"""Split the fused projection into heads, and merge (concatenate) the heads back.

    split_heads:  x[B,T,C] -> view [B,T,H,D] -> transpose -> out[B,H,T,D]
    merge_heads:  x[B,H,T,D] -> transpose -> [B,T,H,D] -> view -> out[B,T,C]      (C = H*D)

Q = X.W_Q computes every head at once: head h is the column block Q[:, :, h*D:(h+1)*D].
split_heads moves each head's T x D slice into one contiguous block, because the attention
kernel reads a head's rows one after another. merge_heads is the exact inverse (the concat of
the heads), so each is the other's backward: the gradient of a permutation is the inverse
permutation. No arithmetic happens here, only data movement (and an add when accumulating).

heads_view(x, H) is the same [B,H,T,D] indexing of x[B,T,C] without a copy: a view whose rows
(a head's D floats at one t) are contiguous and C floats apart. The attention kernels write
their outputs through such views (ops.attention, ops.merge_heads): each head's rows land
straight in their place in the concat, and merging the heads is the attention's own store.
What they read (q, k, v) stays split: contiguous per head.

Each op has two kernels, as in elementwise.py:
  - 4-wide kernels, when D % 4 == 0 and both arrays are 16-byte aligned (vector.aligned16): a
    thread moves 4 consecutive head dimensions of a row with one 16-byte load and store
    (vector.load4/store4), for ROWS_PER_THREAD rows, every load issued before the first store.
    The batch, head and row come from the block indices: no division per element.
  - one-element kernels for every other D (D=6, an odd D): a thread per element; the reference.
"""
from numba import cuda, float32

from .operands import Bf16Heads
from .ptx.vector import aligned16, load4, store4
from .runtime.device import SIMULATOR
from .runtime.launch import (ELEMENTWISE_THREADS, blocks, check, check_float32, check_shape, inlined, launch)

ROWS_PER_THREAD = 2     # 4-wide kernels: the rows (16-byte loads) a thread has in flight


@cuda.jit
def split_heads_kernel(out, x, accumulate):
    # out[B,H,T,D] (+)= x[B,T,C] with C = H*D; grid (C/threads, T, B): a thread per element, the
    # threads of a block along C, so reads of x and writes of each head's row are coalesced.
    B, H, T, D = out.shape
    c = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    t = cuda.blockIdx.y
    b = cuda.blockIdx.z
    if c < H * D:
        h = c // D
        d = c - h * D
        value = x[b, t, c]
        if accumulate:
            value += out[b, h, t, d]
        out[b, h, t, d] = value


@cuda.jit
def merge_heads_kernel(out, x, accumulate):
    # out[B,T,C] (+)= x[B,H,T,D] concatenated over heads; grid (C/threads, T, B)
    B, H, T, D = x.shape
    c = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    t = cuda.blockIdx.y
    b = cuda.blockIdx.z
    if c < H * D:
        h = c // D
        d = c - h * D
        value = x[b, h, t, d]
        if accumulate:
            value += out[b, t, c]
        out[b, t, c] = value


@inlined
def load_head_row4(heads, fused, in_heads, b, h, t, d):
    # heads[b, h, t, d:d+4] if in_heads else fused[b, t, h, d:d+4]: one 16-byte load
    return load4(heads, (b, h, t, d)) if in_heads else load4(fused, (b, t, h, d))


@inlined
def move_heads4(heads, fused, split, accumulate):
    # The 4-wide kernels: heads[B,H,T,D] (+)= fused[B,T,H,D] if split, else fused (+)= heads;
    # fused is the [B,T,C] tensor viewed with C = H*D. D % 4 == 0, both 16-byte aligned.
    # grid (T / (ROWS_PER_THREAD * rows), H, B), block (D/4, rows): thread (x, y) moves head
    # dimensions d = 4x..4x+3 of head h = blockIdx.y, batch b = blockIdx.z, at the rows
    # t = first + k * rows (k < ROWS_PER_THREAD). A block's writes (split) or reads (merge) of
    # heads are one contiguous run of its rows; on the fused side, runs of D floats.
    # Every load comes before the first store (the compiler may not move a load above a store:
    # heads and fused might overlap, for all it knows), and without an `if` (a row past T loads
    # row T-1 again and stores nothing; behind an `if`, a row's loads waited for the previous
    # row's adds), so all of a thread's loads are in flight at once.
    B, H, T, D = heads.shape
    d = 4 * cuda.threadIdx.x
    h = cuda.blockIdx.y
    b = cuda.blockIdx.z
    rows = cuda.blockDim.y
    first = cuda.blockIdx.x * ROWS_PER_THREAD * rows + cuda.threadIdx.y
    values = cuda.local.array((ROWS_PER_THREAD, 4), float32)
    for k in range(ROWS_PER_THREAD):
        t = min(first + k * rows, T - 1)
        x = load_head_row4(heads, fused, not split, b, h, t, d)              # the source
        if accumulate:
            prior = load_head_row4(heads, fused, split, b, h, t, d)          # the destination
            x = (x[0] + prior[0], x[1] + prior[1], x[2] + prior[2], x[3] + prior[3])
        for i in range(4):
            values[k, i] = x[i]
    for k in range(ROWS_PER_THREAD):
        t = first + k * rows
        if t < T:
            if split:
                store4(heads, (b, h, t, d), values[k, 0], values[k, 1], values[k, 2], values[k, 3])
            else:
                store4(fused, (b, t, h, d), values[k, 0], values[k, 1], values[k, 2], values[k, 3])


@cuda.jit
def split_heads4_kernel(out, x, accumulate):
    # out[B,H,T,D] (+)= x[B,T,H,D] (x: the [B,T,C] input viewed as heads); as move_heads4
    move_heads4(out, x, True, accumulate)


@cuda.jit
def merge_heads4_kernel(out, x, accumulate):
    # out[B,T,H,D] (+)= x[B,H,T,D] (out: the [B,T,C] output viewed as heads); as move_heads4
    move_heads4(x, out, False, accumulate)


def _grid(B, T, C):
    """(grid, block) of the one-element kernels: a block of threads along C, one per (t, b)."""
    threads = min(ELEMENTWISE_THREADS, blocks(C, 32) * 32)
    return (blocks(C, threads), T, B), threads


def _grid4(B, H, T, D):
    """(grid, block) of the 4-wide kernels: blocks of (D/4, rows) threads, ELEMENTWISE_THREADS
    or just under (D/4 if more), each covering ROWS_PER_THREAD * rows rows of a (batch, head)."""
    quarters = D // 4
    rows = max(1, ELEMENTWISE_THREADS // quarters)
    return (blocks(T, ROWS_PER_THREAD * rows), H, B), (quarters, rows)


def _four_wide(heads, fused_view):
    """True when the 4-wide kernels may run: 16-byte aligned rows of D % 4 == 0 floats, and
    D/4 threads fit in a block."""
    D = heads.shape[3]
    return D // 4 <= 1024 and aligned16(heads) and aligned16(fused_view)


def _check_heads(heads, fused):
    check(len(heads.shape) == 4 and len(fused.shape) == 3,
          f"heads: expected [B,H,T,D] and [B,T,C], got {heads.shape} and {fused.shape}")
    B, H, T, D = heads.shape
    check_shape("heads: the fused tensor", fused, (B, T, H * D))


def split_heads(out, x, accumulate=False):
    """out[B,H,T,D] (+)= x[B,T,C] split into H heads of D = C/H."""
    check_float32(out=out, x=x)
    _check_heads(out, x)
    B, H, T, D = out.shape
    x_heads = x.reshape(B, T, H, D)
    if _four_wide(out, x_heads):
        launch(split_heads4_kernel, *_grid4(B, H, T, D), out, x_heads, accumulate)
    else:
        launch(split_heads_kernel, *_grid(B, T, H * D), out, x, accumulate)


def merge_heads(out, x, accumulate=False):
    """out[B,T,C] (+)= the heads of x[B,H,T,D] side by side."""
    check_float32(out=out, x=x)
    _check_heads(x, out)
    B, H, T, D = x.shape
    out_heads = out.reshape(B, T, H, D)
    if _four_wide(x, out_heads):
        launch(merge_heads4_kernel, *_grid4(B, H, T, D), out_heads, x, accumulate)
    else:
        launch(merge_heads_kernel, *_grid(B, T, H * D), out, x, accumulate)


def heads_view(x, n_head):
    """x[B,T,C] as [B,H,T,D] (D = C/H), x[b, t, h*D + d] at [b, h, t, d]: a view, no copy (the
    device array's strides say it; NumPy's reshape and transpose are the same view)."""
    check(len(x.shape) == 3 and x.shape[2] % n_head == 0,
          f"heads_view: expected [B,T,C] with C a multiple of {n_head}, got {x.shape}")
    B, T, C = x.shape
    D = C // n_head
    check(x.strides[2] == x.dtype.itemsize, "heads_view: x's rows must be contiguous")
    if SIMULATOR:
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
        return FakeCUDAArray(heads_view_numpy(x._ary, n_head))
    from numba.cuda.cudadrv.devicearray import DeviceNDArray
    batch, time, item = x.strides
    return DeviceNDArray((B, n_head, T, D), (batch, D * item, time, item), x.dtype,
                         stream=x.stream, gpu_data=x.gpu_data)


def heads_view_numpy(x, n_head):
    B, T, C = x.shape
    return x.reshape(B, T, n_head, C // n_head).transpose(0, 2, 1, 3)


def bf16_heads_view(matrix, batch, n_head):
    """The heads [B,H,T,D] of a Bf16Matrix [B*T, C] (C = H*D, D even, no pad) as a Bf16Heads
    whose bf16 pairs [B,H,T,D/2] are a heads_view of the matrix's: the bf16 attention writes
    the gradients of q, k, v through it, straight into the matrices that the products of
    W_Q, W_K, W_V read in their backward (ops.attention)."""
    return Bf16Heads(heads_view(_pairs_by_batch(matrix, batch, n_head), n_head))


def bf16_heads_view_numpy(matrix, batch, n_head):
    return Bf16Heads(heads_view_numpy(_pairs_by_batch(matrix, batch, n_head), n_head))


def _pairs_by_batch(matrix, batch, n_head):
    rows, C = matrix.shape
    check(rows % batch == 0 and C % (2 * n_head) == 0 and 2 * matrix.bf16_pairs.shape[1] == C,
          f"bf16_heads_view: a [B*T, C] matrix with C = H*D, D even, got {matrix.shape} for "
          f"B={batch}, H={n_head}")
    return matrix.bf16_pairs.reshape(batch, rows // batch, C // 2)


def split_heads_numpy(out, x, accumulate=False):
    _check_heads(out, x)
    B, H, T, D = out.shape
    heads = x.reshape(B, T, H, D).transpose(0, 2, 1, 3)
    if accumulate:
        out += heads
    else:
        out[...] = heads


def merge_heads_numpy(out, x, accumulate=False):
    _check_heads(x, out)
    B, H, T, D = x.shape
    fused = x.transpose(0, 2, 1, 3).reshape(B, T, H * D)
    if accumulate:
        out += fused
    else:
        out[...] = fused
