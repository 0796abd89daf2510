"""Matrix multiply on Hopper's warpgroup tensor-core instruction (wgmma, sm_90a), fed and
emptied by its copy engine (TMA): bf16 operands, float32 sums.

    out[M,N]  (+)=  op(a)[M,K] . op(b)[K,N]  (+ bias[N])      op(x) = x or x^T

The bf16 product's function, with its arguments, operands (a Bf16Matrix's bf16 pairs) and
epilogues, by another kernel: on a GPU of compute capability 9.0 (the H100, the H200) the
family's dispatch sends bf16 products here (`takes` says which). Its NumPy twin is
reference.matmul_bf16_numpy.

Why a second tensor-core kernel: mma.sync (matmul/mma_sync.py) is a warp's instruction on operands
in its registers; every fragment comes from shared memory through ldmatrix first, and from
Numba it reaches about 530-570 TFLOP/s on the H200 at best. wgmma is one instruction for a
warpgroup of 4 warps (128 threads), D [64,256] += A [64,16] B [16,256], with A and B read by
the tensor cores themselves straight from shared memory, named by matrix descriptors
(ptx/wgmma.py), either operand as it lies, k-contiguous or not. The ladder
tools/dev/matmul/v12-v20 builds this kernel a step at a time, each step measured
(docs/perf.md): v16 is the last with the threads copying (cp.async), v17 splits the block into
a producer and consumers, v18 gives the copies to TMA, v19 the stores, v20 the registers.

The kernel, wgmma_matmul_kernel(transpose_a, transpose_b, epilogue, bf16_out, biased):
  block        one an SM, persistent (it takes tiles blockIdx.x, + grid, ...; down m first,
               so that the blocks at work at once share op(b)'s columns), 384 threads in 3
               warpgroups with roles (CUTLASS's "warp-specialized" kernels):
  producer     warpgroup 0: one thread copies every K slice of 64 of each of the block's
               128 x 256 tiles into one of 4 stages of shared memory (48 KB each; 3 with
               GELU's epilogue, whose buffers take the fourth: shared_layout), by TMA
               (ptx/tma.py): op(a)'s slice as one box of 128 rows of 64 k (a, K-major)
               or two of 64 rows of k by 64 m (a^T, MN-major), op(b)'s as one box of 256 rows
               of 64 k (b^T) or four of 64 k by 64 n (b), each into wgmma's 128-byte swizzle,
               zeros past the operands' edges. It waits until a stage is released (`empty`,
               an mbarrier), then tells its `full` mbarrier the 48 KB to expect
  consumers    warpgroups 1 and 2: each 64 rows x 256 columns of the tile, 128 float32 sums a
               thread. A slice: wait for its stage's `full` phase, 4 wgmma's (m64n256k16),
               commit, wait for all groups but this one, release the LAST slice's stage: the
               next slice's wgmma's queue behind this one's, the tensor cores never run dry
  epilogue     a consumer hands its 64 x 256 to the copy engine a box at a time (64 rows of
               128 bytes: 32 float32 or 64 bf16 columns) through two 8 KB buffers of its own:
               it waits until the buffer's last box has been read (a bulk group), writes its
               sums there with the epilogue applied (swizzled: a warp's 8 rows in 8 bank
               groups), fences them for the async proxy, meets its warpgroup at a named
               barrier, and one thread stores the box (cp.async.bulk.tensor; `accumulate`:
               the engine's reduce-add, out += box, so out is never read here). The stores
               land while the consumer multiplies its next tile.
               bias: the sums start at it, before the tile's first wgmma (start_sums), so
               the epilogue has nothing to load. GELU (the MLP up): out and GELU's output
               both, a box of each per pass, in two pairs of buffers (four), so that a pass
               waits for the stores of the pass two before, not the one just issued. GELU's
               backward: its input's box is loaded into the buffer first (TMA, an mbarrier a
               buffer, two boxes ahead) and the product times gelu' written over it. GELU's
               exp and division on the special-function unit (gelu_value_sfu). `bf16_out`, the
               bf16 epilogue: out is written as the next products read it (a Bf16Matrix's
               bf16 pairs: half float32's bytes, no rounding pass after), GELU's output too
               (of out as rounded), and GELU's backward reads its input so
  registers    setmaxnreg: the producer warpgroup drops to 40 registers a thread, the
               consumers rise to 232 (the block's 65,536 / 384 = 168 each would spill the
               epilogue's addresses)
  split-K      as the float32 kernel's: the tiles of every slice of K are the blocks' work; their partial
               sums are added in a fixed order (matmul.sum_splits)
Operands and out are named by tensor maps (ptx/tma.py: a device table, made once for each
array's memory). Shared memory, coordinates and offsets are counted in words (a word: 32 bits,
here a bf16 pair or a float32). Offsets are 32-bit: the launcher checks that an operand has
fewer than 2^31 words.
"""
import numba
from numba import cuda, float32, int32, uint64

