"""torch.nn layers whose forward runs tritondnn's kernels.

Each class subclasses its torch.nn namesake and adds no state: the constructor, parameters,
buffers, ``state_dict`` and ``repr`` are torch's, so a checkpoint loads into either and
``tdnn.nn.patch`` can swap a live module's class in place. Only ``forward`` (or the hook torch's
forward calls, such as ``_conv_forward``) changes.

A call tritondnn cannot take runs torch's own forward instead, as cuDNN's absence would in
PyTorch: an input on another device than the backend's, or a problem every engine declines
(``NotSupportedError``; warned once per reason).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from ..core.backend import ON_DEVICE_ATTR
from ..core.config import config
from ..core.errors import NotSupportedError
from ..core.library import PLAIN_TENSORS as _PLAIN
from ..ops.matmul.autograd import Product, linear_pair
from . import cache

_warned: set[str] = set()


def on_backend(x: object) -> bool:
    """Whether ``x`` is a tensor on the device tritondnn's kernels run on."""
    return isinstance(x, torch.Tensor) and getattr(x, ON_DEVICE_ATTR)


def run_or_fallback(module: nn.Module, x: object, ours: Callable[[], Any], theirs: Callable[[], Any]) -> Any:
    """``ours()`` when ``x`` is on the backend's device and an engine takes the problem, else
    ``theirs()`` (torch's forward), warning once per distinct reason.

    An input tritondnn's argument checks reject (a ``TypeError``/``ValueError`` naming the op,
    ``tdnn.<op>: ...``, raised before any launch) runs ``theirs()`` too: for input torch rejects
    as well, the caller gets torch's own error, as torch.nn's contract promises; for input only
    tritondnn lacks (an integer dtype, an interpolation mode without a kernel), torch's result,
    with the warning."""
    if not on_backend(x):
        return theirs()
    try:
        return ours()
    except (NotSupportedError, TypeError, ValueError) as e:
        if not isinstance(e, NotSupportedError) and not str(e).startswith("tdnn."):
            raise  # not an argument check of ours (those name the op): a bug to see, not to hide
        result = theirs()  # raises torch's error where torch rejects the input too
        reason = f"{type(module).__name__}: {e}"
        if reason not in _warned:
            _warned.add(reason)
            warnings.warn(f"tritondnn falls back to torch for {reason}", stacklevel=3)
        return result


# ---------------------------------------------------------------------------------------------
# Convolution and linear.


def _conv_call(fn: Callable[..., torch.Tensor], spatial: int, x: torch.Tensor, *args: Any) -> torch.Tensor:
    """``fn`` on a batched input; an unbatched one (no N dim, as torch.nn accepts) gains one."""
    if x.dim() == spatial + 1:
        return fn(x.unsqueeze(0), *args).squeeze(0)
    return fn(x, *args)


