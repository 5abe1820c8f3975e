"""The spatial transformer's Triton kernels: affine grid (forward and backward), bilinear grid
sampling (forward, backward with atomic or serial input gradient) and the NCHW <-> NHWC copy of
the staged engine. Their callers, engines and autograd are in ``__init__``."""

from __future__ import annotations

import triton
import triton.language as tl

from ...core.numerics import convert


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
    ds_n,
    ds_c,
    ds_h,
    ds_w,
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
    Programs run in position order, so those in flight read the same few images (L2-resident).

    Forward: y (strides ys_n, ys_c, ys_p over (n, c, ho * Wo + wo)) = the samples.
    Backward: dy (same strides as y) given; writes dg (contiguous like the grid) = sum over channels,
    and when ATOMIC_DX adds the input gradient into dx (fp32, fp64 for fp64; strides ds_*) with
    relaxed atomics (only atomicity is needed; the kernel's end orders them).

    With channels innermost in x and dx (xs_c = ds_c = 1) each corner of a position is one
    contiguous run of BLOCK_C channels: vector loads and vector atomics instead of one scattered
    sector per channel, which is why the staged engine copies NCHW inputs to NHWC first.
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
    x0l, x1l, y0l, y1l = x0.to(tl.int64), x1.to(tl.int64), y0.to(tl.int64), y1.to(tl.int64)
    o00 = (y0l * xs_h + x0l * xs_w)[:, None]
    o01 = (y0l * xs_h + x1l * xs_w)[:, None]
    o10 = (y1l * xs_h + x0l * xs_w)[:, None]
    o11 = (y1l * xs_h + x1l * xs_w)[:, None]
    yoff = (n * ys_n + q * ys_p)[:, None]
    gix = tl.zeros([BLOCK_P], ACC)
    giy = tl.zeros([BLOCK_P], ACC)
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
            # Summed per chunk: full-tile accumulators would hold two more tiles of registers.
            gix += tl.sum(d * ((v01 - v00) * (1.0 - ty)[:, None] + (v11 - v10) * ty[:, None]), 1)
            giy += tl.sum(d * ((v10 - v00) * (1.0 - tx)[:, None] + (v11 - v01) * tx[:, None]), 1)
            if ATOMIC_DX:
                dxc = dx_ptr + (n * ds_n)[:, None] + c * ds_c
                acc_ty = dx_ptr.dtype.element_ty
                tl.atomic_add(
                    dxc + (y0l * ds_h + x0l * ds_w)[:, None], (d * w00).to(acc_ty), m00 & cm, sem="relaxed"
                )
                tl.atomic_add(
                    dxc + (y0l * ds_h + x1l * ds_w)[:, None], (d * w01).to(acc_ty), m01 & cm, sem="relaxed"
                )
                tl.atomic_add(
                    dxc + (y1l * ds_h + x0l * ds_w)[:, None], (d * w10).to(acc_ty), m10 & cm, sem="relaxed"
                )
                tl.atomic_add(
                    dxc + (y1l * ds_h + x1l * ds_w)[:, None], (d * w11).to(acc_ty), m11 & cm, sem="relaxed"
                )
        else:
            out = v00 * w00 + v01 * w01 + v10 * w10 + v11 * w11
            tl.store(y_ptr + yoff + c * ys_c, convert(out, y_ptr.dtype.element_ty), mask=omask)
    if BACKWARD:
        dgx = gix * mx
        dgy = giy * my
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
    ds_n,
    ds_c,
    ds_h,
    ds_w,
    ALIGN: tl.constexpr,
    BORDER: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Deterministic input gradient: program (n, channel block) walks the output positions of
    image n in order, adding each one's four weighted gradients into dx (fp32 or fp64, strides
    ds_*) with plain loads and stores. A channel always maps to the same thread, so each
    read-modify-write sees the previous one."""
    n = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < C
    dxn = dx_ptr + n * ds_n + c.to(tl.int64) * ds_c
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
            ptr = dxn + (yi.to(tl.int64) * ds_h + xi.to(tl.int64) * ds_w)
            m = cm & ok
            cur = tl.load(ptr, mask=m, other=0.0)
            tl.store(ptr, cur + (d * (wx * wy)).to(cur.dtype), mask=m)
