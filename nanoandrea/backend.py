"""Backends: where tensors live and which implementation of each op runs.

Every op in nanoandrea.kernels comes as a pair with one signature: the CUDA launcher `name`
and its NumPy twin `name_numpy`. A Backend gathers one side of every pair, plus memory:
    CUDA   device arrays (Numba), float32; kernels launched through kernels.launch
    NumPy  ndarrays on the CPU, float32 or float64 (float64 for the gradient checks)
The model and the autograd only ever call `backend.<op>(...)`, `backend.empty(...)`, ...

A backend also has a precision, the matmuls' and attention's (every other op is float32
whatever it says):
    fp32   the float32 kernels (matmul.py, attention.py; a product of few rows without
           gradients, a sampled token's, matvec.py)
    bf16   the operands of every matmul and of attention's products rounded to bf16, their
           sums, the softmax and its statistics float32: on the GPU the tensor cores
           (matmul_bf16.py, attention_bf16.py), on the CPU their NumPy twins. `operand(x)`
           rounds a matmul's operand once (a Bf16Matrix), where a product first reads it; the
           backward's products read the same copy
    tf32   the matmuls' operands rounded to tf32 (10 bits of mantissa to bf16's 7: ~4x closer
           to float32, at about half bf16's speed on the tensor cores; matmul_tf32.py, a
           Tf32Matrix each); attention float32 (attention.py)
The parameters, their gradients and AdamW's state stay float32 in every precision. bf16 and
tf32 need no loss scaling: they keep float32's 8-bit exponent, so a gradient as small as
1e-38 is still a number (fp16's 5 bits flush anything under ~6e-8 to zero, hence fp16's loss
scaling).
"""
import functools

import numpy as np

from .kernels import (adamw, attention, attention_bf16, crossentropy, dropout, elementwise,
                      embedding, gelu, heads, kvcache, layernorm, matmul, matmul_bf16,
                      matmul_tf32, matvec, reduce)
from .kernels.launch import SIMULATOR, gpu_available

OPS = {
    matmul: ["matmul", "transpose"],
    matvec: ["matvec", "takes_matvec"],
    reduce: ["sum_rows"],
    heads: ["split_heads", "merge_heads", "heads_view"],
    attention: ["attention_forward", "attention_backward"],
    kvcache: ["kv_store", "attention_cached"],
    layernorm: ["layernorm_forward", "layernorm_backward", "residual_layernorm_forward"],
    gelu: ["gelu_forward", "gelu_backward"],
    embedding: ["embedding_forward", "embedding_backward"],
    elementwise: ["add", "add_into", "fill"],
    dropout: ["dropout_forward", "dropout_backward"],
    crossentropy: ["crossentropy_forward", "crossentropy_backward", "crossentropy_forward_backward"],
    adamw: ["grad_norm", "adamw_update"],
    matmul_bf16: ["round_bf16", "bf16_values"],
    matmul_tf32: ["round_tf32"],
}


PRECISIONS = ("fp32", "tf32", "bf16")


