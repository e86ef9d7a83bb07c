"""Autograd of the moonep ops.

`group_gemm` is functional, so it gets `register_autograd`. Dispatch, combine and the weight path write
persistent buffers (which `register_autograd` refuses), so each has a `torch.autograd.Function` around
its op; Dynamo traces those under torch.compile. Backward never re-plans: it reuses the forward's plan.
  dispatch  backward = combine of the row gradients + gather of the route-weight gradients
  combine   backward = dispatch of the token gradients
  experts   (prefetch + SwiGLU GEMMs, one Function) backward = prefetch again, dgrad/wgrad GEMMs, and
            reduce_grad of the copies' weight gradients into the home experts
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
                send_rows, recv_w, recv_primary, recv_next, recv_src, presum, row_scratch, ctrl, group_name):
        rows, row_w, row_primary, row_next = ops.dispatch(
            x, route_w, dst_rank, dst_row, primary_row, cu_seqlens, group_rows,
            send_rows, recv_w, recv_primary, recv_next, recv_src, ctrl, group_name)
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
        return (gx, g_route_w) + (None,) * 14


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, row_primary, row_next, dst_rank, dst_row, primary_row, cu_seqlens, group_rows,
                presum, send_rows, recv_w, recv_primary, recv_next, recv_src, ctrl, group_name):
        out = ops.combine(rows, row_primary, row_next, dst_rank, dst_row, primary_row, presum, ctrl, group_name)
        ctx.save_for_backward(dst_rank, dst_row, primary_row, cu_seqlens, group_rows)
        ctx.buffers = (send_rows, recv_w, recv_primary, recv_next, recv_src, ctrl)
        ctx.group_name = group_name
        return out

    @staticmethod
    def backward(ctx, g_out):
        dst_rank, dst_row, primary_row, cu_seqlens, group_rows = ctx.saved_tensors
        unit_w = torch.ones(dst_rank.shape, dtype=torch.float32, device=g_out.device)
        g_rows, _, _, _ = ops.dispatch(g_out.contiguous(), unit_w, dst_rank, dst_row, primary_row, cu_seqlens,
                                       group_rows, *ctx.buffers, ctx.group_name)
        return (g_rows,) + (None,) * 15


def dispatch(ep: EPGroup, x: Tensor, route_w: Tensor, dst_rank: Tensor, dst_row: Tensor, primary_row: Tensor,
             cu_seqlens: Tensor, group_rows: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Differentiable dispatch: (rows [NvS, H], row weights [NvS], row_primary [NvS], row_next [NvS])."""
    return _Dispatch.apply(x, route_w, dst_rank, dst_row, primary_row, cu_seqlens, group_rows, *ep.dispatch_buffers,
                           ep.presum, ep.row_scratch, ep.ctrl, ep.group_name)


def combine(ep: EPGroup, rows: Tensor, row_primary: Tensor, row_next: Tensor, dst_rank: Tensor, dst_row: Tensor,
            primary_row: Tensor, cu_seqlens: Tensor, group_rows: Tensor) -> Tensor:
    """Differentiable combine: expert output rows [NvS, H] -> token rows [S, H]."""
    return _Combine.apply(rows, row_primary, row_next, dst_rank, dst_row, primary_row, cu_seqlens, group_rows,
                          ep.presum, *ep.dispatch_buffers, ep.ctrl, ep.group_name)


# ---------------------------------------------------------------------------------------- experts
def _swiglu(gate: Tensor, up: Tensor) -> Tensor:
    return (torch.nn.functional.silu(gate.float()) * up.float()).to(gate.dtype)


def _swiglu_backward(gate: Tensor, up: Tensor, g_hidden: Tensor) -> tuple[Tensor, Tensor]:
    g, u, dh = gate.float(), up.float(), g_hidden.float()
    sig = torch.sigmoid(g)
    g_up = dh * g * sig
    g_gate = dh * u * sig * (1 + g * (1 - sig))
    return g_gate.to(gate.dtype), g_up.to(up.dtype)


