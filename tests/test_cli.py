"""The product as a user meets it: `nanoandrea train | sample | prepare | info` through click's
CliRunner, on the CPU backend (and on the GPU too when there is one), with tiny runs.

Every bad input must end in one line starting with "Error:" and a non-zero exit status, with
no traceback, and must never damage a checkpoint that was already there.
"""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import GPU
from nanoandrea.checkpoint import read_checkpoint, save_checkpoint
from nanoandrea.cli import main
from nanoandrea.train import precision_line

TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
        "First Citizen:\nYou are all resolved rather to die than to famish?\n\n") * 40
TINY = ["--preset", "tiny", "--batch-size", "4", "--block-size", "8", "--eval-iters", "2",
        "--log-interval", "3", "--warmup-steps", "2", "--lr", "3e-3"]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOANDREA_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    return path


def run(*args):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=True)
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def assert_user_error(result, text):
    assert result.exit_code != 0, result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and text in errors[0], result.output


def metrics(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def train(corpus, out, *extra, device="cpu"):
    return run("train", "--data", corpus, "--out", out, "--device", device, *TINY, *extra)


# --- training leaves what it promises -------------------------------------------------------------

def test_the_first_line_says_what_runs_on_the_tensor_cores():
    """In bf16 the attention is on the tensor cores only at the head sizes a kernel there
    takes: a run of 24 heads of 16 says that its attention is float32."""
    assert precision_line("bf16", 32) == "matmuls and attention bf16 on the tensor cores"
    assert precision_line("bf16", 16) == ("matmuls bf16 on the tensor cores, attention float32 "
                                          "(no tensor-core kernel takes heads of 16)")
    assert precision_line("tf32", 64).endswith("attention float32")
    assert precision_line("fp32", 64) == "float32 throughout"


def test_train_writes_logs_plot_samples_and_checkpoints(corpus, tmp_path):
    out = tmp_path / "run"
    result = train(corpus, out, "--max-steps", "12", "--eval-interval", "6", "--no-cuda-graph")
    assert result.exit_code == 0, result.output
    assert "ms/step" in result.output and "tok/s" in result.output and "grad norm" in result.output
    done, last = result.output.strip().splitlines()[-2:]    # the best, where the time went
    assert done.startswith("done: 12 steps, best val loss "), done
    best = read_checkpoint(out / "best")["state"]
    assert last.startswith("time: ") and "s of training steps" in last, last
    spent = [float(x) for x in re.findall(r"([0-9.]+) s\b", last)]
    assert len(spent) == 5 and spent[1] > 0, last      # (12 tiny steps may round to 0.0 s)
    assert abs(spent[1] - sum(spent[2:])) <= 0.15, last         # (each rounded to 0.1 s)
    assert read_checkpoint(out / "ckpt")["train"]["cuda_graph"] is False   # the option is kept
    records = metrics(out)
    logged = [r for r in records if "loss" in r]
    evals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in logged] == [1, 3, 6, 9, 12]          # (the first step too)
    assert [r["step"] for r in evals] == [0, 6, 12]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]                   # it learned something
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "samples.txt").read_text().count("=== step") == 2      # (not the untrained)
    saved = read_checkpoint(out / "ckpt")
    assert saved["state"]["step"] == 12 and saved["config"].n_layer == 2
    assert best["step"] in (6, 12) and best["best_step"] == best["step"]
    assert sorted(os.listdir(out)) == ["best", "ckpt", "loss.png", "metrics.jsonl", "samples.txt"]
    assert not (out / "best").is_symlink() and not (out / "ckpt").is_symlink()   # plain folders
    names = json.loads((out / "ckpt" / "model.safetensors").read_bytes()[8:].split(b"}}")[0]
                       .decode(errors="ignore") + "}}")
    assert "h.0.attn.c_attn.weight" in names and names["wte.weight"]["shape"][1] == 16


def resume_matches_uninterrupted(corpus, tmp_path, device, precision="fp32"):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    common = ("--max-steps", "12", "--eval-interval", "6", "--dropout", "0.1",
              "--precision", precision)
    assert train(corpus, whole, *common, device=device).exit_code == 0
    first = train(corpus, parts, *common, "--stop-at", "6", device=device)
    assert first.exit_code == 0 and read_checkpoint(parts / "ckpt")["state"]["step"] == 6
    second = run("train", "--out", parts, "--resume", "--device", device)
    assert second.exit_code == 0, second.output
    assert "resumed from" in second.output

    def losses(out):
        return [(r["step"], r.get("loss"), r.get("val_loss"), r.get("grad_norm"))
                for r in metrics(out)]
    assert losses(parts) == losses(whole)                 # equal, step by step, to the last bit
    assert np.array_equal(read_checkpoint(parts / "ckpt")["m"], read_checkpoint(whole / "ckpt")["m"])


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_resume_equals_the_uninterrupted_run_on_the_cpu(corpus, tmp_path, precision):
    resume_matches_uninterrupted(corpus, tmp_path, "cpu", precision)


