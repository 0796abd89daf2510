"""The bf16 and tf32 products on the tensor cores' mma.sync: any GPU of compute capability 8.0 on.

The family's function (matmul/reference.py's doc), of operands rounded once (operands.py's
Bf16Matrix, Tf32Matrix), with float32 sums: the product of two bf16 (two tf32) is exact in
float32, so the result differs from the float32 product by the operands' rounding alone. On a
GPU of compute capability 9.0 the family's dispatch sends bf16 products to wgmma.py (faster:
docs/perf.md); this kernel takes them on the 8.x GPUs, at widths wgmma does not take, and every
tf32 product. One kernel, mma_matmul_kernel(transpose_a, transpose_b, epilogue, element):
  block tile   a 128 x 128 tile of out, 4 warps (2 down, 2 across),
               each warp a 64 x 64 tile of it: 4 x 8 tiles of 16 x 8, one mma.sync each per k
               step (m16n8k16 for bf16, m16n8k8 for tf32), its float32 sums in the registers of
               the warp's lanes (ptx/mma.py says which): 128 a lane, so two blocks a
               multiprocessor. (A warp of 64 x 32 reads a third more shared memory a flop, and
               measured no faster: docs/perf.md)
  pipeline     K advances 16 words at a time (32 bf16, 16 tf32). Each slice of op(a) and op(b)
               is copied from device to shared memory by cp.async (ptx/asynccopy.py), 16 bytes
               a copy, in the operand's own orientation (k-major or not), STAGES slices ahead:
               while the warps multiply slice t, slices t+1 and t+2 are on their way, and no
               register holds them
  fragments    ldmatrix hands each lane its fragment of a 16 x 16 square, with .trans where the
               slice lies the other way, so a transposed operand costs nothing. A tf32 k-major
               operand cannot go through .trans (it moves 16-bit values and would tear each
               tf32 in half): its lanes read their fragments' words one by one, from tiles
               whose chunks are stored at c XOR 2 (r mod 4) (word_swizzle), one pass a load
  integers     the loop has few instructions an mma to spare, and they stand between the
               barrier and the first mma of a slice, where every warp of the block waits at
               once: what a thread copies, from where to where, and where a lane's fragments
               lie are computed once before the loop (copy_start, fragment_lanes), and each
               slice adds its k and its stage; offsets are 32-bit sums, shifts and masks (no
               signed // or %; the launcher checks that an operand has fewer than 2^31 words),
               a copy's bounds one compare, and fragments come out of ldmatrix in the order
               the mma takes them (else each mma moves registers)
  swizzle      the 8 rows one ldmatrix reads must fall in 8 different groups of 4 banks: each
               row's 16-byte chunks are stored permuted (ptx/sharedmem.swizzle), instead of
               padding the rows (which would not fit three stages in 48 KB)
  epilogue     bias, GELU or its backward, and what out holds (accumulate), added to each
               lane's sums before its stores (float32 out: a product written in bf16 goes
               through float32 here, the family's dispatch says how)
  split-K      as the float32 kernel: grid z takes a slice of K, summed in a fixed order
               (split_k.py)

Everything here is counted in words (a word: 32 bits, here a bf16 pair or one tf32), so that
the two element types share one layout: the operands' uint32 arrays (a Bf16Matrix's bf16 pairs,
a Tf32Matrix's words), shared memory, the fragments' registers.

Under the CUDA simulator the block is 2 x 2 warps of one 16 x 16 tile each (32 x 32): the
same code, small enough to test there.
"""
from numba import cuda, float32, int32, uint32

from ..gelu import gelu_derivative_sfu, gelu_value_sfu
from ..ptx.asynccopy import commit_copies, copy16_async, wait_copies
from ..ptx.mma import ldmatrix_x4, ldmatrix_x4_trans, load_shared_u32, mma_bf16, mma_tf32
from ..ptx.sharedmem import swizzle
from ..ptx.vector import aligned16, flat
from ..runtime import device
from ..runtime.device import SIMULATOR
from ..runtime.launch import blocks, check, check_float32, inlined, kernel_factory, launch
from . import split_k
from .reference import EPILOGUES, bias_argument, check_matmul, epilogue_of

