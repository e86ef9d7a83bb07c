"""Shared benchmark plumbing: CUDA timing, nvidia-smi's clock and power samples (`ClockSampler`), the multi-rank
timing harness (`Bench`), training-step and CUDA-graph capture helpers, and result files that name the GPU,
command, commit, date."""

from __future__ import annotations

import datetime
import gc
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

from csrc_cute.group_gemm.config import tiles_hbm_gbs

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
SMI_FIELDS = "timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active"


class ClockSampler:
    """nvidia-smi sampling SM clock, power and the clock-limit reasons every `period_ms` in the background
    into a file of its own (none on a machine without it): `samples()` stops it and returns [(unix time,
    MHz, W, reasons)]. (Through a pipe, nvidia-smi's block-buffered output since the last flush was lost
    when it was stopped: the first GPU run of bench_sustained lost its last ~30 s of samples.)"""

    def __init__(self, period_ms: int = 100):
        self.path = tempfile.mktemp(suffix=".csv", prefix="moonep_bench_smi_")
        try:
            self.proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader,nounits",
                                          f"-lms={period_ms}", f"--filename={self.path}"])
        except OSError:
            self.proc = None

    def samples(self) -> list[tuple[float, float, float, str]]:
        if self.proc is None:
            return []
        self.proc.send_signal(signal.SIGINT)  # its clean exit: the file is flushed and closed
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        out = []
        with open(self.path) as f:
            for line in f:
                parts = [p.strip() for p in line.split(",")]
                try:  # nvidia-smi's timestamp is the machine's local time
                    stamp = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                    out.append((stamp, float(parts[1]), float(parts[2]), parts[3]))
                except (ValueError, IndexError):
                    continue
        os.unlink(self.path)
        return out


def window_means(samples: list[tuple[float, float, float, str]], t0: float, t1: float) -> dict | None:
    """Mean SM clock (MHz) and power (W) of the ClockSampler samples in [t0, t1] (unix time) and the clock-limit
    reasons seen there; None when no sample falls in it."""
    late = [s for s in samples if t0 <= s[0] <= t1]
    if not late:
        return None
    return dict(clock_mhz=sum(s[1] for s in late) / len(late), power_w=sum(s[2] for s in late) / len(late),
                reasons=sorted({s[3] for s in late}))


def run_sustained(calls: dict, burst_ms: dict, seconds: float, idle_s: float, cuda: bool = True) -> dict:
    """Each of ``calls`` (name -> zero-argument call, in that order) launched back to back for about ``seconds``
    (``seconds`` / its burst time ``burst_ms[name]`` calls, rounded up), each run after ``idle_s`` idle, with
    nvidia-smi sampling the SM clock and the power (``ClockSampler``): name -> its time per call over the whole
    run (``sustained_ms``; CUDA events, or the wall clock where ``cuda`` is False) and, over the run's second half
    (where a kernel that draws the board's cap has settled at it), the mean clock, power, energy per call (power x
    time), M cycles per call (``mcycles``) and clock-limit reasons (none without samples). Why: a burst runs before
    the board has settled, but a training step holds it at its power cap, where a kernel's time follows its energy
    (results/bench_sustained.json); the cycles say how much of a difference in time is the kernel's work and how
    much the clock its power left it."""
    sampler, runs = ClockSampler(), {}
    for name, call in calls.items():
        time.sleep(idle_s)
        n = max(1, math.ceil(seconds * 1e3 / burst_ms[name]))
        t0 = time.time()
        if cuda:
            ms = events_ms(call, n)
        else:
            for _ in range(n):
                call()
            ms = (time.time() - t0) * 1e3 / n
        runs[name] = (t0, time.time(), ms)
    samples = sampler.samples()
    out = {}
    for name, (t0, t1, ms) in runs.items():
        late = window_means(samples, t0 + 0.5 * (t1 - t0), t1)
        out[name] = dict(sustained_ms=ms)
        if late is not None:
            out[name].update(sustained_clock_mhz=late["clock_mhz"], sustained_power_w=late["power_w"],
                             sustained_mj=late["power_w"] * ms, sustained_mcycles=mcycles(ms, late["clock_mhz"]),
                             sustained_reasons=late["reasons"])
    return out


def mcycles(ms: float, clock_mhz: float) -> float:
    """A call's cost in millions of SM cycles: its time (ms) at a mean SM clock (MHz). It does not move with the
    clock as far as the call is bound by the SMs (not by HBM, whose bandwidth does not scale with the SM clock)."""
    return ms * clock_mhz / 1e3


