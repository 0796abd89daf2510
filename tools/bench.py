"""Benchmark nanoandrea's kernels and training step against cuBLAS (CuPy) and PyTorch, on the GPU.

    python tools/bench.py                       # everything, a table at the end
    python tools/bench.py --only matmul,attention
    python tools/bench.py --only train --train-steps 50

Every timing is the median of repeated runs measured with CUDA events after warm-up, the
competitors run in the same process on the same shapes, and every fast kernel's output is
checked against the reference before it is timed: a mismatch stops the benchmark (exit 1).
Sections:
  matmul     the andrea-120m (B=16, T=1024) products, forward and both backward ones, against
             cupy.matmul in float32 with TF32 off
  attention  forward and forward+backward against torch's scaled_dot_product_attention (float32)
  small      the fused memory-bound kernels (residual + layernorm, GELU, cross-entropy with its
             gradient, AdamW with clipping) against PyTorch's ops, in GB/s
  e2e        training tokens/s of full steps (forward, backward, AdamW) against a PyTorch GPT-2
             of identical shape (fused AdamW, SDPA, float32, TF32 off): consecutive steps
             between two events, as a training run has them (no wait for the GPU per step)
  train      andrea-12m on tiny Shakespeare for a few steps: the loss must fall
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
from nanoandrea.kernels import matmul as matmul_kernels  # noqa: E402
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
    not with the host's work before it (the row classes of the LM head at V = 50257 spend
    ~1.3 ms of Python before their 27 ms product: timed with nothing queued, 2% of their ratio
    to cuBLAS, docs/perf.md v18)."""
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
    import cupy
    print("matmul: andrea-120m products at B=16, T=1024 (float32; cuBLAS with TF32 off)")
    M = 16 * 1024
    shapes = [("qkv/W_O  [16384x768]x[768x768]", M, 768, 768),
              ("mlp up   [16384x768]x[768x3072]", M, 3072, 768),
              ("mlp down [16384x3072]x[3072x768]", M, 768, 3072),
              ("lm head  [16384x768]x[768x50257]", M, 50257, 768),
              ("lmVp     [16384x768]x[768x50304]", M, 50304, 768),  # the model's padded vocab
              ("12m proj [16384x384]x[384x384]", M, 384, 384),         # andrea-12m, B=64 T=256
              ("12m down [16384x1536]x[1536x384]", M, 384, 1536)]
    rng = cupy.random.default_rng(0)
    for label, m, n, k in shapes:
        if (args.quick and n >= 50257) or (args.shapes and not any(
                label.startswith(name) for name in args.shapes.split(","))):
            continue
        x = rng.standard_normal((m, k), dtype=cupy.float32)
        w = rng.standard_normal((k, n), dtype=cupy.float32)
        dy = rng.standard_normal((m, n), dtype=cupy.float32)
        # (name, our call, cupy call, flops); operands as Numba views of CuPy's memory
        X, W, DY = (cuda.as_cuda_array(a) for a in (x, w, dy))
        out_y = cuda.device_array((m, n), np.float32)
        out_dx = cuda.device_array((m, k), np.float32)
        out_dw = cuda.device_array((k, n), np.float32)
        products = [        # (name, transpose_a, transpose_b, our out, a, b, cupy's product,
            ("fwd  Y=X.W", False, False, out_y, X, W, lambda: x @ w, None, None),
            ("bwd dX=dY.W^T", False, True, out_dx, DY, W, lambda: dy @ w.T, None, None),
            ("bwd dX [W^T in kernel]", False, True, out_dx, DY, W, lambda: dy @ w.T, False, None),
            ("bwd dW=X^T.dY", True, False, out_dw, X, DY, lambda: x.T @ dy, None, None),
        ]                   # (... copy W^T?, pad_unaligned: see matmul)
        variants = {"": None}               # (the LM heads: too long to time every tile)
        variants.update({name: tiles for name, tiles in
                         (MATMUL_VARIANTS if n < 50257 else LM_VARIANTS).items()
                         if wanted(args, name)})
        pipelined = []
        if n % 4:                           # rows of V floats: the row classes (the default),
                                            # padded copies, or 4 bytes at a time
            plain = [(name, ta, tb, out, a, b, theirs)
                     for name, ta, tb, out, a, b, theirs, copy, _ in products if copy is None]
            if wanted(args, "cp.async 4-byte"):     # (the cp.async pipeline's 4-byte copies)
                pipelined = [(f"{name} [cp.async 4-byte]", *rest) for name, *rest in plain]
            # (the default: in place in four classes of rows, matmul.row_class_matmul) ... or
            products += [(f"{name} [padded copies]", *rest, None, True)    # on padded copies
                         for name, *rest in plain]
            if wanted(args, "4-byte kernels"):      # (timed in sessions 6-11: 0.70-0.75x)
                products += [(f"{name} [4-byte kernels]", *rest, None, False)
                             for name, *rest in plain]
            # ... or the operands padded and the output (rows of V) stored 4 bytes at a time
            if wanted(args, "padded operands"):     # (session 11: 0.72-0.80x)
                products += [(f"{name} [padded operands]", *rest, None, "operands")
                             for name, *rest in plain if rest[2].shape[1] % 4]
        cases = [(f"{name} [{variant}]" if variant else name,
                  lambda out=out, a=a, b=b, ta=ta, tb=tb, tiles=tiles, copy=copy, pads=pads:
                  matmul_kernels.matmul(out, a, b, transpose_a=ta, transpose_b=tb, tiles=tiles,
                                        copy_b_transposed=copy, pad_unaligned=pads), theirs, out)
                 for name, ta, tb, out, a, b, theirs, copy, pads in products
                 for variant, tiles in variants.items()
                 if (copy is None and pads is None) or not variant]
        cases += [(name, lambda out=out, a=a, b=b, ta=ta, tb=tb: matmul_kernels.matmul(
                       out, a, b, transpose_a=ta, transpose_b=tb, tiles=dict(stages=3),
                       copy_b_transposed=False, pad_unaligned=False), theirs, out)
                  for name, ta, tb, out, a, b, theirs in pipelined]
        if n % 4 and wanted(args, "bounded"):       # the row classes' products bounded to
            cases += [  # 2 blocks a multiprocessor (their default: unbounded, 128 registers)
                (f"{name} [row classes, bounded]", lambda out=out, a=a, b=b, ta=ta, tb=tb:
                 matmul_kernels.matmul(out, a, b, transpose_a=ta, transpose_b=tb,
                                       tiles=dict(blocks_per_sm=2), pad_unaligned="row classes"),
                 theirs, out) for name, ta, tb, out, a, b, theirs in plain]
        if n >= 50257 and wanted(args, "dX k_splits"):  # the input gradient's K is the vocabulary:
            for splits in (2, 3):                       # 768 output tiles, 2.9 waves, in slices
                cases.append((f"bwd dX=dY.W^T [dX k_splits={splits}]",
                              lambda splits=splits: matmul_kernels.matmul(   # (padded:
                                  out_dx, DY, W, transpose_b=True, k_splits=splits,  # the row
                                  pad_unaligned=n % 4 != 0 or None),   # classes do not split K)
                              lambda: dy @ w.T, out_dx))
        # the weight gradient in slices of 16 (one barrier a 1024 FFMA, not 512; ptxas: 128
        # registers, no spills, the k loop 1191 instructions for 1024 FFMA against the
        # default's 578 for 512; Nsight Compute found the weight gradient the most
        # barrier-stalled of the three products, session 9)
        dw_variants = [("BK16, cp.async 2 stages", None, dict(BK=16, stages=2))]
        if n < 50257:                       # with half and twice the slices of K split_count
            chosen = matmul_kernels.split_count(k, n, m, (128, 128, 8))             # picks
            dw_variants += [(f"k_splits={splits}", splits, None) for splits in
                            sorted({max(1, chosen // 2), 2 * chosen} - {chosen})]
            dw_variants += [(f"cp.async, {stages} stages", None, dict(stages=stages))
                            for stages in (3, 4)]     # ... and with its slices copied by cp.async
            dw_variants += [("8x16 128 threads, cp.async 3 stages", None,       # (cuBLAS's)
                             dict(thread_cols=16, blocks_per_sm=2, stages=3))]
        for variant, splits, tiles in [v for v in dw_variants if wanted(args, v[0])]:
            cases.append((f"bwd dW=X^T.dY [{variant}]",
                          lambda splits=splits, tiles=tiles: matmul_kernels.matmul(
                              out_dw, X, DY, transpose_a=True, k_splits=splits, tiles=tiles),
                          lambda: x.T @ dy, out_dw))
        if "down" in label:
            gelu_backward_pair(args, label, m, n, k, DY, W, out_dx)
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
            short = " ".join(label.split()[:2 if label.startswith("12m") else 1])
            row("matmul", f"{short:8s} {name}", ours_ms, flops, "TFLOP/s", theirs_ms,
                "cuBLAS", f"(cuBLAS {flops / theirs_ms / 1e9:.1f} TFLOP/s, err {error:.1e})")


def gelu_backward_pair(args, label, m, n, k, DY, W, out_dx):
    """The MLP's input gradient through GELU, d(pre) = (dY . W^T) * gelu'(pre), as one product
    with GELU's backward in its epilogue (what the model runs) against the product followed by
    the gelu_backward kernel: the same arithmetic, so the two must agree to the bit-ish."""
    import cupy
    from nanoandrea.kernels.gelu import gelu_backward
    pre = cuda.as_cuda_array(cupy.random.default_rng(1).standard_normal((m, k), dtype=cupy.float32))
    product = cuda.device_array((m, k), np.float32)
    fused_out = cuda.device_array((m, k), np.float32)

    def fused(tiles=None, copy=None):
        matmul_kernels.matmul(fused_out, DY, W, transpose_b=True, gelu_input=pre, tiles=tiles,
                              copy_b_transposed=copy)

    def unfused():
        matmul_kernels.matmul(product, DY, W, transpose_b=True)
        gelu_backward(out_dx, product, pre)
    unfused()
    unfused_ms = kernel_ms(unfused, args)
    short = " ".join(label.split()[:2 if label.startswith("12m") else 1])
    variants = [("", None, None), (" [1 block/SM]", dict(blocks_per_sm=1), None),
                (" [W^T in kernel]", None, False)]
    variants += [(f" [{name}]", tiles, None) for name, tiles in MATMUL_VARIANTS.items()
                 if "SM" not in name and wanted(args, name)]   # (the blocks/SM: listed above,
                                                            # or this kernel's default)
    for variant, tiles, copy in variants:
        fused_out.copy_to_device(np.full((m, k), np.nan, np.float32))
        fused(tiles, copy)
        cuda.synchronize()
        error = relative_error(fused_out.copy_to_host(), out_dx.copy_to_host())
        require(error, 1e-6, f"matmul {label} dX with gelu' fused{variant}")
        row("matmul", f"{short:8s} bwd dX*gelu' fused{variant}",
            kernel_ms(lambda: fused(tiles, copy), args), 2.0 * m * n * k, "TFLOP/s", unfused_ms,
            "unfused", f"(err {error:.1e})")


# tile variants of the blocked kernel timed with --variants (make_blocked_matmul_kernel's options).
# The 512-thread tiles 128x256 and 256x128 (dict(BN=256, blocks_per_sm=1), dict(BM=256, ...))
# were 3-30% slower than 128x128 on every product (H200, 2026-11-29, session 5, run 1): no
# longer timed by default. Nor is an L2-aware block order (tiles taken 8 or 16 rows of tiles at a
# time, column by column within a group): 2-7% slower on every 16-byte product, 1-3% faster only
# on the LM head's 4-byte ones (session 6, run 1; it was removed from the kernel).
# "8x16 a thread": 128 x 256 block tiles of 256 threads, each 8 x 16 (thread_cols=16), as
# CUTLASS's SIMT SGEMM that cuBLAS runs for the largest float32 products here; ptxas: 254
# registers, 8 bytes spilled, the k loop 1024 FFMA of 1151 instructions (89%, the 8 x 8
# kernel's 85%). Timed in session 7 (run 1): 0.74-0.81x cuBLAS on the 120m products where
# the 8 x 8 kernel runs 0.89-0.96x (one block of 8 warps a multiprocessor hides too little).
# "warps 4x8": a warp covers 4 x 8 threads of the grid, not 2 x 16 (4 shared-memory wavefronts
# a warp a step of k, not 6; ptxas the same registers): 3-6% slower on every product of qkv,
# mlp and lmVp (session 8, run 2; 8 x 4 the same), so the wavefronts were not what held it.
# "128x256 cp.async": CUTLASS's SIMT tile again, through the cp.async pipeline (no staging
# registers; ptxas: 255 registers, no spills, the k loop 1202 instructions for 1024 FFMA):
# 0.77-0.87x cuBLAS where the default ran 0.89-0.97x (session 10, run 4).
# "fragments ahead": each step's shared-memory fragments read while the step before is
# multiplied, and the next slice's first right after the barrier, under the last step's 64
# FFMA (ptxas: the same 124-128 registers, no spills, the k loops 597-631 instructions against
# 578-617). Timed (session 11, run 1): 6-8% slower on every plain product of qkv, mlp and
# 12m, 2% on the two with GELU's backward fused.
# "8x16 128 threads": 128 x 128 block tiles of 128 threads, each 8 x 16, 2 blocks (8 warps) a
# multiprocessor: the tile, threads and occupancy of the cuBLAS kernel that beats ours at
# 16384 x 3072 x 768 (Nsight Compute, session 9: sm80_xmma_gemm_f32f32..._tilesize128x128x8_
# stage3, 128 threads, 255 registers, 91% of cycles issuing against our 84%, with ~2.2x fewer
# barrier and ~4x fewer dispatch stalls an instruction). ptxas: NN 255 registers and 20 bytes
# spilled, NT 243 and none, TN 254 and 8 bytes; the k loop 1024 FFMA of ~1180 instructions
# (87%; the 8 x 8 kernel's 512 of 600) and 48 shared loads for them (the 8 x 8: 32 for 512).
# Timed (session 9, run 2): 5-15% slower on every product (0.79-0.87x cuBLAS where the default
# runs 0.89-0.97x; the LM head at 50257 0.73-0.78x), and with cp.async on the weight gradient
# 2-4% slower: cuBLAS's tile without its way of loading A (its registers went to staging).
MATMUL_VARIANTS = {"1 block/SM": dict(blocks_per_sm=1), "2 blocks/SM": dict(blocks_per_sm=2),
                   "8x16 a thread": dict(BN=256, thread_cols=16, blocks_per_sm=1),
                   "warps 4x8": dict(warp_rows=4),
                   "8x16 128 threads": dict(thread_cols=16, blocks_per_sm=2),
                   "128x256 cp.async": dict(BN=256, thread_cols=16, blocks_per_sm=1, stages=3),
                   "fragments ahead": dict(fragments_ahead=True)}
LM_VARIANTS = {name: MATMUL_VARIANTS[name] for name in ("8x16 a thread", "warps 4x8",
                                                        "fragments ahead")}


# --- attention ------------------------------------------------------------------------------

def bench_attention(args):
    import torch
    import torch.nn.functional as F
    print("attention: causal, float32, against torch scaled_dot_product_attention")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    for B, H, T, D in [(16, 12, 1024, 64), (64, 12, 256, 32), (16, 12, 1024, 72)]:
        if args.shapes and not any(f"{T}x{D}" == name for name in args.shapes.split(",")):
            continue                        # (--shapes 1024x64,256x32: attention's T x D)
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, dout = (torch.randn(B, H, T, D, device="cuda", generator=gen) for _ in range(4))
        qs, ks, vs = (t.clone().requires_grad_(True) for t in (q, k, v))
        out, lse, delta = (cuda.device_array(s, np.float32) for s in
                           ((B, H, T, D), (B, H, T), (B, H, T)))
        dq, dk, dv = (cuda.device_array((B, H, T, D), np.float32) for _ in range(3))
        label = f"[{B},{H},{T},{D}]"
        for kernel, rows, tiles, variant in attention_variants(D, T, args):
            if "4-byte" in variant:     # heads one float off 16 bytes: staged 4 bytes at a time
                Q, K, V, DOUT = (unaligned_copy(t) for t in (q, k, v, dout))
            else:
                Q, K, V, DOUT = (cuda.as_cuda_array(t) for t in (q, k, v, dout))

            def forward():
                attention_kernels.attention_forward(out, lse, Q, K, V, kernel=kernel,
                                                    rows_per_block=rows, tiles=tiles)

            def backward():
                attention_kernels.attention_backward(dq, dk, dv, delta, DOUT, Q, K, V, out, lse,
                                                     kernel=kernel, rows_per_block=rows,
                                                     tiles=tiles)
            for array in (out, dq, dk, dv):         # poisoned: an element left unwritten fails
                torch.as_tensor(array, device="cuda").fill_(float("nan"))
            forward()
            backward()
            ref = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
            # autograd.grad, not .backward(): the timing loops below run backward again and
            # again, and .grad would accumulate them (the check would then read ~14x SDPA's
            # gradients)
            ref_grads = torch.autograd.grad(ref, (qs, ks, vs), dout)
            cuda.synchronize()
            # correctness: ours against float64 NumPy on two heads (the first and the last),
            # and SDPA's too, so that the comparison below compares like with like ...
            for b, h in ((0, 0), (B - 1, H - 1)):
                for name, error in head_errors(q, k, v, dout, out, dq, dk, dv, b, h).items():
                    require(error, 1e-4, f"attention {label} {kernel} head ({b},{h}) {name}")
                for name, error in head_errors(q, k, v, dout, ref, *ref_grads, b, h).items():
                    require(error, 1e-3, f"attention {label} SDPA head ({b},{h}) {name}")
            # ... and, for the record, how far SDPA's float32 answer is from ours
            for got, want, name in ((out, ref.detach(), "out"), (dq, ref_grads[0], "dq"),
                                    (dk, ref_grads[1], "dk"), (dv, ref_grads[2], "dv")):
                error = relative_error(torch.as_tensor(got, device="cuda").cpu(), want.cpu())
                if error >= 1e-4:
                    print(f"  note: {label} {name}: ours and SDPA differ by {error:.1e} "
                          f"(both match float64 NumPy, checked above)")

            if kernel == "tensor":                  # registers, and bytes spilled
                compiled = attention_kernels._tensor_forward(D, tiles and tiles[0], (Q, K, V))
                print(f"  note: {label} tensor{variant}: "
                      f"{max(compiled.get_regs_per_thread().values())} registers, "
                      f"{max(compiled.get_local_mem_per_thread().values())} bytes of local "
                      f"memory")
            if kernel == "fast" and rows is None:   # same inputs again: the same bits?
                first = torch.as_tensor(dq, device="cuda").clone()
                backward()
                again = torch.autograd.grad(F.scaled_dot_product_attention(
                    qs, ks, vs, is_causal=True), (qs, ks, vs), dout)[0]
                same = [torch.equal(first, torch.as_tensor(dq, device="cuda")),
                        torch.equal(ref_grads[0], again)]
                print(f"  note: {label}{variant}: dq the same to the bit in a second backward: "
                      f"ours {'yes' if same[0] else 'no'}, SDPA {'yes' if same[1] else 'no'}")

            def torch_forward():
                with torch.no_grad():
                    F.scaled_dot_product_attention(q, k, v, is_causal=True)

            def torch_both():                # returns the gradients, accumulates nothing
                y = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
                torch.autograd.grad(y, (qs, ks, vs), dout)

            flops_fwd = 4.0 * B * H * T * T * D / 2           # causal: half the score matrix
            name = f"{label} {kernel}{'' if rows is None else f' rows={rows}'}{variant}"
            row("attention", name + " fwd", kernel_ms(forward, args), flops_fwd, "TFLOP/s",
                kernel_ms(torch_forward, args), "SDPA")
            row("attention", name + " fwd+bwd", kernel_ms(lambda: (forward(), backward()), args),
                flops_fwd * 3.5, "TFLOP/s", kernel_ms(torch_both, args), "SDPA")


def unaligned_copy(tensor):
    """A Numba view of a copy of `tensor` that starts one float past a 16-byte boundary."""
    import torch
    flat = torch.empty(tensor.numel() + 1, device=tensor.device, dtype=tensor.dtype)
    copy = flat[1:].view(tensor.shape)
    copy.copy_(tensor)
    return cuda.as_cuda_array(copy)


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


def attention_variants(D, T, args):
    """(kernel, rows_per_block, tiles, label): the reference where it is not too slow to wait
    for, the fast kernels with their default query tile and with one block per (batch, head),
    the tensor-core forward; with --variants, the other tiles asked for too
    (attention.TILE_VARIANTS, TENSOR_TILE_VARIANTS)."""
    variants = [("reference", None, None, "")] if D == 72 or T <= 256 else []
    if D in attention_kernels.FAST_HEAD_SIZES:
        variants += [("fast", None, None, ""), ("fast", T, None, ""), ("tensor", None, None, "")]
        variants += [("tensor", None, (tile, None, None), f" [{name}]")
                     for name, tile in attention_kernels.TENSOR_TILE_VARIANTS.items()
                     if wanted(args, name)]
        variants += [("fast", None, tiles, f" [{name}]")
                     for name, tiles in attention_kernels.TILE_VARIANTS.get(D, {}).items()
                     if wanted(args, name)]
        if wanted(args, "4-byte staging"):
            variants.append(("fast", None, None, " [4-byte staging]"))
    return variants


def wanted(args, variant):
    """Whether --variants asks for this variant: all of them (the flag alone), or those whose
    names contain one of its comma-separated words."""
    return args.variants is not None and (args.variants == "" or any(
        word in variant for word in args.variants.split(",")))


# --- end to end -------------------------------------------------------------------------------

E2E_CASES = [("andrea-12m", 64, 256, 4096), ("andrea-120m", 16, 1024, 50257)]


def e2e_cases(args):
    """(preset, B, T, our step(graph), PyTorch's step) of each end-to-end case: the same
    config, the same batch, AdamW on both sides."""
    import torch
    from nanoandrea.backend import get_backend
    from nanoandrea.config import get_preset
    from nanoandrea.model import GPT
    from nanoandrea.optim import AdamW
    from nanoandrea.step import TrainStep
    from nanoandrea.torch_gpt import TorchGPT
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    for preset, B, T, V in E2E_CASES:
        if (args.quick and preset == "andrea-120m") or (args.models and preset not in args.models):
            continue
        config = get_preset(preset, vocab_size=V, block_size=T)
        rng = np.random.default_rng(0)
        idx = rng.integers(0, V, size=(B, T)).astype(np.int32)
        targets = rng.integers(0, V, size=(B, T)).astype(np.int32)
        model = GPT(config, get_backend("cuda"), seed=0)
        optimizer = AdamW(model.params, lr=1e-4)

        def ours(graph, model=model, optimizer=optimizer, B=B, T=T, batch=(idx, targets),
                 second_stream=True):
            step = TrainStep(model, optimizer, B, T, train=False, cuda_graph=graph,
                             second_stream=second_stream)
            return lambda: step([batch], [0], 1e-4)
        reference = TorchGPT(config, device="cuda")
        torch_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-4, fused=True)
        tidx, ttargets = (torch.as_tensor(a, device="cuda").long() for a in (idx, targets))

        def theirs(reference=reference, torch_optimizer=torch_optimizer, tidx=tidx,
                   ttargets=ttargets):
            torch_optimizer.zero_grad(set_to_none=True)
            _, loss = reference(tidx, ttargets)
            loss.backward()
            torch_optimizer.step()
        yield preset, B, T, config, ours, theirs


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
    print("end to end: training steps (forward, backward, AdamW), float32, steady state")
    for preset, B, T, config, ours, theirs in e2e_cases(args):
        tokens = B * T
        # ours: the step eagerly (every launch from Python), then captured as a CUDA graph: on
        # one stream; with its weight gradients on a second; and with the forward's K and V
        # products there too (the default)
        modes = {"eager": dict(graph=False),
                 "graph, one stream": dict(graph=True, second_stream=False),
                 "graph, second stream in backward": dict(graph=True, second_stream="backward"),
                 "graph": dict(graph=True)}
        # (each of the first three alone, then the default and PyTorch's step in turns: the
        # ratio the issue asks for from timings that alternate; session 17 and before timed
        # PyTorch's step after all of ours, andrea-120m at 0.998-1.006x over four runs)
        ours_ms = {mode: steps_time_ms({mode: ours(**kw)}, args.e2e_repeat)[mode]
                   for mode, kw in modes.items() if mode != "graph"}
        both = steps_time_ms({"graph": ours(**modes["graph"]), "PyTorch": theirs},
                             args.e2e_repeat)
        ours_ms["graph"], torch_ms = both["graph"], both["PyTorch"]
        flops = flops_per_token(config) * tokens
        for mode, ms in ours_ms.items():
            row("e2e", f"{preset} B={B} T={T} step, {mode}", ms,
                flops, "TFLOP/s", torch_ms, "PyTorch",
                f"ours {tokens / ms * 1e3:,.0f} tok/s (MFU {mfu(flops, ms)}), PyTorch "
                f"{tokens / torch_ms * 1e3:,.0f} tok/s (MFU {mfu(flops, torch_ms)})")


def kernel_name(name):
    """A readable kernel name: Numba's arrive demangled as nanoandrea::kernels::matmul::
    make_blocked_matmul_kernel::_3clocals_3e::blocked_matmul_kernel[abi:v12][abi:cw51c...](...);
    keep module.function (and the factory that made a closure kernel)."""
    if "nanoandrea::" not in name:
        return name[:60]
    name = re.sub(r"\[abi:[^]]*\]", "", name.split("(")[0]).replace("::_3clocals_3e", "")
    return ".".join(name.split("::")[2:])


def bench_profile(args):
    """Each kernel's GPU time in one training step, ours and PyTorch's side by side, recorded
    by the CUDA profiling interface (through torch.profiler: it sees every kernel of the
    process, Numba's too). Our step runs eagerly here: the same kernels a graph replays."""
    from torch.profiler import ProfilerActivity, profile
    steps = 3
    for preset, B, T, config, ours, theirs in e2e_cases(args):
        for side, fn in (("ours", ours(False)), ("PyTorch", theirs)):
            for _ in range(3):
                fn()
            cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    fn()
                cuda.synchronize()
            totals = {}
            for event in prof.events():
                if event.device_type.name != "CUDA":
                    continue
                entry = totals.setdefault(kernel_name(event.name), [0, 0.0])
                entry[0] += 1
                entry[1] += event.time_range.elapsed_us() / 1e3
            total = sum(ms for _, ms in totals.values())
            print(f"profile: {preset} B={B} T={T}, {side}: {total / steps:.2f} ms of kernels "
                  f"per step")
            for name, (count, ms) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:args.top]:
                print(f"  {name:60s} {count // steps:4d}/step {ms / steps:8.3f} ms "
                      f"{1e3 * ms / count:9.1f} us each {100 * ms / total:5.1f}%")


def mfu(flops, ms):
    """Model FLOPs utilisation against the GPU's float32 peak without tensor cores."""
    name = cuda.get_current_device().name
    name = name.decode() if isinstance(name, bytes) else name
    peak = next((peak for key, peak in PEAK_FLOPS.items() if key in name), None)
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
    # their first V columns: the 16-byte kernel and the 4-byte one (PyTorch's at V the baseline)
    Vp = -(-V // 64) * 64
    logits_p = cuda.to_device(np.pad(tlogits.detach().cpu().numpy(), ((0, 0), (0, Vp - V))))
    dlogits_p = cuda.device_array((N, Vp), np.float32)
    for vector, threads in ((True, None), (True, 1024), (True, 512), (False, None)):
        def ours_ce_p(vector=vector, threads=threads):
            crossentropy.crossentropy_forward_backward(loss, losses, lse, dlogits_p, logits_p,
                                                       targets, dloss, V, vector, threads)
        name = f"{'16' if vector else '4'}-byte{f', {threads} threads' if threads else ''}"
        ours_ce_p()
        same(f"cross-entropy at Vp ({name}): loss", loss, want_loss.reshape(1))
        same(f"cross-entropy at Vp ({name}): dlogits", dlogits_p.copy_to_host()[:, :V],
             want_dlogits, 1e-4)
        compare(f"cross-entropy fwd+bwd [{N}x{Vp}] {name}", ours_ce_p, theirs_ce,
                4 * (2 * N * Vp + N))

    # pad and unpad (kernels/pad.py): the logits' rows of V floats to rows of 4k and back, the
    # copies matmul makes for the LM head at an unaligned vocabulary, against torch's F.pad and
    # slice-and-copy (each moves ~8 bytes a float)
    from nanoandrea.kernels import pad
    V4 = pad.padded_length(V)
    wide, twide = cuda.device_array((N, V4), np.float32), F.pad(tlogits.detach(), (0, V4 - V))
    back = cuda.device_array((N, V), np.float32)
    pad.pad(wide, logits)
    pad.unpad(back, wide)
    same("pad", wide, twide, 1e-30)         # (a copy: bit for bit)
    same("unpad", back, tlogits, 1e-30)
    compare(f"pad [{N}x{V}] -> [{N}x{V4}]", lambda: pad.pad(wide, logits),
            lambda: F.pad(tlogits.detach(), (0, V4 - V)), 4 * N * (V + V4))
    compare(f"unpad [{N}x{V4}] -> [{N}x{V}]", lambda: pad.unpad(back, wide),
            lambda: twide[:, :V].contiguous(), 4 * N * (V + V4))

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


SECTIONS = {"matmul": bench_matmul, "attention": bench_attention, "small": bench_small,
            "e2e": bench_e2e, "profile": bench_profile, "train": bench_train}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default=",".join(SECTIONS))
    parser.add_argument("--top", type=int, default=25, help="profile: how many kernels to list")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--e2e-repeat", type=int, default=5)
    parser.add_argument("--train-steps", type=int, default=50)
    parser.add_argument("--quick", action="store_true", help="skip the largest shapes")
    parser.add_argument("--models", default=None, help="e2e: only these presets (comma list)")
    parser.add_argument("--shapes", default=None,
                        help="only these shapes (comma list): matmul labels' starts (qkv, "
                             "mlp, lm (both LM heads), lmVp, 12m), attention's T x D "
                             "(1024x64, 256x32, 1024x72)")
    parser.add_argument("--variants", nargs="?", const="", default=None,
                        help="time tile variants too: all, or those whose names contain one "
                        "of these comma-separated words")
    parser.add_argument("--cache", default=None, help="folder for prepared data")
    parser.add_argument("--json", default=None, help="write the rows here")
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
