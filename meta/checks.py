"""Host-side argument checks shared by the fake kernels and the real implementations."""

from __future__ import annotations

from collections.abc import Sequence

import torch

ROW_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ID_DTYPES = (torch.int32, torch.int64)


def check_tensor(op: str, name: str, t: torch.Tensor, dtypes: Sequence[torch.dtype],
                 shape: Sequence[int | None], device: torch.device | None = None) -> None:
    """`t` must have one of `dtypes`, the given shape (None = any size), be contiguous, and sit on `device`."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"moonep.{op}: {name} must be a Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        want = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"moonep.{op}: {name} must have dtype {want}, got {str(t.dtype).replace('torch.', '')}")
    if t.dim() != len(shape) or any(w is not None and w != s for w, s in zip(shape, t.shape)):
        want = "[" + ", ".join("*" if w is None else str(w) for w in shape) + "]"
        raise ValueError(f"moonep.{op}: {name} must have shape {want}, got {list(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"moonep.{op}: {name} must be contiguous")
    if device is not None and t.device != device:
        raise ValueError(f"moonep.{op}: {name} must be on {device} like the other inputs, got {t.device}")


def check_positive(op: str, **values: int) -> None:
    for name, v in values.items():
        if v < 1:
            raise ValueError(f"moonep.{op}: {name} must be >= 1, got {v}")


def check_pad(op: str, P: int) -> None:
    if P < 16 or P & (P - 1):
        raise ValueError(f"moonep.{op}: P must be a power of two >= 16 (every group length is a multiple "
                         f"of P), got P={P}")


def check_ctrl(op: str, ctrl: torch.Tensor, R: int, E: int, device: torch.device) -> None:
    """The EP group's control block: int32 [control_words(R, E)] on the op's device."""
    from csrc_cute.status import control_words

    check_tensor(op, "ctrl", ctrl, (torch.int32,), (control_words(R, E),), device)
