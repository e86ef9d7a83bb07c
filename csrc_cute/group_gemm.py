"""Grouped GEMM for Hopper (sm_90a) in the CuTe DSL: forward, dgrad and (varlen-K) wgrad.

Semantics (the CPU references are ``moonep::group_gemm``, ``group_gemm_dgrad`` and ``group_gemm_wgrad``
in ``moonep_ops/ops.py``)::

    x [N, Kd] bf16, dy [N, Nd] bf16, w_home [epn, Kd, Nd] bf16, w_slot [B, Kd, Nd] bf16,
    cu_seqlens [G = epn + B] int32; group g = rows [cu[g-1], cu[g]) (cu[-1] = 0),
    W_g = w_home[g] if g < epn else w_slot[g - epn]
    forward  y[s:e]  = (x[s:e] @ W_g)    bf16, fp32 accumulation; rows at or past cu[G-1] are zero
    dgrad    dx[s:e] = (dy[s:e] @ W_g^T) bf16, likewise
    wgrad    home groups: dw_home[g] = x[s:e]^T @ dy[s:e] written, bf16 (fp32 accumulation; zeros if empty)
             slot groups: dw_slot[g - epn] += x[s:e]^T @ dy[s:e] fp32, in place; empty ones untouched

Forward and dgrad: one kernel class (``GroupGemmSm90``) with a static flag for the majorness of B. Every
group length is a multiple of the padding ``P``, so with ``tile_M`` dividing ``P`` each M tile of the
output lies in exactly one group: the kernel is a dense persistent GEMM over ``[N, red] x [red, out]`` in
which each M tile picks its B operand on the device. The tile's group is the number of group ends
``cu[g] <= m0`` (``m0`` = first row of the tile), counted by one warp with a ballot over ``cu_seqlens`` 32
entries at a time; each warp that needs it computes it itself (no host sync, no shared-memory hand-off).
A tile whose group index reaches ``G`` lies past the last group: no loads, no MMA, its accumulators stay
zero and the epilogue writes zeros. The grid depends only on ``N`` and the output width
(``min(#tiles, #SMs)`` persistent CTAs, tiles in M-major raster). The forward reads B = ``W_g`` viewed
``(Nd, Kd)``, N-major; dgrad reads B = ``W_g`` viewed ``(Kd, Nd)``, K-major (reduction over ``Nd``).

Wgrad (``GroupGemmWgradSm90``): per group g a GEMM with M = Kd, N = Nd and K = the group's rows;
A = ``x^T`` (M-major in memory) and B = ``dy^T`` (N-major), each read through one tensor map over all
rows: group g's k tiles are rows ``[cu[g-1], cu[g]) / 64`` (64 | P). Work items (group, m tile, n tile),
group-major, are strided over ``min(G * #m tiles * #n tiles, #SMs)`` persistent CTAs; each item's K extent
is read from ``cu_seqlens`` on the device. Every output tile belongs to one work item (no atomics). Home
items store bf16 through the row kernels' TMA-store epilogue (below) into ``dw_home`` viewed (Kd, Nd, epn)
(partial tiles clipped by the TMA bounds); an empty home group's items run with no k tiles and store
zeros. Slot items (the copies' fp32 reduce buffers) add the accumulators straight into ``dw_slot`` in
global memory (read-add-write, predicated on partial tiles); empty slot groups' items are skipped.

Shared by all three (``_GroupedGemmSm90Base``): warp group 0 is the producer (one warp issues TMA loads
of the A and B tiles into a multi-stage shared-memory ring guarded by mbarriers), warp groups 1.. are
consumers (``wgmma`` bf16 x bf16 -> fp32, A and B from shared memory); register budgets are rebalanced
with ``setmaxnreg``. The bf16 epilogue (forward/dgrad, the fused kernels' stored outputs, wgrad's home
groups) goes register -> shared (stmatrix) -> global (TMA store) in sub-tiles.

Inference: remote groups (``group_gemm_row_scale`` and ``group_gemm_swiglu`` with ``remote=``). Then
``G = epn + B + n_remote`` and remote group ``j = g - epn - B`` multiplies by expert ``e =
remote_experts[j]`` (global id; -1: an unused group) of its home rank ``h = e // epn``: ``W_g =
W_home(rank h)[e % epn]``, read straight from that rank's home weights through the peer mapping (their
device addresses ``peers[h]``, one array per projection; same shape and strides as ``w_home``). The
kernel variants with remote groups (separate compiled kernels; the kernels without are unchanged) give
the producer warp one more descriptor per B ring: at the CTA's first remote tile it copies the home
atom's TMA descriptor into the CTA's 128-byte slot of a global-memory workspace (allocated per launch
by the host wrapper), replaces its global address with ``peers[h]`` (``tensormap.replace``), fences
(``fence.proxy.tensormap::generic`` release, then acquire) and loads every remote tile through it
(``tma_desc_ptr``), with expert index ``e % epn``. Precondition: every remote expert of a launch comes
from one donor rank (the planner copies a rank's experts from one donor group). One descriptor per ring
and CTA then suffices and never changes while loads that use it are in flight; switching donors mid-
launch would need the ring drained before the descriptor is rewritten (the producer cannot tell when
the TMA unit has finished reading a descriptor for the loads already issued). A remote group whose
expert is -1 must be empty (the planner guarantees it; such rows are not a supported input).

Host side: ``group_gemm_fwd`` / ``group_gemm_dgrad`` / ``group_gemm_wgrad`` validate, compile once per
static key into ``_COMPILED`` (fake tensors, symbolic ``N``/``epn``/``B``/``G``, ``--enable-tvm-ffi``,
environment stream) and launch on torch's current stream. ``compile_group_gemm_for_sm90`` compiles any
of them on a CPU-only machine for CI (see ``compile_check``).
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch

__all__ = [
    "group_gemm_fwd",
    "group_gemm_swiglu",
    "group_gemm_row_scale",
    "select_swiglu_config",
    "compile_group_gemm_swiglu",
    "compile_group_gemm_row_scale",
    "group_gemm_swiglu_bwd",
    "select_swiglu_bwd_config",
    "compile_group_gemm_swiglu_bwd",
    "group_gemm_dgrad",
    "group_gemm_wgrad",
    "GroupGemmConfig",
    "select_config",
    "select_wgrad_config",
    "compile_group_gemm",
    "compile_group_gemm_dgrad",
    "compile_group_gemm_wgrad",
    "compile_group_gemm_for_sm90",
]


# ---------------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------------


class GroupGemmConfig(tuple):
    """Static tile configuration: (tile_m, tile_n, num_sms)."""

    def __new__(cls, tile_m: int, tile_n: int, num_sms: int):
        return super().__new__(cls, (int(tile_m), int(tile_n), int(num_sms)))

    tile_m = property(lambda self: self[0])
    tile_n = property(lambda self: self[1])
    num_sms = property(lambda self: self[2])


H100_H200_NUM_SMS = 132


def select_config(pad: int, nd: int, num_sms: int = H100_H200_NUM_SMS) -> GroupGemmConfig:
    """Pick the tile shape: tile_M divides the group padding P (128 if P >= 128, else 64)."""
    if not isinstance(pad, int) or pad < 16 or pad & (pad - 1):
        raise ValueError(f"P (pad) must be a power of two >= 16, got {pad!r}")
    tile_m = 128 if pad >= 128 else 64
    if pad < tile_m:
        raise ValueError(
            f"P (pad) = {pad} is smaller than the smallest supported tile_M ({tile_m}): every M tile "
            f"must lie inside one group, so group lengths must be multiples of {tile_m}"
        )
    tile_n = 256 if nd >= 256 else 128
    return GroupGemmConfig(tile_m, tile_n, num_sms)


# ---------------------------------------------------------------------------------------------------
# The kernel (imports of the DSL are deferred so that importing this module stays cheap)
# ---------------------------------------------------------------------------------------------------


def _build_kernel_classes():
    import cuda.bindings.driver as cuda

    import cutlass
    import cutlass.cute as cute
    import cutlass.pipeline as pipeline
    import cutlass.utils as utils
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass.cute.nvgpu import cpasync, warpgroup
    from cutlass.utils import LayoutEnum

    class _GroupedGemmSm90Base:
        """What the three kernels share: warp roles and register budgets, the TMA -> mbarrier ring
        feeding ``wgmma`` (A and B from shared memory, fp32 accumulators), the producer's and the
        consumers' k-tile loops, and the row -> group lookup. Subclasses choose the operand majorness,
        the tile scheduler and the epilogue."""

        threads_per_wg = 128
        tile_k = 64
        buffer_align = 1024

        def _init_common(self, config: GroupGemmConfig, a_layout, b_layout, reserved_smem: int):
            self.tile_m, self.tile_n = config.tile_m, config.tile_n
            self.num_sms = config.num_sms
            self.ab_dtype = cutlass.BFloat16
            self.acc_dtype = cutlass.Float32
            # Each consumer warp group owns 64 rows of the tile.
            self.num_mma_wg = self.tile_m // 64
            self.atom_layout_mnk = (self.num_mma_wg, 1, 1)
            self.num_threads = (1 + self.num_mma_wg) * self.threads_per_wg
            self.num_mma_threads = self.num_mma_wg * self.threads_per_wg
            self.load_regs = 40
            self.mma_regs = 232 if self.num_mma_wg == 2 else 240
            self.a_layout = a_layout
            self.b_layout = b_layout
            smem_capacity = utils.get_smem_capacity_in_bytes("sm_90")
            a_bytes = self.tile_m * self.tile_k * 2
            b_bytes = self.tile_n * self.tile_k * 2
            self.ab_stage = min(8, (smem_capacity - 2048 - reserved_smem) // (a_bytes + b_bytes))

        def _setup_mainloop(self):
            self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
                self.ab_dtype,
                self.ab_dtype,
                self.a_layout.sm90_mma_major_mode(),
                self.b_layout.sm90_mma_major_mode(),
                self.acc_dtype,
                self.atom_layout_mnk,
                tiler_mn=(64, self.tile_n),
            )
            self.tile_mnk = (self.tile_m, self.tile_n, self.tile_k)
            self.a_smem_staged = sm90_utils.make_smem_layout_a(
                self.a_layout, self.tile_mnk, self.ab_dtype, self.ab_stage
            )
            self.b_smem_staged = sm90_utils.make_smem_layout_b(
                self.b_layout, self.tile_mnk, self.ab_dtype, self.ab_stage
            )

        def _init_tma_store_epilogue(self, tile_m: int) -> int:
            """bf16 C [N, out] (N-major) stored registers -> shared (stmatrix) -> global (TMA) in
            sub-tiles of all consumer warp groups' rows x 32 columns. Returns the shared memory of the
            sub-tile ring (reserved before the mainloop stages are sized)."""
            self.c_dtype = cutlass.BFloat16
            self.c_layout = LayoutEnum.ROW_MAJOR
            self.epi_tile = (tile_m, 32)
            self.epi_stage = 4
            self.epi_store_warp = 4  # first warp of the first consumer warp group
            return self.epi_tile[0] * self.epi_tile[1] * 2 * self.epi_stage

        def _setup_tma_store_epilogue(self):
            self.epi_smem_staged = sm90_utils.make_smem_layout_epi(
                self.c_dtype, self.c_layout, self.epi_tile, self.epi_stage
            )

        def _weights_as_b(self, w):
            """Weights ``[E, Kd, Nd]`` viewed (N, K, E) as wgmma reads B (modes ``self.b_modes``)."""
            return cute.make_tensor(w.iterator, cute.select(w.layout, mode=self.b_modes))

        def _tma_load_a(self, a):
            """TMA atom (and its tensor) loading (tile_m, tile_k) tiles of ``a`` into one A stage."""
            return cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(), a, cute.slice_(self.a_smem_staged, (None, None, 0)),
                (self.tile_m, self.tile_k),
            )

        def _tma_load_b(self, b):
            """TMA atom (and its tensor) loading (tile_n, tile_k) tiles of ``b`` into one B stage."""
            return cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(), b, cute.slice_(self.b_smem_staged, (None, None, 0)),
                (self.tile_n, self.tile_k),
            )

        def _tma_store_c(self, c):
            """TMA atom (and its tensor) storing epilogue sub-tiles from one shared slot into ``c``."""
            return cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), c, cute.slice_(self.epi_smem_staged, (None, None, 0)),
                self.epi_tile,
            )

        def _row_tiles(self, a, c):
            """(#n tiles, #tiles) of the output ``c`` of a row-grouped kernel with A operand ``a``."""
            num_m_tiles = cute.ceil_div(cute.size(a, mode=[0]), self.tile_m)
            num_n_tiles = cute.ceil_div(cute.size(c, mode=[1]), self.tile_n)
            return num_n_tiles, num_m_tiles * num_n_tiles

        def _make_shared_storage(self, b_buffers=("sB",), with_c: bool = False):
            """The kernel's shared memory: the ring's mbarriers, the A stages, one B ring per name in
            ``b_buffers`` and, ``with_c``, the epilogue's sub-tile ring (buffers 1024-byte aligned)."""

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
            self.shared_storage = cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

        def _launch_persistent(self, kernel, num_tiles, stream):
            """Launch ``kernel`` (a ``self.kernel(...)`` call) on min(#tiles, #SMs) persistent CTAs."""
            kernel.launch(
                grid=[cutlass.min(num_tiles, self.num_sms), 1, 1],
                block=[self.num_threads, 1, 1],
                min_blocks_per_mp=1,
                stream=stream,
            )

        @cute.jit
        def warp_roles(self):
            """(thread, CTA, #CTAs, warp, warp group) indices; warp and warp group warp-uniform."""
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            gdim, _, _ = cute.arch.grid_dim()
            warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            wg_idx = cute.arch.make_warp_uniform(tidx // self.threads_per_wg)
            return tidx, bidx, gdim, warp_idx, wg_idx

        @cute.jit
        def prefetch_tma_descriptors(self, warp_idx, atoms):
            """Warp 0 prefetches the TMA descriptors, so the first copies do not wait for them."""
            if warp_idx == 0:
                for atom in atoms:
                    cpasync.prefetch_descriptor(atom)

        @cute.jit
        def shared_tensors(self, a_smem_staged, b_smem_staged, b_buffers, epi_smem_staged=None):
            """Allocates ``self.shared_storage`` and creates the mainloop pipeline on its mbarriers;
            returns (pipeline, sA, [sB per name in ``b_buffers``], sC or None)."""
            smem = cutlass.utils.SmemAllocator()
            storage = smem.allocate(self.shared_storage)
            mainloop = self.make_mainloop_pipeline(
                storage.mbar.data_ptr(), a_smem_staged, b_smem_staged, len(b_buffers)
            )
            pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)
            sA = storage.sA.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
            sBs = [getattr(storage, name).get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
                   for name in b_buffers]
            sC = None
            if cutlass.const_expr(epi_smem_staged is not None):
                sC = storage.sC.get_tensor(epi_smem_staged.outer, swizzle=epi_smem_staged.inner)
            return mainloop, sA, sBs, sC

        @cute.jit
        def partition_loads(self, tma_a: cute.CopyAtom, mA: cute.Tensor, sA: cute.Tensor, b_operands):
            """TMA views of this CTA's mainloop loads: A as (TMA, RestM, RestK) and (TMA, stage), and per
            B operand (atom, tensor, shared ring) the (atom, (TMA, RestN, RestK[, E]), (TMA, stage)) that
            ``load_k_tiles`` takes; also the number of k tiles."""
            gA = cute.local_tile(mA, (self.tile_m, self.tile_k), (None, None))
            gBs = [cute.local_tile(mB, (self.tile_n, self.tile_k), (None,) * cute.rank(mB))
                   for _, mB, _ in b_operands]
            tAsA, tAgA = cpasync.tma_partition(
                tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2)
            )
            b_loads = []
            for (tma_b, _, sB), gB in zip(b_operands, gBs):
                tBsB, tBgB = cpasync.tma_partition(
                    tma_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2)
                )
                b_loads.append((tma_b, tBgB, tBsB))
            return tAgA, tAsA, b_loads, cute.size(gA, mode=[3])

        @cute.jit
        def mma_operands(self, tiled_mma: cute.TiledMma, tidx, wg_idx, sA: cute.Tensor, sBs):
            """Consumer warp groups: raise the register budget, then (consumer thread index, the warp
            group's MMA slice, A fragment, [B fragment per ring], read and release pipeline states)."""
            cute.arch.setmaxregister_increase(self.mma_regs)
            mma_tidx = tidx - self.threads_per_wg
            wg_layout = cute.make_layout(self.num_mma_wg, stride=self.threads_per_wg)
            thr_mma = tiled_mma.get_slice(wg_layout(wg_idx - 1))
            tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
            tCrBs = [tiled_mma.make_fragment_B(thr_mma.partition_B(sB)) for sB in sBs]
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)  # accumulators are zero-filled per tile
            read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stage)
            release_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stage)
            return mma_tidx, thr_mma, tCrA, tCrBs, read_state, release_state

        @cute.jit
        def make_tma_store_epilogue(self, tiled_mma: cute.TiledMma, mma_tidx, sC: cute.Tensor):
            """Consumers' side of the registers -> shared (stmatrix) -> global (TMA) epilogue: the
            register -> shared copy (``retile`` maps accumulators onto it), this thread's slots of the
            shared sub-tile ring, its fp32 and bf16 sub-tile registers, the consumers' named barrier and
            the TMA store pipeline."""
            copy_atom_r2s = sm90_utils.get_smem_store_op(
                self.c_layout, elem_ty_d=self.c_dtype, elem_ty_acc=self.acc_dtype
            )
            copy_atom_c = cute.make_copy_atom(
                cute.nvgpu.warp.StMatrix8x8x16bOp(self.c_layout.is_m_major_c(), 4), self.c_dtype
            )
            tiled_copy_r2s = cute.make_tiled_copy_S(copy_atom_r2s, cute.make_tiled_copy_C_atom(copy_atom_c, tiled_mma))
            thr_copy_r2s = tiled_copy_r2s.get_slice(mma_tidx)
            tRS_sD = thr_copy_r2s.partition_D(sC)
            rD_shape = cute.shape(thr_copy_r2s.partition_S(sC))
            tRS_rD = cute.make_rmem_tensor(rD_shape[:3], self.acc_dtype)
            tRS_rOut = cute.make_rmem_tensor(rD_shape[:3], self.c_dtype)
            epi_bar = pipeline.NamedBarrier(barrier_id=1, num_threads=self.num_mma_threads)
            store_pipe = pipeline.PipelineTmaStore.create(
                num_stages=self.epi_stage,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_threads),
            )
            return tiled_copy_r2s, tRS_sD, tRS_rD, tRS_rOut, epi_bar, store_pipe

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
            if warp_idx == self.epi_store_warp:
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
            return pipeline.PipelineTmaAsync.create(
                barrier_storage=mbar_ptr,
                num_stages=self.ab_stage,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(
                    pipeline.Agent.Thread, self.num_mma_wg * 4
                ),
                tx_count=tx_bytes,
                cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
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
            b_loads,  # per B ring: (TMA atom, (TMA, RestK) of this tile's B, (TMA, stage))
            k_start: cutlass.Int32,
            k_count: cutlass.Int32,
            b_descs=None,  # None, or per B ring the global-memory descriptor its loads use instead of the atom's
        ):
            """Producer: TMA k tiles [k_start, k_start + k_count) of A and of every B into the ring, one
            mbarrier per stage for all of them."""
            if cutlass.const_expr(b_descs is None):
                b_descs = [None] * len(b_loads)
            for k in cutlass.range(k_count, unroll=1):
                mainloop.producer_acquire(prod_state)
                bar = mainloop.producer_get_barrier(prod_state)
                cute.copy(tma_a, tAgA[(None, k_start + k)], tAsA[(None, prod_state.index)], tma_bar_ptr=bar)
                for (tma_b, tBgB, tBsB), desc in zip(b_loads, b_descs):
                    cute.copy(tma_b, tBgB[(None, k_start + k)], tBsB[(None, prod_state.index)], tma_bar_ptr=bar,
                              tma_desc_ptr=desc)
                mainloop.producer_commit(prod_state)
                prod_state.advance()
            return prod_state

        @cute.jit
        def load_expert_tile(self, mainloop, prod_state, tma_a: cute.CopyAtom, tAgA: cute.Tensor, tAsA: cute.Tensor,
                             m_idx, n_idx, k_tiles: cutlass.Int32, rings, expert, descs=None):
            """Producer: every k tile of output tile (m_idx, n_idx), with B from expert ``expert`` of the
            weights in ``rings`` (per B ring: TMA atom, (TMA, RestN, RestK, experts), (TMA, stage)),
            through ``descs`` (descriptors in global memory, one per ring) when given."""
            return self.load_k_tiles(
                mainloop, prod_state, tma_a, tAgA[(None, m_idx, None)], tAsA,
                [(tma, tBgB[(None, n_idx, None, expert)], tBsB) for tma, tBgB, tBsB in rings],
                0, k_tiles, descs,
            )

        @cute.jit
        def load_row_tiles(
            self,
            warp_idx,
            mainloop,
            cu_seqlens: cute.Tensor,
            num_n_tiles: cutlass.Int32,
            num_tiles: cutlass.Int32,
            tma_a: cute.CopyAtom,
            tAgA: cute.Tensor,  # (TMA, RestM, RestK)
            tAsA: cute.Tensor,
            b_home,  # per B ring: (TMA atom, (TMA, RestN, RestK, epn), (TMA, stage)) of the home weights
            b_slot,  # the same for the slot weights (group g >= epn reads slot g - epn)
            k_tiles: cutlass.Int32,
            remote=None,  # None, or the remote groups' (remote_experts, [peers], [home B view], workspace)
        ):
            """Producer warp group of the row-grouped kernels: lowers its register budget, and its warp
            0 loads, over this CTA's tiles, all k tiles of A and of the B operand(s) of the tile's group;
            tiles past the last group load nothing. With ``remote`` the last groups are remote groups
            (``load_remote_row_tiles``)."""
            cute.arch.setmaxregister_decrease(self.load_regs)
            if warp_idx == 0:
                bidx, _, _ = cute.arch.block_idx()
                gdim, _, _ = cute.arch.grid_dim()
                num_groups = cute.size(cu_seqlens, mode=[0])
                num_home = cute.size(b_home[0][1], mode=[3])
                prod_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stage)
                if cutlass.const_expr(remote is None):
                    for tile in cutlass.range(bidx, num_tiles, gdim, unroll=1):
                        m_idx, n_idx, g = self.row_tile(cu_seqlens, tile, num_n_tiles)
                        load = (mainloop, prod_state, tma_a, tAgA, tAsA, m_idx, n_idx, k_tiles)
                        if g < num_home:
                            prod_state = self.load_expert_tile(*load, b_home, g)
                        elif g < num_groups:
                            prod_state = self.load_expert_tile(*load, b_slot, g - num_home)
                else:
                    prod_state = self.load_remote_row_tiles(
                        mainloop, prod_state, cu_seqlens, num_n_tiles, num_tiles, tma_a, tAgA, tAsA, b_home, b_slot,
                        k_tiles, remote,
                    )
                mainloop.producer_tail(prod_state)

        @cute.jit
        def load_remote_row_tiles(
            self,
            mainloop,
            prod_state,
            cu_seqlens: cute.Tensor,
            num_n_tiles: cutlass.Int32,
            num_tiles: cutlass.Int32,
            tma_a: cute.CopyAtom,
            tAgA: cute.Tensor,
            tAsA: cute.Tensor,
            b_home,
            b_slot,
            k_tiles: cutlass.Int32,
            remote,
        ):
            """``load_row_tiles`` (producer warp) with remote groups: groups [epn + B, G) are remote group
            j = g - epn - B, expert e = remote_experts[j], read from the donor's home weights ``peers[e //
            epn]`` (per B ring), expert index ``e % epn``. The loads of remote tiles go through a copy of
            the home atom's descriptor in this CTA's global-memory slot(s), with the donor's address,
            built once, at the CTA's first remote tile (``build_remote_descriptors``): every remote
            expert of a launch comes from one donor (the caller's precondition), so the descriptor
            never changes while loads that use it are in flight. A remote group whose expert is -1 (an
            unused group) must be empty."""
            remote_experts, peers, b_views, desc_ws = remote
            bidx, _, _ = cute.arch.block_idx()
            gdim, _, _ = cute.arch.grid_dim()
            num_groups = cute.size(cu_seqlens, mode=[0])
            num_home = cute.size(b_home[0][1], mode=[3])
            slot_end = num_groups - cute.size(remote_experts, mode=[0])
            desc_slots, descs = self.remote_descriptor_slots(desc_ws, len(b_home))
            donor = cutlass.Int32(-1)  # the donor rank of this CTA's remote descriptors; -1: not built yet
            for tile in cutlass.range(bidx, num_tiles, gdim, unroll=1):
                m_idx, n_idx, g = self.row_tile(cu_seqlens, tile, num_n_tiles)
                load = (mainloop, prod_state, tma_a, tAgA, tAsA, m_idx, n_idx, k_tiles)
                if g < num_home:
                    prod_state = self.load_expert_tile(*load, b_home, g)
                elif g < slot_end:
                    prod_state = self.load_expert_tile(*load, b_slot, g - num_home)
                elif g < num_groups:
                    e = remote_experts[g - slot_end]
                    if e >= 0:
                        if donor < 0:
                            donor = e // num_home
                            self.build_remote_descriptors(b_home, peers, b_views, desc_slots, descs, donor)
                        prod_state = self.load_expert_tile(*load, b_home, e % num_home, descs)
                    else:  # an unused group with rows (never in a valid plan): still fill the stages the
                        # consumers will wait for (out-of-bounds expert: TMA zero fill), so nothing hangs
                        prod_state = self.load_expert_tile(*load, b_home, num_home)
            return prod_state

        @cute.jit
        def remote_descriptor_slots(self, desc_ws: cute.Tensor, num_rings: cutlass.Constexpr):
            """This CTA's 128-byte, 128-byte-aligned slots (one per B ring) in the descriptor workspace
            (int64, 16 per slot, #CTAs x #rings slots, allocated per launch by the host), each as a
            (global, generic) pair of descriptor pointers: the descriptor is written through the first,
            the TMA loads take the second."""
            bidx, _, _ = cute.arch.block_idx()
            maps = utils.TensorMapManager(utils.TensorMapUpdateMode.GMEM, 128)
            slots = [desc_ws.iterator + (bidx * num_rings + r) * 16 for r in range(num_rings)]
            return ([maps.get_tensormap_ptr(p) for p in slots],
                    [maps.get_tensormap_ptr(p, cute.AddressSpace.generic) for p in slots])

        @cute.jit
        def build_remote_descriptors(self, b_home, peers, b_views, desc_slots, descs, donor: cutlass.Int32):
            """Producer warp (all lanes), once per CTA: per B ring, the home atom's descriptor copied
            into this CTA's slot (one elected lane: 128 bytes of stores) and its global address replaced
            by the donor's weights (``peers[donor]``, viewed like the home weights: same shape and
            strides; ``update_tma_descriptor`` elects its lane itself: ``tensormap.replace``). The warp
            barriers order the copy before the replacement and the replacement before the release
            fence; each lane then acquires the new descriptors (``fence.proxy.tensormap::generic``
            release / acquire), so whichever lane issues the TMA loads sees them."""
            with cute.arch.elect_one():
                for (tma, _, _), slot in zip(b_home, desc_slots):
                    cpasync.copy_tensormap(tma, slot)
            cute.arch.sync_warp()
            cute.arch.fence_acq_rel_cta()
            for (tma, _, _), ring_peers, view, slot in zip(b_home, peers, b_views, desc_slots):
                donor_b = cute.make_tensor(
                    cute.make_ptr(self.ab_dtype, ring_peers[donor], cute.AddressSpace.gmem, assumed_align=16),
                    view.layout,
                )
                cpasync.update_tma_descriptor(tma, donor_b, slot)
            cute.arch.sync_warp()
            cpasync.fence_tma_desc_release()
            for desc in descs:
                cpasync.fence_tma_desc_acquire(desc)

        @cute.jit
        def mma_stage(self, mainloop, read_state, tiled_mma: cute.TiledMma, accs, tCrA: cute.Tensor, tCrBs):
            """Wait for ring stage ``read_state`` and commit its wgmma batch: every k block, every
            accumulator."""
            mainloop.consumer_wait(read_state)
            for kb in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
                coord = (None, None, kb, read_state.index)
                for acc, tCrB in zip(accs, tCrBs):
                    cute.gemm(tiled_mma, acc, tCrA[coord], tCrB[coord], acc)
            warpgroup.commit_group()

        @cute.jit
        def mma_k_tiles(
            self,
            mainloop,
            read_state,
            release_state,
            tiled_mma: cute.TiledMma,
            accs,  # one fp32 accumulator per B ring
            tCrA: cute.Tensor,
            tCrBs,
            k_count: cutlass.Int32,
        ):
            """Consumers: accs[i] = sum over k_count ring stages of A_k B_i,k (one wgmma batch in
            flight). The caller sets the tiled MMA's ACCUMULATE field once, before its tile loop."""
            for acc in accs:
                acc.fill(0.0)
            warpgroup.fence()
            n_pro = 1 if k_count > 0 else 0
            for k in cutlass.range(n_pro, unroll=1):
                self.mma_stage(mainloop, read_state, tiled_mma, accs, tCrA, tCrBs)
                read_state.advance()
            for k in cutlass.range(n_pro, k_count, unroll=1):
                self.mma_stage(mainloop, read_state, tiled_mma, accs, tCrA, tCrBs)
                warpgroup.wait_group(1)
                mainloop.consumer_release(release_state)
                release_state.advance()
                read_state.advance()
            warpgroup.wait_group(0)
            for k in cutlass.range(n_pro, unroll=1):
                mainloop.consumer_release(release_state)
                release_state.advance()
            return read_state, release_state

        @cute.jit
        def row_tile(self, cu_seqlens: cute.Tensor, tile: cutlass.Int32, num_n_tiles: cutlass.Int32):
            """Tile ``tile`` of a row-grouped kernel (M-major raster) -> (m tile, n tile, group)."""
            m_idx = tile // num_n_tiles
            n_idx = tile % num_n_tiles
            return m_idx, n_idx, self.tile_group(cu_seqlens, m_idx * self.tile_m)

        @cute.jit
        def is_full_tile(self, m_idx, n_idx, dims):
            """Whether output tile (m_idx, n_idx) lies inside ``dims`` (no predication needed)."""
            return ((m_idx + 1) * self.tile_m <= dims[0]) & ((n_idx + 1) * self.tile_n <= dims[1])

        @cute.jit
        def tile_group(self, cu_seqlens: cute.Tensor, row0: cutlass.Int32) -> cutlass.Int32:
            """Index of the group holding row ``row0`` (== G when past the last group). One warp."""
            lane = cute.arch.lane_idx()
            num_groups = cute.size(cu_seqlens, mode=[0])
            g = cutlass.Int32(0)
            for base in cutlass.range(0, num_groups, 32, unroll=1):
                idx = base + lane
                hit = cutlass.Boolean(False)
                if idx < num_groups:
                    hit = cu_seqlens[idx] <= row0
                g = g + cute.arch.popc(cute.arch.vote_ballot_sync(hit))
            return g

    class GroupGemmSm90(_GroupedGemmSm90Base):
        """Row-grouped GEMM ``C[rows of g] = A[rows of g] @ op(W_g)`` (see the module docstring).

        ``b_k_major=False``: forward, ``op(W) = W`` (``[Kd, Nd]``, B N-major).
        ``b_k_major=True``: dgrad, ``op(W) = W^T`` (the reduction runs over ``Nd``, B K-major).
        """

        def __init__(self, config: GroupGemmConfig, b_k_major: bool = False, row_scale: bool = False):
            self.b_k_major = bool(b_k_major)
            # Forward only: scale each output row by row_w[row] (fp32) before the bf16 convert.
            self.row_scale = bool(row_scale)
            # B operand view (N, K, E) of the weights [E, Kd, Nd]: forward (Nd, Kd, E), dgrad (Kd, Nd, E).
            self.b_modes = [1, 2, 0] if self.b_k_major else [2, 1, 0]
            self._init_common(
                config,
                LayoutEnum.ROW_MAJOR,  # A [N, red]: K-major
                LayoutEnum.ROW_MAJOR if self.b_k_major else LayoutEnum.COL_MAJOR,
                self._init_tma_store_epilogue(config.tile_m),
            )

        @cute.jit
        def __call__(
            self,
            x: cute.Tensor,  # (N, red), red contiguous
            w_home: cute.Tensor,  # (epn, Kd, Nd), Nd contiguous
            w_slot: cute.Tensor,  # (B, Kd, Nd), Nd contiguous
            cu_seqlens: cute.Tensor,  # (G,) int32
            y: cute.Tensor,  # (N, out), out contiguous
            stream: cuda.CUstream,
        ):
            self._launch(x, w_home, w_slot, cu_seqlens, y, None, stream)

        @cute.jit
        def _launch(self, x, w_home, w_slot, cu_seqlens, y, row_w, stream, remote_experts=None, peers=None,
                    desc_ws=None):
            """Shared by the plain kernel (``row_w`` None) and the row-scaled one (``row_w`` (N,) fp32);
            with ``remote_experts`` (peers, descriptor workspace) the last groups are remote groups."""
            self._setup_mainloop()
            self._setup_tma_store_epilogue()
            tma_a, mA = self._tma_load_a(x)
            bh_view = self._weights_as_b(w_home)
            tma_bh, mBh = self._tma_load_b(bh_view)
            tma_bs, mBs = self._tma_load_b(self._weights_as_b(w_slot))
            tma_c, mC = self._tma_store_c(y)
            num_n_tiles, num_tiles = self._row_tiles(x, y)
            self._make_shared_storage(with_c=True)
            if cutlass.const_expr(remote_experts is None):
                bh_view = None
            self._launch_persistent(
                self.kernel(
                    tma_a, mA, tma_bh, mBh, tma_bs, mBs, tma_c, mC, cu_seqlens, row_w,
                    self.tiled_mma, self.a_smem_staged, self.b_smem_staged, self.epi_smem_staged,
                    num_n_tiles, num_tiles, remote_experts, peers, bh_view, desc_ws,
                ),
                num_tiles,
                stream,
            )

        @cute.kernel
        def kernel(
            self,
            tma_a: cute.CopyAtom,
            mA: cute.Tensor,
            tma_bh: cute.CopyAtom,
            mBh: cute.Tensor,
            tma_bs: cute.CopyAtom,
            mBs: cute.Tensor,
            tma_c: cute.CopyAtom,
            mC: cute.Tensor,
            cu_seqlens: cute.Tensor,
            row_w,  # None, or (N,) fp32: per-row output scale
            tiled_mma: cute.TiledMma,
            a_smem_staged: cute.ComposedLayout,
            b_smem_staged: cute.ComposedLayout,
            epi_smem_staged: cute.ComposedLayout,
            num_n_tiles: cutlass.Int32,
            num_tiles: cutlass.Int32,
            remote_experts,  # None, or (n_remote,) int32: the remote groups' global expert ids
            peers,  # None, or (R,) int64: each rank's home weights' address
            bh_view,  # None, or w_home viewed as B (the layout of a donor's weights)
            desc_ws,  # None, or the remote descriptors' workspace (int64, 16 per CTA)
        ):
            tidx, bidx, gdim, warp_idx, wg_idx = self.warp_roles()
            self.prefetch_tma_descriptors(warp_idx, (tma_a, tma_bh, tma_bs, tma_c))
            num_groups = cute.size(cu_seqlens, mode=[0])
            mainloop, sA, (sB,), sC = self.shared_tensors(a_smem_staged, b_smem_staged, ("sB",), epi_smem_staged)
            tAgA, tAsA, (load_bh, load_bs), k_tiles = self.partition_loads(
                tma_a, mA, sA, [(tma_bh, mBh, sB), (tma_bs, mBs, sB)]
            )
            gC = cute.local_tile(mC, (self.tile_m, self.tile_n), (None, None))  # (bM, bN, RestM, RestN)

            pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))

            if wg_idx == 0:
                remote = None
                if cutlass.const_expr(remote_experts is not None):
                    remote = (remote_experts, [peers], [bh_view], desc_ws)
                self.load_row_tiles(
                    warp_idx, mainloop, cu_seqlens, num_n_tiles, num_tiles, tma_a, tAgA, tAsA, [load_bh], [load_bs],
                    k_tiles, remote,
                )
            else:
                # ---------------- consumer warp groups ----------------
                mma_tidx, thr_mma, tCrA, (tCrB,), read_state, release_state = self.mma_operands(
                    tiled_mma, tidx, wg_idx, sA, [sB]
                )
                acc = cute.make_rmem_tensor(thr_mma.partition_C(gC).shape[:3], self.acc_dtype)

                tiled_copy_r2s, tRS_sD, tRS_rD, tRS_rOut, epi_bar, store_pipe = self.make_tma_store_epilogue(
                    tiled_mma, mma_tidx, sC
                )
                tRS_rAcc = tiled_copy_r2s.retile(acc)

                epi_count = cutlass.Int32(0)
                for tile in cutlass.range(bidx, num_tiles, gdim, unroll=1):
                    m_idx, n_idx, g = self.row_tile(cu_seqlens, tile, num_n_tiles)
                    # A tile past the last group: no MMA, its accumulators stay zero.
                    k_count = k_tiles if g < num_groups else 0
                    read_state, release_state = self.mma_k_tiles(
                        mainloop, read_state, release_state, tiled_mma, [acc], tCrA, [tCrB], k_count
                    )
                    if cutlass.const_expr(row_w is not None):
                        self.scale_rows(tiled_mma, mma_tidx, acc, row_w, m_idx * self.tile_m)

                    # ---- epilogue ----
                    bSG_sD, bSG_gD, epi_tiles, epi_layout = self.partition_epilogue(
                        tma_c, sC, gC[(None, None, m_idx, n_idx)]
                    )
                    for e in cutlass.range_constexpr(epi_tiles):
                        self.acc_subtile_to_bf16(tRS_rAcc, e, tRS_rD, tRS_rOut)
                        self.store_subtile(
                            tiled_copy_r2s, tRS_rOut, tRS_sD, (epi_count + e) % self.epi_stage, epi_bar,
                            warp_idx, store_pipe, tma_c, bSG_sD, bSG_gD, epi_layout.get_hier_coord(e),
                        )
                    epi_count = epi_count + epi_tiles
                if warp_idx == self.epi_store_warp:
                    store_pipe.producer_tail()

        @cute.jit
        def scale_rows(self, tiled_mma: cute.TiledMma, mma_tidx, acc: cute.Tensor, row_w: cute.Tensor,
                       row0: cutlass.Int32):
            """acc[i] *= row_w[row of acc[i]] (fp32), rows of the tile starting at ``row0``; rows past
            the end of ``row_w`` (the tail of a partial last tile, never stored) read its last entry. The
            rows come from the thread's slice of an identity tile (the same map the wgrad epilogue uses
            and its coverage test checks)."""
            coords = tiled_mma.get_slice(mma_tidx).partition_C(
                cute.make_identity_tensor((self.tile_m, self.tile_n))
            )
            last = cute.size(row_w, mode=[0]) - 1
            for i in cutlass.range_constexpr(cute.size(acc)):
                # clamped, branch-free: equal rows give equal addresses, so the loads are CSE'd
                acc[i] = acc[i] * row_w[cutlass.min(row0 + coords[i][0], last)]

    class GroupGemmRowScaleSm90(GroupGemmSm90):
        """Forward with a per-row scale in the epilogue: ``y[r] = (x[r] @ W_g) * row_w[r]`` (fp32 scale
        before the bf16 convert), e.g. the route weights in the down projection."""

        def __init__(self, config: GroupGemmConfig):
            super().__init__(config, b_k_major=False, row_scale=True)

        @cute.jit
        def __call__(
            self,
            x: cute.Tensor,  # (N, Kd)
            w_home: cute.Tensor,  # (epn, Kd, Nd)
            w_slot: cute.Tensor,  # (B, Kd, Nd)
            cu_seqlens: cute.Tensor,  # (G,) int32
            row_w: cute.Tensor,  # (N,) fp32
            y: cute.Tensor,  # (N, Nd)
            stream: cuda.CUstream,
        ):
            self._launch(x, w_home, w_slot, cu_seqlens, y, row_w, stream)

    class GroupGemmRowScaleRemoteSm90(GroupGemmRowScaleSm90):
        """The row-scaled forward whose last ``n_remote`` groups are remote groups (inference): remote
        group j reads expert ``e = remote_experts[j]`` from the home weights of rank ``e // epn``
        (``peers[e // epn]``, peer-mapped), index ``e % epn`` (see ``load_remote_row_tiles``)."""

        @cute.jit
        def __call__(
            self,
            x: cute.Tensor,  # (N, Kd)
            w_home: cute.Tensor,  # (epn, Kd, Nd)
            w_slot: cute.Tensor,  # (B, Kd, Nd)
            cu_seqlens: cute.Tensor,  # (G = epn + B + n_remote,) int32
            row_w: cute.Tensor,  # (N,) fp32
            y: cute.Tensor,  # (N, Nd)
            remote_experts: cute.Tensor,  # (n_remote,) int32, global expert ids (-1: unused group)
            peers: cute.Tensor,  # (R,) int64: address of rank r's home weights (epn, Kd, Nd)
            desc_ws: cute.Tensor,  # (16 * #SMs,) int64: one descriptor slot per CTA
            stream: cuda.CUstream,
        ):
            self._launch(x, w_home, w_slot, cu_seqlens, y, row_w, stream, remote_experts, peers, desc_ws)

    class GroupGemmWgradSm90(_GroupedGemmSm90Base):
        """Varlen-K grouped weight gradient: home groups ``dw_home[g] = x_g^T @ dy_g`` (written, bf16),
        slot groups ``dw_slot[j] += x_g^T @ dy_g`` (fp32, in place).

        GEMM view per group g: M = Kd, N = Nd, K = the group's rows. A = x viewed (Kd, N) is M-major,
        B = dy viewed (Nd, N) is N-major; both are read with one tensor map each, the k tiles of group g
        being rows [cu[g-1], cu[g]) / tile_k (every group length is a multiple of P, and tile_k | P).
        Work items are (group, m tile, n tile), group-major, strided over persistent CTAs; each item's K
        extent comes from ``cu_seqlens`` on the device. Each output tile belongs to exactly one item (no
        atomics). Home items store bf16 from the fp32 accumulators through the row kernels' registers ->
        shared (stmatrix) -> global (TMA store) epilogue, over ``dw_home`` viewed (Kd, Nd, epn), so
        partial tiles are clipped by the TMA bounds; an empty home group's items run with no k tiles
        and store zeros, so every tile of ``dw_home`` is written. Slot items (the copies' fp32 reduce
        buffers) read-add-write fp32 from the accumulators straight to global memory (predicated on
        partial tiles); empty slot groups' items are skipped (their dW is not touched).
        """

        def __init__(self, config: GroupGemmConfig):
            self._init_common(
                config,
                LayoutEnum.COL_MAJOR,  # A = x^T (Kd, rows): M-major
                LayoutEnum.COL_MAJOR,  # B = dy^T (Nd, rows): N-major
                self._init_tma_store_epilogue(config.tile_m),
            )

        @cute.jit
        def __call__(
            self,
            x: cute.Tensor,  # (N, Kd), Kd contiguous
            dy: cute.Tensor,  # (N, Nd), Nd contiguous
            cu_seqlens: cute.Tensor,  # (G,) int32
            dw_home: cute.Tensor,  # (epn, Kd, Nd) bf16, Nd contiguous: written
            dw_slot: cute.Tensor,  # (B, Kd, Nd) fp32, Nd contiguous: accumulated
            stream: cuda.CUstream,
        ):
            self._setup_mainloop()
            self._setup_tma_store_epilogue()
            a_view = cute.make_tensor(x.iterator, cute.select(x.layout, mode=[1, 0]))  # (Kd, N)
            b_view = cute.make_tensor(dy.iterator, cute.select(dy.layout, mode=[1, 0]))  # (Nd, N)
            # (Kd, Nd, E) views of the gradients
            d_home = cute.make_tensor(dw_home.iterator, cute.select(dw_home.layout, mode=[1, 2, 0]))
            d_slot = cute.make_tensor(dw_slot.iterator, cute.select(dw_slot.layout, mode=[1, 2, 0]))

            tma_a, mA = self._tma_load_a(a_view)
            tma_b, mB = self._tma_load_b(b_view)
            tma_c, mC = self._tma_store_c(d_home)

            num_m_tiles = cute.ceil_div(cute.size(x, mode=[1]), self.tile_m)
            num_n_tiles = cute.ceil_div(cute.size(dy, mode=[1]), self.tile_n)
            num_tiles = cute.size(cu_seqlens, mode=[0]) * (num_m_tiles * num_n_tiles)
            self._make_shared_storage(with_c=True)
            self._launch_persistent(
                self.kernel(
                    tma_a, mA, tma_b, mB, tma_c, mC, cu_seqlens, d_slot,
                    self.tiled_mma, self.a_smem_staged, self.b_smem_staged, self.epi_smem_staged,
                    num_n_tiles, num_m_tiles * num_n_tiles, num_tiles,
                ),
                num_tiles,
                stream,
            )

        @cute.jit
        def work_item(
            self,
            cu_seqlens: cute.Tensor,
            tile: cutlass.Int32,
            num_n_tiles: cutlass.Int32,
            tiles_per_group: cutlass.Int32,
        ):
            """Work item ``tile`` -> (group, m tile, n tile, first k tile, number of k tiles)."""
            g = tile // tiles_per_group
            rest = tile - g * tiles_per_group
            m_idx = rest // num_n_tiles
            n_idx = rest - m_idx * num_n_tiles
            row_start = cutlass.Int32(0)
            if g > 0:
                row_start = cu_seqlens[g - 1]
            row_end = cu_seqlens[g]
            k_start = row_start // self.tile_k
            k_count = (row_end - row_start) // self.tile_k
            return g, m_idx, n_idx, k_start, k_count

        @cute.jit
        def epilogue_partition(self, tiled_mma: cute.TiledMma, mma_tidx, tile: cute.Tensor) -> cute.Tensor:
            """Consumer thread ``mma_tidx``'s (0 .. #consumer threads) share of an output tile, in the
            order of its accumulator registers. It must be sliced by the thread index: the warp-group
            slice that partitions the shared-memory operands of wgmma would give every thread of a warp
            group the first thread's coordinates (checked on the CPU by the tests)."""
            return tiled_mma.get_slice(mma_tidx).partition_C(tile)

        @cute.jit
        def add_into(self, acc: cute.Tensor, tCgD: cute.Tensor, tCcD: cute.Tensor, dims, full):
            """dW tile (this thread's part) += acc; predicated on the bounds unless ``full``."""
            if full:
                for i in cutlass.range_constexpr(cute.size(acc)):
                    tCgD[i] = tCgD[i] + acc[i]
            else:
                for i in cutlass.range_constexpr(cute.size(acc)):
                    if cute.elem_less(tCcD[i], dims):
                        tCgD[i] = tCgD[i] + acc[i]

        @cute.kernel
        def kernel(
            self,
            tma_a: cute.CopyAtom,
            mA: cute.Tensor,
            tma_b: cute.CopyAtom,
            mB: cute.Tensor,
            tma_c: cute.CopyAtom,
            mC: cute.Tensor,  # TMA view (Kd, Nd, epn) of dw_home (bf16)
            cu_seqlens: cute.Tensor,
            mDs: cute.Tensor,  # (Kd, Nd, B) view of dw_slot (fp32)
            tiled_mma: cute.TiledMma,
            a_smem_staged: cute.ComposedLayout,
            b_smem_staged: cute.ComposedLayout,
            epi_smem_staged: cute.ComposedLayout,
            num_n_tiles: cutlass.Int32,
            tiles_per_group: cutlass.Int32,
            num_tiles: cutlass.Int32,
        ):
            tidx, bidx, gdim, warp_idx, wg_idx = self.warp_roles()
            self.prefetch_tma_descriptors(warp_idx, (tma_a, tma_b, tma_c))
            num_home = cute.size(mC, mode=[2])
            mainloop, sA, (sB,), sC = self.shared_tensors(a_smem_staged, b_smem_staged, ("sB",), epi_smem_staged)
            tAgA, tAsA, ((_, tBgB, tBsB),), _ = self.partition_loads(tma_a, mA, sA, [(tma_b, mB, sB)])
            # (bM, bN, RestM, RestN, E) tiles of the home gradients (TMA coordinates)
            gC = cute.local_tile(mC, (self.tile_m, self.tile_n), (None, None, None))

            pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))

            if wg_idx == 0:
                # ---------------- producer warp group ----------------
                cute.arch.setmaxregister_decrease(self.load_regs)
                if warp_idx == 0:
                    prod_state = pipeline.make_pipeline_state(
                        pipeline.PipelineUserType.Producer, self.ab_stage
                    )
                    for tile in cutlass.range(bidx, num_tiles, gdim, unroll=1):
                        g, m_idx, n_idx, k_start, k_count = self.work_item(
                            cu_seqlens, tile, num_n_tiles, tiles_per_group
                        )
                        prod_state = self.load_k_tiles(
                            mainloop, prod_state, tma_a, tAgA[(None, m_idx, None)], tAsA,
                            [(tma_b, tBgB[(None, n_idx, None)], tBsB)], k_start, k_count,
                        )
                    mainloop.producer_tail(prod_state)
            else:
                # ---------------- consumer warp groups ----------------
                mma_tidx, _, tCrA, (tCrB,), read_state, release_state = self.mma_operands(
                    tiled_mma, tidx, wg_idx, sA, [sB]
                )

                dims = (cute.size(mDs, mode=[0]), cute.size(mDs, mode=[1]))  # (Kd, Nd), static
                # (bM, bN, RestM, RestN, B) tiles of the slot gradients and (bM, bN, RestM, RestN) of
                # their coordinates
                gDs = cute.local_tile(mDs, (self.tile_m, self.tile_n), (None, None, None))
                cD = cute.local_tile(
                    cute.make_identity_tensor(dims), (self.tile_m, self.tile_n), (None, None)
                )
                acc = cute.make_rmem_tensor(
                    self.epilogue_partition(tiled_mma, mma_tidx, cD[(None, None, 0, 0)]).shape, self.acc_dtype
                )
                tiled_copy_r2s, tRS_sD, tRS_rD, tRS_rOut, epi_bar, store_pipe = self.make_tma_store_epilogue(
                    tiled_mma, mma_tidx, sC
                )
                tRS_rAcc = tiled_copy_r2s.retile(acc)

                epi_count = cutlass.Int32(0)
                for tile in cutlass.range(bidx, num_tiles, gdim, unroll=1):
                    g, m_idx, n_idx, k_start, k_count = self.work_item(
                        cu_seqlens, tile, num_n_tiles, tiles_per_group
                    )
                    is_home = g < num_home
                    # home items always run (an empty group: no k tiles, zeros stored); empty slot
                    # groups' items are skipped
                    if is_home | (k_count > 0):
                        read_state, release_state = self.mma_k_tiles(
                            mainloop, read_state, release_state, tiled_mma, [acc], tCrA, [tCrB], k_count
                        )
                        if is_home:
                            # home: written in bf16 (registers -> shared -> TMA store)
                            bSG_sD, bSG_gD, epi_tiles, epi_layout = self.partition_epilogue(
                                tma_c, sC, gC[(None, None, m_idx, n_idx, g)]
                            )
                            for e in cutlass.range_constexpr(epi_tiles):
                                self.acc_subtile_to_bf16(tRS_rAcc, e, tRS_rD, tRS_rOut)
                                self.store_subtile(
                                    tiled_copy_r2s, tRS_rOut, tRS_sD, (epi_count + e) % self.epi_stage, epi_bar,
                                    warp_idx, store_pipe, tma_c, bSG_sD, bSG_gD, epi_layout.get_hier_coord(e),
                                )
                            epi_count = epi_count + epi_tiles
                        else:
                            # slot: fp32 read-add-write into the reduce buffer
                            tCcD = self.epilogue_partition(tiled_mma, mma_tidx, cD[(None, None, m_idx, n_idx)])
                            full = self.is_full_tile(m_idx, n_idx, dims)
                            self.add_into(
                                acc,
                                self.epilogue_partition(
                                    tiled_mma, mma_tidx, gDs[(None, None, m_idx, n_idx, g - num_home)]
                                ),
                                tCcD, dims, full,
                            )
                if warp_idx == self.epi_store_warp:
                    store_pipe.producer_tail()

    class GroupGemmSwigluSm90(_GroupedGemmSm90Base):
        """Fused gate/up projection with a SwiGLU epilogue (see ``group_gemm_swiglu``).

        Per output tile (``tile_m`` rows x ``tile_n`` columns of h) the producer loads, per k tile, the
        A tile and the matching ``tile_n``-column tiles of *both* ``W_gate`` and ``W_up`` (two B rings
        sharing one mbarrier per stage); the consumers keep two fp32 accumulators of identical layout
        (gate and up of the same columns, so element i of one and of the other are the same (row,
        column)) and the epilogue computes ``h = silu(gate) * up`` in fp32 from registers, converts to
        bf16 and stores it through the stmatrix -> shared -> TMA path of the forward kernel. With
        ``store_preact`` it also stores the bf16 pre-activations gate and up (what backward needs).
        Same persistent M-major raster and device-side tile -> group lookup as the forward.
        """

        def __init__(self, config: GroupGemmConfig, store_preact: bool = True):
            self.store_preact = bool(store_preact)
            # Stages are sized for A + both B tiles: ask _init_common for a tile twice as wide.
            self._init_common(
                GroupGemmConfig(config.tile_m, 2 * config.tile_n, config.num_sms),
                LayoutEnum.ROW_MAJOR,  # A = x [N, H]: K-major
                LayoutEnum.COL_MAJOR,  # B = W viewed (F, H): N-major
                self._init_tma_store_epilogue(config.tile_m),
            )
            self.tile_n = config.tile_n  # columns of h (and of gate, of up) per tile
            self.b_modes = [2, 1, 0]

        @cute.jit
        def __call__(
            self,
            x: cute.Tensor,  # (N, H)
            wg_home: cute.Tensor,  # (epn, H, F)
            wg_slot: cute.Tensor,  # (B, H, F)
            wu_home: cute.Tensor,  # (epn, H, F)
            wu_slot: cute.Tensor,  # (B, H, F)
            cu_seqlens: cute.Tensor,  # (G,) int32
            h: cute.Tensor,  # (N, F)
            gate: cute.Tensor,  # (N, F), written only with store_preact
            up: cute.Tensor,  # (N, F), written only with store_preact
            stream: cuda.CUstream,
        ):
            self._launch(x, wg_home, wg_slot, wu_home, wu_slot, cu_seqlens, h, gate, up, stream)

        @cute.jit
        def _launch(self, x, wg_home, wg_slot, wu_home, wu_slot, cu_seqlens, h, gate, up, stream,
                    remote_experts=None, gate_peers=None, up_peers=None, desc_ws=None):
            """Shared by the plain kernel and the one with remote groups (``remote_experts`` not None)."""
            self._setup_mainloop()
            self._setup_tma_store_epilogue()
            tma_a, mA = self._tma_load_a(x)
            bg_view = self._weights_as_b(wg_home)
            tma_gh, mGh = self._tma_load_b(bg_view)
            tma_gs, mGs = self._tma_load_b(self._weights_as_b(wg_slot))
            bu_view = self._weights_as_b(wu_home)
            tma_uh, mUh = self._tma_load_b(bu_view)
            tma_us, mUs = self._tma_load_b(self._weights_as_b(wu_slot))
            tma_h, mH = self._tma_store_c(h)
            tma_g, mG = self._tma_store_c(gate)
            tma_u, mU = self._tma_store_c(up)
            num_n_tiles, num_tiles = self._row_tiles(x, h)
            self._make_shared_storage(b_buffers=("sBg", "sBu"), with_c=True)
            if cutlass.const_expr(remote_experts is None):
                bg_view, bu_view = None, None
            self._launch_persistent(
                self.kernel(
                    tma_a, mA, tma_gh, mGh, tma_gs, mGs, tma_uh, mUh, tma_us, mUs,
                    tma_h, mH, tma_g, mG, tma_u, mU, cu_seqlens,
                    self.tiled_mma, self.a_smem_staged, self.b_smem_staged, self.epi_smem_staged,
                    num_n_tiles, num_tiles, remote_experts, gate_peers, up_peers, bg_view, bu_view, desc_ws,
                ),
                num_tiles,
                stream,
            )

        @cute.kernel
        def kernel(
            self,
            tma_a: cute.CopyAtom, mA: cute.Tensor,
            tma_gh: cute.CopyAtom, mGh: cute.Tensor,
            tma_gs: cute.CopyAtom, mGs: cute.Tensor,
            tma_uh: cute.CopyAtom, mUh: cute.Tensor,
            tma_us: cute.CopyAtom, mUs: cute.Tensor,
            tma_h: cute.CopyAtom, mH: cute.Tensor,
            tma_g: cute.CopyAtom, mG: cute.Tensor,
            tma_u: cute.CopyAtom, mU: cute.Tensor,
            cu_seqlens: cute.Tensor,
            tiled_mma: cute.TiledMma,
            a_smem_staged: cute.ComposedLayout,
            b_smem_staged: cute.ComposedLayout,
            epi_smem_staged: cute.ComposedLayout,
            num_n_tiles: cutlass.Int32,
            num_tiles: cutlass.Int32,
            remote_experts,  # None, or (n_remote,) int32: the remote groups' global expert ids
            gate_peers,  # None, or (R,) int64: each rank's home gate weights' address
            up_peers,  # None, or (R,) int64: each rank's home up weights' address
            bg_view,  # None, or the home gate weights viewed as B (the layout of a donor's weights)
            bu_view,  # None, or the same for up
            desc_ws,  # None, or the remote descriptors' workspace (int64, 2 x 16 per CTA)
        ):
            tidx, bidx, gdim, warp_idx, wg_idx = self.warp_roles()
            stores = (tma_h, tma_g, tma_u) if cutlass.const_expr(self.store_preact) else (tma_h,)
            self.prefetch_tma_descriptors(warp_idx, (tma_a, tma_gh, tma_gs, tma_uh, tma_us) + stores)
            num_groups = cute.size(cu_seqlens, mode=[0])
            mainloop, sA, (sBg, sBu), sC = self.shared_tensors(
                a_smem_staged, b_smem_staged, ("sBg", "sBu"), epi_smem_staged
            )
            tAgA, tAsA, (load_gh, load_gs, load_uh, load_us), k_tiles = self.partition_loads(
                tma_a, mA, sA, [(tma_gh, mGh, sBg), (tma_gs, mGs, sBg), (tma_uh, mUh, sBu), (tma_us, mUs, sBu)]
            )
            tile_c = (self.tile_m, self.tile_n)
            gH = cute.local_tile(mH, tile_c, (None, None))
            gG = cute.local_tile(mG, tile_c, (None, None))
            gU = cute.local_tile(mU, tile_c, (None, None))

            pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))

            if wg_idx == 0:
                remote = None
                if cutlass.const_expr(remote_experts is not None):
                    remote = (remote_experts, [gate_peers, up_peers], [bg_view, bu_view], desc_ws)
                self.load_row_tiles(
                    warp_idx, mainloop, cu_seqlens, num_n_tiles, num_tiles, tma_a, tAgA, tAsA,
                    [load_gh, load_uh], [load_gs, load_us], k_tiles, remote,
                )
            else:
                # ---------------- consumer warp groups ----------------
                mma_tidx, thr_mma, tCrA, tCrBs, read_state, release_state = self.mma_operands(
                    tiled_mma, tidx, wg_idx, sA, [sBg, sBu]
                )
                acc_shape = thr_mma.partition_C(gH).shape[:3]
                acc_g = cute.make_rmem_tensor(acc_shape, self.acc_dtype)
                acc_u = cute.make_rmem_tensor(acc_shape, self.acc_dtype)

                tiled_copy_r2s, tRS_sD, tRS_rD, tRS_rOut, epi_bar, store_pipe = self.make_tma_store_epilogue(
                    tiled_mma, mma_tidx, sC
                )
                tRS_rG = tiled_copy_r2s.retile(acc_g)
                tRS_rU = tiled_copy_r2s.retile(acc_u)
                size_rD = cute.size(tRS_rOut)
                neg_log2e = cutlass.Float32(-1.4426950408889634)

                epi_count = cutlass.Int32(0)
                for tile in cutlass.range(bidx, num_tiles, gdim, unroll=1):
                    m_idx, n_idx, g = self.row_tile(cu_seqlens, tile, num_n_tiles)
                    k_count = k_tiles if g < num_groups else 0  # past the last group: zeros
                    read_state, release_state = self.mma_k_tiles(
                        mainloop, read_state, release_state, tiled_mma, [acc_g, acc_u], tCrA, tCrBs, k_count
                    )

                    # ---- epilogue: h = silu(gate) * up (fp32), then gate and up ----
                    bSG_sD, bSG_gH, epi_tiles, epi_layout = self.partition_epilogue(
                        tma_h, sC, gH[(None, None, m_idx, n_idx)]
                    )
                    for e in cutlass.range_constexpr(epi_tiles):
                        for v in cutlass.range_constexpr(size_rD):
                            a = tRS_rG[e * size_rD + v]
                            sig = cute.arch.rcp_approx(1.0 + cute.math.exp2(a * neg_log2e, fastmath=True))
                            tRS_rD[v] = a * sig * tRS_rU[e * size_rD + v]
                        tRS_rOut.store(tRS_rD.load().to(self.c_dtype))
                        self.store_subtile(
                            tiled_copy_r2s, tRS_rOut, tRS_sD, (epi_count + e) % self.epi_stage, epi_bar,
                            warp_idx, store_pipe, tma_h, bSG_sD, bSG_gH[(None, epi_layout.get_hier_coord(e))],
                        )
                    epi_count = epi_count + epi_tiles
                    if cutlass.const_expr(self.store_preact):
                        _, bSG_gG, _, _ = self.partition_epilogue(tma_g, sC, gG[(None, None, m_idx, n_idx)])
                        _, bSG_gU, _, _ = self.partition_epilogue(tma_u, sC, gU[(None, None, m_idx, n_idx)])
                        for e in cutlass.range_constexpr(epi_tiles):
                            self.acc_subtile_to_bf16(tRS_rG, e, tRS_rD, tRS_rOut)
                            self.store_subtile(
                                tiled_copy_r2s, tRS_rOut, tRS_sD, (epi_count + 2 * e) % self.epi_stage, epi_bar,
                                warp_idx, store_pipe, tma_g, bSG_sD, bSG_gG[(None, epi_layout.get_hier_coord(e))],
                            )
                            self.acc_subtile_to_bf16(tRS_rU, e, tRS_rD, tRS_rOut)
                            self.store_subtile(
                                tiled_copy_r2s, tRS_rOut, tRS_sD, (epi_count + 2 * e + 1) % self.epi_stage,
                                epi_bar, warp_idx, store_pipe, tma_u, bSG_sD,
                                bSG_gU[(None, epi_layout.get_hier_coord(e))],
                            )
                        epi_count = epi_count + 2 * epi_tiles
                if warp_idx == self.epi_store_warp:
                    store_pipe.producer_tail()

    class GroupGemmSwigluRemoteSm90(GroupGemmSwigluSm90):
        """The fused gate/up + SwiGLU kernel whose last ``n_remote`` groups are remote groups
        (inference): remote group j reads expert ``e = remote_experts[j]`` from the home gate/up weights
        of rank ``e // epn`` (``gate_peers[e // epn]``, ``up_peers[e // epn]``, peer-mapped), index
        ``e % epn`` (see ``load_remote_row_tiles``)."""

        @cute.jit
        def __call__(
            self,
            x: cute.Tensor,  # (N, H)
            wg_home: cute.Tensor,  # (epn, H, F)
            wg_slot: cute.Tensor,  # (B, H, F)
            wu_home: cute.Tensor,  # (epn, H, F)
            wu_slot: cute.Tensor,  # (B, H, F)
            cu_seqlens: cute.Tensor,  # (G = epn + B + n_remote,) int32
            h: cute.Tensor,  # (N, F)
            gate: cute.Tensor,  # (N, F), written only with store_preact
            up: cute.Tensor,  # (N, F), written only with store_preact
            remote_experts: cute.Tensor,  # (n_remote,) int32, global expert ids (-1: unused group)
            gate_peers: cute.Tensor,  # (R,) int64: address of rank r's home gate weights (epn, H, F)
            up_peers: cute.Tensor,  # (R,) int64: address of rank r's home up weights (epn, H, F)
            desc_ws: cute.Tensor,  # (2 * 16 * #SMs,) int64: one descriptor slot per CTA and B ring
            stream: cuda.CUstream,
        ):
            self._launch(x, wg_home, wg_slot, wu_home, wu_slot, cu_seqlens, h, gate, up, stream, remote_experts,
                         gate_peers, up_peers, desc_ws)

    class GroupGemmSwigluBwdSm90(_GroupedGemmSm90Base):
        """Down-projection dgrad with the SwiGLU backward in the epilogue (see ``group_gemm_swiglu_bwd``).

        Mainloop: the dgrad GEMM ``d = g_y @ W_down_g^T`` (A = g_y K-major, B = ``W_down_g`` viewed
        (F, H), K-major), a 128 x 128 fp32 tile of d per CTA tile, persistent with the device-side tile
        -> group lookup of the forward. After the main loop each consumer thread loads the saved bf16
        gate/up at its accumulator elements' (row, column)s into registers in one batch (vectorised,
        all in flight together, before any store: one memory latency per tile; holding them across the
        main loop instead made ptxas spill). Epilogue, per accumulator element (row r, column f), in
        registers, then stored straight to global memory (vectorised on full tiles): with ``row_w[r]``,
        recomputes ``s = sigmoid(gate)``, ``h = gate * s * up`` in fp32 and writes
        ``g_gate = row_w * d * up * s * (1 + gate * (1 - s))``, ``g_up = row_w * d * gate * s``,
        ``h_w = row_w * h`` (bf16; the down wgrad's A operand: dW_down = h_w^T g_y) and the partial dot
        product ``sum_f d * h`` of its rows over the tile's columns into ``part[r, n tile]`` (fp32; the
        route-weight gradient is ``part.sum(1)``: no atomics, deterministic).
        Row reduction: an accumulator element's row offset within the thread's rows is static (the
        layout of the thread's slice of an identity tile), and the four lanes of a quad share their rows
        (checked on the CPU by the tests): per static row offset a register sum, then two xor shuffles.
        """

        def __init__(self, config: GroupGemmConfig):
            self._init_common(
                config,
                LayoutEnum.ROW_MAJOR,  # A = g_y [N, H]: K-major
                LayoutEnum.ROW_MAJOR,  # B = W_down [F, H] per group: K-major (reduction over H)
                0,
            )
            self.b_modes = [1, 2, 0]  # W_down (E, F, H) -> (F, H, E)

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
            stream: cuda.CUstream,
        ):
            self._setup_mainloop()
            self._row_slots()
            tma_a, mA = self._tma_load_a(g_y)
            tma_bh, mBh = self._tma_load_b(self._weights_as_b(w_home))
            tma_bs, mBs = self._tma_load_b(self._weights_as_b(w_slot))
            num_n_tiles, num_tiles = self._row_tiles(g_y, gate)
            self._make_shared_storage()
            self._launch_persistent(
                self.kernel(
                    tma_a, mA, tma_bh, mBh, tma_bs, mBs, cu_seqlens, row_w, gate, up, g_gate, g_up, h_w, part,
                    self.tiled_mma, self.a_smem_staged, self.b_smem_staged, num_n_tiles, num_tiles,
                ),
                num_tiles,
                stream,
            )

        @cute.jit
        def swiglu_bwd_element(self, i: cutlass.Constexpr, acc: cute.Tensor, gate: cute.Tensor, up: cute.Tensor,
                               g_gate: cute.Tensor, g_up: cute.Tensor, h_w: cute.Tensor, rw, j: cutlass.Constexpr,
                               part_sums: cute.Tensor):
            """Element i: from d = acc[i] and the bf16 gate[i], up[i], writes g_gate[i], g_up[i] (bf16) and
            h_w[i] (in h_w's type) and adds d * h to part_sums[j]. A full tile passes registers (g_gate,
            g_up over gate, up; h_w over acc, fp32), an edge tile its global memory."""
            one = cutlass.Float32(1.0)
            gt = gate[i].to(cutlass.Float32)
            ut = up[i].to(cutlass.Float32)
            d = acc[i]
            s = cute.arch.rcp_approx(one + cute.math.exp2(gt * cutlass.Float32(-1.4426950408889634), fastmath=True))
            silu = gt * s
            h = silu * ut
            gh = d * rw
            g_gate[i] = (gh * ut * s * (one + gt * (one - s))).to(cutlass.BFloat16)
            g_up[i] = (gh * silu).to(cutlass.BFloat16)
            h_w[i] = (h * rw).to(h_w.element_type)
            part_sums[j] = part_sums[j] + d * h

        @cute.jit
        def swiglu_bwd_epilogue(self, acc: cute.Tensor, coords: cute.Tensor, rG: cute.Tensor, rU: cute.Tensor,
                                tCgG: cute.Tensor, tCgU: cute.Tensor, tCgGG: cute.Tensor, tCgGU: cute.Tensor, tCgHW: cute.Tensor,
                                row_w: cute.Tensor, last_row, dims, full: cutlass.Constexpr,
                                part_sums: cute.Tensor):
            """The epilogue (see the class docstring) on registers, then the stores: a full tile's gate/up
            are in ``rG``/``rU`` (results overwrite them) and its stores are vectorised; an edge tile reads
            and writes per element, predicated. ``part_sums[row_slot[i]]`` collects d * h of the
            thread's rows of that static slot (elements outside the bounds are skipped)."""
            # the route weight of each of the thread's rows, read once (clamped: rows past N are never stored)
            rws = cute.make_rmem_tensor(len(self.row_first), self.acc_dtype)
            for j in cutlass.range_constexpr(len(self.row_first)):
                rws[j] = row_w[cutlass.min(coords[self.row_first[j]][0], last_row)]
            if cutlass.const_expr(full):
                for i in cutlass.range_constexpr(cute.size(acc)):
                    self.swiglu_bwd_element(
                        i, acc, rG, rU, rG, rU, acc, rws[self.row_slot[i]], self.row_slot[i], part_sums
                    )
                cute.autovec_copy(rG, tCgGG)
                cute.autovec_copy(rU, tCgGU)
                rG.store(acc.load().to(cutlass.BFloat16))  # h_w, in gate's registers (fewer live registers)
                cute.autovec_copy(rG, tCgHW)
            else:
                # an edge tile (rare): gate/up read from global memory one element at a time, every
                # access predicated on the bounds
                for i in cutlass.range_constexpr(cute.size(acc)):
                    if cute.elem_less(coords[i], dims):
                        self.swiglu_bwd_element(i, acc, tCgG, tCgU, tCgGG, tCgGU, tCgHW, rws[self.row_slot[i]],
                                                self.row_slot[i], part_sums)

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
        ):
            tidx, bidx, gdim, warp_idx, wg_idx = self.warp_roles()
            self.prefetch_tma_descriptors(warp_idx, (tma_a, tma_bh, tma_bs))
            num_groups = cute.size(cu_seqlens, mode=[0])
            mainloop, sA, (sB,), _ = self.shared_tensors(a_smem_staged, b_smem_staged, ("sB",))
            tAgA, tAsA, (load_bh, load_bs), k_tiles = self.partition_loads(
                tma_a, mA, sA, [(tma_bh, mBh, sB), (tma_bs, mBs, sB)]
            )

            pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))

            if wg_idx == 0:
                self.load_row_tiles(
                    warp_idx, mainloop, cu_seqlens, num_n_tiles, num_tiles, tma_a, tAgA, tAsA, [load_bh], [load_bs],
                    k_tiles,
                )
            else:
                mma_tidx, _, tCrA, (tCrB,), read_state, release_state = self.mma_operands(
                    tiled_mma, tidx, wg_idx, sA, [sB]
                )
                thr_c = tiled_mma.get_slice(mma_tidx)  # per-thread slice: element coordinates (see wgrad)

                n_rows = cute.size(mGate, mode=[0])
                dims = (n_rows, cute.size(mGate, mode=[1]))
                tile_c = (self.tile_m, self.tile_n)
                gGate = cute.local_tile(mGate, tile_c, (None, None))
                gUp = cute.local_tile(mUp, tile_c, (None, None))
                gGG = cute.local_tile(mGG, tile_c, (None, None))
                gGU = cute.local_tile(mGU, tile_c, (None, None))
                gHW = cute.local_tile(mHW, tile_c, (None, None))
                cC = cute.local_tile(cute.make_identity_tensor(dims), tile_c, (None, None))
                acc = cute.make_rmem_tensor(thr_c.partition_C(gGate[(None, None, 0, 0)]).shape, self.acc_dtype)
                part_sums = cute.make_rmem_tensor(len(self.row_first), self.acc_dtype)
                rG = cute.make_rmem_tensor(acc.layout, cutlass.BFloat16)  # gate, then g_gate
                rU = cute.make_rmem_tensor(acc.layout, cutlass.BFloat16)  # up, then g_up
                last_row = n_rows - 1

                for tile in cutlass.range(bidx, num_tiles, gdim, unroll=1):
                    m_idx, n_idx, g = self.row_tile(cu_seqlens, tile, num_n_tiles)
                    k_count = k_tiles if g < num_groups else 0  # past the last group: d = 0
                    full = self.is_full_tile(m_idx, n_idx, dims)
                    read_state, release_state = self.mma_k_tiles(
                        mainloop, read_state, release_state, tiled_mma, [acc], tCrA, [tCrB], k_count
                    )
                    coords = thr_c.partition_C(cC[(None, None, m_idx, n_idx)])
                    tCgG = thr_c.partition_C(gGate[(None, None, m_idx, n_idx)])
                    tCgU = thr_c.partition_C(gUp[(None, None, m_idx, n_idx)])
                    tCgGG = thr_c.partition_C(gGG[(None, None, m_idx, n_idx)])
                    tCgGU = thr_c.partition_C(gGU[(None, None, m_idx, n_idx)])
                    tCgHW = thr_c.partition_C(gHW[(None, None, m_idx, n_idx)])

                    part_sums.fill(0.0)
                    if full:
                        cute.autovec_copy(tCgG, rG)  # one batch of loads, before any store of this tile
                        cute.autovec_copy(tCgU, rU)
                        self.swiglu_bwd_epilogue(acc, coords, rG, rU, tCgG, tCgU, tCgGG, tCgGU, tCgHW, row_w,
                                                 last_row, dims, True, part_sums)
                    else:
                        self.swiglu_bwd_epilogue(acc, coords, rG, rU, tCgG, tCgU, tCgGG, tCgGU, tCgHW, row_w,
                                                 last_row, dims, False, part_sums)
                    # the four lanes of a quad hold the same rows: reduce over them, lane 0 of the quad writes
                    lane = cute.arch.lane_idx()
                    for j in cutlass.range_constexpr(len(self.row_first)):
                        p = part_sums[j]
                        p = p + cute.arch.shuffle_sync_bfly(p, offset=1)
                        p = p + cute.arch.shuffle_sync_bfly(p, offset=2)
                        r = coords[self.row_first[j]][0]
                        if (lane % 4 == 0) & (r < n_rows):
                            mPart[r, n_idx] = p

    return (GroupGemmSm90, GroupGemmWgradSm90, GroupGemmRowScaleSm90, GroupGemmSwigluSm90, GroupGemmSwigluBwdSm90,
            GroupGemmRowScaleRemoteSm90, GroupGemmSwigluRemoteSm90)


