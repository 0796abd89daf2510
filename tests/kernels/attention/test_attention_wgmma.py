"""The wgmma attention (kernels/attention/wgmma.py) against the bf16 attention's NumPy twin:
attention of q, k, v (and dout) rounded to bf16, in float64, within bf16's tolerance (the
rounding of P and dS inside the kernels), the same check as the mma.sync kernels'
(test_attention_mma.py). A block is a whole warpgroup (128 threads) in the simulator too, so
its cases are few: T = 80 is two blocks of 64 rows and, with the simulator's streamed tiles of
16, up to five tiles a block, the last one partly past T.
"""
import numpy as np
import pytest
from numba import cuda

from checks import device, poisoned, recording_launches
from conftest import GPU
from nanoandrea.kernels import attention
from nanoandrea.kernels.attention import wgmma
from nanoandrea.kernels.runtime import device as runtime_device
from test_attention_mma import check_attention_bf16

if GPU and cuda.get_current_device().compute_capability != (9, 0):
    pytest.skip("wgmma needs compute capability 9.0 (sm_90a)", allow_module_level=True)


@pytest.mark.parametrize("D,dropout_p", [(32, 0.0), (64, 0.3)] if not GPU else
                         [(D, p) for D in wgmma.HEAD_SIZES for p in (0.0, 0.3)])
@pytest.mark.parametrize("B,H,T", [(1, 1, 80)] if not GPU else [(4, 12, 256), (1, 2, 1000)])
def test_attention_wgmma(rng, D, dropout_p, B, H, T):
    check_attention_bf16(rng, B, H, T, D, dropout_p, kernel="wgmma")


@pytest.mark.skipif(not GPU, reason="the simulator's case above covers the same code")
def test_attention_wgmma_writes_the_heads_concat(rng):
    check_attention_bf16(rng, 2, 3, 300, 64, 0.2, in_concat=True, kernel="wgmma")


@pytest.mark.skipif(not GPU, reason="wgmma is taken on a GPU of compute capability 9.0 only")
def test_attention_bf16_takes_wgmma_on_hopper(rng, monkeypatch):
    """On compute capability 9.0 the bf16 attention's heads of D = 32 and 64 go to the wgmma
    kernels, and give the same results as naming them."""
    assert runtime_device.runs_wgmma()
    B, H, T, D = 2, 2, 200, 64
    q, k, v, dout = (device(rng.standard_normal((B, H, T, D))) for _ in range(4))
    results = []
    for kernel in ("auto", "wgmma"):
        launched = recording_launches(monkeypatch, wgmma)
        out, lse = poisoned((B, H, T, D)), poisoned((B, H, T))
        attention.attention_forward_bf16(out, lse, q, k, v, kernel=kernel)
        grads = [poisoned((B, H, T, D)) for _ in range(3)]
        attention.attention_backward_bf16(*grads, poisoned((B, H, T)), dout, q, k, v, out,
                                          lse, kernel=kernel)
        assert launched == [wgmma.forward_kernel(D, False), wgmma.dq_kernel(D, False),
                            wgmma.dkdv_kernel(D, False)]
        results.append([x.copy_to_host() for x in (out, lse, *grads)])
    for got, want in zip(*results):
        np.testing.assert_array_equal(got, want)


@pytest.mark.skipif(not GPU, reason="a property of the H200's tensor cores, not of the twins")
@pytest.mark.parametrize("D", wgmma.HEAD_SIZES)
def test_attention_wgmma_equals_mma_sync_to_the_bit(rng, D):
    """The wgmma kernels and the mma.sync ones do the same arithmetic in the same
    order (k16 steps in turn, the same softmax), and on the H200 the two instructions round a
    k16 step's sums alike: every output is the same to the bit. (The default recipe's losses
    with either were the same at every logged step: docs/perf.md.)"""
    B, H, T = 2, 3, 300
    q, k, v, dout = (device(rng.standard_normal((B, H, T, D))) for _ in range(4))
    results = []
    for kernel in ("mma", "wgmma"):
        out, lse = poisoned((B, H, T, D)), poisoned((B, H, T))
        attention.attention_forward_bf16(out, lse, q, k, v, kernel=kernel)
        grads = [poisoned((B, H, T, D)) for _ in range(3)]
        attention.attention_backward_bf16(*grads, poisoned((B, H, T)), dout, q, k, v, out,
                                          lse, kernel=kernel)
        results.append([x.copy_to_host() for x in (out, lse, *grads)])
    for got, want in zip(*results):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("D", [32] if not GPU else wgmma.HEAD_SIZES)
def test_attention_wgmma_reads_heads_in_rows_to_the_bit(rng, D):
    """q, k, v as the bf16 rows [B*T, C] the products of W_Q, W_K, W_V write, the heads side by
    side (bf16_heads_view: what bf16 training hands the kernels), against the same values as
    contiguous heads (heads_bf16's): the same tiles, so every output is the same to the bit,
    dout's bf16 copy (laid out as q, k, v) included through dk and dv."""
    from nanoandrea.kernels import heads, operands
    B, H, T = (2, 2, 64) if not GPU else (3, 12, 300)
    rows = [device(rng.standard_normal((B * T, H * D))) for _ in range(3)]
    dout = device(rng.standard_normal((B, H, T, D)))
    in_rows = [heads.bf16_heads_view(operands.rounded_bf16(x), B, H) for x in rows]
    contiguous = [operands.heads_bf16(heads.heads_view(x.reshape(B, T, H * D), H))
                  for x in rows]
    assert not in_rows[0].bf16_pairs.is_c_contiguous()
    results = []
    for q, k, v in (in_rows, contiguous):
        out, lse = poisoned((B, H, T, D)), poisoned((B, H, T))
        attention.attention_forward(out, lse, q, k, v, dropout_p=0.1, seed=device(
            np.array([7], np.int64), np.int64), site=1, kernel="wgmma")
        grads = [poisoned((B, H, T, D)) for _ in range(3)]
        attention.attention_backward(*grads, poisoned((B, H, T)), dout, q, k, v, out, lse,
                                     dropout_p=0.1, seed=device(np.array([7], np.int64),
                                                                np.int64), site=1,
                                     kernel="wgmma")
        results.append([x.copy_to_host() for x in (out, lse, *grads)])
    assert not any(np.isnan(x).any() for x in results[0])
    for got, want in zip(*results):
        np.testing.assert_array_equal(got, want)
