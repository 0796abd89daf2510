"""Every NumPy reference op: its backward against central finite differences, in float64.

Each check builds the op through nanoandrea.ops on the NumPy float64 backend, takes the scalar
L = sum(out * R) for a random R, gets dL/d(input) from the op's backward, and compares it with
(L(x + eps) - L(x - eps)) / 2 eps at every element of every input.
"""
import numpy as np
import pytest

from nanoandrea import ops
from nanoandrea.autograd import Tensor, clear_tape, no_grad
from nanoandrea.backend import get_backend

NP64 = get_backend("numpy", np.float64)
EPS = 1e-6


def check_gradients(build, inputs, rng, tolerance=1e-6):
    """build(**tensors) -> Tensor; inputs: {name: float64 array}. Asserts analytic == numeric."""
    clear_tape()
    tensors = {n: Tensor(a.copy(), NP64, requires_grad=True) for n, a in inputs.items()}
    out = build(**tensors)
    weights = rng.standard_normal(out.shape)
    out.backward(weights.copy())

    def scalar(arrays):
        with no_grad():
            return float(np.sum(build(**{n: Tensor(a, NP64) for n, a in arrays.items()}).data
                                * weights))

    for name, value in inputs.items():
        analytic = tensors[name].grad
        assert analytic is not None, f"no gradient reached {name}"
        numeric = np.zeros_like(value)
        for i in np.ndindex(value.shape):
            shifted = {n: a.copy() for n, a in inputs.items()}
            shifted[name][i] += EPS
            up = scalar(shifted)
            shifted[name][i] -= 2 * EPS
            numeric[i] = (up - scalar(shifted)) / (2 * EPS)
        error = np.abs(analytic - numeric).max() / max(np.abs(numeric).max(), 1e-12)
        assert error < tolerance, f"d/d{name}: relative error {error:.2e}"


