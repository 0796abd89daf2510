"""Backends: where tensors live and which function runs each op.

A backend is a device and a precision:
    cuda    device arrays (Numba), float32; the kernels' launchers (nanoandrea/kernels)
    numpy   ndarrays on the CPU, float32 or float64 (float64 for the gradient checks): each
            launcher's NumPy twin, the same signature, the definition the kernel is tested
            against
The model and the autograd only ever call `backend.<op>(...)`, `backend.empty(...)`, ...; the
table in Backend.__init__ names, for every op, the CUDA launcher and its NumPy twin. The
launchers of the two large families choose their kernel themselves, in one visible dispatch:
kernels/matmul/__init__.py (wgmma | mma.sync | float32 tiles | reference) and
kernels/attention/__init__.py (wgmma | mma.sync | float32 flash | reference).

The precision is the matmuls' and attention's (every other op is float32 whatever it says):
    fp32   the float32 kernels (a product of few rows without gradients, a sampled token's,
           on matvec)
    bf16   the operands of every matmul and of attention's products rounded to bf16, their
           sums, the softmax and its statistics float32: on the GPU the tensor cores, on the
           CPU the NumPy twins. `operand(x)` rounds a matmul's operand once (a Bf16Matrix),
           where a product first reads it; the backward's products read the same copy. The
           weights' copies are kept: AdamW writes them as it updates the weights (params.py)
    tf32   the matmuls' operands rounded to tf32 (10 bits of mantissa to bf16's 7: ~4x closer
           to float32, at about half bf16's speed on the tensor cores; a Tf32Matrix each);
           attention float32
The parameters, their gradients and AdamW's state stay float32 in every precision. bf16 and
tf32 need no loss scaling: they keep float32's 8-bit exponent, so a gradient as small as
1e-38 is still a number (fp16's 5 bits flush anything under ~6e-8 to zero, hence fp16's loss
scaling).
"""
import numpy as np

from .kernels import (adamw, attention, crossentropy, dropout, elementwise, embedding, gelu,
                      heads, layernorm, matmul, operands, reduce)
from .kernels.attention import kvcache
from .kernels.matmul import matvec
from .kernels.runtime.device import SIMULATOR, gpu_available
from .kernels.runtime.device import current as current_device

PRECISIONS = ("fp32", "tf32", "bf16")


def _never(*shape):
    return False


