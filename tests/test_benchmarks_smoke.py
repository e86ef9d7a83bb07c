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


# the tests of one smoke run (a module fixture) run on one pytest-xdist worker (`make test`: --dist
# loadgroup), so each benchmark's smoke run runs once, not once per worker
def on_smoke(fixture: str):
    return pytest.mark.xdist_group(fixture)


@pytest.fixture(scope="module")
def e2e_smoke(tmp_path_factory):
    return run_smoke(tmp_path_factory, "bench_e2e")


@on_smoke("e2e_smoke")
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


@pytest.fixture(scope="module")
def inference_smoke(tmp_path_factory):
    return run_smoke(tmp_path_factory, "bench_inference")


@on_smoke("inference_smoke")
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


def test_bench_peers_exact_routing_picks_the_target_experts():
    """x @ W_router^T is the designed logits up to bf16 rounding: top-K is the target in bf16 and fp32, with the
    margin between the last picked expert and the rest far above the rounding."""
    from benchmarks.bench_peers import OTHER_LOGIT, PICKED_STEP, PICKED_TOP, exact_routing_inputs
    from moonep_ops.routing import route

    S, H, E, K = 512, 256, 16, 4
    x, w, ids = exact_routing_inputs(S, H, E, K, seed=3)
    assert x.dtype == w.dtype == torch.bfloat16 and x.shape == (S, H) and w.shape == (E, H)
    for logits in (x.float() @ w.float().t(), (x @ w.t()).float()):
        _, got = route(logits, K)
        assert torch.equal(got.sort(1).values, ids.sort(1).values)
        picked = logits.gather(1, ids)
        want = PICKED_TOP - PICKED_STEP * torch.arange(K, dtype=torch.float32)
        assert (picked - want).abs().max() < 2e-2
        others = logits.scatter(1, ids, float("-inf"))
        assert others.max() < OTHER_LOGIT + 0.5
    with pytest.raises(ValueError, match="H=8 must be >= E=16"):
        exact_routing_inputs(S, 8, E, K, seed=0)


def test_bench_peers_group_layouts():
    from benchmarks.bench_peers import group_layouts, starts_ends

    layouts = group_layouts(65536)
    assert list(layouts) == ["48 equal", "16 x 4096", "48 skewed"]
    equal, sixteen, skewed = layouts.values()
    assert equal.dtype == torch.int32 and int(equal[-1]) == 65536 and equal.numel() == 48
    assert torch.equal(sixteen, (torch.arange(1, 17) * 4096).int())
    for ends in layouts.values():
        sizes = torch.diff(ends, prepend=ends.new_zeros(1))
        assert (sizes % 128 == 0).all() and (sizes >= 0).all()
        assert starts_ends(ends)[-1][1] == int(ends[-1]) and len(starts_ends(ends)) == ends.numel()
    sizes = torch.diff(skewed, prepend=skewed.new_zeros(1)).float()
    assert skewed.numel() == 48 and int(skewed[-1]) >= 65536 and sizes.max() / sizes.mean() > 3  # skewed
    with pytest.raises(ValueError, match="multiple of 16"):
        group_layouts(1000)


def test_bench_peers_token_rows_read_every_token_k_times_ascending_in_each_group():
    """The gathered families' row_src: as the layer's dispatch index, every token read by M / S rows and each
    group's rows in ascending token order; the plain families' operands do not change with it."""
    from benchmarks.bench_peers import gathered_operand, gemm_operands, group_layouts, starts_ends, token_rows

    for ends in group_layouts(65536).values():
        src = token_rows(ends, 8192, torch.Generator().manual_seed(0))
        assert src.dtype == torch.int32 and src.numel() == int(ends[-1])
        reads = torch.bincount(src.long(), minlength=8192)  # 8 each; the skewed layout's padding rows one more
        assert reads.numel() == 8192 and reads.min() == src.numel() // 8192 and reads.max() - reads.min() <= 1
        for s, e in starts_ends(ends):
            assert (src[s + 1:e] >= src[s:e - 1]).all(), (s, e)
    ends = group_layouts(2048, groups=8, P=16, S=256, K=8)["8 equal"]
    d = gemm_operands(ends, 32, 16, "cpu", seed=3, tokens=256)
    assert torch.equal(gathered_operand("swiglu_bwd_gather", d)["g_y"], d["g_tok"][d["row_src"].long()])
    again = gemm_operands(ends, 32, 16, "cpu", seed=3, tokens=64)
    assert all(torch.equal(d[k], again[k]) for k in ("x", "dy", "g_y", "w", "gate", "row_w"))


def test_bench_peers_table_reports_failures_and_missing_peers():
    from benchmarks.bench_peers import gemm_ratios, layer_ratios, table

    layer = dict(ours=dict(fwd_ms=2.0, infer_ms=1.0, fwd_bwd_ms=6.0, ok=True),
                 torch=dict(fwd_ms=3.0, infer_ms=2.0, fwd_bwd_ms=9.0, ok=False),
                 sonicmoe=dict(error="RuntimeError: boom"))
    gemm = {"fwd | 48 equal": dict(ours_ms=1.0, ours_tflops=500.0, ours_ok=True, torch_ms=2.0, torch_tflops=250.0,
                                   torch_ok=True, quack_error="AssertionError: shape")}
    layer_ratios(layer, fwd_flops=6e9)
    gemm_ratios(gemm)
    assert layer["torch"]["ours_over_fwd_bwd"] == 1.5 and layer["sonicmoe"]["ours_over_fwd"] is None
    assert layer["ours"]["fwd_tflops"] == 6e9 / 2.0 / 1e9 and layer["ours"]["fwd_bwd_tflops"] == 3 * 6e9 / 6.0 / 1e9
    assert gemm["fwd | 48 equal"]["ours_over_torch"] == 2.0 and gemm["fwd | 48 equal"]["ours_over_quack"] is None
    lines = table(dict(layer=layer, gemm=gemm, S=1, H=2, F=3, E=4, K=5, ours_symmetric_gb=None,
                       peers=dict(quack="ok 0.4.1", sonicmoe="missing: module 'sonicmoe' not importable")))
    text = "\n".join(lines)
    assert "sonicmoe: RuntimeError: boom" in text and "fwd | 48 equal quack: AssertionError: shape" in text
    assert "9.000!" in text  # torch's result was off the reference
    assert text.count("ERROR") >= 2 and lines[-1].startswith("peers:") and "sonicmoe missing" in lines[-1]


@pytest.mark.parametrize("argv", [["--smoke", "--graph", "2"], ["--graph", "-1"]])
def test_bench_peers_graph_option_refuses_the_cpu_and_negative_counts(argv, capsys):
    from benchmarks.bench_peers import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2  # argparse's usage error, before anything runs
    assert f"--graph {argv[argv.index('--graph') + 1]}: a number of calls >= 0" in capsys.readouterr().err


@pytest.fixture(scope="module")
def peers_smoke(tmp_path_factory):
    return run_smoke(tmp_path_factory, "bench_peers")


