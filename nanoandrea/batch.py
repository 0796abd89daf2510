"""A batch of token ids on the backend, in buffers that stay where they are.

    idx      int32 [B,T]     the input tokens
    targets  int32 [B*T]     the next tokens (for the loss); absent when only predicting
    order    int32 [B*T]     the embedding backward's grouping of positions by token id, and
    starts   int32 [S+1]     its segment starts, padded to S = min(V, B*T) segments
                             (see kernels/embedding.py)

The model reads a batch from these buffers (views of one int32 buffer). `load(x, y)` copies the
next batch's ids into them, one host-to-device copy, so a training step captured once as a CUDA
graph (which reads fixed addresses) reads each new batch when replayed. The grouping is computed
on the host, where the ids are.
"""
import numpy as np

from .autograd import grad_enabled
from .kernels.embedding import group_positions_by_token


class TokenBatch:
    def __init__(self, backend, batch_size, block_size, vocab_size, with_targets=True,
                 with_grouping=True):
        self.backend = backend
        self.shape = (batch_size, block_size)
        n = batch_size * block_size
        self.segments = min(vocab_size, n)
        # one int32 buffer, [idx | order | starts | targets], so a new batch is one copy
        sizes = [n] + ([n, self.segments + 1] if with_grouping else [0, 0]) \
            + [n if with_targets else 0]
        self.ends = [int(end) for end in np.cumsum(sizes)]
        self.buffer = backend.empty((int(self.ends[-1]),), np.int32)
        views = [self.buffer[end - size:end] if size else None
                 for size, end in zip(sizes, self.ends)]
        self.idx = views[0].reshape(self.shape)
        self.order, self.starts, self.targets = views[1:]

    @classmethod
    def from_host(cls, backend, idx, targets=None, vocab_size=None):
        """A batch made for these ids (evaluation, sampling, tests: a new batch each call);
        the embedding backward's grouping only when gradients are on."""
        idx = np.asarray(idx)
        vocab_size = vocab_size or int(idx.max(initial=0)) + 1
        batch = cls(backend, idx.shape[0], idx.shape[1], vocab_size, targets is not None,
                    grad_enabled())
        return batch.load(idx, targets)

    def load(self, idx, targets=None):
        """Copy a new batch's ids (host int arrays [B,T]) into the buffer: one copy."""
        idx = np.asarray(idx)
        if idx.shape != self.shape:
            raise ValueError(f"batch: expected ids of shape {self.shape}, got {idx.shape}")
        if targets is not None and self.targets is None:
            raise ValueError("batch: made without targets")
        host = np.empty(self.buffer.shape, np.int32)
        host[:self.ends[0]] = idx.reshape(-1)
        if self.order is not None:
            host[self.ends[0]:self.ends[2]] = np.concatenate(
                group_positions_by_token(idx, self.segments))
        end = self.ends[2]
        if targets is not None:
            host[end:] = np.asarray(targets).reshape(-1)
            end = self.ends[3]
        self.backend.copy_from_host(self.buffer[:end], host[:end])
        return self
