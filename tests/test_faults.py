"""Fault injection: ranks that disagree or fall out of step fail fast, on every live rank, with an error
naming the cause (multi-process gloo); and bad arguments to every op fail before anything is written."""

import pytest
import torch

import fault_workers as fw
from csrc_cute.status import STATUS_OP_MISMATCH, STATUS_PEER_REJECTED, STATUS_TIMEOUT
from moonep_ops import EPConfig, EPGroup, MoELayer, planning
from moonep_ops.launch import run_ranks_faulty

ops = torch.ops.moonep
TIMEOUT_S = 3.0
FAST_S = TIMEOUT_S + 5  # every live rank ends within the group's timeout and a margin


def _drift_cases():
    base = fw.SHAPE
    f32, bf16 = torch.float32, torch.bfloat16
    return [
        ("P", base, dict(base, P=32), f32, f32),
        ("S*K", base, dict(base, S=16, K=1), f32, f32),
        ("P64", base, dict(base, P=64), f32, f32),
        ("E", base, dict(base, E=8), f32, f32),
        ("H", base, dict(base, H=32), f32, f32),
        ("F", base, dict(base, F=16), f32, f32),
        ("B", base, dict(base, B=1), f32, f32),
        ("dtype", base, base, f32, bf16),
    ]


def test_config_drift_fails_on_every_rank_naming_the_field():
    res = run_ranks_faulty(fw.config_drift, 2, _drift_cases())
    fields = {"P": ["EPConfig.P: rank 0: 16, rank 1: 32"], "S*K": ["EPConfig.S: rank 0: 8, rank 1: 16",
                                                                  "EPConfig.K: rank 0: 2, rank 1: 1"],
              "P64": ["EPConfig.P: rank 0: 16, rank 1: 64"], "E": ["EPConfig.E: rank 0: 4, rank 1: 8"],
              "H": ["EPConfig.H: rank 0: 16, rank 1: 32"], "F": ["EPConfig.F: rank 0: 8, rank 1: 16"],
              "B": ["EPConfig.B: rank 0: 2, rank 1: 1"], "dtype": ["dtype: rank 0: torch.float32, rank 1: torch.bfloat16"],
              "recompute_rows": ["recompute_rows: rank 0: True, rank 1: False"]}
    for r in res:
        for case, wants in fields.items():
            kind, msg, elapsed = r[case]
            assert kind == "ValueError" and elapsed < FAST_S, (case, r[case])
            for want in wants:
                assert want in msg, (case, msg)
        assert r["agreed"][0] == "ok", r["agreed"]  # the group is still usable: nothing was left in flight
        assert r["default_recompute_rows"] is False  # R > 1: the rows would cross the links again


def test_out_of_step_ranks_fail_fast_and_the_group_can_be_rebuilt():
    r0, r1 = run_ranks_faulty(fw.desync_scenarios, 2, TIMEOUT_S)
    # the bad argument: its rank raises the reason, the peer a named error; both then go on in step
    assert r0["rejected"][0] == "ValueError" and "topk_ids[3, 1] = 99" in r0["rejected"][1], r0["rejected"]
    assert fw.is_named(r1["rejected"], STATUS_PEER_REJECTED) and "rank(s) [0]" in r1["rejected"][1], r1["rejected"]
    for r in (r0, r1):
        assert r["after_rejected"][0] == "ok", r["after_rejected"]
        # each rank's op where they met: rank 0 skipped a forward (it is in the backward's dispatch, rank 1
        # in the second forward's plan), then a backward (it is in the next forward's plan)
        for case, ops_met in (("skip_forward", ("dispatch", "plan")), ("skip_backward", ("plan", "dispatch"))):
            assert fw.is_named(r[case], STATUS_OP_MISMATCH), (case, r[case])
            assert f"rank 0: {ops_met[0]}" in r[case][1] and f"rank 1: {ops_met[1]}" in r[case][1], (case, r[case])
            assert r[case][2] < FAST_S, (case, r[case])
        assert r["rebuilt"][0] == "ok", r["rebuilt"]


@pytest.mark.parametrize("how", ["killed", "stalled"])
def test_a_lost_peer_fails_the_others_within_the_timeout(how):
    r0, _ = run_ranks_faulty(fw.peer_lost, 2, TIMEOUT_S, how)
    assert fw.is_named(r0[how], STATUS_TIMEOUT), r0[how]
    assert "moonep.dispatch" in r0[how][1] or how == "stalled", r0[how]
    assert r0[how][2] < FAST_S, r0[how]
    if how == "stalled":
        assert r0[how][2] >= TIMEOUT_S - 0.5, r0[how]  # it waited the group's timeout, not less


# ------------------------------------------------------------------------------ bad arguments, R = 1
CFG = EPConfig(S=6, H=16, K=3, E=4, F=8, R=1, P=16)


