"""Hopper's warpgroup tensor-core instruction, wgmma (sm_90a), from Numba: what matmul_wgmma.py
(and the matmul ladder from v12 on) is built from, each instruction with a simulator twin
written from the PTX ISA's definitions.

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
    fence_proxy_async()                          this thread's generic-proxy writes to shared
                                                 memory (cp.async's) visible to wgmma's reads
    words = dynamic_shared_words()               the dynamic shared array, uint32
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

The operands are named by MATRIX DESCRIPTORS: 64-bit words that give the start address and
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

The accumulators go through the inline PTX as 64 outputs tied to 64 inputs (C = D's
registers, as tensorcores.mma_bf16 ties its 4). wgmma's results are not there when the
instruction issues, only after wgmma.wait_group, so the wait (and wgmma.fence, before) take
the same 64 values as tied operands: every read of acc after the wait reads the wait's
outputs, and the compiler cannot move one above it. acc is a local array whose elements
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
boundary is at word SIMULATED_START, not 0, as a GPU might.
"""
from collections import namedtuple

import numpy as np
from numba import cuda, float32, uint32

from .launch import SIMULATOR, inlined_by_numba

M, N, K = 64, 128, 16           # one wgmma's shape (m64n128k16)
ACCUMULATORS = M * N // 128     # a thread's float32s of D: 64
SWIZZLE_128B = 1                # the descriptor's code for the 128-byte swizzle
ATOM_BYTES = 1024               # 8 rows of 128 bytes: one period of the swizzle

# An operand's layout in shared memory: which axis is contiguous ("K" or "MN"), and the
# descriptor's two byte offsets (see the module's doc). The kernel's tiles must match.
Layout = namedtuple("Layout", "major leading stride")
K_MAJOR = Layout("K", leading=16, stride=ATOM_BYTES)        # (LBO unused: 16 encodes as 1)


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


def descriptor(address, layout):
    """The matrix descriptor of an operand at shared byte address `address`."""
    return ((address & 0x3FFFF) >> 4) | descriptor_high(layout)


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


