"""The `moonep` ops of the gathered path: a 1-rank EP group's experts read the tokens in place.

At R = 1 every row of a dispatch is a copy of one of this rank's own tokens: row r of dispatch's rows
[NvS, H] is `where(row_src[r] >= 0, x[row_src[r]], 0)` with `row_src` the token each row holds (-1:
padding). So `EPGroup(gather_rows=True)` (the default at R = 1, moonep_ops/group.py) writes no rows:
- `dispatch_index` runs dispatch's table half only: (row_w, row_primary, row_next, row_src) [NvS];
- the grouped GEMMs that read the rows or the row gradients take the token rows [S, H] and `row_src`
  instead and gather in their main loop (csrc_cute/group_gemm/gather.py): `group_gemm_swiglu_gather` (the
  forward's gate/up), `group_gemm_wgrad_gather` (the gate/up wgrads), and with the tokens' gradient
  g_out [S, H] (combine's backward at R = 1 is this same gather) `group_gemm_swiglu_bwd_gather` and
  `group_gemm_wgrad_gather_b` (the down projection's wgrad, g_out as its B operand);
- the backward ops: `dispatch_index_backward` (the route weights' gradient, read back per row) and
  `experts_combine_gathered_backward` (the experts' backward with the tokens' gradient at its end).
Each op is bitwise the materialised path's ops on the gathered rows (`where(row_src >= 0, src[row_src],
0)`), which is also its CPU reference; 2-3 fewer [NvS, H] tensors written a training step (~1 GB each at
the DESIGN shape). A 1-rank plan copies nothing and reads nothing remotely (`ops.gemm_groups`), so the
GEMMs get the home groups alone with empty slot operands, and nothing is prefetched or reduced.
"""

from __future__ import annotations

import torch
from torch.library import custom_op

from . import checks, fake, ops
from .comm import resolve_group
from .registry import group_by_key, group_of, peers
from .table_checks import check_range

Tensor = torch.Tensor


def check_one_rank(op: str, R: int) -> None:
    """The gathered path reads this rank's own tokens: a group of one rank only."""
    if R != 1:
        raise ValueError(f"moonep.{op}: the gathered path needs a 1-rank EP group (R = 1: every row is one of "
                         f"this rank's tokens), got R={R}; with more ranks the rows are pulled by moonep::dispatch")


