"""The CUDA EP group on real ranks (one GPU each, NCCL + symmetric memory): the planner with its
NVLink count exchange, barriers and status; dispatch/combine. Skipped unless enough GPUs exist.

Rerun on a GPU machine: `python3 -m pytest -q tests/test_ep_cuda.py` (uses 1 and, if present, 2 GPUs).
"""

import pytest
import torch

import cuda_workers
from moonep_ops.launch import run_ranks

N_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def world_sizes():
    return [pytest.param(R, marks=pytest.mark.skipif(N_GPUS < R, reason=f"needs {R} GPUs")) for R in (1, 2)]


def plan_configs(R):
    return [
        dict(S=256, K=8, E=48 * R, ids=torch.int64),
        dict(S=512, K=4, E=8 * R, B=2, P=32, ids=torch.int32),      # inference: 2 slots, the rest remote
        dict(S=1000, K=6, E=16 * R, P=16, ids=torch.int32),
        dict(S=64, K=2, E=2 * R, P=16, ids=torch.int64),
        dict(S=8192, K=8, E=48 * R, ids=torch.int32),                # benchmark shape
        dict(S=3, K=3, E=4 * R, P=16, ids=torch.int64),              # tiny S
    ]


@pytest.mark.parametrize("R", world_sizes())
def test_plan_bitexact_on_real_ranks(R):
    res = run_ranks(cuda_workers.plan_bitexact, R, plan_configs(R), 19, backend="nccl")
    for rank, r in enumerate(res):
        assert r["checked"] == 6 * 19 * 2, r["checked"]  # each routing full, then with absent tokens
        assert not r["bad"], (rank, r["bad"][:5])


@pytest.mark.parametrize("R", world_sizes())
def test_plan_repeat_graph_and_no_host_sync(R):
    res = run_ranks(cuda_workers.plan_repeat_graph_nosync, R, 1000, backend="nccl")
    for rank, r in enumerate(res):
        assert r["repeat_bad"] == 0 and r["repeat_status"] == 0, (rank, r)
        assert not r["graph_bad"], (rank, r["graph_bad"])
        assert r["sync_error"] is None and r["nosync_ok"], (rank, r["sync_error"])
        assert r["final_status"] == 0, (rank, r)


@pytest.mark.parametrize("R", world_sizes())
def test_plan_bad_expert_id_reported(R):
    res = run_ranks(cuda_workers.plan_bad_expert_id, R, backend="nccl")
    assert res[0]["msg"] is not None and "outside [0, E)" in res[0]["msg"], res[0]
    for r in res:
        assert r["after"] == 0, r


@pytest.mark.skipif(N_GPUS < 2, reason="needs 2 GPUs")
def test_missing_rank_times_out_instead_of_hanging():
    res = run_ranks(cuda_workers.barrier_timeout, 2, backend="nccl")
    r0 = res[0]
    assert r0["error"] is not None and "timed out" in r0["error"], r0
    assert 0.4 < r0["waited_s"] < 10, r0
    assert all(r["status_after"] == 0 for r in res), res


@pytest.mark.parametrize("R", world_sizes())
def test_dispatch_combine_on_real_ranks(R):
    cfg_kwargs = dict(S=384, H=256, K=8, E=16 * R, F=8, P=32)
    res = run_ranks(cuda_workers.dispatch_combine_traceable, R, cfg_kwargs, 8, 1000, backend="nccl")
    for rank, r in enumerate(res):
        assert not r["fails"], (rank, r["fails"][:6])
        assert r["max_remote_rows"] <= min(cfg_kwargs["K"], R), r
        assert r["repeat_diff"] == 0 and r["graph_ok"], (rank, r)
        assert r["sync_error"] is None, (rank, r["sync_error"])
        assert r["status"] == 0, (rank, r)


@pytest.mark.parametrize("R", world_sizes())
@pytest.mark.parametrize("skew", ["uniform", "extreme"])
def test_moe_layer_matches_dense_reference(R, skew):
    cfg_kwargs = dict(S=256, H=256, K=4, E=8 * R, F=128, P=64)
    compiled = skew == "extreme" and R == 1  # Inductor's compile takes minutes per rank on the GPU machine
    res = run_ranks(cuda_workers.moe_layer_vs_dense, R, cfg_kwargs, skew, compiled, backend="nccl")

    def close(got, want, what):
        err = (got - want).abs().max() / want.abs().max().clamp_min(1e-6)
        assert err < 3e-2, (what, float(err))

    for r, out in enumerate(res):
        assert out["bitwise"], r
        assert out["gathered"] == (R == 1), r  # the default: the gathered path at R = 1 only
        assert out["rows_mode_differ"] == [], (r, "differ with another row mode (gather_rows / recompute_rows)")
        for name, got, want in zip(out["names"][:2], out["got"][:2], out["ref"][:2]):
            close(got, want, (r, name))
        if "compiled" in out:
            for name, a, b in zip(out["names"], out["compiled"], out["got"]):
                close(a, b, (r, "compiled", name))
    # data-parallel router: the ranks' router gradients sum; each rank owns epn experts' gradients
    close(sum(o["got"][2] for o in res), sum(o["ref"][2] for o in res), "router")
    for i, name in enumerate(("gate", "up", "down")):
        ref = sum(o["ref"][3 + i] for o in res)
        got = torch.cat([o["got"][3 + i] for o in res])
        close(got, ref, name)
    if skew == "extreme" and R > 1:
        counts = res[0]["counts"]
        assert counts.sum(0).max() > 2 * counts.sum(0).float().mean()  # the skew is real: copies were planned