@on_smoke("peers_smoke")
def test_bench_peers_smoke_without_peers(peers_smoke):
    stdout, d, _ = peers_smoke
    assert d["smoke"] and d["device"] == "cpu" and d["R"] == 1
    for key in ("gpu", "command", "commit", "date"):
        assert key in d
    assert set(d["versions"]) == {"torch", "cutlass", "quack", "sonicmoe"}
    for peer in ("quack", "sonicmoe"):  # never imported in tests: absent here, named as missing
        assert d["peers"][peer].startswith("missing"), d["peers"]
        assert d["versions"][peer] is None
    assert list(d["layer"]) == ["ours", "ours_rows", "torch", "torch_compiled"]
    for name, r in d["layer"].items():
        assert r["ok"], (name, r)
        for mode in ("fwd", "infer", "fwd_bwd"):
            assert r[f"{mode}_ms"] > 0 and r[f"{mode}_tflops"] > 0, (name, mode)
        assert r["peak_gb"] is None  # CPU: no peak memory
    assert d["layer"]["torch"]["ours_over_fwd"] > 0
    assert len(d["gemm"]) == 9 * 3  # fwd, dgrad, dgrad2, wgrad, swiglu, swiglu_bwd, the 3 gathered x 3 layouts
    for name, r in d["gemm"].items():
        assert r["ours_ok"] and r["torch_ok"], (name, r)
        assert r["ours_tflops"] > 0 and r["ours_over_torch"] > 0 and r["ours_over_quack"] is None
        # --sustained-s (the smoke's 5 ms, wall clock on the CPU): each implementation's time per call, no clock
        assert r["ours_sustained_ms"] > 0 and r["torch_sustained_ms"] > 0 and "ours_sustained_clock_mhz" not in r
        assert "ours_over_torch_cycles" not in r  # no clock, no cycles
        assert r["ours_over_torch_sustained"] == r["torch_sustained_ms"] / r["ours_sustained_ms"]
    assert d["sustained_s"] == 0.005 and d["targets"]["fwd / quack at the power cap (worst layout)"]["met"] is None
    lines = stdout.strip().splitlines()
    assert lines[-1].startswith("peers: quack missing") and any(ln.startswith("MoE layer") for ln in lines)
    assert any(ln.startswith("GEMM TFLOP/s") for ln in lines)
    assert any(ln.startswith("GEMM ms per call at the power cap") for ln in lines)


@pytest.mark.parametrize("smoke, plot", [pytest.param(smoke, plot, marks=on_smoke(smoke)) for smoke, plot in (
    ("e2e_smoke", "plot_e2e"), ("inference_smoke", "plot_inference"), ("peers_smoke", "plot_peers"))])
def test_plot_of_a_smoke_result(request, smoke, plot):
    """Each benchmark's plotter draws its smoke run's JSON into a PNG beside it."""
    pytest.importorskip("matplotlib")
    from benchmarks import plot_results

    _, _, path = request.getfixturevalue(smoke)
    getattr(plot_results, plot)(str(path))
    assert os.path.getsize(str(path).replace(".json", ".png")) > 10_000


@pytest.mark.parametrize("name, plot", [("bench_cold_start.json", "plot_cold_start"),
                                        ("hf_qwen3_gpu.json", "plot_hf_qwen3"),
                                        ("bench_op_overhead.json", "plot_op_overhead")])
def test_plot_of_a_committed_gpu_result(tmp_path, name, plot):
    """The plotters of results that only a GPU run fills in draw the committed H200 JSON (a copy: the PNG
    is written beside it)."""
    pytest.importorskip("matplotlib")
    import shutil

    from benchmarks import plot_results

    path = tmp_path / name
    shutil.copy(os.path.join(ROOT, "benchmarks", "results", name), path)
    getattr(plot_results, plot)(str(path))
    assert os.path.getsize(str(path).replace(".json", ".png")) > 10_000


def test_peers_gpu_time_split_names_gemm_kernels():
    from benchmarks.bench_peers import gpu_time_split

    kernels = [("kernel_cutlass_kernel_GroupGemmWgradSm90_x", 5.0), ("nvjet_sm90_tst_128x256", 1.0),
               ("kernel_cutlass__pull_kernel_t", 0.5), ("void at::native::vectorized_elementwise_kernel<add>", 0.25)]
    got = gpu_time_split(kernels)
    assert (got["gpu_ms"], got["gemm_gpu_ms"], got["non_gemm_gpu_ms"]) == (6.75, 6.0, 0.75)
    assert [n for n, _ in got["non_gemm_kernels"]] == ["kernel_cutlass__pull_kernel_t",
                                                        "void at::native::vectorized_elementwise_kernel<add>"]


def test_peers_combine_local_bandwidth_finds_the_one_pass_pull():
    """bench_peers' combine_local figure: only the pull whose first operand is the rows (combine_local's LOCAL
    variant) counts, not dispatch's or the multi-rank pull (int64 address operands first); its bytes are every
    routed row in and out[s] written (bench_comm's count at R = 1 with every token present), 12 B an entry, per
    launch: a training step's two launches (forward and backward combine, one kernel name) share the time."""
    from benchmarks.bench_peers import combine_local_bandwidth

    kernels = [("kernel_cutlass__pull_kernel_tensorptrbf16gmemalign16o5138022401_tensorptri32gmemo655361", 0.5, 2),
               ("kernel_cutlass__pull_kernel_tensorptri64gmemo11_tensorptri32gmemo655361", 0.25, 1),
               ("kernel_cutlass_kernel_GroupGemmWgradSm90_x", 5.0, 7)]
    S, H, K = 8192, 7168, 8
    got = combine_local_bandwidth(kernels, S, H, K, 2)
    nbytes = (S * K + S) * H * 2 + S * K * 12
    assert got == dict(calls=2, ms=0.25, bytes=nbytes, gbs=round(nbytes / 0.25 / 1e6, 1))
    assert got["gbs"] == 4231.0  # 1.058 GB in 0.25 ms
    assert combine_local_bandwidth(kernels[1:], S, H, K, 2) is None


def test_bench_combine_smoke_compiles_every_variant_without_spills(tmp_path_factory):
    """bench_combine --smoke: each swept (threads per CTA, U, NB) of the one-rank combine, the default among
    them, compiles for sm_90a at the layer shape and spills nothing (the GPU sweep keeps only such variants)."""
    from benchmarks.bench_combine import DEFAULT, VARIANTS, variant_list
    from csrc_cute.compile_check import find_ptxas

    if find_ptxas() is None:
        pytest.skip("ptxas not found")
    stdout, d, _ = run_smoke(tmp_path_factory, "bench_combine")
    assert d["smoke"] and d["device"] == "cpu" and (d["S"], d["H"], d["K"], d["nvs"]) == (8192, 7168, 8, 71680)
    for key in ("gpu", "command", "commit", "date"):
        assert key in d
    assert DEFAULT in variant_list(VARIANTS)
    assert [(r["nt"], r["u"], r["nb"]) for r in d["results"]] == variant_list(VARIANTS)
    for r in d["results"]:
        assert r["registers"] > 0 and r["spill_bytes"] == 0, r
    assert "wrote" in stdout


