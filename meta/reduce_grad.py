"""Fake kernel of moonep::reduce_grad."""

import torch

from .checks import ROW_DTYPES, check_tensor


def check_reduce_args(slot_grads, experts_to_copy, reduce_bufs, epn: int) -> None:
    op = "reduce_grad"
    check_tensor(op, "slot_grad_gate", slot_grads[0], ROW_DTYPES, (None, None, None))
    B, H, F = slot_grads[0].shape
    dev = slot_grads[0].device
    check_tensor(op, "slot_grad_up", slot_grads[1], ROW_DTYPES, (B, H, F), dev)
    check_tensor(op, "slot_grad_down", slot_grads[2], ROW_DTYPES, (B, F, H), dev)
    check_tensor(op, "experts_to_copy", experts_to_copy, (torch.int32,), (None, B), dev)
    for name, g, buf in zip(("gate", "up", "down"), slot_grads, reduce_bufs):
        check_tensor(op, f"reduce_{name}", buf, (torch.float32,), tuple(g.shape), dev)
    if epn < 1:
        raise ValueError(f"moonep.reduce_grad: epn must be >= 1, got {epn}")


def reduce_grad(slot_grad_gate, slot_grad_up, slot_grad_down, experts_to_copy,
                reduce_gate, reduce_up, reduce_down, epn: int, group_name: str):
    slot_grads = (slot_grad_gate, slot_grad_up, slot_grad_down)
    check_reduce_args(slot_grads, experts_to_copy, (reduce_gate, reduce_up, reduce_down), epn)
    return tuple(g.new_empty((epn,) + tuple(g.shape[1:]), dtype=torch.float32) for g in slot_grads)
