"""What each attention head does: `nanoandrea heads --checkpoint DIR [--text FILE]`.

Heads trained together are said to specialise, each coming to attend by a pattern of its
own. This runs a trained model over a text, keeps every head's attention probabilities
P[i, j] (query i, key j <= i), and scores each (layer, head) on named patterns, each the
attention mass, averaged over the queries where the pattern applies, that falls on its keys:
    previous    j = i - 1
    current     j = i
    first       j = 0 (the "attention sink"), queries i >= 8
    local       i - 8 <= j <= i - 2 (near, but neither the token itself nor the previous one)
    brackets    at a closing bracket or quote, the key of the opening one it matches
    induction   j = j' + 1 for every earlier j' < i - 1 whose token is the current one's:
                the token that followed the current token last time
A pattern with more keys takes more mass by chance (a uniform causal head puts 1/(i+1) on
`current` and 7/(i+1) on `local`), so each score is also divided by what a uniform head would
score there (its lift): a head's strongest pattern is the one of the highest lift, and the
table gives its mass and its lift. Then, head by head, the head's output is zeroed before W_O
(the concat's columns of that head) and the loss on the text is measured again: the rise is
what the model loses without it (ablation).

It runs on the CPU, on the NumPy backend (the probabilities come from the NumPy twin of the
attention kernels, which computes them; the GPU kernels never write them out), on `--windows`
windows of the model's block size taken through the text.
"""
import json
from pathlib import Path

import numpy as np

from .autograd import no_grad
from .backend import Backend
from .checkpoint import read_checkpoint
from .data import DEFAULT_CORPUS, VAL_FRACTION
from .files import reason, replacing, unwritable
from .kernels.attention.reference import causal_probabilities
from .model import GPT

PATTERNS = ("previous", "current", "first", "local", "brackets", "induction")
PAIRS = {")": "(", "]": "[", "}": "{", ">": "<", "\u201d": "\u201c", "\u2019": "\u2018"}


class HeadsError(ValueError):
    """Bad input to `heads`: the message says which and why."""


def pattern_masks(tokens, pieces):
    """{pattern: (mask [T,T] of the keys it names for each query, queries [T] where it
    applies)} for one window of token ids and their decoded text pieces."""
    T = len(tokens)
    i, j = np.meshgrid(np.arange(T), np.arange(T), indexing="ij")
    causal = j <= i
    masks = {"previous": j == i - 1, "current": j == i, "first": (j == 0) & (i >= 8),
             "local": (j >= i - 8) & (j <= i - 2)}
    brackets = np.zeros((T, T), bool)
    stack = {opening: [] for opening in PAIRS.values()}
    for position, piece in enumerate(pieces):       # (the last character of each token)
        char = piece[-1:] if piece else ""
        if char in PAIRS and stack[PAIRS[char]]:
            brackets[position, stack[PAIRS[char]].pop()] = True
        elif char in stack:
            stack[char].append(position)
    masks["brackets"] = brackets
    tokens = np.asarray(tokens)
    same = (tokens[:, None] == tokens[None, :]) & (j < i - 1)      # earlier j' with t_j' = t_i
    induction = np.zeros((T, T), bool)
    induction[:, 1:] = same[:, :-1]                                # their next positions
    masks["induction"] = induction & causal & (j < i)
    return {name: (mask & causal, (mask & causal).any(axis=1)) for name, mask in masks.items()}


def pattern_scores(probabilities, masks):
    """{pattern: [L, H] scores} from probabilities [L, H, T, T] of one window."""
    scores = {}
    for name, (mask, queries) in masks.items():
        if not queries.any():
            scores[name] = np.full(probabilities.shape[:2], np.nan)
            continue
        mass = (probabilities * mask).sum(axis=-1)                 # [L, H, T]
        scores[name] = mass[..., queries].mean(axis=-1)
    return scores


def uniform_scores(masks):
    """{pattern: the score of a head that attends uniformly to keys 0 .. i}."""
    T = next(iter(masks.values()))[0].shape[0]
    uniform = np.tril(np.ones((T, T))) / np.arange(1, T + 1)[:, None]
    return {name: float(value[0, 0]) for name, value in
            pattern_scores(uniform[None, None], masks).items()}


class Recorder:
    """A NumPy backend whose attention keeps each call's probabilities, and can zero one head's
    output (the ablation), layer by layer in call order."""

    def __init__(self, dtype=np.float32):
        self.backend = Backend("numpy", dtype)
        self.twin = self.backend.attention_forward
        self.backend.attention_forward = self.attention_forward
        self.probabilities, self.ablate = [], None      # (ablate: (layer, head) to zero)

    def attention_forward(self, out, lse, q, k, v, **options):
        self.twin(out, lse, q, k, v, **options)
        layer = len(self.probabilities)
        self.probabilities.append(causal_probabilities(q, k)[0] if self.ablate is None else None)
        if self.ablate is not None and self.ablate[0] == layer:
            out[:, self.ablate[1]] = 0.0                # out: a view of the heads' concat

    def forward(self, model, ids, targets=None, ablate=None):
        self.probabilities, self.ablate = [], ablate
        with no_grad():
            return model.forward(ids, targets)


