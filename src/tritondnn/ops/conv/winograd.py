"""Winograd convolutions for 3x3, stride-1, undilated 2-D convolutions: F(2x2, 3x3) forward
(``winograd``, any dtype) and F(4x4, 3x3) forward, data and weight gradient (``winograd_4x4``,
fp32 and fp64).

F(2x2, 3x3): each 2x2 block of outputs is computed from a 4x4 input patch with 16 multiplies per
channel pair instead of 36 (2.25x fewer), in three steps:

1. the filter transform ``U = G g G^T`` (PyTorch, on the small weight tensor), [16, groups,
   Cin_g, Cout_g];
2. the input transform ``V = B^T d B`` of every 4x4 patch (``_input_kernel``), [16, groups,
   tiles, Cin_g];
3. 16 * groups batched GEMMs ``M = V @ U`` (``tdnn.matmul``, fp32 output), then the output
   transform ``Y = A^T M A`` with the fused epilogue (``_output_kernel``).

Numerics: the transforms add and subtract up to 9 terms with coefficients of magnitude up to 1
(B, A) and 1/2 (G), so the result's rounding error grows by a small constant factor over direct
convolution: in fp32 we measure about 4x the direct error, bounded in tests by 20x PyTorch's own
fp32 error plus 2e-5 relative (ARCHITECTURE's 2x rule scaled by this documented factor). The
patches V are kept in fp32 for fp32 inputs (and in the input dtype for fp16/bf16, whose tensor
cores need it; the bound there is 4x PyTorch's error plus atol).

F(4x4, 3x3): each 4x4 block of outputs from a 6x6 patch, 36 multiplies per channel pair instead
of 144 (4x fewer); the same three steps with the filter transform a kernel too
(``_filter4_kernel``), the products a batched GEMM of this module (``_products_kernel``: FMA
units, or three TF32 products), and every intermediate laid out tiles innermost for NCHW. Its
transforms sum up to 36 terms with coefficients up to 8 (A^T), 5 (B^T) and 1/24 (G): in fp32 the
error measured 5-14x PyTorch's own (8-32 channels, CPU) and about 1.5e-5 of the output's largest
value on ResNet-50's layers (H100), bounded in tests by 30x PyTorch's error plus 1e-5 relative;
16-bit inputs are left to the tensor-core engines. H100, fp32 NCHW, N=64 (TF32 off), ResNet-50's
3x3 layers 64 @56, 128 @28, 256 @14, 512 @7: 261, 184, 185, 173 us against cuDNN's 359, 209, 228,
484 and the implicit GEMM's 270, 243, 309, 321 (tf32x3 on the tensor cores).

The data gradient (stride 1, groups 1) is that forward over dy with the flipped, transposed
weights, read in place through negative strides; the weight gradient transforms dy's 4x4 tiles
by A (dM = A dy A^T), multiplies them with x's patches over the tiles (36 products DY' V^T,
split along the tiles, the partials added in split order) and returns G^T dU G. Their products'
operands both run along the tiles, as the tensor cores' TF32 products want them, so three TF32
products there ran 2.4x the FMA units' speed. H100, same layers, data + weight gradient: 576,
355, 346, 327 us against cuDNN's 860, 433, 693, 724.

Winograd pays most in fp32 without TF32, where the GEMMs run on the CUDA cores and fewer
multiplies are less time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from ...core.backend import INTERPRET, sm_count
from ...core.engine import Engine, LaunchConfig
from ...core.launcher import cdiv, launcher
from ...core.numerics import convert
from ..epilogue import apply_epilogue
from ..matmul.kernels import dot, grouped
from .engines import (
    DGRAD_FAMILY,
    FAMILY,
    WGRAD_FAMILY,
    epilogue_constexprs,
    itemsize,
    peak,
    roofline,
    row_limit,
)
from .problem import ConvProblem

_G = [[1.0, 0.0, 0.0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0.0, 0.0, 1.0]]


@triton.jit
def _bt(d0, d1, d2, d3):
    """B^T applied to four values along one axis."""
    return d0 - d2, d1 + d2, d2 - d1, d1 - d3


@triton.jit
def _load_row(rows, h, w0, s_h, s_w, H, W, ok):
    """The four patch values of input row h, columns w0..w0+3, zero outside the image; ``rows``
    [BLOCK_P, BLOCK_C] pointers of each (tile, channel), ``ok`` its mask."""
    base = rows + (h * s_h)[:, None]
    okh = (h >= 0) & (h < H)
    d0 = tl.load(base + (w0 * s_w)[:, None], mask=ok & (okh & (w0 >= 0) & (w0 < W))[:, None], other=0.0)
    w1 = w0 + 1
    d1 = tl.load(base + (w1 * s_w)[:, None], mask=ok & (okh & (w1 >= 0) & (w1 < W))[:, None], other=0.0)
    w2 = w0 + 2
    d2 = tl.load(base + (w2 * s_w)[:, None], mask=ok & (okh & (w2 >= 0) & (w2 < W))[:, None], other=0.0)
    w3 = w0 + 3
    d3 = tl.load(base + (w3 * s_w)[:, None], mask=ok & (okh & (w3 >= 0) & (w3 < W))[:, None], other=0.0)
    return d0, d1, d2, d3


@triton.jit
def _input_kernel(
    x_ptr, v_ptr,
    P, C, CG, TH, TW, H, W, s_n, s_c, s_h, s_w, pad_h, pad_w, groups,
    ACC: tl.constexpr, INDEX_64: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """V[xi, g, p, cg] = (B^T d B)[xi] for tile p (n, th, tw) and channel c = g * CG + cg, d the 4x4
    patch at rows 2 * th - pad_h.., columns 2 * tw - pad_w... ``v`` is contiguous [16, groups, P, CG].
    Grid: (cdiv(P, BLOCK_P), cdiv(C, BLOCK_C))."""
    p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    if INDEX_64:
        p = p.to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    p_ok = p < P
    c_ok = c < C
    tw = p % TW
    th = (p // TW) % TH
    n = p // (TW * TH)
    h0 = th * 2 - pad_h
    w0 = tw * 2 - pad_w
    rows = x_ptr + (n * s_n)[:, None] + (c * s_c)[None, :]
    ok = p_ok[:, None] & c_ok[None, :]
    a0, a1, a2, a3 = _load_row(rows, h0, w0, s_h, s_w, H, W, ok)
    b0, b1, b2, b3 = _load_row(rows, h0 + 1, w0, s_h, s_w, H, W, ok)
    e0, e1, e2, e3 = _load_row(rows, h0 + 2, w0, s_h, s_w, H, W, ok)
    f0, f1, f2, f3 = _load_row(rows, h0 + 3, w0, s_h, s_w, H, W, ok)
    a0, a1, a2, a3 = _bt(convert(a0, ACC), convert(a1, ACC), convert(a2, ACC), convert(a3, ACC))
    b0, b1, b2, b3 = _bt(convert(b0, ACC), convert(b1, ACC), convert(b2, ACC), convert(b3, ACC))
    e0, e1, e2, e3 = _bt(convert(e0, ACC), convert(e1, ACC), convert(e2, ACC), convert(e3, ACC))
    f0, f1, f2, f3 = _bt(convert(f0, ACC), convert(f1, ACC), convert(f2, ACC), convert(f3, ACC))
    g = c // CG
    cg = c % CG
    plane = groups * P * CG
    out = v_ptr + (g * P * CG + cg)[None, :] + (p * CG)[:, None]
    mask = ok
    dt = v_ptr.dtype.element_ty
    # Column j of the row transforms, then B^T down the rows: V[i * 4 + j].
    v0, v1, v2, v3 = _bt(a0, b0, e0, f0)
    tl.store(out + 0 * plane, convert(v0, dt), mask=mask)
    tl.store(out + 4 * plane, convert(v1, dt), mask=mask)
    tl.store(out + 8 * plane, convert(v2, dt), mask=mask)
    tl.store(out + 12 * plane, convert(v3, dt), mask=mask)
    v0, v1, v2, v3 = _bt(a1, b1, e1, f1)
    tl.store(out + 1 * plane, convert(v0, dt), mask=mask)
    tl.store(out + 5 * plane, convert(v1, dt), mask=mask)
    tl.store(out + 9 * plane, convert(v2, dt), mask=mask)
    tl.store(out + 13 * plane, convert(v3, dt), mask=mask)
    v0, v1, v2, v3 = _bt(a2, b2, e2, f2)
    tl.store(out + 2 * plane, convert(v0, dt), mask=mask)
    tl.store(out + 6 * plane, convert(v1, dt), mask=mask)
    tl.store(out + 10 * plane, convert(v2, dt), mask=mask)
    tl.store(out + 14 * plane, convert(v3, dt), mask=mask)
    v0, v1, v2, v3 = _bt(a3, b3, e3, f3)
    tl.store(out + 3 * plane, convert(v0, dt), mask=mask)
    tl.store(out + 7 * plane, convert(v1, dt), mask=mask)
    tl.store(out + 11 * plane, convert(v2, dt), mask=mask)
    tl.store(out + 15 * plane, convert(v3, dt), mask=mask)


@triton.jit
def _at(m0, m1, m2, m3):
    """A^T applied to four values along one axis: two outputs."""
    return m0 + m1 + m2, m1 - m2 - m3


@triton.jit
def _load4(ptr, plane, first, mask):
    return (
        tl.load(ptr + first * plane, mask=mask, other=0.0),
        tl.load(ptr + (first + 1) * plane, mask=mask, other=0.0),
        tl.load(ptr + (first + 2) * plane, mask=mask, other=0.0),
        tl.load(ptr + (first + 3) * plane, mask=mask, other=0.0),
    )


@triton.jit
def _finish(
    acc, oh, ow, n, p_ok, cols, OH, OW, COUT, o_n, o_c, o_h, o_w, row_limit,
    out_ptr, c_ptr, bias_ptr, res_ptr, pre_ptr, alpha, beta, p0, p1,
    HAS_C: tl.constexpr, BIAS: tl.constexpr, ACT: tl.constexpr, RESIDUAL: tl.constexpr,
    STORE_PRE: tl.constexpr,
):  # fmt: skip
    ok = p_ok & (oh < OH) & (ow < OW)
    rows = tl.where(ok, n * o_n + oh * o_h + ow * o_w, row_limit)
    y = apply_epilogue(
        acc,
        rows,
        cols,
        row_limit,
        COUT,
        c_ptr,
        1,
        o_c,
        bias_ptr,
        1,
        res_ptr,
        1,
        o_c,
        pre_ptr,
        1,
        o_c,
        alpha,
        beta,
        p0,
        p1,
        HAS_C,
        BIAS,
        ACT,
        RESIDUAL,
        STORE_PRE,
    )
    mask = ok[:, None] & (cols < COUT)[None, :]
    tl.store(out_ptr + rows[:, None] + cols[None, :] * o_c, convert(y, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _output_kernel(
    m_ptr, out_ptr, c_ptr, bias_ptr, res_ptr, pre_ptr,
    alpha, beta, p0, p1,
    P, COUT, COG, TH, TW, OH, OW, o_n, o_c, o_h, o_w, groups, row_limit,
    HAS_C: tl.constexpr, BIAS: tl.constexpr, ACT: tl.constexpr, RESIDUAL: tl.constexpr,
    STORE_PRE: tl.constexpr, INDEX_64: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Y = A^T M A for tile p and output channel co = g * COG + cj from ``m`` [16, groups, P, COG]
    (contiguous, fp32), through the epilogue into ``out`` (strides o_*: n, c, h, w)."""
    p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    if INDEX_64:
        p = p.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    p_ok = p < P
    mask = p_ok[:, None] & (cols < COUT)[None, :]
    tw = p % TW
    th = (p // TW) % TH
    n = p // (TW * TH)
    plane = groups * P * COG
    ptr = m_ptr + ((cols // COG) * P * COG + cols % COG)[None, :] + (p * COG)[:, None]
    # Rows i of M: the A^T transform along j gives (r_i, s_i) for output columns 0 and 1.
    r0, s0 = _at(*_load4(ptr, plane, 0, mask))
    r1, s1 = _at(*_load4(ptr, plane, 4, mask))
    r2, s2 = _at(*_load4(ptr, plane, 8, mask))
    r3, s3 = _at(*_load4(ptr, plane, 12, mask))
    y00, y10 = _at(r0, r1, r2, r3)
    y01, y11 = _at(s0, s1, s2, s3)
    oh = th * 2
    ow = tw * 2
    _finish(
        y00,
        oh,
        ow,
        n,
        p_ok,
        cols,
        OH,
        OW,
        COUT,
        o_n,
        o_c,
        o_h,
        o_w,
        row_limit,
        out_ptr,
        c_ptr,
        bias_ptr,
        res_ptr,
        pre_ptr,
        alpha,
        beta,
        p0,
        p1,
        HAS_C,
        BIAS,
        ACT,
        RESIDUAL,
        STORE_PRE,
    )
    _finish(
        y01,
        oh,
        ow + 1,
        n,
        p_ok,
        cols,
        OH,
        OW,
        COUT,
        o_n,
        o_c,
        o_h,
        o_w,
        row_limit,
        out_ptr,
        c_ptr,
        bias_ptr,
        res_ptr,
        pre_ptr,
        alpha,
        beta,
        p0,
        p1,
        HAS_C,
        BIAS,
        ACT,
        RESIDUAL,
        STORE_PRE,
    )
    _finish(
        y10,
        oh + 1,
        ow,
        n,
        p_ok,
        cols,
        OH,
        OW,
        COUT,
        o_n,
        o_c,
        o_h,
        o_w,
        row_limit,
        out_ptr,
        c_ptr,
        bias_ptr,
        res_ptr,
        pre_ptr,
        alpha,
        beta,
        p0,
        p1,
        HAS_C,
        BIAS,
        ACT,
        RESIDUAL,
        STORE_PRE,
    )
    _finish(
        y11,
        oh + 1,
        ow + 1,
        n,
        p_ok,
        cols,
        OH,
        OW,
        COUT,
        o_n,
        o_c,
        o_h,
        o_w,
        row_limit,
        out_ptr,
        c_ptr,
        bias_ptr,
        res_ptr,
        pre_ptr,
        alpha,
        beta,
        p0,
        p1,
        HAS_C,
        BIAS,
        ACT,
        RESIDUAL,
        STORE_PRE,
    )


def filter_transform(w: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """U = G g G^T for w (Cout, Cin_g, 3, 3): [16 * groups, Cin_g, Cout_g] in ``dtype``."""
    wide = torch.float64 if w.dtype == torch.float64 else torch.float32
    g = torch.tensor(_G, dtype=wide, device=w.device)
    u = torch.einsum("ik,ockl,jl->ijoc", g, w.to(wide), g)  # [4, 4, Cout, Cin_g]
    cout, cin_g = w.shape[0], w.shape[1]
    u = u.reshape(16, groups, cout // groups, cin_g).transpose(2, 3)
    return u.reshape(16 * groups, cin_g, cout // groups).to(dtype)


@FAMILY.register
class WinogradEngine(Engine[ConvProblem]):
    """F(2x2, 3x3): 3x3, stride 1, dilation 1, 2-D. 2.25x fewer multiplies, a few times direct
    convolution's rounding error (see the module docstring)."""

    name = "winograd"

    def not_supported_reasons(self, problem: ConvProblem) -> list[str]:
        p = problem
        reasons = []
        if p.nd != 2:
            reasons.append(f"needs a 2-D convolution (got {p.nd}-D)")
        if p.kernel[1:] != (3, 3):
            reasons.append(f"needs a 3x3 kernel (got {p.kernel[1]}x{p.kernel[2]})")
        if p.stride != (1, 1, 1):
            reasons.append(f"needs stride 1 (got {p.stride[1:]})")
        if p.dilation != (1, 1, 1):
            reasons.append(f"needs dilation 1 (got {p.dilation[1:]})")
        return reasons

    def cost(self, problem: ConvProblem) -> float:
        p = problem
        tiles = p.n * cdiv(p.out_size[1], 2) * cdiv(p.out_size[2], 2)
        v_bytes = 16 * tiles * p.cin * (4 if p.dtype in ("float32", "float64") else itemsize(p.dtype))
        m_bytes = 16 * tiles * p.cout * 4
        # Its batched products ran at 5-6 TFLOP/s of their own work on an H100 (fp32, 3x3 ResNet
        # layers, N=64: 11.6-12.7 TFLOP/s direct-equivalent), the implicit GEMM at 23: 12% of
        # peak, so the heuristic leaves fp32 3x3 layers to the implicit GEMM.
        return roofline(p.flops / 2.25, p.bytes + 2 * (v_bytes + m_bytes), peak(p), 0.12, 0.7) + 15.0

    def bind(self, problem: ConvProblem, config: LaunchConfig) -> Callable[..., None]:
        from ..epilogue import Epilogue
        from ..matmul import matmul

        p = problem
        th, tw = cdiv(p.out_size[1], 2), cdiv(p.out_size[2], 2)
        tiles = p.n * th * tw
        dtype = getattr(torch, p.dtype)
        v_dtype = dtype  # fp32 patches for fp32, the input dtype for fp16/bf16 (tensor cores)
        acc_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        acc = tl.float64 if dtype == torch.float64 else tl.float32
        bp, bc = (16, 16) if INTERPRET else (32, 64)
        big = p.index_64 or 16 * tiles * max(p.cin, p.cout) >= 2**31
        xs = p.x_strides
        transform = launcher(
            _input_kernel,
            (cdiv(tiles, bp), cdiv(p.cin, bc)),
            2,
            (
                tiles,
                p.cin,
                p.cin_g,
                th,
                tw,
                *p.in_size[1:],
                xs[0],
                xs[1],
                xs[3],
                xs[4],
                p.pad[1],
                p.pad[2],
                p.groups,
            ),
            (acc, big, bp, bc),
        )
        ys = p.y_strides
        finish = launcher(
            _output_kernel,
            (cdiv(tiles, bp), cdiv(p.cout, bc)),
            6,
            (
                tiles,
                p.cout,
                p.cout_g,
                th,
                tw,
                *p.out_size[1:],
                ys[0],
                ys[1],
                ys[3],
                ys[4],
                p.groups,
                row_limit(p),
            ),
            (*epilogue_constexprs(p), big, bp, bc),
        )
        epi = Epilogue(out_dtype=acc_dtype)

        def run(x, w, y, c, bias, residual, pre, alpha, beta, p0, p1) -> None:
            u = filter_transform(w, p.groups, v_dtype)
            v = torch.empty((16 * p.groups, tiles, p.cin_g), dtype=v_dtype, device=x.device)
            transform(x, v)
            m = matmul(v, u, epilogue=epi)
            finish(m, y, c, bias, residual, pre, alpha, beta, p0, p1)

        return run


# ---------------------------------------------------------------------------------------------
# F(4x4, 3x3): each 4x4 block of outputs from a 6x6 input patch, 36 multiplies per channel pair
# instead of 144 (4x fewer). Transforms (Lavin & Gray's interpolation points 0, +-1, +-2, inf):
# B^T [6x6], G [6x3], A^T [4x6] below. The patches and the products are laid out [36, groups,
# channels, tiles] (tiles innermost): NCHW's pixels run along tiles, so the transform kernels read
# and write along them, and the products are the batched GEMM M^T = U^T V with the tiles as its
# N dimension.


@triton.jit
def _bt6(d0, d1, d2, d3, d4, d5):
    """B^T of F(4x4, 3x3) applied to six values along one axis."""
    return (
        4.0 * d0 - 5.0 * d2 + d4,
        d3 + d4 - 4.0 * (d1 + d2),
        4.0 * (d1 - d2) + d4 - d3,
        2.0 * (d3 - d1) + d4 - d2,
        2.0 * (d1 - d3) + d4 - d2,
        4.0 * d1 - 5.0 * d3 + d5,
    )


@triton.jit
def _at6(m0, m1, m2, m3, m4, m5):
    """A^T of F(4x4, 3x3) applied to six values along one axis: four outputs."""
    return (
        m0 + m1 + m2 + m3 + m4,
        (m1 - m2) + 2.0 * (m3 - m4),
        (m1 + m2) + 4.0 * (m3 + m4),
        (m1 - m2) + 8.0 * (m3 - m4) + m5,
    )


@triton.jit
def _load_at(base, w, s_w, W, okh, ACC: tl.constexpr):
    return convert(
        tl.load(base + (w * s_w)[None, :], mask=okh & ((w >= 0) & (w < W))[None, :], other=0.0), ACC
    )


@triton.jit
def _row6(rows, h, w0, s_h, s_w, H, W, ok, ACC: tl.constexpr):
    """B^T along input row h of each patch (columns w0..w0+5, zero outside the image); ``rows``
    [BLOCK_C, BLOCK_P] pointers of each (channel, tile), ``ok`` its mask."""
    base = rows + (h * s_h)[None, :]
    okh = ok & ((h >= 0) & (h < H))[None, :]
    return _bt6(
        _load_at(base, w0, s_w, W, okh, ACC),
        _load_at(base, w0 + 1, s_w, W, okh, ACC),
        _load_at(base, w0 + 2, s_w, W, okh, ACC),
        _load_at(base, w0 + 3, s_w, W, okh, ACC),
        _load_at(base, w0 + 4, s_w, W, okh, ACC),
        _load_at(base, w0 + 5, s_w, W, okh, ACC),
    )


@triton.jit
def _store_col6(out, plane, j, d0, d1, d2, d3, d4, d5, mask):
    """B^T down column j of the row-transformed patch: V[i * 6 + j] for i = 0..5."""
    v0, v1, v2, v3, v4, v5 = _bt6(d0, d1, d2, d3, d4, d5)
    dt = out.dtype.element_ty
    tl.store(out + j * plane, convert(v0, dt), mask=mask)
    tl.store(out + (6 + j) * plane, convert(v1, dt), mask=mask)
    tl.store(out + (12 + j) * plane, convert(v2, dt), mask=mask)
    tl.store(out + (18 + j) * plane, convert(v3, dt), mask=mask)
    tl.store(out + (24 + j) * plane, convert(v4, dt), mask=mask)
    tl.store(out + (30 + j) * plane, convert(v5, dt), mask=mask)


@triton.jit
def _input4_kernel(
    x_ptr, v_ptr,
    P, C, TH, TW, H, W, s_n, s_c, s_h, s_w, pad_h, pad_w,
    ACC: tl.constexpr, INDEX_64: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    """V[xi, c, p] = (B^T d B)[xi] for tile p (n, th, tw) and channel c (any group: V's rows are
    group-major), d the 6x6 patch at rows 4 * th - pad_h.., columns 4 * tw - pad_w... ``v`` is
    contiguous [36, C, P]. Grid: (cdiv(P, BLOCK_P), cdiv(C, BLOCK_C))."""
    p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    if INDEX_64:
        p = p.to(tl.int64)
        c = c.to(tl.int64)
    ok = (c < C)[:, None] & (p < P)[None, :]
    tw = p % TW
    th = (p // TW) % TH
    n = p // (TW * TH)
    h0 = th * 4 - pad_h
    w0 = tw * 4 - pad_w
    rows = x_ptr + (n * s_n)[None, :] + (c * s_c)[:, None]
    a0, a1, a2, a3, a4, a5 = _row6(rows, h0, w0, s_h, s_w, H, W, ok, ACC)
    b0, b1, b2, b3, b4, b5 = _row6(rows, h0 + 1, w0, s_h, s_w, H, W, ok, ACC)
    e0, e1, e2, e3, e4, e5 = _row6(rows, h0 + 2, w0, s_h, s_w, H, W, ok, ACC)
    f0, f1, f2, f3, f4, f5 = _row6(rows, h0 + 3, w0, s_h, s_w, H, W, ok, ACC)
    g0, g1, g2, g3, g4, g5 = _row6(rows, h0 + 4, w0, s_h, s_w, H, W, ok, ACC)
    k0, k1, k2, k3, k4, k5 = _row6(rows, h0 + 5, w0, s_h, s_w, H, W, ok, ACC)
    out = v_ptr + (c * P)[:, None] + p[None, :]
    plane = C * P
    _store_col6(out, plane, 0, a0, b0, e0, f0, g0, k0, ok)
    _store_col6(out, plane, 1, a1, b1, e1, f1, g1, k1, ok)
    _store_col6(out, plane, 2, a2, b2, e2, f2, g2, k2, ok)
    _store_col6(out, plane, 3, a3, b3, e3, f3, g3, k3, ok)
    _store_col6(out, plane, 4, a4, b4, e4, f4, g4, k4, ok)
    _store_col6(out, plane, 5, a5, b5, e5, f5, g5, k5, ok)


@triton.jit
def _row_at(ptr, plane, first, mask, b):
    """Output column b of row ``first // 6`` of the products M: A^T[b] . M[i, 0..5] (six planes),
    A^T's row b being (b == 0, 1, +-1, 2^b, +-2^b, b == 3) with the sign (-1)^b."""
    sign = 1.0 - 2.0 * (b % 2).to(tl.float32)
    scale = (1 << b).to(tl.float32)
    m0 = tl.load(ptr + first * plane, mask=mask & (b == 0)[:, None], other=0.0)
    m1 = tl.load(ptr + (first + 1) * plane, mask=mask, other=0.0)
    m2 = tl.load(ptr + (first + 2) * plane, mask=mask, other=0.0)
    m3 = tl.load(ptr + (first + 3) * plane, mask=mask, other=0.0)
    m4 = tl.load(ptr + (first + 4) * plane, mask=mask, other=0.0)
    m5 = tl.load(ptr + (first + 5) * plane, mask=mask & (b == 3)[:, None], other=0.0)
    return m0 + m1 + sign[:, None] * (m2 + scale[:, None] * m4) + scale[:, None] * m3 + m5


@triton.jit
def _output4_kernel(
    m_ptr, out_ptr, c_ptr, bias_ptr, res_ptr, pre_ptr,
    alpha, beta, p0, p1,
    P, COUT, TH, TW, OH, OW, o_n, o_c, o_h, o_w, row_limit,
    HAS_C: tl.constexpr, BIAS: tl.constexpr, ACT: tl.constexpr, RESIDUAL: tl.constexpr,
    STORE_PRE: tl.constexpr, INDEX_64: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    """Y = A^T M A for tile p and output channel co from ``m`` [36, COUT, P] (contiguous, fp32,
    group-major rows), through the epilogue into ``out`` (strides o_*: n, c, h, w).

    Each row of a program's [4 * BLOCK_P, BLOCK_C] values is one output column b of one tile (the
    four of a tile side by side): its four outputs (rows 0..3 of that column) are then stored by
    neighbouring threads at neighbouring addresses along W, where one row per tile would write
    every fourth element (measured at half the copy bandwidth on an H100). The four rows of a tile
    read the same products (one transaction)."""
    BLOCK_Q: tl.constexpr = 4 * BLOCK_P
    q = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    p = q // 4
    b = q % 4
    if INDEX_64:
        p = p.to(tl.int64)
        cols = cols.to(tl.int64)
    p_ok = p < P
    mask = p_ok[:, None] & (cols < COUT)[None, :]
    tw = p % TW
    th = (p // TW) % TH
    n = p // (TW * TH)
    plane = COUT * P
    ptr = m_ptr + p[:, None] + (cols * P)[None, :]
    # A^T along each row i of M gives column b's r_i; A^T down the column gives its four outputs.
    y0, y1, y2, y3 = _at6(
        _row_at(ptr, plane, 0, mask, b),
        _row_at(ptr, plane, 6, mask, b),
        _row_at(ptr, plane, 12, mask, b),
        _row_at(ptr, plane, 18, mask, b),
        _row_at(ptr, plane, 24, mask, b),
        _row_at(ptr, plane, 30, mask, b),
    )
    oh = th * 4
    ow = tw * 4 + b
    _finish(
        y0, oh, ow, n, p_ok, cols, OH, OW, COUT, o_n, o_c, o_h, o_w, row_limit,
        out_ptr, c_ptr, bias_ptr, res_ptr, pre_ptr, alpha, beta, p0, p1,
        HAS_C, BIAS, ACT, RESIDUAL, STORE_PRE,
    )  # fmt: skip
    _finish(
        y1, oh + 1, ow, n, p_ok, cols, OH, OW, COUT, o_n, o_c, o_h, o_w, row_limit,
        out_ptr, c_ptr, bias_ptr, res_ptr, pre_ptr, alpha, beta, p0, p1,
        HAS_C, BIAS, ACT, RESIDUAL, STORE_PRE,
    )  # fmt: skip
    _finish(
        y2, oh + 2, ow, n, p_ok, cols, OH, OW, COUT, o_n, o_c, o_h, o_w, row_limit,
        out_ptr, c_ptr, bias_ptr, res_ptr, pre_ptr, alpha, beta, p0, p1,
        HAS_C, BIAS, ACT, RESIDUAL, STORE_PRE,
    )  # fmt: skip
    _finish(
        y3, oh + 3, ow, n, p_ok, cols, OH, OW, COUT, o_n, o_c, o_h, o_w, row_limit,
        out_ptr, c_ptr, bias_ptr, res_ptr, pre_ptr, alpha, beta, p0, p1,
        HAS_C, BIAS, ACT, RESIDUAL, STORE_PRE,
    )  # fmt: skip


@triton.jit
def _g6(a, b, c):
    """G of F(4x4, 3x3) applied to three values along one axis: six."""
    return (
        a * 0.25,
        (a + b + c) * (-1.0 / 6.0),
        (a - b + c) * (-1.0 / 6.0),
        a * (1.0 / 24.0) + b * (1.0 / 12.0) + c * (1.0 / 6.0),
        a * (1.0 / 24.0) - b * (1.0 / 12.0) + c * (1.0 / 6.0),
        c,
    )


@triton.jit
def _store_row6(out, plane, i, t0, t1, t2, mask):
    """G along row i of G g: U[i * 6 + j] for j = 0..5."""
    u0, u1, u2, u3, u4, u5 = _g6(t0, t1, t2)
    dt = out.dtype.element_ty
    tl.store(out + (6 * i) * plane, convert(u0, dt), mask=mask)
    tl.store(out + (6 * i + 1) * plane, convert(u1, dt), mask=mask)
    tl.store(out + (6 * i + 2) * plane, convert(u2, dt), mask=mask)
    tl.store(out + (6 * i + 3) * plane, convert(u3, dt), mask=mask)
    tl.store(out + (6 * i + 4) * plane, convert(u4, dt), mask=mask)
    tl.store(out + (6 * i + 5) * plane, convert(u5, dt), mask=mask)


@triton.jit
def _filter4_kernel(
    w_ptr, u_ptr, COUT, CG, w_off, s_o, s_c, s_h, s_w, ACC: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    """U[xi, o, c] = (G g G^T)[xi] for the 3x3 filter g = w[o, c] at ``w_off + o * s_o + c * s_c``
    (strides may be negative: the data gradient's flipped, transposed view); ``u`` contiguous
    [36, COUT, CG]."""
    q = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = q < COUT * CG
    o = q // CG
    c = q % CG
    base = w_ptr + w_off + o * s_o + c * s_c
    g00 = convert(tl.load(base, mask=ok, other=0.0), ACC)
    g01 = convert(tl.load(base + s_w, mask=ok, other=0.0), ACC)
    g02 = convert(tl.load(base + 2 * s_w, mask=ok, other=0.0), ACC)
    g10 = convert(tl.load(base + s_h, mask=ok, other=0.0), ACC)
    g11 = convert(tl.load(base + s_h + s_w, mask=ok, other=0.0), ACC)
    g12 = convert(tl.load(base + s_h + 2 * s_w, mask=ok, other=0.0), ACC)
    g20 = convert(tl.load(base + 2 * s_h, mask=ok, other=0.0), ACC)
    g21 = convert(tl.load(base + 2 * s_h + s_w, mask=ok, other=0.0), ACC)
    g22 = convert(tl.load(base + 2 * s_h + 2 * s_w, mask=ok, other=0.0), ACC)
    # G down each column of g, then G along each row of the result.
    a0, a1, a2, a3, a4, a5 = _g6(g00, g10, g20)
    b0, b1, b2, b3, b4, b5 = _g6(g01, g11, g21)
    e0, e1, e2, e3, e4, e5 = _g6(g02, g12, g22)
    out = u_ptr + q
    plane = COUT * CG
    _store_row6(out, plane, 0, a0, b0, e0, ok)
    _store_row6(out, plane, 1, a1, b1, e1, ok)
    _store_row6(out, plane, 2, a2, b2, e2, ok)
    _store_row6(out, plane, 3, a3, b3, e3, ok)
    _store_row6(out, plane, 4, a4, b4, e4, ok)
    _store_row6(out, plane, 5, a5, b5, e5, ok)


@triton.jit
def _products_kernel(
    a_ptr, b_ptr, c_ptr, M, N, K, s_ab, s_am, s_ak, s_bb, s_bk, s_bn, k_chunk,
    ACC: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """C[s, b] = A[b] @ B[b] over K range [s * k_chunk, (s + 1) * k_chunk) for each transform
    point b (A [M, K], B [K, N] at the given strides; C contiguous [splits, batches, M, N]).
    Forward and data gradient: U^T @ V, one split; weight gradient: DY' @ V^T over the tiles, split.
    Grid: (tiles of one product, batches, splits)."""
    b = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    pid_m, pid_n = grouped(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = split * k_chunk
    k_end = tl.minimum(K, k0 + k_chunk)
    rk = k0 + tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + b * s_ab + rm[:, None] * s_am + rk[None, :].to(tl.int64) * s_ak
    b_ptrs = b_ptr + b * s_bb + rk[:, None].to(tl.int64) * s_bk + rn[None, :] * s_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), ACC)
    for k in range(k0, k_end, BLOCK_K):
        k_ok = k - k0 + rk < k_end
        a = tl.load(a_ptrs, mask=(rm < M)[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(b_ptrs, mask=k_ok[:, None] & (rn < N)[None, :], other=0.0)
        acc = dot(a, x, acc, PRECISION, False)
        a_ptrs += BLOCK_K * s_ak
        b_ptrs += BLOCK_K * s_bk
    out = c_ptr + (split * tl.num_programs(1) + b) * M * N + rm[:, None] * N + rn[None, :]
    tl.store(out, acc, mask=(rm < M)[:, None] & (rn < N)[None, :])


def _products(bm: int, bn: int, bk: int, precision: str, warps: int) -> LaunchConfig:
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "PRECISION": precision, "PRODUCT_WARPS": warps}


@FAMILY.register
class Winograd4Engine(Engine[ConvProblem]):
    """F(4x4, 3x3): 3x3, stride 1, dilation 1, 2-D, fp32 (and fp64). 4x fewer multiplies than
    direct convolution; the transforms' larger coefficients (up to 8 and 5, and 1/24 in G) cost more
    rounding error than F(2x2, 3x3) (see the module docstring), which 16-bit inputs cannot
    afford: they have the tensor-core engines."""

    name = "winograd_4x4"

    def not_supported_reasons(self, problem: ConvProblem) -> list[str]:
        reasons = WinogradEngine().not_supported_reasons(problem)
        if problem.dtype not in ("float32", "float64"):
            reasons.append(f"needs fp32 or fp64: its transforms lose 16-bit precision (got {problem.dtype})")
        return reasons

    def cost(self, problem: ConvProblem) -> float:
        p = problem
        tiles = p.n * cdiv(p.out_size[1], 4) * cdiv(p.out_size[2], 4)
        size = itemsize(p.dtype)
        patches = 36 * tiles * (p.cin + p.cout) * size  # V and M, each written once and read once
        products = 2 * 36 * tiles * p.cin_g * p.cout
        # H100, fp32 NCHW N=64, ResNet-50's 3x3 layers: the products at 33-38 TFLOP/s of their own
        # work (FMA units), the transforms moving x, V, M and y at about 2.2 TB/s; this model's
        # 268, 189, 193, 170 us against 261, 184, 185, 173 measured (64 @56 .. 512 @7).
        # Channels-last x and y are read and written across the tiles' channel stride: 3x3 128 @28
        # 277 us, 256 @14 211 (NCHW 184, 185).
        rate = 35.0 if p.dtype == "float32" and not p.tf32 else peak(p) * 0.3
        work = max(roofline(products, 0, rate, 1.0, 1.0), roofline(0, patches, 1.0, 1.0, 0.8))
        moved = p.in_pixels * p.cin * size + p.out_pixels * p.cout * size + patches
        moves = roofline(0, moved, 1.0, 1.0, 0.36 if p.channels_last else 0.73)
        return work + moves + 10.0

    def configs(self, problem: ConvProblem) -> list[LaunchConfig]:
        """Blocks of the transform kernels (BLOCK_C channels x BLOCK_P tiles, tiles innermost) and
        of the products (BLOCK_M x BLOCK_N x BLOCK_K, PRECISION for fp32 without TF32). H100, fp32
        NCHW N=64, 3x3 128 @28 / 256 @14: input transform 36 / 24 us (2.3 / 2.1 TB/s) with one or
        two channels of 64-128 tiles; products in 64 x 64 x 32 "ieee" tiles 103 / 129 us (tdnn.matmul
        123 / 148, cuBLAS 109 / 129), 128 x 64 "tf32x3" 100 / 120."""
        if INTERPRET:
            return [{"BLOCK_C": 4, "BLOCK_P": 16, "num_warps": 4} | _products(16, 16, 16, "ieee", 4)]
        transforms = {"BLOCK_C": 2, "BLOCK_P": 64, "num_warps": 4}
        return [
            transforms | _products(64, 64, 32, "ieee", 4),
            transforms | _products(128, 64, 32, "tf32x3", 4),
            {"BLOCK_C": 1, "BLOCK_P": 128, "num_warps": 4} | _products(64, 64, 32, "ieee", 4),
            transforms | _products(64, 128, 32, "ieee", 4),
        ]

    def bind(self, problem: ConvProblem, config: LaunchConfig) -> Callable[..., None]:
        return _bind4(problem, config, 0)


def _patches(p: ConvProblem, config: LaunchConfig) -> tuple[int, Callable[..., None]]:
    """(tiles, launch(x, v)): 4x4 output tiles over p's output grid and the input transform of
    x's 6x6 patches into V [36, Cin, tiles] (the forward's and the weight gradient's)."""
    th, tw = cdiv(p.out_size[1], 4), cdiv(p.out_size[2], 4)
    tiles = p.n * th * tw
    bc, bp = config["BLOCK_C"], config["BLOCK_P"]
    xs = p.x_strides
    ints = (tiles, p.cin, th, tw, *p.in_size[1:], xs[0], xs[1], xs[3], xs[4], p.pad[1], p.pad[2])
    constexprs = (_acc(p), _index_64(p, tiles), bc, bp)
    grid = (cdiv(tiles, bp), cdiv(p.cin, bc))
    return tiles, launcher(_input4_kernel, grid, 2, ints, constexprs, num_warps=config["num_warps"])


def _acc(p: ConvProblem) -> Any:
    return tl.float64 if p.dtype == "float64" else tl.float32


def _index_64(p: ConvProblem, tiles: int) -> bool:
    """Whether the transforms' [36, channels, tiles] buffers need 64-bit offsets."""
    return p.index_64 or 36 * tiles * max(p.cin, p.cout) >= 2**31


def _bind4(p: ConvProblem, config: LaunchConfig, w_off: int) -> Callable[..., None]:
    """The F(4x4, 3x3) forward of ``p``, its weights read at ``w_off`` elements past the pointer
    through p's (possibly negative) weight strides."""
    tiles, transform = _patches(p, config)
    th, tw = cdiv(p.out_size[1], 4), cdiv(p.out_size[2], 4)
    dtype = getattr(torch, p.dtype)
    acc, big = _acc(p), _index_64(p, tiles)
    bc, bp, warps = config["BLOCK_C"], config["BLOCK_P"], config["num_warps"]
    ys, ws = p.y_strides, p.w_strides
    filters = launcher(
        _filter4_kernel,
        (cdiv(p.cout * p.cin_g, 256),),
        2,
        (p.cout, p.cin_g, w_off, ws[0], ws[1], ws[3], ws[4]),
        (acc, 256),
    )
    ints = (tiles, p.cout, th, tw, *p.out_size[1:], ys[0], ys[1], ys[3], ys[4], row_limit(p))
    finish = launcher(
        _output4_kernel,
        (cdiv(tiles, bp), cdiv(p.cout, bc)),
        6,
        ints,
        (*epilogue_constexprs(p), big, bc, bp),
        num_warps=warps,
    )
    bm, bn = config["BLOCK_M"], config["BLOCK_N"]
    precision = "tf32" if p.tf32 else "ieee" if dtype == torch.float64 else config["PRECISION"]
    cog, cg = p.cout_g, p.cin_g
    products = launcher(
        _products_kernel,
        (cdiv(cog, bm) * cdiv(tiles, bn), 36 * p.groups),
        3,
        (cog, tiles, cg, cog * cg, cg, 1, cg * tiles, tiles, 1, cg),
        (acc, precision, bm, bn, config["BLOCK_K"], 8),
        num_warps=config["PRODUCT_WARPS"],
        num_stages=1 if INTERPRET else 3,
    )

    def run(x, w, y, c, bias, residual, pre, alpha, beta, p0, p1) -> None:
        u = torch.empty((36 * p.groups, p.cout_g, p.cin_g), dtype=dtype, device=x.device)
        filters(w, u)
        v = torch.empty((36 * p.groups, p.cin_g, tiles), dtype=dtype, device=x.device)
        transform(x, v)
        m = torch.empty((36 * p.groups, p.cout_g, tiles), dtype=dtype, device=x.device)
        products(u, v, m)
        finish(m, y, c, bias, residual, pre, alpha, beta, p0, p1)

    return run


def _forward_of_dgrad(p: ConvProblem) -> ConvProblem:
    """The data gradient of a stride-1 3x3 convolution (groups 1) as the forward convolution of dy
    with the flipped, transposed weights, padded 2 - pad: its weight strides (Cin, Cout, -kh, -kw)
    read them in place from w[0, 0, 2, 2]."""
    so, sc, sd, sh, sw = p.w_strides
    return dataclasses.replace(
        p,
        direction="fwd",
        cin=p.cout,
        cout=p.cin,
        in_size=p.out_size,
        out_size=p.in_size,
        x_strides=p.y_strides,
        y_strides=p.x_strides,
        pad=(p.pad[0], 2 - p.pad[1], 2 - p.pad[2]),
        w_strides=(sc, so, sd, -sh, -sw),
    )


@DGRAD_FAMILY.register
class Winograd4DgradEngine(Engine[ConvProblem]):
    """Data gradient of a 3x3 stride-1 fp32 convolution by F(4x4, 3x3): the forward engine over dy
    and the flipped, transposed weights (read in place), so with its numerics."""

    name = "winograd_4x4"

    def not_supported_reasons(self, problem: ConvProblem) -> list[str]:
        reasons = Winograd4Engine().not_supported_reasons(_forward_of_dgrad(problem))
        if problem.groups != 1:
            reasons.append(f"needs groups == 1: grouped weights transpose by groups (got {problem.groups})")
        return reasons

    def cost(self, problem: ConvProblem) -> float:
        return Winograd4Engine().cost(_forward_of_dgrad(problem))

    def configs(self, problem: ConvProblem) -> list[LaunchConfig]:
        return Winograd4Engine().configs(_forward_of_dgrad(problem))

    def bind(self, problem: ConvProblem, config: LaunchConfig) -> Callable[..., None]:
        _, _, _, sh, sw = problem.w_strides
        return _bind4(_forward_of_dgrad(problem), config, 2 * sh + 2 * sw)


# ---------------------------------------------------------------------------------------------
# The weight gradient by F(4x4, 3x3): the forward y = A^T [(G g G^T) . V] A is linear in g, so
# per 4x4 tile of dy, dM = A dy A^T (6x6), dU = sum over tiles of dM . V, and dg = G^T dU G: the
# input transform V of x (as forward), a transform of dy, 36 products DY' @ V^T over the tiles
# (split, partial sums added in the last transform), and the inverse filter transform.


@triton.jit
def _a6(y0, y1, y2, y3):
    """A (the transpose of A^T) applied to four values along one axis: six."""
    return (
        y0,
        y0 + y1 + y2 + y3,
        y0 - y1 + y2 - y3,
        y0 + 2.0 * y1 + 4.0 * y2 + 8.0 * y3,
        y0 - 2.0 * y1 + 4.0 * y2 - 8.0 * y3,
        y3,
    )


@triton.jit
def _dy_row(rows, h, w0, s_h, s_w, H, W, ok, ACC: tl.constexpr):
    """A along row h of each 4x4 dy tile (columns w0..w0+3, zero past the output's edge)."""
    base = rows + (h * s_h)[None, :]
    okh = ok & (h < H)[None, :]
    return _a6(
        _load_at(base, w0, s_w, W, okh, ACC),
        _load_at(base, w0 + 1, s_w, W, okh, ACC),
        _load_at(base, w0 + 2, s_w, W, okh, ACC),
        _load_at(base, w0 + 3, s_w, W, okh, ACC),
    )


@triton.jit
def _store_a_col(out, plane, j, d0, d1, d2, d3, mask):
    """A down column j of the row-transformed tile: DY'[i * 6 + j] for i = 0..5."""
    v0, v1, v2, v3, v4, v5 = _a6(d0, d1, d2, d3)
    dt = out.dtype.element_ty
    tl.store(out + j * plane, convert(v0, dt), mask=mask)
    tl.store(out + (6 + j) * plane, convert(v1, dt), mask=mask)
    tl.store(out + (12 + j) * plane, convert(v2, dt), mask=mask)
    tl.store(out + (18 + j) * plane, convert(v3, dt), mask=mask)
    tl.store(out + (24 + j) * plane, convert(v4, dt), mask=mask)
    tl.store(out + (30 + j) * plane, convert(v5, dt), mask=mask)


@triton.jit
def _dy4_kernel(
    dy_ptr, d_ptr,
    P, C, TH, TW, H, W, s_n, s_c, s_h, s_w,
    ACC: tl.constexpr, INDEX_64: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    """DY'[xi, c, p] = (A dy A^T)[xi] for the 4x4 tile p (n, th, tw) of dy's channel c; ``d`` is
    contiguous [36, C, P]. Grid: (cdiv(P, BLOCK_P), cdiv(C, BLOCK_C))."""
    p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    if INDEX_64:
        p = p.to(tl.int64)
        c = c.to(tl.int64)
    ok = (c < C)[:, None] & (p < P)[None, :]
    tw = p % TW
    th = (p // TW) % TH
    n = p // (TW * TH)
    h0 = th * 4
    w0 = tw * 4
    rows = dy_ptr + (n * s_n)[None, :] + (c * s_c)[:, None]
    a0, a1, a2, a3, a4, a5 = _dy_row(rows, h0, w0, s_h, s_w, H, W, ok, ACC)
    b0, b1, b2, b3, b4, b5 = _dy_row(rows, h0 + 1, w0, s_h, s_w, H, W, ok, ACC)
    e0, e1, e2, e3, e4, e5 = _dy_row(rows, h0 + 2, w0, s_h, s_w, H, W, ok, ACC)
    f0, f1, f2, f3, f4, f5 = _dy_row(rows, h0 + 3, w0, s_h, s_w, H, W, ok, ACC)
    out = d_ptr + (c * P)[:, None] + p[None, :]
    plane = C * P
    _store_a_col(out, plane, 0, a0, b0, e0, f0, ok)
    _store_a_col(out, plane, 1, a1, b1, e1, f1, ok)
    _store_a_col(out, plane, 2, a2, b2, e2, f2, ok)
    _store_a_col(out, plane, 3, a3, b3, e3, f3, ok)
    _store_a_col(out, plane, 4, a4, b4, e4, f4, ok)
    _store_a_col(out, plane, 5, a5, b5, e5, f5, ok)


@triton.jit
def _gt6(m0, m1, m2, m3, m4, m5):
    """G^T of F(4x4, 3x3) applied to six values along one axis: three."""
    return (
        m0 * 0.25 - (m1 + m2) * (1.0 / 6.0) + (m3 + m4) * (1.0 / 24.0),
        (m2 - m1) * (1.0 / 6.0) + (m3 - m4) * (1.0 / 12.0),
        (m3 + m4 - m1 - m2) * (1.0 / 6.0) + m5,
    )


@triton.jit
def _du(du_ptr, q, xi, plane, SPLITS, ok):
    """dU[xi] at q: the sum of the products' split partials, in split order."""
    total = tl.load(du_ptr + xi * plane + q, mask=ok, other=0.0)
    for s in range(1, SPLITS):
        total += tl.load(du_ptr + (s * 36 + xi) * plane + q, mask=ok, other=0.0)
    return total


@triton.jit
def _du_row(du_ptr, q, i, plane, SPLITS, ok):
    """G^T . dU[i, 0..5] (its three columns kw)."""
    return _gt6(
        _du(du_ptr, q, 6 * i, plane, SPLITS, ok),
        _du(du_ptr, q, 6 * i + 1, plane, SPLITS, ok),
        _du(du_ptr, q, 6 * i + 2, plane, SPLITS, ok),
        _du(du_ptr, q, 6 * i + 3, plane, SPLITS, ok),
        _du(du_ptr, q, 6 * i + 4, plane, SPLITS, ok),
        _du(du_ptr, q, 6 * i + 5, plane, SPLITS, ok),
    )


@triton.jit
def _store_dw_col(dw, kw, s_h, s_w, r0, r1, r2, r3, r4, r5, ok):
    """G^T down column kw: dw[.., kh, kw] for kh = 0..2."""
    g0, g1, g2 = _gt6(r0, r1, r2, r3, r4, r5)
    dt = dw.dtype.element_ty
    tl.store(dw + kw * s_w, convert(g0, dt), mask=ok)
    tl.store(dw + s_h + kw * s_w, convert(g1, dt), mask=ok)
    tl.store(dw + 2 * s_h + kw * s_w, convert(g2, dt), mask=ok)


@triton.jit
def _filter4_grad_kernel(
    du_ptr, dw_ptr, COUT, CIN, SPLITS, s_o, s_c, s_h, s_w, BLOCK: tl.constexpr
):  # fmt: skip
    """dw[o, c] = G^T dU G with dU[xi, o, c] the sum over splits of ``du`` [SPLITS, 36, COUT,
    CIN] (contiguous); dw at strides s_*."""
    q = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = q < COUT * CIN
    plane = COUT * CIN
    a0, a1, a2 = _du_row(du_ptr, q, 0, plane, SPLITS, ok)
    b0, b1, b2 = _du_row(du_ptr, q, 1, plane, SPLITS, ok)
    e0, e1, e2 = _du_row(du_ptr, q, 2, plane, SPLITS, ok)
    f0, f1, f2 = _du_row(du_ptr, q, 3, plane, SPLITS, ok)
    g0, g1, g2 = _du_row(du_ptr, q, 4, plane, SPLITS, ok)
    k0, k1, k2 = _du_row(du_ptr, q, 5, plane, SPLITS, ok)
    dw = dw_ptr + (q // CIN) * s_o + (q % CIN) * s_c
    _store_dw_col(dw, 0, s_h, s_w, a0, b0, e0, f0, g0, k0, ok)
    _store_dw_col(dw, 1, s_h, s_w, a1, b1, e1, f1, g1, k1, ok)
    _store_dw_col(dw, 2, s_h, s_w, a2, b2, e2, f2, g2, k2, ok)


def _wgrad_splits(p: ConvProblem, tiles: int, config: LaunchConfig) -> int:
    """Splits of the products' tiles (their K): about three waves of programs, K runs of 512 or more."""
    programs = 36 * cdiv(p.cout, config["BLOCK_M"]) * cdiv(p.cin, config["BLOCK_N"])
    return max(1, min(round(3 * sm_count() / programs), tiles // 512))


@WGRAD_FAMILY.register
class Winograd4WgradEngine(Engine[ConvProblem]):
    """Weight gradient of a 3x3 stride-1 fp32 convolution by F(4x4, 3x3) (groups 1): dy's tiles
    transformed by A, x's patches by B^T as in the forward, 36 products over the tiles (split
    along them; the partials summed in split order, so deterministic), then G^T dU G."""

    name = "winograd_4x4"

    def not_supported_reasons(self, problem: ConvProblem) -> list[str]:
        reasons = Winograd4Engine().not_supported_reasons(problem)
        if problem.groups != 1:
            reasons.append(f"needs groups == 1 (got {problem.groups})")
        return reasons

    def cost(self, problem: ConvProblem) -> float:
        # The forward's model: the same transforms and products, dy's transform in the output's.
        return Winograd4Engine().cost(problem)

    def configs(self, problem: ConvProblem) -> list[LaunchConfig]:
        """The forward's, with three TF32 products in 128 x 64 tiles first: here both operands
        run along the tiles (K-major, as the tensor cores' TF32 products want them), which they do
        not in the forward. H100, fp32 NCHW N=64, 3x3 64 @56 .. 512 @7: 317, 175, 167, 157 us
        against 436, 414, 461, 431 on the FMA units (64 x 64 "ieee"), with a third of the error."""
        configs = Winograd4Engine().configs(problem)
        return sorted(configs, key=lambda c: c["PRECISION"] != "tf32x3")

    def bind(self, problem: ConvProblem, config: LaunchConfig) -> Callable[..., None]:
        p = problem
        tiles, patches = _patches(p, config)
        th, tw = cdiv(p.out_size[1], 4), cdiv(p.out_size[2], 4)
        dtype = getattr(torch, p.dtype)
        acc, big = _acc(p), _index_64(p, tiles)
        bc, bp, warps = config["BLOCK_C"], config["BLOCK_P"], config["num_warps"]
        ys, ws = p.y_strides, p.w_strides
        ints = (tiles, p.cout, th, tw, *p.out_size[1:], ys[0], ys[1], ys[3], ys[4])
        grads = launcher(
            _dy4_kernel, (cdiv(tiles, bp), cdiv(p.cout, bc)), 2, ints, (acc, big, bc, bp), num_warps=warps
        )
        bm, bn = config["BLOCK_M"], config["BLOCK_N"]
        splits = _wgrad_splits(p, tiles, config)
        chunk = cdiv(cdiv(tiles, splits), config["BLOCK_K"]) * config["BLOCK_K"]
        splits = cdiv(tiles, chunk)
        precision = "tf32" if p.tf32 else "ieee" if dtype == torch.float64 else config["PRECISION"]
        products = launcher(
            _products_kernel,
            (cdiv(p.cout, bm) * cdiv(p.cin, bn), 36, splits),
            3,
            (p.cout, p.cin, tiles, p.cout * tiles, tiles, 1, p.cin * tiles, 1, tiles, chunk),
            (acc, precision, bm, bn, config["BLOCK_K"], 8),
            num_warps=config["PRODUCT_WARPS"],
            num_stages=1 if INTERPRET else 3,
        )
        finish = launcher(
            _filter4_grad_kernel,
            (cdiv(p.cout * p.cin, 256),),
            2,
            (p.cout, p.cin, splits, ws[0], ws[1], ws[3], ws[4]),
            (256,),
        )

        def run(x, dy, dw) -> None:
            v = torch.empty((36, p.cin, tiles), dtype=dtype, device=x.device)
            patches(x, v)
            d = torch.empty((36, p.cout, tiles), dtype=dtype, device=x.device)
            grads(dy, d)
            du = torch.empty((splits, 36, p.cout, p.cin), dtype=dtype, device=x.device)
            products(d, v, du)
            finish(du, dw)

        return run
