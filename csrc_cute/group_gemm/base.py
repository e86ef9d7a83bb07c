"""The part every grouped-GEMM kernel shares (Hopper, sm_90a, CuTe DSL): warp roles and register
budgets, the TMA -> mbarrier ring feeding ``wgmma`` (A and B from shared memory, fp32 accumulators),
the producer's and the consumers' k-tile loops, the bf16 registers -> shared (stmatrix) -> global (TMA
store) epilogue, and ``warp_specialized``: the one producer/consumer skeleton each kernel's
``kernel`` body runs, with the kernel family's hooks (``load_tile``, ``consumer_setup``,
``consume_tile``, ``consumer_tail``). Consumers are cooperative (the warp groups share each tile) or,
for a family that asks for it, pingpong (each warp group computes whole tiles, every other one, the
mainloops taking turns: ``consume_alternate_tiles``).

Warp group 0 is the producer (its warp 0 issues the TMA loads of the A and B tiles into a multi-stage
shared-memory ring guarded by mbarriers); warp groups 1.. are consumers (``wgmma`` bf16 x bf16 ->
fp32); register budgets are rebalanced with ``setmaxnreg``.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.utils import LayoutEnum

from .b_loads import BTileLoads
from .config import GroupGemmConfig
from .walk import TileWalk


class GroupGemmSm90Base(BTileLoads, TileWalk):
    """What every grouped-GEMM kernel shares (see the module docstring). A kernel family chooses the
    operand majorness, the tile scheduler (``scheduler``) and the epilogue through the hooks of
    ``warp_specialized``."""

    threads_per_wg = 128
    tile_k = 64
    buffer_align = 1024
    # named barriers: 1 the cooperative TMA-store epilogue's, 2-3 the pingpong mainloop turns, 4-5 each
    # pingpong warp group's epilogue
    pingpong_epi_barrier_base = 4
    # whether the kernel may run in clusters of two CTAs sharing each A tile (``GroupGemmConfig.cluster_n``):
    # the families whose A is loaded by TMA and whose tile walk ``cta_tiles`` / the scheduler drive set it
    multicast_a = False
    # whether the kernel may run in clusters of two CTAs sharing each B tile (``GroupGemmConfig.cluster_m``): the
    # families whose B loads use the atoms' own descriptors (not a remote group's) and whose two CTAs of a
    # cluster walk tiles of one group and one n tile (the row kernels' ``pair_tile``, the wgrads' ``work_item``)
    multicast_b = False
    # whether the kernel may take its tiles from the dynamic walk (``GroupGemmConfig.dynamic``)
    dynamic_walk = True

    def _init_common(self, config: GroupGemmConfig, a_layout, b_layout, reserved_smem: int,
                     pingpong: bool = False):
        self.tile_m, self.tile_n = config.tile_m, config.tile_n
        self.num_sms = config.num_sms
        self.band_m, self.tall_m_major = config.band_m, config.tall_m_major
        self.cluster_n, self.cluster_m = config.cluster_n, config.cluster_m
        self.cluster_size = self.cluster_n * self.cluster_m
        self.dynamic = config.dynamic
        if self.cluster_n > 1 and not self.multicast_a:
            raise ValueError(
                f"{type(self).__name__}: GroupGemmConfig.cluster_n must be 1 for this kernel (got "
                f"{self.cluster_n}): only the forward, dgrad, dgrad2, row-scale and wgrad kernels run in clusters "
                f"(their A tiles shared by TMA multicast)"
            )
        if self.cluster_m > 1 and not self.multicast_b:
            raise ValueError(
                f"{type(self).__name__}: GroupGemmConfig.cluster_m must be 1 for this kernel (got "
                f"{self.cluster_m}): only the forward, dgrad, dgrad2, row-scale, fused SwiGLU, SwiGLU-backward "
                f"and wgrad kernels share their B tiles in clusters (TMA multicast)"
            )
        if self.dynamic and not self.dynamic_walk:
            raise ValueError(f"{type(self).__name__}: GroupGemmConfig.dynamic must be False for this kernel (its "
                             f"producer walks the tiles statically)")
        self.ab_dtype = cutlass.BFloat16
        self.acc_dtype = cutlass.Float32
        # Cooperative: the consumer warp groups share each tile, 64 rows each. Pingpong: two consumer
        # warp groups take alternate tiles, each a whole tile, so that one's epilogue runs while the
        # other's wgmma keeps the tensor cores busy (for epilogues too heavy to hide otherwise).
        self.pingpong = pingpong
        self._init_walk(config)
        self.num_mma_wg = 2 if pingpong else self.tile_m // 64
        self.atom_layout_mnk = (1, 1, 1) if pingpong else (self.num_mma_wg, 1, 1)
        self.num_threads = (1 + self.num_mma_wg) * self.threads_per_wg
        self.num_mma_threads = self.num_mma_wg * self.threads_per_wg
        # the consumer threads that compute one tile (and release its ring stages)
        self.tile_mma_threads = self.threads_per_wg if pingpong else self.num_mma_threads
        self.load_regs = 40
        self.mma_regs = 232 if self.num_mma_wg == 2 else 240
        self.a_layout = a_layout
        self.b_layout = b_layout
        smem_capacity = utils.get_smem_capacity_in_bytes("sm_90")
        a_bytes = self.tile_m * self.tile_k * 2
        b_bytes = self.tile_n * self.tile_k * 2
        self.ab_stage = min(8, (smem_capacity - 2048 - reserved_smem) // (a_bytes + b_bytes))

    @property
    def mma_tile_n(self) -> int:
        """The B columns of one ring stage, which one wgmma batch multiplies: the tile's (a family whose
        tile computes two products of one A tile may widen it: the fused SwiGLU's gate and up)."""
        return self.tile_n

    def _setup_mainloop(self):
        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype,
            self.ab_dtype,
            self.a_layout.sm90_mma_major_mode(),
            self.b_layout.sm90_mma_major_mode(),
            self.acc_dtype,
            self.atom_layout_mnk,
            tiler_mn=(64, self.mma_tile_n),
        )
        self.tile_mnk = (self.tile_m, self.tile_n, self.tile_k)
        self.a_smem_staged = sm90_utils.make_smem_layout_a(
            self.a_layout, self.tile_mnk, self.ab_dtype, self.ab_stage
        )
        # b_smem_staged: a ring stage as the MMA reads it; b_load_staged: what one B load writes into it
        # (the same unless mma_tile_n widens the stage, which then holds several tile_n-column loads)
        self.b_load_staged = sm90_utils.make_smem_layout_b(
            self.b_layout, self.tile_mnk, self.ab_dtype, self.ab_stage
        )
        self.b_smem_staged = self.b_load_staged
        if self.mma_tile_n != self.tile_n:
            self.b_smem_staged = widened_b_stages(
                self.b_layout, self.tile_n, self.mma_tile_n, self.tile_k, self.ab_dtype, self.ab_stage
            )

    def _init_tma_store_epilogue(self, tile_m: int, pingpong: bool = False) -> int:
        """bf16 C [N, out] (N-major) stored registers -> shared (stmatrix) -> global (TMA) in
        sub-tiles of all consumer warp groups' rows (or, ``pingpong``, 64 of one warp group's rows) x 32
        columns: a ring of ``epi_stage`` sub-tile slots per storing group
        (the cooperative consumers together; each pingpong warp group on its own, with its own
        slots, named barrier and storing warp, since the two epilogues may overlap). Returns the
        shared memory of the slots (reserved before the mainloop stages are sized)."""
        self.c_dtype = cutlass.BFloat16
        self.c_layout = LayoutEnum.ROW_MAJOR
        # a pingpong warp group's accumulators run along N first, then over its two 64-row blocks, so
        # its sub-tiles are 64 rows high (sub-tile e = 64-row block e // (tile_n / 32), columns
        # 32 (e % (tile_n / 32)) on: contiguous accumulator registers, as ``acc_subtile_to_bf16`` reads)
        self.epi_tile = (64 if pingpong else tile_m, 32)
        self.epi_groups = 2 if pingpong else 1
        # pingpong: 3 slots a warp group, so that a 128 x 192 tile's ring has 5 stages in the 227 KB of shared
        # memory, not 4 (QuACK's pingpong tile runs 5): under ncu the layer step's three gathered wgrads took
        # 0.5-1.0% and its row-scaled forward 0.35-0.5% fewer cycles, A/B on one H200 in two machines' runs
        # (results/ncu_layer_session27_variants.json; docs/design-notes.md, session 27)
        self.epi_stage = 3 if pingpong else 4
        return self.epi_tile[0] * self.epi_tile[1] * 2 * self.epi_stage * self.epi_groups

    def _setup_tma_store_epilogue(self):
        self.epi_smem_staged = sm90_utils.make_smem_layout_epi(
            self.c_dtype, self.c_layout, self.epi_tile, self.epi_stage * self.epi_groups
        )

    def _weights_as_b(self, w):
        """Weights ``[E, Kd, Nd]`` viewed (N, K, E) as wgmma reads B (modes ``self.b_modes``)."""
        return cute.make_tensor(w.iterator, cute.select(w.layout, mode=self.b_modes))

    def _tma_load_a(self, a):
        """TMA atom (and its tensor) loading (tile_m, tile_k) tiles of ``a`` into one A stage; in a cluster
        (``cluster_n`` = 2) each CTA loads its share of the tile's rows into every CTA of the cluster."""
        op = cpasync.CopyBulkTensorTileG2SOp() if self.cluster_n == 1 else cpasync.CopyBulkTensorTileG2SMulticastOp()
        return cpasync.make_tiled_tma_atom(
            op, a, cute.slice_(self.a_smem_staged, (None, None, 0)), (self.tile_m, self.tile_k),
            num_multicast=self.cluster_n,
        )

    def _tma_load_b(self, b):
        """TMA atom (and its tensor) loading (tile_n, tile_k) tiles of ``b`` into one B stage; in a cluster
        sharing B (``cluster_m`` = 2) each CTA loads its share of the tile's columns into every CTA of it."""
        op = cpasync.CopyBulkTensorTileG2SOp() if self.cluster_m == 1 else cpasync.CopyBulkTensorTileG2SMulticastOp()
        return cpasync.make_tiled_tma_atom(
            op, b, cute.slice_(self.b_load_staged, (None, None, 0)), (self.tile_n, self.tile_k),
            num_multicast=self.cluster_m,
        )

    def _tma_load_weights(self, w_home, w_slot):
        """The TMA loads of one home/slot weight pair as B: (the home weights viewed as B, which a
        remote group's descriptor is rebuilt from; home atom, home tensor; slot atom, slot tensor)."""
        home_view = self._weights_as_b(w_home)
        return (home_view, *self._tma_load_b(home_view), *self._tma_load_b(self._weights_as_b(w_slot)))

    def _tma_store_c(self, c):
        """TMA atom (and its tensor) storing epilogue sub-tiles from one shared slot into ``c``."""
        return cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), c, cute.slice_(self.epi_smem_staged, (None, None, 0)),
            self.epi_tile,
        )

    def _row_tiles(self, a, c, cu_seqlens=None):
        """(#n tiles, #tiles) of the output ``c`` of a row-grouped kernel with A operand ``a``, counted in
        the tiles the persistent walk hands out: with ``cluster_n`` = 2 a tile is a pair of neighbouring n
        tiles (the cluster's, ``cta_tiles``); with ``cluster_m`` = 2 the M tiles come in pairs of one group
        (``RowTileScheduler.pair_tile``), at most (#M tiles + G + 1) / 2 of them with G = len(``cu_seqlens``)."""
        num_m_tiles = cute.ceil_div(cute.size(a, mode=[0]), self.tile_m)
        if self.cluster_m > 1:
            num_m_tiles = (num_m_tiles + cute.size(cu_seqlens, mode=[0]) + 1) // 2
        num_n_tiles = cute.ceil_div(cute.size(c, mode=[1]), self.tile_n * self.cluster_n)
        return num_n_tiles, num_m_tiles * num_n_tiles

    def _make_shared_storage(self, b_buffers=("sB",), with_c: bool = False, epi_barriers: int = 0):
        """The kernel's shared memory: the ring's mbarriers, the A stages, one B ring per name in
        ``b_buffers``, ``with_c`` the epilogue's sub-tile ring (buffers 1024-byte aligned) and
        ``epi_barriers`` mbarriers of an epilogue that loads operands by TMA (``epi_mbar``)."""

        def buffer(dtype, staged):
            return cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(staged)], self.buffer_align]

        fields = {
            "mbar": cute.struct.MemRange[cutlass.Int64, self.ab_stage * 2],
            "sA": buffer(self.ab_dtype, self.a_smem_staged),
        }
        for name in b_buffers:
            fields[name] = buffer(self.ab_dtype, self.b_smem_staged)
        if with_c:
            fields["sC"] = buffer(self.c_dtype, self.epi_smem_staged)
        if epi_barriers:
            fields["epi_mbar"] = cute.struct.MemRange[cutlass.Int64, epi_barriers]
        fields.update(self.walk_fields())
        self.shared_storage = cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    def _launch_persistent(self, kernel, num_tiles, stream):
        """Launch ``kernel`` (a ``self.kernel(...)`` call) on min(#tiles, #SMs) persistent CTAs, or in clusters
        (``cluster_n`` or ``cluster_m`` = 2) on min(#tiles, #SMs / 2) clusters of two CTAs (#tiles counts the
        clusters' tiles)."""
        units = cutlass.min(num_tiles, self.num_sms // self.cluster_size)  # CTAs, or clusters of two CTAs
        clustered = {} if self.cluster_size == 1 else dict(cluster=[self.cluster_size, 1, 1])
        kernel.launch(
            grid=[units if self.cluster_size == 1 else units * self.cluster_size, 1, 1],
            block=[self.num_threads, 1, 1],
            min_blocks_per_mp=1,
            stream=stream,
            **clustered,
        )

    @cute.jit
    def warp_roles(self):
        """(thread, first tile, tile stride (``cta_tiles``), warp, warp group) indices; warp and warp group
        warp-uniform."""
        tidx, _, _ = cute.arch.thread_idx()
        bidx, gdim = self.cta_tiles()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // self.threads_per_wg)
        return tidx, bidx, gdim, warp_idx, wg_idx

    @cute.jit
    def cta_tiles(self):
        """(first tile, tile stride) of this CTA's persistent walk over the kernel's tiles: its block index
        and the grid size, or in clusters its cluster's index and the number of clusters (both CTAs of a
        cluster walk the same tiles, each computing its own n tile, or M tile, of the pair: ``cluster_rank``)."""
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        if cutlass.const_expr(self.cluster_size > 1):
            bidx, gdim = bidx // self.cluster_size, gdim // self.cluster_size
        return bidx, gdim

    @cute.jit
    def cluster_rank(self):
        """This CTA's index in its cluster (0 without clusters): its n tile (``cluster_n``) or M tile
        (``cluster_m``) within the cluster's pair. Clusters are two CTAs along x (``_launch_persistent``), so the
        block index's parity, which the cluster CTA id register also holds: read from that register, the pair
        walk's lone-tile n tile made ptxas spill 8 B of the 128 x 192 SwiGLU backward (sm_90a, session 39)."""
        rank = 0
        if cutlass.const_expr(self.cluster_size > 1):
            rank = cutlass.Int32(cute.arch.block_idx()[0]) % 2
        return rank

    @cute.jit
    def prefetch_tma_descriptors(self, warp_idx, atoms):
        """Warp 0 prefetches the TMA descriptors, so the first copies do not wait for them."""
        if warp_idx == 0:
            for atom in atoms:
                cpasync.prefetch_descriptor(atom)

    @cute.jit
    def shared_tensors(self, a_smem_staged, b_smem_staged, b_buffers, epi_smem_staged=None):
        """Allocates ``self.shared_storage`` and creates the mainloop pipeline (and the dynamic walk's ring,
        ``make_walk``) on its mbarriers; returns (pipeline, sA, [sB per name in ``b_buffers``], sC or None,
        the storage, the walk)."""
        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        mainloop = self.make_mainloop_pipeline(
            storage.mbar.data_ptr(), a_smem_staged, b_smem_staged, len(b_buffers)
        )
        walk = self.make_walk(storage)
        pipeline.pipeline_init_arrive(cluster_shape_mn=(self.cluster_m, self.cluster_n), is_relaxed=True)
        sA = storage.sA.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
        sBs = [getattr(storage, name).get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
               for name in b_buffers]
        sC = None
        if cutlass.const_expr(epi_smem_staged is not None):
            sC = storage.sC.get_tensor(epi_smem_staged.outer, swizzle=epi_smem_staged.inner)
        return mainloop, sA, sBs, sC, storage, walk

    @cute.jit
    def b_load_views(self, sBs):
        """The shared B stages the B loads fill (``b_operands`` index them): the B rings themselves, unless a
        family's wider stage (``mma_tile_n``) takes several loads."""
        return sBs

    @cute.jit
    def partition_loads(self, tma_a: cute.CopyAtom, mA: cute.Tensor, sA: cute.Tensor, b_operands):
        """TMA views of this CTA's mainloop loads: A as (TMA, RestM, RestK) and (TMA, stage), and per
        B operand (atom, tensor, shared ring) the ``BTileLoad`` that ``load_k_tiles`` takes
        (``partition_b_loads``); also the number of k tiles."""
        tAgA, tAsA, k_tiles = self.partition_a_loads(tma_a, mA, sA)
        return tAgA, tAsA, self.partition_b_loads(b_operands), k_tiles

    @cute.jit
    def partition_a_loads(self, tma_a: cute.CopyAtom, mA: cute.Tensor, sA: cute.Tensor):
        """TMA views of this CTA's A loads, (TMA, RestM, RestK) and (TMA, stage), and A's number of k tiles
        (in a cluster: this CTA's share of each tile, multicast to the cluster by ``load_k_tiles``)."""
        gA = cute.local_tile(mA, (self.tile_m, self.tile_k), (None, None))
        tAsA, tAgA = cpasync.tma_partition(
            tma_a, self.cluster_rank(), cute.make_layout(self.cluster_n), cute.group_modes(sA, 0, 2),
            cute.group_modes(gA, 0, 2)
        )
        return tAgA, tAsA, cute.size(gA, mode=[3])

    @cute.jit
    def mma_operands(self, tiled_mma: cute.TiledMma, tidx, wg_idx, sA: cute.Tensor, sBs):
        """Consumer warp groups: raise the register budget, then (consumer thread index, the warp
        group's MMA slice, A fragment, [B fragment per ring], read and release pipeline states)."""
        cute.arch.setmaxregister_increase(self.mma_regs)
        if cutlass.const_expr(self.pingpong):
            mma_tidx = (tidx - self.threads_per_wg) % self.threads_per_wg  # each warp group: a whole tile
            thr_mma = tiled_mma.get_slice(0)
        else:
            mma_tidx = tidx - self.threads_per_wg
            wg_layout = cute.make_layout(self.num_mma_wg, stride=self.threads_per_wg)
            thr_mma = tiled_mma.get_slice(wg_layout(wg_idx - 1))
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrBs = [tiled_mma.make_fragment_B(thr_mma.partition_B(sB)) for sB in sBs]
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)  # off for a tile's first k block (p.first_mma)
        read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stage)
        release_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stage)
        return mma_tidx, thr_mma, tCrA, tCrBs, read_state, release_state

    @cute.jit
    def make_tma_store_epilogue(self, tiled_mma: cute.TiledMma, mma_tidx, sC: cute.Tensor):
        """Consumers' side of the registers -> shared (stmatrix) -> global (TMA) epilogue: the
        register -> shared copy (``retile`` maps accumulators onto it), this thread's slots of the
        shared sub-tile ring, its fp32 and bf16 sub-tile registers, the storing group's named
        barrier, the TMA store pipeline and the group's first slot (``epi_slot``)."""
        tiled_copy_r2s = self.make_r2s_copy(tiled_mma)
        thr_copy_r2s = tiled_copy_r2s.get_slice(mma_tidx)
        tRS_sD = thr_copy_r2s.partition_D(sC)
        rD_shape = cute.shape(thr_copy_r2s.partition_S(sC))
        tRS_rD = cute.make_rmem_tensor(rD_shape[:3], self.acc_dtype)
        tRS_rOut = cute.make_rmem_tensor(rD_shape[:3], self.c_dtype)
        slot0 = 0
        if cutlass.const_expr(self.pingpong):
            wg = cute.arch.make_warp_uniform(cute.arch.warp_idx()) // 4 - 1
            epi_bar = WarpGroupBarrier(self.pingpong_epi_barrier_base + wg, self.threads_per_wg)
            slot0 = wg * self.epi_stage
        else:
            epi_bar = pipeline.NamedBarrier(barrier_id=1, num_threads=self.num_mma_threads)
        store_pipe = pipeline.PipelineTmaStore.create(
            num_stages=self.epi_stage,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.tile_mma_threads),
        )
        return tiled_copy_r2s, tRS_sD, tRS_rD, tRS_rOut, epi_bar, store_pipe, slot0

    def make_r2s_copy(self, tiled_mma: cute.TiledMma):
        """The epilogue's register -> shared copy (stmatrix) of ``tiled_mma``'s accumulators, bf16."""
        copy_atom_r2s = sm90_utils.get_smem_store_op(
            self.c_layout, elem_ty_d=self.c_dtype, elem_ty_acc=self.acc_dtype
        )
        copy_atom_c = cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(self.c_layout.is_m_major_c(), 4), self.c_dtype
        )
        return cute.make_tiled_copy_S(copy_atom_r2s, cute.make_tiled_copy_C_atom(copy_atom_c, tiled_mma))

    def epi_slot(self, slot0, count):
        """The shared slot of a storing group's sub-tile ``count`` (counted over its tiles)."""
        return slot0 + count % self.epi_stage if self.pingpong else count % self.epi_stage

    def is_epi_store_warp(self, warp_idx):
        """Whether ``warp_idx`` issues its storing group's TMA stores: the first warp of the first
        consumer warp group (cooperative) or of each (pingpong; warp 0 is the producer's)."""
        return warp_idx % 4 == 0 if self.pingpong else warp_idx == 4

    @cute.jit
    def partition_epilogue(self, tma_c: cute.CopyAtom, sC: cute.Tensor, gC_tile: cute.Tensor):
        """A (tile_m, tile_n) output tile cut into epi_tile sub-tiles for the TMA store: (shared slots,
        global sub-tiles, number of sub-tiles, sub-tile index -> coordinate layout)."""
        gC_epi = cute.zipped_divide(gC_tile, self.epi_tile)
        bSG_sD, bSG_gD = cpasync.tma_partition(
            tma_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2), gC_epi
        )
        epi_shape = gC_epi.shape[1]
        return bSG_sD, bSG_gD, cute.size(gC_epi, mode=[1]), cute.make_layout(epi_shape, stride=(epi_shape[1], 1))

    @cute.jit
    def store_acc_tile(self, p, c, warp_idx, gC_tile: cute.Tensor, epi_count: cutlass.Int32):
        """The accumulators (``c.tRS_rAcc``) of one output tile -> bf16 -> ``gC_tile``, sub-tile by
        sub-tile through the storing group's shared slots (``c``: ``make_tma_store_epilogue``'s registers,
        slots and barrier). Returns the storing group's sub-tile count after the tile."""
        bSG_sD, bSG_gD, epi_tiles, epi_layout = self.partition_epilogue(p.tma_c, c.sC, gC_tile)
        for e in cutlass.range_constexpr(epi_tiles):
            self.acc_subtile_to_bf16(c.tRS_rAcc, e, c.tRS_rD, c.tRS_rOut)
            self.store_subtile(
                c.tiled_copy_r2s, c.tRS_rOut, c.tRS_sD, self.epi_slot(c.epi_slot0, epi_count + e), c.epi_bar,
                warp_idx, c.store_pipe, p.tma_c, bSG_sD, bSG_gD, epi_layout.get_hier_coord(e),
            )
        return epi_count + epi_tiles

    @cute.jit
    def acc_subtile_to_bf16(self, tRS_rAcc: cute.Tensor, e: cutlass.Constexpr, tRS_rD: cute.Tensor,
                            tRS_rOut: cute.Tensor):
        """Sub-tile ``e`` of the (retiled) fp32 accumulators -> bf16 registers ``tRS_rOut``."""
        size_rD = cute.size(tRS_rD)
        for v in cutlass.range_constexpr(size_rD):
            tRS_rD[v] = tRS_rAcc[e * size_rD + v]
        tRS_rOut.store(tRS_rD.load().to(self.c_dtype))

    @cute.jit
    def store_subtile(self, tiled_copy_r2s, vals: cute.Tensor, tRS_sD: cute.Tensor, buf, epi_bar,
                      warp_idx, store_pipe, tma_c, bSG_sD: cute.Tensor, bSG_gD: cute.Tensor, coord=None):
        """bf16 register sub-tile -> shared ring slot ``buf`` (stmatrix) -> global (TMA store) into
        sub-tile ``coord`` of ``bSG_gD``, or into ``bSG_gD`` itself when ``coord`` is None. (The
        forward slices the sub-tile in the storing warp, the SwiGLU kernel before the stmatrix copy:
        both as validated on the GPU, and the generated code differs.)"""
        cute.copy(tiled_copy_r2s, vals, tRS_sD[(None, None, None, buf)])
        cute.arch.fence_proxy("async.shared", space="cta")
        epi_bar.arrive_and_wait()
        if self.is_epi_store_warp(warp_idx):
            if cutlass.const_expr(coord is None):
                cute.copy(tma_c, bSG_sD[(None, buf)], bSG_gD)
            else:
                cute.copy(tma_c, bSG_sD[(None, buf)], bSG_gD[(None, coord)])
            store_pipe.producer_commit()
            store_pipe.producer_acquire()
        epi_bar.arrive_and_wait()

    @cute.jit
    def make_mainloop_pipeline(self, mbar_ptr, a_smem_staged, b_smem_staged, num_b_rings):
        a_smem = cute.slice_(a_smem_staged, (None, None, 0))
        b_smem = cute.slice_(b_smem_staged, (None, None, 0))
        tx_bytes = cute.size_in_bytes(self.ab_dtype, a_smem) + num_b_rings * cute.size_in_bytes(
            self.ab_dtype, b_smem
        )
        return self.ring_pipeline(mbar_ptr, tx_bytes)

    def ring_pipeline(self, mbar_ptr, tx_bytes, producers: int = 1, kind=pipeline.PipelineTmaAsync):
        """The A/B ring's pipeline (``kind``, e.g. the gathered kernels' ``TmaCpAsyncPipeline``): ``producers``
        arrivals and ``tx_bytes`` TMA bytes fill a stage. A stage is free once the consumers of every CTA that
        loads into it released it: one arrival per consumer warp of each CTA of the cluster (each CTA's A loads,
        or B loads, fill the stage in all of them)."""
        return kind.create(
            barrier_storage=mbar_ptr,
            num_stages=self.ab_stage,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, producers),
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, self.tile_mma_threads // 32 * self.cluster_size
            ),
            tx_count=tx_bytes,
            cta_layout_vmnk=cute.make_layout((1, self.cluster_m, self.cluster_n, 1)),
            defer_sync=True,
        )

    @cute.jit
    def load_k_tiles(
        self,
        mainloop,
        prod_state,
        tma_a: cute.CopyAtom,
        tAgA: cute.Tensor,  # (TMA, RestK) of this tile's A
        tAsA: cute.Tensor,  # (TMA, stage)
        b_loads,  # per B ring: the ``BTileLoad`` of this tile's B
        k_start: cutlass.Int32,
        k_count: cutlass.Int32,
        b_descs=None,  # None, or per B ring the global-memory descriptor its loads use instead of the atom's
        lone=None,  # in clusters sharing B: whether the tile is a lone one (``load_b_tile``)
    ):
        """Producer: TMA k tiles [k_start, k_start + k_count) of A and of every B into the ring, one
        mbarrier per stage for all of them."""
        if cutlass.const_expr(b_descs is None):
            b_descs = [None] * len(b_loads)
        # in a cluster each CTA's A loads (cluster_n) fill the stage in every CTA of it
        a_multicast = {}
        if cutlass.const_expr(self.cluster_n > 1):
            a_multicast = dict(mcast_mask=cutlass.Int16((1 << self.cluster_n) - 1))
        for k in cutlass.range(k_count, unroll=1):
            mainloop.producer_acquire(prod_state)
            bar = mainloop.producer_get_barrier(prod_state)
            cute.copy(tma_a, tAgA[(None, k_start + k)], tAsA[(None, prod_state.index)], tma_bar_ptr=bar,
                      **a_multicast)
            for b, desc in zip(b_loads, b_descs):
                self.load_b_tile(b, k_start + k, prod_state.index, bar, desc, lone)
            mainloop.producer_commit(prod_state)
            prod_state.advance()
        return prod_state

    @cute.jit
    def load_expert_tile(self, mainloop, prod_state, tma_a: cute.CopyAtom, tAgA: cute.Tensor, tAsA: cute.Tensor,
                         m_idx, n_idx, k_tiles: cutlass.Int32, rings, expert, descs=None, lone=None):
        """Producer: every k tile of output tile (m_idx, n_idx), with B from expert ``expert`` of the
        weights in ``rings`` (per B ring its ``BTileLoad``), through ``descs`` (descriptors in global
        memory, one per ring) when given; ``lone`` as ``load_b_tile``'s."""
        return self.load_k_tiles(
            mainloop, prod_state, tma_a, tAgA[(None, m_idx, None)], tAsA, [b.at(n_idx, expert) for b in rings],
            0, k_tiles, descs, lone,
        )


    @cute.jit
    def mma_stage(self, p, mainloop, read_state, accs, tCrA: cute.Tensor, tCrBs, first: bool = False,
                  rows=None):
        """Wait for ring stage ``read_state`` and commit its wgmma batch: every k block, every
        accumulator; ``first`` (a tile's first stage): its first k block overwrites the accumulators.
        ``rows`` (None: the whole stage): the stage's k rows that hold data, from its first; only the k
        blocks holding one are issued (a first stage issues its first k block whatever ``rows``), so
        the padding rows at a group's end cost no tensor-core time. Those k blocks are a loop, not a
        branch per count: wgmma in branches with different counts made ptxas serialise every wgmma of
        the kernel (C7515, "non wgmma instructions defining accumulator registers")."""
        mainloop.consumer_wait(read_state)
        num_kb = cute.size(tCrA, mode=[2])
        if cutlass.const_expr(rows is None):
            for kb in cutlass.range_constexpr(num_kb):
                self.issue_k_block(p.first_mma if cutlass.const_expr(first and kb == 0) else p.tiled_mma,
                                   read_state, accs, tCrA, tCrBs, kb)
        else:
            kb_rows = self.tile_k // num_kb
            blocks = cutlass.min(cutlass.max((rows + kb_rows - 1) // kb_rows, 0), num_kb)
            if cutlass.const_expr(first):
                self.issue_k_block(p.first_mma, read_state, accs, tCrA, tCrBs, 0)
            for kb in cutlass.range(1 if cutlass.const_expr(first) else 0, blocks, unroll=1):
                self.issue_k_block(p.tiled_mma, read_state, accs, tCrA, tCrBs, kb)
        warpgroup.commit_group()

    @cute.jit
    def issue_k_block(self, mma, read_state, accs, tCrA: cute.Tensor, tCrBs, kb):
        """The wgmma of k block ``kb`` of ring stage ``read_state`` into every accumulator."""
        coord = (None, None, kb, read_state.index)
        for acc, tCrB in zip(accs, tCrBs):
            cute.gemm(mma, acc, tCrA[coord], tCrB[coord], acc)

    @cute.jit
    def mma_k_tiles(self, p, mainloop, read_state, release_state, accs, tCrA: cute.Tensor, tCrBs,
                    k_count: cutlass.Int32, turn, k_rows=None):
        """Consumers: accs[i] = sum over k_count ring stages of A_k B_i,k for a tile (``turn``: its place in
        the CTA's walk, ``wait_mainloop_turn``) (one wgmma batch in
        flight; ``p`` the kernel's params: ``p.tiled_mma``, ``p.first_mma``); zeros without k tiles.
        ``k_rows`` (None: all): the tile's k rows that hold data, from its first; the stages' k blocks past
        them are not issued (``mma_stage``: the rows there are zeros, which add nothing). The
        first k block overwrites the accumulators (``p.first_mma``: ACCUMULATE off), so no wgmma reads the
        zeros: accumulated onto them, the second accumulator block's zero moves landed after the tile's
        first wgmma and ptxas waited for that one to complete before the next (sm_90a SASS of every
        kernel with two accumulator blocks a warp group, e.g. the 128 x 192 pingpong dgrad and the fused
        SwiGLU: a ``WARPGROUP.DEPBAR.LE gsb0, 0x0`` in each tile's first stage; the one-block kernels'
        SASS is unchanged by this). Pingpong: the mainloop takes its turn, waiting for it before its first
        wgmma and passing it as soon as its last batch is issued, so that the other warp group's first batch
        queues behind that one on the tensor cores instead of starting after it has drained (ncu of the
        128 x 192 dgrad that passed it after ``wait_group(0)``: tensor pipe active 94.3% of the cycles,
        QuACK's pingpong 99.5%; results/ncu_gemm_ab0de90.json)."""
        for acc in accs:  # what a tile without k tiles stores
            acc.fill(0.0)
        self.wait_mainloop_turn(turn)
        warpgroup.fence()
        n_pro = 1 if k_count > 0 else 0
        for k in cutlass.range(n_pro, unroll=1):
            self.mma_stage(p, mainloop, read_state, accs, tCrA, tCrBs, first=True, rows=k_rows)
            read_state.advance()
        if cutlass.const_expr(k_rows is None):
            read_state, release_state = self.mma_stages(p, mainloop, read_state, release_state, accs, tCrA, tCrBs,
                                                        n_pro, k_count)
        else:  # the stages whose rows all hold data, then the rest, each with its rows
            k_full = cutlass.min(cutlass.max(k_rows // self.tile_k, n_pro), k_count)
            read_state, release_state = self.mma_stages(p, mainloop, read_state, release_state, accs, tCrA, tCrBs,
                                                        n_pro, k_full)
            read_state, release_state = self.mma_stages(p, mainloop, read_state, release_state, accs, tCrA, tCrBs,
                                                        k_full, k_count, k_rows)
        self.pass_mainloop_turn(turn)
        warpgroup.wait_group(0)
        for k in cutlass.range(n_pro, unroll=1):
            mainloop.consumer_release(release_state)
            release_state.advance()
        return read_state, release_state

    @cute.jit
    def mma_stages(self, p, mainloop, read_state, release_state, accs, tCrA: cute.Tensor, tCrBs,
                   k_from: cutlass.Int32, k_to: cutlass.Int32, k_rows=None):
        """Consumers, within ``mma_k_tiles``: the tile's stages [k_from, k_to) after its first, each one's
        batch committed before the previous one's stage is released; ``k_rows`` as there."""
        for k in cutlass.range(k_from, k_to, unroll=1):
            rows = None
            if cutlass.const_expr(k_rows is not None):
                rows = k_rows - k * self.tile_k
            self.mma_stage(p, mainloop, read_state, accs, tCrA, tCrBs, rows=rows)
            warpgroup.wait_group(1)
            mainloop.consumer_release(release_state)
            release_state.advance()
            read_state.advance()
        return read_state, release_state

    @cute.jit
    def is_full_tile(self, m_idx, n_idx, dims):
        """Whether output tile (m_idx, n_idx) lies inside ``dims`` (no predication needed)."""
        return ((m_idx + 1) * self.tile_m <= dims[0]) & ((n_idx + 1) * self.tile_n <= dims[1])

    # ---------------------------------------------------------------- the warp-specialized skeleton

    @cute.jit
    def warp_specialized(self, p):
        """The kernel body every family runs. ``p`` (a ``KernelParams``) holds the kernel's arguments as the hooks
        read them; the scheduler's ``count_groups`` adds its group counts. Warp group 0 produces (``produce``,
        ``load_tiles``: the family's ``load_tile`` per tile), the others run the MMA over this CTA's tiles
        (``consume_tile`` per tile, after ``consumer_setup``, then ``consumer_tail``); the CTA's tiles are its
        walk's (``walk.TileWalk``)."""
        tidx, bidx, gdim, warp_idx, wg_idx = self.warp_roles()
        self.prefetch_tma_descriptors(warp_idx, p.atoms)
        self.count_groups(p)
        mainloop, sA, sBs, sC, storage, p.walk = self.shared_tensors(p.a_smem_staged, p.b_smem_staged,
                                                                     p.b_buffers, p.epi_smem_staged)
        p.storage = storage  # for a family's hooks that use more of it than sC (epilogue mbarriers)
        sB_loads = self.b_load_views(sBs)
        tAgA, tAsA, b_loads, k_tiles = self.partition_loads(
            p.tma_a, p.mA, sA, [(tma_b, mB, sB_loads[ring]) for tma_b, mB, ring in p.b_operands]
        )
        p.k_tiles = k_tiles
        # the MMA of a tile's first k block (mma_k_tiles), which overwrites the accumulators: ACCUMULATE off,
        # set here, outside every dynamic branch and loop, so that it dominates each use
        p.first_mma = p.tiled_mma.with_()
        p.first_mma.set(warpgroup.Field.ACCUMULATE, False)

        pipeline.pipeline_init_wait(cluster_shape_mn=(self.cluster_m, self.cluster_n))

        if wg_idx == 0:
            self.produce(warp_idx, mainloop, p, tAgA, tAsA, b_loads)
        else:
            mma_tidx, thr_mma, tCrA, tCrBs, read_state, release_state = self.mma_operands(
                p.tiled_mma, tidx, wg_idx, sA, sBs
            )
            c = self.consumer_setup(p, mma_tidx, thr_mma, sC)
            epi_count = cutlass.Int32(0)
            if cutlass.const_expr(self.pingpong):
                self.consume_alternate_tiles(p, c, warp_idx, wg_idx - 1, mainloop, tCrA, tCrBs, bidx, gdim)
            elif cutlass.const_expr(self.walked):
                self.consume_walked_tiles(p, c, warp_idx, mainloop, read_state, release_state, tCrA, tCrBs)
            else:
                for tile in cutlass.range(bidx, p.num_tiles, gdim, unroll=1):
                    read_state, release_state, epi_count = self.consume_tile(
                        p, c, warp_idx, mainloop, read_state, release_state, tCrA, tCrBs, self.tile_info(p, tile),
                        tile, epi_count
                    )
            self.consumer_tail(c, warp_idx)

    @cute.jit
    def consume_alternate_tiles(self, p, c, warp_idx, wg, mainloop, tCrA: cute.Tensor, tCrBs, bidx, gdim):
        """Pingpong consumers: warp group ``wg`` (0 or 1) computes every other tile of this CTA's walk (the
        producer loads them in that order into the one ring). A warp group passes over the other's ring
        stages without waiting on or releasing them: ``passed`` counts the ring stages before a tile (the
        k tiles of every earlier tile of the CTA, the scheduler's ``tile_stages``) and each tile starts from
        the pipeline state that many stages in. The family's ``consume_tile`` runs its mainloop as
        ``mma_k_tiles(p, ..., step)`` (a tile without one calls ``wait_mainloop_turn`` /
        ``pass_mainloop_turn`` itself), so the mainloops take turns and each epilogue runs under the other
        warp group's mainloop. Each warp group takes the coordinates of every tile of the CTA: from the walk's
        ring (``walk.TileWalk.consume_walked_alternate_tiles``), or, in an unscheduled static walk, computed
        itself (``tile_info``, under the other warp group's mainloop). Every mainloop passes the turn without
        asking whether a tile follows; after the walk's last step the warp group of the step after it takes
        that last turn, so the turn barriers end balanced."""
        if cutlass.const_expr(self.walked):
            steps = self.consume_walked_alternate_tiles(p, c, warp_idx, wg, mainloop, tCrA, tCrBs)
        else:
            epi_count = cutlass.Int32(0)
            passed = cutlass.Int32(0)
            steps = cutlass.Int32(0)
            for tile in cutlass.range(bidx, p.num_tiles, gdim, unroll=1):
                passed, epi_count = self.consume_alternate_step(p, c, warp_idx, wg, mainloop, tCrA, tCrBs,
                                                                self.tile_info(p, tile), steps, passed, epi_count)
                steps = steps + 1
        if steps % 2 == wg:
            self.wait_mainloop_turn(steps)

    @cute.jit
    def consume_alternate_step(self, p, c, warp_idx, wg, mainloop, tCrA: cute.Tensor, tCrBs, info, step,
                               passed, epi_count):
        """Pingpong warp group ``wg``: the ``step``-th tile of the CTA's walk (coordinates ``info``), computed
        where the step is of the warp group's parity, from the pipeline state ``passed`` stages in -> (the
        stages passed after the tile, the warp group's sub-tile count)."""
        start = self.consumer_state_at(passed)
        passed = passed + self.tile_stages(p, info)  # before the tile: no coordinate stays live over it
        if step % 2 == wg:
            _, _, epi_count = self.consume_tile(
                p, c, warp_idx, mainloop, start, start.clone(), tCrA, tCrBs, info, step, epi_count
            )
        return passed, epi_count

    @cute.jit
    def wait_mainloop_turn(self, turn):
        """Pingpong, before the mainloop of a tile (``turn``: the tile's step in the CTA's walk): wait until the
        other warp group has finished the mainloop of the CTA's previous tile. Without it a warp group would
        wait on ring stages more than one ring pass ahead of the loads, and an mbarrier wait sees only the phase
        parity: it would take the slot's previous pass for this one (on the H200: hangs and faults once a CTA
        had two tiles). Cooperative consumers: nothing."""
        if cutlass.const_expr(self.pingpong):
            if turn != 0:
                cute.arch.barrier(barrier_id=self.turn_barrier_id(turn), number_of_threads=2 * self.threads_per_wg)

    @cute.jit
    def pass_mainloop_turn(self, turn):
        """Pingpong, after the mainloop of a tile (``turn`` as ``wait_mainloop_turn``'s): let the other warp
        group start the CTA's next step (passed after every tile; ``consume_alternate_tiles`` balances the
        last). Cooperative consumers: nothing."""
        if cutlass.const_expr(self.pingpong):
            cute.arch.barrier_arrive(barrier_id=self.turn_barrier_id(turn + 1),
                                     number_of_threads=2 * self.threads_per_wg)

    @cute.jit
    def turn_barrier_id(self, step: cutlass.Int32):
        """The named barrier (2 or 3; 1 is the TMA-store epilogue's) the warp group of the CTA's ``step``-th
        tile waits on."""
        return 2 + step % 2

    @cute.jit
    def consumer_state_at(self, stages: cutlass.Int32):
        """The consumer pipeline state ``stages`` ring stages in (as that many ``advance()`` from the start)."""
        return pipeline.PipelineState(self.ab_stage, stages, stages % self.ab_stage, (stages // self.ab_stage) % 2)

    @cute.jit
    def produce(self, warp_idx, mainloop, p, tAgA: cute.Tensor, tAsA: cute.Tensor, b_loads):
        """Producer warp group: lowers its register budget; its warp 0 loads this CTA's tiles
        (``load_tiles``; the dynamic walk's writer) into the ring, then waits for the consumers to drain it; in
        the scheduled walk its warp 1 computes the tiles' coordinates (``walk.TileWalk.schedule_tiles``)."""
        cute.arch.setmaxregister_decrease(self.load_regs)
        if warp_idx == 0:
            prod_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stage)
            prod_state = self.load_tiles(mainloop, prod_state, p, tAgA, tAsA, b_loads, self.dynamic)
            mainloop.producer_tail(prod_state)
        if cutlass.const_expr(self.scheduled):
            if warp_idx == 1:
                self.schedule_tiles(p)

    @cute.jit
    def load_tiles(self, mainloop, prod_state, p, tAgA, tAsA, b_loads, is_writer):
        """Producer warp: over this CTA's tiles (the unscheduled static walk, or the ring's: the scheduled one or
        the dynamic one, whose writer ``is_writer`` is warp 0), each tile's loads (the scheduler's ``load_tile``)."""
        if cutlass.const_expr(self.walked):
            prod_state = self.load_walked_tiles(mainloop, prod_state, p, tAgA, tAsA, b_loads, is_writer)
        else:
            bidx, gdim = self.cta_tiles()
            for tile in cutlass.range(bidx, p.num_tiles, gdim, unroll=1):
                prod_state = self.load_tile(mainloop, prod_state, p, tAgA, tAsA, b_loads, self.tile_info(p, tile))
        return prod_state

    @cute.jit
    def consumer_tail(self, c, warp_idx):
        """After the consumers' last tile: the storing warp waits for its TMA stores to finish."""
        store_pipe = c.store_pipe  # a local: the DSL carries what a dynamic branch calls methods of
        if self.is_epi_store_warp(warp_idx):
            store_pipe.producer_tail()


@dsl_user_op
def tanh_approx(x, *, loc=None, ip=None) -> cutlass.Float32:
    """``tanh.approx.f32``: one MUFU instruction (``cute.math.tanh(fastmath=True)`` lowers to ex2 and
    rcp instead)."""
    return cutlass.Float32(llvm.inline_asm(
        T.f32(), [cutlass.Float32(x).ir_value(loc=loc, ip=ip)], "tanh.approx.f32 $0, $1;", "=f,f",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


def sigmoid_approx(x):
    """Trace time: sigmoid(x) = (1 + tanh(x / 2)) / 2 in fp32 with one MUFU instruction
    (``tanh_approx``) where 1 / (1 + 2^(-x log2 e)) takes two (``ex2``, ``rcp``): the SwiGLU epilogues
    issue one an element (the cooperative forward's with no mainloop overlapping it), and an SM's MUFU
    unit returns a quarter as many results a clock as its FMA pipe. Its ~2^-11 relative error is below
    the bf16 rounding of what the epilogues store."""
    half = cutlass.Float32(0.5)
    return half + half * tanh_approx(x * half)


def widened_b_stages(b_layout: LayoutEnum, load_n: int, tile_n: int, tile_k: int, dtype, stages: int):
    """B ring stages of ``tile_n`` columns tiled from the swizzle atom of a ``load_n``-column stage (the atom
    ``make_smem_layout_b`` picks by the size of the major mode), so that each ``load_n``-column slice of a
    stage is whole atoms, laid out as a ``load_n``-column load writes them. Why not ``make_smem_layout_b`` at
    ``tile_n``: it would pick the atom by ``tile_n``, and at ``load_n`` = 96 (N-major bf16) a 192-column
    stage's 128-byte atoms would cut the second load's columns in half."""
    k_major = b_layout.is_k_major_b()
    kind = sm90_utils.get_smem_layout_atom(b_layout, dtype, tile_k if k_major else load_n)
    return cute.tile_to_shape(warpgroup.make_smem_layout_atom(kind, dtype), (tile_n, tile_k, stages),
                              order=(0, 1, 2) if k_major else (1, 0, 2))


class WarpGroupBarrier:
    """A named barrier whose id is known on the device only (each pingpong warp group's own)."""

    def __init__(self, barrier_id, num_threads: int):
        self.barrier_id, self.num_threads = barrier_id, num_threads

    def arrive_and_wait(self):
        cute.arch.barrier(barrier_id=self.barrier_id, number_of_threads=self.num_threads)


class KernelParams:
    """The arguments of one kernel launch as ``warp_specialized`` and the hooks read them (set by the
    family's ``kernel``): ``atoms`` (TMA descriptors to prefetch), ``tma_a``/``mA``, ``b_operands``
    ((atom, tensor, index into ``b_buffers``) per B operand), ``b_buffers`` (shared B rings),
    ``a_smem_staged``/``b_smem_staged``/``epi_smem_staged`` (None: no TMA-store epilogue),
    ``tiled_mma``, ``num_tiles``, and whatever else the family's hooks need."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


def partition_coords(part_of, n: int) -> list[list[tuple[int, ...]]]:
    """Trace time (inside a ``cute.jit`` probe): the coordinates that ``part_of(t)``, a partition of an
    identity tensor for thread t < n, holds, in element order. Thread partitions of one TV layout share
    their layout and differ in their base coordinate only, so one partition is read element by element
    (DSL indexing costs ~1 ms an element) and each other one with the same layout adds its own base to
    those offsets; a partition with another layout is read element by element too. Used by the layout
    probes that the CPU tests run (a full read of every thread took 45 s for a 128 x 256 tile)."""

    def read(part):
        return [tuple(int(v) for v in part[i]) for i in range(cute.size(part))]

    first = part_of(0)
    layout = str(first.layout)
    coords = [read(first)]
    base0 = coords[0][0]
    offsets = [tuple(c - b for c, b in zip(crd, base0)) for crd in coords[0]]
    for t in range(1, n):
        part = part_of(t)
        if str(part.layout) != layout:
            coords.append(read(part))
            continue
        base = tuple(int(v) for v in part[0])
        coords.append([tuple(b + o for b, o in zip(base, off)) for off in offsets])
    return coords


def epilogue_pairing(kernel, sources) -> dict:
    """CPU check of a kernel's TMA-store epilogue registers (layout algebra at trace time only): for every
    consumer thread, sub-tile e of a (tile_m, tile_n) output tile and value v of the register -> shared
    copy (the (row, column) of the sub-tile that v holds, at the sub-tile's origin), each (sub-tile, column
    offset) in ``sources(e)`` names the retiled accumulator's sub-tile whose value v the epilogue reads
    (``acc_subtile_to_bf16``) and where that value must lie: at the (row, column + offset) of the
    accumulator's (tile_m, mma_tile_n) tile. Returns the mismatches and the counts checked."""
    from csrc_cute.compile_check import expect_no_driver

    acc_el: list = []
    sub_el: list = []

    @cute.jit
    def probe():
        kernel._setup_mainloop()
        r2s = kernel.make_r2s_copy(kernel.tiled_mma)
        acc = cute.make_identity_tensor((kernel.tile_m, kernel.mma_tile_n))
        sub = cute.make_identity_tensor(kernel.epi_tile)
        n = kernel.tile_mma_threads
        acc_el.extend(partition_coords(lambda t: r2s.retile(kernel.tiled_mma.get_slice(t).partition_C(acc)), n))
        sub_el.extend(partition_coords(lambda t: r2s.get_slice(t).partition_S(sub), n))

    with expect_no_driver():
        cute.compile(probe)
    sub_m, sub_n = kernel.epi_tile
    per_row = kernel.tile_n // sub_n
    n_sub = (kernel.tile_m // sub_m) * per_row
    size = len(sub_el[0])
    bad = reads = 0
    for acc, sub in zip(acc_el, sub_el):
        for e in range(n_sub):
            r0, c0 = (e // per_row) * sub_m, (e % per_row) * sub_n
            for chunk, offset in sources(e):
                reads += 1
                bad += sum(acc[chunk * size + v] != (sub[v][0] + r0, sub[v][1] + c0 + offset) for v in range(size))
    return dict(threads=len(acc_el), subtiles=n_sub, per_subtile=size,
                covered=reads // len(acc_el) * size == len(acc_el[0]), mismatches=int(bad))
