"""Checkpoints: written atomically, loadable by nanoandrea and (the weights) by GPT-2 tools.

A checkpoint is a folder:
    config.json            the model configuration, and the training options that made it
    tokenizer.json         the tokenizer (docs/tokenizer.md)
    model.safetensors      the weights under GPT-2's names (wte.weight, h.0.attn.c_attn.weight,
                           ...; c_attn is [W_Q | W_K | W_V], c_proj is W_O), float32
    optimizer.safetensors  AdamW's m and v, flat, in the model's parameter order
    state.json             step, best val loss, the random states, the data position

OUT/ckpt and OUT/best are such folders, plain ones (`cp -r OUT/best elsewhere` copies it). A
new checkpoint is written in full into a hidden folder beside them, OUT/.ckpt.tmp-<id>, its
files and the folder fsync'ed; once whole it is renamed OUT/.ckpt.next. Then the switch, three
renames and a deletion: OUT/ckpt -> OUT/.ckpt.prev, OUT/.ckpt.next -> OUT/ckpt, OUT/.ckpt.prev
deleted. A kill at any moment leaves every checkpoint whole under one of these names: a reader
takes .ckpt.next, else .ckpt.prev, where OUT/ckpt is missing (checkpoint_folder), and the next
writer finishes the switch (recover). No file of a checkpoint is changed once written, so
OUT/best, when it is the same step's, holds hard links to ckpt's files rather than a copy.

Runs of the older layout, where ckpt and best were symbolic links to OUT/.ckpt-<step>-<id>,
load and resume as they are; a folder of theirs is deleted once no link points at it.
"""
import json
import os
import shutil
from pathlib import Path

import numpy as np
import safetensors
import safetensors.numpy

from .config import ConfigError, GPTConfig
from .files import fsync_folder, new_folder, remove, shareable
from .params import parameter_layout
from .tokenizer import TokenizerError, load_tokenizer, save_tokenizer

FILES = ("config.json", "tokenizer.json", "model.safetensors", "optimizer.safetensors",
         "state.json")
NAMES = ("ckpt", "best")


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete or from another configuration."""


# --- safetensors (the `safetensors` package): the weights' format GPT-2 tools read ----------

def save_safetensors(path, tensors, metadata=None):
    """Write tensors ({name: array}) and string metadata to path, fsync'ed, with the mode the
    umask gives a new file (the package makes it owner-only)."""
    arrays = {name: np.ascontiguousarray(array) for name, array in tensors.items()}
    safetensors.numpy.save_file(arrays, str(path),
                                metadata={k: str(v) for k, v in (metadata or {}).items()})
    shareable(path)
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def load_safetensors(path):
    """(tensors, metadata) from a .safetensors file."""
    try:
        with safetensors.safe_open(str(path), framework="numpy") as f:
            return {name: f.get_tensor(name) for name in f.keys()}, f.metadata() or {}
    except (OSError, safetensors.SafetensorError) as error:
        raise CheckpointError(f"{path} is not a safetensors file ({error})") from None


# --- GPT-2 names --------------------------------------------------------------------------------

def to_gpt2_names(state, config):
    """nanoandrea's parameters -> GPT-2's tensors (fusing W_Q, W_K, W_V into c_attn)."""
    out = {"wte.weight": state["wte"], "wpe.weight": state["wpe"],
           "ln_f.weight": state["ln_f.weight"], "ln_f.bias": state["ln_f.bias"]}
    for i in range(config.n_layer):
        h = f"h.{i}."
        out[h + "attn.c_attn.weight"] = np.concatenate(
            [state[h + f"attn.w_{n}"] for n in "qkv"], axis=1)
        out[h + "attn.c_attn.bias"] = np.concatenate([state[h + f"attn.b_{n}"] for n in "qkv"])
        out[h + "attn.c_proj.weight"] = state[h + "attn.w_o"]
        out[h + "attn.c_proj.bias"] = state[h + "attn.b_o"]
        for name in ("ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight",
                     "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias"):
            out[h + name] = state[h + name]
    return out


def from_gpt2_names(tensors, config):
    """GPT-2's tensors -> nanoandrea's parameters (splitting c_attn into W_Q, W_K, W_V)."""
    C = config.n_embd
    try:
        state = {"wte": tensors["wte.weight"], "wpe": tensors["wpe.weight"],
                 "ln_f.weight": tensors["ln_f.weight"], "ln_f.bias": tensors["ln_f.bias"]}
        for i in range(config.n_layer):
            h = f"h.{i}."
            weight, bias = tensors[h + "attn.c_attn.weight"], tensors[h + "attn.c_attn.bias"]
            for j, n in enumerate("qkv"):
                state[h + f"attn.w_{n}"] = weight[:, j * C:(j + 1) * C]
                state[h + f"attn.b_{n}"] = bias[j * C:(j + 1) * C]
            state[h + "attn.w_o"] = tensors[h + "attn.c_proj.weight"]
            state[h + "attn.b_o"] = tensors[h + "attn.c_proj.bias"]
            for name in ("ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias",
                         "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight",
                         "mlp.c_proj.bias"):
                state[h + name] = tensors[h + name]
    except KeyError as missing:
        raise CheckpointError(f"the weights lack the tensor {missing}") from None
    return state


# --- writing ------------------------------------------------------------------------------------

def _write_json(path, value):
    with open(path, "w") as f:
        json.dump(value, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(out_dir, names, model, optimizer, tokenizer, train_options, state):
    """Write the checkpoint of a training run as each of `names` ("ckpt", "best") in out_dir."""
    return write_checkpoint_files(out_dir, names, model.config, model.params.state_dict(),
                                  tokenizer, train_options, state, optimizer.moments_to_host(),
                                  optimizer.step_count)


def write_checkpoint_files(out_dir, names, config, params, tokenizer, train_options, state,
                           moments=None, step_count=0):
    """save_checkpoint from its parts: params by nanoandrea name; moments None for a fresh
    optimizer state (an imported model: its m and v are then empty). The first name gets the
    files, the others hard links to them; `best` is switched before `ckpt`, so that a kill
    between the two leaves a ckpt whose state names a best no newer than OUT/best."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in names:
        recover(out_dir, name)
    staged = []
    try:
        folder = new_folder(out_dir, f".{names[0]}.tmp-")
        staged.append(folder)
        _write_files(folder, config, params, tokenizer, train_options, state, moments,
                     step_count)
        for name in names[1:]:
            staged.append(_linked_copy(folder, new_folder(out_dir, f".{name}.tmp-")))
        order = sorted(zip(names, staged), key=lambda pair: pair[0] != "best")
        for name, folder in order:
            os.rename(folder, _hidden(out_dir, name, "next"))       # whole: ready to switch
        fsync_folder(out_dir)
        for name, _ in order:
            _switch(out_dir, name)
    except BaseException:
        for folder in staged:
            remove(folder)
        for name in names:          # (a stop inside a switch: it is finished, not undone)
            try:
                recover(out_dir, name)
            except OSError:
                pass
        raise
    _best_as_folder(out_dir)
    _remove_older_layout(out_dir)
    return out_dir / names[0]


