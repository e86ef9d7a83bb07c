"""CPU smoke checks of the benchmark scripts (CI keeps them working without a GPU)."""

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_forced_router_picks_the_target_experts():
    """The benchmark's routing control: the logit bias makes top-K pick exactly the given experts whatever
    the Linear's logits (here scaled up to |logit| ~ 3), and the router still gets a gradient."""
    from benchmarks.routing_gen import ForcedRouter
    from moonep_ops.routing import route

    S, H, E, K = 256, 64, 32, 8
    lin = torch.nn.Linear(H, E, bias=False)
    with torch.no_grad():
        lin.weight.mul_(3 / lin.weight.norm(dim=1, keepdim=True))  # logits ~ N(0, 3^2), 5x the default init
    router = ForcedRouter(lin, S)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(S)])
    router.set_ids(ids)
    x = torch.randn(S, H)
    w, got = route(router(x), K)
    assert torch.equal(got.sort(1).values, ids.sort(1).values)
    (w * torch.randn_like(w)).sum().backward()
    assert lin.weight.grad is not None and lin.weight.grad.abs().sum() > 0


def run_smoke(tmp_path_factory, name: str):
    """`benchmarks/<name>.py --smoke` (CPU, gloo) into a temporary folder: (stdout, its JSON, the JSON's path)."""
    out = tmp_path_factory.mktemp(name)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", f"{name}.py"), "--smoke", "--out",
                           str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout, json.load(open(out / f"{name}.json")), out / f"{name}.json"


@pytest.fixture(scope="module")
def e2e_smoke(tmp_path_factory):
    return run_smoke(tmp_path_factory, "bench_e2e")


def test_bench_e2e_smoke_runs_every_cpu_variant(e2e_smoke):
    stdout, d, _ = e2e_smoke
    assert d["smoke"] and d["device"] == "cpu" and d["R"] == 2
    for key in ("gpu", "command", "commit", "date", "torch"):
        assert key in d
    # E = 16, K = 2: maxvio capped at E/K - 1 = 7, so 0.2, 1, 2, 5 run and 10, 20 are skipped
    assert [r["maxvio_target"] for r in d["layer"]] == [0.2, 1.0, 2.0, 5.0]
    assert [r["maxvio_target"] for r in d["model"]] == [0.2, 1.0, 2.0, 5.0]
    for what, variants in (("layer", ("ours_eager", "ours_compiled", "base_eager", "base_compiled")),
                           ("model", ("ours_eager", "ours_compiled", "base_eager"))):
        for r in d[what]:
            for v in variants:
                assert r[f"{v}_ms"] > 0, (what, v, r)
                assert r[f"{v}_peak_gb"] is None  # CPU: no peak memory
            assert "ours_graph_ms" not in r  # CPU: no CUDA graph
            assert r["ours_eager_routing_ok"] and r["base_eager_routing_ok"], (what, r)
            assert r["ours_eager_planned_counts_ok"], (what, r)
            assert r["speedup_vs_base_eager"] > 0
    notes = d["notes"]
    assert notes["layer_ours_compiled_dynamo"]["graph_breaks"] == 0
    assert "recompiles" in notes["model_ours_compiled_dynamo"]
    assert notes["layer_base_fullgraph"]  # what happened to the baseline under fullgraph=True is recorded
    assert "layer_ours_graph" in notes and "skipped" in notes["layer_ours_graph"]
    assert d["summary"]["layer"]["min_speedup_at_maxvio_ge5"] is not None
    assert "MoE layer" in stdout and "2-layer MoE model" in stdout and "x base" in stdout


def test_bench_e2e_plot(e2e_smoke):
    pytest.importorskip("matplotlib")
    from benchmarks.plot_results import plot_e2e

    _, _, path = e2e_smoke
    plot_e2e(str(path))
    assert os.path.getsize(str(path).replace(".json", ".png")) > 10_000


@pytest.fixture(scope="module")
def inference_smoke(tmp_path_factory):
    return run_smoke(tmp_path_factory, "bench_inference")


def test_bench_inference_smoke_runs_every_cpu_variant(inference_smoke):
    import math

    stdout, d, path = inference_smoke
    assert d["smoke"] and d["device"] == "cpu" and d["R"] == 2 and d["S"] == [32, 64]
    for key in ("gpu", "command", "commit", "date", "torch"):
        assert key in d
    # E = 16, K = 2: maxvio capped at E/K - 1 = 7, so 0.2, 1, 2, 5 run and 10 is skipped
    assert [(r["S"], r["maxvio_target"]) for r in d["rows"]] == [(S, t) for S in (32, 64) for t in (0.2, 1.0, 2.0, 5.0)]
    H, F, epn, B = d["H"], d["F"], d["epn"], d["small_B"]
    assert d["pools"]["ours_full"]["pool_bytes"] == 3 * epn * H * F * 2
    assert d["pools"]["ours_b3"]["pool_bytes"] == 3 * B * H * F * 2
    for r in d["rows"]:
        for v in ("ours_full", "ours_b3", "base"):
            assert math.isfinite(r[f"{v}_ms"]) and r[f"{v}_ms"] > 0, (v, r)
            assert r[f"{v}_peak_gb"] is None  # CPU: no peak memory
            assert r[f"{v}_routing_ok"], (v, r)
            assert math.isfinite(r[f"{v}_rel_diff_vs_full"]), (v, r)
        assert r["ours_full_planned_counts_ok"] and r["ours_b3_planned_counts_ok"], r
        assert r["ours_full_rel_diff_vs_full"] == 0.0
        assert r["ours_b3_rel_diff_vs_full"] < 1e-2 and r["base_rel_diff_vs_full"] < 5e-2, r  # the same weights
        # the same copies whatever B: B = epn puts them all in slots, small B reads the rest remotely
        assert [s + g for s, g in zip(r["ours_b3_slots_used"], r["ours_b3_remote_groups"])] == r["ours_full_slots_used"]
        assert all(s <= B for s in r["ours_b3_slots_used"]) and r["ours_full_remote_groups"] == [0, 0]
        assert "ours_b3_graph_ms" not in r  # CPU: no CUDA graph
        assert r["b3_over_full"] > 0 and r["full_speedup_vs_base"] > 0
    assert any(sum(r["ours_b3_remote_groups"]) > 0 for r in d["rows"])  # the remote-read path ran
    assert "skipped" in d["notes"]["S32_ours_b3_graph"]
    assert "b3/full" in stdout
    log = open(str(path).replace(".json", ".log")).read()
    assert "ours_b3" in log and "b3/full" in log


def test_bench_inference_plot(inference_smoke):
    pytest.importorskip("matplotlib")
    from benchmarks.plot_results import plot_inference

    _, _, path = inference_smoke
    plot_inference(str(path))
    assert os.path.getsize(str(path).replace(".json", ".png")) > 10_000
