"""Softmax and log-softmax along any dimension, forward and backward (cuDNN's ACCURATE softmax).

Rows are the slices along ``dim``; every other dimension indexes rows. The input is read in its own
layout: rows along the last, contiguous dimension load as vectors; rows along an outer dimension
(softmax over channels of an NCHW tensor) load as tiles of many rows at once so neighbouring rows
share memory transactions. The maximum is subtracted before ``exp`` and sums accumulate in fp32
(fp64 for fp64 tensors), so fp16 logits of +-1e4 are safe.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from ..core.autocast import FP32, autocast_policy
from ..core.checks import FLOAT_DTYPES, check_dim, check_dtype, check_tensor
from ..core.config import config
from ..core.engine import Engine, Family, LaunchConfig, Problem
from ..core.launcher import cdiv, launcher
from ..core.library import custom_op, plain_eager
from ..core.numerics import convert, online_exp_sum
from ..core.strides import collapse

# ---------------------------------------------------------------------------------------------
# 1. Reference.


def softmax_reference(x: torch.Tensor, dim: int, log: bool = False) -> torch.Tensor:
    """Softmax (or log-softmax) along ``dim`` in float64."""
    x = x.double()
    return torch.log_softmax(x, dim) if log else torch.softmax(x, dim)


def softmax_backward_reference(
    grad: torch.Tensor, y: torch.Tensor, dim: int, log: bool = False
) -> torch.Tensor:
    """Input gradient from the output ``y`` and its gradient, in float64."""
    grad, y = grad.double(), y.double()
    if log:
        return grad - torch.exp(y) * grad.sum(dim, keepdim=True)
    return y * (grad - (grad * y).sum(dim, keepdim=True))


# ---------------------------------------------------------------------------------------------
# 2. Kernels. Rows are split as (outer, inner) = (row // rows_inner, row % rows_inner), each with a
# stride per tensor, which covers every layout whose non-softmax dimensions merge into two.


@triton.jit
def _row_offsets(rows, rows_inner, stride_outer, stride_inner):
    return (rows // rows_inner) * stride_outer + (rows % rows_inner) * stride_inner


@triton.jit
def _forward_kernel(
    x_ptr, y_ptr, n_rows, n_cols, rows_inner,
    xs_outer, xs_inner, xs_col, ys_outer, ys_inner, ys_col,
    LOG: tl.constexpr, ONE_BLOCK: tl.constexpr, ACC: tl.constexpr, INDEX_64: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """y = softmax(x) over the columns of BLOCK_R rows per program.

    ONE_BLOCK: the whole row fits in BLOCK_N (one read, one write); otherwise a first loop keeps a
    running max and a sum rescaled to it, and a second loop writes. ACC: fp32 or fp64 arithmetic.
    """
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    if INDEX_64:
        rows = rows.to(tl.int64)
    row_mask = rows < n_rows
    x_rows = x_ptr + _row_offsets(rows, rows_inner, xs_outer, xs_inner)[:, None]
    y_rows = y_ptr + _row_offsets(rows, rows_inner, ys_outer, ys_inner)[:, None]
    cols = tl.arange(0, BLOCK_N)[None, :]
    if ONE_BLOCK:
        mask = row_mask[:, None] & (cols < n_cols)
        x = convert(tl.load(x_rows + cols * xs_col, mask=mask, other=-float("inf")), ACC)
        z = x - tl.max(x, 1)[:, None]
        e = tl.exp(z)
        if LOG:
            y = z - tl.log(tl.sum(e, 1))[:, None]
        else:
            y = e * (1.0 / tl.sum(e, 1))[:, None]
        tl.store(y_rows + cols * ys_col, convert(y, y_ptr.dtype.element_ty), mask=mask)
    else:
        m = tl.full([BLOCK_R], -float("inf"), ACC)
        s = tl.zeros([BLOCK_R], ACC)
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            mask = row_mask[:, None] & (c < n_cols)
            x = convert(tl.load(x_rows + c * xs_col, mask=mask, other=-float("inf")), ACC)
            m, s = online_exp_sum(m, s, x)
        if LOG:
            bias = (m + tl.log(s))[:, None]
        else:
            inv = (1.0 / s)[:, None]
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            mask = row_mask[:, None] & (c < n_cols)
            x = convert(tl.load(x_rows + c * xs_col, mask=mask, other=-float("inf")), ACC)
            if LOG:
                y = x - bias
            else:
                y = tl.exp(x - m[:, None]) * inv
            tl.store(y_rows + c * ys_col, convert(y, y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _backward_kernel(
    g_ptr, y_ptr, dx_ptr, n_rows, n_cols, rows_inner,
    gs_outer, gs_inner, gs_col, ys_outer, ys_inner, ys_col, ds_outer, ds_inner, ds_col,
    LOG: tl.constexpr, ONE_BLOCK: tl.constexpr, ACC: tl.constexpr, INDEX_64: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """dx from the output y and its gradient g: y * (g - sum(g * y)), or g - exp(y) * sum(g) for log."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    if INDEX_64:
        rows = rows.to(tl.int64)
    row_mask = rows < n_rows
    g_rows = g_ptr + _row_offsets(rows, rows_inner, gs_outer, gs_inner)[:, None]
    y_rows = y_ptr + _row_offsets(rows, rows_inner, ys_outer, ys_inner)[:, None]
    d_rows = dx_ptr + _row_offsets(rows, rows_inner, ds_outer, ds_inner)[:, None]
    cols = tl.arange(0, BLOCK_N)[None, :]
    if ONE_BLOCK:
        mask = row_mask[:, None] & (cols < n_cols)
        g = convert(tl.load(g_rows + cols * gs_col, mask=mask, other=0.0), ACC)
        y = convert(tl.load(y_rows + cols * ys_col, mask=mask, other=0.0), ACC)
        if LOG:
            dx = g - tl.exp(y) * tl.sum(g, 1)[:, None]
        else:
            dx = y * (g - tl.sum(g * y, 1)[:, None])
        tl.store(d_rows + cols * ds_col, convert(dx, dx_ptr.dtype.element_ty), mask=mask)
    else:
        total = tl.zeros([BLOCK_R, BLOCK_N], ACC)
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            mask = row_mask[:, None] & (c < n_cols)
            g = convert(tl.load(g_rows + c * gs_col, mask=mask, other=0.0), ACC)
            if LOG:
                total += g
            else:
                total += g * convert(tl.load(y_rows + c * ys_col, mask=mask, other=0.0), ACC)
        dot = tl.sum(total, 1)[:, None]
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            mask = row_mask[:, None] & (c < n_cols)
            g = convert(tl.load(g_rows + c * gs_col, mask=mask, other=0.0), ACC)
            y = convert(tl.load(y_rows + c * ys_col, mask=mask, other=0.0), ACC)
            if LOG:
                dx = g - tl.exp(y) * dot
            else:
                dx = y * (g - dot)
            tl.store(d_rows + c * ds_col, convert(dx, dx_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------
# 3. Engines.


@dataclasses.dataclass(frozen=True)
class SoftmaxProblem(Problem):
    """One launch. Tensors in launch order: forward ``(x, y)``, backward ``(grad, y, dx)``.

    ``row_sizes`` is the merged shape of the non-softmax dimensions (outermost first) and
    ``row_strides``/``col_strides`` give each tensor's strides over it and along ``dim``.
    """

    backward: bool
    log: bool
    dim: int
    dtypes: tuple[str, ...]
    n_cols: int
    row_sizes: tuple[int, ...]
    row_strides: tuple[tuple[int, ...], ...]
    col_strides: tuple[int, ...]
    index_64: bool

    @property
    def n_rows(self) -> int:
        n = 1
        for size in self.row_sizes:
            n *= size
        return n

    @property
    def rows_contiguous(self) -> bool:
        """Neighbouring rows are neighbours in memory (softmax over an outer dimension)."""
        return self.col_strides[-1] != 1 and self.row_strides[-1][-1] == 1


def _problem(backward: bool, log: bool, dim: int, tensors: tuple[torch.Tensor, ...]) -> SoftmaxProblem:
    out = tensors[-1]
    rows = [d for d in range(out.ndim) if d != dim]
    shape = [out.shape[d] for d in rows]
    # The output first: the flat row index then walks the output's memory in order.
    sizes, strides = collapse(shape, *([t.stride(d) for d in rows] for t in (out, *tensors[:-1])))
    strides = strides[1:] + strides[:1]
    n_cols = out.shape[dim]
    reach = max(
        sum((n - 1) * s for n, s in zip(sizes, st)) + (n_cols - 1) * t.stride(dim)
        for st, t in zip(strides, tensors)
    )
    return SoftmaxProblem(
        backward=backward,
        log=log,
        dim=dim,
        dtypes=tuple(str(t.dtype).removeprefix("torch.") for t in tensors),
        n_cols=n_cols,
        row_sizes=tuple(sizes),
        row_strides=tuple(map(tuple, strides)),
        col_strides=tuple(t.stride(dim) for t in tensors),
        index_64=max(reach + 1, out.numel()) > 2**31 - 1,
    )


def _describe(
    input: torch.Tensor, dim: int = -1, log: bool = False, backward: bool = False
) -> SoftmaxProblem:
    """The problem ``softmax(input, dim)`` (or its backward, with a contiguous gradient) poses."""
    dim = check_dim("tdnn.engines", "dim", dim, input.ndim)
    y = torch.empty_like(input)
    tensors = (torch.empty_like(y), y, torch.empty_like(y)) if backward else (input, y)
    return _problem(backward, log, dim, tensors)


FAMILY: Family[SoftmaxProblem] = Family("softmax", _describe)

# Longest row the one-block engine keeps in registers (64 fp32 values a thread at 16 warps).
MAX_ONE_BLOCK = 32768


class _RowEngine(Engine[SoftmaxProblem]):
    one_block = True

    def not_supported_reasons(self, problem: SoftmaxProblem) -> list[str]:
        if len(problem.row_sizes) > 2:
            return [f"the non-softmax dimensions merge into {len(problem.row_sizes)}, not at most 2"]
        return []

    def bind(self, problem: SoftmaxProblem, config: LaunchConfig) -> Callable[..., None]:
        rows_inner = problem.row_sizes[-1] if len(problem.row_sizes) == 2 else 1
        strides = []
        for row, col in zip(problem.row_strides, problem.col_strides):
            outer, inner = (row[0], row[1]) if len(row) == 2 else (row[0], 0)
            strides += [outer, inner, col]
        acc = tl.float64 if "float64" in problem.dtypes else tl.float32
        block_r = config["BLOCK_R"]
        return launcher(
            _backward_kernel if problem.backward else _forward_kernel,
            (cdiv(problem.n_rows, block_r),),
            num_tensors=len(problem.dtypes),
            ints=(problem.n_rows, problem.n_cols, rows_inner, *strides),
            constexprs=(problem.log, self.one_block, acc, problem.index_64, block_r, config["BLOCK_N"]),
            num_warps=config["num_warps"],
        )


@FAMILY.register
class OneBlockEngine(_RowEngine):
    """Each row lives in registers: the input is read once and the output written once."""

    name = "one-block"

    def not_supported_reasons(self, problem: SoftmaxProblem) -> list[str]:
        reasons = super().not_supported_reasons(problem)
        if problem.n_cols > MAX_ONE_BLOCK:
            reasons.append(
                f"rows of {problem.n_cols} elements exceed {MAX_ONE_BLOCK}, the most kept in registers"
            )
        return reasons

    def cost(self, problem: SoftmaxProblem) -> float:
        return 1.0

    def configs(self, problem: SoftmaxProblem) -> list[LaunchConfig]:
        block_n = triton.next_power_of_2(problem.n_cols)
        if problem.rows_contiguous:
            # Softmax over an outer dimension: tiles tall in rows, so a warp reads neighbouring rows
            # together (measured best on H100 for 32x256x56x56 over dim 1: 16 rows, 4 warps).
            shapes = [(16, 4), (32, 4), (32, 8), (64, 8), (8, 4), (64, 16)]
        else:
            # Rows along the contiguous dimension: about 2K elements a program, 512 a warp.
            rows = max(1, min(64, 2048 // block_n))
            warps = max(4, min(16, block_n // 512))
            shapes = [
                (rows, warps),
                (rows * 2, warps),
                (rows, max(4, warps // 2)),
                (rows, min(16, warps * 2)),
            ]
        out = []
        for block_r, warps in shapes:
            block_r = min(block_r, triton.next_power_of_2(problem.n_rows))
            config = {"BLOCK_R": block_r, "BLOCK_N": block_n, "num_warps": warps}
            if config not in out and block_r * block_n <= MAX_ONE_BLOCK:
                out.append(config)
        return out


@FAMILY.register
class TwoPassEngine(_RowEngine):
    """Rows of any length in blocks: an online max/sum pass, then a pass that writes (one extra read)."""

    name = "two-pass"
    one_block = False

    def cost(self, problem: SoftmaxProblem) -> float:
        return 1.5

    def configs(self, problem: SoftmaxProblem) -> list[LaunchConfig]:
        if problem.rows_contiguous:
            return [
                {"BLOCK_R": 64, "BLOCK_N": 32, "num_warps": 4},
                {"BLOCK_R": 32, "BLOCK_N": 64, "num_warps": 4},
            ]
        # Measured best on H100 for rows of 32768 bf16: 8192-wide blocks, 16 warps.
        return [{"BLOCK_R": 1, "BLOCK_N": n, "num_warps": w} for n, w in ((8192, 16), (4096, 8), (16384, 16))]


@FAMILY.register
class ContiguousEngine(Engine[SoftmaxProblem]):
    """Fallback for layouts whose non-softmax dimensions do not merge into two: copy, then run."""

    name = "contiguous-copy"

    def not_supported_reasons(self, problem: SoftmaxProblem) -> list[str]:
        if len(problem.row_sizes) <= 2:
            return ["only for layouts the row engines cannot take; this one they read in place"]
        return []

    def cost(self, problem: SoftmaxProblem) -> float:
        return 4.0

    def bind(self, problem: SoftmaxProblem, config: LaunchConfig) -> Callable[..., None]:
        def run(*tensors: torch.Tensor) -> None:
            out = tensors[-1]
            dense_out = torch.empty(out.shape, dtype=out.dtype, device=out.device)
            _run(
                problem.backward,
                problem.log,
                problem.dim,
                (*(t.contiguous() for t in tensors[:-1]), dense_out),
            )
            out.copy_(dense_out)

        return run


# Per-shape plans: the second call with the same shapes, strides and dtypes costs one lookup.
_plans: dict[tuple, Callable[..., None]] = {}


def _run(backward: bool, log: bool, dim: int, tensors: tuple[torch.Tensor, ...]) -> None:
    """Run softmax (or its backward) on ``tensors`` in launch order, the output last, whose strides
    follow from the input's (``empty_like``)."""
    first, out = tensors[0], tensors[-1]
    key = (
        backward,
        log,
        dim,
        config.version,
        first.shape,
        out.dtype,
        *[(t.dtype, t.stride()) for t in tensors[:-1]],
    )
    plan = _plans.get(key)
    if plan is None:
        problem = _problem(backward, log, dim, tensors)
        choice = FAMILY.select(problem, lambda: tensors)
        plan = _plans[key] = choice.engine.bind(problem, choice.config)
    plan(*tensors)


# ---------------------------------------------------------------------------------------------
# 4. torch.library ops and autograd.


def _fake_forward(x: torch.Tensor, dim: int, log: bool, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty_like(x, dtype=dtype)


@custom_op("softmax", "(Tensor x, int dim, bool log, ScalarType dtype) -> Tensor", _fake_forward)
def _forward(x: torch.Tensor, dim: int, log: bool, dtype: torch.dtype) -> torch.Tensor:
    y = torch.empty_like(x, dtype=dtype)
    if x.ndim == 0:
        _run(False, log, 0, (x.view(1), y.view(1)))
    elif x.numel():
        _run(False, log, dim, (x, y))
    return y


def _fake_backward(
    grad: torch.Tensor, y: torch.Tensor, dim: int, log: bool, dtype: torch.dtype
) -> torch.Tensor:
    return torch.empty_like(y, dtype=dtype)


@custom_op(
    "softmax_backward",
    "(Tensor grad, Tensor y, int dim, bool log, ScalarType dtype) -> Tensor",
    _fake_backward,
)
def _backward(grad: torch.Tensor, y: torch.Tensor, dim: int, log: bool, dtype: torch.dtype) -> torch.Tensor:
    dx = torch.empty_like(y, dtype=dtype)
    if y.ndim == 0:
        _run(True, log, 0, (grad.view(1), y.view(1), dx.view(1)))
    elif y.numel():
        _run(True, log, dim, (grad, y, dx))
    return dx


class _SoftmaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, log: bool, dtype: torch.dtype) -> torch.Tensor:
        y = _forward(x, dim, log, dtype)
        ctx.save_for_backward(y)
        ctx.params = (dim, log, x.dtype)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        (y,) = ctx.saved_tensors
        dim, log, input_dtype = ctx.params
        return _backward(grad, y, dim, log, input_dtype), None, None, None


# ---------------------------------------------------------------------------------------------
# 5. Public functions.

# Output dtypes that represent every value of an input dtype: the cast is fused into the kernel.
_WIDER = {
    torch.float16: (torch.float32, torch.float64),
    torch.bfloat16: (torch.float32, torch.float64),
    torch.float32: (torch.float64,),
    torch.float64: (),
}


def _implicit_dim(op: str, ndim: int, stacklevel: int) -> int:
    warnings.warn(
        f"Implicit dimension choice for {op} has been deprecated. "
        "Change the call to include dim=X as an argument.",
        UserWarning,
        stacklevel=stacklevel,
    )
    return 0 if ndim in (0, 1, 3) else 1


def _softmax(
    op: str, input: torch.Tensor, dim: int | None, stacklevel: int, dtype: torch.dtype | None, log: bool
) -> torch.Tensor:
    if dtype is None and type(dim) is int and plain_eager(input) and -input.ndim <= dim < input.ndim:
        # A problem seen before was validated then: one lookup, one allocation, one launch.
        dtype_in = input.dtype
        key = (
            False,
            log,
            dim % input.ndim,
            config.version,
            input.shape,
            dtype_in,
            (dtype_in, input.stride()),
        )
        plan = _plans.get(key)
        if plan is not None:
            out = torch.empty_like(input)
            plan(input, out)
            return out
    check_tensor(op, "input", input)
    if dim is None:
        dim = _implicit_dim(op, input.ndim, stacklevel + 1)
    dim = check_dim(op, "dim", dim, input.ndim)
    out_dtype = input.dtype
    if dtype is not None:
        out_dtype = check_dtype(op, "dtype", dtype, FLOAT_DTYPES)
        if out_dtype != input.dtype and out_dtype not in _WIDER[input.dtype]:
            input = input.to(out_dtype)  # as PyTorch: cast first when the cast loses information
    if input.requires_grad and torch.is_grad_enabled():
        return _SoftmaxFunction.apply(input, dim, log, out_dtype)
    return _forward(input, dim, log, out_dtype)


@autocast_policy(FP32, skip_if="dtype")
def softmax(
    input: torch.Tensor, dim: int | None = None, _stacklevel: int = 3, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``F.softmax``: ``exp(x - max) / sum(exp(x - max))`` along ``dim``.

    Args:
        input: fp16/bf16/fp32/fp64 tensor of any shape and strides.
        dim: the dimension to normalize; ``None`` picks PyTorch's legacy default with a warning.
        dtype: output dtype. A wider one is produced directly by the kernel (no extra pass); a
            narrower one casts the input first, as PyTorch does.

    Returns a tensor in the input's layout (for dense inputs). Rows that are all ``-inf`` give NaN,
    as in PyTorch.
    """
    return _softmax("tdnn.softmax", input, dim, _stacklevel, dtype, log=False)


@autocast_policy(FP32, skip_if="dtype")
def log_softmax(
    input: torch.Tensor, dim: int | None = None, _stacklevel: int = 3, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``F.log_softmax``: ``x - max - log(sum(exp(x - max)))`` along ``dim``; arguments as ``softmax``."""
    return _softmax("tdnn.log_softmax", input, dim, _stacklevel, dtype, log=True)