def test_bench_combine_plan_and_reference():
    """bench_combine's one-rank plan: distinct rows in range on rank 0, primary_row = dst_row, about the asked
    fraction absent (-1); its reference (what every variant is checked against) sums a token's present rows in
    k order in fp32 and rounds once: bf16 1 + 2^-8 + 2^-8 is 1 + 2^-7 (step by step in bf16 it would stay 1)."""
    from benchmarks.bench_combine import one_rank_plan, reference

    dst_rank, dst_row, primary_row = one_rank_plan(512, 8, 5000, torch.Generator().manual_seed(0), absent=0.25)
    assert dst_row.dtype == torch.int32 and dst_row.shape == (512, 8) and torch.equal(primary_row, dst_row)
    assert dst_row.unique().numel() == 512 * 8 and 0 <= int(dst_row.min()) and int(dst_row.max()) < 5000
    assert set(dst_rank.unique().tolist()) == {-1, 0} and 0.2 < float((dst_rank == -1).float().mean()) < 0.3
    rows = torch.tensor([[1.0], [2.0 ** -8], [2.0 ** -8], [5.0]], dtype=torch.bfloat16).expand(4, 8).contiguous()
    got = reference(rows, torch.tensor([[0, 0, 0, -1], [-1, -1, -1, -1]], dtype=torch.int32),
                    torch.tensor([[0, 1, 2, 3], [3, 3, 3, 3]], dtype=torch.int32))
    assert got.dtype == torch.bfloat16 and got[0].tolist() == [1.0 + 2.0 ** -7] * 8 and got[1].tolist() == [0.0] * 8


def test_bench_combine_peer_inputs_and_one_ulp_check():
    """The peer's (SonicMoE's token_gather_and_sum) inputs for a plan: its formula, out[s] = sum over j in
    [M_offset[s], M_offset[s+1]) of rows[M_perm[j]], evaluated in torch, is our reference on the same plan; a plan
    with an absent entry is refused by name. The 1-ulp check: 1 + 2^-7 (one bf16 ulp above 1) passes against 1, 1 +
    2^-6 does not, and zeros compare equal."""
    from benchmarks.bench_combine import one_rank_plan, peer_inputs, reference, within_one_ulp

    plan = one_rank_plan(64, 8, 700, torch.Generator().manual_seed(1))
    rows = torch.randn(700, 16, generator=torch.Generator().manual_seed(2)).bfloat16()
    m_perm, m_offset = peer_inputs(plan)
    assert m_perm.dtype == m_offset.dtype == torch.int32 and m_offset.tolist() == list(range(0, 64 * 8 + 1, 8))
    peer = torch.stack([rows[m_perm[m_offset[s]:m_offset[s + 1]].long()].float().sum(0) for s in range(64)])
    assert torch.equal(peer.bfloat16(), reference(rows, *plan[:2]))
    with pytest.raises(ValueError, match="dst_rank must be 0"):
        peer_inputs(one_rank_plan(64, 8, 700, torch.Generator().manual_seed(1), absent=0.3))
    one = torch.tensor([1.0, 0.0, -3.0], dtype=torch.bfloat16)
    assert within_one_ulp(torch.tensor([1.0 + 2.0 ** -7, 0.0, -3.0], dtype=torch.bfloat16), one)
    assert not within_one_ulp(torch.tensor([1.0 + 2.0 ** -6, 0.0, -3.0], dtype=torch.bfloat16), one)


def test_busy_union_of_overlapping_items_and_gaps():
    """Items worked by hand (us): a [0, 10], b [4, 6] inside a, c [8, 14] overlapping a's end, then a 6 us gap,
    d [20, 25], a 5 us gap, e [30, 31]: span 31, busy 14 + 5 + 1 = 20, the gaps longest first named by the
    item that ended last before each (c, not the earlier-starting b) and the one after it."""
    from benchmarks.common import busy_union

    items = [(0.0, 10.0, "a"), (4.0, 6.0, "b"), (8.0, 14.0, "c"), (20.0, 25.0, "d"), (30.0, 31.0, "e")]
    assert busy_union(items) == (31.0, 20.0, [(6.0, "c", "d"), (5.0, "d", "e")])
    assert busy_union([]) == (0.0, 0.0, [])


def test_copies_greedy_oracle_on_a_hand_made_plan():
    """bench_copies' oracles on a plan worked by hand: donor rank 0 (experts 45, 43, 37, 30 rows) gives 53 rows
    to rank 1, then 43 to rank 2. The consecutive cut: rank 1 takes e0 + 8 of e1, rank 2 the rest of e1 + 8
    of e2 (4 copies); the greedy gives e1 whole to rank 2's equal quota (3 copies), and so does ours."""
    from benchmarks.bench_copies import cut_copies, greedy_copies
    from moonep_ops.planning import plan_global

    counts = torch.tensor([[45, 43, 37, 30, 6, 0, 0, 0, 16, 0, 0, 0], [0] * 12, [0] * 12], dtype=torch.int32)
    assert greedy_copies(counts, 177, 1) == 3 and cut_copies(counts) == 4
    assert plan_global(counts, 177, 1, 4, 16).n_copies == 3


def test_copies_no_more_than_the_greedy_on_the_bench_routings():
    """Issue 13 part 4 on bench_copies' 103 skewed routings (R up to 16): ours makes no more copies than the
    greedy split on any routing. Figures at this commit: ours 937, greedy 937 (margin 0: ours ties the
    greedy on every routing), the interval cut alone 938 (worst +1 at lognormal sigma=1, R=16, E=256)."""
    from benchmarks.bench_copies import run

    res = run()
    ours, greedy, cut = res["ours_total"], res["greedy_total"], res["cut_total"]
    assert res["routings"] >= 100 and {r["R"] for r in res["rows"]} >= {2, 4, 8, 16}
    assert {"one-hot-expert", "one-hot-rank-0", "lognormal1.0"} <= {r["routing"] for r in res["rows"]}
    assert ours <= greedy, f"ours {ours} copies > greedy {greedy} (by {ours - greedy})"
    assert ours <= cut, f"ours {ours} copies > the interval cut's {cut} (by {ours - cut})"
    worse = [r for r in res["rows"] if r["ours"] > min(r["greedy"], r["cut"])]
    assert not worse and res["ours_losses"] == 0, worse[:3]
    assert res["ours_wins"] + res["ties"] == res["routings"]
    print(f"ours {ours}, greedy {greedy} ({greedy - ours} fewer), cut {cut} ({cut - ours} fewer); "
          f"wins {res['ours_wins']}, ties {res['ties']}")


def test_bench_cold_start_smoke_measures_two_processes(tmp_path_factory):
    """Two measured processes share one kernel cache folder; each reports every phase of its first step
    (on the CPU nothing is compiled, so only the plumbing is checked here)."""
    stdout, res, _ = run_smoke(tmp_path_factory, "bench_cold_start")
    assert res["shape"] == dict(S=16, H=32, F=16, E=8, K=2) and res["device"] == "cpu", res
    assert res["pycache"] == "shared", res  # both processes share one bytecode cache (see --pycache)
    # the first process wrote its bytecode there, the second found all of it (it compiled no source)
    first, second = res["first_process"]["pycache_files"], res["second_process"]["pycache_files"]
    assert second == first > 100, (first, second)
    for name in ("first_process", "second_process"):
        r = res[name]
        assert all(r[k] > 0 for k in ("import_s", "init_s", "first_forward_s", "first_backward_s",
                                      "second_step_ms")), r
        assert r["first_step_after_import_s"] == r["init_s"] + r["first_forward_s"] + r["first_backward_s"]
        assert name in stdout


