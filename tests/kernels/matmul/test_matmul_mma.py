"""The mma.sync products (kernels/matmul/mma_sync.py) in bf16 and tf32 against their NumPy twins
and against float64, named by kernel="mma" so that every GPU runs them (on Hopper the dispatch
would choose wgmma for bf16).

Each twin rounds the operands exactly as the kernel does (bf16: to nearest, ties to even; tf32:
ties away), so kernel and twin agree to float32 sums' rounding; against the unrounded float64
product the error is the rounding's, ~1e-2 relative at most for bf16, ~1e-3 for tf32. Sizes
are multiples of 8 (the kernel's copies), none a multiple of its block tile; in the simulator
its block is 32 x 32 (the module's doc). tf32 changes what the k-major operands read (a word a
lane), the slices of 16 k and rows padded to 4 values: fewer cases than bf16's, the code both
share is tested there. `check` and `check_products_in_bf16` serve the wgmma kernel's tests too
(test_matmul_wgmma.py).
"""
import functools

import numpy as np
import pytest

from checks import ORIENTATIONS, device, output_and_prior, poisoned, split_k
from conftest import GPU, relative_error
from nanoandrea.kernels import gelu, matmul, operands
from nanoandrea.kernels.matmul import mma_sync, wgmma
from nanoandrea.kernels.operands import Bf16Matrix, bf16_matrix_values, round_bf16_numpy
from nanoandrea.kernels.ptx.mma import bf16_values, unpack_bf16
from nanoandrea.kernels.runtime.launch import kernel_factory

TOLERANCE = 1e-5 if not GPU else 1e-4       # against the twin: float32 sums in another order
BF16_TOLERANCE = 1e-2                        # against float64 on the unrounded operands
# each precision's (launcher, twin, tolerance against float64 on the unrounded operands)
PRECISIONS = {
    "bf16": (functools.partial(matmul.matmul_bf16, kernel="mma"), matmul.matmul_bf16_numpy,
             BF16_TOLERANCE),
    "tf32": (functools.partial(matmul.matmul_tf32, kernel="mma"), matmul.matmul_tf32_numpy,
             2e-3),
    "wgmma": (lambda out, a, b, *args, **epilogue: wgmma.matmul_wgmma(
        out, operands.rounded_bf16(a), operands.rounded_bf16(b), *args, **epilogue),
        matmul.matmul_bf16_numpy, BF16_TOLERANCE)}          # (test_matmul_wgmma.py)
CASES = ([(40, 24, 40, True, False), (24, 40, 16, False, True)] if not GPU else
         [(1000, 1544, 392, True, False), (1000, 392, 776, False, True),
          (2048, 768, 3072, True, False)])


def check(rng, transpose_a, transpose_b, M, N, K, with_bias, accumulate, gelu=None,
          precision="bf16"):
    product, twin, rounding_tolerance = PRECISIONS[precision]
    a = rng.standard_normal((K, M) if transpose_a else (M, K))
    b = rng.standard_normal((N, K) if transpose_b else (K, N))
    bias = rng.standard_normal(N) if with_bias else None
    out, prior = output_and_prior(rng, (M, N), accumulate)
    pre = 3 * rng.standard_normal((M, N))
    activated = poisoned((M, N))
    device_gelu = (dict(gelu_out=activated) if gelu == "out" else
                   dict(gelu_input=device(pre)) if gelu == "input" else {})
    product(out, device(a), device(b), None if bias is None else device(bias), transpose_a,
            transpose_b, accumulate, **device_gelu)
    want, want_activated = prior.astype(np.float64), np.zeros((M, N))
    host_gelu = (dict(gelu_out=want_activated) if gelu == "out" else
                 dict(gelu_input=pre) if gelu == "input" else {})
    twin(want, a, b, bias, transpose_a, transpose_b, accumulate, **host_gelu)
    got = out.copy_to_host()
    assert relative_error(got, want) < TOLERANCE
    if gelu == "out":
        assert relative_error(activated.copy_to_host(), want_activated) < TOLERANCE
    exact = prior.astype(np.float64)
    matmul.matmul_numpy(exact, a, b, bias, transpose_a, transpose_b, accumulate,
                        **(dict(gelu_input=pre) if gelu == "input" else {}))
    assert relative_error(got, exact) < rounding_tolerance


@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("transpose_a,transpose_b", ORIENTATIONS)
def test_matmul_mma_bf16(rng, monkeypatch, splits, transpose_a, transpose_b):
    """Every orientation (the forward NN, dX's NT, dW's TN), with split-K (splits=2) too."""
    split_k(monkeypatch, splits)
    for case in CASES:
        check(rng, transpose_a, transpose_b, *case)


