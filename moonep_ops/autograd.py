"""Autograd of the moonep ops.

`group_gemm` is functional, so it gets `register_autograd`. Dispatch, combine and the weight path write
persistent buffers (which `register_autograd` refuses), so each has a `torch.autograd.Function` around
its op; Dynamo traces those under torch.compile. Backward never re-plans: it reuses the forward's plan.
  dispatch  backward = dispatch_backward: combine of the row gradients + gather of the route-weight
            gradients
  combine   backward = combine_backward: dispatch of the token gradients
  experts   (prefetch + fused SwiGLU GEMMs, one Function) backward = experts_ffn_backward: prefetch
            again, the down dgrad with the SwiGLU backward in its epilogue, the other dgrad/wgrad GEMMs,
            and reduce_grad of the copies' weight gradients into the home experts
  experts + combine (one Function, what a MoE forward runs) backward = experts_combine_backward: the
            two backwards above in one op, which frees the row gradients between them early
  the gathered path (EPGroup(gather_rows), R = 1; moonep_ops/ops_gathered.py): dispatch_index (the row
            tables only) backward = dispatch_index_backward (the route-weight gradients); the gathered
            experts + combine backward = experts_combine_gathered_backward, which also makes the tokens'
            gradient (no rows, hence no dispatch backward to combine them)
The steps of a MoE forward (`plan`, `dispatch`, `experts_combine`; or `experts_ffn` then `combine`)
take and return the named handles of handles.py; the Functions and ops underneath keep flat arguments.
"""

from __future__ import annotations

import inspect

import torch

from . import ops, ops_gathered
from .group import EPGroup
from .handles import Dispatch, Plan

Tensor = torch.Tensor


def _forward_args(function: type[torch.autograd.Function]) -> tuple[str, ...]:
    """The argument names of `function.forward` after ctx: its backward returns one entry per name."""
    return tuple(inspect.signature(function.forward).parameters)[1:]


def _backward_result(args: tuple[str, ...], **grads: Tensor) -> tuple[Tensor | None, ...]:
    """What a backward returns: the gradients named by forward argument, None for every other argument
    (the plan tables, the persistent buffers, the group's names and the static ints have none)."""
    for name in grads:
        if name not in args:
            raise TypeError(f"backward: {name!r} is not an argument of the forward ({', '.join(args)})")
    return tuple(grads.get(name) for name in args)


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
        dw_home = torch.empty_like(w_home)  # written by wgrad in the weights' dtype (zeros for empty groups)
        dw_slot = w_slot.new_zeros(w_slot.shape, dtype=torch.float32)  # slot groups accumulate in fp32
        ops.group_gemm_wgrad(x, dy, cu_seqlens, dw_home, dw_slot, ctx.P)
        dw_slot = dw_slot.to(w_slot.dtype)
    return dx, dw_home, dw_slot, None, None


ops.group_gemm.register_autograd(_gemm_backward, setup_context=_gemm_setup)


# ------------------------------------------------------------------------------ dispatch and combine
# Forward: the persistent buffers travel as explicit tensor arguments (not through the EPGroup object),
# the form Dynamo traces into the graph as the buffers themselves, mutated in place with no copy.
# Backward: one functional op per Function that finds the buffers through the group's key (a mutated
# buffer in a backward graph would be cloned and copied back; moonep_ops/ops.py, "backward ops").
class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, route_w, dst_rank, dst_row, primary_row, cu_seqlens, group_rows,
                send_rows, recv_w, recv_primary, recv_next, recv_src, ctrl, group_name, ep_key):
        rows, row_w, row_primary, row_next = ops.dispatch(
            x, route_w, dst_rank, dst_row, primary_row, cu_seqlens, group_rows,
            send_rows, recv_w, recv_primary, recv_next, recv_src, ctrl, group_name)
        ctx.save_for_backward(dst_rank, dst_row, primary_row, row_primary, row_next)
        ctx.ep_key, ctx.rows_shape, ctx.rows_dtype = ep_key, rows.shape, rows.dtype
        ctx.mark_non_differentiable(row_primary, row_next)
        return rows, row_w, row_primary, row_next

    @staticmethod
    def backward(ctx, g_rows, g_row_w, _, __):
        dst_rank, dst_row, primary_row, row_primary, row_next = ctx.saved_tensors
        # collective: every rank runs it, with zeros for an output it did not use
        if g_rows is None:
            g_rows = torch.zeros(ctx.rows_shape, dtype=ctx.rows_dtype, device=row_primary.device)
        if g_row_w is None:
            g_row_w = torch.zeros(row_primary.shape, dtype=torch.float32, device=row_primary.device)
        gx, g_route_w = ops.dispatch_backward(g_rows.contiguous(), g_row_w.contiguous(), row_primary, row_next,
                                              dst_rank, dst_row, primary_row, ctx.ep_key)
        return _backward_result(_DISPATCH_ARGS, x=gx, route_w=g_route_w)