def test_hf_qwen3_gpu_smoke_on_cpu(tmp_path):
    """benchmarks/hf_qwen3_gpu.py's CPU path (--smoke: a tiny Qwen3-MoE LM in fp32, 2 layers, batch 2):
    the swapped LM trains (its first loss the untouched LM's, finite router/expert gradients, the loss
    falls) and its StaticCache greedy decode equals the untouched LM's `generate` on the trained weights;
    no CUDA graph on the CPU, and the JSON says so."""
    pytest.importorskip("transformers")
    import math

    out = tmp_path / "hf_qwen3_gpu.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "hf_qwen3_gpu.py"), "--smoke", "--out",
                           str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    d = json.load(open(out))
    assert d["smoke"] and d["device"] == "cpu" and d["dtype"] == "float32" and d["S"] == 2 * 8
    assert d["transformers"] and all(k in d["run_info"] for k in ("gpu", "commit", "date", "torch"))
    tr, dec = d["train"], d["decode"]
    assert len(tr["losses"]) == 3 and all(math.isfinite(v) for v in tr["losses"])
    assert tr["first_loss_rel_err"] <= 1e-4 and tr["losses"][-1] < tr["losses"][0]
    assert len(tr["step_ms"]) == 2 and tr["first_step_ms"] > 0
    grads = tr["grads_finite_nonzero"]
    assert len(grads) == 2 * 4 and all(grads.values())  # 2 layers: gate, w_gate, w_up, w_down
    assert "eager decode only" in dec["graph"] and "graph_ms_per_token" not in dec and dec["eager_ms_per_token"] > 0
    assert dec["tokens_eager"] == dec["tokens_hf"] and [len(t) for t in dec["tokens_eager"]] == [6, 6]
    assert dec["eager_vs_hf"] == dict(equal=12, total=12, common_prefix=[6, 6], identical=True)
    assert d["checks"] == dict(losses_finite=True, first_loss_matches_hf=True, loss_falls=True,
                               moe_grads_finite_nonzero=True, eager_tokens_equal_hf_generate=True)
    assert "ok   eager_tokens_equal_hf_generate" in proc.stdout and "FAIL" not in proc.stdout


def test_hf_qwen3_decode_step_traces_to_one_graph(gloo1):
    """The CPU stand-in for hf_qwen3_gpu's CUDA-graph capture of its decode step: torch.compile(fullgraph=True)
    traces the whole step (the HF forward into the StaticCache, the swapped MoE blocks, the argmax, the static
    buffers' advance) into one graph that every later step reuses, i.e. no host read of a tensor and no Python
    state that changes per token; the compiled steps decode the eager steps' tokens."""
    pytest.importorskip("transformers")
    from torch._dynamo.utils import counters

    from benchmarks import hf_qwen3_gpu

    args = hf_qwen3_gpu.parse_args(["--smoke"])
    _, model, ep = hf_qwen3_gpu.build(args, torch.device("cpu"), torch.float32)
    model.eval()
    prompt = torch.randint(0, args.vocab, (args.batch, args.prompt_len), generator=torch.Generator().manual_seed(2))
    compiled, eager = (hf_qwen3_gpu.GreedyDecoder(model, prompt, args.new_tokens) for _ in range(2))
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(compiled.step, fullgraph=True, backend="aot_eager")
    for _ in range(compiled.steps):
        step()
        eager.step()
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"] and not counters["recompiles"]
    assert torch.equal(compiled.generated, eager.generated)
    torch._dynamo.reset()
    ep.destroy()


def test_bench_op_overhead_bypass_drops_only_the_exchange(gloo1):
    """The CPU "before" figure of bench_op_overhead: with the agreement bypassed an op computes the same output
    and still rejects bad arguments, but runs no exchange (the op counter in the control block stays put);
    the full `agree` comes back afterwards."""
    from benchmarks.bench_op_overhead import CPU_SHAPE, agreement_bypassed, cpu_calls
    from csrc_cute.status import OP_COUNT_WORD
    from moonep_ops import EPConfig, EPGroup
    from moonep_ops import ops as op_impl

    ep = EPGroup(EPConfig(R=1, **CPU_SHAPE), device="cpu")
    combine = cpu_calls(ep)["combine"]
    before = int(ep.ctrl[OP_COUNT_WORD])
    full = combine()
    assert int(ep.ctrl[OP_COUNT_WORD]) == before + 1
    with agreement_bypassed():
        assert torch.equal(combine(), full) and int(ep.ctrl[OP_COUNT_WORD]) == before + 1
        with pytest.raises(ValueError, match="moonep.combine"):
            torch.ops.moonep.combine(full, *([torch.zeros(1, dtype=torch.int32)] * 5), ep.presum, ep.ctrl,
                                     ep.group_name)
    assert op_impl.agree.__name__ == "agree"
    combine()
    assert int(ep.ctrl[OP_COUNT_WORD]) == before + 2
    ep.destroy()


def test_bench_op_overhead_smoke_measures_the_cpu_agreement(tmp_path_factory):
    """--smoke: the CPU part alone (spawned gloo ranks, R = 1 and 2), the GPU part named as skipped."""
    import math

    stdout, d, _ = run_smoke(tmp_path_factory, "bench_op_overhead")
    assert d["smoke"] and d["gpu_r1"].startswith("skipped")
    for key in ("gpu", "command", "commit", "date", "torch"):
        assert key in d
    rows = {(r["R"], r["op"]): r for r in d["cpu_agreement"]}
    assert set(rows) == {(R, op) for R in (1, 2) for op in ("plan", "dispatch", "combine")}
    for r in rows.values():
        assert r["full_us"] > 0 and r["bypassed_us"] > 0 and r["agree_alone_us"] > 0, r
        assert math.isfinite(r["exchange_us"]), r
    for op in ("plan", "dispatch", "combine"):  # R = 2 exchanges between processes; R = 1 exchanges nothing
        assert rows[(2, op)]["agree_alone_us"] > rows[(1, op)]["agree_alone_us"], (rows[(1, op)], rows[(2, op)])
    assert d["summary"]["cpu_exchange_us_R2"] == {op: rows[(2, op)]["exchange_us"] for op in ("plan", "dispatch",
                                                                                            "combine")}
    assert "agree alone" in stdout


def test_bench_comm_bytes_on_a_cpu_plan(gloo1):
    """bench_comm's HBM accounting on a real R = 1 plan (CPU reference) with 3 absent tokens: at R = 1 every
    present token has one chain of K rows here, so heads = present tokens, real rows = their S*K
    entries, carriers = heads; padding rows count in dispatch's pull (it writes zeros there). With R = 1
    meta stages no rows and combine is one pass (no presum); the same tables under R > 1's kernels
    (R = 2) count the staging copy and the presum round trip."""
    from benchmarks.bench_comm import comm_bytes
    from moonep_ops import EPConfig, EPGroup
    from moonep_ops.handles import Dispatch, Plan

    S, H, K, E = 16, 8, 2, 4
    ep = EPGroup(EPConfig(R=1, S=S, H=H, K=K, E=E, F=8), device="cpu")
    ids = torch.rand(S, E).topk(K, dim=1).indices
    ids[[2, 7, 11]] = -1  # absent tokens: nothing to move
    x, route_w = torch.randn(S, H), torch.softmax(torch.randn(S, K), 1)
    p = Plan(*torch.ops.moonep.plan(ids, E, ep.cfg.B, ep.cfg.P, 1, ep.ctrl, ep.group_name))
    d = Dispatch(*torch.ops.moonep.dispatch(x, route_w, p.dst_rank, p.dst_row, p.primary_row, p.cu_seqlens,
                                            p.group_rows, *ep.dispatch_buffers, ep.ctrl, ep.group_name))
    rb, nvs, present = H * 4, ep.cfg.NvS, S - 3
    real = present * K
    tables = (p.dst_rank, p.dst_row, p.primary_row, d.row_primary)
    one, two = comm_bytes(S, 1, rb, *tables), comm_bytes(S, 2, rb, *tables)
    assert nvs > real  # the plan pads each group to a multiple of P
    pull = present * rb + nvs * rb + nvs * 28
    assert one["dispatch"] == dict(minimum=(present + real) * rb, meta=real * 28, pull=pull)
    assert two["dispatch"] == dict(minimum=(present + real) * rb, meta=2 * S * rb + real * 28, pull=pull)
    assert one["combine"] == dict(minimum=(real + present) * rb, pull=real * rb + S * rb + real * 12)
    assert two["combine"] == dict(minimum=(real + present) * rb, presum=(real + present) * rb + nvs * 8,
                                  pull=present * rb + S * rb + real * 12)
    ep.destroy()


