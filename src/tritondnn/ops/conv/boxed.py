"""Implicit GEMM whose image tiles are tensor-descriptor boxes (TMA), with no masks and no gathers.

A channels-last source is a 5-D tensor [N, D, H, W, C] to the copy engine. An output tile is a box
of BD x BH x BW pixels of one image; for tap (td, th, tw) and channels [c0, c0 + BLOCK_K) its
operand is the source box at (n, d0 + off_d + td * dl_d, h0 + ..., w0 + ..., c0): the copy engine
fills the positions outside the tensor (the padding) with zeros, so no element is masked or
addressed one by one. The box lands in shared memory as [BD * BH * BW, BLOCK_K] rows of channels,
which is the B operand of the MMA as it stands; so the kernel computes the transposed product,
``acc[cout, pixel] = W[cout, k] @ X[pixel, k]^T``, and the tensor cores read both operands from
shared memory (taking the box as the A operand would route it through registers).

Stride: a stride-s dimension is read through a view with s times the step and ceil(size / s)
positions, which holds every pixel a tap touches when all of the tap offsets are multiples of s
(1x1 stride-2 downsampling; 3x3 stride 2 with padding 1 is not such a case).

Forward and stride-1 data gradient (the convolution of dy with the transposed, flipped weights).
The cost of boxes: positions of a box past the output's edge are computed and dropped (at 56 and
28 pixels boxes of 8 and 32 fit exactly or waste 12%; at 14 and 7 a quarter).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from ...core.backend import INTERPRET, hopper, sm_count
from ...core.engine import Engine, LaunchConfig
from ...core.launcher import cdiv, ensure_allocator, launcher
from ...core.numerics import convert
from ...core.relayout import relayout
from ..epilogue import apply_epilogue
from ..matmul.kernels import dot, grouped
from .engines import (
    DGRAD_FAMILY,
    FAMILY,
    ImplicitGemmDgradEngine,
    ImplicitGemmEngine,
    channels_last_strides,
    dense_channels_first,
    dot_constexprs,
    epilogue_constexprs,
    peak,
    roofline,
    row_limit,
)
from .problem import ConvProblem, Strides5, Triple, itemsize


@triton.jit
def _box_origin(box, OD, OH, OW, IMAGES: tl.constexpr, BD: tl.constexpr, BH: tl.constexpr, BW: tl.constexpr):
    """First image and output position (n0, d0, h0, w0) of pixel box ``box`` (boxes run W fastest)."""
    boxes_w = tl.cdiv(OW, BW)
    boxes_h = tl.cdiv(OH, BH)
    boxes_d = tl.cdiv(OD, BD)
    w0 = (box % boxes_w) * BW
    rest = box // boxes_w
    h0 = (rest % boxes_h) * BH
    rest = rest // boxes_h
    d0 = (rest % boxes_d) * BD
    return (rest // boxes_d) * IMAGES, d0, h0, w0


@triton.jit
def _boxed_kernel(
    src_ptr, w_ptr, out_ptr, c_ptr, bias_ptr, res_ptr, pre_ptr,
    alpha, beta, p0, p1,
    N, SD, SH, SW, C_ALL, s_n, s_d, s_h, s_w,
    NCOLS, CK, W_ROWS, W_K, w_row,
    OD, OH, OW, TD, TH, TW, off_d, off_h, off_w, dl_d, dl_h, dl_w,
    o_n, o_c, o_d, o_h, o_w, s_bias, row_limit, programs,
    HAS_C: tl.constexpr, BIAS: tl.constexpr, ACT: tl.constexpr, RESIDUAL: tl.constexpr,
    STORE_PRE: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    W_T: tl.constexpr, IMAGES: tl.constexpr, BD: tl.constexpr, BH: tl.constexpr, BW: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, FLATTEN: tl.constexpr,
):  # fmt: skip
    """(IMAGES x BD x BH x BW pixels) x BLOCK_N output tiles of one group, ``programs`` programs
    walking them. Grid: (programs, groups). A box spans IMAGES images where the image is small:
    boxes whose extents divide the output's waste no computed positions.

    src: [N, SD, SH, SW, C_ALL] at strides (s_n, s_d, s_h, s_w, 1), this group's channels
    [g * CK, (g + 1) * CK). w: [W_ROWS, W_K] (row stride ``w_row``), row = output column of any
    group, column = tap * CK + channel; with W_T (the data gradient reading channels-last forward
    weights in place) row = reduction channel of any group, column = flipped tap * NCOLS + output
    column, loaded as [BLOCK_K, BLOCK_N] tiles. Output pixel o, tap t read the source at
    ``o + off + t * dl`` per dimension; outputs (OD, OH, OW) at strides ``o_*``. FLATTEN: Triton
    pipelines the tile and K loops as one (the next tile's loads overlap this tile's epilogue).
    """
    BM: tl.constexpr = IMAGES * BD * BH * BW
    src_desc = tl.make_tensor_descriptor(
        src_ptr, [N, SD, SH, SW, C_ALL], [s_n, s_d, s_h, s_w, 1], [IMAGES, BD, BH, BW, BLOCK_K]
    )
    if W_T:
        w_desc = tl.make_tensor_descriptor(w_ptr, [W_ROWS, W_K], [w_row, 1], [BLOCK_K, BLOCK_N])
    else:
        w_desc = tl.make_tensor_descriptor(w_ptr, [W_ROWS, W_K], [w_row, 1], [BLOCK_N, BLOCK_K])
    g = tl.program_id(1)
    tiles_m = tl.cdiv(N, IMAGES) * tl.cdiv(OD, BD) * tl.cdiv(OH, BH) * tl.cdiv(OW, BW)
    tiles_n = tl.cdiv(NCOLS, BLOCK_N)
    k_blocks = tl.cdiv(CK, BLOCK_K)
    steps = TD * TH * TW * k_blocks
    col0 = g * CK
    # The epilogue finds its tile from a counter of its own: with the loops flattened, what the top
    # of the body computes may already belong to the next tile.
    tile_done = tl.program_id(0) - programs
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, programs, flatten=FLATTEN):
        pid_m, pid_n = grouped(tile, tiles_m, tiles_n, GROUP_M)
        n0, d0, h0, w0 = _box_origin(pid_m, OD, OH, OW, IMAGES, BD, BH, BW)
        off_n = g * NCOLS + pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_N, BM), ACC)
        for i in range(steps):
            t = i // k_blocks
            c0 = (i - t * k_blocks) * BLOCK_K
            tw = t % TW
            th = (t // TW) % TH
            td = t // (TW * TH)
            box = src_desc.load(
                [n0, d0 + off_d + td * dl_d, h0 + off_h + th * dl_h, w0 + off_w + tw * dl_w, col0 + c0]
            )
            if W_T:
                b = w_desc.load([col0 + c0, (TD * TH * TW - 1 - t) * NCOLS + pid_n * BLOCK_N]).T
            else:
                b = w_desc.load([off_n, t * CK + c0])
            acc = dot(b, box.reshape(BM, BLOCK_K).T, acc, PRECISION, UPCAST)
        tile_done += programs
        pid_m, pid_n = grouped(tile_done, tiles_m, tiles_n, GROUP_M)
        n0, d0, h0, w0 = _box_origin(pid_m, OD, OH, OW, IMAGES, BD, BH, BW)
        pix = tl.arange(0, BM)
        ow = w0 + pix % BW
        oh = h0 + (pix // BW) % BH
        od = d0 + (pix // (BW * BH)) % BD
        n = n0 + pix // (BW * BH * BD)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = (n < N) & (od < OD) & (oh < OH) & (ow < OW)
        out_rows = tl.where(ok, n * o_n + od * o_d + oh * o_h + ow * o_w, row_limit)
        base = g * NCOLS * o_c
        y = apply_epilogue(
            tl.trans(acc), out_rows, cols, row_limit, NCOLS,
            c_ptr + base, 1, o_c, bias_ptr + g * NCOLS * s_bias, s_bias,
            res_ptr + base, 1, o_c, pre_ptr + base, 1, o_c,
            alpha, beta, p0, p1, HAS_C, BIAS, ACT, RESIDUAL, STORE_PRE,
        )  # fmt: skip
        out_ptrs = out_ptr + base + out_rows[:, None] + cols[None, :] * o_c
        tl.store(out_ptrs, convert(y, out_ptr.dtype.element_ty), mask=ok[:, None] & (cols < NCOLS)[None, :])


def descriptor_reasons(p: ConvProblem) -> list[str]:
    """What every tensor-descriptor kernel needs: tensor-core dtypes, Hopper, 32-bit offsets."""
    reasons = []
    if p.dtype not in ("float16", "bfloat16") and not p.tf32:
        reasons.append(f"needs fp16, bf16 or fp32 with TF32 tensor-core products (got {p.dtype})")
    if not INTERPRET and not hopper():
        reasons.append("needs compute capability 9.0 or newer for tensor descriptors (TMA)")
    if p.index_64:
        reasons.append("offsets past 2**31 (descriptor coordinates are 32-bit)")
    return reasons


class _Geometry:
    """What the kernel needs of one direction: the source (x forward, dy for the data gradient),
    the output grid, the per-dimension tap offsets and the weight matrix."""

    def __init__(self, p: ConvProblem) -> None:
        fwd = p.direction == "fwd"
        self.src_channels = p.cin if fwd else p.cout
        self.src_size = p.in_size if fwd else p.out_size
        self.out_size = p.out_size if fwd else p.in_size
        self.src_strides = p.x_strides if fwd else p.y_strides
        # A dense channels-first 16-bit source (NCL, NCHW, NCDHW) is copied channels-last per call
        # (``staged``): the boxes need the channels innermost. The data gradient stages only for
        # 128 or more input channels: H100, bf16, N=64, 3x3 NCHW dgrad 64 @56 staged 196 us
        # against the gathered GEMM's 98; 256 @14 64 against 113, conv1d k5 512 NCL 357 against 833.
        self.staged = (
            (fwd or p.cin_g >= 128)
            and p.dtype in ("float16", "bfloat16")
            and self.src_channels > 1
            and dense_channels_first((p.n, self.src_channels, *self.src_size), self.src_strides)
        )
        if self.staged:
            self.src_strides = channels_last_strides(self.src_channels, self.src_size)
        self.out_strides = p.y_strides if fwd else p.x_strides
        self.cols = p.cout_g if fwd else p.cin_g  # output columns per group
        self.ck = p.cin_g if fwd else p.cout_g  # reduction channels per group
        if fwd:
            self.offsets = tuple(-q for q in p.pad)
        else:  # the flipped kernel's padding is (k - 1) * d - pad
            self.offsets = tuple(q - (k - 1) * d for q, k, d in zip(p.pad, p.kernel, p.dilation))
        self.stride = p.stride if fwd else (1, 1, 1)
        # Channels-last weights are the matrix [Cout, taps * Cin_g] as they stand: the forward reads
        # it in place, the data gradient too, transposed in the kernel (``W_T``). Others are packed
        # per call into the matrix the forward reads, or its flipped transpose.
        self.w_inplace = _weights_in_place(p)
        self.w_transposed = self.w_inplace and not fwd
        k = p.taps * self.ck
        pad_to = 16 // itemsize(p.dtype)
        if self.w_inplace:  # rows, columns, row stride
            self.weights = (p.cout, p.taps * p.cin_g, p.w_strides[0])
        else:
            self.weights = (p.cout if fwd else p.cin, k, cdiv(k, pad_to) * pad_to)


def _weights_in_place(p: ConvProblem) -> bool:
    """Whether weights (Cout, Cin_g, *kernel) already are the matrix [Cout, taps * Cin_g] with
    16-byte-aligned rows: channels-last weights."""
    wo, wc, wd, wh, ww = p.w_strides
    kd, kh, kw = p.kernel
    ck = p.cin_g
    ok = (ck == 1 or wc == 1) and (kw == 1 or ww == ck) and (kh == 1 or wh == kw * ck)
    ok = ok and (kd == 1 or wd == kh * kw * ck)
    return ok and (p.cout == 1 or wo >= p.taps * ck) and wo * itemsize(p.dtype) % 16 == 0


def _pack_weights(p: ConvProblem, geo: _Geometry) -> Callable[[torch.Tensor], torch.Tensor]:
    """w (Cout, Cin_g, *kernel) -> the kernel's weight matrix: forward [Cout, taps * Cin_g]; data
    gradient [Cin, taps * Cout_g], taps reversed (rows padded to 16 bytes, the pad never read)."""
    if geo.w_inplace:
        return lambda w: w
    taps, g = p.taps, p.groups
    dtype = getattr(torch, p.dtype)
    rows, k, row = geo.weights

    if p.direction == "fwd":

        def pack(w: torch.Tensor) -> torch.Tensor:
            buf = torch.empty((rows, row), dtype=dtype, device=w.device)
            w3 = w.reshape(p.cout, p.cin_g, taps)
            buf[:, :k].view(p.cout, taps, p.cin_g).copy_(w3.transpose(1, 2))
            return buf

        return pack

    def pack_transposed(w: torch.Tensor) -> torch.Tensor:
        buf = torch.empty((rows, row), dtype=dtype, device=w.device)
        w4 = w.reshape(g, p.cout_g, p.cin_g, taps).flip(3)
        buf[:, :k].view(g, p.cin_g, taps, p.cout_g).copy_(w4.permute(0, 2, 3, 1))
        return buf

    return pack_transposed


class SourceView:
    """A channels-last tensor (N, C, D, H, W) as the 5-D descriptor the copy engine reads: with
    ``stride`` > 1 a view of every stride-th position, in whose steps the tap offsets and
    dilations are given (``on_view``: whether they are whole steps, so that every tap lands on it)."""

    def __init__(
        self,
        n: int,
        channels: int,
        size: Triple,
        strides: Strides5,
        stride: Triple,
        offsets: Triple,
        kernel: Triple,
        dilation: Triple,
    ) -> None:
        n_step, c_step, *steps = strides
        self.channel_step = c_step if channels > 1 else 1
        self.on_view = all(
            o % s == 0 and (k == 1 or d % s == 0) for o, s, k, d in zip(offsets, stride, kernel, dilation)
        )
        self.size = tuple(cdiv(count, s) for count, s in zip(size, stride))
        self.offsets = tuple(o // s for o, s in zip(offsets, stride))
        self.dilation = tuple(d // s if k > 1 else 0 for d, s, k in zip(dilation, stride, kernel))
        # A dimension of one position gets the step of the dimensions inside it: the descriptor
        # wants every step a multiple of 16 bytes, and never reads it.
        inner = channels
        view_steps = []
        for count, step, s in reversed(list(zip(self.size, steps, stride))):
            step = step * s if count > 1 else inner
            view_steps.append(step)
            inner = step * count
        self.steps = (n_step if n > 1 else inner, *reversed(view_steps))

    def reasons(self, name: str, dtype: str) -> list[str]:
        reasons = []
        if self.channel_step != 1:
            reasons.append(f"{name} needs its channels innermost (channels-last)")
        if any(s * itemsize(dtype) % 16 for s in self.steps):
            reasons.append(f"{name}'s pixel steps need to be multiples of 16 bytes (steps {self.steps})")
        if not self.on_view:
            reasons.append("stride > 1: needs every tap offset (padding, dilation) a multiple of the stride")
        return reasons


def _source_view(p: ConvProblem, geo: _Geometry) -> SourceView:
    return SourceView(
        p.n, geo.src_channels, geo.src_size, geo.src_strides, geo.stride, geo.offsets, p.kernel, p.dilation
    )


def boxed_reasons(p: ConvProblem) -> list[str]:
    reasons = descriptor_reasons(p)
    geo = _Geometry(p)
    if p.direction != "fwd" and p.stride != (1, 1, 1):
        reasons.append(f"data gradient: needs stride 1 (got {p.stride[3 - p.nd :]})")
    reasons += _source_view(p, geo).reasons("the source", p.dtype)
    size = itemsize(p.dtype)
    if p.groups > 1 and geo.ck % 16:
        reasons.append(f"grouped: needs a multiple of 16 channels per group (got {geo.ck})")
    elif p.taps > 1 and geo.ck * size % 16:
        # Tap t's weights start at column t * channels: descriptor tiles start 16-byte aligned.
        reasons.append(f"several taps: needs 16-byte runs of channels per group (got {geo.ck})")
    return reasons


Box = tuple[int, int, int, int]  # (images, BD, BH, BW)


def pixel_box(batch: int, out_size: tuple[int, int, int], pixels: int) -> Box:
    """(images, BD, BH, BW) with images * BD * BH * BW = pixels (powers of two) that wastes the
    fewest computed positions past the output's edges; of equals, the fewest images, then the
    widest rows. A box spans several images where that wastes less: at 7x7 one image's 8x8 box
    fills 77%, 16 images' 1x8 rows 88%; at 14x14 and 28x28, 32 images' 2x2 and 16 images' 4x4
    squares fill all (8x16 and 8x32 boxes: 77%)."""
    best: tuple[float, int, int, Box] | None = None
    exps = int(math.log2(pixels))
    for en in range(exps + 1):
        for ew in range(exps + 1 - en):
            for eh in range(exps + 1 - en - ew):
                box = (1 << en, 1 << (exps - en - ew - eh), 1 << eh, 1 << ew)
                key = (box_use(batch, out_size, box), -box[0], box[3])
                if best is None or key > best[:3]:
                    best = (*key, box)
    assert best is not None
    return best[3]


def box_use(batch: int, out_size: tuple[int, int, int], box: Box) -> float:
    """The share of a box's positions that fall inside the output."""
    return math.prod(o / (cdiv(o, b) * b) for o, b in zip((batch, *out_size), box))


