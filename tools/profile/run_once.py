"""One call of nanoandrea's fast kernels and of their PyTorch / cuBLAS counterparts at one
shape, for a profiler to look at (Nsight Compute):

    ncu -k regex:'dkdv|fmha' --launch-skip 3 --launch-count 6 --section SpeedOfLight \\
        python tools/profile/run_once.py attention --shape 16,12,1024,64
    python tools/profile/run_once.py matmul --shape 16384,3072,768    # M,N,K: Y = X.W, dX, dW

attention: a causal forward and backward, ours then SDPA's (float32; with --precision bf16
the tensor-core kernels and SDPA in bf16). matmul: the forward and both backward products of
a linear layer, ours then cuBLAS's (CuPy, TF32 off; with --precision bf16 on operands rounded
once, wgmma on an H100 / H200, and cuBLAS bf16 through torch). With --epilogue
(bf16 only): the one product of the MLP that carries it, as the training step makes it, and
nothing else: gelu, the MLP's up projection Y = X.W + bias with Y and GELU(Y) written in bf16;
gelu_grad, its input gradient dY.W^T times gelu'(Y), in bf16. Each side runs
`--rounds` times (the first compiles and warms up); nothing is timed here (tools/bench.py
times, this only gives a profiler the same launches to see; tools/profile/stalls.py reads
what Nsight Compute makes of them)."""
import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("CUPY_TF32", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
from numba import cuda  # noqa: E402

from nanoandrea.kernels import attention, matmul  # noqa: E402
from nanoandrea.kernels.operands import Bf16Matrix, device_empty, rounded_bf16  # noqa: E402


def run_attention(shape, rounds, precision):
    import torch
    bf16 = precision == "bf16"
    forward = attention.attention_forward_bf16 if bf16 else attention.attention_forward
    backward = attention.attention_backward_bf16 if bf16 else attention.attention_backward
    B, H, T, D = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(B, H, T, D, device="cuda", generator=gen) for _ in range(4))
    Q, K, V, DOUT = (cuda.as_cuda_array(t) for t in (q, k, v, dout))
    out, dq, dk, dv = (cuda.device_array((B, H, T, D), np.float32) for _ in range(4))
    lse, delta = (cuda.device_array((B, H, T), np.float32) for _ in range(2))
    for _ in range(rounds):
        forward(out, lse, Q, K, V)
        backward(dq, dk, dv, delta, DOUT, Q, K, V, out, lse)
    cuda.synchronize()
    dtype = torch.bfloat16 if bf16 else torch.float32
    leaves = [t.to(dtype).requires_grad_(True) for t in (q, k, v)]
    dout = dout.to(dtype)
    for _ in range(rounds):
        y = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True)
        y.backward(dout)
    torch.cuda.synchronize()


def run_matmul(shape, rounds, precision):
    import cupy
    M, N, K = shape
    rng = cupy.random.default_rng(0)
    x, w, dy = (rng.standard_normal(s, dtype=cupy.float32) for s in ((M, K), (K, N), (M, N)))
    X, W, DY = (cuda.as_cuda_array(a) for a in (x, w, dy))
    y, dx, dw = (cuda.device_array(s, np.float32) for s in ((M, N), (M, K), (K, N)))
    product = matmul.matmul
    if precision == "bf16":                     # (rounded once, outside the products)
        X, W, DY = (rounded_bf16(a) for a in (X, W, DY))
        product = matmul.matmul_bf16
    for _ in range(rounds):
        product(y, X, W)
        product(dx, DY, W, transpose_b=True)
        product(dw, X, DY, transpose_a=True)
    cuda.synchronize()
    if precision == "bf16":                     # cuBLAS bf16, through torch
        import torch
        x, w, dy = (torch.as_tensor(a, device="cuda").bfloat16() for a in (x, w, dy))
    for _ in range(rounds):
        x @ w
        dy @ w.T
        x.T @ dy
    cupy.cuda.Device().synchronize()
    if precision == "bf16":
        torch.cuda.synchronize()


def run_gelu_product(shape, rounds, epilogue):
    """The MLP's product with GELU's epilogue (gelu: forward, gelu_grad: backward), ours alone,
    as the bf16 step launches it (M,N,K: out [M,N] in bf16; the forward's Y first, which the
    backward reads)."""
    M, N, K = shape
    rng = np.random.default_rng(0)
    # X [M,K], W [K,N] (the up projection's), dY [M,K], W2 [N,K] (the down projection's)
    x, w, dy, w2 = (cuda.to_device(rng.standard_normal(s, dtype=np.float32))
                    for s in ((M, K), (K, N), (M, K), (N, K)))
    bias = cuda.to_device(rng.standard_normal(N, dtype=np.float32))
    X, W, DY, W2 = (rounded_bf16(a) for a in (x, w, dy, w2))
    y, hidden = (Bf16Matrix.allocate((M, N), device_empty) for _ in range(2))
    matmul.matmul_bf16(y, X, W, bias, gelu_out=hidden)
    for _ in range(rounds):
        if epilogue == "gelu":
            matmul.matmul_bf16(y, X, W, bias, gelu_out=hidden)
        else:                                   # (d pre-activation = (dY . W^T) * gelu'(Y))
            matmul.matmul_bf16(hidden, DY, W2, transpose_b=True, gelu_input=y)
    cuda.synchronize()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("op", choices=("attention", "matmul"))
    parser.add_argument("--shape", default=None,
                        help="attention: B,H,T,D (16,12,1024,64); matmul: M,N,K (16384,3072,768)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16"),
                        help="bf16: the tensor-core attention and SDPA in bf16; the bf16 "
                        "products (wgmma on Hopper) and cuBLAS bf16")
    parser.add_argument("--epilogue", default=None, choices=("gelu", "gelu_grad"),
                        help="matmul in bf16: only the MLP's product with GELU's epilogue")
    args = parser.parse_args()
    default = "16,12,1024,64" if args.op == "attention" else "16384,3072,768"
    shape = tuple(int(n) for n in (args.shape or default).split(","))
    if args.epilogue:
        if args.op != "matmul" or args.precision != "bf16":
            parser.error("--epilogue: matmul in bf16 only")
        return run_gelu_product(shape, args.rounds, args.epilogue)
    (run_attention if args.op == "attention" else run_matmul)(shape, args.rounds, args.precision)


if __name__ == "__main__":
    main()
