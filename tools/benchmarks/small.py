"""The fused memory-bound kernels at andrea-120m's sizes (B=16, T=1024) against what PyTorch
runs for the same op: residual + layer norm, GELU, cross-entropy with its gradient (at V and
at the padded vocabulary), the bias gradients (column sums of bf16 dY), one AdamW step with clipping over all parameters. Each in GB/s of
the fewest bytes the op must move, every output checked against PyTorch's first.
"""
import numpy as np
from numba import cuda

from benchmarks.timing import kernel_ms, relative_error, require, row


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

    # the bias gradients: column sums of the bf16 dY the products read (every linear layer's,
    # at C and at the MLP's 4C), the fast kernel and the reference's, against PyTorch's sum
    # of the same bf16 values in float32 (autocast's bias gradient of its bf16 dY)
    from nanoandrea.kernels import reduce
    from nanoandrea.kernels.operands import rounded_bf16
    for width in (C, 4 * C):
        dy, tdy = pair(N, width)
        dy_bf16 = rounded_bf16(dy)
        tdy = tdy.bfloat16()
        db = cuda.device_array(width, np.float32)
        reduce.sum_rows(db, dy_bf16)
        same(f"bias gradient [{N}x{width}]", db, tdy.sum(dim=0, dtype=torch.float32), 1e-5)
        compare(f"bias gradient, bf16 dY [{N}x{width}]", lambda: reduce.sum_rows(db, dy_bf16),
                lambda: tdy.sum(dim=0, dtype=torch.float32), 2 * N * width + 4 * width)
        fast = reduce.takes_sum_rows8
        reduce.takes_sum_rows8 = lambda x: False
        try:
            compare(f"  the reference kernel [{N}x{width}]", lambda: reduce.sum_rows(db, dy_bf16),
                    lambda: tdy.sum(dim=0, dtype=torch.float32), 2 * N * width + 4 * width)
        finally:
            reduce.takes_sum_rows8 = fast

    # one AdamW step (global-norm clipping included) over all P parameters in one flat buffer,
    # against clip_grad_norm_ + torch's fused AdamW; ours also writes every weight's bf16 copy
    # (as in bf16 training, where all but P's few vectors are matrices): 2 bytes more each
    (params, tparams), (grads, tgrads) = pair(P, scale=0.02), pair(P)
    m, v = cuda.to_device(np.zeros(P, np.float32)), cuda.to_device(np.zeros(P, np.float32))
    bf16_copies = cuda.device_array(P, np.uint16)
    hyper = cuda.to_device(adamw.adamw_hyperparameters(1e-3, 0.9, 0.99, 1e-8, 0.1, 1.0, 1))
    norm, partials = cuda.device_array(1, np.float32), cuda.device_array(adamw.NORM_BLOCKS,
                                                                         np.float32)
    tparam = torch.nn.Parameter(tparams)
    tparam.grad = tgrads.clone()
    optimizer = torch.optim.AdamW([tparam], lr=1e-3, betas=(0.9, 0.99), eps=1e-8,
                                  weight_decay=0.1, fused=TORCH_DEVICE == "cuda")

    def ours_adamw():
        adamw.grad_norm(norm, grads, partials)
        adamw.adamw_update(params, grads, m, v, hyper, norm, P, bf16_copies)

    def theirs_adamw():
        torch.nn.utils.clip_grad_norm_([tparam], 1.0)
        optimizer.step()
    ours_adamw()                            # one step each from the same state, compared
    grad_before = tparam.grad.clone()
    theirs_adamw()
    same("adamw: params", params, tparam)
    tparam.grad = grad_before               # (clipping scaled the gradient in place)
    compare(f"adamw + clipping, {P:,} parameters", ours_adamw, theirs_adamw, 4 * 8 * P + 2 * P)
