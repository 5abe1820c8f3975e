"""Layer and RMS normalization over trailing dimensions, forward and backward, with the fusions
models use: a residual add before the norm (returning the sum too) and an activation after it.

A tensor is normalized as rows of ``n_cols = prod(normalized_shape)`` contiguous elements. Row
statistics are fp32 (two-pass in registers, or Chan's merge of per-block moments for rows longer
than a block) and saved for the backward pass, which recomputes the normalized input instead of
storing it. Weight and bias gradients are reduced in two stages (per-program partial sums in fp32,
then one sum over programs), so they are deterministic with no atomics.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import torch
import triton
import triton.language as tl

from ...core.autocast import FP32, autocast_policy
from ...core.backend import multiprocessor_count
from ...core.checks import check_tensor
from ...core.engine import Engine, Family, LaunchConfig, Problem
from ...core.launcher import cdiv, launcher
from ...core.library import custom_op
from ...core.numerics import convert
from ..activation import activation_gradient, activation_reference, activation_value
from .common import (
    NO_ACTIVATION,
    activation_kind,
    check_affine,
    check_eps,
    dtype_name,
    param_grads,
    rows_view,
    sum_partials,
)

# ---------------------------------------------------------------------------------------------
# 1. Reference.


def layer_norm_reference(
    x: torch.Tensor,
    n_dims: int,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    rms: bool = False,
    activation: str | None = None,
) -> torch.Tensor:
    """Layer (or RMS) norm over the last ``n_dims`` dimensions, then the activation, in float64."""
    x = x.double()
    dims = tuple(range(x.ndim - n_dims, x.ndim))
    if rms:
        y = x * torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + eps)
    else:
        mean = x.mean(dims, keepdim=True)
        y = (x - mean) * torch.rsqrt((x - mean).pow(2).mean(dims, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.double()
    if bias is not None:
        y = y + bias.double()
    if activation is not None:
        kind, p0, p1 = activation_kind(activation)
        y = activation_reference(y, kind, p0, p1)
    return y


# ---------------------------------------------------------------------------------------------
# 2. Kernels. Rows are ``n_rows`` runs of ``n_cols`` contiguous elements, ``*_stride`` apart.
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
def _forward_kernel(
    x_ptr, res_ptr, w_ptr, b_ptr, y_ptr, sum_ptr, mean_ptr, rstd_ptr,
    eps, act_p0, act_p1,
    n_rows, n_cols, x_stride, res_stride, y_stride, sum_stride,
    ACC: tl.constexpr, RMS: tl.constexpr, HAS_RES: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    ACT: tl.constexpr, ONE_BLOCK: tl.constexpr, INDEX_64: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """y = act(norm(x [+ res]) * w + b) for BLOCK_R rows; mean and 1/std saved per row (fp32).

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
        tl.store(y_ptr + rows[:, None] * y_stride + cols, convert(y, y_ptr.dtype.element_ty), mask=mask)
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
            tl.store(y_ptr + rows[:, None] * y_stride + c, convert(y, y_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + rows, mean, mask=row_mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)


@triton.jit
def _grad_block(
    dy_ptr, x_ptr, w_ptr, b_ptr, rows, cols, mask, col_mask, mean, rstd, act_p0, act_p1, dy_stride, x_stride,
    ACC: tl.constexpr, RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACT: tl.constexpr,
):  # fmt: skip
    """(dy through the activation, x-hat, w * dy) for one block of rows and columns."""
    x = convert(tl.load(x_ptr + rows[:, None] * x_stride + cols, mask=mask, other=0.0), ACC)
    dy = convert(tl.load(dy_ptr + rows[:, None] * dy_stride + cols, mask=mask, other=0.0), ACC)
    xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
    w = tl.full([1, 1], 1.0, ACC)
    if HAS_W:
        w = convert(tl.load(w_ptr + cols, mask=col_mask, other=0.0), ACC)
    if ACT >= 0:
        z = xhat * w
        if HAS_B:
            z = z + convert(tl.load(b_ptr + cols, mask=col_mask, other=0.0), ACC)
        dy = activation_gradient(dy, z, ACT, False, act_p0, act_p1)
    return dy, xhat, dy * w


@triton.jit
def _backward_kernel(
    dy_ptr, x_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, dsum_ptr, dx_ptr, dw_ptr, db_ptr,
    act_p0, act_p1,
    n_rows, n_cols, dy_stride, x_stride, dsum_stride, dx_stride,
    ACC: tl.constexpr, RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACT: tl.constexpr,
    HAS_DSUM: tl.constexpr, NEED_DW: tl.constexpr, NEED_DB: tl.constexpr,
    ONE_BLOCK: tl.constexpr, INDEX_64: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """dx (plus dsum, the gradient of the fused add's returned sum) for rows pid, pid + P, ...;
    each program's share of dw = sum(dy * x-hat) and db = sum(dy) goes to row ``pid`` of the
    fp32 partial buffers ``dw_ptr``/``db_ptr`` of shape (programs, n_cols)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)[None, :]
    n_blocks = tl.cdiv(n_rows, BLOCK_R)
    if ONE_BLOCK:
        dw_acc = tl.zeros([BLOCK_N], ACC)
        db_acc = tl.zeros([BLOCK_N], ACC)
        for block in range(pid, n_blocks, programs):
            rows = _rows(block, INDEX_64, BLOCK_R)
            row_mask = rows < n_rows
            mask = row_mask[:, None] & (cols < n_cols)
            mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)
            rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
            dy, xhat, wdy = _grad_block(
                dy_ptr, x_ptr, w_ptr, b_ptr, rows, cols, mask, cols < n_cols, mean, rstd, act_p0, act_p1,
                dy_stride, x_stride, ACC, RMS, HAS_W, HAS_B, ACT,
            )  # fmt: skip
            c1 = tl.sum(xhat * wdy, 1)[:, None] / n_cols
            if RMS:
                dx = (wdy - xhat * c1) * rstd[:, None]
            else:
                dx = (wdy - xhat * c1 - tl.sum(wdy, 1)[:, None] / n_cols) * rstd[:, None]
            if HAS_DSUM:
                dsum = tl.load(dsum_ptr + rows[:, None] * dsum_stride + cols, mask=mask, other=0.0)
                dx += convert(dsum, ACC)
            tl.store(
                dx_ptr + rows[:, None] * dx_stride + cols, convert(dx, dx_ptr.dtype.element_ty), mask=mask
            )
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
            mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)
            rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
            c1 = tl.zeros([BLOCK_R], ACC)
            c2 = tl.zeros([BLOCK_R], ACC)
            for start in range(0, n_cols, BLOCK_N):
                c = start + cols
                mask = row_mask[:, None] & (c < n_cols)
                dy, xhat, wdy = _grad_block(
                    dy_ptr, x_ptr, w_ptr, b_ptr, rows, c, mask, c < n_cols, mean, rstd, act_p0, act_p1,
                    dy_stride, x_stride, ACC, RMS, HAS_W, HAS_B, ACT,
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
                    dy_stride, x_stride, ACC, RMS, HAS_W, HAS_B, ACT,
                )  # fmt: skip
                if RMS:
                    dx = (wdy - xhat * c1) * rstd[:, None]
                else:
                    dx = (wdy - xhat * c1 - c2) * rstd[:, None]
                if HAS_DSUM:
                    dsum = tl.load(dsum_ptr + rows[:, None] * dsum_stride + c, mask=mask, other=0.0)
                    dx += convert(dsum, ACC)
                tl.store(
                    dx_ptr + rows[:, None] * dx_stride + c, convert(dx, dx_ptr.dtype.element_ty), mask=mask
                )
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


# ---------------------------------------------------------------------------------------------
# 3. Engines.


@dataclasses.dataclass(frozen=True)
class LayerNormProblem(Problem):
    """One launch over (n_rows, n_cols) row views. ``strides``: the row strides of the launch's
    row tensors (forward: x, residual, y, sum; backward: dy, x, dsum, dx)."""

    backward: bool
    rms: bool
    has_res: bool
    has_w: bool
    has_b: bool
    act: int
    has_dsum: bool
    need_dw: bool
    need_db: bool
    dtypes: tuple[str, ...]
    n_rows: int
    n_cols: int
    strides: tuple[int, ...]

    @property
    def acc(self) -> tl.dtype:
        """Arithmetic and statistics dtype: fp64 when the input is fp64, else fp32."""
        return tl.float64 if self.dtypes[0] == "float64" else tl.float32

    @property
    def index_64(self) -> bool:
        return max(self.strides) * self.n_rows + self.n_cols > 2**31 - 1


def _describe(
    input: torch.Tensor, normalized_shape: Sequence[int] | int, backward: bool = False, rms: bool = False
):
    """The problem ``layer_norm(input, normalized_shape)`` (affine, or its backward) poses."""
    n_cols = math.prod([normalized_shape] if isinstance(normalized_shape, int) else normalized_shape)
    n_rows = input.numel() // max(n_cols, 1)
    flags = dict(has_dsum=False, need_dw=backward, need_db=backward and not rms)
    return LayerNormProblem(
        backward, rms, False, True, not rms, NO_ACTIVATION, **flags, dtypes=(dtype_name(input.dtype),) * 2,
        n_rows=n_rows, n_cols=n_cols, strides=(n_cols,) * 4,
    )  # fmt: skip


FAMILY: Family[LayerNormProblem] = Family("layer_norm", _describe)

# Longest rows the one-block engine keeps in registers (the backward holds more per element).
MAX_ONE_BLOCK = {False: 16384, True: 8192}


def _programs(config: LaunchConfig, problem: LayerNormProblem) -> int:
    """Programs of the persistent backward grid: a few per multiprocessor, at most one a block."""
    device = torch.cuda.current_device() if torch.cuda.is_available() else 0
    return max(
        1, min(cdiv(problem.n_rows, config["BLOCK_R"]), config["PER_SM"] * multiprocessor_count(device))
    )


class _RowEngine(Engine[LayerNormProblem]):
    one_block = True

    def bind(self, problem: LayerNormProblem, config: LaunchConfig) -> Callable[..., None]:
        p = problem
        block_r, block_n, warps = config["BLOCK_R"], config["BLOCK_N"], config["num_warps"]
        if not p.backward:
            return launcher(
                _forward_kernel,
                (cdiv(p.n_rows, block_r),),
                num_tensors=8,
                ints=(p.n_rows, p.n_cols, *p.strides),
                constexprs=(
                    p.acc,
                    p.rms,
                    p.has_res,
                    p.has_w,
                    p.has_b,
                    p.act,
                    self.one_block,
                    p.index_64,
                    block_r,
                    block_n,
                ),
                num_warps=warps,
            )
        programs = _programs(config, p)
        run = launcher(
            _backward_kernel,
            (programs,),
            num_tensors=10,
            ints=(p.n_rows, p.n_cols, *p.strides),
            constexprs=(
                p.acc,
                p.rms,
                p.has_w,
                p.has_b,
                p.act,
                p.has_dsum,
                p.need_dw,
                p.need_db,
                self.one_block,
                p.index_64,
                block_r,
                block_n,
            ),
            num_warps=warps,
        )
        # One buffer holds both parameters' partial rows (one allocation); the looped kernel
        # accumulates into them, so they start at zero.
        shape = (p.need_dw + p.need_db, programs, p.n_cols)

        def backward(dy, x, w, b, mean, rstd, dsum, dx, dw, db, p0, p1) -> None:
            if not (p.need_dw or p.need_db):
                run(dy, x, w, b, mean, rstd, dsum, dx, x, x, p0, p1)
                return
            part = mean.new_empty(shape) if self.one_block else mean.new_zeros(shape)
            dw_part = part if p.need_dw else x
            db_part = part[1] if p.need_dw and p.need_db else (part if p.need_db else x)
            run(dy, x, w, b, mean, rstd, dsum, dx, dw_part, db_part, p0, p1)
            # Second stage: one fixed-order sum over the programs' partials (deterministic).
            if p.need_dw:
                sum_partials(part, dw, db if p.need_db else None)
            else:
                sum_partials(part, db)

        return backward


@FAMILY.register
class OneBlockEngine(_RowEngine):
    """Each row lives in registers: one read of x (and dy), one write."""

    name = "one-block"

    def not_supported_reasons(self, problem: LayerNormProblem) -> list[str]:
        limit = MAX_ONE_BLOCK[problem.backward]
        if problem.n_cols > limit:
            return [f"rows of {problem.n_cols} elements exceed {limit}, the most kept in registers"]
        return []

    def cost(self, problem: LayerNormProblem) -> float:
        return 1.0

    def configs(self, problem: LayerNormProblem) -> list[LaunchConfig]:
        block_n = triton.next_power_of_2(problem.n_cols)
        rows = max(1, min(64, 2048 // block_n))
        warps = max(4, min(16, block_n // 512))
        shapes = [(rows, warps), (rows * 2, warps), (rows, max(4, warps // 2)), (rows, min(16, warps * 2))]
        if problem.backward and block_n <= 1024:
            # Short rows: twice the rows an iteration, 8 warps for fp32. H100, 8192 x 768 (GPT-2
            # small's, fp32 under autocast / bf16): 50.9 -> 42.2 us fp32 and 48.2 -> 39.5 bf16.
            wide = problem.dtypes[0] in ("float32", "float64")
            shapes.insert(0, (rows * 2, 8 if wide else warps))
        per_sm = (2, 4, 8) if problem.backward else (1,)  # 2 a multiprocessor: best on H100, 4096 wide
        out = []
        for block_r, w in shapes:
            for k in per_sm:
                config = {"BLOCK_R": min(block_r, triton.next_power_of_2(problem.n_rows)), "BLOCK_N": block_n}
                config.update(num_warps=w, PER_SM=k)
                if config not in out:
                    out.append(config)
        return out


@FAMILY.register
class LoopedEngine(_RowEngine):
    """Rows of any length in blocks: the statistics pass, then the output pass (one extra read)."""

    name = "looped"
    one_block = False

    def cost(self, problem: LayerNormProblem) -> float:
        return 1.5

    def configs(self, problem: LayerNormProblem) -> list[LaunchConfig]:
        return [
            {"BLOCK_R": 1, "BLOCK_N": n, "num_warps": w, "PER_SM": 4}
            for n, w in ((4096, 8), (2048, 4), (8192, 16))
        ]


# ---------------------------------------------------------------------------------------------
# 4. torch.library ops and autograd.


def _stats_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _empty(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(0)


def _fake_forward(x, residual, weight, bias, n_cols, eps, rms, act, act_p0, act_p1):
    n_rows = x.numel() // n_cols
    stats = x.new_empty(n_rows, dtype=_stats_dtype(x))
    total = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else _empty(x)
    return torch.empty_like(x, memory_format=torch.contiguous_format), total, stats, torch.empty_like(stats)


@custom_op(
    "layer_norm",
    "(Tensor x, Tensor? residual, Tensor? weight, Tensor? bias, int n_cols, float eps, bool rms, int act, "
    "float act_p0, float act_p1) -> (Tensor, Tensor, Tensor, Tensor)",
    _fake_forward,
)
def _forward(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    n_cols: int,
    eps: float,
    rms: bool,
    act: int,
    act_p0: float,
    act_p1: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, x + residual or an empty tensor, mean, 1/std): y and the sum are contiguous."""
    x2 = rows_view(x, n_cols)
    n_rows = x2.shape[0]
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    total = torch.empty_like(y) if residual is not None else _empty(x)
    mean = x.new_empty(n_rows, dtype=_stats_dtype(x))
    rstd = torch.empty_like(mean)
    if x.numel() == 0:
        return y, total, mean, rstd
    res2 = rows_view(residual, n_cols) if residual is not None else x2
    y2, total2 = y.view(-1, n_cols), total.view(-1, n_cols) if residual is not None else x2
    w = weight if weight is not None else x2  # absent tensors are passed as x and never read
    b = bias if bias is not None else x2
    strides = (x2.stride(0), res2.stride(0), n_cols, n_cols)
    key = (
        False,
        rms,
        residual is not None,
        weight is not None,
        bias is not None,
        act,
        n_rows,
        n_cols,
        strides,
    )
    key += (x.dtype, w.dtype, b.dtype)

    def problem() -> LayerNormProblem:
        flags = (rms, residual is not None, weight is not None, bias is not None, act, False, False, False)
        names = (dtype_name(x.dtype), dtype_name(w.dtype), dtype_name(b.dtype))
        return LayerNormProblem(False, *flags, names, n_rows, n_cols, strides)

    args = (x2, res2, w, b, y2, total2, mean, rstd, eps, act_p0, act_p1)
    FAMILY.plan(key, problem, lambda: args)(*args)
    return y, total, mean, rstd


def _fake_backward(dy, x, weight, bias, mean, rstd, dsum, n_cols, rms, act, act_p0, act_p1, need_dw, need_db):
    return torch.empty_like(x, memory_format=torch.contiguous_format), *param_grads(
        x, weight, bias, need_dw, need_db
    )


@custom_op(
    "layer_norm_backward",
    "(Tensor dy, Tensor x, Tensor? weight, Tensor? bias, Tensor mean, Tensor rstd, Tensor? dsum, int n_cols, "
    "bool rms, int act, float act_p0, float act_p1, bool need_dw, bool need_db) -> (Tensor, Tensor, Tensor)",
    _fake_backward,
)
def _backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    dsum: torch.Tensor | None,
    n_cols: int,
    rms: bool,
    act: int,
    act_p0: float,
    act_p1: float,
    need_dw: bool,
    need_db: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight or empty, dbias or empty); ``x`` is what was normalized, ``dsum`` the
    gradient of the fused add's sum (added to dx)."""
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    dw, db = param_grads(x, weight, bias, need_dw, need_db)
    if x.numel() == 0:
        dw.zero_()
        db.zero_()
        return dx, dw, db
    x2, dy2 = rows_view(x, n_cols), rows_view(dy, n_cols)
    dsum2 = rows_view(dsum, n_cols) if dsum is not None else x2
    w = weight if weight is not None else x2
    b = bias if bias is not None else x2
    n_rows = x2.shape[0]
    strides = (dy2.stride(0), x2.stride(0), dsum2.stride(0), n_cols)
    flags = (rms, False, weight is not None, bias is not None, act, dsum is not None, need_dw, need_db)
    key = (True, *flags, n_rows, n_cols, strides, x.dtype, w.dtype, dy.dtype)

    def problem() -> LayerNormProblem:
        names = (dtype_name(x.dtype), dtype_name(w.dtype), dtype_name(dy.dtype))
        return LayerNormProblem(True, *flags, names, n_rows, n_cols, strides)

    args = (dy2, x2, w, b, mean, rstd, dsum2, dx.view(-1, n_cols), dw, db, act_p0, act_p1)
    FAMILY.plan(key, problem, lambda: args)(*args)
    return dx, dw, db


class _LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, bias, n_cols, eps, rms, act, act_p0, act_p1):
        y, total, mean, rstd = _forward(x, residual, weight, bias, n_cols, eps, rms, act, act_p0, act_p1)
        ctx.save_for_backward(total if residual is not None else x, weight, bias, mean, rstd)
        ctx.params = (n_cols, rms, act, act_p0, act_p1, residual is not None)
        ctx.set_materialize_grads(False)
        # Without a residual the sum is a placeholder: not returned, as every output costs the
        # autograd engine host time (tens of microseconds a call on the H100 machines).
        return (y, total) if residual is not None else y

    @staticmethod
    def backward(ctx, dy, dsum=None):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        n_cols, rms, act, act_p0, act_p1, has_res = ctx.params
        if dy is None:  # only the sum's gradient arrived
            dx = dsum
            dw = db = None
        else:
            need_dw, need_db = ctx.needs_input_grad[2], ctx.needs_input_grad[3]
            dx, dw, db = _backward(
                dy, x, weight, bias, mean, rstd, dsum, n_cols, rms, act, act_p0, act_p1, need_dw, need_db
            )
            dw = dw if need_dw else None
            db = db if need_db else None
        dres = dx if has_res and ctx.needs_input_grad[1] else None
        return dx, dres, dw, db, None, None, None, None, None, None


