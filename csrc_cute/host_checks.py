"""Host-side argument checks of the CuTe DSL kernel wrappers: clear ValueErrors naming the argument,
before anything launches (no device reads, no syncs)."""

from __future__ import annotations

import torch


def need_int(name: str, v, lo: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{name} must be an int, got {type(v).__name__}")
    if v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")
    return v


def need_tensor(name: str, t, dtypes, shape=None, ndim=None, device=None, *, placement=True) -> torch.Tensor:
    """Check a tensor argument: dtype in `dtypes`, exact `shape` (None entries: any) or `ndim`; with
    `placement`, also on a CUDA device (the same as `device` if given) and contiguous. `ndim` may be a
    tuple of allowed ranks."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if ndim is None and shape is not None:
        ndim = len(shape)
    if ndim is not None and t.dim() not in (ndim if isinstance(ndim, tuple) else (ndim,)):
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if shape is not None and any(want is not None and got != want for got, want in zip(t.shape, shape)):
        want = tuple("*" if w is None else w for w in shape)
        raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")
    if placement:
        need_placement(name, t, device)
    return t


def need_placement(name: str, t: torch.Tensor, device=None) -> None:
    if t.device.type != "cuda":
        raise ValueError(f"{name} must be on a CUDA device, got {t.device}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device} (the device of the other inputs), got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def need_rank(rank, R: int) -> int:
    """A rank index in [0, R)."""
    rank = need_int("rank", rank, 0)
    if rank >= R:
        raise ValueError(f"rank must be in [0, R={R}), got {rank}")
    return rank


def need_peers(name: str, t, R=None, device=None) -> int:
    """An int64 [R] CUDA tensor of the same buffer's address on every rank -> R."""
    need_tensor(name, t, (torch.int64,), shape=None if R is None else (R,), ndim=1, device=device)
    if t.numel() < 1:
        raise ValueError(f"{name} must hold at least one peer address")
    return t.numel()
