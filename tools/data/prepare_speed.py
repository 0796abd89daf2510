"""`nanoandrea prepare` from the files to the shards, timed and its memory watched, beside
tiktoken's GPT-2 encoding built from the same local vocab.json + merges.txt on the same text.

    python tools/data/prepare_speed.py --gpt2-files GPT2_DIR [--megabytes 200] [--workers N]
                                       [--format jsonl] [--keep CORPUS_DIR] [--no-baseline]
                                       [--repeat N]
    python tools/data/prepare_speed.py --vocab-size 32768 ...   # a BPE trained on a sample

It writes a corpus with make_corpus.py (beside this file) under a temporary folder (or uses
--keep's folder, made if missing), runs `python -m nanoandrea prepare CORPUS --out SHARDS --gpt2-files GPT2_DIR`
as a child process and samples the resident memory of its process tree (the main process and
its workers, summed) every 50 ms from /proc. Then, in this process, it reads the same documents
into memory and times tiktoken on them two ways: encode_ordinary a document at a time (one
thread) and encode_ordinary_batch over a thread a core; reading the files is not counted for
tiktoken, while prepare's time holds all of its work (start-up, reading, decoding, encoding,
writing). With --repeat N, prepare and tiktoken run in turn N times and the best time of each
counts (on a shared machine the load changes from minute to minute). Beside each time it gives
the CPU seconds spent: prepare's processes together (the children this tool has reaped), and
tiktoken's in this process. Where the machine's cores are shared out by session (Linux's
autogroup) and other sessions keep them busy, a session's processes together get a fixed share,
so two workers are no faster than one and the CPU seconds decide. Last, it checks that the
shards hold tiktoken's ids, each document ended by 50256.
GPT-2's files: gpt2_files.py, beside this file. With --vocab-size, prepare trains its own BPE
on a sample of the corpus (its time counted) and there is no baseline.
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from make_corpus import MEGABYTE, write_corpus  # noqa: E402


def tree_rss(pid):
    """Resident bytes of pid and all its descendants."""
    children, rss = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as file:
                fields = file.read().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(entry))
            rss[int(entry)] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError):
            continue
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        total += rss.get(p, 0)
        stack += children.get(p, [])
    return total


def children_cpu():
    """CPU seconds of this process's children that have ended (their own children's with)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_watched(command):
    """(seconds, CPU seconds, peak resident bytes of the process tree, output) of a command."""
    cpu = children_cpu()
    started = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    peak = [0]

    def watch():
        while child.poll() is None:
            peak[0] = max(peak[0], tree_rss(child.pid))
            time.sleep(0.05)
    watcher = threading.Thread(target=watch)
    watcher.start()
    output = child.communicate()[0]
    watcher.join()
    seconds = time.perf_counter() - started
    if child.returncode:
        sys.exit(f"prepare failed:\n{output}")
    return seconds, children_cpu() - cpu, peak[0], output


def cores_delivered():
    """The cores two CPU-bound processes get here now: 2 x one's time alone / their time
    together (2.0 on two idle cores; other work on the machine makes it less)."""
    loop = [sys.executable, "-c", "x = 0\nfor i in range(10_000_000): x += i"]
    started = time.perf_counter()
    subprocess.run(loop, check=True)
    alone = time.perf_counter() - started
    started = time.perf_counter()
    for child in [subprocess.Popen(loop) for _ in range(2)]:
        child.wait()
    return 2 * alone / (time.perf_counter() - started)


