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
                                gelu, heads, layernorm, matmul, mma, pad)
from nanoandrea.kernels.launch import current_stream, launch
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

# (M, N, K, with bias, accumulate)
MATMUL_CASES = ([(14, 24, 37, True, False), (33, 20, 9, False, True)] if not GPU else
                [(1024, 1536, 384, True, False), (1000, 389, 771, False, True)])


@pytest.mark.parametrize("kernel,k_splits", [("tiled", None), ("blocked", None), ("blocked", 3)])
@pytest.mark.parametrize("transpose_a,transpose_b", [(False, False), (False, True), (True, False)])
def test_matmul(rng, kernel, k_splits, transpose_a, transpose_b):
    """k_splits=3: split-K, three slices of K computed apart, then summed in a fixed order."""
    cases = MATMUL_CASES
    if kernel == "blocked" and not GPU:     # the 256-thread kernel is slow to simulate: two
        cases = [(14, 24, 37, True, True),  # cases, with 4-byte and with 16-byte loads of a
                 (12, 20, 16, True, False)]  # (K % 4 == 0) and of out (N % 4 == 0)
    for M, N, K, with_bias, accumulate in cases:
        a = rng.standard_normal((K, M) if transpose_a else (M, K))
        b = rng.standard_normal((N, K) if transpose_b else (K, N))
        bias = rng.standard_normal(N) if with_bias else None
        out, prior = output_and_prior(rng, (M, N), accumulate)
        matmul.matmul(out, device(a), device(b), None if bias is None else device(bias),
                      transpose_a, transpose_b, accumulate, kernel=kernel, k_splits=k_splits)
        want = prior.astype(np.float64)
        matmul.matmul_numpy(want, a, b, bias, transpose_a, transpose_b, accumulate)
        assert relative_error(out.copy_to_host(), want) < TOLERANCE


@pytest.mark.parametrize("stages,k_splits", [(2, None), (3, None), (3, 2)])
def test_matmul_cp_async_pipeline(rng, stages, k_splits):
    """The weight-gradient product (a[K,M]^T . b[K,N]) with its slices copied by cp.async,
    `stages` in flight: K not a multiple of the slice, M and N not of the tile, split-K."""
    M, N, K = (12, 20, 44) if not GPU else (1000, 388, 4100)
    a, b = rng.standard_normal((K, M)), rng.standard_normal((K, N))
    out, prior = output_and_prior(rng, (M, N), True)
    matmul.matmul(out, device(a), device(b), transpose_a=True, accumulate=True,
                  kernel="blocked", k_splits=k_splits, tiles=dict(stages=stages))
    want = prior.astype(np.float64)
    matmul.matmul_numpy(want, a, b, transpose_a=True, accumulate=True)
    assert relative_error(out.copy_to_host(), want) < TOLERANCE


def test_matmul_cp_async_pipeline_equals_register_staging(rng):
    """Both kernels add the same products in the same order, so they agree bit for bit: a copy
    landing late, early or in the wrong stage would show."""
    M, N, K = (12, 20, 44) if not GPU else (768, 3072, 16384)
    a, b = device(rng.standard_normal((K, M))), device(rng.standard_normal((K, N)))
    staged, pipelined = poisoned((M, N)), poisoned((M, N))
    matmul.matmul(staged, a, b, transpose_a=True, kernel="blocked")
    matmul.matmul(pipelined, a, b, transpose_a=True, kernel="blocked", tiles=dict(stages=3))
    assert np.array_equal(staged.copy_to_host(), pipelined.copy_to_host())


ORIENTATIONS = [(False, False), (False, True), (True, False), (True, True)]


@pytest.mark.parametrize("transpose_a,transpose_b,aligned,tiles",
                         [(ta, tb, aligned, {}) for ta, tb in ORIENTATIONS
                          for aligned in (True, False)]
                         + [(False, False, False, dict(BN=96)), (True, False, False, dict(BN=96)),
                            (True, False, True, dict(BK=16))])
def test_matmul_cp_async_pipeline_any_operands(rng, monkeypatch, transpose_a, transpose_b,
                                               aligned, tiles):
    """The pipeline for every orientation of the operands: slices whose rows run along k are
    copied 4 bytes at a time and land transposed, and so are rows that are not 16-byte runs
    (on a GPU one float off; the simulator has no addresses, so there aligned16 is made to
    say no); with 192 threads (BN=96) a's slice does not divide among them; slices of 16
    (BK=16, a weight gradient). Same products in the same order as the register-staged
    kernel: the same bits."""
    M, N, K = (12, 20, 44) if not GPU else (1000, 388, 4100)
    if not GPU and not aligned:
        monkeypatch.setattr(matmul, "aligned16", lambda array: False)
    a = rng.standard_normal((K, M) if transpose_a else (M, K))
    b = rng.standard_normal((N, K) if transpose_b else (K, N))
    A, B = (device_at(x.astype(np.float32), 0 if aligned else 1) for x in (a, b))
    staged, pipelined = poisoned((M, N)), poisoned((M, N))
    options = dict(transpose_a=transpose_a, transpose_b=transpose_b, kernel="blocked",
                   copy_b_transposed=False, pad_unaligned=False)
    matmul.matmul(staged, A, B, tiles=tiles, **options)
    matmul.matmul(pipelined, A, B, tiles=dict(tiles, stages=3), **options)
    want = np.empty((M, N))
    matmul.matmul_numpy(want, a, b, transpose_a=transpose_a, transpose_b=transpose_b)
    assert relative_error(pipelined.copy_to_host(), want) < TOLERANCE
    assert np.array_equal(staged.copy_to_host(), pipelined.copy_to_host())


def test_matmul_cp_async_pipeline_refuses_one_stage():
    with pytest.raises(ValueError, match="cp.async pipeline"):
        matmul.make_blocked_matmul_kernel(True, False, stages=1)
    with pytest.raises(ValueError, match="cp.async pipeline"):
        matmul.make_blocked_matmul_kernel(True, False, stages=2, BK=24)


