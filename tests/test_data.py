"""prepare and the prepared folder: every format gives the same documents, each ending with the
end-of-text token; val is held-out documents; workers, blocks and shards change no token; train
reads the shards as one sequence and resumes across them; bad input is one `Error:` line and
leaves no output behind."""
import errno
import gzip
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from nanoandrea import corpus as corpus_module
from nanoandrea import data
from nanoandrea.data import DEFAULT_CORPUS, VAL_FRACTION, BatchSampler, Dataset, prepare
from nanoandrea.tokenizer import END_OF_TEXT, BPETokenizer, CharTokenizer
from test_cli import assert_user_error, resume_matches_uninterrupted, run

ROOT = Path(__file__).resolve().parents[1]
SHAKESPEARE = DEFAULT_CORPUS.read_text(encoding="utf-8")
OTHER = ["héllo wörld — ελληνικά", "русский текст, 123", "日本語の文章です。", "emoji 😀🎉 ✓",
         "\ttabs\x00and bytes\x7f", "  leading and trailing  \n\n\n"]
DOCUMENTS = [SHAKESPEARE[i * 1500:(i + 1) * 1500 - 300 * (i % 3)] + OTHER[i % len(OTHER)]
             for i in range(60)]


def quiet(message):
    pass


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory):
    """A small BPE with an end-of-text token, as GPT-2's files: every format's prepare uses it."""
    folder = tmp_path_factory.mktemp("gpt2")
    BPETokenizer.train(SHAKESPEARE[:40_000] + "".join(OTHER), 400, end_of_text=True
                       ).to_gpt2_files(folder)
    return folder


def write_formats(folder):
    """The same DOCUMENTS as .txt files, a .jsonl, a .jsonl.gz and (with pyarrow) parquet."""
    texts = folder / "texts"
    for i, document in enumerate(DOCUMENTS):
        (texts / f"{i // 10}").mkdir(parents=True, exist_ok=True)
        (texts / f"{i // 10}" / f"{i:03d}.txt").write_text(document, encoding="utf-8")
    lines = "".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(DOCUMENTS))
    (folder / "docs.jsonl").write_text(lines, encoding="utf-8")
    with gzip.open(folder / "docs.jsonl.gz", "wt", encoding="utf-8") as file:
        file.write(lines)
    sources = {"txt folder": texts, "jsonl": folder / "docs.jsonl",
               "jsonl.gz": folder / "docs.jsonl.gz"}
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.table({"text": DOCUMENTS}), folder / "docs.parquet", row_group_size=7)
        sources["parquet"] = folder / "docs.parquet"
    except ImportError:
        pass
    return sources


def documents_of(tokens, tokenizer):
    """The texts between end-of-text tokens (each document ends with one)."""
    ids = np.asarray(tokens[:], dtype=np.int64)
    assert ids[-1] == tokenizer.end_of_text
    documents = np.split(ids, np.flatnonzero(ids == tokenizer.end_of_text) + 1)[:-1]
    return [tokenizer.decode(document[:-1]) for document in documents]


def test_every_format_gives_the_documents_each_ended_and_val_held_out(tmp_path, gpt2_files):
    streams = {}
    for name, source in write_formats(tmp_path).items():
        out = prepare(source, tmp_path / f"out-{name.replace(' ', '-')}", report=quiet,
                      gpt2_files=gpt2_files, workers=1)
        dataset = Dataset(out)
        tokenizer = dataset.tokenizer
        assert tokenizer.end_of_text == 399 and dataset.meta["end_of_text"] == 399
        train = documents_of(dataset.splits["train"], tokenizer)
        val = documents_of(dataset.splits["val"], tokenizer)
        assert sorted(train + val) == sorted(DOCUMENTS)                 # whole documents
        assert len(val) == dataset.meta["splits"]["val"]["documents"] >= 4
        share = len(dataset.splits["val"]) / (len(dataset.splits["val"]) + len(dataset.splits["train"]))
        assert VAL_FRACTION * 0.8 < share < VAL_FRACTION * 1.2
        # the ids are the reference's, document by document
        want = np.concatenate([np.append(tokenizer.encode(d), 399) for d in train])
        assert np.array_equal(dataset.splits["train"][:], want)
        streams[name] = (dataset.splits["train"][:].tolist(), dataset.splits["val"][:].tolist())
    assert all(stream == streams["jsonl"] for stream in streams.values()), list(streams)


