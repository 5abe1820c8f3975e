"""The meaning of every op of the family: PyTorch's own functions evaluated in float64.

Tests and the demo compare against these. The max-pool index convention is PyTorch's: the flat
position ``(d * H + h) * W + w`` of the chosen element within its (n, c) plane, the first maximum
in window order (depth, then rows, then columns), a NaN winning over any number.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_MAX = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_AVG = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}
_ADAPTIVE_MAX = {1: F.adaptive_max_pool1d, 2: F.adaptive_max_pool2d, 3: F.adaptive_max_pool3d}
_ADAPTIVE_AVG = {1: F.adaptive_avg_pool1d, 2: F.adaptive_avg_pool2d, 3: F.adaptive_avg_pool3d}


def max_pool_reference(x: torch.Tensor, dims: int, *args, **kwargs):
    """``F.max_pool{dims}d`` on ``x`` in float64 (with indices if ``return_indices=True``)."""
    return _MAX[dims](x.double(), *args, **kwargs)


def avg_pool_reference(x: torch.Tensor, dims: int, *args, **kwargs) -> torch.Tensor:
    """``F.avg_pool{dims}d`` on ``x`` in float64."""
    return _AVG[dims](x.double(), *args, **kwargs)


def adaptive_max_pool_reference(x: torch.Tensor, dims: int, output_size, return_indices: bool = False):
    """``F.adaptive_max_pool{dims}d`` on ``x`` in float64."""
    return _ADAPTIVE_MAX[dims](x.double(), output_size, return_indices)


def adaptive_avg_pool_reference(x: torch.Tensor, dims: int, output_size) -> torch.Tensor:
    """``F.adaptive_avg_pool{dims}d`` on ``x`` in float64."""
    return _ADAPTIVE_AVG[dims](x.double(), output_size)


def local_response_norm_reference(
    x: torch.Tensor, size: int, alpha: float = 1e-4, beta: float = 0.75, k: float = 1.0
) -> torch.Tensor:
    """``x / (k + alpha / size * sum of x**2 over the channel window)**beta`` in float64."""
    return F.local_response_norm(x.double(), size, alpha, beta, k)


def interpolate_reference(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """``F.interpolate`` on ``x`` in float64."""
    return F.interpolate(x.double(), *args, **kwargs)
