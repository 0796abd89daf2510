"""Check and time the numbered teaching versions of an op: tools/dev/<op>/v<N>_<idea>.py.

    python tools/dev/run.py                       # both ladders, each at its default shape
    python tools/dev/run.py matmul    [--shape M,N,K]   [--only v3,v4] [--json PATH]
    python tools/dev/run.py attention [--shape B,H,T,D] [--only v1,v2] [--json PATH]
    python tools/dev/run.py --json results.json   # then: the README's table, from that run
    python tools/dev/run.py --table results.json  #   (markdown; no GPU needed)

Every version is imported in the order of its number and checked against float64 NumPy on
fresh random inputs, its outputs poisoned with NaN first (so an element it never writes
shows): the relative error ||out - ref|| / ||ref|| of every output must stay below the op's
tolerance (TOLERANCE; an attention version in bf16, BF16_TOLERANCE). A version that fails
(or does not import, or raises) is reported and not timed, the others go on, and the run
exits with status 1. On a GPU each version that passed is then timed beside the library, in
the same process on the same inputs, and one table is printed: the version, its idea (the
first line of its docstring), milliseconds, TFLOP/s, and its speed as a ratio of the
library's (library ms / version ms: 0.92x is 8% slower; a bf16 version's against the
library in bf16).

What a version exposes:
  matmul     matmul(out, a, b): out[M,N] = a[M,K] @ b[K,N], C-contiguous float32 Numba device
             arrays, row-major. MULTIPLE_OF = (m, n, k), optional: M, N, K must be multiples
             of these (default any). TRANSPOSES, optional: the (transpose_a, transpose_b) it
             takes, matmul(out, a, b, transpose_a=, transpose_b=) then giving out = op(a) @
             op(b), a transposed operand stored as its transpose ([K, M] for a, [N, K] for b):
             the products of a backward, each checked and timed beside cuBLAS's own.
             Library: cuBLAS, cupy.matmul in float32 with TF32 off (CUPY_TF32=0).
             Work: 2MNK flops. Default shape 16384,3072,768 (andrea-120m's MLP up: B*T = 16384
             rows, C = 768 in, 4C = 3072 out).
  attention  forward(out, lse, q, k, v): causal softmax(q k^T / sqrt(D)) v, no dropout; q, k,
             v, out [B,H,T,D], lse [B,H,T] (lse_i = log sum_{j<=i} exp(q_i . k_j / sqrt(D)),
             natural log), C-contiguous float32 Numba device arrays.
             backward(dq, dk, dv, dout, q, k, v, out, lse), or backward = None: the gradients
             of the inputs (written, not added), given out and lse from forward.
             HEAD_SIZES = (32, 64), optional: the head sizes D it takes (None: any).
             PRECISION = "bf16", optional: it multiplies on the tensor cores in bf16 (its
             inputs still float32, rounded by the version): checked against float64 attention
             of q, k, v, dout rounded to bf16, within BF16_TOLERANCE (what is left is the
             version's rounding of P and dS), and timed beside SDPA on bf16 tensors.
             Library: torch's scaled_dot_product_attention(is_causal=True), float32 with TF32
             off (bf16 versions: on bf16 copies of the inputs, made before the timings);
             forward alone, and forward + backward (autograd) where there is a backward.
             Work: 4BHT^2D/2 flops forward (two products over the causal half of the scores),
             3.5 times that forward + backward (the backward's 5 products), as tools/bench.py
             counts. Default shape 16,12,1024,64 (andrea-120m); 64,12,256,32 is andrea-12m's.
A version that does not take the shape asked for is checked at the nearest larger one it
takes, and not timed.

Timing: CUDA events (numba.cuda.event) on the default stream, after warm-up (the first call
compiles) and two seconds of the library's op to bring the clocks up; the median of --repeat
timings. The timings' inputs are not the check's: before a version is timed, its output on
them is checked against the library's float32 result on the same values (within its
tolerance; a version that fails is not timed, and the run exits with status 1). Each timing
covers 5 calls queued behind ~6 ms of other work, so that the GPU runs them back to back and
the host's launch overhead is not counted (what a CUDA-graph replay pays); calls over 20 ms are
timed one at a time. CuPy and torch are imported only to time.

--json writes the run (its device, date, each op's shape and rows); --table prints a run's
results as tools/dev/README.md's table: a version a row, its idea, its ratio to the library
(matmul: the plain product, other orientations beside it; attention: forward + backward where
there is a backward, the forward beside it), the GPU and the date.

Without a GPU (no NVIDIA device, or NUMBA_ENABLE_CUDASIM=1) the kernels run in Numba's CUDA
simulator: the driver then only checks, at tiny sizes (matmul 128,128,32; attention 1,2,40,32),
and says that it did not time.
"""
import argparse
import datetime
import glob
import importlib
import json
import os
import re
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
if "NUMBA_ENABLE_CUDASIM" not in os.environ:   # (as tests/conftest.py: no GPU, the simulator)
    os.environ["NUMBA_ENABLE_CUDASIM"] = "0" if glob.glob("/dev/nvidia[0-9]*") else "1"
