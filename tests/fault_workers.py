"""Per-rank bodies of the fault-injection tests (tests/test_faults.py): ranks that disagree or fall out of
step. Each returns, per scenario, what it saw: (exception type, message, seconds from the scenario's start)."""

import os
import time

import torch

from moonep_ops import EPConfig, EPGroup, MoELayer, MoEStatusError, ops

SHAPE = dict(S=8, H=16, K=2, E=4, F=8, P=16)


def outcome(fn) -> tuple[str, str, float]:
    """Run fn() once every rank is ready (a shared machine may start them seconds apart); (exception
    type name or 'ok', message, elapsed s)."""
    torch.distributed.barrier()
    t0 = time.monotonic()
    try:
        fn()
    except Exception as e:  # the test asserts on the type and the message
        return type(e).__name__, str(e), time.monotonic() - t0
    return "ok", "", time.monotonic() - t0


def config_drift(rank: int, R: int, cases: list) -> dict:
    """For each (name, rank 0's config kwargs, rank 1's, rank 0's dtype, rank 1's): build an EPGroup."""
    out = {}
    for name, kw0, kw1, dt0, dt1 in cases:
        kw, dt = (kw0, dt0) if rank == 0 else (kw1, dt1)
        out[name] = outcome(lambda: EPGroup(EPConfig(R=R, **kw), dtype=dt))
    out["recompute_rows"] = outcome(lambda: EPGroup(EPConfig(R=R, **SHAPE), dtype=torch.float32,
                                                    recompute_rows=rank == 0))

    def agreed():
        ep = EPGroup(EPConfig(R=R, **SHAPE), dtype=torch.float32)
        out["default_recompute_rows"] = ep.recompute_rows
        ep.destroy()

    out["agreed"] = outcome(agreed)
    return out


def _layers(timeout_s: float, n: int):
    ep = EPGroup(EPConfig(R=torch.distributed.get_world_size(), **SHAPE), dtype=torch.float32, timeout_s=timeout_s)
    torch.manual_seed(0)  # identical weights on every rank: the scenarios only need the ops to run
    return ep, [MoELayer(ep) for _ in range(n)]


def _x(rank: int, step: int = 0) -> torch.Tensor:
    return torch.randn(SHAPE["S"], SHAPE["H"], generator=torch.Generator().manual_seed(10 * rank + step))


def desync_scenarios(rank: int, R: int, timeout_s: float) -> dict:
    """Rank 0 is the one at fault in each scenario; the group is rebuilt after each desync."""
    out = {}
    ep, (l1, l2) = _layers(timeout_s, 2)

    # a bad argument on rank 0: every rank's plan fails in step; both catch it and go on
    ids = torch.zeros(SHAPE["S"], SHAPE["K"], dtype=torch.int64)
    if rank == 0:
        ids[3, 1] = 99
    out["rejected"] = outcome(lambda: ops.plan(ids, ep.cfg.E, ep.cfg.B, ep.cfg.P, R, ep.ctrl, ep.group_name))
    out["after_rejected"] = outcome(lambda: l2(_x(rank)).sum().backward())

    # rank 0 skips the first layer's forward
    def skip_forward():
        x = _x(rank)
        (l2(x) if rank == 0 else l2(l1(x))).sum().backward()
    out["skip_forward"] = outcome(skip_forward)

    ep.destroy()
    ep, (l1,) = _layers(timeout_s, 1)
    out["rebuilt"] = outcome(lambda: l1(_x(rank)).sum().backward())

    # rank 0 skips a backward and goes on to the next step
    def skip_backward():
        y = l1(_x(rank))
        if rank != 0:
            y.sum().backward()
        l1(_x(rank, 1)).sum().backward()
    out["skip_backward"] = outcome(skip_backward)
    ep.destroy()
    return out


def peer_lost(rank: int, R: int, timeout_s: float, how: str) -> dict:
    """Rank 1 is killed inside dispatch (after the ops agreed: the data exchange is cut) or stalls
    before its forward for longer than the timeout; rank 0 runs a forward."""
    ep, (layer,) = _layers(timeout_s, 1)
    layer(_x(rank))  # one good step first: the time measured below is the fault's, not first-call set-up
    if rank == 1 and how == "killed":
        def die(*args, **kwargs):
            os._exit(1)
        ops.exchange = die  # the CPU dispatch's first data exchange
    elif rank == 1:
        return {how: outcome(lambda: time.sleep(timeout_s + 4))}
    return {how: outcome(lambda: layer(_x(rank)))}


def is_named(result, code_bit: int) -> bool:
    """The scenario ended in a MoEStatusError with this status bit."""
    kind, msg, _ = result
    return kind == MoEStatusError.__name__ and f"status {code_bit:#x}" in msg
