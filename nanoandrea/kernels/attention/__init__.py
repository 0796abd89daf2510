"""Causal softmax attention over all heads in one launch: the family, and its one dispatch.

    out[B,H,T,D] = causal softmax(q k^T / sqrt(D)) v,  lse[B,H,T] kept for the backward

reference.py holds the math, the dropout, the NumPy twins and the reference kernels. The
operands say the precision: float32 heads, or q, k, v rounded once to bf16 (operands.py's
Bf16Heads: the bf16 training's `heads_operand`). `choose` picks the kernels:

    wgmma      bf16 heads of D = 32 or 64 on a GPU that runs wgmma (compute capability 9.0):
               every product one warpgroup instruction, the fastest (wgmma.py)
    mma        bf16 heads of D = 32 or 64 elsewhere (the 8.x GPUs): mma.sync (mma_sync.py)
    float32    float32 heads of D = 16, 32 or 64, rows 16-byte aligned: flash-attention-2
               tiles on the CUDA cores (float32.py)
    reference  any other D (72, 384, ...): a warp a row, correct for every D (reference.py)

`kernel=` names one of them instead (the tests, the benchmark, the mma.sync kernels forced on
an H100); the tensor-core kernels round float32 heads given to them first. Sampling with a
key/value cache attends a few new tokens to the cached keys instead (kvcache.py).

The backend's functions (nanoandrea/backend.py), each with its NumPy twin in reference.py:
    attention_forward, attention_backward            in the operands' precision
    attention_forward_bf16, attention_backward_bf16  q, k, v rounded to bf16 first, where the
                                                     tensor-core kernels take their D
    heads_operand(x)    q, k or v as the bf16 attention reads it (rounded once, for forward
                        and backward); rounds_heads(x): whether it rounds them (then the
                        model's split_heads need not copy the float32 heads)
"""
import math

import numpy as np

from ..operands import Bf16Heads, heads_bf16
from ..ptx.vector import aligned16
from ..runtime import device
from ..runtime.launch import check, check_float32, check_float32_rows
from . import float32, mma_sync, reference, wgmma
from .reference import (attention_backward_bf16_numpy, attention_backward_numpy,  # noqa: F401
                        attention_forward_bf16_numpy, attention_forward_numpy, check_attention,
                        dropout_arguments)
from .tiles import LOG2E

KERNELS = ("wgmma", "mma", "float32", "reference")
TENSOR_CORE_HEAD_SIZES = (32, 64)


def choose(D, arrays):
    """The kernels that take heads of D given as `arrays` (the module's doc)."""
    if any(isinstance(x, Bf16Heads) for x in arrays):
        check(D in TENSOR_CORE_HEAD_SIZES, f"attention: heads of {D} in bf16: the tensor-core "
              f"kernels take D in {TENSOR_CORE_HEAD_SIZES}")
        return "wgmma" if device.runs_wgmma() else "mma"
    return "float32" if float32.takes(D, arrays) else "reference"


def _tensor_core_operands(kernel, D, arrays, lse, **heads):
    """Checks the arguments of the tensor-core kernels; the Bf16Heads pairs of q, k, v (the
    wgmma kernels take them as contiguous heads or side by side in rows, reads_heads_in_rows;
    the mma.sync kernels contiguous)."""
    check(rounds_heads_of(D, arrays), f"attention: the {kernel} kernels take D in "
          f"{TENSOR_CORE_HEAD_SIZES} and 16-byte aligned rows, got D={D}")
    check_float32(lse=lse)
    check_float32_rows(**{name: x for name, x in heads.items() if not isinstance(x, Bf16Heads)})
    pairs = [heads_bf16(heads[name]).bf16_pairs for name in ("q", "k", "v")]
    check(kernel == "wgmma" or all(x.is_c_contiguous() for x in pairs),
          f"attention: the {kernel} kernels take q, k, v's bf16 pairs as contiguous heads")
    return pairs


