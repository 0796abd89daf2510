"""Not kept: v20 in clusters of two blocks sharing b's slice, each copying half for both.
H100 2026-12-08: 0.68x cuBLAS bf16 at 16384x3072x768 (v20 0.70x in the same run)

    out[M,N] = a[M,K] @ b[K,N]     as v20: a, b bf16 (uint32 pairs), out float32;
                                   M multiple of 256, N of 256, K of 64

Why: v20's block reads 48 KB of operands from L2 for each slice of 128 x 256 x 64, 4.2
MFLOP: 0.0114 bytes a flop. At 480 TFLOP/s (v20 at 0.70x cuBLAS) that is 5.5 TB/s from L2
into the 132 multiprocessors, about what the H100's L2 gives; L2, not the tensor cores, sets
v20's pace. cuBLAS and CUTLASS's Hopper kernels read less: a cluster of blocks, on
neighbouring multiprocessors, share an operand by TMA's multicast (one read of L2, the box
written into the shared memory of every block of the cluster named in a mask).

Here a cluster is two blocks along m, tiles (2p, n) and (2p + 1, n): the same columns of b.
Block r of the cluster copies its own a (16 KB) and half of b's four 64-column boxes, 2r and
2r + 1, multicast to both (16 KB): 32 KB from L2 a slice, not 48. Each block's `full[s]`
still expects 48 KB (its a, its half of b, the other block's half); what changes is who may
overwrite a stage: a block's copy writes into the other block's stage too, so `empty[s]`
completes when the consumers of BOTH blocks are done with slice s. A consumer warp arrives,
once its wgmma's are done, on the empty barrier of each block of the cluster (lane r on
block r's, through mapa), 8 warps x 2 blocks = 16 arrivals a phase; an arrival keeps
mbarrier.arrive's default semantics (release, the block's scope), as CUTLASS's do: with the
cluster's scope ptxas puts a fence of the whole GPU (MEMBAR.ALL.GPU) before each. The blocks
of a cluster walk their tiles in step (the same n, the same count), meet once their barriers
are made (the other block's first multicast may land before this one has started) and again
before they end (the other block may still arrive on their barriers). The launch names the
cluster (runtime/launch.py: cuda.core's launch, which numba-cuda does not offer). The
simulator has no clusters: there the cluster is one block, copying all of b itself, its
arrivals its own.

Measured (H100, 2026-12-08, `tools/dev/run.py matmul --only v20,v21,v22`): 0.173 ms against
v20's 0.169 at 16384x3072x768, 0.140 against 0.141 at 16384x768x3072; with clusters of four
(a box of b each) 0.260 ms. A third fewer bytes from L2 bought nothing, so L2 is not what
holds v20 back: the epilogue does (the step's q, k, v products, bf16 out and only a bias,
run at 0.88-0.92x cuBLAS; docs/perf.md), with the tensor cores' own pace from shared memory.
Not in the package; its PTX (ptx/tma.py) and cluster launch (runtime/launch.py) stay for the
next kernel that shares an operand.
"""
import numpy as np
from numba import cuda, float32, int32, uint64

from nanoandrea.kernels.ptx.sharedmem import dynamic_shared_floats
from nanoandrea.kernels.ptx.tma import (arrive_expect_tx, barrier_sync, box_load,
                                        box_load_multicast, box_store, bulk_commit,
                                        bulk_reads_done, bulk_wait_all, cluster_sync,
                                        encode_tensor_map, fence_mbarrier_init,
                                        mbarrier_arrive_at, mbarrier_init, registers_down,
                                        registers_up, tensormap_acquire, wait_phase)
from nanoandrea.kernels.ptx.wgmma import (ATOM_BYTES, K_MAJOR, MN_MAJOR, atom_start,
                                          dynamic_shared_words, fence_for, fence_proxy_async,
                                          wait_for, wgmma_commit, wgmma_m64nNk16)
from nanoandrea.kernels.runtime import device
from nanoandrea.kernels.runtime.launch import SIMULATOR, inlined, launch

