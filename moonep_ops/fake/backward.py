"""Fake kernels of the backward ops (moonep::combine_backward, dispatch_backward, experts_ffn_backward,
experts_combine_backward; of the gathered path dispatch_index_backward, experts_combine_gathered_backward).

They run the forward ops on the EP group's own buffers (moonep_ops/ops.py); the output shapes follow
from the EPConfig of the group their `ep_key` names, which the checks return."""

import torch

from ..checks import (check_combine_backward_args, check_dispatch_backward_args, check_dispatch_index_backward_args,
                      check_experts_combine_backward_args, check_experts_combine_gathered_backward_args,
                      check_experts_ffn_backward_args)


def combine_backward(g_out, dst_rank, dst_row, primary_row, cu_seqlens, group_rows, ep_key: str):
    cfg = check_combine_backward_args(g_out, dst_rank, dst_row, primary_row, cu_seqlens, group_rows, ep_key)
    return g_out.new_empty((cfg.NvS, cfg.H))


def dispatch_backward(g_rows, g_row_w, row_primary, row_next, dst_rank, dst_row, primary_row, ep_key: str):
    cfg = check_dispatch_backward_args(g_rows, g_row_w, row_primary, row_next, dst_rank, dst_row, primary_row,
                                       ep_key)
    return g_rows.new_empty((cfg.S, cfg.H)), g_row_w.new_empty((cfg.S, cfg.K))


def experts_ffn_backward(g_y, rows, row_w, w_gate, w_up, w_down, cu_seqlens, experts_to_copy, gate, up, P: int,
                         ep_key: str):
    cfg = check_experts_ffn_backward_args(g_y, rows, row_w, w_gate, w_up, w_down, cu_seqlens, experts_to_copy, gate,
                                          up, ep_key)
    return _experts_grads(cfg, row_w, w_gate, w_up, w_down)


def experts_combine_backward(g_out, dst_rank, dst_row, primary_row, group_rows, rows, tokens, row_w, w_gate, w_up,
                             w_down, cu_seqlens, experts_to_copy, gate, up, P: int, ep_key: str):
    cfg = check_experts_combine_backward_args(g_out, dst_rank, dst_row, primary_row, group_rows, rows, tokens, row_w,
                                              w_gate, w_up, w_down, cu_seqlens, experts_to_copy, gate, up, ep_key)
    return _experts_grads(cfg, row_w, w_gate, w_up, w_down)


def dispatch_index_backward(g_row_w, dst_rank, dst_row, ep_key: str):
    cfg = check_dispatch_index_backward_args(g_row_w, dst_rank, dst_row, ep_key)
    return g_row_w.new_empty((cfg.S, cfg.K))


def experts_combine_gathered_backward(g_out, tokens, row_src, row_primary, row_next, dst_rank, dst_row, primary_row,
                                      row_w, w_gate, w_up, w_down, cu_seqlens, gate, up, P: int, ep_key: str):
    cfg = check_experts_combine_gathered_backward_args(g_out, tokens, row_src, row_primary, row_next, dst_rank,
                                                       dst_row, primary_row, row_w, w_gate, w_up, w_down, cu_seqlens,
                                                       gate, up, ep_key)
    return _experts_grads(cfg, row_w, w_gate, w_up, w_down, rows=cfg.S)


def _experts_grads(cfg, row_w, w_gate, w_up, w_down, rows: int | None = None):
    """(g_rows [NvS, H], or the tokens' gradient [rows, H] of the gathered path; g_row_w, dw_gate, dw_up,
    dw_down): each the shape and dtype of what it is the gradient of."""
    return (w_gate.new_empty((cfg.NvS if rows is None else rows, cfg.H)), torch.empty_like(row_w),
            torch.empty_like(w_gate), torch.empty_like(w_up), torch.empty_like(w_down))
