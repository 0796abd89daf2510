"""Whole training steps, ours against PyTorch's on the same config and batch: andrea-12m
(B=64, T=256) and andrea-120m (B=16, T=1024), fused AdamW on every side.

    e2e        tokens/s of consecutive steps (forward, backward, AdamW) in the steady state:
               ours eager, captured as a CUDA graph on one stream, and on two (the default),
               against the GPT-2 a PyTorch user trains (tools/baselines/torch_gpt.py: float32
               with TF32 off, TF32 on, or bf16 autocast, as --precision says; --compile: under
               torch.compile too)
    profile    each kernel's GPU time in one step, ours and PyTorch's side by side (through
               torch.profiler, whose CUPTI records Numba's kernels too)
    products   each matrix product of one bf16 step as the step makes it, timed alone beside
               cuBLAS bf16 in the same orientation
    train      andrea-12m on tiny Shakespeare for a few steps: the loss must fall
"""
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from numba import cuda

from benchmarks.timing import (Mismatch, kernel_ms, kernel_times, median_ms_per_call,
                               print_kernel_times, row, warm_up_and_time_one)

BASELINES = Path(__file__).resolve().parents[1] / "baselines"      # tools/baselines


E2E_CASES = [("andrea-12m", 64, 256, 4096), ("andrea-120m", 16, 1024, 50257)]


def e2e_cases(args):
    """(preset, B, T, config, our step(graph), {name: a PyTorch step}) of each end-to-end case:
    the same config, the same batch, fused AdamW on every side. The PyTorch step: "PyTorch
    GPT-2", the model a PyTorch user trains (tools/baselines/torch_gpt.py: nn.Linear, one fused
    QKV product, the tied LM head); with --compile also that model under torch.compile."""
    import torch
    from nanoandrea.backend import get_backend
    from nanoandrea.config import get_preset
    from nanoandrea.model import GPT
    from nanoandrea.optim import AdamW
    from nanoandrea.precompile import compile_kernels, kernels_of
    from nanoandrea.step import TrainStep
    sys.path.insert(0, str(BASELINES))
    from torch_gpt import TorchGPT
    torch.backends.cuda.matmul.allow_tf32 = args.precision == "tf32"    # (PyTorch's tf32 run)
    torch.backends.cudnn.allow_tf32 = False
    for preset, B, T, V in E2E_CASES:
        if (args.quick and preset == "andrea-120m") or (args.models and preset not in args.models):
            continue
        config = get_preset(preset, vocab_size=V, block_size=T)
        rng = np.random.default_rng(0)
        idx = rng.integers(0, V, size=(B, T)).astype(np.int32)
        targets = rng.integers(0, V, size=(B, T)).astype(np.int32)
        model = GPT(config, get_backend("cuda", precision=args.precision), seed=0)
        optimizer = AdamW(model.params, lr=1e-4)
        # (the step's kernels compiled first, in parallel processes, as a training run does:
        # compiled where first launched, one after another, they take minutes on a new machine)
        compile_kernels(kernels_of(lambda: TrainStep(model, optimizer, B, T, cuda_graph=False)(
            [(idx, targets)], [0], 1e-4)), report=print)

        def ours(graph, model=model, optimizer=optimizer, B=B, T=T, batch=(idx, targets),
                 second_stream=True):
            step = TrainStep(model, optimizer, B, T, train=False, cuda_graph=graph,
                             second_stream=second_stream)
            return lambda: step([batch], [0], 1e-4)
        ours.model = model                      # (the products section records its matmuls)
        tidx, ttargets = (torch.as_tensor(a, device="cuda").long() for a in (idx, targets))
        autocast = torch.autocast("cuda", dtype=torch.bfloat16,
                                  enabled=args.precision == "bf16")

        def torch_step(module, compile=False):
            optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4, fused=True)
            forward = torch.compile(module) if compile else module

            def step():
                optimizer.zero_grad(set_to_none=True)
                with autocast:
                    _, loss = forward(tidx, ttargets)
                loss.backward()
                optimizer.step()
            return step
        baselines = {"PyTorch GPT-2": torch_step(TorchGPT(config, device="cuda"))}
        if args.compile:
            baselines["PyTorch GPT-2 compiled"] = torch_step(TorchGPT(config, device="cuda"),
                                                             True)
        yield preset, B, T, config, ours, baselines


