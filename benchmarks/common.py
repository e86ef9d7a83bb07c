"""Shared benchmark plumbing: CUDA timing and result files that name the GPU, command, commit, date."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys

import torch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def cuda_time_ms(fn, iters: int = 20, repeats: int = 5, warmup: int = 3) -> float:
    """Median over `repeats` of the mean time of `iters` back-to-back calls, in ms (CUDA events)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop) / iters)
    return sorted(times)[len(times) // 2]


def run_info() -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    commit = os.environ.get("MOONEP_COMMIT", "")  # device runs get a tree copy without git history
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                                    text=True).stdout.strip()
        except OSError:
            pass
    return dict(gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
                gpus=torch.cuda.device_count(), torch=torch.__version__,
                command=" ".join([os.path.basename(sys.executable)] + sys.argv),
                commit=commit if len(commit) == 40 else "unknown",
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))


def apply_smoke_defaults(args, argv: list[str] | None, smoke: dict) -> None:
    """`--smoke`: the tiny CPU shapes in `smoke`, except for the options given on the command line."""
    given = {a.lstrip("-").split("=")[0].replace("-", "_") for a in (argv if argv is not None else sys.argv[1:])
             if a.startswith("--")}
    for k, v in smoke.items():
        if k not in given:
            setattr(args, k, v)


def write_json(name: str, payload: dict, out_dir: str | None = None) -> str:
    out_dir = out_dir or RESULTS
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
    return path
