"""The `moonep` torch.library ops: schemas, CPU reference implementations, fake kernels.

CPU implementations are the reference every CUDA kernel must match: pure torch, cross-rank traffic
through torch.distributed (gloo), free to sync the host. Fake kernels live in `fake/<op>.py`; every
implementation of an op runs the op's contract check (`checks.py`) once.
Persistent buffers (receive rows, slot pools, reduce buffers) are arguments declared in
`mutates_args`; on the GPU they are symmetric memory that peers write into. Outputs are always fresh
tensors, never views of those buffers (see docs/design-notes.md, "Autograd and persistent buffers").
"""

from __future__ import annotations

import torch
from torch.library import custom_op

from . import checks, fake, planning
from .agreement import agree, wait_in_op
from .comm import exchange, pull, pull_many, resolve_group
from .registry import group_by_key, group_of, peers
from .table_checks import (check_copies, check_range, check_received, check_row_tables, check_token_tables,
                           check_unique_rows, real_rows)

Tensor = torch.Tensor


# ---------------------------------------------------------------------------------------------- plan
@custom_op("moonep::plan", mutates_args=("ctrl",), device_types="cpu")
def plan(topk_ids: Tensor, E: int, B: int, P: int, R: int, ctrl: Tensor, group_name: str
         ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Router top-k ids [S, K] -> (dst_rank, dst_row, primary_row [S, K], experts_to_copy [R, B] of all
    ranks, then of this rank: experts_remote [epn-B] (copies read from their home rank, B < epn only),
    cu_seqlens [2*epn] and group_rows [2*epn] (real rows per group), and counts [R, E] of all ranks),
    all int32. `ctrl` is the EP group's control block (CUDA: count exchange, barrier, status).
    S is the capacity: a token whose K ids are all -1 is absent (not counted, destinations -1); with
    N routed rows over all ranks, rank d computes N // R + (d < N % R) rows."""
    group = resolve_group("plan", group_name, R)

    def check():
        checks.check_plan_args(topk_ids, E, B, P, R, ctrl)
        planning.check_topk_ids("moonep.plan", topk_ids, E)

    agree("plan", ctrl, group, check)  # a rank whose ids are bad fails every rank's plan, in step
    S, K = topk_ids.shape
    local = planning.count_routed(topk_ids, E)
    gathered = [torch.empty_like(local) for _ in range(R)]
    wait_in_op(torch.distributed.all_gather(gathered, local, group=group, async_op=True), group)
    counts = torch.stack(gathered)
    gp = planning.plan_global(counts, S, K, B, P)
    rank = torch.distributed.get_rank(group)
    tp = planning.plan_tokens(topk_ids, counts, gp, rank)
    return (tp.dst_rank, tp.dst_row, tp.primary_row, gp.experts_to_copy, gp.experts_remote[rank].clone(),
            gp.cu_seqlens[rank].clone(), gp.group_rows[rank].clone(), counts)


plan.register_fake(fake.plan.plan)


@plan.register_kernel("cuda")
def _plan_cuda(topk_ids: Tensor, E: int, B: int, P: int, R: int, ctrl: Tensor, group_name: str):
    checks.check_plan_args(topk_ids, E, B, P, R, ctrl)
    from csrc_cute import plan as kplan, sync  # CuTe DSL loads on first CUDA use only

    ep = group_of("plan", ctrl)
    S, K = topk_ids.shape
    counts = torch.empty(R, E, dtype=torch.int32, device=topk_ids.device)
    kplan.count_experts(topk_ids, E, ep.status, out=counts[ep.rank])
    sync.exchange_counts(peers("plan", "ctrl", ctrl), ctrl, counts, ep.rank, ep.timeout_s)
    gp, _ = kplan.plan_global_cuda(counts, S, K, B, P, ep.status)
    tp, _ = kplan.plan_tokens_cuda(topk_ids, counts, gp, ep.rank, ep.status)
    out = (tp.dst_rank, tp.dst_row, tp.primary_row, gp.experts_to_copy, gp.experts_remote[ep.rank].clone(),
           gp.cu_seqlens[ep.rank].clone(), gp.group_rows[ep.rank].clone(), counts)
    debug_check(ep, "plan")
    return out


def debug_check(ep, op: str) -> None:
    """In debug mode, raise at once if the op's kernels set a status bit (a host sync per op)."""
    if ep.debug and not torch.cuda.is_current_stream_capturing():
        ep.check(f"moonep.{op}")


# ------------------------------------------------------------------------------------------ dispatch
def next_row_same_rank(dst_rank: Tensor, dst_row: Tensor) -> Tensor:
    """[S, K]: dst_row of the token's next k (k order) that goes to the same rank, -1 if none."""
    nxt = torch.full_like(dst_row, -1)
    K = dst_rank.shape[1]
    for k in range(K):
        for k2 in range(K - 1, k, -1):  # descending, so the nearest later k wins
            same = dst_rank[:, k2] == dst_rank[:, k]
            nxt[:, k] = torch.where(same, dst_row[:, k2], nxt[:, k])
    return nxt


def receive_tables(op: str, check_args, route_w: Tensor, dst_rank: Tensor, dst_row: Tensor, primary_row: Tensor,
                   cu_seqlens: Tensor, group_rows: Tensor, recv_w: Tensor, recv_primary: Tensor, recv_next: Tensor,
                   recv_src: Tensor, ctrl: Tensor, group) -> None:
    """CPU reference of the tables half of a dispatch (`op`: dispatch, dispatch_index): after `check_args()`
    and the rules of the tables (agreed by every rank before anything is written), every (token, k) entry's
    route weight, primary row, next row on its rank and source (rank * S + token) are sent to its rank,
    which writes them into its recv_* tables at the entry's row; padding rows get 0 / -1 / -1 / -1."""
    R = torch.distributed.get_world_size(group)

    def check():
        check_args()  # first: it names a recv_w that is not a tensor before its shape is read
        NvS = recv_w.shape[0]
        check_token_tables(op, R, NvS, dst_rank, dst_row, primary_row)
        check_unique_rows(op, dst_rank, dst_row, NvS)
        return real_rows(op, cu_seqlens, group_rows, NvS)

    real = agree(op, ctrl, group, check)
    S, K = dst_rank.shape
    rank = torch.distributed.get_rank(group)
    flat_rank = dst_rank.reshape(-1)
    next_row = next_row_same_rank(dst_rank, dst_row).reshape(-1)
    src = rank * S + torch.arange(S * K, dtype=torch.int32) // K
    tables = []
    for d in range(R):
        sel = flat_rank == d
        # the fp32 route weight travels in the same int32 rows, by its bits (one exchange, not two)
        tables.append(torch.stack([dst_row.reshape(-1)[sel], primary_row.reshape(-1)[sel], next_row[sel], src[sel],
                                   route_w.reshape(-1)[sel].view(torch.int32)], 1))
    got = torch.cat(exchange(tables, group))
    got_w = got[:, 4].contiguous().view(torch.float32)
    # the rows every peer sent must tile this rank's real rows: checked (and agreed) before any write
    agree(f"{op} (received tables)", ctrl, group,
          lambda: check_received(op, got[:, 0], got[:, 1], got[:, 2], got[:, 3], real, S, R))
    recv_w.zero_()
    for t in (recv_primary, recv_next, recv_src):
        t.fill_(-1)
    row = got[:, 0].long()
    recv_w[row] = got_w
    recv_primary[row], recv_next[row], recv_src[row] = got[:, 1], got[:, 2], got[:, 3]


@custom_op("moonep::dispatch",
           mutates_args=("send_rows", "recv_w", "recv_primary", "recv_next", "recv_src", "ctrl"), device_types="cpu")
def dispatch(x: Tensor, route_w: Tensor, dst_rank: Tensor, dst_row: Tensor, primary_row: Tensor,
             cu_seqlens: Tensor, group_rows: Tensor, send_rows: Tensor, recv_w: Tensor, recv_primary: Tensor,
             recv_next: Tensor, recv_src: Tensor, ctrl: Tensor, group_name: str
             ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Token rows [S, H] -> this rank's expert-grouped rows [NvS, H], row weights [NvS] and, per row,
    the row that carried its token over the link and the token's next row on this rank in k order
    (both -1 for padding). Rows with dst_rank = -1 (absent tokens) are neither sent nor written.
    Each token crosses to a rank once; the receiver copies it to the token's
    other rows there. cu_seqlens/group_rows (this rank's padded group ends and real rows) locate the
    padding rows, which are zero. Persistent buffers: `send_rows` stages this rank's tokens for the
    peers to read; the recv_* tables receive, per row, its weight, primary row, next row and source
    (rank * S + token); with R = 1 `send_rows` may be absent ([0, H], nothing staged: the rows are read
    from x). Outputs are fresh tensors."""
    group = resolve_group("dispatch", group_name)
    R = torch.distributed.get_world_size(group)

    def check_staging():
        checks.check_dispatch_args(x, route_w, dst_rank, dst_row, primary_row, cu_seqlens, group_rows,
                                   send_rows, recv_w, recv_primary, recv_next, recv_src, ctrl)
        checks.check_absent_buffer("dispatch", "send_rows", send_rows, R)

    receive_tables("dispatch", check_staging, route_w, dst_rank, dst_row, primary_row, cu_seqlens, group_rows,
                   recv_w, recv_primary, recv_next, recv_src, ctrl, group)
    staged = x if send_rows.shape[0] == 0 else send_rows.copy_(x)  # absent (R = 1): x serves the pull
    S, NvS = x.shape[0], recv_w.shape[0]
    carriers = torch.nonzero(recv_primary == torch.arange(NvS)).flatten()
    token_rows = pull(staged, recv_src[carriers] // S, recv_src[carriers] % S, group)
    rows = x.new_zeros((NvS, x.shape[1]))
    rows[carriers] = token_rows
    real = torch.nonzero(recv_primary >= 0).flatten()
    rows[real] = rows[recv_primary[real].long()]
    return rows, recv_w.clone(), recv_primary.clone(), recv_next.clone()


dispatch.register_fake(fake.dispatch.dispatch)


@dispatch.register_kernel("cuda")
def _dispatch_cuda(x, route_w, dst_rank, dst_row, primary_row, cu_seqlens, group_rows, send_rows, recv_w,
                   recv_primary, recv_next, recv_src, ctrl, group_name):
    checks.check_dispatch_args(x, route_w, dst_rank, dst_row, primary_row, cu_seqlens, group_rows, send_rows,
                               recv_w, recv_primary, recv_next, recv_src, ctrl)
    from csrc_cute import dispatch as kd  # CuTe DSL loads on first CUDA use only

    ep = group_of("dispatch", ctrl)
    checks.check_absent_buffer("dispatch", "send_rows", send_rows, ep.cfg.R)
    one_rank = ep.cfg.R == 1  # nothing is staged: the pull reads x (csrc_cute/dispatch.py)
    tables = (recv_w, recv_primary, recv_next, recv_src)
    names = ("recv_w", "recv_primary", "recv_next", "recv_src")
    _barrier(ep, ctrl, "dispatch")  # every peer is done reading the previous dispatch's tables and staged rows
    kd.dispatch_meta(x, route_w, dst_rank, dst_row, primary_row,
                     *(peers("dispatch", n, t) for n, t in zip(names, tables)), *tables,
                     None if one_rank else send_rows, cu_seqlens, group_rows, ep.rank, ep.status,
                     num_ctas=ep.comm_sms)
    _barrier(ep, ctrl, "dispatch")  # every row's table entry has landed and every rank's tokens are staged
    out = (torch.empty((recv_w.shape[0], x.shape[1]), dtype=x.dtype, device=x.device),) + tuple(
        torch.empty_like(t) for t in tables[:3])
    kd.dispatch_pull(None if one_rank else peers("dispatch", "send_rows", send_rows), *tables, *out, x.shape[0],
                     ep.status, num_ctas=ep.comm_sms, x=x)  # x: read directly at R = 1
    debug_check(ep, "dispatch")
    return out


def _barrier(ep, ctrl: Tensor, op: str) -> None:
    """The EP group's barrier, carrying `op`'s id: ranks met from different ops set STATUS_OP_MISMATCH."""
    from csrc_cute import sync

    sync.barrier(peers(op, "ctrl", ctrl), ctrl, ep.rank, ep.cfg.E, ep.timeout_s, op)


# ------------------------------------------------------------------------------------------- combine
@custom_op("moonep::combine", mutates_args=("presum", "ctrl"), device_types="cpu")
def combine(rows: Tensor, row_primary: Tensor, row_next: Tensor, dst_rank: Tensor, dst_row: Tensor,
            primary_row: Tensor, presum: Tensor, ctrl: Tensor, group_name: str) -> Tensor:
    """Expert output rows [NvS, H] -> token rows [S, H], summing each token's K rows. The receiver first
    sums a token's rows on it into the row that carried it (fp32, stored in the row dtype in `presum`),
    so one row per (token, rank) crosses back; the source adds those in fp32, in k order. An absent
    token (dst_rank = -1 in all K) gets a zero row. With R = 1 `presum` may be absent ([0, H]: the
    pre-sums are read back from a fresh tensor)."""
    group = resolve_group("combine", group_name)

    def check():
        checks.check_combine_args(rows, row_primary, row_next, dst_rank, dst_row, primary_row, presum, ctrl)
        checks.check_absent_buffer("combine", "presum", presum, torch.distributed.get_world_size(group))
        check_row_tables("combine", row_primary, row_next)
        check_token_tables("combine", torch.distributed.get_world_size(group), rows.shape[0], dst_rank, dst_row,
                           primary_row)

    agree("combine", ctrl, group, check)
    valid = torch.nonzero(row_primary >= 0).flatten()
    acc = torch.zeros(rows.shape, dtype=torch.float32)
    acc.index_add_(0, row_primary[valid].long(), rows[valid].float())
    staged = acc.to(rows.dtype) if presum.shape[0] == 0 else presum.copy_(acc)  # the same rounding
    S, K = dst_rank.shape
    sel = torch.nonzero(((dst_row == primary_row) & (dst_rank >= 0)).reshape(-1)).flatten()
    parts = torch.zeros(S * K, rows.shape[1], dtype=torch.float32)
    parts[sel] = pull(staged, dst_rank.reshape(-1)[sel], primary_row.reshape(-1)[sel], group).float()
    return parts.view(S, K, -1).sum(1).to(rows.dtype)


combine.register_fake(fake.combine.combine)


@combine.register_kernel("cuda")
def _combine_cuda(rows, row_primary, row_next, dst_rank, dst_row, primary_row, presum, ctrl, group_name):
    checks.check_combine_args(rows, row_primary, row_next, dst_rank, dst_row, primary_row, presum, ctrl)
    from csrc_cute import combine as kc  # CuTe DSL loads on first CUDA use only

    ep = group_of("combine", ctrl)
    checks.check_absent_buffer("combine", "presum", presum, ep.cfg.R)
    if ep.cfg.R == 1:
        # one rank: nobody reads a presum but this rank's own pull, so one pass sums each token's rows
        # straight from `rows` (bitwise the presum + pull result; combine_local)
        out = rows.new_empty((dst_rank.shape[0], rows.shape[1]))
        kc.combine_local(rows, dst_rank, dst_row, primary_row, out, ep.status, num_ctas=ep.comm_sms)
        debug_check(ep, "combine")
        return out
    _barrier(ep, ctrl, "combine")  # every peer is done reading the previous combine's presum
    kc.combine_presum(rows, row_primary, row_next, presum, ep.status, num_ctas=ep.comm_sms)
    _barrier(ep, ctrl, "combine")  # every rank's presum is complete
    out = rows.new_empty((dst_rank.shape[0], rows.shape[1]))
    kc.combine_pull(peers("combine", "presum", presum), dst_rank, dst_row, primary_row, out, ep.status,
                    num_ctas=ep.comm_sms, nvs=presum.shape[0])  # rows past every rank's presum are skipped
    debug_check(ep, "combine")
    return out


# -------------------------------------------------------------------------------- gather_row_weights
@custom_op("moonep::gather_row_weights", mutates_args=("row_scratch", "ctrl"), device_types="cpu")
def gather_row_weights(row_vals: Tensor, dst_rank: Tensor, dst_row: Tensor, row_scratch: Tensor, ctrl: Tensor,
                       group_name: str) -> Tensor:
    """Per-row values [NvS] (the route-weight gradient) -> [S, K], read back from the computing ranks
    (through `row_scratch`, a buffer peers can read); 0 where dst_rank = -1 (absent tokens)."""
    group = resolve_group("gather_row_weights", group_name)

    def check():
        checks.check_gather_args(row_vals, dst_rank, dst_row, row_scratch, ctrl)
        check_token_tables("gather_row_weights", torch.distributed.get_world_size(group), row_vals.shape[0],
                           dst_rank, dst_row)

    agree("gather_row_weights", ctrl, group, check)
    row_scratch.copy_(row_vals)
    out = torch.zeros(dst_rank.numel(), dtype=row_vals.dtype)
    sel = torch.nonzero(dst_rank.reshape(-1) >= 0).flatten()
    out[sel] = pull(row_scratch, dst_rank.reshape(-1)[sel], dst_row.reshape(-1)[sel], group)
    return out.view(dst_rank.shape)


gather_row_weights.register_fake(fake.gather_row_weights.gather_row_weights)


@gather_row_weights.register_kernel("cuda")
def _gather_row_weights_cuda(row_vals, dst_rank, dst_row, row_scratch, ctrl, group_name):
    checks.check_gather_args(row_vals, dst_rank, dst_row, row_scratch, ctrl)
    from csrc_cute import combine as kc  # CuTe DSL loads on first CUDA use only

    ep = group_of("gather_row_weights", ctrl)
    _barrier(ep, ctrl, "gather_row_weights")  # every peer is done reading the previous values
    row_scratch.copy_(row_vals)
    _barrier(ep, ctrl, "gather_row_weights")
    out = torch.empty(dst_rank.shape, dtype=torch.float32, device=row_vals.device)
    kc.gather_pull(peers("gather_row_weights", "row_scratch", row_scratch), dst_rank, dst_row, out, ep.status,
                   num_ctas=ep.comm_sms, nvs=row_scratch.shape[0])
    debug_check(ep, "gather_row_weights")
    return out


# ---------------------------------------------------------------------------------------- group_gemm
def _group_bounds(op: str, cu_seqlens: Tensor, n_rows: int, P: int) -> list[tuple[int, int, int]]:
    """(group, first row, end row) of every non-empty group, after checking cu_seqlens."""
    ends = cu_seqlens.tolist()
    starts = [0] + ends[:-1]
    if any(e < s for s, e in zip(starts, ends)) or any(e % P for e in ends):
        raise ValueError(f"moonep.{op}: cu_seqlens must be non-decreasing multiples of P={P}, got {ends}")
    if ends and ends[-1] > n_rows:
        raise ValueError(f"moonep.{op}: cu_seqlens ends at {ends[-1]} but there are only {n_rows} rows")
    return [(g, s, e) for g, (s, e) in enumerate(zip(starts, ends)) if e > s]


def _weight(w_home: Tensor, w_slot: Tensor, g: int, w_remote: Tensor | None = None) -> Tensor:
    """W_g: home experts, then slots, then (inference) the remote groups' weights."""
    epn, B = w_home.shape[0], w_slot.shape[0]
    if g < epn:
        return w_home[g]
    return w_slot[g - epn] if g < epn + B else w_remote[g - epn - B]


@custom_op("moonep::group_gemm", mutates_args=(), device_types="cpu")
def group_gemm(x: Tensor, w_home: Tensor, w_slot: Tensor, cu_seqlens: Tensor, P: int) -> Tensor:
    """y[rows of group g] = x[rows of g] @ W_g, W_g = w_home[g] (g < epn) else w_slot[g - epn]; fp32
    accumulation; every group length is a multiple of P; rows past the last group are zero."""
    fake.group_gemm.check_group_gemm_args(x, w_home, w_slot, cu_seqlens, P)
    y = x.new_zeros((x.shape[0], w_home.shape[2]))
    for g, s, e in _group_bounds("group_gemm", cu_seqlens, x.shape[0], P):
        y[s:e] = (x[s:e].float() @ _weight(w_home, w_slot, g).float()).to(x.dtype)
    return y


group_gemm.register_fake(fake.group_gemm.group_gemm)


@group_gemm.register_kernel("cuda")
def _group_gemm_cuda(x: Tensor, w_home: Tensor, w_slot: Tensor, cu_seqlens: Tensor, P: int) -> Tensor:
    # the CUDA wrappers run the op's contract (moonep_ops/fake/group_gemm.py) once, then the kernels' own checks
    from csrc_cute.group_gemm import group_gemm_fwd  # CuTe DSL loads on first CUDA use only

    return group_gemm_fwd(x, w_home, w_slot, cu_seqlens, pad=P)


@custom_op("moonep::group_gemm_dgrad", mutates_args=(), device_types="cpu")
def group_gemm_dgrad(dy: Tensor, w_home: Tensor, w_slot: Tensor, cu_seqlens: Tensor, P: int) -> Tensor:
    """dx[rows of g] = dy[rows of g] @ W_g^T; rows past the last group are zero."""
    fake.group_gemm.check_dgrad_args(dy, w_home, w_slot, cu_seqlens, P)
    dx = dy.new_zeros((dy.shape[0], w_home.shape[1]))
    for g, s, e in _group_bounds("group_gemm_dgrad", cu_seqlens, dy.shape[0], P):
        dx[s:e] = (dy[s:e].float() @ _weight(w_home, w_slot, g).float().t()).to(dy.dtype)
    return dx


group_gemm_dgrad.register_fake(fake.group_gemm.group_gemm_dgrad)


@group_gemm_dgrad.register_kernel("cuda")
def _group_gemm_dgrad_cuda(dy: Tensor, w_home: Tensor, w_slot: Tensor, cu_seqlens: Tensor, P: int) -> Tensor:
    from csrc_cute.group_gemm import group_gemm_dgrad as dgrad_kernel  # CuTe DSL loads on first CUDA use only

    return dgrad_kernel(dy, w_home, w_slot, cu_seqlens, pad=P)


@custom_op("moonep::group_gemm_dgrad2", mutates_args=(), device_types="cpu")
def group_gemm_dgrad2(dy_a: Tensor, w_a_home: Tensor, w_a_slot: Tensor, dy_b: Tensor, w_b_home: Tensor,
                      w_b_slot: Tensor, cu_seqlens: Tensor, P: int) -> Tensor:
    """dx[rows of g] = dy_a[rows of g] @ Wa_g^T + dy_b[rows of g] @ Wb_g^T: both products summed in fp32 and
    rounded once to the rows' dtype (the input gradient of the gate and up projections in one GEMM); the
    weight pairs are addressed like group_gemm_dgrad's; rows past the last group are zero."""
    fake.group_gemm.check_dgrad2_args(dy_a, w_a_home, w_a_slot, dy_b, w_b_home, w_b_slot, cu_seqlens, P)
    dx = dy_a.new_zeros((dy_a.shape[0], w_a_home.shape[1]))
    for g, s, e in _group_bounds("group_gemm_dgrad2", cu_seqlens, dy_a.shape[0], P):
        dx[s:e] = (dy_a[s:e].float() @ _weight(w_a_home, w_a_slot, g).float().t()
                   + dy_b[s:e].float() @ _weight(w_b_home, w_b_slot, g).float().t()).to(dy_a.dtype)
    return dx


group_gemm_dgrad2.register_fake(fake.group_gemm.group_gemm_dgrad2)


@group_gemm_dgrad2.register_kernel("cuda")
def _group_gemm_dgrad2_cuda(dy_a: Tensor, w_a_home: Tensor, w_a_slot: Tensor, dy_b: Tensor, w_b_home: Tensor,
                            w_b_slot: Tensor, cu_seqlens: Tensor, P: int) -> Tensor:
    from csrc_cute.group_gemm import group_gemm_dgrad2 as dgrad2_kernel  # CuTe DSL loads on first CUDA use only

    return dgrad2_kernel(dy_a, w_a_home, w_a_slot, dy_b, w_b_home, w_b_slot, cu_seqlens, pad=P)


@custom_op("moonep::group_gemm_wgrad", mutates_args=("dw_home", "dw_slot"), device_types="cpu")
def group_gemm_wgrad(x: Tensor, dy: Tensor, cu_seqlens: Tensor, dw_home: Tensor, dw_slot: Tensor, P: int) -> None:
    """Weight gradients x[rows of g]^T @ dy[rows of g], fp32 accumulation. Home groups (g < epn) *write*
    dw_home[g] (x's dtype: one rounding of the fp32 product; a home group with no rows gets zeros, so all
    of dw_home is written). Slot groups accumulate into dw_slot[g - epn] += ... in fp32 (the copies'
    reduce buffers); empty slot groups are not touched."""
    fake.group_gemm.check_wgrad_args(x, dy, cu_seqlens, dw_home, dw_slot, P)
    epn = dw_home.shape[0]
    groups = _group_bounds("group_gemm_wgrad", cu_seqlens, x.shape[0], P)  # validated before anything is written
    dw_home.zero_()  # home groups without rows
    for g, s, e in groups:
        dw = x[s:e].float().t() @ dy[s:e].float()
        if g < epn:
            dw_home[g] = dw  # rounded once to dw_home's dtype
        else:
            dw_slot[g - epn].add_(dw)


group_gemm_wgrad.register_fake(fake.group_gemm.group_gemm_wgrad)


@group_gemm_wgrad.register_kernel("cuda")
def _group_gemm_wgrad_cuda(x: Tensor, dy: Tensor, cu_seqlens: Tensor, dw_home: Tensor, dw_slot: Tensor, P: int) -> None:
    from csrc_cute.group_gemm import group_gemm_wgrad as wgrad_kernel  # CuTe DSL loads on first CUDA use only

    wgrad_kernel(x, dy, cu_seqlens, dw_home, dw_slot, pad=P)


def _remote_home_weights(op: str, w_home: Tensor, experts_remote: Tensor | None, group_name: str) -> Tensor | None:
    """CPU reference of the remote groups' weight reads: [n_remote, ...] = the home weights of each
    expert in `experts_remote` (-1: an empty group, zeros), fetched from its home rank with gloo
    (collective: every rank calls it). None when there are no remote groups (training, B = epn)."""
    if experts_remote is None or experts_remote.numel() == 0:
        return None
    if not group_name:
        raise ValueError(f"moonep.{op}: experts_remote needs group_name (the EP process group the home "
                         f"weights are read over)")
    group = resolve_group(op, group_name)
    R = torch.distributed.get_world_size(group)
    check_range(op, "experts_remote", experts_remote, -1, R * w_home.shape[0], f"E={R * w_home.shape[0]}")
    every = [torch.empty_like(w_home) for _ in range(R)]
    wait_in_op(torch.distributed.all_gather(every, w_home.contiguous(), group=group, async_op=True), group)
    every = torch.cat(every)  # [E, ...] in expert order
    ids = experts_remote.long()
    return torch.where((ids >= 0)[:, None, None], every[ids.clamp(min=0)], 0)


def _weights_cuda(op: str, name: str, w_home: Tensor, experts_remote: Tensor | None) -> Tensor | None:
    """The remote-group operands of a CUDA GEMM: None (no remote groups: the kernels do not read it) or
    the home weights' peer addresses (int64 [R]); the home weights must then be an EPGroup's symmetric
    weights."""
    if experts_remote is None or experts_remote.numel() == 0:
        return None
    return peers(op, name, w_home)


@custom_op("moonep::group_gemm_swiglu", mutates_args=(), device_types="cpu")
def group_gemm_swiglu(x: Tensor, w_gate_home: Tensor, w_gate_slot: Tensor, w_up_home: Tensor, w_up_slot: Tensor,
                      cu_seqlens: Tensor, P: int, save_preact: bool, experts_remote: Tensor | None = None,
                      group_name: str = "") -> tuple[Tensor, Tensor, Tensor]:
    """Fused gate/up projection: per group g, gate = x_g @ Wgate_g and up = x_g @ Wup_g in fp32, then
    h = silu(gate) * up from the fp32 values (never rounded before the activation). Returns (h [N, F],
    gate [N, F], up [N, F]) in x's dtype; with save_preact=False gate and up are empty [0, F] (inference:
    nothing for backward). Weights are addressed like group_gemm's; rows past the last group are zero.
    Inference with B < epn: `experts_remote` [n_remote] (global expert ids, -1 = empty) names the groups
    after the slots, whose weights are read from their home rank (CUDA: through the peer mapping of the
    symmetric home weights; CPU: gloo, over the process group `group_name`)."""
    F = fake.group_gemm.check_swiglu_args(x, w_gate_home, w_gate_slot, w_up_home, w_up_slot, cu_seqlens, P,
                                          experts_remote)
    op = "group_gemm_swiglu"
    remote_gate = _remote_home_weights(op, w_gate_home, experts_remote, group_name)
    remote_up = _remote_home_weights(op, w_up_home, experts_remote, group_name)
    n = x.shape[0]
    h = x.new_zeros((n, F))
    gate, up = x.new_zeros((n if save_preact else 0, F)), x.new_zeros((n if save_preact else 0, F))
    for g, s, e in _group_bounds(op, cu_seqlens, n, P):
        gf = x[s:e].float() @ _weight(w_gate_home, w_gate_slot, g, remote_gate).float()
        uf = x[s:e].float() @ _weight(w_up_home, w_up_slot, g, remote_up).float()
        h[s:e] = (torch.nn.functional.silu(gf) * uf).to(x.dtype)
        if save_preact:
            gate[s:e], up[s:e] = gf.to(x.dtype), uf.to(x.dtype)
    return h, gate, up


group_gemm_swiglu.register_fake(fake.group_gemm.group_gemm_swiglu)


@group_gemm_swiglu.register_kernel("cuda")
def _group_gemm_swiglu_cuda(x: Tensor, w_gate_home: Tensor, w_gate_slot: Tensor, w_up_home: Tensor,
                            w_up_slot: Tensor, cu_seqlens: Tensor, P: int, save_preact: bool,
                            experts_remote: Tensor | None = None, group_name: str = ""):
    from csrc_cute.group_gemm import group_gemm_swiglu as swiglu_kernel  # CuTe DSL loads on first CUDA use only

    op = "group_gemm_swiglu"
    remote = None if experts_remote is None else (  # the kernel checks experts_remote with the op's contract
        experts_remote, _weights_cuda(op, "w_gate_home", w_gate_home, experts_remote),
        _weights_cuda(op, "w_up_home", w_up_home, experts_remote))
    h, gate, up = swiglu_kernel(x, w_gate_home, w_gate_slot, w_up_home, w_up_slot, cu_seqlens, pad=P,
                                store_preact=save_preact, remote=remote)
    if not save_preact:
        gate, up = x.new_empty((0, h.shape[1])), x.new_empty((0, h.shape[1]))
    return h, gate, up


@custom_op("moonep::group_gemm_row_scale", mutates_args=(), device_types="cpu")
def group_gemm_row_scale(x: Tensor, w_home: Tensor, w_slot: Tensor, cu_seqlens: Tensor, row_w: Tensor,
                         P: int, experts_remote: Tensor | None = None, group_name: str = "") -> Tensor:
    """y[r] = (x[r] @ W_g) * row_w[r] for r in group g: fp32 accumulation, the fp32 per-row scale (route
    weight, row_w [N] fp32) applied before the single rounding to x's dtype; rows past the last group
    are zero. Remote groups (`experts_remote`, `group_name`) as in group_gemm_swiglu."""
    fake.group_gemm.check_row_scale_args(x, w_home, w_slot, cu_seqlens, row_w, P, experts_remote)
    remote = _remote_home_weights("group_gemm_row_scale", w_home, experts_remote, group_name)
    y = x.new_zeros((x.shape[0], w_home.shape[2]))
    for g, s, e in _group_bounds("group_gemm_row_scale", cu_seqlens, x.shape[0], P):
        y[s:e] = ((x[s:e].float() @ _weight(w_home, w_slot, g, remote).float()) * row_w[s:e, None]).to(x.dtype)
    return y


group_gemm_row_scale.register_fake(fake.group_gemm.group_gemm_row_scale)


@group_gemm_row_scale.register_kernel("cuda")
def _group_gemm_row_scale_cuda(x: Tensor, w_home: Tensor, w_slot: Tensor, cu_seqlens: Tensor, row_w: Tensor,
                               P: int, experts_remote: Tensor | None = None, group_name: str = "") -> Tensor:
    from csrc_cute.group_gemm import group_gemm_row_scale as row_scale_kernel  # CuTe DSL loads on first CUDA use

    remote = None if experts_remote is None else (  # the kernel checks experts_remote with the op's contract
        experts_remote, _weights_cuda("group_gemm_row_scale", "w_home", w_home, experts_remote))
    return row_scale_kernel(x, w_home, w_slot, cu_seqlens, row_w, pad=P, remote=remote)


@custom_op("moonep::group_gemm_swiglu_bwd", mutates_args=(), device_types="cpu")
def group_gemm_swiglu_bwd(g_y: Tensor, w_down_home: Tensor, w_down_slot: Tensor, cu_seqlens: Tensor, row_w: Tensor,
                          gate: Tensor, up: Tensor, P: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Backward of y = group_gemm_row_scale(silu(gate) * up, W_down, row_w) down to the pre-activations.
    With d = g_y @ W_down_g^T (fp32; zero for rows past the last group), s = sigmoid(gate), h = gate*s*up
    from the saved gate/up: returns g_gate = row_w*d*up*s*(1 + gate*(1 - s)), g_up = row_w*d*gate*s,
    h_w = row_w*h (all [N, F] in g_y's dtype; h_w is the down projection's wgrad operand,
    dW_down_g += h_w_g^T g_y_g) and g_row_w = sum_f d*h ([N] fp32, the route weights' gradient)."""
    fake.group_gemm.check_swiglu_bwd_args(g_y, w_down_home, w_down_slot, cu_seqlens, row_w, gate, up, P)
    n, F = gate.shape
    d = torch.zeros(n, F)
    for g, s, e in _group_bounds("group_gemm_swiglu_bwd", cu_seqlens, n, P):
        d[s:e] = g_y[s:e].float() @ _weight(w_down_home, w_down_slot, g).float().t()
    gf, uf, rw = gate.float(), up.float(), row_w[:, None]
    sig = torch.sigmoid(gf)
    h = gf * sig * uf
    gh = d * rw
    g_gate = gh * uf * sig * (1 + gf * (1 - sig))
    return (g_gate.to(g_y.dtype), (gh * gf * sig).to(g_y.dtype), (h * rw).to(g_y.dtype), (d * h).sum(1))


group_gemm_swiglu_bwd.register_fake(fake.group_gemm.group_gemm_swiglu_bwd)


@group_gemm_swiglu_bwd.register_kernel("cuda")
def _group_gemm_swiglu_bwd_cuda(g_y: Tensor, w_down_home: Tensor, w_down_slot: Tensor, cu_seqlens: Tensor,
                                row_w: Tensor, gate: Tensor, up: Tensor, P: int):
    from csrc_cute.group_gemm import group_gemm_swiglu_bwd as bwd_kernel  # CuTe DSL loads on first CUDA use only

    return bwd_kernel(g_y, w_down_home, w_down_slot, cu_seqlens, row_w, gate, up, pad=P)


# ---------------------------------------------------------------------------------- prefetch_weights
@custom_op("moonep::prefetch_weights", mutates_args=("pool_gate", "pool_up", "pool_down", "ctrl"),
           device_types="cpu")
def prefetch_weights(w_gate: Tensor, w_up: Tensor, w_down: Tensor, experts_to_copy: Tensor,
                     pool_gate: Tensor, pool_up: Tensor, pool_down: Tensor, ctrl: Tensor, group_name: str) -> None:
    """Fill this rank's slot pools with the planned copies (gate, up, down) from their home ranks; empty
    slots keep what they held (no GEMM reads them). The pools are shared by every layer: the GEMMs read
    them in place, and a layer's backward prefetches its copies again."""
    group = resolve_group("prefetch_weights", group_name, experts_to_copy.shape[0])

    def check():
        checks.check_prefetch_args(w_gate, w_up, w_down, experts_to_copy, pool_gate, pool_up, pool_down, ctrl)
        check_copies("prefetch_weights", experts_to_copy, w_gate.shape[0])

    agree("prefetch_weights", ctrl, group, check, shared=("experts_to_copy", experts_to_copy))
    epn = w_gate.shape[0]
    mine = experts_to_copy[torch.distributed.get_rank(group)].long()
    used = torch.nonzero(mine >= 0).flatten()
    pulled = pull_many([w_gate, w_up, w_down], mine[used] // epn, mine[used] % epn, group)
    for pool, got in zip((pool_gate, pool_up, pool_down), pulled):
        pool[used] = got


prefetch_weights.register_fake(fake.prefetch_weights.prefetch_weights)


@prefetch_weights.register_kernel("cuda")
def _prefetch_weights_cuda(w_gate, w_up, w_down, experts_to_copy, pool_gate, pool_up, pool_down, ctrl, group_name):
    checks.check_prefetch_args(w_gate, w_up, w_down, experts_to_copy, pool_gate, pool_up, pool_down, ctrl)
    if experts_to_copy.shape[0] == 1:
        return  # one rank: the plan never copies, so there is nothing to move and no peer to wait for
    from csrc_cute import weights  # CuTe DSL loads on first CUDA use only

    ep = group_of("prefetch_weights", ctrl)
    _barrier(ep, ctrl, "prefetch_weights")  # every rank's GEMMs are done with the copies the pools held
    weights.prefetch_push(w_gate, w_up, w_down, experts_to_copy, peers("prefetch_weights", "pool_gate", pool_gate),
                          peers("prefetch_weights", "pool_up", pool_up),
                          peers("prefetch_weights", "pool_down", pool_down), ep.rank, ep.status,
                          num_ctas=ep.comm_sms)
    _barrier(ep, ctrl, "prefetch_weights")  # every copy has landed
    debug_check(ep, "prefetch_weights")


# --------------------------------------------------------------------------------------- reduce_grad
@custom_op("moonep::reduce_grad",
           mutates_args=("reduce_gate", "reduce_up", "reduce_down", "home_gate", "home_up", "home_down", "ctrl"),
           device_types="cpu")
def reduce_grad(experts_to_copy: Tensor, reduce_gate: Tensor, reduce_up: Tensor, reduce_down: Tensor,
                home_gate: Tensor, home_up: Tensor, home_down: Tensor, ctrl: Tensor, group_name: str) -> None:
    """Fold the copies' weight gradients home. The reduce buffers hold, per slot, the fp32 gradient of
    the copy this rank computed (the wgrad GEMMs accumulate into them). The home gradients [epn, ...]
    are in the weights' dtype (bf16 on CUDA; any float dtype here), as wgrad wrote them. For each home
    expert i with copies: home[i] = round(float(home[i]) + copy_d0 + copy_d1 + ...), the copies added in
    fp32 in ascending rank order and rounded once at the end (bitwise deterministic); experts without
    copies are not touched. Then every rank zeroes the slots it used, ready for the next layer or
    micro-batch."""
    reduce_bufs, homes = (reduce_gate, reduce_up, reduce_down), (home_gate, home_up, home_down)
    group = resolve_group("reduce_grad", group_name, experts_to_copy.shape[0])

    def check():
        checks.check_reduce_args(experts_to_copy, reduce_bufs, homes, ctrl)
        check_copies("reduce_grad", experts_to_copy, home_gate.shape[0])

    agree("reduce_grad", ctrl, group, check, shared=("experts_to_copy", experts_to_copy))
    me = torch.distributed.get_rank(group)
    epn = home_gate.shape[0]
    copies = experts_to_copy.long()
    ranks, slots = torch.nonzero((copies >= 0) & (copies // epn == me), as_tuple=True)  # row-major: rank, slot
    for got, home in zip(pull_many(list(reduce_bufs), ranks, slots, group), homes):
        sums: dict[int, Tensor] = {}  # home expert -> fp32 running sum, copies added in rank order
        for i, e in enumerate(copies[ranks, slots].tolist()):
            k = e - me * epn
            if k not in sums:
                sums[k] = home[k].to(torch.float32, copy=True)
            sums[k] += got[i]
        for k, acc in sums.items():
            home[k] = acc  # one rounding to the home dtype
    # `pull` returned only after every peer's read of these buffers was served; now they can be zeroed
    used = torch.nonzero(copies[me] >= 0).flatten()
    for buf in reduce_bufs:
        buf[used] = 0


reduce_grad.register_fake(fake.reduce_grad.reduce_grad)


@reduce_grad.register_kernel("cuda")
def _reduce_grad_cuda(experts_to_copy, reduce_gate, reduce_up, reduce_down, home_gate, home_up, home_down, ctrl,
                      group_name):
    reduce_bufs, homes = (reduce_gate, reduce_up, reduce_down), (home_gate, home_up, home_down)
    checks.check_reduce_args(experts_to_copy, reduce_bufs, homes, ctrl)
    if experts_to_copy.shape[0] == 1:
        return  # one rank: the plan never copies, so no copy has a gradient to fold home
    from csrc_cute import weights  # CuTe DSL loads on first CUDA use only

    ep = group_of("reduce_grad", ctrl)
    _barrier(ep, ctrl, "reduce_grad")  # every rank's wgrad GEMMs have accumulated into its reduce buffers
    weights.reduce_pull(experts_to_copy, *(peers("reduce_grad", n, b) for n, b in
                                           zip(("reduce_gate", "reduce_up", "reduce_down"), reduce_bufs)),
                        *homes, ep.rank, ep.status, num_ctas=ep.comm_sms)
    _barrier(ep, ctrl, "reduce_grad")  # every home rank has read its copies' gradients
    weights.reduce_zero(experts_to_copy, *reduce_bufs, ep.rank, num_ctas=ep.comm_sms)
    debug_check(ep, "reduce_grad")


# ------------------------------------------------------------------------------------- backward ops
# Backward takes no persistent buffer as an argument. AOTAutograd functionalises every mutation in a
# backward graph, and Inductor then clones each mutated buffer and copies it back (whole slot pools,
# receive tables, reduce buffers: gigabytes per layer at DESIGN.md's shape; and a clone of `ctrl` that
# is not the symmetric block would break the barriers). So each autograd Function's backward is one
# op that finds its EPGroup by `ep_key` and runs the forward ops on the group's own buffers inside;
# to the compiler it is functional, and the backward ops of a layer are ordered by their data
# dependencies (combine_backward -> experts_ffn_backward -> dispatch_backward). docs/design-notes.md.
@custom_op("moonep::combine_backward", mutates_args=())
def combine_backward(g_out: Tensor, dst_rank: Tensor, dst_row: Tensor, primary_row: Tensor, cu_seqlens: Tensor,
                     group_rows: Tensor, ep_key: str) -> Tensor:
    """Gradient of combine: the token gradients [S, H] dispatched to the rows [NvS, H] (unit weights)."""
    checks.check_combine_backward_args(g_out, dst_rank, dst_row, primary_row, cu_seqlens, group_rows, ep_key)
    ep = group_by_key("combine_backward", ep_key)
    return _dispatch_rows(ep, g_out, dst_rank, dst_row, primary_row, cu_seqlens, group_rows)


def _dispatch_rows(ep, tokens: Tensor, dst_rank: Tensor, dst_row: Tensor, primary_row: Tensor, cu_seqlens: Tensor,
                   group_rows: Tensor) -> Tensor:
    """A dispatch of token rows [S, H] on the group's buffers -> rows [NvS, H]: combine's backward (of the
    token gradients) and the recomputed rows of EPGroup(recompute_rows) (of the tokens)."""
    unit_w = torch.ones(dst_rank.shape, dtype=torch.float32, device=tokens.device)
    return dispatch(tokens, unit_w, dst_rank, dst_row, primary_row, cu_seqlens, group_rows, *ep.dispatch_buffers,
                    ep.ctrl, ep.group_name)[0]


combine_backward.register_fake(fake.backward.combine_backward)


@custom_op("moonep::dispatch_backward", mutates_args=())
def dispatch_backward(g_rows: Tensor, g_row_w: Tensor, row_primary: Tensor, row_next: Tensor, dst_rank: Tensor,
                      dst_row: Tensor, primary_row: Tensor, ep_key: str) -> tuple[Tensor, Tensor]:
    """Gradient of dispatch: (token gradients [S, H] = combine of the row gradients, route-weight
    gradients [S, K] = the per-row values read back)."""
    checks.check_dispatch_backward_args(g_rows, g_row_w, row_primary, row_next, dst_rank, dst_row, primary_row,
                                        ep_key)
    ep = group_by_key("dispatch_backward", ep_key)
    gx = combine(g_rows, row_primary, row_next, dst_rank, dst_row, primary_row, ep.presum, ep.ctrl, ep.group_name)
    g_route_w = gather_row_weights(g_row_w, dst_rank, dst_row, ep.row_scratch, ep.ctrl, ep.group_name)
    return gx, g_route_w


dispatch_backward.register_fake(fake.backward.dispatch_backward)


def gemm_groups(cu_seqlens: Tensor, experts_remote: Tensor | None, copies: bool, epn: int
                ) -> tuple[Tensor, Tensor | None]:
    """The groups the experts' GEMMs see: the plan's (home, slot and remote groups) when the EP group has
    copy buffers, else (R = 1 on CUDA: no slot pools, moonep_ops/buffers.py) the epn home groups alone.
    A 1-rank plan copies nothing and reads nothing remotely, so its slot and remote groups are empty and
    end where the home groups end: every M tile of a row GEMM lies in the same home group, or past the
    last group, either way, and wgrad's home work items are the same; no output bit changes."""
    if copies:
        return cu_seqlens, experts_remote
    return cu_seqlens[:epn], None


@custom_op("moonep::experts_ffn_backward", mutates_args=())
def experts_ffn_backward(g_y: Tensor, rows: Tensor, row_w: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
                         cu_seqlens: Tensor, experts_to_copy: Tensor, gate: Tensor, up: Tensor, P: int,
                         ep_key: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradient of one layer's SwiGLU experts (forward: h = silu(rows W_gate) * (rows W_up), then
    y = route_w * (h W_down), with the copies in the slot pools; `gate`/`up` are the saved
    pre-activations): (g_rows, g_row_w, dw_gate, dw_up, dw_down). `_experts_backward` says how."""
    checks.check_experts_ffn_backward_args(g_y, rows, row_w, w_gate, w_up, w_down, cu_seqlens, experts_to_copy,
                                           gate, up, ep_key)
    ep = group_by_key("experts_ffn_backward", ep_key)
    return _experts_backward(ep, lambda: g_y, lambda: rows, row_w, w_gate, w_up, w_down, cu_seqlens, experts_to_copy,
                             gate, up, P)


experts_ffn_backward.register_fake(fake.backward.experts_ffn_backward)


@custom_op("moonep::experts_combine_backward", mutates_args=())
def experts_combine_backward(g_out: Tensor, dst_rank: Tensor, dst_row: Tensor, primary_row: Tensor,
                             group_rows: Tensor, rows: Tensor | None, tokens: Tensor | None, row_w: Tensor,
                             w_gate: Tensor, w_up: Tensor, w_down: Tensor, cu_seqlens: Tensor, experts_to_copy: Tensor,
                             gate: Tensor, up: Tensor, P: int, ep_key: str
                             ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradient of the experts and the combine after them (one autograd Function, moonep_ops/autograd.py):
    the token gradients g_out [S, H] -> (g_rows, g_row_w, dw_gate, dw_up, dw_down), as combine_backward
    then experts_ffn_backward. The row gradients g_y [NvS, H] between them live inside this op only, so
    they are freed once the down-projection GEMMs have read them and g_rows takes their memory: one
    [NvS, H] less at the step's peak (1.1 GB at the DESIGN shape) than the two ops in a row. Exactly one
    of `rows` (the dispatched rows the forward kept) and `tokens` (the dispatched tokens [S, H]: the rows
    are dispatched again, into g_y's memory; EPGroup(recompute_rows)) is given."""
    checks.check_experts_combine_backward_args(g_out, dst_rank, dst_row, primary_row, group_rows, rows, tokens,
                                               row_w, w_gate, w_up, w_down, cu_seqlens, experts_to_copy, gate, up,
                                               ep_key)
    ep = group_by_key("experts_combine_backward", ep_key)
    tables = (dst_rank, dst_row, primary_row, cu_seqlens, group_rows)
    return _experts_backward(ep, lambda: _dispatch_rows(ep, g_out, *tables),
                             (lambda: rows) if tokens is None else (lambda: _dispatch_rows(ep, tokens, *tables)),
                             row_w, w_gate, w_up, w_down, cu_seqlens, experts_to_copy, gate, up, P,
                             recomputed=tokens is not None)


experts_combine_backward.register_fake(fake.backward.experts_combine_backward)


def _experts_backward(ep, make_g_y, make_rows, row_w: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
                      cu_seqlens: Tensor, experts_to_copy: Tensor, gate: Tensor, up: Tensor, P: int,
                      recomputed: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The experts' backward, with the row gradients g_y [NvS, H] from `make_g_y()` and the dispatched rows
    from `make_rows()`: a g_y made there (the combine's backward) is owned here and dropped after its last
    GEMM; `recomputed` rows (dispatched again) are made after that, into g_y's memory, and dropped after
    the gate/up wgrads, before the dgrad makes g_rows. The pools hold another layer's copies by now, so
    this prefetches the layer's copies again; the down-projection dgrad carries the SwiGLU backward and
    the route-weight gradient in its epilogue; the wgrad GEMMs write the home experts' gradients in the
    weights' dtype and accumulate the copies' gradients into the fp32 reduce buffers, and `reduce_grad`
    adds those to the home gradients (one more rounding for experts with copies). A group without copy
    buffers (R = 1 on CUDA) has no copies to prefetch or reduce: its GEMMs get the home groups alone
    (`gemm_groups`)."""
    g_y = make_g_y()  # first: the collectives run in the order of the two separate backward ops
    copies = ep.layout.copies
    pool_gate, pool_up, pool_down = ep.pools
    reduce_gate, reduce_up, reduce_down = ep.reduce_buffers
    if copies:
        prefetch_weights(w_gate, w_up, w_down, experts_to_copy, pool_gate, pool_up, pool_down, ep.ctrl,
                         ep.group_name)
    cu, _ = gemm_groups(cu_seqlens, None, copies, ep.cfg.epn)
    g_gate, g_up, h_w, g_row_w = group_gemm_swiglu_bwd(g_y, w_down, pool_down, cu, row_w, gate, up, P)
    # the home gradients in the weights' dtype: wgrad writes every home expert's (zeros for an expert
    # without rows), reduce_grad adds the copies' fp32 gradients to those with copies (docs/design-notes.md).
    # Each is allocated right before its wgrad, and each operand is dropped after the last GEMM that reads
    # it, so the caching allocator reuses that memory within this backward (a lower peak; the same kernels
    # on the same inputs)
    dw_down = torch.empty_like(w_down)
    group_gemm_wgrad(h_w, g_y, cu, dw_down, reduce_down, P)
    del h_w, g_y
    # recomputed rows take g_y's memory and are dropped before dgrad2 makes g_rows; kept rows are there anyway,
    # so dgrad2 runs first and each [NvS, F] gradient is dropped after its wgrad
    if recomputed:
        rows = make_rows()
        dw_gate = torch.empty_like(w_gate)
        group_gemm_wgrad(rows, g_gate, cu, dw_gate, reduce_gate, P)
        dw_up = torch.empty_like(w_up)
        group_gemm_wgrad(rows, g_up, cu, dw_up, reduce_up, P)
        del rows
    # both halves of the input gradient in one GEMM: one fp32 accumulator, one rounding, one [NvS, H]
    g_rows = group_gemm_dgrad2(g_gate, w_gate, pool_gate, g_up, w_up, pool_up, cu, P)
    if not recomputed:
        rows = make_rows()
        dw_gate = torch.empty_like(w_gate)
        group_gemm_wgrad(rows, g_gate, cu, dw_gate, reduce_gate, P)
        del g_gate  # before dw_up is allocated: a lower peak
        dw_up = torch.empty_like(w_up)
        group_gemm_wgrad(rows, g_up, cu, dw_up, reduce_up, P)
    del g_up
    if copies:
        reduce_grad(experts_to_copy, reduce_gate, reduce_up, reduce_down, dw_gate, dw_up, dw_down, ep.ctrl,
                    ep.group_name)
    return g_rows, g_row_w, dw_gate, dw_up, dw_down