def sustained_text(cell: dict) -> str:
    """One ``run_sustained`` result as a log line's tail."""
    if "sustained_clock_mhz" not in cell:
        return f"sustained {cell['sustained_ms']:7.3f} ms (no clock samples)"
    return (f"sustained {cell['sustained_ms']:7.3f} ms {cell['sustained_clock_mhz']:6.0f} MHz "
            f"{cell['sustained_power_w']:5.0f} W {cell['sustained_mj']:7.1f} mJ {cell['sustained_mcycles']:6.2f} Mcyc")


def cuda_time_ms(fn, iters: int = 20, repeats: int = 5, warmup: int = 3) -> float:
    """Median over `repeats` of the mean time of `iters` back-to-back calls, in ms (CUDA events)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = sorted(events_ms(fn, iters) for _ in range(repeats))
    return times[len(times) // 2]


def events_ms(call, n: int) -> float:
    """Mean time (ms) of ``n`` back-to-back calls of ``call``, from CUDA events recorded around them."""
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        call()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / n


def rotated(names: list, turn: int) -> list:
    """`names` starting at entry ``turn`` (mod its length), wrapping around: the order of round `turn` of a
    rotation in which every name takes every place equally often (empty stays empty)."""
    k = turn % len(names) if names else 0
    return names[k:] + names[:k]


def time_round_robin(calls: dict, time_once, repeats: int) -> dict:
    """Median time of each of `calls` (name -> zero-argument call) over `repeats` rounds, each round
    timing every call once (``time_once(call)``), round r starting at the r-th call (rotated): the
    candidates of one sweep row share the GPU's clock and temperature drift instead of one candidate
    taking all of a slow stretch (in one run two candidates with the same tile order, timed one after
    the other, differed by 12%), and each takes each place in a round equally often (with a fixed order,
    one H200 run had the third of four candidates fastest at every layout, also where its tile order was
    the first one's: results/bench_tiles_456724f.json; used by bench_tiles and bench_peers' GEMM section)."""
    names = list(calls)
    times: dict = {name: [] for name in names}
    for r in range(repeats if names else 0):  # no calls (every candidate failed its check): nothing to time
        for name in rotated(names, r):
            times[name].append(time_once(calls[name]))
    return {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}


# a commit as run_info records it: a full or abbreviated hash, and after a "+" what a device run's tree adds to it
COMMIT_RE = re.compile(r"[0-9a-f]{7,40}(\+[\w.-]+)?")


def run_info() -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # set by a device run's script: the commit its tree is at (the device copy's git can name an older one: in
    # session 32 it named the session's first commit after two more had landed)
    commit = os.environ.get("MOONEP_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                                    text=True).stdout.strip()
        except OSError:
            pass
    info = dict(gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
                gpus=torch.cuda.device_count(), torch=torch.__version__,
                command=" ".join([os.path.basename(sys.executable)] + sys.argv),
                commit=commit if COMMIT_RE.fullmatch(commit) else "unknown",
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    tiles_hbm = tiles_hbm_gbs(None)  # $MOONEP_HBM_GBS, read as the GEMM host reads it (None where unset)
    if tiles_hbm is not None:  # the GEMMs ran the tiles of a device of this HBM bandwidth, not the GPU's own
        info["tiles_hbm_gbs"] = tiles_hbm
    return info


def apply_smoke_defaults(args, argv: list[str] | None, smoke: dict) -> None:
    """`--smoke`: the tiny CPU shapes in `smoke`, except for the options given on the command line."""
    given = {a.lstrip("-").split("=")[0].replace("-", "_") for a in (argv if argv is not None else sys.argv[1:])
             if a.startswith("--")}
    for k, v in smoke.items():
        if k not in given:
            setattr(args, k, v)


def names_option(ap, option: str, text: str, known) -> list[str]:
    """A comma-separated option's names (empty items dropped), each one of `known`; else the parser's error
    naming the option and the unknown names."""
    got = [n for n in text.split(",") if n]
    unknown = sorted(set(got) - set(known))
    if unknown:
        ap.error(f"{option}: unknown {unknown} (known: {', '.join(known)})")
    return got


def write_json(name: str, payload: dict, out_dir: str | None = None) -> str:
    out_dir = out_dir or RESULTS
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
    return path


class Bench:
    def __init__(self, rank: int, R: int, opts: dict, device: torch.device, group, name: str = "bench_e2e"):
        self.rank, self.R, self.opts, self.device, self.group = rank, R, opts, device, group
        self.cuda = device.type == "cuda"
        self.t0 = time.perf_counter()
        self.name = name
        self.lines: list[str] = []  # rank 0's log lines

    def log(self, msg: str) -> None:
        if self.rank == 0:
            self.lines.append(f"[{self.name} {time.perf_counter() - self.t0:7.1f}s] {msg}")
            print(self.lines[-1], flush=True)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def agree(self, values: list[float], op=dist.ReduceOp.MAX) -> list[float]:
        """Element-wise max over ranks (NaN-free: -1 marks a missing value)."""
        t = torch.tensor([-1.0 if v is None or v != v else float(v) for v in values], dtype=torch.float64,
                         device=self.device if self.cuda else "cpu")
        dist.all_reduce(t, op=op, group=self.group)
        return [None if v < 0 else v for v in t.tolist()]

    def time_ms(self, fn, repeats: int | None = None) -> float:
        """Median over `repeats` (default --repeats) of the mean time of `iters` back-to-back steps, in ms
        (after warm-up)."""
        iters, repeats = self.opts["iters"], repeats or self.opts["repeats"]
        times = []
        for _ in range(repeats):
            if self.cuda:
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(iters):
                    fn()
                stop.record()
                torch.cuda.synchronize(self.device)
                times.append(start.elapsed_time(stop) / iters)
            else:
                t = time.perf_counter()
                for _ in range(iters):
                    fn()
                times.append((time.perf_counter() - t) * 1e3 / iters)
        return sorted(times)[len(times) // 2]

    def memory(self, step, clear) -> tuple[float | None, float | None, float | None]:
        """(peak GB, resident GB, device-used GB) of one step after clearing grads (CUDA only)."""
        if not self.cuda:
            return None, None, None
        clear()
        self.sync()
        torch.cuda.reset_peak_memory_stats(self.device)
        resident = torch.cuda.memory_allocated(self.device)
        step()
        self.sync()
        peak = torch.cuda.max_memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        return peak / 2**30, resident / 2**30, (total - free) / 2**30

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def failure(self, e: BaseException, label: str, ep) -> float:
        """The failure code of a measurement that raised `e` (an OOM or a kernel's status error, e.g. a
        barrier timeout): 1.0 OOM (caches freed), 2.0 status error (logged, the status word cleared)."""
        if isinstance(e, torch.OutOfMemoryError):
            self.free()
            return 1.0
        self.log(f"{label}: {e}")
        if ep is not None:
            ep.status.zero_()
        return 2.0

    def agreed_error(self, failed: float) -> str | None:
        """The error every rank records for a measurement (collective): None if no rank failed."""
        failed = self.agree([failed])[0]
        return None if not failed else "OOM" if failed == 1.0 else "status error (see the log)"


def symmetric_bytes(ep) -> int | None:
    """Bytes of an EPGroup's symmetric-memory buffers (tables, presum, slot pools, fp32 reduce buffers), which
    the caching allocator's counters do not include: 0 for a group without symmetric memory (the CPU
    reference; one rank on CUDA, whose few buffers are ordinary tensors inside those counters,
    moonep_ops/buffers.py); None before the weight buffers exist."""
    if ep._pools is None:
        return None
    return ep.buffer_bytes if ep.layout.symmetric else 0


def grad_clearer(module: nn.Module, x: torch.Tensor):
    params = [p for p in module.parameters() if p.requires_grad]

    def clear():
        for p in params:
            p.grad = None
        x.grad = None
    return clear


def make_step(fn, x: torch.Tensor, g: torch.Tensor, clear, mark_step: bool = False):
    """One training step: grads to None, y = fn(x), y.backward(g)."""
    def step():
        clear()
        if mark_step:
            torch.compiler.cudagraph_mark_step_begin()
        fn(x).backward(g)
    return step


def capture(step, warm: int, clear=lambda: None):
    """step() captured once in a CUDA graph after `warm` runs on a side stream, clear() before each run
    and before the capture (training: grads set to None, so that the graph owns them); returns the graph
    and what step() returned during the capture (its static output)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warm):
            clear()
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


