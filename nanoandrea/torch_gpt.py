"""The same model in PyTorch: the independent oracle of the tests and the baseline of the
benchmark. Needs torch (the `test` extra); nothing else in nanoandrea imports this module.

`TorchGPT` takes nanoandrea's parameter names and shapes (ParameterStore.state_dict()), so the
two models can be run on identical weights and batches and their losses and gradients compared.
Attention goes through torch's scaled_dot_product_attention (is_causal=True).
"""
import math

import torch
import torch.nn.functional as F

from .params import parameter_layout


class TorchGPT(torch.nn.Module):
    def __init__(self, config, state_dict=None, device="cpu", dtype=torch.float32):
        super().__init__()
        self.config = config
        self.params = torch.nn.ParameterDict()
        for spec in parameter_layout(config):
            value = (torch.as_tensor(state_dict[spec.name]) if state_dict is not None
                     else torch.zeros(spec.shape))
            self.params[spec.name.replace(".", "__")] = torch.nn.Parameter(
                value.to(device=device, dtype=dtype).clone())
        if state_dict is None:
            self._init_gpt2()

    def _init_gpt2(self):
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for spec in parameter_layout(self.config):
            p = self.p(spec.name)
            with torch.no_grad():
                if spec.init == "normal":
                    p.normal_(0.0, 0.02)
                elif spec.init == "residual":
                    p.normal_(0.0, residual_std)
                elif spec.init == "ones":
                    p.fill_(1.0)
                else:
                    p.zero_()

    def p(self, name):
        return self.params[name.replace(".", "__")]

    def grads(self):
        """{nanoandrea name: gradient as a numpy array}."""
        return {spec.name: self.p(spec.name).grad.detach().cpu().numpy()
                for spec in parameter_layout(self.config)}

    def forward(self, idx, targets=None, dropout=0.0):
        c = self.config
        B, T = idx.shape
        x = self.p("wte")[idx] + self.p("wpe")[:T]
        x = F.dropout(x, dropout, self.training)
        for i in range(c.n_layer):
            h = f"h.{i}."
            y = F.layer_norm(x, (c.n_embd,), self.p(h + "ln_1.weight"), self.p(h + "ln_1.bias"), 1e-5)
            q, k, v = (y @ self.p(h + f"attn.w_{n}") + self.p(h + f"attn.b_{n}") for n in "qkv")
            q, k, v = (t.view(B, T, c.n_head, c.head_size).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               dropout_p=dropout if self.training else 0.0)
            y = y.transpose(1, 2).reshape(B, T, c.n_embd)
            y = y @ self.p(h + "attn.w_o") + self.p(h + "attn.b_o")
            x = x + F.dropout(y, dropout, self.training)
            y = F.layer_norm(x, (c.n_embd,), self.p(h + "ln_2.weight"), self.p(h + "ln_2.bias"), 1e-5)
            y = F.gelu(y @ self.p(h + "mlp.c_fc.weight") + self.p(h + "mlp.c_fc.bias"), approximate="tanh")
            y = y @ self.p(h + "mlp.c_proj.weight") + self.p(h + "mlp.c_proj.bias")
            x = x + F.dropout(y, dropout, self.training)
        x = F.layer_norm(x, (c.n_embd,), self.p("ln_f.weight"), self.p("ln_f.bias"), 1e-5)
        logits = x @ self.p("wte").t()
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(B * T, -1), targets.reshape(B * T))
        return logits, loss