SHARDED_PREPARE = """
import sys, warnings
from nanoandrea import data
# (Python 3.12 warns where a process with threads forks: here that is an error)
warnings.filterwarnings("error", "This process", DeprecationWarning)
source, out, gpt2_files, start = sys.argv[1:]
data.TASK_CHARACTERS = 10_000                               # (tasks enough for two workers)
data._start_method = lambda: start
data.prepare(source, out, report=lambda message: None, gpt2_files=gpt2_files, workers=2,
             shard_tokens=2_000)
"""


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_workers_blocks_and_shards_change_no_token(tmp_path, gpt2_files, start):
    """Forked workers (`nanoandrea prepare`) and spawned ones (a process with CUDA) alike. The
    sharded prepare runs in a fresh interpreter, as `nanoandrea prepare` does: a test process
    has threads (pytest-xdist's, CUDA's once a GPU test ran), and a fork of it may deadlock."""
    source = write_formats(tmp_path)["jsonl"]
    one = Dataset(prepare(source, tmp_path / "one", report=quiet, gpt2_files=gpt2_files,
                          workers=1))
    sharded = tmp_path / "two"
    process = python(SHARDED_PREPARE, source, sharded, gpt2_files, start)
    _, errors = process.communicate()
    assert process.returncode == 0, errors
    two = Dataset(sharded)
    shards = two.meta["splits"]["train"]["shards"]
    assert len(shards) > 5 and all(s["tokens"] <= 2_000 for s in shards)
    assert sum(s["tokens"] for s in shards) == len(two.splits["train"])
    for split in ("train", "val"):
        a, b = one.splits[split], two.splits[split]
        assert len(a) == len(b) and np.array_equal(a[:], b[:])
        for start in (0, 1_999, 2_000, 3_500, len(a) - 300):            # windows across shards
            assert np.array_equal(a[start:start + 300], b[start:start + 300])
    batches = [BatchSampler(d.splits["train"], 8, 256, seed=3) for d in (one, two)]
    for _ in range(5):
        (x1, y1), (x2, y2) = (sampler.next() for sampler in batches)
        assert np.array_equal(x1, x2) and np.array_equal(y1, y2)


def test_a_long_text_file_in_blocks_encodes_as_the_whole(tmp_path, gpt2_files, monkeypatch):
    """One .txt document, read in small blocks cut where the pre-tokenizer cuts: the ids of the
    whole text's head and tail (its last tenth is val), the bytes that are not UTF-8 replaced."""
    monkeypatch.setattr(corpus_module, "BLOCK", 1_000)
    text = "".join(SHAKESPEARE[i:i + 900] + OTHER[i % 6] + "\n  \n\n\n " for i in range(0, 60_000, 900))
    path = tmp_path / "one.txt"
    path.write_bytes(text.encode() + b"caf\xe9 \xff\n")
    text += "caf\ufffd \ufffd\n"
    messages = []
    dataset = Dataset(prepare(path, tmp_path / "out", report=messages.append,
                              gpt2_files=gpt2_files, workers=1))
    split = int(len(text) * (1 - VAL_FRACTION))
    tokenizer = dataset.tokenizer
    assert np.array_equal(dataset.splits["train"][:], tokenizer.encode(text[:split]))
    assert np.array_equal(dataset.splits["val"][:], np.append(tokenizer.encode(text[split:]), 399))
    assert any("2 byte sequence(s) that are not UTF-8" in m for m in messages)


