"""Hugging Face interop (nanoandrea/hf.py): a GPT2LMHeadModel saved by transformers imports,
samples, fine-tunes and exports again with the same logits; exported folders load in
transformers as they are; bad folders end in one line. On the CPU backend in CI; on the GPU
machine `load_model` takes the GPU, and the same logits are checked there."""
import errno
import json
import struct

import numpy as np
import pytest
import torch
import transformers

from conftest import GPU
from nanoandrea.autograd import no_grad
from nanoandrea.checkpoint import load_safetensors, read_checkpoint
from nanoandrea.sample import load_model
from nanoandrea.tokenizer import BPETokenizer
from test_cli import TEXT, TINY, assert_user_error, cache, corpus, metrics, run  # noqa: F401

SHAPE = dict(vocab_size=320, n_positions=32, n_embd=32, n_layer=2, n_head=4)


@pytest.fixture
def hf_folder(tmp_path):
    """A randomly initialised GPT-2 as transformers saves it, with a byte-level BPE's
    vocab.json and merges.txt beside it."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(**SHAPE, bos_token_id=None, eos_token_id=None)
    model = transformers.GPT2LMHeadModel(config).eval()
    folder = tmp_path / "hf"
    model.save_pretrained(folder)
    BPETokenizer.train(TEXT, 300).to_gpt2_files(folder)
    return folder


def hf_logits(folder, ids, auto=False):
    kind = transformers.AutoModelForCausalLM if auto else transformers.GPT2LMHeadModel
    model = kind.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(torch.as_tensor(ids)).logits.numpy()


def our_logits(checkpoint, ids):
    model, _ = load_model(checkpoint, "auto")
    with no_grad():
        logits, _ = model.forward(np.asarray(ids))
    return model.backend.to_host(logits.data)[..., :model.config.vocab_size]


def assert_close(got, want, tolerance=1e-4):
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= tolerance * np.abs(want).max()


def test_import_sample_export_round_trip(hf_folder, tmp_path):
    ids = np.random.default_rng(0).integers(0, SHAPE["vocab_size"], size=(2, 20))
    want = hf_logits(hf_folder, ids)
    result = run("import", "--from-hf", hf_folder, tmp_path / "run")
    assert result.exit_code == 0, result.output
    assert_close(our_logits(tmp_path / "run" / "ckpt", ids), want)
    sampled = run("sample", "--checkpoint", tmp_path / "run" / "ckpt", "--prompt", "First",
                  "--max-new-tokens", "5", "--device", "cpu")
    assert sampled.exit_code == 0, sampled.output
    assert sampled.output.startswith("First")
    exported = run("export", "--checkpoint", tmp_path / "run" / "ckpt", "--to", "hf",
                   tmp_path / "exported")
    assert exported.exit_code == 0, exported.output
    for auto in (False, True):
        assert_close(hf_logits(tmp_path / "exported", ids, auto), want)
    config = json.loads((tmp_path / "exported" / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["n_embd"] == 32
    tokenizer = transformers.GPT2Tokenizer.from_pretrained(tmp_path / "exported")
    ours = BPETokenizer.from_gpt2_files(hf_folder / "vocab.json", hf_folder / "merges.txt")
    text = "Speak, speak. You are all resolved?"
    assert tokenizer.encode(text) == ours.encode(text).tolist()


def test_an_imported_model_fine_tunes_with_a_fresh_optimizer(hf_folder, tmp_path):
    run("import", "--from-hf", hf_folder, tmp_path / "run")
    corpus = tmp_path / "more.txt"
    corpus.write_text(TEXT)
    prepared = run("prepare", corpus, "--out", tmp_path / "data", "--gpt2-files", hf_folder)
    assert prepared.exit_code == 0, prepared.output
    result = run("train", "--out", tmp_path / "run", "--resume", "--data", tmp_path / "data",
                 "--device", "cpu", "--max-steps", "4", "--eval-interval", "4",
                 "--eval-iters", "2", "--batch-size", "2")
    assert result.exit_code == 0, result.output
    assert "fine-tuning" in result.output and "fresh optimizer state" in result.output
    banner = next(line for line in result.output.splitlines() if "parameters" in line)
    assert banner.startswith(f"GPT-2 imported from {hf_folder}: ") and "preset" not in result.output
    assert "andrea-mini" not in result.output and "andrea-120m" not in result.output
    saved = read_checkpoint(tmp_path / "run" / "ckpt")
    assert saved["state"]["step"] == 4 and saved["step_count"] == 4
    losses = [r["loss"] for r in metrics(tmp_path / "run") if "loss" in r]
    assert losses and all(np.isfinite(losses))


def test_exported_char_model_loads_in_transformers(corpus, tmp_path):
    out = tmp_path / "run"
    assert run("train", "--data", corpus, "--out", out, "--device", "cpu", *TINY,
               "--max-steps", "2", "--eval-interval", "2").exit_code == 0
    result = run("export", "--checkpoint", out / "ckpt", tmp_path / "exported")
    assert result.exit_code == 0 and "char_vocab.json" in result.output
    ids = np.arange(16).reshape(2, 8) % 20
    assert_close(hf_logits(tmp_path / "exported", ids), our_logits(out / "ckpt", ids))
    chars = json.loads((tmp_path / "exported" / "char_vocab.json").read_text())
    assert len(chars) == read_checkpoint(out / "ckpt")["tokenizer"].vocab_size
    again = run("import", "--from-hf", tmp_path / "exported", tmp_path / "back")
    assert again.exit_code == 0, again.output          # (its own tokenizer.json came along)
    assert_close(our_logits(tmp_path / "back" / "ckpt", ids), our_logits(out / "ckpt", ids))


def test_bad_hf_folders_end_in_one_line(hf_folder, tmp_path):
    assert_user_error(run("import", "--from-hf", tmp_path, tmp_path / "a"), "no config.json")
    config = json.loads((hf_folder / "config.json").read_text())
    (hf_folder / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    assert_user_error(run("import", "--from-hf", hf_folder, tmp_path / "b"), "'llama'")
    (hf_folder / "config.json").write_text(json.dumps({**config, "n_embd": 64}))
    assert_user_error(run("import", "--from-hf", hf_folder, tmp_path / "c"),
                      "wte.weight has shape (320, 32)")
    (hf_folder / "config.json").write_text(json.dumps(config))
    tensors, _ = load_safetensors(hf_folder / "model.safetensors")
    del tensors["transformer.h.1.mlp.c_fc.bias"]
    from nanoandrea.checkpoint import save_safetensors
    save_safetensors(hf_folder / "model.safetensors", tensors)
    assert_user_error(run("import", "--from-hf", hf_folder, tmp_path / "d"),
                      "h.1.mlp.c_fc.bias")
    for name in "abcd":
        assert not (tmp_path / name / "ckpt").exists()
    assert_user_error(run("export", "--checkpoint", tmp_path / "nothing", tmp_path / "e"),
                      "no checkpoint")


def test_checkpoints_written_before_the_safetensors_package_still_load(tmp_path):
    """The layout nanoandrea wrote by hand until 2026-12-01: 8 bytes of header size, the JSON
    header padded with spaces to 8 bytes, the raw little-endian tensors."""
    tensors = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(4, np.float64)}
    header, offset, blobs = {}, 0, []
    for name, array in tensors.items():
        blob = array.tobytes()
        header[name] = {"dtype": "F32" if array.dtype == np.float32 else "F64",
                        "shape": list(array.shape), "data_offsets": [offset, offset + len(blob)]}
        offset, blobs = offset + len(blob), blobs + [blob]
    header["__metadata__"] = {"step_count": "7"}
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    path = tmp_path / "old.safetensors"
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"".join(blobs))
    loaded, metadata = load_safetensors(path)
    assert metadata == {"step_count": "7"}
    for name, array in tensors.items():
        assert loaded[name].dtype == array.dtype and np.array_equal(loaded[name], array)


@pytest.mark.skipif(not GPU, reason="the GPU's logits: on the GPU machine")
def test_imported_logits_on_the_gpu_equal_transformers(hf_folder, tmp_path):
    ids = np.random.default_rng(1).integers(0, SHAPE["vocab_size"], size=(2, 24))
    run("import", "--from-hf", hf_folder, tmp_path / "run")
    model, _ = load_model(tmp_path / "run" / "ckpt", "cuda", precision="fp32")
    with no_grad():
        logits, _ = model.forward(ids)
    got = model.backend.to_host(logits.data)[..., :SHAPE["vocab_size"]]
    assert_close(got, hf_logits(hf_folder, ids))


def test_import_and_export_write_only_a_new_folder_whole(hf_folder, tmp_path, monkeypatch):
    """import refuses a folder that is not empty (a run's: its trained ckpt and best stay), as
    export does; a disk that fills midway leaves neither a half-written folder nor a
    temporary one."""
    run_folder = tmp_path / "run"
    assert run("import", "--from-hf", hf_folder, run_folder).exit_code == 0
    (run_folder / "notes.txt").write_text("mine")
    before = {p: p.read_bytes() for p in run_folder.rglob("*") if p.is_file()}
    for command in (("import", "--from-hf", hf_folder, run_folder),
                    ("export", "--checkpoint", run_folder / "ckpt", run_folder)):
        assert_user_error(run(*command), f"{run_folder} exists and is not empty: choose a new "
                                         f"folder")
    assert {p: p.read_bytes() for p in run_folder.rglob("*") if p.is_file()} == before
    from nanoandrea import checkpoint, hf

    def disk_full(path, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    with monkeypatch.context() as disk:
        disk.setattr(checkpoint, "save_safetensors", disk_full)
        disk.setattr(hf, "save_safetensors", disk_full)
        for command, out in ((("import", "--from-hf", hf_folder), tmp_path / "imported"),
                             (("export", "--checkpoint", run_folder / "ckpt"), tmp_path / "hf2")):
            assert_user_error(run(*command, out), f"cannot write {out}: the disk is full; "
                                                  f"nothing was written")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"]
