"""Dispatch / combine data-movement kernels (csrc_cute/dispatch.py, csrc_cute/combine.py).

CPU (CI): every kernel compiles for sm_90a (no GPU needed), ptxas reports registers and no spills;
host-side validation errors.
GPU (skipped without CUDA): R in {1, 2, 4} ranks simulated on one GPU (per-rank ordinary tensors and
peer address tables), plans from the CPU reference `moonep_ops.planning`; dispatch_meta on every rank,
then dispatch_pull on every rank, compared bit for bit with an independent torch reimplementation
(rows carry their token and source rank exactly in bf16); combine_presum + combine_pull against fp32
torch sums (exact with small integers); gather_pull exact; skewed routings and K duplicates on one
rank; rows crossing the link per token <= min(K, R); CUDA-graph capture + replay; broken plan
entries; opt-in timing at the benchmark shape (MOONEP_BENCH_COMM=1) with a tuning sweep.
"""

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from canaries import Canaries  # noqa: E402
from kernel_compile import check_module_compiles  # noqa: E402
from moonep_ops import planning  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
DEV = "cuda"

GARBAGE_ROW = 99.0      # receive / output buffers start with this (never a real value)
GARBAGE_W = -7.0
GARBAGE_I = -99


# ------------------------------------------------------------------------------------------------
# (a) CPU: compile for sm_90a, ptxas statistics
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("module,kernels", [
    ("dispatch", ("_meta_kernel", "_pull_kernel")),
    ("combine", ("_presum_kernel", "_pull_kernel", "_gather_kernel")),
])
def test_comm_kernels_compile_sm90a(module, kernels):
    import importlib

    configs = importlib.import_module(f"csrc_cute.{module}").DEFAULT_CHECK_CONFIGS
    # combine: each R = 1 config also compiles the one-pass pull of combine_local
    extra = {"_pull_kernel": sum(c["R"] == 1 for c in configs)} if module == "combine" else {}
    check_module_compiles(f"csrc_cute.{module}:compile_all_for_check", kernels, len(configs),
                          files_per_config=len(kernels), extra=extra)


