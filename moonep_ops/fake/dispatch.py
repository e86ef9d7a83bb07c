"""Fake kernels of moonep::dispatch and dispatch_index."""

import torch

from ..checks import check_dispatch_args, check_dispatch_index_args


def dispatch(x, route_w, dst_rank, dst_row, primary_row, cu_seqlens, group_rows, send_rows, recv_w, recv_primary,
             recv_next, recv_src, ctrl, group_name: str):
    check_dispatch_args(x, route_w, dst_rank, dst_row, primary_row, cu_seqlens, group_rows, send_rows, recv_w,
                        recv_primary, recv_next, recv_src, ctrl)
    return (x.new_empty((recv_w.shape[0], x.shape[1])), torch.empty_like(recv_w), torch.empty_like(recv_primary),
            torch.empty_like(recv_next))


def dispatch_index(x, route_w, dst_rank, dst_row, primary_row, cu_seqlens, group_rows, recv_w, recv_primary, recv_next,
                   recv_src, ctrl, group_name: str):
    check_dispatch_index_args(x, route_w, dst_rank, dst_row, primary_row, cu_seqlens, group_rows, recv_w, recv_primary,
                              recv_next, recv_src, ctrl)
    return (torch.empty_like(recv_w), torch.empty_like(recv_primary), torch.empty_like(recv_next),
            torch.empty_like(recv_src))
