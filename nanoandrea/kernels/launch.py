"""The one place that launches kernels.

Every launcher in nanoandrea.kernels ends in `launch(kernel, grid, block, *args)`. Keeping that
call in one function gives us one place to:
  - pick the CUDA stream (`using_stream`: the training step puts its launches on a CuPy stream
    of its own, which it captures as a CUDA graph; see nanoandrea/step.py),
  - size grids (`blocks(n, per_block)`), and check shapes and dtypes (`check_*`) with one-line errors.

It also wires CuPy's memory pool under Numba (Numba's external-memory-manager plugin), which
turns a device allocation from ~160 us into ~11 us (measured on the H200, ../shared/GPU-FACTS.md)
and lets freed activations be reused; and, for a captured step, `count_allocations` (how much
a step allocates) and `allocate_from(arena)` (one block, carved up, owned by the graph).

Under the CUDA simulator (NUMBA_ENABLE_CUDASIM=1) kernels run as Python threads on the CPU;
`SIMULATOR` lets launchers choose small blocks there.
"""
import os
import warnings
from contextlib import contextmanager

import numpy as np
from numba import config, cuda
from numba.core.errors import NumbaPerformanceWarning

SIMULATOR = bool(config.ENABLE_CUDASIM)

# Numba warns of every grid smaller than the GPU; ours are small on purpose (sampling one
# sequence, the last reduction stage) and the warning buried the training log in noise.
warnings.filterwarnings("ignore", category=NumbaPerformanceWarning)

_stream = 0          # the stream every launch goes to; 0 is the default stream


STATIC_SHARED_BYTES = 48 * 1024    # a block's shared memory without the kernel opting in


# Who inlines the device functions (`inlined`): "numba" (the default) or "nvvm"
# (NANOANDREA_INLINER=nvvm). The kernels are the same Python either way; only the compile
# differs, in time and in the machine code the GPU's driver makes of it (docs/perf.md, v20).
INLINER = os.environ.get("NANOANDREA_INLINER", "numba")
if INLINER not in ("nvvm", "numba"):
    raise ValueError(f"NANOANDREA_INLINER={INLINER!r}: nvvm or numba")


def inlined(function):
    """A device function inlined into every kernel that calls it.
      - "numba" (the default): Numba's inline="always" copies the callee's Numba IR into each
        call site, with Python's deepcopy. Slow to compile: tools/kernel_report.py's 76 kernels
        took 1,072 s on a 2-core machine; on the H200 machine, a process that compiles the NN
        matmul kernel and times it ran 44-47 s.
      - "nvvm": `forceinline`, the LLVM `alwaysinline` attribute, and NVVM inlines. 223 s for
        the 76 kernels, 10-13 s for that process (docs/runs/2026-11-30-issue4-v20/dump_nn.py).
        Offline ptxas makes the same SASS of both for every matmul kernel; the H200 machine
        does not (1,520 instructions against 1,512 for NN), and there the 120m products ran
        3-5% slower and the 120m step 4% (docs/perf.md, v20). So "nvvm" is for compiling
        quickly (the GPU test suite in one call), not for speed.
    (The simulator's cuda.jit takes neither option: there a device function is a Python call.)"""
    if SIMULATOR or INLINER == "numba":
        return inlined_by_numba(function)
    return cuda.jit(device=True, forceinline=True)(function)


def inlined_by_numba(function):
    """`inlined`, by Numba's inliner whatever NANOANDREA_INLINER says: for the few functions
    that NVVM inlining makes worse (matmul's outside_step: 143 registers against 128) or
    cannot compile (sharedmem.dynamic_shared_floats returns a shared array)."""
    if SIMULATOR:
        return cuda.jit(device=True)(function)
    return cuda.jit(device=True, inline="always")(function)


def launch(kernel, grid, block, *args, shared_bytes=0):
    """Launch `kernel` on the current stream. grid and block are ints or tuples. shared_bytes:
    the size of the kernel's dynamic shared array (`cuda.shared.array(0, ...)`, cut into
    tiles by kernels/sharedmem.py); over 48 KB, the kernel is let have that much first."""
    configured = kernel[grid, block, _stream, shared_bytes]
    # (numba-cuda caches the configured launch per (grid, block, stream, bytes): the hook goes
    # on it once, not on every launch)
    if (shared_bytes > STATIC_SHARED_BYTES and not SIMULATOR
            and _allow_dynamic_shared not in configured.pre_launch_callbacks):
        configured.pre_launch_callbacks.append(_allow_dynamic_shared)
    configured(*args)


_allowed_shared = {}        # compiled kernel -> the dynamic shared bytes it may take


