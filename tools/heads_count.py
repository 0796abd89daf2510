"""Why several heads, not one wider one: the same model with its width cut into 1, 2, 4, ...
heads (the same parameters: W_Q, W_K, W_V, W_O are [C,C] whatever the split), trained for the
same steps on the same batches, compared on val loss and time per step.

    python tools/heads_count.py --preset andrea-12m --heads 1,6,12,24 --steps 1500 --out DIR
    python tools/heads_count.py --device cpu --preset andrea-mini --heads 1,2,4,8 --steps 400

Each run is `nanoandrea train` (the default recipe, its schedule over --steps) into
DIR/heads-N; then DIR/heads_count.json and DIR/heads_count.png (val loss over steps, one line a
head count) and a table on stdout: heads x D, best val loss, ms a step. --reuse reads a head
count's run from DIR/heads-N/metrics.jsonl where there is one (runs made on different
machines), instead of training it again; a run cut short says where its evaluations end.
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanoandrea.train import resolve_options, train  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="andrea-12m")
    parser.add_argument("--heads", default="1,6,12,24")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--eval-interval", type=int, default=250)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", default="out/heads_count")
    parser.add_argument("--reuse", action="store_true",
                        help="a head count with a DIR/heads-N/metrics.jsonl is read, not "
                             "trained again (runs made on different machines); one that stopped "
                             "early says where its evaluations end")
    parser.add_argument("--log-heads", action="store_true",
                        help="train's --log-heads in each run (heads_grad.png in DIR/heads-N)")
    args = parser.parse_args()
    out = Path(args.out)
    results = []
    for heads in [int(h) for h in args.heads.split(",")]:
        run = out / f"heads-{heads}"
        if not (args.reuse and (run / "metrics.jsonl").exists()):
            given = dict(preset=args.preset, n_head=heads, max_steps=args.steps,
                         eval_interval=args.eval_interval, device=args.device,
                         log_heads=args.log_heads, out=str(run))
            options = resolve_options(given, report=lambda line: None)
            train(options, report=lambda line: print(f"[{heads} heads] {line}", flush=True))
        metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        step_ms = [m["ms_per_step"] for m in metrics if "ms_per_step" in m][1:]  # (not step 1)
        evals = [(m["step"], m["val_loss"]) for m in metrics if "val_loss" in m]
        best_step, best_val = min(evals, key=lambda e: e[1])
        results.append(dict(heads=heads, best_val=best_val, best_step=best_step, evals=evals,
                            last_eval=evals[-1][0],
                            ms_per_step=sorted(step_ms)[len(step_ms) // 2] if step_ms else None,
                            preset=args.preset))
    (out / "heads_count.json").write_text(json.dumps(results, indent=1))
    print(f"\n{args.preset}, {args.steps} steps, the same seed and batches")
    print(f"{'heads':>6} {'best val':>9} {'at step':>8} {'ms/step':>8}")
    for r in results:
        short = (f"  (evaluated to step {r['last_eval']} only)" if r["last_eval"] < args.steps
                 else "")
        print(f"{r['heads']:>6} {r['best_val']:9.4f} {r['best_step']:>8} {r['ms_per_step']:8.1f}"
              f"{short}")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axis = plt.subplots(figsize=(6, 4))
    for r in results:
        steps, losses = zip(*r["evals"][1:])
        axis.plot(steps, losses, "o-", label=f"{r['heads']} heads")
    axis.set_xlabel("step")
    axis.set_ylabel("val loss")
    axis.set_title(f"{args.preset}: the same width in 1 or more heads")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(out / "heads_count.png", dpi=110)


if __name__ == "__main__":
    main()
