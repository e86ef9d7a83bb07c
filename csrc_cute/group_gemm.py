"""Grouped GEMM forward for Hopper (sm_90a) in the CuTe DSL: ``y = group_gemm(x, w_home, w_slot, cu_seqlens)``.

Semantics (the CPU reference is ``moonep::group_gemm``'s CPU implementation in ``moonep_ops/ops.py``)::

    x [N, Kd] bf16, w_home [epn, Kd, Nd] bf16, w_slot [B, Kd, Nd] bf16, cu_seqlens [epn + B] int32
    group g = rows [cu[g-1], cu[g]) (cu[-1] = 0), weight W_g = w_home[g] if g < epn else w_slot[g - epn]
    y[s:e] = (x[s:e].float() @ W_g.float()).bfloat16();  rows at or past cu[G-1] are zero.

Kernel design. Every group length is a multiple of the padding ``P``, so with ``tile_M`` dividing ``P``
each M tile of the output lies in exactly one group: the kernel is a dense persistent GEMM over
``[N, Kd] x [Kd, Nd]`` in which each M tile picks its B operand on the device. The tile's group is the
number of group ends ``cu[g] <= m0`` (``m0`` = first row of the tile), counted by one warp with a ballot
over ``cu_seqlens`` 32 entries at a time; each warp that needs it computes it itself (no host sync, no
shared-memory hand-off). A tile whose group index reaches ``G`` lies past the last group: no loads, no
MMA, its accumulators stay zero and the epilogue writes zeros. The grid depends only on ``N`` and ``Nd``
(``min(#tiles, #SMs)`` persistent CTAs, tiles in M-major raster).

Per CTA: warp group 0 is the producer (one warp issues TMA loads of the A tile and the B tile -- from the
``w_home`` or ``w_slot`` tensor map -- into a multi-stage shared-memory ring guarded by mbarriers), warp
groups 1.. are consumers (``wgmma`` bf16 x bf16 -> fp32 with A and B from shared memory, B N-major since
``W_g`` is ``[Kd, Nd]`` with ``Nd`` contiguous), then an epilogue of register -> shared (stmatrix) ->
global (TMA store) in sub-tiles. Register budgets are rebalanced with ``setmaxnreg``.

Host side: ``group_gemm_fwd`` validates, compiles once per static key into ``_COMPILED`` (fake tensors,
symbolic ``N``/``epn``/``B``/``G``, ``--enable-tvm-ffi``, environment stream) and launches on torch's
current stream. ``compile_group_gemm_for_sm90`` compiles on a CPU-only machine for CI (see
``compile_check``).
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch

__all__ = [
    "group_gemm_fwd",
    "GroupGemmConfig",
    "select_config",
    "compile_group_gemm",
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


def _build_kernel_class():
    import cuda.bindings.driver as cuda

    import cutlass
    import cutlass.cute as cute
    import cutlass.pipeline as pipeline
    import cutlass.utils as utils
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass.cute.nvgpu import cpasync, warpgroup
    from cutlass.utils import LayoutEnum

    class GroupGemmSm90:
        """Persistent, warp-specialised grouped GEMM (see the module docstring)."""

        def __init__(self, config: GroupGemmConfig):
            self.tile_m, self.tile_n = config.tile_m, config.tile_n
            self.num_sms = config.num_sms
            self.tile_k = 64
            self.ab_dtype = cutlass.BFloat16
            self.c_dtype = cutlass.BFloat16
            self.acc_dtype = cutlass.Float32
            # Each consumer warp group owns 64 rows of the tile.
            self.num_mma_wg = self.tile_m // 64
            self.atom_layout_mnk = (self.num_mma_wg, 1, 1)
            self.threads_per_wg = 128
            self.num_threads = (1 + self.num_mma_wg) * self.threads_per_wg
            self.num_mma_threads = self.num_mma_wg * self.threads_per_wg
            self.load_regs = 40
            self.mma_regs = 232 if self.num_mma_wg == 2 else 240
            self.epi_store_warp = 4  # first warp of the first consumer warp group
            self.smem_capacity = utils.get_smem_capacity_in_bytes("sm_90")
            self.a_layout = LayoutEnum.ROW_MAJOR  # x [N, Kd]: K-major
            self.b_layout = LayoutEnum.COL_MAJOR  # W_g viewed (Nd, Kd): N-major
            self.c_layout = LayoutEnum.ROW_MAJOR  # y [N, Nd]: N-major
            # Sub-tile of the epilogue: all consumer warp groups' rows x 32 columns.
            self.epi_tile = (self.tile_m, 32)
            self.epi_stage = 4
            a_bytes = self.tile_m * self.tile_k * 2
            b_bytes = self.tile_n * self.tile_k * 2
            epi_bytes = self.epi_tile[0] * self.epi_tile[1] * 2 * self.epi_stage
            self.ab_stage = min(8, (self.smem_capacity - 2048 - epi_bytes) // (a_bytes + b_bytes))
            self.buffer_align = 1024

        def _setup(self):
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
            self.epi_smem_staged = sm90_utils.make_smem_layout_epi(
                self.c_dtype, self.c_layout, self.epi_tile, self.epi_stage
            )

        @cute.jit
        def __call__(
            self,
            x: cute.Tensor,  # (N, Kd), Kd contiguous
            w_home: cute.Tensor,  # (epn, Kd, Nd), Nd contiguous
            w_slot: cute.Tensor,  # (B, Kd, Nd), Nd contiguous
            cu_seqlens: cute.Tensor,  # (G,) int32
            y: cute.Tensor,  # (N, Nd), Nd contiguous
            stream: cuda.CUstream,
        ):
            self._setup()
            # B operand views (Nd, Kd, E): N-major, as wgmma sees B.
            b_home = cute.make_tensor(w_home.iterator, cute.select(w_home.layout, mode=[2, 1, 0]))
            b_slot = cute.make_tensor(w_slot.iterator, cute.select(w_slot.layout, mode=[2, 1, 0]))

            a_smem = cute.slice_(self.a_smem_staged, (None, None, 0))
            b_smem = cute.slice_(self.b_smem_staged, (None, None, 0))
            epi_smem = cute.slice_(self.epi_smem_staged, (None, None, 0))
            tma_a, mA = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(), x, a_smem, (self.tile_m, self.tile_k)
            )
            tma_bh, mBh = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(), b_home, b_smem, (self.tile_n, self.tile_k)
            )
            tma_bs, mBs = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(), b_slot, b_smem, (self.tile_n, self.tile_k)
            )
            tma_c, mC = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), y, epi_smem, self.epi_tile
            )

            num_m_tiles = cute.ceil_div(cute.size(x, mode=[0]), self.tile_m)
            num_n_tiles = cute.ceil_div(cute.size(y, mode=[1]), self.tile_n)
            num_tiles = num_m_tiles * num_n_tiles
            grid_x = cutlass.min(num_tiles, self.num_sms)

            @cute.struct
            class SharedStorage:
                mbar: cute.struct.MemRange[cutlass.Int64, self.ab_stage * 2]
                sA: cute.struct.Align[
                    cute.struct.MemRange[self.ab_dtype, cute.cosize(self.a_smem_staged)],
                    self.buffer_align,
                ]
                sB: cute.struct.Align[
                    cute.struct.MemRange[self.ab_dtype, cute.cosize(self.b_smem_staged)],
                    self.buffer_align,
                ]
                sC: cute.struct.Align[
                    cute.struct.MemRange[self.c_dtype, cute.cosize(self.epi_smem_staged)],
                    self.buffer_align,
                ]

            self.shared_storage = SharedStorage

            self.kernel(
                tma_a,
                mA,
                tma_bh,
                mBh,
                tma_bs,
                mBs,
                tma_c,
                mC,
                cu_seqlens,
                self.tiled_mma,
                self.a_smem_staged,
                self.b_smem_staged,
                self.epi_smem_staged,
                num_n_tiles,
                num_tiles,
            ).launch(
                grid=[grid_x, 1, 1],
                block=[self.num_threads, 1, 1],
                min_blocks_per_mp=1,
                stream=stream,
            )

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
            tiled_mma: cute.TiledMma,
            a_smem_staged: cute.ComposedLayout,
            b_smem_staged: cute.ComposedLayout,
            epi_smem_staged: cute.ComposedLayout,
            num_n_tiles: cutlass.Int32,
            num_tiles: cutlass.Int32,
        ):
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            gdim, _, _ = cute.arch.grid_dim()
            warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            wg_idx = cute.arch.make_warp_uniform(tidx // self.threads_per_wg)

            if warp_idx == 0:
                cpasync.prefetch_descriptor(tma_a)
                cpasync.prefetch_descriptor(tma_bh)
                cpasync.prefetch_descriptor(tma_bs)
                cpasync.prefetch_descriptor(tma_c)

            num_groups = cute.size(cu_seqlens, mode=[0])
            num_home = cute.size(mBh, mode=[2])

            smem = cutlass.utils.SmemAllocator()
            storage = smem.allocate(self.shared_storage)

            a_smem = cute.slice_(a_smem_staged, (None, None, 0))
            b_smem = cute.slice_(b_smem_staged, (None, None, 0))
            tx_bytes = cute.size_in_bytes(self.ab_dtype, a_smem) + cute.size_in_bytes(
                self.ab_dtype, b_smem
            )
            mainloop = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.mbar.data_ptr(),
                num_stages=self.ab_stage,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(
                    pipeline.Agent.Thread, self.num_mma_wg * 4
                ),
                tx_count=tx_bytes,
                cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
                defer_sync=True,
            )
            pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)

            sA = storage.sA.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
            sB = storage.sB.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
            sC = storage.sC.get_tensor(epi_smem_staged.outer, swizzle=epi_smem_staged.inner)

            # (bM, bK, RestM, RestK) / (bN, bK, RestN, RestK, E) / (bM, bN, RestM, RestN)
            gA = cute.local_tile(mA, (self.tile_m, self.tile_k), (None, None))
            gBh = cute.local_tile(mBh, (self.tile_n, self.tile_k), (None, None, None))
            gBs = cute.local_tile(mBs, (self.tile_n, self.tile_k), (None, None, None))
            gC = cute.local_tile(mC, (self.tile_m, self.tile_n), (None, None))

            tAsA, tAgA = cpasync.tma_partition(
                tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2)
            )
            tBsBh, tBgBh = cpasync.tma_partition(
                tma_bh, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2), cute.group_modes(gBh, 0, 2)
            )
            tBsBs, tBgBs = cpasync.tma_partition(
                tma_bs, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2), cute.group_modes(gBs, 0, 2)
            )
            k_tiles = cute.size(gA, mode=[3])

            pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))

            if wg_idx == 0:
                # ---------------- producer warp group ----------------
                cute.arch.setmaxregister_decrease(self.load_regs)
                if warp_idx == 0:
                    prod_state = pipeline.make_pipeline_state(
                        pipeline.PipelineUserType.Producer, self.ab_stage
                    )
                    for tile in cutlass.range(bidx, num_tiles, gdim, unroll=1):
                        m_idx = tile // num_n_tiles
                        n_idx = tile % num_n_tiles
                        g = self.tile_group(cu_seqlens, m_idx * self.tile_m)
                        k_count = k_tiles if g < num_groups else 0
                        for k in cutlass.range(k_count, unroll=1):
                            mainloop.producer_acquire(prod_state)
                            bar = mainloop.producer_get_barrier(prod_state)
                            cute.copy(
                                tma_a,
                                tAgA[(None, m_idx, k)],
                                tAsA[(None, prod_state.index)],
                                tma_bar_ptr=bar,
                            )
                            if g < num_home:
                                cute.copy(
                                    tma_bh,
                                    tBgBh[(None, n_idx, k, g)],
                                    tBsBh[(None, prod_state.index)],
                                    tma_bar_ptr=bar,
                                )
                            else:
                                cute.copy(
                                    tma_bs,
                                    tBgBs[(None, n_idx, k, g - num_home)],
                                    tBsBs[(None, prod_state.index)],
                                    tma_bar_ptr=bar,
                                )
                            mainloop.producer_commit(prod_state)
                            prod_state.advance()
                    mainloop.producer_tail(prod_state)
            else:
                # ---------------- consumer warp groups ----------------
                cute.arch.setmaxregister_increase(self.mma_regs)
                mma_tidx = tidx - self.threads_per_wg
                wg_layout = cute.make_layout(self.num_mma_wg, stride=self.threads_per_wg)
                thr_mma = tiled_mma.get_slice(wg_layout(wg_idx - 1))
                tCsA = thr_mma.partition_A(sA)
                tCsB = thr_mma.partition_B(sB)
                tCrA = tiled_mma.make_fragment_A(tCsA)
                tCrB = tiled_mma.make_fragment_B(tCsB)
                tCgC = thr_mma.partition_C(gC)
                acc = cute.make_rmem_tensor(tCgC.shape[:3], self.acc_dtype)
                num_k_blocks = cute.size(tCrA, mode=[2])

                read_state = pipeline.make_pipeline_state(
                    pipeline.PipelineUserType.Consumer, self.ab_stage
                )
                release_state = pipeline.make_pipeline_state(
                    pipeline.PipelineUserType.Consumer, self.ab_stage
                )

                # Epilogue: registers -> smem (stmatrix) -> gmem (TMA store).
                copy_atom_r2s = sm90_utils.get_smem_store_op(
                    self.c_layout, elem_ty_d=self.c_dtype, elem_ty_acc=self.acc_dtype
                )
                copy_atom_c = cute.make_copy_atom(
                    cute.nvgpu.warp.StMatrix8x8x16bOp(self.c_layout.is_m_major_c(), 4),
                    self.c_dtype,
                )
                tiled_copy_c_atom = cute.make_tiled_copy_C_atom(copy_atom_c, tiled_mma)
                tiled_copy_r2s = cute.make_tiled_copy_S(copy_atom_r2s, tiled_copy_c_atom)
                thr_copy_r2s = tiled_copy_r2s.get_slice(mma_tidx)
                tRS_sD = thr_copy_r2s.partition_D(sC)
                tRS_rAcc = tiled_copy_r2s.retile(acc)
                rD_shape = cute.shape(thr_copy_r2s.partition_S(sC))
                tRS_rD = cute.make_rmem_tensor(rD_shape[:3], self.acc_dtype)
                tRS_rD_out = cute.make_rmem_tensor(rD_shape[:3], self.c_dtype)
                size_rD = cute.size(tRS_rD)
                epi_bar = pipeline.NamedBarrier(barrier_id=1, num_threads=self.num_mma_threads)
                store_pipe = pipeline.PipelineTmaStore.create(
                    num_stages=self.epi_stage,
                    producer_group=pipeline.CooperativeGroup(
                        pipeline.Agent.Thread, self.num_mma_threads
                    ),
                )

                epi_count = cutlass.Int32(0)
                for tile in cutlass.range(bidx, num_tiles, gdim, unroll=1):
                    m_idx = tile // num_n_tiles
                    n_idx = tile % num_n_tiles
                    g = self.tile_group(cu_seqlens, m_idx * self.tile_m)
                    k_count = k_tiles if g < num_groups else 0
                    n_pro = 1 if k_count > 0 else 0

                    acc.fill(0.0)
                    tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                    warpgroup.fence()
                    for k in cutlass.range(n_pro, unroll=1):
                        mainloop.consumer_wait(read_state)
                        for kb in cutlass.range_constexpr(num_k_blocks):
                            coord = (None, None, kb, read_state.index)
                            cute.gemm(tiled_mma, acc, tCrA[coord], tCrB[coord], acc)
                        warpgroup.commit_group()
                        read_state.advance()
                    for k in cutlass.range(n_pro, k_count, unroll=1):
                        mainloop.consumer_wait(read_state)
                        for kb in cutlass.range_constexpr(num_k_blocks):
                            coord = (None, None, kb, read_state.index)
                            cute.gemm(tiled_mma, acc, tCrA[coord], tCrB[coord], acc)
                        warpgroup.commit_group()
                        warpgroup.wait_group(1)
                        mainloop.consumer_release(release_state)
                        release_state.advance()
                        read_state.advance()
                    warpgroup.wait_group(0)
                    for k in cutlass.range(n_pro, unroll=1):
                        mainloop.consumer_release(release_state)
                        release_state.advance()

                    # ---- epilogue ----
                    gC_tile = gC[(None, None, m_idx, n_idx)]
                    gC_epi = cute.zipped_divide(gC_tile, self.epi_tile)
                    bSG_sD, bSG_gD = cpasync.tma_partition(
                        tma_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2), gC_epi
                    )
                    epi_tiles = cute.size(gC_epi, mode=[1])
                    epi_shape = gC_epi.shape[1]
                    epi_layout = cute.make_layout(epi_shape, stride=(epi_shape[1], 1))
                    for e in cutlass.range_constexpr(epi_tiles):
                        for v in cutlass.range_constexpr(size_rD):
                            tRS_rD[v] = tRS_rAcc[e * size_rD + v]
                        tRS_rD_out.store(tRS_rD.load().to(self.c_dtype))
                        buf = (epi_count + e) % self.epi_stage
                        cute.copy(tiled_copy_r2s, tRS_rD_out, tRS_sD[(None, None, None, buf)])
                        cute.arch.fence_proxy("async.shared", space="cta")
                        epi_bar.arrive_and_wait()
                        if warp_idx == self.epi_store_warp:
                            cute.copy(
                                tma_c,
                                bSG_sD[(None, buf)],
                                bSG_gD[(None, epi_layout.get_hier_coord(e))],
                            )
                            store_pipe.producer_commit()
                            store_pipe.producer_acquire()
                        epi_bar.arrive_and_wait()
                    epi_count = epi_count + epi_tiles
                if warp_idx == self.epi_store_warp:
                    store_pipe.producer_tail()

    return GroupGemmSm90


_KERNEL_CLASS = None


def _kernel_class():
    global _KERNEL_CLASS
    if _KERNEL_CLASS is None:
        _KERNEL_CLASS = _build_kernel_class()
    return _KERNEL_CLASS


# ---------------------------------------------------------------------------------------------------
# Compilation (once per static key)
# ---------------------------------------------------------------------------------------------------

_COMPILED: dict[tuple, Any] = {}
_COMPILE_LOCK = threading.Lock()


def compile_group_gemm(kd: int, nd: int, config: GroupGemmConfig):
    """Compile (or fetch from the cache) the kernel for static (Kd, Nd, tile config, arch).

    Dynamic: N (rows), epn, B, G. The result takes torch tensors (x, w_home, w_slot, cu_seqlens, y)
    and runs on torch's current stream (tvm-ffi environment stream).
    """
    import cutlass
    import cutlass.cute as cute

    arch = os.environ.get("CUTE_DSL_ARCH", "")
    key = ("group_gemm_fwd", "bf16", "bf16", "f32", int(kd), int(nd), tuple(config), arch)
    fn = _COMPILED.get(key)
    if fn is not None:
        return fn
    with _COMPILE_LOCK:
        fn = _COMPILED.get(key)
        if fn is not None:
            return fn
        n = cute.sym_int()
        epn = cute.sym_int()
        nb = cute.sym_int()
        ng = cute.sym_int()
        rt = cute.runtime
        x_f = rt.make_fake_compact_tensor(cutlass.BFloat16, (n, kd), stride_order=(1, 0), assumed_align=16)
        wh_f = rt.make_fake_compact_tensor(
            cutlass.BFloat16, (epn, kd, nd), stride_order=(2, 1, 0), assumed_align=16
        )
        ws_f = rt.make_fake_compact_tensor(
            cutlass.BFloat16, (nb, kd, nd), stride_order=(2, 1, 0), assumed_align=16
        )
        cu_f = rt.make_fake_compact_tensor(cutlass.Int32, (ng,), assumed_align=4)
        y_f = rt.make_fake_compact_tensor(cutlass.BFloat16, (n, nd), stride_order=(1, 0), assumed_align=16)
        stream = rt.make_fake_stream(use_tvm_ffi_env_stream=True)
        kernel = _kernel_class()(config)
        fn = cute.compile(kernel, x_f, wh_f, ws_f, cu_f, y_f, stream, options="--enable-tvm-ffi")
        _COMPILED[key] = fn
        return fn


# ---------------------------------------------------------------------------------------------------
# Host wrapper
# ---------------------------------------------------------------------------------------------------


def _check_inputs(x, w_home, w_slot, cu_seqlens, pad):
    for name, t in (("x", x), ("w_home", w_home), ("w_slot", w_slot), ("cu_seqlens", cu_seqlens)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in (("x", x), ("w_home", w_home), ("w_slot", w_slot)):
        if t.dtype != torch.bfloat16:
            raise ValueError(f"{name} must be bfloat16, got {t.dtype}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [N, Kd], got shape {tuple(x.shape)}")
    if w_home.dim() != 3:
        raise ValueError(f"w_home must be 3-D [epn, Kd, Nd], got shape {tuple(w_home.shape)}")
    if w_slot.dim() != 3:
        raise ValueError(f"w_slot must be 3-D [B, Kd, Nd], got shape {tuple(w_slot.shape)}")
    n, kd = x.shape
    epn, kd_h, nd = w_home.shape
    nb, kd_s, nd_s = w_slot.shape
    if epn < 1:
        raise ValueError(f"w_home must hold at least one expert (epn >= 1), got epn={epn}")
    if kd_h != kd:
        raise ValueError(f"w_home.shape[1] (Kd={kd_h}) must equal x.shape[1] (Kd={kd})")
    if (kd_s, nd_s) != (kd, nd):
        raise ValueError(
            f"w_slot must be [B, Kd={kd}, Nd={nd}] like w_home, got shape {tuple(w_slot.shape)}"
        )
    if kd < 8 or kd % 8:
        raise ValueError(f"Kd (x.shape[1]) must be a positive multiple of 8, got {kd}")
    if nd < 8 or nd % 8:
        raise ValueError(f"Nd (w_home.shape[2]) must be a positive multiple of 8, got {nd}")
    if cu_seqlens.dtype != torch.int32:
        raise ValueError(f"cu_seqlens must be int32, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] != epn + nb:
        raise ValueError(
            f"cu_seqlens must be 1-D of length epn + B = {epn} + {nb} = {epn + nb}, "
            f"got shape {tuple(cu_seqlens.shape)}"
        )
    if not cu_seqlens.is_contiguous():
        raise ValueError("cu_seqlens must be contiguous")
    dev = x.device
    for name, t in (("w_home", w_home), ("w_slot", w_slot), ("cu_seqlens", cu_seqlens)):
        if t.device != dev:
            raise ValueError(f"{name} must be on the same device as x ({dev}), got {t.device}")
    if dev.type != "cuda":
        raise ValueError(f"x must be a CUDA tensor for the CuTe kernel, got device {dev}")
    for name, t in (("x", x), ("w_home", w_home), ("w_slot", w_slot)):
        if t.numel() and t.data_ptr() % 16:
            raise ValueError(f"{name} must be 16-byte aligned")
    return n, kd, nd, epn, nb


_DEVICE_INFO: dict[int, tuple[tuple[int, int], int]] = {}
# (Kd, Nd, P, device index) -> compiled kernel: skips the config/key work on the hot path.
_LAUNCH_CACHE: dict[tuple, Any] = {}


def _device_info(device: torch.device) -> tuple[tuple[int, int], int]:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    info = _DEVICE_INFO.get(idx)
    if info is None:
        props = torch.cuda.get_device_properties(idx)
        info = _DEVICE_INFO[idx] = ((props.major, props.minor), props.multi_processor_count)
    return info


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
    n, kd, nd, epn, nb = _check_inputs(x, w_home, w_slot, cu_seqlens, pad)
    fast_key = (kd, nd, pad, x.device.index)
    fn = _LAUNCH_CACHE.get(fast_key)
    if fn is None:
        cc, num_sms = _device_info(x.device)
        if cc != (9, 0):
            raise ValueError(
                f"x must be on a Hopper (sm_90) GPU, got compute capability {cc[0]}.{cc[1]}"
            )
        fn = compile_group_gemm(kd, nd, select_config(pad, nd, num_sms))
        _LAUNCH_CACHE[fast_key] = fn
    if out is None:
        y = torch.empty(n, nd, dtype=torch.bfloat16, device=x.device)
    else:
        if out.shape != (n, nd) or out.dtype != torch.bfloat16 or not out.is_contiguous() or out.device != x.device:
            raise ValueError(f"out must be a contiguous bf16 [{n}, {nd}] tensor on {x.device}")
        y = out
    if n == 0:
        return y
    if nb == 0:
        # A zero-sized tensor map cannot be encoded; no tile ever reads the slot map when B == 0.
        w_slot = w_home
    fn(x, w_home, w_slot, cu_seqlens, y)
    return y


# ---------------------------------------------------------------------------------------------------
# CI: compile for sm_90a without a GPU
# ---------------------------------------------------------------------------------------------------


def _compile_only(kd: int = 7168, nd: int = 2048, pad: int = 128, num_sms: int = H100_H200_NUM_SMS) -> None:
    """Child-process entry of ``compile_group_gemm_for_sm90`` (environment already set)."""
    from csrc_cute.compile_check import expect_no_driver

    with expect_no_driver():
        compile_group_gemm(kd, nd, select_config(pad, nd, num_sms))


def compile_group_gemm_for_sm90(
    dump_dir: str, kd: int = 7168, nd: int = 2048, pad: int = 128, num_sms: int = H100_H200_NUM_SMS
):
    """Compile the kernel for sm_90a (works on a CPU-only machine) and return a ``CompileCheckResult``
    with the PTX/cubin paths and ptxas statistics (registers, shared memory, spills)."""
    from csrc_cute.compile_check import run_compile_check

    return run_compile_check(
        "csrc_cute.group_gemm:_compile_only",
        dump_dir,
        dict(kd=kd, nd=nd, pad=pad, num_sms=num_sms),
        arch="sm_90a",
    )
