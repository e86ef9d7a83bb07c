"""The one validation layer: argument rules of the moonep ops and of the CuTe kernel wrappers.

Host-side only (no device reads, no syncs), so the same checks run in the fake kernels (under
torch.compile / torch.export), in the CPU references and in the CUDA entry points, and bad input
fails the same way everywhere before anything launches. Errors name the op (`moonep.<op>:`), the
argument and the rule.

- `check_*`: the rules, and the contract of each non-GEMM op (`check_<op>_args`; the grouped GEMMs'
  contract is in `fake/group_gemm.py`). Every implementation of an op runs its contract check once.
- `need_*`: the same rules as the CuTe kernel wrappers (csrc_cute/*) apply them to their own
  arguments: named by argument alone (a wrapper is not an op) and required on a CUDA device, plus what
  only the kernels need (peer address tables, ranks, CTA counts).

Imports nothing of moonep but the leaf registry (for the backward ops' `ep_key`) and the control
block layout, so every layer can use it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from csrc_cute.status import control_words

from .registry import config_by_key

ROW_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ID_DTYPES = (torch.int32, torch.int64)
I32 = (torch.int32,)
F32 = (torch.float32,)


# ------------------------------------------------------------------------------------------ rules
def _subject(op: str | None, name: str) -> str:
    return f"moonep.{op}: {name}" if op else name


def _shape_text(shape: Sequence[int | None]) -> str:
    return "[" + ", ".join("*" if w is None else str(w) for w in shape) + "]"


def check_tensor(op: str | None, name: str, t: torch.Tensor, dtypes: Sequence[torch.dtype],
                 shape: Sequence[int | None] | None = None, device: torch.device | None = None, *,
                 ndim: int | tuple[int, ...] | None = None, cuda: bool = False,
                 contiguous: bool = True) -> torch.Tensor:
    """`t` must be a Tensor with one of `dtypes`, of rank `ndim` (an int or a tuple of allowed ranks)
    and of `shape` (None entries: any size), on a CUDA device if `cuda`, on `device` if given, and
    contiguous if `contiguous`. Returns `t`."""
    what = _subject(op, name)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        want = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{what} must have dtype {want}, got {str(t.dtype).replace('torch.', '')}")
    if ndim is not None and t.dim() not in (ndim if isinstance(ndim, tuple) else (ndim,)):
        raise ValueError(f"{what} must be {ndim}-D, got shape {list(t.shape)}")
    if shape is not None and (t.dim() != len(shape)
                              or any(w is not None and w != s for w, s in zip(shape, t.shape))):
        raise ValueError(f"{what} must have shape {_shape_text(shape)}, got {list(t.shape)}")
    if cuda and t.device.type != "cuda":
        raise ValueError(f"{what} must be on a CUDA device, got {t.device}")
    if device is not None and t.device != device:
        raise ValueError(f"{what} must be on {device} like the other inputs, got {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{what} must be contiguous")
    return t


def check_int(op: str | None, name: str, v, lo: int = 1) -> int:
    """An int (not a bool) >= lo."""
    what = _subject(op, name)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{what} must be an int, got {type(v).__name__}")
    if v < lo:
        raise ValueError(f"{what} must be >= {lo}, got {v}")
    return v


def check_positive(op: str, **values: int) -> None:
    """>= 1; sizes may be symbolic under torch.compile (SymInt), so no type check here."""
    for name, v in values.items():
        if v < 1:
            raise ValueError(f"moonep.{op}: {name} must be >= 1, got {v}")


def check_pad(op: str, P: int) -> None:
    if P < 16 or P & (P - 1):
        raise ValueError(f"moonep.{op}: P must be a power of two >= 16 (every group length is a multiple "
                         f"of P), got P={P}")


def check_rank(op: str | None, rank, R: int) -> int:
    """A rank index in [0, R)."""
    rank = check_int(op, "rank", rank, 0)
    if rank >= R:
        raise ValueError(f"{_subject(op, 'rank')} must be in [0, R={R}), got {rank}")
    return rank


def check_peers(op: str | None, name: str, t, R: int | None = None, device: torch.device | None = None) -> int:
    """An int64 [R] CUDA tensor of one buffer's address on every rank -> R."""
    check_tensor(op, name, t, (torch.int64,), None if R is None else (R,), device, ndim=1, cuda=True)
    if t.numel() < 1:
        raise ValueError(f"{_subject(op, name)} must hold at least one peer address")
    return t.numel()


