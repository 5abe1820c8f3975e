"""1x1 convolutions as one matrix product (cuDNN's GEMM algorithm), on ``tdnn.matmul``'s engines.

With a 1x1 kernel, no padding and one group, a channels-last activation is a [pixels, channels]
matrix with dense rows, and each direction is a single GEMM:

* forward: ``y[P, Cout] = x[P, Cin] @ W^T``, the convolution's epilogue fused (bias per column);
* data gradient: ``dx[P, Cin] = dy[P, Cout] @ W``, its epilogue fused the same way (with a stride
  s: the product over dy's pixels, scattered into every s-th pixel of a zeroed dx);
* weight gradient: ``dW[Cout, Cin] = dy^T @ x``, a reduction over every pixel.

A stride-s forward or weight gradient reads every s-th pixel: those rows are copied into a dense
matrix first (the only extra traffic, 1/s^2 of x). The weight gradient of any other (one-group,
channels-last) convolution is the same product over an explicit column matrix, each pixel's taps
side by side (``Im2colGemmWgradEngine``): ``dW[Cout, taps * Cin] = dy^T @ cols``, worth its copy
where the layer is small and deep (3x3 512 @7: taps over a 7x7 grid are mostly borders, which the
engines that address taps pay for in every tile). The matrix products then take what the matmul
family would choose for them: the persistent TMA kernel on Hopper, the skinny kernel for narrow
outputs, split-K (deterministic: partial sums added in a fixed order) for the weight gradient's
long reduction. The other convolution engines address each pixel's taps; here there are none,
or they are laid out as columns first.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from ...core.backend import sm_count
from ...core.engine import Choice, Engine, LaunchConfig
from ...core.launcher import cdiv, launcher
from ..matmul import engines as mm
from .engines import _BANDWIDTH, DGRAD_FAMILY, FAMILY, WGRAD_FAMILY, peak, roofline, wgrad_out_steps
from .problem import ConvProblem, Strides5, Triple, itemsize


def _dense(strides: Strides5, channels: int, n: int, size: Triple) -> bool:
    """Whether (N, C, D, H, W) strides are those of a dense channels-last tensor (size-1
    dimensions' strides aside)."""
    step, expected = channels, {1: 1}
    for dim, extent in zip((4, 3, 2), reversed(size)):
        expected[dim] = step
        step *= extent
    expected[0] = step
    extents = {0: n, 1: channels, 2: size[0], 3: size[1], 4: size[2]}
    return all(strides[d] == s for d, s in expected.items() if extents[d] > 1)


def _reasons(p: ConvProblem) -> list[str]:
    reasons = []
    if p.kernel != (1, 1, 1):
        reasons.append(f"needs a 1x1 kernel (got {p.kernel[3 - p.nd :]})")
    sampled = tuple((size - 1) // s + 1 for size, s in zip(p.in_size, p.stride))
    if p.pad != (0, 0, 0) or p.out_size != sampled:  # the second: padding after the input
        reasons.append(f"needs no padding (got {p.pad[3 - p.nd :]} before the input)")
    if p.groups != 1:
        reasons.append(f"needs one group (got {p.groups})")
    if not p.channels_last:
        reasons.append("needs channels-last activations")
    strided = p.stride != (1, 1, 1)
    epilogue = p.bias or p.has_c or p.residual or p.activation >= 0 or p.store_pre
    if p.direction == "dgrad" and strided and epilogue:
        reasons.append("a strided data gradient needs no fused epilogue (dx is zero between the samples)")
    if not _dense(p.y_strides, p.cout, p.n, p.out_size):
        reasons.append(f"the output{' gradient' if p.direction != 'fwd' else ''} is not dense channels-last")
    if not ((strided and p.direction != "dgrad") or _dense(p.x_strides, p.cin, p.n, p.in_size)):
        reasons.append(f"the input{' gradient' if p.direction == 'dgrad' else ''} is not dense channels-last")
    return reasons


def _meta(shape: tuple[int, int], strides: tuple[int, int], dtype: str) -> torch.Tensor:
    return torch.empty_strided(shape, strides, dtype=getattr(torch, dtype), device="meta")


@functools.cache
def _matmul(p: ConvProblem) -> tuple[mm.Layout, Choice]:
    """The matrix product of ``p`` and the matmul family's choice for it (its heuristic)."""
    pixels = p.out_pixels
    ws = p.w_strides
    if p.direction == "wgrad":  # dW[Cout, Cin * taps] = dy^T @ x (its columns, with taps)
        ncols = p.cin * p.taps
        m, n, k, a_strides, b_strides = p.cout, ncols, pixels, (1, p.cout), (ncols, 1)
    elif p.direction == "dgrad":  # dx[P, Cin] = dy[P, Cout] @ W[Cout, Cin]
        m, n, k, a_strides, b_strides = pixels, p.cin, p.cout, (p.cout, 1), (ws[0], ws[1])
    else:  # y[P, Cout] = x[P, Cin] @ W[Cout, Cin]^T
        m, n, k, a_strides, b_strides = pixels, p.cout, p.cin, (p.cin, 1), (ws[1], ws[0])
    out = _meta((m, n), (n, 1), p.out_dtype)
    lay = mm.layout(
        _meta((m, k), a_strides, p.dtype),
        _meta((k, n), b_strides, p.dtype),
        out if p.has_c else None,
        _meta((n,), (1,), p.out_dtype) if p.bias else None,
        out if p.residual else None,
        out_dtype=getattr(torch, p.out_dtype),
        bias_kind=1 if p.bias else 0,
        activation=p.activation,
        store_pre=p.store_pre,
        scaled=False,
        amax=False,
    )
    return lay, mm.FAMILY.select(lay.problem)


def _copy_cost(p: ConvProblem) -> float:
    """Microseconds to copy the sampled pixels of a strided x into a dense matrix, or for a strided
    data gradient to write dx from the product's rows (zeros between the samples; H100: 25.7 MB
    of dx zeroed in 9 us, 0.95 of the 3 TB/s)."""
    if p.stride == (1, 1, 1):
        return 0.0
    if p.direction == "dgrad":
        moved = p.out_pixels * p.cin + p.n * math.prod(p.in_size) * p.cin
        return moved * itemsize(p.dtype) / (_BANDWIDTH * 1e6 * 0.85) + 3.0
    return 2 * p.out_pixels * p.cin * itemsize(p.dtype) / (_BANDWIDTH * 1e6 * 0.6) + 5.0


def _cost(p: ConvProblem) -> float:
    lay, choice = _matmul(p)
    # Forward, the boxed engine stayed ahead on five of seven of ResNet-50's 1x1 layers (H100,
    # bf16, N = 64), one of them ranked first here by the matmul's model (2048->512 @7: 24-28 us
    # boxed, 37-46 as a GEMM), so forward products count half as much again. The gradients were at
    # par or ahead (2048->512 @7 dgrad 20.6 against 25.5, 1024->2048 stride 2 wgrad 39.5 against
    # 70.7).
    scale = 1.5 if p.direction == "fwd" else 1.0
    return scale * choice.engine.cost(lay.problem) + _copy_cost(p)


def _sampler(p: ConvProblem) -> Callable[[torch.Tensor], torch.Tensor]:
    """``rows(x)``: a dense [pixels, C] copy of the pixels a stride-s 1x1 convolution reads from
    x, through one strided view and one copy (slicing, moving and reshaping per call cost tens of
    microseconds of host time on slow hosts)."""
    n_step, c_step, *steps = p.x_strides
    size = (p.n, *p.out_size, p.cin)
    strides = (n_step, *(step * s for step, s in zip(steps, p.stride)), c_step)

    def rows(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty((p.out_pixels, p.cin), dtype=x.dtype, device=x.device)
        out.view(size).copy_(x.as_strided(size, strides, x.storage_offset()))
        return out

    return rows


def _bind(p: ConvProblem) -> Callable[..., None]:
    """``run(src, w, dst, c, bias, residual, pre, alpha, beta, p0, p1)`` for the forward (src x,
    dst y) or the data gradient (src dy, dst dx).

    The kernels address every operand through the problem's strides, so the convolution's own
    tensors are passed as they are (each matrix starts at its tensor's first element): views made
    per call cost host time that a 20 us product cannot hide."""
    lay, choice = _matmul(p)
    launch = choice.engine.bind(lay.problem, choice.config)
    strided = p.stride != (1, 1, 1)
    if strided and p.direction == "dgrad":
        return _bind_strided_dgrad(p, lay, launch)
    rows = _sampler(p) if strided else None

    def run(src, w, dst, c, bias, residual, pre, alpha, beta, p0, p1) -> None:
        a, b = (src if rows is None else rows(src)), w
        if lay.swapped:
            a, b = b, a
        c, bias, residual, pre = (
            t if used else dst
            for t, used in ((c, p.has_c), (bias, p.bias), (residual, p.residual), (pre, p.store_pre))
        )
        launch(a, b, dst, c, bias, residual, pre, dst, dst, dst, alpha, beta, p0, p1)

    return run


@triton.jit
def _scatter_samples_kernel(
    rows_ptr, dx_ptr, pixels, C, SD, SH, SW, TD, TH, TW, OD, OH, OW,
    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """dx (dense channels-last [pixels, C] over an (SD, SH, SW) grid) = the rows of ``rows``
    ([N * OD * OH * OW, C]) at every (TD, TH, TW)-th pixel, zero elsewhere. Grid: pixel blocks."""
    pix = tl.program_id(0).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    w = pix % SW
    h = (pix // SW) % SH
    d = (pix // (SW * SH)) % SD
    n = pix // (SW * SH * SD)
    sampled = (w % TW == 0) & (h % TH == 0) & (d % TD == 0)
    src = ((n * OD + d // TD) * OH + h // TH) * OW + w // TW
    inside = pix < pixels
    for c0 in range(0, C, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        ok = inside[:, None] & (c < C)[None, :]
        v = tl.load(rows_ptr + src[:, None] * C + c[None, :], mask=ok & sampled[:, None], other=0.0)
        tl.store(dx_ptr + pix[:, None] * C + c[None, :], v, mask=ok)


def _bind_strided_dgrad(p: ConvProblem, lay: mm.Layout, launch: Callable[..., None]) -> Callable[..., None]:
    """The data gradient of a stride-s 1x1 convolution: the product dy @ W gives the gradient of
    the sampled pixels only (a dense [pixels, Cin] matrix); one more pass writes dx whole, those
    rows at every s-th pixel and zeros between (no products over the zeros, which the implicit
    GEMM's stride phases computed as empty launches and a gathered product)."""
    pixels = p.n * math.prod(p.in_size)
    block_p, block_c = 64, min(128, triton.next_power_of_2(p.cin))
    ints = (pixels, p.cin, *p.in_size, *p.stride, *p.out_size)
    scatter = launcher(_scatter_samples_kernel, (cdiv(pixels, block_p),), 2, ints, (block_p, block_c))

    def run(src, w, dst, c, bias, residual, pre, alpha, beta, p0, p1) -> None:
        rows = torch.empty((p.out_pixels, p.cin), dtype=dst.dtype, device=dst.device)
        a, b = (w, src) if lay.swapped else (src, w)
        launch(a, b, rows, rows, rows, rows, rows, rows, rows, rows, alpha, beta, p0, p1)
        scatter(rows, dst)

    return run


class _GemmEngine(Engine[ConvProblem]):
    name = "gemm_1x1"

    def not_supported_reasons(self, problem: ConvProblem) -> list[str]:
        return _reasons(problem)

    def cost(self, problem: ConvProblem) -> float:
        return _cost(problem)

    def configs(self, problem: ConvProblem) -> list[LaunchConfig]:
        return [{}]  # the matmul family picks its own engine and configuration

    def bind(self, problem: ConvProblem, config: LaunchConfig) -> Callable[..., None]:
        return _bind(problem)


@FAMILY.register
class GemmForwardEngine(_GemmEngine):
    """A 1x1 channels-last convolution (any stride, one group) as one GEMM with its epilogue."""


@DGRAD_FAMILY.register
class GemmDgradEngine(_GemmEngine):
    """The data gradient of a 1x1 channels-last convolution as one GEMM (with a stride: over the
    sampled pixels, scattered into a zeroed dx)."""


@WGRAD_FAMILY.register
class GemmWgradEngine(_GemmEngine):
    """The weight gradient of a 1x1 channels-last convolution as one GEMM over every pixel."""

    def bind(self, problem: ConvProblem, config: LaunchConfig) -> Callable[..., None]:
        p = problem
        lay, choice = _matmul(p)
        launch = choice.engine.bind(lay.problem, choice.config)
        rows = _sampler(p) if p.stride != (1, 1, 1) else None

        def run(x: torch.Tensor, dy: torch.Tensor, dw: torch.Tensor) -> None:
            a, b = dy, (x if rows is None else rows(x))  # dy^T and x as in ``_bind``
            if lay.swapped:
                a, b = b, a
            launch(a, b, dw, dw, dw, dw, dw, dw, dw, dw, 1.0, 0.0, 0.0, 0.0)

        return run


# ---------------------------------------------------------------------------------------------
# Any weight gradient as one GEMM over an explicit column matrix.


@triton.jit
def _columns_kernel(
    x_ptr, cols_ptr,
    pixels, C, OD, OH, OW, ID, IH, IW, s_n, s_d, s_h, s_w, s_c,
    KH, KW, st_d, st_h, st_w, off_d, off_h, off_w, dl_d, dl_h, dl_w, row, col_c, col_t,
    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """cols[o, c * col_c + t * col_t] (rows ``row`` apart) = x at output pixel o's tap t, input
    channel c, zero where the tap falls in the padding. Grid: (pixel blocks, taps)."""
    t = tl.program_id(1)
    pix = tl.program_id(0).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    ow = pix % OW
    oh = (pix // OW) % OH
    od = (pix // (OW * OH)) % OD
    n = pix // (OW * OH * OD)
    kw = t % KW
    kh = (t // KW) % KH
    kd = t // (KW * KH)
    iw = ow * st_w + off_w + kw * dl_w
    ih = oh * st_h + off_h + kh * dl_h
    i_d = od * st_d + off_d + kd * dl_d
    rows = pix < pixels
    inside = rows & (iw >= 0) & (iw < IW) & (ih >= 0) & (ih < IH) & (i_d >= 0) & (i_d < ID)
    src = n * s_n + i_d * s_d + ih * s_h + iw * s_w
    dst = pix * row + t * col_t
    for c0 in range(0, C, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        ok = (c < C)[None, :]
        v = tl.load(x_ptr + src[:, None] + c[None, :] * s_c, mask=inside[:, None] & ok, other=0.0)
        tl.store(cols_ptr + dst[:, None] + c[None, :] * col_c, v, mask=rows[:, None] & ok)


_COLUMNS_LIMIT = 1 << 30  # bytes: past this the copy dwarfs any product it could make faster


def _columns_reasons(p: ConvProblem) -> list[str]:
    reasons = []
    if not _reasons(p):
        reasons.append("a 1x1 kernel without padding is gemm_1x1's (the same product, no copy)")
    if p.groups != 1:
        reasons.append(f"needs one group (got {p.groups})")
    if not p.channels_last:
        reasons.append("needs channels-last activations")
    if not _dense(p.y_strides, p.cout, p.n, p.out_size):
        reasons.append("the output gradient is not dense channels-last")
    ncols = p.cin * p.taps
    try:
        _, s_co, s_c, s_t = wgrad_out_steps(p)
    except ValueError as err:
        reasons.append(str(err))
    else:
        if s_co != ncols or (s_c, s_t) not in ((1, p.cin), (p.taps, 1)):
            reasons.append(f"the weight gradient is not dense (strides {p.w_strides[: p.nd + 2]})")
    nbytes = p.out_pixels * ncols * itemsize(p.dtype)
    if nbytes > _COLUMNS_LIMIT:
        reasons.append(f"its column matrix would take {nbytes / 2**30:.1f} GiB (at most 1)")
    return reasons


# The columns' product on Hopper in 16 bits: 128 x 256 tiles over the long K (every pixel).
# H200, 3x3 512 @7 N=64 (512 x 4608 x 3136, A = dy^T M-major): 33.5 us (tiled kernel 33.0,
# cuBLAS 25.9), where the matmul family's model picks 64 x 64 persistent tiles for a wave's
# worth (65.0 us) or 128 x 128 (36.1).
_COLUMNS_TILE = {
    "BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3,
    "FLATTEN": False,
}  # fmt: skip


def _columns_product(p: ConvProblem) -> tuple[mm.Layout, Engine, LaunchConfig, float]:
    """The layout of dy^T @ cols, the engine and configuration that run it and its modelled
    microseconds: ``_COLUMNS_TILE`` (at 0.75 of peak) where its tiles fill half the GPU or more
    (256 @14's 36 tiles ran 148 us whole, against 66 with the family's pick)."""
    lay, choice = _matmul(p)
    tma = mm.PersistentTmaEngine()
    tiles = cdiv(p.cout, _COLUMNS_TILE["BLOCK_M"]) * cdiv(p.cin * p.taps, _COLUMNS_TILE["BLOCK_N"])
    if (
        p.dtype in ("float16", "bfloat16")
        and not tma.not_supported_reasons(lay.problem)
        and not lay.swapped
        and 2 * tiles >= sm_count()
    ):
        config = _COLUMNS_TILE
        if itemsize(p.out_dtype) > itemsize(p.dtype):
            # A wider dw (fp32 for an fp32 master weight): the tile is stored from registers in
            # column halves, as the family's configs do where the descriptor store's staging
            # would not fit beside the pipeline (278 KB of 227).
            config = {**config, "STORE_DESC": False, "SUBTILE": True}
        return lay, tma, config, roofline(p.flops, 0, peak(p), 0.75, 1.0)
    return lay, choice.engine, choice.config, choice.engine.cost(lay.problem)


def _columns_cost(p: ConvProblem) -> float:
    """Writing the columns (x's pixels read once per tap, mostly from L2) and the product. H200,
    bf16 N=64: the copy 12.4 us at 3x3 512 @7 (29 MB of columns), 26.2 at 256 @14 (58 MB); the
    product in ``_COLUMNS_TILE`` 33.5 us at 512 @7 (14.8 GFLOP). Timed in 16 bits only: in other
    dtypes it runs by name (priced out)."""
    if p.dtype not in ("float16", "bfloat16"):
        return 1e9
    cols = p.out_pixels * p.cin * p.taps * itemsize(p.dtype)
    product = _columns_product(p)[3]
    copy = cols / (_BANDWIDTH * 1e6 * 0.75)
    # Columns past 128 MB are read back from memory at the copy's rate again (H200, N=128, 3x3
    # stride 2: 128 @56, 231 MB, 261 us against 172 modelled without this; 256 @28, 115 MB, 121).
    return copy * (2 if cols > 128 << 20 else 1) + 8.0 + product


@WGRAD_FAMILY.register
class Im2colGemmWgradEngine(Engine[ConvProblem]):
    """The weight gradient of a one-group channels-last convolution (any kernel, stride, padding,
    dilation) as one GEMM, dy^T times an explicit column matrix of x's taps (written by one copy
    kernel, zeros for the padding), on the matmul family's engines."""

    name = "im2col_gemm"

    def not_supported_reasons(self, problem: ConvProblem) -> list[str]:
        return _columns_reasons(problem)

    def cost(self, problem: ConvProblem) -> float:
        return _columns_cost(problem)

    def configs(self, problem: ConvProblem) -> list[LaunchConfig]:
        return [{}]  # the product's engine and configuration: ``_columns_product``

    def bind(self, problem: ConvProblem, config: LaunchConfig) -> Callable[..., None]:
        p = problem
        lay, engine, config, _ = _columns_product(p)
        launch = engine.bind(lay.problem, config)
        ncols = p.cin * p.taps
        _, _, col_c, col_t = wgrad_out_steps(p)
        # H200, 3x3 512 @7: 32 x 128 blocks 12.4 us, 64 x 128 14.6, 16 x 512 23.3.
        block_p, block_c = 32, min(128, triton.next_power_of_2(p.cin))
        ints = (
            p.out_pixels, p.cin, *p.out_size, *p.in_size, p.x_strides[0], *p.x_strides[2:], p.x_strides[1],
            *p.kernel[1:], *p.stride, *(-q for q in p.pad), *p.dilation, ncols, col_c, col_t,
        )  # fmt: skip
        columns = launcher(
            _columns_kernel, (cdiv(p.out_pixels, block_p), p.taps), 2, ints, (block_p, block_c)
        )
        dtype = getattr(torch, p.dtype)

        def run(x: torch.Tensor, dy: torch.Tensor, dw: torch.Tensor) -> None:
            cols = torch.empty((p.out_pixels, ncols), dtype=dtype, device=x.device)
            columns(x, cols)
            a, b = dy, cols  # dy^T and the columns as in ``_matmul``
            if lay.swapped:
                a, b = b, a
            launch(a, b, dw, dw, dw, dw, dw, dw, dw, dw, 1.0, 0.0, 0.0, 0.0)

        return run
