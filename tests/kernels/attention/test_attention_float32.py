"""The float32 flash attention (kernels/attention/float32.py: flash-attention-2 tiles on the CUDA
cores, D = 16, 32 or 64) against the NumPy twins: every head size, query tiles of the default
size, of a whole head and of 3 rows, with dropout; the GPU's own tiles in the simulator; dk/dv's
key tiles of two query tiles; dq's shares summed in a fixed order; the kernels built without
dropout; the backward's delta."""
import numpy as np
import pytest

from checks import TOLERANCE, device, poisoned, recording_launches
from conftest import GPU, relative_error
from nanoandrea.kernels import attention, heads
from nanoandrea.kernels.attention import float32
from nanoandrea.kernels.attention.tiles import Tile
from test_attention_reference import check_attention


@pytest.mark.parametrize("D", float32.HEAD_SIZES)
@pytest.mark.parametrize("rows_per_block", [None, "T", 3])   # a tile, the whole head, 3 rows
@pytest.mark.parametrize("B,H,T", [(2, 2, 7)] if not GPU else [(4, 12, 256), (1, 2, 1024)])
@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_attention_float32(rng, D, rows_per_block, B, H, T, dropout_p):
    check_attention(rng, D, "float32", T if rows_per_block == "T" else rows_per_block, B, H, T,
                    dropout_p)


@pytest.mark.parametrize("D", [32, 64])
def test_attention_float32_writes_the_heads_concat(rng, D):
    """out, and backward's dq, dk, dv, written through heads views of [B,T,C] arrays (merge
    heads done by the store), dout read through one: the same values as contiguous arrays."""
    B, H, T = (2, 3, 7) if not GPU else (4, 12, 256)
    check_attention(rng, D, "float32", None, B, H, T, 0.3, in_concat=True)


@pytest.mark.parametrize("D", float32.HEAD_SIZES)
def test_attention_gpu_tiles(rng, monkeypatch, D):
    """The kernels with the tiles the GPU runs (64 or 128 threads a block, where the
    simulator's own tiles are tiny; at D=64 dk/dv's key tiles are two query tiles long), on a
    T that crosses 32-row tiles and fills none."""
    monkeypatch.setattr(float32, "TILES", float32.GPU_TILES)
    check_attention(rng, D, "float32", None, 1, 1, 40, 0.3)


@pytest.mark.parametrize("rows_per_block", [None, 16])
def test_attention_key_tiles_of_two_query_tiles(rng, monkeypatch, rows_per_block):
    """dk/dv on key tiles twice as long as its query tiles (dq's shares then summed over two
    query tiles' worth of keys, packed by share_pair; the tiles in dynamic shared memory), as
    the GPU's D=64 tile: tiny tiles of 8 keys x 4 queries on a T that crosses several, one or
    two key tiles a block."""
    if not GPU:
        forward, _ = float32.TILES[64]
        monkeypatch.setitem(float32.TILES, 64, (forward, Tile(8, 4, 4, 2, score_steps=1)))
    assert float32.TILES[64][1].rows == 2 * float32.TILES[64][1].cols
    check_attention(rng, 64, "float32", rows_per_block, 1, 2, 13 if not GPU else 300, 0.3)


@pytest.mark.parametrize("D", float32.HEAD_SIZES)
def test_attention_backward_is_reproducible(rng, monkeypatch, D):
    """dq is summed from its shares in a fixed order (attention_dq_sum_kernel, no atomics):
    two backward passes on the same inputs give the same bits."""
    B, H, T = (1, 2, 13) if not GPU else (2, 4, 300)
    q, k, v, dout, out = (device(rng.standard_normal((B, H, T, D))) for _ in range(5))
    lse = poisoned((B, H, T))
    attention.attention_forward(out, lse, q, k, v, kernel="float32")
    launched = recording_launches(monkeypatch, float32)
    results = []
    for _ in range(2):
        grads = [poisoned((B, H, T, D)) for _ in range(3)]
        attention.attention_backward(*grads, poisoned((B, H, T)), dout, q, k, v, out, lse,
                                     kernel="float32", dropout_p=0.3,
                                     seed=device(np.array([7]), np.int64))
        results.append([g.copy_to_host() for g in grads])
    assert float32.attention_dq_sum_kernel in launched
    for first, second in zip(*results):
        assert np.array_equal(first, second)


