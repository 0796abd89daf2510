"""Two claims about the hardware, measured: docs/hardware.md reports what this section prints.

    python tools/bench.py --only hardware [--json PATH] [--plot PATH]
    python tools/bench.py --replot JSON --plot PATH       (the plot again from saved rows)

(a) One fused [C,C] projection against H separate [C,D] per-head products, the same total
    work (2 M C^2 flops), at andrea-12m's shape (C=384, 12 heads of 32) and andrea-120m's (768,
    12 of 64), M = 16384 rows (B x T of a training batch): ours on the tensor cores
    (kernels/matmul's bf16 dispatch, its operands rounded to bf16 once beforehand, as the model
    rounds them) and cuBLAS bf16 (torch).
(b) Causal attention, forward + backward, TFLOP/s at head sizes 32, 64, 72 and 128 on
    [32, 12, 512, D], four columns:
      ours float32   FFMA (kernels/attention/float32.py takes D = 16, 32 and 64, any other
                     D the reference kernels, a warp a row)
      ours bf16      the tensor cores (kernels/attention's bf16 dispatch, what --precision bf16
                     trains with), called as the model's attention calls it: q, k, v rounded
                     to bf16 pairs once (heads_operand), the forward and the backward reading
                     those, the backward rounding dout; the passes are timed with the
                     kernels, as the training step pays them. It takes D = 32 and 64; any
                     other D falls back to the float32 kernels, so at 72 and 128 its figure is
                     the float32 column's (checked to launch the same kernels, not timed again)
      SDPA bf16      torch's scaled_dot_product_attention on bf16 tensors (tensor cores)
      SDPA float32   the same on float32 tensors.
Timings as tools/bench.py's: CUDA events after warm-up, the median of repeated calls queued
back to back; each of our outputs is checked before it is timed: float32 against SDPA float32
to 1e-4, bf16 against SDPA float32 of the same inputs rounded to bf16 to 2e-2 (what is left
is the kernels' rounding of P and dS to bf16, tools/bench.py's limit). The H per-head products
are timed as one CUDA graph each side (torch.cuda.graph), so that what is measured is the
GPU's time, not twelve launches from Python.

bench.py's --json keeps every row (part (b)'s with its head size and column); --plot draws
both parts, (b) as bars by head size; --replot draws them from the rows of a run's --json,
without a GPU.
"""
import math
import re

import numpy as np
from numba import cuda

from benchmarks.timing import RESULTS, Mismatch, event_time_ms, relative_error, require, row
from nanoandrea.kernels import attention
from nanoandrea.kernels.attention import float32 as float32_attention
from nanoandrea.kernels.matmul import matmul_bf16
from nanoandrea.kernels.operands import rounded_bf16 as rounded
from nanoandrea.kernels.runtime import launch

HEAD_SIZES = (32, 64, 72, 128)
# part (b)'s columns
COLUMNS = ("ours float32 (FFMA)", "ours bf16 (tensor cores)", "SDPA bf16", "SDPA float32")
BF16_LIMIT = 2e-2           # bf16 attention against float32 of the rounded inputs
TENSOR_CORE_HEAD_SIZES = attention.TENSOR_CORE_HEAD_SIZES


def timed(fn, repeat=10, calls=5):
    return event_time_ms(fn, repeat=repeat, calls=calls)


def report(claim, name, ms, flops, note="", **fields):
    row("hardware", name, ms, flops, "TFLOP/s", note=note, claim=claim, **fields)


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


