"""Reading the device status word: the one deliberate host sync of the GPU path."""

from __future__ import annotations

import torch

from csrc_cute.status import MESSAGES


class MoEStatusError(RuntimeError):
    """A moonep kernel reported bad input or an inconsistent plan through the status word, or (CPU) the
    ranks' agreement check failed: `code` holds the status bits, `detail` what was seen (which op and
    counter each rank was at, which rank rejected its input)."""

    def __init__(self, code: int, where: str = "", detail: str = ""):
        self.code = code
        self.detail = detail
        reasons = [msg for bit, msg in MESSAGES.items() if code & bit]
        unknown = code & ~sum(MESSAGES)
        if unknown:
            reasons.append(f"unknown status bits {unknown:#x}")
        super().__init__(f"moonep status {code:#x}{' after ' + where if where else ''}: " + "; ".join(reasons)
                         + (f" ({detail})" if detail else ""))


def check_status(status: torch.Tensor, where: str = "", reset: bool = True) -> None:
    """Raise MoEStatusError if any bit of `status` (int32 [1], on any device) is set; clear it if `reset`.

    Syncs the host with the device: call it at step boundaries or in debug runs, not per op.
    """
    code = int(status.reshape(-1)[0])
    if code:
        if reset:
            status.zero_()
        raise MoEStatusError(code, where)