@pytest.mark.skipif(not GPU, reason="needs a GPU (the CUDA simulator is too slow for a training run)")
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_resume_equals_the_uninterrupted_run_on_the_gpu(corpus, tmp_path, precision):
    resume_matches_uninterrupted(corpus, tmp_path, "cuda", precision)


@pytest.mark.skipif(not GPU, reason="300 steps of andrea-12m: a GPU's work")
def test_bf16_loss_curve_stays_within_2_percent_of_float32(tmp_path):
    """300 steps of the default recipe (andrea-12m, tiny Shakespeare, the same seed and
    batches) with the matmuls in bf16 and in float32: every logged loss within 2%."""
    curves = {}
    for precision in ("fp32", "bf16"):
        out = tmp_path / precision
        result = run("train", "--out", out, "--device", "cuda", "--precision", precision,
                     "--max-steps", "300", "--eval-interval", "300", "--eval-iters", "5")
        assert result.exit_code == 0, result.output
        curves[precision] = {r["step"]: r["loss"] for r in metrics(out) if "loss" in r}
    assert sorted(curves["bf16"]) == sorted(curves["fp32"]) and len(curves["fp32"]) >= 30
    worst = max(abs(curves["bf16"][s] / curves["fp32"][s] - 1) for s in curves["fp32"])
    assert worst < 0.02, f"bf16's loss differs from float32's by up to {100 * worst:.2f}%"
    assert curves["bf16"] != curves["fp32"]             # (two precisions, not one twice)


def test_the_sampling_speed_line_gives_each_rate_apart():
    from nanoandrea.cli import sampling_speed
    assert sampling_speed(2, 100, 3.0, 1.0) == \
        "200 tokens in 3.00 s: the first after 1.00 s, then 99 tokens/s"
    # 41 tokens from the cache by 2.0 s (40 after the first), 59 past the block in 1.0 s
    assert sampling_speed(1, 100, 3.0, 1.0, full=(256, 2.0, 41)) == \
        ("100 tokens in 3.00 s: the first after 1.00 s, then 40 tokens/s from the key/value "
         "cache, 59 tokens/s past the block of 256 positions (each a forward over the whole "
         "window)")
    assert sampling_speed(1, 10, 2.0, 1.0, full=(8, 1.0, 1)).endswith(
        "then 9 tokens/s past the block of 8 positions (each a forward over the whole window)")
    assert sampling_speed(1, 10, 2.0, 1.0, full=(8, 1.9, 10)).endswith("then 9 tokens/s")
    assert sampling_speed(3, 1, 0.5, 0.5) == "3 tokens in 0.50 s (6 tokens/s)"


