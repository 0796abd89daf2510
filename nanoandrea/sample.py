"""Sampling: `python -m nanoandrea.sample` (the same as `nanoandrea sample`).

    prompt ids -> forward -> logits of the last position / temperature -> keep the top k ->
    softmax -> draw the next id -> append -> repeat

The context is the last block_size tokens (no KV cache yet: each new token runs the whole
window through the model).
"""
from pathlib import Path

import numpy as np

from .autograd import no_grad
from .backend import get_backend, resolve_precision
from .kernels.launch import gpu_available
from .checkpoint import read_checkpoint
from .model import GPT


def generate(model, ids, max_new_tokens, temperature=1.0, top_k=None, rng=None, progress=None,
             vocab=None):
    """ids: int array [B, T0] -> [B, T0 + max_new_tokens]. temperature 0 means greedy.
    progress(ids): called with the ids so far after each new token. vocab: draw only ids below
    it (the tokenizer's; an imported GPT-2's "<|endoftext|>" lies beyond its byte-level BPE)."""
    rng = rng or np.random.default_rng()
    ids = np.array(ids, dtype=np.int64)
    block = model.config.block_size
    with no_grad():
        for _ in range(max_new_tokens):
            context = ids[:, -block:]
            logits, _ = model.forward(context)
            last = np.stack([model.backend.to_host(logits.data[b, -1])           # [B, Vp]
                             for b in range(ids.shape[0])]).astype(np.float64)
            last = last[:, :min(model.config.vocab_size, vocab or model.config.vocab_size)]
            if temperature <= 0:
                next_ids = last.argmax(axis=-1)
            else:
                last = last / temperature
                if top_k is not None and top_k < last.shape[-1]:
                    kth = np.partition(last, -top_k, axis=-1)[:, -top_k][:, None]
                    last = np.where(last < kth, -np.inf, last)
                probs = np.exp(last - last.max(axis=-1, keepdims=True))
                probs /= probs.sum(axis=-1, keepdims=True)
                next_ids = np.array([rng.choice(len(p), p=p) for p in probs])
            ids = np.concatenate([ids, next_ids[:, None]], axis=1)
            if progress:
                progress(ids)
    return ids


def load_model(checkpoint, device="auto", precision=None):
    """(model, tokenizer) from a checkpoint folder, its matmuls in `precision` (None: the
    precision it was trained in, on a GPU; fp32 on the CPU)."""
    saved = read_checkpoint(Path(checkpoint), optimizer=False)
    name = "cuda" if device == "cuda" else "numpy" if device == "cpu" else "auto"
    if name == "auto":
        name = "cuda" if gpu_available() else "numpy"
    if precision is None:
        precision = saved["train"].get("precision", "fp32") if name == "cuda" else "fp32"
    backend = get_backend(name, precision=resolve_precision(precision, name))
    model = GPT(saved["config"], backend, seed=None)
    model.params.load_state_dict(saved["params"])
    return model, saved["tokenizer"]


def encode_prompt(tokenizer, text, block_size, report=print):
    known = getattr(tokenizer, "id_of_char", None)      # a char tokenizer: its characters
    if text and known is not None and any(c not in known for c in text):
        unknown = sorted(set(c for c in text if c not in known))
        report(f"the prompt's characters {''.join(unknown)!r} are not in the model's "
               f"vocabulary: left out")
        text = "".join(c for c in text if c in known)
    ids = tokenizer.encode(text) if text else np.zeros(0, dtype=np.int64)
    if ids.size == 0:                               # start from a newline, as a text would
        try:
            ids = tokenizer.encode("\n")
        except ValueError:
            ids = np.zeros(1, dtype=np.int64)
    if ids.size > block_size:
        report(f"the prompt has {ids.size} tokens, more than the block size {block_size}: "
               f"keeping its last {block_size}")
        ids = ids[-block_size:]
    return ids


class TextStream:
    """Prints a sample's text as its tokens come: what decoding all of them adds to what is
    printed (a byte-level BPE token may end inside a multi-byte character: that character waits
    for the token that completes it)."""
    def __init__(self, tokenizer, write):
        self.tokenizer, self.write, self.printed = tokenizer, write, ""

    def update(self, ids, final=False):
        text = self.tokenizer.decode(ids[0])
        if not final:
            text = text.rstrip("\ufffd")
        if text.startswith(self.printed) and len(text) > len(self.printed):
            self.write(text[len(self.printed):])
            self.printed = text


def main():
    from .cli import sample_command
    sample_command(prog_name="python -m nanoandrea.sample")


if __name__ == "__main__":
    main()

