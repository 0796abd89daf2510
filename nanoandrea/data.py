"""Data: tokenize a corpus into train/val token shards, and draw training batches.

    corpus (nanoandrea.corpus: .txt, .jsonl, .jsonl.gz, parquet) -> segments, a few MB at a time
      -> worker processes encode them (tiktoken for a BPE: the reference's ids)
      -> each document's ids, its end-of-text token last, go to train or val shard files

A prepared data folder (docs/data.md) holds
    train-00000.bin ...   the token ids, uint16 (uint32 when the vocabulary needs it), at most
    val-00000.bin ...     SHARD_TOKENS a file, read through numpy.memmap
    tokenizer.json        the tokenizer that made them (docs/tokenizer.md)
    meta.json             the index: each split's shards and token counts, the dtype, the
                          tokenizer's kind and end-of-text id, the source and its fingerprint
It is written in a temporary folder beside DIR and renamed to DIR when complete, so an
interrupted `prepare` leaves no folder that `train --data DIR` could take for a prepared one.
DIR is replaced whole, so it must be new, empty, or a dataset an earlier prepare made and
nothing else: prepare refuses its own corpus, a folder that holds it, the current folder, and
a folder of other files (check_destination).
The val split is held-out documents: a document goes to val when val holds less than
VAL_FRACTION of the tokens so far. A corpus of one document (a .txt file, as tiny Shakespeare)
keeps its last VAL_FRACTION of characters for val instead.

`resolve_data` accepts either such a folder or a corpus, which it prepares once into a cache
folder keyed by the corpus's contents and the tokenizer settings.
"""
import errno
import hashlib
import json
import multiprocessing
import os
import re
import shutil
import signal
import socket
import sys
import threading
import time
from collections import deque
from pathlib import Path

import click
import numpy as np

from .corpus import VAL_FRACTION, Corpus, DataError, corpus_files
from .files import new_folder, reason, unwritable
from .tokenizer import BPETokenizer, load_tokenizer, save_tokenizer, train_tokenizer

DEFAULT_CORPUS = Path(__file__).parent / "data" / "tinyshakespeare.txt"
SHARD_TOKENS = 100_000_000       # tokens a shard file holds at most (200 MB in uint16)
TASK_CHARACTERS = 1 << 22        # text a worker encodes at a time
SAMPLE_CHARACTERS = 32_000_000   # what a BPE is trained on: a sample of a larger corpus
LAYOUT = 2                       # meta.json's "version": 2 is the sharded layout

def _fingerprint(source, tokenizer_kind, vocab_size):
    digest = hashlib.sha256(f"{LAYOUT}:{tokenizer_kind}:{vocab_size}:".encode())
    for path, _ in corpus_files(source):
        with open(path, "rb") as file:
            while block := file.read(1 << 20):
                digest.update(block)
    return digest.hexdigest()[:16]


def _load_gpt2(gpt2_files):
    files = [Path(gpt2_files) / name for name in ("vocab.json", "merges.txt")]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise DataError(f"GPT-2 tokenizer files not found: {', '.join(missing)}")
    return BPETokenizer.from_gpt2_files(*files)


def _train(corpus, kind, vocab_size, report):
    """A char tokenizer from every character of the corpus (a pass over it) and the newline
    that ends its documents; a BPE with an end-of-text token from a sample of the corpus."""
    if kind == "char":
        characters = {"\n"}
        for text, _, _ in corpus.segments():
            characters.update(text)
        corpus.rewind()
        return train_tokenizer("char", "".join(characters))
    sample = "\n".join(corpus.sample(SAMPLE_CHARACTERS))
    report(f"training a {vocab_size}-token BPE on {len(sample) / 1e6:,.1f}M characters"
           f"{' sampled from the corpus' if corpus.total_bytes > SAMPLE_CHARACTERS else ''}")
    with click.progressbar(length=100, label="training the tokenizer", file=sys.stderr) as bar:
        tokenizer = train_tokenizer(kind, sample, vocab_size, end_of_text=True,
                                    progress=lambda done, total: bar.update(
                                        int(100 * done / max(total, 1)) - bar.pos))
    if vocab_size is not None and tokenizer.vocab_size < vocab_size:
        report(f"the BPE has {tokenizer.vocab_size} tokens, not the {vocab_size} asked: every "
               f"word of the text is one token by then (more text makes more)")
    return tokenizer


# --- the worker processes ----------------------------------------------------------------------
_worker = {}