def attention_forward(out, lse, q, k, v, dropout_p=0.0, seed=None, site=0, kernel="auto",
                      rows_per_block=None, out_bf16=None):
    """out = causal softmax(q k^T / sqrt(D)) v for every (batch, head); lse saved for backward.
    dropout_p > 0 drops attention probabilities (seed: int64[1] on the device, site: an int).
    rows_per_block (float32 kernels): query rows per thread block. out_bf16: a Bf16Heads that
    the tensor-core kernels write too, out rounded to bf16 (the bits round_bf16 would make):
    the bf16 training's operand of the product after attention (W_O), without a rounding
    pass (writes_bf16_out says when)."""
    B, H, T, D = check_attention(q, k, v, out=out, lse=lse)
    kernel = choose(D, (out, q, k, v)) if kernel == "auto" else kernel
    check(kernel in KERNELS, f"attention: unknown kernel {kernel!r}: one of {', '.join(KERNELS)}")
    check(out_bf16 is None or kernel in ("wgmma", "mma") and isinstance(out_bf16, Bf16Heads)
          and out_bf16.shape == out.shape, f"attention: the {kernel} kernels write out in "
          "float32 only; out_bf16 is a Bf16Heads of out's shape for the tensor-core kernels")
    if kernel == "reference":
        reference.attention_forward_reference(out, lse, q, k, v, dropout_p, seed, site)
    elif kernel == "float32":
        float32.attention_forward_flash(out, lse, q, k, v, dropout_p, seed, site, rows_per_block)
    else:
        qkv_pairs = _tensor_core_operands(kernel, D, (out, q, k, v), lse, out=out, q=q, k=k,
                                          v=v)
        launch = (wgmma.attention_forward_wgmma if kernel == "wgmma" else
                  mma_sync.attention_forward_mma)
        launch(out, lse, *qkv_pairs, np.float32(LOG2E / math.sqrt(D)), dropout_p > 0,
               dropout_arguments(dropout_p, seed, site),
               None if out_bf16 is None else out_bf16.bf16_pairs)


def reads_heads_in_rows(D):
    """Whether the bf16 attention of heads of D takes q, k, v as the bf16 pairs of [B,T,C] rows,
    the heads side by side (bf16_heads_view): the wgmma kernels, which read their tiles
    straight from there, so the products of W_Q, W_K, W_V write them in bf16 and no pass
    rounds or copies the heads."""
    return D in TENSOR_CORE_HEAD_SIZES and device.runs_wgmma()


def writes_bf16_out(q, k, v):
    """Whether attention_forward of these operands (heads_operand's) can write out's bf16 copy
    too (out_bf16): where the tensor-core kernels take them."""
    return all(isinstance(x, Bf16Heads) for x in (q, k, v))


def attention_backward(dq, dk, dv, delta, dout, q, k, v, out, lse, accumulate=False,
                       dropout_p=0.0, seed=None, site=0, kernel="auto", rows_per_block=None):
    """dq, dk, dv (+)= the gradients of attention_forward (with the same dropout arguments);
    delta [B,H,T] is scratch. rows_per_block (float32 kernels): key rows per dk/dv block.
    dq, dk, dv may be Bf16Heads (all three, accumulate False: the tensor-core kernels write
    each gradient's floats rounded to bf16 pairs, the bits round_bf16 would make of them):
    the bf16 training's gradients of q, k, v, which only products read next."""
    B, H, T, D = check_attention(q, k, v, dq=dq, dk=dk, dv=dv, dout=dout, out=out, lse=lse,
                                 delta=delta)
    arrays = (dq, dk, dv, dout, q, k, v, out)
    kernel = choose(D, arrays) if kernel == "auto" else kernel
    check(kernel in KERNELS, f"attention: unknown kernel {kernel!r}: one of {', '.join(KERNELS)}")
    bf16_grads = _bf16_grads(kernel, accumulate, dq, dk, dv)
    if kernel == "reference":
        reference.attention_backward_reference(dq, dk, dv, delta, dout, q, k, v, out, lse,
                                               accumulate, dropout_p, seed, site)
    elif kernel == "float32":
        float32.attention_backward_flash(dq, dk, dv, delta, dout, q, k, v, out, lse, accumulate,
                                         dropout_p, seed, site, rows_per_block)
    else:
        qkv_pairs = _tensor_core_operands(kernel, D, arrays, lse, dq=dq, dk=dk, dv=dv,
                                          dout=dout, q=q, k=k, v=v, out=out)
        check_float32(delta=delta)
        scale = np.float32(1.0 / math.sqrt(D))
        launch = (wgmma.attention_backward_wgmma if kernel == "wgmma" else
                  mma_sync.attention_backward_mma)
        grads = [x.bf16_pairs if bf16_grads else x for x in (dq, dk, dv)]
        launch(*grads, delta, dout, out, qkv_pairs, lse, np.float32(LOG2E * scale), scale,
               dropout_p > 0, dropout_arguments(dropout_p, seed, site), accumulate, bf16_grads)


