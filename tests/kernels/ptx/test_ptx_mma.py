"""The roundings of the tensor cores' operands as kernels/ptx/mma.py's twins compute them:
bf16 (to nearest, ties to even: what bf16_pair's cvt.rn.bf16x2.f32 does) and tf32 (to nearest,
ties away from zero: cvt.rna.tf32.f32), each against a definition of its own. The kernels that
round whole operands with them are tested in ../test_operands.py."""
import numpy as np

from checks import rounding_hard_values
from nanoandrea.kernels.ptx.mma import (TF32_MASK, bf16_bits, bf16_values, pack_bf16,
                                        tf32_values, unpack_bf16)


def test_bf16_rounding_is_to_nearest_even():
    ulp = 2.0 ** -7                     # bf16's spacing at 1 (7 bits of mantissa after the 1)
    x = np.array([1.0, 1 + ulp, 1 + 0.75 * ulp, 1 + 0.5 * ulp, 1 + 0.5 * ulp + 2 ** -20,
                  1 + 1.5 * ulp, -2.5], dtype=np.float32)
    want = np.array([1.0, 1 + ulp, 1 + ulp, 1.0, 1 + ulp, 1 + 2 * ulp, -2.5], dtype=np.float32)
    assert np.array_equal(bf16_values(x), want)         # (the ties go to the even mantissa)
    assert np.array_equal(unpack_bf16(pack_bf16(x[:6].reshape(1, -1))).ravel(), want[:6])
    assert bf16_bits(np.float32(1.0)) == 0x3F80


def test_tf32_twin_rounds_to_nearest_ties_away(rng):
    """tf32_values against a definition of its own, in float64: the nearest multiple of the
    value's tf32 step (2^(exponent - 10)), a tie away from zero, subnormals by float32's
    smallest step, past the largest tf32 infinity."""
    x = rounding_hard_values(rng)
    mantissa, exponent = np.frexp(x.astype(np.float64))         # x = mantissa 2^exponent
    exponent = np.maximum(exponent, -125)                       # (subnormals: a fixed step)
    step = np.ldexp(1.0, exponent - 11)
    magnitude = np.floor(np.abs(x.astype(np.float64)) / step + 0.5) * step
    finite = np.isfinite(x)
    want = np.where(finite, np.copysign(magnitude, x), x)
    want = np.where(np.abs(want) >= 2.0 ** 128, np.copysign(np.inf, x), want).astype(np.float32)
    got = tf32_values(x)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert not (got.view(np.uint32) & ~np.uint32(TF32_MASK)).any()
    ulp = 2.0 ** -10                                            # tf32's step at 1
    assert tf32_values(np.float32(1 + ulp / 2)) == np.float32(1 + ulp)     # a tie: away, not
    assert tf32_values(np.float32(-1 - ulp / 2)) == np.float32(-1 - ulp)   # to the even 1.0
    assert tf32_values(np.float32(1 + 3 * ulp / 8)) == np.float32(1.0)
    assert np.isnan(tf32_values(np.float32([np.nan, -np.nan]))).all()
