"""The gathered operand of the grouped kernels: A's rows (varlen-M), or A's or B's k rows (varlen-K), by index.

Row-grouped kernels (``GatherRowsMixin``): row r of the virtual A [N, K] is ``x[row_src[r]]`` of ``x [S,
K]``, or a zero row when ``row_src[r] < 0`` (padding rows, rows past the last group) or ``r >= N``. The
wgrad (``GatherKRowsMixin``): A = ``rows^T`` (M-major, M = H, K = the N grouped rows) and k row r of it
is ``x[row_src[r]]`` the same way (the down projection's wgrad too, as the transpose of its gradient: A =
g_out's rows). Hopper's TMA cannot gather rows, so B stays on TMA and the gathered A is loaded with
16-byte ``cp.async`` by the 128 threads of the producer warp group, into the same swizzled stage
(``a_smem_staged``) that TMA would fill. K-major stage (tile_m, 64): thread t owns 16-byte chunk ``t % 8``
of rows ``t // 8 + 16 j``. M-major stage (tile_m, 64): thread t owns the 8 columns ``8 (t % (tile_m /
8))`` .. of k rows ``t // (tile_m / 8) + (1024 / tile_m) j`` (8 consecutive H elements of one token row).
A chunk whose row has no source (or that lies past K, past M or N) is a predicated copy with source size
0, which writes 16 zero bytes (PTX ``cp.async`` zero fill), so a stage holds exactly the bytes TMA would
have loaded from ``where(row_src >= 0, x[row_src], 0)`` (or its transpose). Source offsets are 32-bit
(the host requires the gathered tensor to have fewer than 2**31 elements).

A stage's full mbarrier counts 1 + 128 arrivals: warp 0's elected lane arrives with the expected
transaction bytes of B's tiles (the gathered A is no TMA transaction), and every producer
thread arrives through ``cp.async.mbarrier.arrive.noinc`` once its copies of the stage have landed
(``TmaCpAsyncPipeline``).
"""

from __future__ import annotations

import dataclasses

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.cute.nvgpu import cpasync
from cutlass.cutlass_dsl import if_generate

from .base import KernelParams, partition_coords

# the producer warp group copies the gathered operand
GATHER_THREADS = 128
# bf16 elements of one 16-byte cp.async
CHUNK_ELEMS = 8
# the gathered wgrad looks for a work item's padding rows among its last ROUTED_TAIL_ROWS k rows (P's default:
# a group's padding is fewer rows than P); a multiple of 32, one warp's loads each
ROUTED_TAIL_ROWS = 128


@dataclasses.dataclass(frozen=True)
class TmaCpAsyncPipeline(pipeline.PipelineTmaAsync):
    """A TMA pipeline whose stages are also filled by ``cp.async`` from every producer thread: all of
    them wait for a free stage, only the TMA warp arrives with the transaction bytes
    (``producer_acquire(state, is_tma_warp)``) and each thread arrives once more when its copies have
    landed (``producer_cpasync_commit``). The full barriers' arrival count is the producer group's size
    (1 + the cp.async threads); ``tx_count`` counts the TMA bytes only."""

    @staticmethod
    def create(**kwargs):
        """``PipelineTmaAsync.create(**kwargs)`` as this class."""
        base = pipeline.PipelineTmaAsync.create(**kwargs)
        return TmaCpAsyncPipeline(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)})

    def producer_acquire(self, state, is_tma_warp=True, *, loc=None, ip=None):
        """Wait for stage ``state`` to be free; the TMA warp (``is_tma_warp``, warp-uniform) also arrives on
        its full barrier with the expected TMA bytes (one elected lane). ``producer_tail`` calls it with
        the default (the TMA warp runs the tail)."""
        self.sync_object_empty.wait(state.index, state.phase, loc=loc, ip=ip)
        if_generate(is_tma_warp, lambda: self.sync_object_full.arrive(state.index, self.producer_mask, loc=loc,
                                                                       ip=ip), loc=loc, ip=ip)

    def producer_cpasync_commit(self, state, *, loc=None, ip=None):
        """This thread's arrival on stage ``state``'s full barrier, once its cp.async copies have landed."""
        cute.arch.cp_async_mbarrier_arrive_noinc(self.producer_get_barrier(state, loc=loc, ip=ip), loc=loc, ip=ip)


