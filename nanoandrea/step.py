"""One training step, and its capture as a CUDA graph; the evaluation's forward likewise.

    step(batches, seeds, lr)      zero the gradients; for each micro-batch: forward, backward;
                                  then AdamW. Returns the loss summed over the micro-batches,
                                  a device array [1] (read it later: reading waits for the GPU).
    evaluation.add(x, y)          the loss of one batch, without gradients or dropout, added to
    evaluation.mean()             a device total; the mean of those added, read once (EvalStep)

The walk from the training loop to a kernel launch, here for the LM head's product (the first
step runs eagerly and launches; later steps replay what it recorded):
    train.loop                    loss = run.stepper(batches, seeds, lr)
    step.TrainStep.__call__       the batch, seeds and lr to device buffers; self._run()
    step.GraphedCall._run         eager the first time: self._body(); later: the graph replayed
    step.TrainStep._body          zero the gradients; model.forward(batch), backward, AdamW
    model.GPT.forward             embedding, the blocks, ln_f; logits = ops.linear(x, wte^T)
    ops.linear                    backend.matmul(logits, x_operand, wte_operand, ...)
                                  (wte_operand: wte's bf16 copy, which the last AdamW wrote)
    kernels/matmul matmul_bf16    operands in bf16 (rounded once already), then matmul(...)
    kernels/matmul matmul         choose(): "wgmma" on an H100 -> wgmma.matmul_wgmma(...)
    kernels/matmul/wgmma.py       launch(wgmma_matmul_kernel(...), grid, 384 threads, ...)
    kernels/runtime/launch.py     kernel[grid, block, stream, shared bytes](*args)

Eagerly, a step is ~700 kernel launches from Python, each behind ~0.2 ms of it: for a
small model the GPU waits on Python. So on the GPU the step is run eagerly once (compiling
every kernel and counting the bytes it allocates), then captured once as a CUDA graph and from
then on replayed with one call:

    capture   a CuPy stream is put in capture mode; Numba launches onto it (as an external
              stream) are recorded, not run. Every allocation inside the step comes from one
              arena sized by the first step (kernels/runtime/memory.allocate_from), so the graph's
              addresses stay valid and a step allocates nothing after the first.
    replay    what changes between steps is copied into fixed device buffers first: the token
              ids (TokenBatch.load), the dropout seeds, the learning rate and Adam's bias
              corrections (AdamW.prepare). Nothing in the step waits for the host.
    streams   the capture has a second stream (`second_stream=True`, nanoandrea/schedule.py):
              the weight gradients run on it beside the rest of the backward pass, and in the
              forward a layer's K and V products beside its Q and the W^T copies the input
              gradients read; the graph holds both, joined before the update. The same
              kernels on the same data: the same bits as one stream.

`cuda_graph=False` (train --no-cuda-graph) runs every step eagerly; the results are the same
bit for bit, which tests/test_cli.py checks on the GPU.

The evaluation's forward is captured the same way (EvalStep), on the training step's stream, so
that the two graphs run one after the other, in an arena of its own. An evaluation is 200
forwards: eagerly a forward of andrea-12m's 64 x 256 tokens is ~34 ms of the
host's launches, replayed ~3 ms (docs/perf.md), and the default recipe's evaluations would
otherwise take three times its training steps. Where the arena does not fit in the GPU's
memory, the evaluation runs eagerly.

Data-parallel (`parallel`, a distributed.GradientBuckets): the loss's gradient is
1/(grad_accum * ranks), each layer's gradient bucket is all-reduced (summed) as the last
micro-batch's backward finishes it, then the loss, then the update. Where the communication
goes in a captured step (`communicate_in_graph`):
    True    inside the graph: the buckets' all-reduces on the second stream, beside the rest
            of backward (NCCL 2.9 and later may be captured when its stream is part of the
            capture, as the second stream is); the update, and ZeRO-1's all-gather, after
    False   beside it: the graph holds forward and backward only; the all-reduces (all at
            the end: no overlap) and the update run eagerly after each replay, a few launches
The same kernels and the same sums either way.
"""
import numpy as np

