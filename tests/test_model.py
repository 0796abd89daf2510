"""The whole model: loss and every parameter gradient against PyTorch autograd on the same
weights and batch; the per-head view of the fused projections; the parameter counts."""
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import GPU
from nanoandrea import ops
from nanoandrea.autograd import Tensor, _tape, no_grad
from nanoandrea.backend import get_backend
from nanoandrea.config import ConfigError, get_preset, parameter_breakdown
from nanoandrea.model import GPT

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "baselines"))
from torch_gpt import TorchGPT  # noqa: E402  (the PyTorch GPT-2 the benchmark runs too)


def torch_loss_and_grads(model, idx, targets, dtype):
    reference = TorchGPT.from_nanoandrea(model.config, model.params.state_dict(), dtype=dtype)
    _, loss = reference(torch.as_tensor(idx), torch.as_tensor(targets))
    loss.backward()
    return loss.item(), reference.grads()


def our_loss_and_grads(model, idx, targets, fused_loss=False):
    """fused_loss: the cross-entropy computes d logits in its forward (as training does)."""
    model.params.zero_grads()
    one = model.backend.to_device(np.ones(1, model.backend.dtype))
    _, loss = model.forward(idx, targets, loss_grad=one if fused_loss else None)
    loss.backward(one)
    return loss.item(), model.params.grad_dict()


def assert_grads_close(grads, want_grads, tolerance):
    """Relative error per parameter, with a floor at 1e-3 of the global gradient norm: some
    gradients are exactly zero in exact arithmetic (b_k: softmax ignores a per-row shift)."""
    floor = 1e-3 * np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in want_grads.values()))
    for name, want in want_grads.items():
        error = np.linalg.norm(grads[name] - want) / max(np.linalg.norm(want), floor)
        assert error < tolerance, f"{name}: relative error {error:.2e}"


def batch(rng, config, B, T):
    idx = rng.integers(0, config.vocab_size, size=(B, T))
    idx[0, 1] = idx[0, 0]                                   # a repeated token, for the scatter-add
    return idx, rng.integers(0, config.vocab_size, size=(B, T))


def test_numpy_backend_matches_pytorch_float64(rng):
    config = get_preset("tiny")
    model = GPT(config, get_backend("numpy", np.float64), seed=3)
    model.params.load_flat(model.params.initial_values(3) * 5)   # larger weights: a harder test
    idx, targets = batch(rng, config, 3, config.block_size)
    loss, grads = our_loss_and_grads(model, idx, targets)
    want_loss, want_grads = torch_loss_and_grads(model, idx, targets, torch.float64)
    assert abs(loss - want_loss) < 1e-10 * abs(want_loss)
    assert_grads_close(grads, want_grads, 1e-8)


def test_cuda_kernels_match_pytorch(rng):
    if GPU:   # andrea-12m's heads (D=32: the fast attention path) on a short batch
        config, B, T = get_preset("andrea-12m", vocab_size=65), 4, 64
    else:
        config, B, T = get_preset("tiny"), 2, 5
    model = GPT(config, get_backend("cuda"), seed=5)
    idx, targets = batch(rng, config, B, T)
    want_loss, want_grads = torch_loss_and_grads(model, idx, targets, torch.float64)
    for fused_loss in (False, True):
        loss, grads = our_loss_and_grads(model, idx, targets, fused_loss)
        assert abs(loss - want_loss) < 1e-5 * abs(want_loss)
        assert_grads_close(grads, want_grads, 2e-4)


def test_dropout_is_deterministic_and_the_same_on_both_backends(rng):
    config = get_preset("tiny", dropout=0.2)
    idx, targets = batch(rng, config, 2, 6)

    def train_mode_loss(model, seed):
        model.set_dropout_seed(seed)
        with no_grad():
            return model.forward(idx, targets, train=True)[1].item()

    cpu = GPT(config, get_backend("numpy"), seed=1)
    same, again, other = (train_mode_loss(cpu, s) for s in (11, 11, 12))
    assert same == again and same != other
    with no_grad():
        assert cpu.forward(idx, targets)[1].item() != same        # eval mode: no dropout
    gpu = GPT(config, get_backend("cuda"), seed=1)                 # the same masks on the GPU
    assert abs(train_mode_loss(gpu, 11) - same) < 1e-5 * abs(same)


