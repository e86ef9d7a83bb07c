"""Tests of the CuTe DSL grouped GEMM forward kernel (csrc_cute/group_gemm.py).

CPU (CI): the kernel compiles for sm_90a without a GPU, ptxas reports no spills; input validation.
GPU (Hopper): results against the fp32 reference, CUDA-graph capture/replay; optional benchmark
(``MOONEP_BENCH=1``) against ``torch._grouped_mm``.
"""

import os

import pytest
import torch

import moonep_ops  # noqa: F401  (registers moonep::group_gemm, whose CPU implementation is the reference)
from csrc_cute import compile_check
from csrc_cute.group_gemm import compile_group_gemm_for_sm90, group_gemm_fwd, select_config

HAS_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
gpu = pytest.mark.skipif(not HAS_HOPPER, reason="needs a Hopper (sm_90) GPU")


# ------------------------------------------------------------------------------------------------
# CPU: compile for sm_90a, validation
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pad", [128, 64])
def test_compile_sm90a_no_spills(tmp_path, pad):
    res = compile_group_gemm_for_sm90(str(tmp_path), kd=7168, nd=2048, pad=pad)
    assert res.ptx, f"no PTX written:\n{res.child_output}"
    assert res.cubin and all(os.path.getsize(c) > 0 for c in res.cubin), res.child_output
    if compile_check.find_ptxas() is None:
        pytest.skip("ptxas not available")
    print(f"\n[group_gemm sm_90a P={pad}]\n" + res.summary())
    assert res.stats, "ptxas reported no kernel"
    for s in res.stats:
        assert s.spill_bytes == 0, res.summary()
        assert s.stack_frame_bytes == 0, res.summary()


def test_parse_ptxas_verbose():
    text = (
        "ptxas info    : Compiling entry function 'k1' for 'sm_90a'\n"
        "ptxas info    : Function properties for k1\n"
        "    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n"
        "ptxas info    : Used 168 registers, used 2 barriers, 1024 bytes smem, 400 bytes cmem[0]\n"
    )
    (s,) = compile_check.parse_ptxas_verbose(text)
    assert (s.name, s.registers, s.shared_bytes, s.cmem_bytes) == ("k1", 168, 1024, 400)
    assert (s.stack_frame_bytes, s.spill_store_bytes, s.spill_load_bytes, s.spill_bytes) == (8, 4, 12, 16)


def test_select_config_rejects_small_pad():
    assert tuple(select_config(128, 2048, 132)) == (128, 256, 132)
    assert tuple(select_config(256, 2048, 132)) == (128, 256, 132)
    assert select_config(64, 2048, 132).tile_m == 64
    for bad in (32, 16):
        with pytest.raises(ValueError, match=r"P \(pad\)"):
            select_config(bad, 2048)
    for bad in (0, 96, 8):
        with pytest.raises(ValueError, match=r"P \(pad\)"):
            select_config(bad, 2048)


def _inputs(n=256, kd=64, nd=64, epn=2, nb=1, dtype=torch.bfloat16, device="cpu"):
    x = torch.zeros(n, kd, dtype=dtype, device=device)
    wh = torch.zeros(epn, kd, nd, dtype=dtype, device=device)
    ws = torch.zeros(nb, kd, nd, dtype=dtype, device=device)
    cu = torch.zeros(epn + nb, dtype=torch.int32, device=device)
    return x, wh, ws, cu


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda a: (a[0].float(), *a[1:]), r"^x must be bfloat16"),
        (lambda a: (a[0], a[1].half(), *a[2:]), r"^w_home must be bfloat16"),
        (lambda a: (a[0], a[1], a[2].float(), a[3]), r"^w_slot must be bfloat16"),
        (lambda a: (a[0].t(), *a[1:]), r"^x must be contiguous"),
        (lambda a: (a[0], a[1].transpose(1, 2), *a[2:]), r"^w_home must be contiguous"),
        (lambda a: (a[0][None], *a[1:]), r"^x must be 2-D"),
        (lambda a: (a[0], a[1][0], *a[2:]), r"^w_home must be 3-D"),
        (lambda a: (a[0], a[1], a[2][0], a[3]), r"^w_slot must be 3-D"),
        (lambda a: (a[0][:, :56].contiguous(), *a[1:]), r"^w_home.shape\[1\]"),
        (lambda a: (a[0], a[1], a[2][:, :, :56].contiguous(), a[3]), r"^w_slot must be \[B"),
        (lambda a: (a[0], a[1], a[2], a[3].long()), r"^cu_seqlens must be int32"),
        (lambda a: (a[0], a[1], a[2], a[3][:2]), r"^cu_seqlens must be 1-D of length epn \+ B"),
        (lambda a: (a[0], a[1][:0], a[2], a[3][:1]), r"^w_home must hold at least one expert"),
        (lambda a: a, r"^x must be a CUDA tensor"),
    ],
)
def test_bad_inputs(mutate, match):
    with pytest.raises(ValueError, match=match):
        group_gemm_fwd(*mutate(_inputs()))


