"""The command line: `nanoandrea train | sample | prepare | info`.

Errors a user can fix (bad data, an unknown preset, a missing checkpoint, a NaN loss, too little
memory) end in one line and a non-zero exit, never a traceback.
"""
import math
import os
import sys
import time
from pathlib import Path

import click
import numpy as np

from . import __version__
from .stops import sigterm_raises


def _run(action, user_errors=None):
    """Run action(); a user error becomes `Error: <one line>` and exit status 1. user_errors:
    the exceptions that are one (default: every command's, train.USER_ERRORS; a command that
    needs no GPU names its own, as importing train imports numba, about a second)."""
    if user_errors is None:
        from .train import USER_ERRORS as user_errors
    try:
        return action()
    except user_errors as error:
        raise click.ClickException(str(error)) from None
    except KeyboardInterrupt as stop:          # (Ctrl-C; SIGTERM as Terminated, which says so)
        raise click.ClickException(str(stop) or "interrupted") from None


def _echo(message):
    click.echo(message, err=message.startswith("warning"))


@click.group()
@click.version_option(__version__, prog_name="nanoandrea")
def main():
    """nanoandrea: train and sample GPTs whose every GPU kernel is a Numba @cuda.jit kernel."""


def _train_options(f):
    options = [
        click.option("--preset", help="model preset: tiny, andrea-mini, andrea-12m, andrea-120m "
                     "[andrea-12m on a GPU, andrea-mini on the CPU]"),
        click.option("--data", help="a prepared folder, or a corpus (a .txt file, .jsonl, "
                     ".jsonl.gz or parquet files, a folder of them) to prepare and cache "
                     "[the embedded tiny Shakespeare]"),
        click.option("--tokenizer", type=click.Choice(["char", "bpe"]), help="[char]"),
        click.option("--vocab-size", type=int, help="BPE vocabulary size"),
        click.option("--n-layer", type=int, help="override the preset's depth"),
        click.option("--n-head", type=int, help="override the preset's heads"),
        click.option("--n-embd", type=int, help="override the preset's width"),
        click.option("--batch-size", type=int, help="sequences per micro-batch [64]"),
        click.option("--block-size", type=int, help="tokens per sequence [256]"),
        click.option("--grad-accum", type=int, help="micro-batches per step [1]"),
        click.option("--max-steps", type=int, help="length of the schedule [5000]"),
        click.option("--lr", type=float, help="peak learning rate [1e-3]"),
        click.option("--min-lr", type=float, help="final learning rate [1e-4]"),
        click.option("--warmup-steps", type=int, help="linear warmup [100]"),
        click.option("--weight-decay", type=float, help="on the weight matrices only [0.1]"),
        click.option("--beta1", type=float, help="[0.9]"),
        click.option("--beta2", type=float, help="[0.99]"),
        click.option("--grad-clip", type=float, help="global gradient-norm clip, 0 = off [1.0]"),
        click.option("--dropout", type=float, help="[0.2]"),
        click.option("--eval-interval", type=int, help="steps between evaluations [250]"),
        click.option("--eval-iters", type=int, help="batches per evaluation [100]"),
        click.option("--log-interval", type=int, help="steps between log lines [10]"),
        click.option("--seed", type=int, help="[1337]"),
        click.option("--out", type=click.Path(file_okay=False), help="output folder [out]"),
        click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), help="[auto]"),
        click.option("--precision", type=click.Choice(["auto", "fp32", "tf32", "bf16"]),
                     help="the matmuls' (bf16: attention's too): tf32 or bf16 on the tensor "
                          "cores, float32 sums [auto: bf16 on a GPU of compute capability "
                          "8.0+, else fp32]"),
        click.option("--cuda-graph/--no-cuda-graph", default=None,
                     help="GPU: capture the training step as a CUDA graph after the first "
                     "step and replay it [on]"),
        click.option("--stop-at", type=int, help="stop after this step, with a checkpoint "
                     "(continue later with --resume)"),
        click.option("--resume", is_flag=True, help="continue the run in OUT from OUT/ckpt"),
        click.option("--overwrite", is_flag=True, help="start over in an OUT that holds a "
                     "run: delete its ckpt, best, metrics.jsonl, samples.txt and plots (the "
                     "folder's other files stay) [refuse such an OUT]"),
        click.option("--log-heads/--no-log-heads", default=None,
                     help="at each evaluation, each head's share of its layer's attention "
                          "gradient: metrics.jsonl and heads_grad.png [off]"),
        click.option("--gpus", type=click.IntRange(min=1), help="data-parallel over N GPUs of "
                     "this host, one process each (--device cpu: N processes); --batch-size "
                     "is then the batch of all of them together"),
        click.option("--zero1/--no-zero1", default=None, help="several ranks: each keeps "
                     "AdamW's state for its shard of the parameters, then all-gathers them [off]"),
        click.option("--overlap-comm/--no-overlap-comm", default=None, help="several ranks: "
                     "all-reduce each layer's gradients as backward finishes them, inside the "
                     "CUDA graph; off: after the graph [on]"),
        click.option("--rank-timeout", type=click.FloatRange(min=1), help="several ranks: "
                     "seconds a rank may be silent before every rank stops [60]"),
    ]
    for option in reversed(options):
        f = option(f)
    return f


