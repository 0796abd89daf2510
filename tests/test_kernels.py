"""Every CUDA kernel against its NumPy twin, forward and backward, on fresh random inputs.

Sizes are never multiples of a tile (T=7, C=24, V=37, ...). In the simulator they stay tiny; on
a GPU the same tests run at andrea-12m shapes. Outputs are poisoned with NaN before a kernel
writes them (every element must be written), and each gradient kernel is checked in both modes:
overwrite (=) and accumulate (+=) onto a random prior value.
"""
import os
import re
import subprocess
import sys

import numba
import numpy as np
import pytest
from numba import cuda

from conftest import GPU, relative_error
from nanoandrea.kernels import (adamw, attention, crossentropy, dropout, elementwise, embedding,
                                gelu, heads, layernorm, matmul, reduce)
from nanoandrea.kernels.launch import current_stream, launch
from nanoandrea.kernels.matmul_bf16 import Bf16Matrix, round_bf16_numpy
from nanoandrea.kernels.sharedmem import dynamic_shared_floats, shared_tile
from nanoandrea.kernels.vector import load4, store4

TOLERANCE = 2e-5 if not GPU else 1e-4      # float32 kernels against a float64 reference


def device(array, dtype=np.float32):
    return cuda.to_device(np.ascontiguousarray(array, dtype=dtype))


def poisoned(shape):
    return device(np.full(shape, np.nan))


def output_and_prior(rng, shape, accumulate):
    """(device output buffer, its prior value on the host): NaN-poisoned or random."""
    prior = rng.standard_normal(shape).astype(np.float32) if accumulate else np.zeros(shape)
    return (device(prior) if accumulate else poisoned(shape)), prior


# --- matmul ----------------------------------------------------------------------------------

ORIENTATIONS = [(False, False), (False, True), (True, False), (True, True)]
# (M, N, K, with bias, accumulate): sizes of 4k floats (the rows of either operand, transposed or
# not, are 16-byte runs: the fast kernel's), none a multiple of a tile
MATMUL_CASES = ([(12, 24, 36, True, False), (8, 20, 12, False, True)] if not GPU else
                [(1000, 1540, 388, True, False), (1000, 388, 772, False, True)])


def check_matmul(rng, kernel, transpose_a, transpose_b, M, N, K, with_bias, accumulate,
                 **gelu):
    a = rng.standard_normal((K, M) if transpose_a else (M, K))
    b = rng.standard_normal((N, K) if transpose_b else (K, N))
    bias = rng.standard_normal(N) if with_bias else None
    out, prior = output_and_prior(rng, (M, N), accumulate)
    pre = 3 * rng.standard_normal((M, N))               # gelu_input: GELU's input
    activated = poisoned((M, N))                        # gelu_out: its output
    device_gelu = dict(gelu_out=activated) if gelu.get("out") else (
        dict(gelu_input=device(pre)) if gelu.get("input") else {})
    matmul.matmul(out, device(a), device(b), None if bias is None else device(bias),
                  transpose_a, transpose_b, accumulate, kernel=kernel, **device_gelu)
    want, want_activated = prior.astype(np.float64), np.zeros((M, N))
    host_gelu = dict(gelu_out=want_activated) if gelu.get("out") else (
        dict(gelu_input=pre) if gelu.get("input") else {})
    matmul.matmul_numpy(want, a, b, bias, transpose_a, transpose_b, accumulate, **host_gelu)
    assert relative_error(out.copy_to_host(), want) < TOLERANCE
    if gelu.get("out"):
        assert relative_error(activated.copy_to_host(), want_activated) < TOLERANCE


def split_k(monkeypatch, splits):
    """Make matmul split K into `splits` slices whatever the shape (split_count decides it from
    the H200's multiprocessors, so tiny shapes never split)."""
    monkeypatch.setattr(matmul, "split_count", lambda M, N, K: splits)


@pytest.mark.parametrize("kernel,splits", [("reference", 1), ("fast", 1), ("fast", 3)])
@pytest.mark.parametrize("transpose_a,transpose_b", ORIENTATIONS)
def test_matmul(rng, monkeypatch, kernel, splits, transpose_a, transpose_b):
    """splits=3: split-K, three slices of K computed apart, then summed in a fixed order."""
    split_k(monkeypatch, splits)
    cases = MATMUL_CASES if GPU or kernel == "reference" else MATMUL_CASES[:1]
    for case in cases:                  # (the 256-thread kernel is slow to simulate)
        check_matmul(rng, kernel, transpose_a, transpose_b, *case)


@pytest.mark.parametrize("kernel,splits", [("reference", 1), ("fast", 1), ("fast", 2)])
def test_matmul_with_gelu(rng, monkeypatch, kernel, splits):
    """gelu_out: the MLP's activation, in the fast kernel's epilogue (after the sum of the
    slices with split-K; after the reference kernel), beside the pre-activation."""
    split_k(monkeypatch, splits)
    M, N, K = (12, 20, 16) if not GPU else (1024, 1536, 384)
    check_matmul(rng, kernel, False, False, M, N, K, True, False, out=True)


@pytest.mark.parametrize("kernel,splits,transpose_b,accumulate", [
    ("fast", 1, True, False),       # the input gradient dH = dY . W^T, times gelu'(H)
    ("fast", 1, False, True),       # the same product on W^T copied
    ("fast", 2, True, True),        # split-K: the sum of the slices first, then gelu'
    ("reference", 1, True, True)])  # likewise after the reference kernel
def test_matmul_with_gelu_backward(rng, monkeypatch, kernel, splits, transpose_b, accumulate):
    """gelu_input: the MLP's dH = (dY . W^T) * gelu'(H): out (+)= (a . op(b)) * gelu'(input)."""
    split_k(monkeypatch, splits)
    M, N, K = (12, 20, 16) if not GPU else (1000, 1540, 388)
    check_matmul(rng, kernel, False, transpose_b, M, N, K, False, accumulate, input=True)


@pytest.mark.parametrize("R,C", [(37, 45), (32, 64)] if not GPU else [(1000, 771), (768, 3072)])
def test_transpose(rng, R, C):
    x = rng.standard_normal((R, C))
    out = poisoned((C, R))
    matmul.transpose(out, device(x))
    want = np.zeros((C, R))
    matmul.transpose_numpy(want, x)
    assert np.array_equal(out.copy_to_host(), want.astype(np.float32))


@pytest.mark.parametrize("with_bias,accumulate,gelu_grad", [
    (True, False, False), (False, True, False), (False, True, True)])
