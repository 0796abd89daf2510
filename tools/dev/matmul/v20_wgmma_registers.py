"""v19 with registers moved from the producer to the consumers (setmaxnreg): no spills.
H200 2026-12-03: 0.80x cuBLAS bf16 at 16384x3072x768 (0.136 ms), 0.82x at 16384x768x768,
0.86x at 16384x768x3072

    out[M,N] = a[M,K] @ b[K,N]     as v19

A block of 384 threads, one an SM, gets 65,536 / 384 = 168 registers a thread (the launch
bounds say so, and ptxas keeps to it). The consumers need more: 128 sums, the slice's
addresses, and in the epilogue the boxes' addresses, so ptxas spills the epilogue's values
to local memory (v19: 208 bytes stored and 376 loaded), and the warps wait on those loads
(Nsight Compute: 39% of v19's stalls are on the L1TEX scoreboard). The producer's one
working thread needs a few dozen. Hopper lets a warpgroup give registers back and take them
(setmaxnreg, sm_90a, every thread of the warpgroup together): the producer warpgroup drops
to 40 a thread, the consumers rise to 232, (40 + 2 x 232) x 128 = 64,512 of the 65,536. ptxas
allocates the code after each setmaxnreg within its count. Under the simulator they do
nothing. The rest is v19's.
"""
from numba import cuda

from nanoandrea.kernels.launch import launch
from nanoandrea.kernels.tma import registers_down, registers_up
from nanoandrea.kernels.wgmma import ATOM_BYTES, dynamic_shared_words
from v17_wgmma_producer import BM, BN, STAGE_WORDS, STAGES, THREADS, start_block
from v18_wgmma_tma import produce
from v19_wgmma_tma_store import (BOUNDS, EXTRA_ARGUMENTS, MULTIPLE_OF, OUT_WORDS, RESIDENT,
                                 consume_by_boxes, maps_of)

PRECISION = "bf16"
EXTRA_ARGUMENTS, MULTIPLE_OF = EXTRA_ARGUMENTS, MULTIPLE_OF     # (as v19's: run.py reads them)

@cuda.jit(**BOUNDS)
def wgmma_registers_kernel(out, a, b, maps):
    # out[M,N] = a . b; as v19's kernel, each warpgroup's registers set first
    tiles = dynamic_shared_words()
    first, barriers, tiles_m, items, slices, group, thread = start_block(tiles, out, a, 1,
                                                                         OUT_WORDS)
    if group == 0:
        registers_down()
        if thread == 0:
            produce(tiles, a, b, maps, first, barriers, tiles_m, items, slices)
    else:
        registers_up()
        consume_by_boxes(out, tiles, maps, first, barriers, tiles_m, items, slices, group,
                         thread)


def matmul(out, a, b):
    M, N = out.shape
    launch(wgmma_registers_kernel, min(RESIDENT, (M // BM) * (N // BN)), THREADS, out, a, b,
           maps_of(out, a, b),
           shared_bytes=4 * (STAGES * STAGE_WORDS + OUT_WORDS) + ATOM_BYTES + 16 * STAGES)
