"""The demo (`make demo`: python -m moonep_ops.demo) runs on a CPU machine and keeps every rank at
exactly S*K rows. It runs as its own process, as `make demo` does: its ranks then print into this test's
pipe (rank processes fork from a server started by their parent, and inherit the server's output)."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_demo_runs_balanced():
    proc = subprocess.run([sys.executable, "-m", "moonep_ops.demo", "--steps", "4", "--device", "cpu"], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    steps = re.findall(r"step +\d+/4 .* rows computed \[(\d+), (\d+)\]", proc.stdout)
    assert len(steps) == 4 and all(a == b == "512" for a, b in steps), proc.stdout
    assert "every rank computed S*K rows at every step: True" in proc.stdout
