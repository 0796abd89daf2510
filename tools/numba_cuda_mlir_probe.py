"""Probe numba-cuda-mlir 0.6.0 against what nanoandrea needs, and time it against numba-cuda.

Self-contained (needs only numpy and the two compilers; CuPy is used where present). Every step
prints one line:
    STEP <name> PASS|FAIL|SKIP <detail>
and the run ends with "probe: N passed, N failed, N skipped" and one TIMING JSON line per timing.

Each group of steps runs in a child process of its own, so a crash (a segfault in MLIR, a hung
compile) costs only that group: the parent notes the step that was running, reports it FAIL, and
starts a new child for the steps after it. Each timing runs in a fresh process.

Groups: features (the numba-cuda-mlir API nanoandrea uses, intrinsics with inline PTX, ...),
emm (CuPy's pool as external memory manager), cache (cache=True across two processes),
coexist (numba-cuda and numba-cuda-mlir in one process), timing (compile + first launch of a
register-blocked 8x8 matmul and of a tree of 2**(d+1)-1 device functions, each inlining
variant, under both compilers; then kernel time, launch cost, registers).

On a GPU machine, with numba-cuda-mlir's wheel installed into a folder of its own:
    python3 -m pip install --target /tmp/site-mlir numba-cuda-mlir==0.6.0
    PYTHONPATH=/tmp/site-mlir python3 tools/numba_cuda_mlir_probe.py --budget 330 --json probe.json
Options: --only timing (one group), --size 2048 (matmul M = N = K), --variants always,force,default
(matmul), --tree-variants always,force,never, --tree-depth 6, --backends mlir,numba-cuda.
Without a GPU: `--offline` checks what needs no device (imports, the PTX of every intrinsic,
compile times to PTX with sm_90 assumed; PTXAS=/path/to/ptxas for registers).

numba-cuda 0.30 fails under numpy 2.5 on its first compile (np.row_stack is gone); the children
that run numba-cuda put np.row_stack = np.vstack back first (a probe-only shim), so the probe
runs on a machine whose NumPy is 2.5.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.abspath(__file__)
RESULTS = []          # (name, status, detail) of this process's steps


# ----------------------------------------------------------------------------------------
# reporting

def report(name, status, detail=""):
    detail = " ".join(str(detail).split())[:600]
    RESULTS.append((name, status, detail))
    print(f"STEP {name} {status} {detail}", flush=True)


def step(name):
    """Decorator: run fn(), report PASS with its return value (a detail string), FAIL with the
    error, SKIP when it raises Skip."""
    def wrap(fn):
        def run(*args, **kwargs):
            print(f"START {name}", flush=True)
            if os.environ.get("PROBE_TEST_CRASH") == name:      # to test the crash handling
                os._exit(3)
            try:
                detail = fn(*args, **kwargs)
                report(name, "PASS", detail or "")
            except Skip as e:
                report(name, "SKIP", str(e))
            except Exception as e:     # noqa: BLE001 - a probe reports everything
                tb = traceback.format_exc().strip().splitlines()
                where = next((line.strip() for line in reversed(tb)
                              if line.strip().startswith("File")), "")
                report(name, "FAIL", f"{type(e).__name__}: {e} [{where}]")
        run.step_name = name
        return run
    return wrap


class Skip(Exception):
    pass


def numpy_shim():
    """numba-cuda 0.30 registers an overload of np.row_stack, which numpy 2.5 removed."""
    import numpy as np
    if not hasattr(np, "row_stack"):
        np.row_stack = np.vstack


def offline_shim_numba_cuda():
    """No GPU: numba-cuda asks the device for its compute capability when a device function
    is compiled on its own (forceinline, or no inlining); answer sm_90, as nanoandrea's
    tools/kernel_report.py does."""
    import types as python_types

    from numba.cuda import dispatcher
    dispatcher.get_current_device = lambda: python_types.SimpleNamespace(
        compute_capability=(9, 0))


def offline_shim():
    """No GPU: numba-cuda-mlir asks the device for its compute capability even when cc= is
    given to compile_ptx; answer sm_90 (the H200's)."""
    import numba_cuda_mlir.tools as tools

    def cc(as_type=str):
        return (9, 0) if as_type is tuple else "sm_90"
    tools.get_gpu_compute_capability = cc


# ----------------------------------------------------------------------------------------
# the matmul used for compile timing: one source for both compilers

BM = BN = 128       # block tile
BK = 8              # k slice
NT = 256            # threads a block (16 x 16), each an 8 x 8 tile of C in registers


def build_matmul(cuda, float32, variant):
    """C = A @ B (float32, C-contiguous, M, N multiples of 128, K of 8), register-blocked
    8 x 8 per thread, its device functions in a tree three deep like nanoandrea's matmul.
    variant: "always" (inline="always", Numba-IR inlining: nanoandrea's default), "force"
    (forceinline=True: NVVM inlining under numba-cuda, NANOANDREA_INLINER=nvvm), "never"
    (inline="never": under numba-cuda-mlir, left to MLIR's inliner), "default" (neither
    option: numba-cuda-mlir's own policy inlines small functions in Numba IR)."""
    if variant == "always":
        dev = cuda.jit(device=True, inline="always")
    elif variant == "force":
        dev = cuda.jit(device=True, forceinline=True)
    elif variant == "never":
        dev = cuda.jit(device=True, inline="never")
    else:
        dev = cuda.jit(device=True)

    @dev
    def zero_block(acc):
        for i in range(8):
            for j in range(8):
                acc[i, j] = 0.0

    @dev
    def load_tiles(a_tile, b_tile, A, B, m0, n0, k0, tid):
        for e in range(4):                      # a_tile[k, m] = A[m0 + m, k0 + k]
            idx = tid + e * NT
            r = idx // BK
            c = idx % BK
            a_tile[c, r] = A[m0 + r, k0 + c]
        for e in range(4):                      # b_tile[k, n] = B[k0 + k, n0 + n]
            idx = tid + e * NT
            r = idx // BN
            c = idx % BN
            b_tile[r, c] = B[k0 + r, n0 + c]

    @dev
    def load_fragments(a_frag, b_frag, a_tile, b_tile, kk, ty, tx):
        for i in range(4):
            a_frag[i] = a_tile[kk, ty * 4 + i]
            a_frag[i + 4] = a_tile[kk, 64 + ty * 4 + i]
            b_frag[i] = b_tile[kk, tx * 4 + i]
            b_frag[i + 4] = b_tile[kk, 64 + tx * 4 + i]

    @dev
    def multiply_fragments(acc, a_frag, b_frag):
        for i in range(8):
            for j in range(8):
                acc[i, j] += a_frag[i] * b_frag[j]

    @dev
    def slice_product(acc, a_frag, b_frag, a_tile, b_tile, ty, tx):
        for kk in range(BK):
            load_fragments(a_frag, b_frag, a_tile, b_tile, kk, ty, tx)
            multiply_fragments(acc, a_frag, b_frag)

    @dev
    def store_block(C, acc, m0, n0, ty, tx):
        for i in range(8):
            row = m0 + ty * 4 + i if i < 4 else m0 + 64 + ty * 4 + i - 4
            for j in range(8):
                col = n0 + tx * 4 + j if j < 4 else n0 + 64 + tx * 4 + j - 4
                C[row, col] = acc[i, j]

    @cuda.jit(launch_bounds=(NT, 1))
    def matmul(C, A, B, K):
        a_tile = cuda.shared.array((BK, BM), float32)
        b_tile = cuda.shared.array((BK, BN), float32)
        acc = cuda.local.array((8, 8), float32)
        a_frag = cuda.local.array(8, float32)
        b_frag = cuda.local.array(8, float32)
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        tid = ty * 16 + tx
        m0 = cuda.blockIdx.y * BM
        n0 = cuda.blockIdx.x * BN
        zero_block(acc)
        for k0 in range(0, K, BK):
            load_tiles(a_tile, b_tile, A, B, m0, n0, k0, tid)
            cuda.syncthreads()
            slice_product(acc, a_frag, b_frag, a_tile, b_tile, ty, tx)
            cuda.syncthreads()
        store_block(C, acc, m0, n0, ty, tx)

    return matmul


def build_tree(cuda, variant, depth):
    """A kernel that composes a balanced tree of 2**(depth+1) - 1 device functions (each node
    calls its two children; each leaf does a little arithmetic and a branch), the shape of
    numba-cuda-mlir issues #196 / #249: compile time against the number of inlined functions.
    Generated as source text so both compilers see the same Python."""
    import linecache
    kw = {"always": "inline='always'", "force": "forceinline=True", "never": "inline='never'",
          "default": ""}[variant]
    lines = []
    for level in range(depth, -1, -1):
        for i in range(2 ** level):
            name = f"f{level}_{i}"
            lines.append(f"@cuda.jit(device=True{', ' + kw if kw else ''})")
            if level == depth:
                lines += [f"def {name}(x):",
                          f"    y = x * {1.0 + i / 64:.4f} + {i / 8:.4f}",
                          "    if y > 1.0:",
                          "        y = y - 1.0",
                          "    return y * y + 0.5"]
            else:
                left, right = f"f{level + 1}_{2 * i}", f"f{level + 1}_{2 * i + 1}"
                lines += [f"def {name}(x):",
                          f"    return {left}(x) * 0.5 + {right}(x * 0.5)"]
    lines += ["@cuda.jit", "def tree_kernel(x, out):", "    i = cuda.grid(1)",
              "    if i < x.shape[0]:", "        out[i] = f0_0(x[i])"]
    src = "\n".join(lines) + "\n"
    filename = f"<probe-tree-{variant}-{depth}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    namespace = {"cuda": cuda}
    exec(compile(src, filename, "exec"), namespace)

    def reference(x):
        def f(level, i, v):
            if level == depth:
                y = v * float(f"{1.0 + i / 64:.4f}") + float(f"{i / 8:.4f}")
                y = np.where(y > 1.0, y - 1.0, y)
                return y * y + 0.5
            return f(level + 1, 2 * i, v) * 0.5 + f(level + 1, 2 * i + 1, v * 0.5)
        import numpy as np
        return f(0, 0, x.astype(np.float64))
    return namespace["tree_kernel"], reference


def ptxas_report(ptx):
    """Registers / spills that ptxas (if on PATH) reports for sm_90, or ''."""
    import shutil
    ptxas = os.environ.get("PTXAS") or shutil.which("ptxas")
    if not ptxas:
        return ""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        out = subprocess.run([ptxas, "-arch=sm_90", "-v", path, "-o", os.path.join(d, "k.o")],
                             capture_output=True, text=True, timeout=300)
        text = (out.stdout + out.stderr).replace("\n", " ")
        import re
        regs = re.findall(r"Used (\d+) registers", text)
        spills = re.findall(r"(\d+) bytes spill stores", text)
        return f"ptxas: {regs[-1] if regs else '?'} registers, {spills[-1] if spills else '?'} B spilled"


def timing_child(backend, variant, size, offline, kernel_name="matmul", depth=6):
    """One fresh process: compile (and, with a GPU, run) the matmul; print a JSON line."""
    t_import = time.perf_counter()
    if backend == "numba-cuda":
        numpy_shim()
        from numba import cuda, float32, types
        if offline:
            offline_shim_numba_cuda()
    else:
        if offline:
            offline_shim()
        from numba_cuda_mlir import cuda, types
        float32 = types.float32
    import numpy as np
    t_import = time.perf_counter() - t_import
    result = dict(backend=backend, variant=variant, import_s=round(t_import, 2))

    def warm(x):                    # the first compile of a process pays one-time setup
        x[cuda.grid(1)] += 1.0
    t = time.perf_counter()
    if offline:
        cuda.compile_ptx(warm, (types.float32[::1],), cc=(9, 0))
    else:
        cuda.jit(warm)[1, 32](cuda.to_device(np.zeros(32, np.float32)))
        cuda.synchronize()
    result["warmup_s"] = round(time.perf_counter() - t, 2)
    result["kernel"] = kernel_name if kernel_name == "matmul" else f"tree{depth}"
    if kernel_name == "tree":
        return tree_timing(cuda, types, variant, depth, offline, result)
    kernel = build_matmul(cuda, float32, variant)
    if offline:
        sig = (types.float32[:, ::1], types.float32[:, ::1], types.float32[:, ::1], types.int64)
        t = time.perf_counter()
        ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0), launch_bounds=(NT, 1))
        result["compile_ptx_s"] = round(time.perf_counter() - t, 2)
        result["ptx_lines"] = ptx.count("\n")
        result["ptx_calls"] = ptx.count("call.uni") + ptx.count("\tcall ")
        result["ptxas"] = ptxas_report(ptx)
        print("TIMING " + json.dumps(result), flush=True)
        return
    M = N = K = size
    rng = np.random.default_rng(0)
    a = rng.standard_normal((M, K), dtype=np.float32)
    b = rng.standard_normal((K, N), dtype=np.float32)
    da, db = cuda.to_device(a), cuda.to_device(b)
    dc = cuda.device_array((M, N), dtype=np.float32)
    cuda.synchronize()
    grid, block = (N // BN, M // BM), (16, 16)
    t = time.perf_counter()
    kernel[grid, block](dc, da, db, K)          # compile + load + first run
    cuda.synchronize()
    result["first_launch_s"] = round(time.perf_counter() - t, 2)
    start, end = cuda.event(), cuda.event()
    for _ in range(3):
        kernel[grid, block](dc, da, db, K)
    start.record()
    reps = 10
    for _ in range(reps):
        kernel[grid, block](dc, da, db, K)
    end.record()
    end.synchronize()
    ms = cuda.event_elapsed_time(start, end) / reps
    c = dc.copy_to_host()
    ref = a.astype(np.float64) @ b.astype(np.float64)
    err = float(np.max(np.abs(c - ref)) / np.max(np.abs(ref)))
    result.update(kernel_ms=round(ms, 3), tflops=round(2 * M * N * K / ms / 1e9, 2),
                  max_rel_err=err, correct=bool(err < 1e-4))
    # launch cost from Python: a trivial kernel with 4 device-array arguments, 2,000 launches
    def four(w, x, y, z):
        i = cuda.grid(1)
        if i < w.shape[0]:
            w[i] = x[i] + y[i] + z[i]
    k4 = cuda.jit(four)
    arrays = [cuda.to_device(np.zeros(256, np.float32)) for _ in range(4)]
    k4[1, 256](*arrays)
    cuda.synchronize()
    t = time.perf_counter()
    for _ in range(2000):
        k4[1, 256](*arrays)
    cuda.synchronize()
    result["launch_us"] = round((time.perf_counter() - t) / 2000 * 1e6, 1)
    try:
        regs = kernel.get_regs_per_thread()
        result["regs"] = max(regs.values()) if isinstance(regs, dict) else regs
    except Exception as e:      # noqa: BLE001
        result["regs"] = f"n/a ({type(e).__name__})"
    print("TIMING " + json.dumps(result), flush=True)


def tree_timing(cuda, types, variant, depth, offline, result):
    import numpy as np
    kernel, reference = build_tree(cuda, variant, depth)
    t = time.perf_counter()
    if offline:
        ptx, _ = cuda.compile_ptx(kernel.py_func, (types.float32[::1], types.float32[::1]),
                                  cc=(9, 0))
        result["compile_ptx_s"] = round(time.perf_counter() - t, 2)
        result["ptx_lines"] = ptx.count("\n")
        result["ptx_calls"] = ptx.count("call.uni") + ptx.count("\tcall ")
        print("TIMING " + json.dumps(result), flush=True)
        return
    x = np.linspace(-2, 2, 4096).astype(np.float32)
    out = np.zeros_like(x)
    dx, dout = cuda.to_device(x), cuda.to_device(out)
    kernel[16, 256](dx, dout)
    cuda.synchronize()
    result["first_launch_s"] = round(time.perf_counter() - t, 2)
    err = float(np.max(np.abs(dout.copy_to_host() - reference(x))))
    result.update(max_abs_err=err, correct=bool(err < 1e-3))
    print("TIMING " + json.dumps(result), flush=True)


# ----------------------------------------------------------------------------------------
# numba-cuda-mlir intrinsics written the MLIR way (what nanoandrea's kernels/vector.py,
# asynccopy.py and mma.py would become): codegen(builder, target, args, kwargs) emits MLIR;
# llvm.inline_asm is llvmlite's ir.InlineAsm.

def mlir_intrinsics():
    from numba_cuda_mlir import extending, types
    from numba_cuda_mlir._mlir import ir
    from numba_cuda_mlir._mlir.dialects import arith, llvm
    from numba_cuda_mlir._mlir.extras import types as T
    from numba_cuda_mlir.lowering_utilities import memref_to_llvm_ptr

    def element_ptr(builder, array_var, index_var):
        array = builder.load_var(array_var)
        index = builder.load_var(index_var)
        indices = list(index) if isinstance(index, (tuple, list)) else [index]
        return memref_to_llvm_ptr(array, indices, T.f32())

    def f32(builder, var):
        return builder.mlir_convert(builder.load_var(var), T.f32())

    F4 = lambda: llvm.StructType.get_literal([T.f32()] * 4)     # noqa: E731

    @extending.intrinsic
    def laneid(typingctx):
        def codegen(builder, target, args, kwargs):
            builder.store_var(target, llvm.inline_asm(T.i32(), [], "mov.u32 $0, %laneid;", "=r",
                                                      has_side_effects=False))
        return types.int32(), codegen

    @extending.intrinsic
    def load4(typingctx, array, index):            # ld.global.v4.f32, inline PTX
        result = types.UniTuple(types.float32, 4)

        def codegen(builder, target, args, kwargs):
            ptr = element_ptr(builder, args[0], args[1])
            r = llvm.inline_asm(F4(), [ptr], "ld.global.v4.f32 {$0, $1, $2, $3}, [$4];",
                                "=f,=f,=f,=f,l", has_side_effects=False)
            builder.store_var(target, tuple(llvm.extractvalue(T.f32(), r, [i])
                                            for i in range(4)))
        return result(array, index), codegen

    @extending.intrinsic
    def store4(typingctx, array, index, x0, x1, x2, x3):   # st.global.v4.f32, inline PTX
        def codegen(builder, target, args, kwargs):
            ptr = element_ptr(builder, args[0], args[1])
            llvm.inline_asm(None, [ptr] + [f32(builder, a) for a in args[2:]],
                            "st.global.v4.f32 [$0], {$1, $2, $3, $4};", "l,f,f,f,f,~{memory}",
                            has_side_effects=True)
        return types.void(array, index, x0, x1, x2, x3), codegen

    @extending.intrinsic
    def vload4(typingctx, array, index):           # an aligned <4 x float> load (LLVM IR way,
        result = types.UniTuple(types.float32, 4)  # as vector.py does it): NVVM picks the space

        def codegen(builder, target, args, kwargs):
            ptr = element_ptr(builder, args[0], args[1])
            vec = llvm.load(ir.VectorType.get([4], T.f32()), ptr, alignment=16)
            builder.store_var(target, tuple(
                llvm.extractelement(vec, arith.constant(T.i32(), i)) for i in range(4)))
        return result(array, index), codegen

    @extending.intrinsic
    def add4(typingctx, array, index, x0, x1, x2, x3):     # red.global.add.v4.f32
        def codegen(builder, target, args, kwargs):
            ptr = element_ptr(builder, args[0], args[1])
            llvm.inline_asm(None, [ptr] + [f32(builder, a) for a in args[2:]],
                            "red.global.add.v4.f32 [$0], {$1, $2, $3, $4};",
                            "l,f,f,f,f,~{memory}", has_side_effects=True)
        return types.void(array, index, x0, x1, x2, x3), codegen

    @extending.intrinsic
    def copy16_async(typingctx, dst, dst_index, src, src_index):   # cp.async 16 bytes
        def codegen(builder, target, args, kwargs):
            d = element_ptr(builder, args[0], args[1])      # !llvm.ptr<3> (shared)
            s = element_ptr(builder, args[2], args[3])      # !llvm.ptr<1> (global)
            d32 = llvm.ptrtoint(T.i32(), d) if "ptr<3>" in str(d.type) else None
            if d32 is not None:
                llvm.inline_asm(None, [d32, s], "cp.async.cg.shared.global [$0], [$1], 16, 16;",
                                "r,l,~{memory}", has_side_effects=True)
            else:       # a generic pointer: convert in PTX, as nanoandrea's asynccopy.py does
                llvm.inline_asm(None, [d, s],
                                "{ .reg .u64 s64; .reg .u32 s32; cvta.to.shared.u64 s64, $0; "
                                "cvt.u32.u64 s32, s64; "
                                "cp.async.cg.shared.global [s32], [$1], 16, 16; }",
                                "l,l,~{memory}", has_side_effects=True)
        return types.void(dst, dst_index, src, src_index), codegen

    @extending.intrinsic
    def commit_and_wait(typingctx):
        def codegen(builder, target, args, kwargs):
            llvm.inline_asm(None, [], "cp.async.commit_group;", "~{memory}", has_side_effects=True)
            llvm.inline_asm(None, [], "cp.async.wait_group 0;", "~{memory}", has_side_effects=True)
        return types.void(), codegen

    MMA = ("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
           "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};")

    @extending.intrinsic
    def mma_tf32(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        result = types.UniTuple(types.float32, 4)

        def codegen(builder, target, args, kwargs):
            values = [f32(builder, a) for a in args]
            operands = [llvm.bitcast(T.i32(), v) for v in values[:6]] + values[6:]
            d = llvm.inline_asm(F4(), operands, MMA, "=f,=f,=f,=f,r,r,r,r,r,r,0,1,2,3",
                                has_side_effects=False)
            builder.store_var(target, tuple(llvm.extractvalue(T.f32(), d, [i])
                                            for i in range(4)))
        return result(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3), codegen

    extending.refresh_registries()
    return dict(laneid=laneid, load4=load4, store4=store4, vload4=vload4, add4=add4,
                copy16_async=copy16_async, commit_and_wait=commit_and_wait, mma_tf32=mma_tf32)


# ----------------------------------------------------------------------------------------
# feature steps (numba-cuda-mlir); each returns a detail string or raises

def feature_steps(offline):
    import numpy as np
    if offline:
        offline_shim()
    t = time.perf_counter()
    import numba_cuda_mlir
    from numba_cuda_mlir import cuda, types
    from numba_cuda_mlir.cuda import experimental as cx
    import_s = time.perf_counter() - t
    f32 = types.float32
    box = {}

    def ptx_of(fn, sig, **kw):
        ptx, _ = cuda.compile_ptx(fn, sig, cc=(9, 0), **kw)
        return ptx

    def need_gpu():
        if offline:
            raise Skip("offline: no GPU")

    @step("import_and_versions")
    def s_versions():
        import importlib.metadata as md
        vers = {}
        for name in ("numba-cuda-mlir", "numba_cuda_mlir", "numpy", "cuda-bindings", "cuda-core",
                     "cuda-pathfinder", "numba", "numba-cuda", "llvmlite", "cupy-cuda13x",
                     "nvidia-cuda-nvrtc", "nvidia-nvjitlink", "nvidia-nvvm", "nvidia-cuda-nvcc"):
            try:
                vers[name] = md.version(name)
            except Exception:   # noqa: BLE001
                pass
        loaded = [m for m in ("numba", "llvmlite") if m in sys.modules]
        extra = ""
        try:
            from numba_cuda_mlir.numba_cuda.cudadrv.nvvm import NVVM
            extra += f" NVVM {NVVM().get_version()} IR {NVVM().get_ir_version()}"
        except Exception as e:  # noqa: BLE001
            extra += f" NVVM n/a ({type(e).__name__}: {e})"
        try:
            from numba_cuda_mlir.tools import get_cuda_runtime_version
            extra += f" nvrtc/runtime {get_cuda_runtime_version()}"
        except Exception as e:  # noqa: BLE001
            extra += f" runtime n/a ({type(e).__name__})"
        if not offline:
            try:
                d = cuda.get_current_device()
                extra += f" device {d.name} cc {d.compute_capability}"
                from numba_cuda_mlir.numba_cuda.cudadrv.driver import driver
                extra += f" driver {driver.get_version()}"
            except Exception as e:  # noqa: BLE001
                extra += f" device n/a ({type(e).__name__}: {e})"
        return (f"numba_cuda_mlir {numba_cuda_mlir.__version__} from "
                f"{os.path.dirname(numba_cuda_mlir.__file__)}; import {import_s:.2f}s; {vers}; "
                f"numba/llvmlite imported by it: {loaded or 'none'};{extra}")

    @step("tiny_kernel")
    def s_tiny():
        def add(a, b, out):
            i = cuda.grid(1)
            if i < out.shape[0]:
                out[i] = a[i] + b[i]
        sig = (f32[::1], f32[::1], f32[::1])
        t = time.perf_counter()
        ptx = ptx_of(add, sig)
        ptx_s = time.perf_counter() - t
        if offline:
            return f"compile_ptx {ptx_s:.2f}s, {ptx.count(chr(10))} PTX lines"
        k = cuda.jit(add)
        n = 1 << 20
        a = np.arange(n, dtype=np.float32)
        b = np.ones(n, dtype=np.float32)
        da, db, do = cuda.to_device(a), cuda.to_device(b), cuda.device_array(n, np.float32)
        t = time.perf_counter()
        k[(n + 255) // 256, 256](da, db, do)
        cuda.synchronize()
        first = time.perf_counter() - t
        assert np.array_equal(do.copy_to_host(), a + b), "wrong sum"
        hn = np.zeros(n, np.float32)
        k[(n + 255) // 256, 256](a, b, hn)          # host arrays: copied in and back
        assert np.array_equal(hn, a + b), "wrong sum with host arrays"
        return f"compile_ptx {ptx_s:.2f}s; first launch {first:.2f}s; device and host arrays OK"

    intr = {}

    def I():        # noqa: E743 - the intrinsics, defined once (also after a restart)
        if not intr:
            intr.update(mlir_intrinsics())
        return intr

    @step("intrinsic_api")
    def s_intr():
        return ("numba_cuda_mlir.extending.intrinsic + llvm.inline_asm defined: "
                + ", ".join(I()))

    @step("intrinsic_inline_ptx_laneid")
    def s_laneid():
        laneid = I()["laneid"]

        def k(out):
            i = cuda.grid(1)
            out[i] = laneid()
        ptx = ptx_of(k, (types.int32[::1],))
        assert "%laneid" in ptx, "no %laneid in PTX"
        if offline:
            return "PTX has mov.u32 %r, %laneid"
        out = np.zeros(256, np.int32)
        cuda.jit(k)[2, 128](out)
        assert np.array_equal(out, np.arange(256) % 32), out[:40]
        return "mov.u32 %laneid: lanes 0..31 as expected"

    @step("intrinsic_ld_st_global_v4")
    def s_ldst():
        load4, store4 = I()["load4"], I()["store4"]

        def k(a, out):
            i = cuda.grid(1)
            x0, x1, x2, x3 = load4(a, (i, 0))
            store4(out, (i, 0), x3, x2, x1, x0 + 1.0)
        sig = (f32[:, ::1], f32[:, ::1])
        ptx = ptx_of(k, sig)
        assert "ld.global.v4.f32" in ptx and "st.global.v4.f32" in ptx, "no v4 in PTX"
        if offline:
            return "PTX has ld.global.v4.f32 / st.global.v4.f32"
        a = np.arange(4096, dtype=np.float32).reshape(1024, 4)
        out = np.zeros_like(a)
        cuda.jit(k)[4, 256](a, out)
        want = a[:, ::-1].copy()
        want[:, 3] += 1
        assert np.array_equal(out, want), "wrong values"
        return "16-byte loads/stores (2-D index tuple) correct"

    @step("llvm_vector_load_shared_v4")
    def s_vload():
        vload4 = I()["vload4"]

        def k(a, out):
            tile = cuda.shared.array((64, 4), f32, alignment=16)
            t = cuda.threadIdx.x
            for e in range(4):
                tile[t, e] = a[t, e]
            cuda.syncthreads()
            x0, x1, x2, x3 = vload4(tile, (63 - t, 0))
            out[t] = x0 + x1 + x2 + x3
        sig = (f32[:, ::1], f32[::1])
        ptx = ptx_of(k, sig)
        kinds = [s for s in ("ld.shared.v4.f32", "ld.v4.f32") if s in ptx]
        assert kinds, "no 16-byte shared load in PTX"
        if offline:
            return f"PTX has {kinds}"
        a = np.arange(256, dtype=np.float32).reshape(64, 4)
        out = np.zeros(64, np.float32)
        cuda.jit(k)[1, 64](a, out)
        assert np.array_equal(out, a[::-1].sum(axis=1)), "wrong sums"
        return f"llvm.load <4 x f32> from shared: {kinds}, correct"

    @step("intrinsic_red_global_add_v4")
    def s_red():
        add4 = I()["add4"]

        def k(acc):
            i = cuda.grid(1)
            add4(acc, (i % 8, 0), 1.0, 2.0, 3.0, 4.0)
        ptx = ptx_of(k, (f32[:, ::1],))
        assert "red.global.add.v4.f32" in ptx
        if offline:
            return "PTX has red.global.add.v4.f32"
        acc = cuda.to_device(np.zeros((8, 4), np.float32))
        cuda.jit(k)[4, 256](acc)
        got = acc.copy_to_host()
        assert np.array_equal(got, np.tile([128, 256, 384, 512], (8, 1)).astype(np.float32)), got
        return "red.global.add.v4.f32 sums correct"

    @step("intrinsic_cp_async")
    def s_cpasync():
        copy16, wait = I()["copy16_async"], I()["commit_and_wait"]

        def k(a, out):
            s = cuda.shared.array(256, f32, alignment=16)
            t = cuda.threadIdx.x
            copy16(s, (t * 4,), a, (t * 4,))
            wait()
            cuda.syncthreads()
            out[t] = s[(63 - t) * 4] + s[(63 - t) * 4 + 3]
        sig = (f32[::1], f32[::1])
        ptx = ptx_of(k, sig)
        assert "cp.async.cg.shared.global" in ptx and "cp.async.wait_group" in ptx
        if offline:
            return "PTX has cp.async.cg.shared.global / commit / wait_group"
        a = np.arange(256, dtype=np.float32)
        out = np.zeros(64, np.float32)
        cuda.jit(k)[1, 64](a, out)
        r = a.reshape(64, 4)[::-1]
        assert np.array_equal(out, r[:, 0] + r[:, 3]), "wrong"
        return "cp.async 16 B global->shared correct"

    @step("builtin_inline_ptx")
    def s_inline_ptx():
        def k(x, out):
            i = cuda.grid(1)
            out[i] = cx.inline_ptx("add.f32 %0, %1, %2;", "=f", f32, "f", x[i], "f", 1.5)
        sig = (f32[::1], f32[::1])
        ptx = ptx_of(k, sig)
        assert "add.f32" in ptx
        if offline:
            return "numba_cuda_mlir.cuda.experimental.inline_ptx compiles"
        x = np.arange(64, dtype=np.float32)
        out = np.zeros(64, np.float32)
        cuda.jit(k)[1, 64](x, out)
        assert np.array_equal(out, x + 1.5)
        return "cuda.experimental.inline_ptx correct"

    @step("intrinsic_mma_sync_tf32")
    def s_mma():
        mma = I()["mma_tf32"]

        def k(A, B, C, D):
            lane = cuda.threadIdx.x
            g = lane // 4
            t = lane % 4
            d0, d1, d2, d3 = mma(A[g, t], A[g + 8, t], A[g, t + 4], A[g + 8, t + 4],
                                 B[t, g], B[t + 4, g],
                                 C[g, 2 * t], C[g, 2 * t + 1], C[g + 8, 2 * t], C[g + 8, 2 * t + 1])
            D[g, 2 * t] = d0
            D[g, 2 * t + 1] = d1
            D[g + 8, 2 * t] = d2
            D[g + 8, 2 * t + 1] = d3
        sig = (f32[:, ::1],) * 4
        ptx = ptx_of(k, sig)
        assert "mma.sync.aligned.m16n8k8" in ptx
        if offline:
            return "PTX has mma.sync.aligned.m16n8k8 (C tied to D)"
        rng = np.random.default_rng(1)
        tf = lambda x: (x.view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)  # noqa
        A = tf(rng.standard_normal((16, 8), dtype=np.float32))
        B = tf(rng.standard_normal((8, 8), dtype=np.float32))
        C = rng.standard_normal((16, 8), dtype=np.float32)
        D = np.zeros((16, 8), np.float32)
        cuda.jit(k)[1, 32](A, B, C, D)
        ref = A.astype(np.float64) @ B + C
        err = float(np.max(np.abs(D - ref)))
        assert err < 1e-4, err
        return f"m16n8k8 tf32 on one warp, max abs err {err:.1e}"

    def device_fn_step(label, decorator_kw):
        def body():
            dev = cuda.jit(device=True, **decorator_kw)(lambda x: x * 2.0 + 1.0)

            def k(x, out):
                i = cuda.grid(1)
                out[i] = dev(x[i]) + dev(out[i])
            sig = (f32[::1], f32[::1])
            ptx = ptx_of(k, sig)
            calls = ptx.count("call.uni") + ptx.count("\tcall ")
            if offline:
                return f"{decorator_kw}: compiles, {calls} calls left in PTX"
            x = np.arange(64, dtype=np.float32)
            out = np.ones(64, np.float32)
            kk = cuda.jit(k)
            kk[1, 64](x, out)
            assert np.array_equal(out, (x * 2 + 1) + 3), "wrong"
            asm = kk.inspect_asm()
            asm = next(iter(asm.values())) if isinstance(asm, dict) else asm
            calls = asm.count("call.uni") + asm.count("\tcall ")
            return f"{decorator_kw}: correct, {calls} calls left in PTX"
        return step(label)(body)

    s_always = device_fn_step("device_fn_inline_always", dict(inline="always"))
    s_force = device_fn_step("device_fn_forceinline", dict(forceinline=True))

    @step("launch_bounds")
    def s_bounds():
        def k(out):
            out[cuda.grid(1)] = 1.0
        ptx = ptx_of(k, (f32[::1],), launch_bounds=(256, 2))
        ok = ".maxntid 256, 1, 1" in ptx and ".minnctapersm 2" in ptx
        assert ok, [line for line in ptx.splitlines() if "maxntid" in line or "minncta" in line]
        if offline:
            return "compile_ptx(launch_bounds=(256, 2)): .maxntid 256,1,1 / .minnctapersm 2"
        kk = cuda.jit(launch_bounds=(256, 2))(k)
        out = np.zeros(512, np.float32)
        kk[2, 256](out)
        assert out.sum() == 512
        return "@cuda.jit(launch_bounds=(256, 2)): .maxntid / .minnctapersm in PTX, runs"

    @step("dynamic_shared_100KB_aligned16")
    def s_dynshared():
        def k(out, n):
            buf = cuda.shared.array(0, f32, alignment=16)
            t = cuda.threadIdx.x
            for j in range(t, n, cuda.blockDim.x):
                buf[j] = j
            cuda.syncthreads()
            acc = 0.0
            for j in range(t, n, cuda.blockDim.x):
                acc += buf[n - 1 - j]
            out[t] = acc
        ptx = ptx_of(k, (f32[::1], types.int64))
        assert ".align 16" in ptx, "dynamic shared not 16-byte aligned"
        if offline:
            return "shared.array(0, float32, alignment=16): .shared .align 16 in PTX"
        n = 25600                       # 100 KB of floats, past the 48 KB default
        out = np.zeros(256, np.float32)
        kk = cuda.jit(k)
        kk[1, 256, 0, 4 * n](out, n)    # kernel[grid, block, stream, sharedmem]
        want = np.array([sum(float(n - 1 - j) for j in range(t, n, 256)) for t in range(256)])
        assert np.allclose(out, want), "wrong"
        return "100 KB dynamic shared launched without any opt-in call (the launcher sets it)"

    @step("shfl_xor_sync_syncwarp_local_array")
    def s_warp():
        def k(x, out):
            i = cuda.grid(1)
            tmp = cuda.local.array(4, f32)
            for j in range(4):
                tmp[j] = x[i] * (j + 1)
            v = tmp[0] + tmp[1] + tmp[2] + tmp[3]
            cuda.syncwarp(0xFFFFFFFF)
            for off in (16, 8, 4, 2, 1):
                v += cuda.shfl_xor_sync(0xFFFFFFFF, v, off)
            out[i] = v
        sig = (f32[::1], f32[::1])
        ptx = ptx_of(k, sig)
        assert "shfl.sync.bfly" in ptx and "bar.warp.sync" in ptx
        if offline:
            return "PTX has shfl.sync.bfly, bar.warp.sync"
        x = np.arange(128, dtype=np.float32)
        out = np.zeros(128, np.float32)
        cuda.jit(k)[1, 128](x, out)
        want = np.repeat(x.reshape(4, 32).sum(axis=1) * 10, 32)
        assert np.array_equal(out, want), "wrong"
        return "warp sum correct"

    @step("atomic_add")
    def s_atomic():
        def k(acc):
            cuda.atomic.add(acc, 0, 1.0)
        if offline:
            ptx_of(k, (f32[::1],))
            return "compiles"
        acc = np.zeros(1, np.float32)
        cuda.jit(k)[4, 256](acc)
        assert acc[0] == 1024
        return "cuda.atomic.add correct"

    @step("external_stream_cupy_and_events")
    def s_stream():
        need_gpu()
        try:
            import cupy
        except Exception as e:  # noqa: BLE001
            raise Skip(f"no CuPy: {e}")

        def k(x):
            i = cuda.grid(1)
            if i < x.shape[0]:
                x[i] += 1.0
        kk = cuda.jit(k)
        cs = cupy.cuda.Stream(non_blocking=True)
        s = cuda.external_stream(cs.ptr)
        x = cupy.zeros(1 << 20, dtype=cupy.float32)      # a CuPy array as the argument
        e0, e1 = cuda.event(), cuda.event()
        e0.record(s)
        for _ in range(10):
            kk[(x.size + 255) // 256, 256, s](x)
        e1.record(s)
        e1.synchronize()
        ms = cuda.event_elapsed_time(e0, e1)
        assert float(x.sum()) == 10 * x.size
        # capture into a CUDA graph on the CuPy stream (as nanoandrea's step does)
        graph_note = ""
        try:
            cs.begin_capture()
            for _ in range(5):
                kk[(x.size + 255) // 256, 256, s](x)
            g = cs.end_capture()
            g.launch(cs)
            cs.synchronize()
            assert float(x.sum()) == 15 * x.size
            graph_note = "; graph capture of 5 launches replayed correctly"
        except Exception as e:  # noqa: BLE001
            graph_note = f"; graph capture FAILED: {type(e).__name__}: {e}"
        return (f"external_stream(cupy ptr), CuPy array arg, events: 10 launches "
                f"{ms:.3f} ms{graph_note}")

    @step("compile_results_ptx_sass_regs_pickle")
    def s_inspect():
        need_gpu()
        import pickle

        def k(x):
            x[cuda.grid(1)] *= 2.0
        kk = cuda.jit(k)
        x = np.ones(64, np.float32)
        kk[1, 64](x)
        notes = []
        asm = kk.inspect_asm()
        notes.append(f"inspect_asm: {type(asm).__name__} of {len(asm)}")
        regs = kk.get_regs_per_thread()
        notes.append(f"get_regs_per_thread {regs}")
        try:
            sass = kk.inspect_sass()
            sass = next(iter(sass.values())) if isinstance(sass, dict) else sass
            notes.append(f"inspect_sass {len(sass)} chars")
        except Exception as e:  # noqa: BLE001
            notes.append(f"inspect_sass FAILED {type(e).__name__}: {e}")
        cres = next(iter(kk.overloads.values()))
        notes.append("cubin in metadata" if cres.metadata.get("cubin") else "no cubin in metadata")
        try:
            cres._codelibrary.get_cufunc()
            notes.append("_codelibrary.get_cufunc() OK")
        except Exception as e:  # noqa: BLE001
            notes.append(f"_codelibrary.get_cufunc() FAILED {type(e).__name__}")
        notes.append(f"configured.pre_launch_callbacks: "
                     f"{hasattr(kk[1, 64], 'pre_launch_callbacks')}")
        try:       # _reduce_states / _rebuild: pickle here, rebuild in a fresh process
            state = kk._reduce_states()
            with tempfile.TemporaryDirectory() as d:
                path = os.path.join(d, "kernel.pkl")
                with open(path, "wb") as f:
                    pickle.dump(kk, f)
                code = ("import pickle, numpy as np; k = pickle.load(open(%r, 'rb')); "
                        "x = np.ones(64, np.float32); k[1, 64](x); "
                        "print('REBUILT', float(x.sum()), len(k.overloads))" % path)
                out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                                     text=True, timeout=180)
            line = (out.stdout + out.stderr).strip().splitlines()[-1:]
            ok = bool(line) and line[0].startswith("REBUILT 128.0")
            notes.append(f"pickle -> new process {'OK' if ok else 'FAILED'} {line} "
                         f"(_reduce_states keys {sorted(state)})")
        except Exception as e:  # noqa: BLE001
            notes.append(f"pickle FAILED {type(e).__name__}: {e}")
        return "; ".join(notes)

    @step("simulator_env_var")
    def s_sim():
        code = ("import os, numpy as np; from numba_cuda_mlir import cuda; "
                "print('HAS_SIMULATOR', hasattr(cuda, 'simulator'), "
                "'is_available', cuda.is_available())")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}, timeout=120)
        text = (out.stdout + out.stderr).strip().splitlines()
        line = text[-1] if text else ""
        if "HAS_SIMULATOR False" in line:
            raise AssertionError(f"no simulator: NUMBA_ENABLE_CUDASIM=1 is ignored ({line})")
        return line

    return [s_versions, s_tiny, s_intr, s_laneid, s_ldst, s_vload, s_red, s_cpasync,
            s_inline_ptx, s_mma, s_always, s_force, s_bounds, s_dynshared, s_warp, s_atomic,
            s_stream, s_inspect, s_sim]


def run_features(offline, skip_through):
    steps = feature_steps(offline)
    skipping = skip_through is not None
    for s in steps:
        if skipping:
            if s.step_name == skip_through:
                skipping = False
            continue
        s()


# ----------------------------------------------------------------------------------------
# groups that need a process of their own

def emm_child():
    """External memory manager: CuPy's pool under numba-cuda-mlir (set before the context)."""
    import ctypes

    import numpy as np
    from numba_cuda_mlir import cuda

    @step("emm_cupy_pool")
    def s():
        try:
            import cupy
        except Exception as e:  # noqa: BLE001
            raise Skip(f"no CuPy: {e}")
        from numba_cuda_mlir.cuda import (GetIpcHandleMixin, HostOnlyCUDAMemoryManager,
                                          MemoryInfo, MemoryPointer)
        calls = []

        class CuPyMemoryManager(GetIpcHandleMixin, HostOnlyCUDAMemoryManager):
            live = {}

            def initialize(self):
                pass

            def memalloc(self, size):
                block = cupy.cuda.alloc(size)
                address = int(block.ptr)
                self.live[address] = block
                calls.append(size)
                live = self.live
                return MemoryPointer(self.context, ctypes.c_void_p(address), size,
                                     finalizer=lambda: live.pop(address, None))

            def get_memory_info(self):
                free, total = cupy.cuda.runtime.memGetInfo()
                return MemoryInfo(free=free, total=total)

            @property
            def interface_version(self):
                return 1

        cuda.set_memory_manager(CuPyMemoryManager)

        @cuda.jit
        def k(x):
            x[cuda.grid(1)] += 1.0
        d = cuda.device_array(1024, np.float32)
        d.copy_to_device(np.zeros(1024, np.float32))
        k[4, 256](d)
        assert np.array_equal(d.copy_to_host(), np.ones(1024)), "wrong"
        t = time.perf_counter()
        for _ in range(200):
            cuda.device_array(1024, np.float32)
        us = (time.perf_counter() - t) / 200 * 1e6
        assert calls, "memalloc never called"
        return (f"set_memory_manager(HostOnlyCUDAMemoryManager + GetIpcHandleMixin subclass): "
                f"{len(calls)} memalloc calls; device_array+free {us:.1f} us")
    s()


CACHE_SRC = '''
import sys, time
import numpy as np
from numba_cuda_mlir import cuda

@cuda.jit(cache=True)
def cached_kernel(x):
    i = cuda.grid(1)
    if i < x.shape[0]:
        x[i] = x[i] * 2.0 + 1.0

x = np.ones(256, np.float32)
t = time.perf_counter()
cached_kernel[1, 256](x)
s = time.perf_counter() - t
assert np.array_equal(x, 3 * np.ones(256))
st = cached_kernel.stats
count = lambda c: sum(c.values()) if hasattr(c, "values") else int(c)
print("CACHE", round(s, 3), count(st.cache_hits), count(st.cache_misses), st.cache_path)
'''


CUSTOM_CACHE_SRC = '''
import pickle, sys, time
import numpy as np
from numba_cuda_mlir import cuda
from numba_cuda_mlir.caching import MLIRCacheImpl


class FileCache:
    """nanoandrea/kernels/cache.py's KernelCache, ported: the dispatcher's `_cache` protocol
    (load_overload / save_overload), the payload MLIRCacheImpl's reduce / rebuild (for
    numba-cuda it is _Kernel._reduce_states / _Kernel._rebuild)."""
    def __init__(self, path):
        self.path, self.hits, self.misses = path, 0, 0

    @property
    def cache_path(self):
        return self.path

    def load_overload(self, sig, target_context):
        try:
            with open(self.path, "rb") as f:
                payload = pickle.load(f)
        except OSError:
            self.misses += 1
            return None
        self.hits += 1
        return MLIRCacheImpl.rebuild(None, target_context, payload)

    def save_overload(self, sig, cres):
        with open(self.path, "wb") as f:
            pickle.dump(MLIRCacheImpl.reduce(None, cres), f)

    def flush(self):
        pass


@cuda.jit
def kernel(x):
    i = cuda.grid(1)
    if i < x.shape[0]:
        x[i] = x[i] * 2.0 + 1.0


kernel._cache = FileCache(sys.argv[1])
x = np.ones(256, np.float32)
t = time.perf_counter()
kernel[1, 256](x)
s = time.perf_counter() - t
assert np.array_equal(x, 3 * np.ones(256))
print("CUSTOM", round(s, 3), kernel._cache.hits, kernel._cache.misses)
'''


def cache_group():
    @step("kernel_disk_cache")
    def s():
        with tempfile.TemporaryDirectory() as d:
            src = os.path.join(d, "cached_mod.py")
            with open(src, "w") as f:
                f.write(CACHE_SRC)
            env = {**os.environ, "NUMBA_CACHE_DIR": os.path.join(d, "cache")}
            lines = []
            for _ in range(2):
                out = subprocess.run([sys.executable, src], capture_output=True, text=True,
                                     env=env, timeout=240)
                got = [ln for ln in out.stdout.splitlines() if ln.startswith("CACHE")]
                if not got:
                    tail = (out.stdout + out.stderr).strip().splitlines()[-3:]
                    raise AssertionError(f"run failed: {tail}")
                lines.append(got[-1])
            files = sum(len(fs) for _, _, fs in os.walk(os.path.join(d, "cache")))
            second = lines[1].split()
            assert int(second[2]) > 0, f"second process had no cache hit: {lines}"
            return f"first: {lines[0]}; second: {lines[1]}; {files} cache files"
    s()

    @step("custom_kernel_cache_protocol")
    def s_custom():
        with tempfile.TemporaryDirectory() as d:
            src = os.path.join(d, "custom_cache_mod.py")
            with open(src, "w") as f:
                f.write(CUSTOM_CACHE_SRC)
            store = os.path.join(d, "kernel.pkl")
            lines = []
            for _ in range(2):
                out = subprocess.run([sys.executable, src, store], capture_output=True,
                                     text=True, timeout=240)
                got = [ln for ln in out.stdout.splitlines() if ln.startswith("CUSTOM")]
                if not got:
                    tail = (out.stdout + out.stderr).strip().splitlines()[-3:]
                    raise AssertionError(f"run failed: {tail}")
                lines.append(got[-1])
            assert lines[1].split()[2] == "1", f"second process did not load it: {lines}"
            return (f"dispatcher._cache replaced, payload MLIRCacheImpl.reduce/rebuild: "
                    f"first (hits, misses) {lines[0]}; second {lines[1]}")
    s_custom()


def coexist_child():
    """numba-cuda and numba-cuda-mlir in one process; a device array passed across."""
    @step("coexist_one_process")
    def s():
        numpy_shim()
        import numpy as np
        from numba import cuda as nc
        from numba_cuda_mlir import cuda as mc

        @nc.jit
        def k_old(x):
            x[nc.grid(1)] += 1.0

        @mc.jit
        def k_new(x):
            x[mc.grid(1)] *= 3.0
        d = nc.to_device(np.ones(256, np.float32))
        k_old[1, 256](d)
        k_new[1, 256](d)              # a numba-cuda device array into a numba-cuda-mlir kernel
        k_old[1, 256](d)
        got = d.copy_to_host()
        assert np.array_equal(got, 7 * np.ones(256)), got[:4]
        return "both compilers in one process; numba-cuda array through both kernels correct"
    s()


# ----------------------------------------------------------------------------------------
# the parent: runs each group in a child, restarting after crashes

def run_child(argv, timeout, label):
    """Run this script with argv; return (step lines, timing dicts, tail of output)."""
    cmd = [sys.executable, "-u", HERE] + argv
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        text, rc = out.stdout + out.stderr, out.returncode
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        text += f"\n[timed out after {timeout}s]"
        rc = "timeout"
    lines = text.splitlines()
    steps = [ln for ln in lines if ln.startswith("STEP ")]
    timings = [json.loads(ln[7:]) for ln in lines if ln.startswith("TIMING ")]
    started = [ln.split()[1] for ln in lines if ln.startswith("START ")]
    done = {ln.split()[1] for ln in steps}
    crashed_in = next((s for s in reversed(started) if s not in done), None)
    tail = " | ".join(ln for ln in lines[-6:] if ln.strip())
    return steps, timings, rc, crashed_in, tail


def parent(args):
    t0 = time.perf_counter()
    deadline = t0 + args.budget
    summary = {"PASS": 0, "FAIL": 0, "SKIP": 0}
    timings = []
    common = ["--offline"] if args.offline else []

    def emit(step_lines):
        for ln in step_lines:
            print(ln, flush=True)
            summary[ln.split()[2]] = summary.get(ln.split()[2], 0) + 1

    def fail(name, why):
        emit([f"STEP {name} FAIL {' '.join(why.split())[:600]}"])

    def time_left(need):
        return deadline - time.perf_counter() > need

    groups = args.only.split(",") if args.only else ["features", "emm", "cache", "coexist",
                                                     "timing"]
    if args.offline:
        groups = [g for g in groups if g in ("features", "timing")]

    if "features" in groups:
        skip = None
        for _attempt in range(8):
            if not time_left(30):
                fail("features", "budget spent")
                break
            argv = ["--child", "features"] + common + (["--skip-through", skip] if skip else [])
            steps, _, rc, crashed_in, tail = run_child(argv, min(300, deadline - time.perf_counter()),
                                                       "features")
            emit(steps)
            if crashed_in is None:
                if rc not in (0,):
                    fail("features_child", f"exit {rc}: {tail}")
                break
            fail(crashed_in, f"child died (exit {rc}) in this step: {tail}")
            skip = crashed_in
    for group in ("emm", "cache", "coexist"):
        if group in groups:
            if not time_left(30):
                fail(group, "budget spent")
                continue
            steps, _, rc, crashed_in, tail = run_child(["--child", group] + common,
                                                       min(300, deadline - time.perf_counter()),
                                                       group)
            emit(steps)
            if crashed_in is not None or not steps:
                fail(crashed_in or group, f"child died (exit {rc}): {tail}")
    if "timing" in groups:
        backends = [b for b in args.backends.split(",")]
        runs = [("matmul", v) for v in args.variants.split(",") if v]
        runs += [("tree", v) for v in args.tree_variants.split(",") if v]
        for kernel_name, variant in runs:
            for backend in backends:
                name = f"timing_{kernel_name}_{backend}_{variant}"
                if not time_left(20):
                    emit([f"STEP {name} SKIP budget spent"])
                    continue
                argv = ["--child", "timing", "--backend", backend, "--variant", variant,
                        "--size", str(args.size), "--kernel", kernel_name,
                        "--tree-depth", str(args.tree_depth)] + common
                limit = min(args.timing_timeout, deadline - time.perf_counter())
                steps, tim, rc, _, tail = run_child(argv, limit, name)
                if tim:
                    timings.extend(tim)
                    t = tim[0]
                    secs = t.get("first_launch_s", t.get("compile_ptx_s"))
                    ok = t.get("correct", True)
                    emit([f"STEP {name} {'PASS' if ok else 'FAIL'} "
                          f"{'first launch' if 'first_launch_s' in t else 'compile_ptx'} "
                          f"{secs}s {json.dumps(t)}"])
                else:
                    fail(name, f"exit {rc}: {tail}")
    print(f"probe: {summary['PASS']} passed, {summary['FAIL']} failed, {summary['SKIP']} skipped "
          f"in {time.perf_counter() - t0:.0f}s", flush=True)
    for t in timings:
        print("TIMING " + json.dumps(t), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(summary=summary, timings=timings), f, indent=1)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--offline", action="store_true", help="no GPU: compile to PTX only")
    p.add_argument("--only", default="", help="groups: features,emm,cache,coexist,timing")
    p.add_argument("--budget", type=float, default=540, help="seconds for the whole probe")
    p.add_argument("--size", type=int, default=2048, help="matmul M = N = K for timing")
    p.add_argument("--variants", default="always,force,default",
                   help="matmul timing variants (inlining of its device functions)")
    p.add_argument("--tree-variants", default="always,force,never",
                   help="timing variants for the device-function tree kernel ('' for none)")
    p.add_argument("--tree-depth", type=int, default=6,
                   help="tree of 2**(d+1)-1 device functions")
    p.add_argument("--kernel", default="matmul", help=argparse.SUPPRESS)
    p.add_argument("--backends", default="mlir,numba-cuda")
    p.add_argument("--timing-timeout", type=float, default=200)
    p.add_argument("--json", default="", help="also write the summary and timings here")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    p.add_argument("--skip-through", default=None, help=argparse.SUPPRESS)
    p.add_argument("--backend", default="mlir", help=argparse.SUPPRESS)
    p.add_argument("--variant", default="always", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child == "features":
        run_features(args.offline, args.skip_through)
    elif args.child == "emm":
        emm_child()
    elif args.child == "cache":
        cache_group()
    elif args.child == "coexist":
        coexist_child()
    elif args.child == "timing":
        timing_child(args.backend, args.variant, args.size, args.offline, args.kernel,
                     args.tree_depth)
    else:
        parent(args)


if __name__ == "__main__":
    main()
