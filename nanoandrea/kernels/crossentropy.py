"""Softmax cross-entropy over the vocabulary, fused: the probabilities are never stored.

    logits : [N,Vp]   (N = B*T positions; the first V columns are the vocabulary's, the rest
                      padding, Vp >= V: config.padded_vocab_size)      targets: int32 [N]
    losses : [N]      losses[n] = lse[n] - logits[n, targets[n]]
    lse    : [N]      log sum_v exp(logits[n, v]), saved for backward
    loss   : [1]      mean of losses
In training the loss's gradient is known before backward runs (1, or 1/micro-batches), so
crossentropy_forward_backward computes the loss and dlogits in one kernel (llm.c's fused
classifier): the [N,V] logits, the largest activation of a GPT-2 step, are read twice, not three
times. The log-sum-exp is computed in one pass with a running max (online softmax). Rows of
4k floats (the model's padded vocabulary) take crossentropy_fused4_kernel: 16-byte loads and
stores, a row's two reads (before and after its log-sum-exp) by one block.
Backward of the mean loss (dloss: [1], the upstream gradient, usually 1):
    dlogits[n, v] = (exp(logits[n, v] - lse[n]) - [v == targets[n]]) * dloss / N
The max is subtracted before exp, so logits of magnitude 100 (or 1e4) are fine in float32.
Padding columns (v >= V) are outside the softmax: their gradient is written as 0 (the LM head's
backward multiplies the whole padded row).
In bf16 training the fused kernel writes dlogits as the LM head's backward products read it, a
Bf16Matrix: each gradient rounded as round_bf16 would round the float32 one, so the same bits,
but 2 bytes a logit written where float32 wrote 4 and a rounding pass then read them.

Logits in bf16 (a Bf16Matrix, as the LM head's product writes them in bf16 training and
evaluation, as autocast's are bf16) take bf16_logits_kernel, which reads each row ONCE into
shared memory (a row of 50304 bf16 is 98 KB) and writes the gradient from there. At
andrea-120m's [16384, 50304] that is 1.6 GB read and 1.6 GB written, where float32 logits cost
3.3 GB read twice and 1.6 GB written (and the LM head's product wrote 3.3 GB, now 1.6).
That traffic bounds the kernel only if the memory never waits for the threads, so its blocks
are PERSISTENT and double-buffered: one a multiprocessor (two 98 KB rows fill its shared
memory), block b taking rows b, b + blocks, b + 2 blocks, ...; while it reduces one row and
writes its gradient, its next row streams into the other buffer by cp.async (16-byte copies
straight to shared memory, holding no registers). Each thread owns the same 16-byte chunks of
every row: it copies them, folds them into its running max and sum, and reads them back for
the gradient, so a buffer is refilled without a barrier. The block meets only to combine the
threads' sums (reduce.py's fixed tree; while it does, the next row is still streaming in), so
the same bits every run. Rows too long for two buffers take one (the next row copied in once
this one is done); rows too long for one go through float32 values and the float32 kernels.
The logits are taken in base 2 (x log2 e) and the exponentials are ex2.approx (ptx/sfu.py:
relative error ~2^-22, far below bf16's rounding of the logits): with half the bytes, the
exact exp would bound the kernel instead of the memory, and for the same reason a chunk of
eight classes without the target (all but one or two a row) skips the tests of each column.
Its arithmetic is, step for step, that of the simpler kernel of a block a row kept in
tools/dev/loss_bench.py (a test holds every output to the same bits), so the default recipe's
losses do not depend on which of the two computes them.
"""
import math

import numpy as np
from numba import cuda, float32, float64

from .operands import (Bf16Matrix, bf16_matrix_values, bf16_values, device_empty, round_bf16,
                       round_bf16_numpy)
from .ptx.asynccopy import commit_copies, copy16_async, wait_copies
from .ptx.mma import bf16_pair, bf16_unpair, load4_u32, store4_u32
from .ptx.sfu import exp2_fast
from .ptx.vector import aligned16, load4, store4
from .ptx.wgmma import dynamic_shared_words
from .reduce import MAX_THREADS, block_max, block_sum
from .runtime import device
from .runtime.device import SIMULATOR
from .runtime.launch import check, check_float32, check_shape, inlined, kernel_factory, launch