def test_host_validation_errors():
    from csrc_cute import combine as C
    from csrc_cute import dispatch as D

    i32, i64, f32, bf = torch.int32, torch.int64, torch.float32, torch.bfloat16
    S, K, H, R, N, G = 4, 2, 64, 2, 32, 3

    def meta_args(**over):
        a = dict(x=torch.zeros(S, H, dtype=bf), route_w=torch.zeros(S, K, dtype=f32),
                 dst_rank=torch.zeros(S, K, dtype=i32), dst_row=torch.zeros(S, K, dtype=i32),
                 primary_row=torch.zeros(S, K, dtype=i32), peer_w=torch.zeros(R, dtype=i64),
                 peer_primary=torch.zeros(R, dtype=i64), peer_next=torch.zeros(R, dtype=i64),
                 peer_src=torch.zeros(R, dtype=i64), recv_w=torch.zeros(N, dtype=f32),
                 recv_primary=torch.zeros(N, dtype=i32), recv_next=torch.zeros(N, dtype=i32),
                 recv_src=torch.zeros(N, dtype=i32), send_rows=torch.zeros(S, H, dtype=bf),
                 cu_seqlens=torch.zeros(G, dtype=i32), group_rows=torch.zeros(G, dtype=i32), rank=0,
                 status=torch.zeros(1, dtype=i32))
        a.update(over)
        return a

    def pull_args(**over):
        a = dict(peer_send_rows=torch.zeros(R, dtype=i64), recv_w=torch.zeros(N, dtype=f32),
                 recv_primary=torch.zeros(N, dtype=i32), recv_next=torch.zeros(N, dtype=i32),
                 recv_src=torch.zeros(N, dtype=i32), out_rows=torch.zeros(N, H, dtype=bf),
                 out_w=torch.zeros(N, dtype=f32), out_primary=torch.zeros(N, dtype=i32),
                 out_next=torch.zeros(N, dtype=i32), S=S, status=torch.zeros(1, dtype=i32))
        a.update(over)
        return a

    # combine_pull / gather_pull without nvs use a row bound that must pass the int32 checks
    D.check_fits(S, K, C._NO_NVS)
    with pytest.raises(ValueError, match="must fit int32"):
        D.check_fits(S, K, 2 ** 31)
    # CPU-only checks (caught before any device check)
    with pytest.raises(ValueError, match="x must have dtype"):
        D.dispatch_meta(**meta_args(x=torch.zeros(S, H, dtype=i32)))
    with pytest.raises(ValueError, match="x: a row must be a positive multiple of 16 bytes"):
        D.dispatch_meta(**meta_args(x=torch.zeros(S, 4, dtype=bf)))
    with pytest.raises(ValueError, match="x must be on a CUDA device"):
        D.dispatch_meta(**meta_args())
    with pytest.raises(ValueError, match="out_rows must have dtype"):
        D.dispatch_pull(**pull_args(out_rows=torch.zeros(N, H, dtype=i64)))
    with pytest.raises(ValueError, match="out_rows must be on a CUDA device"):
        D.dispatch_pull(**pull_args())
    with pytest.raises(ValueError, match="rows must have dtype"):
        C.combine_presum(torch.zeros(N, H, dtype=i32), torch.zeros(N, dtype=i32),
                         torch.zeros(N, dtype=i32), torch.zeros(N, H, dtype=i32), torch.zeros(1, dtype=i32))
    with pytest.raises(ValueError, match="out must be 2-D"):
        C.combine_pull(torch.zeros(R, dtype=i64), torch.zeros(S, K, dtype=i32),
                       torch.zeros(S, K, dtype=i32), torch.zeros(S, K, dtype=i32),
                       torch.zeros(S * H, dtype=bf), torch.zeros(1, dtype=i32))
    with pytest.raises(ValueError, match="dst_rank must have dtype"):
        C.gather_pull(torch.zeros(R, dtype=i64), torch.zeros(S, K, dtype=i64),
                      torch.zeros(S, K, dtype=i32), torch.zeros(S, K, dtype=f32), torch.zeros(1, dtype=i32))
    plan = [torch.zeros(S, K, dtype=i32) for _ in range(3)]
    with pytest.raises(ValueError, match="out must have dtype"):
        C.combine_local(torch.zeros(N, H, dtype=bf), *plan, torch.zeros(S, H, dtype=i32), torch.zeros(1, dtype=i32))
    if not HAS_CUDA:
        return
    with pytest.raises(ValueError, match="rows must have dtype"):
        C.combine_local(torch.zeros(N, H, dtype=f32, device=DEV), *(t.to(DEV) for t in plan),
                        torch.zeros(S, H, dtype=bf, device=DEV), torch.zeros(1, dtype=i32, device=DEV))
    with pytest.raises(ValueError, match="combine_local: rows has 72 columns, out 64"):
        C.combine_local(torch.zeros(N, 72, dtype=bf, device=DEV), *(t.to(DEV) for t in plan),
                        torch.zeros(S, H, dtype=bf, device=DEV), torch.zeros(1, dtype=i32, device=DEV))
    a = {k: (v.to(DEV) if isinstance(v, torch.Tensor) else v) for k, v in meta_args().items()}
    q = {k: (v.to(DEV) if isinstance(v, torch.Tensor) else v) for k, v in pull_args().items()}
    cuda = lambda *shape, dtype: torch.zeros(*shape, dtype=dtype, device=DEV)  # noqa: E731
    with pytest.raises(ValueError, match="dst_row must have dtype"):
        D.dispatch_meta(**dict(a, dst_row=cuda(S, K, dtype=i64)))
    with pytest.raises(ValueError, match=r"primary_row must have shape \[4, 2\]"):
        D.dispatch_meta(**dict(a, primary_row=cuda(S, K + 1, dtype=i32)))
    with pytest.raises(ValueError, match="K must be <= 32"):
        D.dispatch_meta(**dict(a, dst_rank=cuda(S, 33, dtype=i32)))
    with pytest.raises(ValueError, match="rank must be in"):
        D.dispatch_meta(**dict(a, rank=R))
    with pytest.raises(ValueError, match="send_rows must have shape"):
        D.dispatch_meta(**dict(a, send_rows=cuda(S, H + 8, dtype=bf)))
    with pytest.raises(ValueError, match="send_rows must have dtype"):
        D.dispatch_meta(**dict(a, send_rows=cuda(S, H, dtype=f32)))
    with pytest.raises(ValueError, match="recv_src must have shape"):
        D.dispatch_meta(**dict(a, recv_src=cuda(N + 1, dtype=i32)))
    with pytest.raises(ValueError, match="peer_src must have shape"):
        D.dispatch_meta(**dict(a, peer_src=cuda(R + 1, dtype=i64)))
    with pytest.raises(ValueError, match="group_rows must have shape"):
        D.dispatch_meta(**dict(a, group_rows=cuda(G + 1, dtype=i32)))
    with pytest.raises(ValueError, match="num_ctas must be >= 1"):
        D.dispatch_meta(**dict(a, num_ctas=0))
    with pytest.raises(ValueError, match="status must hold exactly 1 int32 element"):
        D.dispatch_meta(**dict(a, status=cuda(2, dtype=i32)))
    with pytest.raises(ValueError, match="status must have dtype"):
        D.dispatch_pull(**dict(q, status=cuda(1, dtype=i64)))
    with pytest.raises(ValueError, match="out_rows must be contiguous"):
        D.dispatch_pull(**dict(q, out_rows=cuda(H, N, dtype=bf).t()))
    with pytest.raises(ValueError, match="recv_src must have dtype"):
        D.dispatch_pull(**dict(q, recv_src=cuda(N, dtype=i64)))
    with pytest.raises(ValueError, match="out_next must have shape"):
        D.dispatch_pull(**dict(q, out_next=cuda(N - 1, dtype=i32)))
    with pytest.raises(ValueError, match="peer_send_rows must have dtype"):
        D.dispatch_pull(**dict(q, peer_send_rows=cuda(R, dtype=i32)))
    with pytest.raises(ValueError, match="S must be >= 1"):
        D.dispatch_pull(**dict(q, S=0))
    one_rank = dict(q, peer_send_rows=cuda(1, dtype=i64))
    with pytest.raises(ValueError, match="with R = 1 the rows are read from x"):
        D.dispatch_pull(**one_rank)
    with pytest.raises(ValueError, match="x must have shape"):
        D.dispatch_pull(**dict(one_rank, x=cuda(S + 1, H, dtype=bf)))
    with pytest.raises(ValueError, match="out must have dtype"):
        C.gather_pull(cuda(R, dtype=i64), cuda(S, K, dtype=i32), cuda(S, K, dtype=i32),
                      cuda(S, K, dtype=bf), cuda(1, dtype=i32))
    with pytest.raises(ValueError, match="row_next must have shape"):
        C.combine_presum(cuda(N, H, dtype=bf), cuda(N, dtype=i32), cuda(N + 1, dtype=i32),
                         cuda(N, H, dtype=bf), cuda(1, dtype=i32))


# ------------------------------------------------------------------------------------------------
# single-GPU simulation of R ranks: plans, inputs, references
# ------------------------------------------------------------------------------------------------
def align_up(n, p):
    return (n + p - 1) // p * p


def peer_table(ts):
    """int64 [R] of the buffers' device addresses (what symmetric memory's buffer_ptrs gives)."""
    return torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device=ts[0].device)