def test_sample_prepare_and_info(corpus, tmp_path):
    out = tmp_path / "run"
    assert train(corpus, out, "--max-steps", "6", "--eval-interval", "6").exit_code == 0
    args = ("sample", "--checkpoint", out / "ckpt", "--max-new-tokens", "20", "--seed", "3",
            "--device", "cpu")
    one = run(*args, "--prompt", "First")                   # stdout: the text; stderr: progress
    assert one.exit_code == 0 and one.stdout.startswith("First") and len(one.stdout) >= 25
    assert run(*args, "--prompt", "First").stdout == one.stdout               # seeded
    assert run(*args, "--prompt", "First", "--no-kv-cache").stdout == one.stdout
    long = run(*args, "--prompt", "Speak, " * 5, "--num-samples", "2")
    assert "keeping its last 8" in long.stderr and long.stdout.count("--- sample") == 2
    # the speed: the first token's wait (the prompt's forward) apart from the rate after it;
    # the prompt fills the block of 8, so every later token is a forward over the whole window
    assert re.search(r"40 tokens in [0-9.]+ s: the first after [0-9.]+ s, then [0-9,]+ "
                     r"tokens/s past the block of 8 positions", long.stderr), long.stderr
    short = run(*args, "--prompt", "Sp", "--num-samples", "2")   # 7 tokens from the cache
    assert re.search(r"then [0-9,]+ tokens/s from the key/value cache, [0-9,]+ tokens/s past "
                     r"the block of 8", short.stderr), short.stderr
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text("All:")
    assert run(*args, "--prompt-file", prompt_file).stdout.startswith("All:")
    unseen = run(*args, "--prompt", "Fir€st✓")             # characters Shakespeare lacks
    assert unseen.exit_code == 0 and unseen.stdout == one.stdout      # sampled without them
    assert "characters '€✓' are not in the model's vocabulary: left out" in unseen.stderr

    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text(TEXT[:2000])
    (folder / "b.txt").write_text(TEXT[2000:4000])
    prepared = tmp_path / "prepared"
    result = run("prepare", folder, "--out", prepared, "--tokenizer", "bpe", "--vocab-size", "300")
    assert result.exit_code == 0, result.output
    meta = json.loads((prepared / "meta.json").read_text())
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 300
    tokens = np.fromfile(prepared / "train-00000.bin", dtype=np.uint16)
    assert tokens.size == meta["tokens"]["train"] and tokens.max() < 300
    result = run("train", "--data", prepared, "--out", tmp_path / "bpe", "--device", "cpu",
                 *TINY, "--max-steps", "3", "--eval-interval", "3")
    assert result.exit_code == 0, result.output
    # the same BPE exported as GPT-2's vocab.json + merges.txt, then used to prepare: same ids
    from nanoandrea.tokenizer import load_tokenizer
    load_tokenizer(prepared / "tokenizer.json").to_gpt2_files(tmp_path / "gpt2")
    again = tmp_path / "prepared-gpt2"
    result = run("prepare", folder, "--out", again, "--gpt2-files", tmp_path / "gpt2")
    assert result.exit_code == 0, result.output
    assert np.array_equal(np.fromfile(again / "train-00000.bin", dtype=np.uint16), tokens)
    assert_user_error(run("prepare", folder, "--out", again, "--gpt2-files", tmp_path),
                      "GPT-2 tokenizer files not found")

    info = run("info", "--preset", "andrea-120m")
    assert "2,359,296" in info.output and "28,311,552" in info.output and "124,439,808" in info.output
    assert "step 6" in run("info", "--checkpoint", out / "ckpt").output


# --- bad input: one line, non-zero exit, checkpoints intact -------------------------------------------

def test_bad_data(tmp_path, corpus):
    out = tmp_path / "run"
    assert_user_error(train(tmp_path / "missing.txt", out), "data not found")
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    assert_user_error(train(empty, out), "the data is empty")
    short = tmp_path / "short.txt"
    short.write_text("To be, or not to be")
    assert_user_error(train(short, out, "--block-size", "32"), "fewer than one block")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes(TEXT.encode() + "caf\xe9 cr\xe8me\n".encode("latin-1"))
    result = train(latin1, out, "--max-steps", "1", "--eval-interval", "1")
    assert result.exit_code == 0 and "not UTF-8 were replaced" in result.output


def test_bad_configuration(corpus, tmp_path):
    out = tmp_path / "run"
    assert_user_error(train(corpus, out, "--preset", "andrea-7b"), "unknown preset")
    assert_user_error(train(corpus, out, "--n-head", "3"), "does not divide the width")
    assert_user_error(train(corpus, out, "--batch-size", "100000000"), "lower --batch-size")


def test_bad_checkpoints(corpus, tmp_path):
    out = tmp_path / "run"
    assert_user_error(run("train", "--out", out, "--resume", "--device", "cpu"), "no checkpoint")
    assert train(corpus, out, "--max-steps", "3", "--eval-interval", "3").exit_code == 0
    assert_user_error(run("train", "--out", out, "--resume", "--device", "cpu",
                          "--preset", "andrea-mini"), "from another config")
    not_one = tmp_path / "not-a-checkpoint"
    not_one.mkdir()
    assert_user_error(run("sample", "--checkpoint", not_one, "--device", "cpu"),
                      "not a checkpoint folder")


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(corpus, tmp_path):
    out = tmp_path / "run"
    assert train(corpus, out, "--max-steps", "3", "--eval-interval", "3").exit_code == 0
    before = read_checkpoint(out / "ckpt")
    result = run("train", "--out", out, "--resume", "--device", "cpu", "--lr", "1e30",
                 "--max-steps", "60", "--grad-clip", "0", "--warmup-steps", "1")
    assert_user_error(result, "the loss is")
    assert "at step" in result.output
    after = read_checkpoint(out / "ckpt")
    assert after["state"]["step"] == 3
    assert all(np.array_equal(after["params"][k], before["params"][k]) for k in before["params"])


