"""A training run's folder (train --out, default out/): the names a run writes there, and when
train may write there at all.

A run writes these names and no others, so the folder may hold the user's own files beside
them:
    ckpt/ best/                checkpoints (nanoandrea.checkpoint)
    metrics.jsonl samples.txt loss.png heads_grad.png
    hidden ones                .ckpt.* .best.* (a checkpoint being switched), .ckpt-* .best-*
                               (the older layout's), .NAME.tmp of a file being replaced
The folder holds a run when its ckpt or best is a checkpoint, or its metrics.jsonl is a run's
log (a run stopped before its first checkpoint). Then
    train               refuses, naming the step the run's checkpoint holds
    train --resume      continues it
    train --overwrite   deletes the run's names once the new run starts (start_over); the
                        user's other files stay
A name a run writes that holds something a run did not write (the user's own samples.txt, a
folder ckpt/ that is not a checkpoint) is refused whatever the flags.
"""
import json
import os
import re
from pathlib import Path

from .checkpoint import NAMES, checkpoint_folder
from .files import fsync_folder, remove, replacing, unwritable

LOGS = ("metrics.jsonl", "samples.txt")
PLOTS = ("loss.png", "heads_grad.png")
HIDDEN = (".ckpt.*", ".best.*", ".ckpt-*", ".best-*", *(f".{name}.tmp" for name in LOGS + PLOTS))


SAMPLE_HEADING = re.compile(r"^=== step (\d+) ===$", re.MULTILINE)     # (train.Run.write_sample)


class OutFolderError(ValueError):
    """train cannot write in its --out folder; the message says what to do."""


class RunFolder:
    """What a folder holds of a run: `names`, the run's names there; `foreign`, the names a
    run writes that hold something else; `step`, the step its checkpoint holds (ckpt's, else
    best's; None: no checkpoint, or one too damaged to say)."""

    def __init__(self, out):
        self.out = Path(out)
        self.names, self.foreign, self.step, self.imported_from = [], [], None, None
        self.has_checkpoint = False
        for name in NAMES:
            folder = checkpoint_folder(self.out / name)
            if not folder.exists():
                continue
            if folder.is_dir() and any((folder / f).is_file() for f in ("state.json",
                                                                          "model.safetensors")):
                self.names.append(name)
                if not self.has_checkpoint:
                    state = _state(folder)
                    self.step, self.imported_from = state.get("step"), state.get("imported_from")
                self.has_checkpoint = True
            else:
                self.foreign.append(name)
        metrics = self.out / "metrics.jsonl"
        logged = metrics.exists() and _is_a_log(metrics)
        if metrics.exists():
            (self.names if logged else self.foreign).append(metrics.name)
        samples = self.out / "samples.txt"
        if samples.exists():
            (self.names if _are_samples(samples) else self.foreign).append(samples.name)
        self.is_run = self.has_checkpoint or logged
        for name in PLOTS:
            if (self.out / name).exists():
                (self.names if self.is_run else self.foreign).append(name)


def _state(folder):
    """A checkpoint folder's state.json, {} where it is missing or damaged."""
    try:
        state = json.loads((folder / "state.json").read_text())
        return state if isinstance(state, dict) and isinstance(state.get("step"), int) else {}
    except (OSError, ValueError):
        return {}


def checkpoint_step(out):
    """The step OUT/ckpt holds; None where there is none (or it is damaged)."""
    return _state(checkpoint_folder(Path(out) / "ckpt")).get("step")


def _is_a_log(path):
    """Whether path is a run's metrics.jsonl: a JSON object with a step on every line."""
    try:
        with open(path, encoding="utf-8") as file:
            for line in file:
                record = json.loads(line)
                if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                    return False
    except (OSError, ValueError):
        return False
    return True


def _are_samples(path):
    try:
        with open(path, encoding="utf-8") as file:
            start = file.read(len("=== step "))
    except (OSError, ValueError):
        return False
    return start in ("", "=== step ")


def check_run_folder(out, resume=False, overwrite=False):
    """Refuse, before any work, a run that would write over what is not its own (the module's
    doc): raises OutFolderError."""
    out = Path(out)
    found = RunFolder(out) if out.is_dir() else None
    if resume and (found is None or "ckpt" not in found.names):
        raise OutFolderError(f"--resume: no checkpoint in {out} (expected {out / 'ckpt'})")
    problem = unwritable(out)
    if problem:
        raise OutFolderError(f"cannot write the run's folder {out}: {problem} (choose another "
                             f"--out)")
    if found is None:
        return
    if found.foreign:
        raise OutFolderError(
            f"{out} holds {', '.join(found.foreign)}, which no run of nanoandrea wrote, where a "
            f"run writes: choose another --out, or move them")
    if found.is_run and not resume and not overwrite:
        deletes = f"--overwrite to start over (it deletes {', '.join(found.names)})"
        if not found.has_checkpoint:
            raise OutFolderError(f"{out} holds a run stopped before its first checkpoint: "
                                 f"choose another --out for a new run, or {deletes}")
        held = ("a damaged checkpoint" if found.step is None else
                f"a model imported from {found.imported_from}" if found.imported_from else
                f"its checkpoint at step {found.step}")
        verb = "fine-tune it" if found.imported_from else "continue it"
        raise OutFolderError(f"{out} holds a run ({held}): --resume to {verb}, another --out "
                             f"for a new run, or {deletes}")


def start_over(out):
    """Delete the run in out (train --overwrite), only its names: each checkpoint first made
    hidden by a rename (a kill midway leaves no half-deleted ckpt that would pass for the
    user's), then deleted. Returns the names deleted."""
    out = Path(out)
    if not out.is_dir():
        return []
    found = RunFolder(out)
    for name in NAMES:
        target = out / name
        if name in found.names and (target.exists() or target.is_symlink()):
            remove(out / f".{name}.deleted")            # (an earlier start_over's, killed)
            os.rename(target, out / f".{name}.deleted")
    fsync_folder(out)
    for name in found.names:
        if name not in NAMES:
            (out / name).unlink()
    for pattern in HIDDEN:
        for path in out.glob(pattern):
            remove(path)
    return found.names


def truncate_logs(out, step):
    """Drop what a stopped run logged after its checkpoint's step (metrics.jsonl's lines, the
    samples in samples.txt): the resumed run logs those steps again."""
    out = Path(out)
    metrics = out / "metrics.jsonl"
    if metrics.exists():
        lines = metrics.read_text(encoding="utf-8").splitlines(keepends=True)
        _rewrite(metrics, lines, [line for line in lines if json.loads(line)["step"] <= step])
    samples = out / "samples.txt"
    if samples.exists():
        text = samples.read_text(encoding="utf-8")
        later = next((found.start() for found in SAMPLE_HEADING.finditer(text)
                      if int(found.group(1)) > step), len(text))
        _rewrite(samples, [text], [text[:later]])


def _rewrite(path, before, after):
    """path's lines `after` in place of `before`, through a renamed temporary (a kill leaves
    one or the other whole)."""
    if after == before:
        return
    with replacing(path) as temporary, open(temporary, "w", encoding="utf-8") as file:
        file.writelines(after)
        file.flush()
        os.fsync(file.fileno())