PRECISION = "bf16"
MULTIPLE_OF = (256, 256, 64)
EXTRA_ARGUMENTS = (uint64[:, ::1],)             # the kernel's after (out, a, b): the maps
CLUSTER = 1 if SIMULATOR else 2                 # blocks a cluster, along m
BM, BN, BK = 128, 256, 64       # block tile, K slice
ROW_WORDS = 32                  # a swizzled row: 128 bytes, 32 uint32 words (8 chunks of 4)
B_HALF_WORDS = BK * ROW_WORDS   # a box of 64 columns of b's slice: 64 rows (k) x 64 n, 8 KB
B_BOXES = BN // 64              # b's boxes a slice; a block of the cluster copies its share
GROUP = 128                     # threads a warpgroup
THREADS = 3 * GROUP             # the producer, then two consumers of 64 rows each
CONSUMER_WARPS = 8
STAGES = 4
A_WORDS = BM * ROW_WORDS        # a's slice: 128 rows (m) x 64 k                       16 KB
STAGE_WORDS = A_WORDS + 4 * B_HALF_WORDS    # then b's four boxes of 64 k x 64 n      48 KB
STAGE_BYTES = 4 * STAGE_WORDS                   # what lands in a block a slice: 48 KB
SUMS = BN // 2                  # a consumer thread's float32s of its 64 x 256 (128)
BOX_COLUMNS, BOX_ROWS = 32, 64                  # a box of out: 32 float32s (128 bytes) x 64
BOX_WORDS = BOX_ROWS * BOX_COLUMNS              # 8 KB
OUT_WORDS = 2 * 2 * BOX_WORDS                   # the two consumers' two buffers each: 32 KB
BOUNDS = {} if SIMULATOR else dict(launch_bounds=(THREADS, 1))
multiply = wgmma_m64nNk16(BN, K_MAJOR, MN_MAJOR(4 * B_HALF_WORDS))
fence_sums, wait_all, wait_but_one = fence_for(SUMS), wait_for(SUMS), wait_for(SUMS, pending=1)

load_a, load_b = box_load(BM, True), box_load_multicast(BK, True)
store_box, bulk_wait_read_but_one = box_store(False), bulk_reads_done[1]


