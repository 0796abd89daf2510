"""The matmul family's dispatch (kernels/matmul/__init__.py): which kernel `choose` picks for
each kind of operand on each kind of GPU, that "auto" launches it and a named kernel is the
one that runs, and matmul_sum's one pass or product after product.

The GPU is pretended (checks.on_device: runtime/device.py's current() and runs_wgmma()), so
that each choice is tested in the simulator too, where no GPU runs wgmma and the float32
products take the reference kernel."""
import numpy as np
import pytest

from checks import A100, H200, TOLERANCE, device, on_device, poisoned, recording_launches
from conftest import relative_error
from nanoandrea.kernels import matmul
from nanoandrea.kernels.matmul import float32, mma_sync, reference, wgmma
from nanoandrea.kernels.operands import (Bf16Matrix, device_empty, round_bf16_numpy, rounded_bf16,
                                        rounded_tf32)
from nanoandrea.kernels.ptx.mma import unpack_bf16
from test_matmul_reference import check_matmul


def operands(rng, M, N, K):
    """out [M,N] and a [M,K], b [K,N] of float32 on the device."""
    return poisoned((M, N)), device(rng.standard_normal((M, K))), device(
        rng.standard_normal((K, N)))


def test_float32_products_take_the_float32_kernel_on_a_gpu(rng, monkeypatch):
    """float32 operands whose rows are whole 16-byte runs: the float32 kernel on a GPU, the
    reference kernel in the simulator (where it is the quicker) and for any other width."""
    out, a, b = operands(rng, 8, 12, 16)
    monkeypatch.setattr(matmul, "SIMULATOR", False)
    assert matmul.choose(out, a, b) == "float32"
    assert matmul.choose(out, a, b, device(np.zeros(12)), poisoned((8, 12))) == "float32"
    for M, N, K in [(8, 13, 16), (8, 12, 15)]:              # rows that are not 16-byte runs
        assert matmul.choose(*operands(rng, M, N, K)) == "reference"
    assert matmul.choose(out, a, b, device(np.zeros(13))[:12]) == "float32"    # (aligned)
    assert matmul.choose(out, a, b, device(np.zeros(13))[1:]) == "reference"   # (not aligned)
    monkeypatch.setattr(matmul, "SIMULATOR", True)
    assert matmul.choose(out, a, b) == "reference"


@pytest.mark.parametrize("card", [A100, H200], ids=["A100", "H200"])
def test_tf32_products_take_mma_sync_on_every_gpu(rng, monkeypatch, card):
    on_device(monkeypatch, card)
    out, a, b = operands(rng, 8, 16, 16)
    assert matmul.choose(out, rounded_tf32(a), rounded_tf32(b)) == "mma"


def test_bf16_products_take_wgmma_on_hopper_and_mma_sync_elsewhere(rng, monkeypatch):
    """bf16 operands: wgmma on a GPU of compute capability 9.0 where out's rows are a multiple
    of 8 and out and GELU's array are of one kind (float32 both, or bf16 both); mma.sync on an
    8.x GPU, and for the products wgmma does not take."""
    out, a, b = operands(rng, 8, 16, 16)
    a, b = rounded_bf16(a), rounded_bf16(b)
    bf16_out = Bf16Matrix.allocate((8, 16), device_empty)
    on_device(monkeypatch, A100)
    assert matmul.choose(out, a, b) == "mma"
    assert matmul.choose(bf16_out, a, b, gelu_array=bf16_out) == "mma"
    on_device(monkeypatch, H200)
    assert matmul.choose(out, a, b) == "wgmma"
    assert matmul.choose(out, a, b, device(np.zeros(16)), poisoned((8, 16))) == "wgmma"
    assert matmul.choose(bf16_out, a, b, gelu_array=bf16_out) == "wgmma"
    assert matmul.choose(out, a, b, gelu_array=bf16_out) == "mma"       # (float32 out, bf16 GELU)
    narrow, a20, b20 = operands(rng, 8, 20, 16)                     # (rows of 20: 8 does not
    assert matmul.choose(narrow, rounded_bf16(a20), rounded_bf16(b20)) == "mma"   # divide it)


@pytest.mark.parametrize("M,N,K", [(10, 21, 12), (10, 20, 13)])
def test_auto_takes_the_reference_for_rows_not_16_byte_runs(rng, monkeypatch, M, N, K):
    """A width that is not a multiple of 4 (out's N, or a's K) leaves rows that are not 16-byte
    runs: "auto" computes them with the reference kernel, and "float32" refuses them, on a GPU
    as in the simulator."""
    monkeypatch.setattr(matmul, "SIMULATOR", False)
    launched = recording_launches(monkeypatch, reference, float32)
    check_matmul(rng, "auto", False, False, M, N, K, True, True)
    assert launched == [reference.matmul_tiled_kernel]
    with pytest.raises(ValueError, match="16-byte"):
        check_matmul(rng, "float32", False, False, M, N, K, True, True)


