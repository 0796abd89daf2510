"""Byte-level BPE encoding speed, one process, the same text and merges: nanoandrea's Python
reference (BPETokenizer.encode), its fast path (encode_fast, what `prepare` runs: tiktoken from
the same merges over a thread a core, 256-line chunks), tiktoken in one call, and the
`tokenizers` library's BPE from the same merges. Each must give the reference's
ids; MB/s of UTF-8 text, the best of --repeat runs.

    python tools/data/encode_speed.py [--vocab-size 2048] [--megabytes 8] [--repeat 3]

The text: the embedded tiny Shakespeare repeated to --megabytes, every 7th line replaced by a
line of other scripts and emoji (so that the piece cache of the reference does not see only
English words); the merges: BPETokenizer.train on its first 300 kB.
"""
import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

from nanoandrea.data import DEFAULT_CORPUS  # noqa: E402
from nanoandrea.tokenizer import BPETokenizer  # noqa: E402

OTHER = ["héllo wörld — ελληνικά κείμενο", "русский текст, 123 456", "日本語の文章です。",
         "العربية نص", "emoji 😀🎉🚀 and ✓ marks", "naïve café déjà vu 3.14159"]


def corpus(megabytes):
    lines = DEFAULT_CORPUS.read_text(encoding="utf-8").splitlines(keepends=True)
    lines = [OTHER[i // 7 % len(OTHER)] + "\n" if i % 7 == 6 else line
             for i, line in enumerate(lines)]
    text = "".join(lines)
    return (text * (1 + int(megabytes * 1e6) // len(text.encode())))[:int(megabytes * 1e6)]


def huggingface_bpe(tokenizer):
    """The `tokenizers` library's byte-level BPE of the same merges (pip install tokenizers)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from nanoandrea.tokenizer import BYTE_TO_UNICODE
    strings = ["".join(BYTE_TO_UNICODE[b] for b in data) for data in tokenizer.token_bytes]
    model = models.BPE(vocab={s: i for i, s in enumerate(strings)},
                       merges=[(strings[a], strings[b]) for a, b in tokenizer.merges])
    fast = Tokenizer(model)
    fast.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return fast


def best_seconds(fn, repeat):
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - started)
    return min(times), result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--megabytes", type=float, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    import tiktoken
    text = corpus(args.megabytes)
    size = len(text.encode()) / 1e6
    tokenizer = BPETokenizer.train(text[:300000], args.vocab_size)
    other = tiktoken.Encoding("same-merges", pat_str=tokenizer.pattern, special_tokens={},
                              mergeable_ranks={b: i for i, b in enumerate(tokenizer.token_bytes)})
    print(f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, {size:.1f} MB, vocabulary "
          f"{tokenizer.vocab_size}")
    reference_s, want = best_seconds(lambda: tokenizer.encode(text), 1)
    rows = [("nanoandrea reference (Python)", reference_s, want)]
    rows.append(("nanoandrea encode_fast (tiktoken)",
                 *best_seconds(lambda: tokenizer.encode_fast(text), args.repeat)))
    rows.append(("tiktoken, one encode_ordinary call",
                 *best_seconds(lambda: np.array(other.encode_ordinary(text)), args.repeat)))
    hf = huggingface_bpe(tokenizer)
    rows.append(("tokenizers library, encode_batch",
                 *best_seconds(lambda: np.array([i for e in hf.encode_batch(
                     text.splitlines(keepends=True), add_special_tokens=False) for i in e.ids]),
                     args.repeat)))
    for name, seconds, ids in rows:
        same = "same ids" if np.array_equal(ids, want) else "DIFFERENT IDS"
        print(f"  {name:38s} {seconds:7.2f} s {size / seconds:8.1f} MB/s  {same}")
    if not all(np.array_equal(ids, want) for _, _, ids in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
