"""Fake kernel of moonep::reduce_grad."""

import torch

from .checks import check_tensor


def check_reduce_args(experts_to_copy, reduce_bufs, epn: int, ctrl) -> None:
    op = "reduce_grad"
    check_tensor(op, "experts_to_copy", experts_to_copy, (torch.int32,), (None, None))
    B = experts_to_copy.shape[1]
    dev = experts_to_copy.device
    check_tensor(op, "reduce_gate", reduce_bufs[0], (torch.float32,), (B, None, None), dev)
    H, F = reduce_bufs[0].shape[1:]
    check_tensor(op, "reduce_up", reduce_bufs[1], (torch.float32,), (B, H, F), dev)
    check_tensor(op, "reduce_down", reduce_bufs[2], (torch.float32,), (B, F, H), dev)
    check_tensor(op, "ctrl", ctrl, (torch.int32,), (None,), dev)
    if epn < 1:
        raise ValueError(f"moonep.reduce_grad: epn must be >= 1, got {epn}")


def reduce_grad(experts_to_copy, reduce_gate, reduce_up, reduce_down, epn: int, ctrl, group_name: str):
    bufs = (reduce_gate, reduce_up, reduce_down)
    check_reduce_args(experts_to_copy, bufs, epn, ctrl)
    return tuple(b.new_empty((epn,) + tuple(b.shape[1:])) for b in bufs)
