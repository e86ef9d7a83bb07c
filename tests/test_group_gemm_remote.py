"""Inference's remote groups (csrc_cute/group_gemm/remote.py): the last n_remote groups of
group_gemm_swiglu and group_gemm_row_scale read their expert's weights from the home rank through a peer
address. CPU (CI): validation of the remote arguments. GPU (Hopper): the inference FFN with remote groups
(on one GPU, a second tensor's address plays the donor rank) against the reference op and bitwise against
the plain kernel, CUDA-graph replay.
"""

import pytest
import torch

from group_gemm_cases import (
    capture_graph,
    check_row_scale,
    check_swiglu,
    gpu,
    random_lengths,
    random_problem,
    random_routing,
    random_row_weights,
    random_swiglu_problem,
    zero_inputs,
    zero_swiglu_inputs,
)


# ------------------------------------------------------------------------------------------------
# CPU: validation of the remote arguments
# ------------------------------------------------------------------------------------------------


def _remote_args():
    """CPU stand-ins for (remote_experts, peers) of the host checks: two remote groups, two ranks."""
    return torch.tensor([2, 3], dtype=torch.int32), torch.zeros(2, dtype=torch.int64)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda r: (r[0].long(), r[1]), r"experts_remote must have dtype int32"),
        (lambda r: (r[0][None], r[1]), r"experts_remote must have shape \[\*\]"),
        # no remote groups (the op's empty experts_remote): cu_seqlens must then hold epn + B entries
        (lambda r: (r[0][:0], r[1]), r"cu_seqlens must have shape \[3\] \(one entry per group: epn \+ B \+ "
                                     r"n_remote = 3 \+ 0\), got \[5\]"),
        (lambda r: (r[0].to("meta"), r[1]), r"experts_remote must be on cpu like the other inputs, got meta"),
        (lambda r: (r[0], r[1].int()), r"peers must be int64"),
        (lambda r: (r[0], r[1][:0]), r"peers must be 1-D holding at least one rank's address \(R >= 1\)"),
        (lambda r: (r[0], r[1].view(1, 2)), r"peers must be 1-D"),
        (lambda r: (r[0], torch.zeros(4, dtype=torch.int64)[::2]), r"peers must be contiguous"),
        (lambda r: (r[0], r[1].to("meta")), r"peers must be on cpu like the other inputs, got meta"),
        (lambda r: r[0], r"remote must be None or a tuple \(experts_remote, peers\), got Tensor"),
        (lambda r: (r[0],), r"remote must be None or a tuple \(experts_remote, peers\), got tuple of length 1"),
        (lambda r: r, r"x must be a CUDA tensor"),  # everything else fine
    ],
)
def test_row_scale_remote_bad_inputs(mutate, match):
    from csrc_cute.group_gemm import group_gemm_row_scale

    x, wh, ws, cu = zero_inputs(epn=2, nb=1)
    cu = torch.zeros(2 + 1 + 2, dtype=torch.int32)  # G = epn + B + n_remote
    rw = torch.ones(x.shape[0])
    with pytest.raises(ValueError, match=r"^moonep\.group_gemm_row_scale: " + match):
        group_gemm_row_scale(x, wh, ws, cu, rw, remote=mutate(_remote_args()))
    with pytest.raises(TypeError, match=r"^moonep\.group_gemm_row_scale: experts_remote must be a Tensor"):
        group_gemm_row_scale(x, wh, ws, cu, rw, remote=(_remote_args()[0].tolist(), _remote_args()[1]))


