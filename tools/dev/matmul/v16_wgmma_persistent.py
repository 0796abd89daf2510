"""v15, persistent: each block takes tile after tile, its copies running on from one into the next.
H100 2026-12-07: 0.63x cuBLAS bf16 at 16384x3072x768 (b^T 0.61x, a^T 0.63x)

    out[M,N] = op(a)[M,K] @ op(b)[K,N]    as v15: a, b bf16 (uint32 pairs), stored as they
                                          are transposed or not; out float32; any M, K, and
                                          N a multiple of 8

v12-v15 launch a block a tile, and a tile of 12 slices (K = 768) spends nearly as long
starting and ending as multiplying: its pipeline starts empty, two slices' copies waited for
before the first wgmma, and it ends storing 64 KB of sums four bytes at a time. v16 keeps
v15's block and changes that: the grid is the blocks the GPU holds at once (2 an SM), each
takes every 264th tile, and its copies run on from one tile into the next, so a tile's first
slices arrive while the last tile's last slices multiply and its sums are stored; the stores
are 8 bytes, two sums each. It takes edges too (zeros copied past M, N and K). It was the
package's wgmma kernel until v20's design replaced it, with the training step's epilogues
(bias, GELU, bf16 out) and split-K, which v21 (the package's kernel today) carries; here it
runs the plain product of each orientation, as the ladder times it.

The kernel, wgmma_persistent_kernel(transpose_a, transpose_b):
  block tile   a 128 x 128 tile of out, 2 warpgroups (256 threads), each 64 rows x 128
               columns: one m64n128 accumulator, 64 float32 a thread
  operands     each K slice of 64 copied by cp.async as it lies in memory, 16 bytes a copy,
               into shared rows of 128 bytes whose 16-byte chunks are swizzled (chunk c of row
               r at c ^ r % 8, the layout wgmma reads without bank conflicts): an operand whose
               rows run along k as 128 rows of 64 k (K-major), one whose rows run along m or n
               as 64 rows of k in two blocks of 64 columns (MN-major); zeros where the tile
               passes the operand's edge
  pipeline     3 stages of 32 KB in dynamic shared memory (two blocks an SM). A slice: wait for
               this thread's copies, fence.proxy.async (cp.async writes through the generic
               proxy, wgmma reads through the async one), the block's barrier, 4 wgmma's,
               commit, the copies two slices ahead into the stage the last slice freed (their
               addressing while the tensor cores work), wait
  persistent   the grid is the blocks the GPU holds at once (2 an SM); each block takes tiles
               blockIdx.x, + grid, ... and its copies run on from one tile into the next: while
               it multiplies a tile's last slices and stores the tile, the next tile's first
               slices are on their way. (A block a tile would wait for them at every tile's
               start: at K = 768 a tile is only 12 slices)
  epilogue     pairs of floats, 8-byte stores
Operands and offsets are 32-bit: the launcher checks that an operand has fewer than 2^31 words.
"""
from numba import cuda, float32, int32, uint32

from nanoandrea.kernels.ptx.asynccopy import commit_copies, copy16_async, wait_copies
from nanoandrea.kernels.ptx.vector import flat, store2
from nanoandrea.kernels.ptx.wgmma import (ACCUMULATORS, ATOM_BYTES, K_MAJOR, MN_MAJOR,
                                          atom_start, dynamic_shared_words, fence_proxy_async,
                                          wgmma_commit, wgmma_fence, wgmma_m64n128k16,
                                          wgmma_wait)
from nanoandrea.kernels.runtime import device
from nanoandrea.kernels.runtime.launch import SIMULATOR, blocks, inlined, kernel_factory, launch

