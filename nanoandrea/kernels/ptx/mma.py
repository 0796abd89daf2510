"""bf16 and tf32 tensor cores from Numba: what the tensor-core kernels (matmul/mma_sync.py,
attention/mma_sync.py, and the ladder's v11 on) are built from, each instruction with a
simulator twin written from the PTX ISA's fragment definitions.

    d0, d1, d2, d3 = mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)   one warp's D = A B + C
    d0, d1, d2, d3 = mma_tf32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)   ... A [16,8], B [8,8]: tf32
    r0, r1, r2, r3 = ldmatrix_x4(tile, (r, c))          four 8 x 8 bf16 matrices from shared
    r0, r1, r2, r3 = ldmatrix_x4_trans(tile, (r, c))    ... each transposed on its way
    w = load_shared_u32(tile, (i,))                     one word of a shared uint32 array
    w0, w1, w2, w3 = load4_u32(array, (i, j))           16 bytes: array[i, j:j+4], uint32
    store4_u32(array, (i, j), w0, w1, w2, w3)
    w = bf16_pair(x0, x1)                               two float32s rounded to bf16, packed
    x0, x1 = bf16_unpair(w)                             a pair's two bf16 as float32s
    y = tf32_value(x)                                   a float32 rounded to tf32 (cvt.rna)

A word here is 32 bits, a uint32: a bf16 pair or one tf32. bf16 values travel in pairs, packed
into one word (the lower index in the low 16 bits, as they lie in memory): a bf16 matrix [R, C]
is a uint32 array [R, C/2] (pack_bf16 on the host).

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

mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 takes A [16,8] and B [8,8] of tf32, one
value a register (a float32 rounded to tf32 beforehand, its 13 low mantissa bits zero; the
simulator's twin drops any others):
    a0 = A[g, t]    a1 = A[g+8, t]    a2 = A[g, t+4]    a3 = A[g+8, t+4]
    b0 = B[t, g]    b1 = B[t+4, g]                          (C and D as above)
Counted in 32-bit words along k, that is the bf16 layout word for word: a bf16 k16 step and a
tf32 k8 step both span 8 words, and both mma's take the same registers from the same words.
So a warp's ldmatrix (non-.trans) of operands stored along k hands out tf32 fragments as well
(an 8 x 8 matrix of 16-bit values is 8 rows of 4 words). .trans moves 16-bit values, which
would tear a 32-bit one in half: tf32 operands stored k-major are read one word a lane
(load_shared_u32: tile[i], through a 32-bit shared address as ldmatrix's, where Numba's
indexing would add 64-bit offsets to a 64-bit pointer).

On the GPU these are inline PTX (llvmlite InlineAsm; C tied to D's registers, so a chain of
mma's into one accumulator moves nothing) and LLVM vector loads. Under the simulator, the same
names are Python: the warp's 32 threads meet (ptx/warp.warp_values), and each lane computes its
part of the instruction's result from all lanes' operands.
"""
import numpy as np

from ..runtime.device import SIMULATOR


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


def unpack_bf16(pairs):
    """uint32 [..., C/2] of bf16 pairs -> float32 [..., C]."""
    pairs = np.asarray(pairs, dtype=np.uint32)
    out = np.empty(pairs.shape[:-1] + (2 * pairs.shape[-1],), np.uint32)
    out[..., 0::2], out[..., 1::2] = pairs << 16, pairs & np.uint32(0xFFFF0000)
    return out.view(np.float32)


# --- tf32 on the host ------------------------------------------------------------------------

TF32_MASK = 0xFFFFE000          # the float32 bits tf32 keeps: sign, exponent, 10 of 23 mantissa
TF32_HALF = 0x1000              # half of its last kept bit


def tf32_values(x):
    """x rounded to tf32 as cvt.rna.tf32.f32 rounds it, as float32s (13 low mantissa bits zero):
    to nearest, ties away from zero. Adding half a tf32 step to the magnitude's bits and
    dropping the low 13 does exactly that (a carry out of the mantissa steps the exponent, and
    past the largest float32 lands on infinity: the float32 format is monotonic in its bits).
    NaN stays NaN."""
    bits = np.array(x, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(TF32_HALF)) & np.uint32(TF32_MASK)
    nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    rounded = np.where(nan, (bits & np.uint32(TF32_MASK)) | np.uint32(0x00400000), rounded)
    return rounded.astype(np.uint32).view(np.float32)