def check_tile_choices_win_sweeps(gpu: str, names: tuple[str, ...], chosen: dict) -> None:
    """Each family's tile in ``chosen`` is, in at least two of the three group layouts (the SwiGLU backward: all
    three), the fastest candidate of the newest of the committed tile sweeps ``names`` (newest first; run on
    ``gpu`` at H = 7168, F = 2048, P = 128) that measured the family, or within 3% of it: two candidates that
    walk the same tiles in the same order (bands of 16 and of 64 M tiles at 48 equal groups of 11) differed by
    2.4% and 12% in one run (results/bench_tiles_d6c9627.json). A sweep with sustained runs (--sustained-s) is
    judged by the time per call at the power cap, where a training step runs; older ones by the burst timing."""
    import json

    from benchmarks.bench_tiles import config_name

    sweeps = []
    for name in names:
        with open(os.path.join(ROOT, "benchmarks", "results", name)) as f:
            sweeps.append(json.load(f))
        assert (sweeps[-1]["H"], sweeps[-1]["F"], sweeps[-1]["P"]) == (7168, 2048, 128), name
        assert sweeps[-1]["gpu"] == gpu, name
    for fam, cfg in chosen.items():
        rows = next(rs for rs in ([r for r in sw["rows"].values() if r["family"] == fam] for sw in sweeps) if rs)
        assert len(rows) == 3, fam
        pingpong = cfg.pingpong or fam.startswith("swiglu_bwd")  # the SwiGLU backward is always pingpong
        name = config_name(cfg.tile_m, cfg.tile_n, pingpong, cfg.band_m, cfg.tall_m_major, cfg.cluster_n, cfg.dynamic,
                           cfg.cluster_m, cfg.scheduler_warp)
        wins = 0
        for r in rows:
            field = "sustained_ms" if any(isinstance(c, dict) and "sustained_ms" in c for c in r.values()) else "ms"
            times = {k: c[field] for k, c in r.items() if isinstance(c, dict) and field in c and k != "quack"}
            assert all(r[k]["ok"] for k in times), (fam, r["layout"])
            wins += times[name] <= 1.03 * min(times.values())
        assert wins >= (3 if fam == "swiglu_bwd" else 2), (fam, name, wins)


def test_tile_choices_are_the_fastest_of_the_committed_h200_sweeps():
    """config.py's tile choice for each family at the DESIGN shape on an H200 (HBM bandwidth 4.9 TB/s, or
    unknown) wins the committed H200 sweeps (``check_tile_choices_win_sweeps``)."""
    from csrc_cute.group_gemm import (
        select_config,
        select_dgrad_config,
        select_hbm_rows_config,
        select_swiglu_bwd_config,
        select_swiglu_config,
        select_wgrad_config,
    )

    # (bench_tiles_a5c0867.json is left out: its kernels had the 64-column epilogue sub-tiles, since reverted)
    names = ("bench_tiles_4a8c9c5_wgrad_gather.json", "bench_tiles_b3ef4c5_swiglu.json", "bench_tiles_4240cdb_swiglu.json",
             "bench_tiles_4240cdb_wgrad_gather.json", "bench_tiles_f5d15ce.json", "bench_tiles_6127f68.json",
             "bench_tiles_05bde5c.json", "bench_tiles_eca93ff.json", "bench_tiles_ec8e04b.json",
             "bench_tiles_b179bdb.json", "bench_tiles_3abd0d1.json", "bench_tiles_fb51b4d.json",
             "bench_tiles_456724f.json", "bench_tiles_953407e.json")
    h200 = 4915.0
    for hbm_gbs in (h200, None):
        wgrad = select_wgrad_config(128, 7168, 2048, hbm_gbs=hbm_gbs)
        chosen = dict(fwd=select_config(128, 2048), dgrad=select_dgrad_config(128, 7168, hbm_gbs=hbm_gbs),
                      row_scale=select_hbm_rows_config(128, 7168, hbm_gbs=hbm_gbs),
                      dgrad2=select_hbm_rows_config(128, 7168, hbm_gbs=hbm_gbs),
                      wgrad=wgrad, wgrad_gather=wgrad, wgrad_gather_t=wgrad,
                      swiglu=select_swiglu_config(128, 2048), swiglu_bwd=select_swiglu_bwd_config(128, 2048))
        check_tile_choices_win_sweeps("NVIDIA H200", names, chosen)


def test_tile_choices_are_the_fastest_of_the_committed_h100_sweeps():
    """On an H100 SXM (HBM bandwidth 3.35 TB/s: the dgrad2 and the row scale take cooperative tiles, the dgrad, the
    wgrads and the SwiGLU backwards (at 128 x 192) clusters sharing B) the tiles of the families swept there win
    those sweeps (``check_tile_choices_win_sweeps``); the dgrad's, the row scale's and the SwiGLU backward's with the
    scheduler warp (the default) against the same tiles without it (session 44), the dgrad's, the SwiGLU
    backward's and the wgrad's with their pingpong consumers reading the scheduler's ring (session 45), and the fused
    SwiGLU's, plain and gathered, against the same tile sharing its gate and up tiles in clusters (session 49)."""
    from csrc_cute.group_gemm import (
        select_config,
        select_dgrad_config,
        select_hbm_rows_config,
        select_swiglu_bwd_config,
        select_swiglu_config,
        select_wgrad_config,
    )

    h100 = 3352.0
    wgrad = select_wgrad_config(128, 7168, 2048, hbm_gbs=h100)
    rows = select_hbm_rows_config(128, 7168, hbm_gbs=h100)
    swiglu_bwd = select_swiglu_bwd_config(128, 2048, hbm_gbs=h100)
    swiglu = select_swiglu_config(128, 2048)
    chosen = dict(fwd=select_config(128, 2048), dgrad=select_dgrad_config(128, 7168, hbm_gbs=h100), dgrad2=rows,
                  row_scale=rows, wgrad=wgrad, wgrad_gather=wgrad, wgrad_gather_t=wgrad, swiglu_bwd=swiglu_bwd,
                  swiglu_bwd_gather=swiglu_bwd, swiglu=swiglu, swiglu_gather=swiglu)
    check_tile_choices_win_sweeps("NVIDIA H100 80GB HBM3", ("bench_tiles_session49_h100_swiglu_clusters.json",
                                                            "bench_tiles_session45_h100_pingpong_ring.json",
                                                            "bench_tiles_session44_h100_scheduler_ab.json",
                                                            "bench_tiles_session37_h100_dgrad_clusters.json",
                                                            "bench_tiles_session37_h100_wgrad_clusters.json",
                                                            "bench_tiles_session37_h100_swiglu_bwd_clusters.json",
                                                            "bench_tiles_session36_h100_swiglu_bwd_192.json",
                                                            "bench_tiles_session34_h100_wgrad.json",
                                                            "bench_tiles_session34_h100_swiglu_bwd.json",
                                                            "bench_tiles_session33_h100.json",
                                                            "bench_tiles_session32_h100_rows.json",
                                                            "bench_tiles_session32_h100.json",
                                                            "bench_tiles_session31_h100.json"), chosen)


