"""Every small op's kernel against its NumPy twin, through the backend's table: get_backend("cuda")
and get_backend("numpy") name the same op by the same attribute (nanoandrea/backend.py), so one
test runs each op on random inputs through both and compares every output.

The CUDA side gets float32 device arrays, its outputs poisoned with NaN (every element must be
written) or, for a gradient that accumulates, a random prior to add to; the NumPy side the same
values in float64, the definition. Each op is one or more cases below: the arguments in the
op's order, built by a function of the test's random generator. The products and attention
and the key/value cache have their own folders (matmul/, attention/); what a twin cannot say
(bit for bit, accuracy element by element, which kernel runs) is in each op's file beside
this one.
"""
import inspect

import numpy as np
import pytest

from checks import HEADS_CASES, ROWS, TOLERANCE, WIDTH, device, poisoned
from conftest import GPU, relative_error
from nanoandrea.backend import get_backend
from nanoandrea.kernels import adamw, embedding, layernorm

CUDA, NUMPY = get_backend("cuda"), get_backend("numpy", np.float64)


class Out:
    """An output of `shape`: NaN on both sides before the op, or (prior given) those values, to
    be accumulated onto or updated in place."""
    def __init__(self, shape, prior=None):
        self.prior = prior
        self.shape = (np.shape(prior) if prior is not None else
                      shape if isinstance(shape, tuple) else (shape,))


class Ints:
    """An integer array (token ids, positions, a seed): int32 on the device, or `dtype`."""
    def __init__(self, values, dtype=np.int32):
        self.values, self.dtype = np.asarray(values, dtype), dtype


class Scratch:
    """A temporary the kernel needs and the twin ignores (not compared)."""
    def __init__(self, shape):
        self.shape = shape


def on_cuda(x):
    if isinstance(x, Out):
        return poisoned(x.shape) if x.prior is None else device(x.prior)
    if isinstance(x, Scratch):
        return poisoned(x.shape)
    if isinstance(x, Ints):
        return device(x.values, x.dtype)
    return device(x) if isinstance(x, np.ndarray) else x


def on_numpy(x):
    if isinstance(x, Out):
        return (np.full(x.shape, np.nan) if x.prior is None else
                x.prior.astype(np.float32).astype(np.float64))
    if isinstance(x, Scratch):
        return None
    if isinstance(x, Ints):
        return x.values.copy()
    return x.astype(np.float32).astype(np.float64) if isinstance(x, np.ndarray) else x


# (ROWS, 4 * WIDTH): a multiple of 4, the 16-byte kernels; 5 x 9: the one-element kernels
ELEMENTWISE_SHAPES = [(ROWS, 4 * WIDTH), (5, 9)]
# (rows, C): the layer norm's warp kernels for C % 4 == 0 up to 1024 (C = 128: every lane full;
# 96 and 200: the last group of columns partly empty), its block kernels for the rest (77, and
# rows wider than the shared row cache)
LAYERNORM_SHAPES = ([(20, WIDTH), (5, 128), (5, 96), (5, 200), (20, 77),
                     (2, layernorm.ROW_CACHE + 13)] if not GPU else
                    [(16384, 384), (8192, 768), (1000, 1024), (999, 200), (1000, 77),
                     (300, layernorm.ROW_CACHE + 13)])
# crossentropy's (N, V): rows the 16-byte kernel cannot take (37) and can (40); on the GPU 4097
# and 4096
CROSSENTROPY_SHAPES = [(7, 37), (7, 40)] if not GPU else [(16384, 4097), (16384, 4096)]


def prior(rng, shape, accumulate):
    """The prior of an output: random to accumulate onto, else None (NaN-poisoned)."""
    return rng.standard_normal(shape) if accumulate else None


def layernorm_parameters(rng, C):
    """weight, bias [C] of a layer norm."""
    return 1 + 0.2 * rng.standard_normal(C), rng.standard_normal(C)


def layernorm_statistics(x, weight, bias):
    """mean, rstd of x's rows, as the forward saves them for the backward (the twin's)."""
    mean, rstd = np.empty(len(x)), np.empty(len(x))
    layernorm.layernorm_forward_numpy(np.empty(x.shape), mean, rstd, x, weight, bias)
    return mean.astype(np.float32), rstd.astype(np.float32)


def embedding_case(rng, padded):
    """The backward's arguments: ids with repeats (which must sum), grouped by token; padded:
    segment_starts padded with empty segments to a fixed size (as a CUDA graph replay needs),
    which the backward must skip."""
    B, T, C, V = (2, 7, 24, 11) if not GPU else (64, 256, 384, 65)
    idx = rng.integers(0, V, size=(B, T))
    idx[0, :3] = idx[1, 2]
    order, starts = embedding.group_positions_by_token(idx, min(V, B * T) if padded else None)
    return [Out(None, rng.standard_normal((V, C))), Out(None, rng.standard_normal((T + 3, C))),
            rng.standard_normal((B, T, C)), Ints(idx), Ints(order), Ints(starts)]