def test_matmul_through_transposed_copy(rng, monkeypatch, with_bias, accumulate, gelu_grad):
    """With transpose_b and many rows matmul multiplies by a transposed copy of b (made by
    matmul, or given: b_transposed) instead of transposing b's slices in the kernel. The copy
    only moves data: all three add the same products in the same order, bit for bit."""
    M, N, K = (20, 24, 36) if not GPU else (2048, 3072, 772)
    if not GPU:                         # (so that tiny products take the copy too)
        monkeypatch.setattr(matmul, "TRANSPOSED_COPY_MIN_ROWS", 16)
    a, b = device(rng.standard_normal((M, K))), rng.standard_normal((N, K))
    bias = device(rng.standard_normal(N)) if with_bias else None
    pre = device(3 * rng.standard_normal((M, N))) if gelu_grad else None
    prior = rng.standard_normal((M, N))
    b_t = poisoned((K, N))
    matmul.transpose(b_t, device(b))
    outs = []
    for min_rows, given in ((None, None), (None, b_t), (10**9, None)):     # copy, given, none
        if min_rows:
            monkeypatch.setattr(matmul, "TRANSPOSED_COPY_MIN_ROWS", min_rows)
        assert matmul.copies_b_transposed(M, N, False, True) == (min_rows is None)
        out = device(prior) if accumulate else poisoned((M, N))
        matmul.matmul(out, a, device(b), bias, transpose_b=True, accumulate=accumulate,
                      kernel="fast", gelu_input=pre, b_transposed=given)
        outs.append(out.copy_to_host())
    want = prior.copy() if accumulate else np.zeros((M, N))
    matmul.matmul_numpy(want, a.copy_to_host(), b, None if bias is None else bias.copy_to_host(),
                        transpose_b=True, accumulate=accumulate,
                        gelu_input=None if pre is None else pre.copy_to_host())
    assert relative_error(outs[0], want) < TOLERANCE
    assert np.array_equal(outs[0], outs[1]) and np.array_equal(outs[0], outs[2])


@pytest.mark.parametrize("M,N,K", [(10, 21, 12), (10, 20, 13)])
def test_matmul_rows_not_16_byte_runs_take_the_reference(rng, monkeypatch, M, N, K):
    """A width that is not a multiple of 4 (out's N, or a's K) leaves rows that are not 16-byte
    runs: "auto" computes them with the reference kernel, and "fast" refuses them."""
    launched = recording_launches(monkeypatch, matmul)
    check_matmul(rng, "auto", False, False, M, N, K, True, True)
    assert launched == [matmul.matmul_tiled_kernel]
    with pytest.raises(ValueError, match="16-byte"):
        check_matmul(rng, "fast", False, False, M, N, K, True, True)


def test_matmul_kernels_made_once_per_parameters():
    """A kernel factory makes one kernel per set of compile-time parameters (defaults filled
    in) and names it by them; an unknown epilogue is refused."""
    kernel = matmul.matmul_kernel(False, True)
    assert matmul.matmul_kernel(False, True, None) is kernel
    assert matmul.matmul_kernel(False, True, "gelu_grad") is not kernel
    assert kernel.made_by == ("nanoandrea.kernels.matmul", "matmul_kernel", (False, True, None))
    with pytest.raises(ValueError, match="unknown epilogue"):
        matmul.matmul_kernel(False, False, "relu")


def test_matmul_rejects_bad_shapes():
    a, b = device(np.zeros((3, 4))), device(np.zeros((5, 6)))
    with pytest.raises(ValueError, match="matmul b: expected shape"):
        matmul.matmul(device(np.zeros((3, 6))), a, b)


@pytest.mark.parametrize("M,N,K", [(768, 768, 16384), (768, 3072, 16384), (384, 384, 16384),
                                   (65, 384, 16384), (16384, 768, 768), (1000, 900, 5000)])
