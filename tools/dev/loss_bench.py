"""The bf16 loss kernel before and after it became persistent, at andrea-120m's [16384, 50304]:
each checked against the other and a few rows against the NumPy twin, then timed.

    python tools/dev/loss_bench.py                        # on a GPU: ms and TB/s of each
    python tools/dev/loss_bench.py --shape 2048,50304     # another [N, Vp] (V = Vp - 47)
    NUMBA_ENABLE_CUDASIM=1 python tools/dev/loss_bench.py --shape 5,328   # the checks alone

row_per_block_kernel is the package's kernel before 3acee83 (crossentropy.py at aac3811, copied
here unchanged): a block of 512 threads a row, the row read through registers into 98 KB of
shared memory, shared-memory tree reductions; 1.61 ms on an H100 at [16384, 50304]. The
package's kernel today is crossentropy.launch_bf16_logits. A timing is of the kernel alone (not
the mean of the losses): the median of 20 timings of 5 back-to-back calls between CUDA events,
after warm-up (tools/benchmarks/timing.py). TB/s counts the logits read once and, with the
gradient, dlogits written once.
"""
import argparse
import math
import sys
from pathlib import Path

import numpy as np
from numba import cuda, float32, uint32

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE.parent)]      # nanoandrea, tools/benchmarks

from nanoandrea.kernels import crossentropy  # noqa: E402
from nanoandrea.kernels.operands import Bf16Matrix, device_empty, round_bf16  # noqa: E402
from nanoandrea.kernels.ptx.mma import (bf16_pair, bf16_unpair, load4_u32, store4_u32,  # noqa: E402
                                        unpack_bf16)
from nanoandrea.kernels.ptx.sfu import exp2_fast  # noqa: E402
from nanoandrea.kernels.reduce import MAX_THREADS, block_max, block_sum  # noqa: E402
from nanoandrea.kernels.runtime.device import SIMULATOR  # noqa: E402
from nanoandrea.kernels.runtime.launch import inlined, kernel_factory, launch  # noqa: E402

# --- before: crossentropy.py's bf16 kernel at aac3811 -----------------------------------------

BF16_THREADS = 32 if SIMULATOR else 512
# (its logits in base 2, eight_classes, and add_to_running_sum2, the online softmax in base 2,
# are the package's today: the persistent kernel does the same arithmetic)
eight_classes, add_to_running_sum2 = crossentropy.logits8_log2, crossentropy.add_to_running_sum2
NEG_INF, LOG2E = crossentropy.NEG_INF, crossentropy.LOG2E


@inlined
def gradient2(x0, x1, v, V, lse2, target, scale):
    g0 = exp2_fast(x0 - lse2) - (float32(1.0) if v == target else float32(0.0))
    g1 = exp2_fast(x1 - lse2) - (float32(1.0) if v + 1 == target else float32(0.0))
    return bf16_pair(g0 * scale if v < V else float32(0.0),
                     g1 * scale if v + 1 < V else float32(0.0))


@kernel_factory
def row_per_block_kernel(gradient):
    @cuda.jit
    def crossentropy_bf16_logits_kernel(losses, lse, dlogit_pairs, logit_pairs, targets, dloss,
                                        V):
        scratch = cuda.shared.array(MAX_THREADS, float32)
        row = cuda.shared.array(0, uint32)
        n = cuda.blockIdx.x
        chunks = logit_pairs.shape[1] // 4
        m, s = NEG_INF, float32(0.0)
        for c in range(cuda.threadIdx.x, chunks, cuda.blockDim.x):
            w0, w1, w2, w3 = load4_u32(logit_pairs, (n, 4 * c))
            row[4 * c], row[4 * c + 1], row[4 * c + 2], row[4 * c + 3] = w0, w1, w2, w3
            x0, x1, x2, x3, x4, x5, x6, x7 = eight_classes(w0, w1, w2, w3, 8 * c, V)
            m, s = add_to_running_sum2(m, s, x0, x1, x2, x3, x4, x5, x6, x7)
        row_max = block_max(m, scratch)
        s = s * exp2_fast(m - row_max) if m > NEG_INF else float32(0.0)
        lse2 = row_max + math.log2(block_sum(s, scratch))          # in base 2
        target = targets[n]
        if cuda.threadIdx.x == 0:
            low, high = bf16_unpair(logit_pairs[n, target >> 1])
            lse[n] = lse2 / LOG2E
            losses[n] = lse2 / LOG2E - (high if target & 1 else low)
        if gradient:
            scale = dloss[0] / logit_pairs.shape[0]
            for c in range(cuda.threadIdx.x, chunks, cuda.blockDim.x):
                v = 8 * c
                x0, x1, x2, x3, x4, x5, x6, x7 = eight_classes(
                    row[4 * c], row[4 * c + 1], row[4 * c + 2], row[4 * c + 3], v, V)
                store4_u32(dlogit_pairs, (n, 4 * c),
                           gradient2(x0, x1, v, V, lse2, target, scale),
                           gradient2(x2, x3, v + 2, V, lse2, target, scale),
                           gradient2(x4, x5, v + 4, V, lse2, target, scale),
                           gradient2(x6, x7, v + 6, V, lse2, target, scale))

    return crossentropy_bf16_logits_kernel


