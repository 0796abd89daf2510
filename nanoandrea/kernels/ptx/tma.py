"""Hopper's copy engine (the tensor memory accelerator, TMA) and the barriers a block's
warpgroups meet at while it works: what matmul/wgmma.py is built from, each instruction with
a simulator twin.

    maps, (i, j) = tensor_maps((x, pairs, rows), (y, ...))    the TENSOR MAPs (below) of
                                                 x and y, made once for their memory: rows i
                                                 and j of the table `maps` (uint64 [slots, 16])
    tensormap_acquire(maps, index)               the map, written by the host, seen by TMA
    box_load(rows, pairs)(words, word, maps, index, x, col, row, z, bar)
                                                 copy the box of x at (z, row, col) into shared
                                                 words[word:], counted off mbarrier words[bar]
    box_store(pairs)(words, word, maps, index, x, col, row, z)     and back: shared -> x
    box_add(words, word, maps, index, x, col, row, z)              x's box += shared's
    bulk_commit(); bulk_reads_done[n]()             the stores issued since the last commit form
                                                 a group; wait until at most n groups are
                                                 still reading shared memory (0: none)
    bulk_wait_all()                              until every group's writes are done
    mbarrier_init(words, bar, count); mbarrier_arrive(words, bar)
    arrive_expect_tx(words, bar, bytes)          an arrival, and `bytes` more for the phase
    wait_phase(words, bar, parity)               until the phase of that parity has completed
    barrier_sync(b, count)                       named barrier b (1 .. 15): until `count`
                                                 threads of the block have reached it
    registers_down(); registers_up()             setmaxnreg: this warpgroup's registers to
                                                 PRODUCER_REGISTERS / CONSUMER_REGISTERS
  in a cluster (blocks launched together on neighbouring multiprocessors, runtime/launch.py):
    box_load_multicast(rows, pairs)(..., bar, mask)   box_load into the same words of every
                                                 block in `mask`, counted off each one's bar
    mbarrier_arrive_at(words, bar, cta)          an arrival on block cta's mbarrier at bar
    fence_mbarrier_init(); cluster_sync()        the barriers made, seen by the cluster;
                                                 until every thread of the cluster is here

A TENSOR MAP is 128 bytes the CUDA driver encodes (cuTensorMapEncodeTiled) that describe a
tensor in global memory (here always 3-D: columns, rows, planes; its base, sizes and strides)
and a BOX of it (columns x rows x 1): one instruction, cp.async.bulk.tensor, issued by one
thread, copies a whole box between global and shared memory while the threads go on. In
shared memory a box's rows are 128 bytes (64 bf16 or 32 float32) in the 128-byte swizzle
(16-byte chunk c of row r at c ^ r % 8, the layout wgmma reads: ptx/wgmma.py). Past the
tensor's edges a load brings zeros and a store writes nothing, so a kernel's edge tiles need
no code of their own. A word is 32 bits (a bf16 pair, or one float32: `pairs` says which):
`words` is the block's shared memory as uint32, and coordinates here are in words along a row,
as the kernels index their word arrays.

A load counts its bytes off an MBARRIER in shared memory: a barrier that completes a phase
when `count` arrivals have come AND every byte announced by arrive_expect_tx has landed; a
waiter names the phase by its parity (a fresh barrier counts its "previous" phase, parity 1,
as complete). A store is asynchronous too: its bulk group says when it has read shared memory
(the buffer may be written again) and when its writes are done. The copy engine reads and
writes shared memory through the ASYNC proxy, the threads through the generic one: a thread's
writes a store is to read need fence_proxy_async (ptx/wgmma.py) first.

Where the maps live: Numba passes no 128-byte structure by value (as CUDA C's
__grid_constant__ parameter), so each map is a row of one device table that kernels read
through its index; a map is written into its row once, by a copy synchronous with the host,
before any kernel that reads it is launched, on whichever stream. A captured step's arena
gives its arrays new addresses, so their maps are made while it is captured: those rows are
written once the capture has ended, before the graph first runs (made_while_capturing). The
table is allocated outside any captured step's arena and kept for the life of the process.

On the GPU these are inline PTX (sm_90). Under the simulator, whose threads are Python
threads, each mbarrier and named barrier is a counter in a dict that its waiters sleep on
(a wait that lasts STUCK_S fails: a phase that never completes is a bug, not a hang), a
box copy happens at once (reading or writing the array itself, swizzling as the engine does),
and the waits for bulk groups, the fence and setmaxnreg do nothing. The simulator runs a
block's threads in turn, so a block cannot wait on another: its clusters are of one block,
a multicast landing in the block itself and mbarrier_arrive_at arriving on its own barrier.
"""
import functools
import threading
from contextlib import contextmanager

