"""What data-parallel communication costs a training step, measured on one GPU (a world of one),
at the end-to-end cases' shapes (andrea-12m B=64 T=256, andrea-120m B=16 T=1024).

With one rank NCCL's all-reduce moves no data between GPUs, but every call is still made and
launched as on many: the bucket all-reduces (one NCCL group a layer, plus the embeddings' and
the loss's) on the step's second stream inside the CUDA graph, or after the graph. So the
difference to the plain step is what the buckets' launches and NCCL's kernels cost a step,
the part of a multi-GPU step that does not shrink with more GPUs. Each variant is first
checked against the plain step (the same losses, bit for bit), then timed: consecutive steps
between two CUDA events, after warm-up, the median of 5 windows. Also timed alone: one
all-reduce of the whole gradient buffer, and the bucketed all-reduces in a row.

Rows: plain (no communicator), NCCL in the graph (train's default with several ranks), NCCL
after the graph (train --no-overlap-comm), NCCL in the graph with ZeRO-1 (train --zero1).
"""
import numpy as np

from benchmarks.timing import Mismatch, median_ms_per_call, row, warm_up_and_time_one

CASES = [("andrea-12m", 64, 256), ("andrea-120m", 16, 1024)]
VARIANTS = {"plain": None, "NCCL in the graph": (True, False),
            "NCCL after the graph": (False, False), "NCCL in the graph, ZeRO-1": (True, True)}


def make_step(backend, config, B, world, variant):
    """(a training step, its data-parallel buckets or None) of one variant: (communicate in
    the graph, ZeRO-1), or None for the plain step."""
    from nanoandrea.distributed import data_parallel
    from nanoandrea.model import GPT
    from nanoandrea.optim import AdamW
    from nanoandrea.step import TrainStep
    zero1 = variant is not None and variant[1]
    model = GPT(config, backend, seed=1, moments=not zero1)
    parallel = None
    if variant is None:
        optimizer = AdamW(model.params, lr=1e-4)
    else:
        optimizer, parallel = data_parallel(
            model.params, world.communicator or world.connect(backend), zero1, lr=1e-4)
    step = TrainStep(model, optimizer, B, config.block_size, 1, parallel=parallel,
                     communicate_in_graph=True if variant is None else variant[0])
    return step, parallel


def steps_ms(step, data, per_window=10, windows=5):
    """Median ms per step over windows of consecutive steps (no wait for the GPU inside)."""
    calls = iter(range(10 ** 9))

    def one_step():
        n = next(calls)
        step(data[n % len(data)], [n], 1e-4)
    warm_up_and_time_one(one_step, 3)           # eager, capture, replays
    return median_ms_per_call(one_step, per_window, windows)


def bench_ddp(args):
    from cupy.cuda import nccl

    from nanoandrea.backend import get_backend
    from nanoandrea.config import get_preset
    from nanoandrea.distributed import Address, World, _free_port
    backend = get_backend("cuda", precision=args.precision)
    world = World(0, 1, 0, Address("127.0.0.1", _free_port()))
    print(f"ddp: matmuls {backend.precision}, NCCL {nccl.get_version()}, a world of one")
    for preset, B, T in CASES:
        if args.models and preset not in args.models:
            continue
        config = get_preset(preset, block_size=T, dropout=0.0)
        rng = np.random.default_rng(0)
        data = [[(rng.integers(0, config.vocab_size, (B, T)),) * 2] for _ in range(4)]
        reference, plain_ms, buckets = None, None, None
        tokens = B * T
        for name, variant in VARIANTS.items():
            step, parallel = make_step(backend, config, B, world, variant)
            losses = [float(backend.to_host(step(micro, [n], 1e-4))[0])
                      for n, micro in enumerate(data)]
            if reference is None:
                reference = losses
            elif losses != reference:
                raise Mismatch(f"ddp {preset} {name}: losses {losses} differ from the plain "
                               f"step's {reference}")
            ms = steps_ms(step, data)
            plain_ms = plain_ms or ms
            row("ddp", f"{preset} B={B} T={T} {name}", ms, None, "",
                note=f"{ms - plain_ms:+.3f} ms against plain, {tokens / ms * 1e3:,.0f} tok/s")
            buckets = parallel or buckets
            del step
        store, communicator = buckets.store, buckets.communicator
        whole = median_ms_per_call(lambda: communicator.all_reduce([store.grads]), 20, 5)
        bucketed = median_ms_per_call(lambda: [communicator.all_reduce(
            [store.grads[a:b] for a, b in ranges]) for ranges in buckets.ranges], 20, 5)
        row("ddp", f"{preset} one all-reduce of the gradients", whole, None, "",
            note=f"{store.size:,} floats")
        row("ddp", f"{preset} the {len(buckets.ranges)} buckets in a row", bucketed, None, "")