def _start_method():
    """fork where there is one and this process cannot have initialised CUDA (neither numba's
    CUDA nor CuPy imported, as in `nanoandrea prepare`); spawn otherwise, as a forked child of
    a process that has initialised CUDA is unusable (`train --data CORPUS` prepares after
    importing the kernels). A forked worker starts at once with the tokenizer and its tiktoken
    encoding already built; a spawned one starts Python, imports numpy and tiktoken and builds
    GPT-2's 50,000 merges again, about a second while the main process waits for it."""
    cuda = any(module in sys.modules for module in ("numba.cuda", "cupy"))
    return "fork" if "fork" in multiprocessing.get_all_start_methods() and not cuda else "spawn"


def _start_worker(tokenizer, dtype):
    """tokenizer: the tokenizer (forked) or its to_dict() (spawned). A worker leaves Ctrl-C to
    the main process, which stops the pool and cleans up: a terminal sends SIGINT to every
    process of the job, and a worker's traceback would follow the one line of `Error:`. SIGTERM
    ends it at once, as the main process's handler (inherited by a fork) is not a worker's.
    Both arrive blocked until here (_pool_of_workers): one that came earlier takes effect now."""
    from .tokenizer import TOKENIZER_CLASSES
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    if isinstance(tokenizer, dict):
        tokenizer = TOKENIZER_CLASSES[tokenizer["type"]].from_dict(tokenizer)
    _worker.update(tokenizer=tokenizer, dtype=dtype)


def encode_segments(segments, tokenizer=None, dtype=None):
    """The ids of [(text, ends), ...] in one array, and each segment's count of them. A
    document's last segment gets the end-of-text token (a tokenizer without one, as a char
    tokenizer: a newline, unless the text ends in one). Runs in a worker, with its tokenizer."""
    tokenizer = tokenizer or _worker["tokenizer"]
    if isinstance(tokenizer, BPETokenizer):         # tiktoken, one thread: a worker a core
        def encode(text):
            return tokenizer.encode_fast(text, threads=1)
    else:
        encode = tokenizer.encode
    if tokenizer.end_of_text is not None:
        end = np.array([tokenizer.end_of_text])
    else:
        end = tokenizer.encode("\n")
    pieces, counts = [], []
    for text, ends in segments:
        segment = [encode(text)]
        if ends and (tokenizer.end_of_text is not None or not text.endswith("\n")):
            segment.append(end)
        pieces += segment
        counts.append(sum(map(len, segment)))
    ids = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    return ids.astype(dtype or _worker["dtype"]), counts


def _tasks(corpus):
    """[(text, ends), ...] of about TASK_CHARACTERS, with each segment's start marker."""
    task, starts, size = [], [], 0
    for text, start, ends in corpus.segments():
        task.append((text, ends))
        starts.append(start)
        size += len(text)
        if size >= TASK_CHARACTERS:
            yield task, starts
            task, starts, size = [], [], 0
    if task:
        yield task, starts


def _encoded(corpus, tokenizer, dtype, workers):
    """(ids, counts, starts) of each task in order, encoded by `workers` processes
    (_start_method) with at most two tasks each in flight, so memory holds a few tasks whatever
    the corpus's size; workers=1 encodes in this process."""
    if workers == 1:
        for task, starts in _tasks(corpus):
            yield *encode_segments(task, tokenizer, dtype), starts
        return
    method = _start_method()
    if method == "fork" and isinstance(tokenizer, BPETokenizer):
        tokenizer.fast_encoding()                   # built here once, and inherited
    given = tokenizer if method == "fork" else tokenizer.to_dict()
    pool = _pool_of_workers(multiprocessing.get_context(method), workers, given, dtype)
    try:
        pending = deque()
        for task, starts in _tasks(corpus):
            pending.append((pool.apply_async(encode_segments, (task,)), starts))
            if len(pending) >= 2 * workers:
                result, starts = pending.popleft()
                yield *result.get(), starts
        while pending:
            result, starts = pending.popleft()
            yield *result.get(), starts
    finally:
        _stop_pool(pool)


STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def _pool_of_workers(context, workers, tokenizer, dtype):
    """The pool, made with Ctrl-C and SIGTERM blocked: its workers, forked or spawned now or
    later by the threads it starts here, inherit the blocked mask, so that neither signal
    reaches a worker before _start_worker has set the worker's own handling (else the main
    process's handler, inherited by a fork, raises in it, a traceback after the one line of
    `Error:`; on a loaded machine a stop can come while a worker is still starting).
    Here they are unblocked after: one that came meanwhile is handled then."""
    if not hasattr(signal, "pthread_sigmask"):
        return context.Pool(workers, _start_worker, (tokenizer, dtype))
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        return context.Pool(workers, _start_worker, (tokenizer, dtype))
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def _stop_pool(pool, seconds=10):
    """pool.terminate(), as leaving `with Pool()` does, but in at most 2 x `seconds`: stopped
    midway (Ctrl-C, SIGTERM), terminate can wait forever, its task-feeding thread stuck on the
    task queue's lock (seen about once in 15 stops on a loaded 2-core machine). Then the
    workers are killed, and the stuck thread, a daemon, ends with the process."""
    stopper = threading.Thread(target=pool.terminate, daemon=True)
    stopper.start()
    stopper.join(seconds)
    if stopper.is_alive():
        for child in multiprocessing.active_children():     # (the pool's workers)
            child.kill()
        stopper.join(seconds)


# --- the shards --------------------------------------------------------------------------------
class ShardWriter:
    """A split's token ids, appended to files split-00000.bin, ... of shard_tokens each."""

    def __init__(self, folder, split, shard_tokens):
        self.folder, self.split, self.shard_tokens = folder, split, shard_tokens
        self.shards, self.file, self.in_file = [], None, 0
        self.tokens = self.documents = 0

    def write(self, ids):
        while ids.size:
            if self.file is None or self.in_file == self.shard_tokens:
                self._next_file()
            part, ids = ids[:self.shard_tokens - self.in_file], ids[self.shard_tokens - self.in_file:]
            self.file.write(part.tobytes())
            self.in_file += part.size
            self.tokens += part.size
            self.shards[-1]["tokens"] = self.in_file

    def _next_file(self):
        self.close()
        name = f"{self.split}-{len(self.shards):05d}.bin"
        self.file, self.in_file = open(self.folder / name, "wb"), 0
        self.shards.append({"file": name, "tokens": 0})

    def close(self):
        if self.file is not None:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            self.file = None

    def index(self):
        return {"tokens": self.tokens, "documents": self.documents, "shards": self.shards}


def _write_splits(encoded, staging, shard_tokens, progress):
    """Each document's ids to train or val (module docstring); returns the two writers. The
    segments of a task that go to one split in a row are one write."""
    writers = {name: ShardWriter(staging, name, shard_tokens) for name in ("train", "val")}
    split, tokens = "train", {"train": 0, "val": 0}
    try:
        for ids, counts, starts in encoded:
            offsets, runs = np.cumsum([0, *counts]), []       # runs: [split, begin, end]
            for start, begin, end in zip(starts, offsets[:-1], offsets[1:]):
                if start == "auto":
                    val = tokens["val"] < VAL_FRACTION * (tokens["train"] + tokens["val"])
                    split = "val" if val else "train"
                elif start is not None:
                    split = start
                writers[split].documents += start == "auto"
                tokens[split] += end - begin
                if runs and runs[-1][0] == split:
                    runs[-1][2] = end
                else:
                    runs.append([split, begin, end])
            for run_split, begin, end in runs:
                writers[run_split].write(ids[begin:end])
            progress()
    finally:
        for writer in writers.values():
            writer.close()
    return writers


