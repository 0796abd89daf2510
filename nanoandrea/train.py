"""Training: `python -m nanoandrea.train` (the same as `nanoandrea train`).

    train(options)      the loop, top to bottom: each step draws its batches and dropout seeds,
                        runs forward, backward and AdamW (step.TrainStep: on the GPU one CUDA
                        graph), and every log_interval steps logs, every eval_interval steps
                        evaluates, samples and writes a checkpoint
    Run                 what the loop works with: the data, the model, the optimizer, the step,
                        and how a run logs, evaluates, samples, writes checkpoints and plots

With no arguments it trains andrea-12m on the embedded tiny Shakespeare with the char tokenizer,
on the GPU; without a usable GPU it says so and trains the small andrea-mini on the CPU with the
NumPy backend. The recipe (lr 1e-3 with 100 warmup steps and cosine decay to 1e-4 over 5000
steps, AdamW betas (0.9, 0.99), weight decay 0.1 on the weight matrices, dropout 0.2, B=64,
T=256) is nanoGPT's for this corpus.

What a run leaves in OUT (default out/): metrics.jsonl (one JSON object per logged step and per
evaluation), loss.png, samples.txt (a sample at every evaluation but the first), ckpt and best
(checkpoints, see nanoandrea.checkpoint: ckpt the last evaluation's, best the one of the lowest
val loss among this run's evaluations after step 0, which writes no checkpoint). A folder that
holds a run is continued with `--resume` or started over with `--overwrite`, never written over
without one (nanoandrea.runfolder). The resumed run's losses equal, step by step, those of a
run never interrupted: the batches, the dropout masks and the evaluation batches all come from
random states saved in the checkpoint or derived from the step.

On several ranks (train --gpus N, torchrun, mpirun: nanoandrea/distributed.py) --batch-size is
the batch of all ranks together, each rank training on its batch_size / N rows of it, so a
run's batches, schedule and (within float32 rounding) losses are the same whatever N is, and a
checkpoint of N ranks resumes on M. Rank 0 alone logs, evaluates, samples and writes
checkpoints. Dropout draws each rank's masks from a seed of its own.
"""
import contextlib
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np

from .backend import default_device, get_backend, resolve_precision
from .checkpoint import CheckpointError, checkpoint_folder, read_checkpoint, save_checkpoint
from .config import PRESETS, ConfigError, get_preset, parameter_breakdown
from .data import BatchSampler, DataError, Dataset, resolve_data
from .distributed import DistributedError, data_parallel
from .files import WriteError, replacing, writing
from .heads import HeadsError, gradient_shares, plot_gradient_shares
from .hf import InteropError
from .mfu import mfu, peak_flops, precision_line
from .model import GPT
from .optim import AdamW, ShardedAdamW, learning_rate
from .precompile import compile_kernels, for_training
from .runfolder import (OutFolderError, check_run_folder, checkpoint_step, start_over,
                        truncate_logs)
from .sample import SamplingError
from .step import EvalStep, TrainStep, dropout_seed, evaluation_seed
from .tokenizer import TokenizerError


class TrainingError(RuntimeError):
    """Training cannot go on (a NaN loss, no memory); the message says why and what to do."""


@dataclass
class TrainOptions:
    preset: str = "andrea-12m"
    data: str = None                 # a text file, a folder of .txt files or a prepared folder
    tokenizer: str = "char"
    vocab_size: int = None           # bpe only
    n_layer: int = None              # override the preset's shape
    n_head: int = None
    n_embd: int = None
    batch_size: int = 64
    block_size: int = 256
    grad_accum: int = 1
    max_steps: int = 5000
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0
    dropout: float = 0.2
    eval_interval: int = 250
    eval_iters: int = 100
    log_interval: int = 10
    seed: int = 1337
    out: str = "out"
    device: str = "auto"             # auto | cuda | cpu
    precision: str = "auto"          # auto | fp32 | tf32 | bf16: the matmuls' (backend.py)
    stop_at: int = None              # stop after this step (a checkpoint is written), as if killed
    sample_tokens: int = 200         # length of the sample written at each evaluation
    cuda_graph: bool = True          # GPU: capture the step once as a CUDA graph, then replay it
    model_vocab: int = None          # the model's vocabulary where it exceeds the data's (an
                                     # imported GPT-2: 50257, "<|endoftext|>" among them)
    imported_from: str = None        # the Hugging Face folder an imported checkpoint came from
    log_heads: bool = False          # at each evaluation, each head's share of its layer's
                                     # attention gradient (metrics, heads_grad.png)
    zero1: bool = False              # several ranks: each keeps AdamW's state for its shard
    overlap_comm: bool = True        # several ranks: all-reduce each layer's gradients as
                                     # backward finishes them, inside the CUDA graph (step.py)


