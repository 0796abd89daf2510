"""Differentiable ops: each runs its forward on the tensors' backend and records its backward.

Every function here has the same shape: allocate the output, call the backend's forward,
then `record(output, inputs, backward)` with a closure that calls the backend's backward
kernels. `grad_slot(t)` says where t's gradient goes and whether to add to it.
`schedule.on_second_stream` marks work that may run on a second stream in a captured step (the weight
gradients; a layer's K and V products): without one it runs where it stands.
Shapes: B batch, T time, C width, H heads, D = C/H head size, V vocabulary, N = B*T.
"""
from contextlib import contextmanager

import numpy as np

from . import schedule
from .autograd import (Tensor, grad_out_of_place, grad_enabled, grad_slot, record, share_grad,
                       summed_grad)
from .batch import TokenBatch


def _new(like, shape, dtype=None):
    return Tensor(like.backend.empty(shape, dtype), like.backend)


_fixed_operands = {}    # id(weight Tensor) -> its operand, while fixed_weights holds


@contextmanager
def fixed_weights(weights):
    """For a block in which the parameter Tensors `weights` do not change (sampling): each
    weight's operand (backend.operand: in tf32 a rounded copy) is made once, here, and every
    linear inside reads it instead of rounding the weight again at each forward. (A weight
    whose copy the parameter store keeps, its data_operand, in bf16, needs none made.) Yields
    the copies made: a CUDA graph captured inside reads them, and whoever keeps the graph keeps
    them. The copies go with the block, so a change to the weights after it (an optimizer
    step) is seen by the next one."""
    global _fixed_operands
    operands = {id(w): w.backend.operand(w.data) for w in weights if w.data_operand is None}
    previous, _fixed_operands = _fixed_operands, {**_fixed_operands, **operands}
    try:
        yield operands
    finally:
        _fixed_operands = previous


def weight_operand(weight):
    """weight as the backend's products read it: the copy the parameter store keeps of it
    (data_operand; in bf16 AdamW writes it as it writes the weight, params.py), else
    fixed_weights' copy, else made now (backend.operand: in bf16 and tf32 a rounding pass)."""
    if weight.data_operand is not None:
        return weight.data_operand
    fixed = _fixed_operands.get(id(weight))
    return fixed if fixed is not None else weight.backend.operand(weight.data)


def takes_matvec(x, weight, transpose_weight=False):
    """Whether x[..., K] . weight is a product of few rows without gradients (a sampled
    token's linear layers): then kernels/matvec.py reads each weight once, where the tile
    kernels would spend a 128-row tile on a few rows."""
    if grad_enabled():          # (first: x.data of an OperandTensor would be made)
        return False
    return x.backend.takes_matvec(x.data.reshape(-1, x.shape[-1]), weight.data, transpose_weight)