def prepare(source, out_dir, tokenizer_kind="char", vocab_size=None, report=print,
            gpt2_files=None, text_field="text", strict=False, workers=None,
            shard_tokens=SHARD_TOKENS):
    """Tokenize a corpus into out_dir (written to a temporary folder, then renamed).

    The tokenizer is trained on the corpus (a BPE on a sample of it), or, with gpt2_files (a
    folder holding GPT-2's vocab.json and merges.txt), loaded from those files."""
    out_dir = Path(os.path.normpath(out_dir))
    check_destination(source, out_dir)
    corpus = Corpus(source, text_field, strict)
    if gpt2_files is not None:
        tokenizer = _load_gpt2(gpt2_files)
        tokenizer_kind = f"bpe from {gpt2_files}"
    workers = min(workers or os.cpu_count() or 1,          # (no more workers than tasks: a
                  1 + corpus.total_bytes // TASK_CHARACTERS)   # corpus of one is encoded here)
    report(f"preparing {source} -> {out_dir} ({len(corpus.files):,} file(s), "
           f"{corpus.total_bytes / 1e6:,.1f} MB, {tokenizer_kind} tokenizer, {workers} "
           f"worker(s))")
    if gpt2_files is None:
        tokenizer = _train(corpus, tokenizer_kind, vocab_size, report)
    dtype = np.uint16 if tokenizer.vocab_size <= 2 ** 16 else np.uint32
    staging = None
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale(out_dir)
        staging = new_folder(out_dir.parent, _owned_name(out_dir, "tmp") + "-")
        started = time.perf_counter()
        with click.progressbar(length=max(corpus.total_bytes, 1), label="tokenizing",
                               file=sys.stderr, show_eta=True,
                               item_show_func=lambda rate: rate) as bar:
            def progress():
                seconds = time.perf_counter() - started
                bar.update(corpus.bytes_read - bar.pos,
                           f"{corpus.bytes_read / 1e6 / max(seconds, 1e-9):.1f} MB/s")
            encoded = _encoded(corpus, tokenizer, dtype, workers)
            try:
                writers = _write_splits(encoded, staging, shard_tokens, progress)
            finally:            # (an error or Ctrl-C: the pool stops here, its workers with it,
                encoded.close()     # not when the interpreter exits and collects the generator)
        corpus.report_skipped(report)
        _check_splits(writers, corpus)
        save_tokenizer(tokenizer, staging / "tokenizer.json")
        meta = {"format": "nanoandrea-data", "version": LAYOUT, "dtype": np.dtype(dtype).name,
                "tokens": {name: w.tokens for name, w in writers.items()},
                "splits": {name: w.index() for name, w in writers.items()},
                "tokenizer": tokenizer.kind, "vocab_size": tokenizer.vocab_size,
                "end_of_text": tokenizer.end_of_text, "source": str(source),
                "skipped": corpus.skipped,
                "fingerprint": _fingerprint(source, tokenizer_kind, vocab_size)}
        _write_meta(staging, meta)
        _replace(staging, out_dir)
    except OSError as error:
        raise _writing_error(error, out_dir) from None
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
    seconds = time.perf_counter() - started
    documents = [writers[name].documents for name in ("train", "val")]
    held_out = (f"{documents[0]:,} and {documents[1]:,} documents" if any(documents) else
                f"one text, its last {VAL_FRACTION:.0%} held out")   # (a corpus of one .txt file)
    report(f"prepared {meta['tokens']['train']:,} train and {meta['tokens']['val']:,} val tokens "
           f"({held_out}), "
           f"vocabulary {tokenizer.vocab_size}, tokenized in {seconds:.1f} s "
           f"({corpus.total_bytes / 1e6 / max(seconds, 1e-9):.1f} MB/s)")
    return out_dir


# the files a prepare writes (the first layout's train.bin and val.bin among them)
PREPARED_FILES = re.compile(r"(train|val)(-\d{5})?\.bin|meta\.json|tokenizer\.json")


def check_destination(source, out_dir):
    """Refuse, before any work, an out_dir whose replacement (prepare replaces it whole) would
    lose what prepare did not make: the corpus itself, a folder holding it, the current folder,
    a folder of other files. A new or empty folder, or an earlier prepare's, is taken."""
    out, corpus = Path(out_dir).resolve(), Path(source).resolve()
    here = Path.cwd().resolve()
    new = f"name a new folder, e.g. --out data/{corpus.stem or 'corpus'}"
    if out == corpus or out in corpus.parents:
        raise DataError(f"--out {out_dir} {'is' if out == corpus else 'holds'} the corpus "
                        f"{source}, and prepare replaces its --out folder whole: {new}")
    if out == here or out in here.parents:
        raise DataError(f"--out {out_dir} is the current folder"
                        f"{'' if out == here else ' or one holding it'}, and prepare replaces "
                        f"its --out folder whole: {new}")
    if out.is_dir():
        names = sorted(path.name for path in out.iterdir())
        others = [name for name in names if not PREPARED_FILES.fullmatch(name)]
        if names and not is_prepared(out):
            raise DataError(f"{out_dir} is not empty and holds no dataset prepare made, and "
                            f"prepare replaces its --out folder whole: choose a new or empty "
                            f"folder")
        if others:
            raise DataError(f"{out_dir} holds, beside a prepared dataset, {', '.join(others)}, "
                            f"which prepare did not make and would delete with the folder: "
                            f"move them, or choose another --out")
    problem = unwritable(out.parent)              # (where the staging folder and the rename go)
    if problem:
        raise DataError(f"cannot write {out_dir}: {problem}")


def _check_splits(writers, corpus):
    if not corpus.has_text:
        raise DataError(f"the data is empty: {corpus.source}")
    if writers["val"].tokens == 0:
        raise DataError(f"{corpus.source} has one document: none is left to hold out for val "
                        f"(add documents, or give one .txt file, whose end is held out)")


def _write_meta(staging, meta):
    with open(staging / "meta.json", "w") as file:
        file.write(json.dumps(meta, indent=1))
        file.flush()
        os.fsync(file.fileno())


def _owned_name(out_dir, kind):
    """`.DIR.tmp-HOST-PID` (random letters follow) or `.DIR.old-HOST-PID`: a
    temporary folder's name says which process made it, so that a later prepare can tell one
    left by a process killed outright (kill -9, the machine's crash) from one in use."""
    return f".{out_dir.name}.{kind}-{socket.gethostname()}-{os.getpid()}"


def _remove_stale(out_dir):
    """Delete the temporary folders beside out_dir whose process, on this host, is gone. A
    folder of another host, or of a process id that is alive (in use, or taken since by
    another process), is left."""
    host, prefix = socket.gethostname(), f".{out_dir.name}."
    for path in out_dir.parent.iterdir():
        if not path.name.startswith(prefix):
            continue
        kind, _, owner = path.name[len(prefix):].partition("-")
        if kind == "tmp":
            owner = owner.rpartition("-")[0]          # (the random letters hold no "-")
        owner_host, _, pid = owner.rpartition("-")
        if kind in ("tmp", "old") and owner_host == host and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid):
    try:
        os.kill(pid, 0)                    # signal 0: only whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:                # another user's process
        pass
    return True


