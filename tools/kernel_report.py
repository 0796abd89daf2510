"""Compile the hot kernels for sm_90 without a GPU and print what ptxas says about each:
registers, spills, stack frame (local memory) and shared memory.

    CUDA_HOME=/usr/local/cuda python tools/kernel_report.py

Needs NVVM and ptxas from a CUDA toolkit, and NVRTC (pip install nvidia-cuda-nvrtc), but no GPU.
A register-blocked kernel whose accumulators land in local memory shows a stack frame here long
before it shows up as a slow timing on the device.
"""
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from numba import cuda, float32, int64, types  # noqa: E402

from nanoandrea.kernels import attention, layernorm, matmul  # noqa: E402

A1, A2, A3, A4 = float32[::1], float32[:, ::1], float32[:, :, ::1], float32[:, :, :, ::1]
I1 = int64[::1]
BOOL = types.boolean
DROP = (I1, int64, int64, float32)           # seed, site, threshold, keep


def kernels():
    for ta, tb in ((False, False), (False, True), (True, False)):
        yield (f"blocked matmul {'T' if ta else 'N'}{'T' if tb else 'N'}",
               matmul.make_blocked_matmul_kernel(ta, tb), (A3, A2, A2, A1, BOOL, BOOL, int64))
    yield ("blocked matmul NT, 4-byte loads and stores",       # the LM head of an odd vocabulary
           matmul.make_blocked_matmul_kernel(False, True, False, False, False, blocks_per_sm=2),
           (A3, A2, A2, A1, BOOL, BOOL, int64))
    yield "blocked matmul NN BK=16", matmul.make_blocked_matmul_kernel(False, False, BK=16), \
        (A3, A2, A2, A1, BOOL, BOOL, int64)
    for D in attention.FAST_HEAD_SIZES:
        forward, dq, dkdv = attention.make_attention_kernels(D)
        yield f"attention forward D={D}", forward, (A4, A3, A4, A4, A4, float32, *DROP, int64)
        yield f"attention dq D={D}", dq, (A4, A4, A4, A4, A4, A3, A3, float32, *DROP, int64, BOOL)
        yield f"attention dk/dv D={D}", dkdv, (A4, A4, A4, A4, A4, A4, A3, A3, float32, *DROP,
                                                int64, BOOL)
    yield "attention reference forward", attention.attention_forward_reference_kernel, \
        (A4, A3, A4, A4, A4, float32, *DROP)
    yield "layernorm forward", layernorm.layernorm_forward_kernel, (A2, A1, A1, A2, A1, A1, float32)
    yield "residual + layernorm forward", layernorm.residual_layernorm_forward_kernel, \
        (A2, A2, A1, A1, A2, A2, A1, A1, float32)


def main():
    ptxas = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "kernel.ptx"
        for name, kernel, signature in kernels():
            ptx, _ = cuda.compile_ptx(kernel.py_func, signature, cc=(9, 0),
                                      launch_bounds=getattr(kernel, "launch_bounds", None))
            source.write_text(ptx)
            result = subprocess.run([str(ptxas), "-arch=sm_90", "-v", str(source), "-o",
                                     str(Path(folder) / "kernel.cubin")],
                                    capture_output=True, text=True)
            lines = [line.split("info    :")[-1].strip() for line in result.stderr.splitlines()
                     if "registers" in line or "spill" in line]
            print(f"{name:32s} {' | '.join(lines) or result.stderr.strip()}")


if __name__ == "__main__":
    main()
