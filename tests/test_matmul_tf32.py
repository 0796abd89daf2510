"""The tensor-core matmul in tf32 (kernels/matmul_tf32.py): the kernel against its NumPy twin
(the float64 product of the tf32-rounded operands: float32 sums' rounding apart) and against
float64 on the unrounded operands (tf32's ~1e-3); the rounding against its twin bit for bit,
and the twin against a definition of its own.

The kernel is matmul_bf16's (test_matmul_bf16.py's `check`); what tf32 changes is tested here:
the k-major operands read a word a lane (transpose_a, and b not transposed), the slices of 16
k, rows padded to 4 values. Fewer cases than bf16's: the code both share is tested there.
"""
import numpy as np
import pytest

from conftest import GPU
from nanoandrea.kernels import matmul_tf32
from nanoandrea.kernels.tensorcores import TF32_MASK, tf32_values
from test_kernels import ORIENTATIONS, device
from test_matmul_bf16 import CASES, check, split_k


@pytest.mark.parametrize("transpose_a,transpose_b", ORIENTATIONS)
@pytest.mark.parametrize("splits", [1, 2])
def test_matmul_tf32(rng, monkeypatch, splits, transpose_a, transpose_b):
    """Every orientation, whole and split-K (in the simulator one case each: split-K's needs
    K of two slices or more)."""
    split_k(monkeypatch, splits)
    for case in CASES if GPU else [CASES[2 - splits]]:
        check(rng, transpose_a, transpose_b, *case, precision="tf32")


@pytest.mark.parametrize("gelu,transpose_b,accumulate", [
    ("out", False, False),                  # the MLP up with its activation (b k-major)
    ("input", True, True)])                 # dH = (dY . W^T) * gelu'(H), added to
def test_matmul_tf32_epilogues(rng, gelu, transpose_b, accumulate):
    M, N, K = (40, 24, 40) if not GPU else (1000, 1544, 392)
    check(rng, False, transpose_b, M, N, K, gelu == "out", accumulate, gelu, precision="tf32")


@pytest.mark.parametrize("transpose_a,transpose_b", ORIENTATIONS)
def test_matmul_tf32_any_width(rng, transpose_a, transpose_b):
    """Widths that are not multiples of 4: each operand's rows padded with zeros to 4 values."""
    M, N, K = (12, 13, 21) if not GPU else (300, 65, 1027)
    check(rng, transpose_a, transpose_b, M, N, K, True, False, precision="tf32")


def hard_values(rng):
    """Random values of every size, and those where rounding is easy to get wrong: ties (the
    13 dropped bits exactly 0x1000), just either side of them, carries into the exponent, the
    largest float32s (rounding up overflows to infinity), subnormals, zeros, infinities."""
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


def test_tf32_twin_rounds_to_nearest_ties_away(rng):
    """tf32_values against a definition of its own, in float64: the nearest multiple of the
    value's tf32 step (2^(exponent - 10)), a tie away from zero, subnormals by float32's
    smallest step, past the largest tf32 infinity."""
    x = hard_values(rng)
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


def test_round_tf32_matches_its_twin_bit_for_bit(rng):
    """round_tf32 (cvt.rna.tf32.f32 on the GPU) against round_tf32_numpy, on the hard values,
    at a width of 13 (then 3 zeros of pad) and of 12 (16-byte loads)."""
    values = hard_values(rng)
    for width in (13, 12):
        x = values[:(values.size // width) * width].reshape(-1, width)
        rounded = matmul_tf32.rounded(device(x))
        got = rounded.values.copy_to_host()
        want = matmul_tf32.Tf32Matrix(np.full((x.shape[0], 16 if width == 13 else 12), np.nan,
                                              np.float32), width)
        matmul_tf32.round_tf32_numpy(want, x)
        assert rounded.shape == x.shape and got.shape == want.values.shape
        assert np.array_equal(got.view(np.uint32), want.values.view(np.uint32))
        assert np.array_equal(got[:, :width], tf32_values(x)) and not got[:, width:].any()