def make_ids(kind, R, S, K, E, gen):
    """Routing ids int64 [R, S, K] on the CPU."""
    epn = E // R
    if kind == "random":          # K distinct experts per token
        return torch.rand(R, S, E, generator=gen).argsort(-1)[..., :K].contiguous()
    if kind == "dupes":           # with replacement: the same expert may repeat in a token
        return torch.randint(0, E, (R, S, K), generator=gen)
    if kind == "one-expert":      # every token, every k: one expert
        return torch.full((R, S, K), int(torch.randint(0, E, (1,), generator=gen)), dtype=torch.long)
    if kind == "one-rank":        # all K experts of every token in one home group (rank duplicates)
        d0 = int(torch.randint(0, R, (1,), generator=gen))
        if K <= epn:
            loc = torch.rand(R, S, epn, generator=gen).argsort(-1)[..., :K]
        else:
            loc = torch.randint(0, epn, (R, S, K), generator=gen)
        return (loc + d0 * epn).contiguous()
    if kind == "skew":            # lognormal popularity, K distinct
        pop = torch.randn(E, generator=gen, dtype=torch.float64) * 2.5
        u = torch.rand(R, S, E, generator=gen, dtype=torch.float64).clamp(1e-12, 1 - 1e-12)
        g = -torch.log(-torch.log(u))
        return torch.topk(pop + g, K, dim=-1).indices.contiguous()
    if kind == "absent":          # ranks route 0, 1, S or a random number of tokens; the rest absent (-1)
        keep = [0, 1, S, int(torch.randint(0, S + 1, (1,), generator=gen))]
        ids = make_ids("random", R, S, K, E, gen)
        for r in range(R):
            ids[r, keep[r % 4]:] = -1
        return ids
    raise ValueError(kind)


class Case:
    """One routing on R simulated ranks: the CPU plan and the per-rank tables."""

    def __init__(self, R, S, K, E, B, P, ids):
        self.R, self.S, self.K, self.E, self.B, self.P = R, S, K, E, B, P
        self.epn = E // R
        self.G = self.epn + B
        self.NVS = align_up(S * K + (P - 1) * self.G, P)
        counts = torch.stack([planning.count_routed(ids[r], E) for r in range(R)])
        self.plan = planning.plan_global(counts, S, K, B, P)
        self.tok = [planning.plan_tokens(ids[r], counts, self.plan, r) for r in range(R)]
        alloc, e2c = self.plan.alloc.long(), self.plan.experts_to_copy.long()
        self.group_rows = []
        for d in range(R):
            gr = [int(alloc[d * self.epn + g, d]) for g in range(self.epn)]
            gr += [int(alloc[int(e), d]) if int(e) >= 0 else 0 for e in e2c[d]]
            self.group_rows.append(torch.tensor(gr, dtype=torch.int32))
        self.cu = [self.plan.cu_seqlens[d].clone() for d in range(R)]
        # real-row mask of each rank (independent of the plan tables)
        self.real = []
        for d in range(R):
            m = torch.zeros(self.NVS, dtype=torch.bool)
            start = 0
            for g in range(self.G):
                m[start:start + int(self.group_rows[d][g])] = True
                start = int(self.cu[d][g])
            self.real.append(m)

    def next_rows(self, r):
        """next[s, k]: dst_row of the next k' > k of the token with the same dst_rank, else -1."""
        t = self.tok[r]
        nxt = torch.full((self.S, self.K), -1, dtype=torch.int32)
        for k in range(self.K):
            for k2 in range(self.K - 1, k, -1):
                same = t.dst_rank[:, k2] == t.dst_rank[:, k]
                nxt[:, k] = torch.where(same, t.dst_row[:, k2], nxt[:, k])
        return nxt


def token_rows(src, S, H, dtype, salt=0):
    """Row of token s of rank src: small integers in [-16, 16] (exact in bf16), a per-(src, s, salt)
    pattern (rows of different tokens differ with overwhelming probability)."""
    g = torch.Generator().manual_seed(1000 * src + 7 + 7919 * salt)
    return torch.randint(-16, 17, (S, H), generator=g).to(dtype)


def dispatch_reference(case, xs, ws):
    """Independent torch reimplementation: per rank (rows, w, primary, next, src, carrier mask);
    src[r] = source rank * S + token for every real row, -1 for padding."""
    R, N = case.R, case.NVS
    H = xs[0].shape[1]
    out = []
    for d in range(R):
        rows = torch.zeros(N, H, dtype=xs[0].dtype)
        w = torch.zeros(N, dtype=torch.float32)
        pr = torch.full((N,), -1, dtype=torch.int32)
        nx = torch.full((N,), -1, dtype=torch.int32)
        sv = torch.full((N,), -1, dtype=torch.int32)
        hits = torch.zeros(N, dtype=torch.int32)
        carrier = torch.zeros(N, dtype=torch.bool)
        for src in range(R):
            t = case.tok[src]
            m = t.dst_rank == d
            r = t.dst_row[m].long()
            s = torch.arange(case.S)[:, None].expand(case.S, case.K)[m]
            rows[r] = xs[src][s]
            w[r] = ws[src][m]
            pr[r] = t.primary_row[m]
            nx[r] = case.next_rows(src)[m]
            sv[r] = (src * case.S + s).int()
            hits.index_add_(0, r, torch.ones_like(r, dtype=torch.int32))
            carrier[r] = (t.dst_row == t.primary_row)[m]
        # the plan covers exactly the real rows, each once
        assert torch.equal(hits > 0, case.real[d]) and int(hits.max()) <= 1
        out.append((rows, w, pr, nx, sv, carrier))
    return out