class _ExpertsFFN(torch.autograd.Function):
    """One layer's SwiGLU experts on this rank's rows: prefetch -> gate/up GEMMs -> SwiGLU -> down GEMM ->
    route-weight scaling. The slot pools are shared by every layer, so forward reads them in place and
    backward prefetches this layer's copies again (by then they hold another layer's); the wgrad GEMMs
    accumulate the copies' gradients into the reduce buffers and `reduce_grad` folds them home."""

    @staticmethod
    def forward(ctx, rows, row_w, w_gate, w_up, w_down, cu_seqlens, experts_to_copy,
                pool_gate, pool_up, pool_down, reduce_gate, reduce_up, reduce_down, ctrl, P, group_name):
        ops.prefetch_weights(w_gate, w_up, w_down, experts_to_copy, pool_gate, pool_up, pool_down, ctrl, group_name)
        gate = ops.group_gemm(rows, w_gate, pool_gate, cu_seqlens, P)
        up = ops.group_gemm(rows, w_up, pool_up, cu_seqlens, P)
        out = ops.group_gemm(_swiglu(gate, up), w_down, pool_down, cu_seqlens, P)
        ctx.save_for_backward(rows, row_w, w_gate, w_up, w_down, cu_seqlens, experts_to_copy, gate, up, out)
        ctx.buffers = (pool_gate, pool_up, pool_down, reduce_gate, reduce_up, reduce_down, ctrl)
        ctx.P, ctx.group_name = P, group_name
        return (out.float() * row_w[:, None]).to(rows.dtype)

    @staticmethod
    def backward(ctx, g_y):
        rows, row_w, w_gate, w_up, w_down, cu, etc, gate, up, out = ctx.saved_tensors
        pool_gate, pool_up, pool_down, reduce_gate, reduce_up, reduce_down, ctrl = ctx.buffers
        P, group_name = ctx.P, ctx.group_name
        # collective: every rank runs the whole backward whatever it needs
        ops.prefetch_weights(w_gate, w_up, w_down, etc, pool_gate, pool_up, pool_down, ctrl, group_name)
        g_y = g_y.float()
        g_row_w = (g_y * out.float()).sum(1)
        g_out = (g_y * row_w[:, None]).to(rows.dtype)
        g_hidden = ops.group_gemm_dgrad(g_out, w_down, pool_down, cu, P)
        dw_gate, dw_up, dw_down = (torch.zeros(w.shape, dtype=torch.float32, device=w.device)
                                   for w in (w_gate, w_up, w_down))
        ops.group_gemm_wgrad(_swiglu(gate, up), g_out, cu, dw_down, reduce_down, P)
        g_gate, g_up = _swiglu_backward(gate, up, g_hidden)
        g_rows = (ops.group_gemm_dgrad(g_gate, w_gate, pool_gate, cu, P).float()
                  + ops.group_gemm_dgrad(g_up, w_up, pool_up, cu, P).float()).to(rows.dtype)
        ops.group_gemm_wgrad(rows, g_gate, cu, dw_gate, reduce_gate, P)
        ops.group_gemm_wgrad(rows, g_up, cu, dw_up, reduce_up, P)
        ops.reduce_grad(etc, reduce_gate, reduce_up, reduce_down, dw_gate, dw_up, dw_down, ctrl, group_name)
        dws = tuple(dw.to(w.dtype) for dw, w in zip((dw_gate, dw_up, dw_down), (w_gate, w_up, w_down)))
        return (g_rows, g_row_w) + dws + (None,) * 11


def experts_ffn(ep: EPGroup, rows: Tensor, row_w: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
                cu_seqlens: Tensor, experts_to_copy: Tensor) -> Tensor:
    """Differentiable SwiGLU experts with copied slots: rows [NvS, H] -> route-weighted outputs [NvS, H]."""
    return _ExpertsFFN.apply(rows, row_w, w_gate, w_up, w_down, cu_seqlens, experts_to_copy, *ep.pools,
                             *ep.reduce_buffers, ep.ctrl, ep.cfg.P, ep.group_name)
