"""Which buffers an EPGroup allocates (moonep_ops/buffers.py): the layouts of CPU and CUDA groups at any R,
the CPU group against its layout, and, on the CPU, a group given the 1-rank CUDA layout (absent send_rows,
presum, slot pools and reduce buffers; the GEMMs over the home groups alone, no prefetch or reduce_grad)
whose layer is bitwise the full layout's, eager and compiled, training and inference."""

import pytest
import torch

from moonep_ops import EPConfig, EPGroup, MoELayer
from moonep_ops import checks, group as group_module
from moonep_ops.buffers import (BufferLayout, buffer_layout, group_buffer_shapes, shapes_bytes,
                                weight_buffer_shapes)

DESIGN = dict(S=8192, H=7168, K=8, F=2048)
ABSENT_AT_ONE_RANK = {"send_rows", "presum", "pool_gate", "pool_up", "pool_down", "reduce_gate", "reduce_up",
                      "reduce_down"}
FULL = BufferLayout(symmetric=False, staged=True, presum=True, copies=True)  # the CPU reference's
ONE_RANK_CUDA = BufferLayout(symmetric=False, staged=False, presum=False, copies=False)


def all_shapes(cfg, layout):
    return {**group_buffer_shapes(cfg, layout), **weight_buffer_shapes(cfg, layout)}


def test_layouts_by_device_and_ranks():
    one, two = EPConfig(R=1, E=48, **DESIGN), EPConfig(R=2, E=96, **DESIGN)
    assert buffer_layout(one, "cuda") == ONE_RANK_CUDA
    assert buffer_layout(two, "cuda") == BufferLayout(symmetric=True, staged=True, presum=True, copies=True)
    assert buffer_layout(one, "cpu") == buffer_layout(two, "cpu") == FULL  # the reference allocates everything


def test_full_layout_shapes():
    """R > 1 on CUDA (and the CPU at any R): every buffer at its full size."""
    c = EPConfig(R=2, E=96, **DESIGN)
    shapes = all_shapes(c, buffer_layout(c, "cuda"))
    bf, f32, i32 = None, torch.float32, torch.int32
    assert shapes == {
        "ctrl": (shapes["ctrl"][0], i32), "send_rows": ((c.S, c.H), bf), "recv_w": ((c.NvS,), f32),
        "recv_primary": ((c.NvS,), i32), "recv_next": ((c.NvS,), i32), "recv_src": ((c.NvS,), i32),
        "presum": ((c.NvS, c.H), bf), "row_scratch": ((c.NvS,), f32),
        "pool_gate": ((c.B, c.H, c.F), bf), "pool_up": ((c.B, c.H, c.F), bf), "pool_down": ((c.B, c.F, c.H), bf),
        "reduce_gate": ((c.B, c.H, c.F), f32), "reduce_up": ((c.B, c.H, c.F), f32),
        "reduce_down": ((c.B, c.F, c.H), f32)}
    assert "reduce_gate" not in weight_buffer_shapes(EPConfig(R=2, E=96, B=4, **DESIGN), FULL)  # inference


def test_one_rank_cuda_allocates_only_what_its_kernels_read():
    """At the DESIGN shape: 13.8 GB of buffers become 1.5 MB (the receive tables, row_scratch, ctrl)."""
    c = EPConfig(R=1, E=48, **DESIGN)
    lean, full = all_shapes(c, buffer_layout(c, "cuda")), all_shapes(c, buffer_layout(c, "cpu"))
    assert {name for name, (shape, _) in lean.items() if shape[0] == 0} == ABSENT_AT_ONE_RANK
    assert {name: s for name, s in lean.items() if name not in ABSENT_AT_ONE_RANK} == \
        {name: s for name, s in full.items() if name not in ABSENT_AT_ONE_RANK}
    for name in ABSENT_AT_ONE_RANK:  # absent: no rows, the trailing shape and dtype kept
        assert lean[name][0][1:] == full[name][0][1:] and lean[name][1] == full[name][1], name
    lean_bytes, full_bytes = shapes_bytes(lean, torch.bfloat16), shapes_bytes(full, torch.bfloat16)
    assert lean_bytes < 2 * 2**20, lean_bytes
    assert full_bytes > 13.8e9, full_bytes


def test_cpu_group_allocates_its_layout(gloo1):
    cfg = EPConfig(S=6, H=16, K=3, E=4, F=8, R=1, P=16)
    ep = EPGroup(cfg, dtype=torch.float32)
    assert ep.layout == FULL
    ep.alloc_weight_buffers()
    got = dict(zip(("ctrl", "send_rows", "recv_w", "recv_primary", "recv_next", "recv_src", "presum", "row_scratch"),
                   (ep.ctrl, *ep.dispatch_buffers, ep.presum, ep.row_scratch)))
    got.update(zip(("pool_gate", "pool_up", "pool_down"), ep.pools))
    got.update(zip(("reduce_gate", "reduce_up", "reduce_down"), ep.reduce_buffers))
    want = all_shapes(cfg, ep.layout)
    assert {name: (tuple(t.shape), t.dtype) for name, t in got.items()} == \
        {name: (shape, dt or torch.float32) for name, (shape, dt) in want.items()}
    assert ep.buffer_bytes == shapes_bytes(want, torch.float32)
    ep.destroy()


