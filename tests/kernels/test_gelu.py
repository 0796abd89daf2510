"""GELU (kernels/gelu.py) element by element against float64 over [-12, 12], in float32 epsilons
scaled by the condition number: the exact forms (the element-wise kernels, both of them) and
the special-function unit's (the bf16 products' epilogues). (Against the twin: test_twins.py.)"""
import numpy as np
import pytest
from numba import cuda

from checks import device, poisoned
from nanoandrea.kernels import gelu


def gelu_errors(x, out, dx):
    """gelu(x) = out and gelu'(x) = dx, element by element against float64, in float32 epsilons
    scaled by the condition number 1 + 2|u| (the float32 rounding of u = sqrt(2/pi)(x + 0.044715
    x^3) alone moves exp(-2u) by that many epsilons), plus 1e-35 where the result is below the
    smallest normal float32. The reference is x s, s = 1/(1 + exp(-2u)) = 0.5 (1 + tanh(u)): in
    float64, 0.5 x (1 + tanh(u)) itself cancels to 0 for x < -7. The largest of each."""
    x64 = x.astype(np.float64)
    u = np.sqrt(2 / np.pi) * (x64 + 0.044715 * x64 ** 3)
    s = 1 / (1 + np.exp(-2 * u))
    assert np.allclose(s[np.abs(x) < 3], 0.5 * (1 + np.tanh(u[np.abs(x) < 3])), rtol=1e-14)
    slope_term = 2 * x64 * s * (1 - s) * np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * x64 ** 2)
    scale = np.finfo(np.float32).eps * (1 + 2 * np.abs(u))
    forward_error = np.abs(out - x64 * s) / (scale * np.abs(x64 * s) + 1e-35)
    backward_error = np.abs(dx - (s + slope_term)) / (scale * (s + np.abs(slope_term)) + 1e-35)
    return ((forward_error.max(), x[forward_error.argmax()]),
            (backward_error.max(), x[backward_error.argmax()]))


@pytest.mark.parametrize("n", [4000, 4001])            # the 16-byte and the one-element kernels
def test_gelu_accuracy_element_by_element(n):
    """Every element of gelu and gelu' over [-12, 12] against float64, within 4 of gelu_errors'
    scaled epsilons."""
    x = np.linspace(-12, 12, n).astype(np.float32)
    out, dx = poisoned(n), poisoned(n)
    gelu.gelu_forward(out, device(x))
    gelu.gelu_backward(dx, device(np.ones(n)), device(x))
    (forward, at), (backward, at_b) = gelu_errors(x, out.copy_to_host(), dx.copy_to_host())
    assert forward < 4, f"gelu: {forward} at x = {at}"
    assert backward < 4, f"gelu': {backward} at x = {at_b}"


@cuda.jit
def gelu_sfu_kernel(out, dx, x):
    i = cuda.grid(1)
    if i < x.size:
        out[i] = gelu.gelu_value_sfu(x[i])
        dx[i] = gelu.gelu_derivative_sfu(x[i])


def test_gelu_sfu_accuracy_element_by_element():
    """gelu_value_sfu and gelu_derivative_sfu (the bf16 products' epilogues: exp and the
    division on the special-function unit, kernels/ptx/sfu.py) over [-12, 12] against float64:
    within 16 of gelu_errors' scaled epsilons, ~2^-19 at most where a bf16 rounding is 2^-9
    (the exact forms' bound is 4; in the simulator the twins are exact)."""
    n = 4001
    x = np.linspace(-12, 12, n).astype(np.float32)
    out, dx = poisoned(n), poisoned(n)
    gelu_sfu_kernel[(n + 127) // 128, 128](out, dx, device(x))
    (forward, at), (backward, at_b) = gelu_errors(x, out.copy_to_host(), dx.copy_to_host())
    assert forward < 16, f"gelu: {forward} at x = {at}"
    assert backward < 16, f"gelu': {backward} at x = {at_b}"
