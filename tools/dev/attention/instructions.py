"""The instructions only the teaching versions use, from Numba, each with a simulator twin
(copied from the package, which no longer carries them):

    add4(array, (i, j), x0, x1, x2, x3)     array[i, j:j+4] += x, atomically: one
                                            red.global.add.v4.f32 (sm_90)        (v6)
    hi, lo = split_tf32(x)                  x = hi + lo + r, |r| <= 2^-21 |x|; hi, lo TF32
    d0, d1, d2, d3 = mma_tf32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)     one warp's D = A B + C
    d0, d1, d2, d3 = mma3_tf32(c0, c1, c2, c3, a_hi, a_lo, b_hi0, b_hi1, b_lo0, b_lo1)
                                            D = A B + C to float32 accuracy, three mma's

add4 is a reduction into global memory that other threads' adds to the same floats cannot
tear, in whatever order they land: a sum made of such adds is not reproducible to the bit.

mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 is ONE instruction for the whole warp:
A [16,8] times B [8,8] plus C [16,8], each lane holding pieces (fragments) of the matrices.
With g = lane // 4 (its group, or quad) and t = lane % 4 (its place in the quad):
    a0 = A[g, t]     a1 = A[g+8, t]     a2 = A[g, t+4]     a3 = A[g+8, t+4]
    b0 = B[t, g]     b1 = B[t+4, g]
    c0 = C[g, 2t]    c1 = C[g, 2t+1]    c2 = C[g+8, 2t]    c3 = C[g+8, 2t+1]     (D the same)
All 32 lanes must execute it together. So a row of C sits in the 4 lanes of one quad: its max
and sum meet in two shuffles (the package's reduce.quad_max, quad_sum).
TF32 keeps float32's exponent and 10 of its 23 mantissa bits. split_tf32 zeroes x's low 13
bits for hi, and lo = x - hi (exact) likewise; then A B = Ahi Bhi + Ahi Blo + Alo Bhi + ~2^-21
relative: three mma's, accumulated in float32, are as accurate as float32 ("3xTF32").

On the GPU these are inline PTX (mma_tf32: C tied to D's registers, so a chain of mma's into
one accumulator moves nothing; add4) and LLVM IR (split_tf32: bit casts and a mask). Under the
simulator, the same names are Python: the warp's 32 Python threads meet (warp_result), one of
them computes the instruction's result for all, and each lane takes its part; mma3_tf32's twin
meets once for its three mma's.
"""
import numpy as np

from nanoandrea.kernels.launch import SIMULATOR

TF32_MASK = 0xFFFFE000          # float32 bits kept by TF32: sign, exponent, 10 mantissa bits


def split_tf32_numpy(x):
    """hi, lo (float32 arrays) of split_tf32, elementwise."""
    x = np.asarray(x, dtype=np.float32)
    hi = (x.view(np.uint32) & np.uint32(TF32_MASK)).view(np.float32)
    lo = ((x - hi).view(np.uint32) & np.uint32(TF32_MASK)).view(np.float32)
    return hi, lo


if SIMULATOR:
    import threading

    from numba import cuda, float32

    from nanoandrea.kernels.reduce import WARP

    _warps = {}
    _warps_lock = threading.Lock()

    @cuda.jit(device=True)      # (device functions: `cuda` in them is the simulated one)
    def warp_result(value, compute):
        # (compute(the warp's 32 values in lane order), this lane): the lanes meet at one
        # barrier, and the first past it computes the warp's result once, for all. Meeting n
        # fills slots n % 2, so a lane may fill meeting n+1's while others still read n's (none
        # passes n+1 before all have left n); n's result is dropped at meeting n+1
        index = cuda.threadIdx.x + cuda.blockDim.x * (cuda.threadIdx.y
                                                      + cuda.blockDim.y * cuda.threadIdx.z)
        warp, lane = divmod(index, WARP)
        with _warps_lock:
            slots, meetings, results, barrier, lock = _warps.setdefault(
                (tuple(cuda.blockIdx), warp), ([[None] * WARP, [None] * WARP], [0] * WARP, {},
                                              threading.Barrier(WARP, timeout=60),
                                              threading.Lock()))
        n = meetings[lane]
        meetings[lane] += 1
        slots[n % 2][lane] = value
        barrier.wait()
        with lock:
            if n not in results:
                results.pop(n - 1, None)
                results[n] = compute(list(slots[n % 2]))
            return results[n], lane

    @cuda.jit(device=True)
    def add4(array, index, x0, x1, x2, x3):
        *outer, j = index
        outer = tuple(outer)
        for e, x in enumerate((x0, x1, x2, x3)):
            cuda.atomic.add(array, outer + (j + e,), x)

    def split_tf32(x):
        hi, lo = split_tf32_numpy(np.float32(x))
        return float32(hi), float32(lo)

    _G, _T = np.divmod(np.arange(WARP), 4)      # each lane's group and place in it

    def _matrices(x):
        # A [16,8], B [8,8], C [16,8] from the lanes' fragments (x[n]: value n of each lane)
        a, b, c = np.zeros((16, 8), np.float32), np.zeros((8, 8), np.float32), np.zeros((16, 8))
        a[_G, _T], a[_G + 8, _T], a[_G, _T + 4], a[_G + 8, _T + 4] = x[0], x[1], x[2], x[3]
        b[_T, _G], b[_T + 4, _G] = x[4], x[5]
        c[_G, 2 * _T], c[_G, 2 * _T + 1], c[_G + 8, 2 * _T], c[_G + 8, 2 * _T + 1] = x[6:10]
        return a, b, c

    def _mma(a, b, c):
        # D = A B + C, A and B taken as TF32 (split_tf32's parts already are), summed exactly
        a, b = (split_tf32_numpy(y)[0].astype(np.float64) for y in (a, b))
        return (a @ b + c).astype(np.float32)

    def _fragment(d, lane):
        g, t = divmod(lane, 4)
        return (float32(d[g, 2 * t]), float32(d[g, 2 * t + 1]), float32(d[g + 8, 2 * t]),
                float32(d[g + 8, 2 * t + 1]))

    def _one_mma(fragments):
        return _mma(*_matrices(np.array(fragments, dtype=np.float32).T))

    def _three_mmas(fragments):
        # the GPU's mma3_tf32: Alo Bhi, then Ahi Blo, then Ahi Bhi, each rounded to float32
        x = np.array(fragments, dtype=np.float32).T
        a_hi, b_hi, c = _matrices(x)
        a_lo, b_lo, _ = _matrices(np.concatenate([x[10:16], x[6:10]]))
        return _mma(a_hi, b_hi, _mma(a_hi, b_lo, _mma(a_lo, b_hi, c)).astype(np.float64))

    @cuda.jit(device=True)
    def mma_tf32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        return _fragment(*warp_result((a0, a1, a2, a3, b0, b1, c0, c1, c2, c3), _one_mma))

    @cuda.jit(device=True)
    def mma3_tf32(c0, c1, c2, c3, a_hi, a_lo, b_hi0, b_hi1, b_lo0, b_lo1):
        return _fragment(*warp_result((*a_hi, b_hi0, b_hi1, c0, c1, c2, c3, *a_lo, b_lo0,
                                       b_lo1), _three_mmas))

