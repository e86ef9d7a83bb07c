"""The down-projection dgrad with the SwiGLU backward in its epilogue (``group_gemm_swiglu_bwd``)."""

from __future__ import annotations

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass.utils import LayoutEnum

from .base import GroupGemmSm90Base, KernelParams, partition_coords
from .config import GroupGemmConfig
from .scheduler import RowTileScheduler


class GroupGemmSwigluBwdSm90(RowTileScheduler, GroupGemmSm90Base):
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
        _, tma_bh, mBh, tma_bs, mBs = self._tma_load_weights(w_home, w_slot)
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
        self.warp_specialized(KernelParams(
            atoms=(tma_a, tma_bh, tma_bs), tma_a=tma_a, mA=mA, b_operands=[(tma_bh, mBh, 0), (tma_bs, mBs, 0)],
            b_buffers=("sB",), home_rings=(0,), slot_rings=(1,), a_smem_staged=a_smem_staged,
            b_smem_staged=b_smem_staged, epi_smem_staged=None, tiled_mma=tiled_mma, cu_seqlens=cu_seqlens,
           num_n_tiles=num_n_tiles, num_tiles=num_tiles, row_w=row_w,
            mGate=mGate, mUp=mUp, mGG=mGG, mGU=mGU, mHW=mHW, mPart=mPart,
        ))

    @cute.jit
    def consumer_setup(self, p, mma_tidx, thr_mma, sC):
        """The thread's slice of the output tiles (element coordinates, see wgrad), the accumulator,
        the per-row partial sums and the registers gate/up are loaded into."""
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
        rG = cute.make_rmem_tensor(acc.layout, cutlass.BFloat16)  # gate, then g_gate
        rU = cute.make_rmem_tensor(acc.layout, cutlass.BFloat16)  # up, then g_up
        return KernelParams(thr_c=thr_c, n_rows=n_rows, dims=dims, gGate=gGate, gUp=gUp, gGG=gGG, gGU=gGU, gHW=gHW,
                            cC=cC, acc=acc, part_sums=part_sums, rG=rG, rU=rU, last_row=n_rows - 1)

    @cute.jit
    def consume_tile(self, p, c, warp_idx, mainloop, read_state, release_state, tCrA: cute.Tensor, tCrBs,
                     tile: cutlass.Int32, epi_count: cutlass.Int32):
        """One output tile: the dgrad MMA, the SwiGLU backward epilogue, the rows' partial sums
        (``epi_count`` passes through: no TMA stores)."""
        m_idx, n_idx, k_count = self.row_work(p, tile)  # past the last group: d = 0
        full = self.is_full_tile(m_idx, n_idx, c.dims)
        read_state, release_state = self.mma_k_tiles(
            mainloop, read_state, release_state, p.tiled_mma, [c.acc], tCrA, tCrBs, k_count
        )
        thr_c, acc, rG, rU, part_sums = c.thr_c, c.acc, c.rG, c.rU, c.part_sums
        coords = thr_c.partition_C(c.cC[(None, None, m_idx, n_idx)])
        tCgG = thr_c.partition_C(c.gGate[(None, None, m_idx, n_idx)])
        tCgU = thr_c.partition_C(c.gUp[(None, None, m_idx, n_idx)])
        tCgGG = thr_c.partition_C(c.gGG[(None, None, m_idx, n_idx)])
        tCgGU = thr_c.partition_C(c.gGU[(None, None, m_idx, n_idx)])
        tCgHW = thr_c.partition_C(c.gHW[(None, None, m_idx, n_idx)])

        part_sums.fill(0.0)
        if full:
            cute.autovec_copy(tCgG, rG)  # one batch of loads, before any store of this tile
            cute.autovec_copy(tCgU, rU)
            self.swiglu_bwd_epilogue(acc, coords, rG, rU, tCgG, tCgU, tCgGG, tCgGU, tCgHW, p.row_w,
                                     c.last_row, c.dims, True, part_sums)
        else:
            self.swiglu_bwd_epilogue(acc, coords, rG, rU, tCgG, tCgU, tCgGG, tCgGU, tCgHW, p.row_w,
                                     c.last_row, c.dims, False, part_sums)
        # the four lanes of a quad hold the same rows: reduce over them, lane 0 of the quad writes
        lane = cute.arch.lane_idx()
        mPart = p.mPart  # a local: the DSL carries what a dynamic branch writes into
        for j in cutlass.range_constexpr(len(self.row_first)):
            s = part_sums[j]
            s = s + cute.arch.shuffle_sync_bfly(s, offset=1)
            s = s + cute.arch.shuffle_sync_bfly(s, offset=2)
            r = coords[self.row_first[j]][0]
            if (lane % 4 == 0) & (r < c.n_rows):
                mPart[r, n_idx] = s
        return read_state, release_state, epi_count

    @cute.jit
    def consumer_tail(self, c, warp_idx):
        """Nothing to wait for: the epilogue stores straight from registers (no TMA stores)."""


def swiglu_bwd_row_quads(tile_m: int = 128, tile_n: int = 128) -> dict:
    """CPU check of the SwiGLU-backward epilogue's row reduction (layout algebra at trace time only).

    The kernel sums ``d * h`` per accumulator element into one register per static row slot
    (``row_slot``), then over the four lanes of a quad (xor shuffles 1 and 2), and lane 0 of the quad
    writes the row. Correct iff, for every consumer thread: the elements of a slot share one row
    (``row_first`` names it), the lanes of a quad hold the same rows, and a quad's elements of a row
    cover all ``tile_n`` columns once. Returns the number of violations of each and the counts checked.
    """
    from csrc_cute.compile_check import expect_no_driver

    kernel = GroupGemmSwigluBwdSm90(GroupGemmConfig(tile_m, 128, 1))
    kernel.tile_n = tile_n
    per_thread: list[list[tuple[int, int]]] = []

    @cute.jit
    def probe():
        kernel._setup_mainloop()
        kernel._row_slots()
        tile = cute.make_identity_tensor((tile_m, tile_n))
        per_thread.extend(partition_coords(lambda t: kernel.tiled_mma.get_slice(t).partition_C(tile),
                                           kernel.num_mma_threads))

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
