"""The NN matmul kernel as the device compiles it (run 3 of v20): one product of the qkv shape
through matmul(), timed with CUDA events, then its PTX and cubin written to $OUT/<inliner>/,
with the NVVM version that made them. Run once per NANOANDREA_INLINER (nvvm, numba)."""
import os
import sys

os.environ.setdefault("CUPY_TF32", "0")      # (before CuPy is imported: cuBLAS in float32)
from pathlib import Path

import cupy  # noqa: E402
import numpy as np
from numba import cuda

from nanoandrea.kernels import launch, matmul

out_dir = Path(os.environ["OUT"]) / launch.INLINER
out_dir.mkdir(parents=True, exist_ok=True)
from numba.cuda.cudadrv import nvvm          # noqa: E402
print("inliner", launch.INLINER, "NVVM", nvvm.NVVM().get_version(), "IR",
      nvvm.NVVM().get_ir_version(), "driver", cuda.cudadrv.driver.driver.get_version())

rng = cupy.random.default_rng(0)
x = rng.standard_normal((16384, 768), dtype=cupy.float32)
w = rng.standard_normal((768, 768), dtype=cupy.float32)
y = cupy.empty((16384, 768), cupy.float32)
X, W, Y = (cuda.as_cuda_array(a) for a in (x, w, y))
matmul.matmul(Y, X, W)
cuda.synchronize()
error = float(cupy.abs(y - x @ w).max() / cupy.abs(x @ w).max())
times, theirs = [], []
for _ in range(7):                  # ours and cuBLAS's (x @ w) in turns, 10 calls a round
    for product, into in ((lambda: matmul.matmul(Y, X, W), times), (lambda: x @ w, theirs)):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        for _ in range(10):
            product()
        end.record()
        end.synchronize()
        into.append(cupy.cuda.get_elapsed_time(start, end) / 10)
print(f"qkv fwd {np.median(times):.4f} ms, cuBLAS {np.median(theirs):.4f} ms, "
      f"{np.median(theirs) / np.median(times):.3f}x (error {error:.1e}); ours by round",
      " ".join(f"{t:.4f}" for t in times))

kernel = matmul._blocked_kernel(False, False, (True, True, True))
for signature, compiled in kernel.overloads.items():
    library = compiled._codelibrary
    (out_dir / "nn.ptx").write_text(library.get_asm_str(cc=(9, 0)))
    cubin = library.get_cubin(cc=(9, 0))
    (out_dir / "nn.cubin").write_bytes(bytes(getattr(cubin, "code", cubin)))
    print("registers", compiled.regs_per_thread, "local bytes",
          compiled.local_mem_per_thread)
    try:
        (out_dir / "nn.sass").write_text(compiled.inspect_sass())
    except Exception as error:                      # (nvdisasm may not be there)
        print("no SASS:", str(error)[:100], file=sys.stderr)