@pytest.mark.parametrize("kernel,k_splits", [("tiled", None), ("blocked", None), ("blocked", 2)])
def test_matmul_with_gelu(rng, kernel, k_splits):
    """gelu_out: the MLP's activation, in the blocked kernel's epilogue (after the sum of the
    slices with split-K; after the tiled kernel), beside the pre-activation."""
    M, N, K = (12, 20, 16) if not GPU else (1024, 1536, 384)
    a, b, bias = rng.standard_normal((M, K)), rng.standard_normal((K, N)), rng.standard_normal(N)
    out, activated = poisoned((M, N)), poisoned((M, N))
    matmul.matmul(out, device(a), device(b), device(bias), kernel=kernel, k_splits=k_splits,
                  gelu_out=activated)
    want, want_activated = np.zeros((M, N)), np.zeros((M, N))
    matmul.matmul_numpy(want, a, b, bias, gelu_out=want_activated)
    assert relative_error(out.copy_to_host(), want) < TOLERANCE
    assert relative_error(activated.copy_to_host(), want_activated) < TOLERANCE


@pytest.mark.parametrize("kernel,k_splits,M,N,K,accumulate", [
    ("blocked", None, 32, 48, 40, False),   # 16-byte: GELU's backward in the epilogue
    ("blocked", None, 33, 47, 40, True),    # 4-byte out (N % 4 != 0): the same, element-wise
    ("blocked", 2, 32, 48, 40, True),       # split-K: the sum of the slices first, then gelu'
    ("tiled", None, 12, 20, 16, True)])     # likewise after the reference kernel
def test_matmul_with_gelu_backward(rng, kernel, k_splits, M, N, K, accumulate):
    """gelu_input: the MLP's dH = (dY . W^T) * gelu'(H), out (+)= (a . b^T) * gelu'(gelu_input),
    the input-gradient product (transpose_b) with GELU's backward after it."""
    if GPU:                                 # several tiles, N % 4 kept
        M, N, K = 32 * M, 32 * N + N % 4, 8 * K
    a, b = rng.standard_normal((M, K)), rng.standard_normal((N, K))
    pre = 3 * rng.standard_normal((M, N))
    out, prior = output_and_prior(rng, (M, N), accumulate)
    matmul.matmul(out, device(a), device(b), transpose_b=True, accumulate=accumulate,
                  kernel=kernel, k_splits=k_splits, gelu_input=device(pre))
    want = prior.astype(np.float64)
    matmul.matmul_numpy(want, a, b, transpose_b=True, accumulate=accumulate, gelu_input=pre)
    assert relative_error(out.copy_to_host(), want) < TOLERANCE


@pytest.mark.parametrize("R,C", [(37, 45), (32, 64)] if not GPU else [(1000, 771), (768, 3072)])
def test_transpose(rng, R, C):
    x = rng.standard_normal((R, C))
    out = poisoned((C, R))
    matmul.transpose(out, device(x))
    want = np.zeros((C, R))
    matmul.transpose_numpy(want, x)
    assert np.array_equal(out.copy_to_host(), want.astype(np.float32))


@pytest.mark.parametrize("pad_unaligned", [False, None] if GPU else [False])
@pytest.mark.parametrize("with_bias,accumulate,gelu_grad", [
    (True, False, False), (False, True, False), (False, True, True)])
def test_matmul_through_transposed_copy(rng, with_bias, accumulate, gelu_grad, pad_unaligned):
    """With transpose_b, the blocked path may multiply by a transposed copy of b (the plain
    kernel) instead of transposing b's slices in the kernel. On the GPU K is not a multiple of
    4, so a's rows are not 16-byte runs (in the simulator, where an odd K took 120 s a test,
    they are). With the 4-byte kernels (pad_unaligned=False) a copy only moves
    data: the two add the same products in the same order and agree bit for bit (with gelu'
    too). With matmul's own choice (None) the copy can change the route: b^T's rows are
    aligned, so the copy's product may take the row classes (the k outside each row's window
    first) where the other runs on padded copies; then both are only checked against NumPy."""
    M, N, K = (20, 24, 36) if not GPU else (2048, 3072, 771)
    assert matmul.copies_b_transposed(M, N, False, True) == GPU     # (what None picks)
    a, b = rng.standard_normal((M, K)), rng.standard_normal((N, K))
    bias = device(rng.standard_normal(N)) if with_bias else None
    pre = device(3 * rng.standard_normal((M, N))) if gelu_grad else None
    prior = rng.standard_normal((M, N))
    outs = []
    for copy in (True, False):
        out = device(prior) if accumulate else poisoned((M, N))
        matmul.matmul(out, device(a), device(b), bias, transpose_b=True, accumulate=accumulate,
                      kernel="blocked", gelu_input=pre, copy_b_transposed=copy,
                      pad_unaligned=pad_unaligned)
        outs.append(out.copy_to_host())
    want = prior.copy() if accumulate else np.zeros((M, N))
    matmul.matmul_numpy(want, a, b, None if bias is None else bias.copy_to_host(),
                        transpose_b=True, accumulate=accumulate,
                        gelu_input=None if pre is None else pre.copy_to_host())
    for got in outs:
        assert relative_error(got, want) < TOLERANCE
    if pad_unaligned is False:
        assert np.array_equal(outs[0], outs[1])


@pytest.mark.parametrize("tiles", [dict(BN=96), dict(BM=96)])
@pytest.mark.parametrize("transpose_a,transpose_b", [(False, False), (False, True), (True, False)])
def test_matmul_192_thread_tiles(rng, tiles, transpose_a, transpose_b):
    """128 x 96 and 96 x 128 block tiles (192 threads): one operand's slice has 256 chunks of
    4 floats, so the last round of loads leaves some threads idle. (Tried for andrea-12m's
    [16384, 384] outputs, whose 128 x 128 grid leaves half a wave idle: slower on the H200,
    docs/perf.md v4, so no launch picks them on its own.)"""
    check_blocked_tiles(rng, tiles, transpose_a, transpose_b,
                        *((100, 110, 20) if not GPU else (1000, 389, 771)))


