"""Compile a matmul ladder version's kernels without a GPU, for sm_90a, and print what ptxas
says (registers, spills) and the tensor-core, copy and barrier instructions of its SASS.

    python tools/dev/offline.py v12 [--ptx FOLDER]

(tools/kernel_report.py does the same for the package's kernels, for sm_90. wgmma exists on
sm_90a only, the architecture-specific target, which numba-cuda picks by itself for a device
of compute capability 9.0: here the target is given, cc=(9, 0, "a").) A version's kernels are
its module's @cuda.jit kernels, and those its `kernels()` makes (a version whose kernels come
from a factory: {name: kernel}); their arguments are matmul's, (out, a, b): out float32 and
a, b uint32 pairs of bf16 for a PRECISION = "bf16" version, else float32, then the types of
its EXTRA_ARGUMENTS if it has more (v18's tensor maps). Launch bounds are the kernel's own.
"""
import argparse
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
os.environ["NUMBA_ENABLE_CUDASIM"] = "0"   # (run.py would choose the simulator without a GPU,
                                           # and Numba rereads its config when it compiles)
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from numba import cuda, float32, uint32  # noqa: E402

import kernel_report  # noqa: E402
from run import load, selected, versions  # noqa: E402

SHOWN = ("HGMMA", "WARPGROUP", "HMMA", "LDSM", "LDGSTS", "LDGDEPBAR", "DEPBAR", "FENCE",
         "MEMBAR", "BAR.SYNC", "SYNCS", "UTMA", "LDL", "STL")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("version", help="v12, or v11,v12")
    parser.add_argument("--ptx", help="a folder to keep each kernel's PTX and cubin in")
    args = parser.parse_args()
    kernel_report.compile_for_sm90_offline()
    ptxas = kernel_report.cuda_tool("ptxas")
    folder = Path(args.ptx or tempfile.mkdtemp())
    folder.mkdir(parents=True, exist_ok=True)
    for path in selected(versions("matmul"), args.version):
        module = load(path)
        operand = uint32 if getattr(module, "PRECISION", "fp32") == "bf16" else float32
        signature = ((float32[:, ::1], operand[:, ::1], operand[:, ::1])
                     + tuple(getattr(module, "EXTRA_ARGUMENTS", ())))
        made = module.kernels() if hasattr(module, "kernels") else {}
        for name, kernel in list(vars(module).items()) + list(made.items()):
            options = getattr(kernel, "targetoptions", None)   # (a Numba dispatcher's)
            if not isinstance(options, dict) or options.get("device", True):
                continue
            ptx, _ = cuda.compile_ptx(kernel.py_func, signature, cc=(9, 0, "a"),
                                      launch_bounds=options.get("launch_bounds"))
            source, cubin = folder / f"{path.stem}.{name}.ptx", folder / f"{path.stem}.{name}.cubin"
            source.write_text(ptx)
            result = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(source), "-o", str(cubin)],
                                    capture_output=True, text=True)
            print(f"{path.stem}.{name}: ptxas exit {result.returncode}")
            for line in result.stderr.splitlines():
                if "Compiling entry" not in line and "Function properties" not in line:
                    print("   ", line.split("info    :")[-1].strip())
            if result.returncode == 0:
                ops = Counter(text.split()[1] if text.startswith("@") else text.split()[0]
                              for _, text in kernel_report.disassemble(cubin))
                print("    SASS:", ", ".join(f"{n} {op}" for op, n in sorted(ops.items())
                                             if any(op.startswith(s) for s in SHOWN)))


if __name__ == "__main__":
    main()
