"""Pooling and resampling: max, average and adaptive pooling (1-D, 2-D, 3-D), local response
normalization across channels, and nearest/linear interpolation, forward and backward.

Signatures follow ``torch.nn.functional``. Inputs are read in place in their own layout
(contiguous, channels_last, sliced), outputs take the input's memory format as PyTorch chooses
it, and accumulation is fp32 (fp64 for fp64 inputs). Every backward gathers per input element
with no atomics: the same bits on every run, in and out of ``tdnn.config.deterministic``.

Files: ``common`` (argument rules, geometry), ``kernels`` and ``pooling`` (pooling kernels,
engines, ops), ``lrn``, ``resample``, ``reference`` (float64 meaning); this module holds the
autograd functions and the public functions.
"""

from __future__ import annotations

import torch

from ...core.autocast import FP32, autocast_policy
from .common import (
    INDEX_NONE,
    channels_last_format,
    check_input,
    check_output_size,
    check_pool_args,
    index_kind,
)
from .lrn import FAMILY as LRN_FAMILY
from .lrn import local_response_norm
from .pooling import FAMILY, pool_backward, pool_forward
from .reference import (
    adaptive_avg_pool_reference,
    adaptive_max_pool_reference,
    avg_pool_reference,
    interpolate_reference,
    local_response_norm_reference,
    max_pool_reference,
)
from .resample import FAMILY as RESAMPLE_FAMILY
from .resample import interpolate

__all__ = [
    "FAMILY",
    "LRN_FAMILY",
    "RESAMPLE_FAMILY",
    "adaptive_avg_pool1d",
    "adaptive_avg_pool2d",
    "adaptive_avg_pool3d",
    "adaptive_avg_pool_reference",
    "adaptive_max_pool1d",
    "adaptive_max_pool2d",
    "adaptive_max_pool3d",
    "adaptive_max_pool_reference",
    "avg_pool1d",
    "avg_pool2d",
    "avg_pool3d",
    "avg_pool_reference",
    "interpolate",
    "interpolate_reference",
    "local_response_norm",
    "local_response_norm_reference",
    "max_pool1d",
    "max_pool2d",
    "max_pool3d",
    "max_pool_reference",
]

IntOrTuple = int | tuple[int, ...]
WithIndices = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


class _PoolFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_size, kernel, stride, padding, dilation, adaptive, is_max, count_pad,
                divisor, index):  # fmt: skip
        y, idx = pool_forward(
            x, output_size, kernel, stride, padding, dilation, adaptive, is_max, count_pad, divisor, index
        )
        ctx.mark_non_differentiable(idx)
        ctx.set_materialize_grads(False)  # no zeros for the indices' (absent) gradient
        ctx.save_for_backward(idx)
        ctx.params = (list(x.shape), kernel, stride, padding, dilation, adaptive, is_max, count_pad, divisor,
                      index, channels_last_format(x))  # fmt: skip
        return y, idx

    @staticmethod
    def backward(ctx, dy, _didx):
        if dy is None:
            return (None,) * 11
        (idx,) = ctx.saved_tensors
        shape, kernel, stride, padding, dilation, adaptive, is_max, count_pad, divisor, index, cl = ctx.params
        dx = pool_backward(
            dy, idx, shape, kernel, stride, padding, dilation, adaptive, is_max, count_pad, divisor, index, cl
        )
        return dx, *([None] * 10)