# What `train` uses on the CPU when the user did not choose: a run that finishes in minutes
# (about 0.4 s a step on 2 cores).
CPU_DEFAULTS = dict(preset="andrea-mini", batch_size=16, block_size=64, max_steps=1000,
                    eval_interval=100, eval_iters=20, warmup_steps=50)
# Options that define the model and its data: a resumed run must keep them.
SHAPE_OPTIONS = ("preset", "data", "tokenizer", "vocab_size", "n_layer", "n_head", "n_embd",
                 "block_size")


def resolve_options(given, resume=False, report=print):
    """TrainOptions from the options the user gave (a dict without the Nones): the device
    decides the defaults, and with --resume the checkpoint's own options fill the rest."""
    device = given.get("device", "auto")
    if device == "auto":
        device = default_device()
        if device == "cpu":
            report("no usable GPU: training on the CPU with the NumPy backend")
    elif device == "cuda" and default_device() != "cuda":
        raise TrainingError("--device cuda: no usable CUDA GPU here (try --device cpu)")
    values = dict(CPU_DEFAULTS) if device == "cpu" else {}
    saved = {}
    if resume:
        saved = _saved_options(Path(given.get("out", TrainOptions.out)))
        # (an imported model, not yet trained here, takes the data the user gives it)
        fresh_import = saved.get("imported_from") and saved.get("data") is None
        changed = [k for k in SHAPE_OPTIONS if k in given and given[k] != saved.get(k)
                   and not (fresh_import and k in ("data", "tokenizer"))]
        if changed:
            raise CheckpointError("--resume: the checkpoint is from another config ("
                                  + ", ".join(f"{k}={saved.get(k)!r}, asked {given[k]!r}"
                                              for k in changed) + ")")
        values.update({k: v for k, v in saved.items() if k not in ("device", "stop_at")})
    values.update(given)
    values["device"] = device
    taken = [k for k in CPU_DEFAULTS if device == "cpu" and k not in given and k not in saved]
    if taken:
        report(cpu_defaults_line(taken, values))
    values["precision"] = resolve_precision(values.get("precision", "auto"), device)
    fields = {f.name for f in dataclasses.fields(TrainOptions)}
    return TrainOptions(**{k: v for k, v in values.items() if k in fields})


def cpu_defaults_line(taken, values):
    """The line that says which of CPU_DEFAULTS a run on the CPU takes (those not given):
    the block size among them, lowered from the preset's."""
    preset_block = getattr(PRESETS.get(values["preset"]), "block_size", None)
    words = {"preset": f"the {values['preset']} preset",
             "batch_size": f"batch {values['batch_size']}",
             "block_size": f"block {values['block_size']}" + (
                 f" ({values['preset']}'s is {preset_block})"
                 if preset_block and preset_block > values["block_size"] else ""),
             "max_steps": f"{values['max_steps']} steps",
             "eval_interval": f"an evaluation every {values['eval_interval']} steps",
             "eval_iters": f"{values['eval_iters']} batches an evaluation",
             "warmup_steps": f"{values['warmup_steps']} warmup steps"}
    return ("on the CPU, where not given: " + ", ".join(words[k] for k in taken)
            + " (each option sets its own)")


def _saved_options(out):
    folder = checkpoint_folder(out / "ckpt")
    if not folder.exists():
        raise CheckpointError(f"--resume: no checkpoint in {out} (expected {out / 'ckpt'})")
    config = folder / "config.json"
    if not config.is_file():
        raise CheckpointError(f"--resume: {out / 'ckpt'} is not a checkpoint folder")
    try:
        saved = json.loads(config.read_text()).get("train", {})
        if not isinstance(saved, dict):
            raise ValueError(f"its train options are {type(saved).__name__}, not a mapping")
    except (OSError, ValueError, AttributeError) as error:
        raise CheckpointError(f"--resume: the checkpoint {out / 'ckpt'} is damaged "
                              f"(config.json: {error})") from None
    return saved


