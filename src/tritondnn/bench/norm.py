"""Normalization benchmarks: layer/RMS norm (and the fused residual add) on 16384x4096, batch,
group and instance norm on 64x256x56x56, bf16, forward and forward+backward.

Bytes are the minimum: forward reads x and writes y; forward+backward adds reading x and dy and
writing dx (parameters and statistics aside). Forward+backward is timed as called (host included,
where the host is the slower side) and replayed from a CUDA graph (the GPU's time alone), with
host-overhead rows on small tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial

import torch
import torch.nn.functional as F

from ..core.backend import DEVICE_TYPE, INTERPRET
from ..ops import norm
from . import Case, compiled, graphed, providers

BF16 = torch.bfloat16


def _fwd_bwd(fn: Callable, x: torch.Tensor, params: tuple, dy: torch.Tensor) -> tuple:
    y = fn(x, *params)
    return torch.autograd.grad(y, (x, *params), dy)


def _add_then_norm(fn: Callable, x: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> tuple:
    s = x + r
    return fn(s, w), s


def _pair(label: str, ours: Callable, ref: Callable, x: torch.Tensor, params: tuple) -> Iterator[Case]:
    """Forward (with torch.compile) and forward+backward cases of one norm."""
    yield Case(
        f"{label} fwd",
        providers(
            tritondnn=partial(ours, x, *params),
            torch=partial(ref, x, *params),
            torch_compile=compiled(ref, x, *params),
        ),
        bytes=2 * x.nbytes,
    )
    xg = x.detach().clone().requires_grad_(True)
    pg = tuple(p.detach().clone().requires_grad_(True) for p in params)
    dy = torch.randn_like(x)
    yield Case(
        f"{label} fwd+bwd",
        providers(tritondnn=partial(_fwd_bwd, ours, xg, pg, dy), torch=partial(_fwd_bwd, ref, xg, pg, dy)),
        bytes=5 * x.nbytes,
    )
    if not INTERPRET:  # the same step replayed from a CUDA graph: the GPU's time, whatever the host's
        yield Case(
            f"{label} fwd+bwd CUDA-graph",
            providers(
                tritondnn=graphed(partial(_fwd_bwd, ours, xg, pg, dy)),
                torch=graphed(partial(_fwd_bwd, ref, xg, pg, dy)),
            ),
            bytes=5 * x.nbytes,
        )


def cases(quick: bool) -> Iterator[Case]:
    rows, cols = (64, 96) if INTERPRET else (16384, 4096)
    image = (2, 16, 6, 6) if INTERPRET else (64, 256, 56, 56)
    x = torch.randn(rows, cols, device=DEVICE_TYPE, dtype=BF16)
    out = torch.empty_like(x)
    yield Case(f"copy {rows}x{cols} bf16", providers(torch=partial(out.copy_, x)), bytes=2 * x.nbytes)
    w, b = (
        torch.randn(cols, device=DEVICE_TYPE, dtype=BF16),
        torch.randn(cols, device=DEVICE_TYPE, dtype=BF16),
    )
    shape = f"{rows}x{cols} bf16"

    def ln(x, w, b):
        return norm.layer_norm(x, cols, w, b)

    def ln_ref(x, w, b):
        return F.layer_norm(x, (cols,), w, b)

    def rms(x, w):
        return norm.rms_norm(x, cols, w, 1e-6)

    def rms_ref(x, w):
        return F.rms_norm(x, (cols,), w, 1e-6)

    yield from _pair(f"layer_norm {shape}", ln, ln_ref, x, (w, b))
    yield from _pair(f"rms_norm {shape}", rms, rms_ref, x, (w,))
    r = torch.randn_like(x)

    def add_rms_ref(x, r, w):
        s = x + r
        return F.rms_norm(s, (cols,), w, 1e-6), s

    yield Case(
        f"add+rms_norm {shape} fwd",
        providers(
            tritondnn=partial(norm.add_rms_norm, x, r, cols, w, 1e-6),
            tritondnn_unfused=partial(_add_then_norm, rms, x, r, w),
            torch=partial(add_rms_ref, x, r, w),
            torch_compile=compiled(add_rms_ref, x, r, w),
        ),
        bytes=4 * x.nbytes,
    )
    del x, out, r
    # The forward+backward rows time the host too when it issues a step more slowly than the GPU
    # runs it: the same steps on a small tensor give each provider's host time per call.
    xs = torch.randn(64, 256, device=DEVICE_TYPE, dtype=BF16, requires_grad=True)
    ws, bs = (torch.randn(256, device=DEVICE_TYPE, dtype=BF16, requires_grad=True) for _ in range(2))
    dys = torch.randn_like(xs)
    yield Case(
        "layer_norm 64x256 bf16 fwd+bwd host-overhead",
        providers(
            tritondnn=partial(_fwd_bwd, lambda x, w, b: norm.layer_norm(x, 256, w, b), xs, (ws, bs), dys),
            torch=partial(_fwd_bwd, lambda x, w, b: F.layer_norm(x, (256,), w, b), xs, (ws, bs), dys),
        ),
        host=True,
    )
    if quick:
        return
    img = torch.randn(*image, device=DEVICE_TYPE, dtype=BF16)
    out = torch.empty_like(img)
    yield Case(
        f"copy {'x'.join(map(str, image))} bf16",
        providers(torch=partial(out.copy_, img)),
        bytes=2 * img.nbytes,
    )
    c = image[1]
    groups = 4 if INTERPRET else 32
    wc, bc = torch.randn(c, device=DEVICE_TYPE), torch.randn(c, device=DEVICE_TYPE)
    name = "x".join(map(str, image))
    for layout, t in (("NHWC", img.to(memory_format=torch.channels_last)), ("NCHW", img)):
        label = f"{name} bf16 {layout}"

        def bn(x, w, b):
            return norm.batch_norm(x, None, None, w, b, True)

        def bn_ref(x, w, b):
            return F.batch_norm(x, None, None, w.to(x.dtype), b.to(x.dtype), True)

        def gn(x, w, b):
            return norm.group_norm(x, groups, w, b)

        def gn_ref(x, w, b):
            return F.group_norm(x, groups, w.to(x.dtype), b.to(x.dtype))

        def inorm(x, w, b):
            return norm.instance_norm(x, None, None, w, b)

        def in_ref(x, w, b):
            return F.instance_norm(x, None, None, w.to(x.dtype), b.to(x.dtype))

        yield from _pair(f"batch_norm train {label}", bn, bn_ref, t, (wc, bc))
        yield from _pair(f"group_norm {groups} {label}", gn, gn_ref, t, (wc, bc))
        yield from _pair(f"instance_norm {label}", inorm, in_ref, t, (wc, bc))

        def gn_silu(x, w, b):
            return norm.group_norm(x, groups, w, b, activation="silu")

        def gn_silu_ref(x, w, b):
            return F.silu(F.group_norm(x, groups, w.to(x.dtype), b.to(x.dtype)))

        yield from _pair(f"group_norm {groups}+silu {label}", gn_silu, gn_silu_ref, t, (wc, bc))
    small = torch.randn(2, 32, 4, 4, device=DEVICE_TYPE, dtype=BF16, requires_grad=True)
    ws, bs = (torch.randn(32, device=DEVICE_TYPE, requires_grad=True) for _ in range(2))
    yield Case(
        "batch_norm train 2x32x4x4 bf16 NCHW fwd+bwd host-overhead",
        providers(
            tritondnn=partial(
                _fwd_bwd,
                lambda x, w, b: norm.batch_norm(x, None, None, w, b, True),
                small,
                (ws, bs),
                small.detach(),
            ),
            torch=partial(
                _fwd_bwd,
                lambda x, w, b: F.batch_norm(x, None, None, w.to(x.dtype), b.to(x.dtype), True),
                small,
                (ws, bs),
                small.detach(),
            ),
        ),
        host=True,
    )
