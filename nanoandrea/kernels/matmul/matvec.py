"""Products of few rows: a sampled token's linear layers (M = B rows, 1 to MAX_ROWS).

    out[M,N] = x[M,K] . W[K,N]   (+ bias[N])     W stored [in, out], as the model holds it
    out[M,N] = x[M,K] . W[N,K]^T (+ bias[N])     transpose_b: the tied LM head, wte [Vp, C]
    gelu_out[M,N] = gelu(out)                    the MLP's first layer (as matmul's epilogue)

W is float32, or in bf16 precision the weight's Bf16Matrix (matmul/mma_sync.py); then x's values
are rounded to bf16 as they are read, so the product is the bf16 matmul's: both operands rounded,
float32 sums. x stays a float32 array either way (its rounding costs no launch of its own).

Why a kernel of its own: a product of M rows does 2M flops per weight it reads, so with M <= 16
it is bound by reading W, ~0.5 GB a token at andrea-120m in float32. The tile kernels
(matmul/float32.py, matmul/mma_sync.py) spend a 128-row tile on those few rows and give a 768 x 768
product 6 blocks for 132 multiprocessors. Here every weight is read once, by a 16-byte (bf16:
8-byte) load of consecutive columns, from enough blocks to fill the GPU:

matvec_kernel(rows, bf16)          W [K, N]; grid (N / BLOCK_COLUMNS, splits of K)
    a block is (LANES, GROUPS) threads: lane l takes 4 consecutive columns (a row of W is read
    by consecutive lanes: coalesced), group g the rows k = g, g + GROUPS, ... of the block's
    slice of K. Each thread keeps rows x 4 sums in registers (`rows` is compile-time, so the
    loops over it unroll and the sums never touch memory). The GROUPS partial sums of a column
    meet in shared memory and are added in group order; the block writes its slice's partial
    product, and the slices are summed in order by matmul.sum_splits (split-K, as the tile
    kernels do), with the bias, then GELU. A product whose columns alone fill the GPU is not
    split: the block adds the bias and GELU itself.
matvec_t_kernel(rows, bf16)        W [N, K] (transpose_b); grid N / (WARPS x WARP_COLUMNS)
    a warp takes WARP_COLUMNS output columns, each a row of W: lane l reads 4 consecutive k of
    each (coalesced), 128 apart, with x's same 4 k of every row, read once for the warp's
    columns; each sum meets the other lanes' in a butterfly of shuffles (ptx/warp.warp_sum).

Both sum in a fixed order: the same inputs give the same bits at every call, whatever the
schedule. They are not bit-equal to the tile kernels (which add k in another order): the
cached and the uncached forward of a token differ by float32 rounding, as their attention
kernels already do.
"""
import numpy as np
from numba import cuda, float32

from ..gelu import gelu_forward, gelu_value
from ..operands import Bf16Matrix, bf16_matrix_values
from ..ptx.mma import bf16_pair, bf16_unpair
from ..ptx.vector import aligned16, load4
from ..ptx.warp import WARP, warp_sum
from ..runtime import device
from ..runtime.device import SIMULATOR
from ..runtime.launch import (blocks, check, check_float32, current_stream, inlined,
                              kernel_factory, launch)
from .reference import bias_argument, matmul_numpy
from .split_k import sum_splits

MAX_ROWS = 16               # products of more rows go to the tile kernels

LANES, GROUPS = (4, 4) if SIMULATOR else (16, 16)     # matvec_kernel's block
BLOCK_COLUMNS = 4 * LANES
ROW_PASS = 4                # rows whose partial sums meet in shared memory at a time
ROW_STRIDE = LANES * GROUPS // BLOCK_COLUMNS    # (the block's threads add that many at once)
MIN_ROWS_PER_THREAD = 4     # rows of W a thread reads at least (else a split costs more
                            # partial sums than it saves)
WARPS = 1 if SIMULATOR else 8                          # matvec_t_kernel's block
WARP_COLUMNS = 4


# --- the NumPy twin: the definition -------------------------------------------------------

def matvec_numpy(out, x, w, bias=None, transpose_b=False, gelu_out=None):
    """matmul_numpy's forward product (w a Bf16Matrix in bf16: both operands rounded, as
    matmul_bf16_numpy)."""
    if isinstance(w, Bf16Matrix):
        x, w = (bf16_matrix_values(v).astype(out.dtype) for v in (x, w))
    _check_matvec(out, x, w, bias, transpose_b, gelu_out)
    matmul_numpy(out, x, w, bias, transpose_b=transpose_b, gelu_out=gelu_out)


# --- the kernels ------------------------------------------------------------------------------

