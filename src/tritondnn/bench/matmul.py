"""Matmul benchmarks against cuBLAS (``torch``): the issue's GEMM shapes in bf16 and fp16, skinny
decode-style M, fused epilogues against eager GEMM + pointwise, fp8, fp32 and TF32.

Shapes are written M x N x K. ``NN``: both operands row-major (``torch.matmul(a, b)``); ``TN``: B
is a row-major weight read transposed (``F.linear``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from functools import partial

import torch
import torch.nn.functional as F

from ..core.backend import DEVICE_TYPE, INTERPRET
from ..core.config import config
from ..ops import matmul as mm
from . import Case, compiled, providers

GEMMS = [(2048, 2048, 2048), (4096, 4096, 4096), (8192, 8192, 8192), (16384, 4096, 4096), (8192, 11008, 4096),
         (4096, 4096, 512)]  # fmt: skip
SKINNY = [(1, 8192, 8192), (16, 8192, 8192), (64, 8192, 8192)]
FUSED = [(8192, 4096, 1024), (8192, 11008, 4096)]
_DT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float8_e4m3fn: "fp8e4m3"}


def _randn(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(shape, device=DEVICE_TYPE, dtype=torch.float32).to(dtype)


def _name(kind: str, m: int, n: int, k: int, dtype: torch.dtype, layout: str, direction: str = "fwd") -> str:
    return f"{kind} {m}x{n}x{k} {_DT[dtype]} {layout} {direction}"


def _gemm(m: int, n: int, k: int, dtype: torch.dtype) -> Case:
    a, b = _randn(m, k, dtype=dtype), _randn(k, n, dtype=dtype)
    return Case(
        _name("matmul", m, n, k, dtype, "NN"),
        providers(tritondnn=partial(mm.matmul, a, b), torch=partial(torch.matmul, a, b)),
        flops=2 * m * n * k,
    )


def _skinny(m: int, n: int, k: int, dtype: torch.dtype) -> Case:
    x, w = _randn(m, k, dtype=dtype), _randn(n, k, dtype=dtype)
    return Case(
        _name("linear", m, n, k, dtype, "TN"),
        providers(tritondnn=partial(mm.linear, x, w), torch=partial(F.linear, x, w)),
        bytes=(m * k + n * k + m * n) * x.element_size(),
        flops=2 * m * n * k,
    )


def _fused(m: int, n: int, k: int, dtype: torch.dtype) -> Iterator[Case]:
    """bias+gelu, bias+silu and a residual, each fused against cuBLAS's GEMM then PyTorch's pointwise."""
    x, w, bias = _randn(m, k, dtype=dtype), _randn(n, k, dtype=dtype), _randn(n, dtype=dtype)
    res = _randn(m, n, dtype=dtype)
    eager: dict[str, Callable[..., torch.Tensor]] = {
        "bias+gelu": lambda x, w, b, r: F.gelu(F.linear(x, w, b)),
        "bias+silu": lambda x, w, b, r: F.silu(F.linear(x, w, b)),
        "residual": lambda x, w, b, r: F.linear(x, w) + r,
    }
    ours = {
        "bias+gelu": partial(mm.linear, x, w, bias, activation="gelu"),
        "bias+silu": partial(mm.linear, x, w, bias, activation="silu"),
        "residual": partial(mm.linear, x, w, residual=res),
    }
    for label, ref in eager.items():
        yield Case(
            _name(f"linear+{label}", m, n, k, dtype, "TN"),
            providers(
                tritondnn=ours[label],
                torch=partial(ref, x, w, bias, res),
                torch_compile=compiled(ref, x, w, bias, res),
            ),
            flops=2 * m * n * k,
        )


def _backward(m: int, n: int, k: int, dtype: torch.dtype) -> Case:
    x = _randn(m, k, dtype=dtype).requires_grad_(True)
    w = _randn(n, k, dtype=dtype).requires_grad_(True)
    bias = _randn(n, dtype=dtype).requires_grad_(True)
    dy = _randn(m, n, dtype=dtype)

    def step(fn: Callable[..., torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(fn(x, w, bias), (x, w, bias), dy)

    ours = partial(mm.linear, activation="gelu")
    eager = lambda x, w, b: F.gelu(F.linear(x, w, b))
    return Case(
        _name("linear+bias+gelu", m, n, k, dtype, "TN", "fwd+bwd"),
        providers(tritondnn=partial(step, ours), torch=partial(step, eager)),
        flops=3 * 2 * m * n * k,
    )


# GPT-2 small's four products of a layer over B8 x S1024 tokens: (name, out features, in features).
GPT2_LINEARS = [("qkv", 2304, 768), ("proj", 768, 768), ("mlp up", 3072, 768), ("mlp down", 768, 3072)]


def _linear_step(name: str, m: int, n: int, k: int, dtype: torch.dtype) -> Case:
    """A linear layer's forward and both gradients (the data gradient, and the weight gradient as
    a reduction over the m tokens), without bias or activation: three plain products."""
    x = _randn(m, k, dtype=dtype).requires_grad_(True)
    w = (_randn(n, k, dtype=dtype) / 30).requires_grad_(True)
    dy = _randn(m, n, dtype=dtype)
    step = lambda fn: torch.autograd.grad(fn(x, w), (x, w), dy)
    return Case(
        _name(f"linear ({name})", m, n, k, dtype, "TN", "fwd+bwd"),
        providers(tritondnn=partial(step, mm.linear), torch=partial(step, F.linear)),
        flops=3 * 2 * m * n * k,
    )


def _fp8(m: int, n: int, k: int, fast_accum: bool) -> Case:
    """fp8 e4m3 with per-tensor scales (B K-major, as the fp8 tensor cores take it), against
    cuBLAS's fp8 GEMM with the same accumulation mode; the target is 1.5x our own bf16 case of
    the same shape."""
    a = _randn(m, k, dtype=torch.float8_e4m3fn)
    b = _randn(n, k, dtype=torch.float8_e4m3fn).t()
    sa = sb = torch.ones((), device=DEVICE_TYPE)
    scaled_mm = getattr(torch, "_scaled_mm", None)
    anchor = None
    if scaled_mm is not None:
        anchor = partial(
            scaled_mm, a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=fast_accum
        )
    ours = partial(mm.matmul, a, b, scale_a=sa, scale_b=sb, use_fast_accum=fast_accum)
    return Case(
        _name("matmul", m, n, k, torch.float8_e4m3fn, "TN") + (" fast-accum" if fast_accum else ""),
        providers(tritondnn=ours, torch=anchor),
        flops=2 * m * n * k,
    )


@contextlib.contextmanager
def _tf32(enabled: bool) -> Iterator[None]:
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled
    try:
        with config.flags(allow_tf32=enabled):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def _under(flag: bool, fn: Callable[[], object]) -> Callable[[], object]:
    def call() -> object:
        with _tf32(flag):
            return fn()

    return call


def _fp32(m: int, n: int, k: int, tf32: bool, layout: str = "NN") -> Case:
    """fp32 or TF32; layout "NT" takes B K-major (a linear layer's weight), which TF32's Hopper
    MMAs read in place, where "NN" has B copied K-major first (and fp32's FMA kernel the reverse)."""
    a = _randn(m, k, dtype=torch.float32)
    b = _randn(k, n, dtype=torch.float32) if layout == "NN" else _randn(n, k, dtype=torch.float32).t()
    return Case(
        _name("matmul", m, n, k, torch.float32, layout).replace("fp32", "tf32" if tf32 else "fp32"),
        providers(
            tritondnn=_under(tf32, partial(mm.matmul, a, b)), torch=_under(tf32, partial(torch.matmul, a, b))
        ),
        flops=2 * m * n * k,
    )


def cases(quick: bool) -> Iterator[Case]:
    if INTERPRET:  # exercising the machinery only: tiny shapes, no fp8
        yield _gemm(64, 48, 32, torch.float16)
        yield _skinny(1, 64, 128, torch.float32)
        yield from _fused(64, 32, 32, torch.float32)
        yield _fp32(32, 32, 32, tf32=False)
        return
    dtypes = (torch.bfloat16,) if quick else (torch.bfloat16, torch.float16)
    for dtype in dtypes:
        for shape in GEMMS[:3] if quick else GEMMS:
            yield _gemm(*shape, dtype)
    for shape in SKINNY:
        yield _skinny(*shape, torch.bfloat16)
    for shape in FUSED[:1] if quick else FUSED:
        yield from _fused(*shape, torch.bfloat16)
    if not quick:
        yield _backward(8192, 4096, 4096, torch.bfloat16)
    for name, n, k in GPT2_LINEARS:
        yield _linear_step(f"GPT-2 {name}", 8192, n, k, torch.bfloat16)
    # A language model's output layer over GPT-2's vocabulary: logits rows not 16-byte aligned.
    yield _linear_step("LM head", 8192, 50257, 768, torch.bfloat16)
    if torch.cuda.get_device_capability() >= (9, 0):
        yield _fp8(8192, 8192, 8192, fast_accum=False)
        yield _fp8(8192, 8192, 8192, fast_accum=True)
    for tf32 in (False, True):
        for layout in ("NN", "NT"):
            yield _fp32(4096, 4096, 4096, tf32, layout)
