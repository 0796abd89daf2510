"""Time to first step, as a user meets it: fresh processes of `python -m nanoandrea train` and
`nanoandrea sample`, with the kernel cache empty (a new machine) and then warm, beside PyTorch.

Every measurement starts a new interpreter and reads its output as it comes, so each figure is
seconds from the process's start (before Python itself starts) to a line of its output:
  cold    `python -m nanoandrea train --max-steps 20` with an empty kernel cache of its own:
          its first training-step line ("step     1 | loss ..."), and the compile line
  warm    the same command again, the cache filled: the first step line
  sample  `nanoandrea sample` from the checkpoint the warm run left: the first character of
          generated text after the prompt, then the tokens/s line
  torch   the same shape of model (tools/baselines/torch_gpt.py) trained by PyTorch in a fresh
          process, the same batch, fused AdamW, eagerly and under torch.compile: its first
          step done
Presets after the first share the first one's cache folder: what they add to it is what they
compile (andrea-120m's attention kernels are not andrea-12m's). The whole output of every
process goes to --logs, so that nothing is hidden, warnings included.
"""
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.timing import row

ROOT = Path(__file__).resolve().parents[2]
BASELINES = ROOT / "tools" / "baselines"
STEP = re.compile(r"^step\s+\d+ \| loss")


def timed_run(command, env, log, until=None, after=None):
    """Run `command`; return (seconds to the first output line matching `until` (None: none),
    every line with its time, the exit status). after: a prefix; the time is then to the first
    character of output after it (streamed text, not whole lines)."""
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, bufsize=0)
    lines, found, buffer, text = [], None, b"", ""
    while True:
        chunk = process.stdout.read1(4096)
        if not chunk:
            break
        now = time.perf_counter() - started
        text += chunk.decode(errors="replace")
        if after is not None and found is None and after in text and \
                len(text) > text.index(after) + len(after):
            found = now
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            line = line.decode(errors="replace")
            lines.append((now, line))
            if until is not None and found is None and until.search(line):
                found = now
    status = process.wait()
    if buffer:
        lines.append((time.perf_counter() - started, buffer.decode(errors="replace")))
    with open(log, "a") as f:
        f.write(f"$ {' '.join(command)}\n")
        f.writelines(f"[{t:7.2f} s] {line}\n" for t, line in lines)
        f.write(f"(exit status {status})\n\n")
    return found, lines, status


def seconds_text(seconds):
    return "never" if seconds is None else f"{seconds:.1f} s"


def measure_preset(preset, folder, log):
    env = dict(os.environ, NANOANDREA_KERNEL_CACHE=str(folder), PYTHONUNBUFFERED="1")
    out = Path(tempfile.mkdtemp(prefix=f"startup-{preset}-"))
    for label in ("cold", "warm"):
        command = [sys.executable, "-m", "nanoandrea", "train", "--preset", preset,
                   "--max-steps", "20", "--eval-interval", "20", "--out", str(out / label)]
        seconds, lines, status = timed_run(command, env, log, STEP)
        compiled = [line for _, line in lines if line.startswith("compiled ")]
        note = f"first step at {seconds_text(seconds)}, exit {status}" + (
            f"; {compiled[-1]}" if compiled else "")
        row("startup", f"{preset} train, {label} cache: first step", 1e3 * (seconds or 0), None,
            "", note=note)
    command = [sys.executable, "-m", "nanoandrea", "sample", "--checkpoint",
               str(out / "warm" / "ckpt"), "--prompt", "ROMEO:", "--max-new-tokens", "200"]
    seconds, lines, status = timed_run(command, env, log, after="ROMEO:")
    rate = [line for _, line in lines if "tokens/s" in line]
    row("startup", f"{preset} sample: first token", 1e3 * (seconds or 0), None, "",
        note=f"exit {status}" + (f"; {rate[-1]}" if rate else ""))


TORCH_FIRST_STEP = """
import sys
import torch
sys.path.insert(0, sys.argv[1])
from nanoandrea.config import get_preset
from torch_gpt import TorchGPT
config = get_preset(sys.argv[2], vocab_size=65, block_size=256)
model = TorchGPT(config, device="cuda")
step_model = torch.compile(model) if sys.argv[3] == "compile" else model
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
idx = torch.randint(0, 65, (64, 256), device="cuda")
_, loss = step_model(idx, idx)
loss.backward()
optimizer.step()
torch.cuda.synchronize()
print("first step done")
"""


def measure_torch(preset, log):
    for mode in ("eager", "compile"):
        command = [sys.executable, "-c", TORCH_FIRST_STEP, str(BASELINES), preset, mode]
        env = dict(os.environ, PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                            os.environ.get("PYTHONPATH")])))
        seconds, _, status = timed_run(command, env, log, re.compile(r"^first step done"))
        row("startup", f"{preset} PyTorch {mode}: first step", 1e3 * (seconds or 0), None, "",
            note=f"first step at {seconds_text(seconds)}, exit {status}")


def bench_startup(args):
    """Each preset of --models (default andrea-12m, andrea-120m): ours cold, warm, sampling;
    PyTorch eager and compiled. The processes' output goes to --logs."""
    folder = Path(tempfile.mkdtemp(prefix="nanoandrea-kernels-"))     # empty: a new machine
    print(f"startup: kernel cache {folder} (empty at the start); every process's output in "
          f"{args.logs}", flush=True)
    for preset in (args.models or "andrea-12m,andrea-120m").split(","):
        measure_preset(preset, folder, args.logs)
        measure_torch(preset, args.logs)