@pytest.mark.skipif(N_GPUS < 1, reason="needs a GPU")
@pytest.mark.parametrize("skew", ["uniform", "extreme"])
def test_one_rank_allocates_only_what_its_kernels_read(skew):
    """R = 1 on CUDA: no symmetric memory, no send_rows / presum / slot pools / reduce buffers
    (moonep_ops/buffers.py). The group's buffers are the layout's bytes (under 1% of the full layout's,
    which is ~0.7 GB at this shape), and all the memory the group and layer take beyond the weights is
    far below the full layout's; the layer's forward and gradients match the dense fp32 reference
    and are bitwise those of the full symmetric layout (the R = 1 allocation before)."""
    cfg_kwargs = dict(S=2048, H=2048, K=8, E=16, F=1024, P=128)
    (r,) = run_ranks(cuda_workers.one_rank_buffers, 1, cfg_kwargs, skew, backend="nccl")
    lean, full = r["lean"], r["full"]
    assert not lean["layout"].symmetric and not lean["layout"].copies, lean
    assert lean["buffer_bytes"] == r["lean_layout_bytes"] and full["buffer_bytes"] == r["full_layout_bytes"], r
    assert r["lean_layout_bytes"] * 100 < r["full_layout_bytes"], r
    assert lean["device_bytes"] < 0.2 * r["full_layout_bytes"], lean  # its buffers, x and the output gradient
    assert not r["bitwise_vs_full"], r["bitwise_vs_full"]
    # the exact check is the bitwise one above; against fp32 the bf16 roundings of this wider shape (H=2048,
    # F=1024, K=8: gate/up/h and the K-row sums stored in bf16) reach 3.5e-2 in x's gradient on an H200
    for name, got, want in zip(r["names"], r["got"], r["ref"]):
        err = (got - want).abs().max() / want.abs().max().clamp_min(1e-6)
        assert err < 5e-2, (name, float(err))


@pytest.mark.parametrize("R", world_sizes())
def test_moe_layer_tokens_per_call_up_to_capacity(R):
    """s <= S tokens per call, different per rank and step (0 and 1 included): forward and input
    gradient match the dense fp32 reference; the compiled capacity + n_tokens form equals eager with
    zero rows past the count and 0 recompiles."""
    cfg_kwargs = dict(S=256, H=256, K=4, E=8 * R, F=128, P=64)
    res = run_ranks(cuda_workers.moe_layer_tokens_vs_dense, R, cfg_kwargs, 5, backend="nccl")
    for rank, r in enumerate(res):
        assert r["max_err"] < 3e-2, (rank, r)
        assert not r["cap_bad"] and r["recompiles"] == 0, (rank, r)


@pytest.mark.parametrize("R", world_sizes())
def test_inference_small_B(R):
    """B=3 slots of epn=16: copies without a slot are read from their home rank's weights through the
    peer mapping. The output is bitwise the B=epn layer's, close to the dense fp32 formula, and the
    same compiled and under CUDA-graph replay; at R=2 the skewed routing really reads copies remotely
    (rank 0 takes 5 of rank 1's experts: 3 slots, 2 remote groups)."""
    cfg_kwargs = dict(S=256, H=256, K=8, E=16 * R, F=128, P=64)
    res = run_ranks(cuda_workers.inference_small_B, R, cfg_kwargs, 3, ("uniform", "extreme"), backend="nccl")
    for rank, r in enumerate(res):
        assert r["status"] == [0, 0], (rank, r)
        for skew in ("uniform", "extreme"):
            o = r[skew]
            assert o["bitwise_vs_full"], (rank, skew, o)
            assert o["dense_err"] < 3e-2 and o["compiled_diff"] < 3e-2 and o["graph_bitwise"], (rank, skew, o)
    if R > 1:
        assert sum(r["extreme"]["n_remote"] for r in res) >= 1, [r["extreme"] for r in res]