def steps_time_ms(steps, repeat, warmup=3, seconds=0.5):
    """Milliseconds per training step of each step function in `steps` ({name: step}), steady
    state: consecutive steps (about `seconds` of them) between two CUDA events, nothing waiting
    for the GPU between them, as in training, where the host prepares the next step while the
    GPU runs this one. The functions are timed in turns, one timing of each per round, so that
    a drift of the GPU's clocks over the minute this takes falls on all of them alike; the
    median over `repeat` rounds."""
    counts = {name: max(3, round(seconds / warm_up_and_time_one(step, warmup)))
              for name, step in steps.items()}
    timings = {name: [] for name in steps}
    for _ in range(repeat):
        for name, step in steps.items():
            timings[name].append(median_ms_per_call(step, counts[name], 1, cuda.synchronize))
    return {name: statistics.median(values) for name, values in timings.items()}


def bench_e2e(args):
    from nanoandrea.mfu import flops_per_token
    theirs = {"bf16": "autocast bf16", "tf32": "float32, TF32 on"}.get(args.precision, "float32")
    print(f"end to end: training steps (forward, backward, AdamW), matmuls {args.precision} "
          f"(PyTorch {theirs}), steady state")
    for preset, B, T, config, ours, baselines in e2e_cases(args):
        tokens = B * T
        # ours: the step eagerly (every launch from Python), then captured as a CUDA graph on
        # one stream, and with a second stream (the default: nanoandrea/schedule.py)
        modes = {"eager": dict(graph=False),
                 "graph, one stream": dict(graph=True, second_stream=False),
                 "graph": dict(graph=True)}
        # (each of the first two alone, then the default and the PyTorch steps in turns: the
        # ratios from timings that alternate, so that a drift of the clocks falls on all)
        ours_ms = {mode: steps_time_ms({mode: ours(**kw)}, args.e2e_repeat)[mode]
                   for mode, kw in modes.items() if mode != "graph"}
        turns = steps_time_ms({"graph": ours(**modes["graph"]), **baselines}, args.e2e_repeat)
        ours_ms["graph"] = turns.pop("graph")
        flops = flops_per_token(config) * tokens
        anchor = "PyTorch GPT-2"
        for mode, ms in ours_ms.items():
            row("e2e", f"{preset} B={B} T={T} step, {mode}", ms, flops, "TFLOP/s",
                turns[anchor], anchor, f"ours {tokens / ms * 1e3:,.0f} tok/s "
                f"(MFU {mfu(flops, ms, args.precision)})")
        for name, torch_ms in turns.items():
            row("e2e", f"{preset} B={B} T={T} step, graph against", ours_ms["graph"], flops,
                "TFLOP/s", torch_ms, name, f"{name} {tokens / torch_ms * 1e3:,.0f} tok/s "
                f"(MFU {mfu(flops, torch_ms, args.precision)})")


def bench_profile(args):
    """Each kernel's GPU time in one training step, ours and PyTorch's side by side
    (kernel_times). Our step runs eagerly here: the same kernels a graph replays."""
    for preset, B, T, config, ours, baselines in e2e_cases(args):
        for side, fn in (("ours", ours(False)), *baselines.items()):
            times = kernel_times(fn, 3)
            total = sum(ms for _, ms in times.values())
            # (issue 64 counts launches a step, before and after a fusion: the kernels', not
            # the copies' the profiler lists beside them)
            launches = sum(count for name, (count, _) in times.items()
                           if not name.startswith("Memcpy") and not name.startswith("Memset"))
            print(f"profile: {preset} B={B} T={T}, {side}: {total:.2f} ms of kernels per step, "
                  f"{launches:.0f} kernel launches")
            print_kernel_times(times, args.top)