def windows_of(tokens, block, count):
    """`count` windows of block + 1 tokens (inputs and next-token targets), evenly through."""
    if len(tokens) < block + 1:
        raise HeadsError(f"the text has {len(tokens)} tokens, fewer than one block of the "
                         f"model and its next token ({block + 1})")
    starts = np.linspace(0, len(tokens) - block - 1, count).astype(int)
    return np.stack([tokens[s:s + block + 1] for s in starts])


def analyse(checkpoint, text=None, windows=4, ablation=True, report=print):
    """The heads' table (a list of rows) and the first window's attention maps [L, H, T, T]."""
    saved = read_checkpoint(checkpoint, optimizer=False)
    config, tokenizer = saved["config"], saved["tokenizer"]
    if text is None:
        whole = DEFAULT_CORPUS.read_text(encoding="utf-8")
        text = whole[int(len(whole) * (1 - VAL_FRACTION)):]       # the val split's text
    elif not Path(text).is_file():
        raise HeadsError(f"--text {text}: no such file")
    else:
        text = Path(text).read_text(encoding="utf-8", errors="replace")
    if hasattr(tokenizer, "id_of_char"):
        unseen = sorted(set(text) - set(tokenizer.id_of_char))
        if unseen:
            report(f"the text's characters {''.join(unseen)!r} are not in the model's "
                   f"vocabulary: left out")
        text = "".join(c for c in text if c in tokenizer.id_of_char)
    tokens = tokenizer.encode(text)
    data = windows_of(tokens, config.block_size, windows)
    recorder = Recorder()
    model = GPT(config, recorder.backend, seed=None)
    model.params.load_state_dict(saved["params"])
    ids, targets = data[:, :-1], data[:, 1:]
    totals, maps = {name: [] for name in PATTERNS}, None
    baselines = {name: [] for name in PATTERNS}
    for w in range(len(data)):                      # (a window at a time: [L, H, T, T] each)
        recorder.forward(model, ids[w:w + 1])
        probabilities = np.stack([p[0] for p in recorder.probabilities])      # [L, H, T, T]
        maps = probabilities if maps is None else maps
        pieces = [tokenizer.decode([t]) for t in ids[w]]
        masks = pattern_masks(ids[w], pieces)
        for name, value in pattern_scores(probabilities, masks).items():
            totals[name].append(value)
        for name, value in uniform_scores(masks).items():
            baselines[name].append(value)
    _, loss = recorder.forward(model, ids, targets, ablate=(-1, 0))   # (-1: no head zeroed)
    base_loss = loss.item()
    scores = {}
    for name, values in totals.items():
        values = np.stack(values)                   # [windows, L, H]
        seen = np.isfinite(values).any(axis=0)
        scores[name] = np.where(seen, np.nansum(values, axis=0) / np.maximum(
            np.isfinite(values).sum(axis=0), 1), np.nan)
    uniform = {name: float(np.mean([v for v in values if np.isfinite(v)]))
               if any(np.isfinite(values)) else np.nan for name, values in baselines.items()}
    rows = []
    for layer in range(config.n_layer):
        for head in range(config.n_head):
            row = {"layer": layer, "head": head,
                   **{name: float(scores[name][layer, head]) for name in PATTERNS}}
            lift = {name: row[name] / uniform[name] for name in PATTERNS
                    if np.isfinite(row[name]) and uniform[name] > 0}
            row["pattern"] = max(lift, key=lift.get)
            row["score"], row["lift"] = row[row["pattern"]], lift[row["pattern"]]
            if ablation:
                _, loss = recorder.forward(model, ids, targets, ablate=(layer, head))
                row["ablation"] = loss.item() - base_loss
            rows.append(row)
        report(f"layer {layer}: {config.n_head} heads scored"
               + (" and ablated" if ablation else ""))
    return rows, maps, base_loss


def format_table(rows, base_loss):
    lines = [f"loss on the text {base_loss:.4f}; each head's attention mass on each pattern, "
             f"its strongest (the highest lift over a uniform head), and the loss's rise with "
             f"the head zeroed",
             f"{'head':>6} {'strongest':>10} {'score':>6} {'lift':>5} " +
             " ".join(f"{name[:9]:>9}" for name in PATTERNS) + f" {'ablation':>9}"]
    for row in rows:
        cells = " ".join(f"{row[name]:9.3f}" if np.isfinite(row[name]) else f"{'-':>9}"
                         for name in PATTERNS)
        ablation = f" {row['ablation']:+9.4f}" if "ablation" in row else ""
        lines.append(f"L{row['layer']:>2}H{row['head']:<2} {row['pattern']:>10} "
                     f"{row['score']:6.3f} {row['lift']:5.1f} {cells}{ablation}")
    return "\n".join(lines)


