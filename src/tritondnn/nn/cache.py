"""Per-module caches of the modules' fast paths: a call validated once (by the families' keys and
argument checks) keeps what it ran on the module with its print, the values those checks read,
read again on each call in a few microseconds. A call whose print equals the kept one runs what
was kept; any other goes the validated way and keeps its own.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.autocast import _any_autocast
from ..core.backend import DEVICE_TYPE


class Slot:
    """A module's cached entry (in its ``__dict__``, past ``nn.Module.__setattr__``); copies and
    pickles of the module start empty (the entries hold launchers)."""

    __slots__ = ("entry",)

    def __init__(self) -> None:
        self.entry: tuple | None = None

    def __reduce__(self) -> tuple:
        return Slot, ()

    def __deepcopy__(self, memo: dict) -> Slot:
        return Slot()


def cached(module: torch.nn.Module, name: str) -> tuple | None:
    """The entry kept on ``module`` under ``name``, or None."""
    slot = module.__dict__.get(name)
    return None if slot is None else slot.entry


def store(module: torch.nn.Module, name: str, entry: tuple) -> None:
    """Keep ``entry`` (its print first) on ``module`` under ``name``, in place of the last."""
    slot = module.__dict__.get(name)
    if slot is None:
        slot = module.__dict__[name] = Slot()
    slot.entry = entry  # one assignment: DataParallel's replicas share the slot


def clear(module: torch.nn.Module) -> None:
    """Drop every entry kept on ``module`` (unpatching leaves none behind)."""
    for name in [name for name, value in module.__dict__.items() if type(value) is Slot]:
        del module.__dict__[name]


def tensor_print(t: Any) -> tuple | None:
    """A tensor's part of a print: its type, shape, strides, dtype and device (None for None)."""
    return None if t is None else (type(t), t.shape, t.stride(), t.dtype, t.device)


def autocast_dtype() -> torch.dtype | None:
    """The autocast dtype on the backend's device type, or None where autocast is off there."""
    if _any_autocast() and torch.is_autocast_enabled(DEVICE_TYPE):
        return torch.get_autocast_dtype(DEVICE_TYPE)
    return None
