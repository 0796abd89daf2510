"""Start-up: compiled kernels kept on disk (kernels/cache.py), compiled ahead in parallel
(nanoandrea/precompile.py), and a log free of warning floods.

The cache's key is tested everywhere (it is the source and the versions, no GPU needed); what
needs a compiler (a kernel loaded back, rebuilt when a device function in another file changes,
two processes on one empty folder) runs on the GPU, each in fresh processes.
"""
import json
import os
import shutil
import subprocess
import sys
import warnings
from importlib import import_module
from pathlib import Path

import numpy as np
import pytest

from conftest import GPU
from nanoandrea.backend import get_backend
from nanoandrea.config import get_preset
from nanoandrea.kernels import cache, matmul, matmul_wgmma
from nanoandrea.model import GPT
from nanoandrea.precompile import compile_kernels, for_sampling, for_training, kernels_of
from nanoandrea.sample import generate

PACKAGE = Path(__file__).resolve().parents[1] / "nanoandrea"


def package_copy(tmp_path):
    """A copy of the package (a checkout someone is editing), importable from the folder
    returned."""
    root = tmp_path / "copy"
    shutil.copytree(PACKAGE, root / "nanoandrea", ignore=shutil.ignore_patterns("__pycache__"))
    return root


def python(code, root=None, cache_dir=None, **env):
    """Run `code` in a fresh interpreter (nanoandrea imported from `root` if given), with its
    kernel cache in cache_dir; returns its stdout's last line as JSON."""
    environment = dict(os.environ, **env)
    if root is not None:
        environment["PYTHONPATH"] = f"{root}{os.pathsep}{environment.get('PYTHONPATH', '')}"
    if cache_dir is not None:
        environment["NANOANDREA_KERNEL_CACHE"] = str(cache_dir)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=environment, cwd=root or None, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


DIGESTS = """
import json
from nanoandrea.kernels import cache
print(json.dumps({name: cache.source_digest("nanoandrea.kernels." + name)
                  for name in ("matmul", "embedding", "gelu")}))
"""


def test_cache_key_follows_the_device_functions_a_kernel_calls(tmp_path):
    """A change to gelu.py, where matmul's GELU epilogue gets its device functions, changes
    the source key of every matmul kernel, and not that of a module that does not import it."""
    root = package_copy(tmp_path)
    before, _ = python(DIGESTS, root, NUMBA_ENABLE_CUDASIM="1")
    gelu = root / "nanoandrea" / "kernels" / "gelu.py"
    gelu.write_text(gelu.read_text().replace("CUBIC = float32(0.044715)",
                                             "CUBIC = float32(0.0447)"))
    after, _ = python(DIGESTS, root, NUMBA_ENABLE_CUDASIM="1")
    assert after["gelu"] != before["gelu"] and after["matmul"] != before["matmul"]
    assert after["embedding"] == before["embedding"]


def test_kernels_are_named_across_processes():
    """A kernel made by a factory is named by its parameters, one defined at a module's top
    level by its name: what a worker process makes again."""
    assert cache.kernel_name(matmul.matmul_kernel(True, False)) == (
        "nanoandrea.kernels.matmul", "matmul_kernel", (True, False, None))
    assert cache.kernel_name(matmul.transpose_kernel) == (
        "nanoandrea.kernels.matmul", "transpose_kernel", None)


def test_an_unwritable_cache_folder_is_said_once(tmp_path, monkeypatch, capsys):
    """Where the folder cannot be written, one line says so, and nothing is raised: the run
    compiles in memory."""
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("NANOANDREA_KERNEL_CACHE", str(blocked / "kernels"))
    monkeypatch.setattr(cache, "_unwritable", [])
    monkeypatch.setattr(cache, "key", lambda kernel, signature: "k" + cache.SUFFIX)

    class Compiled:
        def _reduce_states(self):
            return {}
    kept = cache.KernelCache(matmul.transpose_kernel)
    kept.save_overload((), Compiled())
    kept.save_overload((), Compiled())
    assert not cache.writable()             # (what precompile asks before it starts a pool)
    notices = [line for line in capsys.readouterr().err.splitlines() if "cannot keep" in line]
    assert len(notices) == 1 and "NANOANDREA_KERNEL_CACHE" in notices[0]


