"""The training step (nanoandrea.step): the same as the loop it replaces, and on the GPU its
CUDA-graph replay equal to the eager step bit for bit, allocating nothing once captured; the
evaluation's step (EvalStep) likewise."""
import sys
from collections import Counter

import numpy as np
import pytest

from conftest import GPU
from nanoandrea.backend import get_backend
from nanoandrea.config import get_preset
from nanoandrea import schedule
from nanoandrea.kernels.runtime import launch, memory
from nanoandrea.model import GPT
from nanoandrea.optim import AdamW
from nanoandrea.step import EvalStep, TrainStep


def batches(rng, config, B, T, steps, grad_accum):
    def ids():
        return rng.integers(0, config.vocab_size, size=(B, T))
    return [[(ids(), ids()) for _ in range(grad_accum)] for _ in range(steps)]


def run_steps(backend, config, data, cuda_graph, B, T, grad_accum):
    """Losses of every step and the final parameters."""
    model = GPT(config, backend, seed=4)
    optimizer = AdamW(model.params, lr=3e-3)
    step = TrainStep(model, optimizer, B, T, grad_accum, cuda_graph=cuda_graph)
    losses = []
    for n, micro_batches in enumerate(data):
        seeds = [100 * n + micro for micro in range(grad_accum)]
        losses.append(float(backend.to_host(step(micro_batches, seeds, 3e-3))[0]))
    return losses, backend.to_host(model.params.params), step


def test_step_equals_the_loop_it_replaces(rng):
    """Two micro-batches with dropout: TrainStep's loss and update are the plain loop's."""
    config = get_preset("tiny", dropout=0.1)
    B, T, grad_accum = 2, 6, 2
    backend = get_backend("numpy")
    data = batches(rng, config, B, T, 2, grad_accum)
    losses, params, _ = run_steps(backend, config, data, False, B, T, grad_accum)

    model = GPT(config, backend, seed=4)
    optimizer = AdamW(model.params, lr=3e-3)
    half = backend.to_device(np.array([0.5], np.float32))
    want = []
    for n, micro_batches in enumerate(data):
        optimizer.zero_grad()
        total = 0.0
        for micro, (x, y) in enumerate(micro_batches):
            model.set_dropout_seed(100 * n + micro)
            _, loss = model.forward(x, y, train=True)
            loss.backward(half)
            total += loss.item()
        optimizer.step(3e-3)
        want.append(total)
    assert np.allclose(losses, want, rtol=1e-6)
    assert np.array_equal(params, backend.to_host(model.params.params))


@pytest.mark.skipif(not GPU, reason="CUDA graphs need a GPU (and CuPy)")
@pytest.mark.parametrize("n_head,precision", [(4, "fp32"), (2, "fp32"), (4, "bf16"),
                                              (4, "tf32")])
def test_cuda_graph_replays_the_eager_step_and_allocates_nothing(rng, n_head, precision):
    """n_head 4: heads of 32; 2: heads of 64 (the two fast attention tiles); in bf16 and tf32
    too."""
    config = get_preset("andrea-mini", vocab_size=65, dropout=0.1, n_head=n_head)
    B, T, grad_accum = 8, 64, 2
    backend = get_backend("cuda", precision=precision)
    data = batches(rng, config, B, T, 5, grad_accum)
    eager_losses, eager_params, _ = run_steps(backend, config, data, False, B, T, grad_accum)
    graph_losses, graph_params, step = run_steps(backend, config, data, True, B, T, grad_accum)
    assert step.graph is not None                       # steps 2.. were replays
    assert graph_losses == eager_losses                 # bit for bit
    assert np.array_equal(graph_params, eager_params)
    with memory.count_allocations() as tally:           # a replayed step allocates nothing
        step(data[0], [1, 2], 1e-3)
        backend.to_host(step.loss)
    assert tally.count == 0


