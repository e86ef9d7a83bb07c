"""Multi-process gloo runs of MoELayer against a single-process dense MoE with the same weights."""

import pytest
import torch

import ep_workers
from moonep_ops import EPConfig, dense_moe
from moonep_ops.launch import run_ranks
from moonep_ops.planning import maxvio, rank_imbalance

SHAPE = dict(S=12, H=16, K=3, F=8, P=16)


def dense_reference(cfg, skew):
    x_all, router, w_gate, w_up, w_down, grad_out = ep_workers.global_weights(cfg, skew)
    leaves = [t.clone().requires_grad_() for t in (x_all, router, w_gate, w_up, w_down)]
    y = dense_moe(*leaves, K=cfg.K)
    y.backward(grad_out)
    return y.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("R", [1, 2, 4, 8])
def test_moe_layer_matches_dense(R):
    cfg_kwargs = dict(SHAPE, E=4 * R)
    cfg = EPConfig(R=R, **cfg_kwargs)
    res = run_ranks(ep_workers.forward_backward, R, cfg_kwargs, ("uniform", "extreme"))
    for skew in ("uniform", "extreme"):
        y_ref, (gx, grouter, ggate, gup, gdown) = dense_reference(cfg, skew)
        per = [r[skew] for r in res]
        tol = dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.cat([p["y"] for p in per]), y_ref, **tol)
        torch.testing.assert_close(torch.cat([p["x"] for p in per]), gx, **tol)
        torch.testing.assert_close(sum(p["router"] for p in per), grouter, **tol)  # data-parallel router
        torch.testing.assert_close(torch.cat([p["gate"] for p in per]), ggate, **tol)
        torch.testing.assert_close(torch.cat([p["up"] for p in per]), gup, **tol)
        torch.testing.assert_close(torch.cat([p["down"] for p in per]), gdown, **tol)
        counts = per[0]["counts"]
        if skew == "extreme" and R > 1:  # the skew is real: the hottest experts get every token
            assert maxvio(counts) >= 0.9 * (cfg.E / cfg.K - 1)  # the most K distinct experts allow
            assert rank_imbalance(counts) > 1.5


def test_two_runs_bitwise_identical():
    cfg_kwargs = dict(SHAPE, E=8)
    a = run_ranks(ep_workers.forward_backward, 2, cfg_kwargs, ("extreme",))
    b = run_ranks(ep_workers.forward_backward, 2, cfg_kwargs, ("extreme",))
    for ra, rb in zip(a, b):
        for key, t in ra["extreme"].items():
            assert torch.equal(t, rb["extreme"][key]), key


def test_recompute_rows_is_bitwise_the_kept_rows():
    """EPGroup(recompute_rows=True): the experts keep the tokens [S, H] instead of the dispatched rows
    [NvS, H] and their backward dispatches the tokens again; outputs and every gradient are bitwise
    those of the default (2 ranks, the extreme skew: the plan copies experts, so prefetch and
    reduce_grad run around the extra dispatch)."""
    cfg_kwargs = dict(SHAPE, E=8)
    cfg = EPConfig(R=2, **cfg_kwargs)
    kept = run_ranks(ep_workers.forward_backward, 2, cfg_kwargs, ("extreme",))
    again = run_ranks(ep_workers.forward_backward, 2, cfg_kwargs, ("extreme",), dict(recompute_rows=True))
    for ra, rb in zip(kept, again):
        assert rank_imbalance(ra["extreme"]["counts"]) > 1.5  # rank 1's experts get nearly every row: copies
        for key, t in ra["extreme"].items():
            assert torch.equal(t, rb["extreme"][key]), key
        assert (cfg.NvS, cfg.H) in ra["extreme kept"] and (cfg.S, cfg.H) not in ra["extreme kept"]
        assert (cfg.NvS, cfg.H) not in rb["extreme kept"] and (cfg.S, cfg.H) in rb["extreme kept"]


def test_backward_with_unused_outputs():
    """Dispatch's row weights unused (unit weights instead): every gradient still matches the dense
    sum over each token's K experts, and the route weights get no gradient."""
    cfg_kwargs = dict(SHAPE, E=8)
    cfg = EPConfig(R=2, **cfg_kwargs)
    res = run_ranks(ep_workers.partial_use, 2, cfg_kwargs)
    x_all, router, w_gate, w_up, w_down, _ = ep_workers.global_weights(cfg, "extreme")
    ids = torch.topk(x_all @ router.t(), cfg.K).indices
    leaves = [t.clone().requires_grad_() for t in (x_all, w_gate, w_up, w_down)]
    x, wg, wu, wd = leaves
    y = sum(torch.bmm(torch.nn.functional.silu(torch.bmm(x[:, None], wg[ids[:, k]]))
                      * torch.bmm(x[:, None], wu[ids[:, k]]), wd[ids[:, k]]) for k in range(cfg.K))
    y.sum().backward()
    tol = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat([r["x"] for r in res]), x.grad, **tol)
    for name, leaf in (("gate", wg), ("up", wu), ("down", wd)):
        torch.testing.assert_close(torch.cat([r[name] for r in res]), leaf.grad, **tol)
    assert all(r["route_w"] is None or not r["route_w"].any() for r in res)