def crossentropy_logits(rng, N, V, scale):
    return scale * rng.standard_normal((N, V)), Ints(rng.integers(0, V, size=N))


def crossentropy_lse(logits, targets):
    """The forward's log-sum-exp of each row, the backward's input (the twin's)."""
    N = len(logits)
    lse = np.empty(N)
    NUMPY.crossentropy_forward(np.empty(1), np.empty(N), lse, logits, targets.values)
    return lse.astype(np.float32)


def adamw_case(rng):
    P, n_decay = (1000, 600) if not GPU else (10_770_816, 10_000_000)
    grads = rng.standard_normal(P)
    hyper = adamw.adamw_hyperparameters(3e-3, 0.9, 0.99, 1e-8, 0.1, 1.0, 7)
    norm = np.array([np.linalg.norm(grads.astype(np.float32).astype(np.float64))])
    return [Out(None, rng.standard_normal(P)), grads, Out(None, 0.1 * rng.standard_normal(P)),
            Out(None, rng.random(P)), hyper, norm, n_decay,
            Ints(np.zeros(0), np.uint16)]       # (no bf16 copies: test_adamw.py's, bit for bit)


def cases():
    """(op, id, arguments(rng)) for every case of every small op."""
    made = []

    def case(op, name, arguments):
        made.append(pytest.param(op, arguments, id=f"{op}-{name}"))

    for shape in ELEMENTWISE_SHAPES:
        n = f"{shape[0]}x{shape[1]}"
        case("add", n, lambda rng, s=shape: [Out(s), rng.standard_normal(s),
                                             rng.standard_normal(s)])
        case("fill", n, lambda rng, s=shape: [Out(s), 0.25])
        case("gelu_forward", n, lambda rng, s=shape: [Out(s), 3 * rng.standard_normal(s)])
        case("dropout_forward", n, lambda rng, s=shape: [
            Out(s), rng.standard_normal(s), 0.25, Ints([987654321], np.int64), 3])
        for accumulate in (False, True):
            m = f"{n}-{'+=' if accumulate else '='}"
            case("add_into", m, lambda rng, s=shape, a=accumulate: [
                Out(s, prior(rng, s, a)), rng.standard_normal(s), a])
            case("gelu_backward", m, lambda rng, s=shape, a=accumulate: [
                Out(s, prior(rng, s, a)), rng.standard_normal(s), 3 * rng.standard_normal(s), a])
            case("dropout_backward", m, lambda rng, s=shape, a=accumulate: [
                Out(s, prior(rng, s, a)), rng.standard_normal(s), 0.25,
                Ints([987654321], np.int64), 3, a])

    for N, C in LAYERNORM_SHAPES:
        n = f"{N}x{C}"
        case("layernorm_forward", n, lambda rng, N=N, C=C: [
            Out((N, C)), Out(N), Out(N), 3.0 + 2.0 * rng.standard_normal((N, C)),
            *layernorm_parameters(rng, C)])
        case("residual_layernorm_forward", n, lambda rng, N=N, C=C: [
            Out((N, C)), Out((N, C)), Out(N), Out(N), 3.0 + 2.0 * rng.standard_normal((N, C)),
            rng.standard_normal((N, C)), *layernorm_parameters(rng, C)])
        for accumulate in (False, True):
            def backward(rng, N=N, C=C, a=accumulate):
                x = 3.0 + 2.0 * rng.standard_normal((N, C))
                weight, bias = layernorm_parameters(rng, C)
                return [Out((N, C), prior(rng, (N, C), a)), Out(None, rng.standard_normal(C)),
                        Out(None, rng.standard_normal(C)), rng.standard_normal((N, C)), x,
                        weight, *layernorm_statistics(x, weight, bias), a]
            case("layernorm_backward", f"{n}-{'+=' if accumulate else '='}", backward)

    B, T, C, V = (2, 7, 24, 11) if not GPU else (64, 256, 384, 65)
    case("embedding_forward", "repeats", lambda rng: [
        Out((B, T, C)), Ints(rng.integers(0, V, size=(B, T))), rng.standard_normal((V, C)),
        rng.standard_normal((T + 3, C))])
    case("embedding_backward", "segments", lambda rng: embedding_case(rng, False))
    case("embedding_backward", "padded", lambda rng: embedding_case(rng, True))

    for N, V in CROSSENTROPY_SHAPES:
        for scale in (1.0, 100.0):
            n = f"{N}x{V}-scale{scale:g}"

            def forward(rng, N=N, V=V, scale=scale):
                return [Out(1), Out(N), Out(N), *crossentropy_logits(rng, N, V, scale)]

            def fused(rng, N=N, V=V, scale=scale):
                return [Out(1), Out(N), Out(N), Out((N, V)),
                        *crossentropy_logits(rng, N, V, scale), np.array([0.7])]
            case("crossentropy_forward", n, forward)
            case("crossentropy_forward_backward", n, fused)
            for accumulate in (False, True):
                def backward(rng, N=N, V=V, scale=scale, a=accumulate):
                    logits, targets = crossentropy_logits(rng, N, V, scale)
                    return [Out((N, V), prior(rng, (N, V), a)), np.array([0.7]), logits,
                            crossentropy_lse(logits, targets), targets, a]
                case("crossentropy_backward", f"{n}-{'+=' if accumulate else '='}", backward)

    P = 1000 if not GPU else 10_770_816
    case("grad_norm", f"{P}", lambda rng: [Out(1), rng.standard_normal(P),
                                       Scratch(adamw.NORM_BLOCKS)])
    case("adamw_update", f"{P}", adamw_case)

    for accumulate in (False, True):
        a_id = "+=" if accumulate else "="
        shape = (200, 45) if not GPU else (16384, 1536)         # several row chunks
        case("sum_rows", a_id, lambda rng, s=shape, a=accumulate: [
            Out(s[1], prior(rng, s[1], a)), rng.standard_normal(s), a])
        for B_, T_, H, D in HEADS_CASES:
            n = f"D{D}-{a_id}"
            case("split_heads", n, lambda rng, s=(B_, T_, H, D), a=accumulate: [
                Out((s[0], s[2], s[1], s[3]), prior(rng, (s[0], s[2], s[1], s[3]), a)),
                rng.standard_normal((s[0], s[1], s[2] * s[3])), a])
            case("merge_heads", n, lambda rng, s=(B_, T_, H, D), a=accumulate: [
                Out((s[0], s[1], s[2] * s[3]), prior(rng, (s[0], s[1], s[2] * s[3]), a)),
                rng.standard_normal((s[0], s[2], s[1], s[3])), a])

    return made


