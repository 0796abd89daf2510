"""The tensor-core matmul (kernels/matmul_bf16.py) against its NumPy twin and against float64.

Its twin rounds the operands to bf16 exactly as the kernel does (to nearest, ties to even), so
the two agree to float32 sums' rounding; against the unrounded float64 product the error is
bf16's, ~1e-2 relative at most. Sizes are multiples of 8 (the kernel's copies), none a
multiple of its block tile; in the simulator its block is 32 x 32 (the module's doc).
`check` serves tf32's tests of the same kernel too (test_matmul_tf32.py), and the wgmma
kernel's (test_matmul_wgmma.py).
"""
import numpy as np
import pytest

from conftest import GPU, relative_error
from nanoandrea.kernels import gelu, matmul, matmul_bf16, matmul_tf32, matmul_wgmma
from nanoandrea.kernels.launch import kernel_factory
from nanoandrea.kernels.tensorcores import bf16_bits, bf16_values, pack_bf16, unpack_bf16
from test_kernels import ORIENTATIONS, device, output_and_prior, poisoned

TOLERANCE = 1e-5 if not GPU else 1e-4       # against the twin: float32 sums in another order
BF16_TOLERANCE = 1e-2                        # against float64 on the unrounded operands
# each precision's (launcher, twin, tolerance against float64 on the unrounded operands)
PRECISIONS = {"bf16": (matmul_bf16.matmul_bf16, matmul_bf16.matmul_bf16_numpy, BF16_TOLERANCE),
              "tf32": (matmul_tf32.matmul_tf32, matmul_tf32.matmul_tf32_numpy, 2e-3),
              "wgmma": (lambda out, a, b, *args, **epilogue: matmul_wgmma.matmul_wgmma(
                  out, matmul_bf16.rounded(a), matmul_bf16.rounded(b), *args, **epilogue),
                  matmul_bf16.matmul_bf16_numpy, BF16_TOLERANCE)}     # (test_matmul_wgmma.py)
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


def split_k(monkeypatch, splits):
    monkeypatch.setattr(matmul_bf16, "split_count", lambda M, N, K, slots, step: splits)


@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("transpose_a,transpose_b", ORIENTATIONS)
def test_matmul_bf16(rng, monkeypatch, splits, transpose_a, transpose_b):
    """Every orientation (the forward NN, dX's NT, dW's TN), with split-K (splits=2) too."""
    split_k(monkeypatch, splits)
    for case in CASES:
        check(rng, transpose_a, transpose_b, *case)


@pytest.mark.parametrize("gelu,transpose_b,accumulate,splits", [
    ("out", False, False, 1), ("out", False, False, 2),     # the MLP up with its activation
    ("input", True, False, 1), ("input", True, True, 2)])   # dH = (dY . W^T) * gelu'(H)
def test_matmul_bf16_epilogues(rng, monkeypatch, gelu, transpose_b, accumulate, splits):
    split_k(monkeypatch, splits)
    M, N, K = (40, 24, 40) if not GPU else (1000, 1544, 392)
    check(rng, False, transpose_b, M, N, K, gelu == "out", accumulate, gelu)


@pytest.mark.parametrize("transpose_a,transpose_b", ORIENTATIONS)
def test_matmul_bf16_any_width(rng, transpose_a, transpose_b):
    """Widths that are not multiples of 8 (a character vocabulary's 65): each operand's rows
    are padded with zeros to 8 values, and the pad adds nothing to a sum."""
    M, N, K = (12, 13, 21) if not GPU else (300, 65, 1027)
    check(rng, transpose_a, transpose_b, M, N, K, True, False)


def test_round_bf16_pads_with_zeros(rng):
    """round_bf16 against its twin, bit for bit, at a width of 13: 13 values then 3 zeros."""
    x = rng.standard_normal((5, 13)).astype(np.float32)
    rounded = matmul_bf16.rounded(device(x))
    words = rounded.words.copy_to_host()
    want = matmul_bf16.Bf16Matrix(np.zeros((5, 8), np.uint32), 13)
    matmul_bf16.round_bf16_numpy(want, x)
    assert rounded.shape == (5, 13) and words.shape == (5, 8)
    assert np.array_equal(words, want.words)
    assert np.array_equal(unpack_bf16(words)[:, :13], bf16_values(x))
    assert not unpack_bf16(words)[:, 13:].any()


