"""Two operand pairs summed into one accumulator: ``C[rows of g] = A0[rows of g] @ op(W0_g) + A1[rows of g] @
op(W1_g)`` (``group_gemm_dgrad2``: the input gradient of the gate and up projections, one fp32 accumulator,
one rounding, one store instead of two GEMMs, two outputs and an add).

The mainloop is the row kernels' unchanged: per output tile the consumers run one k loop of ``2 x K``
ring stages into one accumulator. Only the producer differs: the k tiles [0, K) of a tile come from the
first pair (A0 and the B operand of W0_g), the k tiles [K, 2K) from the second (A1, W1_g), each pair
through its own TMA descriptors (K = the reduction length / tile_k, equal for both pairs).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from .base import GroupGemmSm90Base
from .scheduler import RowTileScheduler


class OperandPairsMixin(RowTileScheduler):
    """The row scheduler with two (A, B) operand pairs. The kernel sets ``p.tma_a`` / ``p.mA`` to the
    pairs' A atoms / tensors (two each; A shares one shared-memory ring, B one ring) and
    ``p.home_rings`` / ``p.slot_rings`` to each pair's home / slot B operand (pair order). Put it
    before the kernel class: ``class GroupGemmDgrad2Sm90(OperandPairsMixin, GroupGemmSm90)``."""

    num_pairs = 2

    @cute.jit
    def partition_loads(self, tma_a, mA, sA: cute.Tensor, b_operands):
        """``GroupGemmSm90Base.partition_loads`` per pair's A (the B operands once): A as a tuple of
        the pairs' (TMA, RestM, RestK) views and of their (TMA, stage) ring views; k tiles per pair."""
        tAgA0, tAsA0, b_loads, k_tiles = GroupGemmSm90Base.partition_loads(self, tma_a[0], mA[0], sA, b_operands)
        tAgA1, tAsA1, _, _ = GroupGemmSm90Base.partition_loads(self, tma_a[1], mA[1], sA, [])
        return (tAgA0, tAgA1), (tAsA0, tAsA1), b_loads, k_tiles

    @cute.jit
    def tile_work(self, p, info):
        """``RowTileScheduler.tile_work`` with both pairs' k tiles in one k loop."""
        m_idx, n_idx, k_count = RowTileScheduler.tile_work(self, p, info)
        return m_idx, n_idx, k_count * self.num_pairs

    @cute.jit
    def load_tile(self, mainloop, prod_state, p, tAgA, tAsA, b_loads, info):
        """Producer warp (``load_tiles``' step): a tile's (``tile_info``) k tiles of the first pair (A0, W0_g), then
        the second's (A1, W1_g), into the one ring; a tile past the last group loads nothing."""
        num_home = b_loads[p.home_rings[0]].num_experts()
        m_idx, n_idx, g, _ = info
        lone = self.weight_tile_lone(info)
        for pair in cutlass.range_constexpr(self.num_pairs):
            load = (mainloop, prod_state, p.tma_a[pair], tAgA[pair], tAsA[pair], m_idx, n_idx, p.k_tiles)
            if g < num_home:
                prod_state = self.load_expert_tile(*load, [b_loads[p.home_rings[pair]]], g, lone=lone)
            elif g < p.num_groups:
                prod_state = self.load_expert_tile(*load, [b_loads[p.slot_rings[pair]]], g - num_home, lone=lone)
        return prod_state
