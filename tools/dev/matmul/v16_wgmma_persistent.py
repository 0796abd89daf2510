"""v15, persistent: the package's wgmma kernel until v20's design replaced it (2026-12-04).
H200 2026-12-02: 0.62x cuBLAS bf16, 434 TFLOP/s at 16384x3072x768 (tools/bench.py --only matmul)

    out[M,N] = op(a)[M,K] @ op(b)[K,N]    as v15: a, b bf16 (uint32 pairs), stored as they
                                          are transposed or not; out float32; any M, K, and
                                          N a multiple of 8

v12-v15 launch a block a tile, and a tile of 12 slices (K = 768) spends nearly as long
starting and ending as multiplying: its pipeline starts empty, two slices' copies waited for
before the first wgmma, and it ends storing 64 KB of sums four bytes at a time. The package's
kernel keeps v15's block and changes that: the grid is the blocks the GPU holds at once (2 an
SM), each takes every 264th tile, and its copies run on from one tile into the next, so a
tile's first slices arrive while the last tile's last slices multiply and its sums are
stored; the stores are 8 bytes, two sums each. It adds what the training step needs: edges
(zeros copied past M, N and K), bias and GELU epilogues, split-K; the ladder times the plain
product of each orientation.

As the package had it (its launcher, wgmma_matmul, takes matmul_bf16's arguments):
The kernel, wgmma_matmul_kernel(transpose_a, transpose_b, epilogue):
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
  epilogue     bias, GELU or its backward, and what out holds (accumulate), as matmul.py's,
               GELU's exp and division on the special-function unit (gelu_value_sfu: exact
               ones would be a third of a tile's instructions); pairs of floats, 8-byte loads
               and stores. Or, `words`, the bf16 epilogue: out
               is written as the next products read it (a Bf16Matrix's words: half float32's
               bytes, and no rounding pass after), GELU's output too, and GELU's backward reads
               its input so (the MLP's pre-activation in bf16). A lane's pair is one 4-byte
               word; lane pairs swap one so that each stores 8 bytes (store_exchanged), a
               row's 32-byte sector in one instruction
  split-K      as matmul.py: the tiles of every slice of K are the blocks' work; their partial
               sums are added in a fixed order (matmul.sum_splits)
Operands and offsets are 32-bit: the launcher checks that an operand has fewer than 2^31 words.
"""
from numba import cuda, float32, int32, uint32

from nanoandrea.kernels.asynccopy import commit_copies, copy16_async, wait_copies
from nanoandrea.kernels.gelu import gelu_derivative_sfu, gelu_value_sfu
from nanoandrea.kernels.launch import (MULTIPROCESSORS, SIMULATOR, blocks, check, check_float32,
                                      inlined, kernel_factory)
from nanoandrea.kernels.matmul import (EPILOGUES, _check_matmul, k_per_slice, launch_product,
                                      split_count)
from nanoandrea.kernels.matmul_bf16 import Bf16Matrix
from nanoandrea.kernels.reduce import pair_exchange
from nanoandrea.kernels.tensorcores import bf16_pair, bf16_unpair, store2_u32
from nanoandrea.kernels.vector import aligned16, flat, load2, store2
from nanoandrea.kernels.wgmma import (ACCUMULATORS, ATOM_BYTES, K_MAJOR, MN_MAJOR,
                                     atom_start, dynamic_shared_words, fence_proxy_async,
                                     hopper, wgmma_commit, wgmma_fence, wgmma_m64n128k16,
                                     wgmma_wait)

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
RESIDENT_BLOCKS = (2 if SIMULATOR else BLOCKS_PER_SM * MULTIPROCESSORS)   # (the simulator:
                                                        # few blocks, each taking several tiles)
BOUNDS = {} if SIMULATOR else dict(launch_bounds=(THREADS, BLOCKS_PER_SM))
WAIT_FOR_OLDEST = wait_copies(STAGES - 2)   # (until the oldest slice's copies have landed)


@inlined
def tile_of(item, tiles_m, tiles_n, k_per_split, K):
    """Work item `item`'s tile: (first row m0, first column n0, split z, its k range): items
    run down the m tiles first, so that the blocks at work at once share b's columns (the LM
    head's [768, 50304] weight is read from memory about once, a's rows staying in the L2)."""
    tm = item % tiles_m
    rest = item // tiles_m
    z = rest // tiles_n
    k_start = z * k_per_split
    return (int32(tm * BM), int32((rest % tiles_n) * BN), int32(z), int32(k_start),
            int32(min(K, k_start + k_per_split)))


