"""Batch normalization: training (batch statistics, running-statistic updates) and inference,
forward and backward, NCHW and channels_last, with a fused activation (BN + ReLU).

cuDNN splits training batch norm into a statistics pass (its "genstats": per-channel sums) and
a finalize + apply pass; so does this module, so that a distributed wrapper can all-reduce the
sums between the two (``batch_norm_stats`` / ``batch_norm_apply``). The sums are of ``x - shift``
for a per-channel shift near the data (by default one sample of each channel), which keeps the
variance's digits when the mean is large (sum of squares minus squared sum cancels otherwise).

An input (N, C, *spatial) is read as (N, C, S) with strides (n, c, s); rows r = n * S + s and
channels form 2-D tiles, coalesced along whichever of the two is contiguous. Per-channel sums
are reduced in two stages: each program's partial sums, then a fixed-order sum (deterministic).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ...core.checks import check_float, check_like, check_tensor
from ...core.config import config
from ...core.library import PLAIN_TENSORS, custom_op, eager_tensor, functorch_active, raw_apply
from ..activation import _backward as _activation_grad
from ..activation import activation_reference, saves_output
from .batch_engine import _default_shift, _partial_stats, _plan, _stats_dtype, channel_sums
from .common import (
    NO_ACTIVATION,
    activation_kind,
    check_affine,
    check_eps,
    dense_ncs,
    in_layout,
    ncs_layout,
    param_grads,
)

# ---------------------------------------------------------------------------------------------
# 1. Reference.


def batch_norm_reference(
    x: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
    activation: str | None = None,
) -> torch.Tensor:
    """Batch norm (then the activation) in float64; updates the given running statistics."""

    def wide(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.double()

    rm, rv = wide(running_mean), wide(running_var)
    y = F.batch_norm(x.double(), rm, rv, wide(weight), wide(bias), training, momentum, eps)
    if running_mean is not None:
        running_mean.copy_(rm)
        running_var.copy_(rv)
    if activation is not None:
        kind, p0, p1 = activation_kind(activation)
        y = activation_reference(y, kind, p0, p1)
    return y


# ---------------------------------------------------------------------------------------------
# 2. Kernels: batch_kernels.py.


# ---------------------------------------------------------------------------------------------
# 3. Engine: batch_engine.py.


# ---------------------------------------------------------------------------------------------
# 4. torch.library ops and autograd.


def _fake_forward(
    x, weight, bias, running_mean, running_var, residual, training, momentum, eps, act, act_p0, act_p1
):
    stats = x.new_empty(x.shape[1], dtype=_stats_dtype(x))
    return torch.empty_like(x), stats, torch.empty_like(stats)


@custom_op(
    "batch_norm",
    "(Tensor x, Tensor? weight, Tensor? bias, Tensor(a!)? running_mean, Tensor(b!)? running_var, "
    "Tensor? residual, bool training, float momentum, float eps, int act, float act_p0, float act_p1) "
    "-> (Tensor, Tensor, Tensor)",
    _fake_forward,
    mutates_args=("running_mean", "running_var"),
)
def _forward(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    residual: torch.Tensor | None,
    training: bool,
    momentum: float,
    eps: float,
    act: int,
    act_p0: float,
    act_p1: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y in x's layout, mean, 1/std per channel): batch statistics in training (the running ones
    updated in place if given), running statistics otherwise; ``residual`` (x's shape and dtype)
    is added before the activation."""
    y = torch.empty_like(x)
    mean = x.new_empty(x.shape[1], dtype=_stats_dtype(x))
    rstd = torch.empty_like(mean)
    if x.numel() == 0:
        return y, mean.fill_(float("nan")), rstd.fill_(float("nan"))
    x, y = dense_ncs(x, y)
    residual = None if residual is None else in_layout(residual, y)
    count = x.numel() // x.shape[1]
    if training:  # statistics (the shift is x[0, :, 0]), finalize and apply in one plan
        update = running_mean is not None
        w, b, r, rm, rv = (
            t if t is not None else x for t in (weight, bias, residual, running_mean, running_var)
        )
        args = (x, w, b, r, rm, rv, y, mean, rstd, count, eps, momentum, act_p0, act_p1)

        def timing_args() -> tuple:  # benchmark mode times on copies of the running statistics
            return (*args[:4], rm.clone(), rv.clone(), *args[6:])

        _plan("forward", x, True, update, weight, bias, act, timing_args, residual)(*args)
    else:  # the running statistics: no partial sums or shift to read
        _finalize_apply(
            x, x, x, weight, bias, running_mean, running_var, y, mean, rstd, count,
            False, momentum, eps, act, act_p0, act_p1, residual,
        )  # fmt: skip
    return y, mean, rstd


