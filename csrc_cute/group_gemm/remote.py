"""Remote groups (inference): B operands read straight from another rank's home weights.

With remote groups ``G = epn + B + n_remote`` and remote group ``j = g - epn - B`` multiplies by
expert ``e = remote_experts[j]`` (global id; -1: an unused group) of its home rank ``h = e // epn``:
``W_g = W_home(rank h)[e % epn]``, read through the peer mapping (device addresses ``peers[h]``, one
array per projection; same shape and strides as ``w_home``). The producer warp gets one more
descriptor per B ring: at the CTA's first remote tile it copies the home atom's TMA descriptor into
the CTA's 128-byte slot of a global-memory workspace (allocated per launch by the host), replaces its
global address with ``peers[h]`` (``tensormap.replace``), fences (``fence.proxy.tensormap::generic``
release, then acquire) and loads every remote tile through it (``tma_desc_ptr``), with expert index
``e % epn``. Precondition: every remote expert of a launch comes from one donor rank (the planner
copies a rank's experts from one donor group). One descriptor per ring and CTA then suffices and never
changes while loads that use it are in flight; switching donors mid-launch would need the ring drained
before the descriptor is rewritten (the producer cannot tell when the TMA unit has finished reading a
descriptor for the loads already issued). A remote group whose expert is -1 must be empty.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils as utils
from cutlass.cute.nvgpu import cpasync

from .scheduler import RowTileScheduler


class RemoteWeightsMixin(RowTileScheduler):
    """The row scheduler's producer with remote groups; the kernel sets ``p.remote`` =
    (remote_experts, [peers per B ring], [home weights viewed as B per ring], descriptor workspace)
    and lists the home B rings first in ``p.home_rings``. Put it before the kernel class:
    ``class GroupGemmRowScaleRemoteSm90(RemoteWeightsMixin, GroupGemmRowScaleSm90)``."""

    multicast_a = False  # each CTA's remote descriptors are its own; clusters are not tested with them
    multicast_b = False  # likewise: the remote groups' B loads go through this CTA's own descriptors
    dynamic_walk = False  # the descriptors are built at the CTA's first remote tile of its static walk
    scheduled_walk = False  # its loading warp walks the static tiles itself (``load_tiles``)

    @cute.jit
    def load_tiles(self, mainloop, prod_state, p, tAgA: cute.Tensor, tAsA: cute.Tensor, b_loads, is_writer):
        """``GroupGemmSm90Base.load_tiles`` (producer warp; the static walk: ``is_writer`` unused) with remote
        groups (``p.remote``): groups [epn + B, G) are remote group j = g - epn - B, expert e =
        remote_experts[j], read from the donor's home weights ``peers[e // epn]`` (per B ring), expert index
        ``e % epn``. The loads of remote tiles go through a copy
        of the home atom's descriptor in this CTA's global-memory slot(s), with the donor's address, built once,
        at the CTA's first remote tile (``build_remote_descriptors``): every remote expert of a launch comes
        from one donor (the caller's precondition), so the descriptor never changes while loads that use it are
        in flight. A remote group whose expert is -1 (an unused group) must be empty."""
        remote_experts, peers, b_views, desc_ws = p.remote
        cu_seqlens, num_n_tiles, num_tiles = p.cu_seqlens, p.num_n_tiles, p.num_tiles
        tma_a, k_tiles = p.tma_a, p.k_tiles
        b_home = [b_loads[i] for i in p.home_rings]
        b_slot = [b_loads[i] for i in p.slot_rings]
        bidx, gdim = self.cta_tiles()
        num_groups = cute.size(cu_seqlens, mode=[0])
        num_home = b_home[0].num_experts()
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
            for b, slot in zip(b_home, desc_slots):
                cpasync.copy_tensormap(b.atom, slot)
        cute.arch.sync_warp()
        cute.arch.fence_acq_rel_cta()
        for b, ring_peers, view, slot in zip(b_home, peers, b_views, desc_slots):
            donor_b = cute.make_tensor(
                cute.make_ptr(self.ab_dtype, ring_peers[donor], cute.AddressSpace.gmem, assumed_align=16),
                view.layout,
            )
            cpasync.update_tma_descriptor(b.atom, donor_b, slot)
        cute.arch.sync_warp()
        cpasync.fence_tma_desc_release()
        for desc in descs:
            cpasync.fence_tma_desc_acquire(desc)