def model_config(options, vocab_size):
    """The model's configuration for data of `vocab_size` tokens."""
    if options.model_vocab is not None:
        if vocab_size > options.model_vocab:
            raise ConfigError(f"the data has {vocab_size} tokens, more than the model's "
                              f"vocabulary ({options.model_vocab})")
        vocab_size = options.model_vocab
    shape = {k: getattr(options, k) for k in ("n_layer", "n_head", "n_embd")}
    return get_preset(options.preset, vocab_size=vocab_size, block_size=options.block_size,
                      dropout=options.dropout, **shape)


def estimate_step_bytes(config, batch_size, backend="cuda"):
    """A generous estimate of the memory a training step needs (activations and their gradients
    kept for backward, logits twice, the flat [4, P] parameter buffer). The NumPy backend's
    attention (kernels/attention.py's twins) also makes [B,H,T,T] arrays, one layer at a time:
    the scores, the probabilities, their gradient and the dropout factors, with temporaries
    about 7.5 such arrays at once (measured; 5.5 without dropout), counted as 8."""
    C, V, L = config.n_embd, config.vocab_size, config.n_layer
    tokens = batch_size * config.block_size
    per_token = L * (40 * C) + 4 * V + 8 * C
    attention = (8 * batch_size * config.n_head * config.block_size ** 2 if backend == "numpy"
                 else 0)
    return 4 * (tokens * per_token * 2 + 4 * parameter_breakdown(config)[-1][1] + attention)