def check_ctrl(op: str, ctrl: torch.Tensor, R: int, E: int, device: torch.device) -> None:
    """The EP group's control block: int32 [control_words(R, E)] on the op's device."""
    check_tensor(op, "ctrl", ctrl, I32, (control_words(R, E),), device)


def check_peer_buffer(op: str, name: str, t: torch.Tensor, dtypes: Sequence[torch.dtype], rows: int, tail,
                      device) -> None:
    """A buffer the peers read, of shape [rows, *tail], or absent: no rows ([0, *tail]), the form a 1-rank
    CUDA group allocates (moonep_ops/buffers.py; `check_absent_buffer` holds it to R = 1)."""
    check_tensor(op, name, t, dtypes, (None, *tail), device)
    if t.shape[0] not in (0, rows):
        raise ValueError(f"moonep.{op}: {name} must have shape {_shape_text((rows, *tail))} (or "
                         f"{_shape_text((0, *tail))}, absent, with R = 1), got {list(t.shape)}")


def check_absent_buffer(op: str, name: str, t: torch.Tensor, R: int) -> None:
    """An absent buffer (no rows) only with R = 1: with more ranks the peers read it."""
    if t.shape[0] == 0 and R > 1:
        raise ValueError(f"moonep.{op}: {name} has no rows (absent), which only R = 1 allows (no peer reads "
                         f"it); with R={R} pass the EPGroup's own {name}")


def check_token_plan(op: str, S: int, K: int, device, **tables: torch.Tensor) -> None:
    """Per-token plan tables (dst_rank, dst_row, primary_row): int32 [S, K]."""
    for name, t in tables.items():
        check_tensor(op, name, t, I32, (S, K), device)


# -------------------------------------------------------------------- the CuTe kernel wrappers' form
def need_tensor(name: str, t, dtypes, shape=None, ndim=None, device=None, *, placement=True) -> torch.Tensor:
    """check_tensor for a kernel wrapper's argument; with `placement`, also on a CUDA device and
    contiguous (without: dtype and shape only, for checks that must come before the placement's). A
    wrong rank reads "must be N-D"."""
    if ndim is None and shape is not None:
        ndim = len(shape)
    return check_tensor(None, name, t, dtypes, shape, device, ndim=ndim, cuda=placement, contiguous=placement)


def need_placement(name: str, t: torch.Tensor, device=None) -> None:
    """A kernel wrapper's argument on a CUDA device (`device` if given), contiguous."""
    check_tensor(None, name, t, (t.dtype,), device=device, cuda=True)


def need_int(name: str, v, lo: int = 1) -> int:
    return check_int(None, name, v, lo)


def need_rank(rank, R: int) -> int:
    return check_rank(None, rank, R)


def need_peers(name: str, t, R=None, device=None) -> int:
    return check_peers(None, name, t, R, device)


def need_status(t, device=None) -> torch.Tensor:
    """A status word: int32 [1] (the kernels OR their STATUS_* bits into it)."""
    need_tensor("status", t, (torch.int32,), ndim=1, device=device)
    if t.numel() != 1:
        raise ValueError(f"status must hold exactly 1 int32 element, got {t.numel()}")
    return t


# ------------------------------------------------------------------- contracts of the non-GEMM ops
def check_plan_args(topk_ids: torch.Tensor, E: int, B: int, P: int, R: int, ctrl: torch.Tensor) -> None:
    check_tensor("plan", "topk_ids", topk_ids, ID_DTYPES, (None, None))
    check_positive("plan", E=E, R=R, S=topk_ids.shape[0], K=topk_ids.shape[1])
    if E % R:
        raise ValueError(f"moonep.plan: E={E} must be a multiple of R={R}")
    if not 0 <= B <= E // R:
        raise ValueError(f"moonep.plan: B must be in [0, E/R={E // R}], got {B}")
    check_pad("plan", P)
    check_ctrl("plan", ctrl, R, E, topk_ids.device)


