"""A batch of token ids on the backend, in buffers that stay where they are.

    idx      int32 [B,T]     the input tokens
    targets  int32 [B*T]     the next tokens (for the loss); absent when only predicting
    order    int32 [B*T]     the embedding backward's grouping of positions by token id, and
    starts   int32 [S+1]     its segment starts, padded to S = min(V, B*T) segments
                             (see kernels/embedding.py)

The model reads a batch from these buffers. `load(x, y)` copies the next batch's ids into the
same buffers, so a training step captured once as a CUDA graph (which reads fixed addresses)
reads each new batch when replayed. The grouping is computed on the host, where the ids are.
"""
import numpy as np

from .kernels.embedding import group_positions_by_token


class TokenBatch:
    def __init__(self, backend, batch_size, block_size, vocab_size, with_targets=True):
        self.backend = backend
        self.shape = (batch_size, block_size)
        n = batch_size * block_size
        self.segments = min(vocab_size, n)
        self.idx = backend.empty(self.shape, np.int32)
        self.targets = backend.empty((n,), np.int32) if with_targets else None
        self.order = backend.empty((n,), np.int32)
        self.starts = backend.empty((self.segments + 1,), np.int32)

    @classmethod
    def from_host(cls, backend, idx, targets=None, vocab_size=None):
        """A batch made for these ids (evaluation, sampling, tests: a new batch each call)."""
        idx = np.asarray(idx)
        vocab_size = vocab_size or int(idx.max(initial=0)) + 1
        batch = cls(backend, idx.shape[0], idx.shape[1], vocab_size, targets is not None)
        return batch.load(idx, targets)

    def load(self, idx, targets=None):
        """Copy a new batch's ids (host int arrays [B,T]) into the buffers."""
        idx = np.asarray(idx)
        if idx.shape != self.shape:
            raise ValueError(f"batch: expected ids of shape {self.shape}, got {idx.shape}")
        copy = self.backend.copy_from_host
        copy(self.idx, idx.astype(np.int32))
        order, starts = group_positions_by_token(idx, self.segments)
        copy(self.order, order)
        copy(self.starts, starts)
        if targets is not None:
            if self.targets is None:
                raise ValueError("batch: made without targets")
            copy(self.targets, np.asarray(targets, dtype=np.int32).reshape(-1))
        return self
