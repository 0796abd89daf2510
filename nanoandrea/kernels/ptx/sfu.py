"""Two instructions of the special-function unit (SFU), each one MUFU instruction, approximate:

    exp2_fast(x)        2^x    ex2.approx.ftz.f32   relative error ~2^-22
    reciprocal_fast(x)  1/x    rcp.approx.ftz.f32   relative error ~2^-23

`.ftz` flushes results below 2^-126 (denormals) to zero. Where a result is rounded to bf16 (8
bits of mantissa) or only summed with larger ones (a softmax row), neither the error nor the
flush shows, and each saves the ten or so instructions of the exact forms: libdevice's exp2f
adds a test and two multiplies to keep denormals, an IEEE division a Newton step, a fix-up and
a slow path. The tensor-core attention's softmax (attention/mma_sync.py, attention/wgmma.py) and
the bf16 products' GELU epilogues (gelu.gelu_value_sfu) use them. The simulator's twins are the
exact forms.
"""
import math

from numba import float32

from ..runtime.device import SIMULATOR

if SIMULATOR:
    def exp2_fast(x):
        return float32(math.exp2(x))

    def reciprocal_fast(x):
        return float32(float32(1.0) / x)
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    def one_instruction(asm):
        """An intrinsic float32 -> float32 that is the one PTX instruction `asm`."""
        def typer(typingctx, x):
            def codegen(context, builder, signature, args):
                value = context.cast(builder, args[0], signature.args[0], types.float32)
                f32 = ir.FloatType()
                function = ir.InlineAsm(ir.FunctionType(f32, [f32]), asm, "=f,f",
                                        side_effect=False)
                return builder.call(function, [value])

            return types.float32(x), codegen
        return intrinsic(typer)

    exp2_fast = one_instruction("ex2.approx.ftz.f32 $0, $1;")
    reciprocal_fast = one_instruction("rcp.approx.ftz.f32 $0, $1;")
