"""What data-parallel communication costs a training step, measured on one GPU (a world of one).

    python tools/ddp_overlap.py                          # andrea-12m, B=64 T=256
    python tools/ddp_overlap.py --preset andrea-120m --batch-size 16 --block-size 1024

With one rank NCCL's all-reduce moves no data between GPUs, but every call is still made and
launched as on many: the bucket all-reduces (one NCCL group a layer, plus the embeddings' and
the loss's) on the step's second stream inside the CUDA graph, or after the graph. So the
difference to the plain step is what the buckets' launches and NCCL's kernels cost a step,
the part of a multi-GPU step that does not shrink with more GPUs. Each variant is first
checked against the plain step (the same losses, bit for bit), then timed: consecutive steps
between two CUDA events, after warm-up, the median of 5 windows. Also timed alone: one
all-reduce of the whole gradient buffer, and the bucketed all-reduces in a row.

Rows: plain (no communicator), NCCL in the graph (train's default with several ranks), NCCL
after the graph (--no-overlap-comm), NCCL in the graph with ZeRO-1 (--zero1).
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import median_ms_per_call, warm_up_and_time_one        # noqa: E402

from nanoandrea.backend import get_backend, resolve_precision   # noqa: E402
from nanoandrea.config import get_preset                          # noqa: E402
from nanoandrea.distributed import Address, World, _free_port, data_parallel  # noqa: E402
from nanoandrea.model import GPT                                  # noqa: E402
from nanoandrea.optim import AdamW                                # noqa: E402
from nanoandrea.step import TrainStep                             # noqa: E402

VARIANTS = {"plain": None, "NCCL in the graph": (True, False),
            "NCCL after the graph": (False, False), "NCCL in the graph, ZeRO-1": (True, True)}


def make_step(args, backend, config, world, variant):
    zero1 = variant is not None and variant[1]
    model = GPT(config, backend, seed=1, moments=not zero1)
    parallel = None
    if variant is None:
        optimizer = AdamW(model.params, lr=1e-4)
    else:
        optimizer, parallel = data_parallel(
            model.params, world.communicator or world.connect(backend), zero1, lr=1e-4)
    step = TrainStep(model, optimizer, args.batch_size, config.block_size, args.grad_accum,
                     parallel=parallel,
                     communicate_in_graph=True if variant is None else variant[0])
    return step, parallel


def steps_ms(step, data, per_window=10, windows=5):
    """Median ms per step over windows of consecutive steps (no wait for the GPU inside)."""
    calls = iter(range(10 ** 9))

    def one_step():
        n = next(calls)
        step(data[n % len(data)], [n] * len(data[0]), 1e-4)
    warm_up_and_time_one(one_step, 3)           # eager, capture, replays
    return median_ms_per_call(one_step, per_window, windows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="andrea-12m")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"])
    parser.add_argument("--vocab-size", type=int, default=None)
    args = parser.parse_args()
    backend = get_backend("cuda", precision=resolve_precision(args.precision, "cuda"))
    config = get_preset(args.preset, block_size=args.block_size, dropout=0.0,
                        **({"vocab_size": args.vocab_size} if args.vocab_size else {}))
    world = World(0, 1, 0, Address("127.0.0.1", _free_port()))
    from cupy.cuda import nccl
    print(f"{args.preset}, B={args.batch_size} T={config.block_size} x {args.grad_accum}, "
          f"matmuls {backend.precision}, NCCL {nccl.get_version()}, a world of one")
    rng = np.random.default_rng(0)
    data = [[(rng.integers(0, config.vocab_size, (args.batch_size, config.block_size)),) * 2
             for _ in range(args.grad_accum)] for _ in range(4)]

    reference, rows, buckets = None, [], None
    for name, variant in VARIANTS.items():
        step, parallel = make_step(args, backend, config, world, variant)
        losses = [float(backend.to_host(step(micro, [n] * len(micro), 1e-4))[0])
                  for n, micro in enumerate(data)]
        if reference is None:
            reference = losses
        elif losses != reference:
            sys.exit(f"{name}: losses {losses} differ from the plain step's {reference}")
        rows.append((name, steps_ms(step, data)))
        buckets = parallel or buckets
        del step

    store, communicator = buckets.store, buckets.communicator
    whole = median_ms_per_call(lambda: communicator.all_reduce([store.grads]), 20, 5)
    bucketed = median_ms_per_call(lambda: [communicator.all_reduce(
        [store.grads[a:b] for a, b in ranges]) for ranges in buckets.ranges], 20, 5)
    plain = rows[0][1]
    tokens = args.batch_size * config.block_size * args.grad_accum
    print(f"{'variant':28s} {'ms/step':>9s} {'cost':>9s} {'tokens/s':>11s}")
    for name, ms in rows:
        print(f"{name:28s} {ms:9.3f} {ms - plain:+9.3f} {tokens / ms * 1e3:11,.0f}")
    print(f"one all-reduce of the {store.size:,} gradients: {whole:.3f} ms; "
          f"{len(buckets.ranges)} buckets in a row: {bucketed:.3f} ms")


if __name__ == "__main__":
    main()
