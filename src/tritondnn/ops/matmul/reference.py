"""The meaning of ``tdnn.matmul`` and ``tdnn.linear``, in float64 with plain PyTorch."""

from __future__ import annotations

import torch

from ..activation import activation_reference
from ..epilogue import Epilogue


def matmul_reference(
    input: torch.Tensor,
    other: torch.Tensor,
    *,
    epilogue: Epilogue | None = None,
    c: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    scale_a: torch.Tensor | None = None,
    scale_b: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, pre-activation) of ``tdnn.matmul`` in float64: ``torch.matmul`` of the operands
    (times their scales), then ``act(alpha * . + beta * c + bias) + residual``.

    A per-row bias follows the output's second-to-last dimension (M); with a 1-D ``input`` the
    output has no such dimension and M is 1.
    """
    epi = epilogue or Epilogue()
    a, b = input.double(), other.double()
    if scale_a is not None:
        a = a * scale_a.double()
    if scale_b is not None:
        b = b * scale_b.double()
    pre = epi.alpha * torch.matmul(a, b)
    if c is not None:
        pre = pre + epi.beta * c.double()
    if bias is not None:
        if epi.bias == "col":
            pre = pre + bias.double()
        elif input.ndim == 1:
            pre = pre + bias.double()[0]
        else:
            pre = pre + bias.double()[:, None] if other.ndim > 1 else pre + bias.double()
    out = pre if epi.activation is None else activation_reference(pre, epi.activation_kind, *epi.params)
    if residual is not None:
        out = out + residual.double()
    return out, pre


def linear_reference(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str | None = None,
    activation_params: tuple[float, ...] = (),
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``act(F.linear(input, weight, bias)) + residual`` in float64."""
    epi = Epilogue(activation=activation, activation_params=activation_params)
    out = torch.nn.functional.linear(input.double(), weight.double(), None if bias is None else bias.double())
    if activation is not None:
        out = activation_reference(out, epi.activation_kind, *epi.params)
    return out if residual is None else out + residual.double()