def test_remote_cu_seqlens_length_and_swiglu_names():
    from csrc_cute.group_gemm import group_gemm_row_scale, group_gemm_swiglu

    x, wh, ws, cu = zero_inputs(epn=2, nb=1)  # cu: epn + B entries, no room for the remote groups
    rw = torch.ones(x.shape[0])
    rs, sg = r"^moonep\.group_gemm_row_scale: ", r"^moonep\.group_gemm_swiglu: "
    with pytest.raises(ValueError, match=rs + r"cu_seqlens must have shape \[5\] \(one entry per group: epn \+ B \+ "
                                         r"n_remote = 3 \+ 2\)"):
        group_gemm_row_scale(x, wh, ws, cu, rw, remote=_remote_args())
    with pytest.raises(ValueError, match=rs + r"cu_seqlens must have shape \[3\] \(one entry per group: epn \+ B = 3\), "
                                         r"got \[5\]"):
        group_gemm_row_scale(x, wh, ws, torch.zeros(5, dtype=torch.int32), rw)  # remote groups but no remote
    sw = list(zero_swiglu_inputs())
    sw[5] = torch.zeros(2 + 1 + 2, dtype=torch.int32)
    experts, peers = _remote_args()
    for remote, match in (
        ((experts, peers), r"remote must be None or a tuple \(experts_remote, gate_peers, up_peers\)"),
        ((experts, peers.int(), peers), r"gate_peers must be int64"),
        ((experts, peers, peers[:0]), r"up_peers must be 1-D holding at least one rank's address"),
        ((experts, peers, peers.to("meta")), r"up_peers must be on cpu like the other inputs"),
        ((experts, peers, torch.zeros(3, dtype=torch.int64)), r"gate_peers, up_peers must have the same length"),
        ((experts.float(), peers, peers), r"experts_remote must have dtype int32"),
        ((experts, peers, peers), r"x must be a CUDA tensor"),
    ):
        for store_preact in (False, True):
            with pytest.raises(ValueError, match=sg + match):
                group_gemm_swiglu(*sw, store_preact=store_preact, remote=remote)
    sw[5] = sw[5][:3]
    with pytest.raises(ValueError, match=sg + r"cu_seqlens must have shape \[5\] \(one entry per group: epn \+ B \+ "
                                         r"n_remote = 3 \+ 2\)"):
        group_gemm_swiglu(*sw, remote=(experts, peers, peers))


# ------------------------------------------------------------------------------------------------
# GPU: the inference FFN with remote groups
# ------------------------------------------------------------------------------------------------


def _remote_weights(w_home, w_slot, experts, seed):
    """One GPU plays two ranks: this one (rank 0, home weights ``w_home``) and the donor (rank 1), whose
    home weights ``w_donor`` (random, of w_home's scale) the kernel reaches only through their address,
    ``peers[1]`` (the kernel only needs device addresses). Returns (peers, w_donor, ref_slots):
    ``ref_slots`` = ``w_slot`` followed by the weights each remote group reads (``w_donor[e % epn]``,
    zeros for an unused group, -1), so that the remote groups are slot groups of the reference op and
    of the plain kernel. Keep ``w_donor`` alive while the kernel may run."""
    epn = w_home.shape[0]
    g = torch.Generator().manual_seed(seed)
    w_donor = (torch.randn(w_home.shape, generator=g) * w_home.float().std().item()).bfloat16().to(w_home.device)
    peers = torch.tensor([w_home.data_ptr(), w_donor.data_ptr()], dtype=torch.int64, device=w_home.device)
    extra = torch.stack([w_donor[e % epn] if e >= 0 else torch.zeros_like(w_donor[0]) for e in experts])
    return peers, w_donor, torch.cat([w_slot, extra])


def _remote_ffn_case(lengths, epn, nb, experts, hd, f, tail, seed, pad=128):
    """The inference FFN with remote groups: h = group_gemm_swiglu (gate/up, weights [*, H, F]) then
    y = group_gemm_row_scale(h, W_down [*, F, H]), both with the last len(experts) groups remote (donor
    rank 1, see ``_remote_weights``), each checked against the reference op (remote groups as slots) and
    bitwise against the plain kernel given the remote groups' weights as slots; h-only and with the
    pre-activations. ``lengths``: all G = epn + nb + len(experts) groups; ``tail`` rows past the last."""
    from csrc_cute.group_gemm import group_gemm_row_scale, group_gemm_swiglu

    x, wgh, wgs, wuh, wus, cu = random_swiglu_problem(lengths, epn, hd, f, n_total=sum(lengths) + tail, seed=seed)
    wgs, wus = wgs[:nb], wus[:nb]  # random_swiglu_problem made slots for every group past epn
    _, wdh, wds, _ = random_problem(lengths, epn, f, hd, seed=seed + 1)
    wds = wds[:nb]
    remote_experts = torch.tensor(experts, dtype=torch.int32, device="cuda")
    gate_peers, gate_donor, gate_slots = _remote_weights(wgh, wgs, experts, seed + 2)
    up_peers, up_donor, up_slots = _remote_weights(wuh, wus, experts, seed + 3)
    down_peers, down_donor, down_slots = _remote_weights(wdh, wds, experts, seed + 4)
    sw_remote = (remote_experts, gate_peers, up_peers)
    for store_preact in (False, True):
        h, gate, up = check_swiglu(x, wgh, wgs, wuh, wus, cu, pad, store_preact, remote=sw_remote,
                                    ref_slots=(gate_slots, up_slots))
        plain = group_gemm_swiglu(x, wgh, gate_slots, wuh, up_slots, cu, pad=pad, store_preact=store_preact)
        assert all(a is b or torch.equal(a, b) for a, b in zip((h, gate, up), plain)), store_preact
    row_w = random_row_weights(x.shape[0], seed)
    y = check_row_scale(h, wdh, wds, cu, row_w, pad, remote=(remote_experts, down_peers), ref_slots=down_slots)
    assert torch.equal(y, group_gemm_row_scale(h, wdh, down_slots, cu, row_w, pad=pad))
    assert torch.count_nonzero(y[:7]) == 0
    return h, y