def _finalize_apply(
    x, part, shift, weight, bias, rm, rv, y, mean, rstd, count, training, momentum, eps, act, p0, p1,
    residual=None,
):  # fmt: skip
    """Finalize (2, k, C) partial sums ``part`` about ``shift`` and apply (training), or apply the
    running statistics (``part`` and ``shift`` unread); ``residual`` is laid out as x."""
    update = training and rm is not None
    w = weight if weight is not None else x  # absent tensors are passed as x and never read
    b = bias if bias is not None else x
    r = residual if residual is not None else x
    rm = rm if rm is not None else x
    rv = rv if rv is not None else x
    args = (x, part, shift, w, b, r, rm, rv, y, mean, rstd, count, eps, momentum, p0, p1)

    def timing_args() -> tuple:  # benchmark mode times on copies of the running statistics
        return (*args[:6], rm.clone(), rv.clone(), *args[8:])

    _plan("apply", x, training, update, weight, bias, act, timing_args, residual)(*args)


def _fake_backward(dy, x, weight, bias, mean, rstd, training, act, act_p0, act_p1, need_dw, need_db):
    return torch.empty_like(x), *param_grads(x, weight, bias, need_dw, need_db)


@custom_op(
    "batch_norm_backward",
    "(Tensor dy, Tensor x, Tensor? weight, Tensor? bias, Tensor mean, Tensor rstd, bool training, int act, "
    "float act_p0, float act_p1, bool need_dw, bool need_db) -> (Tensor, Tensor, Tensor)",
    _fake_backward,
)
def _backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    training: bool,
    act: int,
    act_p0: float,
    act_p1: float,
    need_dw: bool,
    need_db: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx in x's layout, dweight or empty, dbias or empty)."""
    dx = torch.empty_like(x)
    dw, db = param_grads(x, weight, bias, need_dw, need_db)
    if x.numel() == 0:
        return dx, dw.zero_(), db.zero_()
    x, dx = dense_ncs(x, dx)
    dy = in_layout(dy, dx)
    w = weight if weight is not None else x
    b = bias if bias is not None else x
    grads = (dw if need_dw else None, db if need_db else None)
    args = (dy, x, mean, rstd, w, b, dx, *grads, x.numel() // x.shape[1], act_p0, act_p1)
    _plan("backward", dx, training, False, weight, bias, act, lambda: args)(*args)
    return dx, dw, db


def _through_residual_activation(dy, y, act, p0, p1):
    """The gradient of ``act(z)`` for z = batch norm + residual: from the saved output y (the
    activation's input z is not kept); this is also the residual's gradient."""
    return dy if act == NO_ACTIVATION else _activation_grad(dy, y, act, p0, p1, True)


class _BatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        x,
        weight,
        bias,
        running_mean,
        running_var,
        residual,
        training,
        momentum,
        eps,
        act,
        act_p0,
        act_p1,
    ):
        y, mean, rstd = _forward(
            x, weight, bias, running_mean, running_var, residual, training, momentum, eps, act, act_p0, act_p1
        )
        with_residual = residual is not None
        ctx.save_for_backward(
            x, weight, bias, mean, rstd, y if with_residual and act != NO_ACTIVATION else None
        )
        ctx.params = (training, act, act_p0, act_p1, with_residual)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, mean, rstd, y = ctx.saved_tensors
        training, act, act_p0, act_p1, with_residual = ctx.params
        need_dw, need_db = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        dr = None
        if with_residual:  # the activation's gradient first, then batch norm's without one
            dy = dr = _through_residual_activation(dy, y, act, act_p0, act_p1)
            act = NO_ACTIVATION
        dx, dw, db = _backward(
            dy, x, weight, bias, mean, rstd, training, act, act_p0, act_p1, need_dw, need_db
        )
        dr = dr if ctx.needs_input_grad[5] else None
        return dx, dw if need_dw else None, db if need_db else None, None, None, dr, *([None] * 6)


