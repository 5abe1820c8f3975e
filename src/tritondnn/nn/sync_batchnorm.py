"""``SyncBatchNorm``: batch normalization over the global batch of a torch.distributed group.

Per layer and step, one all-gather of each rank's per-channel (count, mean, M2) in the forward
pass and one all-reduce of the per-channel (sum dy, sum dy * x_hat) in the backward pass; the
device work between them is ``ops.norm.batch_sync``'s (a few kernels, no host synchronization).
Ranks may hold different batch sizes (even none). ``forward_relu`` fuses a following ReLU, with a
residual add before it or not, into the same passes (``patch(model, fuse=True)`` uses it, as for
the one-process batch norm).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..ops.activation import relu as relu_op
from ..ops.norm.batch import _through_residual_activation
from ..ops.norm.batch_sync import sync_batch_norm_backward, sync_batch_norm_forward
from ..ops.norm.common import NO_ACTIVATION, activation_kind
from .layers import RELU_FUSABLE_FORWARDS, BatchNorm1d, fusable_residual, on_backend

_RELU = activation_kind("relu")  # (kind, negative slope, clip) as the norm kernels take them
_NONE = (NO_ACTIVATION, 0.0, 0.0)

# torch 2.13 renamed all_gather_into_tensor (a stack of every rank's tensor into one output).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _SyncBatchNormFunction(torch.autograd.Function):
    """``relu(bn(x) + residual)``, ``relu(bn(x))`` or ``bn(x)`` over the group's batch; ``act``:
    the activation's (kind, p0, p1)."""

    @staticmethod
    def forward(ctx, x, weight, bias, residual, running_mean, running_var, momentum, eps, group, act):
        def all_gather(out: torch.Tensor, local: torch.Tensor) -> None:
            _all_gather_single(out, local, group=group)

        world = dist.get_world_size(group)
        y, mean, invstd, count = sync_batch_norm_forward(
            x, weight, bias, running_mean, running_var, momentum, eps, world, all_gather, *act, residual
        )
        # With a residual the activation's gradient comes from the output (the pre-activation
        # values need the residual, which is not kept); without one, from recomputed values.
        through_output = residual is not None and act[0] != NO_ACTIVATION
        ctx.save_for_backward(x, weight, bias, mean, invstd, count, y if through_output else None)
        ctx.params = group, act, residual is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, mean, invstd, count, y = ctx.saved_tensors
        group, act, with_residual = ctx.params

        def all_reduce(t: torch.Tensor) -> None:
            dist.all_reduce(t, group=group)

        dr = None
        if with_residual:
            dy = dr = _through_residual_activation(dy, y, *act)
            act = _NONE
        dx, sum_dy, sum_dy_xhat = sync_batch_norm_backward(
            dy, x, weight, mean, invstd, count, all_reduce, ctx.needs_input_grad[0], bias, *act
        )
        # Parameter gradients stay local, as torch's SyncBatchNorm: DDP averages them.
        dw = sum_dy_xhat.to(weight.dtype) if ctx.needs_input_grad[1] else None
        db = sum_dy.to(ctx.bias_dtype) if ctx.needs_input_grad[2] else None
        dr = dr if ctx.needs_input_grad[3] else None
        return dx, dw, db, dr, None, None, None, None, None, None


class SyncBatchNorm(nn.SyncBatchNorm):
    """``torch.nn.SyncBatchNorm`` over tritondnn's statistics and finalize-apply kernels.

    The same constructor, parameters, buffers and ``state_dict`` as torch's. In training inside
    an initialized process group of more than one rank, the statistics cover the group's whole
    batch; otherwise it is ``tdnn.nn.BatchNorm*d``.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._forward(input, None, False)

    def forward_relu(self, input: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``relu(self(input) + residual)`` (or ``relu(self(input))``) as one fused op over the
        group's batch, as ``tdnn.nn.BatchNorm2d.forward_relu`` does in one process (for
        ``Sequential`` and patch-time fusion); a residual of another shape or dtype than the
        input's (torch would broadcast or promote) is added unfused."""
        return self._forward(input, residual, True)

    def _forward(self, input: torch.Tensor, residual: torch.Tensor | None, relu: bool) -> torch.Tensor:
        self._check_input_dim(input)
        self._check_non_zero_input_channels(input)
        group = self.process_group or (dist.group.WORLD if dist.is_available() else None)
        sync = (
            self.training and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
        )
        if not sync:
            if relu:
                return BatchNorm1d.forward_relu(self, input, residual)
            return BatchNorm1d.forward(self, input)
        if not on_backend(input):  # torch's (and its errors) off our device
            y = nn.SyncBatchNorm.forward(self, input)
            return torch.relu(y if residual is None else y + residual) if relu else y
        if not fusable_residual(residual, input):
            return relu_op(self._forward(input, None, False) + residual)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        rm = self.running_mean if self.track_running_stats else None
        rv = self.running_var if self.track_running_stats else None
        act = _RELU if relu else _NONE
        return _SyncBatchNormFunction.apply(
            input, self.weight, self.bias, residual, rm, rv, factor, self.eps, group, act
        )

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    @classmethod
    def convert_sync_batchnorm(cls, module: nn.Module, process_group=None) -> nn.Module:
        """torch's conversion of every BatchNorm*d in ``module``, into tritondnn's SyncBatchNorm."""
        converted = nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group)
        for m in converted.modules():
            if type(m) is nn.SyncBatchNorm:
                m.__class__ = cls
        return converted


RELU_FUSABLE_FORWARDS.add(SyncBatchNorm.forward)
