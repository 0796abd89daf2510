"""The runtime layer: how kernels are compiled, cached, launched and given memory.

    device      the device's facts, read from it: multiprocessors, L2, compute capability,
                peak FLOP/s; whether a GPU (or the simulator) is there
    launch      the one launcher: the stream, shape and dtype checks, kernel factories
    memory      CuPy's pool under Numba, the arena of a captured CUDA graph, scratch arrays
    cache       compiled kernels kept on disk, keyed by their source and toolchain
"""
# CuPy's pool goes under Numba before any CUDA context exists, so at the first import of the
# kernels, whichever module comes first (a context made before it keeps Numba's own allocator:
# ~160 us a cudaMalloc, and each free synchronizes the device)
from . import memory  # noqa: F401,E402