class _EagerBatchNorm(torch.autograd.Function):
    """``_BatchNormFunction`` for the eager fast path: ``program`` (see ``_eager_program``) runs
    the bound plans directly, forward and backward, and keeps the statistics in one workspace;
    the running statistics are updated in place."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, residual, momentum, program):
        y, workspace = program[0](x, weight, bias, residual, running_mean, running_var, momentum)
        ctx.save_for_backward(x, weight, bias, workspace, y if program[2] else None)
        ctx.program = program
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, workspace, y = ctx.saved_tensors
        _, need_dw, need_db = ctx.needs_input_grad[:3]
        dx, dw, db, dr = ctx.program[1](dy, x, weight, bias, workspace, y, need_dw, need_db)
        return dx, dw, db, None, None, dr if ctx.needs_input_grad[5] else None, None, None


_apply_eager = raw_apply(_EagerBatchNorm)


def _eager_program(
    x, weight, bias, running_mean, running_var, residual, training, momentum, eps, act, p0, p1
):
    """``fast(x, weight, bias, residual, running_mean, running_var, momentum, grad) -> y`` for the
    calls of a validated call's key (``_eager_key``): the work of ``_forward`` (and ``_backward``)
    through the packed steps' plans, bound here, or None where the call needs the general path's
    copies (an empty input, an input not dense in its own layout, a residual in another layout).
    Arguments as ``_forward``'s."""
    y0 = torch.empty_like(x)
    if not x.numel() or x.stride() != y0.stride() or ncs_layout(y0) is None:
        return None
    if residual is not None and residual.stride() != x.stride():
        return None
    count = x.numel() // x.shape[1]
    update = training and running_mean is not None
    # Absent tensors are passed as x and never read; which ones are absent is fixed by the key.
    first = (x, *(t if t is not None else x for t in (weight, bias, residual, running_mean, running_var)))
    args = (*first, y0, count, eps, momentum, p0, p1)
    step = "forward_packed" if training else "apply_packed"
    plan = _plan(
        step, x, training, update, weight, bias, act,
        lambda: (*args[:4], args[4].clone(), args[5].clone(), *args[6:]),  # copies of the running stats
        residual,
    )  # fmt: skip
    # With a residual, the activation's gradient is taken from the saved output (see
    # _BatchNormFunction) and batch norm's backward runs without one.
    # (The closures below hold flags, not the first call's tensors.)
    with_residual = residual is not None
    keep_output = with_residual and act != NO_ACTIVATION
    backward_act = NO_ACTIVATION if with_residual else act

    def run(x, weight, bias, r, rm, rv, momentum):
        """(y, the workspace whose first rows are the mean and 1/std)."""
        y = torch.empty_like(x)
        w = weight if weight is not None else x
        b = bias if bias is not None else x
        r = r if r is not None else x
        rm = rm if rm is not None else x
        rv = rv if rv is not None else x
        return y, plan(x, w, b, r, rm, rv, y, count, eps, momentum, p0, p1)

    backward_plan: list = [None, None]  # (config version, plan): looked up on the first backward

    def backward(dy, x, weight, bias, workspace, y, need_dw, need_db):
        dr = None
        if with_residual:
            dy = dr = _through_residual_activation(dy, y, act, p0, p1)
        dx = torch.empty_like(x)
        dy = in_layout(dy, dx)
        w = weight if weight is not None else x
        b = bias if bias is not None else x
        dw = torch.empty_like(weight) if need_dw else None
        db = torch.empty_like(bias) if need_db else None
        args = (dy, x, workspace, workspace, w, b, dx, dw, db, count, p0, p1)
        if backward_plan[0] != config.version:
            plan = _plan("backward_packed", dx, training, False, weight, bias, backward_act, lambda: args)
            backward_plan[:] = config.version, plan
        backward_plan[1](*args)
        return dx, dw, db, dr

    program = (run, backward, keep_output)

    def fast(x, weight, bias, residual, running_mean, running_var, momentum, grad):
        if grad:
            return _apply_eager(x, weight, bias, running_mean, running_var, residual, momentum, program)
        return run(x, weight, bias, residual, running_mean, running_var, momentum)[0]

    fast.program = program  # for fused callers that run it inside an autograd node of their own
    return fast


