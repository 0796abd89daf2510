"""The device's facts, read from the device rather than written down for one card.

    SIMULATOR         Numba's CUDA simulator is on (NUMBA_ENABLE_CUDASIM=1): kernels run as
                      Python threads on the CPU, at tiny sizes
    current()         the GPU this process launches on: its name, compute capability,
                      multiprocessors, L2 bytes and the shared memory a block may opt into
    gpu_available()   whether a real CUDA GPU is usable
    runs_wgmma()      compute capability 9.0 (the H100, the H200): Hopper's warpgroup
                      instructions (sm_90a), which later GPUs do not run
    peak_flops()      the card's dense peak FLOP/s in a precision, from PEAK_FLOPS; None where
                      the card is not in it

Grids that must fill the GPU (the persistent products, split-K, the column sums) take their
size from current().multiprocessors, and split-K's slices from current().l2_bytes, so they
follow the card the user has: an A100 has 108 multiprocessors, an H100 PCIe 114, an H100 SXM
and an H200 132, an RTX 4090 128. Under the simulator current() is SIMULATED, an H100 SXM's
figures, so the sizing rules run in the tests as on that card.
"""
import functools
from dataclasses import dataclass

from numba import config, cuda

SIMULATOR = bool(config.ENABLE_CUDASIM)


@dataclass(frozen=True)
class Device:
    name: str
    compute_capability: tuple
    multiprocessors: int
    l2_bytes: int
    shared_bytes_optin: int         # the most shared memory a block may ask for


SIMULATED = Device("the CUDA simulator (as an H100 SXM)", (9, 0), multiprocessors=132,
                   l2_bytes=50 * 2**20, shared_bytes_optin=227 * 1024)


@functools.cache
def _read(device_id):
    gpu = cuda.get_current_device()
    name = gpu.name.decode() if isinstance(gpu.name, bytes) else gpu.name
    return Device(name, tuple(gpu.compute_capability), gpu.MULTIPROCESSOR_COUNT,
                  gpu.L2_CACHE_SIZE, gpu.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)


def current():
    """The Device this process launches on (read once per GPU)."""
    if SIMULATOR:
        return SIMULATED
    return _read(cuda.get_current_device().id)


def gpu_available():
    """True when a real CUDA GPU is usable (never under the simulator)."""
    if SIMULATOR:
        return False
    try:
        return cuda.is_available() and len(cuda.gpus) > 0
    except Exception:
        return False


def runs_wgmma():
    """Whether the GPU runs wgmma and the bulk tensor copies: compute capability 9.0 (sm_90a),
    not the simulator (the tests call the wgmma kernels' twins themselves)."""
    return not SIMULATOR and current().compute_capability == (9, 0)


# Dense (not sparse) peak FLOP/s of the vendors' datasheets: float32 on the CUDA cores, tf32
# and bf16 on the tensor cores with float32 sums. Keyed by compute capability and a word of
# the card's name, as one capability covers several cards (an H100 SXM and an H100 PCIe are
# both 9.0); the first row that matches counts.
PEAK_FLOPS = [
    ((9, 0), "H200", dict(fp32=67e12, tf32=495e12, bf16=989e12)),
    ((9, 0), "H100 PCIe", dict(fp32=51e12, tf32=378e12, bf16=756e12)),
    ((9, 0), "H100", dict(fp32=67e12, tf32=495e12, bf16=989e12)),          # SXM
    ((8, 9), "RTX 4090", dict(fp32=82.6e12, tf32=82.6e12, bf16=165.2e12)),
    ((8, 0), "A100", dict(fp32=19.5e12, tf32=156e12, bf16=312e12)),
]


def peak_flops(precision, device=None):
    """The dense peak FLOP/s of `device` (default: current()) in precision fp32, tf32 or bf16;
    None where PEAK_FLOPS does not know the card."""
    device = device or current()
    for capability, word, peaks in PEAK_FLOPS:
        if device.compute_capability == capability and word in device.name:
            return peaks[precision]
    return None
