"""The mma.sync attention (kernels/attention/mma_sync.py) against its NumPy twin: attention of
q, k, v (and dout) rounded to bf16, in float64. What is left between them is the rounding of
P and dS to bf16 inside the kernels: bf16's tolerance, ~1e-2 of the result's norm. A fragment
in the wrong lane or register is an error of order 1. The kernels are named (kernel="mma"), so
that a GPU that runs wgmma runs them too. `check_attention_bf16` serves the wgmma kernels'
tests (test_attention_wgmma.py)."""
import numpy as np
import pytest

from checks import DeviceHeads, device, device_at, poisoned
from conftest import GPU, relative_error
from nanoandrea.kernels import attention, heads, operands
from nanoandrea.kernels.attention import mma_sync

TOLERANCE = 1.5e-2


def check_attention_bf16(rng, B, H, T, D, dropout_p, in_concat=False, kernel="auto"):
    """kernel: the tensor-core kernels named ("mma", "wgmma"), or "auto". in_concat: out and
    the gradients are views of [B,T,C] concats, as the model's, and the forward writes out's
    bf16 copy too (out_bf16, as W_O's product reads it): round_bf16's bits of out."""
    seed = np.array([4242], dtype=np.int64)
    drop_numpy = dict(dropout_p=dropout_p, seed=seed, site=3)
    drop = dict(drop_numpy, seed=device(seed, np.int64), kernel=kernel)
    q, k, v, dout = (rng.standard_normal((B, H, T, D)) for _ in range(4))
    out, lse = DeviceHeads(np.full((B, H, T, D), np.nan), in_concat), poisoned((B, H, T))
    dq_q, dk_q, dv_q = (device_at(x.astype(np.float32), 0) for x in (q, k, v))
    d_dout = DeviceHeads(dout.astype(np.float32), in_concat).array
    copy = operands.Bf16Matrix.allocate((B * T, H * D), lambda shape, dtype: device(
        np.full(shape, 0xFFFFFFFF), dtype)) if in_concat else None    # (poisoned: NaN pairs)
    attention.attention_forward_bf16(out.array, lse, dq_q, dk_q, dv_q, **drop, out_bf16=(
        None if copy is None else heads.bf16_heads_view(copy, B, H)))
    want_out, want_lse = np.empty((B, H, T, D)), np.empty((B, H, T))
    want_copy = operands.Bf16Matrix.allocate((B * T, H * D), np.empty) if in_concat else None
    attention.attention_forward_bf16_numpy(want_out, want_lse, q, k, v, **drop_numpy, out_bf16=(
        None if want_copy is None else heads.bf16_heads_view_numpy(want_copy, B, H)))
    assert relative_error(out.host(), want_out) < TOLERANCE
    if copy is not None:                # (the twin's copy: its out rounded; the kernels' below)
        np.testing.assert_array_equal(operands.bf16_matrix_values(want_copy),
                                      operands.bf16_matrix_values(want_out.astype(np.float32)
                                                                  .transpose(0, 2, 1, 3)
                                                                  .reshape(B * T, H * D)))
        rounded = operands.Bf16Matrix.allocate((B * T, H * D), np.empty)
        operands.round_bf16_numpy(rounded, out.base.copy_to_host().reshape(B * T, H * D))
        np.testing.assert_array_equal(copy.bf16_pairs.copy_to_host(), rounded.bf16_pairs)
    assert relative_error(lse.copy_to_host(), want_lse) < 1e-3     # (float32 all the way)

    for accumulate in (False, True):
        priors = [rng.standard_normal((B, H, T, D)).astype(np.float32) if accumulate else
                  np.full((B, H, T, D), np.nan) for _ in range(3)]
        grads = [DeviceHeads(prior, in_concat) for prior in priors]
        attention.attention_backward_bf16(*[g.array for g in grads], poisoned((B, H, T)),
                                          d_dout, dq_q, dk_q, dv_q, out.array, lse,
                                          accumulate, **drop)
        want = [prior.astype(np.float64) for prior in priors]
        attention.attention_backward_bf16_numpy(*want, np.empty((B, H, T)), dout, q, k, v,
                                                want_out, want_lse, accumulate, **drop_numpy)
        for got, expected, name in zip(grads, want, ("dq", "dk", "dv")):
            assert relative_error(got.host(), expected) < TOLERANCE, name


# (in the simulator a block is 32 rows and a tile 16: T = 33 is two blocks of rows, three tiles,
# the last one row)
@pytest.mark.parametrize("D,dropout_p", [(32, 0.0), (32, 0.3), (64, 0.3)] if not GPU else
                         [(D, p) for D in mma_sync.HEAD_SIZES for p in (0.0, 0.3)])
@pytest.mark.parametrize("B,H,T", [(1, 1, 33)] if not GPU else [(4, 12, 256), (1, 2, 1000)])
def test_attention_mma(rng, D, dropout_p, B, H, T):
    check_attention_bf16(rng, B, H, T, D, dropout_p, kernel="mma")


def test_attention_mma_writes_the_heads_concat(rng):
    check_attention_bf16(rng, 1, 2, 20 if not GPU else 300, 32, 0.2, in_concat=True,
                         kernel="mma")


@pytest.mark.parametrize("D", mma_sync.HEAD_SIZES)
def test_delta_and_dout_bf16(rng, D):
    """The backward's first pass against its twin, dout and out views of the heads' concat (as
    the model's are): dout's bf16 pairs the same to the bit as heads_bf16's, delta float32's
    sum. B*H*T rows not a multiple of a warp's: the lanes past the last row store nothing."""
    B, H, T = (1, 2, 7) if not GPU else (3, 12, 301)
    dout, out = (DeviceHeads(rng.standard_normal((B, H, T, D)).astype(np.float32), True)
                 for _ in range(2))
    delta = poisoned((B, H, T))
    pairs = mma_sync.delta_and_dout_bf16(delta, dout.array, out.array).bf16_pairs
    want_delta = np.empty((B, H, T))
    want_pairs = mma_sync.delta_and_dout_bf16_numpy(want_delta, dout.host().astype(
        np.float64), out.host().astype(np.float64))
    np.testing.assert_array_equal(pairs.copy_to_host(), want_pairs)
    np.testing.assert_array_equal(pairs.copy_to_host(),
                                  operands.heads_bf16(dout.array).bf16_pairs.copy_to_host())
    assert relative_error(delta.copy_to_host(), want_delta) < 1e-6
