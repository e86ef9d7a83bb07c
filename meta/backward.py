"""Fake kernels of the backward ops (moonep::combine_backward, dispatch_backward, experts_ffn_backward),
and their argument checks, shared with the real implementations.

They run the forward ops on the EP group's own buffers (moonep_ops/ops.py); the output shapes follow
from the group's EPConfig, which the checks hold every argument to."""

import torch

from .checks import check_tensor

I32 = (torch.int32,)


def group_cfg(op: str, ep_key: str):
    """The EPConfig and row dtype of the live EPGroup named `ep_key`. The checks return the config,
    which the fakes size their outputs from."""
    from moonep_ops.group import group_by_key  # the fake of an op that names its group by key

    ep = group_by_key(op, ep_key)
    return ep.cfg, ep.dtype


def _check_token_plan(op: str, cfg, dev, **tables) -> None:
    for name, t in tables.items():
        check_tensor(op, name, t, I32, (cfg.S, cfg.K), dev)


def check_combine_backward_args(g_out, dst_rank, dst_row, primary_row, cu_seqlens, group_rows, ep_key):
    op = "combine_backward"
    cfg, dtype = group_cfg(op, ep_key)
    check_tensor(op, "g_out", g_out, (dtype,), (cfg.S, cfg.H))
    _check_token_plan(op, cfg, g_out.device, dst_rank=dst_rank, dst_row=dst_row, primary_row=primary_row)
    check_tensor(op, "cu_seqlens", cu_seqlens, I32, (cfg.G,), g_out.device)
    check_tensor(op, "group_rows", group_rows, I32, (cfg.G,), g_out.device)
    return cfg


def combine_backward(g_out, dst_rank, dst_row, primary_row, cu_seqlens, group_rows, ep_key: str):
    cfg = check_combine_backward_args(g_out, dst_rank, dst_row, primary_row, cu_seqlens, group_rows, ep_key)
    return g_out.new_empty((cfg.NvS, cfg.H))


def check_dispatch_backward_args(g_rows, g_row_w, row_primary, row_next, dst_rank, dst_row, primary_row, ep_key):
    op = "dispatch_backward"
    cfg, dtype = group_cfg(op, ep_key)
    check_tensor(op, "g_rows", g_rows, (dtype,), (cfg.NvS, cfg.H))
    dev = g_rows.device
    check_tensor(op, "g_row_w", g_row_w, (torch.float32,), (cfg.NvS,), dev)
    check_tensor(op, "row_primary", row_primary, I32, (cfg.NvS,), dev)
    check_tensor(op, "row_next", row_next, I32, (cfg.NvS,), dev)
    _check_token_plan(op, cfg, dev, dst_rank=dst_rank, dst_row=dst_row, primary_row=primary_row)
    return cfg


def dispatch_backward(g_rows, g_row_w, row_primary, row_next, dst_rank, dst_row, primary_row, ep_key: str):
    cfg = check_dispatch_backward_args(g_rows, g_row_w, row_primary, row_next, dst_rank, dst_row, primary_row,
                                       ep_key)
    return g_rows.new_empty((cfg.S, cfg.H)), g_row_w.new_empty((cfg.S, cfg.K))


def check_experts_ffn_backward_args(g_y, rows, row_w, w_gate, w_up, w_down, cu_seqlens, experts_to_copy, gate, up,
                                    ep_key) -> None:
    op = "experts_ffn_backward"
    cfg, dtype = group_cfg(op, ep_key)
    check_tensor(op, "g_y", g_y, (dtype,), (cfg.NvS, cfg.H))
    dev = g_y.device
    check_tensor(op, "rows", rows, (dtype,), (cfg.NvS, cfg.H), dev)
    check_tensor(op, "row_w", row_w, (torch.float32,), (cfg.NvS,), dev)
    check_tensor(op, "w_gate", w_gate, (dtype,), (cfg.epn, cfg.H, cfg.F), dev)
    check_tensor(op, "w_up", w_up, (dtype,), (cfg.epn, cfg.H, cfg.F), dev)
    check_tensor(op, "w_down", w_down, (dtype,), (cfg.epn, cfg.F, cfg.H), dev)
    check_tensor(op, "cu_seqlens", cu_seqlens, I32, (cfg.G,), dev)
    check_tensor(op, "experts_to_copy", experts_to_copy, I32, (cfg.R, cfg.B), dev)
    check_tensor(op, "gate", gate, (dtype,), (cfg.NvS, cfg.F), dev)
    check_tensor(op, "up", up, (dtype,), (cfg.NvS, cfg.F), dev)


def experts_ffn_backward(g_y, rows, row_w, w_gate, w_up, w_down, cu_seqlens, experts_to_copy, gate, up, P: int,
                         ep_key: str):
    check_experts_ffn_backward_args(g_y, rows, row_w, w_gate, w_up, w_down, cu_seqlens, experts_to_copy, gate, up,
                                    ep_key)
    return (torch.empty_like(rows), torch.empty_like(row_w), torch.empty_like(w_gate), torch.empty_like(w_up),
            torch.empty_like(w_down))