import numpy as np
from numba import cuda

from ..runtime.device import SIMULATOR
from ..runtime.launch import inlined, is_recording
from ..runtime.memory import scratch

ROW_WORDS = 32                  # a box's row in shared memory: 128 bytes
BOX_BYTES_ROW = 4 * ROW_WORDS
# a thread's registers after setmaxnreg, in a block of a producer and two consumer warpgroups
# (matmul_wgmma checks that they fit the registers its block is launched with)
PRODUCER_REGISTERS, CONSUMER_REGISTERS = 40, 232

if SIMULATOR:
    # Each barrier has a condition (all on one lock): a thread that finds its phase open
    # sleeps on it until that barrier changes, as try_wait suspends a thread on the GPU,
    # instead of spinning for the interpreter against the block's hundreds of threads.
    _lock = threading.Lock()
    _mbarriers = {}     # (block, word): [count, pending arrivals, phase, bytes due, Condition]
    _named = {}         # (block, b): [arrived, generation, Condition]
    STUCK_S = 600       # a wait this long is a barrier that never completes: fail, not hang

    def _complete(barrier):
        if barrier[1] == 0 and barrier[3] == 0:
            barrier[1], barrier[2] = barrier[0], barrier[2] + 1
            barrier[4].notify_all()

    @cuda.jit(device=True)
    def mbarrier_init(words, word, count):
        with _lock:
            _mbarriers[(tuple(cuda.blockIdx), int(word))] = [
                int(count), int(count), 0, 0, threading.Condition(_lock)]

    @cuda.jit(device=True)
    def mbarrier_arrive(words, word):
        with _lock:
            barrier = _mbarriers[(tuple(cuda.blockIdx), int(word))]
            barrier[1] -= 1
            _complete(barrier)

    @cuda.jit(device=True)
    def arrive_expect_tx(words, word, count):
        with _lock:
            barrier = _mbarriers[(tuple(cuda.blockIdx), int(word))]
            barrier[3] += int(count)
            barrier[1] -= 1
            _complete(barrier)

    def _bytes_landed(key, count):
        with _lock:
            barrier = _mbarriers[key]
            barrier[3] -= count
            _complete(barrier)

    @cuda.jit(device=True)
    def mbarrier_try_wait(words, word, parity):
        with _lock:
            barrier = _mbarriers[(tuple(cuda.blockIdx), int(word))]
            if not barrier[4].wait_for(lambda: barrier[2] % 2 != parity, STUCK_S):
                raise RuntimeError(f"mbarrier at word {word}: phase {parity} still open "
                                   f"after {STUCK_S} s")
        return True

    @cuda.jit(device=True)
    def barrier_sync(b, count):
        key = (tuple(cuda.blockIdx), int(b))
        with _lock:
            state = _named.setdefault(key, [0, 0, threading.Condition(_lock)])
            generation = state[1]
            state[0] += 1
            if state[0] == count:
                state[0], state[1] = 0, generation + 1
                state[2].notify_all()
            elif not state[2].wait_for(lambda: state[1] != generation, STUCK_S):
                raise RuntimeError(f"barrier {b}: {state[0]} of {count} threads in {STUCK_S} s")

    def tensormap_acquire(maps, index):
        pass

    def bulk_commit():
        pass

    def bulk_wait_all():
        pass

    bulk_reads_done = {0: bulk_wait_all, 1: bulk_wait_all}

    def registers_down():
        pass

    def registers_up():
        pass

    @functools.cache
    def box_load(rows, pairs):
        """The twin of a load of `rows` rows of 32 words of x [planes, R, C] from (z, row,
        col) into words[word:], swizzled, zeros past x's edges, its bytes counted off the
        mbarrier at words[bar]."""
        @cuda.jit(device=True)
        def load(words, word, maps, index, x, col, row, z, bar):
            planes = _planes(x)
            for r in range(rows):
                for chunk in range(8):
                    for w in range(4):
                        c = col + 4 * chunk + w
                        inside = row + r < planes.shape[1] and c < planes.shape[2]
                        words[word + r * ROW_WORDS + 4 * (chunk ^ (r % 8)) + w] = (
                            planes[z, row + r, c] if inside else 0)
            _bytes_landed((tuple(cuda.blockIdx), int(bar)), BOX_BYTES_ROW * rows)
        return load

    def _planes(x):
        # x as the map sees it: [planes, rows, columns]
        return x if len(x.shape) == 3 else x.reshape((1,) + tuple(x.shape))

    def _box_write(add):
        @cuda.jit(device=True)
        def write(words, word, maps, index, x, col, row, z):
            planes = _planes(x)
            for r in range(min(64, planes.shape[1] - row)):
                for chunk in range(8):
                    for w in range(4):
                        c = col + 4 * chunk + w
                        if c < planes.shape[2]:
                            value = words[word + r * ROW_WORDS + 4 * (chunk ^ (r % 8)) + w]
                            planes[z, row + r, c] = (planes[z, row + r, c] + value if add
                                                     else value)
        return write

    @functools.cache
    def box_store(pairs):
        """The twin of a store of a box of 64 rows of 32 words from words[word:] (swizzled)
        to x [planes, R, C] at (z, row, col), nothing past x's edges."""
        return _box_write(add=False)

    box_add = _box_write(add=True)

    # Clusters: the simulator runs one block at a time, so its clusters are of one block; a
    # multicast lands in the block itself and a barrier of "block `cta`" is the block's own.
    @functools.cache
    def box_load_multicast(rows, pairs):
        """The twin of box_load(rows, pairs) into every block of `mask` (the block's own)."""
        load = box_load(rows, pairs)

        @cuda.jit(device=True)
        def load_multicast(words, word, maps, index, x, col, row, z, bar, mask):
            load(words, word, maps, index, x, col, row, z, bar)
        return load_multicast

    @cuda.jit(device=True)
    def mbarrier_arrive_at(words, word, cta):
        mbarrier_arrive(words, word)

    @cuda.jit(device=True)
    def cluster_sync():
        cuda.syncthreads()

    def fence_mbarrier_init():
        pass

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    from .vector import item_pointer, shared_address

    I32, I64 = ir.IntType(32), ir.IntType(64)

    def _asm(builder, text, constraints, operands, result=None):
        kinds = [operand.type for operand in operands]
        function = ir.InlineAsm(ir.FunctionType(result or ir.VoidType(), kinds), text,
                                constraints, side_effect=True)
        return builder.call(function, operands)

    def _shared(context, builder, words_type, words, word_type, word):
        # the 32-bit shared address of words[word]
        index_type = types.UniTuple(word_type, 1)
        index = context.make_tuple(builder, index_type, [word])
        return shared_address(builder, item_pointer(context, builder, words_type, words,
                                                    index_type, index))

    def _map(context, builder, maps_type, maps, index_type, index):
        # the generic address of tensor map `index` (row `index` of the [slots, 16] table)
        at_type = types.UniTuple(types.intp, 2)
        at = context.make_tuple(builder, at_type, [
            context.cast(builder, index, index_type, types.intp),
            context.get_constant(types.intp, 0)])
        return builder.ptrtoint(item_pointer(context, builder, maps_type, maps, at_type, at),
                                I64)

    def _ints(context, builder, values, kinds):
        return [context.cast(builder, v, t, types.int32) for v, t in zip(values, kinds)]

    def _statement(text):
        """An intrinsic f() running the PTX statement `text`."""
        @intrinsic
        def statement(typingctx):
            def codegen(context, builder, signature, args):
                _asm(builder, text, "~{memory}", [])
            return types.void(), codegen
        return statement

    bulk_commit = _statement("cp.async.bulk.commit_group;")
    bulk_wait_all = _statement("cp.async.bulk.wait_group 0;")
    registers_down = _statement(f"setmaxnreg.dec.sync.aligned.u32 {PRODUCER_REGISTERS};")
    registers_up = _statement(f"setmaxnreg.inc.sync.aligned.u32 {CONSUMER_REGISTERS};")
    # bulk_reads_done[n](): until at most n of this thread's groups still read shared memory
    bulk_reads_done = {n: _statement(f"cp.async.bulk.wait_group.read {n};") for n in (0, 1)}

    def barrier_instruction(text, values=0, result=False):
        """An intrinsic f(words, word, *values) running `text` with $0 (or $1 after a result)
        the shared address of words[word] and the int32 values after it (an mbarrier's
        instructions; the ladder's v17 makes cp.async's arrival with it)."""
        def typer(words, word, *rest):
            if not (isinstance(words, types.Array) and isinstance(word, types.Integer)):
                return None

            def codegen(context, builder, signature, args):
                operands = ([_shared(context, builder, signature.args[0], args[0],
                                     signature.args[1], args[1])]
                            + _ints(context, builder, args[2:], signature.args[2:]))
                constraints = ",".join((["=r"] if result else []) + ["r"] * len(operands)
                                       + ["~{memory}"])
                return _asm(builder, text, constraints, operands, I32 if result else None)

            return (types.uint32 if result else types.void)(words, word, *rest), codegen

        if values == 0:
            return intrinsic(lambda typingctx, words, word: typer(words, word))
        return intrinsic(lambda typingctx, words, word, value: typer(words, word, value))

    mbarrier_init = barrier_instruction("mbarrier.init.shared::cta.b64 [$0], $1;", values=1)
    mbarrier_arrive = barrier_instruction("{ .reg .b64 state; "
                               "mbarrier.arrive.shared::cta.b64 state, [$0]; }")
    arrive_expect_tx = barrier_instruction("{ .reg .b64 state; "
                                "mbarrier.arrive.expect_tx.shared::cta.b64 state, [$0], $1; }",
                                values=1)
    mbarrier_try_wait = barrier_instruction("{ .reg .pred done; "
                                 "mbarrier.try_wait.parity.shared::cta.b64 done, [$1], $2; "
                                 "selp.u32 $0, 1, 0, done; }", values=1, result=True)
    # an arrival on the mbarrier at the same word of block `cta` of the cluster (its shared
    # address there: mapa). Its default semantics (release, the block's scope), as CUTLASS's
    # ClusterBarrier arrives: what it orders is the wgmma's reads of a stage before the copy
    # engine's next writes into it, which the barrier's phase itself orders; the cluster's
    # scope would put a fence of the whole GPU (MEMBAR.ALL.GPU) before every arrival
    mbarrier_arrive_at = barrier_instruction(
        "{ .reg .b32 remote; mapa.shared::cluster.u32 remote, $0, $1; "
        "mbarrier.arrive.shared::cluster.b64 _, [remote]; }", values=1)
    # every thread of every block of the cluster meets here (not .aligned: a warp's threads
    # may come apart, as the producer's one busy thread does)
    cluster_sync = _statement("barrier.cluster.arrive; barrier.cluster.wait;")
    # mbarrier_init's writes, seen by the cluster's other blocks (before cluster_sync)
    fence_mbarrier_init = _statement("fence.mbarrier_init.release.cluster;")

    @intrinsic
    def barrier_sync(typingctx, b, count):
        if not all(isinstance(x, types.Integer) for x in (b, count)):
            return None

        def codegen(context, builder, signature, args):
            _asm(builder, "bar.sync $0, $1;", "r,r,~{memory}",
                 _ints(context, builder, args, signature.args))
        return types.void(b, count), codegen

    @intrinsic
    def tensormap_acquire(typingctx, maps, index):
        def codegen(context, builder, signature, args):
            address = _map(context, builder, signature.args[0], args[0], signature.args[1],
                           args[1])
            _asm(builder, "fence.proxy.tensormap::generic.acquire.gpu [$0], 128;",
                 "l,~{memory}", [address])
        return types.void(maps, index), codegen

    def _coordinates(context, builder, signature, args, pairs):
        # (col, row, z) as the instruction takes them: col in elements (2 a word for pairs)
        col, row, z = _ints(context, builder, args[5:8], signature.args[5:8])
        if pairs:
            col = builder.shl(col, ir.Constant(I32, 1))
        return col, row, z

    @functools.cache
    def box_load(rows, pairs):
        """The copy engine's load of a box of x (its rows: the map's) at word (z, row, col)
        into words[word:], counted off the mbarrier at words[bar]. (`x` is the array the
        twin reads; rows: the box's, which the map holds)"""
        @intrinsic
        def load(typingctx, words, word, maps, index, x, col, row, z, bar):
            def codegen(context, builder, signature, args):
                kinds = signature.args
                destination = _shared(context, builder, kinds[0], args[0], kinds[1], args[1])
                barrier = _shared(context, builder, kinds[0], args[0], kinds[8], args[8])
                address = _map(context, builder, kinds[2], args[2], kinds[3], args[3])
                _asm(builder, "cp.async.bulk.tensor.3d.shared::cluster.global.tile"
                     ".mbarrier::complete_tx::bytes [$0], [$1, {$2, $3, $4}], [$5];",
                     "r,l,r,r,r,r,~{memory}",
                     [destination, address,
                      *_coordinates(context, builder, signature, args, pairs), barrier])

            return types.void(words, word, maps, index, x, col, row, z, bar), codegen
        return load

    @functools.cache
    def box_load_multicast(rows, pairs):
        """box_load(rows, pairs), the box landing at the same word in every block of the
        cluster whose bit is set in `mask` (16 bits, bit r: block r), and counted off the
        mbarrier at the same word in each: one read of L2 for them all."""
        @intrinsic
        def load(typingctx, words, word, maps, index, x, col, row, z, bar, mask):
            def codegen(context, builder, signature, args):
                kinds = signature.args
                destination = _shared(context, builder, kinds[0], args[0], kinds[1], args[1])
                barrier = _shared(context, builder, kinds[0], args[0], kinds[8], args[8])
                address = _map(context, builder, kinds[2], args[2], kinds[3], args[3])
                bits = builder.trunc(_ints(context, builder, args[9:], kinds[9:])[0],
                                     ir.IntType(16))
                _asm(builder, "cp.async.bulk.tensor.3d.shared::cluster.global.tile"
                     ".mbarrier::complete_tx::bytes.multicast::cluster"
                     " [$0], [$1, {$2, $3, $4}], [$5], $6;",
                     "r,l,r,r,r,r,h,~{memory}",
                     [destination, address,
                      *_coordinates(context, builder, signature, args, pairs), barrier, bits])

            return types.void(words, word, maps, index, x, col, row, z, bar, mask), codegen
        return load

    def _box_write(text, pairs):
        @intrinsic
        def write(typingctx, words, word, maps, index, x, col, row, z):
            def codegen(context, builder, signature, args):
                kinds = signature.args
                source = _shared(context, builder, kinds[0], args[0], kinds[1], args[1])
                address = _map(context, builder, kinds[2], args[2], kinds[3], args[3])
                _asm(builder, text, "l,r,r,r,r,~{memory}",
                     [address, *_coordinates(context, builder, signature, args, pairs),
                      source])

            return types.void(words, word, maps, index, x, col, row, z), codegen
        return write

    @functools.cache
    def box_store(pairs):
        """The copy engine's store of the box at words[word:] to x at word (z, row, col)."""
        return _box_write("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group"
                          " [$0, {$1, $2, $3}], [$4];", pairs)

    box_add = _box_write("cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile"
                         ".bulk_group [$0, {$1, $2, $3}], [$4];", pairs=False)


