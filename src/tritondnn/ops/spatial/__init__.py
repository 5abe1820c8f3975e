"""Spatial transformer: the affine grid generator and the bilinear grid sampler, forward and
backward (cuDNN's SpatialTf*, ``F.affine_grid`` and ``F.grid_sample``).

``affine_grid`` maps each output position's normalized base coordinates ``(x, y[, z], 1)`` through
``theta`` (2-D and 3-D). ``grid_sample`` reads a 4-D input at the grid's positions with bilinear
interpolation, ``zeros`` or ``border`` padding and either ``align_corners`` convention; its backward
gives the gradient of both the input and the grid.

Each output position reads four corners of its image. With a pixel's channels contiguous (NHWC)
a corner is one vector access for all channels; with NCHW it is a scattered 32-byte sector per
channel. So for an NCHW input the forward (engine ``nhwc-staged``) first copies the input to NHWC
and gathers from the copy, which it saves for the backward in place of the input (one extra copy
of the input held until then); a channels-last input is gathered in place (``pixel-atomic``).

The input gradient scatters each output gradient to four input pixels. The default backward adds
them with fp32 vector atomics into a buffer laid out like the saved input (the order of additions,
hence the last bits, may change between runs), then copies it into the input's layout and dtype.
With ``tdnn.config.deterministic = True`` a serial engine runs instead: one program per (image,
channel block) walks the output pixels in order and adds into the buffer with plain loads and
stores (same bits every run; slow, as parallelism is only N * C / 32 programs).
The grid gradient and ``affine_grid``'s theta gradient are reductions owned by one program each:
no atomics in either mode.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ...core.checks import check_choice, check_tensor
from ...core.config import config
from ...core.engine import Engine, Family, LaunchConfig, Problem
from ...core.launcher import cdiv, launcher
from ...core.relayout import relayout
from .kernels import (
    _affine_grid_backward_kernel,
    _affine_grid_kernel,
    _grid_sample_dx_serial_kernel,
    _grid_sample_kernel,
)

PADDING = ("zeros", "border")

# ---------------------------------------------------------------------------------------------
# 1. References.


def affine_grid_reference(theta: torch.Tensor, size: list[int], align_corners: bool) -> torch.Tensor:
    """``F.affine_grid`` in float64."""
    return F.affine_grid(theta.double(), size, align_corners=align_corners)


def grid_sample_reference(
    input: torch.Tensor, grid: torch.Tensor, padding_mode: str, align_corners: bool
) -> torch.Tensor:
    """``F.grid_sample`` (bilinear) in float64."""
    return F.grid_sample(input.double(), grid.double(), "bilinear", padding_mode, align_corners=align_corners)


# ---------------------------------------------------------------------------------------------
# 2. Kernels: kernels.py.


# ---------------------------------------------------------------------------------------------
# 3. Engines. The forward gathers from the input as given (pixel) or from an NHWC copy (staged),
# which it saves for the backward; the backward adds the input gradient with atomics (pixel) or
# serially (deterministic), into an fp32 buffer laid out like the saved input.


@dataclasses.dataclass(frozen=True)
class GridSampleProblem(Problem):
    """One grid_sample launch. ``x_strides``: the tensor the kernels gather from (in the backward,
    the one the forward saved); ``dy_strides``: (n, c, position) strides of dy, () in the forward;
    ``channels_last``: the layout of the caller's input, which its gradient gets; ``grad``: a
    backward will follow (the forward's heuristic counts it)."""

    backward: bool
    deterministic: bool
    grad: bool
    N: int
    C: int
    H: int
    W: int
    Ho: int
    Wo: int
    dtype: str
    align_corners: bool
    border: bool
    x_strides: tuple[int, ...]
    grid_strides: tuple[int, ...]
    dy_strides: tuple[int, ...]
    channels_last: bool


def _channels_inner(strides: tuple[int, ...], C: int) -> bool:
    """Whether a pixel's channels are contiguous: each corner is then one vector access."""
    return C > 1 and strides[1] == 1


def _problem(
    x: torch.Tensor,
    grid: torch.Tensor,
    border: bool,
    align: bool,
    backward: bool,
    grad: bool = False,
    dy: torch.Tensor | None = None,
    channels_last: bool | None = None,
) -> GridSampleProblem:
    N, C, H, W = x.shape
    Ho, Wo = grid.shape[1], grid.shape[2]
    return GridSampleProblem(
        backward,
        config.deterministic if backward else False,
        grad,
        N,
        C,
        H,
        W,
        Ho,
        Wo,
        str(x.dtype).removeprefix("torch."),
        align,
        border,
        tuple(x.stride()),
        tuple(grid.stride()),
        _out_strides(dy) if dy is not None else (),
        _channels_inner(x.stride(), C) if channels_last is None else channels_last,
    )


def _describe(
    input: torch.Tensor,
    grid: torch.Tensor,
    padding_mode: str = "zeros",
    align_corners: bool = False,
    backward: bool = False,
) -> GridSampleProblem:
    """The problem ``grid_sample(input, grid, ...)`` (or its backward, for a contiguous dy) poses."""
    N, C = input.shape[:2]
    dy = torch.empty((N, C, grid.shape[1], grid.shape[2]), device="meta") if backward else None
    return _problem(input, grid, padding_mode == "border", bool(align_corners), backward, dy=dy)


FAMILY: Family[GridSampleProblem] = Family("grid_sample", _describe)


def _acc(dtype: str):
    return tl.float64 if dtype == "float64" else tl.float32


def _dense_strides(problem: GridSampleProblem, channels_last: bool) -> tuple[int, int, int, int]:
    C, H, W = problem.C, problem.H, problem.W
    return (H * W * C, 1, W * C, C) if channels_last else (C * H * W, H * W, W, 1)


def _y_strides(problem: GridSampleProblem) -> tuple[int, int, int]:
    """(n, c, position) strides of the forward's contiguous output."""
    return problem.C * problem.Ho * problem.Wo, problem.Ho * problem.Wo, 1


def _elem_bytes(dtype: str) -> int:
    return {"float64": 8, "float32": 4}.get(dtype, 2)


def _cost(problem: GridSampleProblem, channels_inner: bool, staged: bool) -> float:
    """Estimated microseconds at 3 TB/s. A corner read or atomic add moves a whole 32-byte sector
    when channels are strided; when they are contiguous, the C channels of a corner share sectors.
    Corner reads mostly hit L2 (an image is a few MB): counted at a third of their bytes; atomics
    at twice theirs. The forward of a problem with ``grad`` adds the backward it sets up."""
    es = _elem_bytes(problem.dtype)
    acc_es = 8 if problem.dtype == "float64" else 4
    outs = problem.N * problem.C * problem.Ho * problem.Wo
    numel = problem.N * problem.C * problem.H * problem.W
    corner = max(es, 32 / problem.C) if channels_inner else 32
    corner_acc = max(acc_es, 32 / problem.C) if channels_inner else 32
    fwd = outs * es + 4 * outs * corner / 3 + (2 * numel * es if staged else 0)
    bwd = 2 * outs * es + 4 * outs * corner / 3 + 8 * outs * corner_acc + numel * acc_es
    if channels_inner != problem.channels_last or acc_es != es:
        bwd += numel * (acc_es + es)  # the gradient's copy to the caller's layout and dtype
    total = bwd if problem.backward else fwd + (bwd if problem.grad else 0)
    return total / 3e6


def _kernel(
    problem: GridSampleProblem,
    cfg: LaunchConfig,
    x_strides: tuple[int, ...],
    out_strides: tuple[int, ...],
    dx_strides: tuple[int, ...] = (0, 0, 0, 0),
    atomic_dx: bool = False,
) -> Callable[..., None]:
    """``_grid_sample_kernel`` for the problem, called with (x, g, y, dy, dx, dg)."""
    P = problem.N * problem.Ho * problem.Wo
    ints = (problem.C, problem.H, problem.W, problem.Ho, problem.Wo, P)
    return launcher(
        _grid_sample_kernel,
        (cdiv(P, cfg["block_p"]),),
        num_tensors=6,
        ints=(*ints, *x_strides, *problem.grid_strides, *out_strides, *dx_strides),
        constexprs=(
            problem.backward,
            atomic_dx,
            problem.align_corners,
            problem.border,
            _acc(problem.dtype),
            cfg["block_p"],
            cfg["block_c"],
        ),
        num_warps=cfg["num_warps"],
    )


def _tiles(problem: GridSampleProblem, channels_inner: bool) -> list[LaunchConfig]:
    """Tile shapes worth timing, the heuristic's first. Contiguous channels: a pixel's channels
    across the lanes (vector corners). Strided channels: many positions and few channels at a
    time (the programs on an SM then share fewer channel planes, which we take to be why that
    measured faster)."""
    # First choices measured on an H100 (32 x 64 x 128 x 128 fp32, random grid): contiguous, 16 x 64
    # with 2 warps (gather 147 us, backward 476 us; 32 x 64 with 4 warps: 161 and 491); strided,
    # 512 x 2 (forward 620 us; 64 x 32: 955).
    c2 = triton.next_power_of_2(problem.C)
    if channels_inner:
        bc = min(64, c2)
        shapes = [(1024 // bc, bc, 2), (1024 // bc, bc, 4), (2048 // bc, bc, 4), (4096 // bc, bc, 8)]
    else:
        shapes = [(512, min(2, c2), 4), (256, min(4, c2), 4), (128, min(8, c2), 4), (64, min(32, c2), 4)]
    return [{"block_p": p, "block_c": c, "num_warps": w} for p, c, w in shapes]


def _relayout(problem: GridSampleProblem, src: tuple[int, ...], dst: tuple[int, ...]) -> Callable[..., None]:
    """The relayout copy of the problem's input shape, called with (src, dst)."""
    return relayout(problem.N, problem.C, problem.H, problem.W, src, dst)


def _input_grad(
    problem: GridSampleProblem, accumulate: Callable[[tuple[int, ...]], Callable[..., None]]
) -> Callable[..., None]:
    """The backward's run(x, g, dy, dg, dx): ``accumulate(buffer strides)`` gives the launch
    (x, g, dy, dg, buffer) that adds the input gradient into a zeroed fp32 (fp64) buffer laid out
    like x (NHWC when its channels are contiguous: vector atomics), which is dx itself when the
    caller's layout and dtype match, else copied into dx."""
    inner = _channels_inner(problem.x_strides, problem.C)
    acc_dtype = torch.float64 if problem.dtype == "float64" else torch.float32
    direct = inner == problem.channels_last and problem.dtype == str(acc_dtype).removeprefix("torch.")
    strides = _dense_strides(problem, inner)
    fmt = torch.channels_last if inner else torch.contiguous_format
    add = accumulate(strides)
    copy = None if direct else _relayout(problem, strides, _dense_strides(problem, problem.channels_last))

    def run(x, g, dy, dg, dx):
        if direct:
            add(x, g, dy, dg, dx.zero_())
            return
        buf = torch.empty(x.shape, dtype=acc_dtype, device=x.device, memory_format=fmt).zero_()
        add(x, g, dy, dg, buf)
        copy(buf, dx)

    return run


@FAMILY.register
class PixelEngine(Engine[GridSampleProblem]):
    """Output positions in parallel, channels in a loop, on the input as given; the backward adds
    the input gradient with fp32 atomics (not deterministic)."""

    name = "pixel-atomic"

    def not_supported_reasons(self, problem: GridSampleProblem) -> list[str]:
        if problem.backward and problem.deterministic:
            return ["adds the input gradient with atomics; tdnn.config.deterministic is set"]
        return []

    def cost(self, problem: GridSampleProblem) -> float:
        return _cost(problem, _channels_inner(problem.x_strides, problem.C), staged=False)

    def configs(self, problem: GridSampleProblem) -> list[LaunchConfig]:
        return _tiles(problem, _channels_inner(problem.x_strides, problem.C))

    def bind(self, problem: GridSampleProblem, config: LaunchConfig) -> Callable[..., None]:
        if not problem.backward:
            launch = _kernel(problem, config, problem.x_strides, _y_strides(problem))

            def run(x, g, y):
                launch(x, g, y, y, y, y)
                return x

            return run

        def accumulate(strides):
            launch = _kernel(problem, config, problem.x_strides, problem.dy_strides, strides, atomic_dx=True)
            return lambda x, g, dy, dg, buf: launch(x, g, dy, dy, buf, dg)

        return _input_grad(problem, accumulate)


@FAMILY.register
class StagedEngine(Engine[GridSampleProblem]):
    """Forward only: copies an input whose channels are strided (NCHW) to NHWC, then gathers each
    corner's channels as vectors; the copy is saved, so the backward's corner reads and atomic
    adds are vectors too."""

    name = "nhwc-staged"

    def not_supported_reasons(self, problem: GridSampleProblem) -> list[str]:
        if problem.backward:
            return ["forward only: the backward works on the copy the forward saved"]
        if _channels_inner(problem.x_strides, problem.C):
            return ["the input's channels are contiguous already (pixel-atomic reads it in place)"]
        return []

    def cost(self, problem: GridSampleProblem) -> float:
        return _cost(problem, True, staged=True)

    def configs(self, problem: GridSampleProblem) -> list[LaunchConfig]:
        return _tiles(problem, True)

    def bind(self, problem: GridSampleProblem, config: LaunchConfig) -> Callable[..., None]:
        nhwc = _dense_strides(problem, True)
        stage = _relayout(problem, problem.x_strides, nhwc)
        launch = _kernel(problem, config, nhwc, _y_strides(problem))
        shape = (problem.N, problem.C, problem.H, problem.W)

        def run(x, g, y):
            xc = torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=torch.channels_last)
            stage(x, xc)
            launch(xc, g, y, y, y, y)
            return xc

        return run


@FAMILY.register
class SerialEngine(Engine[GridSampleProblem]):
    """Backward only: the grid gradient by output position, the input gradient by one program per
    (image, channel block) walking positions in order: the same bits every run."""

    name = "serial-deterministic"

    def not_supported_reasons(self, problem: GridSampleProblem) -> list[str]:
        if not problem.backward:
            return ["backward only (the forward has no reduction)"]
        return []

    def cost(self, problem: GridSampleProblem) -> float:
        # A chain of Ho * Wo read-modify-write steps per program, about 1.5 us each on an H100
        # (24.5 ms for 32 x 64 x 128 x 128), all programs of a wave at once.
        programs = problem.N * cdiv(problem.C, 32)
        return problem.Ho * problem.Wo * 1.5 * cdiv(programs, 2048)

    def bind(self, problem: GridSampleProblem, config: LaunchConfig) -> Callable[..., None]:
        tiles = _tiles(problem, _channels_inner(problem.x_strides, problem.C))[0]
        grid_grad = _kernel(problem, tiles, problem.x_strides, problem.dy_strides)
        block_c = min(32, triton.next_power_of_2(problem.C))

        def accumulate(strides):
            serial = launcher(
                _grid_sample_dx_serial_kernel,
                (problem.N, cdiv(problem.C, block_c)),
                num_tensors=3,
                ints=(
                    problem.C,
                    problem.H,
                    problem.W,
                    problem.Ho,
                    problem.Wo,
                    *problem.grid_strides,
                    *problem.dy_strides,
                    *strides,
                ),
                constexprs=(problem.align_corners, problem.border, _acc(problem.dtype), block_c),
                num_warps=1,
            )

            def run(x, g, dy, dg, buf):
                grid_grad(x, g, dy, dy, buf, dg)
                serial(g, dy, buf)

            return run

        return _input_grad(problem, accumulate)


def _out_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(n, c, position) strides of an (N, C, Ho, Wo) tensor whose (Ho, Wo) merge into one."""
    if t.shape[3] != 1 and t.shape[2] != 1 and t.stride(2) != t.stride(3) * t.shape[3]:
        raise AssertionError("positions must merge")  # callers make such tensors contiguous
    sp = t.stride(3) if t.shape[3] != 1 else t.stride(2)
    return t.stride(0), t.stride(1), sp


# ---------------------------------------------------------------------------------------------
# 4. Autograd.

_CHOSEN: dict[tuple, Callable[..., object]] = {}


def _plan(problem: GridSampleProblem, algo: str | None, timing_args: Callable[[], tuple]) -> Callable:
    """The bound launch for ``problem``: the family's choice, or the engine named ``algo``."""
    if algo is None:
        return FAMILY.plan((problem,), lambda: problem, timing_args)
    key = (config.version, problem, algo)
    bound = _CHOSEN.get(key)
    if bound is None:
        choice = FAMILY.choose(problem, algo, None, "tdnn.grid_sample")
        bound = _CHOSEN[key] = choice.engine.bind(problem, choice.config)
    return bound


class _GridSampleFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, grid, border, align, grad, algo):
        N, C = x.shape[:2]
        Ho, Wo = grid.shape[1], grid.shape[2]
        y = torch.empty((N, C, Ho, Wo), dtype=x.dtype, device=x.device)
        saved = x
        if y.numel():
            problem = _problem(x, grid, border, align, False, grad)
            saved = _plan(problem, algo, lambda: (x, grid, torch.empty_like(y)))(x, grid, y)
        ctx.save_for_backward(saved, grid)
        ctx.params = (border, align, _channels_inner(x.stride(), C))
        return y

    @staticmethod
    def backward(ctx, dy):
        x, grid = ctx.saved_tensors
        border, align, channels_last = ctx.params
        Wo = grid.shape[2]
        if dy.shape[2] != 1 and dy.shape[3] != 1 and dy.stride(2) != dy.stride(3) * Wo:
            dy = dy.contiguous()
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device, memory_format=fmt)
        dg = torch.empty(grid.shape, dtype=grid.dtype, device=grid.device)
        if dy.numel():
            problem = _problem(x, grid, border, align, True, dy=dy, channels_last=channels_last)
            timing = lambda: (x, grid, dy, torch.empty_like(dg), torch.empty_like(dx))
            _plan(problem, None, timing)(x, grid, dy, dg, dx)
        else:
            dx.zero_()
            dg.zero_()
        return dx, dg, None, None, None, None


