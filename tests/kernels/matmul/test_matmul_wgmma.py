"""The wgmma matmul (kernels/matmul/wgmma.py) against matmul_bf16's NumPy twin and against
float64, in every orientation and epilogue, with split-K. Its blocks are persistent: in the
simulator one block (resident_blocks()) takes CASES' 2 tiles, so that it carries its copies
and barriers from one tile into the next; on the GPU the largest case gives each block about
3 tiles. Sizes are multiples of 8 in N (the kernel's pairs), none a multiple of its 128 x 256
tile, and K passes the end of a 64-wide slice (the copies' zeros past K). The simulator runs
the GPU's own block (384 threads, the wgmma twin of kernels/ptx/wgmma.py), so its cases are few
and small.
"""
import numpy as np
import pytest
from numba import cuda

from checks import device, output_and_prior, split_k
from conftest import GPU, relative_error
from nanoandrea.kernels import matmul, operands
from nanoandrea.kernels.matmul import wgmma
from nanoandrea.kernels.operands import Bf16Matrix, bf16_matrix_values, round_bf16_numpy
from nanoandrea.kernels.runtime import device as runtime_device
from test_matmul_mma import TOLERANCE, check, check_products_in_bf16

if GPU and cuda.get_current_device().compute_capability != (9, 0):
    pytest.skip("wgmma needs compute capability 9.0 (sm_90a)", allow_module_level=True)

ORIENTATIONS = [(False, False), (False, True), (True, False)]   # x W, dY W^T, x^T dY
# (M, N, K): in the simulator 2 tiles; on the GPU 56 tiles, then 384 (about 3 a block)
CASES = [(136, 136, 72)] if not GPU else [(1000, 1544, 392), (8192, 1536, 200)]


@pytest.mark.parametrize("transpose_a,transpose_b", ORIENTATIONS)
def test_matmul_wgmma(rng, monkeypatch, transpose_a, transpose_b):
    split_k(monkeypatch, 1)
    for M, N, K in CASES:
        check(rng, transpose_a, transpose_b, M, N, K, True, False, precision="wgmma")


@pytest.mark.parametrize("transpose_a,transpose_b", [(True, False)] if not GPU else ORIENTATIONS)
def test_matmul_wgmma_split_k(rng, monkeypatch, transpose_a, transpose_b):
    """Two slices of K, their partial tiles the blocks' work (dW = x^T dY's case)."""
    asked = split_k(monkeypatch, 2)
    M, N, K = (72, 136, 136) if not GPU else (768, 1536, 8200)
    check(rng, transpose_a, transpose_b, M, N, K, False, True, precision="wgmma")
    assert asked == [(M, N, K)]        # (a product without bias is split too)


@pytest.mark.parametrize("gelu,transpose_b,accumulate,splits,bias", [
    ("out", False, False, 1, True), ("input", True, True, 1, False),
    ("out", True, False, 1, False)] + ([] if not GPU else [
        ("out", False, False, 2, True), ("input", True, False, 2, False)]))
def test_matmul_wgmma_epilogues(rng, monkeypatch, gelu, transpose_b, accumulate, splits, bias):
    """The MLP up with its activation (gelu; with its bias, as the model's, and without),
    dH = (dY . W^T) * gelu'(H) (gelu_grad)."""
    split_k(monkeypatch, splits)
    M, N, K = (72, 136, 72) if not GPU else (1000, 1544, 392)
    check(rng, False, transpose_b, M, N, K, bias, accumulate, gelu, precision="wgmma")


@pytest.mark.parametrize("transpose_a,transpose_b,accumulate,splits", [
    (False, True, False, 1), (True, False, True, 2)] + ([] if not GPU else [
        (False, False, True, 1), (False, True, True, 2), (False, True, False, 3)]))