@inlined
def wait_phase(words, word, parity):
    while not mbarrier_try_wait(words, word, parity):
        pass



# --- the tensor maps -------------------------------------------------------------------------

BFLOAT16, FLOAT32 = 9, 7        # (cuda.h's CUtensorMapDataType)
SWIZZLE_128B, L2_PROMOTION_256B = 3, 3


def encode_tensor_map(x, pairs, box_rows):
    """The 128 bytes of the tensor map of the 32-bit device array x [planes, R, C] (planes
    optional; its rows contiguous, their strides multiples of 16 bytes), seen as bf16 pairs (`pairs`: 2C columns) or float32: boxes of 128
    bytes x box_rows rows x 1 plane, the 128-byte swizzle, zeros past the edges."""
    import ctypes
    shape = (1,) * (3 - len(x.shape)) + tuple(x.shape)
    planes, rows, cols = shape
    row_bytes = x.strides[-2]
    plane_bytes = x.strides[-3] if len(x.shape) == 3 else row_bytes * rows
    encode = ctypes.CDLL("libcuda.so.1").cuTensorMapEncodeTiled
    encode.restype = ctypes.c_int
    found = (ctypes.c_uint64 * 16)()
    per_word = 2 if pairs else 1
    status = encode(found, BFLOAT16 if pairs else FLOAT32, 3,
                    ctypes.c_void_p(x.device_ctypes_pointer.value),
                    (ctypes.c_uint64 * 3)(per_word * cols, rows, planes),
                    (ctypes.c_uint64 * 2)(row_bytes, plane_bytes),
                    (ctypes.c_uint32 * 3)(per_word * ROW_WORDS, box_rows, 1),
                    (ctypes.c_uint32 * 3)(1, 1, 1), 0, SWIZZLE_128B, L2_PROMOTION_256B, 0)
    if status != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled: CUresult {status} for an array of "
                           f"{x.shape} (box rows {box_rows})")
    return np.frombuffer(found, dtype=np.uint64)