def ours_bf16(Q, K, V, DOUT):
    """The bf16 backend's attention on float32 q, k, v, dout (Numba device arrays [B,H,T,D]):
    (run, (out, dq, dk, dv)). run() rounds q, k, v to bf16 pairs (heads_operand, as ops.attention
    does), then runs the bf16 attention's forward and backward on them (the backward rounds dout),
    so that a timing of run() includes those passes; the outputs are NaN until run() writes
    them."""
    B, H, T, D = Q.shape
    out, dq, dk, dv = (cuda.to_device(np.full((B, H, T, D), np.nan, np.float32))
                       for _ in range(4))
    lse, delta = (cuda.device_array((B, H, T), np.float32) for _ in range(2))

    def run():
        operands = [attention.heads_operand(x) for x in (Q, K, V)]
        attention.attention_forward_bf16(out, lse, *operands)
        attention.attention_backward_bf16(dq, dk, dv, delta, DOUT, *operands, out, lse)
    return run, (out, dq, dk, dv)


def check_bf16(outputs, wants, D):
    """Each of ours_bf16's (out, dq, dk, dv), after a run, within BF16_LIMIT of want (host
    arrays: float32 or float64 attention of the inputs rounded to bf16)."""
    for got, want, name in zip(outputs, wants, ("out", "dq", "dk", "dv")):
        require(relative_error(got.copy_to_host(), want), BF16_LIMIT,
                f"attention bf16 D={D} {name}")


def launches_of(forward, backward, D, T=512):
    """The kernels (with their argument types) that forward and backward launch for one head
    [1, 1, T, D] of float32: what is launched depends on T and D, not on B or H."""
    from nanoandrea.precompile import kernels_of
    q, out, lse = (cuda.device_array(shape, np.float32) for shape in
                   ((1, 1, T, D), (1, 1, T, D), (1, 1, T)))

    def both():
        forward(out, lse, q, q, q)
        backward(out, out, out, lse, q, q, q, q, out, lse)
    return kernels_of(both)


def falls_back(D):
    """Whether the bf16 attention takes float32's kernels for heads of D (those it launches are
    the float32 path's): then part (b) reports the float32 figure for it, not timed again."""
    if D in TENSOR_CORE_HEAD_SIZES:
        return False
    if (launches_of(attention.attention_forward_bf16, attention.attention_backward_bf16, D)
            != launches_of(attention.attention_forward, attention.attention_backward, D)):
        raise Mismatch(f"attention bf16 D={D}: launches other kernels than float32's")
    return True


def attention_by_head_size():
    import torch
    import torch.nn.functional as F
    torch.backends.cuda.matmul.allow_tf32 = False
    print("(b) causal attention forward + backward by head size")
    from nanoandrea.precompile import compile_kernels
    B, H, T = 32, 12, 512
    compile_kernels(set().union(*(
        launches_of(forward, backward, D, T) for D in HEAD_SIZES for forward, backward in (
            (attention.attention_forward, attention.attention_backward),
            (attention.attention_forward_bf16, attention.attention_backward_bf16)))))
    for D in HEAD_SIZES:
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
        fallback = falls_back(D)
        if not fallback:                # (float32 attention of the values the kernels read)
            run_bf16, outputs = ours_bf16(Q, K, V, DOUT)
            run_bf16()
            cuda.synchronize()
            qr, kr, vr = (t.bfloat16().float().requires_grad_(True) for t in (q, k, v))
            want = F.scaled_dot_product_attention(qr, kr, vr, is_causal=True)
            want.backward(dout.bfloat16().float())
            check_bf16(outputs, [t.detach().cpu().numpy() for t in
                                 (want, qr.grad, kr.grad, vr.grad)], D)

        def sdpa(dtype):
            qd, kd, vd = (t.to(dtype).requires_grad_(True) for t in (q, k, v))
            dd = dout.to(dtype)

            def run():
                o = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True)
                o.backward(dd)
            return run
        flops = 3.5 * 4 * B * H * T * T * D / 2     # tools/bench.py's count
        kind = "float32" if D in float32_attention.HEAD_SIZES else "reference"
        label = f"[{B},{H},{T},{D}]"
        fp32_ms = timed(ours, repeat=5, calls=1 if kind == "reference" else 5)
        report("b", f"{label} ours (float32 FFMA, {kind} kernel)", fp32_ms, flops,
               head_size=D, column=COLUMNS[0])
        if fallback:
            report("b", f"{label} ours bf16 (float32 fallback, {kind} kernel)", fp32_ms,
                   flops, "the float32 row's kernels, not timed again", head_size=D,
                   column=COLUMNS[1], fallback=True)
        else:
            report("b", f"{label} ours bf16 (tensor cores)", timed(run_bf16), flops,
                   "with the rounding of q, k, v, dout to bf16", head_size=D,
                   column=COLUMNS[1], fallback=False)
        report("b", f"{label} SDPA bf16", timed(sdpa(torch.bfloat16)), flops, head_size=D,
               column=COLUMNS[2])
        report("b", f"{label} SDPA float32", timed(sdpa(torch.float32)), flops, head_size=D,
               column=COLUMNS[3])
    print("\n(b) forward + backward by head size")
    for line in head_size_table(hardware_rows(RESULTS)):
        print("  " + line)


