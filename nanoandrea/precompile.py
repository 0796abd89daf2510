"""Compile the kernels a run will launch before it launches them, in parallel processes.

    needed = kernels_of(work)       the (kernel, argument types) that work() launches, found by
                                    running it with every launch recorded and none made
                                    (kernels/runtime/launch.py `recording`): nothing runs on the GPU
    compile_kernels(needed)         those the kernel cache (runtime/cache.py) does not hold yet,
                                    compiled by a pool of worker processes into it, with a line
                                    that says how far it is

Compiled where they are first launched, a training run's kernels would compile one after another
in its own process, minutes with Numba's inliner; a pool of processes (one a core) takes about
as long as the slowest few, and every later run loads them from the cache in well under a
second. What a run needs: `for_training` (a step, an evaluation, a sample), `for_sampling`.
"""
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from importlib import import_module

import numpy as np

from .kernels.runtime import cache
from .kernels.runtime.device import SIMULATOR
from .kernels.runtime.launch import recording


def kernels_of(work):
    """The set of (kernel, argument types) that work() launches; work() runs, but no kernel.
    What work() reads back to the host (a loss, the logits a sample draws from) was never
    written, so its bits are whatever the memory held, signalling NaNs among them, whose cast
    NumPy would warn of in the user's terminal: those values mean nothing here."""
    with recording() as launched, np.errstate(invalid="ignore"):
        work()
    return launched


def for_sampling(model):
    """What sampling from `model` launches (sample.generate): the prompt's forward, then a
    token's against the key/value cache; and the whole window's forward, which a sample takes
    once its context outgrows the block (or without the cache), on more rows than a token's
    products (matvec.py) take."""
    from .sample import generate
    needed = kernels_of(lambda: generate(model, np.zeros((1, 1), np.int64), 2, temperature=0))
    window = np.zeros((1, model.config.block_size), np.int64)
    return needed | kernels_of(lambda: generate(model, window, 1, temperature=0, kv_cache=False))


def for_training(model, batch_size, block_size, grad_accum=1, optimizer=None):
    """What a training run of `model` launches: a step (forward, backward, AdamW), an
    evaluation and a sample. (A step of its own, with an optimizer of its own, a new AdamW
    unless given: the model's parameters and the run's optimizer are untouched, since no
    kernel runs.)"""
    from .optim import AdamW
    from .step import TrainStep
    step = TrainStep(model, optimizer or AdamW(model.params), batch_size, block_size,
                     grad_accum, cuda_graph=False)
    ids = np.zeros((batch_size, block_size), np.int64)
    needed = kernels_of(lambda: step([(ids, ids)] * grad_accum, [0] * grad_accum, 1e-3))
    needed |= kernels_of(lambda: model.loss(ids, ids))
    return needed | for_sampling(model)


def compile_kernels(needed, workers=None, report=None):
    """Compile those of `needed` that the cache does not hold, `workers` processes at a time
    (default: $NANOANDREA_COMPILE_WORKERS, else one a core); report(line) says how far it is.
    Returns (compiled, seconds)."""
    if SIMULATOR or not needed:
        return 0, 0.0
    # (a kernel made in a function, not by launch.kernel_factory, has no name another process
    # could make it by: it is compiled where it is first launched)
    missing = sorted(((kernel, signature) for kernel, signature in needed
                      if cache.made_elsewhere(kernel) and not cache.cached(kernel, signature)),
                     key=_slowest_first)
    if not missing or not cache.writable():     # (unwritable: compiled where launched, once)
        return 0, 0.0
    report = report or (lambda line: print(line, file=sys.stderr, flush=True))
    workers = workers or int(os.environ.get("NANOANDREA_COMPILE_WORKERS", 0)) or os.cpu_count()
    workers = min(len(missing), workers or 1)
    started = time.perf_counter()
    progress = Progress(len(missing), report)
    context = multiprocessing.get_context("spawn")      # (never fork a process that has CUDA)
    with ProcessPoolExecutor(workers, mp_context=context) as pool:
        futures = {pool.submit(compile_one, cache.kernel_name(kernel), signature): kernel
                   for kernel, signature in missing}
        for future in as_completed(futures):
            error = future.exception()
            if error is not None:       # (compiled again where it is launched, and fails there)
                report(f"compiling {cache.kernel_name(futures[future])[1]} failed in a worker: "
                       f"{type(error).__name__}: {error}")
            progress.step()
    seconds = time.perf_counter() - started
    report(f"compiled {len(missing)} kernels in {seconds:.0f} s ({workers} processes); kept in "
           f"{cache.folder()}")
    return len(missing), seconds


def _slowest_first(item):
    """The matmul and attention kernels take longest to compile (the tensor-core ones most):
    they go to the pool first."""
    module = cache.kernel_name(item[0])[0]
    return (0 if ".matmul." in module or ".attention." in module else 1,
            str(cache.kernel_name(item[0])))


class Progress:
    """'compiling kernels 23/61 ...', rewritten in place on a terminal, else a line every 10 s."""
    def __init__(self, total, report):
        self.total, self.done, self.report = total, 0, report
        self.tty = sys.stderr.isatty()
        self.last = time.perf_counter()
        self._say(force=True)

    def step(self):
        self.done += 1
        self._say(force=self.done == self.total)

    def _say(self, force=False):
        line = (f"compiling kernels {self.done}/{self.total} (first run only; kept in "
                f"{cache.folder()})")
        if self.tty:
            sys.stderr.write("\r" + line + ("\n" if self.done == self.total else ""))
            sys.stderr.flush()
        elif force or time.perf_counter() - self.last > 10:
            self.report(line)
            self.last = time.perf_counter()


def compile_one(name, signature):
    """In a worker process: make the kernel `name` (cache.kernel_name) and compile it for
    `signature` into the cache."""
    module, qualname, parameters = name
    made = getattr(import_module(module), qualname)
    kernel = made(*parameters) if parameters is not None else made
    cache.attach(kernel)
    kernel.compile(tuple(signature))