@click.command("train")
@_train_options
def train_command(resume, overwrite, gpus, **given):
    """Train a model (default: andrea-12m on tiny Shakespeare)."""
    from .distributed import DEFAULT_TIMEOUT, start_ranks, world_from_environment
    from .runfolder import check_run_folder
    given = {k: v for k, v in given.items() if v is not None}
    if resume and overwrite:
        raise click.UsageError("--resume continues the run in OUT, --overwrite deletes it: "
                               "give one")
    timeout = given.get("rank_timeout", DEFAULT_TIMEOUT)   # (the launch's, not the run's:
                                                           # a checkpoint does not keep it)
    if gpus is not None:            # this process starts the ranks, and trains on none of them
        if "RANK" in os.environ:
            raise click.UsageError("--gpus starts its own ranks: leave it out under torchrun "
                                   "or mpirun")
        _run(lambda: check_run_folder(given.get("out", "out"), resume, overwrite))
        with sigterm_raises():
            status = start_ranks(gpus, _arguments(train_command, dict(
                given, resume=resume, overwrite=overwrite)), timeout)
        sys.exit(status)
    world = _run(lambda: world_from_environment(timeout))
    if world is None:
        with sigterm_raises():
            _run(lambda: _train(given, resume, overwrite))
        return
    try:
        if given.get("device", "auto") != "cpu" and _gpu_available():
            world.select_device()
        with sigterm_raises():
            _run(lambda: _train(given, resume, overwrite, world))
        world.close()
    except BaseException as error:          # (an error line, and every rank stopped)
        if world.size == 1:
            raise
        world.fail(error.message if isinstance(error, click.ClickException) else
                   f"{type(error).__name__}: {error}")


def _train(given, resume, overwrite, world=None):
    from .runfolder import check_run_folder
    from .train import TrainOptions, resolve_options, train
    if world is None or world.main:     # (train checks again; here a refusal is the only line)
        check_run_folder(given.get("out", TrainOptions.out), resume, overwrite)
    notes = []                  # (said once the settings are known to mean something)
    options = resolve_options(given, resume=resume, report=notes.append)
    check_settings(options)
    for note in notes:
        _echo(note)
    result = train(options, resume=resume, report=_echo, world=world, overwrite=overwrite)
    if world is None or world.main:
        _echo(done_line(result, Path(options.out)))
        _echo(spent_line(result["spent"]))


def _positive(value):
    return 0 < value < math.inf


def _not_negative(value):
    return 0 <= value < math.inf


def _a_fraction(value):
    return 0 <= value < 1


def _at_least_1(value):
    return value is None or value >= 1