def _write_files(folder, config, params, tokenizer, train_options, state, moments, step_count):
    _write_json(folder / "config.json", {"model": config.to_dict(), "train": train_options})
    save_tokenizer(tokenizer, folder / "tokenizer.json")
    save_safetensors(folder / "model.safetensors", to_gpt2_names(params, config),
                     {"format": "pt", "producer": "nanoandrea", "step": state["step"]})
    empty = np.zeros(0, np.float32)
    save_safetensors(folder / "optimizer.safetensors",
                     moments if moments is not None else {"m": empty, "v": empty},
                     {"step_count": step_count})
    _write_json(folder / "state.json", state)
    fsync_folder(folder)


def _linked_copy(source, target):
    """target (an empty folder) given source's files: hard links where the file system has
    them, else copies."""
    for name in FILES:
        try:
            os.link(source / name, target / name)
        except OSError:
            shutil.copyfile(source / name, target / name)
            with open(target / name, "rb+") as f:
                os.fsync(f.fileno())
    fsync_folder(target)
    return target


def _hidden(out_dir, name, kind):
    return out_dir / f".{name}.{kind}"


def _switch(out_dir, name):
    """OUT/.name.next (whole) becomes OUT/name; the one it replaces is deleted."""
    target, previous = out_dir / name, _hidden(out_dir, name, "prev")
    if _exists(target):
        os.rename(target, previous)
    os.rename(_hidden(out_dir, name, "next"), target)
    fsync_folder(out_dir)
    remove(previous)


def recover(out_dir, name):
    """Finish a switch of OUT/name that a kill interrupted, and delete what a kill left:
    .name.tmp-* (never renamed .next: maybe not whole), .name.prev once OUT/name is there,
    .name.deleted (runfolder.start_over's)."""
    out_dir = Path(out_dir)
    target, following = out_dir / name, _hidden(out_dir, name, "next")
    previous = _hidden(out_dir, name, "prev")
    for folder in out_dir.glob(f".{name}.tmp-*"):
        remove(folder)
    remove(_hidden(out_dir, name, "deleted"))
    if following.is_dir():
        if _exists(target):
            remove(previous)
            os.rename(target, previous)
        os.rename(following, target)
        fsync_folder(out_dir)
    elif not _exists(target) and previous.is_dir():
        os.rename(previous, target)
        fsync_folder(out_dir)
    remove(previous)


