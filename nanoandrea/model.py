"""The ANDREA model: GPT-2's architecture, its attention written as five steps.

    idx [B,T] -> token + position embedding -> n_layer blocks -> final layernorm -> LM head
    block:      x = x + attention(layernorm(x))     x = x + mlp(layernorm(x))     (pre-LN)
                (each residual add runs fused with the layer norm after it: ops.add_layernorm)
    attention:  1. Q, K, V = X.W_Q, X.W_K, X.W_V     three matmuls, each [C,C] holding all heads
                2. split heads                       [B,T,C] -> [B,H,T,D]
                3. attention                         one kernel, every (batch, head) pair
                4. merge heads                       [B,H,T,D] -> [B,T,C], the concat
                5. output projection                 Y.W_O mixes the heads
                (3 writes its output straight into the concat, so 4 copies nothing; backward,
                3 writes the gradients of Q, K, V into their [B,T,C] ones: ops.attention)
    mlp:        gelu(x.W_fc + b) . W_proj + b        width 4C
The LM head is tied to the token embedding: logits = x . wte^T. wte is stored with Vp rows, the
vocabulary padded to a multiple of 64 (config.padded_vocab_size; the extra rows are zero), so
the logits are [B,T,Vp]; the loss and sampling use the first V columns only.
Dropout (training only, probability config.dropout) as GPT-2: after the embedding, on the
attention probabilities, and on each residual branch before it is added.
Sampling passes a key/value cache (sample.KVCache): each layer's K and V are kept, and the
next forward takes only the new tokens, their attention against every cached key
(kernels/kvcache.py) in place of steps 3 and 4.
"""
import numpy as np

from . import ops
from .autograd import Tensor, no_grad
from .backend import get_backend
from .batch import TokenBatch
from .config import GPTConfig
from .params import ParameterStore