def test_bench_tiles_records_one_compile_call_per_candidate(monkeypatch, tmp_path):
    """``sweep_compile_calls``: a dry run of every swept candidate (two families, their candidates named as on the
    command line) records one compile call per candidate, for the kernel of that family with that candidate's
    config, and launches nothing (the operands are CPU tensors: any launch would fail); what
    ``jit.compile_ahead`` then compiles side by side."""
    import argparse

    from benchmarks.bench_peers import gemm_operands, group_layouts
    from benchmarks.bench_tiles import candidate_config, config_name, sweep_compile_calls
    from csrc_cute import jit

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.setenv(jit.CACHE_DIR_ENV, str(tmp_path))
    names = ("dgrad:128x192 pingpong band 16; dgrad:128x192 pingpong band 16 cluster 2x1;"
             "wgrad_gather:128x192 pingpong;wgrad_gather:128x192 pingpong cluster 2x1")
    opts = argparse.Namespace(candidates=names)
    ends = next(iter(group_layouts(2048, 4, 128, 512, 2, 0).values()))
    d = gemm_operands(ends, 256, 256, torch.device("cpu"), 0, 512)
    calls = sweep_compile_calls(["dgrad", "wgrad_gather"], d, 128, 132, opts)
    expected = {("dgrad", (128, 192, True, 16, False)), ("dgrad", (128, 192, True, 16, False, 1, False, 2)),
                ("wgrad_gather", (128, 192, True, 0, False)), ("wgrad_gather", (128, 192, True, 0, False, 1, False, 2))}
    assert {f"{fam}:{config_name(*c)}" for fam, c in expected} == {n.strip() for n in names.split(";")}
    assert len(calls) == len(set(calls)) == 4
    for call, (fam, c) in zip(calls, sorted(expected)):
        assert call.module == "csrc_cute.group_gemm.host", call
        assert candidate_config(c, 132) in call.args, (fam, call)
        kernel = call.args[0] if call.name == "_compile_rows_kernel" else call.name  # the row kernels by name
        assert kernel == {"dgrad": "group_gemm_dgrad", "wgrad_gather": "compile_group_gemm_wgrad_gather"}[fam], call
    assert not list(tmp_path.rglob("*.o"))  # recorded, not compiled


def test_bench_tiles_candidates_name_each_familys_own_or_fail():
    """``--candidates``: a bare name is swept by every family that has that candidate, FAMILY:NAME by that family
    alone; a name no swept family has, a prefix outside --families, a family left with no candidate and an
    unknown family are each a SystemExit naming them (before anything compiles)."""
    import argparse

    from benchmarks.bench_tiles import check_candidates, swept

    def ns(names):
        return argparse.Namespace(candidates=names)

    both = ns("128x192 pingpong")
    assert swept("dgrad", both) == swept("wgrad", both) == [(128, 192, True, 0, False)]
    own = ns("dgrad:128x192 pingpong band 16;wgrad:128x192 pingpong cluster 2x1")
    assert swept("dgrad", own) == [(128, 192, True, 16, False)]
    assert swept("wgrad", own) == [(128, 192, True, 0, False, 1, False, 2)]
    check_candidates(["dgrad", "wgrad"], own)
    assert len(swept("wgrad", ns(""))) > 2  # none named: all
    for families, names, match in ((["dgrad"], "128x999", "'128x999' is not a candidate of \\['dgrad'\\]"),
                                   (["dgrad"], "wgrad:128x192 pingpong", "'wgrad' is not one of --families"),
                                   (["dgrad", "wgrad"], "dgrad:128x192 pingpong band 16", "none of wgrad's"),
                                   (["wgrad", "dgrad:x"], "", "are not swept families")):
        with pytest.raises(SystemExit, match=match):
            check_candidates(families, ns(names))


def test_bench_tiles_times_the_candidates_round_robin():
    """A clock that drifts by one unit per timing: timed round-robin (round r starting at the r-th
    candidate), equal candidates get medians within a few units of each other, where timing each one's
    repeats in a row would set them a whole candidate's repeats (5 units) apart; a faster candidate stays
    faster. A clock that favours one place in a round (the third of four, 3 units): over 4 rounds every
    candidate takes every place once, so equal candidates get equal medians."""
    from benchmarks.common import time_round_robin

    clock = iter(range(1000))
    calls = dict(a=lambda: 10.0, b=lambda: 10.0, c=lambda: 10.0, fast=lambda: 4.0)
    med = time_round_robin(calls, lambda call: call() + next(clock), repeats=5)
    assert list(med) == ["a", "b", "c", "fast"]
    # rounds: a b c fast | b c fast a | c fast a b | fast a b c | a b c fast (timings 0..19)
    assert med == dict(a=10 + 10, b=10 + 11, c=10 + 8, fast=4 + 9)
    place = iter(range(1000))
    med = time_round_robin(calls, lambda call: call() - 3 * (next(place) % 4 == 2), repeats=4)
    assert med == dict(a=10, b=10, c=10, fast=4)
    assert time_round_robin({}, lambda call: call(), repeats=3) == {}  # every candidate failed: nothing timed


