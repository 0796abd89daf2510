"""The package's forward: flash tiles as a register-blocked SGEMM.
H100 2026-12-07: fwd 1.01x SDPA float32 at [16,12,1024,64]

This version calls the package's kernel (attention_forward, kernel="float32"): it is the forward
the product runs, and a copy here would only duplicate it. What it changes over v2:
  - A block takes a tile of ROWS query rows and stages it in shared memory beside each tile of
    COLS keys and values. S = Q K^T for the pair is a small matrix product in which each thread
    owns a 4x4 patch of S in registers: per 4 values of d, 4 + 4 sixteen-byte shared loads
    (ld.shared.v4) feed 64 FFMA, where v2's thread did one FFMA per shared load.
  - The online softmax runs on the patches: a row's max and sum meet through shared memory
    among the few threads of that row, which are lanes of one warp (a warp barrier, not the
    block's), and rescale that row's outputs where they sit.
  - P goes to shared memory (transposed, 16-byte stores) and O += P V is a second product,
    each thread owning a 4 x TD patch of O (the SGEMM's outer product, TD = D / threads a row).
  - Shared tiles' rows are padded so that 16-byte accesses of 8 threads hit 8 bank groups;
    exp is ex2 of x log2(e); the heaviest row tiles (the most keys) launch first.
No thread holds a whole row any more, so nothing spills at D=64, and each shared load feeds
as many FFMA as in the SGEMM. D is a compile-time constant of the tiles: 32 or 64.
"""
from nanoandrea.kernels.attention import attention_forward

HEAD_SIZES = (32, 64)


def forward(out, lse, q, k, v):
    attention_forward(out, lse, q, k, v, kernel="float32")


backward = None     # the backward ladder: v4 to v6