def no_slots(w: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """An empty slot operand [0, ...] of `w`'s shape (and dtype, or `dtype`): a 1-rank plan has no copies."""
    return w.new_empty((0, *w.shape[1:]), dtype=dtype)


# ------------------------------------------------------------------------------------- dispatch_index
@custom_op("moonep::dispatch_index", mutates_args=("recv_w", "recv_primary", "recv_next", "recv_src", "ctrl"),
           device_types="cpu")
def dispatch_index(x: Tensor, route_w: Tensor, dst_rank: Tensor, dst_row: Tensor, primary_row: Tensor,
                   cu_seqlens: Tensor, group_rows: Tensor, recv_w: Tensor, recv_primary: Tensor, recv_next: Tensor,
                   recv_src: Tensor, ctrl: Tensor, group_name: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """moonep::dispatch of a 1-rank group without its rows: (row_w [NvS] fp32, row_primary, row_next, row_src
    [NvS] int32), the first three as dispatch returns them and row_src the token each row holds (-1:
    padding), so that dispatch's rows are `where(row_src >= 0, x[row_src], 0)`. The recv_* tables are
    written as dispatch writes them; x [S, H] is read by no one here (the gathered GEMMs read it)."""
    group = resolve_group("dispatch_index", group_name)

    def check_args():
        checks.check_dispatch_index_args(x, route_w, dst_rank, dst_row, primary_row, cu_seqlens, group_rows, recv_w,
                                         recv_primary, recv_next, recv_src, ctrl)
        check_one_rank("dispatch_index", torch.distributed.get_world_size(group))

    ops.receive_tables("dispatch_index", check_args, route_w, dst_rank, dst_row, primary_row, cu_seqlens, group_rows,
                       recv_w, recv_primary, recv_next, recv_src, ctrl, group)
    return recv_w.clone(), recv_primary.clone(), recv_next.clone(), recv_src.clone()


dispatch_index.register_fake(fake.dispatch.dispatch_index)


@dispatch_index.register_kernel("cuda")
def _dispatch_index_cuda(x, route_w, dst_rank, dst_row, primary_row, cu_seqlens, group_rows, recv_w, recv_primary,
                         recv_next, recv_src, ctrl, group_name):
    checks.check_dispatch_index_args(x, route_w, dst_rank, dst_row, primary_row, cu_seqlens, group_rows, recv_w,
                                     recv_primary, recv_next, recv_src, ctrl)
    from csrc_cute import dispatch as kd  # CuTe DSL loads on first CUDA use only

    ep = group_of("dispatch_index", ctrl)
    check_one_rank("dispatch_index", ep.cfg.R)
    tables = (recv_w, recv_primary, recv_next, recv_src)
    names = ("recv_w", "recv_primary", "recv_next", "recv_src")
    # no barrier: no peer reads or writes this rank's tables. dispatch_meta writes every row's entry (a
    # token's, or a padding row's 0 / -1), so row_src is -1 or a token of x ([0, S)) everywhere
    kd.dispatch_meta(x, route_w, dst_rank, dst_row, primary_row,
                     *(peers("dispatch_index", n, t) for n, t in zip(names, tables)), *tables, None, cu_seqlens,
                     group_rows, ep.rank, ep.status, num_ctas=ep.comm_sms)
    out = tuple(t.clone() for t in tables)
    ops.debug_check(ep, "dispatch_index")
    return out


# ------------------------------------------------------------------------------- gathered grouped GEMMs
def gathered_rows(op: str, src_name: str, src: Tensor, row_src: Tensor) -> Tensor:
    """The CPU reference of a gathered operand: `where(row_src >= 0, src[row_src], 0)` [N, *], after checking
    every index in [-1, S) (the CUDA kernels take that as a precondition: no host sync there)."""
    check_range(op, "row_src", row_src, -1, src.shape[0], f"S={src.shape[0]}, the rows of {src_name}")
    rows = src.new_zeros((row_src.shape[0], src.shape[1]))
    routed = torch.nonzero(row_src >= 0).flatten()
    rows[routed] = src[row_src[routed].long()]
    return rows


@custom_op("moonep::group_gemm_swiglu_gather", mutates_args=(), device_types="cpu")
def group_gemm_swiglu_gather(x: Tensor, row_src: Tensor, w_gate_home: Tensor, w_gate_slot: Tensor,
                             w_up_home: Tensor, w_up_slot: Tensor, cu_seqlens: Tensor, P: int, save_preact: bool
                             ) -> tuple[Tensor, Tensor, Tensor]:
    """moonep::group_gemm_swiglu on the rows `where(row_src >= 0, x[row_src], 0)` [N, H], read from the
    tokens x [S, H] by the kernel (row_src int32 [N], in [-1, S)): bitwise the same (h, gate, up)."""
    fake.group_gemm.check_swiglu_gather_args(x, row_src, w_gate_home, w_gate_slot, w_up_home, w_up_slot, cu_seqlens, P)
    rows = gathered_rows("group_gemm_swiglu_gather", "x", x, row_src)
    return ops.group_gemm_swiglu(rows, w_gate_home, w_gate_slot, w_up_home, w_up_slot, cu_seqlens, P, save_preact)


group_gemm_swiglu_gather.register_fake(fake.group_gemm.group_gemm_swiglu_gather)


@group_gemm_swiglu_gather.register_kernel("cuda")
def _group_gemm_swiglu_gather_cuda(x, row_src, w_gate_home, w_gate_slot, w_up_home, w_up_slot, cu_seqlens, P,
                                   save_preact):
    from csrc_cute.group_gemm import group_gemm_swiglu_gather as kernel  # CuTe DSL loads on first CUDA use only

    h, gate, up = kernel(x, row_src, w_gate_home, w_gate_slot, w_up_home, w_up_slot, cu_seqlens, pad=P,
                         store_preact=save_preact)
    if not save_preact:
        gate, up = x.new_empty((0, h.shape[1])), x.new_empty((0, h.shape[1]))
    return h, gate, up


@custom_op("moonep::group_gemm_wgrad_gather", mutates_args=("dw_home", "dw_slot"), device_types="cpu")
def group_gemm_wgrad_gather(x: Tensor, row_src: Tensor, dy: Tensor, cu_seqlens: Tensor, dw_home: Tensor,
                            dw_slot: Tensor, P: int) -> None:
    """moonep::group_gemm_wgrad with the rows `where(row_src >= 0, x[row_src], 0)` [N, Kd] as its A operand,
    read from x [S, Kd] by the kernel (dy has the N rows): bitwise the same dw_home / dw_slot for finite dy (the
    CUDA kernel does not read dy's rows in the 16-row blocks after a group's last routed row:
    csrc_cute.group_gemm.group_gemm_wgrad_gather)."""
    fake.group_gemm.check_wgrad_gather_args(x, row_src, dy, cu_seqlens, dw_home, dw_slot, P)
    ops.group_gemm_wgrad(gathered_rows("group_gemm_wgrad_gather", "x", x, row_src), dy, cu_seqlens, dw_home, dw_slot,
                         P)


group_gemm_wgrad_gather.register_fake(fake.group_gemm.group_gemm_wgrad_gather)


@group_gemm_wgrad_gather.register_kernel("cuda")
def _group_gemm_wgrad_gather_cuda(x, row_src, dy, cu_seqlens, dw_home, dw_slot, P):
    from csrc_cute.group_gemm import group_gemm_wgrad_gather as kernel  # CuTe DSL loads on first CUDA use only

    kernel(x, row_src, dy, cu_seqlens, dw_home, dw_slot, pad=P)


@custom_op("moonep::group_gemm_wgrad_gather_b", mutates_args=("dw_home", "dw_slot"), device_types="cpu")
def group_gemm_wgrad_gather_b(x: Tensor, dy_src: Tensor, row_src: Tensor, cu_seqlens: Tensor, dw_home: Tensor,
                              dw_slot: Tensor, P: int) -> None:
    """moonep::group_gemm_wgrad with the output-gradient rows `where(row_src >= 0, dy_src[row_src], 0)` [N, Nd]
    as its dy, read from dy_src [S, Nd] by the kernel (x has the N rows; the down projection's wgrad with
    x = h_w, dy_src = the tokens' gradient): bitwise the same dw_home / dw_slot for finite x (the CUDA kernel
    does not read x's rows in the 16-row blocks after a group's last routed row)."""
    fake.group_gemm.check_wgrad_gather_b_args(x, dy_src, row_src, cu_seqlens, dw_home, dw_slot, P)
    ops.group_gemm_wgrad(x, gathered_rows("group_gemm_wgrad_gather_b", "dy_src", dy_src, row_src), cu_seqlens,
                         dw_home, dw_slot, P)


group_gemm_wgrad_gather_b.register_fake(fake.group_gemm.group_gemm_wgrad_gather_b)


@group_gemm_wgrad_gather_b.register_kernel("cuda")
def _group_gemm_wgrad_gather_b_cuda(x, dy_src, row_src, cu_seqlens, dw_home, dw_slot, P):
    from csrc_cute.group_gemm import group_gemm_wgrad_gather_b as kernel  # CuTe DSL loads on first CUDA use only

    kernel(x, dy_src, row_src, cu_seqlens, dw_home, dw_slot, pad=P)


@custom_op("moonep::group_gemm_swiglu_bwd_gather", mutates_args=(), device_types="cpu")
def group_gemm_swiglu_bwd_gather(g_out: Tensor, row_src: Tensor, w_down_home: Tensor, w_down_slot: Tensor,
                                 cu_seqlens: Tensor, row_w: Tensor, gate: Tensor, up: Tensor, P: int
                                 ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """moonep::group_gemm_swiglu_bwd with the row gradients `where(row_src >= 0, g_out[row_src], 0)` [N, H],
    read from the tokens' gradient g_out [S, H] by the kernel (row_w, gate, up have the N rows): bitwise
    the same (g_gate, g_up, h_w, g_row_w)."""
    fake.group_gemm.check_swiglu_bwd_gather_args(g_out, row_src, w_down_home, w_down_slot, cu_seqlens, row_w, gate,
                                                 up, P)
    g_y = gathered_rows("group_gemm_swiglu_bwd_gather", "g_out", g_out, row_src)
    return ops.group_gemm_swiglu_bwd(g_y, w_down_home, w_down_slot, cu_seqlens, row_w, gate, up, P)


group_gemm_swiglu_bwd_gather.register_fake(fake.group_gemm.group_gemm_swiglu_bwd_gather)


@group_gemm_swiglu_bwd_gather.register_kernel("cuda")
def _group_gemm_swiglu_bwd_gather_cuda(g_out, row_src, w_down_home, w_down_slot, cu_seqlens, row_w, gate, up, P):
    from csrc_cute.group_gemm import group_gemm_swiglu_bwd_gather as kernel  # CuTe DSL loads on first CUDA use only

    return kernel(g_out, row_src, w_down_home, w_down_slot, cu_seqlens, row_w, gate, up, pad=P)


# ------------------------------------------------------------------------------------- backward ops
# Functional, finding the group by `ep_key`, as the materialised path's backward ops (ops.py, "backward ops").
@custom_op("moonep::dispatch_index_backward", mutates_args=())
def dispatch_index_backward(g_row_w: Tensor, dst_rank: Tensor, dst_row: Tensor, ep_key: str) -> Tensor:
    """Gradient of dispatch_index: the route weights' gradients [S, K], the per-row values g_row_w [NvS] read
    back (the token rows' gradient comes from the experts' backward, which read them)."""
    checks.check_dispatch_index_backward_args(g_row_w, dst_rank, dst_row, ep_key)
    ep = group_by_key("dispatch_index_backward", ep_key)
    return ops.gather_row_weights(g_row_w, dst_rank, dst_row, ep.row_scratch, ep.ctrl, ep.group_name)


dispatch_index_backward.register_fake(fake.backward.dispatch_index_backward)


@custom_op("moonep::experts_combine_gathered_backward", mutates_args=())
def experts_combine_gathered_backward(g_out: Tensor, tokens: Tensor, row_src: Tensor, row_primary: Tensor,
                                      row_next: Tensor, dst_rank: Tensor, dst_row: Tensor, primary_row: Tensor,
                                      row_w: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, cu_seqlens: Tensor,
                                      gate: Tensor, up: Tensor, P: int, ep_key: str
                                      ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradient of the gathered experts and the combine after them (autograd._ExpertsCombineGathered): the
    tokens' gradient g_out [S, H] -> (g_tokens [S, H], g_row_w, dw_gate, dw_up, dw_down). As the
    materialised path's experts_combine_backward followed by dispatch_backward's combine of the row
    gradients, bitwise, with g_out and the tokens read by row_src in the GEMMs: the row gradients g_y and
    the rows [NvS, H] are never written. g_rows [NvS, H] is combined into g_tokens and dropped before the
    gate/up wgrads allocate their gradients (a lower peak)."""
    checks.check_experts_combine_gathered_backward_args(g_out, tokens, row_src, row_primary, row_next, dst_rank,
                                                        dst_row, primary_row, row_w, w_gate, w_up, w_down, cu_seqlens,
                                                        gate, up, ep_key)
    ep = group_by_key("experts_combine_gathered_backward", ep_key)
    check_one_rank("experts_combine_gathered_backward", ep.cfg.R)
    cu = cu_seqlens[:ep.cfg.epn]  # the home groups: a 1-rank plan has no copies (module docstring)
    g_gate, g_up, h_w, g_row_w = group_gemm_swiglu_bwd_gather(g_out, row_src, w_down, no_slots(w_down), cu, row_w,
                                                              gate, up, P)
    # each gradient is allocated right before its wgrad and each operand dropped after its last reader
    dw_down = torch.empty_like(w_down)
    group_gemm_wgrad_gather_b(h_w, g_out, row_src, cu, dw_down, no_slots(w_down, torch.float32), P)
    del h_w
    g_rows = ops.group_gemm_dgrad2(g_gate, w_gate, no_slots(w_gate), g_up, w_up, no_slots(w_up), cu, P)
    g_tokens = ops.combine(g_rows, row_primary, row_next, dst_rank, dst_row, primary_row, ep.presum, ep.ctrl,
                           ep.group_name)
    del g_rows
    dw_gate = torch.empty_like(w_gate)
    group_gemm_wgrad_gather(tokens, row_src, g_gate, cu, dw_gate, no_slots(w_gate, torch.float32), P)
    del g_gate
    dw_up = torch.empty_like(w_up)
    group_gemm_wgrad_gather(tokens, row_src, g_up, cu, dw_up, no_slots(w_up, torch.float32), P)
    return g_tokens, g_row_w, dw_gate, dw_up, dw_down


experts_combine_gathered_backward.register_fake(fake.backward.experts_combine_gathered_backward)