# What each training setting means: (the option, whether a value has a meaning, the values
# that do). NaN fails every comparison, so every check here refuses it.
SETTINGS = (
    *((name, _at_least_1, "at least 1") for name in (
        "batch_size", "block_size", "grad_accum", "max_steps", "log_interval", "eval_interval",
        "eval_iters", "stop_at", "n_layer", "n_head", "n_embd")),
    ("lr", _positive, "a positive number (at 0 nothing trains)"),
    ("min_lr", _not_negative, "a number of at least 0"),
    ("warmup_steps", lambda v: v >= 0, "at least 0"),
    ("weight_decay", _not_negative, "a number of at least 0"),
    ("beta1", _a_fraction, "in [0, 1)"),
    ("beta2", _a_fraction, "in [0, 1)"),
    ("grad_clip", _not_negative, "a number of at least 0 (0 turns clipping off)"),
    ("dropout", _a_fraction, "in [0, 1)"),
    ("seed", lambda v: v >= 0, "at least 0"),
)


def check_settings(options):
    """Refuse, before any work, a training setting outside its meaning: a usage error that
    names the option."""
    for name, fits, meaning in SETTINGS:
        value = getattr(options, name)
        if not fits(value):
            raise click.BadParameter(f"must be {meaning}, got {value}",
                                     param_hint=f"'--{name.replace('_', '-')}'")
    if options.min_lr > options.lr:
        raise click.BadParameter(f"{options.min_lr} is above --lr {options.lr}: the schedule "
                                 f"decays from --lr down to --min-lr", param_hint="'--min-lr'")


def done_line(result, out):
    """The line a run ends with: its steps, and the step each of its checkpoints holds."""
    ckpt = ("no checkpoint" if result["checkpoint_step"] is None else
            f"{out / 'ckpt'} (step {result['checkpoint_step']})")
    best = ("no best (no evaluation after step 0)" if result["best_step"] is None else
            f"{out / 'best'} (step {result['best_step']}, val loss {result['best_val']:.4f})")
    return f"done: {result['step']} steps; checkpoints: {ckpt}, {best}"


def spent_line(spent):
    """Where a run's time went (train.Run.spent): its steps, as their log lines time them, and
    its evaluations, part by part."""
    evaluations = spent["losses"] + spent["samples"] + spent["saves"]
    return (f"time: {spent['training']:.1f} s of training steps, {evaluations:.1f} s of "
            f"evaluations (the losses {spent['losses']:.1f} s, samples {spent['samples']:.1f} s, "
            f"checkpoints and plots {spent['saves']:.1f} s)")


def _gpu_available():
    from .kernels.runtime.device import gpu_available
    return gpu_available()


def _arguments(command, values):
    """The command line that gives `command` these option values (a rank's, from --gpus)."""
    arguments = []
    for param in command.params:
        value = values.get(param.name)
        if value is None or not isinstance(param, click.Option):
            continue
        if param.is_flag and param.secondary_opts:          # --x/--no-x
            arguments.append(param.opts[0] if value else param.secondary_opts[0])
        elif param.is_flag:
            arguments += [param.opts[0]] if value else []
        else:
            arguments += [param.opts[0], str(value)]
    return arguments


@click.command("sample")
@click.option("--checkpoint", default="out/ckpt", show_default=True,
              type=click.Path(file_okay=False), help="a checkpoint folder (OUT/ckpt or OUT/best)")
@click.option("--prompt", default="", help="text to continue")
@click.option("--prompt-file", type=click.Path(exists=True, dir_okay=False),
              help="read the prompt from a file")
@click.option("--max-new-tokens", default=500, show_default=True, type=click.IntRange(min=0))
@click.option("--temperature", default=0.8, show_default=True, type=click.FloatRange(min=0),
              callback=lambda ctx, param, value: _finite(value), help="0: the likeliest token")
@click.option("--top-k", default=200, show_default=True, type=click.IntRange(min=1))
@click.option("--num-samples", default=1, show_default=True, type=click.IntRange(min=1))
@click.option("--seed", default=1337, show_default=True, type=click.IntRange(min=0))
@click.option("--device", default="auto", type=click.Choice(["auto", "cuda", "cpu"]))
@click.option("--precision", type=click.Choice(["auto", "fp32", "tf32", "bf16"]),
              help="the matmuls' [on a GPU: the one the checkpoint was trained in]")