def test_a_bf16_step_on_mma_sync_as_on_an_8x_gpu(rng, monkeypatch):
    """A step's forward and backward in bf16 on a GPU of compute capability 8.0-8.9 (an A100
    pretended): every product and the attention on the mma.sync kernels, no wgmma; the loss
    and every gradient those of the NumPy backend's bf16 twins, within bf16's tolerance. On an
    H100 this runs the 8.x path that the default does not take there; in the simulator at tiny
    sizes (heads of 32, the tensor-core attention's). (The update is AdamW's float32 kernel,
    the same on every GPU.)"""
    from checks import A100, on_device, recording_launches
    from nanoandrea.kernels.attention import mma_sync as attention_mma
    from nanoandrea.kernels.attention import wgmma as attention_wgmma
    from nanoandrea.kernels.matmul import mma_sync as matmul_mma
    from nanoandrea.kernels.matmul import wgmma as matmul_wgmma
    on_device(monkeypatch, A100)

    def no_wgmma(*args, **kwargs):
        raise AssertionError("a wgmma kernel ran on an 8.x GPU")
    for module, name in ((matmul_wgmma, "matmul_wgmma"),
                         (attention_wgmma, "attention_forward_wgmma"),
                         (attention_wgmma, "attention_backward_wgmma")):
        monkeypatch.setattr(module, name, no_wgmma)
    launched = recording_launches(monkeypatch, matmul_mma, attention_mma)
    config = (get_preset("tiny", n_layer=1, n_head=1, n_embd=32, dropout=0.1) if not GPU else
              get_preset("andrea-mini", vocab_size=65, dropout=0.1))
    B, T = (2, 8) if not GPU else (8, 64)
    (x, y), = batches(rng, config, B, T, 1, 1)[0]
    results = {}
    for name in ("cuda", "numpy"):
        backend = get_backend(name, precision="bf16")
        model = GPT(config, backend, seed=4)
        model.set_dropout_seed(7)
        one = backend.to_device(np.ones(1, np.float32))
        _, loss = model.forward(x, y, train=True, loss_grad=one)    # (as TrainStep's body)
        loss.backward(one)
        results[name] = loss.item(), backend.to_host(model.params.grads).astype(np.float64)
    names = {kernel.py_func.__name__ for kernel in launched}
    assert "mma_matmul_kernel" in names and "attention_forward_bf16_kernel" in names, names
    (loss, grads), (want_loss, want_grads) = results["cuda"], results["numpy"]
    # (measured in the simulator: the loss 8e-6 apart, the gradients 1.3e-3)
    assert abs(loss - want_loss) < 1e-3 * abs(want_loss)
    assert np.linalg.norm(grads - want_grads) < 1e-2 * np.linalg.norm(want_grads)


def address_range(array):
    """[its first byte, past its last) of an array of any backend (a view's own bytes)."""
    array = getattr(array, "_ary", array)           # (the simulator's arrays wrap an ndarray)
    interface = getattr(array, "__cuda_array_interface__", None) or array.__array_interface__
    return interface["data"][0], interface["data"][0] + array.nbytes


@pytest.mark.parametrize("precision,grad_accum", [("bf16", 1), ("bf16", 2), ("tf32", 2),
                                                  ("fp32", 2)])
def test_in_bf16_no_step_rounds_a_weight(rng, monkeypatch, precision, grad_accum):
    """bf16: the products read the weights' copies that AdamW writes (the parameter store's,
    params.py), so no rounding pass reads a weight, in the first step (the copies were made
    where the weights were loaded) or in the next, with gradient accumulation too. tf32 keeps
    the rounding passes: each micro-batch's forward rounds every matrix (6 a layer, wte for
    the LM head); fp32 rounds nothing. The launches are recorded, not run."""
    from nanoandrea.kernels import operands
    config = get_preset("tiny", n_layer=2, n_head=1, n_embd=32)
    B, T = 2, 8
    with launch.recording():
        model = GPT(config, get_backend("cuda", precision=precision), seed=4)
        weights = address_range(model.params.params)
        rounded = []
        real_launch = operands.launch

        def spy(kernel, grid, block, *arguments, **options):
            if kernel in (operands.round_bf16_kernel, operands.round_tf32_kernel):
                first, end = address_range(arguments[1])            # (copy, x, whole_rows)
                rounded.append(weights[0] <= first and end <= weights[1])
            real_launch(kernel, grid, block, *arguments, **options)
        monkeypatch.setattr(operands, "launch", spy)
        step = TrainStep(model, AdamW(model.params), B, T, grad_accum, cuda_graph=False)
        weights_rounded = []
        for n, micro_batches in enumerate(batches(rng, config, B, T, 2, grad_accum)):
            rounded.clear()
            step(micro_batches, [n] * grad_accum, 1e-3)
            weights_rounded.append(sum(rounded))
    matrices = 6 * config.n_layer + 1
    assert weights_rounded == ([grad_accum * matrices] * 2 if precision == "tf32" else [0, 0])
    assert (model.params.bf16_copies.size > 0) == (precision == "bf16")


