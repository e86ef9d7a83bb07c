"""Fake kernels of the backward ops (moonep::combine_backward, dispatch_backward, experts_ffn_backward).

They run the forward ops on the EP group's own buffers (moonep_ops/ops.py); the output shapes follow
from the inputs and the group's EPConfig."""

import torch

from .checks import ROW_DTYPES, check_tensor


def _cfg(ep_key: str):
    from moonep_ops.group import group_by_key  # the fake of an op that names its group by key

    return group_by_key("backward", ep_key).cfg


def check_combine_backward_args(g_out, dst_rank, cfg) -> None:
    check_tensor("combine_backward", "g_out", g_out, ROW_DTYPES, (cfg.S, cfg.H))
    check_tensor("combine_backward", "dst_rank", dst_rank, (torch.int32,), (cfg.S, cfg.K), g_out.device)


def combine_backward(g_out, dst_rank, dst_row, primary_row, cu_seqlens, group_rows, ep_key: str):
    cfg = _cfg(ep_key)
    check_combine_backward_args(g_out, dst_rank, cfg)
    return g_out.new_empty((cfg.NvS, cfg.H))


def check_dispatch_backward_args(g_rows, g_row_w, cfg) -> None:
    check_tensor("dispatch_backward", "g_rows", g_rows, ROW_DTYPES, (cfg.NvS, cfg.H))
    check_tensor("dispatch_backward", "g_row_w", g_row_w, (torch.float32,), (cfg.NvS,), g_rows.device)


def dispatch_backward(g_rows, g_row_w, row_primary, row_next, dst_rank, dst_row, primary_row, ep_key: str):
    cfg = _cfg(ep_key)
    check_dispatch_backward_args(g_rows, g_row_w, cfg)
    return g_rows.new_empty((cfg.S, cfg.H)), g_row_w.new_empty((cfg.S, cfg.K))


def check_experts_ffn_backward_args(g_y, rows, w_gate, cfg) -> None:
    check_tensor("experts_ffn_backward", "rows", rows, ROW_DTYPES, (cfg.NvS, cfg.H))
    check_tensor("experts_ffn_backward", "g_y", g_y, ROW_DTYPES, (cfg.NvS, cfg.H), rows.device)
    check_tensor("experts_ffn_backward", "w_gate", w_gate, ROW_DTYPES, (cfg.epn, cfg.H, cfg.F), rows.device)


def experts_ffn_backward(g_y, rows, row_w, w_gate, w_up, w_down, cu_seqlens, experts_to_copy, gate, up, P: int,
                         ep_key: str):
    check_experts_ffn_backward_args(g_y, rows, w_gate, _cfg(ep_key))
    return (torch.empty_like(rows), torch.empty_like(row_w), torch.empty_like(w_gate), torch.empty_like(w_up),
            torch.empty_like(w_down))