from . import autograd, schedule
from .batch import TokenBatch
from .kernels.dropout import mix32
from .kernels.ptx import tma
from .kernels.runtime import launch, memory


def dropout_seed(seed, step, micro, rank=0):
    """The dropout masks of (step, micro-batch): a hash (the kernels' own, kernels/dropout.py),
    so a resumed run draws the same ones; on rank r > 0 of several, hashed again with r (each
    rank's rows get masks of their own)."""
    mixed = mix32(mix32(seed) ^ mix32(step * 64 + micro + 1))
    return mixed if rank == 0 else mix32(mixed ^ mix32(rank))


def evaluation_seed(seed, step, split):
    """The seed of the batches an evaluation at `step` draws from `split`: the training
    batches never depend on when evaluations happen, and a resumed run draws the same."""
    return mix32(seed + 7919 * step + (split == "val"))


class GraphedCall:
    """What a captured call shares: its streams, its first run eager (counting the bytes it
    allocates), its capture into a CUDA graph and its replays. A subclass's `_body()` is the
    call; `_captured_body()` what the capture records (the body, by default). streams: another
    GraphedCall whose streams to launch on (the graphs then run one after the other)."""

    def __init__(self, backend, cuda_graph, second_stream=False, streams=None):
        self.backend = backend
        self.cuda_graph = cuda_graph and backend.name == "cuda" and memory.CUPY_POOL
        self.graph = None
        self.arena_bytes = None
        self.stream = self.side_stream = None
        self.launch_stream = launch.current_stream()
        if streams is not None and self.cuda_graph:
            self.stream, self.launch_stream = streams.stream, streams.launch_stream
            self.side_stream = streams.side_stream if second_stream else None
        elif self.cuda_graph:
            import cupy
            from numba import cuda
            # capture needs a stream of its own; a blocking one, so work on the default stream
            # (the caller's copies and events) stays ordered with it
            self.stream = cupy.cuda.Stream(non_blocking=False)
            self.launch_stream = cuda.external_stream(self.stream.ptr)
            if second_stream:
                self.side = cupy.cuda.Stream(non_blocking=True)
                self.side_stream = cuda.external_stream(self.side.ptr)

    def _run(self):
        """The body: eagerly (the first time, counting its bytes; always without graphs), else
        replayed (captured at the first replay). Returns whether it was replayed."""
        if not self.cuda_graph:
            self._body()
            return False
        if self.arena_bytes is None:
            with memory.count_allocations() as tally:
                self._body()
            self.arena_bytes = tally.bytes
            return False
        if self.graph is None:
            self._capture()
        self.graph.launch(stream=self.stream)
        return True

    def _captured_body(self):
        self._body()

    def _capture(self):
        import cupy
        self.arena = memory.Arena(self.arena_bytes)
        with self.stream, memory.allocate_from(self.arena), tma.made_while_capturing():
            self.stream.begin_capture()
            try:
                if self.side_stream is None:
                    self._captured_body()
                else:
                    with schedule.second_stream(self.side_stream):
                        self._captured_body()
            finally:
                self.graph = self.stream.end_capture()
        cupy.get_default_memory_pool().free_all_blocks()    # the eager call's cached blocks