class _ConvMixin:
    """Forward of Conv1d/2d/3d: torch's ``_conv_forward`` with tritondnn's convolution."""

    _tdnn_conv: Callable[..., torch.Tensor]
    _tdnn_spatial: int

    def _conv_forward(self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        def ours() -> torch.Tensor:
            x, padding = input, self.padding
            if self.padding_mode != "zeros":
                x = F.pad(x, self._reversed_padding_repeated_twice, mode=self.padding_mode)
                padding = 0
            args = (weight, bias, self.stride, padding, self.dilation, self.groups)
            return _conv_call(type(self)._tdnn_conv, self._tdnn_spatial, x, *args)

        theirs = super()._conv_forward
        return run_or_fallback(self, input, ours, lambda: theirs(input, weight, bias))


class Conv1d(_ConvMixin, nn.Conv1d):
    """``torch.nn.Conv1d`` through ``tdnn.conv1d``."""

    _tdnn_conv, _tdnn_spatial = staticmethod(ops.conv.conv1d), 1


class Conv2d(_ConvMixin, nn.Conv2d):
    """``torch.nn.Conv2d`` through ``tdnn.conv2d``."""

    _tdnn_conv, _tdnn_spatial = staticmethod(ops.conv.conv2d), 2


class Conv3d(_ConvMixin, nn.Conv3d):
    """``torch.nn.Conv3d`` through ``tdnn.conv3d``."""

    _tdnn_conv, _tdnn_spatial = staticmethod(ops.conv.conv3d), 3


class _ConvTransposeMixin:
    """Forward of ConvTranspose1d/2d/3d: torch's, with tritondnn's transposed convolution."""

    _tdnn_conv: Callable[..., torch.Tensor]
    _tdnn_spatial: int

    def forward(self, input: torch.Tensor, output_size: list[int] | None = None) -> torch.Tensor:
        def ours() -> torch.Tensor:
            if self.padding_mode != "zeros":
                raise ValueError(f"Only 'zeros' padding mode is supported for {type(self).__name__}")
            output_padding = self._output_padding(
                input, output_size, self.stride, self.padding, self.kernel_size, self._tdnn_spatial,
                self.dilation,
            )  # fmt: skip
            args = (
                self.weight,
                self.bias,
                self.stride,
                self.padding,
                output_padding,
                self.groups,
                self.dilation,
            )
            return _conv_call(type(self)._tdnn_conv, self._tdnn_spatial, input, *args)

        theirs = super().forward
        return run_or_fallback(self, input, ours, lambda: theirs(input, output_size))


class ConvTranspose1d(_ConvTransposeMixin, nn.ConvTranspose1d):
    """``torch.nn.ConvTranspose1d`` through ``tdnn.conv_transpose1d``."""

    _tdnn_conv, _tdnn_spatial = staticmethod(ops.conv.conv_transpose1d), 1


class ConvTranspose2d(_ConvTransposeMixin, nn.ConvTranspose2d):
    """``torch.nn.ConvTranspose2d`` through ``tdnn.conv_transpose2d``."""

    _tdnn_conv, _tdnn_spatial = staticmethod(ops.conv.conv_transpose2d), 2


class ConvTranspose3d(_ConvTransposeMixin, nn.ConvTranspose3d):
    """``torch.nn.ConvTranspose3d`` through ``tdnn.conv_transpose3d``."""

    _tdnn_conv, _tdnn_spatial = staticmethod(ops.conv.conv_transpose3d), 3


class Linear(nn.Linear):
    """``torch.nn.Linear`` through ``tdnn.linear``."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return linear_call(self, input, None, lambda: nn.Linear.forward(self, input))


_LINEAR = "_tdnn_linear"  # a Linear's last cached call: (print, the matmul family's call, p0, p1, cast)


def linear_call(
    module: nn.Linear, input: torch.Tensor, activation: str | None, theirs: Callable[[], torch.Tensor]
) -> torch.Tensor:
    """``tdnn.linear(input, module.weight, module.bias, activation=activation)`` (``theirs()``
    where ``run_or_fallback`` falls back). The call the linear family cached for such a call
    (``ops.matmul._eager``) is kept on the module with the call's print (``nn.cache``) and run
    directly while the print matches: the autocast wrapper, the argument checks and the
    family's key, all of whose inputs the print holds, stay out of the way (about 10 us of a
    GPT-2 layer's product on a 2-core host)."""
    mark = _linear_print(module, input, activation)
    entry = cache.cached(module, _LINEAR) if mark is not None else None
    if entry is not None and entry[0] == mark:
        params = module._parameters
        return entry[1](input, params["weight"], params["bias"], entry[2], entry[3], True, entry[4])
    out = run_or_fallback(
        module,
        input,
        lambda: ops.matmul.linear(input, module.weight, module.bias, activation=activation),
        theirs,
    )
    if mark is not None and on_backend(input):  # not a call that fell back to torch's
        cast, grad = mark[:2]
        weight, bias = module._parameters["weight"], module._parameters["bias"]
        fast = ops.matmul._eager.get(ops.matmul.linear_key(input, weight, bias, activation, (), cast, grad))
        if fast is not None:
            cache.store(module, _LINEAR, (mark, fast, *ops.matmul._params(activation, ()), cast))
    return out


_LINEAR_PAIR = "_tdnn_linear_pair"  # on a pair's first Linear: (its print, the second's own, the pair's call)


def linear_pair_call(
    first: nn.Linear,
    activation: str,
    then: nn.Module,
    second: nn.Linear,
    input: torch.Tensor,
    last: tuple[str, nn.Module] | None = None,
) -> torch.Tensor:
    """``second(then(first(input)))``, ``then`` the activation module computing ``activation``
    (a transformer's MLP), and ``last``'s activation module after it where given (its
    activation's name, the module): the first product with the activation in its epilogue, then
    the second with its own, both as one autograd node (``ops.matmul.autograd.linear_pair``)
    where autograd records the call and both products' calls were cached (``linear_call``) for
    such a call before; else the calls as ``linear_call`` makes them, a node each. The pair is
    kept on ``first`` with its print and the second's own (its parameters and type: the rest of
    the second's print, its input's included, follows from the first's)."""
    mark = _linear_print(first, input, activation)
    grad = mark is not None and mark[1]
    last_activation = None if last is None else last[0]
    if grad:
        entry = cache.cached(first, _LINEAR_PAIR)
        if entry is not None and entry[0] == mark and entry[1] == _own_print(second, last_activation):
            p, q = first._parameters, second._parameters
            return linear_pair(input, p["weight"], p["bias"], q["weight"], q["bias"], *entry[2])
    hidden = linear_call(first, input, activation, lambda: then(nn.Linear.forward(first, input)))
    if last is None:
        out = second(hidden)
    else:
        out = linear_call(second, hidden, last[0], lambda: last[1](nn.Linear.forward(second, hidden)))
    if grad:
        kept = cache.cached(first, _LINEAR), cache.cached(second, _LINEAR)
        if (
            None not in kept
            and kept[0][0] == mark
            and kept[1][0] == _linear_print(second, hidden, last_activation)
        ):
            (_, fast, p0, p1, cast), (_, then_fast, q0, q1, then_cast) = kept
            if cast == then_cast and hasattr(fast, "product") and hasattr(then_fast, "product"):
                products = (Product(*fast.product, p0, p1), Product(*then_fast.product, q0, q1), cast)
                cache.store(first, _LINEAR_PAIR, (mark, _own_print(second, last_activation), products))
    return out


def _own_print(module: nn.Linear, activation: str | None) -> tuple | None:
    """The part of a Linear's print its input does not decide: its type, parameters and the
    activation after it."""
    params = module._parameters
    if "weight" not in params or "bias" not in params:
        return None
    weight, bias = cache.tensor_print(params["weight"]), cache.tensor_print(params["bias"])
    return type(module), weight, bias, activation


def _linear_print(module: nn.Linear, input: Any, activation: str | None) -> tuple | None:
    """What the family's key for the call and its autocast wrapper's choice read: (the dtype
    input and weight are cast to inside the op or None, whether autograd records it, config
    version, ...); None where the call is not cached (tracing, a tensor subclass, autocast
    casting the arguments before the op)."""
    if torch.compiler.is_compiling() or type(input) not in _PLAIN:
        return None
    return linear_print_of(module, input.dtype, input.requires_grad, cache.tensor_print(input), activation)


def linear_print_of(
    module: nn.Linear, dtype: torch.dtype, requires_grad: bool, input_print: tuple, activation: str | None
) -> tuple | None:
    """``_linear_print`` of a call on a plain tensor of ``dtype`` and ``input_print``
    (``cache.tensor_print``'s) that requires grad or not: for a caller that knows what the
    input will be before it exists (a fused norm's output)."""
    params = module._parameters
    if "weight" not in params or "bias" not in params:
        return None  # an attribute of another kind (pruning, a parametrization): read by the call
    weight, bias = params["weight"], params["bias"]
    if weight is None:
        return None
    cast = cache.autocast_dtype()
    if cast is not None and not ops.matmul.casts_inside(cast, dtype, weight, bias):
        return None  # autocast casts the arguments before the op
    grad = torch.is_grad_enabled() and (
        requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    return (
        cast, grad, config.version, activation, type(module),
        input_print, cache.tensor_print(weight), cache.tensor_print(bias),
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Normalization.


_BN_STATE = ("running_mean", "running_var", "weight", "bias", "num_batches_tracked")
_bn_plain_state: dict[type, bool] = {}


def _bn_state(module: nn.Module) -> tuple:
    """``module``'s (running_mean, running_var, weight, bias, num_batches_tracked): read from its
    parameter and buffer dicts, where attribute lookup finds them through nn.Module.__getattr__
    (about 1.5 us each), unless its class defines one of the names (a parametrization's property)
    or a dict lacks one (deleted, or set as a plain attribute since): then as attributes."""
    cls = type(module)
    plain = _bn_plain_state.get(cls)
    if plain is None:
        plain = _bn_plain_state[cls] = not any(hasattr(cls, name) for name in _BN_STATE)
    if plain:
        p, b = module._parameters, module._buffers
        try:
            return b["running_mean"], b["running_var"], p["weight"], p["bias"], b["num_batches_tracked"]
        except KeyError:
            pass
    return tuple(getattr(module, name) for name in _BN_STATE)


class _BatchNormMixin:
    """torch's ``_BatchNorm.forward`` (momentum None = cumulative average, num_batches_tracked,
    running statistics used in eval) with ``tdnn.batch_norm``."""

    def _statistics(self) -> tuple:
        """(running_mean, running_var, weight, bias, batch_stats) as F.batch_norm takes them in
        the module's current mode: the running statistics None where not used."""
        running_mean, running_var, weight, bias, _ = _bn_state(self)
        batch_stats = self.training or (running_mean is None and running_var is None)
        if self.training and not self.track_running_stats:
            running_mean = running_var = None
        return running_mean, running_var, weight, bias, batch_stats

    def _batch_norm_args(self, input: torch.Tensor, counts: list[torch.Tensor] | None = None) -> tuple:
        """F.batch_norm's arguments for this call; counts the batch (num_batches_tracked), or
        with a fixed momentum appends the counter to ``counts`` for the caller to add one later."""
        self._check_input_dim(input)
        return (input, *_BatchNormMixin._counted_statistics(self, counts), self.eps)

    def _counted_statistics(self, counts: list[torch.Tensor] | None = None) -> tuple:
        """``_batch_norm_args`` without the input or its check, for callers that checked the input
        before: (running_mean, running_var, weight, bias, batch_stats, momentum factor)."""
        running_mean, running_var, weight, bias, batch_stats = _BatchNormMixin._statistics(self)
        batches = _bn_state(self)[4]
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and batches is not None:
            if counts is not None and self.momentum is not None:
                counts.append(batches)
            else:
                batches.add_(1)
                factor = 1.0 / float(batches) if self.momentum is None else self.momentum
        return running_mean, running_var, weight, bias, batch_stats, factor

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # Named through the class: SyncBatchNorm borrows this forward without the mixin.
        args = _BatchNormMixin._batch_norm_args(self, input)
        return run_or_fallback(self, input, lambda: ops.norm.batch_norm(*args), lambda: F.batch_norm(*args))

    def forward_relu(self, input: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``relu(self(input) + residual)`` (or ``relu(self(input))``) as one fused op, for
        ``Sequential`` and patch-time fusion (see fusion.py); a residual tdnn.batch_norm cannot
        take (another shape or dtype: torch would broadcast or promote) is added unfused."""
        args = _BatchNormMixin._batch_norm_args(self, input)  # SyncBatchNorm borrows this too

        def ours() -> torch.Tensor:
            if fusable_residual(residual, input):
                return ops.norm.batch_norm(*args, activation="relu", residual=residual)
            return ops.activation.relu(ops.norm.batch_norm(*args) + residual)

        def theirs() -> torch.Tensor:
            y = F.batch_norm(*args)
            return F.relu(y if residual is None else y + residual)

        return run_or_fallback(self, input, ours, theirs)


def fusable_residual(residual: torch.Tensor | None, input: torch.Tensor) -> bool:
    """Whether a batch norm's fused residual add takes ``residual`` (none, or a plain tensor of
    the input's shape and dtype: torch would broadcast or promote others, added unfused)."""
    return residual is None or (
        type(residual) in _PLAIN and residual.shape == input.shape and residual.dtype == input.dtype
    )


def fusable_batch_norm(module: object) -> bool:
    """A tritondnn batch norm whose forward is ours (not a subclass's own): ``forward_relu`` may
    stand in for its call, and the convolution before it may join it (conv_bn.py)."""
    return isinstance(module, _BatchNormMixin) and type(module).forward is _BatchNormMixin.forward


# The forwards whose module's ``forward_relu(x, r)`` computes ``relu(forward(x) [+ r])`` fused:
# a subclass overriding forward is not fused. sync_batchnorm.py adds SyncBatchNorm's.
RELU_FUSABLE_FORWARDS = {_BatchNormMixin.forward}


def relu_fusable_batch_norm(module: object) -> bool:
    """A tritondnn batch norm (synchronized or not) whose ``forward_relu`` may stand in for
    ``relu(module(x) [+ r])``."""
    return getattr(type(module), "forward", None) in RELU_FUSABLE_FORWARDS


class BatchNorm1d(_BatchNormMixin, nn.BatchNorm1d):
    """``torch.nn.BatchNorm1d`` through ``tdnn.batch_norm``."""


class BatchNorm2d(_BatchNormMixin, nn.BatchNorm2d):
    """``torch.nn.BatchNorm2d`` through ``tdnn.batch_norm``."""


class BatchNorm3d(_BatchNormMixin, nn.BatchNorm3d):
    """``torch.nn.BatchNorm3d`` through ``tdnn.batch_norm``."""


class _InstanceNormMixin:
    """torch's ``_InstanceNorm`` (its forward adds the batch dim of an unbatched input) with
    ``tdnn.instance_norm``."""

    def _apply_instance_norm(self, input: torch.Tensor) -> torch.Tensor:
        if self.training or not self.track_running_stats:
            F._verify_spatial_size(input.size())  # torch's error for one value per instance
        args = (
            input, self.running_mean, self.running_var, self.weight, self.bias,
            self.training or not self.track_running_stats,
            self.momentum if self.momentum is not None else 0.0, self.eps,
        )  # fmt: skip
        theirs = super()._apply_instance_norm
        return run_or_fallback(self, input, lambda: ops.norm.instance_norm(*args), lambda: theirs(input))


class InstanceNorm1d(_InstanceNormMixin, nn.InstanceNorm1d):
    """``torch.nn.InstanceNorm1d`` through ``tdnn.instance_norm``."""


class InstanceNorm2d(_InstanceNormMixin, nn.InstanceNorm2d):
    """``torch.nn.InstanceNorm2d`` through ``tdnn.instance_norm``."""


class InstanceNorm3d(_InstanceNormMixin, nn.InstanceNorm3d):
    """``torch.nn.InstanceNorm3d`` through ``tdnn.instance_norm``."""


def _norm_after_add(
    module: nn.Module, op: Callable[..., Any], input: torch.Tensor, residual: torch.Tensor, *args: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(module(input + residual), input + residual)``: ``op(input, residual, *args)`` in one pass,
    or the add and then ``module`` where ``op`` does not take the operands, or where autocast
    would run the norm in fp32 on a narrower sum (the fused op keeps the sum's dtype)."""

    def unfused() -> tuple[torch.Tensor, torch.Tensor]:
        total = input + residual
        return module(total), total

    if not add_norm_keeps_dtype(input):
        return unfused()
    return run_or_fallback(module, input, lambda: op(input, residual, *args), unfused)


def add_norm_keeps_dtype(input: torch.Tensor) -> bool:
    """Whether the fused add + norm on ``input`` (the sum in its dtype) computes what the add and
    the norm do: not under autocast with a narrower input, where torch's norm runs in fp32."""
    return input.dtype == torch.float32 or not torch.is_autocast_enabled(input.device.type)


class LayerNorm(nn.LayerNorm):
    """``torch.nn.LayerNorm`` through ``tdnn.layer_norm``."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        args = (input, self.normalized_shape, self.weight, self.bias, self.eps)
        return run_or_fallback(
            self, input, lambda: ops.norm.layer_norm(*args), lambda: nn.LayerNorm.forward(self, input)
        )

    def forward_add(self, input: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(self(input + residual), input + residual)`` in one pass (``tdnn.add_layer_norm``:
        ``residual`` in input's dtype or a narrower one); the add, then ``self``, where that op
        does not take the operands."""
        args = (self.normalized_shape, self.weight, self.bias, self.eps)
        return _norm_after_add(self, ops.norm.add_layer_norm, input, residual, *args)


class RMSNorm(nn.RMSNorm):
    """``torch.nn.RMSNorm`` through ``tdnn.rms_norm``."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        args = (input, self.normalized_shape, self.weight, self.eps)
        return run_or_fallback(
            self, input, lambda: ops.norm.rms_norm(*args), lambda: nn.RMSNorm.forward(self, input)
        )

    def forward_add(self, input: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(self(input + residual), input + residual)`` in one pass (``tdnn.add_rms_norm``), as
        ``LayerNorm.forward_add``."""
        return _norm_after_add(
            self, ops.norm.add_rms_norm, input, residual, self.normalized_shape, self.weight, self.eps
        )


class GroupNorm(nn.GroupNorm):
    """``torch.nn.GroupNorm`` through ``tdnn.group_norm``."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        args = (input, self.num_groups, self.weight, self.bias, self.eps)
        return run_or_fallback(
            self, input, lambda: ops.norm.group_norm(*args), lambda: nn.GroupNorm.forward(self, input)
        )


class LocalResponseNorm(nn.LocalResponseNorm):
    """``torch.nn.LocalResponseNorm`` through ``tdnn.local_response_norm``."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        args = (input, self.size, self.alpha, self.beta, self.k)
        return run_or_fallback(
            self,
            input,
            lambda: ops.pool.local_response_norm(*args),
            lambda: nn.LocalResponseNorm.forward(self, input),
        )


# ---------------------------------------------------------------------------------------------
# Pooling and resampling.


def _max_pool(fn: Callable[..., Any], base: type[nn.Module]) -> Callable[[nn.Module, torch.Tensor], Any]:
    def forward(self, input: torch.Tensor) -> Any:
        args = (input, self.kernel_size, self.stride, self.padding, self.dilation, self.ceil_mode)
        return run_or_fallback(
            self, input, lambda: fn(*args, self.return_indices), lambda: base.forward(self, input)
        )

    return forward


class MaxPool1d(nn.MaxPool1d):
    """``torch.nn.MaxPool1d`` through ``tdnn.max_pool1d``."""

    forward = _max_pool(ops.pool.max_pool1d, nn.MaxPool1d)


class MaxPool2d(nn.MaxPool2d):
    """``torch.nn.MaxPool2d`` through ``tdnn.max_pool2d``."""

    forward = _max_pool(ops.pool.max_pool2d, nn.MaxPool2d)


class MaxPool3d(nn.MaxPool3d):
    """``torch.nn.MaxPool3d`` through ``tdnn.max_pool3d``."""

    forward = _max_pool(ops.pool.max_pool3d, nn.MaxPool3d)


class AvgPool1d(nn.AvgPool1d):
    """``torch.nn.AvgPool1d`` through ``tdnn.avg_pool1d``."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        args = (input, self.kernel_size, self.stride, self.padding, self.ceil_mode, self.count_include_pad)
        return run_or_fallback(
            self, input, lambda: ops.pool.avg_pool1d(*args), lambda: nn.AvgPool1d.forward(self, input)
        )


def _avg_pool(fn: Callable[..., Any], base: type[nn.Module]) -> Callable[[nn.Module, torch.Tensor], Any]:
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        args = (
            input, self.kernel_size, self.stride, self.padding, self.ceil_mode, self.count_include_pad,
            self.divisor_override,
        )  # fmt: skip
        return run_or_fallback(self, input, lambda: fn(*args), lambda: base.forward(self, input))

    return forward


class AvgPool2d(nn.AvgPool2d):
    """``torch.nn.AvgPool2d`` through ``tdnn.avg_pool2d``."""

    forward = _avg_pool(ops.pool.avg_pool2d, nn.AvgPool2d)


class AvgPool3d(nn.AvgPool3d):
    """``torch.nn.AvgPool3d`` through ``tdnn.avg_pool3d``."""

    forward = _avg_pool(ops.pool.avg_pool3d, nn.AvgPool3d)


def _adaptive(
    fn: Callable[..., Any], base: type[nn.Module], with_indices: bool
) -> Callable[[nn.Module, torch.Tensor], Any]:
    def forward(self, input: torch.Tensor) -> Any:
        args = (input, self.output_size, self.return_indices) if with_indices else (input, self.output_size)
        return run_or_fallback(self, input, lambda: fn(*args), lambda: base.forward(self, input))

    return forward


class AdaptiveAvgPool1d(nn.AdaptiveAvgPool1d):
    """``torch.nn.AdaptiveAvgPool1d`` through ``tdnn.adaptive_avg_pool1d``."""

    forward = _adaptive(ops.pool.adaptive_avg_pool1d, nn.AdaptiveAvgPool1d, False)


class AdaptiveAvgPool2d(nn.AdaptiveAvgPool2d):
    """``torch.nn.AdaptiveAvgPool2d`` through ``tdnn.adaptive_avg_pool2d``."""

    forward = _adaptive(ops.pool.adaptive_avg_pool2d, nn.AdaptiveAvgPool2d, False)


class AdaptiveAvgPool3d(nn.AdaptiveAvgPool3d):
    """``torch.nn.AdaptiveAvgPool3d`` through ``tdnn.adaptive_avg_pool3d``."""

    forward = _adaptive(ops.pool.adaptive_avg_pool3d, nn.AdaptiveAvgPool3d, False)


class AdaptiveMaxPool1d(nn.AdaptiveMaxPool1d):
    """``torch.nn.AdaptiveMaxPool1d`` through ``tdnn.adaptive_max_pool1d``."""

    forward = _adaptive(ops.pool.adaptive_max_pool1d, nn.AdaptiveMaxPool1d, True)


class AdaptiveMaxPool2d(nn.AdaptiveMaxPool2d):
    """``torch.nn.AdaptiveMaxPool2d`` through ``tdnn.adaptive_max_pool2d``."""

    forward = _adaptive(ops.pool.adaptive_max_pool2d, nn.AdaptiveMaxPool2d, True)


class AdaptiveMaxPool3d(nn.AdaptiveMaxPool3d):
    """``torch.nn.AdaptiveMaxPool3d`` through ``tdnn.adaptive_max_pool3d``."""

    forward = _adaptive(ops.pool.adaptive_max_pool3d, nn.AdaptiveMaxPool3d, True)


class Upsample(nn.Upsample):
    """``torch.nn.Upsample`` through ``tdnn.interpolate`` (torch's forward for the modes it has no
    kernel for)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        args = (input, self.size, self.scale_factor, self.mode, self.align_corners)
        return run_or_fallback(
            self,
            input,
            lambda: ops.pool.interpolate(*args, recompute_scale_factor=self.recompute_scale_factor),
            lambda: nn.Upsample.forward(self, input),
        )


# ---------------------------------------------------------------------------------------------
# Activations, softmax, dropout.


class ReLU(nn.ReLU):
    """``torch.nn.ReLU`` through ``tdnn.relu``."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return run_or_fallback(
            self,
            input,
            lambda: ops.activation.relu(input, self.inplace),
            lambda: nn.ReLU.forward(self, input),
        )


class LeakyReLU(nn.LeakyReLU):
    """``torch.nn.LeakyReLU`` through ``tdnn.leaky_relu``."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        args = (input, self.negative_slope, self.inplace)
        return run_or_fallback(
            self, input, lambda: ops.activation.leaky_relu(*args), lambda: nn.LeakyReLU.forward(self, input)
        )


class GELU(nn.GELU):
    """``torch.nn.GELU`` through ``tdnn.gelu``."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return run_or_fallback(
            self,
            input,
            lambda: ops.activation.gelu(input, self.approximate),
            lambda: nn.GELU.forward(self, input),
        )


class SiLU(nn.SiLU):
    """``torch.nn.SiLU`` through ``tdnn.silu``."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return run_or_fallback(
            self,
            input,
            lambda: ops.activation.silu(input, self.inplace),
            lambda: nn.SiLU.forward(self, input),
        )


class Sigmoid(nn.Sigmoid):
    """``torch.nn.Sigmoid`` through ``tdnn.sigmoid``."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return run_or_fallback(
            self, input, lambda: ops.activation.sigmoid(input), lambda: nn.Sigmoid.forward(self, input)
        )


class Tanh(nn.Tanh):
    """``torch.nn.Tanh`` through ``tdnn.tanh``."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return run_or_fallback(
            self, input, lambda: ops.activation.tanh(input), lambda: nn.Tanh.forward(self, input)
        )


class ELU(nn.ELU):
    """``torch.nn.ELU`` through ``tdnn.elu``."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        args = (input, self.alpha, self.inplace)
        return run_or_fallback(
            self, input, lambda: ops.activation.elu(*args), lambda: nn.ELU.forward(self, input)
        )


class Softplus(nn.Softplus):
    """``torch.nn.Softplus`` through ``tdnn.softplus``."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        args = (input, self.beta, self.threshold)
        return run_or_fallback(
            self, input, lambda: ops.activation.softplus(*args), lambda: nn.Softplus.forward(self, input)
        )


class Softmax(nn.Softmax):
    """``torch.nn.Softmax`` through ``tdnn.softmax``."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return run_or_fallback(
            self,
            input,
            lambda: ops.softmax.softmax(input, self.dim, _stacklevel=5),
            lambda: nn.Softmax.forward(self, input),
        )


class LogSoftmax(nn.LogSoftmax):
    """``torch.nn.LogSoftmax`` through ``tdnn.log_softmax``."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return run_or_fallback(
            self,
            input,
            lambda: ops.softmax.log_softmax(input, self.dim, _stacklevel=5),
            lambda: nn.LogSoftmax.forward(self, input),
        )


class CrossEntropyLoss(nn.CrossEntropyLoss):
    """``torch.nn.CrossEntropyLoss`` through ``tdnn.cross_entropy`` (one pass over the logits
    forward, one backward; no log-probability tensor)."""

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return run_or_fallback(
            self,
            input,
            lambda: ops.cross_entropy.cross_entropy(
                input,
                target,
                self.weight,
                ignore_index=self.ignore_index,
                reduction=self.reduction,
                label_smoothing=self.label_smoothing,
            ),
            lambda: nn.CrossEntropyLoss.forward(self, input, target),
        )


class Dropout(nn.Dropout):
    """``torch.nn.Dropout`` through ``tdnn.dropout`` (its Philox seed drawn from torch's default
    generator, so ``torch.manual_seed`` reproduces a run, though not torch's own mask)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        args = (input, self.p, self.training, self.inplace)
        return run_or_fallback(
            self, input, lambda: ops.dropout.dropout(*args), lambda: nn.Dropout.forward(self, input)
        )


class Embedding(nn.Embedding):
    """``torch.nn.Embedding`` through ``tdnn.embedding`` (the weight gradient a scatter-add of
    the output gradient's rows; ``sparse`` and ``scale_grad_by_freq`` run torch's)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        args = (self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq, self.sparse)
        return run_or_fallback(
            self,
            self.weight,
            lambda: ops.embedding.embedding(input, self.weight, *args),
            lambda: nn.Embedding.forward(self, input),
        )


# ---------------------------------------------------------------------------------------------
# Fusion helpers (containers.py and fusion.py fuse modules whose calls these allow).


def _hooked(module: nn.Module) -> bool:
    """Whether hooks would see ``module``'s own call (fusing it away would skip them)."""
    glob = torch.nn.modules.module
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
        or glob._global_forward_hooks
        or glob._global_forward_pre_hooks
        or glob._global_backward_hooks
        or glob._global_backward_pre_hooks
    )