def combine_reference(case, ys, primaries, nexts):
    """(presum per rank (head rows only, others None-masked), out per rank) with the kernels' exact
    summation order: chain order in fp32, rounded; then carriers in k order in fp32, rounded."""
    R = case.R
    presums, heads = [], []
    for d in range(R):
        y = ys[d].float()
        pr, nx = primaries[d].long(), nexts[d].long()
        head = pr == torch.arange(case.NVS)
        acc = torch.zeros_like(y)
        cur = torch.where(head, torch.arange(case.NVS), torch.full_like(pr, -1))
        for _ in range(32):
            on = cur >= 0
            if not bool(on.any()):
                break
            acc[on] += y[cur[on]]
            cur = torch.where(on, nx[cur.clamp(min=0)], cur)
        presums.append(acc.to(ys[d].dtype))
        heads.append(head)
    outs = []
    for src in range(R):
        t = case.tok[src]
        acc = torch.zeros(case.S, ys[0].shape[1], dtype=torch.float32)
        for k in range(case.K):
            c = t.dst_row[:, k] == t.primary_row[:, k]
            for d in range(R):
                m = c & (t.dst_rank[:, k] == d)
                acc[m] += presums[d][t.dst_row[m, k].long()].float()
        outs.append(acc.to(ys[0].dtype))
    return presums, heads, outs


class Sim:
    """Per-rank device buffers of one case and the kernel calls on all ranks."""

    def __init__(self, case, H, dtype, num_ctas, canaries=None):
        """`canaries`: a Canaries that allocates every buffer the kernels write (default: plain tensors)."""
        self.c, self.H, self.dtype, self.ncta = case, H, dtype, num_ctas
        R, N, S, K = case.R, case.NVS, case.S, case.K
        dev = DEV
        empty = torch.empty
        if canaries is not None:
            empty = lambda *shape, dtype, device: canaries.empty(shape, dtype, device)  # noqa: E731
        self.status = [torch.zeros(1, dtype=torch.int32, device=dev) for _ in range(R)]
        self.x = [torch.empty(S, H, dtype=dtype, device=dev) for _ in range(R)]
        self.w = [torch.empty(S, K, dtype=torch.float32, device=dev) for _ in range(R)]
        self.dst_rank = [case.tok[r].dst_rank.to(dev).contiguous() for r in range(R)]
        self.dst_row = [case.tok[r].dst_row.to(dev).contiguous() for r in range(R)]
        self.primary = [case.tok[r].primary_row.to(dev).contiguous() for r in range(R)]
        self.cu = [case.cu[r].to(dev) for r in range(R)]
        self.grows = [case.group_rows[r].to(dev) for r in range(R)]
        self.send_rows = [empty(S, H, dtype=dtype, device=dev) for _ in range(R)]
        self.recv_w = [empty(N, dtype=torch.float32, device=dev) for _ in range(R)]
        self.recv_pr = [empty(N, dtype=torch.int32, device=dev) for _ in range(R)]
        self.recv_nx = [empty(N, dtype=torch.int32, device=dev) for _ in range(R)]
        self.recv_src = [empty(N, dtype=torch.int32, device=dev) for _ in range(R)]
        self.out_rows = [empty(N, H, dtype=dtype, device=dev) for _ in range(R)]
        self.out_w = [empty(N, dtype=torch.float32, device=dev) for _ in range(R)]
        self.out_pr = [empty(N, dtype=torch.int32, device=dev) for _ in range(R)]
        self.out_nx = [empty(N, dtype=torch.int32, device=dev) for _ in range(R)]
        self.y = [torch.empty(N, H, dtype=dtype, device=dev) for _ in range(R)]
        self.presum = [empty(N, H, dtype=dtype, device=dev) for _ in range(R)]
        self.comb = [empty(S, H, dtype=dtype, device=dev) for _ in range(R)]
        self.vals = [torch.empty(N, dtype=torch.float32, device=dev) for _ in range(R)]
        self.gath = [empty(S, K, dtype=torch.float32, device=dev) for _ in range(R)]
        self.p_send, self.p_w = peer_table(self.send_rows), peer_table(self.recv_w)
        self.p_pr, self.p_nx = peer_table(self.recv_pr), peer_table(self.recv_nx)
        self.p_src = peer_table(self.recv_src)
        self.p_presum, self.p_vals = peer_table(self.presum), peer_table(self.vals)
        self.poison()

    def poison(self):
        for lst, v in ((self.send_rows, GARBAGE_ROW), (self.recv_w, GARBAGE_W), (self.recv_pr, GARBAGE_I),
                       (self.recv_nx, GARBAGE_I), (self.recv_src, GARBAGE_I), (self.out_rows, GARBAGE_ROW),
                       (self.out_w, GARBAGE_W), (self.out_pr, GARBAGE_I), (self.out_nx, GARBAGE_I),
                       (self.presum, GARBAGE_ROW), (self.comb, GARBAGE_ROW), (self.gath, GARBAGE_W)):
            for t in lst:
                t.fill_(v)

    def set_inputs(self, salt):
        c = self.c
        for r in range(c.R):
            self.x[r].copy_(token_rows(r, c.S, self.H, self.dtype, salt))
            g = torch.Generator().manual_seed(31 * r + salt)
            self.w[r].copy_(torch.rand(c.S, c.K, generator=g))

    def set_expert_outputs(self, salt, exact):
        c = self.c
        for d in range(c.R):
            g = torch.Generator().manual_seed(97 * d + salt)
            if exact:
                y = torch.randint(-4, 5, (c.NVS, self.H), generator=g).float()
            else:
                y = torch.randn(c.NVS, self.H, generator=g) * 3
            y[~c.real[d]] = 55.0  # padding rows must never be summed
            self.y[d].copy_(y.to(self.dtype))
            self.vals[d].copy_(torch.randn(c.NVS, generator=g))

    def meta(self):
        from csrc_cute.dispatch import dispatch_meta

        for r in range(self.c.R):
            dispatch_meta(self.x[r], self.w[r], self.dst_rank[r], self.dst_row[r], self.primary[r],
                          self.p_w, self.p_pr, self.p_nx, self.p_src, self.recv_w[r], self.recv_pr[r],
                          self.recv_nx[r], self.recv_src[r], self.send_rows[r], self.cu[r], self.grows[r],
                          r, self.status[r], self.ncta)

    def pull(self):
        from csrc_cute.dispatch import dispatch_pull

        for r in range(self.c.R):
            dispatch_pull(self.p_send, self.recv_w[r], self.recv_pr[r], self.recv_nx[r], self.recv_src[r],
                          self.out_rows[r], self.out_w[r], self.out_pr[r], self.out_nx[r], self.c.S,
                          self.status[r], self.ncta, x=self.x[r])  # read at R = 1 (nothing staged)

    def presum_all(self):
        from csrc_cute.combine import combine_presum

        for d in range(self.c.R):
            combine_presum(self.y[d], self.out_pr[d], self.out_nx[d], self.presum[d], self.status[d], self.ncta)

    def combine_pull_all(self):
        from csrc_cute.combine import combine_pull

        for r in range(self.c.R):
            combine_pull(self.p_presum, self.dst_rank[r], self.dst_row[r], self.primary[r], self.comb[r],
                         self.status[r], self.ncta, nvs=self.c.NVS)

    def combine_local(self):
        """R = 1: the one-pass combine (combine_local) into comb[0]; nothing else is written."""
        from csrc_cute.combine import combine_local

        assert self.c.R == 1
        combine_local(self.y[0], self.dst_rank[0], self.dst_row[0], self.primary[0], self.comb[0], self.status[0],
                      self.ncta)

    def gather_all(self):
        from csrc_cute.combine import gather_pull

        for r in range(self.c.R):
            gather_pull(self.p_vals, self.dst_rank[r], self.dst_row[r], self.gath[r], self.status[r], self.ncta,
                        nvs=self.c.NVS)

    def combine(self):
        self.presum_all()
        self.combine_pull_all()
        self.gather_all()

    def status_words(self):
        """Every rank's status word (a host sync)."""
        return [int(t) for t in self.status]

    # ---- checks -------------------------------------------------------------------------------
    def check_meta(self, ref):
        """After meta only: complete metadata on every rank, send_rows = x, no output written."""
        for d in range(self.c.R):
            _, w, pr, nx, sv, _ = ref[d]
            _eq(self.recv_w[d].cpu(), w, f"rank {d} w")
            _eq(self.recv_pr[d].cpu(), pr, f"rank {d} primary")
            _eq(self.recv_nx[d].cpu(), nx, f"rank {d} next")
            _eq(self.recv_src[d].cpu(), sv, f"rank {d} src")
            staged = self.x[d].cpu() if self.c.R > 1 else torch.full_like(self.x[d].cpu(), GARBAGE_ROW)
            _eq(self.send_rows[d].cpu(), staged, f"rank {d} send_rows (R = 1: nothing staged)")
            got = self.out_rows[d].cpu()
            _eq(got, torch.full_like(got, GARBAGE_ROW), f"rank {d} out rows untouched by meta")

    def check_pull(self, ref):
        for d in range(self.c.R):
            rows, w, pr, nx, _, _ = ref[d]
            _eq(self.out_rows[d].cpu(), rows, f"rank {d} out rows")
            _eq(self.out_w[d].cpu(), w, f"rank {d} out w")
            _eq(self.out_pr[d].cpu(), pr, f"rank {d} out primary")
            _eq(self.out_nx[d].cpu(), nx, f"rank {d} out next")

    def check_combine(self, exact):
        c = self.c
        ys = [t.cpu() for t in self.y]
        ref_pr = [t.cpu() for t in self.out_pr]
        ref_nx = [t.cpu() for t in self.out_nx]
        presums, heads, outs = combine_reference(c, ys, ref_pr, ref_nx)
        for d in range(c.R):
            got = self.presum[d].cpu()
            _eq(got[heads[d]], presums[d][heads[d]], f"rank {d} presum heads")
            _eq(got[~heads[d]], torch.full_like(got[~heads[d]], GARBAGE_ROW),
                f"rank {d} presum others untouched")
        for r in range(c.R):
            got = self.comb[r].cpu()
            _eq(got, outs[r], f"rank {r} combine (kernel summation order)")
            # plain fp32 sum over all k, rounded once
            t = c.tok[r]
            acc = torch.zeros(c.S, self.H)
            absum = torch.zeros(c.S, self.H)
            for k in range(c.K):
                for d in range(c.R):
                    m = t.dst_rank[:, k] == d
                    term = ys[d][t.dst_row[m, k].long()].float()
                    acc[m] += term
                    absum[m] += term.abs()
            if exact:
                _eq(got, acc.to(self.dtype), f"rank {r} combine (exact integer sums)")
            else:
                # rounding of the presums and of the result: at most (K + 1) ulps of the sum of |terms|
                diff = (got.float() - acc).abs()
                tol = (c.K + 1) * _ulp(absum, self.dtype)
                assert bool((diff <= tol).all()), f"rank {r} combine: max diff {float(diff.max())}"
            vals = torch.zeros(c.S, c.K)
            for d in range(c.R):
                m = t.dst_rank == d
                vals[m] = self.vals[d].cpu()[t.dst_row[m].long()]
            _eq(self.gath[r].cpu(), vals, f"rank {r} gather_pull")


