"""Hopper's warpgroup tensor-core instruction, wgmma (sm_90a), from Numba: what matmul/wgmma.py,
attention/wgmma.py (and the matmul ladder from v12 on) are built from, each instruction with a
simulator twin written from the PTX ISA's definitions.

    acc = cuda.local.array(64, float32)          a thread's part of one 64 x 128 float32 D
    multiply = wgmma_m64n128k16(K_MAJOR, MN_MAJOR(8192))    (at import: the operands'
                                                 shared-memory layouts, below: here A
                                                 K-major, B n-major)
    wgmma_fence(acc)                             wgmma.fence: acc's registers ready for wgmma
    multiply(acc, a_tiles, a_word, b_tiles, b_word)
                                                 D[64,128] += A[64,16] B[16,128], started;
                                                 the operands at a_tiles[a_word], b_tiles[b_word]
    wgmma_commit()                               the wgmmas started since form one group
    wgmma_wait(acc)                              wait for all groups; acc readable again
    multiply = wgmma_m64nNk16(64, REGISTERS, MN_MAJOR(8192))
    multiply(acc, a0, a1, a2, a3, b_tiles, b_word)   D[64,64] += A[64,16] B[16,64], A from the
                                                 threads' registers (below), B from shared
    fence = fence_for(32, 16)                    wgmma.fence with two arrays tied (an acc of
    fence(acc, frag)                             32 floats, A fragments in 16 words): any
    wait = wait_for(32, 32)                      count of float32 accumulators or uint32
    wait(acc, acc2)                              fragments (wgmma_fence, wgmma_wait: one of 64)
    fence_proxy_async()                          this thread's generic-proxy writes to shared
                                                 memory (cp.async's) visible to wgmma's reads
    words = dynamic_shared_words()               the dynamic shared array, uint32 (a word: 32
                                                 bits, here a bf16 pair or a float32)
    first = atom_start(words)                    the first word of words on a 1024-byte
                                                 boundary (a 128-byte swizzle's period): 0 to
                                                 255 (launch with ATOM_BYTES more than used)

wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 is ONE instruction for a warpgroup (4
consecutive warps, 128 threads, the first a multiple of 128): A [64,16] and B [16,128], bf16,
both read from shared memory by the tensor cores themselves, added to D [64,128] float32 held
in the 128 threads' registers, 64 a thread. Which 64 (PTX ISA, "Register Fragments", wgmma
.m64nNk16, D): warp w of the warpgroup holds rows 16w .. 16w+15, and within the warp, with
g = lane // 4 and t = lane % 4, mma.sync's m16n8 layout once for each 8 columns j:
    d[4j] = D[16w+g, 8j+2t]    d[4j+1] = D[16w+g, 8j+2t+1]
    d[4j+2] = D[16w+g+8, 8j+2t]    d[4j+3] = D[16w+g+8, 8j+2t+1]

The same instruction comes in every width N from 8 to 256 in steps of 8 (m64nNk16: D [64,N],
N/2 floats a thread, the same layout for j < N/8), and A may instead come from the threads'
registers (the "RS" form; B is always read from shared memory): warp w holds A's rows 16w ..
16w+15 as mma.sync's m16n8k16 A fragment (ptx/mma.py; PTX ISA, "Register Fragments" for
A), four words of bf16 pairs,
    a0 = A[16w+g, 2t:2t+2]   a1 = A[16w+g+8, 2t:2t+2]   a2 = A[16w+g, 2t+8:2t+10]
    a3 = A[16w+g+8, 2t+8:2t+10]
which is what two neighbouring n8 column groups of a D accumulator give, rounded in pairs: a
product's result becomes the next product's A without leaving the registers (attention's P).

The operands are named by MATRIX DESCRIPTORS: 64-bit values that give the start address and
the layout (PTX ISA, "Matrix Descriptor Format"):
    bits 0-13   start address >> 4 (a shared address, 16-byte aligned)
    bits 16-29  leading dimension byte offset >> 4 (LBO)
    bits 32-45  stride dimension byte offset >> 4 (SBO)
    bits 49-51  base offset (0: the swizzle pattern starts at a 1024-byte boundary)
    bits 62-63  swizzle: 0 none, 1 128-byte, 2 64-byte, 3 32-byte
With the 128-byte swizzle, a matrix is made of ATOMS of 8 rows of 128 bytes (1024 bytes), and
inside each the 16-byte chunk c of row r is stored at chunk c ^ r: the 8 rows of any chunk
column fall on 8 different 16-byte groups of banks, so the tensor cores (and cp.async's
writes) meet no bank conflicts. The XOR is of address bits 4-6 with bits 7-9 of the absolute
address, hence the 1024-byte alignment. (An alignment declared for the dynamic shared array is
a promise the compiler believes, and the launch places the array; atom_start asks the address
instead, at the cost of one add an index.) In the canonical layouts (CUTLASS's names),
either operand may lie either way:
  K-major (rows of m for A, of n for B, each along k):  element (row, k) at byte
        128 (row % 8) + SBO (row // 8) + 2k            (k < 64: one 128-byte row holds k0..k63)
    a 64 x 64 slice is 8 atoms, SBO = 1024, LBO unused. A k16 step inside the row is a start
    address 32 bytes on: the hardware swizzles the address it computes, as cp.async's writes
    were swizzled.
  MN-major (rows of k, each along m for A, along n for B):  element (k, col) at byte
        2 (col % 64) + LBO (col // 64) + 128 (k % 8) + SBO (k // 8)
    a row of 64 columns is 128 bytes, 8 rows of k one atom; SBO steps 8 rows of k, LBO 64
    columns. A k16 step is 2 atoms on.
wgmma reads A K-major with imm-trans-a = 0 and MN-major with 1, and B likewise with
imm-trans-b (bf16 operands may come either way; the instruction's default is K-major for
both). The forward's x @ W has A K-major (x's rows) and B n-major (W's rows); dX = dY W^T
reads W's rows as B K-major; dW = x^T dY reads x's rows as A m-major.

Both are written by the kernel with cp.async (nanoandrea/kernels/asynccopy.py), and cp.async
writes through the GENERIC proxy while wgmma reads through the ASYNC proxy: between them,
each writing thread waits for its copies, then runs fence.proxy.async.shared::cta, and only
then the block's barrier makes everyone's copies visible to every warpgroup's wgmma.

The accumulators go through the inline PTX as N/2 outputs tied to N/2 inputs (C = D's
registers, as ptx/mma.mma_bf16 ties its 4). wgmma's results are not there when the
instruction issues, only after wgmma.wait_group, so the wait (and wgmma.fence, before) take
the same values as tied operands: every read of acc after the wait reads the wait's
outputs, and the compiler cannot move one above it. A fragments in registers are tied through
the fence the same way (fence_for), so that every write of them stays above it, as the PTX ISA
asks of registers a wgmma reads. acc is a local array whose elements
become registers once every index into it is a constant (unrolled loops, as v11's acc). What
ptxas makes of v12's slice (tools/dev/offline.py): WARPGROUP.ARRIVE, 4 HGMMA.64x128x16 on the
same registers R24-R87 with nothing moved between them, WARPGROUP.DEPBAR; no warning that it
had to serialize them. ptxas knows wgmma's registers itself: with the wait untied, and even with
wgmma.fence left out, it made the same SASS (inserting the ARRIVE on its own; 2026-12-01,
offline). The ties are for LLVM and NVVM, which know nothing of it: they keep a read of acc
from being scheduled between the instruction and its wait.

On the GPU these are inline PTX (llvmlite InlineAsm). Under the simulator they are Python:
multiply reads A and B from the shared array through the same descriptor (encoded, then
decoded field by field) and adds this thread's part of A B to acc at once, a legal schedule of
an asynchronous instruction; fences, commit and wait do nothing. The twin assumes a 1-D block
(warpgroup = threadIdx.x // 128), and gives the shared array an address whose 1024-byte
boundary is at word SIMULATED_START, not 0, as a GPU might. The twin of the register form
gathers its warp's A fragments (ptx/warp.warp_values), as ptx/mma.py's mma twin does.
"""
import functools
from collections import namedtuple