class TrainStep(GraphedCall):
    def __init__(self, model, optimizer, batch_size, block_size, grad_accum=1, train=True,
                 cuda_graph=True, second_stream=True, parallel=None, communicate_in_graph=True):
        super().__init__(model.backend, cuda_graph, second_stream)
        self.model = model
        self.optimizer = optimizer
        backend = self.backend
        self.grad_accum = grad_accum
        self.train = train
        self.batches = [TokenBatch(backend, batch_size, block_size, model.config.vocab_size)
                        for _ in range(grad_accum)]
        self.seeds = backend.to_device(np.zeros(grad_accum, dtype=np.int64))
        self.loss = backend.zeros((1,))                 # the step's loss, summed over micro-batches
        self.parallel = parallel
        self.communicate_in_graph = communicate_in_graph
        ranks = 1 if parallel is None else parallel.communicator.size
        self.loss_grad = backend.zeros((1,))            # d(mean over micro-batches and ranks)
        backend.fill(self.loss_grad, 1.0 / (grad_accum * ranks))        # /d(loss)

    def __call__(self, batches, seeds, lr):
        """batches: grad_accum pairs (x, y) of host ids [B,T]; seeds: grad_accum dropout seeds
        (dropout_seed). What changes between steps goes to fixed device buffers first, then
        the step runs (eagerly, or its graph replayed)."""
        with launch.using_stream(self.launch_stream):
            for batch, (x, y) in zip(self.batches, batches, strict=True):
                batch.load(x, y)
            self.backend.copy_from_host(self.seeds, np.asarray(seeds, dtype=np.int64))
            self.optimizer.prepare(lr)
            replayed = self._run()
            if replayed and self.parallel is not None and not self.communicate_in_graph:
                self._communicate_and_update()
        return self.loss

    def _body(self, communicate=True):
        """The step itself: every launch in here is what the graph records. communicate=False:
        without the data-parallel communication and the update (they follow the graph)."""
        parallel = self.parallel if communicate else None
        self.optimizer.zero_grad()
        for micro, batch in enumerate(self.batches):
            self.model.dropout_seed = self.seeds[micro:micro + 1]
            _, loss = self.model.forward(batch, train=self.train, loss_grad=self.loss_grad)
            schedule.join()             # (the W^T copies the backward reads)
            last = parallel is not None and micro == len(self.batches) - 1
            if last:                    # (each bucket's all-reduce as backward completes it)
                parallel.arm(autograd.recorded())
            loss.backward(self.loss_grad, after_node=parallel.after_node if last else None)
            schedule.join()             # (the weight gradients)
            self.backend.add_into(self.loss, loss.data, accumulate=micro > 0)
        if self.parallel is None:
            self.optimizer.update()
        elif communicate:
            self._communicate_and_update()

    def _captured_body(self):
        self._body(self.communicate_in_graph)

    def _communicate_and_update(self):
        self.parallel.finish(self.loss)
        self.optimizer.update()


class EvalStep(GraphedCall):
    """The evaluation's loss over batches of batch_size x block_size: `add(x, y)` runs one
    batch's forward (no gradients, no dropout) and adds its mean loss to a device total;
    `mean()` reads the total once, the mean of the losses added since the last mean() (the
    eager loop read each batch's, a wait each). On the GPU captured as the training step is
    (`streams`: the TrainStep whose stream it runs on); where the graph's arena does not fit
    in memory, eager."""

    def __init__(self, model, batch_size, block_size, cuda_graph=True, streams=None):
        super().__init__(model.backend, cuda_graph, streams=streams)
        self.model = model
        self.batch = TokenBatch(self.backend, batch_size, block_size, model.config.vocab_size,
                                with_grouping=False)
        self.total = self.backend.zeros((1,))
        self.count = 0

    def add(self, x, y):
        with launch.using_stream(self.launch_stream):
            self.batch.load(x, y)
            try:
                self._run()
            except MemoryError:             # (the arena: memory.Arena's, or CuPy's)
                self.cuda_graph, self.graph, self.arena = False, None, None
                self._body()
        self.count += 1

    def mean(self):
        with launch.using_stream(self.launch_stream):
            total = float(self.backend.to_host(self.total)[0])
            self.backend.fill(self.total, 0.0)
        count, self.count = self.count, 0
        return total / count

    def _body(self):
        with autograd.no_grad():
            _, loss = self.model.forward(self.batch)
        self.backend.add_into(self.total, loss.data, accumulate=True)
