"""The element-wise ops' two kernels (kernels/elementwise.py's `pick`, which gelu.py and
dropout.py use too): the 16-byte kernels where every array is whole 16-byte runs, 16-byte
aligned, the one-element kernels elsewhere. (What they compute: test_twins.py.)"""
import numpy as np
import pytest

from checks import ROWS, WIDTH, device, device_at, recording_launches
from nanoandrea.kernels import dropout, elementwise, gelu


@pytest.mark.parametrize("shape,offset,four_wide", [
    ((ROWS, 4 * WIDTH), 0, True),          # whole 16-byte runs
    ((5, 9), 0, False),                    # 45 floats: not a multiple of 4
    ((ROWS, 4 * WIDTH), 1, False)])        # 1 float off a 16-byte boundary
def test_the_16_byte_kernels_take_whole_aligned_runs(rng, monkeypatch, shape, offset, four_wide):
    launched = recording_launches(monkeypatch, elementwise, gelu, dropout)
    x, y = (device_at(rng.standard_normal(shape).astype(np.float32), offset) for _ in range(2))
    out, seed = device_at(np.full(shape, np.nan, np.float32), offset), device([5], np.int64)
    assert elementwise.vectorizable(out.reshape(out.size), x.reshape(x.size)) == four_wide
    elementwise.add(out, x, y)
    elementwise.add_into(out, x, True)
    elementwise.fill(out, 0.25)
    gelu.gelu_forward(out, x)
    gelu.gelu_backward(out, x, y, True)
    dropout.dropout_forward(out, x, 0.25, seed, 3)
    dropout.dropout_backward(out, x, 0.25, seed, 3)
    if four_wide:
        want = [elementwise.add4_kernel, elementwise.add_into4_kernel, elementwise.fill4_kernel,
                gelu.gelu_forward4_kernel, gelu.gelu_backward4_kernel,
                dropout.dropout_forward4_kernel, dropout.dropout_backward4_kernel]
    else:
        want = [elementwise.add_kernel, elementwise.add_into_kernel, elementwise.fill_kernel,
                gelu.gelu_forward_kernel, gelu.gelu_backward_kernel,
                dropout.dropout_forward_kernel, dropout.dropout_backward_kernel]
    assert launched == want
    assert np.isfinite(out.copy_to_host()).all()
