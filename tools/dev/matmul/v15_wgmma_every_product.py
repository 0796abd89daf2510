"""wgmma for every product of training: x W, dY W^T and x^T dY from one kernel.
H100 2026-12-07: 0.43x cuBLAS bf16 at 16384x3072x768 (b^T 0.42x, a^T 0.41x)

    out[M,N] = op(a)[M,K] @ op(b)[K,N]    op(x) = x or x^T; a, b bf16 (uint32 pairs), stored
                                          as [M,K] or, transposed, [K,M] (a), [K,N] or [N,K]
                                          (b); out float32; M, N multiples of 128, K of 64

A layer's forward multiplies x [B*T, C] by W [C, C'] (v12's product: a's rows run along k, b's
along n). Its backward needs two more: dX = dY W^T reads W's rows along k as B, and dW = x^T dY
reads x's rows along m as A. mma.sync takes its fragments from registers, so the package's
kernel (nanoandrea/kernels/matmul/mma_sync.py) turns a transposed operand round with
ldmatrix.trans as it loads it. wgmma reads its operands from shared memory itself and takes
either layout of each, K-major or MN-major (kernels/ptx/wgmma.py: imm-trans-a, imm-trans-b), so
here a transposed operand costs nothing at all: each slice is copied as it lies in memory, and
only the descriptor and the instruction's flag say which way it lies.

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

from nanoandrea.kernels.ptx.asynccopy import commit_copies, copy16_async, wait_copies
from nanoandrea.kernels.ptx.wgmma import (ACCUMULATORS, ATOM_BYTES, K_MAJOR, MN_MAJOR, atom_start,
                                          dynamic_shared_words, fence_proxy_async, wgmma_commit,
                                          wgmma_fence, wgmma_m64n128k16, wgmma_wait)
from nanoandrea.kernels.runtime.launch import SIMULATOR, inlined, kernel_factory, launch

PRECISION = "bf16"              # (tools/dev/run.py: operands packed bf16, cuBLAS bf16 beside)
MULTIPLE_OF = (128, 128, 64)
BM, BN, BK = 128, 128, 64       # block tile, K slice (bf16 elements; BK: one 128-byte row)
THREADS = 256                   # 2 warpgroups, each 64 rows x 128 columns of the tile
STAGES = 3                      # slices in shared memory: one multiplied, two in flight
ROW_WORDS = 32                  # a swizzled row: 128 bytes, 32 uint32 words (8 chunks of 4)
A_WORDS = BM * ROW_WORDS        # a slice of a: 128 rows (m) x 64 k          16 KB
B_HALF_WORDS = BK * ROW_WORDS   # b: two blocks of 64 columns, each 64 rows (k) x 64 n, 8 KB
STAGE_WORDS = A_WORDS + 2 * B_HALF_WORDS                                    # 32 KB
COPIES = BM * (BK // 8) // THREADS      # 16-byte copies a thread makes of each operand (4)
WAIT_FOR_OLDEST = wait_copies(STAGES - 2)
BOUNDS = {} if SIMULATOR else dict(launch_bounds=(THREADS, 2))    # 2 blocks an SM
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


@inlined
def store_tile(out, acc, row0, col0, thread):
    """out[row0:+64, col0:+128] = a warpgroup's acc, by wgmma's D layout: thread 32 w + 4 g + t
    holds rows 16 w + g and 16 w + g + 8, columns 8 j + 2 t and 8 j + 2 t + 1."""
    warp, lane = thread // 32, thread % 32
    row = row0 + 16 * warp + lane // 4
    col = col0 + 2 * (lane % 4)
    for j in range(BN // 8):
        out[row, col + 8 * j], out[row, col + 8 * j + 1] = acc[4 * j], acc[4 * j + 1]
        out[row + 8, col + 8 * j], out[row + 8, col + 8 * j + 1] = acc[4 * j + 2], acc[4 * j + 3]

@inlined
def copy_k_rows(tiles, at, x, row0, k0, tid):
    """x[row0:+128, k0:+64] (x's rows along k) into 128 swizzled rows of 128 bytes at word
    `at`, each 16-byte chunk at its place; 8 consecutive threads copy one row (coalesced)."""
    for r in range(COPIES):
        c = tid + r * THREADS
        i, q = c // 8, c % 8                       # row i, chunk q of its 64 k
        copy16_async(tiles, (at + i * ROW_WORDS + 4 * (q ^ (i % 8)),),
                     x, (row0 + i, k0 // 2 + 4 * q), True)

@inlined
def copy_mn_rows(tiles, at, x, k0, col0, tid):
    """x[k0:+64, col0:+128] (x's rows along m or n) into two blocks of 64 columns at word
    `at`, each 64 swizzled rows of 128 bytes; 16 consecutive threads copy one row."""
    for r in range(COPIES):
        c = tid + r * THREADS
        k, q = c // 16, c % 16                     # row k, chunk q of its 128 columns
        block, q8 = q // 8, q % 8                  # (chunks 0-7 the first 64 columns)
        copy16_async(tiles, (at + block * B_HALF_WORDS + k * ROW_WORDS + 4 * (q8 ^ (k % 8)),),
                     x, (k0 + k, col0 // 2 + 4 * q), True)


def kernels():
    """Each product's kernel, by its transposes (what tools/profile/kernel_report.py --ladder
    compiles)."""
    return {f"wgmma_product_kernel[a{'^T' if ta else ''} b{'^T' if tb else ''}]":
            wgmma_product_kernel(ta, tb) for ta, tb in TRANSPOSES}


def matmul(out, a, b, transpose_a=False, transpose_b=False):
    M, N = out.shape
    launch(wgmma_product_kernel(transpose_a, transpose_b), (N // BN, M // BM), THREADS, out,
           a, b, shared_bytes=4 * STAGES * STAGE_WORDS + ATOM_BYTES)
