"""Products of few rows (kernels/matmul/matvec.py) against their NumPy twin and float64, in both
orientations and precisions, split over K or not; and the model's forward of one token through
them against the tile kernels'."""
import numpy as np
import pytest

from checks import device, poisoned
from conftest import GPU, relative_error
from nanoandrea.kernels import matmul
from nanoandrea.kernels.matmul import matvec
from nanoandrea.kernels.operands import Bf16Matrix, round_bf16_numpy
from nanoandrea.kernels.runtime import device as runtime_device


TOLERANCE = 2e-5 if not GPU else 1e-4      # float32 sums against float64 (or the twin)
BF16_TOLERANCE = 1e-2                       # bf16 operands against the unrounded product
# (M, N, K): K not a multiple of the block's groups, N not of its columns; on the GPU the
# model's products (QKV, MLP up and down, the LM head's vocabulary) and odd ones
CASES = ([(1, 20, 36), (3, 36, 28)] if not GPU else
         [(1, 768, 768), (8, 3072, 768), (5, 768, 3072), (16, 1540, 388), (8, 50304, 768)])


def bf16_device(x):
    """A Bf16Matrix of x on the device (what backend.operand makes in bf16)."""
    rounded = Bf16Matrix(np.zeros(Bf16Matrix.pairs_shape(x.shape), np.uint32), x.shape[1])
    round_bf16_numpy(rounded, x.astype(np.float32))
    return Bf16Matrix(device(rounded.bf16_pairs, np.uint32), x.shape[1])


def check(rng, M, N, K, transpose_b, bf16, with_bias, gelu):
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = (rng.standard_normal((N, K) if transpose_b else (K, N)) / np.sqrt(K)).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32) if with_bias else None
    out, activated = poisoned((M, N)), poisoned((M, N)) if gelu else None
    w_device = bf16_device(w) if bf16 else device(w)
    assert matvec.takes_matvec(device(x), w_device, transpose_b)
    matvec.matvec(out, device(x), w_device, None if bias is None else device(bias),
                  transpose_b=transpose_b, gelu_out=activated)
    want, want_activated = np.zeros((M, N)), np.zeros((M, N))
    w_host = w
    if bf16:
        w_host = Bf16Matrix(np.asarray(w_device.bf16_pairs.copy_to_host()),
                            K if transpose_b else N)
    matvec.matvec_numpy(want, x.astype(np.float64), w_host if bf16 else w.astype(np.float64),
                        bias, transpose_b, want_activated if gelu else None)
    got = out.copy_to_host()
    assert relative_error(got, want) < TOLERANCE
    if gelu:
        assert relative_error(activated.copy_to_host(), want_activated) < TOLERANCE
    exact = np.zeros((M, N))
    matmul.matmul_numpy(exact, x.astype(np.float64), w.astype(np.float64), bias,
                        transpose_b=transpose_b)
    assert relative_error(got, exact) < (BF16_TOLERANCE if bf16 else TOLERANCE)
    again = poisoned((M, N))             # the same bits at a second call: a fixed order
    matvec.matvec(again, device(x), w_device, None if bias is None else device(bias),
                  transpose_b=transpose_b)
    assert np.array_equal(again.copy_to_host(), got)


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("transpose_b", [False, True])
def test_matvec(rng, bf16, transpose_b):
    for M, N, K in CASES:
        if not transpose_b and N > 4096:            # (the vocabulary is the LM head's alone)
            continue
        check(rng, M, N, K, transpose_b, bf16, with_bias=not transpose_b, gelu=False)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("bf16", [False, True])
def test_matvec_split_or_not_with_gelu(rng, monkeypatch, splits, bf16):
    """The MLP's first layer: the bias and GELU in the kernel (one split) or after the
    split-K sum; many rows (several passes of the groups' sums)."""
    monkeypatch.setattr(matvec, "matvec_splits", lambda N, K: splits)
    M, N, K = (6, 24, 40) if not GPU else (16, 3072, 768)
    check(rng, M, N, K, False, bf16, with_bias=True, gelu=True)


def test_matvec_splits_fill_the_gpu():
    """Two blocks a multiprocessor where K is long enough, each thread reading at least
    MIN_ROWS_PER_THREAD rows of W; one split where the columns alone fill the GPU."""
    per_split = matvec.MIN_ROWS_PER_THREAD * matvec.GROUPS
    for N, K in [(768, 768), (3072, 768), (768, 3072), (50304, 768), (64, 64)]:
        splits = matvec.matvec_splits(N, K)
        columns = -(-N // matvec.BLOCK_COLUMNS)
        assert splits == 1 or K // splits >= per_split
        assert splits == K // per_split or (
            columns * splits >= 2 * runtime_device.current().multiprocessors)
    assert matvec.matvec_splits(1 << 20, 768) == 1


def test_matvec_takes_few_rows_of_whole_runs():
    x, w = np.zeros((4, 8), np.float32), np.zeros((8, 12), np.float32)
    assert matvec.takes_matvec_numpy(x, w)
    assert not matvec.takes_matvec_numpy(np.zeros((matvec.MAX_ROWS + 1, 8), np.float32), w)
    assert not matvec.takes_matvec_numpy(x, np.zeros((8, 10), np.float32))
    assert matvec.takes_matvec_numpy(x, np.zeros((12, 8), np.float32), transpose_b=True)


@pytest.mark.parametrize("precision", ["fp32"] + (["bf16"] if GPU else []))
def test_forward_of_few_rows_runs_matvec_and_equals_the_tile_kernels(rng, monkeypatch,
                                                                     precision):
    """Without gradients a forward of few rows (B x T <= MAX_ROWS) takes matvec for every
    linear layer, and gives the logits the tile kernels give with gradients on. (In the
    simulator fp32 only: test_matvec checks the bf16 kernels, and this takes half a minute.)"""
    from nanoandrea.autograd import no_grad
    from nanoandrea.backend import get_backend
    from nanoandrea.config import get_preset
    from nanoandrea.model import GPT
    config = get_preset("tiny") if not GPU else get_preset("andrea-mini", vocab_size=65)
    model = GPT(config, get_backend("cuda", precision=precision), seed=5)
    ids = rng.integers(0, config.vocab_size, size=(2, 3))
    with_grad, _ = model.forward(ids)
    calls = []
    original = model.backend.matvec
    monkeypatch.setattr(model.backend, "matvec",
                        lambda *args, **options: calls.append(1) or original(*args, **options))
    with no_grad():
        without, _ = model.forward(ids)
    assert len(calls) == 6 * config.n_layer + 1         # Q, K, V, O, MLP up and down; LM head
    # (bf16: an activation that lies within float32's last bits of a boundary between two
    # bf16 numbers is rounded to either, 2^-9 apart, and the next layers carry that on:
    # bf16's tolerance; measured 1.4e-3 on the H200. A wrong product is an error of order 1)
    tolerance = TOLERANCE if precision == "fp32" else 1e-2
    assert relative_error(without.numpy(), with_grad.numpy()) < tolerance
