"""The varlen-K grouped weight gradient (``group_gemm_wgrad``).

Semantics (CPU reference ``moonep::group_gemm_wgrad``): home groups ``dw_home[g] = x[s:e]^T @ dy[s:e]``
written, bf16 (fp32 accumulation; zeros if empty); slot groups ``dw_slot[g - epn] += x[s:e]^T @
dy[s:e]`` fp32, in place; empty ones untouched.

Per group g a GEMM with M = Kd, N = Nd and K = the group's rows; A = ``x^T`` (M-major in memory) and
B = ``dy^T`` (N-major), each read through one tensor map over all rows: group g's k tiles are rows
``[cu[g-1], cu[g]) / 64`` (64 | P). Work items (``scheduler.GroupTileScheduler``). Every output tile
belongs to one work item (no atomics). Home items store bf16 through the TMA-store epilogue into
``dw_home`` viewed (Kd, Nd, epn) (partial tiles clipped by the TMA bounds); an empty home group's items
run with no k tiles and store zeros. Slot items add the accumulators straight into ``dw_slot`` in
global memory (read-add-write, predicated on partial tiles); empty slot groups' items are skipped.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass.utils import LayoutEnum

from . import gather
from .base import GroupGemmSm90Base, KernelParams, epilogue_pairing, partition_coords
from .config import GroupGemmConfig
from .scheduler import GroupTileScheduler


class GroupGemmWgradSm90(GroupTileScheduler, GroupGemmSm90Base):
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

    multicast_a = True  # GroupGemmConfig.cluster_n = 2: two n tiles of one (group, m tile) share its A tiles
    multicast_b = True  # GroupGemmConfig.cluster_m = 2: two m tiles of one (group, n tile) share its B tiles

    def __init__(self, config: GroupGemmConfig, dw_m_major: bool = False):
        self._init_common(
            config,
            LayoutEnum.COL_MAJOR,  # A = x^T (Kd, rows): M-major
            LayoutEnum.COL_MAJOR,  # B = dy^T (Nd, rows): N-major
            self._init_tma_store_epilogue(config.tile_m, config.pingpong),
            pingpong=config.pingpong,
        )
        # dw_m_major: the gradients are stored Kd contiguous (dw_home and dw_slot the transposes of
        # [*, Nd, Kd] tensors), the home tiles through an M-major shared sub-tile (stmatrix transposing)
        if dw_m_major:
            self.c_layout = LayoutEnum.COL_MAJOR

    @cute.jit
    def __call__(
        self,
        x: cute.Tensor,  # (N, Kd), Kd contiguous
        dy: cute.Tensor,  # (N, Nd), Nd contiguous
        cu_seqlens: cute.Tensor,  # (G,) int32
        dw_home: cute.Tensor,  # (epn, Kd, Nd) bf16, Nd contiguous: written
        dw_slot: cute.Tensor,  # (B, Kd, Nd) fp32, Nd contiguous: accumulated
        tile_counter: cute.Tensor,  # (1,) int32, zero: the dynamic walk's counter (unused by the static walk)
        stream: cuda.CUstream,
    ):
        self._launch(x, dy, cu_seqlens, dw_home, dw_slot, tile_counter, stream)

    @cute.jit
    def _launch(self, x, dy, cu_seqlens, dw_home, dw_slot, tile_counter, stream, row_src=None):
        """Shared by the plain kernel (x = the grouped rows [N, Kd]) and the one with a gathered A
        (``row_src`` not None: x is [S, Kd], k row r of A is x[row_src[r]], no TMA for A)."""
        self._setup_mainloop()
        self._setup_tma_store_epilogue()
        # (Kd, Nd, E) views of the gradients
        d_home = cute.make_tensor(dw_home.iterator, cute.select(dw_home.layout, mode=[1, 2, 0]))
        d_slot = cute.make_tensor(dw_slot.iterator, cute.select(dw_slot.layout, mode=[1, 2, 0]))

        if cutlass.const_expr(row_src is None):
            a_view = cute.make_tensor(x.iterator, cute.select(x.layout, mode=[1, 0]))  # (Kd, N)
            tma_a, mA = self._tma_load_a(a_view)
        else:
            tma_a, mA = None, x
        b_view = cute.make_tensor(dy.iterator, cute.select(dy.layout, mode=[1, 0]))  # (Nd, N)
        tma_b, mB = self._tma_load_b(b_view)
        tma_c, mC = self._tma_store_c(d_home)

        # (in clusters: pairs of m tiles, cluster_m, or of n tiles, cluster_n)
        num_m_tiles = cute.ceil_div(cute.size(x, mode=[1]), self.tile_m * self.cluster_m)
        num_n_tiles = cute.ceil_div(cute.size(dy, mode=[1]), self.tile_n * self.cluster_n)
        num_tiles = cute.size(cu_seqlens, mode=[0]) * (num_m_tiles * num_n_tiles)
        self._make_shared_storage(with_c=True)
        self._launch_persistent(
            self.kernel(
                tma_a, mA, tma_b, mB, tma_c, mC, cu_seqlens, d_slot,
                self.tiled_mma, self.a_smem_staged, self.b_smem_staged, self.epi_smem_staged,
                num_n_tiles, num_m_tiles * num_n_tiles, num_tiles, row_src, self.walk_counter(tile_counter),
            ),
            num_tiles,
            stream,
        )

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
        row_src,  # None, or (N,) int32: the gathered A's token of each k row (mA = x; tma_a is None)
        tile_counter,  # None (the static walk), or the dynamic walk's counter
    ):
        a_atoms = (tma_a,)
        if cutlass.const_expr(row_src is not None):
            a_atoms, mA = (), (mA, row_src)  # GatherKRowsMixin.partition_loads takes the pair
        self.warp_specialized(KernelParams(
            atoms=a_atoms + (tma_b, tma_c), tma_a=tma_a, mA=mA, b_operands=[(tma_b, mB, 0)], b_buffers=("sB",),
            a_smem_staged=a_smem_staged, b_smem_staged=b_smem_staged, epi_smem_staged=epi_smem_staged,
            tiled_mma=tiled_mma, cu_seqlens=cu_seqlens, num_n_tiles=num_n_tiles, tiles_per_group=tiles_per_group,
            num_tiles=num_tiles, tma_c=tma_c, mC=mC, mDs=mDs, row_src=row_src, tile_counter=tile_counter,
        ))

    @cute.jit
    def consumer_setup(self, p, mma_tidx, thr_mma, sC: cute.Tensor):
        """The accumulator, the home groups' TMA-store epilogue and the slot groups' tiles."""
        # (bM, bN, RestM, RestN, E) tiles of the home gradients (TMA coordinates)
        gC = cute.local_tile(p.mC, (self.tile_m, self.tile_n), (None, None, None))
        dims = (cute.size(p.mDs, mode=[0]), cute.size(p.mDs, mode=[1]))  # (Kd, Nd), static
        # (bM, bN, RestM, RestN, B) tiles of the slot gradients and (bM, bN, RestM, RestN) of their coordinates
        gDs = cute.local_tile(p.mDs, (self.tile_m, self.tile_n), (None, None, None))
        cD = cute.local_tile(cute.make_identity_tensor(dims), (self.tile_m, self.tile_n), (None, None))
        acc = cute.make_rmem_tensor(
            self.epilogue_partition(p.tiled_mma, mma_tidx, cD[(None, None, 0, 0)]).shape, self.acc_dtype
        )
        tiled_copy_r2s, tRS_sD, tRS_rD, tRS_rOut, epi_bar, store_pipe, epi_slot0 = self.make_tma_store_epilogue(
            p.tiled_mma, mma_tidx, sC
        )
        return KernelParams(mma_tidx=mma_tidx, sC=sC, gC=gC, dims=dims, gDs=gDs, cD=cD, acc=acc,
                            tiled_copy_r2s=tiled_copy_r2s, tRS_sD=tRS_sD, tRS_rD=tRS_rD, tRS_rOut=tRS_rOut,
                            epi_bar=epi_bar, store_pipe=store_pipe, epi_slot0=epi_slot0,
                            tRS_rAcc=tiled_copy_r2s.retile(acc))

    @cute.jit
    def consume_tile(self, p, c, warp_idx, mainloop, read_state, release_state, tCrA: cute.Tensor, tCrBs,
                     info, turn, epi_count: cutlass.Int32):
        """One work item (its coordinates: ``tile_info``): home items always run (an empty group: no k tiles,
        zeros stored) and store bf16; slot items with rows add fp32 into the reduce buffer; empty slot groups'
        items are skipped."""
        g, m_idx, n_idx, k_start, k_count = info
        is_home = g < p.num_home
        if is_home | (k_count > 0):  # the mainloop takes its turn (pingpong) in mma_k_tiles
            read_state, release_state = self.mma_k_tiles(
                p, mainloop, read_state, release_state, [c.acc], tCrA, tCrBs, k_count, turn,
                self.routed_k_rows(p, k_start, k_count),
            )
            epi_count = self.store_item(p, c, warp_idx, g, m_idx, n_idx, is_home, epi_count)
        else:  # a skipped item takes and passes the turn too
            self.wait_mainloop_turn(turn)
            self.pass_mainloop_turn(turn)
        return read_state, release_state, epi_count

    def routed_k_rows(self, p, k_start, k_count):
        """The item's k rows that hold data (``mma_k_tiles``' ``k_rows``): all of them (None) when A is the
        grouped rows themselves, whose padding rows the kernel cannot tell apart."""
        return None

    @cute.jit
    def store_item(self, p, c, warp_idx, g, m_idx, n_idx, is_home, epi_count: cutlass.Int32):
        """A work item's epilogue: a home item's tile written in bf16 (registers -> shared -> TMA store),
        a slot item's added in fp32 into the reduce buffer. Returns the storing group's sub-tile count."""
        if is_home:
            epi_count = self.store_acc_tile(p, c, warp_idx, c.gC[(None, None, m_idx, n_idx, g)], epi_count)
        else:
            tCcD = self.epilogue_partition(p.tiled_mma, c.mma_tidx, c.cD[(None, None, m_idx, n_idx)])
            full = self.is_full_tile(m_idx, n_idx, c.dims)
            self.add_into(
                c.acc,
                self.epilogue_partition(p.tiled_mma, c.mma_tidx, c.gDs[(None, None, m_idx, n_idx, g - p.num_home)]),
                tCcD, c.dims, full,
            )
        return epi_count


class GroupGemmWgradGatherSm90(gather.GatherKRowsMixin, GroupGemmWgradSm90):
    """The varlen-K grouped weight gradient with a gathered A operand: per group g, ``dW_g = rows_g^T @
    dy_g`` where row r of ``rows`` is ``x[row_src[r]]``, a zero row where ``row_src[r] < 0`` (``gather``:
    A's k rows by cp.async from the producer warp group, each thread 8 consecutive H elements of one
    token row; B = dy^T by TMA as in the plain kernel). Bitwise the plain kernel's outputs for ``rows =
    where(row_src >= 0, x[row_src], 0)``: the A stages hold the same bytes in the same layout, and the
    mainloop, schedule and epilogues are the plain kernel's. With ``dw_m_major`` it also computes the down
    projection's wgrad, ``dW_down_g^T = g_y_g^T @ h_w_g`` with the gathered g_y as A (x = g_out) into the
    transposed dW_down (``group_gemm_wgrad_gather_b``)."""

    def __init__(self, config: GroupGemmConfig, dw_m_major: bool = False):
        super().__init__(config, dw_m_major)
        self._init_gather()

    @cute.jit
    def __call__(
        self,
        x: cute.Tensor,  # (S, Kd), Kd contiguous: the tokens
        row_src: cute.Tensor,  # (N,) int32: grouped row r is x[row_src[r]], zero when row_src[r] < 0
        dy: cute.Tensor,  # (N, Nd), Nd contiguous
        cu_seqlens: cute.Tensor,  # (G,) int32
        dw_home: cute.Tensor,  # (epn, Kd, Nd) bf16, Nd contiguous: written
        dw_slot: cute.Tensor,  # (B, Kd, Nd) fp32, Nd contiguous: accumulated
        tile_counter: cute.Tensor,  # (1,) int32, zero: the dynamic walk's counter (unused by the static walk)
        stream: cuda.CUstream,
    ):
        self._launch(x, dy, cu_seqlens, dw_home, dw_slot, tile_counter, stream, row_src=row_src)


def wgrad_epilogue_coverage(tile_m: int = 128, tile_n: int = 256) -> dict:
    """CPU check of the wgrad slot-group epilogue's thread -> element map (the fp32 read-add-write into
    the reduce buffers; layout algebra at trace time only).

    Returns how many (row, col) of a ``tile_m x tile_n`` output tile the consumer threads' partitions
    (``GroupGemmWgradSm90.epilogue_partition``) write, how many distinct ones, and the tile size: every
    element must be written by exactly one thread. Run with ``CUTE_DSL_ARCH=sm_90a`` (see the tests).
    """
    from csrc_cute.compile_check import expect_no_driver

    kernel = GroupGemmWgradSm90(GroupGemmConfig(tile_m, tile_n, 1))
    seen: list[tuple[int, int]] = []

    @cute.jit
    def probe():
        kernel._setup_mainloop()
        tile = cute.make_identity_tensor((tile_m, tile_n))
        for coords in partition_coords(lambda t: kernel.epilogue_partition(kernel.tiled_mma, t, tile),
                                       kernel.num_mma_threads):
            seen.extend(coords)

    with expect_no_driver():
        cute.compile(probe)
    inside = all(0 <= r < tile_m and 0 <= c < tile_n for r, c in seen)
    return dict(writes=len(seen), distinct=len(set(seen)), elements=tile_m * tile_n, inside=inside)


def wgrad_gather_copy_coverage(tile_m: int = 128, tile_n: int = 256) -> dict:
    """CPU check of the gathered wgrad's M-major A copy on one A stage: ``gather.gather_copy_coverage`` of
    ``GroupGemmWgradGatherSm90`` (``tile_n`` unused: the A stage is tile_m x 64). Run with
    ``CUTE_DSL_ARCH=sm_90a`` (see the tests)."""
    del tile_n
    return gather.gather_copy_coverage(GroupGemmWgradGatherSm90(GroupGemmConfig(tile_m, 128, 1)))


def wgrad_store_pairing(tile_m: int = 128, tile_n: int = 192, pingpong: bool = True, dw_m_major: bool = True) -> dict:
    """CPU check of the wgrad's home-tile store (``base.epilogue_pairing``): the value v of output sub-tile e
    that a thread stores is value v of its accumulator's sub-tile e, with the gradient N-major or, with
    ``dw_m_major``, M-major (the shared sub-tile transposed by stmatrix)."""
    kernel = GroupGemmWgradSm90(GroupGemmConfig(tile_m, tile_n, 1, pingpong), dw_m_major)
    return epilogue_pairing(kernel, lambda e: [(e, 0)])
