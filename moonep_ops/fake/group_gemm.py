"""Fake kernels of moonep::group_gemm, group_gemm_dgrad, group_gemm_dgrad2, group_gemm_wgrad, group_gemm_swiglu,
group_gemm_row_scale and group_gemm_swiglu_bwd, and their contracts (``check_*_args``: the checks the fake,
the CPU reference and the CUDA path each run once); also of the ops that read an operand's rows by index
(group_gemm_swiglu_gather, group_gemm_wgrad_gather, group_gemm_swiglu_bwd_gather, group_gemm_wgrad_gather_b:
x [S, H] or g_out [S, H] and row_src [N] in place of the rows [N, H]), whose contracts the host wrappers
of their kernels (csrc_cute/group_gemm/host_gather.py) run as well."""

import torch

from ..checks import ROW_DTYPES, check_pad, check_tensor


def check_weights(op: str, w_home, w_slot, cu_seqlens, dtype, device, experts_remote=None) -> tuple[int, int]:
    check_tensor(op, "w_home", w_home, (dtype,), (None, None, None), device)
    epn, Kd, Nd = w_home.shape
    check_tensor(op, "w_slot", w_slot, (dtype,), (None, Kd, Nd), device)
    check_groups(op, cu_seqlens, epn + w_slot.shape[0], experts_remote, device)
    return Kd, Nd


def check_groups(op: str, cu_seqlens, local_groups: int, experts_remote, device) -> None:
    """cu_seqlens holds the home and slot groups, then one group per entry of experts_remote (int32
    [n_remote], inference) when it is given."""
    groups = f"epn + B = {local_groups}"
    n_remote = 0
    if experts_remote is not None:
        check_tensor(op, "experts_remote", experts_remote, (torch.int32,), (None,), device)
        n_remote = experts_remote.shape[0]
        groups = f"epn + B + n_remote = {local_groups} + {n_remote}"
    check_tensor(op, "cu_seqlens", cu_seqlens, (torch.int32,), (None,), device)
    if cu_seqlens.shape[0] != local_groups + n_remote:
        raise ValueError(f"moonep.{op}: cu_seqlens must have shape [{local_groups + n_remote}] (one entry per group: "
                         f"{groups}), got {list(cu_seqlens.shape)}")


def check_rows_and_weights(op: str, name: str, a, w_home, w_slot, cu_seqlens, P, experts_remote=None):
    """The checks every row-grouped GEMM starts with: its row operand ``a`` (argument ``name``, [N, *]),
    P, and the weight pair with its groups (in ``a``'s dtype, on its device) -> (Kd, Nd)."""
    check_tensor(op, name, a, ROW_DTYPES, (None, None))
    check_pad(op, P)
    return check_weights(op, w_home, w_slot, cu_seqlens, a.dtype, a.device, experts_remote)


def check_group_gemm_args(x, w_home, w_slot, cu_seqlens, P) -> int:
    Kd, Nd = check_rows_and_weights("group_gemm", "x", x, w_home, w_slot, cu_seqlens, P)
    if x.shape[1] != Kd:
        raise ValueError(f"moonep.group_gemm: x has {x.shape[1]} columns but w_home rows are {Kd} long")
    return Nd


def group_gemm(x, w_home, w_slot, cu_seqlens, P: int):
    Nd = check_group_gemm_args(x, w_home, w_slot, cu_seqlens, P)
    return x.new_empty((x.shape[0], Nd))


def check_dgrad_args(dy, w_home, w_slot, cu_seqlens, P) -> int:
    Kd, Nd = check_rows_and_weights("group_gemm_dgrad", "dy", dy, w_home, w_slot, cu_seqlens, P)
    if dy.shape[1] != Nd:
        raise ValueError(f"moonep.group_gemm_dgrad: dy has {dy.shape[1]} columns but the weights have {Nd}")
    return Kd


def group_gemm_dgrad(dy, w_home, w_slot, cu_seqlens, P: int):
    Kd = check_dgrad_args(dy, w_home, w_slot, cu_seqlens, P)
    return dy.new_empty((dy.shape[0], Kd))


