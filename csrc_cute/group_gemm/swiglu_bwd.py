"""The down-projection dgrad with the SwiGLU backward in its epilogue (``group_gemm_swiglu_bwd``)."""

from __future__ import annotations

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.utils import LayoutEnum

from . import gather
from .base import GroupGemmSm90Base, KernelParams, partition_coords, sigmoid_approx
from .config import GroupGemmConfig
from .scheduler import RowTileScheduler
from .swiglu_bwd_smem import SwigluBwdSmemEpilogue

# "registers": gate/up read and g_gate, g_up, h_w written between global memory and the accumulator
# fragment; "smem": through shared memory by TMA (swiglu_bwd_smem.py)
SWIGLU_BWD_EPILOGUES = ("registers", "smem")


class GroupGemmSwigluBwdSm90(SwigluBwdSmemEpilogue, RowTileScheduler, GroupGemmSm90Base):
    """Down-projection dgrad with the SwiGLU backward in the epilogue (see ``group_gemm_swiglu_bwd``).

    Mainloop: the dgrad GEMM ``d = g_y @ W_down_g^T`` (A = g_y K-major, B = ``W_down_g`` viewed
    (F, H), K-major), persistent with the device-side tile -> group lookup of the forward. Pingpong:
    each of the two consumer warp groups computes whole tile_m x 128 tiles of d (fp32, 128
    accumulators per thread at tile_m = 128), taking every other tile of its CTA, so that one warp
    group's epilogue (which reads two and writes three [N, F] bf16 tensors) runs while the other's
    wgmma keeps the tensor cores busy (cooperative warp groups, both on one tile and then both in the
    epilogue, left them idle meanwhile; measured gain 2-9%, docs/design-notes.md).
    Epilogue, per batch of 8-column accumulator chunks (see ``swiglu_bwd_batch``): the saved bf16
    gate/up at the accumulator elements' (row, column)s loaded into registers in one vectorised batch
    (all in flight before any store; a whole tile's gate/up next to its accumulators would not fit the
    registers), then per element, in registers, with ``row_w[r]``: ``s = sigmoid(gate)``,
    ``h = gate * s * up`` in fp32 and ``g_gate = row_w * d * up * s * (1 + gate * (1 - s))``,
    ``g_up = row_w * d * gate * s``, ``h_w = row_w * h`` (bf16; the down wgrad's A operand:
    dW_down = h_w^T g_y), stored straight to global memory (vectorised on full tiles), and the
    partial dot product ``sum_f d * h`` of its rows over the tile's columns into ``part[r, n tile]``
    (fp32; the route-weight gradient is ``part.sum(1)``: no atomics, deterministic).
    Row reduction: an accumulator element's row offset within the thread's rows is static (the
    layout of the thread's slice of an identity tile), and the four lanes of a quad share their rows
    (checked on the CPU by the tests): per static row offset a register sum, then two xor shuffles.
    With ``epilogue="smem"`` gate/up and the three outputs move through shared memory by TMA instead
    (``SwigluBwdSmemEpilogue``; the same math and row sums, bitwise the same results).
    """

    # GroupGemmConfig.cluster_m = 2: two M tiles of one group share its W_down tiles (``pair_tile``; a pair's
    # M tile past N reads zeros and its stores are dropped: predicated, or clipped by the TMA bounds)
    multicast_b = True

    def __init__(self, config: GroupGemmConfig, epilogue: str = "registers"):
        if epilogue not in SWIGLU_BWD_EPILOGUES:
            raise ValueError(f"GroupGemmSwigluBwdSm90: epilogue must be one of {SWIGLU_BWD_EPILOGUES}, "
                             f"got {epilogue!r}")
        self.epilogue = epilogue
        self._init_common(
            config,
            LayoutEnum.ROW_MAJOR,  # A = g_y [N, H]: K-major
            LayoutEnum.ROW_MAJOR,  # B = W_down [F, H] per group: K-major (reduction over H)
            self._init_smem_epilogue(config.tile_n) if epilogue == "smem" else 0,
            pingpong=True,
        )
        self.b_modes = [1, 2, 0]  # W_down (E, F, H) -> (F, H, E)
        if self.tile_n > 128:
            # a wider tile's accumulators (tile_n per thread) next to the epilogue's registers need the
            # consumers' largest budget (the producer's one warp of TMA issue fits in 24)
            self.load_regs, self.mma_regs = 24, 240
        # 8-column accumulator chunks per epilogue batch (at most 8, dividing the tile's tile_n / 8): a
        # batch's gate/up registers next to a whole tile's accumulators must fit the consumers' registers
        chunks = self.tile_n // 8
        self.epi_batch_chunks = max(d for d in range(1, 9) if chunks % d == 0)

    def output_rows(self, p):
        """The rows of the outputs (``pair_tile``): gate's (N), also for a gathered A of S rows."""
        return cute.size(p.mGate, mode=[0])

    def _row_slots(self):
        """Trace time: the static row offset of each accumulator element within a thread's rows (the
        same for every thread), as (slot of element i, first element of each slot)."""
        local = self.tiled_mma.get_slice(0).partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        offs = [int(local.layout(i)[0]) for i in range(cute.size(local))]
        distinct = sorted(set(offs))
        self.row_slot = tuple(distinct.index(o) for o in offs)
        self.row_first = tuple(offs.index(o) for o in distinct)

    @cute.jit
    def __call__(
        self,
        g_y: cute.Tensor,  # (N, H)
        w_home: cute.Tensor,  # (epn, F, H)
        w_slot: cute.Tensor,  # (B, F, H)
        cu_seqlens: cute.Tensor,  # (G,) int32
        row_w: cute.Tensor,  # (N,) fp32
        gate: cute.Tensor,  # (N, F) bf16
        up: cute.Tensor,  # (N, F) bf16
        g_gate: cute.Tensor,  # (N, F) bf16 out
        g_up: cute.Tensor,  # (N, F) bf16 out
        h_w: cute.Tensor,  # (N, F) bf16 out
        part: cute.Tensor,  # (N, ceil(F / tile_n)) fp32 out
        tile_counter: cute.Tensor,  # (1,) int32, zero: the dynamic walk's counter (unused by the static walk)
        stream: cuda.CUstream,
    ):
        self._launch(g_y, w_home, w_slot, cu_seqlens, row_w, gate, up, g_gate, g_up, h_w, part, tile_counter, stream)

    @cute.jit
    def _launch(self, g_y, w_home, w_slot, cu_seqlens, row_w, gate, up, g_gate, g_up, h_w, part, tile_counter, stream,
                row_src=None):
        """Shared by the plain kernel (g_y = the grouped rows [N, H]) and the one with a gathered A operand
        (``row_src`` not None: g_y is [S, H], A row r is g_y[row_src[r]], no TMA for A, and the m tiles
        come from gate's rows)."""
        self._setup_mainloop()
        self._row_slots()
        if cutlass.const_expr(row_src is None):
            tma_a, mA = self._tma_load_a(g_y)
        else:
            tma_a, mA = None, g_y
        _, tma_bh, mBh, tma_bs, mBs = self._tma_load_weights(w_home, w_slot)
        num_n_tiles, num_tiles = self._row_tiles(g_y if cutlass.const_expr(row_src is None) else gate, gate,
                                                 cu_seqlens)
        if cutlass.const_expr(self.epilogue == "smem"):
            epi_atoms = self._smem_epilogue_atoms(gate, up, g_gate, g_up, h_w)
            epi_smem_staged = self.epi_smem_staged
            self._make_shared_storage(with_c=True, epi_barriers=2 * self.epi_load_stages)
        else:
            epi_atoms, epi_smem_staged = (None,) * 10, None
            self._make_shared_storage()
        self._launch_persistent(
            self.kernel(
                tma_a, mA, tma_bh, mBh, tma_bs, mBs, cu_seqlens, row_w, gate, up, g_gate, g_up, h_w, part,
                self.tiled_mma, self.a_smem_staged, self.b_smem_staged, num_n_tiles, num_tiles,
                epi_smem_staged, *epi_atoms, row_src, self.walk_counter(tile_counter),
            ),
            num_tiles,
            stream,
        )

    @cute.jit
    def swiglu_bwd_values(self, d, gate, up, rw):
        """One element: from d (fp32) and the bf16 gate, up -> (g_gate, g_up, h_w) in fp32 and d * h."""
        one = cutlass.Float32(1.0)
        gt = gate.to(cutlass.Float32)
        ut = up.to(cutlass.Float32)
        s = sigmoid_approx(gt)
        silu = gt * s
        h = silu * ut
        gh = d * rw
        return gh * ut * s * (one + gt * (one - s)), gh * silu, h * rw, d * h

    @cute.jit
    def swiglu_bwd_epilogue(self, acc: cute.Tensor, coords: cute.Tensor, rG: cute.Tensor, rU: cute.Tensor,
                            tCgG: cute.Tensor, tCgU: cute.Tensor, tCgGG: cute.Tensor, tCgGU: cute.Tensor, tCgHW: cute.Tensor,
                            row_w: cute.Tensor, last_row, dims, full: cutlass.Constexpr,
                            part_sums: cute.Tensor):
        """The epilogue (see the class docstring). A full tile, per 64-row block of the warp group's
        tile (the accumulator's MMA_M mode) and batch of its 8-column chunks (``swiglu_bwd_batch``):
        vectorised loads of gate/up into ``rG``/``rU``, the math in registers, vectorised stores. An
        edge tile reads and writes per element, predicated. ``part_sums[row_slot[i]]``
        collects d * h of the thread's rows of that static slot (elements outside the bounds are
        skipped)."""
        # the route weight of each of the thread's rows, read once (clamped: rows past N are never stored)
        rws = self.row_weights(coords, row_w, last_row)
        blocks = cute.size(acc, mode=[1])
        per_block = cute.size(acc) // blocks  # element e of block m is acc[m * per_block + e]
        for m in cutlass.range_constexpr(blocks):
            if cutlass.const_expr(full):
                for b in cutlass.range_constexpr(cute.size(acc.shape[0][2]) // self.epi_batch_chunks):
                    self.swiglu_bwd_batch(acc, m, b, rG, rU, tCgG, tCgU, tCgGG, tCgGU, tCgHW, rws, part_sums)
            else:
                # an edge tile (rare): gate/up read from global memory one element at a time, every
                # access predicated on the bounds
                for e in cutlass.range_constexpr(per_block):
                    i = m * per_block + e
                    if cute.elem_less(coords[i], dims):
                        self.swiglu_bwd_edge_element(i, acc, tCgG, tCgU, tCgGG, tCgGU, tCgHW, rws, part_sums)

    @cute.jit
    def row_weights(self, coords: cute.Tensor, row_w: cute.Tensor, last_row):
        """The route weight of each of the thread's row slots, read once (``row_weight``)."""
        rws = cute.make_rmem_tensor(len(self.row_first), self.acc_dtype)
        for j in cutlass.range_constexpr(len(self.row_first)):
            rws[j] = self.row_weight(coords, row_w, j, last_row)
        return rws

    @cute.jit
    def row_weight(self, coords: cute.Tensor, row_w: cute.Tensor, slot: cutlass.Constexpr, last_row):
        """The route weight of the thread's rows of static row slot ``slot`` (clamped: rows past N are never
        stored)."""
        return row_w[cutlass.min(coords[self.row_first[slot]][0], last_row)]

    @cute.jit
    def swiglu_bwd_batch(self, acc: cute.Tensor, m: cutlass.Constexpr, b: cutlass.Constexpr, rG: cute.Tensor,
                         rU: cute.Tensor, tCgG: cute.Tensor, tCgU: cute.Tensor, tCgGG: cute.Tensor, tCgGU: cute.Tensor,
                         tCgHW: cute.Tensor, rws: cute.Tensor, part_sums: cute.Tensor):
        """Batch ``b`` of a full tile's 64-row block ``m``: ``epi_batch_chunks`` of the accumulator's 8-column
        chunks (a wgmma C fragment is ((2, 2, tile_n / 8), MMA_M, MMA_N): chunk j of block m holds
        elements 64 m + 4 j + (0..3), two rows x two adjacent columns). One batch of vectorised
        gate/up loads (all in flight before any store), the math in registers, vectorised stores of
        g_gate, g_up, h_w."""
        per_block = cute.size(acc) // cute.size(acc, mode=[1])
        chunks = range(b * self.epi_batch_chunks, (b + 1) * self.epi_batch_chunks)
        for c, j in enumerate(chunks):
            cute.autovec_copy(tCgG[((None, None, j), m, None)], rG[(None, None, c, None)])
            cute.autovec_copy(tCgU[((None, None, j), m, None)], rU[(None, None, c, None)])
        for c, j in enumerate(chunks):
            for e in cutlass.range_constexpr(4):
                i = m * per_block + 4 * j + e
                slot = self.row_slot[i]
                g_gate, g_up, h_w, dh = self.swiglu_bwd_values(acc[i], rG[4 * c + e], rU[4 * c + e], rws[slot])
                rG[4 * c + e] = g_gate.to(cutlass.BFloat16)
                rU[4 * c + e] = g_up.to(cutlass.BFloat16)
                acc[i] = h_w
                part_sums[slot] = part_sums[slot] + dh
        for c, j in enumerate(chunks):
            cute.autovec_copy(rG[(None, None, c, None)], tCgGG[((None, None, j), m, None)])
            cute.autovec_copy(rU[(None, None, c, None)], tCgGU[((None, None, j), m, None)])
        for c, j in enumerate(chunks):
            for e in cutlass.range_constexpr(4):
                rG[4 * c + e] = acc[m * per_block + 4 * j + e].to(cutlass.BFloat16)  # h_w, in gate's registers
            cute.autovec_copy(rG[(None, None, c, None)], tCgHW[((None, None, j), m, None)])

    @cute.jit
    def swiglu_bwd_edge_element(self, i: cutlass.Constexpr, acc: cute.Tensor, tCgG: cute.Tensor, tCgU: cute.Tensor,
                                tCgGG: cute.Tensor, tCgGU: cute.Tensor, tCgHW: cute.Tensor, rws: cute.Tensor,
                                part_sums: cute.Tensor):
        """Element i of an edge tile, inside the bounds: gate/up read from and results written to global
        memory (a function of its own: a dynamic branch may not bind new values)."""
        slot = self.row_slot[i]
        g_gate, g_up, h_w, dh = self.swiglu_bwd_values(acc[i], tCgG[i], tCgU[i], rws[slot])
        tCgGG[i] = g_gate.to(cutlass.BFloat16)
        tCgGU[i] = g_up.to(cutlass.BFloat16)
        tCgHW[i] = h_w.to(tCgHW.element_type)
        part_sums[slot] = part_sums[slot] + dh

    @cute.kernel
    def kernel(
        self,
        tma_a: cute.CopyAtom, mA: cute.Tensor,
        tma_bh: cute.CopyAtom, mBh: cute.Tensor,
        tma_bs: cute.CopyAtom, mBs: cute.Tensor,
        cu_seqlens: cute.Tensor,
        row_w: cute.Tensor,
        mGate: cute.Tensor, mUp: cute.Tensor, mGG: cute.Tensor, mGU: cute.Tensor, mHW: cute.Tensor,
        mPart: cute.Tensor,
        tiled_mma: cute.TiledMma,
        a_smem_staged: cute.ComposedLayout,
        b_smem_staged: cute.ComposedLayout,
        num_n_tiles: cutlass.Int32,
        num_tiles: cutlass.Int32,
        epi_smem_staged,  # None (the register epilogue), or the shared-memory epilogue's sub-tile slots
        # the shared-memory epilogue's TMA atoms and tensors (None for the register epilogue): loads of
        # gate, up; stores of g_gate, g_up, h_w
        tma_ld_gate, mLdGate, tma_ld_up, mLdUp, tma_st_gg, mStGG, tma_st_gu, mStGU, tma_st_hw, mStHW,
        row_src,  # None, or (N,) int32: the gathered A's source rows of g_y (mA; tma_a is None)
        tile_counter,  # None (the static walk), or the dynamic walk's counter
    ):
        atoms = (tma_a, tma_bh, tma_bs)
        if cutlass.const_expr(row_src is not None):
            atoms, mA = (tma_bh, tma_bs), (mA, row_src)  # GatherRowsMixin.partition_loads takes the pair
        if cutlass.const_expr(self.epilogue == "smem"):
            atoms = atoms + (tma_ld_gate, tma_ld_up, tma_st_gg, tma_st_gu, tma_st_hw)
        self.warp_specialized(KernelParams(
            atoms=atoms, tma_a=tma_a, mA=mA, b_operands=[(tma_bh, mBh, 0), (tma_bs, mBs, 0)],
            b_buffers=("sB",), home_rings=(0,), slot_rings=(1,), a_smem_staged=a_smem_staged,
            b_smem_staged=b_smem_staged, epi_smem_staged=epi_smem_staged, tiled_mma=tiled_mma,
            cu_seqlens=cu_seqlens, num_n_tiles=num_n_tiles, num_tiles=num_tiles, row_w=row_w,
            mGate=mGate, mUp=mUp, mGG=mGG, mGU=mGU, mHW=mHW, mPart=mPart,
            tma_ld_gate=tma_ld_gate, mLdGate=mLdGate, tma_ld_up=tma_ld_up, mLdUp=mLdUp, tma_st_gg=tma_st_gg,
            mStGG=mStGG, tma_st_gu=tma_st_gu, mStGU=mStGU, tma_st_hw=tma_st_hw, mStHW=mStHW,
            tile_counter=tile_counter,
        ))

    @cute.jit
    def consumer_setup(self, p, mma_tidx, thr_mma, sC):
        """The thread's slice of the output tiles (element coordinates, see wgrad), the accumulator,
        the per-row partial sums and the registers gate/up are loaded into (the shared-memory
        epilogue: its own state, ``smem_epilogue_setup``)."""
        thr_c = p.tiled_mma.get_slice(mma_tidx)  # per-thread slice: element coordinates (see wgrad)
        n_rows = cute.size(p.mGate, mode=[0])
        dims = (n_rows, cute.size(p.mGate, mode=[1]))
        tile_c = (self.tile_m, self.tile_n)
        gGate = cute.local_tile(p.mGate, tile_c, (None, None))
        gUp = cute.local_tile(p.mUp, tile_c, (None, None))
        gGG = cute.local_tile(p.mGG, tile_c, (None, None))
        gGU = cute.local_tile(p.mGU, tile_c, (None, None))
        gHW = cute.local_tile(p.mHW, tile_c, (None, None))
        cC = cute.local_tile(cute.make_identity_tensor(dims), tile_c, (None, None))
        acc = cute.make_rmem_tensor(thr_c.partition_C(gGate[(None, None, 0, 0)]).shape, self.acc_dtype)
        part_sums = cute.make_rmem_tensor(len(self.row_first), self.acc_dtype)
        batch = (2, 2, self.epi_batch_chunks, 1)  # one epilogue batch of 8-column chunks (swiglu_bwd_batch)
        rG = cute.make_rmem_tensor(batch, cutlass.BFloat16)  # gate, then g_gate, then h_w
        rU = cute.make_rmem_tensor(batch, cutlass.BFloat16)  # up, then g_up
        c = KernelParams(thr_c=thr_c, n_rows=n_rows, dims=dims, gGate=gGate, gUp=gUp, gGG=gGG, gGU=gGU, gHW=gHW,
                         cC=cC, acc=acc, part_sums=part_sums, rG=rG, rU=rU, last_row=n_rows - 1)
        if cutlass.const_expr(self.epilogue == "smem"):
            c.sC, c.mma_tidx = sC, mma_tidx
            c = self.smem_epilogue_setup(p, c)
        return c

    @cute.jit
    def consume_tile(self, p, c, warp_idx, mainloop, read_state, release_state, tCrA: cute.Tensor, tCrBs,
                     info, turn, epi_count: cutlass.Int32):
        """One output tile (its coordinates: ``tile_info``): the dgrad MMA, the SwiGLU backward epilogue, the
        rows' partial sums (``epi_count``: the warp group's sub-tiles so far in the shared-memory epilogue;
        passed through by the register epilogue)."""
        m_idx, n_idx, k_count = self.tile_work(p, info)  # past the last group: d = 0
        if cutlass.const_expr(self.epilogue == "smem"):
            t = self.smem_epilogue_tiles(p, c, m_idx, n_idx)
            self.smem_epilogue_prefetch(p, c, t, warp_idx, epi_count)  # gate/up load under the mainloop
        read_state, release_state = self.mma_k_tiles(  # the other warp group's mainloop runs under the epilogue
            p, mainloop, read_state, release_state, [c.acc], tCrA, tCrBs, k_count, turn
        )
        thr_c, acc, rG, rU, part_sums = c.thr_c, c.acc, c.rG, c.rU, c.part_sums
        coords = thr_c.partition_C(c.cC[(None, None, m_idx, n_idx)])
        if cutlass.const_expr(self.epilogue == "smem"):
            part_sums.fill(0.0)
            self.smem_epilogue(p, c, t, warp_idx, epi_count, coords)
            epi_count = epi_count + t.epi_tiles
        else:
            tCgG = thr_c.partition_C(c.gGate[(None, None, m_idx, n_idx)])
            tCgU = thr_c.partition_C(c.gUp[(None, None, m_idx, n_idx)])
            tCgGG = thr_c.partition_C(c.gGG[(None, None, m_idx, n_idx)])
            tCgGU = thr_c.partition_C(c.gGU[(None, None, m_idx, n_idx)])
            tCgHW = thr_c.partition_C(c.gHW[(None, None, m_idx, n_idx)])

            part_sums.fill(0.0)
            if self.is_full_tile(m_idx, n_idx, c.dims):
                self.swiglu_bwd_epilogue(acc, coords, rG, rU, tCgG, tCgU, tCgGG, tCgGU, tCgHW, p.row_w,
                                         c.last_row, c.dims, True, part_sums)
            else:
                self.swiglu_bwd_epilogue(acc, coords, rG, rU, tCgG, tCgU, tCgGG, tCgGU, tCgHW, p.row_w,
                                         c.last_row, c.dims, False, part_sums)
        self.store_part_sums(p, c, coords, n_idx)
        return read_state, release_state, epi_count

    @cute.jit
    def store_part_sums(self, p, c, coords: cute.Tensor, n_idx):
        """The rows' partial sums of the tile into ``part[:, n_idx]``: the four lanes of a quad hold the
        same rows, so reduce over them and lane 0 of the quad writes."""
        lane = cute.arch.lane_idx()
        part_sums = c.part_sums
        mPart = p.mPart  # a local: the DSL carries what a dynamic branch writes into
        for j in cutlass.range_constexpr(len(self.row_first)):
            s = part_sums[j]
            s = s + cute.arch.shuffle_sync_bfly(s, offset=1)
            s = s + cute.arch.shuffle_sync_bfly(s, offset=2)
            r = coords[self.row_first[j]][0]
            if (lane % 4 == 0) & (r < c.n_rows):
                mPart[r, n_idx] = s

    @cute.jit
    def consumer_tail(self, c, warp_idx):
        """The register epilogue: nothing to wait for (no TMA stores). The shared-memory one: the warp
        group's storing warp waits until its last TMA stores have read shared memory."""
        if cutlass.const_expr(self.epilogue == "smem"):
            if warp_idx % 4 == 0:
                cute.arch.cp_async_bulk_wait_group(0, read=True)


class GroupGemmSwigluBwdGatherSm90(gather.GatherRowsMixin, GroupGemmSwigluBwdSm90):
    """The SwiGLU-backward dgrad with a gathered A operand: row r of A is ``g_out[row_src[r]]``, a zero
    row where ``row_src[r] < 0`` (``gather``: cp.async by the producer warp group; W_down by TMA as in the
    plain kernel). At R = 1 combine's backward would write g_y = g_out[row_src]: this reads it in place.
    Bitwise the plain kernel's outputs for ``g_y = where(row_src >= 0, g_out[row_src], 0)``: the A stages
    hold the same bytes in the same layout; mainloop, pingpong schedule and epilogue are the plain
    kernel's (the producer warp group, all four warps of it, loads; its 56 registers come from the two
    consumer warp groups, 224 each)."""

    def __init__(self, config: GroupGemmConfig):
        # the shared-memory epilogue only (the default, and the one compiled and tested here): the register
        # epilogue's batches were sized for 232 consumer registers and the gather leaves 224
        super().__init__(config, "smem")
        self._init_gather()
        if self.tile_n > 160:
            # a wider tile's accumulators need the plain kernel's 240 consumer registers (sm_90a, 128 x 192: at 224
            # ptxas spilled, at 232 40-108 B); the producers' K-major gather fits in 24 (none spilled)
            self.load_regs, self.mma_regs = 24, 240

    @cute.jit
    def __call__(
        self,
        g_out: cute.Tensor,  # (S, H)
        row_src: cute.Tensor,  # (N,) int32: A row r is g_out[row_src[r]], zero when row_src[r] < 0
        w_home: cute.Tensor,  # (epn, F, H)
        w_slot: cute.Tensor,  # (B, F, H)
        cu_seqlens: cute.Tensor,  # (G,) int32
        row_w: cute.Tensor,  # (N,) fp32
        gate: cute.Tensor,  # (N, F) bf16
        up: cute.Tensor,  # (N, F) bf16
        g_gate: cute.Tensor,  # (N, F) bf16 out
        g_up: cute.Tensor,  # (N, F) bf16 out
        h_w: cute.Tensor,  # (N, F) bf16 out
        part: cute.Tensor,  # (N, ceil(F / tile_n)) fp32 out
        tile_counter: cute.Tensor,  # (1,) int32, zero: the dynamic walk's counter (unused by the static walk)
        stream: cuda.CUstream,
    ):
        self._launch(g_out, w_home, w_slot, cu_seqlens, row_w, gate, up, g_gate, g_up, h_w, part, tile_counter, stream,
                     row_src=row_src)


def swiglu_bwd_row_quads(tile_m: int = 128, tile_n: int = 128) -> dict:
    """CPU check of the SwiGLU-backward epilogue's row reduction (layout algebra at trace time only).

    The kernel sums ``d * h`` per accumulator element into one register per static row slot
    (``row_slot``), then over the four lanes of a quad (xor shuffles 1 and 2), and lane 0 of the quad
    writes the row. Correct iff, for every consumer thread: the elements of a slot share one row
    (``row_first`` names it), the lanes of a quad hold the same rows, and a quad's elements of a row
    cover all ``tile_n`` columns once. Returns the number of violations of each and the counts checked.
    """
    from csrc_cute.compile_check import expect_no_driver

    kernel = GroupGemmSwigluBwdSm90(GroupGemmConfig(tile_m, tile_n, 1))
    per_thread: list[list[tuple[int, int]]] = []

    @cute.jit
    def probe():
        kernel._setup_mainloop()
        kernel._row_slots()
        tile = cute.make_identity_tensor((tile_m, tile_n))
        per_thread.extend(partition_coords(lambda t: kernel.tiled_mma.get_slice(t).partition_C(tile),
                                           kernel.tile_mma_threads))

    with expect_no_driver():
        cute.compile(probe)
    slot, first = kernel.row_slot, kernel.row_first
    bad_slot = sum(1 for el in per_thread for i, (r, _) in enumerate(el) if r != el[first[slot[i]]][0])
    bad_quad, bad_cover = 0, 0
    for t, el in enumerate(per_thread):
        rows = sorted({r for r, _ in el})
        quad = [per_thread[(t & ~3) + q] for q in range(4)]
        if any(sorted({r for r, _ in q}) != rows for q in quad):
            bad_quad += 1
        for r in rows:
            cols = [c for q in quad for rr, c in q if rr == r]
            if sorted(cols) != list(range(tile_n)):
                bad_cover += 1
    return dict(threads=len(per_thread), bad_slot=bad_slot, bad_quad=bad_quad, bad_cover=bad_cover,
                slots=len(first))


def swiglu_bwd_smem_subtile_layout(tile_m: int = 128, tile_n: int = 128) -> dict:
    """CPU check of the shared-memory epilogue's element pairing (layout algebra at trace time only):
    for every thread of a warp group and every chunk e the threads compute at a time (64 x ``epi_math_n``: a
    whole 64 x 32 sub-tile, or half of one past 160 columns), element v of the chunk MMA's partition of the chunk
    (offset by the chunk's origin) must be the (row, column) of the accumulator's element ``first(e) + v``
    (``smem_epilogue_math``). Returns the mismatches and counts."""
    from csrc_cute.compile_check import expect_no_driver


    kernel = GroupGemmSwigluBwdSm90(GroupGemmConfig(tile_m, tile_n, 1), epilogue="smem")
    acc_el: list = []
    sub_el: list = []

    @cute.jit
    def probe():
        kernel._setup_mainloop()
        epi_mma = sm90_utils.make_trivial_tiled_mma(
            kernel.ab_dtype, kernel.ab_dtype, kernel.a_layout.sm90_mma_major_mode(),
            kernel.b_layout.sm90_mma_major_mode(), kernel.acc_dtype, (1, 1, 1), tiler_mn=kernel.epi_math_tile,
        )
        tile = cute.make_identity_tensor((tile_m, tile_n))
        sub = cute.make_identity_tensor(kernel.epi_math_tile)
        n = kernel.tile_mma_threads
        acc_el.extend(partition_coords(lambda t: kernel.tiled_mma.get_slice(t).partition_C(tile), n))
        sub_el.extend(partition_coords(lambda t: epi_mma.get_slice(t).partition_C(sub), n))

    with expect_no_driver():
        cute.compile(probe)
    sub_m, sub_n = kernel.epi_math_tile
    per_row = tile_n // sub_n
    n_sub = (tile_m // sub_m) * per_row
    per_block = len(acc_el[0]) // (tile_m // sub_m)
    size = len(sub_el[0])
    bad = 0
    for acc, sub in zip(acc_el, sub_el):
        for e in range(n_sub):
            r0, c0 = (e // per_row) * sub_m, (e % per_row) * sub_n
            first = (e // per_row) * per_block + (e % per_row) * size
            bad += sum(1 for v in range(size) if (sub[v][0] + r0, sub[v][1] + c0) != acc[first + v])
    return dict(threads=len(acc_el), subtiles=n_sub, per_subtile=size, covered=n_sub * size == len(acc_el[0]),
                mismatches=bad)