def hardware_rows(rows):
    """This section's rows among a run's (RESULTS, or the rows of a run's --json)."""
    return [r for r in rows if r["section"] == "hardware"]


def head_size_table(rows):
    """Part (b)'s rows as table lines: a head size a line, COLUMNS across, each
    "ms, TFLOP/s" (a fallback's marked)."""
    cells = {(r["head_size"], r["column"]): r for r in rows if r["claim"] == "b"}
    lines = [f"{'D':>4s} " + " ".join(f"{c:>28s}" for c in COLUMNS)]
    for D in sorted({D for D, _ in cells}):
        texts = []
        for column in COLUMNS:
            cell = cells.get((D, column))
            text = "-" if cell is None else (f"{cell['ms']:.3f} ms, {cell['rate']:.1f} TFLOP/s"
                                             + (" *" if cell.get("fallback") else ""))
            texts.append(f"{text:>28s}")
        lines.append(f"{D:4d} " + " ".join(texts))
    if any(r.get("fallback") for r in cells.values()):
        lines.append("* float32 fallback: the bf16 attention takes D = "
                     + " and ".join(map(str, TENSOR_CORE_HEAD_SIZES))
                     + "; the float32 column's figure")
    return lines


def plot(rows, path):
    """(a) as one bar a row; (b) as bars by head size, a colour a column, the bf16 fallback's
    hatched (the float32 figure, shown where the bf16 training step would be)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    fused = [r for r in rows if r["claim"] == "a"]
    # the labels without their shapes, which the presets name
    left.barh([re.sub(r"\[\S+\] ", "", r["name"]) for r in fused], [r["rate"] for r in fused])
    left.invert_yaxis()
    left.set_xlabel("TFLOP/s")
    left.set_title("(a) fused [C,C] against per-head products, bf16", fontsize=10)
    left.tick_params(axis="y", labelsize=7)
    rows = [r for r in rows if r["claim"] == "b"]
    sizes = sorted({r["head_size"] for r in rows})
    width = 0.8 / len(COLUMNS)
    for c, column in enumerate(COLUMNS):
        cells = {r["head_size"]: r for r in rows if r["column"] == column}
        at = [i + (c - (len(COLUMNS) - 1) / 2) * width for i, D in enumerate(sizes)
              if D in cells]
        bars = right.bar(at, [cells[D]["rate"] for D in sizes if D in cells], width,
                         label=column, color=f"C{c}")
        for bar, D in zip(bars, [D for D in sizes if D in cells]):
            if cells[D].get("fallback"):
                bar.set_hatch("//")
                bar.set_alpha(0.5)
    right.set_xticks(range(len(sizes)), [f"D={D}" for D in sizes])
    right.set_ylabel("TFLOP/s")
    right.set_title("(b) attention fwd+bwd, [32,12,512,D]\nhatched: bf16's float32 fallback",
                    fontsize=10)
    right.legend(fontsize=8, loc="upper left")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def bench_hardware(args):
    """Parts (a) and (b); --plot draws them."""
    fused_against_per_head()
    attention_by_head_size()
    if args.plot:
        plot(hardware_rows(RESULTS), args.plot)
