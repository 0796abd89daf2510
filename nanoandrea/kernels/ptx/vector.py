"""16-byte loads and stores of four float32s, `load4` and `store4`, and 8-byte ones of two,
`load2` and `store2`, for use inside kernels.

    x0, x1, x2, x3 = load4(array, (i, j))      array[i, j], array[i, j+1], array[i, j+2], array[i, j+3]
    store4(array, (i, j), x0, x1, x2, x3)
    x0, x1 = load2(array, (i, j))              array[i, j], array[i, j+1]
    store2(array, (i, j), x0, x1)

One 16-byte instruction (ld.global.v4.f32, ld.shared.v4.f32, st.shared.v4.f32, ...) instead of
four 4-byte ones: a quarter of the load/store instructions, which is what a register-blocked
matmul is short of. Numba has no float4 type, so these are Numba intrinsics that emit LLVM IR
directly: a pointer to the first element, bitcast to <4 x float>*, one aligned load or store.
NVVM then picks the address space (global or shared) from where the array lives.

The caller guarantees what the hardware needs: the last index is the contiguous axis, the four
elements are in bounds, and the first one's address is a multiple of 16 bytes (row lengths a
multiple of 4 and 16-byte aligned base pointers; `aligned16` checks a device array), or of 8
bytes for load2 and store2 (an even column of such an array).

Under the CUDA simulator (NUMBA_ENABLE_CUDASIM=1) there is no LLVM: the same names are plain
Python functions that index the array four times, so kernels using them run there unchanged.

`flat(x)`, for a C-contiguous x, is x's elements in one row (a view of the same memory): a
kernel that walks x with one index adds a constant to it where x[row, col] would multiply.
`flat_span(x)` is the same for a permuted view of a dense array whose first element is the
array's (a heads view [B,H,T,D] of [B,T,C] rows): the memory's words in their own order, so
the kernel computes its offsets from the strides it is given.
"""
import numpy as np

from ..runtime.device import SIMULATOR


def aligned16(array):
    """True when every row (last axis) of a device array starts at a multiple of 16 bytes and
    holds a multiple of 4 contiguous float32s: its first element is 16-byte aligned, its last
    axis has stride 4 bytes and the others strides of whole 16 bytes (a view with rows of 4k
    floats cut from wider rows of 4k + 1 would not be). Then every load4 at a column j % 4 == 0
    is legal."""
    last = len(array.shape) - 1
    if SIMULATOR:                   # (the same test of the simulator's NumPy array, so that
        address = array._ary.ctypes.data                 # an argument the GPU's would refuse
    else:                                                # fails in the simulator too)
        address = array.device_ctypes_pointer.value or 0     # (not __cuda_array_interface__,
                                                             # which builds a dict each call)
    strides = array.strides
    return (address % 16 == 0 and array.shape[last] % 4 == 0
            and (array.shape[last] <= 1 or strides[last] == 4)
            and all(stride % 16 == 0 for stride in strides[:last]))


if SIMULATOR:
    def flat(x):
        return x.reshape(x.size)

    def flat_span(x):
        array = getattr(x, "_ary", x)
        return np.lib.stride_tricks.as_strided(array, shape=(array.size,),
                                               strides=(array.itemsize,))

    def load4(array, index):
        *outer, j = index
        outer = tuple(outer)
        return (array[outer + (j,)], array[outer + (j + 1,)], array[outer + (j + 2,)],
                array[outer + (j + 3,)])

    def store4(array, index, x0, x1, x2, x3):
        *outer, j = index
        outer = tuple(outer)
        array[outer + (j,)] = x0
        array[outer + (j + 1,)] = x1
        array[outer + (j + 2,)] = x2
        array[outer + (j + 3,)] = x3

    def load2(array, index):
        *outer, j = index
        outer = tuple(outer)
        return array[outer + (j,)], array[outer + (j + 1,)]

    def store2(array, index, x0, x1):
        *outer, j = index
        outer = tuple(outer)
        array[outer + (j,)] = x0
        array[outer + (j + 1,)] = x1