def check_dgrad2_args(dy_a, w_a_home, w_a_slot, dy_b, w_b_home, w_b_slot, cu_seqlens, P) -> int:
    """Two dgrad operand pairs of one shape ([N, Nd] rows, [epn, Kd, Nd] / [B, Kd, Nd] weights) -> Kd."""
    op = "group_gemm_dgrad2"
    check_tensor(op, "dy_a", dy_a, ROW_DTYPES, (None, None))
    check_pad(op, P)
    N, Nd = dy_a.shape
    check_tensor(op, "w_a_home", w_a_home, (dy_a.dtype,), (None, None, Nd), dy_a.device)
    epn, Kd, _ = w_a_home.shape
    check_tensor(op, "w_a_slot", w_a_slot, (dy_a.dtype,), (None, Kd, Nd), dy_a.device)
    check_tensor(op, "dy_b", dy_b, (dy_a.dtype,), (N, Nd), dy_a.device)
    check_tensor(op, "w_b_home", w_b_home, (dy_a.dtype,), (epn, Kd, Nd), dy_a.device)
    check_tensor(op, "w_b_slot", w_b_slot, (dy_a.dtype,), (w_a_slot.shape[0], Kd, Nd), dy_a.device)
    check_groups(op, cu_seqlens, epn + w_a_slot.shape[0], None, dy_a.device)
    return Kd


def group_gemm_dgrad2(dy_a, w_a_home, w_a_slot, dy_b, w_b_home, w_b_slot, cu_seqlens, P: int):
    Kd = check_dgrad2_args(dy_a, w_a_home, w_a_slot, dy_b, w_b_home, w_b_slot, cu_seqlens, P)
    return dy_a.new_empty((dy_a.shape[0], Kd))


def check_wgrad_args(x, dy, cu_seqlens, dw_home, dw_slot, P) -> None:
    op = "group_gemm_wgrad"
    check_tensor(op, "x", x, ROW_DTYPES, (None, None))
    check_pad(op, P)
    _check_wgrad_rest(op, x, x.shape[0], dy, cu_seqlens, dw_home, dw_slot)


def check_wgrad_gather_args(x, row_src, dy, cu_seqlens, dw_home, dw_slot, P) -> None:
    """group_gemm_wgrad's contract with x [S, Kd] and row_src int32 [N] (the rows' token indices, -1: a
    zero row) in place of the rows [N, Kd]."""
    op = "group_gemm_wgrad_gather"
    check_tensor(op, "x", x, ROW_DTYPES, (None, None))
    check_pad(op, P)
    check_tensor(op, "row_src", row_src, (torch.int32,), (None,), x.device)
    _check_wgrad_rest(op, x, row_src.shape[0], dy, cu_seqlens, dw_home, dw_slot)


def check_wgrad_gather_b_args(x, dy_src, row_src, cu_seqlens, dw_home, dw_slot, P) -> None:
    """group_gemm_wgrad's contract with dy_src [S, Nd] and row_src int32 [N] (the rows' token indices, -1: a
    zero row) in place of dy's rows [N, Nd]; x has the N rows (the down projection's wgrad: x = h_w, dy_src =
    the tokens' gradient g_out)."""
    op = "group_gemm_wgrad_gather_b"
    check_tensor(op, "x", x, ROW_DTYPES, (None, None))
    check_pad(op, P)
    check_tensor(op, "dy_src", dy_src, (x.dtype,), (None, None), x.device)
    check_tensor(op, "row_src", row_src, (torch.int32,), (None,), x.device)
    if row_src.shape[0] != x.shape[0]:
        raise ValueError(f"moonep.{op}: row_src must have one entry per row of x (N = {x.shape[0]}), got "
                         f"shape {tuple(row_src.shape)}")
    _check_wgrad_outputs(op, x, dy_src.shape[1], cu_seqlens, dw_home, dw_slot)


def _check_wgrad_rest(op: str, x, N: int, dy, cu_seqlens, dw_home, dw_slot) -> None:
    """dy [N, Nd] and the gradients of a wgrad whose A operand has N rows of x's width and dtype."""
    check_tensor(op, "dy", dy, (x.dtype,), (N, None), x.device)
    _check_wgrad_outputs(op, x, dy.shape[1], cu_seqlens, dw_home, dw_slot)