def _fitted_pixels(batch: int, out_size: tuple[int, int, int], pixels: int) -> int:
    """``pixels``, or fewer (down to 64) where a smaller box wastes far fewer positions."""
    options = [q for q in (pixels, pixels // 2, pixels // 4) if q >= 64] or [pixels]
    uses = {q: box_use(batch, out_size, pixel_box(batch, out_size, q)) for q in options}
    return next(q for q in options if uses[q] >= 0.8 * max(uses.values()))


def _pixel_tiles(p: ConvProblem, geo: _Geometry, pixels: int) -> int:
    """How many boxes of (about) ``pixels`` positions cover the output."""
    pixels = _fitted_pixels(p.n, geo.out_size, pixels)
    box = pixel_box(p.n, geo.out_size, pixels)
    return math.prod(cdiv(size, b) for size, b in zip((p.n, *geo.out_size), box))


def _tiles(p: ConvProblem, geo: _Geometry) -> list[tuple[int, int, int, int]]:
    """(pixels per tile, BLOCK_N, BLOCK_K, persistent programs a multiprocessor), the heuristic's
    pick first. On an H100 (bf16, N=64, ResNet-50's layers, `scratch/fwd/images_sweep.py`):

    - 64 output channels: 128 x 64 tiles two programs a multiprocessor (one's epilogue overlapping
      the other's loop) beat 256 x 64 ones alone with bias and ReLU (3x3 64 @56: 76.5 -> 65.2 us);
      gradients keep 256 x 64 (not told apart from run-to-run noise).
    - Many tiles (two waves or more of 128 x 256): 128 x 256, one program a multiprocessor (1x1
      64->256 @56: 52.7 us; 128 x 128 56.1).
    - Otherwise 128 x 128, with two programs a multiprocessor where that takes a wave off: a
      multiprocessor runs two tiles at once in 1.7 times one's time (3x3 256 @14, 196 tiles: two
      a multiprocessor 38.5 us, one 44.5; 3x3 128 @28, 392 tiles: 41.4 and 38.4; 3x3 512 @7, 112
      tiles: 51.8 and 41.1; 1x1 s2 1024->2048 @14, 448 tiles: 34.5 and 37.7).
    """
    if p.dtype == "float32":
        return [(128, 128, 32, 1), (64, 128, 32, 1), (128, 64, 32, 1)]
    cols, sms = geo.cols, sm_count()
    if cols <= 64:
        first = (128, 64, 2) if p.direction == "fwd" else (256, 64, 1)
    elif cols >= 256 and cdiv(cols, 256) * _pixel_tiles(p, geo, 128) >= 2 * sms:
        first = (128, 256, 1)
    else:
        tiles = cdiv(cols, 128) * _pixel_tiles(p, geo, 128)
        first = (128, 128, 2 if 1.7 * cdiv(tiles, 2 * sms) < cdiv(tiles, sms) else 1)
    options: list[tuple[int, int, int, int]] = []
    for pixels, bn, per_sm in (first, (128, 128, 1), (128, 256, 1), (256, 128, 1), (256, 64, 1)):
        if not any(t[:2] == (pixels, bn) for t in options) and bn <= max(64, 2 * cols):
            options.append((pixels, bn, 64, per_sm))
    return options


def _configs(p: ConvProblem) -> list[LaunchConfig]:
    """Persistent tiles first: with loops this short (9 K steps for a 3x3 with 64 channels) the
    next tile's loads overlapping this one's epilogue took ResNet-50's layers from 0.65-0.8x to
    0.8-1.0x cuDNN on an H100."""
    geo = _Geometry(p)
    configs = []
    for pixels, bn, bk, per_sm in [(16, 16, 16, 1)] if INTERPRET else _tiles(p, geo):
        if p.groups > 1:  # a K step must stay inside the group's channels
            bk = math.gcd(bk, geo.ck)
        else:  # no wider than the channels (a space-to-depth stem's 16)
            bk = min(bk, max(16, 1 << (geo.ck - 1).bit_length()))
        pixels = _fitted_pixels(p.n, geo.out_size, pixels)
        images, bd, bh, bw = pixel_box(p.n, geo.out_size, pixels)
        stage = (pixels + bn) * bk * itemsize(p.dtype)
        # Shared memory a program: 160 KB leaves the epilogue's layout conversions room (128 x 256
        # tiles in 4 stages with a channels-first output asked 262 KB); two a multiprocessor, 100.
        budget = (160 if per_sm == 1 else 100) * 1024
        configs.append(
            {"IMAGES": images, "BD": bd, "BH": bh, "BW": bw, "BLOCK_N": bn, "BLOCK_K": bk}
            | {"GROUP_M": 8, "PERSISTENT": True, "PER_SM": per_sm}
            | {"num_warps": 8 if pixels * bn >= 32768 else 4}
            | {"num_stages": 1 if INTERPRET else 4 if 4 * stage <= budget else 3}
        )
    return [configs[0], {**configs[0], "PERSISTENT": False}, *configs[1:]]


def _bind(p: ConvProblem, config: LaunchConfig, fallback: Callable[..., None]) -> Callable[..., None]:
    geo = _Geometry(p)
    view = _source_view(p, geo)
    images, bd, bh, bw, bn = (config[k] for k in ("IMAGES", "BD", "BH", "BW", "BLOCK_N"))
    od, oh, ow = geo.out_size
    tiles = cdiv(p.n, images) * cdiv(od, bd) * cdiv(oh, bh) * cdiv(ow, bw) * cdiv(geo.cols, bn)
    programs = min(tiles, config["PER_SM"] * sm_count()) if config["PERSISTENT"] else tiles
    ints = (
        p.n,
        *view.size,
        geo.src_channels,
        *view.steps,
        geo.cols,
        geo.ck,
        *geo.weights,
        *geo.out_size,
        *p.kernel,
        *view.offsets,
        *view.dilation,
        geo.out_strides[0],
        geo.out_strides[1],
        *geo.out_strides[2:],
        1,
        row_limit(p),
        programs,
    )
    acc, precision, upcast = dot_constexprs(p)
    launch = launcher(
        _boxed_kernel,
        (programs, p.groups),
        num_tensors=7,
        ints=ints,
        constexprs=(
            *epilogue_constexprs(p),
            acc,
            precision,
            upcast,
            geo.w_transposed,
            images,
            bd,
            bh,
            bw,
            bn,
            config["BLOCK_K"],
            config["GROUP_M"],
            config["PERSISTENT"],
        ),
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )
    pack = _pack_weights(p, geo)
    if geo.staged:  # the source (n, c, D * H, W), dense either way
        d, h, w_ = geo.src_size
        c = geo.src_channels
        stage = relayout(
            p.n, c, d * h, w_, (c * d * h * w_, d * h * w_, w_, 1), geo.src_strides[:2] + geo.src_strides[3:]
        )
        numel = p.n * c * d * h * w_
        dtype = getattr(torch, p.dtype)

    def run(src: torch.Tensor, w: torch.Tensor, out: torch.Tensor, *rest: Any) -> None:
        wm = pack(w)
        # Descriptors need 16-byte-aligned base addresses, which only the call knows.
        if (src.data_ptr() | wm.data_ptr()) & 15:
            fallback(src, w, out, *rest)
            return
        if geo.staged:
            staged = torch.empty(numel, dtype=dtype, device=src.device)
            stage(src, staged)
            src = staged
        ensure_allocator()
        launch(src, wm, out, *rest)

    return run


def _cost(p: ConvProblem) -> float:
    geo = _Geometry(p)
    bn = _tiles(p, geo)[0][1]
    col_eff = geo.cols / (cdiv(geo.cols, bn) * bn)
    k_eff = geo.ck / (cdiv(geo.ck, 64) * 64) if geo.ck >= 64 else 0.6
    use = box_use(p.n, geo.out_size, pixel_box(p.n, geo.out_size, _fitted_pixels(p.n, geo.out_size, 128)))
    # On an H100 (bf16, ResNet-50's layers) 1.2-1.8x the gathered implicit GEMM's speed, wasted
    # positions included; that engine's cost counts 0.75 of the peak.
    cost = roofline(p.flops, p.bytes, peak(p), min(1.0, 1.1 * col_eff * k_eff * use), 0.75) + 4.0
    if geo.staged:  # the channels-last copy of the source: read and written once more
        nbytes = 2 * p.n * math.prod(geo.src_size) * geo.src_channels * itemsize(p.dtype)
        cost += roofline(0, nbytes, 1.0, 1.0, 0.75) + 4.0
    return cost


@FAMILY.register
class BoxedGemmEngine(Engine[ConvProblem]):
    """Channels-last convolutions (Hopper) whose image tiles are tensor-descriptor boxes: padding
    filled by the copy engine, both MMA operands straight from shared memory."""

    name = "boxed_gemm"

    def not_supported_reasons(self, problem: ConvProblem) -> list[str]:
        return boxed_reasons(problem)

    def cost(self, problem: ConvProblem) -> float:
        return _cost(problem)

    def configs(self, problem: ConvProblem) -> list[LaunchConfig]:
        return _configs(problem)

    def bind(self, problem: ConvProblem, config: LaunchConfig) -> Callable[..., None]:
        fallback = ImplicitGemmEngine()
        return _bind(problem, config, fallback.bind(problem, fallback.configs(problem)[0]))


@DGRAD_FAMILY.register
class BoxedGemmDgradEngine(Engine[ConvProblem]):
    """Data gradient of a stride-1 channels-last convolution: the boxed GEMM of the output
    gradient with the transposed, flipped weights."""

    name = "boxed_gemm"

    def not_supported_reasons(self, problem: ConvProblem) -> list[str]:
        return boxed_reasons(problem)

    def cost(self, problem: ConvProblem) -> float:
        # Packing the flipped transpose per call. (Forward costs leave out their packs: this
        # engine's and the gathered engine's repack of contiguous weights cost about the same.)
        return _cost(problem) + (0.0 if _Geometry(problem).w_inplace else 3.0)

    def configs(self, problem: ConvProblem) -> list[LaunchConfig]:
        return _configs(problem)

    def bind(self, problem: ConvProblem, config: LaunchConfig) -> Callable[..., None]:
        fallback = ImplicitGemmDgradEngine()
        return _bind(problem, config, fallback.bind(problem, fallback.configs(problem)[0]))
