"""The one place that launches kernels.

Every launcher in nanoandrea.kernels ends in `launch(kernel, grid, block, *args)`. Keeping that
call in one function gives one place to:
  - pick the CUDA stream (`using_stream`: the training step puts its launches on a CuPy stream
    of its own, which it captures as a CUDA graph; see nanoandrea/step.py and schedule.py),
  - size grids (`blocks(n, per_block)`), and check shapes and dtypes (`check_*`) with one-line
    errors.

Device memory (CuPy's pool under Numba, a captured step's arena) is memory.py's; importing
this module sets the pool up, before any CUDA context exists.

Kernels made by a factory from a few compile-time parameters (a tile, a transpose, an
epilogue) come from `kernel_factory`, which makes each once and names it by its parameters.

Under the CUDA simulator (NUMBA_ENABLE_CUDASIM=1) kernels run as Python threads on the CPU;
`SIMULATOR` lets launchers choose small blocks there.
"""
import functools
import inspect
import os
from contextlib import contextmanager

import numpy as np
from numba import cuda

from . import cache, device, memory  # noqa: F401  (memory: CuPy's pool, before any context)
from .device import SIMULATOR

if not SIMULATOR:
    # numba-cuda warns of every grid of fewer than 128 blocks; ours are small on purpose
    # (sampling one sequence, the last stage of a reduction), and the warning buried the
    # training log in noise. Every other warning still shows.
    from numba.cuda.core import config as cuda_config
    cuda_config.CUDA_LOW_OCCUPANCY_WARNINGS = 0

_stream = 0          # the stream every launch goes to; 0 is the default stream


STATIC_SHARED_BYTES = 48 * 1024    # a block's shared memory without the kernel opting in


# Who inlines the device functions (`inlined`): "numba" (the default) or "nvvm"
# (NANOANDREA_INLINER=nvvm). The kernels are the same Python either way; only the compile
# differs, in time and in the machine code the GPU's driver makes of it (docs/perf.md).
INLINER = os.environ.get("NANOANDREA_INLINER", "numba")
if INLINER not in ("nvvm", "numba"):
    raise ValueError(f"NANOANDREA_INLINER={INLINER!r}: nvvm or numba")


def inlined(function):
    """A device function inlined into every kernel that calls it.
      - "numba" (the default): Numba's inline="always" copies the callee's Numba IR into each
        call site. Slow to compile (the compiled kernels are kept on disk: runtime/cache.py),
        and the fastest code on the H200.
      - "nvvm": `forceinline`, the LLVM `alwaysinline` attribute, and NVVM inlines: the same
        kernels compile 4-5 times faster, and the H200 driver's machine code of them runs a
        few percent slower (docs/perf.md). For compiling quickly: the GPU test suite.
    (The simulator's cuda.jit takes neither option: there a device function is a Python call.)"""
    if SIMULATOR or INLINER == "numba":
        return inlined_by_numba(function)
    return cuda.jit(device=True, forceinline=True)(function)


def inlined_by_numba(function):
    """`inlined`, by Numba's inliner whatever NANOANDREA_INLINER says: for a function NVVM
    inlining cannot compile (sharedmem.dynamic_shared_floats returns a shared array)."""
    if SIMULATOR:
        return cuda.jit(device=True)(function)
    return cuda.jit(device=True, inline="always")(function)