def launch_row_per_block(losses, lse, dlogits, logits, targets, dloss, V):
    """launch_bf16_logits at aac3811, for rows that fit in a block's shared memory."""
    pairs = logits.bf16_pairs
    launch(row_per_block_kernel(dlogits is not None), logits.shape[0], BF16_THREADS, losses, lse,
           pairs if dlogits is None else dlogits.bf16_pairs, pairs, targets,
           lse if dloss is None else dloss, V, shared_bytes=4 * pairs.shape[1])


# --- the driver ------------------------------------------------------------------------------

def random_logits(N, Vp):
    """A device Bf16Matrix [N, Vp] of logits ~ N(0, 2^2), their float32s made on the device
    (CuPy; 3.3 GB at andrea-120m), or in NumPy under the simulator."""
    if SIMULATOR:
        floats = cuda.to_device(2 * np.random.default_rng(0).standard_normal((N, Vp), np.float32))
    else:
        import cupy
        floats = cuda.as_cuda_array(
            2 * cupy.random.default_rng(0).standard_normal((N, Vp), cupy.float32))
    logits = Bf16Matrix.allocate((N, Vp), device_empty)
    round_bf16(logits, floats)
    return logits


def values(pairs, cols):
    """The float32 values of bf16 pairs copied to the host."""
    return unpack_bf16(pairs.copy_to_host())[:, :cols]


def check(name, got, want, limit):
    """max |got - want| / max |want|, printed; past `limit` the driver stops (exit status 1)."""
    error = float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))
    print(f"  {name:40s} max |difference| / max |value| {error:.1e}")
    if not error <= limit:
        sys.exit(f"MISMATCH: {name}: {error:.1e} > {limit:.0e}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="16384,50304", help="N,Vp (V = Vp - 47)")
    N, Vp = (int(x) for x in parser.parse_args().shape.split(","))
    V = Vp - 47                                 # (GPT-2's 50257 classes in 50304 columns)
    print(f"device: {'the CUDA simulator' if SIMULATOR else cuda.get_current_device().name}, "
          f"logits [{N}, {Vp}] in bf16, {V} classes; persistent grid (buffers, blocks): "
          f"{crossentropy.bf16_logits_grid(N, 2 * Vp)}")
    logits = random_logits(N, Vp)
    targets = cuda.to_device(np.random.default_rng(1).integers(0, V, N).astype(np.int32))
    dloss = cuda.to_device(np.ones(1, np.float32))
    kernels = {"row per block (before)": launch_row_per_block,
               "persistent (now)": crossentropy.launch_bf16_logits}
    outputs = {}
    for name, run in kernels.items():
        losses, lse = device_empty(N, np.float32), device_empty(N, np.float32)
        dlogits = Bf16Matrix.allocate((N, Vp), device_empty)
        outputs[name] = (losses, lse, dlogits)
        run(losses, lse, dlogits, logits, targets, dloss, V)
    (losses_a, lse_a, grad_a), (losses_b, lse_b, grad_b) = outputs.values()
    print("checks: now against before, to the bit (the same arithmetic, step for step)")
    for name, a, b in (("losses", losses_a, losses_b), ("lse", lse_a, lse_b),
                       ("dlogits", grad_a.bf16_pairs, grad_b.bf16_pairs)):
        a, b = a.copy_to_host(), b.copy_to_host()
        differ = np.count_nonzero(a.view(np.uint32) != b.view(np.uint32))
        print(f"  {name:40s} {differ} of {a.size} words differ")
        if differ:
            sys.exit(f"MISMATCH: {name}: {differ} words differ from the kernel before")
        del a, b
    few = min(N, 64)                        # the twin on the first rows (float64)
    want = [np.empty(1), np.empty(few), np.empty(few), np.empty((few, Vp))]
    crossentropy.crossentropy_forward_backward_numpy(
        *want, values(logits.bf16_pairs[:few], Vp).astype(np.float64),
        targets.copy_to_host()[:few], np.array([few / N]), vocab=V)
    print(f"checks: now against the NumPy twin, rows 0..{few - 1}")
    check("losses", losses_b.copy_to_host()[:few], want[1], 1e-5)
    check("dlogits", values(grad_b.bf16_pairs[:few], Vp), want[3], 2**-7)
    if SIMULATOR:
        return
    from benchmarks.timing import event_time_ms, warm_up_clocks
    warm_up_clocks()
    row_bytes = 4 * logits.bf16_pairs.shape[1]
    for gradient in (True, False):
        print("the loss and its gradient" if gradient else "the loss alone (evaluation's)")
        for name, run in kernels.items():
            losses, lse, dlogits = outputs[name]
            ms = event_time_ms(lambda: run(losses, lse, dlogits if gradient else None, logits,
                                           targets, dloss if gradient else None, V),
                               warmup=3, repeat=20, calls=5)
            moved = N * row_bytes * (2 if gradient else 1) + 8 * N
            print(f"  {name:28s} {ms:8.3f} ms {moved / ms / 1e9:7.2f} TB/s")


if __name__ == "__main__":
    # run as the module loss_bench, not as __main__: the kernel cache finds a kernel's source
    # again by its module's name (nanoandrea/kernels/runtime/cache.py)
    sys.path.insert(0, str(HERE))
    import loss_bench
    loss_bench.main()