@pytest.mark.parametrize("gelu,transpose_b,accumulate,splits", [
    ("out", False, False, 1), ("out", False, False, 2),     # the MLP up with its activation
    ("input", True, False, 1), ("input", True, True, 2)])   # dH = (dY . W^T) * gelu'(H)
def test_matmul_mma_bf16_epilogues(rng, monkeypatch, gelu, transpose_b, accumulate, splits):
    split_k(monkeypatch, splits)
    M, N, K = (40, 24, 40) if not GPU else (1000, 1544, 392)
    check(rng, False, transpose_b, M, N, K, gelu == "out", accumulate, gelu)


@pytest.mark.parametrize("transpose_a,transpose_b", ORIENTATIONS)
def test_matmul_mma_bf16_any_width(rng, transpose_a, transpose_b):
    """Widths that are not multiples of 8 (a character vocabulary's 65): each operand's rows
    are padded with zeros to 8 values, and the pad adds nothing to a sum."""
    M, N, K = (12, 13, 21) if not GPU else (300, 65, 1027)
    check(rng, transpose_a, transpose_b, M, N, K, True, False)


@pytest.mark.parametrize("transpose_a,transpose_b", ORIENTATIONS)
@pytest.mark.parametrize("splits", [1, 2])
def test_matmul_mma_tf32(rng, monkeypatch, splits, transpose_a, transpose_b):
    """Every orientation, whole and split-K (in the simulator one case each: split-K's needs
    K of two slices or more)."""
    split_k(monkeypatch, splits)
    for case in CASES if GPU else [CASES[2 - splits]]:
        check(rng, transpose_a, transpose_b, *case, precision="tf32")


@pytest.mark.parametrize("gelu,transpose_b,accumulate", [
    ("out", False, False),                  # the MLP up with its activation (b k-major)
    ("input", True, True)])                 # dH = (dY . W^T) * gelu'(H), added to
def test_matmul_mma_tf32_epilogues(rng, gelu, transpose_b, accumulate):
    M, N, K = (40, 24, 40) if not GPU else (1000, 1544, 392)
    check(rng, False, transpose_b, M, N, K, gelu == "out", accumulate, gelu, precision="tf32")


@pytest.mark.parametrize("transpose_a,transpose_b", ORIENTATIONS)
def test_matmul_mma_tf32_any_width(rng, transpose_a, transpose_b):
    """Widths that are not multiples of 4: each operand's rows padded with zeros to 4 values."""
    M, N, K = (12, 13, 21) if not GPU else (300, 65, 1027)
    check(rng, transpose_a, transpose_b, M, N, K, True, False, precision="tf32")


GPU_BLOCK = dict(MMA_M=4, MMA_N=8, WM=64, WN=64, BM=128, BN=128, A_COPIES=4, B_COPIES=4)


@pytest.mark.skipif(GPU, reason="on the GPU every test runs this block")
@pytest.mark.parametrize("precision", ["bf16", "tf32"])
@pytest.mark.parametrize("transpose_a,transpose_b", [(False, False), (True, True)])
def test_the_gpu_block_in_the_simulator(rng, monkeypatch, precision, transpose_a, transpose_b):
    """The GPU's block tile (128 x 128, 4 warps of 64 x 64) in the simulator, where each thread
    makes 4 copies of a slice of each operand, rows APART apart (the simulator's 32 x 32 block
    makes one): the copies past the first, inside and outside out's M = 100 rows, 24
    columns and K = 40, and the fragments of every tile of a warp. Two orientations take
    each operand both ways, along k and k-major (one block: the simulator is slow at it)."""
    for name, value in GPU_BLOCK.items():
        monkeypatch.setattr(mma_sync, name, value)
    monkeypatch.setattr(mma_sync, "mma_matmul_kernel",         # (a new cache of kernels)
                        kernel_factory(mma_sync.mma_matmul_kernel.__wrapped__))
    check(rng, transpose_a, transpose_b, 100, 24, 40, True, False, precision=precision)


