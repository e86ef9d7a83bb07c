"""PNG plots of the committed benchmark JSONs (needs matplotlib): python benchmarks/plot_results.py"""

from __future__ import annotations

import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def bars(ax, labels, series: dict[str, list[float]], ylabel: str):
    width = 0.8 / len(series)
    for i, (name, vals) in enumerate(series.items()):
        ax.bar([x + i * width for x in range(len(labels))], vals, width, label=name)
    ax.set_xticks([x + width * (len(series) - 1) / 2 for x in range(len(labels))], labels, fontsize=7,
                  rotation=35, ha="right")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)


def caption(d: dict) -> str:
    return f"{d['gpu']}, torch {d['torch']}, commit {d['commit'][:10]}, {d['date']}"


def plot_gemm(path: str) -> None:
    d = json.load(open(path))
    rows = d["results"]
    labels = [f"{r['case'].split(':')[0]} {r['proj']} {r.get('op', 'fwd')}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(9, len(rows) * 0.6), 4))
    series = {"moonep group_gemm (CuTe DSL)": "ours_tflops", "torch._grouped_mm": "grouped_mm_tflops",
              "dense torch.mm": "dense_tflops", "torch baseline (the fused ops: _grouped_mm + eager)": "baseline_tflops"}
    bars(ax, labels, {label: [r[key] for r in rows] for label, key in series.items() if all(key in r for r in rows)},
         "TFLOP/s")
    ops = " / ".join(dict.fromkeys(r.get("op", "fwd") for r in rows))
    ax.set_title(f"Grouped GEMM {ops}, H=7168 F=2048\n" + caption(d), fontsize=9)
    fig.tight_layout()
    fig.savefig(path.replace(".json", ".png"), dpi=120)


def plot_planner(path: str) -> None:
    d = json.load(open(path))
    rows = d["results"]
    stages = list(dict.fromkeys(r["stage"] for r in rows))
    configs = list(dict.fromkeys((r["R"], r["E"], round(r["maxvio"], 1)) for r in rows))
    fig, ax = plt.subplots(figsize=(11, 5))
    series = {f"R={R} E={E} maxvio {mv}": [next((r["isolated_us"] for r in rows if (r["R"], r["E"], round(
        r["maxvio"], 1)) == (R, E, mv) and r["stage"] == s), 0.0) for s in stages] for R, E, mv in configs}
    bars(ax, stages, series, "us (CUDA graph replay, median)")
    ax.set_title("Planner, S=8192 K=8: kernels on simulated ranks (one GPU); exchange and moonep::plan on "
                 "real ranks\n" + caption(d), fontsize=9)
    fig.tight_layout()
    fig.savefig(path.replace(".json", ".png"), dpi=120)


def plot_comm(path: str) -> None:
    d = json.load(open(path))
    rows = d["results"]
    mv = [r["maxvio"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for key, label, style in (("ours_dispatch_graph_ms", "moonep dispatch (graph)", "o-"),
                              ("ours_combine_graph_ms", "moonep combine (graph)", "s-"),
                              ("baseline_dispatch_ms", "NCCL a2a dispatch", "o--"),
                              ("baseline_combine_ms", "NCCL a2a combine", "s--")):
        a.plot(mv, [r[key] for r in rows], style, label=label)
    for key, label, style in (("ours_forward_graph_ms", "moonep plan+dispatch+combine (graph)", "o-"),
                              ("ours_backward_graph_ms", "moonep backward (graph)", "s-"),
                              ("baseline_forward_ms", "NCCL a2a forward", "o--"),
                              ("baseline_fwd_bwd_ms", "NCCL a2a forward+backward", "s--")):
        b.plot(mv, [r[key] for r in rows], style, label=label)
    for ax in (a, b):
        ax.set_xlabel("maxvio")
        ax.set_ylabel("ms")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    fig.suptitle(f"Token communication, EP{d['R']}, S={d['S']} H={d['H']} K={d['K']} epn={d['epn']}, "
                 f"{d['comm_sms']} SMs\n" + caption(d), fontsize=9)
    fig.tight_layout()
    fig.savefig(path.replace(".json", ".png"), dpi=120)


E2E_SERIES = (("ours_eager", "moonep eager", "o-"), ("ours_compiled", "moonep compiled", "s-"),
              ("ours_graph", "moonep compiled + CUDA graph", "^-"), ("base_eager", "NCCL a2a baseline eager", "o--"),
              ("base_compiled", "NCCL a2a baseline compiled (graph breaks)", "s--"))


def plot_e2e(path: str) -> None:
    """bench_e2e: forward+backward time and peak memory vs maxvio, per variant, for the layer and the model.
    Missing points (OOM, skipped, CPU memory) are left out."""
    d = json.load(open(path))
    parts = [(k, t) for k, t in (("layer", "MoE layer"), ("model", f"{d.get('layers')}-layer MoE model"))
             if d.get(k)]
    fig, axes = plt.subplots(len(parts), 2, figsize=(12, 4.2 * len(parts)), squeeze=False)
    for (key, title), (a, b) in zip(parts, axes):
        rows = d[key]
        for variant, label, style in E2E_SERIES:
            for ax, field in ((a, "ms"), (b, "peak_gb")):
                pts = [(r["maxvio"], r.get(f"{variant}_{field}")) for r in rows]
                pts = [(x, y) for x, y in pts if isinstance(y, (int, float))]
                if pts:
                    ax.plot(*zip(*pts), style, label=label)
                oom = [r["maxvio"] for r in rows if r.get(f"{variant}_error") == "OOM"]
                if oom and field == "ms":
                    ax.plot(oom, [0] * len(oom), "x", color="red", label=f"{label}: OOM")
        a.set_title(f"{title}: forward + backward", fontsize=9)
        a.set_ylabel("ms")
        b.set_title(f"{title}: peak memory (max_memory_allocated)", fontsize=9)
        b.set_ylabel("GB")
        for ax in (a, b):
            ax.set_xlabel("maxvio")
            ax.set_ylim(bottom=0)
            if ax.lines:
                ax.legend(fontsize=7)
            else:
                ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(f"End to end, EP{d['R']}, S={d['S']} H={d['H']} F={d['F']} K={d['K']} epn={d['epn']} {d['dtype']}, "
                 f"graph mode {d['graph_mode']}\n" + caption(d), fontsize=9)
    fig.tight_layout()
    fig.savefig(path.replace(".json", ".png"), dpi=120)


INFERENCE_SERIES = (("ours_full", "moonep B=epn", "o-"), ("ours_b3", "moonep small B", "s-"),
                    ("ours_b3_graph", "moonep small B, CUDA graph", "^-"), ("base", "NCCL a2a baseline", "o--"))


def plot_inference(path: str) -> None:
    """bench_inference: forward time vs maxvio per variant, and the copies ours_b3's plan used (max over ranks),
    one row per S. Missing points (OOM, skipped) are left out."""
    d = json.load(open(path))
    sizes = list(dict.fromkeys(r["S"] for r in d["rows"]))
    fig, axes = plt.subplots(len(sizes), 2, figsize=(12, 4.2 * len(sizes)), squeeze=False)
    for S, (a, b) in zip(sizes, axes):
        rows = [r for r in d["rows"] if r["S"] == S]
        for variant, label, style in INFERENCE_SERIES:
            pts = [(r["maxvio"], r.get(f"{variant}_ms")) for r in rows
                   if isinstance(r.get(f"{variant}_ms"), (int, float))]
            if pts:
                a.plot(*zip(*pts), style, label=label)
        for key, label, style in (("ours_full_slots_used", "B=epn: copies (slots used)", "o--"),
                                  ("ours_b3_slots_used", f"B={d['small_B']}: slots used", "s-"),
                                  ("ours_b3_remote_groups", f"B={d['small_B']}: remote groups", "^-")):
            pts = [(r["maxvio"], max(r[key])) for r in rows if r.get(key)]
            if pts:
                b.plot(*zip(*pts), style, label=label)
        a.set_title(f"S={S}: MoE layer forward (no_grad), ms, max over ranks", fontsize=9)
        b.set_title(f"S={S}: copies per rank in the plan (max over ranks)", fontsize=9)
        for ax in (a, b):
            ax.set_xlabel("maxvio")
            ax.set_ylim(bottom=0)
            if ax.lines:
                ax.legend(fontsize=7)
    pools = ", ".join(f"B={p['B']}: {p['pool_bytes'] / 1e9:.2f} GB" for p in d["pools"].values())
    fig.suptitle(f"Inference, EP{d['R']}, H={d['H']} F={d['F']} K={d['K']} epn={d['epn']}; slot pools per rank "
                 f"{pools}\n" + caption(d), fontsize=9)
    fig.tight_layout()
    fig.savefig(path.replace(".json", ".png"), dpi=120)


def plot_peers(path: str) -> None:
    """bench_peers: the MoE layer's times per mode and the GEMM families' TFLOP/s per layout, per implementation
    (missing or failed cells left out; a section the run did not have gets no panel)."""
    d = json.load(open(path))
    layer, gemm = d.get("layer") or {}, d.get("gemm") or {}
    panels = [p for p, rows in (("layer", layer), ("gemm", gemm)) if rows]
    if not panels:
        raise ValueError(f"{path}: no layer or GEMM results to plot")
    widths = [1 if p == "layer" else 3 for p in panels]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 + 4 * sum(widths), 4.5), squeeze=False,
                             gridspec_kw=dict(width_ratios=widths))
    for ax, panel in zip(axes[0], panels):
        if panel == "layer":
            modes = ("fwd", "infer", "fwd_bwd")
            bars(ax, list(modes), {i: [r.get(f"{m}_ms") or 0.0 for m in modes] for i, r in layer.items()}, "ms")
            ax.set_title(f"MoE layer S={d['S']} H={d['H']} F={d['F']} E={d['E']} K={d['K']}\n" + caption(d),
                         fontsize=9)
        else:
            impls = [i for i in ("ours", "quack", "torch") if any(f"{i}_tflops" in r for r in gemm.values())]
            bars(ax, list(gemm), {i: [r.get(f"{i}_tflops") or 0.0 for r in gemm.values()] for i in impls}, "TFLOP/s")
            ax.set_title("GEMM families x group layouts\n" + caption(d), fontsize=9)
    fig.tight_layout()
    fig.savefig(path.replace(".json", ".png"), dpi=120)
    plt.close(fig)


COLD_START_PHASES = ("import_s", "device_init_s", "ep_group_s", "cute_import_s", "first_forward_s",
                     "first_backward_s")


def plot_cold_start(path: str) -> None:
    """bench_cold_start: each process's phases up to the end of its first training step, stacked."""
    d = json.load(open(path))
    procs = ("first_process", "second_process")
    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = [0.0, 0.0]
    for phase in COLD_START_PHASES:
        vals = [d[p].get(phase, 0.0) for p in procs]
        ax.barh(procs, vals, left=bottom, label=phase[:-2])
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xlabel("s from process start")
    ax.legend(fontsize=7)
    shape = " ".join(f"{k}={v}" for k, v in d["shape"].items())
    ax.set_title(f"cold start to the first training step, {shape}\n{caption(d)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path.replace(".json", ".png"), dpi=120)
    plt.close(fig)


def plot_hf_qwen3(path: str) -> None:
    """hf_qwen3_gpu: the training losses (and the untouched model's first loss) and the decode ms/token."""
    d = json.load(open(path))
    train, dec = d["train"], d["decode"]
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(9, 4))
    ax0.plot(range(1, len(train["losses"]) + 1), train["losses"], marker="o", label="swapped LM")
    ax0.scatter([1], [train["ref_first_loss"]], marker="x", color="k", label="untouched HF, step 1")
    ax0.set_xlabel("step")
    ax0.set_ylabel("loss")
    ax0.legend(fontsize=8)
    modes = [m for m in ("graph", "eager") if f"{m}_ms_per_token" in dec]
    ax1.bar(modes, [dec[f"{m}_ms_per_token"] for m in modes])
    ax1.set_ylabel("ms per decoded token")
    info = d["run_info"]
    fig.suptitle(f"Qwen3-MoE (transformers {d['transformers']}) with swapped blocks, {d['dtype']}\n"
                 f"{caption(info)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path.replace(".json", ".png"), dpi=120)
    plt.close(fig)


def plot_op_overhead(path: str) -> None:
    """bench_op_overhead: host and GPU us per call of each op at the design shape (log scale), and the us per
    launch of the barrier, the barrier without its op-id check and an empty kernel (CUDA-graph replay)."""
    d = json.load(open(path))
    shape = next(s for s in d["gpu_r1"] if s["name"] == "design")
    rows = shape["rows"]
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw=dict(width_ratios=[3, 1]))
    bars(ax0, [r["op"] for r in rows], {"host us per call": [r["host_us"] for r in rows],
                                        "GPU us per call": [r["gpu_us"] for r in rows]}, "us")
    ax0.set_yscale("log")
    ax0.set_title(f"R=1, {' '.join(f'{k}={v}' for k, v in shape['shape'].items())}", fontsize=9)
    b = shape["barrier"]
    kernels = ("barrier", "unchecked", "empty")
    ax1.bar(["barrier", "no op-id\ncheck", "empty"], [b[f"{k}_graph_us"] for k in kernels])
    ax1.set_ylabel("us per launch (CUDA graph)")
    ax1.set_title(f"op-id check {b['op_check_per_comm_op_us']:.3f} us per comm op", fontsize=9)
    fig.suptitle(f"per-op cost of the cross-rank agreement\n{caption(d)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path.replace(".json", ".png"), dpi=120)
    plt.close(fig)


def plot_sustained(path: str) -> None:
    """bench_sustained: every step's time from idle, per implementation (the last round of the last phase),
    and the sampled SM clock over the whole run."""
    d = json.load(open(path))
    last = max(r["phase"] for r in d["runs"])
    runs = [r for r in d["runs"] if r["phase"] == last]
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in runs:
        if r["round"] == max(x["round"] for x in runs):
            ax0.plot(range(1, len(r["ms"]) + 1), r["ms"], label=r["impl"])
    ax0.set_xlabel("step after idle")
    ax0.set_ylabel("fwd+bwd ms")
    ax0.legend(fontsize=8)
    ax0.set_title(f"S={d['S']} H={d['H']} F={d['F']} E={d['E']} K={d['K']}, phase {last}\n{caption(d)}", fontsize=9)
    samples = d.get("clock_samples") or []
    if samples:
        t0 = samples[0][0]
        ax1.plot([s[0] - t0 for s in samples], [s[1] for s in samples], label="SM clock (MHz)")
        ax1.plot([s[0] - t0 for s in samples], [s[2] for s in samples], label="power (W)")
        for r in d["runs"]:
            ax1.axvspan(r["t0"] - t0, r["t1"] - t0, alpha=0.1)
        ax1.set_xlabel("s (shaded: timed runs)")
        ax1.legend(fontsize=8)
        ax1.set_title("nvidia-smi samples", fontsize=9)
    fig.tight_layout()
    fig.savefig(path.replace(".json", ".png"), dpi=120)
    plt.close(fig)


def plot_gemm_clocks(path: str) -> None:
    """gemm_clocks: per GEMM cell of each source run, QuACK's time over ours in the burst and at the cap and its
    cycles over ours at the cap; below, the SM clock each one's burst time implies."""
    d = json.load(open(path))
    cells = [(f"{run['name']} {name}", c) for run in d["runs"] for name, c in run["cells"].items()]
    if not cells:
        return
    labels = [label for label, _ in cells]
    fig, (ax0, ax1) = plt.subplots(2, 1, figsize=(max(9, len(cells) * 0.45), 8))
    bars(ax0, labels, {f"QuACK/ours {k}": [c[k] for _, c in cells] for k in ("burst", "cap", "cycles")}, "ratio")
    ax0.axhline(1.0, color="k", lw=0.6)
    ax0.set_ylim(min(0.85, min(min(c[k] for k in ("burst", "cap", "cycles")) for _, c in cells) - 0.02), None)
    gpus = ", ".join(sorted({str(run["gpu"]) for run in d["runs"]}))
    ax0.set_title(f"GEMM cells of {len(d['runs'])} bench_peers runs ({gpus}); cycles = ms x mean SM clock at the "
                  f"cap\ngemm_clocks at commit {d['commit'][:10]}, {d['date']}", fontsize=9)
    bars(ax1, labels, {f"{impl} burst-implied clock": [c[impl]["burst_implied_mhz"] for _, c in cells]
                       for impl in ("ours", "quack")}, "MHz (cycles at the cap / burst ms)")
    implied = [c[impl]["burst_implied_mhz"] for _, c in cells for impl in ("ours", "quack")]
    ax1.set_ylim(0.9 * min(implied), 1.05 * max(implied))
    fig.tight_layout()
    fig.savefig(path.replace(".json", ".png"), dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    for name, plot in (("bench_gemm.json", plot_gemm), ("bench_planner.json", plot_planner),
                       ("bench_comm.json", plot_comm), ("bench_e2e.json", plot_e2e),
                       ("bench_inference.json", plot_inference), ("bench_peers.json", plot_peers),
                       ("bench_cold_start.json", plot_cold_start), ("hf_qwen3_gpu.json", plot_hf_qwen3),
                       ("bench_op_overhead.json", plot_op_overhead), ("bench_sustained.json", plot_sustained)):
        if os.path.exists(os.path.join(RESULTS, name)):
            plot(os.path.join(RESULTS, name))