def _tf32_words_values(words):
    # uint32 words of tf32 -> their float32 values (any low bits dropped: rounded operands
    # have none)
    return (np.asarray(words, dtype=np.uint32) & np.uint32(TF32_MASK)).view(np.float32)


if SIMULATOR:
    from numba import cuda, float32, uint32

    from .warp import warp_values

    _G, _T = np.divmod(np.arange(32), 4)

    def _mma(values):
        """The twin of an mma whose registers hold words that values(words [..., W]) turns into
        W or 2W values along k: A and B laid out in words by the fragment table above (the
        same for bf16 and tf32), then turned into values."""
        @cuda.jit(device=True)  # (device functions: `cuda` in them is the simulated one)
        def mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            fragments, lane = warp_values((a0, a1, a2, a3, b0, b1, c0, c1, c2, c3))
            words = np.array([f[:6] for f in fragments], dtype=np.uint32).T        # [6, 32]
            a_words, b_words = np.zeros((16, 8), np.uint32), np.zeros((8, 8), np.uint32)
            a_words[_G, _T], a_words[_G + 8, _T] = words[0], words[1]
            a_words[_G, _T + 4], a_words[_G + 8, _T + 4] = words[2], words[3]
            b_words[_G, _T], b_words[_G, _T + 4] = words[4], words[5]   # B^T: [n, k words]
            a = values(a_words).astype(np.float64)
            b = values(b_words).astype(np.float64).T
            c = np.zeros((16, 8))
            sums = np.array([f[6:] for f in fragments], dtype=np.float64)          # [32, 4]
            c[_G, 2 * _T], c[_G, 2 * _T + 1], c[_G + 8, 2 * _T], c[_G + 8, 2 * _T + 1] = sums.T
            d = (a @ b + c).astype(np.float32)  # (bf16 and tf32 products are exact in float64)
            g, t = _G[lane], _T[lane]
            return (float32(d[g, 2 * t]), float32(d[g, 2 * t + 1]), float32(d[g + 8, 2 * t]),
                    float32(d[g + 8, 2 * t + 1]))
        return mma

    mma_bf16 = _mma(unpack_bf16)
    mma_tf32 = _mma(_tf32_words_values)

    def _matrices(tile, addresses):
        # the four 8 x 8 matrices of 16-bit values whose rows the lanes address: [4, 8, 8]
        # (ldmatrix moves bits, whatever they mean; a word's low half is the lower index)
        rows = np.array([tile[tuple(outer)][c:c + 4] for *outer, c in addresses],
                        dtype=np.uint32)
        return rows.astype("<u4").view("<u2").reshape(4, 8, 8)

    def _word(pair):
        return uint32(int(pair[0]) | int(pair[1]) << 16)

    @cuda.jit(device=True)
    def ldmatrix_x4(tile, index):
        addresses, lane = warp_values(tuple(index))
        m = _matrices(tile, addresses)
        g, t = _G[lane], _T[lane]
        return tuple(_word(m[i, g, 2 * t:2 * t + 2]) for i in range(4))

    @cuda.jit(device=True)
    def ldmatrix_x4_trans(tile, index):
        addresses, lane = warp_values(tuple(index))
        m = _matrices(tile, addresses)
        g, t = _G[lane], _T[lane]
        return tuple(_word(m[i, 2 * t:2 * t + 2, g]) for i in range(4))

    def load_shared_u32(tile, index):
        return tile[index]

    def bf16_pair(x0, x1):
        return uint32(pack_bf16(np.array([[x0, x1]], np.float32))[0, 0])

    def tf32_value(x):
        return float32(tf32_values(np.float32(x)))

    def bf16_unpair(word):
        return tuple(float(v) for v in unpack_bf16(np.array([word], np.uint32)))

    def load4_u32(array, index):
        *outer, j = index
        return tuple(array[tuple(outer) + (j + e,)] for e in range(4))

    def store4_u32(array, index, w0, w1, w2, w3):
        *outer, j = index
        for e, w in enumerate((w0, w1, w2, w3)):
            array[tuple(outer) + (j + e,)] = w

    def store2_u32(array, index, w0, w1):
        *outer, j = index
        for e, w in enumerate((w0, w1)):
            array[tuple(outer) + (j + e,)] = w

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    from .vector import item_pointer as _pointer
    from .vector import shared_address

    F32, I32, I64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
    WORD4 = ir.VectorType(I32, 4)
    MMA = ("mma.sync.aligned.{shape}.row.col.f32.{kind}.{kind}.f32 "
           "{{$0, $1, $2, $3}}, {{$4, $5, $6, $7}}, {{$8, $9}}, {{$10, $11, $12, $13}};")
    LDMATRIX = "ldmatrix.sync.aligned.m8n8.x4{trans}.shared.b16 {{$0, $1, $2, $3}}, [$4];"

    def _check(array, index, dtype=types.uint32):
        if not (isinstance(array, types.Array) and array.dtype == dtype
                and isinstance(index, types.BaseTuple) and len(index) == array.ndim):
            raise TypeError(f"needs a {dtype} array and {getattr(array, 'ndim', '?')} indices, "
                            f"got {array}, {index}")

    def _words(context, builder, kinds, values):
        return [context.cast(builder, value, kind, types.uint32)
                for value, kind in zip(values, kinds)]

    def _store_words(context, builder, signature, args, width):
        # array[index:index + width] = the words args[2:], one aligned store of 4 width bytes
        vector_type = ir.VectorType(I32, width)
        pointer = builder.bitcast(_pointer(context, builder, signature.args[0], args[0],
                                           signature.args[1], args[1]),
                                  ir.PointerType(vector_type))
        vector = ir.Constant(vector_type, ir.Undefined)
        for i, word in enumerate(_words(context, builder, signature.args[2:], args[2:])):
            vector = builder.insert_element(vector, word, ir.Constant(I32, i))
        builder.store(vector, pointer, align=4 * width)

    def _mma(shape, element):
        """The intrinsic mma_<element>: one mma.sync of `shape`, A and B in uint32 words (4 and
        2 registers for both shapes), C and D float32."""
        code = MMA.format(shape=shape, kind=element)

        @intrinsic
        def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            result = types.UniTuple(types.float32, 4)

            def codegen(context, builder, signature, args):
                words = _words(context, builder, signature.args[:6], args[:6])
                floats = [context.cast(builder, value, kind, types.float32)
                          for value, kind in zip(args[6:], signature.args[6:])]
                function = ir.InlineAsm(
                    ir.FunctionType(ir.LiteralStructType([F32] * 4), [I32] * 6 + [F32] * 4),
                    code, "=f,=f,=f,=f,r,r,r,r,r,r,0,1,2,3", side_effect=False)
                d = builder.call(function, words + floats)
                return context.make_tuple(builder, result,
                                          [builder.extract_value(d, i) for i in range(4)])

            return result(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3), codegen
        return mma

    mma_bf16 = _mma("m16n8k16", "bf16")
    mma_tf32 = _mma("m16n8k8", "tf32")

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
    def load_shared_u32(typingctx, tile, index):
        _check(tile, index)

        def codegen(context, builder, signature, args):
            pointer = _pointer(context, builder, signature.args[0], args[0], signature.args[1],
                               args[1])
            function = ir.InlineAsm(ir.FunctionType(I32, [I32]), "ld.shared.b32 $0, [$1];",
                                    "=r,r,~{memory}", side_effect=True)
            return builder.call(function, [shared_address(builder, pointer)])

        return types.uint32(tile, index), codegen

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
    def tf32_value(typingctx, x):
        # cvt.rna.tf32.f32 d, a: a rounded to tf32 (to nearest, ties away from zero), in a .b32
        # register that reads as the rounded float32
        def codegen(context, builder, signature, args):
            (value,) = args
            value = context.cast(builder, value, signature.args[0], types.float32)
            function = ir.InlineAsm(ir.FunctionType(I32, [F32]), "cvt.rna.tf32.f32 $0, $1;",
                                    "=r,f", side_effect=False)
            return builder.bitcast(builder.call(function, [value]), F32)

        return types.float32(x), codegen

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
            _store_words(context, builder, signature, args, 4)

        return types.void(array, index, w0, w1, w2, w3), codegen

    @intrinsic
    def store2_u32(typingctx, array, index, w0, w1):
        # two words in one 8-byte store (the index even, the row 8-byte aligned)
        _check(array, index)

        def codegen(context, builder, signature, args):
            _store_words(context, builder, signature, args, 2)

        return types.void(array, index, w0, w1), codegen