def test_bf16_rounding_is_to_nearest_even():
    ulp = 2.0 ** -7                     # bf16's spacing at 1 (7 bits of mantissa after the 1)
    x = np.array([1.0, 1 + ulp, 1 + 0.75 * ulp, 1 + 0.5 * ulp, 1 + 0.5 * ulp + 2 ** -20,
                  1 + 1.5 * ulp, -2.5], dtype=np.float32)
    want = np.array([1.0, 1 + ulp, 1 + ulp, 1.0, 1 + ulp, 1 + 2 * ulp, -2.5], dtype=np.float32)
    assert np.array_equal(bf16_values(x), want)         # (the ties go to the even mantissa)
    assert np.array_equal(unpack_bf16(pack_bf16(x[:6].reshape(1, -1))).ravel(), want[:6])
    assert bf16_bits(np.float32(1.0)) == 0x3F80


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
        monkeypatch.setattr(matmul_bf16, name, value)
    monkeypatch.setattr(matmul_bf16, "mma_matmul_kernel",       # (a new cache of kernels)
                        kernel_factory(matmul_bf16.mma_matmul_kernel.__wrapped__))
    check(rng, transpose_a, transpose_b, 100, 24, 40, True, False, precision=precision)


def check_gelu_in_bf16(rng, product, M, N, K):
    """product(out, a, b, bias, gelu_out=Bf16Matrix): out as with a float32 gelu_out, and
    GELU's output the float32 one rounded to bf16, to the bit (the epilogue rounds the same
    float32 values round_bf16 would); bf16_values reads it back as float32."""
    a, b, bias = (device(rng.standard_normal(s)) for s in ((M, K), (K, N), (N,)))
    out, hidden = poisoned((M, N)), poisoned((M, N))
    product(out, a, b, bias, gelu_out=hidden)
    out_words = poisoned((M, N))
    words = matmul_bf16.Bf16Matrix.allocate((M, N), matmul_bf16.device_empty)
    product(out_words, a, b, bias, gelu_out=words)
    np.testing.assert_array_equal(out_words.copy_to_host(), out.copy_to_host())
    want = matmul_bf16.Bf16Matrix.allocate((M, N), np.empty)
    matmul_bf16.round_bf16_numpy(want, hidden.copy_to_host())
    np.testing.assert_array_equal(words.words.copy_to_host(), want.words)
    values = poisoned((M, N))
    matmul_bf16.bf16_values(values, words)
    np.testing.assert_array_equal(values.copy_to_host(), matmul_bf16.bf16_matrix_values(want))


