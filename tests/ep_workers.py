"""Per-rank bodies of the multi-process tests (module level, so torch.multiprocessing can spawn them)."""

import torch

from moonep_ops import EPConfig, EPGroup, MoELayer
from moonep_ops.launch import COLLECTIVE_TIMEOUT_S


def global_weights(cfg: EPConfig, skew: str, seed: int = 1):
    """Router and all experts' weights, identical on every rank; inputs of every rank."""
    g = torch.Generator().manual_seed(seed)
    H, E, F = cfg.H, cfg.E, cfg.F
    router = torch.randn(E, H, generator=g) * 0.3
    x_all = torch.randn(cfg.R * cfg.S, H, generator=g)
    if skew == "extreme":  # feature 0 is large and positive for every token, and favours the last experts
        x_all[:, 0] = x_all[:, 0].abs() + 4
        router[:, 0] = torch.linspace(-2, 2, E)
    w_gate = torch.randn(E, H, F, generator=g) / H ** 0.5
    w_up = torch.randn(E, H, F, generator=g) / H ** 0.5
    w_down = torch.randn(E, F, H, generator=g) / F ** 0.5
    grad_out = torch.randn(cfg.R * cfg.S, H, generator=g)
    return x_all, router, w_gate, w_up, w_down, grad_out


def compiling_group(cfg: EPConfig, **kwargs) -> EPGroup:
    """The EPGroup of a worker that torch.compiles on several ranks. A rank compiles in its first
    compiled call (Inductor: tens of seconds, each rank at its own speed on a loaded machine) and only
    then meets its peers in the first op's agreement, where the ranks that compiled sooner wait for it:
    they wait as long as the process group itself does (launch.COLLECTIVE_TIMEOUT_S), not the default
    30 s, so a test does not depend on the compile-time skew between ranks. The timeout path itself is
    tested with short timeouts in tests/test_faults.py."""
    return EPGroup(cfg, timeout_s=COLLECTIVE_TIMEOUT_S, **kwargs)


def build_layer(cfg: EPConfig, rank: int, skew: str, dtype=torch.float32, compiled: bool = False, **group_kwargs):
    """A MoELayer with the weights of `global_weights` (this rank's home experts), this rank's inputs and
    output gradient; `compiled`: the layer will run under torch.compile (see compiling_group);
    `group_kwargs`: EPGroup options."""
    ep = compiling_group(cfg, dtype=dtype, **group_kwargs) if compiled else EPGroup(cfg, dtype=dtype, **group_kwargs)
    layer = MoELayer(ep)
    x_all, router, w_gate, w_up, w_down, grad_out = global_weights(cfg, skew)
    mine = slice(rank * cfg.epn, (rank + 1) * cfg.epn)
    with torch.no_grad():
        layer.router.weight.copy_(router)
        layer.experts.w_gate.copy_(w_gate[mine])
        layer.experts.w_up.copy_(w_up[mine])
        layer.experts.w_down.copy_(w_down[mine])
    tokens = slice(rank * cfg.S, (rank + 1) * cfg.S)
    return layer, x_all[tokens].clone(), grad_out[tokens].clone()


def forward_backward(rank: int, R: int, cfg_kwargs: dict, skews: tuple[str, ...], group_kwargs: dict | None = None):
    """For each skew: this rank's output and every gradient, and the plan it used; and the shapes of what
    the experts' autograd node kept for its backward."""
    cfg = EPConfig(R=R, **cfg_kwargs)
    out = {}
    for skew in skews:
        layer, x, grad_out = build_layer(cfg, rank, skew, **(group_kwargs or {}))
        x.requires_grad_()
        y = layer(x)
        kept = [tuple(t.shape) for t in _experts_node(y).saved_tensors if t is not None]
        y.backward(grad_out)
        out[skew] = dict(y=y.detach(), x=x.grad, router=layer.router.weight.grad, gate=layer.experts.w_gate.grad,
                         up=layer.experts.w_up.grad, down=layer.experts.w_down.grad, counts=layer.last_counts)
        out[skew + " kept"] = kept
    return out


