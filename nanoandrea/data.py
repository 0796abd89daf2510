"""Data: read a corpus, tokenize it into train/val token files, and draw training batches.

A prepared data folder holds
    train.bin, val.bin   the token ids, uint16 (uint32 when the vocabulary needs it), read
                         through numpy.memmap so a corpus larger than memory is fine
    tokenizer.json       the tokenizer that made them (docs/tokenizer.md)
    meta.json            dtype, token counts, tokenizer kind, the source's fingerprint
`resolve_data` accepts either such a folder or raw text (a .txt file or a folder of them), which
it prepares once into a cache folder keyed by the source's contents and the tokenizer settings.
"""
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import click
import numpy as np

from .tokenizer import BPETokenizer, load_tokenizer, save_tokenizer, train_tokenizer

DEFAULT_CORPUS = Path(__file__).parent / "data" / "tinyshakespeare.txt"
VAL_FRACTION = 0.1


class DataError(ValueError):
    """Bad data input; the message is one line a user can act on."""


def read_corpus(source, report=print):
    """The text of a .txt file, or of every .txt file in a folder (sorted, joined by newlines).

    Bytes that are not UTF-8 are decoded as U+FFFD and reported, not fatal."""
    source = Path(source)
    if not source.exists():
        raise DataError(f"data not found: {source}")
    if source.is_dir():
        files = sorted(p for p in source.rglob("*.txt") if p.is_file())
        if not files:
            raise DataError(f"no .txt files in the folder {source}")
    else:
        files = [source]
    texts = []
    for path in files:
        raw = path.read_bytes()
        text = raw.decode("utf-8", errors="replace")
        bad = text.count("\ufffd") - raw.decode("utf-8", errors="ignore").count("\ufffd")
        if bad:
            report(f"warning: {path}: {bad} byte sequence(s) that are not UTF-8 were replaced by U+FFFD")
        texts.append(text)
    text = "\n".join(texts)
    if not text.strip():
        raise DataError(f"the data is empty: {source}")
    return text


def _fingerprint(source, tokenizer_kind, vocab_size):
    digest = hashlib.sha256(f"{tokenizer_kind}:{vocab_size}:".encode())
    source = Path(source)
    for path in ([source] if source.is_file() else sorted(source.rglob("*.txt"))):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def prepare(source, out_dir, tokenizer_kind="char", vocab_size=None, report=print,
            gpt2_files=None):
    """Tokenize a text file or folder into out_dir (written to a temporary folder, then renamed).

    The tokenizer is trained on the text, or, with gpt2_files (a folder holding GPT-2's
    vocab.json and merges.txt), loaded from those files."""
    text = read_corpus(source, report)
    out_dir = Path(out_dir)
    if gpt2_files is not None:
        files = [Path(gpt2_files) / name for name in ("vocab.json", "merges.txt")]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise DataError(f"GPT-2 tokenizer files not found: {', '.join(missing)}")
        tokenizer = BPETokenizer.from_gpt2_files(*files)
        tokenizer_kind = f"bpe from {gpt2_files}"
    report(f"preparing {source} -> {out_dir} ({len(text):,} characters, {tokenizer_kind} tokenizer)")
    if gpt2_files is None:
        with click.progressbar(length=100, label="training the tokenizer", file=sys.stderr) as bar:
            tokenizer = train_tokenizer(tokenizer_kind, text, vocab_size,
                                        progress=lambda done, total: bar.update(
                                            int(100 * done / max(total, 1)) - bar.pos))
    dtype = np.uint16 if tokenizer.vocab_size <= 2 ** 16 else np.uint32
    split = int(len(text) * (1 - VAL_FRACTION))
    parts = {"train": text[:split], "val": text[split:]}
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
    counts = {}
    with click.progressbar(parts.items(), label="tokenizing", file=sys.stderr) as bar:
        for name, part in bar:
            ids = getattr(tokenizer, "encode_fast", tokenizer.encode)(part)
            ids.astype(dtype).tofile(staging / f"{name}.bin")
            counts[name] = int(ids.size)
    save_tokenizer(tokenizer, staging / "tokenizer.json")
    meta = {"dtype": np.dtype(dtype).name, "tokens": counts, "tokenizer": tokenizer.kind,
            "vocab_size": tokenizer.vocab_size, "source": str(source),
            "fingerprint": _fingerprint(source, tokenizer_kind, vocab_size)}
    (staging / "meta.json").write_text(json.dumps(meta, indent=1))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(staging, out_dir)
    report(f"prepared {counts['train']:,} train and {counts['val']:,} val tokens, "
           f"vocabulary {tokenizer.vocab_size}")
    return out_dir


