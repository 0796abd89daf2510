"""Device memory (kernels/runtime/memory.py): CuPy's pool is under Numba whichever of the
package's modules a program imports first, as long as it does so before its first CUDA array
(a tool that imports only the device's facts, then makes arrays, then a launcher: the ladder's
driver does). Without the pool each allocation is a cudaMalloc and each free waits for the
device, and a timed kernel that allocates is measured at the host's pace."""
import subprocess
import sys

import pytest

from conftest import GPU

pytest.importorskip("cupy")

PROGRAM = """
from numba import cuda
import nanoandrea.kernels.runtime.device          # the first import: the device's facts only
cuda.device_array(4)                               # the CUDA context made here
from nanoandrea.kernels.runtime import launch, memory   # noqa: F401 (a launcher, later)
print(type(cuda.current_context().memory_manager).__name__, memory.CUPY_POOL)
"""


@pytest.mark.skipif(not GPU, reason="the pool is the GPU's (the simulator allocates in NumPy)")
def test_the_pool_is_under_numba_whichever_module_comes_first():
    result = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True,
                            check=True)
    assert result.stdout.split() == ["CuPyMemoryManager", "True"], result.stdout + result.stderr
