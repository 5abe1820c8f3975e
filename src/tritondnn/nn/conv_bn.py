"""A convolution and the batch norm after it (then a residual add and ReLU, or not) as one
autograd node: what ``patch(..., fuse=True)`` and ``Sequential`` run for Conv -> BatchNorm.

The two ops' kernels stay as they are (the eager programs both families bind per validated key);
what fusing saves is host time, which a training step of a convolutional network at PyTorch's
speed is short of: one ``autograd.Function`` node instead of two (plus autocast's weight cast
node), one module call chain, and autocast's cast of the weight done inside the node. A call
whose pieces have no eager program yet (the first of its shapes), or that the fast path does not
take (hooks, a conv bias, a padding mode, an input of another dtype than the computation's),
runs the two modules as they are; the first such call builds the programs the later ones use.

A model patched with ``fuse=True`` also opens a ``_Step`` for each of its forwards (``enter_step``
and ``exit_step``, hooks on the model), in which work that every fused call repeats is done once
for all of them: autocast's casts of the convolutions' weights (one multi-tensor copy at the first
fused call, for the convolutions the model's previous forward ran fused) and the batch norms'
``num_batches_tracked += 1`` (one multi-tensor add as the forward returns). On an H200's host a
weight's ``.to()`` took 13.6 us and an ``add_(1)`` 10.2, 53 of each in a ResNet-50 step.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from ..core.autocast import _any_autocast
from ..core.backend import DEVICE_TYPE
from ..core.library import functorch_active, raw_apply
from ..ops.conv import eager as conv_eager
from ..ops.norm import batch as batch_ops
from .layers import Conv2d, _bn_state, _hooked, fusable_batch_norm, on_backend


class _ConvBatchNorm(torch.autograd.Function):
    """y = bn(conv(x, cast(weight))) [+ residual, relu]; backward: batch norm's, then the
    convolution's data and weight gradients, the weight's stored in the (master) weight's dtype
    from the kernels' fp32 sums (no cast node, no cast launch)."""

    @staticmethod
    def forward(
        ctx, x, weight, bn_weight, bn_bias, running_mean, running_var, residual, momentum, programs, low, cast
    ):
        conv_program, bn_program = programs
        w = cast if cast is not None else weight if low is None else weight.to(low)
        h = conv_program[0](x, w, None)
        y, workspace = bn_program[0](h, bn_weight, bn_bias, residual, running_mean, running_var, momentum)
        ctx.save_for_backward(x, w, h, bn_weight, bn_bias, workspace, y if bn_program[2] else None)
        ctx.programs = programs
        ctx.weight_dtype = weight.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, h, bn_weight, bn_bias, workspace, y = ctx.saved_tensors
        need_x, need_w, need_bn_w, need_bn_b = ctx.needs_input_grad[:4]
        conv_program, bn_program = ctx.programs
        dh, dbn_w, dbn_b, dr = bn_program[1](dy, h, bn_weight, bn_bias, workspace, y, need_bn_w, need_bn_b)
        dx, dw, _ = conv_program[1](dh, x, w, need_x, need_w, False, ctx.weight_dtype)
        dr = dr if ctx.needs_input_grad[6] else None
        return dx, dw, dbn_w, dbn_b, None, None, dr, None, None, None, None


_apply = raw_apply(_ConvBatchNorm)

# (conv key, batch norm's flags and parameter specs, residual spec, relu) -> (conv program,
# batch norm program), filled after a call of that key ran unfused.
_programs: dict[tuple, tuple] = {}


