"""Tensor cores from Numba: one warp's 16 x 8 x 8 matrix multiply-accumulate (mma.sync, sm_80
and later) on TF32 inputs, and the split of a float32 into two TF32 parts that makes three of
them as accurate as float32 ("3xTF32", what PyTorch's float32 attention runs on).

    hi, lo = split_tf32(x)                  x = hi + lo + r, |r| <= 2^-21 |x|; hi, lo TF32
    d0, d1, d2, d3 = mma_tf32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)       D = A B + C

mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 is ONE instruction for the whole warp:
A [16,8] times B [8,8] plus C [16,8], each lane holding pieces (fragments) of the four
matrices in registers. With g = lane // 4 (its group) and t = lane % 4 (its place in the group):
    a0 = A[g, t]     a1 = A[g+8, t]     a2 = A[g, t+4]     a3 = A[g+8, t+4]
    b0 = B[t, g]     b1 = B[t+4, g]
    c0 = C[g, 2t]    c1 = C[g, 2t+1]    c2 = C[g+8, 2t]    c3 = C[g+8, 2t+1]     (D the same)
All 32 lanes must execute it together (no lane of the warp may have left the code path).

TF32 keeps float32's exponent and 10 of its 23 mantissa bits. split_tf32 cuts x's mantissa:
hi = x with its low 13 bits zeroed, lo = x - hi (exact in float32) with its own low 13 bits
zeroed. Then A B = Ahi Bhi + Ahi Blo + Alo Bhi + (Alo Blo and the cut bits, ~2^-21 relative),
three mma's whose sums the tensor cores accumulate in float32.

mma_tf32 is inline PTX (llvmlite InlineAsm, as kernels/asynccopy.py's copies are; C tied to
D's registers, so that a chain of mma's into one accumulator moves nothing), split_tf32
LLVM IR (bit casts and a mask). Under the CUDA simulator there is neither: split_tf32 does the
same bit arithmetic in NumPy, and mma_tf32 gathers the warp's fragments through a list that the
warp's 32 Python threads meet at (reduce.warp_values), multiplies the matrices and hands
each lane its fragment of D.
"""
import numpy as np

from .launch import SIMULATOR

TF32_MASK = 0xFFFFE000          # float32 bits kept by TF32: sign, exponent, 10 mantissa bits


def split_tf32_numpy(x):
    """hi, lo (float32 arrays) of split_tf32, elementwise."""
    x = np.asarray(x, dtype=np.float32)
    hi = (x.view(np.uint32) & np.uint32(TF32_MASK)).view(np.float32)
    lo = ((x - hi).view(np.uint32) & np.uint32(TF32_MASK)).view(np.float32)
    return hi, lo


def mma_numpy(a, b, c):
    """D = A B + C for A [16,8], B [8,8], C [16,8] (float32; the products summed in float64)."""
    return (a.astype(np.float64) @ b.astype(np.float64) + c).astype(np.float32)


if SIMULATOR:
    from numba import cuda, float32

    from .reduce import warp_values

    def split_tf32(x):
        hi, lo = split_tf32_numpy(np.float32(x))
        return float32(hi), float32(lo)

    @cuda.jit(device=True)      # (a device function: `cuda` in it is the simulated one)
    def mma_tf32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        fragments, lane = warp_values((a0, a1, a2, a3, b0, b1, c0, c1, c2, c3))
        a, b, c = np.zeros((16, 8)), np.zeros((8, 8)), np.zeros((16, 8))
        for other, (x0, x1, x2, x3, y0, y1, z0, z1, z2, z3) in enumerate(fragments):
            g, t = divmod(other, 4)
            a[g, t], a[g + 8, t], a[g, t + 4], a[g + 8, t + 4] = x0, x1, x2, x3
            b[t, g], b[t + 4, g] = y0, y1
            c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1] = z0, z1, z2, z3
        # TF32 operands (split_tf32's parts, whose low bits are zero already: then this is exact)
        a, b = (split_tf32_numpy(x.astype(np.float32))[0] for x in (a, b))
        d = mma_numpy(a, b, c)
        g, t = divmod(lane, 4)
        return (float32(d[g, 2 * t]), float32(d[g, 2 * t + 1]), float32(d[g + 8, 2 * t]),
                float32(d[g + 8, 2 * t + 1]))

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    F32, I32 = ir.FloatType(), ir.IntType(32)
    MMA = ("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
           "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};")

    def _float32s(context, builder, signature, args):
        return [context.cast(builder, value, kind, types.float32)
                for value, kind in zip(args, signature.args)]

    def _tf32_bits(builder, value):
        return builder.and_(builder.bitcast(value, I32), ir.Constant(I32, TF32_MASK))

    @intrinsic
    def split_tf32(typingctx, x):
        result = types.UniTuple(types.float32, 2)

        def codegen(context, builder, signature, args):
            (value,) = _float32s(context, builder, signature, args)
            hi = builder.bitcast(_tf32_bits(builder, value), F32)
            lo = builder.bitcast(_tf32_bits(builder, builder.fsub(value, hi)), F32)
            return context.make_tuple(builder, result, [hi, lo])

        return result(x), codegen

    @intrinsic
    def mma_tf32(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        result = types.UniTuple(types.float32, 4)

        def codegen(context, builder, signature, args):
            values = _float32s(context, builder, signature, args)
            operands = [builder.bitcast(value, I32) for value in values[:6]] + values[6:]
            function = ir.InlineAsm(
                ir.FunctionType(ir.LiteralStructType([F32] * 4), [I32] * 6 + [F32] * 4),
                MMA, "=f,=f,=f,=f,r,r,r,r,r,r,0,1,2,3", side_effect=False)
            d = builder.call(function, operands)
            return context.make_tuple(builder, result,
                                      [builder.extract_value(d, i) for i in range(4)])

        return result(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3), codegen
