"""Ours against the peers on one GPU, one process, one run: SonicMoE (`sonicmoe.MoE`, its own kernels), QuACK
0.4.1 (its varlen GEMMs), plain torch (`torch._grouped_mm` with permute/unpermute) and torch.compile of it.

    source .carry/prelude.sh && source .carry/peers.sh && python3 benchmarks/bench_peers.py --out $OUT
    python benchmarks/bench_peers.py --smoke          (tiny shapes on the CPU: ours and torch, no peers)
    python benchmarks/bench_peers.py --only gemm      (sections: layer, gemm)

Sections
  layer  one MoE layer, S=8192 H=7168 F=2048 E=48 K=8 bf16, R=1 (ours: moonep_ops.MoELayer on a 1-rank process
         group, NCCL; gloo on the CPU): forward, inference forward (no_grad; SonicMoE with is_inference_mode),
         forward + backward (gradients of x, the router and every expert weight), peak memory of one step
         (torch.cuda.max_memory_allocated; `step_gb` = peak - memory allocated before the step; ours' symmetric
         buffers come from the symmetric-memory allocator and are reported apart, `ours_symmetric_gb`);
         `ours_rows`: ours with EPGroup(gather_rows=False) (dispatch writes the rows [NvS, H], re-dispatched
         in backward: the default before the gathered path; the default at R = 1 reads the tokens by index
         in its GEMMs and writes no rows); `step_gpu_idle`: three steps back to back profiled, per step the
         host's enqueue time and the GPU's span, busy and idle time with the longest gaps (common.gpu_idle).
  gemm   each GEMM family at H=7168, F=2048 in three group layouts (65536 rows in 48 equal groups; 16 x 2048;
         48 skewed groups: a maxvio-4 routing's per-expert rows, each padded to 128):
           fwd         y = x_g @ W_g                 [M, H] x [G, H, F]
           dgrad       dx = dy_g @ W_g^T             [M, F] x [G, H, F]^T
           dgrad2      dx = g_gate_g @ W_gate_g^T + g_up_g @ W_up_g^T  (the gate/up input gradient; ours one
                       GEMM with one fp32 accumulator; QuACK one GEMM with K = 2F on the interleaved
                       gradient and weights, as SonicMoE's backward runs it; torch two dgrads and a bf16 add)
           wgrad       dW_g = x_g^T @ dy_g           -> [G, H, F], bf16 out, fp32 accumulation
           swiglu      h = silu(x W_gate) * (x W_up) (pre-activations stored for backward)
           swiglu_bwd  d = g_y_g @ W_down_g^T with the SwiGLU backward and the route weight in the epilogue:
                       g_gate, g_up, h_w = row_w * h, g_row_w = sum_f d * h
           swiglu_gather, wgrad_gather, swiglu_bwd_gather  the same with the rows read by index from S tokens
                       (x_tok [S, H], g_tok [S, H]; row_src [M]: every token read by M / S rows, ascending within
                       each group, as the layer's gathered path at R = 1 reads them): ours the gathered kernels
                       the layer runs (group_gemm_*_gather), QuACK its gather_A (A_idx) of the same calls,
                       torch index_select and then its plain call
         ours: torch.ops.moonep.group_gemm* (all groups home groups); QuACK: quack.gemm_interface.gemm /
         gemm_gated / gemm_dgated (gate/up columns interleaved, cu_seqlens_m/k = [0, ends...]); torch:
         torch._grouped_mm (+ eager SwiGLU math). TFLOP/s count the GEMM FLOPs of every row.

Identical inputs: one set of bf16 weights and one x, copied into every implementation's layout. The router is
made exact without touching any implementation's router: x = L Q^T + noise, router weight Q^T (Q [H, E]
orthonormal columns, the noise orthogonal to them), so x @ W_router^T = L up to bf16 rounding (~2e-3), where L
holds 0.5, 0.4375, ... on each token's K target experts and -8 elsewhere: a margin of 7.5 that no rounding
crosses, so all pick the same experts (checked: the fp32 reference's top-K equals the target). Every result is
checked against an fp32 reference (moonep_ops.dense_moe; per-group fp32 matmuls for the GEMMs) before it is
timed (max |got - ref| / max |ref|, `*_err`; `*_ok` against --tol); a mismatch is reported and still timed.

Peers: QuACK's and SonicMoE's autotuning is pinned off (every quack Autotuner gets the single config it uses
with tuned=False, its default; SonicMoE's Triton helpers tune over their few configs during warm-up). A missing
peer (not importable, or no CUDA) is named in the JSON `peers` and in the table, and ours and torch still run;
a peer (or any implementation) that fails is recorded as an error in its cell and the run goes on. Peers are
imported after ours and torch have run: importing quack makes CuTe DSL compiles single-threaded process-wide;
our GEMM section's kernels compile side by side in child processes before its first row (`ours_compile_calls`,
`csrc_cute.jit.compile_ahead`), the layer's through its automatic `precompile`.

Timing: CUDA events (wall clock on the CPU), median over --repeats of the mean of --iters calls after --warmup;
the GEMM families' implementations in rotated rounds, one round timing each once, so that ours and QuACK share
the GPU's clock and power state. ``--sustained-s S`` (GEMM section): each implementation of each family and layout
also launched back to back for about S seconds after ``--idle-s`` idle (common.run_sustained, the order rotated
per row), its time per call at the board's power cap (`*_sustained_ms`, with clock, power, energy and M SM
cycles per call, and `ours_over_<impl>_cycles`, the other's cycles over ours') beside the burst: the burst's
5 x 3 calls run before the board settles and record no clock (on the H100s of sessions 42-53 each call's cycles
at the cap put them at 1.12-1.77 GHz, not the 1.98 GHz boost: benchmarks/gemm_clocks.py,
results/gemm_clocks_session54_h100_all.json.gz), and kernels that did not change moved by up to 15% between
runs (the wgrad at 48 equal groups: ours 0.87x QuACK's speed in session 32's burst,
results/bench_peers_session32_h100_gemm.json, and 1.00x in session 31's bench_tiles burst); a training step runs
at the cap (until 4cde1fc QuACK was timed in a second pass, after SonicMoE's layer runs:
the same QuACK dgrad at 16 x 4096 took 2.50 ms there and 2.81 ms in a bench_tiles run of the same session on
another machine, 1 H200: results/bench_peers_4cde1fc_h200.log.gz, bench_tiles_session18_h200.log.gz). The layer's
implementations are timed each in a block of its own (fwd, inference, fwd + backward), not in rotated rounds:
tried in session 28, rounds of 3 warm-up + 5 timed steps each (about 0.25 s) met the board's power limiter in
the transient the other implementation left, and ours came out slower than its own steady state at the 700 W
cap (H100: 32.65 ms against bench_sustained's 31.16 in the same call, SonicMoE 32.77 against 33.87;
results/bench_peers_layer_session28_rotated5_h100.json, bench_sustained_session28_h100.json). Neither short
protocol is that steady state (the blocks on that H100: ours 31.81, SonicMoE 37.10 ms,
results/bench_peers_layer_session28_blocks_h100.json): bench_sustained measures it. ``--graph N`` (GEMM
section): the burst's calls replay a CUDA graph of N calls each, so the host's launches leave no gaps and what
separates two kernels is the GPU's own (launch, prologue, tail: what programmatic dependent launch overlaps).
Writes bench_peers.json (GPU, command, commit, date, versions of torch, cutlass, quack, sonicmoe) and
bench_peers.png (benchmarks/plot_results.plot_peers, if matplotlib is there); the table is printed last.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import os
import re
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as Fn
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (Bench, apply_smoke_defaults, capture, combine_pull_bytes, gpu_idle,  # noqa: E402
                               kernel_breakdown, names_option, rotated, run_info, run_sustained, short_error,
                               sustained_text, symmetric_bytes, time_round_robin, write_json)
from benchmarks.routing_gen import counts_of, routing_for_maxvio, sample_topk  # noqa: E402
from csrc_cute import jit  # noqa: E402
from moonep_ops.routing import route  # noqa: E402

SECTIONS = ("layer", "gemm")
PEERS = ("quack", "sonicmoe")
FAMILIES = ("fwd", "dgrad", "dgrad2", "wgrad", "swiglu", "swiglu_bwd", "swiglu_gather", "wgrad_gather",
            "swiglu_bwd_gather")
# gathered family -> (the operand of its plain family, the tokens that operand's rows are read from by row_src)
GATHERED = {"swiglu_gather": ("x", "x_tok"), "wgrad_gather": ("x", "x_tok"), "swiglu_bwd_gather": ("g_y", "g_tok")}
IMPLS = ("ours", "ours_rows", "torch", "torch_compiled", "sonicmoe", "quack")
PICKED_TOP, PICKED_STEP, OTHER_LOGIT = 0.5, 0.0625, -8.0  # designed router logits (see the module docstring)
SMOKE = dict(S=64, H=64, F=32, E=8, K=2, P=16, gemm_rows=512, iters=2, repeats=1, warmup=1,
             compile_backend="aot_eager", sustained_s=0.005, idle_s=0.0)


# ------------------------------------------------------------------------------------------ inputs
def exact_routing_inputs(S: int, H: int, E: int, K: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x [S, H] bf16, router weight [E, H] bf16, target ids [S, K]): x @ W^T is the designed logits, so top-K
    of every implementation's router picks exactly the target ids (uniformly drawn, K distinct per token)."""
    if H < E:
        raise ValueError(f"exact_routing_inputs: H={H} must be >= E={E} (Q [H, E] has orthonormal columns)")
    ids = sample_topk(1, S, E, K, sigma=0.0, seed=seed)[0]
    logits = torch.full((S, E), OTHER_LOGIT, dtype=torch.float64)
    picked = PICKED_TOP - PICKED_STEP * torch.arange(K, dtype=torch.float64)
    logits.scatter_(1, ids, picked.expand(S, K).contiguous())
    g = torch.Generator().manual_seed(seed + 1)
    q, _ = torch.linalg.qr(torch.randn(H, E, generator=g, dtype=torch.float64))
    noise = torch.randn(S, H, generator=g, dtype=torch.float64)
    noise -= (noise @ q) @ q.t()
    x = logits @ q.t() + noise
    return x.bfloat16(), q.t().contiguous().bfloat16(), ids


