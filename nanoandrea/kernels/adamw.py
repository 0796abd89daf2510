"""AdamW over the flat parameter buffer, with global gradient-norm clipping, as kernels.

    params, grads, m, v : [P]   one flat buffer each (named views into them are the model's
                                parameters); the first n_decay entries are the 2-D weight
                                matrices, which get weight decay, the rest (biases, layernorms,
                                position embeddings) do not.
    norm                : [1]   the global L2 norm of grads (written by grad_norm)
    partials            : [NORM_BLOCKS] scratch of grad_norm
    hyper               : float32 [8] = lr, beta1, beta2, eps, weight_decay, grad_clip,
                                bias_correction1, bias_correction2  (see adamw_hyperparameters)
    bf16_copies         : uint16 [n] (n <= P; n = 0: none) the weights as the products read
                                them in bf16 training, written in the same pass: bf16_copies[i]
                                = the new params[i] rounded to bf16 (to nearest, ties to even:
                                operands.round_bf16's bits). The parameter store lays them out
                                so that these are its matrices' Bf16Matrix copies (params.py)
Everything a step changes (lr, the bias corrections) lives in `hyper` on the device and the clip
factor is computed on the device from `norm`, so a step needs no host sync and can be replayed
as a CUDA graph.

    g     = grads * min(1, grad_clip / (norm + 1e-6))      (no clipping when grad_clip <= 0)
    m     = beta1 m + (1 - beta1) g
    v     = beta2 v + (1 - beta2) g^2
    param -= lr * ( (m / bc1) / (sqrt(v / bc2) + eps) + weight_decay * param )   (decay if i < n_decay)
    bf16_copies[i] = bf16(param)                                                   (if i < n)
The kernel reads and writes every weight anyway: the copy costs 2 bytes a weight more, where a
rounding pass of its own would read the 4 bytes of each again, in a launch a matrix.
The step is bound by the memory (30 bytes a parameter moved), so the fast kernel, adamw4_kernel,
gives a thread four adjacent parameters and moves each buffer 16 bytes at a time; adamw_kernel,
a thread a parameter, is the reference (and takes buffers that are not 16-byte aligned).
"""
import math

import numpy as np
from numba import cuda, float32

from .ptx.mma import bf16_bits, bf16_pair
from .ptx.vector import aligned16, load4, store4
from .runtime.device import SIMULATOR
from .runtime.launch import blocks, check, check_float32, inlined, launch
from .reduce import MAX_THREADS, block_sum

THREADS = 32 if SIMULATOR else 256
NORM_BLOCKS = 4 if SIMULATOR else 256


@cuda.jit
def squares_partial_kernel(partials, x):
    # partials[block] = sum of x^2 over a grid-stride slice of x[P]
    scratch = cuda.shared.array(MAX_THREADS, float32)
    total = float32(0.0)
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        total += x[i] * x[i]
    total = block_sum(total, scratch)
    if cuda.threadIdx.x == 0:
        partials[cuda.blockIdx.x] = total


@cuda.jit
def norm_from_partials_kernel(norm, partials):
    # norm[0] = sqrt(sum of partials); one block
    scratch = cuda.shared.array(MAX_THREADS, float32)
    total = float32(0.0)
    for i in range(cuda.threadIdx.x, partials.size, cuda.blockDim.x):
        total += partials[i]
    total = block_sum(total, scratch)
    if cuda.threadIdx.x == 0:
        norm[0] = math.sqrt(total)


@inlined
def hyperparameters(hyper, norm):
    # (lr, beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2, clip) of the step
    grad_clip = hyper[5]
    clip = float32(1.0)
    if grad_clip > 0:
        clip = min(float32(1.0), grad_clip / (norm[0] + float32(1e-6)))
    return hyper[0], hyper[1], hyper[2], hyper[3], hyper[4], hyper[6], hyper[7], clip


@inlined
def update(param, g, m_i, v_i, decay, lr, beta1, beta2, eps, weight_decay, bias_correction1,
           bias_correction2, clip):
    # one parameter's step (the module's doc): (its new m, v, param)
    g = g * clip
    m_i = beta1 * m_i + (float32(1.0) - beta1) * g
    v_i = beta2 * v_i + (float32(1.0) - beta2) * g * g
    change = (m_i / bias_correction1) / (math.sqrt(v_i / bias_correction2) + eps)
    if decay:
        change += weight_decay * param
    return m_i, v_i, float32(param - lr * change)


@inlined
def update_one(params, grads, m, v, n_decay, bf16_copies, i, lr, beta1, beta2, eps,
               weight_decay, bias_correction1, bias_correction2, clip):
    # parameter i's step, its bf16 copy beside it (i < n)
    m[i], v[i], param = update(params[i], grads[i], m[i], v[i], i < n_decay, lr, beta1, beta2,
                               eps, weight_decay, bias_correction1, bias_correction2, clip)
    params[i] = param
    if i < bf16_copies.size:            # (the pair of param and 0: param's bf16 in the low half)
        bf16_copies[i] = bf16_pair(param, float32(0.0))


@cuda.jit
def adamw_kernel(params, grads, m, v, hyper, norm, n_decay, bf16_copies):
    # the reference kernel: one thread per parameter, grid-stride
    h = hyperparameters(hyper, norm)
    for i in range(cuda.grid(1), params.size, cuda.gridsize(1)):
        update_one(params, grads, m, v, n_decay, bf16_copies, i, *h)