def _available_bytes(backend):
    if backend.name == "cuda":
        from numba import cuda
        free, _ = cuda.current_context().get_memory_info()
        return free
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class Run:
    """A training run's parts, which the loop (train) works with."""

    def __init__(self, options: TrainOptions, report=print, world=None):
        """world: this process's rank among several (distributed.World), or None."""
        self.options = o = options
        self.world = world
        self.ranks, self.rank = (1, 0) if world is None else (world.size, world.rank)
        self.main = self.rank == 0
        self.report = report if self.main else (lambda message: None)
        if o.batch_size % self.ranks:
            raise TrainingError(f"--batch-size {o.batch_size} is the batch of all {self.ranks} "
                                f"ranks together: make it a multiple of {self.ranks}")
        self.rank_batch = o.batch_size // self.ranks          # each rank's rows of a batch
        self.out = Path(o.out)
        self.backend = get_backend("cuda" if o.device == "cuda" else "numpy",
                                   precision=o.precision)
        self.dataset = Dataset(self._resolve_data())
        self.config = model_config(o, self.dataset.vocab_size)
        self.dataset.check_block_size(self.config.block_size)
        self._check_memory()
        zero1 = world is not None and o.zero1
        self.model = GPT(self.config, self.backend, seed=o.seed, moments=not zero1)
        hyperparameters = dict(lr=o.lr, betas=(o.beta1, o.beta2), weight_decay=o.weight_decay,
                               grad_clip=o.grad_clip)
        parallel, in_graph = None, o.overlap_comm
        if world is None:
            self.optimizer = AdamW(self.model.params, **hyperparameters)
        else:
            communicator = world.connect(self.backend)
            self.optimizer, parallel = data_parallel(self.model.params, communicator, zero1,
                                                     **hyperparameters)
            in_graph = in_graph and communicator.capturable     # (else after the graph)
        self.batches = BatchSampler(self.dataset.splits["train"], o.batch_size,
                                    self.config.block_size, seed=o.seed,
                                    shard=(self.rank, self.ranks))
        self.step = 0
        self.best_val = math.inf
        self.owns_checkpoint = False    # whether OUT/ckpt is this run's (resumed, or written)
        # wall time this process spent on each part of the run, said when it ends (spent_line)
        self.spent = dict(training=0.0, losses=0.0, samples=0.0, saves=0.0)
        self.best_step = None
        self.window = self.backend.zeros((o.log_interval,))    # each step's loss, on the device
        self.stepper = TrainStep(self.model, self.optimizer, self.rank_batch,
                                 self.config.block_size, o.grad_accum, cuda_graph=o.cuda_graph,
                                 parallel=parallel, communicate_in_graph=in_graph)
        self.evaluation = None          # the evaluation's EvalStep, made at the first one
        self.history = {"step": [], "loss": [], "val_step": [], "val": []}
        self.tokens_per_step = o.batch_size * self.config.block_size * o.grad_accum
        self.peak = peak_flops(self.backend.precision) if self.backend.name == "cuda" else None

    def _resolve_data(self):
        """The prepared data folder (rank 0 prepares it, if need be, before the others look)."""
        o = self.options
        return self._rank_0_first(lambda: resolve_data(o.data, o.tokenizer, o.vocab_size,
                                                       report=self.report))

    def _rank_0_first(self, action):
        """action() here; on several ranks on rank 0 first, then on the others, which find
        what it made (a prepared data folder, compiled kernels) in the caches on their shared
        disk instead of all making it at once."""
        result = action() if self.main else None
        if self.world is not None:
            self.world.rendezvous.barrier()
            if not self.main:
                result = action()
        return result

    def _check_memory(self):
        need = estimate_step_bytes(self.config, self.rank_batch, self.backend.name)
        have = _available_bytes(self.backend)
        if have is not None and need > have:
            where = "the GPU has" if self.backend.name == "cuda" else "the machine has"
            raise TrainingError(
                f"batch too large for memory: a step needs about {need / 2**30:.1f} GiB and "
                f"{where} {have / 2**30:.1f} GiB free: lower --batch-size "
                f"({self.options.batch_size}{self._per_rank()}) or --block-size "
                f"({self.config.block_size}), "
                f"and use --grad-accum to keep the tokens per step")

    def _per_rank(self):
        return "" if self.world is None else f", {self.rank_batch} a rank"

    # --- resume -------------------------------------------------------------------------
    def resume(self):
        self.owns_checkpoint = True
        saved = read_checkpoint(self.out / "ckpt")
        if saved["config"] != self.config:
            raise CheckpointError(f"--resume: the checkpoint's model {saved['config']} differs "
                                  f"from this run's {self.config}")
        if saved["tokenizer"].to_dict() != self.dataset.tokenizer.to_dict():
            raise CheckpointError("--resume: the data's tokenizer is not the checkpoint's "
                                  "(prepare the text with the checkpoint's tokenizer: for a "
                                  "GPT-2, `nanoandrea prepare TEXT --out DIR --gpt2-files ...`)")
        store = self.model.params
        store.load_state_dict(saved["params"])
        state = saved["state"]
        if state.get("imported_from"):         # fine-tuning: a fresh optimizer, step 0
            self.report(f"fine-tuning {state['imported_from']} (imported) from "
                        f"{self.out / 'ckpt'}, with a fresh optimizer state")
            return
        self.optimizer.load_moments(saved["m"], saved["v"])
        self.optimizer.step_count = saved["step_count"]
        try:
            self.step = state["step"]
            self.best_val, self.best_step = state["best_val"], state["best_step"]
            self.batches.load_state(state["batches"])
            self.history = state["history"]
        except (KeyError, TypeError) as error:
            raise CheckpointError(f"the checkpoint {self.out / 'ckpt'} is damaged: its "
                                  f"state.json lacks {error}") from None
        # a run of older versions may have no best (step 0's loss counted as one, and no
        # checkpoint is written at step 0): the next evaluation writes one
        if not checkpoint_folder(self.out / "best").is_dir():
            self.best_val, self.best_step = math.inf, None
        if self.main:
            with writing(self.out):
                truncate_logs(self.out, self.step)
        self.report(f"resumed from {self.out / 'ckpt'} at step {self.step}")

    def checkpoints_said(self):
        """Where this run's last checkpoint is, for the line that says it stopped; a checkpoint
        in OUT that is not this run's is never named (a run does not resume from it)."""
        step = checkpoint_step(self.out) if self.owns_checkpoint else None
        if step is None:
            return "no checkpoint was written"
        return f"the last checkpoint, {self.out / 'ckpt'}, holds step {step}"

    # --- what the loop calls ------------------------------------------------------------
    def say_what_runs(self):
        """The run's first lines: the model, the backend and precision, the tokens per step."""
        o = self.options
        if self.main:
            with writing(self.out):
                self.out.mkdir(parents=True, exist_ok=True)
        total = parameter_breakdown(self.config)[-1][1]
        precision = precision_line(self.backend.precision, self.config.head_size,
                                   "cpu" if self.backend.name == "numpy" else "cuda")
        self.report(f"{model_name(o)}: {total:,} parameters, {self.config}, backend "
                    f"{self.backend.name}, {precision}")
        ranks = "" if self.world is None else (
            f", over {self.ranks} ranks ({self.rank_batch} sequences each"
            f"{', ZeRO-1' if isinstance(self.optimizer, ShardedAdamW) else ''})")
        self.report(f"{self.tokens_per_step:,} tokens per step ({o.batch_size} x "
                    f"{self.config.block_size} x {o.grad_accum}{ranks}), {o.max_steps} steps, "
                    f"out {self.out}")

    def start_over(self):
        """--overwrite: delete the earlier run's names in OUT, now that this run has started."""
        if not self.main:
            return
        with writing(self.out):
            deleted = start_over(self.out)
        if deleted:
            self.report(f"--overwrite: deleted the earlier run's {', '.join(deleted)} in "
                        f"{self.out}")

    def keep_loss(self, loss):
        """Add the step's loss (a device array) to the log window's slot, without a wait."""
        slot = self.window[self.step % self.options.log_interval:][:1]
        self.backend.add_into(slot, loss)

    def compile(self):
        """Compile the kernels the run launches (with an optimizer like the run's), those the
        kernel cache does not hold yet; nothing on the CPU."""
        if self.backend.name != "cuda":
            return
        optimizer = (ShardedAdamW(self.model.params, self.optimizer.communicator)
                     if isinstance(self.optimizer, ShardedAdamW) else None)
        self._rank_0_first(lambda: compile_kernels(
            for_training(self.model, self.rank_batch, self.config.block_size,
                         self.options.grad_accum, optimizer), report=self.report))

    def window_losses(self, steps):
        """The losses of the last `steps` steps, read from the device: waits for the GPU (the
        host runs ahead of it, by many steps when the step is a CUDA graph)."""
        o = self.options
        first = self.step - steps                     # 0-based index of the window's first step
        slots = [(first + i) % o.log_interval for i in range(steps)]
        return self.backend.to_host(self.window)[slots] / (o.grad_accum * self.ranks)

    def log(self, lr, losses, seconds_per_step, steps):
        if not self.main:
            return
        first = self.step - steps
        bad = np.flatnonzero(~np.isfinite(losses))
        if bad.size:
            raise TrainingError(f"the loss is {losses[bad[0]]} at step {first + bad[0] + 1}: "
                                f"stopped; {self.checkpoints_said()} (try a lower --lr)")
        loss = float(losses.mean())
        tokens_per_s = self.tokens_per_step / seconds_per_step
        utilisation = mfu(self.config, tokens_per_s, self.peak, self.ranks)
        norm = self.optimizer.grad_norm()
        self.history["step"].append(self.step)
        self.history["loss"].append(loss)
        line = (f"step {self.step:5d} | loss {loss:.4f} | lr {lr:.2e} | grad norm {norm:.3f} | "
                f"{seconds_per_step * 1e3:7.1f} ms/step | {tokens_per_s:9,.0f} tok/s")
        self.report(line + (f" | MFU {100 * utilisation:.1f}%" if utilisation is not None
                            else ""))
        self._metrics(dict(step=self.step, loss=loss, lr=lr, grad_norm=norm,
                           ms_per_step=seconds_per_step * 1e3, tokens_per_s=tokens_per_s,
                           mfu=utilisation))

    def _metrics(self, record):
        with writing(self.out / "metrics.jsonl"), open(self.out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    # --- evaluation, samples, checkpoints --------------------------------------------------
    def estimate_loss(self, split):
        """Mean loss over eval_iters batches drawn from a generator seeded by the step, so the
        training batches never depend on when evaluations happen: each batch's forward an
        EvalStep (on the GPU a captured graph, as the training step), the mean read once. (On
        several ranks rank 0 alone evaluates, a rank's rows of a batch at a time.)"""
        o = self.options
        if self.evaluation is None:
            self.evaluation = EvalStep(self.model, self.rank_batch, self.config.block_size,
                                       cuda_graph=o.cuda_graph, streams=self.stepper)
        sampler = BatchSampler(self.dataset.splits[split], o.batch_size, self.config.block_size,
                               seed=evaluation_seed(o.seed, self.step, split))
        # (a bar on a terminal; in a log, where click prints each bar's label as a line of its
        # own, nothing: the eval line follows)
        bar = (click.progressbar(range(o.eval_iters), label=f"eval {split}", file=sys.stderr,
                                 show_eta=False) if sys.stderr.isatty()
               else contextlib.nullcontext(range(o.eval_iters)))
        with bar as batches:
            for _ in batches:
                x, y = sampler.next()
                for rows in range(0, o.batch_size, self.rank_batch):
                    part = slice(rows, rows + self.rank_batch)
                    self.evaluation.add(x[part], y[part])
        return self.evaluation.mean()

    def evaluate(self, save):
        o = self.options
        if not self.main:                   # (ZeRO-1: the checkpoint gathers every shard)
            if save and isinstance(self.optimizer, ShardedAdamW):
                self.optimizer.moments_to_host()
            return
        started = time.perf_counter()
        train_loss, val_loss = self.estimate_loss("train"), self.estimate_loss("val")
        self.spent["losses"] += time.perf_counter() - started
        if not (math.isfinite(val_loss) and math.isfinite(train_loss)):
            raise TrainingError(f"the loss is {val_loss} at step {self.step}: stopped; "
                                f"{self.checkpoints_said()} (try a lower --lr)")
        improved = save and val_loss < self.best_val    # (step 0's writes no checkpoint)
        if improved:
            self.best_val, self.best_step = val_loss, self.step
        self.history["val_step"].append(self.step)
        self.history["val"].append(val_loss)
        self.report(f"step {self.step:5d} | eval: train {train_loss:.4f} | val {val_loss:.4f}"
                    f"{' (best)' if improved else ''}")
        record = dict(step=self.step, train_loss=train_loss, val_loss=val_loss)
        if o.log_heads and self.step > 0:           # (the last step's gradients)
            shares = gradient_shares(self.model.params.grad_dict(), self.config)
            self.history.setdefault("head_steps", []).append(self.step)
            self.history.setdefault("head_shares", []).append(shares)
            record["head_grad_share"] = shares
            with writing(self.out / "heads_grad.png"):
                plot_gradient_shares(self.history["head_steps"], self.history["head_shares"],
                                     self.out / "heads_grad.png")
        self._metrics(record)
        started = time.perf_counter()
        if self.step > 0:               # (the untrained model's text says nothing)
            self.write_sample()
        self.spent["samples"] += time.perf_counter() - started
        started = time.perf_counter()
        if save:
            state = dict(step=self.step, best_val=self.best_val, best_step=self.best_step,
                         batches=self.batches.state(), history=self.history,
                         val_loss=val_loss, seed=o.seed)
            self.owns_checkpoint = True
            with writing(f"a checkpoint in {self.out}"):
                save_checkpoint(self.out, ["ckpt", "best"] if improved else ["ckpt"], self.model,
                                self.optimizer, self.dataset.tokenizer, dataclasses.asdict(o),
                                state)
        self.plot()
        self.spent["saves"] += time.perf_counter() - started

    def write_sample(self):
        from .sample import generate
        tokenizer = self.dataset.tokenizer
        prompt = np.asarray(self.dataset.splits["val"][:1], dtype=np.int64)
        ids = generate(self.model, prompt[None, :], self.options.sample_tokens, temperature=0.8,
                       top_k=200, rng=np.random.default_rng(self.step),
                       vocab=tokenizer.vocab_size)
        text = tokenizer.decode(ids[0])
        path = self.out / "samples.txt"
        with writing(path), open(path, "a", encoding="utf-8") as f:
            f.write(f"=== step {self.step} ===\n{text}\n\n")

    def plot(self):
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return
        figure, axes = plt.subplots(figsize=(7, 4))
        axes.plot(self.history["step"], self.history["loss"], label="train (logged steps)")
        axes.plot(self.history["val_step"], self.history["val"], "o-", label="val")
        axes.set_xlabel("step")
        axes.set_ylabel("cross-entropy loss")
        axes.set_title(f"{model_name(self.options)} on "
                       f"{Path(self.dataset.meta['source']).name}")
        axes.grid(alpha=0.3)
        axes.legend()
        figure.tight_layout()
        try:
            with writing(self.out / "loss.png"), replacing(self.out / "loss.png") as temporary:
                figure.savefig(temporary, format="png", dpi=100)
        finally:
            plt.close(figure)


def model_name(options):
    """What the run's first line calls its model: the preset, or where an imported model came
    from (its shape is its own, whatever preset its options name)."""
    if options.imported_from:
        return f"GPT-2 imported from {options.imported_from}"
    return options.preset


def _explain_memory_error(error, options):
    text = f"{type(error).__name__}: {error}"
    if isinstance(error, MemoryError) or "OUT_OF_MEMORY" in text or "OutOfMemory" in text:
        graph = (" (or use --no-cuda-graph: a captured step keeps all its activations)"
                 if options.cuda_graph and options.device == "cuda" else "")
        return TrainingError(f"out of memory during a training step: lower --batch-size "
                             f"({options.batch_size}) or --block-size ({options.block_size}), "
                             f"and use --grad-accum to keep the tokens per step{graph}")
    return error


def train(options: TrainOptions, resume=False, report=print, world=None, overwrite=False):
    """Train as `options` say; resume: continue OUT/ckpt; overwrite: delete the run in OUT
    (its names only) once this one has started (nanoandrea.runfolder)."""
    if world is None or world.main:
        check_run_folder(options.out, resume, overwrite)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):   # (a NaN loss is said)
        return loop(options, resume, report, world, overwrite)