_KERNEL_CLASSES = None


def _kernel_classes():
    global _KERNEL_CLASSES
    if _KERNEL_CLASSES is None:
        _KERNEL_CLASSES = _build_kernel_classes()
    return _KERNEL_CLASSES


# ---------------------------------------------------------------------------------------------------
# Compilation (once per static key)
# ---------------------------------------------------------------------------------------------------

_COMPILED: dict[tuple, Any] = {}
# One TMA descriptor (CUtensorMap): its size and the alignment its global-memory copy needs.
_DESC_BYTES = 128
_COMPILE_LOCK = threading.Lock()


def _compile_cached(key: tuple, build):
    """``build()`` once per ``key`` and target arch (``CUTE_DSL_ARCH``)."""
    key = key + (os.environ.get("CUTE_DSL_ARCH", ""),)
    fn = _COMPILED.get(key)
    if fn is not None:
        return fn
    with _COMPILE_LOCK:
        fn = _COMPILED.get(key)
        if fn is None:
            fn = _COMPILED[key] = build()
        return fn


def _fake_sizes():
    """Symbolic (N, epn, B, G): the sizes a compiled kernel takes at run time."""
    import cutlass.cute as cute

    return cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()


def _fake(dtype, shape, align: int = 16):
    """Fake contiguous (row-major) tensor of ``shape`` for ``cute.compile``."""
    import cutlass.cute as cute

    return cute.runtime.make_fake_compact_tensor(
        dtype, shape, stride_order=tuple(reversed(range(len(shape)))), assumed_align=align
    )


