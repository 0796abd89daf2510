"""The GPU kernels, in three layers (each op with its NumPy twin, the same signature):

    ptx/        the instructions and their simulator twins
    runtime/    the device's facts, the launcher, memory, the compiled-kernel cache
    matmul/     the matrix products: one dispatch chooses wgmma | mma.sync | float32 | reference
    attention/  causal attention: one dispatch chooses wgmma | mma.sync | float32 | reference;
                sampling's key/value cache
    operands    bf16 and tf32 copies of the products' operands
    layernorm, gelu, embedding, dropout, crossentropy, adamw, elementwise, reduce, heads
                the other ops, forward and backward, one module each
"""
