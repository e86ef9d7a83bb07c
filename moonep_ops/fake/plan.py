"""Fake kernel of moonep::plan."""

import torch

from ..checks import check_plan_args


def plan(topk_ids, E: int, B: int, P: int, R: int, ctrl, group_name: str):
    check_plan_args(topk_ids, E, B, P, R, ctrl)
    S, K = topk_ids.shape

    def i32(*shape):
        return topk_ids.new_empty(shape, dtype=torch.int32)

    epn = E // R
    # dst_rank, dst_row, primary_row, experts_to_copy, experts_remote, cu_seqlens, group_rows, counts
    return i32(S, K), i32(S, K), i32(S, K), i32(R, B), i32(epn - B), i32(2 * epn), i32(2 * epn), i32(R, E)