def test_a_runs_kernels_are_listed_without_running_them():
    """for_training lists a step's, an evaluation's and a sample's kernels (matmul, attention,
    the optimizer among them) by running them with every launch recorded: no kernel runs, so
    the parameters stay what they were."""
    model = GPT(get_preset("tiny", vocab_size=37), get_backend("cuda"), seed=3)
    before = model.backend.to_host(model.params.buffer)
    needed = for_training(model, batch_size=2, block_size=8)
    names = {kernel.py_func.__name__ for kernel, _ in needed}
    assert {"adamw_kernel", "embedding_forward_kernel", "embedding_token_grad_kernel"} <= names
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
    wgmma = precision == "bf16" and matmul_wgmma.hopper()
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


# --- on the GPU: compiled once, loaded after, rebuilt when the source changes ----------------

GELU_PRODUCT = """
import json, numpy as np
from numba import cuda
from nanoandrea.kernels import matmul
rng = np.random.default_rng(0)
a, b = rng.standard_normal((256, 64), np.float32), rng.standard_normal((64, 128), np.float32)
out, activated = cuda.device_array((256, 128), np.float32), cuda.device_array((256, 128), np.float32)
matmul.matmul(out, cuda.to_device(a), cuda.to_device(b), gelu_out=activated)
kernel = matmul.matmul_kernel(False, False, "gelu")
print(json.dumps(dict(hits=kernel._cache.hits, misses=kernel._cache.misses,
                      sum=float(activated.copy_to_host().astype(np.float64).sum()))))
"""


@pytest.mark.skipif(not GPU, reason="compiling needs a GPU's toolchain")
def test_a_kernel_is_compiled_once_and_rebuilt_when_a_device_function_changes(tmp_path):
    """A fresh process compiles the GELU-epilogue product and keeps it; the next loads it;
    after gelu.py changes (a device function the kernel calls, in another file) the kernel is
    compiled again, and computes the new function."""
    root, folder = package_copy(tmp_path), tmp_path / "kernels"
    first, _ = python(GELU_PRODUCT, root, folder)
    second, _ = python(GELU_PRODUCT, root, folder)
    assert (first["hits"], first["misses"]) == (0, 1)
    assert (second["hits"], second["misses"]) == (1, 0) and second["sum"] == first["sum"]
    gelu = root / "nanoandrea" / "kernels" / "gelu.py"
    gelu.write_text(gelu.read_text().replace("CUBIC = float32(0.044715)",
                                             "CUBIC = float32(0.5)"))
    changed, _ = python(GELU_PRODUCT, root, folder)
    assert (changed["hits"], changed["misses"]) == (0, 1) and changed["sum"] != first["sum"]


@pytest.mark.skipif(not GPU, reason="compiling needs a GPU's toolchain")
def test_two_processes_fill_one_empty_cache_at_once(tmp_path):
    """Two processes that compile the same kernels into one empty folder at the same time both
    finish, and a third loads what they left."""
    root, folder = package_copy(tmp_path), tmp_path / "kernels"
    environment = dict(os.environ, NANOANDREA_KERNEL_CACHE=str(folder),
                       PYTHONPATH=f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    both = [subprocess.Popen([sys.executable, "-c", GELU_PRODUCT], env=environment, cwd=root,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(2)]
    results = [process.communicate(timeout=600) for process in both]
    assert all(process.returncode == 0 for process in both), results
    third, _ = python(GELU_PRODUCT, root, folder)
    assert (third["hits"], third["misses"]) == (1, 0)
    assert not list(folder.glob(".writing-*"))


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