def _cpu_grouped_mm_works() -> bool:
    try:
        torch._grouped_mm(torch.ones(2, 8), torch.ones(1, 8, 8), offs=torch.tensor([2], dtype=torch.int32))
        return True
    except (RuntimeError, NotImplementedError):
        return False


@pytest.mark.skipif(not _cpu_grouped_mm_works(), reason="this torch has no CPU torch._grouped_mm")
@pytest.mark.parametrize("R", [1, 2, 4])
def test_baseline_ep_path_matches_dense(R):
    """The benchmarks' baseline (all_to_all with host split sizes + _grouped_mm) is itself correct."""
    cfg_kwargs = dict(SHAPE, E=4 * R)
    cfg = EPConfig(R=R, **cfg_kwargs)
    res = run_ranks(ep_workers.baseline_forward_backward, R, cfg_kwargs, "extreme")
    y_ref, (gx, grouter, ggate, gup, gdown) = dense_reference(cfg, "extreme")
    tol = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat([r["y"] for r in res]), y_ref, **tol)
    torch.testing.assert_close(torch.cat([r["x"] for r in res]), gx, **tol)
    torch.testing.assert_close(sum(r["router"] for r in res), grouter, **tol)
    for name, want in (("gate", ggate), ("up", gup), ("down", gdown)):
        torch.testing.assert_close(torch.cat([r[name] for r in res]), want, **tol)


@pytest.mark.parametrize("R", [1, 2, 4])
def test_multi_layer_model_matches_dense(R):
    """Three MoE blocks share one EPGroup's buffers (receive tables, slot pools, reduce buffers): the
    forward and every gradient equal a dense model's, so no layer sees another layer's copies."""
    n_layers = 3
    cfg_kwargs = dict(SHAPE, E=4 * R)
    cfg = EPConfig(R=R, **cfg_kwargs)
    res = run_ranks(ep_workers.model_forward_backward, R, cfg_kwargs, n_layers)
    ref = ep_workers.dense_model_reference(cfg, n_layers)
    tol = dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.cat([r["y"] for r in res]), ref["y"], **tol)
    torch.testing.assert_close(torch.cat([r["x"] for r in res]), ref["x"], **tol)
    got = ep_workers.gather_model_grads([r["grads"] for r in res])
    assert got.keys() == ref["grads"].keys()
    for name, want in ref["grads"].items():
        torch.testing.assert_close(got[name], want, **tol, msg=lambda m, name=name: f"{name}: {m}")


def test_no_grad_forward_equals_training_forward():
    """Under torch.no_grad the experts keep no pre-activations (inference): the output is unchanged."""
    res = run_ranks(ep_workers.no_grad_forward, 2, dict(SHAPE, E=8))
    assert res == [True, True]


@pytest.mark.parametrize("R", [2, 4])
def test_inference_small_B_matches_dense(R):
    """Inference with B=1 slot (epn=4): the copies without a slot are read from their home rank (here
    with gloo; on CUDA through the peer mapping); the output equals the dense MoE's, eager and, at R = 2,
    compiled (fullgraph; for the skewed routing, which really reads copies remotely). The compiled graph
    is the same at R = 4 (the same op calls, the remote reads inside the ops), so R = 4 runs eager only:
    four ranks each compiling cost more than the rest of the test."""
    cfg_kwargs = dict(SHAPE, E=4 * R, B=1)
    cfg = EPConfig(R=R, **cfg_kwargs)
    compiled_skews = ("extreme",) if R == 2 else ()
    res = run_ranks(ep_workers.inference_forward, R, cfg_kwargs, ("uniform", "extreme"), compiled_skews)
    for skew in ("uniform", "extreme"):
        y_ref, _ = dense_reference(cfg, skew)
        tol = dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.cat([r[skew]["y"] for r in res]), y_ref, **tol)
        if skew in compiled_skews:
            torch.testing.assert_close(torch.cat([r[skew]["compiled"] for r in res]), y_ref, **tol)
    assert sum(r["extreme"]["n_remote"] for r in res) >= 1


def test_training_with_small_B_is_refused():
    res = run_ranks(ep_workers.train_small_B, 2, dict(SHAPE, E=8, B=1))
    assert all("inference only" in msg for msg in res), res


