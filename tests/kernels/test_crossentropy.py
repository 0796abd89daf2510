"""The cross-entropy (kernels/crossentropy.py) beyond its twin (test_twins.py): the fused
forward-and-backward kernels by name, each against the twin; the gradient written in bf16 as
the LM head's products read it, to the bit; the model's padded vocabulary, whose padding
columns are no classes and get gradient 0."""
import numpy as np
import pytest

from checks import TOLERANCE, device, poisoned
from conftest import GPU, relative_error
from nanoandrea.kernels import crossentropy
from nanoandrea.kernels.operands import Bf16Matrix, round_bf16_numpy


@pytest.mark.parametrize("scale, columns", [(1.0, 37), (100.0, 37), (1.0, 40), (100.0, 40)])
def test_crossentropy_kernels(rng, scale, columns):
    """The fused kernels, "reference" and (rows of 16-byte runs) "fast": the loss and dlogits
    in one pass, as the twin's. columns: 37, rows the 16-byte kernel cannot take; 40, rows it
    can (and on the GPU 4096 and 4097)."""
    N, V = (7, columns) if not GPU else (16384, 4096 + columns % 2)
    logits = scale * rng.standard_normal((N, V))
    targets = rng.integers(0, V, size=N).astype(np.int32)
    dloss = np.array([0.7])
    want_fused = [np.empty(1), np.empty(N), np.empty(N), np.empty((N, V))]
    crossentropy.crossentropy_forward_backward_numpy(*want_fused, logits, targets, dloss)
    for kernel in ("reference", "fast") if V % 4 == 0 else ("reference",):
        fused = [poisoned(1), poisoned(N), poisoned(N), poisoned((N, V))]
        crossentropy.crossentropy_forward_backward(*fused, device(logits),
                                                   device(targets, np.int32), device(dloss),
                                                   kernel=kernel)
        for got, expected in zip(fused, want_fused):
            assert relative_error(got.copy_to_host(), expected) < TOLERANCE
        # bf16 training's gradient, written as the LM head's products read it: the bits a
        # rounding of the float32 gradient gives
        words = Bf16Matrix.allocate((N, V), lambda shape, dtype: device(
            np.full(shape, 0xFFFFFFFF), dtype))
        loss_b = poisoned(1)
        crossentropy.crossentropy_forward_backward(loss_b, poisoned(N), poisoned(N), words,
                                                   device(logits), device(targets, np.int32),
                                                   device(dloss), kernel=kernel)
        rounded = Bf16Matrix.allocate((N, V), np.empty)
        round_bf16_numpy(rounded, fused[3].copy_to_host())
        assert np.array_equal(words.words.copy_to_host(), rounded.words)
        assert loss_b.copy_to_host()[0] == fused[0].copy_to_host()[0]
    twin = Bf16Matrix.allocate((N, V), np.empty)
    crossentropy.crossentropy_forward_backward_numpy(np.empty(1), np.empty(N), np.empty(N), twin,
                                                     logits, targets, dloss)
    round_bf16_numpy(rounded, want_fused[3].astype(np.float32))
    assert np.array_equal(twin.words, rounded.words)


@pytest.mark.parametrize("fused", [False, True])
def test_crossentropy_ignores_padded_vocabulary(rng, fused):
    """Logits [N, Vp] of which the first V are classes (the model's padded vocabulary): the
    loss is the cross-entropy of logits[:, :V], and the padding columns get gradient 0, even
    when their logits are large."""
    N, Vp, V = (6, 40, 37) if not GPU else (1024, 50304, 50257)
    logits = rng.standard_normal((N, Vp))
    logits[:, V:] = 30.0
    targets = rng.integers(0, V, size=N).astype(np.int32)
    dloss = np.array([0.7])
    loss, losses, lse, dlogits = poisoned(1), poisoned(N), poisoned(N), poisoned((N, Vp))
    if fused:
        crossentropy.crossentropy_forward_backward(loss, losses, lse, dlogits, device(logits),
                                                   device(targets, np.int32), device(dloss), V)
    else:
        crossentropy.crossentropy_forward(loss, losses, lse, device(logits),
                                          device(targets, np.int32), V)
        crossentropy.crossentropy_backward(dlogits, device(dloss), device(logits), lse,
                                           device(targets, np.int32), vocab=V)
    want = [np.empty(1), np.empty(N), np.empty(N), np.empty((N, V))]    # unpadded, no vocab
    crossentropy.crossentropy_forward_backward_numpy(*want, logits[:, :V].copy(), targets, dloss)
    for got, expected in zip((loss, losses, lse), want):
        assert relative_error(got.copy_to_host(), expected) < TOLERANCE
    got = dlogits.copy_to_host()
    assert relative_error(got[:, :V], want[3]) < TOLERANCE and np.all(got[:, V:] == 0)
    twin = [np.empty(1), np.empty(N), np.empty(N), np.empty((N, Vp))]   # the twin agrees
    crossentropy.crossentropy_forward_backward_numpy(*twin, logits, targets, dloss, V)
    assert relative_error(twin[0], want[0]) < 1e-12 and np.all(twin[3][:, V:] == 0)