def test_split_k_fills_its_waves(M, N, K):
    """The split count: 1 when the output alone fills the GPU; otherwise the smallest count
    whose waves of resident blocks are at least 90% busy and whose slice's rows of both
    operands fit in half the L2 (or, if none, the smallest well-filled count), slices never
    thinner than 256."""
    slots = matmul.RESIDENT_BLOCKS
    splits = matmul.split_count(M, N, K)
    output_blocks = -(-M // 128) * -(-N // 128)
    if output_blocks >= slots:
        assert splits == 1
        return
    assert 1 <= splits and K // splits >= 256

    def fill(s):
        total = output_blocks * s
        return total / (-(-total // slots) * slots)

    def fits(s):
        return 4 * (M + N) * matmul.k_per_slice(K, s) <= matmul.L2_BYTES // 2

    counts = [s for s in range(1, K // 256 + 1) if s * output_blocks <= 8 * slots]  # 8 waves
    well_filled = [s for s in counts if fill(s) >= 0.9]
    if not well_filled:                     # none fills its waves: the best-filled one
        assert all(fill(s) <= fill(splits) for s in counts)
        return
    assert splits == ([s for s in well_filled if fits(s)] or well_filled)[0]


@pytest.mark.parametrize("M,N,measured", [(768, 3072, 10), (3072, 768, 10), (768, 768, 7),
                                          (384, 384, 27), (384, 1536, 7)])
def test_split_count_of_the_measured_weight_gradients(M, N, measured):
    """The counts that ran fastest of those timed on the H200 (docs/perf.md): dW of the MLP,
    the attention projections and andrea-12m's, K = 16384."""
    assert matmul.split_count(M, N, 16384) == measured


@pytest.mark.parametrize("with_bias,accumulate", [(True, False), (False, True)])
def test_sum_splits(rng, with_bias, accumulate):
    """Split-K's partial products summed in order (+ bias), 16 bytes at a time."""
    M, N, S = (5, 24, 3) if not GPU else (1000, 1540, 7)
    partials = rng.standard_normal((S, M, N)).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32)
    out, prior = output_and_prior(rng, (M, N), accumulate)
    matmul.sum_splits(out, device(partials), device(bias) if with_bias else device(prior[0]),
                      with_bias, accumulate)
    want = (bias if with_bias else 0) + partials.astype(np.float64).sum(axis=0) + prior
    assert relative_error(out.copy_to_host(), want) < TOLERANCE


@pytest.mark.parametrize("accumulate", [False, True])
def test_sum_rows(rng, accumulate):
    x = rng.standard_normal((200, 45) if not GPU else (16384, 1536))     # several row chunks
    out, prior = output_and_prior(rng, x.shape[1], accumulate)
    reduce.sum_rows(out, device(x), accumulate)
    want = prior.astype(np.float64)
    reduce.sum_rows_numpy(want, x, accumulate)
    assert relative_error(out.copy_to_host(), want) < TOLERANCE


def test_sum_rows_of_bf16(rng):
    """sum_rows of a Bf16Matrix (a gradient written in bf16): its values summed in float32,
    the odd columns' (a word's high half) and the even ones' alike."""
    from nanoandrea.kernels.matmul_bf16 import Bf16Matrix, bf16_matrix_values, round_bf16_numpy
    x = rng.standard_normal((200, 48) if not GPU else (16384, 3072))
    words = Bf16Matrix.allocate(x.shape, np.empty)
    round_bf16_numpy(words, x.astype(np.float32))
    out = poisoned(x.shape[1])
    reduce.sum_rows(out, Bf16Matrix(device(words.words, np.uint32), x.shape[1]))
    want = np.empty(x.shape[1])
    reduce.sum_rows_numpy(want, words)
    assert np.array_equal(want, bf16_matrix_values(words).sum(axis=0))
    assert relative_error(out.copy_to_host(), want) < TOLERANCE


# --- split / merge heads ---------------------------------------------------------------------------

def device_at(array, offset):
    """A device copy of `array` whose first element sits `offset` floats past the start of its
    allocation: offset 1 makes it not 16-byte aligned (on a GPU; the simulator has no addresses)."""
    flat = np.zeros(offset + array.size, dtype=np.float32)
    flat[offset:] = array.reshape(-1)
    return cuda.to_device(flat)[offset:].reshape(array.shape)


def recording_launches(monkeypatch, module):
    """The list of the kernels `module` launches from now on, in order (they still run)."""
    launched = []

    def record(kernel, *arguments, **options):
        launched.append(kernel)
        launch(kernel, *arguments, **options)

    monkeypatch.setattr(module, "launch", record)
    return launched


# (B, T, H, D): D % 4 == 0 takes the 16-byte kernels (in the simulator D=64 gives a block 2 rows
# tall, so T=7 spans two blocks, the second part empty), other D the one-element kernels
HEADS_CASES = ([(2, 7, 3, 8), (2, 7, 2, 64), (2, 7, 3, 6)] if not GPU else
               [(64, 256, 12, 32), (16, 1024, 12, 64), (16, 256, 12, 30)])


@pytest.mark.parametrize("B,T,H,D", HEADS_CASES)
@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("accumulate", [False, True])
def test_split_and_merge_heads(rng, monkeypatch, B, T, H, D, offset, accumulate):
    """Bit for bit the NumPy twins (a copy, or one float32 add); offset 1: arrays not 16-byte
    aligned, which must take the one-element kernels (aligned16 tests the simulator's arrays
    as the GPU's)."""
    launched = recording_launches(monkeypatch, heads)
    x = rng.standard_normal((B, T, H * D)).astype(np.float32)
    prior = rng.standard_normal((B, H, T, D)).astype(np.float32)
    out = device_at(prior, offset) if accumulate else poisoned((B, H, T, D))
    heads.split_heads(out, device_at(x, offset), accumulate)
    want = prior.copy()
    heads.split_heads_numpy(want, x, accumulate)
    assert np.array_equal(out.copy_to_host(), want)
    y = rng.standard_normal((B, H, T, D)).astype(np.float32)
    prior = rng.standard_normal((B, T, H * D)).astype(np.float32)
    out = device_at(prior, offset) if accumulate else poisoned((B, T, H * D))
    heads.merge_heads(out, device_at(y, offset), accumulate)
    want = prior.copy()
    heads.merge_heads_numpy(want, y, accumulate)
    assert np.array_equal(out.copy_to_host(), want)
    four_wide = D % 4 == 0 and not offset
    assert launched == ([heads.split_heads4_kernel, heads.merge_heads4_kernel] if four_wide else
                        [heads.split_heads_kernel, heads.merge_heads_kernel])


def test_merge_inverts_split(rng):
    x = rng.standard_normal((2, 5, 12)).astype(np.float32)
    split, merged = poisoned((2, 3, 5, 4)), poisoned((2, 5, 12))
    heads.split_heads(split, device(x))
    heads.merge_heads(merged, split)
    assert np.array_equal(merged.copy_to_host(), x)


# --- attention -------------------------------------------------------------------------------------

def attention_cases():
    cases = []
    # the reference kernels' lanes hold 1, 2 or 3 of a row's values, some lanes none (8, 40)
    for D in (8, 16, 32, 40, 64, 72) + ((384,) if GPU else ()):
        for kernel in ("reference", "fast"):
            if kernel == "fast" and D not in attention.FAST_HEAD_SIZES:
                continue
            # fast: the default query tile, one block per (batch, head), and a tile of 3 rows
            for rows_per_block in ((None,) if kernel == "reference" else (None, "T", 3)):
                cases.append((D, kernel, rows_per_block))
    return cases


def concat(heads_array):
    """[B,H,T,D] on the host -> the heads side by side, [B,T,C] (merge_heads' twin)."""
    B, H, T, D = heads_array.shape
    out = np.empty((B, T, H * D), dtype=heads_array.dtype)
    heads.merge_heads_numpy(out, heads_array)
    return out


class DeviceHeads:
    """A [B,H,T,D] device array to test a kernel's output or input with: contiguous, or (concat)
    a heads.heads_view of a [B,T,C] device array, the heads side by side as the model keeps
    attention's output and q, k, v's gradients. `host()` reads it back as [B,H,T,D]."""
    def __init__(self, values, in_concat, offset=0):
        B, H, T, D = values.shape
        self.base = device_at(concat(values) if in_concat else values, offset)
        self.array = heads.heads_view(self.base, H) if in_concat else self.base
        self.shape, self.in_concat = values.shape, in_concat

    def host(self):
        x = self.base.copy_to_host()
        return heads.heads_view_numpy(x, self.shape[1]) if self.in_concat else x


def check_attention(rng, D, kernel, rows_per_block, B, H, T, dropout_p, offset=0,
                    in_concat=False):
    """attention_forward, then attention_backward (= and +=), against the NumPy twins; q, k, v
    and dout `offset` floats past the start of their allocations (device_at). in_concat: out,
    dout and the gradients are heads views of [B,T,C] arrays (DeviceHeads), as the model has them."""
    seed = np.array([424242], dtype=np.int64)
    drop = dict(dropout_p=dropout_p, seed=device(seed, np.int64), site=5)
    drop_numpy = dict(drop, seed=seed)
    q, k, v, dout = (rng.standard_normal((B, H, T, D)) for _ in range(4))
    out, lse = DeviceHeads(np.full((B, H, T, D), np.nan), in_concat), poisoned((B, H, T))
    dq_q, dk_q, dv_q = (device_at(x.astype(np.float32), offset) for x in (q, k, v))
    d_dout = DeviceHeads(dout.astype(np.float32), in_concat, offset).array
    attention.attention_forward(out.array, lse, dq_q, dk_q, dv_q, kernel=kernel,
                                rows_per_block=rows_per_block, **drop)
    want_out, want_lse = np.empty((B, H, T, D)), np.empty((B, H, T))
    attention.attention_forward_numpy(want_out, want_lse, q, k, v, **drop_numpy)
    assert relative_error(out.host(), want_out) < TOLERANCE
    assert relative_error(lse.copy_to_host(), want_lse) < TOLERANCE

    for accumulate in (False, True):
        priors = [rng.standard_normal((B, H, T, D)).astype(np.float32) if accumulate else
                  np.full((B, H, T, D), np.nan) for _ in range(3)]
        grads = [DeviceHeads(prior, in_concat) for prior in priors]
        delta = poisoned((B, H, T))
        attention.attention_backward(*[g.array for g in grads], delta, d_dout, dq_q, dk_q,
                                     dv_q, out.array, lse, accumulate, kernel=kernel,
                                     rows_per_block=rows_per_block, **drop)
        want = [prior.astype(np.float64) for prior in priors]
        attention.attention_backward_numpy(*want, np.empty((B, H, T)), dout, q, k, v, want_out,
                                           want_lse, accumulate, **drop_numpy)
        for got, expected, name in zip(grads, want, ("dq", "dk", "dv")):
            assert relative_error(got.host(), expected) < TOLERANCE, name


@pytest.mark.parametrize("D,kernel,rows_per_block", attention_cases())
@pytest.mark.parametrize("B,H,T", [(2, 2, 7)] if not GPU else [(4, 12, 256), (1, 2, 1024)])
@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_attention(rng, D, kernel, rows_per_block, B, H, T, dropout_p):
    check_attention(rng, D, kernel, T if rows_per_block == "T" else rows_per_block, B, H, T,
                    dropout_p)


@pytest.mark.parametrize("D,kernel", [(8, "reference"), (32, "fast"), (64, "fast")])
def test_attention_writes_the_heads_concat(rng, D, kernel):
    """out, and backward's dq, dk, dv, written through heads views of [B,T,C] arrays (merge
    heads done by the store), dout read through one: the same values as contiguous arrays."""
    B, H, T = (2, 3, 7) if not GPU else (4, 12, 256)
    check_attention(rng, D, kernel, None, B, H, T, 0.3, in_concat=True)


def test_heads_view(rng):
    """heads_view(x, H)[b, h, t, d] is x[b, t, h*D + d], for a kernel reading through it (the
    delta of attention's backward: the row sums against ones): no copy."""
    B, T, H, D = 2, 5, 3, 4
    x = rng.standard_normal((B, T, H * D)).astype(np.float32)
    want = heads.heads_view_numpy(x, H)
    assert np.array_equal(want, x.reshape(B, T, H, D).transpose(0, 2, 1, 3))
    view = heads.heads_view(device(x), H)
    assert view.shape == (B, H, T, D)
    delta = poisoned((B, H, T))
    attention.attention_delta(delta, view, device(np.ones((B, H, T, D))))
    assert relative_error(delta.copy_to_host(), want.sum(axis=-1)) < TOLERANCE


@pytest.mark.parametrize("D", attention.FAST_HEAD_SIZES)
def test_attention_gpu_tiles(rng, monkeypatch, D):
    """The fast kernels with the tiles the GPU runs (64 or 128 threads a block, where the
    simulator's own tiles are tiny; at D=64 dk/dv's key tiles are two query tiles long), on a
    T that crosses 32-row tiles and fills none."""
    monkeypatch.setattr(attention, "TILES", attention.GPU_TILES)
    check_attention(rng, D, "fast", None, 1, 1, 40, 0.3)


@pytest.mark.parametrize("rows_per_block", [None, 16])
def test_attention_key_tiles_of_two_query_tiles(rng, monkeypatch, rows_per_block):
    """dk/dv on key tiles twice as long as its query tiles (dq's shares then summed over two
    query tiles' worth of keys, packed by share_pair; the tiles in dynamic shared memory), as
    the GPU's D=64 tile: tiny tiles of 8 keys x 4 queries on a T that crosses several, one or
    two key tiles a block."""
    if not GPU:
        forward, _ = attention.TILES[64]
        monkeypatch.setitem(attention.TILES, 64, (forward, attention.Tile(8, 4, 4, 2,
                                                                          score_steps=1)))
    assert attention.TILES[64][1].rows == 2 * attention.TILES[64][1].cols
    check_attention(rng, 64, "fast", rows_per_block, 1, 2, 13 if not GPU else 300, 0.3)


@pytest.mark.parametrize("D", attention.FAST_HEAD_SIZES)
def test_attention_backward_is_reproducible(rng, monkeypatch, D):
    """dq is summed from its shares in a fixed order (attention_dq_sum_kernel, no atomics):
    two backward passes on the same inputs give the same bits."""
    B, H, T = (1, 2, 13) if not GPU else (2, 4, 300)
    q, k, v, dout, out = (device(rng.standard_normal((B, H, T, D))) for _ in range(5))
    lse = poisoned((B, H, T))
    attention.attention_forward(out, lse, q, k, v, kernel="fast")
    launched = recording_launches(monkeypatch, attention)
    results = []
    for _ in range(2):
        grads = [poisoned((B, H, T, D)) for _ in range(3)]
        attention.attention_backward(*grads, poisoned((B, H, T)), dout, q, k, v, out, lse,
                                     kernel="fast", dropout_p=0.3,
                                     seed=device(np.array([7]), np.int64))
        results.append([g.copy_to_host() for g in grads])
    assert attention.attention_dq_sum_kernel in launched
    for first, second in zip(*results):
        assert np.array_equal(first, second)


def test_share_pairs_are_packed():
    """share_pair numbers a head's (query tile, key tile) pairs 0, 1, 2, ... in order, the key
    tiles of query tile q being 0 .. q // ratio."""
    for ratio in (1, 2, 4):
        pairs = [(q, k) for q in range(9) for k in range(q // ratio + 1)]
        assert [attention.share_pair(q, k, ratio) for q, k in pairs] == list(range(len(pairs)))
        assert attention.share_pair(9, 0, ratio) == len(pairs)


@pytest.mark.parametrize("D", attention.FAST_HEAD_SIZES)
def test_attention_unaligned_heads_take_the_reference(rng, monkeypatch, D):
    """q, k, v and dout whose rows are not 16-byte aligned: "auto" takes the reference kernels
    (the fast ones stage 16 bytes at a time), and "fast" refuses them. (On a GPU they sit 1
    float off; the simulator has no addresses, so there aligned16 is made to say no.)"""
    if not GPU:
        monkeypatch.setattr(attention, "aligned16", lambda array: False)
    launched = recording_launches(monkeypatch, attention)
    check_attention(rng, D, "auto", None, 1, 2, 9, 0.3, offset=1)
    dims = attention.lane_dims(D)
    assert set(launched) == {attention.reference_forward_kernel(dims),
                             attention.reference_dq_kernel(dims),
                             attention.reference_dkdv_kernel(dims)}
    with pytest.raises(ValueError, match="16-byte aligned rows"):
        check_attention(rng, D, "fast", None, 1, 2, 9, 0.3, offset=1)


@pytest.mark.parametrize("D", attention.FAST_HEAD_SIZES)
def test_attention_without_dropout_compiled_in(rng, monkeypatch, D):
    """At dropout_p = 0 the launchers take kernels built without dropout (no_dropout); the
    kernels with dropout compiled in, given p = 0, must give the same bits."""
    B, H, T = (1, 2, 9) if not GPU else (2, 4, 300)
    q, k, v, dout = (device(rng.standard_normal((B, H, T, D))) for _ in range(4))
    results = []
    for built_with_dropout in (False, True):
        if built_with_dropout:
            for name in ("forward_kernel", "dkdv_kernel"):
                factory = getattr(attention, name)
                monkeypatch.setattr(attention, name, lambda D, tile, dropout, factory=factory:
                                    factory(D, tile, True))
        launched = recording_launches(monkeypatch, attention)
        out, lse, delta = poisoned((B, H, T, D)), poisoned((B, H, T)), poisoned((B, H, T))
        grads = [poisoned((B, H, T, D)) for _ in range(3)]
        attention.attention_forward(out, lse, q, k, v, kernel="fast")
        attention.attention_backward(*grads, delta, dout, q, k, v, out, lse, kernel="fast")
        tiles = attention.TILES[D]
        assert launched[0] is attention.forward_kernel(D, tiles[0], built_with_dropout)
        assert attention.dkdv_kernel(D, tiles[1], built_with_dropout) in launched
        results.append([x.copy_to_host() for x in (out, lse, *grads)])
    for without, with_dropout in zip(*results):
        assert np.array_equal(without, with_dropout)


@pytest.mark.parametrize("D", [8, 32, 64, 128])
def test_attention_delta(rng, D):
    """delta = dout . out per row (the scratch of the fast backward), a warp per 4 rows (at
    D=8 two lanes of the warp hold data); N = B*H*T = 30 rows: the last warp of the
    simulator's kernel holds two."""
    B, H, T = (2, 3, 5) if not GPU else (64, 12, 256)
    dout, out = rng.standard_normal((B, H, T, D)), rng.standard_normal((B, H, T, D))
    delta = poisoned((B, H, T))
    attention.attention_delta(delta, device(dout), device(out))
    assert relative_error(delta.copy_to_host(), (dout * out).sum(axis=-1)) < TOLERANCE


def test_attention_fast_kernel_refuses_other_head_sizes():
    x = device(np.zeros((1, 1, 3, 72)))
    with pytest.raises(ValueError, match="fast kernels take D in"):
        attention.attention_forward(x, device(np.zeros((1, 1, 3))), x, x, x, kernel="fast")


# --- layernorm, gelu, elementwise, dropout ----------------------------------------------------------

ROWS, WIDTH = (7, 24) if not GPU else (16384, 384)


# (rows, C): the warp kernels for C % 4 == 0 up to 1024 (C = 128: every lane full; 96 and 200:
# the last group of columns partly empty), the block kernels for the rest (77, and wider rows)
LAYERNORM_SHAPES = ([(20, WIDTH), (5, 128), (5, 96), (5, 200), (20, 77)] if not GPU else
                    [(16384, 384), (8192, 768), (1000, 1024), (999, 200), (1000, 77),
                     (300, layernorm.ROW_CACHE + 13)])


@pytest.mark.parametrize("N,C", LAYERNORM_SHAPES)
@pytest.mark.parametrize("accumulate", [False, True])
def test_layernorm(rng, N, C, accumulate):
    x = 3.0 + 2.0 * rng.standard_normal((N, C))
    weight, bias = 1 + 0.2 * rng.standard_normal(C), rng.standard_normal(C)
    out, mean, rstd = poisoned((N, C)), poisoned(N), poisoned(N)
    assert bool(layernorm.warp_vectors(C, out)) == (C % 4 == 0 and C <= 1024)
    layernorm.layernorm_forward(out, mean, rstd, device(x), device(weight), device(bias))
    want = [np.empty((N, C)), np.empty(N), np.empty(N)]
    layernorm.layernorm_forward_numpy(*want, x, weight, bias)
    for got, expected in zip((out, mean, rstd), want):
        assert relative_error(got.copy_to_host(), expected) < TOLERANCE
    dout = rng.standard_normal((N, C))
    dx, prior = output_and_prior(rng, (N, C), accumulate)
    dweight_prior, dbias_prior = rng.standard_normal(C), rng.standard_normal(C)
    dweight, dbias = device(dweight_prior), device(dbias_prior)
    layernorm.layernorm_backward(dx, dweight, dbias, device(dout), device(x), device(weight),
                                 mean, rstd, accumulate)
    want_dx, want_dw, want_db = prior.copy(), dweight_prior.copy(), dbias_prior.copy()
    layernorm.layernorm_backward_numpy(want_dx, want_dw, want_db, dout, x, weight, want[1],
                                       want[2], accumulate)
    for got, expected in ((dx, want_dx), (dweight, want_dw), (dbias, want_db)):
        assert relative_error(got.copy_to_host(), expected) < TOLERANCE
    if accumulate:          # out of place: dx = prior + the gradient, prior another array
        apart, prior_array = poisoned((N, C)), device(prior)
        layernorm.layernorm_backward(apart, dweight, dbias, device(dout), device(x),
                                     device(weight), mean, rstd, True, prior=prior_array)
        assert np.array_equal(apart.copy_to_host(), dx.copy_to_host())
        assert np.array_equal(prior_array.copy_to_host(), prior), "prior left as it was"


# C = 40 and 128: the warp kernels; 77: not a multiple of 4; the last C is wider than the shared
# row cache (and than the warp kernels take)
@pytest.mark.parametrize("N,C", [(6, 40), (5, 128), (3, 77), (2, layernorm.ROW_CACHE + 13)]
                         if not GPU else
                         [(16384, 384), (8192, 768), (300, 77), (300, layernorm.ROW_CACHE + 13)])
def test_residual_layernorm(rng, N, C):
    a, b = 3.0 + 2.0 * rng.standard_normal((N, C)), rng.standard_normal((N, C))
    weight, bias = 1 + 0.2 * rng.standard_normal(C), rng.standard_normal(C)
    outputs = [poisoned((N, C)), poisoned((N, C)), poisoned(N), poisoned(N)]     # resid, out, ...
    params = device(weight), device(bias)
    layernorm.residual_layernorm_forward(*outputs, device(a), device(b), *params)
    want = [np.empty((N, C)), np.empty((N, C)), np.empty(N), np.empty(N)]
    layernorm.residual_layernorm_forward_numpy(*want, a, b, weight, bias)
    for got, expected in zip(outputs, want):
        assert relative_error(got.copy_to_host(), expected) < TOLERANCE
    unfused = [poisoned((N, C)), poisoned((N, C)), poisoned(N), poisoned(N)]
    elementwise.add(unfused[0], device(a), device(b))
    layernorm.layernorm_forward(unfused[1], unfused[2], unfused[3], unfused[0], *params)
    for got, expected in zip(outputs, unfused):         # the same arithmetic as add + layernorm
        assert np.array_equal(got.copy_to_host(), expected.copy_to_host())


@pytest.mark.parametrize("C", [48, 20, 9])
def test_layernorm_writes_bf16(rng, C):
    """The forwards with out a Bf16Matrix (bf16 training): the float32 output rounded, to the
    bit; C = 48 by the warp kernel's words (8 columns a 16 bytes), 20 and 9 through float32.
    The twins likewise."""
    from nanoandrea.kernels.matmul_bf16 import Bf16Matrix, device_empty, round_bf16_numpy
    N = 12 if not GPU else 4096
    a, b = 3.0 + 2.0 * rng.standard_normal((N, C)), rng.standard_normal((N, C))
    weight, bias = 1 + 0.2 * rng.standard_normal(C), rng.standard_normal(C)
    params = device(weight), device(bias)
    for fused in (False, True):
        floats, words = poisoned((N, C)), Bf16Matrix.allocate((N, C), device_empty)
        stats = [poisoned(N) for _ in range(4)]
        for out, (mean, rstd) in ((floats, stats[:2]), (words, stats[2:])):
            if fused:
                layernorm.residual_layernorm_forward(poisoned((N, C)), out, mean, rstd, device(a),
                                                     device(b), *params)
            else:
                layernorm.layernorm_forward(out, mean, rstd, device(a), *params)
        want = Bf16Matrix.allocate((N, C), np.empty)
        round_bf16_numpy(want, floats.copy_to_host())
        assert np.array_equal(words.words.copy_to_host(), want.words)
        host = Bf16Matrix.allocate((N, C), np.empty)
        layernorm.layernorm_forward_numpy(host, np.empty(N), np.empty(N), a, weight, bias)
        values = np.empty((N, C))
        layernorm.layernorm_forward_numpy(values, np.empty(N), np.empty(N), a, weight, bias)
        round_bf16_numpy(want, values.astype(np.float32))
        assert np.array_equal(host.words, want.words)


# (ROWS, 4 * WIDTH): a multiple of 4, the 16-byte kernels; 5 x 9: the one-element kernels
@pytest.mark.parametrize("shape,vector", [((ROWS, 4 * WIDTH), True), ((5, 9), False)])
@pytest.mark.parametrize("accumulate", [False, True])
def test_gelu(rng, shape, vector, accumulate):
    x = 3 * rng.standard_normal(shape)
    out = poisoned(x.shape)
    assert elementwise.vectorizable(out.reshape(out.size)) == vector
    gelu.gelu_forward(out, device(x))
    want = np.empty(x.shape)
    gelu.gelu_forward_numpy(want, x)
    assert relative_error(out.copy_to_host(), want) < TOLERANCE
    dout = rng.standard_normal(x.shape)
    dx, prior = output_and_prior(rng, x.shape, accumulate)
    gelu.gelu_backward(dx, device(dout), device(x), accumulate)
    want = prior.copy()
    gelu.gelu_backward_numpy(want, dout, x, accumulate)
    assert relative_error(dx.copy_to_host(), want) < TOLERANCE


def gelu_errors(x, out, dx):
    """gelu(x) = out and gelu'(x) = dx, element by element against float64, in float32 epsilons
    scaled by the condition number 1 + 2|u| (the float32 rounding of u = sqrt(2/pi)(x + 0.044715
    x^3) alone moves exp(-2u) by that many epsilons), plus 1e-35 where the result is below the
    smallest normal float32. The reference is x s, s = 1/(1 + exp(-2u)) = 0.5 (1 + tanh(u)): in
    float64, 0.5 x (1 + tanh(u)) itself cancels to 0 for x < -7. The largest of each."""
    x64 = x.astype(np.float64)
    u = np.sqrt(2 / np.pi) * (x64 + 0.044715 * x64 ** 3)
    s = 1 / (1 + np.exp(-2 * u))
    assert np.allclose(s[np.abs(x) < 3], 0.5 * (1 + np.tanh(u[np.abs(x) < 3])), rtol=1e-14)
    slope_term = 2 * x64 * s * (1 - s) * np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * x64 ** 2)
    scale = np.finfo(np.float32).eps * (1 + 2 * np.abs(u))
    forward_error = np.abs(out - x64 * s) / (scale * np.abs(x64 * s) + 1e-35)
    backward_error = np.abs(dx - (s + slope_term)) / (scale * (s + np.abs(slope_term)) + 1e-35)
    return ((forward_error.max(), x[forward_error.argmax()]),
            (backward_error.max(), x[backward_error.argmax()]))


@pytest.mark.parametrize("n", [4000, 4001])            # the 16-byte and the one-element kernels
def test_gelu_accuracy_element_by_element(n):
    """Every element of gelu and gelu' over [-12, 12] against float64, within 4 of gelu_errors'
    scaled epsilons."""
    x = np.linspace(-12, 12, n).astype(np.float32)
    out, dx = poisoned(n), poisoned(n)
    gelu.gelu_forward(out, device(x))
    gelu.gelu_backward(dx, device(np.ones(n)), device(x))
    (forward, at), (backward, at_b) = gelu_errors(x, out.copy_to_host(), dx.copy_to_host())
    assert forward < 4, f"gelu: {forward} at x = {at}"
    assert backward < 4, f"gelu': {backward} at x = {at_b}"


@cuda.jit
def gelu_sfu_kernel(out, dx, x):
    i = cuda.grid(1)
    if i < x.size:
        out[i] = gelu.gelu_value_sfu(x[i])
        dx[i] = gelu.gelu_derivative_sfu(x[i])


def test_gelu_sfu_accuracy_element_by_element():
    """gelu_value_sfu and gelu_derivative_sfu (the bf16 products' epilogues: exp and the
    division on the special-function unit, kernels/sfu.py) over [-12, 12] against float64:
    within 16 of gelu_errors' scaled epsilons, ~2^-19 at most where a bf16 rounding is 2^-9
    (the exact forms' bound is 4; in the simulator the twins are exact)."""
    n = 4001
    x = np.linspace(-12, 12, n).astype(np.float32)
    out, dx = poisoned(n), poisoned(n)
    gelu_sfu_kernel[(n + 127) // 128, 128](out, dx, device(x))
    (forward, at), (backward, at_b) = gelu_errors(x, out.copy_to_host(), dx.copy_to_host())
    assert forward < 16, f"gelu: {forward} at x = {at}"
    assert backward < 16, f"gelu': {backward} at x = {at_b}"


@pytest.mark.parametrize("shape,vector", [((6, 8), True), ((5, 9), False)])
def test_elementwise(rng, shape, vector):
    a, b = rng.standard_normal(shape), rng.standard_normal(shape)
    out = poisoned(a.shape)
    assert elementwise.vectorizable(out.reshape(out.size)) == vector
    elementwise.add(out, device(a), device(b))
    assert relative_error(out.copy_to_host(), a + b) < TOLERANCE
    elementwise.add_into(out, device(a), accumulate=True)
    assert relative_error(out.copy_to_host(), 2 * a + b) < TOLERANCE
    elementwise.add_into(out, device(b), accumulate=False)
    assert relative_error(out.copy_to_host(), b) < TOLERANCE
    elementwise.fill(out, 0.25)
    assert np.all(out.copy_to_host() == 0.25)


@pytest.mark.parametrize("shape", [(ROWS, WIDTH), (5, 9)])      # 4-wide and one-element kernels
@pytest.mark.parametrize("accumulate", [False, True])
def test_dropout_matches_numpy_bit_for_bit(rng, shape, accumulate):
    x = rng.standard_normal(shape).astype(np.float32)
    seed = np.array([987654321], dtype=np.int64)
    out = poisoned(x.shape)
    dropout.dropout_forward(out, device(x), 0.25, device(seed, np.int64), 3)
    want = np.empty(x.shape, dtype=np.float32)
    dropout.dropout_forward_numpy(want, x, 0.25, seed, 3)
    got = out.copy_to_host()
    assert np.array_equal(got, want)
    dropped = np.mean(got == 0)
    assert 0.15 < dropped < 0.35, f"dropped fraction {dropped}"
    dout = rng.standard_normal(x.shape).astype(np.float32)
    dx, prior = output_and_prior(rng, x.shape, accumulate)
    dropout.dropout_backward(dx, device(dout), 0.25, device(seed, np.int64), 3, accumulate)
    want_dx = prior.astype(np.float32)
    dropout.dropout_backward_numpy(want_dx, dout, 0.25, seed, 3, accumulate)
    assert relative_error(dx.copy_to_host(), want_dx) < 1e-6
    other_site = np.empty(x.shape, dtype=np.float32)
    dropout.dropout_forward_numpy(other_site, x, 0.25, seed, 4)
    assert not np.array_equal(other_site, want), "two sites must draw different masks"


# --- embedding, cross-entropy, AdamW -------------------------------------------------------------

@pytest.mark.parametrize("padded", [False, True])
def test_embedding(rng, padded):
    """padded: segment_starts padded to a fixed size with empty segments (as a CUDA graph
    replay needs), which the backward must skip."""
    B, T, C, V = (2, 7, 24, 11) if not GPU else (64, 256, 384, 65)
    idx = rng.integers(0, V, size=(B, T)).astype(np.int32)
    idx[0, :3] = idx[1, 2]                                   # repeated ids must sum
    wte, wpe = rng.standard_normal((V, C)), rng.standard_normal((T + 3, C))
    out = poisoned((B, T, C))
    embedding.embedding_forward(out, device(idx, np.int32), device(wte), device(wpe))
    want = np.empty((B, T, C))
    embedding.embedding_forward_numpy(want, idx, wte, wpe)
    assert relative_error(out.copy_to_host(), want) < TOLERANCE
    dout = rng.standard_normal((B, T, C))
    dwte_prior, dwpe_prior = rng.standard_normal(wte.shape), rng.standard_normal(wpe.shape)
    dwte, dwpe = device(dwte_prior), device(dwpe_prior)
    order, starts = embedding.group_positions_by_token(idx, min(V, B * T) if padded else None)
    embedding.embedding_backward(dwte, dwpe, device(dout), device(idx, np.int32),
                                 device(order, np.int32), device(starts, np.int32))
    want_dwte, want_dwpe = dwte_prior.copy(), dwpe_prior.copy()
    embedding.embedding_backward_numpy(want_dwte, want_dwpe, dout, idx)
    assert relative_error(dwte.copy_to_host(), want_dwte) < TOLERANCE
    assert relative_error(dwpe.copy_to_host(), want_dwpe) < TOLERANCE


@pytest.mark.parametrize("scale, columns", [(1.0, 37), (100.0, 37), (1.0, 40), (100.0, 40)])
def test_crossentropy(rng, scale, columns):
    """columns: 37, rows the 16-byte kernel cannot take; 40, rows it can (and on the GPU 4096
    and 4097)."""
    N, V = (7, columns) if not GPU else (16384, 4096 + columns % 2)
    logits = scale * rng.standard_normal((N, V))
    targets = rng.integers(0, V, size=N).astype(np.int32)
    loss, losses, lse = poisoned(1), poisoned(N), poisoned(N)
    crossentropy.crossentropy_forward(loss, losses, lse, device(logits), device(targets, np.int32))
    want = [np.empty(1), np.empty(N), np.empty(N)]
    crossentropy.crossentropy_forward_numpy(*want, logits, targets)
    for got, expected in zip((loss, losses, lse), want):
        assert relative_error(got.copy_to_host(), expected) < TOLERANCE
    dloss = np.array([0.7])
    for accumulate in (False, True):
        dlogits, prior = output_and_prior(rng, (N, V), accumulate)
        crossentropy.crossentropy_backward(dlogits, device(dloss), device(logits), lse,
                                           device(targets, np.int32), accumulate)
        want_d = prior.copy()
        crossentropy.crossentropy_backward_numpy(want_d, dloss, logits, want[2], targets,
                                                 accumulate)
        assert relative_error(dlogits.copy_to_host(), want_d) < TOLERANCE
    # the fused kernels: the same loss and the same dlogits in one pass (16 bytes at a time
    # where the rows allow it)
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


def test_adamw_and_grad_norm(rng):
    P, n_decay = (1000, 600) if not GPU else (10_770_816, 10_000_000)
    params, grads = rng.standard_normal(P), rng.standard_normal(P)
    m, v = 0.1 * rng.standard_normal(P), rng.random(P)
    hyper = adamw.adamw_hyperparameters(3e-3, 0.9, 0.99, 1e-8, 0.1, 1.0, 7)
    arrays = [device(a) for a in (params, grads, m, v)]
    norm, partials = poisoned(1), poisoned(adamw.NORM_BLOCKS)
    adamw.grad_norm(norm, arrays[1], partials)
    assert relative_error(norm.copy_to_host(), [np.linalg.norm(grads)]) < TOLERANCE
    adamw.adamw_update(*arrays, device(hyper), norm, n_decay)
    want_norm = np.array([np.linalg.norm(grads)])
    adamw.adamw_update_numpy(params, grads, m, v, hyper, want_norm, n_decay)
    for got, expected in zip(arrays, (params, grads, m, v)):
        assert relative_error(got.copy_to_host(), expected) < TOLERANCE


# --- dynamic shared memory -------------------------------------------------------------------

SWAP_ROWS, SWAP_COLS = (4, 8) if not GPU else (128, 68)     # on the GPU 2 x 34.8 KB: over 48 KB


@cuda.jit
def swap_through_shared_tiles(out, x):
    # out[0] = x[1], out[1] = x[0] (x, out [2, SWAP_ROWS, SWAP_COLS]), through two tiles cut
    # from the dynamic shared array: thread t stores rows t, t + blockDim, ... of both, 16
    # bytes at a time, and after the barrier reads the other tile's rows
    buffer = dynamic_shared_floats()
    first = shared_tile(buffer, 0, SWAP_ROWS, SWAP_COLS)
    second = shared_tile(buffer, SWAP_ROWS * SWAP_COLS, SWAP_ROWS, SWAP_COLS)
    for r in range(cuda.threadIdx.x, SWAP_ROWS, cuda.blockDim.x):
        for c in range(0, SWAP_COLS, 4):
            a0, a1, a2, a3 = load4(x, (0, r, c))
            b0, b1, b2, b3 = load4(x, (1, r, c))
            store4(first, (r, c), a0, a1, a2, a3)
            store4(second, (r, c), b0, b1, b2, b3)
    cuda.syncthreads()
    for r in range(cuda.threadIdx.x, SWAP_ROWS, cuda.blockDim.x):
        for c in range(SWAP_COLS):
            out[0, r, c] = second[r, c]
            out[1, r, c] = first[r, c]


def test_shared_tiles_in_dynamic_shared_memory(rng):
    """Two 2-D tiles cut from the dynamic shared array (shared_tile) hold what was stored to
    them; on the GPU they take 69.6 KB, so the launch must first let the kernel have more than
    48 KB (launch's shared_bytes)."""
    x = rng.standard_normal((2, SWAP_ROWS, SWAP_COLS)).astype(np.float32)
    out = poisoned(x.shape)
    launch(swap_through_shared_tiles, 1, 32, out, device(x), shared_bytes=2 * x[0].nbytes)
    assert np.array_equal(out.copy_to_host(), x[::-1])


@pytest.mark.skipif(not GPU, reason="the simulator has no launch hooks")
def test_dynamic_shared_hook_added_once(rng):
    """numba-cuda hands back the same configured launch for the same grid, block, stream and
    bytes: launching it again must not add launch's hook again (the list would grow by one a
    launch, and every launch would run them all)."""
    x = rng.standard_normal((2, SWAP_ROWS, SWAP_COLS)).astype(np.float32)
    out, source = poisoned(x.shape), device(x)
    for _ in range(3):
        launch(swap_through_shared_tiles, 1, 32, out, source, shared_bytes=2 * x[0].nbytes)
    configured = swap_through_shared_tiles[1, 32, current_stream(), 2 * x[0].nbytes]
    assert len(configured.pre_launch_callbacks) == 1


@pytest.mark.skipif(not GPU, reason="PTX needs the compiler (not the simulator)")
def test_shared_tiles_stay_in_shared_memory():
    """shared_tile's views compile to shared-memory loads and stores with constant offsets:
    no call into Numba's runtime, no local memory, no generic addresses."""
    ptx, _ = cuda.compile_ptx(swap_through_shared_tiles.py_func,
                              (numba.float32[:, :, ::1], numba.float32[:, :, ::1]), cc=(9, 0))
    assert "st.shared.v4.f32" in ptx and "ld.shared.f32" in ptx
    assert "call" not in ptx and ".local" not in ptx
    assert ".shared .align 16" in ptx           # (dynamic_shared_floats: 16-byte aligned)


def test_inliner_refuses_an_unknown_name():
    # NANOANDREA_INLINER names who inlines the device functions (launch.inlined): "numba" or
    # "nvvm"; any other name is refused when the module is imported
    env = dict(os.environ, NANOANDREA_INLINER="llvm")
    refused = subprocess.run([sys.executable, "-c", "import nanoandrea.kernels.launch"], env=env,
                             capture_output=True, text=True)
    assert refused.returncode != 0 and "NANOANDREA_INLINER='llvm'" in refused.stderr


@pytest.mark.skipif(not GPU, reason="the simulator's device functions are Python calls")
@pytest.mark.parametrize("inliner", ["numba", "nvvm"])
def test_inliner_is_chosen_by_its_environment_variable(monkeypatch, inliner):
    # Numba copying their IR (the default, the faster code on the H200) or NVVM (forceinline:
    # quicker to compile); inlined_by_numba is Numba's whatever the variable says
    from nanoandrea.kernels import launch as launch_module
    monkeypatch.setattr(launch_module, "INLINER", inliner)
    options = launch_module.inlined(lambda x: x + 1).targetoptions
    assert (options["inline"], options["forceinline"]) == (
        ("always", False) if inliner == "numba" else ("never", True))
    options = launch_module.inlined_by_numba(lambda x: x + 1).targetoptions
    assert (options["inline"], options["forceinline"]) == ("always", False)
