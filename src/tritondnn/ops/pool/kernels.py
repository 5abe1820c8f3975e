"""Triton kernels of max, average and adaptive pooling, forward and backward.

Tensors are addressed as (N, C, D, H, W) through their strides (``common.strides5``), so NCHW,
channels_last and sliced inputs are read in place. Direct kernels work on [BLOCK_P, BLOCK_C]
tiles: BLOCK_P positions of one sample (outputs forward, inputs backward) by BLOCK_C channels,
coalesced along positions for contiguous tensors and along channels for channels_last ones.

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
    BLOCK_P (or BLOCK_S, window taps), BLOCK_C: tile sizes along positions and channels.
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


# ---------------------------------------------------------------------------------------------
# Direct forward: one output element per tile lane, its window's taps in PyTorch's order.


@triton.jit
def _forward_body(
    x_ptr, y_ptr, idx_ptr, divisor,
    C, ID, IH, IW, OD, OH, OW, SD, SH, SW, PD, PH, PW, DD, DH, DW,
    xs_n, xs_c, xs_d, xs_h, xs_w, ys_n, ys_c, ys_d, ys_h, ys_w,
    KD, KH, KW,
    IS_MAX: tl.constexpr, ADAPTIVE: tl.constexpr, COUNT_PAD: tl.constexpr, OVERRIDE: tl.constexpr,
    INDEX: tl.constexpr, ACC: tl.constexpr, INDEX_64: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    p, c, n, mask = tile(C, OD * OH * OW, INDEX_64, BLOCK_P, BLOCK_C)
    od, oh, ow = split(p, OH, OW)
    start_d = _window_start(od, ID, OD, SD, PD, ADAPTIVE)
    start_h = _window_start(oh, IH, OH, SH, PH, ADAPTIVE)
    start_w = _window_start(ow, IW, OW, SW, PW, ADAPTIVE)
    x_at = x_ptr + n * xs_n + c * xs_c
    best = tl.full([BLOCK_P, BLOCK_C], float("-inf"), ACC)
    if INDEX_64:
        arg = tl.full([BLOCK_P, BLOCK_C], -1, tl.int64)
    else:
        arg = tl.full([BLOCK_P, BLOCK_C], -1, tl.int32)
    total = tl.zeros([BLOCK_P, BLOCK_C], ACC)
    for a in range(KD):
        i_d, ok_d = _tap(start_d, a, od, ID, OD, DD, ADAPTIVE)
        for b in range(KH):
            i_h, ok_h = _tap(start_h, b, oh, IH, OH, DH, ADAPTIVE)
            for e in range(KW):
                i_w, ok_w = _tap(start_w, e, ow, IW, OW, DW, ADAPTIVE)
                ok = mask & ok_d & ok_h & ok_w
                v = convert(tl.load(x_at + i_d * xs_d + i_h * xs_h + i_w * xs_w, mask=ok, other=0.0), ACC)
                if IS_MAX:
                    # PyTorch's rule: the first valid tap, then a strictly greater value or a NaN
                    # (so the first maximum wins, and the last NaN).
                    take = ok & ((v > best) | (v != v) | (arg < 0))
                    best = tl.where(take, v, best)
                    if INDEX == _INDEX_FLAT:
                        at = (i_d * IH + i_h) * IW + i_w
                    else:
                        at = (a * KH + b) * KW + e
                    arg = tl.where(take, at.to(arg.dtype), arg)
                else:
                    total += v
    y_off = n * ys_n + c * ys_c + od * ys_d + oh * ys_h + ow * ys_w
    if IS_MAX:
        tl.store(y_ptr + y_off, convert(best, y_ptr.dtype.element_ty), mask=mask)
        if INDEX != 0:
            tl.store(idx_ptr + y_off, arg.to(idx_ptr.dtype.element_ty), mask=mask)
    else:
        div = _divisor(od, oh, ow, ID, IH, IW, OD, OH, OW, SD, SH, SW, PD, PH, PW, KD, KH, KW, divisor,
                       ADAPTIVE, COUNT_PAD, OVERRIDE, ACC)  # fmt: skip
        tl.store(y_ptr + y_off, convert(total / div, y_ptr.dtype.element_ty), mask=mask)


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
    """Direct forward with the window size as runtime ints: one compiled kernel for any geometry."""
    _forward_body(
        x_ptr, y_ptr, idx_ptr, divisor, C, ID, IH, IW, OD, OH, OW, SD, SH, SW, PD, PH, PW, DD, DH, DW,
        xs_n, xs_c, xs_d, xs_h, xs_w, ys_n, ys_c, ys_d, ys_h, ys_w, KD, KH, KW,
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
    """Direct forward with the window size compiled in: constant trip counts, so the compiler
    unrolls the taps and issues their loads together."""
    _forward_body(
        x_ptr, y_ptr, idx_ptr, divisor, C, ID, IH, IW, OD, OH, OW, SD, SH, SW, PD, PH, PW, DD, DH, DW,
        xs_n, xs_c, xs_d, xs_h, xs_w, ys_n, ys_c, ys_d, ys_h, ys_w, KD, KH, KW,
        IS_MAX, ADAPTIVE, COUNT_PAD, OVERRIDE, INDEX, ACC, INDEX_64, BLOCK_P, BLOCK_C,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Direct backward: one input element per tile lane, gathering from the windows that contain it.


@triton.jit
def _backward_body(
    dy_ptr, idx_ptr, dx_ptr, divisor,
    C, ID, IH, IW, OD, OH, OW, SD, SH, SW, PD, PH, PW, DD, DH, DW,
    xs_n, xs_c, xs_d, xs_h, xs_w, gs_n, gs_c, gs_d, gs_h, gs_w, is_n, is_c, is_d, is_h, is_w,
    KD, KH, KW, ND, NH, NW,
    IS_MAX: tl.constexpr, ADAPTIVE: tl.constexpr, COUNT_PAD: tl.constexpr, OVERRIDE: tl.constexpr,
    INDEX: tl.constexpr, ACC: tl.constexpr, INDEX_64: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    p, c, n, mask = tile(C, ID * IH * IW, INDEX_64, BLOCK_P, BLOCK_C)
    i_d, i_h, i_w = split(p, IH, IW)
    dy_at = dy_ptr + n * gs_n + c * gs_c
    idx_at = idx_ptr + n * is_n + c * is_c
    total = tl.zeros([BLOCK_P, BLOCK_C], ACC)
    for a in range(ND):
        od, t_d, ok_d = _candidate(i_d, a, ID, OD, SD, PD, DD, KD, ADAPTIVE)
        for b in range(NH):
            oh, t_h, ok_h = _candidate(i_h, b, IH, OH, SH, PH, DH, KH, ADAPTIVE)
            for e in range(NW):
                ow, t_w, ok_w = _candidate(i_w, e, IW, OW, SW, PW, DW, KW, ADAPTIVE)
                ok = mask & ok_d & ok_h & ok_w
                g = convert(tl.load(dy_at + od * gs_d + oh * gs_h + ow * gs_w, mask=ok, other=0.0), ACC)
                if IS_MAX:
                    saved = tl.load(idx_at + od * is_d + oh * is_h + ow * is_w, mask=ok, other=-1)
                    if INDEX == _INDEX_FLAT:
                        hit = saved == p  # the flat position within the plane is the lane's p
                    else:
                        hit = saved == (t_d * KH + t_h) * KW + t_w
                    total += tl.where(ok & hit, g, 0.0)
                else:
                    div = _divisor(od, oh, ow, ID, IH, IW, OD, OH, OW, SD, SH, SW, PD, PH, PW, KD, KH, KW,
                                   divisor, ADAPTIVE, COUNT_PAD, OVERRIDE, ACC)  # fmt: skip
                    total += tl.where(ok, g / div, 0.0)
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
    """Direct backward with window and candidate counts as runtime ints."""
    _backward_body(
        dy_ptr, idx_ptr, dx_ptr, divisor, C, ID, IH, IW, OD, OH, OW, SD, SH, SW, PD, PH, PW, DD, DH, DW,
        xs_n, xs_c, xs_d, xs_h, xs_w, gs_n, gs_c, gs_d, gs_h, gs_w, is_n, is_c, is_d, is_h, is_w,
        KD, KH, KW, ND, NH, NW,
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
    """Direct backward with the counts compiled in. Non-overlapping windows (stride >= extent)
    give one candidate per dimension: a one-to-one gather with no loop left."""
    _backward_body(
        dy_ptr, idx_ptr, dx_ptr, divisor, C, ID, IH, IW, OD, OH, OW, SD, SH, SW, PD, PH, PW, DD, DH, DW,
        xs_n, xs_c, xs_d, xs_h, xs_w, gs_n, gs_c, gs_d, gs_h, gs_w, is_n, is_c, is_d, is_h, is_w,
        KD, KH, KW, ND, NH, NW,
        IS_MAX, ADAPTIVE, COUNT_PAD, OVERRIDE, INDEX, ACC, INDEX_64, BLOCK_P, BLOCK_C,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Window reduction (forward): a program reduces one output position's window for BLOCK_C
# channels, BLOCK_S taps at a time: coalesced along a window row for contiguous tensors, along
# channels for channels_last ones. For large windows: global and adaptive pooling to small sizes.


@triton.jit
def window_reduce_kernel(
    x_ptr, y_ptr, idx_ptr, divisor,
    C, ID, IH, IW, OD, OH, OW, SD, SH, SW, PD, PH, PW, DD, DH, DW,
    xs_n, xs_c, xs_d, xs_h, xs_w, ys_n, ys_c, ys_d, ys_h, ys_w,
    KD, KH, KW,
    IS_MAX: tl.constexpr, ADAPTIVE: tl.constexpr, COUNT_PAD: tl.constexpr, OVERRIDE: tl.constexpr,
    INDEX: tl.constexpr, ACC: tl.constexpr, INDEX_64: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Each tap lane keeps its own running max (PyTorch's rule over its taps, in window order) or
    sum; lanes merge at the end: any NaN gives the last NaN's tap, else the first maximum's."""
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
    start_d = _window_start(od, ID, OD, SD, PD, ADAPTIVE)
    start_h = _window_start(oh, IH, OH, SH, PH, ADAPTIVE)
    start_w = _window_start(ow, IW, OW, SW, PW, ADAPTIVE)
    x_at = x_ptr + n * xs_n + c[None, :] * xs_c
    c_ok = (c < C)[None, :]
    taps = KD * KH * KW
    best = tl.full([BLOCK_S, BLOCK_C], float("-inf"), ACC)
    arg = tl.full([BLOCK_S, BLOCK_C], -1, tl.int32)
    total = tl.zeros([BLOCK_S, BLOCK_C], ACC)
    for s0 in range(0, taps, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)[:, None]  # the tap (a * KH + b) * KW + e, in window order
        a, b, e = split(s, KH, KW)
        i_d, ok_d = _tap(start_d, a, od, ID, OD, DD, ADAPTIVE)
        i_h, ok_h = _tap(start_h, b, oh, IH, OH, DH, ADAPTIVE)
        i_w, ok_w = _tap(start_w, e, ow, IW, OW, DW, ADAPTIVE)
        ok = (s < taps) & ok_d & ok_h & ok_w & c_ok
        v = convert(tl.load(x_at + i_d * xs_d + i_h * xs_h + i_w * xs_w, mask=ok, other=0.0), ACC)
        if IS_MAX:
            take = ok & ((v > best) | (v != v) | (arg < 0))
            best = tl.where(take, v, best)
            arg = tl.where(take, s, arg)
        else:
            total += v
    y_off = n * ys_n + c * ys_c + od * ys_d + oh * ys_h + ow * ys_w
    if IS_MAX:
        seen = arg >= 0
        nan = seen & (best != best)
        any_nan = tl.max(nan.to(tl.int32), 0) > 0
        last_nan = tl.max(tl.where(nan, arg, -1), 0)
        top = tl.max(tl.where(seen & ~nan, best, float("-inf")), 0)
        first_top = tl.min(tl.where(seen & ~nan & (best == top[None, :]), arg, taps), 0)
        chosen = tl.where(any_nan, last_nan, first_top)
        value = tl.where(any_nan, float("nan"), top)
        tl.store(y_ptr + y_off, convert(value, y_ptr.dtype.element_ty), mask=c < C)
        if INDEX == _INDEX_FLAT:
            a, b, e = split(chosen, KH, KW)
            i_d, _ = _tap(start_d, a, od, ID, OD, DD, ADAPTIVE)
            i_h, _ = _tap(start_h, b, oh, IH, OH, DH, ADAPTIVE)
            i_w, _ = _tap(start_w, e, ow, IW, OW, DW, ADAPTIVE)
            tl.store(idx_ptr + y_off, ((i_d * IH + i_h) * IW + i_w).to(tl.int64), mask=c < C)
        elif INDEX == _INDEX_LOCAL:
            tl.store(idx_ptr + y_off, chosen.to(tl.int8), mask=c < C)
    else:
        div = _divisor(od, oh, ow, ID, IH, IW, OD, OH, OW, SD, SH, SW, PD, PH, PW, KD, KH, KW, divisor,
                       ADAPTIVE, COUNT_PAD, OVERRIDE, ACC)  # fmt: skip
        tl.store(y_ptr + y_off, convert(tl.sum(total, 0) / div, y_ptr.dtype.element_ty), mask=c < C)
