"""What a run says about the hardware it runs on: its precision line and its MFU.

    precision_line(...)     what runs where, as a run's first line says it: "matmuls and
                            attention bf16 on the tensor cores", "float32 throughout", ...
    flops_per_token(config) the model FLOPs of training one token: 6 a parameter (the
                            products, forward and backward) and attention's scores
    peak_flops(precision)   the card's dense peak in that precision (kernels/runtime/device.py's
                            table, read by compute capability and name); None: not known
    MFU = flops_per_token x tokens/s / peak: the share of the card's peak that the model's own
    arithmetic is, as nanoGPT and llm.c report it (recomputation and padding not counted)
"""
from .config import parameter_breakdown
from .kernels.attention import TENSOR_CORE_HEAD_SIZES
from .kernels.runtime import device


def precision_line(precision, head_size, device="cuda"):
    """What a run's precision puts on the tensor cores, as its first line says it: in bf16 the
    attention too, where a tensor-core kernel takes its head size. On the CPU there are none:
    the NumPy twins round the operands as the tensor cores would, for the same numbers, not for
    speed."""
    if precision == "fp32":
        return "float32 throughout"
    if device == "cpu":
        rounded = ("matmuls' and attention's operands rounded to bf16" if precision == "bf16"
                   else "matmuls' operands rounded to tf32, attention float32")
        return f"{rounded}, float32 sums (NumPy on the CPU: {precision}'s numbers, not its speed)"
    if precision == "tf32":
        return "matmuls tf32 on the tensor cores, attention float32"
    if head_size in TENSOR_CORE_HEAD_SIZES:
        return "matmuls and attention bf16 on the tensor cores"
    return (f"matmuls bf16 on the tensor cores, attention float32 (no tensor-core kernel takes "
            f"heads of {head_size})")


def flops_per_token(config):
    """Training FLOPs per token: 6 per parameter (matmuls forward and backward) + attention."""
    n = parameter_breakdown(config)[-1][1]
    return 6.0 * n + 6.0 * config.n_layer * config.n_embd * config.block_size


def peak_flops(precision):
    """The GPU's dense peak FLOP/s in `precision`; None where the table does not know it."""
    return device.peak_flops(precision)


def mfu(config, tokens_per_second, peak, ranks=1):
    """Model FLOPs utilisation of `ranks` GPUs of `peak` FLOP/s each; None without a peak."""
    if not peak:
        return None
    return flops_per_token(config) * tokens_per_second / (peak * ranks)