def test_bad_inner_dims():
    with pytest.raises(ValueError, match=r"^Kd"):
        group_gemm_fwd(*_inputs(kd=60))
    with pytest.raises(ValueError, match=r"^Nd"):
        group_gemm_fwd(*_inputs(nd=60))


# ------------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------------


def _make(lengths, epn, kd, nd, n_total=None, seed=0):
    """Random bf16 problem with the given group lengths (G = len(lengths), B = G - epn)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    nb = len(lengths) - epn
    cu = torch.tensor(lengths, dtype=torch.int64).cumsum(0).to(torch.int32)
    n = int(cu[-1]) if n_total is None else n_total
    x = (torch.randn(n, kd, generator=g) * 0.5).bfloat16()
    wh = (torch.randn(epn, kd, nd, generator=g) / kd**0.5).bfloat16()
    ws = (torch.randn(nb, kd, nd, generator=g) / kd**0.5).bfloat16()
    dev = "cuda"
    return x.to(dev), wh.to(dev), ws.to(dev), cu.to(dev)


def reference_group_gemm(x, wh, ws, cu, pad=128):
    """The CPU reference op (fp32 accumulation), moved back to x's device."""
    return torch.ops.moonep.group_gemm(x.cpu(), wh.cpu(), ws.cpu(), cu.cpu(), pad).to(x.device)


def _check(x, wh, ws, cu, pad=128):
    out = torch.full((x.shape[0], wh.shape[2]), float("nan"), dtype=torch.bfloat16, device=x.device)
    y = group_gemm_fwd(x, wh, ws, cu, pad=pad, out=out)
    torch.cuda.synchronize()
    ref = reference_group_gemm(x, wh, ws, cu, pad)
    end = int(cu[-1])
    assert torch.equal(y[end:], torch.zeros_like(y[end:])), "rows past the last group must be zero"
    torch.testing.assert_close(y.float(), ref.float(), atol=2e-2, rtol=2e-2)
    return y


@gpu
@pytest.mark.parametrize("pad", [128, 64, 256])
def test_random_groups_with_empty_and_slots(pad):
    gen = torch.Generator().manual_seed(pad)
    epn, nb = 5, 4
    lengths = (torch.randint(0, 6, (epn + nb,), generator=gen) * pad).tolist()
    lengths[1] = 0  # an empty home group
    lengths[epn + 1] = 0  # an empty slot group
    lengths[epn] = max(lengths[epn], pad)  # a slot group with rows
    tail = 3 * pad  # padding rows past the last group
    x, wh, ws, cu = _make(lengths, epn, kd=520, nd=384, n_total=sum(lengths) + tail, seed=pad)
    _check(x, wh, ws, cu, pad=pad)


@gpu
@pytest.mark.parametrize("pad", [128, 64])
def test_many_tiles_per_cta(pad):
    # More tiles than SMs: each persistent CTA walks several tiles, mixing real, empty and zero tiles.
    gen = torch.Generator().manual_seed(7 + pad)
    epn, nb = 8, 8
    lengths = (torch.randint(0, 13, (epn + nb,), generator=gen) * pad).tolist()
    lengths[3] = 0
    lengths[epn + 2] = 0
    x, wh, ws, cu = _make(lengths, epn, kd=256, nd=1024, n_total=sum(lengths) + 5 * pad, seed=pad)
    _check(x, wh, ws, cu, pad=pad)


