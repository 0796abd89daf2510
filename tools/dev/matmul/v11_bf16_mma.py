"""Tensor cores: bf16 operands, float32 sums, one warp's mma.sync of 16 x 8 x 16 at a time.
H100 2026-12-07: 0.18x cuBLAS bf16 at 16384x3072x768

    out[M,N] = a[M,K] @ b[K,N]     a, b bf16 (uint32 arrays of pairs: [M, K/2], [K, N/2]),
                                   out float32; M, N multiples of 128, K of 32

The first tensor-core version, kept as simple as the SIMT ladder's v3: a block of 8 warps
computes a 128 x 128 tile of out; K advances 32 at a time. Each slice of a (128 x 32 bf16)
and of b (32 x 128) is copied into shared memory with 16-byte loads and stores (8 bf16 a
copy), rows padded by 16 bytes so that the 8 rows an ldmatrix reads fall on 8 different
groups of banks. Then, for each k16 step of the slice, each warp (its tile of out 64 x 32:
warps 2 down, 4 across) loads its fragments with ldmatrix (four 8 x 8 matrices a load: one
m16 x k16 fragment of a, or k16 x n8 fragments of b for two n8 tiles, transposed on the way,
since b lies k-major) and issues 4 x 4 mma's, one per 16 x 8 tile of its 64 x 32, into
float32 accumulators held in registers (64 a lane).

What it leaves for the versions after it: the block waits at a barrier while each slice
arrives (no double buffering, no cp.async), and every fragment is loaded once per k16 step
and used by only 4 mma's.
"""
from numba import cuda, float32, uint32

from nanoandrea.kernels.ptx.mma import (ldmatrix_x4, ldmatrix_x4_trans, load4_u32, mma_bf16,
                                        store4_u32)
from nanoandrea.kernels.runtime.launch import launch

PRECISION = "bf16"              # (tools/dev/run.py: operands packed bf16, cuBLAS bf16 beside)
MULTIPLE_OF = (128, 128, 32)
BM, BN, BK = 128, 128, 32       # block tile, K slice (bf16 elements)
WARPS_M, WARPS_N = 2, 4         # 8 warps, each a 64 x 32 tile of out
WM, WN = BM // WARPS_M, BN // WARPS_N
MMA_M, MMA_N = WM // 16, WN // 8        # 4 x 4 mma tiles a warp
THREADS = 32 * WARPS_M * WARPS_N
A_ROW = BK // 2 + 4             # shared rows, in uint32 (bf16 pairs): 16 + 4 of padding
B_ROW = BN // 2 + 4             # 64 + 4
A_COPIES = BM * (BK // 8) // THREADS    # 16-byte copies a thread makes of a slice (2)
B_COPIES = BK * (BN // 8) // THREADS    # (2)


@cuda.jit
def bf16_mma_kernel(out, a, b):
    # out[M,N] = a . b; grid (N/128, M/128), block 256: warp w takes rows 64 (w // 4), columns
    # 32 (w % 4) of the block's tile
    a_tile = cuda.shared.array((BM, A_ROW), uint32)     # a[m0 + i, k0 + 2c : + 2] as pairs
    b_tile = cuda.shared.array((BK, B_ROW), uint32)     # b[k0 + k, n0 + 2c : + 2]
    acc = cuda.local.array((MMA_M, MMA_N, 4), float32)
    a_frag = cuda.local.array((MMA_M, 4), uint32)
    b_frag = cuda.local.array((MMA_N, 2), uint32)
    K = 2 * a.shape[1]
    tid = cuda.threadIdx.x
    warp, lane = tid // 32, tid % 32
    wm, wn = (warp // WARPS_N) * WM, (warp % WARPS_N) * WN
    m0, n0 = cuda.blockIdx.y * BM, cuda.blockIdx.x * BN
    for i in range(MMA_M):
        for j in range(MMA_N):
            for e in range(4):
                acc[i, j, e] = float32(0.0)
    # the row and column (in pairs) this lane gives ldmatrix: lanes 8q .. 8q+7 address matrix
    # q's rows; matrices 0, 1 are rows 0-7 and 8-15 at the first 8 columns, 2, 3 the next 8
    row_in, pair_in = lane % 8 + 8 * ((lane // 8) % 2), 4 * (lane // 16)
    for k0 in range(0, K, BK):
        for r in range(A_COPIES):                       # the slices, 8 bf16 a copy
            c = tid + r * THREADS
            i, p = c // (BK // 8), (c % (BK // 8)) * 4
            w0, w1, w2, w3 = load4_u32(a, (m0 + i, k0 // 2 + p))
            store4_u32(a_tile, (i, p), w0, w1, w2, w3)
        for r in range(B_COPIES):
            c = tid + r * THREADS
            k, p = c // (BN // 8), (c % (BN // 8)) * 4
            w0, w1, w2, w3 = load4_u32(b, (k0 + k, n0 // 2 + p))
            store4_u32(b_tile, (k, p), w0, w1, w2, w3)
        cuda.syncthreads()
        for kk in range(0, BK, 16):
            for i in range(MMA_M):                      # a: one m16 x k16 fragment a load
                a_frag[i, 0], a_frag[i, 1], a_frag[i, 2], a_frag[i, 3] = ldmatrix_x4(
                    a_tile, (wm + 16 * i + row_in, kk // 2 + pair_in))
            for j in range(0, MMA_N, 2):                # b: two n8 tiles' k16 x n8 a load
                b_frag[j, 0], b_frag[j, 1], b_frag[j + 1, 0], b_frag[j + 1, 1] = \
                    ldmatrix_x4_trans(b_tile, (kk + row_in, (wn + 8 * j) // 2 + pair_in))
            for i in range(MMA_M):
                for j in range(MMA_N):
                    acc[i, j, 0], acc[i, j, 1], acc[i, j, 2], acc[i, j, 3] = mma_bf16(
                        a_frag[i, 0], a_frag[i, 1], a_frag[i, 2], a_frag[i, 3],
                        b_frag[j, 0], b_frag[j, 1],
                        acc[i, j, 0], acc[i, j, 1], acc[i, j, 2], acc[i, j, 3])
        cuda.syncthreads()                              # before the next slices overwrite
    g, t = lane // 4, lane % 4                          # D's layout: rows g, g + 8; columns
    for i in range(MMA_M):                              # 2t, 2t + 1 of each 16 x 8 tile
        for j in range(MMA_N):
            row, col = m0 + wm + 16 * i + g, n0 + wn + 8 * j + 2 * t
            out[row, col], out[row, col + 1] = acc[i, j, 0], acc[i, j, 1]
            out[row + 8, col], out[row + 8, col + 1] = acc[i, j, 2], acc[i, j, 3]


def matmul(out, a, b):
    M, N = out.shape
    launch(bf16_mma_kernel, (N // BN, M // BM), THREADS, out, a, b)