else:
    from llvmlite import ir
    from numba import cuda, types
    from numba.core import cgutils
    from numba.cuda.extending import intrinsic

    from nanoandrea.kernels.launch import inlined

    F32, I32, I64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
    ADD4 = """{
    .reg .u64 global_address;
    cvta.to.global.u64 global_address, $0;
    red.global.add.v4.f32 [global_address], {$1, $2, $3, $4};
}"""
    MMA = ("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
           "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};")

    def _float32s(context, builder, kinds, values):
        return [context.cast(builder, value, kind, types.float32)
                for value, kind in zip(values, kinds)]

    @intrinsic
    def add4(typingctx, array, index, x0, x1, x2, x3):
        if not (isinstance(array, types.Array) and array.dtype == types.float32
                and isinstance(index, types.BaseTuple) and len(index) == array.ndim):
            raise TypeError(f"add4 needs a float32 array and {getattr(array, 'ndim', '?')} "
                            f"indices, got {array}, {index}")

        def codegen(context, builder, signature, args):
            array_type, index_type = signature.args[:2]
            view = context.make_array(array_type)(context, builder, args[0])
            indices = [context.cast(builder, value, kind, types.intp) for value, kind in
                       zip(cgutils.unpack_tuple(builder, args[1], len(index_type)), index_type)]
            pointer = cgutils.get_item_pointer(context, builder, array_type, view, indices,
                                               wraparound=False)
            values = _float32s(context, builder, signature.args[2:], args[2:])
            function = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [I64] + [F32] * 4), ADD4,
                                    "l,f,f,f,f,~{memory}", side_effect=True)
            builder.call(function, [builder.ptrtoint(pointer, I64), *values])

        return types.void(array, index, x0, x1, x2, x3), codegen

    def _tf32_bits(builder, value):
        return builder.and_(builder.bitcast(value, I32), ir.Constant(I32, TF32_MASK))

    @intrinsic
    def split_tf32(typingctx, x):
        result = types.UniTuple(types.float32, 2)

        def codegen(context, builder, signature, args):
            (value,) = _float32s(context, builder, signature.args, args)
            hi = builder.bitcast(_tf32_bits(builder, value), F32)
            lo = builder.bitcast(_tf32_bits(builder, builder.fsub(value, hi)), F32)
            return context.make_tuple(builder, result, [hi, lo])

        return result(x), codegen

    @intrinsic
    def mma_tf32(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        result = types.UniTuple(types.float32, 4)

        def codegen(context, builder, signature, args):
            values = _float32s(context, builder, signature.args, args)
            operands = [builder.bitcast(value, I32) for value in values[:6]] + values[6:]
            function = ir.InlineAsm(
                ir.FunctionType(ir.LiteralStructType([F32] * 4), [I32] * 6 + [F32] * 4),
                MMA, "=f,=f,=f,=f,r,r,r,r,r,r,0,1,2,3", side_effect=False)
            d = builder.call(function, operands)
            return context.make_tuple(builder, result,
                                      [builder.extract_value(d, i) for i in range(4)])

        return result(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3), codegen

    @inlined
    def mma3_tf32(c0, c1, c2, c3, a_hi, a_lo, b_hi0, b_hi1, b_lo0, b_lo1):
        # (c0..c3) + A B, A = a_hi + a_lo (4 fragment floats each, local arrays), B = b_hi + b_lo
        # (2 each): Alo Bhi + Ahi Blo + Ahi Bhi, three mma's, the small parts first
        c0, c1, c2, c3 = mma_tf32(a_lo[0], a_lo[1], a_lo[2], a_lo[3], b_hi0, b_hi1,
                                  c0, c1, c2, c3)
        c0, c1, c2, c3 = mma_tf32(a_hi[0], a_hi[1], a_hi[2], a_hi[3], b_lo0, b_lo1,
                                  c0, c1, c2, c3)
        return mma_tf32(a_hi[0], a_hi[1], a_hi[2], a_hi[3], b_hi0, b_hi1, c0, c1, c2, c3)

