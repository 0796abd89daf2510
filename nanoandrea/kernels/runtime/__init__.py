"""The runtime layer: how kernels are compiled, cached, launched and given memory.

    device      the device's facts, read from it: multiprocessors, L2, compute capability,
                peak FLOP/s; whether a GPU (or the simulator) is there
    launch      the one launcher: the stream, shape and dtype checks, kernel factories
    memory      CuPy's pool under Numba, the arena of a captured CUDA graph, scratch arrays
    cache       compiled kernels kept on disk, keyed by their source and toolchain
"""
