"""The meaning of every convolution, in float64 with plain PyTorch (the tests' reference).

Padding is given per spatial dimension as (pre, post) pairs, cuDNN's asymmetric padding; the
symmetric torch.nn.functional case is (p, p).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def _pad_arg(padding: Sequence[tuple[int, int]]) -> list[int]:
    """F.pad's argument (last dimension first) for per-dimension (pre, post) pairs."""
    return [p for pre_post in reversed(list(padding)) for p in pre_post]


def conv_reference(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: Sequence[int] = (1,),
    padding: Sequence[tuple[int, int]] = ((0, 0),),
    dilation: Sequence[int] = (1,),
    groups: int = 1,
) -> torch.Tensor:
    """Cross-correlation of x (N, C, *spatial) with w (Cout, C / groups, *kernel) plus bias, in
    float64, with per-dimension (pre, post) zero padding."""
    nd = x.ndim - 2
    xp = F.pad(x.double(), _pad_arg(padding))
    b = None if bias is None else bias.double()
    return _CONV[nd](xp, w.double(), b, tuple(stride), 0, tuple(dilation), groups)


def conv_transpose_reference(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: Sequence[int] = (1,),
    padding: Sequence[int] = (0,),
    output_padding: Sequence[int] = (0,),
    groups: int = 1,
    dilation: Sequence[int] = (1,),
) -> torch.Tensor:
    """F.conv_transpose{1,2,3}d in float64."""
    nd = x.ndim - 2
    b = None if bias is None else bias.double()
    return _CONV_T[nd](
        x.double(),
        w.double(),
        b,
        tuple(stride),
        tuple(padding),
        tuple(output_padding),
        groups,
        tuple(dilation),
    )


def conv_backward_reference(
    x: torch.Tensor,
    w: torch.Tensor,
    dy: torch.Tensor,
    stride: Sequence[int],
    padding: Sequence[tuple[int, int]],
    dilation: Sequence[int],
    groups: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dw) of ``conv_reference`` for the output gradient dy, in float64 by autograd."""
    xd = x.detach().double().requires_grad_(True)
    wd = w.detach().double().requires_grad_(True)
    y = conv_reference(xd, wd, None, stride, padding, dilation, groups)
    dx, dw = torch.autograd.grad(y, (xd, wd), dy.double())
    return dx, dw
