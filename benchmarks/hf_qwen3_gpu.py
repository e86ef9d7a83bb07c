"""A Hugging Face Qwen3-MoE causal LM with moonep's blocks swapped in, on one GPU: trains a few steps and
decodes greedily with one CUDA graph (issue 14's GPU acceptance item).

    python benchmarks/hf_qwen3_gpu.py [--out benchmarks/results/hf_qwen3_gpu.json] [--steps 5 --new-tokens 16]
        [--hidden 1024 --layers 4 --experts 32 --topk 8 --moe-intermediate 512 --vocab 4096 --heads 8]
        [--batch 4 --seq 256 --prompt-len 32]
    python benchmarks/hf_qwen3_gpu.py --smoke      (tiny shapes on the CPU in fp32: the same code path, eager decode)

What runs (random weights from --seed, nothing downloaded; transformers 5.x public API only):
  model    Qwen3MoeForCausalLM(Qwen3MoeConfig(...)) in --dtype on --device; an untouched copy is the reference;
           the other gets `swap_moe_blocks` with an R = 1 EPGroup (no init_process_group: EPGroup makes its own
           1-rank group, nccl on CUDA) whose capacity S = batch * seq covers a training batch; prefill
           (batch * prompt_len tokens) and decode steps (batch tokens) pass fewer, padded to S inside.
  train    --steps AdamW steps on one fixed random token batch (labels = inputs), so the loss must fall.
           Checks: every loss finite; the first-step loss equals the untouched model's on that batch
           (relative --loss-tol, default 2e-2 in bf16, 1e-4 in fp32); the gradients of every swapped layer's
           router and experts are finite and non-zero at every step; the last loss is below the first.
           ms per step: wall clock of each step (synchronised), the first (kernel compiles) reported apart.
  decode   --new-tokens greedy tokens from a random prompt [batch, prompt_len] into a transformers
           StaticCache of prompt_len + new_tokens positions: one prefill forward, then one forward per token
           on static buffers (input token, position, cache position where this transformers takes one):
           the step feeds the last token, takes the argmax, writes it into the generated buffer at its
           position and advances the position, all on the device. `graph`: that step captured ONCE in a
           torch.cuda.CUDAGraph after --graph-warmup eager steps on a side stream (they decode the first
           tokens), then replayed for every remaining token (CUDA only). `eager`: the same step called
           eagerly, from a fresh cache. `hf`: the untouched model holding the trained weights (the swapped
           model's state_dict, HF's layout, loaded into it) decoding with `generate` (greedy, its own cache).
           Checks: graph tokens == eager tokens (the same kernels, one captured); in fp32 also eager == hf.
           In bf16 the hf match count is reported, not checked (other kernels may round differently).
           ms per token: decode steps after the first, back to back, synchronised once.
Writes --out (config, versions, losses, step ms, decode ms/token, token matches, checks, run_info) and prints
a table; exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import math
import os
import statistics
import sys
import time
import traceback

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever downloaded: the config is built here

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import RESULTS, apply_smoke_defaults, capture, run_info, write_json  # noqa: E402
from moonep_ops import EPConfig, EPGroup  # noqa: E402
from moonep_ops.hf import swap_moe_blocks  # noqa: E402

SMOKE = dict(device="cpu", dtype="float32", hidden=32, layers=2, experts=8, topk=2, moe_intermediate=16, vocab=64,
             heads=4, kv_heads=2, head_dim=8, batch=2, seq=8, prompt_len=4, new_tokens=6, steps=3, lr=1e-2, P=16)
DTYPES = dict(bfloat16=torch.bfloat16, float32=torch.float32)
LOSS_TOL = dict(bfloat16=2e-2, float32=1e-4)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(RESULTS, "hf_qwen3_gpu.json"), help="result JSON path")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16", help="model and experts (CUDA: bf16 only)")
    for k, v, h in (("hidden", 1024, "hidden_size"), ("layers", 4, "num_hidden_layers"), ("experts", 32, "num_experts"),
                    ("topk", 8, "num_experts_per_tok"), ("moe_intermediate", 512, "moe_intermediate_size"),
                    ("vocab", 4096, "vocab_size"), ("heads", 8, "num_attention_heads"),
                    ("kv_heads", 4, "num_key_value_heads"), ("head_dim", 128, "head_dim"),
                    ("batch", 4, "sequences per batch (training and decoding)"), ("seq", 256, "training sequence length"),
                    ("prompt_len", 32, "decode prompt length"), ("new_tokens", 16, "greedy tokens decoded"),
                    ("steps", 5, "training steps"), ("graph_warmup", 2, "eager decode steps before the capture"),
                    ("P", 128, "EPConfig.P (row padding per expert group)"), ("seed", 0, "weights and data")):
        ap.add_argument(f"--{k.replace('_', '-')}", dest=k, type=int, default=v, help=h)
    ap.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    ap.add_argument("--loss-tol", type=float, default=None, help="first-step loss rel tol (default by dtype)")
    ap.add_argument("--attn", default="sdpa", help="attn_implementation")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU in fp32 (" +
                    ", ".join(f"{k}={v}" for k, v in SMOKE.items()) + ")")
    args = ap.parse_args(argv)
    if args.smoke:
        apply_smoke_defaults(args, argv, SMOKE)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here (the CPU path: --device cpu --dtype float32, or --smoke)")
    if args.device == "cuda" and args.dtype != "bfloat16":
        ap.error("--device cuda needs --dtype bfloat16 (the CUDA kernels are bf16 only)")
    if args.prompt_len > args.seq:
        ap.error(f"--prompt-len {args.prompt_len} must be <= --seq {args.seq} (the prefill fits the capacity S)")
    if args.new_tokens < args.graph_warmup + 2:
        ap.error(f"--new-tokens must be >= --graph-warmup + 2 = {args.graph_warmup + 2} (the prefill's token, the "
                 f"warm-up steps, at least one replay)")
    if args.steps < 2:
        ap.error("--steps must be >= 2 (the first is the warm-up)")
    if args.loss_tol is None:
        args.loss_tol = LOSS_TOL[args.dtype]
    return args


def hf_config(args):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                          num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                          num_experts=args.experts, num_experts_per_tok=args.topk,
                          moe_intermediate_size=args.moe_intermediate, intermediate_size=4 * args.moe_intermediate,
                          norm_topk_prob=True, max_position_embeddings=max(args.seq, args.prompt_len + args.new_tokens),
                          tie_word_embeddings=False, attn_implementation=args.attn)


def build(args, device: torch.device, dtype: torch.dtype):
    """(untouched reference LM, swapped LM, EPGroup): the same random weights, on device in dtype."""
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(args.seed)
    ref = Qwen3MoeForCausalLM(hf_config(args)).to(device=device, dtype=dtype)
    model = copy.deepcopy(ref)
    cfg = EPConfig(S=args.batch * args.seq, H=args.hidden, K=args.topk, E=args.experts, F=args.moe_intermediate,
                   R=1, P=args.P)
    ep = EPGroup(cfg, dtype=dtype, device=device)
    swap_moe_blocks(model, ep)
    return ref, model, ep


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _moe_grads_ok(model) -> dict[str, bool]:
    """Per swapped layer: its router's and experts' gradients all finite and not all zero."""
    from moonep_ops.hf import HFMoEBlock

    out = {}
    for name, block in model.named_modules():
        if isinstance(block, HFMoEBlock):
            for pname, p in (("gate.weight", block.gate.weight), *((f"experts.{n}", p) for n, p in
                                                                   block.experts.named_parameters())):
                g = p.grad
                out[f"{name}.{pname}"] = g is not None and bool(torch.isfinite(g).all()) and bool(g.abs().sum() > 0)
    return out


def train(args, ref, model, device: torch.device) -> dict:
    """--steps AdamW steps on one fixed random batch; the untouched model's loss on it first."""
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(args.seed + 1))
    ids = ids.to(device)
    with torch.no_grad():
        ref_loss = float(ref(input_ids=ids, labels=ids).loss)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses, step_ms, grads_ok = [], [], {}
    for _ in range(args.steps):
        _sync(device)
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        _sync(device)
        step_ms.append((time.perf_counter() - t) * 1e3)
        losses.append(float(loss.detach()))
        for k, ok in _moe_grads_ok(model).items():  # this step's gradients (the optimizer leaves them)
            grads_ok[k] = grads_ok.get(k, True) and ok
    model.eval()
    return dict(losses=losses, ref_first_loss=ref_loss, first_loss_rel_err=abs(losses[0] - ref_loss) / abs(ref_loss),
                first_step_ms=step_ms[0], step_ms=step_ms[1:], median_step_ms=statistics.median(step_ms[1:]),
                grads_finite_nonzero=grads_ok)