def make_gather_copy(tile_m: int, tile_k: int, m_major: bool = False, dtype=cutlass.BFloat16):
    """The tiled copy of a (tile_m, tile_k) A stage by the ``GATHER_THREADS`` producer threads, 16 bytes
    each, along the stage's contiguous mode: K-major, ``tile_k / 8`` threads per row (one 128-byte line for
    tile_k = 64), 16 rows per pass; M-major (``m_major``), ``tile_m / 8`` threads per k row (8 consecutive M
    elements each), ``1024 / tile_m`` k rows per pass."""
    atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), dtype,
                               num_bits_per_copy=CHUNK_ELEMS * dtype.width)
    if m_major:
        per_line = tile_m // CHUNK_ELEMS
        assert GATHER_THREADS % per_line == 0 and tile_k % (GATHER_THREADS // per_line) == 0, (tile_m, tile_k)
        threads = cute.make_layout((per_line, GATHER_THREADS // per_line), stride=(1, per_line))
        return cute.make_tiled_copy_tv(atom, threads, cute.make_layout((CHUNK_ELEMS, 1)))
    per_row = tile_k // CHUNK_ELEMS
    assert GATHER_THREADS % per_row == 0 and tile_m % (GATHER_THREADS // per_row) == 0, (tile_m, tile_k)
    threads = cute.make_layout((GATHER_THREADS // per_row, per_row), stride=(per_row, 1))
    return cute.make_tiled_copy_tv(atom, threads, cute.make_layout((1, CHUNK_ELEMS)))


class GatherOperandMixin:
    """What the kernels with a gathered operand share (see the module docstring): the register budgets,
    the ring's pipeline (``TmaCpAsyncPipeline``), the producer warp group (all four warps load) and the
    partition of the gather copy. Put a subclass before the kernel class and call ``_init_gather`` after
    the kernel's ``__init__``; the kernel passes no TMA atom for the gathered operand and (x, row_src [N]
    int32) as its tensor. ``gather_m_major``: the gathered stage is M-major (the wgrad's ``rows^T``)."""

    gather_m_major = False
    multicast_a = False  # the gathered operand is not loaded by TMA (B may be shared: ``cluster_m``)
    walk_producer_readers = GATHER_THREADS // 32 - 1  # every producer warp walks the tiles; warp 0 writes the walk
    scheduled_walk = False  # no producer warp is free to schedule the static walk: all four load

    def _init_gather(self):
        # every producer thread holds the source rows and addresses of up to 8 rows: with two consumer
        # warp groups registers move from them (128 x (56 + 2 x 224) = 64 512 <= 65 536, as 40 / 232
        # today); one consumer warp group keeps its 240
        self.load_regs = 56
        if self.num_mma_wg == 2:
            self.mma_regs = 224

    @cute.jit
    def make_mainloop_pipeline(self, mbar_ptr, a_smem_staged, b_smem_staged, num_b_rings):
        # the transaction bytes: B's tiles of a stage (in clusters sharing B: each CTA's half and its peer's); the
        # arrivals: the TMA warp's and every cp.async thread's
        tx_bytes = num_b_rings * cute.size_in_bytes(self.ab_dtype, cute.slice_(b_smem_staged, (None, None, 0)))
        return self.ring_pipeline(mbar_ptr, tx_bytes, 1 + GATHER_THREADS, TmaCpAsyncPipeline)

    @cute.jit
    def partition_gather(self, mA, sA: cute.Tensor):
        """``mA`` = (x, row_src): this producer thread's view of the gathered operand (``KernelParams``: x,
        row_src, the thread's slice of the gather copy and its (row, column) coordinates in a stage) and
        its chunks of the operand's stages ``sA`` (CPY, RestM, RestK, stage)."""
        x, row_src = mA
        tidx, _, _ = cute.arch.thread_idx()
        thr_copy = make_gather_copy(self.tile_m, self.tile_k, self.gather_m_major).get_slice(tidx % GATHER_THREADS)
        tAsA = thr_copy.partition_D(sA)
        tAcA = thr_copy.partition_S(cute.make_identity_tensor((self.tile_m, self.tile_k)))
        return KernelParams(x=x, row_src=row_src, thr_copy=thr_copy, tAcA=tAcA), tAsA

    @cute.jit
    def produce(self, warp_idx, mainloop, p, tAgA, tAsA: cute.Tensor, b_loads):
        """Producer warp group: lowers its register budget; all four warps load this CTA's tiles
        (``load_tiles``: the gathered operand by cp.async from every thread, the other by TMA from warp 0),
        then warp 0 waits for the consumers to drain the ring."""
        cute.arch.setmaxregister_decrease(self.load_regs)
        prod_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stage)
        prod_state = self.load_tiles(mainloop, prod_state, p, tAgA, tAsA, b_loads, warp_idx == 0)
        if warp_idx == 0:
            mainloop.producer_tail(prod_state)


class GatherRowsMixin(GatherOperandMixin):
    """The row-grouped kernels' producer with a gathered A operand (K-major, varlen-M): their m tiles come
    from N (the output's rows), not S. ``load_tiles`` (the row scheduler's ``load_tile``) runs in all four
    producer warps (each computes the schedule itself); ``load_expert_tile`` loads a tile's row indices
    once, then its k tiles (``load_gathered_k_tiles``)."""

    @cute.jit
    def partition_loads(self, tma_a, mA, sA: cute.Tensor, b_operands):
        """The gathered A (``partition_gather``), the B loads as the base class has them, and the number
        of k tiles."""
        gather, tAsA = self.partition_gather(mA, sA)
        k_tiles = cute.ceil_div(cute.size(gather.x, mode=[1]), self.tile_k)
        return gather, tAsA, self.partition_b_loads(b_operands), k_tiles

    @cute.jit
    def load_expert_tile(self, mainloop, prod_state, tma_a, gather, tAsA: cute.Tensor, m_idx, n_idx,
                         k_tiles: cutlass.Int32, rings, expert, descs=None, lone=None):
        """Producer thread: every k tile of output tile (m_idx, n_idx), A gathered by ``gather``'s row
        indices, B from expert ``expert`` of the weights in ``rings`` (through ``descs`` when given; ``lone``
        as ``load_b_tile``'s)."""
        return self.load_gathered_k_tiles(
            mainloop, prod_state, gather, tAsA, m_idx, [b.at(n_idx, expert) for b in rings], k_tiles, descs, lone,
        )

    @cute.jit
    def load_gathered_k_tiles(self, mainloop, prod_state, gather, tAsA: cute.Tensor, m_idx, b_loads,
                              k_count: cutlass.Int32, b_descs=None, lone=None):
        """Producer thread: k tiles [0, k_count) of m tile ``m_idx`` into the ring. The source rows of the
        thread's rows are read once (rows >= N or with a negative index: zero rows, the address clamped to
        row 0); per k tile warp 0 issues the B loads (per ring its ``BTileLoad``: ``load_b_tile``, ``lone`` as
        there) and every thread its A chunks, one 16-byte cp.async per row, predicated off (zero fill) for
        rows without a source and chunks past K (a pair's M tile past N: zero rows)."""
        if cutlass.const_expr(b_descs is None):
            b_descs = [None] * len(b_loads)
        thr_copy, tAcA, x = gather.thr_copy, gather.tAcA, gather.x
        rows = cute.size(tAcA, mode=[1])
        num_rows = cute.size(gather.row_src, mode=[0])
        k_extent = cute.size(x, mode=[1])
        is_tma_warp = cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 0
        src = cute.make_rmem_tensor(rows, cutlass.Int32)
        has_src = cute.make_rmem_tensor(rows, cutlass.Boolean)
        for j in cutlass.range_constexpr(rows):
            r = m_idx * self.tile_m + tAcA[(0, j, 0)][0]
            idx = cutlass.Int32(-1)
            if r < num_rows:
                idx = gather.row_src[r]
            has_src[j] = idx >= 0
            src[j] = cutlass.max(idx, 0)
        pred = cute.make_rmem_tensor(cute.make_layout((1, 1)), cutlass.Boolean)
        for k in cutlass.range(k_count, unroll=1):
            mainloop.producer_acquire(prod_state, is_tma_warp)
            stage = prod_state.index
            if is_tma_warp:
                bar = mainloop.producer_get_barrier(prod_state)
                for b, desc in zip(b_loads, b_descs):
                    self.load_b_tile(b, k, stage, bar, desc, lone)
            in_k = cutlass.Boolean(True)
            if cutlass.const_expr(k_extent % self.tile_k != 0):  # a partial last k tile: chunks past K
                in_k = k * self.tile_k + tAcA[(0, 0, 0)][1] < k_extent
            for j in cutlass.range_constexpr(rows):
                # the source row, broadcast over the stage's rows: the copy's partition then picks this
                # thread's chunk of it (same column offsets as the stage)
                row = cute.local_tile(x, (1, self.tile_k), (src[j], k))
                tAgA = thr_copy.partition_S(
                    cute.make_tensor(row.iterator, cute.make_layout((self.tile_m, self.tile_k), stride=(0, 1)))
                )
                pred[0] = has_src[j] & in_k
                cute.copy(thr_copy, tAgA[(None, j, None)], tAsA[(None, j, None, stage)], pred=pred)
            mainloop.producer_cpasync_commit(prod_state)
            prod_state.advance()
        return prod_state



class GatherKRowsMixin(GatherOperandMixin):
    """The wgrad's producer with a gathered A = ``rows^T`` (M-major, varlen-K): k row r of A is
    ``x[row_src[r]]`` (M = H, the columns of x). ``load_tiles`` (the group scheduler's ``load_tile``) runs in
    all four producer warps; ``load_work_item`` loads one work item's k tiles, reading the token indices of
    each k tile's rows one k tile ahead into registers (their global-memory latency overlaps the wait for
    a free stage and the copies of the current k tile). Tried in session 25 and left out (docs/design-notes.md):
    reading them two k tiles ahead (faster at 16 x 4096 rows, ~2% slower in the layer step's 22-k-tile
    items) and reading the next item's first ones during the current item (slower still)."""

    gather_m_major = True

    @cute.jit
    def partition_loads(self, tma_a, mA, sA: cute.Tensor, b_operands):
        """The gathered A (``partition_gather``), the B loads as the base class has them, and the number
        of k tiles of all N rows."""
        gather, tAsA = self.partition_gather(mA, sA)
        k_tiles = cute.ceil_div(cute.size(gather.row_src, mode=[0]), self.tile_k)
        return gather, tAsA, self.partition_b_loads(b_operands), k_tiles

    @cute.jit
    def routed_k_rows(self, p, k_start: cutlass.Int32, k_count: cutlass.Int32):
        """Consumer warp: the rows of k tiles [k_start, k_start + k_count) up to their last one with a token,
        looked for among the last ``ROUTED_TAIL_ROWS`` (rows before those count as routed). Every row after
        it is a zero row of A, so the mainloop need not multiply it (``mma_k_tiles``' ``k_rows``): the
        layer's groups end in up to P - 1 padding rows (dispatch's layout), whose whole 16-row blocks are
        ~3% of the wgrad's MMAs at 48 groups of 1365 routed rows on average. Measured in the layer step under ncu
        (session 25): the tensor pipe's active share fell by that much (93.9 -> 90.5%), the elapsed cycles
        did not (4.13 -> 4.19 M on another board, where the unchanged SwiGLU took 1% more): this kernel's
        short items are not bound by the tensor cores. Four loads a lane from ``p.row_src`` (cached, issued
        before the mainloop waits for its turn) and one max over the warp."""
        rows = k_count * self.tile_k
        first = k_start * self.tile_k
        window = cutlass.min(rows, ROUTED_TAIL_ROWS)
        lane = cute.arch.lane_idx()
        routed_end = cutlass.Int32(0)  # 1 + the window's last routed row, from the window's first
        for chunk in cutlass.range_constexpr(ROUTED_TAIL_ROWS // 32):
            r = chunk * 32 + lane
            if r < window:
                if p.row_src[first + rows - window + r] >= 0:
                    routed_end = r + 1
        return rows - window + cute.arch.warp_redux_sync(routed_end, "max")

    @cute.jit
    def fetch_k_sources(self, gather, k_tile: cutlass.Int32, src: cute.Tensor):
        """``src[j]`` = the token index of this thread's j-th k row of k tile ``k_tile`` (-1: none, also
        for rows >= N, e.g. the k tile after the last group's)."""
        num_rows = cute.size(gather.row_src, mode=[0])
        for j in cutlass.range_constexpr(cute.size(src)):
            r = k_tile * self.tile_k + gather.tAcA[(0, 0, j)][1]
            idx = cutlass.Int32(-1)
            if r < num_rows:
                idx = gather.row_src[r]
            src[j] = idx

    @cute.jit
    def load_work_item(self, mainloop, prod_state, tma_a, gather, tAsA: cute.Tensor, b_load, m_idx, n_idx,
                       k_start: cutlass.Int32, k_count: cutlass.Int32):
        """Producer thread: k tiles [k_start, k_start + k_count) of work item (m tile ``m_idx``, n tile
        ``n_idx``) into the ring: A gathered (m tile ``m_idx`` of x's columns), B (``b_load``: its ``BTileLoad``)
        by TMA (``load_gathered_k_rows``)."""
        return self.load_gathered_k_rows(mainloop, prod_state, gather, tAsA, m_idx, b_load.at(n_idx), k_start,
                                         k_count)

    @cute.jit
    def load_gathered_k_rows(self, mainloop, prod_state, gather, tAsA: cute.Tensor, m_idx, b_load,
                             k_start: cutlass.Int32, k_count: cutlass.Int32):
        """Producer thread: k tiles [k_start, k_start + k_count) into the ring. Per k tile warp 0 issues B's
        load (``b_load``: this item's ``BTileLoad``, ``load_b_tile``) and every thread its chunks of the
        gathered A's tile ``m_idx`` (tile_m columns of x from ``m_idx * tile_m``, into ``tAsA``), one 16-byte
        cp.async per k row from the row's token of x (8 consecutive columns), predicated off (zero fill) for
        rows without a token and columns past x's (a partial last tile, or a cluster's tile past the last; the
        address clamped to token 0). In clusters sharing B (``cluster_m`` = 2) warp 0 loads its CTA's half of B's
        tile into both CTAs."""
        thr_copy, tAcA, x = gather.thr_copy, gather.tAcA, gather.x
        k_rows = cute.size(tAcA, mode=[2])
        m_extent = cute.size(x, mode=[1])
        is_tma_warp = cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 0
        in_m = cutlass.Boolean(True)
        # a partial last tile, or in clusters sharing B the tile past the last of an odd number: chunks past x's
        # columns
        if cutlass.const_expr(m_extent % self.tile_m != 0 or self.cluster_m > 1):
            in_m = m_idx * self.tile_m + tAcA[(0, 0, 0)][0] < m_extent
        src = cute.make_rmem_tensor(k_rows, cutlass.Int32)
        next_src = cute.make_rmem_tensor(k_rows, cutlass.Int32)
        self.fetch_k_sources(gather, k_start, next_src)
        pred = cute.make_rmem_tensor(cute.make_layout((1, 1)), cutlass.Boolean)
        for k in cutlass.range(k_count, unroll=1):
            for j in cutlass.range_constexpr(k_rows):
                src[j] = next_src[j]
            self.fetch_k_sources(gather, k_start + k + 1, next_src)
            mainloop.producer_acquire(prod_state, is_tma_warp)
            stage = prod_state.index
            if is_tma_warp:
                self.load_b_tile(b_load, k_start + k, stage, mainloop.producer_get_barrier(prod_state))
            for j in cutlass.range_constexpr(k_rows):
                # the token's row of x from column m0, broadcast over the stage's k rows: the copy's
                # partition then picks this thread's chunk of it (same column offsets as the stage)
                row = cute.local_tile(x, (1, self.tile_m), (cutlass.max(src[j], 0), m_idx))
                tAgA = thr_copy.partition_S(
                    cute.make_tensor(row.iterator, cute.make_layout((self.tile_m, self.tile_k), stride=(1, 0)))
                )
                pred[0] = (src[j] >= 0) & in_m
                cute.copy(thr_copy, tAgA[(None, None, j)], tAsA[(None, None, j, stage)], pred=pred)
            mainloop.producer_cpasync_commit(prod_state)
            prod_state.advance()
        return prod_state


def gather_copy_coverage(kernel) -> dict:
    """CPU check of a gathered-operand kernel's copy on one stage of that operand (layout algebra at trace
    time only). Per producer thread the (row, column) of every value of its partition of a (tile_m, 64) A
    stage, in copies of ``CHUNK_ELEMS`` values, and where the stage's shared layout (the swizzled
    ``a_smem_staged`` that TMA fills, as ``kernel`` builds it) puts each of them. Returns: how many values
    and distinct (row, column) the threads cover, the stage's size, how many copies are not one 16-byte
    chunk along the stage's contiguous mode (8 consecutive columns of one row from a multiple of 8, or
    for an M-major stage 8 consecutive rows of one column), and how many are not 8 consecutive elements
    of shared memory at a 16-byte aligned offset. Run with ``CUTE_DSL_ARCH=sm_90a`` (see the tests)."""
    from csrc_cute.compile_check import expect_no_driver

    seen: list[tuple[int, int]] = []
    offsets: list[int] = []

    @cute.jit
    def probe():
        kernel._setup_mainloop()
        copy = make_gather_copy(kernel.tile_m, kernel.tile_k, kernel.gather_m_major)
        stage = cute.make_identity_tensor((kernel.tile_m, kernel.tile_k))
        for coords in partition_coords(lambda t: copy.get_slice(t).partition_D(stage), GATHER_THREADS):
            seen.extend(coords)
        layout = cute.slice_(kernel.a_smem_staged, (None, None, 0))
        offsets.extend(int(layout(crd)) for crd in seen)

    with expect_no_driver():
        cute.compile(probe)
    step = (1, 0) if kernel.gather_m_major else (0, 1)
    copies = [seen[i:i + CHUNK_ELEMS] for i in range(0, len(seen), CHUNK_ELEMS)]
    bad_chunks = sum(1 for cp in copies if (cp[0][0] if kernel.gather_m_major else cp[0][1]) % CHUNK_ELEMS
                     or cp != [(cp[0][0] + v * step[0], cp[0][1] + v * step[1]) for v in range(CHUNK_ELEMS)])
    spans = [offsets[i:i + CHUNK_ELEMS] for i in range(0, len(offsets), CHUNK_ELEMS)]
    bad_smem = sum(1 for sp in spans if sp[0] % CHUNK_ELEMS or sp != list(range(sp[0], sp[0] + CHUNK_ELEMS)))
    return dict(values=len(seen), distinct=len(set(seen)), elements=kernel.tile_m * kernel.tile_k,
                bad_chunks=bad_chunks, bad_smem=bad_smem, smem_distinct=len(set(offsets)))
