"""Data-parallel training (nanoandrea/distributed.py) for real, across CPU processes on the
NumPy backend: ranks started by `train --gpus N` and by torchrun's variables, talking
through the socket communicator (the NCCL one's interface), train as one process on the same
global batch, resume on another number of ranks, and stop together when one dies or hangs.
On a GPU: the NCCL path with a world of one is the plain step, bit for bit."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import GPU
from nanoandrea import autograd
from nanoandrea.backend import get_backend
from nanoandrea.checkpoint import read_checkpoint
from nanoandrea.config import get_preset
from nanoandrea.distributed import GradientBuckets, start_ranks
from nanoandrea.model import GPT
from nanoandrea.optim import AdamW, shard_bounds

ROOT = Path(__file__).resolve().parents[1]
TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
        "First Citizen:\nYou are all resolved rather to die than to famish?\n\n") * 40
# 6 sequences a step: 3 a rank on 2 ranks, 2 on 3; 2 micro-batches, so accumulation is crossed
RUN = ["--device", "cpu", "--preset", "tiny", "--batch-size", "6", "--block-size", "8",
       "--grad-accum", "2", "--eval-iters", "2", "--log-interval", "1", "--warmup-steps", "2",
       "--lr", "3e-3", "--dropout", "0", "--eval-interval", "10"]


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    return path


def environment(tmp_path, **extra):
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path, NANOANDREA_CACHE=str(tmp_path / "cache"), **extra)


def train(tmp_path, *arguments):
    """One `nanoandrea train` process (it starts the ranks itself with --gpus)."""
    done = subprocess.run([sys.executable, "-m", "nanoandrea", "train", *map(str, arguments)],
                          env=environment(tmp_path), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


def torchrun_style(tmp_path, ranks, *arguments):
    """`ranks` processes started as torchrun starts them: RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT in their environment."""
    from nanoandrea.distributed import _free_port
    port = str(_free_port())
    processes = [subprocess.Popen(
        [sys.executable, "-m", "nanoandrea", "train", *map(str, arguments)],
        env=environment(tmp_path, RANK=str(r), WORLD_SIZE=str(ranks), LOCAL_RANK=str(r),
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(ranks)]
    return processes


def metrics(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def curve(out):
    """Every logged number, by step: the train loss and gradient norm, the evaluations."""
    return [(r["step"], r.get("loss"), r.get("grad_norm"), r.get("val_loss"), r.get("train_loss"))
            for r in metrics(out)]


def assert_close_curves(got, want):
    assert [row[0] for row in got] == [row[0] for row in want]
    for row_got, row_want in zip(got, want):
        for a, b in zip(row_got[1:], row_want[1:]):
            assert (a is None) == (b is None)
            if a is not None:
                assert abs(a - b) <= 2e-5 * abs(b), (row_got, row_want)


def test_ranks_train_as_one_process_on_the_same_global_batch(corpus, tmp_path):
    """20 steps of one process, of 2 ranks started by --gpus and of 3 ranks started by
    torchrun's variables with ZeRO-1: the same losses, gradient norms and evaluations within
    float32 rounding (the ranks' sums of shard gradients are added in another order)."""
    steps = ("--data", corpus, "--max-steps", "20", *RUN)
    train(tmp_path, *steps, "--out", tmp_path / "one")
    output = train(tmp_path, *steps, "--out", tmp_path / "two", "--gpus", "2")
    assert "over 2 ranks (3 sequences each)" in output
    assert output.count("step    20 | loss") == 1                 # rank 0 alone logs
    ranks = torchrun_style(tmp_path, 3, *steps, "--out", tmp_path / "three", "--zero1")
    outputs = [p.communicate(timeout=300) for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0, 0], outputs[0][1][-3000:]
    assert "ZeRO-1" in outputs[0][0] and outputs[1][0] == outputs[2][0] == ""
    want = curve(tmp_path / "one")
    assert len([row for row in want if row[1] is not None]) == 20
    assert_close_curves(curve(tmp_path / "two"), want)
    assert_close_curves(curve(tmp_path / "three"), want)
    one, three = read_checkpoint(tmp_path / "one" / "ckpt"), read_checkpoint(tmp_path / "three" / "ckpt")
    assert np.allclose(three["m"], one["m"], rtol=1e-3, atol=1e-9)   # (gathered from 3 shards)
    assert one["m"].shape == three["m"].shape and np.count_nonzero(three["v"]) > 0


def test_resume_on_the_same_and_on_another_number_of_ranks(corpus, tmp_path):
    """A 2-rank run stopped at step 6 and resumed on 2 ranks is the uninterrupted 2-rank run
    to the bit; its checkpoint resumed on 3 ranks (ZeRO-1: each takes its shard of AdamW's
    state) goes on within float32 rounding of it."""
    steps = ("--data", corpus, "--max-steps", "12", *RUN, "--eval-interval", "6")
    train(tmp_path, *steps, "--out", tmp_path / "whole", "--gpus", "2")
    train(tmp_path, *steps, "--out", tmp_path / "parts", "--gpus", "2", "--stop-at", "6")
    shutil.copytree(tmp_path / "parts", tmp_path / "parts3", symlinks=True)
    assert "resumed from" in train(tmp_path, "--out", tmp_path / "parts", "--resume",
                                   "--device", "cpu", "--gpus", "2")
    assert curve(tmp_path / "parts") == curve(tmp_path / "whole")
    train(tmp_path, "--out", tmp_path / "parts3", "--resume", "--device", "cpu", "--gpus", "3",
          "--zero1")
    assert_close_curves(curve(tmp_path / "parts3"), curve(tmp_path / "whole"))


def mpi_available():
    import importlib.util
    return importlib.util.find_spec("mpi4py") is not None and shutil.which("mpirun") is not None


@pytest.mark.skipif(not mpi_available(), reason="needs mpi4py and mpirun")
def test_ranks_started_by_mpirun_train_as_one_process(corpus, tmp_path):
    """mpirun -np 2: rank and size from MPI, rank 0's address broadcast over MPI."""
    steps = ("--data", corpus, "--max-steps", "6", *RUN)
    train(tmp_path, *steps, "--out", tmp_path / "one")
    # (Open MPI refuses to start as root, as a GPU machine's container may run, unless told;
    # MPICH ignores the two variables)
    env = dict(environment(tmp_path), OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    done = subprocess.run(["mpirun", "-np", "2", sys.executable, "-m",
                           "nanoandrea", "train", *map(str, steps), "--out", tmp_path / "mpi"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "over 2 ranks" in done.stdout
    assert_close_curves(curve(tmp_path / "mpi"), curve(tmp_path / "one"))


def wait_for(condition, seconds, what):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_rank_that_dies_or_hangs_stops_the_others_with_one_line(corpus, tmp_path):
    """3 ranks; rank 2 killed (SIGKILL): ranks 0 and 1 stop at once, one line naming rank 2.
    Then 3 ranks again; rank 1 stopped (SIGSTOP, a hang): the others stop within the timeout
    (5 s), one line naming rank 1. The checkpoint written before is whole both times."""
    timeout = 5
    for victim, sig, said in ((2, signal.SIGKILL, "rank 2 exited"),
                              (1, signal.SIGSTOP, "rank 1 stopped responding")):
        out = tmp_path / f"run-{victim}"
        ranks = torchrun_style(tmp_path, 3, "--data", corpus, "--max-steps", "100000", *RUN,
                               "--eval-interval", "5", "--out", out, "--rank-timeout", timeout)
        try:
            wait_for(lambda: (out / "ckpt").exists() or any(p.poll() is not None for p in ranks),
                     120, "the first checkpoint")
            assert all(p.poll() is None for p in ranks), ranks[0].communicate()[1][-3000:]
            ranks[victim].send_signal(sig)
            started = time.monotonic()
            survivors = [p for r, p in enumerate(ranks) if r != victim]
            wait_for(lambda: all(p.poll() is not None for p in survivors), timeout + 10,
                     "the other ranks to stop")
            stopped_after = time.monotonic() - started
        finally:
            for p in ranks:
                if p.poll() is None:
                    p.kill()
        errors = []
        for p in survivors:
            assert p.returncode == 1
            errors += [line for line in p.communicate()[1].splitlines() if "Error" in line]
        assert len(errors) == 1 and errors[0].startswith("Error: ") and said in errors[0], errors
        assert stopped_after < timeout + 5
        assert read_checkpoint(out / "ckpt")["state"]["step"] % 5 == 0


def test_sigterm_to_train_gpus_stops_every_rank_with_one_line(corpus, tmp_path):
    """A job scheduler's SIGTERM reaches `train --gpus 2` alone: rank 0 is sent it, and every
    rank stops, with one line naming the step the last checkpoint holds."""
    out = tmp_path / "run"
    process = subprocess.Popen([sys.executable, "-m", "nanoandrea", "train", "--data", corpus,
                                "--max-steps", "100000", *RUN, "--eval-interval", "5", "--out",
                                out, "--gpus", "2"], env=environment(tmp_path),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (out / "ckpt").exists() or process.poll() is not None, 120,
                 "the first checkpoint")
        process.send_signal(signal.SIGTERM)
        output, errors = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    errors = [line for line in (output + errors).splitlines() if "Error" in line]
    step = read_checkpoint(out / "ckpt")["state"]["step"]
    assert process.returncode == 1 and len(errors) == 1, errors
    assert re.fullmatch(rf"Error: rank 0: terminated \(SIGTERM\) at step \d+; the last "
                        rf"checkpoint, {re.escape(str(out / 'ckpt'))}, holds step {step}; "
                        rf"stopping every rank", errors[0]), errors


# --- the buckets, in one process ---------------------------------------------------------------

class RecordingCommunicator:
    """A world of one that keeps what each all-reduce was handed, at the moment it was."""
    rank, size = 0, 1

    def __init__(self):
        self.calls = []

    def all_reduce(self, arrays):
        self.calls.append([np.array(a) for a in arrays])

    def all_gather(self, array, bounds):
        pass


def test_each_bucket_goes_out_once_its_gradients_are_final_and_before_backward_ends(rng):
    """A real backward of the tiny model: every gradient entry is in exactly one bucket; the
    buckets go out last layer first; what each is handed is already the final gradient."""
    config = get_preset("tiny", n_layer=3)
    model = GPT(config, get_backend("numpy"), seed=1)
    store = model.params
    communicator = RecordingCommunicator()
    buckets = GradientBuckets(store, communicator)
    covered = np.zeros(store.size, int)
    for ranges in buckets.ranges:
        for start, end in ranges:
            covered[start:end] += 1
    for name in store:
        start = store.offsets[name]
        assert np.all(covered[start:start + store[name].data.size] == 1), name
    assert [names[0].split(".")[1] for names in buckets.names[:-1]] == ["2", "1", "0"]

    idx = rng.integers(0, config.vocab_size, size=(2, 8))
    store.zero_grads()
    _, loss = model.forward(idx, idx)
    buckets.arm(autograd.recorded())
    loss.backward(after_node=buckets.after_node)
    assert len(communicator.calls) == len(buckets.ranges) and all(buckets.launched)
    for call, ranges in zip(communicator.calls, buckets.ranges):
        for handed, (start, end) in zip(call, ranges):
            assert np.array_equal(handed, store.grads[start:end])
    assert np.count_nonzero(store.grads) > 0.9 * store.count


def test_buckets_launch_while_backward_runs(rng):
    """The number of backward nodes done at each bucket's launch: the layers' buckets go out
    before the last node, in order, the embeddings' bucket after it."""
    config = get_preset("tiny", n_layer=3)
    model = GPT(config, get_backend("numpy"), seed=1)
    at_launch = []
    done = [0]

    class Counting(RecordingCommunicator):
        def all_reduce(self, arrays):
            at_launch.append(done[0])

    buckets = GradientBuckets(model.params, Counting())
    idx = rng.integers(0, config.vocab_size, size=(2, 8))
    _, loss = model.forward(idx, idx)
    nodes = len(autograd.recorded())
    buckets.arm(autograd.recorded())

    def after(inputs):
        done[0] += 1
        buckets.after_node(inputs)
    loss.backward(after_node=after)
    assert at_launch == sorted(at_launch) and len(at_launch) == config.n_layer + 1
    assert all(count < nodes for count in at_launch[:-1])      # the layers' buckets go early
    assert at_launch[-1] == nodes                               # the embeddings' at the end


def test_shards_cover_the_buffer_aligned():
    for size, ranks in ((10, 3), (4096, 3), (7, 8), (1_000_003 * 4, 5)):
        bounds = shard_bounds(size, ranks)
        assert bounds[0] == 0 and bounds[-1] == size and bounds == sorted(bounds)
        assert all(b % 4 == 0 for b in bounds[:-1])
        assert max(np.diff(bounds)) - min(np.diff(bounds)) <= 4 + 4


class SecondRankOf:
    """A world of two seen from rank 0: rank 1's update of its shard is `reference`'s (a model
    that ran AdamW over all of P), which all_gather hands over."""
    size, rank = 2, 0

    def __init__(self, reference):
        self.reference = reference

    def all_gather(self, array, bounds):
        array[bounds[1]:bounds[2]] = self.reference.params.params[bounds[1]:bounds[2]]


def test_zero1_in_bf16_makes_the_copies_of_every_rank_shard(rng):
    """bf16 under ZeRO-1 (NumPy twins): a rank updates its shard only and gathers the rest; its
    weights are AdamW's over all of P, and so are the bf16 copies the next step's products read,
    the other rank's shard included, to the bit."""
    from nanoandrea.optim import ShardedAdamW
    config = get_preset("tiny", n_embd=32, n_head=1)
    backend = get_backend("numpy", precision="bf16")
    reference, model = GPT(config, backend, seed=4), GPT(config, backend, seed=4, moments=False)
    reference_optimizer = AdamW(reference.params, lr=0.1)
    optimizer = ShardedAdamW(model.params, SecondRankOf(reference), lr=0.1)
    assert 0 < optimizer.hi < model.params.n_decay       # (rank 1's shard holds matrices too)
    for _ in range(2):
        grads = rng.standard_normal(model.params.size).astype(np.float32)
        for store, adamw in ((reference.params, reference_optimizer),
                             (model.params, optimizer)):
            store.grads[...] = grads
            adamw.step()
        assert np.array_equal(model.params.params, reference.params.params)
        assert np.array_equal(model.params.bf16_copies, reference.params.bf16_copies)
    assert model.params.bf16_copies.any()


def test_start_ranks_passes_the_failure_on(tmp_path):
    """--gpus N's launcher: the ranks' environment, and the status of a failed rank."""
    script = tmp_path / "rank.py"
    script.write_text("import os, sys\n"
                      "print(os.environ['RANK'], os.environ['WORLD_SIZE'], os.environ['LOCAL_RANK'],"
                      " os.environ['MASTER_ADDR'], flush=True)\n"
                      "sys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    assert start_ranks(2, [], timeout=1, program=[sys.executable, str(script)]) == 3


# --- on a GPU: NCCL with a world of one is the plain step ---------------------------------------

def nccl_available():
    try:
        from cupy.cuda import nccl
        return nccl.get_version() > 0
    except Exception:
        return False


@pytest.mark.skipif(not GPU or not nccl_available(), reason="needs a GPU and CuPy's NCCL")
@pytest.mark.parametrize("communicate_in_graph,zero1,precision", [
    (True, False, "fp32"), (False, False, "fp32"), (True, True, "fp32"), (True, True, "bf16")])
def test_nccl_world_of_one_equals_the_plain_step(rng, communicate_in_graph, zero1, precision):
    """andrea-mini, 5 steps (the graph captured at the second), 2 micro-batches: the losses
    and parameters of the NCCL step with a world of one are the plain step's, bit for bit,
    with the all-reduces inside the graph, after it, and under ZeRO-1; in bf16 ZeRO-1's
    products read the weights' copies its rounding pass made after the gather, the plain
    step's those AdamW wrote."""
    from nanoandrea.distributed import Address, World, _free_port, data_parallel
    from nanoandrea.step import TrainStep
    config = get_preset("andrea-mini", vocab_size=65, dropout=0.1)
    B, T, grad_accum = 8, 64, 2
    backend = get_backend("cuda", precision=precision)
    data = [[(rng.integers(0, 65, (B, T)), rng.integers(0, 65, (B, T)))
             for _ in range(grad_accum)] for _ in range(5)]

    def run(world):
        sharded = zero1 and world is not None       # (the plain run keeps AdamW's moments)
        model = GPT(config, backend, seed=4, moments=not sharded)
        parallel = None
        if world is None:
            optimizer = AdamW(model.params, lr=3e-3)
        else:
            optimizer, parallel = data_parallel(model.params, world.connect(backend), zero1,
                                                lr=3e-3)
        step = TrainStep(model, optimizer, B, T, grad_accum, parallel=parallel,
                         communicate_in_graph=communicate_in_graph)
        losses = [float(backend.to_host(step(micro, [7 * n, 7 * n + 1], 3e-3))[0])
                  for n, micro in enumerate(data)]
        assert step.graph is not None
        return losses, backend.to_host(model.params.params)

    plain = run(None)
    nccl = run(World(0, 1, 0, Address("127.0.0.1", _free_port())))
    assert nccl[0] == plain[0]
    assert np.array_equal(nccl[1], plain[1])


@pytest.mark.skipif(not GPU or not nccl_available(), reason="needs a GPU and CuPy's NCCL")
@pytest.mark.parametrize("extra", [(), ("--zero1",), ("--no-overlap-comm",)])
def test_train_on_one_gpu_through_nccl_equals_plain_train(corpus, tmp_path, extra):
    """`train --gpus 1` (a rank of its own, NCCL, the all-reduces in the CUDA graph or after
    it, ZeRO-1) logs the plain `train`'s numbers, bit for bit."""
    steps = ("--data", corpus, "--max-steps", "12", "--preset", "andrea-mini", "--batch-size",
             "8", "--block-size", "64", "--eval-iters", "2", "--log-interval", "1",
             "--eval-interval", "6", "--dropout", "0.1", "--device", "cuda")
    train(tmp_path, *steps, "--out", tmp_path / "plain")
    train(tmp_path, *steps, "--out", tmp_path / "nccl", "--gpus", "1", *extra)
    assert curve(tmp_path / "nccl") == curve(tmp_path / "plain")


def test_pytorch_ddp_baseline_keeps_its_ranks_equal(tmp_path):
    """tools/baselines/torch_ddp.py (the several-GPU baseline) under torchrun, 2 CPU ranks on
    gloo: it trains, reports tokens/s, and both ranks end with the same parameters (DDP
    averaged them)."""
    from nanoandrea.distributed import _free_port
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_port", str(_free_port()), str(ROOT / "tools" / "baselines" / "torch_ddp.py"),
         "--preset", "andrea-mini", "--batch-size", "4", "--block-size", "32", "--vocab-size",
         "65", "--steps", "3", "--warmup", "1", "--precision", "fp32", "--device", "cpu"],
        env=environment(tmp_path), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    sums = dict(re.findall(r"rank (\d): parameters' sum (\S+),", done.stdout))
    assert sorted(sums) == ["0", "1"] and sums["0"] == sums["1"], done.stdout
    assert "PyTorch DDP, 2 ranks (cpu)" in done.stdout and "tokens/s" in done.stdout