def _compile_for_torch(kernel, *fakes):
    """Compile ``kernel`` for the fake arguments; the result takes torch tensors and runs on torch's
    current stream (tvm-ffi environment stream)."""
    import cutlass.cute as cute

    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(kernel, *fakes, stream, options="--enable-tvm-ffi")


def _compile_rows_kernel(name: str, red: int, out: int, kd: int, nd: int, b_k_major: bool,
                         config: GroupGemmConfig):
    """Row-grouped kernel ``C [N, out] = A [N, red] @ op(W_g)`` with ``W`` ``[E, kd, nd]``."""
    import cutlass

    def build():
        n, epn, nb, ng = _fake_sizes()
        bf = cutlass.BFloat16
        return _compile_for_torch(
            _kernel_classes()[0](config, b_k_major=b_k_major),
            _fake(bf, (n, red)), _fake(bf, (epn, kd, nd)), _fake(bf, (nb, kd, nd)), _fake(cutlass.Int32, (ng,), 4),
            _fake(bf, (n, out)),
        )

    return _compile_cached((name, int(kd), int(nd), tuple(config)), build)


def compile_group_gemm(kd: int, nd: int, config: GroupGemmConfig):
    """Compile (or fetch from the cache) the forward kernel for static (Kd, Nd, tile config, arch).

    Dynamic: N (rows), epn, B, G. The result takes torch tensors (x, w_home, w_slot, cu_seqlens, y)
    and runs on torch's current stream (tvm-ffi environment stream).
    """
    return _compile_rows_kernel("group_gemm_fwd", kd, nd, kd, nd, False, config)


