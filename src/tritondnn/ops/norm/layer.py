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

from ...core.autocast import FP32, attach_lowered, autocast_policy
from ...core.backend import multiprocessor_count
from ...core.checks import check_tensor
from ...core.config import config
from ...core.engine import Engine, Family, LaunchConfig, Problem
from ...core.launcher import cdiv, launcher
from ...core.library import PLAIN_TENSORS, custom_op, eager_tensor, functorch_active, raw_apply
from ..activation import activation_reference
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
from .layer_kernels import _backward_kernel, _forward_kernel

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
# 2. Kernels: layer_kernels.py.


# ---------------------------------------------------------------------------------------------
# 3. Engines.


@dataclasses.dataclass(frozen=True)
class LayerNormProblem(Problem):
    """One launch over (n_rows, n_cols) row views. ``strides``: the row strides of the launch's
    row tensors (forward: x, residual, y, sum; backward: dy, x, dsum, dx). ``lower``: the forward
    also stores y rounded to a lower dtype (the last of ``dtypes``; see ``_layer_norm_autocast``),
    the backward dx (the gradient of a narrower residual, ``_eager_program``)."""

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
    lower: bool = False

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
                    p.lower,
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
                p.lower,
                block_r,
                block_n,
            ),
            num_warps=warps,
        )
        # One buffer holds both parameters' partial rows (one allocation); the looped kernel
        # accumulates into them, so they start at zero.
        shape = (p.need_dw + p.need_db, programs, p.n_cols)

        def backward(dy, x, w, b, stats, dsum, dx, dw, db, dlow, p0, p1) -> None:
            if not (p.need_dw or p.need_db):
                run(dy, x, w, b, stats, dsum, dx, x, x, dlow, p0, p1)
                return
            part = stats.new_empty(*shape) if self.one_block else stats.new_zeros(shape)
            dw_part = part if p.need_dw else x
            db_part = part[1] if p.need_dw and p.need_db else (part if p.need_db else x)
            run(dy, x, w, b, stats, dsum, dx, dw_part, db_part, dlow, p0, p1)
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
# 4. torch.library ops, autograd and the eager fast path.


