"""`nanoandrea heads` (nanoandrea/heads.py): the patterns score what they name, the attention
maps are the model's, ablation zeroes one head, and bad input ends in one line."""
import errno
import json
import os

import numpy as np

from nanoandrea.heads import PATTERNS, Recorder, pattern_masks, pattern_scores
from nanoandrea.checkpoint import read_checkpoint
from nanoandrea.model import GPT
from test_cli import TINY, assert_user_error, cache, corpus, run  # noqa: F401


def test_each_pattern_scores_one_on_the_attention_it_names():
    tokens = [5, 1, 2, 3, 9, 1, 2, 7, 4, 4, 8, 6, 1, 2]
    pieces = ["a", "(", "b", "c", "x", "d", ")", "e", "f", "g", "h", "i", "j", "k"]
    T = len(tokens)
    masks = pattern_masks(tokens, pieces)
    previous = np.eye(T, k=-1)
    previous[0, 0] = 1.0
    current, first = np.eye(T), np.zeros((T, T))
    first[:, 0] = 1.0
    induction = np.eye(T)                       # after t_12 = 1 (earlier at 1 and 5): key 6
    induction[12] = 0.0
    induction[12, 6] = 1.0
    for name, p in (("previous", previous), ("current", current), ("first", first)):
        scores = pattern_scores(p[None, None], masks)
        assert scores[name][0, 0] == 1.0
        assert all(scores[other][0, 0] < 1.0 for other in ("previous", "current", "first")
                   if other != name)
    assert pattern_scores(induction[None, None], masks)["induction"][0, 0] > 0.0
    assert masks["brackets"][0][6, 1] and masks["brackets"][1].sum() == 1   # ")" -> "("
    assert masks["induction"][0][12, 6] and masks["induction"][0][12, 2]


def test_heads_command_writes_the_table_maps_and_ablation(corpus, tmp_path):
    out = tmp_path / "run"
    assert run("train", "--data", corpus, "--out", out, "--device", "cpu", *TINY,
               "--max-steps", "30", "--eval-interval", "30").exit_code == 0
    result = run("heads", "--checkpoint", out / "ckpt", "--text", corpus, "--out",
                 tmp_path / "heads", "--windows", "3")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "heads" / "heads.json").read_text())
    saved = read_checkpoint(out / "ckpt", optimizer=False)
    config = saved["config"]
    assert len(report["heads"]) == config.n_layer * config.n_head
    for row in report["heads"]:
        assert row["pattern"] in PATTERNS and 0.0 <= row["score"] <= 1.0 + 1e-6
        assert row["ablation"] != 0.0           # (zeroing a head changes the loss)
    assert (tmp_path / "heads" / "heads.png").read_bytes()[:4] == b"\x89PNG"
    assert "strongest" in (tmp_path / "heads" / "heads.md").read_text()

    # the recorded probabilities are the attention's: its output is P . V, head by head
    recorder = Recorder(np.float64)
    model = GPT(config, recorder.backend, seed=None)
    model.params.load_state_dict(saved["params"])
    ids = np.arange(2 * config.block_size).reshape(2, -1) % config.vocab_size
    recorder.forward(model, ids)
    p = recorder.probabilities[0]
    assert p.shape == (2, config.n_head, config.block_size, config.block_size)
    assert np.allclose(p.sum(axis=-1), 1.0) and np.allclose(np.triu(p[0, 0], 1), 0.0)


def test_heads_bad_input(corpus, tmp_path):
    out = tmp_path / "run"
    run("train", "--data", corpus, "--out", out, "--device", "cpu", *TINY, "--max-steps", "2",
        "--eval-interval", "2")
    assert_user_error(run("heads", "--checkpoint", tmp_path / "none"), "no checkpoint")
    assert_user_error(run("heads", "--checkpoint", out / "ckpt", "--text", tmp_path / "x.txt"),
                      "no such file")
    short = tmp_path / "short.txt"
    short.write_text("All:")
    assert_user_error(run("heads", "--checkpoint", out / "ckpt", "--text", short),
                      "fewer than one block")
    assert not (tmp_path / "heads").exists() or not any((tmp_path / "heads").iterdir())


