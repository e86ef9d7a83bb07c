"""The GEMM cells of stored bench_peers runs in SM cycles (CPU: it reads result files, runs nothing).

    python benchmarks/gemm_clocks.py RUN.json[.gz] [RUN ...] [--cells "fwd | 16 x 4096;wgrad | 48 equal"] [--out DIR]

A bench_peers run with --sustained-s holds, for each GEMM family, layout and implementation, the time per call
back to back at the board's power cap and the mean SM clock over that run's second half (common.run_sustained).
Their product is the call's cost in M SM cycles (common.mcycles), which does not depend on the clock the cap left
the kernel, as far as the call is bound by the SMs rather than by HBM. From it, per cell of each run (where ours
and QuACK both have clock samples): QuACK's cycles over ours' (> 1: ours does the call in fewer cycles) beside the
time ratios in the burst and at the cap, and the SM clock each implementation's burst time implies (its cycles at
the cap / its burst time). Why: the burst records no clock, so a burst cell below 1.0 does not say by itself
whether our kernel needs more cycles or ran at a lower clock than QuACK's in its 5-call windows; where ours takes
fewer cycles at the cap, the implied clocks name the second. Runs without sustained cells (bench_peers before
--sustained-s, or a run without it) are named and skipped. Writes gemm_clocks.json (each source run's GPU,
commit, date and command; every cell's figures) and gemm_clocks.png (benchmarks/plot_results.plot_gemm_clocks, if
matplotlib is there), and prints the table.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import mcycles, run_info, write_json  # noqa: E402

IMPLS = ("ours", "quack")


def load_run(path: str) -> dict:
    """A result file, gzipped (``.gz``) or not."""
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        return json.load(f)


def impl_cycles(row: dict, impl: str) -> dict | None:
    """`impl`'s M cycles per call at the cap in GEMM row `row` and the clock its burst time implies (MHz); None
    where the row has no burst time or no clock-sampled sustained run of it."""
    ms, cap_ms, clock = (row.get(f"{impl}_{k}") for k in ("ms", "sustained_ms", "sustained_clock_mhz"))
    if not all(isinstance(v, (int, float)) and v > 0 for v in (ms, cap_ms, clock)):
        return None
    cycles = row.get(f"{impl}_sustained_mcycles") or mcycles(cap_ms, clock)  # runs before session 54 lack the key
    return dict(mcycles=cycles, cap_clock_mhz=clock, burst_ms=ms, burst_implied_mhz=cycles / ms * 1e3)


def cell_figures(row: dict) -> dict | None:
    """QuACK's time over ours in the burst and at the cap, its cycles over ours at the cap, and each one's figures
    (``impl_cycles``); None unless both have them."""
    per = {impl: impl_cycles(row, impl) for impl in IMPLS}
    if None in per.values():
        return None
    ours, quack = per["ours"], per["quack"]
    return dict(burst=quack["burst_ms"] / ours["burst_ms"],
                cap=row["quack_sustained_ms"] / row["ours_sustained_ms"],
                cycles=quack["mcycles"] / ours["mcycles"], **per)


def run_figures(path: str, cells: list[str] | None) -> dict:
    """One source run: its GPU, commit, date and command, and ``cell_figures`` of its GEMM rows (those named in
    `cells`, or all)."""
    d = load_run(path)
    rows = {name: cell_figures(row) for name, row in (d.get("gemm") or {}).items()
            if cells is None or name in cells}
    file = os.path.basename(path)
    return dict(file=file, name=short_name(file), gpu=d.get("gpu"), commit=d.get("commit"), date=d.get("date"),
                command=d.get("command"), cells={k: v for k, v in rows.items() if v is not None})


def short_name(file: str) -> str:
    """A source run's file name without bench_peers' prefix and the extension."""
    return file.removeprefix("bench_peers_").split(".json")[0]


def table(runs: list[dict]) -> list[str]:
    lines = [f"{'run':>34} {'family | layout':>28} | {'burst':>6} {'cap':>6} {'cycles':>6} | Mcyc ours quack | "
             "burst-implied MHz ours quack"]
    for run in runs:
        if not run["cells"]:
            lines.append(f"{run['name'][:34]:>34} no GEMM cell with both ours' and QuACK's clock-sampled runs")
        for name, c in run["cells"].items():
            lines.append(f"{run['name'][:34]:>34} {name:>28} | {c['burst']:6.3f} {c['cap']:6.3f} {c['cycles']:6.3f} | "
                         f"{c['ours']['mcycles']:5.2f} {c['quack']['mcycles']:5.2f} | "
                         f"{c['ours']['burst_implied_mhz']:5.0f} {c['quack']['burst_implied_mhz']:5.0f}")
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="bench_peers result files (.json or .json.gz)")
    ap.add_argument("--cells", default="", help="semicolon-separated GEMM rows ('family | layout'); default: all")
    ap.add_argument("--out", default=None, help="result dir (default benchmarks/results)")
    opts = ap.parse_args(argv)
    cells = [c.strip() for c in opts.cells.split(";") if c.strip()] or None
    runs = [run_figures(p, cells) for p in opts.runs]
    lines = table(runs)
    path = write_json("gemm_clocks.json", dict(run_info(), cells_asked=cells, runs=runs), opts.out)
    try:
        from benchmarks.plot_results import plot_gemm_clocks
        plot_gemm_clocks(path)
    except ImportError:  # matplotlib is optional
        pass
    print("\n".join(lines + [f"wrote {path}"]))


if __name__ == "__main__":
    main()
