"""What the normalization modules share: fused activation names and argument checks."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch

from ...core.checks import check_tensor
from ..activation import Activation

NO_ACTIVATION = -1

# Activations a norm can fuse after its affine step, with their fixed parameters (p0, p1).
_FUSED = {
    "relu": (Activation.RELU.value, 0.0, math.inf),
    "silu": (Activation.SILU.value, 1.0, 0.0),
    "gelu": (Activation.GELU.value, 0.0, 0.0),
    "gelu_tanh": (Activation.GELU_TANH.value, 0.0, 0.0),
    "sigmoid": (Activation.SIGMOID.value, 0.0, 0.0),
    "tanh": (Activation.TANH.value, 0.0, 0.0),
}


def activation_kind(name: str | None, op: str = "norm") -> tuple[int, float, float]:
    """(kind, p0, p1) of a fused activation name, or NO_ACTIVATION for None."""
    if name is None:
        return NO_ACTIVATION, 0.0, 0.0
    if type(name) is not str or name not in _FUSED:
        raise ValueError(
            f"{op}: argument 'activation'={name!r}; accepted: None, {', '.join(map(repr, _FUSED))}"
        )
    return _FUSED[name]


def check_eps(op: str, eps: object) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"{op}: argument 'eps'={eps!r} must be a finite number > 0")
    return float(eps)


def check_affine(
    op: str, name: str, value: torch.Tensor | None, shape: Sequence[int], like: torch.Tensor
) -> torch.Tensor | None:
    """A weight, bias or running statistic: None, or a float tensor of ``shape`` on ``like``'s device."""
    if value is None:
        return None
    check_tensor(op, name, value)
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"{op}: argument '{name}' has shape {tuple(value.shape)}; expected {tuple(shape)}")
    if value.device != like.device:
        raise ValueError(f"{op}: argument '{name}' is on {value.device} but 'input' is on {like.device}")
    return value


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def rows_view(t: torch.Tensor, n_cols: int) -> torch.Tensor:
    """``t`` as (rows, n_cols) with unit column stride: a view where the layout allows (contiguous
    trailing dimensions, mergeable leading ones), a contiguous copy otherwise."""
    v = t.reshape(-1, n_cols)
    return v if v.stride(-1) == 1 or n_cols == 1 else v.contiguous()


def ncs_layout(x: torch.Tensor) -> tuple[int, int, int, tuple[int, int, int]] | None:
    """(N, C, S, (stride_n, stride_c, stride_s)) when the spatial dimensions merge into one, else None."""
    n, c = x.shape[0], x.shape[1]
    spatial = math.prod(x.shape[2:])
    dims = [(size, st) for size, st in zip(x.shape[2:], x.stride()[2:]) if size != 1]
    stride_s = dims[-1][1] if dims else 1
    for (_outer, outer_st), (inner, inner_st) in itertools.pairwise(dims):
        if outer_st != inner_st * inner:
            return None
    return n, c, spatial, (x.stride(0), x.stride(1), stride_s)


def in_layout(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` with ``like``'s strides (a copy only when they differ)."""
    return t if t.stride() == like.stride() else torch.empty_like(like).copy_(t)


def dense_ncs(x: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, out) in one layout whose spatial dimensions merge into one stride, so a kernel can
    address every tensor of a launch with one set of (n, c, s) strides. ``out`` is
    ``empty_like(x)``: dense, in x's dimension order. Where that order interleaves channels among
    the spatial dimensions (rare permutations), both are made contiguous instead."""
    if ncs_layout(out) is None:
        return x.contiguous(), torch.empty(out.shape, dtype=out.dtype, device=out.device)
    return in_layout(x, out), out


def param_grads(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, need_dw: bool, need_db: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Buffers for the weight and bias gradients, or empty placeholders where none is needed (a
    custom op returns tensors, not None)."""
    dw = torch.empty_like(weight) if need_dw else x.new_empty(0)
    db = torch.empty_like(bias) if need_db else x.new_empty(0)
    return dw, db


def sum_rows(partial: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` (any shape of ``partial.shape[1]`` elements) = the sum of ``partial``'s rows, the
    second stage of the parameter-gradient reductions: one fixed-order reduction, so the same bits
    on every run; written in place when the dtypes agree (one kernel instead of two)."""
    flat = out.view(-1)
    if out.dtype == partial.dtype:
        torch.sum(partial, 0, out=flat)
    else:
        flat.copy_(partial.sum(0))
