"""What every benchmark section shares: timing with CUDA events, the report's rows, the checks
that stop a benchmark on a wrong answer, and each kernel's GPU time through the profiler.

Timing: the median of repeated runs between two CUDA events on the default stream, after
warm-up. A kernel's timing covers several back-to-back calls queued behind ~6 ms of other
work (event_time_ms), so that what is measured is its GPU time, not the host's launch.
"""
import re
import statistics
import time

import numpy as np
from numba import cuda

RESULTS = []          # the rows of the final table (row()), written by --json


class Mismatch(Exception):
    """An output that does not match its reference: the benchmark stops with exit status 1."""


def device_name():
    name = cuda.get_current_device().name
    return name.decode() if isinstance(name, bytes) else name


def event_time_ms(fn, warmup=3, repeat=10, calls=1):
    """Median milliseconds of one fn() between two CUDA events on the default stream.

    calls > 1: each timing covers `calls` back-to-back calls (and is divided by calls), queued
    while the GPU is still busy with ~6 ms of other work. The GPU then runs them without
    waiting for Python between launches (a Numba launch costs ~30 us of host time, a launcher
    that checks shapes more, which for small kernels is more than their GPU time): this
    measures the kernels' GPU time, which is what a CUDA-graph replay pays. Both sides of a
    comparison are timed the same way.
    A call over 20 ms is timed alone (calls = 1), still behind the ~6 ms of other work: its
    launches too then queue while the GPU is busy, so the timing starts with its first kernel,
    not with the host's work before it."""
    if warm_up_and_time_one(fn, warmup) > 0.02:
        calls = 1           # a slow kernel (the LM head, the reference ones): one a timing
    return median_ms_per_call(fn, calls, repeat, lambda: keep_gpu_busy(6))


def warm_up_and_time_one(fn, warmup):
    """Run fn `warmup` times, then once more alone: the seconds that one took, host waits
    included."""
    for _ in range(warmup):
        fn()
    cuda.synchronize()
    began = time.perf_counter()
    fn()
    cuda.synchronize()
    return time.perf_counter() - began


def median_ms_per_call(fn, calls, repeat, before=None):
    """`repeat` times: before(), then `calls` calls of fn between two CUDA events; the median
    of the milliseconds per call."""
    times = []
    for _ in range(repeat):
        if before is not None:
            before()
        start, end = cuda.event(), cuda.event()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(cuda.event_elapsed_time(start, end) / calls)
    return statistics.median(times)


KERNEL_CALLS = 5        # back-to-back calls per timing of one kernel (see event_time_ms)


def kernel_ms(fn, args):
    """GPU milliseconds of one call of a kernel (or a competitor's op), median of args.repeat."""
    return event_time_ms(fn, repeat=args.repeat, calls=KERNEL_CALLS)


def warm_up_clocks(seconds=2.0):
    """Keep the GPU busy for a moment first: an idle GPU runs at low clocks and ramps up under
    load: without this the first shapes timed could pay for the ramp-up."""
    import cupy
    x = cupy.ones((4096, 4096), cupy.float32)
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        for _ in range(10):
            x @ x
        cupy.cuda.Device().synchronize()


def keep_gpu_busy(ms):
    """Queue about `ms` milliseconds of matrix products on the default stream, without waiting."""
    import cupy
    x = cupy.ones((4096, 4096), cupy.float32)
    for _ in range(max(1, int(ms / 3))):        # ~3 ms each (137 GFLOP at ~45 TFLOP/s)
        x @ x


def row(section, name, ms, work, unit, baseline_ms=None, baseline="", note="", **fields):
    """One row of the report, printed now and kept in RESULTS. work / ms / 1e9 is the rate in
    T{unit}/s (None: no rate); the ratio is baseline_ms / ms (above 1: ours is faster).
    fields: anything more a section keeps in its rows (the hardware plot's head sizes)."""
    rate = work / ms / 1e9 if work else None
    entry = dict(section=section, name=name, ms=ms, rate=rate, unit=unit,
                 baseline=baseline, baseline_ms=baseline_ms,
                 ratio=(baseline_ms / ms) if baseline_ms else None, note=note, **fields)
    RESULTS.append(entry)
    ratio = f"{entry['ratio']:.2f}x {baseline}" if entry["ratio"] else ""
    rate_text = f"{rate:8.2f} {unit}" if rate else ""
    print(f"  {name:44s} {ms:9.3f} ms {rate_text:>16s}  {ratio} {note}", flush=True)


def relative_error(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def require(error, limit, what):
    if not (error < limit):
        raise Mismatch(f"{what}: relative error {error:.2e} exceeds {limit:.0e}")


# --- each kernel's GPU time -------------------------------------------------------------------

def kernel_name(name):
    """A readable kernel name: Numba's arrive demangled as nanoandrea::kernels::matmul::wgmma::
    wgmma_matmul_kernel::_3clocals_3e::kernel[abi:v12][abi:cw51c...](...); keep the module path
    from the family on, and the factory that made a closure kernel."""
    if "nanoandrea::" not in name:
        return name[:60]
    name = re.sub(r"\[abi:[^]]*\]", "", name.split("(")[0]).replace("::_3clocals_3e", "")
    return ".".join(name.split("::")[2:])


def kernel_times(fn, calls):
    """{kernel: (launches a call, ms a call)} of fn's GPU kernels, recorded by the CUDA
    profiling interface (through torch.profiler: it sees every kernel of the process, Numba's
    too), fn run 3 times first. Launches a call is the count over the `calls` calls divided
    by calls, a fraction where a kernel runs less than once a call (a workspace's memset,
    something done every few steps): never rounded down to none."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(3):
        fn()
    cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA], acc_events=True) as prof:
        for _ in range(calls):
            fn()
        cuda.synchronize()
    totals = {}
    for event in prof.events():
        if event.device_type.name != "CUDA":
            continue
        entry = totals.setdefault(kernel_name(event.name), [0, 0.0])
        entry[0] += 1
        entry[1] += event.time_range.elapsed_us() / 1e3
    return {name: (count / calls, ms / calls) for name, (count, ms) in totals.items()}


def print_kernel_times(times, top):
    """The `top` kernels of kernel_times by their time a call: launches a call, ms a call, the
    time of one launch, the share of all."""
    total = sum(ms for _, ms in times.values())
    if total <= 0:
        print("  (the profiler recorded no GPU time: is CUPTI available to torch.profiler?)")
        return
    for name, (launches, ms) in sorted(times.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"  {name:60s} {launches:6.4g}/call {ms:8.3f} ms {1e3 * ms / launches:9.1f} us "
              f"each {100 * ms / total:5.1f}%")
