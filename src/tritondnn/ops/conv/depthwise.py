"""Direct depthwise convolution (groups == input channels): forward, data and weight gradients.

Depthwise convolutions do two multiply-adds per loaded element per tap: they are memory-bound,
and a GEMM tile would waste all but one of its columns. These kernels keep a [pixels, channels]
tile of fp32 accumulators and walk the taps on the CUDA cores; channels-last tensors load and
store whole channel runs. The forward kernel takes the general geometry of ``kernels`` (see its
docstring), so the data gradient runs as its stride phases, with no work on inserted zeros.
A channel multiplier (Cout = k * Cin) is supported forward and for the weight gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import triton
import triton.language as tl

from ...core.backend import INTERPRET, sm_count
from ...core.engine import Engine, LaunchConfig
from ...core.launcher import cdiv, launcher
from ...core.numerics import convert
from ..epilogue import apply_epilogue
from .engines import (
    DGRAD_FAMILY,
    FAMILY,
    WGRAD_FAMILY,
    dgrad_phases,
    epilogue_constexprs,
    forward_geometry,
    roofline,
    row_limit,
    summed_splits,
    wgrad_out_steps,
    workspace_steps,
)
from .kernels import output_pixel
from .problem import ConvProblem


@triton.jit
def _depthwise_kernel(
    src_ptr, w_ptr, out_ptr, c_ptr, bias_ptr, res_ptr, pre_ptr,
    alpha, beta, p0, p1,
    M, C_OUT, MULT, OD, OH, OW, ID, IH, IW, TD, TH, TW,
    s_n, s_c, s_d, s_h, s_w, w_c, w_d, w_h, w_w,
    o_n, o_c, o_d, o_h, o_w, s_bias,
    gs_d, gs_h, gs_w, go_d, go_h, go_w, gd_d, gd_h, gd_w,
    wt_d, wt_h, wt_w, ws_d, ws_h, ws_w,
    os_d, os_h, os_w, oo_d, oo_h, oo_w, row_limit,
    HAS_C: tl.constexpr, BIAS: tl.constexpr, ACT: tl.constexpr, RESIDUAL: tl.constexpr,
    STORE_PRE: tl.constexpr, ACC: tl.constexpr, INDEX_64: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """out[row, co] = sum over taps of src[row's tap position, co // MULT] * w[co, tap]; arguments
    as ``_igemm_kernel``'s (w_c: the weight's output-channel stride). Grid: (row tiles, channel tiles)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    if INDEX_64:
        rows = rows.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    m_ok = rows < M
    col_ok = cols < C_OUT
    ow = rows % OW
    rest = rows // OW
    oh = rest % OH
    rest = rest // OH
    od = rest % OD
    n = rest // OD
    bd = od * gs_d + go_d
    bh = oh * gs_h + go_h
    bw = ow * gs_w + go_w
    src_rows = src_ptr + n * s_n
    src_cols = (cols // MULT) * s_c
    acc = tl.zeros((BLOCK_M, BLOCK_C), ACC)
    for t in range(0, TD * TH * TW):
        tw = t % TW
        t2 = t // TW
        th = t2 % TH
        td = t2 // TH
        sd = bd + td * gd_d
        sh = bh + th * gd_h
        sw = bw + tw * gd_w
        ok = m_ok & (sd >= 0) & (sd < ID) & (sh >= 0) & (sh < IH) & (sw >= 0) & (sw < IW)
        a_ptrs = src_rows[:, None] + (sd * s_d + sh * s_h + sw * s_w)[:, None] + src_cols[None, :]
        a = tl.load(a_ptrs, mask=ok[:, None] & col_ok[None, :], other=0.0)
        w_off = (wt_d + td * ws_d) * w_d + (wt_h + th * ws_h) * w_h + (wt_w + tw * ws_w) * w_w
        wv = tl.load(w_ptr + w_off + cols * w_c, mask=col_ok, other=0.0)
        acc += convert(a, ACC) * convert(wv, ACC)[None, :]
    out_rows = n * o_n + (od * os_d + oo_d) * o_d + (oh * os_h + oo_h) * o_h + (ow * os_w + oo_w) * o_w
    out_rows = tl.where(m_ok, out_rows, row_limit)
    y = apply_epilogue(
        acc,
        out_rows,
        cols,
        row_limit,
        C_OUT,
        c_ptr,
        1,
        o_c,
        bias_ptr,
        s_bias,
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
    out_ptrs = out_ptr + out_rows[:, None] + cols[None, :] * o_c
    tl.store(out_ptrs, convert(y, out_ptr.dtype.element_ty), mask=m_ok[:, None] & col_ok[None, :])


@triton.jit
def _depthwise_wgrad_kernel(
    dy_ptr, x_ptr, out_ptr,
    KTOT, C_OUT, MULT, OD, OH, OW, ID, IH, IW, KH, KW, k_chunk,
    y_n, y_c, y_d, y_h, y_w, x_n, x_c, x_d, x_h, x_w, o_s, o_c, o_t,
    st_d, st_h, st_w, pd_d, pd_h, pd_w, dl_d, dl_h, dl_w,
    ACC: tl.constexpr, INDEX_64: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """dw[co, tap] = sum over (n, output pixel) of dy[n, co, pixel] * x[n, co // MULT, pixel's tap
    position], pixels [s * k_chunk, (s + 1) * k_chunk) for program (channel tile, tap, s); stored at
    ``out + s * o_s + co * o_c + tap * o_t`` (dw, or the fp32 split workspace)."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    tap = tl.program_id(1)
    split = tl.program_id(2)
    if INDEX_64:
        split = split.to(tl.int64)
    col_ok = cols < C_OUT
    kw = tap % KW
    kh = (tap // KW) % KH
    kd = tap // (KW * KH)
    k_start = split * k_chunk
    k_end = tl.minimum(KTOT, k_start + k_chunk)
    acc = tl.zeros((BLOCK_K, BLOCK_C), ACC)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        if INDEX_64:
            k = k.to(tl.int64)
        k_ok = k < k_end
        n, od, oh, ow = output_pixel(k, OD, OH, OW)
        a_ptrs = dy_ptr + (n * y_n + od * y_d + oh * y_h + ow * y_w)[:, None] + (cols * y_c)[None, :]
        a = tl.load(a_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        sd = od * st_d - pd_d + kd * dl_d
        sh = oh * st_h - pd_h + kh * dl_h
        sw = ow * st_w - pd_w + kw * dl_w
        ok = k_ok & (sd >= 0) & (sd < ID) & (sh >= 0) & (sh < IH) & (sw >= 0) & (sw < IW)
        b_ptrs = x_ptr + (n * x_n + sd * x_d + sh * x_h + sw * x_w)[:, None] + ((cols // MULT) * x_c)[None, :]
        b = tl.load(b_ptrs, mask=ok[:, None] & col_ok[None, :], other=0.0)
        acc += convert(a, ACC) * convert(b, ACC)
    total = tl.sum(acc, 0)
    tl.store(
        out_ptr + split * o_s + cols * o_c + tap * o_t, convert(total, out_ptr.dtype.element_ty), mask=col_ok
    )


@triton.jit
def _rows_store(
    acc, oh, n, ow, ow_ok, cols, col_ok, C, out_ptr, c_ptr, bias_ptr, res_ptr, pre_ptr,
    alpha, beta, p0, p1, o_n, o_h, o_w, s_bias, row_limit,
    HAS_C: tl.constexpr, BIAS: tl.constexpr, ACT: tl.constexpr, RESIDUAL: tl.constexpr,
    STORE_PRE: tl.constexpr,
):  # fmt: skip
    """The epilogue and store of output row ``oh`` of a strip."""
    out_rows = tl.where(ow_ok, n * o_n + oh * o_h + ow * o_w, row_limit)
    y = apply_epilogue(
        acc, out_rows, cols, row_limit, C, c_ptr, 1, 1, bias_ptr, s_bias, res_ptr, 1, 1, pre_ptr, 1, 1,
        alpha, beta, p0, p1, HAS_C, BIAS, ACT, RESIDUAL, STORE_PRE,
    )  # fmt: skip
    out_ptrs = out_ptr + out_rows[:, None] + cols[None, :]
    tl.store(out_ptrs, convert(y, out_ptr.dtype.element_ty), mask=ow_ok[:, None] & col_ok[None, :])


@triton.jit
def _tap_weight(
    w_cols,
    col_ok,
    th,
    tw,
    w_h,
    w_w,
    ACC: tl.constexpr,
    KH: tl.constexpr,
    KW: tl.constexpr,
    FLIP: tl.constexpr,
):
    """Tap (th, tw)'s weights of the program's channels (the flipped tap for the data gradient)."""
    if FLIP:
        ptrs = w_cols + (KH - 1 - th) * w_h + (KW - 1 - tw) * w_w
    else:
        ptrs = w_cols + th * w_h + tw * w_w
    return convert(tl.load(ptrs, mask=col_ok, other=0.0), ACC)


@triton.jit
def _depthwise_rows_kernel(
    src_ptr, w_ptr, out_ptr, c_ptr, bias_ptr, res_ptr, pre_ptr,
    alpha, beta, p0, p1,
    C, OH, OW, IH, IW, rows_per_program, w_blocks, h_chunks,
    s_n, s_h, s_w, w_c, w_h, w_w, o_n, o_h, o_w, s_bias,
    st_h, st_w, pd_h, pd_w, dl_h, dl_w, row_limit,
    HAS_C: tl.constexpr, BIAS: tl.constexpr, ACT: tl.constexpr, RESIDUAL: tl.constexpr,
    STORE_PRE: tl.constexpr, ACC: tl.constexpr, INDEX_64: tl.constexpr,
    KH: tl.constexpr, KW: tl.constexpr, FLIP: tl.constexpr, ROTATE: tl.constexpr,
    BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """Channels-last 2-D depthwise convolution (channel multiplier 1) streamed down image rows:
    out[n, oh, ow, c] = sum over taps (th, tw) of src[n, oh * st_h - pd_h + th * dl_h,
    ow * st_w - pd_w + tw * dl_w, c] * w[c, th, tw] (w[c, KH-1-th, KW-1-tw] with FLIP: the data
    gradient). Channel strides are 1. A program owns one image's [BLOCK_W columns, BLOCK_C
    channels] strip over ``rows_per_program`` output rows. Grid: (images * h_chunks * w_blocks,
    channel tiles).

    ROTATE (st_h == dl_h == 1): the strip walks input rows; each is loaded (as its KW column
    shifts, the shifts after the first from L1) and converted once, and added into the KH output
    rows it feeds, whose accumulators rotate: per output element KW loads and conversions instead
    of KH * KW. Otherwise each output row loads its KH * KW taps (rows shared with the next output
    row come from L1)."""
    pid = tl.program_id(0)
    wb = pid % w_blocks
    rest = pid // w_blocks
    hc = rest % h_chunks
    n = rest // h_chunks
    if INDEX_64:
        n = n.to(tl.int64)
    ow = wb * BLOCK_W + tl.arange(0, BLOCK_W)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ow_ok = ow < OW
    col_ok = cols < C
    src = src_ptr + n * s_n
    w_cols = w_ptr + cols * w_c
    oh_start = hc * rows_per_program
    oh_end = tl.minimum(OH, oh_start + rows_per_program)
    # The weights stay in registers over the rows (at most 9 taps; a tap's channels are a strided
    # gather: the weight is (C, 1, KH, KW)).
    taps = ()
    for t in tl.static_range(KH * KW):
        taps = taps + (_tap_weight(w_cols, col_ok, t // KW, t % KW, w_h, w_w, ACC, KH, KW, FLIP),)
    if ROTATE:
        # accs[j] holds output row ih + pd_h - (KH - 1) + j while input row ih is added.
        accs = ()
        for _ in tl.static_range(KH):
            accs = accs + (tl.zeros((BLOCK_W, BLOCK_C), ACC),)
        for ih in tl.range(oh_start - pd_h, oh_end - pd_h + KH - 1, num_stages=STAGES):
            row = src + ih * s_h
            row_ok = (ih >= 0) & (ih < IH)
            for tw in tl.static_range(KW):
                iw = ow * st_w - pd_w + tw * dl_w
                ok = ow_ok & (iw >= 0) & (iw < IW) & row_ok
                a = tl.load(
                    row + (iw * s_w)[:, None] + cols[None, :], mask=ok[:, None] & col_ok[None, :], other=0.0
                )
                a = convert(a, ACC)
                fed = ()
                for j in tl.static_range(KH):
                    fed = fed + (accs[j] + a * taps[(KH - 1 - j) * KW + tw][None, :],)
                accs = fed
            oh = ih + pd_h - (KH - 1)
            if oh >= oh_start:
                _rows_store(
                    accs[0], oh, n, ow, ow_ok, cols, col_ok, C, out_ptr, c_ptr, bias_ptr, res_ptr, pre_ptr,
                    alpha, beta, p0, p1, o_n, o_h, o_w, s_bias, row_limit,
                    HAS_C, BIAS, ACT, RESIDUAL, STORE_PRE,
                )  # fmt: skip
            rotated = ()
            for j in tl.static_range(1, KH):
                rotated = rotated + (accs[j],)
            accs = rotated + (tl.zeros((BLOCK_W, BLOCK_C), ACC),)
    else:
        for oh in tl.range(oh_start, oh_end, num_stages=STAGES):
            acc = tl.zeros((BLOCK_W, BLOCK_C), ACC)
            for th in tl.static_range(KH):
                ih = oh * st_h - pd_h + th * dl_h
                row = src + ih * s_h
                row_ok = (ih >= 0) & (ih < IH)
                for tw in tl.static_range(KW):
                    iw = ow * st_w - pd_w + tw * dl_w
                    ok = ow_ok & (iw >= 0) & (iw < IW) & row_ok
                    a = tl.load(
                        row + (iw * s_w)[:, None] + cols[None, :],
                        mask=ok[:, None] & col_ok[None, :],
                        other=0.0,
                    )
                    acc += convert(a, ACC) * taps[th * KW + tw][None, :]
            _rows_store(
                acc, oh, n, ow, ow_ok, cols, col_ok, C, out_ptr, c_ptr, bias_ptr, res_ptr, pre_ptr,
                alpha, beta, p0, p1, o_n, o_h, o_w, s_bias, row_limit,
                HAS_C, BIAS, ACT, RESIDUAL, STORE_PRE,
            )  # fmt: skip


def _acc(p: ConvProblem):
    return tl.float64 if p.dtype == "float64" else tl.float32


def _depthwise_reasons(p: ConvProblem) -> list[str]:
    if p.groups != p.cin:
        return [f"needs groups == input channels (groups={p.groups}, channels={p.cin})"]
    return []


def _tiles(p: ConvProblem) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_C, warps): channel-wide tiles for channels-last, pixel-long ones otherwise."""
    if INTERPRET:
        return 16, 16, 4
    if p.channels_last:  # H100, 3x3 256ch @56 bf16: 1204 GB/s, against 857 for 32x64 tiles
        return 32, 128, 4
    return 128, 16, 4


def _ints_from_igemm(ints: tuple[int, ...], c_out: int, mult: int, w_strides: tuple[int, ...]) -> tuple:
    """The depthwise kernel's ints from ``_igemm_kernel``'s (same geometry, no groups)."""
    return (ints[0], c_out, mult, *ints[3:12], *ints[12:17], w_strides[0], *w_strides[2:], *ints[23:])


def _bind(p: ConvProblem, launches: list[tuple[int, tuple]], c_out: int) -> Callable[..., None]:
    bm, bc, warps = _tiles(p)
    consts = (*epilogue_constexprs(p), _acc(p), p.index_64, bm, bc)
    fns = [
        launcher(_depthwise_kernel, (cdiv(m, bm), cdiv(c_out, bc)), 7, ints, consts, num_warps=warps)
        for m, ints in launches
    ]
    if len(fns) == 1:
        return fns[0]

    def run(*args: Any) -> None:
        for fn in fns:
            fn(*args)

    return run


def _memory_cost(p: ConvProblem) -> float:
    return roofline(p.flops, p.bytes, 40.0, 0.5, 0.75) + 3.0


# The row kernel keeps each tap's weights in registers. Larger kernels measured slower than the
# general engine with the weights reloaded (H100, 7x7 96ch @56 N=64 bf16: 0.62 ms against 0.39).
_ROWS_MAX_TAPS = 9


def _unit_multiplier_reasons(p: ConvProblem) -> list[str]:
    reasons = _depthwise_reasons(p)
    if not reasons and p.cout != p.cin:
        reasons.append(f"needs a channel multiplier of 1 (got {p.cout // p.cin})")
    return reasons


def _rows_reasons(p: ConvProblem) -> list[str]:
    reasons = _unit_multiplier_reasons(p)
    if p.kernel[0] != 1 or p.in_size[0] != 1:
        reasons.append("needs a 1-D or 2-D convolution")
    if p.x_strides[1] != 1 or p.y_strides[1] != 1 or p.cin == 1:
        reasons.append("needs channels-last input and output")
    if p.kernel[1] * p.kernel[2] > _ROWS_MAX_TAPS:
        reasons.append(f"needs at most {_ROWS_MAX_TAPS} taps (got {p.kernel[1] * p.kernel[2]})")
    return reasons


def _rows_configs(p: ConvProblem) -> list[LaunchConfig]:
    """Strip tiles, the heuristic's pick first: 2048-element [columns, channels] tiles, 128
    channels wide at most, and the row loop software-pipelined (``STAGES``: rows of loads in
    flight through shared memory; the rotating loop loads KW tiles a row, the other KH * KW).
    PROGRAMS_PER_SM: the H chunking aims at this many programs a multiprocessor.

    H100, N=64 bf16, against cuDNN: 3x3 256 @56 forward 82.5 us (103.2), data gradient 83.9 us
    (166.2); 3x3 stride 2 144 @56 44.1 us (47.2); 3x3 672 @14 23.6-26.1 us (27.4); MobileNetV2's
    depthwise layers 0.81-1.11x forward, 2.7-9.6x the data gradient. Narrower tiles that waste
    fewer masked lanes ran slower: 144 @56 with 32-wide tiles 89.2 us against 79.7 (128-wide,
    the second one mostly masked). Without the pipelining (one program's row loads at a time, two
    programs a multiprocessor at 220 registers a thread) the 256 @56 forward took 126-150 us."""
    if INTERPRET:
        return [{"BLOCK_W": 8, "BLOCK_C": 16, "num_warps": 4, "PROGRAMS_PER_SM": 4, "STAGES": 2}]
    bc = min(128, max(16, triton.next_power_of_2(p.cin)))
    bw = min(max(8, 2048 // bc), max(8, triton.next_power_of_2(p.out_size[2])))
    rotate = p.stride[1] == 1 and p.dilation[1] == 1
    stages = 5 if rotate else 3
    shapes = [
        (bw, bc, stages),
        (bw, bc, stages + 1),
        (max(8, bw // 2), bc, stages),
        (bw * 2, max(16, bc // 2), stages),
    ]
    return [
        {"BLOCK_W": w, "BLOCK_C": c, "num_warps": 4, "PROGRAMS_PER_SM": 2, "STAGES": st}
        for w, c, st in shapes
    ]


def _bind_rows(
    p: ConvProblem,
    config: LaunchConfig,
    src: tuple[tuple[int, ...], tuple[int, ...]],
    dst: tuple[tuple[int, ...], tuple[int, ...]],
    stride: tuple[int, ...],
    pad: tuple[int, ...],
    flip: bool,
) -> Callable[..., None]:
    """src, dst: ((H, W), 5-D strides) of the tensor read and the tensor written."""
    bw, bc = config["BLOCK_W"], config["BLOCK_C"]
    (ih, iw), ss = src
    (oh, ow), ds = dst
    w_blocks, c_blocks = cdiv(ow, bw), cdiv(p.cin, bc)
    base = p.n * w_blocks * c_blocks
    rows = cdiv(oh, max(1, min(oh, cdiv(config["PROGRAMS_PER_SM"] * sm_count(), base))))
    h_chunks = cdiv(oh, rows)
    ints = (
        p.cin, oh, ow, ih, iw, rows, w_blocks, h_chunks,
        ss[0], ss[3], ss[4], p.w_strides[0], p.w_strides[3], p.w_strides[4], ds[0], ds[3], ds[4], 1,
        *stride, *pad, *p.dilation[1:], row_limit(p),
    )  # fmt: skip
    rotate = stride[0] == 1 and p.dilation[1] == 1
    consts = (
        *epilogue_constexprs(p),
        _acc(p),
        p.index_64,
        p.kernel[1],
        p.kernel[2],
        flip,
        rotate,
        bw,
        bc,
        config["STAGES"],
    )
    grid = (p.n * h_chunks * w_blocks, c_blocks)
    return launcher(_depthwise_rows_kernel, grid, 7, ints, consts, num_warps=config["num_warps"])


def _rows_cost(p: ConvProblem) -> float:
    return roofline(p.flops, p.bytes, 40.0, 0.5, 0.85) + 3.0


@FAMILY.register
class DepthwiseRowsEngine(Engine[ConvProblem]):
    """Channels-last 1-D/2-D depthwise (multiplier 1), streamed down image rows with unrolled taps."""

    name = "depthwise_rows"

    def not_supported_reasons(self, problem: ConvProblem) -> list[str]:
        return _rows_reasons(problem)

    def cost(self, problem: ConvProblem) -> float:
        return _rows_cost(problem)

    def configs(self, problem: ConvProblem) -> list[LaunchConfig]:
        return _rows_configs(problem)

    def bind(self, problem: ConvProblem, config: LaunchConfig) -> Callable[..., None]:
        p = problem
        src = (p.in_size[1:], p.x_strides)
        dst = (p.out_size[1:], p.y_strides)
        return _bind_rows(p, config, src, dst, p.stride[1:], p.pad[1:], False)


@DGRAD_FAMILY.register
class DepthwiseRowsDgradEngine(DepthwiseRowsEngine):
    """Depthwise data gradient of a stride-1 convolution: the row kernel over the output gradient
    with the flipped taps."""

    def not_supported_reasons(self, problem: ConvProblem) -> list[str]:
        reasons = _rows_reasons(problem)
        if problem.stride != (1, 1, 1):
            reasons.append(f"needs stride 1 (got {problem.stride[1:]})")
        return reasons

    def bind(self, problem: ConvProblem, config: LaunchConfig) -> Callable[..., None]:
        p = problem
        src = (p.out_size[1:], p.y_strides)
        dst = (p.in_size[1:], p.x_strides)
        pad = tuple(d * (k - 1) - q for d, k, q in zip(p.dilation[1:], p.kernel[1:], p.pad[1:]))
        return _bind_rows(p, config, src, dst, (1, 1), pad, True)


@FAMILY.register
class DepthwiseEngine(Engine[ConvProblem]):
    """Depthwise (groups == channels, any channel multiplier): direct, memory-bound, fused epilogue."""

    name = "depthwise"

    def not_supported_reasons(self, problem: ConvProblem) -> list[str]:
        return _depthwise_reasons(problem)

    def cost(self, problem: ConvProblem) -> float:
        return _memory_cost(problem)

    def bind(self, problem: ConvProblem, config: LaunchConfig) -> Callable[..., None]:
        p = problem
        m, ints = forward_geometry(p)
        return _bind(p, [(m, _ints_from_igemm(ints, p.cout, p.cout // p.cin, p.w_strides))], p.cout)


@DGRAD_FAMILY.register
class DepthwiseDgradEngine(Engine[ConvProblem]):
    """Depthwise data gradient (channel multiplier 1), by stride phases."""

    name = "depthwise"

    def not_supported_reasons(self, problem: ConvProblem) -> list[str]:
        return _unit_multiplier_reasons(problem)

    def cost(self, problem: ConvProblem) -> float:
        return _memory_cost(problem)

    def bind(self, problem: ConvProblem, config: LaunchConfig) -> Callable[..., None]:
        p = problem
        launches = [(m, _ints_from_igemm(ints, p.cin, 1, p.w_strides)) for m, ints in dgrad_phases(p)]
        return _bind(p, launches, p.cin)


@WGRAD_FAMILY.register
class DepthwiseWgradEngine(Engine[ConvProblem]):
    """Depthwise weight gradient: per (channel tile, tap), a sum over pixels split into chunks that
    a second pass adds in order (deterministic)."""

    name = "depthwise"

    def not_supported_reasons(self, problem: ConvProblem) -> list[str]:
        return _depthwise_reasons(problem)

    def cost(self, problem: ConvProblem) -> float:
        return _memory_cost(problem) * 1.5

    def bind(self, problem: ConvProblem, config: LaunchConfig) -> Callable[..., None]:
        p = problem
        bk, bc = (16, 16) if INTERPRET else (64, 64 if p.channels_last else 32)
        taps, ktot = p.taps, p.out_pixels
        tiles = cdiv(p.cout, bc) * taps
        split = max(1, min(cdiv(2 * sm_count(), tiles), cdiv(ktot, 8 * bk), 1024))
        chunk = max(bk, cdiv(cdiv(ktot, split), bk) * bk)
        split = max(1, cdiv(ktot, chunk))
        numel = p.cout * taps
        head = (
            ktot,
            p.cout,
            p.cout // p.cin,
            *p.out_size,
            *p.in_size,
            p.kernel[1],
            p.kernel[2],
            chunk,
            *p.y_strides,
            *p.x_strides,
        )
        geometry = (*p.stride, *p.pad, *p.dilation)
        consts = (_acc(p), p.index_64, bk, bc)
        grid = (cdiv(p.cout, bc), taps, split)
        _, o_m, _, o_t = wgrad_out_steps(p)
        direct = launcher(_depthwise_wgrad_kernel, grid, 3, (*head, 0, o_m, o_t, *geometry), consts)
        if split == 1:
            return lambda x, dy, dw: direct(dy, x, dw)
        _, ws_m, _, ws_t = workspace_steps(p)
        partial = launcher(_depthwise_wgrad_kernel, grid, 3, (*head, numel, ws_m, ws_t, *geometry), consts)
        return summed_splits(p, split, partial)