def linear(x, weight, bias=None, transpose_weight=False, activation=None, x_operand=None,
           x_grad=None, out_operand=False):
    """x[..., K] . weight[K, N] + bias[N]  (weight[N, K] transposed when transpose_weight).
    activation="gelu": gelu of that (the MLP's first layer), computed in the matmul's epilogue
    and recorded as two ops, the linear layer then GELU: returns a GeluOutput.
    The products read their operands as the backend's matmul takes them (`backend.operand`:
    in bf16 rounded once, here, and the same copies in backward; the weight's, in bf16, the
    copy AdamW wrote: weight_operand); x_operand: x's rows so made already (linears).
    x_grad: an InputGradient that makes dX (linears' products of one x); backward hands it
    its pair (dY, W) instead. A product of few rows without gradients runs
    as matvec (takes_matvec), which rounds x's values itself as it reads them. out_operand: y
    is written as the op after it reads it (in bf16 a Bf16Matrix, an OperandTensor: the
    logits, which the loss reads in bf16 as autocast's are)."""
    backend = x.backend
    K = x.shape[-1]
    N = weight.shape[0] if transpose_weight else weight.shape[1]
    w = weight_operand(weight)
    if activation not in (None, "gelu"):
        raise ValueError(f"linear: unknown activation {activation!r}")
    if x_operand is None:
        x_operand = getattr(x, "operand", None)     # (bf16: written so: an OperandTensor)
    matvec = x_operand is None and takes_matvec(x, weight, transpose_weight)
    y = None                                                        # x . W + b
    if activation is None and out_operand:
        y = OperandTensor(backend, x.shape[:-1] + (N,), backend.precision == "bf16" and not matvec)
    elif activation is None:
        y = _new(x, x.shape[:-1] + (N,))
    g = None                                                       # gelu(y), the same kernel
    if activation == "gelu":
        # in bf16 the pre-activation and GELU's output are written only as the products read
        # them (OperandTensor's): half float32's bytes, and no rounding pass after
        in_bf16 = backend.precision == "bf16" and not matvec
        y = OperandTensor(backend, x.shape[:-1] + (N,), in_bf16)
        g = GeluOutput(y, in_bf16)
    if matvec:
        backend.matvec(y.data.reshape(-1, N), x.data.reshape(-1, K), w,
                       None if bias is None else bias.data, transpose_b=transpose_weight,
                       gelu_out=None if g is None else g.data.reshape(-1, N))
        return y if g is None else g            # (no gradients: nothing to record)
    rows = x_operand if x_operand is not None else backend.operand(x.data.reshape(-1, K))
    backend.matmul(_written(y, N), rows, w, None if bias is None else bias.data,
                   transpose_b=transpose_weight, gelu_out=None if g is None else _written(g, N))
    # dX = dY . W^T reads W^T: where the product would copy it, the copy is made now, beside
    # the forward (schedule.transposed_weight), so that backward starts dX's product at once
    needs_dx = grad_enabled() and x.requires_grad and not transpose_weight
    weight_t = schedule.transposed_weight(backend, w, rows.shape[0]) if needs_dx else None

    def backward():
        # (before `on_second_stream`: both products read dY's operand)
        dy, dy_operand = _rows_and_operand(y, N, backend)
        with schedule.on_second_stream(weight, bias):     # nothing below needs dW and db
            if weight.requires_grad:
                dw, accumulate = grad_slot(weight)
                if transpose_weight:                                # dW[N,K] = dY^T . X
                    backend.matmul(dw, dy_operand, rows, transpose_a=True,
                                   accumulate=accumulate)
                else:                                               # dW[K,N] = X^T . dY
                    backend.matmul(dw, rows, dy_operand, transpose_a=True,
                                   accumulate=accumulate)
            if bias is not None and bias.requires_grad:             # db = sum of dY's rows
                db, accumulate = grad_slot(bias)
                # (bf16: the rows as the products read them, half the bytes of float32's; the
                # sums float32, as autocast's bias gradient is of its bf16 dY)
                rows_summed = dy_operand if dy is None or backend.precision == "bf16" else dy
                backend.sum_rows(db, rows_summed, accumulate=accumulate)
        if not x.requires_grad:
            return
        product = dict(transpose_b=not transpose_weight, b_transposed=weight_t)
        if x_grad is not None:                      # dX += dY . W^T, summed with the others
            x_grad.add(dy_operand, w, weight_t)
            return
        if not isinstance(x, GeluOutput):                           # dX = dY . W^T
            dx, accumulate = grad_slot(x)
            backend.matmul(dx.reshape(-1, K), dy_operand, w, accumulate=accumulate, **product)
            return
        # x = gelu(pre): d(pre) = (dY . W^T) * gelu'(pre), GELU's backward in the epilogue
        pre = x.pre
        if pre.operand is not None and pre.grad is None:
            # bf16: d(pre) written as the MLP's first products read it, half float32's bytes
            pre.grad = backend.new_operand(pre.operand.shape)
            backend.matmul(pre.grad, dy_operand, w, gelu_input=pre.operand, **product)
            return
        dx, accumulate = grad_slot(pre)
        backend.matmul(dx.reshape(-1, K), dy_operand, w, accumulate=accumulate,
                       gelu_input=pre.data.reshape(-1, K), **product)

    inputs = [x, weight] + ([bias] if bias is not None else [])
    y = record(y, inputs, backward)
    return y if g is None else record(g, [y], _gelu_backward(g, y))


def _written(t, N):
    """Where a product writes tensor t [..., N]: its operand (an OperandTensor in bf16), else
    its float32 rows."""
    operand = getattr(t, "operand", None)
    return operand if operand is not None else t.data.reshape(-1, N)


