"""Host wrappers of the backward kernels that read the output gradient's rows in place by index (R = 1:
combine's backward would write ``g_y = where(row_src >= 0, g_out[row_src], 0)`` [N, H]; these kernels
gather those rows themselves): ``group_gemm_swiglu_bwd_gather`` (g_y as the SwiGLU-backward dgrad's A
operand) and ``group_gemm_wgrad_gather_b`` (g_y as the down projection's wgrad B operand). Validation and
launch as in ``host`` (same checks, compile cache and launch helpers)."""

from __future__ import annotations

import torch

from moonep_ops.checks import ROW_DTYPES, check_pad, check_tensor
from moonep_ops.fake import group_gemm as contracts

from .host import _check_kernel_args, _launch_swiglu_bwd, _launch_wgrad, _token_rows, check_row_src


def group_gemm_swiglu_bwd_gather(
    g_out: torch.Tensor,
    row_src: torch.Tensor,
    w_down_home: torch.Tensor,
    w_down_slot: torch.Tensor,
    cu_seqlens: torch.Tensor,
    row_w: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    pad: int = 128,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``group_gemm_swiglu_bwd`` (its shared-memory epilogue) with its rows gathered from ``g_out [S, H]`` in
    the kernel: row r of the grouped output gradient is ``g_out[row_src[r]]``, or a zero row where
    ``row_src[r] < 0`` (padding rows, rows past the last group), for ``row_src`` int32 ``[N]`` (``gate``,
    ``up``, ``row_w`` have the N rows). Returns ``(g_gate, g_up, h_w, g_row_w)``, bitwise what
    ``group_gemm_swiglu_bwd(where(row_src >= 0, g_out[row_src], 0), ...)`` returns, without the [N, H]
    copy. ``g_out`` has fewer than 2**31 elements (32-bit row offsets). Precondition (device values, not
    checked: no host sync): every ``row_src[r] < S``; an index may repeat (a token routed to several
    groups). No host sync."""
    op = "group_gemm_swiglu_bwd_gather"

    def contract(_):
        # group_gemm_swiglu_bwd's contract (moonep_ops/fake/group_gemm.py) with g_out [S, H] + row_src [N] in
        # place of g_y [N, H]: N from gate
        check_tensor(op, "g_out", g_out, ROW_DTYPES, (None, None))
        check_pad(op, pad)
        check_row_src(op, row_src, "g_out", g_out, "H")
        n, hd = row_src.shape[0], g_out.shape[1]
        check_tensor(op, "w_down_home", w_down_home, (g_out.dtype,), (None, None, hd), g_out.device)
        epn, f, _ = w_down_home.shape
        check_tensor(op, "w_down_slot", w_down_slot, (g_out.dtype,), (None, f, hd), g_out.device)
        contracts.check_groups(op, cu_seqlens, epn + w_down_slot.shape[0], None, g_out.device)
        check_tensor(op, "row_w", row_w, (torch.float32,), (n,), g_out.device)
        check_tensor(op, "gate", gate, (g_out.dtype,), (n, f), g_out.device)
        check_tensor(op, "up", up, (g_out.dtype,), (n, f), g_out.device)
        return {"F": f, "H": hd}, epn

    sizes = _check_kernel_args(
        op, contract, pad,
        (("g_out", g_out), ("w_down_home", w_down_home), ("w_down_slot", w_down_slot), ("gate", gate), ("up", up)),
        "w_down_home", aligned=(("row_w", row_w),),
    )
    return _launch_swiglu_bwd("swiglu_bwd_gather", sizes, pad, (_token_rows(g_out, sizes["H"]), row_src),
                              w_down_home, w_down_slot, cu_seqlens, row_w, gate, up)


def group_gemm_wgrad_gather_b(
    x: torch.Tensor,
    dy_src: torch.Tensor,
    row_src: torch.Tensor,
    cu_seqlens: torch.Tensor,
    dw_home: torch.Tensor,
    dw_slot: torch.Tensor,
    pad: int = 128,
) -> None:
    """``group_gemm_wgrad`` with its output-gradient rows gathered from ``dy_src [S, Nd]`` in the kernel:
    row r of the grouped ``dy`` is ``dy_src[row_src[r]]``, or a zero row where ``row_src[r] < 0`` (padding
    rows, rows past the last group), for ``row_src`` int32 ``[N]`` (``x`` has the N rows). Writes
    ``dw_home`` and adds into ``dw_slot`` bitwise what ``group_gemm_wgrad(x, where(row_src >= 0,
    dy_src[row_src], 0), ...)`` does, without the [N, Nd] copy (the down projection's wgrad, x = h_w and
    dy_src = g_out). ``dy_src`` has fewer than 2**31 elements (32-bit row offsets). Precondition (device
    values, not checked: no host sync): every ``row_src[r] < S``; an index may repeat. No host sync."""
    op = "group_gemm_wgrad_gather_b"

    def contract(_):
        # group_gemm_wgrad's contract (moonep_ops/fake/group_gemm.py) with dy_src [S, Nd] + row_src [N] in
        # place of dy [N, Nd]: x and the gradients as there
        check_tensor(op, "x", x, ROW_DTYPES, (None, None))
        check_pad(op, pad)
        check_tensor(op, "dy_src", dy_src, (x.dtype,), (None, None), x.device)
        check_row_src(op, row_src, "dy_src", dy_src, "Nd")
        if row_src.shape[0] != x.shape[0]:
            raise ValueError(f"moonep.{op}: row_src must have one entry per row of x (N = {x.shape[0]}), got "
                             f"shape {tuple(row_src.shape)}")
        kd, nd = x.shape[1], dy_src.shape[1]
        check_tensor(op, "dw_home", dw_home, (x.dtype,), (None, kd, nd), x.device)
        check_tensor(op, "dw_slot", dw_slot, (torch.float32,), (None, kd, nd), x.device)
        contracts.check_groups(op, cu_seqlens, dw_home.shape[0] + dw_slot.shape[0], None, x.device)
        return {"Kd": kd, "Nd": nd}, dw_home.shape[0]

    sizes = _check_kernel_args(op, contract, pad, (("x", x), ("dy_src", dy_src), ("dw_home", dw_home)),
                               "dw_home", aligned=(("dw_slot", dw_slot),))
    _launch_wgrad("wgrad_gather_b", sizes, pad, (x, _token_rows(dy_src, sizes["Nd"]), row_src), x.shape[0],
                  cu_seqlens, dw_home, dw_slot)
