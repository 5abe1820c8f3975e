"""Convolution families and the implicit-GEMM and im2col engines.

Three families share ``ConvProblem``: ``conv`` (forward, also conv_transpose's backward-data),
``conv_dgrad`` (input gradient, also conv_transpose's forward) and ``conv_wgrad`` (weight gradient).
Engines bind to a launch function with one calling convention per family:

* ``conv``: ``run(x, w, y, c, bias, residual, pre, alpha, beta, p0, p1)``;
* ``conv_dgrad``: ``run(dy, w, dx, c, bias, residual, pre, alpha, beta, p0, p1)``;
* ``conv_wgrad``: ``run(x, dy, dw)``, dw contiguous (Cout, Cin / groups, *kernel).

Absent epilogue tensors are passed as the written tensor. Other engines (depthwise, Winograd,
FFT) live in their own modules and register into these families.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import triton.language as tl

from ...core.backend import INTERPRET, sm_count
from ...core.engine import Engine, Family, LaunchConfig
from ...core.launcher import cdiv, launcher
from ...core.relayout import relayout
from .kernels import _col2im_kernel, _igemm_kernel, _sum_kernel, _wgrad_kernel
from .problem import ConvProblem, Strides5, Triple, channels_last_strides_of, itemsize


def _describe(*args: Any, **kwargs: Any) -> ConvProblem:
    from . import describe_forward  # the public layer parses the call

    return describe_forward(*args, **kwargs)


def _describe_dgrad(*args: Any, **kwargs: Any) -> ConvProblem:
    from . import describe_dgrad

    return describe_dgrad(*args, **kwargs)


def _describe_wgrad(*args: Any, **kwargs: Any) -> ConvProblem:
    from . import describe_wgrad

    return describe_wgrad(*args, **kwargs)


FAMILY: Family[ConvProblem] = Family("conv", _describe)
DGRAD_FAMILY: Family[ConvProblem] = Family("conv_dgrad", _describe_dgrad)
WGRAD_FAMILY: Family[ConvProblem] = Family("conv_wgrad", _describe_wgrad)


# ---------------------------------------------------------------------------------------------
# Cost model (microseconds on an H100-class GPU) and launch configurations.

_PEAK = {"float16": 600.0, "bfloat16": 600.0, "float32": 45.0, "float64": 45.0}  # TFLOP/s, dense
_TF32_PEAK = 300.0
_BANDWIDTH = 3.0  # TB/s


def peak(p: ConvProblem) -> float:
    return _TF32_PEAK if p.tf32 else _PEAK[p.dtype]


def roofline(flops: float, nbytes: float, tflops: float, compute_eff: float, bw_eff: float) -> float:
    return max(flops / (tflops * 1e6 * compute_eff), nbytes / (_BANDWIDTH * 1e6 * bw_eff))


def dot_constexprs(p: ConvProblem) -> tuple:
    """ACC, PRECISION, UPCAST for tl.dot. fp32 without TF32 takes three TF32 products a product
    ("tf32x3", about fp32's accuracy, on the tensor cores) as the recurrent networks do, or
    Triton's "ieee" fp32 dot on the FMA units, whichever ran faster. H100, ResNet-50's layers at
    N=64: forward 3x3 64 @56 NCHW 0.646 -> 0.267 ms, 1x1 64->256 @56 0.345 -> 0.201; data
    gradients 10-20% faster with it (NCHW 3x3 128 @28 361 -> 295 us, 64 @56 406 -> 321; the
    strided 1x1 lost 443 -> 533); weight gradients with taps (channels-last) 25% slower (3x3 128
    @28 450 -> 569 us), 1x1 ones faster (64->256 @56 257 -> 195, 1024->2048 s2 333 -> 290)."""
    acc = tl.float64 if p.dtype == "float64" else tl.float32
    if p.dtype != "float32":
        precision = "ieee"
    elif p.tf32:
        precision = "tf32"
    else:
        precision = "ieee" if p.direction == "wgrad" and p.taps > 1 else "tf32x3"
    return acc, precision, INTERPRET and p.dtype == "bfloat16"


def epilogue_constexprs(p: ConvProblem) -> tuple:
    return p.has_c, 1 if p.bias else 0, p.activation, p.residual, p.store_pre


def row_limit(p: ConvProblem) -> int:
    """The offset kernels give rows past the end: above every valid offset, and a multiple of 16,
    so that Triton still knows row offsets are (vectorizable stores of a 16-byte-aligned run)."""
    return 2**62 if p.index_64 else 2**31 - 16


def _tile(bm: int, bn: int, bk: int, warps: int, stages: int) -> LaunchConfig:
    return {
        "BLOCK_M": bm,
        "BLOCK_N": bn,
        "BLOCK_K": bk,
        "GROUP_M": 8,
        "num_warps": warps,
        "num_stages": stages,
    }


def tile_configs(p: ConvProblem, cols: int) -> list[LaunchConfig]:
    """Tile shapes for a GEMM with ``cols`` columns per group, the heuristic's pick first: 128x128x64
    (16-bit) for wide outputs, narrower column tiles where the group has few columns."""
    if INTERPRET:  # small tiles keep the interpreter quick and still cover several tiles
        shapes = [(32, 32, 16, 4, 1), (16, 16, 16, 4, 1)]
    elif p.dtype == "float64":
        shapes = [(64, 64, 16, 4, 2), (32, 32, 16, 4, 2)]
    elif p.direction != "fwd" and dot_constexprs(p)[1] == "tf32x3":
        # H100, ResNet-50's gradients at N=64: 128 x 64 tiles ran tf32x3 fastest on every layer but
        # the strided 1x1's data gradient (NCHW dgrad 3x3 128 @28 295 us against 128 x 128's 488).
        shapes = [(128, 64, 32, 4, 3), (128, 128, 32, 8, 3), (64, 128, 32, 4, 3), (64, 64, 32, 4, 4)]
    elif p.dtype == "float32" and not p.tf32:
        shapes = [(128, 128, 32, 8, 3), (64, 128, 32, 4, 3), (128, 64, 32, 4, 3), (64, 64, 32, 4, 4)]
    elif p.dtype == "float32":
        shapes = [(128, 128, 32, 8, 3), (128, 64, 32, 4, 4), (64, 128, 32, 4, 4), (64, 64, 32, 4, 4)]
    else:
        shapes = [
            (128, 128, 64, 8, 4),
            (128, 256, 64, 8, 3),
            (256, 128, 64, 8, 3),
            (128, 64, 64, 4, 4),
            (64, 128, 64, 4, 4),
            (64, 64, 64, 4, 4),
            (128, 128, 32, 4, 4),
        ]
    configs = [_tile(*s) for s in shapes]
    fit = max(16, 1 << (max(cols, 1) - 1).bit_length())
    configs.sort(key=lambda c: c["BLOCK_N"] > max(fit, 64))  # stable: narrow groups skip wide tiles
    return configs


# ---------------------------------------------------------------------------------------------
# Forward and data-gradient geometry for ``_igemm_kernel``.


def forward_geometry(p: ConvProblem) -> tuple[int, tuple[int, ...]]:
    """(rows, the kernel's ints) of the forward convolution."""
    m = p.out_pixels
    ints = (
        m,
        p.cout_g,
        p.cin_g,
        *p.out_size,
        *p.in_size,
        *p.kernel,
        *p.x_strides,
        p.w_strides[1],
        p.w_strides[0],
        *p.w_strides[2:],
        p.cout_g * p.w_strides[0],
        *p.y_strides,
        1,
        *p.stride,
        *(-q for q in p.pad),
        *p.dilation,
        0,
        0,
        0,
        1,
        1,
        1,
        1,
        1,
        1,
        0,
        0,
        0,
        row_limit(p),
    )
    return m, ints


def _phases_1d(size: int, out: int, k: int, s: int, pad: int, d: int) -> list[tuple]:
    """Per phase r < s of one dimension: (rows, taps, source offset, source step, first tap, tap
    step, r), see the kernels' docstring."""
    phases = []
    g = math.gcd(s, d)
    for r in range(s):
        rows = cdiv(size - r, s) if size > r else 0
        taps = [j for j in range(k) if (r + pad - j * d) % s == 0]
        k0 = taps[0] if taps else 0
        phases.append((rows, len(taps), (r + pad - k0 * d) // s, -(d // g), k0, s // g, r))
    return phases


def _tapless_cost(p: ConvProblem) -> float:
    """Microseconds of the data gradient's phases that no tap reaches (a kernel narrower than its
    stride, as 1x1 stride 2): launches of their own that write zeros. H100, bf16, N=64, ResNet-50's
    1x1 stride-2 layers: 18-21 us above the rest of the model, where the GEMM with a scatter
    (``gemm_1x1``) ran 53-94 us against 64-111."""
    dims = [
        _phases_1d(p.in_size[i], p.out_size[i], p.kernel[i], p.stride[i], p.pad[i], p.dilation[i])
        for i in range(3)
    ]
    cost = 0.0
    for pd in dims[0]:
        for ph in dims[1]:
            for pw in dims[2]:
                pixels = p.n * pd[0] * ph[0] * pw[0]
                if pixels and not (pd[1] and ph[1] and pw[1]):
                    cost += pixels * p.cin * itemsize(p.dtype) / (_BANDWIDTH * 1e6 * 0.5) + 5.0
    return cost


def dgrad_phases(p: ConvProblem) -> list[tuple[int, tuple[int, ...]]]:
    """(rows, the kernel's ints) of each launch of the data gradient; phases without rows are left out."""
    dims = [
        _phases_1d(p.in_size[i], p.out_size[i], p.kernel[i], p.stride[i], p.pad[i], p.dilation[i])
        for i in range(3)
    ]
    launches = []
    for pd in dims[0]:
        for ph in dims[1]:
            for pw in dims[2]:
                cnt = (pd[0], ph[0], pw[0])
                m = p.n * math.prod(cnt)
                if m == 0:
                    continue
                ints = (
                    m,
                    p.cin_g,
                    p.cout_g,
                    *cnt,
                    *p.out_size,
                    pd[1],
                    ph[1],
                    pw[1],
                    *p.y_strides,
                    p.w_strides[0],
                    p.w_strides[1],
                    *p.w_strides[2:],
                    p.cout_g * p.w_strides[0],
                    *p.x_strides,
                    1,
                    1,
                    1,
                    1,
                    pd[2],
                    ph[2],
                    pw[2],
                    pd[3],
                    ph[3],
                    pw[3],
                    pd[4],
                    ph[4],
                    pw[4],
                    pd[5],
                    ph[5],
                    pw[5],
                    p.stride[0],
                    p.stride[1],
                    p.stride[2],
                    pd[6],
                    ph[6],
                    pw[6],
                    row_limit(p),
                )
                launches.append((m, ints))
    return launches


def row_window(p: ConvProblem) -> bool:
    """Whether the forward convolution can walk K by row windows (``kernels``, K_WALK 2)."""
    s_c, s_w = p.x_strides[1], p.x_strides[4]
    return p.groups == 1 and p.cin > 1 and s_c == 1 and s_w == p.cin and p.dilation[2] == 1


def _igemm_launch(
    p: ConvProblem, config: LaunchConfig, m: int, ints: tuple, cols: int, ck: int, window: bool
):
    """The launch of ``_igemm_kernel``; ``window``: the K walk by row windows may be used. Called
    with the kernel's seven tensors and its floats; with ``p.prologue``, its scale and shift
    tensors after the seven."""
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    walk = 0
    if ck < bk:
        walk = 2 if window else 1
    if walk == 2:  # a chunk as wide as the window, no wider
        bk = min(bk, max(16, 1 << (p.kernel[2] * ck - 1).bit_length()))
    launch = launcher(
        _igemm_kernel,
        (cdiv(m, bm) * cdiv(cols, bn), p.groups),
        num_tensors=9,
        ints=ints,
        constexprs=(
            *epilogue_constexprs(p),
            *dot_constexprs(p),
            p.index_64,
            walk,
            p.prologue,
            bm,
            bn,
            bk,
            config["GROUP_M"],
        ),
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )
    if p.prologue:
        return launch

    def run(src, w, out, c, bias, res, pre, *floats) -> None:
        launch(src, w, out, c, bias, res, pre, out, out, *floats)  # no scale or shift

    return run


def _igemm_cost(p: ConvProblem, config: LaunchConfig, cols: int, ck: int, gather_eff: float = 1.0) -> float:
    bn, bk = config["BLOCK_N"], config["BLOCK_K"]
    # Work done on padding: columns past the group's, channels past CK in each K step.
    col_eff = cols / (cdiv(cols, bn) * bn)
    k_eff = ck / (cdiv(ck, bk) * bk) if ck >= bk else 0.6
    return roofline(p.flops, p.bytes, peak(p), 0.75 * col_eff * k_eff * gather_eff, 0.7) + 4.0


def _channels_first_gather_eff(p: ConvProblem) -> float:
    """A tiles gathered from a 16-bit channels-first source (x forward, dy for the data
    gradient), per tap shifted and masked or strided: H100, bf16 N=64, ResNet-50's 3x3 layers and
    the 1x1 stride-2 one in NCHW ran forward at 107-146 TFLOP/s, 0.24-0.32 of the 450 the cost
    assumes (conv1d k5 NCL 210); single-tap stride-1 ones keep their rate (1x1 conv1d NCL 308)."""
    src_channel_step = p.x_strides[1] if p.direction == "fwd" else p.y_strides[1]
    if src_channel_step == 1 or p.dtype not in ("float16", "bfloat16"):
        return 1.0
    return 1.0 if p.taps == 1 and p.stride == (1, 1, 1) else 0.35


def dense_channels_first(sizes: tuple[int, ...], strides: Strides5) -> bool:
    """Whether a tensor is dense channels-first (strides of size-1 dimensions aside)."""
    step = 1
    for size, st in reversed(list(zip(sizes, strides))):
        if size > 1 and st != step:
            return False
        step *= size
    return True


def channels_last_strides(c: int, size: Triple) -> Strides5:
    """(n, c, d, h, w) strides of a dense channels-last (N, C, D, H, W) tensor."""
    return channels_last_strides_of((1, c, *size))  # type: ignore[return-value]


def channels_last_stager(n: int, channels: int, size: Triple) -> Callable[[torch.Tensor], torch.Tensor]:
    """A dense channels-first (n, channels, *size) tensor -> its channels-last copy (flat), for
    engines that read channels innermost (``staged`` operands)."""
    d, h, w = size
    copy = relayout(
        n,
        channels,
        d * h,
        w,
        (channels * d * h * w, d * h * w, w, 1),
        (d * h * w * channels, 1, w * channels, channels),
    )
    numel = n * channels * d * h * w

    def stage(t: torch.Tensor) -> torch.Tensor:
        buf = torch.empty(numel, dtype=t.dtype, device=t.device)
        copy(t, buf)
        return buf

    return stage


def channels_last_weights(
    p: ConvProblem,
) -> tuple[ConvProblem, Callable[[torch.Tensor], torch.Tensor] | None]:
    """Weights whose channel stride is not 1 (contiguous ones) fill both directions' B tiles one
    element at a time (neither tile dimension is contiguous); a channels-last copy loads runs of
    channels. (The problem with channels-last weight strides, the per-call repack), or (p, None)
    where the weights already are (ResNet-50's 3x3x3 conv3d ran 8x slower from contiguous ones)."""
    if p.w_strides[1] == 1 or p.cin_g == 1:
        return p, None
    _, kh, kw = p.kernel
    c = p.cin_g
    strides = (p.taps * c, 1, kh * kw * c, kw * c, c)

    def repack(w: torch.Tensor) -> torch.Tensor:
        return w.movedim(1, -1).contiguous().movedim(-1, 1)

    return dataclasses.replace(p, w_strides=strides), repack


def with_weights(launches: list[Callable[..., None]], repack) -> Callable[..., None]:
    """One call running ``launches`` in order on (src, w, ...), w repacked first if asked."""
    if repack is None and len(launches) == 1:
        return launches[0]

    def run(src: torch.Tensor, w: torch.Tensor, *rest: Any) -> None:
        if repack is not None:
            w = repack(w)
        for launch in launches:
            launch(src, w, *rest)

    return run


@FAMILY.register
class ImplicitGemmEngine(Engine[ConvProblem]):
    """Any convolution: a GEMM over (pixels) x (output channels), its A operand gathered from the
    input on the fly (no im2col buffer), bias and the epilogue fused into the store."""

    name = "implicit_gemm"

    def cost(self, problem: ConvProblem) -> float:
        p = problem
        config = self.configs(p)[0]
        gather_eff = _channels_first_gather_eff(p)
        staged = window_staged(p, config)
        if (staged or row_window(p)) and p.cin_g < config["BLOCK_K"] and p.dtype in ("float16", "bfloat16"):
            # Measured, H100: ResNet-50's stem (3 channels, 7x7 s2, N=64, bf16) by row windows at
            # 52 TFLOP/s, 0.09 of the tensor cores' peak.
            gather_eff = 0.2
        cost = _igemm_cost(p, config, p.cout_g, p.cin_g, gather_eff)
        if staged:  # x read and written once more
            cost += roofline(0, 2 * p.in_pixels * p.cin * itemsize(p.dtype), 1.0, 1.0, 0.75) + 4.0
        return cost

    def configs(self, problem: ConvProblem) -> list[LaunchConfig]:
        return tile_configs(problem, problem.cout_g)

    def bind(self, problem: ConvProblem, config: LaunchConfig) -> Callable[..., None]:
        staged = window_staged(problem, config)
        if staged:
            problem = dataclasses.replace(
                problem, x_strides=channels_last_strides(problem.cin, problem.in_size)
            )
        p, repack = channels_last_weights(problem)
        m, ints = forward_geometry(p)
        run = with_weights([_igemm_launch(p, config, m, ints, p.cout_g, p.cin_g, row_window(p))], repack)
        if not staged:
            return run
        stage = channels_last_stager(p.n, p.cin, p.in_size)
        return lambda x, *rest: run(stage(x), *rest)


def window_staged(p: ConvProblem, config: LaunchConfig) -> bool:
    """Whether the forward copies a dense channels-first x with fewer channels than a K step
    channels-last first, for the row-window K walk (``kernels``). H100, ResNet-50's stem in fp32
    (3 channels, 7x7 stride 2, N=64): NCHW 2535 us by the flat walk, channels-last 1433 (the copy:
    40 us)."""
    return (
        p.groups == 1
        and 1 < p.cin < config["BLOCK_K"]
        and p.dilation[2] == 1
        and p.x_strides[1] != 1
        and dense_channels_first((p.n, p.cin, *p.in_size), p.x_strides)
    )


@DGRAD_FAMILY.register
class ImplicitGemmDgradEngine(Engine[ConvProblem]):
    """Any data gradient: per stride phase, a stride-1 implicit GEMM over the output gradient
    with just the taps that reach that phase (sub-pixel decomposition; no inserted zeros)."""

    name = "implicit_gemm"

    def cost(self, problem: ConvProblem) -> float:
        phases = math.prod(problem.stride)
        if problem.cin_g < 16 and problem.groups == 1:
            # Tiles of a few input channels run far below the model's rate: ResNet-50's stem (3
            # channels, 7x7 stride 2, N64 bf16) took 2.4 ms on an H100, 6.3 TFLOP/s. (Grouped
            # problems keep the model: their other engines were not measured against it.)
            return problem.flops / (6.3e6 * problem.cin_g / 3) + 3.0 * phases
        p = problem
        gather_eff = _channels_first_gather_eff(p)
        cost = _igemm_cost(p, self.configs(p)[0], p.cin_g, p.cout_g, gather_eff) + 3.0 * phases
        return cost + _tapless_cost(p)

    def configs(self, problem: ConvProblem) -> list[LaunchConfig]:
        return tile_configs(problem, problem.cin_g)

    def bind(self, problem: ConvProblem, config: LaunchConfig) -> Callable[..., None]:
        p, repack = channels_last_weights(problem)
        launches = [
            _igemm_launch(p, config, m, ints, p.cin_g, p.cout_g, False) for m, ints in dgrad_phases(p)
        ]
        return with_weights(launches, repack)


def split_pixels(pixels: int, tiles: int, bk: int) -> tuple[int, int]:
    """(split, pixels per split) of a weight gradient's reduction over ``pixels`` for ``tiles``
    output tiles: enough programs for two waves, at least four K steps of ``bk`` each."""
    split = max(1, min(cdiv(2 * sm_count(), tiles), cdiv(pixels, 4 * bk), 1024))
    chunk = cdiv(cdiv(pixels, split), bk) * bk
    return cdiv(pixels, chunk) if pixels else 1, max(chunk, bk)


def wgrad_split(p: ConvProblem, config: LaunchConfig) -> tuple[int, int]:
    """``split_pixels`` for the implicit GEMM's tiles."""
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    tiles = cdiv(p.cout_g, bm) * cdiv(p.cin_g * p.taps, bn) * p.groups
    return split_pixels(p.out_pixels, tiles, bk)


def wgrad_out_steps(p: ConvProblem) -> tuple[int, int, int, int]:
    """(group, output channel, input channel, tap) steps of the weight gradient dw in memory, tap
    ``t = (kd * KH + kh) * KW + kw``. The plans lay dw out contiguous (taps innermost) or
    channels-last (input channels innermost, as PyTorch returns it for channels-last inputs); in
    both the kernel dimensions nest, so one step walks the taps. (Split workspaces keep their own
    order, ``workspace_steps``.)"""
    s_co, s_c, *s_k = p.w_strides
    tap = None
    for size, stride in zip(reversed(p.kernel), reversed(s_k)):
        if size == 1:
            continue
        if tap is None:
            tap, expected = stride, stride
        if stride != expected:
            raise ValueError(f"weight gradient strides {p.w_strides}: the kernel dimensions do not nest")
        expected *= size
    return p.cout_g * s_co, s_co, s_c, 1 if tap is None else tap


def workspace_steps(p: ConvProblem) -> tuple[int, int, int, int]:
    """(group, output channel, input channel, tap) steps of a split weight gradient's workspace:
    input channels innermost whatever dw's layout, so that each split's stores run along channels
    (H100, fp32 NCHW 3x3 128 @28 N=64: the contiguous dw's order, taps innermost, scattered them);
    ``reduce_splits`` writes dw through its own steps."""
    row = p.taps * p.cin_g
    return p.cout_g * row, row, 1, p.cin_g


def reduce_splits(p: ConvProblem, split: int) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """``reduce(ws, dw)``: the (split, dw elements) workspace in ``workspace_steps`` order, added
    in a fixed order (deterministic) into dw."""
    numel = p.cout * p.cin_g * p.taps
    _, o_m, o_c, o_t = wgrad_out_steps(p)
    ints = (numel, split, p.cin_g, p.taps, o_m, o_c, o_t)
    return launcher(_sum_kernel, (cdiv(numel, 1024),), 2, ints, (1024,))


def summed_splits(p: ConvProblem, split: int, partial: Callable[..., None]) -> Callable[..., None]:
    """``run(x, dy, dw)`` of a split weight gradient: ``partial(dy, x, ws)`` writes each split's
    sums into a (split, dw elements) fp32 (fp64) workspace (``workspace_steps``), then
    ``reduce_splits`` adds them into dw."""
    numel = p.cout * p.cin_g * p.taps
    ws_dtype = torch.float64 if p.dtype == "float64" else torch.float32
    reduce = reduce_splits(p, split)

    def run(x: torch.Tensor, dy: torch.Tensor, dw: torch.Tensor) -> None:
        ws = torch.empty((split, numel), dtype=ws_dtype, device=x.device)
        partial(dy, x, ws)
        reduce(ws, dw)

    return run


@WGRAD_FAMILY.register
class ImplicitGemmWgradEngine(Engine[ConvProblem]):
    """Any weight gradient: a GEMM (output channels) x (input channels, taps) reducing over
    N * output pixels, split over that reduction with the partial sums added in a fixed order.
    Dense channels-first fp32 x and dy are ``staged`` (copied channels-last per call, see
    ``wgrad_staged``)."""

    name = "implicit_gemm"

    def cost(self, problem: ConvProblem) -> float:
        p = problem
        staged = wgrad_staged(p)
        # Channels-last x is gathered in runs of Cin_g elements per (pixel, tap): runs shorter than
        # a 32-byte sector waste its rest (the 3-channel stem ran at 6 TFLOP/s on an H100).
        run = min(1.0, p.cin_g * itemsize(p.dtype) / 32) if p.channels_last or staged else 1.0
        # 16-bit channels-first operands are gathered element by element: H100, bf16, 3x3 64 @56
        # N=64 NCHW 1458 us (10 TFLOP/s), 3x3 256 @14 676 us, conv1d k5 512 L4096 NCL 1580 us;
        # so are short runs in 16-bit (the bf16 stem, 3 channels: 2627 us).
        if p.dtype in ("float16", "bfloat16") and (not p.channels_last or run < 1.0):
            run *= 0.1
        elif p.dtype in ("float16", "bfloat16") and p.taps > 1:
            # Gathered taps: H200, bf16 NHWC N=64, CUDA graphs, 3x3 64 @56 113.5 us, 128 @28 72.7,
            # 256 @14 87.2, 512 @7 90.6 (130-200 TFLOP/s).
            run *= 0.5
        cost = roofline(p.flops, p.bytes, peak(p), 0.6 * run, 0.6) + 8.0
        if staged:  # x and dy read and written once more
            nbytes = 2 * (p.in_pixels * p.cin + p.out_pixels * p.cout) * itemsize(p.dtype)
            cost += roofline(0, nbytes, 1.0, 1.0, 0.75) + 8.0
        return cost

    def configs(self, problem: ConvProblem) -> list[LaunchConfig]:
        p = problem
        configs = tile_configs(p, p.cin_g * p.taps)
        # Rows are the group's output channels: no taller tiles than they fill. fp32 on the FMA
        # units with 64 of them: 64 x 64 tiles (H100, 3x3 64 @56 N=64 NHWC 633 us, 64 x 128 804).
        fit = max(64, 1 << (max(p.cout_g, 1) - 1).bit_length())
        narrow = dot_constexprs(p)[1] == "ieee" and p.dtype == "float32" and fit == 64
        configs.sort(key=lambda c: (c["BLOCK_M"] > fit, narrow and c["BLOCK_N"] > 64))  # stable
        return configs

    def bind(self, problem: ConvProblem, config: LaunchConfig) -> Callable[..., None]:
        p = problem
        bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
        split, chunk = wgrad_split(p, config)
        taps = p.taps
        ncols = p.cin_g * taps
        numel = p.cout * ncols
        grid = (cdiv(p.cout_g, bm) * cdiv(ncols, bn), p.groups, split)
        staged = wgrad_staged(p)
        x_strides = channels_last_strides(p.cin, p.in_size) if staged else p.x_strides
        y_strides = channels_last_strides(p.cout, p.out_size) if staged else p.y_strides
        head = (
            p.out_pixels,
            p.cout_g,
            p.cin_g,
            *p.out_size,
            *p.in_size,
            *p.kernel,
            chunk,
            *y_strides,
            *x_strides,
        )
        geometry = (*p.stride, *p.pad, *p.dilation)
        tap_major = p.channels_last or staged
        consts = (*dot_constexprs(p), p.index_64, tap_major, bm, bn, bk, config["GROUP_M"])
        opts = {"num_warps": config["num_warps"], "num_stages": config["num_stages"]}
        direct = (0, *wgrad_out_steps(p))
        launch = launcher(_wgrad_kernel, grid, 3, (*head, *direct, *geometry), consts, **opts)
        if split == 1:
            run = lambda x, dy, dw: launch(dy, x, dw)
        else:
            partial = (numel, *workspace_steps(p))
            launch_ws = launcher(_wgrad_kernel, grid, 3, (*head, *partial, *geometry), consts, **opts)
            run = summed_splits(p, split, launch_ws)
        if not staged:
            return run
        stage_x = channels_last_stager(p.n, p.cin, p.in_size)
        stage_dy = channels_last_stager(p.n, p.cout, p.out_size)
        return lambda x, dy, dw: run(stage_x(x), stage_dy(dy), dw)


def wgrad_staged(p: ConvProblem) -> bool:
    """Whether the implicit GEMM copies x and dy channels-last first: both dense channels-first
    fp32 with at least a 32-byte sector of input channels per group. Channels-first loads along
    pixels, shifted by the taps, do not vectorize: H100, ResNet-50's fp32 layers at N=64, NCHW
    3x3 128 @28 1526 us against 450 channels-last (copies: 45), 1x1 64->256 @56 562 against 195."""
    return (
        p.dtype == "float32"
        and p.cin_g * itemsize(p.dtype) >= 32
        and p.cout > 1
        and dense_channels_first((p.n, p.cin, *p.in_size), p.x_strides)
        and dense_channels_first((p.n, p.cout, *p.out_size), p.y_strides)
    )


# ---------------------------------------------------------------------------------------------
# The fallback: explicit im2col (torch indexing) and a tdnn.matmul per group.


def as5d(t: torch.Tensor) -> torch.Tensor:
    """The (N, C, D, H, W) view of an (N, C, *spatial) tensor."""
    while t.ndim < 5:
        t = t.unsqueeze(2)
    return t


def im2col(x5: torch.Tensor, p: ConvProblem) -> torch.Tensor:
    """Columns [groups, N * out pixels, Cin_g * taps] (channel-major, then taps) of x (N, C, D, H, W)."""
    post = [
        max(0, (o - 1) * s + d * (k - 1) + 1 - i - pre)
        for o, s, d, k, i, pre in zip(p.out_size, p.stride, p.dilation, p.kernel, p.in_size, p.pad)
    ]
    pads = [v for i in (2, 1, 0) for v in (p.pad[i], post[i])]
    xp = torch.nn.functional.pad(x5, pads)
    patches = xp
    for dim, (k, s, d) in enumerate(zip(p.kernel, p.stride, p.dilation)):
        span = d * (k - 1) + 1
        patches = patches.unfold(2 + dim, span, s)[..., ::d]  # appends the tap dimension
    # patches: (N, C, OD, OH, OW, KD, KH, KW)
    n, c = p.n, p.cin
    cols = patches.reshape(n, p.groups, p.cin_g, *p.out_size, p.taps)
    cols = cols.permute(1, 0, 3, 4, 5, 2, 6).reshape(p.groups, n * math.prod(p.out_size), p.cin_g * p.taps)
    del c
    return cols


def epilogue_torch(
    acc: torch.Tensor, p: ConvProblem, c, bias, residual, alpha: float, beta: float, p0: float, p1: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fused epilogue's arithmetic with torch ops on a (N, Cout, *spatial) accumulator:
    (act(pre) + residual, pre). The activation is evaluated in float64."""
    from ..activation import activation_reference

    shape = (1, -1) + (1,) * (acc.ndim - 2)
    pre = acc * alpha
    if c is not None:
        pre = pre + beta * c.to(pre.dtype)
    if bias is not None:
        pre = pre + bias.to(pre.dtype).view(shape)
    y = pre
    if p.activation >= 0:
        y = activation_reference(pre, p.activation, p0, p1).to(pre.dtype)
    if residual is not None:
        y = y + residual.to(y.dtype)
    return y, pre


@FAMILY.register
class Im2colGemmEngine(Engine[ConvProblem]):
    """Every convolution, the always-available fallback: an explicit im2col buffer (PyTorch
    indexing) times the weights with ``tdnn.matmul`` per group, the epilogue after it in fp32."""

    name = "im2col_gemm"

    def cost(self, problem: ConvProblem) -> float:
        p = problem
        cols = p.out_pixels * p.cin * p.taps * itemsize(p.dtype)
        return roofline(p.flops, p.bytes + 3 * cols, peak(p), 0.6, 0.5) + 40.0

    def bind(self, problem: ConvProblem, config: LaunchConfig) -> Callable[..., None]:
        from ..matmul import matmul

        p = problem
        wide = torch.float64 if p.dtype == "float64" else torch.float32

        def run(x, w, y, c, bias, residual, pre, alpha, beta, p0, p1) -> None:
            cols = im2col(as5d(x), p)
            wm = w.reshape(p.groups, p.cout_g, p.cin_g * p.taps).transpose(1, 2)
            from ..epilogue import Epilogue

            acc = matmul(cols, wm, epilogue=Epilogue(out_dtype=wide))  # [G, N * pixels, Cout_g]
            acc = acc.view(p.groups, p.n, *p.out_size, p.cout_g).permute(1, 0, 5, 2, 3, 4)
            acc = acc.reshape(p.n, p.cout, *p.out_size)
            acc = acc.view(y.shape)
            out, pre_v = epilogue_torch(
                acc,
                p,
                c if p.has_c else None,
                bias if p.bias else None,
                residual if p.residual else None,
                alpha,
                beta,
                p0,
                p1,
            )
            y.copy_(out)
            if p.store_pre:
                pre.copy_(pre_v)

        return run


@DGRAD_FAMILY.register
class Im2colGemmDgradEngine(Engine[ConvProblem]):
    """2-D data gradients, chosen where the input has few channels (a network's stem): the
    columns' gradient as one GEMM per sample (weights^T times dy, in fp32), folded back onto the
    image by a gather over the taps (col2im), where an implicit GEMM's tiles would be mostly
    empty. (torch's ``F.fold`` took 1.9 ms for the stem's fold on an H100.)"""

    name = "im2col_gemm"

    def not_supported_reasons(self, problem: ConvProblem) -> list[str]:
        p = problem
        reasons = []
        if p.nd != 2:
            reasons.append(f"2-D convolutions only, not {p.nd}-D")
        if p.groups != 1:
            reasons.append(f"one group only, not {p.groups}")
        if p.has_c or p.bias or p.residual or p.activation >= 0 or p.store_pre:
            reasons.append("no fused epilogue")
        return reasons

    def cost(self, problem: ConvProblem) -> float:
        p = problem
        columns = 4 * p.out_pixels * p.cin * p.taps  # fp32, written by the GEMM, read by the fold
        return roofline(p.flops, p.bytes + 2 * columns, peak(p), 0.3, 0.7) + 20.0

    def bind(self, problem: ConvProblem, config: LaunchConfig) -> Callable[..., None]:
        from ..epilogue import Epilogue
        from ..matmul import matmul

        p = problem
        _, kh, kw = p.kernel
        _, h, w_in = p.in_size
        _, oh, ow = p.out_size
        wide = torch.float64 if p.dtype == "float64" else torch.float32
        block = 1024
        fold = launcher(
            _col2im_kernel,
            (p.n * p.cin, cdiv(h * w_in, block)),
            num_tensors=2,
            ints=(p.cin, h, w_in, oh, ow, p.x_strides[0], p.x_strides[1], p.x_strides[3], p.x_strides[4],
                  *p.stride[1:], *p.pad[1:], *p.dilation[1:]),
            constexprs=(kh, kw, block),
        )  # fmt: skip

        def run(dy, w, dx, c, bias, residual, pre, alpha, beta, p0, p1) -> None:
            n, k = dy.shape[:2]
            columns = matmul(  # [N, Cin * taps, out pixels]
                w.reshape(k, -1).t(),
                dy.reshape(n, k, oh * ow),
                epilogue=Epilogue(alpha=alpha, out_dtype=wide),
            )
            fold(columns, dx)

        return run


def timing_copy(tensors: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    return [None if t is None else t.clone() for t in tensors]
