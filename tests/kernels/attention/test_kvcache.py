"""Sampling with the key/value cache: its kernels against their NumPy twins, the twins against
the full causal attention, and cached sampling against uncached sampling: the same tokens for
the same seed (on the CPU backend in CI, on the GPU at andrea-mini's shape there)."""
import numpy as np
import pytest

from checks import device, poisoned
from conftest import GPU, relative_error
from nanoandrea.backend import get_backend
from nanoandrea.config import get_preset
from nanoandrea.kernels import attention, heads
from nanoandrea.kernels.attention import kvcache
from nanoandrea.model import GPT
from nanoandrea.sample import generate

TOLERANCE = 2e-5 if not GPU else 1e-4


@pytest.mark.parametrize("B,H,Tmax,D,start,T", [(2, 3, 12, 8, 0, 5), (2, 3, 12, 8, 5, 1),
                                                 (1, 2, 12, 32, 9, 3), (1, 1, 8, 136, 3, 2)]
                         if not GPU else
                         [(4, 12, 1024, 64, 1000, 1), (2, 12, 1024, 32, 0, 700),
                          (3, 12, 256, 72, 100, 5), (2, 1, 256, 384, 200, 3)])
def test_cached_attention_kernels_match_their_twins(rng, B, H, Tmax, D, start, T):
    """(D = 136 and 384: wider than 128, so more columns a lane, the last one part-filled)"""
    cache = rng.standard_normal((2, B, H, Tmax, D)).astype(np.float32)
    k, v, q = (rng.standard_normal((B, H, T, D)).astype(np.float32) for _ in range(3))
    device_cache, position = device(cache), np.array([start], np.int32)
    kvcache.kv_store(device_cache, device(k), device(v), device(position, np.int32))
    kvcache.kv_store_numpy(cache, k, v, position)
    assert np.array_equal(device_cache.copy_to_host(), cache)
    out = poisoned((B, T, H * D))
    kvcache.attention_cached(out, device(q), device_cache, device(position, np.int32))
    want = np.zeros((B, T, H * D))
    kvcache.attention_cached_numpy(want, q.astype(np.float64), cache.astype(np.float64),
                                   position)
    assert relative_error(out.copy_to_host(), want) < TOLERANCE


def test_cached_attention_of_a_whole_prefix_is_the_causal_attention(rng):
    """Queries at positions 0 .. T-1 against the cache of the same T keys: the model's
    attention, merged (heads side by side)."""
    B, H, T, D = 2, 3, 7, 8
    q, k, v = (rng.standard_normal((B, H, T, D)) for _ in range(3))
    cache, start = np.zeros((2, B, H, 10, D)), np.zeros(1, np.int32)
    kvcache.kv_store_numpy(cache, k, v, start)
    out = np.zeros((B, T, H * D))
    kvcache.attention_cached_numpy(out, q, cache, start)
    full, lse = np.zeros((B, H, T, D)), np.zeros((B, H, T))
    attention.attention_forward_numpy(full, lse, q, k, v)
    merged = np.zeros((B, T, H * D))
    heads.merge_heads_numpy(merged, full)
    assert np.allclose(out, merged, rtol=1e-12, atol=1e-12)


def sample_both_ways(model, prompt, steps, **options):
    return [generate(model, prompt, steps, rng=np.random.default_rng(4), kv_cache=cached,
                     **options) for cached in (True, False)]


@pytest.mark.parametrize("backend_name", ["numpy"] + (["cuda"] if GPU else []))
def test_cached_sampling_gives_the_uncached_tokens(rng, backend_name):
    """Sampled (top-k) and greedy, a batch of three, past the block size (where the window
    starts to move and the cache is let go).

    On the CPU the two paths give the same tokens to the last one. On the GPU a cached token's
    products have a few rows and take matvec.py, whose sums run in another order than the
    tiles of the full forward's products: the logits differ in their last float32 bits, and a
    draw that falls within that distance of a boundary between two tokens can go either way
    (then the texts part from there on). So there the two paths' logits are compared, token by
    token on the same text (`test_cached_logits_are_the_uncached_logits`), and the tokens of
    greedy decoding."""
    config = (get_preset("tiny") if backend_name == "numpy" else
              get_preset("andrea-mini", vocab_size=65, block_size=64))
    model = GPT(config, get_backend(backend_name), seed=3)
    model.params.load_flat(model.params.initial_values(3) * 10)     # (sharper distributions)
    prompt = rng.integers(0, config.vocab_size, size=(3, 5))
    if backend_name == "numpy":
        steps = config.block_size + 4
        cached, uncached = sample_both_ways(model, prompt, steps, temperature=1.0, top_k=10)
        assert cached.shape == (3, 5 + steps) and np.array_equal(cached, uncached)
    cached, uncached = sample_both_ways(model, prompt, 10, temperature=0)
    assert np.array_equal(cached, uncached)
    assert len({tuple(row) for row in cached[:, 5:]}) > 1     # (three prompts, three texts)


