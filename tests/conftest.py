"""Test setup: kernels run on the GPU when there is one, else in Numba's CUDA simulator.

NUMBA_ENABLE_CUDASIM must be set before numba is imported, so it is decided here, first:
an explicit NUMBA_ENABLE_CUDASIM wins; otherwise the simulator is on when the machine shows no
NVIDIA device. `GPU` tells the tests which sizes to use: the simulator runs every GPU thread as
a Python thread, so its sizes are tiny; on the GPU the same tests run at andrea-12m shapes.
"""
import glob
import os
import sys
import zlib

if "NUMBA_ENABLE_CUDASIM" not in os.environ:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "0" if glob.glob("/dev/nvidia[0-9]*") else "1"

import numpy as np
import pytest

GPU = os.environ["NUMBA_ENABLE_CUDASIM"] != "1"
# tests/kernels/checks.py, the kernel tests' shared helpers, is imported by name from every
# folder below tests/kernels (pytest puts a test's own folder and this one on sys.path)
sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels"))
# Compiled kernels: one cache for the whole session (its workers too), whatever folder a test
# gives NANOANDREA_CACHE (the data cache); a run's compiling pool small beside pytest's workers
os.environ.setdefault("NANOANDREA_KERNEL_CACHE",
                      os.path.join(os.path.expanduser("~"), ".cache", "nanoandrea", "kernels"))
os.environ.setdefault("NANOANDREA_COMPILE_WORKERS", "2")


def _serialise_simulated_shared_arrays():
    """Numba's simulator (numba-cuda 0.30) gives a block's threads their shared arrays with an
    unlocked check-then-insert (FakeCUDAShared.array: get, and if missing, np.empty and insert,
    keyed by the declaring line). Two threads that reach a declaration together can each make
    an array; one then works on a private copy the rest of the block never sees (stale or NaN
    values). Rare, and under load: seen with 8-12 pytest workers on a busy
    machine (the layer norm's backward, the attention backward). Here the same lookup, locked.
    """
    import sys
    import threading
    import traceback

    from numba.core import types
    from numba.cuda.simulator.kernelapi import FakeCUDAShared
    from numba.np import numpy_support

    unlocked = FakeCUDAShared.array
    lock = threading.Lock()

    def array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:     # dynamic shared memory: one buffer made
            return unlocked(self, shape, dtype, alignment)      # up front (or an error)
        caller = traceback.extract_stack(sys._getframe(1), limit=1)[0][0:2]
        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        with lock:
            found = self._allocations.get(caller)
            if found is None:
                found = self._allocations[caller] = np.empty(shape, dtype)
        return found

    FakeCUDAShared.array = array


def _yield_between_polls():
    """Numba's simulator runs a block's threads as Python threads, and its BlockManager.run
    polls them in a loop that never sleeps (to see which wait at a barrier, which finished):
    the polling thread holds the interpreter lock for its whole switch interval while the
    block's threads wait for it, about half the time of a block with one thread left running.
    Here each poll of a thread (BlockThread.is_alive, called once a loop for every live thread)
    first yields the lock (time.sleep(0)): the same results, the simulated threads run while
    the block manager waits."""
    import time

    from numba.cuda.simulator.kernel import BlockThread

    alive = BlockThread.is_alive

    def is_alive(self):
        time.sleep(0)
        return alive(self)

    BlockThread.is_alive = is_alive


if not GPU:
    _serialise_simulated_shared_arrays()
    _yield_between_polls()


def pytest_report_header(config):
    return ("kernels run on the GPU" if GPU else
            "kernels run in Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1): tiny sizes")


@pytest.fixture(autouse=True)
def empty_tape():
    """Each test starts with an empty autograd tape: a test that runs a forward with gradients
    and no backward (comparing outputs only) leaves its nodes there, and the next test in the
    same worker would find them."""
    from nanoandrea.autograd import clear_tape
    clear_tape()
    yield


@pytest.fixture
def rng(request):
    """A fresh random generator per test (seeded from the test's name, so a failure repeats)."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def relative_error(got, want):
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, f"shape {got.shape} != {want.shape}"
    assert np.all(np.isfinite(got)), "non-finite values in the result"
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
