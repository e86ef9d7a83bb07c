"""Host wrappers of the kernels that read a grouped operand's rows in place by index, ``row_src`` int32
[N] (-1: a zero row): ``group_gemm_swiglu_gather`` and ``group_gemm_wgrad_gather`` read the token rows x
[S, H] (R = 1: dispatch's [N, H] copy is not made); ``group_gemm_swiglu_bwd_gather`` (g_y as the
SwiGLU-backward dgrad's A operand) and ``group_gemm_wgrad_gather_b`` (g_y as the down projection's wgrad
B operand) read the output gradient g_out [S, H] (combine's backward would write ``g_y = where(row_src >=
0, g_out[row_src], 0)``). Validation and launch as in ``host``: the op's contract
(moonep_ops/fake/group_gemm.py, the check its fake and CPU reference run), then the kernels' own checks
(the 32-bit row offsets among them), compile cache and launch helpers."""

from __future__ import annotations

import torch

from moonep_ops.checks import check_tensor
from moonep_ops.fake import group_gemm as contracts

from .host import (
    _check_kernel_args,
    _launch_swiglu_bwd,
    _launch_wgrad,
    _launcher,
    _out_tensor,
    _slot_map,
    _weights_contract,
)


def check_row_src(op: str, row_src, src_name: str, src: torch.Tensor, cols: str) -> None:
    """A gathered operand's index: ``row_src`` int32 [N] on ``src``'s device, and the (checked) source rows
    ``src`` [S, cols] with fewer than 2**31 elements (the kernels' row offsets ``row_src[r] * cols`` are
    32-bit)."""
    check_tensor(op, "row_src", row_src, (torch.int32,), (None,), src.device)
    if src.numel() >= 2**31:
        raise ValueError(f"moonep.{op}: {src_name} must have fewer than 2**31 elements for the CuTe kernel (its row "
                         f"offsets row_src[r] * {cols} are 32-bit), got {src.numel()}")


def _token_rows(src: torch.Tensor, cols: int) -> torch.Tensor:
    """A gathered operand's source rows ``src``, or one zero row in their place when there are no tokens
    (S = 0, every row_src < 0): the kernels' zero-size copies still take a valid address."""
    return src.new_zeros(1, cols) if src.shape[0] == 0 else src


def _with_row_src(contract, op: str, row_src, src_name: str, src: torch.Tensor, cols: str):
    """A row kernel's contract (``_weights_contract``) followed by the check of its gathered operand's index
    (``check_row_src``): what ``_check_kernel_args`` calls for a gathered row kernel."""

    def checked(experts_remote):
        sizes, epn = contract(experts_remote)
        check_row_src(op, row_src, src_name, src, cols)
        return sizes, epn

    return checked


