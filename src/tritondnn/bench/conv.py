"""Convolution benchmarks: the ResNet-50 layer set at N=64 (bf16 channels-last and fp32 NCHW
without TF32, for cuDNN too), forward, forward+backward through autograd and dgrad+wgrad as
standalone calls; conv+bias+ReLU fused; depthwise 3x3;
conv3d and conv1d.

TFLOP/s count the direct algorithm's 2 * N * out pixels * Cout * Cin/groups * taps per pass
(Winograd and FFT are credited with the same work, as cuDNN's numbers are); the depthwise case is
memory-bound and reports GB/s of x read and y written once. PyTorch runs with
``torch.backends.cudnn.benchmark = True``; which engine tritondnn's heuristics chose is in the
case name (``[engine]``). The full run adds each ResNet-50 layer's forward in benchmark mode
(``fwd autotuned``: every candidate engine and config timed once, the winner named and timed).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from functools import partial

import torch
import torch.nn.functional as F

from ..core.backend import DEVICE_TYPE, INTERPRET
from ..core.config import config
from ..core.engine import engines
from ..ops import conv
from ..ops.epilogue import Epilogue
from . import Case, compiled, providers

# (label, Cin, Cout, kernel, stride, padding, input size) at N=64.
RESNET50 = [
    ("7x7s2 3->64 @224", 3, 64, 7, 2, 3, 224),
    ("3x3 64 @56", 64, 64, 3, 1, 1, 56),
    ("1x1 64->256 @56", 64, 256, 1, 1, 0, 56),
    ("3x3 128 @28", 128, 128, 3, 1, 1, 28),
    ("3x3 256 @14", 256, 256, 3, 1, 1, 14),
    ("3x3 512 @7", 512, 512, 3, 1, 1, 7),
    ("1x1s2 1024->2048 @14", 1024, 2048, 1, 2, 0, 14),
]


def _chosen(x: torch.Tensor, w: torch.Tensor, *args: object) -> str:
    return next((r.name for r in engines("conv", x, w, None, *args) if r.chosen), "?")


def _conv_cases(label: str, x: torch.Tensor, w: torch.Tensor, stride, padding, groups, dtype_name: str,
                layout: str, tuned: bool = False) -> Iterator[Case]:  # fmt: skip
    nd = x.ndim - 2
    ours_fn = {1: conv.conv1d, 2: conv.conv2d, 3: conv.conv3d}[nd]
    ref_fn = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[nd]
    ours = partial(ours_fn, stride=stride, padding=padding, groups=groups)
    ref = partial(ref_fn, stride=stride, padding=padding, groups=groups)
    y = ref(x, w)
    flops = 2 * y.numel() * w[0].numel()
    name = f"conv{nd}d {label} {dtype_name} {layout}"
    engine = _chosen(x, w, stride, padding, 1, groups)
    yield Case(
        f"{name} fwd [{engine}]",
        providers(tritondnn=partial(ours, x, w), torch=partial(ref, x, w), torch_compile=compiled(ref, x, w)),
        flops=flops,
    )
    if tuned:
        yield _tuned_case(
            name, partial(ours, x, w), partial(ref, x, w), x, w, (stride, padding, 1, groups), flops
        )
    xg, wg = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    dy = torch.randn_like(y)
    yield Case(
        f"{name} fwd+bwd",
        providers(
            tritondnn=partial(_grads_only, ours, xg, wg, dy), torch=partial(_grads_only, ref, xg, wg, dy)
        ),
        flops=3 * flops,
    )
    yield _gradient_case(name, x, w, dy, stride, padding, groups, flops)
    if tuned and layout == "NHWC":
        yield _gradient_case(name, x, w, dy, stride, padding, groups, flops, deterministic=True)
    if tuned and layout == "NHWC" and stride == 1 and w.shape[-1] > 1:
        yield from _wgrad_engine_cases(name, x, w, dy, padding, groups, flops)


# Weight-gradient engines timed side by side on the stride-1 channels-last layers (the shifted
# GEMM takes back wrapped pixels; the padded-box engine is run by name until it is priced).
WGRAD_ENGINES = ("shifted_gemm", "padded_box", "im2col_gemm", "implicit_gemm")


def _wgrad_engine_cases(name: str, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, padding, groups,
                        flops: int) -> Iterator[Case]:  # fmt: skip
    grad_w = getattr(torch.nn.grad, f"conv{x.ndim - 2}d_weight")
    cudnn = partial(grad_w, x, w.shape, dy, 1, padding, 1, groups)
    for algo in WGRAD_ENGINES:
        ours = partial(conv.conv_backward_weight, x, dy, w.shape, 1, padding, 1, groups, algo=algo)
        yield Case(f"{name} wgrad [{algo}]", providers(tritondnn=ours, torch=cudnn), flops=flops)


def _tuned_case(name: str, ours: Callable, ref: Callable, x: torch.Tensor, w: torch.Tensor, geometry: tuple,
                flops: int) -> Case:  # fmt: skip
    """The forward in benchmark mode (``tdnn.config.benchmark``): when the case is selected every
    candidate engine and config is timed once and the winner, named in the case, runs."""

    def tuned() -> object:
        with config.flags(benchmark=True):
            return ours()

    def tune() -> str:
        tuned()
        engine = next((r.name for r in engines("conv", x, w, None, *geometry) if r.tuned), "?")
        return f" [{engine}]"

    return Case(f"{name} fwd autotuned", providers(tritondnn=tuned, torch=ref), flops=flops, prepare=tune)


def _gradient_case(name: str, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, stride, padding, groups,
                    flops: int, deterministic: bool = False) -> Case:  # fmt: skip
    """The data and the weight gradient as standalone calls (what the issue compares with cuDNN's
    dgrad + wgrad): no forward and no autograd node, whose host time can exceed a small layer's
    kernels. ``deterministic``: ours and cuDNN's in deterministic mode (the issue asks for ours
    within 1.5x of the plain row)."""
    nd = x.ndim - 2
    grad_in = getattr(torch.nn.grad, f"conv{nd}d_input")
    grad_w = getattr(torch.nn.grad, f"conv{nd}d_weight")
    geometry = (stride, padding, 1, groups)
    our_mode, cudnn_mode = contextlib.nullcontext, contextlib.nullcontext
    if deterministic:
        our_mode = partial(config.flags, deterministic=True)
        cudnn_mode = partial(
            torch.backends.cudnn.flags, enabled=True, benchmark=True, deterministic=True, allow_tf32=False
        )

    def ours() -> tuple:
        with our_mode():
            return (
                conv.conv_backward_data(dy, w, x.shape, *geometry),
                conv.conv_backward_weight(x, dy, w.shape, *geometry),
            )

    def cudnn() -> tuple:
        with cudnn_mode():
            return grad_in(x.shape, w, dy, *geometry), grad_w(x, w.shape, dy, *geometry)

    label = f"{name} dgrad+wgrad" + (" deterministic" if deterministic else "")
    return Case(label, providers(tritondnn=ours, torch=cudnn), flops=2 * flops)


def _grads_only(fn: Callable, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> tuple:
    """Forward, then dgrad + wgrad (3x the forward's work)."""
    return torch.autograd.grad(fn(x, w), (x, w), dy)


def cases(quick: bool) -> Iterator[Case]:
    torch.backends.cudnn.benchmark = True
    # The fp32 cases compare fp32 arithmetic (the "tf32 off"): PyTorch lets cuDNN use TF32
    # for convolutions by default, which ran 2-5x past fp32's own rate.
    torch.backends.cudnn.allow_tf32 = False
    dev = DEVICE_TYPE
    n = 2 if INTERPRET else 64
    layers = RESNET50[:2] if quick else RESNET50
    for dtype, dtype_name, cl in ((torch.bfloat16, "bf16", True), (torch.float32, "fp32", False)):
        layout = "NHWC" if cl else "NCHW"
        for label, cin, cout, k, s, p, size in layers:
            if INTERPRET:
                cin, cout, size = min(cin, 8), min(cout, 8), min(size, 12)
            x = torch.randn(n, cin, size, size, device=dev, dtype=dtype)
            if cl:
                x = x.to(memory_format=torch.channels_last)
            w = torch.randn(cout, cin, k, k, device=dev, dtype=dtype) / math.sqrt(cin * k * k)
            if cl:
                w = w.to(memory_format=torch.channels_last)
            yield from _conv_cases(label, x, w, s, p, 1, dtype_name, layout, tuned=not quick)
    if quick:
        return
    # conv + bias + ReLU, fused, against PyTorch eager's three ops.
    c, size = (8, 12) if INTERPRET else (64, 56)
    x = torch.randn(n, c, size, size, device=dev, dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    w = (torch.randn(c, c, 3, 3, device=dev, dtype=torch.bfloat16) / (3 * math.sqrt(c))).to(
        memory_format=torch.channels_last
    )
    b = torch.randn(c, device=dev, dtype=torch.bfloat16)
    relu = Epilogue(activation="relu")

    def ref_fused(x, w, b):
        return F.relu(F.conv2d(x, w, b, padding=1))

    yield Case(
        f"conv2d+bias+relu 3x3 {c} @{size} bf16 NHWC fwd",
        providers(
            tritondnn=partial(conv.conv2d, x, w, b, padding=1, epilogue=relu),
            torch=partial(ref_fused, x, w, b),
            torch_compile=compiled(ref_fused, x, w, b),
        ),
        flops=2 * x.numel() * c * 9,
    )
    # Depthwise 3x3, memory-bound.
    c = 16 if INTERPRET else 256
    x = torch.randn(n, c, size, size, device=dev, dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    w = torch.randn(c, 1, 3, 3, device=dev, dtype=torch.bfloat16)
    yield Case(
        f"conv2d depthwise 3x3 {c} @{size} bf16 NHWC fwd [{_chosen(x, w, 1, 1, 1, c)}]",
        providers(
            tritondnn=partial(conv.conv2d, x, w, None, 1, 1, 1, c),
            torch=partial(F.conv2d, x, w, None, 1, 1, 1, c),
            torch_compile=compiled(partial(F.conv2d, stride=1, padding=1, groups=c), x, w),
        ),
        bytes=2 * x.nbytes,
    )
    # conv3d 3x3x3 64ch 16x56x56 and conv1d k5 512ch L4096.
    c3, d3, s3 = (4, 4, 8) if INTERPRET else (64, 16, 56)
    x = torch.randn(2 if INTERPRET else 8, c3, d3, s3, s3, device=dev, dtype=torch.bfloat16)
    x = x.to(memory_format=torch.channels_last_3d)
    w = torch.randn(c3, c3, 3, 3, 3, device=dev, dtype=torch.bfloat16) / math.sqrt(27 * c3)
    yield from _conv_cases(f"3x3x3 {c3} @{d3}x{s3}x{s3}", x, w, 1, 1, 1, "bf16", "NDHWC")
    c1, length = (8, 64) if INTERPRET else (512, 4096)
    x = torch.randn(n if INTERPRET else 16, c1, length, device=dev, dtype=torch.bfloat16)
    w = torch.randn(c1, c1, 5, device=dev, dtype=torch.bfloat16) / math.sqrt(5 * c1)
    yield from _conv_cases(f"k5 {c1} L{length}", x, w, 1, 2, 1, "bf16", "NCL")
