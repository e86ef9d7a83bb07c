"""The row-grouped kernels: forward, dgrad and the row-scaled forward (with and without remote groups).

Semantics (the CPU references are ``moonep::group_gemm``, ``group_gemm_dgrad`` and
``group_gemm_row_scale`` in ``moonep_ops/ops.py``)::

    x [N, Kd] bf16, dy [N, Nd] bf16, w_home [epn, Kd, Nd] bf16, w_slot [B, Kd, Nd] bf16,
    cu_seqlens [G = epn + B] int32; group g = rows [cu[g-1], cu[g]) (cu[-1] = 0),
    W_g = w_home[g] if g < epn else w_slot[g - epn]
    forward    y[s:e]  = (x[s:e] @ W_g)    bf16, fp32 accumulation; rows at or past cu[G-1] are zero
    dgrad      dx[s:e] = (dy[s:e] @ W_g^T) bf16, likewise
    row scale  y[r]    = (x[r] @ W_g) * row_w[r]  (fp32 scale before the bf16 convert)
    dgrad2     dx[s:e] = (dy_a[s:e] @ Wa_g^T + dy_b[s:e] @ Wb_g^T)  one fp32 accumulator, one rounding

One kernel class (``GroupGemmSm90``) with a static flag for the majorness of B: a dense persistent GEMM
over ``[N, red] x [red, out]`` in which each M tile picks its B operand on the device
(``RowTileScheduler``). The forward reads B = ``W_g`` viewed ``(Nd, Kd)``, N-major; dgrad reads B =
``W_g`` viewed ``(Kd, Nd)``, K-major (reduction over ``Nd``). The epilogue stores bf16 through
stmatrix -> shared -> TMA store in sub-tiles; the row-scaled variant scales the fp32 accumulators
first. Remote groups: ``remote.RemoteWeightsMixin``; dgrad2's two operand pairs: ``pairs.OperandPairsMixin``.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass.utils import LayoutEnum

from .base import GroupGemmSm90Base, KernelParams, epilogue_pairing
from .config import GroupGemmConfig
from .pairs import OperandPairsMixin
from .remote import RemoteWeightsMixin
from .scheduler import RowTileScheduler


class GroupGemmSm90(RowTileScheduler, GroupGemmSm90Base):
    """Row-grouped GEMM ``C[rows of g] = A[rows of g] @ op(W_g)`` (see the module docstring).

    ``b_k_major=False``: forward, ``op(W) = W`` (``[Kd, Nd]``, B N-major).
    ``b_k_major=True``: dgrad, ``op(W) = W^T`` (the reduction runs over ``Nd``, B K-major).
    """

    multicast_a = True  # GroupGemmConfig.cluster_n = 2: two n tiles of one M tile share its A (rows) tiles
    multicast_b = True  # GroupGemmConfig.cluster_m = 2: two M tiles of one group share its B (weight) tiles

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
            self._init_tma_store_epilogue(config.tile_m, config.pingpong),
            pingpong=config.pingpong,
        )

    @cute.jit
    def __call__(
        self,
        x: cute.Tensor,  # (N, red), red contiguous
        w_home: cute.Tensor,  # (epn, Kd, Nd), Nd contiguous
        w_slot: cute.Tensor,  # (B, Kd, Nd), Nd contiguous
        cu_seqlens: cute.Tensor,  # (G,) int32
        y: cute.Tensor,  # (N, out), out contiguous
        tile_counter: cute.Tensor,  # (1,) int32, zero: the dynamic walk's counter (unused by the static walk)
        stream: cuda.CUstream,
    ):
        self._launch(x, w_home, w_slot, cu_seqlens, y, None, tile_counter, stream)

    @cute.jit
    def _launch(self, x, w_home, w_slot, cu_seqlens, y, row_w, tile_counter, stream, remote_experts=None, peers=None,
                desc_ws=None):
        """Shared by the plain kernel (``row_w`` None) and the row-scaled one (``row_w`` (N,) fp32);
        with ``remote_experts`` (peers, descriptor workspace) the last groups are remote groups."""
        self._setup_mainloop()
        self._setup_tma_store_epilogue()
        tma_a, mA = self._tma_load_a(x)
        bh_view, tma_bh, mBh, tma_bs, mBs = self._tma_load_weights(w_home, w_slot)
        tma_c, mC = self._tma_store_c(y)
        num_n_tiles, num_tiles = self._row_tiles(x, y, cu_seqlens)
        self._make_shared_storage(with_c=True)
        if cutlass.const_expr(remote_experts is None):
            bh_view = None
        self._launch_persistent(
            self.kernel(
                tma_a, mA, tma_bh, mBh, tma_bs, mBs, tma_c, mC, cu_seqlens, row_w,
                self.tiled_mma, self.a_smem_staged, self.b_smem_staged, self.epi_smem_staged,
                num_n_tiles, num_tiles, remote_experts, peers, bh_view, desc_ws, self.walk_counter(tile_counter),
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
        tile_counter,  # None (the static walk), or the dynamic walk's counter
    ):
        remote = None
        if cutlass.const_expr(remote_experts is not None):
            remote = (remote_experts, [peers], [bh_view], desc_ws)
        self.warp_specialized(KernelParams(
            atoms=(tma_a, tma_bh, tma_bs, tma_c), tma_a=tma_a, mA=mA,
            b_operands=[(tma_bh, mBh, 0), (tma_bs, mBs, 0)], b_buffers=("sB",), home_rings=(0,), slot_rings=(1,),
            a_smem_staged=a_smem_staged, b_smem_staged=b_smem_staged, epi_smem_staged=epi_smem_staged,
            tiled_mma=tiled_mma, cu_seqlens=cu_seqlens,
            num_n_tiles=num_n_tiles, num_tiles=num_tiles, tma_c=tma_c, mC=mC, row_w=row_w, remote=remote,
            tile_counter=tile_counter,
        ))

    @cute.jit
    def consumer_setup(self, p, mma_tidx, thr_mma, sC: cute.Tensor):
        """The accumulator and the TMA-store epilogue's registers, shared slots and barriers."""
        gC = cute.local_tile(p.mC, (self.tile_m, self.tile_n), (None, None))  # (bM, bN, RestM, RestN)
        acc = cute.make_rmem_tensor(thr_mma.partition_C(gC).shape[:3], self.acc_dtype)
        tiled_copy_r2s, tRS_sD, tRS_rD, tRS_rOut, epi_bar, store_pipe, epi_slot0 = self.make_tma_store_epilogue(
            p.tiled_mma, mma_tidx, sC
        )
        return KernelParams(mma_tidx=mma_tidx, sC=sC, gC=gC, acc=acc, tiled_copy_r2s=tiled_copy_r2s, tRS_sD=tRS_sD,
                            tRS_rD=tRS_rD, tRS_rOut=tRS_rOut, epi_bar=epi_bar, store_pipe=store_pipe,
                            epi_slot0=epi_slot0,
                            tRS_rAcc=tiled_copy_r2s.retile(acc))

    @cute.jit
    def consume_tile(self, p, c, warp_idx, mainloop, read_state, release_state, tCrA: cute.Tensor, tCrBs,
                     info, turn, epi_count: cutlass.Int32):
        """One output tile (its coordinates: ``tile_info``): the MMA over its k tiles, the optional row scale, the
        bf16 store."""
        m_idx, n_idx, k_count = self.tile_work(p, info)
        # pingpong: the mainloop takes its turn; the other warp group's runs under this epilogue
        read_state, release_state = self.mma_k_tiles(
            p, mainloop, read_state, release_state, [c.acc], tCrA, tCrBs, k_count, turn
        )
        if cutlass.const_expr(p.row_w is not None):
            self.scale_rows(p.tiled_mma, c.mma_tidx, c.acc, p.row_w, m_idx * self.tile_m)
        return read_state, release_state, self.store_acc_tile(p, c, warp_idx, c.gC[(None, None, m_idx, n_idx)],
                                                              epi_count)

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
        tile_counter: cute.Tensor,  # (1,) int32, zero: the dynamic walk's counter (unused by the static walk)
        stream: cuda.CUstream,
    ):
        self._launch(x, w_home, w_slot, cu_seqlens, y, row_w, tile_counter, stream)

