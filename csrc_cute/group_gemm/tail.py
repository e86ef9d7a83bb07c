"""The narrow last n tile (``GroupGemmConfig.narrow_tail``): where an output's last n tile is partial, its
mainloop runs a second tiled MMA only as wide as its columns instead of the whole tile's width.

The width is static (the output's columns are a compile-time value): ``set_tail_n`` at trace time. The
narrower MMA reads the first rows of the same B ring stage and writes the first column chunks of the same
accumulator (a wgmma C fragment of N = w is the first w / 8 chunks of a wider one's), so the loads, the
ring and the epilogue stay as they are; the accumulator columns past it hold no output and are never stored
(TMA clips them, the slot epilogues predicate them). At the DESIGN shape the dgrad's 38th 192-column tile
holds 64 of 7168 columns and the wgrads' 11th 128 of 2048. Where ptxas spills or serialises the wgmmas of a
kernel with both widths: docs/design-notes.md, "Narrow last n tile".
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import warpgroup


class NarrowTail:
    """Mixin of ``GroupGemmSm90Base``: a family sets ``narrow_tail_mma``, calls ``set_tail_n`` in its launch
    and runs each tile's mainloop through ``tile_mainloop``; ``warp_specialized`` adds ``p.narrow_tail``
    (``add_narrow_tail``) where ``tail_n`` is set."""

    # whether the kernel may run its partial last n tile with a narrower MMA (``GroupGemmConfig.narrow_tail``)
    narrow_tail_mma = False
    # the narrower MMA's width (0: none), set at trace time from the output's static width (``set_tail_n``)
    tail_n = 0

    def set_tail_n(self, out_cols: int, b_n_major: bool) -> None:
        """Trace time: ``tail_n``, the MMA width of the output's last n tile where ``narrow_tail`` is on and
        that tile is partial (``out_cols``, the output's static width, not a multiple of tile_n): its columns
        rounded up to the wgmma's N step of 8, or to 64 where B is N-major (a sub-tile of its stage must be
        whole 128-byte swizzle atoms); else 0."""
        tail = out_cols - (-(-out_cols // self.tile_n) - 1) * self.tile_n
        step = 64 if b_n_major else 8
        width = -(-tail // step) * step
        self.tail_n = width if self.narrow_tail and width < self.tile_n else 0

    def add_narrow_tail(self, p, sBs):
        """``p.narrow_tail``: the kernel params of the last n tile's mainloop (``set_tail_n``), ``p`` with a
        tiled MMA of tile_m x tail_n (and its first-k-block copy) over the first tail_n rows of each B stage
        (``tCrBs``), and ``acc``, a view of an accumulator's first tail_n / 8 column chunks (a wgmma C fragment
        of N = w is the first w / 8 chunks of a wider one's, so the epilogue stores it as it is; the columns
        past it are no output's and are never stored)."""
        mma = sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype, self.ab_dtype, self.a_layout.sm90_mma_major_mode(), self.b_layout.sm90_mma_major_mode(),
            self.acc_dtype, self.atom_layout_mnk, tiler_mn=(64, self.tail_n))
        thr = mma.get_slice(0)  # the B fragment is the same for every warp group's slice
        tCrBs = [mma.make_fragment_B(thr.partition_B(cute.local_tile(sB, (self.tail_n, self.tile_k, self.ab_stage),
                                                                      (0, 0, 0)))) for sB in sBs]
        mma.set(warpgroup.Field.ACCUMULATE, True)
        first = mma.with_()
        first.set(warpgroup.Field.ACCUMULATE, False)
        chunks = self.tail_n // 8

        def acc(full: cute.Tensor) -> cute.Tensor:
            v, *rest = full.layout.shape
            return cute.make_tensor(full.iterator, cute.make_layout(((v[0], v[1], chunks), *rest),
                                                                     stride=full.layout.stride))
        p.narrow_tail = type(p)(**dict(p.__dict__, tiled_mma=mma, first_mma=first), tCrBs=tCrBs, acc=acc)

    @cute.jit
    def tile_mainloop(self, p, n_idx, mainloop, read_state, release_state, accs, tCrA: cute.Tensor, tCrBs,
                      k_count: cutlass.Int32, turn, k_rows=None):
        """``mma_k_tiles`` of a tile at n tile ``n_idx``; where ``tail_n`` is set (``GroupGemmConfig.narrow_tail``)
        the partial last n tile's with ``p.narrow_tail``'s MMA (``add_narrow_tail``) into the accumulators'
        first columns (the others keep an earlier tile's values: no output's, never stored)."""
        if cutlass.const_expr(self.tail_n > 0):
            tail = p.narrow_tail
            tail_accs = [tail.acc(acc) for acc in accs]  # (no method call on p inside the dynamic if)
            if n_idx == p.num_n_tiles - 1:
                read_state, release_state = self.mma_k_tiles(tail, mainloop, read_state, release_state, tail_accs,
                                                              tCrA, tail.tCrBs, k_count, turn, k_rows)
            else:
                read_state, release_state = self.mma_k_tiles(p, mainloop, read_state, release_state, accs, tCrA,
                                                              tCrBs, k_count, turn, k_rows)
        else:
            read_state, release_state = self.mma_k_tiles(p, mainloop, read_state, release_state, accs, tCrA, tCrBs,
                                                          k_count, turn, k_rows)
        return read_state, release_state