def _check_wgrad_outputs(op: str, x, Nd: int, cu_seqlens, dw_home, dw_slot) -> None:
    """The gradients [*, Kd, Nd] of a wgrad whose A operand has x's width Kd and dtype, and their groups."""
    Kd = x.shape[1]
    # home gradients are written in the rows' dtype; slot gradients (the reduce buffers) accumulate in fp32
    check_tensor(op, "dw_home", dw_home, (x.dtype,), (None, Kd, Nd), x.device)
    check_tensor(op, "dw_slot", dw_slot, (torch.float32,), (None, Kd, Nd), x.device)
    check_groups(op, cu_seqlens, dw_home.shape[0] + dw_slot.shape[0], None, x.device)


def group_gemm_wgrad(x, dy, cu_seqlens, dw_home, dw_slot, P: int) -> None:
    check_wgrad_args(x, dy, cu_seqlens, dw_home, dw_slot, P)


def group_gemm_wgrad_gather(x, row_src, dy, cu_seqlens, dw_home, dw_slot, P: int) -> None:
    check_wgrad_gather_args(x, row_src, dy, cu_seqlens, dw_home, dw_slot, P)


def group_gemm_wgrad_gather_b(x, dy_src, row_src, cu_seqlens, dw_home, dw_slot, P: int) -> None:
    check_wgrad_gather_b_args(x, dy_src, row_src, cu_seqlens, dw_home, dw_slot, P)


def check_swiglu_args(x, w_gate_home, w_gate_slot, w_up_home, w_up_slot, cu_seqlens, P, experts_remote=None, *,
                      op: str = "group_gemm_swiglu") -> int:
    check_tensor(op, "x", x, ROW_DTYPES, (None, None))
    check_pad(op, P)
    check_tensor(op, "w_gate_home", w_gate_home, (x.dtype,), (None, x.shape[1], None), x.device)
    epn, H, F = w_gate_home.shape
    check_tensor(op, "w_gate_slot", w_gate_slot, (x.dtype,), (None, H, F), x.device)
    check_tensor(op, "w_up_home", w_up_home, (x.dtype,), (epn, H, F), x.device)
    check_tensor(op, "w_up_slot", w_up_slot, (x.dtype,), (w_gate_slot.shape[0], H, F), x.device)
    check_groups(op, cu_seqlens, epn + w_gate_slot.shape[0], experts_remote, x.device)
    return F


def group_gemm_swiglu(x, w_gate_home, w_gate_slot, w_up_home, w_up_slot, cu_seqlens, P: int, save_preact: bool,
                      experts_remote=None, group_name: str = ""):
    F = check_swiglu_args(x, w_gate_home, w_gate_slot, w_up_home, w_up_slot, cu_seqlens, P, experts_remote)
    n_pre = x.shape[0] if save_preact else 0
    return x.new_empty((x.shape[0], F)), x.new_empty((n_pre, F)), x.new_empty((n_pre, F))


def check_swiglu_gather_args(x, row_src, w_gate_home, w_gate_slot, w_up_home, w_up_slot, cu_seqlens, P,
                             experts_remote=None) -> int:
    """group_gemm_swiglu's contract with x [S, H] and row_src int32 [N] (the rows' token indices, -1: a zero
    row) in place of the rows [N, H]."""
    op = "group_gemm_swiglu_gather"
    F = check_swiglu_args(x, w_gate_home, w_gate_slot, w_up_home, w_up_slot, cu_seqlens, P, experts_remote, op=op)
    check_tensor(op, "row_src", row_src, (torch.int32,), (None,), x.device)
    return F


def group_gemm_swiglu_gather(x, row_src, w_gate_home, w_gate_slot, w_up_home, w_up_slot, cu_seqlens, P: int,
                             save_preact: bool):
    F = check_swiglu_gather_args(x, row_src, w_gate_home, w_gate_slot, w_up_home, w_up_slot, cu_seqlens, P)
    n, n_pre = row_src.shape[0], row_src.shape[0] if save_preact else 0
    return x.new_empty((n, F)), x.new_empty((n_pre, F)), x.new_empty((n_pre, F))


