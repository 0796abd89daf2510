"""Benchmark nanoandrea's kernels and training step against cuBLAS (CuPy) and PyTorch, on the GPU.

    python tools/bench.py                       # everything, a table at the end
    python tools/bench.py --only matmul,attention
    python tools/bench.py --only train --train-steps 50
    python tools/bench.py --only matmul,e2e --precision bf16

Every timing is the median of repeated runs measured with CUDA events after warm-up, the
competitors run in the same process on the same shapes, and every fast kernel's output is
checked against the reference before it is timed: a mismatch stops the benchmark (exit 1).
Sections:
  matmul     the andrea-120m (B=16, T=1024) products, forward and both backward ones, against
             cupy.matmul in float32 with TF32 off
  attention  forward and forward+backward against torch's scaled_dot_product_attention (float32)
  small      the fused memory-bound kernels (residual + layernorm, GELU, cross-entropy with its
             gradient, AdamW with clipping) against PyTorch's ops, in GB/s
  e2e        training tokens/s of full steps (forward, backward, AdamW) against PyTorch GPT-2s
             of identical shape (fused AdamW, SDPA, float32, TF32 off): the tests' oracle
             (nanoandrea/torch_gpt.py) and the model a PyTorch user trains (tools/torch_gpt2.py;
             --compile: under torch.compile too); consecutive steps between two events, as a
             training run has them (no wait for the GPU per step)
--precision bf16: the matmuls on the tensor cores (kernels/matmul_bf16.py) against cuBLAS bf16
(torch.matmul of bf16 tensors), checked against the float32 product of the bf16-rounded
operands; attention (kernels/attention_bf16.py) against SDPA on bf16 tensors; e2e against
PyTorch under torch.autocast(bfloat16).
--precision tf32: the same kernel on tf32 operands (kernels/matmul_tf32.py) against cuBLAS
with TF32 on (torch.matmul of float32 tensors), checked against the float64 product of the
tf32-rounded operands; e2e against PyTorch float32 with TF32 on.
  train      andrea-12m on tiny Shakespeare for a few steps: the loss must fall
  sample     andrea-120m at 1024 tokens of context (greedy, batch 1 and 8, fp32 and bf16): 256
             tokens after a 768-token prompt with the key/value cache, and Hugging Face
             transformers' `generate` (which caches) on the same weights and precision; 16
             without the cache; and one captured step's replay, in tokens/s
  profile    each kernel's GPU time in the e2e steps, ours and PyTorch's side by side
             (through torch.profiler, whose CUPTI records Numba's kernels too)
"""
import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("CUPY_TF32", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
from numba import cuda  # noqa: E402

from nanoandrea.kernels import attention as attention_kernels  # noqa: E402
from nanoandrea.kernels import attention_bf16  # noqa: E402
from nanoandrea.kernels import matmul as matmul_kernels  # noqa: E402
from nanoandrea.kernels import matmul_bf16 as matmul_bf16_kernels  # noqa: E402
from nanoandrea.kernels import matmul_tf32 as matmul_tf32_kernels  # noqa: E402
from nanoandrea.train import PEAK_FLOPS, flops_per_token  # noqa: E402

RESULTS = []          # rows of the final table


class Mismatch(Exception):
    pass


def event_time_ms(fn, warmup=3, repeat=10, calls=1):
    """Median milliseconds of one fn() between two CUDA events on the default stream.

    calls > 1: each timing covers `calls` back-to-back calls (and is divided by calls), queued
    while the GPU is still busy with ~6 ms of other work. The GPU then runs them without
    waiting for Python between launches (a Numba launch costs ~30 us of host time, a launcher
    that checks shapes more, which for small kernels is more than their GPU time): this
    measures the kernels' GPU time, which is what a CUDA-graph replay pays. Both sides of a
    comparison are timed the same way.
    A call over 20 ms is timed alone (calls = 1), still behind the ~6 ms of other work: its
    launches too then queue while the GPU is busy, so the timing starts with its first kernel,
    not with the host's work before it."""
    if warm_up_and_time_one(fn, warmup) > 0.02:
        calls = 1           # a slow kernel (the LM head, the reference ones): one a timing
    return median_ms_per_call(fn, calls, repeat, lambda: keep_gpu_busy(6))


def warm_up_and_time_one(fn, warmup):
    """Run fn `warmup` times, then once more alone: the seconds that one took, host waits
    included."""
    for _ in range(warmup):
        fn()
    cuda.synchronize()
    began = time.perf_counter()
    fn()
    cuda.synchronize()
    return time.perf_counter() - began


def median_ms_per_call(fn, calls, repeat, before=None):
    """`repeat` times: before(), then `calls` calls of fn between two CUDA events; the median
    of the milliseconds per call."""
    times = []
    for _ in range(repeat):
        if before is not None:
            before()
        start, end = cuda.event(), cuda.event()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(cuda.event_elapsed_time(start, end) / calls)
    return statistics.median(times)


KERNEL_CALLS = 5        # back-to-back calls per timing of one kernel (see event_time_ms)


def kernel_ms(fn, args):
    """GPU milliseconds of one call of a kernel (or a competitor's op), median of args.repeat."""
    return event_time_ms(fn, repeat=args.repeat, calls=KERNEL_CALLS)


def warm_up_clocks(seconds=2.0):
    """Keep the GPU busy for a moment first: an idle GPU runs at low clocks and ramps up under
    load: without this the first shapes timed could pay for the ramp-up."""
    import cupy
    x = cupy.ones((4096, 4096), cupy.float32)
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        for _ in range(10):
            x @ x
        cupy.cuda.Device().synchronize()


def keep_gpu_busy(ms):
    """Queue about `ms` milliseconds of matrix products on the default stream, without waiting."""
    import cupy
    x = cupy.ones((4096, 4096), cupy.float32)
    for _ in range(max(1, int(ms / 3))):        # ~3 ms each (137 GFLOP at ~45 TFLOP/s)
        x @ x


def row(section, name, ms, work, unit, baseline_ms=None, baseline="", note=""):
    rate = work / ms / 1e9 if work else None          # work per ms -> T{unit}/s
    entry = dict(section=section, name=name, ms=ms, rate=rate, unit=unit,
                 baseline=baseline, baseline_ms=baseline_ms,
                 ratio=(baseline_ms / ms) if baseline_ms else None, note=note)
    RESULTS.append(entry)
    ratio = f"{entry['ratio']:.2f}x {baseline}" if entry["ratio"] else ""
    rate_text = f"{rate:8.2f} {unit}" if rate else ""
    print(f"  {name:44s} {ms:9.3f} ms {rate_text:>16s}  {ratio} {note}", flush=True)


def relative_error(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def require(error, limit, what):
    if not (error < limit):
        raise Mismatch(f"{what}: relative error {error:.2e} exceeds {limit:.0e}")


# --- matmul ---------------------------------------------------------------------------------

def bench_matmul(args):
    if args.precision != "fp32":
        return bench_matmul_bf16(args)
    import cupy
    print("matmul: the products of a training step (float32; cuBLAS with TF32 off)")
    rng = cupy.random.default_rng(0)
    for label, m, n, k in matmul_shapes(args):
        x = rng.standard_normal((m, k), dtype=cupy.float32)
        w = rng.standard_normal((k, n), dtype=cupy.float32)
        dy = rng.standard_normal((m, n), dtype=cupy.float32)
        X, W, DY = (cuda.as_cuda_array(a) for a in (x, w, dy))   # Numba views of CuPy's memory
        out_y = cuda.device_array((m, n), np.float32)
        out_dx = cuda.device_array((m, k), np.float32)
        out_dw = cuda.device_array((k, n), np.float32)
        cases = [           # (name, our product, cuBLAS's, our output)
            ("fwd  Y=X.W", lambda: matmul_kernels.matmul(out_y, X, W), lambda: x @ w, out_y),
            ("bwd dX=dY.W^T", lambda: matmul_kernels.matmul(out_dx, DY, W, transpose_b=True),
             lambda: dy @ w.T, out_dx),
            ("bwd dW=X^T.dY", lambda: matmul_kernels.matmul(out_dw, X, DY, transpose_a=True),
             lambda: x.T @ dy, out_dw)]
        short = short_name(label)
        for name, ours, theirs, out in cases:
            cupy.asarray(out).fill(cupy.nan)    # poisoned: an element left unwritten fails
            ours()
            want = theirs()
            cuda.synchronize()
            error = relative_error(cupy.asarray(out).get(), want.get())
            require(error, 1e-5, f"matmul {label} {name}")
            flops = 2.0 * m * n * k
            theirs_ms = kernel_ms(theirs, args)
            ours_ms = kernel_ms(ours, args)
            row("matmul", f"{short:8s} {name}", ours_ms, flops, "TFLOP/s", theirs_ms,
                "cuBLAS", f"(cuBLAS {flops / theirs_ms / 1e9:.1f} TFLOP/s, err {error:.1e})")
        if "down" in label:
            gelu_backward_pair(args, short, m, n, k, DY, W, out_dx)


M_ROWS = 16 * 1024
def short_name(label):
    """A product's name in the report: its label up to the shapes ("mlp up")."""
    return label.split("[")[0].strip()


MATMUL_SHAPES = [("qkv/W_O  [16384x768]x[768x768]", M_ROWS, 768, 768),   # andrea-120m, B=16 T=1024
                 ("mlp up   [16384x768]x[768x3072]", M_ROWS, 3072, 768),
                 ("mlp down [16384x3072]x[3072x768]", M_ROWS, 768, 3072),
                 ("lm head  [16384x768]x[768x50304]", M_ROWS, 50304, 768),  # (the padded vocabulary)
                 ("12m proj [16384x384]x[384x384]", M_ROWS, 384, 384),       # andrea-12m, B=64 T=256
                 ("12m down [16384x1536]x[1536x384]", M_ROWS, 384, 1536)]


def matmul_shapes(args):
    for label, m, n, k in MATMUL_SHAPES:
        if not ((args.quick and n >= 50257) or (args.shapes and not any(
                label.startswith(name) for name in args.shapes.split(",")))):
            yield label, m, n, k


def bench_matmul_bf16(args):
    """The same products on the tensor cores: ours from bf16 (tf32) operands (Bf16Matrix,
    Tf32Matrix, rounded once beforehand, as the model does), float32 out; cuBLAS's from bf16
    tensors, bf16 out (what PyTorch's autocast runs), or in tf32 from float32 tensors with TF32
    on. Ours is checked against the float64 product of the rounded operands. The rounding of X
    (round_bf16 or round_tf32, one pass over it) is timed on its own line."""
    import torch
    precision = args.precision
    kernels = matmul_bf16_kernels if precision == "bf16" else matmul_tf32_kernels
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"     # (cuBLAS's tf32)
    print(f"matmul: the products of a training step in {precision} (cuBLAS {precision} through "
          "torch)")
    generator = torch.Generator(device="cuda").manual_seed(0)
    for label, m, n, k in matmul_shapes(args):
        x, w, dy = (torch.randn(shape, device="cuda", generator=generator)
                    for shape in ((m, k), (k, n), (m, n)))
        x_float = cuda.as_cuda_array(x)
        X, W, DY = (kernels.rounded(cuda.as_cuda_array(t)) for t in (x, w, dy))
        if precision == "bf16":                 # cuBLAS's operands, and the rounded values
            xb, wb, dyb = x.bfloat16(), w.bfloat16(), dy.bfloat16()
            xr, wr, dyr = (t.double() for t in (xb, wb, dyb))
        else:
            xb, wb, dyb = x, w, dy
            xr, wr, dyr = (torch.as_tensor(t.values, device="cuda")[:, :t.shape[1]].double()
                           for t in (X, W, DY))
        outs = [torch.empty(shape, device="cuda") for shape in ((m, n), (m, k), (k, n))]
        out_y, out_dx, out_dw = (cuda.as_cuda_array(t) for t in outs)
        mm = getattr(kernels, f"matmul_{precision}")
        round_x = getattr(kernels, f"round_{precision}")
        round_ms = kernel_ms(lambda: round_x(X, x_float), args)
        row("matmul", f"{short_name(label):8s} "
            f"round X {precision}", round_ms, 4.0 * m * k + X.words.nbytes, "TB/s", None, None,
            f"(float32 read, {precision} written)")
        cases = [           # (name, ours, cuBLAS's, the reference, our output)
            ("fwd  Y=X.W", lambda: mm(out_y, X, W), lambda: xb @ wb, lambda: xr @ wr, outs[0]),
            ("bwd dX=dY.W^T", lambda: mm(out_dx, DY, W, transpose_b=True), lambda: dyb @ wb.T,
             lambda: dyr @ wr.T, outs[1]),
            ("bwd dW=X^T.dY", lambda: mm(out_dw, X, DY, transpose_a=True), lambda: xb.T @ dyb,
             lambda: xr.T @ dyr, outs[2])]
        short = short_name(label)
        for name, ours, theirs, reference, out in cases:
            out.fill_(float("nan"))
            ours()
            want = reference()
            cuda.synchronize()
            error = relative_error(out.cpu().numpy(), want.cpu().numpy())
            require(error, 1e-4, f"matmul {precision} {label} {name}")
            flops = 2.0 * m * n * k
            theirs_ms = kernel_ms(theirs, args)
            ours_ms = kernel_ms(ours, args)
            row("matmul", f"{short:8s} {name} {precision}", ours_ms, flops, "TFLOP/s", theirs_ms,
                f"cuBLAS {precision}", f"(cuBLAS {flops / theirs_ms / 1e9:.1f} TFLOP/s, err "
                f"{error:.1e})")


def gelu_backward_pair(args, short, m, n, k, DY, W, out_dx):
    """The MLP's input gradient through GELU, d(pre) = (dY . W^T) * gelu'(pre), as one product
    with GELU's backward in its epilogue (what the model runs) against the product followed by
    the gelu_backward kernel: the same arithmetic, so the two agree to float32 rounding."""
    import cupy
    from nanoandrea.kernels.gelu import gelu_backward
    pre = cuda.as_cuda_array(cupy.random.default_rng(1).standard_normal((m, k), dtype=cupy.float32))
    product = cuda.device_array((m, k), np.float32)
    fused_out = cuda.device_array((m, k), np.float32)

    def fused():
        matmul_kernels.matmul(fused_out, DY, W, transpose_b=True, gelu_input=pre)

    def unfused():
        matmul_kernels.matmul(product, DY, W, transpose_b=True)
        gelu_backward(out_dx, product, pre)
    unfused()
    fused_out.copy_to_device(np.full((m, k), np.nan, np.float32))
    fused()
    cuda.synchronize()
    error = relative_error(fused_out.copy_to_host(), out_dx.copy_to_host())
    require(error, 1e-6, f"matmul {short} dX with gelu' fused")
    row("matmul", f"{short:8s} bwd dX*gelu' fused", kernel_ms(fused, args), 2.0 * m * n * k,
        "TFLOP/s", kernel_ms(unfused, args), "unfused", f"(err {error:.1e})")


# --- attention ------------------------------------------------------------------------------

def bench_attention(args):
    import torch
    import torch.nn.functional as F
    bf16 = args.precision == "bf16"
    print(f"attention: causal, {'bf16 (ours: kernels/attention_bf16.py)' if bf16 else 'float32'}"
          f", against torch scaled_dot_product_attention in the same precision")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    # in bf16 ours reads float32 q, k, v, dout (rounded as staged), SDPA bf16 copies of them
    forward_of = attention_bf16.attention_forward_bf16 if bf16 else attention_kernels.attention_forward
    backward_of = (attention_bf16.attention_backward_bf16 if bf16
                   else attention_kernels.attention_backward)
    limits = (2e-2, 2e-2) if bf16 else (1e-4, 1e-3)      # (ours, SDPA) against float64
    shapes = [(16, 12, 1024, 64), (64, 12, 256, 32)] + ([] if bf16 else [(16, 12, 1024, 72)])
    profiled = []           # (label, ours, SDPA's): forward + backward with q, k, v in bf16
    for B, H, T, D in shapes:
        if args.shapes and not any(f"{T}x{D}" == name for name in args.shapes.split(",")):
            continue                        # (--shapes 1024x64,256x32: attention's T x D)
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, dout = (torch.randn(B, H, T, D, device="cuda", generator=gen) for _ in range(4))
        if bf16:                            # (the same values on both sides: rounded once)
            q, k, v, dout = (t.bfloat16().float() for t in (q, k, v, dout))
        qs, ks, vs = (t.clone().requires_grad_(True) for t in (q, k, v))
        tq, tk, tv, tdout, tqs, tks, tvs = (t.bfloat16() if bf16 else t
                                            for t in (q, k, v, dout, qs, ks, vs))
        out, lse, delta = (cuda.device_array(s, np.float32) for s in
                           ((B, H, T, D), (B, H, T), (B, H, T)))
        dq, dk, dv = (cuda.device_array((B, H, T, D), np.float32) for _ in range(3))
        label = f"[{B},{H},{T},{D}]"
        Q, K, V, DOUT = (cuda.as_cuda_array(t) for t in (q, k, v, dout))
        kernels = ["fast"] if D in attention_kernels.FAST_HEAD_SIZES else []
        if not bf16 and (D not in attention_kernels.FAST_HEAD_SIZES or T <= 256):
            kernels.append("reference")         # (where it is not too slow to wait for)
        for kernel in kernels:
            kernel_arg = "auto" if bf16 else kernel

            def forward(kernel=kernel_arg):
                forward_of(out, lse, Q, K, V, kernel=kernel)

            def backward(kernel=kernel_arg):
                backward_of(dq, dk, dv, delta, DOUT, Q, K, V, out, lse, kernel=kernel)
            for array in (out, dq, dk, dv):         # poisoned: an element left unwritten fails
                torch.as_tensor(array, device="cuda").fill_(float("nan"))
            forward()
            backward()
            ref = F.scaled_dot_product_attention(tqs, tks, tvs, is_causal=True)
            # autograd.grad, not .backward(): the timing loops below run backward again and
            # again, and .grad would accumulate them (the check would then read ~14x SDPA's
            # gradients)
            ref_grads = [g.float() for g in torch.autograd.grad(ref, (qs, ks, vs), tdout)]
            ref = ref.float()
            cuda.synchronize()
            # correctness: ours against float64 NumPy on two heads (the first and the last),
            # and SDPA's too, so that the comparison below compares like with like ...
            for b, h in ((0, 0), (B - 1, H - 1)):
                for name, error in head_errors(q, k, v, dout, out, dq, dk, dv, b, h).items():
                    require(error, limits[0], f"attention {label} {kernel} head ({b},{h}) {name}")
                for name, error in head_errors(q, k, v, dout, ref, *ref_grads, b, h).items():
                    require(error, limits[1], f"attention {label} SDPA head ({b},{h}) {name}")
            # ... and, for the record, how far SDPA's float32 answer is from ours
            for got, want, name in ((out, ref.detach(), "out"), (dq, ref_grads[0], "dq"),
                                    (dk, ref_grads[1], "dk"), (dv, ref_grads[2], "dv")):
                error = relative_error(torch.as_tensor(got, device="cuda").cpu(), want.cpu())
                if error >= 1e-4:
                    print(f"  note: {label} {name}: ours and SDPA differ by {error:.1e} "
                          f"(both match float64 NumPy, checked above)")

            if kernel == "fast":                    # same inputs again: the same bits?
                first = torch.as_tensor(dq, device="cuda").clone()
                backward()
                again = torch.autograd.grad(F.scaled_dot_product_attention(
                    tqs, tks, tvs, is_causal=True), (qs, ks, vs), tdout)[0]
                same = [torch.equal(first, torch.as_tensor(dq, device="cuda")),
                        torch.equal(ref_grads[0], again.float())]
                print(f"  note: {label}: dq the same to the bit in a second backward: "
                      f"ours {'yes' if same[0] else 'no'}, SDPA {'yes' if same[1] else 'no'}")

            def torch_forward():
                with torch.no_grad():
                    F.scaled_dot_product_attention(tq, tk, tv, is_causal=True)

            leaves = (tqs, tks, tvs) if not bf16 else tuple(
                t.detach().requires_grad_(True) for t in (tqs, tks, tvs))

            def torch_both(leaves=leaves, tdout=tdout):     # accumulates nothing (autograd.grad)
                y = F.scaled_dot_product_attention(*leaves, is_causal=True)
                torch.autograd.grad(y, leaves, tdout)

            flops_fwd = 4.0 * B * H * T * T * D / 2           # causal: half the score matrix
            name = f"{label} {'bf16' if bf16 else kernel}"
            row("attention", name + " fwd", kernel_ms(forward, args), flops_fwd, "TFLOP/s",
                kernel_ms(torch_forward, args), "SDPA")
            row("attention", name + " fwd+bwd", kernel_ms(lambda: (forward(), backward()), args),
                flops_fwd * 3.5, "TFLOP/s", kernel_ms(torch_both, args), "SDPA")
            if bf16:        # as the model calls it, and as SDPA gets its operands: q, k, v in
                operands = [attention_bf16.heads_operand(x) for x in (Q, K, V)]   # bf16 already

                # (the arrays bound as defaults: the profile below calls these after the loop,
                # when its names hold the last shape's arrays)
                def forward_bf16(out=out, lse=lse, operands=operands):
                    forward_of(out, lse, *operands)

                def backward_bf16(dq=dq, dk=dk, dv=dv, delta=delta, DOUT=DOUT, operands=operands,
                                  out=out, lse=lse):
                    backward_of(dq, dk, dv, delta, DOUT, *operands, out, lse)
                results = [torch.as_tensor(x, device="cuda").clone() for x in (out, dq, dk, dv)]
                forward_bf16()
                backward_bf16()
                same = all(torch.equal(r, torch.as_tensor(x, device="cuda"))
                           for r, x in zip(results, (out, dq, dk, dv)))
                if not same:
                    raise Mismatch(f"attention {label}: q, k, v given in bf16 change the result")
                row("attention", name + " fwd, q k v bf16", kernel_ms(forward_bf16, args),
                    flops_fwd, "TFLOP/s", kernel_ms(torch_forward, args), "SDPA")
                row("attention", name + " fwd+bwd, q k v bf16",
                    kernel_ms(lambda: (forward_bf16(), backward_bf16()), args), flops_fwd * 3.5,
                    "TFLOP/s", kernel_ms(torch_both, args), "SDPA")
                profiled.append((label, lambda f=forward_bf16, b=backward_bf16: (f(), b()),
                                 torch_both))
    # each kernel's time, ours and SDPA's, after every timing above: a timing made after
    # torch.profiler has run can be the host's (on 2026-12-04, [64,12,256,32] with float32
    # q, k, v, 11 launches and 7 allocations a call, read 0.616 ms after a profile, 0.231 before)
    for label, ours, theirs in profiled:
        for side, fn in (("ours", ours), ("SDPA", theirs)):
            print(f"  {label} fwd+bwd, q k v bf16, the kernels of {side}:")
            print_kernel_times(kernel_times(fn, 10), 12)


def head_errors(q, k, v, dout, out, dq, dk, dv, b, h):
    """{name: relative error} of out, dq, dk, dv (ours: device arrays, or SDPA's: tensors) for
    head (b, h) against float64 NumPy."""
    head = [t[b:b + 1, h:h + 1].double().cpu().numpy() for t in (q, k, v, dout)]
    want_out, lse = np.empty(head[0].shape), np.empty(head[0].shape[:3])
    attention_kernels.attention_forward_numpy(want_out, lse, *head[:3])
    grads = [np.empty(head[0].shape) for _ in range(3)]
    attention_kernels.attention_backward_numpy(*grads, np.empty(lse.shape), head[3], *head[:3],
                                               want_out, lse)
    ours = [a[b:b + 1, h:h + 1].detach().cpu().numpy() if hasattr(a, "detach")
            else np.asarray(a.copy_to_host())[b:b + 1, h:h + 1] for a in (out, dq, dk, dv)]
    return {name: relative_error(got, want)
            for name, got, want in zip(("out", "dq", "dk", "dv"), ours, [want_out, *grads])}


# --- end to end -------------------------------------------------------------------------------

E2E_CASES = [("andrea-12m", 64, 256, 4096), ("andrea-120m", 16, 1024, 50257)]


def e2e_cases(args):
    """(preset, B, T, config, our step(graph), {name: a PyTorch step}) of each end-to-end case:
    the same config, the same batch, fused AdamW on every side. The PyTorch steps: "PyTorch",
    nanoandrea.torch_gpt's oracle (our parameter names, `x @ W + b`, three projections), and
    "PyTorch GPT-2", the model a PyTorch user trains (tools/torch_gpt2.py: nn.Linear, one fused
    QKV product, the tied LM head), the issue's anchors; with --compile also that model under
    torch.compile."""
    import torch
    from nanoandrea.backend import get_backend
    from nanoandrea.config import get_preset
    from nanoandrea.model import GPT
    from nanoandrea.optim import AdamW
    from nanoandrea.precompile import compile_kernels, kernels_of
    from nanoandrea.step import TrainStep
    from nanoandrea.torch_gpt import TorchGPT
    from torch_gpt2 import GPT2
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
        baselines = {"PyTorch": torch_step(TorchGPT(config, device="cuda")),
                     "PyTorch GPT-2": torch_step(GPT2(config, device="cuda"))}
        if args.compile:
            baselines["PyTorch GPT-2 compiled"] = torch_step(GPT2(config, device="cuda"), True)
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


def kernel_name(name):
    """A readable kernel name: Numba's arrive demangled as nanoandrea::kernels::matmul::
    make_blocked_matmul_kernel::_3clocals_3e::blocked_matmul_kernel[abi:v12][abi:cw51c...](...);
    keep module.function (and the factory that made a closure kernel)."""
    if "nanoandrea::" not in name:
        return name[:60]
    name = re.sub(r"\[abi:[^]]*\]", "", name.split("(")[0]).replace("::_3clocals_3e", "")
    return ".".join(name.split("::")[2:])


def kernel_times(fn, calls):
    """{kernel: (launches a call, ms a call)} of fn's GPU kernels, recorded by the CUDA
    profiling interface (through torch.profiler: it sees every kernel of the process, Numba's
    too), fn run 3 times first."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(3):
        fn()
    cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA], acc_events=True) as prof:
        for _ in range(calls):
            fn()
        cuda.synchronize()
    totals = {}
    for event in prof.events():
        if event.device_type.name != "CUDA":
            continue
        entry = totals.setdefault(kernel_name(event.name), [0, 0.0])
        entry[0] += 1
        entry[1] += event.time_range.elapsed_us() / 1e3
    return {name: (count // calls, ms / calls) for name, (count, ms) in totals.items()}


def print_kernel_times(times, top):
    total = sum(ms for _, ms in times.values())
    for name, (count, ms) in sorted(times.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"  {name:60s} {count:4d}/call {ms:8.3f} ms {1e3 * ms / count:9.1f} us each "
              f"{100 * ms / total:5.1f}%")


def bench_profile(args):
    """Each kernel's GPU time in one training step, ours and PyTorch's side by side
    (kernel_times). Our step runs eagerly here: the same kernels a graph replays."""
    for preset, B, T, config, ours, baselines in e2e_cases(args):
        for side, fn in (("ours", ours(False)), *baselines.items()):
            times = kernel_times(fn, 3)
            total = sum(ms for _, ms in times.values())
            print(f"profile: {preset} B={B} T={T}, {side}: {total:.2f} ms of kernels per step")
            print_kernel_times(times, args.top)


def bf16_tensor(x):
    """A Bf16Matrix as the bf16 tensor [R, C] of its values (a view of its words)."""
    import torch
    return torch.as_tensor(x.words, device="cuda").view(torch.bfloat16)[:, :x.shape[1]]


def bench_products(args):
    """The matrix products of one training step as the step makes them (shapes, orientations,
    epilogues, accumulation and split-K as the model's linear layers ask: an eager step's
    backend.matmul calls, recorded), each timed on its own and summed, beside cuBLAS bf16 (torch)
    on the same bf16 operands in the same orientation with bf16 out, what autocast runs (its
    GELU, bias gradients and the like are kernels of their own there, not counted). The
    isolated products of `--only matmul` are in the forward's orientation and plain; these
    say where the step's product time goes."""
    import torch

    from nanoandrea.kernels import matmul_bf16
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
                   hasattr(out, "words"), len(a))
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
                A, Bm = (z if isinstance(z, matmul_bf16.Bf16Matrix) else matmul_bf16.rounded(z)
                         for z in (x, y))
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
    without tensor cores, or bf16 on them)."""
    name = cuda.get_current_device().name
    name = name.decode() if isinstance(name, bytes) else name
    peak = next((peak for key, peak in PEAK_FLOPS[precision].items() if key in name), None)
    return f"{100 * flops / (ms / 1e3) / peak:.0f}%" if peak else "?"


def bench_train(args):
    """andrea-12m on tiny Shakespeare (char tokenizer): the loss must fall."""
    from nanoandrea.backend import get_backend
    from nanoandrea.config import get_preset
    from nanoandrea.data import BatchSampler, Dataset, resolve_data
    from nanoandrea.model import GPT
    from nanoandrea.optim import AdamW, learning_rate
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


# --- the memory-bound kernels -------------------------------------------------------------

SMALL_SIZES = dict(N=16 * 1024, C=768, V=50257, P=124_475_904)   # andrea-120m, B=16, T=1024
TORCH_DEVICE = "cuda"


def gigabytes(nbytes):
    """row() reports work / ms / 1e9: bytes x 1e3 makes that GB/s."""
    return 1e3 * nbytes


def bench_small(args):
    """The fused memory-bound kernels at andrea-120m's sizes against what PyTorch runs for the
    same op: time, GB/s (the fewest bytes the op must move: each input read once, each output
    written once) and the ratio; every output checked against PyTorch's first."""
    import torch
    import torch.nn.functional as F
    from nanoandrea.kernels import adamw, crossentropy, gelu, layernorm
    N, C, V, P = (SMALL_SIZES[k] for k in "NCVP")
    print(f"small kernels: N={N:,} rows, C={C}, V={V:,}, P={P:,} parameters (float32)")
    rng = np.random.default_rng(0)

    def pair(*shape, scale=1.0):            # the same random values for us and for PyTorch
        host = (scale * rng.standard_normal(shape)).astype(np.float32)
        return cuda.to_device(host), torch.as_tensor(host, device=TORCH_DEVICE)

    def same(name, ours, theirs, limit=1e-5):
        got = ours.copy_to_host() if hasattr(ours, "copy_to_host") else ours
        error = relative_error(got, theirs.detach().cpu().numpy())
        require(error, limit, f"small kernels: {name}")

    def compare(name, ours, theirs, nbytes):
        theirs_ms = kernel_ms(theirs, args)
        ours_ms = kernel_ms(ours, args)
        row("small", name, ours_ms, gigabytes(nbytes), "GB/s", theirs_ms, "PyTorch")

    # x = a + b and layernorm(x), one kernel (ours) against an add and F.layer_norm
    (a, ta), (b, tb), (w, tw), (bias, tbias) = pair(N, C), pair(N, C), pair(C), pair(C)
    resid, out = cuda.device_array((N, C), np.float32), cuda.device_array((N, C), np.float32)
    mean, rstd = cuda.device_array(N, np.float32), cuda.device_array(N, np.float32)

    def ours_ln():
        layernorm.residual_layernorm_forward(resid, out, mean, rstd, a, b, w, bias)

    def theirs_ln():
        x = ta + tb
        return x, F.layer_norm(x, (C,), tw, tbias)
    ours_ln()
    want_resid, want_out = theirs_ln()
    same("residual + layernorm: x", resid, want_resid)
    same("residual + layernorm: out", out, want_out, 1e-4)
    compare(f"residual + layernorm [{N}x{C}]", ours_ln, theirs_ln, 4 * (4 * N * C + 2 * C + 2 * N))

    # GELU (tanh approximation) over the MLP's [N, 4C] hidden layer
    (h, th) = pair(N, 4 * C)
    g = cuda.device_array((N, 4 * C), np.float32)
    gelu.gelu_forward(g, h)
    same("gelu", g, F.gelu(th, approximate="tanh"))
    compare(f"gelu [{N}x{4 * C}]", lambda: gelu.gelu_forward(g, h),
            lambda: F.gelu(th, approximate="tanh"), 4 * 2 * N * 4 * C)

    # cross-entropy and its gradient in one pass (ours) against F.cross_entropy + autograd
    logits, tlogits = pair(N, V, scale=3.0)
    tlogits.requires_grad_(True)
    targets_host = rng.integers(0, V, size=N).astype(np.int32)
    targets = cuda.to_device(targets_host)
    ttargets = torch.as_tensor(targets_host, device=TORCH_DEVICE).long()
    dloss = cuda.to_device(np.ones(1, np.float32))
    loss, losses = cuda.device_array(1, np.float32), cuda.device_array(N, np.float32)
    lse, dlogits = cuda.device_array(N, np.float32), cuda.device_array((N, V), np.float32)

    def ours_ce():
        crossentropy.crossentropy_forward_backward(loss, losses, lse, dlogits, logits, targets,
                                                   dloss)

    def theirs_ce():
        value = F.cross_entropy(tlogits, ttargets)
        return value, torch.autograd.grad(value, tlogits)[0]
    ours_ce()
    want_loss, want_dlogits = theirs_ce()
    same("cross-entropy: loss", loss, want_loss.reshape(1))
    same("cross-entropy: dlogits", dlogits, want_dlogits, 1e-4)
    compare(f"cross-entropy fwd+bwd [{N}x{V}]", ours_ce, theirs_ce, 4 * (2 * N * V + N))
    # the model's case: rows of the padded vocabulary Vp (4k floats, aligned), the classes
    # their first V columns: the 16-byte kernel (PyTorch's at V the baseline)
    Vp = -(-V // 64) * 64
    logits_p = cuda.to_device(np.pad(tlogits.detach().cpu().numpy(), ((0, 0), (0, Vp - V))))
    dlogits_p = cuda.device_array((N, Vp), np.float32)

    def ours_ce_p():
        crossentropy.crossentropy_forward_backward(loss, losses, lse, dlogits_p, logits_p,
                                                   targets, dloss, V)
    ours_ce_p()
    same("cross-entropy at Vp: loss", loss, want_loss.reshape(1))
    same("cross-entropy at Vp: dlogits", dlogits_p.copy_to_host()[:, :V], want_dlogits, 1e-4)
    compare(f"cross-entropy fwd+bwd [{N}x{Vp}]", ours_ce_p, theirs_ce, 4 * (2 * N * Vp + N))

    # one AdamW step (global-norm clipping included) over all P parameters in one flat buffer,
    # against clip_grad_norm_ + torch's fused AdamW
    (params, tparams), (grads, tgrads) = pair(P, scale=0.02), pair(P)
    m, v = cuda.to_device(np.zeros(P, np.float32)), cuda.to_device(np.zeros(P, np.float32))
    hyper = cuda.to_device(adamw.adamw_hyperparameters(1e-3, 0.9, 0.99, 1e-8, 0.1, 1.0, 1))
    norm, partials = cuda.device_array(1, np.float32), cuda.device_array(adamw.NORM_BLOCKS,
                                                                         np.float32)
    tparam = torch.nn.Parameter(tparams)
    tparam.grad = tgrads.clone()
    optimizer = torch.optim.AdamW([tparam], lr=1e-3, betas=(0.9, 0.99), eps=1e-8,
                                  weight_decay=0.1, fused=TORCH_DEVICE == "cuda")

    def ours_adamw():
        adamw.grad_norm(norm, grads, partials)
        adamw.adamw_update(params, grads, m, v, hyper, norm, P)

    def theirs_adamw():
        torch.nn.utils.clip_grad_norm_([tparam], 1.0)
        optimizer.step()
    ours_adamw()                            # one step each from the same state, compared
    grad_before = tparam.grad.clone()
    theirs_adamw()
    same("adamw: params", params, tparam)
    tparam.grad = grad_before               # (clipping scaled the gradient in place)
    compare(f"adamw + clipping, {P:,} parameters", ours_adamw, theirs_adamw, 4 * 8 * P)


def bench_sample(args):
    """Generation at 1024 tokens of context, andrea-120m, greedy, B=1 and 8, fp32 and bf16:
    ours with the cache (a 768-token prompt and 256 new tokens: the context reaches 1024) and
    transformers' GPT2LMHeadModel.generate (which caches) on the same weights and precision,
    each the wall time of the whole call after a short warm-up call; ours without the cache
    over 16 tokens at the same context (a prompt of 1008); and one token's steady state, N
    replays of the captured step alone. Ratios: cached / uncached, and ours / HF."""
    import torch
    import transformers
    from nanoandrea import ops
    from nanoandrea.autograd import no_grad
    from nanoandrea.backend import get_backend
    from nanoandrea.checkpoint import to_gpt2_names
    from nanoandrea.config import get_preset
    from nanoandrea.hf import hf_config
    from nanoandrea.model import GPT
    from nanoandrea.sample import CachedDecoder, generate
    from nanoandrea.tokenizer import CharTokenizer
    torch.backends.cuda.matmul.allow_tf32 = False
    prompt_len, new_tokens, uncached_tokens, replays = 768, 256, 16, 200
    print(f"sample: andrea-120m, greedy, a {prompt_len}-token prompt and {new_tokens} new tokens "
          f"(uncached: {uncached_tokens} tokens after {1024 - uncached_tokens})")
    config = get_preset("andrea-120m")
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        **{k: v for k, v in hf_config(config, CharTokenizer("a")).items()
           if k not in ("architectures", "model_type", "torch_dtype")}))
    state = GPT(config, get_backend("cuda"), seed=0, moments=False).params.state_dict()
    missing, unexpected = hf.transformer.load_state_dict(
        {k: torch.as_tensor(v) for k, v in to_gpt2_names(state, config).items()}, strict=False)
    require(float(len([m for m in missing if not m.endswith("attn.bias")]) + len(unexpected)),
            0.5, "transformers took every weight")
    hf = hf.cuda().eval()

    def seconds(fn):
        cuda.synchronize()
        torch.cuda.synchronize()
        started = time.perf_counter()
        out = fn()
        cuda.synchronize()
        torch.cuda.synchronize()
        return time.perf_counter() - started, out

    for precision in ("fp32", "bf16"):
        model = GPT(config, get_backend("cuda", precision=precision), seed=None, moments=False)
        model.params.load_state_dict(state)
        if precision == "bf16":
            hf = hf.to(torch.bfloat16)
        for batch in (1, 8):
            rng = np.random.default_rng(batch)
            prompt = rng.integers(0, config.vocab_size, (batch, prompt_len))
            long_prompt = rng.integers(0, config.vocab_size, (batch, 1024 - uncached_tokens))

            def theirs(n):
                with torch.no_grad():
                    return hf.generate(torch.as_tensor(prompt, device="cuda"), do_sample=False,
                                       max_new_tokens=n, min_new_tokens=n,
                                       pad_token_id=0).cpu().numpy()
            theirs(4)                                   # (warm: kernels, memory pools)
            hf_s, hf_ids = seconds(lambda: theirs(new_tokens))
            generate(model, prompt, 4, temperature=0)
            ours_s, ids = seconds(lambda: generate(model, prompt, new_tokens, temperature=0))
            generate(model, long_prompt, 1, temperature=0, kv_cache=False)
            slow_s, _ = seconds(lambda: generate(model, long_prompt, uncached_tokens,
                                                 temperature=0, kv_cache=False))
            replay_ms = replay_time_ms(model, prompt, replays, ops, no_grad, CachedDecoder)
            rate, hf_rate = batch * new_tokens / ours_s, batch * new_tokens / hf_s
            slow_rate = batch * uncached_tokens / slow_s
            agree = float(np.mean(ids[:, prompt_len:] == hf_ids[:, prompt_len:]))
            same_rows = int(np.sum(np.all(ids == hf_ids, axis=1)))
            name = f"B={batch} {precision}"
            row("sample", f"{name} cached", 1e3 * ours_s, None, "", 1e3 * hf_s, "HF generate",
                f"{rate:,.0f} tok/s; HF {hf_rate:,.0f} tok/s: ours/HF {rate / hf_rate:.2f}x; "
                f"new ids equal to HF's: {100 * agree:.1f}%, {same_rows} of {batch} rows all "
                f"equal" + ("" if precision == "fp32" else " (HF's bf16 rounds every op)"))
            row("sample", f"{name} uncached", 1e3 * slow_s, None, "", None, "",
                f"{slow_rate:,.1f} tok/s: cached/uncached {rate / slow_rate:.1f}x")
            row("sample", f"{name} one replay", replay_ms, None, "", None, "",
                f"{batch * 1e3 / replay_ms:,.0f} tok/s in the steady state "
                f"(median of {replays} replays, context {prompt_len}..{prompt_len + replays})")