def expert_weights(E: int, H: int, F: int, device, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w_gate, w_up [E, H, F], w_down [E, F, H] bf16, uniform +-1/sqrt(fan_in) like MoEExperts."""
    g = torch.Generator(device=device).manual_seed(seed)

    def uni(*shape, fan_in):
        return ((torch.rand(*shape, generator=g, device=device) * 2 - 1) / fan_in ** 0.5).bfloat16()
    return uni(E, H, F, fan_in=H), uni(E, H, F, fan_in=H), uni(E, F, H, fan_in=F)


def group_layouts(rows: int, groups: int = 48, P: int = 128, S: int = 8192, K: int = 8, seed: int = 0
                  ) -> dict[str, torch.Tensor]:
    """name -> group ends [G] int32 (ours' cu_seqlens; every group a multiple of P): `rows` rows in 48 equal
    groups, 16 groups of rows/16, and 48 skewed groups (a maxvio-4 routing's per-expert rows, padded to P)."""
    G = groups
    if rows % (16 * P) or rows < G * P:
        raise ValueError(f"group_layouts: rows={rows} must be a multiple of 16*P={16 * P} and >= {G}*P")
    equal = [rows // G // P * P] * G
    equal[-1] += rows - sum(equal)
    ids, _, _ = routing_for_maxvio(1, S, G, K, min(4.0, G / K - 1), seed=seed)
    counts = counts_of(ids, G)[0].long()
    skewed = (counts + P - 1) // P * P
    return {f"{G} equal": torch.tensor(equal).cumsum(0).int(),
            f"16 x {rows // 16}": (torch.arange(1, 17) * (rows // 16)).int(),
            f"{G} skewed": skewed.cumsum(0).int()}


def starts_ends(ends: torch.Tensor) -> list[tuple[int, int]]:
    e = [0] + ends.tolist()
    return list(zip(e[:-1], e[1:]))


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.to(got.device)
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))


# ------------------------------------------------------------------------------------------ peers
def load_peers(cuda: bool) -> tuple[dict, dict]:
    """(modules by name, status by name): "ok <version>", "missing: ..." or "not run: ...". On CUDA, quack's
    autotuners are pinned to the single config quack uses with tuned=False."""
    mods, status = {}, {}
    for name in PEERS:
        if importlib.util.find_spec(name) is None:
            status[name] = f"missing: module {name!r} not importable (source .carry/peers.sh)"
            continue
        if not cuda:
            status[name] = "not run: needs CUDA"
            continue
        try:
            mods[name] = importlib.import_module(name)
            status[name] = f"ok {getattr(mods[name], '__version__', '?')}"
        except Exception as e:  # noqa: BLE001  (recorded: the other implementations still run)
            status[name] = "import failed: " + short_error(e)
    if "quack" in mods:
        try:
            from quack import gemm_interface as qgi
            from quack.autotuner import AutotuneConfig, Autotuner
            for tuner in vars(qgi).values():
                if isinstance(tuner, Autotuner):
                    tuner.configs = [AutotuneConfig(config=None)]  # config=None: quack's default config
        except Exception as e:  # noqa: BLE001
            status["quack"] += "; autotune not pinned: " + short_error(e)
    return mods, status


# ------------------------------------------------------------------------------------------ layer
class TorchMoE(nn.Module):
    """The standard single-GPU MoE: router, top-K, permute rows by expert, torch._grouped_mm SwiGLU, unpermute
    with the route weights. Expert counts by scatter_add (no host sync, static shapes: torch.compile-able)."""

    def __init__(self, router_w, w_gate, w_up, w_down, K: int):
        super().__init__()
        self.K = K
        self.router = nn.Linear(router_w.shape[1], router_w.shape[0], bias=False, dtype=router_w.dtype,
                                device=router_w.device)
        with torch.no_grad():
            self.router.weight.copy_(router_w)
        self.w_gate, self.w_up, self.w_down = (nn.Parameter(w.clone()) for w in (w_gate, w_up, w_down))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        S, E = x.shape[0], self.w_gate.shape[0]
        weights, ids = route(self.router(x), self.K)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        offs = torch.zeros(E, dtype=torch.int32, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat, dtype=torch.int32)).cumsum(0).to(torch.int32)
        rows = x[order // self.K]
        h = Fn.silu(torch._grouped_mm(rows, self.w_gate, offs=offs)) * torch._grouped_mm(rows, self.w_up, offs=offs)
        out = torch._grouped_mm(h, self.w_down, offs=offs)
        scaled = out.float() * weights.reshape(-1)[order][:, None]
        return torch.zeros(S, x.shape[1], dtype=torch.float32, device=x.device).index_add_(
            0, order // self.K, scaled).to(x.dtype)

    def grads(self) -> dict:
        return dict(router=self.router.weight.grad, w_gate=self.w_gate.grad, w_up=self.w_up.grad,
                    w_down=self.w_down.grad)


class OursLayer:
    """moonep_ops.MoELayer at R=1 with the shared weights copied in."""

    def __init__(self, ep, router_w, w_gate, w_up, w_down):
        from moonep_ops import MoELayer

        self.module = MoELayer(ep)
        with torch.no_grad():
            for dst, src in ((self.module.router.weight, router_w), (self.module.experts.w_gate, w_gate),
                             (self.module.experts.w_up, w_up), (self.module.experts.w_down, w_down)):
                dst.copy_(src)

    def __call__(self, x, inference=False):
        return self.module(x)

    def grads(self) -> dict:
        ex = self.module.experts
        return dict(router=self.module.router.weight.grad, w_gate=ex.w_gate.grad, w_up=ex.w_up.grad,
                    w_down=ex.w_down.grad)


class SonicLayer:
    """sonicmoe.MoE with the shared weights in its layout: c_fc [E, 2F, H] gate/up rows interleaved, c_proj
    [E, H, F]; forward with KernelBackendMoE.sonicmoe (its softmax over the top-K logits = our route)."""

    def __init__(self, sonicmoe, router_w, w_gate, w_up, w_down, K: int):
        from sonicmoe.enums import ActivationType, KernelBackendMoE

        E, H, F = w_gate.shape
        self.backend = KernelBackendMoE.sonicmoe
        with torch.device(w_gate.device):  # initialised on the GPU (its fp32 init on the CPU takes long)
            self.module = sonicmoe.MoE(E, K, H, F, ActivationType.SWIGLU, add_bias=False, std=0.02).to(w_gate.dtype)
        with torch.no_grad():
            self.module.router.weight.copy_(router_w)
            fc = self.module.c_fc.weight  # [E, 2F, H]
            fc[:, 0::2].copy_(w_gate.transpose(1, 2))
            fc[:, 1::2].copy_(w_up.transpose(1, 2))
            self.module.c_proj.weight.copy_(w_down.transpose(1, 2))

    def __call__(self, x, inference=False):
        return self.module(x, kernel_backend_moe=self.backend, is_inference_mode=inference)[0]

    def grads(self) -> dict:
        fc, proj = self.module.c_fc.weight.grad, self.module.c_proj.weight.grad
        return dict(router=self.module.router.weight.grad, w_gate=fc[:, 0::2].transpose(1, 2),
                    w_up=fc[:, 1::2].transpose(1, 2), w_down=proj.transpose(1, 2))


class TorchLayer:
    def __init__(self, module: TorchMoE, compiled_with: str | None = None):
        self.module = module
        self.fn = module if compiled_with is None else torch.compile(module, backend=compiled_with)

    def __call__(self, x, inference=False):
        return self.fn(x)

    def grads(self) -> dict:
        return self.module.grads()


def layer_reference(x, router_w, w_gate, w_up, w_down, g, K: int, ids: torch.Tensor) -> dict:
    """fp32 dense reference: output and the gradients of x, the router and the experts for output gradient g.
    Checks that its top-K is the designed target (exact routing)."""
    from moonep_ops.dense import dense_moe

    leaves = [t.float().requires_grad_() for t in (x, router_w, w_gate, w_up, w_down)]
    _, got_ids = route(leaves[0].detach() @ leaves[1].detach().t(), K)
    if not torch.equal(got_ids.sort(1).values.cpu(), ids.sort(1).values):
        raise RuntimeError("bench_peers: the fp32 router's top-K differs from the designed target ids")
    y = dense_moe(*leaves, K)
    y.backward(g.float())
    ref = dict(y=y.detach(), x=leaves[0].grad)
    ref.update({k: t.grad for k, t in zip(("router", "w_gate", "w_up", "w_down"), leaves[1:])})
    return {k: v.cpu() for k, v in ref.items()}  # kept on the host: out of the measured implementations' peaks


def measure_layer(b: Bench, name: str, impl, x: torch.Tensor, g: torch.Tensor, ref: dict, tol: float) -> dict:
    """Check `impl` against the reference (forward, then forward + backward), then time forward, inference
    forward and forward + backward, and the peak memory of one training step."""
    xg = x.clone().requires_grad_()
    res: dict = {}

    def clear():
        xg.grad = None
        for t in impl_params(impl):
            t.grad = None

    def train_step():
        clear()
        impl(xg).backward(g)

    def fwd():
        return impl(xg)

    def infer():
        with torch.no_grad():
            return impl(x, inference=True)

    y = fwd()
    res["y_err"] = rel_err(y, ref["y"])
    with torch.no_grad():
        res["infer_y_err"] = rel_err(infer(), ref["y"])
    train_step()
    grads = dict(impl.grads(), x=xg.grad)
    res.update({f"d{k}_err": rel_err(grads[k], ref[k]) for k in ("x", "router", "w_gate", "w_up", "w_down")})
    res["ok"] = all(v <= tol for k, v in res.items() if k.endswith("_err"))
    del y, grads
    for mode, fn in (("fwd", fwd), ("infer", infer), ("fwd_bwd", train_step)):
        for _ in range(b.opts["warmup"]):
            fn()
        b.sync()
        res[f"{mode}_ms"] = b.time_ms(fn)
    peak, resident, _ = b.memory(train_step, clear)
    res["peak_gb"], res["step_gb"] = peak, None if peak is None else peak - resident
    if b.cuda:
        kernels = kernel_breakdown(train_step, show=name == "ours", top=None, calls=True)
        res.update(gpu_time_split([(n, ms) for n, ms, _ in kernels]))
        res["combine_local"] = combine_local_bandwidth(kernels, *x.shape, b.opts["K"], x.element_size())
        res["step_gpu_idle"] = gpu_idle(train_step)
    clear()
    b.log(f"layer {name:14s} fwd {res['fwd_ms']:.3f} ms, infer {res['infer_ms']:.3f} ms, fwd+bwd "
          f"{res['fwd_bwd_ms']:.3f} ms; max rel err {max(v for k, v in res.items() if k.endswith('_err')):.2e}")
    return res


# matrix-product kernels (ours, QuACK's/SonicMoE's CuTe GEMMs, cuBLAS) by kernel name; the rest is the
# non-GEMM time of a step (issue 13's target: <= 3 ms for ours at R = 1)
GEMM_KERNEL = re.compile(r"gemm|nvjet|xmma|cublas|cutlass.*sm90.*(tensorop|wgmma)", re.IGNORECASE)


# ours' one-pass combine at R = 1 (csrc_cute/combine.py combine_local): the pull kernel whose first operand is the
# rows themselves (a float tensor; the multi-rank pull's and dispatch's pull's first operands are int64 addresses)
COMBINE_LOCAL_KERNEL = re.compile(r"_pull_kernel_tensorptr(bf16|f16|f32)")


def combine_local_bandwidth(kernels: list[tuple[str, float, int]], S: int, H: int, K: int, itemsize: int
                            ) -> dict | None:
    """ours' combine_local in one profiled step (issue 13: its local passes at >= 80% of HBM bandwidth), from
    `kernels` (name, ms, launches): its launches (a training step runs two, the forward's combine and its
    backward's, of one compile key: one kernel name), the GPU ms of one, the bytes one must move with every
    token routed to K rows (``combine_pull_bytes``) and their GB/s; None where the step ran no such kernel
    (the peers, R > 1)."""
    found = [(ms, n_calls) for n, ms, n_calls in kernels if COMBINE_LOCAL_KERNEL.search(n)]
    if not found:
        return None
    ms, n_calls = sum(m for m, _ in found), sum(c for _, c in found)
    nbytes = combine_pull_bytes(S * K, S, S * K, H * itemsize)
    per_call = ms / n_calls
    return dict(calls=n_calls, ms=round(per_call, 4), bytes=nbytes, gbs=round(nbytes / per_call / 1e6, 1))


def gpu_time_split(kernels: list[tuple[str, float]]) -> dict:
    """One profiled training step's GPU time: total, in GEMM kernels, and the rest, with the largest
    non-GEMM kernels named."""
    gemm = [(n, ms) for n, ms in kernels if GEMM_KERNEL.search(n)]
    other = [(n, ms) for n, ms in kernels if not GEMM_KERNEL.search(n)]
    total = sum(ms for _, ms in kernels)
    gemm_ms = sum(ms for _, ms in gemm)
    return dict(gpu_ms=round(total, 3), gemm_gpu_ms=round(gemm_ms, 3), non_gemm_gpu_ms=round(total - gemm_ms, 3),
                non_gemm_kernels=[(n[:120], ms) for n, ms in other[:12]])


def impl_params(impl) -> list[torch.Tensor]:
    return [p for p in impl.module.parameters() if p.requires_grad]


def layer_inputs(o: dict, device) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """The layer's shared inputs ((x, router_w, w_gate, w_up, w_down, output gradient g), all bf16 on
    `device`) from the seed in `o`, and the target ids the router picks exactly."""
    x, router_w, ids = exact_routing_inputs(o["S"], o["H"], o["E"], o["K"], o["seed"])
    weights = expert_weights(o["E"], o["H"], o["F"], device, o["seed"] + 2)
    g = (torch.randn(o["S"], o["H"], generator=torch.Generator().manual_seed(o["seed"] + 3)) / 4).bfloat16()
    return (x.to(device), router_w.to(device), *weights, g.to(device)), ids


def ours_group(o: dict, device, name: str):
    """The 1-rank EPGroup of implementation `name`: ours (the defaults: the gathered path) or ours_rows
    (gather_rows=False); `o["comm_sms"]` when given."""
    from moonep_ops import EPConfig, EPGroup

    cfg = EPConfig(S=o["S"], H=o["H"], K=o["K"], E=o["E"], F=o["F"], R=1, P=o["P"])
    sms = {} if o.get("comm_sms") is None else dict(comm_sms=o["comm_sms"])
    return EPGroup(cfg, dtype=torch.bfloat16, device=device, timeout_s=600.0,
                   gather_rows=False if name == "ours_rows" else None, **sms)


def layer_section(b: Bench, st: dict, impls: list[str], peers: dict) -> None:
    """Run the layer implementations `impls` (a subset of ours, ours_rows = ours with
    EPGroup(gather_rows=False), torch, torch_compiled, sonicmoe) into st."""
    o = b.opts
    if "inputs" not in st:
        st["inputs"], ids = layer_inputs(o, b.device)
        st["ref"] = layer_reference(*st["inputs"], o["K"], ids)
        st["rows"] = {}
        b.log("layer: inputs and fp32 reference ready (exact routing checked)")
        b.free()
    x, router_w, w_gate, w_up, w_down, g = st["inputs"]
    for name in impls:
        impl = None
        try:
            if name in ("ours", "ours_rows"):
                st["ep"] = ours_group(o, b.device, name)
                impl = OursLayer(st["ep"], router_w, w_gate, w_up, w_down)
                st["ours_symmetric_gb"] = (symmetric_bytes(st["ep"]) or 0) / 2**30
            elif name in ("torch", "torch_compiled"):
                impl = TorchLayer(TorchMoE(router_w, w_gate, w_up, w_down, o["K"]),
                                  o["compile_backend"] if name == "torch_compiled" else None)
            elif name == "sonicmoe":
                impl = SonicLayer(peers["sonicmoe"], router_w, w_gate, w_up, w_down, o["K"])
            st["rows"][name] = measure_layer(b, name, impl, x, g, st["ref"], o["tol"])
        except Exception as e:  # noqa: BLE001  (one implementation's failure is recorded, the run goes on)
            st["rows"][name] = dict(error=short_error(e))
            b.log(f"layer {name}: failed: {short_error(e)}")
            traceback.print_exc()
        del impl
        if name == "torch_compiled":
            torch._dynamo.reset()
        if name in ("ours", "ours_rows") and "ep" in st:
            st.pop("ep").destroy()
        b.free()


# ------------------------------------------------------------------------------------------ gemm
def gemm_operands(ends: torch.Tensor, H: int, F: int, device, seed: int, tokens: int) -> dict:
    """One layout's operands (bf16 unless noted): x [M, H], dy and dy_up [M, F], g_y [M, H], w [G, H, F], w_up
    [G, H, F], w_down [G, F, H], gate/up [M, F], row_w [M] fp32; ends [G] int32 and cu0 [G+1] (0 first); for
    the gathered families x_tok and g_tok [tokens, H] and row_src [M] int32 (token_rows)."""
    G, M = ends.numel(), int(ends[-1])
    gen = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).bfloat16()
    return dict(ends=ends.to(device), cu0=torch.cat([ends.new_zeros(1), ends]).to(device), bounds=starts_ends(ends),
                x=rnd(M, H), dy=rnd(M, F), dy_up=rnd(M, F), g_y=rnd(M, H), w=rnd(G, H, F, scale=H ** -0.5),
                w_up=rnd(G, H, F, scale=H ** -0.5), w_down=rnd(G, F, H, scale=F ** -0.5), gate=rnd(M, F),
                up=rnd(M, F), row_w=torch.rand(M, generator=gen, device=device), x_tok=rnd(tokens, H),
                g_tok=rnd(tokens, H), row_src=token_rows(ends, tokens, gen))


def token_rows(ends: torch.Tensor, tokens: int, gen: torch.Generator) -> torch.Tensor:
    """row_src [M] int32 of the gathered families: row i reads token row_src[i]; every token is read by M / tokens
    rows (rounded), spread over the groups at random, ascending within each group (as the layer's dispatch
    index lays out a group's rows)."""
    M = int(ends[-1])
    src = (torch.arange(M, device=gen.device) % tokens)[torch.randperm(M, generator=gen, device=gen.device)]
    for s, e in starts_ends(ends):
        src[s:e] = src[s:e].sort().values
    return src.int()


def gemm_reference(fam: str, d: dict) -> tuple[torch.Tensor, ...]:
    """fp32 per-group matmuls of family `fam` (the outputs every implementation is checked against); a gathered
    family's are its plain family's on the gathered rows."""
    if fam in GATHERED:
        return gemm_reference(fam.removesuffix("_gather"), dict(d, **gathered_operand(fam, d)))
    outs = []
    for gi, (s, e) in enumerate(d["bounds"]):
        if fam == "fwd":
            outs.append(d["x"][s:e].float() @ d["w"][gi].float())
        elif fam == "dgrad":
            outs.append(d["dy"][s:e].float() @ d["w"][gi].float().t())
        elif fam == "dgrad2":
            outs.append(d["dy"][s:e].float() @ d["w"][gi].float().t()
                        + d["dy_up"][s:e].float() @ d["w_up"][gi].float().t())
        elif fam == "wgrad":
            outs.append((d["x"][s:e].float().t() @ d["dy"][s:e].float())[None])
        elif fam == "swiglu":
            xg = d["x"][s:e].float()
            outs.append(Fn.silu(xg @ d["w"][gi].float()) * (xg @ d["w_up"][gi].float()))
        else:
            outs.append(d["g_y"][s:e].float() @ d["w_down"][gi].float().t())
    out = torch.cat(outs)
    if fam != "swiglu_bwd":
        return (out,)
    gf, uf, rw = d["gate"].float(), d["up"].float(), d["row_w"][:, None]
    sg = torch.sigmoid(gf)
    h = gf * sg * uf
    return (rw * out * uf * sg * (1 + gf * (1 - sg)), rw * out * gf * sg, rw * h, (out * h).sum(1))


def gathered_operand(fam: str, d: dict) -> dict:
    """{operand name: its rows read by index from the tokens} of gathered family `fam` (the input of its plain
    family)."""
    operand, tokens = GATHERED[fam]
    return {operand: d[tokens].index_select(0, d["row_src"])}


def gemm_call(impl: str, fam: str, d: dict, P: int, qgi=None):
    """A zero-argument call of family `fam` by `impl` (ours, torch, quack) and a function of its result that
    gives the reference's outputs (same order as gemm_reference). torch's gathered families: index_select into
    a buffer, then its plain call on the buffer."""
    if impl == "torch" and fam in GATHERED:
        operand, tokens = GATHERED[fam]
        buf = torch.empty_like(d[operand])
        plain, outputs = gemm_call(impl, fam.removesuffix("_gather"), dict(d, **{operand: buf}), P, qgi)

        def gather_then_plain():
            torch.index_select(d[tokens], 0, d["row_src"], out=buf)
            return plain()
        return gather_then_plain, outputs
    x_tok, g_tok, row_src = d["x_tok"], d["g_tok"], d["row_src"]
    x, dy, g_y, w, w_up, w_down, ends, cu0 = (d[k] for k in ("x", "dy", "g_y", "w", "w_up", "w_down", "ends", "cu0"))
    gate, up, row_w, dy_up = d["gate"], d["up"], d["row_w"], d["dy_up"]
    G, M, H, F = w.shape[0], x.shape[0], w.shape[1], w.shape[2]
    ops = torch.ops.moonep
    if impl == "ours":
        none_of = {k: v[:0] for k, v in (("w", w), ("w_down", w_down))}
        dw = torch.empty(G, H, F, dtype=x.dtype, device=x.device)
        no_slot = torch.empty(0, H, F, dtype=torch.float32, device=x.device)
        calls = dict(
            fwd=(lambda: ops.group_gemm(x, w, none_of["w"], ends, P), lambda r: (r,)),
            dgrad=(lambda: ops.group_gemm_dgrad(dy, w, none_of["w"], ends, P), lambda r: (r,)),
            dgrad2=(lambda: ops.group_gemm_dgrad2(dy, w, none_of["w"], dy_up, w_up, none_of["w"], ends, P),
                    lambda r: (r,)),
            wgrad=(lambda: ops.group_gemm_wgrad(x, dy, ends, dw, no_slot, P), lambda r: (dw,)),
            swiglu=(lambda: ops.group_gemm_swiglu(x, w, none_of["w"], w_up, none_of["w"], ends, P, True),
                    lambda r: (r[0],)),
            swiglu_bwd=(lambda: ops.group_gemm_swiglu_bwd(g_y, w_down, none_of["w_down"], ends, row_w, gate, up, P),
                        lambda r: tuple(r)),
            swiglu_gather=(lambda: ops.group_gemm_swiglu_gather(x_tok, row_src, w, none_of["w"], w_up, none_of["w"],
                                                                ends, P, True), lambda r: (r[0],)),
            wgrad_gather=(lambda: ops.group_gemm_wgrad_gather(x_tok, row_src, dy, ends, dw, no_slot, P),
                          lambda r: (dw,)),
            swiglu_bwd_gather=(lambda: ops.group_gemm_swiglu_bwd_gather(g_tok, row_src, w_down, none_of["w_down"],
                                                                        ends, row_w, gate, up, P),
                               lambda r: tuple(r)))
    elif impl == "torch":
        w_t, w_cat, wd_t = w.transpose(-1, -2), torch.cat([w, w_up], dim=2), w_down.transpose(-1, -2)

        def swiglu():
            gu = torch._grouped_mm(x, w_cat, offs=ends)
            return Fn.silu(gu[:, :F]) * gu[:, F:], gu[:, :F], gu[:, F:]

        def swiglu_bwd():
            dd = torch._grouped_mm(g_y, wd_t, offs=ends).float()
            gf, uf, rw = gate.float(), up.float(), row_w[:, None]
            sg = torch.sigmoid(gf)
            h = gf * sg * uf
            gh = dd * rw
            return ((gh * uf * sg * (1 + gf * (1 - sg))).to(x.dtype), (gh * gf * sg).to(x.dtype),
                    (h * rw).to(x.dtype), (dd * h).sum(1))
        calls = dict(fwd=(lambda: torch._grouped_mm(x, w, offs=ends), lambda r: (r,)),
                     dgrad=(lambda: torch._grouped_mm(dy, w_t, offs=ends), lambda r: (r,)),
                     dgrad2=(lambda: torch._grouped_mm(dy, w_t, offs=ends).add_(
                         torch._grouped_mm(dy_up, w_up.transpose(-1, -2), offs=ends)), lambda r: (r,)),
                     wgrad=(lambda: torch._grouped_mm(x.t(), dy, offs=ends), lambda r: (r,)),
                     swiglu=(swiglu, lambda r: (r[0],)), swiglu_bwd=(swiglu_bwd, lambda r: tuple(r)))
    elif impl == "quack":
        out_f = torch.empty(M, F, dtype=x.dtype, device=x.device)
        out_h = torch.empty(M, H, dtype=x.dtype, device=x.device)
        dw = torch.empty(G, H, F, dtype=x.dtype, device=x.device)
        w_int = torch.stack([w, w_up], dim=3).reshape(G, H, 2 * F)  # gate/up columns interleaved
        preact = torch.stack([gate, up], dim=2).reshape(M, 2 * F)
        wd_t = w_down.transpose(-1, -2)  # [G, H, F] view: B (K=H, N=F) of the down dgrad
        # the gate/up input gradient as SonicMoE's backward computes it: one GEMM with K = 2F over the
        # interleaved gradient (gemm_dgated's dx layout) and the interleaved weights' transpose
        dy_int = torch.stack([dy, dy_up], dim=2).reshape(M, 2 * F)

        def dgrad2():
            return qgi.gemm(dy_int, w_int.transpose(-1, -2), out_h, cu_seqlens_m=cu0, tuned=False)

        def dgated(a=g_y, a_idx=None):
            dx, h_w, g_rw = qgi.gemm_dgated(a, wd_t, preact, activation="swiglu", colvec_scale=row_w,
                                            colvec_reduce=True, cu_seqlens_m=cu0, A_idx=a_idx, tuned=False)
            return dx[:, 0::2], dx[:, 1::2], h_w, g_rw
        calls = dict(
            fwd=(lambda: qgi.gemm(x, w, out_f, cu_seqlens_m=cu0, tuned=False), lambda r: (out_f,)),
            dgrad=(lambda: qgi.gemm(dy, w.transpose(-1, -2), out_h, cu_seqlens_m=cu0, tuned=False),
                   lambda r: (out_h,)),
            dgrad2=(dgrad2, lambda r: (out_h,)),
            wgrad=(lambda: qgi.gemm(x.t(), dy, dw, cu_seqlens_k=cu0, tuned=False), lambda r: (dw,)),
            swiglu=(lambda: qgi.gemm_gated(x, w_int, activation="swiglu", cu_seqlens_m=cu0, store_preact=True,
                                           tuned=False), lambda r: (r[1],)),
            swiglu_bwd=(dgated, lambda r: tuple(r)),
            swiglu_gather=(lambda: qgi.gemm_gated(x_tok, w_int, activation="swiglu", cu_seqlens_m=cu0, A_idx=row_src,
                                                  store_preact=True, tuned=False), lambda r: (r[1],)),
            wgrad_gather=(lambda: qgi.gemm(x_tok.t(), dy, dw, cu_seqlens_k=cu0, A_idx=row_src, tuned=False),
                          lambda r: (dw,)),
            swiglu_bwd_gather=(lambda: dgated(g_tok, row_src), lambda r: tuple(r)))
    else:
        raise ValueError(f"gemm_call: unknown implementation {impl!r}")
    return calls[fam]


def gemm_flops(fam: str, M: int, H: int, F: int) -> float:
    return 2.0 * M * H * F * (2 if fam.removesuffix("_gather") in ("swiglu", "dgrad2") else 1)


def ours_compile_calls(families: list[str], d: dict, P: int) -> list[jit.CompileCall]:
    """The compile calls of our kernels of the GEMM `families` that are neither in memory nor in the disk cache:
    each family's call (``gemm_call``) in a dry run, which launches nothing."""
    with jit.dry_run() as calls:
        for fam in families:
            gemm_call("ours", fam, d, P)[0]()
    return calls


def gemm_section(b: Bench, st: dict, impls: list[str], peers: dict, timed: bool = True) -> None:
    """Every family x layout for the implementations `impls` (ours, torch, quack) into st["rows"]: each checked
    and warmed, then (`timed`) all timed in rotated rounds (``time_round_robin``); a later call checks and
    times the row's earlier ones again beside the new ones."""
    o = b.opts
    H, F, P = o["H"], o["F"], o["P"]
    if "layouts" not in st:
        st["layouts"] = group_layouts(o["gemm_rows"], o["E"], P, o["S"], o["K"], o["seed"])
        st["rows"] = {}
    qgi = importlib.import_module("quack.gemm_interface") if "quack" in impls else None
    for li, (lname, ends) in enumerate(st["layouts"].items()):
        d = gemm_operands(ends, H, F, b.device, o["seed"] + 10 + li, o["S"])
        M = int(ends[-1])
        families = [f for f in FAMILIES if f in o["families"]]
        if li == 0 and "ours" in impls and b.cuda:  # side by side in child processes, not one by one here
            try:
                jit.compile_ahead(ours_compile_calls(families, d, P))
            except Exception as e:  # noqa: BLE001 - only a speed-up: each kernel still compiles at its first call
                b.log(f"gemm: compiling ours ahead failed ({short_error(e)}); each kernel compiles at its first call")
        for fam in families:
            ref = gemm_reference(fam, d)
            row = st["rows"].setdefault(f"{fam} | {lname}", dict(family=fam, layout=lname, groups=ends.numel(),
                                                                 rows=M, flops=gemm_flops(fam, M, H, F)))
            calls = {}
            for impl in impls:
                try:
                    call, outputs = gemm_call(impl, fam, d, P, qgi)
                    got = outputs(call())
                    err = max(rel_err(a, r) for a, r in zip(got, ref))
                    del got
                    for _ in range(o["warmup"] if timed else 0):  # the timed pass warms its calls itself
                        call()
                    calls[impl] = call
                    row.update({f"{impl}_err": err, f"{impl}_ok": err <= o["tol"]})
                except Exception as e:  # noqa: BLE001  (recorded in the cell, the run goes on)
                    row[f"{impl}_error"] = short_error(e)
                    b.log(f"gemm {fam} {lname} {impl}: failed: {short_error(e)}")
                    traceback.print_exc()
            b.sync()
            if calls and timed:  # in rotated rounds: the implementations share the GPU's clock and power state
                timed_calls, n = calls, 1
                if o["graph"]:  # each timed call replays a CUDA graph of n calls: no host launch cost between them
                    timed_calls, n = {i: graph_of(c, o["graph"]) for i, c in calls.items()}, o["graph"]
                for impl, ms in time_round_robin(timed_calls, lambda c: b.time_ms(c, repeats=1) / n,
                                                 o["repeats"]).items():
                    row.update({f"{impl}_ms": ms, f"{impl}_tflops": row["flops"] / ms / 1e9})
                    b.log(f"gemm {fam:10s} {lname:12s} {impl:6s} {ms:8.3f} ms {row[f'{impl}_tflops']:7.1f} TF/s "
                          f"err {row[f'{impl}_err']:.2e}")
                if o["sustained_s"] > 0:
                    order = rotated(list(calls), len(st["rows"]))
                    runs = run_sustained({i: calls[i] for i in order}, {i: row[f"{i}_ms"] for i in order},
                                         o["sustained_s"], o["idle_s"], cuda=b.cuda)
                    for impl, cell in runs.items():
                        row.update({f"{impl}_{k}": v for k, v in cell.items()})
                        b.log(f"gemm {fam:10s} {lname:12s} {impl:6s} {sustained_text(cell)}")
            del calls
            del ref
        del d
        b.free()


def graph_of(call, n: int):
    """The replay of one CUDA graph of ``n`` back-to-back ``call()`` (captured after a warm call on a side stream;
    each call's outputs freed before the next, so the graph's pool holds about one call's)."""
    def calls():
        for _ in range(n):
            call()
    graph, _ = capture(calls, warm=1)
    return graph.replay


# ------------------------------------------------------------------------------------------ report
def speedup(ours, other):
    """other's time / ours (> 1: ours faster), None unless both ran."""
    return other / ours if isinstance(ours, float) and isinstance(other, float) and ours > 0 else None


def layer_ratios(rows: dict, fwd_flops: float) -> None:
    """rows[impl]["<mode>_tflops"] (GEMM FLOPs of the real rows; backward = 2x forward) and, for every impl but
    ours, rows[impl]["ours_over_<mode>"] = impl's time / ours'."""
    for name, r in rows.items():
        for mode in ("fwd", "infer", "fwd_bwd"):
            ms = r.get(f"{mode}_ms")
            if isinstance(ms, float):
                r[f"{mode}_tflops"] = fwd_flops * (3 if mode == "fwd_bwd" else 1) / ms / 1e9
            if name != "ours":
                r[f"ours_over_{mode}"] = speedup(rows.get("ours", {}).get(f"{mode}_ms"), ms)


def gemm_ratios(rows: dict) -> None:
    """rows[*]["ours_over_<impl>"] = impl's time / ours' (equivalently ours' TFLOP/s / impl's), in the burst; where
    the row was run sustained (--sustained-s), rows[*]["ours_over_<impl>_sustained"] at the power cap, and where
    those runs had clock samples, rows[*]["ours_over_<impl>_cycles"] = impl's M cycles per call there / ours'
    (``common.mcycles``: how much of the time ratio is the kernels' work, not the clocks the cap gave them)."""
    for r in rows.values():
        for impl in ("quack", "torch"):
            r[f"ours_over_{impl}"] = speedup(r.get("ours_ms"), r.get(f"{impl}_ms"))
            if "ours_sustained_ms" in r:
                r[f"ours_over_{impl}_sustained"] = speedup(r["ours_sustained_ms"], r.get(f"{impl}_sustained_ms"))
            if "ours_sustained_mcycles" in r:
                r[f"ours_over_{impl}_cycles"] = speedup(r["ours_sustained_mcycles"],
                                                        r.get(f"{impl}_sustained_mcycles"))


def issue_targets(layer: dict, gemm: dict) -> dict:
    """The one-GPU targets (issue 13) from one run's rows: name -> dict(value, target, met), met None when a
    side did not run. Times as ours / SonicMoE (<= target), peak as ours / SonicMoE's, GEMMs as the lowest
    ours-over-QuACK speed of a family over its layouts (>= 1.0; in the burst, and at the power cap where the rows
    were run with --sustained-s), the profiled step's non-GEMM GPU ms."""
    def target(value, goal, at_most=True):
        met = None if value is None else (value <= goal if at_most else value >= goal)
        return dict(value=value, target=goal, met=met)

    ours, sonic = layer.get("ours", {}), layer.get("sonicmoe", {})

    def over_sonic(impl, key):
        a, b = layer.get(impl, {}).get(key), sonic.get(key)
        return a / b if isinstance(a, float) and isinstance(b, float) and b > 0 else None

    out = {"layer fwd+bwd / sonicmoe": target(over_sonic("ours", "fwd_bwd_ms"), 0.90),
           "layer fwd / sonicmoe": target(over_sonic("ours", "fwd_ms"), 0.95),
           "peak / sonicmoe": target(over_sonic("ours", "peak_gb"), 1.05)}
    if "ours_rows" in layer:  # EPGroup(gather_rows=False), not the default at R = 1
        out["layer fwd+bwd / sonicmoe (rows)"] = target(over_sonic("ours_rows", "fwd_bwd_ms"), 0.90)
    non_gemm = ours.get("non_gemm_gpu_ms")
    out["non-GEMM GPU ms of a step"] = target(non_gemm if isinstance(non_gemm, float) else None, 3.0)
    for fam in dict.fromkeys(r["family"] for r in gemm.values()):
        rows = [r for r in gemm.values() if r["family"] == fam]
        for key, label in (("ours_over_quack", ""), ("ours_over_quack_sustained", " at the power cap")):
            if label and not any(key in r for r in rows):
                continue  # not run sustained (gemm_ratios sets the key, None where QuACK did not run)
            speeds = [r.get(key) for r in rows]
            worst = None if not speeds or None in speeds else min(speeds)
            out[f"{fam} / quack{label} (worst layout)"] = target(worst, 1.0, at_most=False)
    return out


def fmt(v, w: int, p: int) -> str:
    return f"{v:{w}.{p}f}" if isinstance(v, float) else f"{'-':>{w}}"


def cell(r: dict, impl: str, key: str, w: int = 9, p: int = 2) -> str:
    if f"{impl}_error" in r:
        return f"{'ERROR':>{w}}"
    v = r.get(f"{impl}_{key}")
    bad = r.get(f"{impl}_ok") is False
    return f"{'-':>{w}}" if not isinstance(v, float) else f"{v:{w - 1}.{p}f}" + ("!" if bad else " ")


def table(payload: dict) -> list[str]:
    """The printed report: layer rows, GEMM rows, the peers' status; `!` marks a result off the fp32 reference."""
    lines, peers = [], payload["peers"]
    layer = payload.get("layer") or {}
    if layer:
        impls = list(layer)
        lines.append("MoE layer (ms; ours/x = x's time / ours) | " + ", ".join(
            f"{k}={payload[k]}" for k in ("S", "H", "F", "E", "K")))
        lines.append(f"{'mode':>8} | " + " ".join(f"{i:>14}" for i in impls) + " | "
                     + " ".join(f"{'ours/' + i:>14}" for i in impls if i != "ours"))
        for mode in ("fwd", "infer", "fwd_bwd", "fwd_tflops", "fwd_bwd_tflops", "peak_gb", "step_gb"):
            key = mode if mode.endswith(("_gb", "_tflops")) else f"{mode}_ms"
            rat = " ".join(fmt(layer[i].get(f"ours_over_{mode}"), 14, 3) for i in impls if i != "ours")
            lines.append(f"{mode:>8} | " + " ".join(
                f"{'ERROR':>14}" if "error" in layer[i] else fmt(layer[i].get(key), 13, 3)
                + (" " if layer[i].get("ok", True) else "!") for i in impls) + f" | {rat}")
        for i in impls:
            if layer[i].get("gpu_ms") is not None:
                lines.append(f"  {i}: one profiled fwd+bwd step {layer[i]['gpu_ms']:.2f} ms GPU time, GEMM "
                             f"{layer[i]['gemm_gpu_ms']:.2f} ms, non-GEMM {layer[i]['non_gemm_gpu_ms']:.2f} ms")
            comb = layer[i].get("combine_local")
            if comb:
                lines.append(f"  {i}: combine_local {comb['ms']:.3f} ms a pass ({comb['calls']} a step) for "
                             f"{comb['bytes'] / 1e9:.2f} GB: {comb['gbs']:.0f} GB/s")
            idle = layer[i].get("step_gpu_idle")
            if idle:
                lines.append(f"  {i}: 3 steps back to back, per step: enqueued in {idle['enqueue_ms']:.2f} ms (host), "
                             f"GPU span {idle['span_ms']:.2f} ms, busy {idle['busy_ms']:.2f}, "
                             f"idle {idle['idle_ms']:.2f}; longest gaps "
                             + ", ".join(f"{us:.0f} us before {b[:40]}" for us, _, b in idle["longest_gaps"][:3]))
        if payload.get("ours_symmetric_gb") is not None:
            lines.append(f"  ours' symmetric buffers (not in the allocator's peak): {payload['ours_symmetric_gb']:.2f} GB")
        for i in impls:
            if "error" in layer[i]:
                lines.append(f"  {i}: {layer[i]['error']}")
    gemm = payload.get("gemm") or {}
    if gemm:
        impls = [i for i in ("ours", "quack", "torch") if any(f"{i}_ms" in r or f"{i}_error" in r
                                                               for r in gemm.values())]
        lines.append(f"GEMM TFLOP/s (H={payload['H']}, F={payload['F']}; ours/x = x's time / ours)")
        lines.append(f"{'family | layout':>31} | " + " ".join(f"{i:>9}" for i in impls) + " | "
                     + " ".join(f"{'ours/' + i:>11}" for i in impls if i != "ours"))
        for name, r in gemm.items():
            lines.append(f"{name:>31} | " + " ".join(cell(r, i, "tflops", 9, 1) for i in impls) + " | "
                         + " ".join(fmt(r.get(f"ours_over_{i}"), 11, 3) for i in impls if i != "ours"))
        if any("ours_sustained_ms" in r for r in gemm.values()):
            lines.append(f"GEMM ms per call at the power cap (--sustained-s {payload.get('sustained_s')}; "
                         "ours/x = x's time / ours; cycles: x's M SM cycles per call / ours')")
            for name, r in gemm.items():
                lines.append(f"{name:>31} | " + " ".join(cell(r, i, "sustained_ms", 9, 3) for i in impls) + " | "
                             + " ".join(fmt(r.get(f"ours_over_{i}_sustained"), 11, 3) for i in impls if i != "ours")
                             + " | cycles " + " ".join(fmt(r.get(f"ours_over_{i}_cycles"), 6, 3)
                                                       for i in impls if i != "ours"))
        errs = [f"  {n} {i}: {r[f'{i}_error']}" for n, r in gemm.items() for i in impls if f"{i}_error" in r]
        lines += errs
    targets = payload.get("targets") or {}
    if targets:
        lines.append("targets (issue 13): " + "; ".join(
            f"{k} {fmt(t['value'], 1, 3).strip()} (target {t['target']}: "
            f"{ {True: 'met', False: 'missed', None: 'not measured'}[t['met']] })" for k, t in targets.items()))
    lines += [f"section {k} failed: {v}" for k, v in (payload.get("section_errors") or {}).items()]
    lines.append("peers: " + "; ".join(f"{k} {v}" for k, v in peers.items()))
    return lines


def versions(mods: dict) -> dict:
    out = dict(torch=torch.__version__)
    for name in ("cutlass", *PEERS):
        if name in mods:
            out[name] = getattr(mods[name], "__version__", "?")
        elif name == "cutlass" and importlib.util.find_spec("cutlass") is not None:
            out[name] = getattr(importlib.import_module("cutlass"), "__version__", "?")
        else:
            out[name] = None
    return out


# ------------------------------------------------------------------------------------------ main
def run(opts: dict) -> dict:
    """Both phases (ours and torch first, then the peers) of the chosen sections; returns the JSON payload."""
    cuda = opts["device"] == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    workdir = tempfile.mkdtemp(prefix="bench_peers_pg_")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{workdir}/store", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=600))
    b = Bench(0, 1, opts, device, dist.group.WORLD, name="bench_peers")
    b.log(f"S={opts['S']} H={opts['H']} F={opts['F']} E={opts['E']} K={opts['K']} P={opts['P']} bf16 on {device}; "
          f"sections {opts['only']}")
    layer, gemm, errors = {}, {}, {}
    sections = dict(layer=(layer_section, layer), gemm=(gemm_section, gemm))

    def section(name: str, impls: list[str], peers: dict, **kw) -> None:
        """One section for `impls` (those --impls keeps; `kw` to its function); a failure outside the
        per-implementation guards (inputs, the fp32 reference) is recorded and the run goes on."""
        impls = [i for i in impls if i in opts["impls"]]
        if name not in opts["only"] or name in errors or not impls:
            return
        fn, st = sections[name]
        try:
            fn(b, st, impls, peers, **kw)
        except Exception as e:  # noqa: BLE001
            errors[name] = short_error(e)
            b.log(f"{name}: failed: {errors[name]}")
            traceback.print_exc()
        b.free()

    section("layer", ["ours", "ours_rows", "torch", "torch_compiled"], {})
    section("gemm", ["ours", "torch"], {}, timed=False)  # compiled here: importing quack serialises compiles
    mods, status = load_peers(cuda)
    b.log("peers: " + "; ".join(f"{k} {v}" for k, v in status.items()))
    if "sonicmoe" in mods:
        section("layer", ["sonicmoe"], mods)
    section("gemm", ["ours", "torch"] + (["quack"] if "quack" in mods else []), mods)
    dist.destroy_process_group()
    info = dict(run_info(), versions=versions(mods), peers=status, sections=opts["only"], section_errors=errors,
                device=opts["device"],
                smoke=opts["smoke"], tol=opts["tol"], iters=opts["iters"], repeats=opts["repeats"],
                sustained_s=opts["sustained_s"], idle_s=opts["idle_s"], graph=opts["graph"],
                warmup=opts["warmup"], compile_backend=opts["compile_backend"], dtype="bfloat16", R=1,
                comm_sms=opts["comm_sms"],
                **{k: opts[k] for k in ("S", "H", "F", "E", "K", "P", "gemm_rows")})
    rows_l, rows_g = layer.get("rows", {}), gemm.get("rows", {})
    fwd_flops = 6.0 * opts["S"] * opts["K"] * opts["H"] * opts["F"]
    layer_ratios(rows_l, fwd_flops)
    gemm_ratios(rows_g)
    return dict(info, layer=rows_l, gemm=rows_g, ours_symmetric_gb=layer.get("ours_symmetric_gb"),
                layer_fwd_flops=fwd_flops, targets=issue_targets(rows_l, rows_g))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="result dir (default benchmarks/results; smoke: a temp dir)")
    for k, v in dict(S=8192, H=7168, F=2048, E=48, K=8, P=128, gemm_rows=65536).items():
        ap.add_argument(f"--{k.replace('_', '-')}", dest=k, type=int, default=v)
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections ({', '.join(SECTIONS)})")
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma-separated GEMM families")
    ap.add_argument("--iters", type=int, default=5, help="calls per timed repeat")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats (median)")
    ap.add_argument("--warmup", type=int, default=3, help="warm-up calls (compiles and autotuning happen here)")
    ap.add_argument("--tol", type=float, default=3e-2, help="max |got - ref| / max |ref| against fp32")
    ap.add_argument("--compile-backend", default=None, help="torch.compile backend (inductor; smoke: aot_eager)")
    ap.add_argument("--sustained-s", dest="sustained_s", type=float, default=0.0,
                    help="GEMM section: each implementation also launched back to back for about S seconds, its "
                         "time per call at the power cap (common.run_sustained); 0: off")
    ap.add_argument("--idle-s", dest="idle_s", type=float, default=1.0, help="idle seconds before each sustained run")
    ap.add_argument("--graph", type=int, default=0, help="GEMM section: time each call from a CUDA graph of this "
                    "many back-to-back calls (no host launch cost; what remains between two kernels is the GPU's); "
                    "0: eager calls")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated implementations ({', '.join(IMPLS)})")
    ap.add_argument("--comm-sms", type=int, default=None, help="CTAs of our communication kernels (EPGroup.comm_sms; "
                    "default: the EPGroup default)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, no peers")
    args = ap.parse_args(argv)
    if args.smoke:
        apply_smoke_defaults(args, argv, SMOKE)
    if args.graph < 0 or (args.graph and args.smoke):
        ap.error(f"--graph {args.graph}: a number of calls >= 0, and CUDA graphs need the GPU (not with --smoke)")
    args.compile_backend = args.compile_backend or "inductor"
    opts = vars(args)
    opts["only"] = names_option(ap, "--only", args.only, SECTIONS)
    opts["families"] = names_option(ap, "--families", args.families, FAMILIES)
    opts["impls"] = names_option(ap, "--impls", args.impls, IMPLS)
    opts["device"] = "cpu" if args.smoke else "cuda"
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("bench_peers: no CUDA device (use --smoke for the CPU check)")
    t0 = time.perf_counter()
    payload = run(opts)
    payload["wall_s"] = round(time.perf_counter() - t0, 1)
    out_dir = args.out
    if out_dir is None and args.smoke:  # smoke figures are no results: keep them out of benchmarks/results
        out_dir = tempfile.mkdtemp(prefix="bench_peers_smoke_")
    path = write_json("bench_peers.json", payload, out_dir)
    print("wrote", path, f"({payload['wall_s']} s)", flush=True)
    try:
        from benchmarks.plot_results import plot_peers
        plot_peers(path)
        print("wrote", path.replace(".json", ".png"), flush=True)
    except Exception as e:  # noqa: BLE001  (no matplotlib, say: the JSON is written, the table still prints)
        print(f"no PNG: {short_error(e)}", flush=True)
    print("\n".join(table(payload)), flush=True)


if __name__ == "__main__":
    main()