def test_auto_launches_the_kernel_chosen(rng, monkeypatch):
    """"auto" launches the kernel `choose` names (on an A100 pretended: for float32 operands
    the float32 kernel, in the simulator the reference one; mma.sync for bf16 and tf32 ones),
    and a kernel named is the one that runs."""
    on_device(monkeypatch, A100)
    out, a, b = operands(rng, 8, 16, 8)
    launched = recording_launches(monkeypatch, reference, float32, mma_sync, wgmma)
    matmul.matmul(out, a, b)
    assert launched == [{"float32": float32.matmul_kernel(False, False, None),
                         "reference": reference.matmul_tiled_kernel}[matmul.choose(out, a, b)]]
    launched.clear()
    matmul.matmul(out, rounded_bf16(a), rounded_bf16(b))
    matmul.matmul(out, rounded_tf32(a), rounded_tf32(b))
    assert launched == [mma_sync.mma_matmul_kernel(False, False, None, "bf16"),
                        mma_sync.mma_matmul_kernel(False, False, None, "tf32")]
    launched.clear()
    matmul.matmul(out, a, b, kernel="float32")
    assert launched == [float32.matmul_kernel(False, False, None)]
    with pytest.raises(ValueError, match="unknown kernel 'fast'"):
        matmul.matmul(out, a, b, kernel="fast")


def test_mma_named_stays_on_mma_sync_for_products_in_bf16(rng, monkeypatch):
    """kernel="mma" on a GPU that runs wgmma (the mma.sync kernels forced on an H100): a
    product written in bf16, which mma.sync's epilogue does not write, is its float32 product
    rounded after, and that product is mma.sync's too, not wgmma's."""
    on_device(monkeypatch, H200)

    def no_wgmma(*args, **kwargs):
        raise AssertionError("wgmma ran where mma.sync was named")
    monkeypatch.setattr(wgmma, "matmul_wgmma", no_wgmma)
    launched = recording_launches(monkeypatch, mma_sync)
    M, N, K = 16, 24, 16
    a, b, bias = (device(rng.standard_normal(s)) for s in ((M, K), (K, N), (N,)))
    out, activated, gelu_bf16 = (Bf16Matrix.allocate((M, N), device_empty) for _ in range(3))
    matmul.matmul_bf16(out, a, b, bias, gelu_out=activated, kernel="mma")
    matmul.matmul_bf16(poisoned((M, N)), a, b, bias, gelu_out=gelu_bf16, kernel="mma")
    assert launched and set(launched) <= {mma_sync.mma_matmul_kernel(False, False, None, "bf16"),
                                          mma_sync.mma_matmul_kernel(False, False, "gelu", "bf16")}
    want = Bf16Matrix.allocate((M, N), np.empty)
    matmul.matmul_bf16_numpy(want, *(x.copy_to_host() for x in (a, b, bias)))
    assert relative_error(unpack_bf16(out.bf16_pairs.copy_to_host()),
                          unpack_bf16(want.bf16_pairs)) < 1e-3


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_matmul_sum_is_the_sum_of_its_products(rng, monkeypatch, precision):
    """matmul_sum (attention's dX = dQ W_Q^T + dK W_K^T + dV W_V^T) on a GPU without wgmma (an
    A100 pretended): one product after another, each added to out, as its twin does them."""
    on_device(monkeypatch, A100)
    M, N, K = 8, 12, 16
    pairs = [(rng.standard_normal((M, K)).astype(np.float32),
              rng.standard_normal((N, K)).astype(np.float32)) for _ in range(3)]
    prior = rng.standard_normal((M, N)).astype(np.float32)
    if precision == "bf16":
        host = []
        for pair in pairs:
            rounded = [Bf16Matrix.allocate(x.shape, np.empty) for x in pair]
            for r, x in zip(rounded, pair):
                round_bf16_numpy(r, x)
            host.append(tuple(rounded))
        given = [tuple(Bf16Matrix(device(x.bf16_pairs, np.uint32), x.shape[1]) for x in pair)
                 for pair in host]
    else:
        host = pairs
        given = [(device(a), device(b)) for a, b in pairs]
    out = device(prior)
    matmul.matmul_sum(out, given, transpose_b=True, accumulate=True)
    want = prior.astype(np.float64)
    matmul.matmul_sum_numpy(want, host, transpose_b=True, accumulate=True)
    assert relative_error(out.copy_to_host(), want) < TOLERANCE
    exact = prior + sum(a.astype(np.float64) @ b.T for a, b in pairs)
    assert relative_error(out.copy_to_host(), exact) < (TOLERANCE if precision == "fp32" else
                                                        1e-2)


def test_matmul_sum_takes_one_wgmma_pass_on_hopper(rng, monkeypatch):
    """On a GPU that runs wgmma, bf16 pairs of one shape are one pass of the wgmma kernel
    (matmul_wgmma's more_pairs); pairs of other shapes, one product after another."""
    on_device(monkeypatch, H200)
    calls = []

    def record(out, a, b, bias=None, transpose_a=False, transpose_b=False, accumulate=False,
               gelu_out=None, gelu_input=None, more_pairs=()):
        calls.append((a, b, dict(accumulate=accumulate, more_pairs=more_pairs)))
    monkeypatch.setattr(wgmma, "matmul_wgmma", record)
    out = poisoned((8, 16))
    pairs = [tuple(rounded_bf16(device(rng.standard_normal(s))) for s in ((8, 24), (16, 24)))
             for _ in range(3)]
    matmul.matmul_sum(out, pairs, transpose_b=True)
    (a, b, options), = calls
    assert (a, b) == pairs[0] and options["more_pairs"] == pairs[1:]
    calls.clear()
    other = tuple(rounded_bf16(device(rng.standard_normal(s))) for s in ((8, 32), (16, 32)))
    matmul.matmul_sum(out, [pairs[0], other], transpose_b=True)
    assert [(a, b) for a, b, _ in calls] == [pairs[0], other]
    assert [options["accumulate"] for _, _, options in calls] == [False, True]
