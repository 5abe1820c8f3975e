"""Softmax benchmarks: softmax and log_softmax forward and backward, rows of many lengths and layouts;
cross entropy over a language model's vocabulary."""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import torch

from ..core.backend import DEVICE_TYPE, INTERPRET
from ..ops import cross_entropy as ce
from ..ops import softmax as sm
from . import Case, compiled, providers


def _grad(y: torch.Tensor, x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(y, x, dy, retain_graph=True)


def _dt(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]


def _pair(label: str, x: torch.Tensor, dim: int, log: bool) -> Iterator[Case]:
    ours = partial(sm.log_softmax if log else sm.softmax, dim=dim)
    ref = partial(torch.log_softmax if log else torch.softmax, dim=dim)
    yield Case(
        f"{label} fwd",
        providers(tritondnn=partial(ours, x), torch=partial(ref, x), torch_compile=compiled(ref, x)),
        bytes=2 * x.nbytes,
    )
    xg = x.detach().clone().requires_grad_(True)
    dy = torch.randn_like(x)
    yield Case(
        f"{label} bwd",
        providers(tritondnn=partial(_grad, ours(xg), xg, dy), torch=partial(_grad, ref(xg), xg, dy)),
        bytes=3 * x.nbytes,
    )


def cases(quick: bool) -> Iterator[Case]:
    rows, cols = (64, 96) if INTERPRET else (16384, 4096)
    dtypes = (torch.bfloat16,) if quick else (torch.bfloat16, torch.float32)
    for dtype in dtypes:
        x = torch.randn(rows, cols, device=DEVICE_TYPE, dtype=dtype)
        out = torch.empty_like(x)
        yield Case(
            f"copy {rows}x{cols} {_dt(dtype)}", providers(torch=partial(out.copy_, x)), bytes=2 * x.nbytes
        )
        for log in (False, True):
            name = "log_softmax" if log else "softmax"
            yield from _pair(f"{name} {rows}x{cols} {_dt(dtype)}", x, -1, log)
        if dtype == torch.bfloat16 and not quick and not INTERPRET:
            yield from _shapes_and_layouts()
    yield from _cross_entropy()
    yield from _host_overhead()


def _cross_entropy() -> Iterator[Case]:
    """A language model's loss: bf16 logits over GPT-2's vocabulary for 8192 tokens. PyTorch's
    anchor is what a bf16 training step runs (the logits widened to fp32, then cross entropy,
    as autocast does), and torch.compile of it; ours reads the bf16 logits as they are."""
    rows, classes = (16, 300) if INTERPRET else (8192, 50257)
    x = torch.randn(rows, classes, device=DEVICE_TYPE, dtype=torch.bfloat16)
    target = torch.randint(0, classes, (rows,), device=DEVICE_TYPE)
    ours = partial(ce.cross_entropy, target=target)

    def theirs(logits: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.float(), target)

    label = f"cross_entropy {rows}x{classes} bf16"
    yield Case(
        f"{label} fwd",
        providers(tritondnn=partial(ours, x), torch=partial(theirs, x), torch_compile=compiled(theirs, x)),
        bytes=x.nbytes,
    )
    xg = x.detach().clone().requires_grad_(True)
    compiled_theirs = compiled(theirs)

    def forward_backward(fn) -> torch.Tensor:
        return torch.autograd.grad(fn(xg), xg)[0]

    yield Case(
        f"{label} fwd+bwd",
        providers(
            tritondnn=partial(forward_backward, ours),
            torch=partial(forward_backward, theirs),
            # The compiled forward, its backward compiled by AOTAutograd on the first call.
            torch_compile=compiled_theirs and partial(forward_backward, compiled_theirs),
        ),
        # The logits read forward, read again and their gradient written backward.
        bytes=3 * x.nbytes,
    )


def _shapes_and_layouts() -> Iterator[Case]:
    """Long rows (two-pass or 32K one-block), short rows, and softmax over channels in both layouts."""
    long_rows = torch.randn(2048, 32768, device=DEVICE_TYPE, dtype=torch.bfloat16)
    yield from _pair("softmax 2048x32768 bf16", long_rows, -1, False)
    short_rows = torch.randn(262144, 256, device=DEVICE_TYPE, dtype=torch.bfloat16)
    yield from _pair("softmax 262144x256 bf16", short_rows, -1, False)
    nchw = torch.randn(32, 256, 56, 56, device=DEVICE_TYPE, dtype=torch.bfloat16)
    yield from _pair("softmax 32x256x56x56 bf16 NCHW dim=1", nchw, 1, False)
    nhwc = nchw.to(memory_format=torch.channels_last)
    yield from _pair("softmax 32x256x56x56 bf16 NHWC dim=1", nhwc, 1, False)


def _host_overhead() -> Iterator[Case]:
    small = torch.randn(1024, device=DEVICE_TYPE)
    yield Case(
        "softmax 1024 fp32 fwd host-overhead",
        providers(tritondnn=partial(sm.softmax, small, -1), torch=partial(torch.softmax, small, -1)),
        host=True,
    )
