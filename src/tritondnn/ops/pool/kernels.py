"""Triton kernels of max, average and adaptive pooling, forward and backward.

Tensors are addressed as (N, C, D, H, W) through their strides (``common.strides5``), so NCHW,
channels_last and sliced inputs are read in place. Two tilings, over the same window code:

* [BLOCK_P, BLOCK_C] tiles (``tile``): BLOCK_P positions of one sample (outputs forward, inputs
  backward) by BLOCK_C channels; for channels_last tensors, coalesced along channels.
* [BLOCK_H, BLOCK_W] tiles of one (n, c, d) plane (``plane_tile``): for tensors whose rows are
  contiguous (NCHW). Window positions and masks are computed per row and per column, not per
  lane, and no lane divides its flat position into coordinates.

Backward kernels gather: each input element sums the output gradients of the windows that
contain it, visiting candidate windows in a fixed order. No atomics, so every run gives the same
bits (cuDNN's deterministic max-pool backward), and no zero-fill of the input gradient.

Kernel arguments, documented once:
    x_ptr, y_ptr: pooling input and output; dy_ptr, dx_ptr: their gradients.
    idx_ptr: max-pool indices in y's layout (PyTorch's flat int64 positions, or int8 window
        offsets; see ``common.INDEX_*``); unused tensors are passed as another tensor, never read.
    divisor: average pooling's ``divisor_override`` (read when OVERRIDE).
    C: channels. ID, IH, IW: input sizes. OD, OH, OW: output sizes.
    SD.., PD.., DD..: stride, padding and dilation per dimension (unused for adaptive windows).
    KD, KH, KW: taps per dimension of the largest window (the kernel size, for regular windows);
        ints in the direct kernels, constexprs in the unrolled ones.
    ND, NH, NW: (backward) the most windows one input lies in, per dimension; int or constexpr.
    xs_*, ys_*, gs_*, is_*: (n, c, d, h, w) strides of the input-side tensor (x or dx), the
        output-side one (y), dy and the indices.
    IS_MAX: max pooling (else average). ADAPTIVE: PyTorch's adaptive windows (else regular).
    COUNT_PAD: average pooling counts padding taps in the divisor. OVERRIDE: divide by `divisor`.
    INDEX: which indices to store (forward) or compare with (backward).
    ACC: accumulation dtype (fp32; fp64 for fp64 tensors). INDEX_64: int64 offsets.
    UNROLL: the tap (forward) or candidate (backward) counts are constexprs; their loops unroll.
    BLOCK_P (or BLOCK_S, window taps), BLOCK_C: tile sizes along positions and channels.
    BLOCK_H, BLOCK_W: tile sizes along a plane's rows and columns.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...core.numerics import convert
from .common import INDEX_FLAT, INDEX_LOCAL

_INDEX_FLAT: tl.constexpr = tl.constexpr(INDEX_FLAT)
_INDEX_LOCAL: tl.constexpr = tl.constexpr(INDEX_LOCAL)

# ---------------------------------------------------------------------------------------------
# Window geometry along one dimension (see ``common``): where a window starts, where its taps
# land, which windows contain an input, and how many taps an average divides by.


@triton.jit
def _window_start(o, size, out, S, P, ADAPTIVE: tl.constexpr):
    if ADAPTIVE:
        return (o * size) // out
    else:
        return o * S - P


@triton.jit
def _tap(start, k, o, size, out, DIL, ADAPTIVE: tl.constexpr):
    """Input index of tap ``k`` of the window of output ``o``, and whether the window has it
    inside the input (padding taps and an adaptive window's short end are not)."""
    if ADAPTIVE:
        pos = start + k
        return pos, pos < ((o + 1) * size + out - 1) // out
    else:
        pos = start + k * DIL
        return pos, (pos >= 0) & (pos < size)


@triton.jit
def _candidate(i, j, size, out, S, P, DIL, K, ADAPTIVE: tl.constexpr):
    """The ``j``-th output whose window may contain input ``i``: (o, the tap of i in it, whether
    it does). Candidates run upwards from the first window that can reach i."""
    if ADAPTIVE:
        o = (i * out) // size + j
        start = (o * size) // out
        inside = (o < out) & (i >= start) & (i < ((o + 1) * size + out - 1) // out)
        return o, i - start, inside
    else:
        reach = (K - 1) * DIL
        o = (tl.maximum(i + P - reach, 0) + S - 1) // S + j
        r = i + P - o * S
        inside = (o < out) & (r >= 0) & (r <= reach) & (r % DIL == 0)
        return o, r // DIL, inside


@triton.jit
def _avg_extent(o, size, out, S, P, K, ADAPTIVE: tl.constexpr, COUNT_PAD: tl.constexpr):
    """The window's length along one dimension as average pooling counts it (PyTorch's rule:
    with COUNT_PAD, the window clipped to the padded input, else to the input)."""
    if ADAPTIVE:
        return ((o + 1) * size + out - 1) // out - (o * size) // out
    else:
        start = o * S - P
        if COUNT_PAD:
            return tl.minimum(start + K, size + P) - start
        else:
            return tl.minimum(start + K, size) - tl.maximum(start, 0)


@triton.jit
def _divisor(
    od, oh, ow, ID, IH, IW, OD, OH, OW, SD, SH, SW, PD, PH, PW, KD, KH, KW, divisor,
    ADAPTIVE: tl.constexpr, COUNT_PAD: tl.constexpr, OVERRIDE: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """What an average window divides its sum by (at least 1: an empty window gives 0, as PyTorch)."""
    if OVERRIDE:
        return tl.cast(divisor, ACC)
    else:
        count = (
            _avg_extent(od, ID, OD, SD, PD, KD, ADAPTIVE, COUNT_PAD)
            * _avg_extent(oh, IH, OH, SH, PH, KH, ADAPTIVE, COUNT_PAD)
            * _avg_extent(ow, IW, OW, SW, PW, KW, ADAPTIVE, COUNT_PAD)
        )
        return tl.maximum(count, 1).to(ACC)


@triton.jit
def tile(C, P, INDEX_64: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program's positions [BLOCK_P, 1] and channels [1, BLOCK_C] of sample n, and their mask.
    Channel blocks vary fastest, so neighbouring programs share positions (and, channels_last,
    memory)."""
    pid = tl.program_id(0)
    c_blocks = tl.cdiv(C, BLOCK_C)
    p_blocks = tl.cdiv(P, BLOCK_P)
    cb = pid % c_blocks
    rest = pid // c_blocks
    p = (rest % p_blocks) * BLOCK_P + tl.arange(0, BLOCK_P)[:, None]
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
    n = rest // p_blocks
    if INDEX_64:
        p = p.to(tl.int64)
        c = c.to(tl.int64)
        n = n.to(tl.int64)
    return p, c, n, (p < P) & (c < C)


@triton.jit
def split(p, H, W):
    """(d, h, w) of flat positions over a (D, H, W) box."""
    w = p % W
    t = p // W
    return t // H, t % H, w


@triton.jit
def plane_tile(C, D, H, W, INDEX_64: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr):
    """Program's sample n, channel c and depth d (scalars), its rows [1, BLOCK_H] and columns
    [BLOCK_W, 1] of that (H, W) plane, and their mask. Column blocks vary fastest, then row blocks,
    so neighbouring programs read neighbouring (and, with overlapping windows, shared) rows."""
    pid = tl.program_id(0)
    w_blocks = tl.cdiv(W, BLOCK_W)
    h_blocks = tl.cdiv(H, BLOCK_H)
    rest = pid // w_blocks
    plane = rest // h_blocks
    # Columns on dim 0: where no address is known to be contiguous (strided taps), Triton's
    # coalescing runs lanes along dim 0, so lanes then read neighbouring columns of a row.
    h = (rest % h_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)[None, :]
    w = (pid % w_blocks) * BLOCK_W + tl.arange(0, BLOCK_W)[:, None]
    if INDEX_64:
        plane = plane.to(tl.int64)
        h = h.to(tl.int64)
        w = w.to(tl.int64)
    d = plane % D
    nc = plane // D
    return nc // C, nc % C, d, h, w, (h < H) & (w < W)


# ---------------------------------------------------------------------------------------------
# Forward: each lane pools one output's window, taps in PyTorch's order. UNROLL: the window
# size is a constexpr and the taps unroll (``tl.static_range``) so their loads issue together;
# else a loop over runtime counts (a plain ``range`` over constexpr counts is not unrolled).


@triton.jit
def _pool_tap(
    x_at, t, od, oh, ow, start_d, start_h, start_w, mask, best, arg, total,
    ID, IH, IW, OD, OH, OW, DD, DH, DW, xs_d, xs_h, xs_w, KH, KW,
    IS_MAX: tl.constexpr, ADAPTIVE: tl.constexpr, INDEX: tl.constexpr, ACC: tl.constexpr,
    CLAMP: tl.constexpr,
):  # fmt: skip
    """Fold tap t = (a * KH + b) * KW + e of each lane's window into (best, arg) or total."""
    a, b, e = split(t, KH, KW)
    i_d, ok_d = _tap(start_d, a, od, ID, OD, DD, ADAPTIVE)
    i_h, ok_h = _tap(start_h, b, oh, IH, OH, DH, ADAPTIVE)
    i_w, ok_w = _tap(start_w, e, ow, IW, OW, DW, ADAPTIVE)
    if CLAMP:
        at = x_at + _clamp(i_d, ID) * xs_d + _clamp(i_h, IH) * xs_h + _clamp(i_w, IW) * xs_w
        best = tl.maximum(best, convert(tl.load(at), ACC), propagate_nan=tl.PropagateNan.ALL)
    else:
        at = x_at + i_d * xs_d + i_h * xs_h + i_w * xs_w
        ok = mask & ok_d & ok_h & ok_w
        if IS_MAX and INDEX == 0:
            # The value alone: NaN-propagating max, padding as -inf.
            v = convert(tl.load(at, mask=ok, other=float("-inf")), ACC)
            best = tl.maximum(best, v, propagate_nan=tl.PropagateNan.ALL)
        elif IS_MAX:
            v = convert(tl.load(at, mask=ok, other=0.0), ACC)
            # PyTorch's rule: the first valid tap, then a strictly greater value or a NaN (so the
            # first maximum wins, and the last NaN).
            take = ok & ((v > best) | (v != v) | (arg < 0))
            best = tl.where(take, v, best)
            if INDEX == _INDEX_FLAT:
                arg = tl.where(take, ((i_d * IH + i_h) * IW + i_w).to(arg.dtype), arg)
            else:
                arg = tl.where(take, t, arg)
        else:
            total += convert(tl.load(at, mask=ok, other=0.0), ACC)
    return best, arg, total


@triton.jit
def _clamp(i, size):
    return tl.minimum(tl.maximum(i, 0), size - 1)


@triton.jit
def _window(
    x_at, od, oh, ow, mask, divisor,
    ID, IH, IW, OD, OH, OW, SD, SH, SW, PD, PH, PW, DD, DH, DW, xs_d, xs_h, xs_w,
    KD, KH, KW, UNROLL: tl.constexpr,
    IS_MAX: tl.constexpr, ADAPTIVE: tl.constexpr, COUNT_PAD: tl.constexpr, OVERRIDE: tl.constexpr,
    INDEX: tl.constexpr, ACC: tl.constexpr, INDEX_64: tl.constexpr, CLAMP: tl.constexpr,
):  # fmt: skip
    """(value, index) of the windows of outputs (od, oh, ow) (any broadcastable shapes, masked by
    ``mask``); x_at points at each lane's (n, c) plane. The index is INDEX's kind of the tap max
    pooling took; max pooling without indices and average pooling return an unused one.

    CLAMP (max pooling without indices, regular windows without dilation): every window is a
    run of inputs that meets the input, so a padding tap may read the nearest input instead, a
    duplicate of a window member that leaves the max unchanged; and lanes past the tile's end
    may pool the last output again. The loads then need no masks."""
    if CLAMP:
        od = tl.minimum(od, OD - 1)
        oh = tl.minimum(oh, OH - 1)
        ow = tl.minimum(ow, OW - 1)
    start_d = _window_start(od, ID, OD, SD, PD, ADAPTIVE)
    start_h = _window_start(oh, IH, OH, SH, PH, ADAPTIVE)
    start_w = _window_start(ow, IW, OW, SW, PW, ADAPTIVE)
    best = tl.full(mask.shape, float("-inf"), ACC)
    if INDEX_64:
        arg = tl.full(mask.shape, -1, tl.int64)
    else:
        arg = tl.full(mask.shape, -1, tl.int32)
    total = tl.zeros(mask.shape, ACC)
    if UNROLL:
        for t in tl.static_range(KD * KH * KW):
            best, arg, total = _pool_tap(
                x_at, t, od, oh, ow, start_d, start_h, start_w, mask, best, arg, total,
                ID, IH, IW, OD, OH, OW, DD, DH, DW, xs_d, xs_h, xs_w, KH, KW,
                IS_MAX, ADAPTIVE, INDEX, ACC, CLAMP,
            )  # fmt: skip
    else:
        for t in range(KD * KH * KW):
            best, arg, total = _pool_tap(
                x_at, t, od, oh, ow, start_d, start_h, start_w, mask, best, arg, total,
                ID, IH, IW, OD, OH, OW, DD, DH, DW, xs_d, xs_h, xs_w, KH, KW,
                IS_MAX, ADAPTIVE, INDEX, ACC, CLAMP,
            )  # fmt: skip
    if IS_MAX:
        return best, arg
    else:
        div = _divisor(od, oh, ow, ID, IH, IW, OD, OH, OW, SD, SH, SW, PD, PH, PW, KD, KH, KW, divisor,
                       ADAPTIVE, COUNT_PAD, OVERRIDE, ACC)  # fmt: skip
        return total / div, arg


@triton.jit
def _store_pooled(y_ptr, idx_ptr, y_off, value, arg, mask, IS_MAX: tl.constexpr, INDEX: tl.constexpr):
    tl.store(y_ptr + y_off, convert(value, y_ptr.dtype.element_ty), mask=mask)
    if IS_MAX and INDEX != 0:
        tl.store(idx_ptr + y_off, arg.to(idx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _forward_tiles(
    x_ptr, y_ptr, idx_ptr, divisor,
    C, ID, IH, IW, OD, OH, OW, SD, SH, SW, PD, PH, PW, DD, DH, DW,
    xs_n, xs_c, xs_d, xs_h, xs_w, ys_n, ys_c, ys_d, ys_h, ys_w,
    KD, KH, KW, UNROLL: tl.constexpr,
    IS_MAX: tl.constexpr, ADAPTIVE: tl.constexpr, COUNT_PAD: tl.constexpr, OVERRIDE: tl.constexpr,
    INDEX: tl.constexpr, ACC: tl.constexpr, INDEX_64: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    p, c, n, mask = tile(C, OD * OH * OW, INDEX_64, BLOCK_P, BLOCK_C)
    od, oh, ow = split(p, OH, OW)
    value, arg = _window(
        x_ptr + n * xs_n + c * xs_c, od, oh, ow, mask, divisor,
        ID, IH, IW, OD, OH, OW, SD, SH, SW, PD, PH, PW, DD, DH, DW, xs_d, xs_h, xs_w,
        KD, KH, KW, UNROLL, IS_MAX, ADAPTIVE, COUNT_PAD, OVERRIDE, INDEX, ACC, INDEX_64, False,
    )  # fmt: skip
    y_off = n * ys_n + c * ys_c + od * ys_d + oh * ys_h + ow * ys_w
    _store_pooled(y_ptr, idx_ptr, y_off, value, arg, mask, IS_MAX, INDEX)


@triton.jit
def forward_kernel(
    x_ptr, y_ptr, idx_ptr, divisor,
    C, ID, IH, IW, OD, OH, OW, SD, SH, SW, PD, PH, PW, DD, DH, DW,
    xs_n, xs_c, xs_d, xs_h, xs_w, ys_n, ys_c, ys_d, ys_h, ys_w,
    KD, KH, KW,
    IS_MAX: tl.constexpr, ADAPTIVE: tl.constexpr, COUNT_PAD: tl.constexpr, OVERRIDE: tl.constexpr,
    INDEX: tl.constexpr, ACC: tl.constexpr, INDEX_64: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Direct forward over [positions x channels] tiles, the window size as runtime ints: one
    compiled kernel for any geometry."""
    _forward_tiles(
        x_ptr, y_ptr, idx_ptr, divisor, C, ID, IH, IW, OD, OH, OW, SD, SH, SW, PD, PH, PW, DD, DH, DW,
        xs_n, xs_c, xs_d, xs_h, xs_w, ys_n, ys_c, ys_d, ys_h, ys_w, KD, KH, KW, False,
        IS_MAX, ADAPTIVE, COUNT_PAD, OVERRIDE, INDEX, ACC, INDEX_64, BLOCK_P, BLOCK_C,
    )  # fmt: skip


@triton.jit
def forward_unrolled_kernel(
    x_ptr, y_ptr, idx_ptr, divisor,
    C, ID, IH, IW, OD, OH, OW, SD, SH, SW, PD, PH, PW, DD, DH, DW,
    xs_n, xs_c, xs_d, xs_h, xs_w, ys_n, ys_c, ys_d, ys_h, ys_w,
    KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
    IS_MAX: tl.constexpr, ADAPTIVE: tl.constexpr, COUNT_PAD: tl.constexpr, OVERRIDE: tl.constexpr,
    INDEX: tl.constexpr, ACC: tl.constexpr, INDEX_64: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Direct forward over [positions x channels] tiles with the window size compiled in and its
    taps unrolled."""
    _forward_tiles(
        x_ptr, y_ptr, idx_ptr, divisor, C, ID, IH, IW, OD, OH, OW, SD, SH, SW, PD, PH, PW, DD, DH, DW,
        xs_n, xs_c, xs_d, xs_h, xs_w, ys_n, ys_c, ys_d, ys_h, ys_w, KD, KH, KW, True,
        IS_MAX, ADAPTIVE, COUNT_PAD, OVERRIDE, INDEX, ACC, INDEX_64, BLOCK_P, BLOCK_C,
    )  # fmt: skip


@triton.jit
def plane_forward_kernel(
    x_ptr, y_ptr, idx_ptr, divisor,
    C, xs_n, xs_c, xs_d, xs_h, xs_w, ys_n, ys_c, ys_d, ys_h, ys_w,
    ID: tl.constexpr, IH: tl.constexpr, IW: tl.constexpr, OD: tl.constexpr, OH: tl.constexpr,
    OW: tl.constexpr, SD: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr, PD: tl.constexpr,
    PH: tl.constexpr, PW: tl.constexpr, DD: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
    KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
    IS_MAX: tl.constexpr, ADAPTIVE: tl.constexpr, COUNT_PAD: tl.constexpr, OVERRIDE: tl.constexpr,
    INDEX: tl.constexpr, ACC: tl.constexpr, INDEX_64: tl.constexpr, CLAMP: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    """Forward over [rows x columns] tiles of one output plane, taps unrolled. The geometry is
    compiled in (one kernel per pooling layer's shape, as a runtime-compiled engine): window
    positions and bounds fold into constants and shifts."""
    n, c, od, oh, ow, mask = plane_tile(C, OD, OH, OW, INDEX_64, BLOCK_H, BLOCK_W)
    value, arg = _window(
        x_ptr + n * xs_n + c * xs_c, od, oh, ow, mask, divisor,
        ID, IH, IW, OD, OH, OW, SD, SH, SW, PD, PH, PW, DD, DH, DW, xs_d, xs_h, xs_w,
        KD, KH, KW, True, IS_MAX, ADAPTIVE, COUNT_PAD, OVERRIDE, INDEX, ACC, INDEX_64, CLAMP,
    )  # fmt: skip
    y_off = n * ys_n + c * ys_c + od * ys_d + oh * ys_h + ow * ys_w
    _store_pooled(y_ptr, idx_ptr, y_off, value, arg, mask, IS_MAX, INDEX)


# ---------------------------------------------------------------------------------------------
# Backward: each lane gathers one input element's gradient from the windows that contain it.


@triton.jit
def _gather_candidate(
    dy_at, idx_at, t, i_d, i_h, i_w, mask, divisor, total,
    ID, IH, IW, OD, OH, OW, SD, SH, SW, PD, PH, PW, DD, DH, DW,
    gs_d, gs_h, gs_w, is_d, is_h, is_w, KD, KH, KW, NH, NW,
    IS_MAX: tl.constexpr, ADAPTIVE: tl.constexpr, COUNT_PAD: tl.constexpr, OVERRIDE: tl.constexpr,
    INDEX: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """Add candidate window t = (a * NH + b) * NW + e's share of dy to each lane's total."""
    a, b, e = split(t, NH, NW)
    od, t_d, ok_d = _candidate(i_d, a, ID, OD, SD, PD, DD, KD, ADAPTIVE)
    oh, t_h, ok_h = _candidate(i_h, b, IH, OH, SH, PH, DH, KH, ADAPTIVE)
    ow, t_w, ok_w = _candidate(i_w, e, IW, OW, SW, PW, DW, KW, ADAPTIVE)
    ok = mask & ok_d & ok_h & ok_w
    g = convert(tl.load(dy_at + od * gs_d + oh * gs_h + ow * gs_w, mask=ok, other=0.0), ACC)
    if IS_MAX:
        saved = tl.load(idx_at + od * is_d + oh * is_h + ow * is_w, mask=ok, other=-1)
        if INDEX == _INDEX_FLAT:
            hit = saved == (i_d * IH + i_h) * IW + i_w
        else:
            hit = saved == (t_d * KH + t_h) * KW + t_w
        total += tl.where(ok & hit, g, 0.0)
    else:
        div = _divisor(od, oh, ow, ID, IH, IW, OD, OH, OW, SD, SH, SW, PD, PH, PW, KD, KH, KW, divisor,
                       ADAPTIVE, COUNT_PAD, OVERRIDE, ACC)  # fmt: skip
        total += tl.where(ok, g / div, 0.0)
    return total


@triton.jit
def _gather(
    dy_at, idx_at, i_d, i_h, i_w, mask, divisor,
    ID, IH, IW, OD, OH, OW, SD, SH, SW, PD, PH, PW, DD, DH, DW,
    gs_d, gs_h, gs_w, is_d, is_h, is_w,
    KD, KH, KW, ND, NH, NW, UNROLL: tl.constexpr,
    IS_MAX: tl.constexpr, ADAPTIVE: tl.constexpr, COUNT_PAD: tl.constexpr, OVERRIDE: tl.constexpr,
    INDEX: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """The input gradient at (i_d, i_h, i_w) (broadcastable shapes, masked by ``mask``); dy_at
    and idx_at point at each lane's (n, c) plane of dy and of the indices. UNROLL: the candidate
    counts are constexprs and the candidates unroll."""
    total = tl.zeros(mask.shape, ACC)
    if UNROLL:
        for t in tl.static_range(ND * NH * NW):
            total = _gather_candidate(
                dy_at, idx_at, t, i_d, i_h, i_w, mask, divisor, total,
                ID, IH, IW, OD, OH, OW, SD, SH, SW, PD, PH, PW, DD, DH, DW,
                gs_d, gs_h, gs_w, is_d, is_h, is_w, KD, KH, KW, NH, NW,
                IS_MAX, ADAPTIVE, COUNT_PAD, OVERRIDE, INDEX, ACC,
            )  # fmt: skip
    else:
        for t in range(ND * NH * NW):
            total = _gather_candidate(
                dy_at, idx_at, t, i_d, i_h, i_w, mask, divisor, total,
                ID, IH, IW, OD, OH, OW, SD, SH, SW, PD, PH, PW, DD, DH, DW,
                gs_d, gs_h, gs_w, is_d, is_h, is_w, KD, KH, KW, NH, NW,
                IS_MAX, ADAPTIVE, COUNT_PAD, OVERRIDE, INDEX, ACC,
            )  # fmt: skip
    return total


@triton.jit
def _backward_tiles(
    dy_ptr, idx_ptr, dx_ptr, divisor,
    C, ID, IH, IW, OD, OH, OW, SD, SH, SW, PD, PH, PW, DD, DH, DW,
    xs_n, xs_c, xs_d, xs_h, xs_w, gs_n, gs_c, gs_d, gs_h, gs_w, is_n, is_c, is_d, is_h, is_w,
    KD, KH, KW, ND, NH, NW, UNROLL: tl.constexpr,
    IS_MAX: tl.constexpr, ADAPTIVE: tl.constexpr, COUNT_PAD: tl.constexpr, OVERRIDE: tl.constexpr,
    INDEX: tl.constexpr, ACC: tl.constexpr, INDEX_64: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    p, c, n, mask = tile(C, ID * IH * IW, INDEX_64, BLOCK_P, BLOCK_C)
    i_d, i_h, i_w = split(p, IH, IW)
    total = _gather(
        dy_ptr + n * gs_n + c * gs_c, idx_ptr + n * is_n + c * is_c, i_d, i_h, i_w, mask, divisor,
        ID, IH, IW, OD, OH, OW, SD, SH, SW, PD, PH, PW, DD, DH, DW, gs_d, gs_h, gs_w, is_d, is_h, is_w,
        KD, KH, KW, ND, NH, NW, UNROLL, IS_MAX, ADAPTIVE, COUNT_PAD, OVERRIDE, INDEX, ACC,
    )  # fmt: skip
    dx_off = n * xs_n + c * xs_c + i_d * xs_d + i_h * xs_h + i_w * xs_w
    tl.store(dx_ptr + dx_off, convert(total, dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def backward_kernel(
    dy_ptr, idx_ptr, dx_ptr, divisor,
    C, ID, IH, IW, OD, OH, OW, SD, SH, SW, PD, PH, PW, DD, DH, DW,
    xs_n, xs_c, xs_d, xs_h, xs_w, gs_n, gs_c, gs_d, gs_h, gs_w, is_n, is_c, is_d, is_h, is_w,
    KD, KH, KW, ND, NH, NW,
    IS_MAX: tl.constexpr, ADAPTIVE: tl.constexpr, COUNT_PAD: tl.constexpr, OVERRIDE: tl.constexpr,
    INDEX: tl.constexpr, ACC: tl.constexpr, INDEX_64: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Direct backward over [positions x channels] tiles, window and candidate counts as runtime ints."""
    _backward_tiles(
        dy_ptr, idx_ptr, dx_ptr, divisor, C, ID, IH, IW, OD, OH, OW, SD, SH, SW, PD, PH, PW, DD, DH, DW,
        xs_n, xs_c, xs_d, xs_h, xs_w, gs_n, gs_c, gs_d, gs_h, gs_w, is_n, is_c, is_d, is_h, is_w,
        KD, KH, KW, ND, NH, NW, False,
        IS_MAX, ADAPTIVE, COUNT_PAD, OVERRIDE, INDEX, ACC, INDEX_64, BLOCK_P, BLOCK_C,
    )  # fmt: skip


@triton.jit
def backward_unrolled_kernel(
    dy_ptr, idx_ptr, dx_ptr, divisor,
    C, ID, IH, IW, OD, OH, OW, SD, SH, SW, PD, PH, PW, DD, DH, DW,
    xs_n, xs_c, xs_d, xs_h, xs_w, gs_n, gs_c, gs_d, gs_h, gs_w, is_n, is_c, is_d, is_h, is_w,
    KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
    ND: tl.constexpr, NH: tl.constexpr, NW: tl.constexpr,
    IS_MAX: tl.constexpr, ADAPTIVE: tl.constexpr, COUNT_PAD: tl.constexpr, OVERRIDE: tl.constexpr,
    INDEX: tl.constexpr, ACC: tl.constexpr, INDEX_64: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Direct backward with the counts compiled in and the candidates unrolled. Non-overlapping
    windows (stride >= extent) give one candidate per dimension: a one-to-one gather."""
    _backward_tiles(
        dy_ptr, idx_ptr, dx_ptr, divisor, C, ID, IH, IW, OD, OH, OW, SD, SH, SW, PD, PH, PW, DD, DH, DW,
        xs_n, xs_c, xs_d, xs_h, xs_w, gs_n, gs_c, gs_d, gs_h, gs_w, is_n, is_c, is_d, is_h, is_w,
        KD, KH, KW, ND, NH, NW, True,
        IS_MAX, ADAPTIVE, COUNT_PAD, OVERRIDE, INDEX, ACC, INDEX_64, BLOCK_P, BLOCK_C,
    )  # fmt: skip


@triton.jit
def plane_backward_kernel(
    dy_ptr, idx_ptr, dx_ptr, divisor,
    C, xs_n, xs_c, xs_d, xs_h, xs_w, gs_n, gs_c, gs_d, gs_h, gs_w, is_n, is_c, is_d, is_h, is_w,
    ID: tl.constexpr, IH: tl.constexpr, IW: tl.constexpr, OD: tl.constexpr, OH: tl.constexpr,
    OW: tl.constexpr, SD: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr, PD: tl.constexpr,
    PH: tl.constexpr, PW: tl.constexpr, DD: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
    KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
    ND: tl.constexpr, NH: tl.constexpr, NW: tl.constexpr,
    IS_MAX: tl.constexpr, ADAPTIVE: tl.constexpr, COUNT_PAD: tl.constexpr, OVERRIDE: tl.constexpr,
    INDEX: tl.constexpr, ACC: tl.constexpr, INDEX_64: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    """Backward over [rows x columns] tiles of one input plane, candidates unrolled, geometry
    compiled in (as ``plane_forward_kernel``)."""
    n, c, i_d, i_h, i_w, mask = plane_tile(C, ID, IH, IW, INDEX_64, BLOCK_H, BLOCK_W)
    total = _gather(
        dy_ptr + n * gs_n + c * gs_c, idx_ptr + n * is_n + c * is_c, i_d, i_h, i_w, mask, divisor,
        ID, IH, IW, OD, OH, OW, SD, SH, SW, PD, PH, PW, DD, DH, DW, gs_d, gs_h, gs_w, is_d, is_h, is_w,
        KD, KH, KW, ND, NH, NW, True, IS_MAX, ADAPTIVE, COUNT_PAD, OVERRIDE, INDEX, ACC,
    )  # fmt: skip
    dx_off = n * xs_n + c * xs_c + i_d * xs_d + i_h * xs_h + i_w * xs_w
    tl.store(dx_ptr + dx_off, convert(total, dx_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------
# Window reduction (forward): a program reduces one output position's window for BLOCK_C
# channels, BLOCK_S taps at a time: coalesced along a window row for contiguous tensors, along
# channels for channels_last ones. For large windows: global and adaptive pooling to small sizes.
# When outputs are too few to fill the GPU, SPLIT programs share a window, CHUNK taps each, and
# write partial results (ACC value or sum, int32 tap) that ``window_merge_kernel`` combines in
# tap order: no atomics, so the same bits on every run.


@triton.jit
def _reduce_position(C, OD, OH, OW, INDEX_64: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program's output position (od, oh, ow), sample n, channels [BLOCK_C] and split index,
    from program ids (position and channel block, split)."""
    pid = tl.program_id(0)
    c_blocks = tl.cdiv(C, BLOCK_C)
    rest = pid // c_blocks
    c = (pid % c_blocks) * BLOCK_C + tl.arange(0, BLOCK_C)
    p = rest % (OD * OH * OW)
    n = rest // (OD * OH * OW)
    if INDEX_64:
        p = p.to(tl.int64)
        c = c.to(tl.int64)
        n = n.to(tl.int64)
    od, oh, ow = split(p, OH, OW)
    return od, oh, ow, n, c, rest


@triton.jit
def _finish_window(
    y_ptr, idx_ptr, divisor, value, chosen, od, oh, ow, n, c,
    C, ID, IH, IW, OD, OH, OW, SD, SH, SW, PD, PH, PW, DD, DH, DW, ys_n, ys_c, ys_d, ys_h, ys_w,
    KD, KH, KW,
    IS_MAX: tl.constexpr, ADAPTIVE: tl.constexpr, COUNT_PAD: tl.constexpr, OVERRIDE: tl.constexpr,
    INDEX: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """Store a window's max (and the index of its tap ``chosen``, in window order) or its sum
    divided as average pooling divides it."""
    y_off = n * ys_n + c * ys_c + od * ys_d + oh * ys_h + ow * ys_w
    if IS_MAX:
        tl.store(y_ptr + y_off, convert(value, y_ptr.dtype.element_ty), mask=c < C)
        if INDEX == _INDEX_FLAT:
            a, b, e = split(chosen, KH, KW)
            i_d, _ = _tap(_window_start(od, ID, OD, SD, PD, ADAPTIVE), a, od, ID, OD, DD, ADAPTIVE)
            i_h, _ = _tap(_window_start(oh, IH, OH, SH, PH, ADAPTIVE), b, oh, IH, OH, DH, ADAPTIVE)
            i_w, _ = _tap(_window_start(ow, IW, OW, SW, PW, ADAPTIVE), e, ow, IW, OW, DW, ADAPTIVE)
            tl.store(idx_ptr + y_off, ((i_d * IH + i_h) * IW + i_w).to(tl.int64), mask=c < C)
        elif INDEX == _INDEX_LOCAL:
            tl.store(idx_ptr + y_off, chosen.to(tl.int8), mask=c < C)
    else:
        div = _divisor(od, oh, ow, ID, IH, IW, OD, OH, OW, SD, SH, SW, PD, PH, PW, KD, KH, KW, divisor,
                       ADAPTIVE, COUNT_PAD, OVERRIDE, ACC)  # fmt: skip
        tl.store(y_ptr + y_off, convert(value / div, y_ptr.dtype.element_ty), mask=c < C)


@triton.jit
def window_reduce_kernel(
    x_ptr, y_ptr, idx_ptr, part_ptr, part_idx_ptr, divisor,
    C, ID, IH, IW, OD, OH, OW, SD, SH, SW, PD, PH, PW, DD, DH, DW,
    xs_n, xs_c, xs_d, xs_h, xs_w, ys_n, ys_c, ys_d, ys_h, ys_w,
    KD, KH, KW, CHUNK, SPLIT,
    IS_MAX: tl.constexpr, ADAPTIVE: tl.constexpr, COUNT_PAD: tl.constexpr, OVERRIDE: tl.constexpr,
    INDEX: tl.constexpr, ACC: tl.constexpr, INDEX_64: tl.constexpr, PARTIAL: tl.constexpr,
    FLAT: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Each tap lane keeps its own running max (PyTorch's rule over its taps, in window order) or
    sum; lanes merge at the end: any NaN gives the last NaN's tap, else the first maximum's.
    PARTIAL: reduce taps [CHUNK * s, CHUNK * (s + 1)) for split s = program_id(1) into part_ptr
    and part_idx_ptr ([SPLIT, positions, C], position = n * OD * OH * OW + p). FLAT: the window
    is the whole input, its positions evenly strided by xs_w (global pooling of a packed tensor):
    tap s is at s * xs_w, no coordinates needed."""
    od, oh, ow, n, c, position = _reduce_position(C, OD, OH, OW, INDEX_64, BLOCK_C)
    start_d = _window_start(od, ID, OD, SD, PD, ADAPTIVE)
    start_h = _window_start(oh, IH, OH, SH, PH, ADAPTIVE)
    start_w = _window_start(ow, IW, OW, SW, PW, ADAPTIVE)
    x_at = x_ptr + n * xs_n + c[None, :] * xs_c
    c_ok = (c < C)[None, :]
    taps = KD * KH * KW
    first = tl.program_id(1) * CHUNK
    stop = tl.minimum(first + CHUNK, taps)
    best = tl.full([BLOCK_S, BLOCK_C], float("-inf"), ACC)
    arg = tl.full([BLOCK_S, BLOCK_C], -1, tl.int32)
    total = tl.zeros([BLOCK_S, BLOCK_C], ACC)
    for s0 in range(first, stop, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)[:, None]  # the tap (a * KH + b) * KW + e, in window order
        if FLAT:
            ok = (s < stop) & c_ok
            at = x_at + s * xs_w
        else:
            a, b, e = split(s, KH, KW)
            i_d, ok_d = _tap(start_d, a, od, ID, OD, DD, ADAPTIVE)
            i_h, ok_h = _tap(start_h, b, oh, IH, OH, DH, ADAPTIVE)
            i_w, ok_w = _tap(start_w, e, ow, IW, OW, DW, ADAPTIVE)
            ok = (s < stop) & ok_d & ok_h & ok_w & c_ok
            at = x_at + i_d * xs_d + i_h * xs_h + i_w * xs_w
        v = convert(tl.load(at, mask=ok, other=0.0), ACC)
        if IS_MAX:
            take = ok & ((v > best) | (v != v) | (arg < 0))
            best = tl.where(take, v, best)
            arg = tl.where(take, s, arg)
        else:
            total += v
    if IS_MAX:
        seen = arg >= 0
        nan = seen & (best != best)
        any_nan = tl.max(nan.to(tl.int32), 0) > 0
        last_nan = tl.max(tl.where(nan, arg, -1), 0)
        top = tl.max(tl.where(seen & ~nan, best, float("-inf")), 0)
        first_top = tl.min(tl.where(seen & ~nan & (best == top[None, :]), arg, taps), 0)
        chosen = tl.where(any_nan, last_nan, first_top)  # taps when no tap was seen
        value = tl.where(any_nan, float("nan"), top)
    else:
        chosen = tl.zeros([BLOCK_C], tl.int32)
        value = tl.sum(total, 0)
    if PARTIAL:
        at = (tl.program_id(1) * (tl.num_programs(0) // tl.cdiv(C, BLOCK_C)) + position) * C + c
        tl.store(part_ptr + at, value, mask=c < C)
        if IS_MAX:
            tl.store(part_idx_ptr + at, chosen, mask=c < C)
    else:
        _finish_window(
            y_ptr, idx_ptr, divisor, value, chosen, od, oh, ow, n, c,
            C, ID, IH, IW, OD, OH, OW, SD, SH, SW, PD, PH, PW, DD, DH, DW, ys_n, ys_c, ys_d, ys_h, ys_w,
            KD, KH, KW, IS_MAX, ADAPTIVE, COUNT_PAD, OVERRIDE, INDEX, ACC,
        )  # fmt: skip


@triton.jit
def window_merge_kernel(
    x_ptr, y_ptr, idx_ptr, part_ptr, part_idx_ptr, divisor,
    C, ID, IH, IW, OD, OH, OW, SD, SH, SW, PD, PH, PW, DD, DH, DW,
    xs_n, xs_c, xs_d, xs_h, xs_w, ys_n, ys_c, ys_d, ys_h, ys_w,
    KD, KH, KW, CHUNK, SPLIT,
    IS_MAX: tl.constexpr, ADAPTIVE: tl.constexpr, COUNT_PAD: tl.constexpr, OVERRIDE: tl.constexpr,
    INDEX: tl.constexpr, ACC: tl.constexpr, INDEX_64: tl.constexpr, PARTIAL: tl.constexpr,
    FLAT: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Combine window_reduce_kernel's SPLIT partial results per output in split (= tap) order:
    sums add up; maxima keep the first maximum, unless a NaN came (then the last NaN's tap).
    Takes window_reduce_kernel's arguments (x_ptr unused)."""
    od, oh, ow, n, c, position = _reduce_position(C, OD, OH, OW, INDEX_64, BLOCK_C)
    positions = tl.num_programs(0) // tl.cdiv(C, BLOCK_C)
    taps = KD * KH * KW
    if IS_MAX:
        value = tl.full([BLOCK_C], float("-inf"), ACC)
    else:
        value = tl.zeros([BLOCK_C], ACC)
    chosen = tl.full([BLOCK_C], taps, tl.int32)
    for s in range(SPLIT):
        at = (s * positions + position) * C + c
        v = tl.load(part_ptr + at, mask=c < C, other=0.0)
        if IS_MAX:
            t = tl.load(part_idx_ptr + at, mask=c < C, other=taps)
            take = (t < taps) & ((v != v) | ((value == value) & ((v > value) | (chosen == taps))))
            value = tl.where(take, v, value)
            chosen = tl.where(take, t, chosen)
        else:
            value += v
    _finish_window(
        y_ptr, idx_ptr, divisor, value, chosen, od, oh, ow, n, c,
        C, ID, IH, IW, OD, OH, OW, SD, SH, SW, PD, PH, PW, DD, DH, DW, ys_n, ys_c, ys_d, ys_h, ys_w,
        KD, KH, KW, IS_MAX, ADAPTIVE, COUNT_PAD, OVERRIDE, INDEX, ACC,
    )  # fmt: skip