os.environ.setdefault("CUPY_TF32", "0")         # (read when CuPy is imported)
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE.parent))           # (tools/: the benchmarks' timing)

import numpy as np  # noqa: E402
from numba import cuda  # noqa: E402

from benchmarks.timing import keep_gpu_busy, median_ms_per_call, warm_up_and_time_one  # noqa: E402
from nanoandrea.kernels.runtime.device import SIMULATOR  # noqa: E402


# --- the versions --------------------------------------------------------------------------

def versions(op):
    """The paths of tools/dev/<op>/v<N>_*.py, in the order of N."""
    found = [(int(m.group(1)), path) for path in (HERE / op).glob("v*.py")
             if (m := re.fullmatch(r"v(\d+)_\w+\.py", path.name))]
    return [path for _, path in sorted(found)]


def load(path):
    """The version at `path`, imported as the module named by its file (v3_register_blocking).
    Its folder goes on sys.path, so that precompile's worker processes import it by that name
    too."""
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    return importlib.import_module(path.stem)


def idea(module):
    """The first line of the version's docstring."""
    return (module.__doc__ or "").strip().split("\n")[0]


def shortened(text, width=64):
    return text if len(text) <= width else text[:width - 3] + "..."


def selected(paths, only):
    """The paths whose stem is, or starts with, one of the comma-separated names (v3 matches
    v3_register_blocking, not v30_...)."""
    if not only:
        return paths
    names = [name.strip() for name in only.split(",") if name.strip()]
    return [p for p in paths if any(p.stem == n or p.stem.startswith(n + "_") for n in names)]


# --- checks --------------------------------------------------------------------------------

def poisoned(shape):
    """A device array full of NaN: an element the version leaves unwritten fails the check."""
    return cuda.to_device(np.full(shape, np.nan, dtype=np.float32))


