"""A tape autograd at tensor granularity, micrograd's idea with one node per op.

A Tensor holds `data` (a device array or an ndarray, as its backend says), `grad` (None until a
gradient reaches it) and `requires_grad`. Every differentiable op (nanoandrea.ops) computes its
output and, when gradients are on, appends one closure to the tape that, given output.grad,
writes its inputs' gradients. `loss.backward()` walks the tape in reverse.

Gradients are written by the backward kernels themselves, in one of two modes: the first
gradient to reach a tensor is written (=), later ones are added (+=) - that is how the residual
stream, used by two branches, sums its gradients (`grad_slot` says which). Parameters'
gradients are views into the flat gradient buffer, zeroed once per step, so they are always
added to (`summed_grad`; which also makes gradient accumulation over micro-batches free).

An op may hand its output's gradient on as an input's without a copy (`share_grad`: the residual
add passes it to both its inputs), with its `grad_operand` if it has one: the same gradient as
products read it (in bf16 a Bf16Matrix), written by the kernel that wrote the gradient (layer
norm's backward), so that no rounding pass makes it again. A gradient written again (+= or a
new buffer) loses its operand. A shared buffer is then never added to in place (that would
change the other tensor's gradient too): a later gradient of that tensor goes to a new buffer,
the old one added in (`grad_out_of_place`: by the kernel that makes it, as layer norm's backward
does; `grad_slot`: a copy first).

A gradient may still be in the making when the tape moves on (written on another stream:
nanoandrea/schedule.py); its tensor's `grad_ready` is then a function that waits for it, called
before the gradient is touched again.

Data-parallel training averages the parameters' gradients while backward goes on: `recorded()`
lists each node's inputs, and `backward(after_node=...)` calls a function with a node's inputs
once the node has run, so it can tell when a parameter's last gradient has been written.
"""
from contextlib import contextmanager

_tape = []                      # (output, backward closure, inputs), in forward order
_grad_enabled = True


class Tensor:
    __slots__ = ("data", "backend", "grad", "requires_grad", "name", "grad_ready", "shared",
                 "grad_operand", "data_operand")

    def __init__(self, data, backend, requires_grad=False, grad=None, name=None):
        self.data = data
        self.backend = backend
        self.requires_grad = requires_grad
        self.grad = grad
        self.name = name
        self.grad_ready = None      # a function to call before using grad, while it is written
        self.shared = False         # grad is another tensor's gradient too (share_grad)
        self.grad_operand = None    # grad as the products read it, where its writer made it
        self.data_operand = None    # data as the products read it, where it is kept so (a
                                    # weight's bf16 copy in the parameter store: params.py)

    @property
    def shape(self):
        return tuple(self.data.shape)

    def numpy(self):
        return self.backend.to_host(self.data)

    def item(self):
        return float(self.numpy().reshape(-1)[0])

    def backward(self, grad=None, after_node=None):
        """Backpropagate through everything on the tape, from this tensor with gradient `grad`
        (a backend array of this shape; default: ones, as for a scalar loss); after_node, if
        given, is called with each node's inputs once the node is done."""
        if grad is None:
            grad = self.backend.empty(self.shape)
            self.backend.fill(grad, 1.0)
        self.grad = grad
        for output, backward, inputs in reversed(_tape):
            if output.grad is not None:
                backward()
            if after_node is not None:
                after_node(inputs)
        _tape.clear()

    def __repr__(self):
        return f"Tensor({self.name or ''}{list(self.shape)}, {self.backend.name})"


def record(output, inputs, backward):
    """Called by an op: output depends on inputs through `backward` (a closure)."""
    if _grad_enabled and any(t.requires_grad for t in inputs):
        output.requires_grad = True
        _tape.append((output, backward, inputs))
    return output


def recorded():
    """The inputs of every node on the tape, in forward order."""
    return [inputs for _, _, inputs in _tape]


def _ready(tensor):
    if tensor.grad_ready is not None:
        tensor.grad_ready()
        tensor.grad_ready = None


def share_grad(tensor, buffer, operand=None):
    """tensor's gradient is `buffer`, another tensor's (final) gradient: no copy (and operand,
    that one's grad_operand)."""
    tensor.grad = buffer
    tensor.shared = True
    tensor.grad_operand = operand


def grad_out_of_place(tensor):
    """(buffer, prior) for a kernel that writes buffer = prior + its gradient of tensor: prior
    None for the first gradient to reach it; buffer is prior itself unless prior is shared."""
    _ready(tensor)
    prior = tensor.grad
    tensor.grad_operand = None              # (the gradient is about to change)
    if prior is None or tensor.shared:
        tensor.shared = False
        tensor.grad = tensor.backend.empty(tensor.shape)
    return tensor.grad, prior


def grad_slot(tensor):
    """(buffer, accumulate): where a backward writes tensor's gradient, and whether it adds."""
    buffer, prior = grad_out_of_place(tensor)
    if prior is not None and prior is not buffer:       # (shared: added to a copy)
        tensor.backend.add_into(buffer, prior)
    return buffer, prior is not None


def summed_grad(tensor):
    """tensor's gradient buffer for kernels that always add to it (parameter gradients)."""
    _ready(tensor)
    if tensor.grad is None:
        tensor.grad = tensor.backend.zeros(tensor.shape)
    return tensor.grad


@contextmanager
def no_grad():
    """Evaluation and sampling: ops record nothing."""
    global _grad_enabled
    previous, _grad_enabled = _grad_enabled, False
    try:
        yield
    finally:
        _grad_enabled = previous


def grad_enabled():
    return _grad_enabled


def clear_tape():
    _tape.clear()
