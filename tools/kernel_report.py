"""Compile the hot kernels for sm_90 without a GPU and print what ptxas says about each:
registers, spills, stack frame (local memory) and shared memory.

    CUDA_HOME=/usr/local/cuda python tools/kernel_report.py [--sass] [--only matmul]

(NANOANDREA_INLINER=nvvm compiles the 76 kernels 4.8x faster. ptxas here makes the same SASS of
both inliners' matmul kernels, but the H200 machine's build of the PTX does not: docs/perf.md, v20.)

Needs NVVM from a CUDA toolkit (CUDA_HOME), ptxas and NVRTC (a toolkit's, or the pip wheels of
the `tools` extra), but no GPU. A register-blocked kernel whose accumulators land in local
memory shows a stack frame here long before it shows up as a slow timing on the device.
--sass disassembles each kernel (cuobjdump), counts its global loads and stores by width
(LDG.E.128 is a 16-byte load) and describes its loops: how many instructions an inner loop
spends besides its FFMAs is the first thing to read about a matmul.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from numba import cuda, float32, int32, int64, types  # noqa: E402

from nanoandrea.kernels import (attention, crossentropy, gelu, heads, layernorm,  # noqa: E402
                                matmul)

A1, A2, A3, A4 = float32[::1], float32[:, ::1], float32[:, :, ::1], float32[:, :, :, ::1]
I1 = int64[::1]
BOOL = types.boolean
DROP = (I1, int64, int64, float32)           # seed, site, threshold, keep


MATMUL_ARGS = (A3, A2, A2, A1, BOOL, BOOL, int64, A2)


def kernels():
    blocked = matmul._blocked_kernel            # (as the launcher picks them)
    for ta, tb in ((False, False), (False, True), (True, False)):
        yield f"blocked matmul {'T' if ta else 'N'}{'T' if tb else 'N'}", \
            blocked(ta, tb, (True, True, True)), MATMUL_ARGS
    variants = [
        ("blocked matmul TN, cp.async 3 stages",            # a weight gradient, pipelined
         blocked(True, False, (True, True, True), dict(stages=3))),
        ("blocked matmul TN BK=16, cp.async 2 stages",      # ... in slices of 16
         blocked(True, False, (True, True, True), dict(BK=16, stages=2))),
        ("blocked matmul TN, cp.async 3 stages, a 4-byte",  # the LM head's dW at V = 50257
         blocked(True, False, (False, True, True), dict(stages=3))),
        ("blocked matmul NT, cp.async 3 stages, 4-byte",    # its dX there (both operands)
         blocked(False, True, (False, False, True), dict(stages=3))),
        ("blocked matmul NN, GELU epilogue",                # the MLP's first layer
         blocked(False, False, (True, True, True), gelu=True)),
        ("blocked matmul NN, GELU-backward epilogue",       # the MLP's dH, times gelu'(H),
         blocked(False, False, (True, True, True), gelu_grad=True)),    # W^T copied
        ("blocked matmul NN, GELU-backward epilogue, 1 block/SM",
         blocked(False, False, (True, True, True), dict(blocks_per_sm=1), gelu_grad=True)),
        ("blocked matmul NT, GELU-backward epilogue",       # (W^T read in the kernel)
         blocked(False, True, (True, True, True), gelu_grad=True)),
        ("blocked matmul NT, 4-byte loads and stores",      # the LM head of an odd vocabulary
         blocked(False, True, (False, False, False))),
        ("blocked matmul NN 128x256",                       # 512 threads: --variants
         blocked(False, False, (True, True, True), dict(BN=256, blocks_per_sm=1))),
        ("blocked matmul TN 256x128",
         blocked(True, False, (True, True, True), dict(BM=256, blocks_per_sm=1))),
        ("blocked matmul NN 8x16 a thread",                 # 128 x 256, 256 threads: --variants
         blocked(False, False, (True, True, True), dict(BN=256, thread_cols=16, blocks_per_sm=1))),
        ("blocked matmul NN 8x16 a thread, GELU-backward epilogue",
         blocked(False, False, (True, True, True), dict(BN=256, thread_cols=16, blocks_per_sm=1),
                 gelu_grad=True)),
        ("blocked matmul NN, 2 blocks/SM", matmul.make_blocked_matmul_kernel(
            False, False, blocks_per_sm=2)),
        ("blocked matmul NN BK=16", matmul.make_blocked_matmul_kernel(False, False, BK=16))]
    for variant, tiles in (("warps 4x8", dict(warp_rows=4)),                # --variants warps
                           ("fragments ahead", dict(fragments_ahead=True))):    # and fragments
        variants += [(f"blocked matmul {'T' if ta else 'N'}{'T' if tb else 'N'}, {variant}",
                      blocked(ta, tb, (True, True, True), tiles))
                     for ta, tb in ((False, False), (False, True), (True, False))]
    for name, kernel in variants:
        yield name, kernel, MATMUL_ARGS
    PAIR = types.UniTuple(int64, 2)     # the row classes: one launch, offsets as numbers
    for name, ta in (("NN, row classes (forward, dX at 50257)", False),
                     ("TN, row classes of k (dW at 50257)", True)):
        yield f"blocked matmul {name}", blocked(ta, False, (True, True, True)).classes, \
            (A3, A2, A2, int64, int64, int64, BOOL, PAIR, PAIR, PAIR, PAIR)
    yield "transpose (the copy of W^T)", matmul.transpose_kernel, (A2, A2)
    yield "sum_splits4 (16-byte)", matmul.sum_splits4_kernel, (A1, A2, A1, BOOL, BOOL, int64)
    for D in attention.FAST_HEAD_SIZES:
        forward, dq, dkdv = attention.make_attention_kernels(D, dropout=False)   # (training
        yield f"attention forward D={D}", forward, (A4, A3, A4, A4, A4, float32, *DROP, int64)
        yield f"attention dq D={D}", dq, (A4, A4, A4, A4, A4, A3, A3, float32, *DROP, int64, BOOL)
        dkdv_args = (A4, A4, A4, A4, A4, A4, A4, A3, A3, float32, *DROP, int64, BOOL)
        yield f"attention dk/dv D={D} (+ dq shares: {dkdv.with_dq})", dkdv, dkdv_args
        yield f"attention dk/dv D={D}, dropout compiled in", attention.make_attention_kernels(
            D)[2], dkdv_args                                            # with dropout_p > 0)
        yield f"attention dk/dv D={D} without dq", attention.make_dkdv_kernel(
            D, *attention.GPU_TILES[D][2][:6]), dkdv_args
        for name, tiles in attention.TILE_VARIANTS.get(D, {}).items():     # --variants
            if tiles[0] is not None:
                yield f"attention forward D={D} [{name}]", attention.make_forward_kernel(
                    D, *tiles[0]), (A4, A3, A4, A4, A4, float32, *DROP, int64)
            if tiles[2] is not None:
                yield f"attention dk/dv D={D} [{name}]", attention.make_dkdv_kernel(
                    D, *tiles[2], dropout=False), dkdv_args
        for tile in dict.fromkeys((attention.GPU_TENSOR_TILES[D],
                                   *attention.TENSOR_TILE_VARIANTS.values())):
            tensor = attention.make_tensor_forward_kernel(D, *tile)
            yield f"attention forward D={D} (tensor cores, 3xTF32, {tile})", tensor, \
                (float32[:, :, :, :], A3, A4, A4, A4, float32, int64)
        V4 = float32[:, :, :, :]     # heads views of [B,T,C] arrays (heads.heads_view): the
        yield f"attention forward D={D}, out the heads' concat", forward, \
            (V4, A3, A4, A4, A4, float32, *DROP, int64)     # training step's (merge in the store)
        yield f"attention dk/dv D={D}, views of the concat", dkdv, \
            (V4, V4, V4, V4, A4, A4, A4, A3, A3, float32, *DROP, int64, BOOL)
        yield f"attention forward D={D}, 4-byte staging", attention.make_attention_kernels(
            D, vector=False)[0], (A4, A3, A4, A4, A4, float32, *DROP, int64)
    yield "attention dq sum", attention.attention_dq_sum_kernel, \
        (A4, A4, float32, int64, int64, BOOL)
    yield "attention reference forward", attention.attention_forward_reference_kernel, \
        (A4, A3, A4, A4, A4, float32, *DROP)
    yield "attention_delta4 (16-byte)", attention.attention_delta4_kernel, (A3, A4, A4, A4, BOOL)
    yield "attention_delta4 (16-byte), out a view of the concat", \
        attention.attention_delta4_kernel, (A3, A4, float32[:, :, :, :], float32[:, :, :, :], BOOL)
    yield "attention_delta (4-byte)", attention.attention_delta_kernel, (A3, A4, A4, A4, BOOL)
    yield "split_heads4 (16-byte)", heads.split_heads4_kernel, (A4, A4, BOOL)
    yield "merge_heads4 (16-byte)", heads.merge_heads4_kernel, (A4, A4, BOOL)
    yield "split_heads (4-byte)", heads.split_heads_kernel, (A4, A3, BOOL)
    yield "merge_heads (4-byte)", heads.merge_heads_kernel, (A3, A4, BOOL)
    warp = layernorm.warp_kernels(6)                         # C = 768: 6 groups of 4 per lane
    yield "layernorm warp forward C<=768", warp.forward, (A2, A1, A1, A2, A1, A1, float32)
    yield "residual + layernorm warp forward C<=768", warp.residual_forward, \
        (A2, A2, A1, A1, A2, A2, A1, A1, float32)
    yield "layernorm warp backward C<=768", warp.backward, \
        (A2, A2, A2, A2, A2, A2, A1, A1, A1, BOOL)
    yield "gelu forward, 16-byte", gelu.gelu_forward4_kernel, (A1, A1)
    yield "gelu backward, 16-byte", gelu.gelu_backward4_kernel, (A1, A1, A1, BOOL)
    yield "layernorm forward", layernorm.layernorm_forward_kernel, (A2, A1, A1, A2, A1, A1, float32)
    yield "residual + layernorm forward", layernorm.residual_layernorm_forward_kernel, \
        (A2, A2, A1, A1, A2, A2, A1, A1, float32)
    ce_args = (A1, A1, A2, A2, int32[::1], A1, int64)
    yield "cross-entropy fused", crossentropy.crossentropy_fused_kernel, ce_args
    yield "cross-entropy fused, 16-byte", crossentropy.crossentropy_fused4_kernel, ce_args


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
            count = {op: sum(1 for t in body if op in t) for op in ("FFMA", "LDS", "BAR")}
            spills = sum(1 for t in body if "LDL" in t or "STL" in t)
            yield (f"loop of {len(body)} instructions: {count['FFMA']} FFMA, {count['LDS']} LDS, "
                   f"{count['BAR']} BAR" + (f", {spills} LDL/STL" if spills else ""))


def compile_for_sm90_offline():
    """Device functions compiled on their own (kernels/launch.py `inlined` with
    NANOANDREA_INLINER=nvvm: NVVM inlines them) ask numba-cuda for the current device's compute capability, which needs a driver: without
    a GPU, answer sm_90 (what compile_ptx is given below)."""
    import types as python_types

    from numba.cuda import dispatcher
    if not cuda.is_available():
        dispatcher.get_current_device = lambda: python_types.SimpleNamespace(
            compute_capability=(9, 0))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sass", action="store_true",
                        help="also disassemble (cuobjdump) and describe each kernel's loops")
    parser.add_argument("--only", default="", help="kernels whose name contains this")
    args = parser.parse_args()
    ptxas = cuda_tool("ptxas")
    compile_for_sm90_offline()
    with tempfile.TemporaryDirectory() as folder:
        source, cubin = Path(folder) / "kernel.ptx", Path(folder) / "kernel.cubin"
        for name, kernel, signature in kernels():
            if args.only not in name:
                continue
            ptx, _ = cuda.compile_ptx(kernel.py_func, signature, cc=(9, 0),
                                      launch_bounds=getattr(kernel, "launch_bounds", None))
            source.write_text(ptx)
            result = subprocess.run([ptxas, "-arch=sm_90", "-v", str(source), "-o", str(cubin)],
                                    capture_output=True, text=True)
            lines = [line.split("info    :")[-1].strip() for line in result.stderr.splitlines()
                     if "registers" in line or "spill" in line]
            print(f"{name:32s} {' | '.join(lines) or result.stderr.strip()}")
            if args.sass and result.returncode == 0:
                code = disassemble(cubin)
                for line in [global_accesses(code), *loops(code)]:
                    print(f"{'':32s}   {line}")


if __name__ == "__main__":
    main()
