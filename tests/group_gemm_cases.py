"""What the grouped GEMM tests (tests/test_group_gemm_*.py) share: the Hopper marker, problem builders
(CPU zeros for the host checks, random bf16 problems on the GPU), the CPU reference ops and the checks
of a kernel's result against them, random group lengths and routings, CUDA-graph capture.
"""

import pytest
import torch

import moonep_ops  # noqa: F401  (registers moonep::group_gemm*, whose CPU implementations are the references)

HAS_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
gpu = pytest.mark.skipif(not HAS_HOPPER, reason="needs a Hopper (sm_90) GPU")


def zero_inputs(n=256, kd=64, nd=64, epn=2, nb=1, dtype=torch.bfloat16, device="cpu"):
    """Zeros of the forward's arguments (x [n, Kd], w_home [epn, Kd, Nd], w_slot [nb, Kd, Nd], cu_seqlens
    [epn + nb]) on the CPU: valid but for the device, so a host check fails on the argument it mutates."""
    x = torch.zeros(n, kd, dtype=dtype, device=device)
    wh = torch.zeros(epn, kd, nd, dtype=dtype, device=device)
    ws = torch.zeros(nb, kd, nd, dtype=dtype, device=device)
    cu = torch.zeros(epn + nb, dtype=torch.int32, device=device)
    return x, wh, ws, cu


def zero_swiglu_inputs(n=256, kd=64, nd=64, epn=2, nb=1):
    """``zero_inputs`` for group_gemm_swiglu: (x, w_gate_home, w_gate_slot, w_up_home, w_up_slot, cu_seqlens)."""
    x, wh, ws, cu = zero_inputs(n, kd, nd, epn, nb)
    return x, wh, ws, wh.clone(), ws.clone(), cu


# ------------------------------------------------------------------------------------------------
# GPU problems, references and checks
# ------------------------------------------------------------------------------------------------


def random_problem(lengths, epn, kd, nd, n_total=None, seed=0):
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


def random_bwd_problem(lengths, epn, kd, nd, n_total=None, seed=0):
    """Random bf16 backward problem: (x, dy, w_home, w_slot, cu_seqlens) on the GPU."""
    x, wh, ws, cu = random_problem(lengths, epn, kd, nd, n_total=n_total, seed=seed)
    g = torch.Generator(device="cpu").manual_seed(seed + 1000)
    dy = torch.randn(x.shape[0], nd, generator=g).bfloat16().to(x.device)
    # dy scale: keep dx = dy @ W^T (sums over Nd) of order one
    wh.mul_((kd / nd) ** 0.5)
    ws.mul_((kd / nd) ** 0.5)
    return x, dy, wh, ws, cu


def random_swiglu_problem(lengths, epn, kd, nd, n_total=None, seed=0):
    """(x, w_gate_home, w_gate_slot, w_up_home, w_up_slot, cu) on the GPU; gate/up of order one."""
    x, wgh, wgs, cu = random_problem(lengths, epn, kd, nd, n_total=n_total, seed=seed)
    _, wuh, wus, _ = random_problem(lengths, epn, kd, nd, n_total=n_total, seed=seed + 500)
    for w in (wgh, wgs, wuh, wus):
        w.mul_(2.0)  # x ~ 0.5 N(0, 1): gate, up ~ N(0, 1), so silu sees both signs and its curved part
    return x, wgh, wgs, wuh, wus, cu


def random_lengths(pad, epn, nb, hi, seed):
    gen = torch.Generator().manual_seed(seed)
    lengths = (torch.randint(0, hi, (epn + nb,), generator=gen) * pad).tolist()
    lengths[1] = 0  # an empty home group
    lengths[epn + 1] = 0  # an empty slot group
    lengths[epn] = max(lengths[epn], pad)  # a slot group with rows
    lengths[0] = max(lengths[0], pad)
    return lengths


def random_routing(epn, nb, n, seed):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (epn + nb,), generator=gen) * 128
    return lengths.cumsum(0).clamp(max=n).to(torch.int32)


def random_row_weights(n, seed):
    """Route weights of both signs, some ~0, the first 7 exactly 0 (their rows must be zero)."""
    g = torch.Generator().manual_seed(seed)
    row_w = (torch.rand(n, generator=g) * 2 - 0.5).cuda()
    row_w[:7] = 0.0
    return row_w


def reference_group_gemm(x, wh, ws, cu, pad=128):
    """The CPU reference op (fp32 accumulation), moved back to x's device."""
    return torch.ops.moonep.group_gemm(x.cpu(), wh.cpu(), ws.cpu(), cu.cpu(), pad).to(x.device)


def reference_dgrad(dy, wh, ws, cu, pad=128):
    return torch.ops.moonep.group_gemm_dgrad(dy.cpu(), wh.cpu(), ws.cpu(), cu.cpu(), pad).to(dy.device)


def reference_swiglu(x, wgh, wgs, wuh, wus, cu, pad=128, save=True):
    out = torch.ops.moonep.group_gemm_swiglu(*(t.cpu() for t in (x, wgh, wgs, wuh, wus, cu)), pad, save)
    return tuple(t.to(x.device) for t in out)


def check_rows(y, ref, cu):
    """y (written over a NaN-filled buffer) equals ref within bf16 tolerance; rows past the end are zero."""
    torch.cuda.synchronize()
    end = int(cu[-1])
    assert torch.equal(y[end:], torch.zeros_like(y[end:])), "rows past the last group must be zero"
    torch.testing.assert_close(y.float(), ref.float(), atol=2e-2, rtol=2e-2)
    return y


WGRAD_TOL = dict(atol=1e-2, rtol=1e-3)  # fp32 slot gradients: only the summation order differs