def test_share_pairs_are_packed():
    """share_pair numbers a head's (query tile, key tile) pairs 0, 1, 2, ... in order, the key
    tiles of query tile q being 0 .. q // ratio."""
    for ratio in (1, 2, 4):
        pairs = [(q, k) for q in range(9) for k in range(q // ratio + 1)]
        assert [float32.share_pair(q, k, ratio) for q, k in pairs] == list(range(len(pairs)))
        assert float32.share_pair(9, 0, ratio) == len(pairs)


@pytest.mark.parametrize("D", float32.HEAD_SIZES)
def test_attention_without_dropout_compiled_in(rng, monkeypatch, D):
    """At dropout_p = 0 the launchers take kernels built without dropout (no_dropout); the
    kernels with dropout compiled in, given p = 0, must give the same bits."""
    B, H, T = (1, 2, 9) if not GPU else (2, 4, 300)
    q, k, v, dout = (device(rng.standard_normal((B, H, T, D))) for _ in range(4))
    results = []
    for built_with_dropout in (False, True):
        if built_with_dropout:
            for name in ("forward_kernel", "dkdv_kernel"):
                factory = getattr(float32, name)
                monkeypatch.setattr(float32, name, lambda D, tile, dropout, factory=factory:
                                    factory(D, tile, True))
        launched = recording_launches(monkeypatch, float32)
        out, lse, delta = poisoned((B, H, T, D)), poisoned((B, H, T)), poisoned((B, H, T))
        grads = [poisoned((B, H, T, D)) for _ in range(3)]
        attention.attention_forward(out, lse, q, k, v, kernel="float32")
        attention.attention_backward(*grads, delta, dout, q, k, v, out, lse, kernel="float32")
        tiles = float32.TILES[D]
        assert launched[0] is float32.forward_kernel(D, tiles[0], built_with_dropout)
        assert float32.dkdv_kernel(D, tiles[1], built_with_dropout) in launched
        results.append([x.copy_to_host() for x in (out, lse, *grads)])
    for without, with_dropout in zip(*results):
        assert np.array_equal(without, with_dropout)


@pytest.mark.parametrize("D", [8, 32, 64, 128])
def test_attention_delta(rng, D):
    """delta = dout . out per row (the scratch of the backward), a warp per 4 rows (at D=8 two
    lanes of the warp hold data); N = B*H*T = 30 rows: the last warp of the simulator's kernel
    holds two."""
    B, H, T = (2, 3, 5) if not GPU else (64, 12, 256)
    dout, out = rng.standard_normal((B, H, T, D)), rng.standard_normal((B, H, T, D))
    delta = poisoned((B, H, T))
    float32.attention_delta(delta, device(dout), device(out))
    assert relative_error(delta.copy_to_host(), (dout * out).sum(axis=-1)) < TOLERANCE


def test_attention_delta_reads_through_a_heads_view(rng):
    """heads_view(x, H)[b, h, t, d] is x[b, t, h*D + d], for a kernel reading through it (the
    delta of attention's backward: the row sums against ones): no copy."""
    B, T, H, D = 2, 5, 3, 4
    x = rng.standard_normal((B, T, H * D)).astype(np.float32)
    want = heads.heads_view_numpy(x, H)
    assert np.array_equal(want, x.reshape(B, T, H, D).transpose(0, 2, 1, 3))
    view = heads.heads_view(device(x), H)
    assert view.shape == (B, H, T, D)
    delta = poisoned((B, H, T))
    float32.attention_delta(delta, view, device(np.ones((B, H, T, D))))
    assert relative_error(delta.copy_to_host(), want.sum(axis=-1)) < TOLERANCE


def test_attention_float32_refuses_other_head_sizes():
    x = device(np.zeros((1, 1, 3, 72)))
    with pytest.raises(ValueError, match="float32 flash kernels take D in"):
        attention.attention_forward(x, device(np.zeros((1, 1, 3))), x, x, x, kernel="float32")
