"""Splitting q, k, v into heads and merging attention's output back (kernels/heads.py): bit for
bit the NumPy twins, by the 16-byte kernels where the rows allow it and the one-element ones
elsewhere (unaligned arrays among them); merge undoes split. (heads_view: the attention tests.)"""
import numpy as np
import pytest

from checks import HEADS_CASES, device_at, poisoned, recording_launches
from nanoandrea.kernels import heads


@pytest.mark.parametrize("B,T,H,D", HEADS_CASES)
@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("accumulate", [False, True])
def test_split_and_merge_heads(rng, monkeypatch, B, T, H, D, offset, accumulate):
    """Bit for bit the NumPy twins (a copy, or one float32 add); offset 1: arrays not 16-byte
    aligned, which must take the one-element kernels (aligned16 tests the simulator's arrays
    as the GPU's)."""
    launched = recording_launches(monkeypatch, heads)
    x = rng.standard_normal((B, T, H * D)).astype(np.float32)
    prior = rng.standard_normal((B, H, T, D)).astype(np.float32)
    out = device_at(prior, offset) if accumulate else poisoned((B, H, T, D))
    heads.split_heads(out, device_at(x, offset), accumulate)
    want = prior.copy()
    heads.split_heads_numpy(want, x, accumulate)
    assert np.array_equal(out.copy_to_host(), want)
    y = rng.standard_normal((B, H, T, D)).astype(np.float32)
    prior = rng.standard_normal((B, T, H * D)).astype(np.float32)
    out = device_at(prior, offset) if accumulate else poisoned((B, T, H * D))
    heads.merge_heads(out, device_at(y, offset), accumulate)
    want = prior.copy()
    heads.merge_heads_numpy(want, y, accumulate)
    assert np.array_equal(out.copy_to_host(), want)
    four_wide = D % 4 == 0 and not offset
    assert launched == ([heads.split_heads4_kernel, heads.merge_heads4_kernel] if four_wide else
                        [heads.split_heads_kernel, heads.merge_heads_kernel])


def test_merge_inverts_split(rng):
    x = rng.standard_normal((2, 5, 12)).astype(np.float32)
    split, merged = poisoned((2, 3, 5, 4)), poisoned((2, 5, 12))
    heads.split_heads(split, device_at(x, 0))
    heads.merge_heads(merged, split)
    assert np.array_equal(merged.copy_to_host(), x)
