"""Routings for the planner tests: lognormal skews from the shared generator, and extremes."""

import torch

from benchmarks.routing_gen import sample_topk
from moonep_ops.planning import count_routed, greedy_split, hottest_first, interval_split, rank_flows, rank_targets

HAS_CUDA = torch.cuda.is_available()


def lognormal_ids(gen, R, S, K, E, sigma, replacement=False):
    """ids int64 [R, S, K] on the CPU from the shared routing generator (sampled on the GPU if any)."""
    seed = int(torch.randint(0, 2 ** 62, (1,), generator=gen))
    dev = "cuda" if HAS_CUDA else "cpu"
    return torch.stack(sample_topk(R, S, E, K, sigma, seed, dev, replacement=replacement or K > E)).cpu()


def routings(R, S, K, E, seed, n):
    """The first n of (name, ids [R, S, K] int64 on CPU) for one config: skews, extremes, duplicates."""
    gen = torch.Generator().manual_seed(seed)
    epn = E // R
    makers = []
    for sigma in (0.0, 0.3, 1.0, 2.0, 3.0, 4.0):
        for rep in range(2):
            makers.append((f"lognormal{sigma}-{rep}", lambda s=sigma: lognormal_ids(gen, R, S, K, E, s)))
    makers.append(("all-one-expert", lambda: torch.full(
        (R, S, K), int(torch.randint(0, E, (1,), generator=gen)), dtype=torch.long)))
    makers.append(("dupes", lambda: torch.randint(0, E, (R, S, K), generator=gen)))
    makers.append(("all-one-rank", lambda: lognormal_ids(gen, R, S, K, epn, 1.0, replacement=K > epn)
                   + int(torch.randint(0, R, (1,), generator=gen)) * epn))
    makers.append(("dupes-skew", lambda: lognormal_ids(gen, R, S, K, E, 2.0, replacement=True)))
    makers.append(("all-rank0", lambda: torch.randint(0, epn, (R, S, K), generator=gen)))
    makers.append(("all-last-expert", lambda: torch.full((R, S, K), E - 1, dtype=torch.long)))
    makers.append(("per-rank-one-expert", lambda: torch.randint(0, E, (R, 1, 1), generator=gen)
                   .expand(R, S, K).contiguous()))
    # extremes early, so that configs that use only a few routings still get them
    order = [0, 6, 12, 14, 10, 13, 4, 8, 15, 2, 16, 17, 18, 1, 3, 5, 7, 9, 11]
    return [(makers[i][0], makers[i][1]()) for i in order[:n]]


def cpu_counts(ids, E):
    """int32 [R, E] counts of ids [R, S, K]; absent tokens (-1) are not counted."""
    return torch.stack([count_routed(ids[r], E) for r in range(ids.shape[0])])


def with_absent_tokens(ids, seed):
    """ids [R, S, K] with each rank keeping a different number of its first tokens (0, 1, all, or a
    random count, rotating over the ranks); the rest become absent (-1 in all K ids)."""
    gen = torch.Generator().manual_seed(seed)
    R, S, _ = ids.shape
    out = ids.clone()
    for r in range(R):
        keep = [0, 1, S, int(torch.randint(0, S + 1, (1,), generator=gen))][(r + seed) % 4]
        out[r, keep:] = -1
    return out


def greedy_split_donors(counts):
    """Donors whose greedy split makes strictly fewer copies than the interval cut (so plan_global
    takes it) in the plan of counts [R, E]."""
    R, E = counts.shape
    epn = E // R
    tot = counts.long().sum(0)
    quotas = {}
    for g, _, amt in rank_flows(tot.view(R, epn).sum(1), rank_targets(int(tot.sum()), R)):
        quotas.setdefault(g, []).append(amt)
    out = []
    for g, q in quotas.items():
        sizes = tot[g * epn:(g + 1) * epn][hottest_first(tot[g * epn:(g + 1) * epn])].tolist()
        if len(greedy_split(sizes, q)) < len(interval_split(sizes, q)):
            out.append(g)
    return out


# bench_copies' hand-made plan: donor rank 0 (experts of 45, 43, 37, 30 rows) gives 53 rows to rank 1,
# then 43 to rank 2; the greedy split gives expert 1 whole to rank 2 (3 copies against the cut's 4)
HAND_MADE_COUNTS = [[45, 43, 37, 30, 6, 0, 0, 0, 16, 0, 0, 0], [0] * 12, [0] * 12]


def hand_made_ids():
    """ids int64 [3, 177, 1] of HAND_MADE_COUNTS: rank 0's 177 tokens in expert order, ranks 1 and 2
    route none (every token absent, -1)."""
    ids = torch.full((3, 177, 1), -1, dtype=torch.long)
    ids[0, :, 0] = torch.repeat_interleave(torch.arange(12), torch.tensor(HAND_MADE_COUNTS[0]))
    return ids


def greedy_split_routings(R, S, K, E, seed, n):
    """n (name, ids [R, S, K] int64) whose plans take the greedy split for at least one donor (R >= 3:
    a donor with one receiver has one quota, and both splits are the same). Rejection sampling: one hot
    rank over lognormal popularity, K ids per token drawn with replacement."""
    if R < 3:
        raise ValueError(f"greedy_split_routings: R={R}; a donor needs two receivers, so R >= 3")
    gen = torch.Generator().manual_seed(seed)
    epn = E // R
    out = []
    for _ in range(2000 * n):  # hit rates: ~1 in 600 draws at R = 3, 1 in 50-150 at R >= 8
        logp = torch.randn(E, generator=gen, dtype=torch.float64) * float(torch.rand(1, generator=gen) * 2)
        hot = int(torch.randint(0, R, (1,), generator=gen))
        logp[hot * epn:(hot + 1) * epn] += 1 + float(torch.rand(1, generator=gen)) * 3
        ids = torch.multinomial(torch.softmax(logp, 0), R * S * K, replacement=True, generator=gen).view(R, S, K)
        if greedy_split_donors(cpu_counts(ids, E)):
            out.append((f"greedy-split-{len(out)}", ids))
            if len(out) == n:
                return out
    raise AssertionError(f"greedy_split_routings: fewer than {n} routings found at R={R} S={S} K={K} E={E}")
