"""The gathered A operand of the row-grouped kernels (varlen-M row gather by index).

Row r of the virtual A [N, K] is ``x[row_src[r]]`` of ``x [S, K]``, or a zero row when ``row_src[r] < 0``
(padding rows, rows past the last group) or ``r >= N``. Hopper's TMA cannot gather rows, so B stays on
TMA and A is loaded with 16-byte ``cp.async`` by the 128 threads of the producer warp group, into the
same swizzled A stage (``a_smem_staged``) that TMA would fill: thread t owns 16-byte chunk ``t % 8`` of
rows ``t // 8 + 16 j`` of a (tile_m, 64) stage. A chunk whose row has no source is a predicated copy
with source size 0, which writes 16 zero bytes (PTX ``cp.async`` zero fill), so a stage holds exactly
the bytes TMA would have loaded from ``where(row_src >= 0, x[row_src], 0)``. Source offsets are 32-bit
(the host requires x to have fewer than 2**31 elements).

A stage's full mbarrier counts 1 + 128 arrivals: warp 0's elected lane arrives with the expected
transaction bytes of the B tiles (A is no TMA transaction), and every producer thread arrives through
``cp.async.mbarrier.arrive.noinc`` once its copies of the stage have landed (``TmaCpAsyncPipeline``).
"""

from __future__ import annotations

import dataclasses

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.cute.nvgpu import cpasync
from cutlass.cutlass_dsl import if_generate

from .base import KernelParams

# the producer warp group copies A
GATHER_THREADS = 128
# bf16 elements of one 16-byte cp.async
CHUNK_ELEMS = 8


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


def make_gather_copy_a(tile_m: int, tile_k: int, dtype=cutlass.BFloat16):
    """The tiled copy of a K-major (tile_m, tile_k) A stage by ``GATHER_THREADS`` threads, 16 bytes each:
    ``tile_k / 8`` threads per row (one 128-byte line for tile_k = 64), 16 rows per pass."""
    atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), dtype,
                               num_bits_per_copy=CHUNK_ELEMS * dtype.width)
    per_row = tile_k // CHUNK_ELEMS
    assert GATHER_THREADS % per_row == 0 and tile_m % (GATHER_THREADS // per_row) == 0, (tile_m, tile_k)
    threads = cute.make_layout((GATHER_THREADS // per_row, per_row), stride=(per_row, 1))
    return cute.make_tiled_copy_tv(atom, threads, cute.make_layout((1, CHUNK_ELEMS)))


class GatherRowsMixin:
    """The row-grouped kernels' producer with a gathered A operand (see the module docstring). Put it
    before the kernel class and call ``_init_gather`` after the kernel's ``__init__``; the kernel passes
    ``p.tma_a = None`` and ``p.mA = (x [S, K], row_src [N] int32)`` and its m tiles come from N (the
    output's rows), not S. The row scheduler's ``load_tiles`` runs unchanged in all four producer warps
    (each computes the schedule itself); ``load_expert_tile`` loads a tile's row indices once, then its
    k tiles (``load_gathered_k_tiles``)."""

    def _init_gather(self):
        # every producer thread holds the source rows and addresses of up to 8 rows: with two consumer
        # warp groups registers move from them (128 x (56 + 2 x 224) = 64 512 <= 65 536, as 40 / 232
        # today); one consumer warp group keeps its 240
        self.load_regs = 56
        if self.num_mma_wg == 2:
            self.mma_regs = 224

    @cute.jit
    def make_mainloop_pipeline(self, mbar_ptr, a_smem_staged, b_smem_staged, num_b_rings):
        b_smem = cute.slice_(b_smem_staged, (None, None, 0))
        return TmaCpAsyncPipeline.create(
            barrier_storage=mbar_ptr,
            num_stages=self.ab_stage,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1 + GATHER_THREADS),
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, self.tile_mma_threads // 32  # one arrival per consumer warp
            ),
            tx_count=num_b_rings * cute.size_in_bytes(self.ab_dtype, b_smem),
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
            defer_sync=True,
        )

    @cute.jit
    def partition_loads(self, tma_a, mA, sA: cute.Tensor, b_operands):
        """``mA`` = (x, row_src): this producer thread's view of the gathered A (``KernelParams``: x, row_src,
        the thread's slice of the gather copy and its (row, column) coordinates in a stage), its chunks
        of the A stages (CPY, rows, 1, stage), the B loads as the base class has them, and the number of
        k tiles."""
        x, row_src = mA
        tidx, _, _ = cute.arch.thread_idx()
        thr_copy = make_gather_copy_a(self.tile_m, self.tile_k).get_slice(tidx % GATHER_THREADS)
        tAsA = thr_copy.partition_D(sA)
        tAcA = thr_copy.partition_S(cute.make_identity_tensor((self.tile_m, self.tile_k)))
        gather = KernelParams(x=x, row_src=row_src, thr_copy=thr_copy, tAcA=tAcA)
        k_tiles = cute.ceil_div(cute.size(x, mode=[1]), self.tile_k)
        return gather, tAsA, self.partition_b_loads(b_operands), k_tiles

    @cute.jit
    def produce(self, warp_idx, mainloop, p, tAgA, tAsA: cute.Tensor, b_loads):
        """Producer warp group: lowers its register budget; all four warps load this CTA's tiles
        (``load_tiles``: A by cp.async from every thread, B by TMA from warp 0), then warp 0 waits for
        the consumers to drain the ring."""
        cute.arch.setmaxregister_decrease(self.load_regs)
        prod_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stage)
        prod_state = self.load_tiles(mainloop, prod_state, p, tAgA, tAsA, b_loads)
        if warp_idx == 0:
            mainloop.producer_tail(prod_state)

    @cute.jit
    def load_expert_tile(self, mainloop, prod_state, tma_a, gather, tAsA: cute.Tensor, m_idx, n_idx,
                         k_tiles: cutlass.Int32, rings, expert, descs=None):
        """Producer thread: every k tile of output tile (m_idx, n_idx), A gathered by ``gather``'s row
        indices, B from expert ``expert`` of the weights in ``rings`` (through ``descs`` when given)."""
        return self.load_gathered_k_tiles(
            mainloop, prod_state, gather, tAsA, m_idx,
            [(tma, tBgB[(None, n_idx, None, expert)], tBsB) for tma, tBgB, tBsB in rings], k_tiles, descs,
        )

    @cute.jit
    def load_gathered_k_tiles(self, mainloop, prod_state, gather, tAsA: cute.Tensor, m_idx, b_loads,
                              k_count: cutlass.Int32, b_descs=None):
        """Producer thread: k tiles [0, k_count) of m tile ``m_idx`` into the ring. The source rows of the
        thread's rows are read once (rows >= N or with a negative index: zero rows, the address clamped to
        row 0); per k tile warp 0 issues the B loads (per ring (atom, (TMA, RestK), (TMA, stage))) and
        every thread its A chunks, one 16-byte cp.async per row, predicated off (zero fill) for rows
        without a source and chunks past K."""
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
                for (tma_b, tBgB, tBsB), desc in zip(b_loads, b_descs):
                    cute.copy(tma_b, tBgB[(None, k)], tBsB[(None, stage)], tma_bar_ptr=bar, tma_desc_ptr=desc)
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