def relative_error(got, want):
    """||got - want|| / ||want||, infinite where got has a NaN or an infinity."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def gpu_relative_error(got, want):
    """relative_error of two CuPy arrays (or arrays CuPy can view), on the GPU."""
    import cupy
    got, want = cupy.asarray(got, cupy.float64), cupy.asarray(want, cupy.float64)
    if not bool(cupy.all(cupy.isfinite(got))):
        return float("inf")
    return float(cupy.linalg.norm(got - want) / max(float(cupy.linalg.norm(want)), 1e-30))


def random_float32(rng, shape):
    return rng.standard_normal(shape, dtype=np.float32)


class Matmul:
    name, axes, library = "matmul", "M,N,K", "cuBLAS"
    gpu_shape, simulator_shape = (16384, 3072, 768), (128, 128, 32)
    TOLERANCE = 1e-4

    @staticmethod
    def nearest(module, shape):
        """The smallest shape at least `shape` whose M, N, K are multiples of MULTIPLE_OF."""
        multiple = getattr(module, "MULTIPLE_OF", (1, 1, 1))
        return tuple(-(-n // m) * m for n, m in zip(shape, multiple))

    @staticmethod
    def bf16(module):
        """Whether the version multiplies bf16 operands (PRECISION = "bf16": a and b come as
        uint32 arrays of bf16 pairs, nanoandrea/kernels/ptx/mma.py), else float32."""
        return getattr(module, "PRECISION", "fp32") == "bf16"

    @staticmethod
    def tolerance(module):
        """TOLERANCE, bf16 or not: a bf16 version is checked against the product of the bf16
        values, which float32 sums meet to float32's rounding."""
        return Matmul.TOLERANCE

    @staticmethod
    def operands(module, a, b):
        """a, b as the version takes them (host arrays), and their float64 values."""
        if Matmul.bf16(module):
            from nanoandrea.kernels.ptx.mma import bf16_values, pack_bf16
            return (pack_bf16(a), pack_bf16(b),
                    bf16_values(a).astype(np.float64), bf16_values(b).astype(np.float64))
        return a, b, a.astype(np.float64), b.astype(np.float64)

    @staticmethod
    def transposes(module):
        """The (transpose_a, transpose_b) the version takes: TRANSPOSES, else the plain product."""
        return getattr(module, "TRANSPOSES", ((False, False),))

    @staticmethod
    def orientation(transpose_a, transpose_b):
        """A product's name in the report: "" for a @ b, "a^T", "b^T" or "a^T b^T"."""
        return " ".join(name for name, t in (("a^T", transpose_a), ("b^T", transpose_b)) if t)

    @staticmethod
    def stored_shapes(shape, transpose_a, transpose_b):
        """The shapes a and b are stored in: a [M,K] or, transposed, [K,M]; b [K,N] or [N,K]."""
        M, N, K = shape
        return (K, M) if transpose_a else (M, K), (N, K) if transpose_b else (K, N)

    @staticmethod
    def product(module, out, a, b, transpose_a, transpose_b):
        """module.matmul, given the transposes only where the version takes some."""
        if hasattr(module, "TRANSPOSES"):
            module.matmul(out, a, b, transpose_a=transpose_a, transpose_b=transpose_b)
        else:
            module.matmul(out, a, b)

    @staticmethod
    def check(module, shape, rng):
        """{output: relative error} of module.matmul against float64 NumPy, fresh inputs (for
        a bf16 version, the product of the bf16 values: the sums are float32 either way), in
        each orientation it takes."""
        errors = {}
        for ta, tb in Matmul.transposes(module):
            a_shape, b_shape = Matmul.stored_shapes(shape, ta, tb)
            a, b, a64, b64 = Matmul.operands(module, random_float32(rng, a_shape),
                                             random_float32(rng, b_shape))
            out = poisoned(shape[:2])
            Matmul.product(module, out, cuda.to_device(a), cuda.to_device(b), ta, tb)
            want = (a64.T if ta else a64) @ (b64.T if tb else b64)
            name = " ".join(filter(None, ["out", Matmul.orientation(ta, tb)]))
            errors[name] = relative_error(out.copy_to_host(), want)
        return errors

    @staticmethod
    def call(module, shape):
        """module.matmul once in each orientation, on arrays of `shape` (what it launches, for
        precompile_all)."""
        for ta, tb in Matmul.transposes(module):
            a_shape, b_shape = Matmul.stored_shapes(shape, ta, tb)
            if Matmul.bf16(module):
                a, b = (cuda.device_array((r, c // 2), np.uint32) for r, c in (a_shape, b_shape))
            else:
                a, b = (cuda.device_array(s, np.float32) for s in (a_shape, b_shape))
            Matmul.product(module, cuda.device_array(shape[:2], np.float32), a, b, ta, tb)

    @staticmethod
    def flops(shape):
        M, N, K = shape
        return 2.0 * M * N * K

    @staticmethod
    def timings(shape, modules):
        """(library's name, [(pass, fn)] for the library, {version: [(pass, fn, flops)]}): one
        set of inputs, shared by all, in CuPy's memory (Numba views of it for the versions);
        bf16 versions ("bf16" pass) beside cuBLAS in bf16 (torch.matmul, bf16 out)."""
        import cupy
        M, N, K = shape
        rng = cupy.random.default_rng(0)
        a, b = (rng.standard_normal(s, dtype=cupy.float32) for s in ((M, K), (K, N)))
        c = cupy.empty((M, N), dtype=cupy.float32)
        A, B, C = (cuda.as_cuda_array(x) for x in (a, b, c))
        work = Matmul.flops(shape)
        library = [("", lambda: cupy.matmul(a, b, out=c), work)]
        want = {"": cupy.matmul(a, b)}          # (float32 sums, TF32 off)

        def error(label):                       # (of the version's last output, in c)
            return gpu_relative_error(c, want[label])
        ours, bf16_operands = {}, {}
        for name, module in modules.items():
            if not Matmul.bf16(module):
                ours[name] = [("", lambda m=module: m.matmul(C, A, B), work,
                               lambda: error(""))]
                continue
            import torch
            from nanoandrea.kernels.ptx.mma import pack_bf16
            ours[name] = []
            for ta, tb in Matmul.transposes(module):
                label = " ".join(filter(None, ["bf16", Matmul.orientation(ta, tb)]))
                if label not in bf16_operands:  # (each orientation's operands and cuBLAS, once)
                    stored = [x.T.copy() if t else x for x, t in ((a, ta), (b, tb))]
                    packed = [cuda.to_device(pack_bf16(x.get())) for x in stored]
                    ta_, tb_ = (torch.as_tensor(x, device="cuda").bfloat16() for x in stored)
                    ta_, tb_ = (ta_.T if ta else ta_), (tb_.T if tb else tb_)
                    library.append((label, lambda x=ta_, y=tb_: torch.matmul(x, y), work))
                    bf16_operands[label] = packed
                    want[label] = cupy.asarray(torch.matmul(ta_.float(), tb_.float()))
                ours[name].append((label, lambda m=module, p=bf16_operands[label], ta=ta, tb=tb:
                                   Matmul.product(m, C, *p, ta, tb), work,
                                   lambda label=label: error(label)))
        return ("cuBLAS (cupy.matmul in float32, TF32 off; torch.matmul in bf16)", library,
                ours)


class Attention:
    name, axes, library = "attention", "B,H,T,D", "SDPA"
    gpu_shape, simulator_shape = (16, 12, 1024, 64), (1, 2, 40, 32)
    TOLERANCE = 1e-4
    BF16_TOLERANCE = 2e-2       # (tools/bench.py's for the package's bf16 attention)

    @staticmethod
    def bf16(module):
        """Whether the version multiplies in bf16 (PRECISION = "bf16"), else float32."""
        return getattr(module, "PRECISION", "fp32") == "bf16"

    @staticmethod
    def tolerance(module):
        """TOLERANCE, or BF16_TOLERANCE for a bf16 version: its reference has q, k, v, dout
        rounded as the version rounds them, but not P and dS, which the version rounds to bf16
        before its second products (~2^-9 relative each)."""
        return Attention.BF16_TOLERANCE if Attention.bf16(module) else Attention.TOLERANCE

    @staticmethod
    def nearest(module, shape):
        """`shape`, with D the nearest head size the version takes (the next larger, else
        the largest)."""
        sizes = getattr(module, "HEAD_SIZES", None)
        B, H, T, D = shape
        if sizes is None or D in sizes:
            return shape
        larger = [d for d in sizes if d >= D]
        return (B, H, T, min(larger) if larger else max(sizes))

    @staticmethod
    def reference(q, k, v, dout):
        """out, lse, dq, dk, dv of causal attention in float64: the math of
        nanoandrea/kernels/attention/reference.py's NumPy twins, copied (no dropout)."""
        T, D = q.shape[-2:]
        scale = 1.0 / np.sqrt(D)

        def transposed(x):
            return np.swapaxes(x, -1, -2)

        scores = np.where(np.tril(np.ones((T, T), dtype=bool)), q @ transposed(k) * scale,
                          -np.inf)
        top = scores.max(axis=-1, keepdims=True)
        lse = (top + np.log(np.exp(scores - top).sum(axis=-1, keepdims=True)))[..., 0]
        p = np.exp(scores - lse[..., None])
        out = p @ v
        delta = (dout * out).sum(axis=-1)                       # = sum_j P_ij dP_ij
        ds = p * (dout @ transposed(v) - delta[..., None]) * scale
        return dict(out=out, lse=lse, dq=ds @ k, dk=transposed(ds) @ q, dv=transposed(p) @ dout)

    @staticmethod
    def check(module, shape, rng):
        """{output: relative error} of forward (and backward) against float64 NumPy, of the
        inputs rounded to bf16 for a bf16 version (it takes them float32 all the same)."""
        B, H, T, D = shape
        q, k, v, dout = (random_float32(rng, shape) for _ in range(4))
        Q, K, V, DOUT = (cuda.to_device(x) for x in (q, k, v, dout))
        if Attention.bf16(module):
            from nanoandrea.kernels.ptx.mma import bf16_values
            q, k, v, dout = (bf16_values(x) for x in (q, k, v, dout))
        got = dict(out=poisoned(shape), lse=poisoned((B, H, T)))
        module.forward(got["out"], got["lse"], Q, K, V)
        backward = getattr(module, "backward", None)
        if backward is not None:
            got.update(dq=poisoned(shape), dk=poisoned(shape), dv=poisoned(shape))
            backward(got["dq"], got["dk"], got["dv"], DOUT, Q, K, V, got["out"], got["lse"])
        got = {name: array.copy_to_host() for name, array in got.items()}
        # one batch element at a time (its scores are H x T x T float64s): the squared norms
        # of the differences and of the reference, summed over the batch
        sums = {name: [0.0, 0.0] for name in got}
        for b in range(B):
            want = Attention.reference(*(x[b].astype(np.float64) for x in (q, k, v, dout)))
            for name, value in got.items():
                finite = np.all(np.isfinite(value[b]))
                sums[name][0] += (float(np.sum((value[b] - want[name]) ** 2)) if finite
                                  else float("inf"))
                sums[name][1] += float(np.sum(want[name] ** 2))
        return {name: float(np.sqrt(d / max(w, 1e-60))) for name, (d, w) in sums.items()}

    @staticmethod
    def call(module, shape):
        """forward (and backward) once, on arrays of `shape` (what they launch)."""
        B, H, T, D = shape
        q, k, v, out, dout, dq, dk, dv = (cuda.device_array(shape, np.float32) for _ in range(8))
        lse = cuda.device_array((B, H, T), np.float32)
        module.forward(out, lse, q, k, v)
        if getattr(module, "backward", None) is not None:
            module.backward(dq, dk, dv, dout, q, k, v, out, lse)

    @staticmethod
    def flops(shape):
        B, H, T, D = shape
        return 4.0 * B * H * T * T * D / 2

    @staticmethod
    def timings(shape, modules):
        import cupy
        import torch
        import torch.nn.functional as F
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        B, H, T, D = shape
        generator = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, dout = (torch.randn(shape, device="cuda", generator=generator)
                         for _ in range(4))
        qs, ks, vs = (t.clone().requires_grad_(True) for t in (q, k, v))
        Q, K, V, DOUT = (cuda.as_cuda_array(t) for t in (q, k, v, dout))
        out, lse = cuda.device_array(shape, np.float32), cuda.device_array((B, H, T), np.float32)
        dq, dk, dv = (cuda.device_array(shape, np.float32) for _ in range(3))
        work = Attention.flops(shape)

        def sdpa(q, k, v, dout, leaves):
            def forward():
                with torch.no_grad():
                    F.scaled_dot_product_attention(q, k, v, is_causal=True)

            def both():                         # (autograd.grad: nothing accumulates)
                y = F.scaled_dot_product_attention(*leaves, is_causal=True)
                torch.autograd.grad(y, leaves, dout)
            return forward, both

        library = list(zip(("fwd", "fwd+bwd"), sdpa(q, k, v, dout, (qs, ks, vs)),
                           (work, 3.5 * work)))
        want = {}                               # (float32 SDPA of the inputs, as taken)

        def wanted(bf16):
            if bf16 not in want:
                inputs = [t.bfloat16().float() if bf16 else t for t in (q, k, v, dout)]
                leaves = tuple(t.clone().requires_grad_(True) for t in inputs[:3])
                y = F.scaled_dot_product_attention(*leaves, is_causal=True)
                want[bf16] = [y.detach(), *torch.autograd.grad(y, leaves, inputs[3])]
            return want[bf16]

        def error(bf16, arrays):                # (the worst of the version's last outputs)
            return max(gpu_relative_error(cupy.asarray(x), cupy.asarray(w))
                       for x, w in zip(arrays, wanted(bf16)))
        ours = {}
        for name, module in modules.items():
            bf16 = Attention.bf16(module)
            if bf16 and len(library) == 2:      # (SDPA on bf16 copies, once)
                copies = [t.bfloat16() for t in (q, k, v, dout)]
                leaves = tuple(t.clone().requires_grad_(True) for t in copies[:3])
                library += zip(("bf16 fwd", "bf16 fwd+bwd"), sdpa(*copies, leaves),
                               (work, 3.5 * work))

            def forward(m=module):
                m.forward(out, lse, Q, K, V)

            prefix = "bf16 " if bf16 else ""
            cases = [(prefix + "fwd", forward, work, lambda bf16=bf16: error(bf16, [out]))]
            if getattr(module, "backward", None) is not None:
                def both(m=module, forward=forward):
                    forward()
                    m.backward(dq, dk, dv, DOUT, Q, K, V, out, lse)
                cases.append((prefix + "fwd+bwd", both, 3.5 * work,
                              lambda bf16=bf16: error(bf16, [out, dq, dk, dv])))
            ours[name] = cases
        return ("SDPA (torch, float32, TF32 off; bf16 passes on bf16 tensors)", library, ours)


OPS = {"matmul": Matmul, "attention": Attention}


def precompile_all(op, paths, shape):
    """Compile every version's kernels at once, in parallel processes (nanoandrea/precompile.py)
    rather than one after another as each is first called: each version is run with every
    launch recorded and none made, on inputs of the shape it is checked at."""
    from nanoandrea.precompile import compile_kernels, kernels_of
    needed = set()
    for path in paths:
        try:
            module = load(path)
            checked = op.nearest(module, shape)
            needed |= kernels_of(lambda: op.call(module, checked))
        except Exception:               # (check_all reports it)
            continue
    compile_kernels(needed)


# --- timing --------------------------------------------------------------------------------

def gpu_ms(fn, repeat=10, calls=5):
    """Median milliseconds of one fn() on the GPU (see the module's doc): `calls` calls between
    two CUDA events (one, for a call over 20 ms), each timing behind ~6 ms of matrix products
    that keep the GPU busy while the timed calls queue, so that a launcher's host time (more
    than a fast kernel's GPU time) is not what is timed. The timing itself is tools/bench.py's."""
    if warm_up_and_time_one(fn, warmup=1) > 0.02:       # (the first call compiles)
        calls = 1
    return median_ms_per_call(fn, calls, repeat, before=lambda: keep_gpu_busy(6))


def warm_up(fn, seconds=2.0):
    """Keep the GPU busy for a moment: an idle GPU runs at low clocks and ramps up under load."""
    began = time.perf_counter()
    while time.perf_counter() - began < seconds:
        for _ in range(5):
            fn()
        cuda.synchronize()


# --- the run -------------------------------------------------------------------------------

def parse_shape(text, op):
    shape = tuple(int(n) for n in re.split(r"[,x]", text))
    if len(shape) != len(op.axes.split(",")) or min(shape) < 1:
        raise SystemExit(f"--shape: {op.axes} for {op.name}, got {text!r}")
    return shape


def device_name():
    if SIMULATOR:
        return "Numba's CUDA simulator"
    name = cuda.get_current_device().name
    return name.decode() if isinstance(name, bytes) else name


def check_all(op, paths, shape, rng):
    """Import and check each version. Returns (rows, {stem: module} of those that passed and
    take `shape` itself)."""
    rows, timable = [], {}
    for path in paths:
        row = dict(version=path.stem, idea="", checked_shape=None, errors={}, ok=False, note="")
        rows.append(row)
        try:
            module = load(path)
            row["idea"] = idea(module)
            checked = op.nearest(module, shape)
            row["checked_shape"] = list(checked)
            began = time.perf_counter()
            row["errors"] = op.check(module, checked, rng)
            row["first_call_s"] = round(time.perf_counter() - began, 1)
        except Exception as error:
            traceback.print_exc()
            row["note"] = f"FAILED: {type(error).__name__}: {error}"
            print(f"{path.stem}: {row['note']}", flush=True)
            continue
        worst = max(row["errors"].values())
        tolerance = op.tolerance(module)
        row["ok"] = worst < tolerance
        errors = ", ".join(f"{name} {e:.1e}" for name, e in row["errors"].items())
        at = "x".join(map(str, checked))
        if not row["ok"]:
            row["note"] = f"FAILED: relative error over {tolerance:.0e} ({errors})"
        elif tuple(checked) != tuple(shape):
            row["note"] = f"checked at {at} (the shape it takes), not timed"
        else:
            timable[path.stem] = module
        print(f"{path.stem}: {'ok' if row['ok'] else 'MISMATCH'} at {at} ({errors}; "
              f"{row['first_call_s']} s with the compile)", flush=True)
    return rows, timable


def time_all(op, shape, modules, rows, repeat):
    """Time the library and every version in `modules`; one table row per (version, pass),
    the library's last. Returns the rows, the library's included."""
    library_name, library_cases, ours = op.timings(shape, modules)
    warm_up(library_cases[0][1])
    library = {name: gpu_ms(fn, repeat) for name, fn, _ in library_cases}
    timed = []
    for row in rows:
        for name, fn, work, error_of_last in ours.get(row["version"], []):
            fn()                                # (on the timing's inputs: checked first)
            cuda.synchronize()
            error = error_of_last()
            if not error < op.tolerance(modules[row["version"]]):
                note = f"FAILED on the timing's inputs: relative error {error:.1e}, not timed"
                print(f"{row['version']} {name}: {note}", flush=True)
                timed.append(dict(row, ok=False, note=note,
                                  **{"pass": name, "ms": None, "tflops": None, "ratio": None}))
                continue
            ms = gpu_ms(fn, repeat)
            timed.append(dict(row, **{"pass": name, "ms": ms, "tflops": work / ms / 1e9,
                                      "ratio": library[name] / ms}))
            print(f"{row['version']} {name}: {ms:.3f} ms", flush=True)
        if row["version"] not in ours:
            timed.append(dict(row, **{"pass": "", "ms": None, "tflops": None, "ratio": None}))
    again = gpu_ms(library_cases[0][1], repeat)         # did the clocks drift meanwhile?
    drift = again / library[library_cases[0][0]] - 1
    for name, fn, work in library_cases:
        timed.append(dict(version=op.library, idea=library_name, errors={}, ok=True,
                          note=f"{drift:+.1%} when timed again last" if name ==
                          library_cases[0][0] and abs(drift) > 0.02 else "",
                          **{"pass": name, "ms": library[name],
                             "tflops": work / library[name] / 1e9, "ratio": 1.0}))
    return timed


def print_table(op, rows, title):
    passes = any(row.get("pass") for row in rows)
    print(f"\n{title}")
    header = (f"{'version':26s} {'idea':64s} " + (f"{'pass':12s} " if passes else "")
              + f"{'error':>8s} {'ms':>9s} {'TFLOP/s':>8s} {'vs ' + op.library:>10s}")
    print(header)
    print("-" * len(header))
    for row in rows:
        error = f"{max(row['errors'].values()):.1e}" if row["errors"] else ""
        ms = row.get("ms")
        timing = (f"{ms:9.3f} {row['tflops']:8.2f} {row['ratio']:9.2f}x" if ms is not None
                  else f"{'-':>9s} {'-':>8s} {'-':>10s}")
        print(f"{row['version']:26s} {shortened(row['idea']):64s} "
              + (f"{row.get('pass', ''):12s} " if passes else "") + f"{error:>8s} {timing}"
              + (f"  {row['note']}" if row.get("note") else ""))


# --- the results table (tools/dev/README.md) -----------------------------------------------

def ratio_text(op_name, passes):
    """One version's timed passes [(pass, ratio)] as the table says them: matmul "0.80x cuBLAS
    bf16 (b^T 0.79x, a^T 0.78x)", attention "fwd+bwd 0.99x SDPA float32 (fwd 1.03x)"."""
    ratios = dict(passes)
    bf16 = any(name.startswith("bf16") for name in ratios)
    library = f"{OPS[op_name].library} {'bf16' if bf16 else 'float32'}"
    ratios = {name.removeprefix("bf16").strip(): ratio for name, ratio in ratios.items()}
    main = ("" if op_name == "matmul" else "fwd+bwd" if "fwd+bwd" in ratios else "fwd")
    others = ", ".join(f"{name} {ratio:.2f}x" for name, ratio in ratios.items() if name != main)
    return (f"{main} " if main else "") + f"{ratios[main]:.2f}x {library}" + (
        f" ({others})" if others else "")


def markdown_table(results):
    """A run's results (main's --json) as markdown lines: a caption, then one table, a row a
    version of each op: version, idea, ratio to cuBLAS or SDPA, GPU, date."""
    shapes = ", ".join(f"{name} at {'x'.join(map(str, op['shape']))}"
                       for name, op in results["ops"].items())
    lines = [f"{shapes}; ratio = the library's time / the version's (above 1: faster).", "",
             "| version | idea | ratio to cuBLAS or SDPA | GPU | date |",
             "|---|---|---|---|---|"]
    for name, op in results["ops"].items():
        versions = {}                   # version -> (idea, [(pass, ratio)], note)
        for row in op["rows"]:
            if row["version"] == OPS[name].library:
                continue
            idea_text, passes, note = versions.setdefault(row["version"],
                                                          (row["idea"], [], row.get("note")))
            if row.get("ratio") is not None:
                passes.append((row.get("pass", ""), row["ratio"]))
        for version, (idea_text, passes, note) in versions.items():
            ratio = (ratio_text(name, passes) if passes else
                     "not timed" + (f": {note}" if note else ""))
            lines.append(f"| {name} {version} | {idea_text.replace('|', '/')} | {ratio} | "
                         f"{results['device']} | {results['date']} |")
    return lines


# --- the run ---------------------------------------------------------------------------------

def run_op(op, shape, only, repeat):
    """Check (and on a GPU time) the versions of one op: (rows, the shape, whether any
    failed)."""
    paths = selected(versions(op.name), only)
    print(f"{op.name} at {'x'.join(map(str, shape))} ({op.axes}), float32, on {device_name()}: "
          f"{len(paths)} version(s) in tools/dev/{op.name}/", flush=True)
    if not SIMULATOR:
        precompile_all(op, paths, shape)
    rows, timable = check_all(op, paths, shape, np.random.default_rng(0))
    if SIMULATOR:
        title = "Checked in Numba's CUDA simulator, not timed (timings need a GPU)."
    else:
        rows = time_all(op, shape, timable, rows, repeat)
        title = (f"{op.name} {'x'.join(map(str, shape))} on {device_name()}, "
                 f"{datetime.date.today()}: ratio = {op.library} ms / version ms")
    print_table(op, rows, title)
    if not paths:
        print(f"(no versions found in tools/dev/{op.name}/)")
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("ops", nargs="*", metavar="op", help="matmul, attention (default both)")
    parser.add_argument("--shape", help="matmul M,N,K; attention B,H,T,D (one op; default: the "
                        "op's GPU shape, or its tiny one in the simulator)")
    parser.add_argument("--only", default="", help="comma-separated versions: v3,v4")
    parser.add_argument("--repeat", type=int, default=10, help="timings a median is taken of")
    parser.add_argument("--json", help="also write the run's results to this file")
    parser.add_argument("--table", metavar="JSON", help="print the markdown table of a run's "
                        "--json results, and run nothing")
    args = parser.parse_args(argv)
    if args.table:
        print("\n".join(markdown_table(json.loads(Path(args.table).read_text()))))
        return
    unknown = [name for name in args.ops if name not in OPS]
    if unknown:
        parser.error(f"no op {', '.join(unknown)}: one of {', '.join(OPS)}")
    names = args.ops or list(OPS)
    if args.shape and len(names) != 1:
        parser.error("--shape: name one op")
    results = dict(device=device_name(), date=str(datetime.date.today()), timed=not SIMULATOR,
                   ops={})
    failed = []
    for name in names:
        op = OPS[name]
        shape = (parse_shape(args.shape, op) if args.shape else
                 op.simulator_shape if SIMULATOR else op.gpu_shape)
        rows = run_op(op, shape, args.only, args.repeat)
        results["ops"][name] = dict(shape=list(shape), library=op.library, rows=rows)
        failed += [f"{name} {row['version']}" for row in rows if not row["ok"]]
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    if failed:
        print(f"\nFAILED: {', '.join(failed)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