def _forward_kwargs(model) -> tuple[str, bool]:
    """How this transformers' causal LM takes a cache: the argument's name (`cache` from 5.x's rename on,
    `past_key_values` before) and whether it takes `cache_position` (older 5.x: the static cache writes
    there; newer ones count the cached length on the device themselves)."""
    params = inspect.signature(type(model).forward).parameters
    return ("cache" if "cache" in params else "past_key_values"), "cache_position" in params


class GreedyDecoder:
    """Greedy decoding of `model` from `prompt` [b, p] into a transformers StaticCache of p + new_tokens
    positions. The constructor runs the prefill (the first new token); each step() decodes one more on
    static buffers and advances them on the device, so one CUDA graph of step() replays every step.
    `generated` [b, new_tokens] fills in as the steps run."""

    def __init__(self, model, prompt: torch.Tensor, new_tokens: int):
        from transformers import StaticCache

        b, p = prompt.shape
        dev = prompt.device
        self.model, self.prompt_len, self.steps = model, p, new_tokens - 1
        self.cache_arg, takes_cache_position = _forward_kwargs(model)
        self.cache = StaticCache(config=model.config, max_cache_len=p + new_tokens)
        self.generated = torch.zeros(b, new_tokens, dtype=torch.long, device=dev)
        self.token = torch.zeros(b, 1, dtype=torch.long, device=dev)      # the token fed next
        self.position = torch.zeros(b, 1, dtype=torch.long, device=dev)   # its position
        self.cache_position = torch.zeros(1, dtype=torch.long, device=dev) if takes_cache_position else None
        positions = torch.arange(p, device=dev)
        with torch.no_grad():
            logits = self._forward(prompt, positions.expand(b, p), positions if takes_cache_position else None)
        first = logits[:, -1].argmax(-1, keepdim=True)
        self.generated[:, :1] = first
        self.token.copy_(first)
        self.position.fill_(p)
        if self.cache_position is not None:
            self.cache_position.fill_(p)

    def _forward(self, ids, position_ids, cache_position):
        kw = {self.cache_arg: self.cache, "position_ids": position_ids, "use_cache": True}
        if cache_position is not None:
            kw["cache_position"] = cache_position
        return self.model(input_ids=ids, **kw).logits

    def step(self) -> None:
        with torch.no_grad():
            logits = self._forward(self.token, self.position, self.cache_position)
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            self.generated.scatter_(1, self.position - (self.prompt_len - 1), nxt)
            self.token.copy_(nxt)
            self.position.add_(1)
            if self.cache_position is not None:
                self.cache_position.add_(1)