PRECISION = "bf16"
MULTIPLE_OF = (8, 8, 8)                 # (rows of whole 16-byte copies: no pad to add)
TRANSPOSES = ((False, False), (False, True), (True, False))    # x W, dY W^T, x^T dY
BM, BN, BK = 128, 128, 64       # the block tile of out; k a slice (one 128-byte row of bf16)
THREADS = 256                   # 2 warpgroups, each 64 rows of the tile
STAGES = 3                      # slices in shared memory: one multiplied, two on their way
ROW_WORDS = 32                  # a shared row: 128 bytes, 32 uint32 words (8 chunks of 4)
BLOCK_WORDS = BK * ROW_WORDS    # an MN-major slice's block of 64 columns: 64 rows of k, 8 KB
OPERAND_WORDS = BM * ROW_WORDS  # a slice of one operand, either way: 16 KB
STAGE_WORDS = 2 * OPERAND_WORDS                 # op(a)'s slice, then op(b)'s: 32 KB
SHARED_BYTES = 4 * STAGES * STAGE_WORDS + ATOM_BYTES    # (tiles from the first 1024-byte
                                                        # boundary on: atom_start)
COPIES = OPERAND_WORDS // 4 // THREADS  # 16-byte copies a thread makes of an operand's slice
K_APART = THREADS // (BK // 8)  # a K-major slice: 8 chunks a row, so a thread's copies are
MN_APART = THREADS // (BN // 8)  # 32 rows apart; an MN-major one: 16 chunks, 16 rows apart
BLOCKS_PER_SM = 2               # 2 x 97 KB of shared memory; at most 128 registers a thread
BOUNDS = {} if SIMULATOR else dict(launch_bounds=(THREADS, BLOCKS_PER_SM))
WAIT_FOR_OLDEST = wait_copies(STAGES - 2)   # (until the oldest slice's copies have landed)