def test_absent_buffer_only_with_one_rank():
    absent, full = torch.empty(0, 16), torch.empty(6, 16)
    checks.check_absent_buffer("dispatch", "send_rows", absent, 1)
    checks.check_absent_buffer("dispatch", "send_rows", full, 2)
    with pytest.raises(ValueError, match=r"moonep.dispatch: send_rows has no rows \(absent\), which only R = 1"):
        checks.check_absent_buffer("dispatch", "send_rows", absent, 2)
    checks.check_peer_buffer("combine", "presum", absent, (torch.float32,), 6, (16,), None)
    with pytest.raises(ValueError, match=r"moonep.combine: presum must have shape \[6, 16\] \(or \[0, 16\], absent"):
        checks.check_peer_buffer("combine", "presum", torch.empty(3, 16), (torch.float32,), 6, (16,), None)


def _layer(cfg, layout, monkeypatch):
    """A CPU MoELayer (fp32, seed 0) on a group given `layout` (None: its own)."""
    with monkeypatch.context() as m:
        if layout is not None:
            m.setattr(group_module, "buffer_layout", lambda c, device_type: layout)
        torch.manual_seed(0)
        return MoELayer(EPGroup(cfg, dtype=torch.float32))


def _forward_backward(layer, x, g, fn=None):
    layer.zero_grad()
    x = x.clone().requires_grad_()
    y = (layer if fn is None else fn)(x)
    y.backward(g)
    return [y.detach(), x.grad] + [p.grad for p in layer.parameters()]


@pytest.mark.parametrize("skewed", [False, True])
def test_one_rank_layout_layer_is_bitwise_the_full_layouts(gloo1, monkeypatch, skewed):
    """The layer on the 1-rank CUDA layout (run here by the CPU reference ops) equals the full layout's
    bit for bit, forward and every gradient; the absent buffers stay absent."""
    cfg = EPConfig(S=32, H=16, K=2, E=4, F=8, R=1, P=16)
    full, lean = _layer(cfg, None, monkeypatch), _layer(cfg, ONE_RANK_CUDA, monkeypatch)
    ep = lean.ep
    if skewed:  # every token to expert 0 first: one group holds them all, the others few or none
        for layer in (full, lean):
            with torch.no_grad():
                layer.router.weight[0] += 10.0
    x, g = torch.randn(cfg.S, cfg.H), torch.randn(cfg.S, cfg.H)
    want, got = _forward_backward(full, x, g), _forward_backward(lean, x, g)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert ep.send_rows.shape[0] == ep.presum.shape[0] == 0
    assert all(t.shape[0] == 0 for t in (*ep.pools, *ep.reduce_buffers))
    assert ep.buffer_bytes == shapes_bytes(all_shapes(cfg, ONE_RANK_CUDA), torch.float32)
    full.ep.destroy()
    ep.destroy()


def test_one_rank_layout_inference_small_B(gloo1, monkeypatch):
    """B < epn (inference): the full layout reads the copies without a slot through remote groups (all
    empty at R = 1); the 1-rank layout drops the slot and remote groups. Bitwise the same output."""
    cfg = EPConfig(S=32, H=16, K=2, E=4, F=8, R=1, P=16, B=1)
    full, lean = _layer(cfg, None, monkeypatch), _layer(cfg, ONE_RANK_CUDA, monkeypatch)
    x = torch.randn(cfg.S, cfg.H)
    with torch.no_grad():
        assert torch.equal(lean(x), full(x))
    full.ep.destroy()
    lean.ep.destroy()


def test_one_rank_layout_compiles(gloo1, monkeypatch):
    """torch.compile(fullgraph=True) of the layer on the 1-rank layout: the fakes take the absent buffers
    and the home-groups view of cu_seqlens; forward and gradients equal eager's."""
    cfg = EPConfig(S=16, H=16, K=2, E=4, F=8, R=1, P=16)
    layer = _layer(cfg, ONE_RANK_CUDA, monkeypatch)
    x, g = torch.randn(cfg.S, cfg.H), torch.randn(cfg.S, cfg.H)
    eager = _forward_backward(layer, x, g)
    compiled = _forward_backward(layer, x, g, torch.compile(layer, fullgraph=True))
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    layer.ep.destroy()
