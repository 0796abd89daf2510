"""Session 12, runs 5-6: where the row classes' dW went (run on the H200 against 20de0b9,
whose matmul.row_class_matmul still copied through pad.copy_corner on strided views; the
functions it calls have changed since, so it reproduces that tree only). Two scripts, one a
device call, joined here with their setup shared; their output is diagnosis-run5.log.
    PYTHONPATH=$PWD python3 docs/runs/2026-11-30-issue4-v14/diagnosis-run5.py
"""
import time

import cupy
import numpy as np
from numba import cuda

from nanoandrea.kernels import matmul as mm
from nanoandrea.kernels.launch import elementwise_grid, launch


M, N, K = 768, 50257, 16384


def operands():
    """X [K, M] and dY [K, N] as CuPy arrays and as Numba views of them (the bench's way)."""
    rng = cupy.random.default_rng(0)
    x = rng.standard_normal((K, M), dtype=cupy.float32)
    dy = rng.standard_normal((K, N), dtype=cupy.float32)
    return x, dy, cuda.as_cuda_array(x), cuda.as_cuda_array(dy)


def timed(fn, n=3):
    """(GPU ms a call between two events, host ms a call) of n calls after one."""
    fn()
    cuda.synchronize()
    e0, e1 = cuda.event(), cuda.event()
    e0.record()
    s = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - s) / n * 1e3
    e1.record()
    e1.synchronize()
    return cuda.event_elapsed_time(e0, e1) / n, host


def part_1():
    """One class's dW product on strided views and on contiguous copies of the same rows."""
    x, dy, X, DY = operands()
    first, count = mm.aligned_window(DY, 1)
    P = cuda.device_array((1, M, count), np.float32)
    a_v, b_v = X[1::4], DY[1::4, first:first + count]
    a_c = cuda.as_cuda_array(cupy.ascontiguousarray(x[1::4]))
    b_c = cuda.as_cuda_array(cupy.ascontiguousarray(dy[1::4, first:first + count]))
    for name, a, b in (("contiguous copies", a_c, b_c), ("views", a_v, b_v),
                       ("view a, copy b", a_v, b_c), ("copy a, view b", a_c, b_v)):
        for tiles in (None, dict(blocks_per_sm=2)):
            ms, _ = timed(lambda: mm._blocked_view_product(P, a, b, True, False, None, tiles))
            print(f"{name:20s} {tiles} {ms:.3f} ms")


def part_2():
    """The whole row-class dW, and each of its parts, GPU (events) and host time a call."""
    _, _, X, DY = operands()

    def t(fn):
        return "gpu {:.3f} ms, host {:.3f} ms".format(*timed(fn))
    out = cuda.device_array((M, N), np.float32)
    print("full row classes dW", t(lambda: mm.matmul(out, X, DY, transpose_a=True,
                                                     pad_unaligned="row classes")))
    windows = [mm.aligned_window(DY, j) for j in range(4)]
    lo = max(f for f, _ in windows)
    hi = min(f + c for f, c in windows)
    parts = [cuda.device_array((M, c), np.float32) for _, c in windows]
    shifts = [lo - f for f, _ in windows]
    print("sum_windows", t(lambda: launch(mm.sum_windows_kernel, *elementwise_grid(M * (hi - lo)),
                                          out[:, lo:hi], *parts, *shifts, False)))
    edges = cuda.device_array((M, 8), np.float32)
    print("edge columns copy", t(lambda: mm._edge_columns(DY, lo, hi)))
    E = mm._edge_columns(DY, lo, hi)
    print("edge product", t(lambda: mm.matmul(edges, X, E, transpose_a=True, kernel="blocked",
                                              pad_unaligned=False)))
    print("one class product", t(lambda: mm._blocked_view_product(
        parts[1].reshape(1, M, windows[1][1]), X[1::4], DY[1::4, windows[1][0]:sum(windows[1])],
        True, False, None, None)))


if __name__ == "__main__":
    part_1()
    part_2()