def test_the_default_corpus_splits_as_before(tmp_path):
    """tiny Shakespeare, one document: train is its first 90% of characters, val the rest, char
    ids, one shard each: the batches the default run has always drawn. Its report says so
    (not "0 and 0 documents")."""
    lines = []
    dataset = Dataset(data.resolve_data(None, cache_dir=tmp_path, report=lines.append))
    assert any("(one text, its last 10% held out)" in line for line in lines), lines
    split = int(len(SHAKESPEARE) * (1 - VAL_FRACTION))
    tokenizer = CharTokenizer.train(SHAKESPEARE)
    assert dataset.tokenizer.to_dict() == tokenizer.to_dict()
    assert np.array_equal(dataset.splits["train"][:], tokenizer.encode(SHAKESPEARE[:split]))
    assert np.array_equal(dataset.splits["val"][:], tokenizer.encode(SHAKESPEARE[split:]))
    assert dataset.meta["dtype"] == "uint16" and len(dataset.meta["splits"]["train"]["shards"]) == 1


def test_bpe_training_samples_a_large_corpus(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "SAMPLE_CHARACTERS", 64 * 200)
    source = write_formats(tmp_path)["jsonl"]
    taken = []
    original = data.train_tokenizer
    monkeypatch.setattr(data, "train_tokenizer",
                        lambda kind, text, *a, **k: taken.append(text) or original(kind, text, *a, **k))
    dataset = Dataset(prepare(source, tmp_path / "out", "bpe", 300, report=quiet, workers=1))
    assert dataset.vocab_size == 300 and dataset.tokenizer.end_of_text == 299
    assert len(taken[0]) < 64 * 200 + 64 * 2 < sum(map(len, DOCUMENTS)) / 5
    sampled = [i for i, document in enumerate(DOCUMENTS) if document[:100] in taken[0]]
    assert len(sampled) > 30 and sampled[0] == 0 and sampled[-1] > 55       # spread out


def test_train_resumes_exactly_over_a_sharded_folder(tmp_path, gpt2_files):
    source = write_formats(tmp_path)["jsonl"]
    result = run("prepare", source, "--out", tmp_path / "prepared", "--tokenizer", "char",
                 "--shard-tokens", "3000")
    assert result.exit_code == 0, result.output
    assert len(Dataset(tmp_path / "prepared").meta["splits"]["train"]["shards"]) > 10
    resume_matches_uninterrupted(tmp_path / "prepared", tmp_path, "cpu")


# --- bad input: one line, and no output -------------------------------------------------------

def left_behind(folder):
    return sorted(p.name for p in folder.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


def test_bad_records_are_counted_and_skipped_or_refused(tmp_path):
    lines = [json.dumps({"text": d}) for d in DOCUMENTS[:20]]
    lines[3], lines[7] = "{not json", json.dumps({"body": "no text field"})
    source = tmp_path / "bad.jsonl"
    source.write_text("\n".join(lines) + "\n")
    result = run("prepare", source, "--out", tmp_path / "out")
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.output.splitlines() if line.startswith("warning")]
    assert warnings == [f'warning: skipped 2 record(s) (1 not JSON, 1 no "text" string); the '
                        f'first at {source}:4 (--strict refuses them)']
    assert Dataset(tmp_path / "out").meta["skipped"] == {"not JSON": 1, 'no "text" string': 1}
    assert_user_error(run("prepare", source, "--out", tmp_path / "strict", "--strict"),
                      f"{source}:4: not JSON")
    assert not (tmp_path / "strict").exists() and left_behind(tmp_path) == []
    assert_user_error(run("prepare", source, "--out", tmp_path / "field", "--text-field", "body"),
                      "has one document")


