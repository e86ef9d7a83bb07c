"""Fake kernel of moonep::prefetch_weights."""

import torch

from .checks import ROW_DTYPES, check_tensor


def check_prefetch_args(w_gate, w_up, w_down, experts_to_copy, pool_gate, pool_up, pool_down, ctrl) -> None:
    op = "prefetch_weights"
    check_tensor(op, "w_gate", w_gate, ROW_DTYPES, (None, None, None))
    epn, H, F = w_gate.shape
    dev, dt = w_gate.device, w_gate.dtype
    check_tensor(op, "w_up", w_up, (dt,), (epn, H, F), dev)
    check_tensor(op, "w_down", w_down, (dt,), (epn, F, H), dev)
    check_tensor(op, "experts_to_copy", experts_to_copy, (torch.int32,), (None, None), dev)
    B = experts_to_copy.shape[1]
    check_tensor(op, "pool_gate", pool_gate, (dt,), (B, H, F), dev)
    check_tensor(op, "pool_up", pool_up, (dt,), (B, H, F), dev)
    check_tensor(op, "pool_down", pool_down, (dt,), (B, F, H), dev)
    check_tensor(op, "ctrl", ctrl, (torch.int32,), (None,), dev)


def prefetch_weights(w_gate, w_up, w_down, experts_to_copy, pool_gate, pool_up, pool_down, ctrl,
                     group_name: str) -> None:
    check_prefetch_args(w_gate, w_up, w_down, experts_to_copy, pool_gate, pool_up, pool_down, ctrl)