def test_bench_peers_issue_targets_from_hand_made_rows():
    """bench_peers' target summary: ratios to SonicMoE (at most the target), the worst layout of each GEMM
    family against QuACK (at least 1.0; also at the power cap where the rows were run sustained), and 'not measured'
    where a side did not run."""
    from benchmarks.bench_peers import issue_targets

    layer = dict(ours=dict(fwd_ms=9.0, fwd_bwd_ms=28.0, peak_gb=14.0, non_gemm_gpu_ms=1.5),
                 ours_rows=dict(fwd_ms=9.0, fwd_bwd_ms=27.0, peak_gb=13.0),
                 sonicmoe=dict(fwd_ms=10.0, fwd_bwd_ms=30.0, peak_gb=13.0))
    gemm = {"fwd | a": dict(family="fwd", ours_over_quack=1.1),
            "fwd | b": dict(family="fwd", ours_over_quack=0.97),
            "wgrad | a": dict(family="wgrad", ours_over_quack=1.02),
            "wgrad | b": dict(family="wgrad", ours_over_quack=None)}
    t = issue_targets(layer, gemm)
    assert t["layer fwd+bwd / sonicmoe"] == dict(value=28.0 / 30.0, target=0.90, met=False)
    assert t["layer fwd / sonicmoe"] == dict(value=0.9, target=0.95, met=True)
    assert t["peak / sonicmoe"]["met"] is False and t["layer fwd+bwd / sonicmoe (rows)"]["value"] == 0.9
    assert t["non-GEMM GPU ms of a step"] == dict(value=1.5, target=3.0, met=True)
    assert t["fwd / quack (worst layout)"] == dict(value=0.97, target=1.0, met=False)
    assert t["wgrad / quack (worst layout)"]["met"] is None  # QuACK missing at one layout
    assert not any("power cap" in k for k in t)  # no row run sustained: no such target
    # rows run sustained (--sustained-s): each family's worst layout at the cap too, beside the burst's
    gemm["fwd | a"]["ours_over_quack_sustained"] = 1.01
    gemm["fwd | b"]["ours_over_quack_sustained"] = 1.03
    t = issue_targets(layer, gemm)
    assert t["fwd / quack at the power cap (worst layout)"] == dict(value=1.01, target=1.0, met=True)
    assert t["fwd / quack (worst layout)"]["met"] is False and "wgrad / quack at the power cap (worst layout)" not in t
    none = issue_targets(dict(ours=layer["ours"]), {})
    assert none["layer fwd / sonicmoe"]["met"] is None and "layer fwd+bwd / sonicmoe (rows)" not in none


def test_bench_sustained_smoke_times_every_step(tmp_path_factory):
    """bench_sustained --smoke (CPU): both of ours' row modes run every step of every round, the summary's
    first-steps and last-steps means are those of the recorded step times, and no clock is claimed."""
    stdout, d, _ = run_smoke(tmp_path_factory, "bench_sustained")
    for key in ("gpu", "command", "commit", "date", "torch"):
        assert key in d
    assert d["smoke"] and [r["impl"] for r in d["runs"]] == ["ours", "ours_rows"]
    for run in d["runs"]:
        assert len(run["ms"]) == d["steps"] and all(m > 0 for m in run["ms"])
        row = d["summary"]["1"][run["impl"]]
        assert abs(row["first3_ms"] - sum(run["ms"][:3]) / 3) < 1e-2 and row["clock_mhz"] is None
        assert abs(row["last20_ms"] - sum(run["ms"]) / len(run["ms"])) < 1e-2  # 4 steps: the last 20 are all
    assert "wrote" in stdout


def test_bench_tiles_sustained_runs_each_timed_candidate_and_reports_its_energy(monkeypatch):
    """bench_tiles --sustained-s on stand-ins for the CUDA events and nvidia-smi (CPU): every candidate that was
    timed runs about S seconds of back-to-back calls (S / its burst time, rounded up), in the order rotated by
    the row's turn, and gets its time per call (the events' elapsed time / calls) and, from the samples of its
    run's second half, the clock, power and energy per call (W x ms = mJ); a candidate without a burst time
    (failed its check) is skipped."""
    import time
    import types

    from benchmarks import bench_tiles, common

    class Event:  # each run's end event reports 2 ms per call made since its start event
        def __init__(self, enable_timing):
            self.calls = None

        def record(self):
            self.calls = len(order)

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return 2.0 * (end.calls - self.calls)

    class Sampler:  # 1500 MHz, 600 W every millisecond since it started
        def __init__(self):
            self.t0 = time.time()

        def samples(self):
            t1 = time.time()
            return [(self.t0 + i / 1e3, 1500.0, 600.0, "0x4") for i in range(int((t1 - self.t0) * 1e3) + 2)]

    monkeypatch.setattr(bench_tiles.torch.cuda, "Event", Event)
    monkeypatch.setattr(common, "ClockSampler", Sampler)
    order = []
    calls = {name: (lambda name=name: (order.append(name), time.sleep(1e-3))) for name in ("a", "b", "c")}
    rows = {"k": dict(a=dict(ms=1.0), b=dict(ms=4.0), c=dict(error="failed its check"))}
    opts = types.SimpleNamespace(sustained_s=0.02, idle_s=0.0)
    bench_tiles.measure_sustained(rows, "k", calls, opts, turn=1)
    assert order == ["b"] * 5 + ["a"] * 20  # 20 ms / 4 ms and / 1 ms calls; turn 1: b first; c skipped
    for name in ("a", "b"):
        cell = rows["k"][name]
        assert cell["sustained_ms"] == 2.0 and cell["sustained_power_w"] == 600.0
        assert cell["sustained_clock_mhz"] == 1500.0 and cell["sustained_mj"] == 1200.0
        assert cell["sustained_mcycles"] == 3.0  # 2 ms at 1500 MHz: 3 M SM cycles a call
        assert cell["sustained_reasons"] == ["0x4"]
    assert "sustained_ms" not in rows["k"]["c"]


def test_window_means_average_the_samples_inside_the_window():
    """The clock / power means that bench_sustained and bench_tiles --sustained-s report: only the samples whose
    time lies in [t0, t1], their reasons sorted and deduplicated; None for a window without samples."""
    from benchmarks.common import window_means

    samples = [(0.0, 1980.0, 300.0, "0x0"), (1.0, 1500.0, 690.0, "0x4"), (2.0, 1400.0, 700.0, "0x4"),
               (3.0, 1980.0, 100.0, "0x0")]
    assert window_means(samples, 1.0, 2.0) == dict(clock_mhz=1450.0, power_w=695.0, reasons=["0x4"])
    assert window_means(samples, 0.0, 3.0)["reasons"] == ["0x0", "0x4"]
    assert window_means(samples, 3.5, 4.0) is None and window_means([], 0.0, 1.0) is None


def test_names_option_keeps_known_names_and_names_the_unknown(capsys):
    """The benchmarks' comma-separated options: empty items dropped, order kept; an unknown name is the
    parser's error, naming the option, the unknown names and the known ones."""
    import argparse

    from benchmarks.common import names_option

    ap = argparse.ArgumentParser(prog="bench")
    assert names_option(ap, "--impls", "b,,a", ("a", "b", "c")) == ["b", "a"]
    with pytest.raises(SystemExit):
        names_option(ap, "--impls", "a,y,x", ("a", "b"))
    assert "bench: error: --impls: unknown ['x', 'y'] (known: a, b)" in capsys.readouterr().err


