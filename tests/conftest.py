"""Test setup: kernels run on the GPU when there is one, else in Numba's CUDA simulator.

NUMBA_ENABLE_CUDASIM must be set before numba is imported, so it is decided here, first:
an explicit NUMBA_ENABLE_CUDASIM wins; otherwise the simulator is on when the machine shows no
NVIDIA device. `GPU` tells the tests which sizes to use: the simulator runs every GPU thread as
a Python thread, so its sizes are tiny; on the GPU the same tests run at andrea-12m shapes.
"""
import glob
import os
import zlib

if "NUMBA_ENABLE_CUDASIM" not in os.environ:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "0" if glob.glob("/dev/nvidia[0-9]*") else "1"

import numpy as np
import pytest

GPU = os.environ["NUMBA_ENABLE_CUDASIM"] != "1"


def pytest_report_header(config):
    return ("kernels run on the GPU" if GPU else
            "kernels run in Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1): tiny sizes")


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
