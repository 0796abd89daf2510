"""Model configurations: GPTConfig, the ANDREA presets, and the parameter breakdown."""
import dataclasses
from dataclasses import dataclass


class ConfigError(ValueError):
    """A configuration that cannot make a model; the message says what to change."""


VOCAB_MULTIPLE = 64


@dataclass
class GPTConfig:
    n_layer: int
    n_head: int
    n_embd: int                 # C, the width of the residual stream
    block_size: int             # the longest sequence the position table covers
    vocab_size: int
    dropout: float = 0.0

    @property
    def head_size(self):        # D
        return self.n_embd // self.n_head

    @property
    def padded_vocab_size(self):
        """Vp: rows of the token-embedding storage and columns of the logits, the vocabulary
        rounded up to a multiple of VOCAB_MULTIPLE (llm.c's Vp): every row of the logits then
        starts on a 16-byte boundary and the LM head's matmuls move 16 bytes at a time (GPT-2's
        50257 is odd). The padded rows are zero and the loss and sampling ignore their columns,
        so the model's function is the unpadded one."""
        return -(-self.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE

    def validate(self):
        for name in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise ConfigError(f"n_head={self.n_head} does not divide the width n_embd={self.n_embd}:"
                              f" each head needs n_embd/n_head columns")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout}")
        return self

    def replace(self, **changes):
        return dataclasses.replace(self, **changes).validate()

    def to_dict(self):
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d):
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - fields
        if unknown:
            raise ConfigError(f"unknown configuration keys: {', '.join(sorted(unknown))}")
        return cls(**d).validate()


PRESETS = {
    # for tests: every size deliberately off the kernels' tile sizes
    "tiny": GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=37),
    # what `train` runs on a machine without a GPU, with the NumPy backend
    "andrea-mini": GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=64, vocab_size=4096),
    "andrea-12m": GPTConfig(n_layer=6, n_head=12, n_embd=384, block_size=256, vocab_size=4096),
    "andrea-120m": GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50257),
}


def get_preset(name, **changes):
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    return PRESETS[name].replace(**{k: v for k, v in changes.items() if v is not None})


def parameter_breakdown(config):
    """[(label, count)]: where the parameters are. The LM head is tied to the token embedding."""
    C, L, V = config.n_embd, config.n_layer, config.vocab_size
    attention_weights = 4 * C * C               # W_Q, W_K, W_V, W_O, each [C, C]
    attention_biases = 4 * C
    mlp = C * 4 * C + 4 * C + 4 * C * C + C     # up [C,4C] + bias, down [4C,C] + bias
    layernorms = 2 * 2 * C                      # ln_1, ln_2: weight and bias
    rows = [
        ("token embedding wte [V,C] (tied to the LM head)", V * C),
        ("position embedding wpe [block,C]", config.block_size * C),
        ("attention projections per layer (W_Q, W_K, W_V, W_O: 4 C^2)", attention_weights),
        (f"attention projections, all {L} layers", attention_weights * L),
        (f"attention biases, all {L} layers", attention_biases * L),
        (f"MLP weights and biases, all {L} layers", mlp * L),
        (f"layernorms, all {L} layers + final", layernorms * L + 2 * C),
    ]
    total = (V * C + config.block_size * C
             + (attention_weights + attention_biases + mlp + layernorms) * L + 2 * C)
    rows.append(("total", total))
    return rows


def format_breakdown(config):
    rows = parameter_breakdown(config)
    total = rows[-1][1]
    width = max(len(label) for label, _ in rows)
    lines = []
    for label, count in rows:
        share = "" if "per layer" in label else f"  {100.0 * count / total:5.1f}%"
        lines.append(f"{label:<{width}}  {count:>13,}{share}")
    return "\n".join(lines)
