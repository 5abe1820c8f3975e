"""Containers whose forward fuses neighbouring modules: a patched ``Sequential``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .conv_bn import conv_batch_norm
from .layers import (
    GELU,
    Conv2d,
    Linear,
    ReLU,
    Sigmoid,
    SiLU,
    Tanh,
    _hooked,
    fusable_batch_norm,
    linear_call,
    linear_pair_call,
    on_backend,
    relu_fusable_batch_norm,
)


def _fusable_activation(module: nn.Module) -> str | None:
    """The epilogue activation a (tritondnn) activation module computes, if a matmul can fuse it."""
    kind = type(module)
    if kind is GELU:
        return "gelu_tanh" if module.approximate == "tanh" else "gelu"  # type: ignore[union-attr]
    return _EPILOGUE_ACTIVATIONS.get(kind)


_EPILOGUE_ACTIVATIONS: dict[type, str] = {ReLU: "relu", SiLU: "silu", Sigmoid: "sigmoid", Tanh: "tanh"}


def _linear_activation(linear: nn.Linear, then: nn.Module, activation: str, x: torch.Tensor) -> torch.Tensor:
    return linear_call(linear, x, activation, lambda: then(nn.Linear.forward(linear, x)))


def linear_pair_at(modules: list[nn.Module], i: int) -> tuple | None:
    """(first Linear, its activation's name, the activation module, second Linear, the second's
    activation (name, module) or None, how many modules that is) where ``modules[i:]`` begins
    with tritondnn's Linear, a fusable activation, Linear and maybe another fusable activation,
    none of them with hooks (one node: ``layers.linear_pair_call``); else None."""
    first, then, second, last = (modules[j] if j < len(modules) else None for j in range(i, i + 4))
    if type(first) is not Linear or type(second) is not Linear or any(map(_hooked, (first, then, second))):
        return None
    activation = _fusable_activation(then)
    if activation is None:
        return None
    last_activation = None if last is None or _hooked(last) else _fusable_activation(last)
    if last_activation is None:
        return first, activation, then, second, None, 3
    return first, activation, then, second, (last_activation, last), 4


def _relu(module: nn.Module | None) -> bool:
    return type(module) is ReLU and not _hooked(module)


class Sequential(nn.Sequential):
    """``torch.nn.Sequential`` that runs neighbouring modules as one fused op, as cuDNN's runtime
    fusion joins a matmul or convolution and what follows it:

    - Linear + GELU, ReLU, SiLU, Sigmoid or Tanh: one ``tdnn.linear`` with the activation in its
      epilogue (the activation's gradient joins the bias gradient's kernel); followed by another
      Linear (a transformer's MLP), the two products as one autograd node where autograd records
      (``layers.linear_pair_call``);
    - Conv2d + BatchNorm (+ ReLU): one autograd node (``conv_bn.conv_batch_norm``);
    - BatchNorm + ReLU: one ``tdnn.batch_norm(..., activation="relu")``.

    All of them tritondnn's modules. A module with hooks, or an input off the backend's device,
    runs module by module as torch's."""

    def forward(self, input: Any) -> Any:
        modules = list(self._modules.values())
        i = 0
        while i < len(modules):
            module = modules[i]
            then = modules[i + 1] if i + 1 < len(modules) else None
            pair = then is not None and on_backend(input) and not (_hooked(module) or _hooked(then))
            activation = _fusable_activation(then) if pair and type(module) is Linear else None
            products = linear_pair_at(modules, i) if activation is not None else None
            if products is not None:
                *parts, taken = products
                input = linear_pair_call(*parts[:4], input, parts[4])
                i += taken
            elif activation is not None:
                input = _linear_activation(module, then, activation, input)
                i += 2
            elif pair and type(module) is Conv2d and fusable_batch_norm(then):
                relu = i + 2 < len(modules) and _relu(modules[i + 2])
                input = conv_batch_norm(module, then, input, None, relu)
                i += 3 if relu else 2
            elif pair and relu_fusable_batch_norm(module) and _relu(then):
                input = module.forward_relu(input)
                i += 2
            else:
                input = module(input)
                i += 1
        return input