def _timed(fn, n: int, device: torch.device) -> float:
    """ms per call of n back-to-back calls, synchronised once."""
    _sync(device)
    t = time.perf_counter()
    for _ in range(n):
        fn()
    _sync(device)
    return (time.perf_counter() - t) * 1e3 / n


def decode_eager(model, prompt: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, float]:
    dec = GreedyDecoder(model, prompt, new_tokens)
    dec.step()  # the first step at the decode shapes, untimed
    ms = _timed(dec.step, dec.steps - 1, prompt.device)
    return dec.generated.cpu(), ms


def decode_graph(model, prompt: torch.Tensor, new_tokens: int, warm: int) -> tuple[torch.Tensor, float, int]:
    """The decode step captured once (after `warm` eager steps on a side stream, which decode tokens 1..warm)
    and replayed for the rest: (tokens, ms per replayed token, replays)."""
    dec = GreedyDecoder(model, prompt, new_tokens)
    graph, _ = capture(dec.step, warm)
    replays = dec.steps - warm
    ms = _timed(graph.replay, replays, prompt.device)
    return dec.generated.cpu(), ms, replays


def _matches(a: torch.Tensor, b: torch.Tensor) -> dict:
    """Equal positions, and per sequence the length of the common prefix (greedy decodes part at the first
    difference and then follow different contexts)."""
    same = a == b
    prefix = [int(row.long().cumprod(0).sum()) for row in same]
    return dict(equal=int(same.sum()), total=same.numel(), common_prefix=prefix, identical=bool(same.all()))