WARPS_M, WARPS_N = 2, 2                                # warps down and across a block
# 16 x 8 tiles down and across a warp (the epilogue takes 1, 2 or 4 down, 2, 4 or 8 across)
MMA_M, MMA_N = (1, 2) if SIMULATOR else (4, 8)
WM, WN = 16 * MMA_M, 8 * MMA_N          # a warp's tile of out
BM, BN = WARPS_M * WM, WARPS_N * WN
BK_WORDS = 16                           # k a slice, in 32-bit words: two steps of 8 words
                                        # (an m16n8k16 of bf16 or an m16n8k8 of tf32 each)
PER_WORD = {"bf16": 2, "tf32": 1}       # values a word holds, of each element type
BK = BK_WORDS * PER_WORD["bf16"]        # k a slice of bf16 (32)
THREADS = 32 * WARPS_M * WARPS_N
STAGES = 3                              # slices in shared memory: 3 x 16 KB, static's 48 KB
A_COPIES = BM * BK_WORDS // 4 // THREADS    # 16-byte copies a thread makes of a slice of op(a)
B_COPIES = BK_WORDS * BN // 4 // THREADS
BLOCKS_PER_SM = 2                       # resident blocks a multiprocessor (8 warps): up to
                                        # 255 registers a thread
BOUNDS = {} if SIMULATOR else dict(launch_bounds=(THREADS, BLOCKS_PER_SM))
WAIT_FOR_OLDEST = wait_copies(STAGES - 2)   # (until the oldest slice's copies have landed)


def word_swizzle(chunks):
    """The stored place of 16-byte chunk c of row r in a tile read one 32-bit word a lane, 4
    rows (r mod 4 = 0 .. 3) by 8 consecutive words at a time (a tf32 fragment of a k-major
    operand, matmul/mma_sync.py): c XOR 2 (r mod 4), so that the 4 rows' runs of 8 words (2 chunks)
    fall in the 4 different quarters of a bank line (rows of 8 chunks or more). Adding a
    multiple of 4 to r, or of 8 to c, changes nothing (its bits lie above the XOR's): the
    fragments' offsets use that."""
    check(chunks >= 8, f"matmul_tf32: a k-major tile of {chunks} chunks a row")

    @inlined
    def swizzled(r, c):
        return c ^ ((r & 3) << 1)
    return swizzled


def log2(n):
    check(n & (n - 1) == 0, f"matmul_mma: {n} is not a power of 2")
    return n.bit_length() - 1


