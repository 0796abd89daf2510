"""Compiled kernels kept on disk (kernels/runtime/cache.py).

The cache's key is tested everywhere (it is the source and the versions, no GPU needed); what
needs a compiler (a kernel loaded back, rebuilt when a device function in another file changes,
two processes on one empty folder) runs on the GPU, each in fresh processes.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import GPU
from nanoandrea.kernels.matmul import float32
from nanoandrea.kernels.runtime import cache

PACKAGE = Path(__file__).resolve().parents[3] / "nanoandrea"


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
from nanoandrea.kernels.runtime import cache
print(json.dumps({name: cache.source_digest("nanoandrea.kernels." + name)
                  for name in ("matmul.float32", "embedding", "gelu")}))
"""


def test_cache_key_follows_the_device_functions_a_kernel_calls(tmp_path):
    """A change to gelu.py, where the float32 product's GELU epilogue gets its device functions,
    changes the source key of its kernels, and not that of a module that does not import it."""
    root = package_copy(tmp_path)
    before, _ = python(DIGESTS, root, NUMBA_ENABLE_CUDASIM="1")
    gelu = root / "nanoandrea" / "kernels" / "gelu.py"
    gelu.write_text(gelu.read_text().replace("CUBIC = float32(0.044715)",
                                             "CUBIC = float32(0.0447)"))
    after, _ = python(DIGESTS, root, NUMBA_ENABLE_CUDASIM="1")
    assert after["gelu"] != before["gelu"]
    assert after["matmul.float32"] != before["matmul.float32"]
    assert after["embedding"] == before["embedding"]


def test_kernels_are_named_across_processes():
    """A kernel made by a factory is named by its parameters, one defined at a module's top
    level by its name: what a worker process makes again."""
    assert cache.kernel_name(float32.matmul_kernel(True, False)) == (
        "nanoandrea.kernels.matmul.float32", "matmul_kernel", (True, False, None))
    assert cache.kernel_name(float32.transpose_kernel) == (
        "nanoandrea.kernels.matmul.float32", "transpose_kernel", None)


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
    kept = cache.KernelCache(float32.transpose_kernel)
    kept.save_overload((), Compiled())
    kept.save_overload((), Compiled())
    assert not cache.writable()             # (what precompile asks before it starts a pool)
    notices = [line for line in capsys.readouterr().err.splitlines() if "cannot keep" in line]
    assert len(notices) == 1 and "NANOANDREA_KERNEL_CACHE" in notices[0]


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_kept_kernels_follow_the_umask(tmp_path, monkeypatch, umask):
    """A kept kernel's file has the mode the umask gives (0644 under 022), not mkstemp's 0600:
    a cluster's shared cache folder is read by every user's runs."""
    monkeypatch.setenv("NANOANDREA_KERNEL_CACHE", str(tmp_path / "kernels"))
    monkeypatch.setattr(cache, "_unwritable", [])
    monkeypatch.setattr(cache, "key", lambda kernel, signature: "k" + cache.SUFFIX)

    class Compiled:
        def _reduce_states(self):
            return {}
    previous = os.umask(umask)
    try:
        cache.KernelCache(float32.transpose_kernel).save_overload((), Compiled())
    finally:
        os.umask(previous)
    kept = list((tmp_path / "kernels").iterdir())
    assert [path.name for path in kept] == ["k" + cache.SUFFIX]
    assert kept[0].stat().st_mode & 0o777 == 0o666 & ~umask


# --- on the GPU: compiled once, loaded after, rebuilt when the source changes ----------------

GELU_PRODUCT = """
import json, numpy as np
from numba import cuda
from nanoandrea.kernels import matmul
from nanoandrea.kernels.matmul import float32
rng = np.random.default_rng(0)
a, b = rng.standard_normal((256, 64), np.float32), rng.standard_normal((64, 128), np.float32)
out, activated = cuda.device_array((256, 128), np.float32), cuda.device_array((256, 128), np.float32)
matmul.matmul(out, cuda.to_device(a), cuda.to_device(b), gelu_out=activated)
kernel = float32.matmul_kernel(False, False, "gelu")
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


def test_kernels_made_in_a_function_are_named_by_what_they_closed_over():
    """Kernels of one name made by a function of their own (a ladder version's make_kernels(D),
    not a kernel_factory) take the same argument types at D = 32 and 64: their names carry
    the closure's constants, device functions' included, or the D = 64 code would be loaded
    for D = 32 (wrong numbers, no error). A closure over anything else (an array) is compiled
    in memory and not kept."""
    from types import SimpleNamespace

    import numpy as np

    def make_kernels(D, table=None):
        def row_sum(x):
            return x * D

        def kernel(out):
            return row_sum(out) + (0 if table is None else table[0])
        return SimpleNamespace(py_func=kernel)

    names = [cache.kernel_name(make_kernels(D)) for D in (32, 64, 32)]
    assert names[0] == names[2] != names[1]
    assert "'D', '32'" in repr(names[0]) and "'D', '64'" in repr(names[1])
    with_array = make_kernels(32, table=np.zeros(4))
    with pytest.raises(cache.NotCacheable, match="table, a ndarray"):
        cache.kernel_name(with_array)
    assert cache.attach(with_array) is None and with_array.in_memory
    assert not cache.made_elsewhere(with_array) and not cache.made_elsewhere(make_kernels(32))
