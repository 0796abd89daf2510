"""The reference attention (kernels/attention/reference.py: a warp a row, any head size) against
attention_forward_numpy / attention_backward_numpy, the definition, with and without dropout,
writing the heads' concat too. `check_attention` serves the float32 flash kernels' tests
(test_attention_float32.py) and the dispatch's (test_attention_dispatch.py)."""
import numpy as np
import pytest

from checks import TOLERANCE, DeviceHeads, device, device_at, poisoned
from conftest import GPU, relative_error
from nanoandrea.kernels import attention


def check_attention(rng, D, kernel, rows_per_block, B, H, T, dropout_p, offset=0,
                    in_concat=False):
    """attention_forward, then attention_backward (= and +=), against the NumPy twins; q, k, v
    and dout `offset` floats past the start of their allocations (device_at). in_concat: out,
    dout and the gradients are heads views of [B,T,C] arrays (DeviceHeads), as the model has
    them."""
    seed = np.array([424242], dtype=np.int64)
    drop = dict(dropout_p=dropout_p, seed=device(seed, np.int64), site=5)
    drop_numpy = dict(drop, seed=seed)
    q, k, v, dout = (rng.standard_normal((B, H, T, D)) for _ in range(4))
    out, lse = DeviceHeads(np.full((B, H, T, D), np.nan), in_concat), poisoned((B, H, T))
    dq_q, dk_q, dv_q = (device_at(x.astype(np.float32), offset) for x in (q, k, v))
    d_dout = DeviceHeads(dout.astype(np.float32), in_concat, offset).array
    attention.attention_forward(out.array, lse, dq_q, dk_q, dv_q, kernel=kernel,
                                rows_per_block=rows_per_block, **drop)
    want_out, want_lse = np.empty((B, H, T, D)), np.empty((B, H, T))
    attention.attention_forward_numpy(want_out, want_lse, q, k, v, **drop_numpy)
    assert relative_error(out.host(), want_out) < TOLERANCE
    assert relative_error(lse.copy_to_host(), want_lse) < TOLERANCE

    for accumulate in (False, True):
        priors = [rng.standard_normal((B, H, T, D)).astype(np.float32) if accumulate else
                  np.full((B, H, T, D), np.nan) for _ in range(3)]
        grads = [DeviceHeads(prior, in_concat) for prior in priors]
        delta = poisoned((B, H, T))
        attention.attention_backward(*[g.array for g in grads], delta, d_dout, dq_q, dk_q,
                                     dv_q, out.array, lse, accumulate, kernel=kernel,
                                     rows_per_block=rows_per_block, **drop)
        want = [prior.astype(np.float64) for prior in priors]
        attention.attention_backward_numpy(*want, np.empty((B, H, T)), dout, q, k, v, want_out,
                                           want_lse, accumulate, **drop_numpy)
        for got, expected, name in zip(grads, want, ("dq", "dk", "dv")):
            assert relative_error(got.host(), expected) < TOLERANCE, name


# the lanes of a row hold 1, 2 or 3 of its values on the GPU, some lanes none (8, 40); in the
# simulator one thread holds a row (reference.LANES)
@pytest.mark.parametrize("D", [8, 16, 32, 40, 64, 72] + ([384] if GPU else []))
@pytest.mark.parametrize("B,H,T", [(2, 2, 7)] if not GPU else [(4, 12, 256), (1, 2, 1024)])
@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_attention_reference(rng, D, B, H, T, dropout_p):
    check_attention(rng, D, "reference", None, B, H, T, dropout_p)


def test_attention_reference_writes_the_heads_concat(rng):
    """out, and backward's dq, dk, dv, written through heads views of [B,T,C] arrays (merge
    heads done by the store), dout read through one: the same values as contiguous arrays."""
    B, H, T = (2, 3, 7) if not GPU else (4, 12, 256)
    check_attention(rng, 8, "reference", None, B, H, T, 0.3, in_concat=True)


def test_attention_reference_reads_unaligned_heads(rng):
    """q, k, v and dout 1 float past a 16-byte boundary: the reference kernels read them as any
    other (the flash kernels refuse them: test_attention_dispatch.py)."""
    check_attention(rng, 32, "reference", None, 1, 2, 9, 0.3, offset=1)
