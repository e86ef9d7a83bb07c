"""The fused gate/up projection with a SwiGLU epilogue (``group_gemm_swiglu``), with and without remote
groups: per group g, ``gate = x_g @ Wgate_g``, ``up = x_g @ Wup_g`` (fp32 accumulators) and ``h =
silu(gate) * up`` in fp32, stored bf16; with ``store_preact`` also the bf16 gate and up."""

from __future__ import annotations

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass.utils import LayoutEnum

from . import gather
from .base import GroupGemmSm90Base, KernelParams, epilogue_pairing, sigmoid_approx
from .config import GroupGemmConfig
from .remote import RemoteWeightsMixin
from .scheduler import RowTileScheduler


def stage_half(staged, tile_n: int, tile_k: int, half: int):
    """Columns [half tile_n, (half + 1) tile_n) of every stage of ``staged`` (a B ring, tensor or layout,
    (2 tile_n, tile_k, stages)): (tile_n, tile_k, stages)."""
    return cute.slice_(cute.flat_divide(staged, (tile_n, tile_k)), (None, None, half, 0, None))


class GroupGemmSwigluSm90(RowTileScheduler, GroupGemmSm90Base):
    """Fused gate/up projection with a SwiGLU epilogue (see ``group_gemm_swiglu``).

    Per output tile (``tile_m`` rows x ``tile_n`` columns of h) the producer loads, per k tile, the
    A tile and the matching ``tile_n``-column tiles of *both* ``W_gate`` and ``W_up`` into the two
    halves of one B stage of ``2 tile_n`` columns (``b_load_views``); the consumers multiply it with one
    wgmma batch into one fp32 accumulator of ``2 tile_n`` columns, gate's columns then up's, so a
    thread holds gate and up of the same (row, column) one half of its sub-tiles apart
    (``gate_subtile``). One wgmma of twice the width reads the A fragment once where a gate and an up
    wgmma read it twice (the sm_90a SASS issued two ``HGMMA.64x128x16`` a k step). The epilogue computes
    ``h = silu(gate) * up`` in fp32 from registers, converts to bf16 and stores it through the stmatrix ->
    shared -> TMA path of the forward kernel. With ``store_preact`` it also stores the bf16
    pre-activations gate and up (what backward needs). Same persistent raster and device-side tile ->
    group lookup as the forward. ``config.pingpong``: each consumer warp group computes whole tiles
    (all ``tile_m`` rows), every other tile of its CTA, its epilogue under the other's mainloop (128 x 96:
    one 64 x 192 wgmma a 64-row block, the stage tiled from the 64-byte swizzle atom of a 96-column load,
    ``base.widened_b_stages``; QuACK's ``gemm_gated`` runs a 128 x 192 tile of gate and up interleaved in
    global memory).
    """

    # GroupGemmConfig.cluster_m = 2: two M tiles of one group share its gate and up tiles (``pair_tile``), each
    # CTA loading half of both and multicasting it; B is two thirds of a stage's bytes at 128 x 128 (256 weight
    # columns against 128 rows)
    multicast_b = True

    def __init__(self, config: GroupGemmConfig, store_preact: bool = True):
        self.store_preact = bool(store_preact)
        # Stages are sized for A + both B tiles: ask _init_common for a tile twice as wide.
        self._init_common(
            GroupGemmConfig(config.tile_m, 2 * config.tile_n, config.num_sms, config.pingpong, config.band_m,
                            config.tall_m_major, config.cluster_n, config.dynamic, config.cluster_m),
            LayoutEnum.ROW_MAJOR,  # A = x [N, H]: K-major
            LayoutEnum.COL_MAJOR,  # B = W viewed (F, H): N-major
            self._init_tma_store_epilogue(config.tile_m, config.pingpong),
            pingpong=config.pingpong,
        )
        self.tile_n = config.tile_n  # columns of h (and of gate, of up) per tile
        self.b_modes = [2, 1, 0]

    def output_rows(self, p):
        """The rows of the outputs (``pair_tile``): h's (N), also for a gathered A of S rows."""
        return cute.size(p.mH, mode=[0])

    @property
    def mma_tile_n(self) -> int:
        """A B stage holds the gate tile and then the up tile."""
        return 2 * self.tile_n

    @cute.jit
    def b_load_views(self, sBs):
        """The two halves of the one B ring's stages, gate's and up's: an N-major stage is laid out
        K atoms first (``make_smem_layout_b``), so its first ``tile_n`` columns are contiguous and laid
        out as a ``tile_n``-column stage, which each half's TMA load writes (probe ``swiglu_b_stage_halves``)."""
        return [stage_half(sBs[0], self.tile_n, self.tile_k, 0), stage_half(sBs[0], self.tile_n, self.tile_k, 1)]

    def gate_subtile(self, e: int) -> int:
        """The accumulator sub-tile (``acc_subtile_to_bf16``'s index) holding gate of output sub-tile ``e``.
        The accumulator's sub-tiles run over its ``2 tile_n`` columns first, then over 64-row blocks
        (pingpong), while the output's run over ``tile_n`` columns."""
        per_row = self.tile_n // self.epi_tile[1]
        return e + (e // per_row) * per_row

    def up_subtile(self, e: int) -> int:
        """The accumulator sub-tile holding up of output sub-tile ``e``: gate's, ``tile_n`` columns on."""
        return self.gate_subtile(e) + self.tile_n // self.epi_tile[1]

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
        tile_counter: cute.Tensor,  # (1,) int32, zero: the dynamic walk's counter (unused by the static walk)
        stream: cuda.CUstream,
    ):
        self._launch(x, wg_home, wg_slot, wu_home, wu_slot, cu_seqlens, h, gate, up, tile_counter, stream)

    @cute.jit
    def _launch(self, x, wg_home, wg_slot, wu_home, wu_slot, cu_seqlens, h, gate, up, tile_counter, stream,
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
        num_n_tiles, num_tiles = self._row_tiles(x if cutlass.const_expr(row_src is None) else h, h, cu_seqlens)
        self._make_shared_storage(b_buffers=("sB",), with_c=True)
        if cutlass.const_expr(remote_experts is None):
            bg_view, bu_view = None, None
        self._launch_persistent(
            self.kernel(
                tma_a, mA, tma_gh, mGh, tma_gs, mGs, tma_uh, mUh, tma_us, mUs,
                tma_h, mH, tma_g, mG, tma_u, mU, cu_seqlens,
                self.tiled_mma, self.a_smem_staged, self.b_smem_staged, self.epi_smem_staged,
                num_n_tiles, num_tiles, remote_experts, gate_peers, up_peers, bg_view, bu_view, desc_ws, row_src,
                self.walk_counter(tile_counter),
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
        tile_counter,  # None (the static walk), or the dynamic walk's counter
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
            b_buffers=("sB",), home_rings=(0, 2), slot_rings=(1, 3),
            a_smem_staged=a_smem_staged, b_smem_staged=b_smem_staged, epi_smem_staged=epi_smem_staged,
            tiled_mma=tiled_mma, cu_seqlens=cu_seqlens,
            num_n_tiles=num_n_tiles, num_tiles=num_tiles, tma_h=tma_h, mH=mH, tma_g=tma_g, mG=mG, tma_u=tma_u,
            mU=mU, remote=remote, tile_counter=tile_counter,
        ))

    @cute.jit
    def consumer_setup(self, p, mma_tidx, thr_mma, sC: cute.Tensor):
        """The accumulator of gate and up (``2 tile_n`` columns: gate's, then up's) and the TMA-store
        epilogue."""
        tile_c = (self.tile_m, self.tile_n)
        gH = cute.local_tile(p.mH, tile_c, (None, None))
        gG = cute.local_tile(p.mG, tile_c, (None, None))
        gU = cute.local_tile(p.mU, tile_c, (None, None))
        acc_tile = cute.make_identity_tensor((self.tile_m, self.mma_tile_n))
        acc = cute.make_rmem_tensor(thr_mma.partition_C(acc_tile).shape[:3], self.acc_dtype)
        tiled_copy_r2s, tRS_sD, tRS_rD, tRS_rOut, epi_bar, store_pipe, epi_slot0 = self.make_tma_store_epilogue(
            p.tiled_mma, mma_tidx, sC
        )
        return KernelParams(sC=sC, gH=gH, gG=gG, gU=gU, acc=acc, tiled_copy_r2s=tiled_copy_r2s,
                            tRS_sD=tRS_sD, tRS_rD=tRS_rD, tRS_rOut=tRS_rOut, epi_bar=epi_bar, store_pipe=store_pipe,
                            epi_slot0=epi_slot0, tRS_rAcc=tiled_copy_r2s.retile(acc))

    @cute.jit
    def consume_tile(self, p, c, warp_idx, mainloop, read_state, release_state, tCrA: cute.Tensor, tCrBs,
                     info, turn, epi_count: cutlass.Int32):
        """One output tile (its coordinates: ``tile_info``): the MMA of gate and up, then h = silu(gate) * up
        (fp32) stored bf16, then (``store_preact``) gate and up."""
        m_idx, n_idx, k_count = self.tile_work(p, info)
        read_state, release_state = self.mma_k_tiles(  # pingpong: the mainloop takes its turn
            p, mainloop, read_state, release_state, [c.acc], tCrA, tCrBs, k_count, turn
        )
        tRS_rAcc, tRS_rD, tRS_rOut = c.tRS_rAcc, c.tRS_rD, c.tRS_rOut
        size_rD = cute.size(tRS_rOut)
        bSG_sD, bSG_gH, epi_tiles, epi_layout = self.partition_epilogue(
            p.tma_h, c.sC, c.gH[(None, None, m_idx, n_idx)]
        )
        for e in cutlass.range_constexpr(epi_tiles):
            g0, u0 = self.gate_subtile(e) * size_rD, self.up_subtile(e) * size_rD
            for v in cutlass.range_constexpr(size_rD):
                a = tRS_rAcc[g0 + v]
                tRS_rD[v] = a * sigmoid_approx(a) * tRS_rAcc[u0 + v]
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
                self.acc_subtile_to_bf16(tRS_rAcc, self.gate_subtile(e), tRS_rD, tRS_rOut)
                self.store_subtile(
                    c.tiled_copy_r2s, tRS_rOut, c.tRS_sD, self.epi_slot(c.epi_slot0, epi_count + 2 * e), c.epi_bar,
                    warp_idx, c.store_pipe, p.tma_g, bSG_sD, bSG_gG[(None, epi_layout.get_hier_coord(e))],
                )
                self.acc_subtile_to_bf16(tRS_rAcc, self.up_subtile(e), tRS_rD, tRS_rOut)
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
        tile_counter: cute.Tensor,  # (1,) int32, zero: the dynamic walk's counter (unused by the static walk)
        stream: cuda.CUstream,
    ):
        self._launch(x, wg_home, wg_slot, wu_home, wu_slot, cu_seqlens, h, gate, up, tile_counter, stream,
                     remote_experts, gate_peers, up_peers, desc_ws)


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
        tile_counter: cute.Tensor,  # (1,) int32, zero: the dynamic walk's counter (unused by the static walk)
        stream: cuda.CUstream,
    ):
        self._launch(x, wg_home, wg_slot, wu_home, wu_slot, cu_seqlens, h, gate, up, tile_counter, stream,
                     row_src=row_src)


