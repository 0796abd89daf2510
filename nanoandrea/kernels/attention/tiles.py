"""The pieces both fast attention kernels (kernels/attention/float32.py) are built from: flash-attention
tiles computed like a register-blocked SGEMM.

A block owns a tile of rows (queries in the forward, keys in dk/dv) and streams tiles of columns
(keys, or queries) through shared memory. Each of its threads owns a small patch of the scores
S (or S^T) in registers and the matching rows of the output O; both products are SGEMMs in
miniature, their operands read from shared memory 16 bytes at a time:
    scores_product   S += X Y^T      (the sum over the head dimension d)
    exchange         a thread's patch of P (or dS) into shared memory, transposed
    output_product   O += E^T Y      (the sum over the streamed columns)
`stage` copies rows of a head into a shared tile; `Tile` names a tile's shape; `block_rows` says
which rows a block takes (the longest causal rows first). `dout_chunk` is the tensor-core
backward's: 8 values of dout rounded to bf16 and their share of delta; `pairs_storer` its
store of a gradient in bf16.
"""
import math
from typing import NamedTuple

from numba import cuda, float32, uint64

from ..ptx.mma import bf16_pair
from ..ptx.vector import load4, store4
from ..ptx.warp import WARP
from ..runtime.device import SIMULATOR
from ..runtime.launch import inlined

LOG2E = float32(1.0 / math.log(2.0))
NEG_INF = float32(-math.inf)


class Tile(NamedTuple):
    """A fast kernel's tile: a block owns `rows` rows (queries; keys in dk/dv) and streams
    tiles of `cols` columns (keys; queries in dk/dv) through shared memory; each of its
    (rows/thread_rows) x (cols/thread_cols) threads owns thread_rows x thread_cols scores."""
    rows: int
    cols: int
    thread_rows: int = 4
    thread_cols: int = 4
    blocks_per_sm: int = 0      # launch bounds: that many blocks a multiprocessor; 0 no cap
    score_steps: int = 2        # steps of 4 d per trip of the scores products' loop
    wide_staging: bool = True   # stage q, k, v (and dout) 16 bytes at a time, else 4


@inlined
def fast_exp(x):
    # e^x as 2^(x log2 e): a multiply and the hardware's ex2 (math.exp2), where math.exp costs
    # about ten instructions of range reduction. A few float32 ulps off where it matters (x near
    # 0, the weights a softmax row is made of); x = -inf gives 0
    return math.exp2(x * LOG2E)


def column_stager(COLS):
    """stage_columns(neg_lse_tiles, delta_tiles, at, lse, delta, b, h, n0, T, tid): a dk/dv
    kernel's query tile of COLS queries from n0 on, their -lse (log2 units; past T, -inf: P = 0)
    and delta, into shared slots from `at` on (the tensor-core kernels, attention/mma_sync.py and
    attention/wgmma.py, read a tile's P^T and dS^T by these columns)."""
    load_columns, store_columns = column_loader(COLS)

    @inlined
    def stage_columns(neg_lse_tiles, delta_tiles, at, lse, delta, b, h, n0, T, tid):
        store_columns(neg_lse_tiles, delta_tiles, at,
                      load_columns(lse, delta, b, h, n0, T, tid), tid)
    return stage_columns


def column_loader(COLS):
    """(load_columns, store_columns): column_stager's stage_columns in its two halves, so that a
    kernel issues a tile's loads, does other work while they travel, and only then stores them:
    load_columns(lse, delta, b, h, n0, T, tid) gives this thread's (lse, delta) of the tile
    from n0 (-inf's and 0 past T), store_columns(neg_lse_tiles, delta_tiles, at, columns, tid)
    puts them in the shared slots (-lse in log2 units). Stored at once, a thread waits there
    for its loads: in dk/dv's profile the largest stall after the tensor cores'."""
    @inlined
    def load_columns(lse, delta, b, h, n0, T, tid):
        inside = tid < COLS and n0 + tid < T
        return (lse[b, h, n0 + tid] if inside else -NEG_INF,
                delta[b, h, n0 + tid] if inside else float32(0.0))

    @inlined
    def store_columns(neg_lse_tiles, delta_tiles, at, columns, tid):
        if tid < COLS:
            neg_lse_tiles[at + tid] = -columns[0] * LOG2E     # (+inf's -lse: -inf, P = 0)
            delta_tiles[at + tid] = columns[1]
    return load_columns, store_columns