def _ulp(x, dtype):
    """Spacing of `dtype` numbers at |x| (fp32 tensor)."""
    mant = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}[dtype]
    e = torch.floor(torch.log2(x.abs().clamp(min=1e-30)))
    return torch.pow(2.0, e - mant)


def _eq(got, want, what):
    if got.dtype.is_floating_point:
        same = (got == want) | (torch.isnan(got) & torch.isnan(want))
    else:
        same = got == want
    if not bool(same.all()):
        bad = (~same).nonzero()
        raise AssertionError(f"{what}: {bad.shape[0]} mismatches, first at {bad[:3].tolist()}: "
                             f"got {[got[tuple(i)].item() for i in bad[:3]]} "
                             f"want {[want[tuple(i)].item() for i in bad[:3]]}")


# ------------------------------------------------------------------------------------------------
# (b) GPU: simulated ranks
# ------------------------------------------------------------------------------------------------
# (R, S, K, E, B, P, H, dtype, num_ctas)
CONFIGS = [
    (1, 64, 4, 8, 8, 16, 64, torch.bfloat16, 32),
    # R = 1 pulls rows by bulk copies of 4 KiB pieces: 7168 bf16 = 3 pieces + 2 KiB; 2056 bf16 = one piece
    # + 16 bytes, on 3 CTAs (many batches per warp: the slots' mbarrier phases carry across batches)
    (1, 96, 8, 48, 48, 16, 7168, torch.bfloat16, 32),
    (1, 150, 6, 16, 16, 32, 2056, torch.bfloat16, 3),
    (2, 200, 8, 16, 8, 16, 200, torch.bfloat16, 3),       # K > R: duplicates; partial tail chunks
    (4, 150, 6, 16, 4, 32, 136, torch.bfloat16, 32),
    (2, 96, 8, 96, 48, 16, 7168, torch.bfloat16, 32),     # the benchmark's H, E, B (P=16 keeps NvS small)
    (4, 64, 2, 8, 2, 8, 72, torch.float32, 1),
    (2, 33, 3, 4, 2, 4, 64, torch.float16, 5),
]
KINDS = ("random", "one-expert", "one-rank", "dupes", "skew", "absent")