@click.option("--kv-cache/--no-kv-cache", default=True, show_default=True,
              help="keep each layer's keys and values: a new token costs O(T), not a forward "
                   "over the context (the same logits either way, to float32's rounding)")
def sample_command(checkpoint, prompt, prompt_file, max_new_tokens, temperature, top_k,
                   num_samples, seed, device, precision, kv_cache):
    """Continue a prompt with a trained model."""
    from .precompile import compile_kernels, for_sampling
    from .sample import TextStream, encode_prompt, generate, load_model

    def action():
        text = prompt
        if prompt_file:
            try:
                text = Path(prompt_file).read_text(encoding="utf-8", errors="replace")
            except OSError as error:
                raise click.ClickException(f"cannot read --prompt-file {prompt_file}: "
                                           f"{error.strerror}") from None
        model, tokenizer = load_model(checkpoint, device, precision)
        compile_kernels(for_sampling(model), report=lambda m: click.echo(m, err=True))
        prompt_ids = encode_prompt(tokenizer, text, model.config.block_size,
                                   report=lambda m: click.echo(m, err=True))
        batch = np.repeat(prompt_ids[None, :], num_samples, axis=0)
        rng = np.random.default_rng(seed)
        started = time.perf_counter()
        first = []                      # when the first new token came (its prefill and the
                                        # decoder's capture are in it)
        block, full = model.config.block_size, []   # when the context filled the block

        def timed(update):
            def progress(ids):
                if not first:
                    first.append(time.perf_counter())
                if kv_cache and not full and ids.shape[1] > block:
                    full.append((block, time.perf_counter() - started,
                                 ids.shape[1] - len(prompt_ids)))
                update(ids)
            return progress
        if num_samples == 1:            # one sample: its text as it comes
            stream = TextStream(tokenizer, lambda piece: click.echo(piece, nl=False))
            stream.update(batch)
            out = generate(model, batch, max_new_tokens, temperature, top_k, rng,
                           progress=timed(stream.update), vocab=tokenizer.vocab_size,
                           kv_cache=kv_cache)
            stream.update(out, final=True)
            click.echo()
        else:
            with click.progressbar(length=max_new_tokens, label="sampling",
                                   file=sys.stderr) as bar:
                out = generate(model, batch, max_new_tokens, temperature, top_k, rng,
                               progress=timed(lambda ids: bar.update(1)),
                               vocab=tokenizer.vocab_size, kv_cache=kv_cache)
            for i, row in enumerate(out):
                click.echo(f"--- sample {i + 1} ---")
                click.echo(tokenizer.decode(row))
        ended = time.perf_counter()
        click.echo(sampling_speed(num_samples, max_new_tokens, ended - started,
                                  first[0] - started if first else None,
                                  full[0] if full else None), err=True)
    _run(action)


def _finite(value):
    if not math.isfinite(value):
        raise click.BadParameter(f"must be a finite number, got {value}")
    return value


def sampling_speed(rows, new_tokens, seconds, first_seconds, full=None):
    """The line sample ends with: all tokens and the time, then the first token's wait (the
    prompt's forward) apart from the rate of the rest, which is what a longer sample runs at.
    full = (block, seconds, cached): when the context filled the block, after `cached` new
    tokens. The tokens after it each run a forward over the whole window (sample.py), at a
    rate of their own, so the line gives the two rates apart."""
    line = f"{rows * new_tokens} tokens in {seconds:.2f} s"
    if first_seconds is None or new_tokens < 2:
        return line + f" ({rows * new_tokens / max(seconds, 1e-9):,.0f} tokens/s)"
    line += f": the first after {first_seconds:.2f} s, then "
    if full is None or full[2] >= new_tokens:
        rest = rows * (new_tokens - 1) / max(seconds - first_seconds, 1e-9)
        return line + f"{rest:,.0f} tokens/s"
    block, full_seconds, cached = full
    past = rows * (new_tokens - cached) / max(seconds - full_seconds, 1e-9)
    past = (f"{past:,.0f} tokens/s past the block of {block} positions (each a forward over "
            f"the whole window)")
    if cached < 2:
        return line + past
    cached_rate = rows * (cached - 1) / max(full_seconds - first_seconds, 1e-9)
    return line + f"{cached_rate:,.0f} tokens/s from the key/value cache, {past}"


