"""Run 5 (session 15): the LM head's weight gradient at 50257 alone, row classes (the default)
against cuBLAS, as tools/bench.py times it (bench.kernel_ms, after its check)."""
import sys
import types
import cupy
import numpy as np
from numba import cuda
sys.path.insert(0, "tools")
import bench
from nanoandrea.kernels import matmul as mm

bench.warm_up_clocks()
M, N, K = 768, 50257, 16384
rng = cupy.random.default_rng(0)
x = rng.standard_normal((K, M), dtype=cupy.float32)
dy = rng.standard_normal((K, N), dtype=cupy.float32)
X, DY = cuda.as_cuda_array(x), cuda.as_cuda_array(dy)
out = cuda.device_array((M, N), np.float32)
args = types.SimpleNamespace(repeat=10)
for name, pads in (("row classes (default)", None), ("padded copies", True)):
    def ours():
        mm.matmul(out, X, DY, transpose_a=True, pad_unaligned=pads)
    def theirs():
        return x.T @ dy
    cupy.asarray(out).fill(cupy.nan)
    ours()
    want = theirs()
    cuda.synchronize()
    error = bench.relative_error(cupy.asarray(out).get(), want.get())
    bench.require(error, 1e-5, "dW")
    for _ in range(2):
        t, o = bench.kernel_ms(theirs, args), bench.kernel_ms(ours, args)
        print(f"lm bwd dW=X^T.dY [{name}] {o:.3f} ms, cuBLAS {t:.3f} ms, {t / o:.3f}x (err {error:.1e})", flush=True)
