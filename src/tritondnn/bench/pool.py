"""Pooling and resampling benchmarks, bf16, NCHW and NHWC (channels_last), forward and
forward+backward: max and average pooling 3x3 stride 2 (ResNet's stem) and global average
pooling on 64x256x112x112, LRN (size 5), nearest and bilinear x2 upsampling of 64x256x56x56;
then fp32 NCHW max and average pooling 3x3 stride 2 (PyTorch's fastest pooling layout).

Bytes are the minimum: forward reads x and writes y; forward+backward adds reading dy and
writing dx (max-pool indices aside: PyTorch saves 8 bytes per output, tritondnn 1).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial

import torch
import torch.nn.functional as F

from ..core.backend import DEVICE_TYPE, INTERPRET
from ..ops import pool
from . import Case, compiled, providers

BF16 = torch.bfloat16
LAYOUTS = {"NCHW": torch.contiguous_format, "NHWC": torch.channels_last}


def _fwd_bwd(fn: Callable, x: torch.Tensor, dy: torch.Tensor) -> tuple:
    return torch.autograd.grad(fn(x), x, dy)


def _pair(label: str, ours: Callable, ref: Callable, x: torch.Tensor) -> Iterator[Case]:
    """Forward (with torch.compile) and forward+backward cases of one op on ``x``."""
    y = ref(x)
    yield Case(
        f"{label} fwd",
        providers(tritondnn=partial(ours, x), torch=partial(ref, x), torch_compile=compiled(ref, x)),
        bytes=x.nbytes + y.nbytes,
    )
    xg = x.detach().clone().requires_grad_(True)
    dy = torch.randn_like(y)
    yield Case(
        f"{label} fwd+bwd",
        providers(tritondnn=partial(_fwd_bwd, ours, xg, dy), torch=partial(_fwd_bwd, ref, xg, dy)),
        bytes=2 * (x.nbytes + y.nbytes),
    )


def cases(quick: bool) -> Iterator[Case]:
    image = (2, 8, 10, 10) if INTERPRET else (64, 256, 112, 112)
    small = (2, 8, 5, 5) if INTERPRET else (64, 256, 56, 56)
    x = torch.randn(*image, device=DEVICE_TYPE, dtype=BF16)
    out = torch.empty_like(x)
    name = "x".join(map(str, image))
    yield Case(f"copy {name} bf16", providers(torch=partial(out.copy_, x)), bytes=2 * x.nbytes)
    del out
    for layout, fmt in LAYOUTS.items():
        t = x.to(memory_format=fmt)
        label = f"{name} bf16 {layout}"
        yield from _pair(
            f"max_pool2d 3x3/2 {label}",
            partial(pool.max_pool2d, kernel_size=3, stride=2, padding=1),
            partial(F.max_pool2d, kernel_size=3, stride=2, padding=1),
            t,
        )
        yield from _pair(
            f"avg_pool2d 3x3/2 {label}",
            partial(pool.avg_pool2d, kernel_size=3, stride=2, padding=1),
            partial(F.avg_pool2d, kernel_size=3, stride=2, padding=1),
            t,
        )
        if quick:
            continue
        yield from _pair(
            f"adaptive_avg_pool2d global {label}",
            partial(pool.adaptive_avg_pool2d, output_size=1),
            partial(F.adaptive_avg_pool2d, output_size=1),
            t,
        )
        # PyTorch's CPU LRN of a 4-D bf16 tensor needs a bf16 avg_pool3d, which it lacks.
        lrn_dtype = torch.float32 if INTERPRET else BF16
        yield from _pair(
            f"local_response_norm 5 {name} {str(lrn_dtype).removeprefix('torch.')} {layout}".replace(
                "bfloat16", "bf16"
            ),
            partial(pool.local_response_norm, size=5),
            partial(F.local_response_norm, size=5),
            t.to(lrn_dtype),
        )
        s = torch.randn(*small, device=DEVICE_TYPE, dtype=BF16).to(memory_format=fmt)
        small_label = f"{'x'.join(map(str, small))} bf16 {layout}"
        for mode in ("nearest", "bilinear"):
            yield from _pair(
                f"interpolate {mode} x2 {small_label}",
                partial(pool.interpolate, scale_factor=2, mode=mode),
                partial(F.interpolate, scale_factor=2, mode=mode),
                s,
            )
    x = x.float()
    for kind, ours, ref in (
        ("max_pool2d", pool.max_pool2d, F.max_pool2d),
        ("avg_pool2d", pool.avg_pool2d, F.avg_pool2d),
    ):
        window = {"kernel_size": 3, "stride": 2, "padding": 1}
        yield from _pair(f"{kind} 3x3/2 {name} fp32 NCHW", partial(ours, **window), partial(ref, **window), x)
