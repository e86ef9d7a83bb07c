"""The B operand's TMA loads (the weights, or the wgrad's dy^T) into the ring, alone or in clusters of two
CTAs sharing each B tile (``GroupGemmConfig.cluster_m`` = 2).

In such a cluster each B tile is loaded in two shares, one per CTA, each multicast into both CTAs' stage.
A lone tile of the row kernels' walk (``RowTileScheduler.pair_tile``: an odd group's last M tile, whose
two CTAs compute two n tiles of it) needs a whole B tile per CTA: each CTA then loads both shares of its
own tile into its own stage. The stage's mbarrier expects the same bytes either way, and the consumers of
both CTAs still release every stage of both (the two CTAs walk the same tiles, stage for stage).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync


class BTileLoad:
    """One B ring's TMA loads in this CTA: the atom, the global view (TMA, RestN, RestK[, E]) and the
    shared ring view (TMA, stage) of this CTA's share of a B tile, and in clusters sharing B the same
    two views of the other CTA's share (``peer_gmem`` / ``peer_smem``, None otherwise). ``at`` picks one
    tile's (TMA, RestK)."""

    def __init__(self, atom, gmem, smem, peer_gmem=None, peer_smem=None):
        self.atom, self.gmem, self.smem, self.peer_gmem, self.peer_smem = atom, gmem, smem, peer_gmem, peer_smem

    def at(self, n_idx, expert=None) -> BTileLoad:
        """The loads of n tile ``n_idx`` (of expert ``expert`` where the view has an expert mode)."""
        coord = (None, n_idx, None) if expert is None else (None, n_idx, None, expert)
        peer = None if self.peer_gmem is None else self.peer_gmem[coord]
        return BTileLoad(self.atom, self.gmem[coord], self.smem, peer, self.peer_smem)

    def num_experts(self):
        """The experts of a view with an expert mode (the home or slot weights)."""
        return cute.size(self.gmem, mode=[3])


class BTileLoads:
    """Mixin of ``GroupGemmSm90Base``: partitions the B operands (``partition_b_loads``) and loads one k tile
    of a B tile (``load_b_tile``)."""

    @cute.jit
    def partition_b_loads(self, b_operands):
        """Per B operand (atom, tensor, shared ring) its ``BTileLoad``: in clusters sharing B this CTA's share of
        each tile and the other CTA's."""
        b_loads = []
        rank = self.cluster_rank()
        for tma_b, mB, sB in b_operands:
            gB = cute.local_tile(mB, (self.tile_n, self.tile_k), (None,) * cute.rank(mB))
            if cutlass.const_expr(self.cluster_m > 1):
                (tBsB, tBgB), (peer_sB, peer_gB) = (self.share_views(tma_b, sB, gB, s) for s in (rank, 1 - rank))
                b_loads.append(BTileLoad(tma_b, tBgB, tBsB, peer_gB, peer_sB))
            else:
                tBsB, tBgB = self.share_views(tma_b, sB, gB, 0)
                b_loads.append(BTileLoad(tma_b, tBgB, tBsB))
        return b_loads

    @cute.jit
    def share_views(self, tma_b, sB, gB, share):
        """(shared, global) TMA views of share ``share`` of each B tile (the whole tile without clusters)."""
        return cpasync.tma_partition(
            tma_b, share, cute.make_layout(self.cluster_m), cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2)
        )

    @cute.jit
    def load_b_tile(self, b: BTileLoad, k, stage, bar, desc=None, lone=None):
        """k tile ``k`` of ``b`` (one tile's ``BTileLoad.at``) into ring stage ``stage`` (mbarrier ``bar``,
        through the global-memory descriptor ``desc`` when given). In clusters sharing B: this CTA's share into
        both CTAs, or where ``lone`` (a dynamic Boolean: ``RowTileScheduler.pair_tile``'s lone tile; None:
        never) both shares into this CTA alone."""
        if cutlass.const_expr(self.cluster_m == 1):
            cute.copy(b.atom, b.gmem[(None, k)], b.smem[(None, stage)], tma_bar_ptr=bar, tma_desc_ptr=desc)
        elif cutlass.const_expr(lone is None):
            cute.copy(b.atom, b.gmem[(None, k)], b.smem[(None, stage)], tma_bar_ptr=bar, tma_desc_ptr=desc,
                      mcast_mask=cutlass.Int16((1 << self.cluster_m) - 1))
        else:
            own = cutlass.Int16(1) << cutlass.Int16(self.cluster_rank())
            mask = cutlass.Int16(cutlass.select_(lone, own, cutlass.Int16((1 << self.cluster_m) - 1)))
            cute.copy(b.atom, b.gmem[(None, k)], b.smem[(None, stage)], tma_bar_ptr=bar, tma_desc_ptr=desc,
                      mcast_mask=mask)
            if lone:
                cute.copy(b.atom, b.peer_gmem[(None, k)], b.peer_smem[(None, stage)], tma_bar_ptr=bar,
                          tma_desc_ptr=desc, mcast_mask=own)
