"""Nsight Compute profile of one call of each GEMM family by ours and QuACK, clocks free (1 GPU).

    source .carry/prelude.sh && source .carry/peers.sh && python3 benchmarks/ncu_gemm.py --out $OUT/ncu
    python benchmarks/ncu_gemm.py --smoke          (CPU: the calls run once, no profiler)

bench_peers and bench_tiles give each kernel's time; this says where the time goes. The script runs itself
under `ncu --profile-from-start off --nvtx --clock-control none` (clocks free, as in bench_peers' bursts; ncu's
default locks them to the base clock): every implementation's call is compiled and warmed first, then each
runs once inside an NVTX range named "<impl> <family>" between cudaProfilerStart/Stop, so only those kernels
are profiled (each replayed once per metric pass, caches flushed before each pass). Operands and calls are
bench_peers' (gemm_operands / gemm_call, one group layout). The sections: SpeedOfLight, MemoryWorkloadAnalysis,
ComputeWorkloadAnalysis, Occupancy, LaunchStats, SchedulerStats, WarpStateStats, plus the tensor pipes'
active cycles and every warp stall reason per issued instruction. Writes ncu_gemm.csv (ncu's details page,
every metric of every profiled kernel), ncu_gemm.json (the metrics below per "<impl> <family>" and the run's
GPU, command, commit, date), ncu_gemm.png (elapsed cycles and tensor-pipe active share per call) and
prints a table of them.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import io
import json
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_peers import FAMILIES, gemm_call, gemm_operands, group_layouts, load_peers  # noqa: E402
from benchmarks.common import names_option, run_info, write_json  # noqa: E402

SECTIONS = ("SpeedOfLight", "MemoryWorkloadAnalysis", "ComputeWorkloadAnalysis", "Occupancy", "LaunchStats",
            "SchedulerStats", "WarpStateStats")
EXTRA_METRICS = ("regex:sm__pipe_tensor_op_.*cycles_active\\.avg\\.pct_of_peak_sustained_active",
                 "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio")
# (table heading, ncu metric name as the details page names it): what the table and the JSON keep
SUMMARY = (("ms", "Duration"), ("SM MHz", "SM Frequency"), ("SM %", "Compute (SM) Throughput"),
           ("DRAM %", "DRAM Throughput"), ("L2 hit %", "L2 Hit Rate"), ("L1 %", "L1/TEX Cache Throughput"),
           ("L2 %", "L2 Cache Throughput"), ("issue %", "Issue Slots Busy"), ("regs", "Registers Per Thread"),
           ("smem KB", "Dynamic Shared Memory Per Block"), ("grid", "Grid Size"), ("warp cyc/inst",
                                                                               "Warp Cycles Per Issued Instruction"))
STALL_PREFIX = "smsp__average_warps_issue_stalled_"
TENSOR_ACTIVE = "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"  # wgmma included
# metrics whose unit is converted: to ms, MHz, KiB
UNITS = {"Duration": {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0},
         "SM Frequency": {"hz": 1e-6, "cycle/second": 1e-6, "khz": 1e-3, "mhz": 1.0, "ghz": 1e3,
                          "cycle/usecond": 1.0, "cycle/nsecond": 1e3},
         "Dynamic Shared Memory Per Block": {"byte": 1 / 1024, "byte/block": 1 / 1024, "kbyte": 1000 / 1024,
                                             "kibyte": 1.0}}
SMOKE = dict(H=64, F=32, E=8, S=64, K=2, P=16, rows=512)


def profiled_calls(opts: dict, device: torch.device) -> list[tuple[str, object]]:
    """("<impl> <family>", zero-argument call) for every implementation x family, each called (compiled,
    autotuned, warmed) three times here. Ours first: importing quack makes CuTe DSL compiles single-threaded."""
    layouts = group_layouts(opts["rows"], opts["E"], opts["P"], opts["S"], opts["K"], seed=0)
    if opts["layout"] not in layouts:
        raise SystemExit(f"ncu_gemm: --layout {opts['layout']!r} is not one of {sorted(layouts)}")
    d = gemm_operands(layouts[opts["layout"]], opts["H"], opts["F"], device, seed=10, tokens=opts["S"])
    calls = []
    for impl in opts["impls"]:
        qgi = None
        if impl == "quack":
            mods, status = load_peers(device.type == "cuda")
            if "quack" not in mods:
                raise SystemExit(f"ncu_gemm: quack {status['quack']}")
            qgi = importlib.import_module("quack.gemm_interface")
        for fam in opts["families"]:
            call, _ = gemm_call(impl, fam, d, opts["P"], qgi)
            for _ in range(3):
                call()
            calls.append((f"{impl} {fam}", call))
    if device.type == "cuda":
        torch.cuda.synchronize()
    return calls


def run_profiled(opts: dict) -> None:
    """The process ncu profiles: each call once in its own NVTX range and profiler window."""
    device = torch.device("cuda", 0) if opts["device"] == "cuda" else torch.device("cpu")
    for name, call in profiled_calls(opts, device):
        if device.type != "cuda":
            call()
            print(f"ncu_gemm smoke: {name} ran", flush=True)
            continue
        torch.cuda.nvtx.range_push(name)
        torch.cuda.cudart().cudaProfilerStart()
        call()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        torch.cuda.nvtx.range_pop()


def details_rows(text: str) -> list[dict]:
    """ncu --csv --page details output -> its rows as dicts (ncu's own lines before the header dropped)."""
    start = text.find('"ID"')
    if start < 0:
        raise ValueError("ncu_gemm: no ncu details table in the output (no kernel was profiled?)")
    return list(csv.DictReader(io.StringIO(text[start:])))


def summarize(rows: list[dict], renamed: list[dict]) -> dict:
    """{"<impl> <family>": {kernel, metrics by SUMMARY heading, stalls {reason: warps per issue}}}: `rows` the
    details page with the kernels' names, `renamed` the same page with NVTX range names (same IDs). A call
    that ran several kernels keeps the longest one (the GEMM) and lists the others' names."""
    range_of = {r["ID"]: r["Kernel Name"].split("/")[0] for r in renamed}  # ncu 2025.3 prints "<range>/<kernel>"
    kernels: dict[str, dict] = {}
    for r in rows:
        k = kernels.setdefault(r["ID"], dict(range=range_of.get(r["ID"], "?"), kernel=r["Kernel Name"],
                                             metrics={}, stalls={}))
        name, value = r["Metric Name"], r["Metric Value"].replace(",", "")
        try:
            number = float(value)
        except ValueError:
            continue
        unit = r.get("Metric Unit", "").lower()
        if name in UNITS:  # ncu prints these in the unit it likes; one it has not printed before keeps its name
            if unit in UNITS[name]:
                number *= UNITS[name][unit]
            else:
                name = f"{name} [{unit}]"
        if name.startswith(STALL_PREFIX):
            k["stalls"][name[len(STALL_PREFIX):].replace("_per_issue_active.ratio", "")] = number
        else:
            k["metrics"][name] = number
    out: dict[str, dict] = {}
    for k in kernels.values():
        prev = out.get(k["range"])
        dur = k["metrics"].get("Duration", 0.0)
        if prev is None or dur > prev["metrics"].get("Duration", 0.0):
            others = ([prev["kernel"]] + prev["others"]) if prev else []
            out[k["range"]] = dict(kernel=k["kernel"], others=others, metrics=k["metrics"], stalls=k["stalls"])
        else:
            prev["others"].append(k["kernel"])
    for v in out.values():
        v["summary"] = {head: v["metrics"].get(metric) for head, metric in SUMMARY}
        v["top_stalls"] = sorted(v["stalls"].items(), key=lambda kv: -kv[1])[:6]
    return out


def table(summary: dict) -> list[str]:
    heads = [h for h, _ in SUMMARY]
    lines = ["range".ljust(18) + "".join(h.rjust(11) for h in heads)]
    for name in sorted(summary, key=lambda n: (n.split(" ")[-1], n)):
        s = summary[name]["summary"]
        lines.append(name.ljust(18) + "".join((f"{s[h]:11.3f}" if isinstance(s[h], float) else "-".rjust(11))
                                              for h in heads))
        lines.append("    stalls (warps per issued instruction): " + ", ".join(
            f"{r} {v:.2f}" for r, v in summary[name]["top_stalls"]))
    return lines


def plot(path: str) -> None:
    """ncu_gemm.json -> .png: each profiled call's elapsed cycles and tensor-pipe active share."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = json.load(open(path))
    names = sorted(d["kernels"], key=lambda n: (n.split("/")[0].split(" ")[-1], n))
    mets = [d["kernels"][n]["metrics"] for n in names]
    labels = [n.split("/")[0] for n in names]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, ylabel in ((axes[0], "Elapsed Cycles", "elapsed cycles (M)"), (axes[1], TENSOR_ACTIVE,
                                                                                 "tensor pipe active (%)")):
        vals = [m.get(key, 0.0) / (1e6 if key == "Elapsed Cycles" else 1.0) for m in mets]
        ax.bar(range(len(vals)), vals, color=["C0" if lab.startswith("ours") else "C1" for lab in labels])
        ax.set_xticks(range(len(vals)), labels, rotation=60, ha="right", fontsize=8)
        ax.set_ylabel(ylabel)
        ax.set_ylim(min(vals) * 0.95, max(vals) * 1.01)
    fig.suptitle(f"ncu, 1 call each, clocks free; {d['layout']}, H={d['H']} F={d['F']}\n{d['gpu']} "
                 f"{d['commit'][:7]} {d['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path.replace(".json", ".png"), dpi=120)
    plt.close(fig)


def profile(opts: dict, argv: list[str]) -> None:
    """Run this script under ncu (--child), then read its report twice (kernel names, NVTX names)."""
    out = opts["out"]
    os.makedirs(out, exist_ok=True)
    rep = os.path.join(out, "ncu_gemm")
    cmd = ["ncu", "--profile-from-start", "off", "--nvtx", "--clock-control", "none", "--target-processes", "all",
           "-f", "-o", rep] + [a for s in SECTIONS for a in ("--section", s)] + [
        "--metrics", ",".join(EXTRA_METRICS)] + [sys.executable, os.path.abspath(__file__), "--child"
                                                              ] + argv
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    page = ["ncu", "-i", rep + ".ncu-rep", "--csv", "--page", "details", "--print-units", "base"]
    text = subprocess.run(page, check=True, capture_output=True, text=True).stdout
    renamed = subprocess.run(page + ["--print-nvtx-rename", "kernel"], check=True, capture_output=True,
                             text=True).stdout
    with open(os.path.join(out, "ncu_gemm.csv"), "w") as f:
        f.write(text)
    summary = summarize(details_rows(text), details_rows(renamed))
    payload = dict(run_info(), layout=opts["layout"], clock_control="none",
                   **{k: opts[k] for k in ("H", "F", "E", "P", "rows")}, kernels=summary)
    path = write_json("ncu_gemm.json", payload, out)
    print("wrote", path, flush=True)
    try:
        plot(path)
    except Exception as e:  # noqa: BLE001  (no matplotlib, say: the JSON is written, the table still prints)
        print(f"no PNG: {e}", flush=True)
    print("\n".join(table(summary)), flush=True)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="where the report, CSV and JSON go (required on the GPU)")
    for k, v in dict(H=7168, F=2048, E=48, S=8192, K=8, P=128, rows=65536).items():
        ap.add_argument(f"--{k}", dest=k, type=int, default=v)
    ap.add_argument("--layout", default="16 x 4096", help="bench_peers group layout (48 equal, 16 x <rows/16>, "
                    "48 skewed)")
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma-separated GEMM families")
    ap.add_argument("--impls", default="ours,quack", help="comma-separated: ours, quack, torch")
    ap.add_argument("--child", action="store_true", help="(internal) the profiled process")
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny shapes, ours and torch, each call run once")
    args = ap.parse_args(argv)
    opts = vars(args)
    opts["families"] = names_option(ap, "--families", args.families, FAMILIES)
    opts["impls"] = names_option(ap, "--impls", args.impls, ("ours", "quack", "torch"))
    if args.smoke:
        opts.update(SMOKE, device="cpu", impls=[i for i in opts["impls"] if i != "quack"], layout="16 x 32")
        run_profiled(opts)
        return
    opts["device"] = "cuda"
    if args.child:
        run_profiled(opts)
    elif args.out is None:
        raise SystemExit("ncu_gemm: --out DIR is required (the report is written there)")
    else:
        profile(opts, argv)


if __name__ == "__main__":
    main()
