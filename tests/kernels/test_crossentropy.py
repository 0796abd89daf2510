"""The cross-entropy (kernels/crossentropy.py) beyond its twin (test_twins.py): the fused
forward-and-backward kernels by name, each against the twin; the gradient written in bf16 as
the LM head's products read it, to the bit; the model's padded vocabulary, whose padding
columns are no classes and get gradient 0."""
import numpy as np
import pytest

from checks import TOLERANCE, device, poisoned
from conftest import GPU, relative_error
from nanoandrea.kernels import crossentropy
from nanoandrea.kernels.operands import Bf16Matrix, bf16_matrix_values, round_bf16_numpy


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
        dlogits_bf16 = Bf16Matrix.allocate((N, V), lambda shape, dtype: device(
            np.full(shape, 0xFFFFFFFF), dtype))
        loss_b = poisoned(1)
        crossentropy.crossentropy_forward_backward(loss_b, poisoned(N), poisoned(N), dlogits_bf16,
                                                   device(logits), device(targets, np.int32),
                                                   device(dloss), kernel=kernel)
        rounded = Bf16Matrix.allocate((N, V), np.empty)
        round_bf16_numpy(rounded, fused[3].copy_to_host())
        assert np.array_equal(dlogits_bf16.bf16_pairs.copy_to_host(), rounded.bf16_pairs)
        assert loss_b.copy_to_host()[0] == fused[0].copy_to_host()[0]
    twin = Bf16Matrix.allocate((N, V), np.empty)
    crossentropy.crossentropy_forward_backward_numpy(np.empty(1), np.empty(N), np.empty(N), twin,
                                                     logits, targets, dloss)
    round_bf16_numpy(rounded, want_fused[3].astype(np.float32))
    assert np.array_equal(twin.bf16_pairs, rounded.bf16_pairs)


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


def bf16_logits(rng, N, Vp, scale):
    """Logits [N, Vp] as the LM head writes them in bf16: (a device Bf16Matrix, its host twin)."""
    logits = Bf16Matrix.allocate((N, Vp), np.empty)
    round_bf16_numpy(logits, (scale * rng.standard_normal((N, Vp))).astype(np.float32))
    return Bf16Matrix(device(logits.bf16_pairs, np.uint32), Vp), logits


@pytest.mark.parametrize("scale", [1.0, 30.0])
@pytest.mark.parametrize("rows_in_shared", [None, 2, 1.5, 0.5])
def test_crossentropy_of_bf16_logits(rng, monkeypatch, scale, rows_in_shared):
    """Logits in bf16 (bf16_logits_kernel: persistent blocks, each row read once into shared
    memory, ex2.approx): the loss, lse and the bf16 gradient against the twin on the same bf16
    values, the forward alone too (evaluation's); the padding columns outside the softmax with
    gradient 0, a target in the chunk where the classes end. rows_in_shared: None, the device
    as it is; else a device of 2 multiprocessors whose blocks hold that many rows: 2, two
    blocks take turns at the N rows (N odd: one takes a row more) with the next row streaming
    into the second buffer; 1.5, the same with one buffer; 0.5, no row fits and the logits go
    through float32 values and the float32 kernels instead."""
    N, Vp, V = (5, 328, 321) if not GPU else (2048, 50304, 50257)
    if rows_in_shared is not None:
        from nanoandrea.kernels.runtime import device as runtime_device
        row_bytes = 2 * Vp
        small = runtime_device.Device(
            "a card of little shared memory", (9, 0), 2, 50 * 2**20,
            int(rows_in_shared * row_bytes) + (crossentropy.STATS_BYTES if rows_in_shared >= 1
                                               else 0))
        monkeypatch.setattr(runtime_device, "current", lambda: small)
        grid = {2: (2, 2), 1.5: (1, 2), 0.5: None}[rows_in_shared]
        assert crossentropy.bf16_logits_grid(N, row_bytes) == grid
    logits, host = bf16_logits(rng, N, Vp, scale)
    targets = rng.integers(0, V, size=N).astype(np.int32)
    targets[0] = V - 1
    dloss = np.array([0.7], np.float32)
    want = [np.empty(1, np.float32), np.empty(N, np.float32), np.empty(N, np.float32)]
    want_grad = Bf16Matrix.allocate((N, Vp), np.empty)
    crossentropy.crossentropy_forward_backward_numpy(*want, want_grad, host, targets, dloss,
                                                     vocab=V)
    got = [poisoned(1), poisoned(N), poisoned(N)]
    grad = Bf16Matrix.allocate((N, Vp), lambda shape, dtype: device(
        np.full(shape, 0xFFFFFFFF), dtype))
    crossentropy.crossentropy_forward_backward(*got, grad, logits, device(targets, np.int32),
                                               device(dloss), vocab=V)
    for g, w in zip(got, want):
        assert relative_error(g.copy_to_host(), w) < 1e-5
    got_values = bf16_matrix_values(Bf16Matrix(grad.bf16_pairs.copy_to_host(), Vp))
    want_values = bf16_matrix_values(want_grad)
    assert np.abs(got_values - want_values).max() <= 2**-7 * np.abs(want_values).max()
    assert not got_values[:, V:].any()
    forward = [poisoned(1), poisoned(N), poisoned(N)]
    crossentropy.crossentropy_forward(*forward, logits, device(targets, np.int32), vocab=V)
    for g, w in zip(forward, want):
        assert relative_error(g.copy_to_host(), w) < 1e-5