@pytest.mark.parametrize("R", [1, 2, 4])
def test_tokens_per_call_up_to_capacity_match_dense(R):
    """Steps where every rank passes a different number s <= S of tokens (0 and 1 included): forward
    and every gradient equal the dense MoE on the concatenated present tokens; each rank computes
    exactly N // R (+1 on the first N % R ranks) rows; the capacity + n_tokens form equals the s form."""
    steps = 5
    cfg_kwargs = dict(SHAPE, E=4 * R)
    cfg = EPConfig(R=R, **cfg_kwargs)
    res = run_ranks(ep_workers.variable_tokens, R, cfg_kwargs, steps)
    x_all, router, w_gate, w_up, w_down, grad_out = ep_workers.global_weights(cfg, "extreme")
    tol = dict(rtol=1e-5, atol=1e-5)
    for step in range(steps):
        per = [r["steps"][step] for r in res]
        sizes = [p["s"] for p in per]
        assert sizes == [ep_workers.token_counts(cfg, step, r) for r in range(R)]
        present = torch.cat([torch.arange(r * cfg.S, r * cfg.S + s) for r, s in enumerate(sizes)])
        leaves = [t.clone().requires_grad_() for t in (x_all[present], router, w_gate, w_up, w_down)]
        y = dense_moe(*leaves, K=cfg.K)
        if y.requires_grad:
            y.backward(grad_out[present])
        for t in leaves:  # no token at all (R = 1, s = 0): every gradient is zero
            t.grad = torch.zeros_like(t) if t.grad is None else t.grad
        torch.testing.assert_close(torch.cat([p["y"] for p in per]), y.detach(), **tol)
        torch.testing.assert_close(torch.cat([p["x"] for p in per]), leaves[0].grad, **tol)
        torch.testing.assert_close(sum(p["router"] for p in per), leaves[1].grad, **tol)
        for i, name in enumerate(("gate", "up", "down")):
            torch.testing.assert_close(torch.cat([p[name] for p in per]), leaves[2 + i].grad, **tol)
        N = sum(sizes) * cfg.K
        assert [p["computed"] for p in per] == [N // R + (1 if d < N % R else 0) for d in range(R)]
    assert all(r["capacity_form_zero_past"] and r["capacity_form_diff"] < 1e-5 for r in res), [(r["capacity_form_diff"], r["capacity_form_zero_past"]) for r in res]


def test_changing_token_counts_compile_once():
    """The capacity + n_tokens form under torch.compile(fullgraph=True): 13 steps with different
    counts (each rank passes every count 0..S=12 once, the ranks' counts differing at each step),
    0 recompiles; x with changing s under dynamic=True: no recompile after the first two shapes; both
    equal eager."""
    res = run_ranks(ep_workers.compiled_token_counts, 2, dict(SHAPE, E=8), SHAPE["S"] + 1)
    for r in res:
        assert r["count_recompiles"] == 0 and r["count_frames"] == 1, r
        assert r["count_diff"] < 1e-5 and r["dynamic_diff"] < 1e-5, r
        assert r["dynamic_recompiles_after_two"] == 0, r


def test_too_many_tokens_and_bad_n_tokens():
    msgs = run_ranks(ep_workers.too_many_tokens, 2, dict(SHAPE, E=8))[0]
    assert "MoELayer: x holds 13 tokens of size H=16, more than the capacity EPConfig.S=12" in msgs[0]
    assert "MoELayer: with n_tokens, x must hold the capacity EPConfig.S=12 tokens" in msgs[1]
    assert "moe_experts: n_tokens must be in [0, EPConfig.S=12], got 13" in msgs[2]  # MoELayer runs moe_experts
    assert "moe_experts: n_tokens must be an int32/int64 tensor [1]" in msgs[3]


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_run_ranks_start_methods(monkeypatch, method):
    """MOONEP_START_METHOD picks how rank processes start (forkserver by default); both give every rank its
    own process with its rank and world size; another value is refused, naming the variable."""
    import os

    monkeypatch.setenv("MOONEP_START_METHOD", method)
    res = run_ranks(ep_workers.process_facts, 2)
    assert [(r["rank"], r["R"]) for r in res] == [(0, 2), (1, 2)]
    assert len({r["pid"] for r in res} | {os.getpid()}) == 3
    if method == "forkserver":  # forks of one server process, not children of this one
        assert res[0]["parent"] == res[1]["parent"] != os.getpid()
    else:
        assert res[0]["parent"] == res[1]["parent"] == os.getpid()
    monkeypatch.setenv("MOONEP_START_METHOD", "fork")
    with pytest.raises(ValueError, match="MOONEP_START_METHOD must be 'forkserver' or 'spawn'"):
        run_ranks(ep_workers.process_facts, 1)