_DISPATCH_ARGS = _forward_args(_Dispatch)


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, row_primary, row_next, dst_rank, dst_row, primary_row, cu_seqlens, group_rows,
                presum, ctrl, group_name, ep_key):
        out = ops.combine(rows, row_primary, row_next, dst_rank, dst_row, primary_row, presum, ctrl, group_name)
        ctx.save_for_backward(dst_rank, dst_row, primary_row, cu_seqlens, group_rows)
        ctx.ep_key = ep_key
        return out

    @staticmethod
    def backward(ctx, g_out):
        g_rows = ops.combine_backward(g_out.contiguous(), *ctx.saved_tensors, ctx.ep_key)
        return _backward_result(_COMBINE_ARGS, rows=g_rows)


_COMBINE_ARGS = _forward_args(_Combine)


class _DispatchIndex(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, route_w, dst_rank, dst_row, primary_row, cu_seqlens, group_rows, recv_w, recv_primary,
                recv_next, recv_src, ctrl, group_name, ep_key):
        row_w, row_primary, row_next, row_src = ops_gathered.dispatch_index(
            x, route_w, dst_rank, dst_row, primary_row, cu_seqlens, group_rows, recv_w, recv_primary, recv_next,
            recv_src, ctrl, group_name)
        ctx.save_for_backward(dst_rank, dst_row)
        ctx.ep_key = ep_key
        ctx.mark_non_differentiable(row_primary, row_next, row_src)
        return row_w, row_primary, row_next, row_src

    @staticmethod
    def backward(ctx, g_row_w, _, __, ___):
        # x's gradient comes from the gathered experts' backward, which read the tokens. One rank: no peer
        # waits for this backward, so it runs only when route_w needs the gradient
        if g_row_w is None or not ctx.needs_input_grad[1]:
            return _backward_result(_DISPATCH_INDEX_ARGS)
        dst_rank, dst_row = ctx.saved_tensors
        g_route_w = ops_gathered.dispatch_index_backward(g_row_w.contiguous(), dst_rank, dst_row, ctx.ep_key)
        return _backward_result(_DISPATCH_INDEX_ARGS, route_w=g_route_w)


_DISPATCH_INDEX_ARGS = _forward_args(_DispatchIndex)


def plan(ep: EPGroup, topk_ids: Tensor) -> Plan:
    """The plan of the router's top-k ids [S, K] (moonep::plan; integer tables, no gradient)."""
    c = ep.cfg
    return Plan(*ops.plan(topk_ids, c.E, c.B, c.P, c.R, ep.ctrl, ep.group_name))


def dispatch(ep: EPGroup, x: Tensor, route_w: Tensor, plan: Plan) -> Dispatch:
    """Differentiable dispatch of the token rows x [S, H] with route weights [S, K] along `plan`."""
    return Dispatch(*_Dispatch.apply(x, route_w, plan.dst_rank, plan.dst_row, plan.primary_row, plan.cu_seqlens,
                                     plan.group_rows, *ep.dispatch_buffers, ep.ctrl, ep.group_name, ep.key), tokens=x)


