"""Batch normalization's kernels (see batch.py for the algorithm and the engine that launches
them)."""

import triton
import triton.language as tl

from ...core.arrival import last_arrival
from ...core.numerics import convert
from ..activation import activation_gradient, activation_value

# ---------------------------------------------------------------------------------------------
# Kernels. Element (row r = n * S + s, channel c) sits at n * stride_n + s * stride_s +
# c * stride_c. Unused tensors are passed as x and never read.
#
# PACKED: the per-channel buffers lie in one workspace (one allocation instead of four, for the
# eager fast path): mean, 1/std, scale and mean_lo at rows 0, 1, 2 and 3 of a (4 + 2 * splits, C)
# buffer, the forward's partial sums from row 4. The kernels then get the workspace as
# ``mean_ptr`` and find the rest from it (the other pointer arguments are unread).


@triton.jit
def _tile(r0, c0, n_rows, n_channels, spatial, stride_n, stride_c, stride_s,
          INDEX_64: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):  # fmt: skip
    """Offsets and mask of the [BLOCK_R, BLOCK_C] tile at (row r0, channel c0), and its channels."""
    r = r0 + tl.arange(0, BLOCK_R)[:, None]
    if INDEX_64:
        r = r.to(tl.int64)
    c = c0 + tl.arange(0, BLOCK_C)[None, :]
    offsets = (r // spatial) * stride_n + (r % spatial) * stride_s + c * stride_c
    return offsets, (r < n_rows) & (c < n_channels), c


@triton.jit
def _reversed(n_channels, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """(first row, first channel) of this program's tile in a 1-D grid that visits the row blocks
    from the last to the first, every channel block of a row block together: the reductions
    before it swept the rows forwards, so the last rows they read are still in L2."""
    c_blocks = tl.cdiv(n_channels, BLOCK_C)
    pid = tl.program_id(0)
    row_block = tl.num_programs(0) // c_blocks - 1 - pid // c_blocks
    return row_block * BLOCK_R, (pid % c_blocks) * BLOCK_C


@triton.jit
def _channel_sums(
    x_ptr, shift, c0, split, splits, n_rows, n_channels, spatial, stride_n, stride_c, stride_s,
    ACC: tl.constexpr, INDEX_64: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Sums of (x - shift) and (x - shift)**2 over the row blocks split, split + splits, ... of
    channels [c0, c0 + BLOCK_C): [BLOCK_C] vectors."""
    acc = tl.zeros([BLOCK_R, BLOCK_C], ACC)
    acc_sq = tl.zeros([BLOCK_R, BLOCK_C], ACC)
    for r0 in range(split * BLOCK_R, n_rows, splits * BLOCK_R):
        offs, mask, _ = _tile(
            r0, c0, n_rows, n_channels, spatial, stride_n, stride_c, stride_s, INDEX_64, BLOCK_R, BLOCK_C
        )
        d = tl.where(mask, convert(tl.load(x_ptr + offs, mask=mask, other=0.0), ACC) - shift, 0.0)
        acc += d
        acc_sq += d * d
    return tl.sum(acc, 0), tl.sum(acc_sq, 0)


@triton.jit
def _stats_kernel(
    x_ptr, shift_ptr, part_ptr,
    n_rows, n_channels, spatial, stride_n, stride_c, stride_s,
    ACC: tl.constexpr, PACKED: tl.constexpr, INDEX_64: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Per-channel sums of (x - shift) and (x - shift)**2 over this program's rows, fp32, into
    rows ``split`` and ``splits + split`` of the (2, splits, C) buffer ``part`` (from row 4 of
    the workspace ``part`` when PACKED). Grid: (channel blocks, splits).

    Split k takes row blocks k, k + splits, ...: the programs sweep the tensor together from its
    first rows to its last, which leaves the last rows in L2 for the apply pass (it starts there)."""
    if PACKED:
        part_ptr += 4 * n_channels
    c0 = tl.program_id(0) * BLOCK_C
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    cols = c0 + tl.arange(0, BLOCK_C)
    shift = convert(tl.load(shift_ptr + cols, mask=cols < n_channels, other=0.0), ACC)[None, :]
    total, total_sq = _channel_sums(
        x_ptr, shift, c0, split, splits, n_rows, n_channels, spatial, stride_n, stride_c, stride_s,
        ACC, INDEX_64, BLOCK_R, BLOCK_C,
    )  # fmt: skip
    out = part_ptr + split * n_channels + cols
    tl.store(out, total, mask=cols < n_channels)
    tl.store(out + splits * n_channels, total_sq, mask=cols < n_channels)


@triton.jit
def _sum_splits(part_ptr, cols, n_channels, splits, ACC: tl.constexpr, BLOCK_K: tl.constexpr):
    """Sums over the splits of a (2, splits, C) buffer of partials at channels ``cols``: BLOCK_K
    splits per load (one memory round trip each, not one per split), added in a fixed order."""
    k = tl.arange(0, BLOCK_K)[:, None]
    cm = (cols < n_channels)[None, :]
    total = tl.zeros([BLOCK_K, cols.shape[0]], ACC)
    total_sq = tl.zeros([BLOCK_K, cols.shape[0]], ACC)
    for k0 in range(0, splits, BLOCK_K):
        mask = (k0 + k < splits) & cm
        at = part_ptr + (k0 + k) * n_channels + cols[None, :]
        total += tl.load(at, mask=mask, other=0.0, cache_modifier=".cg")
        total_sq += tl.load(at + splits * n_channels, mask=mask, other=0.0, cache_modifier=".cg")
    return tl.sum(total, 0), tl.sum(total_sq, 0)


@triton.jit
def _stats_finalize_kernel(
    x_ptr, w_ptr, rmean_ptr, rvar_ptr, part_ptr, mean_ptr, rstd_ptr, scale_ptr, counter_ptr,
    count, eps, momentum,
    n_rows, n_channels, spatial, stride_n, stride_c, stride_s,
    ACC: tl.constexpr, UPDATE_RUNNING: tl.constexpr, HAS_W: tl.constexpr, PACKED: tl.constexpr,
    INDEX_64: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Training's statistics and finalize in one launch: _stats_kernel's partial sums (the shift
    is x[0, c, 0]), then the last of a channel block's programs to finish (``counter``: one int32
    per channel block) finalizes that block as _finalize_kernel does (PACKED as there). Saves the
    finalize's launch and the gap before it. Grid: (channel blocks, splits)."""
    if PACKED:
        rstd_ptr = mean_ptr + n_channels
        scale_ptr = mean_ptr + 2 * n_channels
        part_ptr = mean_ptr + 4 * n_channels
    c0 = tl.program_id(0) * BLOCK_C
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    cols = c0 + tl.arange(0, BLOCK_C)
    cm = cols < n_channels
    shift = convert(tl.load(x_ptr + cols * stride_c, mask=cm, other=0.0), ACC)
    total, total_sq = _channel_sums(
        x_ptr, shift[None, :], c0, split, splits, n_rows, n_channels, spatial, stride_n, stride_c,
        stride_s, ACC, INDEX_64, BLOCK_R, BLOCK_C,
    )  # fmt: skip
    tl.store(part_ptr + split * n_channels + cols, total, mask=cm)
    tl.store(part_ptr + (splits + split) * n_channels + cols, total_sq, mask=cm)
    if last_arrival(counter_ptr + tl.program_id(0), splits):
        total, total_sq = _sum_splits(part_ptr, cols, n_channels, splits, ACC, BLOCK_K)
        _finalize_channels(
            cols, total, total_sq, shift, w_ptr, rmean_ptr, rvar_ptr, mean_ptr, rstd_ptr, scale_ptr,
            count, eps, momentum, n_channels, ACC, True, UPDATE_RUNNING, HAS_W,
        )  # fmt: skip


@triton.jit
def _finalize_channels(
    c, total, total_sq, shift, w_ptr, rmean_ptr, rvar_ptr, mean_ptr, rstd_ptr, scale_ptr,
    count, eps, momentum, n_channels,
    ACC: tl.constexpr, TRAINING: tl.constexpr, UPDATE_RUNNING: tl.constexpr, HAS_W: tl.constexpr,
):  # fmt: skip
    """_finalize_kernel's work for channels ``c``, from the sums of x - shift and of its square
    over ``count`` values (unused unless TRAINING)."""
    cm = c < n_channels
    if TRAINING:
        centred = total / count
        var = tl.maximum(total_sq / count - centred * centred, 0.0)
        mean = shift + centred
        mean_lo = (shift - mean) + centred
        if UPDATE_RUNNING:
            rm = convert(tl.load(rmean_ptr + c, mask=cm, other=0.0), ACC)
            rv = convert(tl.load(rvar_ptr + c, mask=cm, other=0.0), ACC)
            unbiased = var * (count / tl.maximum(count - 1.0, 1.0))
            tl.store(
                rmean_ptr + c,
                convert((1.0 - momentum) * rm + momentum * mean, rmean_ptr.dtype.element_ty),
                mask=cm,
            )
            tl.store(
                rvar_ptr + c,
                convert((1.0 - momentum) * rv + momentum * unbiased, rvar_ptr.dtype.element_ty),
                mask=cm,
            )
    else:
        mean = convert(tl.load(rmean_ptr + c, mask=cm, other=0.0), ACC)
        var = convert(tl.load(rvar_ptr + c, mask=cm, other=0.0), ACC)
        mean_lo = tl.zeros(c.shape, ACC)
    rstd = 1.0 / tl.sqrt(var + eps)
    scale = rstd
    if HAS_W:
        scale = scale * convert(tl.load(w_ptr + c, mask=cm, other=0.0), ACC)
    tl.store(mean_ptr + c, mean, mask=cm)
    tl.store(rstd_ptr + c, rstd, mask=cm)
    tl.store(scale_ptr + c, scale, mask=cm)
    tl.store(scale_ptr + n_channels + c, mean_lo, mask=cm)


@triton.jit
def _finalize_kernel(
    part_ptr, shift_ptr, w_ptr, rmean_ptr, rvar_ptr, mean_ptr, rstd_ptr, scale_ptr,
    count, eps, momentum,
    n_channels, splits, shift_stride,
    ACC: tl.constexpr, TRAINING: tl.constexpr, UPDATE_RUNNING: tl.constexpr, HAS_W: tl.constexpr,
    PACKED: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Per channel: mean and 1/std (from the (2, splits, C) partials when TRAINING, from the running
    statistics otherwise), the running-statistic update (unbiased variance, as PyTorch), and
    for the apply kernel scale = w / std (row 0 of the (2, C) scale buffer) and mean_lo, the part
    of the mean that the fp32 ``mean`` rounded away (row 1): x - mean is then taken as
    (x - mean) - mean_lo, exact to fp32 whatever the mean's size. PACKED: all four buffers are
    rows of the workspace ``mean``, the partial sums too."""
    if PACKED:
        rstd_ptr = mean_ptr + n_channels
        scale_ptr = mean_ptr + 2 * n_channels
        part_ptr = mean_ptr + 4 * n_channels
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < n_channels
    total = tl.zeros([BLOCK_C], ACC)
    total_sq = tl.zeros([BLOCK_C], ACC)
    shift = tl.zeros([BLOCK_C], ACC)
    if TRAINING:
        for k in range(0, splits):  # a fixed order: the same bits on every run
            total += tl.load(part_ptr + k * n_channels + c, mask=cm, other=0.0)
            total_sq += tl.load(part_ptr + (splits + k) * n_channels + c, mask=cm, other=0.0)
        shift = convert(tl.load(shift_ptr + c * shift_stride, mask=cm, other=0.0), ACC)
    _finalize_channels(
        c, total, total_sq, shift, w_ptr, rmean_ptr, rvar_ptr, mean_ptr, rstd_ptr, scale_ptr,
        count, eps, momentum, n_channels, ACC, TRAINING, UPDATE_RUNNING, HAS_W,
    )  # fmt: skip


@triton.jit
def _apply_kernel(
    x_ptr, mean_ptr, scale_ptr, b_ptr, r_ptr, y_ptr,
    act_p0, act_p1,
    n_rows, n_channels, spatial, stride_n, stride_c, stride_s,
    HAS_B: tl.constexpr, HAS_R: tl.constexpr, ACT: tl.constexpr, PACKED: tl.constexpr,
    INDEX_64: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """y = act((x - mean[c] - mean_lo[c]) * scale[c] + b[c] + r) (r: the residual, laid out as x,
    when HAS_R) with scale and mean_lo the rows of
    the (2, C) buffer the finalize kernel wrote (rows 2 and 3 of the workspace ``mean`` when
    PACKED). Subtracting the mean first keeps the digits a folded x * scale + (b - mean * scale)
    would cancel away for large means. Grid: (row blocks x channel blocks,), see _reversed."""
    if PACKED:
        scale_ptr = mean_ptr + 2 * n_channels
    r0, c0 = _reversed(n_channels, BLOCK_R, BLOCK_C)
    offs, mask, c = _tile(
        r0, c0, n_rows, n_channels, spatial, stride_n, stride_c, stride_s, INDEX_64, BLOCK_R, BLOCK_C
    )
    mean = tl.load(mean_ptr + c, mask=c < n_channels, other=0.0)
    scale = tl.load(scale_ptr + c, mask=c < n_channels, other=0.0)
    mean_lo = tl.load(scale_ptr + n_channels + c, mask=c < n_channels, other=0.0)
    y = ((convert(tl.load(x_ptr + offs, mask=mask, other=0.0), mean.dtype) - mean) - mean_lo) * scale
    if HAS_B:
        y = y + convert(tl.load(b_ptr + c, mask=c < n_channels, other=0.0), mean.dtype)
    if HAS_R:
        y = y + convert(tl.load(r_ptr + offs, mask=mask, other=0.0), mean.dtype)
    if ACT >= 0:
        y = activation_value(y, ACT, act_p0, act_p1)
    tl.store(y_ptr + offs, convert(y, y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _grad_tile(dy_ptr, x_ptr, offs, mask, mean, rstd, w, b, act_p0, act_p1, ACT: tl.constexpr):
    """(dy through the activation, x-hat) of one tile; the pre-activation is recomputed from x."""
    xhat = tl.where(
        mask, (convert(tl.load(x_ptr + offs, mask=mask, other=0.0), mean.dtype) - mean) * rstd, 0.0
    )
    dy = convert(tl.load(dy_ptr + offs, mask=mask, other=0.0), mean.dtype)
    if ACT >= 0:
        dy = activation_gradient(dy, xhat * w + b, ACT, False, act_p0, act_p1)
    return dy, xhat


@triton.jit
def _load_channel(ptr, c, n_channels, default, PRESENT: tl.constexpr, ACC: tl.constexpr):
    if PRESENT:
        return convert(tl.load(ptr + c, mask=c < n_channels, other=0.0), ACC)
    else:
        return tl.full(c.shape, default, ACC)


@triton.jit
def _grad_sums(
    dy_ptr, x_ptr, mean_ptr, rstd_ptr, w_ptr, b_ptr, act_p0, act_p1, c0, split, splits,
    n_rows, n_channels, spatial, stride_n, stride_c, stride_s,
    ACC: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACT: tl.constexpr,
    INDEX_64: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Sums of dy (through the activation) and dy * x-hat over the row blocks split, split +
    splits, ... of channels [c0, c0 + BLOCK_C): [BLOCK_C] vectors."""
    c2 = (c0 + tl.arange(0, BLOCK_C))[None, :]
    mean = tl.load(mean_ptr + c2, mask=c2 < n_channels, other=0.0)
    rstd = tl.load(rstd_ptr + c2, mask=c2 < n_channels, other=0.0)
    w = _load_channel(w_ptr, c2, n_channels, 1.0, HAS_W, ACC)
    b = _load_channel(b_ptr, c2, n_channels, 0.0, HAS_B, ACC)
    acc = tl.zeros([BLOCK_R, BLOCK_C], ACC)
    acc_x = tl.zeros([BLOCK_R, BLOCK_C], ACC)
    for r0 in range(split * BLOCK_R, n_rows, splits * BLOCK_R):
        offs, mask, _ = _tile(
            r0, c0, n_rows, n_channels, spatial, stride_n, stride_c, stride_s, INDEX_64, BLOCK_R, BLOCK_C
        )
        dy, xhat = _grad_tile(dy_ptr, x_ptr, offs, mask, mean, rstd, w, b, act_p0, act_p1, ACT)
        acc += dy
        acc_x += dy * xhat
    return tl.sum(acc, 0), tl.sum(acc_x, 0)


@triton.jit
def _backward_reduce_kernel(
    dy_ptr, x_ptr, mean_ptr, rstd_ptr, w_ptr, b_ptr, part_ptr,
    act_p0, act_p1,
    n_rows, n_channels, spatial, stride_n, stride_c, stride_s,
    ACC: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACT: tl.constexpr, PACKED: tl.constexpr,
    INDEX_64: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Per-channel partial sums of dy and dy * x-hat (dy taken through the activation) into rows
    ``split`` and ``splits + split`` of the (2, splits, C) buffer ``part``: db and dw, and the two
    terms of dx. PACKED: 1/std is row 1 of the workspace ``mean``. Grid as _stats."""
    if PACKED:
        rstd_ptr = mean_ptr + n_channels
    c0 = tl.program_id(0) * BLOCK_C
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    cols = c0 + tl.arange(0, BLOCK_C)
    total, total_x = _grad_sums(
        dy_ptr, x_ptr, mean_ptr, rstd_ptr, w_ptr, b_ptr, act_p0, act_p1, c0, split, splits,
        n_rows, n_channels, spatial, stride_n, stride_c, stride_s,
        ACC, HAS_W, HAS_B, ACT, INDEX_64, BLOCK_R, BLOCK_C,
    )  # fmt: skip
    out = part_ptr + split * n_channels + cols
    tl.store(out, total, mask=cols < n_channels)
    tl.store(out + splits * n_channels, total_x, mask=cols < n_channels)


@triton.jit
def _backward_sums_kernel(
    dy_ptr, x_ptr, mean_ptr, rstd_ptr, w_ptr, b_ptr, part_ptr, dsum_ptr, dxsum_ptr, counter_ptr,
    act_p0, act_p1,
    n_rows, n_channels, spatial, stride_n, stride_c, stride_s,
    ACC: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACT: tl.constexpr, PACKED: tl.constexpr,
    INDEX_64: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """_backward_reduce_kernel, then the last of a channel block's programs to finish
    (``counter``: one int32 per channel block) adds the block's partials into ``dsum`` and
    ``dxsum`` (sum(dy), sum(dy * x-hat): db and dw), in a fixed order. Grid as _stats."""
    if PACKED:
        rstd_ptr = mean_ptr + n_channels
    c0 = tl.program_id(0) * BLOCK_C
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    cols = c0 + tl.arange(0, BLOCK_C)
    cm = cols < n_channels
    total, total_x = _grad_sums(
        dy_ptr, x_ptr, mean_ptr, rstd_ptr, w_ptr, b_ptr, act_p0, act_p1, c0, split, splits,
        n_rows, n_channels, spatial, stride_n, stride_c, stride_s,
        ACC, HAS_W, HAS_B, ACT, INDEX_64, BLOCK_R, BLOCK_C,
    )  # fmt: skip
    tl.store(part_ptr + split * n_channels + cols, total, mask=cm)
    tl.store(part_ptr + (splits + split) * n_channels + cols, total_x, mask=cm)
    if last_arrival(counter_ptr + tl.program_id(0), splits):
        total, total_x = _sum_splits(part_ptr, cols, n_channels, splits, ACC, BLOCK_K)
        tl.store(dsum_ptr + cols, total, mask=cm)
        tl.store(dxsum_ptr + cols, total_x, mask=cm)


@triton.jit
def _backward_apply_kernel(
    dy_ptr, x_ptr, mean_ptr, rstd_ptr, w_ptr, b_ptr, dsum_ptr, dxsum_ptr, dx_ptr,
    act_p0, act_p1, count,
    n_rows, n_channels, spatial, stride_n, stride_c, stride_s,
    ACC: tl.constexpr, TRAINING: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACT: tl.constexpr,
    PACKED: tl.constexpr, INDEX_64: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """dx = w * rstd * (dy - sum(dy) / count - x-hat * sum(dy * x-hat) / count) in training; with
    running statistics the mean and variance are constants and dx = w * rstd * dy. PACKED as in
    _backward_reduce_kernel. Grid as _apply_kernel's."""
    if PACKED:
        rstd_ptr = mean_ptr + n_channels
    r0, c0 = _reversed(n_channels, BLOCK_R, BLOCK_C)
    offs, mask, c = _tile(
        r0, c0, n_rows, n_channels, spatial, stride_n, stride_c, stride_s, INDEX_64, BLOCK_R, BLOCK_C
    )
    cm = c < n_channels
    mean = tl.load(mean_ptr + c, mask=cm, other=0.0)
    rstd = tl.load(rstd_ptr + c, mask=cm, other=0.0)
    w = _load_channel(w_ptr, c, n_channels, 1.0, HAS_W, ACC)
    b = _load_channel(b_ptr, c, n_channels, 0.0, HAS_B, ACC)
    dy, xhat = _grad_tile(dy_ptr, x_ptr, offs, mask, mean, rstd, w, b, act_p0, act_p1, ACT)
    if TRAINING:
        dy = dy - tl.load(dsum_ptr + c, mask=cm, other=0.0) / count
        dy = dy - xhat * (tl.load(dxsum_ptr + c, mask=cm, other=0.0) / count)
    tl.store(dx_ptr + offs, convert(dy * w * rstd, dx_ptr.dtype.element_ty), mask=mask)