def _replace(staging, out_dir):
    """staging becomes out_dir; an older out_dir is moved aside first and deleted after."""
    old = None
    if out_dir.exists():
        old = out_dir.with_name(_owned_name(out_dir, "old"))
        os.replace(out_dir, old)
    os.replace(staging, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _writing_error(error, out_dir):
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return DataError(f"the disk is full writing {out_dir}: nothing was written (free "
                         f"space and run again)")
    return DataError(f"cannot write {out_dir}: {reason(error)}; nothing was written")


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
    problem = unwritable(cache_dir)
    if problem:
        raise DataError(f"cannot prepare {data} in the data cache {cache_dir}: {problem} (set "
                        f"NANOANDREA_CACHE to a folder you can write, or give --data a folder "
                        f"`nanoandrea prepare` made)")
    return prepare(data, cache, tokenizer_kind, vocab_size, report)


class TokenShards:
    """A split's shard files read as one sequence: len() and slices that may span shards (a
    slice inside one shard is a view of its memmap)."""

    def __init__(self, arrays, dtype):
        self.arrays, self.dtype = arrays, dtype
        self.ends = np.cumsum([len(a) for a in arrays], dtype=np.int64)   # where each ends

    def __len__(self):
        return int(self.ends[-1]) if len(self.ends) else 0

    def __getitem__(self, index):
        start, stop, step = index.indices(len(self))
        if step != 1:
            raise IndexError("token shards take contiguous slices only")
        parts, shard = [], int(np.searchsorted(self.ends, start, side="right"))
        while start < stop:
            begin = self.ends[shard] - len(self.arrays[shard])     # the shard's first token
            end = min(stop, int(self.ends[shard]))
            parts.append(self.arrays[shard][start - begin:end - begin])
            start, shard = end, shard + 1
        if len(parts) == 1:
            return parts[0]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=self.dtype)


class Dataset:
    """The token shards of a prepared folder, and the tokenizer that made them."""

    def __init__(self, folder):
        folder = Path(folder)
        if not is_prepared(folder):
            raise DataError(f"{folder} is not a prepared data folder (no meta.json)")
        self.folder = folder
        self.meta = json.loads((folder / "meta.json").read_text())
        self.tokenizer = load_tokenizer(folder / "tokenizer.json")
        dtype = np.dtype(self.meta["dtype"])
        self.splits = {name: TokenShards([self._open(file, dtype) for file in self._files(name)],
                                         dtype) for name in ("train", "val")}

    def _files(self, split):
        """The split's shard files (a folder of the first layout: train.bin and val.bin)."""
        if "splits" not in self.meta:
            return [f"{split}.bin"]
        return [shard["file"] for shard in self.meta["splits"][split]["shards"]]

    def _open(self, name, dtype):
        path = self.folder / name
        if not path.is_file():
            raise DataError(f"{path} is missing: {self.folder} is not a complete prepared folder")
        return np.memmap(path, dtype=dtype, mode="r")

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