def _cfg_id(cfg):
    R, S, K, E, B, P, H, dt, n = cfg
    return f"R{R}-S{S}-K{K}-E{E}-H{H}-{str(dt)[6:]}-ctas{n}"


@needs_cuda
@pytest.mark.parametrize("cfg", CONFIGS, ids=_cfg_id)
def test_dispatch_combine_simulated(cfg):
    R, S, K, E, B, P, H, dtype, ncta = cfg
    gen = torch.Generator().manual_seed(R * 1000 + S + K)
    for ki, kind in enumerate(KINDS):
        ids = make_ids(kind, R, S, K, E, gen)
        case = Case(R, S, K, E, B, P, ids)
        # each token crosses to each destination rank once: <= min(K, R) rows over the links
        for r in range(R):
            t = case.tok[r]
            ncar = ((t.dst_row == t.primary_row) & (t.dst_rank >= 0)).sum(1)  # absent rows (-1) carry nothing
            ndst = torch.stack([(t.dst_rank == d).any(1) for d in range(R)], 1).sum(1)
            assert torch.equal(ncar, ndst) and int(ncar.max()) <= min(K, R), kind
        sim = Sim(case, H, dtype, ncta)
        sim.set_inputs(salt=ki)
        xs = [t.cpu() for t in sim.x]
        ws = [t.cpu() for t in sim.w]
        ref = dispatch_reference(case, xs, ws)
        sim.meta()
        torch.cuda.synchronize()
        sim.check_meta(ref)
        sim.pull()
        torch.cuda.synchronize()
        sim.check_pull(ref)
        for exact in (True, False):
            sim.set_expert_outputs(salt=ki + 10 * exact, exact=exact)
            for t in sim.presum + sim.comb:
                t.fill_(GARBAGE_ROW)
            for t in sim.gath:
                t.fill_(GARBAGE_W)
            sim.combine()
            torch.cuda.synchronize()
            sim.check_combine(exact)
            if R == 1:  # the one-pass combine of one rank: bitwise the presum + pull result
                two_pass = sim.comb[0].clone()
                sim.comb[0].fill_(GARBAGE_ROW)
                sim.combine_local()
                torch.cuda.synchronize()
                sim.check_combine(exact)
                _eq(sim.comb[0], two_pass, f"{kind}: combine_local against presum + pull")
                assert sim.status_words() == [0], kind


def _bad_table_sim():
    """The small shape of the table-check tests (the kernels compile once for both) on canary buffers:
    (case, sim, canaries, a real row and a chain head of rank 0) after one clean dispatch."""
    R, S, K, E, B, P, H, dtype = 2, 40, 4, 8, 4, 8, 64, torch.bfloat16
    gen = torch.Generator().manual_seed(5)
    case = Case(R, S, K, E, B, P, make_ids("random", R, S, K, E, gen))
    guard = Canaries()
    sim = Sim(case, H, dtype, 4, guard)
    sim.set_inputs(salt=1)
    sim.set_expert_outputs(salt=2, exact=True)
    sim.meta()
    sim.pull()
    pr0 = sim.recv_pr[0].cpu()
    heads = torch.nonzero(pr0 == torch.arange(case.NVS, dtype=pr0.dtype)).flatten()
    real = int(torch.nonzero(case.real[0])[0])
    return case, sim, guard, real, int(heads[0])


