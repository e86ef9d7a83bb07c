"""Sustained training steps of one MoE layer on one GPU: the time of every fwd+bwd step from idle, with the SM
clock, the power draw and the clock-limit reasons (nvidia-smi) beside them.

    source .carry/prelude.sh && source .carry/peers.sh && python3 benchmarks/bench_sustained.py --out $OUT
    python benchmarks/bench_sustained.py --smoke      (tiny shapes on the CPU: ours and ours_rows, no clocks)

Why: bench_peers times back-to-back steps (warm-up, then repeats of `iters` steps), and on an H200 a DESIGN-shape
step draws the board's 700 W within ~0.5 s: the SM clock then falls from 1980 MHz to ~1450 MHz (reason: SW
power cap), so a step's sustained time is set by its energy, while one profiled step after a pause runs at
the boost clock. This measures both ends per implementation: `first3_ms` (the mean of the first three steps
after `--idle-s` seconds idle) and `last20_ms` (the last twenty of `--steps`), with the mean clock and power
over the last 40% of each run. Rounds rotate the order of the implementations (ours: MoELayer with the
default EPGroup, the gathered path at R = 1; ours_rows: EPGroup(gather_rows=False); sonicmoe: sonicmoe.MoE
with its own kernels, on the same inputs and experts as bench_peers). Phase 1 runs ours and ours_rows; phase
2 adds SonicMoE (its first step compiles its kernels: minutes on a fresh machine) and runs every
implementation again; the JSON is written after each phase.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_peers import (  # noqa: E402
    OursLayer, SonicLayer, layer_inputs, load_peers, ours_group, versions)
from benchmarks.common import (  # noqa: E402
    ClockSampler, apply_smoke_defaults, grad_clearer, make_step, names_option, rotated, run_info, window_means,
    write_json)

IMPLS = ("ours", "ours_rows", "sonicmoe")
SMOKE = dict(S=64, H=64, F=32, E=8, K=2, P=16, steps=4, rounds=1, idle_s=0.0)


def build(impl: str, opts: dict, inputs, peers: dict, device):
    """One implementation on the shared inputs (bench_peers' layer classes and groups)."""
    x, router_w, w_gate, w_up, w_down, _ = inputs
    if impl == "sonicmoe":
        return SonicLayer(peers["sonicmoe"], router_w, w_gate, w_up, w_down, opts["K"])
    return OursLayer(ours_group(opts, device, impl), router_w, w_gate, w_up, w_down)


def timed_steps(step, n: int, cuda: bool) -> list[float]:
    """The time of each of `n` back-to-back steps, ms (CUDA events between them; no sync in between)."""
    if not cuda:
        times = []
        for _ in range(n):
            t = time.perf_counter()
            step()
            times.append((time.perf_counter() - t) * 1e3)
        return times
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    ev[0].record()
    for i in range(n):
        step()
        ev[i + 1].record()
    torch.cuda.synchronize()
    return [ev[i].elapsed_time(ev[i + 1]) for i in range(n)]


def summary(runs: list[dict], samples: list[tuple[float, float, float, str]]) -> dict:
    """Per implementation: means over its runs of first3_ms / last20_ms, and of the clock and power sampled in
    the last 40% of each run; the clock-limit reasons seen there."""
    out: dict[str, dict] = {}
    for run in runs:
        row = out.setdefault(run["impl"], dict(first3_ms=[], last20_ms=[], clock_mhz=[], power_w=[], reasons=set()))
        ms = run["ms"]
        row["first3_ms"].append(sum(ms[:3]) / len(ms[:3]))
        row["last20_ms"].append(sum(ms[-20:]) / len(ms[-20:]))
        late = window_means(samples, run["t0"] + 0.6 * (run["t1"] - run["t0"]), run["t1"])
        if late is not None:
            row["clock_mhz"].append(late["clock_mhz"])
            row["power_w"].append(late["power_w"])
            row["reasons"].update(late["reasons"])

    def mean(v):
        return round(sum(v) / len(v), 3) if v else None

    return {impl: dict(first3_ms=mean(r["first3_ms"]), last20_ms=mean(r["last20_ms"]), clock_mhz=mean(r["clock_mhz"]),
                       power_w=mean(r["power_w"]), reasons=sorted(r["reasons"]), runs=len(r["first3_ms"]))
            for impl, r in out.items()}


def run_rounds(impls: dict, opts: dict, step_of, cuda: bool, phase: int, log) -> list[dict]:
    names, runs = list(impls), []
    for rnd in range(opts["rounds"]):
        for name in rotated(names, rnd):
            time.sleep(opts["idle_s"])
            t0 = time.time()
            ms = timed_steps(step_of(impls[name]), opts["steps"], cuda)
            runs.append(dict(phase=phase, round=rnd, impl=name, t0=t0, t1=time.time(), ms=[round(m, 4) for m in ms]))
            log(f"phase {phase} round {rnd} {name:9s} first3 {sum(ms[:3]) / len(ms[:3]):.3f} ms, last20 "
                f"{sum(ms[-20:]) / len(ms[-20:]):.3f} ms")
    return runs


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="result dir (default benchmarks/results)")
    for k, v in dict(S=8192, H=7168, F=2048, E=48, K=8, P=128, steps=60, rounds=3).items():
        ap.add_argument(f"--{k}", type=int, default=v)
    ap.add_argument("--idle-s", dest="idle_s", type=float, default=1.5, help="idle seconds before each run")
    ap.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated ({', '.join(IMPLS)})")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (ours and ours_rows)")
    args = ap.parse_args(argv)
    if args.smoke:
        apply_smoke_defaults(args, argv, SMOKE)
    opts = vars(args)
    wanted = names_option(ap, "--impls", args.impls, IMPLS)
    cuda = not args.smoke
    if cuda and not torch.cuda.is_available():
        raise SystemExit("bench_sustained: no CUDA device (use --smoke for the CPU check)")
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{tempfile.mkdtemp()}/store", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=600))
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[bench_sustained {time.perf_counter() - t_start:7.1f}s] {msg}", flush=True)

    inputs, _ = layer_inputs(opts, device)
    x, g, dtype = inputs[0], inputs[-1], inputs[0].dtype
    xg = x.clone().requires_grad_()
    mods, status = load_peers(cuda)

    def step_of(impl):
        return make_step(impl, xg, g, grad_clearer(impl.module, xg))

    sampler = ClockSampler() if cuda else None
    impls, runs, samples = {}, [], []
    phases = [[i for i in wanted if i != "sonicmoe"]]
    if "sonicmoe" in wanted and "sonicmoe" in mods:
        phases.append(wanted)
    info = dict(run_info(), versions=versions(mods), peers=status, smoke=args.smoke,
                dtype=str(dtype).replace("torch.", ""), R=1,
                **{k: opts[k] for k in ("S", "H", "F", "E", "K", "P", "steps", "rounds", "idle_s")})
    path = None
    for phase, names in enumerate(phases, 1):
        for name in names:
            if name not in impls:
                impls[name] = build(name, opts, inputs, mods, device)
                for _ in range(3):  # compiles (and, for SonicMoE, its first-call setup) happen here
                    step_of(impls[name])()
                log(f"{name}: built and warm")
        runs += run_rounds({n: impls[n] for n in names}, opts, step_of, cuda, phase, log)
        if sampler is not None:  # its samples so far; a fresh sampler for the next phase
            samples += sampler.samples()
            sampler = ClockSampler() if phase < len(phases) else None
        by_phase = {p: summary([r for r in runs if r["phase"] == p], samples) for p in range(1, phase + 1)}
        path = write_json("bench_sustained.json", dict(info, summary=by_phase, runs=runs,
                                                       clock_samples=[list(s) for s in samples],
                                                       wall_s=round(time.perf_counter() - t_start, 1)), args.out)
        for impl, row in by_phase[phase].items():
            log(f"phase {phase} {impl:9s} {row}")
    log(f"wrote {path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