class _AffineGridFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, theta, size, align):
        dims = len(size) - 2
        spatial = list(size[2:]) if dims == 3 else [1, *size[2:]]
        D, H, W = spatial
        P = D * H * W
        grid = torch.empty((size[0], *size[2:], dims), dtype=theta.dtype, device=theta.device)
        acc = _acc(str(theta.dtype).removeprefix("torch."))
        if grid.numel():
            launcher(
                _affine_grid_kernel,
                (cdiv(P, 256), size[0]),
                num_tensors=2,
                ints=(P, D, H, W),
                constexprs=(dims, align, acc, 256),
            )(theta.contiguous(), grid)
        ctx.params = (dims, D, H, W, align, acc)
        return grid

    @staticmethod
    def backward(ctx, dgrid):
        dims, D, H, W, align, acc = ctx.params
        N = dgrid.shape[0]
        g = dgrid.reshape(N, D * H * W, dims)
        dtheta = torch.empty((N, dims, dims + 1), dtype=dgrid.dtype, device=dgrid.device)
        if N:
            launcher(
                _affine_grid_backward_kernel,
                (N,),
                num_tensors=2,
                ints=(D * H * W, D, H, W, *g.stride()),
                constexprs=(dims, align, acc, 256),
            )(g, dtheta)
        return dtheta, None, None


