"""Time to first step, as a user meets it: fresh processes of `python -m nanoandrea.train` and
`nanoandrea sample`, with the kernel cache empty (a new machine) and then warm, beside PyTorch.

    python tools/startup.py [--presets andrea-12m,andrea-120m] [--json PATH]

Every measurement starts a new interpreter and reads its output as it comes, so each figure is
seconds from the process's start (before Python itself starts) to a line of its output:
  cold    `python -m nanoandrea.train --max-steps 20` with an empty kernel cache of its own:
          its first training-step line ("step     1 | loss ..."), and the compile line
  warm    the same command again, the cache filled: the first step line
  sample  `nanoandrea sample` from the checkpoint the warm run left: the first character of
          generated text after the prompt, then the tokens/s line
  torch   the same model (nanoandrea/torch_gpt.py) trained by PyTorch in a fresh process, the
          same batch, fused AdamW, eagerly and under torch.compile: its first step done
Presets after the first share the first one's cache folder: what they add to it is what they
compile (andrea-120m's attention kernels are not andrea-12m's). The whole output of every
process is written to LOGS (--logs), so that nothing is hidden, warnings included.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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
        chunk = process.stdout.read1(4096) if hasattr(process.stdout, "read1") else \
            process.stdout.read(1)
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


def train_command(preset, out):
    return [sys.executable, "-m", "nanoandrea.train", "--preset", preset, "--max-steps", "20",
            "--eval-interval", "20", "--out", str(out)]


def measure_preset(preset, folder, logs, results):
    env = dict(os.environ, NANOANDREA_KERNEL_CACHE=str(folder), PYTHONUNBUFFERED="1")
    out = Path(tempfile.mkdtemp(prefix=f"startup-{preset}-"))
    for label in ("cold", "warm"):
        seconds, lines, status = timed_run(train_command(preset, out / label), env, logs, STEP)
        compiled = [line for _, line in lines if line.startswith("compiled ")]
        results.append(dict(preset=preset, run=label, first_step_s=seconds, status=status,
                            compile_line=compiled[-1] if compiled else None))
        print(f"{preset} {label}: first step at {seconds if seconds is None else round(seconds, 1)}"
              f" s{'; ' + compiled[-1] if compiled else ''} (exit {status})", flush=True)
    sample = [sys.executable, "-m", "nanoandrea", "sample", "--checkpoint",
              str(out / "warm" / "ckpt"), "--prompt", "ROMEO:", "--max-new-tokens", "200"]
    seconds, lines, status = timed_run(sample, env, logs, after="ROMEO:")
    rate = [line for _, line in lines if "tokens/s" in line]
    results.append(dict(preset=preset, run="sample", first_token_s=seconds, status=status,
                        rate=rate[-1] if rate else None))
    print(f"{preset} sample: first token at {seconds if seconds is None else round(seconds, 1)} s;"
          f" {rate[-1] if rate else ''} (exit {status})", flush=True)


TORCH_FIRST_STEP = """
import sys, time
import torch
from nanoandrea.config import get_preset
from nanoandrea.torch_gpt import TorchGPT
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


def measure_torch(preset, logs, results):
    for mode in ("eager", "compile"):
        command = [sys.executable, "-c", TORCH_FIRST_STEP, "", preset, mode]
        seconds, _, status = timed_run(command, dict(os.environ, PYTHONUNBUFFERED="1"), logs,
                                       re.compile(r"^first step done"))
        results.append(dict(preset=preset, run=f"torch {mode}", first_step_s=seconds,
                            status=status))
        print(f"{preset} PyTorch {mode}: first step at "
              f"{seconds if seconds is None else round(seconds, 1)} s (exit {status})", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", default="andrea-12m,andrea-120m")
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--logs", default="startup.log", help="every process's whole output")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="nanoandrea-kernels-"))     # empty: a new machine
    results = []
    print(f"{time.strftime('%Y-%m-%d')}: kernel cache {folder} (empty at the start)", flush=True)
    for preset in args.presets.split(","):
        measure_preset(preset, folder, args.logs, results)
        if not args.no_torch:
            measure_torch(preset, args.logs, results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