@inlined
def next_slice(item, m0, n0, k, k_end, step, tiles_m, tiles_n, k_per_split, K):
    """The slice after (item's tile, k): the next k, or the block's next tile's first."""
    k = int32(k + BK)
    if k >= k_end:
        item = int32(item + step)
        m0, n0, _, k, k_end = tile_of(item, tiles_m, tiles_n, k_per_split, K)
    return item, m0, n0, k, k_end


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
def wgmma_matmul_kernel(transpose_a, transpose_b, epilogue=None, words=False):
    """The kernel (see the module's doc) for one (transpose_a, transpose_b) and epilogue: None,
    "gelu" (gelu(out) also written to `hidden`) or "gelu_grad" (the product, plus bias, times
    gelu'(hidden)). words: out and hidden are the words of Bf16Matrix's, [S=1, M, N/2] and
    [M, N/2]: out rounded to bf16, GELU of out as rounded (what the next products and the
    backward read), rounded too; nothing accumulated."""
    check(epilogue in EPILOGUES, f"matmul_wgmma: unknown epilogue {epilogue!r}")
    A_ALONG_K = not transpose_a         # a[M,K]: its rows run along k
    B_ALONG_K = transpose_b             # b[N,K]: likewise
    GELU, GELU_GRAD = epilogue == "gelu", epilogue == "gelu_grad"
    WORDS = words
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
    def group_reads(out, hidden, bias, has_bias, accumulate, z, row, c, M, N):
        # what the epilogue of the 8-column group at column c reads: bias[c:c + 2] and, for rows
        # row and row + 8, gelu's input (gelu_grad; words: a word each, h1 and h3 unused, its
        # pair unpacked where it is used) and what out holds (accumulate)
        zero = float32(0.0)
        b0 = b1 = o0 = o1 = o2 = o3 = zero
        h0 = h1 = h2 = h3 = uint32(0) if WORDS else zero
        if c < N:                       # (N is even: the pair's second column is in too)
            if has_bias:
                b0, b1 = load2(bias, (c,))
            if GELU_GRAD:
                if WORDS:
                    if row < M:
                        h0 = hidden[row, c >> 1]
                    if row + 8 < M:
                        h2 = hidden[row + 8, c >> 1]
                else:
                    if row < M:
                        h0, h1 = load2(hidden, (row, c))
                    if row + 8 < M:
                        h2, h3 = load2(hidden, (row + 8, c))
            if accumulate and not WORDS:
                if row < M:
                    o0, o1 = load2(out, (z, row, c))
                if row + 8 < M:
                    o2, o3 = load2(out, (z, row + 8, c))
        return b0, b1, h0, h1, h2, h3, o0, o1, o2, o3

    @inlined
    def finish_pair(out, hidden, accumulate, z, row, col, x0, x1, h0, h1, o0, o1, M):
        # out[z, row, col:col + 2] (+)= the epilogue of two sums (the bias added), given what
        # it reads (group_reads)
        if row < M:
            if GELU_GRAD:
                x0 *= gelu_derivative_sfu(h0)
                x1 *= gelu_derivative_sfu(h1)
            if accumulate:
                x0 += o0
                x1 += o1
            store2(out, (z, row, col), x0, x1)
            if GELU:
                store2(hidden, (row, col), gelu_value_sfu(x0), gelu_value_sfu(x1))

    @inlined
    def store_group(out, hidden, acc, j, reads, accumulate, z, row, col, M, N):
        # the thread's sums of 8-column group j: out[z, row and row + 8, col + 8 j + (0, 1)]
        c = col + 8 * j
        if c < N:
            b0, b1, h0, h1, h2, h3, o0, o1, o2, o3 = reads
            finish_pair(out, hidden, accumulate, z, row, c, acc[4 * j] + b0,
                        acc[4 * j + 1] + b1, h0, h1, o0, o1, M)
            finish_pair(out, hidden, accumulate, z, row + 8, c, acc[4 * j + 2] + b0,
                        acc[4 * j + 3] + b1, h2, h3, o2, o3, M)

    @inlined
    def words_of_group(acc, j, reads, e):
        # words: group j's sums e, e + 1 (e = 0: the thread's first row, 2: its row + 8), the
        # epilogue applied, as bf16 pairs: (out's word, GELU's word)
        b0, b1, h0, h1, h2, h3, o0, o1, o2, o3 = reads
        x0, x1 = acc[4 * j + e] + b0, acc[4 * j + e + 1] + b1
        if GELU_GRAD:
            g0, g1 = bf16_unpair(h0 if e == 0 else h2)
            x0 *= gelu_derivative_sfu(g0)
            x1 *= gelu_derivative_sfu(g1)
        pair = bf16_pair(x0, x1)
        activated = uint32(0)
        if GELU:                        # (of the values as rounded: what backward reads)
            r0, r1 = bf16_unpair(pair)
            activated = bf16_pair(gelu_value_sfu(r0), gelu_value_sfu(r1))
        return pair, activated

    @inlined
    def store_exchanged(x, row, c, odd, word_j, word_k, M, N):
        # words: one row's words of groups j and k = j + 1 (this thread's at column c of group
        # j, c + 8 of group k), two a lane pair: each lane gives the other the word it does not
        # store, so that the even lane stores group j's 4 columns from c on and the odd one
        # group k's from c + 6 on, 8 bytes each: a row's 32 bytes in one store instruction
        # (a 4-byte store a pair would write half a 32-byte sector at a time)
        other = pair_exchange(word_j if odd else word_k)
        if row < M:
            if odd:
                if c + 8 < N:
                    store2_u32(x, (row, (c + 6) >> 1), other, word_k)
            elif c < N:
                store2_u32(x, (row, c >> 1), word_j, other)

    @inlined
    def store_words(out, hidden, acc, j, reads_j, reads_k, z, row, col, M, N):
        # words: groups j and j + 1, both rows of the thread, by store_exchanged (every lane
        # calls it: the exchange is a shuffle)
        c = col + 8 * j
        odd = (col >> 1) & 1
        out_rows = out[z]               # (written out twice, as store_groups says why)
        pair_j, activated_j = words_of_group(acc, j, reads_j, 0)
        pair_k, activated_k = words_of_group(acc, j + 1, reads_k, 0)
        store_exchanged(out_rows, row, c, odd, pair_j, pair_k, M, N)
        if GELU:
            store_exchanged(hidden, row, c, odd, activated_j, activated_k, M, N)
        pair_j, activated_j = words_of_group(acc, j, reads_j, 2)
        pair_k, activated_k = words_of_group(acc, j + 1, reads_k, 2)
        store_exchanged(out_rows, row + 8, c, odd, pair_j, pair_k, M, N)
        if GELU:
            store_exchanged(hidden, row + 8, c, odd, activated_j, activated_k, M, N)

    @inlined
    def store_groups(out, hidden, acc, j, bias, has_bias, accumulate, z, row, col, M, N):
        # groups j .. j + 3, their loads first: a load after a store to out might read what
        # the store wrote (the compiler cannot tell out from hidden or bias), so it stays
        # behind it, and each group would wait a memory latency of its own for its reads.
        # Written out: a loop over the groups would index acc at run time wherever its body is
        # too long for the compiler to unroll (GELU's), and acc would move to local memory
        reads0 = group_reads(out, hidden, bias, has_bias, accumulate, z, row, col + 8 * j, M, N)
        reads1 = group_reads(out, hidden, bias, has_bias, accumulate, z, row, col + 8 * j + 8,
                             M, N)
        reads2 = group_reads(out, hidden, bias, has_bias, accumulate, z, row, col + 8 * j + 16,
                             M, N)
        reads3 = group_reads(out, hidden, bias, has_bias, accumulate, z, row, col + 8 * j + 24,
                             M, N)
        if WORDS:
            store_words(out, hidden, acc, j, reads0, reads1, z, row, col, M, N)
            store_words(out, hidden, acc, j + 2, reads2, reads3, z, row, col, M, N)
        else:
            store_group(out, hidden, acc, j, reads0, accumulate, z, row, col, M, N)
            store_group(out, hidden, acc, j + 1, reads1, accumulate, z, row, col, M, N)
            store_group(out, hidden, acc, j + 2, reads2, accumulate, z, row, col, M, N)
            store_group(out, hidden, acc, j + 3, reads3, accumulate, z, row, col, M, N)

    @inlined
    def store_tile(out, hidden, acc, bias, has_bias, accumulate, z, row0, col0, thread, M, N):
        # out[z, row0:+64, col0:+128] (+)= a warpgroup's sums, by wgmma's D layout: thread
        # 32 w + 4 g + t holds rows 16 w + g and 16 w + g + 8, columns 8 j + 2 t and + 1
        warp, lane = thread >> 5, thread & 31
        row = row0 + 16 * warp + (lane >> 2)
        col = col0 + 2 * (lane & 3)
        store_groups(out, hidden, acc, 0, bias, has_bias, accumulate, z, row, col, M, N)
        store_groups(out, hidden, acc, 4, bias, has_bias, accumulate, z, row, col, M, N)
        store_groups(out, hidden, acc, 8, bias, has_bias, accumulate, z, row, col, M, N)
        store_groups(out, hidden, acc, 12, bias, has_bias, accumulate, z, row, col, M, N)

    @inlined
    def copy_slice(tiles, at, a_words, a_pitch, a_start, b_words, b_pitch, b_start, m0, n0, k0,
                   k_end, M, N):
        # start this thread's copies of op(a)'s and op(b)'s slices at k0 for the tile (m0, n0)
        # into the stage at word `at`
        copy_operand(tiles, at, a_words, a_pitch, a_start, A_ALONG_K, m0, M, k0, k_end)
        copy_operand(tiles, at + OPERAND_WORDS, b_words, b_pitch, b_start, B_ALONG_K, n0, N, k0,
                     k_end)

    @cuda.jit(**BOUNDS)
    def wgmma_matmul_kernel(out, a, b, bias, has_bias, accumulate, k_per_split, hidden):
        # out[S,M,N]: out[z] (+)= op(a)[:, Kz] . op(b)[Kz, :] (+ bias[N] if has_bias), Kz the
        # z-th slice of k_per_split rows of K (S = 1 when K is not split); a, b: the words of
        # Bf16Matrix operands. hidden[M,N] (S = 1): GELU's output (gelu) or its input
        # (gelu_grad); else not read. (words: out [1, M, N/2] and hidden [M, N/2] in pairs)
        # grid: up to RESIDENT_BLOCKS blocks, each taking tiles blockIdx.x, + grid, ...; block
        # THREADS; dynamic shared memory SHARED_BYTES: STAGES stages from word `first` on
        tiles = dynamic_shared_words()
        first = atom_start(tiles)
        acc = cuda.local.array(ACCUMULATORS, float32)
        S, M, N = out.shape[0], out.shape[1], out.shape[2] * (2 if WORDS else 1)
        # K: the rows of a k-major operand; with both along k, their padded width (its zeros
        # add nothing)
        K = int32(a.shape[0] if transpose_a else b.shape[0] if not transpose_b else 2 * a.shape[1])
        a_pitch, b_pitch = int32(a.shape[1]), int32(b.shape[1])
        a_words, b_words = flat(a), flat(b)
        tid = int32(cuda.threadIdx.x)
        group, thread = tid >> 7, tid & 127             # the warpgroup, the thread in it
        tiles_m, tiles_n = int32((M + BM - 1) // BM), int32((N + BN - 1) // BN)
        items, step = int32(tiles_m * tiles_n * S), int32(cuda.gridDim.x)
        a_start, b_start = copy_start(tid, A_ALONG_K), copy_start(tid, B_ALONG_K)

        # the copies' cursor: the tile and k of the next slice to copy, STAGES - 1 slices
        # ahead of the one multiplied, from tile to tile
        load = int32(cuda.blockIdx.x)
        load_m0, load_n0, _, load_k, load_k_end = tile_of(load, tiles_m, tiles_n, k_per_split, K)
        for s in range(STAGES - 1):
            if load < items:
                copy_slice(tiles, first + s * STAGE_WORDS, a_words, a_pitch, a_start, b_words,
                           b_pitch, b_start, load_m0, load_n0, load_k, load_k_end, M, N)
                load, load_m0, load_n0, load_k, load_k_end = next_slice(
                    load, load_m0, load_n0, load_k, load_k_end, step, tiles_m, tiles_n,
                    k_per_split, K)
            commit_copies()             # (a group each slice, empty ones too: wait counts them)
        read, write = int32(0), int32(STAGES - 1)   # the stages of this slice and the copied
        for item in range(cuda.blockIdx.x, items, step):
            m0, n0, z, k_start, k_end = tile_of(item, tiles_m, tiles_n, k_per_split, K)
            for e in range(ACCUMULATORS):
                acc[e] = float32(0.0)
            for _ in range((k_end - k_start + BK - 1) // BK):
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
                               b_words, b_pitch, b_start, load_m0, load_n0, load_k, load_k_end,
                               M, N)    # while this slice's wgmma's run
                    load, load_m0, load_n0, load_k, load_k_end = next_slice(
                        load, load_m0, load_n0, load_k, load_k_end, step, tiles_m, tiles_n,
                        k_per_split, K)
                commit_copies()
                wgmma_wait(acc)
                read = int32(read + 1) if read < STAGES - 1 else int32(0)
                write = int32(write + 1) if write < STAGES - 1 else int32(0)
            store_tile(out, hidden, acc, bias, has_bias, accumulate, z, m0 + 64 * group, n0,
                       thread, M, N)

    return wgmma_matmul_kernel


# --- the launcher ----------------------------------------------------------------------------

def wgmma_matmul(out, a, b, bias=None, transpose_a=False, transpose_b=False, accumulate=False,
                 gelu_out=None, gelu_input=None):
    """out[M,N] (+)= op(a) . op(b) (+ bias), matmul_bf16's arguments and epilogues; a, b
    Bf16Matrix operands (already rounded). out, gelu_out and gelu_input all float32 arrays, or
    all Bf16Matrix's (the bf16 epilogue: nothing accumulated)."""
    hidden = gelu_out if gelu_out is not None else gelu_input
    words = hasattr(out, "words")                       # (a Bf16Matrix)
    check(hidden is None or hasattr(hidden, "words") == words,
          "matmul_wgmma: out and GELU's array must both be float32 or both Bf16Matrix's")
    check(not (words and accumulate), "matmul_wgmma: a product in bf16 is not added to")
    if not words:
        check_float32(out=out, gelu_out=gelu_out, gelu_input=gelu_input)
    check_float32(bias=bias)
    M, N, K = _check_matmul(out, a, b, bias, transpose_a, transpose_b, gelu_out, gelu_input)
    check(N % 2 == 0, f"matmul_wgmma: out's rows of {N}, an odd width (pairs are stored)")
    check(max(a.words.size, b.words.size) < 2**31,     # (the kernel's offsets are 32-bit)
          f"matmul_wgmma: an operand of {max(a.words.size, b.words.size)} words, 2^31 or more")
    # (split-K's sum reads 4 floats at a time: rows of other widths are not split; a product
    # in bf16 comes from the epilogue only: not split either)
    can_split = not words and all(aligned16(x) for x in (out, bias, hidden) if x is not None)
    splits = (split_count(M, N, K, slots=RESIDENT_BLOCKS, step=BK, value_bytes=2) if can_split
              else 1)
    k_per_split = k_per_slice(K, splits, step=BK)
    grid = (blocks(N, BN), blocks(M, BM), blocks(K, k_per_split))
    words_of = (lambda x: x.words) if words else (lambda x: x)
    launch_product(wgmma_matmul_kernel, THREADS, grid, k_per_split, words_of(out), a.words,
                   b.words, bias, transpose_a, transpose_b, accumulate,
                   None if gelu_out is None else words_of(gelu_out),
                   None if gelu_input is None else words_of(gelu_input),
                   blocks_at_once=RESIDENT_BLOCKS, shared_bytes=SHARED_BYTES, words=words)


PRECISION = "bf16"
MULTIPLE_OF = (8, 8, 8)                 # (rows of whole 16-byte copies: no pad to add)
TRANSPOSES = ((False, False), (False, True), (True, False))    # x W, dY W^T, x^T dY


def matmul(out, a, b, transpose_a=False, transpose_b=False):
    wgmma_matmul(out, Bf16Matrix(a, 2 * a.shape[1]), Bf16Matrix(b, 2 * b.shape[1]),
                 transpose_a=transpose_a, transpose_b=transpose_b)
