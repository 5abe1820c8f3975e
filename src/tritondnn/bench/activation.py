"""Activation benchmarks: every activation forward and backward on 16384x4096, bf16 and fp32."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial

import torch
import torch.nn.functional as F

from ..core.backend import DEVICE_TYPE, INTERPRET
from ..ops import activation as act
from . import Case, compiled, providers

# name: (tritondnn, PyTorch)
ACTIVATIONS: dict[str, tuple[Callable, Callable]] = {
    "relu": (act.relu, F.relu),
    "leaky_relu": (act.leaky_relu, F.leaky_relu),
    "elu": (act.elu, F.elu),
    "sigmoid": (act.sigmoid, torch.sigmoid),
    "tanh": (act.tanh, torch.tanh),
    "gelu": (act.gelu, F.gelu),
    "gelu_tanh": (partial(act.gelu, approximate="tanh"), partial(F.gelu, approximate="tanh")),
    "silu": (act.silu, F.silu),
    "softplus": (act.softplus, F.softplus),
}


def _grad(y: torch.Tensor, x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(y, x, dy, retain_graph=True)


def cases(quick: bool) -> Iterator[Case]:
    rows, cols = (64, 96) if INTERPRET else (16384, 4096)
    shape = f"{rows}x{cols}"
    dtypes = (torch.bfloat16,) if quick else (torch.bfloat16, torch.float32)
    names = ("relu", "gelu", "silu") if quick else tuple(ACTIVATIONS)
    for dtype in dtypes:
        dt = str(dtype).removeprefix("torch.").replace("bfloat16", "bf16").replace("float32", "fp32")
        x = torch.randn(rows, cols, device=DEVICE_TYPE, dtype=dtype)
        out = torch.empty_like(x)
        yield Case(f"copy {shape} {dt}", providers(torch=partial(out.copy_, x)), bytes=2 * x.nbytes)
        for name in names:
            ours, ref = ACTIVATIONS[name]
            yield Case(
                f"{name} {shape} {dt} fwd",
                providers(tritondnn=partial(ours, x), torch=partial(ref, x), torch_compile=compiled(ref, x)),
                bytes=2 * x.nbytes,
            )
            xg = x.detach().clone().requires_grad_(True)
            dy = torch.randn_like(x)
            yield Case(
                f"{name} {shape} {dt} bwd",
                providers(tritondnn=partial(_grad, ours(xg), xg, dy), torch=partial(_grad, ref(xg), xg, dy)),
                bytes=3 * x.nbytes,
            )
    small = torch.randn(1024, device=DEVICE_TYPE)
    yield Case(
        "relu 1024 fp32 fwd host-overhead",
        providers(tritondnn=partial(act.relu, small), torch=partial(F.relu, small)),
        host=True,
    )