def check_dispatch_args(x, route_w, dst_rank, dst_row, primary_row, cu_seqlens, group_rows, send_rows, recv_w,
                        recv_primary, recv_next, recv_src, ctrl) -> None:
    check_dispatch_index_args(x, route_w, dst_rank, dst_row, primary_row, cu_seqlens, group_rows, recv_w,
                              recv_primary, recv_next, recv_src, ctrl, op="dispatch")
    check_peer_buffer("dispatch", "send_rows", send_rows, (x.dtype,), x.shape[0], (x.shape[1],), x.device)


def check_dispatch_index_args(x, route_w, dst_rank, dst_row, primary_row, cu_seqlens, group_rows, recv_w,
                              recv_primary, recv_next, recv_src, ctrl, op: str = "dispatch_index") -> None:
    """The arguments of a dispatch but its staging buffer: dispatch_index's contract, and dispatch's."""
    check_tensor(op, "x", x, ROW_DTYPES, (None, None))
    S = x.shape[0]
    check_tensor(op, "route_w", route_w, F32, (S, None), x.device)
    K = route_w.shape[1]
    check_token_plan(op, S, K, x.device, dst_rank=dst_rank, dst_row=dst_row, primary_row=primary_row)
    check_tensor(op, "recv_w", recv_w, F32, (None,), x.device)
    NvS = recv_w.shape[0]
    check_tensor(op, "recv_primary", recv_primary, I32, (NvS,), x.device)
    check_tensor(op, "recv_next", recv_next, I32, (NvS,), x.device)
    check_tensor(op, "recv_src", recv_src, I32, (NvS,), x.device)
    check_tensor(op, "cu_seqlens", cu_seqlens, I32, (None,), x.device)
    check_tensor(op, "group_rows", group_rows, I32, cu_seqlens.shape, x.device)
    check_tensor(op, "ctrl", ctrl, I32, (None,), x.device)


def check_combine_args(rows, row_primary, row_next, dst_rank, dst_row, primary_row, presum, ctrl) -> None:
    op = "combine"
    check_tensor(op, "rows", rows, ROW_DTYPES, (None, None))
    NvS, H = rows.shape
    check_tensor(op, "row_primary", row_primary, I32, (NvS,), rows.device)
    check_tensor(op, "row_next", row_next, I32, (NvS,), rows.device)
    check_tensor(op, "dst_rank", dst_rank, I32, (None, None), rows.device)
    S, K = dst_rank.shape
    check_token_plan(op, S, K, rows.device, dst_row=dst_row, primary_row=primary_row)
    check_peer_buffer(op, "presum", presum, (rows.dtype,), NvS, (H,), rows.device)
    check_tensor(op, "ctrl", ctrl, I32, (None,), rows.device)


def check_gather_args(row_vals, dst_rank, dst_row, row_scratch, ctrl) -> None:
    op = "gather_row_weights"
    check_tensor(op, "row_vals", row_vals, F32, (None,))
    check_tensor(op, "dst_rank", dst_rank, I32, (None, None), row_vals.device)
    S, K = dst_rank.shape
    check_token_plan(op, S, K, row_vals.device, dst_row=dst_row)
    check_tensor(op, "row_scratch", row_scratch, F32, row_vals.shape, row_vals.device)
    check_tensor(op, "ctrl", ctrl, I32, (None,), row_vals.device)