class TensorMaps:
    """The device's table of tensor maps: each made once for an array's memory, shape and
    box (what it encodes), and never changed after (see the module's doc). A table holds
    SLOTS; when the current one is full, another is started (those before stay: a captured
    graph may read them), and a kernel's maps all come from the current one."""
    SLOTS = 4096

    def __init__(self):
        self.tables, self.slots = [], {}    # (device, pinned host) tables; the current's rows
        self.unwritten = []                 # rows made while a graph was captured

    def _grow(self):
        device = scratch(("tensor maps", len(self.tables)), (self.SLOTS, 16), np.uint64)
        self.tables.append((device, cuda.pinned_array((self.SLOTS, 16), np.uint64)))
        self.slots = {}

    def maps(self, *wanted):
        """(the current table, the row of each (x, pairs, box_rows) wanted), each made where
        the table does not hold it yet."""
        if not self.tables or (len(self.slots) + len(wanted) > self.SLOTS):
            self._grow()
        if SIMULATOR or is_recording():     # (the twins read the arrays; nothing runs)
            return self.tables[-1][0], (0,) * len(wanted)
        device, host = self.tables[-1]
        rows = []
        for x, pairs, box_rows in wanted:
            key = (x.device_ctypes_pointer.value, tuple(x.shape), pairs, box_rows)
            if key not in self.slots:
                slot = self.slots[key] = len(self.slots)
                host[slot] = encode_tensor_map(x, pairs, box_rows)
                if _capturing:
                    self.unwritten.append((device, host, slot))
                else:
                    _write(device, host, slot)
            rows.append(self.slots[key])
        return device, tuple(rows)

    def write_unwritten(self):
        for device, host, slot in self.unwritten:
            _write(device, host, slot)
        self.unwritten = []


def _write(device, host, slot):
    # a copy synchronous with the host: done before any kernel launched after it, on any
    # stream, reads the row (an asynchronous one on the current stream would leave a kernel
    # on another stream free to read the row before it lands)
    device[slot:slot + 1].copy_to_device(host[slot:slot + 1])


_tensor_maps = {}
_capturing = False


def tensor_maps(*wanted):
    """TensorMaps.maps(*wanted) of the current device's table."""
    device = 0 if SIMULATOR else cuda.get_current_device().id
    return _tensor_maps.setdefault(device, TensorMaps()).maps(*wanted)


@contextmanager
def made_while_capturing():
    """Around a CUDA graph's capture (nanoandrea/step.py): the maps its kernels need are made
    inside, but written into their rows once it has ended, before the graph first runs (a copy
    inside would be recorded into the graph, not made; and no stream orders it before a kernel
    of another stream that reads the same row)."""
    global _capturing
    _capturing = True
    try:
        yield
    finally:
        _capturing = False
        for maps in _tensor_maps.values():
            maps.write_unwritten()
