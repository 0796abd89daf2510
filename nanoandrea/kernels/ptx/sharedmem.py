"""Dynamic shared memory: more than 48 KB a block, cut into 2-D tiles.

    buffer = dynamic_shared_floats()                 # inside a kernel: the dynamic array
    k_tile = shared_tile(buffer, 0, ROWS, D_ROW)     # k_tile[r, d], floats 0 .. ROWS*D_ROW - 1
    v_tile = shared_tile(buffer, ROWS * D_ROW, ROWS, D_ROW)
    launch(kernel, grid, block, *args, shared_bytes=4 * 2 * ROWS * D_ROW)   (runtime/launch.py)

A kernel's static shared arrays (`cuda.shared.array((R, C), float32)`) may hold at most 48 KB
a block. An H200 multiprocessor has 228 KB, and a block may take up to 227 KB of it as
dynamic shared memory once the kernel opts in (the CUDA driver's
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES): bigger attention tiles, deeper matmul
pipelines. Numba declares the dynamic array as `cuda.shared.array(0, dtype)`, one flat array
whose size the launch gives; `launch(..., shared_bytes=n)` sets the attribute when n is over
48 KB, once per compiled kernel.

`shared_tile` makes a [rows, cols] C-contiguous view of the flat array from element `offset`
on, so that a kernel's tiles keep their 2-D indexing and load4 / store4 (the offset of a tile
whose rows are 16-byte aligned must be a multiple of 4 floats). It is an intrinsic that fills
in the array's pointer, shape and strides: NumPy's way, `buffer[a:b].reshape(rows, cols)`,
compiles in Numba to a call into its runtime through local memory, after which the loads go
through generic addresses instead of shared ones.

`dynamic_shared_floats()` is the dynamic array as float32, declared 16-byte aligned (Numba's
default is the element's 4 bytes, too little for load4 / store4; the simulator takes no
alignment).

Under the simulator shared_tile is that slice and reshape (a view of the same memory).
"""
from numba import cuda, float32

from ..runtime.device import SIMULATOR
from ..runtime.launch import inlined, inlined_by_numba

if SIMULATOR:
    @cuda.jit(device=True)
    def dynamic_shared_floats():
        return cuda.shared.array(0, float32)

    def shared_tile(buffer, offset, rows, cols):
        return buffer[offset:offset + rows * cols].reshape(rows, cols)

else:
    from numba import types
    from numba.core import cgutils
    from numba.cuda.extending import intrinsic

    # (inlined by Numba: a device function compiled on its own may only return arrays
    # it was given)
    @inlined_by_numba
    def dynamic_shared_floats():
        return cuda.shared.array(0, float32, alignment=16)

    @intrinsic
    def shared_tile(typingctx, buffer, offset, rows, cols):
        if not (isinstance(buffer, types.Array) and buffer.ndim == 1 and
                all(isinstance(n, types.Integer) for n in (offset, rows, cols))):
            return None
        tile = types.Array(buffer.dtype, 2, "C")

        def codegen(context, builder, signature, args):
            first, n_rows, n_cols = (context.cast(builder, value, from_type, types.intp)
                                     for value, from_type in zip(args[1:], signature.args[1:]))
            source = context.make_array(signature.args[0])(context, builder, args[0])
            itemsize = context.get_constant(types.intp, context.get_abi_sizeof(
                context.get_data_type(buffer.dtype)))
            view = context.make_array(tile)(context, builder)
            context.populate_array(
                view, data=builder.gep(source.data, [first]),
                shape=cgutils.pack_array(builder, [n_rows, n_cols]),
                strides=cgutils.pack_array(builder, [builder.mul(n_cols, itemsize), itemsize]),
                itemsize=itemsize, meminfo=None)
            return view._getvalue()

        return tile(buffer, offset, rows, cols), codegen


def swizzle(chunks):
    """The stored place of 16-byte chunk c of row r in a shared tile of `chunks` chunks a row
    (a power of 2), such that rows r .. r+7 (r a multiple of 8) of any one chunk lie in 8
    different 16-byte columns of a 128-byte bank line: c XOR r mod 8 for rows of 8 chunks or
    more; for rows of 4 (two rows a line), c XOR (r / 2) mod 4; for 2, c XOR (r / 4) mod 2.
    Adding a multiple of 16 to r changes nothing (the fragments' offsets use that)."""
    shift = {1: 3, 2: 2, 4: 1}.get(chunks, 0)       # log2 of the rows in one 128-byte line
    mask = min(8, chunks) - 1

    @inlined
    def swizzled(r, c):
        return c ^ ((r >> shift) & mask)
    return swizzled