@pytest.mark.parametrize("R", world_sizes())
def test_compiled_model_contract(R):
    """Two MoE blocks on one EPGroup, on the GPU: eager equals the dense fp32 model; torch.compile
    (fullgraph) over 50 differently routed steps with no recompile and equal to eager; no host sync in a
    warm compiled training step (and the check does catch a planted .item()); CUDA-graph replay
    (mode="reduce-overhead") bitwise equal to the plain compiled step; export equals eager; peak memory of
    a training step the same at uniform and skewed routing."""
    import ep_workers
    from moonep_ops import EPConfig

    n_layers, steps = 2, 50
    cfg_kwargs = dict(S=256, H=256, K=4, E=8 * R, F=128, P=64)
    res = run_ranks(cuda_workers.compiled_model_contract, R, cfg_kwargs, n_layers, steps, backend="nccl")
    ids = [torch.cat([r["eager"]["ids"][i] for r in res]) for i in range(n_layers)]  # bf16 routing, all ranks
    ref = ep_workers.dense_model_reference(EPConfig(R=R, **cfg_kwargs), n_layers, ids)

    def close(got, want, what):
        # relative Frobenius error: bf16 through two residual blocks (RMSNorm backward cancels terms, so
        # a few elements' relative error is large while the tensor's is ~1e-2; a broken layer gives ~1)
        err = (got - want).norm() / want.norm().clamp_min(1e-6)
        assert err < 3e-2, (what, float(err))

    close(torch.cat([r["eager"]["y"] for r in res]), ref["y"], "y")
    close(torch.cat([r["eager"]["x"] for r in res]), ref["x"], "x")
    got = ep_workers.gather_model_grads([r["eager"]["grads"] for r in res])
    for name, want in ref["grads"].items():
        close(got[name], want, name)
    # Top-K picks K distinct experts per token, so the hottest expert's load is at most E/K times the
    # mean (2 at R=1: E=8, K=4). The skewed steps reach 1.7-1.9 there and 2.5-2.8 at R=2 (fp32 on the
    # CPU); uniform steps stay below 1.25. Require 3/4 of that ceiling, and > 2 where it is reachable.
    want_load = min(2.0, 0.75 * cfg_kwargs["E"] / cfg_kwargs["K"])
    for rank, r in enumerate(res):
        print(rank, {k: v for k, v in r.items() if k != "eager"})
        # the routing really changes and skews
        assert r["distinct_routings"] == steps and r["max_load"] > want_load, (want_load, r)
        assert r["frames"] == 1 and r["recompiles"] == 0 and r["graph_breaks"] == 0, r
        assert r["compiled_vs_eager"] < 5e-2, r
        assert r["syncs"] == [], r["syncs"]
        assert r["syncs_planted"], "the host-sync check missed a planted .item()"
        assert all(r["graphs_bitwise"]), {k: r[k] for k in (
            "graphs_bitwise", "graphs_diff", "graphs_differing", "replays_vs_first_replay",
            "compiled_repeat_differing", "second_compile_differing", "eager_repeat_differing",
            "eager_nan_filled_nonfinite", "eager_nan_filled_differing", "eager_nan_filled_status")}
        assert r["export_diff"] < 1e-2, r
        peaks = r["peaks"]
        for mode in ("eager", "compiled"):
            u, s = peaks[f"{mode}/uniform"], peaks[f"{mode}/skewed"]
            assert abs(u - s) <= 0.01 * u, (mode, peaks)


@pytest.mark.parametrize("R", world_sizes())
def test_precompile_compiles_ahead_and_the_step_only_loads(R, tmp_path):
    """From an empty kernel disk cache: `precompile` (training) names the kernels of every family a step
    runs (plan, dispatch, the grouped GEMMs, combine; sync's exchange and barriers with R > 1) and compiles
    them side by side (some in child processes); the training step after it then compiles nothing itself
    (it only loads what the children wrote), and a second precompile finds nothing missing. Then the same
    for inference, whose fused SwiGLU keeps no pre-activations: only that kernel is new (at R = 1 the
    gathered one: EPGroup(gather_rows))."""
    cfg_kwargs = dict(S=256, H=256, K=4, E=8 * R, F=128, P=64)
    res = run_ranks(cuda_workers.precompile_cold, R, cfg_kwargs, str(tmp_path / "cache"),
                    str(tmp_path / "compiles.jsonl"), 4, backend="nccl")
    # every rank's dry run sees the disk as the others fill it: the ranks' records together name every kernel
    train_calls = {c for r in res for c in r["train"]["calls"]}
    assert {m for m, _ in train_calls} >= {"csrc_cute.plan", "csrc_cute.dispatch", "csrc_cute.combine",
                                           "csrc_cute.group_gemm.host"}, train_calls
    swiglu = "compile_group_gemm_swiglu_gather" if R == 1 else "compile_group_gemm_swiglu"
    assert {c for r in res for c in r["inference"]["calls"]} == {("csrc_cute.group_gemm.host", swiglu)}, res
    for rank, r in enumerate(res):
        for kind in ("train", "inference"):
            got = r[kind]
            assert all(e == "loaded" for _, e, _ in got["step_events"]), (rank, kind, got["step_events"])
            assert got["again"] == 0 and got["finite"], (rank, kind, got)
    built = [(fam, mine) for fam, e, mine in res[0]["events"] if e == "built"]
    assert any(not mine for _, mine in built), built  # some kernels were built by compile-ahead children
