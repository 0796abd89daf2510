"""Run 1 (session 16): where the LM head's products at V = 50257 spend their time, and how the
timing method sees them.

Two timings of each call, both CUDA events around one call (median of 7):
- "as bench": bench.event_time_ms, which for calls over 20 ms times one call with nothing
  queued before it, so the host time before its first kernel starts (checks, views,
  allocations: Python) is inside the timing;
- "queued": the same after ~6 ms of other work queued (bench.keep_gpu_busy), so the call's
  launches queue behind it and the timing is the GPU's time alone (what a graph replay pays).
Also the host time of one call (its launches returning, the GPU busy), and the parts of the
row classes' weight gradient alone. Every product is checked against cuBLAS before timing."""
import sys
import time
import cupy
import numpy as np
from numba import cuda
sys.path.insert(0, "tools")
import bench
from nanoandrea.kernels import matmul as mm
from nanoandrea.kernels.launch import blocks, launch

REPEAT = 7
bench.warm_up_clocks()
V, C, R = 50257, 768, 16384
rng = cupy.random.default_rng(0)
x = rng.standard_normal((R, C), dtype=cupy.float32)
dy = rng.standard_normal((R, V), dtype=cupy.float32)
w = rng.standard_normal((C, V), dtype=cupy.float32)
X, DY, W = cuda.as_cuda_array(x), cuda.as_cuda_array(dy), cuda.as_cuda_array(w)
dw = cuda.device_array((C, V), np.float32)
logits = cuda.device_array((R, V), np.float32)


def as_bench(fn):
    return bench.event_time_ms(fn, repeat=REPEAT, calls=bench.KERNEL_CALLS)


def queued(fn):
    return bench.median_ms_per_call(fn, 1, REPEAT, lambda: bench.keep_gpu_busy(6))


def host_ms(fn):
    bench.keep_gpu_busy(30)
    began = time.perf_counter()
    fn()
    took = time.perf_counter() - began
    cuda.synchronize()
    return 1e3 * took


def checked(name, out, fn, want):
    cupy.asarray(out).fill(cupy.nan)
    fn()
    cuda.synchronize()
    error = bench.relative_error(cupy.asarray(out).get(), want)
    bench.require(error, 1e-5, name)
    return error


def compare(name, out, ours, theirs, want):
    error = checked(name, out, ours, want)
    for method, timing in (("queued", queued), ("as bench", as_bench)):
        t, o = timing(theirs), timing(ours)
        print(f"{name:38s} {method:9s} {o:8.3f} ms, cuBLAS {t:8.3f} ms, {t / o:.3f}x"
              f"  (host {host_ms(ours):.2f} ms, err {error:.1e})", flush=True)


want_dw = (x.T @ dy).get()
dw_cublas = lambda: x.T @ dy            # noqa: E731
for round_ in range(2):
    print(f"-- round {round_ + 1}: dW = X^T . dY [{C} x {V} x {R}]", flush=True)
    for name, pads in (("dW row classes (default)", None), ("dW 4-byte spread b, one pass", False),
                       ("dW padded copies", True)):
        compare(name, dw, lambda: mm.matmul(dw, X, DY, transpose_a=True, pad_unaligned=pads),
                dw_cublas, want_dw)

# the row classes' dW in its parts, as row_class_matmul launches them
fast = mm._blocked_kernel(True, False, (True, True, True)).classes
BM, BN, _ = fast.tile
first, step, count = mm.class_window(DY)
partials = cuda.device_array((C, 4 * count), np.float32)
A4, B4 = mm.as_classes(X), mm.as_classes(DY)
lo, hi = first + 3 * step, first + count


def class_product():
    launch(fast, (blocks(count, BN), blocks(C, BM), 4), fast.threads, partials.reshape(1, C, 4 * count),
           A4, B4, C, count, R // 4, False, (0, C), (0, 0), (first, V + step), (0, count))


def window_sum():
    launch(mm.sum_windows_kernel, *mm.rows_grid(C, hi - lo), dw, partials, first, step, count, lo, hi,
           False)


edge_columns = cuda.device_array((R, 2 * mm.EDGE), np.float32)
edges = cuda.device_array((C, 2 * mm.EDGE), np.float32)


def edge_pass():
    launch(mm.gather_edges_kernel, *mm.rows_grid(R, 2 * mm.EDGE), edge_columns, DY, lo, hi)
    mm.matmul(edges, X, edge_columns, transpose_a=True, kernel="blocked", pad_unaligned=False)
    launch(mm.scatter_edges_kernel, *mm.rows_grid(C, 2 * mm.EDGE), dw, edges, lo, 0, hi - lo, hi,
           False)


cupy.asarray(dw).fill(cupy.nan)
class_product(), window_sum(), edge_pass()
cuda.synchronize()
bench.require(bench.relative_error(cupy.asarray(dw).get(), want_dw), 1e-5, "dW by parts")
print(f"-- dW row classes by parts (window {first}+{step}j, {count} wide; edges [0,{lo}) [{hi},{V}))")
for name, fn in (("class product (one launch)", class_product), ("sum of the 4 partials", window_sum),
                 ("edge columns (3 launches)", edge_pass)):
    print(f"{name:38s} queued {queued(fn):8.3f} ms (host {host_ms(fn):.2f} ms)", flush=True)

# the plain TN kernel at an aligned width (dY's rows padded to 50260), and cuBLAS there
Vp = 50260
dyp = cupy.zeros((R, Vp), cupy.float32)
dyp[:, :V] = dy
dwp = cuda.device_array((C, Vp), np.float32)
DYP = cuda.as_cuda_array(dyp)
compare("dW plain kernel at V=50260", dwp, lambda: mm.matmul(dwp, X, DYP, transpose_a=True),
        lambda: x.T @ dyp, (x.T @ dyp).get())


# the forward, logits = X . W
want_logits = (x @ w).get()
print(f"-- forward logits = X . W [{R} x {V} x {C}]", flush=True)
for name, pads in (("fwd row classes (default)", None), ("fwd 4-byte spread b, one pass", False)):
    compare(name, logits, lambda: mm.matmul(logits, X, W, pad_unaligned=pads), lambda: x @ w,
            want_logits)
