"""Spatial transformer: the affine grid generator and the bilinear grid sampler, forward and
backward (cuDNN's SpatialTf*, ``F.affine_grid`` and ``F.grid_sample``).

``affine_grid`` maps each output position's normalized base coordinates ``(x, y[, z], 1)`` through
``theta`` (2-D and 3-D). ``grid_sample`` reads a 4-D input at the grid's positions with bilinear
interpolation, ``zeros`` or ``border`` padding and either ``align_corners`` convention; its backward
gives the gradient of both the input and the grid.

The input gradient scatters each output gradient to four input pixels. The default engine adds
them with fp32 atomics (the order of additions, hence the last bits, may change between runs).
With ``tdnn.config.deterministic = True`` a gather-free serial engine runs instead: one program
per (image, channel block) walks the output pixels in order and adds into the input gradient with
plain loads and stores (same bits every run; slower, as parallelism is only N * C / 32 programs).
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

from ..core.checks import check_choice, check_tensor
from ..core.config import config
from ..core.engine import Engine, Family, LaunchConfig, Problem
from ..core.launcher import cdiv, launcher
from ..core.numerics import convert

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
# 2. Kernels.


@triton.jit
def _base(i, size, ALIGN: tl.constexpr):
    """Normalized coordinate of index i along a dimension of ``size`` (0 for size 1, as torch)."""
    f = i.to(tl.float32)
    if ALIGN:
        v = tl.where(size > 1, -1.0 + 2.0 * f / tl.maximum(size - 1, 1).to(tl.float32), 0.0)
    else:
        v = (2.0 * f + 1.0) / size - 1.0  # size may be a constexpr (a size of 1 is specialized)
    return v


@triton.jit
def _base_tile(p, D, H, W, DIMS: tl.constexpr, ALIGN: tl.constexpr, ACC: tl.constexpr):
    """[BLOCK, 4] tile of (x, y, z, 1) (3-D) or (x, y, 1, 0) (2-D) for flat output positions p."""
    w = p % W
    h = (p // W) % H
    d = p // (W * H)
    j = tl.arange(0, 4)[None, :]
    x = _base(w, W, ALIGN).to(ACC)[:, None]
    y = _base(h, H, ALIGN).to(ACC)[:, None]
    z = _base(d, D, ALIGN).to(ACC)[:, None]
    if DIMS == 2:
        t = tl.where(j == 0, x, tl.where(j == 1, y, tl.where(j == 2, 1.0, 0.0)))
    else:
        t = tl.where(j == 0, x, tl.where(j == 1, y, tl.where(j == 2, z, 1.0)))
    return t


@triton.jit
def _affine_grid_kernel(
    theta_ptr,
    grid_ptr,
    P,
    D,
    H,
    W,
    DIMS: tl.constexpr,
    ALIGN: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """grid[n, p, i] = sum_j theta[n, i, j] * base[p, j] for P positions; program axis 1 is n.

    theta: contiguous (N, DIMS, DIMS + 1); grid: contiguous (N, P, DIMS).
    """
    n = tl.program_id(1).to(tl.int64)
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = p < P
    base = _base_tile(p, D, H, W, DIMS, ALIGN, ACC)
    j = tl.arange(0, 4)
    for i in tl.static_range(DIMS):
        row = convert(
            tl.load(theta_ptr + n * (DIMS * (DIMS + 1)) + i * (DIMS + 1) + j, mask=j <= DIMS, other=0.0), ACC
        )
        v = tl.sum(base * row[None, :], 1)
        tl.store(grid_ptr + (n * P + p) * DIMS + i, convert(v, grid_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _affine_grid_backward_kernel(
    dgrid_ptr,
    dtheta_ptr,
    P,
    D,
    H,
    W,
    gs_n,
    gs_p,
    gs_i,
    DIMS: tl.constexpr,
    ALIGN: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """dtheta[n, i, j] = sum_p dgrid[n, p, i] * base[p, j]; one program per n, positions in order
    (a fixed summation order: the same bits every run). dgrid strides: gs_n, gs_p, gs_i."""
    n = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, 4)
    for i in tl.static_range(DIMS):
        acc = tl.zeros([BLOCK, 4], ACC)
        for start in range(0, P, BLOCK):
            p = start + tl.arange(0, BLOCK)
            mask = p < P
            g = convert(tl.load(dgrid_ptr + n * gs_n + p * gs_p + i * gs_i, mask=mask, other=0.0), ACC)
            acc += g[:, None] * _base_tile(p, D, H, W, DIMS, ALIGN, ACC)
        row = tl.sum(acc, 0)
        out = dtheta_ptr + n * (DIMS * (DIMS + 1)) + i * (DIMS + 1) + j
        tl.store(out, convert(row, dtheta_ptr.dtype.element_ty), mask=j <= DIMS)


@triton.jit
def _source(g, size, ALIGN: tl.constexpr, BORDER: tl.constexpr):
    """Pixel coordinate of normalized g and d(coordinate)/d(g) (0 where border clipping binds)."""
    if ALIGN:
        mult = (size - 1).to(g.dtype) * 0.5
        c = (g + 1.0) * mult
    else:
        mult = size.to(g.dtype) * 0.5
        c = ((g + 1.0) * size.to(g.dtype) - 1.0) * 0.5
    if BORDER:
        hi = (size - 1).to(g.dtype)
        clipped = (c <= 0.0) | (c >= hi)
        c = tl.where(c <= 0.0, 0.0, tl.where(c >= hi, hi, c))
        mult = tl.where(clipped, 0.0, mult)
    return c, mult


@triton.jit
def _corners(gx, gy, H, W, ALIGN: tl.constexpr, BORDER: tl.constexpr):
    ix, mx = _source(gx, W, ALIGN, BORDER)
    iy, my = _source(gy, H, ALIGN, BORDER)
    fx = tl.floor(ix)
    fy = tl.floor(iy)
    tx = ix - fx
    ty = iy - fy
    # NaN or huge coordinates: the int conversion is clamped away from overflow; the corner is
    # then out of bounds and reads zero.
    x0 = tl.where(fx == fx, tl.maximum(tl.minimum(fx, 2.0**30), -(2.0**30)), -2.0).to(tl.int32)
    y0 = tl.where(fy == fy, tl.maximum(tl.minimum(fy, 2.0**30), -(2.0**30)), -2.0).to(tl.int32)
    return x0, y0, tx, ty, mx, my


@triton.jit
def _grid_sample_kernel(
    x_ptr,
    g_ptr,
    y_ptr,
    dy_ptr,
    dx_ptr,
    dg_ptr,
    C,
    H,
    W,
    Ho,
    Wo,
    P,
    xs_n,
    xs_c,
    xs_h,
    xs_w,
    gs_n,
    gs_h,
    gs_w,
    gs_k,
    ys_n,
    ys_c,
    ys_p,
    BACKWARD: tl.constexpr,
    ATOMIC_DX: tl.constexpr,
    ALIGN: tl.constexpr,
    BORDER: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Bilinear sampling of x (N, C, H, W; strides xs_*) at grid (N, Ho, Wo, 2; strides gs_*) for
    BLOCK_P of the P = N * Ho * Wo output positions, looping over channels in BLOCK_C chunks.

    Forward: y (strides ys_n, ys_c, ys_p over (n, c, ho * Wo + wo)) = the samples.
    Backward: dy (same strides as y) given; writes dg (contiguous like the grid) = sum over channels,
    and when ATOMIC_DX adds the input gradient into dx (fp32, fp64 for fp64; contiguous NCHW) with
    atomics.
    """
    p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    pmask = p < P
    p = p.to(tl.int64)
    n = p // (Ho * Wo)
    q = p % (Ho * Wo)
    ho = q // Wo
    wo = q % Wo
    gbase = g_ptr + n * gs_n + ho * gs_h + wo * gs_w
    gx = convert(tl.load(gbase, mask=pmask, other=0.0), ACC)
    gy = convert(tl.load(gbase + gs_k, mask=pmask, other=0.0), ACC)
    x0, y0, tx, ty, mx, my = _corners(gx, gy, H, W, ALIGN, BORDER)
    x1 = x0 + 1
    y1 = y0 + 1
    in_x0 = (x0 >= 0) & (x0 < W)
    in_x1 = (x1 >= 0) & (x1 < W)
    in_y0 = (y0 >= 0) & (y0 < H)
    in_y1 = (y1 >= 0) & (y1 < H)
    m00 = (pmask & in_y0 & in_x0)[:, None]
    m01 = (pmask & in_y0 & in_x1)[:, None]
    m10 = (pmask & in_y1 & in_x0)[:, None]
    m11 = (pmask & in_y1 & in_x1)[:, None]
    w00 = ((1.0 - tx) * (1.0 - ty))[:, None]
    w01 = (tx * (1.0 - ty))[:, None]
    w10 = ((1.0 - tx) * ty)[:, None]
    w11 = (tx * ty)[:, None]
    xn = x_ptr + (n * xs_n)[:, None]
    o00 = (y0.to(tl.int64) * xs_h + x0.to(tl.int64) * xs_w)[:, None]
    o01 = (y0.to(tl.int64) * xs_h + x1.to(tl.int64) * xs_w)[:, None]
    o10 = (y1.to(tl.int64) * xs_h + x0.to(tl.int64) * xs_w)[:, None]
    o11 = (y1.to(tl.int64) * xs_h + x1.to(tl.int64) * xs_w)[:, None]
    yoff = (n * ys_n + q * ys_p)[:, None]
    gix = tl.zeros([BLOCK_P, BLOCK_C], ACC)
    giy = tl.zeros([BLOCK_P, BLOCK_C], ACC)
    for c0 in range(0, C, BLOCK_C):
        c = (c0 + tl.arange(0, BLOCK_C))[None, :]
        cm = c < C
        xc = xn + c * xs_c
        v00 = convert(tl.load(xc + o00, mask=m00 & cm, other=0.0), ACC)
        v01 = convert(tl.load(xc + o01, mask=m01 & cm, other=0.0), ACC)
        v10 = convert(tl.load(xc + o10, mask=m10 & cm, other=0.0), ACC)
        v11 = convert(tl.load(xc + o11, mask=m11 & cm, other=0.0), ACC)
        omask = pmask[:, None] & cm
        if BACKWARD:
            d = convert(tl.load(dy_ptr + yoff + c * ys_c, mask=omask, other=0.0), ACC)
            gix += d * ((v01 - v00) * (1.0 - ty)[:, None] + (v11 - v10) * ty[:, None])
            giy += d * ((v10 - v00) * (1.0 - tx)[:, None] + (v11 - v01) * tx[:, None])
            if ATOMIC_DX:
                dxc = dx_ptr + (n * C * H * W)[:, None] + c * (H * W)
                tl.atomic_add(
                    dxc + (y0 * W + x0)[:, None], (d * w00).to(dx_ptr.dtype.element_ty), mask=m00 & cm
                )
                tl.atomic_add(
                    dxc + (y0 * W + x1)[:, None], (d * w01).to(dx_ptr.dtype.element_ty), mask=m01 & cm
                )
                tl.atomic_add(
                    dxc + (y1 * W + x0)[:, None], (d * w10).to(dx_ptr.dtype.element_ty), mask=m10 & cm
                )
                tl.atomic_add(
                    dxc + (y1 * W + x1)[:, None], (d * w11).to(dx_ptr.dtype.element_ty), mask=m11 & cm
                )
        else:
            out = v00 * w00 + v01 * w01 + v10 * w10 + v11 * w11
            tl.store(y_ptr + yoff + c * ys_c, convert(out, y_ptr.dtype.element_ty), mask=omask)
    if BACKWARD:
        dgx = tl.sum(gix, 1) * mx
        dgy = tl.sum(giy, 1) * my
        tl.store(dg_ptr + p * 2, convert(dgx, dg_ptr.dtype.element_ty), mask=pmask)
        tl.store(dg_ptr + p * 2 + 1, convert(dgy, dg_ptr.dtype.element_ty), mask=pmask)