@cuda.jit
def adamw4_kernel(params, grads, m, v, hyper, norm, n_decay, bf16_copies):
    # the fast kernel, for 16-byte aligned buffers: four adjacent parameters a thread, each
    # buffer read and written 16 bytes at a time (four times the bytes in flight a load of
    # the reference's), the same arithmetic a parameter; the last P % 4 one a thread
    lr, beta1, beta2, eps, weight_decay, bc1, bc2, clip = hyperparameters(hyper, norm)
    whole = params.size // 4 * 4
    for i in range(4 * cuda.grid(1), whole, 4 * cuda.gridsize(1)):
        p0, p1, p2, p3 = load4(params, (i,))
        g0, g1, g2, g3 = load4(grads, (i,))
        m0, m1, m2, m3 = load4(m, (i,))
        v0, v1, v2, v3 = load4(v, (i,))
        m0, v0, p0 = update(p0, g0, m0, v0, i < n_decay, lr, beta1, beta2, eps, weight_decay,
                            bc1, bc2, clip)
        m1, v1, p1 = update(p1, g1, m1, v1, i + 1 < n_decay, lr, beta1, beta2, eps,
                            weight_decay, bc1, bc2, clip)
        m2, v2, p2 = update(p2, g2, m2, v2, i + 2 < n_decay, lr, beta1, beta2, eps,
                            weight_decay, bc1, bc2, clip)
        m3, v3, p3 = update(p3, g3, m3, v3, i + 3 < n_decay, lr, beta1, beta2, eps,
                            weight_decay, bc1, bc2, clip)
        store4(m, (i,), m0, m1, m2, m3)
        store4(v, (i,), v0, v1, v2, v3)
        store4(params, (i,), p0, p1, p2, p3)
        for e, param in ((0, p0), (1, p1), (2, p2), (3, p3)):
            if i + e < bf16_copies.size:
                bf16_copies[i + e] = bf16_pair(param, float32(0.0))
    for i in range(whole + cuda.grid(1), params.size, cuda.gridsize(1)):
        update_one(params, grads, m, v, n_decay, bf16_copies, i, lr, beta1, beta2, eps,
                   weight_decay, bc1, bc2, clip)


def adamw_hyperparameters(lr, beta1, beta2, eps, weight_decay, grad_clip, step):
    """The `hyper` vector for optimizer step number `step` (1-based)."""
    return np.array([lr, beta1, beta2, eps, weight_decay, grad_clip,
                     1.0 - beta1 ** step, 1.0 - beta2 ** step], dtype=np.float32)


def _check(bf16_copies, *flat_buffers):
    check(all(len(b.shape) == 1 and b.shape == flat_buffers[0].shape for b in flat_buffers),
          "adamw: params, grads, m, v must be flat buffers of one size")
    check(bf16_copies.dtype == np.uint16 and len(bf16_copies.shape) == 1
          and bf16_copies.size <= flat_buffers[0].size,
          f"adamw: bf16_copies must be uint16 [n <= {flat_buffers[0].size}], got "
          f"{bf16_copies.dtype} {tuple(bf16_copies.shape)}")


def grad_norm(norm, grads, partials):
    """norm[0] = ||grads||_2 (two deterministic reductions; partials: [NORM_BLOCKS] scratch)."""
    check_float32(norm=norm, grads=grads, partials=partials)
    check(partials.shape == (NORM_BLOCKS,), f"grad_norm: partials must be [{NORM_BLOCKS}]")
    launch(squares_partial_kernel, NORM_BLOCKS, THREADS, partials, grads)
    launch(norm_from_partials_kernel, 1, THREADS, norm, partials)


def adamw_update(params, grads, m, v, hyper, norm, n_decay, bf16_copies, kernel="auto"):
    """One AdamW step over params [P] (the module's doc), and the first bf16_copies.size
    weights' bf16 copies. kernel: "auto" (adamw4_kernel where every buffer is 16-byte
    aligned: ZeRO-1's shards may not be) or "reference" (adamw_kernel); the same bits."""
    check_float32(params=params, grads=grads, m=m, v=v, hyper=hyper, norm=norm)
    _check(bf16_copies, params, grads, m, v)
    check(kernel in ("auto", "reference"), f"adamw: unknown kernel {kernel!r}")
    fast = kernel == "auto" and all(aligned16(x) for x in (params, grads, m, v))
    per_thread = 4 if fast else 1
    launch(adamw4_kernel if fast else adamw_kernel,
           min(4096, max(1, blocks(params.size, THREADS * per_thread))), THREADS,
           params, grads, m, v, hyper, norm, np.int64(n_decay), bf16_copies)


def grad_norm_numpy(norm, grads, partials=None):
    norm[0] = np.sqrt(np.sum(grads.astype(np.float64) ** 2))


def adamw_update_numpy(params, grads, m, v, hyper, norm, n_decay, bf16_copies,
                       kernel="auto"):
    _check(bf16_copies, params, grads, m, v)
    lr, beta1, beta2, eps, weight_decay, grad_clip, bc1, bc2 = [float(h) for h in hyper]
    clip = min(1.0, grad_clip / (float(norm[0]) + 1e-6)) if grad_clip > 0 else 1.0
    g = grads * clip
    m[...] = beta1 * m + (1.0 - beta1) * g
    v[...] = beta2 * v + (1.0 - beta2) * g * g
    update = (m / bc1) / (np.sqrt(v / bc2) + eps)
    update[:n_decay] += weight_decay * params[:n_decay]
    params -= lr * update
    bf16_copies[...] = bf16_bits(params[:bf16_copies.size])
