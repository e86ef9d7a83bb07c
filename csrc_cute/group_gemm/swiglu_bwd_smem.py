"""The shared-memory epilogue of the SwiGLU-backward dgrad (``GroupGemmSwigluBwdSm90(epilogue="smem")``).

The register epilogue (swiglu_bwd.py) reads the saved gate/up and writes g_gate, g_up, h_w straight
between global memory and the wgmma accumulator fragment: two adjacent bf16 columns per access, 4-byte
loads and stores that use half of each 32-byte sector. This one moves them through shared memory with
TMA instead (the idea of QuACK's sm90 epilogue, which loads its C operand and stores its outputs by TMA
through shared sub-tiles): per 64 x 32 sub-tile of a warp group's tile, TMA loads gate and up into
shared memory, each thread reads its accumulator elements' gate/up from there (where the tile is wider than
160 columns, in two 64 x 16 halves: ``epi_math_n``), computes exactly what
the register epilogue computes (``swiglu_bwd_values``, the same rounding points, the row sums in the
same order), writes g_gate and g_up over gate and up in place and h_w next to them, and one warp of the
warp group TMA-stores the three sub-tiles. Edge tiles need no path of their own: TMA zero-fills the
loads and clips the stores at the tensors' bounds, and the elements outside them add exactly +0 to the
row sums (W_down's rows past F and gate/up past their bounds are zero-filled, so there d = +0 and
h = +0: the accumulators start at +0 and a sum of +0 and -0 is +0).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync

from .base import KernelParams


class SwigluBwdSmemEpilogue:
    """The shared-memory epilogue's part of ``GroupGemmSwigluBwdSm90`` (pingpong: each consumer warp
    group owns whole tiles and has its own sub-tile buffers, mbarriers and named barrier, since the
    two warp groups' epilogues may overlap).

    Shared memory per warp group: ``epi_load_stages`` stages of three 64 x 32 bf16 sub-tiles
    (gate -> g_gate, up -> g_up, h_w) and one mbarrier per stage (the TMA loads' transaction count). Sub-tile
    ``count`` of a warp group (counted over its tiles: ``epi_count``) uses stage ``count % stages``.
    The first warp of the warp group issues the TMA traffic: the loads of a tile's first ``stages``
    sub-tiles before its mainloop (they do not depend on the accumulators), and after the stores of
    sub-tile s, once they have read the stage (bulk wait_group.read), the loads of sub-tile s + stages.
    """

    epi_load_stages = 2
    epi_buffers_per_stage = 3  # gate -> g_gate, up -> g_up, h_w

    @staticmethod
    def epi_math_n(tile_n: int) -> int:
        """The columns of a sub-tile the threads hold in registers at a time: all 32; 16 where the tile is wider
        than 160 columns, whose accumulators (tile_n / 2 fp32 registers a thread) leave no room for 32 columns'
        gate/up/h_w registers (sm_90a, 128 x 192: ptxas spilled 44-96 B with 32, none with 16; the gathered
        variant too, at the plain kernel's 240 consumer registers: ``GroupGemmSwigluBwdGatherSm90``). The TMA
        sub-tiles stay 32 columns wide: 64 x 16 ones (session 35's 128 x 192 kernel) doubled the sub-tile round
        trips and the DRAM reads (ncu: 4.0 -> 6.7 GB at 128 x 160) and took 1.07-1.29x the time at the power cap
        (session 36; results/bench_tiles_session36_h100_swiglu_bwd_experiments.json)."""
        return 32 if tile_n <= 160 else 16

    def _init_smem_epilogue(self, tile_n: int) -> int:
        """Epilogue sub-tiles (64 x 32), the threads' chunks of them (64 x ``epi_math_n``) and the stages of a
        tile ``tile_n`` wide; returns their shared memory (reserved before the mainloop stages are sized)."""
        self._init_tma_store_epilogue(64)
        self.epi_tile = (64, 32)
        self.epi_math_tile = (64, self.epi_math_n(tile_n))
        # the sub-tile slots of both consumer warp groups: (warp group, stage, buffer)
        self.epi_stage = 2 * self.epi_load_stages * self.epi_buffers_per_stage
        self.epi_load_bytes = 2 * self.epi_tile[0] * self.epi_tile[1] * 2  # gate and up sub-tiles, bf16
        return self.epi_tile[0] * self.epi_tile[1] * 2 * self.epi_stage + 8 * 2 * self.epi_load_stages

    def _smem_epilogue_atoms(self, gate, up, g_gate, g_up, h_w):
        """TMA atoms and tensors: loads of gate, up; stores of g_gate, g_up, h_w (one sub-tile each)."""
        self._setup_tma_store_epilogue()
        slot = cute.slice_(self.epi_smem_staged, (None, None, 0))
        loads = [cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), t, slot, self.epi_tile)
                 for t in (gate, up)]
        stores = [self._tma_store_c(t) for t in (g_gate, g_up, h_w)]
        return tuple(x for pair in loads + stores for x in pair)

    @cute.jit
    def smem_epilogue_setup(self, p, c):
        """Adds to the consumer state ``c``: the warp group's mbarriers (initialised here), its first
        slot and named barrier, the 64 x sub-tile-width MMA that partitions a sub-tile as the accumulator's
        elements of it, the thread's slices, the sub-tile registers and the TMA tensors' tiles."""
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = warp_idx // 4 - 1
        stages = self.epi_load_stages
        mbar = p.storage.epi_mbar.data_ptr() + wg * stages
        if warp_idx % 4 == 0:
            self.smem_epilogue_init_barriers(mbar)
        cute.arch.barrier(barrier_id=self.pingpong_epi_barrier_base + wg, number_of_threads=self.threads_per_wg)
        # The wgmma C fragment repeats per 8-column chunk, so a 64 x 32 (16) tiled MMA's partition of a
        # sub-tile (chunk) holds, element for element, the accumulator's 16 (8) elements of it (the CPU test
        # checks it: swiglu_bwd.swiglu_bwd_smem_subtile_layout)
        epi_mma = sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype, self.ab_dtype, self.a_layout.sm90_mma_major_mode(), self.b_layout.sm90_mma_major_mode(),
            self.acc_dtype, (1, 1, 1), tiler_mn=self.epi_math_tile,
        )
        thr_epi = epi_mma.get_slice(c.mma_tidx)
        sub_shape = thr_epi.partition_C(self.math_chunk(c.sC[(None, None, 0)], 0)).shape
        tile_c = (self.tile_m, self.tile_n)
        c.epi_mbar = mbar
        c.epi_slot0 = wg * stages * self.epi_buffers_per_stage
        c.epi_wg_barrier = self.pingpong_epi_barrier_base + wg
        c.thr_epi = thr_epi
        c.rG = cute.make_rmem_tensor(sub_shape, cutlass.BFloat16)  # gate, then g_gate
        c.rU = cute.make_rmem_tensor(sub_shape, cutlass.BFloat16)  # up, then g_up
        c.rHW = cute.make_rmem_tensor(sub_shape, cutlass.BFloat16)
        c.gLoads = [cute.local_tile(t, tile_c, (None, None)) for t in (p.mLdGate, p.mLdUp)]
        c.gStores = [cute.local_tile(t, tile_c, (None, None)) for t in (p.mStGG, p.mStGU, p.mStHW)]
        return c

    @cute.jit
    def smem_epilogue_init_barriers(self, mbar):
        """The warp group's first warp: its mbarriers, one arrival (the loads' issuer) each. (The
        helpers the warp's dynamic branches call are functions of their own: a dynamic branch may not
        bind new values.)"""
        with cute.arch.elect_one():
            for k in cutlass.range_constexpr(self.epi_load_stages):
                cute.arch.mbarrier_init(mbar + k, 1)
        cute.arch.mbarrier_init_fence()

    @cute.jit
    def smem_epilogue_tiles(self, p, c, m_idx, n_idx):
        """This tile's TMA views: (shared slots, [gate, up] sub-tiles, [g_gate, g_up, h_w] sub-tiles,
        #sub-tiles, sub-tile index -> coordinate)."""
        bS, _, epi_tiles, epi_layout = self.partition_epilogue(p.tma_ld_gate, c.sC, c.gLoads[0][(None, None, m_idx, n_idx)])
        loads = [self.partition_epilogue(tma, c.sC, g[(None, None, m_idx, n_idx)])[1]
                 for tma, g in zip((p.tma_ld_gate, p.tma_ld_up), c.gLoads)]
        stores = [self.partition_epilogue(tma, c.sC, g[(None, None, m_idx, n_idx)])[1]
                  for tma, g in zip((p.tma_st_gg, p.tma_st_gu, p.tma_st_hw), c.gStores)]
        return KernelParams(bS=bS, loads=loads, stores=stores, epi_tiles=epi_tiles, epi_layout=epi_layout)

    @cute.jit
    def smem_epilogue_load(self, p, c, t, e: cutlass.Constexpr, count):
        """The warp group's first warp: TMA loads of gate and up of sub-tile ``e`` into the stage of
        the warp group's sub-tile ``count``, on that stage's mbarrier."""
        k = count % self.epi_load_stages
        bar = c.epi_mbar + k
        slot = c.epi_slot0 + k * self.epi_buffers_per_stage
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(bar, self.epi_load_bytes)
        coord = t.epi_layout.get_hier_coord(e)
        for b, (tma, gT) in enumerate(zip((p.tma_ld_gate, p.tma_ld_up), t.loads)):
            cute.copy(tma, gT[(None, coord)], t.bS[(None, slot + b)], tma_bar_ptr=bar)

    @cute.jit
    def smem_epilogue_prefetch(self, p, c, t, warp_idx, epi_count):
        """Before a tile's mainloop: once the previous tile's stores have read their stages, the loads
        of this tile's first sub-tiles."""
        if warp_idx % 4 == 0:
            self.smem_epilogue_first_loads(p, c, t, epi_count)

    @cute.jit
    def smem_epilogue_first_loads(self, p, c, t, epi_count):
        cute.arch.cp_async_bulk_wait_group(0, read=True)
        cute.arch.sync_warp()
        for e in cutlass.range_constexpr(min(self.epi_load_stages, t.epi_tiles)):
            self.smem_epilogue_load(p, c, t, e, epi_count + e)

    @cute.jit
    def smem_epilogue(self, p, c, t, warp_idx, epi_count, coords: cute.Tensor):
        """Every sub-tile of the tile: wait for its gate/up, the math (``smem_epilogue_math``), then the
        TMA stores of g_gate, g_up, h_w and the loads of the sub-tile ``epi_load_stages`` ahead."""
        stages, nbuf = self.epi_load_stages, self.epi_buffers_per_stage
        chunks = self.epi_tile[1] // self.epi_math_tile[1]
        for e in cutlass.range_constexpr(t.epi_tiles):
            count = epi_count + e
            k = count % stages
            slot = c.epi_slot0 + k * nbuf
            cute.arch.mbarrier_wait(c.epi_mbar + k, (count // stages) % 2)
            for h in cutlass.range_constexpr(chunks):
                views = [c.thr_epi.partition_C(self.math_chunk(c.sC[(None, None, slot + b)], h)) for b in range(nbuf)]
                self.smem_epilogue_math(p, c, e * chunks + h, views, coords)
            cute.arch.fence_proxy("async.shared", space="cta")  # the stores read what the threads wrote
            cute.arch.barrier(barrier_id=c.epi_wg_barrier, number_of_threads=self.threads_per_wg)
            if warp_idx % 4 == 0:
                self.smem_epilogue_store(p, c, t, e, count, slot)

    @cute.jit
    def smem_epilogue_store(self, p, c, t, e: cutlass.Constexpr, count, slot):
        """The warp group's first warp: TMA stores of sub-tile ``e`` (g_gate, g_up, h_w from ``slot``
        on), then, once they have read the stage, the loads of the sub-tile ``epi_load_stages`` ahead."""
        coord = t.epi_layout.get_hier_coord(e)
        for b, tma in enumerate((p.tma_st_gg, p.tma_st_gu, p.tma_st_hw)):
            cute.copy(tma, t.bS[(None, slot + b)], t.stores[b][(None, coord)])
        cute.arch.cp_async_bulk_commit_group()
        if cutlass.const_expr(e + self.epi_load_stages < t.epi_tiles):
            cute.arch.cp_async_bulk_wait_group(0, read=True)  # the stage is free again
            cute.arch.sync_warp()
            self.smem_epilogue_load(p, c, t, e + self.epi_load_stages, count + self.epi_load_stages)

    def math_chunk(self, slot: cute.Tensor, h: cutlass.Constexpr) -> cute.Tensor:
        """Trace time: columns h * epi_math_n .. of a shared 64 x 32 sub-tile (the whole sub-tile where the
        threads compute all 32 columns at once)."""
        if self.epi_math_tile == self.epi_tile:
            return slot
        return cute.local_tile(slot, self.epi_math_tile, (0, h))

    def subtile_row_slots(self, first: int, sub: int) -> list[int]:
        """Trace time: the row slots of accumulator elements first .. first + sub - 1."""
        return sorted({self.row_slot[first + v] for v in range(sub)})

    @cute.jit
    def smem_epilogue_math(self, p, c, e: cutlass.Constexpr, views, coords: cute.Tensor):
        """Chunk ``e`` of the tile (64-row block e // (tile_n / w), columns w (e % (tile_n / w)) on, w =
        ``epi_math_n``; a whole sub-tile where w is its width): the thread's gate/up from shared memory, per
        element ``swiglu_bwd_values`` (as the register epilogue, accumulator elements in increasing order, so
        each row's sum adds in the same order), g_gate, g_up over gate, up and h_w into shared memory (an edge
        tile's elements outside the bounds add +0 to the row sums, see the module docstring; TMA clips the
        stores)."""
        acc, part_sums = c.acc, c.part_sums
        rG, rU, rHW = c.rG, c.rU, c.rHW
        sub = cute.size(rG)
        per_block = cute.size(acc) // cute.size(acc, mode=[1])
        per_row = self.tile_n // self.epi_math_tile[1]
        first = (e // per_row) * per_block + (e % per_row) * sub
        # the route weights of the chunk's rows (two per thread), read here rather than held for the
        # whole tile: four registers that a 160-column tile's consumers do not have (L1 hits)
        rws = {slot: self.row_weight(coords, p.row_w, slot, c.last_row) for slot in self.subtile_row_slots(first, sub)}
        cute.autovec_copy(views[0], rG)
        cute.autovec_copy(views[1], rU)
        for v in cutlass.range_constexpr(sub):
            i = first + v
            slot = self.row_slot[i]
            g_gate, g_up, h_w, dh = self.swiglu_bwd_values(acc[i], rG[v], rU[v], rws[slot])
            rG[v] = g_gate.to(cutlass.BFloat16)
            rU[v] = g_up.to(cutlass.BFloat16)
            rHW[v] = h_w.to(cutlass.BFloat16)
            part_sums[slot] = part_sums[slot] + dh
        cute.autovec_copy(rG, views[0])
        cute.autovec_copy(rU, views[1])
        cute.autovec_copy(rHW, views[2])