def plot_maps(rows, maps, path, size=64):
    """heads.png: one heatmap of each head's attention over the first `size` positions, in a
    grid of layers (rows) by heads (columns), each titled with its strongest pattern."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    L, H = maps.shape[:2]
    figure, axes = plt.subplots(L, H, figsize=(1.3 * H, 1.4 * L), squeeze=False)
    for row in rows:
        axis = axes[row["layer"], row["head"]]
        axis.imshow(maps[row["layer"], row["head"], :size, :size], cmap="viridis", vmin=0,
                    vmax=1)
        axis.set_title(f"L{row['layer']}H{row['head']} {row['pattern']} x{row['lift']:.1f}",
                       fontsize=5)
        axis.set_xticks([])
        axis.set_yticks([])
    figure.tight_layout()
    figure.savefig(path, format="png", dpi=150)
    plt.close(figure)


OUTPUTS = ("heads.md", "heads.json", "heads.png")


def heads_report(checkpoint, out, text=None, windows=4, ablation=True, report=print):
    """Write heads.md (the table), heads.json and heads.png into `out`; return the table.
    Each is written beside its name and renamed onto it once all three are whole; names an
    earlier report of heads did not write are refused before any work."""
    out = Path(out)
    check_output_folder(out)
    rows, maps, base_loss = analyse(checkpoint, text, windows, ablation, report)
    table = format_table(rows, base_loss)
    made = out if not out.exists() else None
    written = {name: out / f".{name}.tmp" for name in OUTPUTS}
    try:
        out.mkdir(parents=True, exist_ok=True)
        written["heads.md"].write_text("```\n" + table + "\n```\n")
        written["heads.json"].write_text(json.dumps({"loss": base_loss, "heads": rows},
                                                    indent=1))
        plot_maps(rows, maps, written["heads.png"])
        for name, temporary in written.items():
            temporary.replace(out / name)
    except OSError as error:
        raise HeadsError(f"cannot write {out}: {reason(error)}; nothing was written") from None
    finally:
        for temporary in written.values():
            temporary.unlink(missing_ok=True)
        if made is not None and made.is_dir() and not any(made.iterdir()):
            made.rmdir()
    return table


def check_output_folder(out):
    """Refuse an --out where heads would replace what is not an earlier heads report (a
    heads.json of another shape, a user's heads.md), or that cannot be written."""
    taken = [name for name in OUTPUTS if (out / name).exists()]
    if taken and not _is_a_report(out / "heads.json"):
        raise HeadsError(f"{out} holds {', '.join(taken)}, which no earlier `nanoandrea "
                         f"heads` wrote: choose another --out, or move them")
    problem = unwritable(out)
    if problem:
        raise HeadsError(f"cannot write {out}: {problem}")


def _is_a_report(path):
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(report, dict) and set(report) == {"loss", "heads"}


# --- during training: each head's share of its layer's attention gradient (--log-heads) ------

def gradient_shares(grads, config):
    """[L][H]: each head's share of the squared gradient norm of its layer's attention
    projections: its D columns of W_Q, W_K, W_V and its D rows of W_O (grads: the model's
    grad_dict). Equal shares mean the heads still get the same pressure; apart, they
    specialise."""
    D = config.head_size
    shares = []
    for layer in range(config.n_layer):
        a = f"h.{layer}.attn."
        columns = sum(np.square(grads[a + f"w_{n}"].astype(np.float64)) for n in "qkv")
        per_head = (columns.reshape(config.n_embd, config.n_head, D).sum(axis=(0, 2))
                    + np.square(grads[a + "w_o"].astype(np.float64))
                    .reshape(config.n_head, D, config.n_embd).sum(axis=(1, 2)))
        shares.append((per_head / max(per_head.sum(), 1e-300)).tolist())
    return shares


def plot_gradient_shares(steps, shares, path):
    """heads_grad.png: a panel a layer, a line a head: its share over training."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    shares = np.asarray(shares)                             # [evals, L, H]
    L = shares.shape[1]
    columns = min(L, 4)
    rows = -(-L // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(3.2 * columns, 2.4 * rows),
                                squeeze=False, sharey=True)
    for layer in range(L):
        axis = axes[layer // columns, layer % columns]
        axis.plot(steps, shares[:, layer, :], linewidth=1)
        axis.set_title(f"layer {layer}", fontsize=8)
        axis.set_xlabel("step", fontsize=7)
        axis.tick_params(labelsize=6)
    for empty in range(L, rows * columns):
        axes[empty // columns, empty % columns].axis("off")
    axes[0, 0].set_ylabel("share of the layer's\nattention gradient", fontsize=7)
    axes[0, 0].legend([f"head {h}" for h in range(shares.shape[2])], fontsize=5)
    figure.tight_layout()
    try:
        with replacing(path) as temporary:
            figure.savefig(temporary, format="png", dpi=110)
    finally:
        plt.close(figure)