class GPT:
    def __init__(self, config: GPTConfig, backend=None, seed=1337, moments=True):
        """seed: GPT-2's initialisation from this seed; None: the parameters are zeros, for a
        model whose weights are loaded next (a checkpoint). moments: whether the parameter
        store holds AdamW's m and v (ZeRO-1 keeps a shard of them elsewhere: params.py)."""
        self.config = config.validate()
        self.backend = backend or get_backend()
        self.params = ParameterStore(self.config, self.backend, moments)
        if seed is not None:
            self.params.initialize(seed)
        self.dropout_seed = self.backend.to_device(np.zeros(1, dtype=np.int64))

    def __getitem__(self, name):
        return self.params[name]

    def set_dropout_seed(self, seed):
        """Dropout masks are a hash of (seed, site, element): set a new seed every step."""
        self.backend.copy_from_host(self.dropout_seed, np.array([seed], dtype=np.int64))

    def forward(self, idx, targets=None, train=False, loss_grad=None, cache=None):
        """idx: a TokenBatch (nanoandrea.batch; its targets, if it has them, give the loss), or
        int arrays [B,T] on the host, idx and targets. Returns (logits [B,T,Vp], loss [1] or
        None): logits[..., :V] are the vocabulary's, the rest padding (see the module's doc).
        loss_grad: the gradient loss.backward will be given, if known (training): the loss
        then computes the logits' gradient in its forward pass. cache (sampling, no
        gradients): idx are the tokens after the cache.length it holds, and it keeps theirs;
        the logits are then the last position's alone, [B,1,Vp] (a prompt's LM head over
        every position would be B x T x Vp of logits no one reads)."""
        if isinstance(idx, TokenBatch):
            batch = idx
        else:
            batch = TokenBatch.from_host(self.backend, idx, targets, self.config.vocab_size)
        B, T = batch.shape
        start = 0 if cache is None else cache.length        # the position of idx[:, 0]
        if start + T > self.config.block_size:
            raise ValueError(f"sequence length {start + T} exceeds the block size "
                             f"{self.config.block_size}")
        p = self.config.dropout if train else 0.0
        wpe = self["wpe"] if cache is None else cache.positions(self["wpe"], T)
        x = ops.embedding(batch, self["wte"], wpe)                            # [B,T,C]
        x = ops.dropout(x, p, self.dropout_seed, site=0)
        normed = ops.layernorm(x, *self.norm("h.0.ln_1"))
        for layer in range(self.config.n_layer):
            x, normed = self.block(x, normed, layer, p, cache)  # normed: ln_f(x) after the last
        if cache is not None:
            cache.length += T
            normed = self.last_position(normed)     # (sampling reads the last logits only)
        # [B,T,Vp]; in bf16 written as the loss reads them, when a loss follows
        logits = ops.linear(normed, self["wte"], transpose_weight=True,
                            out_operand=batch.targets is not None)
        loss = (None if batch.targets is None else
                ops.cross_entropy(logits, batch.targets, loss_grad, self.config.vocab_size))
        return logits, loss

    def last_position(self, x):
        """x [B,T,C] -> its last position's rows, [B,1,C] (contiguous: a product's operand)."""
        B, T, C = x.shape
        if T == 1:
            return x
        last = Tensor(self.backend.empty((B, 1, C)), self.backend)
        for b in range(B):                          # (each row is contiguous, their set is not)
            self.backend.copy(last.data[b], x.data[b, T - 1:T])
        return last

    def block(self, x, normed, layer, p, cache=None):
        """x: the residual stream, normed = ln_1(x). Returns the new x and the layer norm of it
        that comes next (the next block's ln_1, or ln_f after the last block): each residual
        add is one fused kernel with the layer norm that follows it."""
        h = f"h.{layer}."
        site = 1 + 3 * layer            # this layer's dropout sites: site, site + 1, site + 2
        a = self.attention(normed, layer, p, site, cache)
        x, normed = ops.add_layernorm(x, ops.dropout(a, p, self.dropout_seed, site=site + 1),
                                      *self.norm(h + "ln_2"))
        m = self.mlp(normed, layer)
        following = f"h.{layer + 1}.ln_1" if layer + 1 < self.config.n_layer else "ln_f"
        return ops.add_layernorm(x, ops.dropout(m, p, self.dropout_seed, site=site + 2),
                                 *self.norm(following))

    def norm(self, name):
        """(weight, bias) of the layer norm `name`."""
        return self[name + ".weight"], self[name + ".bias"]

    def attention(self, x, layer, p=0.0, site=0, cache=None):
        a = f"h.{layer}.attn."
        H = self.config.n_head
        q, k, v = ops.linears(x, (self[a + "w_q"], self[a + "b_q"]),   # 1. three products, all
                              (self[a + "w_k"], self[a + "b_k"]),   #    heads at once, [B,T,C]
                              (self[a + "w_v"], self[a + "b_v"]),   # 2. each split into heads,
                              heads=H)                              #    [B,H,T,D] (split_heads)
        if cache is not None and cache.length > 0:  # (sampling: the new tokens' queries
            y = cache.attend(layer, q, k, v)        # against every cached key) 3 + 4. [B,T,C]
        else:
            if cache is not None:
                cache.store(layer, k, v)
            y = ops.attention(q, k, v, p, self.dropout_seed, site)            # 3. [B,H,T,D]
            y = ops.merge_heads(y)                                            # 4. [B,T,C]
        return ops.linear(y, self[a + "w_o"], self[a + "b_o"])                # 5. mix the heads

    def mlp(self, x, layer):
        m = f"h.{layer}.mlp."
        x = ops.linear(x, self[m + "c_fc.weight"], self[m + "c_fc.bias"],      # [B,T,4C]
                       activation="gelu")          # gelu(x . W_fc + b), in the matmul's epilogue
        return ops.linear(x, self[m + "c_proj.weight"], self[m + "c_proj.bias"])

    def loss(self, idx, targets):
        """The mean cross-entropy as a float, without gradients (evaluation)."""
        with no_grad():
            _, loss = self.forward(idx, targets)
            return loss.item()