@triton.jit
def _grid_sample_dx_serial_kernel(
    g_ptr,
    dy_ptr,
    dx_ptr,
    C,
    H,
    W,
    Ho,
    Wo,
    gs_n,
    gs_h,
    gs_w,
    gs_k,
    ys_n,
    ys_c,
    ys_p,
    ALIGN: tl.constexpr,
    BORDER: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Deterministic input gradient: program (n, channel block) walks the output positions of
    image n in order, adding each one's four weighted gradients into dx (fp32 or fp64, contiguous
    NCHW) with plain loads and stores. A channel always maps to the same thread, so each
    read-modify-write sees the previous one."""
    n = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < C
    dxn = dx_ptr + n * C * H * W + c.to(tl.int64) * (H * W)
    for q in range(0, Ho * Wo):
        ho = q // Wo
        wo = q % Wo
        gb = g_ptr + n * gs_n + ho * gs_h + wo * gs_w
        gx = convert(tl.load(gb), ACC)
        gy = convert(tl.load(gb + gs_k), ACC)
        x0, y0, tx, ty, _mx, _my = _corners(gx, gy, H, W, ALIGN, BORDER)
        d = convert(tl.load(dy_ptr + n * ys_n + c * ys_c + q * ys_p, mask=cm, other=0.0), ACC)
        for k in tl.static_range(4):
            xi = x0 + (k % 2)
            yi = y0 + (k // 2)
            wx = (k % 2) * tx + (1 - k % 2) * (1.0 - tx)
            wy = (k // 2) * ty + (1 - k // 2) * (1.0 - ty)
            ok = (xi >= 0) & (xi < W) & (yi >= 0) & (yi < H)
            ptr = dxn + (yi * W + xi)
            m = cm & ok
            cur = tl.load(ptr, mask=m, other=0.0)
            tl.store(ptr, cur + (d * (wx * wy)).to(cur.dtype), mask=m)


# ---------------------------------------------------------------------------------------------
# 3. Engines (the grid sampler's backward: atomic or serial input gradient).


@dataclasses.dataclass(frozen=True)
class GridSampleProblem(Problem):
    backward: bool
    deterministic: bool
    N: int
    C: int
    H: int
    W: int
    Ho: int
    Wo: int
    dtype: str
    align_corners: bool
    border: bool


def _describe(
    input: torch.Tensor,
    grid: torch.Tensor,
    padding_mode: str = "zeros",
    align_corners: bool = False,
    backward: bool = False,
) -> GridSampleProblem:
    """The problem ``grid_sample(input, grid, ...)`` (or its backward) poses."""
    N, C, H, W = input.shape
    return GridSampleProblem(
        backward,
        config.deterministic,
        N,
        C,
        H,
        W,
        grid.shape[1],
        grid.shape[2],
        str(input.dtype).removeprefix("torch."),
        align_corners,
        padding_mode == "border",
    )


FAMILY: Family[GridSampleProblem] = Family("grid_sample", _describe)


def _acc(dtype: str):
    return tl.float64 if dtype == "float64" else tl.float32


def _pixel_launch(problem: GridSampleProblem, atomic_dx: bool, block_p: int = 64) -> Callable[..., None]:
    block_c = min(32, triton.next_power_of_2(problem.C))
    P = problem.N * problem.Ho * problem.Wo
    return launcher(
        _grid_sample_kernel,
        (cdiv(P, block_p),),
        num_tensors=6,
        constexprs=(
            problem.backward,
            atomic_dx,
            problem.align_corners,
            problem.border,
            _acc(problem.dtype),
            block_p,
            block_c,
        ),
        num_warps=4,
    )


@FAMILY.register
class PixelEngine(Engine[GridSampleProblem]):
    """Output positions in parallel, channels in a loop; the backward adds the input gradient with
    fp32 atomics (not deterministic)."""

    name = "pixel-atomic"

    def not_supported_reasons(self, problem: GridSampleProblem) -> list[str]:
        if problem.backward and problem.deterministic:
            return ["adds the input gradient with atomics; tdnn.config.deterministic is set"]
        return []

    def cost(self, problem: GridSampleProblem) -> float:
        return 1.0

    def bind(self, problem: GridSampleProblem, config: LaunchConfig) -> Callable[..., None]:
        launch = _pixel_launch(problem, True)
        P = problem.N * problem.Ho * problem.Wo

        def run(x, g, y, dy, dx, dg):
            launch(
                x,
                g,
                y,
                dy,
                dx,
                dg,
                problem.C,
                problem.H,
                problem.W,
                problem.Ho,
                problem.Wo,
                P,
                *x.stride(),
                *g.stride(),
                *_out_strides(y if y is not None else dy),
            )

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
        return 10.0

    def bind(self, problem: GridSampleProblem, config: LaunchConfig) -> Callable[..., None]:
        grid_grad = _pixel_launch(problem, False)
        block_c = min(32, triton.next_power_of_2(problem.C))
        serial = launcher(
            _grid_sample_dx_serial_kernel,
            (problem.N, cdiv(problem.C, block_c)),
            num_tensors=3,
            constexprs=(problem.align_corners, problem.border, _acc(problem.dtype), block_c),
            num_warps=1,
        )
        P = problem.N * problem.Ho * problem.Wo
        dims = (problem.C, problem.H, problem.W, problem.Ho, problem.Wo)

        def run(x, g, y, dy, dx, dg):
            ys = _out_strides(dy)
            grid_grad(x, g, dy, dy, dx, dg, *dims, P, *x.stride(), *g.stride(), *ys)
            serial(g, dy, dx, *dims, *g.stride(), *ys)

        return run


def _out_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(n, c, position) strides of an (N, C, Ho, Wo) tensor whose (Ho, Wo) merge into one."""
    if t.shape[3] != 1 and t.shape[2] != 1 and t.stride(2) != t.stride(3) * t.shape[3]:
        raise AssertionError("positions must merge")  # callers make such tensors contiguous
    sp = t.stride(3) if t.shape[3] != 1 else t.stride(2)
    return t.stride(0), t.stride(1), sp


