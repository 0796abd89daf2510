"""AdamW over the model's flat buffers, and the learning-rate schedule.

One optimizer step is three kernels whatever the model size: the global gradient norm (two
deterministic reductions) and one AdamW kernel over all P parameters, which in bf16 training
also writes the weight matrices' bf16 copies that the next step's products read (the store's
bf16_copies, params.py). The step's lr and bias corrections travel to the device as one
8-float vector, and clipping reads the norm on the device, so nothing waits for the host.

ZeRO-1 (`ShardedAdamW`, train --zero1): on R data-parallel ranks, whose averaged gradients are
the same everywhere, each rank keeps m and v for one contiguous shard of the P parameters
(1/R of AdamW's memory), updates only that shard, and the ranks then all-gather the
parameters. The same kernel on a slice: the same numbers as AdamW over all of P. The bf16
copies are then made from the gathered weights in one rounding pass (the store's
round_bf16_copies: the same bits), not gathered: that would move half the weights' bytes
again between the GPUs, where the pass reads and writes each GPU's own memory. The
gradients are still all-reduced whole (distributed.GradientBuckets: the buckets follow the
layers, the shards the ranks); a reduce-scatter into each rank's shard would move half the
bytes, and is not done here.
"""
import math

import numpy as np

from .kernels.adamw import NORM_BLOCKS, adamw_hyperparameters


class AdamW:
    def __init__(self, store, lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1,
                 grad_clip=1.0):
        self.store = store
        self.backend = store.backend
        self.lr = lr
        self.betas = betas
        self.eps = eps
        self.weight_decay = weight_decay
        self.grad_clip = grad_clip
        self.step_count = 0
        self.hyper = self.backend.zeros((8,), np.float32)
        self.norm = self.backend.zeros((1,), np.float32)
        self.partials = self.backend.zeros((NORM_BLOCKS,), np.float32)

    def zero_grad(self):
        self.store.zero_grads()

    def step(self, lr=None):
        """One AdamW update from the gradients in the store (lr: this step's learning rate)."""
        self.prepare(lr)
        self.update()

    def prepare(self, lr=None):
        """Count the step and send its lr and bias corrections to the device (before update)."""
        self.step_count += 1
        hyper = adamw_hyperparameters(self.lr if lr is None else lr, self.betas[0],
                                      self.betas[1], self.eps, self.weight_decay,
                                      self.grad_clip, self.step_count)
        self.backend.copy_from_host(self.hyper, hyper)

    def update(self):
        """The update itself, kernels only (what a captured CUDA graph replays)."""
        self.backend.grad_norm(self.norm, self.store.grads, self.partials)
        self.backend.adamw_update(self.store.params, self.store.grads, self.store.m,
                                  self.store.v, self.hyper, self.norm, self.store.n_decay,
                                  self.store.bf16_copies)

    def grad_norm(self):
        """The global gradient norm of the last step (before clipping); waits for the device."""
        return float(self.backend.to_host(self.norm)[0])

    def moments_to_host(self):
        """{"m", "v"}: AdamW's state over all P parameters, host arrays (for a checkpoint)."""
        return {"m": self.backend.to_host(self.store.m), "v": self.backend.to_host(self.store.v)}

    def load_moments(self, m, v):
        """Restore the state moments_to_host gave (host arrays [P])."""
        self.backend.copy_from_host(self.store.m, m)
        self.backend.copy_from_host(self.store.v, v)


def shard_bounds(size, ranks, align=4):
    """[b_0 = 0, b_1, ..., b_R = size]: rank r's shard of a flat buffer is [b_r, b_r+1), every
    bound a multiple of `align` (the views' 16-byte alignment) but the last."""
    return [min(size, size * r // ranks // align * align) for r in range(ranks)] + [size]


class ShardedAdamW(AdamW):
    """AdamW under ZeRO-1: this rank's m and v cover its shard [lo, hi) of the parameters; the
    update writes that shard, then `communicator.all_gather` hands every rank every shard.
    The gradient norm is over all of P (every rank holds the averaged gradients); the bf16
    copies are made after the gather, from all of P (the module's doc)."""

    def __init__(self, store, communicator, **hyperparameters):
        super().__init__(store, **hyperparameters)
        self.communicator = communicator
        self.bounds = shard_bounds(store.size, communicator.size)
        self.lo, self.hi = self.bounds[communicator.rank], self.bounds[communicator.rank + 1]
        self.m = self.backend.zeros((self.hi - self.lo,))
        self.v = self.backend.zeros((self.hi - self.lo,))
        self.n_decay = min(max(store.n_decay - self.lo, 0), self.hi - self.lo)
        self.no_copies = self.backend.empty((0,), np.uint16)     # (made after the gather)

    def update(self):
        store, lo, hi = self.store, self.lo, self.hi
        self.backend.grad_norm(self.norm, store.grads, self.partials)
        self.backend.adamw_update(store.params[lo:hi], store.grads[lo:hi], self.m, self.v,
                                  self.hyper, self.norm, self.n_decay, self.no_copies)
        self.communicator.all_gather(store.params, self.bounds)
        store.round_bf16_copies()

    def moments_to_host(self):
        """The whole m and v, gathered from every rank's shard (every rank calls it)."""
        moments = {}
        for name, shard in (("m", self.m), ("v", self.v)):
            whole = self.backend.zeros((self.store.size,))
            self.backend.copy(whole[self.lo:self.hi], shard)
            self.communicator.all_gather(whole, self.bounds)
            moments[name] = self.backend.to_host(whole)
        return moments

    def load_moments(self, m, v):
        self.backend.copy_from_host(self.m, m[self.lo:self.hi])
        self.backend.copy_from_host(self.v, v[self.lo:self.hi])


def learning_rate(step, max_lr, min_lr, warmup_steps, max_steps):
    """Linear warmup from 0 to max_lr over warmup_steps, then cosine decay to min_lr at max_steps.

    step is 0-based (the step about to run)."""
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if step >= max_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (max_lr - min_lr)
