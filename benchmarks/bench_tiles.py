"""Tile sweep: our grouped-GEMM kernels at each candidate tile configuration against QuACK (1 GPU, one run).

    python benchmarks/bench_tiles.py [--families fwd,dgrad,...,swiglu_bwd,swiglu_bwd_gather] [--out DIR]
                                     [--sustained-s 3] [--candidates "NAME;FAMILY:NAME"]

The choice of ``csrc_cute/group_gemm/config.py`` (which tile and which consumer schedule each family
runs) is measured here: per family and group layout (bench_peers' three: 48 equal, 16 x 4096, 48
skewed groups, H=7168, F=2048, 65536 rows, P=128) every candidate ``GroupGemmConfig`` is compiled and
launched directly (the kernel the op would launch with that config), checked against the fp32
reference, timed round-robin with the row's other candidates (``time_round_robin``), and next to
QuACK's varlen GEMM of the same family (``bench_peers.gemm_call``; QuACK is imported after our kernels
have compiled: importing it makes CuTe DSL compiles single-threaded). All candidates are compiled side by
side first (``sweep_compile_calls`` then ``csrc_cute.jit.compile_ahead``: child processes write the disk
cache, from which the sweep loads them).
Candidates (``CANDIDATES``): the row kernels (forward, dgrad, dgrad2) with cooperative 128 x 256 tiles in the
M-major raster or in bands of 64 M tiles of each group (``GroupGemmConfig.band_m``), the banded one also in clusters
of two CTAs sharing the A tiles (``GroupGemmConfig.cluster_n``) or the B tiles (``GroupGemmConfig.cluster_m``) by
TMA multicast, and pingpong 128 x 192 (QuACK's default tile) M-major or in bands of 64 or 16 M tiles, the M-major
and band-16 ones also sharing B in clusters (the dgrad's also in bands of 8 and 32); the same for the row-scaled
forward (the layer's down projection, ours only); the wgrad cooperative at 128 x 256 or pingpong at 128 x 192, each
without clusters, sharing A (``cluster_n``) or sharing B (``cluster_m``), and its two gathered variants at those two
tiles without clusters or sharing B; the fused SwiGLU cooperative at 128 x 128 (columns of h; M-major, in bands of
16, in bands of 16 for short groups alone; M-major and in bands of 16 sharing B) or pingpong at 128 x 96 (M-major or in
bands of 16), its gathered variant at 128 x 128 in bands of 16, alone and sharing B, and the SwiGLU
backward (always pingpong, shared-memory epilogue) and its gathered variant at 128 x 160 in those three rasters, the
M-major and band-16 ones also sharing B, and both at 128 x 192 in bands of 16, alone and sharing B (the H100's tile
since session 36: 64 x 32 epilogue sub-tiles computed in 16-column halves).
``--sustained-s S``: each candidate (and QuACK) also launched back to back for about S seconds with
nvidia-smi's clock and power sampled, its time per call and energy per call at the power cap recorded
beside the burst timing (``measure_sustained``). Writes ``bench_tiles.json`` (and a PNG with matplotlib).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_peers import (gathered_operand, gemm_call, gemm_flops, gemm_operands, gemm_reference,  # noqa: E402
                                    group_layouts, rel_err)
from benchmarks.common import (  # noqa: E402
    cuda_time_ms, rotated, run_info, run_sustained, short_error, sustained_text, time_round_robin, write_json)
from csrc_cute import jit  # noqa: E402
from csrc_cute.group_gemm import host  # noqa: E402
from csrc_cute.group_gemm.config import GroupGemmConfig  # noqa: E402

# (tile_m, tile_n, pingpong, band_m, tall_m_major[, cluster_n[, dynamic[, cluster_m[, scheduler_warp]]]]) per family;
# ``scheduler_warp`` False: the tile's coordinates computed by the warps that use them (GroupGemmConfig.scheduler_warp,
# session 44), next to the same tile with the scheduler warp (the default); ``dynamic``: the
# tiles taken in order from a global counter (GroupGemmConfig.dynamic, csrc_cute/group_gemm/walk.py; session 29),
# next to the same tile with the static walk; ``cluster_m`` = 2: pairs of M tiles of one group sharing each weight
# tile by TMA multicast (session 33). Dropped after earlier sweeps (kept
# in results/bench_tiles_*.json): the row kernels' bands of 8 (no faster at any layout), their cooperative
# bands of 16 and the short-groups-only raster (config.py's comment), their M-major and pingpong tiles in
# clusters (slower at the power cap than the banded tile: results/bench_tiles_ec8e04b.json), the SwiGLU
# backward's 128 x 128 tile; the wgrad's pingpong 128 x 128 (to keep the sweep short). ``row_scale`` (the
# layer's down projection, y = (h @ W_down) * row_w, K = F, N = H) and ``wgrad_gather_t`` (the layer's down
# projection's: dW = dy^T x_tok[row_src], Kd = F, Nd = H, computed as the gathered-A wgrad of its transpose,
# dW^T = x_tok[row_src]^T dy, stored transposed; until session 22 a wgrad with B's rows gathered, family
# ``wgrad_gather_b`` in the older sweeps) are ours only (QuACK has no GEMM with a row scale; the transposed
# store is ours). ``wgrad_gather`` (the layer's gate/up wgrad at R = 1: the tokens' rows read by row_src,
# bench_peers.token_rows; until session 24 a random permutation of x's M rows) against QuACK's gather_A.
QUACK_FAMILIES = ("fwd", "dgrad", "dgrad2", "wgrad", "swiglu", "swiglu_bwd", "swiglu_gather", "wgrad_gather",
                  "swiglu_bwd_gather")
# the wgrads and the SwiGLU backward also in clusters of two CTAs sharing each B tile (``cluster_m`` = 2, session 34)
WGRAD_CANDIDATES = ((128, 256, False, 0, False), (128, 192, True, 0, False), (128, 256, False, 0, False, 1, False, 2),
                    (128, 192, True, 0, False, 1, False, 2))
SWIGLU_BWD_CANDIDATES = ((128, 160, True, 0, False), (128, 160, True, 16, False), (128, 160, True, 16, True),
                         (128, 160, True, 16, False, 1, True), (128, 160, True, 0, False, 1, False, 2),
                         (128, 160, True, 16, False, 1, False, 2))
# QuACK gemm_dgated's 128 x 192 (11 n tiles at F = 2048, where 160 columns take 13), unclustered and sharing B
WIDE_SWIGLU_BWD_CANDIDATES = ((128, 192, True, 16, False), (128, 192, True, 16, False, 1, False, 2),
                              (128, 192, True, 16, False, 1, False, 2, False))
ROW_CANDIDATES = ((128, 256, False, 0, False), (128, 256, False, 64, False), (128, 256, False, 64, False, 2),
                  (128, 256, False, 64, False, 1, False, 2),
                  (128, 192, True, 0, False), (128, 192, True, 64, False), (128, 192, True, 16, False),
                  (128, 192, True, 16, False, 1, True), (128, 192, True, 0, False, 1, False, 2),
                  (128, 192, True, 16, False, 1, False, 2))
# the clustered dgrad's band height beside 16 M tiles: bands of 8 and of 32 (session 43, 1 H100)
DGRAD_CLUSTER_BAND_CANDIDATES = ((128, 192, True, 8, False, 1, False, 2), (128, 192, True, 32, False, 1, False, 2))
# the H100's choices without the scheduler warp (session 44): the clustered pingpong tile (dgrad; the SwiGLU backward's
# below) and the cooperative banded one (row-scaled forward; its consumers read the scheduler's ring too)
UNSCHEDULED_ROW_CANDIDATES = ((128, 192, True, 16, False, 1, False, 2, False),
                              (128, 256, False, 64, False, 1, False, 1, False))
# the same without the scheduler warp for the H100's clustered pingpong wgrad (session 45: its consumers read the ring)
# and the H200's unclustered pingpong dgrad, SwiGLU backward and wgrad tiles (not yet run on an H200)
UNSCHEDULED_PINGPONG_CANDIDATES = dict(
    dgrad=((128, 192, True, 16, False, 1, False, 1, False),),
    swiglu_bwd=((128, 160, True, 16, False, 1, False, 1, False),),
    wgrad=((128, 192, True, 0, False, 1, False, 2, False), (128, 192, True, 0, False, 1, False, 1, False)))
# the fused SwiGLU's cooperative 128 x 128 tile sharing its gate and up tiles in clusters (session 49), M-major and in
# bands of 16; its gathered variant (the layer's forward at R = 1) at the ops' tile and those two
SWIGLU_CLUSTER_CANDIDATES = ((128, 128, False, 0, False, 1, False, 2), (128, 128, False, 16, False, 1, False, 2))
CANDIDATES = dict(fwd=ROW_CANDIDATES, dgrad=(ROW_CANDIDATES + DGRAD_CLUSTER_BAND_CANDIDATES + UNSCHEDULED_ROW_CANDIDATES
                         + UNSCHEDULED_PINGPONG_CANDIDATES["dgrad"]),
                  dgrad2=ROW_CANDIDATES, row_scale=ROW_CANDIDATES + UNSCHEDULED_ROW_CANDIDATES,
                  wgrad=(WGRAD_CANDIDATES + ((128, 256, False, 0, False, 2), (128, 192, True, 0, False, 2))
                         + UNSCHEDULED_PINGPONG_CANDIDATES["wgrad"]),
                  wgrad_gather=WGRAD_CANDIDATES + ((128, 192, True, 0, False, 1, True),),
                  wgrad_gather_t=WGRAD_CANDIDATES,
                  swiglu=((128, 128, False, 0, False), (128, 128, False, 16, False), (128, 128, False, 16, True),
                          (128, 96, True, 0, False), (128, 96, True, 16, False), (128, 128, False, 16, False, 1, True))
                  + SWIGLU_CLUSTER_CANDIDATES,
                  swiglu_gather=((128, 128, False, 16, False),) + SWIGLU_CLUSTER_CANDIDATES,
                  swiglu_bwd=(SWIGLU_BWD_CANDIDATES + WIDE_SWIGLU_BWD_CANDIDATES
                              + UNSCHEDULED_PINGPONG_CANDIDATES["swiglu_bwd"]),
                  swiglu_bwd_gather=SWIGLU_BWD_CANDIDATES + WIDE_SWIGLU_BWD_CANDIDATES)


def named_candidates(opts) -> set[tuple[str | None, str]]:
    """The (family or None, candidate name) pairs of ``--candidates`` (empty: every candidate): "NAME" names a
    candidate of every family that has one of that name, "FAMILY:NAME" one of FAMILY's alone."""
    pairs = set()
    for item in (n.strip() for n in opts.candidates.split(";")):
        fam, sep, name = item.partition(":")
        if item:
            pairs.add((fam.strip(), name.strip()) if sep else (None, item))
    return pairs