THREADS = 32 if SIMULATOR else 256
NEG_INF = float32(-np.inf)


@inlined
def row_logsumexp(logits, n, V, scratch):
    # log sum_{v<V} exp(logits[n, v]) in ONE pass over the row: each thread keeps a running max m
    # and sum s of exp(x - m) over its elements (rescaling s when m grows), then the block
    # combines them: M = max of the m's, S = sum of s * exp(m - M).
    m = NEG_INF
    s = float32(0.0)
    for v in range(cuda.threadIdx.x, V, cuda.blockDim.x):
        x = logits[n, v]
        if x > m:
            s = s * math.exp(m - x) + float32(1.0)
            m = x
        else:
            s += math.exp(x - m)
    row_max = block_max(m, scratch)
    s = s * math.exp(m - row_max) if m > NEG_INF else float32(0.0)
    return row_max + math.log(block_sum(s, scratch))


@inlined
def class_gradient(logits, n, v, V, row_lse, target):
    # d loss_n / d logits[n, v] for a loss of weight 1: softmax - onehot for a class (v < V),
    # 0 for a padding column
    grad = float32(0.0)
    if v < V:
        grad = math.exp(logits[n, v] - row_lse)
        if v == target:
            grad -= float32(1.0)
    return grad


@cuda.jit
def crossentropy_forward_kernel(losses, lse, logits, targets, V):
    # losses[N], lse[N] from logits[N,Vp] (classes v < V); one block per row, threads stride
    # over the row
    scratch = cuda.shared.array(MAX_THREADS, float32)
    n = cuda.blockIdx.x
    row_lse = row_logsumexp(logits, n, V, scratch)
    if cuda.threadIdx.x == 0:
        lse[n] = row_lse
        losses[n] = row_lse - logits[n, targets[n]]


@cuda.jit
def crossentropy_fused_kernel(losses, lse, dlogits, logits, targets, dloss, V):
    # forward and backward at once, as llm.c's fused classifier: losses[N], lse[N] and
    # dlogits[N,Vp] = (softmax - onehot) * dloss[0] / N (0 in the padding columns v >= V),
    # where dloss is the gradient the loss
    # will be given (known before the backward pass in training). Two reads of the row (its
    # log-sum-exp, then the gradient) instead of three; one block per row.
    scratch = cuda.shared.array(MAX_THREADS, float32)
    n = cuda.blockIdx.x
    row_lse = row_logsumexp(logits, n, V, scratch)
    target = targets[n]
    if cuda.threadIdx.x == 0:
        lse[n] = row_lse
        losses[n] = row_lse - logits[n, target]
    scale = dloss[0] / logits.shape[0]
    for v in range(cuda.threadIdx.x, logits.shape[1], cuda.blockDim.x):
        dlogits[n, v] = class_gradient(logits, n, v, V, row_lse, target) * scale


@inlined
def class_or_padding(x, v, V):
    # a logit of the softmax (v < V), or -inf for a padding column, outside it
    return x if v < V else NEG_INF


@inlined
def add_to_running_sum(m, s, x0, x1, x2, x3, x4, x5, x6, x7):
    # the online softmax's (max m, sum s of exp(x - m)) after eight more values (-inf: none)
    new_m = max(max(max(m, x0), max(x1, x2)), max(max(x3, x4), max(max(x5, x6), x7)))
    if new_m == NEG_INF:
        return m, s
    s = s * math.exp(m - new_m) + (
        (math.exp(x0 - new_m) + math.exp(x1 - new_m)) + (math.exp(x2 - new_m) + math.exp(x3 - new_m))
        + (math.exp(x4 - new_m) + math.exp(x5 - new_m)) + (math.exp(x6 - new_m) + math.exp(x7 - new_m)))
    return new_m, s


@inlined
def load_classes4(logits, n, v, V):
    # logits[n, v:v+4] by one 16-byte load, -inf past the classes (and past the row)
    if v >= logits.shape[1]:
        return NEG_INF, NEG_INF, NEG_INF, NEG_INF
    x0, x1, x2, x3 = load4(logits, (n, v))
    return (class_or_padding(x0, v, V), class_or_padding(x1, v + 1, V),
            class_or_padding(x2, v + 2, V), class_or_padding(x3, v + 3, V))


