"""What runs beside what: the second stream of a captured training step (nanoandrea/step.py).

A product's last wave of blocks and the small kernels between products leave multiprocessors
idle. Inside a captured step some work that nothing needs right away runs on a second CUDA
stream, beside the rest, and fills them:
    backward    the weight gradients: each starts when its dY is ready (ops.linear)
    forward     a layer's K and V products and their splits into heads, beside its Q
                (ops.linears), and the W^T copies the input gradients will read (ops.linear)
The graph holds both streams, joined before the update: the same kernels on the same data,
so the same bits as one stream.

Only inside a capture: there every allocation comes from the step's arena, never reused, so
memory the second stream still reads is never handed to the first (eagerly, CuPy's pool
would). Without a second stream, `on_second_stream` runs its block where it is and `join` does nothing,
so ops.py reads the same either way.

A gradient written on the second stream is not ready until the next join: `on_second_stream`
marks its tensors (Tensor.grad_ready), and the autograd waits before it touches their gradients
again (the tied token embedding: the LM head's weight gradient, then the embedding's).
"""
from contextlib import contextmanager

from numba import cuda

from .kernels.runtime import launch
from .kernels.runtime.device import SIMULATOR

_second = None          # (the second stream, its fork event, its join event) while there is one
_forked = False         # work launched on the second stream since the last join
_pending = []           # tensors whose gradients that work writes


@contextmanager
def second_stream(stream):
    """Inside the block, `on_second_stream()` puts launches on `stream` (a Numba stream)."""
    global _second, _forked
    events = [cuda.event() if SIMULATOR else cuda.event(timing=False)
              for _ in range(2)]                # (the simulator's events take no arguments)
    previous, _second = _second, (stream, *events)
    try:
        yield
    finally:
        join()
        _second, _forked = previous, False


@contextmanager
def on_second_stream(*tensors):
    """Launches inside the block go to the second stream, if there is one, after everything
    launched so far on the current stream; they run beside what is launched after the block,
    until `join()`. tensors: those whose gradients the block writes (not ready until then).
    Without a second stream the block runs where it is."""
    global _forked
    if _second is None or launch.current_stream() is _second[0]:
        yield
        return
    side, fork, _ = _second
    fork.record(launch.current_stream())
    fork.wait(side)
    with launch.using_stream(side):
        yield
    _forked = True
    for tensor in tensors:
        if tensor is not None:
            tensor.grad_ready = join
            _pending.append(tensor)


def join():
    """The current stream waits for what was launched `on_second_stream()` it (from inside a
    `on_second_stream()` block: nothing to wait for)."""
    global _forked
    if _second is None or launch.current_stream() is _second[0]:
        return
    if _forked:
        side, _, done = _second
        done.record(side)
        done.wait(launch.current_stream())
        _forked = False
    for tensor in _pending:
        tensor.grad_ready = None
    _pending.clear()


def transposed_weight(backend, weight, rows):
    """W^T for the input gradient dX = dY . W^T of a product of `rows` rows by weight [K, N],
    copied now, beside the forward (W does not change before the update), where the backend's
    matmul would copy it in backward; else None (matmul then reads W itself)."""
    K, N = weight.shape
    if not backend.copies_b_transposed(rows, K, False, True):
        return None
    with on_second_stream():
        weight_t = backend.empty((N, K))
        backend.transpose(weight_t, weight)
    return weight_t
