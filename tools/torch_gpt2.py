"""The GPT-2 a PyTorch user trains (nanoGPT's model.py, written again): the anchor that the
end-to-end targets are stated against, beside nanoandrea.torch_gpt's oracle.

nanoandrea.torch_gpt.TorchGPT takes nanoandrea's parameter names and [in, out] weights so that
the tests can compare gradients on identical weights; it multiplies `y @ W + b` (a product and
an elementwise add), the three projections as three products. A user's model does what
nanoGPT does: nn.Linear (weights [out, in], the bias inside cuBLAS's epilogue), Q, K and V
from one fused [C, 3C] product, the LM head tied to the token embedding. Under bf16 autocast
the two run at different speeds, so tools/bench.py times both and names which is which.

    model = GPT2(config, device="cuda")     # config: nanoandrea.config.GPTConfig
    logits, loss = model(idx, targets)
"""
import math

import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        C = config.n_embd
        self.n_head = config.n_head
        self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.c_attn = nn.Linear(C, 3 * C)           # W_Q, W_K, W_V side by side
        self.c_proj = nn.Linear(C, C)               # W_O
        self.c_fc = nn.Linear(C, 4 * C)
        self.mlp_proj = nn.Linear(4 * C, C)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in (q, k, v))              # (B, H, T, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT2(nn.Module):
    def __init__(self, config, device="cpu"):
        super().__init__()
        V, C = config.padded_vocab_size, config.n_embd
        self.wte = nn.Embedding(V, C)
        self.wpe = nn.Embedding(config.block_size, C)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(C)
        for name, p in self.named_parameters():     # GPT-2's initialisation
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() == 2:
                std = 0.02 / math.sqrt(2 * config.n_layer) if "proj" in name else 0.02
                nn.init.normal_(p, 0.0, std)
        self.to(device)

    def forward(self, idx, targets=None):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe.weight[:T]
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)      # the tied LM head
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))
        return logits, loss
