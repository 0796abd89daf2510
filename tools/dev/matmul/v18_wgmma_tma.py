"""v17 with the copies made by the tensor memory accelerator (TMA): one thread, five
instructions a slice.
H200 2026-12-03: 0.43x cuBLAS bf16 at 16384x3072x768 (0.254 ms), 0.69x at 16384x768x3072

    out[M,N] = a[M,K] @ b[K,N]     as v17: a, b bf16 (uint32 pairs), out float32;
                                   M multiple of 128, N of 256, K of 64

v17's producer warpgroup issues a slice's 3,072 cp.async's, 24 a thread with their addressing,
and ran at 0.31x cuBLAS. Hopper copies a tile with one instruction: cp.async.bulk.tensor reads a
box of a 2-D tensor, described by a TENSOR MAP (its base, sizes, row stride, box size and
swizzle, 128 bytes the driver encodes: cuTensorMapEncodeTiled), and writes it into shared
memory in the 128-byte swizzle wgmma reads (chunk c of row r at c ^ r % 8, as the cp.async
versions placed it by hand). When its bytes have landed it counts them off the mbarrier it
names (complete_tx): the producer first tells the stage's `full` barrier how many bytes to
expect (mbarrier.arrive.expect_tx, 48 KB), and the phase completes when they all have. So
one thread of the producer warpgroup does all the copying: a's slice [128 m, 64 k] in one box,
b's [64 k, 256 n] in four boxes of 64 columns (a box's rows are at most 128 bytes under the
swizzle). The consumers are v17's, less its proxy fence a slice: the copy engine writes
through the async proxy, the one wgmma reads through.

The tensor maps are made on the host (ctypes into the CUDA driver) and copied to a small
device array the kernel reads them from (Numba passes no 128-byte structure by value, as a
__grid_constant__ parameter would be); the producer thread runs fence.proxy.tensormap's acquire
on each before its first copy, since the host wrote them through the generic proxy. Under the
simulator the tensor maps are not made: its twin of the copy reads the box from the operand
itself, swizzles it into place and counts its bytes off the barrier.
"""
import functools

import numpy as np
from numba import cuda, float32, int32, uint64

from nanoandrea.kernels.launch import MULTIPROCESSORS, SIMULATOR, inlined, launch
from nanoandrea.kernels.wgmma import ATOM_BYTES, dynamic_shared_words
from v12_wgmma import B_HALF_WORDS, ROW_WORDS
from v17_wgmma_producer import (A_WORDS, BK, BM, BN, STAGE_WORDS, STAGES, SUMS, THREADS, consume,
                                start_block, wait_phase)

PRECISION = "bf16"
MULTIPLE_OF = (128, 256, 64)
STAGE_BYTES = 4 * STAGE_WORDS                   # what a slice's five copies bring: 48 KB
EXTRA_ARGUMENTS = (uint64[:, ::1],)             # the kernel's after (out, a, b): the maps
RESIDENT = 1 if SIMULATOR else MULTIPROCESSORS
BOUNDS = {} if SIMULATOR else dict(launch_bounds=(THREADS, 1))

