"""Device memory: CuPy's pool under Numba, and the arena of a captured CUDA graph.

    pool      Numba's external-memory-manager plugin draws every device allocation from
              CuPy's memory pool: an allocation costs ~11 us instead of ~160 with Numba's own
              allocator, and freed activations are reused (must be set before the CUDA
              context is created, so at import; NANOANDREA_CUPY_POOL=0 turns it off)
    arena     a captured step allocates nothing after its first run: `count_allocations`
              tallies what the eager run allocates, and inside the capture `allocate_from`
              carves every allocation from one block the graph owns (nanoandrea/step.py)
    scratch   a launcher's temporary kept for the life of the process, outside any arena
"""
import os
from contextlib import contextmanager

import numpy as np
from numba import cuda

from .device import SIMULATOR

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


def scratch(name, shape, dtype=np.float32):
    """A device array kept for the life of the process, one per (name, shape, dtype, device):
    a launcher's temporary too large to allocate at every call (the attention backward's dq
    shares: 830 MB at andrea-120m, B=16, shared by its 12 layers). Its users launch on the
    first stream only (what runs beside it, on the second stream, takes none), so calls run
    one after another and may share it; it is allocated outside count_allocations and
    allocate_from, so a captured graph's arena does not hold a copy of it, and the graph may
    keep using it."""
    global _tally, _arena
    key = (name, tuple(shape), np.dtype(dtype).str,
           0 if SIMULATOR else cuda.get_current_device().id)
    if key not in _scratch:
        saved, (_tally, _arena) = (_tally, _arena), (None, None)
        try:
            _scratch[key] = cuda.device_array(shape, dtype=dtype)
        finally:
            _tally, _arena = saved
    return _scratch[key]
