"""The planning core: invariants on many routings, an independent oracle, and a golden plan."""

import itertools

import pytest
import torch
from expecttest import assert_expected_inline

from benchmarks.routing_gen import counts_of, sample_topk
from moonep_ops.config import EPConfig
from routings import greedy_split_donors, greedy_split_routings, hand_made_ids, with_absent_tokens
from moonep_ops.planning import (check_topk_ids, count_routed, donor_split, greedy_split, group_of_expert,
                                  interval_split, maxvio, plan_global, plan_tokens)


# ----------------------------------------------------------------------------- independent oracles
def oracle_targets(N, R):
    """Rows each rank computes when all ranks route N rows: N // R, the first N % R ranks one more."""
    return [N // R + (1 if d < N % R else 0) for d in range(R)]


def oracle_greedy(counts):
    """DESIGN.md's reference policy written as plainly as possible: lists of ints, no torch. The rank
    loop first; then each donor's experts, hottest first, are split over its receivers twice, by
    consecutive cuts in step order and by the largest-remaining-quota greedy, and the split with fewer
    (expert, receiver) copies is kept (ties: the cuts)."""
    R, E = counts.shape
    epn = E // R
    tot = [int(v) for v in counts.sum(0)]
    T = oracle_targets(sum(tot), R)
    surplus = [sum(tot[r * epn:(r + 1) * epn]) - T[r] for r in range(R)]
    receivers = {}  # donor -> [(receiver, rows)] in step order
    while max(surplus) > 0:
        g = surplus.index(max(surplus))
        d = surplus.index(min(surplus))
        amt = -surplus[d]
        surplus[g] -= amt
        surplus[d] += amt
        receivers.setdefault(g, []).append((d, amt))
    alloc = [[0] * R for _ in range(E)]
    for e in range(E):
        alloc[e][e // epn] = tot[e]
    for g, flows in receivers.items():
        hot = sorted(range(g * epn, (g + 1) * epn), key=lambda e: (-tot[e], e))
        cut = {}  # (expert, receiver) -> rows
        home = {e: tot[e] for e in hot}
        for d, amt in flows:
            for e in hot:  # take from the hottest expert that still has rows at home
                take = min(amt, home[e])
                if take:
                    cut[e, d] = take
                    home[e] -= take
                    amt -= take
        greedy = {}
        quota = [amt for _, amt in flows]
        for e in hot:
            rows = tot[e]
            while rows and sum(quota):
                best = max(quota)
                j = quota.index(best)  # the earliest step of the largest remaining quota
                take = min(rows, best)
                greedy[e, flows[j][0]] = take
                quota[j] -= take
                rows -= take
        for (e, d), take in (greedy if len(greedy) < len(cut) else cut).items():
            alloc[e][g] -= take
            alloc[e][d] += take
    return alloc


def oracle_rows(ids_per_rank, alloc, experts_to_copy, cu_seqlens, E):
    """(rank, row) of every (r, s, k) by walking each expert's global token sequence."""
    R = len(ids_per_rank)
    epn = E // R
    seqs = {e: [] for e in range(E)}  # expert -> its rows ordered by (source rank, s*K + k)
    for r in range(R):
        for s, k in itertools.product(*map(range, ids_per_rank[r].shape)):
            if ids_per_rank[r][s, k] >= 0:  # -1: an absent token, routed nowhere
                seqs[int(ids_per_rank[r][s, k])].append((r, s, k))
    out = {}
    for e, seq in seqs.items():
        i = 0
        for d in range(R):
            if e // epn == d:
                g = e - d * epn
            elif alloc[e][d]:
                g = epn + [int(v) for v in experts_to_copy[d]].index(e)
            start = 0 if g == 0 else int(cu_seqlens[d, g - 1])
            for j in range(alloc[e][d]):
                out[seq[i]] = (d, start + j)
                i += 1
        assert i == len(seq)
    return out


# ---------------------------------------------------------------------------------------- routings
def routings():
    """>= 200 (name, R, S, K, E, ids per rank)."""
    g = torch.Generator().manual_seed(1234)
    cases = []
    for R, E, S, K in [(1, 8, 16, 2), (2, 8, 16, 2), (2, 96, 64, 8), (4, 16, 32, 4), (8, 64, 32, 8), (8, 384, 64, 8)]:
        for sigma in (0.0, 0.5, 1.0, 2.0, 4.0, 8.0):
            for seed in range(5):
                cases.append((f"lognormal{sigma}", R, S, K, E, sample_topk(R, S, E, K, sigma, seed * 31 + R)))
    for R, E, S, K in [(2, 8, 16, 1), (4, 16, 8, 1), (8, 8, 4, 1), (8, 64, 16, 1)]:
        cases.append(("all-to-expert-0", R, S, K, E, [torch.zeros(S, K, dtype=torch.long)] * R))
        cases.append(("all-to-last-expert", R, S, K, E, [torch.full((S, K), E - 1)] * R))
    for R, E, S, K in [(2, 8, 16, 2), (4, 16, 8, 4), (8, 64, 16, 8), (2, 512, 16, 8)]:
        epn = E // R
        for home in (0, R - 1):
            ids = [torch.randint(home * epn, (home + 1) * epn, (S, K), generator=g) for _ in range(R)]
            cases.append((f"all-to-rank-{home}", R, S, K, E, ids))
    for R, E, S, K in [(2, 8, 16, 4), (4, 16, 8, 8), (8, 32, 16, 4)]:
        for seed in range(3):  # duplicate experts inside a token's top-k (ids drawn with replacement)
            cases.append(("duplicates", R, S, K, E, [torch.randint(0, min(E, 3), (S, K), generator=g) for _ in range(R)]))
    for R, E in [(1, 1), (2, 2), (4, 4), (8, 8), (8, 16)]:
        cases.append(("S=1", R, 1, 1, E, [torch.randint(0, E, (1, 1), generator=g) for _ in range(R)]))
        cases.append(("E=R", R, 8, 1, E, sample_topk(R, 8, E, 1, 3.0, R)))
    for R, E in [(2, 512), (4, 1024)]:  # large epn
        cases.append(("large-epn", R, 32, 8, E, sample_topk(R, 32, E, 8, 2.0, R)))
    for R, S, K, E in [(3, 16, 2, 12), (4, 64, 4, 32), (8, 64, 4, 64)]:  # some donor takes the greedy split
        for name, ids in greedy_split_routings(R, S, K, E, seed=R * E, n=4):
            cases.append((name, R, S, K, E, list(ids)))
    return cases


CASES = routings()


def test_enough_routings():
    assert len(CASES) >= 200
    greedy = [name for name, R, S, K, E, ids in CASES if greedy_split_donors(counts_of(ids, E))]
    assert len(greedy) >= 12, greedy  # the oracle sees plans where the greedy split is kept


def test_donor_split_keeps_the_fewer_pieces():
    """Pieces are (expert position, outflow, rows). Each split wins somewhere; a tie keeps the cut."""
    cut = [(0, 0, 45), (1, 0, 8), (1, 1, 35), (2, 1, 8)]
    assert interval_split([45, 43, 37, 30], [53, 43]) == cut
    assert greedy_split([45, 43, 37, 30], [53, 43]) == donor_split([45, 43, 37, 30], [53, 43]) == [
        (0, 0, 45), (1, 1, 43), (2, 0, 8)]
    assert interval_split([3, 2, 1], [1, 2, 2]) == donor_split([3, 2, 1], [1, 2, 2]) == [
        (0, 0, 1), (0, 1, 2), (1, 2, 2)]
    assert len(greedy_split([3, 2, 1], [1, 2, 2])) == 4
    tie = [(0, 0, 1), (0, 1, 2), (1, 1, 2)]  # both make 3 pieces, different ones
    assert interval_split([3, 2], [1, 4]) == donor_split([3, 2], [1, 4]) == tie
    assert greedy_split([3, 2], [1, 4]) == [(0, 1, 3), (1, 0, 1), (1, 1, 1)]


def test_greedy_split_on_the_hand_made_plan():
    """Donor rank 0 (experts 45, 43, 37, 30 rows) gives 53 rows to rank 1, then 43 to rank 2. The
    interval cut: rank 1 takes e0 + 8 of e1, rank 2 the rest of e1 + 8 of e2 (4 copies); the greedy
    split gives e0 + 8 of e2 to rank 1 and e1 whole to rank 2's equal quota (3 copies), and is kept."""
    ids = list(hand_made_ids())
    check_plan(3, 177, 1, 12, ids, 16)
    gp = plan_global(counts_with_absent(ids, 12), 177, 1, 4, 16)
    assert gp.n_copies == 3
    assert gp.alloc[:4].tolist() == [[0, 45, 0], [0, 0, 43], [29, 8, 0], [30, 0, 0]]


def counts_with_absent(ids, E):
    return torch.stack([count_routed(i, E) for i in ids])


def check_plan(R, S, K, E, ids, P):
    """Every invariant of the plan of one routing (ids per rank [S, K], -1 = absent token)."""
    cfg = EPConfig(S=S, H=8, K=K, E=E, F=8, R=R, P=P)
    epn, B = cfg.epn, cfg.B
    counts = counts_with_absent(ids, E)
    target = torch.tensor(oracle_targets(int(counts.sum()), R))
    gp = plan_global(counts, S, K, B, P)
    alloc = gp.alloc.long()
    # conservation and exact balance: rank d computes T_d = N // R + (d < N % R) rows
    assert torch.equal(alloc.sum(1), counts.long().sum(0))
    assert torch.equal(alloc.sum(0), target)
    # the reference policy, from an independent implementation
    assert alloc.tolist() == oracle_greedy(counts)
    # slots: ascending copied experts, -1 after; remote rows only for slot experts; <= B per rank,
    # all of one donor group
    home = torch.arange(E) // epn
    for d in range(R):
        slots = [int(v) for v in gp.experts_to_copy[d]]
        used = [v for v in slots if v >= 0]
        assert slots == used + [-1] * (B - len(used)) and used == sorted(used)
        foreign = [e for e in range(E) if alloc[e, d] > 0 and home[e] != d]
        assert foreign == used
        assert len({e // epn for e in used}) <= 1
    # groups: home experts then slots, padded to P, within NvS
    cu = gp.cu_seqlens.long()
    lens = torch.diff(torch.cat([torch.zeros(R, 1, dtype=torch.long), cu], 1), dim=1)
    assert bool((lens >= 0).all()) and bool((cu % P == 0).all()) and bool((cu[:, -1] <= cfg.NvS).all())
    for d in range(R):
        want = [alloc[d * epn + i, d] for i in range(epn)] + [alloc[e, d] if e >= 0 else 0 for e in gp.experts_to_copy[d]]
        assert lens[d].tolist() == [(int(n) + P - 1) // P * P for n in want]
    # token destinations: oracle walk, every rank exactly T_d distinct rows inside its groups
    tps = [plan_tokens(ids[r], counts, gp, r) for r in range(R)]
    want_rows = oracle_rows(ids, alloc.tolist(), gp.experts_to_copy, gp.cu_seqlens, E)
    for r, tp in enumerate(tps):
        got = {(r, s, k): (int(tp.dst_rank[s, k]), int(tp.dst_row[s, k])) for s in range(S) for k in range(K)
               if ids[r][s, k] >= 0}
        assert got == {key: v for key, v in want_rows.items() if key[0] == r}
        absent = ids[r] < 0
        for t in tp:
            assert bool((t[absent] == -1).all())
        for s in range(S):  # the first k of each destination rank carries the token
            for k in range(K):
                first = next(j for j in range(K) if tp.dst_rank[s, j] == tp.dst_rank[s, k])
                assert tp.primary_row[s, k] == tp.dst_row[s, first]
    for d in range(R):
        rows = torch.cat([tp.dst_row[tp.dst_rank == d] for tp in tps])
        assert rows.numel() == int(target[d]) and rows.unique().numel() == int(target[d])
    # deterministic
    again = plan_global(counts.clone(), S, K, B, P)
    assert all(torch.equal(a, b) for a, b in zip(gp, again))
    return target


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("P", [16])
def test_plan_invariants(case, P):
    name, R, S, K, E, ids = CASES[case]
    target = check_plan(R, S, K, E, ids, P)
    assert target.tolist() == [S * K] * R  # every token present: every rank computes S*K rows, as before


@pytest.mark.parametrize("case", range(0, len(CASES), 3))
def test_plan_invariants_with_absent_tokens(case):
    """Ranks route different numbers of tokens (s <= S, 0 and 1 included): T_d rule, one donor per
    receiver, <= B copies, the oracle walk for the present rows, -1 everywhere for the absent ones."""
    name, R, S, K, E, ids = CASES[case]
    for seed in range(3):
        sparse = list(with_absent_tokens(torch.stack(ids), seed + case))
        target = check_plan(R, S, K, E, sparse, 16)
        N = sum(int((i >= 0).sum()) for i in sparse)
        assert int(target.sum()) == N and int(target.max() - target.min()) <= 1


def test_every_token_absent():
    ids = [torch.full((4, 2), -1)] * 2
    counts = counts_with_absent(ids, 8)
    gp = plan_global(counts, 4, 2, 4, 16)
    assert not gp.alloc.any() and not gp.cu_seqlens.any() and gp.n_copies == 0
    tp = plan_tokens(ids[1], counts, gp, 1)
    assert all(bool((t == -1).all()) for t in tp)


def test_uneven_targets_go_to_the_lowest_ranks():
    """N = 7 rows over R = 2: rank 0 computes 4, rank 1 computes 3, whoever routed them."""
    ids = [torch.tensor([[4], [5], [6], [7], [4], [-1]]), torch.tensor([[5], [6], [-1], [-1], [-1], [-1]])]
    gp = plan_global(counts_with_absent(ids, 8), 6, 1, 4, 16)
    assert gp.alloc.sum(0).tolist() == [4, 3]


def test_absent_marker_misuse():
    check_topk_ids("op", torch.tensor([[-1, -1], [0, 3]]), 4)
    with pytest.raises(ValueError, match=r"op: topk_ids\[1, 0\] = -2 is outside \[0, E=4\)"):
        check_topk_ids("op", torch.tensor([[0, 1], [-2, -2]]), 4)
    with pytest.raises(ValueError, match=r"op: topk_ids\[0, 1\] = 4 is outside"):
        check_topk_ids("op", torch.tensor([[0, 4]]), 4)
    with pytest.raises(ValueError, match=r"op: topk_ids\[1\] = \[2, -1\] mixes the absent-token marker -1"):
        check_topk_ids("op", torch.tensor([[0, 1], [2, -1]]), 4)


def test_receivers_take_one_home_group():
    """Why B = epn always suffices: each rank's copies come from a single home group."""
    for name, R, S, K, E, ids in CASES:
        gp = plan_global(counts_of(ids, E), S, K, E // R, 16)
        for d in range(R):
            used = gp.experts_to_copy[d][gp.experts_to_copy[d] >= 0]
            assert (used // (E // R)).unique().numel() <= 1, name


def test_copies_without_a_slot_are_read_remotely():
    # rank 0's experts 0-3 hold 3 rows each: rank 1 must take 4 rows, 3 of one expert and 1 of another
    ids = [torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])[:, None], torch.tensor([2, 3, 3, 3, 4, 5, 6, 7])[:, None]]
    counts = counts_of(ids, 8)
    one = plan_global(counts, 8, 1, 1, 16)
    two = plan_global(counts, 8, 1, 2, 16)
    assert torch.equal(one.alloc, two.alloc)  # B changes where weights come from, never the balance
    # B=1: the copy with the most rows on rank 1 gets the slot, the other is a remote group
    foreign = torch.nonzero(one.alloc[:4, 1]).flatten()
    hot = int(foreign[torch.argmax(one.alloc[foreign, 1])])
    assert one.experts_to_copy.tolist() == [[-1], [hot]]
    assert one.experts_remote.tolist() == [[-1, -1, -1], [int(e) for e in foreign if int(e) != hot] + [-1, -1]]
    assert two.experts_to_copy[1].tolist() == foreign.tolist() and bool((two.experts_remote == -1).all())
    # groups: 4 home, B slots, 4 - B remote; the same padded rows in total
    assert one.cu_seqlens.shape == two.cu_seqlens.shape == (2, 8)
    assert torch.equal(one.cu_seqlens[:, -1], two.cu_seqlens[:, -1])
    for plan in (one, two):
        for r in range(2):
            tp = plan_tokens(ids[r], counts, plan, r)
            assert torch.equal(tp.dst_rank, plan_tokens(ids[r], counts, one, r).dst_rank)


@pytest.mark.parametrize("B", [0, 1, 3])
def test_small_B_plans_hold_the_invariants(B):
    """Inference B < epn on every case: each rank's groups hold exactly its allocated rows, slots get
    the copies with the most rows, and every token lands in its expert's group."""
    for name, R, S, K, E, ids in CASES:
        epn = E // R
        if B >= epn:
            continue
        counts = counts_of(ids, E)
        gp = plan_global(counts, S, K, B, 16)
        full = plan_global(counts, S, K, epn, 16)
        assert torch.equal(gp.alloc, full.alloc), name
        group = group_of_expert(gp, E)
        for d in range(R):
            slots = gp.experts_to_copy[d][gp.experts_to_copy[d] >= 0].long()
            remote = gp.experts_remote[d][gp.experts_remote[d] >= 0].long()
            if remote.numel():
                assert slots.numel() == B, name
            if remote.numel() and B:
                assert int(gp.alloc[slots, d].min()) >= int(gp.alloc[remote, d].max()), name
            both = torch.cat([slots, remote]).sort().values
            full_used = full.experts_to_copy[d][full.experts_to_copy[d] >= 0].long()
            assert torch.equal(both, full_used), name
            assert int(gp.group_rows[d].sum()) == S * K, name
        for r in range(R):
            tp = plan_tokens(ids[r], counts, gp, r)
            g = group[tp.dst_rank.long(), ids[r].long()]
            cu = gp.cu_seqlens.long()
            start = torch.where(g > 0, cu[tp.dst_rank.long(), (g - 1).clamp(min=0)], 0)
            assert bool((g >= 0).all()) and bool((tp.dst_row >= start).all()), name
            assert bool((tp.dst_row < cu[tp.dst_rank.long(), g]).all()), name


def test_counts_must_fit_S_times_K():
    with pytest.raises(ValueError, match=r"every rank routes at most S\*K=16 rows"):
        plan_global(torch.tensor([[8, 9], [4, 4]], dtype=torch.int32), 8, 2, 1, 16)


def format_plan(ids, E, S, K, P, B=None):
    R = len(ids)
    counts = counts_of(ids, E)
    gp = plan_global(counts, S, K, E // R if B is None else B, P)
    lines = [f"R={R} E={E} S={S} K={K} P={P} maxvio={maxvio(counts):.2f} copies={gp.n_copies}",
             "expert: " + " ".join(f"{e:>3}" for e in range(E)),
             *(f"cnt r{r}: " + " ".join(f"{int(v):>3}" for v in counts[r]) for r in range(R)),
             *(f"alloc{d}: " + " ".join(f"{int(v):>3}" for v in gp.alloc[:, d]) for d in range(R)),
             *(f"rank {d}: slots={gp.experts_to_copy[d].tolist()}"
               + (f" remote={gp.experts_remote[d].tolist()}" if gp.experts_remote.shape[1] else "")
               + f" cu_seqlens={gp.cu_seqlens[d].tolist()}" for d in range(R))]
    for r in range(R):
        tp = plan_tokens(ids[r], counts, gp, r)
        lines.append(f"tokens of rank {r} (expert->rank:row, * = local copy):")
        for s in range(S):
            cells = [f"{int(ids[r][s, k])}->{int(tp.dst_rank[s, k])}:{int(tp.dst_row[s, k])}"
                     + ("*" if tp.dst_row[s, k] != tp.primary_row[s, k] else "") for k in range(K)]
            lines.append(f"  s{s}: " + " ".join(f"{c:<10}" for c in cells).rstrip())
    return "\n".join(lines)


def test_golden_plan():
    ids = [torch.tensor([[0, 1], [0, 2], [1, 0], [0, 3], [2, 0], [0, 1]]),
           torch.tensor([[0, 5], [1, 0], [0, 4], [6, 0], [0, 1], [7, 2]])]
    assert_expected_inline(format_plan(ids, E=8, S=6, K=2, P=16), """\
R=2 E=8 S=6 K=2 P=16 maxvio=2.67 copies=1
expert:   0   1   2   3   4   5   6   7
cnt r0:   6   3   2   1   0   0   0   0
cnt r1:   5   2   1   0   1   1   1   1
alloc0:   3   5   3   1   0   0   0   0
alloc1:   8   0   0   0   1   1   1   1
rank 0: slots=[-1, -1, -1, -1] cu_seqlens=[16, 32, 48, 64, 64, 64, 64, 64]
rank 1: slots=[0, -1, -1, -1] cu_seqlens=[16, 32, 48, 64, 80, 80, 80, 80]
tokens of rank 0 (expert->rank:row, * = local copy):
  s0: 0->0:0     1->0:16*
  s1: 0->0:1     2->0:32*
  s2: 1->0:17    0->0:2*
  s3: 0->1:64    3->0:48
  s4: 2->0:33    0->1:65
  s5: 0->1:66    1->0:18
tokens of rank 1 (expert->rank:row, * = local copy):
  s0: 0->1:67    5->1:16*
  s1: 1->0:19    0->1:68
  s2: 0->1:69    4->1:0*
  s3: 6->1:32    0->1:70*
  s4: 0->1:71    1->0:20
  s5: 7->1:48    2->0:34""")


def test_golden_plan_inference():
    """B=1 < epn=4: of rank 1's two copies, expert 0 (6 rows) gets the slot and expert 1 (4 rows) is a
    remote group, read from rank 0's weights (rows 48-63, after the slot's group)."""
    ids = [torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3], [0, 2], [1, 3]]),
           torch.tensor([[0, 1], [2, 3], [0, 2], [1, 3], [0, 4], [1, 5]])]
    assert_expected_inline(format_plan(ids, E=8, S=6, K=2, P=16, B=1), """\
R=2 E=8 S=6 K=2 P=16 maxvio=1.00 copies=1
expert:   0   1   2   3   4   5   6   7
cnt r0:   3   3   3   3   0   0   0   0
cnt r1:   3   3   2   2   1   1   0   0
alloc0:   0   2   5   5   0   0   0   0
alloc1:   6   4   0   0   1   1   0   0
rank 0: slots=[-1] remote=[-1, -1, -1] cu_seqlens=[0, 16, 32, 48, 48, 48, 48, 48]
rank 1: slots=[0] remote=[1, -1, -1] cu_seqlens=[16, 32, 32, 32, 48, 64, 64, 64]
tokens of rank 0 (expert->rank:row, * = local copy):
  s0: 0->1:32    1->0:0
  s1: 2->0:16    3->0:32*
  s2: 0->1:33    1->0:1
  s3: 2->0:17    3->0:33*
  s4: 0->1:34    2->0:18
  s5: 1->1:48    3->0:34
tokens of rank 1 (expert->rank:row, * = local copy):
  s0: 0->1:35    1->1:49*
  s1: 2->0:19    3->0:35*
  s2: 0->1:36    2->0:20
  s3: 1->1:50    3->0:36
  s4: 0->1:37    4->1:0*
  s5: 1->1:51    5->1:16*""")