# bf16 home gradients against the fp32 reference: one rounding (relative error <= 2^-9), after fp32
# accumulation in a different order
WGRAD_HOME_TOL = dict(atol=1e-3, rtol=4e-3)


def nan_home_grads(epn, kd, nd):
    """bf16 home gradients filled with NaN: every element the kernel does not write stays NaN."""
    return torch.full((epn, kd, nd), float("nan"), dtype=torch.bfloat16, device="cuda")


def check_swiglu(x, wgh, wgs, wuh, wus, cu, pad=128, store_preact=True, remote=None, ref_slots=None):
    """The kernel (with ``remote`` groups, if given) against the reference op; ``ref_slots`` (gate, up):
    the slot weights the reference uses instead of (wgs, wus) (see ``_remote_weights`` in
    test_group_gemm_remote.py)."""
    from csrc_cute.group_gemm import group_gemm_swiglu

    n, nd = x.shape[0], wgh.shape[2]
    bufs = [torch.full((n, nd), float("nan"), dtype=torch.bfloat16, device=x.device) for _ in range(3)]
    h, gate, up = group_gemm_swiglu(x, wgh, wgs, wuh, wus, cu, pad=pad, store_preact=store_preact, out=bufs[0],
                                    gate_out=bufs[1], up_out=bufs[2], remote=remote)
    ref_gs, ref_us = (wgs, wus) if ref_slots is None else ref_slots
    ref_h, ref_g, ref_u = reference_swiglu(x, wgh, ref_gs, wuh, ref_us, cu, pad)
    check_rows(h, ref_h, cu)
    if store_preact:
        check_rows(gate, ref_g, cu)
        check_rows(up, ref_u, cu)
    else:
        assert gate is None and up is None
        assert torch.isnan(bufs[1]).all() and torch.isnan(bufs[2]).all(), "h-only kernel wrote gate/up"
    return h, gate, up


def check_row_scale(x, wh, ws, cu, row_w, pad=128, remote=None, ref_slots=None):
    """group_gemm_row_scale (with ``remote`` groups, if given) into a NaN-filled buffer against the
    reference op, which uses ``ref_slots`` instead of ``ws`` if given (see ``_remote_weights`` in
    test_group_gemm_remote.py)."""
    from csrc_cute.group_gemm import group_gemm_row_scale

    out = torch.full((x.shape[0], wh.shape[2]), float("nan"), dtype=torch.bfloat16, device=x.device)
    y = group_gemm_row_scale(x, wh, ws, cu, row_w, pad=pad, out=out, remote=remote)
    ref_ws = ws if ref_slots is None else ref_slots
    ref = torch.ops.moonep.group_gemm_row_scale(x.cpu(), wh.cpu(), ref_ws.cpu(), cu.cpu(), row_w.cpu(), pad)
    return check_rows(y, ref.to(x.device), cu)


def capture_graph(fn, warm: bool = False) -> "torch.cuda.CUDAGraph":
    """fn() captured once in a CUDA graph on a side stream (its kernels compiled beforehand; ``warm``: run
    it once more on that stream before the capture)."""
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        if warm:
            fn()
        with torch.cuda.graph(graph, stream=stream):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    return graph


def gathered_rows(x, row_src):
    """What dispatch builds and the gathered kernel reads in place: ``where(row_src >= 0, x[row_src], 0)``."""
    if x.shape[0] == 0:  # no tokens: every row is padding
        return x.new_zeros(row_src.shape[0], x.shape[1])
    rows = x[row_src.clamp(min=0).long()]
    return torch.where((row_src >= 0)[:, None], rows, torch.zeros_like(rows))


def random_row_src(cu, n, s, seed, all_padding=(), tail_valid=False):
    """row_src [n] int32 (on cu's device) for group ends ``cu``: per group a random number of rows from random
    tokens of x [s, H] (with repeats), the rest padding (-1); groups ``all_padding`` padding only; every group
    with routed rows has token s - 1 and token 0 (one token in several groups); rows past the last group -1
    or (``tail_valid``) valid tokens, which neither kernel reads."""
    gen = torch.Generator().manual_seed(seed)
    src = torch.full((n,), -1, dtype=torch.int32)
    ends = cu.cpu().tolist()
    start = 0
    for g, end in enumerate(ends):
        length = end - start
        routed = 0 if g in all_padding or length == 0 else int(torch.randint(1, length + 1, (1,), generator=gen))
        if routed:
            src[start:start + routed] = torch.randint(0, s, (routed,), generator=gen, dtype=torch.int32)
            src[start] = s - 1
            src[start + routed - 1] = 0
        start = end
    if tail_valid and n > start:
        src[start:] = torch.randint(0, s, (n - start,), generator=gen, dtype=torch.int32)
    return src.to(cu.device)


def unmultiplied_rows(cu, row_src, window=128, block=16):
    """bool [n]: the rows a gathered wgrad does not multiply (``GatherKRowsMixin.routed_k_rows``): in each
    group, those past the 16-row block that holds its last routed row among its last 128 rows (the rows
    before those all count as routed), its first block always multiplied."""
    src = row_src.cpu()
    mask = torch.zeros(src.shape[0], dtype=torch.bool)
    start = 0
    for end in cu.cpu().tolist():
        length = end - start
        if length:
            w = min(length, window)
            routed = (src[end - w:end] >= 0).nonzero()
            k_rows = length - w + (int(routed[-1]) + 1 if len(routed) else 0)
            mask[start + max(-(-k_rows // block), 1) * block:end] = True
        start = end
    return mask.to(row_src.device)


def random_tokens(s, kd, seed):
    """x [s, H] bf16 on the GPU, of the scale ``random_problem`` uses."""
    return (torch.randn(s, kd, generator=torch.Generator().manual_seed(seed)) * 0.5).bfloat16().cuda()