def dispatch_index(ep: EPGroup, x: Tensor, route_w: Tensor, plan: Plan) -> Dispatch:
    """`dispatch` without its rows, for a 1-rank group (R = 1): the handle's `rows` is None and row r is
    `x[row_src[r]]` (zero where -1), which the gathered experts read in place (`experts_combine`).
    Differentiable in route_w; x's gradient comes from the experts' backward."""
    ops_gathered.check_one_rank("dispatch_index", ep.cfg.R)
    row_w, row_primary, row_next, row_src = _DispatchIndex.apply(
        x, route_w, plan.dst_rank, plan.dst_row, plan.primary_row, plan.cu_seqlens, plan.group_rows,
        *ep.dispatch_buffers[1:], ep.ctrl, ep.group_name, ep.key)
    return Dispatch(None, row_w, row_primary, row_next, tokens=x, row_src=row_src)


def combine(ep: EPGroup, rows: Tensor, plan: Plan, dispatched: Dispatch) -> Tensor:
    """Differentiable combine: expert output rows [NvS, H] (in `dispatched`'s row order) -> token rows [S, H]."""
    return _Combine.apply(rows, dispatched.row_primary, dispatched.row_next, plan.dst_rank, plan.dst_row,
                          plan.primary_row, plan.cu_seqlens, plan.group_rows, ep.presum, ep.ctrl, ep.group_name,
                          ep.key)


# ---------------------------------------------------------------------------------------- experts
def _experts_rows(rows, row_w, w_gate, w_up, w_down, cu_seqlens, experts_to_copy, experts_remote, pool_gate,
                  pool_up, pool_down, ctrl, P, group_name, save_preact, copies):
    """The experts' forward: prefetch -> fused gate/up GEMM with the SwiGLU epilogue -> down GEMM with the
    route-weight scaling epilogue: (outputs [NvS, H], gate, up; the pre-activations when `save_preact`)."""
    if copies:
        ops.prefetch_weights(w_gate, w_up, w_down, experts_to_copy, pool_gate, pool_up, pool_down, ctrl, group_name)
    cu, remote = ops.gemm_groups(cu_seqlens, experts_remote, copies, w_gate.shape[0])
    hidden, gate, up = ops.group_gemm_swiglu(rows, w_gate, pool_gate, w_up, pool_up, cu, P, save_preact, remote,
                                             group_name)
    return ops.group_gemm_row_scale(hidden, w_down, pool_down, cu, row_w, P, remote, group_name), gate, up


class _ExpertsFFN(torch.autograd.Function):
    """One layer's SwiGLU experts on this rank's rows (`_experts_rows`). The slot pools are shared by every
    layer, so forward reads them in place; backward (`moonep::experts_ffn_backward`) prefetches this
    layer's copies again. `copies` False (the group has no copy buffers: R = 1 on CUDA): nothing to
    prefetch, the GEMMs get the home groups alone (`ops.gemm_groups`)."""

    @staticmethod
    def forward(ctx, rows, row_w, w_gate, w_up, w_down, cu_seqlens, experts_to_copy, experts_remote,
                pool_gate, pool_up, pool_down, ctrl, P, group_name, ep_key, save_preact, copies):
        y, gate, up = _experts_rows(rows, row_w, w_gate, w_up, w_down, cu_seqlens, experts_to_copy, experts_remote,
                                    pool_gate, pool_up, pool_down, ctrl, P, group_name, save_preact, copies)
        ctx.save_for_backward(rows, row_w, w_gate, w_up, w_down, cu_seqlens, experts_to_copy, gate, up)
        ctx.P, ctx.ep_key = P, ep_key
        return y

    @staticmethod
    def backward(ctx, g_y):
        rows, row_w, w_gate, w_up, w_down, cu, etc, gate, up = ctx.saved_tensors
        # collective: every rank runs the whole backward whatever it needs
        grads = ops.experts_ffn_backward(g_y.contiguous(), rows, row_w, w_gate, w_up, w_down, cu, etc, gate, up,
                                         ctx.P, ctx.ep_key)
        g_rows, g_row_w, dw_gate, dw_up, dw_down = grads
        return _backward_result(_EXPERTS_FFN_ARGS, rows=g_rows, row_w=g_row_w, w_gate=dw_gate, w_up=dw_up,
                                w_down=dw_down)


_EXPERTS_FFN_ARGS = _forward_args(_ExpertsFFN)