# ---------------------------------------------------------------------------------------------
# 5. Public functions.


def affine_grid(theta: torch.Tensor, size: list[int], align_corners: bool | None = None) -> torch.Tensor:
    """``F.affine_grid``: the sampling grid of an affine transform.

    Args:
        theta: (N, 2, 3) for 2-D or (N, 3, 4) for 3-D, fp16/bf16/fp32/fp64.
        size: the output's (N, C, H, W) or (N, C, D, H, W).
        align_corners: as in ``F.affine_grid`` (None means False).

    Returns (N, H, W, 2) or (N, D, H, W, 3) in theta's dtype; differentiable with respect to theta
    (a fixed-order reduction per image).
    """
    name = "tdnn.affine_grid"
    check_tensor(name, "theta", theta, min_ndim=3, max_ndim=3)
    size = list(size)
    if len(size) not in (4, 5) or not all(isinstance(s, int) and s >= 0 for s in size):
        raise ValueError(f"{name}: argument 'size'={size} must be 4 or 5 non-negative ints")
    dims = len(size) - 2
    if tuple(theta.shape) != (size[0], dims, dims + 1):
        raise ValueError(
            f"{name}: theta of shape {tuple(theta.shape)} does not match size {size}; expected "
            f"({size[0]}, {dims}, {dims + 1})"
        )
    align = bool(align_corners)
    return _AffineGridFunction.apply(theta, tuple(size), align)


