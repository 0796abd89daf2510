"""The products' operands rounded once (kernels/operands.py): round_bf16 and round_tf32 against
their twins bit for bit, the pad of zeros past a row's width, and bf16_values reading them
back. (The roundings themselves: ptx/test_ptx_mma.py.)"""
import numpy as np

from checks import device, poisoned, rounding_hard_values
from nanoandrea.kernels import operands
from nanoandrea.kernels.operands import Bf16Matrix, Tf32Matrix
from nanoandrea.kernels.ptx.mma import bf16_values, tf32_values, unpack_bf16


def test_round_bf16_pads_with_zeros(rng):
    """round_bf16 against its twin, bit for bit, at a width of 13: 13 values then 3 zeros;
    bf16_values reads the values back."""
    x = rng.standard_normal((5, 13)).astype(np.float32)
    rounded = operands.rounded_bf16(device(x))
    pairs = rounded.bf16_pairs.copy_to_host()
    want = Bf16Matrix(np.zeros((5, 8), np.uint32), 13)
    operands.round_bf16_numpy(want, x)
    assert rounded.shape == (5, 13) and pairs.shape == (5, 8)
    assert np.array_equal(pairs, want.bf16_pairs)
    assert np.array_equal(unpack_bf16(pairs)[:, :13], bf16_values(x))
    assert not unpack_bf16(pairs)[:, 13:].any()
    values = poisoned((5, 13))
    operands.bf16_values(values, rounded)
    assert np.array_equal(values.copy_to_host(), bf16_values(x))
    host = np.empty((5, 13), np.float32)
    operands.bf16_values_numpy(host, want)
    assert np.array_equal(host, bf16_values(x))


def test_round_tf32_matches_its_twin_bit_for_bit(rng):
    """round_tf32 (cvt.rna.tf32.f32 on the GPU) against round_tf32_numpy, on the hard values,
    at a width of 13 (then 3 zeros of pad) and of 12 (16-byte loads)."""
    values = rounding_hard_values(rng)
    for width in (13, 12):
        x = values[:(values.size // width) * width].reshape(-1, width)
        rounded = operands.rounded_tf32(device(x))
        got = rounded.values.copy_to_host()
        want = Tf32Matrix(np.full((x.shape[0], 16 if width == 13 else 12), np.nan, np.float32),
                          width)
        operands.round_tf32_numpy(want, x)
        assert rounded.shape == x.shape and got.shape == want.values.shape
        assert np.array_equal(got.view(np.uint32), want.values.view(np.uint32))
        assert np.array_equal(got[:, :width], tf32_values(x)) and not got[:, width:].any()
