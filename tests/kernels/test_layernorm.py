"""The layer norm (kernels/layernorm.py) beyond its twin (test_twins.py): which kernels take
which rows, the backward's gradient written beside its prior, the fused residual forward the
same bits as add then layer norm, and the forwards writing bf16 as the next products read it."""
import numpy as np
import pytest

from checks import TOLERANCE, WIDTH, device, output_and_prior, poisoned
from conftest import GPU, relative_error
from nanoandrea.kernels import elementwise, layernorm
from nanoandrea.kernels.operands import Bf16Matrix, device_empty, round_bf16_numpy


@pytest.mark.parametrize("C", [WIDTH, 128, 96, 200, 1024, 77, 1028, layernorm.ROW_CACHE + 13])
def test_warp_kernels_take_rows_of_whole_16_byte_runs_up_to_1024(C):
    """The warp kernels for C % 4 == 0 up to 1024 columns (every lane full at 128; the last
    group of columns partly empty at 96 and 200), 16-byte aligned; the block kernels for the
    rest."""
    out = device(np.zeros((3, C)))
    assert bool(layernorm.warp_vectors(C, out)) == (C % 4 == 0 and C <= 1024)
    if C % 4 == 0 and C <= 1024:
        assert not layernorm.warp_vectors(C, device(np.zeros(3 * C + 1))[1:].reshape(3, C))


def backward_inputs(rng, N, C):
    """x [N, C] (host), weight (host), mean and rstd of x's layer norm (device) and a random
    dout (device): what a backward reads."""
    x = 3.0 + 2.0 * rng.standard_normal((N, C))
    weight, bias = 1 + 0.2 * rng.standard_normal(C), rng.standard_normal(C)
    mean, rstd = poisoned(N), poisoned(N)
    layernorm.layernorm_forward(poisoned((N, C)), mean, rstd, device(x), device(weight),
                                device(bias))
    return x, weight, mean, rstd, device(rng.standard_normal((N, C)))


@pytest.mark.parametrize("N,C", [(20, WIDTH), (20, 77)])
def test_layernorm_backward_beside_its_prior(rng, N, C):
    """dx = prior + the gradient, prior another array (out of place), left as it was: the same
    bits as the gradient added onto the prior in place."""
    x, weight, mean, rstd, dout = backward_inputs(rng, N, C)
    dx, prior = output_and_prior(rng, (N, C), True)
    dweight, dbias = device(np.zeros(C)), device(np.zeros(C))
    layernorm.layernorm_backward(dx, dweight, dbias, dout, device(x), device(weight), mean, rstd,
                                 True)
    apart, prior_array = poisoned((N, C)), device(prior)
    layernorm.layernorm_backward(apart, dweight, dbias, dout, device(x), device(weight), mean,
                                 rstd, True, prior=prior_array)
    assert np.array_equal(apart.copy_to_host(), dx.copy_to_host())
    assert np.array_equal(prior_array.copy_to_host(), prior), "prior left as it was"


# C = 40 and 128: the warp kernels; 77: not a multiple of 4; the last C is wider than the shared
# row cache (and than the warp kernels take)
@pytest.mark.parametrize("N,C", [(6, 40), (5, 128), (3, 77), (2, layernorm.ROW_CACHE + 13)]
                         if not GPU else
                         [(16384, 384), (8192, 768), (300, 77), (300, layernorm.ROW_CACHE + 13)])
def test_residual_layernorm_is_add_then_layernorm(rng, N, C):
    """The fused residual forward: the same arithmetic as add + layernorm, bit for bit."""
    a, b = 3.0 + 2.0 * rng.standard_normal((N, C)), rng.standard_normal((N, C))
    weight, bias = 1 + 0.2 * rng.standard_normal(C), rng.standard_normal(C)
    outputs = [poisoned((N, C)), poisoned((N, C)), poisoned(N), poisoned(N)]     # resid, out, ...
    params = device(weight), device(bias)
    layernorm.residual_layernorm_forward(*outputs, device(a), device(b), *params)
    unfused = [poisoned((N, C)), poisoned((N, C)), poisoned(N), poisoned(N)]
    elementwise.add(unfused[0], device(a), device(b))
    layernorm.layernorm_forward(unfused[1], unfused[2], unfused[3], unfused[0], *params)
    for got, expected in zip(outputs, unfused):
        assert np.array_equal(got.copy_to_host(), expected.copy_to_host())


