"""nanoandrea: a GPT training engine whose every GPU kernel is a plain Numba @cuda.jit kernel."""

__version__ = "0.1.0"