@needs_cuda
def test_invalid_plan_entries_are_skipped():
    """Table entries outside the plan (a failed plan, corrupted tables) are skipped, never written or read
    out of bounds, and set STATUS_BAD_TABLE in the status word of the rank whose kernel met them; the
    absent-token marker dst_rank = -1 sets nothing. gather gives 0 there, combine sums only the valid
    carriers, a chain head whose src is out of range is zeroed; every written buffer keeps its canaries."""
    from csrc_cute.status import STATUS_BAD_TABLE

    case, sim, guard, real, h = _bad_table_sim()
    R, S, N = case.R, case.S, case.NVS
    names = ("dst_rank", "dst_row", "primary", "cu", "grows", "recv_pr", "recv_nx", "recv_src", "out_pr", "out_nx")
    clean = {n: [t.clone() for t in getattr(sim, n)] for n in names}

    def restore():
        for n, saved in clean.items():
            for t, v in zip(getattr(sim, n), saved):
                t.copy_(v)

    def run(kernels, flagged, what):
        """Run `kernels` on every rank from zeroed status words: rank r's word must be STATUS_BAD_TABLE
        if flagged[r], else 0 (no other bit either); the canaries must be intact."""
        for t in sim.status:
            t.zero_()
        for k in kernels:
            getattr(sim, k)()
        torch.cuda.synchronize()
        want = [STATUS_BAD_TABLE if f else 0 for f in flagged]
        assert sim.status_words() == want, (what, kernels, sim.status_words(), want)
        guard.check()

    every = ("meta", "pull", "presum_all", "combine_pull_all", "gather_all")
    run(every, [False] * R, "a valid plan")
    # absent tokens: token 0 all -1, token 1 dst_rank = -1 only; both legal, their rows 0
    for r in range(R):
        for t in (sim.dst_rank[r], sim.dst_row[r], sim.primary[r]):
            t[0] = -1
        sim.dst_rank[r][1] = -1
    run(("combine_pull_all", "gather_all", "meta", "pull"), [False] * R, "absent tokens")
    for r in range(R):
        assert bool((sim.gath[r][:2] == 0).all()) and bool((sim.comb[r][:2] == 0).all())
    restore()

    # this rank's token tables, corrupted on every rank: (what, table, token, value, flagged by gather)
    token_kinds = [("dst_rank = R", "dst_rank", 1, R, True), ("dst_rank = -5", "dst_rank", 1, -5, True),
                   ("dst_row = NvS", "dst_row", 2, N, True), ("dst_row = -2", "dst_row", 2, -2, True),
                   ("primary_row = NvS", "primary", 3, N, False)]
    for what, name, s, v, by_gather in token_kinds:
        restore()
        for r in range(R):
            getattr(sim, name)[r][s] = v
        run(("meta",), [True] * R, what)
        run(("combine_pull_all",), [True] * R, what)
        run(("gather_all",), [by_gather] * R, what)
        for r in range(R):
            assert bool((sim.comb[r][s] == 0).all()), what  # no entry of the token is a valid carrier
            if by_gather:
                assert bool((sim.gath[r][s] == 0).all()), what
    # group tables of meta's padding pass (group 0's length is cu_seqlens[0])
    for what, name, g, value in (("group_rows past its group", "grows", 0, lambda r: int(clean["cu"][r][0]) + 1),
                                 ("cu_seqlens past NvS", "cu", -1, lambda r: N + 1)):
        restore()
        for r in range(R):
            getattr(sim, name)[r][g] = value(r)
        run(("meta",), [True] * R, what)
    restore()
    run(("meta", "pull"), [False] * R, "the clean plan again")

    # rank 0's receive tables (dispatch_pull) and row tables (combine_presum); rank 1's stay clean
    row_kinds = [("recv_primary = NvS", "recv_pr", real, N, "pull"), ("recv_primary = -3", "recv_pr", real, -3, "pull"),
                 ("recv_next = NvS", "recv_nx", real, N, "pull"), ("recv_next cycle", "recv_nx", h, h, "pull"),
                 ("recv_src = R*S at a head", "recv_src", h, R * S, "pull"),
                 ("row_primary = NvS", "out_pr", real, N, "presum_all"),
                 ("row_primary = -2", "out_pr", real, -2, "presum_all"),
                 ("row_next = NvS on a chain", "out_nx", h, N + 2, "presum_all"),
                 ("row_next cycle", "out_nx", h, h, "presum_all")]
    for what, name, i, v, kernel in row_kinds:
        restore()
        getattr(sim, name)[0][i] = v
        sim.out_rows[0].fill_(GARBAGE_ROW)
        run((kernel,), [True] + [False] * (R - 1), what)
        if name == "recv_src":
            assert bool((sim.out_rows[0][h] == 0).all()), what  # the head's chain is not followed


@needs_cuda
def test_corrupted_tables_keep_canaries_and_raise():
    """Every kind of corrupted table at once, on every rank, through every kernel: the canaries around
    every written buffer are byte-identical, each rank's status word holds STATUS_BAD_TABLE and nothing
    else, and check_status raises MoEStatusError with its message (and clears the word)."""
    import re

    from csrc_cute.status import MESSAGES, STATUS_BAD_TABLE
    from moonep_ops.status import MoEStatusError, check_status

    case, sim, guard, real, h = _bad_table_sim()
    R, S, N = case.R, case.S, case.NVS
    torch.cuda.synchronize()
    assert sim.status_words() == [0] * R
    for r in range(R):
        sim.dst_rank[r][0] = R
        sim.dst_rank[r][1] = -3
        sim.dst_row[r][2] = N
        sim.dst_row[r][3] = -2
        sim.primary[r][4] = N
    sim.meta()
    for d in range(R):  # after meta's writes: a next row past the buffer, a head without a source
        pr = sim.recv_pr[d].cpu()
        hd = torch.nonzero(pr == torch.arange(N, dtype=pr.dtype)).flatten()
        sim.recv_nx[d][hd[0]] = N
        sim.recv_src[d][hd[1]] = R * S
        sim.recv_pr[d][int(torch.nonzero(case.real[d])[-1])] = N
    sim.pull()   # copies the bad next row into out_nx: presum's chain walk meets it
    sim.combine()
    torch.cuda.synchronize()
    guard.check()
    assert sim.status_words() == [STATUS_BAD_TABLE] * R
    for r in range(R):
        with pytest.raises(MoEStatusError, match=re.escape(MESSAGES[STATUS_BAD_TABLE])):
            check_status(sim.status[r], "dispatch")
        assert int(sim.status[r]) == 0


@needs_cuda
def test_cuda_graph_capture_replay():
    R, S, K, E, B, P, H, dtype, ncta = 2, 128, 8, 16, 8, 16, 256, torch.bfloat16, 32
    gen = torch.Generator().manual_seed(3)
    case = Case(R, S, K, E, B, P, make_ids("skew", R, S, K, E, gen))
    sim = Sim(case, H, dtype, ncta)
    sim.set_inputs(salt=0)
    sim.set_expert_outputs(salt=0, exact=True)
    sim.meta()
    sim.pull()
    sim.combine()  # warm up: compiles outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        sim.meta()
        sim.pull()
        sim.combine()
    for salt in (5, 6):
        sim.poison()
        sim.set_inputs(salt=salt)
        sim.set_expert_outputs(salt=salt, exact=True)
        g.replay()
        torch.cuda.synchronize()
        ref = dispatch_reference(case, [t.cpu() for t in sim.x], [t.cpu() for t in sim.w])
        sim.check_pull(ref)
        sim.check_combine(exact=True)