def swiglu_gather_copy_coverage(tile_m: int = 128, tile_n: int = 256) -> dict:
    """CPU check of the SwiGLU kernel's K-major gather copy on one A stage: ``gather.gather_copy_coverage``
    of ``GroupGemmSwigluGatherSm90`` (``tile_n`` unused: the A stage is tile_m x 64). Run with
    ``CUTE_DSL_ARCH=sm_90a`` (see the tests)."""
    del tile_n
    return gather.gather_copy_coverage(GroupGemmSwigluGatherSm90(GroupGemmConfig(tile_m, 128, 1)))


def _flat(x) -> list:
    return [v for y in x for v in _flat(y)] if isinstance(x, tuple) else [x]


def _mode_index(coord, shape) -> int:
    """A (possibly nested) coordinate of one layout mode as its 1-D index (first sub-mode fastest)."""
    index, scale = 0, 1
    for c, size in zip(_flat(coord), _flat(shape)):
        index += int(c) * scale
        scale *= size
    return index


def _layout_offset(shape_stride, coord) -> int:
    """The offset of a static layout, given as its (shape, stride), at ``coord``: one integer per top-level
    mode, each unfolded over its sub-modes (first sub-mode fastest)."""
    offset = 0
    for c, shape, stride in zip(coord, *shape_stride):
        for size, step in zip(_flat(shape), _flat(stride)):
            offset += (c % size) * step
            c //= size
    return offset


