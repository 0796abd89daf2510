"""Parameters, gradients and AdamW state in ONE flat buffer, with named views into it.

    buffer[0] params   buffer[1] grads   buffer[2] m   buffer[3] v        buffer: [4, P]

(Under ZeRO-1, optim.ShardedAdamW, each rank keeps m and v for its shard only: the buffer is
then [2, P], and m and v are None.)

(P is the parameter count rounded up: every view starts on a 16-byte boundary.)

Each parameter is a Tensor whose data is a view params[offset:offset+n].reshape(shape) and whose
grad is the same view of grads. So zeroing every gradient is one fill, AdamW is one kernel over
P numbers, and a checkpoint is one array. The 2-D weight matrices come first (the first
n_decay entries): they are the ones AdamW decays.

In bf16 training the products read each matrix as a Bf16Matrix (kernels/operands.py), and the
store keeps those copies too, in one more flat buffer beside the weights:

    bf16_copies  uint16 [n_decay]   bf16_copies[i] = params[i] rounded to bf16, for the matrices

Every matrix's rows are whole 16-byte runs of bf16 (its width a multiple of 8, as n_embd is in
every preset), so its size is a multiple of 8 and, the matrices coming first, each starts a
multiple of 8 floats into the buffer: a matrix's copy is a view of bf16_copies in the
Bf16Matrix's own layout (its pairs, no pad, 16-byte aligned), and parameter i's bf16 lies at
index i (AdamW's thread of parameter i writes it). Who writes them: AdamW, in the pass that
writes the weights (kernels/adamw.py), and `round_bf16_copies` where anything else writes the
weights (load_flat; under ZeRO-1 the all-gather of the other ranks' shards, optim.py). Each
matrix Tensor's `data_operand` is its copy: the products read it (ops.weight_operand), and no
step rounds a weight. In fp32 and tf32, or where a width is not a multiple of 8, there are
none (bf16_copies is empty, data_operand None) and the products round the weights themselves
(backend.operand).

Names follow GPT-2 where GPT-2 has the same tensor (wte, wpe, h.{i}.ln_1, h.{i}.mlp.c_fc, ...).
Attention keeps four matrices: h.{i}.attn.w_q, w_k, w_v, w_o (each [C, C], all heads
side by side) with biases b_q, b_k, b_v, b_o; GPT-2's c_attn is [w_q | w_k | w_v].
"""
from dataclasses import dataclass
import math

import numpy as np

from .autograd import Tensor
from .kernels.operands import Bf16Matrix


ALIGN = 4            # floats: 16 bytes, what a vector load (ptx/vector.py) needs


def aligned(n):
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class ParamSpec:
    name: str
    shape: tuple
    decay: bool          # AdamW weight decay applies
    init: str            # "normal", "residual" (scaled normal), "zeros", "ones"
    stored_rows: int = None   # rows kept in the store when more than shape[0]: the extra rows
                              # are padding, zero, outside the model's function (wte: Vp rows)

    @property
    def stored_shape(self):
        return self.shape if self.stored_rows is None else (self.stored_rows, *self.shape[1:])


def parameter_layout(config):
    """Every parameter of the model, matrices (decayed) first."""
    C, L = config.n_embd, config.n_layer
    matrices = [ParamSpec("wte", (config.vocab_size, C), True, "normal",
                          stored_rows=config.padded_vocab_size)]
    others = [ParamSpec("wpe", (config.block_size, C), False, "normal")]
    for i in range(L):
        h = f"h.{i}."
        for w in ("w_q", "w_k", "w_v"):
            matrices.append(ParamSpec(h + "attn." + w, (C, C), True, "normal"))
        matrices.append(ParamSpec(h + "attn.w_o", (C, C), True, "residual"))
        matrices.append(ParamSpec(h + "mlp.c_fc.weight", (C, 4 * C), True, "normal"))
        matrices.append(ParamSpec(h + "mlp.c_proj.weight", (4 * C, C), True, "residual"))
        others += [ParamSpec(h + "ln_1.weight", (C,), False, "ones"),
                   ParamSpec(h + "ln_1.bias", (C,), False, "zeros")]
        others += [ParamSpec(h + "attn." + b, (C,), False, "zeros")
                   for b in ("b_q", "b_k", "b_v", "b_o")]
        others += [ParamSpec(h + "ln_2.weight", (C,), False, "ones"),
                   ParamSpec(h + "ln_2.bias", (C,), False, "zeros"),
                   ParamSpec(h + "mlp.c_fc.bias", (4 * C,), False, "zeros"),
                   ParamSpec(h + "mlp.c_proj.bias", (C,), False, "zeros")]
    others += [ParamSpec("ln_f.weight", (C,), False, "ones"),
               ParamSpec("ln_f.bias", (C,), False, "zeros")]
    return matrices + others


