"""Start-up: a run's kernels listed and compiled ahead in parallel (nanoandrea/precompile.py),
and a log free of warning floods. (The compiled kernels kept on disk:
kernels/runtime/test_cache.py.)"""
import os
import subprocess
import sys
import warnings
from importlib import import_module

import numpy as np
import pytest

from conftest import GPU
from nanoandrea.backend import get_backend
from nanoandrea.config import get_preset
from nanoandrea.kernels.runtime import cache, device
from nanoandrea.model import GPT
from nanoandrea.precompile import compile_kernels, for_sampling, for_training, kernels_of
from nanoandrea.sample import generate


def test_a_runs_kernels_are_listed_without_running_them():
    """for_training lists a step's, an evaluation's and a sample's kernels (matmul, attention,
    the optimizer among them) by running them with every launch recorded: no kernel runs, so
    the parameters stay what they were."""
    model = GPT(get_preset("tiny", vocab_size=37), get_backend("cuda"), seed=3)
    before = model.backend.to_host(model.params.buffer)
    needed = for_training(model, batch_size=2, block_size=8)
    names = {kernel.py_func.__name__ for kernel, _ in needed}
    assert {"adamw4_kernel", "embedding_forward_kernel", "embedding_token_grad_kernel"} <= names
    assert any("matmul" in name for name in names)
    assert any("attention_forward" in name for name in names)
    assert any("attention_backward" in name or "dkdv" in name for name in names)
    assert np.array_equal(model.backend.to_host(model.params.buffer), before)
    assert for_sampling(model) <= needed
    assert {"kv_store_kernel", "attention_cached_kernel"} <= {   # (the cached token's forward)
        kernel.py_func.__name__ for kernel, _ in for_sampling(model)}
    window = np.zeros((1, model.config.block_size + 2), np.int64)     # (outgrows the block)
    assert kernels_of(lambda: generate(model, window, 2, temperature=0)) <= for_sampling(model)
    assert kernels_of(lambda: None) == set()


def test_listing_a_samples_kernels_says_nothing_of_the_memory_it_reads(monkeypatch):
    """While a run's kernels are listed none runs, so the logits a sample draws from are
    whatever the memory held: bits that may be signalling NaNs, whose cast to float64 NumPy
    warns of. Listing them prints no warning (here every value read back is one)."""
    model = GPT(get_preset("tiny", vocab_size=37), get_backend("cuda"), seed=3)
    backend = type(model.backend)
    to_host = backend.to_host

    def unwritten(self, array):             # (float32 signalling NaNs: exponent all ones,
        values = np.asarray(to_host(self, array))               # the quiet bit clear)
        if values.dtype != np.float32:
            return values
        return np.full(values.shape, 0x7FA00000, np.uint32).view(np.float32)

    monkeypatch.setattr(backend, "to_host", unwritten)
    with pytest.warns(RuntimeWarning, match="invalid value"):           # (the bits do warn)
        unwritten(model.backend, model.params.buffer).astype(np.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert for_sampling(model)


@pytest.mark.parametrize("precision", ["tf32", "bf16"])
def test_a_tensor_core_runs_products_are_listed_under_names_a_worker_can_make(precision):
    """In tf32 and bf16 a run's list holds the tensor-core products (the three orientations a
    step launches, of that element type) and the operands' rounding; each product is named by
    its factory and parameters, so that a compiling worker (precompile.compile_one) makes the
    very kernel the run launches."""
    model = GPT(get_preset("tiny", vocab_size=37), get_backend("cuda", precision=precision),
                seed=3)
    needed = for_training(model, batch_size=2, block_size=8)
    # (mma.sync's kernel is made for an element type; on Hopper bf16's products are wgmma's,
    # bf16 only)
    wgmma = precision == "bf16" and device.runs_wgmma()
    products = {kernel for kernel, _ in needed if cache.kernel_name(kernel)[1] == (
        "wgmma_matmul_kernel" if wgmma else "mma_matmul_kernel")}
    assert wgmma or {cache.kernel_name(kernel)[2][3] for kernel in products} == {precision}
    assert {cache.kernel_name(kernel)[2][:2] for kernel in products} == {
        (False, False), (False, True), (True, False)}               # Y = X W, dX, dW
    assert f"round_{precision}_kernel" in {kernel.py_func.__name__ for kernel, _ in needed}
    for kernel in products:
        module, factory, parameters = cache.kernel_name(kernel)
        assert getattr(import_module(module), factory)(*parameters) is kernel


@pytest.mark.skipif(GPU, reason="without a GPU nothing is compiled")
def test_nothing_compiles_in_the_simulator():
    model = GPT(get_preset("tiny"), get_backend("cuda"), seed=3)
    assert compile_kernels(for_sampling(model)) == (0, 0.0)


@pytest.mark.skipif(not GPU, reason="compiling needs a GPU's toolchain")
def test_compile_command_fills_the_cache_ahead(tmp_path):
    """`nanoandrea compile --preset tiny` compiles what training, evaluation and sampling
    launch, and says so; run again, it finds them all compiled."""
    folder = tmp_path / "kernels"
    command = [sys.executable, "-m", "nanoandrea", "compile", "--preset", "tiny",
               "--batch-size", "4", "--block-size", "8"]
    environment = dict(os.environ, NANOANDREA_KERNEL_CACHE=str(folder),
                       NANOANDREA_INLINER="nvvm")
    first = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=600)
    assert first.returncode == 0, first.stderr
    assert "compiled" in first.stdout + first.stderr and list(folder.glob("*" + cache.SUFFIX))
    again = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=600)
    assert "compiled already" in again.stdout + again.stderr, again.stdout + again.stderr


@pytest.mark.skipif(not GPU, reason="the warnings come from numba-cuda's launches")
def test_a_training_log_has_no_warning_flood(tmp_path):
    """A short GPU run's whole output, warnings shown as Python shows them by default: no
    NumbaPerformanceWarning (the grids of one sequence's sampling are small on purpose)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("Speak, speak. First Citizen: we are resolved.\n" * 200)
    done = subprocess.run([sys.executable, "-W", "default", "-m", "nanoandrea.train", "--preset",
                           "tiny", "--data", str(corpus), "--out", str(tmp_path / "out"),
                           "--max-steps", "6", "--eval-interval", "3", "--eval-iters", "2",
                           "--batch-size", "4", "--block-size", "8", "--log-interval", "3"],
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, NANOANDREA_CACHE=str(tmp_path / "data")))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Warning" not in done.stdout + done.stderr, (done.stdout + done.stderr)[-3000:]
