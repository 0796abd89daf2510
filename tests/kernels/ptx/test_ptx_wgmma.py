"""One wgmma (kernels/ptx/wgmma.py: matmul/wgmma.py's, attention/wgmma.py's, and the ladder's
from v12 on) on its own: D [64,128] = A [64,16] B [16,128], the operands put in shared memory by the host in the
128-byte-swizzled layouts, built here from the layouts' plain description (rows of 128
bytes, chunk c of row r stored at chunk c ^ (r % 8)), not from the module's address arithmetic; each operand K-major
or MN-major (the forward's A K-major and B n-major, dX's B K-major, dW's A m-major). In the
simulator it checks the twin; on an sm_90 GPU it checks the instruction, the descriptors,
the transposes and D's fragment layout against the same NumPy product, apart from any
kernel's pipeline (where a wrong layout would only show as a wrong matmul). The attention's
form, D [64,64] = A [64,16] B [16,64] with A from the threads' registers (each thread's four
words taken from A by the fragment table, here), is checked the same way. A word, in shared
memory or a register, is 32 bits: here a bf16 pair.
"""
import numpy as np
import pytest
from numba import cuda, float32

from nanoandrea.kernels.ptx.mma import bf16_bits, bf16_pair, bf16_values
from nanoandrea.kernels.ptx.wgmma import (ACCUMULATORS, ATOM_BYTES, K_MAJOR, MN_MAJOR,
                                          REGISTERS, atom_start, dynamic_shared_words,
                                          fence_for, fence_proxy_async, wait_for, wgmma_commit,
                                          wgmma_fence, wgmma_m64n128k16, wgmma_m64nNk16,
                                          wgmma_wait)
from nanoandrea.kernels.runtime.device import SIMULATOR

ROW_WORDS = 32                            # a swizzled row: 128 bytes
BLOCK_WORDS = 64 * ROW_WORDS              # 64 rows of it: one block of 64 columns, MN-major
A_WORDS = 64 * ROW_WORDS                  # A's tile, either way: 64 x 64, 8 KB
multiplies = {(a_major, b_major): wgmma_m64n128k16(K_MAJOR if a_major == "K" else
                                                   MN_MAJOR(4 * BLOCK_WORDS),
                                                   K_MAJOR if b_major == "K" else
                                                   MN_MAJOR(4 * BLOCK_WORDS))
              for a_major in ("K", "MN") for b_major in ("K", "MN")}

if not SIMULATOR and cuda.is_available() and \
        cuda.get_current_device().compute_capability < (9, 0):
    pytest.skip("wgmma needs sm_90", allow_module_level=True)


def swizzled_rows(x):
    """x [rows, 64] as bf16 in 128-byte rows, chunk c (8 values) of row r at c ^ (r % 8):
    uint32 words [rows * 32]."""
    chunks = bf16_bits(x).reshape(len(x), 8, 8)
    stored = np.empty_like(chunks)
    for r in range(len(x)):
        for c in range(8):
            stored[r, c ^ (r % 8)] = chunks[r, c]
    return stored.reshape(-1).view(np.uint32)


def one_wgmma_kernel(multiply):
    @cuda.jit
    def one_wgmma(out, words, a_word, b_word):
        # out[64, 128] = the wgmma of the operands at words[a_word], words[b_word]; 128 threads
        tiles = dynamic_shared_words()
        first = atom_start(tiles)                   # (words go from a 1024-byte boundary on)
        acc = cuda.local.array(ACCUMULATORS, float32)
        tid = cuda.threadIdx.x
        for i in range(tid, words.shape[0], 128):
            tiles[first + i] = words[i]
        for e in range(ACCUMULATORS):
            acc[e] = float32(0.0)
        fence_proxy_async()                 # (generic-proxy stores, read by the async proxy)
        cuda.syncthreads()
        wgmma_fence(acc)
        multiply(acc, tiles, first + a_word, tiles, first + b_word)
        wgmma_commit()
        wgmma_wait(acc)
        warp, lane = tid // 32, tid % 32
        row, col = 16 * warp + lane // 4, 2 * (lane % 4)
        for j in range(16):
            out[row, col + 8 * j], out[row, col + 8 * j + 1] = acc[4 * j], acc[4 * j + 1]
            out[row + 8, col + 8 * j], out[row + 8, col + 8 * j + 1] = (acc[4 * j + 2],
                                                                        acc[4 * j + 3])
    return one_wgmma