def check_candidates(families: list[str], opts) -> None:
    """`families` are swept families, each name of ``--candidates`` is a candidate of at least one of them (of the
    one it is prefixed with), and each family has at least one; else SystemExit naming them."""
    unknown = [f for f in families if f not in CANDIDATES]
    if unknown:
        raise SystemExit(f"bench_tiles: --families {unknown} are not swept families: {sorted(CANDIDATES)}")
    for fam, name in named_candidates(opts):
        if fam is not None and fam not in families:
            raise SystemExit(f"bench_tiles: --candidates {fam}:{name!r}: {fam!r} is not one of --families {families}")
        scope = families if fam is None else [fam]
        if not any(config_name(*c) == name for f in scope for c in CANDIDATES[f]):
            raise SystemExit(f"bench_tiles: --candidates {name!r} is not a candidate of {scope}")
    for fam in families:
        if not swept(fam, opts):
            raise SystemExit(f"bench_tiles: --candidates names none of {fam}'s candidates: "
                             f"{sorted(config_name(*c) for c in CANDIDATES[fam])}")


def swept(fam: str, opts) -> list[tuple]:
    """The candidates of `fam` this run sweeps: all, or those ``--candidates`` names for it."""
    pairs = named_candidates(opts)
    names = {name for f, name in pairs if f in (None, fam)}
    return [c for c in CANDIDATES[fam] if not pairs or config_name(*c) in names]


