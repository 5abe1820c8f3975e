"""The weight gradient of stride-1 channels-last convolutions as shifted GEMMs on tensor
descriptors (TMA).

A dense channels-last tensor is a matrix X [N * D * H * W, C], one row per pixel. In a stride-1
convolution, tap (kd, kh, kw) of every pixel reads the pixel a constant number of rows away:
``shift = (kd * dd - pd) * H * W + (kh * dh - ph) * W + (kw * dw - pw)``. So per tap, the weight
gradient is dy's rows (transposed) times x's rows shifted by the tap: plain blocks that the copy
engine moves into shared memory, and both stay there for the tensor cores. Rows past the
tensor's ends load as zeros. A pixel whose shifted pixel lies outside the image (past an edge the
shifted row wraps into the neighbouring row or image) must not contribute: the plain loop adds
its product anyway, and a short second loop gathers those pixels (the image's margins: 2 of 56
columns and rows of a 3x3 tap at 56x56) and subtracts their products. Masking dy's tile in the
main loop instead routes it through registers, which ran the kernel 1.6-1.9x slower on an H100
(3x3 ResNet-50 layers, N=64). (So an Inf or NaN in x makes NaN in taps where PyTorch's sum skips
it: the product taken back is 0 * Inf.)

(The forward and data gradient read boxes of the image instead, ``boxed``; for the weight
gradient, whose both operands would be such boxes, one of them would pass through registers
reshaped, and it measured no faster than this kernel on an H100. ``padded`` reads x in boxes
and dy as rows of a copy padded to whole boxes instead: both operands from shared memory.)
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from ...core.backend import INTERPRET, sm_count
from ...core.engine import Engine, LaunchConfig
from ...core.launcher import cdiv, ensure_allocator, launcher
from ...core.numerics import convert
from ..matmul.kernels import dot
from .boxed import descriptor_reasons
from .engines import (
    WGRAD_FAMILY,
    ImplicitGemmWgradEngine,
    channels_last_stager,
    dense_channels_first,
    dot_constexprs,
    peak,
    roofline,
    summed_splits,
    wgrad_out_steps,
    workspace_steps,
)
from .problem import ConvProblem, itemsize


@triton.jit
def _margins(off, size):
    """How many planes/rows/columns at the low and the high end of a dimension of ``size`` have
    their pixel displaced by ``off`` outside the image."""
    lo = tl.minimum(tl.maximum(-off, 0), size)
    hi = tl.minimum(tl.maximum(off, 0), size - lo)
    return lo, hi


@triton.jit
def _margin_rank(p, SD, SH, SW, mdl, mdh, mhl, mhh):
    """How many pixels of margin rows lie before pixel ``p`` (margin rows: rows whose plane or row
    index is in a margin; counted image by image, in pixel order)."""
    mh = mhl + mhh
    inner_d = SD - mdl - mdh
    rows = SD * SH - inner_d * (SH - mh)  # margin rows per image
    n = p // (SD * SH * SW)
    r = (p // SW) % (SD * SH)
    d = r // SH
    h = r % SH
    planes_before = tl.where(
        d <= mdl,
        d * SH,
        tl.where(d <= SD - mdh, mdl * SH + (d - mdl) * mh, mdl * SH + inner_d * mh + (d - SD + mdh) * SH),
    )
    full = (d < mdl) | (d >= SD - mdh)
    in_plane = tl.where(full | (h < mhl), h, tl.where(h < SH - mhh, mhl, mhl + h - SH + mhh))
    margin = full | (h < mhl) | (h >= SH - mhh)
    return (n * rows + planes_before + in_plane) * SW + tl.where(margin, p % SW, 0)


@triton.jit
def _margin_pixel(j, SD, SH, SW, mdl, mdh, mhl, mhh):
    """The pixel whose margin rank (``_margin_rank``) is ``j``."""
    mh = mhl + mhh
    inner_d = SD - mdl - mdh
    rows = SD * SH - inner_d * (SH - mh)
    n = j // (rows * SW)
    q = (j // SW) % rows
    w = j % SW
    low_end = mdl * SH  # rows of the low full planes
    high_start = low_end + inner_d * mh  # rows before the high full planes
    q2 = tl.maximum(q - low_end, 0)
    hq = q2 % tl.maximum(mh, 1)
    d = tl.where(q < low_end, q // SH, tl.where(q < high_start, mdl + q2 // tl.maximum(mh, 1), 0))
    h = tl.where(q < low_end, q % SH, tl.where(hq < mhl, hq, SH - mhh + hq - mhl))
    q3 = q - high_start
    d = tl.where(q >= high_start, SD - mdh + q3 // SH, d)
    h = tl.where(q >= high_start, q3 % SH, h)
    return (n * SD * SH + d * SH + h) * SW + w


@triton.jit
def _take_back(
    acc, x_ptr, dy_ptr, p, keep, shift, P, x_row, y_row, xc0, yc0, n_lim, m_lim,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """acc - dy[p]^T x[p + shift] over the pixels ``p`` where ``keep`` (gathered loads)."""
    co = tl.arange(0, BLOCK_M)
    c = tl.arange(0, BLOCK_N)
    p = p.to(tl.int64)
    a_ok = keep[None, :] & (co < m_lim)[:, None]
    a = tl.load(dy_ptr + p[None, :] * y_row + (yc0 + co)[:, None], mask=a_ok, other=0.0)
    q = p + shift
    b_ok = (keep & (q >= 0) & (q < P))[:, None] & (c < n_lim)[None, :]
    b = tl.load(x_ptr + q[:, None] * x_row + (xc0 + c)[None, :], mask=b_ok, other=0.0)
    return dot(-a, b, acc, PRECISION, UPCAST)


@triton.jit
def _take_back_wrapped(
    acc, x_ptr, dy_ptr, P, x_row, y_row, xc0, yc0, n_lim, m_lim,
    k_start, k_end, shift, SD, SH, SW, dd, dh, dw,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Subtract from ``acc`` the products of the pixels in [k_start, k_end) whose tap, displaced
    by (dd, dh, dw), leaves the image: the plain shifted rows wrapped them into a neighbouring
    row, plane or image. Those pixels are the margin rows (planes or rows within the margins
    of D and H, whole) and, in the other rows, the margin columns."""
    mdl, mdh = _margins(dd, SD)
    mhl, mhh = _margins(dh, SH)
    mwl, mwh = _margins(dw, SW)
    # Margin columns of the rows that are not margin rows. (Software-pipelining these gathered
    # loops, or merging the two, measured no faster on an H100.)
    mw = mwl + mwh
    r_first = k_start // SW
    count = (tl.cdiv(k_end, SW) - r_first) * mw
    for j0 in range(0, count, BLOCK_K):
        j = j0 + tl.arange(0, BLOCK_K)
        r = r_first + j // tl.maximum(mw, 1)
        col = j % tl.maximum(mw, 1)
        p = r * SW + tl.where(col < mwl, col, SW - mwh + col - mwl)
        h = r % SH
        d = (r // SH) % SD
        inner = (d >= mdl) & (d < SD - mdh) & (h >= mhl) & (h < SH - mhh)
        keep = (j < count) & inner & (p >= k_start) & (p < k_end)
        acc = _take_back(
            acc, x_ptr, dy_ptr, p, keep, shift, P, x_row, y_row, xc0, yc0, n_lim, m_lim,
            PRECISION, UPCAST, BLOCK_M, BLOCK_N,
        )  # fmt: skip
    # Margin rows, whole: ranks [rank(k_start), rank(k_end)) are this range's.
    j_start = _margin_rank(k_start, SD, SH, SW, mdl, mdh, mhl, mhh)
    j_end = _margin_rank(k_end, SD, SH, SW, mdl, mdh, mhl, mhh)
    for j0 in range(j_start, j_end, BLOCK_K):
        j = j0 + tl.arange(0, BLOCK_K)
        p = _margin_pixel(j, SD, SH, SW, mdl, mdh, mhl, mhh)
        acc = _take_back(
            acc, x_ptr, dy_ptr, p, j < j_end, shift, P, x_row, y_row, xc0, yc0, n_lim, m_lim,
            PRECISION, UPCAST, BLOCK_M, BLOCK_N,
        )  # fmt: skip
    return acc


@triton.jit
def tap_tile(
    CG, TD, TH, TW, off_d, off_h, off_w, dl_d, dl_h, dl_w, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):  # fmt: skip
    """A weight-gradient program's (group, split, tap, first output channel, first input channel,
    and the tap's offset per dimension), from the grid (co tiles * taps * c tiles, groups, splits)."""
    taps = TD * TH * TW
    tiles_n = tl.cdiv(CG, BLOCK_N)
    pid = tl.program_id(0)
    pid_n = pid % tiles_n
    t = (pid // tiles_n) % taps
    pid_m = pid // (tiles_n * taps)
    tw = t % TW
    th = (t // TW) % TH
    td = t // (TW * TH)
    dd = off_d + td * dl_d
    dh = off_h + th * dl_h
    dw = off_w + tw * dl_w
    return tl.program_id(1), tl.program_id(2), t, pid_m * BLOCK_M, pid_n * BLOCK_N, dd, dh, dw


@triton.jit
def store_tile(
    acc, out_ptr, split, g, t, co0, c0, COG, CG, o_s, o_g, o_m, o_c, o_t,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Store a (co, c) tile of tap t's sums at ``out + split * o_s + g * o_g + co * o_m + c * o_c
    + t * o_t`` (dw itself, or a split's row of the workspace)."""
    co = co0 + tl.arange(0, BLOCK_M)
    c = c0 + tl.arange(0, BLOCK_N)
    out_ptrs = out_ptr + split * o_s + g * o_g + co[:, None] * o_m + (c * o_c + t * o_t)[None, :]
    tl.store(out_ptrs, convert(acc, out_ptr.dtype.element_ty), mask=(co < COG)[:, None] & (c < CG)[None, :])


@triton.jit
def _shifted_wgrad_kernel(
    x_ptr, dy_ptr, out_ptr,
    P, CG, COG, C_X, C_Y, x_row, y_row, k_chunk,
    SD, SH, SW, TD, TH, TW, off_d, off_h, off_w, dl_d, dl_h, dl_w,
    o_s, o_g, o_m, o_c, o_t,
    ACC: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, WRAPS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """dw[co, c, tap] = sum over pixels p of dy[p, co] * x[p + shift(tap), c] for one group, one
    tap, a BLOCK_M x BLOCK_N tile of (co, c) and the pixels [s * k_chunk, (s + 1) * k_chunk).
    Grid: (co tiles * taps * c tiles, groups, splits).

    x: [P, C_X] (row stride ``x_row``), dy: [P, C_Y] (``y_row``), both on the same pixel grid
    (SD, SH, SW); this group's channels are columns [g * CG, ...) of x and [g * COG, ...) of dy.
    dy's tile loads as [pixels, co] and is transposed for the dot; where shifted pixels can leave
    the image (WRAPS), their products are taken back after the loop. k_chunk is a multiple of
    BLOCK_K, so blocks never straddle two splits; pixels past P load as zeros. Sums are stored at
    ``out + s * o_s + g * o_g + co * o_m + c * o_c + tap * o_t``.
    """
    x_desc = tl.make_tensor_descriptor(x_ptr, [P, C_X], [x_row, 1], [BLOCK_K, BLOCK_N])
    dy_desc = tl.make_tensor_descriptor(dy_ptr, [P, C_Y], [y_row, 1], [BLOCK_K, BLOCK_M])
    g, split, t, co0, c0, dd, dh, dw = tap_tile(
        CG, TD, TH, TW, off_d, off_h, off_w, dl_d, dl_h, dl_w, BLOCK_M, BLOCK_N
    )
    shift = (dd * SH + dh) * SW + dw
    k_start = split * k_chunk
    k_end = tl.minimum(P, k_start + k_chunk)
    acc = tl.zeros((BLOCK_M, BLOCK_N), ACC)
    for p0 in range(k_start, k_end, BLOCK_K):
        a = dy_desc.load([p0, g * COG + co0]).T
        b = x_desc.load([p0 + shift, g * CG + c0])
        acc = dot(a, b, acc, PRECISION, UPCAST)
    if WRAPS:
        acc = _take_back_wrapped(
            acc, x_ptr, dy_ptr, P, x_row, y_row, g * CG + c0, g * COG + co0, CG - c0, COG - co0,
            k_start, k_end, shift, SD, SH, SW, dd, dh, dw,
            PRECISION, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip
    store_tile(acc, out_ptr, split, g, t, co0, c0, COG, CG, o_s, o_g, o_m, o_c, o_t, BLOCK_M, BLOCK_N)


# ---------------------------------------------------------------------------------------------
# Which problems the kernels take, and their arguments.


def rows_stride(shape: tuple[int, ...], strides: tuple[int, ...]) -> int | None:
    """The row stride of a (N, C, D, H, W) tensor read as a matrix [N * D * H * W, C] (channels
    at unit stride, pixels at equal steps of at least C), or None where it is not one."""
    n, c, d, h, w = shape
    if c > 1 and strides[1] != 1:
        return None
    row = None
    dims = ((w, strides[4], 1), (h, strides[3], w), (d, strides[2], h * w), (n, strides[0], d * h * w))
    for size, stride, pixels in dims:
        if size == 1:
            continue
        if row is None:
            row, rem = divmod(stride, pixels)
            if rem:
                return None
        if stride != row * pixels:
            return None
    if row is None:
        row = c
    return row if row >= c else None


def _aligned(n: int) -> bool:
    return n % 16 == 0


def _operands(p: ConvProblem) -> list[tuple[str, int, tuple[int, ...], bool]]:
    """(name, channels, strides, staged) of x and dy. A dense channels-first 16-bit operand (NCL,
    NCHW, NCDHW) is ``staged``: copied channels-last per call, then read as that matrix."""
    operands = []
    for name, channels, strides in (("x", p.cin, p.x_strides), ("dy", p.cout, p.y_strides)):
        staged = (
            p.dtype in ("float16", "bfloat16")
            and channels > 1
            and strides[1] != 1
            and dense_channels_first((p.n, channels, *p.in_size), strides)
        )
        operands.append((name, channels, strides, staged))
    return operands


def _row(p: ConvProblem, channels: int, strides: tuple[int, ...], staged: bool) -> int | None:
    return channels if staged else rows_stride((p.n, channels, *p.in_size), strides)


def wgrad_reasons(p: ConvProblem) -> list[str]:
    reasons = descriptor_reasons(p)
    if p.stride != (1, 1, 1):
        reasons.append(f"needs stride 1 (got {p.stride[3 - p.nd :]})")
    if p.out_size != p.in_size:
        reasons.append(f"needs the output grid to equal the input's ({p.out_size} vs {p.in_size})")
    size = itemsize(p.dtype)
    for name, channels, strides, staged in _operands(p):
        row = _row(p, channels, strides, staged)
        if row is None:
            reasons.append(f"{name} needs a dense channels-last layout (NHWC, NDHWC, NLC)")
        elif not _aligned(row * size):
            reasons.append(f"{name}'s pixel rows need 16-byte alignment ({row} channels)")
    if p.groups > 1 and not (_aligned(p.cin_g * size) and _aligned(p.cout_g * size)):
        reasons.append("grouped: each group's channels need to start 16-byte aligned")
    return reasons


def _wgrad_configs(p: ConvProblem) -> list[LaunchConfig]:
    """Tiles of (output channel, input channel) for one tap, the heuristic's pick first: no taller
    or wider than the group's channels."""
    if INTERPRET:
        shapes = [(16, 16, 16, 4, 1)]
    elif p.dtype == "float32":
        shapes = [(64, 64, 32, 4, 3), (128, 64, 32, 4, 3), (64, 128, 32, 4, 3)]
    else:
        # H100, bf16, N=64, graphs, with ``reduction_splits``' counts: 128x128 tiles with two warp groups
        # 3x3 512 @7 / 256 @14 / 128 @28 64 / 48 / 44 us, with one 70 / 52 / 47. (With two waves'
        # worth of splits one had been faster: 63 / 59 against 67 / 61.)
        shapes = [(128, 128, 64, 8, 3), (64, 64, 64, 4, 4), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4)]
        shapes.append((128, 128, 64, 4, 3))
    return tile_configs(p, shapes)


def tile_configs(p: ConvProblem, shapes: list[tuple[int, int, int, int, int]]) -> list[LaunchConfig]:
    """Configs of (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) shapes, those no taller or wider than
    the group's channels (rounded up to 64) first, in their order otherwise."""
    fit_m = max(64, 1 << (p.cout_g - 1).bit_length())
    fit_n = max(64, 1 << (p.cin_g - 1).bit_length())
    shapes = sorted(shapes, key=lambda s: (s[0] > fit_m) + (s[1] > fit_n))  # stable
    return [
        {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w, "num_stages": st}
        for bm, bn, bk, w, st in shapes
    ]


def reduction_splits(p: ConvProblem, tiles: int, pixels: int, config: LaunchConfig) -> int:
    """How many pixel ranges the reduction splits into. Tiles of 64 x 64 or less share a
    multiprocessor: two waves' worth of programs (H100, bf16 N=64, 3x3 64 @56 split 30 59 us
    against one wave's 14 73; 3x3x3 64 @16x56x56 10 against 9: 580 against 631 us with dgrad).
    Larger ones: the fewest waves of programs times the K steps each runs (about 0.4 us a 128 x
    128 x 64 16-bit step), plus the workspace each extra split writes and the sum reads (2.5
    TB/s). Graphs: 3x3 256 @14 split 3 (one wave of 108 programs) 52 us against two waves' 63 (8);
    128 @28 14 against 30: 47 against 55; 512 @7 1 (144 tiles, dw stored directly) 64-70
    against 68-75 with 2."""
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    most = max(1, min(cdiv(pixels, 4 * bk), 1024))
    if bm * bn <= 64 * 64:
        return min(cdiv(2 * sm_count(), tiles), most)
    step = 0.4 * bm * bn * bk / (128 * 128 * 64) * peak(p) / 600.0
    ws_split = p.cout * p.cin_g * p.taps * 8 / 2.5e6  # fp32 written once, read once

    def cost(split: int) -> float:
        waves = cdiv(tiles * split, sm_count())
        return waves * cdiv(pixels, split * bk) * step + (ws_split * split if split > 1 else 0.0)

    return min(range(1, min(most, 256) + 1), key=cost)


def _margin_share(p: ConvProblem) -> float:
    """The share of (pixel, tap) pairs the take-back loop gathers: taps displaced past an edge.
    Each costs a few of the main loop's (registers, not descriptors): H200, bf16 NHWC N=64, CUDA
    graphs, 3x3 512 @7 (share 0.18) 63.5 us, 256 @14 (0.09) 45.8, 128 @28 40.8 (57.5 and 52.1 in
    the bench's own timing)."""
    share = 0.0
    for tap in range(p.taps):
        kept = 1.0
        for dim, size in enumerate(p.out_size):
            k = (tap // math.prod(p.kernel[dim + 1 :])) % p.kernel[dim]
            off = abs(k * p.dilation[dim] - p.pad[dim])
            kept *= max(0, size - off) / size
        share += 1.0 - kept
    return share / p.taps


@WGRAD_FAMILY.register
class ShiftedGemmWgradEngine(Engine[ConvProblem]):
    """Weight gradient of a stride-1 'same' convolution (channels-last): per tap, dy's pixel rows
    (transposed) times x's rows shifted by the tap, both by tensor descriptor, split over pixels
    with the partial sums added in a fixed order."""

    name = "shifted_gemm"

    def not_supported_reasons(self, problem: ConvProblem) -> list[str]:
        return wgrad_reasons(problem)

    def cost(self, problem: ConvProblem) -> float:
        p = problem
        # On an H100 (bf16, N=64) it beat the gathered implicit GEMM on every ResNet-50 stride-1
        # layer while it still masked dy in registers (3x3 by 10-25%, 1x1 by 17%, the 3x3x3
        # conv3d by 42%); taking wrapped pixels back instead made the 3x3 layers 1.2-1.6x faster
        # again (84-110 us against cuDNN's 33-55), 1x1 is at 0.9-1.0x cuDNN.
        wraps = p.taps > 1 or any(p.pad)  # the take-back loop runs
        take_back = 2.5 * _margin_share(p) if p.dtype in ("float16", "bfloat16") else 0.0  # timed there
        cost = roofline(p.flops * (1 + take_back), p.bytes, peak(p), 0.65 if wraps else 0.8, 0.7) + 8.0
        for _, channels, _, staged in _operands(p):
            if staged:  # its channels-last copy: read and written once more
                nbytes = 2 * p.n * math.prod(p.in_size) * channels * itemsize(p.dtype)
                cost += roofline(0, nbytes, 1.0, 1.0, 0.75) + 4.0
        return cost

    def configs(self, problem: ConvProblem) -> list[LaunchConfig]:
        return _wgrad_configs(problem)

    def bind(self, problem: ConvProblem, config: LaunchConfig) -> Callable[..., None]:
        p = problem
        bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
        taps = p.taps
        pixels = p.n * math.prod(p.in_size)
        tiles = cdiv(p.cout_g, bm) * taps * cdiv(p.cin_g, bn)
        split = reduction_splits(p, tiles * p.groups, pixels, config)
        chunk = cdiv(cdiv(pixels, split), bk) * bk
        split = cdiv(pixels, chunk)
        (_, _, x_strides, stage_x), (_, _, y_strides, stage_dy) = _operands(p)
        head = (
            pixels,
            p.cin_g,
            p.cout_g,
            p.cin,
            p.cout,
            _row(p, p.cin, x_strides, stage_x),
            _row(p, p.cout, y_strides, stage_dy),
            chunk,
            *p.in_size,
            *p.kernel,
            *(-q for q in p.pad),
            *p.dilation,
        )
        acc, precision, upcast = dot_constexprs(p)
        consts = (acc, precision, upcast, taps > 1 or any(p.pad), bm, bn, bk)
        opts = {"num_warps": config["num_warps"], "num_stages": config["num_stages"]}
        ncols = p.cin_g * taps
        numel = p.cout * ncols
        grid = (tiles, p.groups, split)
        direct = (0, *wgrad_out_steps(p))
        launch = launcher(_shifted_wgrad_kernel, grid, 3, (*head, *direct), consts, **opts)
        fallback = ImplicitGemmWgradEngine()
        slow = fallback.bind(p, fallback.configs(p)[0])

        stagers = tuple(
            channels_last_stager(p.n, c, p.in_size) if staged else None
            for c, staged in ((p.cin, stage_x), (p.cout, stage_dy))
        )

        def operands(x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
            """x and dy as the kernel reads them (staged ones copied), or None when a base address
            is off 16 bytes (descriptors need aligned ones, which only the call knows)."""
            if (x.data_ptr() | dy.data_ptr()) & 15:
                return None
            ensure_allocator()
            return tuple(t if stage is None else stage(t) for t, stage in zip((x, dy), stagers))  # type: ignore[return-value]

        if split == 1:

            def run_direct(x: torch.Tensor, dy: torch.Tensor, dw: torch.Tensor) -> None:
                read = operands(x, dy)
                if read is None:
                    return slow(x, dy, dw)
                launch(*read, dw)

            return run_direct
        partial = launcher(
            _shifted_wgrad_kernel, grid, 3, (*head, numel, *workspace_steps(p)), consts, **opts
        )
        summed = summed_splits(p, split, lambda dy, x, ws: partial(x, dy, ws))

        def run(x: torch.Tensor, dy: torch.Tensor, dw: torch.Tensor) -> None:
            read = operands(x, dy)
            if read is None:
                return slow(x, dy, dw)
            summed(*read, dw)

        return run
