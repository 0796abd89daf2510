"""Compiled kernels kept on disk: a run compiles only what no run before it has compiled.

    key     the kernel (its `made_by`: module, factory and compile-time parameters, or its
            module and name), its argument types, and everything its machine code depends on:
              - the source of its module and of every project module that module imports, so
                that a change to a device function in another file compiles the kernels that
                call it again (numba's own cache, `cache=True`, checks only the kernel's file,
                and for a kernel made by a factory it never hits: its key pickles the closure);
              - numba, numba-cuda, llvmlite and NumPy's versions, NVVM's and the CUDA driver's;
              - the GPU's compute capability, and who inlines the device functions (INLINER).
    value   numba-cuda's own serialised kernel (its PTX and its cubin), pickled.
    folder  $NANOANDREA_KERNEL_CACHE, else $NANOANDREA_CACHE/kernels (the data cache's folder),
            else ~/.cache/nanoandrea/kernels.

A kernel is written to a temporary file in the folder and renamed into place (atomic), so
processes that share the folder (two trainings, the test suite's workers) never read half of
one; an entry that does not load (a truncated file, another pickle) is compiled again. A folder
that cannot be written is said once, and the run compiles in memory.

`attach(kernel)` gives a numba-cuda dispatcher this cache (runtime/launch.py does it at a
kernel's first launch); the dispatcher then asks it before compiling and hands it what it
compiled. Under the CUDA simulator nothing is compiled, and nothing is kept.
"""
import ast
import functools
import hashlib
import importlib.util
import os
import pickle
import sys
import tempfile
from pathlib import Path

import numpy as np

from ...files import shareable

SUFFIX = ".kernel"


def folder():
    """Where the compiled kernels live (see the module's doc)."""
    if os.environ.get("NANOANDREA_KERNEL_CACHE"):
        return Path(os.environ["NANOANDREA_KERNEL_CACHE"])
    data = os.environ.get("NANOANDREA_CACHE") or Path.home() / ".cache" / "nanoandrea"
    return Path(data) / "kernels"


# --- the key ---------------------------------------------------------------------------------

@functools.cache
def _library_paths():
    """Folders of installed packages and of Python itself: modules there are versioned, not
    hashed."""
    import site
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, *site.getsitepackages(),
             site.getusersitepackages()}
    return tuple(str(Path(p).resolve()) for p in paths if p)


def _is_project_module(name, path):
    """nanoandrea's own modules, and modules of the user's (a script's, a test's, tools/dev's):
    those whose files are not under an installed package's folder."""
    if name.split(".")[0] == "nanoandrea":
        return True
    return not str(Path(path).resolve()).startswith(_library_paths())


@functools.cache
def _imports(module_name):
    """The project modules `module_name` imports (by its source, relative imports resolved)."""
    spec = importlib.util.find_spec(module_name)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return ()
    package = module_name if spec.submodule_search_locations else module_name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(Path(spec.origin).read_bytes())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) \
                if node.level else node.module
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            try:
                other = importlib.util.find_spec(name)
            except (ImportError, ValueError):
                continue        # (a name imported from a module, not a module)
            if (other is not None and other.origin and other.origin.endswith(".py")
                    and _is_project_module(name, other.origin)):
                found.append(name)
    return tuple(dict.fromkeys(found))


@functools.cache
def source_digest(module_name):
    """SHA-256 of the source of `module_name` and of every project module it imports, however
    deep: what the kernels defined in it are compiled from."""
    seen, todo = set(), [module_name]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(_imports(name))
    digest = hashlib.sha256()
    for name in sorted(seen):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin and spec.origin.endswith(".py"):
            digest.update(name.encode() + b"\0" + Path(spec.origin).read_bytes() + b"\0")
    return digest.hexdigest()


def kernel_name(kernel):
    """What names a kernel across processes: (module, factory, parameters) for a kernel made
    by launch.kernel_factory, (module, name, None) for one defined at a module's top level,
    and (module, name, its closure's constants) for one made by a function of its own (a
    `make_kernels(D)` that is not a kernel_factory): two such kernels of one name differ by
    what they closed over, D = 32 or 64, which their argument types do not show."""
    made_by = getattr(kernel, "made_by", None)
    if made_by is not None:
        return made_by
    function = kernel.py_func
    return function.__module__, function.__qualname__, closure_constants(function)


PLAIN = (bool, int, float, str, bytes, type(None))


def closure_constants(function):
    """The values a function closed over, as a tuple of plain constants (device functions it
    closed over give their own, recursively); None without a closure. NotCacheable when one
    is anything else (an array, an object): its name cannot say what it computes."""
    cells = function.__closure__ or ()
    if not cells:
        return None
    values = []
    for name, cell in zip(function.__code__.co_freevars, cells):
        value = cell.cell_contents
        inner = getattr(value, "py_func", value)            # (a numba dispatcher's function)
        if isinstance(value, PLAIN) or type(value).__module__ == "numpy" and np.isscalar(value):
            values.append((name, repr(value)))
        elif callable(inner) and hasattr(inner, "__code__"):
            values.append((name, inner.__module__, inner.__qualname__, closure_constants(inner)))
        else:
            raise NotCacheable(f"{function.__qualname__} closes over {name}, a "
                               f"{type(value).__name__}")
    return tuple(values)