@inlined
def gradient4(x, v, V, row_lse, target, scale):
    # class_gradient of logit x at column v, times scale (x: -inf in the padding, whose exp is 0)
    grad = math.exp(x - row_lse)
    if v == target:
        grad -= float32(1.0)
    return grad * scale if v < V else float32(0.0)


@inlined
def row_logsumexp4(logits, n, V, scratch):
    # row_logsumexp for rows of 4k floats, 16-byte aligned: a thread reads 4 columns at a time,
    # two 16-byte loads in flight (8 logits folded into its running max and sum at once)
    step = 4 * cuda.blockDim.x
    m, s = NEG_INF, float32(0.0)
    for v in range(4 * cuda.threadIdx.x, logits.shape[1], 2 * step):
        x0, x1, x2, x3 = load_classes4(logits, n, v, V)
        x4, x5, x6, x7 = load_classes4(logits, n, v + step, V)
        m, s = add_to_running_sum(m, s, x0, x1, x2, x3, x4, x5, x6, x7)
    row_max = block_max(m, scratch)
    s = s * math.exp(m - row_max) if m > NEG_INF else float32(0.0)
    return row_max + math.log(block_sum(s, scratch))


@inlined
def fused_row_start(losses, lse, logits, targets, dloss, V, scratch):
    # the fused 16-byte kernels' first half for row blockIdx.x: its logsumexp (row_logsumexp4),
    # lse and loss written; returns (row, its logsumexp, its target, the gradient's scale)
    n = cuda.blockIdx.x
    row_lse = row_logsumexp4(logits, n, V, scratch)
    target = targets[n]
    if cuda.threadIdx.x == 0:
        lse[n] = row_lse
        losses[n] = row_lse - logits[n, target]
    return n, row_lse, target, dloss[0] / logits.shape[0]


@cuda.jit
def crossentropy_fused4_kernel(losses, lse, dlogits, logits, targets, dloss, V):
    # crossentropy_fused_kernel for rows of 4k floats, 16-byte aligned (row_logsumexp4), the
    # gradient written 16 bytes at a time; one block per row, of THREADS threads (more rows in
    # flight beat larger blocks that keep a row in L2 for its second read: docs/perf.md).
    scratch = cuda.shared.array(MAX_THREADS, float32)
    n, row_lse, target, scale = fused_row_start(losses, lse, logits, targets, dloss, V, scratch)
    for v in range(4 * cuda.threadIdx.x, logits.shape[1], 4 * cuda.blockDim.x):
        x0, x1, x2, x3 = load_classes4(logits, n, v, V)
        store4(dlogits, (n, v), gradient4(x0, v, V, row_lse, target, scale),
               gradient4(x1, v + 1, V, row_lse, target, scale),
               gradient4(x2, v + 2, V, row_lse, target, scale),
               gradient4(x3, v + 3, V, row_lse, target, scale))


@cuda.jit
def crossentropy_fused_bf16_kernel(losses, lse, dlogit_pairs, logits, targets, dloss, V):
    # crossentropy_fused4_kernel with dlogits written as a Bf16Matrix's bf16 pairs [N, P/2] (P: Vp
    # rounded up to 8, zeros past Vp): a thread 8 gradients at a time, one 16-byte store
    scratch = cuda.shared.array(MAX_THREADS, float32)
    n, row_lse, target, scale = fused_row_start(losses, lse, logits, targets, dloss, V, scratch)
    for v in range(8 * cuda.threadIdx.x, 2 * dlogit_pairs.shape[1], 8 * cuda.blockDim.x):
        x0, x1, x2, x3 = load_classes4(logits, n, v, V)
        x4, x5, x6, x7 = load_classes4(logits, n, v + 4, V)
        store4_u32(dlogit_pairs, (n, v >> 1),
                   bf16_pair(gradient4(x0, v, V, row_lse, target, scale),
                             gradient4(x1, v + 1, V, row_lse, target, scale)),
                   bf16_pair(gradient4(x2, v + 2, V, row_lse, target, scale),
                             gradient4(x3, v + 3, V, row_lse, target, scale)),
                   bf16_pair(gradient4(x4, v + 4, V, row_lse, target, scale),
                             gradient4(x5, v + 5, V, row_lse, target, scale)),
                   bf16_pair(gradient4(x6, v + 6, V, row_lse, target, scale),
                             gradient4(x7, v + 7, V, row_lse, target, scale)))