@gpu
@pytest.mark.parametrize("pad", [128, 64])
def test_remote_groups_small(pad):
    """Several remote groups (experts of the donor, ascending, an unused -1 tail), empty groups among
    the home, slot and remote ones (a remote expert with no rows too), partial tiles (H = 520, F = 200,
    a partial last M tile) and rows past the last group."""
    epn, nb = 4, 2
    experts = [epn + 0, epn + 1, epn + 3, -1]
    lengths = random_lengths(pad, epn, nb, 4, seed=70 + pad) + [2 * pad, 0, 3 * pad, 0]
    _remote_ffn_case(lengths, epn, nb, experts, hd=520, f=200, tail=3 * pad + 64, seed=pad, pad=pad)


@gpu
def test_remote_groups_realistic_shapes():
    """H = 7168, F = 2048, P = 128: more tiles than SMs, so CTAs reach remote tiles after home and slot
    tiles and walk several remote groups with the descriptor they built once; then all rows in remote
    groups (every CTA's first tile is remote) with no slot groups (B = 0)."""
    epn, hd, f = 2, 7168, 2048
    _remote_ffn_case([256, 0, 384, 0, 512, 640, 0], epn, 2, [epn + 0, epn + 1, -1], hd, f, tail=128, seed=11)
    _remote_ffn_case([0, 0, 768, 1024], epn, 0, [epn + 0, epn + 1], hd, f, tail=256, seed=12)


@gpu
def test_remote_groups_cuda_graph_replay():
    """The inference FFN with remote groups captured once (each launch allocates its descriptor
    workspace) and replayed with new routings on the device: equal to eager."""
    from csrc_cute.group_gemm import group_gemm_row_scale, group_gemm_swiglu

    epn, nb, kd, nd, n = 4, 1, 384, 256, 2048
    experts = [epn + 1, epn + 2, -1]
    g_total = epn + nb + len(experts)
    x, wgh, wgs, wuh, wus, _ = random_swiglu_problem([0] * g_total, epn, kd, nd, n_total=n, seed=21)
    _, wdh, wds, _ = random_problem([0] * g_total, epn, nd, kd, seed=22)
    wgs, wus, wds = wgs[:nb], wus[:nb], wds[:nb]
    remote_experts = torch.tensor(experts, dtype=torch.int32, device="cuda")
    gate_peers, gate_donor, _ = _remote_weights(wgh, wgs, experts, 23)
    up_peers, up_donor, _ = _remote_weights(wuh, wus, experts, 24)
    down_peers, down_donor, _ = _remote_weights(wdh, wds, experts, 25)
    row_w = torch.rand(n, device="cuda")
    cu = torch.zeros(g_total, dtype=torch.int32, device="cuda")

    def ffn(h_out=None, y_out=None):
        h, _, _ = group_gemm_swiglu(x, wgh, wgs, wuh, wus, cu, store_preact=False, out=h_out,
                                    remote=(remote_experts, gate_peers, up_peers))
        return h, group_gemm_row_scale(h, wdh, wds, cu, row_w, out=y_out, remote=(remote_experts, down_peers))

    def routing(seed):
        r = random_routing(epn, nb + len(experts), n, seed)
        r[-1] = r[-2]  # the unused group stays empty
        return r

    cu.copy_(routing(0))
    ffn()  # compile + warm up outside capture
    h_out = torch.empty(n, nd, dtype=torch.bfloat16, device="cuda")
    y_out = torch.empty(n, kd, dtype=torch.bfloat16, device="cuda")
    graph = capture_graph(lambda: ffn(h_out, y_out))
    for seed in range(1, 4):
        cu.copy_(routing(seed))
        h_out.fill_(float("nan"))
        y_out.fill_(float("nan"))
        graph.replay()
        eh, ey = ffn()
        torch.cuda.synchronize()
        assert torch.equal(h_out, eh) and torch.equal(y_out, ey), seed
