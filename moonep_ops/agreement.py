"""What the ranks of an EP group must agree on, checked instead of trusted (docs/design-notes.md,
"Ranks that disagree or fall out of step").

- The fingerprint: every field of the EPConfig, the row dtype, the device type and the version of the
  ops' cross-rank protocol. `EPGroup` all-gathers it when it is built (a fixed-length int64 vector, so
  drift cannot make the exchange itself mis-sized) and every rank raises a ValueError naming each field
  that differs and every rank's value.
- The op counter (CPU reference ops): every collective op first validates its arguments, then
  all-gathers (op id, counter, rejected?, digest of a table that must be identical everywhere) and
  compares. A rank that skipped or repeated an op meets its peers with another op id or counter: every
  rank raises MoEStatusError(STATUS_OP_MISMATCH) naming each rank's op and counter. A rank whose
  arguments were bad raises its own error and its peers raise MoEStatusError(STATUS_PEER_REJECTED);
  nothing was written anywhere, so all ranks stay in step and may go on. Every wait (the exchange and
  the op's own collectives, through `wait`) is bounded by EPGroup.timeout_s, kept in the control block,
  so a peer that never comes or died fails the others with MoEStatusError(STATUS_TIMEOUT), not the
  process group's timeout. On CUDA the barriers carry the op id instead (csrc_cute/sync.py).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable

import torch
import torch.distributed as dist

from csrc_cute.status import (DEFAULT_TIMEOUT_S, MISMATCH_WORD, OP_COUNT_WORD, OP_IDS, OP_NAMES,
                              STATUS_OP_MISMATCH, STATUS_PEER_REJECTED, STATUS_TIMEOUT, TIMEOUT_MS_WORD)
from .checks import ROW_DTYPES

from .status import MoEStatusError

# Bump when an op's cross-rank protocol (what it exchanges, in which order) changes: ranks running two
# versions of the library then refuse to form a group instead of exchanging mismatched messages.
OPS_VERSION = 1
DEVICE_TYPES = ("cpu", "cuda")
COUNTER_MASK = 0x7FFFFFFF  # the counter is an int32 word of the control block; it wraps

# process-group name -> (op, timeout in s) of the op that last agreed on that group: the op whose own
# collectives `wait` is bounding now (ops on one group run one at a time)
_ACTIVE: dict[str, tuple[str, float]] = {}


def gather_fixed(vec: torch.Tensor, group, timeout_s: float, where: str) -> torch.Tensor:
    """all_gather of a fixed-length int64 vector, waited at most timeout_s -> [R, n] on the CPU."""
    R = dist.get_world_size(group)
    if R == 1:
        return vec[None].cpu()
    every = [torch.empty_like(vec) for _ in range(R)]
    wait(dist.all_gather(every, vec, group=group, async_op=True), timeout_s, where)
    return torch.stack(every).cpu()


def wait(work, timeout_s: float, where: str) -> None:
    """Wait for a collective at most timeout_s; a peer that never arrives or left becomes a named error."""
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:  # gloo: "Operation timed out!", "Connection closed by peer", ...
        raise MoEStatusError(STATUS_TIMEOUT, where, f"a peer did not take part within timeout_s={timeout_s:g} s "
                                                    f"or left the group: {e}") from e


def wait_in_op(work, group) -> None:
    """Wait for a collective inside the op that last agreed on `group` (comm.exchange), bounded by
    that op's timeout."""
    op, timeout_s = _ACTIVE.get(group.group_name, ("collective", DEFAULT_TIMEOUT_S))
    wait(work, timeout_s, f"moonep.{op}")


# ------------------------------------------------------------------------------------- fingerprint
def fingerprint(cfg, dtype: torch.dtype, device: torch.device, recompute_rows: bool = False) -> dict[str, int]:
    """Everything the ranks of one EP group must agree on, as named integers (EPConfig fields as is;
    `recompute_rows` adds a collective to every backward, so it must be the same everywhere)."""
    if dtype not in ROW_DTYPES:
        raise ValueError(f"EPGroup: dtype must be one of {[str(d) for d in ROW_DTYPES]}, got {dtype}")
    return {"ops version": OPS_VERSION, **{f"EPConfig.{f}": getattr(cfg, f) for f in "SHKEFRPB"},
            "dtype": ROW_DTYPES.index(dtype), "device type": DEVICE_TYPES.index(device.type),
            "recompute_rows": int(recompute_rows)}


def _shown(name: str, v: int) -> str:
    if name == "dtype":
        return str(ROW_DTYPES[v]) if 0 <= v < len(ROW_DTYPES) else f"dtype #{v}"
    if name == "device type":
        return DEVICE_TYPES[v] if 0 <= v < len(DEVICE_TYPES) else f"device #{v}"
    if name == "recompute_rows":
        return str(bool(v))
    return str(v)


