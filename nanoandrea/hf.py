"""Hugging Face interop: a checkpoint as a `transformers` GPT-2 folder, and back.

    export_hf(checkpoint, out)    a folder GPT2LMHeadModel.from_pretrained(out) loads as it is
    import_hf(folder, out)        a GPT-2 folder (config.json + model.safetensors, or
                                  pytorch_model.bin with torch) as a nanoandrea checkpoint

The weights are the same tensors under the same names: nanoandrea's checkpoints already hold
GPT-2's (c_attn = [W_Q | W_K | W_V], each [in, out] as GPT-2's Conv1D stores them; c_proj =
W_O). What differs is the folder around them:
    config.json    GPT-2's keys (n_embd, n_layer, n_head, n_positions, vocab_size, gelu_new,
                   layer_norm_epsilon 1e-5, tied embeddings), model_type "gpt2"
    tokenizer      a BPE tokenizer as GPT-2's vocab.json + merges.txt (byte-level, GPT-2's byte
                   order), which transformers' GPT2Tokenizer reads. A char tokenizer has no
                   GPT-2 equivalent: its ids are written as char_vocab.json ({character: id})
                   for a reader to map text by hand, and no tokenizer class is configured.
    nanoandrea_tokenizer.json   nanoandrea's own tokenizer file (tokenizer.json is
                   transformers' fast-tokenizer name), so that an exported folder imports
                   back with its tokenizer whatever its kind
GPT-2's vocabulary has 50257 entries, the last "<|endoftext|>", which nanoandrea's byte-level
BPE does not encode or decode: an imported model keeps all 50257 rows (its logits equal the
original's) and sampling never draws the ids its tokenizer cannot decode.
"""
import contextlib
import json
import os
import shutil
from pathlib import Path

import numpy as np

from .checkpoint import (CheckpointError, from_gpt2_names, load_safetensors, read_checkpoint,
                         save_safetensors, to_gpt2_names, write_checkpoint_files)
from .params import parameter_layout
from .config import ConfigError, GPTConfig
from .files import new_folder, reason, unwritable
from .tokenizer import BPETokenizer, TokenizerError, load_tokenizer, save_tokenizer

ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")     # GELU's tanh form, nanoandrea's
OWN_TOKENIZER = "nanoandrea_tokenizer.json"
LAYER_NORM_EPSILON = 1e-5


class InteropError(ValueError):
    """A folder that cannot be exported or imported; the message names what and why."""


def hf_config(config, tokenizer):
    """GPT-2's config.json for a nanoandrea model."""
    end_of_text = config.vocab_size - 1 if config.vocab_size == 50257 else None
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": config.vocab_size, "n_positions": config.block_size,
        "n_embd": config.n_embd, "n_layer": config.n_layer, "n_head": config.n_head,
        "n_inner": None, "activation_function": "gelu_new",
        "resid_pdrop": config.dropout, "embd_pdrop": config.dropout,
        "attn_pdrop": config.dropout, "layer_norm_epsilon": LAYER_NORM_EPSILON,
        "initializer_range": 0.02, "scale_attn_weights": True, "use_cache": True,
        "tie_word_embeddings": True, "bos_token_id": end_of_text, "eos_token_id": end_of_text,
        "torch_dtype": "float32",
        **({"tokenizer_class": "GPT2Tokenizer"} if isinstance(tokenizer, BPETokenizer) else {}),
    }


