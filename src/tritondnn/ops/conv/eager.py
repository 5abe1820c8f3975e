"""The eager fast path of ``conv1d/2d/3d``: a call on plain tensors without an epilogue, C,
residual or forced engine whose key (``eager_key``: shapes, strides, dtypes, devices, geometry
arguments, the config version) was validated before skips the argument checks, the autograd
wrapper and the plans' key building, and runs the plans bound for that key (forward, and per
output-gradient layout the data and weight gradients). The general path's plans are shared, so
the arithmetic (and the bits) are the same.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...core.config import config
from ...core.library import PLAIN_TENSORS, eager_tensor, functorch_active, plain_eager, raw_apply
from .autograd import _like_param, epilogue_grads
from .plans import dgrad_plan, forward_plan, wgrad_plan
from .problem import channels_last

# Calls seen before, keyed by ``eager_key``: ``fast(input, weight, bias, grad) -> output``.
programs: dict[tuple, Callable[..., torch.Tensor]] = {}
# Standalone gradient calls seen before (``conv_backward_data`` / ``conv_backward_weight``), keyed
# by ``gradient_key``: ``run(a, b) -> gradient``.
gradient_programs: dict[tuple, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {}


def _int_tuple(value: Any) -> bool:
    """An int, or a tuple of ints or of int pairs: the geometry arguments a key can hold as given
    (floats and bools compare equal to ints, so their exact types must be checked first)."""
    if type(value) is int:
        return True
    return type(value) is tuple and all(
        type(v) is int or (type(v) is tuple and all(type(e) is int for e in v)) for v in value
    )


def eager_key(nd, input, weight, bias, stride, padding, dilation, groups, weight_dtype=None) -> tuple | None:
    """The key of a batched call on plain tensors, or None where the call takes the general path
    (tracing, a functorch transform, a tensor subclass, an unbatched input, a strided bias,
    geometry arguments of other types). ``weight_dtype``: the key of the call with ``weight``
    cast to that dtype (same strides), as autocast would pass it."""
    if not eager_tensor(input) or functorch_active() or type(weight) not in PLAIN_TENSORS:
        return None
    if bias is not None and (type(bias) not in PLAIN_TENSORS or not bias.is_contiguous()):
        return None
    if input.dim() != nd + 2 or type(groups) is not int:
        return None
    if not (_int_tuple(stride) and _int_tuple(dilation) and (type(padding) is str or _int_tuple(padding))):
        return None
    return (
        nd, config.version, input.shape, input.stride(), input.dtype, input.device,
        weight.shape, weight.stride(), weight_dtype or weight.dtype, weight.device,
        None if bias is None else (bias.shape, bias.dtype, bias.device),
        stride, padding, dilation, groups,
    )  # fmt: skip


def gradient_key(kind, a, b, size, stride, padding, dilation, groups, algo) -> tuple | None:
    """The key of a standalone gradient call (``kind`` 'dgrad': a = grad_output, b = weight, size
    = the input's; 'wgrad': a = input, b = grad_output, size = the weight's) on plain, non-empty
    tensors that autograd does not record, or None where it takes the general path."""
    if not (plain_eager(a) and plain_eager(b)) or functorch_active() or type(groups) is not int:
        return None
    if not (a.numel() and b.numel()) or (algo is not None and type(algo) is not str):
        return None
    if type(size) not in (torch.Size, tuple, list) or not all(type(v) is int for v in size):
        return None
    if not (_int_tuple(stride) and _int_tuple(dilation) and (type(padding) is str or _int_tuple(padding))):
        return None
    return (
        kind, config.version, a.shape, a.stride(), a.dtype, a.device, b.shape, b.stride(), b.dtype, b.device,
        tuple(size), stride, padding, dilation, groups, algo,
    )  # fmt: skip


def gradient_program(kind, a, b, size, stride, pad_pre, dilation, groups, algo):
    """``run(a, b)`` for a validated ``gradient_key``'s calls: the plan the general path runs."""
    if kind == "wgrad":
        return wgrad_plan(a, b, list(size), stride, pad_pre, dilation, groups, algo)
    plan = dgrad_plan(
        a, b, None, None, None, list(size), stride, pad_pre, dilation, groups, -1, False, a.dtype,
        channels_last(a), algo,
    )  # fmt: skip
    return lambda dy, w: plan(dy, w, None, None, None, 1.0, 0.0, 0.0, 0.0)[0]


class _EagerConv(torch.autograd.Function):
    """``_ConvFunction`` without an epilogue, for the fast path: ``program`` (see
    ``eager_program``) runs the bound plans forward and backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, program):
        ctx.save_for_backward(x, weight)
        ctx.program = program
        return program[0](x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_bias = ctx.needs_input_grad[:3]
        return (*ctx.program[1](dy, x, weight, need_x, need_w, need_bias), None)


_apply_eager = raw_apply(_EagerConv)


def eager_program(x, weight, bias, geometry) -> Callable[..., torch.Tensor] | None:
    """``fast(input, weight, bias, grad) -> output`` for the calls of a validated call's key, with
    ``geometry`` = (stride, pad_pre, pad_post, dilation, groups) as the general path normalized
    it; None for an empty input or weight (the general path's zero-filled gradients)."""
    if not x.numel() or not weight.numel():
        return None
    stride, pad_pre, pad_post, dilation, groups = geometry
    last = channels_last(x)
    bias_dtype = None if bias is None else bias.dtype
    run_forward = forward_plan(
        x, weight, bias, None, None, stride, pad_pre, pad_post, dilation, groups, -1, False, x.dtype, None
    )
    # (config version, output gradient's shape and strides) -> (data-gradient run, weight-gradient run)
    gradient_runs: dict[tuple, tuple[Callable[..., Any], Callable[..., Any]]] = {}

    def forward(x, weight, bias):
        return run_forward(x, weight, bias, None, None, 1.0, 1.0, 0.0, 0.0)[0]

    def backward(dy, x, weight, need_x, need_w, need_bias, weight_grad_dtype=None):
        """(dx, dw, dbias); dw in ``weight_grad_dtype`` where given (a master weight's, when
        ``weight`` is its low-precision cast), else weight's."""
        d, dbias = epilogue_grads(dy, None, -1, 0.0, 0.0, need_bias, bias_dtype, last)
        key = (config.version, d.shape, d.stride(), d.dtype, weight_grad_dtype)
        runs = gradient_runs.get(key)
        if runs is None:
            size = list(x.shape)
            runs = gradient_runs[key] = (
                dgrad_plan(d, weight, None, None, None, size, stride, pad_pre, dilation, groups, -1, False,
                           x.dtype, last, None),
                wgrad_plan(x, d, list(weight.shape), stride, pad_pre, dilation, groups, None,
                           weight_grad_dtype),
            )  # fmt: skip
        dx = runs[0](d, weight, None, None, None, 1.0, 0.0, 0.0, 0.0)[0] if need_x else None
        dw = _like_param(runs[1](x, d), weight) if need_w else None
        return dx, dw, dbias

    program = (forward, backward)

    def fast(x, weight, bias, grad):
        if grad:
            return _apply_eager(x, weight, bias, program)
        return forward(x, weight, bias)

    fast.program = program  # for fused callers that run it inside an autograd node of their own
    return fast