def check_prefetch_args(w_gate, w_up, w_down, experts_to_copy, pool_gate, pool_up, pool_down, ctrl) -> None:
    op = "prefetch_weights"
    check_tensor(op, "w_gate", w_gate, ROW_DTYPES, (None, None, None))
    epn, H, F = w_gate.shape
    dev, dt = w_gate.device, w_gate.dtype
    check_tensor(op, "w_up", w_up, (dt,), (epn, H, F), dev)
    check_tensor(op, "w_down", w_down, (dt,), (epn, F, H), dev)
    check_tensor(op, "experts_to_copy", experts_to_copy, I32, (None, None), dev)
    B = experts_to_copy.shape[1]
    check_tensor(op, "pool_gate", pool_gate, (dt,), (B, H, F), dev)
    check_tensor(op, "pool_up", pool_up, (dt,), (B, H, F), dev)
    check_tensor(op, "pool_down", pool_down, (dt,), (B, F, H), dev)
    check_tensor(op, "ctrl", ctrl, I32, (None,), dev)


def check_reduce_args(experts_to_copy, reduce_bufs, homes, ctrl) -> None:
    op = "reduce_grad"
    check_tensor(op, "experts_to_copy", experts_to_copy, I32, (None, None))
    B = experts_to_copy.shape[1]
    dev = experts_to_copy.device
    check_tensor(op, "reduce_gate", reduce_bufs[0], F32, (B, None, None), dev)
    H, F = reduce_bufs[0].shape[1:]
    check_tensor(op, "reduce_up", reduce_bufs[1], F32, (B, H, F), dev)
    check_tensor(op, "reduce_down", reduce_bufs[2], F32, (B, F, H), dev)
    # the home gradients are in the weights' dtype (bf16 on CUDA); the copies' reduce buffers are fp32
    check_tensor(op, "home_gate", homes[0], ROW_DTYPES, (None, H, F), dev)
    epn, dtype = homes[0].shape[0], homes[0].dtype
    check_tensor(op, "home_up", homes[1], (dtype,), (epn, H, F), dev)
    check_tensor(op, "home_down", homes[2], (dtype,), (epn, F, H), dev)
    check_tensor(op, "ctrl", ctrl, I32, (None,), dev)


# The backward ops take no buffer: their shapes follow from the EPConfig of the group their `ep_key`
# names, which every argument is held to. The checks return it for the fakes to size their outputs.
def check_combine_backward_args(g_out, dst_rank, dst_row, primary_row, cu_seqlens, group_rows, ep_key):
    op = "combine_backward"
    cfg, dtype = config_by_key(op, ep_key)
    check_tensor(op, "g_out", g_out, (dtype,), (cfg.S, cfg.H))
    check_token_plan(op, cfg.S, cfg.K, g_out.device, dst_rank=dst_rank, dst_row=dst_row, primary_row=primary_row)
    check_tensor(op, "cu_seqlens", cu_seqlens, I32, (cfg.G,), g_out.device)
    check_tensor(op, "group_rows", group_rows, I32, (cfg.G,), g_out.device)
    return cfg


def check_dispatch_backward_args(g_rows, g_row_w, row_primary, row_next, dst_rank, dst_row, primary_row, ep_key):
    op = "dispatch_backward"
    cfg, dtype = config_by_key(op, ep_key)
    check_tensor(op, "g_rows", g_rows, (dtype,), (cfg.NvS, cfg.H))
    dev = g_rows.device
    check_tensor(op, "g_row_w", g_row_w, F32, (cfg.NvS,), dev)
    check_tensor(op, "row_primary", row_primary, I32, (cfg.NvS,), dev)
    check_tensor(op, "row_next", row_next, I32, (cfg.NvS,), dev)
    check_token_plan(op, cfg.S, cfg.K, dev, dst_rank=dst_rank, dst_row=dst_row, primary_row=primary_row)
    return cfg


def check_experts_ffn_backward_args(g_y, rows, row_w, w_gate, w_up, w_down, cu_seqlens, experts_to_copy, gate, up,
                                    ep_key):
    op = "experts_ffn_backward"
    cfg, dtype = config_by_key(op, ep_key)
    check_tensor(op, "g_y", g_y, (dtype,), (cfg.NvS, cfg.H))
    check_tensor(op, "rows", rows, (dtype,), (cfg.NvS, cfg.H), g_y.device)
    _check_experts_saved(op, cfg, dtype, g_y.device, row_w, w_gate, w_up, w_down, cu_seqlens, gate, up)
    check_tensor(op, "experts_to_copy", experts_to_copy, I32, (cfg.R, cfg.B), g_y.device)
    return cfg


