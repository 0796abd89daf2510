"""AdamW's bf16 copies (kernels/adamw.py): the kernel and its twin write, beside each weight
they update, the bits round_bf16 makes of it, for the first n weights and no others. (The
update itself against its twin: test_twins.py; against the formula: test_numpy_ops.py.)"""
import numpy as np
import pytest

from checks import device
from conftest import GPU
from nanoandrea.kernels import adamw
from nanoandrea.kernels.operands import Bf16Matrix, round_bf16_numpy

UNWRITTEN = 0xDEAD          # the bits past the copies: no weight's bf16 (a NaN's), left alone


def rounded(weights):
    """round_bf16_numpy's bits of weights [n] (n a multiple of 8), as uint16 [n]."""
    out = Bf16Matrix(np.empty((weights.size // 8, 4), np.uint32), 8)
    round_bf16_numpy(out, weights.reshape(-1, 8))
    return out.bf16_pairs.view(np.uint16).reshape(-1)


def bf16_hard_values(rng, size):
    """Weights where a rounding to bf16 is easy to get wrong: ties (the 16 dropped bits exactly
    0x8000, to even either way), just either side of them, carries into the exponent and past
    the largest float32 (to infinity), subnormals, zeros, infinities; each also negated."""
    exponents = rng.integers(0, 255, size // 8, dtype=np.uint32)
    kept = rng.integers(0, 2**7, size // 8, dtype=np.uint32)
    ties = (exponents << 23) | (kept << 16) | np.uint32(0x8000)
    bits = np.concatenate([ties, ties - 1, ties + 1, np.uint32([
        0x3F7FFFFF, 0x3F7F8000, 0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0x00008000, 0x00018000,
        0x00007FFF, 0x00000000, 0x7F800000])])
    values = bits.view(np.float32)
    return np.resize(np.concatenate([values, -values]), size)


def step_arguments(rng, params, lr):
    """(params, grads, m, v, hyper, norm) of one step, float32 on the host."""
    P = params.size
    grads = rng.standard_normal(P).astype(np.float32)
    hyper = adamw.adamw_hyperparameters(lr, 0.9, 0.99, 1e-8, 0.1, 1.0, 7)
    norm = np.array([np.linalg.norm(grads.astype(np.float64))], np.float32)
    return (params.astype(np.float32), grads, (0.1 * rng.standard_normal(P)).astype(np.float32),
            rng.random(P).astype(np.float32), hyper, norm)


@pytest.mark.parametrize("values", ["updated", "hard"])
def test_adamw_writes_the_bits_round_bf16_makes_of_the_weights(rng, values):
    """updated: a step of random weights; the copies of the first n (the matrices, 8-aligned)
    are round_bf16's of the weights the kernel (the twin) wrote, and the uint16 after them
    keep their bits. hard: lr 0 over rounding's hard values (ties to even, carries into the
    exponent, infinities, subnormals): the weights keep their values, and their copies are
    still round_bf16's."""
    P, n = (1000, 600) if not GPU else (10_770_816, 10_000_000)
    if values == "updated":
        params, lr, n_decay = 0.02 * rng.standard_normal(P), 3e-3, n
    else:                                   # (no decay: 0 x infinity would be a NaN)
        params, lr, n_decay = bf16_hard_values(rng, P), 0.0, 0
    arguments = step_arguments(rng, params, lr)
    copies_and_more = np.full(n + 8, UNWRITTEN, np.uint16)

    on_gpu = [device(a) for a in arguments]
    gpu_copies = device(copies_and_more, np.uint16)
    adamw.adamw_update(*on_gpu, n_decay, gpu_copies[:n])
    gpu_params, gpu_copies = on_gpu[0].copy_to_host(), gpu_copies.copy_to_host()

    twin = [a.copy() for a in arguments]
    twin_copies = copies_and_more.copy()
    adamw.adamw_update_numpy(*twin, n_decay, twin_copies[:n])

    for weights, copies in ((gpu_params, gpu_copies), (twin[0], twin_copies)):
        assert np.array_equal(copies[:n], rounded(weights[:n]))
        assert np.all(copies[n:] == UNWRITTEN)
    if values == "hard":                    # (the values stay; a zero may change its sign)
        assert np.array_equal(gpu_params, arguments[0]) and np.array_equal(twin[0], arguments[0])


def test_adamw_without_copies_writes_none(rng):
    """bf16_copies empty (fp32 and tf32 training, ZeRO-1's shard): the update alone, the same
    weights as with copies."""
    P = 1000 if not GPU else 10_770_816
    arguments = step_arguments(rng, 0.02 * rng.standard_normal(P), 3e-3)
    results = []
    for n in (0, P // 8 * 8):
        on_gpu = [device(a) for a in arguments]
        adamw.adamw_update(*on_gpu, P // 2, device(np.zeros(n), np.uint16))
        results.append(on_gpu[0].copy_to_host())
    assert np.array_equal(results[0].view(np.uint32), results[1].view(np.uint32))
    with pytest.raises(ValueError, match="bf16_copies must be uint16"):
        adamw.adamw_update(*[device(a) for a in arguments], P // 2,
                           device(np.zeros(8), np.uint32))


def test_adamw_four_a_thread_equals_the_reference(rng):
    """The fast kernel (four parameters a thread, 16-byte loads; the last P % 4 one a thread)
    and the reference (a thread a parameter) write the same bits: weights, moments, copies,
    with the decay's end and the copies' end inside a group of four; and a buffer that is not
    16-byte aligned (a ZeRO-1 shard's view) takes the reference."""
    P = 1003 if not GPU else 10_770_819
    n_decay, n = P // 2 + 1, P // 3 + 2
    arguments = step_arguments(rng, 0.02 * rng.standard_normal(P), 3e-3)
    results = []
    for kernel in ("auto", "reference"):
        on_gpu = [device(a) for a in arguments]
        copies = device(np.full(n + 8, UNWRITTEN, np.uint16), np.uint16)
        adamw.adamw_update(*on_gpu, n_decay, copies[:n], kernel=kernel)
        results.append([x.copy_to_host() for x in on_gpu[:4]] + [copies.copy_to_host()])
    for fast, reference in zip(*results):
        assert np.array_equal(fast.view(np.uint8), reference.view(np.uint8))
    shard = [device(np.concatenate([[0], a]).astype(np.float32))[1:] for a in arguments[:4]]
    adamw.adamw_update(*shard, *[device(a) for a in arguments[4:]], n_decay,
                       device(np.zeros(n), np.uint16))
    assert np.array_equal(shard[0].copy_to_host().view(np.uint32),
                          results[1][0].view(np.uint32))
