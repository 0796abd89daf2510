"""Matrix multiply on the tensor cores: bf16 operands, float32 sums.

    out[M,N]  (+)=  op(a)[M,K] . op(b)[K,N]  (+ bias[N])      op(x) = x or x^T

The same function, arguments and epilogues as matmul.py (the model's every product and its
backward: see there), with one difference: each element of a and b is rounded to bf16 (8
bits of mantissa, float32's range) before it is multiplied. The products of two bf16 are
exact in float32 and the sums are float32, so the result differs from the float32 product
by the operands' rounding alone: a relative error of about 2^-9 per operand, ~1e-2 at worst
over a row, far below what the training noise moves a weight.

The fast kernel, matmul_bf16_kernel(transpose_a, transpose_b, epilogue):
  block tile   a 128 x 128 tile of out, 8 warps (2 down, 4 across), each warp a 64 x 32 tile
               of it: 4 x 4 tiles of 16 x 8, one `mma.sync.m16n8k16` each per 16 of k, its
               float32 sums in the registers of the warp's lanes (tensorcores.py says which)
  k slices     K advances 32 at a time. a and b are float32 in device memory: each slice is
               loaded 8 floats a copy (two 16-byte loads), rounded to bf16 pairs (cvt.rn.
               bf16x2) and stored 16 bytes at a time in shared memory, in the operand's own
               orientation (k-major or not); ldmatrix then hands each lane its fragment, with
               .trans where the slice lies the other way, so a transposed operand costs
               nothing. Rows are padded by 16 bytes: the 8 rows one ldmatrix reads fall in 8
               different groups of banks
  double       the next slice's global loads are issued before the current slice's mma's and
  buffering    stored (converted) into the other buffer after them
  epilogue     bias, GELU or its backward, and what out holds (accumulate), added to each
               lane's sums before its stores
  split-K      as matmul.py: grid z takes a slice of K, summed in a fixed order (sum_splits)
The launcher takes this kernel where each operand's contiguous rows are whole 8-float runs,
16-byte aligned (every width of the andrea presets); other shapes take matmul.py's float32
kernels (at least as precise).

Under the CUDA simulator the block is 2 x 2 warps of one 16 x 16 tile each (32 x 32): the
same code, small enough to test there.
"""
from numba import cuda, float32, uint32

from .gelu import gelu_derivative, gelu_value
from .launch import (MULTIPROCESSORS, SIMULATOR, blocks, check, check_float32, inlined,
                     kernel_factory)
from .matmul import (EPILOGUES, _check_matmul, k_per_slice, launch_product, matmul, matmul_numpy,
                     split_count)
from .tensorcores import (bf16_pair, bf16_values, ldmatrix_x4, ldmatrix_x4_trans, mma_bf16,
                          store4_u32)
from .vector import aligned16, load4


# --- the NumPy twin: the definition -------------------------------------------------------

def matmul_bf16_numpy(out, a, b, bias=None, transpose_a=False, transpose_b=False,
                      accumulate=False, gelu_out=None, gelu_input=None, b_transposed=None):
    """matmul_numpy of a and b rounded to bf16 (the sums in out's precision)."""
    matmul_numpy(out, bf16_values(a).astype(out.dtype), bf16_values(b).astype(out.dtype), bias,
                 transpose_a, transpose_b, accumulate, gelu_out, gelu_input)


# --- the fast kernel -----------------------------------------------------------------------

WARPS_M, WARPS_N = (2, 2) if SIMULATOR else (2, 4)     # warps down and across a block
MMA_M, MMA_N = (1, 2) if SIMULATOR else (4, 4)         # 16 x 8 tiles down and across a warp
                                                        # (the epilogue takes 1, 2 or 4 down, 2 or 4 across)
WM, WN = 16 * MMA_M, 8 * MMA_N          # a warp's tile of out
BM, BN, BK = WARPS_M * WM, WARPS_N * WN, 32
THREADS = 32 * WARPS_M * WARPS_N
PAD = 4                                 # 16 bytes at the end of each shared row (in uint32)
A_COPIES = BM * BK // 8 // THREADS      # 8-float copies a thread makes of a slice of op(a)
B_COPIES = BK * BN // 8 // THREADS
A_STAGED, B_STAGED = 8 * A_COPIES, 8 * B_COPIES     # their floats, held in registers
BLOCKS_PER_SM = 2                       # resident blocks a multiprocessor: 16 warps to hide
                                        # the loads' latency, at 128 registers a thread
RESIDENT_BLOCKS = BLOCKS_PER_SM * MULTIPROCESSORS
BOUNDS = {} if SIMULATOR else dict(launch_bounds=(THREADS, BLOCKS_PER_SM))