class Backend:
    def __init__(self, name, dtype, precision="fp32"):
        self.name = name
        self.dtype = np.dtype(dtype)
        self.precision = precision
        cuda = name == "cuda"
        bf16, tf32 = precision == "bf16", precision == "tf32"
        # Each op: the CUDA launcher if cuda else its NumPy twin (kernels/<family>).
        # The products, in the precision's kind of operand (operands.py) ...
        self.matmul = (
            (matmul.matmul_bf16 if cuda else matmul.matmul_bf16_numpy) if bf16 else
            (matmul.matmul_tf32 if cuda else matmul.matmul_tf32_numpy) if tf32 else
            (matmul.matmul if cuda else matmul.matmul_numpy))
        # out (+)= a sum of products (the gradient of x that attention's q, k and v send back)
        self.matmul_sum = matmul.matmul_sum if cuda else matmul.matmul_sum_numpy
        self.matvec = matvec.matvec if cuda else matvec.matvec_numpy
        self.transpose = matmul.transpose if cuda else matmul.transpose_numpy
        self.round_bf16 = operands.round_bf16 if cuda else operands.round_bf16_numpy
        self.round_tf32 = operands.round_tf32 if cuda else operands.round_tf32_numpy
        self.bf16_values = operands.bf16_values if cuda else operands.bf16_values_numpy
        # ... attention (kernels/attention: the bf16 launchers round q, k, v first) ...
        self.attention_forward = (
            (attention.attention_forward_bf16 if cuda else attention.attention_forward_bf16_numpy)
            if bf16 else (attention.attention_forward if cuda else
                          attention.attention_forward_numpy))
        self.attention_backward = (
            (attention.attention_backward_bf16 if cuda else
             attention.attention_backward_bf16_numpy) if bf16 else
            (attention.attention_backward if cuda else attention.attention_backward_numpy))
        self.kv_store = kvcache.kv_store if cuda else kvcache.kv_store_numpy
        self.attention_cached = kvcache.attention_cached if cuda else kvcache.attention_cached_numpy
        self.split_heads = heads.split_heads if cuda else heads.split_heads_numpy
        self.merge_heads = heads.merge_heads if cuda else heads.merge_heads_numpy
        self.heads_view = heads.heads_view if cuda else heads.heads_view_numpy
        self.bf16_heads_view = heads.bf16_heads_view if cuda else heads.bf16_heads_view_numpy
        # ... and the rest
        self.sum_rows = reduce.sum_rows if cuda else reduce.sum_rows_numpy
        self.layernorm_forward = layernorm.layernorm_forward if cuda else layernorm.layernorm_forward_numpy
        self.layernorm_backward = layernorm.layernorm_backward if cuda else layernorm.layernorm_backward_numpy
        self.residual_layernorm_forward = (layernorm.residual_layernorm_forward if cuda else
                                           layernorm.residual_layernorm_forward_numpy)
        self.gelu_forward = gelu.gelu_forward if cuda else gelu.gelu_forward_numpy
        self.gelu_backward = gelu.gelu_backward if cuda else gelu.gelu_backward_numpy
        self.embedding_forward = embedding.embedding_forward if cuda else embedding.embedding_forward_numpy
        self.embedding_backward = embedding.embedding_backward if cuda else embedding.embedding_backward_numpy
        self.add = elementwise.add if cuda else elementwise.add_numpy
        self.add_into = elementwise.add_into if cuda else elementwise.add_into_numpy
        self.fill = elementwise.fill if cuda else elementwise.fill_numpy
        self.dropout_forward = dropout.dropout_forward if cuda else dropout.dropout_forward_numpy
        self.dropout_backward = dropout.dropout_backward if cuda else dropout.dropout_backward_numpy
        self.crossentropy_forward = (crossentropy.crossentropy_forward if cuda else
                                     crossentropy.crossentropy_forward_numpy)
        self.crossentropy_backward = (crossentropy.crossentropy_backward if cuda else
                                      crossentropy.crossentropy_backward_numpy)
        self.crossentropy_forward_backward = (crossentropy.crossentropy_forward_backward if cuda
                                              else crossentropy.crossentropy_forward_backward_numpy)
        self.grad_norm = adamw.grad_norm if cuda else adamw.grad_norm_numpy
        self.adamw_update = adamw.adamw_update if cuda else adamw.adamw_update_numpy
        # Questions the ops ask of the backend's kernels:
        # whether a product of few rows without gradients runs on matvec (tf32: never, matvec
        # reads float32 or bf16 weights, not tf32's)
        self.takes_matvec = (_never if tf32 else
                             matvec.takes_matvec if cuda else matvec.takes_matvec_numpy)
        # q, k, v as attention reads them (bf16: rounded once, for forward and backward), and
        # whether attention rounds heads x so (then split_heads need not copy them)
        self.heads_operand = (attention.heads_operand if cuda else
                              attention.heads_operand_numpy) if bf16 else (lambda x: x)
        self.attention_rounds = (attention.rounds_heads if cuda else
                                 attention.rounds_heads_numpy) if bf16 else _never
        # whether attention_forward of these operands writes out's bf16 copy too (out_bf16:
        # the tensor-core kernels; the NumPy twins do not)
        self.attention_writes_bf16_out = attention.writes_bf16_out if cuda and bf16 else _never
        # whether it reads q, k, v of heads of D as the bf16 rows the products write (then
        # nothing rounds or copies the heads: the wgmma kernels)
        self.attention_reads_heads_in_rows = (attention.reads_heads_in_rows if cuda and bf16
                                              else _never)
        # whether the float32 product multiplies by a copy of W^T it makes (the step makes it
        # beside; the tensor-core kernels read W^T as it lies)
        self.copies_b_transposed = (matmul.copies_b_transposed if cuda and precision == "fp32"
                                    else _never)

    def __repr__(self):
        return f"Backend({self.name!r}, {self.dtype.name}, {self.precision!r})"

    def operand(self, x):
        """x [R, C] as this backend's matmul reads it: in bf16 a new Bf16Matrix, in tf32 a new
        Tf32Matrix, x rounded; in fp32 x itself."""
        if self.precision == "fp32":
            return x
        rounded = self.new_operand(x.shape)
        (self.round_bf16 if self.precision == "bf16" else self.round_tf32)(rounded, x)
        return rounded

    def new_operand(self, shape):
        """A new operand of a [R, C] matrix for this backend's matmul, not yet written: a
        Bf16Matrix in bf16, a Tf32Matrix in tf32 (fp32: none)."""
        kind = operands.Bf16Matrix if self.precision == "bf16" else operands.Tf32Matrix
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
    from .kernels.runtime.launch import current_stream
    return current_stream()


_backends = {}


def default_device():
    """'cuda' where a CUDA GPU is usable, else 'cpu' (the NumPy backend)."""
    return "cuda" if gpu_available() else "cpu"


def resolve_precision(precision, device):
    """'auto': bf16 on a GPU with bf16 tensor cores (compute capability 8.0 and up), else
    fp32 (on the CPU, rounding the operands to bf16 costs time and saves none)."""
    if precision != "auto":
        return precision
    if device != "cuda" or SIMULATOR:
        return "fp32"
    return "bf16" if current_device().compute_capability >= (8, 0) else "fp32"


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