@pytest.mark.parametrize("transpose_a,transpose_b", [(False, False), (False, True), (True, False)])
def test_matmul_8x16_thread_tiles(rng, transpose_a, transpose_b):
    """thread_cols=16: each thread owns 8 x 16 of the output, in 4 runs of 4 columns (on the
    GPU 128 x 256 block tiles of 256 threads, CUTLASS's SIMT shape, timed by --variants; in the
    simulator 8 x 32 tiles of 2 threads, with ragged edges); with bias, then with accumulate
    and GELU's backward in the epilogue."""
    tiles = (dict(BN=256, thread_cols=16, blocks_per_sm=1) if GPU else
             dict(BM=8, BN=32, thread_cols=16))
    M, N, K = (20, 70, 12) if not GPU else (1000, 389, 771)
    check_blocked_tiles(rng, tiles, transpose_a, transpose_b, M, N, K)
    a = rng.standard_normal((K, M) if transpose_a else (M, K))
    b = rng.standard_normal((N, K) if transpose_b else (K, N))
    pre = 3 * rng.standard_normal((M, N))
    out, prior = output_and_prior(rng, (M, N), True)
    matmul.matmul(out, device(a), device(b), None, transpose_a, transpose_b, True,
                  kernel="blocked", k_splits=1, tiles=tiles, gelu_input=device(pre),
                  copy_b_transposed=False)
    want = prior.astype(np.float64)
    matmul.matmul_numpy(want, a, b, None, transpose_a, transpose_b, True, gelu_input=pre)
    assert relative_error(out.copy_to_host(), want) < TOLERANCE


def check_same_bits(rng, transpose_a, transpose_b, M, N, K, *variants):
    """The blocked product with bias and accumulate, once for each of `variants` (matmul's
    keyword arguments): the first against NumPy, and all of them the same bits."""
    a = rng.standard_normal((K, M) if transpose_a else (M, K))
    b = rng.standard_normal((N, K) if transpose_b else (K, N))
    bias = rng.standard_normal(N)
    prior = rng.standard_normal((M, N)).astype(np.float32)
    outs = []
    for options in variants:
        out = device(prior)
        matmul.matmul(out, device(a), device(b), device(bias), transpose_a, transpose_b, True,
                      kernel="blocked", k_splits=1, copy_b_transposed=False, **options)
        outs.append(out.copy_to_host())
    want = prior.astype(np.float64)
    matmul.matmul_numpy(want, a, b, bias, transpose_a, transpose_b, True)
    assert relative_error(outs[0], want) < TOLERANCE
    for other in outs[1:]:
        assert np.array_equal(outs[0], other)


@pytest.mark.parametrize("transpose_a,transpose_b", [(False, False), (False, True), (True, False)])
def test_matmul_fragments_ahead(rng, transpose_a, transpose_b):
    """fragments_ahead: each step's shared-memory fragments read while the step before is
    multiplied, the next slice's first right after the barrier. The same multiply-adds in the
    same order as the default kernel: the same bits, with ragged edges (a K that leaves a
    partial last slice), 4-byte operands, bias and the accumulating epilogue; a pipelined or
    BK=16 kernel refuses it."""
    tiles = dict() if GPU else dict(BM=16, BN=16)
    check_same_bits(rng, transpose_a, transpose_b, *((21, 18, 37) if not GPU else (1000, 389, 771)),
                    dict(tiles=dict(tiles, fragments_ahead=True), pad_unaligned=False),
                    dict(tiles=tiles, pad_unaligned=False))
    for refused in (dict(stages=3), dict(BK=16)):
        with pytest.raises(ValueError, match="fragments_ahead"):
            matmul.make_blocked_matmul_kernel(transpose_a, transpose_b, fragments_ahead=True,
                                              **refused)


@pytest.mark.parametrize("transpose_a,transpose_b", [(False, False), (False, True), (True, False)])
def test_matmul_warp_tiled_threads(rng, transpose_a, transpose_b):
    """warp_rows=4: a warp covers 4 x 8 threads of the grid, not 2 rows of 16 (on the GPU the
    default 128 x 128 tiles; in the simulator 32 x 128 tiles of 64 threads, two warps side by
    side), with ragged edges, bias and the accumulating epilogue."""
    tiles = dict(warp_rows=4) if GPU else dict(BM=32, BN=128, warp_rows=4)
    M, N, K = (40, 140, 12) if not GPU else (1000, 389, 771)
    check_blocked_tiles(rng, tiles, transpose_a, transpose_b, M, N, K)


def check_blocked_tiles(rng, tiles, transpose_a, transpose_b, M, N, K):
    """The blocked kernel with these tiles against NumPy, bias included, on a poisoned out."""
    a = rng.standard_normal((K, M) if transpose_a else (M, K))
    b = rng.standard_normal((N, K) if transpose_b else (K, N))
    bias = rng.standard_normal(N)
    out = poisoned((M, N))
    matmul.matmul(out, device(a), device(b), device(bias), transpose_a, transpose_b,
                  kernel="blocked", tiles=tiles)
    want = np.zeros((M, N))
    matmul.matmul_numpy(want, a, b, bias, transpose_a, transpose_b)
    assert relative_error(out.copy_to_host(), want) < TOLERANCE


@pytest.mark.parametrize("tiles,transpose_a,transpose_b", [
    (dict(BN=256, blocks_per_sm=1), False, False), (dict(BN=256, blocks_per_sm=1), False, True),
    (dict(BM=256, blocks_per_sm=1), True, False)])
def test_matmul_512_thread_tiles(rng, tiles, transpose_a, transpose_b):
    """128 x 256 and 256 x 128 block tiles (512 threads, launch bounds of 128 registers): the
    tile cuBLAS picks for the large float32 products, timed by tools/bench.py --variants. (In
    the simulator one block with ragged edges: 512 Python threads are slow.)"""
    M, N, K = (70, 200, 20) if not GPU else (1000, 389, 771)
    if tiles.get("BM"):
        M, N = N, M
    check_blocked_tiles(rng, tiles, transpose_a, transpose_b, M, N, K)


@pytest.mark.parametrize("shape,padded", [((5, 7), (8, 8)), ((3, 4), (4, 12)), ((3, 70), (4, 72)),
                                          ((2, 130), (4, 132)), ((7,), (8,))])