def _allow_dynamic_shared(compiled, configuration):
    # (numba-cuda's pre-launch hook, given the kernel compiled for these arguments.) The
    # driver's attribute, set the way numba-cuda 0.30 sets a kernel's shared-memory carveout
    # (CudaPythonFunction.set_shared_memory_carveout), once per kernel and size
    bytes_wanted = configuration.sharedmem
    if _allowed_shared.get(id(compiled), 0) >= bytes_wanted:
        return
    from cuda.bindings import driver as binding
    from numba.cuda.cudadrv.driver import driver
    function = compiled._codelibrary.get_cufunc()
    attribute = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    driver.cuKernelSetAttribute(attribute, bytes_wanted, function.handle, function.device.id)
    _allowed_shared[id(compiled)] = bytes_wanted


def current_stream():
    return _stream


def set_stream(stream):
    """Make later launches go to `stream` (a Numba stream, or 0 for the default one)."""
    global _stream
    _stream = stream


@contextmanager
def using_stream(stream):
    """Launches (and the backend's copies) inside the block go to `stream`."""
    previous = _stream
    set_stream(stream)
    try:
        yield
    finally:
        set_stream(previous)


# --- a second stream, beside the current one ---------------------------------------------
# Inside a captured step (nanoandrea/step.py) the weight gradients run on a second stream: each
# starts when its dY is ready and runs beside the input gradients and the rest of the backward
# pass, filling the multiprocessors that a product's last wave and the small kernels leave idle.
# In the forward, products of the same input (a layer's K and V beside its Q: ops.linears) may
# run there too. Only inside a capture: there every allocation comes from the arena, never
# reused, so memory the second stream still reads is never handed to the first (eagerly,
# CuPy's pool would).

_second = None          # (the second stream, its fork event, its join event, whether forward
                        # work may go there), while there is one
_forked = False         # work launched on the second stream since the last join


@contextmanager
def second_stream(stream, forward=True):
    """Inside the block, `beside()` puts launches on `stream` (a Numba stream); forward=False:
    only the backward's (`beside(forward=True)` then runs in place)."""
    global _second, _forked
    events = [cuda.event() if SIMULATOR else cuda.event(timing=False) for _ in range(2)]
    previous, _second = _second, (stream, *events, forward)     # (the simulator's events take
    try:                                                         # no arguments)
        yield
    finally:
        join()
        _second, _forked = previous, False


@contextmanager
def beside(forward=False):
    """Launches inside the block go to the second stream, if there is one, after everything
    launched so far on the current stream; they run beside what is launched after the block,
    until `join()`. Without a second stream (or for forward work, without its leave), the
    block runs where it is."""
    global _forked
    if _second is None or _stream is _second[0] or (forward and not _second[3]):
        yield
        return
    side, fork, _, _ = _second
    fork.record(_stream)
    fork.wait(side)
    with using_stream(side):
        yield
    _forked = True


def join():
    """The current stream waits for what was launched `beside()` it. False (and no wait) when
    called from inside a `beside()` block."""
    global _forked
    if _second is not None and _stream is _second[0]:
        return False
    if _forked:
        side, _, done, _ = _second
        done.record(side)
        done.wait(_stream)
        _forked = False
    return True