def check_fingerprint(cfg, dtype: torch.dtype, device: torch.device, group, timeout_s: float,
                      recompute_rows: bool = False) -> None:
    """Raise on every rank if the ranks' fingerprints differ (collective; `EPGroup` calls it)."""
    mine = fingerprint(cfg, dtype, device, recompute_rows)
    if dist.get_world_size(group) == 1:
        # nobody to disagree with; and a 1-rank CUDA group then creates no NCCL communicator at all (its
        # ops synchronise through the control block), which costs start-up time and device memory
        return
    on = device if dist.get_backend(group) == "nccl" else "cpu"
    every = gather_fixed(torch.tensor(list(mine.values()), dtype=torch.int64, device=on), group, timeout_s,
                         "EPGroup()")
    diffs = [f"{name}: " + ", ".join(f"rank {r}: {_shown(name, int(v))}" for r, v in enumerate(every[:, i]))
             for i, name in enumerate(mine) if bool((every[:, i] != every[0, i]).any())]
    if diffs:
        raise ValueError("EPGroup: the ranks disagree on " + "; ".join(diffs)
                         + " (every rank must build its EPGroup with the same EPConfig, dtype and options)")


# ----------------------------------------------------------------------------------- op agreement
def init_ctrl(ctrl: torch.Tensor, timeout_s: float) -> None:
    """Record the group's timeout in its control block (the CPU ops read it from there)."""
    ctrl[TIMEOUT_MS_WORD] = max(1, min(int(timeout_s * 1000), COUNTER_MASK))


def digest(t: torch.Tensor) -> int:
    """An int64 digest of an integer table (equal tables -> equal digests; int64 arithmetic wraps)."""
    flat = t.reshape(-1).long()
    weights = torch.arange(flat.numel(), dtype=torch.long) * 2654435761 + 40503
    return int(((flat + 2) * weights).sum()) ^ (flat.numel() << 40)


def agree(op: str, ctrl: torch.Tensor, group, check: Callable[[], object] | None = None,
          shared: tuple[str, torch.Tensor] | None = None):
    """Validate this rank's arguments (`check`), then agree with every rank of `group` on (op, counter,
    whether everyone accepted its arguments, and the digest of `shared` = (name, table) that must be
    identical everywhere). Returns what `check` returned; raises on every rank if anything differs.
    Collective: every rank's op calls it before it writes anything."""
    if ctrl.dtype != torch.int32 or ctrl.dim() != 1 or ctrl.numel() <= TIMEOUT_MS_WORD:
        raise ValueError(f"moonep.{op}: ctrl must be the EP group's control block (EPGroup.ctrl)")
    error, result = None, None
    try:
        result = check() if check is not None else None
    except Exception as e:  # shared with the peers below, then raised here
        error = e
    counter = int(ctrl[OP_COUNT_WORD])
    timeout_ms = int(ctrl[TIMEOUT_MS_WORD])
    timeout_s = timeout_ms / 1000 if timeout_ms > 0 else DEFAULT_TIMEOUT_S
    ctrl[OP_COUNT_WORD] = (counter + 1) & COUNTER_MASK
    where = f"moonep.{op}"
    mine = torch.tensor([OP_IDS[op], counter, int(error is not None),
                         digest(shared[1]) if shared is not None and error is None else 0], dtype=torch.int64)
    every = gather_fixed(mine, group, timeout_s, where)
    ids, counters, rejected, digests = every.unbind(1)
    if bool((ids != ids[0]).any() | (counters != counters[0]).any()):
        seen = ", ".join(f"rank {r}: {OP_NAMES.get(int(i), f'op #{int(i)}')} (op {int(c)})"
                         for r, (i, c) in enumerate(zip(ids, counters)))
        raise MoEStatusError(STATUS_OP_MISMATCH, where, f"ranks are at different ops: {seen}")
    if error is not None:
        raise error
    if bool(rejected.any()):
        bad = torch.nonzero(rejected).flatten().tolist()
        raise MoEStatusError(STATUS_PEER_REJECTED, where, f"rank(s) {bad} rejected their arguments")
    if shared is not None and bool((digests != digests[0]).any()):
        raise ValueError(f"{where}: {shared[0]} must be identical on every rank (it is the global plan), "
                         f"but the ranks' copies differ (digests {digests.tolist()})")
    _ACTIVE[group.group_name] = (op, timeout_s)
    return result


def barrier_mismatch(ctrl: torch.Tensor, code: int) -> str:
    """What a CUDA barrier recorded with STATUS_OP_MISMATCH: this rank's op and the peer's ('' if none)."""
    if not code & STATUS_OP_MISMATCH:
        return ""
    word = int(ctrl[MISMATCH_WORD])
    ctrl[MISMATCH_WORD] = 0
    mine, theirs = (word >> 16) & 0xFF, word & 0xFF
    return (f"this rank was at a barrier of {OP_NAMES.get(mine, f'op #{mine}')}, a peer at the same epoch "
            f"at one of {OP_NAMES.get(theirs, f'op #{theirs}')}")