def _wants_grad(x: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and x.requires_grad


def _run(x, unbatched, return_indices, *args):
    """Forward through autograd when a gradient is wanted; drop the batch dimension if added."""
    if _wants_grad(x):
        y, idx = _PoolFunction.apply(x, *args)
    else:
        y, idx = pool_forward(x, *args)
    if unbatched:
        y, idx = y.squeeze(0), (idx.squeeze(0) if return_indices else idx)
    return (y, idx) if return_indices else y


def _max_pool(op, dims, input, kernel_size, stride, padding, dilation, ceil_mode, return_indices):
    x, unbatched = check_input(op, input, dims)
    kernel, stride_, pad, dil, out = check_pool_args(
        op, x, dims, kernel_size, stride, padding, dilation, ceil_mode
    )
    if not isinstance(return_indices, bool):
        raise TypeError(f"{op}: argument 'return_indices' must be a bool, got {return_indices!r}")
    index = index_kind(return_indices, _wants_grad(x), kernel)
    args = (list(out), list(kernel), list(stride_), list(pad), list(dil), False, True, False, 0, index)
    return _run(x, unbatched, return_indices, *args)


def _avg_pool(op, dims, input, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    x, unbatched = check_input(op, input, dims)
    kernel, stride_, pad, dil, out = check_pool_args(op, x, dims, kernel_size, stride, padding, 1, ceil_mode)
    if not isinstance(count_include_pad, bool):
        raise TypeError(f"{op}: argument 'count_include_pad' must be a bool, got {count_include_pad!r}")
    divisor = 0
    if divisor_override is not None:
        if isinstance(divisor_override, bool) or not isinstance(divisor_override, int):
            raise TypeError(f"{op}: argument 'divisor_override' must be an int, got {divisor_override!r}")
        if divisor_override == 0:
            raise ValueError(f"{op}: argument 'divisor_override' must be non-zero")
        divisor = divisor_override
    args = (list(out), list(kernel), list(stride_), list(pad), list(dil), False, False, count_include_pad,
            divisor, INDEX_NONE)  # fmt: skip
    return _run(x, unbatched, False, *args)


def _adaptive_pool(op, dims, input, output_size, is_max, return_indices):
    x, unbatched = check_input(op, input, dims)
    out = check_output_size(op, output_size, x, dims)
    if not isinstance(return_indices, bool):
        raise TypeError(f"{op}: argument 'return_indices' must be a bool, got {return_indices!r}")
    index = INDEX_NONE
    if is_max:  # a bound of the largest window (ceil(I / O) + 1 taps) decides the index dtype
        bound = [-(-i // o) + (i % o != 0) for i, o in zip(x.shape[2:], out)]
        index = index_kind(return_indices, _wants_grad(x), bound)
    args = (list(out), [], [], [], [], True, is_max, False, 0, index)
    return _run(x, unbatched, return_indices, *args)


# ---------------------------------------------------------------------------------------------
# Public functions. Common to all: inputs (N, C, *spatial) or (C, *spatial), fp16/bf16/fp32/fp64,
# any strides (channels_last read in place); the output takes PyTorch's memory format choice;
# sums accumulate in fp32 (fp64 for fp64); backward passes are deterministic gathers; bad ranks,
# dtypes or arguments raise TypeError/ValueError naming the argument.


def max_pool1d(
    input: torch.Tensor,
    kernel_size: IntOrTuple,
    stride: IntOrTuple | None = None,
    padding: IntOrTuple = 0,
    dilation: IntOrTuple = 1,
    ceil_mode: bool = False,
    return_indices: bool = False,
) -> WithIndices:
    """``F.max_pool1d`` on (N, C, L) or (C, L); see ``max_pool2d``."""
    return _max_pool(
        "tdnn.max_pool1d", 1, input, kernel_size, stride, padding, dilation, ceil_mode, return_indices
    )


def max_pool2d(
    input: torch.Tensor,
    kernel_size: IntOrTuple,
    stride: IntOrTuple | None = None,
    padding: IntOrTuple = 0,
    dilation: IntOrTuple = 1,
    ceil_mode: bool = False,
    return_indices: bool = False,
) -> WithIndices:
    """``F.max_pool2d``: the maximum of each window of ``kernel_size`` taps spaced by ``dilation``,
    windows every ``stride`` (default ``kernel_size``) over the input padded by ``padding`` (at
    most half the kernel) with -inf; ``ceil_mode`` keeps a last partial window.

    Args:
        input: (N, C, H, W) or (C, H, W).
        return_indices: also return int64 indices in PyTorch's convention (the flat position
            within each (n, c) plane), which ``F.max_unpool2d`` accepts.

    A NaN in a window wins (the index is the last NaN's); ties take the first maximum. Without
    ``return_indices`` a training forward saves 1-byte window offsets instead of int64 indices.
    """
    return _max_pool(
        "tdnn.max_pool2d", 2, input, kernel_size, stride, padding, dilation, ceil_mode, return_indices
    )


@autocast_policy(None, FP32)  # PyTorch's CPU autocast runs 3-D pooling in fp32
def max_pool3d(
    input: torch.Tensor,
    kernel_size: IntOrTuple,
    stride: IntOrTuple | None = None,
    padding: IntOrTuple = 0,
    dilation: IntOrTuple = 1,
    ceil_mode: bool = False,
    return_indices: bool = False,
) -> WithIndices:
    """``F.max_pool3d`` on (N, C, D, H, W) or (C, D, H, W); see ``max_pool2d``."""
    return _max_pool(
        "tdnn.max_pool3d", 3, input, kernel_size, stride, padding, dilation, ceil_mode, return_indices
    )


def avg_pool1d(
    input: torch.Tensor,
    kernel_size: IntOrTuple,
    stride: IntOrTuple | None = None,
    padding: IntOrTuple = 0,
    ceil_mode: bool = False,
    count_include_pad: bool = True,
) -> torch.Tensor:
    """``F.avg_pool1d`` on (N, C, L) or (C, L); see ``avg_pool2d``."""
    return _avg_pool(
        "tdnn.avg_pool1d", 1, input, kernel_size, stride, padding, ceil_mode, count_include_pad, None
    )


def avg_pool2d(
    input: torch.Tensor,
    kernel_size: IntOrTuple,
    stride: IntOrTuple | None = None,
    padding: IntOrTuple = 0,
    ceil_mode: bool = False,
    count_include_pad: bool = True,
    divisor_override: int | None = None,
) -> torch.Tensor:
    """``F.avg_pool2d``: the mean of each ``kernel_size`` window, windows every ``stride`` (default
    ``kernel_size``) over the input zero-padded by ``padding`` (at most half the kernel).

    Args:
        input: (N, C, H, W) or (C, H, W).
        count_include_pad: divide by the window's size including padding (cuDNN's
            AVERAGE_COUNT_INCLUDE_PADDING) or by its taps inside the input (EXCLUDE_PADDING).
        divisor_override: divide every window's sum by this non-zero int instead.
    """
    return _avg_pool(
        "tdnn.avg_pool2d",
        2,
        input,
        kernel_size,
        stride,
        padding,
        ceil_mode,
        count_include_pad,
        divisor_override,
    )


@autocast_policy(None, FP32)  # PyTorch's CPU autocast runs 3-D pooling in fp32
def avg_pool3d(
    input: torch.Tensor,
    kernel_size: IntOrTuple,
    stride: IntOrTuple | None = None,
    padding: IntOrTuple = 0,
    ceil_mode: bool = False,
    count_include_pad: bool = True,
    divisor_override: int | None = None,
) -> torch.Tensor:
    """``F.avg_pool3d`` on (N, C, D, H, W) or (C, D, H, W); see ``avg_pool2d``."""
    return _avg_pool(
        "tdnn.avg_pool3d",
        3,
        input,
        kernel_size,
        stride,
        padding,
        ceil_mode,
        count_include_pad,
        divisor_override,
    )


OutputSize = int | tuple[int | None, ...]


def adaptive_max_pool1d(
    input: torch.Tensor, output_size: OutputSize, return_indices: bool = False
) -> WithIndices:
    """``F.adaptive_max_pool1d`` on (N, C, L) or (C, L); see ``adaptive_max_pool2d``."""
    return _adaptive_pool("tdnn.adaptive_max_pool1d", 1, input, output_size, True, return_indices)


def adaptive_max_pool2d(
    input: torch.Tensor, output_size: OutputSize, return_indices: bool = False
) -> WithIndices:
    """``F.adaptive_max_pool2d``: the maximum over PyTorch's adaptive windows (output o covers
    inputs floor(o * I / O) to ceil((o + 1) * I / O) - 1), so ``output_size=1`` is global pooling.

    Args:
        input: (N, C, H, W) or (C, H, W).
        output_size: an int or (H, W) of positive ints, None keeping the input's size.
        return_indices: also return int64 indices, as ``max_pool2d``.
    """
    return _adaptive_pool("tdnn.adaptive_max_pool2d", 2, input, output_size, True, return_indices)


@autocast_policy(None, FP32)  # PyTorch's CPU autocast runs 3-D pooling in fp32
def adaptive_max_pool3d(
    input: torch.Tensor, output_size: OutputSize, return_indices: bool = False
) -> WithIndices:
    """``F.adaptive_max_pool3d`` on (N, C, D, H, W) or (C, D, H, W); see ``adaptive_max_pool2d``."""
    return _adaptive_pool("tdnn.adaptive_max_pool3d", 3, input, output_size, True, return_indices)


def adaptive_avg_pool1d(input: torch.Tensor, output_size: OutputSize) -> torch.Tensor:
    """``F.adaptive_avg_pool1d`` on (N, C, L) or (C, L); see ``adaptive_avg_pool2d``."""
    return _adaptive_pool("tdnn.adaptive_avg_pool1d", 1, input, output_size, False, False)


def adaptive_avg_pool2d(input: torch.Tensor, output_size: OutputSize) -> torch.Tensor:
    """``F.adaptive_avg_pool2d``: the mean over PyTorch's adaptive windows (see
    ``adaptive_max_pool2d``); ``output_size=1`` is global average pooling.

    Args:
        input: (N, C, H, W) or (C, H, W).
        output_size: an int or (H, W) of positive ints, None keeping the input's size.
    """
    return _adaptive_pool("tdnn.adaptive_avg_pool2d", 2, input, output_size, False, False)


@autocast_policy(None, FP32)  # PyTorch's CPU autocast runs 3-D pooling in fp32
def adaptive_avg_pool3d(input: torch.Tensor, output_size: OutputSize) -> torch.Tensor:
    """``F.adaptive_avg_pool3d`` on (N, C, D, H, W) or (C, D, H, W); see ``adaptive_avg_pool2d``."""
    return _adaptive_pool("tdnn.adaptive_avg_pool3d", 3, input, output_size, False, False)