def short_error(e: BaseException) -> str:
    """Type, first line, and Dynamo's "Developer debug context" line (the underlying error) if any."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    msg = f"{type(e).__name__}: {lines[0][:300] if lines else ''}"
    ctx = [ln for ln in lines[1:] if ln.startswith("Developer debug context:") and len(ln) > 25]
    return msg + (f" ({ctx[0][len('Developer debug context:'):].strip()[:400]})" if ctx else "")


SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def run_without_host_sync(fn):
    """fn() under torch's CUDA sync debug mode "error" (after a synchronize): (its result, None), or
    (None, the RuntimeError a host sync raised); the mode is reset either way."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return fn(), None
    except RuntimeError as e:
        return None, e
    finally:
        torch.cuda.set_sync_debug_mode("default")


def profile_step(step) -> tuple[list[str], int]:
    """Run `step` once under torch.profiler: (the host syncs and device-to-host copies it made: CUDA runtime
    sync calls and synchronous cudaMemcpy inside the step's time range, and every DtoH copy on the GPU;
    the GPU work items it queued: kernels, memsets, copies)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("moonep_step"):
            step()
    events = prof.events()
    (span,) = [e.time_range for e in events if e.name == "moonep_step" and e.device_type == DeviceType.CPU]
    found, gpu_items = [], 0
    for e in events:
        gpu_items += e.device_type == DeviceType.CUDA
        inside = span.start <= e.time_range.start and e.time_range.end <= span.end
        if inside and (e.name in SYNC_CALLS or e.name == "cudaMemcpy"):
            found.append(e.name)
        elif "Memcpy DtoH" in e.name:
            found.append(e.name)
    return found, gpu_items


def host_syncs(step) -> list[str]:
    """The host syncs and device-to-host copies of one run of `step` (profile_step)."""
    return profile_step(step)[0]


def busy_union(items: list[tuple[float, float, str]]) -> tuple[float, float, list[tuple[float, str, str]]]:
    """(span, busy, gaps) of GPU items (start, end, name) sorted by start: span from the first start to the
    last end, busy the length of the union of their intervals, gaps every idle interval as (length, the
    item that ended last before it, the item after it), longest first."""
    busy, gaps, end, before = 0.0, [], float("-inf"), None
    for start, stop, name in items:
        if before is not None and start > end:
            gaps.append((start - end, before, name))
        if stop > end:  # the union grows by the part of this item past the latest end so far
            busy += stop - max(start, end)
            end, before = stop, name
    span = end - items[0][0] if items else 0.0
    return span, busy, sorted(gaps, key=lambda g: -g[0])


def gpu_idle(step, steps: int = 3, gaps: int = 4) -> dict:
    """Where the GPU waits in `steps` back-to-back runs of `step` (after a synchronize), per step, ms: the
    host time to enqueue them (no profiler; near the GPU time, the launches pace the GPU), then under
    torch.profiler the GPU items' span, busy time and idle time (busy_union), with the `gaps` longest idle
    gaps in us and the items on either side of each (a sync or a slow host path shows as a gap before the
    item it delays)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    enqueue_ms = (time.perf_counter() - t) * 1e3 / steps
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    span, busy, found = busy_union(sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                                          if e.device_type == DeviceType.CUDA))
    per_step = lambda us: round(us / 1e3 / steps, 3)  # noqa: E731
    return dict(enqueue_ms=round(enqueue_ms, 3), span_ms=per_step(span), busy_ms=per_step(busy),
                idle_ms=per_step(span - busy),
                longest_gaps=[(round(us, 1), a[:80], b[:80]) for us, a, b in found[:gaps]])