def group_gemm_swiglu_gather(
    x: torch.Tensor,
    row_src: torch.Tensor,
    w_gate_home: torch.Tensor,
    w_gate_slot: torch.Tensor,
    w_up_home: torch.Tensor,
    w_up_slot: torch.Tensor,
    cu_seqlens: torch.Tensor,
    pad: int = 128,
    store_preact: bool = True,
    out: torch.Tensor | None = None,
    gate_out: torch.Tensor | None = None,
    up_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``group_gemm_swiglu`` with its rows gathered from ``x [S, H]`` in the kernel: row r of the grouped
    operand is ``x[row_src[r]]``, or a zero row where ``row_src[r] < 0`` (padding rows, rows past the last
    group), for ``row_src`` int32 ``[N]``. Returns ``(h, gate, up)`` of N rows, bitwise what
    ``group_gemm_swiglu(where(row_src >= 0, x[row_src], 0), ...)`` returns, without the [N, H] copy.
    ``cu_seqlens`` groups the N rows as there; ``x`` has fewer than 2**31 elements (32-bit row offsets).
    Precondition (device values, not checked: no host sync): every ``row_src[r] < S``; an index may repeat
    (a token routed to several groups). No host sync."""
    op = "group_gemm_swiglu_gather"
    weights = (w_gate_home, w_gate_slot, w_up_home, w_up_slot)
    contract = _with_row_src(_weights_contract(contracts.check_swiglu_gather_args,
                                               (x, row_src, *weights, cu_seqlens, pad), w_gate_home, ("H", "F")),
                             op, row_src, "x", x, "H")
    sizes = _check_kernel_args(
        op, contract, pad,
        (("x", x), ("w_gate_home", w_gate_home), ("w_gate_slot", w_gate_slot), ("w_up_home", w_up_home),
         ("w_up_slot", w_up_slot)), "w_gate_home",
    )
    hd, f, n = sizes["H"], sizes["F"], row_src.shape[0]
    fn = _launcher("swiglu_gather" if store_preact else "swiglu_gather_h_only", hd, f, pad, x.device)
    h = _out_tensor(op, "out", out, n, f, x.device)
    gate = _out_tensor(op, "gate_out", gate_out, n, f, x.device) if store_preact else None
    up = _out_tensor(op, "up_out", up_out, n, f, x.device) if store_preact else None
    if n:
        fn(_token_rows(x, hd), row_src, w_gate_home, _slot_map(w_gate_slot, w_gate_home), w_up_home,
           _slot_map(w_up_slot, w_up_home), cu_seqlens, h, gate if store_preact else h, up if store_preact else h)
    return h, gate, up


def group_gemm_wgrad_gather(
    x: torch.Tensor,
    row_src: torch.Tensor,
    dy: torch.Tensor,
    cu_seqlens: torch.Tensor,
    dw_home: torch.Tensor,
    dw_slot: torch.Tensor,
    pad: int = 128,
) -> None:
    """``group_gemm_wgrad`` with its rows gathered from ``x [S, Kd]`` in the kernel: row r of the grouped
    operand is ``x[row_src[r]]``, or a zero row where ``row_src[r] < 0`` (padding rows, rows past the last
    group), for ``row_src`` int32 ``[N]`` (``dy`` has the N rows). Writes ``dw_home`` and adds into
    ``dw_slot`` bitwise what ``group_gemm_wgrad(where(row_src >= 0, x[row_src], 0), dy, ...)`` does, without
    the [N, Kd] copy, for finite ``dy``: the 16-row blocks of a group after its last row with a token (among
    its last 128 rows) are not multiplied, so ``dy``'s rows there are not read (a NaN there, which the
    reference would spread, stays out). ``x`` has fewer than 2**31 elements (32-bit row offsets).
    Precondition (device values, not checked: no host sync): every ``row_src[r] < S``; an index may repeat (a
    token routed to several groups). No host sync."""
    op = "group_gemm_wgrad_gather"

    def contract(_):
        contracts.check_wgrad_gather_args(x, row_src, dy, cu_seqlens, dw_home, dw_slot, pad)
        check_row_src(op, row_src, "x", x, "Kd")
        return {"Kd": x.shape[1], "Nd": dy.shape[1]}, dw_home.shape[0]

    sizes = _check_kernel_args(op, contract, pad, (("x", x), ("dy", dy), ("dw_home", dw_home)), "dw_home",
                               aligned=(("dw_slot", dw_slot),))
    _launch_wgrad("wgrad_gather", sizes, pad, (_token_rows(x, sizes["Kd"]), row_src, dy), dy.shape[0], cu_seqlens,
                  dw_home, dw_slot)


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
    contract = _with_row_src(_weights_contract(
        contracts.check_swiglu_bwd_gather_args, (g_out, row_src, w_down_home, w_down_slot, cu_seqlens, row_w, gate,
                                                 up, pad), w_down_home, ("F", "H")), op, row_src, "g_out", g_out, "H")
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
    dy_src = g_out), for finite ``x``: as in ``group_gemm_wgrad_gather`` the 16-row blocks of a group after
    its last row with a token (among its last 128) are not multiplied, so ``x``'s rows there are not read.
    ``dy_src`` has fewer than 2**31 elements (32-bit row offsets). Precondition (device values, not checked:
    no host sync): every ``row_src[r] < S``; an index may repeat. No host sync."""
    op = "group_gemm_wgrad_gather_b"

    def contract(_):
        contracts.check_wgrad_gather_b_args(x, dy_src, row_src, cu_seqlens, dw_home, dw_slot, pad)
        check_row_src(op, row_src, "dy_src", dy_src, "Nd")
        return {"Kd": x.shape[1], "Nd": dy_src.shape[1]}, dw_home.shape[0]

    sizes = _check_kernel_args(op, contract, pad, (("x", x), ("dy_src", dy_src), ("dw_home", dw_home)),
                               "dw_home", aligned=(("dw_slot", dw_slot),))
    # computed as dW_g^T = rows_g^T @ x_g: the gathered-A wgrad (M = Nd over the gathered token rows' columns,
    # N = Kd), its tiles stored transposed into dW (see docs/design-notes.md, session 22)
    _launch_wgrad("wgrad_gather_t", {"Kd": sizes["Nd"], "Nd": sizes["Kd"]}, pad,
                  (_token_rows(dy_src, sizes["Nd"]), row_src, x), x.shape[0], cu_seqlens, dw_home, dw_slot)
