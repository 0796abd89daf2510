"""The reference product (kernels/matmul/reference.py: one thread an output, 16 x 16 tiles) against
matmul_numpy, the definition, in every orientation, with a bias, accumulating, and with GELU's
epilogues (passes of their own after the product). `check_matmul` serves the float32 kernel's
tests too (test_matmul_float32.py)."""
import numpy as np
import pytest

from checks import ORIENTATIONS, TOLERANCE, device, output_and_prior, poisoned
from conftest import GPU, relative_error
from nanoandrea.kernels import matmul

# (M, N, K, with bias, accumulate): sizes of 4k floats (the rows of either operand, transposed or
# not, are 16-byte runs: the float32 kernel's), none a multiple of a tile
MATMUL_CASES = ([(12, 24, 36, True, False), (8, 20, 12, False, True)] if not GPU else
                [(1000, 1540, 388, True, False), (1000, 388, 772, False, True)])


def check_matmul(rng, kernel, transpose_a, transpose_b, M, N, K, with_bias, accumulate,
                 **gelu):
    """matmul(..., kernel=kernel) of float32 operands against matmul_numpy in float64; gelu:
    out=True (gelu_out, checked too) or input=True (gelu_input)."""
    a = rng.standard_normal((K, M) if transpose_a else (M, K))
    b = rng.standard_normal((N, K) if transpose_b else (K, N))
    bias = rng.standard_normal(N) if with_bias else None
    out, prior = output_and_prior(rng, (M, N), accumulate)
    pre = 3 * rng.standard_normal((M, N))               # gelu_input: GELU's input
    activated = poisoned((M, N))                        # gelu_out: its output
    device_gelu = dict(gelu_out=activated) if gelu.get("out") else (
        dict(gelu_input=device(pre)) if gelu.get("input") else {})
    matmul.matmul(out, device(a), device(b), None if bias is None else device(bias),
                  transpose_a, transpose_b, accumulate, kernel=kernel, **device_gelu)
    want, want_activated = prior.astype(np.float64), np.zeros((M, N))
    host_gelu = dict(gelu_out=want_activated) if gelu.get("out") else (
        dict(gelu_input=pre) if gelu.get("input") else {})
    matmul.matmul_numpy(want, a, b, bias, transpose_a, transpose_b, accumulate, **host_gelu)
    assert relative_error(out.copy_to_host(), want) < TOLERANCE
    if gelu.get("out"):
        assert relative_error(activated.copy_to_host(), want_activated) < TOLERANCE


@pytest.mark.parametrize("transpose_a,transpose_b", ORIENTATIONS)
def test_matmul_reference(rng, transpose_a, transpose_b):
    for case in MATMUL_CASES:
        check_matmul(rng, "reference", transpose_a, transpose_b, *case)


def test_matmul_reference_with_gelu(rng):
    """gelu_out: the MLP's activation, a pass after the product, beside the pre-activation."""
    M, N, K = (12, 20, 16) if not GPU else (1024, 1536, 384)
    check_matmul(rng, "reference", False, False, M, N, K, True, False, out=True)


def test_matmul_reference_with_gelu_backward(rng):
    """gelu_input: the MLP's dH = (dY . W^T) * gelu'(H), the product then GELU's backward,
    added to what out holds."""
    M, N, K = (12, 20, 16) if not GPU else (1000, 1540, 388)
    check_matmul(rng, "reference", False, True, M, N, K, False, True, input=True)


def test_matmul_rejects_bad_shapes():
    a, b = device(np.zeros((3, 4))), device(np.zeros((5, 6)))
    with pytest.raises(ValueError, match="matmul b: expected shape"):
        matmul.matmul(device(np.zeros((3, 6))), a, b)
    with pytest.raises(ValueError, match="matmul b: expected shape"):
        matmul.matmul_numpy(np.zeros((3, 6)), np.zeros((3, 4)), np.zeros((5, 6)))


def test_matmul_reference_refuses_other_dtypes():
    """The kernel reads float32: a float64 operand is refused, not read as float32."""
    a, b = device(np.zeros((3, 4)), np.float64), device(np.zeros((4, 6)))
    with pytest.raises(ValueError, match="a: expected float32, got float64"):
        matmul.matmul(device(np.zeros((3, 6))), a, b, kernel="reference")