# --- logits in bf16: persistent blocks, each row read once into shared memory ----------------

# bf16_logits_kernel's block, a constant: the stride of its loops over a row's chunks, which the
# compiler then counts without dividing (512: 12 or 13 chunks a thread at 50304 columns)
BF16_THREADS = 32 if SIMULATOR else 512
STATS_BYTES = 4 * MAX_THREADS               # its static shared memory: the reductions' scratch
LOG2E = float32(1.0 / math.log(2.0))


@inlined
def class_log2(x, v, V):
    # a logit in base-2 units (x log2 e), or -inf for a padding column, outside the softmax
    return x * LOG2E if v < V else NEG_INF


@inlined
def logits8_log2(w0, w1, w2, w3, v, V):
    # the eight logits of a 16-byte chunk (four bf16 pairs, columns v .. v + 7) in base 2, -inf
    # past the classes. All but a row's last chunk or two hold classes only: no test a column
    x0, x1 = bf16_unpair(w0)
    x2, x3 = bf16_unpair(w1)
    x4, x5 = bf16_unpair(w2)
    x6, x7 = bf16_unpair(w3)
    if v + 8 <= V:
        return (x0 * LOG2E, x1 * LOG2E, x2 * LOG2E, x3 * LOG2E, x4 * LOG2E, x5 * LOG2E,
                x6 * LOG2E, x7 * LOG2E)
    return (class_log2(x0, v, V), class_log2(x1, v + 1, V), class_log2(x2, v + 2, V),
            class_log2(x3, v + 3, V), class_log2(x4, v + 4, V), class_log2(x5, v + 5, V),
            class_log2(x6, v + 6, V), class_log2(x7, v + 7, V))


@inlined
def add_to_running_sum2(m, s, x0, x1, x2, x3, x4, x5, x6, x7):
    # the online softmax in base 2: (max m, sum s of 2^(x - m)) after eight more values (-inf:
    # none); the old sum is rescaled to the new max by one more exponential
    new_m = max(max(max(m, x0), max(x1, x2)), max(max(x3, x4), max(max(x5, x6), x7)))
    if new_m == NEG_INF:
        return m, s
    s = s * exp2_fast(m - new_m) + (
        (exp2_fast(x0 - new_m) + exp2_fast(x1 - new_m))
        + (exp2_fast(x2 - new_m) + exp2_fast(x3 - new_m))
        + (exp2_fast(x4 - new_m) + exp2_fast(x5 - new_m))
        + (exp2_fast(x6 - new_m) + exp2_fast(x7 - new_m)))
    return new_m, s


@inlined
def edge_gradient(x, v, V, lse2, target, scale):
    # the gradient of base-2 logit x at column v in a chunk that holds the target or the end
    # of the classes: (softmax - onehot) * scale, 0 in the padding
    if v >= V:
        return float32(0.0)
    return (exp2_fast(x - lse2) - (float32(1.0) if v == target else float32(0.0))) * scale