def compile_group_gemm_dgrad(kd: int, nd: int, config: GroupGemmConfig):
    """The dgrad kernel (same class, B K-major): takes (dy [N, Nd], w_home, w_slot, cu_seqlens,
    dx [N, Kd]). ``config.tile_n`` tiles the output columns, Kd."""
    return _compile_rows_kernel("group_gemm_dgrad", nd, kd, kd, nd, True, config)


def compile_group_gemm_wgrad(kd: int, nd: int, config: GroupGemmConfig):
    """The varlen-K wgrad kernel: takes (x [N, Kd], dy [N, Nd], cu_seqlens, dw_home bf16, dw_slot fp32),
    writes ``x_g^T dy_g`` into the home groups' ``dw_home[g]`` (bf16) and adds it into the slot groups'
    ``dw_slot[g - epn]`` (fp32). ``config.tile_m`` tiles Kd, ``config.tile_n`` tiles Nd."""
    import cutlass

    def build():
        n, epn, nb, ng = _fake_sizes()
        bf, f32 = cutlass.BFloat16, cutlass.Float32
        return _compile_for_torch(
            _kernel_classes()[1](config),
            _fake(bf, (n, kd)), _fake(bf, (n, nd)), _fake(cutlass.Int32, (ng,), 4),
            _fake(bf, (epn, kd, nd)), _fake(f32, (nb, kd, nd)),
        )

    return _compile_cached(("group_gemm_wgrad", int(kd), int(nd), tuple(config)), build)