def _setup(group):
    ep = EPGroup(CFG, dtype=torch.float32)
    ep.alloc_weight_buffers()
    ids = torch.tensor([[0, 1, 2], [3, 0, 1], [2, 2, 0], [1, 3, 0], [0, 0, 0], [3, 2, 1]])
    dst_rank, dst_row, primary_row, etc, _, cu, group_rows, _ = ops.plan(ids, CFG.E, CFG.B, CFG.P, CFG.R, ep.ctrl,
                                                                         group)
    x, route_w = torch.randn(CFG.S, CFG.H), torch.rand(CFG.S, CFG.K)
    rows, row_w, row_primary, row_next = ops.dispatch(x, route_w, dst_rank, dst_row, primary_row, cu, group_rows,
                                                      *ep.dispatch_buffers, ep.ctrl, group)
    return ep, dict(x=x, route_w=route_w, dst_rank=dst_rank, dst_row=dst_row, primary_row=primary_row, etc=etc, cu=cu,
                    group_rows=group_rows, rows=rows, row_w=row_w, row_primary=row_primary, row_next=row_next)


def _corrupt(t, idx, value):
    t = t.clone()
    t[idx] = value
    return t


def _primary(dst_rank, dst_row):
    """primary_row that matches (dst_rank, dst_row): the dst_row of each token's first k on the same rank."""
    first = torch.argmax((dst_rank[:, :, None] == dst_rank[:, None, :]).int(), dim=2)
    return torch.gather(dst_row, 1, first)


def _unchanged(before, after):
    for a, b in zip(before, after):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _expect(fn, match, buffers):
    before = [b.clone() for b in buffers]
    with pytest.raises(ValueError, match=match):
        fn()
    _unchanged(before, buffers)


def test_comm_ops_reject_bad_tables_before_writing(gloo1):
    ep, t = _setup(gloo1)
    NvS = CFG.NvS
    recv = list(ep.dispatch_buffers)

    def dispatch(**bad):
        a = {**t, **bad}
        return ops.dispatch(a["x"], a["route_w"], a["dst_rank"], a["dst_row"], a["primary_row"], a["cu"],
                            a["group_rows"], *ep.dispatch_buffers, ep.ctrl, gloo1)

    _expect(lambda: dispatch(primary_row=_corrupt(t["primary_row"], (0, 0), -1)), r"primary_row\[0, 0\] = -1", recv)
    _expect(lambda: dispatch(dst_row=_corrupt(t["dst_row"], (2, 1), NvS)), rf"dst_row\[2, 1\] = {NvS}", recv)
    _expect(lambda: dispatch(dst_rank=_corrupt(t["dst_rank"], (1, 2), 1)), r"dst_rank\[1, 2\] = 1 is outside", recv)
    dup_row = _corrupt(t["dst_row"], (1, 0), int(t["dst_row"][0, 0]))
    _expect(lambda: dispatch(dst_row=dup_row, primary_row=_primary(t["dst_rank"], dup_row)), r"both name row", recv)
    # locally consistent tables that send a row into a group's padding: the receiver refuses them
    pad = int(t["cu"][0]) - 1
    assert pad >= int(t["group_rows"][0]), "group 0 has a padding row"
    padded = _corrupt(t["dst_row"], (4, 0), pad)
    _expect(lambda: dispatch(dst_row=padded, primary_row=_primary(t["dst_rank"], padded)), "padding", recv)

    def combine(**bad):
        a = {**t, **bad}
        return ops.combine(a["rows"], a["row_primary"], a["row_next"], a["dst_rank"], a["dst_row"], a["primary_row"],
                           ep.presum, ep.ctrl, gloo1)

    _expect(lambda: combine(dst_rank=_corrupt(t["dst_rank"], (0, 1), 1)), r"dst_rank\[0, 1\] = 1", [ep.presum])
    _expect(lambda: combine(primary_row=_corrupt(t["primary_row"], (0, 1), NvS)), rf"primary_row\[0, 1\] = {NvS}",
            [ep.presum])
    carrier = int(t["dst_row"][0, 0])
    _expect(lambda: combine(row_primary=_corrupt(t["row_primary"], carrier, NvS)), "row_primary", [ep.presum])

    def gather(**bad):
        a = {**t, **bad}
        return ops.gather_row_weights(a["row_w"], a["dst_rank"], a["dst_row"], ep.row_scratch, ep.ctrl, gloo1)

    _expect(lambda: gather(dst_rank=_corrupt(t["dst_rank"], (5, 2), 3)), r"dst_rank\[5, 2\] = 3", [ep.row_scratch])
    _expect(lambda: gather(dst_row=_corrupt(t["dst_row"], (5, 0), -1)), r"dst_row\[5, 0\] = -1", [ep.row_scratch])


