"""Causal attention, forward and forward + backward, against torch's
scaled_dot_product_attention (SDPA) on the same values, at andrea-120m's heads [16,12,1024,64],
andrea-12m's [64,12,256,32] and, in float32, a head size the tensor cores do not take (72).

    --precision fp32   the float32 flash kernels (attention/float32.py) and, where they are not
                       too slow to wait for, the reference ones, against SDPA in float32
    --precision bf16   the dispatch's bf16 kernels (wgmma on an H100 / H200, else mma.sync)
                       against SDPA on bf16 tensors; also with q, k, v given in bf16 already, as
                       the model calls them; then each kernel's time, ours and SDPA's

Every output is checked against float64 NumPy on two heads (SDPA's too) before it is timed.
"""
import numpy as np
from numba import cuda

from benchmarks.timing import (Mismatch, kernel_ms, kernel_times, print_kernel_times,
                               relative_error, require, row)
from nanoandrea.kernels import attention as attention_kernels
from nanoandrea.kernels.attention import float32 as float32_attention


def bench_attention(args):
    import torch
    import torch.nn.functional as F
    bf16 = args.precision == "bf16"
    print(f"attention: causal, {'bf16 (ours: the tensor-core kernels)' if bf16 else 'float32'}"
          f", against torch scaled_dot_product_attention in the same precision")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    # in bf16 ours reads float32 q, k, v, dout (rounded as staged), SDPA bf16 copies of them
    forward_of = (attention_kernels.attention_forward_bf16 if bf16
                  else attention_kernels.attention_forward)
    backward_of = (attention_kernels.attention_backward_bf16 if bf16
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
        kernels = ["float32"] if D in float32_attention.HEAD_SIZES else []
        if not bf16 and (D not in float32_attention.HEAD_SIZES or T <= 256):
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

            if kernel == "float32":                 # same inputs again: the same bits?
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
                operands = [attention_kernels.heads_operand(x) for x in (Q, K, V)]  # bf16

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
    # torch.profiler has run can measure the host (a call of many small launches read 2.7
    # times its time before the profile)
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