@pytest.mark.parametrize("max_blocks", [None, 2])
def test_pad_and_unpad(rng, monkeypatch, shape, padded, max_blocks):
    """pad puts x in the corner of an array with rows of 4k floats (zeros elsewhere); unpad
    (+)= takes the corner back; both against their NumPy twins, bit for bit. 130 columns:
    two blocks a row in the simulator (a block takes 4 x 32 columns). max_blocks=2: fewer
    rows of blocks than rows, walked grid-stride two rows at a time (odd counts of rows: a
    last round with no second row)."""
    if max_blocks:
        monkeypatch.setattr(pad, "MAX_BLOCKS", max_blocks)
    x = rng.standard_normal(shape).astype(np.float32)
    out = poisoned(padded)
    pad.pad(out, device(x))
    want = np.full(padded, np.nan)
    pad.pad_numpy(want, x)
    assert np.array_equal(out.copy_to_host(), want)
    for accumulate in (False, True):
        back, prior = output_and_prior(rng, shape, accumulate)
        pad.unpad(back, out, accumulate)
        want_back = prior.astype(np.float32)
        pad.unpad_numpy(want_back, want.astype(np.float32), accumulate)
        assert np.array_equal(back.copy_to_host(), want_back)


@pytest.mark.skipif(not GPU, reason="PTX needs the compiler (not the simulator)")
def test_pad_copies_do_not_divide():
    """The copy kernel behind pad and unpad has no integer division or remainder in its PTX
    (the first kernels divided on every row they walked, in loops of 346 and 427 instructions
    for a thread's 4 floats), and no call or local memory."""
    ptx, _ = cuda.compile_ptx(pad.copy_corner_kernel.py_func,
                              (numba.float32[:, ::1], numba.float32[:, ::1], numba.boolean),
                              cc=(9, 0))
    assert not re.search(r"\b(div|rem)\.", ptx)
    assert "call" not in ptx and ".local" not in ptx


@pytest.mark.parametrize("transpose_a,transpose_b", [(False, False), (False, True), (True, False)])
def test_matmul_on_padded_copies(rng, transpose_a, transpose_b):
    """Operands whose rows are not 16-byte runs (M, N, K all odd here): the blocked product on
    padded copies (zeros add nothing to the sums), of all three or of the operands only,
    equals the 4-byte kernels' bit for bit, with bias and accumulate, and matches NumPy."""
    check_same_bits(rng, transpose_a, transpose_b, *((13, 21, 11) if not GPU else (1001, 389, 771)),
                    dict(pad_unaligned=True), dict(pad_unaligned="operands"),
                    dict(pad_unaligned=False))


# (case, M, N, K, transpose_b) of the row classes: in the simulator, then at sizes whose rows of
# odd length make all four classes' windows start at different columns; None: a product the
# row classes do not take (its classes' rows not as many in each), which the 4-byte kernels do
ROW_CLASS_CASES = [("a rows", *((32, 36, 39) if not GPU else (1000, 388, 771)), False),
                   ("a rows", *((32, 36, 39) if not GPU else (1000, 388, 771)), True),
                   ("k rows", *((36, 37, 32) if not GPU else (388, 771, 1000)), False),
                   ("out rows", *((32, 37, 36) if not GPU else (1000, 771, 388)), False),
                   (None, *((33, 36, 39) if not GPU else (1001, 388, 771)), False)]


def offset_by_one(array):
    """A device copy of `array` whose first element is one float past a 16-byte boundary (a
    contiguous view of a longer buffer)."""
    flat = device(np.concatenate([[0.0], array.ravel()]))
    return flat[1:].reshape(array.shape)


@pytest.mark.parametrize("case,M,N,K,transpose_b", ROW_CLASS_CASES)
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("offset", [False, True])
def test_matmul_in_row_classes(rng, monkeypatch, case, M, N, K, transpose_b, accumulate, offset):
    """pad_unaligned="row classes": a product whose operand or output has rows that are not
    16-byte runs, in four classes of rows in one launch, each over its aligned window (with
    transpose_b, on W^T's copy), and the columns outside the windows apart (for "a rows", the
    k outside each row's window in the same launch). Every element of out written (NaN
    before), or added to; the case expected taken; NumPy's answer. Also with the unaligned
    array starting one float past a 16-byte boundary, so that the windows move with it (in the
    simulator, which has no addresses, float_offset is made to say so)."""
    if offset and not GPU:
        monkeypatch.setattr(matmul, "float_offset", lambda array: 1)
    transpose_a = case == "k rows"
    a = rng.standard_normal((K, M) if transpose_a else (M, K)).astype(np.float32)
    b = rng.standard_normal((N, K) if transpose_b else (K, N)).astype(np.float32)
    out, prior = output_and_prior(rng, (M, N), accumulate)
    A, B = device(a), device(b)
    if offset and case in ("a rows", None):
        A = offset_by_one(a)
    elif offset and case == "k rows":
        B = offset_by_one(b)
    elif offset:
        out = offset_by_one(prior if accumulate else np.full((M, N), np.nan))
    taken = []
    real = matmul.row_class_matmul
    monkeypatch.setattr(matmul, "row_class_matmul", lambda case, *args: (taken.append(case),
                                                                         real(case, *args)))
    matmul.matmul(out, A, B, transpose_a=transpose_a, transpose_b=transpose_b,
                  accumulate=accumulate, kernel="blocked", tiles=None if GPU else dict(BM=16, BN=16),
                  pad_unaligned="row classes", copy_b_transposed=transpose_b or None)
    assert taken == ([case] if case else [])
    want = prior.astype(np.float64)
    matmul.matmul_numpy(want, a, b, None, transpose_a, transpose_b, accumulate)
    assert relative_error(out.copy_to_host(), want) < TOLERANCE