def check_experts_combine_backward_args(g_out, dst_rank, dst_row, primary_row, group_rows, rows, tokens, row_w,
                                        w_gate, w_up, w_down, cu_seqlens, experts_to_copy, gate, up, ep_key):
    op = "experts_combine_backward"
    cfg, dtype = config_by_key(op, ep_key)
    check_tensor(op, "g_out", g_out, (dtype,), (cfg.S, cfg.H))
    dev = g_out.device
    check_token_plan(op, cfg.S, cfg.K, dev, dst_rank=dst_rank, dst_row=dst_row, primary_row=primary_row)
    check_tensor(op, "group_rows", group_rows, I32, (cfg.G,), dev)
    if (rows is None) == (tokens is None):
        raise ValueError(f"moonep.{op}: exactly one of rows (the dispatched rows) and tokens (the tokens to "
                         f"dispatch again) must be given, got {'both' if rows is not None else 'neither'}")
    if tokens is not None:
        check_tensor(op, "tokens", tokens, (dtype,), (cfg.S, cfg.H), dev)
    else:
        check_tensor(op, "rows", rows, (dtype,), (cfg.NvS, cfg.H), dev)
    _check_experts_saved(op, cfg, dtype, dev, row_w, w_gate, w_up, w_down, cu_seqlens, gate, up)
    check_tensor(op, "experts_to_copy", experts_to_copy, I32, (cfg.R, cfg.B), dev)
    return cfg


def check_dispatch_index_backward_args(g_row_w, dst_rank, dst_row, ep_key):
    op = "dispatch_index_backward"
    cfg, _ = config_by_key(op, ep_key)
    check_tensor(op, "g_row_w", g_row_w, F32, (cfg.NvS,))
    check_token_plan(op, cfg.S, cfg.K, g_row_w.device, dst_rank=dst_rank, dst_row=dst_row)
    return cfg


def check_experts_combine_gathered_backward_args(g_out, tokens, row_src, row_primary, row_next, dst_rank, dst_row,
                                                 primary_row, row_w, w_gate, w_up, w_down, cu_seqlens, gate, up,
                                                 ep_key):
    op = "experts_combine_gathered_backward"
    cfg, dtype = config_by_key(op, ep_key)
    check_tensor(op, "g_out", g_out, (dtype,), (cfg.S, cfg.H))
    dev = g_out.device
    check_tensor(op, "tokens", tokens, (dtype,), (cfg.S, cfg.H), dev)
    for name, t in (("row_src", row_src), ("row_primary", row_primary), ("row_next", row_next)):
        check_tensor(op, name, t, I32, (cfg.NvS,), dev)
    check_token_plan(op, cfg.S, cfg.K, dev, dst_rank=dst_rank, dst_row=dst_row, primary_row=primary_row)
    _check_experts_saved(op, cfg, dtype, dev, row_w, w_gate, w_up, w_down, cu_seqlens, gate, up)
    return cfg


def _check_experts_saved(op, cfg, dtype, dev, row_w, w_gate, w_up, w_down, cu_seqlens, gate, up):
    """What the experts' forward saved for its backward (the rows aside), held to the group's EPConfig."""
    check_tensor(op, "row_w", row_w, F32, (cfg.NvS,), dev)
    check_tensor(op, "w_gate", w_gate, (dtype,), (cfg.epn, cfg.H, cfg.F), dev)
    check_tensor(op, "w_up", w_up, (dtype,), (cfg.epn, cfg.H, cfg.F), dev)
    check_tensor(op, "w_down", w_down, (dtype,), (cfg.epn, cfg.F, cfg.H), dev)
    check_tensor(op, "cu_seqlens", cu_seqlens, I32, (cfg.G,), dev)
    check_tensor(op, "gate", gate, (dtype,), (cfg.NvS, cfg.F), dev)
    check_tensor(op, "up", up, (dtype,), (cfg.NvS, cfg.F), dev)