def is_prepared(folder):
    return (Path(folder) / "meta.json").is_file()


def resolve_data(data, tokenizer_kind="char", vocab_size=None, cache_dir=None, report=print):
    """A prepared folder for `data` (default: the embedded tiny Shakespeare)."""
    data = Path(data) if data else DEFAULT_CORPUS
    if data.is_dir() and is_prepared(data):
        return data
    if not data.exists():
        raise DataError(f"data not found: {data}")
    key = _fingerprint(data, tokenizer_kind, vocab_size)
    cache_dir = cache_dir or os.environ.get("NANOANDREA_CACHE") or Path.home() / ".cache" / "nanoandrea"
    cache = Path(cache_dir) / f"{data.stem}-{tokenizer_kind}-{key}"
    if is_prepared(cache):
        return cache
    return prepare(data, cache, tokenizer_kind, vocab_size, report)


class Dataset:
    """The token files of a prepared folder, and the tokenizer that made them."""

    def __init__(self, folder):
        folder = Path(folder)
        if not is_prepared(folder):
            raise DataError(f"{folder} is not a prepared data folder (no meta.json)")
        self.folder = folder
        self.meta = json.loads((folder / "meta.json").read_text())
        self.tokenizer = load_tokenizer(folder / "tokenizer.json")
        dtype = np.dtype(self.meta["dtype"])
        self.splits = {name: np.memmap(folder / f"{name}.bin", dtype=dtype, mode="r")
                       for name in ("train", "val")}

    @property
    def vocab_size(self):
        return self.tokenizer.vocab_size

    def check_block_size(self, block_size):
        for name, tokens in self.splits.items():
            if len(tokens) < block_size + 1:
                raise DataError(f"the {name} split has {len(tokens)} tokens, fewer than one block "
                                f"of {block_size} + 1: use more text or a smaller --block-size")


class BatchSampler:
    """Random windows of T+1 tokens (inputs and next-token targets), nanoGPT style.

    Its random state is part of the checkpoint, so a resumed run draws the same batches.
    shard=(rank, ranks): every rank draws the same batch_size starts and reads its own
    batch_size / ranks of them (data-parallel training: the ranks' shards are one batch)."""

    def __init__(self, tokens, batch_size, block_size, seed, shard=(0, 1)):
        self.tokens = tokens
        self.batch_size = batch_size
        self.shard = shard
        self.block_size = block_size
        self.rng = np.random.default_rng(seed)
        self.drawn = 0

    def next(self):
        starts = self.rng.integers(0, len(self.tokens) - self.block_size, size=self.batch_size)
        rank, ranks = self.shard
        rows = self.batch_size // ranks
        starts = starts[rank * rows:(rank + 1) * rows]
        window = np.stack([np.asarray(self.tokens[s:s + self.block_size + 1]) for s in starts])
        self.drawn += 1
        window = window.astype(np.int32)
        return window[:, :-1], window[:, 1:]

    def state(self):
        return {"rng": self.rng.bit_generator.state, "drawn": self.drawn}

    def load_state(self, state):
        self.rng.bit_generator.state = state["rng"]
        self.drawn = state["drawn"]
