"""The brief's hardware claims, measured on the GPU: docs/hardware.md reports what this prints.

    python tools/hardware.py [--json PATH] [--plot PATH]

(a) One fused [C,C] projection against H separate [C,D] per-head products, the same total
    work (2 M C^2 flops), at andrea-12m's shape (C=384, 12 heads of 32) and andrea-120m's (768,
    12 of 64), M = 16384 rows (B x T of a training batch): ours on the tensor cores
    (kernels/matmul_bf16.py, its operands rounded to bf16 once beforehand, as the model rounds
    them) and cuBLAS bf16 (torch).
(b) Causal attention, forward + backward, TFLOP/s at head sizes 32, 64, 72 and 128 on
    [32, 12, 512, D]: ours (float32 FFMA: the fast kernels take D = 32 and 64, any other D
    the reference kernel) and torch's scaled_dot_product_attention in bf16 (tensor cores)
    and in float32.
Timings as tools/bench.py's: CUDA events after warm-up, the median of repeated calls queued
back to back; each of our outputs is checked against the reference before it is timed. The
H per-head products are timed as one CUDA graph each side (torch.cuda.graph), so that what is
measured is the GPU's time, not twelve launches from Python.
"""
import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("CUPY_TF32", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from numba import cuda  # noqa: E402

from bench import event_time_ms, relative_error, require, warm_up_clocks  # noqa: E402
from nanoandrea.kernels import attention, launch  # noqa: E402
from nanoandrea.kernels.matmul_bf16 import matmul_bf16, rounded  # noqa: E402

ROWS = []


def timed(fn, repeat=10, calls=5):
    return event_time_ms(fn, repeat=repeat, calls=calls)


def report(claim, name, ms, flops, note=""):
    rate = flops / ms / 1e9
    ROWS.append(dict(claim=claim, name=name, ms=ms, tflops=rate, note=note))
    print(f"  {name:52s} {ms:9.3f} ms {rate:9.1f} TFLOP/s  {note}", flush=True)


def as_graph(fn):
    """fn's launches (ours through Numba, or torch's) captured once: a function that replays
    them on the default stream."""
    import torch
    fn()                                # (compiled and warm before the capture)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        with launch.using_stream(cuda.external_stream(torch.cuda.current_stream().cuda_stream)):
            fn()
    return graph.replay


def fused_against_per_head():
    import torch
    from nanoandrea.precompile import compile_kernels, kernels_of
    print("(a) one [C,C] projection against H per-head [C,D] products, bf16")
    small = cuda.device_array((128, 64), np.float32)
    compile_kernels(kernels_of(lambda: matmul_bf16(small, small, small[:64])))
    generator = torch.Generator(device="cuda").manual_seed(0)
    for preset, C, H in (("andrea-12m", 384, 12), ("andrea-120m", 768, 12)):
        M, D = 16384, C // H
        x = torch.randn(M, C, device="cuda", generator=generator)
        w = torch.randn(C, C, device="cuda", generator=generator) / math.sqrt(C)
        heads = [w[:, h * D:(h + 1) * D].contiguous() for h in range(H)]
        out = torch.empty(M, C, device="cuda")
        outs = [torch.empty(M, D, device="cuda") for _ in range(H)]
        OUT, OUTS = cuda.as_cuda_array(out), [cuda.as_cuda_array(t) for t in outs]
        X, W = (rounded(cuda.as_cuda_array(t)) for t in (x, w))
        HEADS = [rounded(cuda.as_cuda_array(t)) for t in heads]
        xb, wb, heads_b = x.bfloat16(), w.bfloat16(), [t.bfloat16() for t in heads]

        def ours_fused():
            matmul_bf16(OUT, X, W)

        def ours_heads():
            for w_h, out_h in zip(HEADS, OUTS):
                matmul_bf16(out_h, X, w_h)

        def cublas_heads():
            for w_h, out_h in zip(heads_b, outs_b):
                torch.matmul(xb, w_h, out=out_h)
        outs_b = [torch.empty(M, D, device="cuda", dtype=torch.bfloat16) for _ in range(H)]
        ours_fused()
        ours_heads = as_graph(ours_heads)
        for out_h in outs:
            out_h.fill_(float("nan"))
        ours_heads()
        cuda.synchronize()
        want = xb.float() @ wb.float()
        require(relative_error(out.cpu().numpy(), want.cpu().numpy()), 1e-4, "fused")
        per_head = torch.cat(outs, dim=1)
        require(relative_error(per_head.cpu().numpy(), want.cpu().numpy()), 1e-4, "per head")
        flops = 2.0 * M * C * C
        shape = f"{preset} [{M}x{C}].[{C}x{C}]"
        report("a", f"{shape} ours, fused", timed(ours_fused), flops)
        report("a", f"{shape} ours, {H} heads of {D}", timed(ours_heads), flops)
        report("a", f"{shape} cuBLAS, fused", timed(lambda: xb @ wb), flops)
        report("a", f"{shape} cuBLAS, {H} heads of {D}", timed(as_graph(cublas_heads)), flops)


def attention_by_head_size():
    import torch
    import torch.nn.functional as F
    torch.backends.cuda.matmul.allow_tf32 = False
    print("(b) causal attention forward + backward by head size")
    from nanoandrea.precompile import compile_kernels, kernels_of
    B, H, T = 32, 12, 512
    head_sizes = (32, 64, 72, 128)

    def both(D):                        # (one head: what is launched depends on T and D)
        q, out, lse = (cuda.device_array(shape, np.float32) for shape in
                       ((1, 1, T, D), (1, 1, T, D), (1, 1, T)))
        attention.attention_forward(out, lse, q, q, q)
        attention.attention_backward(out, out, out, lse, q, q, q, q, out, lse)
    compile_kernels(set().union(*(kernels_of(lambda D=D: both(D)) for D in head_sizes)))
    for D in head_sizes:
        generator = torch.Generator(device="cuda").manual_seed(D)
        q, k, v, dout = (torch.randn(B, H, T, D, device="cuda", generator=generator)
                         for _ in range(4))
        out, dq, dk, dv = (torch.empty(B, H, T, D, device="cuda") for _ in range(4))
        lse, delta = (torch.empty(B, H, T, device="cuda") for _ in range(2))
        Q, K, V, DOUT, OUT, DQ, DK, DV, LSE, DELTA = (cuda.as_cuda_array(t) for t in (
            q, k, v, dout, out, dq, dk, dv, lse, delta))

        def ours():
            attention.attention_forward(OUT, LSE, Q, K, V)
            attention.attention_backward(DQ, DK, DV, DELTA, DOUT, Q, K, V, OUT, LSE)
        ours()
        cuda.synchronize()
        qs, ks, vs = (t.clone().requires_grad_(True) for t in (q, k, v))
        want = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
        want.backward(dout)
        for got, ref, name in ((out, want, "out"), (dq, qs.grad, "dq"), (dk, ks.grad, "dk")):
            require(relative_error(got.cpu().numpy(), ref.detach().cpu().numpy()), 1e-4,
                    f"attention D={D} {name}")

        def sdpa(dtype):
            qd, kd, vd = (t.to(dtype).requires_grad_(True) for t in (q, k, v))
            dd = dout.to(dtype)

            def run():
                o = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True)
                o.backward(dd)
            return run
        flops = 3.5 * 4 * B * H * T * T * D / 2     # tools/bench.py's count
        kind = "fast" if D in attention.FAST_HEAD_SIZES else "reference"
        label = f"[{B},{H},{T},{D}]"
        report("b", f"{label} ours (float32 FFMA, {kind} kernel)",
               timed(ours, repeat=5, calls=1 if kind == "reference" else 5), flops)
        report("b", f"{label} SDPA bf16", timed(sdpa(torch.bfloat16)), flops)
        report("b", f"{label} SDPA float32", timed(sdpa(torch.float32)), flops)


def plot(path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    for axis, claim, title in ((left, "a", "(a) fused [C,C] against per-head products, bf16"),
                               (right, "b", "(b) attention fwd+bwd by head size")):
        rows = [r for r in ROWS if r["claim"] == claim]
        axis.barh([r["name"] for r in rows], [r["tflops"] for r in rows])
        axis.invert_yaxis()
        axis.set_xlabel("TFLOP/s")
        axis.set_title(title, fontsize=10)
        axis.tick_params(axis="y", labelsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    args = parser.parse_args()
    device = cuda.get_current_device()
    name = device.name.decode() if isinstance(device.name, bytes) else device.name
    print(f"device: {name}, date {time.strftime('%Y-%m-%d')}")
    warm_up_clocks()
    fused_against_per_head()
    attention_by_head_size()
    if args.json:
        Path(args.json).write_text(json.dumps(ROWS, indent=1))
    if args.plot:
        plot(args.plot)


if __name__ == "__main__":
    main()
