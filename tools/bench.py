"""Benchmark nanoandrea on the GPU against cuBLAS, SDPA and PyTorch: one command, in sections.

    python tools/bench.py                               # the default sections, a table at the end
    python tools/bench.py --only matmul,attention --precision bf16
    python tools/bench.py --only e2e --precision bf16 --compile --models andrea-120m,andrea-12m
    python tools/bench.py --only profile --precision bf16
    python tools/bench.py --only hardware --json hardware.json --plot docs/hardware.png
    python tools/bench.py --replot hardware.json --plot docs/hardware.png     # (no GPU)

Every timing is the median of repeated runs measured with CUDA events after warm-up, the
competitors run in the same process on the same shapes, and every output of ours is checked
against a reference before it is timed: a mismatch stops the section (exit status 1).
Sections (tools/benchmarks/<module>.py; the default runs those marked *):
  matmul *    the products of a training step against cuBLAS (matmul.py)
  attention * causal attention, forward and backward, against SDPA (attention.py)
  small *     the fused memory-bound kernels against PyTorch's ops, in GB/s (small.py)
  products *  each product of one bf16 training step as the step makes it, against cuBLAS bf16
              (step.py)
  e2e *       training tokens/s of whole steps against the PyTorch GPT-2 a user trains
              (step.py; --compile: under torch.compile too)
  profile *   each kernel's GPU time in one step, ours and PyTorch's side by side (step.py)
  train *     andrea-12m on tiny Shakespeare: the loss must fall (step.py)
  sample *    generation with the key/value cache, without it, and Hugging Face's (sample.py)
  startup     time to the first step and the first token in fresh processes, cold and warm
              kernel cache, beside PyTorch's first step (startup.py)
  ddp         what data-parallel communication costs a step, on one GPU (ddp.py; needs NCCL)
  hardware    one fused projection against per-head products, and attention by head size
              (hardware.py: docs/hardware.md's figures; --plot draws them)
--precision (fp32, tf32, bf16) is the matmuls' precision in matmul, attention, products, e2e,
profile and ddp, and PyTorch's to match (float32 with TF32 off, TF32 on, bf16 autocast).
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("CUPY_TF32", "0")         # (read when CuPy is imported)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import attention, ddp, hardware, matmul, sample, small, startup, step  # noqa: E402
from benchmarks.timing import RESULTS, Mismatch, device_name, warm_up_clocks  # noqa: E402

SECTIONS = {"matmul": matmul.bench_matmul, "attention": attention.bench_attention,
            "small": small.bench_small, "products": step.bench_products, "e2e": step.bench_e2e,
            "profile": step.bench_profile, "train": step.bench_train,
            "sample": sample.bench_sample, "startup": startup.bench_startup,
            "ddp": ddp.bench_ddp, "hardware": hardware.bench_hardware}
DEFAULT = "matmul,attention,small,products,e2e,profile,train,sample"


def parse_arguments():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 2)[2])
    parser.add_argument("--only", default=DEFAULT, help=f"sections, a comma list of "
                        f"{', '.join(SECTIONS)} (default {DEFAULT})")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "tf32", "bf16"],
                        help="the matmuls' precision, ours and PyTorch's")
    parser.add_argument("--json", default=None, help="write every row here")
    parser.add_argument("--repeat", type=int, default=10, help="timings a kernel's median is of")
    parser.add_argument("--quick", action="store_true", help="skip the largest shapes")
    parser.add_argument("--shapes", default=None,
                        help="only these shapes (comma list): matmul labels' starts (qkv, "
                             "mlp, lm, 12m), attention's T x D (1024x64, 256x32, 1024x72)")
    parser.add_argument("--models", default=None,
                        help="e2e, profile, products, ddp, startup: only these presets")
    parser.add_argument("--e2e-repeat", type=int, default=5, help="e2e: rounds of timings")
    parser.add_argument("--compile", action="store_true",
                        help="e2e: PyTorch's GPT-2 under torch.compile too")
    parser.add_argument("--top", type=int, default=25, help="profile: how many kernels to list")
    parser.add_argument("--train-steps", type=int, default=50)
    parser.add_argument("--cache", default=None, help="train: a folder for prepared data")
    parser.add_argument("--logs", default="startup.log",
                        help="startup: where every process's whole output goes")
    parser.add_argument("--plot", default=None, help="hardware: draw its figures here")
    parser.add_argument("--replot", default=None, metavar="JSON",
                        help="draw --plot from the hardware rows of an earlier --json; measure "
                             "nothing")
    args = parser.parse_args()
    unknown = [name for name in args.only.split(",") if name not in SECTIONS]
    if unknown:
        parser.error(f"--only: no section {', '.join(unknown)} (sections: {', '.join(SECTIONS)})")
    if args.replot and not args.plot:
        parser.error("--replot draws --plot PATH: name it")
    return args


def main():
    args = parse_arguments()
    if args.replot:
        hardware.plot(hardware.hardware_rows(json.loads(Path(args.replot).read_text())),
                      args.plot)
        return
    print(f"device: {device_name()}, date {time.strftime('%Y-%m-%d')}")
    warm_up_clocks()
    status = 0
    for name in args.only.split(","):
        try:
            SECTIONS[name](args)
        except Mismatch as error:
            print(f"MISMATCH: {error}", flush=True)
            status = 1
        except Exception as error:          # a broken section must not cost the others' time
            import traceback
            traceback.print_exc()
            print(f"ERROR in section {name}: {type(error).__name__}: {error}", flush=True)
            status = 1
    if args.json:
        Path(args.json).write_text(json.dumps(RESULTS, indent=1))
    print("\nsummary")
    for r in RESULTS:
        ratio = f"{r['ratio']:.2f}x {r['baseline']}" if r["ratio"] else ""
        rate = f"{r['rate']:.2f} {r['unit']}" if r["rate"] else ""
        print(f"{r['section']:9s} {r['name']:46s} {r['ms']:9.3f} ms {rate:>16s} {ratio}")
    sys.exit(status)


if __name__ == "__main__":
    main()
