"""The launcher (kernels/runtime/launch.py): tiles cut from dynamic shared memory, which a launch
over 48 KB must first allow (launch's shared_bytes, a hook added once), staying in shared memory
when compiled; who inlines the device functions (NANOANDREA_INLINER); the kernel factories'
kernels, made once per parameters."""
import os
import subprocess
import sys

import numba
import numpy as np
import pytest
from numba import cuda

from checks import device, poisoned
from conftest import GPU
from nanoandrea.kernels.ptx.sharedmem import dynamic_shared_floats, shared_tile
from nanoandrea.kernels.ptx.vector import load4, store4
from nanoandrea.kernels.runtime import launch as launch_module
from nanoandrea.kernels.runtime.launch import current_stream, kernel_factory, launch

SWAP_ROWS, SWAP_COLS = (4, 8) if not GPU else (128, 68)     # on the GPU 2 x 34.8 KB: over 48 KB


@cuda.jit
def swap_through_shared_tiles(out, x):
    # out[0] = x[1], out[1] = x[0] (x, out [2, SWAP_ROWS, SWAP_COLS]), through two tiles cut
    # from the dynamic shared array: thread t stores rows t, t + blockDim, ... of both, 16
    # bytes at a time, and after the barrier reads the other tile's rows
    buffer = dynamic_shared_floats()
    first = shared_tile(buffer, 0, SWAP_ROWS, SWAP_COLS)
    second = shared_tile(buffer, SWAP_ROWS * SWAP_COLS, SWAP_ROWS, SWAP_COLS)
    for r in range(cuda.threadIdx.x, SWAP_ROWS, cuda.blockDim.x):
        for c in range(0, SWAP_COLS, 4):
            a0, a1, a2, a3 = load4(x, (0, r, c))
            b0, b1, b2, b3 = load4(x, (1, r, c))
            store4(first, (r, c), a0, a1, a2, a3)
            store4(second, (r, c), b0, b1, b2, b3)
    cuda.syncthreads()
    for r in range(cuda.threadIdx.x, SWAP_ROWS, cuda.blockDim.x):
        for c in range(SWAP_COLS):
            out[0, r, c] = second[r, c]
            out[1, r, c] = first[r, c]


def test_shared_tiles_in_dynamic_shared_memory(rng):
    """Two 2-D tiles cut from the dynamic shared array (shared_tile) hold what was stored to
    them; on the GPU they take 69.6 KB, so the launch must first let the kernel have more than
    48 KB (launch's shared_bytes)."""
    x = rng.standard_normal((2, SWAP_ROWS, SWAP_COLS)).astype(np.float32)
    out = poisoned(x.shape)
    launch(swap_through_shared_tiles, 1, 32, out, device(x), shared_bytes=2 * x[0].nbytes)
    assert np.array_equal(out.copy_to_host(), x[::-1])


@pytest.mark.skipif(not GPU, reason="the simulator has no launch hooks")
def test_dynamic_shared_hook_added_once(rng):
    """numba-cuda hands back the same configured launch for the same grid, block, stream and
    bytes: launching it again must not add launch's hook again (the list would grow by one a
    launch, and every launch would run them all)."""
    x = rng.standard_normal((2, SWAP_ROWS, SWAP_COLS)).astype(np.float32)
    out, source = poisoned(x.shape), device(x)
    for _ in range(3):
        launch(swap_through_shared_tiles, 1, 32, out, source, shared_bytes=2 * x[0].nbytes)
    configured = swap_through_shared_tiles[1, 32, current_stream(), 2 * x[0].nbytes]
    assert len(configured.pre_launch_callbacks) == 1


@pytest.mark.skipif(not GPU, reason="PTX needs the compiler (not the simulator)")
def test_shared_tiles_stay_in_shared_memory():
    """shared_tile's views compile to shared-memory loads and stores with constant offsets:
    no call into Numba's runtime, no local memory, no generic addresses."""
    ptx, _ = cuda.compile_ptx(swap_through_shared_tiles.py_func,
                              (numba.float32[:, :, ::1], numba.float32[:, :, ::1]), cc=(9, 0))
    assert "st.shared.v4.f32" in ptx and "ld.shared.f32" in ptx
    assert "call" not in ptx and ".local" not in ptx
    assert ".shared .align 16" in ptx           # (dynamic_shared_floats: 16-byte aligned)


def test_inliner_refuses_an_unknown_name():
    # NANOANDREA_INLINER names who inlines the device functions (launch.inlined): "numba" or
    # "nvvm"; any other name is refused when the module is imported
    env = dict(os.environ, NANOANDREA_INLINER="llvm")
    refused = subprocess.run([sys.executable, "-c", "import nanoandrea.kernels.runtime.launch"],
                             env=env, capture_output=True, text=True)
    assert refused.returncode != 0 and "NANOANDREA_INLINER='llvm'" in refused.stderr


@pytest.mark.skipif(not GPU, reason="the simulator's device functions are Python calls")
@pytest.mark.parametrize("inliner", ["numba", "nvvm"])
def test_inliner_is_chosen_by_its_environment_variable(monkeypatch, inliner):
    # Numba copying their IR (the default, the faster code on the H200) or NVVM (forceinline:
    # quicker to compile); inlined_by_numba is Numba's whatever the variable says
    monkeypatch.setattr(launch_module, "INLINER", inliner)
    options = launch_module.inlined(lambda x: x + 1).targetoptions
    assert (options["inline"], options["forceinline"]) == (
        ("always", False) if inliner == "numba" else ("never", True))
    options = launch_module.inlined_by_numba(lambda x: x + 1).targetoptions
    assert (options["inline"], options["forceinline"]) == ("always", False)


def test_a_factory_makes_one_kernel_per_parameters():
    """kernel_factory: the same parameters (defaults filled in) give the same kernel, named by
    its module, factory and parameters (what the compile cache and a compiling worker use);
    other parameters another kernel."""
    made = []

    @kernel_factory
    def scaled(factor, offset=0.0):
        made.append((factor, offset))

        @cuda.jit
        def scaled_kernel(out, x):
            i = cuda.grid(1)
            if i < x.size:
                out[i] = factor * x[i] + offset
        return scaled_kernel

    kernel = scaled(2.0)
    assert scaled(2.0, 0.0) is kernel and scaled(factor=2.0) is kernel
    assert scaled(3.0) is not kernel and made == [(2.0, 0.0), (3.0, 0.0)]
    assert kernel.made_by == (__name__, "test_a_factory_makes_one_kernel_per_parameters"
                              ".<locals>.scaled", (2.0, 0.0))
    out = poisoned(5)
    launch(kernel, 1, 32, out, device(np.arange(5)))
    assert np.array_equal(out.copy_to_host(), 2.0 * np.arange(5))