@cuda.jit(**BOUNDS)
def wgmma_cluster_kernel(out, a, b, maps):
    # out[M,N] = a . b; maps: [3, 16] uint64, a's, b's and out's tensor maps; as v20's kernel,
    # in clusters of CLUSTER blocks along x (see the module's doc)
    tiles = dynamic_shared_words()
    first = atom_start(tiles)
    barriers = first + STAGES * STAGE_WORDS + OUT_WORDS
    M, N, K = out.shape[0], out.shape[1], 2 * a.shape[1]
    pairs_m = M // BM // CLUSTER                # the clusters' tiles down m, for each n
    rank = int32(cuda.blockIdx.x % CLUSTER)     # (a cluster of CLUSTER blocks along x)
    cluster, clusters = cuda.blockIdx.x // CLUSTER, cuda.gridDim.x // CLUSTER
    tid = int32(cuda.threadIdx.x)
    if tid == 0:
        for s in range(STAGES):
            mbarrier_init(tiles, barriers + 2 * s, 1)                       # the producer's
            mbarrier_init(tiles, barriers + 2 * (STAGES + s), CONSUMER_WARPS * CLUSTER)
        fence_mbarrier_init()
    cluster_sync()                              # (every block's barriers made)
    group, thread = tid // GROUP, tid % GROUP
    if group == 0:
        registers_down()
        if thread == 0:
            produce(tiles, a, b, maps, first, barriers, pairs_m, pairs_m * (N // BN), K // BK,
                    rank, cluster, clusters)
    else:
        registers_up()
        consume_by_boxes(out, tiles, maps, first, barriers, pairs_m, pairs_m * (N // BN),
                         K // BK, rank, cluster, clusters, group, thread)
    cluster_sync()                              # (the other block's arrivals on ours done)


@inlined
def tile_of(pair, pairs_m, rank):
    """The block's tile of the cluster's work item `pair`: (m0, n0)."""
    return ((pair % pairs_m) * CLUSTER + rank) * BM, (pair // pairs_m) * BN


@inlined
def produce(tiles, a, b, maps, first, barriers, pairs_m, pairs, slices, rank, cluster,
            clusters):
    """The producer's one thread: each slice of each of the block's tiles, its a copied by
    TMA into its stage, and its share of b's boxes into the stage of every block of the
    cluster, once the stage is released by the consumers of all of them."""
    n = int32(0)                                # the block's slice count, over its tiles
    tensormap_acquire(maps, 0)
    tensormap_acquire(maps, 1)
    everyone = int32((1 << CLUSTER) - 1)        # (the multicast's mask: every block)
    for pair in range(cluster, pairs, clusters):
        m0, n0 = tile_of(pair, pairs_m, rank)
        for s in range(slices):
            stage = n % STAGES
            full = barriers + 2 * stage
            wait_phase(tiles, barriers + 2 * (STAGES + stage), ((n // STAGES) & 1) ^ 1)
            arrive_expect_tx(tiles, full, STAGE_BYTES)
            at = first + stage * STAGE_WORDS
            load_a(tiles, at, maps, 0, a, s * BK // 2, m0, 0, full)     # (columns in words:
            for j in range(rank * (B_BOXES // CLUSTER),               # a bf16 pair each)
                           (rank + 1) * (B_BOXES // CLUSTER)):
                load_b(tiles, at + A_WORDS + j * B_HALF_WORDS, maps, 1, b, (n0 + 64 * j) // 2,
                       s * BK, 0, full, everyone)
            n += 1


@inlined
def consume_by_boxes(out, tiles, maps, first, barriers, pairs_m, pairs, slices, rank,
                     cluster, clusters, group, thread):
    """Consumer `group`'s 64 rows of each of the block's tiles, each tile stored by boxes."""
    values = dynamic_shared_floats()            # (the same shared memory, as float32s)
    buffers = first + STAGES * STAGE_WORDS + (group - 1) * 2 * BOX_WORDS
    sums = cuda.local.array(SUMS, float32)
    n = int32(0)                                # the block's slice count, over its tiles
    for pair in range(cluster, pairs, clusters):
        m0, n0 = tile_of(pair, pairs_m, rank)
        n = multiply_tile(tiles, sums, first, barriers, group, thread, n, slices)
        store_by_boxes(values, buffers, maps, out, sums, m0 + (group - 1) * 64, n0, group,
                       thread)
    if thread == 0:
        bulk_wait_all()                         # (out's last boxes written)


@inlined
def store_by_boxes(values, buffers, maps, out, sums, row0, col0, group, thread):
    """out[row0:+64, col0:+256] = a consumer's sums, in 8 boxes of 32 columns (v20's)."""
    store_box_of(values, buffers, maps, out, sums, row0, col0, group, thread, 0)
    store_box_of(values, buffers, maps, out, sums, row0, col0, group, thread, 1)
    store_box_of(values, buffers, maps, out, sums, row0, col0, group, thread, 2)
    store_box_of(values, buffers, maps, out, sums, row0, col0, group, thread, 3)
    store_box_of(values, buffers, maps, out, sums, row0, col0, group, thread, 4)
    store_box_of(values, buffers, maps, out, sums, row0, col0, group, thread, 5)
    store_box_of(values, buffers, maps, out, sums, row0, col0, group, thread, 6)
    store_box_of(values, buffers, maps, out, sums, row0, col0, group, thread, 7)


@inlined
def store_box_of(values, buffers, maps, out, sums, row0, col0, group, thread, p):
    """Box p (columns 32 p .. 32 p + 31) of the consumer's 64 x 256 (v20's)."""
    warp, lane = thread // 32, thread % 32
    row = 16 * warp + lane // 4                 # in the box; and row + 8
    buffer = buffers + (p % 2) * BOX_WORDS
    if thread == 0:
        bulk_wait_read_but_one()                # (this buffer's last box has been read)
    barrier_sync(group, GROUP)
    for jj in range(BOX_COLUMNS // 8):
        j = 4 * p + jj                          # columns 8 j .. 8 j + 7 of the 256
        x = 8 * jj + 2 * (lane % 4)             # the thread's first column in the box
        chunk, within = x // 4, x % 4
        for h in range(2):
            r = row + 8 * h
            at = buffer + r * BOX_COLUMNS + 4 * (chunk ^ (r % 8)) + within
            values[at], values[at + 1] = sums[4 * j + 2 * h], sums[4 * j + 2 * h + 1]
    fence_proxy_async()                         # (the writes, seen by the copy engine)
    barrier_sync(group, GROUP)
    if thread == 0:
        store_box(values, buffer, maps, 2, out, col0 + BOX_COLUMNS * p, row0, 0)
        bulk_commit()


@inlined
def release(tiles, barriers, stage, thread):
    """The consumer warp is done with `stage`: lane r arrives on the stage's empty barrier
    in block r of the cluster (wgmma's wait is the warp's together: once lane r is past it,
    so is the warp)."""
    lane = thread % 32
    if lane < CLUSTER:
        mbarrier_arrive_at(tiles, barriers + 2 * (STAGES + stage), lane)


@inlined
def multiply_tile(tiles, sums, first, barriers, group, thread, n, slices):
    """Consumer `group`'s sums of one tile, slices n .. n + slices - 1 of the block's count
    (returned: the count after them), each slice's stage released once its wgmma's are done
    (v20's, released in every block of the cluster)."""
    rows = (group - 1) * 64 * ROW_WORDS         # the consumer's 64 rows of a's slice
    for e in range(SUMS):
        sums[e] = float32(0.0)
    for s in range(slices):
        stage = n % STAGES
        wait_phase(tiles, barriers + 2 * stage, (n // STAGES) & 1)
        at = first + stage * STAGE_WORDS
        fence_sums(sums)
        for kk in range(BK // 16):              # a: 32 bytes on along its rows; b: 16 rows
            multiply(sums, tiles, at + rows + 8 * kk, tiles,
                     at + A_WORDS + 16 * kk * ROW_WORDS)
        wgmma_commit()
        wait_but_one(sums)                      # (slice n - 1's wgmma's are done)
        if s > 0:
            release(tiles, barriers, (n - 1) % STAGES, thread)
        n += 1
    wait_all(sums)
    release(tiles, barriers, (n - 1) % STAGES, thread)
    return n


_maps = {}      # (a's, b's and out's addresses and shapes): their tensor maps on the device


def maps_of(out, a, b):
    """a's, b's and out's tensor maps, a [3, 16] uint64 device array (v20's)."""
    maps = np.zeros((3, 16), np.uint64)
    if SIMULATOR:                   # (the twins read and write the arrays: no maps)
        return cuda.to_device(maps)
    key = tuple((x.device_ctypes_pointer.value, x.shape) for x in (out, a, b))
    if key not in _maps:
        maps[0], maps[1] = encode_tensor_map(a, True, BM), encode_tensor_map(b, True, 64)
        maps[2] = encode_tensor_map(out, False, BOX_ROWS)
        _maps[key] = cuda.to_device(maps)
    return _maps[key]


def resident_blocks():
    """One block an SM, in whole clusters (the simulator's one, taking every tile)."""
    return 1 if SIMULATOR else device.current().multiprocessors // CLUSTER * CLUSTER


def matmul(out, a, b):
    M, N = out.shape
    clusters = min(resident_blocks() // CLUSTER, (M // BM // CLUSTER) * (N // BN))
    launch(wgmma_cluster_kernel, clusters * CLUSTER, THREADS, out, a, b, maps_of(out, a, b),
           shared_bytes=4 * (STAGES * STAGE_WORDS + OUT_WORDS) + ATOM_BYTES + 16 * STAGES,
           cluster=CLUSTER)