def candidate_config(candidate: tuple, num_sms: int) -> GroupGemmConfig:
    """The ``GroupGemmConfig`` of a ``CANDIDATES`` entry on a device of `num_sms` SMs."""
    return GroupGemmConfig(candidate[0], candidate[1], num_sms, *candidate[2:])


def sweep_compile_calls(families: list[str], d: dict, P: int, num_sms: int, opts) -> list[jit.CompileCall]:
    """The compile calls of the sweep's candidate kernels (every candidate of `families`, ``swept``) that are
    neither in memory nor in the disk cache: ``ours_call`` of each in a dry run, which launches nothing."""
    with jit.dry_run() as calls:
        for fam in families:
            for c in swept(fam, opts):
                ours_call(fam, d, P, candidate_config(c, num_sms))
    return calls


def config_name(tile_m: int, tile_n: int, pingpong: bool, band_m: int = 0, tall_m_major: bool = False,
                cluster_n: int = 1, dynamic: bool = False, cluster_m: int = 1, scheduler_warp: bool = True) -> str:
    return (f"{tile_m}x{tile_n}{' pingpong' if pingpong else ''}{f' band {band_m}' if band_m else ''}"
            f"{' short groups' if tall_m_major else ''}{f' cluster 1x{cluster_n}' if cluster_n > 1 else ''}"
            f"{f' cluster {cluster_m}x1' if cluster_m > 1 else ''}{' dynamic' if dynamic else ''}"
            f"{'' if scheduler_warp else ' unscheduled'}")


