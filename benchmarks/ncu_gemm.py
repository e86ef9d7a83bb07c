"""Nsight Compute profile of one call of each GEMM family by ours and QuACK, clocks free (1 GPU).

    source .carry/prelude.sh && source .carry/peers.sh && python3 benchmarks/ncu_gemm.py --out $OUT/ncu
    python benchmarks/ncu_gemm.py --smoke          (CPU: the calls run once, no profiler)
    ... ncu_gemm.py --layer ours,sonicmoe --out $OUT/ncu_layer   (the GEMM kernels of one layer training step)

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

`--layer IMPLS`: instead of the GEMM families, one forward + backward step of bench_peers' MoE layer (S=8192,
H=7168, F=2048, E=48, K=8, R=1, its exact-routing inputs) per implementation (ours, sonicmoe), after two warm
steps, in one NVTX range "<impl> layer"; only kernels whose name holds "gemm" (any case) are profiled (ours'
grouped GEMMs, QuACK's inside SonicMoE; the router's cuBLAS GEMMs are not), each kept as "<impl> layer
<n> <kernel class>" in launch order (the backward's kernels, which autograd launches from its own thread
outside the range, under the step of the last kernel with a range): what each GEMM of the layer costs in
cycles there, against the same family's call alone.

`--tiles "NAME;NAME"`: ours compiled with each named bench_tiles candidate (``bench_tiles.config_name``) instead of
the op's tile, each profiled as "ours[NAME] <family>": where a candidate's cycles, DRAM and L2 bytes go.

`--source`: also the SourceCounters section (warp states sampled per SASS instruction): ncu's source page of
every kernel goes to ncu_source.csv.gz, and per launch its samples' shares by stall reason and its instructions
with the most samples (``source_hotspots``) into the JSON's "source_hotspots": which wait (a barrier, a load, the
wgmma) holds its warps.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import importlib
import io
import json
import os
import re
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_peers import (FAMILIES, OursLayer, SonicLayer, gemm_call, gemm_operands,  # noqa: E402
                                    group_layouts, layer_inputs, load_peers, ours_group)
from benchmarks.bench_tiles import CANDIDATES, config_name, ours_call  # noqa: E402
from benchmarks.common import names_option, run_info, write_json  # noqa: E402
from csrc_cute.group_gemm.config import GroupGemmConfig  # noqa: E402

SECTIONS = ("SpeedOfLight", "MemoryWorkloadAnalysis", "ComputeWorkloadAnalysis", "Occupancy", "LaunchStats",
            "SchedulerStats", "WarpStateStats")
# sm__cycles_active min/max/avg: how unevenly the persistent CTAs' work spreads over the SMs (the slowest SM
# sets the kernel's time; avg against "Elapsed Cycles" alone mixes that spread with the launch and the tail)
EXTRA_METRICS = ("regex:sm__pipe_tensor_op_.*cycles_active\\.avg\\.pct_of_peak_sustained_active",
                 "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio",
                 "sm__cycles_active.min", "sm__cycles_active.max", "sm__cycles_active.avg",
                 "dram__bytes_read.sum", "lts__t_bytes.sum",
                 # shared-memory bank conflicts of the threads' loads and stores (an epilogue's sub-tile traffic)
                 "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum",
                 "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum")
# (table heading, ncu metric name as the details page names it): what the table and the JSON keep
SUMMARY = (("ms", "Duration"), ("SM MHz", "SM Frequency"), ("SM %", "Compute (SM) Throughput"),
           ("DRAM %", "DRAM Throughput"), ("L2 hit %", "L2 Hit Rate"), ("L1 %", "L1/TEX Cache Throughput"),
           ("L2 %", "L2 Cache Throughput"), ("issue %", "Issue Slots Busy"), ("regs", "Registers Per Thread"),
           ("smem KB", "Dynamic Shared Memory Per Block"), ("grid", "Grid Size"), ("warp cyc/inst",
                                                                               "Warp Cycles Per Issued Instruction"),
           ("DRAM rd MB", "dram__bytes_read.sum"), ("L2 MB", "lts__t_bytes.sum"))
STALL_PREFIX = "smsp__average_warps_issue_stalled_"
TENSOR_ACTIVE = "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"  # wgmma included
# metrics whose unit is converted: to ms, MHz, MB (the DRAM and L2 bytes), KiB
UNITS = {"Duration": {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0},
         "SM Frequency": {"hz": 1e-6, "cycle/second": 1e-6, "khz": 1e-3, "mhz": 1.0, "ghz": 1e3,
                          "cycle/usecond": 1.0, "cycle/nsecond": 1e3},
         **{m: {"byte": 1e-6, "kbyte": 1e-3, "mbyte": 1.0, "gbyte": 1e3} for m in ("dram__bytes_read.sum",
                                                                                   "lts__t_bytes.sum")},
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
            for name, call in impl_calls(impl, fam, d, opts, qgi, device):
                for _ in range(3):
                    call()
                calls.append((f"{name} {fam}", call))
    if device.type == "cuda":
        torch.cuda.synchronize()
    return calls


def impl_calls(impl: str, fam: str, d: dict, opts: dict, qgi, device: torch.device) -> list[tuple[str, object]]:
    """(name, zero-argument call) of `impl`'s `fam`: bench_peers' call, or for ours with `--tiles` one call per
    bench_tiles candidate named there ("ours[<candidate>]", its kernel compiled with that config)."""
    if impl != "ours" or not opts.get("tiles"):
        return [(impl, gemm_call(impl, fam, d, opts["P"], qgi)[0])]
    candidates = {config_name(*c): c for c in CANDIDATES.get(fam, ())}
    unknown = [t for t in opts["tiles"] if t not in candidates]
    if unknown:
        raise SystemExit(f"ncu_gemm: --tiles {unknown} are not bench_tiles candidates of {fam}: {sorted(candidates)}")
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    return [(f"ours[{t}]", ours_call(fam, d, opts["P"], GroupGemmConfig(c[0], c[1], num_sms, *c[2:]))[0])
            for t, c in ((t, candidates[t]) for t in opts["tiles"])]


def layer_steps(impls: list[str], device: torch.device) -> list[tuple[str, object]]:
    """("<impl> layer", one forward + backward step of bench_peers' layer by impl) for ours / sonicmoe, each
    step run twice here (compiled, warm). Ours' R = 1 EPGroup makes its own 1-rank process group."""
    o = dict(S=8192, H=7168, E=48, K=8, F=2048, P=128, seed=0)
    (x, router_w, w_gate, w_up, w_down, g), _ = layer_inputs(o, device)
    steps = []
    for impl in impls:
        if impl == "ours":
            layer = OursLayer(ours_group(o, device, "ours"), router_w, w_gate, w_up, w_down)
        else:
            mods, status = load_peers(True)
            if "sonicmoe" not in mods:
                raise SystemExit(f"ncu_gemm: sonicmoe {status['sonicmoe']}")
            layer = SonicLayer(mods["sonicmoe"], router_w, w_gate, w_up, w_down, o["K"])
        xg = x.clone().requires_grad_()

        def step(layer=layer, xg=xg):
            layer(xg).backward(g)
        for _ in range(2):
            step()
        steps.append((f"{impl} layer", step))
    torch.cuda.synchronize()
    return steps


def run_profiled(opts: dict) -> None:
    """The process ncu profiles: each call once in its own NVTX range and profiler window."""
    device = torch.device("cuda", 0) if opts["device"] == "cuda" else torch.device("cpu")
    calls = layer_steps(opts["layer"], device) if opts["layer"] else profiled_calls(opts, device)
    for name, call in calls:
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


def summarize(rows: list[dict], renamed: list[dict], every_kernel: bool = False) -> dict:
    """{"<impl> <family>": {kernel, metrics by SUMMARY heading, stalls {reason: warps per issue}}}: `rows` the
    details page with the kernels' names, `renamed` the same page with NVTX range names (same IDs). A call
    that ran several kernels keeps the longest one (the GEMM) and lists the others' names; with
    `every_kernel` (--layer) each kernel is kept, as "<range> <n> <kernel class>" in launch order."""
    range_of = {r["ID"]: r["Kernel Name"].split("/")[0] for r in renamed}  # ncu 2025.3 prints "<range>/<kernel>"
    names = {r["ID"]: r["Kernel Name"] for r in rows}
    if every_kernel:
        # autograd runs the backward's kernels on its own thread, outside the step's NVTX range (NVTX ranges
        # are per thread): a kernel without a range belongs to the step of the last one with a range (the
        # implementations' steps run one after another, each synchronised)
        ranged = {r["ID"] for r in renamed if "/" in r["Kernel Name"]}
        last, seen = "?", {}
        for kid in sorted(range_of, key=int):
            last = range_of[kid] if kid in ranged else last
            seen[last] = seen.get(last, 0) + 1
            kernel_class = re.search(r"(?:[A-Z][a-z0-9]*)*Gemm(?:[A-Z][a-z0-9]*)*?Sm90", names.get(kid, ""))
            range_of[kid] = f"{last} {seen[last]}{' ' + kernel_class.group(0) if kernel_class else ''}"
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


def order(name: str) -> tuple:
    """Table order: the families' calls by family, then impl; a layer step's kernels by impl, then launch."""
    parts = name.split(" ")
    return (parts[0], int(parts[2])) if parts[1:2] == ["layer"] else (parts[-1], name)


def table(summary: dict) -> list[str]:
    heads = [h for h, _ in SUMMARY]
    width = max([18] + [len(n) + 1 for n in summary])
    lines = ["range".ljust(width) + "".join(h.rjust(11) for h in heads)]
    for name in sorted(summary, key=order):
        s = summary[name]["summary"]
        lines.append(name.ljust(width) + "".join((f"{s[h]:11.3f}" if isinstance(s[h], float) else "-".rjust(11))
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
    names = sorted(d["kernels"], key=order)
    mets = [d["kernels"][n]["metrics"] for n in names]
    labels = [n.split("/")[0] for n in names]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5 + 0.04 * max(len(lab) for lab in labels)))
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
           "-f", "-o", rep] + (["--kernel-name", "regex:(?i)gemm"] if opts["layer"] else []) + [a for s in SECTIONS for a in ("--section", s)] + [
        "--metrics", ",".join(EXTRA_METRICS)] + [sys.executable, os.path.abspath(__file__), "--child"
                                                              ] + argv
    if opts["source"]:
        cmd[cmd.index("--metrics"):cmd.index("--metrics")] = ["--section", "SourceCounters", "--import-source", "no"]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    hotspots = None
    if opts["source"]:
        page_text = write_source_page(rep + ".ncu-rep", os.path.join(out, "ncu_source.csv.gz"))
        try:
            hotspots = source_hotspots(page_text)
        except (KeyError, ValueError) as e:  # a page layout this parser has not seen: the page itself is kept
            print(f"no source hotspots ({type(e).__name__}: {e}); see ncu_source.csv.gz", flush=True)
    page = ["ncu", "-i", rep + ".ncu-rep", "--csv", "--page", "details", "--print-units", "base"]
    text = subprocess.run(page, check=True, capture_output=True, text=True).stdout
    renamed = subprocess.run(page + ["--print-nvtx-rename", "kernel"], check=True, capture_output=True,
                             text=True).stdout
    with open(os.path.join(out, "ncu_gemm.csv"), "w") as f:
        f.write(text)
    summary = summarize(details_rows(text), details_rows(renamed), every_kernel=bool(opts["layer"]))
    payload = dict(run_info(), layout="layer step" if opts["layer"] else opts["layout"], clock_control="none",
                   **{k: opts[k] for k in ("H", "F", "E", "P", "rows")}, kernels=summary)
    if hotspots is not None:
        payload["source_hotspots"] = hotspots  # "<n> <kernel name>" -> its stall shares and busiest instructions
    path = write_json("ncu_gemm.json", payload, out)
    print("wrote", path, flush=True)
    try:
        plot(path)
    except Exception as e:  # noqa: BLE001  (no matplotlib, say: the JSON is written, the table still prints)
        print(f"no PNG: {e}", flush=True)
    print("\n".join(table(summary)), flush=True)