def test_bf16_logits_grid(monkeypatch):
    """At andrea-120m's [16384, 50304] on an H100's figures (the simulator's device): a row is
    98 KB, two fit in a block's shared memory, so one block a multiprocessor, each with two
    buffers; past half the shared memory one buffer; past all of it none (float32 instead)."""
    from nanoandrea.kernels.runtime import device as runtime_device
    h100 = runtime_device.SIMULATED
    assert h100.multiprocessors == 132 and h100.shared_bytes_optin == 227 * 1024
    monkeypatch.setattr(runtime_device, "current", lambda: h100)
    assert crossentropy.bf16_logits_grid(16384, 2 * 50304) == (2, 132)
    assert crossentropy.bf16_logits_grid(100, 2 * 50304) == (2, 100)
    assert crossentropy.bf16_logits_grid(16384, 2 * 100_000) == (1, 132)
    assert crossentropy.bf16_logits_grid(16384, 2 * 120_000) is None


@pytest.mark.parametrize("scale", ["float64", "float32"])
def test_bf16_logits_kernel_keeps_the_bits_of_the_kernel_before(rng, monkeypatch, scale):
    """The persistent kernel does the arithmetic of the row-per-block kernel it replaced
    (kept in tools/dev/loss_bench.py; its base-2 logits and per-thread online sums are the
    package's helpers, so this holds the rest: the reductions, lse, the loss, the gradient's
    scale and rounding, the rows each block walks), step for step: losses, lse and every
    gradient word the same bits, on a device of 2 multiprocessors whose blocks take turns at
    the rows (the default recipe's losses were measured with those bits). The gradient's
    scale dloss / N: one float32 does not hold (float64 products), and one it holds (float32
    products, which the kernel then makes: the same bits)."""
    import importlib.util
    from pathlib import Path
    from nanoandrea.kernels.runtime import device as runtime_device
    path = Path(__file__).resolve().parents[2] / "tools" / "dev" / "loss_bench.py"
    spec = importlib.util.spec_from_file_location("loss_bench", path)
    before = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(before)
    N, Vp, V = (7, 328, 321) if not GPU else (1031, 50304, 50257)
    two = runtime_device.Device("two multiprocessors", (9, 0), 2, 50 * 2**20,
                                2 * 2 * Vp + crossentropy.STATS_BYTES)
    monkeypatch.setattr(runtime_device, "current", lambda: two)
    assert crossentropy.bf16_logits_grid(N, 2 * Vp) == (2, 2)
    logits, _ = bf16_logits(rng, N, Vp, 4.0)
    targets = rng.integers(0, V, size=N).astype(np.int32)
    targets[0], targets[1] = V - 1, 0
    outputs = []
    for run in (before.launch_row_per_block, crossentropy.launch_bf16_logits):
        losses, lse = poisoned(N), poisoned(N)
        grad = Bf16Matrix.allocate((N, Vp), lambda shape, dtype: device(
            np.full(shape, 0xFFFFFFFF), dtype))
        dloss = 0.7 if scale == "float64" else N / 1024     # (dloss / N: 0.1, or 2^-10)
        run(losses, lse, grad, logits, device(targets, np.int32),
            device(np.array([dloss], np.float32)), V)
        outputs.append([x.copy_to_host().view(np.uint32)
                        for x in (losses, lse, grad.bf16_pairs)])
    for a, b in zip(*outputs):
        assert np.array_equal(a, b)