@inlined
def store_gradients8(dlogit_pairs, n, c, x0, x1, x2, x3, x4, x5, x6, x7, V, lse2, target,
                     scale):
    # dlogits[n, 8c : 8c + 8] from the chunk's base-2 logits, rounded to bf16 pairs, one
    # 16-byte store. All but a row's one or two chunks hold eight classes and no target:
    # softmax * scale. (scale: dloss / N, float64, or float32 where that is the same value:
    # each product is rounded to float32, then to bf16, as the row-per-block kernel's are)
    v = 8 * c
    if v + 8 <= V and not (v <= target < v + 8):
        g0, g1 = exp2_fast(x0 - lse2) * scale, exp2_fast(x1 - lse2) * scale
        g2, g3 = exp2_fast(x2 - lse2) * scale, exp2_fast(x3 - lse2) * scale
        g4, g5 = exp2_fast(x4 - lse2) * scale, exp2_fast(x5 - lse2) * scale
        g6, g7 = exp2_fast(x6 - lse2) * scale, exp2_fast(x7 - lse2) * scale
    else:
        g0 = edge_gradient(x0, v, V, lse2, target, scale)
        g1 = edge_gradient(x1, v + 1, V, lse2, target, scale)
        g2 = edge_gradient(x2, v + 2, V, lse2, target, scale)
        g3 = edge_gradient(x3, v + 3, V, lse2, target, scale)
        g4 = edge_gradient(x4, v + 4, V, lse2, target, scale)
        g5 = edge_gradient(x5, v + 5, V, lse2, target, scale)
        g6 = edge_gradient(x6, v + 6, V, lse2, target, scale)
        g7 = edge_gradient(x7, v + 7, V, lse2, target, scale)
    store4_u32(dlogit_pairs, (n, 4 * c), bf16_pair(g0, g1), bf16_pair(g2, g3),
               bf16_pair(g4, g5), bf16_pair(g6, g7))