def _bf16_grads(kernel, accumulate, dq, dk, dv):
    """Whether the gradients are to be written in bf16 (Bf16Heads), checking that all three
    are, that nothing is added to them, and that the kernels write bf16."""
    in_bf16 = [isinstance(x, Bf16Heads) for x in (dq, dk, dv)]
    if not any(in_bf16):
        return False
    check(all(in_bf16) and not accumulate, "attention: gradients in bf16 are dq, dk and dv all "
          "three, written (not added to)")
    check(kernel in ("wgmma", "mma"), f"attention: the {kernel} kernels write float32 "
          "gradients, not bf16")
    return True


def rounds_heads_of(D, arrays):
    """Whether the tensor-core kernels take heads of D as `arrays`: D in
    TENSOR_CORE_HEAD_SIZES, each array bf16 already or with 16-byte aligned rows."""
    return D in TENSOR_CORE_HEAD_SIZES and all(isinstance(x, Bf16Heads) or aligned16(x)
                                               for x in arrays)


def rounds_heads(x):
    """Whether the bf16 attention rounds heads x [B,H,T,D] (a float32 array or view) to bf16
    (heads_operand): then a float32 copy of the split heads is never read."""
    return rounds_heads_of(x.shape[3], (x,))


def rounds_heads_numpy(x):
    return False        # (the NumPy twins round their operands' values themselves)


def heads_operand(x):
    """q, k or v [B,H,T,D] as the bf16 attention reads it: rounded to bf16 (a Bf16Heads) where
    the tensor-core kernels take it, else x itself (the float32 kernels read it)."""
    return heads_bf16(x) if rounds_heads(x) else x


def heads_operand_numpy(x):
    return x


def attention_forward_bf16(out, lse, q, k, v, dropout_p=0.0, seed=None, site=0, kernel="auto",
                           rows_per_block=None, out_bf16=None):
    """attention_forward of q, k, v rounded to bf16 where the tensor-core kernels take them."""
    q, k, v = (heads_operand(x) if not isinstance(x, Bf16Heads) else x for x in (q, k, v))
    attention_forward(out, lse, q, k, v, dropout_p, seed, site, kernel, rows_per_block,
                      out_bf16)


def attention_backward_bf16(dq, dk, dv, delta, dout, q, k, v, out, lse, accumulate=False,
                            dropout_p=0.0, seed=None, site=0, kernel="auto",
                            rows_per_block=None):
    """attention_backward of q, k, v rounded to bf16 where the tensor-core kernels take them
    (dout is rounded by the kernels' first pass)."""
    q, k, v = (heads_operand(x) if not isinstance(x, Bf16Heads) else x for x in (q, k, v))
    attention_backward(dq, dk, dv, delta, dout, q, k, v, out, lse, accumulate, dropout_p, seed,
                       site, kernel, rows_per_block)
