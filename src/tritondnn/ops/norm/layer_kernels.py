"""Layer and RMS normalization kernels (see layer.py). Rows are ``n_rows`` runs of ``n_cols``
contiguous elements, ``*_stride`` apart."""

import triton
import triton.language as tl

from ...core.numerics import convert
from ..activation import activation_gradient, activation_value

# Unused tensor arguments (no residual, no weight...) are passed as ``x`` and never read.


@triton.jit
def _rows(start, INDEX_64: tl.constexpr, BLOCK_R: tl.constexpr):
    rows = start * BLOCK_R + tl.arange(0, BLOCK_R)
    if INDEX_64:  # rows * stride may pass 2**31
        rows = rows.to(tl.int64)
    return rows


@triton.jit
def _load_input(
    x_ptr, res_ptr, sum_ptr, rows, cols, mask, x_stride, res_stride, sum_stride,
    HAS_RES: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """The row block to normalize: x, or x + residual rounded to the input dtype and stored, so
    the backward pass and the returned sum see exactly what was normalized."""
    x = tl.load(x_ptr + rows[:, None] * x_stride + cols, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + rows[:, None] * res_stride + cols, mask=mask, other=0.0)
        x = convert(convert(x, ACC) + convert(r, ACC), x_ptr.dtype.element_ty)
        tl.store(sum_ptr + rows[:, None] * sum_stride + cols, x, mask=mask)
    return convert(x, ACC)


@triton.jit
def _affine_act(
    xhat,
    w_ptr,
    b_ptr,
    cols,
    col_mask,
    act_p0,
    act_p1,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    ACT: tl.constexpr,
):
    y = xhat
    if HAS_W:
        y = y * convert(tl.load(w_ptr + cols, mask=col_mask, other=0.0), xhat.dtype)
    if HAS_B:
        y = y + convert(tl.load(b_ptr + cols, mask=col_mask, other=0.0), xhat.dtype)
    if ACT >= 0:
        y = activation_value(y, ACT, act_p0, act_p1)
    return y


@triton.jit
def _store_y(y_ptr, low_ptr, offsets, y, mask, LOW: tl.constexpr):
    """y in its dtype and, where LOW, that value rounded again to ``low_ptr``'s (what
    ``y.to(low dtype)`` would give: the same rounding of the same stored value). (The backward
    stores dx this way too.)"""
    y = convert(y, y_ptr.dtype.element_ty)
    tl.store(y_ptr + offsets, y, mask=mask)
    if LOW:
        # The offsets in runs of 4 as the compiler sees them: the narrow store then takes the
        # wide one's layout (4 elements a thread). Seen whole (8 2-byte elements a thread), it
        # made the compiler move the whole row block between the two layouts through shared
        # memory each iteration of the backward's loop (9 shared stores and 15 barriers more in
        # its PTX for sm_90a), which took GPT-2 small's norm backward from 1.16 to 2.01 ms a step.
        fours = (offsets // 4) * 4 + offsets % 4
        tl.store(low_ptr + fours, convert(y, low_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _forward_kernel(
    x_ptr, res_ptr, w_ptr, b_ptr, y_ptr, sum_ptr, stats_ptr, low_ptr,
    eps, act_p0, act_p1,
    n_rows, n_cols, x_stride, res_stride, y_stride, sum_stride,
    ACC: tl.constexpr, RMS: tl.constexpr, HAS_RES: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    ACT: tl.constexpr, ONE_BLOCK: tl.constexpr, INDEX_64: tl.constexpr, LOW: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """y = act(norm(x [+ res]) * w + b) for BLOCK_R rows; mean and 1/std saved per row (fp32) as
    ``stats[0]`` and ``stats[1]`` of a (2, n_rows) buffer (one allocation a call). LOW: y is
    also stored rounded to ``low_ptr``'s dtype (rows ``y_stride`` apart, as y's).

    ONE_BLOCK: a row fits in BLOCK_N, two passes over registers. Otherwise a first loop merges
    per-block means and squared deviations (Chan et al.) and a second loop writes.
    ACT: an Activation kind, or -1 for none. RMS: no mean subtraction, no bias.
    ACC: the arithmetic and statistics dtype (fp32, or fp64 for fp64 tensors).
    """
    rows = _rows(tl.program_id(0), INDEX_64, BLOCK_R)
    row_mask = rows < n_rows
    cols = tl.arange(0, BLOCK_N)[None, :]
    if ONE_BLOCK:
        mask = row_mask[:, None] & (cols < n_cols)
        x = _load_input(
            x_ptr, res_ptr, sum_ptr, rows, cols, mask, x_stride, res_stride, sum_stride, HAS_RES, ACC
        )
        if RMS:
            mean = tl.zeros([BLOCK_R], ACC)
            xc = x
        else:
            mean = tl.sum(x, 1) / n_cols
            xc = tl.where(mask, x - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, 1) / n_cols + eps)
        y = _affine_act(
            xc * rstd[:, None], w_ptr, b_ptr, cols, cols < n_cols, act_p0, act_p1, HAS_W, HAS_B, ACT
        )
        _store_y(y_ptr, low_ptr, rows[:, None] * y_stride + cols, y, mask, LOW)
    else:
        count = tl.zeros([BLOCK_R], ACC)
        mean = tl.zeros([BLOCK_R], ACC)
        m2 = tl.zeros([BLOCK_R], ACC)
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            mask = row_mask[:, None] & (c < n_cols)
            x = _load_input(
                x_ptr, res_ptr, sum_ptr, rows, c, mask, x_stride, res_stride, sum_stride, HAS_RES, ACC
            )
            if RMS:
                m2 += tl.sum(x * x, 1)
            else:
                n_block = tl.minimum(n_cols - start, BLOCK_N).to(ACC)
                block_mean = tl.sum(x, 1) / n_block
                d = tl.where(mask, x - block_mean[:, None], 0.0)
                total = count + n_block
                delta = block_mean - mean
                mean += delta * (n_block / total)
                m2 += tl.sum(d * d, 1) + delta * delta * (count * n_block / total)
                count = total
        rstd = 1.0 / tl.sqrt(m2 / n_cols + eps)
        # The second pass reads back what the first normalized: the stored sum, or x.
        src_ptr = sum_ptr if HAS_RES else x_ptr
        src_stride = sum_stride if HAS_RES else x_stride
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            mask = row_mask[:, None] & (c < n_cols)
            x = convert(tl.load(src_ptr + rows[:, None] * src_stride + c, mask=mask, other=0.0), ACC)
            xhat = (x - mean[:, None]) * rstd[:, None]
            y = _affine_act(xhat, w_ptr, b_ptr, c, c < n_cols, act_p0, act_p1, HAS_W, HAS_B, ACT)
            _store_y(y_ptr, low_ptr, rows[:, None] * y_stride + c, y, mask, LOW)
    tl.store(stats_ptr + rows, mean, mask=row_mask)
    tl.store(stats_ptr + n_rows + rows, rstd, mask=row_mask)


@triton.jit
def _grad_block(
    dy_ptr, x_ptr, w_ptr, b_ptr, rows, cols, mask, col_mask, mean, rstd, act_p0, act_p1, dy_stride, x_stride,
    ACC: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACT: tl.constexpr,
):  # fmt: skip
    """(dy through the activation, x-hat, w * dy) for one block of rows and columns."""
    x = tl.load(x_ptr + rows[:, None] * x_stride + cols, mask=mask, other=0.0)
    dy = tl.load(dy_ptr + rows[:, None] * dy_stride + cols, mask=mask, other=0.0)
    w, b = _affine_params(w_ptr, b_ptr, cols, col_mask, ACC, HAS_W, HAS_B, ACT)
    return _grad_values(dy, x, w, b, mask, mean, rstd, act_p0, act_p1, ACC, ACT)


@triton.jit
def _affine_params(
    w_ptr, b_ptr, cols, col_mask,
    ACC: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACT: tl.constexpr,
):  # fmt: skip
    """The weight (ones without one) and the bias the activation's gradient needs (zeros otherwise)
    over ``cols``."""
    w = tl.full([1, 1], 1.0, ACC)
    if HAS_W:
        w = convert(tl.load(w_ptr + cols, mask=col_mask, other=0.0), ACC)
    b = tl.full([1, 1], 0.0, ACC)
    if ACT >= 0 and HAS_B:
        b = convert(tl.load(b_ptr + cols, mask=col_mask, other=0.0), ACC)
    return w, b


@triton.jit
def _load_block(
    dy_ptr, x_ptr, stats_ptr, dsum_ptr, block, cols, col_mask, n_rows, dy_stride, x_stride, dsum_stride,
    HAS_DSUM: tl.constexpr, INDEX_64: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """(dy, x, mean, 1/std, dsum) of row block ``block`` as stored (nothing loaded past the last
    row); dsum a zero without HAS_DSUM (a loop carries the tuple: no None in it)."""
    rows = _rows(block, INDEX_64, BLOCK_R)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & col_mask
    x = tl.load(x_ptr + rows[:, None] * x_stride + cols, mask=mask, other=0.0)
    dy = tl.load(dy_ptr + rows[:, None] * dy_stride + cols, mask=mask, other=0.0)
    mean = tl.load(stats_ptr + rows, mask=row_mask, other=0.0)
    rstd = tl.load(stats_ptr + n_rows + rows, mask=row_mask, other=0.0)
    dsum = tl.full([1, 1], 0.0, tl.float32)
    if HAS_DSUM:
        dsum = tl.load(dsum_ptr + rows[:, None] * dsum_stride + cols, mask=mask, other=0.0)
    return dy, x, mean, rstd, dsum


@triton.jit
def _grad_values(dy, x, w, b, mask, mean, rstd, act_p0, act_p1, ACC: tl.constexpr, ACT: tl.constexpr):
    """``_grad_block``'s values from the block's loaded dy and x."""
    x = convert(x, ACC)
    dy = convert(dy, ACC)
    xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
    if ACT >= 0:
        dy = activation_gradient(dy, xhat * w + b, ACT, False, act_p0, act_p1)
    return dy, xhat, dy * w


@triton.jit
def _backward_kernel(
    dy_ptr, x_ptr, w_ptr, b_ptr, stats_ptr, dsum_ptr, dx_ptr, dw_ptr, db_ptr, dlow_ptr,
    act_p0, act_p1,
    n_rows, n_cols, dy_stride, x_stride, dsum_stride, dx_stride,
    ACC: tl.constexpr, RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACT: tl.constexpr,
    HAS_DSUM: tl.constexpr, NEED_DW: tl.constexpr, NEED_DB: tl.constexpr,
    ONE_BLOCK: tl.constexpr, INDEX_64: tl.constexpr, LOW: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """dx (plus dsum, the gradient of the fused add's returned sum) for rows pid, pid + P, ...;
    each program's share of dw = sum(dy * x-hat) and db = sum(dy) goes to row ``pid`` of the
    fp32 partial buffers ``dw_ptr``/``db_ptr`` of shape (programs, n_cols). LOW: dx is also
    stored rounded to ``dlow_ptr``'s dtype (rows ``dx_stride`` apart): the gradient of a residual
    narrower than the input, which the autograd engine would otherwise cast in a pass of its own."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)[None, :]
    n_blocks = tl.cdiv(n_rows, BLOCK_R)
    if ONE_BLOCK:
        dw_acc = tl.zeros([BLOCK_N], ACC)
        db_acc = tl.zeros([BLOCK_N], ACC)
        col_mask = cols < n_cols
        w, b = _affine_params(w_ptr, b_ptr, cols, col_mask, ACC, HAS_W, HAS_B, ACT)
        # Each block's loads are issued an iteration ahead, so that they are in flight while the
        # block before is reduced and stored: with a few programs an SM (the partial sums' rows
        # are per program) nothing else hides the memory latency. A block past the end loads
        # nothing (all masked). The fused add's gradient too: loaded where it was added, it had
        # the backward at 42 us against 21 without it (8192 x 768 fp32, GPT-2 small's, H200);
        # prefetched, 27-30.
        loaded = _load_block(dy_ptr, x_ptr, stats_ptr, dsum_ptr, pid, cols, col_mask, n_rows, dy_stride,
                             x_stride, dsum_stride, HAS_DSUM, INDEX_64, BLOCK_R)  # fmt: skip
        for block in range(pid, n_blocks, programs):
            dy, x, mean, rstd, dsum = loaded
            rows = _rows(block, INDEX_64, BLOCK_R)
            row_mask = rows < n_rows
            mask = row_mask[:, None] & col_mask
            loaded = _load_block(
                dy_ptr, x_ptr, stats_ptr, dsum_ptr, block + programs, cols, col_mask, n_rows, dy_stride,
                x_stride, dsum_stride, HAS_DSUM, INDEX_64, BLOCK_R,
            )  # fmt: skip
            dy, xhat, wdy = _grad_values(dy, x, w, b, mask, mean, rstd, act_p0, act_p1, ACC, ACT)
            c1 = tl.sum(xhat * wdy, 1)[:, None] / n_cols
            if RMS:
                dx = (wdy - xhat * c1) * rstd[:, None]
            else:
                dx = (wdy - xhat * c1 - tl.sum(wdy, 1)[:, None] / n_cols) * rstd[:, None]
            if HAS_DSUM:
                dx += convert(dsum, ACC)
            _store_y(dx_ptr, dlow_ptr, rows[:, None] * dx_stride + cols, dx, mask, LOW)
            if NEED_DW:
                dw_acc += tl.sum(dy * xhat, 0)
            if NEED_DB:
                db_acc += tl.sum(dy, 0)
        flat = tl.arange(0, BLOCK_N)
        if NEED_DW:
            tl.store(dw_ptr + pid * n_cols + flat, dw_acc, mask=flat < n_cols)
        if NEED_DB:
            tl.store(db_ptr + pid * n_cols + flat, db_acc, mask=flat < n_cols)
    else:
        for block in range(pid, n_blocks, programs):
            rows = _rows(block, INDEX_64, BLOCK_R)
            row_mask = rows < n_rows
            mean = tl.load(stats_ptr + rows, mask=row_mask, other=0.0)
            rstd = tl.load(stats_ptr + n_rows + rows, mask=row_mask, other=0.0)
            c1 = tl.zeros([BLOCK_R], ACC)
            c2 = tl.zeros([BLOCK_R], ACC)
            for start in range(0, n_cols, BLOCK_N):
                c = start + cols
                mask = row_mask[:, None] & (c < n_cols)
                dy, xhat, wdy = _grad_block(
                    dy_ptr, x_ptr, w_ptr, b_ptr, rows, c, mask, c < n_cols, mean, rstd, act_p0, act_p1,
                    dy_stride, x_stride, ACC, HAS_W, HAS_B, ACT,
                )  # fmt: skip
                c1 += tl.sum(xhat * wdy, 1)
                c2 += tl.sum(wdy, 1)
            c1 = c1[:, None] / n_cols
            c2 = c2[:, None] / n_cols
            for start in range(0, n_cols, BLOCK_N):
                c = start + cols
                mask = row_mask[:, None] & (c < n_cols)
                dy, xhat, wdy = _grad_block(
                    dy_ptr, x_ptr, w_ptr, b_ptr, rows, c, mask, c < n_cols, mean, rstd, act_p0, act_p1,
                    dy_stride, x_stride, ACC, HAS_W, HAS_B, ACT,
                )  # fmt: skip
                if RMS:
                    dx = (wdy - xhat * c1) * rstd[:, None]
                else:
                    dx = (wdy - xhat * c1 - c2) * rstd[:, None]
                if HAS_DSUM:
                    dsum = tl.load(dsum_ptr + rows[:, None] * dsum_stride + c, mask=mask, other=0.0)
                    dx += convert(dsum, ACC)
                _store_y(dx_ptr, dlow_ptr, rows[:, None] * dx_stride + c, dx, mask, LOW)
                # This program alone owns its partial row: read-modify-write without races.
                flat = start + tl.arange(0, BLOCK_N)
                if NEED_DW:
                    part = dw_ptr + pid * n_cols + flat
                    tl.store(
                        part, tl.load(part, mask=flat < n_cols) + tl.sum(dy * xhat, 0), mask=flat < n_cols
                    )
                if NEED_DB:
                    part = db_ptr + pid * n_cols + flat
                    tl.store(part, tl.load(part, mask=flat < n_cols) + tl.sum(dy, 0), mask=flat < n_cols)
