"""Stride-1 convolutions of channels-last tensors as shifted GEMMs on tensor descriptors (TMA).

A dense channels-last tensor is a matrix X [N * D * H * W, C], one row per pixel. In a stride-1
convolution, tap (kd, kh, kw) of every pixel reads the pixel a constant number of rows away:
``shift = (kd * dd - pd) * H * W + (kh * dh - ph) * W + (kw * dw - pw)``. So the A tile of a tap
is a plain block of X (BLOCK_M rows from ``off_m + shift``), moved into shared memory by the copy
engine with no address arithmetic; a gathered implicit GEMM computes an address per element.
Rows whose shifted pixel lies outside the image (past an edge it wraps into the neighbouring row
or image) are zeroed in registers before the dot; rows past the tensor's ends load as zeros. The
weights, a matrix [Cout, taps * Cin_g] with the channels innermost, load by descriptor too: in
place for channels-last weights, else packed per call (a few microseconds for ResNet's largest).

Rows are indexed on the source's pixel grid: output pixel (n, d, h, w) is computed by row
(n, d, h, w) of the source, and written if it lies inside the output, which must be no larger
than the source in any dimension (true for 'same' and 'valid' padding).

The data gradient of a stride-1 convolution is the convolution of the output gradient with the
transposed, flipped weights (packed per call) and padding ``(k - 1) * d - pad``: the same kernel.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from ...core.backend import INTERPRET
from ...core.engine import Engine, LaunchConfig
from ...core.launcher import cdiv, ensure_allocator, launcher
from ...core.numerics import convert
from ..epilogue import apply_epilogue
from ..matmul.kernels import dot, grouped
from .engines import (
    DGRAD_FAMILY,
    FAMILY,
    WGRAD_FAMILY,
    ImplicitGemmDgradEngine,
    ImplicitGemmEngine,
    ImplicitGemmWgradEngine,
    dot_constexprs,
    epilogue_constexprs,
    peak,
    roofline,
    row_limit,
    sm_count,
)
from .kernels import _sum_kernel
from .problem import ConvProblem, itemsize


@triton.jit
def _shifted_kernel(
    src_ptr, w_ptr, out_ptr, c_ptr, bias_ptr, res_ptr, pre_ptr,
    alpha, beta, p0, p1,
    R, NCOLS, CK, C_ALL, s_row, W_ROWS, W_K, w_row,
    SD, SH, SW, OD, OH, OW, TD, TH, TW, off_d, off_h, off_w, dl_d, dl_h, dl_w,
    o_n, o_c, o_d, o_h, o_w, s_bias, row_limit, programs,
    HAS_C: tl.constexpr, BIAS: tl.constexpr, ACT: tl.constexpr, RESIDUAL: tl.constexpr,
    STORE_PRE: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    MASKED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, FLATTEN: tl.constexpr,
):  # fmt: skip
    """Output tiles of one group, persistent over ``programs`` programs. Grid: (programs, groups).

    src: X [R, C_ALL] (row stride ``s_row``), R = N * SD * SH * SW rows on the source grid; this
    group's channels are columns [g * CK, (g + 1) * CK). w: [W_ROWS, W_K] (row stride ``w_row``),
    row = output column of any group (this group's: [g * NCOLS, (g + 1) * NCOLS)), column =
    tap * CK + channel. Tap (td, th, tw) reads the source at offset ``off + t * dl`` per
    dimension. Outputs (OD, OH, OW, no larger than the source grid) at strides ``o_*``.
    MASKED: some tap reaches outside the image (else every shifted row is the pixel itself).
    FLATTEN: Triton pipelines the tile and K loops as one (the next tile's loads overlap this
    tile's epilogue).
    """
    src_desc = tl.make_tensor_descriptor(src_ptr, [R, C_ALL], [s_row, 1], [BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, [W_ROWS, W_K], [w_row, 1], [BLOCK_N, BLOCK_K])
    g = tl.program_id(1)
    tiles_m = tl.cdiv(R, BLOCK_M)
    tiles_n = tl.cdiv(NCOLS, BLOCK_N)
    k_blocks = tl.cdiv(CK, BLOCK_K)
    steps = TD * TH * TW * k_blocks
    col0 = g * CK
    wrow0 = g * NCOLS
    # The epilogue finds its tile from a counter of its own: with the loops flattened, what the top
    # of the body computes may already belong to the next tile.
    tile_done = tl.program_id(0) - programs
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, programs, flatten=FLATTEN):
        pid_m, pid_n = grouped(tile, tiles_m, tiles_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        rows = off_m + tl.arange(0, BLOCK_M)
        pw = rows % SW
        ph = (rows // SW) % SH
        pd = (rows // (SW * SH)) % SD
        acc = tl.zeros((BLOCK_M, BLOCK_N), ACC)
        for i in range(steps):
            t = i // k_blocks
            c0 = (i - t * k_blocks) * BLOCK_K
            tw = t % TW
            th = (t // TW) % TH
            td = t // (TW * TH)
            dd = off_d + td * dl_d
            dh = off_h + th * dl_h
            dw = off_w + tw * dl_w
            a = src_desc.load([off_m + (dd * SH + dh) * SW + dw, col0 + c0])
            if MASKED:
                sd = pd + dd
                sh = ph + dh
                sw = pw + dw
                inside = (sd >= 0) & (sd < SD) & (sh >= 0) & (sh < SH) & (sw >= 0) & (sw < SW)
                a = tl.where(inside[:, None], a, tl.zeros_like(a))
            b = w_desc.load([wrow0 + off_n, t * CK + c0])
            acc = dot(a, b.T, acc, PRECISION, UPCAST)
        tile_done += programs
        pid_m, pid_n = grouped(tile_done, tiles_m, tiles_n, GROUP_M)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ow = rows % SW
        oh = (rows // SW) % SH
        rest = rows // (SW * SH)
        od = rest % SD
        n = rest // SD
        ok = (rows < R) & (od < OD) & (oh < OH) & (ow < OW)
        out_rows = tl.where(ok, n * o_n + od * o_d + oh * o_h + ow * o_w, row_limit)
        base = g * NCOLS * o_c
        y = apply_epilogue(
            acc, out_rows, cols, row_limit, NCOLS,
            c_ptr + base, 1, o_c, bias_ptr + g * NCOLS * s_bias, s_bias,
            res_ptr + base, 1, o_c, pre_ptr + base, 1, o_c,
            alpha, beta, p0, p1, HAS_C, BIAS, ACT, RESIDUAL, STORE_PRE,
        )  # fmt: skip
        out_ptrs = out_ptr + base + out_rows[:, None] + cols[None, :] * o_c
        tl.store(out_ptrs, convert(y, out_ptr.dtype.element_ty), mask=ok[:, None] & (cols < NCOLS)[None, :])


@triton.jit
def _shifted_wgrad_kernel(
    x_ptr, dy_ptr, out_ptr,
    P, CG, COG, C_X, C_Y, x_row, y_row, k_chunk,
    SD, SH, SW, TD, TH, TW, off_d, off_h, off_w, dl_d, dl_h, dl_w,
    o_s, o_g, o_m, o_c, o_t,
    ACC: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, MASKED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """dw[co, c, tap] = sum over pixels p of dy[p, co] * x[p + shift(tap), c] for one group, one
    tap, a BLOCK_M x BLOCK_N tile of (co, c) and the pixels [s * k_chunk, (s + 1) * k_chunk).
    Grid: (co tiles * taps * c tiles, groups, splits).

    x: [P, C_X] (row stride ``x_row``), dy: [P, C_Y] (``y_row``), both on the same pixel grid
    (SD, SH, SW); this group's channels are columns [g * CG, ...) of x and [g * COG, ...) of dy.
    dy's tile loads as [pixels, co] and is transposed for the dot; pixels whose shifted pixel lies
    outside the image are zeroed in it (MASKED). k_chunk is a multiple of BLOCK_K, so blocks
    never straddle two splits; pixels past P load as zeros. Sums are stored at
    ``out + s * o_s + g * o_g + co * o_m + c * o_c + tap * o_t``.
    """
    x_desc = tl.make_tensor_descriptor(x_ptr, [P, C_X], [x_row, 1], [BLOCK_K, BLOCK_N])
    dy_desc = tl.make_tensor_descriptor(dy_ptr, [P, C_Y], [y_row, 1], [BLOCK_K, BLOCK_M])
    taps = TD * TH * TW
    tiles_n = tl.cdiv(CG, BLOCK_N)
    pid = tl.program_id(0)
    g = tl.program_id(1)
    split = tl.program_id(2)
    pid_n = pid % tiles_n
    t = (pid // tiles_n) % taps
    pid_m = pid // (tiles_n * taps)
    tw = t % TW
    th = (t // TW) % TH
    td = t // (TW * TH)
    dd = off_d + td * dl_d
    dh = off_h + th * dl_h
    dw = off_w + tw * dl_w
    shift = (dd * SH + dh) * SW + dw
    co0 = pid_m * BLOCK_M
    c0 = pid_n * BLOCK_N
    k_start = split * k_chunk
    k_end = tl.minimum(P, k_start + k_chunk)
    acc = tl.zeros((BLOCK_M, BLOCK_N), ACC)
    for p0 in range(k_start, k_end, BLOCK_K):
        a = dy_desc.load([p0, g * COG + co0]).T
        if MASKED:
            p = p0 + tl.arange(0, BLOCK_K)
            sw = p % SW + dw
            sh = (p // SW) % SH + dh
            sd = (p // (SW * SH)) % SD + dd
            inside = (sd >= 0) & (sd < SD) & (sh >= 0) & (sh < SH) & (sw >= 0) & (sw < SW)
            a = tl.where(inside[None, :], a, tl.zeros_like(a))
        b = x_desc.load([p0 + shift, g * CG + c0])
        acc = dot(a, b, acc, PRECISION, UPCAST)
    co = co0 + tl.arange(0, BLOCK_M)
    c = c0 + tl.arange(0, BLOCK_N)
    out_ptrs = out_ptr + split * o_s + g * o_g + co[:, None] * o_m + (c * o_c + t * o_t)[None, :]
    tl.store(out_ptrs, convert(acc, out_ptr.dtype.element_ty), mask=(co < COG)[:, None] & (c < CG)[None, :])


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


def _hopper() -> bool:
    return torch.cuda.get_device_capability() >= (9, 0)


def _aligned(n: int) -> bool:
    return n % 16 == 0


class _Geometry:
    """What the kernel needs of one direction: the source (x forward, dy for the data gradient)
    as a row matrix, the output grid, the per-dimension tap offsets and the weight matrix."""

    def __init__(self, p: ConvProblem) -> None:
        fwd = p.direction == "fwd"
        self.src_channels = p.cin if fwd else p.cout
        self.src_size = p.in_size if fwd else p.out_size
        self.out_size = p.out_size if fwd else p.in_size
        self.src_strides = p.x_strides if fwd else p.y_strides
        self.out_strides = p.y_strides if fwd else p.x_strides
        self.cols = p.cout_g if fwd else p.cin_g  # output columns per group
        self.ck = p.cin_g if fwd else p.cout_g  # reduction channels per group
        self.w_rows = p.cout if fwd else p.cin
        if fwd:
            self.offsets = tuple(-q for q in p.pad)
        else:  # the flipped kernel's padding is (k - 1) * d - pad
            self.offsets = tuple(q - (k - 1) * d for q, k, d in zip(p.pad, p.kernel, p.dilation))
        shape = (p.n, self.src_channels, *self.src_size)
        self.s_row = rows_stride(shape, self.src_strides)
        self.rows = p.n * math.prod(self.src_size)
        self.k = p.taps * self.ck
        self.w_inplace = fwd and _weights_in_place(p)
        pad_to = 16 // itemsize(p.dtype)
        self.w_row = p.w_strides[0] if self.w_inplace else cdiv(self.k, pad_to) * pad_to
        self.masked = any(o != 0 for o in self.offsets) or p.taps > 1


def _weights_in_place(p: ConvProblem) -> bool:
    """Whether forward weights (Cout, Cin_g, *kernel) already are the matrix [Cout, taps * Cin_g]
    with 16-byte-aligned rows: channels-last weights."""
    wo, wc, wd, wh, ww = p.w_strides
    kd, kh, kw = p.kernel
    ck = p.cin_g
    ok = (ck == 1 or wc == 1) and (kw == 1 or ww == ck) and (kh == 1 or wh == kw * ck)
    ok = ok and (kd == 1 or wd == kh * kw * ck)
    return ok and (p.cout == 1 or wo >= p.taps * ck) and _aligned(wo * itemsize(p.dtype))


def _pack_weights(p: ConvProblem, geo: _Geometry) -> Callable[[torch.Tensor], torch.Tensor]:
    """w (Cout, Cin_g, *kernel) -> the kernel's weight matrix: forward [Cout, taps * Cin_g]; data
    gradient [Cin, taps * Cout_g], taps reversed (rows padded to 16 bytes, the pad never read)."""
    if geo.w_inplace:
        return lambda w: w
    taps, g = p.taps, p.groups
    dtype = getattr(torch, p.dtype)

    if p.direction == "fwd":

        def pack(w: torch.Tensor) -> torch.Tensor:
            buf = torch.empty((p.cout, geo.w_row), dtype=dtype, device=w.device)
            w3 = w.reshape(p.cout, p.cin_g, taps)
            buf[:, : geo.k].view(p.cout, taps, p.cin_g).copy_(w3.transpose(1, 2))
            return buf

        return pack

    def pack_transposed(w: torch.Tensor) -> torch.Tensor:
        buf = torch.empty((p.cin, geo.w_row), dtype=dtype, device=w.device)
        w4 = w.reshape(g, p.cout_g, p.cin_g, taps).flip(3)
        buf[:, : geo.k].view(g, p.cin_g, taps, p.cout_g).copy_(w4.permute(0, 2, 3, 1))
        return buf

    return pack_transposed


def _common_reasons(p: ConvProblem) -> list[str]:
    """What every shifted-GEMM kernel needs: tensor-core dtypes, Hopper, stride 1, 32-bit offsets."""
    reasons = []
    if p.dtype not in ("float16", "bfloat16") and not p.tf32:
        reasons.append(f"needs fp16, bf16 or fp32 with TF32 tensor-core products (got {p.dtype})")
    if not INTERPRET and not _hopper():
        reasons.append("needs compute capability 9.0 or newer for tensor descriptors (TMA)")
    if p.stride != (1, 1, 1):
        reasons.append(f"needs stride 1 (got {p.stride[3 - p.nd :]})")
    if p.index_64:
        reasons.append("offsets past 2**31 (descriptor coordinates are 32-bit)")
    return reasons


def shifted_reasons(p: ConvProblem) -> list[str]:
    reasons = _common_reasons(p)
    geo = _Geometry(p)
    if geo.s_row is None:
        reasons.append("the source needs a dense channels-last layout (NHWC, NDHWC, NLC)")
    elif not _aligned(geo.s_row * itemsize(p.dtype)):
        reasons.append(f"the source's pixel rows need 16-byte alignment ({geo.s_row} channels)")
    if any(o > s for o, s in zip(geo.out_size, geo.src_size)):
        reasons.append(f"the output {geo.out_size} is larger than the source {geo.src_size} in a dimension")
    if p.groups > 1 and geo.ck % 16:
        reasons.append(f"grouped: needs a multiple of 16 channels per group (got {geo.ck})")
    elif p.taps > 1 and not _aligned(geo.ck * itemsize(p.dtype)):
        # Tap t's weights start at column t * channels: descriptor tiles start 16-byte aligned.
        reasons.append(f"several taps: needs 16-byte runs of channels per group (got {geo.ck})")
    return reasons


def _configs(p: ConvProblem, cols: int, ck: int) -> list[LaunchConfig]:
    """Tiles, the heuristic's pick first. PERSISTENT: one program per SM walks the tiles with the
    tile and K loops flattened, so the next tile's loads overlap this tile's epilogue: on an H100
    (bf16, N=64) that took 1x1 convolutions with one or four K steps from 128-150 us to 56-61 us,
    while masked (3x3) problems ran best as one program per tile."""
    if INTERPRET:
        shapes = [(32, 16, 16, 4, 1)]
    elif p.dtype == "float32":
        shapes = [(128, 128, 32, 8, 3), (128, 64, 32, 4, 3), (64, 128, 32, 4, 3)]
    else:
        # 128x256 and 256x128 tiles computed wrong sums on an H100 (Triton 3.6): not listed.
        shapes = [(128, 128, 64, 8, 4), (64, 128, 64, 4, 4), (256, 64, 64, 8, 3), (128, 64, 64, 4, 4)]
    if cols <= 64:
        shapes.sort(key=lambda s: s[1] != 64)
    if p.groups > 1:  # a K step must stay inside the group's channels
        shapes = [(bm, bn, math.gcd(bk, ck), w, s) for bm, bn, bk, w, s in shapes]
    tiles = [
        {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "num_warps": w, "num_stages": s}
        for bm, bn, bk, w, s in shapes
    ]
    plain = [{**c, "PERSISTENT": False} for c in tiles]
    persistent = [{**c, "PERSISTENT": True} for c in tiles[:2]]
    return plain + persistent if _Geometry(p).masked else persistent + plain


def _bind(p: ConvProblem, config: LaunchConfig, fallback: Callable[..., None]) -> Callable[..., None]:
    geo = _Geometry(p)
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    tiles = cdiv(geo.rows, bm) * cdiv(geo.cols, bn)
    programs = min(tiles, sm_count()) if config["PERSISTENT"] else tiles
    ints = (
        geo.rows,
        geo.cols,
        geo.ck,
        geo.src_channels,
        geo.s_row,
        geo.w_rows,
        geo.k,
        geo.w_row,
        *geo.src_size,
        *geo.out_size,
        *p.kernel,
        *geo.offsets,
        *p.dilation,
        *geo.out_strides[:1],
        geo.out_strides[1],
        *geo.out_strides[2:],
        1,
        row_limit(p),
        programs,
    )
    acc, precision, upcast = dot_constexprs(p)
    launch = launcher(
        _shifted_kernel,
        (programs, p.groups),
        num_tensors=7,
        ints=ints,
        constexprs=(
            *epilogue_constexprs(p),
            acc,
            precision,
            upcast,
            geo.masked,
            bm,
            bn,
            bk,
            config["GROUP_M"],
            config["PERSISTENT"],
        ),
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )
    pack = _pack_weights(p, geo)

    def run(src: torch.Tensor, w: torch.Tensor, out: torch.Tensor, *rest: Any) -> None:
        wm = pack(w)
        # Descriptors need 16-byte-aligned base addresses, which only the call knows.
        if (src.data_ptr() | wm.data_ptr()) & 15:
            fallback(src, w, out, *rest)
            return
        ensure_allocator()
        launch(src, wm, out, *rest)

    return run


def _cost(p: ConvProblem, config: LaunchConfig) -> float:
    geo = _Geometry(p)
    bn, bk = config["BLOCK_N"], config["BLOCK_K"]
    col_eff = geo.cols / (cdiv(geo.cols, bn) * bn)
    k_eff = geo.ck / (cdiv(geo.ck, bk) * bk)
    # The source grid's rows that fall outside the output are computed and dropped.
    grid_eff = math.prod(geo.out_size) / math.prod(geo.src_size)
    # Masked A tiles pass through registers: on an H100 (bf16 3x3, N=64, 64 to 512 channels)
    # that ran 10-40% slower than the gathered implicit GEMM, so the heuristic leaves those to it.
    compute, bandwidth = (0.45, 0.5) if geo.masked else (0.85, 0.75)
    return roofline(p.flops, p.bytes, peak(p), compute * col_eff * k_eff * grid_eff, bandwidth) + 4.0


@FAMILY.register
class ShiftedGemmEngine(Engine[ConvProblem]):
    """Stride-1 convolutions of channels-last tensors (Hopper): each tap's A tile is a block of
    pixel rows loaded by tensor descriptor, masked at image edges; weights by descriptor too."""

    name = "shifted_gemm"

    def not_supported_reasons(self, problem: ConvProblem) -> list[str]:
        return shifted_reasons(problem)

    def cost(self, problem: ConvProblem) -> float:
        return _cost(problem, self.configs(problem)[0])

    def configs(self, problem: ConvProblem) -> list[LaunchConfig]:
        return _configs(problem, problem.cout_g, problem.cin_g)

    def bind(self, problem: ConvProblem, config: LaunchConfig) -> Callable[..., None]:
        fallback = ImplicitGemmEngine()
        return _bind(problem, config, fallback.bind(problem, fallback.configs(problem)[0]))


@DGRAD_FAMILY.register
class ShiftedGemmDgradEngine(Engine[ConvProblem]):
    """Data gradient of a stride-1 convolution (channels-last): the shifted GEMM of the output
    gradient with the transposed, flipped weights."""

    name = "shifted_gemm"

    def not_supported_reasons(self, problem: ConvProblem) -> list[str]:
        return shifted_reasons(problem)

    def cost(self, problem: ConvProblem) -> float:
        return _cost(problem, self.configs(problem)[0]) + 3.0  # the weight pack

    def configs(self, problem: ConvProblem) -> list[LaunchConfig]:
        return _configs(problem, problem.cin_g, problem.cout_g)

    def bind(self, problem: ConvProblem, config: LaunchConfig) -> Callable[..., None]:
        fallback = ImplicitGemmDgradEngine()
        return _bind(problem, config, fallback.bind(problem, fallback.configs(problem)[0]))


def wgrad_reasons(p: ConvProblem) -> list[str]:
    reasons = _common_reasons(p)
    if p.out_size != p.in_size:
        reasons.append(f"needs the output grid to equal the input's ({p.out_size} vs {p.in_size})")
    size = itemsize(p.dtype)
    for name, channels, strides in (("x", p.cin, p.x_strides), ("dy", p.cout, p.y_strides)):
        row = rows_stride((p.n, channels, *p.in_size), strides)
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
        shapes = [(64, 64, 64, 4, 4), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4), (128, 128, 64, 8, 3)]
    fit_m = max(64, 1 << (p.cout_g - 1).bit_length())
    fit_n = max(64, 1 << (p.cin_g - 1).bit_length())
    shapes.sort(key=lambda s: (s[0] > fit_m) + (s[1] > fit_n))  # stable
    return [
        {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w, "num_stages": st}
        for bm, bn, bk, w, st in shapes
    ]


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
        # layer: 3x3 by 10-25% (masked dy tiles pass through registers), 1x1 by 17%, the 3x3x3
        # conv3d by 42%; still 0.25-0.4x cuDNN on the 3x3 layers, 0.9-1.0x on 1x1.
        masked = p.taps > 1 or any(p.pad)
        return roofline(p.flops, p.bytes, peak(p), 0.65 if masked else 0.8, 0.7) + 8.0

    def configs(self, problem: ConvProblem) -> list[LaunchConfig]:
        return _wgrad_configs(problem)

    def bind(self, problem: ConvProblem, config: LaunchConfig) -> Callable[..., None]:
        p = problem
        bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
        taps = p.taps
        pixels = p.n * math.prod(p.in_size)
        tiles = cdiv(p.cout_g, bm) * taps * cdiv(p.cin_g, bn)
        split = max(1, min(cdiv(2 * sm_count(), tiles * p.groups), cdiv(pixels, 4 * bk), 1024))
        chunk = cdiv(cdiv(pixels, split), bk) * bk
        split = cdiv(pixels, chunk)
        shape_x = (p.n, p.cin, *p.in_size)
        head = (
            pixels,
            p.cin_g,
            p.cout_g,
            p.cin,
            p.cout,
            rows_stride(shape_x, p.x_strides),
            rows_stride((p.n, p.cout, *p.in_size), p.y_strides),
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
        # dw contiguous (Cout, Cin_g, taps): group step Cout_g * ncols, row ncols, channel taps.
        direct = (0, p.cout_g * ncols, ncols, taps, 1)
        launch = launcher(_shifted_wgrad_kernel, grid, 3, (*head, *direct), consts, **opts)
        fallback = ImplicitGemmWgradEngine()
        slow = fallback.bind(p, fallback.configs(p)[0])

        def aligned(x: torch.Tensor, dy: torch.Tensor) -> bool:
            # Descriptors need 16-byte-aligned base addresses, which only the call knows.
            return not (x.data_ptr() | dy.data_ptr()) & 15

        if split == 1:

            def run_direct(x: torch.Tensor, dy: torch.Tensor, dw: torch.Tensor) -> None:
                if not aligned(x, dy):
                    return slow(x, dy, dw)
                ensure_allocator()
                launch(x, dy, dw)

            return run_direct
        partial = launcher(_shifted_wgrad_kernel, grid, 3, (*head, numel, *direct[1:]), consts, **opts)
        ws_dtype = torch.float64 if p.dtype == "float64" else torch.float32
        reduce = launcher(_sum_kernel, (cdiv(numel, 1024),), 2, (numel, split), (1024,))

        def run(x: torch.Tensor, dy: torch.Tensor, dw: torch.Tensor) -> None:
            if not aligned(x, dy):
                return slow(x, dy, dw)
            ensure_allocator()
            ws = torch.empty((split, numel), dtype=ws_dtype, device=x.device)
            partial(x, dy, ws)
            reduce(ws, dw)

        return run
