"""Resampling (cuDNN's resample / PyTorch's upsample): nearest and linear interpolation over 1, 2
or 3 spatial dimensions ("nearest", "linear", "bilinear", "trilinear"), forward and backward.

Resampling is separable: along each dimension, output o reads inputs i0[o] and i1[o] with weights
1 - w1[o] and w1[o]. These tables are computed once per problem on the host with PyTorch's CUDA
formulas, so outputs match it index for index:

* nearest: ``i0 = min(floor(o * scale), I - 1)`` in fp32 at every dtype, scale = 1 / scale_factor
  when one was given (and not recomputed), else I / O;
* linear: source ``scale * o`` (align_corners, scale = (I - 1) / (O - 1)) or
  ``max(scale * (o + 0.5) - 0.5, 0)``, in fp32 (fp64 for fp64 tensors); i0 = floor(source),
  i1 = i0 + 1 (i0 at the last input), w1 = source - i0. An output the size of the input is a
  copy, as in PyTorch (whose CPU kernels also copy along any single dimension of unchanged size;
  its CUDA kernels, and these, only when all are unchanged).

The backward gathers: the outputs reading input i form a contiguous run starting at first[i]
(another table), at most ND/NH/NW long; each input element sums dy times its weights over that
run. No atomics (PyTorch's CUDA backward uses them), and forward and backward read the same
tables, so the backward is the forward's exact transpose.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import torch
import triton
import triton.language as tl

from ...core.autocast import FP32, autocast_policy
from ...core.checks import check_choice, check_tensor
from ...core.engine import Engine, Family, LaunchConfig, Problem
from ...core.launcher import cdiv, launcher
from ...core.library import custom_op
from ...core.numerics import convert
from .common import (
    channels_last_format,
    empty_output,
    grad_input,
    int_tuple,
    needs_int64,
    pad3,
    plane_configs,
    plane_cost,
    sizes3,
    strides5,
)
from .kernels import plane_tile, split, tile

# ---------------------------------------------------------------------------------------------
# Kernels. Tables: ``itab`` (int32) holds i0 for the D, H and W outputs, then i1 likewise, then
# first[i] for the D, H and W inputs; ``wtab`` (ACC) holds w1 for the D, H and W outputs.
# LIN_D/H/W: interpolate along that dimension (else i0 alone, weight 1). ND, NH, NW: the
# longest run of outputs reading one input (constexprs: few distinct values). Tiles are
# [positions x channels] (``kernels.tile``) or [rows x columns] of one plane
# (``kernels.plane_tile``, for contiguous rows: table reads per row and per column, not per
# lane). Other arguments as in ``kernels``.


@triton.jit
def _row(at, w0, w1, ww1, xs_w, mask, LIN_W: tl.constexpr, ACC: tl.constexpr):
    v = convert(tl.load(at + w0 * xs_w, mask=mask, other=0.0), ACC)
    if LIN_W:
        v = (1.0 - ww1) * v + ww1 * convert(tl.load(at + w1 * xs_w, mask=mask, other=0.0), ACC)
    return v


@triton.jit
def _plane(at, h0, h1, wh1, w0, w1, ww1, xs_h, xs_w, mask,
           LIN_H: tl.constexpr, LIN_W: tl.constexpr, ACC: tl.constexpr):  # fmt: skip
    v = _row(at + h0 * xs_h, w0, w1, ww1, xs_w, mask, LIN_W, ACC)
    if LIN_H:
        v = (1.0 - wh1) * v + wh1 * _row(at + h1 * xs_h, w0, w1, ww1, xs_w, mask, LIN_W, ACC)
    return v


@triton.jit
def _sample(
    x_at, od, oh, ow, ok_d, ok_h, ok_w, mask, itab_ptr, wtab_ptr, OD, OH, OW, xs_d, xs_h, xs_w,
    LIN_D: tl.constexpr, LIN_H: tl.constexpr, LIN_W: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """The outputs (od, oh, ow) (broadcastable; ok_* mask each coordinate's table reads); weights
    combine as PyTorch's (along W, then H, then D)."""
    T = OD + OH + OW
    d0 = tl.load(itab_ptr + od, mask=ok_d, other=0)
    h0 = tl.load(itab_ptr + OD + oh, mask=ok_h, other=0)
    w0 = tl.load(itab_ptr + OD + OH + ow, mask=ok_w, other=0)
    d1 = tl.load(itab_ptr + T + od, mask=ok_d, other=0)
    h1 = tl.load(itab_ptr + T + OD + oh, mask=ok_h, other=0)
    w1 = tl.load(itab_ptr + T + OD + OH + ow, mask=ok_w, other=0)
    wd1 = tl.load(wtab_ptr + od, mask=ok_d, other=0.0)
    wh1 = tl.load(wtab_ptr + OD + oh, mask=ok_h, other=0.0)
    ww1 = tl.load(wtab_ptr + OD + OH + ow, mask=ok_w, other=0.0)
    v = _plane(x_at + d0 * xs_d, h0, h1, wh1, w0, w1, ww1, xs_h, xs_w, mask, LIN_H, LIN_W, ACC)
    if LIN_D:
        v2 = _plane(x_at + d1 * xs_d, h0, h1, wh1, w0, w1, ww1, xs_h, xs_w, mask, LIN_H, LIN_W, ACC)
        v = (1.0 - wd1) * v + wd1 * v2
    return v


@triton.jit
def _coords(C, D, H, W, INDEX_64: tl.constexpr, PLANE: tl.constexpr, BLOCK_A: tl.constexpr,
            BLOCK_B: tl.constexpr):  # fmt: skip
    """Each lane's element of a (D, H, W) grid of C channels: n, c, d, h, w, the tile mask and
    whether d, h and w are in range. [BLOCK_A, BLOCK_B] tiles are [rows x columns] of a plane
    when PLANE, else [positions x channels]."""
    if PLANE:
        n, c, d, h, w, mask = plane_tile(C, D, H, W, INDEX_64, BLOCK_A, BLOCK_B)
        ok_d, ok_h, ok_w = d < D, h < H, w < W
    else:
        P = D * H * W
        p, c, n, mask = tile(C, P, INDEX_64, BLOCK_A, BLOCK_B)
        d, h, w = split(p, H, W)
        ok_d = p < P
        ok_h = ok_d
        ok_w = ok_d
    return n, c, d, h, w, mask, ok_d, ok_h, ok_w


@triton.jit
def _forward_kernel(
    x_ptr, y_ptr, itab_ptr, wtab_ptr,
    C, ID, IH, IW, OD, OH, OW,
    xs_n, xs_c, xs_d, xs_h, xs_w, ys_n, ys_c, ys_d, ys_h, ys_w,
    LIN_D: tl.constexpr, LIN_H: tl.constexpr, LIN_W: tl.constexpr,
    ACC: tl.constexpr, INDEX_64: tl.constexpr, PLANE: tl.constexpr,
    BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr,
):  # fmt: skip
    """One output element per lane; tiles as _coords makes them."""
    n, c, od, oh, ow, mask, ok_d, ok_h, ok_w = _coords(C, OD, OH, OW, INDEX_64, PLANE, BLOCK_A, BLOCK_B)
    v = _sample(
        x_ptr + n * xs_n + c * xs_c, od, oh, ow, ok_d, ok_h, ok_w, mask, itab_ptr, wtab_ptr,
        OD, OH, OW, xs_d, xs_h, xs_w, LIN_D, LIN_H, LIN_W, ACC,
    )  # fmt: skip
    y_off = n * ys_n + c * ys_c + od * ys_d + oh * ys_h + ow * ys_w
    tl.store(y_ptr + y_off, convert(v, y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _weight(i, o, out, itab_ptr, wtab_ptr, at_i0, at_i1, at_w):
    """Input i's total weight in output o along one dimension, and whether o reads i at all."""
    ok = o < out
    i0 = tl.load(itab_ptr + at_i0 + o, mask=ok, other=-1)
    i1 = tl.load(itab_ptr + at_i1 + o, mask=ok, other=-1)
    w1 = tl.load(wtab_ptr + at_w + o, mask=ok, other=0.0)
    w = tl.where(i0 == i, 1.0 - w1, 0.0) + tl.where(i1 == i, w1, 0.0)
    return w, ok & ((i0 == i) | (i1 == i))


@triton.jit
def _gather_row(at, i_w, fw, od, oh, w_dh, ok_dh, total, e, itab_ptr, wtab_ptr, OD, OH, OW, gs_d, gs_h, gs_w,
                ACC: tl.constexpr):  # fmt: skip
    """Add output (od, oh, fw + e) times its weight (w_dh, the D and H weights, times W's)."""
    ow = fw + e
    T = OD + OH + OW
    ww, ok_w = _weight(i_w, ow, OW, itab_ptr, wtab_ptr, OD + OH, T + OD + OH, OD + OH)
    ok = ok_dh & ok_w
    g = convert(tl.load(at + od * gs_d + oh * gs_h + ow * gs_w, mask=ok, other=0.0), ACC)
    return total + tl.where(ok, g * (w_dh * ww), 0.0)


@triton.jit
def _backward_kernel(
    dy_ptr, dx_ptr, itab_ptr, wtab_ptr,
    C, ID, IH, IW, OD, OH, OW,
    xs_n, xs_c, xs_d, xs_h, xs_w, gs_n, gs_c, gs_d, gs_h, gs_w,
    ND: tl.constexpr, NH: tl.constexpr, NW: tl.constexpr, UNROLL: tl.constexpr,
    ACC: tl.constexpr, INDEX_64: tl.constexpr, PLANE: tl.constexpr,
    BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr,
):  # fmt: skip
    """One input element per lane: the sum of dy times its weight over the outputs reading it.
    Tiles as _coords makes them, over the input; UNROLL: the runs' outputs unroll."""
    n, c, i_d, i_h, i_w, mask, in_d, in_h, in_w = _coords(C, ID, IH, IW, INDEX_64, PLANE, BLOCK_A, BLOCK_B)
    first = itab_ptr + 2 * (OD + OH + OW)
    fd = tl.load(first + i_d, mask=in_d, other=0)
    fh = tl.load(first + ID + i_h, mask=in_h, other=0)
    fw = tl.load(first + ID + IH + i_w, mask=in_w, other=0)
    at = dy_ptr + n * gs_n + c * gs_c
    T = OD + OH + OW
    total = tl.zeros(mask.shape, ACC)
    if UNROLL:
        for a in tl.static_range(ND):
            wd, ok_d = _weight(i_d, fd + a, OD, itab_ptr, wtab_ptr, 0, T, 0)
            for b in tl.static_range(NH):
                wh, ok_h = _weight(i_h, fh + b, OH, itab_ptr, wtab_ptr, OD, T + OD, OD)
                for e in tl.static_range(NW):
                    total = _gather_row(at, i_w, fw, fd + a, fh + b, wd * wh, mask & ok_d & ok_h, total, e,
                                        itab_ptr, wtab_ptr, OD, OH, OW, gs_d, gs_h, gs_w, ACC)  # fmt: skip
    else:
        for a in range(ND):
            wd, ok_d = _weight(i_d, fd + a, OD, itab_ptr, wtab_ptr, 0, T, 0)
            for b in range(NH):
                wh, ok_h = _weight(i_h, fh + b, OH, itab_ptr, wtab_ptr, OD, T + OD, OD)
                for e in range(NW):
                    total = _gather_row(at, i_w, fw, fd + a, fh + b, wd * wh, mask & ok_d & ok_h, total, e,
                                        itab_ptr, wtab_ptr, OD, OH, OW, gs_d, gs_h, gs_w, ACC)  # fmt: skip
    dx_off = n * xs_n + c * xs_c + i_d * xs_d + i_h * xs_h + i_w * xs_w
    tl.store(dx_ptr + dx_off, convert(total, dx_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------
# Tables and engine.


@functools.lru_cache(maxsize=256)
def dim_table(size: int, out: int, linear: bool, align: bool, ratio: float, fp64: bool):
    """Along one dimension: (i0, i1, w1) per output, first[i] per input (0 for inputs no output
    reads), and the longest run of outputs reading one input; as lists. Computed in fp32 (fp64
    for fp64 linear problems) with the formulas of PyTorch's CUDA kernels."""
    o = torch.arange(out)
    if linear and size > 1:
        acc = torch.float64 if fp64 else torch.float32
        if align:
            scale = torch.tensor((size - 1) / (out - 1) if out > 1 else 0.0, dtype=acc)
            src = scale * o.to(acc)
        else:
            scale = torch.tensor(ratio, dtype=acc)
            src = (scale * (o.to(acc) + 0.5) - 0.5).clamp_min(0)
        i0 = src.to(torch.int64)
        w1 = src - i0.to(acc)
        i1 = torch.where(i0 < size - 1, i0 + 1, i0)
    else:
        scale = torch.tensor(ratio, dtype=torch.float32)
        i0 = torch.floor(o.float() * scale).long().clamp_max(size - 1)
        i1, w1 = i0, torch.zeros(out, dtype=torch.float64)
    both = torch.cat([i0, i1])
    first = torch.full((size,), out, dtype=torch.int64).scatter_reduce(0, both, o.repeat(2), "amin")
    last = torch.full((size,), -1, dtype=torch.int64).scatter_reduce(0, both, o.repeat(2), "amax")
    read = last >= 0
    run = int((last - first + 1)[read].max()) if bool(read.any()) else 1
    first = torch.where(read, first, 0)
    return i0.tolist(), i1.tolist(), w1.double().tolist(), first.tolist(), run


@dataclasses.dataclass(frozen=True)
class ResampleProblem(Problem):
    """One launch over (N, C, D, H, W) views. ``linear`` holds LIN_D/H/W; ``ratios`` the scale of
    each nearest or non-aligned linear dimension; ``strides`` the (n, c, d, h, w) strides of the
    input-side then the output-side tensor."""

    backward: bool
    align_corners: bool
    dtype: str
    n: int
    channels: int
    in_size: tuple[int, int, int]
    out_size: tuple[int, int, int]
    linear: tuple[bool, bool, bool]
    ratios: tuple[float, float, float]
    strides: tuple[tuple[int, ...], ...]
    index_64: bool

    @property
    def acc(self) -> tl.dtype:
        return tl.float64 if self.dtype == "float64" else tl.float32

    @property
    def lane_sizes(self) -> tuple[int, int, int]:
        """The (D, H, W) sizes a program's lanes walk: outputs forward, inputs backward."""
        return self.in_size if self.backward else self.out_size

    @property
    def positions(self) -> int:
        return math.prod(self.lane_sizes)

    @property
    def channels_last(self) -> bool:
        return self.strides[0 if self.backward else 1][1] == 1 and self.channels > 1

    def tables(self) -> tuple[list[int], list[float], tuple[int, int, int]]:
        """(itab, wtab) contents and the (ND, NH, NW) run lengths."""
        dims = [
            dim_table(i, o, lin, self.align_corners, r, self.dtype == "float64")
            for i, o, lin, r in zip(self.in_size, self.out_size, self.linear, self.ratios)
        ]
        itab = (
            [v for d in dims for v in d[0]]
            + [v for d in dims for v in d[1]]
            + [v for d in dims for v in d[3]]
        )
        return itab, [v for d in dims for v in d[2]], tuple(d[4] for d in dims)  # type: ignore[return-value]


def _problem(backward, linear, align, x_side, y_side, in_size, out_size, ratios) -> ResampleProblem:
    lin = tuple(linear and i > 1 for i in in_size)
    return ResampleProblem(
        backward, align, str(x_side.dtype).removeprefix("torch."), x_side.shape[0], x_side.shape[1],
        tuple(in_size), tuple(out_size), lin, tuple(ratios),
        (strides5(x_side), strides5(y_side)), needs_int64(x_side, y_side),
    )  # fmt: skip


def _describe(input: torch.Tensor, size: Sequence[int], mode: str = "nearest",
              align_corners: bool = False, backward: bool = False) -> ResampleProblem:  # fmt: skip
    """The problem ``interpolate(input, size, mode=mode, align_corners=...)`` (or its backward) poses."""
    out = pad3(tuple(size), 1)
    y = empty_output(input, (*input.shape[:2], *size))
    ratios = [i / o for i, o in zip(sizes3(input), out)]
    return _problem(backward, mode != "nearest", align_corners, input, y, sizes3(input), out, ratios)


FAMILY: Family[ResampleProblem] = Family("resample", _describe)


# The [positions x channels] backward unrolls its loop over the outputs reading an input up
# to this many.
MAX_UNROLLED_RUNS = 64


@FAMILY.register
class DirectEngine(Engine[ResampleProblem]):
    """Gathers per output (forward) or per input (backward) from [positions x channels] tiles,
    through the per-dimension index and weight tables."""

    name = "direct"
    plane = False

    def cost(self, problem: ResampleProblem) -> float:
        return 1.0

    def configs(self, problem: ResampleProblem) -> list[LaunchConfig]:
        c = triton.next_power_of_2(problem.channels)
        positions = triton.next_power_of_2(problem.positions)
        out = []
        # Measured on an H100 (x2 scales, channels_last): large tiles forward.
        for tile_size in (1024, 2048, 512) if problem.backward else (2048, 1024, 512):
            if problem.channels_last:
                block_c = min(c, 64)
                block_p = max(1, min(positions, tile_size // block_c))
            else:
                block_p = min(positions, tile_size)
                block_c = max(1, min(c, tile_size // block_p))
            config = {"BLOCK_A": block_p, "BLOCK_B": block_c, "num_warps": 4}
            if config not in out:
                out.append(config)
        return out

    def grid(self, problem: ResampleProblem, block_a: int, block_b: int) -> tuple[int]:
        p = problem
        return (p.n * cdiv(p.positions, block_a) * cdiv(p.channels, block_b),)

    def bind(self, problem: ResampleProblem, config: LaunchConfig) -> Callable[..., None]:
        p = problem
        grid = self.grid(p, config["BLOCK_A"], config["BLOCK_B"])
        sizes = (p.channels, *p.in_size, *p.out_size)
        strides = (*p.strides[0], *p.strides[1])
        tail = (p.acc, p.index_64, self.plane, config["BLOCK_A"], config["BLOCK_B"])
        itab, wtab, runs = p.tables()
        wdtype = torch.float64 if p.dtype == "float64" else torch.float32
        tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

        def on(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
            """The tables on ``device``: copied there once, on its first call."""
            if device not in tables:
                tables[device] = (
                    torch.tensor(itab, dtype=torch.int32, device=device),
                    torch.tensor(wtab, dtype=wdtype, device=device),
                )
            return tables[device]

        warps = config["num_warps"]
        if p.backward:
            # Measured on an H100 (bilinear x2): unrolled, the channels_last tiles' backward took
            # 418 us instead of 531; the plane tiles' 2833 instead of 1380 (register pressure).
            unroll = not self.plane and math.prod(runs) <= MAX_UNROLLED_RUNS
            ints = (*sizes, *strides)
            run = launcher(_backward_kernel, grid, 4, ints, (*runs, unroll, *tail), num_warps=warps)
            return lambda dy, dx: run(dy, dx, *on(dy.device))
        run = launcher(_forward_kernel, grid, 4, (*sizes, *strides), (*p.linear, *tail), num_warps=warps)
        return lambda x, y: run(x, y, *on(x.device))


@FAMILY.register
class PlaneEngine(DirectEngine):
    """The same gathers over [rows x columns] tiles of one (n, c, d) plane, for contiguous rows:
    table reads per row and per column instead of per lane."""

    name = "plane"
    plane = True

    def cost(self, problem: ResampleProblem) -> float:
        return plane_cost(problem.channels_last, problem.lane_sizes)

    def configs(self, problem: ResampleProblem) -> list[LaunchConfig]:
        # Measured on an H100 (x2 scales): large tiles forward, small ones backward; 4 warps.
        tiles = (512, 1024, 2048) if problem.backward else (2048, 1024, 512)
        return plane_configs(problem.lane_sizes, tiles, ("BLOCK_A", "BLOCK_B"))

    def grid(self, problem: ResampleProblem, block_a: int, block_b: int) -> tuple[int]:
        d, h, w = problem.lane_sizes
        return (problem.n * problem.channels * d * cdiv(h, block_a) * cdiv(w, block_b),)


# ---------------------------------------------------------------------------------------------
# torch.library ops and autograd. ``ratios`` holds PyTorch's per-dimension scale (1 / scale
# factor, or input / output size); align_corners scales are derived from the sizes.


def _fake_forward(x, output_size, linear, align_corners, ratios):
    return empty_output(x, (x.shape[0], x.shape[1], *output_size))


@custom_op(
    "resample",
    "(Tensor x, int[] output_size, bool linear, bool align_corners, float[] ratios) -> Tensor",
    _fake_forward,
)
def resample_forward(
    x: torch.Tensor, output_size: list[int], linear: bool, align_corners: bool, ratios: list[float]
) -> torch.Tensor:
    """The resampled tensor in x's memory format."""
    y = empty_output(x, (x.shape[0], x.shape[1], *output_size))
    if y.numel() == 0:
        return y
    in3, out3, ratios3 = sizes3(x), pad3(output_size, 1), (1.0,) * (3 - len(ratios)) + tuple(ratios)
    key = (False, linear, align_corners, x.shape, x.stride(), x.dtype, out3, ratios3)

    def problem() -> ResampleProblem:
        return _problem(False, linear, align_corners, x, y, in3, out3, ratios3)

    FAMILY.plan(key, problem, lambda: (x, y))(x, y)
    return y


def _fake_backward(dy, input_size, channels_last, linear, align_corners, ratios):
    return grad_input(dy, input_size, channels_last)


@custom_op(
    "resample_backward",
    "(Tensor dy, int[] input_size, bool channels_last, bool linear, bool align_corners, float[] ratios) "
    "-> Tensor",
    _fake_backward,
)
def resample_backward(
    dy: torch.Tensor,
    input_size: list[int],
    channels_last: bool,
    linear: bool,
    align_corners: bool,
    ratios: list[float],
) -> torch.Tensor:
    """The input gradient, channels_last or contiguous as the input's format was."""
    dx = grad_input(dy, input_size, channels_last)
    if dx.numel() == 0:
        return dx
    in3, out3, ratios3 = sizes3(dx), sizes3(dy), (1.0,) * (3 - len(ratios)) + tuple(ratios)
    key = (True, linear, align_corners, dx.shape, dx.stride(), dy.shape, dy.stride(), dy.dtype, ratios3)

    def problem() -> ResampleProblem:
        return _problem(True, linear, align_corners, dx, dy, in3, out3, ratios3)

    FAMILY.plan(key, problem, lambda: (dy, dx))(dy, dx)
    return dx


class _ResampleFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_size, linear, align_corners, ratios):
        ctx.params = (list(x.shape), channels_last_format(x), linear, align_corners, ratios)
        return resample_forward(x, output_size, linear, align_corners, ratios)

    @staticmethod
    def backward(ctx, dy):
        return resample_backward(dy, *ctx.params), None, None, None, None


# ---------------------------------------------------------------------------------------------
# Public function.

_MODES = ("nearest", "linear", "bilinear", "trilinear")
_LINEAR_DIMS = {"linear": 1, "bilinear": 2, "trilinear": 3}


def _scale_factors(op: str, scale_factor: object, dims: int) -> tuple[float, ...]:
    values = scale_factor if isinstance(scale_factor, (tuple, list)) else (scale_factor,) * dims
    if len(values) != dims or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in values
    ):
        raise TypeError(f"{op}: argument 'scale_factor'={scale_factor!r} must be a number or {dims} numbers")
    if not all(math.isfinite(v) and v > 0 for v in values):
        raise ValueError(f"{op}: argument 'scale_factor'={scale_factor!r} must be finite and positive")
    return tuple(float(v) for v in values)


@autocast_policy(FP32)  # PyTorch's CUDA autocast runs the upsampling kernels in fp32
def interpolate(
    input: torch.Tensor,
    size: int | Sequence[int] | None = None,
    scale_factor: float | Sequence[float] | None = None,
    mode: str = "nearest",
    align_corners: bool | None = None,
    recompute_scale_factor: bool | None = None,
    antialias: bool = False,
) -> torch.Tensor:
    """``F.interpolate`` for the modes "nearest" (1-D, 2-D, 3-D), "linear" (1-D), "bilinear"
    (2-D) and "trilinear" (3-D), with PyTorch's index arithmetic (see the module's docstring).

    Args:
        input: (N, C, L), (N, C, H, W) or (N, C, D, H, W); fp16/bf16/fp32/fp64, any strides
            (channels_last read in place; the output keeps PyTorch's memory format choice).
        size: the output's spatial size (an int or one per dimension); or give ``scale_factor``.
        scale_factor: multiplies each spatial size (floored); the sampling uses 1 / scale_factor
            unless ``recompute_scale_factor`` is True.
        align_corners: linear modes only (default False): corner pixels' centres align.
        antialias: must be False.

    Linear modes interpolate in fp32 (fp64 for fp64). The backward is a deterministic gather.
    Raises TypeError/ValueError for a bad rank, dtype, mode, size or scale factor.
    """
    op = "tdnn.interpolate"
    check_tensor(op, "input", input, min_ndim=3, max_ndim=5)
    dims = input.ndim - 2
    check_choice(op, "mode", mode, _MODES)
    if mode in _LINEAR_DIMS and _LINEAR_DIMS[mode] != dims:
        raise ValueError(f"{op}: mode={mode!r} needs a {_LINEAR_DIMS[mode] + 2}-D input; got {input.ndim}-D")
    linear = mode != "nearest"
    if align_corners is not None and not linear:
        raise ValueError(f"{op}: argument 'align_corners' can only be set with the linear modes")
    if align_corners is not None and not isinstance(align_corners, bool):
        raise TypeError(f"{op}: argument 'align_corners' must be a bool or None, got {align_corners!r}")
    if antialias is not False:
        raise ValueError(f"{op}: argument 'antialias'={antialias!r}; only False is supported")
    if (size is None) == (scale_factor is None):
        raise ValueError(f"{op}: give exactly one of 'size' and 'scale_factor'")
    if any(s == 0 for s in input.shape[1:]):
        raise ValueError(
            f"{op}: argument 'input' of shape {tuple(input.shape)} has an empty non-batch dimension"
        )
    spatial = tuple(input.shape[2:])
    if size is not None:
        if recompute_scale_factor:
            raise ValueError(f"{op}: 'recompute_scale_factor' needs 'scale_factor', not 'size'")
        out = int_tuple(op, "size", size, dims)
        ratios = [i / o if o > 0 else 0.0 for i, o in zip(spatial, out)]
    else:
        factors = _scale_factors(op, scale_factor, dims)
        out = tuple(math.floor(i * f) for i, f in zip(spatial, factors))
        if recompute_scale_factor:
            ratios = [i / o if o > 0 else 0.0 for i, o in zip(spatial, out)]
        else:
            ratios = [1.0 / f for f in factors]
    if min(out) < 1:
        raise ValueError(f"{op}: the output size {out} must be positive (input {spatial})")
    if linear and out == spatial:  # PyTorch's CUDA kernels copy: nearest with scale 1 is a copy
        linear, ratios = False, [1.0] * dims
    args = (list(out), linear, bool(align_corners), ratios)
    if torch.is_grad_enabled() and input.requires_grad:
        return _ResampleFunction.apply(input, *args)
    return resample_forward(input, *args)