def gpt2_encoding(folder):
    """tiktoken's "gpt2" Encoding, its files read from folder rather than fetched."""
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    ranks = data_gym_to_mergeable_bpe_ranks(vocab_bpe_file=str(Path(folder) / "merges.txt"),
                                            encoder_json_file=str(Path(folder) / "vocab.json"))
    return tiktoken.Encoding("gpt2-local", mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": 50256},
                             pat_str=r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


def read_documents(corpus):
    from nanoandrea.corpus import Corpus
    return [text for text, _, _ in Corpus(corpus).segments()]


def check_shards(shards, encoded):
    """The shards hold each document's tiktoken ids and 50256, train and val in document order
    (VAL_FRACTION's rule, replayed)."""
    from nanoandrea.data import VAL_FRACTION, Dataset
    dataset = Dataset(shards)
    want, counts = {"train": [], "val": []}, {"train": 0, "val": 0}
    for ids in encoded:
        val = counts["val"] < VAL_FRACTION * (counts["train"] + counts["val"])
        split = "val" if val else "train"
        want[split].append(np.append(np.array(ids, dtype=np.int64), 50256))
        counts[split] += len(ids) + 1
    return all(np.array_equal(dataset.splits[name][:], np.concatenate(want[name]))
               for name in want)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpt2-files", help="a folder with vocab.json, merges.txt")
    parser.add_argument("--vocab-size", type=int, help="train a BPE of this size instead")
    parser.add_argument("--megabytes", type=float, default=200)
    parser.add_argument("--format", default="jsonl", choices=["jsonl", "jsonl.gz", "txt"])
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    parser.add_argument("--keep", help="the corpus's folder (kept; made if missing)")
    parser.add_argument("--no-baseline", action="store_true", help="prepare only (its memory)")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each, alternated")
    args = parser.parse_args()
    if not (args.gpt2_files or args.vocab_size):
        parser.error("give --gpt2-files (tools/data/gpt2_files.py makes them) or --vocab-size")
    with tempfile.TemporaryDirectory(dir="/tmp") as scratch:
        corpus = Path(args.keep or Path(scratch) / "corpus")
        if not corpus.exists():
            write_corpus(corpus, args.megabytes, args.format)
        size = sum(p.stat().st_size for p in corpus.rglob("*") if p.is_file()) / MEGABYTE
        shards = Path(scratch) / "shards"
        tokenizer = (["--tokenizer", "bpe", "--vocab-size", str(args.vocab_size)]
                     if args.vocab_size else ["--gpt2-files", args.gpt2_files])
        command = [sys.executable, "-m", "nanoandrea", "prepare", str(corpus), "--out",
                   str(shards), *tokenizer, "--workers", str(args.workers)]
        baseline = None if args.no_baseline or args.vocab_size else Baseline(corpus,
                                                                             args.gpt2_files)
        cores = [cores_delivered()]
        runs = []                   # {"prepare": (seconds, CPU seconds), "one": ..., ...}
        for _ in range(args.repeat):            # alternated, so both see the same load
            seconds, cpu, peak, output = run_watched(command)
            runs.append({"prepare": (seconds, cpu), "peak": peak,
                         **(baseline.times() if baseline else {})})
            cores.append(cores_delivered())
        seconds, peak = min(r["prepare"][0] for r in runs), max(r["peak"] for r in runs)
        cpu = min(r["prepare"][1] for r in runs)
        meta = json.loads((shards / "meta.json").read_text())
        print(f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, load average "
              f"{os.getloadavg()[0]:.1f}, corpus {size:,.1f} MB ({args.format}), " +
              ("a BPE trained on a sample" if args.vocab_size else "GPT-2's vocabulary") +
              f" ({meta['vocab_size']} tokens); the best of {args.repeat} run(s)")
        print(f"  cores two processes got, before and after each run: "
              f"{', '.join(f'{c:.2f}' for c in cores)}")
        print(f"  nanoandrea prepare, {args.workers} workers, files to shards: {seconds:7.1f} s "
              f"{size / seconds:7.2f} MB/s, {sum(meta['tokens'].values()):,} tokens, peak "
              f"resident memory {peak / 2**20:,.0f} MiB, {cpu:.1f} CPU s")
        print("  " + "\n  ".join(line for line in output.splitlines() if line.startswith(
            ("training a", "prepared"))))
        if baseline is None:
            return
        one, threads = (min(r[name][0] for r in runs) for name in ("one", "threads"))
        one_cpu, threads_cpu = (min(r[name][1] for r in runs) for name in ("one", "threads"))
        text = baseline.megabytes
        print(f"  (the text: {text:,.1f} MB of UTF-8 in {len(baseline.documents):,} documents)")
        print(f"  tiktoken gpt2, encode_ordinary, 1 thread:         {one:7.1f} s "
              f"{text / one:7.2f} MB/s, {one_cpu:.1f} CPU s")
        print(f"  tiktoken gpt2, encode_ordinary_batch, {os.cpu_count()} threads: {threads:7.1f} s "
              f"{text / threads:7.2f} MB/s, {threads_cpu:.1f} CPU s")
        print(f"  prepare / tiktoken: {one / seconds:.2f}x one thread, {threads / seconds:.2f}x "
              f"{os.cpu_count()} threads (MB/s of text: prepare {text / seconds:.2f}); CPU "
              f"seconds, tiktoken's one thread / prepare's: {one_cpu / cpu:.2f}")
        print("  each run (prepare, tiktoken 1 thread, threads), seconds / CPU seconds: " +
              ", ".join("(" + ", ".join(f"{r[name][0]:.1f}/{r[name][1]:.1f}" for name in
                                        ("prepare", "one", "threads")) + ")" for r in runs))
        same = baseline.same_ids() and check_shards(shards, baseline.encoded)
        print(f"  the shards hold tiktoken's ids: {'yes' if same else 'NO'}")
        sys.exit(0 if same else 1)


class Baseline:
    """tiktoken's gpt2 on the corpus's documents, read into memory once (not timed)."""

    def __init__(self, corpus, gpt2_files):
        self.documents = read_documents(corpus)
        self.megabytes = sum(len(d.encode()) for d in self.documents) / MEGABYTE
        self.encoding = gpt2_encoding(gpt2_files)

    def times(self):
        """{"one": (seconds, CPU seconds), "threads": (...)} of encoding every document."""
        started, cpu = time.perf_counter(), time.process_time()
        self.encoded = [self.encoding.encode_ordinary(d) for d in self.documents]
        one = (time.perf_counter() - started, time.process_time() - cpu)
        started, cpu = time.perf_counter(), time.process_time()
        self.batch = self.encoding.encode_ordinary_batch(self.documents,
                                                         num_threads=os.cpu_count())
        return {"one": one, "threads": (time.perf_counter() - started, time.process_time() - cpu)}

    def same_ids(self):
        return self.batch == self.encoded


if __name__ == "__main__":
    main()
