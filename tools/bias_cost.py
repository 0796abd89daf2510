"""What the bias costs the wgmma products' epilogue: GELU's product (16384 x 3072 x 768, bf16
out and GELU's output) and a projection (16384 x 768 x 768, float32 out), each timed with its
bias and without, beside cuBLAS bf16 on the same operands; each result checked against
torch's first.

    python3 tools/bias_cost.py

The bias is read from global memory in the epilogue, a load per 8 columns of a box, after
the tile's mainloop: if its latency is not hidden, it shows as the gap between the two rows.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from numba import cuda  # noqa: E402

from bench import bf16_tensor, event_time_ms, warm_up_clocks  # noqa: E402
from nanoandrea.kernels import matmul_bf16, matmul_wgmma  # noqa: E402


def main():
    rng = np.random.default_rng(0)
    warm_up_clocks()
    print(f"bias cost: {cuda.get_current_device().name}, wgmma products with and "
          "without bias (ms, median of 10 timings of 5 calls), cuBLAS bf16 beside")
    for M, N, K, gelu in ((16384, 3072, 768, True), (16384, 768, 768, False)):
        a = matmul_bf16.rounded(cuda.to_device(rng.standard_normal((M, K)).astype(np.float32)))
        b = matmul_bf16.rounded(cuda.to_device(rng.standard_normal((K, N)).astype(np.float32)))
        bias = cuda.to_device(rng.standard_normal(N).astype(np.float32))
        if gelu:
            out = matmul_bf16.Bf16Matrix.allocate((M, N), matmul_bf16.device_empty)
            hidden = matmul_bf16.Bf16Matrix.allocate((M, N), matmul_bf16.device_empty)
        else:
            out, hidden = cuda.device_array((M, N), np.float32), None
        A, B = bf16_tensor(a), bf16_tensor(b)
        bias_t = torch.as_tensor(bias, device="cuda")
        for with_bias in (True, False):
            def ours():
                matmul_wgmma.matmul_wgmma(out, a, b, bias if with_bias else None,
                                          gelu_out=hidden)
            ours()
            want = (A.float() @ B.float()) + (bias_t if with_bias else 0)
            got = (bf16_tensor(out).float() if gelu else torch.as_tensor(out, device="cuda"))
            error = ((got - want).norm() / want.norm()).item()
            assert error < 1e-2, f"{M}x{N}x{K}: relative error {error}"
            ours_ms = event_time_ms(ours, repeat=10, calls=5)
            theirs_ms = event_time_ms(
                (lambda: torch.addmm(bias_t.bfloat16(), A, B)) if with_bias else (lambda: A @ B),
                repeat=10, calls=5)
            flops = 2.0 * M * N * K
            print(f"  {M}x{N}x{K} {'gelu ' if gelu else ''}{'+bias' if with_bias else 'no bias'}"
                  f"  ours {ours_ms:.4f} ms {flops / ours_ms / 1e9:7.1f} TFLOP/s   cuBLAS "
                  f"{theirs_ms:.4f} ms {flops / theirs_ms / 1e9:7.1f}   {theirs_ms / ours_ms:.3f}x"
                  f"   (error {error:.1e})")


if __name__ == "__main__":
    main()
