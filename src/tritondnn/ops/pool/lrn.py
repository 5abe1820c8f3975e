"""Local response normalization across channels (cuDNN's LRN_CROSS_CHANNEL, AlexNet's LRN),
forward and backward, as ``torch.nn.functional.local_response_norm``:

    y[c] = x[c] / scale[c] ** beta,   scale[c] = k + alpha / size * sum(x[c'] ** 2)

over the channels c' = c - size // 2 .. c + (size - 1) // 2 that exist (zero padding). An input
(N, C, *spatial) is read as (N, C, S) with one set of (n, c, s) strides (``ncs_layout``), so
contiguous and channels_last tensors are read in place; tiles of positions x channels coalesce
along whichever is contiguous. The forward saves ``scale`` (fp32) when a backward will follow,
as Caffe does, so the backward reads 3 values per window tap instead of recomputing each window:

    dx[j] = dy[j] * scale[j] ** -beta
            - 2 * alpha * beta / size * x[j] * sum(dy[c] * x[c] * scale[c] ** (-beta - 1))

over the channels c whose window contains j. Powers are exp(log(.)): a non-positive scale
(k <= 0) gives NaN where PyTorch's pow might not.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from ...core.autocast import FP32, autocast_policy
from ...core.checks import check_float, check_tensor
from ...core.engine import Engine, Family, LaunchConfig, Problem
from ...core.launcher import cdiv, launcher
from ...core.library import custom_op
from ...core.numerics import convert
from ..norm.common import dense_ncs, in_layout, ncs_layout
from .common import needs_int64, split_f32, wide
from .kernels import tile

# ---------------------------------------------------------------------------------------------
# Kernels. Element (n, c, s) sits at n * stride_n + c * stride_c + s * stride_s in every tensor
# of a launch. Scalars come as (hi, lo) fp32 pairs (``split_f32``): coef = alpha / size, beta, k.
# SAVE: store the scale (in ACC precision). Tiles are [BLOCK_S positions, BLOCK_C channels].


@triton.jit
def _forward_kernel(
    x_ptr, y_ptr, scale_ptr,
    coef_hi, coef_lo, beta_hi, beta_lo, k_hi, k_lo,
    C, S, size, stride_n, stride_c, stride_s,
    SAVE: tl.constexpr, ACC: tl.constexpr, INDEX_64: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    s, c, n, mask = tile(C, S, INDEX_64, BLOCK_S, BLOCK_C)
    at = n * stride_n + s * stride_s
    squares = tl.zeros([BLOCK_S, BLOCK_C], ACC)
    for d in range(size):
        cc = c - size // 2 + d
        ok = (s < S) & (cc >= 0) & (cc < C)
        v = convert(tl.load(x_ptr + at + cc * stride_c, mask=ok, other=0.0), ACC)
        squares += v * v
    scale = wide(k_hi, k_lo, ACC) + wide(coef_hi, coef_lo, ACC) * squares
    x = convert(tl.load(x_ptr + at + c * stride_c, mask=mask, other=0.0), ACC)
    y = x * tl.exp(-wide(beta_hi, beta_lo, ACC) * tl.log(scale))
    tl.store(y_ptr + at + c * stride_c, convert(y, y_ptr.dtype.element_ty), mask=mask)
    if SAVE:
        tl.store(scale_ptr + at + c * stride_c, scale, mask=mask)


@triton.jit
def _backward_kernel(
    dy_ptr, x_ptr, scale_ptr, dx_ptr,
    coef_hi, coef_lo, beta_hi, beta_lo,
    C, S, size, stride_n, stride_c, stride_s,
    ACC: tl.constexpr, INDEX_64: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Gathers over the channels whose windows contain each element: no atomics."""
    s, c, n, mask = tile(C, S, INDEX_64, BLOCK_S, BLOCK_C)
    at = n * stride_n + s * stride_s
    beta = wide(beta_hi, beta_lo, ACC)
    total = tl.zeros([BLOCK_S, BLOCK_C], ACC)
    for d in range(size):
        cc = c - (size - 1) // 2 + d
        ok = (s < S) & (cc >= 0) & (cc < C)
        off = at + cc * stride_c
        g = convert(tl.load(dy_ptr + off, mask=ok, other=0.0), ACC)
        x = convert(tl.load(x_ptr + off, mask=ok, other=0.0), ACC)
        scale = tl.load(scale_ptr + off, mask=ok, other=1.0)
        total += g * x * tl.exp((-beta - 1.0) * tl.log(scale))
    off = at + c * stride_c
    g = convert(tl.load(dy_ptr + off, mask=mask, other=0.0), ACC)
    x = convert(tl.load(x_ptr + off, mask=mask, other=0.0), ACC)
    scale = tl.load(scale_ptr + off, mask=mask, other=1.0)
    dx = g * tl.exp(-beta * tl.log(scale)) - 2.0 * wide(coef_hi, coef_lo, ACC) * beta * x * total
    tl.store(dx_ptr + off, convert(dx, dx_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------
# Engine.


@dataclasses.dataclass(frozen=True)
class LrnProblem(Problem):
    """One launch over an (N, C, S) view with (n, c, s) strides shared by its tensors."""

    backward: bool
    save: bool
    dtype: str
    n: int
    channels: int
    spatial: int
    size: int
    strides: tuple[int, int, int]
    index_64: bool

    @property
    def acc(self) -> tl.dtype:
        return tl.float64 if self.dtype == "float64" else tl.float32

    @property
    def channels_last(self) -> bool:
        return self.strides[1] == 1 and self.channels > 1


def _describe(input: torch.Tensor, size: int, *_args, backward: bool = False) -> LrnProblem:
    """The problem ``local_response_norm(input, size, ...)`` (or its backward) poses."""
    n, c, s, strides = ncs_layout(torch.empty_like(input))
    name = str(input.dtype).removeprefix("torch.")
    return LrnProblem(backward, backward, name, n, c, s, size, strides, needs_int64(input))


FAMILY: Family[LrnProblem] = Family("lrn", _describe)


@FAMILY.register
class DirectEngine(Engine[LrnProblem]):
    """Each element sums its channel window from [positions x channels] tiles (neighbouring
    channels of a tile share the window loads in cache)."""

    name = "direct"

    def cost(self, problem: LrnProblem) -> float:
        return 1.0

    def configs(self, problem: LrnProblem) -> list[LaunchConfig]:
        c = triton.next_power_of_2(problem.channels)
        s = triton.next_power_of_2(problem.spatial)
        out = []
        for tile_size in (1024, 2048, 512):
            if problem.channels_last:
                block_c = min(c, 64)
                block_s = max(1, min(s, tile_size // block_c))
            else:
                block_s = min(s, tile_size // 4)
                block_c = max(1, min(c, tile_size // block_s))
            config = {"BLOCK_S": block_s, "BLOCK_C": block_c, "num_warps": 4}
            if config not in out:
                out.append(config)
        return out

    def bind(self, problem: LrnProblem, config: LaunchConfig) -> Callable[..., None]:
        p = problem
        block_s, block_c = config["BLOCK_S"], config["BLOCK_C"]
        grid = (p.n * cdiv(p.spatial, block_s) * cdiv(p.channels, block_c),)
        ints = (p.channels, p.spatial, p.size, *p.strides)
        tail = (p.acc, p.index_64, block_s, block_c)
        if p.backward:
            return launcher(_backward_kernel, grid, 4, ints, tail, num_warps=config["num_warps"])
        return launcher(_forward_kernel, grid, 3, ints, (p.save, *tail), num_warps=config["num_warps"])


# ---------------------------------------------------------------------------------------------
# torch.library ops and autograd.


def _scale_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _fake_forward(x, size, alpha, beta, k, save):
    y = torch.empty_like(x)
    return y, torch.empty_like(x, dtype=_scale_dtype(x)) if save else x.new_empty(0, dtype=_scale_dtype(x))


def _plan(backward: bool, save: bool, t: torch.Tensor, size: int, args: tuple) -> Callable[..., None]:
    n, c, s, strides = ncs_layout(t)
    wide64 = needs_int64(t)

    def problem() -> LrnProblem:
        return LrnProblem(backward, save, str(t.dtype).removeprefix("torch."), n, c, s, size, strides, wide64)

    return FAMILY.plan((backward, save, t.dtype, n, c, s, size, strides), problem, lambda: args)


@custom_op(
    "local_response_norm",
    "(Tensor x, int size, float alpha, float beta, float k, bool save) -> (Tensor, Tensor)",
    _fake_forward,
)
def lrn_forward(
    x: torch.Tensor, size: int, alpha: float, beta: float, k: float, save: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y in x's layout, the fp32 scale in y's layout if ``save``, else an empty tensor)."""
    x, y = dense_ncs(x, torch.empty_like(x))
    scale = torch.empty_like(y, dtype=_scale_dtype(x)) if save else x.new_empty(0, dtype=_scale_dtype(x))
    if x.numel() == 0:
        return y, scale
    args = (x, y, scale if save else y, *split_f32(alpha / size), *split_f32(beta), *split_f32(k))
    _plan(False, save, y, size, args)(*args)
    return y, scale


def _fake_backward(dy, x, scale, size, alpha, beta):
    return torch.empty_like(x)


@custom_op(
    "local_response_norm_backward",
    "(Tensor dy, Tensor x, Tensor scale, int size, float alpha, float beta) -> Tensor",
    _fake_backward,
)
def lrn_backward(
    dy: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, size: int, alpha: float, beta: float
) -> torch.Tensor:
    """dx in x's layout, from the scale the forward saved."""
    dx = torch.empty_like(x)
    if x.numel() == 0:
        return dx
    x, dx = dense_ncs(x, dx)
    dy = in_layout(dy, dx)
    if scale.stride() != dx.stride():  # saved in the forward's layout: differs only if x was re-laid
        scale = torch.empty_like(dx, dtype=scale.dtype).copy_(scale)
    args = (dy, x, scale, dx, *split_f32(alpha / size), *split_f32(beta))
    _plan(True, False, dx, size, args)(*args)
    return dx


class _LrnFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, size, alpha, beta, k):
        y, scale = lrn_forward(x, size, alpha, beta, k, True)
        ctx.save_for_backward(x, scale)
        ctx.params = (size, alpha, beta)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, scale = ctx.saved_tensors
        return lrn_backward(dy, x, scale, *ctx.params), None, None, None, None


# PyTorch's autocast: fp32 on CUDA (its pow); on CPU for 4-D and larger inputs (via avg_pool3d).
@autocast_policy(FP32, lambda x: FP32 if x.dim() >= 4 else None)
def local_response_norm(
    input: torch.Tensor, size: int, alpha: float = 1e-4, beta: float = 0.75, k: float = 1.0
) -> torch.Tensor:
    """``F.local_response_norm``: ``x / (k + alpha / size * sum of x**2 over size neighbouring
    channels) ** beta``, channels beyond the edges counting as zeros.

    Args:
        input: (N, C, *spatial) with at least one spatial dimension; fp16/bf16/fp32/fp64,
            contiguous or channels_last (read in place; the output keeps the layout).
        size: the channel window (a positive int).
        alpha, beta, k: finite reals.

    Sums of squares and powers are computed in fp32 (fp64 for fp64). Raises TypeError/ValueError
    for a bad dtype, rank or argument.
    """
    op = "tdnn.local_response_norm"
    check_tensor(op, "input", input, min_ndim=3)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"{op}: argument 'size'={size!r} must be a positive int")
    alpha = check_float(op, "alpha", alpha)
    beta = check_float(op, "beta", beta)
    k = check_float(op, "k", k)
    if input.numel() == 0:
        return input
    if torch.is_grad_enabled() and input.requires_grad:
        return _LrnFunction.apply(input, size, alpha, beta, k)
    return lrn_forward(input, size, alpha, beta, k, False)[0]
