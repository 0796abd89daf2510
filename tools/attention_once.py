"""One causal attention forward and backward of nanoandrea's fast kernels and of PyTorch's
scaled_dot_product_attention (float32), at one shape, for a profiler to look at:

    ncu -k regex:'dkdv|fmha' --launch-skip 2 --launch-count 4 --section SpeedOfLight \\
        python tools/attention_once.py --shape 16,12,1024,64

Each side runs `--rounds` times (the first compiles and warms up); nothing is timed here
(tools/bench.py times, this only gives a profiler the same launches to see)."""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from numba import cuda  # noqa: E402

from nanoandrea.kernels import attention  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="16,12,1024,64", help="B,H,T,D")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    B, H, T, D = (int(n) for n in args.shape.split(","))
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(B, H, T, D, device="cuda", generator=gen) for _ in range(4))
    Q, K, V, DOUT = (cuda.as_cuda_array(t) for t in (q, k, v, dout))
    out, dq, dk, dv = (cuda.device_array((B, H, T, D), np.float32) for _ in range(4))
    lse, delta = (cuda.device_array((B, H, T), np.float32) for _ in range(2))
    for _ in range(args.rounds):
        attention.attention_forward(out, lse, Q, K, V)
        attention.attention_backward(dq, dk, dv, delta, DOUT, Q, K, V, out, lse)
    cuda.synchronize()
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    for _ in range(args.rounds):
        y = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True)
        y.backward(dout)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
