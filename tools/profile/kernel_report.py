"""Compile the hot kernels for sm_90 without a GPU and print what ptxas says about each:
registers, spills, stack frame (local memory), shared memory, and its performance warnings
(C7512 and the like: a kernel's wgmma serialized, each waited for before the next).

    CUDA_HOME=/usr/local/cuda python tools/profile/kernel_report.py [--sass] [--only matmul]
    python tools/profile/kernel_report.py --ptx FOLDER      # each kernel's PTX, to diff two trees
    python tools/profile/kernel_report.py --ladder v12,v13  # matmul ladder versions instead

(NANOANDREA_INLINER=nvvm compiles them several times faster. A GPU machine's own build of the
same PTX can differ from this one, so its registers are a lead, not a measurement.)

Needs NVVM from a CUDA toolkit (CUDA_HOME), ptxas and NVRTC (a toolkit's, or the pip wheels of
the `tools` extra), but no GPU. A register-blocked kernel whose accumulators land in local
memory shows a stack frame here long before it shows up as a slow timing on the device.
--sass disassembles each kernel (cuobjdump), counts its global loads and stores by width
(LDG.E.128 is a 16-byte load) and describes its loops: how many instructions an inner loop
spends besides its FFMAs is the first thing to read about a matmul, and counts its
tensor-core, copy and barrier instructions.

--ladder compiles versions of the matmul ladder (tools/dev/matmul/vN_*.py) for sm_90a: a
version's kernels are its module's @cuda.jit kernels and those its `kernels()` makes (a
version whose kernels come from a factory: {name: kernel}), their arguments matmul's, (out, a,
b): out float32 and a, b uint32 pairs of bf16 for a PRECISION = "bf16" version, else float32,
then the types of its EXTRA_ARGUMENTS if it has more (v18's tensor maps). Launch bounds are the
kernel's own.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[1]
os.environ["NUMBA_ENABLE_CUDASIM"] = "0"    # (it compiles for sm_90: never in the simulator)
sys.path.insert(0, str(TOOLS.parent))

from numba import cuda, float32, int32, int64, types, uint32  # noqa: E402

from nanoandrea.kernels import crossentropy, gelu, heads, layernorm, reduce  # noqa: E402
from nanoandrea.kernels.attention import float32 as attention  # noqa: E402
from nanoandrea.kernels.attention import mma_sync as attention_mma  # noqa: E402
from nanoandrea.kernels.attention import wgmma as attention_wgmma  # noqa: E402
from nanoandrea.kernels.matmul import float32 as matmul, split_k  # noqa: E402
from nanoandrea.kernels.matmul import wgmma as matmul_wgmma  # noqa: E402

A1, A2, A3, A4 = float32[::1], float32[:, ::1], float32[:, :, ::1], float32[:, :, :, ::1]
I1 = int64[::1]
BOOL = types.boolean
DROP = (I1, int64, int64, float32)           # seed, site, threshold, keep


MATMUL_ARGS = (A3, A2, A2, A1, BOOL, BOOL, int64, A2)
U2 = types.uint32[:, ::1]                   # a Bf16Matrix's bf16 pairs
WGMMA_ARGS = (A3, U2, U2, A1, BOOL, BOOL, int64, A2)
# the tensor-map table; the pairs' rows (a's, b's), out's, GELU's; the pair count, the pairs
WGMMA_MAPS = (types.uint64[:, ::1], types.UniTuple(int64, 3), types.UniTuple(int64, 3), int64,
              int64, int64, types.UniTuple(U2, 3), types.UniTuple(U2, 3))
V4 = float32[:, :, :, :]        # heads views of [B,T,C] arrays (heads.heads_view)


def kernels():
    """(name, kernel, signature) of every kernel a training step, evaluation or sampling runs
    on the GPU, with the argument types the launchers give them."""
    for ta, tb in ((False, False), (False, True), (True, False)):
        for epilogue in (None, "gelu", "gelu_grad"):
            if ta and epilogue or (tb and epilogue == "gelu"):
                continue            # (the products the model has: see matmul's module doc)
            yield (f"matmul {'T' if ta else 'N'}{'T' if tb else 'N'}"
                   f"{f', {epilogue} epilogue' if epilogue else ''}",
                   matmul.matmul_kernel(ta, tb, epilogue), MATMUL_ARGS)
    U3 = types.uint32[:, :, ::1]                # a product written in bf16 (bf16_out epilogue)
    for ta, tb in ((False, False), (False, True), (True, False)):       # (sm_90a: wgmma)
        for epilogue in (None, "gelu", "gelu_grad"):
            if ta and epilogue or (tb and epilogue == "gelu"):
                continue
            for bf16_out in (False, True):
                if bf16_out and ta:
                    continue            # (bf16 out: q, k, v, the MLP's pre-activation and its
                                        # gradient, the logits; never a weight's gradient)
                # (None: unread, the launcher passes a)
                hidden = (U2,) if epilogue is None or bf16_out else (A2,)
                out = (U3,) if bf16_out else (A3,)
                # (a bias: the forward's products, X W + b, GELU's among them)
                forward = not ta and not tb and epilogue != "gelu_grad"
                for biased in (False, True) if forward else (False,):
                    yield (f"wgmma {'T' if ta else 'N'}{'T' if tb else 'N'}"
                           f"{f', {epilogue} epilogue' if epilogue else ''}"
                           f"{', bf16 out' if bf16_out else ''}{', bias' if biased else ''}",
                           matmul_wgmma.wgmma_matmul_kernel(ta, tb, epilogue, bf16_out, biased),
                           out + WGMMA_ARGS[1:-1] + hidden + WGMMA_MAPS)
    yield "transpose (the copy of W^T)", matmul.transpose_kernel, (A2, A2)
    yield "sum_splits (16-byte)", split_k.sum_splits_kernel, (A1, A2, A1, BOOL, BOOL, int64)
    for D in attention.HEAD_SIZES:
        forward_tile, dkdv_tile = attention.GPU_TILES[D]
        for dropout in (True, False):
            yield (f"attention forward D={D}{', dropout' if dropout else ''}",
                   attention.forward_kernel(D, forward_tile, dropout),
                   (V4, A3, A4, A4, A4, float32, *DROP, int64))
        yield f"attention dk/dv D={D}, dropout", attention.dkdv_kernel(D, dkdv_tile, True), \
            (V4, V4, A4, V4, A4, A4, A4, A3, A3, float32, *DROP, int64, BOOL)
    W4 = types.uint32[:, :, :, ::1]             # the tensor-core attention's heads in bf16 pairs
    P4 = types.uint32[:, :, :, :]               # heads views of bf16 pairs (bf16_heads_view)
    for D in attention_mma.HEAD_SIZES:
        for dropout in (False, True):
            named = f"D={D}{', dropout' if dropout else ''}"
            yield (f"attention bf16 forward {named}", attention_mma.forward_kernel(D, dropout),
                   (V4, A3, W4, W4, W4, float32, *DROP, W4))
            yield (f"attention bf16 forward {named}, bf16 copy",   # (bf16 training's)
                   attention_mma.forward_kernel(D, dropout, True),
                   (V4, A3, W4, W4, W4, float32, *DROP, P4))
            backward = (W4, W4, W4, W4, A3, A3, float32, float32, *DROP, BOOL)
            yield (f"attention bf16 dq {named}", attention_mma.dq_kernel(D, dropout),
                   (V4, *backward))
            yield (f"attention bf16 dk/dv {named}", attention_mma.dkdv_kernel(D, dropout),
                   (V4, V4, *backward))
            yield (f"attention bf16 dq {named}, bf16 gradients",
                   attention_mma.dq_kernel(D, dropout, True), (P4, *backward))
            yield (f"attention bf16 dk/dv {named}, bf16 gradients",
                   attention_mma.dkdv_kernel(D, dropout, True), (P4, P4, *backward))
    for D in attention_wgmma.HEAD_SIZES:                                # (sm_90a: wgmma)
        for dropout in (False, True):
            named = f"D={D}{', dropout' if dropout else ''}"
            LAYOUT = (int32, int32)             # (heads_layout: head_words, row_words)
            yield (f"attention wgmma forward {named}", attention_wgmma.forward_kernel(D, dropout),
                   (V4, A3, W4, W4, W4, float32, *DROP, W4, *LAYOUT))
            backward = (W4, W4, W4, W4, A3, A3, float32, float32, *DROP, BOOL, *LAYOUT)
            yield (f"attention wgmma dq {named}", attention_wgmma.dq_kernel(D, dropout),
                   (V4, W4, A3, V4, V4, W4, W4, W4, A3, float32, float32, *DROP, BOOL, *LAYOUT))
            yield (f"attention wgmma dk/dv {named}", attention_wgmma.dkdv_kernel(D, dropout),
                   (V4, V4, *backward))
            # (bf16 training: q, k, v and dout's copy read in place from bf16 rows, heads
            # views; the output's bf16 copy and the gradients written as bf16 pairs through
            # heads views)
            yield (f"attention wgmma forward {named}, heads in rows, bf16 copy",
                   attention_wgmma.forward_kernel(D, dropout, True),
                   (V4, A3, P4, P4, P4, float32, *DROP, P4, *LAYOUT))
            in_rows = (P4, P4, P4, P4, A3, A3, float32, float32, *DROP, BOOL, *LAYOUT)
            yield (f"attention wgmma dq {named}, heads in rows, bf16 gradients",
                   attention_wgmma.dq_kernel(D, dropout, True),
                   (P4, P4, A3, V4, V4, P4, P4, P4, A3, float32, float32, *DROP, BOOL, *LAYOUT))
            yield (f"attention wgmma dk/dv {named}, heads in rows, bf16 gradients",
                   attention_wgmma.dkdv_kernel(D, dropout, True), (P4, P4, *in_rows))
    yield "attention dq sum", attention.attention_dq_sum_kernel, \
        (V4, A4, float32, int64, int64, BOOL)
    yield "attention delta", attention.attention_delta4_kernel, (A3, V4, V4)
    for D in attention_mma.HEAD_SIZES:
        yield (f"attention delta and dout bf16 D={D}", attention_mma.delta_and_dout_kernel(D),
               (A3, W4, V4, V4))
    yield "split_heads4 (16-byte)", heads.split_heads4_kernel, (A4, A4, BOOL)
    yield "merge_heads4 (16-byte)", heads.merge_heads4_kernel, (A4, A4, BOOL)
    for which in ("forward", "residual_forward", "backward"):     # C = 768: 6 groups of 4 a lane
        kernel = layernorm.warp_kernel(6, which)
        signature = {"forward": (A2, A1, A1, A2, A1, A1, float32),
                     "residual_forward": (A2, A2, A1, A1, A2, A2, A1, A1, float32),
                     "backward": (A2, U2, A2, A2, A2, A2, A2, A1, A1, A1, BOOL)}[which]
        yield f"layernorm warp {which.replace('_', ' ')} C<=768", kernel, signature
        if which != "backward":             # (bf16 training: the rows as a Bf16Matrix's pairs)
            out = 1 if which == "residual_forward" else 0
            yield (f"layernorm warp {which.replace('_', ' ')} C<=768, bf16 out",
                   layernorm.warp_kernel(6, which, True),
                   signature[:out] + (U2,) + signature[out + 1:])
        else:                               # (bf16 training: dx also as a Bf16Matrix's pairs)
            yield ("layernorm warp backward C<=768, dx in bf16 too",
                   layernorm.warp_kernel(6, which, True), signature)
    for bf16_in in (False, True):           # the bias gradients: column sums, 8 columns a thread
        yield (f"sum_rows, 16-byte, {'bf16' if bf16_in else 'float32'} rows",
               reduce.sum_rows8_kernel(bf16_in), (A2, U2 if bf16_in else A2, BOOL))
    yield "gelu forward, 16-byte", gelu.gelu_forward4_kernel, (A1, A1)
    yield "gelu backward, 16-byte", gelu.gelu_backward4_kernel, (A1, A1, A1, BOOL)
    yield "cross-entropy fused, 16-byte", crossentropy.crossentropy_fused4_kernel, \
        (A1, A1, A2, A2, int32[::1], A1, int64)
    for gradient in (True, False):          # bf16 logits: the loss and its gradient, or the loss
        yield (f"cross-entropy of bf16 logits{', gradient' if gradient else ''}",
               crossentropy.bf16_logits_kernel(gradient), (A1, A1, U2, U2, int32[::1], A1, int64))


def cuda_tool(name):
    """Path of a CUDA command-line tool: the pip wheels' nvidia/cu13/bin (pip install -e
    ".[tools]"; NVVM then comes from there too, and a newer ptxas reads older PTX),
    $CUDA_HOME/bin, then PATH."""
    candidates = []
    try:
        import nvidia
        candidates += [Path(folder) / "cu13" / "bin" / name for folder in nvidia.__path__]
    except ImportError:
        pass
    candidates.append(Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / name)
    found = next((str(c) for c in candidates if c.is_file()), shutil.which(name))
    if found is None:
        sys.exit(f"{name} not found: set CUDA_HOME or pip install -e \".[tools]\"")
    return found


def disassemble(cubin):
    """[(address, instruction)] of the kernel's SASS (cuobjdump)."""
    cuobjdump = cuda_tool("cuobjdump")
    environment = dict(os.environ, NVDISASM_PATH=str(Path(cuda_tool("nvdisasm")).parent))
    sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True,
                          check=True, env=environment).stdout
    return [(int(m.group(1), 16), m.group(2)) for m in
            (re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+([^;]*);", line) for line in sass.splitlines())
            if m]


def global_accesses(code):
    """One line counting the kernel's global loads and stores by kind (LDG.E.128: 16 bytes,
    LDG.E: 4; LD.E, ST.E: through a generic address, where the compiler could not tell it is
    global), as they stand in the code (an access in a loop counts once)."""
    kinds = {}
    for _, text in code:
        kind = re.search(r"\b((?:LDG|STG|LD|ST)\.E[A-Z0-9.]*)", text)
        if kind:
            kinds[kind.group(1)] = kinds.get(kind.group(1), 0) + 1
    return "global memory: " + (", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
                                or "none")


def loops(code):
    """One line per loop of the kernel's SASS (a backward branch): its instructions, how many
    are FFMA, shared-memory loads and barriers, and local-memory (spill) loads and stores if
    any. Inner loops first."""
    index = {address: i for i, (address, _) in enumerate(code)}
    for i, (address, text) in enumerate(code):
        branch = re.search(r"BRA (0x[0-9a-f]+)", text)
        if branch and int(branch.group(1), 16) < address:
            body = [t for _, t in code[index[int(branch.group(1), 16)]:i + 1]]
            count = {op: sum(1 for t in body if op in t)
                     for op in ("FFMA", "HGMMA", "LDGSTS", "LDS", "BAR")}
            spills = sum(1 for t in body if "LDL" in t or "STL" in t)
            yield (f"loop of {len(body)} instructions: "
                   + ", ".join(f"{n} {op}" for op, n in count.items() if n or op == "BAR")
                   + (f", {spills} LDL/STL" if spills else ""))


def compile_for_sm90_offline():
    """Device functions compiled on their own (kernels/runtime/launch.py `inlined` with
    NANOANDREA_INLINER=nvvm: NVVM inlines them) ask numba-cuda for the current device's compute
    capability, which needs a driver: without a GPU, answer sm_90 (what compile_ptx is given
    below)."""
    import types as python_types

    from numba.cuda import dispatcher
    if not cuda.is_available():
        dispatcher.get_current_device = lambda: python_types.SimpleNamespace(
            compute_capability=(9, 0))


def package_kernels():
    """(name, kernel, signature, arch) of kernels(): arch "a" (sm_90a) for the wgmma modules'
    kernels, the architecture-specific target numba-cuda picks by itself on a device of compute
    capability 9.0 (wgmma exists there only)."""
    wgmma_modules = (matmul_wgmma.__name__, attention_wgmma.__name__)
    for name, kernel, signature in kernels():
        yield name, kernel, signature, "a" if kernel.py_func.__module__ in wgmma_modules else ""


def ladder_kernels(only):
    """(name, kernel, signature, "a") of the matmul ladder versions `only` names (v12, or
    v11,v12): the module's doc."""
    sys.path.insert(0, str(TOOLS / "dev"))
    from run import load, selected, versions
    for path in selected(versions("matmul"), only):
        module = load(path)
        operand = uint32 if getattr(module, "PRECISION", "fp32") == "bf16" else float32
        signature = ((float32[:, ::1], operand[:, ::1], operand[:, ::1])
                     + tuple(getattr(module, "EXTRA_ARGUMENTS", ())))
        made = module.kernels() if hasattr(module, "kernels") else {}
        for name, kernel in list(vars(module).items()) + list(made.items()):
            options = getattr(kernel, "targetoptions", None)   # (a Numba dispatcher's)
            if isinstance(options, dict) and not options.get("device", True):
                yield f"{path.stem}.{name}", kernel, signature, "a"


SHOWN = ("HGMMA", "WARPGROUP", "HMMA", "LDSM", "LDGSTS", "LDGDEPBAR", "DEPBAR", "FENCE",
         "MEMBAR", "BAR.SYNC", "SYNCS", "UTMA", "LDL", "STL")


def instruction_counts(code):
    """One line counting the kernel's tensor-core, copy, barrier and local-memory instructions
    (SHOWN), as they stand in the code."""
    ops = Counter(text.split()[1] if text.startswith("@") else text.split()[0]
                  for _, text in code)
    return "instructions: " + (", ".join(f"{n} {op}" for op, n in sorted(ops.items())
                                         if op.startswith(SHOWN)) or "none of " + " ".join(SHOWN))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sass", action="store_true",
                        help="also disassemble (cuobjdump) and describe each kernel's loops")
    parser.add_argument("--only", default="", help="kernels whose name contains this")
    parser.add_argument("--ptx", metavar="FOLDER", help="also write each kernel's PTX there (to "
                        "compare two versions of the code: `diff -r`, names aside)")
    parser.add_argument("--ladder", metavar="VERSIONS", help="the matmul ladder's versions "
                        "(v12, or v11,v12) instead of the package's kernels")
    args = parser.parse_args()
    ptxas = cuda_tool("ptxas")
    compile_for_sm90_offline()
    targets = ladder_kernels(args.ladder) if args.ladder else package_kernels()
    with tempfile.TemporaryDirectory() as folder:
        source, cubin = Path(folder) / "kernel.ptx", Path(folder) / "kernel.cubin"
        for name, kernel, signature, arch in targets:
            if args.only not in name:
                continue
            ptx, _ = cuda.compile_ptx(kernel.py_func, signature, cc=(9, 0, arch) if arch else (9, 0),
                                      launch_bounds=kernel.targetoptions.get("launch_bounds"))
            source.write_text(ptx)
            if args.ptx:
                Path(args.ptx).mkdir(parents=True, exist_ok=True)
                (Path(args.ptx) / (re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_") + ".ptx")
                 ).write_text(ptx)
            result = subprocess.run([ptxas, f"-arch=sm_90{arch}", "-v", str(source), "-o",
                                     str(cubin)], capture_output=True, text=True)
            lines = [line.split("info    :")[-1].strip() for line in result.stderr.splitlines()
                     if re.search(r"Used \d+ registers|bytes spill", line)]
            # ptxas's performance warnings (C7510-C7515: wgmma serialized, and why)
            lines += [re.sub(r" for the function '.*", "", line.split("info    :")[-1].strip())
                      for line in result.stderr.splitlines() if "Potential Performance Loss" in line]
            print(f"{name:32s} {' | '.join(lines) or result.stderr.strip()}")
            if args.sass and result.returncode == 0:
                code = disassemble(cubin)
                for line in [global_accesses(code), instruction_counts(code), *loops(code)]:
                    print(f"{'':32s}   {line}")


if __name__ == "__main__":
    main()
