"""Fake kernel of moonep::gather_row_weights."""

import torch

from .checks import check_tensor
from .dispatch import check_token_plan


def check_gather_args(row_vals, dst_rank, dst_row) -> None:
    check_tensor("gather_row_weights", "row_vals", row_vals, (torch.float32,), (None,))
    check_tensor("gather_row_weights", "dst_rank", dst_rank, (torch.int32,), (None, None), row_vals.device)
    S, K = dst_rank.shape
    check_token_plan("gather_row_weights", S, K, row_vals.device, dst_row=dst_row)


def gather_row_weights(row_vals, dst_rank, dst_row, group_name: str):
    check_gather_args(row_vals, dst_rank, dst_row)
    return row_vals.new_empty(dst_rank.shape)