# ---------------------------------------------------------------------------------------------
# 5. Public functions.


# Eager calls seen before run ``_eager_program``'s ``fast``, keyed by ``_eager_key``.
_eager: dict[tuple, Callable[..., torch.Tensor]] = {}


def _eager_key(
    input, running_mean, running_var, weight, bias, training, eps, activation, residual
) -> tuple | None:
    """The fast path's key of a call on plain tensors: everything the argument checks and the plans
    depend on (types, shapes, strides, dtypes, devices, flags, eps, the config version) but
    momentum, checked on each call (with momentum=None the module passes a new factor each step).
    None where the call takes the general path: tracing, a functorch transform, a tensor
    subclass, arguments of unusual types."""
    if not eager_tensor(input) or type(training) is not bool or functorch_active():
        return None
    if activation is not None and type(activation) is not str:
        return None
    params = (weight, bias, running_mean, running_var)
    for t in params:
        if t is not None and (type(t) not in PLAIN_TENSORS or not t.is_contiguous()):
            return None
    if residual is not None and type(residual) not in PLAIN_TENSORS:
        return None
    return (
        config.version, input.shape, input.stride(), input.dtype, input.device, training, eps, type(eps),
        activation, *[None if t is None else (t.shape, t.dtype, t.device) for t in params],
        None if residual is None else (residual.shape, residual.stride(), residual.dtype, residual.device),
    )  # fmt: skip


