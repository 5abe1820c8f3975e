"""Winograd F(2x2, 3x3) forward convolution for 3x3, stride-1, undilated 2-D convolutions.

Each 2x2 block of outputs is computed from a 4x4 input patch with 16 multiplies per channel pair
instead of 36 (2.25x fewer), in three steps:

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
cores need it; the bound there is 4x PyTorch's error plus atol). It pays most in fp32 without TF32,
where the GEMM runs on the CUDA cores and 2.25x fewer multiplies is 2.25x less time.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from ...core.backend import INTERPRET
from ...core.engine import Engine, LaunchConfig
from ...core.launcher import cdiv, launcher
from ...core.numerics import convert
from ..epilogue import apply_epilogue
from .engines import FAMILY, epilogue_constexprs, itemsize, peak, roofline, row_limit
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