def _exists(path):
    return path.exists() or path.is_symlink()          # (a link whose folder is gone too)


def _best_as_folder(out_dir):
    """An older run's best, a link to OUT/.ckpt-<step>-<id>, made a plain folder by the same
    switch as a new checkpoint's, once ckpt (switched before it) no longer links there."""
    link = out_dir / "best"
    if not link.is_symlink() or (out_dir / "ckpt").is_symlink():
        return
    target = out_dir / os.readlink(link)
    if target.parent == out_dir and target.name.startswith(".ckpt-") and target.is_dir():
        os.rename(target, _hidden(out_dir, "best", "next"))
        _switch(out_dir, "best")


def _remove_older_layout(out_dir):
    """The older layout's folders (.ckpt-<step>-<id>) that neither ckpt nor best links to, and
    its links' temporaries (.ckpt-<id>, .best-<id>)."""
    kept = {os.readlink(out_dir / name) for name in NAMES if (out_dir / name).is_symlink()}
    for path in [*out_dir.glob(".ckpt-*"), *out_dir.glob(".best-*")]:
        if path.name not in kept:
            remove(path)


# --- reading -------------------------------------------------------------------------------------

def checkpoint_folder(folder):
    """The folder that holds the checkpoint `folder`: itself, or, while a kill has left its
    switch unfinished, .NAME.next (whole, the newer) or .NAME.prev beside it."""
    folder = Path(folder)
    if folder.exists():
        return folder
    for kind in ("next", "prev"):
        other = folder.with_name(f".{folder.name}.{kind}")
        if other.is_dir():
            return other
    return folder


def read_checkpoint(folder, optimizer=True):
    """{config, train, tokenizer, params (nanoandrea names), m, v, step_count, state};
    optimizer=False: without AdamW's state (m, v: twice the weights' bytes), for sampling.
    A training run may switch the checkpoint while it is read: then it is read again."""
    for _ in range(3):
        found = checkpoint_folder(folder)
        before = _identity(found)
        try:
            saved = _read(found, folder, optimizer)
        except CheckpointError:
            if _identity(checkpoint_folder(folder)) == before:
                raise
            continue
        if _identity(checkpoint_folder(folder)) == before:
            return saved
    raise CheckpointError(f"{folder} changed three times while it was read: read it again")


def _identity(folder):
    try:
        found = os.stat(folder)
    except OSError:
        return None
    return found.st_dev, found.st_ino


def _read(folder, name, optimizer):
    """The checkpoint in `folder`, called `name` in messages."""
    if not folder.is_dir():
        raise CheckpointError(f"no checkpoint at {name}")
    missing = [file for file in FILES if not (folder / file).is_file()]
    if len(missing) == len(FILES):
        raise CheckpointError(f"{name} is not a checkpoint folder (no {', '.join(FILES[:3])})")
    if missing:
        raise CheckpointError(f"the checkpoint {name} is incomplete: {', '.join(missing)} missing")
    try:
        saved = json.loads((folder / "config.json").read_text())
        config = GPTConfig.from_dict(saved["model"])
        state = json.loads((folder / "state.json").read_text())
        if not isinstance(state.get("step"), int) or not isinstance(saved.get("train", {}), dict):
            raise ValueError("state.json has no step, or config.json's train is not a mapping")
        tokenizer = load_tokenizer(folder / "tokenizer.json")
    except (ValueError, KeyError, TypeError, AttributeError, ConfigError,
            TokenizerError) as error:
        raise CheckpointError(f"the checkpoint {name} is damaged: {error}") from None
    tensors, _ = load_safetensors(folder / "model.safetensors")
    params = from_gpt2_names(tensors, config)
    for spec in parameter_layout(config):
        shape = tuple(np.shape(params[spec.name]))
        if shape != tuple(spec.shape):
            raise CheckpointError(f"the checkpoint {name} is damaged: its config.json's model "
                                  f"needs {spec.name} of shape {tuple(spec.shape)}, "
                                  f"model.safetensors holds {shape}")
    moments, metadata = (load_safetensors(folder / "optimizer.safetensors") if optimizer else
                         ({"m": None, "v": None}, {}))
    return {"config": config, "train": saved.get("train", {}), "tokenizer": tokenizer,
            "params": params, "m": moments.get("m"), "v": moments.get("v"),
            "step_count": int(metadata.get("step_count", 0)), "state": state}