@pytest.mark.parametrize("backend_name", ["numpy"] + (["cuda"] if GPU else []))
def test_cached_logits_are_the_uncached_logits(rng, backend_name):
    """The cached decoder's logits of each next token (the prompt's forward, then one token at
    a time, replayed as a graph on the GPU) against a forward over the whole text so far, on
    the same text, past the block size: float32's rounding apart, the same numbers."""
    from nanoandrea.autograd import no_grad
    from nanoandrea.sample import CachedDecoder, last_logits
    config = (get_preset("tiny") if backend_name == "numpy" else
              get_preset("andrea-mini", vocab_size=65, block_size=64))
    model = GPT(config, get_backend(backend_name), seed=3)
    ids = rng.integers(0, config.vocab_size, size=(3, config.block_size))
    decoder = CachedDecoder(model, 3)
    with no_grad():
        for t in range(4, config.block_size):
            cached = (decoder.prefill(ids[:, :t + 1]) if t == 4 else
                      decoder.step(ids[:, t]))
            full, _ = model.forward(ids[:, :t + 1])
            got, want = (last_logits(model.backend, x.data) for x in (cached, full))
            assert relative_error(got, want) < (1e-6 if backend_name == "numpy" else 1e-5), t


@pytest.mark.parametrize("backend_name", ["numpy"] + (["cuda"] if GPU else []))
def test_the_moving_windows_forward_is_the_models_forward(rng, backend_name):
    """Past the block size each token runs a forward over the whole window (WindowDecoder: on
    the GPU eager at its first call, then captured as a graph and replayed): the logits of each
    window as it moves on are the model's forward's, bit for bit."""
    from nanoandrea.autograd import no_grad
    from nanoandrea.kernels.runtime import memory
    from nanoandrea.sample import WindowDecoder, last_logits
    config = (get_preset("tiny") if backend_name == "numpy" else
              get_preset("andrea-mini", vocab_size=65, block_size=64))
    model = GPT(config, get_backend(backend_name), seed=3)
    ids = rng.integers(0, config.vocab_size, size=(2, config.block_size + 4))
    window = WindowDecoder(model, 2)
    with no_grad():
        for start in range(5):
            text = ids[:, start:start + config.block_size]
            got, (want, _) = window(text), model.forward(text)
            assert np.array_equal(last_logits(model.backend, got.data),
                                  last_logits(model.backend, want.data)), start
    assert (window.graph is not None) == (backend_name == "cuda" and memory.CUPY_POOL)


def test_sampling_reads_the_weights_as_an_optimizer_step_left_them(rng):
    """generate reads each weight's bf16 copy, which AdamW writes with the weight (the
    parameter store's; in tf32 ops.fixed_weights rounds each once a call), not rounded at
    every token: after an AdamW step the next call must sample from the new weights, as a
    model loaded with them does (a copy that AdamW did not renew would sample the old ones)."""
    from nanoandrea.optim import AdamW
    config = get_preset("tiny")
    backend = get_backend("numpy", precision="bf16")
    model = GPT(config, backend, seed=3)
    model.params.load_flat(model.params.initial_values(3) * 10)
    prompt = rng.integers(0, config.vocab_size, size=(2, 4))
    before = generate(model, prompt, 8, temperature=0)
    model.params.grads[...] = rng.standard_normal(model.params.size)
    AdamW(model.params, lr=0.5, weight_decay=0.0, grad_clip=0.0).step()
    after = generate(model, prompt, 8, temperature=0)
    loaded = GPT(config, backend, seed=None)
    loaded.params.load_state_dict(model.params.state_dict())
    assert np.array_equal(after, generate(loaded, prompt, 8, temperature=0))
    assert not np.array_equal(after, before)        # (the step changed what is sampled)