@needs_cuda
@pytest.mark.skipif(not os.environ.get("MOONEP_BENCH_COMM"), reason="set MOONEP_BENCH_COMM=1 to time")
def test_timing_default_shape():
    """Timing at the benchmark shape (S=8192, H=7168, K=8, R=2, E=96, B=48, P=128) with both ranks
    on one GPU (the 'remote' traffic is local HBM traffic here): per-rank kernel times."""
    R, S, K, E, B, P, H, dtype = 2, 8192, 8, 96, 48, 128, 7168, torch.bfloat16
    ncta = int(os.environ.get("MOONEP_BENCH_CTAS", "32"))
    gen = torch.Generator().manual_seed(1)
    case = Case(R, S, K, E, B, P, make_ids("skew", R, S, K, E, gen))
    sim = Sim(case, H, dtype, ncta)
    for t in sim.x + sim.y:
        t.normal_()
    rowb = H * 2
    ncar = sum(int((t.dst_row == t.primary_row).sum()) for t in case.tok)

    from benchmarks.common import cuda_time_ms

    def timed(fn):
        return cuda_time_ms(fn, iters=5, repeats=3, warmup=1) / R * 1e3  # us per rank

    from csrc_cute import combine as KC
    from csrc_cute import dispatch as KD

    N = case.NVS
    t_meta = timed(sim.meta)
    t_dpull = timed(sim.pull)
    t_pre = timed(sim.presum_all)
    t_pull = timed(sim.combine_pull_all)
    t_gat = timed(sim.gather_all)
    n_real = S * K
    nc = ncar // R
    print(f"\n[comm timing, {ncta} CTAs, per rank, both ranks simulated on one GPU] NvS={N} "
          f"carriers/rank={nc}")
    print(f"  dispatch_meta  {t_meta:8.1f} us  {2 * S * rowb / t_meta / 1e3:7.1f} GB/s (x copy read + write)")
    print(f"  dispatch_pull  {t_dpull:8.1f} us  {(nc + N) * rowb / t_dpull / 1e3:7.1f} GB/s (reads + writes)"
          f"  {N * rowb / t_dpull / 1e3:7.1f} GB/s of rows written")
    print(f"  dispatch total {t_meta + t_dpull:8.1f} us")
    print(f"  combine_presum {t_pre:8.1f} us  {n_real * rowb / t_pre / 1e3:7.1f} GB/s read "
          f"{(n_real + nc) * rowb / t_pre / 1e3:7.1f} GB/s read + write")
    print(f"  combine_pull   {t_pull:8.1f} us  {(nc + S) * rowb / t_pull / 1e3:7.1f} GB/s (read + write)")
    print(f"  gather_pull    {t_gat:8.1f} us")

    # tuning sweep through the private compile hooks; every variant must give the same bits
    if os.environ.get("MOONEP_BENCH_SWEEP", "1") == "0":
        return
    ref_rows = [t.clone() for t in sim.out_rows]
    ref_pre = [t.clone() for t in sim.presum]
    for nct in sorted({ncta, 66, 132}):
        for nt, u in ((512, 8), (512, 4), (512, 16)):
            fn = KD._compile_meta(S, H, K, R, N, case.G, dtype, nct, nt, u)
            t = timed(lambda: [fn(sim.x[r].view(-1), sim.w[r].view(-1), sim.dst_rank[r].view(-1),
                                  sim.dst_row[r].view(-1), sim.primary[r].view(-1), sim.p_w, sim.p_pr,
                                  sim.p_nx, sim.p_src, sim.recv_w[r], sim.recv_pr[r], sim.recv_nx[r],
                                  sim.recv_src[r], sim.send_rows[r].view(-1), sim.cu[r], sim.grows[r],
                                  sim.status[r], r)
                               for r in range(R)])
            print(f"  meta   ctas={nct:3d} nt={nt} u={u}:        {t:8.1f} us")
        for nt, u in ((512, 16), (512, 8), (256, 16)):
            for o in sim.out_rows:
                o.fill_(GARBAGE_ROW)
            fn = KD._compile_pull(S, H, R, N, dtype, nct, nt, u)
            t = timed(lambda: [fn(sim.p_send, sim.recv_w[r], sim.recv_pr[r], sim.recv_nx[r], sim.recv_src[r],
                                  sim.out_rows[r].view(-1), sim.out_w[r], sim.out_pr[r], sim.out_nx[r],
                                  sim.status[r])
                               for r in range(R)])
            same = all(torch.equal(a, b) for a, b in zip(sim.out_rows, ref_rows))
            print(f"  pull   ctas={nct:3d} nt={nt} u={u}:        {t:8.1f} us  "
                  f"{N * rowb / t / 1e3:7.1f} GB/s written  same={same}")
            assert same
        for nt, u, dd in ((512, 4, 6), (512, 4, 7), (256, 4, 12), (512, 2, 12), (512, 8, 3), (256, 8, 6)):
            for o in sim.presum:
                o.fill_(GARBAGE_ROW)
            fn = KC._compile_presum(N, H, dtype, nct, nt, u, dd)
            t = timed(lambda: [fn(sim.y[d].view(-1), sim.out_pr[d], sim.out_nx[d], sim.presum[d].view(-1),
                                  sim.status[d])
                               for d in range(R)])
            heads = [pr == torch.arange(N, device=pr.device, dtype=pr.dtype) for pr in sim.out_pr]
            same = all(torch.equal(a[h], b[h]) for a, b, h in zip(sim.presum, ref_pre, heads))
            print(f"  presum ctas={nct:3d} nt={nt} u={u} d={dd:2d}: {t:8.1f} us  "
                  f"{n_real * rowb / t / 1e3:7.1f} GB/s read  same={same}")
            assert same