@pytest.mark.parametrize("op,arguments", cases())
def test_kernel_equals_its_twin(rng, op, arguments):
    given = arguments(rng)
    on_gpu, on_cpu = [on_cuda(x) for x in given], [on_numpy(x) for x in given]
    getattr(CUDA, op)(*on_gpu)
    getattr(NUMPY, op)(*on_cpu)
    outputs = [(got, want) for x, got, want in zip(given, on_gpu, on_cpu) if isinstance(x, Out)]
    assert outputs
    for number, (got, want) in enumerate(outputs):
        assert relative_error(got.copy_to_host(), want) < TOLERANCE, f"output {number}"


def test_every_small_op_has_a_case():
    """The cases above cover every op of the backend's table but the matmul and attention
    families' (their own folders: the products, the transposed copy, attention and its
    key/value cache), the operands' rounding (test_operands.py) and the questions the ops ask
    (takes_matvec, heads_operand, ...)."""
    covered = {param.values[0] for param in cases()}
    elsewhere = {"matmul", "matmul_sum", "matvec", "transpose", "round_bf16", "round_tf32",
                 "bf16_values", "attention_forward", "attention_backward", "kv_store",
                 "attention_cached", "heads_view", "bf16_heads_view", "takes_matvec", "heads_operand",
                 "attention_rounds", "attention_writes_bf16_out", "attention_reads_heads_in_rows",
                 "copies_b_transposed"}
    table = {name for name, value in vars(CUDA).items() if callable(value)}
    assert covered == table - elsewhere


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_each_launcher_has_its_twin_with_its_arguments(precision):
    """In each precision the table pairs every CUDA launcher with its own twin (its name and
    _numpy), which takes the same arguments in the same order: what ops.py passes to one it can
    pass to the other. (The questions answered by one function on both sides are alike.)"""
    cuda, numpy = get_backend("cuda", precision=precision), get_backend("numpy",
                                                                           precision=precision)
    for op, launcher in vars(cuda).items():
        if not callable(launcher):
            continue
        twin = getattr(numpy, op)
        if {launcher.__name__, twin.__name__} & {"_never", "<lambda>"}:
            continue
        assert twin.__name__ == launcher.__name__ + "_numpy", op
        assert (list(inspect.signature(twin).parameters) ==
                list(inspect.signature(launcher).parameters)), op
