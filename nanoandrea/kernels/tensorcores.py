"""bf16 tensor cores from Numba: what the tensor-core kernels (matmul_bf16.py, and the
ladder's v11 on) are built from, each instruction with a simulator twin written from the PTX
ISA's fragment definitions.

    d0, d1, d2, d3 = mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)   one warp's D = A B + C
    r0, r1, r2, r3 = ldmatrix_x4(tile, (r, c))          four 8 x 8 bf16 matrices from shared
    r0, r1, r2, r3 = ldmatrix_x4_trans(tile, (r, c))    ... each transposed on its way
    w0, w1, w2, w3 = load4_u32(array, (i, j))           16 bytes: array[i, j:j+4], uint32
    store4_u32(array, (i, j), w0, w1, w2, w3)
    w = bf16_pair(x0, x1)                               two float32s rounded to bf16, packed
    x0, x1 = bf16_unpair(w)                             a pair's two bf16 as float32s

bf16 values travel in pairs, packed into one uint32 (the lower index in the low 16 bits, as
they lie in memory): a bf16 matrix [R, C] is a uint32 array [R, C/2] (pack_bf16 on the host).

mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 is ONE instruction for the whole warp:
A [16,16] (bf16) times B [16,8] (bf16) plus C [16,8] (float32). With g = lane // 4 and
t = lane % 4, each lane holds (PTX ISA, "mma.m16n8k16" fragments for .bf16):
    a0 = A[g, 2t:2t+2]    a1 = A[g+8, 2t:2t+2]    a2 = A[g, 2t+8:2t+10]   a3 = A[g+8, 2t+8:2t+10]
    b0 = B[2t:2t+2, g]    b1 = B[2t+8:2t+10, g]                  (each a pair: one uint32)
    c0 = C[g, 2t]   c1 = C[g, 2t+1]   c2 = C[g+8, 2t]   c3 = C[g+8, 2t+1]      (D the same)
ldmatrix.sync.aligned.m8n8.x4.shared.b16 loads four 8 x 8 matrices of 16-bit values for the
warp: lanes 8i .. 8i+7 give the addresses of matrix i's 8 rows (16 bytes each), and lane l
gets, of each matrix, the pair in row l // 4, columns 2 (l % 4) and 2 (l % 4) + 1: A's
fragment layout, so that four matrices (rows 0-7 / 8-15 by columns 0-7 / 8-15, in that order)
are one m16 x k16 A fragment. With .trans a lane gets the pair in column l // 4, rows
2 (l % 4), 2 (l % 4) + 1: B's layout, from a B stored k-major (rows along k).

On the GPU these are inline PTX (llvmlite InlineAsm; C tied to D's registers, so a chain of
mma's into one accumulator moves nothing) and LLVM vector loads. Under the simulator, the same
names are Python: the warp's 32 threads meet (reduce.warp_values), and each lane computes its
part of the instruction's result from all lanes' operands.
"""
import numpy as np

from .launch import SIMULATOR


# --- bf16 on the host ------------------------------------------------------------------------