@click.command("compile")
@click.option("--preset", default="andrea-12m", show_default=True, help="model preset")
@click.option("--batch-size", default=64, show_default=True, type=click.IntRange(min=1),
              help="sequences per micro-batch of the runs to come")
@click.option("--block-size", type=click.IntRange(min=1), help="tokens per sequence [256, "
              "or the preset's if shorter]")
@click.option("--workers", type=click.IntRange(min=1), help="compiling processes [one a core]")
@click.option("--precision", default="auto", show_default=True,
              type=click.Choice(["auto", "fp32", "tf32", "bf16"]), help="the matmuls' (as train's)")
def compile_command(preset, batch_size, block_size, workers, precision):
    """Compile the kernels a preset's training, evaluation and sampling launch, into the kernel
    cache (ahead of the first run: a container build, a cluster's shared disk)."""
    from .backend import get_backend, resolve_precision
    from .config import get_preset
    from .kernels.runtime import cache
    from .kernels.runtime.device import gpu_available
    from .model import GPT
    from .precompile import compile_kernels, for_training
    from .train import TrainingError

    def action():
        if not gpu_available():
            raise TrainingError("compile: no usable CUDA GPU here (the kernels are compiled "
                                "for the GPU they will run on)")
        config = get_preset(preset)
        config = config.replace(block_size=min(block_size or 256, config.block_size))
        backend = get_backend("cuda", precision=resolve_precision(precision, "cuda"))
        model = GPT(config, backend, seed=None)
        needed = for_training(model, batch_size, config.block_size)
        compiled, _ = compile_kernels(needed, workers, report=_echo)
        if not compiled:
            _echo(f"{preset}: all {len(needed)} kernels are compiled already ({cache.folder()})")
    _run(action)


@click.command("prepare")
@click.argument("source", type=click.Path())
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="folder for the token shards, tokenizer.json and meta.json (docs/data.md)")
@click.option("--tokenizer", default="char", show_default=True, type=click.Choice(["char", "bpe"]))
@click.option("--vocab-size", type=int, help="BPE vocabulary size, the end-of-text token included")
@click.option("--gpt2-files", type=click.Path(file_okay=False),
              help="a folder with GPT-2's vocab.json and merges.txt: use that BPE, do not train one")
@click.option("--text-field", default="text", show_default=True,
              help="the field of a .jsonl line, or the parquet column, that holds the text")
@click.option("--strict", is_flag=True, help="refuse a .jsonl line that is not JSON or lacks "
              "the text field [count and skip it]")
@click.option("--workers", type=click.IntRange(min=1), help="encoding processes [one a core]")
@click.option("--shard-tokens", type=click.IntRange(min=1),
              help="tokens a shard file holds at most [100,000,000]")
def prepare_command(source, out_dir, tokenizer, vocab_size, gpt2_files, text_field, strict,
                    workers, shard_tokens):
    """Tokenize a corpus (a .txt file, .jsonl, .jsonl.gz or parquet files, or a folder of them)
    into train/val token shards."""
    from .data import SHARD_TOKENS, DataError, prepare
    from .tokenizer import TokenizerError

    def action():
        try:
            with sigterm_raises():
                prepare(source, out_dir, tokenizer, vocab_size, report=_echo,
                        gpt2_files=gpt2_files, text_field=text_field, strict=strict,
                        workers=workers, shard_tokens=shard_tokens or SHARD_TOKENS)
        except KeyboardInterrupt as stop:     # (Ctrl-C; SIGTERM as Terminated, which says so)
            raise click.ClickException(f"{str(stop) or 'interrupted'}; {out_dir} was not "
                                       f"written") from None
    _run(action, (DataError, TokenizerError))


