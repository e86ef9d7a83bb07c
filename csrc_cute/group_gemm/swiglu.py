"""The fused gate/up projection with a SwiGLU epilogue (``group_gemm_swiglu``), with and without remote
groups: per group g, ``gate = x_g @ Wgate_g``, ``up = x_g @ Wup_g`` (fp32 accumulators) and ``h =
silu(gate) * up`` in fp32, stored bf16; with ``store_preact`` also the bf16 gate and up."""

from __future__ import annotations

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass.utils import LayoutEnum

from . import gather
from .base import GroupGemmSm90Base, KernelParams
from .config import GroupGemmConfig
from .remote import RemoteWeightsMixin
from .scheduler import RowTileScheduler


class GroupGemmSwigluSm90(RowTileScheduler, GroupGemmSm90Base):
    """Fused gate/up projection with a SwiGLU epilogue (see ``group_gemm_swiglu``).

    Per output tile (``tile_m`` rows x ``tile_n`` columns of h) the producer loads, per k tile, the
    A tile and the matching ``tile_n``-column tiles of *both* ``W_gate`` and ``W_up`` (two B rings
    sharing one mbarrier per stage); the consumers keep two fp32 accumulators of identical layout
    (gate and up of the same columns, so element i of one and of the other are the same (row,
    column)) and the epilogue computes ``h = silu(gate) * up`` in fp32 from registers, converts to
    bf16 and stores it through the stmatrix -> shared -> TMA path of the forward kernel. With
    ``store_preact`` it also stores the bf16 pre-activations gate and up (what backward needs).
    Same persistent raster and device-side tile -> group lookup as the forward. ``config.pingpong``:
    each consumer warp group computes whole tiles (both accumulators of all ``tile_m`` rows), every other
    tile of its CTA, its epilogue under the other's mainloop (128 x 96: 192 accumulator registers per
    thread, as the 128 x 192 pingpong dgrad; QuACK's ``gemm_gated`` runs the 128 x 192 interleaved
    gate/up tile so).
    """

    def __init__(self, config: GroupGemmConfig, store_preact: bool = True):
        self.store_preact = bool(store_preact)
        # Stages are sized for A + both B tiles: ask _init_common for a tile twice as wide.
        self._init_common(
            GroupGemmConfig(config.tile_m, 2 * config.tile_n, config.num_sms, config.pingpong, config.band_m,
                            config.tall_m_major, config.cluster_n),
            LayoutEnum.ROW_MAJOR,  # A = x [N, H]: K-major
            LayoutEnum.COL_MAJOR,  # B = W viewed (F, H): N-major
            self._init_tma_store_epilogue(config.tile_m, config.pingpong),
            pingpong=config.pingpong,
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
                remote_experts=None, gate_peers=None, up_peers=None, desc_ws=None, row_src=None):
        """Shared by the plain kernel, the one with remote groups (``remote_experts`` not None) and the
        one with a gathered A operand (``row_src`` not None: A row r is x[row_src[r]], no TMA for A, and
        the m tiles come from h's rows)."""
        self._setup_mainloop()
        self._setup_tma_store_epilogue()
        if cutlass.const_expr(row_src is None):
            tma_a, mA = self._tma_load_a(x)
        else:
            tma_a, mA = None, x
        bg_view, tma_gh, mGh, tma_gs, mGs = self._tma_load_weights(wg_home, wg_slot)
        bu_view, tma_uh, mUh, tma_us, mUs = self._tma_load_weights(wu_home, wu_slot)
        tma_h, mH = self._tma_store_c(h)
        tma_g, mG = self._tma_store_c(gate)
        tma_u, mU = self._tma_store_c(up)
        num_n_tiles, num_tiles = self._row_tiles(x if cutlass.const_expr(row_src is None) else h, h)
        self._make_shared_storage(b_buffers=("sBg", "sBu"), with_c=True)
        if cutlass.const_expr(remote_experts is None):
            bg_view, bu_view = None, None
        self._launch_persistent(
            self.kernel(
                tma_a, mA, tma_gh, mGh, tma_gs, mGs, tma_uh, mUh, tma_us, mUs,
                tma_h, mH, tma_g, mG, tma_u, mU, cu_seqlens,
                self.tiled_mma, self.a_smem_staged, self.b_smem_staged, self.epi_smem_staged,
                num_n_tiles, num_tiles, remote_experts, gate_peers, up_peers, bg_view, bu_view, desc_ws, row_src,
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
        row_src,  # None, or (N,) int32: the gathered A's source rows of x (mA; tma_a is None)
    ):
        stores = (tma_h, tma_g, tma_u) if cutlass.const_expr(self.store_preact) else (tma_h,)
        a_atoms = (tma_a,)
        if cutlass.const_expr(row_src is not None):
            a_atoms, mA = (), (mA, row_src)  # GatherRowsMixin.partition_loads takes the pair
        remote = None
        if cutlass.const_expr(remote_experts is not None):
            remote = (remote_experts, [gate_peers, up_peers], [bg_view, bu_view], desc_ws)
        self.warp_specialized(KernelParams(
            atoms=a_atoms + (tma_gh, tma_gs, tma_uh, tma_us) + stores, tma_a=tma_a, mA=mA,
            b_operands=[(tma_gh, mGh, 0), (tma_gs, mGs, 0), (tma_uh, mUh, 1), (tma_us, mUs, 1)],
            b_buffers=("sBg", "sBu"), home_rings=(0, 2), slot_rings=(1, 3),
            a_smem_staged=a_smem_staged, b_smem_staged=b_smem_staged, epi_smem_staged=epi_smem_staged,
            tiled_mma=tiled_mma, cu_seqlens=cu_seqlens,
            num_n_tiles=num_n_tiles, num_tiles=num_tiles, tma_h=tma_h, mH=mH, tma_g=tma_g, mG=mG, tma_u=tma_u,
            mU=mU, remote=remote,
        ))

    @cute.jit
    def consumer_setup(self, p, mma_tidx, thr_mma, sC: cute.Tensor):
        """The gate and up accumulators (one layout: element i of each is the same (row, column)) and
        the TMA-store epilogue."""
        tile_c = (self.tile_m, self.tile_n)
        gH = cute.local_tile(p.mH, tile_c, (None, None))
        gG = cute.local_tile(p.mG, tile_c, (None, None))
        gU = cute.local_tile(p.mU, tile_c, (None, None))
        acc_shape = thr_mma.partition_C(gH).shape[:3]
        acc_g = cute.make_rmem_tensor(acc_shape, self.acc_dtype)
        acc_u = cute.make_rmem_tensor(acc_shape, self.acc_dtype)
        tiled_copy_r2s, tRS_sD, tRS_rD, tRS_rOut, epi_bar, store_pipe, epi_slot0 = self.make_tma_store_epilogue(
            p.tiled_mma, mma_tidx, sC
        )
        return KernelParams(sC=sC, gH=gH, gG=gG, gU=gU, acc_g=acc_g, acc_u=acc_u, tiled_copy_r2s=tiled_copy_r2s,
                            tRS_sD=tRS_sD, tRS_rD=tRS_rD, tRS_rOut=tRS_rOut, epi_bar=epi_bar, store_pipe=store_pipe,
                            epi_slot0=epi_slot0,
                            tRS_rG=tiled_copy_r2s.retile(acc_g), tRS_rU=tiled_copy_r2s.retile(acc_u))

    @cute.jit
    def consume_tile(self, p, c, warp_idx, mainloop, read_state, release_state, tCrA: cute.Tensor, tCrBs,
                     tile: cutlass.Int32, epi_count: cutlass.Int32):
        """One output tile: the MMA of gate and up, then h = silu(gate) * up (fp32) stored bf16, then
        (``store_preact``) gate and up."""
        m_idx, n_idx, k_count = self.row_work(p, tile)
        read_state, release_state = self.mma_k_tiles(  # pingpong: the mainloop takes its turn
            p, mainloop, read_state, release_state, [c.acc_g, c.acc_u], tCrA, tCrBs, k_count, tile
        )
        tRS_rG, tRS_rU, tRS_rD, tRS_rOut = c.tRS_rG, c.tRS_rU, c.tRS_rD, c.tRS_rOut
        size_rD = cute.size(tRS_rOut)
        neg_log2e = cutlass.Float32(-1.4426950408889634)
        bSG_sD, bSG_gH, epi_tiles, epi_layout = self.partition_epilogue(
            p.tma_h, c.sC, c.gH[(None, None, m_idx, n_idx)]
        )
        for e in cutlass.range_constexpr(epi_tiles):
            for v in cutlass.range_constexpr(size_rD):
                a = tRS_rG[e * size_rD + v]
                sig = cute.arch.rcp_approx(1.0 + cute.math.exp2(a * neg_log2e, fastmath=True))
                tRS_rD[v] = a * sig * tRS_rU[e * size_rD + v]
            tRS_rOut.store(tRS_rD.load().to(self.c_dtype))
            self.store_subtile(
                c.tiled_copy_r2s, tRS_rOut, c.tRS_sD, self.epi_slot(c.epi_slot0, epi_count + e), c.epi_bar,
                warp_idx, c.store_pipe, p.tma_h, bSG_sD, bSG_gH[(None, epi_layout.get_hier_coord(e))],
            )
        epi_count = epi_count + epi_tiles
        if cutlass.const_expr(self.store_preact):
            _, bSG_gG, _, _ = self.partition_epilogue(p.tma_g, c.sC, c.gG[(None, None, m_idx, n_idx)])
            _, bSG_gU, _, _ = self.partition_epilogue(p.tma_u, c.sC, c.gU[(None, None, m_idx, n_idx)])
            for e in cutlass.range_constexpr(epi_tiles):
                self.acc_subtile_to_bf16(tRS_rG, e, tRS_rD, tRS_rOut)
                self.store_subtile(
                    c.tiled_copy_r2s, tRS_rOut, c.tRS_sD, self.epi_slot(c.epi_slot0, epi_count + 2 * e), c.epi_bar,
                    warp_idx, c.store_pipe, p.tma_g, bSG_sD, bSG_gG[(None, epi_layout.get_hier_coord(e))],
                )
                self.acc_subtile_to_bf16(tRS_rU, e, tRS_rD, tRS_rOut)
                self.store_subtile(
                    c.tiled_copy_r2s, tRS_rOut, c.tRS_sD, self.epi_slot(c.epi_slot0, epi_count + 2 * e + 1), c.epi_bar,
                    warp_idx, c.store_pipe, p.tma_u, bSG_sD, bSG_gU[(None, epi_layout.get_hier_coord(e))],
                )
            epi_count = epi_count + 2 * epi_tiles
        return read_state, release_state, epi_count

class GroupGemmSwigluRemoteSm90(RemoteWeightsMixin, GroupGemmSwigluSm90):
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


class GroupGemmSwigluGatherSm90(gather.GatherRowsMixin, GroupGemmSwigluSm90):
    """The fused gate/up + SwiGLU kernel with a gathered A operand: row r of A is ``x[row_src[r]]``, a
    zero row where ``row_src[r] < 0`` (``gather``: cp.async by the producer warp group; B by TMA as in
    the plain kernel). Bitwise the plain kernel's outputs for ``rows = where(row_src >= 0, x[row_src],
    0)``: the A stages hold the same bytes in the same layout."""

    def __init__(self, config: GroupGemmConfig, store_preact: bool = True):
        super().__init__(config, store_preact)
        self._init_gather()

    @cute.jit
    def __call__(
        self,
        x: cute.Tensor,  # (S, H)
        row_src: cute.Tensor,  # (N,) int32: A row r is x[row_src[r]], zero when row_src[r] < 0
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
        self._launch(x, wg_home, wg_slot, wu_home, wu_slot, cu_seqlens, h, gate, up, stream, row_src=row_src)


def swiglu_gather_copy_coverage(tile_m: int = 128, tile_n: int = 256) -> dict:
    """CPU check of the SwiGLU kernel's K-major gather copy on one A stage: ``gather.gather_copy_coverage``
    of ``GroupGemmSwigluGatherSm90`` (``tile_n`` unused: the A stage is tile_m x 64). Run with
    ``CUTE_DSL_ARCH=sm_90a`` (see the tests)."""
    del tile_n
    return gather.gather_copy_coverage(GroupGemmSwigluGatherSm90(GroupGemmConfig(tile_m, 128, 1)))