@pytest.mark.parametrize("C", [48, 20, 9])
def test_layernorm_writes_bf16(rng, C):
    """The forwards with out a Bf16Matrix (bf16 training): the float32 output rounded, to the
    bit; C = 48 by the warp kernel's bf16 pairs (8 columns a 16 bytes), 20 and 9 through float32.
    The twins likewise."""
    N = 12 if not GPU else 4096
    a, b = 3.0 + 2.0 * rng.standard_normal((N, C)), rng.standard_normal((N, C))
    weight, bias = 1 + 0.2 * rng.standard_normal(C), rng.standard_normal(C)
    params = device(weight), device(bias)
    for fused in (False, True):
        floats, bf16_out = poisoned((N, C)), Bf16Matrix.allocate((N, C), device_empty)
        stats = [poisoned(N) for _ in range(4)]
        for out, (mean, rstd) in ((floats, stats[:2]), (bf16_out, stats[2:])):
            if fused:
                layernorm.residual_layernorm_forward(poisoned((N, C)), out, mean, rstd, device(a),
                                                     device(b), *params)
            else:
                layernorm.layernorm_forward(out, mean, rstd, device(a), *params)
        want = Bf16Matrix.allocate((N, C), np.empty)
        round_bf16_numpy(want, floats.copy_to_host())
        assert np.array_equal(bf16_out.bf16_pairs.copy_to_host(), want.bf16_pairs)
        host = Bf16Matrix.allocate((N, C), np.empty)
        layernorm.layernorm_forward_numpy(host, np.empty(N), np.empty(N), a, weight, bias)
        values = np.empty((N, C))
        layernorm.layernorm_forward_numpy(values, np.empty(N), np.empty(N), a, weight, bias)
        round_bf16_numpy(want, values.astype(np.float32))
        assert np.array_equal(host.bf16_pairs, want.bf16_pairs)


@pytest.mark.parametrize("accumulate", [False, True], ids=["=", "+="])
@pytest.mark.parametrize("N,C", [(20, 40), (20, 36), (20, 77)] if not GPU else
                         [(16384, 768), (300, 36), (300, 77)])
def test_layernorm_backward_writes_dx_in_bf16_too(rng, N, C, accumulate):
    """dx_bf16: dx also as a Bf16Matrix, the bits round_bf16 makes of dx (written by the warp
    kernel where C % 8 == 0, by a rounding pass after the others: C = 36, 77); dx, dweight and
    dbias the same bits as without it. The twin alike."""
    x, weight, mean, rstd, dout = backward_inputs(rng, N, C)
    prior = rng.standard_normal((N, C))
    results = []
    for dx_bf16 in (None, Bf16Matrix.allocate((N, C), device_empty)):
        dx = device(prior) if accumulate else poisoned((N, C))
        dweight, dbias = device(np.zeros(C)), device(np.zeros(C))
        layernorm.layernorm_backward(dx, dweight, dbias, dout, device(x), device(weight), mean,
                                     rstd, accumulate, dx_bf16=dx_bf16)
        results.append([a.copy_to_host() for a in (dx, dweight, dbias)])
    for got, want in zip(*results):
        assert np.array_equal(got, want)
    rounded = Bf16Matrix.allocate((N, C), np.empty)
    round_bf16_numpy(rounded, results[0][0])
    assert np.array_equal(dx_bf16.bf16_pairs.copy_to_host(), rounded.bf16_pairs)
    twin, twin_dx = Bf16Matrix.allocate((N, C), np.empty), prior.astype(np.float32)
    layernorm.layernorm_backward_numpy(twin_dx, np.zeros(C), np.zeros(C), dout.copy_to_host(),
                                       x, weight, mean.copy_to_host(), rstd.copy_to_host(),
                                       accumulate, dx_bf16=twin)
    assert relative_error(twin_dx, results[0][0]) < TOLERANCE
    round_bf16_numpy(rounded, twin_dx)
    assert np.array_equal(twin.bf16_pairs, rounded.bf16_pairs)
