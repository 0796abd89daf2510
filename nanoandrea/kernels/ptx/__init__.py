"""The PTX layer: one module per instruction family, each instruction beside its simulator twin.

    vector      16- and 8-byte loads and stores (ld.global.v4, st.global.v4, ...)
    sfu         the special-function unit: ex2.approx, rcp.approx
    warp        shuffles and the warp's barrier (shfl.sync, bar.warp.sync)
    mma         mma.sync (bf16, tf32), ldmatrix, bf16 pairs and tf32 rounding
    asynccopy   cp.async: device to shared memory without registers
    sharedmem   dynamic shared memory cut into tiles, and the XOR swizzle of their rows
    wgmma       Hopper's warpgroup MMA: matrix descriptors, fences, waits
    tma         Hopper's bulk tensor copies (TMA), mbarriers, tensor maps, setmaxnreg

Each is written from the PTX ISA's tables; a twin computes the same thing with NumPy so that
the kernels built on them run, and are tested, in Numba's CUDA simulator. Nothing here knows
about matrix products or attention: the op families (matmul/, attention/, ...) do.
"""