class Backend:
    def __init__(self, name, dtype, precision="fp32"):
        self.name = name
        self.dtype = np.dtype(dtype)
        self.precision = precision
        suffix = "" if name == "cuda" else "_numpy"
        for module, names in OPS.items():
            for op in names:
                setattr(self, op, getattr(module, op + suffix))
        if precision != "fp32":
            module = matmul_bf16 if precision == "bf16" else matmul_tf32
            self.matmul = getattr(module, f"matmul_{precision}{suffix}")
        # out (+)= a sum of products (the gradient of x that attention's q, k and v send
        # back): one product after another, or, bf16 on the GPU, all of them in one pass
        self.matmul_sum = functools.partial(matmul.products_in_turn, self.matmul)
        if precision == "bf16" and name == "cuda":
            self.matmul_sum = matmul_bf16.matmul_sum_bf16
        # q, k, v as attention reads them (in bf16 rounded once, for forward and backward),
        # and whether attention rounds heads x so (then split_heads need not copy them)
        self.heads_operand, self.attention_rounds = (lambda x: x), (lambda x: False)
        if precision == "bf16":
            for op in ("attention_forward", "attention_backward"):
                setattr(self, op, getattr(attention_bf16, op + "_bf16" + suffix))
            self.heads_operand = getattr(attention_bf16, "heads_operand" + suffix)
            self.attention_rounds = getattr(attention_bf16, "takes" + suffix)
        if precision == "tf32":
            # matvec reads float32 or bf16 weights, not tf32's: a sampled token's products
            # stay on the tensor-core tiles
            self.takes_matvec = lambda x, w, transpose_b=False: False
        # whether the matmul multiplies by a copy of W^T it makes (the step makes it beside;
        # the tensor-core kernels read W^T as it lies)
        self.copies_b_transposed = (lambda *shape: False) if name != "cuda" else (
            matmul if precision == "fp32" else matmul_bf16).copies_b_transposed

    def __repr__(self):
        return f"Backend({self.name!r}, {self.dtype.name}, {self.precision!r})"

    def operand(self, x):
        """x [R, C] as this backend's matmul reads it: in bf16 a new Bf16Matrix, in tf32 a new
        Tf32Matrix, x rounded; in fp32 x itself."""
        if self.precision == "fp32":
            return x
        rounded = self.new_operand(x.shape)
        getattr(self, f"round_{self.precision}")(rounded, x)
        return rounded

    def new_operand(self, shape):
        """A new operand of a [R, C] matrix for this backend's matmul, not yet written: a
        Bf16Matrix in bf16, a Tf32Matrix in tf32 (fp32: none)."""
        kind = matmul_bf16.Bf16Matrix if self.precision == "bf16" else matmul_tf32.Tf32Matrix
        return kind.allocate(shape, self.empty)

    # --- memory ------------------------------------------------------------------------
    def empty(self, shape, dtype=None):
        dtype = np.dtype(dtype or self.dtype)
        if self.name == "cuda":
            from numba import cuda
            return cuda.device_array(shape, dtype=dtype, stream=_stream())
        return np.empty(shape, dtype=dtype)

    def zeros(self, shape, dtype=None):
        array = self.empty(shape, dtype)
        if self.name == "cuda" and array.dtype == np.float32 and array.size:
            self.fill(array, 0.0)
        elif self.name == "cuda":
            array.copy_to_device(np.zeros(shape, dtype=array.dtype), stream=_stream())
        else:
            array[...] = 0
        return array

    def to_device(self, host_array, dtype=None):
        """A copy of a host array on this backend (as `dtype`, default: its own dtype)."""
        host_array = np.ascontiguousarray(host_array, dtype=dtype or np.asarray(host_array).dtype)
        if self.name == "cuda":
            from numba import cuda
            return cuda.to_device(host_array, stream=_stream())
        return host_array.copy()

    def copy_from_host(self, array, host_array):
        """Overwrite `array` (on this backend) with the contents of a host array."""
        if self.name == "cuda":
            array.copy_to_device(np.ascontiguousarray(host_array, dtype=array.dtype),
                                 stream=_stream())
        else:
            array[...] = host_array

    def copy(self, array, source):
        """Overwrite `array` with `source`, both on this backend (on the GPU: on the stream)."""
        if self.name == "cuda":
            array.copy_to_device(source, stream=_stream())
        else:
            array[...] = source

    def to_host(self, array):
        """A host copy of `array`; on the GPU this waits for the work queued before it."""
        if self.name == "cuda":
            stream = _stream()
            host = array.copy_to_host(stream=stream)
            if stream != 0:
                stream.synchronize()        # a copy on a stream is asynchronous
            return host
        return np.array(array)


def _stream():
    from .kernels.launch import current_stream
    return current_stream()


_backends = {}


def resolve_precision(precision, device):
    """'auto': bf16 on a GPU with bf16 tensor cores (compute capability 8.0 and up), else
    fp32 (on the CPU, rounding the operands to bf16 costs time and saves none)."""
    if precision != "auto":
        return precision
    if device != "cuda" or SIMULATOR:
        return "fp32"
    from numba import cuda
    return "bf16" if cuda.get_current_device().compute_capability >= (8, 0) else "fp32"


def get_backend(name="auto", dtype=None, precision="fp32"):
    """'cuda', 'numpy' (alias 'cpu') or 'auto' (CUDA when a GPU is usable, else NumPy); the
    matmuls' precision, 'fp32', 'tf32' or 'bf16' (the module's doc).

    Under the CUDA simulator 'cuda' works too (the kernels run as Python threads on the CPU).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}: use one of {', '.join(PRECISIONS)}")
    if name == "cpu":
        name = "numpy"
    if name == "auto":
        name = "cuda" if gpu_available() else "numpy"
    if name not in ("cuda", "numpy"):
        raise ValueError(f"unknown backend {name!r}: use 'cuda', 'numpy' or 'auto'")
    if name == "cuda" and not (gpu_available() or SIMULATOR):
        raise RuntimeError("no usable CUDA GPU (and the CUDA simulator is off)")
    dtype = np.dtype(dtype or np.float32)
    if name == "cuda" and dtype != np.float32:
        raise ValueError("the CUDA kernels are float32")
    key = (name, dtype, precision)
    if key not in _backends:
        _backends[key] = Backend(name, dtype, precision)
    return _backends[key]