@click.command("info")
@click.option("--preset", help="a preset name")
@click.option("--checkpoint", type=click.Path(file_okay=False), help="a checkpoint folder")
@click.option("--vocab-size", type=int, help="override the preset's vocabulary")
def info_command(preset, checkpoint, vocab_size):
    """A configuration and its parameter breakdown."""
    from .checkpoint import read_checkpoint
    from .config import format_breakdown, get_preset

    def action():
        if checkpoint:
            saved = read_checkpoint(checkpoint, optimizer=False)
            config = saved["config"]
            state = saved["state"]
            click.echo(f"checkpoint {checkpoint}: step {state['step']}, " + (
                f"imported from {state['imported_from']}" if state.get("imported_from") else
                f"best val loss {state['best_val']:.4f}"))
        else:
            config = get_preset(preset or "andrea-12m", vocab_size=vocab_size)
            click.echo(f"preset {preset or 'andrea-12m'}")
        for key, value in config.to_dict().items():
            click.echo(f"  {key:12s} {value}")
        click.echo(f"  {'head_size':12s} {config.head_size}")
        click.echo(format_breakdown(config))
    _run(action)


@click.command("export")
@click.option("--checkpoint", required=True, type=click.Path(file_okay=False),
              help="a checkpoint folder (OUT/ckpt or OUT/best)")
@click.option("--to", "target", default="hf", show_default=True, type=click.Choice(["hf"]),
              help="the format: a Hugging Face transformers GPT-2 folder")
@click.argument("out_dir", type=click.Path(file_okay=False))
def export_command(checkpoint, target, out_dir):
    """Write a checkpoint as a folder GPT2LMHeadModel.from_pretrained(OUT_DIR) loads."""
    from .hf import export_hf

    def action():
        note = export_hf(checkpoint, out_dir)
        _echo(f"exported {checkpoint} to {out_dir} (config.json, model.safetensors); {note}")
    _run(action)


@click.command("import")
@click.option("--from-hf", "source", required=True, type=click.Path(file_okay=False),
              help="a local Hugging Face GPT-2 folder (config.json, model.safetensors or "
                   "pytorch_model.bin, vocab.json + merges.txt)")
@click.argument("out_dir", type=click.Path(file_okay=False))
def import_command(source, out_dir):
    """Make a Hugging Face GPT-2 a nanoandrea checkpoint, OUT_DIR/ckpt: for `sample`, and for
    `train --out OUT_DIR --resume --data ...` (fine-tuning, with a fresh optimizer)."""
    from .hf import import_hf

    def action():
        config = import_hf(source, out_dir)
        _echo(f"imported {source} as {out_dir}/ckpt: {config}")
    _run(action)


@click.command("heads")
@click.option("--checkpoint", required=True, type=click.Path(file_okay=False),
              help="a checkpoint folder (OUT/ckpt or OUT/best)")
@click.option("--text", type=click.Path(dir_okay=False),
              help="the text to run the model over [the embedded Shakespeare's val split]")
@click.option("--out", "out_dir", default="heads", show_default=True,
              type=click.Path(file_okay=False), help="where heads.md, .json and .png go")
@click.option("--windows", default=4, show_default=True, type=click.IntRange(min=1),
              help="windows of the block size, evenly through the text")
@click.option("--ablation/--no-ablation", default=True, show_default=True,
              help="also the loss's rise with each head zeroed (a forward per head)")
def heads_command(checkpoint, text, out_dir, windows, ablation):
    """Score every attention head on named patterns (previous token, induction, ...), draw
    their attention maps, and ablate each (nanoandrea/heads.py)."""
    from .heads import heads_report

    def action():
        click.echo(heads_report(checkpoint, out_dir, text, windows, ablation,
                                      report=lambda m: click.echo(m, err=True)))
        click.echo(f"wrote {out_dir}/heads.md, heads.json, heads.png", err=True)
    _run(action)


for command in (train_command, sample_command, prepare_command, info_command, compile_command,
                export_command, import_command, heads_command):
    main.add_command(command)
