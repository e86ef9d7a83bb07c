"""Fake kernel of moonep::plan."""

import torch

from .checks import ID_DTYPES, check_ctrl, check_pad, check_positive, check_tensor


def check_plan_args(topk_ids: torch.Tensor, E: int, B: int, P: int, R: int, ctrl: torch.Tensor) -> None:
    check_tensor("plan", "topk_ids", topk_ids, ID_DTYPES, (None, None))
    check_positive("plan", E=E, R=R, S=topk_ids.shape[0], K=topk_ids.shape[1])
    if E % R:
        raise ValueError(f"moonep.plan: E={E} must be a multiple of R={R}")
    if not 0 <= B <= E // R:
        raise ValueError(f"moonep.plan: B must be in [0, E/R={E // R}], got {B}")
    check_pad("plan", P)
    check_ctrl("plan", ctrl, R, E, topk_ids.device)


def plan(topk_ids, E: int, B: int, P: int, R: int, ctrl, group_name: str):
    check_plan_args(topk_ids, E, B, P, R, ctrl)
    S, K = topk_ids.shape

    def i32(*shape):
        return topk_ids.new_empty(shape, dtype=torch.int32)

    epn = E // R
    # dst_rank, dst_row, primary_row, experts_to_copy, experts_remote, cu_seqlens, group_rows, counts
    return i32(S, K), i32(S, K), i32(S, K), i32(R, B), i32(epn - B), i32(2 * epn), i32(2 * epn), i32(R, E)
