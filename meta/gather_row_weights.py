"""Fake kernel of moonep::gather_row_weights."""

import torch

from .checks import check_tensor
from .dispatch import check_token_plan


def check_gather_args(row_vals, dst_rank, dst_row, row_scratch, ctrl) -> None:
    check_tensor("gather_row_weights", "row_vals", row_vals, (torch.float32,), (None,))
    check_tensor("gather_row_weights", "dst_rank", dst_rank, (torch.int32,), (None, None), row_vals.device)
    S, K = dst_rank.shape
    check_token_plan("gather_row_weights", S, K, row_vals.device, dst_row=dst_row)
    check_tensor("gather_row_weights", "row_scratch", row_scratch, (torch.float32,), row_vals.shape, row_vals.device)
    check_tensor("gather_row_weights", "ctrl", ctrl, (torch.int32,), (None,), row_vals.device)


def gather_row_weights(row_vals, dst_rank, dst_row, row_scratch, ctrl, group_name: str):
    check_gather_args(row_vals, dst_rank, dst_row, row_scratch, ctrl)
    return row_vals.new_empty(dst_rank.shape)