class ParameterStore:
    def __init__(self, config, backend, moments=True):
        self.config = config
        self.backend = backend
        self.layout = parameter_layout(config)
        self.offsets = {}
        offset = 0
        for spec in self.layout:          # each view starts on a 16-byte boundary (ALIGN floats),
            self.offsets[spec.name] = offset    # so kernels may read it 16 bytes at a time
            offset = aligned(offset + math.prod(spec.stored_shape))
            if spec.decay:
                self.n_decay = offset      # the decayed matrices (and their padding) come first
        self.size = offset                 # padding entries stay 0: no gradient ever moves them
        self.buffer = backend.zeros((4 if moments else 2, self.size))
        self.params, self.grads = self.buffer[0], self.buffer[1]
        self.m, self.v = (self.buffer[2], self.buffer[3]) if moments else (None, None)
        self.tensors = {spec.name: Tensor(self._view(self.params, spec), backend,
                                          requires_grad=True, grad=self._view(self.grads, spec),
                                          name=spec.name)
                        for spec in self.layout}
        # the matrices' bf16 copies (the module's doc), zero as the weights are
        keeps_copies = backend.precision == "bf16" and all(
            spec.stored_shape[1] % 8 == 0 and self.offsets[spec.name] % 8 == 0
            for spec in self.layout if spec.decay)
        self.bf16_copies = backend.zeros((self.n_decay if keeps_copies else 0,), np.uint16)
        for spec in self.layout:
            if spec.decay and keeps_copies:
                self.tensors[spec.name].data_operand = self._bf16_copy(spec)

    @property
    def count(self):
        """The number of parameters: without the alignment gaps and padded rows of the buffer."""
        return sum(math.prod(spec.shape) for spec in self.layout)

    def _view(self, flat, spec):
        start = self.offsets[spec.name]
        return flat[start:start + math.prod(spec.stored_shape)].reshape(spec.stored_shape)

    def _bf16_copy(self, spec):
        """The Bf16Matrix of matrix `spec` in bf16_copies: its pairs [R, C/2]."""
        start, (rows, cols) = self.offsets[spec.name], spec.stored_shape
        pairs = self.bf16_copies.view(np.uint32)[start // 2:(start + rows * cols) // 2]
        return Bf16Matrix(pairs.reshape(rows, cols // 2), cols)

    def round_bf16_copies(self):
        """Make the matrices' bf16 copies from the weights as they are now (where something but
        AdamW wrote them): one rounding pass over all of them, the bits AdamW would write."""
        if self.bf16_copies.size:
            every_matrix = Bf16Matrix(self.bf16_copies.view(np.uint32).reshape(-1, 4), 8)
            self.backend.round_bf16(every_matrix, self.params[:self.n_decay].reshape(-1, 8))

    def __getitem__(self, name):
        return self.tensors[name]

    def __iter__(self):
        return iter(self.tensors)

    def matrices(self):
        """The weight matrices' Tensors (the products' operands: the decayed ones)."""
        return [self.tensors[spec.name] for spec in self.layout if spec.decay]

    def initial_values(self, seed):
        """GPT-2's initialisation as one host array: N(0, 0.02) weights, N(0, 0.02/sqrt(2L)) for
        the two projections that write into the residual stream, zero biases, unit layernorms."""
        rng = np.random.default_rng(seed)
        values = np.zeros(self.size, dtype=np.float32)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for spec in self.layout:
            n = math.prod(spec.shape)               # (the padded rows after these stay 0)
            start = self.offsets[spec.name]
            if spec.init in ("normal", "residual"):
                std = 0.02 if spec.init == "normal" else residual_std
                values[start:start + n] = rng.standard_normal(n, dtype=np.float32) * std
            else:
                values[start:start + n] = 0.0 if spec.init == "zeros" else 1.0
        return values

    def initialize(self, seed):
        self.load_flat(self.initial_values(seed))

    def load_flat(self, values):
        """The weights from a host array [P] (and their bf16 copies made from them)."""
        self.backend.copy_from_host(self.params, values)
        self.round_bf16_copies()

    def zero_grads(self):
        self.backend.fill(self.grads, 0.0)

    def state_dict(self):
        """{name: host array} of the parameters (their own shapes: without padded rows)."""
        return self._host_views(self.params)

    def grad_dict(self):
        """{name: host array} of the gradients, shaped as state_dict()."""
        return self._host_views(self.grads)

    def _host_views(self, flat_device):
        flat = self.backend.to_host(flat_device)
        return {spec.name: flat[self.offsets[spec.name]:
                                self.offsets[spec.name] + math.prod(spec.shape)].reshape(spec.shape)
                for spec in self.layout}

    def load_state_dict(self, arrays):
        missing = [s.name for s in self.layout if s.name not in arrays]
        if missing:
            raise ValueError(f"missing parameters: {', '.join(missing[:5])}")
        flat = np.zeros(self.size, dtype=self.backend.dtype)
        for spec in self.layout:
            value = np.asarray(arrays[spec.name])
            if tuple(value.shape) != tuple(spec.shape):
                raise ValueError(f"{spec.name}: expected shape {spec.shape}, got {value.shape}")
            start = self.offsets[spec.name]
            flat[start:start + value.size] = value.reshape(-1)
        self.load_flat(flat)
