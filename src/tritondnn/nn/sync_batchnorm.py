"""``SyncBatchNorm``: batch normalization over the global batch of a torch.distributed group.

Forward: each rank's per-channel statistics (``batch_norm_stats``) become (count, mean, M2) —
M2 the sum of squared deviations from the rank's own mean — gathered across the group in one
collective and combined with Chan's parallel formula (exact, and free of the cancellation that
summing raw squares over ranks would suffer for large means); the finalize + apply kernel then
normalizes. Backward: the per-channel ``sum(dy)`` and ``sum(dy * x_hat)`` of each rank are summed
by one all-reduce before the elementwise pass. Ranks may hold different batch sizes (even none).
Counts stay on the device: no host synchronization.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..ops.norm import (
    batch_norm_apply,
    batch_norm_backward_apply,
    batch_norm_backward_reduce,
    batch_norm_stats,
)
from .layers import BatchNorm1d, on_backend


def _global_statistics(x: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean, biased variance, count) per channel over every rank's ``x``, fp32."""
    total, total_sq, shift, n = batch_norm_stats(x)
    local_n = max(n, 1)
    centred = total / local_n
    local = torch.stack([
        torch.full_like(total, float(n)),
        shift + centred,
        total_sq - total * centred,  # M2 about the local mean
    ])  # fmt: skip
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    counts, means, m2 = torch.stack(gathered).unbind(1)  # each (world, C)
    count = counts.sum(0)
    mean = (counts * means).sum(0) / count
    m2 = (m2 + counts * (means - mean) ** 2).sum(0)
    return mean, m2 / count, count


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps, group):
        mean, var, count = _global_statistics(x, group)
        # finalize + apply from the combined statistics: shift = mean and zero centred sum.
        y, mean, invstd = batch_norm_apply(x, torch.zeros_like(mean), var, mean, 1, weight, bias, eps=eps)
        if running_mean is not None:
            unbiased = var * count / (count - 1).clamp_min(1)
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        ctx.save_for_backward(x, weight, mean, invstd, count)
        ctx.group = group
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, invstd, count = ctx.saved_tensors
        sum_dy, sum_dy_xhat = batch_norm_backward_reduce(dy, x, mean, invstd, weight)
        channels = sum_dy.shape[0]
        both = torch.cat([sum_dy, sum_dy_xhat])
        dist.all_reduce(both, group=ctx.group)
        dx = None
        if ctx.needs_input_grad[0]:
            dx = batch_norm_backward_apply(
                dy, x, mean, invstd, weight, both[:channels] / count, both[channels:] / count, 1.0
            )
        # Parameter gradients stay local, as torch's SyncBatchNorm: DDP averages them.
        dw = sum_dy_xhat.to(weight.dtype) if ctx.needs_input_grad[1] else None
        db = sum_dy.to(ctx.bias_dtype) if ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None, None, None, None


class SyncBatchNorm(nn.SyncBatchNorm):
    """``torch.nn.SyncBatchNorm`` over tritondnn's statistics and finalize-apply kernels.

    The same constructor, parameters, buffers and ``state_dict`` as torch's. In training inside
    an initialized process group of more than one rank, the statistics cover the group's whole
    batch; otherwise it is ``tdnn.nn.BatchNorm*d``.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        self._check_non_zero_input_channels(input)
        group = self.process_group or (dist.group.WORLD if dist.is_available() else None)
        sync = (
            self.training and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
        )
        if not sync:
            return BatchNorm1d.forward(self, input)
        if not on_backend(input):
            return nn.SyncBatchNorm.forward(self, input)  # torch's (and its errors) off our device
        factor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        rm = self.running_mean if self.track_running_stats else None
        rv = self.running_var if self.track_running_stats else None
        return _SyncBatchNormFunction.apply(input, self.weight, self.bias, rm, rv, factor, self.eps, group)

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