def check_gelu_in_bf16(rng, product, M, N, K):
    """product(out, a, b, bias, gelu_out=Bf16Matrix): out as with a float32 gelu_out, and
    GELU's output the float32 one rounded to bf16, to the bit (the epilogue rounds the same
    float32 values round_bf16 would); bf16_values reads it back as float32."""
    a, b, bias = (device(rng.standard_normal(s)) for s in ((M, K), (K, N), (N,)))
    out, hidden = poisoned((M, N)), poisoned((M, N))
    product(out, a, b, bias, gelu_out=hidden)
    out_again = poisoned((M, N))
    hidden_bf16 = Bf16Matrix.allocate((M, N), operands.device_empty)
    product(out_again, a, b, bias, gelu_out=hidden_bf16)
    np.testing.assert_array_equal(out_again.copy_to_host(), out.copy_to_host())
    want = Bf16Matrix.allocate((M, N), np.empty)
    round_bf16_numpy(want, hidden.copy_to_host())
    np.testing.assert_array_equal(hidden_bf16.bf16_pairs.copy_to_host(), want.bf16_pairs)
    values = poisoned((M, N))
    operands.bf16_values(values, hidden_bf16)
    np.testing.assert_array_equal(values.copy_to_host(), bf16_matrix_values(want))


EPILOGUES_IN_BF16 = ("plain", "gelu", "gelu_grad")


def check_products_in_bf16(rng, product, M, N, K, epilogues=EPILOGUES_IN_BF16):
    """product(out, a, b, bias, ...) with out a Bf16Matrix (the bf16 epilogue: the MLP's
    pre-activation, GELU's output and the pre-activation's gradient written as the next
    products read them), and the NumPy twin likewise: out is the float32 product rounded, to
    the bit; GELU's output is GELU of out as rounded (to bf16's rounding: numpy's exp is not
    the GPU's); GELU's backward reads a Bf16Matrix input as its values, and its result is the
    float32 one rounded, to the bit. The kernel and the twin agree to float32 sums' order.
    epilogues: those of "plain", "gelu" (with the plain product, which its pre-activation
    equals) and "gelu_grad" to check (the simulator runs them as tests of their own)."""
    a, b, bias = (rng.standard_normal(s).astype(np.float32) for s in ((M, K), (N, K), (N,)))
    pre = Bf16Matrix.allocate((M, N), np.empty)              # GELU's input, in bf16
    round_bf16_numpy(pre, 3 * rng.standard_normal((M, N)).astype(np.float32))
    pre_values = bf16_matrix_values(pre)
    sides = {"kernel": (product, device, lambda: Bf16Matrix.allocate((M, N),
                                                                       operands.device_empty),
                        lambda x: x.copy_to_host()),
             "twin": (matmul.matmul_bf16_numpy, np.array,
                      lambda: Bf16Matrix.allocate((M, N), np.empty), np.asarray)}
    got = {}
    for side, (run, put, new, host) in sides.items():
        x, w, c = put(a), put(b), put(bias)         # (w: W^T, as dX = dY . W^T reads it)
        gelu_input = Bf16Matrix(put(pre.bf16_pairs) if side == "twin"
                                else device(pre.bf16_pairs, np.uint32), N)
        pairs = []
        if "plain" in epilogues or "gelu" in epilogues:
            out, plain = new(), put(np.full((M, N), np.nan, np.float32))
            run(out, x, w, c, transpose_b=True)
            run(plain, x, w, c, transpose_b=True)
            pairs.append(host(out.bf16_pairs))
            assert_rounded_from(pairs[-1], host(plain))             # the float32 one rounded
        if "gelu" in epilogues:
            activated, activated_pre = new(), new()
            run(activated_pre, x, w, c, transpose_b=True, gelu_out=activated)
            pairs += [host(activated_pre.bf16_pairs), host(activated.bf16_pairs)]
            np.testing.assert_array_equal(pairs[-2], pairs[0])      # gelu's pre-activation
            gelu_of_out = np.empty((M, N), np.float32)
            gelu.gelu_forward_numpy(gelu_of_out, unpack_bf16(pairs[0])[:, :N])
            np.testing.assert_allclose(unpack_bf16(pairs[-1])[:, :N], gelu_of_out,
                                       rtol=2 ** -7, atol=1e-6)
        if "gelu_grad" in epilogues:
            dpre, dpre_float = new(), put(np.full((M, N), np.nan, np.float32))
            run(dpre, x, w, None, transpose_b=True, gelu_input=gelu_input)
            run(dpre_float, x, w, None, transpose_b=True, gelu_input=put(pre_values))
            pairs.append(host(dpre.bf16_pairs))
            assert_rounded_from(pairs[-1], host(dpre_float))
        got[side] = pairs
    for kernel, twin in zip(got["kernel"], got["twin"]):
        assert relative_error(unpack_bf16(kernel), unpack_bf16(twin)) < BF16_TOLERANCE / 10


def assert_rounded_from(pairs, values):
    """pairs are the bf16 pairs of the float32 values, rounded to the bit."""
    rounded = Bf16Matrix.allocate(values.shape, np.empty)
    round_bf16_numpy(rounded, values)
    np.testing.assert_array_equal(pairs, rounded.bf16_pairs)