def decode(args, ref, model, device: torch.device) -> dict:
    prompt = torch.randint(0, args.vocab, (args.batch, args.prompt_len),
                           generator=torch.Generator().manual_seed(args.seed + 2)).to(device)
    res = {}
    eager, res["eager_ms_per_token"] = decode_eager(model, prompt, args.new_tokens)
    res["tokens_eager"] = eager.tolist()
    if device.type == "cuda":
        try:
            graph, res["graph_ms_per_token"], res["graph_replays"] = decode_graph(model, prompt, args.new_tokens,
                                                                                 args.graph_warmup)
        except Exception:  # a failed capture is a finding to report (which op, which call), then the rest runs
            res["graph"] = "capture or replay failed (graph_error)"
            res["graph_error"] = traceback.format_exc()[-6000:]
            print(res["graph_error"], file=sys.stderr, flush=True)
        else:
            res["graph"] = f"one CUDA graph captured once after {args.graph_warmup} eager warm-up steps, " \
                           f"replayed {res['graph_replays']} times"
            res["tokens_graph"] = graph.tolist()
            res["graph_vs_eager"] = _matches(graph, eager)
    else:
        res["graph"] = "none: CUDA graphs need CUDA (eager decode only)"
    ref.load_state_dict(model.state_dict())  # the trained weights, in HF's layout, into the untouched model
    ref.eval()
    with torch.no_grad():
        out = ref.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=args.new_tokens,
                           do_sample=False, pad_token_id=0)
    hf = out[:, args.prompt_len:].cpu()
    res["tokens_hf"] = hf.tolist()
    res["eager_vs_hf"] = _matches(eager, hf) if hf.shape == eager.shape else dict(identical=False, shape=list(hf.shape))
    return res


def checks_of(args, tr: dict, dec: dict) -> dict[str, bool]:
    grads = tr["grads_finite_nonzero"]
    checks = dict(losses_finite=all(math.isfinite(v) for v in tr["losses"]),
                  first_loss_matches_hf=tr["first_loss_rel_err"] <= args.loss_tol,
                  loss_falls=tr["losses"][-1] < tr["losses"][0],
                  moe_grads_finite_nonzero=bool(grads) and all(grads.values()))
    if args.device == "cuda":
        checks["graph_tokens_equal_eager"] = dec.get("graph_vs_eager", {}).get("identical", False)
    if args.dtype == "float32":
        checks["eager_tokens_equal_hf_generate"] = dec["eager_vs_hf"]["identical"]
    return checks


def report(d: dict) -> None:
    tr, dec = d["train"], d["decode"]
    print(f"transformers {d['transformers']}, torch {d['torch']}, {d['run_info']['gpu']}, {d['device']} {d['dtype']}")
    print(f"  train  losses {' '.join(f'{v:.4f}' for v in tr['losses'])}  (untouched HF first-step loss "
          f"{tr['ref_first_loss']:.4f}, rel err {tr['first_loss_rel_err']:.2e})")
    print(f"         first step {tr['first_step_ms']:.1f} ms (compiles), then {tr['median_step_ms']:.2f} ms/step "
          f"(median of {len(tr['step_ms'])})")
    graph = f"{dec['graph_ms_per_token']:.3f}" if "graph_ms_per_token" in dec else "   -"
    print(f"  decode ms/token: graph {graph}  eager {dec['eager_ms_per_token']:.3f}   [{dec['graph']}]")
    if "graph_vs_eager" in dec:
        m = dec["graph_vs_eager"]
        print(f"         graph vs eager tokens: {m['equal']}/{m['total']} equal")
    m = dec["eager_vs_hf"]
    if "equal" in m:
        print(f"         eager vs HF generate (untouched model, trained weights): {m['equal']}/{m['total']} equal, "
              f"common prefix per sequence {m['common_prefix']}")
    if d["peak_gb"] is not None:
        print(f"  peak memory {d['peak_gb']:.2f} GB (torch.cuda.max_memory_allocated; symmetric buffers apart)")
    for name, ok in d["checks"].items():
        print(f"  {'ok  ' if ok else 'FAIL'} {name}")


def main(argv: list[str] | None = None) -> int:
    import transformers

    args = parse_args(argv)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}", flush=True)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.reset_peak_memory_stats(device)
    ref, model, ep = build(args, device, dtype)
    tr = train(args, ref, model, device)
    dec = decode(args, ref, model, device)
    d = dict(config={k: v for k, v in vars(args).items() if k not in ("out", "smoke")}, smoke=args.smoke,
             device=str(device), dtype=args.dtype, S=ep.cfg.S, transformers=transformers.__version__,
             torch=torch.__version__, train=tr, decode=dec,
             peak_gb=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
             run_info=run_info())
    d["checks"] = checks_of(args, tr, dec)
    path = write_json(os.path.basename(args.out), d, os.path.dirname(os.path.abspath(args.out)))
    report(d)
    print(f"wrote {path}")
    owns = ep.owns_process_group
    ep.destroy()
    if owns:
        dist.destroy_process_group()
    return 0 if all(d["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