@kernel_factory
def mma_matmul_kernel(transpose_a, transpose_b, epilogue=None, element="bf16"):
    """The tensor-core kernel (see the module's doc) for one (transpose_a, transpose_b),
    epilogue: None, "gelu" (gelu(out) also written to `gelu_array`) or "gelu_grad" (the product,
    plus bias, times gelu'(gelu_array)), and element type: "bf16", or "tf32"."""
    check(epilogue in EPILOGUES, f"matmul_mma: unknown epilogue {epilogue!r}")
    check(element in PER_WORD, f"matmul_mma: unknown element type {element!r}")
    A_ALONG_K = not transpose_a         # a[M,K]: its rows run along k
    B_ALONG_K = transpose_b             # b[N,K]: likewise
    GELU, GELU_GRAD = epilogue == "gelu", epilogue == "gelu_grad"
    TF32 = element == "tf32"
    mma = mma_tf32 if TF32 else mma_bf16
    # In 32-bit words the two types are one layout (ptx/mma.py): a word holds PER values
    # along the operand's contiguous axis, a 16-byte copy CHUNK of them, a slice BK of k
    PER = PER_WORD[element]
    LOG_PER, CHUNK, BK = log2(PER), 4 * PER, BK_WORDS * PER
    # tf32 fragments of a k-major operand: read a word a lane (ldmatrix.trans moves 16-bit
    # values), from a tile swizzled for that
    A_WORDWISE, B_WORDWISE = TF32 and not A_ALONG_K, TF32 and not B_ALONG_K
    # A slice in shared memory: words along the operand's contiguous axis, [BM, BK] or
    # [BK, BM] for op(a), [BN, BK] or [BK, BN] for op(b), rows of A_ROW / B_ROW words; STAGES
    # of them one after another in a flat array (offsets: plain integer sums)
    A_ROW = BK_WORDS if A_ALONG_K else BM // PER
    B_ROW = BK_WORDS if B_ALONG_K else BN // PER
    A_STAGE, B_STAGE = BM * BK_WORDS, BK_WORDS * BN
    A_WORDS, B_WORDS = STAGES * A_STAGE, STAGES * B_STAGE
    a_swizzled = word_swizzle(A_ROW // 4) if A_WORDWISE else swizzle(A_ROW // 4)
    b_swizzled = word_swizzle(B_ROW // 4) if B_WORDWISE else swizzle(B_ROW // 4)
    # (the divisions below by powers of 2 are shifts and masks: a signed // or % costs a
    # dozen instructions where the loop has few to spare)
    LOG_BK_CHUNKS = log2(BK // CHUNK)
    LOG_BM_CHUNKS, LOG_BN_CHUNKS = log2(BM // CHUNK), log2(BN // CHUNK)

    # A thread's copies of a slice: the slice's rows are `chunks` 16-byte chunks wide, and
    # thread tid copies chunk tid % chunks of rows i, i + APART, i + 2 APART, ... (i = tid //
    # chunks, APART = THREADS // chunks). Its chunk, and so the column it reads, is the same
    # in every copy and every slice, and the rows differ by a constant: one offset, computed
    # once (copy_start), stands for them all, and each slice only moves it along k
    A_LOG_CHUNKS = LOG_BK_CHUNKS if A_ALONG_K else LOG_BM_CHUNKS
    B_LOG_CHUNKS = LOG_BK_CHUNKS if B_ALONG_K else LOG_BN_CHUNKS
    A_APART, B_APART = THREADS >> A_LOG_CHUNKS, THREADS >> B_LOG_CHUNKS
    # (rows APART apart have the same swizzle: its pattern repeats every 8 rows, or every 4
    # for word_swizzle, so the stored place of copy r is copy 0's plus r APART rows)
    check(A_APART % (4 if A_WORDWISE else 8) == 0 and B_APART % (4 if B_WORDWISE else 8) == 0,
          "matmul_mma: a thread's copies would not share a swizzle")

    @inlined
    def copy_start(tid, log_chunks, row_words, swizzled, along_k, first, size, k_end):
        # where thread tid's first copy of every slice goes, and what it reads: (place, row,
        # col, row_end, col_end): the word in a stage it is stored at; x's row and column (in
        # values) at k = 0, which load_slice moves to the slice's k; the bounds of x that
        # hold values, [:row_end] x [:col_end]
        i, chunk = tid >> log_chunks, tid & ((1 << log_chunks) - 1)
        place = int32(i * row_words + 4 * swizzled(i, chunk))
        if along_k:                     # x[size, K]: a copy is CHUNK consecutive k
            return place, int32(first + i), int32(CHUNK * chunk), int32(size), int32(k_end)
        return place, int32(i), int32(first + CHUNK * chunk), int32(k_end), int32(size)

    @inlined
    def load_slice(tiles, base, x, pitch, copies, along_k, apart, row_words, start, k0):
        # start copying this thread's part of op(x)'s slice at k0 into the stage at
        # tiles[base:]: x[row + r apart, col : col + CHUNK] to tiles[base + place + r apart
        # row_words :], r = 0 .. copies - 1 (start: copy_start's); zeros outside [:row_end] x
        # [:col_end] (x's pad is zeros). x: flat(words), `pitch` words a row. The offsets are
        # 32-bit sums (a 64-bit one costs two instructions, its compares three, and the loop
        # has few to spare): the launcher checks that x holds fewer than 2^31 words (the
        # largest the model has, the LM head's dlogits [16384, 50304] in tf32, holds 2^29.6)
        place, row, col, row_end, col_end = start
        if along_k:
            col = int32(col + k0)
        else:
            row = int32(row + k0)
        at = int32(row * pitch + (col >> LOG_PER))
        rows_left = int32(row_end - row)    # (a row past x's end is not read: zeros)
        cols_inside = col < col_end
        for r in range(copies):
            inside = cols_inside and apart * r < rows_left
            copy16_async(tiles, (base + place + apart * r * row_words,), x,
                         (uint32(at + apart * r * pitch) if inside else uint32(0),), inside)
                                        # (nothing is read outside; x[0] is legal. Unsigned:
                                        # widened to the 64-bit address by zeros, one
                                        # multiply-add, where a signed index takes four)

    @inlined
    def fragment_lanes(first, row_in, chunk_in, along_k, row_words, swizzled):
        # the words, within a stage, that this lane gives ldmatrix for an operand's fragments
        # (first: the warp's first row m or n of the block tile), computed once: every other
        # is one of them plus a constant (the swizzle repeats every 8 rows). Rows along k (m
        # or n rows): one for each k16 step of the slice, (2 step + chunk_in) the chunk,
        # fragment i (A: 16 rows) or tile j (B: 8) further down. k-major (k rows): one for
        # each group q of 16 columns (A's fragment i = q, B's tiles j = 2q and j + 1), step 1
        # 16 rows further down
        if along_k:
            r = first + row_in
            return (int32(r * row_words + 4 * swizzled(r, chunk_in)),
                    int32(r * row_words + 4 * swizzled(r, 2 + chunk_in)), int32(0), int32(0))
        r = row_in                      # (the chunk of m (n) = first + 16 q is 2 q + first / 8)
        return (int32(r * row_words + 4 * swizzled(r, (first >> 3) + chunk_in)),
                int32(r * row_words + 4 * swizzled(r, (first >> 3) + 2 + chunk_in)),
                int32(r * row_words + 4 * swizzled(r, (first >> 3) + 4 + chunk_in)),
                int32(r * row_words + 4 * swizzled(r, (first >> 3) + 6 + chunk_in)))

    @inlined
    def word_columns(first, lane, row_words, swizzled):
        # where, within a stage, a lane of a wordwise operand finds its word of 8-word column
        # group q = 0..3 of the warp's tile (columns first + 8q + g, rows k = t): whatever the
        # step, the k + 4 half or the group u, the place is column[u & 3] plus a constant,
        # (8 step + 4 half) row_words + 32 (u >> 2) (word_swizzle's doc says why)
        g, t = lane >> 2, lane & 3
        return (int32(t * row_words + 4 * swizzled(t, (first >> 2) + (g >> 2)) + (g & 3)),
                int32(t * row_words + 4 * swizzled(t, (first >> 2) + 2 + (g >> 2)) + (g & 3)),
                int32(t * row_words + 4 * swizzled(t, (first >> 2) + 4 + (g >> 2)) + (g & 3)),
                int32(t * row_words + 4 * swizzled(t, (first >> 2) + 6 + (g >> 2)) + (g & 3)))

    @inlined
    def k_step(acc, a_frag, b_frag, a_tiles, b_tiles, a_base, b_base, step, a_lanes, b_lanes,
               a_columns, b_columns):
        # the warp's 16 x 8 tiles times k step `step` (8 words) of the slice in the stages at
        # a_base, b_base. One ldmatrix gives a lane one word of each of four 8 x 8 matrices, in
        # the order of the fragment's registers (A: m16 x 8 words, 4 words; B: two 8 words x
        # n8, 2 words each); lanes 8q .. 8q+7 address matrix q's 8 rows, at a_lanes, b_lanes
        # (fragment_lanes, of the kernel's lane_rows) plus constants. A
        # wordwise operand's lane reads its fragment's words one by one (ptx/mma.py's tf32
        # table), rows k = t, t + 4 of the step by columns m = g, g + 8 (A) or n = g (B), at
        # a_columns, b_columns (word_columns) plus constants
        for i in range(MMA_M):
            if A_WORDWISE:
                for e in range(4):      # a0 .. a3: m + 8 if e & 1, k + 4 if e >> 1
                    u = 2 * i + (e & 1)             # (the 8-column group of m)
                    row = 8 * step + 4 * (e >> 1)
                    a_frag[i, e] = load_shared_u32(a_tiles, (
                        a_base + a_columns[u & 3] + 32 * (u >> 2) + row * A_ROW,))
                continue
            at = (a_base + a_lanes[step] + 16 * i * A_ROW if A_ALONG_K else
                  a_base + a_lanes[i] + 16 * step * A_ROW,)
            if A_ALONG_K:
                a_frag[i, 0], a_frag[i, 1], a_frag[i, 2], a_frag[i, 3] = ldmatrix_x4(a_tiles, at)
            else:
                a_frag[i, 0], a_frag[i, 1], a_frag[i, 2], a_frag[i, 3] = ldmatrix_x4_trans(
                    a_tiles, at)
        for j in range(0, MMA_N, 2):
            if B_WORDWISE:
                for e in range(4):      # b0, b1 of tiles j, j + 1: k + 4 if e & 1
                    u = j + (e >> 1)
                    row = 8 * step + 4 * (e & 1)
                    b_frag[u, e & 1] = load_shared_u32(b_tiles, (
                        b_base + b_columns[u & 3] + 32 * (u >> 2) + row * B_ROW,))
                continue
            at = (b_base + b_lanes[step] + 8 * j * B_ROW if B_ALONG_K else
                  b_base + b_lanes[j >> 1] + 16 * step * B_ROW,)
            if B_ALONG_K:
                b_frag[j, 0], b_frag[j, 1], b_frag[j + 1, 0], b_frag[j + 1, 1] = ldmatrix_x4(
                    b_tiles, at)
            else:
                b_frag[j, 0], b_frag[j, 1], b_frag[j + 1, 0], b_frag[j + 1, 1] = \
                    ldmatrix_x4_trans(b_tiles, at)
        for i in range(MMA_M):
            for j in range(MMA_N):
                acc[i, j, 0], acc[i, j, 1], acc[i, j, 2], acc[i, j, 3] = mma(
                    a_frag[i, 0], a_frag[i, 1], a_frag[i, 2], a_frag[i, 3],
                    b_frag[j, 0], b_frag[j, 1],
                    acc[i, j, 0], acc[i, j, 1], acc[i, j, 2], acc[i, j, 3])

    @inlined
    def finish(out, gelu_array, value, accumulate, z, row, col, N):
        # out[z, row, col] (+)= the epilogue of one sum (the bias added)
        if col < N:
            if GELU_GRAD:
                value *= gelu_derivative_sfu(gelu_array[row, col])
            if accumulate:
                value += out[z, row, col]
            out[z, row, col] = value
            if GELU:
                gelu_array[row, col] = gelu_value_sfu(value)

    @inlined
    def store_tile(out, gelu_array, acc, i, j, bias, has_bias, accumulate, z, row0, col0, lane, M,
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
            finish(out, gelu_array, acc[i, j, 0] + bias0, accumulate, z, row, col, N)
            finish(out, gelu_array, acc[i, j, 1] + bias1, accumulate, z, row, col + 1, N)
        if row + 8 < M:
            finish(out, gelu_array, acc[i, j, 2] + bias0, accumulate, z, row + 8, col, N)
            finish(out, gelu_array, acc[i, j, 3] + bias1, accumulate, z, row + 8, col + 1, N)

    @inlined
    def store_tiles(out, gelu_array, acc, i, bias, has_bias, accumulate, z, row0, col0, lane, M, N):
        # the tiles (i, 0 .. MMA_N - 1)
        store_tile(out, gelu_array, acc, i, 0, bias, has_bias, accumulate, z, row0, col0, lane, M, N)
        store_tile(out, gelu_array, acc, i, 1, bias, has_bias, accumulate, z, row0, col0, lane, M, N)
        if MMA_N > 2:
            store_tile(out, gelu_array, acc, i, 2, bias, has_bias, accumulate, z, row0, col0, lane,
                       M, N)
            store_tile(out, gelu_array, acc, i, 3, bias, has_bias, accumulate, z, row0, col0, lane,
                       M, N)
        if MMA_N > 4:
            for j in (4, 5, 6, 7):      # (a literal tuple: unrolled, j a constant each time)
                store_tile(out, gelu_array, acc, i, j, bias, has_bias, accumulate, z, row0, col0,
                           lane, M, N)

    @cuda.jit(**BOUNDS)
    def mma_matmul_kernel(out, a, b, bias, has_bias, accumulate, k_per_split, gelu_array):
        # out[S,M,N]: out[z] (+)= op(a)[:, Kz] . op(b)[Kz, :] (+ bias[N] if has_bias), Kz the
        # z-th slice of k_per_split rows of K (S = 1 when K is not split); a, b: the words of
        # Bf16Matrix (its bf16 pairs) or Tf32Matrix operands. gelu_array[M,N] (S = 1): GELU's
        # output (gelu) or its input (gelu_grad); else not read.
        # grid (N/BN, M/BM, S), block THREADS: warp w takes the warp tile (w // WARPS_N,
        # w % WARPS_N) of the block's
        a_tiles = cuda.shared.array(A_WORDS, uint32)
        b_tiles = cuda.shared.array(B_WORDS, uint32)
        acc = cuda.local.array((MMA_M, MMA_N, 4), float32)
        a_frag = cuda.local.array((MMA_M, 4), uint32)
        b_frag = cuda.local.array((MMA_N, 2), uint32)
        M, N = out.shape[1], out.shape[2]
        # K: the rows of a k-major operand; with both along k, their padded width (its
        # zeros add nothing)
        K = a.shape[0] if transpose_a else b.shape[0] if not transpose_b else PER * a.shape[1]
        a_pitch, b_pitch = a.shape[1], b.shape[1]
        a_words, b_words = flat(a), flat(b)
        z = cuda.blockIdx.z
        k_start = z * k_per_split
        k_end = min(K, k_start + k_per_split)
        slices = int32((k_end - k_start + BK - 1) // BK)     # (32-bit: the loop's counters too)
        tid = cuda.threadIdx.x
        warp, lane = tid >> 5, tid & 31
        wm, wn = (warp // WARPS_N) * WM, (warp % WARPS_N) * WN
        m0, n0 = cuda.blockIdx.y * BM, cuda.blockIdx.x * BN
        # lane_rows: the slice's row (within 16) and chunk (within 2) whose address each lane
        # gives ldmatrix, so that matrix q comes out as the fragment's q-th register. A's
        # registers are (m 0-7, k 0-7), (m 8-15, k 0-7), (m 0-7, k 8-15), (m 8-15, k 8-15);
        # B's, for n8 tiles j and j + 1: (j, k 0-7), (j, k 8-15), (j + 1, k 0-7), (j + 1, k 8-15).
        # So where the rows are m (A along k) or k (B k-major), q's low bit picks the half of
        # the rows; else (A k-major, B along k) its high bit does. (Out of order, each mma
        # would take its fragment through register moves.)
        low_bit_rows = ((lane & 7) + 8 * ((lane >> 3) & 1), lane >> 4)
        high_bit_rows = ((lane & 7) + 8 * (lane >> 4), (lane >> 3) & 1)
        a_lane = low_bit_rows if A_ALONG_K else high_bit_rows
        b_lane = high_bit_rows if B_ALONG_K else low_bit_rows
        a_lanes = fragment_lanes(wm, a_lane[0], a_lane[1], A_ALONG_K, A_ROW, a_swizzled)
        b_lanes = fragment_lanes(wn, b_lane[0], b_lane[1], B_ALONG_K, B_ROW, b_swizzled)
        # (for a wordwise operand; else never read)
        a_columns = word_columns(wm, lane, A_ROW, a_swizzled)
        b_columns = word_columns(wn, lane, B_ROW, b_swizzled)
        for i in range(MMA_M):
            for j in range(MMA_N):
                for e in range(4):
                    acc[i, j, e] = float32(0.0)

        a_start = copy_start(tid, A_LOG_CHUNKS, A_ROW, a_swizzled, A_ALONG_K, m0, M, k_end)
        b_start = copy_start(tid, B_LOG_CHUNKS, B_ROW, b_swizzled, B_ALONG_K, n0, N, k_end)
        for s in range(STAGES - 1):     # the first slices on their way, a group each
            if s < slices:
                load_slice(a_tiles, s * A_STAGE, a_words, a_pitch, A_COPIES, A_ALONG_K, A_APART,
                           A_ROW, a_start, k_start + s * BK)
                load_slice(b_tiles, s * B_STAGE, b_words, b_pitch, B_COPIES, B_ALONG_K, B_APART,
                           B_ROW, b_start, k_start + s * BK)
            commit_copies()
        read, write = int32(0), int32(STAGES - 1)   # the stages of slices t, t + STAGES - 1
        for t in range(slices):
            WAIT_FOR_OLDEST()           # this thread's copies of slice t have landed, and
            cuda.syncthreads()          # everyone's; and everyone is done with slice t - 1
            if t + STAGES - 1 < slices:     # into slice t - 1's stage
                k0 = k_start + (t + STAGES - 1) * BK
                load_slice(a_tiles, write * A_STAGE, a_words, a_pitch, A_COPIES, A_ALONG_K,
                           A_APART, A_ROW, a_start, k0)
                load_slice(b_tiles, write * B_STAGE, b_words, b_pitch, B_COPIES, B_ALONG_K,
                           B_APART, B_ROW, b_start, k0)
            commit_copies()             # (a group each slice, empty ones too: wait counts them)
            # the slice's two k steps, written out: each indexes the fragments' offsets
            # with a constant step
            k_step(acc, a_frag, b_frag, a_tiles, b_tiles, read * A_STAGE, read * B_STAGE, 0,
                   a_lanes, b_lanes, a_columns, b_columns)
            k_step(acc, a_frag, b_frag, a_tiles, b_tiles, read * A_STAGE, read * B_STAGE, 1,
                   a_lanes, b_lanes, a_columns, b_columns)
            read = int32(read + 1) if read < STAGES - 1 else int32(0)
            write = int32(write + 1) if write < STAGES - 1 else int32(0)

        # the epilogue, tile by tile, written out (as in slice_product, the loops there are
        # unrolled by the compiler; here their bodies are too long for it): a loop over the
        # tiles would index acc at run time, and acc would move from registers to memory
        store_tiles(out, gelu_array, acc, 0, bias, has_bias, accumulate, z, m0 + wm, n0 + wn, lane,
                    M, N)
        if MMA_M > 1:
            store_tiles(out, gelu_array, acc, 1, bias, has_bias, accumulate, z, m0 + wm, n0 + wn,
                        lane, M, N)
        if MMA_M > 2:
            store_tiles(out, gelu_array, acc, 2, bias, has_bias, accumulate, z, m0 + wm, n0 + wn,
                        lane, M, N)
            store_tiles(out, gelu_array, acc, 3, bias, has_bias, accumulate, z, m0 + wm, n0 + wn,
                        lane, M, N)

    return mma_matmul_kernel


def resident_blocks():
    """Blocks of mma_matmul_kernel this device runs at once: a wave of the grid."""
    return BLOCKS_PER_SM * device.current().multiprocessors


def matmul_mma(out, a, b, bias=None, transpose_a=False, transpose_b=False, accumulate=False,
               gelu_out=None, gelu_input=None, element="bf16"):
    """out[M,N] (+)= op(a) . op(b) (+ bias) of operands already rounded (a, b: Bf16Matrix for
    element "bf16", Tf32Matrix for "tf32"); out, gelu_out and gelu_input float32."""
    check_float32(out=out, bias=bias, gelu_out=gelu_out, gelu_input=gelu_input)
    M, N, K = check_matmul(out, a, b, bias, transpose_a, transpose_b, gelu_out, gelu_input)
    # the operands' words as the kernel takes them: a Bf16Matrix's bf16 pairs, a Tf32Matrix's
    # values as uint32
    a_words, b_words = (x.bf16_pairs if element == "bf16" else x.tf32_bits for x in (a, b))
    check(max(a_words.size, b_words.size) < 2**31,     # (the kernel's offsets are 32-bit)
          f"matmul_{element}: an operand of {max(a_words.size, b_words.size)} words, 2^31 or more")
    gelu_array = gelu_out if gelu_out is not None else gelu_input
    # (split-K's sum reads 4 floats at a time: rows of other widths are not split)
    can_split = all(aligned16(x) for x in (out, bias, gelu_array) if x is not None)
    step = BK_WORDS * PER_WORD[element]         # k a slice
    splits = split_k.split_count(M, N, K, resident_blocks(), step, 4, (BM, BN)) if can_split else 1
    k_per_split = split_k.k_per_slice(K, splits, step)
    grid = (blocks(N, BN), blocks(M, BM), blocks(K, k_per_split))
    bias, has_bias = bias_argument(out, bias)
    if grid[2] == 1:                    # one pass: the epilogue does the rest
        kernel = mma_matmul_kernel(bool(transpose_a), bool(transpose_b),
                                   epilogue_of(gelu_out, gelu_input), element)
        launch(kernel, grid, THREADS, out.reshape(1, M, N), a_words, b_words, bias, has_bias,
               accumulate, k_per_split, a_words if gelu_array is None else gelu_array)
        return
    partials = split_k.partials(grid[2], M, N)
    launch(mma_matmul_kernel(bool(transpose_a), bool(transpose_b), None, element), grid,
           THREADS, partials, a_words, b_words, bias, False, False, k_per_split, a_words)
    split_k.finish(out, partials, bias, has_bias, accumulate, gelu_out, gelu_input)
