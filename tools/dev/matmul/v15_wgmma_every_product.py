"""wgmma for every product of training: x W, dY W^T and x^T dY from one kernel.
H200 2026-12-02: 0.41-0.43x cuBLAS bf16 in each orientation at 16384x3072x768 (279-298 TFLOP/s)

    out[M,N] = op(a)[M,K] @ op(b)[K,N]    op(x) = x or x^T; a, b bf16 (uint32 pairs), stored
                                          as [M,K] or, transposed, [K,M] (a), [K,N] or [N,K]
                                          (b); out float32; M, N multiples of 128, K of 64

A layer's forward multiplies x [B*T, C] by W [C, C'] (v12's product: a's rows run along k, b's
along n). Its backward needs two more: dX = dY W^T reads W's rows along k as B, and dW = x^T dY
reads x's rows along m as A. mma.sync takes its fragments from registers, so the package's
kernel (nanoandrea/kernels/matmul_bf16.py) turns a transposed operand round with ldmatrix.trans
as it loads it. wgmma reads its operands from shared memory itself and takes either layout of
each, K-major or MN-major (kernels/wgmma.py: imm-trans-a, imm-trans-b), so here a transposed operand
costs nothing at all: each slice is copied as it lies in memory, and only the descriptor and
the instruction's flag say which way it lies.

  operand         stored            its slice in shared memory             wgmma reads it
  a               [M, K]: rows of k  128 rows of 64 k (v12's a)             K-major
  a, transposed   [K, M]: rows of m  64 rows of k, two blocks of 64 m       MN-major
  b               [K, N]: rows of n  64 rows of k, two blocks of 64 n (v12) MN-major
  b, transposed   [N, K]: rows of k  128 rows of 64 k                       K-major

Warpgroup g multiplies rows 64g .. 64g+63 of the tile: K-major, from row 64g of a's slice;
MN-major, from block g. Everything else is v12's: the 128 x 128 tile, 3 stages, one barrier a
slice, the epilogue.
"""
from numba import cuda, float32

from nanoandrea.kernels.asynccopy import commit_copies
from nanoandrea.kernels.launch import inlined, kernel_factory, launch
from v12_wgmma import (A_WORDS, B_HALF_WORDS, BK, BM, BN, BOUNDS, MULTIPLE_OF,  # noqa: F401
                       ROW_WORDS, STAGE_WORDS, STAGES, THREADS, WAIT_FOR_OLDEST, copy_k_rows,
                       copy_mn_rows, store_tile)    # (MULTIPLE_OF: what run.py reads)
from nanoandrea.kernels.wgmma import (ACCUMULATORS, ATOM_BYTES, K_MAJOR, MN_MAJOR, atom_start,
                   dynamic_shared_words, fence_proxy_async, wgmma_commit, wgmma_fence,
                   wgmma_m64n128k16, wgmma_wait)

PRECISION = "bf16"
TRANSPOSES = ((False, False), (False, True), (True, False))    # x W, dY W^T, x^T dY
BLOCKS_APART = 4 * B_HALF_WORDS         # bytes between an MN-major slice's blocks of 64


@kernel_factory
def wgmma_product_kernel(transpose_a, transpose_b):
    """The kernel for op(a) @ op(b) with these transposes."""
    multiply = wgmma_m64n128k16(MN_MAJOR(BLOCKS_APART) if transpose_a else K_MAJOR,
                                K_MAJOR if transpose_b else MN_MAJOR(BLOCKS_APART))

    @inlined
    def copy_operands(tiles, stage, a, b, m0, n0, k0, tid):
        # a's slice, then b's, into the stage at word `stage`, each as it lies in memory
        if transpose_a:
            copy_mn_rows(tiles, stage, a, k0, m0, tid)
        else:
            copy_k_rows(tiles, stage, a, m0, k0, tid)
        if transpose_b:
            copy_k_rows(tiles, stage + A_WORDS, b, n0, k0, tid)
        else:
            copy_mn_rows(tiles, stage + A_WORDS, b, k0, n0, tid)

    @cuda.jit(**BOUNDS)
    def wgmma_product_kernel(out, a, b):
        # out[M,N] = op(a) . op(b); grid (N/128, M/128), block 256; shared memory as v12's,
        # each operand's slice as it lies (the module's table)
        tiles = dynamic_shared_words()
        first = atom_start(tiles)
        acc = cuda.local.array(ACCUMULATORS, float32)
        K = a.shape[0] if transpose_a else 2 * a.shape[1]
        tid = cuda.threadIdx.x
        group, thread = tid // 128, tid % 128
        m0, n0 = cuda.blockIdx.y * BM, cuda.blockIdx.x * BN
        for e in range(ACCUMULATORS):
            acc[e] = float32(0.0)
        slices = K // BK
        for s in range(STAGES - 1):
            if s < slices:
                copy_operands(tiles, first + s * STAGE_WORDS, a, b, m0, n0, s * BK, tid)
            commit_copies()
        for s in range(slices):
            WAIT_FOR_OLDEST()
            fence_proxy_async()
            cuda.syncthreads()
            ahead = s + STAGES - 1
            if ahead < slices:
                copy_operands(tiles, first + (ahead % STAGES) * STAGE_WORDS, a, b, m0, n0,
                              ahead * BK, tid)
            commit_copies()
            stage = first + (s % STAGES) * STAGE_WORDS
            wgmma_fence(acc)
            for kk in range(BK // 16):             # K-major: 32 bytes on along the rows;
                if transpose_a:                    # MN-major: 16 rows of k on
                    a_word = stage + group * B_HALF_WORDS + 16 * kk * ROW_WORDS
                else:
                    a_word = stage + group * 64 * ROW_WORDS + 8 * kk
                if transpose_b:
                    b_word = stage + A_WORDS + 8 * kk
                else:
                    b_word = stage + A_WORDS + 16 * kk * ROW_WORDS
                multiply(acc, tiles, a_word, tiles, b_word)
            wgmma_commit()
            wgmma_wait(acc)
        store_tile(out, acc, m0 + 64 * group, n0, thread)

    return wgmma_product_kernel


def kernels():
    """Each product's kernel, by its transposes (what tools/dev/offline.py compiles)."""
    return {f"wgmma_product_kernel[a{'^T' if ta else ''} b{'^T' if tb else ''}]":
            wgmma_product_kernel(ta, tb) for ta, tb in TRANSPOSES}


def matmul(out, a, b, transpose_a=False, transpose_b=False):
    M, N = out.shape
    launch(wgmma_product_kernel(transpose_a, transpose_b), (N // BN, M // BM), THREADS, out,
           a, b, shared_bytes=4 * STAGES * STAGE_WORDS + ATOM_BYTES)
