"""The demo runs on a CPU machine and keeps every rank at exactly S*K rows."""

import re

from moonep_ops import demo


def test_demo_runs_balanced(capfd):
    assert demo.main(["--steps", "4", "--device", "cpu"]) == 0
    out = capfd.readouterr().out  # rank 0 prints from its own process
    steps = re.findall(r"step +\d+/4 .* rows computed \[(\d+), (\d+)\]", out)
    assert len(steps) == 4 and all(a == b == "512" for a, b in steps)
    assert "every rank computed S*K rows at every step: True" in out