def test_matmul_mma_products_in_bf16(rng):
    """matmul_bf16 on mma.sync with out a Bf16Matrix: the float32 product rounded after
    (through_float32; on Hopper wgmma's bf16 epilogue writes them: test_matmul_wgmma.py)."""
    M, N, K = (40, 24, 40) if not GPU else (1000, 1544, 392)
    check_products_in_bf16(rng, functools.partial(matmul.matmul_bf16, kernel="mma"), M, N, K)


def test_matmul_mma_writes_gelu_in_bf16(rng):
    """matmul_bf16 on mma.sync with a Bf16Matrix gelu_out (the MLP up in bf16 training): a
    float32 GELU rounded; the twin likewise."""
    M, N, K = (40, 24, 40) if not GPU else (1000, 1544, 392)
    check_gelu_in_bf16(rng, functools.partial(matmul.matmul_bf16, kernel="mma"), M, N, K)
    a, b, bias = (rng.standard_normal(s) for s in ((M, K), (K, N), (N,)))
    out, hidden = np.empty((M, N)), np.empty((M, N))
    matmul.matmul_bf16_numpy(out, a, b, bias, gelu_out=hidden)
    hidden_bf16 = Bf16Matrix.allocate((M, N), np.empty)
    matmul.matmul_bf16_numpy(np.empty((M, N)), a, b, bias, gelu_out=hidden_bf16)
    want = Bf16Matrix.allocate((M, N), np.empty)
    round_bf16_numpy(want, hidden.astype(np.float32))
    np.testing.assert_array_equal(hidden_bf16.bf16_pairs, want.bf16_pairs)


def test_bf16_mlp_keeps_gelu_as_the_next_products_operand(rng):
    """ops.linear(activation="gelu") in bf16: the pre-activation, GELU's output and the
    pre-activation's gradient are written only as the MLP's products read them (the
    OperandTensor's operand), no float32 copy is made in the forward or the backward, and the
    output and gradients are the NumPy backend's (its twin rounds the same way). Reading
    `data` afterwards gives GELU's values in bf16: GELU of the pre-activation as it was
    stored. (The dispatch's kernels: mma.sync here, wgmma on Hopper.)"""
    from nanoandrea import ops
    from nanoandrea.autograd import Tensor
    from nanoandrea.backend import get_backend
    M, C = (16, 8) if not GPU else (512, 64)
    values = [rng.standard_normal(s) for s in ((M, C), (C, 4 * C), (4 * C,), (4 * C, C), (C,))]
    dy = rng.standard_normal((M, C))
    results = {}
    for name in ("cuda", "numpy"):
        backend = get_backend(name, np.float32, precision="bf16")
        leaves = [Tensor(backend.to_device(v, np.float32), backend, requires_grad=True)
                  for v in values]
        x, w_fc, b_fc, w_proj, b_proj = leaves
        h = ops.linear(x, w_fc, b_fc, activation="gelu")
        y = ops.linear(h, w_proj, b_proj)
        y.backward(backend.to_device(dy, np.float32))
        if name == "cuda":
            assert h.operand is not None and h._values is None
            assert h.pre.operand is not None and h.pre._values is None   # (pre-activation)
            assert hasattr(h.pre.grad, "bf16_pairs")                     # (and its gradient)
        results[name] = [backend.to_host(t) for t in (y.data, *(v.grad for v in leaves))]
        results[name + " gelu"] = backend.to_host(h.data)
        results[name + " pre"] = backend.to_host(h.pre.data).astype(np.float64)
    for got, want in zip(results["cuda"], results["numpy"]):
        assert relative_error(got, want) < TOLERANCE
    # (against GELU of the pre-activation the kernel stored: its float32 sums, in another order
    # than the twin's, may round to the next bf16, and GELU moves with it. On Hopper GELU is
    # taken on the special-function unit, ~2^-22 off, flushing results under ~1e-37 to zero: a
    # value may still round to the next bf16, one step of at most 2^-7)
    for name in ("cuda", "numpy"):
        x = results[name + " pre"]
        # (exp overflows to inf where GELU is under 1e-300, and x / inf is its limit, 0)
        with np.errstate(over="ignore"):
            exact = x / (1 + np.exp(-2 * np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))
        np.testing.assert_allclose(results[name + " gelu"],
                                   bf16_values(exact.astype(np.float32)), rtol=2 ** -7, atol=1e-30)
    assert np.array_equal(bf16_values(results["cuda gelu"].astype(np.float32)),
                          results["cuda gelu"])