# A save of ckpt and best (step 99) over a run's (step 3), killed (SIGKILL) at its Nth file-system
# call, for N = 1, 2, ... until a save runs whole: after each kill both checkpoints are read, then
# a save of step 100 runs, which must finish or clear what the kill left. A fresh interpreter
# (checkpoint.py imports no numba: no threads) forks a child a moment.
KILLED_SAVES = """
import json, os, shutil, signal, sys
from pathlib import Path
from nanoandrea.checkpoint import read_checkpoint, write_checkpoint_files
base, work = Path(sys.argv[1]), Path(sys.argv[2])
saved = read_checkpoint(base / "ckpt")
def save(step):
    write_checkpoint_files(work, ["ckpt", "best"], saved["config"], saved["params"],
                           saved["tokenizer"], saved["train"], dict(saved["state"], step=step),
                           {"m": saved["m"], "v": saved["v"]}, saved["step_count"])
def steps():
    return [read_checkpoint(work / name)["state"]["step"] for name in ("ckpt", "best")]
moments = []
while not moments or not moments[-1]["whole"]:
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(base, work)
    child = os.fork()
    if child == 0:
        calls = []
        def killed_at(moment, call):
            def counted(*args, **kwargs):
                calls.append(call)
                if len(calls) == moment:
                    os.kill(os.getpid(), signal.SIGKILL)
                return call(*args, **kwargs)
            return counted
        for name in ("open", "mkdir", "rename", "replace", "link", "fsync", "unlink", "rmdir"):
            setattr(os, name, killed_at(len(moments) + 1, getattr(os, name)))
        save(99)
        os._exit(0)
    _, status = os.waitpid(child, 0)
    after_kill = steps()
    save(100)
    moments.append({"whole": os.WIFEXITED(status), "after_kill": after_kill,
                    "left": sorted(os.listdir(work)), "after_next_save": steps()})
print(json.dumps(moments))
"""


def test_a_kill_while_saving_leaves_the_previous_checkpoint(corpus, tmp_path):
    """A kill at any moment of a save leaves ckpt and best loadable, each the old or the new
    one, never a ckpt newer than best when the save was of both; the next save finishes the
    switch or clears its leftovers. The folders hold no symbolic link (cp -r copies them)."""
    out = tmp_path / "run"
    assert train(corpus, out, "--max-steps", "3", "--eval-interval", "3").exit_code == 0
    done = subprocess.run([sys.executable, "-c", KILLED_SAVES, out, tmp_path / "work"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    moments = json.loads(done.stdout)
    assert len(moments) > 20, moments                 # (every call of the save, one by one)
    seen = {tuple(moment["after_kill"]) for moment in moments}
    assert seen == {(3, 3), (3, 99), (99, 99)}, seen     # best is switched first
    for moment in moments:
        assert moment["left"] == ["best", "ckpt", "loss.png", "metrics.jsonl", "samples.txt"]
        assert moment["after_next_save"] == [100, 100], moment
    assert not any(path.is_symlink() for path in (out / "ckpt", out / "best"))


def test_a_run_of_the_older_layout_loads_and_resumes(corpus, tmp_path):
    """Runs written before checkpoints were plain folders: ckpt and best symbolic links to
    .ckpt-<step>-<id>. sample and info read them, --resume continues them, and its first save
    leaves plain folders and none of the older ones."""
    out = tmp_path / "run"
    assert train(corpus, out, "--max-steps", "6", "--eval-interval", "3").exit_code == 0
    for name in ("ckpt", "best"):
        step = read_checkpoint(out / name)["state"]["step"]
        older = out / f".ckpt-{step:07d}-0123abcd"
        if older.exists():
            shutil.rmtree(out / name)           # (ckpt and best of one step: one folder)
        else:
            os.rename(out / name, older)
        os.symlink(older.name, out / name)
    best_step = read_checkpoint(out / "best")["state"]["step"]
    sampled = run("sample", "--checkpoint", out / "best", "--device", "cpu",
                  "--max-new-tokens", "5")
    assert sampled.exit_code == 0, sampled.output
    assert "step 6" in run("info", "--checkpoint", out / "ckpt").output
    resumed = run("train", "--out", out, "--resume", "--device", "cpu", "--max-steps", "9")
    assert resumed.exit_code == 0 and "resumed from" in resumed.output, resumed.output
    assert sorted(os.listdir(out)) == ["best", "ckpt", "loss.png", "metrics.jsonl", "samples.txt"]
    assert not (out / "best").is_symlink() and not (out / "ckpt").is_symlink()
    assert read_checkpoint(out / "ckpt")["state"]["step"] == 9
    assert read_checkpoint(out / "best")["state"]["step"] in (best_step, 9)

