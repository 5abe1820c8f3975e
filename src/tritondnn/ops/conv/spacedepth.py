"""Strided convolutions with few input channels (the 7x7 stride-2 stem of ResNets) as stride-1
convolutions over a space-to-depth copy of x: forward and data gradient on the boxed GEMM, weight
gradient on the shifted GEMM (Hopper, 16-bit).

A stride-s convolution reads x at ``s * o + t - pad`` for output o and tap t. With t = s * a + b
(0 <= b < s) that is ``s * (o + a) + b - pad``; so with

    z[n, (b, c), i] = x[n, c, s * i + b - pad]   (zero outside x)

the convolution is a stride-1, unpadded one over z, with ceil(k / s) taps and s * C channels per
dimension, of the weights ``w'[co, (b, c), a] = w[co, c, s * a + b]`` (zero for s * a + b >= k).
Along W the taps are folded into the channels as well: a z pixel holds the window of
ceil(KW / SW) * SW positions of x that its output reads, so the convolution over z has taps along
D and H only, and K steps of whole runs of channels. The stem (3 channels, 7x7, stride 2, padding
3) becomes a 4x1 convolution over 48 channels (b_h, 8 window positions, c) at 115x112: the boxed
GEMM takes it, its descriptor boxes loading whole tiles with no gathers, which x itself rules out
(6-byte pixels; stride-2 taps at odd offsets). The price: 4 * 64 = 256 products an output (the K
steps padded to 64) against the direct algorithm's 147, and z written and read once (79 MB for
the stem at N=64, against y's 103 MB). Measured on an H100 (bf16, N=64), against cuDNN: forward
159 us / 465, data gradient 168 / 1488, weight gradient 260 / 318.

An x element that is inf or NaN reaches the outputs of every z copy of it, also through the taps
past k (zero weights: 0 * inf); the direct algorithm confines it to the outputs that read it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ...core.engine import Engine, LaunchConfig
from ...core.launcher import cdiv, launcher
from ...core.relayout import relayout
from . import boxed, shifted
from .engines import DGRAD_FAMILY, FAMILY, WGRAD_FAMILY, channels_last_strides, peak, roofline
from .kernels import output_pixel
from .problem import ConvProblem, itemsize

# Space-to-depth channels past this and the channels-last x has runs enough for the boxed GEMM's
# K steps as it stands (or the gathered implicit GEMM's).
MAX_CHANNELS = 64


@triton.jit
def _space_to_depth_kernel(
    x_ptr, z_ptr, ROWS, ID, IH, IW, ZD, ZH, ZW, x_n, x_c, x_d, x_h, x_w, PD, PH, PW,
    C: tl.constexpr, RUN: tl.constexpr, PAD_C: tl.constexpr,
    SD: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
    INDEX_64: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """z (dense channels-last, SD * SH * RUN + PAD_C channels a pixel) from x at strides ``x_*``.

    A z pixel (n, i_d, i_h, i_w) holds SD * SH runs (b_d, b_h) of RUN = WINDOW * C elements,
    element r = j * C + c of run (b_d, b_h) being x[n, c, SD * i_d + b_d - PD, SH * i_h + b_h - PH,
    SW * i_w + j - PW] (zero outside x), then PAD_C zeros. A program fills BLOCK_Q of the ROWS
    (pixel, run) pairs. The sizes are compile-time constants: the divisions by C are
    multiplications, and z's row offsets are known multiples of 16 bytes, so stores are vectors
    (on an H100 the stem's copy took 130 us with them run-time values; a plain copy of z, 58).
    """
    q = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    if INDEX_64:
        q = q.to(tl.int64)
    runs = SD * SH
    b = q % runs
    pix = q // runs
    n, i_d, ih, iw = output_pixel(pix, ZD, ZH, ZW)
    d = i_d * SD + b // SH - PD
    h = ih * SH + b % SH - PH
    w0 = iw * SW - PW
    row_ok = (q < ROWS) & (d >= 0) & (d < ID) & (h >= 0) & (h < IH)
    r = tl.arange(0, BLOCK_R)
    base = n * x_n + d * x_d + h * x_h
    w = w0[:, None] + (r // C)[None, :]
    ok = row_ok[:, None] & (r < RUN)[None, :] & (w >= 0) & (w < IW)
    src = x_ptr + base[:, None] + (r % C)[None, :] * x_c + w * x_w
    values = tl.load(src, mask=ok, other=0)
    dst = z_ptr + (pix * (runs * RUN + PAD_C) + b * RUN)[:, None] + r[None, :]
    if PAD_C == 0:
        in_run = (r < RUN)[None, :]
    else:  # the last run of a pixel also writes the pixel's PAD_C zero channels
        in_run = r[None, :] < (RUN + tl.where(b == runs - 1, PAD_C, 0))[:, None]
    tl.store(dst, values, mask=(q < ROWS)[:, None] & in_run)


@triton.jit
def _depth_to_space_kernel(
    dz_ptr, dx_ptr, GROUPS, ID, IH, IW, ZD, ZH, ZW, GW, x_n, x_c, x_d, x_h, x_w, PD, PH, PW,
    C: tl.constexpr, RUN: tl.constexpr, PAD_C: tl.constexpr,
    SD: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
    INDEX_64: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """The adjoint of ``_space_to_depth_kernel``: dx[n, c, d, h, w] (at strides ``x_*``) = the sum
    of the z gradient's elements that copied x[n, c, d, h, w].

    A program takes BLOCK_G of the GROUPS groups (n, d, h, g) of SW consecutive x positions along
    W, w = g * SW - PW + e // C for e = local * C + c: the group's SW * C elements are one
    contiguous run of each of the RUN / (C * SW) z pixels g - t that hold it (at run offset
    SW * t * C), so loads come in runs of SW * C elements."""
    grp = tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)
    if INDEX_64:
        grp = grp.to(tl.int64)
    n, d, h, g = output_pixel(grp, ID, IH, GW)
    i_d = (d + PD) // SD
    i_h = (h + PH) // SH
    run0 = (((d + PD) % SD) * SH + (h + PH) % SH) * RUN
    row_ok = (grp < GROUPS) & (i_d < ZD) & (i_h < ZH)
    e = tl.arange(0, BLOCK_E)
    acc = tl.zeros((BLOCK_G, BLOCK_E), tl.float32)
    for t in tl.static_range(RUN // (C * SW)):
        i_w = g - t
        ok = row_ok & (i_w >= 0) & (i_w < ZW)
        src = (((n * ZD + i_d) * ZH + i_h) * ZW + i_w) * (SD * SH * RUN + PAD_C) + run0 + t * SW * C
        mask = ok[:, None] & (e < SW * C)[None, :]
        acc += tl.load(dz_ptr + src[:, None] + e[None, :], mask=mask, other=0).to(tl.float32)
    w = (g * SW - PW)[:, None] + (e // C)[None, :]
    dst = dx_ptr + (n * x_n + d * x_d + h * x_h)[:, None] + w * x_w + (e % C)[None, :] * x_c
    ok = (grp < GROUPS)[:, None] & (e < SW * C)[None, :] & (w >= 0) & (w < IW)
    tl.store(dst, acc.to(dx_ptr.dtype.element_ty), mask=ok)


def _window(p: ConvProblem) -> int:
    """The W positions of x a z pixel holds: ceil(KW / SW) taps of SW positions each."""
    return cdiv(p.kernel[2], p.stride[2]) * p.stride[2]


def _z_channels(p: ConvProblem) -> tuple[int, int]:
    """z's channels (b_d, b_h, W position, c), and that rounded up to 16-byte pixel steps."""
    channels = p.stride[0] * p.stride[1] * _window(p) * p.cin
    per_pixel = 16 // itemsize(p.dtype)
    return channels, cdiv(channels, per_pixel) * per_pixel


def stride_one_problem(p: ConvProblem) -> ConvProblem:
    """The stride-1, unpadded convolution over z that equals ``p`` (taps along D and H only)."""
    kd, kh = (cdiv(k, s) for k, s in zip(p.kernel[:2], p.stride[:2]))
    od, oh, ow = p.out_size
    zc = _z_channels(p)[1]
    z_size = (od + kd - 1, oh + kh - 1, ow)
    return dataclasses.replace(
        p,
        cin=zc,
        in_size=z_size,
        kernel=(kd, kh, 1),
        stride=(1, 1, 1),
        pad=(0, 0, 0),
        x_strides=channels_last_strides(zc, z_size),
        w_strides=(kd * kh * zc, 1, kh * zc, zc, zc),
    )


def _weight_index(p: ConvProblem) -> torch.Tensor:
    """For each column (a_d, a_h, c') of z's weight matrix [Cout, taps' * C'], the column of w's
    [Cout, C * taps] it copies, or C * taps (a zero appended to each row) where it has none."""
    s, k = p.stride, p.kernel
    kd, kh = (cdiv(ki, si) for ki, si in zip(k[:2], s[:2]))
    window = _window(p)
    index = torch.full((kd, kh, _z_channels(p)[1]), p.cin * p.taps, dtype=torch.long)
    for a_d, a_h, b_d, b_h, t_w in torch.cartesian_prod(
        *(torch.arange(n) for n in (kd, kh, s[0], s[1], min(k[2], window)))
    ).tolist():
        t_d, t_h = s[0] * a_d + b_d, s[1] * a_h + b_h
        if t_d < k[0] and t_h < k[1]:
            tap = (t_d * k[1] + t_h) * k[2] + t_w
            first = ((b_d * s[1] + b_h) * window + t_w) * p.cin
            index[a_d, a_h, first : first + p.cin] = torch.arange(p.cin) * p.taps + tap
    return index.flatten()


def _shape_reasons(p: ConvProblem) -> list[str]:
    """What every direction needs of the convolution itself (16-bit: TF32 is not measured)."""
    reasons = boxed.descriptor_reasons(p)
    if p.dtype not in ("float16", "bfloat16") and not reasons:
        reasons.append(f"needs fp16 or bf16 (got {p.dtype} with TF32)")
    if p.stride == (1, 1, 1):
        reasons.append("needs a stride > 1")
    if p.groups != 1:
        reasons.append(f"needs groups == 1 (got {p.groups})")
    if p.dilation != (1, 1, 1):
        reasons.append(f"needs dilation 1 (got {p.dilation[3 - p.nd :]})")
    if _z_channels(p)[1] > MAX_CHANNELS:
        reasons.append(
            f"ceil(KW / stride) * stride^d * channels at most {MAX_CHANNELS} (got "
            f"{_z_channels(p)[0]}): wider inputs have runs of channels enough to be read in place"
        )
    if not reasons and stride_one_problem(p).index_64:
        reasons.append("the space-to-depth copy spans 2**31 elements or more")
    return reasons


def space_to_depth_reasons(p: ConvProblem) -> list[str]:
    """The forward's and the data gradient's: the boxed GEMM takes the convolution over z."""
    return _shape_reasons(p) or boxed.boxed_reasons(stride_one_problem(p))


@FAMILY.register
class SpaceToDepthEngine(Engine[ConvProblem]):
    """Strided convolutions with few input channels: a space-to-depth copy of x, then the boxed
    GEMM's stride-1 convolution over it (Hopper, 16-bit)."""

    name = "space_to_depth"

    def not_supported_reasons(self, problem: ConvProblem) -> list[str]:
        return space_to_depth_reasons(problem)

    def cost(self, problem: ConvProblem) -> float:
        # Measured, H100, the stem (N=64, bf16): the copy 37 us for its 98 MB (x read, z
        # written), the boxed GEMM over z at 0.4 of the peak (101-107 us for 26 GFLOP).
        q = stride_one_problem(problem)
        copy = (problem.in_pixels * problem.cin + q.in_pixels * q.cin) * itemsize(q.dtype)
        return roofline(q.flops, q.bytes, peak(q), 0.4, 0.75) + roofline(0, copy, 1.0, 1.0, 0.85) + 8.0

    def configs(self, problem: ConvProblem) -> list[LaunchConfig]:
        """The boxed GEMM's tiles over z, 256-pixel ones first where the output has at most 64
        channels (the stem: 256 x 64 tiles one a multiprocessor 10-20 us ahead of 128 x 64 ones
        two a multiprocessor)."""
        q = stride_one_problem(problem)
        configs = boxed.BoxedGemmEngine().configs(q)
        wide = [c for c in configs if c["IMAGES"] * c["BD"] * c["BH"] * c["BW"] == 256 and c["BLOCK_N"] == 64]
        if q.cout <= 64 and wide:
            configs.remove(wide[0])
            configs.insert(0, wide[0])
        return configs

    def bind(self, problem: ConvProblem, config: LaunchConfig) -> Callable[..., None]:
        p, q = problem, stride_one_problem(problem)
        gemm = boxed.BoxedGemmEngine().bind(q, config)
        stage, pack = _stager(p, q), _weight_packer(p)

        def run(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, *rest: Any) -> None:
            gemm(stage(x), pack(w), out, *rest)

        return run


@DGRAD_FAMILY.register
class SpaceToDepthDgradEngine(Engine[ConvProblem]):
    """The data gradient of a strided convolution with few input channels: the boxed GEMM's data
    gradient of the stride-1 convolution over z, then each x element's z copies summed."""

    name = "space_to_depth"

    def not_supported_reasons(self, problem: ConvProblem) -> list[str]:
        p = problem
        reasons = space_to_depth_reasons(p)
        if p.bias or p.has_c or p.residual or p.activation != -1 or p.store_pre:
            reasons.append("no fused epilogue")
        return reasons

    def cost(self, problem: ConvProblem) -> float:
        # As the forward's: the GEMM at 0.4 of the peak, z's gradient written and read once more.
        q = stride_one_problem(problem)
        traffic = (2 * q.in_pixels * q.cin + problem.in_pixels * problem.cin) * itemsize(q.dtype)
        return roofline(q.flops, q.bytes, peak(q), 0.4, 0.75) + roofline(0, traffic, 1.0, 1.0, 0.6) + 8.0

    def configs(self, problem: ConvProblem) -> list[LaunchConfig]:
        return boxed.BoxedGemmDgradEngine().configs(stride_one_problem(problem))

    def bind(self, problem: ConvProblem, config: LaunchConfig) -> Callable[..., None]:
        p, q = problem, stride_one_problem(problem)
        gemm = boxed.BoxedGemmDgradEngine().bind(q, config)
        unstage, pack = _unstager(p, q), _weight_packer(p)
        dz_numel = q.in_pixels * q.cin

        def run(dy: torch.Tensor, w: torch.Tensor, dx: torch.Tensor, *rest: Any) -> None:
            dz = torch.empty(dz_numel, dtype=dx.dtype, device=dx.device)
            gemm(dy, pack(w), dz, *rest)
            unstage(dz, dx)

        return run


@WGRAD_FAMILY.register
class SpaceToDepthWgradEngine(Engine[ConvProblem]):
    """The weight gradient of a strided convolution with few input channels: the shifted GEMM's
    weight gradient of the stride-1 convolution over z, against dy padded with zero rows to z's
    grid (the shifted GEMM pairs dy's and z's pixels by one shift), gathered back into w's order."""

    name = "space_to_depth"

    def not_supported_reasons(self, problem: ConvProblem) -> list[str]:
        return _shape_reasons(problem) or shifted.wgrad_reasons(_same_grid_problem(problem))

    def cost(self, problem: ConvProblem) -> float:
        # The GEMM as the shifted engine's own cost, plus the copies: x -> z, dy into its padded
        # copy (read and written), at the forward copy's measured rate. (H100, the bf16 stem at
        # N=64: 260 us, of which the GEMM and its sum 131, z 37, dy's copy 65.)
        p, q = problem, _same_grid_problem(problem)
        copies = p.in_pixels * p.cin + q.in_pixels * q.cin + p.out_pixels * p.cout + q.in_pixels * p.cout
        return shifted.ShiftedGemmWgradEngine().cost(q) + roofline(
            0, copies * itemsize(p.dtype), 1.0, 1.0, 0.85
        )

    def configs(self, problem: ConvProblem) -> list[LaunchConfig]:
        return shifted.ShiftedGemmWgradEngine().configs(_same_grid_problem(problem))

    def bind(self, problem: ConvProblem, config: LaunchConfig) -> Callable[..., None]:
        p, q = problem, _same_grid_problem(problem)
        gemm = shifted.ShiftedGemmWgradEngine().bind(q, config)
        stage = _stager(p, q)
        z_grid = q.in_size
        od, oh, ow = p.out_size
        # dy into the padded buffer, one depth slice (n, c, h, w) a launch; the rest zeroed.
        c = p.cout
        zd, zh, zw = z_grid
        y_n, y_c, _, y_h, y_w = p.y_strides
        pad_slice = relayout(p.n, c, oh, ow, (y_n, y_c, y_h, y_w), (zd * zh * zw * c, 1, zw * c, c))
        order = torch.empty(p.cin * p.taps, dtype=torch.long)
        columns = _weight_index(p)
        used = columns < p.cin * p.taps
        order[columns[used]] = torch.arange(columns.numel())[used]
        order_on = _on_device(order)
        numel = p.cout * q.taps * q.cin

        def run(x: torch.Tensor, dy: torch.Tensor, dw: torch.Tensor) -> None:
            index = order_on(dw.device)
            padded = torch.empty((p.n, *z_grid, p.cout), dtype=dy.dtype, device=dy.device)
            padded[:, od:].zero_()
            padded[:, :od, oh:].zero_()
            dy5 = dy.view(p.n, c, od, oh, ow)
            for d in range(od):
                pad_slice(dy5[:, :, d], padded[:, d])
            dwz = torch.empty(numel, dtype=dw.dtype, device=dw.device)
            gemm(stage(x), padded.movedim(-1, 1), dwz)
            dw.copy_(dwz.view(p.cout, -1)[:, index].view(dw.shape))

        return run


def _same_grid_problem(p: ConvProblem) -> ConvProblem:
    """The stride-1 convolution over z with z's grid as its output (dy padded to it)."""
    q = stride_one_problem(p)
    return dataclasses.replace(q, out_size=q.in_size, y_strides=channels_last_strides(p.cout, q.in_size))


def _z_constexprs(p: ConvProblem, q: ConvProblem) -> tuple:
    """C, RUN, PAD_C, SD, SH, SW, INDEX_64 of the copy kernels."""
    return (p.cin, _window(p) * p.cin, q.cin - _z_channels(p)[0], *p.stride, q.index_64)


def _stager(p: ConvProblem, q: ConvProblem) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> z (flat, dense channels-last)."""
    run = _window(p) * p.cin
    rows = q.in_pixels * p.stride[0] * p.stride[1]
    block_r = 1 << (run + q.cin - _z_channels(p)[0] - 1).bit_length()
    block_q = max(1, 4096 // block_r)
    launch = launcher(
        _space_to_depth_kernel,
        (cdiv(rows, block_q),),
        num_tensors=2,
        ints=(rows, *p.in_size, *q.in_size, *p.x_strides, *p.pad),
        constexprs=(*_z_constexprs(p, q), block_q, block_r),
    )
    numel = q.in_pixels * q.cin
    dtype = getattr(torch, p.dtype)

    def stage(x: torch.Tensor) -> torch.Tensor:
        z = torch.empty(numel, dtype=dtype, device=x.device)
        launch(x, z)
        return z

    return stage


def _unstager(p: ConvProblem, q: ConvProblem) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """(z's gradient, dx): dx written through its strides."""
    groups_w = cdiv(p.in_size[2] + p.pad[2], p.stride[2])
    groups = p.n * p.in_size[0] * p.in_size[1] * groups_w
    block_e = 1 << (p.stride[2] * p.cin - 1).bit_length()
    block_g = max(1, 2048 // block_e)
    return launcher(
        _depth_to_space_kernel,
        (cdiv(groups, block_g),),
        num_tensors=2,
        ints=(groups, *p.in_size, *q.in_size, groups_w, *p.x_strides, *p.pad),
        constexprs=(*_z_constexprs(p, q), block_g, block_e),
    )


def _weight_packer(p: ConvProblem) -> Callable[[torch.Tensor], torch.Tensor]:
    """w -> z's weight matrix [Cout, taps' * C'] (a gather of w's columns and zeros)."""
    index_on = _on_device(_weight_index(p))

    def pack(w: torch.Tensor) -> torch.Tensor:
        return F.pad(w.reshape(p.cout, -1), (0, 1))[:, index_on(w.device)]

    return pack


def _on_device(t: torch.Tensor) -> Callable[[torch.device], torch.Tensor]:
    """device -> ``t`` there, copied once a device."""
    copies: dict[torch.device, torch.Tensor] = {}

    def on(device: torch.device) -> torch.Tensor:
        copy = copies.get(device)
        if copy is None:
            copy = copies[device] = t.to(device)
        return copy

    return on
