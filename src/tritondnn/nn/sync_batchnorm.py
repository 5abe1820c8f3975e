"""``SyncBatchNorm``: batch normalization over the global batch of a torch.distributed group.

Per layer and step, one all-gather of each rank's per-channel (count, mean, M2) in the forward
pass and one all-reduce of the per-channel (sum dy, sum dy * x_hat) in the backward pass; the
device work between them is ``ops.norm.batch_sync``'s (a few kernels, no host synchronization).
Ranks may hold different batch sizes (even none).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..ops.norm.batch_sync import sync_batch_norm_backward, sync_batch_norm_forward
from .layers import BatchNorm1d, on_backend

# torch 2.13 renamed all_gather_into_tensor (a stack of every rank's tensor into one output).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps, group):
        def all_gather(out: torch.Tensor, local: torch.Tensor) -> None:
            _all_gather_single(out, local, group=group)

        world = dist.get_world_size(group)
        y, mean, invstd, count = sync_batch_norm_forward(
            x, weight, bias, running_mean, running_var, momentum, eps, world, all_gather
        )
        ctx.save_for_backward(x, weight, mean, invstd, count)
        ctx.group = group
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, invstd, count = ctx.saved_tensors
        group = ctx.group

        def all_reduce(t: torch.Tensor) -> None:
            dist.all_reduce(t, group=group)

        dx, sum_dy, sum_dy_xhat = sync_batch_norm_backward(
            dy, x, weight, mean, invstd, count, all_reduce, ctx.needs_input_grad[0]
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