def test_unusable_sources_are_one_line(tmp_path, monkeypatch):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.md").write_text("not a corpus file")
    assert_user_error(run("prepare", tmp_path / "empty", "--out", tmp_path / "out"),
                      "no text in the folder")
    broken = tmp_path / "broken.jsonl.gz"
    whole = gzip.compress("".join(json.dumps({"text": d}) + "\n" for d in DOCUMENTS).encode())
    broken.write_bytes(whole[:len(whole) // 2])                       # (cut short)
    assert_user_error(run("prepare", broken, "--out", tmp_path / "out"), f"cannot read {broken}")
    locked = tmp_path / "locked.txt"
    locked.write_text("some text")

    def no_permission(path, *args, **kwargs):
        if str(path) == str(locked):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return open(path, *args, **kwargs)
    monkeypatch.setattr(corpus_module, "open", no_permission, raising=False)
    assert_user_error(run("prepare", locked, "--out", tmp_path / "out"),
                      f"cannot read {locked}: Permission denied")
    pytest.importorskip("pyarrow")
    (tmp_path / "fake.parquet").write_text("not parquet")
    assert_user_error(run("prepare", tmp_path / "fake.parquet", "--out", tmp_path / "out"),
                      "not a readable parquet file")
    assert not (tmp_path / "out").exists() and left_behind(tmp_path) == []


@pytest.mark.parametrize("failure", ["disk full", "interrupt"])
def test_a_failure_while_writing_leaves_the_old_output_and_no_new(tmp_path, monkeypatch, failure):
    source = write_formats(tmp_path)["jsonl"]
    out = tmp_path / "out"
    assert run("prepare", source, "--out", out).exit_code == 0
    before = {name: (out / name).read_bytes() for name in os.listdir(out)}
    writes = []

    def failing_write(self, ids):
        writes.append(ids.size)
        if len(writes) == 3:                      # (a few writes in)
            if failure == "interrupt":
                raise KeyboardInterrupt
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(self, ids)
    original = data.ShardWriter.write
    monkeypatch.setattr(data.ShardWriter, "write", failing_write)
    result = run("prepare", source, "--out", out, "--tokenizer", "bpe", "--vocab-size", "300")
    message = "the disk is full writing" if failure == "disk full" else "interrupted;"
    assert_user_error(result, message)
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before
    assert left_behind(tmp_path) == []
    monkeypatch.setattr(data.ShardWriter, "write", original)
    assert run("prepare", source, "--out", tmp_path / "new", "--tokenizer", "bpe",
               "--vocab-size", "300").exit_code == 0
    assert END_OF_TEXT in (tmp_path / "new" / "tokenizer.json").read_text()


def test_a_vocabulary_past_uint16_gets_uint32_shards(tmp_path):
    text = "".join(map(chr, range(0xE000, 0xE000 + 70_000)))     # 70,000 distinct characters
    (tmp_path / "wide.txt").write_text(text, encoding="utf-8")
    dataset = Dataset(prepare(tmp_path / "wide.txt", tmp_path / "out", report=quiet))
    assert dataset.meta["dtype"] == "uint32" and dataset.vocab_size == 70_001  # (and "\n")
    assert dataset.splits["val"][:].dtype == np.uint32
    ids = np.concatenate([dataset.splits["train"][:], dataset.splits["val"][:]])
    assert dataset.tokenizer.decode(ids) == text + "\n" and ids.max() == 70_000


def test_a_folder_of_the_first_layout_is_still_read(tmp_path):
    """train.bin and val.bin, a meta.json without "splits": what prepare wrote before shards."""
    from nanoandrea.tokenizer import save_tokenizer
    tokenizer = CharTokenizer.train(SHAKESPEARE[:5000])
    ids = {"train": tokenizer.encode(SHAKESPEARE[:4000]), "val": tokenizer.encode(SHAKESPEARE[4000:5000])}
    for name, split in ids.items():
        split.astype(np.uint16).tofile(tmp_path / f"{name}.bin")
    save_tokenizer(tokenizer, tmp_path / "tokenizer.json")
    (tmp_path / "meta.json").write_text(json.dumps({"dtype": "uint16", "tokens": {
        name: len(split) for name, split in ids.items()}, "tokenizer": "char"}))
    dataset = Dataset(tmp_path)
    assert all(np.array_equal(dataset.splits[name][:], ids[name]) for name in ids)


# --- prepare as its own process ---------------------------------------------------------------

def python(code, *args, **popen):
    """A Python process running code with this checkout's nanoandrea (not an installed one)."""
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)


def test_prepare_imports_no_numba(tmp_path, gpt2_files):
    """numba is a second of start-up that prepare never uses (its CUDA kernels are train's)."""
    probe = python("import sys\nfrom nanoandrea.cli import main\n"
                   "try:\n    main(sys.argv[1:])\nexcept SystemExit as end:\n"
                   "    print(end.code, sorted(m for m in sys.modules if m.startswith('numba')))",
                   "prepare", write_formats(tmp_path)["jsonl"], "--out", tmp_path / "out",
                   "--gpt2-files", gpt2_files)
    output, errors = probe.communicate(timeout=120)
    assert output.split("\n")[-2] == "0 []", errors


# prepare with two workers whose first write waits: a process to stop midway, its workers busy
# or waiting, its temporary folder there. The line "writing PID PID" says the workers' ids.
# SIGINT's handler is set as a terminal's foreground job has it: a process started in the
# background (`cmd &`, as a CI runner may start the tests) inherits SIGINT ignored, and Python
# then leaves it ignored, as Unix asks (Ctrl-C does not reach a background job).
SLOW_PREPARE = """
import multiprocessing, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
from nanoandrea import data
from nanoandrea.cli import main
data.TASK_CHARACTERS = 10_000                          # (tasks enough for two workers)
def first_write_waits(self, ids):
    workers = [child.pid for child in multiprocessing.active_children()]
    print("\\nwriting", *workers, file=sys.stderr, flush=True)
    time.sleep(120)
data.ShardWriter.write = first_write_waits
main(sys.argv[1:])
"""


def gone(pid):
    """Whether a process has ended (a zombie, not yet reaped by the one that adopted it, has)."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM", "SIGKILL"])
def test_a_stopped_prepare_leaves_no_worker_and_no_temporary_folder(tmp_path, gpt2_files, how):
    """Ctrl-C (SIGINT to the whole job, as a terminal sends it) and SIGTERM (to the main
    process): one line, the workers stopped, the temporary folder deleted. SIGKILL leaves the
    folder, which the next prepare into the same DIR deletes."""
    source, out = write_formats(tmp_path)["jsonl"], tmp_path / "out"
    arguments = ["prepare", source, "--out", out, "--gpt2-files", gpt2_files, "--workers", "2"]
    process = python(SLOW_PREPARE, *arguments, start_new_session=True)
    said = ""
    while not (found := re.search(r"writing([\d ]+)\n", said)) and process.poll() is None:
        said += process.stderr.readline()
    assert found, said + process.stderr.read()
    workers = [int(pid) for pid in found.group(1).split()]
    assert len(workers) == 2 and len(left_behind(tmp_path)) == 1
    if how == "SIGINT":
        os.killpg(process.pid, signal.SIGINT)
    else:
        process.send_signal(getattr(signal, how))
    errors = said + process.communicate(timeout=60)[1]
    deadline = time.monotonic() + 30
    while not all(map(gone, workers)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(map(gone, workers)), errors
    assert not out.exists()
    if how == "SIGKILL":
        assert process.returncode == -signal.SIGKILL and len(left_behind(tmp_path)) == 1
        assert run(*arguments).exit_code == 0 and Dataset(out).meta["tokens"]["val"] > 0
    else:
        assert process.returncode == 1 and "Traceback" not in errors
        said = {"SIGINT": "interrupted;", "SIGTERM": "terminated (SIGTERM);"}[how]
        assert [line for line in errors.splitlines() if line.startswith("Error:")] == [
            f"Error: {said} {out} was not written"], errors
    assert left_behind(tmp_path) == []


def test_a_later_prepare_deletes_the_temporary_folders_of_ended_ones(tmp_path, gpt2_files):
    """Only those of a process of this host that has ended: the others may be in use."""
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    host = socket.gethostname()
    folders = {"ended": f".out.tmp-{host}-{ended.pid}-k2x9_q1a",
               "ended, moved aside": f".out.old-{host}-{ended.pid}",
               "alive": f".out.tmp-{host}-{os.getpid()}-b7m3dd0z",
               "another host's": f".out.tmp-elsewhere-{ended.pid}-p0c4n8wq",
               "another DIR's": f".out2.tmp-{host}-{ended.pid}-r5t6y7u8"}
    for name in folders.values():
        (tmp_path / name).mkdir()
        (tmp_path / name / "train-00000.bin").write_bytes(b"\0" * 10)
    prepare(write_formats(tmp_path)["jsonl"], tmp_path / "out", report=quiet,
            gpt2_files=gpt2_files, workers=1)
    kept = {what for what, name in folders.items() if (tmp_path / name).exists()}
    assert kept == {"alive", "another host's", "another DIR's"}


# --- where prepare writes ---------------------------------------------------------------------

def test_prepare_writes_only_a_new_folder_or_its_own_dataset(tmp_path, monkeypatch):
    """prepare replaces --out whole: its own corpus, a folder holding it, the current folder,
    or a folder of other files would be lost, so each is refused before any work, one line,
    every file untouched. A new, empty or earlier prepared folder is written (atomically)."""
    texts = tmp_path / "my_texts"
    texts.mkdir()
    (texts / "a.txt").write_text(SHAKESPEARE[:3000])
    (texts / "b.txt").write_text(SHAKESPEARE[3000:6000])
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "precious.txt").write_text("the user's")
    (keep / "inner").mkdir()
    before = {path: path.read_bytes() for path in tmp_path.rglob("*") if path.is_file()}
    for here, source, out, said in [
            (tmp_path, texts, texts, f"--out {texts} is the corpus {texts}"),
            (tmp_path, texts / "a.txt", texts, f"--out {texts} holds the corpus"),
            (texts, "a.txt", ".", "--out . holds the corpus a.txt"),
            (keep, texts / "a.txt", ".", "--out . is the current folder"),
            (keep / "inner", texts / "a.txt", "..",
             "--out .. is the current folder or one holding it"),
            (tmp_path, texts, keep, f"{keep} is not empty and holds no dataset")]:
        monkeypatch.chdir(here)
        assert_user_error(run("prepare", source, "--out", out), said)
    monkeypatch.chdir(tmp_path)
    assert {path: path.read_bytes() for path in tmp_path.rglob("*") if path.is_file()} == before

    data = tmp_path / "data"
    assert run("prepare", texts, "--out", data).exit_code == 0
    assert run("prepare", texts, "--out", data, "--tokenizer", "bpe",
               "--vocab-size", "300").exit_code == 0            # (its own dataset: replaced)
    assert Dataset(data).meta["tokenizer"] == "bpe"
    (data / "notes.txt").write_text("mine")
    assert_user_error(run("prepare", texts, "--out", data),
                      f"{data} holds, beside a prepared dataset, notes.txt, which prepare did "
                      f"not make")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run("prepare", texts, "--out", empty).exit_code == 0 and Dataset(empty)
    assert left_behind(tmp_path) == []


def test_a_read_only_folder_or_cache_is_one_line(tmp_path, monkeypatch):
    """The folder that would hold --out, or the data cache train prepares into, cannot be
    written (read-only; simulated, as root writes there anyway): one line, nothing made."""
    source = tmp_path / "corpus.txt"
    source.write_text(SHAKESPEARE[:20_000])
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **options: (
        not (Path(path) == locked and mode & os.W_OK) and real_access(path, mode, **options)))
    assert_user_error(run("prepare", source, "--out", locked / "data"),
                      f"cannot write {locked / 'data'}: {locked} is not writable")
    monkeypatch.setenv("NANOANDREA_CACHE", str(locked / "cache"))
    assert_user_error(run("train", "--data", source, "--device", "cpu", "--out",
                          tmp_path / "run", "--max-steps", "1"),
                      f"cannot prepare {source} in the data cache {locked / 'cache'}: {locked} "
                      f"is not writable (set NANOANDREA_CACHE to a folder you can write")
    assert os.listdir(locked) == [] and not (tmp_path / "run").exists()

    def read_only(parent, prefix):
        raise OSError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr(data, "new_folder", read_only)
    assert_user_error(run("prepare", source, "--out", tmp_path / "out"),
                      f"cannot write {tmp_path / 'out'}: the file system is read-only; nothing "
                      f"was written")
    assert not (tmp_path / "out").exists()


def test_a_bpe_smaller_than_asked_is_said(tmp_path):
    source = tmp_path / "small.txt"
    source.write_text("to be or not to be, that is the question\n" * 30)
    result = run("prepare", source, "--out", tmp_path / "out", "--tokenizer", "bpe",
                 "--vocab-size", "4096")
    assert result.exit_code == 0, result.output
    vocabulary = Dataset(tmp_path / "out").vocab_size
    assert vocabulary < 4096
    assert (f"the BPE has {vocabulary} tokens, not the 4096 asked: every word of the text is "
            f"one token by then (more text makes more)") in result.output