@inlined
def block_rows(H, T, rows_per_block, heavy_first):
    # this block's (batch, head) and its rows [row_start, row_end): grid (B*H, T/rows_per_block).
    # heavy_first: block y takes the y-th range from the end, so the longest causal rows (the
    # most key tiles) start first and the short ones fill the gaps at the end of the launch
    y = cuda.gridDim.y - 1 - cuda.blockIdx.y if heavy_first else cuda.blockIdx.y
    row_start = y * rows_per_block
    return cuda.blockIdx.x // H, cuda.blockIdx.x % H, row_start, min(T, row_start + rows_per_block)


def make_stage(D, THREADS, VECTOR):
    """(stage, R_STEP): the device function that copies rows of one head's [T, D] into a shared
    tile, for a block of THREADS threads, which copies R_STEP rows a pass (tiles hold a multiple
    of R_STEP rows), 16 bytes a load where VECTOR, else 4."""
    CHUNKS = D // 4                     # 4-float chunks in a row of D; a pass of the block
    C_STEP = min(CHUNKS, THREADS)       # copies R_STEP rows, C_STEP chunks of each row per
    R_STEP = THREADS // C_STEP          # thread step
    assert CHUNKS % C_STEP == 0, (D, THREADS)

    @inlined
    def stage(tile, x, row0, n_rows, T, scale):
        # tile[r, d] = x[row0 + r, d] * scale for r < n_rows (x: one head's [T, D]), zeros past T,
        # in 4-float chunks, one 16-byte store each. Consecutive threads take consecutive chunks
        # of a row (a warp reads 512 consecutive bytes): thread t copies chunks t % C_STEP +
        # s*C_STEP of rows t // C_STEP + n*R_STEP. Indices are uint64: for a signed index Numba
        # adds a negative-index wraparound (a compare and a select) the compiler cannot drop.
        d_first = uint64(cuda.threadIdx.x % C_STEP * 4)
        r_first = uint64(cuda.threadIdx.x // C_STEP)
        for n in range(n_rows // R_STEP):
            r = r_first + uint64(n * R_STEP)
            row = uint64(row0) + r
            inside = row < uint64(T)
            for step in range(CHUNKS // C_STEP):
                d = d_first + uint64(step * C_STEP * 4)
                if inside and VECTOR:
                    x4 = load4(x, (row, d))
                    store4(tile, (r, d), x4[0] * scale, x4[1] * scale, x4[2] * scale,
                           x4[3] * scale)
                elif inside:
                    store4(tile, (r, d), x[row, d] * scale, x[row, d + uint64(1)] * scale,
                           x[row, d + uint64(2)] * scale, x[row, d + uint64(3)] * scale)
                else:
                    zero = float32(0.0)
                    store4(tile, (r, d), zero, zero, zero, zero)

    return stage, R_STEP


def tile_functions(D, ROWS, COLS, TM, TN, SCORE_STEPS=2, VECTOR=True):
    """The device functions a tiled kernel is built from, for one tile shape (Tile's fields).

    Thread (ty, tx) of the THREADS_M x THREADS_N grid owns, in registers,
        the TM x TN scores   rows row_of(ty, i), columns tx + j*THREADS_N
        the TM x TD outputs  the same rows, head dimensions dim_of(tx, j)   (TD = D/THREADS_N)
    where row_of and dim_of make runs of 4 consecutive indices, as in the blocked SGEMM, so that
    a thread reads 4 of its rows (or head dimensions) with one 16-byte load. A row's scores and
    its outputs live in the same THREADS_N threads, consecutive lanes of one warp: the softmax
    statistics of a row rescale that row's outputs without moving them, and what they exchange
    about their own rows needs only that warp's barrier (warp_barrier).
      scores_product  S += X Y^T, the sum over d: per 4 d, TM + TN 16-byte loads feed 4 TM TN
                      multiply-adds. The score columns are strided (tx + j*THREADS_N) so that
                      the 8 threads of a 16-byte access phase read 8 rows of Y: 8 bank groups.
      exchange        the thread's TM x TN values (P, dS) into a shared tile e[c, r],
                      transposed, 4 rows r per 16-byte store.
      output_product  O += E^T Y, the sum over the COLS columns: per c, TM/4 + TD/4 16-byte
                      loads feed TM TD multiply-adds, the SGEMM's outer product.
    Every tile's row length is padded(n): 16-byte aligned rows, no bank conflicts."""
    THREADS_M = ROWS // TM
    THREADS_N = COLS // TN
    TD = D // THREADS_N
    THREADS = THREADS_M * THREADS_N
    assert ROWS % TM == 0 and COLS % TN == 0 and D % THREADS_N == 0, (D, ROWS, COLS, TM, TN)
    assert TM % 4 == 0 and TD % 4 == 0, ("runs of 4 rows and head dimensions", D, TM, TD)
    stage, R_STEP = make_stage(D, THREADS, VECTOR)
    assert ROWS % R_STEP == 0 and COLS % R_STEP == 0, (D, ROWS, COLS)
    assert SCORE_STEPS in (1, 2) and D % (4 * SCORE_STEPS) == 0 and COLS % 4 == 0, \
        ("steps per loop trip", D, COLS, SCORE_STEPS)
    assert WARP % THREADS_N == 0, ("a row's threads in one warp", COLS, TN)

    @inlined
    def thread_position():
        # (ty, tx) of this thread on the THREADS_M x THREADS_N grid
        return cuda.threadIdx.x // THREADS_N, cuda.threadIdx.x % THREADS_N

    @inlined
    def row_of(ty, i):
        # the tile row of this thread's i-th row (of TM): runs of 4, 4*THREADS_M rows apart
        return (i // 4) * (4 * THREADS_M) + ty * 4 + i % 4

    @inlined
    def dim_of(tx, j):
        # the head dimension of this thread's j-th output column (of TD): runs of 4, 4*THREADS_N
        # dimensions apart
        return (j // 4) * (4 * THREADS_N) + tx * 4 + j % 4

    @inlined
    def scores_step(acc, x, y, y_frag, d, ty, tx):
        # acc[TM, TN] += sum_{d <= e < d+4} x[row_of(ty, i), e] y[tx + j*THREADS_N, e] (y's 4 x TN
        # values held while x's rows stream through)
        for j in range(TN):
            y4 = load4(y, (tx + j * THREADS_N, d))
            for u in range(4):
                y_frag[j, u] = y4[u]
        for i in range(TM):
            x4 = load4(x, (row_of(ty, i), d))
            for u in range(4):
                for j in range(TN):
                    acc[i, j] += x4[u] * y_frag[j, u]

    @inlined
    def scores_product(acc, x, y):
        # acc[TM, TN] += sum_d x[row_of(ty, i), d] y[tx + j*THREADS_N, d] over d < D, in
        # SCORE_STEPS steps per loop trip (unrolled by hand: the compiler does not unroll a loop
        # this large, and a trip's counting costs ~13 instructions)
        ty, tx = thread_position()
        y_frag = cuda.local.array((TN, 4), float32)
        for d in range(0, D, 4 * SCORE_STEPS):
            scores_step(acc, x, y, y_frag, d, ty, tx)
            if SCORE_STEPS == 2:
                scores_step(acc, x, y, y_frag, d + 4, ty, tx)

    @inlined
    def exchange(tile, values):
        # tile[tx + j*THREADS_N, row_of(ty, i)] = values[i, j]: transposed, so output_product
        # reads it along r; the 8 threads of an access phase write 8 rows: 8 bank groups
        ty, tx = thread_position()
        for j in range(TN):
            c = tx + j * THREADS_N
            for a in range(TM // 4):
                store4(tile, (c, row_of(ty, 4 * a)), values[4 * a, j], values[4 * a + 1, j],
                       values[4 * a + 2, j], values[4 * a + 3, j])

    @inlined
    def output_step(acc, e, y, e_frag, y_frag, c, ty, tx):
        # acc[TM, TD] += e[c, row_of(ty, i)] y[c, dim_of(tx, j)]: the SGEMM's outer product
        for a in range(TM // 4):
            e4 = load4(e, (c, row_of(ty, 4 * a)))
            for u in range(4):
                e_frag[4 * a + u] = e4[u]
        for a in range(TD // 4):
            y4 = load4(y, (c, dim_of(tx, 4 * a)))
            for u in range(4):
                y_frag[4 * a + u] = y4[u]
        for i in range(TM):
            for j in range(TD):
                acc[i, j] += e_frag[i] * y_frag[j]

    @inlined
    def output_product(acc, e, y):
        # acc[TM, TD] += sum_c e[c, row_of(ty, i)] y[c, dim_of(tx, j)] over c < COLS (e: an
        # exchange tile, y a staged tile [COLS, D]). Four steps per loop trip, as above
        ty, tx = thread_position()
        e_frag = cuda.local.array(TM, float32)
        y_frag = cuda.local.array(TD, float32)
        for c in range(0, COLS, 4):
            output_step(acc, e, y, e_frag, y_frag, c, ty, tx)
            output_step(acc, e, y, e_frag, y_frag, c + 1, ty, tx)
            output_step(acc, e, y, e_frag, y_frag, c + 2, ty, tx)
            output_step(acc, e, y, e_frag, y_frag, c + 3, ty, tx)

    @inlined
    def store_rows(x, acc, b, h, first, end, scale, accumulate, ty, tx):
        # x[b, h, first + row_of(ty, i), dim_of(tx, j)] (+)= acc[i, j] * scale, rows below end
        for i in range(TM):
            row = first + row_of(ty, i)
            if row < end:
                for j in range(TD):
                    d = dim_of(tx, j)
                    value = acc[i, j] * scale
                    if accumulate:
                        value += x[b, h, row, d]
                    x[b, h, row, d] = value

    return (thread_position, row_of, dim_of, stage, scores_product, exchange,
            output_product, store_rows)


def padded(n):
    """Row length of a shared tile whose rows hold n floats (n a multiple of 4), accessed 16
    bytes at a time: a multiple of 4 (rows stay 16-byte aligned) whose quarter is odd. A 16-byte
    access is served 8 threads at a time, and 8 threads that touch 8 consecutive rows at the
    same column then hit the 8 different groups of 4 banks."""
    return n + 4 if n % 8 == 0 else n


def launch_bounds(threads, blocks_per_sm):
    """cuda.jit's arguments asking that blocks_per_sm blocks fit on a multiprocessor (which caps
    the registers per thread at 65536 / (threads * blocks_per_sm)); 0: no cap. The simulator
    has no registers to cap (and its jit takes no launch_bounds)."""
    return dict(launch_bounds=(threads, blocks_per_sm)) if blocks_per_sm and not SIMULATOR else {}


def labelled(kernel, threads, tile, shared_bytes=0):
    """The kernel, with what its launcher needs (its block, its tile, its dynamic shared
    memory) and its launch bounds (for tools/kernel_report.py, which compiles it again)."""
    kernel.threads, kernel.tile, kernel.shared_bytes = threads, tile, shared_bytes
    kernel.launch_bounds = launch_bounds(threads, tile.blocks_per_sm).get("launch_bounds")
    return kernel


@inlined
def dout_chunk(dout, out, b, h, i, d):
    # dout[b, h, i, d : d + 8] rounded to 4 bf16 pairs and its dot product with out's
    # same 8 values: two 16-byte loads of each, the sums in one fixed order (the mma.sync
    # attention's delta pass and the wgmma attention's dq, so that both give delta the same bits)
    g0, g1, g2, g3 = load4(dout, (b, h, i, d))
    g4, g5, g6, g7 = load4(dout, (b, h, i, d + 4))
    o0, o1, o2, o3 = load4(out, (b, h, i, d))
    o4, o5, o6, o7 = load4(out, (b, h, i, d + 4))
    partial = (g0 * o0 + g1 * o1 + g2 * o2 + g3 * o3) + (g4 * o4 + g5 * o5 + g6 * o6 + g7 * o7)
    return (partial, bf16_pair(g0, g1), bf16_pair(g2, g3), bf16_pair(g4, g5),
            bf16_pair(g6, g7))


def pairs_storer(DN, accumulator):
    """store_pairs for the tensor-core kernels' accumulators of a [16-row, D] product, DN = D/8
    column groups: x[b, h, row0 + g (+ 8), :] = acc times factor0 (row g) or factor1 (g + 8),
    x the bf16 pairs [B,H,T,D/2] of a gradient that products read next, each two floats
    rounded to one pair (as round_bf16 would round them), a 32-bit store; nothing past row T.
    accumulator(acc, j, e): the lane's e-th float of column group j (mma.sync's acc is
    [DN, 4], wgmma's flat). `accumulate` is False (the launchers check it): store_rows' place."""

    @inlined
    def store_pairs(x, acc, factor0, factor1, accumulate, b, h, row0, T, lane):
        g, t = lane >> 2, lane & 3
        for j in range(DN):
            for half in range(2):
                row = row0 + g + 8 * half
                factor = factor0 if half == 0 else factor1
                if row < T:
                    x[b, h, row, 4 * j + t] = bf16_pair(accumulator(acc, j, 2 * half) * factor,
                                                        accumulator(acc, j, 2 * half + 1) * factor)

    return store_pairs