def _stats_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _empty(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(0)


def _stats(x: torch.Tensor, n_cols: int) -> torch.Tensor:
    """The (2, rows) buffer of the rows' means and 1/std, one allocation. (Sizes given one by one:
    a tuple costs the argument parser microseconds more.)"""
    return x.new_empty(2, x.numel() // max(n_cols, 1), dtype=_stats_dtype(x))


def _dense(x: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor like ``x``."""
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _fake_forward(x, residual, weight, bias, n_cols, eps, rms, act, act_p0, act_p1):
    return _dense(x), _dense(x) if residual is not None else _empty(x), _stats(x, n_cols)


def _forward_args(x, residual, weight, bias, y, total, stats, low, n_cols, eps, act_p0, act_p1) -> tuple:
    """The forward kernel's tensors (rows as (rows, n_cols) views) and floats; ``low``: y's
    lower-precision copy (contiguous), or None."""
    x2 = rows_view(x, n_cols)
    res2 = rows_view(residual, n_cols) if residual is not None else x2
    total2 = total.view(-1, n_cols) if residual is not None else x2
    w = weight if weight is not None else x2  # absent tensors are passed as x and never read
    b = bias if bias is not None else x2
    low2 = low.view(-1, n_cols) if low is not None else x2
    return (x2, res2, w, b, y.view(-1, n_cols), total2, stats, low2, eps, act_p0, act_p1)


def _forward_plan(
    args: tuple, rms: bool, act: int, has_res: bool, has_w: bool, has_b: bool, lower: bool = False
) -> Callable:
    """The bound forward launch for ``_forward_args``'s ``args``, cached by what it depends on."""
    x2, res2, w, b = args[:4]
    n_rows, n_cols = x2.shape
    strides = (x2.stride(0), res2.stride(0), n_cols, n_cols)
    dtypes = (x2.dtype, w.dtype, b.dtype, res2.dtype, *((args[7].dtype,) if lower else ()))
    key = (False, rms, has_res, has_w, has_b, act, n_rows, n_cols, strides, *dtypes)

    def problem() -> LayerNormProblem:
        flags = (rms, has_res, has_w, has_b, act, False, False, False)
        names = tuple(dtype_name(d) for d in dtypes)
        return LayerNormProblem(False, *flags, names, n_rows, n_cols, strides, lower)

    return FAMILY.plan(key, problem, lambda: args)


@custom_op(
    "layer_norm",
    "(Tensor x, Tensor? residual, Tensor? weight, Tensor? bias, int n_cols, float eps, bool rms, int act, "
    "float act_p0, float act_p1) -> (Tensor, Tensor, Tensor)",
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, x + residual or an empty tensor, (2, rows) mean and 1/std): y and the sum are contiguous."""
    y, stats = _dense(x), _stats(x, n_cols)
    total = _dense(x) if residual is not None else _empty(x)
    if x.numel() == 0:
        return y, total, stats
    args = _forward_args(x, residual, weight, bias, y, total, stats, None, n_cols, eps, act_p0, act_p1)
    _forward_plan(args, rms, act, residual is not None, weight is not None, bias is not None)(*args)
    return y, total, stats


def _fake_backward(dy, x, weight, bias, stats, dsum, n_cols, rms, act, act_p0, act_p1, need_dw, need_db):
    return _dense(x), *param_grads(x, weight, bias, need_dw, need_db)


def _backward_args(dy, x, weight, bias, stats, dsum, dx, dw, db, dlow, n_cols, act_p0, act_p1) -> tuple:
    """The backward kernel's tensors (rows as (rows, n_cols) views) and floats; ``dlow``: dx's
    lower-precision copy (contiguous), or None."""
    x2, dy2 = rows_view(x, n_cols), rows_view(dy, n_cols)
    dsum2 = rows_view(dsum, n_cols) if dsum is not None else x2
    w = weight if weight is not None else x2
    b = bias if bias is not None else x2
    dlow2 = dlow.view(-1, n_cols) if dlow is not None else x2
    return (dy2, x2, w, b, stats, dsum2, dx.view(-1, n_cols), dw, db, dlow2, act_p0, act_p1)


def _backward_plan(args: tuple, rms: bool, act: int, *flags: bool, lower: bool = False) -> Callable:
    """The bound backward launch for ``_backward_args``'s ``args``, cached by what it depends on;
    ``flags``: has_w, has_b, has_dsum, need_dw, need_db; ``lower``: dx also stored in the dtype
    of ``args``' ``dlow``."""
    dy2, x2, w, _, _, dsum2 = args[:6]
    n_rows, n_cols = x2.shape
    strides = (dy2.stride(0), x2.stride(0), dsum2.stride(0), n_cols)
    has_w, has_b, has_dsum, need_dw, need_db = flags
    flags = (rms, False, has_w, has_b, act, has_dsum, need_dw, need_db)
    dtypes = (x2.dtype, w.dtype, dy2.dtype, *((args[9].dtype,) if lower else ()))
    key = (True, *flags, n_rows, n_cols, strides, *dtypes)

    def problem() -> LayerNormProblem:
        names = tuple(dtype_name(d) for d in dtypes)
        return LayerNormProblem(True, *flags, names, n_rows, n_cols, strides, lower)

    return FAMILY.plan(key, problem, lambda: args)


@custom_op(
    "layer_norm_backward",
    "(Tensor dy, Tensor x, Tensor? weight, Tensor? bias, Tensor stats, Tensor? dsum, int n_cols, "
    "bool rms, int act, float act_p0, float act_p1, bool need_dw, bool need_db) -> (Tensor, Tensor, Tensor)",
    _fake_backward,
)
def _backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    stats: torch.Tensor,
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
    dx = _dense(x)
    dw, db = param_grads(x, weight, bias, need_dw, need_db)
    if x.numel() == 0:
        dw.zero_()
        db.zero_()
        return dx, dw, db
    args = _backward_args(dy, x, weight, bias, stats, dsum, dx, dw, db, None, n_cols, act_p0, act_p1)
    flags = (weight is not None, bias is not None, dsum is not None, need_dw, need_db)
    _backward_plan(args, rms, act, *flags)(*args)
    return dx, dw, db


class _LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, bias, n_cols, eps, rms, act, act_p0, act_p1):
        y, total, stats = _forward(x, residual, weight, bias, n_cols, eps, rms, act, act_p0, act_p1)
        ctx.save_for_backward(total if residual is not None else x, weight, bias, stats)
        ctx.params = (n_cols, rms, act, act_p0, act_p1)
        ctx.set_materialize_grads(False)
        # Without a residual the sum is a placeholder: not returned, as every output costs the
        # autograd engine host time (tens of microseconds a call on the H100 machines).
        return (y, total) if residual is not None else y

    @staticmethod
    def backward(ctx, dy, dsum=None):
        x, weight, bias, stats = ctx.saved_tensors
        n_cols, rms, act, act_p0, act_p1 = ctx.params
        _, need_dres, need_dw, need_db = ctx.needs_input_grad[:4]
        if dy is None:  # only the sum's gradient arrived
            dx, dw, db = dsum, None, None
        else:
            dx, dw, db = _backward(
                dy, x, weight, bias, stats, dsum, n_cols, rms, act, act_p0, act_p1, need_dw, need_db
            )
        return dx, dx if need_dres else None, dw if need_dw else None, db if need_db else None, *[None] * 6


class _EagerLayerNorm(torch.autograd.Function):
    """``_LayerNormFunction`` for the eager fast path: ``program`` (see ``_eager_program``) runs
    the bound plans directly, forward and backward."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, program):
        y, total, stats = program[0](x, residual, weight, bias)
        ctx.save_for_backward(total if residual is not None else x, weight, bias, stats)
        ctx.program = program
        ctx.set_materialize_grads(False)
        return (y, total) if residual is not None else y

    @staticmethod
    def backward(ctx, dy, dsum=None):
        x, weight, bias, stats = ctx.saved_tensors
        _, need_dres, need_dw, need_db = ctx.needs_input_grad[:4]
        if dy is None:
            return dsum, dsum if need_dres else None, None, None, None
        dx, dres, dw, db = ctx.program[1](dy, x, weight, bias, stats, dsum, need_dw, need_db, need_dres)
        return dx, dres, dw, db, None


_apply_eager = raw_apply(_EagerLayerNorm)


def _rows_in_place(t: torch.Tensor, n_cols: int) -> bool:
    """Whether ``t``'s rows are a view of it (so a launch needs only its address)."""
    return rows_view(t, n_cols).data_ptr() == t.data_ptr()


def _eager_program(
    x, residual, weight, bias, n_cols, eps, rms, act, p0, p1, low_dtype=None
) -> Callable | None:
    """``fast(x, residual, weight, bias, grad) -> (y, x + residual or None)`` for the calls of a
    validated call's key (``_eager_key``): the work of ``_forward`` and ``_backward`` through
    plans bound here, the tensors passed as they are (the key fixes their strides, and their rows
    are views, so a launch reads only their addresses). None where the call needs the general
    path (an empty input, rows that are copies). Arguments as ``_forward``'s; ``low_dtype``: a
    dtype y is also stored in, kept as y's copy (``core.autocast.attach_lowered``). A residual
    narrower than x (a bf16 branch onto an fp32 stream) gets its gradient in its dtype from the
    backward kernel, as it writes dx."""
    if not x.numel() or not _rows_in_place(x, n_cols):
        return None
    if residual is not None and not _rows_in_place(residual, n_cols):
        return None
    has_res, flags = residual is not None, (weight is not None, bias is not None)
    narrow_res = residual.dtype if has_res and residual.dtype != x.dtype else None
    y, stats = _dense(x), _stats(x, n_cols)
    total = _dense(x) if has_res else _empty(x)
    lower = low_dtype is not None
    low = torch.empty_like(y, dtype=low_dtype) if lower else None
    first = _forward_args(x, residual, weight, bias, y, total, stats, low, n_cols, eps, p0, p1)
    plan = _forward_plan(first, rms, act, has_res, *flags, lower)
    out_strides = y.stride()
    # (The closures below hold strides and flags, not the first call's tensors.)

    def forward(x, residual, weight, bias):
        y, stats = _dense(x), _stats(x, n_cols)
        total = _dense(x) if has_res else None
        w = weight if weight is not None else x
        b = bias if bias is not None else x
        low = torch.empty_like(y, dtype=low_dtype) if lower else x
        plan(x, residual if has_res else x, w, b, y, total if has_res else x, stats, low, eps, p0, p1)
        if lower:
            attach_lowered(y, low)
        return y, total, stats

    # by (config version, need_dw, need_db, has_dsum, the residual's gradient lowered)
    backward_plans: dict[tuple, Callable] = {}

    def backward(dy, x, weight, bias, stats, dsum, need_dw, need_db, need_dres):
        """(dx, the residual's gradient or None, dw or None, db or None)."""
        if dy.stride() != out_strides or (dsum is not None and dsum.stride() != out_strides):
            dx, dw, db = _backward(
                dy, x, weight, bias, stats, dsum, n_cols, rms, act, p0, p1, need_dw, need_db
            )
            return dx, dx if need_dres else None, dw if need_dw else None, db if need_db else None
        dx = _dense(x)
        lower_dres = need_dres and narrow_res is not None
        dres = torch.empty_like(dx, dtype=narrow_res) if lower_dres else (dx if need_dres else None)
        dw = torch.empty_like(weight) if need_dw else None
        db = torch.empty_like(bias) if need_db else None
        w = weight if weight is not None else x
        b = bias if bias is not None else x
        dsum_or_x = dsum if dsum is not None else x
        args = (dy, x, w, b, stats, dsum_or_x, dx, dw if need_dw else x, db if need_db else x)
        args += (dres if lower_dres else x, p0, p1)
        key = (config.version, need_dw, need_db, dsum is not None, lower_dres)
        plan = backward_plans.get(key)
        if plan is None:
            full = _backward_args(
                dy, x, weight, bias, stats, dsum, dx, *args[7:9], dres if lower_dres else None, n_cols, p0, p1
            )  # fmt: skip
            plan = backward_plans[key] = _backward_plan(
                full, rms, act, *flags, dsum is not None, need_dw, need_db, lower=lower_dres
            )
        plan(*args)
        return dx, dres, dw, db

    program = (forward, backward)

    def fast(x, residual, weight, bias, grad):
        if grad:
            out = _apply_eager(x, residual, weight, bias, program)
            return out if has_res else (out, None)
        return forward(x, residual, weight, bias)[:2]

    fast.program = program  # type: ignore[attr-defined]  # for nodes that run the norm among others
    return fast


# Eager calls seen before run ``_eager_program``'s ``fast``, keyed by ``_eager_key``.
_eager: dict[tuple, Callable[..., tuple]] = {}


def _eager_key(
    op, input, residual, normalized_shape, weight, bias, eps, activation, low_dtype=None
) -> tuple | None:
    """The fast path's key of a call on plain tensors: everything the argument checks and the plans
    depend on (the op, types, shapes, strides, dtypes, devices, eps, the activation, the config
    version, the dtype of a lowered copy). None where the call takes the general path: tracing, a
    functorch transform, a tensor subclass, strided parameters, arguments of unusual types."""
    if not eager_tensor(input) or functorch_active():
        return None
    if type(normalized_shape) is not int:
        if type(normalized_shape) not in (tuple, list, torch.Size):
            return None
        normalized_shape = tuple(normalized_shape)
        if not all(type(n) is int for n in normalized_shape):
            return None
    if activation is not None and type(activation) is not str:
        return None
    for t in (weight, bias):
        if t is not None and (type(t) not in PLAIN_TENSORS or not t.is_contiguous()):
            return None
    if residual is not None and type(residual) not in PLAIN_TENSORS:
        return None
    return (
        config.version, op, input.shape, input.stride(), input.dtype, input.device, normalized_shape,
        eps, type(eps), activation, low_dtype,
        *[None if t is None else (t.shape, t.dtype, t.device) for t in (weight, bias)],
        None if residual is None else (residual.shape, residual.stride(), residual.dtype, residual.device),
    )  # fmt: skip


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
    low_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normalized, the sum or None). Eager calls on plain tensors are checked once per key
    (``_eager_key``); later calls with the key run prepared plans. ``low_dtype``: a lower dtype
    (for an fp32 input) the eager path also stores the output in, kept as the output's copy
    (``core.autocast.attach_lowered``); other paths ignore it."""
    key = _eager_key(op, input, residual, normalized_shape, weight, bias, eps, activation, low_dtype)
    if key is not None:
        fast = _eager.get(key)
        if fast is not None:
            grad = torch.is_grad_enabled() and (
                input.requires_grad
                or (weight is not None and weight.requires_grad)
                or (bias is not None and bias.requires_grad)
                or (residual is not None and residual.requires_grad)
            )
            return fast(input, residual, weight, bias, grad)
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
        if (
            residual.shape != input.shape
            or residual.device != input.device
            or not residual.is_floating_point()
            or torch.promote_types(input.dtype, residual.dtype) != input.dtype
        ):
            raise ValueError(
                f"{op}: argument 'residual' ({tuple(residual.shape)}, {residual.dtype}) must have the shape "
                f"and device of 'input' ({tuple(input.shape)}, {input.dtype}) and a float dtype no wider"
            )
    eps = check_eps(op, eps)
    act, p0, p1 = activation_kind(activation, op)
    n_cols = math.prod(shape)
    tensors = (input, residual, weight, bias)
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    if key is not None:  # validated: later calls with this key skip the checks
        fast = _eager_program(input, residual, weight, bias, n_cols, eps, rms, act, p0, p1, low_dtype)
        if fast is not None:
            _eager[key] = fast
            return fast(input, residual, weight, bias, grad)
    if grad:
        out = _LayerNormFunction.apply(input, residual, weight, bias, n_cols, eps, rms, act, p0, p1)
        return out if residual is not None else (out, None)
    y, total, _ = _forward(input, residual, weight, bias, n_cols, eps, rms, act, p0, p1)
    return y, total


# ---------------------------------------------------------------------------------------------
# 5. Public functions.


def _default_eps(input: object) -> float | None:
    """PyTorch's rms_norm default: the input dtype's machine epsilon (left to validation otherwise)."""
    floating = isinstance(input, torch.Tensor) and input.is_floating_point()
    return torch.finfo(input.dtype).eps if floating else None


def _layer_norm_autocast(
    dtype: torch.dtype,
    input: torch.Tensor,
    normalized_shape: Sequence[int] | int,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    activation: str | None = None,
) -> torch.Tensor:
    """``layer_norm`` under autocast on an fp32 input (a transformer's residual stream) where
    autograd records: in fp32 as PyTorch's, the output also stored in the autocast dtype as it is
    written, kept as its copy (``core.autocast.attach_lowered``), so that the product it usually
    feeds takes that instead of casting it (a kernel reading the fp32 output back).
    ``NotImplemented`` (autocast's casts, then ``layer_norm``) for other inputs and without grad
    mode (evaluation: the products' no-grad paths cast themselves)."""
    if not (eager_tensor(input) and input.dtype == torch.float32 and torch.is_grad_enabled()):
        return NotImplemented
    args = (input, None, normalized_shape, weight, bias, eps, False, activation, dtype)
    return _norm("tdnn.layer_norm", *args)[0]


@autocast_policy(FP32, inside=_layer_norm_autocast)
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

    Statistics are fp32. The output is contiguous, in the input's dtype (fp32 under CUDA autocast,
    as PyTorch's; there, with grad mode on, the kernel also writes the output in the autocast dtype
    for ``linear``'s cast to take while the output is unchanged: see ``core.autocast``). Raises
    ``ValueError`` for shape mismatches and ``eps <= 0``.
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


def _low_for_products(input: object) -> torch.dtype | None:
    """The autocast dtype where the fused add's normalized output is fp32 under autocast (on the
    input's device) with grad mode on: the products it feeds cast it to that dtype, and take the
    copy the kernel stores as it writes the output instead (``core.autocast.lowered``). Else None.
    (The fused adds are not cast by autocast: their fp32 output is the caller's fp32 stream.)"""
    if not eager_tensor(input) or input.dtype != torch.float32 or not torch.is_grad_enabled():
        return None
    device = input.device.type
    if not torch.is_autocast_enabled(device):
        return None
    dtype = torch.get_autocast_dtype(device)
    return dtype if dtype in (torch.float16, torch.bfloat16) else None


def add_layer_norm(
    input: torch.Tensor,
    residual: torch.Tensor,
    normalized_shape: Sequence[int] | int,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``layer_norm(input + residual)`` in one pass. Returns ``(normalized, input + residual)``:
    the sum, rounded to the input dtype, is the next block's residual in pre-norm transformers.
    ``residual`` has input's shape, in input's dtype or a narrower float one (a bf16 branch's
    output onto an fp32 residual stream, as autocast leaves them): the sum is formed in fp32, as
    PyTorch's type promotion would, and its gradient reaches ``residual`` in residual's dtype.
    Autocast does not cast the arguments (the sum keeps input's dtype): under CUDA autocast,
    where PyTorch's layer norm runs in fp32, pass an fp32 input to match it (there, with grad mode
    on, the output is also stored in the autocast dtype for the product it feeds, as
    ``layer_norm``'s)."""
    args = (normalized_shape, weight, bias, eps, False, None, _low_for_products(input))
    return _norm("tdnn.add_layer_norm", input, residual, *args)


def add_rms_norm(
    input: torch.Tensor,
    residual: torch.Tensor,
    normalized_shape: Sequence[int] | int,
    weight: torch.Tensor | None = None,
    eps: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm(input + residual)`` in one pass; returns ``(normalized, input + residual)``
    (``residual`` as ``add_layer_norm``'s)."""
    eps = _default_eps(input) if eps is None else eps
    args = (normalized_shape, weight, None, eps, True, None, _low_for_products(input))
    return _norm("tdnn.add_rms_norm", input, residual, *args)