def test_ncu_gemm_summary_of_a_hand_made_details_page():
    """benchmarks/ncu_gemm.py reads ncu's CSV details page: a call that launched two kernels keeps the
    longer (the GEMM) and names the other; durations and clocks in ncu's base units become ms and MHz;
    stall reasons are keyed by reason; a unit it has not seen keeps the metric under a name with the unit."""
    from benchmarks.ncu_gemm import details_rows, summarize

    head = '"ID","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value"\n'

    def page(names):
        rows = [(0, names[0], "Duration", "nsecond", "2,500"), (0, names[0], "SM Frequency", "cycle/second",
                                                                  "1,755,000,000"),
                (1, names[1], "Duration", "nsecond", "3,000,000"), (1, names[1], "SM Frequency", "hz", "1.98e9"),
                (1, names[1], "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio", "", "0.5"),
                (1, names[1], "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio", "", "1.25"),
                (2, names[2], "Duration", "usecond", "2,900"), (2, names[2], "SM Frequency", "furlong", "7"),
                (2, names[2], "Block Limit Registers", "block", "n/a")]
        return "==PROF== noise before the table\n" + head + "".join(
            f'"{i}","{n}","S","{m}","{u}","{v}"\n' for i, n, m, u, v in rows)
    kernels = page(["zero_fill", "ours_gemm_kernel", "quack_gemm_kernel"])
    ranges = page(["ours dgrad/zero_fill", "ours dgrad/ours_gemm_kernel", "quack dgrad"])  # ncu 2025.3: range/kernel
    got = summarize(details_rows(kernels), details_rows(ranges))
    assert sorted(got) == ["ours dgrad", "quack dgrad"]
    ours, quack = got["ours dgrad"], got["quack dgrad"]
    assert (ours["kernel"], ours["others"]) == ("ours_gemm_kernel", ["zero_fill"])
    assert ours["summary"]["ms"] == pytest.approx(3.0) and ours["summary"]["SM MHz"] == pytest.approx(1980.0)
    assert ours["top_stalls"] == [("wait", 1.25), ("long_scoreboard", 0.5)]
    assert quack["summary"]["ms"] == pytest.approx(2.9) and quack["summary"]["SM MHz"] is None
    assert quack["metrics"]["SM Frequency [furlong]"] == 7.0
    with pytest.raises(ValueError, match="no ncu details table"):
        details_rows("==ERROR== ERR_NVGPUCTRPERM\n")


def test_ncu_gemm_source_hotspots_of_a_hand_made_source_page():
    """`ncu_gemm.py --source`: ncu's CSV source page (a "Kernel Name" line, then the launch's SASS table) -> per
    launch (one kernel launched twice is two) its stall reasons' shares and its instructions by warp samples
    (ncu's thousands separators read), with their share and main reason; rows of another width are not
    instructions."""
    from benchmarks.ncu_gemm import source_hotspots

    head = ('"Address","Source","Warp Stall Sampling (All Samples)","stall_barrier","stall_long_sb",'
            '"stall_long_sb (Not Issued)"\n')
    wgrad = ('"Kernel Name","k_wgrad"\n' + head + '"0x10","SYNCS.PHASECHK.TRANS64 P0, [R2]","6,000","0","6,000","5,800"\n'
             '"0x20","BAR.SYNC.DEFER_BLOCKING R3, 0x100","3,000","3,000","0","0"\n"0x30","EXIT","1,000","0","0","0"\n'
             '"a note of another width"\n')
    page = (wgrad + '"Kernel Name","k_fwd"\n' + head + '"0x10","BAR.SYNC.DEFER_BLOCKING 0x1, 0x100","0","0","0","0"\n'
            '"0x20","LDG.E.128 R4, desc[UR6][R2.64]","5","0","5","5"\n' + wgrad)
    hot = source_hotspots(page, top=2)
    assert list(hot) == ["1 k_wgrad", "2 k_fwd", "3 k_wgrad"]
    assert hot["1 k_wgrad"]["stalls"] == {"long_sb": 0.6, "barrier": 0.3} == hot["3 k_wgrad"]["stalls"]
    assert [(h["address"], h["samples"], h["share"], h["stall"]) for h in hot["1 k_wgrad"]["top"]] == [
        ("0x10", 6000, 0.6, "long_sb"), ("0x20", 3000, 0.3, "barrier")]
    assert hot["1 k_wgrad"]["top"][0]["sass"].startswith("SYNCS.PHASECHK")
    assert [(h["address"], h["share"]) for h in hot["2 k_fwd"]["top"]] == [("0x20", 1.0), ("0x10", 0.0)]
    assert hot["2 k_fwd"]["stalls"] == {"long_sb": 1.0}


def test_ncu_gemm_layer_summary_keeps_every_kernel_and_carries_the_range_to_the_backward():
    """`ncu_gemm.py --layer`: every profiled kernel of a step is kept, keyed "<impl> layer <n> <kernel class>" in
    launch order; the backward's kernels (autograd's thread, no NVTX range) belong to the last ranged step."""
    from benchmarks.ncu_gemm import details_rows, order, summarize

    head = '"ID","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value"\n'
    names = ["k_csrc_cutegroup_gemmswigluGroupGemmSwigluGatherSm90_obj", "k_wgradGroupGemmWgradGatherSm90_obj",
             "k_quackgemm_actGemmGatedSm90_obj", "k_quackgemm_default_epiGemmDefaultSm90_obj"]
    ranged = {0: "ours layer", 2: "sonicmoe layer"}

    def page(named):
        return head + "".join(f'"{i}","{(ranged[i] + "/" + n) if named and i in ranged else n}","S","Duration",'
                              f'"nsecond","{1000 * (i + 1)}"\n' for i, n in enumerate(names))
    got = summarize(details_rows(page(False)), details_rows(page(True)), every_kernel=True)
    assert sorted(got, key=order) == ["ours layer 1 GroupGemmSwigluGatherSm90", "ours layer 2 GroupGemmWgradGatherSm90",
                                      "sonicmoe layer 1 GemmGatedSm90", "sonicmoe layer 2 GemmDefaultSm90"]
    assert got["ours layer 2 GroupGemmWgradGatherSm90"]["summary"]["ms"] == pytest.approx(2e-3)
    assert all(v["others"] == [] for v in got.values())


def test_ncu_gemm_smoke_runs_every_call_on_the_cpu():
    """`ncu_gemm.py --smoke`: the profiled process's calls (bench_peers' operands, ours and torch) run on the
    CPU, each family once, without the profiler."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "ncu_gemm.py"), "--smoke",
                           "--impls", "ours,torch", "--families", "dgrad,wgrad"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.stdout.split("\n")[:4] == [f"ncu_gemm smoke: {i} {f} ran" for i in ("ours", "torch")
                                           for f in ("dgrad", "wgrad")]


def test_ncu_gemm_plot_of_the_committed_h200_profile(tmp_path):
    """ncu_gemm.plot draws the committed H200 profile of ours and QuACK (a copy: the PNG is written beside it)."""
    pytest.importorskip("matplotlib")
    import shutil

    from benchmarks.ncu_gemm import plot

    path = tmp_path / "ncu_gemm_ab0de90.json"
    shutil.copy(os.path.join(ROOT, "benchmarks", "results", path.name), path)
    plot(str(path))
    assert os.path.getsize(str(path).replace(".json", ".png")) > 10_000


def test_run_info_records_the_commit_a_device_script_names(monkeypatch):
    from benchmarks.common import run_info

    for given, recorded in (("d5559c9", "d5559c9"), ("d5559c95b4e8890c94663dc9ff0cce7cab6a1aca",) * 2,
                            ("72cba59+lsu-prefetch", "72cba59+lsu-prefetch"), ("not a commit", "unknown")):
        monkeypatch.setenv("MOONEP_COMMIT", given)
        assert run_info()["commit"] == recorded


def test_run_info_names_the_hbm_bandwidth_the_tiles_were_chosen_for(monkeypatch):
    # a run with $MOONEP_HBM_GBS set (the tiles of another device's HBM, config.tiles_hbm_gbs) says so in its JSON;
    # one without it has no such field
    from benchmarks.common import run_info

    monkeypatch.delenv("MOONEP_HBM_GBS", raising=False)
    assert "tiles_hbm_gbs" not in run_info()
    monkeypatch.setenv("MOONEP_HBM_GBS", "3350")
    assert run_info()["tiles_hbm_gbs"] == 3350.0