def combine_pull_bytes(rows_in: int, S: int, entries: int, row_bytes: int) -> int:
    """Bytes of combine's pull kernel (csrc_cute/combine.py): its ``rows_in`` rows read (R = 1, combine_local's
    one pass: every routed row; R > 1: the carriers' presums), out[s] written for the S tokens, and each of the
    plan's ``entries`` (s, k) read from three int32 tables."""
    return rows_in * row_bytes + S * row_bytes + entries * 12


def kernel_breakdown(step, show: bool, top: int | None = 25, calls: bool = False) -> list[tuple]:
    """GPU time per kernel name over one step (torch.profiler), ms, largest first (the first `top`, or
    all with None); printed (the first 25) if `show`. (name, ms), or with `calls` (name, ms, launches): a
    kernel the step launches several times (one compile key) has one name and their summed time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    launches: dict[str, int] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            totals[e.name] = totals.get(e.name, 0.0) + e.device_time_total / 1e3
            launches[e.name] = launches.get(e.name, 0) + 1
    rows = sorted(totals.items(), key=lambda kv: -kv[1])
    if show:
        print(f"  GPU time {sum(totals.values()):.2f} ms over {len(totals)} kernel names; top 25:", flush=True)
        for name, ms in rows[:25]:
            print(f"    {ms:8.3f} ms  {launches[name]:3d}x  {name[:105]}", flush=True)
    return [(n[:200], round(ms, 4)) + ((launches[n],) if calls else ()) for n, ms in rows[:top]]
