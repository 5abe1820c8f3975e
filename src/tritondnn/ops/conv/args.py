"""Argument rules of the public convolution functions (torch.nn.functional's, plus cuDNN's
asymmetric padding), checked before anything launches."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ...core.checks import check_tensor
from ..epilogue import Epilogue
from .problem import DTYPES, output_size

Pads = tuple[tuple[int, int], ...]


def int_tuple(op: str, name: str, value: Any, nd: int, minimum: int) -> tuple[int, ...]:
    """An int or a sequence of ``nd`` ints (one is broadcast), each at least ``minimum``."""
    items = (value,) * nd if isinstance(value, int) and not isinstance(value, bool) else value
    try:
        items = tuple(items)
    except TypeError:
        raise TypeError(
            f"{op}: argument '{name}' must be an int or a tuple of {nd} ints, got {value!r}"
        ) from None
    if len(items) == 1 and nd > 1:
        items = items * nd
    if len(items) != nd or not all(isinstance(v, int) and not isinstance(v, bool) for v in items):
        raise ValueError(f"{op}: argument '{name}'={value!r}; accepted: an int or a tuple of {nd} ints")
    if any(v < minimum for v in items):
        raise ValueError(f"{op}: argument '{name}'={value!r} must be >= {minimum} in every dimension")
    return items


def padding_pairs(
    op: str, padding: Any, nd: int, kernel: Sequence[int], stride: Sequence[int], dilation: Sequence[int]
) -> Pads:
    """Per-dimension (pre, post) padding from an int, ``nd`` ints, ``nd`` (pre, post) pairs, or
    'valid' / 'same' (stride 1 only; an odd total puts the extra element after, as PyTorch)."""
    if isinstance(padding, str):
        if padding == "valid":
            return ((0, 0),) * nd
        if padding == "same":
            if any(s != 1 for s in stride):
                raise ValueError(f"{op}: padding='same' is not supported for strided convolutions")
            total = [d * (k - 1) for k, d in zip(kernel, dilation)]
            return tuple((t // 2, t - t // 2) for t in total)
        raise ValueError(
            f"{op}: argument 'padding'={padding!r}; accepted: 'valid', 'same', ints or (pre, post) pairs"
        )
    if isinstance(padding, (tuple, list)) and padding and all(isinstance(p, (tuple, list)) for p in padding):
        if len(padding) != nd or not all(len(p) == 2 for p in padding):
            raise ValueError(f"{op}: argument 'padding'={padding!r}; accepted: {nd} (pre, post) pairs")
        flat = int_tuple(op, "padding", [v for p in padding for v in p], 2 * nd, 0)
        return tuple((flat[2 * i], flat[2 * i + 1]) for i in range(nd))
    sym = int_tuple(op, "padding", padding, nd, 0)
    return tuple((p, p) for p in sym)


def check_groups(op: str, groups: Any) -> int:
    if isinstance(groups, bool) or not isinstance(groups, int):
        raise TypeError(f"{op}: argument 'groups' must be an int, got {groups!r}")
    if groups < 1:
        raise ValueError(f"{op}: argument 'groups'={groups} must be >= 1")
    return groups


def check_input_weight(op: str, input: Any, weight: Any, nd: int) -> tuple[torch.Tensor, bool]:
    """(input with a batch dimension, whether it was added); checks dtypes, devices and ranks."""
    check_tensor(op, "input", input, dtypes=DTYPES)
    check_tensor(op, "weight", weight, dtypes=DTYPES)
    if input.ndim not in (nd + 1, nd + 2):
        raise ValueError(
            f"{op}: argument 'input' has {input.ndim} dimensions; accepted: {nd + 1} (unbatched) or "
            f"{nd + 2} (batched)"
        )
    if weight.ndim != nd + 2:
        raise ValueError(f"{op}: argument 'weight' has {weight.ndim} dimensions; accepted: {nd + 2}")
    if weight.dtype != input.dtype:
        raise TypeError(f"{op}: argument 'weight' has dtype {weight.dtype} but 'input' has {input.dtype}")
    if weight.device != input.device:
        raise ValueError(f"{op}: argument 'weight' is on {weight.device} but 'input' is on {input.device}")
    unbatched = input.ndim == nd + 1
    return (input.unsqueeze(0) if unbatched else input), unbatched


def check_bias(op: str, bias: Any, channels: int, x: torch.Tensor) -> torch.Tensor | None:
    if bias is None:
        return None
    check_tensor(op, "bias", bias, dtypes=DTYPES)
    if bias.shape != (channels,):
        raise ValueError(f"{op}: argument 'bias' has shape {tuple(bias.shape)}; accepted: ({channels},)")
    if bias.dtype != x.dtype:
        raise TypeError(f"{op}: argument 'bias' has dtype {bias.dtype} but 'input' has {x.dtype}")
    if bias.device != x.device:
        raise ValueError(f"{op}: argument 'bias' is on {bias.device} but 'input' is on {x.device}")
    return bias.contiguous()


def output_shape(
    op: str, x: torch.Tensor, weight_shape: Sequence[int], stride, pads: Pads, dilation
) -> tuple[int, ...]:
    out = []
    for i, (size, k, s, (pre, post), d) in enumerate(
        zip(x.shape[2:], weight_shape[2:], stride, pads, dilation)
    ):
        o = output_size(size, k, s, pre, post, d)
        if o < 1:
            raise ValueError(
                f"{op}: the kernel ({k}, dilation {d}: extent {d * (k - 1) + 1}) is larger than the padded "
                f"input ({size} + {pre} + {post}) in spatial dimension {i}"
            )
        out.append(o)
    return (x.shape[0], weight_shape[0], *out)


def check_epilogue(
    op: str,
    epilogue: Any,
    bias: torch.Tensor | None,
    c: Any,
    residual: Any,
    out_shape: Sequence[int],
    x: torch.Tensor,
    unbatched: bool,
) -> tuple[Epilogue, torch.Tensor | None, torch.Tensor | None]:
    """The epilogue (default: none) and its C and residual tensors, with the output's shape."""
    if epilogue is not None and not isinstance(epilogue, Epilogue):
        raise TypeError(
            f"{op}: argument 'epilogue' must be a tdnn.Epilogue or None, got {type(epilogue).__name__}"
        )
    epi = epilogue or Epilogue()
    if epi.bias != "none" and bias is None:
        raise ValueError(f"{op}: epilogue.bias={epi.bias!r} but no 'bias' tensor was given")
    if (c is None) != (epi.beta == 0.0):
        raise ValueError(
            f"{op}: argument 'c' must be given exactly when epilogue.beta is non-zero (beta={epi.beta})"
        )
    if (residual is None) == epi.residual:
        raise ValueError(f"{op}: argument 'residual' must be given exactly when epilogue.residual is True")
    shape = tuple(out_shape[1:]) if unbatched else tuple(out_shape)
    tensors = []
    for name, t in (("c", c), ("residual", residual)):
        if t is not None:
            check_tensor(op, name, t, dtypes=DTYPES)
            if tuple(t.shape) != shape:
                raise ValueError(f"{op}: argument '{name}' has shape {tuple(t.shape)}; accepted: {shape}")
            if t.device != x.device:
                raise ValueError(f"{op}: argument '{name}' is on {t.device} but 'input' is on {x.device}")
            t = t.unsqueeze(0) if unbatched else t
        tensors.append(t)
    return epi, tensors[0], tensors[1]
