"""Split-K (kernels/matmul/split_k.py): how many slices of K a product is cut into, from the
device's multiprocessors and L2, and the ordered sum of the slices' partial products."""
import numpy as np
import pytest

from checks import A100, H200, TOLERANCE, device, on_device, output_and_prior
from conftest import GPU, relative_error
from nanoandrea.kernels.matmul import float32, split_k
from nanoandrea.kernels.runtime import device as runtime_device


def float32_split_count(M, N, K):
    """The count the float32 kernel's launcher asks for (its resident blocks, slice, tile)."""
    return split_k.split_count(M, N, K, float32.resident_blocks(), float32.BK, 4,
                               (float32.BM, float32.BN))


@pytest.mark.parametrize("card", [H200, A100], ids=["H200", "A100"])
@pytest.mark.parametrize("M,N,K", [(768, 768, 16384), (768, 3072, 16384), (384, 384, 16384),
                                   (65, 384, 16384), (16384, 768, 768), (1000, 900, 5000)])
def test_split_k_fills_its_waves(monkeypatch, card, M, N, K):
    """The split count: 1 when the output alone fills the GPU; otherwise the smallest count
    whose waves of resident blocks are at least 90% busy and whose slice's rows of both
    operands fit in half the L2 (or, if none, the smallest well-filled count), slices never
    thinner than 256; on the device's own multiprocessors and L2."""
    on_device(monkeypatch, card)
    slots = float32.resident_blocks()
    assert slots == 2 * card.multiprocessors
    splits = float32_split_count(M, N, K)
    output_blocks = -(-M // 128) * -(-N // 128)
    if output_blocks >= slots:
        assert splits == 1
        return
    assert 1 <= splits and K // splits >= 256

    def fill(s):
        total = output_blocks * s
        return total / (-(-total // slots) * slots)

    def fits(s):
        return 4 * (M + N) * split_k.k_per_slice(K, s, float32.BK) <= card.l2_bytes // 2

    counts = [s for s in range(1, K // 256 + 1) if s * output_blocks <= 8 * slots]  # 8 waves
    well_filled = [s for s in counts if fill(s) >= 0.9]
    if not well_filled:                     # none fills its waves: the best-filled one
        assert all(fill(s) <= fill(splits) for s in counts)
        return
    assert splits == ([s for s in well_filled if fits(s)] or well_filled)[0]


@pytest.mark.parametrize("M,N,measured", [(768, 3072, 10), (3072, 768, 10), (768, 768, 7),
                                          (384, 384, 27), (384, 1536, 7)])
def test_split_count_of_the_measured_weight_gradients(monkeypatch, M, N, measured):
    """The counts that ran fastest of those timed on the H200 (docs/perf.md): dW of the MLP,
    the attention projections and andrea-12m's, K = 16384."""
    on_device(monkeypatch, H200)
    assert float32_split_count(M, N, 16384) == measured


def test_split_count_keeps_a_slice_in_half_the_l2(monkeypatch):
    """Of two counts that fill their waves alike, the one whose slice of both operands fits in
    half the L2: a device of a smaller L2 cuts the same product into more slices."""
    M, N, K = 768, 768, 16384               # 36 blocks of out; 7 slices fill 252 of 264 slots
    on_device(monkeypatch, H200)
    roomy = float32_split_count(M, N, K)
    small_l2 = runtime_device.Device("a card of 16 MiB of L2", (9, 0), 132, 16 * 2**20, 0)
    on_device(monkeypatch, small_l2)
    cramped = float32_split_count(M, N, K)
    assert (roomy, cramped) == (7, 14)
    assert 4 * (M + N) * split_k.k_per_slice(K, 7, float32.BK) > small_l2.l2_bytes // 2
    assert 4 * (M + N) * split_k.k_per_slice(K, 14, float32.BK) <= small_l2.l2_bytes // 2


@pytest.mark.parametrize("with_bias,accumulate", [(True, False), (False, True)])
def test_sum_splits(rng, with_bias, accumulate):
    """Split-K's partial products summed in order (+ bias), 16 bytes at a time."""
    M, N, S = (5, 24, 3) if not GPU else (1000, 1540, 7)
    partials = rng.standard_normal((S, M, N)).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32)
    out, prior = output_and_prior(rng, (M, N), accumulate)
    split_k.sum_splits(out, device(partials), device(bias) if with_bias else device(prior[0]),
                       with_bias, accumulate)
    want = (bias if with_bias else 0) + partials.astype(np.float64).sum(axis=0) + prior
    assert relative_error(out.copy_to_host(), want) < TOLERANCE
