"""Autograd of the moonep ops.

`group_gemm` is functional, so it gets `register_autograd`. Dispatch, combine and the weight path write
persistent buffers (which `register_autograd` refuses), so each has a `torch.autograd.Function` around
its op; Dynamo traces those under torch.compile. Backward never re-plans: it reuses the forward's plan.
  dispatch  backward = combine of the row gradients + gather of the route-weight gradients
  combine   backward = dispatch of the token gradients
  prefetch  backward = reduce_grad of the copies' weight gradients into the home experts
"""

from __future__ import annotations

import torch

from . import ops
from .group import EPGroup

Tensor = torch.Tensor


# ---------------------------------------------------------------------------------------- group_gemm
def _gemm_setup(ctx, inputs, output):
    x, w_home, w_slot, cu_seqlens, P = inputs
    ctx.save_for_backward(x, w_home, w_slot, cu_seqlens)
    ctx.P = P


def _gemm_backward(ctx, dy):
    x, w_home, w_slot, cu_seqlens = ctx.saved_tensors
    dy = dy.contiguous()
    dx = dw_home = dw_slot = None
    if ctx.needs_input_grad[0]:
        dx = ops.group_gemm_dgrad(dy, w_home, w_slot, cu_seqlens, ctx.P)
    if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
        dw_home = w_home.new_zeros(w_home.shape, dtype=torch.float32)
        dw_slot = w_slot.new_zeros(w_slot.shape, dtype=torch.float32)
        ops.group_gemm_wgrad(x, dy, cu_seqlens, dw_home, dw_slot, ctx.P)
        dw_home, dw_slot = dw_home.to(w_home.dtype), dw_slot.to(w_slot.dtype)
    return dx, dw_home, dw_slot, None, None


ops.group_gemm.register_autograd(_gemm_backward, setup_context=_gemm_setup)


# ------------------------------------------------------------------------------ dispatch and combine
# The persistent buffers travel as explicit tensor arguments (not through the EPGroup object), the form
# Dynamo traces into the graph as the buffers themselves.
class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, route_w, dst_rank, dst_row, primary_row, cu_seqlens, group_rows,
                recv_rows, recv_w, recv_primary, recv_next, presum, row_scratch, ctrl, group_name):
        rows, row_w, row_primary, row_next = ops.dispatch(
            x, route_w, dst_rank, dst_row, primary_row, cu_seqlens, group_rows,
            recv_rows, recv_w, recv_primary, recv_next, ctrl, group_name)
        ctx.save_for_backward(dst_rank, dst_row, primary_row, row_primary, row_next)
        ctx.buffers = (presum, row_scratch, ctrl)
        ctx.group_name = group_name
        ctx.mark_non_differentiable(row_primary, row_next)
        return rows, row_w, row_primary, row_next

    @staticmethod
    def backward(ctx, g_rows, g_row_w, _, __):
        dst_rank, dst_row, primary_row, row_primary, row_next = ctx.saved_tensors
        presum, row_scratch, ctrl = ctx.buffers
        # both ops are collective: every rank runs them, with zeros for an output it did not use
        if g_rows is None:
            g_rows = presum.new_zeros(presum.shape)
        if g_row_w is None:
            g_row_w = row_scratch.new_zeros(row_scratch.shape)
        gx = ops.combine(g_rows.contiguous(), row_primary, row_next, dst_rank, dst_row, primary_row, presum, ctrl,
                         ctx.group_name)
        g_route_w = ops.gather_row_weights(g_row_w.contiguous(), dst_rank, dst_row, row_scratch, ctrl,
                                           ctx.group_name)
        return (gx, g_route_w) + (None,) * 13


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, row_primary, row_next, dst_rank, dst_row, primary_row, cu_seqlens, group_rows,
                presum, recv_rows, recv_w, recv_primary, recv_next, ctrl, group_name):
        out = ops.combine(rows, row_primary, row_next, dst_rank, dst_row, primary_row, presum, ctrl, group_name)
        ctx.save_for_backward(dst_rank, dst_row, primary_row, cu_seqlens, group_rows)
        ctx.buffers = (recv_rows, recv_w, recv_primary, recv_next, ctrl)
        ctx.group_name = group_name
        return out

    @staticmethod
    def backward(ctx, g_out):
        dst_rank, dst_row, primary_row, cu_seqlens, group_rows = ctx.saved_tensors
        unit_w = torch.ones(dst_rank.shape, dtype=torch.float32, device=g_out.device)
        g_rows, _, _, _ = ops.dispatch(g_out.contiguous(), unit_w, dst_rank, dst_row, primary_row, cu_seqlens,
                                       group_rows, *ctx.buffers, ctx.group_name)
        return (g_rows,) + (None,) * 14


def dispatch(ep: EPGroup, x: Tensor, route_w: Tensor, dst_rank: Tensor, dst_row: Tensor, primary_row: Tensor,
             cu_seqlens: Tensor, group_rows: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Differentiable dispatch: (rows [NvS, H], row weights [NvS], row_primary [NvS], row_next [NvS])."""
    return _Dispatch.apply(x, route_w, dst_rank, dst_row, primary_row, cu_seqlens, group_rows, *ep.recv_buffers,
                           ep.presum, ep.row_scratch, ep.ctrl, ep.group_name)


def combine(ep: EPGroup, rows: Tensor, row_primary: Tensor, row_next: Tensor, dst_rank: Tensor, dst_row: Tensor,
            primary_row: Tensor, cu_seqlens: Tensor, group_rows: Tensor) -> Tensor:
    """Differentiable combine: expert output rows [NvS, H] -> token rows [S, H]."""
    return _Combine.apply(rows, row_primary, row_next, dst_rank, dst_row, primary_row, cu_seqlens, group_rows,
                          ep.presum, *ep.recv_buffers, ep.ctrl, ep.group_name)


# -------------------------------------------------------------------------------------- weight path
class _SlotWeights(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w_gate, w_up, w_down, experts_to_copy, pool_gate, pool_up, pool_down,
                reduce_gate, reduce_up, reduce_down, group_name):
        slots = ops.prefetch_weights(w_gate, w_up, w_down, experts_to_copy, pool_gate, pool_up, pool_down,
                                     group_name)
        ctx.save_for_backward(experts_to_copy)
        ctx.reduce = (reduce_gate, reduce_up, reduce_down)
        ctx.meta = (w_gate.shape[0], w_gate.dtype, group_name)
        return slots

    @staticmethod
    def backward(ctx, *slot_grads):
        (experts_to_copy,) = ctx.saved_tensors
        epn, dtype, group_name = ctx.meta
        # collective: every rank folds all three projections, zeros for a slot weight it did not use
        g_gate, g_up, g_down = (buf.new_zeros(buf.shape) if g is None else g.contiguous()
                                for g, buf in zip(slot_grads, ctx.reduce))
        home = ops.reduce_grad(g_gate, g_up, g_down, experts_to_copy, *ctx.reduce, epn, group_name)
        return (*(h.to(dtype) for h in home), None, None, None, None, None, None, None, None)


def slot_weights(ep: EPGroup, w_gate: Tensor, w_up: Tensor, w_down: Tensor, experts_to_copy: Tensor
                 ) -> tuple[Tensor, Tensor, Tensor]:
    """This layer's copied experts (gate, up, down) in the rank's slots; gradients flow home."""
    return _SlotWeights.apply(w_gate, w_up, w_down, experts_to_copy, *ep.pools, *ep.reduce_buffers,
                              ep.group_name)
