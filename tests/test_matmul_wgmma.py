"""The wgmma matmul (kernels/matmul_wgmma.py) against matmul_bf16's NumPy twin and against
float64, in every orientation and epilogue, with split-K. Its blocks are persistent: in the
simulator 2 blocks (RESIDENT_BLOCKS) take 4 tiles, so that each carries its copies from one
tile into the next; on the GPU the largest case gives each block about 3 tiles. Sizes are
multiples of 8 in N (the kernel's pairs), none a multiple of its 128 x 128 tile, and K passes
the end of a 64-wide slice (the copies' zeros past K). The simulator runs the GPU's own block
(256 threads, the wgmma twin of kernels/wgmma.py), so its cases are few and small.
"""
import numpy as np
import pytest
from numba import cuda

from conftest import GPU
from nanoandrea.kernels import matmul_bf16, matmul_wgmma
from test_matmul_bf16 import check, check_products_in_bf16
from test_kernels import device

if GPU and cuda.get_current_device().compute_capability != (9, 0):
    pytest.skip("wgmma needs compute capability 9.0 (sm_90a)", allow_module_level=True)

ORIENTATIONS = [(False, False), (False, True), (True, False)]   # x W, dY W^T, x^T dY
# (M, N, K): in the simulator 2 x 2 tiles; on the GPU 104 tiles, then 768 (3 a block)
CASES = [(136, 136, 72)] if not GPU else [(1000, 1544, 392), (8192, 1536, 200)]


def split_k(monkeypatch, splits):
    """Every product split `splits` ways; returns the list of the products that asked."""
    asked = []

    def split_count(M, N, K, **rest):
        asked.append((M, N, K))
        return splits
    monkeypatch.setattr(matmul_wgmma, "split_count", split_count)
    return asked


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


@pytest.mark.parametrize("gelu,transpose_b,accumulate,splits", [
    ("out", False, False, 1), ("input", True, True, 1)] + ([] if not GPU else [
        ("out", False, False, 2), ("input", True, False, 2)]))
def test_matmul_wgmma_epilogues(rng, monkeypatch, gelu, transpose_b, accumulate, splits):
    """The MLP up with its activation (gelu), dH = (dY . W^T) * gelu'(H) (gelu_grad)."""
    split_k(monkeypatch, splits)
    M, N, K = (72, 136, 72) if not GPU else (1000, 1544, 392)
    check(rng, False, transpose_b, M, N, K, gelu == "out", accumulate, gelu, precision="wgmma")


@pytest.mark.skipif(not GPU, reason="which kernel matmul_bf16 picks is the GPU's question")
def test_matmul_bf16_takes_wgmma_on_hopper():
    """On compute capability 9.0 matmul_bf16's products go to wgmma, but for an odd width."""
    assert matmul_wgmma.takes(device(np.zeros((16, 72))))
    assert not matmul_wgmma.takes(device(np.zeros((16, 65))))


def test_matmul_wgmma_products_in_bf16(rng):
    """The bf16 epilogue (words): out, GELU's output and GELU's backward's input as Bf16Matrix
    words, the rounded float32 results to the bit."""
    M, N, K = (72, 136, 72) if not GPU else (1000, 1544, 392)
    check_products_in_bf16(rng, lambda out, a, b, bias, **rest: matmul_wgmma.matmul_wgmma(
        out, matmul_bf16.rounded(a), matmul_bf16.rounded(b), bias, **rest), M, N, K)


@pytest.mark.skipif(not GPU, reason="the tensor maps are the GPU's (the simulator has none)")
def test_matmul_wgmma_starts_a_new_table_of_maps_when_one_is_full(rng, monkeypatch):
    """Tables of 6 rows: each product needs 4 maps, so every other product starts a table (the
    ones before stay where a product's rows came from), and each product is still right."""
    from nanoandrea.kernels import tma
    monkeypatch.setattr(tma.TensorMaps, "SLOTS", 6)
    monkeypatch.setattr(tma, "_tensor_maps", {})
    split_k(monkeypatch, 1)
    for M, N, K in [(200, 264, 72), (136, 512, 200), (72, 136, 392)]:
        check(rng, False, False, M, N, K, True, False, precision="wgmma")
    assert len(tma._tensor_maps[cuda.get_current_device().id].tables) == 3
