"""The weight gradient of few-channel channels-last convolutions by row windows (the 7x7,
3-channel stem of ResNets).

In a dense channels-last x with one group and no W dilation, the KW * Cin elements that one output
pixel's (d, h) tap row reads lie side by side: ``(ow * stride - pad) * Cin + j`` from the start of
the pixel row, ``j = kw * Cin + c`` below the window ``KW * Cin``, and inside the row exactly when
that offset is in [0, IW * Cin). So the weight gradient is a GEMM with rows co, columns
(tap row r = (kd, kh), j) and the reduction over output pixels, whose B tile is a gather with one
pointer per pixel plus a per-column offset: no division per element. Every tap row of a block is
computed from the same dy tile, loaded once.

The general implicit GEMM gathers ``Cin`` contiguous elements per (pixel, tap) and finds each
element's tap by division: on the stem (3 channels) it ran at 6 TFLOP/s on an H100.
"""

from __future__ import annotations

from collections.abc import Callable

import triton
import triton.language as tl

from ...core.backend import INTERPRET
from ...core.engine import Engine, LaunchConfig
from ...core.launcher import cdiv, launcher
from ...core.numerics import convert
from ..matmul.kernels import dot
from .engines import (
    WGRAD_FAMILY,
    dot_constexprs,
    peak,
    roofline,
    split_pixels,
    summed_splits,
    wgrad_out_steps,
    workspace_steps,
)
from .kernels import output_pixel
from .problem import ConvProblem

# The widest window (KW * Cin) a column block takes: wider windows have channels enough for the
# implicit GEMM's contiguous runs.
MAX_WINDOW = 128
# Columns per program: tap rows are packed into blocks of this many (window padded to a power of 2).
MAX_COLUMNS = 256


