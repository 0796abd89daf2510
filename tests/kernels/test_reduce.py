"""The column sums (kernels/reduce.py's sum_rows: the biases' gradients) beyond their twin
(test_twins.py): a gradient the products wrote in bf16, summed from its bf16 pairs; the fast
kernel and the reference's, each where it is taken."""
import numpy as np
import pytest

from checks import TOLERANCE, device, poisoned, recording_launches
from conftest import GPU, relative_error
from nanoandrea.kernels import reduce
from nanoandrea.kernels.operands import Bf16Matrix, bf16_matrix_values, round_bf16_numpy


def test_sum_rows_of_bf16(rng):
    """sum_rows of a Bf16Matrix (a gradient written in bf16): its values summed in float32,
    the odd columns' (a pair's high half) and the even ones' alike."""
    x = rng.standard_normal((200, 48) if not GPU else (16384, 3072))
    rounded = Bf16Matrix.allocate(x.shape, np.empty)
    round_bf16_numpy(rounded, x.astype(np.float32))
    out = poisoned(x.shape[1])
    reduce.sum_rows(out, Bf16Matrix(device(rounded.bf16_pairs, np.uint32), x.shape[1]))
    want = np.empty(x.shape[1])
    reduce.sum_rows_numpy(want, rounded)
    assert np.array_equal(want, bf16_matrix_values(rounded).sum(axis=0))
    assert relative_error(out.copy_to_host(), want) < TOLERANCE


@pytest.mark.parametrize("bf16_in", [False, True], ids=["float32", "bf16"])
@pytest.mark.parametrize("accumulate", [False, True], ids=["=", "+="])
@pytest.mark.parametrize("shape,kernel", [
    ((200, 48), "fast"),            # several row chunks, then their partials as one
    ((10, 40), "fast"),             # one chunk: straight into out
    ((200, 45), "reference"),       # rows not 8k columns
] if not GPU else [((16384, 768), "fast"), ((16384, 3072), "fast"), ((64, 786432), "fast"),
                   ((16384, 1000), "fast"), ((16384, 45), "reference")])
def test_sum_rows_kernels(rng, monkeypatch, bf16_in, accumulate, shape, kernel):
    """sum_rows against its twin (the float32 sum of the values, bf16's rounded): the fast
    kernel where the rows are 8k columns 16-byte aligned, the reference's elsewhere, into out
    or added to it."""
    x = rng.standard_normal(shape).astype(np.float32)
    prior = rng.standard_normal(shape[1]).astype(np.float32)
    out = device(prior) if accumulate else poisoned(shape[1])
    if bf16_in:
        rounded = Bf16Matrix.allocate(shape, np.empty)
        round_bf16_numpy(rounded, x)
        given = Bf16Matrix(device(rounded.bf16_pairs, np.uint32), shape[1])
    else:
        rounded, given = x, device(x)
    launched = recording_launches(monkeypatch, reduce)
    reduce.sum_rows(out, given, accumulate)
    want = prior.copy() if accumulate else np.empty(shape[1], np.float32)
    reduce.sum_rows_numpy(want, rounded, accumulate)
    assert relative_error(out.copy_to_host(), want) < TOLERANCE
    fast = {reduce.sum_rows8_kernel(bf16_in), reduce.sum_rows8_kernel(False)}
    assert set(launched) <= fast if kernel == "fast" else not set(launched) & fast


def test_sum_rows_of_unaligned_rows_takes_the_reference(rng, monkeypatch):
    """float32 rows 1 float off 16 bytes: the reference kernel, the same sums."""
    x = rng.standard_normal(1 + 40 * 48).astype(np.float32)
    given = device(x)[1:].reshape(40, 48)       # (each row 4 bytes past 16k)
    out = poisoned(48)
    launched = recording_launches(monkeypatch, reduce)
    reduce.sum_rows(out, given)
    assert reduce.sum_rows8_kernel(False) not in launched
    assert relative_error(out.copy_to_host(), x[1:].reshape(40, 48).sum(axis=0)) < TOLERANCE