def blocks(n, per_block):
    """Number of blocks of `per_block` items that cover n items."""
    return max(1, (n + per_block - 1) // per_block)


MULTIPROCESSORS = 132   # the H200's SMs: grids that must fill the GPU are sized from this
ELEMENTWISE_THREADS = 32 if SIMULATOR else 256
ELEMENTWISE_MAX_BLOCKS = 4 if SIMULATOR else MULTIPROCESSORS * 16


def elementwise_grid(n):
    """(blocks, threads) for a grid-stride loop over n elements: enough blocks to fill the GPU,
    never more than needed (and few in the simulator, where every thread is a Python thread)."""
    return min(blocks(n, ELEMENTWISE_THREADS), ELEMENTWISE_MAX_BLOCKS), ELEMENTWISE_THREADS


# --- shape and dtype checks: a launcher states what it expects, in one line each ---------

def check(condition, message):
    if not condition:
        raise ValueError(message)


def check_shape(name, array, shape):
    """shape may hold None for 'any size' in that position."""
    ok = len(array.shape) == len(shape) and all(
        want is None or have == want for have, want in zip(array.shape, shape))
    check(ok, f"{name}: expected shape {tuple(shape)}, got {tuple(array.shape)}")


def check_dtype(name, array, dtype=np.float32):
    check(array.dtype == np.dtype(dtype), f"{name}: expected {np.dtype(dtype)}, got {array.dtype}")


def is_contiguous(array):
    """Whether an array (device, simulated or host) is C-contiguous."""
    flags = getattr(array, "flags", None)
    return flags["C_CONTIGUOUS"] if flags is not None else True


def check_contiguous(name, array):
    check(is_contiguous(array), f"{name}: expected a C-contiguous array")


def check_float32(**arrays):
    """Every array given is float32 and C-contiguous (None entries are skipped)."""
    for name, array in arrays.items():
        if array is not None:
            check_dtype(name, array)
            check_contiguous(name, array)


def check_float32_rows(**arrays):
    """Every array given is float32 with contiguous rows (its last axis), whatever the strides
    of the others: a view such as heads.heads_view's (None entries are skipped)."""
    for name, array in arrays.items():
        if array is not None:
            check_dtype(name, array)
            last = len(array.shape) - 1         # (the simulator's shapes take no index -1)
            check(array.shape[last] <= 1 or array.strides[last] == array.dtype.itemsize,
                  f"{name}: expected rows (the last axis) contiguous")


# --- device memory ------------------------------------------------------------------------

def _use_cupy_memory_pool():
    """Let Numba allocate from CuPy's memory pool (the EMM plugin), if CuPy is installed.

    Must run before the CUDA context is created. NANOANDREA_CUPY_POOL=0 turns it off.
    """
    if SIMULATOR or os.environ.get("NANOANDREA_CUPY_POOL", "1") == "0":
        return False
    try:
        import cupy
        from numba.cuda import (GetIpcHandleMixin, HostOnlyCUDAMemoryManager,
                                MemoryInfo, MemoryPointer)
    except Exception:       # no CuPy, or a CuPy without a usable CUDA: Numba's own allocator
        return False

    import ctypes

    class CuPyMemoryManager(GetIpcHandleMixin, HostOnlyCUDAMemoryManager):
        """Device memory from CuPy's pool; host memory as Numba does it."""
        live = {}    # device address -> CuPy's pointer object; dropping it returns the block

        def initialize(self):
            pass     # CuPy's pool needs no setup

        def memalloc(self, size):
            if _arena is not None:              # inside a graph capture: carve from the arena
                return MemoryPointer(self.context, ctypes.c_void_p(_arena.take(size)), size)
            if _tally is not None:
                _tally.add(size)
            block = cupy.cuda.alloc(size)
            address = int(block.ptr)
            self.live[address] = block
            live = self.live
            return MemoryPointer(self.context, ctypes.c_void_p(address), size,
                                 finalizer=lambda: live.pop(address, None))

        def get_memory_info(self):
            free, total = cupy.cuda.runtime.memGetInfo()
            return MemoryInfo(free=free, total=total)

        @property
        def interface_version(self):
            return 1

    cuda.set_memory_manager(CuPyMemoryManager)
    return True


CUPY_POOL = _use_cupy_memory_pool()

# --- memory for a captured step: count once, then carve from one block -------------------

ALIGNMENT = 256          # bytes; what cudaMalloc gives, so 16-byte vector loads stay legal
_tally = None            # while counting: the Tally every device allocation reports to
_arena = None            # while capturing: the Arena every device allocation comes from


class Tally:
    """Bytes allocated on the device inside a `count_allocations()` block."""
    def __init__(self):
        self.bytes = 0
        self.count = 0

    def add(self, size):
        self.bytes += -(-size // ALIGNMENT) * ALIGNMENT
        self.count += 1


class Arena:
    """One device block, handed out front to back and never given back: the memory of a captured
    CUDA graph. The graph's kernels read and write these addresses at every replay, so the
    arena lives as long as the graph (whoever holds the graph holds the arena)."""
    def __init__(self, size):
        import cupy
        self.size = size
        self.block = cupy.cuda.alloc(max(size, ALIGNMENT))
        self.base = int(self.block.ptr)
        self.used = 0

    def take(self, size):
        size = -(-size // ALIGNMENT) * ALIGNMENT
        if self.used + size > self.size:
            raise MemoryError(f"graph arena: {self.used + size} bytes needed, {self.size} reserved")
        address = self.base + self.used
        self.used += size
        return address


@contextmanager
def count_allocations():
    """Yields a Tally of the device allocations made inside the block (needs CuPy's pool)."""
    global _tally
    _tally = Tally()
    try:
        yield _tally
    finally:
        _tally = None


@contextmanager
def allocate_from(arena):
    """Inside the block every device allocation is carved from `arena` (needs CuPy's pool)."""
    global _arena
    _arena = arena
    try:
        yield arena
    finally:
        _arena = None


_scratch = {}


def scratch(name, shape):
    """A float32 device array kept for the life of the process, one per (name, shape, device):
    a launcher's temporary too large to allocate at every call (the attention backward's dq
    shares: 830 MB at andrea-120m, B=16, shared by its 12 layers). Its users launch on the
    first stream only (what runs `beside()`, the weight gradients, takes none), so calls run
    one after another and may share it; it is allocated
    outside count_allocations and allocate_from, so a captured graph's arena does not hold a
    copy of it, and the graph may keep using it."""
    global _tally, _arena
    key = (name, tuple(shape), 0 if SIMULATOR else cuda.get_current_device().id)
    if key not in _scratch:
        saved, (_tally, _arena) = (_tally, _arena), (None, None)
        try:
            _scratch[key] = cuda.device_array(shape, dtype=np.float32)
        finally:
            _tally, _arena = saved
    return _scratch[key]


def gpu_available():
    """True when a real CUDA GPU is usable (never under the simulator)."""
    if SIMULATOR:
        return False
    try:
        return cuda.is_available() and len(cuda.gpus) > 0
    except Exception:
        return False