def loop(o, resume, report, world, overwrite):
    """The loop, top to bottom."""
    run = Run(o, report, world)
    try:
        if resume:
            run.resume()
        if overwrite:
            run.start_over()
        run.say_what_runs()
        run.compile()                       # (a first run on a machine compiles them all)
        last_step = o.max_steps if o.stop_at is None else min(o.max_steps, o.stop_at)
        if run.step == 0 and last_step > 0:
            run.evaluate(save=False)        # the untrained model's loss, for the plot
        clock, steps, paused = time.perf_counter(), 0, 0.0
        while run.step < last_step:
            lr = learning_rate(run.step, o.lr, o.min_lr, o.warmup_steps, o.max_steps)
            batches = [run.batches.next() for _ in range(o.grad_accum)]
            seeds = [dropout_seed(o.seed, run.step, micro, run.rank)
                     for micro in range(o.grad_accum)]
            try:
                loss = run.stepper(batches, seeds, lr)      # forward, backward, AdamW
            except Exception as error:
                raise _explain_memory_error(error, o) from error
            run.keep_loss(loss)             # (on the device: the host runs ahead of the GPU)
            run.step += 1
            steps += 1
            # (the first step is logged too: it says that training has started, and its time
            # is the one-off cost of the first step, the graph's capture)
            if run.step % o.log_interval == 0 or run.step == last_step or run.step == 1:
                losses = run.window_losses(steps)           # waits for the GPU: the steps'
                elapsed = time.perf_counter() - clock - paused          # real time
                run.log(lr, losses, elapsed / steps, steps)
                run.spent["training"] += elapsed
                clock, steps, paused = time.perf_counter(), 0, 0.0
            if run.step % o.eval_interval == 0 or run.step == last_step:
                started = time.perf_counter()
                run.evaluate(save=True)     # the losses, a sample, a checkpoint, the plot
                paused += time.perf_counter() - started
        if run.main:
            run.plot()
        return {"step": run.step, "best_val": run.best_val, "best_step": run.best_step,
                "checkpoint_step": checkpoint_step(run.out) if run.main else None,
                "spent": dict(run.spent)}
    except KeyboardInterrupt as stop:       # (Ctrl-C; SIGTERM as stops.Terminated, which says so)
        raise TrainingError(f"{str(stop) or 'interrupted'} at step {run.step}; "
                            f"{run.checkpoints_said()}") from None
    except WriteError as error:
        raise TrainingError(f"{error}; stopped at step {run.step}, "
                            f"{run.checkpoints_said()}") from None


USER_ERRORS = (ConfigError, DataError, CheckpointError, TrainingError, TokenizerError,
               InteropError, HeadsError, DistributedError, OutFolderError, WriteError,
               SamplingError)


if __name__ == "__main__":      # python -m nanoandrea.train: `nanoandrea train`, by the cli
    import runpy
    sys.argv[1:1] = ["train"]
    runpy.run_module("nanoandrea", run_name="__main__", alter_sys=True)