@gpu
def test_all_rows_one_group():
    lengths = [0, 0, 1024, 0]
    x, wh, ws, cu = _make(lengths, epn=3, kd=256, nd=512)
    _check(x, wh, ws, cu)
    # ... and all rows in the single slot group
    lengths = [0, 0, 0, 1024]
    x, wh, ws, cu = _make(lengths, epn=3, kd=256, nd=512, seed=1)
    _check(x, wh, ws, cu)


@gpu
def test_groups_of_exactly_p_rows():
    lengths = [128] * 12
    x, wh, ws, cu = _make(lengths, epn=6, kd=1024, nd=256)
    _check(x, wh, ws, cu)


@gpu
def test_no_slots_b0_and_many_groups():
    lengths = [128 * ((i * 7) % 5) for i in range(40)]
    x, wh, ws, cu = _make(lengths, epn=40, kd=128, nd=136, n_total=sum(lengths) + 256)
    assert ws.shape[0] == 0
    _check(x, wh, ws, cu)


@gpu
def test_slot_weights_are_read_from_w_slot():
    # Home and slot weights differ by sign: a mix-up would flip the result.
    lengths = [256, 256]
    x, wh, ws, cu = _make(lengths, epn=1, kd=128, nd=128)
    ws.copy_(-wh)
    y = _check(x, wh, ws, cu)
    torch.testing.assert_close(
        y[256:].float(), -(x[256:].float() @ wh[0].float()).bfloat16().float(), atol=2e-2, rtol=2e-2
    )


@gpu
def test_all_padding_zero_rows():
    x, wh, ws, cu = _make([0, 0, 0], epn=2, kd=64, nd=64, n_total=512)
    y = _check(x, wh, ws, cu)
    assert torch.count_nonzero(y) == 0


@gpu
def test_cuda_graph_replay_matches_eager():
    epn, nb, kd, nd, n = 4, 2, 512, 512, 2048
    x, wh, ws, _ = _make([0] * (epn + nb), epn, kd, nd, n_total=n)
    cu = torch.zeros(epn + nb, dtype=torch.int32, device="cuda")

    def routing(seed):
        gen = torch.Generator().manual_seed(seed)
        lengths = torch.randint(0, 4, (epn + nb,), generator=gen) * 128
        return lengths.cumsum(0).clamp(max=n).to(torch.int32)

    cu.copy_(routing(0))
    group_gemm_fwd(x, wh, ws, cu)  # compile + warm up outside capture
    out = torch.empty(n, nd, dtype=torch.bfloat16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        group_gemm_fwd(x, wh, ws, cu, out=out)
        with torch.cuda.graph(graph, stream=stream):
            group_gemm_fwd(x, wh, ws, cu, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    for seed in range(1, 5):  # new routings land on the device only; the graph is replayed as is
        cu.copy_(routing(seed))
        out.fill_(float("nan"))
        graph.replay()
        eager = group_gemm_fwd(x, wh, ws, cu)
        torch.cuda.synchronize()
        assert torch.equal(out, eager), f"graph replay differs from eager (seed {seed})"
        torch.testing.assert_close(
            out.float(), reference_group_gemm(x, wh, ws, cu).float(), atol=2e-2, rtol=2e-2
        )


@gpu
def test_registered_cuda_op_and_autograd_boundary():
    """torch.ops.moonep.group_gemm on CUDA tensors runs this kernel."""
    x, wh, ws, cu = _make([128, 0, 256, 128], 2, 256, 192)
    y = torch.ops.moonep.group_gemm(x, wh, ws, cu, 128)
    torch.testing.assert_close(y.float(), reference_group_gemm(x, wh, ws, cu).float(), atol=2e-2, rtol=2e-2)