def export_hf(checkpoint, out):
    """Write checkpoint (a folder) as a Hugging Face GPT-2 folder `out`, made whole in a
    temporary folder beside it and then renamed. Returns a line saying what the tokenizer
    export holds."""
    out = Path(out)
    _check_new_folder(out)
    saved = read_checkpoint(checkpoint, optimizer=False)
    config, tokenizer = saved["config"], saved["tokenizer"]
    with _new_folder_in_place_of(out) as staging:
        (staging / "config.json").write_text(json.dumps(hf_config(config, tokenizer), indent=1))
        save_safetensors(staging / "model.safetensors",
                         to_gpt2_names(saved["params"], config), {"format": "pt"})
        save_tokenizer(tokenizer, staging / OWN_TOKENIZER)
        if isinstance(tokenizer, BPETokenizer):
            tokenizer.to_gpt2_files(staging)
            note = "tokenizer: vocab.json + merges.txt (GPT2Tokenizer)"
        else:
            chars = {c: i for i, c in enumerate(tokenizer.chars)}
            (staging / "char_vocab.json").write_text(json.dumps(chars, ensure_ascii=False,
                                                                indent=1))
            note = ("tokenizer: a char tokenizer has no transformers class; its ids are in "
                    "char_vocab.json (the model loads without a tokenizer)")
    return note


def _check_new_folder(out):
    """Refuse, before any work, an `out` that is not new or empty, or cannot be written."""
    if out.exists() and any(out.iterdir()):
        raise InteropError(f"{out} exists and is not empty: choose a new folder")
    problem = unwritable(out.parent)
    if problem:
        raise InteropError(f"cannot write {out}: {problem}")


@contextlib.contextmanager
def _new_folder_in_place_of(out):
    """A folder made whole beside `out` (_check_new_folder's), renamed `out` when the block
    ends; an error or a stop deletes it, and a write that fails (read-only, full) is one
    line."""
    staging = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = new_folder(out.parent, f".{out.name}.tmp-")
        yield staging
        if out.exists():
            out.rmdir()
        os.rename(staging, out)
    except OSError as error:
        raise InteropError(f"cannot write {out}: {reason(error)}; nothing was written") from None
    finally:
        if staging is not None and staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def read_hf_folder(folder):
    """(GPTConfig, GPT-2 tensors by name, tokenizer) of a Hugging Face GPT-2 folder."""
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise InteropError(f"{folder} is not a Hugging Face model folder (no config.json)")
    try:
        hf = json.loads(config_path.read_text())
    except ValueError as error:
        raise InteropError(f"{config_path} is not JSON: {error}") from None
    if hf.get("model_type") != "gpt2":
        raise InteropError(f"{folder} holds a {hf.get('model_type')!r} model, not GPT-2 "
                           f"(model_type must be \"gpt2\")")
    checks = [("activation_function", hf.get("activation_function", "gelu_new") in ACTIVATIONS),
              ("n_inner", hf.get("n_inner") in (None, 4 * hf.get("n_embd", 0))),
              ("layer_norm_epsilon", abs(hf.get("layer_norm_epsilon", 1e-5) - 1e-5) < 1e-12),
              ("tie_word_embeddings", hf.get("tie_word_embeddings", True)),
              ("scale_attn_by_inverse_layer_idx", not hf.get("scale_attn_by_inverse_layer_idx")),
              ("reorder_and_upcast_attn", not hf.get("reorder_and_upcast_attn"))]
    for key, fits in checks:
        if not fits:
            raise InteropError(f"{config_path}: {key}={hf.get(key)!r} is not the GPT-2 "
                               f"nanoandrea runs (gelu_new, n_inner 4 n_embd, layer norm 1e-5, "
                               f"tied embeddings)")
    try:
        config = GPTConfig(n_layer=hf["n_layer"], n_head=hf["n_head"], n_embd=hf["n_embd"],
                           block_size=hf["n_positions"], vocab_size=hf["vocab_size"],
                           dropout=float(hf.get("resid_pdrop", 0.0))).validate()
    except (KeyError, TypeError) as error:
        raise InteropError(f"{config_path} lacks {error}") from None
    except ConfigError as error:
        raise InteropError(f"{config_path}: {error}") from None
    return config, _hf_tensors(folder), _hf_tokenizer(folder)