def _rows_and_operand(t, N, backend):
    """t's gradient as float32 rows [R, N] and as the products read it: its grad_operand where
    its writer made one (bf16: layer norm's backward, of the residual stream), else
    backend.operand's. A gradient that arrives as the operand alone (bf16: the loss's of the
    logits, the MLP's of its pre-activation, attention's of q, k, v) has no float32 rows: None
    (sum_rows reads the operand)."""
    grad = t.grad
    if hasattr(grad, "bf16_pairs"):
        return None, grad
    rows = grad.reshape(-1, N)
    return rows, t.grad_operand if t.grad_operand is not None else backend.operand(rows)


def linears(x, *weights_and_biases, heads=None):
    """[linear(x, w, b) for each (w, b)]: products of one input, independent of each other
    (x's operand made once, for all); heads=H: each then split into H heads (split_heads). In
    a captured step all but the first run beside it on the second stream, joined before this
    returns (schedule.py): the grids' last waves overlap, and their splits (memory-bound
    copies) the first product (compute-bound). (Recorded last to first.) Products of few
    rows (takes_matvec) make no operand of x: matvec reads x itself. Backward: x's gradient
    is the sum of what each product sends back, dX = sum of dY_j . W_j^T, one call of
    backend.matmul_sum once all are in (InputGradient)."""
    rows = getattr(x, "operand", None)              # (bf16: written so: an OperandTensor)
    if rows is None and not takes_matvec(x, weights_and_biases[0][0]):
        rows = x.backend.operand(x.data.reshape(-1, x.shape[-1]))
    x_grad = InputGradient(x)
    # in bf16 training on the wgmma attention, each product writes its heads in bf16, side by
    # side in its rows, where attention reads them: no pass rounds or splits them
    in_rows = (heads is not None and grad_enabled()
               and x.backend.attention_reads_heads_in_rows(weights_and_biases[0][0].shape[1]
                                                           // heads))

    def product(w, b):
        y = linear(x, w, b, x_operand=rows, x_grad=x_grad, out_operand=in_rows)
        return y if heads is None else split_heads(y, heads, sole_reader=True)

    (w, b), rest = weights_and_biases[0], weights_and_biases[1:]
    with schedule.on_second_stream():
        others = [product(*pair) for pair in rest]
    first = product(w, b)
    schedule.join()
    return [first, *others]


class InputGradient(Tensor):
    """The gradient of x that several linear layers of x send back (linears'), as the pairs
    (dY_j, W_j) of its products: each layer's backward adds its pair (`add`), and this node,
    recorded before those layers, so run after them all, makes dX = sum of dY_j . W_j^T in one
    call (backend.matmul_sum). Its `grad` is the list of pairs: None until one arrives, and a
    node whose output has no gradient does not run."""
    __slots__ = ("x", "transposed")

    def __init__(self, x):
        super().__init__(None, x.backend)
        self.x, self.transposed = x, []
        record(self, [x], self.backward)

    def add(self, dy, w, w_transposed):
        self.grad = (self.grad or []) + [(dy, w)]
        self.transposed.append(w_transposed)

    def backward(self):
        dx, accumulate = grad_slot(self.x)
        transposed = None if all(t is None for t in self.transposed) else self.transposed
        self.backend.matmul_sum(dx.reshape(-1, self.x.shape[-1]), self.grad, transpose_b=True,
                                accumulate=accumulate, b_transposed=transposed)


def _values_of(backend, operand, shape):
    """A new float32 array of `shape` holding a Bf16Matrix operand's values."""
    values = backend.empty(shape)
    backend.bf16_values(values.reshape(operand.shape), operand)
    return values


class OperandTensor(Tensor):
    """A tensor [..., N] that a product writes as the next products read it: `operand`, in
    bf16 a Bf16Matrix [R, N] (half float32's bytes, and no rounding pass after); or, in_bf16
    False, float32 `data` as any tensor. Its float32 values are made if something reads
    `data` after all (backend.bf16_values)."""
    __slots__ = ("operand", "_shape", "_values")

    def __init__(self, backend, shape, in_bf16):
        self._shape = tuple(shape)
        super().__init__(None if in_bf16 else backend.empty(shape), backend)
        rows = int(np.prod(shape[:-1]))
        self.operand = backend.new_operand((rows, shape[-1])) if in_bf16 else None

    @property
    def shape(self):
        return self._shape

    @property
    def data(self):
        if self._values is None:
            self._values = _values_of(self.backend, self.operand, self.shape)
        return self._values

    @data.setter
    def data(self, value):
        self._values = value


class GeluOutput(OperandTensor):
    """gelu(pre) from linear(activation="gelu"), which keeps `pre`, the Tensor of the
    pre-activation (an OperandTensor too): the linear layer that takes this tensor as its input
    (the MLP's W_proj) writes pre's gradient itself, GELU's backward in its dX product's
    epilogue (in bf16 as the MLP's first products read it), and no gradient of this tensor is
    made. GELU's own backward then runs only if one reaches it from another use (gradients
    add, and gelu' is linear in them, so either order is exact)."""
    __slots__ = ("pre",)

    def __init__(self, pre, in_bf16):
        self.pre = pre
        super().__init__(pre.backend, pre.shape, in_bf16)


class SplitHeads(Tensor):
    """split_heads' output [B,H,T,D], which keeps `fused`, the [B,T,C] Tensor it was split from.
    Its copy is made when its data is first read (`data`): the bf16 attention rounds the heads
    straight from fused (a heads_view of it, _heads_operand), so in bf16 training the float32
    copy is never made. A backward that writes this tensor's gradient through a heads_view of
    fused's writes the merged gradient straight away (attention does), and split's own backward
    then finds no gradient of this tensor to merge. sole_reader: nothing else reads fused (a
    product's output split at once: linears' heads), so its gradient is this one's alone."""
    __slots__ = ("fused", "n_head", "_heads", "sole_reader")

    def __init__(self, fused, n_head, sole_reader=False):
        self.fused, self.n_head, self._heads = fused, n_head, None
        self.sole_reader = sole_reader
        super().__init__(None, fused.backend)

    @property
    def shape(self):
        B, T, C = self.fused.shape
        return B, self.n_head, T, C // self.n_head

    def split(self):
        """The float32 heads, copied from fused at the first call."""
        if self._heads is None:
            self._heads = self.backend.empty(self.shape)
            self.backend.split_heads(self._heads, self.fused.data)
        return self._heads

    @property
    def data(self):
        return self.split()

    @data.setter
    def data(self, value):          # (Tensor.__init__'s None: not split yet)
        self._heads = value


class HeadsInConcat(Tensor):
    """attention's output [B,H,T,D]: a heads_view of `concat`, a [B,T,C] array, so the heads are
    already side by side there and merge_heads copies nothing. in_bf16: attention writes the
    concat's bf16 copy too, `operand` (a Bf16Matrix [B*T, C]), as the product after it (W_O)
    reads it: no rounding pass."""
    __slots__ = ("concat", "operand")

    def __init__(self, backend, shape, in_bf16=False):
        B, H, T, D = shape
        self.concat = backend.empty((B, T, H * D))
        self.operand = backend.new_operand((B * T, H * D)) if in_bf16 else None
        super().__init__(backend.heads_view(self.concat, H), backend)


class MergedHeads(Tensor):
    """merge_heads' output of attention's concat: its float32 `data`, and `operand`, the bf16
    copy attention wrote too, which the next product reads (linear's x_operand; None where
    attention wrote none)."""
    __slots__ = ("operand",)

    def __init__(self, heads):
        self.operand = heads.operand
        super().__init__(heads.concat, heads.backend)


def split_heads(x, n_head, sole_reader=False):
    """[B,T,C] -> [B,H,T,D]: each head's T x D slice contiguous. The copy is made here unless
    the backend's attention rounds these heads straight from x (bf16 on the tensor cores: then
    only a reader of the float32 heads, the sampling's key/value cache, makes it), or reads
    them in place from x's bf16 rows (x an OperandTensor in bf16: linears' heads on the wgmma
    attention). sole_reader: nothing else reads x (SplitHeads')."""
    out = SplitHeads(x, n_head, sole_reader)
    in_rows = getattr(x, "operand", None) is not None   # (bf16 rows attention reads in place)
    if not in_rows and not x.backend.attention_rounds(x.backend.heads_view(x.data, n_head)):
        out.split()

    def backward():
        dx, accumulate = grad_slot(x)
        x.backend.merge_heads(dx, out.grad, accumulate=accumulate)

    return record(out, [x], backward)


def merge_heads(x):
    """[B,H,T,D] -> [B,T,C]: the heads side by side (their concatenation). For attention's
    output they already are: its [B,T,C] array, no copy, and backward hands out the gradient as
    a view of this one's."""
    B, H, T, D = x.shape
    if isinstance(x, HeadsInConcat):
        out = MergedHeads(x)
    else:
        out = _new(x, (B, T, H * D))
        x.backend.merge_heads(out.data, x.data)

    def backward():
        if isinstance(x, HeadsInConcat) and x.grad is None:
            share_grad(x, x.backend.heads_view(out.grad, H))
            return
        dx, accumulate = grad_slot(x)
        x.backend.split_heads(dx, out.grad, accumulate=accumulate)

    return record(out, [x], backward)


def _heads_grad_slot(t):
    """grad_slot for a [B,H,T,D] tensor: split_heads' output gets a view of its fused tensor's
    gradient when both are still to come (merging the heads is then the writer's store)."""
    if _fused_grad_to_come(t):
        dx, accumulate = grad_slot(t.fused)
        return t.backend.heads_view(dx, t.shape[1]), accumulate
    return grad_slot(t)


def _fused_grad_to_come(t):
    return (isinstance(t, SplitHeads) and t.grad is None and t.fused.grad is None
            and t.fused.requires_grad)


def _heads_grad_slots(q, k, v):
    """Where attention's backward writes the gradients of q, k, v: [(buffer, accumulate)] * 3.
    In bf16, where attention rounded all three straight from their fused tensors (three
    products' outputs, whose gradients only the backward's products read), each fused
    tensor's gradient is a Bf16Matrix that the attention writes in bf16 through a heads view
    (no float32 copy, and no rounding pass after); else _heads_grad_slot's."""
    heads = (q, k, v)
    if (len({id(t) for t in heads}) == 3 and all(_fused_grad_to_come(t) and t.sole_reader
                                                  and t._heads is None for t in heads)):
        # (_heads None: not split, attention rounds them (attention_rounds))
        slots = []
        for t in heads:
            B, H, T, D = t.shape
            t.fused.grad = t.backend.new_operand((B * T, H * D))
            slots.append((t.backend.bf16_heads_view(t.fused.grad, B, H), False))
        return slots
    return [_heads_grad_slot(t) for t in heads]


def _heads_operand(t):
    """q, k or v as the backend's attention reads it (backend.heads_operand): in bf16 the heads
    of split_heads are rounded straight from its fused tensor, a heads_view of it, or, where
    the product wrote that tensor in bf16, are a heads view of its bf16 rows (no pass)."""
    if isinstance(t, SplitHeads) and t._heads is None:     # (not split: attention_rounds)
        rows = getattr(t.fused, "operand", None)
        if rows is not None:            # (a product's bf16 rows: the heads read in place)
            return t.backend.bf16_heads_view(rows, t.shape[0], t.n_head)
        return t.backend.heads_operand(t.backend.heads_view(t.fused.data, t.n_head))
    return t.backend.heads_operand(t.data)


def attention(q, k, v, dropout_p=0.0, seed=None, site=0):
    """Causal softmax attention, all (batch, head) pairs in one launch. q, k, v: [B,H,T,D].
    dropout_p > 0 drops attention probabilities (masks from seed, an int64[1], and site).
    The output is written into the heads' concat (HeadsInConcat), and where q, k, v come from
    split_heads their gradients are written into their fused tensors' (_heads_grad_slot)."""
    backend = q.backend
    B, H, T, D = q.shape
    lse = backend.empty((B, H, T))
    drop = dict(dropout_p=dropout_p, seed=seed, site=site)
    operands = [_heads_operand(t) for t in (q, k, v)]     # (bf16: rounded once, for both)
    # in training, out's bf16 copy for W_O's products, written by the same kernel
    in_bf16 = grad_enabled() and backend.attention_writes_bf16_out(*operands)
    out = HeadsInConcat(backend, q.shape, in_bf16)
    copy = dict(out_bf16=backend.bf16_heads_view(out.operand, B, H)) if in_bf16 else {}
    backend.attention_forward(out.data, lse, *operands, **drop, **copy)

    def backward():
        (dq, acc_q), (dk, acc_k), (dv, acc_v) = _heads_grad_slots(q, k, v)
        if not (acc_q == acc_k == acc_v):
            raise NotImplementedError("attention backward: q, k, v gradients must all be new")
        delta = backend.empty((B, H, T))
        backend.attention_backward(dq, dk, dv, delta, out.grad, *operands, out.data, lse,
                                   accumulate=acc_q, **drop)

    return record(out, [q, k, v], backward)


def _normalized(x):
    """The output of a layer norm of x: an OperandTensor, which in bf16 training is written
    only as the products after it read it (layer norm's backward reads x, not its output)."""
    in_bf16 = x.backend.precision == "bf16" and grad_enabled()
    return OperandTensor(x.backend, x.shape, in_bf16)


def layernorm(x, weight, bias):
    """Layer norm over the last axis of x[..., C]."""
    backend = x.backend
    C = x.shape[-1]
    out = _normalized(x)
    mean, rstd = _row_stats(x)
    backend.layernorm_forward(_written(out, C), mean, rstd, x.data.reshape(-1, C),
                              weight.data, bias.data)
    return record(out, [x, weight, bias], _layernorm_backward(out, x, weight, bias, mean, rstd))


def _row_stats(x):
    """Empty mean and rstd buffers, one value per row of x[..., C]."""
    rows = x.data.size // x.shape[-1]
    return x.backend.empty((rows,)), x.backend.empty((rows,))


def _layernorm_backward(out, x, weight, bias, mean, rstd):
    C = x.shape[-1]

    def backward():
        dx, prior = grad_out_of_place(x)                   # (prior: another gradient of x, to add)
        # bf16: x's gradient also as the products read it (x is the residual stream: its
        # gradient is that of the W_O or W_proj product before it, or the embedding's)
        operand = x.backend.new_operand(dx.reshape(-1, C).shape) if (
            x.backend.precision == "bf16") else None
        x.backend.layernorm_backward(dx.reshape(-1, C), summed_grad(weight), summed_grad(bias),
                                     out.grad.reshape(-1, C), x.data.reshape(-1, C),
                                     weight.data, mean, rstd, accumulate=prior is not None,
                                     prior=None if prior is None else prior.reshape(-1, C),
                                     dx_bf16=operand)
        x.grad_operand = operand

    return backward


def gelu(x):
    out = _new(x, x.shape)
    x.backend.gelu_forward(out.data, x.data)
    return record(out, [x], _gelu_backward(out, x))


def _gelu_backward(out, x):
    def backward():
        if hasattr(x.grad, "bf16_pairs"):       # (pre's gradient in bf16, from W_proj: as
            x.grad = _values_of(x.backend, x.grad, x.shape)     # float32, to add this one to)
        dx, accumulate = grad_slot(x)
        x.backend.gelu_backward(dx, out.grad, x.data, accumulate=accumulate)

    return backward


def add(a, b):
    """The residual add: a + b (same shapes)."""
    out = _new(a, a.shape)
    a.backend.add(out.data, a.data, b.data)
    return record(out, [a, b], _add_backward(out, a, b))


def _add_backward(out, a, b):
    # d(a + b) passes out.grad on to both unchanged: an input with no gradient yet takes
    # out.grad's buffer itself (final here; shared, so never added to in place: see
    # autograd.share_grad), the others add it in.
    def backward():
        for t in (a, b):
            if not t.requires_grad:
                continue
            if t.grad is None:
                share_grad(t, out.grad, out.grad_operand)
            else:
                dt, accumulate = grad_slot(t)
                t.backend.add_into(dt, out.grad, accumulate=accumulate)

    return backward


def add_layernorm(a, b, weight, bias):
    """(x, h) = (a + b, layernorm(a + b)): the residual add and the layer norm after it, one
    fused kernel forward. Recorded as add then layernorm, so backward is exactly theirs."""
    C = a.shape[-1]
    x, h = _new(a, a.shape), _normalized(a)
    mean, rstd = _row_stats(x)
    a.backend.residual_layernorm_forward(x.data.reshape(-1, C), _written(h, C), mean, rstd,
                                         a.data.reshape(-1, C), b.data.reshape(-1, C),
                                         weight.data, bias.data)
    x = record(x, [a, b], _add_backward(x, a, b))
    return x, record(h, [x, weight, bias], _layernorm_backward(h, x, weight, bias, mean, rstd))


def dropout(x, p, seed, site):
    """Zero each element with probability p, scale the rest by 1/(1-p). seed: int64[1] on the
    backend (changed every step); site: this dropout's number in the model."""
    if p == 0.0:
        return x
    out = _new(x, x.shape)
    x.backend.dropout_forward(out.data, x.data, p, seed, site)

    def backward():
        dx, accumulate = grad_slot(x)
        x.backend.dropout_backward(dx, out.grad, p, seed, site, accumulate=accumulate)

    return record(out, [x], backward)


def embedding(batch, wte, wpe):
    """Token + position embedding of a TokenBatch (nanoandrea.batch; or host ids [B,T]):
    wte [V,C], wpe [block,C] (or the rows of it from the tokens' first position on: sampling
    with a key/value cache)."""
    backend = wte.backend
    if not isinstance(batch, TokenBatch):
        batch = TokenBatch.from_host(backend, batch, vocab_size=wte.shape[0])
    B, T = batch.shape
    out = _new(wte, (B, T, wte.shape[1]))
    backend.embedding_forward(out.data, batch.idx, wte.data, wpe.data)
    if batch.order is None and grad_enabled() and (wte.requires_grad or wpe.requires_grad):
        raise ValueError("embedding: the batch was made without the grouping backward needs")

    def backward():
        backend.embedding_backward(summed_grad(wte), summed_grad(wpe), out.grad, batch.idx,
                                   batch.order, batch.starts)

    return record(out, [wte, wpe], backward)


def cross_entropy(logits, targets, loss_grad=None, vocab=None):
    """Mean softmax cross-entropy of logits[..., Vp] against int32 targets on the backend (a
    TokenBatch's, or host ids [...]). vocab: the classes are the first `vocab` columns, the
    rest padding (the model's padded vocabulary); None: all Vp. loss_grad: the gradient
    backward will be given (a [1] array); then the gradient of the logits is computed now, in
    the same pass."""
    backend = logits.backend
    V = logits.shape[-1]
    rows = getattr(logits, "operand", None)         # (bf16 logits: a Bf16Matrix [N, Vp])
    if rows is None:
        rows = logits.data.reshape(-1, V)                             # [N, Vp]
    N = rows.shape[0]
    if isinstance(targets, np.ndarray):
        targets = backend.to_device(targets.reshape(N), np.int32)
    loss = _new(logits, (1,))
    losses = backend.empty((N,))
    lse = backend.empty((N,))
    if loss_grad is not None and grad_enabled() and logits.requires_grad:
        # in bf16 the gradient is written only as the LM head's products read it (a Bf16Matrix
        # [N, Vp]: the same bits a rounding of the float32 one would give, half its bytes)
        in_bf16 = backend.precision == "bf16"
        dlogits = backend.new_operand((N, V)) if in_bf16 else backend.empty((N, V))
        backend.crossentropy_forward_backward(loss.data, losses, lse, dlogits, rows, targets,
                                              loss_grad, vocab)

        def backward():
            if loss.grad is not loss_grad:
                raise ValueError("cross_entropy: backward got another gradient than loss_grad")
            if logits.grad is None:
                logits.grad = dlogits if in_bf16 else dlogits.reshape(logits.shape)
                return
            values = _values_of(backend, dlogits, (N, V)) if in_bf16 else dlogits
            backend.add_into(logits.grad, values.reshape(logits.shape), accumulate=True)
    else:
        backend.crossentropy_forward(loss.data, losses, lse, rows, targets, vocab)

        def backward():
            dlogits, accumulate = grad_slot(logits)
            backend.crossentropy_backward(dlogits.reshape(-1, V), loss.grad,
                                          logits.data.reshape(-1, V), lse, targets,
                                          accumulate=accumulate, vocab=vocab)

    return record(loss, [logits], backward)