def grid_sample(
    input: torch.Tensor,
    grid: torch.Tensor,
    mode: str = "bilinear",
    padding_mode: str = "zeros",
    align_corners: bool | None = None,
    *,
    algo: str | None = None,
) -> torch.Tensor:
    """``F.grid_sample`` for 4-D inputs: bilinear samples of ``input`` at ``grid``'s positions.

    Args:
        input: (N, C, H, W), fp16/bf16/fp32/fp64, any strides (channels_last included).
        grid: (N, Ho, Wo, 2) of normalized (x, y) in [-1, 1], the input's dtype, any strides.
        mode: ``"bilinear"`` (``"nearest"``/``"bicubic"`` raise NotImplementedError).
        padding_mode: ``"zeros"`` or ``"border"`` (``"reflection"`` raises NotImplementedError).
        align_corners: as in ``F.grid_sample`` (None means False).
        algo: the forward's engine: None (heuristics), ``"pixel-atomic"`` (gathers from the input
            as given) or ``"nhwc-staged"`` (from an NHWC copy, for inputs with strided channels).

    Returns (N, C, Ho, Wo), contiguous, accumulated in fp32 (fp64). Differentiable with respect to
    both ``input`` and ``grid``; the input's gradient has the input's dtype and layout (NHWC when
    its channels are contiguous, else contiguous NCHW). See the module notes on determinism.
    """
    name = "tdnn.grid_sample"
    check_tensor(name, "input", input, min_ndim=4, max_ndim=4)
    check_tensor(name, "grid", grid, min_ndim=4, max_ndim=4)
    if mode in ("nearest", "bicubic"):
        raise NotImplementedError(f"{name}: mode {mode!r} is not implemented; only 'bilinear'")
    check_choice(name, "mode", mode, ("bilinear",))
    if padding_mode == "reflection":
        raise NotImplementedError(
            f"{name}: padding_mode 'reflection' is not implemented; use 'zeros' or 'border'"
        )
    check_choice(name, "padding_mode", padding_mode, PADDING)
    if grid.dtype != input.dtype or grid.device != input.device:
        raise TypeError(
            f"{name}: 'grid' ({grid.dtype}, {grid.device}) must match 'input' ({input.dtype}, {input.device})"
        )
    if grid.shape[0] != input.shape[0] or grid.shape[3] != 2:
        raise ValueError(
            f"{name}: grid of shape {tuple(grid.shape)} must be (N, Ho, Wo, 2) with N = {input.shape[0]}"
        )
    if 0 in input.shape[2:]:
        raise ValueError(f"{name}: input of shape {tuple(input.shape)} has an empty spatial dimension")
    grad = torch.is_grad_enabled() and (input.requires_grad or grid.requires_grad)
    border = padding_mode == "border"
    return _GridSampleFunction.apply(input, grid, border, bool(align_corners), grad, algo)


__all__ = ["FAMILY", "affine_grid", "affine_grid_reference", "grid_sample", "grid_sample_reference"]