def test_per_head_view_of_the_fused_projection(rng):
    """X.W_Q^h, with W_Q^h the h-th block of D columns of W_Q, is exactly head h of
    split_heads(X.W_Q): one fused matmul computes every head's projection."""
    B, T, C, H = 2, 5, 12, 3
    D = C // H
    backend = get_backend("numpy", np.float64)
    x, w_q = rng.standard_normal((B, T, C)), rng.standard_normal((C, C))
    with no_grad():
        fused = ops.split_heads(ops.linear(Tensor(x, backend), Tensor(w_q, backend)), H).data
    for h in range(H):
        per_head = x @ w_q[:, h * D:(h + 1) * D]                      # [B,T,D]
        assert np.allclose(fused[:, h], per_head, rtol=1e-12, atol=1e-12)


def test_parameter_breakdown_of_andrea_120m():
    config = get_preset("andrea-120m")
    rows = dict(parameter_breakdown(config))
    assert rows["attention projections per layer (W_Q, W_K, W_V, W_O: 4 C^2)"] == 4 * 768 ** 2 == 2_359_296
    assert rows["attention projections, all 12 layers"] == 28_311_552
    assert rows["attention biases, all 12 layers"] == 12 * 4 * 768
    assert rows["total"] == 124_439_808                      # GPT-2 small
    assert 0.2 < 28_311_552 / rows["total"] < 0.3            # about a quarter


def test_parameter_breakdown_counts_what_the_model_allocates():
    config = get_preset("tiny")
    model = GPT(config, get_backend("numpy"))
    assert dict(parameter_breakdown(config))["total"] == model.params.count


def test_padded_vocabulary_rows_stay_zero_and_out_of_the_model(rng):
    """wte keeps Vp = 64 rows for the tiny preset's 37 tokens: the 27 extra rows start at zero,
    get no gradient, so AdamW (weight decay included) leaves them at zero; checkpoints and the
    PyTorch oracle see [37, C]."""
    from nanoandrea.optim import AdamW
    config = get_preset("tiny")
    model = GPT(config, get_backend("numpy", np.float64), seed=5)
    assert config.padded_vocab_size == 64 and model["wte"].shape == (64, config.n_embd)
    optimizer = AdamW(model.params, lr=1e-2, weight_decay=0.1)
    for _ in range(2):
        optimizer.zero_grad()
        _, loss = model.forward(*batch(rng, config, 2, config.block_size), train=True)
        loss.backward()
        optimizer.step()
    wte = model["wte"].numpy()
    assert np.all(wte[37:] == 0) and np.all(model["wte"].grad[37:] == 0) and wte[:37].any()
    state = model.params.state_dict()
    assert state["wte"].shape == (37, config.n_embd)
    copy = GPT(config, get_backend("numpy", np.float64), seed=6)
    copy.params.load_state_dict(state)
    assert np.array_equal(copy["wte"].numpy(), wte)


@pytest.mark.parametrize("changes,message", [
    (dict(n_head=5), "does not divide the width"),
    (dict(n_layer=0), "n_layer must be a positive integer"),
    (dict(dropout=1.0), "dropout must be in"),
])
def test_config_errors_are_clear(changes, message):
    with pytest.raises(ConfigError, match=message):
        get_preset("andrea-12m", **changes)
    with pytest.raises(ConfigError, match="unknown preset"):
        get_preset("andrea-7b")


