"""The matrix products of a training step, each against cuBLAS on the same operands:
andrea-120m's (B=16, T=1024) and andrea-12m's (B=64, T=256) linear layers, the forward and both
backward products, and the MLP's input gradient with GELU's backward in the product's epilogue.

    --precision fp32   kernels/matmul's dispatch on float32 arrays (the register-blocked SGEMM,
                       matmul/float32.py) against cupy.matmul with TF32 off
    --precision bf16   operands rounded to bf16 once (operands.Bf16Matrix, as the model rounds
                       them): wgmma on an H100 / H200, else mma.sync, against cuBLAS bf16
                       (torch.matmul of bf16 tensors, bf16 out); checked against the float64
                       product of the rounded operands
    --precision tf32   the same on tf32 operands (mma.sync) against cuBLAS with TF32 on
"""
import numpy as np
from numba import cuda

from benchmarks.timing import kernel_ms, relative_error, require, row
from nanoandrea.kernels import matmul as matmul_kernels
from nanoandrea.kernels import operands


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
    rounded, round_x, mm = ((operands.rounded_bf16, operands.round_bf16,
                             matmul_kernels.matmul_bf16) if precision == "bf16" else
                            (operands.rounded_tf32, operands.round_tf32,
                             matmul_kernels.matmul_tf32))
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"     # (cuBLAS's tf32)
    print(f"matmul: the products of a training step in {precision} (cuBLAS {precision} through "
          "torch)")
    generator = torch.Generator(device="cuda").manual_seed(0)
    for label, m, n, k in matmul_shapes(args):
        x, w, dy = (torch.randn(shape, device="cuda", generator=generator)
                    for shape in ((m, k), (k, n), (m, n)))
        x_float = cuda.as_cuda_array(x)
        X, W, DY = (rounded(cuda.as_cuda_array(t)) for t in (x, w, dy))
        if precision == "bf16":                 # cuBLAS's operands, and the rounded values
            xb, wb, dyb = x.bfloat16(), w.bfloat16(), dy.bfloat16()
            xr, wr, dyr = (t.double() for t in (xb, wb, dyb))
        else:
            xb, wb, dyb = x, w, dy
            xr, wr, dyr = (torch.as_tensor(t.values, device="cuda")[:, :t.shape[1]].double()
                           for t in (X, W, DY))
        outs = [torch.empty(shape, device="cuda") for shape in ((m, n), (m, k), (k, n))]
        out_y, out_dx, out_dw = (cuda.as_cuda_array(t) for t in outs)
        round_ms = kernel_ms(lambda: round_x(X, x_float), args)
        rounded_bytes = (X.bf16_pairs if precision == "bf16" else X.values).nbytes
        row("matmul", f"{short_name(label):8s} "
            f"round X {precision}", round_ms, 4.0 * m * k + rounded_bytes, "TB/s", None, None,
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