ON_GPU_ONLY = pytest.mark.skipif(not GPU, reason="3 steps of 2 micro-batches, twice: too "
                                 "slow in the simulator (the twins' run checks the same)")


@pytest.mark.parametrize("backend_name", ["numpy", pytest.param("cuda", marks=ON_GPU_ONLY)])
def test_bf16_steps_read_adamws_copies_the_bits_of_the_rounding_pass(rng, backend_name):
    """3 bf16 steps of 2 micro-batches, with dropout: after each, every matrix's bf16 copy is
    round_bf16's of its weights; the losses and weights are those of the same steps whose
    products round the weights themselves (the copies dropped), to the bit. Weights loaded
    into a new model (a checkpoint's) come with their copies."""
    from nanoandrea.kernels.operands import Bf16Matrix, round_bf16_numpy
    config = (get_preset("tiny", n_layer=2, n_head=1, n_embd=32, dropout=0.1) if not GPU else
              get_preset("andrea-mini", vocab_size=65, dropout=0.1))
    B, T, grad_accum = (2, 8, 2) if not GPU else (8, 64, 2)
    backend = get_backend(backend_name, precision="bf16")
    data = batches(rng, config, B, T, 3, grad_accum)

    def assert_copies_are_rounded(store):
        for spec in store.layout:
            if spec.decay:
                weight = store[spec.name]
                want = Bf16Matrix(np.empty(weight.data_operand.bf16_pairs.shape, np.uint32),
                                  weight.shape[1])
                round_bf16_numpy(want, backend.to_host(weight.data))
                got = backend.to_host(weight.data_operand.bf16_pairs)
                assert np.array_equal(got, want.bf16_pairs), spec.name

    def run(keep_copies):
        model = GPT(config, backend, seed=4)
        if not keep_copies:                         # (ops.weight_operand then rounds them)
            for weight in model.params.matrices():
                weight.data_operand = None
        step = TrainStep(model, AdamW(model.params, lr=3e-2), B, T, grad_accum,
                         cuda_graph=False)
        losses = []
        for n, micro_batches in enumerate(data):
            losses.append(float(backend.to_host(step(micro_batches, [2 * n, 2 * n + 1],
                                                     3e-2))[0]))
            if keep_copies:
                assert_copies_are_rounded(model.params)
        return losses, backend.to_host(model.params.params), model

    losses, weights, model = run(keep_copies=True)
    assert model.params.bf16_copies.size == model.params.n_decay
    want_losses, want_weights, _ = run(keep_copies=False)
    assert losses == want_losses
    assert np.array_equal(weights.view(np.uint32), want_weights.view(np.uint32))
    loaded = GPT(config, backend, seed=None)
    loaded.params.load_state_dict(model.params.state_dict())
    assert_copies_are_rounded(loaded.params)
    assert np.array_equal(backend.to_host(loaded.params.bf16_copies),
                          backend.to_host(model.params.bf16_copies))


def evaluation_means(step, data, rounds=2):
    """EvalStep's mean over `data`'s batches, `rounds` times (the weights unchanged)."""
    means = []
    for _ in range(rounds):
        for x, y in data:
            step.add(x, y)
        means.append(step.mean())
    return means


def test_evaluation_step_is_the_mean_of_the_models_losses(rng):
    """EvalStep.mean(): the mean of model.loss over the batches added since the last mean."""
    config = get_preset("tiny", dropout=0.1)        # (evaluation drops nothing)
    B, T = 3, 6
    backend = get_backend("numpy")
    model = GPT(config, backend, seed=4)
    data = [pair for step in batches(rng, config, B, T, 3, 1) for pair in step]
    means = evaluation_means(EvalStep(model, B, T), data)
    want = np.mean([model.loss(x, y) for x, y in data])
    assert means[0] == means[1] and abs(means[0] - want) < 1e-6 * want


@pytest.mark.skipif(not GPU, reason="CUDA graphs need a GPU (and CuPy)")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_evaluation_graph_replays_the_eager_forward(rng, precision):
    """EvalStep on a training step's stream: its replays give the eager means bit for bit,
    after a training step changed the weights too, and a replay allocates nothing."""
    config = get_preset("andrea-mini", vocab_size=65, dropout=0.1)
    B, T = 8, 64
    backend = get_backend("cuda", precision=precision)
    model = GPT(config, backend, seed=4)
    train = TrainStep(model, AdamW(model.params, lr=3e-3), B, T)
    data = [pair for step in batches(rng, config, B, T, 3, 1) for pair in step]
    eager, graph = EvalStep(model, B, T, cuda_graph=False), EvalStep(model, B, T, streams=train)
    assert graph.stream is train.stream
    first = evaluation_means(eager, data), evaluation_means(graph, data)
    train(batches(rng, config, B, T, 1, 1)[0], [7], 3e-3)
    second = evaluation_means(eager, data), evaluation_means(graph, data)
    assert graph.graph is not None
    assert first[0] == first[1] and second[0] == second[1]
    assert first[0][0] != second[0][0]                  # (the weights did change)
    with memory.count_allocations() as tally:
        graph.add(*data[0])
        graph.mean()
    assert tally.count == 0