@inlined
def tile_of(item, tiles_m):
    """Work item `item`'s tile: (first row m0, first column n0): items run down the m tiles
    first, so that the blocks at work at once share b's columns (a's rows staying in the L2)."""
    return int32((item % tiles_m) * BM), int32((item // tiles_m) * BN)


@inlined
def next_slice(item, m0, n0, k, step, tiles_m, K):
    """The slice after (item's tile, k): the next k, or the block's next tile's first."""
    k = int32(k + BK)
    if k >= K:
        item = int32(item + step)
        m0, n0 = tile_of(item, tiles_m)
        k = int32(0)
    return item, m0, n0, k


@inlined
def copy_start(tid, along_k):
    """Thread tid's first copy of an operand's slice: (the word of a stage it goes to, the row
    and chunk of the slice it reads). Its other copies are rows APART further down, where the
    swizzle is the same (APART is a multiple of 8): their words are this one's plus r APART
    rows."""
    if along_k:                 # 128 rows (m or n) of 8 chunks of k
        row, chunk = tid >> 3, tid & 7
        return int32(row * ROW_WORDS + 4 * (chunk ^ (row & 7))), int32(row), int32(chunk)
    row, chunk = tid >> 4, tid & 15         # 64 rows of k of 16 chunks, two blocks of 8
    return (int32((chunk >> 3) * BLOCK_WORDS + row * ROW_WORDS + 4 * ((chunk & 7) ^ (row & 7))),
            int32(row), int32(chunk))


@inlined
def copy_operand(tiles, at, words, pitch, start, along_k, first, size, k0, k_end):
    """Start this thread's copies of op(x)'s slice at k0 for the tile whose rows (m or n)
    begin at `first`, into the stage's operand at word `at`. words: flat(x's words), `pitch`
    words a row; `size`: x's extent along m or n; zeros past it and past k_end. (Offsets in 32
    bits, unsigned where they are widened to an address: one multiply-add)"""
    place, row, chunk = start
    if along_k:                 # x[size, K]: rows first + row + 32 r, k from k0 + 8 chunk
        row = int32(first + row)
        at_k = int32(k0 + 8 * chunk)
        src = int32(row * pitch + (at_k >> 1))
        rows_left = int32(size - row)
        inside = at_k < k_end
        for r in range(COPIES):
            valid = inside and K_APART * r < rows_left
            copy16_async(tiles, (at + place + K_APART * r * ROW_WORDS,), words,
                         (uint32(src + K_APART * r * pitch) if valid else uint32(0),), valid)
    else:                       # x[K, size]: rows k0 + row + 16 r, columns from first + 8 chunk
        k = int32(k0 + row)
        column = int32(first + 8 * chunk)
        src = int32(k * pitch + (column >> 1))
        rows_left = int32(k_end - k)
        inside = column < size
        for r in range(COPIES):
            valid = inside and MN_APART * r < rows_left
            copy16_async(tiles, (at + place + MN_APART * r * ROW_WORDS,), words,
                         (uint32(src + MN_APART * r * pitch) if valid else uint32(0),), valid)


@kernel_factory
def wgmma_persistent_kernel(transpose_a, transpose_b):
    """The kernel (see the module's doc) for one (transpose_a, transpose_b)."""
    A_ALONG_K = not transpose_a         # a[M,K]: its rows run along k
    B_ALONG_K = transpose_b             # b[N,K]: likewise
    multiply = wgmma_m64n128k16(K_MAJOR if A_ALONG_K else MN_MAJOR(4 * BLOCK_WORDS),
                                K_MAJOR if B_ALONG_K else MN_MAJOR(4 * BLOCK_WORDS))

    @inlined
    def operand_words(stage, group, kk):
        # where wgmma finds k16 step kk of the slice in the stage at word `stage`: warpgroup
        # `group`'s 64 rows of op(a) (K-major: rows 64 group on, 32 bytes a step along them;
        # MN-major: block `group`, 16 rows of k a step), and all 128 columns of op(b)
        a_word = (stage + group * 64 * ROW_WORDS + 8 * kk if A_ALONG_K else
                  stage + group * BLOCK_WORDS + 16 * kk * ROW_WORDS)
        b_word = (stage + OPERAND_WORDS + 8 * kk if B_ALONG_K else
                  stage + OPERAND_WORDS + 16 * kk * ROW_WORDS)
        return a_word, b_word

    @inlined
    def store_tile(out, acc, row0, col0, thread, M, N):
        # out[row0:+64, col0:+128] = a warpgroup's sums, by wgmma's D layout: thread
        # 32 w + 4 g + t holds rows 16 w + g and 16 w + g + 8, columns 8 j + 2 t and + 1;
        # a pair of sums an 8-byte store (N is even: a pair is in or out whole)
        warp, lane = thread >> 5, thread & 31
        row = row0 + 16 * warp + (lane >> 2)
        col = col0 + 2 * (lane & 3)
        for j in range(BN // 8):
            c = col + 8 * j
            if c < N:
                if row < M:
                    store2(out, (row, c), acc[4 * j], acc[4 * j + 1])
                if row + 8 < M:
                    store2(out, (row + 8, c), acc[4 * j + 2], acc[4 * j + 3])

    @inlined
    def copy_slice(tiles, at, a_words, a_pitch, a_start, b_words, b_pitch, b_start, m0, n0, k0,
                   K, M, N):
        # start this thread's copies of op(a)'s and op(b)'s slices at k0 for the tile (m0, n0)
        # into the stage at word `at`
        copy_operand(tiles, at, a_words, a_pitch, a_start, A_ALONG_K, m0, M, k0, K)
        copy_operand(tiles, at + OPERAND_WORDS, b_words, b_pitch, b_start, B_ALONG_K, n0, N, k0,
                     K)

    @cuda.jit(**BOUNDS)
    def wgmma_persistent_kernel(out, a, b):
        # out[M,N] = op(a) . op(b); a, b: bf16 pairs. grid: up to resident_blocks() blocks,
        # each taking tiles blockIdx.x, + grid, ...; block THREADS; dynamic shared memory
        # SHARED_BYTES: STAGES stages from word `first` on
        tiles = dynamic_shared_words()
        first = atom_start(tiles)
        acc = cuda.local.array(ACCUMULATORS, float32)
        M, N = out.shape
        # K: the rows of a k-major operand; with both along k, their padded width (its zeros
        # add nothing)
        K = int32(a.shape[0] if transpose_a else b.shape[0] if not transpose_b else 2 * a.shape[1])
        a_pitch, b_pitch = int32(a.shape[1]), int32(b.shape[1])
        a_words, b_words = flat(a), flat(b)
        tid = int32(cuda.threadIdx.x)
        group, thread = tid >> 7, tid & 127             # the warpgroup, the thread in it
        tiles_m, tiles_n = int32((M + BM - 1) // BM), int32((N + BN - 1) // BN)
        items, step = int32(tiles_m * tiles_n), int32(cuda.gridDim.x)
        a_start, b_start = copy_start(tid, A_ALONG_K), copy_start(tid, B_ALONG_K)

        # the copies' cursor: the tile and k of the next slice to copy, STAGES - 1 slices
        # ahead of the one multiplied, from tile to tile
        load = int32(cuda.blockIdx.x)
        load_m0, load_n0 = tile_of(load, tiles_m)
        load_k = int32(0)
        for s in range(STAGES - 1):
            if load < items:
                copy_slice(tiles, first + s * STAGE_WORDS, a_words, a_pitch, a_start, b_words,
                           b_pitch, b_start, load_m0, load_n0, load_k, K, M, N)
                load, load_m0, load_n0, load_k = next_slice(load, load_m0, load_n0, load_k,
                                                            step, tiles_m, K)
            commit_copies()             # (a group each slice, empty ones too: wait counts them)
        read, write = int32(0), int32(STAGES - 1)   # the stages of this slice and the copied
        for item in range(cuda.blockIdx.x, items, step):
            m0, n0 = tile_of(item, tiles_m)
            for e in range(ACCUMULATORS):
                acc[e] = float32(0.0)
            for _ in range((K + BK - 1) // BK):
                WAIT_FOR_OLDEST()       # this thread's copies of the slice have landed,
                fence_proxy_async()     # are visible to wgmma's proxy,
                cuda.syncthreads()      # and everyone's; and every warpgroup is done with
                stage = first + read * STAGE_WORDS              # the last slice's stage
                wgmma_fence(acc)
                for kk in range(BK // 16):
                    a_word, b_word = operand_words(stage, group, kk)
                    multiply(acc, tiles, a_word, tiles, b_word)
                wgmma_commit()
                if load < items:        # the copies go to the last slice's stage, issued
                    copy_slice(tiles, first + write * STAGE_WORDS, a_words, a_pitch, a_start,
                               b_words, b_pitch, b_start, load_m0, load_n0, load_k, K, M,
                               N)       # while this slice's wgmma's run
                    load, load_m0, load_n0, load_k = next_slice(load, load_m0, load_n0, load_k,
                                                                step, tiles_m, K)
                commit_copies()
                wgmma_wait(acc)
                read = int32(read + 1) if read < STAGES - 1 else int32(0)
                write = int32(write + 1) if write < STAGES - 1 else int32(0)
            store_tile(out, acc, m0 + 64 * group, n0, thread, M, N)

    return wgmma_persistent_kernel


def kernels():
    """Each product's kernel, by its transposes (what tools/profile/kernel_report.py --ladder
    compiles)."""
    return {f"wgmma_persistent_kernel[a{'^T' if ta else ''} b{'^T' if tb else ''}]":
            wgmma_persistent_kernel(ta, tb) for ta, tb in TRANSPOSES}


def resident_blocks():
    """The blocks the GPU holds at once (BLOCKS_PER_SM an SM); the simulator's few, each
    taking several tiles."""
    return 2 if SIMULATOR else BLOCKS_PER_SM * device.current().multiprocessors


def matmul(out, a, b, transpose_a=False, transpose_b=False):
    """out[M,N] = op(a) . op(b); a, b: bf16 pairs, stored as they are transposed or not."""
    M, N = out.shape
    assert N % 2 == 0 and max(a.size, b.size) < 2**31, (out.shape, a.shape, b.shape)
    items = blocks(M, BM) * blocks(N, BN)
    launch(wgmma_persistent_kernel(transpose_a, transpose_b), min(resident_blocks(), items),
           THREADS, out, a, b, shared_bytes=SHARED_BYTES)