else:
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.cuda.extending import intrinsic

    F32 = ir.FloatType()

    def item_pointer(context, builder, array_type, array, index_type, index):
        """LLVM pointer to array[index] (index: a tuple of integers), without Numba's
        negative-index wraparound (the indices are the caller's, non-negative). For the
        intrinsics here and in ptx/mma.py."""
        array = context.make_array(array_type)(context, builder, array)
        indices = [context.cast(builder, value, kind, types.intp) for value, kind in
                   zip(cgutils.unpack_tuple(builder, index, len(index_type)), index_type)]
        return cgutils.get_item_pointer(context, builder, array_type, array, indices,
                                        wraparound=False)

    def shared_address(builder, pointer):
        """The 32-bit shared-memory address of a generic pointer into a shared array (what
        ldmatrix and cp.async take): an LLVM address-space cast, which folds into the shared
        array's own address, so that the offsets stay 32-bit sums (not the 64-bit generic
        arithmetic and the cvta.to.shared a conversion in PTX would cost)."""
        shared = builder.addrspacecast(pointer, ir.PointerType(pointer.type.pointee, 3))
        return builder.ptrtoint(shared, ir.IntType(32))

    def _row_of(x):
        # (signature, codegen) of a 1-D view of x's nitems from its first element on
        row = types.Array(x.dtype, 1, "C")

        def codegen(context, builder, signature, args):
            source = context.make_array(signature.args[0])(context, builder, args[0])
            view = context.make_array(row)(context, builder)
            context.populate_array(view, data=source.data,
                                   shape=cgutils.pack_array(builder, [source.nitems]),
                                   strides=cgutils.pack_array(builder, [source.itemsize]),
                                   itemsize=source.itemsize, meminfo=None)
            return view._getvalue()

        return row(x), codegen

    @intrinsic
    def flat(typingctx, x):
        # (Numba's x.reshape(n) calls a helper of its CPU runtime, which kernels lack)
        return _row_of(x) if isinstance(x, types.Array) and x.layout == "C" else None

    @intrinsic
    def flat_span(typingctx, x):
        # flat's view of any layout: the caller knows that x's elements fill the memory from
        # its first on (its launcher checks the strides)
        return _row_of(x) if isinstance(x, types.Array) else None

    def _element_pointer(context, builder, array_type, array, index_type, index, width):
        """LLVM <width x float>* to array[index]."""
        return builder.bitcast(item_pointer(context, builder, array_type, array, index_type,
                                            index), ir.PointerType(ir.VectorType(F32, width)))

    def _check(array, index):
        if not (isinstance(array, types.Array) and array.dtype == types.float32):
            raise TypeError(f"vector loads and stores need a float32 array, got {array}")
        if not (isinstance(index, types.BaseTuple) and len(index) == array.ndim):
            raise TypeError(f"vector loads and stores need a tuple of {array.ndim} indices, "
                            f"got {index}")

    def _vector_load(width):
        """The intrinsic load<width>(array, index): one aligned load of `width` float32s."""
        result = types.UniTuple(types.float32, width)

        @intrinsic
        def load(typingctx, array, index):
            _check(array, index)

            def codegen(context, builder, signature, args):
                pointer = _element_pointer(context, builder, signature.args[0], args[0],
                                           signature.args[1], args[1], width)
                vector = builder.load(pointer, align=4 * width)
                values = [builder.extract_element(vector, ir.Constant(ir.IntType(32), i))
                          for i in range(width)]
                return context.make_tuple(builder, result, values)

            return result(array, index), codegen
        return load

    def _store(context, builder, signature, args, width):
        pointer = _element_pointer(context, builder, signature.args[0], args[0],
                                   signature.args[1], args[1], width)
        values = [context.cast(builder, value, kind, types.float32)
                  for value, kind in zip(args[2:], signature.args[2:])]
        vector = ir.Constant(ir.VectorType(F32, width), ir.Undefined)
        for i, value in enumerate(values):
            vector = builder.insert_element(vector, value, ir.Constant(ir.IntType(32), i))
        builder.store(vector, pointer, align=4 * width)

    load4, load2 = _vector_load(4), _vector_load(2)

    @intrinsic
    def store4(typingctx, array, index, x0, x1, x2, x3):
        _check(array, index)

        def codegen(context, builder, signature, args):
            _store(context, builder, signature, args, 4)

        return types.void(array, index, x0, x1, x2, x3), codegen

    @intrinsic
    def store2(typingctx, array, index, x0, x1):
        _check(array, index)

        def codegen(context, builder, signature, args):
            _store(context, builder, signature, args, 2)

        return types.void(array, index, x0, x1), codegen