@inlined
def store_gradient_row(dlogit_pairs, words, at, n, row_words, V, lse2, target, scale):
    # this thread's chunks of row n's gradient, from the row's logits in words[at:]
    for c in range(cuda.threadIdx.x, row_words // 4, BF16_THREADS):
        w0, w1, w2, w3 = load4_u32(words, (at + 4 * c,))
        x0, x1, x2, x3, x4, x5, x6, x7 = logits8_log2(w0, w1, w2, w3, 8 * c, V)
        store_gradients8(dlogit_pairs, n, c, x0, x1, x2, x3, x4, x5, x6, x7, V, lse2, target,
                         scale)


@inlined
def start_row_copy(words, at, logit_pairs, n):
    # this thread's 16-byte chunks of row n (c = threadIdx.x, + BF16_THREADS, ...) copied into
    # words[at + 4c] by cp.async, one commit group: empty past the last row, so that the
    # groups in flight count rows either way
    if n < logit_pairs.shape[0]:
        for c in range(cuda.threadIdx.x, logit_pairs.shape[1] // 4, BF16_THREADS):
            copy16_async(words, (at + 4 * c,), logit_pairs, (n, 4 * c), True)
    commit_copies()


@kernel_factory
def bf16_logits_kernel(gradient, buffers=2):
    """The loss of logits given as a Bf16Matrix's bf16 pairs, and with `gradient` dlogits too,
    as a Bf16Matrix's bf16 pairs. buffers: the rows a block holds in shared memory, 2 (the
    next row streams in while this one is worked on) or 1 (a row too long for two)."""
    wait_for_this_row = wait_copies(buffers - 1)

    @cuda.jit(**({} if SIMULATOR else dict(launch_bounds=(BF16_THREADS, 1))))
    def crossentropy_bf16_logits_kernel(losses, lse, dlogit_pairs, logit_pairs, targets, dloss,
                                        V):
        # losses[N], lse[N] (and dlogits) of logits [N, P/2] in bf16 pairs. Block b takes rows
        # b, b + gridDim.x, ...; each of its threads owns the 16-byte chunks c = threadIdx.x,
        # + BF16_THREADS, ... of every row: it copies them into shared memory (cp.async), folds
        # them into its running max and sum, and reads them back for the gradient. No thread
        # reads another's chunks, so a buffer is refilled without a barrier: the block meets
        # only to combine the threads' sums (block_max, block_sum: reduce.py's fixed tree).
        # The arithmetic, in base 2, is the row-per-block kernel's (tools/dev/loss_bench.py),
        # step for step, and so are the bits
        words = dynamic_shared_words()          # `buffers` rows of P/2 words, 16-byte aligned
        scratch = cuda.shared.array(MAX_THREADS, float32)
        N, row_words = logit_pairs.shape
        # the gradient's scale, dloss / N in float64 as before. Where float32 holds it exactly
        # (dloss 1 and N a power of two: every recipe's), each float32 product x * scale is
        # the float64 product rounded once to float32, the same bits, and costs no
        # conversions to float64 and back (64-bit conversions run at 16 a clock a
        # multiprocessor: ~0.25 ms over andrea-120m's 824M logits)
        scale = dloss[0] / N
        scale32 = float32(scale)
        exact32 = float64(scale32) == scale
        n, at = cuda.blockIdx.x, 0          # the row, and the word where its buffer starts
        start_row_copy(words, at, logit_pairs, n)
        while n < N:
            next_n, next_at = n + cuda.gridDim.x, (row_words - at if buffers == 2 else 0)
            if buffers == 2:                # the next row streams in during all of this one
                start_row_copy(words, next_at, logit_pairs, next_n)
            target = targets[n]
            wait_for_this_row()             # this row's group: this thread's chunks have landed
            m, s = NEG_INF, float32(0.0)
            for c in range(cuda.threadIdx.x, row_words // 4, BF16_THREADS):
                w0, w1, w2, w3 = load4_u32(words, (at + 4 * c,))
                x0, x1, x2, x3, x4, x5, x6, x7 = logits8_log2(w0, w1, w2, w3, 8 * c, V)
                m, s = add_to_running_sum2(m, s, x0, x1, x2, x3, x4, x5, x6, x7)
            row_max = block_max(m, scratch)
            s = s * exp2_fast(m - row_max) if m > NEG_INF else float32(0.0)
            lse2 = row_max + math.log2(block_sum(s, scratch))          # in base 2
            if (target >> 3) % BF16_THREADS == cuda.threadIdx.x:
                # the target's chunk is this thread's: its logit is read there, no other's
                low, high = bf16_unpair(words[at + (target >> 1)])
                lse[n] = lse2 / LOG2E
                losses[n] = lse2 / LOG2E - (high if target & 1 else low)
            if gradient and exact32:
                store_gradient_row(dlogit_pairs, words, at, n, row_words, V, lse2, target,
                                   scale32)
            elif gradient:
                store_gradient_row(dlogit_pairs, words, at, n, row_words, V, lse2, target,
                                   scale)
            if buffers == 1:                # the one buffer is free once this row is done
                start_row_copy(words, next_at, logit_pairs, next_n)
            n, at = next_n, next_at

    return crossentropy_bf16_logits_kernel


def bf16_logits_grid(rows, row_bytes):
    """(buffers, blocks) of bf16_logits_kernel for `rows` rows of row_bytes: two buffers where
    a block's shared memory holds two rows, one where it holds one, None where not even that
    (the caller goes through float32). Blocks: as many as the multiprocessors hold by their
    shared memory (one each at andrea-120m's 98 KB rows), never more than the rows. Where
    threads run out before shared memory (short rows), the extra blocks wait their turn: only
    less even, still right."""
    gpu = device.current()
    for buffers in (2, 1):
        block_bytes = buffers * row_bytes + STATS_BYTES
        if block_bytes <= gpu.shared_bytes_optin:
            per_multiprocessor = gpu.shared_bytes_optin // block_bytes
            return buffers, min(rows, gpu.multiprocessors * per_multiprocessor)
    return None


def launch_bf16_logits(losses, lse, dlogits, logits, targets, dloss, V):
    """bf16_logits_kernel on logits (a Bf16Matrix); dlogits a Bf16Matrix of its shape, or None
    (the loss alone, evaluation's)."""
    gradient = dlogits is not None
    logit_pairs = logits.bf16_pairs
    row_bytes = 4 * logit_pairs.shape[1]
    grid = bf16_logits_grid(logit_pairs.shape[0], row_bytes)
    if grid is None:                                    # (a row past ~110k tokens: float32
        values = device_empty(logits.shape, np.float32)           # values, two reads)
        bf16_values(values, logits)
        launch(crossentropy_fused_bf16_kernel if gradient else crossentropy_forward_kernel,
               logits.shape[0], THREADS, losses, lse, *((dlogits.bf16_pairs,) if gradient else ()),
               values, targets, *((dloss,) if gradient else ()), V)
        return
    buffers, blocks = grid
    launch(bf16_logits_kernel(gradient, buffers), blocks, BF16_THREADS, losses, lse,
           dlogits.bf16_pairs if gradient else logit_pairs, logit_pairs, targets,
           dloss if gradient else lse, V, shared_bytes=buffers * row_bytes)


@cuda.jit
def crossentropy_backward_kernel(dlogits, logits, lse, targets, dloss, accumulate, V):
    # dlogits[N,Vp] (+)= (softmax - onehot) * dloss[0] / N, 0 in the padding columns v >= V;
    # one block per row
    n = cuda.blockIdx.x
    N = logits.shape[0]
    scale = dloss[0] / N
    row_lse = lse[n]
    target = targets[n]
    for v in range(cuda.threadIdx.x, logits.shape[1], cuda.blockDim.x):
        grad = class_gradient(logits, n, v, V, row_lse, target) * scale
        if accumulate:
            grad += dlogits[n, v]
        dlogits[n, v] = grad


@cuda.jit
def mean_kernel(out, x):
    # out[0] = mean of x[N]; a single block, fixed order
    scratch = cuda.shared.array(MAX_THREADS, float32)
    total = float32(0.0)
    for i in range(cuda.threadIdx.x, x.shape[0], cuda.blockDim.x):
        total += x[i]
    total = block_sum(total, scratch)
    if cuda.threadIdx.x == 0:
        out[0] = total / x.shape[0]


def _check(logits, targets, vocab, **rows):
    """V: the number of classes, the first `vocab` columns of the logits (None: all of them)."""
    check(len(logits.shape) == 2, f"cross-entropy: logits must be [N,Vp], got {logits.shape}")
    N = logits.shape[0]
    check_shape("cross-entropy targets", targets, (N,))
    for name, array in rows.items():
        check_shape(f"cross-entropy {name}", array, logits.shape if name == "dlogits" else (N,))
    V = logits.shape[1] if vocab is None else vocab
    check(1 <= V <= logits.shape[1], f"cross-entropy: vocab {V} outside 1..{logits.shape[1]}")
    return V


def crossentropy_forward(loss, losses, lse, logits, targets, vocab=None):
    """loss[1] = mean cross-entropy; losses[N] per position; lse[N] saved for backward.
    vocab: the classes are logits[:, :vocab] (the rest is padding); None: every column.
    logits: float32 [N, Vp], or a Bf16Matrix of that shape (bf16_logits_kernel)."""
    bf16 = isinstance(logits, Bf16Matrix)
    check_float32(loss=loss, losses=losses, lse=lse, **({} if bf16 else dict(logits=logits)))
    check(targets.dtype == np.int32, f"cross-entropy: targets must be int32, got {targets.dtype}")
    V = _check(logits, targets, vocab, losses=losses, lse=lse)
    if bf16:
        launch_bf16_logits(losses, lse, None, logits, targets, None, V)
    else:
        launch(crossentropy_forward_kernel, logits.shape[0], THREADS, losses, lse, logits,
               targets, V)
    launch(mean_kernel, 1, THREADS, loss, losses)


def crossentropy_forward_backward(loss, losses, lse, dlogits, logits, targets, dloss,
                                  vocab=None, kernel="auto"):
    """crossentropy_forward and crossentropy_backward (=) in one pass over the logits, for a
    loss whose gradient dloss[1] is known before backward. dlogits: float32 [N, Vp], or a
    Bf16Matrix of that shape (bf16 training: the gradient as the LM head's products read it).
    kernel: "fast" (16-byte loads and stores, crossentropy_fused4_kernel or, for a Bf16Matrix,
    crossentropy_fused_bf16_kernel: rows of 4k floats, aligned), "reference"
    (crossentropy_fused_kernel, any rows; a Bf16Matrix then rounded from its float32 output)
    or "auto" (fast where the rows allow it). logits may be a Bf16Matrix (then dlogits is one
    too): bf16_logits_kernel, the row read once."""
    bf16_dlogits = isinstance(dlogits, Bf16Matrix)
    if isinstance(logits, Bf16Matrix):
        check(bf16_dlogits, "cross-entropy: with logits in bf16, dlogits is a Bf16Matrix too")
        check_float32(loss=loss, losses=losses, lse=lse, dloss=dloss)
        check(targets.dtype == np.int32, f"cross-entropy: targets must be int32, got "
              f"{targets.dtype}")
        V = _check(logits, targets, vocab, losses=losses, lse=lse)
        check(tuple(dlogits.shape) == tuple(logits.shape), f"cross-entropy dlogits: shape "
              f"{tuple(dlogits.shape)}, logits {tuple(logits.shape)}")
        launch_bf16_logits(losses, lse, dlogits, logits, targets, dloss, V)
        launch(mean_kernel, 1, THREADS, loss, losses)
        return
    check_float32(loss=loss, losses=losses, lse=lse, logits=logits, dloss=dloss,
                  **({} if bf16_dlogits else dict(dlogits=dlogits)))
    check(targets.dtype == np.int32, f"cross-entropy: targets must be int32, got {targets.dtype}")
    V = _check(logits, targets, vocab, losses=losses, lse=lse)
    check(tuple(dlogits.shape) == tuple(logits.shape),
          f"cross-entropy dlogits: shape {tuple(dlogits.shape)}, logits {tuple(logits.shape)}")
    check(kernel in ("auto", "fast", "reference"), f"cross-entropy: unknown kernel {kernel!r}")
    aligned = aligned16(logits) and (bf16_dlogits or aligned16(dlogits))
    if kernel == "auto":
        kernel = "fast" if aligned else "reference"
    check(aligned or kernel == "reference",
          "cross-entropy: the fast kernel needs logits and dlogits in rows of 4k floats, aligned")
    if kernel == "fast":
        fused = crossentropy_fused_bf16_kernel if bf16_dlogits else crossentropy_fused4_kernel
        launch(fused, logits.shape[0], THREADS, losses, lse,
               dlogits.bf16_pairs if bf16_dlogits else dlogits, logits, targets, dloss, V)
    else:
        values = device_empty(logits.shape, np.float32) if bf16_dlogits else dlogits
        launch(crossentropy_fused_kernel, logits.shape[0], THREADS, losses, lse, values, logits,
               targets, dloss, V)
        if bf16_dlogits:
            round_bf16(dlogits, values)
    launch(mean_kernel, 1, THREADS, loss, losses)


def crossentropy_backward(dlogits, dloss, logits, lse, targets, accumulate=False, vocab=None):
    check_float32(dlogits=dlogits, dloss=dloss, logits=logits, lse=lse)
    V = _check(logits, targets, vocab, dlogits=dlogits, lse=lse)
    launch(crossentropy_backward_kernel, logits.shape[0], THREADS,
           dlogits, logits, lse, targets, dloss, accumulate, V)


def crossentropy_forward_numpy(loss, losses, lse, logits, targets, vocab=None):
    if isinstance(logits, Bf16Matrix):              # (bf16 logits: their values)
        logits = bf16_matrix_values(logits)
    V = _check(logits, targets, vocab, losses=losses, lse=lse)
    classes = logits[:, :V]
    m = classes.max(axis=1, keepdims=True)
    lse[...] = (m + np.log(np.exp(classes - m).sum(axis=1, keepdims=True)))[:, 0]
    losses[...] = lse - logits[np.arange(logits.shape[0]), targets]
    loss[...] = losses.mean()


def crossentropy_backward_numpy(dlogits, dloss, logits, lse, targets, accumulate=False,
                                vocab=None):
    V = _check(logits, targets, vocab, dlogits=dlogits, lse=lse)
    grad = np.exp(logits - lse[:, None])
    grad[:, V:] = 0.0                                       # padding: outside the softmax
    grad[np.arange(logits.shape[0]), targets] -= 1.0
    grad *= dloss[0] / logits.shape[0]
    if accumulate:
        dlogits += grad
    else:
        dlogits[...] = grad


def crossentropy_forward_backward_numpy(loss, losses, lse, dlogits, logits, targets, dloss,
                                        vocab=None, kernel="auto"):
    if isinstance(logits, Bf16Matrix):              # (bf16 logits: their values)
        logits = bf16_matrix_values(logits)
    crossentropy_forward_numpy(loss, losses, lse, logits, targets, vocab)
    bf16_dlogits = isinstance(dlogits, Bf16Matrix)
    values = np.empty(logits.shape, np.float32) if bf16_dlogits else dlogits
    crossentropy_backward_numpy(values, dloss, logits, lse, targets, vocab=vocab)
    if bf16_dlogits:
        round_bf16_numpy(dlogits, values)
