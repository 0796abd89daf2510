"""Checkpoints: written atomically, loadable by nanoandrea and (the weights) by GPT-2 tools.

A checkpoint is a folder:
    config.json            the model configuration, and the training options that made it
    tokenizer.json         the tokenizer (docs/tokenizer.md)
    model.safetensors      the weights under GPT-2's names (wte.weight, h.0.attn.c_attn.weight,
                           ...; c_attn is [W_Q | W_K | W_V], c_proj is W_O), float32
    optimizer.safetensors  AdamW's m and v, flat, in the model's parameter order
    state.json             step, best val loss, the random states, the data position

OUT/ckpt and OUT/best are symbolic links to such folders (OUT/.ckpt-<step>-<id>). A new
checkpoint is written in full into a new folder, its files fsync'ed, and then the link is
swapped with one rename, which is atomic: a kill at any moment leaves the previous checkpoint
whole. Folders no link points to are removed afterwards.
"""
import json
import os
import shutil
import uuid
from pathlib import Path

import numpy as np
import safetensors
import safetensors.numpy

from .config import ConfigError, GPTConfig
from .tokenizer import TokenizerError, load_tokenizer, save_tokenizer

FILES = ("config.json", "tokenizer.json", "model.safetensors", "optimizer.safetensors",
         "state.json")


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete or from another configuration."""


# --- safetensors (the `safetensors` package): the weights' format GPT-2 tools read ----------

def save_safetensors(path, tensors, metadata=None):
    """Write tensors ({name: array}) and string metadata to path, fsync'ed."""
    arrays = {name: np.ascontiguousarray(array) for name, array in tensors.items()}
    safetensors.numpy.save_file(arrays, str(path),
                                metadata={k: str(v) for k, v in (metadata or {}).items()})
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


# --- writing and reading --------------------------------------------------------------------------

def _write_json(path, value):
    with open(path, "w") as f:
        json.dump(value, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _fsync_folder(folder):
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(out_dir, links, model, optimizer, tokenizer, train_options, state):
    """Write a checkpoint folder of a training run and point each name in `links` ("ckpt",
    "best") at it."""
    return write_checkpoint_files(out_dir, links, model.config, model.params.state_dict(),
                                  tokenizer, train_options, state, optimizer.moments_to_host(),
                                  optimizer.step_count)


def write_checkpoint_files(out_dir, links, config, params, tokenizer, train_options, state,
                           moments=None, step_count=0):
    """The folder of save_checkpoint from its parts: params by nanoandrea name; moments None
    for a fresh optimizer state (an imported model: its m and v are then empty)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    folder = out_dir / f".ckpt-{state['step']:07d}-{uuid.uuid4().hex[:8]}"
    folder.mkdir()
    _write_json(folder / "config.json", {"model": config.to_dict(), "train": train_options})
    save_tokenizer(tokenizer, folder / "tokenizer.json")
    save_safetensors(folder / "model.safetensors", to_gpt2_names(params, config),
                     {"format": "pt", "producer": "nanoandrea", "step": state["step"]})
    empty = np.zeros(0, np.float32)
    save_safetensors(folder / "optimizer.safetensors",
                     moments if moments is not None else {"m": empty, "v": empty},
                     {"step_count": step_count})
    _write_json(folder / "state.json", state)
    _fsync_folder(folder)
    for name in links:
        temporary = out_dir / f".{name}-{uuid.uuid4().hex[:8]}"
        os.symlink(folder.name, temporary)
        os.replace(temporary, out_dir / name)                  # the atomic switch
    _fsync_folder(out_dir)
    _remove_unlinked(out_dir)
    return out_dir / links[0]


def _remove_unlinked(out_dir):
    kept = {os.readlink(out_dir / name) for name in ("ckpt", "best")
            if (out_dir / name).is_symlink()}
    for folder in out_dir.glob(".ckpt-*"):
        if folder.name not in kept:
            shutil.rmtree(folder, ignore_errors=True)


def read_checkpoint(folder, optimizer=True):
    """{config, train, tokenizer, params (nanoandrea names), m, v, step_count, state};
    optimizer=False: without AdamW's state (m, v: twice the weights' bytes), for sampling."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"no checkpoint at {folder}")
    missing = [name for name in FILES if not (folder / name).is_file()]
    if len(missing) == len(FILES):
        raise CheckpointError(f"{folder} is not a checkpoint folder (no {', '.join(FILES[:3])})")
    if missing:
        raise CheckpointError(f"the checkpoint {folder} is incomplete: {', '.join(missing)} missing")
    try:
        saved = json.loads((folder / "config.json").read_text())
        config = GPTConfig.from_dict(saved["model"])
        state = json.loads((folder / "state.json").read_text())
        tokenizer = load_tokenizer(folder / "tokenizer.json")
    except (ValueError, KeyError, TypeError, ConfigError, TokenizerError) as error:
        raise CheckpointError(f"the checkpoint {folder} is damaged: {error}") from None
    tensors, _ = load_safetensors(folder / "model.safetensors")
    moments, metadata = (load_safetensors(folder / "optimizer.safetensors") if optimizer else
                         ({"m": None, "v": None}, {}))
    return {"config": config, "train": saved.get("train", {}), "tokenizer": tokenizer,
            "params": from_gpt2_names(tensors, config), "m": moments["m"], "v": moments["v"],
            "step_count": int(metadata.get("step_count", 0)), "state": state}