def _check_channels(op: str, input: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    check_tensor(op, "input", input, min_ndim=2)
    for name, value in tensors.items():
        check_affine(op, name, value, (input.shape[1],), input)


def _check_residual(op: str, input: torch.Tensor, residual, act: int, p0: float, activation) -> None:
    """A residual is a tensor of the input's shape, dtype and device; the activation after it must
    have a gradient that its output determines (the backward keeps the output, not the sum)."""
    if residual is None:
        return
    check_like(op, "residual", residual, "input", input)
    if residual.dtype != input.dtype:
        raise TypeError(f"{op}: 'residual' has dtype {residual.dtype} but 'input' has {input.dtype}")
    if act != NO_ACTIVATION and not saves_output(act, p0):
        raise ValueError(
            f"{op}: activation={activation!r} with a residual is not supported: its gradient does not "
            "follow from its output (relu, sigmoid and tanh's do)"
        )


def _unit_stride(op: str, *vectors: torch.Tensor | None, **running: torch.Tensor | None) -> list:
    """The per-channel ``vectors`` with unit stride, as the kernels read them (a differentiable
    copy where they are strided); the ``running`` statistics are updated in place, so a strided
    one is an error rather than a copy whose update would be lost."""
    for name, value in running.items():
        if value is not None and not value.is_contiguous():
            raise ValueError(f"{op}: argument '{name}' must be contiguous (it is updated in place)")
    return [None if t is None else t.contiguous() for t in vectors]


def batch_norm(
    input: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
    *,
    activation: str | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.batch_norm``, with cuDNN's fused activation (``activation="relu"`` for BN + ReLU) and
    residual add: ``activation(batch_norm(input) + residual)`` (cuDNN's BN-add-ReLU, the end of a
    ResNet block) in one pass.

    Args:
        input: (N, C, *spatial) fp16/bf16/fp32, contiguous or channels_last (read in place; the
            output keeps the layout).
        running_mean, running_var: (C,) float tensors, updated in place in training
            (``(1 - momentum) * old + momentum * batch``, the variance unbiased, as PyTorch);
            required when not training.
        weight, bias: (C,) tensors of any float dtype, or None.
        training: normalize with the batch's statistics (else with the running ones).
        activation: a fused activation name (``"relu"``, ``"silu"``, ...), or None.
        residual: a tensor of the input's shape and dtype (any layout), added before the
            activation; with one, the activation must be one whose gradient follows from its
            output (relu, sigmoid, tanh): the output is kept for the backward instead of the sum.

    The saved statistics are fp32; the sums behind them are of ``x - shift`` with a per-channel
    sample as the shift, so a mean of 1e4 over a unit variance keeps its digits.

    Eager calls on plain tensors are checked once per key (``_eager_key``: shapes, strides,
    dtypes, devices, flags, eps, the config version); later calls with that key check only the
    momentum and run prepared plans (about a third of the host time of a checked call).
    """
    key = _eager_key(input, running_mean, running_var, weight, bias, training, eps, activation, residual)
    if key is not None:
        fast = _eager.get(key)
        # momentum is checked here, as check_float would (a real number, finite, not a bool).
        if fast is not None and (
            type(momentum) is int or (type(momentum) is float and math.isfinite(momentum))
        ):
            grad = torch.is_grad_enabled() and (
                input.requires_grad
                or (weight is not None and weight.requires_grad)
                or (bias is not None and bias.requires_grad)
                or (residual is not None and residual.requires_grad)
            )
            return fast(input, weight, bias, residual, running_mean, running_var, float(momentum), grad)
    op = "tdnn.batch_norm"
    _check_channels(op, input, running_mean=running_mean, running_var=running_var, weight=weight, bias=bias)
    if (running_mean is None) != (running_var is None):
        raise ValueError(f"{op}: give both 'running_mean' and 'running_var', or neither")
    if not training and running_mean is None:
        raise ValueError(f"{op}: 'running_mean' and 'running_var' are required when training=False")
    if training and input.numel() // max(input.shape[1], 1) == 1:
        raise ValueError(
            f"{op}: expected more than 1 value per channel when training, got input {tuple(input.shape)}"
        )
    momentum = check_float(op, "momentum", momentum)
    eps = check_eps(op, eps)
    act, p0, p1 = activation_kind(activation, op)
    _check_residual(op, input, residual, act, p0, activation)
    weight, bias = _unit_stride(op, weight, bias, running_mean=running_mean, running_var=running_var)
    args = (
        input,
        weight,
        bias,
        running_mean,
        running_var,
        residual,
        bool(training),
        momentum,
        eps,
        act,
        p0,
        p1,
    )
    grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (input, weight, bias, residual)
    )
    if key is not None:  # validated: later calls with this key skip the checks
        fast = _eager_program(*args)
        if fast is not None:
            _eager[key] = fast
            return fast(input, weight, bias, residual, running_mean, running_var, momentum, grad)
    if grad:
        return _BatchNormFunction.apply(*args)
    return _forward(*args)[0]


def batch_norm_stats(
    input: torch.Tensor, shift: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """cuDNN's batch-norm statistics pass (genstats), on its own so the sums can be all-reduced
    across devices before ``batch_norm_apply``.

    Returns ``(sum, sum_sq, shift, count)``: per-channel fp32 sums of ``x - shift`` and of its
    square over N and the spatial dimensions, the per-channel shift used (``shift`` if given, else
    a sample of each channel; for an all-reduce, give every rank the same one) and the number of
    values per channel.
    """
    op = "tdnn.batch_norm_stats"
    _check_channels(op, input, shift=shift)
    x, _ = dense_ncs(input, torch.empty_like(input))
    shift = _default_shift(x) if shift is None else shift.to(_stats_dtype(x)).contiguous()
    if x.numel() == 0:
        zeros = torch.zeros(x.shape[1], dtype=_stats_dtype(x), device=x.device)
        return zeros, zeros.clone(), shift, 0
    total, total_sq = channel_sums(_partial_stats(x, shift))
    return total, total_sq, shift, x.numel() // x.shape[1]


def batch_norm_apply(
    input: torch.Tensor,
    sum: torch.Tensor,
    sum_sq: torch.Tensor,
    shift: torch.Tensor,
    count: int,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    running_mean: torch.Tensor | None = None,
    running_var: torch.Tensor | None = None,
    momentum: float = 0.1,
    eps: float = 1e-5,
    *,
    activation: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """cuDNN's finalize + apply: batch statistics from (possibly all-reduced) ``batch_norm_stats``
    sums over ``count`` values per channel, the running-statistic update, and the normalization.
    Returns ``(output, mean, invstd)``; no autograd (a distributed wrapper supplies its own)."""
    op = "tdnn.batch_norm_apply"
    _check_channels(op, input, sum=sum, sum_sq=sum_sq, shift=shift, weight=weight, bias=bias)
    _check_channels(op, input, running_mean=running_mean, running_var=running_var)
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"{op}: argument 'count'={count!r} must be a positive int")
    act, p0, p1 = activation_kind(activation, op)
    eps = check_eps(op, eps)
    momentum = check_float(op, "momentum", momentum)
    weight, bias = _unit_stride(op, weight, bias, running_mean=running_mean, running_var=running_var)
    y = torch.empty_like(input)
    x, y = dense_ncs(input, y)
    mean = x.new_empty(x.shape[1], dtype=_stats_dtype(x))
    rstd = torch.empty_like(mean)
    if x.numel():
        part = torch.stack((sum, sum_sq)).to(mean.dtype).reshape(2, 1, -1)  # the (2, k, C) layout
        shift = shift.to(mean.dtype).contiguous()
        _finalize_apply(
            x, part, shift, weight, bias, running_mean, running_var, y, mean, rstd, count,
            True, momentum, eps, act, p0, p1,
        )  # fmt: skip
    return y, mean, rstd


def batch_norm_backward_reduce(
    grad_output: torch.Tensor, input: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor,
    weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The first half of batch norm's training backward, on its own so a distributed wrapper can
    all-reduce its sums: per-channel fp32 ``sum(dy)`` and ``sum(dy * x_hat)`` with
    ``x_hat = (x - mean) * invstd`` (these are also dbias and dweight). ``mean``/``invstd`` are
    the fp32 statistics ``batch_norm_apply`` returned."""
    op = "tdnn.batch_norm_backward_reduce"
    _check_channels(op, input, mean=mean, invstd=invstd, weight=weight)
    check_like(op, "grad_output", grad_output, "input", input)
    if input.numel() == 0:
        zeros = torch.zeros(input.shape[1], dtype=_stats_dtype(input), device=input.device)
        return zeros, zeros.clone()
    x, _ = dense_ncs(input, torch.empty_like(input))
    dy = in_layout(grad_output, x)
    (weight,) = _unit_stride(op, weight)
    w = weight if weight is not None else x
    mean, invstd = (t.to(_stats_dtype(x)).contiguous() for t in (mean, invstd))
    args = (dy, x, mean, invstd, w, x, 0.0, 0.0)
    return channel_sums(
        _plan("backward_reduce", x, True, False, weight, None, NO_ACTIVATION, lambda: args)(*args)
    )


def batch_norm_backward_apply(
    grad_output: torch.Tensor, input: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor,
    weight: torch.Tensor | None, sum_dy: torch.Tensor, sum_dy_xhat: torch.Tensor, count: float,
) -> torch.Tensor:  # fmt: skip
    """The second half: ``dx = weight * invstd * (dy - sum_dy / count - x_hat * sum_dy_xhat /
    count)`` in the input's layout, from (all-reduced) ``batch_norm_backward_reduce`` sums over
    ``count`` values per channel (a float: the sums may come pre-divided with ``count=1``)."""
    op = "tdnn.batch_norm_backward_apply"
    _check_channels(
        op, input, mean=mean, invstd=invstd, weight=weight, sum_dy=sum_dy, sum_dy_xhat=sum_dy_xhat
    )
    check_like(op, "grad_output", grad_output, "input", input)
    count = check_float(op, "count", count)
    if count <= 0:
        raise ValueError(f"{op}: argument 'count'={count} must be positive")
    if input.numel() == 0:
        return torch.empty_like(input)
    x, dx = dense_ncs(input, torch.empty_like(input))
    dy = in_layout(grad_output, dx)
    (weight,) = _unit_stride(op, weight)
    w = weight if weight is not None else x
    stats = [t.to(_stats_dtype(x)).contiguous() for t in (mean, invstd, sum_dy, sum_dy_xhat)]
    args = (dy, x, stats[0], stats[1], w, x, stats[2], stats[3], dx, count, 0.0, 0.0)
    _plan("backward_apply", dx, True, False, weight, None, NO_ACTIVATION, lambda: args)(*args)
    return dx