def test_matmul_wgmma_sums_three_products_in_one_pass(rng, monkeypatch, transpose_a,
                                                        transpose_b, accumulate, splits):
    """out (+)= a_0 b_0 + a_1 b_1 + a_2 b_2 (attention's dX = dQ W_Q^T + dK W_K^T + dV W_V^T):
    one product over the three K's one after another, each padded to a whole slice (K is
    not a multiple of 64 here: the padding's zeros add nothing), against the product of the
    operands concatenated along K, in float64, and against each pair's product added in turn
    (matmul_sum's other path, the twin's order)."""
    asked = split_k(monkeypatch, splits)
    M, N, K = (72, 136, 40) if not GPU else (1000, 1544, 392)
    pairs = [(rng.standard_normal((K, M) if transpose_a else (M, K)),
              rng.standard_normal((N, K) if transpose_b else (K, N))) for _ in range(3)]
    out, prior = output_and_prior(rng, (M, N), accumulate)
    (a, b), *more = [(operands.rounded_bf16(device(a)), operands.rounded_bf16(device(b)))
                     for a, b in pairs]
    wgmma.matmul_wgmma(out, a, b, transpose_a=transpose_a, transpose_b=transpose_b,
                       accumulate=accumulate, more_pairs=more)
    assert asked == [(M, N, 3 * 64 * -(-K // 64))]      # (each K padded to slices of 64)
    got = out.copy_to_host()
    concatenated = (np.concatenate([a for a, _ in pairs], axis=0 if transpose_a else 1),
                    np.concatenate([b for _, b in pairs], axis=1 if transpose_b else 0))
    rounded = [bf16_matrix_values(x).astype(np.float64) for x in concatenated]
    exact = prior.astype(np.float64)
    matmul.matmul_numpy(exact, *rounded, None, transpose_a, transpose_b, accumulate)
    assert relative_error(got, exact) < TOLERANCE
    if not transpose_a:                         # (not matmul_sum's case)
        in_turn = prior.astype(np.float32)
        matmul.matmul_sum_numpy(in_turn, [tuple(bf16_matrix(x) for x in pair) for pair in pairs],
                                transpose_b, accumulate)
        assert relative_error(got, in_turn) < TOLERANCE


def bf16_matrix(x):
    """x rounded to bf16 on the host: a Bf16Matrix of NumPy bf16 pairs (matmul_sum_numpy's
    operand)."""
    rounded = Bf16Matrix.allocate(x.shape, np.empty)
    round_bf16_numpy(rounded, x.astype(np.float32))
    return rounded


def test_matmul_wgmma_refuses_pairs_of_other_shapes(rng):
    a, b = (operands.rounded_bf16(device(rng.standard_normal((72, 64)))) for _ in range(2))
    other = operands.rounded_bf16(device(rng.standard_normal((72, 72))))
    with pytest.raises(ValueError, match="pairs"):
        wgmma.matmul_wgmma(device(np.zeros((72, 72))), a, b, transpose_b=True,
                                  more_pairs=[(a, other)])


@pytest.mark.skipif(not GPU, reason="which kernel the dispatch picks is the GPU's question "
                    "(the simulator pretends one in test_matmul_dispatch.py)")
def test_matmul_bf16_takes_wgmma_on_hopper():
    """On compute capability 9.0 the bf16 products go to wgmma, but for an odd width."""
    assert runtime_device.runs_wgmma()
    assert wgmma.takes(device(np.zeros((16, 72))))
    assert not wgmma.takes(device(np.zeros((16, 65))))


@pytest.mark.parametrize("epilogue", ["gelu", "gelu_grad"])
def test_matmul_wgmma_products_in_bf16(rng, epilogue):
    """The bf16 epilogue (bf16_out): out, GELU's output and GELU's backward's input as
    Bf16Matrix's, the rounded float32 results to the bit; with blocks of several tiles (GELU's
    buffers and their mbarriers carried from one tile into the next). The plain product runs
    with GELU's (its pre-activation equals it). (An epilogue a test: in the simulator each
    takes minutes, and the test workers share them.)"""
    epilogues = ("plain", epilogue) if epilogue == "gelu" else (epilogue,)
    for M, N, K in CASES:
        check_products_in_bf16(rng, lambda out, a, b, bias, **rest: wgmma.matmul_wgmma(
            out, operands.rounded_bf16(a), operands.rounded_bf16(b), bias, **rest), M, N, K,
            epilogues)


@pytest.mark.skipif(not GPU, reason="the tensor maps are the GPU's (the simulator has none)")
def test_matmul_wgmma_starts_a_new_table_of_maps_when_one_is_full(rng, monkeypatch):
    """Tables of 6 rows: each product needs 4 maps, so every other product starts a table (the
    ones before stay where a product's rows came from), and each product is still right."""
    from nanoandrea.kernels.ptx import tma
    monkeypatch.setattr(tma.TensorMaps, "SLOTS", 6)
    monkeypatch.setattr(tma, "_tensor_maps", {})
    split_k(monkeypatch, 1)
    for M, N, K in [(200, 264, 72), (136, 512, 200), (72, 136, 392)]:
        check(rng, False, False, M, N, K, True, False, precision="wgmma")
    assert len(tma._tensor_maps[cuda.get_current_device().id].tables) == 3
