"""The tensor-core attention (kernels/attention_bf16.py) against its NumPy twin: attention of
q, k, v (and dout) rounded to bf16, in float64. What is left between them is the rounding of
P and dS to bf16 inside the kernels: bf16's tolerance, ~1e-2 of the result's norm. A fragment
in the wrong lane or register is an error of order 1."""
import numpy as np
import pytest

from conftest import GPU, relative_error
from nanoandrea.kernels import attention, attention_bf16
from test_kernels import DeviceHeads, device, device_at, poisoned, recording_launches

TOLERANCE = 1.5e-2


def check_attention_bf16(rng, B, H, T, D, dropout_p, in_concat=False, kernel="auto"):
    """kernel: attention_bf16's choice of tensor-core kernels ("auto", "mma", "wgmma")."""
    seed = np.array([4242], dtype=np.int64)
    drop_numpy = dict(dropout_p=dropout_p, seed=seed, site=3)
    drop = dict(drop_numpy, seed=device(seed, np.int64), kernel=kernel)
    q, k, v, dout = (rng.standard_normal((B, H, T, D)) for _ in range(4))
    out, lse = DeviceHeads(np.full((B, H, T, D), np.nan), in_concat), poisoned((B, H, T))
    dq_q, dk_q, dv_q = (device_at(x.astype(np.float32), 0) for x in (q, k, v))
    d_dout = DeviceHeads(dout.astype(np.float32), in_concat).array
    attention_bf16.attention_forward_bf16(out.array, lse, dq_q, dk_q, dv_q, **drop)
    want_out, want_lse = np.empty((B, H, T, D)), np.empty((B, H, T))
    attention_bf16.attention_forward_bf16_numpy(want_out, want_lse, q, k, v, **drop_numpy)
    assert relative_error(out.host(), want_out) < TOLERANCE
    assert relative_error(lse.copy_to_host(), want_lse) < 1e-3     # (float32 all the way)

    for accumulate in (False, True):
        priors = [rng.standard_normal((B, H, T, D)).astype(np.float32) if accumulate else
                  np.full((B, H, T, D), np.nan) for _ in range(3)]
        grads = [DeviceHeads(prior, in_concat) for prior in priors]
        attention_bf16.attention_backward_bf16(*[g.array for g in grads], poisoned((B, H, T)),
                                               d_dout, dq_q, dk_q, dv_q, out.array, lse,
                                               accumulate, **drop)
        want = [prior.astype(np.float64) for prior in priors]
        attention_bf16.attention_backward_bf16_numpy(*want, np.empty((B, H, T)), dout, q, k, v,
                                                     want_out, want_lse, accumulate,
                                                     **drop_numpy)
        for got, expected, name in zip(grads, want, ("dq", "dk", "dv")):
            assert relative_error(got.host(), expected) < TOLERANCE, name


# (in the simulator a block is 32 rows and a tile 16: T = 33 is two blocks of rows, three tiles,
# the last one row)
@pytest.mark.parametrize("D,dropout_p", [(32, 0.0), (32, 0.3), (64, 0.3)] if not GPU else
                         [(D, p) for D in attention_bf16.HEAD_SIZES for p in (0.0, 0.3)])
@pytest.mark.parametrize("B,H,T", [(1, 1, 33)] if not GPU else [(4, 12, 256), (1, 2, 1000)])
def test_attention_bf16(rng, D, dropout_p, B, H, T):
    check_attention_bf16(rng, B, H, T, D, dropout_p, kernel="mma")   # (Hopper's: wgmma's test)


def test_attention_bf16_writes_the_heads_concat(rng):
    check_attention_bf16(rng, 1, 2, 20 if not GPU else 300, 32, 0.2, in_concat=True,
                         kernel="mma")


def test_attention_bf16_takes_the_tensor_cores(rng, monkeypatch):
    """D = 64 runs the three kernels here (named: on Hopper "auto" takes wgmma's); D = 72 (no
    kernel of its size) attention.py's float32 reference kernels, correct to float32's
    tolerance."""
    B, H, T = 1, 1, 9
    for D, kernel, expected in ((64, "mma", [attention_bf16.forward_kernel(64, False),
                                             attention_bf16.dq_kernel(64, False),
                                             attention_bf16.dkdv_kernel(64, False)]),
                                (72, "auto", [
                                    attention.reference_forward_kernel(attention.lane_dims(72)),
                                    attention.reference_dq_kernel(attention.lane_dims(72)),
                                    attention.reference_dkdv_kernel(attention.lane_dims(72))])):
        launched = recording_launches(monkeypatch, attention_bf16)
        launched_fp32 = recording_launches(monkeypatch, attention)
        q, k, v, dout = (device(rng.standard_normal((B, H, T, D))) for _ in range(4))
        out, lse = poisoned((B, H, T, D)), poisoned((B, H, T))
        attention_bf16.attention_forward_bf16(out, lse, q, k, v, kernel=kernel)
        grads = [poisoned((B, H, T, D)) for _ in range(3)]
        attention_bf16.attention_backward_bf16(*grads, poisoned((B, H, T)), dout, q, k, v, out,
                                               lse, kernel=kernel)
        assert all(any(made is x for x in launched + launched_fp32) for made in expected)
        host = [x.copy_to_host().astype(np.float64) for x in (q, k, v, dout)]
        want_out, want_lse = np.empty((B, H, T, D)), np.empty((B, H, T))
        attention.attention_forward_numpy(want_out, want_lse, *host[:3])
        tolerance = 1e-5 if D == 72 else TOLERANCE
        assert relative_error(out.copy_to_host(), want_out) < tolerance
        want = [np.empty((B, H, T, D)) for _ in range(3)]
        attention.attention_backward_numpy(*want, np.empty((B, H, T)), host[3], *host[:3],
                                           want_out, want_lse)
        for got, expected_grad in zip(grads, want):
            assert relative_error(got.copy_to_host(), expected_grad) < tolerance