import numpy as np
from numba import cuda, float32, uint32

from ..runtime.device import SIMULATOR
from ..runtime.launch import inlined_by_numba

M, N, K = 64, 128, 16           # the ladder's wgmma (m64n128k16); any N: m64nNk16
ACCUMULATORS = M * N // 128     # a thread's float32s of that D: 64 (N/2 for m64nNk16)
SWIZZLE_128B = 1                # the descriptor's code for the 128-byte swizzle
ATOM_BYTES = 1024               # 8 rows of 128 bytes: one period of the swizzle

# An operand's layout in shared memory: which axis is contiguous ("K" or "MN"), and the
# descriptor's two byte offsets (see the module's doc). The kernel's tiles must match.
Layout = namedtuple("Layout", "major leading stride")
K_MAJOR = Layout("K", leading=16, stride=ATOM_BYTES)        # (LBO unused: 16 encodes as 1)


REGISTERS = Layout("registers", leading=0, stride=0)       # A in the threads' registers


def MN_MAJOR(columns_apart):
    """An operand stored m- or n-contiguous: 8-row groups of k ATOM_BYTES apart, 64-column
    blocks `columns_apart` bytes apart."""
    return Layout("MN", leading=columns_apart, stride=ATOM_BYTES)


def swizzled(byte):
    """The stored place of byte offset `byte` (from a 1024-byte boundary) under the 128-byte
    swizzle: its 16-byte chunk (bits 4-6) XOR its row in the atom (bits 7-9)."""
    return byte ^ (((byte >> 7) & 7) << 4)