def select_swiglu_config(pad: int, f: int, num_sms: int = H100_H200_NUM_SMS) -> GroupGemmConfig:
    """Tile of the fused gate/up kernel: tile_M as the forward's; tile_N = 128 columns of h, so a tile
    computes 128 columns of gate *and* of up (two 64 x 128 fp32 accumulators per consumer warp group,
    the register footprint of the forward's 128 x 256 tile)."""
    base = select_config(pad, f, num_sms)
    return GroupGemmConfig(base.tile_m, 128, num_sms)


def _fake_remote(num_peer_arrays: int):
    """Fakes of the remote arguments: remote_experts (n_remote,) int32, ``num_peer_arrays`` x peers (R,)
    int64 and the descriptor workspace (int64, 128-byte aligned), all of symbolic length."""
    import cutlass
    import cutlass.cute as cute

    n_remote, num_ranks, ws = cute.sym_int(), cute.sym_int(), cute.sym_int()
    return (_fake(cutlass.Int32, (n_remote,), 4), *(_fake(cutlass.Int64, (num_ranks,), 8)
                                                      for _ in range(num_peer_arrays)),
            _fake(cutlass.Int64, (ws,), _DESC_BYTES))


def compile_group_gemm_swiglu(hd: int, f: int, config: GroupGemmConfig, store_preact: bool = True,
                              remote: bool = False):
    """The fused gate/up + SwiGLU kernel: takes (x [N, H], w_gate_home, w_gate_slot, w_up_home, w_up_slot
    [*, H, F], cu_seqlens, h [N, F], gate [N, F], up [N, F]); gate/up are written only with
    ``store_preact`` (otherwise pass any bf16 [N, F] tensor, e.g. h: it is never written). ``remote``:
    the variant with remote groups, which also takes (remote_experts [n_remote] int32, gate_peers [R]
    int64, up_peers [R] int64, descriptor workspace int64 [2 * 16 * num_sms]) after ``up``."""
    import cutlass

    def build():
        n, epn, nb, ng = _fake_sizes()
        bf = cutlass.BFloat16
        cls = _kernel_classes()[6 if remote else 3]
        return _compile_for_torch(
            cls(config, store_preact=store_preact),
            _fake(bf, (n, hd)), _fake(bf, (epn, hd, f)), _fake(bf, (nb, hd, f)), _fake(bf, (epn, hd, f)),
            _fake(bf, (nb, hd, f)), _fake(cutlass.Int32, (ng,), 4), _fake(bf, (n, f)), _fake(bf, (n, f)),
            _fake(bf, (n, f)), *(_fake_remote(2) if remote else ()),
        )

    name = "group_gemm_swiglu_remote" if remote else "group_gemm_swiglu"
    return _compile_cached((name, bool(store_preact), int(hd), int(f), tuple(config)), build)