@pytest.mark.parametrize("D", attention_bf16.HEAD_SIZES)
def test_delta_and_dout_bf16(rng, D):
    """The backward's first pass against its twin, dout and out views of the heads' concat (as
    the model's are): dout's bf16 pairs the same to the bit as heads_bf16's, delta float32's
    sum. B*H*T rows not a multiple of a warp's: the lanes past the last row store nothing."""
    B, H, T = (1, 2, 7) if not GPU else (3, 12, 301)
    dout, out = (DeviceHeads(rng.standard_normal((B, H, T, D)).astype(np.float32), True)
                 for _ in range(2))
    delta = poisoned((B, H, T))
    words = attention_bf16.delta_and_dout_bf16(delta, dout.array, out.array).words
    want_delta = np.empty((B, H, T))
    want_words = attention_bf16.delta_and_dout_bf16_numpy(want_delta, dout.host().astype(
        np.float64), out.host().astype(np.float64))
    np.testing.assert_array_equal(words.copy_to_host(), want_words)
    np.testing.assert_array_equal(words.copy_to_host(),
                                  attention_bf16.heads_bf16(dout.array).words.copy_to_host())
    assert relative_error(delta.copy_to_host(), want_delta) < 1e-6


def test_attention_bf16_rounds_its_operands_once(rng, monkeypatch):
    """q, k, v given as Bf16Heads (heads_operand, what the model's attention hands over): the
    forward and the backward launch no rounding of them (the backward rounds dout alone), and
    every result is the same to the bit as from float32 q, k, v. D = 72 has no bf16 kernel:
    heads_operand leaves it float32, and attention.py's kernels read it."""
    B, H, T, D = 1, 2, 20 if not GPU else 300, 32
    q, k, v, dout = (device(rng.standard_normal((B, H, T, D))) for _ in range(4))

    def run(operands):
        out, lse = poisoned((B, H, T, D)), poisoned((B, H, T))
        attention_bf16.attention_forward_bf16(out, lse, *operands)
        grads = [poisoned((B, H, T, D)) for _ in range(3)]
        attention_bf16.attention_backward_bf16(*grads, poisoned((B, H, T)), dout, *operands,
                                               out, lse)
        return [x.copy_to_host() for x in (out, lse, *grads)]

    want = run((q, k, v))
    operands = [attention_bf16.heads_operand(x) for x in (q, k, v)]
    assert all(isinstance(x, attention_bf16.Bf16Heads) for x in operands)
    launched = recording_launches(monkeypatch, attention_bf16)
    got = run(operands)
    assert launched.count(attention_bf16.heads_bf16_kernel) == 0
    # dout's copy: with delta in a pass of its own, or on Hopper by the dq kernel as it stages
    wgmma = attention_bf16._on_tensor_cores("auto", D, ()) == "wgmma"
    assert launched.count(attention_bf16.delta_and_dout_kernel(D)) == (0 if wgmma else 1)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    wide = device(rng.standard_normal((B, H, 4, 72)))
    assert attention_bf16.heads_operand(wide) is wide


def test_bf16_attention_reads_the_heads_from_the_fused_tensors(rng, monkeypatch):
    """ops.attention in bf16: q, k, v split from [B,T,C] tensors (split_heads) are rounded
    straight from those (a heads_view), so no float32 copy of the heads is made; the output and
    the gradients of the fused tensors are the same to the bit as with the copies made. A
    reader of the float32 heads (the sampling's cache) still gets the split."""
    from nanoandrea import ops
    from nanoandrea.autograd import Tensor
    from nanoandrea.backend import get_backend
    from nanoandrea.kernels import heads
    backend = get_backend("cuda", precision="bf16")
    B, T, H, D = 1, 20 if not GPU else 300, 2, 32
    fused = [rng.standard_normal((B, T, H * D)).astype(np.float32) for _ in range(3)]
    dy = device(rng.standard_normal((B, T, H * D)))

    def run(split_first):
        leaves = [Tensor(device(x), backend, requires_grad=True) for x in fused]
        q, k, v = (ops.split_heads(x, H) for x in leaves)
        if split_first:
            for t in (q, k, v):
                t.split()
        y = ops.merge_heads(ops.attention(q, k, v))
        y.backward(dy)
        return [x.copy_to_host() for x in (y.data, *(t.grad for t in leaves))], q

    want, _ = run(True)
    launched = recording_launches(monkeypatch, heads)
    got, q = run(False)
    assert heads.split_heads4_kernel not in launched
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    np.testing.assert_array_equal(q.data.copy_to_host(),
                                  fused[0].reshape(B, T, H, D).transpose(0, 2, 1, 3))
    assert heads.split_heads4_kernel in launched
