"""Sampling: `python -m nanoandrea.sample` (the same as `nanoandrea sample`).

    prompt ids -> forward -> logits of the last position / temperature -> keep the top k ->
    softmax -> draw the next id -> append -> repeat

With the key/value cache (the default) the prompt runs through the model once and each later
forward takes only the new token: every layer keeps its K and V (KVCache), and the new
token's attention reads them (kernels/kvcache.py), O(T) a token instead of a forward over the
whole context; on the GPU a token's forward is a CUDA graph, replayed (CachedDecoder). The
context is the last block_size tokens: once the text is longer, each new token's window
starts one position later, so every token then runs the whole window again, as without the
cache (the positions of the cached keys would all shift); on the GPU that forward is a CUDA
graph too (WindowDecoder).
"""
from pathlib import Path

import numpy as np

from . import ops
from .autograd import Tensor, no_grad
from .backend import get_backend, resolve_precision
from .batch import TokenBatch
from .checkpoint import read_checkpoint
from .kernels.runtime import launch
from .kernels.runtime.device import gpu_available
from .model import GPT
from .step import GraphedCall


class KVCache:
    """Each layer's keys and values of the tokens so far, [2, B, H, block_size, D]: both
    projections of all heads in one array, as the model's fused projections hold them.
    `length`: the positions filled (the model's forward advances it); `start`, the same on the
    device, and `row`, the position embedding of a lone new token: what `prepare` copies there
    before each forward, so that a captured forward reads them at every replay."""

    def __init__(self, model, batch):
        c = model.config
        self.backend = backend = model.backend
        self.layers = [backend.zeros((2, batch, c.n_head, c.block_size, c.head_size))
                       for _ in range(c.n_layer)]
        self.length = 0
        self.start = backend.to_device(np.zeros(1, np.int32))
        self.row = backend.zeros((1, c.n_embd))

    def prepare(self, wpe, T):
        """Before a forward of T new tokens (outside a captured graph): their first position,
        and for one token its row of the position table wpe [block, C]."""
        self.backend.copy_from_host(self.start, np.array([self.length], np.int32))
        if self.length > 0 and T == 1:
            self.backend.copy(self.row, wpe.data[self.length:self.length + 1])

    def positions(self, wpe, T):
        """The position table as the embedding of T new tokens reads it, from their first row."""
        if self.length == 0:
            return wpe
        return Tensor(self.row if T == 1 else wpe.data[self.length:], self.backend)

    def store(self, layer, k, v):
        """Keep the new tokens' keys and values k, v [B,H,T,D] after the cached ones."""
        self.backend.kv_store(self.layers[layer], k.data, v.data, self.start)

    def attend(self, layer, q, k, v):
        """Store k, v, then the attention of the new tokens' queries q [B,H,T,D] over all the
        cached keys, each causal at its position: [B,T,C], the heads side by side."""
        self.store(layer, k, v)
        B, H, T, D = q.shape
        out = Tensor(self.backend.empty((B, T, H * D)), self.backend)
        self.backend.attention_cached(out.data, q.data, self.layers[layer], self.start)
        return out


class CachedDecoder(GraphedCall):
    """The model's forward against a KVCache: the prompt's (`prefill`), then one new token a
    row at a time (`step`). On the GPU a token's forward is ~12 launches a layer from Python,
    which for a small batch costs more than the GPU's work; so, as the training step does
    (nanoandrea/step.py), a token's first forward runs eagerly, counting the bytes it
    allocates, the second is captured as a CUDA graph, replayed from then on: the new ids, the
    position and its row of the position table are copied into fixed buffers first."""

    def __init__(self, model, batch):
        super().__init__(model.backend, cuda_graph=True)
        self.model = model
        self.cache = KVCache(model, batch)
        self.batch = TokenBatch(self.backend, batch, 1, model.config.vocab_size,
                                with_targets=False, with_grouping=False)
        self.logits = None

    def prefill(self, ids):
        with launch.using_stream(self.launch_stream):
            self.cache.prepare(self.model["wpe"], ids.shape[1])
            logits, _ = self.model.forward(ids, cache=self.cache)
            return logits

    def step(self, next_ids):
        """The logits [B,1,Vp] of next_ids [B], the tokens after the cached ones."""
        with launch.using_stream(self.launch_stream):
            self.cache.prepare(self.model["wpe"], 1)
            self.batch.load(next_ids[:, None])
            length = self.cache.length
            self._run()
            self.cache.length = length + 1      # (the forward advances it as it runs from
            return self.logits                  # Python; a replay runs none)

    def _body(self):
        self.logits, _ = self.model.forward(self.batch, cache=self.cache)