def test_row_class_windows(rng, monkeypatch):
    """class_window of a [R, 50257] matrix: row i starts i floats (mod 4) into a 16-byte run, so
    with step = 3, class j's window from column first + 3j starts on a run, wherever the
    array's first element sits in its own (float_offset); the windows are whole runs, cover
    all but at most 12 columns on either side, and overlap. as_classes holds them: in its row
    i, class j's window starts at column first + j (L + step) (a view: writes land in x)."""
    class Rows:                 # (only the shape is looked at, and float_offset's answer)
        shape = (8, 50257)
    for offset in range(4):
        monkeypatch.setattr(matmul, "float_offset", lambda x: offset)
        first, step, count = matmul.class_window(Rows())
        assert step == 3 and count % 4 == 0
        for j in range(4):
            assert (offset + j * 50257 + first + j * step) % 4 == 0
        lo, hi = first + 3 * step, first + count
        assert lo <= 12 and 50257 - hi <= 12 and lo < hi
    monkeypatch.undo()
    L = 23
    host = rng.standard_normal((12, L)).astype(np.float32)
    x = device(host)
    first, step, count = matmul.class_window(x)
    view = matmul.as_classes(x)
    for j in range(4):
        start = first + j * (L + step)
        np.testing.assert_array_equal(view.copy_to_host()[:, start:start + count],
                                      host[j::4, first + j * step:first + j * step + count])
    fill_kernel[1, 32](view, -1.0)
    np.testing.assert_array_equal(x.copy_to_host(), np.full_like(host, -1.0))


