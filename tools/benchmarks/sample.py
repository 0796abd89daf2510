"""Generation with andrea-120m at 1024 tokens of context, greedy, batch 1 and 8, fp32 and bf16:
ours with the key/value cache against Hugging Face transformers' `generate` (which caches) on
the same weights and precision, ours without the cache, and one captured decode step's replay.
"""
import statistics
import time

import numpy as np
from numba import cuda

from benchmarks.timing import require, row


def bench_sample(args):
    """Generation at 1024 tokens of context, andrea-120m, greedy, B=1 and 8, fp32 and bf16:
    ours with the cache (a 768-token prompt and 256 new tokens: the context reaches 1024) and
    transformers' GPT2LMHeadModel.generate (which caches) on the same weights and precision,
    each the wall time of the whole call after a short warm-up call; ours without the cache
    over 16 tokens at the same context (a prompt of 1008); and one token's steady state, N
    replays of the captured step alone. Ratios: cached / uncached, and ours / HF."""
    import torch
    import transformers
    from nanoandrea import ops
    from nanoandrea.autograd import no_grad
    from nanoandrea.backend import get_backend
    from nanoandrea.checkpoint import to_gpt2_names
    from nanoandrea.config import get_preset
    from nanoandrea.hf import hf_config
    from nanoandrea.model import GPT
    from nanoandrea.sample import CachedDecoder, generate
    from nanoandrea.tokenizer import CharTokenizer
    torch.backends.cuda.matmul.allow_tf32 = False
    prompt_len, new_tokens, uncached_tokens, replays = 768, 256, 16, 200
    print(f"sample: andrea-120m, greedy, a {prompt_len}-token prompt and {new_tokens} new tokens "
          f"(uncached: {uncached_tokens} tokens after {1024 - uncached_tokens})")
    config = get_preset("andrea-120m")
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        **{k: v for k, v in hf_config(config, CharTokenizer("a")).items()
           if k not in ("architectures", "model_type", "torch_dtype")}))
    state = GPT(config, get_backend("cuda"), seed=0, moments=False).params.state_dict()
    missing, unexpected = hf.transformer.load_state_dict(
        {k: torch.as_tensor(v) for k, v in to_gpt2_names(state, config).items()}, strict=False)
    require(float(len([m for m in missing if not m.endswith("attn.bias")]) + len(unexpected)),
            0.5, "transformers took every weight")
    hf = hf.cuda().eval()

    def seconds(fn):
        cuda.synchronize()
        torch.cuda.synchronize()
        started = time.perf_counter()
        out = fn()
        cuda.synchronize()
        torch.cuda.synchronize()
        return time.perf_counter() - started, out

    for precision in ("fp32", "bf16"):
        model = GPT(config, get_backend("cuda", precision=precision), seed=None, moments=False)
        model.params.load_state_dict(state)
        if precision == "bf16":
            hf = hf.to(torch.bfloat16)
        for batch in (1, 8):
            rng = np.random.default_rng(batch)
            prompt = rng.integers(0, config.vocab_size, (batch, prompt_len))
            long_prompt = rng.integers(0, config.vocab_size, (batch, 1024 - uncached_tokens))

            def theirs(n):
                with torch.no_grad():
                    return hf.generate(torch.as_tensor(prompt, device="cuda"), do_sample=False,
                                       max_new_tokens=n, min_new_tokens=n,
                                       pad_token_id=0).cpu().numpy()
            theirs(4)                                   # (warm: kernels, memory pools)
            hf_s, hf_ids = seconds(lambda: theirs(new_tokens))
            generate(model, prompt, 4, temperature=0)
            ours_s, ids = seconds(lambda: generate(model, prompt, new_tokens, temperature=0))
            generate(model, long_prompt, 1, temperature=0, kv_cache=False)
            slow_s, _ = seconds(lambda: generate(model, long_prompt, uncached_tokens,
                                                 temperature=0, kv_cache=False))
            replay_ms = replay_time_ms(model, prompt, replays, ops, no_grad, CachedDecoder)
            rate, hf_rate = batch * new_tokens / ours_s, batch * new_tokens / hf_s
            slow_rate = batch * uncached_tokens / slow_s
            agree = float(np.mean(ids[:, prompt_len:] == hf_ids[:, prompt_len:]))
            same_rows = int(np.sum(np.all(ids == hf_ids, axis=1)))
            name = f"B={batch} {precision}"
            row("sample", f"{name} cached", 1e3 * ours_s, None, "", 1e3 * hf_s, "HF generate",
                f"{rate:,.0f} tok/s; HF {hf_rate:,.0f} tok/s: ours/HF {rate / hf_rate:.2f}x; "
                f"new ids equal to HF's: {100 * agree:.1f}%, {same_rows} of {batch} rows all "
                f"equal" + ("" if precision == "fp32" else " (HF's bf16 rounds every op)"))
            row("sample", f"{name} uncached", 1e3 * slow_s, None, "", None, "",
                f"{slow_rate:,.1f} tok/s: cached/uncached {rate / slow_rate:.1f}x")
            row("sample", f"{name} one replay", replay_ms, None, "", None, "",
                f"{batch * 1e3 / replay_ms:,.0f} tok/s in the steady state "
                f"(median of {replays} replays, context {prompt_len}..{prompt_len + replays})")


def replay_time_ms(model, prompt, replays, ops, no_grad, CachedDecoder):
    """Milliseconds of one decode step once captured: the prompt's forward, the eager and the
    captured step, then `replays` steps timed one by one (each: the new ids and position
    copied in, the graph launched, waited for), the median."""
    times = []
    with no_grad(), ops.fixed_weights(model.params.matrices()):
        decoder = CachedDecoder(model, prompt.shape[0])
        decoder.prefill(prompt)
        next_ids = np.asarray(prompt[:, -1])
        for step in range(replays + 2):
            cuda.synchronize()
            started = time.perf_counter()
            decoder.step(next_ids)
            cuda.synchronize()
            if decoder.cuda_graph:
                decoder.stream.synchronize()
            if step >= 2:                       # (the eager step and the capture)
                times.append(1e3 * (time.perf_counter() - started))
    return statistics.median(times)