def bf16_bits(x):
    """The bf16 nearest each float32 of x (ties to even), as uint16 bit patterns."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def bf16_values(x):
    """x rounded to bf16, as float32s (what the tensor cores multiply)."""
    return (bf16_bits(x).astype(np.uint32) << 16).view(np.float32)


def pack_bf16(x):
    """A float32 matrix [R, C] (C even) as bf16 pairs: uint32 [R, C/2]."""
    bits = bf16_bits(x).astype(np.uint32)
    return np.ascontiguousarray(bits[..., 0::2] | (bits[..., 1::2] << 16))


def unpack_bf16(words):
    """uint32 [..., C/2] of bf16 pairs -> float32 [..., C]."""
    words = np.asarray(words, dtype=np.uint32)
    out = np.empty(words.shape[:-1] + (2 * words.shape[-1],), np.uint32)
    out[..., 0::2], out[..., 1::2] = words << 16, words & np.uint32(0xFFFF0000)
    return out.view(np.float32)


if SIMULATOR:
    from numba import cuda, float32, uint32

    from .reduce import warp_values

    _G, _T = np.divmod(np.arange(32), 4)
    _PAIR = np.array([0, 1])
    # where each lane's 12 bf16 of A (its a0..a3 as pairs) and of B (b0, b1) lie in A, B: the
    # fragment table above, one row a lane
    _A_ROWS = np.repeat(np.stack([_G, _G + 8, _G, _G + 8], axis=1), 2, axis=1)
    _A_COLS = np.concatenate([2 * _T[:, None] + _PAIR + offset for offset in (0, 0, 8, 8)], 1)
    _B_ROWS = np.concatenate([2 * _T[:, None] + _PAIR + offset for offset in (0, 8)], 1)
    _B_COLS = np.repeat(_G[:, None], 4, axis=1)

    @cuda.jit(device=True)      # (device functions: `cuda` in them is the simulated one)
    def mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        fragments, lane = warp_values((a0, a1, a2, a3, b0, b1, c0, c1, c2, c3))
        words = unpack_bf16(np.array([f[:6] for f in fragments], dtype=np.uint32))  # [32, 12]
        a, b, c = np.zeros((16, 16)), np.zeros((16, 8)), np.zeros((16, 8))
        a[_A_ROWS, _A_COLS], b[_B_ROWS, _B_COLS] = words[:, :8], words[:, 8:]
        sums = np.array([f[6:] for f in fragments], dtype=np.float64)              # [32, 4]
        c[_G, 2 * _T], c[_G, 2 * _T + 1], c[_G + 8, 2 * _T], c[_G + 8, 2 * _T + 1] = sums.T
        d = (a @ b + c).astype(np.float32)          # (bf16 products are exact in float64)
        g, t = _G[lane], _T[lane]
        return (float32(d[g, 2 * t]), float32(d[g, 2 * t + 1]), float32(d[g + 8, 2 * t]),
                float32(d[g + 8, 2 * t + 1]))

    def _matrices(tile, addresses):
        # the four 8 x 8 bf16 matrices whose rows the lanes address: [4, 8, 8] float32
        rows = np.array([tile[tuple(outer)][c:c + 4] for *outer, c in addresses],
                        dtype=np.uint32)
        return unpack_bf16(rows).reshape(4, 8, 8)

    def _packed(pair):
        return uint32(pack_bf16(np.asarray(pair, np.float32)[None])[0, 0])

    @cuda.jit(device=True)
    def ldmatrix_x4(tile, index):
        addresses, lane = warp_values(tuple(index))
        m = _matrices(tile, addresses)
        g, t = _G[lane], _T[lane]
        return tuple(_packed(m[i, g, 2 * t:2 * t + 2]) for i in range(4))

    @cuda.jit(device=True)
    def ldmatrix_x4_trans(tile, index):
        addresses, lane = warp_values(tuple(index))
        m = _matrices(tile, addresses)
        g, t = _G[lane], _T[lane]
        return tuple(_packed(m[i, 2 * t:2 * t + 2, g]) for i in range(4))

    def bf16_pair(x0, x1):
        return _packed((x0, x1))

    def bf16_unpair(word):
        return tuple(float(v) for v in unpack_bf16(np.array([word], np.uint32)))

    def load4_u32(array, index):
        *outer, j = index
        return tuple(array[tuple(outer) + (j + e,)] for e in range(4))

    def store4_u32(array, index, w0, w1, w2, w3):
        *outer, j = index
        for e, w in enumerate((w0, w1, w2, w3)):
            array[tuple(outer) + (j + e,)] = w

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    from .vector import item_pointer as _pointer
    from .vector import shared_address

    F32, I32, I64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
    WORD4 = ir.VectorType(I32, 4)
    MMA = ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
           "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};")
    LDMATRIX = "ldmatrix.sync.aligned.m8n8.x4{trans}.shared.b16 {{$0, $1, $2, $3}}, [$4];"

    def _check(array, index, dtype=types.uint32):
        if not (isinstance(array, types.Array) and array.dtype == dtype
                and isinstance(index, types.BaseTuple) and len(index) == array.ndim):
            raise TypeError(f"needs a {dtype} array and {getattr(array, 'ndim', '?')} indices, "
                            f"got {array}, {index}")

    def _words(context, builder, kinds, values):
        return [context.cast(builder, value, kind, types.uint32)
                for value, kind in zip(values, kinds)]

    @intrinsic
    def mma_bf16(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        result = types.UniTuple(types.float32, 4)

        def codegen(context, builder, signature, args):
            words = _words(context, builder, signature.args[:6], args[:6])
            floats = [context.cast(builder, value, kind, types.float32)
                      for value, kind in zip(args[6:], signature.args[6:])]
            function = ir.InlineAsm(
                ir.FunctionType(ir.LiteralStructType([F32] * 4), [I32] * 6 + [F32] * 4),
                MMA, "=f,=f,=f,=f,r,r,r,r,r,r,0,1,2,3", side_effect=False)
            d = builder.call(function, words + floats)
            return context.make_tuple(builder, result,
                                      [builder.extract_value(d, i) for i in range(4)])

        return result(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3), codegen

    def _ldmatrix(trans):
        code = LDMATRIX.format(trans=".trans" if trans else "")

        @intrinsic
        def ldmatrix(typingctx, tile, index):
            _check(tile, index)
            result = types.UniTuple(types.uint32, 4)

            def codegen(context, builder, signature, args):
                pointer = _pointer(context, builder, signature.args[0], args[0],
                                   signature.args[1], args[1])
                function = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([I32] * 4), [I32]),
                                        code, "=r,=r,=r,=r,r,~{memory}", side_effect=True)
                words = builder.call(function, [shared_address(builder, pointer)])
                return context.make_tuple(builder, result,
                                          [builder.extract_value(words, i) for i in range(4)])

            return result(tile, index), codegen
        return ldmatrix

    ldmatrix_x4 = _ldmatrix(False)
    ldmatrix_x4_trans = _ldmatrix(True)

    @intrinsic
    def bf16_pair(typingctx, x0, x1):
        # cvt.rn.bf16x2.f32 d, a, b: d's upper half is a rounded to bf16 (to nearest, ties to
        # even), its lower half b; x0 goes low, as the lower index lies in memory
        def codegen(context, builder, signature, args):
            x0, x1 = [context.cast(builder, value, kind, types.float32)
                      for value, kind in zip(args, signature.args)]
            function = ir.InlineAsm(ir.FunctionType(I32, [F32, F32]),
                                    "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f",
                                    side_effect=False)
            return builder.call(function, [x1, x0])

        return types.uint32(x0, x1), codegen

    @intrinsic
    def bf16_unpair(typingctx, word):
        # a bf16 is the upper half of the float32 it stands for: shift the low one up, mask
        # the high one, and read both bit patterns as float32s
        result = types.UniTuple(types.float32, 2)

        def codegen(context, builder, signature, args):
            word = context.cast(builder, args[0], signature.args[0], types.uint32)
            low = builder.shl(word, ir.Constant(I32, 16))
            high = builder.and_(word, ir.Constant(I32, 0xFFFF0000))
            return context.make_tuple(builder, result, [builder.bitcast(low, F32),
                                                        builder.bitcast(high, F32)])

        return result(word), codegen

    @intrinsic
    def load4_u32(typingctx, array, index):
        _check(array, index)
        result = types.UniTuple(types.uint32, 4)

        def codegen(context, builder, signature, args):
            pointer = builder.bitcast(_pointer(context, builder, signature.args[0], args[0],
                                               signature.args[1], args[1]),
                                      ir.PointerType(WORD4))
            vector = builder.load(pointer, align=16)
            return context.make_tuple(builder, result, [
                builder.extract_element(vector, ir.Constant(I32, i)) for i in range(4)])

        return result(array, index), codegen

    @intrinsic
    def store4_u32(typingctx, array, index, w0, w1, w2, w3):
        _check(array, index)

        def codegen(context, builder, signature, args):
            pointer = builder.bitcast(_pointer(context, builder, signature.args[0], args[0],
                                               signature.args[1], args[1]),
                                      ir.PointerType(WORD4))
            vector = ir.Constant(WORD4, ir.Undefined)
            for i, word in enumerate(_words(context, builder, signature.args[2:], args[2:])):
                vector = builder.insert_element(vector, word, ir.Constant(I32, i))
            builder.store(vector, pointer, align=16)

        return types.void(array, index, w0, w1, w2, w3), codegen
