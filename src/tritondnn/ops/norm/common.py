"""What the normalization modules share: fused activation names and argument checks."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import torch
import triton
import triton.language as tl

from ...core.checks import check_tensor
from ...core.launcher import cdiv, launcher
from ...core.numerics import convert
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
    """A weight, bias or running statistic: None, or a float tensor of ``shape`` on ``like``'s
    device. Returned with unit strides, as the kernels read it (a differentiable copy where
    strided; callers that update it in place keep the argument instead)."""
    if value is None:
        return None
    check_tensor(op, name, value)
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"{op}: argument '{name}' has shape {tuple(value.shape)}; expected {tuple(shape)}")
    if value.device != like.device:
        raise ValueError(f"{op}: argument '{name}' is on {value.device} but 'input' is on {like.device}")
    return value.contiguous()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def rows_view(t: torch.Tensor, n_cols: int) -> torch.Tensor:
    """``t`` as (rows, n_cols) with unit column stride: a view where the layout allows (contiguous
    trailing dimensions, mergeable leading ones), a contiguous copy otherwise."""
    if t.dim() == 2 and t.shape[1] == n_cols and t.stride(1) == 1:
        return t  # already rows: skip reshape's dispatch (host time on every call)
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


@triton.jit
def _sum_partials_kernel(
    part_ptr, out_a_ptr, out_b_ptr, n_parts, n_cols,
    TWO: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """out_a[c] = sum over p of part[0, p, c] (and out_b from part[1] when TWO), in out's dtype.
    Each program owns BLOCK_C columns and adds the rows in one fixed order: deterministic."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    rows = tl.arange(0, BLOCK_P)[:, None]
    acc_a = tl.zeros([BLOCK_P, BLOCK_C], part_ptr.dtype.element_ty)
    acc_b = tl.zeros([BLOCK_P, BLOCK_C], part_ptr.dtype.element_ty)
    for p0 in range(0, n_parts, BLOCK_P):
        mask = (p0 + rows < n_parts) & (cols < n_cols)[None, :]
        at = part_ptr + (p0 + rows) * n_cols + cols[None, :]
        acc_a += tl.load(at, mask=mask, other=0.0)
        if TWO:
            acc_b += tl.load(at + n_parts * n_cols, mask=mask, other=0.0)
    tl.store(out_a_ptr + cols, convert(tl.sum(acc_a, 0), out_a_ptr.dtype.element_ty), mask=cols < n_cols)
    if TWO:
        tl.store(out_b_ptr + cols, convert(tl.sum(acc_b, 0), out_b_ptr.dtype.element_ty), mask=cols < n_cols)


_SUM_LAUNCHERS: dict[tuple, Callable[..., None]] = {}


def sum_blocks(n_parts: int, n_cols: int) -> tuple[int, int, int]:
    """(partial rows, columns, warps) of a program of ``sum_partials``: narrow and tall, so that
    many programs each have few loads in a row (the sum is latency-bound). H200, (2, 264, 768)
    and (2, 528, 768) fp32 partials (GPT-2 small's layer norm backward), do_bench medians: 16.6
    and 25.6 us in 64 x 64 blocks of 4 warps, 6.3 and 8.2 in 512 x 8 blocks of 8 warps."""
    block_c = min(8, triton.next_power_of_2(n_cols))
    block_p = max(1, min(triton.next_power_of_2(n_parts), 512))
    return block_p, block_c, max(1, min(8, block_p * block_c // 256))


def sum_partials(part: torch.Tensor, out_a: torch.Tensor, out_b: torch.Tensor | None = None) -> None:
    """The second stage of the parameter-gradient reductions, in one launch: ``out_a`` (any shape
    of C elements, any float dtype) = the sum over p of ``part[0, p, :]``, and ``out_b`` of
    ``part[1]`` when given. ``part`` is a contiguous (1 or 2, P, C) fp32/fp64 buffer. One kernel
    replaces a reduction and a dtype copy per output, and the rows are added in a fixed order."""
    two = out_b is not None
    _, n_parts, n_cols = part.shape
    # The launcher compiles for the first call's dtypes: they belong in the key.
    key = (n_parts, n_cols, part.dtype, out_a.dtype, out_b.dtype if two else None)
    run = _SUM_LAUNCHERS.get(key)
    if run is None:
        block_p, block_c, warps = sum_blocks(n_parts, n_cols)
        run = _SUM_LAUNCHERS[key] = launcher(
            _sum_partials_kernel,
            (cdiv(n_cols, block_c),),
            3,
            (n_parts, n_cols),
            (two, block_p, block_c),
            num_warps=warps,
        )
    run(part, out_a, out_b if two else out_a)