class WindowDecoder(GraphedCall):
    """The forward over a whole window of block_size tokens, which every token takes once the
    text is longer than the block (the window moves on by one, so the cache cannot be kept).
    On the GPU it is ~12 launches a layer from Python for little work each: as the training
    step and CachedDecoder are, it runs eagerly once (counting the bytes it allocates), is
    captured as a CUDA graph at its second call and replayed from then on, the window's ids
    copied into a fixed batch first."""

    def __init__(self, model, batch):
        super().__init__(model.backend, cuda_graph=True)
        self.model = model
        self.batch = TokenBatch(self.backend, batch, model.config.block_size,
                                model.config.vocab_size, with_targets=False,
                                with_grouping=False)
        self.logits = None

    def __call__(self, ids):
        """The logits [B, block_size, Vp] of ids [B, block_size]."""
        with launch.using_stream(self.launch_stream):
            self.batch.load(ids)
            self._run()
        return self.logits

    def _body(self):
        self.logits, _ = self.model.forward(self.batch)


def generate(model, ids, max_new_tokens, temperature=1.0, top_k=None, rng=None, progress=None,
             vocab=None, kv_cache=True):
    """ids: int array [B, T0] -> [B, T0 + max_new_tokens]. temperature 0 means greedy.
    progress(ids): called with the ids so far after each new token. vocab: draw only ids below
    it (the tokenizer's; an imported GPT-2's "<|endoftext|>" lies beyond its byte-level BPE).
    kv_cache: keep the keys and values (the module's doc); False runs the whole window for
    every token. Both give the same tokens on the CPU; on the GPU the same logits to float32's
    rounding (a cached token's products, matvec.py, sum in another order than the full
    forward's tiles), so a draw that falls at a boundary between two tokens may differ. The
    weights do not change during the call: each is made the products' operand once
    (ops.fixed_weights: in tf32 rounded once, not at every token; in bf16 the parameter
    store's copies, which AdamW keeps), and the decoder's graph reads those copies."""
    rng = rng or np.random.default_rng()
    ids = np.array(ids, dtype=np.int64)
    block = model.config.block_size
    with no_grad(), ops.fixed_weights(model.params.matrices()):
        decoder = CachedDecoder(model, ids.shape[0]) if kv_cache else None
        window = None
        for _ in range(max_new_tokens):
            if decoder is not None and decoder.cache.length == 0:
                logits = decoder.prefill(ids[:, -block:])
            elif decoder is not None and decoder.cache.length < block:
                logits = decoder.step(ids[:, -1])
            elif ids.shape[1] >= block:         # (the window is full: it moves on each token)
                decoder = None
                if window is None:
                    window = WindowDecoder(model, ids.shape[0])
                logits = window(ids[:, -block:])
            else:
                logits, _ = model.forward(ids)
            last = last_logits(model.backend, logits.data).astype(np.float64)   # [B, Vp]
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


def last_logits(backend, logits):
    """logits [B,T,Vp] -> the last position's [B,Vp] on the host: one copy for a cached token
    (T = 1, contiguous), else one a row (the last position's rows are strided)."""
    B, T, Vp = logits.shape
    if T == 1:
        return backend.to_host(logits.reshape(B, Vp))
    return np.stack([backend.to_host(logits[b, -1]) for b in range(B)])


class SamplingError(ValueError):
    """sample cannot run as asked (no GPU for --device cuda); the message says what to do."""


def load_model(checkpoint, device="auto", precision=None):
    """(model, tokenizer) from a checkpoint folder, its matmuls in `precision` (None: the
    precision it was trained in, on a GPU; fp32 on the CPU)."""
    name = "cuda" if device == "cuda" else "numpy" if device == "cpu" else "auto"
    if name == "auto":
        name = "cuda" if gpu_available() else "numpy"
    elif name == "cuda" and not (gpu_available() or launch.SIMULATOR):
        raise SamplingError("--device cuda: no usable CUDA GPU here (try --device cpu)")
    saved = read_checkpoint(Path(checkpoint), optimizer=False)
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


if __name__ == "__main__":      # python -m nanoandrea.sample: `nanoandrea sample`, by the cli
    import runpy
    import sys
    sys.argv[1:1] = ["sample"]
    runpy.run_module("nanoandrea", run_name="__main__", alter_sys=True)