def bf16_tensor(x):
    """A Bf16Matrix as the bf16 tensor [R, C] of its values (a view of its bf16 pairs)."""
    import torch
    return torch.as_tensor(x.bf16_pairs, device="cuda").view(torch.bfloat16)[:, :x.shape[1]]


def bench_products(args):
    """The matrix products of one training step as the step makes them (shapes, orientations,
    epilogues, accumulation and split-K as the model's linear layers ask: an eager step's
    backend.matmul calls, recorded), each timed on its own and summed, beside cuBLAS bf16 (torch)
    on the same bf16 operands in the same orientation with bf16 out, what autocast runs (its
    GELU, bias gradients and the like are kernels of their own there, not counted). The
    isolated products of `--only matmul` are in the forward's orientation and plain; these
    say where the step's product time goes."""
    import torch

    from nanoandrea.kernels.operands import Bf16Matrix, rounded_bf16
    if args.precision != "bf16":
        print("products: bf16 only (--precision bf16)")
        return
    for preset, B, T, config, ours, baselines in e2e_cases(args):
        step = ours(False)
        step()                                  # (compiled, warm)
        calls = []                              # (out, [a], [b], bias, flags)

        def recorded(out, a, b, bias=None, **flags):
            calls.append((out, [a], [b], bias, flags))
            backend_matmul(out, a, b, bias, **flags)

        def recorded_sum(out, pairs, **flags):  # (a sum of products: one call, one pass)
            calls.append((out, [a for a, _ in pairs], [b for _, b in pairs], None, flags))
            backend_matmul_sum(out, pairs, **flags)
        backend = ours.model.backend
        backend_matmul, backend_matmul_sum = backend.matmul, backend.matmul_sum
        backend.matmul, backend.matmul_sum = recorded, recorded_sum
        try:
            step()
        finally:
            backend.matmul, backend.matmul_sum = backend_matmul, backend_matmul_sum
        cuda.synchronize()
        groups = {}                             # signature -> (count, first call)
        for out, a, b, bias, flags in calls:
            ta, tb = flags.get("transpose_a", False), flags.get("transpose_b", False)
            epilogue = ("gelu" if flags.get("gelu_out") is not None else "gelu'" if
                        flags.get("gelu_input") is not None else "")
            key = (tuple(out.shape), tuple(a[0].shape), tuple(b[0].shape), ta, tb,
                   bias is not None, bool(flags.get("accumulate")), epilogue,
                   hasattr(out, "bf16_pairs"), len(a))
            count, first = groups.get(key, (0, None))
            groups[key] = (count + 1, first or (out, a, b, bias, flags))

        print(f"products: {preset} B={B} T={T}, {len(calls)} a step in {len(groups)} kinds, "
              f"each timed alone (ours: out as the step writes it, float32 or bf16; cuBLAS "
              f"bf16: out bf16, same orientation; a sum of products: cuBLAS's one product of "
              f"the operands concatenated along K, as a fused [C, 3C] projection's dX is)")
        ours_total = theirs_total = 0.0
        for key, (count, (out, a, b, bias, flags)) in sorted(
                groups.items(), key=lambda kv: -kv[1][0] * np.prod(kv[0][0])):
            ta, tb = key[3], key[4]
            ops_a, ops_b = [], []
            for x, y in zip(a, b):
                A, Bm = (z if isinstance(z, Bf16Matrix) else rounded_bf16(z) for z in (x, y))
                ops_a.append(bf16_tensor(A).t() if ta else bf16_tensor(A))
                ops_b.append(bf16_tensor(Bm).t() if tb else bf16_tensor(Bm))
            opa, opb = torch.cat(ops_a, dim=1), torch.cat(ops_b, dim=0)
            if len(a) == 1:                      # (as it lies: cuBLAS's own orientation)
                opa, opb = ops_a[0], ops_b[0]
            M, K = opa.shape
            N = opb.shape[1]
            bias_t = torch.as_tensor(bias, device="cuda").bfloat16() if bias is not None else None

            def theirs(opa=opa, opb=opb, bias_t=bias_t):
                return torch.addmm(bias_t, opa, opb) if bias_t is not None else opa @ opb

            def mine(out=out, a=a, b=b, bias=bias, flags=flags):
                if len(a) == 1:
                    backend_matmul(out, a[0], b[0], bias, **flags)
                else:
                    backend_matmul_sum(out, list(zip(a, b)), **flags)
            mine_ms, theirs_ms = kernel_ms(mine, args), kernel_ms(theirs, args)
            ours_total += count * mine_ms
            theirs_total += count * theirs_ms
            name = (f"{count:3d} x {M}x{N}x{K} {'T' if ta else 'N'}{'T' if tb else 'N'}"
                    f"{f' sum of {len(a)}' if len(a) > 1 else ''}"
                    f"{' +bias' if key[5] else ''}{' +=' if key[6] else ''}"
                    f"{' ' + key[7] if key[7] else ''}{' bf16 out' if key[8] else ''}")
            row("products", f"{preset} {name}", mine_ms, 2.0 * M * N * K, "TFLOP/s", theirs_ms,
                "cuBLAS bf16", f"(cuBLAS {2.0 * M * N * K / theirs_ms / 1e9:.0f} TFLOP/s)")
        row("products", f"{preset} all {len(calls)} of a step, summed", ours_total, None, "",
            theirs_total, "cuBLAS bf16")


