"""The GPT-2 a PyTorch user trains (nanoGPT's model.py, written again): the benchmark's anchor
and the tests' independent oracle. Needs torch (the `test` extra); the package never imports it.

nanoGPT's shape: nn.Linear layers (weights [out, in], the bias inside cuBLAS's epilogue), Q, K
and V from one fused [C, 3C] product, attention through scaled_dot_product_attention
(is_causal=True), the LM head tied to the token embedding, no dropout (the benchmark's steps
and the tests' checks run without it).

    model = TorchGPT(config, device="cuda")     # GPT-2's initialisation, the padded vocabulary
    logits, loss = model(idx, targets)

For the tests, the same module on nanoandrea's weights: from_nanoandrea takes a state dict of
nanoandrea's names and [in, out] weights (ParameterStore.state_dict(): the vocabulary's V rows,
not the padded ones, so that both softmaxes run over the same V classes), and grads() hands
the gradients back under nanoandrea's names. The module's names are GPT-2's (h.0.attn.c_attn,
...), so the package's own GPT-2 mapping (checkpoint.to_gpt2_names, from_gpt2_names) renames
both ways; nn.Linear stores each weight transposed.

    reference = TorchGPT.from_nanoandrea(config, model.params.state_dict(), dtype=torch.float64)
    _, loss = reference(idx, targets)
    loss.backward()
    reference.grads()                           # {nanoandrea name: numpy array}
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanoandrea.checkpoint import from_gpt2_names, to_gpt2_names

LINEAR_LAYERS = (".c_attn.", ".c_proj.", ".c_fc.")      # nn.Linear's, named as GPT-2's


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)    # W_Q, W_K, W_V side by side
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)        # W_O

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in (q, k, v))                                 # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))        # heads side by side


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(config.n_embd), nn.LayerNorm(config.n_embd)
        self.attn, self.mlp = CausalSelfAttention(config), MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TorchGPT(nn.Module):
    def __init__(self, config, device="cpu", dtype=torch.float32, vocab_size=None):
        """vocab_size: the embedding's rows (default the padded vocabulary, as nanoGPT pads
        50257 to 50304)."""
        super().__init__()
        self.config = config
        C = config.n_embd
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size or config.padded_vocab_size, C),
            wpe=nn.Embedding(config.block_size, C),
            h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
            ln_f=nn.LayerNorm(C)))
        for name, p in self.named_parameters():         # GPT-2's initialisation
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() == 2:
                std = 0.02 / math.sqrt(2 * config.n_layer) if name.endswith("c_proj.weight") \
                    else 0.02
                nn.init.normal_(p, 0.0, std)
        self.to(device=device, dtype=dtype)

    def forward(self, idx, targets=None):
        t = self.transformer
        x = t.wte(idx) + t.wpe.weight[:idx.shape[1]]
        for block in t.h:
            x = block(x)
        logits = F.linear(t.ln_f(x), t.wte.weight)      # the tied LM head
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))
        return logits, loss

    # --- nanoandrea's weights in, its gradients out -------------------------------------------

    @classmethod
    def from_nanoandrea(cls, config, state_dict, device="cpu", dtype=torch.float32):
        """The model on nanoandrea's parameters (its names, [in, out] weights, V rows of wte)."""
        model = cls(config, device, dtype, vocab_size=state_dict["wte"].shape[0])
        tensors = to_gpt2_names(state_dict, config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                value = torch.as_tensor(tensors[cls._gpt2_name(name)])
                p.copy_(value.T if cls._transposed(name) else value)
        return model

    def grads(self):
        """{nanoandrea name: gradient as a numpy array} after a backward."""
        tensors = {self._gpt2_name(name): (p.grad.T if self._transposed(name) else p.grad)
                   .detach().cpu().numpy() for name, p in self.named_parameters()}
        return from_gpt2_names(tensors, self.config)

    @staticmethod
    def _gpt2_name(name):
        return name.removeprefix("transformer.")

    @staticmethod
    def _transposed(name):
        """nn.Linear's weights are [out, in]; GPT-2's (and nanoandrea's) are [in, out]."""
        return name.endswith(".weight") and any(layer in name for layer in LINEAR_LAYERS)
