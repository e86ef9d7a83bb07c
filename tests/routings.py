"""Routings for the planner tests: lognormal skews from the shared generator, and extremes."""

import torch

from benchmarks.routing_gen import sample_topk
from moonep_ops.planning import count_routed

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