def write_source_page(report: str, path: str) -> str:
    """ncu's source page of every kernel of ``report`` (SASS, with the SourceCounters section's per-instruction
    warp-state samples), gzipped to ``path``: where in the kernel its warps wait. Returns the page's text."""
    text = subprocess.run(["ncu", "-i", report, "--csv", "--page", "source", "--print-source", "sass"], check=True,
                          capture_output=True, text=True).stdout
    with gzip.open(path, "wt") as f:
        f.write(text)
    print(f"wrote {path}: {len(text.splitlines())} lines", flush=True)
    return text


SAMPLES = "Warp Stall Sampling (All Samples)"


def _count(value: str | None) -> int:
    return int(float((value or "0").replace(",", "")))  # ncu writes 1,234


def source_hotspots(text: str, top: int = 12) -> dict[str, dict]:
    """ncu's CSV source page (a ``"Kernel Name","<name>"`` line before each launch's table of SASS instructions,
    one row per address) -> per launch, keyed "<n> <kernel name>" in the page's order (a kernel launched three
    times is three tables): ``stalls``, the share of its warp-state samples (all warps, issued or not) per stall
    reason (ncu's ``stall_<reason>`` columns), largest first; ``top``, its ``top`` instructions by samples:
    address, SASS text, samples, their share of the launch's, and the reason with most of them."""
    tables: list[tuple[str, list[dict]]] = []
    header = None
    for row in csv.reader(io.StringIO(text)):
        if len(row) >= 2 and row[0] == "Kernel Name":
            tables.append((row[1], []))
            header = None
        elif tables and row and row[0] == "Address":
            header = row
        elif tables and header is not None and len(row) == len(header):
            tables[-1][1].append(dict(zip(header, row)))
    hot = {}
    for i, (name, rows) in enumerate(tables):
        reasons = [c for c in (rows[0] if rows else {}) if c.startswith("stall_") and not c.endswith("(Not Issued)")]
        total = sum(_count(r.get(SAMPLES)) for r in rows) or 1
        by_reason = {c.removeprefix("stall_"): sum(_count(r[c]) for r in rows) / total for c in reasons}

        def top_reason(r):
            return max(reasons, key=lambda c: _count(r[c])).removeprefix("stall_") if reasons else None
        ranked = sorted(rows, key=lambda r: -_count(r.get(SAMPLES)))[:top]
        hot[f"{i + 1} {name}"] = dict(
            stalls={k: round(v, 4) for k, v in sorted(by_reason.items(), key=lambda kv: -kv[1]) if v > 0},
            top=[dict(address=r["Address"], sass=r.get("Source", ""), samples=_count(r.get(SAMPLES)),
                      share=round(_count(r.get(SAMPLES)) / total, 4), stall=top_reason(r)) for r in ranked])
    return hot


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
    ap.add_argument("--layer", default="", help="comma-separated (ours, sonicmoe): profile the GEMM kernels of one "
                    "layer training step of each instead of the families")
    ap.add_argument("--source", action="store_true", help="also sample each kernel's warps per SASS instruction "
                    "(the SourceCounters section) and write ncu's source page (ncu_source.csv.gz)")
    ap.add_argument("--tiles", default="", help="semicolon-separated bench_tiles candidate names (e.g. '128x192 "
                    "pingpong band 16;128x192 pingpong band 16 cluster 2x1'): ours compiled with each instead of "
                    "the op's choice")
    ap.add_argument("--child", action="store_true", help="(internal) the profiled process")
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny shapes, ours and torch, each call run once")
    args = ap.parse_args(argv)
    opts = vars(args)
    opts["families"] = names_option(ap, "--families", args.families, FAMILIES)
    opts["impls"] = names_option(ap, "--impls", args.impls, ("ours", "quack", "torch"))
    opts["layer"] = names_option(ap, "--layer", args.layer, ("ours", "sonicmoe")) if args.layer else []
    opts["tiles"] = [t.strip() for t in args.tiles.split(";") if t.strip()]
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
