"""Asynchronous copies from global to shared memory (`cp.async`, sm_80 and later): the
tensor-core matmul's (matmul/mma_sync.py) and the ladder's v7 on.

    copy16_async(dst, (i, .., j), src, (r, .., c), valid)
        dst[i, .., j:j+4] = src[r, .., c:c+4] if valid else 0      16 bytes, started, not waited for
                                                                   (float32 or uint32 arrays: four
                                                                   floats, or 8 bf16 in pairs)
    copy4_async(dst, (i, .., j), src, (r, .., c), valid)
        dst[i, .., j] = src[r, .., c] if valid else 0              4 bytes: any alignment, and
                                                                   any place in dst (a transpose)
    commit_copies()          the copies started since the last commit form one group
    wait_copies(n)()         wait until at most n groups are still in flight (n: a Python int)

A register-staged copy (load into registers, later store to shared memory) ties up its registers
until the store, and its load must be issued early by hand to hide the latency. `cp.async` goes
straight from global to shared memory: the thread keeps computing, several slices can be in
flight at once (a pipeline of stages), and no registers are spent on them. The data is in shared
memory for the whole block only after the issuing threads have waited for their groups AND the
block has passed a barrier.

Numba has no API for it, so these are Numba intrinsics whose code is inline PTX (llvmlite
InlineAsm):
    cp.async.cg.shared.global [dst], [src], 16, src_size;    (src_size 0: 16 zero bytes written)
    cp.async.ca.shared.global [dst], [src], 4, src_size;     (4 bytes, through the L1 cache)
The array pointers Numba holds are generic addresses: the shared one becomes a 32-bit shared
address by an LLVM address-space cast (vector.shared_address), the global one by
`cvta.to.global`. For the 16-byte copy the caller guarantees
16-byte alignment of both addresses; for either, even when valid is False, that src's index is
inside the array (nothing is read then; the address stays legal).

Under the CUDA simulator there is no PTX: the copy happens at once (a legal schedule of an
asynchronous copy), and committing and waiting do nothing.
"""
from ..runtime.device import SIMULATOR

if SIMULATOR:
    def copy16_async(dst, dst_index, src, src_index, valid):
        *outer, j = dst_index
        *rows, c = src_index
        for e in range(4):
            dst[tuple(outer) + (j + e,)] = src[tuple(rows) + (c + e,)] if valid else 0

    def copy4_async(dst, dst_index, src, src_index, valid):
        dst[dst_index] = src[src_index] if valid else 0

    def commit_copies():
        pass

    def wait_copies(n):
        def wait():
            pass
        return wait

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    from .vector import item_pointer as _pointer
    from .vector import shared_address

    I32, I64 = ir.IntType(32), ir.IntType(64)
    COPY = """{{
    .reg .u64 global_address;
    cvta.to.global.u64 global_address, $1;
    cp.async.{cache}.shared.global [$0], [global_address], {size}, $2;
}}"""

    def _check(array, index):
        if not (isinstance(array, types.Array) and array.dtype in (types.float32, types.uint32)):
            raise TypeError(f"copy16_async, copy4_async need float32 or uint32 arrays, got "
                            f"{array}")
        if not (isinstance(index, types.BaseTuple) and len(index) == array.ndim):
            raise TypeError(f"copy16_async, copy4_async need a tuple of {array.ndim} indices, "
                            f"got {index}")

    def _asm(builder, text, constraints, arguments, kinds):
        """Inline PTX with side effects (kept where it stands), returning nothing."""
        function = ir.InlineAsm(ir.FunctionType(ir.VoidType(), kinds), text, constraints,
                                side_effect=True)
        builder.call(function, arguments)

    def _copy_async(size, cache):
        """The intrinsic copy<size>_async: one cp.async of `size` bytes (src_size 0 when not
        valid: zeros written, nothing read)."""
        code = COPY.format(cache=cache, size=size)

        @intrinsic
        def copy_async(typingctx, dst, dst_index, src, src_index, valid):
            _check(dst, dst_index)
            _check(src, src_index)

            def codegen(context, builder, signature, args):
                kinds = signature.args
                dst_address = shared_address(builder, _pointer(context, builder, kinds[0],
                                                               args[0], kinds[1], args[1]))
                src_address = builder.ptrtoint(_pointer(context, builder, kinds[2], args[2],
                                                        kinds[3], args[3]), I64)
                is_valid = context.cast(builder, args[4], kinds[4], types.boolean)
                source_size = builder.select(is_valid, ir.Constant(I32, size),
                                             ir.Constant(I32, 0))
                _asm(builder, code, "r,l,r,~{memory}", [dst_address, src_address, source_size],
                     [I32, I64, I32])

            return types.void(dst, dst_index, src, src_index, valid), codegen
        return copy_async

    copy16_async = _copy_async(16, "cg")    # (.cg, past L1: each 16 bytes are read once)
    copy4_async = _copy_async(4, "ca")      # (.cg takes 16 bytes only; a warp's 4-byte copies
                                            # of a row's 32 floats meet in L1)

    @intrinsic
    def commit_copies(typingctx):
        def codegen(context, builder, signature, args):
            _asm(builder, "cp.async.commit_group;", "~{memory}", [], [])

        return types.void(), codegen

    _waits = {}

    def wait_copies(n):
        """The intrinsic that waits until at most n groups of this thread's copies are in
        flight (n is part of the instruction, so one intrinsic per n)."""
        if n not in _waits:
            @intrinsic
            def wait(typingctx):
                def codegen(context, builder, signature, args):
                    _asm(builder, f"cp.async.wait_group {int(n)};", "~{memory}", [], [])

                return types.void(), codegen
            _waits[n] = wait
        return _waits[n]
