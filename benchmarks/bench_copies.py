"""How many expert copies the planner makes against the published greedy split (issue 13 part 4).

Ours (moonep_ops.planning.donor_split) keeps, per donor, whichever of its interval cut and its greedy split
makes fewer copies, so it never makes more than either; the interval cut alone (the policy before) is
reported as `cut`.

Every copy is an expert's weights pushed over NVLink and its fp32 gradient pulled back (88 MB + 176 MB at
DESIGN.md's shape). The comparison policy has the same rank-level step (moonep_ops.planning.rank_flows): a
donor walks its home experts hottest first and gives each one's rows to the receiver with the largest
remaining quota (ties: the earlier step), splitting an expert only when that quota is full; the rest stays
home. Copies = (expert, rank) pairs computed away from the expert's home. CPU only:

    python3 benchmarks/bench_copies.py            # writes benchmarks/results/bench_copies.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import run_info  # noqa: E402
from benchmarks.routing_gen import counts_of, sample_topk  # noqa: E402
from moonep_ops.planning import hottest_first, interval_split, plan_global, rank_flows, rank_targets  # noqa: E402


def greedy_copies(counts: torch.Tensor, S: int, K: int) -> int:
    """Copies made by the largest-remaining-quota greedy split, plain Python."""
    R, E = counts.shape
    epn = E // R
    tot = [int(v) for v in counts.sum(0)]
    load = torch.tensor([sum(tot[r * epn:(r + 1) * epn]) for r in range(R)])
    quotas: dict[int, list[int]] = {}
    for g, _, amt in rank_flows(load, rank_targets(int(load.sum()), R)):
        quotas.setdefault(g, []).append(amt)
    copies = 0
    for g, rem in quotas.items():
        for e in hottest_first(torch.tensor(tot[g * epn:(g + 1) * epn])).tolist():
            left = min(tot[g * epn + e], sum(rem))
            while left > 0:
                j = max(range(len(rem)), key=lambda i: (rem[i], -i))
                take = min(left, rem[j])
                rem[j] -= take
                left -= take
                copies += 1
    return copies


def cut_copies(counts: torch.Tensor) -> int:
    """Copies made by the interval cut alone (every donor cuts its outflows as consecutive intervals)."""
    R, E = counts.shape
    epn = E // R
    tot = counts.long().sum(0)
    quotas: dict[int, list[int]] = {}
    for g, _, amt in rank_flows(tot.view(R, epn).sum(1), rank_targets(int(tot.sum()), R)):
        quotas.setdefault(g, []).append(amt)
    return sum(len(interval_split(tot[g * epn:(g + 1) * epn][hottest_first(tot[g * epn:(g + 1) * epn])].tolist(), q))
               for g, q in quotas.items())


def skewed_routings(seed: int = 13) -> list[tuple]:
    """>= 100 skewed routings with R up to 16: lognormal, one hot expert, one hot rank, E = R, S = 1."""
    g = torch.Generator().manual_seed(seed)
    cases = []
    for R, E, S, K in [(2, 16, 64, 4), (4, 32, 32, 8), (8, 64, 32, 8), (16, 128, 16, 8), (16, 256, 32, 8)]:
        for sigma in (1.0, 2.0, 3.0, 4.0):
            for rep in range(4):
                cases.append((f"lognormal{sigma}", R, S, K, E, sample_topk(R, S, E, K, sigma, 7 * rep + R)))
        hot = int(torch.randint(0, E, (1,), generator=g))
        cases.append(("one-hot-expert", R, S, K, E, [torch.full((S, K), hot)] * R))
        epn = E // R
        for home in (0, R - 1):
            ids = [torch.randint(home * epn, (home + 1) * epn, (S, K), generator=g) for _ in range(R)]
            cases.append((f"one-hot-rank-{home}", R, S, K, E, ids))
    for R in (2, 4, 8, 16):
        cases.append(("E=R", R, 16, 1, R, sample_topk(R, 16, R, 1, 3.0, R)))
        cases.append(("S=1", R, 1, 2, 2 * R, [torch.randint(0, 2 * R, (1, 2), generator=g) for _ in range(R)]))
    return cases


def run() -> dict:
    rows = []
    for name, R, S, K, E, ids in skewed_routings():
        counts = counts_of(ids, E)
        rows.append(dict(routing=name, R=R, S=S, K=K, E=E, ours=plan_global(counts, S, K, E // R, 16).n_copies,
                         greedy=greedy_copies(counts, S, K), cut=cut_copies(counts)))
    worst = max(rows, key=lambda r: (r["ours"] - r["greedy"], r["ours"]))  # largest excess, then most copies
    return dict(run_info(), routings=len(rows), ours_total=sum(r["ours"] for r in rows),
                greedy_total=sum(r["greedy"] for r in rows), cut_total=sum(r["cut"] for r in rows),
                ours_wins=sum(r["ours"] < r["greedy"] for r in rows),
                ties=sum(r["ours"] == r["greedy"] for r in rows),
                ours_losses=sum(r["ours"] > r["greedy"] for r in rows), worst=worst, rows=rows)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args(argv)
    res = run()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_copies.json"), "w") as f:
        json.dump(res, f, indent=1)
    w = res["worst"]
    print(f"{res['routings']} routings: ours {res['ours_total']} copies, greedy {res['greedy_total']}, interval cut "
          f"alone {res['cut_total']}; ours wins "
          f"{res['ours_wins']}, ties {res['ties']}, loses {res['ours_losses']}; worst single routing (ours - greedy "
          f"largest) {w['routing']} R={w['R']} E={w['E']}: ours {w['ours']}, greedy {w['greedy']}")


if __name__ == "__main__":
    main()
