"""The registry of live EP groups: how an op finds the group behind its arguments.

A leaf module (it imports nothing of moonep), so the EP group (`group.py`), the ops (`ops.py`) and the
fake kernels can all use it without importing each other. Three maps, all holding weak references: a
destroyed group leaves nothing alive behind.
- data_ptr of a symmetric buffer -> (its owning EPGroup, int64 [R] peer addresses): `peers`
- data_ptr of a control block -> its EPGroup: `group_of` (the CUDA entry points of the forward ops)
- EPGroup.key -> the group and its static config and row dtype: `group_by_key` (the backward ops,
  which take no buffer, see docs/design-notes.md) and `config_by_key` (their fakes and checks, which
  need the shapes only)
"""

from __future__ import annotations

import weakref

import torch

_PEERS: dict[int, tuple[weakref.ref, torch.Tensor]] = {}
_GROUP_OF_CTRL: dict[int, weakref.ref] = {}
_GROUP_OF_KEY: dict[str, tuple[weakref.ref, object, torch.dtype]] = {}


def add_group(ep) -> None:
    """Register EPGroup `ep` under `ep.key` (with its EPConfig `ep.cfg` and row dtype `ep.dtype`)."""
    _GROUP_OF_KEY[ep.key] = (weakref.ref(ep), ep.cfg, ep.dtype)


def add_ctrl(ep, ctrl: torch.Tensor) -> None:
    """Register `ctrl` as the (symmetric) control block of EPGroup `ep`."""
    _GROUP_OF_CTRL[ctrl.data_ptr()] = weakref.ref(ep)


def add_peers(ep, t: torch.Tensor, addrs: torch.Tensor) -> None:
    """Register the int64 [R] peer addresses `addrs` of symmetric buffer `t`, owned by EPGroup `ep`."""
    _PEERS[t.data_ptr()] = (weakref.ref(ep), addrs)


def remove_buffer(t: torch.Tensor) -> None:
    """Forget buffer `t` (its peer addresses, and the group it is the control block of)."""
    _PEERS.pop(t.data_ptr(), None)
    _GROUP_OF_CTRL.pop(t.data_ptr(), None)


def remove_group(key: str) -> None:
    _GROUP_OF_KEY.pop(key, None)


def peers(op: str, name: str, t: torch.Tensor) -> torch.Tensor:
    """int64 [R] addresses of symmetric buffer `t` on every rank (CUDA ops only)."""
    entry = _PEERS.get(t.data_ptr())
    if entry is None or entry[0]() is None:
        raise ValueError(f"moonep.{op}: {name} must be the symmetric buffer of a live CUDA EPGroup "
                         f"(pass the EPGroup's own buffer, not a copy)")
    return entry[1]


def group_of(op: str, ctrl: torch.Tensor):
    """The CUDA EPGroup whose control block is `ctrl`."""
    ref = _GROUP_OF_CTRL.get(ctrl.data_ptr())
    ep = ref() if ref is not None else None
    if ep is None:
        raise ValueError(f"moonep.{op}: ctrl must be the control block of a live CUDA EPGroup (EPGroup.ctrl)")
    return ep


def _live_entry(op: str, key: str):
    entry = _GROUP_OF_KEY.get(key)
    ep = entry[0]() if entry is not None else None
    if ep is None or ep.ctrl is None:
        raise ValueError(f"moonep.{op}: ep_key={key!r} names no live EPGroup (pass EPGroup.key)")
    return ep, entry[1], entry[2]


def group_by_key(op: str, key: str):
    """The live EPGroup whose `key` is `key`."""
    return _live_entry(op, key)[0]


def config_by_key(op: str, key: str):
    """(EPConfig, row dtype) of the live EPGroup whose `key` is `key`: what the fakes of the backward
    ops size their outputs from."""
    _, cfg, dtype = _live_entry(op, key)
    return cfg, dtype