def check_row_scale_args(x, w_home, w_slot, cu_seqlens, row_w, P, experts_remote=None) -> int:
    op = "group_gemm_row_scale"
    Kd, Nd = check_rows_and_weights(op, "x", x, w_home, w_slot, cu_seqlens, P, experts_remote)
    if x.shape[1] != Kd:
        raise ValueError(f"moonep.{op}: x has {x.shape[1]} columns but w_home rows are {Kd} long")
    check_tensor(op, "row_w", row_w, (torch.float32,), (x.shape[0],), x.device)
    return Nd


def group_gemm_row_scale(x, w_home, w_slot, cu_seqlens, row_w, P: int, experts_remote=None, group_name: str = ""):
    Nd = check_row_scale_args(x, w_home, w_slot, cu_seqlens, row_w, P, experts_remote)
    return x.new_empty((x.shape[0], Nd))


def check_swiglu_bwd_args(g_y, w_down_home, w_down_slot, cu_seqlens, row_w, gate, up, P) -> int:
    op = "group_gemm_swiglu_bwd"
    check_tensor(op, "g_y", g_y, ROW_DTYPES, (None, None))
    check_pad(op, P)
    return _check_swiglu_bwd_rest(op, g_y, g_y.shape[0], w_down_home, w_down_slot, cu_seqlens, row_w, gate, up)


def check_swiglu_bwd_gather_args(g_out, row_src, w_down_home, w_down_slot, cu_seqlens, row_w, gate, up, P) -> int:
    """group_gemm_swiglu_bwd's contract with g_out [S, H] and row_src int32 [N] (the rows' token indices, -1: a
    zero row) in place of g_y [N, H]: N is row_src's length, which row_w, gate and up hold to."""
    op = "group_gemm_swiglu_bwd_gather"
    check_tensor(op, "g_out", g_out, ROW_DTYPES, (None, None))
    check_pad(op, P)
    check_tensor(op, "row_src", row_src, (torch.int32,), (None,), g_out.device)
    return _check_swiglu_bwd_rest(op, g_out, row_src.shape[0], w_down_home, w_down_slot, cu_seqlens, row_w, gate,
                                  up)


def _check_swiglu_bwd_rest(op: str, g, N: int, w_down_home, w_down_slot, cu_seqlens, row_w, gate, up) -> int:
    """The arguments after the output gradient ``g`` (its rows, or the tokens they are read from: [*, H]) of a
    SwiGLU backward of N rows -> F."""
    H = g.shape[1]
    check_tensor(op, "w_down_home", w_down_home, (g.dtype,), (None, None, H), g.device)
    epn, F, _ = w_down_home.shape
    check_tensor(op, "w_down_slot", w_down_slot, (g.dtype,), (None, F, H), g.device)
    check_groups(op, cu_seqlens, epn + w_down_slot.shape[0], None, g.device)
    check_tensor(op, "row_w", row_w, (torch.float32,), (N,), g.device)
    check_tensor(op, "gate", gate, (g.dtype,), (N, F), g.device)
    check_tensor(op, "up", up, (g.dtype,), (N, F), g.device)
    return F


def group_gemm_swiglu_bwd(g_y, w_down_home, w_down_slot, cu_seqlens, row_w, gate, up, P: int):
    F = check_swiglu_bwd_args(g_y, w_down_home, w_down_slot, cu_seqlens, row_w, gate, up, P)
    N = g_y.shape[0]
    return (g_y.new_empty((N, F)), g_y.new_empty((N, F)), g_y.new_empty((N, F)),
            g_y.new_empty((N,), dtype=torch.float32))


def group_gemm_swiglu_bwd_gather(g_out, row_src, w_down_home, w_down_slot, cu_seqlens, row_w, gate, up, P: int):
    F = check_swiglu_bwd_gather_args(g_out, row_src, w_down_home, w_down_slot, cu_seqlens, row_w, gate, up, P)
    N = row_src.shape[0]
    return (g_out.new_empty((N, F)), g_out.new_empty((N, F)), g_out.new_empty((N, F)),
            g_out.new_empty((N,), dtype=torch.float32))
