"""Fake kernel of moonep::reduce_grad."""

import torch

from .checks import check_tensor


def check_reduce_args(slot_grads, experts_to_copy, reduce_bufs, epn: int) -> None:
    op = "reduce_grad"
    check_tensor(op, "experts_to_copy", experts_to_copy, (torch.int32,), (None, None))
    B = experts_to_copy.shape[1]
    dev = experts_to_copy.device
    for name, g, buf in zip(("gate", "up", "down"), slot_grads, reduce_bufs):
        check_tensor(op, f"slot_grad_{name}", g, (torch.float32, torch.bfloat16, torch.float16), (B, None, None), dev)
        check_tensor(op, f"reduce_{name}", buf, (torch.float32,), tuple(g.shape), dev)
    if epn < 1:
        raise ValueError(f"moonep.reduce_grad: epn must be >= 1, got {epn}")


def reduce_grad(slot_grad_gate, slot_grad_up, slot_grad_down, experts_to_copy,
                reduce_gate, reduce_up, reduce_down, epn: int, group_name: str):
    slot_grads = (slot_grad_gate, slot_grad_up, slot_grad_down)
    check_reduce_args(slot_grads, experts_to_copy, (reduce_gate, reduce_up, reduce_down), epn)
    return tuple(g.new_empty((epn,) + tuple(g.shape[1:]), dtype=torch.float32) for g in slot_grads)