from ..gelu import gelu_derivative_sfu, gelu_value_sfu
from ..ptx.mma import bf16_pair, bf16_unpair
from ..ptx.sharedmem import dynamic_shared_floats
from ..ptx.tma import (CONSUMER_REGISTERS, PRODUCER_REGISTERS, ROW_WORDS, arrive_expect_tx,
                       barrier_sync, box_add, box_load, box_store, bulk_commit, bulk_reads_done,
                       bulk_wait_all, mbarrier_arrive, mbarrier_init, registers_down,
                       registers_up, tensor_maps, tensormap_acquire, wait_phase)
from ..ptx.vector import aligned16, load2
from ..ptx.wgmma import (ATOM_BYTES, K_MAJOR, MN_MAJOR, atom_start, dynamic_shared_words,
                         fence_for, fence_proxy_async, wait_for, wgmma_commit, wgmma_m64nNk16)
from ..runtime import device
from ..runtime.device import SIMULATOR
from ..runtime.launch import blocks, check, check_float32, inlined, kernel_factory, launch
from . import split_k
from .reference import EPILOGUES, bias_argument, check_matmul, epilogue_of

BM, BN, BK = 128, 256, 64       # the block tile of out; k a slice (one 128-byte row of bf16)
GROUP = 128                     # threads a warpgroup
THREADS = 3 * GROUP             # the producer, then two consumers of 64 rows each
# setmaxnreg moves registers between a block's warpgroups, no more: the block is launched with
# 168 a thread (65,536 / 384, down to a multiple of 8), so (40 + 2 x 232) x 128 = 168 x 384. A
# warpgroup asking for more would wait in setmaxnreg.inc forever
assert ((PRODUCER_REGISTERS + 2 * CONSUMER_REGISTERS) * GROUP
        <= 65536 // THREADS // 8 * 8 * THREADS)
PAIRS = 3                       # products summed in one pass at most (attention's q, k, v dX)
A_WORDS = BM * ROW_WORDS        # op(a)'s slice: 128 rows x 64 k, or 64 k x 2 x 64 m   16 KB
BLOCK_WORDS = BK * ROW_WORDS    # an MN-major box: 64 rows of k x 64 columns            8 KB
STAGE_WORDS = A_WORDS + BN * ROW_WORDS          # then op(b)'s: 256 x 64 k              48 KB
STAGE_BYTES = 4 * STAGE_WORDS
BOX_ROWS = 64                   # a box of out: a consumer's 64 rows x 128 bytes        8 KB
BOX_WORDS = BOX_ROWS * ROW_WORDS
SUMS = BN // 2                  # a consumer thread's float32s of its 64 x 256
BOUNDS = {} if SIMULATOR else dict(launch_bounds=(THREADS, 1))
fence_sums, wait_all, wait_but_one = fence_for(SUMS), wait_for(SUMS), wait_for(SUMS, pending=1)


def shared_layout(epilogue):
    """(stages, buffers, bytes): the K slices in shared memory, each consumer's buffers of out
    (a box each), and the block's dynamic shared memory. GELU's epilogue writes two boxes a
    pass: with 2 buffers each pass would wait for the last one's stores to have read them, so
    it takes 4 (two passes in flight) and gives up a stage for them (of the 227 KB an SM gives
    a block, 4 x 48 KB + 2 x 4 x 8 KB do not fit, 3 x 48 + 2 x 4 x 8 KB do). GELU's backward
    measures slower so and keeps 4 stages and 2 buffers (docs/perf.md)."""
    stages, buffers = (3, 4) if epilogue == "gelu" else (4, 2)
    barriers = 2 * stages + 2 * buffers     # full[s], empty[s]; each consumer's loaded[b]
    return stages, buffers, (4 * (stages * STAGE_WORDS + 2 * buffers * BOX_WORDS) + ATOM_BYTES
                             + 8 * barriers)


@inlined
def tile_of(item, tiles_m, tiles_n, k_per_split, K):
    """Work item `item`'s tile: (first row m0, first column n0, split z, its k range)."""
    tm = item % tiles_m
    rest = item // tiles_m
    z = rest // tiles_n
    k_start = z * k_per_split
    return (int32(tm * BM), int32((rest % tiles_n) * BN), int32(z), int32(k_start),
            int32(min(K, k_start + k_per_split)))


@kernel_factory
def wgmma_matmul_kernel(transpose_a, transpose_b, epilogue=None, bf16_out=False, biased=False):
    """The kernel (see the module's doc) for one (transpose_a, transpose_b) and epilogue: None,
    "gelu" (gelu(out) also written to `gelu_array`) or "gelu_grad" (the product, plus bias, times
    gelu'(gelu_array)). bf16_out: out and gelu_array are the bf16 pairs of Bf16Matrix's,
    [1, M, N/2] and [M, N/2]: out rounded to bf16, GELU of out as rounded, rounded too; nothing
    accumulated. biased: the bias is added (the sums start at it), whatever the launch's
    has_bias says: a kernel of its own, since a sum chosen at run time between the bias and 0
    costs ptxas's wgmma pipeline (start_sums)."""
    check(epilogue in EPILOGUES, f"matmul_wgmma: unknown epilogue {epilogue!r}")
    A_ALONG_K = not transpose_a         # a[M,K]: its rows run along k
    B_ALONG_K = transpose_b             # b[N,K]: likewise
    GELU, GELU_GRAD = epilogue == "gelu", epilogue == "gelu_grad"
    BF16_OUT, BIASED = bf16_out, biased
    STAGES, BUFFERS, _ = shared_layout(epilogue)
    multiply = wgmma_m64nNk16(BN, K_MAJOR if A_ALONG_K else MN_MAJOR(4 * BLOCK_WORDS),
                              K_MAJOR if B_ALONG_K else MN_MAJOR(4 * BLOCK_WORDS))
    load_a = box_load(BM if A_ALONG_K else BK, True)
    load_b = box_load(BN if B_ALONG_K else BK, True)
    load_box, store_box = box_load(BOX_ROWS, BF16_OUT), box_store(BF16_OUT)
    shared_values = dynamic_shared_words if BF16_OUT else dynamic_shared_floats
    BOX_COLUMNS = 64 if BF16_OUT else 32   # out's columns in a box
    GROUPS = BOX_COLUMNS // 8           # wgmma's 8-column groups of D in a box
    BOXES = BN // BOX_COLUMNS           # a consumer's boxes a tile: 4 or 8
    # GELU's backward loads each buffer an even number of times a tile, so that every tile's
    # first load into it completes a phase of parity 0
    check(not GELU_GRAD or BOXES // BUFFERS % 2 == 0,
          "matmul_wgmma: GELU's backward needs an even count of boxes a buffer")
    # before a box is written: at most one group still reading (the other buffer's box, or
    # GELU's other pair of buffers)
    buffer_free = bulk_reads_done[1]
    all_read = bulk_reads_done[0]

    @inlined
    def produce(tiles, a_parts, b_parts, maps, a_maps, b_maps, pairs, k_pair, first, barriers,
                tiles_m, tiles_n, items, k_per_split, K):
        # the producer's one thread: each slice of each of the block's tiles into its stage;
        # slice k of the pairs' K is pair k // k_pair's slice k % k_pair
        for j in range(pairs):
            tensormap_acquire(maps, a_maps[j])
            tensormap_acquire(maps, b_maps[j])
        n = int32(0)                            # the block's slice count, over its tiles
        for item in range(cuda.blockIdx.x, items, cuda.gridDim.x):
            m0, n0, _, k_start, k_end = tile_of(item, tiles_m, tiles_n, k_per_split, K)
            for pair_k in range(k_start, k_end, BK):
                j = pair_k // k_pair
                k = pair_k - j * k_pair
                a, b, a_map, b_map = a_parts[j], b_parts[j], a_maps[j], b_maps[j]
                stage = n % STAGES
                full = barriers + 2 * stage
                wait_phase(tiles, barriers + 2 * (STAGES + stage), ((n // STAGES) & 1) ^ 1)
                arrive_expect_tx(tiles, full, STAGE_BYTES)
                at = first + stage * STAGE_WORDS
                if A_ALONG_K:                   # (coordinates in words: a bf16 pair each)
                    load_a(tiles, at, maps, a_map, a, k >> 1, m0, 0, full)
                else:
                    load_a(tiles, at, maps, a_map, a, m0 >> 1, k, 0, full)
                    load_a(tiles, at + BLOCK_WORDS, maps, a_map, a, (m0 + 64) >> 1, k, 0, full)
                if B_ALONG_K:
                    load_b(tiles, at + A_WORDS, maps, b_map, b, k >> 1, n0, 0, full)
                else:
                    for j in range(BN // 64):
                        load_b(tiles, at + A_WORDS + j * BLOCK_WORDS, maps, b_map, b,
                               (n0 + 64 * j) >> 1, k, 0, full)
                n += 1

    @inlined
    def start_sums(sums, bias, col0, N, thread):
        # the sums start at the bias of their columns (wgmma adds to what D holds), or at 0.
        # wgmma's D layout (ptx/wgmma.py): thread 32 w + 4 g + t holds rows 16 w + g and 8
        # more, columns 8 j + 2 t and the next, in sums[4 j .. 4 j + 3]. All 32 loads issue
        # before the first wgmma needs them: one wait a tile, where the epilogue waited once a
        # box. Every load is made, none behind a test: ptxas serializes every wgmma of the
        # kernel (C7515) once a sum's first value is chosen by a branch or a select. A group
        # past out's last column loads the last group's pair instead (N is a multiple of 8);
        # its sums are clipped by the stores.
        if BIASED:
            start, last = int32(col0 + 2 * (thread & 3)), int32(N - col0 - 8)
            for j in range(BN // 8):
                b0, b1 = load2(bias, (start + min(int32(8 * j), last),))
                sums[4 * j], sums[4 * j + 1], sums[4 * j + 2], sums[4 * j + 3] = b0, b1, b0, b1
        else:
            for e in range(SUMS):
                sums[e] = float32(0.0)

    @inlined
    def multiply_tile(tiles, sums, first, barriers, group, n, slices):
        # consumer `group`'s sums of one tile (started by start_sums), slices n .. n + slices
        # - 1 of the block's count (returned: the count after them), each stage released once
        # its wgmma's are done
        a_rows = (group - 1) * (64 * ROW_WORDS if A_ALONG_K else BLOCK_WORDS)
        for s in range(slices):
            stage = n % STAGES
            wait_phase(tiles, barriers + 2 * stage, (n // STAGES) & 1)
            at = first + stage * STAGE_WORDS
            fence_sums(sums)
            for kk in range(BK // 16):          # K-major: 32 bytes on along the rows;
                multiply(sums, tiles,           # MN-major: 16 rows of k on
                         at + a_rows + (8 * kk if A_ALONG_K else 16 * kk * ROW_WORDS), tiles,
                         at + A_WORDS + (8 * kk if B_ALONG_K else 16 * kk * ROW_WORDS))
            wgmma_commit()
            wait_but_one(sums)                  # (slice n - 1's wgmma's are done)
            if s > 0:
                mbarrier_arrive(tiles, barriers + 2 * (STAGES + (n - 1) % STAGES))
            n += 1
        wait_all(sums)
        if slices > 0:                          # (a split past K's end has none)
            mbarrier_arrive(tiles, barriers + 2 * (STAGES + (n - 1) % STAGES))
        return n

    @inlined
    def box_column(col0, p):
        # the word of out's rows where box p of the tile's columns from col0 begins
        return (col0 + BOX_COLUMNS * p) >> 1 if BF16_OUT else col0 + BOX_COLUMNS * p

    @inlined
    def load_input(values, buffers, loaded, maps, gelu_map, gelu_array, row0, col0, p):
        # GELU's backward: its input's box p into buffer p % BUFFERS, counted off its loaded
        barrier = loaded + 2 * (p % BUFFERS)
        arrive_expect_tx(values, barrier, 4 * BOX_WORDS)
        load_box(values, buffers + (p % BUFFERS) * BOX_WORDS, maps, gelu_map, gelu_array,
                 box_column(col0, p), row0, 0, barrier)

    @inlined
    def store_box_of(values, buffers, loaded, maps, out_map, gelu_map, out, gelu_array, sums,
                     accumulate, z, row0, col0, thread, group, p):
        # box p (a constant: the sums are registers while every index into them is one) of
        # the consumer's 64 x 256 at (row0, col0), the bias already in the sums: its epilogue
        # written into a buffer, then stored (start_sums says which sums are whose)
        warp, lane = thread >> 5, thread & 31
        row, t = 16 * warp + (lane >> 2), lane & 3
        # GELU: out's box in buffer 2 (p % 2), GELU's in the next; else buffer p % BUFFERS
        buffer = buffers + ((p % 2) * 2 if GELU else p % BUFFERS) * BOX_WORDS
        if GELU_GRAD:                           # (its input has landed in the buffer)
            wait_phase(values, loaded + 2 * (p % BUFFERS), (p // BUFFERS) & 1)
        else:
            if thread == 0:
                buffer_free()
            barrier_sync(group, GROUP)
        for jj in range(GROUPS):
            j = GROUPS * p + jj                 # columns 8 j .. 8 j + 7 of the 256
            for h in range(2):
                r = row + 8 * h
                # the pair's place in the box: a word (BF16_OUT) or two floats, swizzled.
                # Unsigned: Numba gives a signed index a test and a fix-up for negative values
                # (from the end), two more instructions a read or write of the box
                if BF16_OUT:
                    at = uint64(buffer + r * ROW_WORDS + 4 * (jj ^ (r & 7)) + t)
                else:
                    at = uint64(buffer + r * ROW_WORDS + 4 * ((2 * jj + (t >> 1)) ^ (r & 7))
                                + 2 * (t & 1))
                at_next, at_gelu = at + uint64(1), at + uint64(BOX_WORDS)
                x0, x1 = sums[4 * j + 2 * h], sums[4 * j + 2 * h + 1]
                if GELU_GRAD:
                    if BF16_OUT:
                        g0, g1 = bf16_unpair(values[at])
                    else:
                        g0, g1 = values[at], values[at_next]
                    x0 *= gelu_derivative_sfu(g0)
                    x1 *= gelu_derivative_sfu(g1)
                if BF16_OUT:
                    pair = bf16_pair(x0, x1)
                    values[at] = pair
                    if GELU:                    # (of the values as rounded: what backward
                        r0, r1 = bf16_unpair(pair)                              # reads)
                        values[at_gelu] = bf16_pair(gelu_value_sfu(r0), gelu_value_sfu(r1))
                else:
                    values[at], values[at_next] = x0, x1
                    if GELU:
                        values[at_gelu] = gelu_value_sfu(x0)
                        values[at_gelu + uint64(1)] = gelu_value_sfu(x1)
        fence_proxy_async()                     # (the writes, seen by the copy engine)
        barrier_sync(group, GROUP)
        if thread == 0:
            x = box_column(col0, p)
            if accumulate:
                box_add(values, buffer, maps, out_map, out, x, row0, z)
            else:
                store_box(values, buffer, maps, out_map, out, x, row0, z)
            if GELU:
                store_box(values, buffer + BOX_WORDS, maps, gelu_map, gelu_array, x, row0, 0)
            bulk_commit()
            if GELU_GRAD and p + BUFFERS < BOXES:   # the box BUFFERS on, once this one is read
                all_read()
                load_input(values, buffers, loaded, maps, gelu_map, gelu_array, row0, col0,
                           p + BUFFERS)

    @inlined
    def store_tile(values, buffers, loaded, maps, out_map, gelu_map, out, gelu_array, sums,
                   accumulate, z, row0, col0, thread, group):
        # the consumer's boxes of the tile, one call each (a loop this long is not unrolled)
        store_box_of(values, buffers, loaded, maps, out_map, gelu_map, out, gelu_array, sums,
                     accumulate, z, row0, col0, thread, group, 0)
        store_box_of(values, buffers, loaded, maps, out_map, gelu_map, out, gelu_array, sums,
                     accumulate, z, row0, col0, thread, group, 1)
        store_box_of(values, buffers, loaded, maps, out_map, gelu_map, out, gelu_array, sums,
                     accumulate, z, row0, col0, thread, group, 2)
        store_box_of(values, buffers, loaded, maps, out_map, gelu_map, out, gelu_array, sums,
                     accumulate, z, row0, col0, thread, group, 3)
        if BOXES > 4:
            store_box_of(values, buffers, loaded, maps, out_map, gelu_map, out, gelu_array,
                         sums, accumulate, z, row0, col0, thread, group, 4)
            store_box_of(values, buffers, loaded, maps, out_map, gelu_map, out, gelu_array,
                         sums, accumulate, z, row0, col0, thread, group, 5)
            store_box_of(values, buffers, loaded, maps, out_map, gelu_map, out, gelu_array,
                         sums, accumulate, z, row0, col0, thread, group, 6)
            store_box_of(values, buffers, loaded, maps, out_map, gelu_map, out, gelu_array,
                         sums, accumulate, z, row0, col0, thread, group, 7)

    @inlined
    def consume(tiles, first, barriers, out, gelu_array, bias, accumulate, maps, out_map,
                gelu_map, tiles_m, tiles_n, items, k_per_split, K, N, group, thread):
        # consumer `group` (1 or 2): its 64 rows of each of the block's tiles
        values = shared_values()                # (the same shared memory, as out's values)
        buffers = first + STAGES * STAGE_WORDS + (group - 1) * BUFFERS * BOX_WORDS
        loaded = barriers + 2 * (2 * STAGES + BUFFERS * (group - 1))
        sums = cuda.local.array(SUMS, float32)
        if thread == 0:
            tensormap_acquire(maps, out_map)
            if GELU or GELU_GRAD:
                tensormap_acquire(maps, gelu_map)
        n = int32(0)                            # the block's slice count, over its tiles
        for item in range(cuda.blockIdx.x, items, cuda.gridDim.x):
            m0, n0, z, k_start, k_end = tile_of(item, tiles_m, tiles_n, k_per_split, K)
            row0 = m0 + 64 * (group - 1)
            if GELU_GRAD and thread == 0:       # (the last tile's boxes read: the buffers
                all_read()                      # are free)
                for p in range(min(BUFFERS, BOXES)):
                    load_input(values, buffers, loaded, maps, gelu_map, gelu_array, row0, n0, p)
            start_sums(sums, bias, n0, N, thread)
            n = multiply_tile(tiles, sums, first, barriers, group, n,
                              (k_end - k_start + BK - 1) // BK)
            store_tile(values, buffers, loaded, maps, out_map, gelu_map, out, gelu_array, sums,
                       accumulate, z, row0, n0, thread, group)
        if thread == 0:
            bulk_wait_all()                     # (out's last boxes written)

    @cuda.jit(**BOUNDS)
    def wgmma_matmul_kernel(out, a, b, bias, has_bias, accumulate, k_per_split, gelu_array, maps,
                            a_maps, b_maps, out_map, gelu_map, pairs, a_parts, b_parts):
        # out[S,M,N]: out[z] (+)= op(a)[:, Kz] . op(b)[Kz, :] (+ bias[N] if biased; has_bias,
        # the launcher's, says the same and is not read), Kz the z-th slice of k_per_split rows
        # of K (S = 1 when K is not split); a, b: the bf16 pairs of Bf16Matrix operands.
        # gelu_array[M,N] (S = 1): GELU's output (gelu) or its input
        # (gelu_grad); else not read. (BF16_OUT: out [1, M, N/2] and gelu_array [M, N/2] in pairs)
        # pairs > 1: out (+)= the sum of the products op(a_parts[j]) . op(b_parts[j]), j <
        # pairs, of one shape (a, b: the first): one product over their K's one after
        # another, each padded to a whole slice. maps: the tensor-map table; a_maps[j],
        # b_maps[j], out_map, gelu_map: the rows of a_parts[j], b_parts[j], out, gelu_array.
        # grid: up to RESIDENT_BLOCKS blocks; block THREADS; dynamic shared memory
        # shared_layout(epilogue)'s bytes: from word `first` on the stages, the buffers, the
        # mbarriers
        tiles = dynamic_shared_words()
        first = atom_start(tiles)
        barriers = first + STAGES * STAGE_WORDS + 2 * BUFFERS * BOX_WORDS
        S, M, N = out.shape[0], out.shape[1], out.shape[2] * (2 if BF16_OUT else 1)
        # K: the rows of a k-major operand; with both along k, their padded width (its zeros
        # add nothing)
        K = int32(a.shape[0] if transpose_a else b.shape[0] if not transpose_b else 2 * a.shape[1])
        k_pair = K if pairs == 1 else (K + BK - 1) // BK * BK
        K = int32(pairs * k_pair)
        tiles_m, tiles_n = int32((M + BM - 1) // BM), int32((N + BN - 1) // BN)
        items = int32(tiles_m * tiles_n * S)
        tid = int32(cuda.threadIdx.x)
        if tid == 0:
            for s in range(STAGES):
                mbarrier_init(tiles, barriers + 2 * s, 1)           # the producer's arrival
                mbarrier_init(tiles, barriers + 2 * (STAGES + s), 2 * GROUP)    # consumers'
            for q in range(2 * BUFFERS):
                mbarrier_init(tiles, barriers + 2 * (2 * STAGES + q), 1)
        cuda.syncthreads()
        group, thread = tid >> 7, tid & 127     # the warpgroup, the thread in it
        if group == 0:
            registers_down()
            if thread == 0:
                produce(tiles, a_parts, b_parts, maps, a_maps, b_maps, pairs, k_pair, first,
                        barriers, tiles_m, tiles_n, items, k_per_split, K)
        else:
            registers_up()
            consume(tiles, first, barriers, out, gelu_array, bias, accumulate, maps,
                    out_map, gelu_map, tiles_m, tiles_n, items, k_per_split, K, N, group,
                    thread)

    return wgmma_matmul_kernel


# --- the launcher ----------------------------------------------------------------------------

def resident_blocks():
    """The persistent grid: one block a multiprocessor (one in the simulator, which then takes
    every tile in turn)."""
    return 1 if SIMULATOR else device.current().multiprocessors


def takes(out, bias=None, gelu_array=None, a=None, b=None):
    """Whether this kernel takes the product: on a GPU that runs wgmma (runtime/device.py),
    when out's rows are a multiple of 8 values (the split-K sum's fours; a Bf16Matrix then has
    no padding to keep zero; the tensor maps' 16-byte row strides) and every array is 16-byte
    aligned (the tensor maps' and the 8-byte bias loads'). Any M and K. out and gelu_array are
    float32 arrays or Bf16Matrix's, a and b Bf16Matrix's."""
    arrays = [getattr(x, "bf16_pairs", x) for x in (out, bias, gelu_array, a, b) if x is not None]
    return device.runs_wgmma() and out.shape[1] % 8 == 0 and all(aligned16(x) for x in arrays)


def matmul_wgmma(out, a, b, bias=None, transpose_a=False, transpose_b=False, accumulate=False,
                 gelu_out=None, gelu_input=None, more_pairs=()):
    """out[M,N] (+)= op(a) . op(b) (+ bias); a, b Bf16Matrix operands (already rounded). out,
    gelu_out and gelu_input all float32 arrays, or all Bf16Matrix's (the bf16 epilogue: nothing
    accumulated). more_pairs: up to PAIRS - 1 more (a, b) of a's and b's shapes and
    orientation, their products added in the same pass (`takes_pairs`): the sums stay in the
    registers, out is written once."""
    gelu_array = gelu_out if gelu_out is not None else gelu_input
    bf16_out = hasattr(out, "bf16_pairs")               # (a Bf16Matrix)
    check(gelu_array is None or hasattr(gelu_array, "bf16_pairs") == bf16_out,
          "matmul_wgmma: out and GELU's array must both be float32 or both Bf16Matrix's")
    check(not (bf16_out and accumulate), "matmul_wgmma: a product in bf16 is not added to")
    if not bf16_out:
        check_float32(out=out, gelu_out=gelu_out, gelu_input=gelu_input)
    check_float32(bias=bias)
    M, N, K = check_matmul(out, a, b, bias, transpose_a, transpose_b, gelu_out, gelu_input)
    check(N % 8 == 0, f"matmul_wgmma: out's rows of {N}, not a multiple of 8")
    pairs = [(a, b), *more_pairs]
    check(takes_pairs(pairs) and (len(pairs) == 1 or gelu_array is None and not bf16_out),
          f"matmul_wgmma: {len(pairs)} pairs, not all of one shape and kind (at most {PAIRS})")
    check(max(x.bf16_pairs.size for pair in pairs for x in pair) < 2**31,   # (32-bit offsets)
          "matmul_wgmma: an operand of 2^31 words or more")
    # the pairs' K one after another, each padded to whole slices
    K_all = K if len(pairs) == 1 else len(pairs) * blocks(K, BK) * BK
    # (a product in bf16 comes from the epilogue only: not split)
    splits = 1 if bf16_out else split_k.split_count(M, N, K_all, resident_blocks(), BK, 2,
                                                 (BM, BN))
    k_per_split = split_k.k_per_slice(K_all, splits, BK)
    grid = (blocks(N, BN), blocks(M, BM), blocks(K_all, k_per_split))
    filled = pairs + [pairs[0]] * (PAIRS - len(pairs))     # (the kernel's tuples: PAIRS each)

    def tensor_map_arguments(out, gelu_array):
        # the table, each pair's rows in it, out's and gelu_array's (out: [S, M, N] as the
        # kernel writes it; gelu_array: None where there is none), then the pairs themselves
        table, rows = tensor_maps(*[(a.bf16_pairs, True, BK if transpose_a else BM)
                                    for a, _ in filled],
                                  *[(b.bf16_pairs, True, BN if transpose_b else BK)
                                    for _, b in filled],
                                  (out, bf16_out, BOX_ROWS),
                                  (out if gelu_array is None else gelu_array, bf16_out, BOX_ROWS))
        return (table, rows[:PAIRS], rows[PAIRS:2 * PAIRS], *rows[2 * PAIRS:], len(pairs),
                tuple(a.bf16_pairs for a, _ in filled), tuple(b.bf16_pairs for _, b in filled))

    # out and GELU's array as the kernel takes them: a Bf16Matrix's bf16 pairs [M, N/2]
    out_array = out.bf16_pairs if bf16_out else out
    gelu_argument = (None if gelu_array is None else
                     gelu_array.bf16_pairs if bf16_out else gelu_array)
    bias, has_bias = bias_argument(out_array, bias)
    # the persistent grid: each block takes tiles in turn, from every slice of K
    launched = min(grid[0] * grid[1] * grid[2], resident_blocks())
    ta, tb = bool(transpose_a), bool(transpose_b)
    if grid[2] == 1:        # one pass, the bias in the sums and the epilogue doing the rest
        epilogue = epilogue_of(gelu_out, gelu_input)
        out_array = out_array.reshape(1, *out_array.shape)
        biased = has_bias and splits == 1
        launch(wgmma_matmul_kernel(ta, tb, epilogue, bf16_out, biased), launched, THREADS,
               out_array, a.bf16_pairs, b.bf16_pairs, bias, has_bias, accumulate, k_per_split,
               a.bf16_pairs if gelu_argument is None else gelu_argument,
               *tensor_map_arguments(out_array, gelu_argument),
               shared_bytes=shared_layout(epilogue)[2])
        return
    # split-K: the partial products have no bias (their sum adds it)
    partials = split_k.partials(grid[2], M, N)
    launch(wgmma_matmul_kernel(ta, tb), launched, THREADS, partials, a.bf16_pairs, b.bf16_pairs,
           bias, False, False, k_per_split, a.bf16_pairs, *tensor_map_arguments(partials, None),
           shared_bytes=shared_layout(None)[2])
    split_k.finish(out, partials, bias, has_bias, accumulate, gelu_out, gelu_input)


def takes_pairs(pairs):
    """Whether one pass can sum the products of these (a, b) pairs: at most PAIRS, every a of
    one shape and array type (the kernel indexes a tuple of them), every b likewise."""
    def alike(xs):
        return (len({x.shape for x in xs}) == 1
                and len({numba.typeof(x.bf16_pairs) for x in xs}) == 1)
    return len(pairs) <= PAIRS and alike([a for a, _ in pairs]) and alike([b for _, b in pairs])
