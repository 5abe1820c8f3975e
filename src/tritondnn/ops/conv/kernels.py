"""Implicit-GEMM convolution kernels: the forward (and data-gradient) kernel and the weight-gradient
kernel with its deterministic split-K reduction.

The forward and data-gradient convolutions are one kernel over a general geometry. Per spatial
dimension (D, H, W), output row coordinate ``o`` and tap ``t < T`` read the source at
``o * gs + go + t * gd``, use weight tap ``wt + t * ws`` and write the output at ``o * os + oo``:

* forward: gs = stride, go = -pad, gd = dilation, (wt, ws) = (0, 1), (os, oo) = (1, 0);
* data gradient of a stride-s convolution, one launch per phase r < s (the input positions
  ``r + s * o``): only the taps k with ``(r + pad - k * dilation) % s == 0`` touch them, spaced by
  ``s / gcd(s, dilation)``; they read the output gradient at ``o + base - t * dilation / gcd``, a
  stride-1 convolution with negative dilation. No multiply touches an inserted zero.

The GEMM: rows are output pixels (n, od, oh, ow), columns the group's output channels, the
reduction runs over (tap, source channel). Three K walks (``K_WALK``):

* 0, by tap, then by BLOCK_K source channels: per-row coordinates are computed once per tap; the
  walk for channel counts of 16 and up;
* 1, flat over (tap, channel) with the channel fastest: each element finds its tap; for few
  source channels, where a tap-wise walk would pad 3 channels to BLOCK_K;
* 2, row windows, for few channels in a dense channels-last source (``s_w`` = CK, ``s_c`` = 1,
  one group, W dilation 1): the TW * CK elements a (d, h) tap reads for one row lie side by
  side, ``bw * CK + j`` from the pixel row's start, inside it exactly when that offset is in
  [0, IW * CK). Per (d, h) tap, the window is walked in BLOCK_K chunks with no division per
  element (the 7x7, 3-channel stem: 21 of every 32 K lanes used, against 147 lanes of
  div/mod gathers in walk 1).

Arguments, documented once:

* tensors: ``src`` (x, or the output gradient), ``w`` (weights), ``out``, then the epilogue's
  ``c``, ``bias``, ``res``, ``pre`` (laid out as ``out``; ``out`` stands in for absent ones), then
  the prologue's per-channel ``scale`` and ``shift`` (``_prologue``; ``out`` where absent);
* floats: ``alpha, beta, p0, p1`` (``ops.epilogue``);
* ints: ``M`` rows, ``NCOLS`` columns per group, ``CK`` source channels per group, the row grid
  ``OD, OH, OW``, the source bounds ``ID, IH, IW``, the tap counts ``TD, TH, TW``; strides of src
  (``s_*``: n, c, d, h, w), of w (``w_k``: along the reduction channel, ``w_j``: along the output
  column, ``w_d, w_h, w_w``: taps; ``w_group``: one group's step), of out (``o_*``), the bias
  step; the geometry above; ``row_limit``, above every valid output offset.
* constexprs: the epilogue flags, ``ACC`` (accumulator dtype), ``PRECISION`` ("ieee"/"tf32"/"tf32x3"),
  ``UPCAST`` (bf16 dots on fp32 copies under the interpreter), ``INDEX_64``, ``K_WALK``, the
  ``PROLOGUE`` bits (``problem.PROLOGUE_*``) and the tile sizes.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...core.numerics import convert
from ..epilogue import apply_epilogue
from ..matmul.kernels import dot, grouped


@triton.jit
def _prologue(a, ok, scale_ptr, shift_ptr, channel, channel_ok, ACC: tl.constexpr, PROLOGUE: tl.constexpr):
    """cuDNN's scale-bias-relu on an A tile as it is read: ``a * scale + shift`` per source channel
    (``channel``: each column's), then ReLU (``PROLOGUE`` bits 1, 2, 4), in ACC, rounded once to
    a's dtype. Positions outside the input (``ok`` False: padding) stay zero, as the transformed
    input's zero padding would be."""
    v = a.to(ACC)
    if PROLOGUE & 1:
        v = v * tl.load(scale_ptr + channel, mask=channel_ok, other=0.0).to(ACC)[None, :]
    if PROLOGUE & 2:
        v = v + tl.load(shift_ptr + channel, mask=channel_ok, other=0.0).to(ACC)[None, :]
    if PROLOGUE & 4:
        v = tl.where(v < 0.0, 0.0, v)  # NaN passes, as torch.relu's (tl.maximum would drop it)
    return tl.where(ok, v, 0.0).to(a.dtype)


@triton.jit
def _igemm_kernel(
    src_ptr, w_ptr, out_ptr, c_ptr, bias_ptr, res_ptr, pre_ptr, scale_ptr, shift_ptr,
    alpha, beta, p0, p1,
    M, NCOLS, CK, OD, OH, OW, ID, IH, IW, TD, TH, TW,
    s_n, s_c, s_d, s_h, s_w,
    w_k, w_j, w_d, w_h, w_w, w_group,
    o_n, o_c, o_d, o_h, o_w, s_bias,
    gs_d, gs_h, gs_w, go_d, go_h, go_w, gd_d, gd_h, gd_w,
    wt_d, wt_h, wt_w, ws_d, ws_h, ws_w,
    os_d, os_h, os_w, oo_d, oo_h, oo_w, row_limit,
    HAS_C: tl.constexpr, BIAS: tl.constexpr, ACT: tl.constexpr, RESIDUAL: tl.constexpr,
    STORE_PRE: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    INDEX_64: tl.constexpr, K_WALK: tl.constexpr, PROLOGUE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """One BLOCK_M x BLOCK_N output tile of one group. Grid: (row tiles * column tiles, groups)."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(NCOLS, BLOCK_N)
    pid_m, pid_n = grouped(tl.program_id(0), tiles_m, tiles_n, GROUP_M)
    g = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if INDEX_64:
        rows = rows.to(tl.int64)
        g = g.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    m_ok = rows < M
    col_ok = cols < NCOLS
    ow = rows % OW
    rest = rows // OW
    oh = rest % OH
    rest = rest // OH
    od = rest % OD
    n = rest // OD
    # Source coordinates of tap 0 for each row.
    bd = od * gs_d + go_d
    bh = oh * gs_h + go_h
    bw = ow * gs_w + go_w
    src_rows = src_ptr + n * s_n + g * CK * s_c
    w_base = w_ptr + g * w_group
    acc = tl.zeros((BLOCK_M, BLOCK_N), ACC)
    if K_WALK == 2:
        window = TW * CK
        chunks = tl.cdiv(window, BLOCK_K)
        row_w = bw * CK  # the window's start in the pixel row
        for i in range(0, TD * TH * chunks):
            t = i // chunks
            j = (i - t * chunks) * BLOCK_K + ks
            th = t % TH
            td = t // TH
            sd = bd + td * gd_d
            sh = bh + th * gd_h
            row_ok = m_ok & (sd >= 0) & (sd < ID) & (sh >= 0) & (sh < IH)
            pos = row_w[:, None] + j[None, :]
            ok = row_ok[:, None] & (pos >= 0) & (pos < IW * CK) & (j < window)[None, :]
            a = tl.load(src_rows[:, None] + (sd * s_d + sh * s_h)[:, None] + pos, mask=ok, other=0.0)
            c = j % CK
            if PROLOGUE != 0:
                a = _prologue(a, ok, scale_ptr, shift_ptr, g * CK + c, j < window, ACC, PROLOGUE)
            tw = j // CK
            w_off = c * w_k + (wt_d + td * ws_d) * w_d + (wt_h + th * ws_h) * w_h + (wt_w + tw * ws_w) * w_w
            b = tl.load(
                w_base + w_off[:, None] + cols[None, :] * w_j,
                mask=(j < window)[:, None] & col_ok[None, :],
                other=0.0,
            )
            acc = dot(a, b, acc, PRECISION, UPCAST)
    elif K_WALK == 1:
        K = CK * TD * TH * TW
        for k0 in range(0, K, BLOCK_K):
            r = k0 + ks
            k_ok = r < K
            c = r % CK
            t = r // CK
            tw = t % TW
            t = t // TW
            th = t % TH
            td = t // TH
            sd = bd[:, None] + (td * gd_d)[None, :]
            sh = bh[:, None] + (th * gd_h)[None, :]
            sw = bw[:, None] + (tw * gd_w)[None, :]
            ok = (m_ok[:, None] & k_ok[None, :]) & ((sd >= 0) & (sd < ID))
            ok = ok & ((sh >= 0) & (sh < IH)) & ((sw >= 0) & (sw < IW))
            a_ptrs = src_rows[:, None] + (c * s_c)[None, :] + sd * s_d + sh * s_h + sw * s_w
            a = tl.load(a_ptrs, mask=ok, other=0.0)
            if PROLOGUE != 0:
                a = _prologue(a, ok, scale_ptr, shift_ptr, g * CK + c, k_ok, ACC, PROLOGUE)
            w_off = c * w_k + (wt_d + td * ws_d) * w_d + (wt_h + th * ws_h) * w_h + (wt_w + tw * ws_w) * w_w
            b = tl.load(
                w_base + w_off[:, None] + cols[None, :] * w_j, mask=k_ok[:, None] & col_ok[None, :], other=0.0
            )
            acc = dot(a, b, acc, PRECISION, UPCAST)
    else:
        blocks = tl.cdiv(CK, BLOCK_K)
        for i in range(0, TD * TH * TW * blocks):
            t = i // blocks
            c = (i % blocks) * BLOCK_K + ks
            c_ok = c < CK
            tw = t % TW
            t2 = t // TW
            th = t2 % TH
            td = t2 // TH
            sd = bd + td * gd_d
            sh = bh + th * gd_h
            sw = bw + tw * gd_w
            ok = m_ok & (sd >= 0) & (sd < ID) & (sh >= 0) & (sh < IH) & (sw >= 0) & (sw < IW)
            a_ptrs = src_rows[:, None] + (sd * s_d + sh * s_h + sw * s_w)[:, None] + (c * s_c)[None, :]
            a = tl.load(a_ptrs, mask=ok[:, None] & c_ok[None, :], other=0.0)
            if PROLOGUE != 0:
                a = _prologue(
                    a, ok[:, None] & c_ok[None, :], scale_ptr, shift_ptr, g * CK + c, c_ok, ACC, PROLOGUE
                )
            w_off = (wt_d + td * ws_d) * w_d + (wt_h + th * ws_h) * w_h + (wt_w + tw * ws_w) * w_w
            b_ptrs = w_base + w_off + c[:, None] * w_k + cols[None, :] * w_j
            b = tl.load(b_ptrs, mask=c_ok[:, None] & col_ok[None, :], other=0.0)
            acc = dot(a, b, acc, PRECISION, UPCAST)
    # The epilogue addresses rows by their offsets in ``out`` (stride 1): C, residual and pre share
    # out's layout. Rows past M get ``row_limit``, which the epilogue masks off.
    out_rows = n * o_n + (od * os_d + oo_d) * o_d + (oh * os_h + oo_h) * o_h + (ow * os_w + oo_w) * o_w
    out_rows = tl.where(m_ok, out_rows, row_limit)
    base = g * NCOLS * o_c
    y = apply_epilogue(
        acc,
        out_rows,
        cols,
        row_limit,
        NCOLS,
        c_ptr + base,
        1,
        o_c,
        bias_ptr + g * NCOLS * s_bias,
        s_bias,
        res_ptr + base,
        1,
        o_c,
        pre_ptr + base,
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
    out_ptrs = out_ptr + base + out_rows[:, None] + cols[None, :] * o_c
    tl.store(out_ptrs, convert(y, out_ptr.dtype.element_ty), mask=m_ok[:, None] & col_ok[None, :])


@triton.jit
def output_pixel(k, OD, OH, OW):
    """(n, od, oh, ow) of flat output pixel indices ``k`` (n-major, then d, h, w)."""
    ow = k % OW
    rest = k // OW
    oh = rest % OH
    rest = rest // OH
    return rest // OD, rest % OD, oh, ow


@triton.jit
def _wgrad_kernel(
    dy_ptr, x_ptr, out_ptr,
    KTOT, COG, CG, OD, OH, OW, ID, IH, IW, KD, KH, KW, k_chunk,
    y_n, y_c, y_d, y_h, y_w, x_n, x_c, x_d, x_h, x_w,
    o_s, o_g, o_m, o_c, o_t,
    st_d, st_h, st_w, pd_d, pd_h, pd_w, dl_d, dl_h, dl_w,
    ACC: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, INDEX_64: tl.constexpr,
    TAP_MAJOR: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """The weight gradient dw[co, c, tap] = sum over (n, output pixel) of dy[n, co, pixel] times
    x[n, c, pixel * stride - pad + tap * dilation], one group: a GEMM with rows co (COG per group),
    columns (c, tap) and reduction over the KTOT = N * OD * OH * OW output pixels.

    Program (tile, g, s) reduces pixels [s * k_chunk, (s + 1) * k_chunk) and writes its sum (in
    ``out``'s dtype) at ``out + s * o_s + g * o_g + co * o_m + c * o_c + tap * o_t``: ``out`` is dw
    itself without a split, else an fp32 workspace [split, ...] that ``_sum_kernel`` adds in order
    (no atomics: the same bits on every run). Columns run tap-major (c fastest) for channels-last
    x, where channels are contiguous, else channel-major. Grid: (tiles, groups, split).
    """
    taps = KD * KH * KW
    ncols = CG * taps
    tiles_m = tl.cdiv(COG, BLOCK_M)
    tiles_n = tl.cdiv(ncols, BLOCK_N)
    pid_m, pid_n = grouped(tl.program_id(0), tiles_m, tiles_n, GROUP_M)
    g = tl.program_id(1)
    split = tl.program_id(2)
    if INDEX_64:
        g = g.to(tl.int64)
        split = split.to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rows < COG
    col_ok = cols < ncols
    if TAP_MAJOR:
        c = cols % CG
        t = cols // CG
    else:
        c = cols // taps
        t = cols % taps
    kw = t % KW
    kh = (t // KW) % KH
    kd = t // (KW * KH)
    off_d = kd * dl_d - pd_d
    off_h = kh * dl_h - pd_h
    off_w = kw * dl_w - pd_w
    a_rows = dy_ptr + (g * COG + rows) * y_c
    b_cols = x_ptr + (g * CG + c) * x_c
    ks = tl.arange(0, BLOCK_K)
    k_start = split * k_chunk
    k_end = tl.minimum(KTOT, k_start + k_chunk)
    acc = tl.zeros((BLOCK_M, BLOCK_N), ACC)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + ks
        if INDEX_64:
            k = k.to(tl.int64)
        k_ok = k < k_end
        n, od, oh, ow = output_pixel(k, OD, OH, OW)
        a_off = n * y_n + od * y_d + oh * y_h + ow * y_w
        a = tl.load(a_rows[:, None] + a_off[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        sd = (od * st_d)[:, None] + off_d[None, :]
        sh = (oh * st_h)[:, None] + off_h[None, :]
        sw = (ow * st_w)[:, None] + off_w[None, :]
        ok = (k_ok[:, None] & col_ok[None, :]) & ((sd >= 0) & (sd < ID))
        ok = ok & ((sh >= 0) & (sh < IH)) & ((sw >= 0) & (sw < IW))
        b_ptrs = b_cols[None, :] + (n * x_n)[:, None] + sd * x_d + sh * x_h + sw * x_w
        b = tl.load(b_ptrs, mask=ok, other=0.0)
        acc = dot(a, b, acc, PRECISION, UPCAST)
    out_ptrs = out_ptr + split * o_s + g * o_g + rows[:, None] * o_m + (c * o_c + t * o_t)[None, :]
    tl.store(out_ptrs, convert(acc, out_ptr.dtype.element_ty), mask=m_ok[:, None] & col_ok[None, :])


@triton.jit
def _sum_kernel(ws_ptr, out_ptr, numel, split, CG, TAPS, o_m, o_c, o_t, BLOCK: tl.constexpr):
    """A split weight gradient's sum: out[co, c, tap] = sum over s of ws[s, co, tap, c] (ws
    [split, numel] contiguous, channels innermost), added in order of s, stored in out's dtype at
    ``co * o_m + c * o_c + tap * o_t``. Grid: (cdiv(numel, BLOCK),)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    acc = tl.zeros((BLOCK,), ws_ptr.dtype.element_ty)
    for s in range(split):
        acc += tl.load(ws_ptr + s * numel + offs, mask=ok, other=0.0)
    c = offs % CG
    t = (offs // CG) % TAPS
    co = offs // (CG * TAPS)
    tl.store(out_ptr + co * o_m + c * o_c + t * o_t, convert(acc, out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _col2im_kernel(
    cols_ptr, dx_ptr,
    C, H, W, OH, OW, sdx_n, sdx_c, sdx_h, sdx_w, SH, SW, PH, PW, DH, DW,
    KH: tl.constexpr, KW: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """dx = the fold of the columns' gradient ``cols`` [N, C * KH * KW, OH * OW] (fp32 or fp64):
    each input pixel sums the column entries of the taps that read it (a gather: no atomics, each
    entry read once). Grid: (N * C, pixel blocks) (N * C may pass the 65535 programs a grid's
    second dimension takes); dx (N, C, H, W) through its strides, in its dtype."""
    nc = tl.program_id(0)
    n = nc // C
    c = nc % C
    pixels = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = pixels < H * W
    h = pixels // W
    w = pixels % W
    base = cols_ptr + nc.to(tl.int64) * (KH * KW) * (OH * OW)
    acc = tl.zeros([BLOCK], cols_ptr.dtype.element_ty)
    for r in tl.static_range(KH):
        hh = h + PH - r * DH
        p = hh // SH
        row_ok = inside & (hh >= 0) & (hh % SH == 0) & (p < OH)
        for s in tl.static_range(KW):
            ww = w + PW - s * DW
            q = ww // SW
            ok = row_ok & (ww >= 0) & (ww % SW == 0) & (q < OW)
            acc += tl.load(base + (r * KW + s) * (OH * OW) + p * OW + q, mask=ok, other=0.0)
    out = dx_ptr + n.to(tl.int64) * sdx_n + c * sdx_c + h * sdx_h + w * sdx_w  # dx may pass 2**31
    tl.store(out, acc.to(dx_ptr.dtype.element_ty), mask=inside)