class GroupGemmRowScaleRemoteSm90(RemoteWeightsMixin, GroupGemmRowScaleSm90):
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
        tile_counter: cute.Tensor,  # (1,) int32, zero: the dynamic walk's counter (unused by the static walk)
        stream: cuda.CUstream,
    ):
        self._launch(x, w_home, w_slot, cu_seqlens, y, row_w, tile_counter, stream, remote_experts, peers, desc_ws)


class GroupGemmDgrad2Sm90(OperandPairsMixin, GroupGemmSm90):
    """The dgrad of two operand pairs into one output: ``dx[rows of g] = dy_a[rows of g] @ Wa_g^T +
    dy_b[rows of g] @ Wb_g^T`` (one fp32 accumulator over both pairs' k tiles, one bf16 rounding, one
    store), e.g. the input gradient of the gate and up projections. The dgrad kernel's mainloop and
    epilogue; the producer and the k-tile count are ``OperandPairsMixin``'s."""

    def __init__(self, config: GroupGemmConfig):
        super().__init__(config, b_k_major=True)

    @cute.jit
    def __call__(
        self,
        dy_a: cute.Tensor,  # (N, Nd)
        wa_home: cute.Tensor,  # (epn, Kd, Nd)
        wa_slot: cute.Tensor,  # (B, Kd, Nd)
        dy_b: cute.Tensor,  # (N, Nd)
        wb_home: cute.Tensor,  # (epn, Kd, Nd)
        wb_slot: cute.Tensor,  # (B, Kd, Nd)
        cu_seqlens: cute.Tensor,  # (G,) int32
        dx: cute.Tensor,  # (N, Kd)
        tile_counter: cute.Tensor,  # (1,) int32, zero: the dynamic walk's counter (unused by the static walk)
        stream: cuda.CUstream,
    ):
        self._setup_mainloop()
        self._setup_tma_store_epilogue()
        tma_a0, mA0 = self._tma_load_a(dy_a)
        tma_a1, mA1 = self._tma_load_a(dy_b)
        _, tma_ah, mBah, tma_as, mBas = self._tma_load_weights(wa_home, wa_slot)
        _, tma_bh, mBbh, tma_bs, mBbs = self._tma_load_weights(wb_home, wb_slot)
        tma_c, mC = self._tma_store_c(dx)
        num_n_tiles, num_tiles = self._row_tiles(dy_a, dx, cu_seqlens)
        self._make_shared_storage(with_c=True)
        self._launch_persistent(
            self.kernel(
                tma_a0, mA0, tma_a1, mA1, tma_ah, mBah, tma_as, mBas, tma_bh, mBbh, tma_bs, mBbs, tma_c, mC,
                cu_seqlens, self.tiled_mma, self.a_smem_staged, self.b_smem_staged, self.epi_smem_staged,
                num_n_tiles, num_tiles, self.walk_counter(tile_counter),
            ),
            num_tiles,
            stream,
        )

    @cute.kernel
    def kernel(
        self,
        tma_a0: cute.CopyAtom, mA0: cute.Tensor,
        tma_a1: cute.CopyAtom, mA1: cute.Tensor,
        tma_ah: cute.CopyAtom, mBah: cute.Tensor,
        tma_as: cute.CopyAtom, mBas: cute.Tensor,
        tma_bh: cute.CopyAtom, mBbh: cute.Tensor,
        tma_bs: cute.CopyAtom, mBbs: cute.Tensor,
        tma_c: cute.CopyAtom, mC: cute.Tensor,
        cu_seqlens: cute.Tensor,
        tiled_mma: cute.TiledMma,
        a_smem_staged: cute.ComposedLayout,
        b_smem_staged: cute.ComposedLayout,
        epi_smem_staged: cute.ComposedLayout,
        num_n_tiles: cutlass.Int32,
        num_tiles: cutlass.Int32,
        tile_counter,  # None (the static walk), or the dynamic walk's counter
    ):
        self.warp_specialized(KernelParams(
            atoms=(tma_a0, tma_a1, tma_ah, tma_as, tma_bh, tma_bs, tma_c), tma_a=(tma_a0, tma_a1), mA=(mA0, mA1),
            b_operands=[(tma_ah, mBah, 0), (tma_as, mBas, 0), (tma_bh, mBbh, 0), (tma_bs, mBbs, 0)],
            b_buffers=("sB",), home_rings=(0, 2), slot_rings=(1, 3),
            a_smem_staged=a_smem_staged, b_smem_staged=b_smem_staged, epi_smem_staged=epi_smem_staged,
            tiled_mma=tiled_mma, cu_seqlens=cu_seqlens,
            num_n_tiles=num_n_tiles, num_tiles=num_tiles, tma_c=tma_c, mC=mC, row_w=None, tile_counter=tile_counter,
        ))


def rows_store_pairing(tile_m: int = 128, tile_n: int = 256, pingpong: bool = False) -> dict:
    """CPU check of the row kernels' store (``base.epilogue_pairing``): the value v of output sub-tile e that a
    thread stores is value v of its accumulator's sub-tile e (32-column sub-tiles of the whole tile's rows,
    cooperative, or of a warp group's 64-row blocks, pingpong)."""
    return epilogue_pairing(GroupGemmSm90(GroupGemmConfig(tile_m, tile_n, 1, pingpong)), lambda e: [(e, 0)])