def _check_train(ep: EPGroup, *inputs: Tensor) -> bool:
    """Whether the experts keep their pre-activations (a backward is to come: grad mode on and an input
    requiring grad; inference keeps none), refused with B < epn, which has no gradient path."""
    save_preact = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
    if save_preact and ep.cfg.B < ep.cfg.epn:
        raise RuntimeError(
            f"MoE experts: EPConfig.B={ep.cfg.B} < epn={ep.cfg.epn} is inference only (remote weight reads "
            f"have no gradient path); run under torch.no_grad() / inference_mode, or train with B = epn")
    return save_preact


def experts_ffn(ep: EPGroup, rows: Tensor, row_w: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
                plan: Plan) -> Tensor:
    """Differentiable SwiGLU experts with copied slots: rows [NvS, H] with route weights row_w [NvS],
    grouped along `plan` -> route-weighted outputs [NvS, H]. With B < epn (inference) the copies without
    a slot (`plan.experts_remote`) are read from their home rank."""
    save_preact = _check_train(ep, rows, row_w, w_gate, w_up, w_down)
    return _ExpertsFFN.apply(rows, row_w, w_gate, w_up, w_down, plan.cu_seqlens, plan.experts_to_copy,
                             plan.experts_remote, *ep.pools, ep.ctrl, ep.cfg.P, ep.group_name, ep.key, save_preact,
                             ep.layout.copies)


class _ExpertsCombine(torch.autograd.Function):
    """The experts (`_experts_rows`) and the combine of their outputs, one Function: its backward
    (`moonep::experts_combine_backward`) takes the token gradients [S, H] and makes the row gradients
    [NvS, H] inside one op, which frees them once the down-projection GEMMs have read them, so the input
    gradient g_rows reuses their memory (as two Functions, combine's backward hands them to the experts'
    backward op, which holds them to its end: one more [NvS, H] at the step's peak). `recompute_rows`
    (EPGroup): it keeps the dispatched `tokens` [S, H] instead of `rows`, and its backward dispatches
    them again."""

    @staticmethod
    def forward(ctx, rows, row_w, w_gate, w_up, w_down, tokens, row_primary, row_next, dst_rank, dst_row,
                primary_row, cu_seqlens, group_rows, experts_to_copy, experts_remote, pool_gate, pool_up, pool_down,
                presum, ctrl, P, group_name, ep_key, save_preact, copies, recompute_rows):
        y, gate, up = _experts_rows(rows, row_w, w_gate, w_up, w_down, cu_seqlens, experts_to_copy, experts_remote,
                                    pool_gate, pool_up, pool_down, ctrl, P, group_name, save_preact, copies)
        out = ops.combine(y, row_primary, row_next, dst_rank, dst_row, primary_row, presum, ctrl, group_name)
        kept = (None, tokens) if recompute_rows else (rows, None)
        ctx.save_for_backward(*kept, row_w, w_gate, w_up, w_down, dst_rank, dst_row, primary_row, cu_seqlens,
                              group_rows, experts_to_copy, gate, up)
        ctx.P, ctx.ep_key = P, ep_key
        return out

    @staticmethod
    def backward(ctx, g_out):
        rows, tokens, row_w, w_gate, w_up, w_down, dst_rank, dst_row, primary_row, cu, group_rows, etc, gate, up = \
            ctx.saved_tensors
        # collective: every rank runs the whole backward whatever it needs
        grads = ops.experts_combine_backward(g_out.contiguous(), dst_rank, dst_row, primary_row, group_rows, rows,
                                             tokens, row_w, w_gate, w_up, w_down, cu, etc, gate, up, ctx.P,
                                             ctx.ep_key)
        g_rows, g_row_w, dw_gate, dw_up, dw_down = grads
        return _backward_result(_EXPERTS_COMBINE_ARGS, rows=g_rows, row_w=g_row_w, w_gate=dw_gate, w_up=dw_up,
                                w_down=dw_down)


_EXPERTS_COMBINE_ARGS = _forward_args(_ExpertsCombine)