def _spec(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def conv_batch_norm(
    conv: torch.nn.Module, bn: torch.nn.Module, input: Any, residual: Any, relu: bool
) -> torch.Tensor:
    """``relu(bn(conv(input)) + residual)`` (without the residual where None, without the ReLU
    where ``relu`` is False), fused where the fast path takes the call."""
    key = _key(conv, bn, input, residual, relu)
    programs = _programs.get(key) if key is not None else None
    if programs is None:
        h = conv(input)
        y = bn.forward_relu(h, residual) if relu else bn(h)
        if key is not None:
            _remember(key, bn, h, residual, relu)
        return y
    step = _local.step
    # Counts the batch (or leaves it to the step), computes the momentum factor.
    args = bn._batch_norm_args(input, None if step is None else step.counts)
    _, rm, rv, bn_weight, bn_bias, _, momentum, _ = args
    low = key[1]
    weight = conv.weight
    cast = None if low is None or step is None else step.cast_weight(conv, weight, low)
    grad = torch.is_grad_enabled() and (
        input.requires_grad
        or weight.requires_grad
        or (bn_weight is not None and bn_weight.requires_grad)
        or (bn_bias is not None and bn_bias.requires_grad)
        or (residual is not None and residual.requires_grad)
    )
    if grad:
        return _apply(
            input, weight, bn_weight, bn_bias, rm, rv, residual, float(momentum), programs, low, cast
        )
    w = cast if cast is not None else weight if low is None else weight.to(low)
    h = programs[0][0](input, w, None)
    return programs[1][0](h, bn_weight, bn_bias, residual, rm, rv, float(momentum))[0]


def _key(conv, bn, input, residual, relu) -> tuple | None:
    """The fast path's key, or None where the call runs unfused every time (tracing included:
    torch.compile sees the two modules' ops)."""
    if torch.compiler.is_compiling():
        return None
    if type(conv) is not Conv2d or not fusable_batch_norm(bn) or not on_backend(input):
        return None
    if conv.bias is not None or conv.padding_mode != "zeros" or _hooked(conv) or _hooked(bn):
        return None
    if functorch_active() or (residual is not None and type(residual) is not torch.Tensor):
        return None
    weight = conv.weight
    low = None
    if _any_autocast() and torch.is_autocast_enabled(DEVICE_TYPE):
        low = torch.get_autocast_dtype(DEVICE_TYPE)
        if weight.dtype not in (torch.float32, low):
            return None
        low = None if weight.dtype == low else low
    if input.dtype != (low or weight.dtype):
        return None  # autocast would cast the input too: the unfused path does that
    conv_key = conv_eager.eager_key(
        2, input, weight, None, conv.stride, conv.padding, conv.dilation, conv.groups, low
    )
    if conv_key is None:
        return None
    # Which statistics and parameters the batch norm takes (its mode) and their layouts.
    params = tuple(_spec(t) for t in _bn_state(bn)[:4])
    return conv_key, low, bn.training, bn.track_running_stats, bn.eps, params, _spec(residual), relu


def _remember(key, bn, h, residual, relu) -> None:
    """After an unfused call: the two eager programs its key maps to, where both exist."""
    conv_fast = conv_eager.programs.get(key[0])
    rm, rv, weight, bias, batch_stats = bn._statistics()
    bn_key = batch_ops._eager_key(
        h, rm, rv, weight, bias, batch_stats, bn.eps, "relu" if relu else None, residual
    )
    bn_fast = batch_ops._eager.get(bn_key) if bn_key is not None else None
    conv_program = getattr(conv_fast, "program", None)
    bn_program = getattr(bn_fast, "program", None)
    if conv_program is not None and bn_program is not None:
        _programs[key] = (conv_program, bn_program)


# ---------------------------------------------------------------------------------------------
# A patched model's forward as one step.


class _CastPlan:
    """The convolutions whose weights a model's forward casts in one copy (kept on the model):
    those its earlier forwards ran fused under autocast."""

    def __init__(self) -> None:
        self.convs: list[torch.nn.Module] = []
        self.known: set[int] = set()

    def learn(self, conv: torch.nn.Module) -> None:
        if id(conv) not in self.known:
            self.known.add(id(conv))
            self.convs.append(conv)

    def cast_all(self, low: torch.dtype, like: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """{id(conv): (its weight, the weight in ``low``)} for the convolutions whose weight is a
        dense fp32 tensor on ``like``'s device: views of one new buffer (each at a 128-byte
        boundary, as the convolutions' tensor descriptors need 16), filled by one copy."""
        weights, views, entries = [], [], []
        offset = 0
        for conv in self.convs:
            w = conv._parameters.get("weight")
            if w is None or w.dtype != torch.float32 or w.device != like.device or not _dense(w):
                continue
            entries.append((conv, w, offset))
            offset += -(-w.numel() // 64) * 64
        if not entries:
            return {}
        flat = torch.empty(offset, dtype=low, device=like.device)
        casts = {}
        for conv, w, start in entries:
            view = flat.as_strided(w.shape, w.stride(), start)
            weights.append(w)
            views.append(view)
            casts[id(conv)] = (w, view)
        torch._foreach_copy_(views, weights)
        return casts


def _dense(t: torch.Tensor) -> bool:
    return t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last)


class _Step:
    """One forward of a patched model (see the module's docstring): the ``num_batches_tracked``
    counters its fused calls leave to it, and its weight casts."""

    __slots__ = ("casts", "counts", "depth", "owner", "plan")

    def __init__(self, owner: torch.nn.Module, plan: _CastPlan) -> None:
        self.owner = owner
        self.plan = plan
        self.counts: list[torch.Tensor] = []
        self.casts: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
        self.depth = 0

    def cast_weight(
        self, conv: torch.nn.Module, weight: torch.Tensor, low: torch.dtype
    ) -> torch.Tensor | None:
        """``weight`` in ``low`` from the step's cast, or None (cast it alone): a convolution the
        plan did not have (it will next time) or whose weight changed since the cast."""
        if self.casts is None:
            self.casts = self.plan.cast_all(low, weight)
        hit = self.casts.get(id(conv))
        if hit is not None and hit[0] is weight and hit[1].dtype == low:
            return hit[1]
        self.plan.learn(conv)
        return None

    def finish(self) -> None:
        """Adds one to every counter left to the step (one launch; one per counter where a batch
        norm ran more than once, which the multi-tensor add must not see twice)."""
        counts, self.counts = self.counts, []
        if not counts:
            return
        if len({id(t) for t in counts}) == len(counts):
            torch._foreach_add_(counts, 1)
        else:
            for t in counts:
                t.add_(1)


class _Local(threading.local):
    step: _Step | None = None  # the open step of this thread (DataParallel runs replicas in threads)


_local = _Local()


def enter_step(model: torch.nn.Module, *_: object) -> None:
    """Forward pre-hook opening the model's ``_Step`` (``patch(model, fuse=True)`` registers it);
    a nested patched model's forward joins the open one."""
    step = _local.step
    if step is not None:
        step.depth += 1
        return
    if torch.compiler.is_compiling():
        return  # traced calls take the unfused path (``_key``)
    plan = model.__dict__.get("_tdnn_cast_plan")
    if plan is None:
        plan = model.__dict__["_tdnn_cast_plan"] = _CastPlan()
    _local.step = _Step(model, plan)


def exit_step(model: torch.nn.Module, *_: object) -> None:
    """Forward hook closing ``enter_step``'s step (registered with ``always_call=True``: it runs
    when the forward raised, and when an earlier pre-hook raised and no step was opened)."""
    step = _local.step
    if step is None:
        return
    if step.depth:
        step.depth -= 1
        return
    if step.owner is not model:
        return  # this model's enter_step did not run
    _local.step = None
    step.finish()