@pytest.mark.skipif(not GPU, reason="CUDA graphs need a GPU (and CuPy)")
def test_evaluation_without_room_for_its_graph_runs_eagerly(rng, monkeypatch):
    """Where the graph's arena cannot be allocated (MemoryError), EvalStep goes on eagerly,
    with the eager means."""
    config = get_preset("andrea-mini", vocab_size=65)
    B, T = 8, 64
    model = GPT(config, get_backend("cuda"), seed=4)
    data = [pair for step in batches(rng, config, B, T, 3, 1) for pair in step]
    want = evaluation_means(EvalStep(model, B, T, cuda_graph=False), data)

    def no_room(size):
        raise MemoryError(f"graph arena of {size} bytes")
    monkeypatch.setattr(memory, "Arena", no_room)
    step = EvalStep(model, B, T)
    assert evaluation_means(step, data) == want
    assert step.graph is None and not step.cuda_graph


@pytest.mark.skipif(GPU, reason="eagerly, memory the second stream reads could be reused by the "
                    "first (CuPy's pool); on the GPU the captured step above runs it")
def test_work_beside_on_a_second_stream_gives_the_same_gradients(rng, monkeypatch):
    """Work launched on a second stream (schedule.on_second_stream): every linear layer's dW and db; in
    the forward each layer's K and V products and their splits into heads (ops.linears) and
    the W^T copies of its six weights that backward's dX products read (made at any size
    here); nothing else; the backward ends joined; the gradients are the one-stream gradients
    bit for bit."""
    from numba import cuda

    from nanoandrea.kernels.matmul import float32
    monkeypatch.setattr(float32, "TRANSPOSED_COPY_MIN_ROWS", 1)
    config = get_preset("tiny", n_layer=1)   # (one layer shows every kind of launch)
    model = GPT(config, get_backend("cuda"), seed=2)
    idx, targets = batches(rng, config, 2, 5, 1, 1)[0][0]
    one = model.backend.to_device(np.ones(1, np.float32))
    side, streams, forward_launches = cuda.stream(), [], 0

    def grads():
        nonlocal forward_launches
        model.params.zero_grads()
        _, loss = model.forward(idx, targets, loss_grad=one)
        forward_launches = len(streams)
        schedule.join()
        loss.backward(one)
        schedule.join()
        return model.backend.to_host(model.params.grads)

    want = grads()
    streams.clear()
    real_launch = launch.launch

    def spy(kernel, *args, **kw):
        streams.append((kernel_name(kernel), launch.current_stream() is side))
        real_launch(kernel, *args, **kw)
    for module in list(sys.modules.values()):       # every launcher's `launch`
        if module.__name__.startswith("nanoandrea.") and getattr(module, "launch", None) is real_launch:
            monkeypatch.setattr(module, "launch", spy)
    with schedule.second_stream(side):
        got = grads()
        assert not schedule._forked and not schedule._pending       # backward ended joined
    assert np.array_equal(got, want)
    split = "split_heads4_kernel" if config.head_size % 4 == 0 else "split_heads_kernel"
    beside = {name for name, on_side in streams if on_side}
    assert beside == {"matmul_tiled_kernel", "sum_rows8_kernel", "transpose_kernel", split}
    products = [on_side for name, on_side in streams[forward_launches:] if "matmul" in name]
    assert sum(products) == len(products) / 2          # of each layer's two products, dW beside
    assert "transpose_kernel" not in {name for name, _ in streams[forward_launches:]}
    in_forward = Counter(name for name, on_side in streams[:forward_launches] if on_side)
    assert in_forward == Counter({"matmul_tiled_kernel": 2 * config.n_layer, split:
                                  2 * config.n_layer, "transpose_kernel": 6 * config.n_layer})


def kernel_name(kernel):
    function = getattr(kernel, "py_func", None) or getattr(kernel, "fn", kernel)
    return getattr(function, "__name__", str(kernel))