def _norm(
    op: str,
    input: torch.Tensor,
    residual: torch.Tensor | None,
    normalized_shape: Sequence[int] | int,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    rms: bool,
    activation: str | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_tensor(op, "input", input)
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if not shape or any(not isinstance(n, int) or isinstance(n, bool) for n in shape):
        raise TypeError(f"{op}: argument 'normalized_shape'={normalized_shape!r} must be an int or ints")
    if tuple(input.shape[input.ndim - len(shape) :]) != shape or len(shape) > input.ndim:
        raise ValueError(
            f"{op}: argument 'normalized_shape'={list(shape)} does not match the trailing dimensions of "
            f"input of shape {tuple(input.shape)}"
        )
    weight = check_affine(op, "weight", weight, shape, input)
    bias = check_affine(op, "bias", bias, shape, input)
    if residual is not None:
        check_tensor(op, "residual", residual)
        if residual.shape != input.shape or residual.dtype != input.dtype or residual.device != input.device:
            raise ValueError(
                f"{op}: argument 'residual' ({tuple(residual.shape)}, {residual.dtype}) must match "
                f"'input' ({tuple(input.shape)}, {input.dtype})"
            )
    eps = check_eps(op, eps)
    act, p0, p1 = activation_kind(activation, op)
    n_cols = math.prod(shape)
    tensors = (input, residual, weight, bias)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        out = _LayerNormFunction.apply(input, residual, weight, bias, n_cols, eps, rms, act, p0, p1)
        return out if residual is not None else (out, None)
    y, total, _, _ = _forward(input, residual, weight, bias, n_cols, eps, rms, act, p0, p1)
    return y, total


# ---------------------------------------------------------------------------------------------
# 5. Public functions.


def _default_eps(input: object) -> float | None:
    """PyTorch's rms_norm default: the input dtype's machine epsilon (left to validation otherwise)."""
    floating = isinstance(input, torch.Tensor) and input.is_floating_point()
    return torch.finfo(input.dtype).eps if floating else None


@autocast_policy(FP32)
def layer_norm(
    input: torch.Tensor,
    normalized_shape: Sequence[int] | int,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    activation: str | None = None,
) -> torch.Tensor:
    """``F.layer_norm``: normalize over the trailing ``normalized_shape`` dimensions, then scale
    and shift, then (cuDNN-style fusion) an optional ``activation`` ("relu", "silu", "gelu",
    "gelu_tanh", "sigmoid", "tanh").

    Args:
        input: fp16/bf16/fp32 tensor whose last dimensions are ``normalized_shape``.
        weight, bias: tensors of ``normalized_shape`` (any float dtype: fp32 parameters with bf16
            activations are fine), or None.
        eps: added to the variance; must be > 0.

    Statistics are fp32. The output is contiguous, in the input's dtype. Raises ``ValueError``
    for shape mismatches and ``eps <= 0``.
    """
    return _norm("tdnn.layer_norm", input, None, normalized_shape, weight, bias, eps, False, activation)[0]


def rms_norm(
    input: torch.Tensor,
    normalized_shape: Sequence[int] | int,
    weight: torch.Tensor | None = None,
    eps: float | None = None,
    *,
    activation: str | None = None,
) -> torch.Tensor:
    """``F.rms_norm``: ``x / sqrt(mean(x**2) + eps) * weight`` over ``normalized_shape``; ``eps``
    defaults to the input dtype's machine epsilon, as in PyTorch."""
    eps = _default_eps(input) if eps is None else eps
    return _norm("tdnn.rms_norm", input, None, normalized_shape, weight, None, eps, True, activation)[0]


def add_layer_norm(
    input: torch.Tensor,
    residual: torch.Tensor,
    normalized_shape: Sequence[int] | int,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``layer_norm(input + residual)`` in one pass. Returns ``(normalized, input + residual)``:
    the sum, rounded to the input dtype, is the next block's residual in pre-norm transformers."""
    return _norm("tdnn.add_layer_norm", input, residual, normalized_shape, weight, bias, eps, False, None)


def add_rms_norm(
    input: torch.Tensor,
    residual: torch.Tensor,
    normalized_shape: Sequence[int] | int,
    weight: torch.Tensor | None = None,
    eps: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm(input + residual)`` in one pass; returns ``(normalized, input + residual)``."""
    eps = _default_eps(input) if eps is None else eps
    return _norm("tdnn.add_rms_norm", input, residual, normalized_shape, weight, None, eps, True, None)
