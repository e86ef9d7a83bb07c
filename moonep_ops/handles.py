"""The named handles one MoE forward passes from step to step: route -> plan -> dispatch -> experts ->
combine (moonep_ops/autograd.py, MoELayer.forward). Named tuples, so a step reads `plan.cu_seqlens`
instead of the sixth of eight positions, while the ops keep their flat schemas and torch.compile traces
the handles away (the compiled graph is the same as with plain tuples).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Plan(NamedTuple):
    """The outputs of moonep::plan, in its order (all int32)."""

    dst_rank: torch.Tensor         # [S, K] the rank each (token, k) row goes to
    dst_row: torch.Tensor          # [S, K] its row on that rank
    primary_row: torch.Tensor      # [S, K] the row there that carries the token over the link
    experts_to_copy: torch.Tensor  # [R, B] every rank's slot copies (global expert ids, -1 = empty)
    experts_remote: torch.Tensor   # [epn - B] this rank's copies read from their home rank (inference)
    cu_seqlens: torch.Tensor       # [2*epn] this rank's padded group ends
    group_rows: torch.Tensor       # [2*epn] real rows per group
    counts: torch.Tensor           # [R, E] every rank's token counts per expert


class Dispatch(NamedTuple):
    """What dispatch hands the experts and combine: this rank's rows and, per row, its links. The gathered
    form (`autograd.dispatch_index`, R = 1) has no rows: row r is `tokens[row_src[r]]` (zero where -1)."""

    rows: torch.Tensor | None  # [NvS, H] the expert-grouped rows (padding zero); None in the gathered form
    row_w: torch.Tensor        # [NvS] fp32 route weight of each row
    row_primary: torch.Tensor  # [NvS] int32 the row that carried its token over the link (-1: padding)
    row_next: torch.Tensor     # [NvS] int32 the token's next row on this rank in k order (-1: none)
    tokens: torch.Tensor | None = None  # [S, H] what was dispatched (re-dispatched by EPGroup(recompute_rows))
    row_src: torch.Tensor | None = None  # [NvS] int32 the gathered form's token of each row (-1: padding)