def test_tape_records_nothing_under_no_grad(rng):
    config = get_preset("tiny")
    model = GPT(config, get_backend("numpy"))
    idx, targets = batch(rng, config, 2, 4)
    with no_grad():
        model.forward(idx, targets)
    assert len(_tape) == 0
    _, loss = model.forward(idx, targets)
    assert len(_tape) > 0
    loss.backward()
    assert len(_tape) == 0


@pytest.mark.parametrize("backend_name,fused_loss", [("numpy", False), ("numpy", True),
                                                    ("cuda", True)])
def test_bf16_matmuls_match_pytorch_autocast(rng, backend_name, fused_loss):
    """Precision bf16 (every matmul's operands rounded to bf16, float32 sums) against PyTorch
    autocast bf16 and float64 on the same weights: the loss within 1%, every gradient within
    bf16's tolerance (measured: 5e-3 to 7e-3 relative, the same distance as autocast's own
    from float64). fused_loss: the loss computes the logits' gradient in its forward, and
    writes it in bf16, as the LM head's products read it."""
    if backend_name == "cuda" and not GPU:
        pytest.skip("150 s in the simulator: there tests/kernels/matmul/test_matmul_mma.py checks "
                    "the kernel, and test_step.py a bf16 step on it")
    if GPU and backend_name == "cuda":
        config, B, T = get_preset("andrea-12m", vocab_size=65), 4, 64
    else:
        config, B, T = get_preset("tiny"), 2, 5
    model = GPT(config, get_backend(backend_name, precision="bf16"), seed=5)
    idx, targets = batch(rng, config, B, T)
    reference = TorchGPT.from_nanoandrea(config, model.params.state_dict(), dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, autocast_loss = reference(torch.as_tensor(idx), torch.as_tensor(targets))
    autocast_loss.backward()
    exact_loss, exact_grads = torch_loss_and_grads(model, idx, targets, torch.float64)
    loss, grads = our_loss_and_grads(model, idx, targets, fused_loss=fused_loss)
    assert abs(loss - autocast_loss.item()) < 0.01 * abs(autocast_loss.item())
    assert abs(loss - exact_loss) < 0.01 * abs(exact_loss)
    assert_grads_close(grads, reference.grads(), 2e-2)
    assert_grads_close(grads, exact_grads, 2e-2)
    float32_model = GPT(config, get_backend(backend_name), seed=5)  # (bf16 is not float32)
    _, float32_grads = our_loss_and_grads(float32_model, idx, targets)
    assert max(np.abs(grads[name] - g).max() for name, g in float32_grads.items()) > 0


@pytest.mark.parametrize("backend_name", ["numpy", "cuda"])
def test_tf32_matmuls_match_float32(rng, backend_name):
    """Precision tf32 (every matmul's operands rounded to tf32, float32 sums) against the same
    model in float32: the loss within 1e-3 relative, every gradient within 2e-3 of PyTorch
    float64's (measured on tiny: 7e-4, where bf16's are 5e-3); not float32 itself (the
    operands are rounded)."""
    if backend_name == "cuda" and not GPU:
        pytest.skip("as bf16's: in the simulator tests/kernels/matmul/test_matmul_mma.py "
                    "checks the kernel")
    config, B, T = ((get_preset("andrea-12m", vocab_size=65), 4, 64) if GPU else
                    (get_preset("tiny"), 2, 5))
    idx, targets = batch(rng, config, B, T)
    models = {precision: GPT(config, get_backend(backend_name, precision=precision), seed=6)
              for precision in ("tf32", "fp32")}
    fused = backend_name == "cuda"
    (loss, grads), (float32_loss, float32_grads) = (
        our_loss_and_grads(models[p], idx, targets, fused_loss=fused) for p in ("tf32", "fp32"))
    assert abs(loss - float32_loss) < 1e-3 * abs(float32_loss)
    _, exact_grads = torch_loss_and_grads(models["fp32"], idx, targets, torch.float64)
    assert_grads_close(grads, exact_grads, 2e-3)
    assert max(np.abs(grads[name] - g).max() for name, g in float32_grads.items()) > 0