def test_log_heads_records_each_heads_share_of_the_gradient(corpus, tmp_path):
    out = tmp_path / "run"
    result = run("train", "--data", corpus, "--out", out, "--device", "cpu", *TINY,
                 "--max-steps", "6", "--eval-interval", "3", "--log-heads")
    assert result.exit_code == 0, result.output
    evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
             if "head_grad_share" in line]
    assert [e["step"] for e in evals] == [3, 6]
    config = read_checkpoint(out / "ckpt", optimizer=False)["config"]
    for e in evals:
        shares = np.asarray(e["head_grad_share"])
        assert shares.shape == (config.n_layer, config.n_head)
        assert np.allclose(shares.sum(axis=1), 1.0) and (shares > 0).all()
    assert (out / "heads_grad.png").read_bytes()[:4] == b"\x89PNG"


def test_gradient_shares_split_the_norm_by_head():
    from nanoandrea.config import get_preset
    from nanoandrea.heads import gradient_shares
    config = get_preset("tiny")                 # 2 heads of 8
    C, D = config.n_embd, config.head_size
    grads = {}
    for layer in range(config.n_layer):
        a = f"h.{layer}.attn."
        for n in "qkv":
            grads[a + f"w_{n}"] = np.zeros((C, C))
        grads[a + "w_o"] = np.zeros((C, C))
        grads[a + "w_q"][:, :D] = 1.0           # head 0's columns of W_Q: C * D ones
        grads[a + "w_o"][D:, :] = 1.0           # head 1's rows of W_O: D * C ones
        grads[a + "w_v"][3, D + 2] = 2.0        # one more entry of head 1's, squared: 4
    total = 2 * C * D + 4
    assert np.allclose(gradient_shares(grads, config), [[C * D / total, (C * D + 4) / total]] * 2)


def test_a_uniform_head_has_a_lift_of_one_on_every_pattern():
    from nanoandrea.heads import uniform_scores
    tokens = [5, 1, 2, 3, 9, 1, 2, 7, 4, 4, 8, 6, 1, 2]
    masks = pattern_masks(tokens, ["a"] * len(tokens))
    T = len(tokens)
    uniform = np.tril(np.ones((T, T))) / np.arange(1, T + 1)[:, None]
    scores = pattern_scores(uniform[None, None], masks)
    for name, value in uniform_scores(masks).items():
        assert np.isnan(value) and np.isnan(scores[name][0, 0]) or value == scores[name][0, 0]
    assert uniform_scores(masks)["local"] > uniform_scores(masks)["current"]


def test_heads_says_what_it_leaves_out_and_writes_only_its_own_report(corpus, tmp_path,
                                                                      monkeypatch):
    """Characters the model has never seen: one line naming them. --out: written whole (a full
    disk leaves nothing), replacing only an earlier report of heads."""
    out = tmp_path / "run"
    assert run("train", "--data", corpus, "--out", out, "--device", "cpu", *TINY,
               "--max-steps", "1", "--eval-interval", "1").exit_code == 0
    text = tmp_path / "text.txt"
    text.write_text(corpus.read_text() + "caf\u00e9 \u2713\n")
    arguments = ("heads", "--checkpoint", out / "ckpt", "--text", text, "--windows", "1",
                 "--no-ablation", "--out")
    result = run(*arguments, tmp_path / "heads")
    assert result.exit_code == 0, result.output
    assert "the text's characters '\u00e9\u2713' are not in the model's vocabulary: left out" in (
        result.stderr)
    assert run(*arguments, tmp_path / "heads").exit_code == 0         # (its own: replaced)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "heads.md").write_text("my notes")
    assert_user_error(run(*arguments, mine), f"{mine} holds heads.md, which no earlier "
                                             f"`nanoandrea heads` wrote")
    assert os.listdir(mine) == ["heads.md"] and (mine / "heads.md").read_text() == "my notes"
    from nanoandrea import heads

    def disk_full(rows, maps, path, size=64):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(heads, "plot_maps", disk_full)
    before = {p.name: p.read_bytes() for p in (tmp_path / "heads").iterdir()}
    for folder in (tmp_path / "heads", tmp_path / "new"):
        assert_user_error(run(*arguments, folder), f"cannot write {folder}: the disk is full; "
                                                   f"nothing was written")
    assert {p.name: p.read_bytes() for p in (tmp_path / "heads").iterdir()} == before
    assert not (tmp_path / "new").exists()