@cuda.jit
def fill_kernel(x, value):
    # x[R,C] = value, whatever x's strides
    for i in range(cuda.threadIdx.x, x.shape[0] * x.shape[1], cuda.blockDim.x):
        x[i // x.shape[1], i % x.shape[1]] = value


@pytest.mark.parametrize("kernel", ["tiled", "blocked"])
@pytest.mark.parametrize("transpose_a", [False, True])
def test_matmul_with_rows_padded_along_m_or_n(rng, kernel, transpose_a):
    """An operand whose rows run along M or N (a transposed, b not) may come with its rows
    padded to 4k floats ([K, M4], [K, N4]): the padding, NaN here, is read and left out of
    out; the same bits as the unpadded operands, and NumPy's twin agrees."""
    M, N, K = (13, 21, 11) if not GPU else (1001, 389, 771)
    M4, N4 = pad.padded_length(M), pad.padded_length(N)
    a = rng.standard_normal((K, M) if transpose_a else (M, K)).astype(np.float32)
    b = rng.standard_normal((K, N)).astype(np.float32)
    a_wide = np.full((K, M4), np.nan, np.float32) if transpose_a else a
    if transpose_a:
        a_wide[:, :M] = a
    b_wide = np.full((K, N4), np.nan, np.float32)
    b_wide[:, :N] = b
    outs = []
    for x, y in ((a, b), (a_wide, b_wide)):
        out = poisoned((M, N))
        matmul.matmul(out, device(x), device(y), transpose_a=transpose_a, kernel=kernel,
                      pad_unaligned=False)
        outs.append(out.copy_to_host())
    assert np.array_equal(outs[0], outs[1])
    want = np.empty((M, N))
    matmul.matmul_numpy(want, a_wide.astype(np.float64), b_wide.astype(np.float64),
                        transpose_a=transpose_a)
    assert relative_error(outs[1], want) < TOLERANCE
    with pytest.raises(ValueError, match="matmul b"):     # wider by more than the padding
        matmul.matmul(poisoned((M, N)), device(a), device(np.zeros((K, N4 + 4), np.float32)),
                      transpose_a=transpose_a)


def test_padding_pays_only_for_large_products(monkeypatch):
    """pads_unaligned: the LM head at V = 50257 (forward, input and weight gradients) is large
    enough for padded copies of the arrays whose rows hold V floats (with "operands", not of
    the output, then stored 4 bytes at a time); a small unaligned product, or an aligned one,
    is not. matmul then takes the row classes where they apply (takes_row_classes): all three
    products of the LM head, without a bias."""
    class Shaped:                 # (only the shape and the alignment are looked at)
        def __init__(self, *shape):
            self.shape = shape
    monkeypatch.setattr(matmul, "aligned16", lambda x: x.shape[-1] % 4 == 0)
    M, V, C, V4 = 16384, 50257, 768, 50260
    lm_products = [  # out, a, b, transpose_a, transpose_b, the copies (the output's too)
        ((M, V), (M, C), (C, V), False, False, {"out": (M, V4), "b": (C, V4)}),   # X . W
        ((M, C), (M, V), (C, V), False, True, {"a": (M, V4), "b": (C, V4)}),   # dlogits . W^T
        ((C, V), (M, C), (M, V), True, False, {"out": (C, V4), "b": (M, V4)})]    # X^T . dlogits
    for out, a, b, ta, tb, copied in lm_products:
        k = a[0] if ta else a[1]
        shaped = (Shaped(*out), Shaped(*a), Shaped(*b), ta, tb)
        assert matmul.pads_unaligned(*out, k, *shaped) == copied
        copied.pop("out", None)             # "operands": never the output
        assert matmul.pads_unaligned(*out, k, *shaped, pad_unaligned="operands") == copied
    for (out, a, b, ta, tb, _), case in zip(lm_products, ("out rows", "a rows", "k rows")):
        aligned = dict(out=out[1] % 4 == 0, a=a[1] % 4 == 0, b=b[1] % 4 == 0)
        assert matmul.takes_row_classes(*out, a[0] if ta else a[1], ta, tb, aligned, False,
                                        None) == case   # (matmul's default for them)
        assert matmul.takes_row_classes(*out, a[0] if ta else a[1], ta, tb, aligned, True,
                                        None) is None   # (no bias in the row classes)
    assert matmul.pads_unaligned(100, 101, 77, Shaped(100, 101), Shaped(100, 77),
                                 Shaped(77, 101), False, False) is None
    assert matmul.pads_unaligned(M, 50304, C, Shaped(M, 50304), Shaped(M, C),
                                 Shaped(C, 50304), False, False) is None


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
    tile, slots = (128, 128, 8), matmul.RESIDENT_BLOCKS
    splits = matmul.split_count(M, N, K, tile)
    output_blocks = -(-M // 128) * -(-N // 128)
    if output_blocks >= slots:
        assert splits == 1
        return
    assert 1 <= splits and K // splits >= 256

    def fill(s):
        total = output_blocks * s
        return total / (-(-total // slots) * slots)

    def fits(s):
        return 4 * (M + N) * matmul.k_per_slice(K, s, 8) <= matmul.L2_BYTES // 2

    counts = [s for s in range(1, K // 256 + 1) if s * output_blocks <= 8 * slots]  # 8 waves
    well_filled = [s for s in counts if fill(s) >= 0.9]
    if not well_filled:                     # none fills its waves: the best-filled one
        assert all(fill(s) <= fill(splits) for s in counts)
        return
    assert splits == ([s for s in well_filled if fits(s)] or well_filled)[0]


@pytest.mark.parametrize("M,N,measured", [(768, 3072, 10), (3072, 768, 10), (768, 768, 7),
                                          (384, 384, 27), (384, 1536, 7)])
def test_split_count_of_the_measured_weight_gradients(M, N, measured):
    """The counts that ran fastest of those timed on the H200 (split_count's docstring,
    2026-11-29): dW of the MLP, the attention projections and andrea-12m's, K = 16384."""
    assert matmul.split_count(M, N, 16384, (128, 128, 8)) == measured


@pytest.mark.parametrize("N,offset", [(24, 0), (23, 0), (24, 1)])
@pytest.mark.parametrize("with_bias,accumulate", [(True, False), (False, True)])
def test_sum_splits(rng, monkeypatch, N, offset, with_bias, accumulate):
    """Split-K's partial products summed in order (+ bias): 16 bytes at a time when rows of N %
    4 == 0 are 16-byte aligned (offset 1: out one float off, on a GPU), else one element a time;
    both add the same numbers in the same order, so they agree bit for bit."""
    M, S = (5, 3) if not GPU else (1000, 7)
    partials = rng.standard_normal((S, M, N)).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32)
    prior = rng.standard_normal((M, N)).astype(np.float32)
    results = []
    for kernel in (matmul.sum_splits4_kernel, matmul.sum_splits_kernel):
        if kernel == matmul.sum_splits_kernel:      # the fallback, whatever the shape
            monkeypatch.setattr(matmul, "aligned16", lambda array: False)
        launched = recording_launches(monkeypatch, matmul)
        out = device_at(prior if accumulate else np.full((M, N), np.nan, np.float32), offset)
        matmul.sum_splits(out, device(partials), device(bias) if with_bias else device(prior[0]),
                          with_bias, accumulate)
        four_wide = N % 4 == 0 and not (GPU and offset)
        assert launched == [kernel if four_wide else matmul.sum_splits_kernel]
        results.append(out.copy_to_host())
    want = (bias if with_bias else 0) + partials.astype(np.float64).sum(axis=0)
    want += prior if accumulate else 0
    assert relative_error(results[0], want) < TOLERANCE
    assert np.array_equal(results[0], results[1])


@pytest.mark.parametrize("accumulate", [False, True])
def test_sum_rows(rng, accumulate):
    x = rng.standard_normal((200, 45) if not GPU else (16384, 1536))     # several row chunks
    out, prior = output_and_prior(rng, x.shape[1], accumulate)
    matmul.sum_rows(out, device(x), accumulate)
    want = prior.astype(np.float64)
    matmul.sum_rows_numpy(want, x, accumulate)
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
    aligned, which on a GPU must take the one-element kernels."""
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
    four_wide = D % 4 == 0 and not (GPU and offset)
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
    for D in (8, 32, 64, 72):
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


def check_attention(rng, D, kernel, rows_per_block, B, H, T, dropout_p, tiles=None, offset=0,
                    in_concat=False):
    """attention_forward, then attention_backward (= and +=), against the NumPy twins; q, k, v
    and dout `offset` floats past the start of their allocations (device_at). in_concat: out,
    dout and the gradients are heads views of [B,T,C] arrays (DeviceHeads), as the model has them."""
    seed = np.array([424242], dtype=np.int64)
    drop = dict(dropout_p=dropout_p, seed=device(seed, np.int64), site=5, tiles=tiles)
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
    delta of attention's backward: the row sums against ones) and writing through it (its zeroed
    array): no copy either way."""
    B, T, H, D = 2, 5, 3, 4
    x = rng.standard_normal((B, T, H * D)).astype(np.float32)
    want = heads.heads_view_numpy(x, H)
    assert np.array_equal(want, x.reshape(B, T, H, D).transpose(0, 2, 1, 3))
    view = heads.heads_view(device(x), H)
    assert view.shape == (B, H, T, D)
    delta, written = poisoned((B, H, T)), poisoned((B, T, H * D))
    attention.attention_delta(delta, view, device(np.ones((B, H, T, D))),
                              heads.heads_view(written, H))
    assert relative_error(delta.copy_to_host(), want.sum(axis=-1)) < TOLERANCE
    assert not written.copy_to_host().any(), "every element written through the view"


@pytest.mark.parametrize("D", attention.FAST_HEAD_SIZES)
def test_attention_gpu_tiles(rng, monkeypatch, D):
    """The fast kernels with the tiles the GPU runs (64 or 128 threads a block, where the
    simulator's own tiles are tiny), on a T that crosses 32-row tiles and fills none."""
    monkeypatch.setattr(attention, "TILES", attention.GPU_TILES)
    monkeypatch.setattr(attention, "_fast_kernels", {})
    check_attention(rng, D, "fast", None, 1, 1, 40, 0.3)


@pytest.mark.parametrize("D,name", [(D, name) for D, variants in attention.TILE_VARIANTS.items()
                                    for name in variants])
def test_attention_tile_variants(rng, D, name):
    """The other tiles tools/bench.py times (--variants) compute the same function."""
    check_attention(rng, D, "fast", None, 1, 1, 40, 0.3, tiles=attention.TILE_VARIANTS[D][name])


@pytest.mark.parametrize("rows_per_block", [None, 16])
def test_attention_key_tiles_of_two_query_tiles(rng, rows_per_block):
    """dk/dv on key tiles twice as long as its query tiles (dq's shares then summed over two
    query tiles' worth of keys, packed by share_pair; the tiles in dynamic shared memory):
    tiny tiles of 8 keys x 4 queries on a T that crosses several, one or two key tiles a
    block."""
    tiles = (None, None, (8, 4, 4, 2, 0, 1, True) if not GPU else (64, 32, 4, 4, 3, 1, True))
    check_attention(rng, 64, "fast", rows_per_block, 1, 2, 13 if not GPU else 300, 0.3,
                    tiles=tiles)


@pytest.mark.parametrize("keys", [4, 8] if not GPU else [32, 64])
def test_attention_dq_added_atomically(rng, keys):
    """dq_atomic: the dk/dv kernel adds each dq share into dq with 16-byte atomic adds (dq
    zeroed first, or accumulated into), on key tiles of one and of two query tiles; dropout
    on, T crossing several tiles."""
    small = (keys, 4, 4, 1 if keys == 4 else 2, 0, 1, True, True)
    tiles = (None, None, small if not GPU else (keys, 32, 4, 4, 3, 1, True, True))
    check_attention(rng, 64, "fast", None, 1, 2, 13 if not GPU else 300, 0.3, tiles=tiles)


def test_attention_deterministic_sums_the_shares(rng, monkeypatch):
    """deterministic=True (or use_deterministic) on tiles that add dq atomically: the shares
    are summed in a fixed order instead (the sum kernel runs), and dq comes out
    the same to the bit twice."""
    atomic = (8, 4, 4, 2, 0, 1, True, True) if not GPU else (64, 32, 4, 4, 3, 1, True, True)
    assert attention.deterministic_tiles(64, (None, None, atomic))[2] == atomic[:7] + (False,)
    B, H, T, D = (1, 2, 13, 64) if not GPU else (2, 4, 300, 64)
    q, k, v, dout, out = (device(rng.standard_normal((B, H, T, D))) for _ in range(5))
    lse = poisoned((B, H, T))
    attention.attention_forward(out, lse, q, k, v)
    launched = recording_launches(monkeypatch, attention)
    monkeypatch.setattr(attention, "DETERMINISTIC", False)
    attention.use_deterministic()
    results = []
    for _ in range(2):
        dq, dk, dv = (poisoned((B, H, T, D)) for _ in range(3))
        attention.attention_backward(dq, dk, dv, poisoned((B, H, T)), dout, q, k, v, out, lse,
                                     tiles=(None, None, atomic))
        results.append(dq.copy_to_host())
    assert attention.attention_dq_sum_kernel in launched
    assert attention.DETERMINISTIC
    assert np.array_equal(results[0], results[1])


def test_share_pairs_are_packed():
    """share_pair numbers a head's (query tile, key tile) pairs 0, 1, 2, ... in order, the key
    tiles of query tile q being 0 .. q // ratio."""
    for ratio in (1, 2, 4):
        pairs = [(q, k) for q in range(9) for k in range(q // ratio + 1)]
        assert [attention.share_pair(q, k, ratio) for q, k in pairs] == list(range(len(pairs)))
        assert attention.share_pair(9, 0, ratio) == len(pairs)


@pytest.mark.parametrize("D", attention.FAST_HEAD_SIZES)
@pytest.mark.parametrize("B,H,T,rows_per_block,in_concat",
                         [(1, 2, 7, None, False), (1, 1, 20, None, True)] if not GPU else
                         [(4, 12, 256, None, True), (1, 2, 1000, None, False), (1, 1, 300, 40, False)])
def test_attention_tensor_forward(rng, D, B, H, T, rows_per_block, in_concat):
    """The tensor-core forward (3xTF32 mma's), then the fast backward from its out and lse:
    several key tiles, rows of a block not a multiple of the tile's, out the heads' concat."""
    check_attention(rng, D, "tensor", rows_per_block, B, H, T, 0.0, in_concat=in_concat)


def test_attention_auto_picks_the_tensor_forward_without_dropout(monkeypatch):
    monkeypatch.setattr(attention, "TENSOR_FORWARD", True)
    assert attention._pick(64, "auto") == "tensor"
    assert attention._pick(32, "auto", dropout_p=0.1) == "fast"
    assert attention._pick(64, "auto", backward=True) == "fast"
    assert attention._pick(72, "auto") == "reference"


def test_attention_tensor_forward_takes_no_dropout(rng):
    q = device(rng.standard_normal((1, 1, 5, 32)))
    with pytest.raises(ValueError, match="no dropout"):
        attention.attention_forward(poisoned((1, 1, 5, 32)), poisoned((1, 1, 5)), q, q, q,
                                    kernel="tensor", dropout_p=0.1)


@cuda.jit
def one_mma_kernel(d, a, b, c):
    # d[16,8] = a[16,8] b[8,8] + c[16,8] by one warp: each lane loads its fragments (mma.py)
    lane = cuda.threadIdx.x
    g, t = lane // 4, lane % 4
    x = mma.mma_tf32(a[g, t], a[g + 8, t], a[g, t + 4], a[g + 8, t + 4], b[t, g], b[t + 4, g],
                     c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1])
    d[g, 2 * t], d[g, 2 * t + 1], d[g + 8, 2 * t], d[g + 8, 2 * t + 1] = x


@cuda.jit
def split_kernel(hi, lo, x):
    i = cuda.grid(1)
    if i < x.shape[0]:
        hi[i], lo[i] = mma.split_tf32(x[i])


def test_mma_fragments_and_tf32_split(rng):
    """One warp's mma on TF32 values against NumPy (the fragment layout of kernels/mma.py),
    and split_tf32: hi and lo TF32 (low 13 bits zero), hi + lo within 2^-21 of x, as NumPy's."""
    x = (rng.standard_normal(1000) * 10.0 ** rng.integers(-8, 8, 1000)).astype(np.float32)
    hi, lo = poisoned(1000), poisoned(1000)
    split_kernel[8, 128](hi, lo, device(x))
    hi, lo = hi.copy_to_host(), lo.copy_to_host()
    want_hi, want_lo = mma.split_tf32_numpy(x)
    assert np.array_equal(hi, want_hi) and np.array_equal(lo, want_lo)
    assert not np.any((hi.view(np.uint32) | lo.view(np.uint32)) & np.uint32(0x1FFF))
    assert np.all(np.abs(hi.astype(np.float64) + lo - x) <= 2.0 ** -21 * np.abs(x))
    a, b = (mma.split_tf32_numpy(rng.standard_normal(shape))[0] for shape in ((16, 8), (8, 8)))
    c = rng.standard_normal((16, 8)).astype(np.float32)
    d = poisoned((16, 8))
    one_mma_kernel[1, 32](d, device(a), device(b), device(c))
    assert relative_error(d.copy_to_host(), mma.mma_numpy(a, b, c)) < 1e-6


@pytest.mark.parametrize("D", attention.FAST_HEAD_SIZES)
def test_attention_unaligned_heads(rng, monkeypatch, D):
    """q, k, v and dout whose rows are not 16-byte aligned: the fast kernels stage them 4 bytes
    at a time. (On a GPU they sit 1 float off; the simulator has no addresses, so there
    aligned16 is made to say no.)"""
    if not GPU:
        monkeypatch.setattr(attention, "aligned16", lambda array: False)
    monkeypatch.setattr(attention, "_fast_kernels", {})
    check_attention(rng, D, "fast", None, 1, 2, 9, 0.3, offset=1)
    assert [vector for _, _, vector, _ in attention._fast_kernels] == [False]


@pytest.mark.parametrize("D", attention.FAST_HEAD_SIZES)
def test_attention_without_dropout_compiled_in(rng, monkeypatch, D):
    """At dropout_p = 0 the launchers take kernels built without dropout (no_dropout); the
    kernels with dropout compiled in, given p = 0, must give the same bits."""
    B, H, T = (1, 2, 9) if not GPU else (2, 4, 300)
    q, k, v, dout = (device(rng.standard_normal((B, H, T, D))) for _ in range(4))
    results = []
    for built_with_dropout in (False, True):
        monkeypatch.setattr(attention, "_fast_kernels", {})
        if built_with_dropout:
            fast = attention._fast
            monkeypatch.setattr(attention, "_fast", lambda D, tiles, arrays, dropout:
                                fast(D, tiles, arrays, dropout=True))
        out, lse, delta = poisoned((B, H, T, D)), poisoned((B, H, T)), poisoned((B, H, T))
        grads = [poisoned((B, H, T, D)) for _ in range(3)]
        attention.attention_forward(out, lse, q, k, v, kernel="fast")
        attention.attention_backward(*grads, delta, dout, q, k, v, out, lse, kernel="fast")
        assert [dropout for *_, dropout in attention._fast_kernels] == [built_with_dropout]
        results.append([x.copy_to_host() for x in (out, lse, *grads)])
    for without, with_dropout in zip(*results):
        assert np.array_equal(without, with_dropout)


# D % 4 == 0 up to 4 * 32 takes the warp kernel (D=8: two lanes of the warp hold data), other D the
# one-thread kernel
DELTA_HEAD_SIZES = [8, 72, 6, 136] if not GPU else [32, 64, 72, 30, 136]


@pytest.mark.parametrize("D", DELTA_HEAD_SIZES)
@pytest.mark.parametrize("offset", [0, 1])
def test_attention_delta(rng, monkeypatch, D, offset):
    """delta = dout . out per row (the scratch of the fast backward), and `zeroed` set to zeros
    (dq before its shares are added); offset 1: rows not 16-byte aligned, which on a GPU must
    take the one-thread kernel (which zeroes its rows too). N = B*H*T = 30 rows: the last warp
    of the simulator's warp kernel (4 rows) holds two."""
    B, H, T = (2, 3, 5) if not GPU else (64, 12, 256)
    launched = recording_launches(monkeypatch, attention)
    dout, out = rng.standard_normal((B, H, T, D)), rng.standard_normal((B, H, T, D))
    delta = poisoned((B, H, T))
    zeroed = device_at(rng.standard_normal((B, H, T, D)).astype(np.float32), offset)
    attention.attention_delta(delta, device_at(dout.astype(np.float32), offset),
                              device_at(out.astype(np.float32), offset), zeroed)
    assert relative_error(delta.copy_to_host(), (dout * out).sum(axis=-1)) < TOLERANCE
    assert not zeroed.copy_to_host().any(), "zeroed: every element set to 0"
    four_wide = D % 4 == 0 and D <= 128 and not (GPU and offset)
    assert launched == [attention.attention_delta4_kernel if four_wide else
                        attention.attention_delta_kernel]


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


@pytest.mark.parametrize("n", [4000, 4001])            # the 16-byte and the one-element kernels
def test_gelu_accuracy_element_by_element(n):
    """Every element of gelu and gelu' over [-12, 12] against float64, in float32 epsilons scaled
    by the condition number 1 + 2|u| (the float32 rounding of u = sqrt(2/pi)(x + 0.044715 x^3)
    alone moves exp(-2u) by that many epsilons), plus 1e-35 where the result is below the
    smallest normal float32. The reference is x s, s = 1/(1 + exp(-2u)) = 0.5 (1 + tanh(u)): in
    float64, 0.5 x (1 + tanh(u)) itself cancels to 0 for x < -7."""
    x = np.linspace(-12, 12, n).astype(np.float32)
    out, dx = poisoned(n), poisoned(n)
    gelu.gelu_forward(out, device(x))
    gelu.gelu_backward(dx, device(np.ones(n)), device(x))
    x64 = x.astype(np.float64)
    u = np.sqrt(2 / np.pi) * (x64 + 0.044715 * x64 ** 3)
    s = 1 / (1 + np.exp(-2 * u))
    assert np.allclose(s[np.abs(x) < 3], 0.5 * (1 + np.tanh(u[np.abs(x) < 3])), rtol=1e-14)
    slope_term = 2 * x64 * s * (1 - s) * np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * x64 ** 2)
    scale = np.finfo(np.float32).eps * (1 + 2 * np.abs(u))
    forward_error = np.abs(out.copy_to_host() - x64 * s) / (scale * np.abs(x64 * s) + 1e-35)
    backward_error = (np.abs(dx.copy_to_host() - (s + slope_term))
                      / (scale * (s + np.abs(slope_term)) + 1e-35))
    assert forward_error.max() < 4, f"gelu: {forward_error.max()} at x = {x[forward_error.argmax()]}"
    assert backward_error.max() < 4, f"gelu': {backward_error.max()} at {x[backward_error.argmax()]}"


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
    for vector, threads in ((False, None), (True, None), (True, 64)) if V % 4 == 0 else (
            (False, None),):
        fused = [poisoned(1), poisoned(N), poisoned(N), poisoned((N, V))]
        crossentropy.crossentropy_forward_backward(*fused, device(logits),
                                                   device(targets, np.int32), device(dloss),
                                                   vector=vector, threads=threads)
        for got, expected in zip(fused, want_fused):
            assert relative_error(got.copy_to_host(), expected) < TOLERANCE


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