@triton.jit
def _window_wgrad_kernel(
    dy_ptr, x_ptr, out_ptr,
    KTOT, COUT, OD, OH, OW, ID, IH, IW, CK, KH, KW, ROWS, k_chunk,
    y_n, y_c, y_d, y_h, y_w, x_n, x_d, x_h,
    o_s, o_m, o_c, o_t,
    st_d, st_h, st_w, pd_d, pd_h, pd_w, dl_d, dl_h,
    ACC: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, INDEX_64: tl.constexpr,
    BLOCK_M: tl.constexpr, ROW_BLOCK: tl.constexpr, WINDOW_BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """dw[co, c, kd, kh, kw] = sum over output pixels p of dy[p, co] * x[source(p) + tap]: one
    BLOCK_M tile of co, ROW_BLOCK tap rows (kd, kh) of WINDOW_BLOCK columns j = kw * CK + c each,
    pixels [s * k_chunk, (s + 1) * k_chunk). Grid: (co tiles, tap-row blocks, splits).

    x is dense channels-last along W (channel stride 1, W stride CK); strides of dy ``y_*``
    (n, c, d, h, w) and of x ``x_*`` (n, d, h). The sum is stored at
    ``out + s * o_s + co * o_m + c * o_c + tap * o_t``.
    """
    pid_m = tl.program_id(0)
    pid_r = tl.program_id(1)
    split = tl.program_id(2)
    if INDEX_64:
        split = split.to(tl.int64)
    cols = tl.arange(0, ROW_BLOCK * WINDOW_BLOCK)
    r = pid_r * ROW_BLOCK + cols // WINDOW_BLOCK
    j = cols % WINDOW_BLOCK
    col_ok = (r < ROWS) & (j < KW * CK)
    kd = r // KH
    kh = r % KH
    off_d = kd * dl_d - pd_d
    off_h = kh * dl_h - pd_h
    col_off = off_d * x_d + off_h * x_h + j
    co = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = co < COUT
    ks = tl.arange(0, BLOCK_K)
    k_start = split * k_chunk
    k_end = tl.minimum(KTOT, k_start + k_chunk)
    row_len = IW * CK
    acc = tl.zeros((BLOCK_M, ROW_BLOCK * WINDOW_BLOCK), ACC)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + ks
        k_ok = k < k_end
        n, od, oh, ow = output_pixel(k, OD, OH, OW)
        a_off = n * y_n + od * y_d + oh * y_h + ow * y_w
        a = tl.load(
            dy_ptr + co[:, None] * y_c + a_off[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0
        )
        sd = (od * st_d)[:, None] + off_d[None, :]
        sh = (oh * st_h)[:, None] + off_h[None, :]
        start = (ow * st_w - pd_w) * CK
        pos = start[:, None] + j[None, :]
        ok = (k_ok[:, None] & col_ok[None, :]) & ((sd >= 0) & (sd < ID) & (sh >= 0) & (sh < IH))
        ok = ok & (pos >= 0) & (pos < row_len)
        base = n * x_n + (od * st_d) * x_d + (oh * st_h) * x_h + start
        b = tl.load(x_ptr + base[:, None] + col_off[None, :], mask=ok, other=0.0)
        acc = dot(a, b, acc, PRECISION, UPCAST)
    kw = j // CK
    c = j % CK
    out_ptrs = out_ptr + split * o_s + co[:, None] * o_m + (c * o_c + (r * KW + kw) * o_t)[None, :]
    tl.store(out_ptrs, convert(acc, out_ptr.dtype.element_ty), mask=m_ok[:, None] & col_ok[None, :])


def window_block(p: ConvProblem) -> int:
    """The window KW * Cin padded to a power of two (at least 16, a dot's K/N granule)."""
    return max(16, triton.next_power_of_2(p.kernel[2] * p.cin))


def window_reasons(p: ConvProblem) -> list[str]:
    reasons = []
    if p.groups != 1:
        reasons.append(f"needs one group (got {p.groups})")
    if not (p.x_strides[1] == 1 and p.x_strides[4] == p.cin):
        reasons.append("x needs channels-last pixels along W (channel stride 1, W stride Cin)")
    if p.dilation[2] != 1:
        reasons.append(f"needs W dilation 1 (got {p.dilation[2]})")
    if p.kernel[2] * p.cin > MAX_WINDOW:
        reasons.append(f"a tap row's window KW * Cin = {p.kernel[2] * p.cin} exceeds {MAX_WINDOW}")
    return reasons


def _configs(p: ConvProblem) -> list[LaunchConfig]:
    if INTERPRET:
        return [{"BLOCK_M": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 1}]
    if p.dtype in ("float32", "float64"):
        return [{"BLOCK_M": 64, "BLOCK_K": 32, "num_warps": 8, "num_stages": 2}]
    return [
        {"BLOCK_M": 64, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3},
        {"BLOCK_M": 64, "BLOCK_K": 32, "num_warps": 8, "num_stages": 3},
        {"BLOCK_M": 128, "BLOCK_K": 32, "num_warps": 8, "num_stages": 3},
    ]


@WGRAD_FAMILY.register
class WindowWgradEngine(Engine[ConvProblem]):
    """Weight gradient of a few-channel, channels-last convolution (the stem): rows co, columns
    (tap row, window position), reduction over output pixels split with partial sums added in a
    fixed order."""

    name = "row_window"

    def not_supported_reasons(self, problem: ConvProblem) -> list[str]:
        return window_reasons(problem)

    def cost(self, problem: ConvProblem) -> float:
        p = problem
        # Columns padded to the window block do work too; the B tile is a gather (L1/L2 hits). On
        # the tensor cores that gather bounds it: the bf16 stem (N=64, H100) took 474 us, 0.08 of
        # the peak on the padded work.
        padded = p.flops * window_block(p) / (p.kernel[2] * p.cin)
        eff = 0.08 if p.dtype in ("float16", "bfloat16") else 0.25
        return roofline(padded, p.bytes, peak(p), eff, 0.5) + 8.0

    def configs(self, problem: ConvProblem) -> list[LaunchConfig]:
        return _configs(problem)

    def bind(self, problem: ConvProblem, config: LaunchConfig) -> Callable[..., None]:
        p = problem
        bm, bk = config["BLOCK_M"], config["BLOCK_K"]
        jb = window_block(p)
        rows = p.kernel[0] * p.kernel[1]
        rb = max(1, min(triton.next_power_of_2(rows), MAX_COLUMNS // jb))
        ktot = p.out_pixels
        split, chunk = split_pixels(ktot, cdiv(p.cout, bm) * cdiv(rows, rb), bk)
        y_n, y_c, y_d, y_h, y_w = p.y_strides
        x_n, _, x_d, x_h, _ = p.x_strides
        head = (
            ktot,
            p.cout,
            *p.out_size,
            *p.in_size,
            p.cin,
            p.kernel[1],
            p.kernel[2],
            rows,
            chunk,
            y_n,
            y_c,
            y_d,
            y_h,
            y_w,
            x_n,
            x_d,
            x_h,
        )
        geometry = (*p.stride, *p.pad, p.dilation[0], p.dilation[1])
        consts = (*dot_constexprs(p), p.index_64, bm, rb, jb, bk)
        opts = {"num_warps": config["num_warps"], "num_stages": config["num_stages"]}
        taps = p.taps
        numel = p.cout * p.cin * taps
        grid = (cdiv(p.cout, bm), cdiv(rows, rb), split)
        direct = (0, *wgrad_out_steps(p)[1:])  # one group
        if split == 1:
            launch = launcher(_window_wgrad_kernel, grid, 3, (*head, *direct, *geometry), consts, **opts)
            return lambda x, dy, dw: launch(dy, x, dw)
        partial = launcher(
            _window_wgrad_kernel, grid, 3, (*head, numel, *workspace_steps(p)[1:], *geometry), consts, **opts
        )
        return summed_splits(p, split, partial)
