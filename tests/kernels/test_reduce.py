"""The column sums (kernels/reduce.py's sum_rows: the biases' gradients) beyond their twin
(test_twins.py): a gradient the products wrote in bf16, summed from its bf16 pairs."""
import numpy as np

from checks import TOLERANCE, device, poisoned
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