if SIMULATOR:
    from v17_wgmma_producer import _barriers, _lock

    _bytes_due = {}                 # (block, barrier word): transaction bytes still to land

    def _complete(key):
        barrier = _barriers[key]                # [count, pending, phase]
        if barrier[1] == 0 and _bytes_due.get(key, 0) == 0:
            barrier[1], barrier[2] = barrier[0], barrier[2] + 1

    @cuda.jit(device=True)
    def arrive_expect_tx(words, word, count):
        key = (tuple(cuda.blockIdx), int(word))
        with _lock:
            _bytes_due[key] = _bytes_due.get(key, 0) + int(count)
            _barriers[key][1] -= 1
            _complete(key)

    def tensormap_acquire(maps, which):
        pass

    @functools.cache
    def tma_load(rows):
        """The twin of a box of `rows` rows of 64 bf16 (128 bytes) of `source` (uint32 pairs,
        the tensor map's operand) from element (y, x) into tiles[word:], swizzled, its bytes
        counted off barrier `bar`."""
        @cuda.jit(device=True)
        def load(tiles, word, maps, which, source, x, y, bar):
            for r in range(rows):
                for chunk in range(8):
                    for w in range(4):
                        tiles[word + r * ROW_WORDS + 4 * (chunk ^ (r % 8)) + w] = \
                            source[y + r, x // 2 + 4 * chunk + w]
            key = (tuple(cuda.blockIdx), int(bar))
            with _lock:
                _bytes_due[key] -= 128 * rows
                _complete(key)
        return load

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    from nanoandrea.kernels.vector import item_pointer, shared_address
    from v17_wgmma_producer import _barrier

    I32, I64 = ir.IntType(32), ir.IntType(64)
    arrive_expect_tx = _barrier("{ .reg .b64 state; "
                                "mbarrier.arrive.expect_tx.shared::cta.b64 state, [$0], $1; }",
                                values=1)

    def _map_address(context, builder, maps_type, maps, which_type, which):
        # the generic address of tensor map `which` (row `which` of the [2, 16] uint64 array)
        index_type = types.UniTuple(types.intp, 2)
        index = context.make_tuple(builder, index_type, [
            context.cast(builder, which, which_type, types.intp),
            context.get_constant(types.intp, 0)])
        return builder.ptrtoint(item_pointer(context, builder, maps_type, maps, index_type,
                                             index), I64)

    def _shared(context, builder, words_type, words, word_type, word):
        index = context.make_tuple(builder, types.UniTuple(word_type, 1), [word])
        return shared_address(builder, item_pointer(context, builder, words_type, words,
                                                    types.UniTuple(word_type, 1), index))

    @intrinsic
    def tensormap_acquire(typingctx, maps, which):
        def codegen(context, builder, signature, args):
            address = _map_address(context, builder, signature.args[0], args[0],
                                   signature.args[1], args[1])
            function = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [I64]),
                                    "fence.proxy.tensormap::generic.acquire.gpu [$0], 128;",
                                    "l,~{memory}", side_effect=True)
            builder.call(function, [address])

        return types.void(maps, which), codegen

    @functools.cache
    def tma_load(rows):
        """The copy of a box of the tensor map's operand from element (y, x) (x along its rows)
        into tiles[word:], counted off the mbarrier at tiles[bar]. (rows: the box's, in the
        map; `source` is the operand the simulator's twin reads)"""
        @intrinsic
        def load(typingctx, tiles, word, maps, which, source, x, y, bar):
            def codegen(context, builder, signature, args):
                kinds = signature.args
                destination = _shared(context, builder, kinds[0], args[0], kinds[1], args[1])
                barrier = _shared(context, builder, kinds[0], args[0], kinds[7], args[7])
                address = _map_address(context, builder, kinds[2], args[2], kinds[3], args[3])
                x_, y_ = (context.cast(builder, v, t, types.int32)
                          for v, t in zip(args[5:7], kinds[5:7]))
                function = ir.InlineAsm(
                    ir.FunctionType(ir.VoidType(), [I32, I64, I32, I32, I32]),
                    "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx"
                    "::bytes [$0], [$1, {$2, $3}], [$4];", "r,l,r,r,r,~{memory}",
                    side_effect=True)
                builder.call(function, [destination, address, x_, y_, barrier])

            return types.void(tiles, word, maps, which, source, x, y, bar), codegen
        return load

load_a, load_b = tma_load(BM), tma_load(BK)     # a's box: 128 rows of m; b's: 64 rows of k


@cuda.jit(**BOUNDS)
def wgmma_tma_kernel(out, a, b, maps):
    # out[M,N] = a . b; maps: [2, 16] uint64, a's tensor map then b's; as v17 otherwise, but
    # full[s] waits for one arrival (the producer's, with the stage's bytes to expect)
    tiles = dynamic_shared_words()
    first, barriers, tiles_m, items, slices, group, thread = start_block(tiles, out, a, 1, 0)
    if group == 0 and thread == 0:
        produce(tiles, a, b, maps, first, barriers, tiles_m, items, slices)
    elif group > 0:
        consume(out, tiles, cuda.local.array(SUMS, float32), first, barriers, group, thread,
                tiles_m, items, slices, False)


