"""Argument validation shared by every family: one message shape for every error.

Messages name the operation, the argument, what was given and what is accepted, e.g.
``tdnn.softmax: argument 'input' has dtype torch.int32; accepted: float16, bfloat16, float32, float64``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import triton
import triton.language as tl

from .backend import DEVICE_TYPE, ON_DEVICE_ATTR, backend
from .launcher import cdiv, launcher

FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _names(dtypes: Sequence[torch.dtype]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_tensor(
    op: str,
    name: str,
    value: object,
    *,
    dtypes: Sequence[torch.dtype] = FLOAT_DTYPES,
    min_ndim: int = 0,
    max_ndim: int | None = None,
) -> torch.Tensor:
    """Check that ``value`` is a tensor of an accepted dtype, on the backend's device, of a valid rank."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{op}: argument '{name}' must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype not in dtypes:
        raise TypeError(f"{op}: argument '{name}' has dtype {value.dtype}; accepted: {_names(dtypes)}")
    if not getattr(value, ON_DEVICE_ATTR):
        raise ValueError(
            f"{op}: argument '{name}' is on device '{value.device}'; the '{backend()}' backend "
            f"runs on {DEVICE_TYPE} tensors"
        )
    if value.ndim < min_ndim or (max_ndim is not None and value.ndim > max_ndim):
        accepted = f"{min_ndim}..{max_ndim}" if max_ndim is not None else f">= {min_ndim}"
        raise ValueError(f"{op}: argument '{name}' has {value.ndim} dimensions; accepted: {accepted}")
    return value


def check_like(op: str, name: str, value: object, ref_name: str, ref: torch.Tensor) -> torch.Tensor:
    """Check that ``value`` is a tensor with the shape and device of ``ref`` (dtype checked by the caller)."""
    tensor = check_tensor(op, name, value)
    if tensor.shape != ref.shape:
        raise ValueError(
            f"{op}: argument '{name}' has shape {tuple(tensor.shape)}; it must match "
            f"'{ref_name}' of shape {tuple(ref.shape)}"
        )
    if tensor.device != ref.device:
        raise ValueError(f"{op}: argument '{name}' is on {tensor.device} but '{ref_name}' is on {ref.device}")
    return tensor


def check_dim(op: str, name: str, dim: object, ndim: int) -> int:
    """Normalize a possibly negative dimension index; a scalar (ndim 0) accepts -1 and 0 as torch does."""
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{op}: argument '{name}' must be an int, got {type(dim).__name__}")
    rank = max(ndim, 1)
    if not -rank <= dim < rank:
        raise ValueError(f"{op}: argument '{name}'={dim} is out of range for a tensor of {ndim} dimensions")
    return dim % rank


def check_float(
    op: str, name: str, value: object, *, positive: bool = False, nonzero: bool = False, finite: bool = True
) -> float:
    """Check a real scalar argument; returns it as a Python float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{op}: argument '{name}' must be a real number, got {type(value).__name__}")
    value = float(value)
    if finite and not math.isfinite(value):
        raise ValueError(f"{op}: argument '{name}'={value} must be finite")
    if positive and not value > 0:
        raise ValueError(f"{op}: argument '{name}'={value} must be > 0")
    if nonzero and value == 0:
        raise ValueError(f"{op}: argument '{name}' must be non-zero")
    return value


def check_choice(op: str, name: str, value: object, choices: Sequence[str]) -> str:
    """Check a string option against its accepted values."""
    if value not in choices:
        raise ValueError(f"{op}: argument '{name}'={value!r}; accepted: {', '.join(map(repr, choices))}")
    return value  # type: ignore[return-value]


def check_dtype(
    op: str, name: str, value: object, dtypes: Sequence[torch.dtype] = FLOAT_DTYPES
) -> torch.dtype:
    """Check a ``dtype=`` argument."""
    if value not in dtypes:
        raise TypeError(f"{op}: argument '{name}'={value}; accepted: {_names(dtypes)}")
    return value  # type: ignore[return-value]


@triton.jit(debug=True)  # debug keeps the assert in the compiled kernel
def _in_range_kernel(x_ptr, n, low, high, MESSAGE: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n, other=low)
    tl.device_assert((x >= low) & (x <= high), MESSAGE)


def check_values(op: str, name: str, t: torch.Tensor, low: int, high: int, what: str) -> None:
    """Every value of the integer tensor ``t`` lies in [low, high].

    A host tensor is read here (ValueError). A device tensor is checked on the device, as PyTorch
    checks device indices: reading it back would stall every call until the GPU caught up (a
    decode step takes ~100 us) and cannot happen during CUDA graph capture. A bad value there is
    a device-side assert naming ``op``, ``name`` and ``what``, reported at the next synchronization.
    """
    if not t.numel():
        return
    if t.device.type == "cpu":
        if int(t.min()) < low or int(t.max()) > high:
            raise ValueError(f"{op}: argument '{name}' has {what} outside [{low}, {high}]")
        return
    flat = t.reshape(-1)
    key = (op, name, what, flat.dtype, flat.numel(), low, high)
    launch = _RANGE_LAUNCHERS.get(key)
    if launch is None:
        block = 1024
        # The limits stay out of the message so that it reads the same for every limit.
        message = f"{op}: argument '{name}' has {what} outside their range"
        launch = launcher(
            _in_range_kernel, (cdiv(flat.numel(), block),), 1, (flat.numel(), low, high), (message, block)
        )
        _RANGE_LAUNCHERS[key] = launch
    launch(flat)


_RANGE_LAUNCHERS: dict[tuple, Callable[..., None]] = {}