def mfu(flops, ms, precision="fp32"):
    """Model FLOPs utilisation against the GPU's peak in the matmuls' precision (float32
    without tensor cores, tf32 or bf16 on them); "?" for a card runtime.device does not know."""
    from nanoandrea.kernels.runtime.device import peak_flops
    peak = peak_flops(precision)
    return f"{100 * flops / (ms / 1e3) / peak:.0f}%" if peak else "?"


def bench_train(args):
    """andrea-12m on tiny Shakespeare (char tokenizer): the loss must fall."""
    from nanoandrea.backend import get_backend
    from nanoandrea.config import get_preset
    from nanoandrea.data import BatchSampler, Dataset, resolve_data
    from nanoandrea.model import GPT
    from nanoandrea.optim import AdamW, learning_rate
    from nanoandrea.mfu import flops_per_token
    print(f"train: andrea-12m, tiny Shakespeare, B=64, T=256, {args.train_steps} steps")
    data = Dataset(resolve_data(None, "char", cache_dir=args.cache))
    config = get_preset("andrea-12m", vocab_size=data.vocab_size, dropout=0.0)
    model = GPT(config, get_backend("cuda"), seed=0)
    optimizer = AdamW(model.params, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    batches = BatchSampler(data.splits["train"], 64, 256, seed=0)
    losses, times = [], []
    for step in range(args.train_steps):
        cuda.synchronize()
        start = time.perf_counter()
        optimizer.zero_grad()
        x, y = batches.next()
        _, loss = model.forward(x, y, train=True)
        loss.backward()
        optimizer.step(learning_rate(step, 1e-3, 1e-4, 10, args.train_steps))
        losses.append(loss.item())          # synchronizes
        times.append(time.perf_counter() - start)
    print("  losses:", " ".join(f"{l:.3f}" for l in losses[::max(1, len(losses) // 10)]),
          f"... {losses[-1]:.3f}")
    ms = statistics.median(times[2:]) * 1e3
    first, last = np.mean(losses[:5]), np.mean(losses[-5:])
    row("train", "andrea-12m step (wall, synced)", ms, 64 * 256 * flops_per_token(config),
        "TFLOP/s", note=f"loss {first:.3f} -> {last:.3f}")
    if not last < first - 0.5:
        raise Mismatch(f"the training loss did not fall: {first:.3f} -> {last:.3f}")