@inlined
def x_value(x, m, k, bf16):
    # x[m, k] as the product multiplies it: rounded to bf16 in bf16 precision
    v = x[m, k]
    if bf16:
        v, _ = bf16_unpair(bf16_pair(v, v))
    return v


@inlined
def four_floats(w, row, col):
    # w[row, col:col+4] of a float32 W: one 16-byte load
    return load4(w, (row, col))


@inlined
def four_bf16(w, row, col):
    # the same four of a Bf16Matrix's bf16 pairs: two pairs, 8 bytes
    w0, w1 = bf16_unpair(w[row, col >> 1])
    w2, w3 = bf16_unpair(w[row, (col >> 1) + 1])
    return w0, w1, w2, w3


def four_weights_of(bf16):
    """The kernels' reader of four weights (a kernel factory's choice: a device function's
    branches are all typed, and load4 takes float32 arrays only)."""
    return four_bf16 if bf16 else four_floats


@inlined
def finish(out, gelu_array, value, z, m, n, bias, has_bias, gelu):
    # out[z, m, n] = value (+ bias), and gelu of it into gelu_array
    if has_bias:
        value += bias[n]
    out[z, m, n] = value
    if gelu:
        gelu_array[m, n] = gelu_value(value)


@kernel_factory
def matvec_kernel(rows, bf16):
    """out[z] = x . W over slice z of K (the module's doc): W [K, N] float32 or bf16 pairs."""
    four_weights = four_weights_of(bf16)
    PASSES = (rows + ROW_PASS - 1) // ROW_PASS

    @cuda.jit
    def matvec_kernel(out, x, w, bias, has_bias, gelu, gelu_array, k_per_split):
        # out [splits, M, N]: this block's slice's partial sums (with one split, the result)
        partial = cuda.shared.array((ROW_PASS, GROUPS, BLOCK_COLUMNS), float32)
        acc = cuda.local.array((rows, 4), float32)
        N, K = out.shape[2], x.shape[1]
        lane, group = cuda.threadIdx.x, cuda.threadIdx.y
        col = cuda.blockIdx.x * BLOCK_COLUMNS + 4 * lane
        z = cuda.blockIdx.y
        k_end = min(K, (z + 1) * k_per_split)
        for m in range(rows):
            for c in range(4):
                acc[m, c] = float32(0.0)
        if col < N:
            for k in range(z * k_per_split + group, k_end, GROUPS):
                w0, w1, w2, w3 = four_weights(w, k, col)
                for m in range(rows):
                    xv = x_value(x, m, k, bf16)
                    acc[m, 0] += xv * w0
                    acc[m, 1] += xv * w1
                    acc[m, 2] += xv * w2
                    acc[m, 3] += xv * w3
        # the groups' sums of each column, added in group order, ROW_PASS rows at a time:
        # thread t of the block adds column t % BLOCK_COLUMNS of rows t // BLOCK_COLUMNS,
        # + ROW_STRIDE, ...
        tid = group * LANES + lane
        column = tid % BLOCK_COLUMNS
        n = cuda.blockIdx.x * BLOCK_COLUMNS + column
        for p in range(PASSES):
            for r in range(ROW_PASS):
                if p * ROW_PASS + r < rows:
                    for c in range(4):
                        partial[r, group, 4 * lane + c] = acc[p * ROW_PASS + r, c]
            cuda.syncthreads()
            for r in range(tid // BLOCK_COLUMNS, ROW_PASS, ROW_STRIDE):
                m = p * ROW_PASS + r
                if m < rows and n < N:
                    total = float32(0.0)
                    for g in range(GROUPS):
                        total += partial[r, g, column]
                    finish(out, gelu_array, total, z, m, n, bias, has_bias, gelu)
            cuda.syncthreads()

    return matvec_kernel


@kernel_factory
def matvec_t_kernel(rows, bf16):
    """out = x . W^T (the module's doc): W [N, K] float32 or bf16 pairs, K % 4 == 0."""
    four_weights = four_weights_of(bf16)

    @cuda.jit
    def matvec_t_kernel(out, x, w, bias, has_bias, gelu, gelu_array):
        acc = cuda.local.array((rows, WARP_COLUMNS), float32)
        xs = cuda.local.array((rows, 4), float32)
        N, K = out.shape[2], x.shape[1]
        lane = cuda.threadIdx.x % WARP
        first = (cuda.blockIdx.x * WARPS + cuda.threadIdx.x // WARP) * WARP_COLUMNS
        for m in range(rows):
            for j in range(WARP_COLUMNS):
                acc[m, j] = float32(0.0)
        for k in range(4 * lane, K, 4 * WARP):
            for m in range(rows):               # x[m, k:k+4], for all the warp's columns
                for c in range(4):
                    xs[m, c] = x_value(x, m, k + c, bf16)
            for j in range(WARP_COLUMNS):
                if first + j < N:
                    w0, w1, w2, w3 = four_weights(w, first + j, k)
                    for m in range(rows):
                        acc[m, j] += xs[m, 0] * w0 + xs[m, 1] * w1 + xs[m, 2] * w2 + xs[m, 3] * w3
        for m in range(rows):                   # (every lane takes part in every shuffle)
            for j in range(WARP_COLUMNS):
                total = warp_sum(acc[m, j])
                if lane == 0 and first + j < N:
                    finish(out, gelu_array, total, 0, m, first + j, bias, has_bias, gelu)

    return matvec_t_kernel


# --- the launcher ----------------------------------------------------------------------------

def takes_matvec_numpy(x, w, transpose_b=False):
    """Whether matvec computes x . op(w): few rows, and widths of whole 4-float runs."""
    N, K = w.shape[0] if transpose_b else w.shape[1], x.shape[1]
    return 1 <= x.shape[0] <= MAX_ROWS and N % 4 == 0 and K % 4 == 0


def takes_matvec(x, w, transpose_b=False):
    """takes_matvec_numpy, and rows 16-byte aligned in memory (the kernels' loads)."""
    return (takes_matvec_numpy(x, w, transpose_b) and aligned16(x)
            and (isinstance(w, Bf16Matrix) or aligned16(w)))


def matvec_splits(N, K):
    """Slices of K for matvec_kernel: enough blocks for two a multiprocessor, each thread
    still reading MIN_ROWS_PER_THREAD rows of W (one split where the columns alone fill it)."""
    wanted = -(-2 * device.current().multiprocessors // blocks(N, BLOCK_COLUMNS))
    return max(1, min(wanted, K // (MIN_ROWS_PER_THREAD * GROUPS)))


def matvec(out, x, w, bias=None, transpose_b=False, gelu_out=None):
    """out[M,N] = x[M,K] . op(w) (+ bias), gelu_out = gelu(out): x float32 [M <= MAX_ROWS, K]
    (takes_matvec says which products), w float32 or a Bf16Matrix."""
    bf16 = isinstance(w, Bf16Matrix)
    w_array = w.bf16_pairs if bf16 else w
    check_float32(out=out, x=x, bias=bias, gelu_out=gelu_out, w=None if bf16 else w)
    M, N, K = _check_matvec(out, x, w, bias, transpose_b, gelu_out)
    check(takes_matvec(x, w, transpose_b), f"matvec: {M} rows of {K} by {N} columns (at most "
          f"{MAX_ROWS} rows, widths of 16-byte runs)")
    bias, has_bias = bias_argument(out, bias)
    gelu = gelu_out is not None
    gelu_array = gelu_out if gelu else out          # (a placeholder, never read, without GELU)
    if transpose_b:
        launch(matvec_t_kernel(M, bf16), blocks(N, WARPS * WARP_COLUMNS), WARPS * WARP,
               out.reshape(1, M, N), x, w_array, bias, has_bias, gelu, gelu_array)
        return
    splits = matvec_splits(N, K)
    k_per_split = -(-K // splits)
    splits = -(-K // k_per_split)
    grid, block = (blocks(N, BLOCK_COLUMNS), splits), (LANES, GROUPS)
    if splits == 1:
        launch(matvec_kernel(M, bf16), grid, block, out.reshape(1, M, N), x, w_array, bias,
               has_bias, gelu, gelu_array, k_per_split)
        return
    partials = cuda.device_array((splits, M, N), np.float32, stream=current_stream())
    launch(matvec_kernel(M, bf16), grid, block, partials, x, w_array, bias, False, False,
           gelu_array, k_per_split)
    sum_splits(out, partials, bias, has_bias, False)
    if gelu:
        gelu_forward(gelu_out, out)


def _check_matvec(out, x, w, bias, transpose_b, gelu_out):
    check(len(out.shape) == 2 and len(x.shape) == 2 and len(w.shape) == 2,
          f"matvec: out, x, w must be 2-D, got {out.shape}, {x.shape}, {w.shape}")
    M, N = out.shape
    K = x.shape[1]
    check(x.shape[0] == M, f"matvec x: expected {M} rows, got {x.shape}")
    check(tuple(w.shape) == ((N, K) if transpose_b else (K, N)),
          f"matvec w: expected {(N, K) if transpose_b else (K, N)}, got {tuple(w.shape)}")
    check(bias is None or tuple(bias.shape) == (N,), f"matvec bias: expected ({N},)")
    check(gelu_out is None or tuple(gelu_out.shape) == (M, N), f"matvec gelu_out: ({M}, {N})")
    return M, N, K
