"""Dropout (kernels/dropout.py): the kernels draw the very mask of the NumPy twin, bit for bit
(the counter-based hash of seed, site and index), about p of the elements are dropped, and two
sites draw different masks."""
import numpy as np
import pytest

from checks import ROWS, WIDTH, device, output_and_prior, poisoned
from conftest import relative_error
from nanoandrea.kernels import dropout


@pytest.mark.parametrize("shape", [(ROWS, WIDTH), (5, 9)])      # 4-wide and one-element kernels
@pytest.mark.parametrize("accumulate", [False, True])
def test_dropout_matches_numpy_bit_for_bit(rng, shape, accumulate):
    x = rng.standard_normal(shape).astype(np.float32)
    seed = np.array([987654321], dtype=np.int64)
    out = poisoned(x.shape)
    dropout.dropout_forward(out, device(x), 0.25, device(seed, np.int64), 3)
    want = np.empty(x.shape, dtype=np.float32)
    dropout.dropout_forward_numpy(want, x, 0.25, seed, 3)
    got = out.copy_to_host()
    assert np.array_equal(got, want)
    dropped = np.mean(got == 0)
    assert 0.15 < dropped < 0.35, f"dropped fraction {dropped}"
    dout = rng.standard_normal(x.shape).astype(np.float32)
    dx, prior = output_and_prior(rng, x.shape, accumulate)
    dropout.dropout_backward(dx, device(dout), 0.25, device(seed, np.int64), 3, accumulate)
    want_dx = prior.astype(np.float32)
    dropout.dropout_backward_numpy(want_dx, dout, 0.25, seed, 3, accumulate)
    assert relative_error(dx.copy_to_host(), want_dx) < 1e-6
    other_site = np.empty(x.shape, dtype=np.float32)
    dropout.dropout_forward_numpy(other_site, x, 0.25, seed, 4)
    assert not np.array_equal(other_site, want), "two sites must draw different masks"