@inlined
def produce(tiles, a, b, maps, first, barriers, tiles_m, items, slices):
    """The producer's one thread: each slice of each of the block's tiles copied into its
    stage by TMA, once the stage's last slice is released (see the module's doc)."""
    n = int32(0)                                # the block's slice count, over its tiles
    tensormap_acquire(maps, 0)
    tensormap_acquire(maps, 1)
    for item in range(cuda.blockIdx.x, items, cuda.gridDim.x):
        m0, n0 = (item % tiles_m) * BM, (item // tiles_m) * BN
        for s in range(slices):
            stage = n % STAGES
            full = barriers + 2 * stage
            wait_phase(tiles, barriers + 2 * (STAGES + stage), ((n // STAGES) & 1) ^ 1)
            arrive_expect_tx(tiles, full, STAGE_BYTES)
            at = first + stage * STAGE_WORDS
            load_a(tiles, at, maps, 0, a, s * BK, m0, full)
            for j in range(BN // 64):
                load_b(tiles, at + A_WORDS + j * B_HALF_WORDS, maps, 1, b, n0 + 64 * j,
                       s * BK, full)
            n += 1


BFLOAT16, FLOAT32 = 9, 7                        # (cuda.h's CUtensorMapDataType)


def tensor_map(words, box_rows):
    """The 128-byte tensor map of a bf16 operand held as uint32 pairs `words` [rows, cols/2]:
    boxes of 64 columns (128 bytes) x box_rows rows."""
    return encode_tensor_map(words, BFLOAT16, 2 * words.shape[1], 64, box_rows)


def encode_tensor_map(array, kind, columns, box_columns, box_rows):
    """The tensor map of the 2-D device array `array` seen as [rows, columns] elements of
    `kind`: boxes of box_columns x box_rows (a box's row 128 bytes), the 128-byte swizzle,
    zeros past its edges (cuTensorMapEncodeTiled, through ctypes)."""
    import ctypes
    rows, row_bytes = array.shape[0], array.strides[0]
    driver = ctypes.CDLL("libcuda.so.1")
    encode = driver.cuTensorMapEncodeTiled
    encode.restype = ctypes.c_int
    found = (ctypes.c_uint64 * 16)()
    SWIZZLE_128B, L2_PROMOTION_256B = 3, 3      # (cuda.h's enums)
    status = encode(found, kind, 2, ctypes.c_void_p(array.device_ctypes_pointer.value),
                    (ctypes.c_uint64 * 2)(columns, rows), (ctypes.c_uint64 * 1)(row_bytes),
                    (ctypes.c_uint32 * 2)(box_columns, box_rows), (ctypes.c_uint32 * 2)(1, 1),
                    0, SWIZZLE_128B, L2_PROMOTION_256B, 0)
    if status != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled: CUresult {status}")
    return np.frombuffer(found, dtype=np.uint64).copy()


_maps = {}      # (a's and b's addresses and shapes): their tensor maps on the device


def maps_of(a, b):
    """a's and b's tensor maps, a [2, 16] uint64 device array, made once for the operands'
    memory (a copy from the host at each call would wait for the GPU's queue)."""
    maps = np.zeros((2, 16), np.uint64)
    if SIMULATOR:                   # (its twin reads the operands: no maps)
        return cuda.to_device(maps)
    key = tuple((x.device_ctypes_pointer.value, x.shape) for x in (a, b))
    if key not in _maps:
        maps[0], maps[1] = tensor_map(a, BM), tensor_map(b, BK)
        _maps[key] = cuda.to_device(maps)
    return _maps[key]


def matmul(out, a, b):
    M, N = out.shape
    launch(wgmma_tma_kernel, min(RESIDENT, (M // BM) * (N // BN)), THREADS, out, a, b,
           maps_of(a, b), shared_bytes=4 * STAGES * STAGE_WORDS + ATOM_BYTES + 16 * STAGES)