@pytest.mark.parametrize("a_major,b_major", [("K", "MN"), ("K", "K"), ("MN", "MN"), ("MN", "K")])
@pytest.mark.parametrize("a_step,b_step", [(0, 0), (1, 2), (3, 3)])
def test_one_wgmma(rng, a_major, b_major, a_step, b_step):
    """A is k 16 a_step .. of a 64 x 64 tile (K-major: 64 rows of m, its start 32 a_step bytes
    into each; MN-major: 64 rows of k, its start 16 a_step rows on), B k 16 b_step .. of a 64 x
    128 tile (MN-major: 64 rows of k in two blocks of 64 columns; K-major: 128 rows of n)."""
    a_full = rng.standard_normal((64, 64), dtype=np.float32)           # [m, k]
    b_full = rng.standard_normal((64, 128), dtype=np.float32)          # [k, n]
    if a_major == "K":
        a_words, a_word = swizzled_rows(a_full), 8 * a_step
    else:
        a_words, a_word = swizzled_rows(a_full.T), 16 * a_step * ROW_WORDS
    if b_major == "MN":
        b_words = np.concatenate([swizzled_rows(b_full[:, :64]), swizzled_rows(b_full[:, 64:])])
        b_word = A_WORDS + 16 * b_step * ROW_WORDS
    else:
        b_words, b_word = swizzled_rows(b_full.T), A_WORDS + 8 * b_step
    words = np.concatenate([a_words, b_words])
    out = cuda.to_device(np.full((64, 128), np.nan, np.float32))
    kernel = one_wgmma_kernel(multiplies[a_major, b_major])
    kernel[1, 128, 0, 4 * len(words) + ATOM_BYTES](out, cuda.to_device(words), a_word, b_word)
    a = bf16_values(a_full[:, 16 * a_step:16 * a_step + 16]).astype(np.float64)
    b = bf16_values(b_full[16 * b_step:16 * b_step + 16]).astype(np.float64)
    np.testing.assert_allclose(out.copy_to_host(), a @ b, rtol=1e-5, atol=1e-5)


N64 = 32                                  # a thread's floats of D [64,64]
registers_multiplies = {b_major: wgmma_m64nNk16(64, REGISTERS, K_MAJOR if b_major == "K"
                                                else MN_MAJOR(BLOCK_WORDS))
                        for b_major in ("K", "MN")}
fence_with_a, wait_n64 = fence_for(N64, 4), wait_for(N64)


def registers_wgmma_kernel(multiply):
    @cuda.jit
    def registers_wgmma(out, a, words, b_word):
        # out[64, 64] = a [64, 16] (each thread's fragment words from it) . the B at b_word
        tiles = dynamic_shared_words()
        first = atom_start(tiles)
        acc = cuda.local.array(N64, float32)
        frag = cuda.local.array(4, np.uint32)
        tid = cuda.threadIdx.x
        for i in range(tid, words.shape[0], 128):
            tiles[first + i] = words[i]
        warp, lane = tid // 32, tid % 32
        row, col = 16 * warp + lane // 4, 2 * (lane % 4)
        for r in range(4):                  # a0 .. a3: rows g, g + 8, then columns 8 on
            i, j = row + 8 * (r % 2), col + 8 * (r // 2)
            frag[r] = bf16_pair(a[i, j], a[i, j + 1])
        for e in range(N64):
            acc[e] = float32(0.0)
        fence_proxy_async()
        cuda.syncthreads()
        fence_with_a(acc, frag)
        multiply(acc, frag[0], frag[1], frag[2], frag[3], tiles, first + b_word)
        wgmma_commit()
        wait_n64(acc)
        for j in range(8):
            out[row, col + 8 * j], out[row, col + 8 * j + 1] = acc[4 * j], acc[4 * j + 1]
            out[row + 8, col + 8 * j], out[row + 8, col + 8 * j + 1] = (acc[4 * j + 2],
                                                                        acc[4 * j + 3])
    return registers_wgmma


@pytest.mark.parametrize("b_major", ["MN", "K"])
@pytest.mark.parametrize("b_step", [0, 3])
def test_one_wgmma_a_in_registers(rng, b_major, b_step):
    """A [64,16] from the threads' registers; B k 16 b_step .. of a 64 x 64 tile: MN-major, 64
    rows of k (attention's P V, V's rows as they lie), or K-major, 64 rows of n (S = Q K^T's
    K tile)."""
    a = rng.standard_normal((64, 16), dtype=np.float32)               # [m, k]
    b_full = rng.standard_normal((64, 64), dtype=np.float32)          # [k, n]
    if b_major == "MN":
        words, b_word = swizzled_rows(b_full), 16 * b_step * ROW_WORDS
    else:
        words, b_word = swizzled_rows(b_full.T), 8 * b_step
    out = cuda.to_device(np.full((64, 64), np.nan, np.float32))
    kernel = registers_wgmma_kernel(registers_multiplies[b_major])
    kernel[1, 128, 0, 4 * len(words) + ATOM_BYTES](out, cuda.to_device(a), cuda.to_device(words),
                                                   b_word)
    want = bf16_values(a).astype(np.float64) @ bf16_values(
        b_full[16 * b_step:16 * b_step + 16]).astype(np.float64)
    np.testing.assert_allclose(out.copy_to_host(), want, rtol=1e-5, atol=1e-5)