def swiglu_b_stage_halves(tile_m: int = 128, tile_n: int = 128) -> dict:
    """CPU check of the one B ring of the fused SwiGLU (layout algebra at trace time only). Per half of a
    stage (``stage_half``, gate's and up's): its (column, k, stage) must be the ring's (column + half
    tile_n, k, stage) (read off an identity tensor cut as the kernel cuts the ring), and there the ring's
    layout as the MMA reads it (``b_smem_staged``) must be the half's first element plus the layout one
    TMA load writes (``b_load_staged``'s stage), under the same swizzle, the half's first element a whole
    number of 1024-byte swizzle periods in. Returns the mismatches and the elements checked."""
    from csrc_cute.compile_check import expect_no_driver

    kernel = GroupGemmSwigluSm90(GroupGemmConfig(tile_m, tile_n, 1))
    got: dict = {}

    def shape_stride(layout):
        return tuple(layout.shape), tuple(layout.stride)

    def read_axes(view, sizes):
        # the coordinates of every element along each axis from the origin, and of the far corner (a slice
        # of an identity tensor is affine, so these pin it down)
        points = [tuple(i if a == axis else 0 for a in range(3)) for axis in range(3) for i in range(sizes[axis])]
        points.append(tuple(n - 1 for n in sizes))
        return {pt: tuple(_mode_index(c, shape) for c, shape in zip(view[pt], got["full"][0])) for pt in points}

    @cute.jit
    def probe():
        kernel._setup_mainloop()
        full, load = kernel.b_smem_staged, kernel.b_load_staged
        sizes = (tile_n, kernel.tile_k, cute.size(full.outer, mode=[2]))
        ring = cute.make_identity_tensor(cute.shape(full.outer))
        got.update(swizzles=(str(full.inner), str(load.inner)), full=shape_stride(full.outer),
                   load=shape_stride(load.outer), sizes=sizes)
        got.update(halves=[read_axes(stage_half(ring, tile_n, kernel.tile_k, 0), sizes),
                           read_axes(stage_half(ring, tile_n, kernel.tile_k, 1), sizes)])

    with expect_no_driver():
        cute.compile(probe)
    mismatches = 0
    for half, coords in enumerate(got["halves"]):
        mismatches += sum(crd != (n + half * tile_n, k, s) for (n, k, s), crd in coords.items())
    stages = got["sizes"][2]
    for half in range(2):
        for s in range(stages):
            base = _layout_offset(got["full"], (half * tile_n, 0, s))
            mismatches += base % 512 != 0  # bf16 elements of a 1024-byte period
            for n in range(tile_n):
                for k in range(kernel.tile_k):
                    mismatches += (_layout_offset(got["full"], (n + half * tile_n, k, s))
                                   != base + _layout_offset(got["load"], (n, k, 0)))
    return dict(mismatches=int(mismatches), checked=2 * stages * tile_n * kernel.tile_k, stages=stages,
                same_swizzle=got["swizzles"][0] == got["swizzles"][1])


def swiglu_gate_up_pairing(tile_m: int = 128, tile_n: int = 128, pingpong: bool = False) -> dict:
    """CPU check of the fused SwiGLU epilogue's pairing (``base.epilogue_pairing``): the value v of output
    sub-tile e that a thread stores is, in its accumulator, value v of sub-tile ``gate_subtile(e)`` (gate)
    and of ``up_subtile(e)`` (up, ``tile_n`` columns on)."""
    kernel = GroupGemmSwigluSm90(GroupGemmConfig(tile_m, tile_n, 1, pingpong))
    return epilogue_pairing(kernel, lambda e: [(kernel.gate_subtile(e), 0), (kernel.up_subtile(e), tile_n)])