def descriptor_high(layout):
    """The descriptor's bits above the start address: LBO, SBO, the swizzle (base offset 0)."""
    return (((layout.leading >> 4) & 0x3FFF) << 16 | ((layout.stride >> 4) & 0x3FFF) << 32
            | SWIZZLE_128B << 62)


def logical_bytes(layout, rows, cols):
    """Byte offsets, from the start address and before the swizzle, of the elements of a
    canonical-layout operand as it lies, [rows, cols] with cols the contiguous axis: (m or n,
    k) K-major, (k, m or n) MN-major (the CUTLASS formulas above, with the descriptor's
    strides)."""
    r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    if layout.major == "K":
        return 128 * (r % 8) + layout.stride * (r // 8) + 2 * c
    k, col = r, c
    return 2 * (col % 64) + layout.leading * (col // 64) + 128 * (k % 8) + layout.stride * (k // 8)


def read_operand(words, first, desc, major, rows, cols):
    """The bf16 operand a descriptor names, read as wgmma would from a uint32 array of shared
    memory whose word `first` is at shared address 0 (a 1024-byte boundary), as float64 [rows,
    cols] as it lies (logical_bytes): the descriptor's fields decoded, the canonical layout,
    then the swizzle."""
    start = (desc & 0x3FFF) << 4
    layout = Layout(major, leading=((desc >> 16) & 0x3FFF) << 4,
                    stride=((desc >> 32) & 0x3FFF) << 4)
    if desc >> 62 != SWIZZLE_128B:
        raise ValueError("the twin reads only the 128-byte swizzle")
    stored = swizzled(start + logical_bytes(layout, rows, cols))
    bits = (np.asarray(words, np.uint32)[first + stored // 4] >> (16 * ((stored // 2) % 2)))
    return ((bits & 0xFFFF).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _check_layouts(n, a_layout, b_layout):
    if not (8 <= n <= 256 and n % 8 == 0):
        raise ValueError(f"wgmma: N = {n}, not a multiple of 8 from 8 to 256")
    if b_layout.major == REGISTERS.major:
        raise ValueError("wgmma: B is read from shared memory only")


if SIMULATOR:
    from .mma import unpack_bf16
    from .warp import warp_values

    _G, _T = np.divmod(np.arange(32), 4)

    @cuda.jit(device=True)
    def dynamic_shared_words():
        return cuda.shared.array(0, uint32)

    # The simulator's arrays have no shared addresses; the twin gives the dynamic array one
    # that puts its word SIMULATED_START on a 1024-byte boundary, not word 0, so that a kernel
    # that forgets to start its tiles at atom_start fails here as it would on the GPU.
    SIMULATED_START = 24

    def atom_start(words):
        return SIMULATED_START

    def fence_proxy_async():
        pass

    def shared_descriptor(tiles, word):
        """The address field of a descriptor of tiles[word] (word SIMULATED_START at 0)."""
        return ((4 * (int(word) - SIMULATED_START)) & 0x3FFFF) >> 4   # (Python ints: NumPy's
                                                                      # int32 overflows)
    def _operand_a(tiles, desc, major):
        """A [64, 16] as the descriptor names it (float64)."""
        if major == "K":
            return read_operand(tiles, SIMULATED_START, int(desc), "K", M, K)
        return read_operand(tiles, SIMULATED_START, int(desc), "MN", K, M).T

    def _operand_b(tiles, desc, major, n):
        """B [16, n] as the descriptor names it (float64)."""
        if major == "MN":
            return read_operand(tiles, SIMULATED_START, int(desc), "MN", K, n)
        return read_operand(tiles, SIMULATED_START, int(desc), "K", n, K).T

    def _add_rows(acc, rows, n, t, scale_d=1):
        # acc (+)= the part of D's two rows `rows` [2, n] of a thread of lane % 4 = t (the doc's
        # layout); scale_d 0: acc's values are not read (D = A B)
        for j in range(n // 8):
            for e in range(4):
                old = acc[4 * j + e] if scale_d else 0.0
                acc[4 * j + e] = float32(old + rows[e // 2, 8 * j + 2 * t + e % 2])

    @functools.cache
    def wgmma_by_descriptors(n, a_layout, b_layout, scale_d=1):
        """The twin of one wgmma of width n whose operands the kernel names by descriptors into
        the shared array `tiles`; A in registers gathered from the warp's lanes; scale_d 0:
        D = A B, acc's old values unread."""
        _check_layouts(n, a_layout, b_layout)
        if a_layout.major == REGISTERS.major:
            @cuda.jit(device=True)  # (a device function: `cuda` in it is the simulated one)
            def multiply_rs(acc, a0, a1, a2, a3, tiles, b_desc):
                fragments, lane = warp_values((a0, a1, a2, a3))
                words = np.array(fragments, dtype=np.uint32).T                  # [4, 32]
                a_words = np.zeros((16, 8), np.uint32)          # the warp's 16 rows of A
                a_words[_G, _T], a_words[_G + 8, _T] = words[0], words[1]
                a_words[_G, _T + 4], a_words[_G + 8, _T + 4] = words[2], words[3]
                a = unpack_bf16(a_words).astype(np.float64)                     # [16, 16]
                g, t = lane // 4, lane % 4
                _add_rows(acc, a[[g, g + 8]] @ _operand_b(tiles, b_desc, b_layout.major, n), n,
                          t, scale_d)
            return multiply_rs

        @cuda.jit(device=True)
        def multiply(acc, tiles, a_desc, b_desc):
            a = _operand_a(tiles, a_desc, a_layout.major)                       # [M, K]
            thread = cuda.threadIdx.x % 128
            warp, g, t = thread // 32, (thread % 32) // 4, thread % 4
            _add_rows(acc, a[[16 * warp + g, 16 * warp + g + 8]]
                      @ _operand_b(tiles, b_desc, b_layout.major, n), n, t, scale_d)
        return multiply

    @functools.cache
    def _nothing(counts, pending=0):
        def nothing(*arrays):
            pass
        return nothing

    def fence_for(*counts):
        return _nothing(counts)

    def wait_for(*counts, pending=0):
        return _nothing(counts, pending)

    def wgmma_commit():
        pass

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    from .vector import item_pointer as _pointer
    from .vector import shared_address

    F32, I32, I64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)

    @inlined_by_numba
    def dynamic_shared_words():
        return cuda.shared.array(0, uint32, alignment=16)

    @intrinsic
    def atom_start(typingctx, words):
        if not (isinstance(words, types.Array) and words.dtype == types.uint32):
            return None

        def codegen(context, builder, signature, args):
            data = context.make_array(signature.args[0])(context, builder, args[0]).data
            address = shared_address(builder, data)
            skip = builder.and_(builder.neg(address), ir.Constant(I32, ATOM_BYTES - 1))
            return builder.zext(builder.lshr(skip, ir.Constant(I32, 2)), I64)   # (bytes to words)

        return types.intp(words), codegen

    def _asm(builder, text, constraints, arguments, kinds, result=ir.VoidType()):
        function = ir.InlineAsm(ir.FunctionType(result, kinds), text, constraints,
                                side_effect=True)
        return builder.call(function, arguments)

    @intrinsic
    def fence_proxy_async(typingctx):
        def codegen(context, builder, signature, args):
            _asm(builder, "fence.proxy.async.shared::cta;", "~{memory}", [], [])

        return types.void(), codegen

    def _elements(context, builder, array_type, array, count):
        """Pointers to array[0] .. array[count - 1] (constant indices: registers after SROA,
        as long as every other index into the array is a constant too) and their LLVM type."""
        data = context.make_array(array_type)(context, builder, array).data
        kind = F32 if array_type.dtype == types.float32 else I32
        return [builder.gep(data, [ir.Constant(I64, i)]) for i in range(count)], kind

    def _check_registers(array):
        if not (isinstance(array, types.Array) and array.ndim == 1
                and array.dtype in (types.float32, types.uint32)):
            raise TypeError(f"wgmma: registers come as a 1-D local array, float32 (D) or "
                            f"uint32 (A fragments), got {array}")

    def _tied(text, counts):
        """An intrinsic f(x1, .., xn) running `text` with the first counts[i] values of each
        array xi as tied operands ("+f" or "+r"): in and out of the instruction, so that
        nothing reading or writing them crosses it."""
        def codegen(context, builder, signature, args):
            pointers, kinds = [], []
            for array_type, array, count in zip(signature.args, args, counts):
                found, kind = _elements(context, builder, array_type, array, count)
                pointers += found
                kinds += [kind] * count
            n = len(pointers)
            if n == 0:
                _asm(builder, text, "~{memory}", [], [])
                return
            letters = ["=f" if kind == F32 else "=r" for kind in kinds]
            out = _asm(builder, text, ",".join(letters + [str(i) for i in range(n)])
                       + ",~{memory}", [builder.load(p) for p in pointers], kinds,
                       ir.LiteralStructType(kinds))
            for i, p in enumerate(pointers):
                builder.store(builder.extract_value(out, i), p)

        def typed(*arrays):
            for array in arrays:
                _check_registers(array)
            return types.void(*arrays), codegen

        if len(counts) >= len(_ARITIES):
            raise ValueError(f"wgmma: at most {len(_ARITIES) - 1} arrays of registers")
        return _ARITIES[len(counts)](typed)

    # an intrinsic of 0 to 6 arrays (Numba's intrinsics take no *args)
    _ARITIES = [lambda typed: intrinsic(lambda typingctx: typed()),
                lambda typed: intrinsic(lambda typingctx, a: typed(a)),
                lambda typed: intrinsic(lambda typingctx, a, b: typed(a, b)),
                lambda typed: intrinsic(lambda typingctx, a, b, c: typed(a, b, c)),
                lambda typed: intrinsic(lambda typingctx, a, b, c, d: typed(a, b, c, d)),
                lambda typed: intrinsic(lambda typingctx, a, b, c, d, e: typed(a, b, c, d, e)),
                lambda typed: intrinsic(lambda typingctx, a, b, c, d, e, f: typed(a, b, c, d, e,
                                                                                 f))]

    @functools.cache
    def fence_for(*counts):
        """wgmma.fence with arrays of counts[i] registers each tied (accumulators, A
        fragments): their writes before it, every wgmma reading them after."""
        return _tied("wgmma.fence.sync.aligned;", counts)

    @functools.cache
    def wait_for(*counts, pending=0):
        """wgmma.wait_group `pending` (all but the newest `pending` groups done) with arrays of
        counts[i] accumulators each tied: their reads after it."""
        return _tied(f"wgmma.wait_group.sync.aligned {int(pending)};", counts)

    @intrinsic
    def wgmma_commit(typingctx):
        def codegen(context, builder, signature, args):
            _asm(builder, "wgmma.commit_group.sync.aligned;", "~{memory}", [], [])

        return types.void(), codegen

    def _address_field(context, builder, tiles_type, tiles, word_type, word):
        # the start-address field of a descriptor of tiles[word]: its shared address >> 4
        index = context.make_tuple(builder, types.UniTuple(word_type, 1), [word])
        address = shared_address(builder, _pointer(context, builder, tiles_type, tiles,
                                                   types.UniTuple(word_type, 1), index))
        start = builder.lshr(builder.and_(address, ir.Constant(I32, 0x3FFFF)), ir.Constant(I32, 4))
        return builder.zext(start, I64)

    @intrinsic
    def shared_descriptor(typingctx, tiles, word):
        """The address field of a descriptor of tiles[word] (an int64): a whole descriptor is
        this | descriptor_high(layout), and a start 16 n bytes on is this + n."""
        if not (isinstance(tiles, types.Array) and isinstance(word, types.Integer)):
            return None

        def codegen(context, builder, signature, args):
            return _address_field(context, builder, signature.args[0], args[0],
                                  signature.args[1], args[1])

        return types.int64(tiles, word), codegen

    def _wgmma(n, a_layout, b_layout, scale_d=1):
        """(emit, registers_a): emit(context, builder, acc_type, acc, inputs) issues one wgmma
        of width n on acc, inputs the A words (registers_a) or descriptor, then B's; scale_d
        1: D += A B, 0: D = A B."""
        _check_layouts(n, a_layout, b_layout)
        count = n // 2
        registers = ", ".join(f"${i}" for i in range(count))
        trans_b = int(b_layout.major == "MN")   # (0 K-major, 1 MN-major)
        registers_a = a_layout.major == REGISTERS.major
        # (scale-a, scale-b 1)
        if registers_a:
            code = (f"wgmma.mma_async.sync.aligned.m{M}n{n}k{K}.f32.bf16.bf16 {{{registers}}}, "
                    f"{{${count}, ${count + 1}, ${count + 2}, ${count + 3}}}, ${count + 4}, "
                    f"{int(scale_d)}, 1, 1, {trans_b};")
            operands, kinds = ["r"] * 4 + ["l"], [I32] * 4 + [I64]
        else:
            trans_a = int(a_layout.major == "MN")
            code = (f"wgmma.mma_async.sync.aligned.m{M}n{n}k{K}.f32.bf16.bf16 {{{registers}}}, "
                    f"${count}, ${count + 1}, {int(scale_d)}, 1, 1, {trans_a}, {trans_b};")
            operands, kinds = ["l", "l"], [I64, I64]
        # (D = A B reads no accumulators: outputs only, so that acc's old values are not kept
        # alive into it, nor moved into its registers, while another wgmma is in flight)
        tied = [str(i) for i in range(count)] if scale_d else []
        constraints = ",".join(["=f"] * count + operands + tied)

        def emit(context, builder, acc_type, acc, inputs):
            pointers, _ = _elements(context, builder, acc_type, acc, count)
            values = [builder.load(p) for p in pointers] if scale_d else []
            out = _asm(builder, code, constraints, inputs + values,
                       kinds + [F32] * len(values), ir.LiteralStructType([F32] * count))
            for i, p in enumerate(pointers):
                builder.store(builder.extract_value(out, i), p)
        return emit, registers_a

    def _casts(context, builder, values, kinds, kind):
        return [context.cast(builder, value, type_, kind) for value, type_ in zip(values, kinds)]

    @functools.cache
    def wgmma_by_descriptors(n, a_layout, b_layout, scale_d=1):
        """The intrinsic multiply(acc, tiles, a_desc, b_desc) of one wgmma of width n whose
        operands the kernel names by descriptors it made (shared_descriptor(tiles, word) |
        descriptor_high(layout), + an offset); with a_layout REGISTERS, multiply(acc, a0, a1,
        a2, a3, tiles, b_desc). `tiles` is the shared array they point into: the twin reads it,
        the tensor cores read shared memory by address. scale_d 0: D = A B, acc's values
        unread (a product's first k16 step: no instruction zeroes acc, which ptxas would count
        as a write into a wgmma's registers while another wgmma is in flight)."""
        emit, registers_a = _wgmma(n, a_layout, b_layout, scale_d)
        if registers_a:
            @intrinsic
            def multiply_rs(typingctx, acc, a0, a1, a2, a3, tiles, b_desc):
                _check_registers(acc)

                def codegen(context, builder, signature, args):
                    kinds = signature.args
                    emit(context, builder, kinds[0], args[0],
                         _casts(context, builder, args[1:5], kinds[1:5], types.uint32)
                         + _casts(context, builder, args[6:7], kinds[6:7], types.int64))

                return types.void(acc, a0, a1, a2, a3, tiles, b_desc), codegen
            return multiply_rs

        @intrinsic
        def multiply(typingctx, acc, tiles, a_desc, b_desc):
            _check_registers(acc)

            def codegen(context, builder, signature, args):
                kinds = signature.args
                emit(context, builder, kinds[0], args[0],
                     _casts(context, builder, args[2:4], kinds[2:4], types.int64))

            return types.void(acc, tiles, a_desc, b_desc), codegen
        return multiply

@functools.cache
def wgmma_m64nNk16(n, a_layout, b_layout):
    """multiply(acc, a_tiles, a_word, b_tiles, b_word): one wgmma of width n with operands in
    these layouts at the shared arrays' words, their descriptors made of the words' shared
    addresses and the layouts' bits (wgmma_by_descriptors); with a_layout REGISTERS,
    multiply(acc, a0, a1, a2, a3, b_tiles, b_word)."""
    by_descriptors = wgmma_by_descriptors(n, a_layout, b_layout)
    b_bits = descriptor_high(b_layout)
    if a_layout.major == REGISTERS.major:
        @inlined_by_numba
        def multiply_rs(acc, a0, a1, a2, a3, b_tiles, b_word):
            by_descriptors(acc, a0, a1, a2, a3, b_tiles,
                           shared_descriptor(b_tiles, b_word) | b_bits)
        return multiply_rs
    a_bits = descriptor_high(a_layout)

    @inlined_by_numba
    def multiply(acc, a_tiles, a_word, b_tiles, b_word):
        by_descriptors(acc, a_tiles, shared_descriptor(a_tiles, a_word) | a_bits,
                       shared_descriptor(b_tiles, b_word) | b_bits)
    return multiply


def wgmma_m64n128k16(a_layout, b_layout):
    """The ladder's m64n128k16: multiply(acc, a_tiles, a_word, b_tiles, b_word), D [64,128]."""
    return wgmma_m64nNk16(N, a_layout, b_layout)


wgmma_fence = fence_for(ACCUMULATORS)
wgmma_wait = wait_for(ACCUMULATORS)
wgmma_wait_but_one = wait_for(ACCUMULATORS, pending=1)    # (the newest group runs on)