def check_products_in_bf16(rng, product, M, N, K):
    """product(out, a, b, bias, ...) with out a Bf16Matrix (the bf16 epilogue: the MLP's
    pre-activation, GELU's output and the pre-activation's gradient written as the next
    products read them), and the NumPy twin likewise: out is the float32 product rounded, to
    the bit; GELU's output is GELU of out as rounded (to bf16's rounding: numpy's exp is not
    the GPU's); GELU's backward reads a Bf16Matrix input as its values, and its result is the
    float32 one rounded, to the bit. The kernel and the twin agree to float32 sums' order."""
    Bf16Matrix = matmul_bf16.Bf16Matrix
    a, b, bias = (rng.standard_normal(s).astype(np.float32) for s in ((M, K), (N, K), (N,)))
    pre = Bf16Matrix.allocate((M, N), np.empty)              # GELU's input, in bf16
    matmul_bf16.round_bf16_numpy(pre, 3 * rng.standard_normal((M, N)).astype(np.float32))
    pre_values = matmul_bf16.bf16_matrix_values(pre)
    sides = {"kernel": (product, device, lambda: Bf16Matrix.allocate((M, N),
                                                                       matmul_bf16.device_empty),
                        lambda x: x.copy_to_host()),
             "twin": (matmul_bf16.matmul_bf16_numpy, np.array,
                      lambda: Bf16Matrix.allocate((M, N), np.empty), np.asarray)}
    got = {}
    for side, (run, put, new, host) in sides.items():
        x, w, c = put(a), put(b), put(bias)         # (w: W^T, as dX = dY . W^T reads it)
        gelu_input = Bf16Matrix(put(pre.words) if side == "twin" else device(pre.words, np.uint32),
                                N)
        out, activated, activated_pre, dpre = new(), new(), new(), new()
        run(out, x, w, c, transpose_b=True)
        run(activated_pre, x, w, c, transpose_b=True, gelu_out=activated)
        run(dpre, x, w, None, transpose_b=True, gelu_input=gelu_input)
        words = [host(m.words) for m in (out, activated_pre, activated, dpre)]
        floats = [put(np.full((M, N), np.nan, np.float32)) for _ in range(2)]
        run(floats[0], x, w, c, transpose_b=True)
        run(floats[1], x, w, None, transpose_b=True, gelu_input=put(pre_values))
        for value, want in zip((words[0], words[3]), floats):        # the float32 ones rounded
            rounded = Bf16Matrix.allocate((M, N), np.empty)
            matmul_bf16.round_bf16_numpy(rounded, host(want))
            np.testing.assert_array_equal(value, rounded.words)
        np.testing.assert_array_equal(words[1], words[0])            # gelu's pre-activation
        gelu_of_out = np.empty((M, N), np.float32)
        gelu.gelu_forward_numpy(gelu_of_out, unpack_bf16(words[0])[:, :N])
        np.testing.assert_allclose(unpack_bf16(words[2])[:, :N], gelu_of_out, rtol=2 ** -7,
                                   atol=1e-6)
        got[side] = words
    for kernel, twin in zip(got["kernel"], got["twin"]):
        assert relative_error(unpack_bf16(kernel), unpack_bf16(twin)) < BF16_TOLERANCE / 10


def test_matmul_bf16_products_in_bf16(rng):
    """matmul_bf16 with out a Bf16Matrix: on Hopper wgmma's bf16 epilogue, elsewhere (and in
    the simulator) the float32 product rounded after (through_float32)."""
    M, N, K = (40, 24, 40) if not GPU else (1000, 1544, 392)
    check_products_in_bf16(rng, matmul_bf16.matmul_bf16, M, N, K)


def test_matmul_bf16_writes_gelu_in_bf16(rng):
    """matmul_bf16 with a Bf16Matrix gelu_out (the MLP up in bf16 training): on Hopper wgmma's
    epilogue writes it, elsewhere (and in the simulator) a float32 GELU rounded; the twin
    likewise."""
    M, N, K = (40, 24, 40) if not GPU else (1000, 1544, 392)
    check_gelu_in_bf16(rng, matmul_bf16.matmul_bf16, M, N, K)
    a, b, bias = (rng.standard_normal(s) for s in ((M, K), (K, N), (N,)))
    out, hidden = np.empty((M, N)), np.empty((M, N))
    matmul_bf16.matmul_bf16_numpy(out, a, b, bias, gelu_out=hidden)
    words = matmul_bf16.Bf16Matrix.allocate((M, N), np.empty)
    matmul_bf16.matmul_bf16_numpy(np.empty((M, N)), a, b, bias, gelu_out=words)
    want = matmul_bf16.Bf16Matrix.allocate((M, N), np.empty)
    matmul_bf16.round_bf16_numpy(want, hidden.astype(np.float32))
    np.testing.assert_array_equal(words.words, want.words)


def test_bf16_mlp_keeps_gelu_as_the_next_products_operand(rng):
    """ops.linear(activation="gelu") in bf16: the pre-activation, GELU's output and the
    pre-activation's gradient are written only as the MLP's products read them (the
    OperandTensor's operand), no float32 copy is made in the forward or the backward, and the output and gradients are the NumPy backend's (its twin rounds the same
    way). Reading `data` afterwards gives GELU's values in bf16: GELU of the pre-activation as
    it was stored."""
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
            assert hasattr(h.pre.grad, "words")                          # (and its gradient)
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