def shared_empty(d: dict, fam: str, index: int, *shape: int, dtype=torch.bfloat16) -> torch.Tensor:
    """Output `index` of family `fam`'s kernels, made once per layout (kept in the operands `d`): every
    candidate of a sweep row writes the same tensors, so they differ in their kernel only, not in where
    their outputs lie."""
    return d.setdefault(("out", fam, index, shape, dtype), torch.empty(*shape, dtype=dtype, device=d["x"].device))


def ours_call(fam: str, d: dict, P: int, cfg: GroupGemmConfig):
    """A zero-argument launch of our kernel of `fam` compiled with `cfg` (``compile_op`` with that config)
    and a function of its result that gives its outputs in gemm_reference's order (as bench_peers.gemm_call's)."""
    x, dy, dy_up, g_y, w, w_up, w_down, ends = (d[k] for k in ("x", "dy", "dy_up", "g_y", "w", "w_up", "w_down",
                                                                 "ends"))
    M, H, F = x.shape[0], w.shape[1], w.shape[2]
    if fam == "fwd":
        fn = host.compile_op("fwd", H, F, P, cfg.num_sms, cfg)
        out = shared_empty(d, fam, 0, M, F)
        return (lambda: fn(x, w, w, ends, out)), (lambda _: (out,))
    if fam == "dgrad":
        fn = host.compile_op("dgrad", H, F, P, cfg.num_sms, cfg)
        out = shared_empty(d, fam, 0, M, H)
        return (lambda: fn(dy, w, w, ends, out)), (lambda _: (out,))
    if fam == "dgrad2":
        fn = host.compile_op("dgrad2", H, F, P, cfg.num_sms, cfg)
        out = shared_empty(d, fam, 0, M, H)
        return (lambda: fn(dy, w, w, dy_up, w_up, w_up, ends, out)), (lambda _: (out,))
    if fam == "row_scale":
        fn = host.compile_op("row_scale", F, H, P, cfg.num_sms, cfg)
        out = shared_empty(d, fam, 0, M, H)
        return (lambda: fn(dy, w_down, w_down, ends, d["row_w"], out)), (lambda _: (out,))
    if fam in ("wgrad", "wgrad_gather"):
        fn = host.compile_op(fam, H, F, P, cfg.num_sms, cfg)
        dw = shared_empty(d, fam, 0, *w.shape)
        no_slot = host._no_slots_f32(dw)  # B = 0: an empty fp32 view (a zero-sized tensor map cannot be encoded)
        a = (d["x_tok"], d["row_src"]) if fam == "wgrad_gather" else (x,)  # the gathered wgrad's A: tokens by row_src
        return (lambda: fn(*a, dy, ends, dw, no_slot)), (lambda _: (dw,))
    if fam == "wgrad_gather_t":  # dW [G, F, H] = dy^T x[row_src], as dW^T = x[row_src]^T dy (A gathered, M = H)
        fn = host.compile_op(fam, H, F, P, cfg.num_sms, cfg)
        dw = shared_empty(d, fam, 0, w.shape[0], F, H)
        dw_t, no_slot_t = dw.transpose(1, 2), host._no_slots_f32(dw).transpose(1, 2)
        return (lambda: fn(d["x_tok"], d["row_src"], dy, ends, dw_t, no_slot_t)), (lambda _: (dw,))
    if fam in ("swiglu", "swiglu_gather"):  # the gathered one's A: the tokens' rows by row_src
        fn = host.compile_op(fam, H, F, P, cfg.num_sms, cfg)
        h, gate, up = (shared_empty(d, fam, i, M, F) for i in range(3))
        a = (x,) if fam == "swiglu" else (d["x_tok"], d["row_src"])
        return (lambda: fn(*a, w, w, w_up, w_up, ends, h, gate, up)), (lambda _: (h,))
    if fam in ("swiglu_bwd", "swiglu_bwd_gather"):  # the gathered one's A: g_tok's rows by row_src
        fn = host.compile_op("swiglu_bwd_smem" if fam == "swiglu_bwd" else fam, H, F, P, cfg.num_sms, cfg)
        outs = [shared_empty(d, fam, i, M, F) for i in range(3)]
        part = shared_empty(d, fam, 3, M, -(-F // cfg.tile_n), dtype=torch.float32)
        a = (g_y,) if fam == "swiglu_bwd" else (d["g_tok"], d["row_src"])
        return ((lambda: fn(*a, w_down, w_down, ends, d["row_w"], d["gate"], d["up"], *outs, part)),
                (lambda _: (*outs, part.sum(1))))
    raise ValueError(f"bench_tiles: unknown family {fam!r}")


def family_reference(fam: str, d: dict) -> tuple[torch.Tensor, ...]:
    """bench_peers' fp32 reference of `fam`, or of the families only bench_tiles has (row_scale, the transposed
    gathered wgrad)."""
    if fam == "row_scale":
        return row_scale_reference(d)
    if fam == "wgrad_gather_t":  # per group dy_g^T x_tok[row_src]_g
        return gemm_reference("wgrad", dict(d, x=d["dy"], dy=gathered_operand("wgrad_gather", d)["x"]))
    return gemm_reference(fam, d)


def row_scale_reference(d: dict) -> tuple[torch.Tensor]:
    """fp32 (dy_g @ W_down_g) * row_w per group (the row_scale family's operands: A = dy [M, F])."""
    out = torch.cat([d["dy"][s:e].float() @ d["w_down"][g].float() for g, (s, e) in enumerate(d["bounds"])])
    return (out * d["row_w"][:, None],)


def check(rows: dict, key: str, name: str, call, outputs, ref, opts) -> bool:
    """Run `call` once (compiling it), compare its outputs (`outputs` of its result) with `ref` and record
    the error under rows[key][name]; False (the error recorded) if it fails."""
    try:
        err = max(rel_err(a, r) for a, r in zip(outputs(call()), ref))
        rows[key][name] = dict(err=err, ok=err <= opts.tol)
        return True
    except Exception as e:  # noqa: BLE001  (recorded, the sweep goes on)
        rows[key][name] = dict(error=short_error(e))
        print(f"{key} {name}: failed: {short_error(e)}", flush=True)
        traceback.print_exc()
        return False


def measure(rows: dict, key: str, calls: dict, opts) -> None:
    """Time the checked `calls` (name -> call) of sweep row `key` round-robin; record ms and TFLOP/s."""
    for call in calls.values():
        for _ in range(opts.warmup):
            call()
    row = rows[key]
    timed = time_round_robin(calls, lambda c: cuda_time_ms(c, iters=opts.iters, repeats=1, warmup=0), opts.repeats)
    for name, ms in timed.items():
        row[name].update(ms=ms, tflops=row["flops"] / ms / 1e9)
        print(f"{key:24s} {name:30s} {ms:7.3f} ms {row[name]['tflops']:6.1f} TF/s err {row[name]['err']:.1e}",
              flush=True)


def measure_sustained(rows: dict, key: str, calls: dict, opts, turn: int) -> None:
    """``--sustained-s`` S > 0: each timed call of sweep row `key` launched back to back for about S seconds, the
    row's candidates in turn, the order rotated by `turn`, each after ``--idle-s`` idle (``run_sustained``: its
    time per call, and the clock, power and energy per call where the board has settled)."""
    row = rows[key]
    names = rotated([n for n in calls if "ms" in row[n]], turn)
    runs = run_sustained({n: calls[n] for n in names}, {n: row[n]["ms"] for n in names}, opts.sustained_s,
                         opts.idle_s)
    for name, cell in runs.items():
        row[name].update(cell)
        print(f"{key:24s} {name:30s} {sustained_text(cell)}", flush=True)


def run(opts) -> dict:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    H, F, P = opts.H, opts.F, opts.P
    families = [f for f in opts.families.split(",") if f]
    check_candidates(families, opts)
    layouts = group_layouts(opts.rows, opts.E, P, opts.S, opts.K, opts.seed)
    rows: dict = {}
    phases = ["ours"] + (["quack"] if not opts.no_quack else [])
    for phase in phases:
        qgi = importlib.import_module("quack.gemm_interface") if phase == "quack" else None
        for li, (lname, ends) in enumerate(layouts.items()):
            d = gemm_operands(ends, H, F, device, opts.seed + 10 + li, opts.S)
            M = int(ends[-1])
            if phase == "ours" and li == 0:
                # all candidates compiled side by side (child processes, into the disk cache) before the first
                # is checked, where they compiled one after another on one of the GPU machine's 16 cores
                jit.compile_ahead(sweep_compile_calls(families, d, P, num_sms, opts))
            for fam in families:
                key = f"{fam} | {lname}"
                rows.setdefault(key, dict(family=fam, layout=lname, rows=M, flops=gemm_flops(fam, M, H, F)))
                if phase == "quack" and fam not in QUACK_FAMILIES:
                    continue
                ref = family_reference(fam, d)
                if phase == "ours":
                    candidates = {config_name(*c): ours_call(fam, d, P, candidate_config(c, num_sms))
                                  for c in swept(fam, opts)}
                else:
                    candidates = {"quack": gemm_call("quack", fam, d, P, qgi)}
                checked = {name: call for name, (call, outputs) in candidates.items()
                           if check(rows, key, name, call, outputs, ref, opts)}
                measure(rows, key, checked, opts)
                if opts.sustained_s > 0:
                    measure_sustained(rows, key, checked, opts, len(rows))
                del ref, candidates, checked
            del d
            torch.cuda.empty_cache()
    for row in rows.values():
        q = row.get("quack", {}).get("ms")
        for name, cell in row.items():
            if isinstance(cell, dict) and "ms" in cell and q:
                cell["over_quack"] = q / cell["ms"]  # > 1: faster than QuACK
    return dict(run_info(), H=H, F=F, P=P, E=opts.E, rows_total=opts.rows,
                iters=opts.iters, repeats=opts.repeats, warmup=opts.warmup, tol=opts.tol,
                sustained_s=opts.sustained_s, idle_s=opts.idle_s,
                candidates={f: [config_name(*c) for c in swept(f, opts)] for f in families}, rows=rows)


def plot(payload: dict, path: str) -> None:
    """TFLOP/s per candidate and sweep row: the burst timing, and under it (``--sustained-s``) the time per
    call at the power cap."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(payload["rows"])
    names = sorted({n for r in payload["rows"].values() for n, c in r.items() if isinstance(c, dict) and "tflops" in c})
    panels = [("ms", "burst")]
    if payload.get("sustained_s"):
        panels.append(("sustained_ms", "sustained at the power cap"))
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(8, len(keys) * 1.1), 4.5 * len(panels)), squeeze=False)
    width = 0.8 / max(1, len(names))
    for ax, (field, title) in zip(axes[:, 0], panels):
        for i, n in enumerate(names):
            cells = [payload["rows"][k].get(n, {}) for k in keys]
            vals = [payload["rows"][k]["flops"] / c[field] / 1e9 if field in c else 0 for k, c in zip(keys, cells)]
            ax.bar([j + i * width for j in range(len(keys))], vals, width, label=n)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(keys))], keys, rotation=30, ha="right", fontsize=7)
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"tile sweep vs QuACK ({title}), {payload.get('gpu', '')}, {payload.get('commit', '')[:7]}",
                     fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="result dir (default benchmarks/results)")
    ap.add_argument("--families", default=",".join(CANDIDATES))
    for k, v in dict(S=8192, H=7168, F=2048, E=48, K=8, P=128, rows=65536, seed=0).items():
        ap.add_argument(f"--{k}", dest=k, type=int, default=v)
    ap.add_argument("--iters", type=int, default=10, help="calls per timed round")
    ap.add_argument("--repeats", type=int, default=5, help="rounds (median), each timing every candidate once")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--tol", type=float, default=3e-2)
    ap.add_argument("--no-quack", action="store_true", help="ours only (QuACK not installed)")
    ap.add_argument("--sustained-s", dest="sustained_s", type=float, default=0.0,
                    help="also launch each candidate back to back for this many seconds with the clock and power "
                         "sampled (measure_sustained); 0: off")
    ap.add_argument("--candidates", default="", help="semicolon-separated candidate names (config_name) to sweep "
                    "instead of all of each family's: each family sweeps the names that are its candidates; "
                    "FAMILY:NAME names one family's alone")
    ap.add_argument("--idle-s", dest="idle_s", type=float, default=1.0, help="idle seconds before each sustained run")
    opts = ap.parse_args(argv)
    payload = run(opts)
    path = write_json("bench_tiles.json", payload, opts.out)
    print(f"wrote {path}")
    try:
        plot(payload, path[:-len(".json")] + ".png")
    except ImportError:
        print("matplotlib missing: no PNG")


if __name__ == "__main__":
    main()