def kernel_factory(make):
    """A function that makes a kernel from a few compile-time parameters (hashable values, a
    tile or a flag): called again with the same parameters it returns the same kernel, so each
    is compiled once, and the kernel keeps `made_by` = (module, factory, parameters), which
    names it in the compile cache (runtime/cache.py) and lets another process make it again."""
    signature = inspect.signature(make)
    made = {}

    @functools.wraps(make)
    def factory(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        parameters = tuple(bound.arguments.values())
        if parameters not in made:
            kernel = make(*parameters)
            kernel.made_by = (make.__module__, make.__qualname__, parameters)
            made[parameters] = kernel
        return made[parameters]

    return factory


_recording = None       # while a run's kernels are listed (`recording`): the set they go to


def launch(kernel, grid, block, *args, shared_bytes=0, cluster=1):
    """Launch `kernel` on the current stream. grid and block are ints or tuples. shared_bytes:
    the size of the kernel's dynamic shared array (`cuda.shared.array(0, ...)`, cut into
    tiles by kernels/sharedmem.py); over 48 KB, the kernel is let have that much first.
    cluster: blocks a cluster, along x (Hopper; grid, an int, a multiple of it): the blocks
    of a cluster run at once, on neighbouring multiprocessors, each able to write into the
    others' shared memory and arrive on their barriers (ptx/tma.py). The simulator runs
    clusters of one block only.
    A kernel's first launch gives it the compile cache on disk (runtime/cache.py)."""
    if _recording is not None:
        _recording.add((kernel, argument_types(kernel, args)))
        return
    if not SIMULATOR and not isinstance(kernel._cache, cache.KernelCache):
        cache.attach(kernel)
    if cluster > 1:
        check(not SIMULATOR and isinstance(grid, int) and grid % cluster == 0,
              f"launch: a grid of {grid} blocks in clusters of {cluster}")
        launch_in_clusters(kernel, grid, block, args, shared_bytes, cluster)
        return
    configured = kernel[grid, block, _stream, shared_bytes]
    # (numba-cuda caches the configured launch per (grid, block, stream, bytes): the hook goes
    # on it once, not on every launch)
    if (shared_bytes > STATIC_SHARED_BYTES and not SIMULATOR
            and _allow_dynamic_shared not in configured.pre_launch_callbacks):
        configured.pre_launch_callbacks.append(_allow_dynamic_shared)
    configured(*args)


def launch_in_clusters(kernel, grid, block, args, shared_bytes, cluster):
    """numba-cuda's launch (dispatcher._Kernel.launch) with a cluster in its configuration,
    which numba-cuda does not offer: the kernel compiled for these arguments (or taken from
    memory or the disk cache), its arguments prepared as numba-cuda prepares them, and
    cuda.core's launch, whose grid then counts clusters."""
    from cuda.core import LaunchConfig
    from cuda.core import launch as core_launch
    from numba.cuda.cudadrv.driver import _to_core_stream
    compiled = kernel.compile(argument_types(kernel, args))
    stream = _to_core_stream(_stream)
    if shared_bytes > STATIC_SHARED_BYTES:
        _allow_shared_bytes(compiled, shared_bytes)
    prepared, written_back = [], []
    for kind, value in zip(compiled.argument_types, args):
        compiled._prepare_args(kind, value, stream, written_back, prepared)
    config = LaunchConfig(grid=grid // cluster, cluster=cluster, block=block,
                          shmem_size=shared_bytes)
    core_launch(stream, config, compiled._codelibrary.get_cufunc().kernel, *prepared)
    for write_back in written_back:     # (host arrays given: copied back, as numba-cuda does)
        write_back()


_allowed_shared = {}        # compiled kernel -> the dynamic shared bytes it may take


def _allow_dynamic_shared(compiled, configuration):
    # (numba-cuda's pre-launch hook, given the kernel compiled for these arguments)
    _allow_shared_bytes(compiled, configuration.sharedmem)


def _allow_shared_bytes(compiled, bytes_wanted):
    # The driver's attribute, set the way numba-cuda sets a kernel's shared-memory carveout
    # (CudaPythonFunction.set_shared_memory_carveout), once per kernel and size
    if _allowed_shared.get(id(compiled), 0) >= bytes_wanted:
        return
    from cuda.bindings import driver as binding
    from numba.cuda.cudadrv.driver import driver
    function = compiled._codelibrary.get_cufunc()
    attribute = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    driver.cuKernelSetAttribute(attribute, bytes_wanted, function.handle, function.device.id)
    _allowed_shared[id(compiled)] = bytes_wanted


def argument_types(kernel, args):
    """The numba types a kernel is compiled for when launched with `args` (under the simulator,
    which compiles nothing, the types of the arrays it wraps)."""
    if SIMULATOR:
        from numba import typeof
        return tuple(typeof(getattr(arg, "_ary", arg)) for arg in args)
    return tuple(kernel.typeof_pyval(arg) for arg in args)


@contextmanager
def recording():
    """Inside the block no kernel is launched: each launch adds (kernel, its argument types) to
    the set this yields, what the block would compile (nanoandrea/precompile.py). Nothing
    runs on the GPU, so what the host reads back from it is whatever the memory held."""
    global _recording
    previous, _recording = _recording, set()
    try:
        yield _recording
    finally:
        _recording = previous


def is_recording():
    """Whether launches are being recorded (`recording`), not made."""
    return _recording is not None


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


def blocks(n, per_block):
    """Number of blocks of `per_block` items that cover n items."""
    return max(1, (n + per_block - 1) // per_block)


ELEMENTWISE_THREADS = 32 if SIMULATOR else 256


def elementwise_grid(n):
    """(blocks, threads) for a grid-stride loop over n elements: enough blocks to fill the GPU
    (16 a multiprocessor), never more than needed (and few in the simulator, where every thread
    is a Python thread)."""
    most = 4 if SIMULATOR else 16 * device.current().multiprocessors
    return min(blocks(n, ELEMENTWISE_THREADS), most), ELEMENTWISE_THREADS


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
