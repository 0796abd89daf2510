"""Where sampling's time goes: `generate` from a checkpoint with and without the key/value
cache, each twice in one process (the first call also loads, or compiles, what it launches),
then a profile of the uncached path by Python function.

    python tools/sample_profile.py CHECKPOINT [--tokens 40] [--prompt "JULIET:"]

Every call starts from the same prompt and seed, 40 new tokens by default, top-k 200 at
temperature 0.8 (sample's defaults).
"""
import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanoandrea.sample import generate, load_model  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--tokens", type=int, default=40)
    parser.add_argument("--prompt", default="JULIET:")
    args = parser.parse_args()
    model, tokenizer = load_model(args.checkpoint)
    ids = np.array([tokenizer.encode(args.prompt)])

    def run(kv_cache):
        generate(model, ids, args.tokens, 0.8, 200, np.random.default_rng(1), kv_cache=kv_cache)
    for kv_cache in (True, False):
        for repeat in range(2):
            started = time.perf_counter()
            run(kv_cache)
            print(f"kv_cache={kv_cache} run {repeat}: {args.tokens} tokens in "
                  f"{time.perf_counter() - started:.3f} s", flush=True)
    profile = cProfile.Profile()
    profile.enable()
    run(False)
    profile.disable()
    pstats.Stats(profile).sort_stats("cumtime").print_stats(30)


if __name__ == "__main__":
    main()