@kernel_factory
def matmul_bf16_kernel(transpose_a, transpose_b, epilogue=None):
    """The tensor-core kernel (see the module's doc) for one (transpose_a, transpose_b) and
    epilogue: None, "gelu" (gelu(out) also written to `hidden`) or "gelu_grad" (the product,
    plus bias, times gelu'(hidden))."""
    check(epilogue in EPILOGUES, f"matmul_bf16: unknown epilogue {epilogue!r}")
    A_ALONG_K = not transpose_a         # a[M,K]: its rows run along k
    B_ALONG_K = transpose_b             # b[N,K]: likewise
    GELU, GELU_GRAD = epilogue == "gelu", epilogue == "gelu_grad"
    # a slice in shared memory, bf16 pairs along the operand's contiguous axis: [BM, BK] or
    # [BK, BM] for op(a), [BN, BK] or [BK, BN] for op(b)
    A_TILE = (2, BM, BK // 2 + PAD) if A_ALONG_K else (2, BK, BM // 2 + PAD)
    B_TILE = (2, BN, BK // 2 + PAD) if B_ALONG_K else (2, BK, BN // 2 + PAD)

    @inlined
    def load_slice(staged, x, copies, along_k, width, size, k_end, first, k0, tid):
        # op(x)'s slice [first : first + width] x [k0 : k0 + BK] into registers, 8 floats a
        # copy, zeros outside [:size] x [:k_end]
        for r in range(copies):
            c = tid + r * THREADS
            if along_k:                 # x[size, K]: a copy is 8 consecutive k
                i, k = c // (BK // 8), (c % (BK // 8)) * 8
                row, col, inside = first + i, k0 + k, first + i < size and k0 + k < k_end
            else:                       # x[K, size]: 8 consecutive m (or n)
                k, i = c // (width // 8), (c % (width // 8)) * 8
                row, col, inside = k0 + k, first + i, k0 + k < k_end and first + i < size
            for e in range(8):
                staged[8 * r + e] = float32(0.0)
            if inside:
                x0, x1, x2, x3 = load4(x, (row, col))
                x4, x5, x6, x7 = load4(x, (row, col + 4))
                staged[8 * r], staged[8 * r + 1], staged[8 * r + 2] = x0, x1, x2
                staged[8 * r + 3], staged[8 * r + 4], staged[8 * r + 5] = x3, x4, x5
                staged[8 * r + 6], staged[8 * r + 7] = x6, x7

    @inlined
    def park(tiles, buffer, staged, copies, along_k, width, tid):
        # registers -> shared memory, rounded to bf16: 8 values, one 16-byte store a copy
        for r in range(copies):
            c = tid + r * THREADS
            if along_k:
                i, p = c // (BK // 8), (c % (BK // 8)) * 4
            else:
                i, p = c // (width // 8), (c % (width // 8)) * 4
            s = 8 * r
            store4_u32(tiles, (buffer, i, p), bf16_pair(staged[s], staged[s + 1]),
                       bf16_pair(staged[s + 2], staged[s + 3]),
                       bf16_pair(staged[s + 4], staged[s + 5]),
                       bf16_pair(staged[s + 6], staged[s + 7]))

    @inlined
    def load_fragments(a_frag, b_frag, a_tiles, b_tiles, buffer, kk, wm, wn, row_in, pair_in):
        # A's m16 x k16 fragments (4 words each) and B's k16 x n8 ones (2 words) of this warp
        # for k = kk .. kk + 15. Lanes 8q .. 8q+7 address matrix q's rows: rows 0-7 and 8-15 of
        # the slice's 16 x 16 square at the first 8 columns (q = 0, 1), then the next 8 (2, 3).
        # With the rows along m (a) or n (b) the four matrices come out as the fragment wants
        # them; with the rows along k, matrices 1 and 2 trade places.
        for i in range(MMA_M):
            m = wm + 16 * i
            if A_ALONG_K:               # rows m, columns k: A's layout as it is
                a_frag[i, 0], a_frag[i, 1], a_frag[i, 2], a_frag[i, 3] = ldmatrix_x4(
                    a_tiles, (buffer, m + row_in, kk // 2 + pair_in))
            else:                       # rows k, columns m: transposed on the way
                a_frag[i, 0], a_frag[i, 2], a_frag[i, 1], a_frag[i, 3] = ldmatrix_x4_trans(
                    a_tiles, (buffer, kk + row_in, m // 2 + pair_in))
        for j in range(0, MMA_N, 2):    # two n8 tiles a load
            n = wn + 8 * j
            if B_ALONG_K:               # rows n, columns k: B's column-major layout
                b_frag[j, 0], b_frag[j + 1, 0], b_frag[j, 1], b_frag[j + 1, 1] = ldmatrix_x4(
                    b_tiles, (buffer, n + row_in, kk // 2 + pair_in))
            else:                       # rows k, columns n
                b_frag[j, 0], b_frag[j, 1], b_frag[j + 1, 0], b_frag[j + 1, 1] = \
                    ldmatrix_x4_trans(b_tiles, (buffer, kk + row_in, n // 2 + pair_in))

    @inlined
    def slice_product(acc, a_frag, b_frag, a_tiles, b_tiles, buffer, wm, wn, row_in, pair_in):
        for kk in range(0, BK, 16):
            load_fragments(a_frag, b_frag, a_tiles, b_tiles, buffer, kk, wm, wn, row_in,
                           pair_in)
            for i in range(MMA_M):
                for j in range(MMA_N):
                    acc[i, j, 0], acc[i, j, 1], acc[i, j, 2], acc[i, j, 3] = mma_bf16(
                        a_frag[i, 0], a_frag[i, 1], a_frag[i, 2], a_frag[i, 3],
                        b_frag[j, 0], b_frag[j, 1],
                        acc[i, j, 0], acc[i, j, 1], acc[i, j, 2], acc[i, j, 3])

    @inlined
    def finish(out, hidden, value, accumulate, z, row, col, N):
        # out[z, row, col] (+)= the epilogue of one sum (the bias added)
        if col < N:
            if GELU_GRAD:
                value *= gelu_derivative(hidden[row, col])
            if accumulate:
                value += out[z, row, col]
            out[z, row, col] = value
            if GELU:
                hidden[row, col] = gelu_value(value)

    @inlined
    def store_tile(out, hidden, acc, i, j, bias, has_bias, accumulate, z, row0, col0, lane, M,
                   N):
        # the 16 x 8 tile (i, j) of the warp's sums, whose top-left is out[z, row0, col0]: lane
        # holds rows g, g + 8 and columns 2t, 2t + 1 of it
        row, col = row0 + 16 * i + lane // 4, col0 + 8 * j + 2 * (lane % 4)
        bias0 = bias1 = float32(0.0)
        if has_bias and col < N:
            bias0 = bias[col]
        if has_bias and col + 1 < N:
            bias1 = bias[col + 1]
        if row < M:
            finish(out, hidden, acc[i, j, 0] + bias0, accumulate, z, row, col, N)
            finish(out, hidden, acc[i, j, 1] + bias1, accumulate, z, row, col + 1, N)
        if row + 8 < M:
            finish(out, hidden, acc[i, j, 2] + bias0, accumulate, z, row + 8, col, N)
            finish(out, hidden, acc[i, j, 3] + bias1, accumulate, z, row + 8, col + 1, N)

    @inlined
    def store_tiles(out, hidden, acc, i, bias, has_bias, accumulate, z, row0, col0, lane, M, N):
        # the tiles (i, 0 .. MMA_N - 1)
        store_tile(out, hidden, acc, i, 0, bias, has_bias, accumulate, z, row0, col0, lane, M, N)
        store_tile(out, hidden, acc, i, 1, bias, has_bias, accumulate, z, row0, col0, lane, M, N)
        if MMA_N > 2:
            store_tile(out, hidden, acc, i, 2, bias, has_bias, accumulate, z, row0, col0, lane,
                       M, N)
            store_tile(out, hidden, acc, i, 3, bias, has_bias, accumulate, z, row0, col0, lane,
                       M, N)

    @cuda.jit(**BOUNDS)
    def matmul_bf16_kernel(out, a, b, bias, has_bias, accumulate, k_per_split, hidden):
        # out[S,M,N]: out[z] (+)= op(a)[:, Kz] . op(b)[Kz, :] (+ bias[N] if has_bias), Kz the
        # z-th slice of k_per_split rows of K (S = 1 when K is not split). hidden[M,N] (S = 1):
        # GELU's output (gelu) or its input (gelu_grad); else not read.
        # grid (N/BN, M/BM, S), block THREADS: warp w takes the warp tile (w // WARPS_N,
        # w % WARPS_N) of the block's
        a_tiles = cuda.shared.array(A_TILE, uint32)
        b_tiles = cuda.shared.array(B_TILE, uint32)
        acc = cuda.local.array((MMA_M, MMA_N, 4), float32)
        a_frag = cuda.local.array((MMA_M, 4), uint32)
        b_frag = cuda.local.array((MMA_N, 2), uint32)
        a_next = cuda.local.array(A_STAGED, float32)
        b_next = cuda.local.array(B_STAGED, float32)
        M, N = out.shape[1], out.shape[2]
        K = a.shape[0] if transpose_a else a.shape[1]
        z = cuda.blockIdx.z
        k_start = z * k_per_split
        k_end = min(K, k_start + k_per_split)
        tid = cuda.threadIdx.x
        warp, lane = tid // 32, tid % 32
        wm, wn = (warp // WARPS_N) * WM, (warp % WARPS_N) * WN
        m0, n0 = cuda.blockIdx.y * BM, cuda.blockIdx.x * BN
        row_in, pair_in = lane % 8 + 8 * ((lane // 8) % 2), 4 * (lane // 16)   # (ldmatrix)
        for i in range(MMA_M):
            for j in range(MMA_N):
                for e in range(4):
                    acc[i, j, e] = float32(0.0)

        load_slice(a_next, a, A_COPIES, A_ALONG_K, BM, M, k_end, m0, k_start, tid)
        load_slice(b_next, b, B_COPIES, B_ALONG_K, BN, N, k_end, n0, k_start, tid)
        park(a_tiles, 0, a_next, A_COPIES, A_ALONG_K, BM, tid)
        park(b_tiles, 0, b_next, B_COPIES, B_ALONG_K, BN, tid)
        cuda.syncthreads()
        buffer = 0
        for k0 in range(k_start, k_end, BK):
            # (unconditionally, as matmul.py's kernel: past k_end the loads give zeros)
            load_slice(a_next, a, A_COPIES, A_ALONG_K, BM, M, k_end, m0, k0 + BK, tid)
            load_slice(b_next, b, B_COPIES, B_ALONG_K, BN, N, k_end, n0, k0 + BK, tid)
            slice_product(acc, a_frag, b_frag, a_tiles, b_tiles, buffer, wm, wn, row_in,
                          pair_in)
            park(a_tiles, 1 - buffer, a_next, A_COPIES, A_ALONG_K, BM, tid)
            park(b_tiles, 1 - buffer, b_next, B_COPIES, B_ALONG_K, BN, tid)
            cuda.syncthreads()
            buffer = 1 - buffer

        # the epilogue, tile by tile, written out (as in slice_product, the loops there are
        # unrolled by the compiler; here their bodies are too long for it): a loop over the
        # tiles would index acc at run time, and acc would move from registers to memory
        store_tiles(out, hidden, acc, 0, bias, has_bias, accumulate, z, m0 + wm, n0 + wn, lane,
                    M, N)
        if MMA_M > 1:
            store_tiles(out, hidden, acc, 1, bias, has_bias, accumulate, z, m0 + wm, n0 + wn,
                        lane, M, N)
        if MMA_M > 2:
            store_tiles(out, hidden, acc, 2, bias, has_bias, accumulate, z, m0 + wm, n0 + wn,
                        lane, M, N)
            store_tiles(out, hidden, acc, 3, bias, has_bias, accumulate, z, m0 + wm, n0 + wn,
                        lane, M, N)

    return matmul_bf16_kernel


# --- the launcher ----------------------------------------------------------------------------

def copies_b_transposed(M, N, transpose_a, transpose_b):
    """Never: ldmatrix.trans reads a transposed operand as fast (matmul.py's kernel copies)."""
    return False


def takes_tensor_cores(out, a, b, bias=None, hidden=None):
    """Whether matmul_bf16_kernel can take these arrays: a's and b's rows whole 8-float runs
    (its copies), and every array's rows 16-byte aligned (its loads; split-K's sum)."""
    return (a.shape[1] % 8 == 0 and b.shape[1] % 8 == 0
            and all(aligned16(x) for x in (out, a, b, bias, hidden) if x is not None))


def matmul_bf16(out, a, b, bias=None, transpose_a=False, transpose_b=False, accumulate=False,
                gelu_out=None, gelu_input=None, b_transposed=None):
    """out[M,N] (+)= bf16(op(a)) . bf16(op(b)) (+ bias): matmul.matmul's arguments and
    epilogues, on the tensor cores (b_transposed is not needed: ldmatrix transposes)."""
    check_float32(out=out, a=a, b=b, bias=bias, gelu_out=gelu_out, gelu_input=gelu_input)
    M, N, K = _check_matmul(out, a, b, bias, transpose_a, transpose_b, gelu_out, gelu_input)
    hidden = gelu_out if gelu_out is not None else gelu_input
    if not takes_tensor_cores(out, a, b, bias, hidden):
        matmul(out, a, b, bias, transpose_a, transpose_b, accumulate, gelu_out, gelu_input)
        return
    has_bias = bias is not None
    if not has_bias:            # kernels take arrays, not None: a placeholder never read
        bias = out.reshape(out.size)[:1]
    splits = split_count(M, N, K, slots=RESIDENT_BLOCKS, step=BK)
    k_per_split = k_per_slice(K, splits, step=BK)
    grid = (blocks(N, BN), blocks(M, BM), blocks(K, k_per_split))
    launch_product(matmul_bf16_kernel, THREADS, grid, k_per_split, out, a, b, bias, has_bias,
                   transpose_a, transpose_b, accumulate, gelu_out, gelu_input)