@pytest.mark.parametrize("transpose_weight", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear(rng, transpose_weight, with_bias):
    x = rng.standard_normal((2, 3, 5))
    w = rng.standard_normal((4, 5) if transpose_weight else (5, 4))
    inputs = dict(x=x, w=w)
    if with_bias:
        inputs["b"] = rng.standard_normal(4)
    check_gradients(lambda x, w, b=None: ops.linear(x, w, b, transpose_weight), inputs, rng)


def test_linear_with_gelu(rng):
    """activation="gelu": gelu(x . W + b) in one op (the MLP's first layer), whose backward goes
    through GELU's derivative at the kept pre-activation."""
    inputs = dict(x=rng.standard_normal((2, 3, 4)), w=rng.standard_normal((4, 5)),
                  b=rng.standard_normal(5))
    check_gradients(lambda x, w, b: ops.linear(x, w, b, activation="gelu"), inputs, rng)
    x, w, b = (Tensor(inputs[name], NP64) for name in "xwb")
    want = ops.gelu(ops.linear(x, w, b)).data
    assert np.allclose(ops.linear(x, w, b, activation="gelu").data, want, rtol=1e-14, atol=0)


@pytest.mark.parametrize("also_used", [None, "before", "after"])
def test_mlp_gelu_backward_in_the_next_linear(rng, also_used):
    """gelu(x . W_fc + b) . W_proj + b: the second linear writes the pre-activation's gradient
    itself (dH . W_proj^T times gelu'), GELU's own backward is skipped. also_used: the GELU's
    output also goes into a residual add recorded before or after the second linear (so its
    gradient reaches GELU's backward before or after the fused one), and the two still sum."""
    inputs = dict(x=rng.standard_normal((2, 3, 4)), w_fc=rng.standard_normal((4, 6)),
                  b_fc=rng.standard_normal(6), w_proj=rng.standard_normal((6, 4)),
                  b_proj=rng.standard_normal(4))
    if also_used:
        inputs["w_side"] = rng.standard_normal((6, 4))

    made = []

    def build(x, w_fc, b_fc, w_proj, b_proj, w_side=None):
        g = ops.linear(x, w_fc, b_fc, activation="gelu")
        made.append(g)
        if also_used == "before":
            side = ops.linear(ops.add(g, g), w_side)
        y = ops.linear(g, w_proj, b_proj)
        if also_used == "after":
            side = ops.linear(ops.add(g, g), w_side)
        return y if also_used is None else ops.add(y, side)

    check_gradients(build, inputs, rng)
    assert (made[0].grad is None) == (also_used is None)    # alone, no gradient of gelu's output


def test_split_and_merge_heads(rng):
    check_gradients(lambda x: ops.split_heads(x, 3), dict(x=rng.standard_normal((2, 4, 6))), rng)
    check_gradients(lambda x: ops.merge_heads(x), dict(x=rng.standard_normal((2, 3, 4, 2))), rng)


@pytest.mark.parametrize("also_used", [None, "output", "input"])
def test_attention_between_split_and_merge(rng, also_used):
    """The model's chain: split, attention, merge. The attention writes its output into the
    heads' concat (merge copies nothing) and q, k, v's gradients into their fused tensors'
    (split's backward has nothing left to merge). also_used: the attention output merged twice
    (the second merge's gradient added to the shared first: a copy), or q used again after the
    split (its gradient there first: then q's split takes its own buffer, merged after)."""
    H, shape = 2, (2, 4, 6)

    def build(q, k, v):
        split = [ops.split_heads(t, H) for t in (q, k, v)]
        y = ops.attention(*split)
        out = ops.merge_heads(y)
        if also_used == "output":
            out = ops.add(out, ops.merge_heads(y))
        elif also_used == "input":
            out = ops.add(out, q)
        return out, split

    inputs = {n: rng.standard_normal(shape) for n in "qkv"}
    check_gradients(lambda q, k, v: build(q, k, v)[0], inputs, rng)
    clear_tape()
    tensors = [Tensor(a.copy(), NP64, requires_grad=True) for a in inputs.values()]
    out, split = build(*tensors)
    out.backward(rng.standard_normal(out.shape))
    assert [s.grad is None for s in split] == [also_used != "input", True, True]


@pytest.mark.parametrize("later_use", ["layernorm", "linear"])
def test_a_shared_gradient_is_never_written_in_place(rng, later_use):
    """The residual add hands its gradient to both inputs without a copy (share_grad). A later
    gradient of one of them (layer norm's, which its kernel adds to the shared one: grad_out_of_place;
    a linear layer's, through grad_slot: a copy first) goes to a new buffer, never into the
    shared one, which the other input's users (a weight gradient beside) may still be reading."""
    weight, bias = 1 + 0.3 * rng.standard_normal(6), rng.standard_normal(6)
    w = rng.standard_normal((6, 6))

    def build(a, b):
        if later_use == "layernorm":
            used = ops.layernorm(a, Tensor(weight, NP64), Tensor(bias, NP64))
        else:
            used = ops.linear(a, Tensor(w, NP64))
        return ops.add(ops.add(a, b), used)

    inputs = dict(a=rng.standard_normal((3, 2, 6)), b=rng.standard_normal((3, 2, 6)))
    check_gradients(build, inputs, rng)
    clear_tape()
    a, b = (Tensor(x.copy(), NP64, requires_grad=True) for x in inputs.values())
    upstream = rng.standard_normal((3, 2, 6))
    build(a, b).backward(upstream.copy())
    assert np.array_equal(b.grad, upstream), "the shared buffer was written"
    assert a.grad is not b.grad


@pytest.mark.parametrize("D", [2, 3])
@pytest.mark.parametrize("dropout_p", [0.0, 0.4])
def test_attention(rng, D, dropout_p):
    shape = (2, 2, 5, D)
    seed = np.array([77], dtype=np.int64)
    check_gradients(lambda q, k, v: ops.attention(q, k, v, dropout_p, seed, site=1),
                    {n: rng.standard_normal(shape) for n in "qkv"}, rng)


def test_layernorm(rng):
    inputs = dict(x=rng.standard_normal((3, 2, 6)), weight=1 + 0.3 * rng.standard_normal(6),
                  bias=rng.standard_normal(6))
    check_gradients(ops.layernorm, inputs, rng)


def test_add_layernorm(rng):
    # as in the model, both outputs carry gradient (the sum s goes on down the residual stream,
    # h into the branch) and x is used again; the fused forward equals add then layernorm
    inputs = dict(x=rng.standard_normal((3, 2, 6)), y=rng.standard_normal((3, 2, 6)),
                  weight=1 + 0.3 * rng.standard_normal(6), bias=rng.standard_normal(6))

    def build(x, y, weight, bias):
        s, h = ops.add_layernorm(x, y, weight, bias)
        return ops.add(ops.add(s, h), x)

    check_gradients(build, inputs, rng)
    with no_grad():
        x, y, weight, bias = (Tensor(a, NP64) for a in inputs.values())
        s, h = ops.add_layernorm(x, y, weight, bias)
        want = ops.add(x, y)
        assert np.array_equal(s.data, want.data)
        assert np.array_equal(h.data, ops.layernorm(want, weight, bias).data)


def test_gelu(rng):
    check_gradients(ops.gelu, dict(x=3 * rng.standard_normal((4, 7))), rng)


def test_add_sums_both_paths(rng):
    # x feeds both operands: its gradient is the sum of the two (the residual-stream case)
    check_gradients(lambda x, y: ops.add(x, ops.add(x, y)),
                    dict(x=rng.standard_normal((3, 4)), y=rng.standard_normal((3, 4))), rng)


def test_dropout(rng):
    seed = np.array([1234], dtype=np.int64)
    check_gradients(lambda x: ops.dropout(x, 0.3, seed, site=2),
                    dict(x=rng.standard_normal((5, 7))), rng)


def test_embedding_with_repeated_tokens(rng):
    idx = np.array([[1, 3, 1, 1], [0, 3, 2, 1]])                   # repeats within and across rows
    check_gradients(lambda wte, wpe: ops.embedding(idx, wte, wpe),
                    dict(wte=rng.standard_normal((5, 3)), wpe=rng.standard_normal((6, 3))), rng)


def test_cross_entropy(rng):
    targets = rng.integers(0, 7, size=(2, 3))
    check_gradients(lambda logits: ops.cross_entropy(logits, targets),
                    dict(logits=2 * rng.standard_normal((2, 3, 7))), rng)


def test_cross_entropy_over_the_first_vocab_columns(rng):
    """vocab=5 of 7 columns (a padded vocabulary): the last two are no classes, so the loss
    does not depend on them and their gradient is 0 (finite differences agree)."""
    targets = rng.integers(0, 5, size=(2, 3))
    check_gradients(lambda logits: ops.cross_entropy(logits, targets, vocab=5),
                    dict(logits=2 * rng.standard_normal((2, 3, 7))), rng)


def test_cross_entropy_is_stable_for_large_logits(rng):
    logits = 100.0 * rng.standard_normal((4, 9))
    targets = rng.integers(0, 9, size=4)
    loss = ops.cross_entropy(Tensor(logits, NP64, requires_grad=True), targets)
    m = logits.max(axis=1, keepdims=True)
    want = np.mean(np.log(np.exp(logits - m).sum(axis=1)) + m[:, 0] - logits[np.arange(4), targets])
    assert np.isfinite(loss.item()) and abs(loss.item() - want) < 1e-9 * abs(want)
    check_gradients(lambda logits: ops.cross_entropy(logits, targets),
                    dict(logits=logits / 100.0 * 5.0), rng)


def test_adamw_matches_the_formula(rng):
    from nanoandrea.kernels.adamw import adamw_hyperparameters, adamw_update_numpy, grad_norm_numpy
    P, n_decay = 11, 6
    params, grads = rng.standard_normal(P), rng.standard_normal(P)
    m, v = 0.1 * rng.standard_normal(P), rng.random(P)
    norm = np.zeros(1)
    grad_norm_numpy(norm, grads)
    assert np.isclose(norm[0], np.linalg.norm(grads))
    lr, b1, b2, eps, wd, clip, step = 0.01, 0.9, 0.99, 1e-8, 0.1, 0.5, 3
    hyper = adamw_hyperparameters(lr, b1, b2, eps, wd, clip, step).astype(np.float64)
    want_p, want_m, want_v = params.copy(), m.copy(), v.copy()
    g = grads * min(1.0, clip / (norm[0] + 1e-6))
    want_m = b1 * want_m + (1 - b1) * g
    want_v = b2 * want_v + (1 - b2) * g * g
    step_size = (want_m / (1 - b1 ** step)) / (np.sqrt(want_v / (1 - b2 ** step)) + eps)
    want_p -= lr * step_size
    want_p[:n_decay] -= lr * wd * params[:n_decay]
    adamw_update_numpy(params, grads, m, v, hyper, norm, n_decay, np.zeros(0, np.uint16))
    np.testing.assert_allclose(params, want_p, rtol=1e-6)
    np.testing.assert_allclose(m, want_m, rtol=1e-6)
    np.testing.assert_allclose(v, want_v, rtol=1e-6)