class NotCacheable(Exception):
    """A kernel whose name does not say what it computes: compiled in memory, not kept."""


@functools.cache
def toolchain():
    """The versions and the device that compiled code depends on."""
    from importlib.metadata import version

    import llvmlite
    import numba
    import numpy
    from numba import cuda
    from numba.cuda.cudadrv import nvvm
    from numba.cuda.cudadrv.driver import driver
    inliner = os.environ.get("NANOANDREA_INLINER", "numba")     # (what launch.py compiles by)
    return (numba.__version__, version("numba-cuda"), llvmlite.__version__, numpy.__version__,
            nvvm.NVVM().get_version(), driver.get_version(),
            cuda.get_current_device().compute_capability, inliner, sys.version_info[:2])


def key(kernel, signature):
    """The file name of `kernel` compiled for `signature` (a tuple of numba types)."""
    module, name, parameters = kernel_name(kernel)
    text = repr((module, name, parameters, tuple(str(t) for t in signature),
                 source_digest(module), toolchain()))
    return hashlib.sha256(text.encode()).hexdigest()[:40] + SUFFIX


# --- the cache a dispatcher asks ---------------------------------------------------------------

_unwritable = []            # the folder, once writing to it has failed (said once)


class KernelCache:
    """What numba-cuda's dispatcher calls (in place of its own cache): load_overload before it
    compiles a signature, save_overload with what it compiled."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.hits = self.misses = 0

    @property
    def cache_path(self):
        return str(folder())

    def path(self, signature):
        return folder() / key(self.kernel, signature)

    def load_overload(self, signature, target_context):
        from numba.cuda.dispatcher import _Kernel
        signature = _argument_types(signature)
        try:
            payload = self.path(signature).read_bytes()
        except OSError:
            self.misses += 1
            return None
        try:
            target_context.refresh()
            compiled = _Kernel._rebuild(**pickle.loads(payload))
        except Exception:           # (truncated, or of another version: compiled again)
            self.misses += 1
            return None
        self.hits += 1
        return compiled

    def save_overload(self, signature, compiled):
        from numba.cuda.serialize import dumps          # (numba-cuda's own pickler)
        if _unwritable:
            return
        where = folder()
        try:
            payload = dumps(compiled._reduce_states())
        except Exception as error:      # (a kernel that holds a device array, say)
            print(f"nanoandrea: {kernel_name(self.kernel)[1]} cannot be kept on disk "
                  f"({type(error).__name__}: {error}); it is compiled again by every run",
                  file=sys.stderr)
            return
        try:
            where.mkdir(parents=True, exist_ok=True)
            handle, temporary = tempfile.mkstemp(dir=where, prefix=".writing-")
            with os.fdopen(handle, "wb") as f:
                f.write(payload)
            shareable(temporary)        # (mkstemp's 0600: a team's shared cache reads it)
            os.replace(temporary, self.path(_argument_types(signature)))
        except OSError as error:
            _cannot_write(where, error)

    def flush(self):
        pass


def _cannot_write(where, error):
    """Say once that `where` cannot be written; from then on nothing is saved."""
    if not _unwritable:
        _unwritable.append(where)
        reason = error.strerror or type(error).__name__
        print(f"nanoandrea: cannot keep compiled kernels in {where} ({reason}); set "
              f"NANOANDREA_KERNEL_CACHE to a writable folder. Compiling in memory for this run.",
              file=sys.stderr)


def writable():
    """Whether compiled kernels can be kept in the folder (if not, said once)."""
    if _unwritable:
        return False
    where = folder()
    try:
        where.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=where):
            pass
        return True
    except OSError as error:
        _cannot_write(where, error)
        return False


def _argument_types(signature):
    """A dispatcher's signature (a tuple of types, or a numba Signature) as a tuple of types."""
    return tuple(getattr(signature, "args", signature))


def attach(kernel):
    """Make the numba-cuda dispatcher `kernel` load and keep its compiled code here (unless it
    is NotCacheable: then numba-cuda compiles it in memory, as without this cache)."""
    if getattr(kernel, "in_memory", False):
        return None
    if not isinstance(getattr(kernel, "_cache", None), KernelCache):
        try:
            kernel_name(kernel)
        except NotCacheable:
            kernel.in_memory = True
            return None
        kernel._cache = KernelCache(kernel)
    return kernel._cache


def made_elsewhere(kernel):
    """Whether another process can make `kernel` by its name (cache.kernel_name): a kernel of
    a module's top level or of a kernel_factory, not one made inside a function."""
    try:
        return "<locals>" not in kernel_name(kernel)[1]
    except NotCacheable:
        return False


def cached(kernel, signature):
    """Whether `kernel` compiled for `signature` is on disk already."""
    return (folder() / key(kernel, tuple(signature))).is_file()
