"""The device's facts (kernels/runtime/device.py), read from the device and not written down for
one card: the grids that must fill the GPU follow its multiprocessors (an A100's 108, where an
H100 SXM or an H200 has 132), split-K its L2 too; peak FLOP/s come from a table keyed by compute
capability and name, None for a card it does not know. The device is pretended
(checks.on_device) so that the sizing runs as on each card."""
import pytest

from checks import A100, H200, on_device
from conftest import GPU
from nanoandrea.kernels import reduce
from nanoandrea.kernels.matmul import float32, matvec, mma_sync, split_k, wgmma
from nanoandrea.kernels.runtime import device, launch
from nanoandrea.kernels.runtime.device import Device


@pytest.mark.skipif(GPU, reason="on a GPU current() reads the GPU")
def test_the_simulator_sizes_grids_as_an_h100_sxm_and_runs_no_wgmma():
    assert device.current() is device.SIMULATED
    assert (device.current().multiprocessors, device.current().l2_bytes) == (132, 50 * 2**20)
    assert not device.runs_wgmma() and not device.gpu_available()


def grid_sizes(monkeypatch, card):
    """What each sizing rule gives on `card` (the simulator's own smaller grids turned off)."""
    on_device(monkeypatch, card)
    monkeypatch.setattr(wgmma, "SIMULATOR", False)      # (the simulator's one persistent block)
    monkeypatch.setattr(launch, "SIMULATOR", False)     # (and its 4 element-wise blocks)
    return dict(
        wgmma_blocks=wgmma.resident_blocks(),
        mma_blocks=mma_sync.resident_blocks(),
        float32_blocks=float32.resident_blocks(),
        # dW of an attention projection of andrea-120m: M x N = 768 x 768, K = B*T = 16384
        float32_splits=split_k.split_count(768, 768, 16384, float32.resident_blocks(),
                                           float32.BK, 4, (float32.BM, float32.BN)),
        elementwise_blocks=launch.elementwise_grid(10**8)[0],
        column_sum_chunks=reduce.row_chunks(16384, 384),
        matvec_splits=matvec.matvec_splits(768, 16384))


def test_grids_follow_the_multiprocessors(monkeypatch):
    """On a device of 108 multiprocessors: the persistent wgmma grid one block each, the tile
    kernels' waves two blocks each, split-K's count for those waves (6 slices where 132
    multiprocessors take 7), 16 element-wise blocks each, ~4 column-sum blocks each (12 blocks
    of 32 columns a chunk), ~2 matvec blocks each (768 columns)."""
    sizes = {card.multiprocessors: grid_sizes(monkeypatch, card) for card in (A100, H200)}
    for sms, got in sizes.items():
        column_blocks = -(-768 // matvec.BLOCK_COLUMNS)
        assert got == dict(wgmma_blocks=sms, mma_blocks=2 * sms, float32_blocks=2 * sms,
                           float32_splits={108: 6, 132: 7}[sms], elementwise_blocks=16 * sms,
                           column_sum_chunks=-(-4 * sms // 12),
                           matvec_splits=-(-2 * sms // column_blocks))
    assert all(sizes[108][rule] != sizes[132][rule] for rule in sizes[108])


@pytest.mark.parametrize("name,capability,bf16,tf32,fp32", [
    ("NVIDIA H100 80GB HBM3", (9, 0), 989e12, 495e12, 67e12),      # SXM
    ("NVIDIA H100 PCIe", (9, 0), 756e12, 378e12, 51e12),
    ("NVIDIA H200", (9, 0), 989e12, 495e12, 67e12),
    ("NVIDIA A100-SXM4-80GB", (8, 0), 312e12, 156e12, 19.5e12),
    ("NVIDIA GeForce RTX 4090", (8, 9), 165.2e12, 82.6e12, 82.6e12)])
def test_peak_flops_of_known_cards(monkeypatch, name, capability, bf16, tf32, fp32):
    card = Device(name, capability, multiprocessors=100, l2_bytes=2**25, shared_bytes_optin=0)
    assert [device.peak_flops(p, card) for p in ("bf16", "tf32", "fp32")] == [bf16, tf32, fp32]
    on_device(monkeypatch, card)                        # (default: the current device)
    assert device.peak_flops("bf16") == bf16


@pytest.mark.parametrize("name,capability", [
    ("NVIDIA GeForce RTX 3090", (8, 6)),                # a card the table does not have
    ("NVIDIA L4", (8, 9)),
    ("NVIDIA H100 80GB HBM3", (8, 0)),                  # a name with another capability
    ("Tesla V100-SXM2-16GB", (7, 0))])
def test_peak_flops_of_an_unknown_card_is_none(name, capability):
    card = Device(name, capability, multiprocessors=80, l2_bytes=2**22, shared_bytes_optin=0)
    assert all(device.peak_flops(p, card) is None for p in ("bf16", "tf32", "fp32"))
