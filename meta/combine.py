"""Fake kernel of moonep::combine."""

import torch

from .checks import ROW_DTYPES, check_tensor
from .dispatch import check_token_plan


def check_combine_args(rows, row_primary, row_next, dst_rank, dst_row, primary_row, presum, ctrl) -> None:
    check_tensor("combine", "rows", rows, ROW_DTYPES, (None, None))
    NvS, H = rows.shape
    check_tensor("combine", "row_primary", row_primary, (torch.int32,), (NvS,), rows.device)
    check_tensor("combine", "row_next", row_next, (torch.int32,), (NvS,), rows.device)
    check_tensor("combine", "dst_rank", dst_rank, (torch.int32,), (None, None), rows.device)
    S, K = dst_rank.shape
    check_token_plan("combine", S, K, rows.device, dst_row=dst_row, primary_row=primary_row)
    check_tensor("combine", "presum", presum, (rows.dtype,), (NvS, H), rows.device)
    check_tensor("combine", "ctrl", ctrl, (torch.int32,), (None,), rows.device)


def combine(rows, row_primary, row_next, dst_rank, dst_row, primary_row, presum, ctrl, group_name: str):
    check_combine_args(rows, row_primary, row_next, dst_rank, dst_row, primary_row, presum, ctrl)
    return rows.new_empty((dst_rank.shape[0], rows.shape[1]))
