"""Fake kernel of moonep::dispatch."""

import torch

from .checks import ROW_DTYPES, check_tensor


def check_token_plan(op: str, S: int, K: int, device, **tables: torch.Tensor) -> None:
    for name, t in tables.items():
        check_tensor(op, name, t, (torch.int32,), (S, K), device)


def check_dispatch_args(x, route_w, dst_rank, dst_row, primary_row, cu_seqlens, group_rows, send_rows, recv_w,
                        recv_primary, recv_next, recv_src, ctrl) -> None:
    check_tensor("dispatch", "x", x, ROW_DTYPES, (None, None))
    S, H = x.shape
    check_tensor("dispatch", "route_w", route_w, (torch.float32,), (S, None), x.device)
    K = route_w.shape[1]
    check_token_plan("dispatch", S, K, x.device, dst_rank=dst_rank, dst_row=dst_row, primary_row=primary_row)
    check_tensor("dispatch", "send_rows", send_rows, (x.dtype,), (S, H), x.device)
    check_tensor("dispatch", "recv_w", recv_w, (torch.float32,), (None,), x.device)
    NvS = recv_w.shape[0]
    check_tensor("dispatch", "recv_primary", recv_primary, (torch.int32,), (NvS,), x.device)
    check_tensor("dispatch", "recv_next", recv_next, (torch.int32,), (NvS,), x.device)
    check_tensor("dispatch", "recv_src", recv_src, (torch.int32,), (NvS,), x.device)
    check_tensor("dispatch", "cu_seqlens", cu_seqlens, (torch.int32,), (None,), x.device)
    check_tensor("dispatch", "group_rows", group_rows, (torch.int32,), cu_seqlens.shape, x.device)
    check_tensor("dispatch", "ctrl", ctrl, (torch.int32,), (None,), x.device)


def dispatch(x, route_w, dst_rank, dst_row, primary_row, cu_seqlens, group_rows, send_rows, recv_w, recv_primary,
             recv_next, recv_src, ctrl, group_name: str):
    check_dispatch_args(x, route_w, dst_rank, dst_row, primary_row, cu_seqlens, group_rows, send_rows, recv_w,
                        recv_primary, recv_next, recv_src, ctrl)
    return (x.new_empty((recv_w.shape[0], x.shape[1])), torch.empty_like(recv_w), torch.empty_like(recv_primary),
            torch.empty_like(recv_next))