def compile_group_gemm_row_scale(kd: int, nd: int, config: GroupGemmConfig, remote: bool = False):
    """Forward with the per-row scale epilogue: takes (x [N, Kd], w_home, w_slot, cu_seqlens,
    row_w [N] fp32, y [N, Nd]). ``remote``: the variant with remote groups, which also takes
    (remote_experts [n_remote] int32, peers [R] int64, descriptor workspace int64 [16 * num_sms]) after
    ``y``."""
    import cutlass

    def build():
        n, epn, nb, ng = _fake_sizes()
        bf = cutlass.BFloat16
        return _compile_for_torch(
            _kernel_classes()[5 if remote else 2](config),
            _fake(bf, (n, kd)), _fake(bf, (epn, kd, nd)), _fake(bf, (nb, kd, nd)), _fake(cutlass.Int32, (ng,), 4),
            _fake(cutlass.Float32, (n,), 4), _fake(bf, (n, nd)), *(_fake_remote(1) if remote else ()),
        )

    name = "group_gemm_row_scale_remote" if remote else "group_gemm_row_scale"
    return _compile_cached((name, int(kd), int(nd), tuple(config)), build)


def select_swiglu_bwd_config(pad: int, num_sms: int = H100_H200_NUM_SMS) -> GroupGemmConfig:
    """Tile of the SwiGLU-backward dgrad: tile_M as the forward's, 128 columns of F (its per-element
    epilogue keeps one 64-register accumulator per thread and reads/writes five [N, F] tensors)."""
    base = select_config(pad, 128, num_sms)
    return GroupGemmConfig(base.tile_m, 128, num_sms)


def compile_group_gemm_swiglu_bwd(hd: int, f: int, config: GroupGemmConfig):
    """The down-projection dgrad with the SwiGLU backward epilogue: takes (g_y [N, H], w_down_home
    [epn, F, H], w_down_slot [B, F, H], cu_seqlens, row_w [N] fp32, gate [N, F], up [N, F], g_gate [N, F],
    g_up [N, F], h_w [N, F], part [N, ceil(F / tile_n)] fp32)."""
    import cutlass

    def build():
        n, epn, nb, ng = _fake_sizes()
        bf, f32 = cutlass.BFloat16, cutlass.Float32
        n_tiles = (f + config.tile_n - 1) // config.tile_n
        return _compile_for_torch(
            _kernel_classes()[4](config),
            _fake(bf, (n, hd)), _fake(bf, (epn, f, hd)), _fake(bf, (nb, f, hd)), _fake(cutlass.Int32, (ng,), 4),
            _fake(f32, (n,), 4), *(_fake(bf, (n, f)) for _ in range(5)), _fake(f32, (n, n_tiles), 4),
        )

    return _compile_cached(("group_gemm_swiglu_bwd", int(hd), int(f), tuple(config)), build)


def select_wgrad_config(pad: int, kd: int, nd: int, num_sms: int = H100_H200_NUM_SMS) -> GroupGemmConfig:
    """Tile shape of the wgrad kernel: tile_M over Kd, tile_N over Nd; its k tile (64 rows) must divide P."""
    if not isinstance(pad, int) or pad < 16 or pad & (pad - 1):
        raise ValueError(f"P (pad) must be a power of two >= 16, got {pad!r}")
    if pad < 64:
        raise ValueError(
            f"P (pad) = {pad} is smaller than the wgrad kernel's k tile (64 rows): every k tile must lie "
            f"inside one group, so group lengths must be multiples of 64"
        )
    tile_m = 128 if kd > 64 else 64
    tile_n = 256 if nd >= 256 else 128
    return GroupGemmConfig(tile_m, tile_n, num_sms)