def _hf_tensors(folder):
    if (folder / "model.safetensors").is_file():
        tensors, _ = load_safetensors(folder / "model.safetensors")
    elif (folder / "pytorch_model.bin").is_file():
        try:
            import torch
        except ImportError:
            raise InteropError(f"{folder} holds pytorch_model.bin, which needs torch to read "
                               f"(pip install torch), or convert it to model.safetensors") from None
        state = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
        tensors = {name: value.float().numpy() for name, value in state.items()}
    else:
        raise InteropError(f"{folder} has no weights (model.safetensors or pytorch_model.bin)")
    out = {}
    for name, value in tensors.items():     # (transformers' own saves prefix "transformer.")
        name = name.removeprefix("transformer.")
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            continue                        # (old GPT-2 files keep the causal mask as a tensor)
        out[name] = np.asarray(value, dtype=np.float32)
    lm_head = out.pop("lm_head.weight", None)
    if lm_head is not None and "wte.weight" in out and not np.array_equal(lm_head, out["wte.weight"]):
        raise InteropError("lm_head.weight differs from wte.weight: nanoandrea ties them")
    return out


def _hf_tokenizer(folder):
    if (folder / OWN_TOKENIZER).is_file():           # from an export
        try:
            return load_tokenizer(folder / OWN_TOKENIZER)
        except TokenizerError as error:
            raise InteropError(f"{folder / OWN_TOKENIZER}: {error}") from None
    files = [folder / "vocab.json", folder / "merges.txt"]
    if all(f.is_file() for f in files):
        try:
            return BPETokenizer.from_gpt2_files(*files)
        except TokenizerError as error:
            raise InteropError(f"{folder}: {error}") from None
    raise InteropError(f"{folder} has no tokenizer nanoandrea reads (vocab.json + merges.txt, "
                       f"or a nanoandrea tokenizer.json)")


def import_hf(folder, out):
    """A Hugging Face GPT-2 folder as the checkpoint OUT/ckpt (also OUT/best), with a fresh
    optimizer state: `sample --checkpoint OUT/ckpt` and `train --out OUT --resume` (fine-
    tuning) take it. OUT must be new or empty, as export's. Returns the model's config."""
    out = Path(out)
    _check_new_folder(out)
    config, tensors, tokenizer = read_hf_folder(folder)
    if tokenizer.vocab_size > config.vocab_size:
        raise InteropError(f"{folder}: the tokenizer has {tokenizer.vocab_size} tokens, the "
                           f"model's vocabulary {config.vocab_size}")
    try:
        params = from_gpt2_names(tensors, config)
    except CheckpointError as error:
        raise InteropError(f"{folder}: {error}") from None
    for spec in parameter_layout(config):
        shape = tuple(params[spec.name].shape)
        if shape != tuple(spec.shape):
            raise InteropError(f"{folder}: {gpt2_name(spec.name)} has shape {shape}, the "
                               f"config needs {tuple(spec.shape)}")
    train_options = {"preset": "andrea-120m", "n_layer": config.n_layer,
                     "n_head": config.n_head, "n_embd": config.n_embd,
                     "block_size": config.block_size, "model_vocab": config.vocab_size,
                     "dropout": config.dropout, "tokenizer": tokenizer.kind,
                     "imported_from": str(Path(folder).resolve())}
    state = {"step": 0, "imported_from": str(Path(folder).resolve())}
    with _new_folder_in_place_of(out) as staging:
        write_checkpoint_files(staging, ["ckpt", "best"], config, params, tokenizer,
                               train_options, state)
    return config


def gpt2_name(name):
    """GPT-2's name of the tensor that holds nanoandrea's parameter `name`."""
    for n in "qkv":
        name = name.replace(f"attn.w_{n}", "attn.c_attn.weight").replace(f"attn.b_{n}",
                                                                          "attn.c_attn.bias")
    name = name.replace("attn.w_o", "attn.c_proj.weight").replace("attn.b_o", "attn.c_proj.bias")
    return {"wte": "wte.weight", "wpe": "wpe.weight"}.get(name, name)
