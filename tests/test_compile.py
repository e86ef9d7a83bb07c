"""The compiler contract on the CPU: fullgraph compile of forward+backward, no recompiles as routing
changes, export, and the moonep ops each compiled graph calls (a golden, so changes show in review)."""

import re

import pytest
import torch
from expecttest import assert_expected_inline

import ep_workers
from moonep_ops.launch import run_ranks

SHAPE = dict(S=16, H=16, K=2, F=8, P=16)


@pytest.fixture(scope="module")
def compiled_r2():
    return run_ranks(ep_workers.compile_and_export, 2, dict(SHAPE, E=8), 5)


# the tests of one module fixture run on one pytest-xdist worker (`make test`: --dist loadgroup), so the
# fixture's compile runs once, not once per worker
on_compiled_r2 = pytest.mark.xdist_group("compiled_r2")


@on_compiled_r2
def test_fullgraph_no_breaks_no_recompiles(compiled_r2):
    for res in compiled_r2:
        assert res["graph_breaks"] == 0 and res["graphs"] == 1
        assert res["frames"] == 1 and res["recompiles"] == 0
        counts = res["counts"]  # every step routed differently
        assert all(not torch.equal(a, b) for i, a in enumerate(counts) for b in counts[i + 1:])
        assert res["max_rel_diff"] < 1e-5  # compiled forward and every gradient equal eager (fp32)


@on_compiled_r2
def test_export_runs_and_matches_eager(compiled_r2):
    for res in compiled_r2:
        assert res["export_diff"] < 1e-5


def graph_ops_text(graphs: dict[str, list[str]]) -> str:
    """The moonep ops of each compiled graph, one per line under the graph's name (the goldens' form)."""
    return "\n".join(f"{graph}:\n" + "\n".join(f"  {op}" for op in calls) for graph, calls in graphs.items())


@on_compiled_r2
def test_compiled_graph_ops(compiled_r2):
    assert compiled_r2[0]["n_inductor_graphs"] == 2  # one forward, one backward over the 5 steps
    assert_expected_inline(graph_ops_text(compiled_r2[0]["graph_ops"]), """\
forward:
  auto_functionalized(moonep.plan.default)
  auto_functionalized(moonep.dispatch.default)
  auto_functionalized(moonep.prefetch_weights.default)
  moonep.group_gemm_swiglu.default
  moonep.group_gemm_row_scale.default
  auto_functionalized(moonep.combine.default)
backward:
  moonep.experts_combine_backward.default
  moonep.dispatch_backward.default""")


def _buffer_copy_kernels(code: str) -> list[str]:
    """Calls of Inductor-generated kernels that clone or copy (on the CPU: cpp_fused_*clone*/copy_*)."""
    return re.findall(r"^\s+(cpp_fused\w*(?:clone|copy_)\w*)\(", code, re.M)


def test_inductor_code_copies_no_persistent_buffer(gloo1):
    """DESIGN.md's compiler contract: the generated code holds no clone/copy of the receive buffers,
    slot pools or reduce buffers, forward or backward. (It failed while backward called the forward's
    mutating ops on those buffers: AOTAutograd functionalised them and Inductor emitted clone and
    copy-back kernels over each one; docs/design-notes.md, "Autograd and persistent buffers".) At R = 1
    the layer takes the gathered path (EPGroup(gather_rows)): the moonep ops of its graphs are a golden."""
    from torch._inductor.utils import run_and_get_code

    from moonep_ops import EPConfig, EPGroup, MoELayer

    cfg = EPConfig(R=1, E=4, **SHAPE)
    layer = MoELayer(EPGroup(cfg, dtype=torch.float32))
    loss = torch.compile(lambda x: (layer(x) ** 2).sum(), fullgraph=True)
    x = torch.randn(cfg.S, cfg.H, requires_grad=True)
    graphs = []
    record = lambda g: graphs.append(ep_workers.moonep_calls(g))  # noqa: E731
    with torch._inductor.config.patch(post_grad_custom_post_pass=record):
        _, codes = run_and_get_code(lambda: loss(x).backward())
    assert len(codes) == 2  # forward, backward
    assert not _buffer_copy_kernels(codes[0])
    assert not _buffer_copy_kernels(codes[1]), _buffer_copy_kernels(codes[1])
    assert_expected_inline(graph_ops_text(dict(zip(("forward", "backward"), graphs))), """\
forward:
  auto_functionalized(moonep.plan.default)
  auto_functionalized(moonep.dispatch_index.default)
  moonep.group_gemm_swiglu_gather.default
  moonep.group_gemm_row_scale.default
  auto_functionalized(moonep.combine.default)
backward:
  moonep.experts_combine_gathered_backward.default
  moonep.dispatch_index_backward.default""")