# ---------------------------------------------------------------------------------------------------
# Host wrappers
# ---------------------------------------------------------------------------------------------------


def _check_inputs(x, w_home, w_slot, cu_seqlens, pad, x_name="x", red_dim=1, w_names=("w_home", "w_slot"),
                  check_device=True, remote=None, peer_names=("peers",)):
    """Checks of the row-grouped kernels; ``red_dim`` is the weight dim that x's columns match
    (1 = Kd: forward, 2 = Nd: dgrad, with x = dy); ``w_names`` name the weights in the errors;
    ``check_device=False`` leaves out the device and alignment checks. ``remote``: None, or the tuple
    (remote_experts, *peers) of the kernels with remote groups (``peer_names`` name the peers); then
    cu_seqlens has epn + B + n_remote entries (see ``_check_remote``)."""
    if w_names != ("w_home", "w_slot"):
        try:
            return _check_inputs(x, w_home, w_slot, cu_seqlens, pad, x_name, red_dim, check_device=check_device,
                                 remote=remote, peer_names=peer_names)
        except ValueError as exc:  # name the caller's weights
            msg = str(exc)
            msg = msg.replace("w_home", "\0").replace("w_slot", w_names[1]).replace("\0", w_names[0])
            raise ValueError(msg) from None
    for name, t in ((x_name, x), ("w_home", w_home), ("w_slot", w_slot), ("cu_seqlens", cu_seqlens)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in ((x_name, x), ("w_home", w_home), ("w_slot", w_slot)):
        if t.dtype != torch.bfloat16:
            raise ValueError(f"{name} must be bfloat16, got {t.dtype}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    red_name = "Kd" if red_dim == 1 else "Nd"
    if x.dim() != 2:
        raise ValueError(f"{x_name} must be 2-D [N, {red_name}], got shape {tuple(x.shape)}")
    if w_home.dim() != 3:
        raise ValueError(f"w_home must be 3-D [epn, Kd, Nd], got shape {tuple(w_home.shape)}")
    if w_slot.dim() != 3:
        raise ValueError(f"w_slot must be 3-D [B, Kd, Nd], got shape {tuple(w_slot.shape)}")
    n, red = x.shape
    epn, kd, nd = w_home.shape
    nb, kd_s, nd_s = w_slot.shape
    if epn < 1:
        raise ValueError(f"w_home must hold at least one expert (epn >= 1), got epn={epn}")
    if w_home.shape[red_dim] != red:
        raise ValueError(
            f"w_home.shape[{red_dim}] ({red_name}={w_home.shape[red_dim]}) must equal "
            f"{x_name}.shape[1] ({red_name}={red})"
        )
    if (kd_s, nd_s) != (kd, nd):
        raise ValueError(
            f"w_slot must be [B, Kd={kd}, Nd={nd}] like w_home, got shape {tuple(w_slot.shape)}"
        )
    if kd < 8 or kd % 8:
        raise ValueError(f"Kd (w_home.shape[1]) must be a positive multiple of 8, got {kd}")
    if nd < 8 or nd % 8:
        raise ValueError(f"Nd (w_home.shape[2]) must be a positive multiple of 8, got {nd}")
    remote_tensors = ()
    if remote is not None:
        remote_tensors = _check_remote(remote, peer_names)
    _check_cu(cu_seqlens, epn + nb, remote_tensors[0][1].shape[0] if remote_tensors else 0)
    if not check_device:
        return n, kd, nd, epn, nb
    dev = x.device
    for name, t in (("w_home", w_home), ("w_slot", w_slot), ("cu_seqlens", cu_seqlens)) + remote_tensors:
        if t.device != dev:
            raise ValueError(f"{name} must be on the same device as {x_name} ({dev}), got {t.device}")
    if dev.type != "cuda":
        raise ValueError(f"{x_name} must be a CUDA tensor for the CuTe kernel, got device {dev}")
    for name, t in ((x_name, x), ("w_home", w_home), ("w_slot", w_slot)):
        if t.numel() and t.data_ptr() % 16:
            raise ValueError(f"{name} must be 16-byte aligned")
    return n, kd, nd, epn, nb


def _check_cu(cu_seqlens, num_groups, n_remote=0):
    if cu_seqlens.dtype != torch.int32:
        raise ValueError(f"cu_seqlens must be int32, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] != num_groups + n_remote:
        what = f"epn + B + n_remote = {num_groups} + {n_remote}" if n_remote else f"epn + B = {num_groups}"
        raise ValueError(f"cu_seqlens must be 1-D of length {what}, got shape {tuple(cu_seqlens.shape)}")
    if not cu_seqlens.is_contiguous():
        raise ValueError("cu_seqlens must be contiguous")


def _check_remote(remote, peer_names):
    """Checks of ``remote`` = (remote_experts, *peers) (dtype, 1-D, non-empty, contiguous; the caller
    checks the devices); returns ((name, tensor), ...) of its tensors. The values live on the device and
    are not checked (no host sync): see the preconditions in ``group_gemm_row_scale``."""
    names = ("remote_experts",) + tuple(peer_names)
    if not isinstance(remote, tuple) or len(remote) != len(names):
        raise ValueError(f"remote must be None or a tuple ({', '.join(names)}), got {type(remote).__name__}"
                         + (f" of length {len(remote)}" if isinstance(remote, tuple) else ""))
    for (name, what, dtype), t in zip(
        [("remote_experts", "at least one remote group (n_remote >= 1)", torch.int32)]
        + [(pn, "at least one rank's address (R >= 1)", torch.int64) for pn in peer_names],
        remote,
    ):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != dtype:
            raise ValueError(f"{name} must be {str(dtype).replace('torch.', '')}, got {t.dtype}")
        if t.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
        if t.shape[0] < 1:
            raise ValueError(f"{name} must hold {what}, got shape {tuple(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if len(peer_names) > 1 and any(t.shape != remote[1].shape for t in remote[2:]):
        raise ValueError(f"{', '.join(peer_names)} must have the same length (one address per rank), got "
                         f"{', '.join(str(tuple(t.shape)) for t in remote[1:])}")
    return tuple(zip(names, remote))


def _desc_workspace(device: torch.device, num_rings: int) -> torch.Tensor:
    """Per launch of a kernel with remote groups: one 128-byte descriptor slot per CTA (at most #SMs)
    and B ring, 128-byte aligned (the caching allocator's blocks are 512-byte aligned)."""
    ws = torch.empty(num_rings * _device_info(device)[1] * (_DESC_BYTES // 8), dtype=torch.int64, device=device)
    assert ws.data_ptr() % _DESC_BYTES == 0
    return ws


_DEVICE_INFO: dict[int, tuple[tuple[int, int], int]] = {}
# (op, Kd, Nd, P, device index) -> compiled kernel: skips the config/key work on the hot path.
_LAUNCH_CACHE: dict[tuple, Any] = {}


def _device_info(device: torch.device) -> tuple[tuple[int, int], int]:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    info = _DEVICE_INFO.get(idx)
    if info is None:
        props = torch.cuda.get_device_properties(idx)
        info = _DEVICE_INFO[idx] = ((props.major, props.minor), props.multi_processor_count)
    return info


def _compile_op(op: str, kd: int, nd: int, pad: int, num_sms: int):
    """The kernel of ``op`` ("fwd", "dgrad", "wgrad", "row_scale", "swiglu", "swiglu_h_only",
    "swiglu_bwd"; "row_scale_remote", "swiglu_remote", "swiglu_h_only_remote": with remote groups) for
    static (Kd, Nd) (H, F for the SwiGLU ops), padding P and ``num_sms``."""
    if op == "fwd":
        return compile_group_gemm(kd, nd, select_config(pad, nd, num_sms))
    if op == "dgrad":
        return compile_group_gemm_dgrad(kd, nd, select_config(pad, kd, num_sms))
    if op == "wgrad":
        return compile_group_gemm_wgrad(kd, nd, select_wgrad_config(pad, kd, nd, num_sms))
    if op in ("row_scale", "row_scale_remote"):
        return compile_group_gemm_row_scale(kd, nd, select_config(pad, nd, num_sms), op == "row_scale_remote")
    if op in ("swiglu", "swiglu_h_only", "swiglu_remote", "swiglu_h_only_remote"):
        return compile_group_gemm_swiglu(kd, nd, select_swiglu_config(pad, nd, num_sms),
                                         op in ("swiglu", "swiglu_remote"), op.endswith("_remote"))
    if op == "swiglu_bwd":
        return compile_group_gemm_swiglu_bwd(kd, nd, select_swiglu_bwd_config(pad, num_sms))
    raise ValueError(f"unknown op {op!r}")


def _launcher(op: str, kd: int, nd: int, pad: int, device: torch.device):
    fast_key = (op, kd, nd, pad, device.index)
    fn = _LAUNCH_CACHE.get(fast_key)
    if fn is None:
        cc, num_sms = _device_info(device)
        if cc != (9, 0):
            raise ValueError(
                f"tensors must be on a Hopper (sm_90) GPU, got compute capability {cc[0]}.{cc[1]}"
            )
        fn = _LAUNCH_CACHE[fast_key] = _compile_op(op, kd, nd, pad, num_sms)
    return fn


def _out_tensor(out, n, cols, device):
    if out is None:
        return torch.empty(n, cols, dtype=torch.bfloat16, device=device)
    if out.shape != (n, cols) or out.dtype != torch.bfloat16 or not out.is_contiguous() or out.device != device:
        raise ValueError(f"out must be a contiguous bf16 [{n}, {cols}] tensor on {device}")
    return out


def _slot_map(w_slot: torch.Tensor, w_home: torch.Tensor) -> torch.Tensor:
    """``w_slot``, or ``w_home`` in its place when B == 0: a zero-sized tensor map cannot be encoded,
    and with no slot groups no tile ever reads (or writes) the slot map."""
    return w_home if w_slot.shape[0] == 0 else w_slot


def _rows_gemm(op: str, a, w_home, w_slot, cu_seqlens, pad: int, out, a_name: str, red_dim: int):
    """Forward (``red_dim`` 1) or dgrad (``red_dim`` 2): ``a [N, red] @ op(W_g)`` per group."""
    n, kd, nd, epn, nb = _check_inputs(a, w_home, w_slot, cu_seqlens, pad, x_name=a_name, red_dim=red_dim)
    fn = _launcher(op, kd, nd, pad, a.device)
    c = _out_tensor(out, n, nd if red_dim == 1 else kd, a.device)
    if n:
        fn(a, w_home, _slot_map(w_slot, w_home), cu_seqlens, c)
    return c


def group_gemm_fwd(
    x: torch.Tensor,
    w_home: torch.Tensor,
    w_slot: torch.Tensor,
    cu_seqlens: torch.Tensor,
    pad: int = 128,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y[N, Nd] = group_gemm(x, w_home, w_slot, cu_seqlens)`` on the GPU (no host sync).

    ``pad`` is P, the multiple every group length has (a power of two >= 64 for this kernel).
    """
    return _rows_gemm("fwd", x, w_home, w_slot, cu_seqlens, pad, out, "x", 1)


def group_gemm_dgrad(
    dy: torch.Tensor,
    w_home: torch.Tensor,
    w_slot: torch.Tensor,
    cu_seqlens: torch.Tensor,
    pad: int = 128,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``dx[N, Kd]``: ``dx[rows of g] = dy[rows of g] @ W_g^T``, rows past the last group zero (no host
    sync). ``pad`` is P (a power of two >= 64)."""
    return _rows_gemm("dgrad", dy, w_home, w_slot, cu_seqlens, pad, out, "dy", 2)


def group_gemm_row_scale(
    x: torch.Tensor,
    w_home: torch.Tensor,
    w_slot: torch.Tensor,
    cu_seqlens: torch.Tensor,
    row_w: torch.Tensor,
    pad: int = 128,
    out: torch.Tensor | None = None,
    remote: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``y[r] = (x[r] @ W_g) * row_w[r]``: the forward with a per-row fp32 scale applied to the fp32
    accumulators before the bf16 convert (the route weights of the down projection). Rows past the last
    group are zero. ``row_w`` is fp32 ``[N]``. No host sync.

    ``remote`` (inference): None, or ``(remote_experts, peers)``: then the last ``n_remote`` groups are
    remote groups, whose weights are read straight from their home rank (peer-mapped), and
    ``cu_seqlens`` has ``G = epn + B + n_remote`` entries. ``remote_experts`` int32 ``[n_remote >= 1]``
    (CUDA) holds the remote groups' global expert ids (ascending, -1 = an unused group); ``peers`` int64
    ``[R]`` (CUDA) holds ``peers[r]`` = the device address (valid on this GPU, e.g. torch symmetric memory)
    of rank r's home weights, a contiguous bf16 ``[epn, Kd, Nd]`` tensor like ``w_home``. Remote group j
    multiplies by ``W = (rank e // epn's home weights)[e % epn]``, ``e = remote_experts[j]``.
    Preconditions (on the device values, not checked: no host sync): every remote expert of a launch
    comes from one donor rank (each CTA builds its remote descriptor once, at its first remote tile: a
    different donor would need a new descriptor while loads that use the old one are in flight, i.e. the
    ring drained first; the kernel would read the first donor's weights instead), ``0 <= e < R * epn``
    for every used group, an unused group (-1) is empty, and every peer
    address is 16-byte aligned."""
    n, kd, nd, epn, nb = _check_inputs(x, w_home, w_slot, cu_seqlens, pad, check_device=False, remote=remote)
    if not isinstance(row_w, torch.Tensor):
        raise ValueError(f"row_w must be a torch.Tensor, got {type(row_w).__name__}")
    if row_w.dtype != torch.float32:
        raise ValueError(f"row_w must be float32, got {row_w.dtype}")
    if row_w.dim() != 1 or row_w.shape[0] != n:
        raise ValueError(f"row_w must be 1-D [N={n}] (one scale per row of x), got shape {tuple(row_w.shape)}")
    if not row_w.is_contiguous():
        raise ValueError("row_w must be contiguous")
    _check_inputs(x, w_home, w_slot, cu_seqlens, pad, remote=remote)
    if row_w.device != x.device:
        raise ValueError(f"row_w must be on the same device as x ({x.device}), got {row_w.device}")
    fn = _launcher("row_scale" if remote is None else "row_scale_remote", kd, nd, pad, x.device)
    y = _out_tensor(out, n, nd, x.device)
    if n:
        if remote is None:
            fn(x, w_home, _slot_map(w_slot, w_home), cu_seqlens, row_w, y)
        else:
            fn(x, w_home, _slot_map(w_slot, w_home), cu_seqlens, row_w, y, *remote, _desc_workspace(x.device, 1))
    return y


def group_gemm_swiglu(
    x: torch.Tensor,
    w_gate_home: torch.Tensor,
    w_gate_slot: torch.Tensor,
    w_up_home: torch.Tensor,
    w_up_slot: torch.Tensor,
    cu_seqlens: torch.Tensor,
    pad: int = 128,
    store_preact: bool = True,
    out: torch.Tensor | None = None,
    gate_out: torch.Tensor | None = None,
    up_out: torch.Tensor | None = None,
    remote: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Fused gate/up projection with a SwiGLU epilogue, one kernel: per group g,
    ``gate = x_g @ Wgate_g``, ``up = x_g @ Wup_g`` (fp32 accumulators, never rounded before the
    activation) and ``h = silu(gate) * up`` in fp32, stored bf16. Returns ``(h, gate, up)``: gate and up
    are the bf16 pre-activations (what backward needs) when ``store_preact``, else None (inference).
    Weights ``[epn, H, F]`` home and ``[B, H, F]`` slot, as in ``group_gemm_fwd``. No host sync.

    ``remote`` (inference): None, or ``(remote_experts, gate_peers, up_peers)``: the last ``n_remote``
    groups are remote groups, read from their home rank's gate and up weights (``gate_peers[r]``,
    ``up_peers[r]``: addresses of rank r's ``[epn, H, F]`` home weights, like ``w_gate_home`` /
    ``w_up_home``), with ``G = epn + B + n_remote``; as in ``group_gemm_row_scale``, preconditions
    included (one donor rank per launch)."""
    gate_names, up_names = ("w_gate_home", "w_gate_slot"), ("w_up_home", "w_up_slot")
    peer_names = ("gate_peers", "up_peers")
    n, hd, f, epn, nb = _check_inputs(x, w_gate_home, w_gate_slot, cu_seqlens, pad, w_names=gate_names,
                                      check_device=False, remote=remote, peer_names=peer_names)
    for name, t, like, ref in (("w_up_home", w_up_home, "w_gate_home", w_gate_home),
                               ("w_up_slot", w_up_slot, "w_gate_slot", w_gate_slot)):
        if isinstance(t, torch.Tensor) and t.shape != ref.shape:
            raise ValueError(f"{name} must have the shape of {like} {tuple(ref.shape)}, got {tuple(t.shape)}")
    _check_inputs(x, w_up_home, w_up_slot, cu_seqlens, pad, w_names=up_names, check_device=False, remote=remote,
                  peer_names=peer_names)
    _check_inputs(x, w_gate_home, w_gate_slot, cu_seqlens, pad, w_names=gate_names, remote=remote,
                  peer_names=peer_names)
    _check_inputs(x, w_up_home, w_up_slot, cu_seqlens, pad, w_names=up_names, remote=remote, peer_names=peer_names)
    op = "swiglu" if store_preact else "swiglu_h_only"
    fn = _launcher(op if remote is None else op + "_remote", hd, f, pad, x.device)
    h = _out_tensor(out, n, f, x.device)
    gate = _out_tensor(gate_out, n, f, x.device) if store_preact else None
    up = _out_tensor(up_out, n, f, x.device) if store_preact else None
    if n:
        args = (x, w_gate_home, _slot_map(w_gate_slot, w_gate_home), w_up_home, _slot_map(w_up_slot, w_up_home),
                cu_seqlens, h, gate if store_preact else h, up if store_preact else h)
        if remote is None:
            fn(*args)
        else:
            fn(*args, *remote, _desc_workspace(x.device, 2))
    return h, gate, up


def group_gemm_swiglu_bwd(
    g_y: torch.Tensor,
    w_down_home: torch.Tensor,
    w_down_slot: torch.Tensor,
    cu_seqlens: torch.Tensor,
    row_w: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    pad: int = 128,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of ``y = group_gemm_row_scale(swiglu(gate, up), W_down, row_w)`` up to the gate/up
    pre-activations, one kernel: ``d = g_y @ W_down_g^T`` (fp32) and, in its epilogue, from the saved bf16
    ``gate``/``up`` and ``row_w``: ``g_gate``, ``g_up`` (bf16, the gate/up projections' output gradients),
    ``h_w = row_w * silu(gate) * up`` (bf16, the down projection's wgrad operand: ``dW_down_g += h_w_g^T
    g_y_g``) and ``g_row_w[r] = sum_f d[r, f] * h[r, f]`` (fp32 [N], the route weights' gradient; per
    128-column tile partial sums, added here in a fixed order). Weights ``[epn, F, H]`` / ``[B, F, H]``.
    No host sync."""
    n, f, hd, epn, nb = _check_inputs(g_y, w_down_home, w_down_slot, cu_seqlens, pad, x_name="g_y", red_dim=2,
                                      w_names=("w_down_home", "w_down_slot"), check_device=False)
    for name, t, dt, shape in (("row_w", row_w, torch.float32, (n,)), ("gate", gate, torch.bfloat16, (n, f)),
                               ("up", up, torch.bfloat16, (n, f))):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != dt:
            raise ValueError(f"{name} must be {str(dt).replace('torch.', '')}, got {t.dtype}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)} (N rows of g_y, F = w_down_home.shape[1]), "
                             f"got {list(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    _check_inputs(g_y, w_down_home, w_down_slot, cu_seqlens, pad, x_name="g_y", red_dim=2,
                  w_names=("w_down_home", "w_down_slot"))
    for name, t in (("row_w", row_w), ("gate", gate), ("up", up)):
        if t.device != g_y.device:
            raise ValueError(f"{name} must be on the same device as g_y ({g_y.device}), got {t.device}")
        if t.numel() and t.data_ptr() % 16:
            raise ValueError(f"{name} must be 16-byte aligned")
    fn = _launcher("swiglu_bwd", hd, f, pad, g_y.device)
    tile_n = 128  # select_swiglu_bwd_config
    dev = g_y.device
    g_gate, g_up, h_w = (torch.empty(n, f, dtype=torch.bfloat16, device=dev) for _ in range(3))
    part = torch.empty(n, (f + tile_n - 1) // tile_n, dtype=torch.float32, device=dev)
    if n:
        fn(g_y, w_down_home, _slot_map(w_down_slot, w_down_home), cu_seqlens, row_w, gate, up, g_gate, g_up, h_w,
           part)
    return g_gate, g_up, h_w, part.sum(1)


def group_gemm_wgrad(
    x: torch.Tensor,
    dy: torch.Tensor,
    cu_seqlens: torch.Tensor,
    dw_home: torch.Tensor,
    dw_slot: torch.Tensor,
    pad: int = 128,
) -> None:
    """Home groups: ``dw_home[g] = x[rows of g]^T @ dy[rows of g]``, *written* in bf16 (fp32
    accumulation, one rounding; a home group with no rows gets zeros: every element of ``dw_home``
    ``[epn, Kd, Nd]`` is written). Slot groups: ``dw_slot[j] += x[rows of g]^T @ dy[rows of g]`` in fp32,
    in place (``dw_slot`` ``[B, Kd, Nd]``, the copies' reduce buffers); empty slot groups are not
    touched. No host sync. ``pad`` is P (a power of two >= 64)."""
    for name, t in (("x", x), ("dy", dy), ("cu_seqlens", cu_seqlens), ("dw_home", dw_home), ("dw_slot", dw_slot)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    for name, t, dt in (("x", x, torch.bfloat16), ("dy", dy, torch.bfloat16),
                        ("dw_home", dw_home, torch.bfloat16), ("dw_slot", dw_slot, torch.float32)):
        if t.dtype != dt:
            raise ValueError(f"{name} must be {str(dt).replace('torch.', '')}, got {t.dtype}")
    if x.dim() != 2 or dy.dim() != 2 or dy.shape[0] != x.shape[0]:
        raise ValueError(f"x [N, Kd] and dy [N, Nd] must be 2-D with equal N, got {tuple(x.shape)}, {tuple(dy.shape)}")
    n, kd = x.shape
    nd = dy.shape[1]
    if dw_home.dim() != 3 or tuple(dw_home.shape[1:]) != (kd, nd) or dw_home.shape[0] < 1:
        raise ValueError(f"dw_home must be [epn >= 1, Kd={kd}, Nd={nd}], got shape {tuple(dw_home.shape)}")
    if dw_slot.dim() != 3 or tuple(dw_slot.shape[1:]) != (kd, nd):
        raise ValueError(f"dw_slot must be [B, Kd={kd}, Nd={nd}], got shape {tuple(dw_slot.shape)}")
    if kd < 8 or kd % 8 or nd < 8 or nd % 8:
        raise ValueError(f"Kd and Nd must be positive multiples of 8, got Kd={kd}, Nd={nd}")
    _check_cu(cu_seqlens, dw_home.shape[0] + dw_slot.shape[0])
    dev = x.device
    for name, t in (("dy", dy), ("cu_seqlens", cu_seqlens), ("dw_home", dw_home), ("dw_slot", dw_slot)):
        if t.device != dev:
            raise ValueError(f"{name} must be on the same device as x ({dev}), got {t.device}")
    if dev.type != "cuda":
        raise ValueError(f"x must be a CUDA tensor for the CuTe kernel, got device {dev}")
    for name, t in (("x", x), ("dy", dy), ("dw_home", dw_home), ("dw_slot", dw_slot)):
        if t.numel() and t.data_ptr() % 16:
            raise ValueError(f"{name} must be 16-byte aligned")
    fn = _launcher("wgrad", kd, nd, pad, dev)
    if n == 0:  # no rows: every group is empty, the home gradients are zero
        dw_home.zero_()
        return
    fn(x, dy, cu_seqlens, dw_home, dw_slot if dw_slot.shape[0] else _no_slots_f32(dw_home))


def _no_slots_f32(dw_home: torch.Tensor) -> torch.Tensor:
    """The wgrad kernel's fp32 slot argument when B == 0: an empty ``[0, Kd, Nd]`` fp32 view at
    ``dw_home``'s (valid, 16-byte aligned) address. No work item touches it: there are no slot groups."""
    _, kd, nd = dw_home.shape
    return dw_home.view(torch.float32).as_strided((0, kd, nd), (kd * nd, nd, 1))


# ---------------------------------------------------------------------------------------------------
# CI: compile for sm_90a without a GPU
# ---------------------------------------------------------------------------------------------------


def _compile_only(kd: int = 7168, nd: int = 2048, pad: int = 128, num_sms: int = H100_H200_NUM_SMS,
                  op: str = "fwd") -> None:
    """Child-process entry of ``compile_group_gemm_for_sm90`` (environment already set)."""
    from csrc_cute.compile_check import expect_no_driver

    with expect_no_driver():
        _compile_op(op, kd, nd, pad, num_sms)


def _wgrad_epilogue_coverage(tile_m: int = 128, tile_n: int = 256) -> dict:
    """CPU check of the wgrad slot-group epilogue's thread -> element map (the fp32 read-add-write into
    the reduce buffers; layout algebra at trace time only).

    Returns how many (row, col) of a ``tile_m x tile_n`` output tile the consumer threads' partitions
    (``GroupGemmWgradSm90.epilogue_partition``) write, how many distinct ones, and the tile size: every
    element must be written by exactly one thread. Run with ``CUTE_DSL_ARCH=sm_90a`` (see the tests).
    """
    import cutlass
    import cutlass.cute as cute

    from csrc_cute.compile_check import expect_no_driver

    kernel = _kernel_classes()[1](GroupGemmConfig(tile_m, tile_n, 1))
    seen: list[tuple[int, int]] = []

    @cute.jit
    def probe():
        kernel._setup_mainloop()
        tile = cute.make_identity_tensor((tile_m, tile_n))
        for t in cutlass.range_constexpr(kernel.num_mma_threads):
            part = kernel.epilogue_partition(kernel.tiled_mma, t, tile)
            for i in cutlass.range_constexpr(cute.size(part)):
                seen.append(tuple(int(v) for v in part[i]))

    with expect_no_driver():
        cute.compile(probe)
    inside = all(0 <= r < tile_m and 0 <= c < tile_n for r, c in seen)
    return dict(writes=len(seen), distinct=len(set(seen)), elements=tile_m * tile_n, inside=inside)


def _swiglu_bwd_row_quads(tile_m: int = 128, tile_n: int = 128) -> dict:
    """CPU check of the SwiGLU-backward epilogue's row reduction (layout algebra at trace time only).

    The kernel sums ``d * h`` per accumulator element into one register per static row slot
    (``row_slot``), then over the four lanes of a quad (xor shuffles 1 and 2), and lane 0 of the quad
    writes the row. Correct iff, for every consumer thread: the elements of a slot share one row
    (``row_first`` names it), the lanes of a quad hold the same rows, and a quad's elements of a row
    cover all ``tile_n`` columns once. Returns the number of violations of each and the counts checked.
    """
    import cutlass
    import cutlass.cute as cute

    from csrc_cute.compile_check import expect_no_driver

    kernel = _kernel_classes()[4](GroupGemmConfig(tile_m, 128, 1))
    kernel.tile_n = tile_n
    per_thread: list[list[tuple[int, int]]] = []

    @cute.jit
    def probe():
        kernel._setup_mainloop()
        kernel._row_slots()
        tile = cute.make_identity_tensor((tile_m, tile_n))
        for t in cutlass.range_constexpr(kernel.num_mma_threads):
            part = kernel.tiled_mma.get_slice(t).partition_C(tile)
            per_thread.append([tuple(int(v) for v in part[i]) for i in range(cute.size(part))])

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


def compile_group_gemm_for_sm90(
    dump_dir: str, kd: int = 7168, nd: int = 2048, pad: int = 128, num_sms: int = H100_H200_NUM_SMS,
    op: str = "fwd",
):
    """Compile one kernel (``op`` = "fwd", "dgrad", "wgrad", "row_scale", "swiglu", "swiglu_h_only",
    "swiglu_bwd", or with remote groups "row_scale_remote", "swiglu_remote", "swiglu_h_only_remote"; for
    the SwiGLU ops ``kd`` is H and ``nd`` is F) for sm_90a (works on a CPU-only machine) and return a
    ``CompileCheckResult`` with the PTX/cubin paths and ptxas statistics (registers, shared memory,
    spills)."""
    from csrc_cute.compile_check import run_compile_check

    return run_compile_check(
        "csrc_cute.group_gemm:_compile_only",
        dump_dir,
        dict(kd=kd, nd=nd, pad=pad, num_sms=num_sms, op=op),
        arch="sm_90a",
    )
