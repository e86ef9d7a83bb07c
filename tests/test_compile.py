"""The compiler contract on the CPU: fullgraph compile of forward+backward, no recompiles as routing
changes, export, and the moonep ops each compiled graph calls (a golden, so changes show in review)."""

import pytest
import torch
from expecttest import assert_expected_inline

import ep_workers
from moonep_ops.launch import run_ranks

SHAPE = dict(S=16, H=16, K=2, F=8, P=16)


@pytest.fixture(scope="module")
def compiled_r2():
    return run_ranks(ep_workers.compile_and_export, 2, dict(SHAPE, E=8), 5)


def test_fullgraph_no_breaks_no_recompiles(compiled_r2):
    for res in compiled_r2:
        assert res["graph_breaks"] == 0 and res["graphs"] == 1
        assert res["frames"] == 1 and res["recompiles"] == 0
        counts = res["counts"]  # every step routed differently
        assert all(not torch.equal(a, b) for i, a in enumerate(counts) for b in counts[i + 1:])
        assert res["max_rel_diff"] < 1e-5  # compiled forward and every gradient equal eager (fp32)


def test_export_runs_and_matches_eager(compiled_r2):
    for res in compiled_r2:
        assert res["export_diff"] < 1e-5


def test_compiled_graph_ops(compiled_r2):
    ops = compiled_r2[0]["graph_ops"]
    text = "\n".join(f"{graph}:\n" + "\n".join(f"  {op}" for op in calls) for graph, calls in ops.items())
    assert_expected_inline(text, """\
forward:
  auto_functionalized(moonep.plan.default)
  auto_functionalized(moonep.dispatch.default)
  auto_functionalized(moonep.prefetch_weights.default)
  moonep.group_gemm.default
  moonep.group_gemm.default
  moonep.group_gemm.default
  auto_functionalized(moonep.combine.default)
backward:
  auto_functionalized(moonep.dispatch.default)
  auto_functionalized(moonep.prefetch_weights.default)
  moonep.group_gemm_dgrad.default
  auto_functionalized(moonep.group_gemm_wgrad.default)
  moonep.group_gemm_dgrad.default
  moonep.group_gemm_dgrad.default
  auto_functionalized(moonep.group_gemm_wgrad.default)
  auto_functionalized(moonep.group_gemm_wgrad.default)
  auto_functionalized(moonep.reduce_grad.default)
  auto_functionalized(moonep.combine.default)
  auto_functionalized(moonep.gather_row_weights.default)""")