def _experts_node(y: torch.Tensor):
    """The autograd node of the experts (+ combine) Function in y's graph (its gathered form at R = 1)."""
    seen, todo = set(), [y.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        if node.name() in ("_ExpertsCombineBackward", "_ExpertsCombineGatheredBackward"):
            return node
        seen.add(id(node))
        todo.extend(n for n, _ in node.next_functions)
    raise AssertionError("no _ExpertsCombineBackward (or _ExpertsCombineGatheredBackward) node in the graph")


def inference_forward(rank: int, R: int, cfg_kwargs: dict, skews: tuple[str, ...],
                      compiled_skews: tuple[str, ...]):
    """Inference (B < epn, no_grad): per skew this rank's output, eager (and compiled for the skews in
    `compiled_skews`: an inductor compile per rank and skew is most of this worker's time), and how many
    copies the plan read remotely (every rank's, from the plan op itself)."""
    from moonep_ops import ops

    cfg = EPConfig(R=R, **cfg_kwargs)
    out = {}
    for skew in skews:
        layer, x, _ = build_layer(cfg, rank, skew, compiled=skew in compiled_skews)
        with torch.no_grad():
            y = layer(x)
            ids = torch.topk(layer.router(x), cfg.K).indices
            remote = ops.plan(ids, cfg.E, cfg.B, cfg.P, cfg.R, layer.ep.ctrl, layer.ep.group_name)[4]
            compiled = torch.compile(layer, fullgraph=True)(x) if skew in compiled_skews else None
        out[skew] = dict(y=y, compiled=compiled, n_remote=int((remote >= 0).sum()))
    return out


def train_small_B(rank: int, R: int, cfg_kwargs: dict) -> str:
    layer, x, _ = build_layer(EPConfig(R=R, **cfg_kwargs), rank, "extreme")
    try:
        layer(x)
    except RuntimeError as e:
        return str(e)
    return "no error"


def moonep_calls(graph) -> list[str]:
    """moonep ops called by an FX graph, in order (functionalised calls shown as such)."""
    calls = []
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        name = str(n.target)
        if "auto_functionalized" in name:
            calls.append(f"auto_functionalized({n.args[0]})")
        elif name.startswith("moonep."):
            calls.append(name)
    return calls


def compile_and_export(rank: int, R: int, cfg_kwargs: dict, steps: int):
    """torch.compile(fullgraph=True) of forward+loss with backward through AOTAutograd, against eager,
    over steps with different routings; torch.export of the forward."""
    from torch._dynamo.utils import counters

    cfg = EPConfig(R=R, **cfg_kwargs)
    layer, _, _ = build_layer(cfg, rank, "uniform", compiled=True)
    xs = [torch.randn(cfg.S, cfg.H, generator=torch.Generator().manual_seed(100 * rank + i)) * (1 + 3 * i)
          for i in range(steps)]

    def loss_fn(x):
        y = layer(x)
        return y, (y * y).sum()

    def step(fn, x):
        layer.zero_grad()
        x = x.clone().requires_grad_()
        y, loss = fn(x)
        loss.backward()
        return [y.detach(), x.grad, layer.router.weight.grad, layer.experts.w_gate.grad, layer.experts.w_down.grad]

    out = {}
    explain = torch._dynamo.explain(loss_fn)(xs[0])
    out["graph_breaks"] = explain.graph_break_count
    out["graphs"] = explain.graph_count
    torch._dynamo.reset()
    eager = [step(loss_fn, x) for x in xs]
    out["counts"] = []
    for x in xs:
        layer(x)
        out["counts"].append(layer.last_counts.clone())

    counters.clear()
    compiled = torch.compile(loss_fn, fullgraph=True)
    # the graphs Inductor runs (forward, then backward), after its post-grad passes: recorded by the same
    # compile (one Inductor compile of forward and backward per rank, not a second one for the golden)
    graphs = []
    with torch._inductor.config.patch(post_grad_custom_post_pass=lambda g: graphs.append(moonep_calls(g))):
        got = [step(compiled, x) for x in xs]
    out["max_rel_diff"] = max(float((a - b).abs().max() / b.abs().max()) for ge, gc in zip(eager, got)
                              for a, b in zip(ge, gc))
    out["frames"] = counters["stats"]["unique_graphs"]
    out["recompiles"] = sum(counters["recompiles"].values())
    out["graph_ops"] = dict(zip(("forward", "backward"), graphs))
    out["n_inductor_graphs"] = len(graphs)

    exported = torch.export.export(layer, (xs[0],))
    with torch.no_grad():
        out["export_diff"] = float((exported.module()(xs[1]) - layer(xs[1])).abs().max())
    return out


def partial_use(rank: int, R: int, cfg_kwargs: dict):
    """Backward through dispatch when only the rows are used (not the row weights): the collective
    backward ops (gather_row_weights among them) still run on every rank."""
    from moonep_ops import autograd as ag

    cfg = EPConfig(R=R, **cfg_kwargs)
    layer, x, _ = build_layer(cfg, rank, "extreme")
    ep = layer.ep
    x.requires_grad_()
    ids = torch.topk(layer.router(x), cfg.K).indices
    plan = ag.plan(ep, ids)
    route_w = torch.full(ids.shape, 0.5, requires_grad=True)
    dispatched = ag.dispatch(ep, x, route_w, plan)
    # the row weights go unused
    y = layer.experts(dispatched._replace(row_w=torch.ones(dispatched.rows.shape[0])), plan)
    out = ag.combine(ep, y, plan, dispatched)
    out.sum().backward()
    e = layer.experts
    return dict(x=x.grad, gate=e.w_gate.grad, up=e.w_up.grad, down=e.w_down.grad, route_w=route_w.grad)


def baseline_forward_backward(rank: int, R: int, cfg_kwargs: dict, skew: str):
    """The benchmarks' baseline EP path (NCCL/gloo all_to_all + _grouped_mm) on this rank."""
    from benchmarks.baseline_ep import baseline_moe

    cfg = EPConfig(R=R, **cfg_kwargs)
    x_all, router, w_gate, w_up, w_down, grad_out = global_weights(cfg, skew)
    mine, tokens = slice(rank * cfg.epn, (rank + 1) * cfg.epn), slice(rank * cfg.S, (rank + 1) * cfg.S)
    leaves = [t.clone().requires_grad_() for t in (x_all[tokens], router, w_gate[mine], w_up[mine], w_down[mine])]
    y = baseline_moe(*leaves, K=cfg.K, E=cfg.E)
    y.backward(grad_out[tokens])
    return dict(y=y.detach(), x=leaves[0].grad, router=leaves[1].grad, gate=leaves[2].grad, up=leaves[3].grad,
                down=leaves[4].grad)


def model_weights(cfg: EPConfig, n_layers: int):
    """Per layer: (mix [H, H], router, w_gate, w_up, w_down), identical on every rank; inputs of every
    rank and the output gradient."""
    layers = []
    for i in range(n_layers):
        _, router, w_gate, w_up, w_down, _ = global_weights(cfg, "extreme", seed=10 + i)
        mix = torch.randn(cfg.H, cfg.H, generator=torch.Generator().manual_seed(50 + i)) / cfg.H ** 0.5
        layers.append((mix, router, w_gate, w_up, w_down))
    x_all, _, _, _, _, grad_out = global_weights(cfg, "extreme", seed=1)
    return layers, x_all, grad_out


def load_model_weights(model, cfg: EPConfig, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Give a MoEModel the weights of `model_weights` (this rank's home experts); returns every rank's
    inputs and the output gradient."""
    layers, x_all, grad_out = model_weights(cfg, len(model.blocks))
    mine = slice(rank * cfg.epn, (rank + 1) * cfg.epn)
    with torch.no_grad():
        for block, (mix, router, w_gate, w_up, w_down) in zip(model.blocks, layers):
            block.mix.weight.copy_(mix)
            block.moe.router.weight.copy_(router)
            block.moe.experts.w_gate.copy_(w_gate[mine])
            block.moe.experts.w_up.copy_(w_up[mine])
            block.moe.experts.w_down.copy_(w_down[mine])
    return x_all, grad_out


def model_forward_backward(rank: int, R: int, cfg_kwargs: dict, n_layers: int):
    """A MoEModel of n_layers blocks sharing one EPGroup: output and every gradient on this rank."""
    from moonep_ops import MoEModel

    cfg = EPConfig(R=R, **cfg_kwargs)
    model = MoEModel(EPGroup(cfg, dtype=torch.float32), n_layers)
    x_all, grad_out = load_model_weights(model, cfg, rank)
    tokens = slice(rank * cfg.S, (rank + 1) * cfg.S)
    x = x_all[tokens].clone().requires_grad_()
    y = model(x)
    y.backward(grad_out[tokens])
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return dict(y=y.detach(), x=x.grad, grads=grads)


def dense_model_reference(cfg: EPConfig, n_layers: int, ids: list[torch.Tensor] | None = None) -> dict:
    """The dense fp32 model that MoEModel must equal on all ranks' tokens: output, input gradient, and
    every parameter's gradient by MoEModel parameter name (router, norms, mix: the full gradient, which
    the data-parallel ranks' gradients sum to; experts: all E experts, which the ranks' home experts
    concatenate to). `ids`: per layer, the experts [R*S, K] the model under test chose (a bf16 run)."""
    from moonep_ops import dense_moe

    layers, x_all, grad_out = model_weights(cfg, n_layers)
    x = x_all.clone().requires_grad_()
    h, named = x, {}
    for i, (mix, router, w_gate, w_up, w_down) in enumerate(layers):
        norm1, norm2 = torch.nn.RMSNorm(cfg.H), torch.nn.RMSNorm(cfg.H)
        leaves = [t.clone().requires_grad_() for t in (mix, router, w_gate, w_up, w_down)]
        named.update({f"blocks.{i}.norm1.weight": norm1.weight, f"blocks.{i}.mix.weight": leaves[0],
                      f"blocks.{i}.norm2.weight": norm2.weight, f"blocks.{i}.moe.router.weight": leaves[1],
                      f"blocks.{i}.moe.experts.w_gate": leaves[2], f"blocks.{i}.moe.experts.w_up": leaves[3],
                      f"blocks.{i}.moe.experts.w_down": leaves[4]})
        h = h + norm1(h) @ leaves[0].t()
        h = h + dense_moe(norm2(h), *leaves[1:], K=cfg.K, ids=None if ids is None else ids[i])
    h.backward(grad_out)
    return dict(y=h.detach(), x=x.grad, grads={name: t.grad for name, t in named.items()})


def gather_model_grads(per_rank: list[dict]) -> dict:
    """Per-rank MoEModel gradients -> the dense model's: expert weights concatenate, the rest sum."""
    names = per_rank[0].keys()
    return {n: torch.cat([g[n] for g in per_rank]) if ".experts." in n else sum(g[n] for g in per_rank)
            for n in names}


def no_grad_forward(rank: int, R: int, cfg_kwargs: dict):
    """The layer's output under torch.no_grad (no pre-activations kept) and with autograd: equal?"""
    cfg = EPConfig(R=R, **cfg_kwargs)
    layer, x, _ = build_layer(cfg, rank, "extreme")
    y = layer(x.requires_grad_())
    with torch.no_grad():
        y_inference = layer(x)
    return bool(torch.equal(y.detach(), y_inference)) and y.requires_grad and not y_inference.requires_grad


def token_counts(cfg: EPConfig, step: int, rank: int) -> int:
    """Tokens rank `rank` routes at step `step`: rotates over S, 0, 1 and two in between, so that the
    ranks differ within a step and each rank changes between steps."""
    return [cfg.S, 0, 1, cfg.S - 3, cfg.S // 2][(step + 2 * rank) % 5]


def variable_tokens(rank: int, R: int, cfg_kwargs: dict, steps: int):
    """Per step: this rank passes its first token_counts(...) tokens (s <= S); output and every
    gradient. One more step runs the capacity + n_tokens form; it must equal the s form exactly, with
    zero rows (and zero gradients) past n_tokens."""
    cfg = EPConfig(R=R, **cfg_kwargs)
    layer, x_full, grad_full = build_layer(cfg, rank, "extreme")
    out = []
    for step in range(steps):
        s = token_counts(cfg, step, rank)
        layer.zero_grad()
        x = x_full[:s].clone().requires_grad_()
        y = layer(x)
        computed = int((layer.ep.recv_primary >= 0).sum())  # real rows of this rank's receive buffer
        y.backward(grad_full[:s])
        e = layer.experts
        out.append(dict(y=y.detach(), x=x.grad, router=layer.router.weight.grad, gate=e.w_gate.grad.clone(),
                        up=e.w_up.grad.clone(), down=e.w_down.grad.clone(), s=s, computed=computed))
    # the capacity form, with the same token count as the s form's step 0
    s = token_counts(cfg, 0, rank)
    layer.zero_grad()
    x = x_full.clone().requires_grad_()
    y = layer(x, n_tokens=torch.tensor([s], dtype=torch.int32))
    y.backward(torch.cat([grad_full[:s], torch.randn(cfg.S - s, cfg.H)]))  # gradient of absent rows: ignored
    first = out[0]
    # the router's matmul over S rows instead of s may round differently: compare within fp32 rounding
    diff = max(float((a - b).abs().max()) if a.numel() else 0.0 for a, b in (
        (y[:s].detach(), first["y"]), (x.grad[:s], first["x"]), (layer.router.weight.grad, first["router"]),
        (layer.experts.w_gate.grad, first["gate"]), (layer.experts.w_down.grad, first["down"])))
    zero_past = not y[s:].any() and not x.grad[s:].any()
    return dict(steps=out, capacity_form_diff=diff, capacity_form_zero_past=zero_past)


def compiled_token_counts(rank: int, R: int, cfg_kwargs: dict, steps: int):
    """torch.compile(fullgraph=True) of forward+backward with the capacity + n_tokens form over
    `steps` different token counts (tensor n_tokens: 0 recompiles); then torch.compile(dynamic=True)
    with x of changing s (no recompile after the first two shapes); both against eager."""
    from torch._dynamo.utils import counters

    cfg = EPConfig(R=R, **cfg_kwargs)
    layer, x_full, _ = build_layer(cfg, rank, "uniform", compiled=True)

    def loss_count(x, n):
        y = layer(x, n_tokens=n)
        return y, (y * y).sum()

    def loss_s(x):
        y = layer(x)
        return y, (y * y).sum()

    def step(fn, x, *args):
        layer.zero_grad()
        x = x.clone().requires_grad_()
        y, loss = fn(x, *args)
        loss.backward()
        return [y.detach(), x.grad, layer.router.weight.grad, layer.experts.w_gate.grad]

    def max_rel(a, b):
        return max(float((u - v).abs().max() / v.abs().max().clamp(min=1e-30)) for u, v in zip(a, b))

    res = {}
    counts = [(3 * i + rank) % (cfg.S + 1) for i in range(steps)]
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(loss_count, fullgraph=True)
    diffs = []
    for t in counts:
        n = torch.tensor([t], dtype=torch.int32)
        diffs.append(max_rel(step(compiled, x_full, n), step(loss_count, x_full, n)))
    res["count_recompiles"] = sum(counters["recompiles"].values())
    res["count_frames"] = counters["stats"]["unique_graphs"]
    res["count_diff"] = max(diffs)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(loss_s, fullgraph=True, dynamic=True)
    sizes = [cfg.S - 1, 5, 7, cfg.S, 3, 9, 2, cfg.S - 4]
    frames, diffs = [], []
    for s in sizes:
        x = x_full[:s]
        diffs.append(max_rel(step(compiled, x), step(loss_s, x)))
        frames.append(counters["stats"]["unique_graphs"])
    res["dynamic_frames"] = frames
    res["dynamic_recompiles_after_two"] = frames[-1] - frames[1]
    res["dynamic_diff"] = max(diffs)
    return res


def too_many_tokens(rank: int, R: int, cfg_kwargs: dict) -> list[str]:
    """The errors for x past the capacity and a bad n_tokens."""
    cfg = EPConfig(R=R, **cfg_kwargs)
    layer, x, _ = build_layer(cfg, rank, "uniform")
    msgs = []
    for call in (lambda: layer(torch.randn(cfg.S + 1, cfg.H)), lambda: layer(x[:2], n_tokens=1),
                 lambda: layer(x, n_tokens=cfg.S + 1), lambda: layer(x, n_tokens=torch.tensor([1.0]))):
        try:
            call()
            msgs.append("no error")
        except ValueError as e:
            msgs.append(str(e))
    return msgs


def process_facts(rank: int, R: int) -> dict:
    """What a rank process sees of itself: its rank, world size, pid and parent pid."""
    import os

    return dict(rank=rank, R=R, pid=os.getpid(), parent=os.getppid())