def replay_time_ms(model, prompt, replays, ops, no_grad, CachedDecoder):
    """Milliseconds of one decode step once captured: the prompt's forward, the eager and the
    captured step, then `replays` steps timed one by one (each: the new ids and position
    copied in, the graph launched, waited for), the median."""
    times = []
    with no_grad(), ops.fixed_weights(model.params.matrices()):
        decoder = CachedDecoder(model, prompt.shape[0])
        decoder.prefill(prompt)
        next_ids = np.asarray(prompt[:, -1])
        for step in range(replays + 2):
            cuda.synchronize()
            started = time.perf_counter()
            decoder.step(next_ids)
            cuda.synchronize()
            if decoder.cuda_graph:
                decoder.stream.synchronize()
            if step >= 2:                       # (the eager step and the capture)
                times.append(1e3 * (time.perf_counter() - started))
    return statistics.median(times)


SECTIONS = {"matmul": bench_matmul, "attention": bench_attention, "small": bench_small,
            "products": bench_products,
            "e2e": bench_e2e, "profile": bench_profile, "train": bench_train,
            "sample": bench_sample}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default=",".join(SECTIONS))
    parser.add_argument("--top", type=int, default=25, help="profile: how many kernels to list")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--e2e-repeat", type=int, default=5)
    parser.add_argument("--train-steps", type=int, default=50)
    parser.add_argument("--quick", action="store_true", help="skip the largest shapes")
    parser.add_argument("--compile", action="store_true",
                        help="e2e: PyTorch's GPT-2 under torch.compile too")
    parser.add_argument("--models", default=None, help="e2e: only these presets (comma list)")
    parser.add_argument("--shapes", default=None,
                        help="only these shapes (comma list): matmul labels' starts (qkv, "
                             "mlp, lm, 12m), attention's T x D (1024x64, 256x32, 1024x72)")
    parser.add_argument("--cache", default=None, help="folder for prepared data")
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "tf32", "bf16"],
                        help="matmul and e2e: the matmuls' precision (the module's doc)")
    args = parser.parse_args()
    device = cuda.get_current_device()
    print(f"device: {device.name.decode() if isinstance(device.name, bytes) else device.name}, "
          f"date {time.strftime('%Y-%m-%d')}")
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