# ---------------------------------------------------------------------------------------------
# 4. Autograd.


def _plan(problem: GridSampleProblem) -> Callable[..., None]:
    return FAMILY.plan((problem,), lambda: problem, lambda: ())


class _GridSampleFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, grid, border, align):
        N, C, H, W = x.shape
        Ho, Wo = grid.shape[1], grid.shape[2]
        dt = str(x.dtype).removeprefix("torch.")
        y = torch.empty((N, C, Ho, Wo), dtype=x.dtype, device=x.device)
        if y.numel():
            problem = GridSampleProblem(False, False, N, C, H, W, Ho, Wo, dt, align, border)
            _plan(problem)(x, grid, y, y, y, y)
        ctx.save_for_backward(x, grid)
        ctx.params = (border, align)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, grid = ctx.saved_tensors
        border, align = ctx.params
        N, C, H, W = x.shape
        Ho, Wo = grid.shape[1], grid.shape[2]
        if dy.shape[2] != 1 and dy.shape[3] != 1 and dy.stride(2) != dy.stride(3) * Wo:
            dy = dy.contiguous()
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        dx = torch.zeros((N, C, H, W), dtype=acc, device=x.device)
        dg = torch.empty(grid.shape, dtype=grid.dtype, device=grid.device)
        if dy.numel():
            problem = GridSampleProblem(
                True,
                config.deterministic,
                N,
                C,
                H,
                W,
                Ho,
                Wo,
                str(x.dtype).removeprefix("torch."),
                align,
                border,
            )
            _plan(problem)(x, grid, dy, dy, dx, dg)  # no output in the backward: dy stands in
        else:
            dg.zero_()
        return dx.to(x.dtype), dg, None, None


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
) -> torch.Tensor:
    """``F.grid_sample`` for 4-D inputs: bilinear samples of ``input`` at ``grid``'s positions.

    Args:
        input: (N, C, H, W), fp16/bf16/fp32/fp64, any strides (channels_last included).
        grid: (N, Ho, Wo, 2) of normalized (x, y) in [-1, 1], the input's dtype, any strides.
        mode: ``"bilinear"`` (``"nearest"``/``"bicubic"`` raise NotImplementedError).
        padding_mode: ``"zeros"`` or ``"border"`` (``"reflection"`` raises NotImplementedError).
        align_corners: as in ``F.grid_sample`` (None means False).

    Returns (N, C, Ho, Wo), contiguous, accumulated in fp32 (fp64). Differentiable with respect to
    both ``input`` and ``grid``; see the module notes on determinism of the input gradient.
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
    return _GridSampleFunction.apply(input, grid, padding_mode == "border", bool(align_corners))


__all__ = ["FAMILY", "affine_grid", "affine_grid_reference", "grid_sample", "grid_sample_reference"]
