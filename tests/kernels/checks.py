"""What the kernel tests share: device copies, outputs poisoned with NaN, priors to accumulate
onto, the products' orientations, launches recorded, split-K forced, fake devices.

Every kernel writes into an output poisoned with NaN first (every element must be written), and
each gradient kernel is checked in both modes: overwrite (=) and accumulate (+=) onto a random
prior value. Sizes are never multiples of a tile; in the simulator they stay tiny, on a GPU the
same tests run at andrea-12m shapes.
"""
import numpy as np
from numba import cuda

from conftest import GPU
from nanoandrea.kernels import heads
from nanoandrea.kernels.matmul import split_k as split_k_module
from nanoandrea.kernels.runtime.device import Device
from nanoandrea.kernels.runtime.launch import launch

TOLERANCE = 2e-5 if not GPU else 1e-4      # float32 kernels against a float64 reference
ROWS, WIDTH = (7, 24) if not GPU else (16384, 384)      # activations of the small ops' tests
# split/merge heads' (B, T, H, D): D % 4 == 0 takes the 16-byte kernels (in the simulator D=64
# gives a block 2 rows tall, so T=7 spans two blocks, the second part empty), other D the
# one-element kernels
HEADS_CASES = ([(2, 7, 3, 8), (2, 7, 2, 64), (2, 7, 3, 6)] if not GPU else
               [(64, 256, 12, 32), (16, 1024, 12, 64), (16, 256, 12, 30)])
# the products' (transpose_a, transpose_b): forward X W, dX = dY W^T, dW = X^T dY, and the last
ORIENTATIONS = [(False, False), (False, True), (True, False), (True, True)]

# Devices to size grids for (runtime/device.py reads the real one; the simulator is an H100 SXM)
H200 = Device("NVIDIA H200", (9, 0), multiprocessors=132, l2_bytes=50 * 2**20,
              shared_bytes_optin=227 * 1024)
A100 = Device("NVIDIA A100-SXM4-80GB", (8, 0), multiprocessors=108, l2_bytes=40 * 2**20,
              shared_bytes_optin=163 * 1024)


def device(array, dtype=np.float32):
    return cuda.to_device(np.ascontiguousarray(array, dtype=dtype))


def poisoned(shape):
    return device(np.full(shape, np.nan))


def output_and_prior(rng, shape, accumulate):
    """(device output buffer, its prior value on the host): NaN-poisoned or random."""
    prior = rng.standard_normal(shape).astype(np.float32) if accumulate else np.zeros(shape)
    return (device(prior) if accumulate else poisoned(shape)), prior


def device_at(array, offset):
    """A device copy of `array` whose first element sits `offset` floats past the start of its
    allocation: offset 1 makes it not 16-byte aligned (aligned16 tests the simulator's arrays
    as the GPU's)."""
    flat = np.zeros(offset + array.size, dtype=np.float32)
    flat[offset:] = array.reshape(-1)
    return cuda.to_device(flat)[offset:].reshape(array.shape)


def concat(heads_array):
    """[B,H,T,D] on the host -> the heads side by side, [B,T,C] (merge_heads' twin)."""
    B, H, T, D = heads_array.shape
    out = np.empty((B, T, H * D), dtype=heads_array.dtype)
    heads.merge_heads_numpy(out, heads_array)
    return out


class DeviceHeads:
    """A [B,H,T,D] device array to test an attention kernel's output or input with: contiguous,
    or (in_concat) a heads.heads_view of a [B,T,C] device array, the heads side by side as the
    model keeps attention's output and q, k, v's gradients. `host()` reads it back as
    [B,H,T,D]."""
    def __init__(self, values, in_concat, offset=0):
        B, H, T, D = values.shape
        self.base = device_at(concat(values) if in_concat else values, offset)
        self.array = heads.heads_view(self.base, H) if in_concat else self.base
        self.shape, self.in_concat = values.shape, in_concat

    def host(self):
        x = self.base.copy_to_host()
        return heads.heads_view_numpy(x, self.shape[1]) if self.in_concat else x


def recording_launches(monkeypatch, *modules):
    """The list of the kernels the launchers of `modules` launch from now on, in order (they
    still run)."""
    launched = []

    def record(kernel, *arguments, **options):
        launched.append(kernel)
        launch(kernel, *arguments, **options)

    for module in modules:
        monkeypatch.setattr(module, "launch", record)
    return launched


def split_k(monkeypatch, splits):
    """Every product of the matmul kernels split into `splits` slices of K, whatever its shape
    (split_k.split_count sizes them for the device, so tiny shapes never split); returns the
    list of the (M, N, K) that asked."""
    asked = []

    def split_count(M, N, K, *sizing):
        asked.append((M, N, K))
        return splits

    monkeypatch.setattr(split_k_module, "split_count", split_count)
    return asked


def on_device(monkeypatch, fake, wgmma=None):
    """Make runtime/device.py say that the GPU is `fake` (a Device); wgmma: what runs_wgmma()
    answers (default: whether `fake` is of compute capability 9.0)."""
    from nanoandrea.kernels.runtime import device as device_module
    monkeypatch.setattr(device_module, "current", lambda: fake)
    runs = fake.compute_capability == (9, 0) if wgmma is None else wgmma
    monkeypatch.setattr(device_module, "runs_wgmma", lambda: runs)


def rounding_hard_values(rng):
    """Random float32 values of every size, and those where a rounding to tf32 is easy to get
    wrong: ties (the 13 dropped bits exactly 0x1000), just either side of them, carries into
    the exponent, the largest float32s (rounding up overflows to infinity), subnormals, zeros,
    infinities; each also negated."""
    exponents, kept = rng.integers(0, 255, 64, dtype=np.uint32), rng.integers(0, 2**10, 64,
                                                                              dtype=np.uint32)
    ties = (exponents << 23) | (kept << 13) | np.uint32(0x1000)
    near = np.concatenate([ties - 1, ties + 1, np.uint32([0x3FFFF000, 0x7F7FF000, 0x7F7FFFFF,
                                                          0x7F7FEFFF, 0x00001000, 0x00000FFF,
                                                          0x00003000, 0x007FF000])])
    bits = np.concatenate([ties, near]).astype(np.uint32)
    specials = np.float32([0.0, -0.0, np.inf, -np.inf, 1.0, -2.5, 1e-45, 3.4e38])
    values = np.concatenate([bits.view(np.float32), specials,
                             rng.standard_normal(200).astype(np.float32) * 10.0 ** rng.integers(
                                 -30, 30, 200)])
    return np.concatenate([values, -values]).astype(np.float32)