def test_weight_ops_reject_bad_tables_before_writing(gloo1):
    ep, t = _setup(gloo1)
    c = CFG
    w = [torch.randn(c.epn, c.H, c.F), torch.randn(c.epn, c.H, c.F), torch.randn(c.epn, c.F, c.H)]
    bad_etc = _corrupt(t["etc"], (0, 0), c.E)
    _expect(lambda: ops.prefetch_weights(*w, bad_etc, *ep.pools, ep.ctrl, gloo1), rf"experts_to_copy\[0, 0\] = {c.E}",
            list(ep.pools))
    homes = [torch.randn_like(x) for x in w]
    _expect(lambda: ops.reduce_grad(bad_etc, *ep.reduce_buffers, *homes, ep.ctrl, gloo1), "experts_to_copy",
            list(ep.reduce_buffers) + homes)
    remote = torch.tensor([-5], dtype=torch.int32)
    cu = torch.cat([t["cu"], t["cu"][-1:]])
    with pytest.raises(ValueError, match=r"experts_remote\[0\] = -5 is outside \[-1, E=4\)"):
        ops.group_gemm_swiglu(t["rows"], w[0], ep.pools[0], w[1], ep.pools[1], cu, c.P, False, remote, gloo1)
    dw_home, dw_slot = torch.randn(c.epn, c.H, c.F), torch.randn(c.B, c.H, c.F)
    bad_cu = _corrupt(t["cu"], 0, 8)  # not a multiple of P
    _expect(lambda: ops.group_gemm_wgrad(t["rows"], torch.randn(c.NvS, c.F), bad_cu, dw_home, dw_slot, c.P),
            "cu_seqlens", [dw_home, dw_slot])


def test_layer_checks_its_input(gloo1):
    layer = MoELayer(EPGroup(EPConfig(S=8, H=16, K=2, E=4, F=8, R=1, P=16), dtype=torch.float32))
    for x, match in ((torch.randn(16, 8), r"\[\.\.\., H\] with H=16"), (torch.randn(8, 17), "H=16"),
                     (torch.ones(8, 16, dtype=torch.int64), "floating-point"),
                     (torch.ones(8, 16, dtype=torch.bool), "floating-point"),
                     (torch.randn(12, 16), "holds 12 tokens of size H=16, more than the capacity EPConfig.S=8")):
        with pytest.raises(ValueError, match=match):
            layer(x)


def test_sizes_that_overflow_int32_tables_are_refused():
    with pytest.raises(ValueError, match=r"NvS must be < 2\*\*31"):
        EPConfig(S=8, H=16, K=2, E=4, F=8, R=1, P=2**31)
    with pytest.raises(ValueError, match=r"NvS must be < 2\*\*31"):
        EPConfig(S=2**31 - 1, H=16, K=1, E=4, F=8, R=1, P=16)
    with pytest.raises(ValueError, match=r"S\*K\*R must be < 2\*\*31"):
        EPConfig(S=2**28, H=16, K=4, E=4, F=8, R=2, P=16)
    with pytest.raises(ValueError, match="control block"):
        EPConfig(S=1, H=16, K=1, E=2**17, F=8, R=2**14, P=16)


def test_plan_global_validates_its_arguments():
    counts = torch.tensor([[3, 1, 0, 0], [0, 0, 2, 2]], dtype=torch.int32)  # R=2, E=4, S*K=4
    ok = planning.plan_global(counts, 2, 2, 2, 16)
    assert int(ok.cu_seqlens[0, -1]) > 0
    for args, match in (((counts, 2, 2, 3, 16), r"B must be in \[0, epn\] = \[0, 2\], got B=3"),
                        ((counts, 2, 2, 2, 0), "P must be a power of two, got P=0"),
                        ((counts, 2, 2, 2, 24), "P must be a power of two, got P=24"),
                        ((counts, 2, 2, 2, 2**31), r"NvS must be < 2\*\*31"),
                        ((counts, 2**30, 2, 2, 16), r"S\*K\*R must be < 2\*\*31"),
                        ((counts.float(), 2, 2, 2, 16), "int32/int64 \\[R, E\\]"),
                        ((counts[0], 2, 2, 2, 16), "int32/int64 \\[R, E\\]"),
                        ((counts[:, :3], 2, 2, 1, 16), "E must be a positive multiple of R"),
                        ((_corrupt(counts, (0, 0), -1), 2, 2, 2, 16), r"counts\[0, 0\] = -1"),
                        ((_corrupt(counts, (1, 3), 3), 2, 2, 2, 16), r"row sums \[4, 5\]")):
        with pytest.raises(ValueError, match=match):
            planning.plan_global(*args)
