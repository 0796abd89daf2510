"""The float32 product on the CUDA cores (kernels/matmul/float32.py: the register-blocked SGEMM)
against matmul_numpy, in every orientation, whole and split-K, with GELU's epilogues; its copy
of W^T (the transpose kernel); its kernels made once per compile-time parameters. The
kernel's block is 256 threads, the GPU's own, so the simulator takes few cases."""
import numpy as np
import pytest

from checks import ORIENTATIONS, TOLERANCE, device, poisoned, split_k
from conftest import GPU, relative_error
from nanoandrea.kernels import matmul
from nanoandrea.kernels.matmul import float32
from test_matmul_reference import MATMUL_CASES, check_matmul


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("transpose_a,transpose_b", ORIENTATIONS)
def test_matmul_float32(rng, monkeypatch, splits, transpose_a, transpose_b):
    """splits=3: split-K, three slices of K computed apart, then summed in a fixed order."""
    split_k(monkeypatch, splits)
    for case in MATMUL_CASES if GPU else MATMUL_CASES[:1]:     # (slow to simulate)
        check_matmul(rng, "float32", transpose_a, transpose_b, *case)


@pytest.mark.parametrize("splits", [1, 2])
def test_matmul_float32_with_gelu(rng, monkeypatch, splits):
    """gelu_out: the MLP's activation in the kernel's epilogue (after the sum of the slices
    with split-K), beside the pre-activation."""
    split_k(monkeypatch, splits)
    M, N, K = (12, 20, 16) if not GPU else (1024, 1536, 384)
    check_matmul(rng, "float32", False, False, M, N, K, True, False, out=True)


@pytest.mark.parametrize("splits,transpose_b,accumulate", [
    (1, True, False),       # the input gradient dH = dY . W^T, times gelu'(H)
    (1, False, True),       # the same product on W^T copied
    (2, True, True)])       # split-K: the sum of the slices first, then gelu'
def test_matmul_float32_with_gelu_backward(rng, monkeypatch, splits, transpose_b, accumulate):
    """gelu_input: the MLP's dH = (dY . W^T) * gelu'(H): out (+)= (a . op(b)) * gelu'(input)."""
    split_k(monkeypatch, splits)
    M, N, K = (12, 20, 16) if not GPU else (1000, 1540, 388)
    check_matmul(rng, "float32", False, transpose_b, M, N, K, False, accumulate, input=True)


@pytest.mark.parametrize("R,C", [(37, 45), (32, 64)] if not GPU else [(1000, 771), (768, 3072)])
def test_transpose(rng, R, C):
    x = rng.standard_normal((R, C))
    out = poisoned((C, R))
    matmul.transpose(out, device(x))
    want = np.zeros((C, R))
    matmul.transpose_numpy(want, x)
    assert np.array_equal(out.copy_to_host(), want.astype(np.float32))


@pytest.mark.parametrize("with_bias,accumulate,gelu_grad", [
    (True, False, False), (False, True, False), (False, True, True)])
def test_matmul_through_transposed_copy(rng, monkeypatch, with_bias, accumulate, gelu_grad):
    """With transpose_b and many rows the float32 kernel multiplies by a transposed copy of b
    (made by its launcher, or given: b_transposed) instead of transposing b's slices in the
    kernel. The copy only moves data: all three add the same products in the same order, bit
    for bit."""
    M, N, K = (20, 24, 36) if not GPU else (2048, 3072, 772)
    if not GPU:                         # (so that tiny products take the copy too)
        monkeypatch.setattr(float32, "TRANSPOSED_COPY_MIN_ROWS", 16)
    a, b = device(rng.standard_normal((M, K))), rng.standard_normal((N, K))
    bias = device(rng.standard_normal(N)) if with_bias else None
    pre = device(3 * rng.standard_normal((M, N))) if gelu_grad else None
    prior = rng.standard_normal((M, N))
    b_t = poisoned((K, N))
    matmul.transpose(b_t, device(b))
    outs = []
    for min_rows, given in ((None, None), (None, b_t), (10**9, None)):     # copy, given, none
        if min_rows:
            monkeypatch.setattr(float32, "TRANSPOSED_COPY_MIN_ROWS", min_rows)
        assert matmul.copies_b_transposed(M, N, False, True) == (min_rows is None)
        out = device(prior) if accumulate else poisoned((M, N))
        matmul.matmul(out, a, device(b), bias, transpose_b=True, accumulate=accumulate,
                      kernel="float32", gelu_input=pre, b_transposed=given)
        outs.append(out.copy_to_host())
    want = prior.copy() if accumulate else np.zeros((M, N))
    matmul.matmul_numpy(want, a.copy_to_host(), b, None if bias is None else bias.copy_to_host(),
                        transpose_b=True, accumulate=accumulate,
                        gelu_input=None if pre is None else pre.copy_to_host())
    assert relative_error(outs[0], want) < TOLERANCE
    assert np.array_equal(outs[0], outs[1]) and np.array_equal(outs[0], outs[2])


def test_matmul_float32_refuses_rows_not_16_byte_runs():
    """The kernel loads 16 bytes at a time: rows of a width that is not a multiple of 4 floats
    are refused (the dispatch sends them to the reference kernel: test_matmul_dispatch.py)."""
    for M, N, K in [(10, 21, 12), (10, 20, 13)]:
        out, a, b = (device(np.zeros(shape)) for shape in ((M, N), (M, K), (K, N)))
        with pytest.raises(ValueError, match="16-byte"):
            matmul.matmul(out, a, b, kernel="float32")


def test_matmul_kernels_made_once_per_parameters():
    """A kernel factory makes one kernel per set of compile-time parameters (defaults filled
    in) and names it by them; an unknown epilogue is refused."""
    kernel = float32.matmul_kernel(False, True)
    assert float32.matmul_kernel(False, True, None) is kernel
    assert float32.matmul_kernel(False, True, "gelu_grad") is not kernel
    assert kernel.made_by == ("nanoandrea.kernels.matmul.float32", "matmul_kernel",
                              (False, True, None))
    with pytest.raises(ValueError, match="unknown epilogue"):
        float32.matmul_kernel(False, False, "relu")