if SIMULATOR:
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

    def wgmma_m64n128k16(a_layout, b_layout):
        """The twin of one wgmma with operands in these layouts: the words' shared addresses
        (word SIMULATED_START at address 0) made into descriptors, and read back."""
        @cuda.jit(device=True)  # (a device function: `cuda` in it is the simulated one)
        def multiply(acc, a_tiles, a_word, b_tiles, b_word):
            first = SIMULATED_START
            a_desc = descriptor(4 * (int(a_word) - first), a_layout)   # (Python ints: a
            b_desc = descriptor(4 * (int(b_word) - first), b_layout)   # NumPy int32 overflows)
            a = (read_operand(a_tiles, first, a_desc, "K", M, K) if a_layout.major == "K"
                 else read_operand(a_tiles, first, a_desc, "MN", K, M).T)          # [M, K]
            b = (read_operand(b_tiles, first, b_desc, "MN", K, N) if b_layout.major == "MN"
                 else read_operand(b_tiles, first, b_desc, "K", N, K).T)           # [K, N]
            thread = cuda.threadIdx.x % 128
            warp, lane = thread // 32, thread % 32
            g, t = lane // 4, lane % 4
            rows = a[[16 * warp + g, 16 * warp + g + 8]] @ b                       # [2, 128]
            for j in range(N // 8):
                for e in range(4):
                    acc[4 * j + e] = float32(acc[4 * j + e]
                                             + rows[e // 2, 8 * j + 2 * t + e % 2])
        return multiply

    def wgmma_fence(acc):
        pass

    def wgmma_commit():
        pass

    def wgmma_wait(acc):
        pass

    def wgmma_wait_but_one(acc):
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

    def _accumulators(context, builder, array_type, array):
        """Pointers to acc[0] .. acc[ACCUMULATORS - 1] (constant indices: registers after
        SROA, as long as every other index into acc is a constant too)."""
        data = context.make_array(array_type)(context, builder, array).data
        return [builder.gep(data, [ir.Constant(I64, i)]) for i in range(ACCUMULATORS)]

    def _check_acc(acc):
        if not (isinstance(acc, types.Array) and acc.dtype == types.float32 and acc.ndim == 1):
            raise TypeError(f"acc must be a 1-D float32 local array of {ACCUMULATORS}, "
                            f"got {acc}")

    def _tied(text):
        """An intrinsic f(acc) running `text` with acc's 64 values as tied operands ("+f"):
        in and out of the instruction, so that nothing reading or writing them crosses it."""
        @intrinsic
        def tied(typingctx, acc):
            _check_acc(acc)

            def codegen(context, builder, signature, args):
                pointers = _accumulators(context, builder, signature.args[0], args[0])
                values = [builder.load(p) for p in pointers]
                n = ACCUMULATORS
                out = _asm(builder, text, ",".join(["=f"] * n + [str(i) for i in range(n)])
                           + ",~{memory}", values, [F32] * n, ir.LiteralStructType([F32] * n))
                for i, p in enumerate(pointers):
                    builder.store(builder.extract_value(out, i), p)

            return types.void(acc), codegen
        return tied

    wgmma_fence = _tied("wgmma.fence.sync.aligned;")
    wgmma_wait = _tied("wgmma.wait_group.sync.aligned 0;")
    wgmma_wait_but_one = _tied("wgmma.wait_group.sync.aligned 1;")   # (the newest runs on)

    @intrinsic
    def wgmma_commit(typingctx):
        def codegen(context, builder, signature, args):
            _asm(builder, "wgmma.commit_group.sync.aligned;", "~{memory}", [], [])

        return types.void(), codegen

    def wgmma_m64n128k16(a_layout, b_layout):
        """The intrinsic multiply(acc, a_tiles, a_word, b_tiles, b_word): one wgmma, its
        descriptors built here from the words' shared addresses and the layouts' constants."""
        n = ACCUMULATORS
        registers = ", ".join(f"${i}" for i in range(n))
        trans_a, trans_b = (int(layout.major == "MN") for layout in (a_layout, b_layout))
        code = (f"wgmma.mma_async.sync.aligned.m{M}n{N}k{K}.f32.bf16.bf16 "
                f"{{{registers}}}, ${n}, ${n + 1}, 1, 1, 1, {trans_a}, {trans_b};")
        # (scale-d 1: D += A B; scale-a, scale-b 1; trans-a, trans-b: 0 K-major, 1 MN-major)
        constraints = ",".join(["=f"] * n + ["l", "l"] + [str(i) for i in range(n)])
        highs = [ir.Constant(I64, descriptor_high(layout)) for layout in (a_layout, b_layout)]

        @intrinsic
        def multiply(typingctx, acc, a_tiles, a_word, b_tiles, b_word):
            _check_acc(acc)

            def codegen(context, builder, signature, args):
                kinds = signature.args
                descriptors = []
                for (tiles, word), high in zip(((1, 2), (3, 4)), highs):
                    index = context.make_tuple(builder, types.UniTuple(kinds[word], 1),
                                               [args[word]])
                    address = shared_address(builder, _pointer(
                        context, builder, kinds[tiles], args[tiles],
                        types.UniTuple(kinds[word], 1), index))
                    start = builder.lshr(builder.and_(address, ir.Constant(I32, 0x3FFFF)),
                                         ir.Constant(I32, 4))
                    descriptors.append(builder.or_(builder.zext(start, I64), high))
                pointers = _accumulators(context, builder, kinds[0], args[0])
                values = [builder.load(p) for p in pointers]
                out = _asm(builder, code, constraints, descriptors + values,
                           [I64, I64] + [F32] * n, ir.LiteralStructType([F32] * n))
                for i, p in enumerate(pointers):
                    builder.store(builder.extract_value(out, i), p)

            return types.void(acc, a_tiles, a_word, b_tiles, b_word), codegen
        return multiply
