"""The weight gradient of stride-1 channels-last convolutions against a zero-padded copy of dy:
both MMA operands straight from shared memory, and no pixel to take back.

``dw[co, c, tap] = sum over output pixels o of dy[o, co] * x[o + offset(tap), c]``. The shifted
GEMM (``shifted``) reads both as flat pixel rows, so a tap that leaves the image wraps into the
neighbouring row and its products are taken back in a second loop: at 7x7 that loop is about
half the kernel (H100, bf16 3x3 512 @7 N=64: 65 us with it, 37 without). Here x is read as
tensor-descriptor boxes whose positions outside the image the copy engine fills with zeros (as
the boxed forward reads it), and dy as flat rows of a copy padded to a grid of whole boxes (each
image's rows widened to a power of two, rows to a multiple of the box's), so that a box of x
and a run of dy's rows hold the same pixels in the same order. Triton keeps a box reshaped to a
matrix in shared memory only as the MMA's B operand as it stands; transposed as the A operand
(dy's, for dw's rows) it goes through registers (Triton 3.6, sm_90 TTGIR: a ``local_load``):
so dy, whose rows are a plain 2-D block of the padded copy, is the transposed operand. The
copy is dy's size over the padding's share of positions, and the products over padded
positions are wasted: 77% of positions are pixels at 7x7 and 14x14 (8x8 and 16x16 images),
87.5% at 28x28 and 56x56.

As in the shifted GEMM, the products over dy's zero padding still read real x pixels: an Inf or
NaN in x makes NaN in taps where PyTorch's sum skips it (0 * Inf).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from ...core.backend import INTERPRET
from ...core.engine import Engine, LaunchConfig
from ...core.launcher import cdiv, ensure_allocator, launcher
from ..matmul.kernels import dot
from .boxed import SourceView, descriptor_reasons
from .engines import (
    WGRAD_FAMILY,
    ImplicitGemmWgradEngine,
    dot_constexprs,
    summed_splits,
    wgrad_out_steps,
    workspace_steps,
)
from .problem import ConvProblem, itemsize
from .shifted import reduction_splits, store_tile, tap_tile, tile_configs


@triton.jit
def _padded_wgrad_kernel(
    x_ptr, dy_ptr, out_ptr,
    N, SD, SH, SW, C_X, s_n, s_d, s_h, s_w,
    DP, HP, WP, C_Y, CG, COG, box_chunk, boxes,
    TD, TH, TW, off_d, off_h, off_w, dl_d, dl_h, dl_w,
    o_s, o_g, o_m, o_c, o_t,
    ACC: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    IMAGES: tl.constexpr, BD: tl.constexpr, BH: tl.constexpr, BW: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """dw[co, c, tap] for one group, one tap, a BLOCK_M x BLOCK_N tile of (co, c) and the boxes
    [s * box_chunk, (s + 1) * box_chunk). Grid: (co tiles * taps * c tiles, groups, splits).

    x: [N, SD, SH, SW, C_X] at steps (s_n, s_d, s_h, s_w, 1), read in boxes of IMAGES x BD x BH
    x BW pixels (zeros outside it). dy: its padded copy, [boxes * BK, C_Y] rows of the grid
    (images, DP, HP, WP): the box starting at row ``b * BK`` is (n0, d0, h0, w0) of that grid,
    and tap t reads x's box at (n0, d0 + off_d + td * dl_d, ...). Sums are stored at ``out + s *
    o_s + g * o_g + co * o_m + c * o_c + tap * o_t``.
    """
    BK: tl.constexpr = IMAGES * BD * BH * BW
    x_desc = tl.make_tensor_descriptor(
        x_ptr, [N, SD, SH, SW, C_X], [s_n, s_d, s_h, s_w, 1], [IMAGES, BD, BH, BW, BLOCK_N]
    )
    dy_desc = tl.make_tensor_descriptor(dy_ptr, [boxes * BK, C_Y], [C_Y, 1], [BK, BLOCK_M])
    g, split, t, co0, c0, dd, dh, dw = tap_tile(
        CG, TD, TH, TW, off_d, off_h, off_w, dl_d, dl_h, dl_w, BLOCK_M, BLOCK_N
    )
    b_end = tl.minimum(boxes, (split + 1) * box_chunk)
    acc = tl.zeros((BLOCK_M, BLOCK_N), ACC)
    for b in range(split * box_chunk, b_end):
        p0 = b * BK
        w0 = p0 % WP
        rest = p0 // WP
        h0 = rest % HP
        rest = rest // HP
        d0 = rest % DP
        n0 = rest // DP
        a = dy_desc.load([p0, g * COG + co0]).T
        box = x_desc.load([n0, d0 + dd, h0 + dh, w0 + dw, g * CG + c0])
        acc = dot(a, box.reshape(BK, BLOCK_N), acc, PRECISION, UPCAST)
    store_tile(acc, out_ptr, split, g, t, co0, c0, COG, CG, o_s, o_g, o_m, o_c, o_t, BLOCK_M, BLOCK_N)


# ---------------------------------------------------------------------------------------------
# The padded grid, reasons, configs.


def padded_grid(
    n: int, out_size: tuple[int, int, int], pixels: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """((images, DP, HP, WP), (IMAGES, BD, BH, BW)): dy's padded grid and the box (``pixels``
    positions, powers of two) whose runs of rows it is made of. Rows are widened to a power of
    two; a box holds whole rows (or a power-of-two part of one), then whole planes, then whole
    images, so that each box is a contiguous run of the padded copy's rows; rows (planes, images)
    are padded to a multiple of the box's."""
    od, oh, ow = out_size
    wp = 1 << (ow - 1).bit_length()
    bw = min(wp, pixels)
    rest = pixels // bw
    bh = min(1 << (oh - 1).bit_length(), rest) if bw == wp else 1
    rest //= bh
    hp = cdiv(oh, bh) * bh
    bd = min(1 << (od - 1).bit_length(), rest) if bh == hp else 1
    rest //= bd
    dp = cdiv(od, bd) * bd
    images = rest if bd == dp else 1
    return (cdiv(n, images) * images, dp, hp, wp), (images, bd, bh, pixels // (images * bd * bh))


def _x_view(p: ConvProblem) -> SourceView:
    return SourceView(
        p.n, p.cin, p.in_size, p.x_strides, (1, 1, 1), tuple(-q for q in p.pad), p.kernel, p.dilation
    )


def padded_reasons(p: ConvProblem) -> list[str]:
    reasons = descriptor_reasons(p)
    if p.dtype not in ("float16", "bfloat16"):
        reasons.append(f"needs fp16 or bf16 (got {p.dtype}): its tiles are sized for 16-bit operands")
    (images, dp, hp, wp), _ = padded_grid(p.n, p.out_size, 128)
    if images * dp * hp * wp * p.cout >= 2**31:
        reasons.append("dy's padded copy reaches past 2**31 elements")
    if p.stride != (1, 1, 1):
        reasons.append(f"needs stride 1 (got {p.stride[3 - p.nd :]})")
    reasons += _x_view(p).reasons("x", p.dtype)
    size = itemsize(p.dtype)
    if p.cin_g * size % 16 or p.cout_g * size % 16:
        reasons.append(f"needs 16-byte runs of channels per group (got {p.cin_g} and {p.cout_g})")
    return reasons


def _configs(p: ConvProblem) -> list[LaunchConfig]:
    """128-position boxes; (output channel, input channel) tiles as the shifted GEMM's."""
    if INTERPRET:
        shapes = [(16, 16, 16, 4, 1)]
    else:
        shapes = [(128, 128, 128, 8, 3), (128, 128, 64, 8, 4), (64, 64, 128, 4, 4), (128, 64, 128, 4, 3)]
    return tile_configs(p, shapes)


@WGRAD_FAMILY.register
class PaddedBoxWgradEngine(Engine[ConvProblem]):
    """Weight gradient of a stride-1 convolution (channels-last x, fp16/bf16): x's boxes (the
    padding filled by the copy engine) against dy's rows in a copy padded to whole boxes, both
    operands from shared memory, split over boxes with the partial sums added in a fixed order."""

    name = "padded_box"

    def not_supported_reasons(self, problem: ConvProblem) -> list[str]:
        return padded_reasons(problem)

    def cost(self, problem: ConvProblem) -> float:
        # Priced above any engine (the implicit GEMM takes every problem): only benchmark mode or
        # algo="padded_box" runs it. H200, bf16 NHWC N=64 (us, this engine / the shifted GEMM):
        # 3x3 64 @56 133.7 / 62.9, 128 @28 64.8 / 52.3, 256 @14 75.2 / 57.1, 512 @7 70.8 / 70.3
        # (there its kernel 54.6 against 62.3, but dy's padded copy, a fill and a copy, 6.9).
        return 1e9

    def configs(self, problem: ConvProblem) -> list[LaunchConfig]:
        return _configs(problem)

    def bind(self, problem: ConvProblem, config: LaunchConfig) -> Callable[..., None]:
        p = problem
        bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
        (images, dp, hp, wp), box = padded_grid(p.n, p.out_size, bk)
        od, oh, ow = p.out_size
        boxes = images * dp * hp * wp // bk
        tiles = cdiv(p.cout_g, bm) * p.taps * cdiv(p.cin_g, bn)
        split = reduction_splits(p, tiles * p.groups, boxes * bk, config)
        chunk = cdiv(boxes, split)
        split = cdiv(boxes, chunk)
        view = _x_view(p)
        head = (
            p.n,
            *view.size,
            p.cin,
            *view.steps,
            dp,
            hp,
            wp,
            p.cout,
            p.cin_g,
            p.cout_g,
            chunk,
            boxes,
            *p.kernel,
            *view.offsets,
            *view.dilation,
        )
        acc, precision, upcast = dot_constexprs(p)
        consts = (acc, precision, upcast, *box, bm, bn)
        opts = {"num_warps": config["num_warps"], "num_stages": config["num_stages"]}
        grid = (tiles, p.groups, split)
        dtype = getattr(torch, p.dtype)
        fallback = ImplicitGemmWgradEngine()
        slow = fallback.bind(p, fallback.configs(p)[0])

        def padded(dy: torch.Tensor) -> torch.Tensor:
            """dy's channels-last copy on the padded grid, zero outside dy."""
            buf = torch.zeros((images, dp, hp, wp, p.cout), dtype=dtype, device=dy.device)
            dy5 = dy.reshape(p.n, p.cout, od, oh, ow)  # (N, C, D, H, W) whatever the rank
            buf[: p.n, :od, :oh, :ow].copy_(dy5.permute(0, 2, 3, 4, 1))
            return buf

        # store(x, padded dy, dw): dw directly, or each split's sums into a workspace, then added.
        if split == 1:
            store = launcher(_padded_wgrad_kernel, grid, 3, (*head, 0, *wgrad_out_steps(p)), consts, **opts)
        else:
            numel = p.cout * p.cin_g * p.taps
            partial = launcher(
                _padded_wgrad_kernel, grid, 3, (*head, numel, *workspace_steps(p)), consts, **opts
            )
            store = summed_splits(p, split, lambda dyp, x, ws: partial(x, dyp, ws))

        def run(x: torch.Tensor, dy: torch.Tensor, dw: torch.Tensor) -> None:
            if x.data_ptr() & 15:  # descriptors need 16-byte-aligned base addresses
                return slow(x, dy, dw)
            ensure_allocator()
            store(x, padded(dy), dw)

        return run


__all__ = ["PaddedBoxWgradEngine", "padded_grid", "padded_reasons"]
