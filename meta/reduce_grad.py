"""Fake kernel of moonep::reduce_grad."""

import torch

from .checks import ROW_DTYPES, check_tensor


def check_reduce_args(experts_to_copy, reduce_bufs, homes, ctrl) -> None:
    op = "reduce_grad"
    check_tensor(op, "experts_to_copy", experts_to_copy, (torch.int32,), (None, None))
    B = experts_to_copy.shape[1]
    dev = experts_to_copy.device
    check_tensor(op, "reduce_gate", reduce_bufs[0], (torch.float32,), (B, None, None), dev)
    H, F = reduce_bufs[0].shape[1:]
    check_tensor(op, "reduce_up", reduce_bufs[1], (torch.float32,), (B, H, F), dev)
    check_tensor(op, "reduce_down", reduce_bufs[2], (torch.float32,), (B, F, H), dev)
    # the home gradients are in the weights' dtype (bf16 on CUDA); the copies' reduce buffers are fp32
    check_tensor(op, "home_gate", homes[0], ROW_DTYPES, (None, H, F), dev)
    epn, dtype = homes[0].shape[0], homes[0].dtype
    check_tensor(op, "home_up", homes[1], (dtype,), (epn, H, F), dev)
    check_tensor(op, "home_down", homes[2], (dtype,), (epn, F, H), dev)
    check_tensor(op, "ctrl", ctrl, (torch.int32,), (None,), dev)


def reduce_grad(experts_to_copy, reduce_gate, reduce_up, reduce_down, home_gate, home_up, home_down, ctrl,
                group_name: str) -> None:
    check_reduce_args(experts_to_copy, (reduce_gate, reduce_up, reduce_down), (home_gate, home_up, home_down), ctrl)