class _ExpertsCombineGathered(torch.autograd.Function):
    """`_ExpertsCombine` of the gathered form (`dispatch_index`, R = 1): the fused gate/up GEMM reads the
    tokens by row_src, then the down GEMM with the route-weight scaling and the combine; the home groups
    alone (a 1-rank plan has no copies: `ops_gathered.no_slots`). It keeps the tokens (as recompute_rows
    does) and its backward (`moonep::experts_combine_gathered_backward`) reads them and g_out by row_src
    and returns the tokens' gradient itself."""

    @staticmethod
    def forward(ctx, tokens, row_w, w_gate, w_up, w_down, row_src, row_primary, row_next, dst_rank, dst_row,
                primary_row, cu_seqlens, presum, ctrl, P, group_name, ep_key, save_preact):
        cu = cu_seqlens[:w_gate.shape[0]]
        no_slots = ops_gathered.no_slots
        hidden, gate, up = ops_gathered.group_gemm_swiglu_gather(tokens, row_src, w_gate, no_slots(w_gate), w_up,
                                                                 no_slots(w_up), cu, P, save_preact)
        y = ops.group_gemm_row_scale(hidden, w_down, no_slots(w_down), cu, row_w, P)
        out = ops.combine(y, row_primary, row_next, dst_rank, dst_row, primary_row, presum, ctrl, group_name)
        ctx.save_for_backward(tokens, row_src, row_primary, row_next, dst_rank, dst_row, primary_row, row_w, w_gate,
                              w_up, w_down, cu_seqlens, gate, up)
        ctx.P, ctx.ep_key = P, ep_key
        return out

    @staticmethod
    def backward(ctx, g_out):
        grads = ops_gathered.experts_combine_gathered_backward(g_out.contiguous(), *ctx.saved_tensors, ctx.P,
                                                               ctx.ep_key)
        g_tokens, g_row_w, dw_gate, dw_up, dw_down = grads
        return _backward_result(_EXPERTS_COMBINE_GATHERED_ARGS, tokens=g_tokens, row_w=g_row_w, w_gate=dw_gate,
                                w_up=dw_up, w_down=dw_down)


_EXPERTS_COMBINE_GATHERED_ARGS = _forward_args(_ExpertsCombineGathered)


def experts_combine(ep: EPGroup, w_gate: Tensor, w_up: Tensor, w_down: Tensor, plan: Plan, dispatched: Dispatch
                    ) -> Tensor:
    """`combine(ep, experts_ffn(ep, dispatched.rows, ...), plan, dispatched)` as one differentiable step (the
    same kernels on the same inputs, the same outputs and gradients; one [NvS, H] less at backward's peak:
    `_ExpertsCombine`): the dispatched rows -> token rows [S, H]. The gathered form of `dispatched` (from
    `dispatch_index`: no rows) runs the gathered GEMMs on its tokens (`_ExpertsCombineGathered`)."""
    if dispatched.rows is None:
        if dispatched.tokens is None or dispatched.row_src is None:
            raise ValueError("experts_combine: a Dispatch without rows must be the gathered form, with its tokens "
                             "and row_src (autograd.dispatch_index sets both)")
        save_preact = _check_train(ep, dispatched.tokens, dispatched.row_w, w_gate, w_up, w_down)
        return _ExpertsCombineGathered.apply(dispatched.tokens, dispatched.row_w, w_gate, w_up, w_down,
                                             dispatched.row_src, dispatched.row_primary, dispatched.row_next,
                                             plan.dst_rank, plan.dst_row, plan.primary_row, plan.cu_seqlens, ep.presum,
                                             ep.ctrl, ep.cfg.P, ep.group_name, ep.key, save_preact)
    save_preact = _check_train(ep, dispatched.rows, dispatched.row_w, w_gate, w_up, w_down)
    recompute = ep.recompute_rows and save_preact
    if recompute and dispatched.tokens is None:
        raise ValueError("experts_combine: EPGroup(recompute_rows=True) needs the dispatched tokens "
                         "(dispatched.tokens, which autograd.dispatch sets)")
    return _ExpertsCombine.apply(dispatched.rows, dispatched.row_w, w_gate, w_up, w_down, dispatched.tokens,
                                 dispatched.row_primary, dispatched.row_next, plan.dst_rank, plan.dst_row,
                                 plan.primary_row, plan.cu_seqlens, plan.group_rows, plan.experts_to_copy,
                                 plan.experts_remote, *ep.pools, ep.presum, ep.ctrl, ep.cfg.P, ep.group_name, ep.key,
                                 save_preact, ep.layout.copies, recompute)
