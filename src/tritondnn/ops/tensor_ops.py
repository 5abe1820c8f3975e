"""Pointwise tensor arithmetic with broadcasting and scaling: cuDNN's OpTensor.

``C = op(alpha1 * A, alpha2 * B) + beta * C`` for the binary ops ``add``, ``sub``, ``mul``, ``div``,
``min``, ``max``, and ``C = op(alpha1 * A) + beta * C`` for the unary ``sqrt``, ``neg`` and ``not``
(``1 - x``, cuDNN's logical not of 0/1 values). A and B broadcast against each other as in PyTorch
(expanded dimensions read with stride 0, never copied); every tensor is read in its own layout.
Arithmetic is fp32 (fp64 when any operand is fp64); the result dtype is PyTorch's type promotion.
min/max propagate NaN, as ``torch.minimum``/``torch.maximum``.

Gradients are computed by one pointwise kernel at the broadcast shape, then summed over the
broadcast dimensions with ``reduce_tensor``.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from torch.autograd.graph import increment_version

from ..core.checks import check_choice, check_float, check_tensor
from ..core.engine import Engine, Family, LaunchConfig, Problem
from ..core.launcher import cdiv, launcher
from ..core.library import custom_op
from ..core.numerics import convert
from ..core.strides import MAX_DIMS, broadcast_shapes, collapse, offset4, pad_dims, unravel4
from .reduce import reduce_tensor


class TensorOp(enum.IntEnum):
    ADD = 0
    SUB = 1
    MUL = 2
    DIV = 3
    MIN = 4
    MAX = 5
    SQRT = 6
    NEG = 7
    NOT = 8


OPS = tuple(op.name.lower() for op in TensorOp)
UNARY = (TensorOp.SQRT, TensorOp.NEG, TensorOp.NOT)

# ---------------------------------------------------------------------------------------------
# 1. Reference.


def op_tensor_reference(
    a: torch.Tensor,
    b: torch.Tensor | None,
    op: str,
    alpha1: float = 1.0,
    alpha2: float = 1.0,
    beta: float = 0.0,
    c: torch.Tensor | None = None,
) -> torch.Tensor:
    """The operation in float64 with plain PyTorch."""
    x = alpha1 * a.double()
    y = alpha2 * b.double() if b is not None else None
    fns: dict[str, Callable[[], torch.Tensor]] = {
        "add": lambda: x + y,
        "sub": lambda: x - y,
        "mul": lambda: x * y,
        "div": lambda: x / y,
        "min": lambda: torch.minimum(x, y),
        "max": lambda: torch.maximum(x, y),
        "sqrt": lambda: torch.sqrt(x),
        "neg": lambda: -x,
        "not": lambda: 1.0 - x,
    }
    r = fns[op]()
    return r + beta * c.double() if c is not None and beta != 0.0 else r


# ---------------------------------------------------------------------------------------------
# 2. Kernels.


@triton.jit
def _apply(x, y, OP: tl.constexpr):
    if OP == 0:
        r = x + y
    elif OP == 1:
        r = x - y
    elif OP == 2:
        r = x * y
    elif OP == 3:
        r = x / y
    elif OP == 4:
        # tl.minimum drops NaN on GPUs; torch.minimum propagates it.
        r = tl.where(x != x, x, tl.where((y != y) | (y < x), y, x))
    elif OP == 5:
        r = tl.where(x != x, x, tl.where((y != y) | (y > x), y, x))
    elif OP == 6:
        r = tl.sqrt(x)
    elif OP == 7:
        r = -x
    else:
        r = 1.0 - x
    return r


@triton.jit
def _coords(numel, size1, size2, size3, INDEX_64: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    if INDEX_64:
        pid = pid.to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    i0, i1, i2, i3 = unravel4(idx, size1, size2, size3)
    return idx, idx < numel, i0, i1, i2, i3


@triton.jit
def _op_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    alpha1,
    alpha2,
    beta,
    numel,
    size1,
    size2,
    size3,
    as0,
    as1,
    as2,
    as3,
    bs0,
    bs1,
    bs2,
    bs3,
    cs0,
    cs1,
    cs2,
    cs3,
    OP: tl.constexpr,
    HAS_B: tl.constexpr,
    HAS_BETA: tl.constexpr,
    DENSE: tl.constexpr,
    ACC: tl.constexpr,
    INDEX_64: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """c = op(alpha1 * a, alpha2 * b) + beta * c over the collapsed (size0..size3) box.

    a, b, c: strides as*, bs*, cs* (0 along broadcast dimensions). DENSE: all three are one dense
    run (flat index = offset, no division). HAS_BETA: c is read (beta != 0; beta * NaN-poisoned
    memory must not leak in when beta == 0, as cuDNN). ACC: fp32 or fp64 arithmetic.
    """
    if DENSE:
        pid = tl.program_id(0)
        if INDEX_64:
            pid = pid.to(tl.int64)
        oa = pid * BLOCK + tl.arange(0, BLOCK)
        mask = oa < numel
        ob = oa
        oc = oa
    else:
        _idx, mask, i0, i1, i2, i3 = _coords(numel, size1, size2, size3, INDEX_64, BLOCK)
        oa = offset4(i0, i1, i2, i3, as0, as1, as2, as3)
        ob = offset4(i0, i1, i2, i3, bs0, bs1, bs2, bs3)
        oc = offset4(i0, i1, i2, i3, cs0, cs1, cs2, cs3)
    x = alpha1 * convert(tl.load(a_ptr + oa, mask=mask), ACC)
    if HAS_B:
        y = alpha2 * convert(tl.load(b_ptr + ob, mask=mask), ACC)
    else:
        y = x
    r = _apply(x, y, OP)
    if HAS_BETA:
        r += beta * convert(tl.load(c_ptr + oc, mask=mask), ACC)
    tl.store(c_ptr + oc, convert(r, c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _op_backward_kernel(
    g_ptr,
    a_ptr,
    b_ptr,
    da_ptr,
    db_ptr,
    alpha1,
    alpha2,
    numel,
    size1,
    size2,
    size3,
    gs0,
    gs1,
    gs2,
    gs3,
    as0,
    as1,
    as2,
    as3,
    bs0,
    bs1,
    bs2,
    bs3,
    OP: tl.constexpr,
    HAS_B: tl.constexpr,
    ACC: tl.constexpr,
    INDEX_64: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """da, db (contiguous, the broadcast shape, flat index) from the output gradient g.

    Ties of min/max split the gradient in halves, as PyTorch's minimum/maximum.
    """
    idx, mask, i0, i1, i2, i3 = _coords(numel, size1, size2, size3, INDEX_64, BLOCK)
    g = convert(tl.load(g_ptr + offset4(i0, i1, i2, i3, gs0, gs1, gs2, gs3), mask=mask), ACC)
    x = alpha1 * convert(tl.load(a_ptr + offset4(i0, i1, i2, i3, as0, as1, as2, as3), mask=mask), ACC)
    if HAS_B:
        y = alpha2 * convert(tl.load(b_ptr + offset4(i0, i1, i2, i3, bs0, bs1, bs2, bs3), mask=mask), ACC)
    else:
        y = x
    if OP == 0:
        ga = g
        gb = g
    elif OP == 1:
        ga = g
        gb = -g
    elif OP == 2:
        ga = g * y
        gb = g * x
    elif OP == 3:
        ga = g / y
        gb = -g * x / (y * y)
    elif OP == 4 or OP == 5:
        if OP == 4:
            a_wins = x < y
            b_wins = y < x
        else:
            a_wins = x > y
            b_wins = y > x
        tie = x == y
        ga = tl.where(a_wins, g, tl.where(tie, 0.5 * g, 0.0))
        gb = tl.where(b_wins, g, tl.where(tie, 0.5 * g, 0.0))
    elif OP == 6:
        ga = g * 0.5 / tl.sqrt(x)
        gb = g
    else:
        ga = -g
        gb = g
    tl.store(da_ptr + idx, convert(ga * alpha1, da_ptr.dtype.element_ty), mask=mask)
    if HAS_B:
        tl.store(db_ptr + idx, convert(gb * alpha2, db_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------
# 3. Engines.


@dataclasses.dataclass(frozen=True)
class OpTensorProblem(Problem):
    """One launch. Tensors in order: forward (a, b, c), backward (g, a, b); ``sizes`` is the
    collapsed broadcast shape and ``strides`` each tensor's strides over it."""

    backward: bool
    op: int
    has_b: bool
    has_beta: bool
    dtypes: tuple[str, ...]
    sizes: tuple[int, ...]
    strides: tuple[tuple[int, ...], ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def dense(self) -> bool:
        return not self.backward and len(self.sizes) == 1 and all(s == (1,) for s in self.strides)


def _describe(input: torch.Tensor, other: torch.Tensor | None = None, op: str = "add") -> OpTensorProblem:
    """The problem ``op_tensor(input, other, op)`` poses."""
    b = other if other is not None else input
    shape = broadcast_shapes(input.shape, b.shape)
    out = torch.empty(shape, dtype=torch.result_type(input, b), device=input.device)
    tensors = (input.expand(shape), b.expand(shape), out)
    return _problem(False, TensorOp[op.upper()], other is not None, False, tensors, out)


def _problem(
    backward: bool, op: int, has_b: bool, has_beta: bool, tensors: tuple, lead: torch.Tensor
) -> OpTensorProblem:
    """``lead``: the tensor whose memory order the flat index walks (forward c, backward the
    contiguous da)."""
    sizes, strides = collapse(lead.shape, lead.stride(), *(t.stride() for t in tensors))
    return OpTensorProblem(
        backward=backward,
        op=int(op),
        has_b=has_b,
        has_beta=has_beta,
        dtypes=tuple(str(t.dtype).removeprefix("torch.") for t in tensors),
        sizes=tuple(sizes),
        strides=tuple(map(tuple, strides[1:])),
    )


FAMILY: Family[OpTensorProblem] = Family("op_tensor", _describe)


def _index_64(problem: OpTensorProblem) -> bool:
    reach = max(sum((n - 1) * abs(s) for n, s in zip(problem.sizes, st)) for st in problem.strides)
    return max(reach + 1, problem.numel + 4096) > 2**31 - 1


@FAMILY.register
class StridedEngine(Engine[OpTensorProblem]):
    """One pass over the broadcast shape, each tensor read through its own strides (up to four
    dimensions after merging); a dense flat loop where all three share one dense layout."""

    name = "strided"

    def not_supported_reasons(self, problem: OpTensorProblem) -> list[str]:
        if len(problem.sizes) > MAX_DIMS:
            return [f"{len(problem.sizes)} dimensions remain after merging; at most {MAX_DIMS}"]
        return []

    def cost(self, problem: OpTensorProblem) -> float:
        return 1.0

    def configs(self, problem: OpTensorProblem) -> list[LaunchConfig]:
        # 16 bytes of the output a thread at 4 warps, as the activations (the same memory-bound loop).
        block = 2048 if "float64" not in problem.dtypes else 1024
        return [
            {"BLOCK": block, "num_warps": 4},
            {"BLOCK": 4096, "num_warps": 8},
            {"BLOCK": 1024, "num_warps": 4},
        ]

    def bind(self, problem: OpTensorProblem, config: LaunchConfig) -> Callable[..., None]:
        sizes, strides = pad_dims(list(problem.sizes), [list(s) for s in problem.strides])
        acc = tl.float64 if "float64" in problem.dtypes else tl.float32
        block = config["BLOCK"]
        ints = (problem.numel, *sizes[1:], *(st for s in strides for st in s))
        if problem.backward:
            fn, flags = _op_backward_kernel, (problem.op, problem.has_b, acc, _index_64(problem), block)
            n = 5
        else:
            fn = _op_kernel
            flags = (
                problem.op,
                problem.has_b,
                problem.has_beta,
                problem.dense,
                acc,
                _index_64(problem),
                block,
            )
            n = 3
        return launcher(fn, (cdiv(problem.numel, block),), n, ints, flags, num_warps=config["num_warps"])


@FAMILY.register
class ContiguousEngine(Engine[OpTensorProblem]):
    """Layouts with more than four irreducible dimensions: operands copied to the broadcast shape."""

    name = "contiguous-copy"

    def not_supported_reasons(self, problem: OpTensorProblem) -> list[str]:
        if len(problem.sizes) <= MAX_DIMS:
            return ["only for layouts the strided engine cannot take"]
        return []

    def cost(self, problem: OpTensorProblem) -> float:
        return 4.0

    def bind(self, problem: OpTensorProblem, config: LaunchConfig) -> Callable[..., None]:
        def run(*args):
            tensors, scalars = args[: 5 if problem.backward else 3], args[5 if problem.backward else 3 :]
            if problem.backward:
                g, a, b, da, db = tensors
                _launch(
                    True,
                    problem.op,
                    problem.has_b,
                    False,
                    (g.contiguous(), a.contiguous(), b.contiguous()),
                    (da, db),
                    scalars,
                )
            else:
                a, b, c = tensors
                dense = torch.empty(c.shape, dtype=c.dtype, device=c.device)
                if problem.has_beta:
                    dense.copy_(c)
                _launch(
                    False,
                    problem.op,
                    problem.has_b,
                    problem.has_beta,
                    (a.contiguous(), b.contiguous(), dense),
                    (),
                    scalars,
                )
                c.copy_(dense)

        return run


def _launch(
    backward: bool, op: int, has_b: bool, has_beta: bool, tensors: tuple, outs: tuple, scalars: tuple
):
    key = (
        backward,
        op,
        has_b,
        has_beta,
        tensors[0].shape,
        *[(t.dtype, t.stride()) for t in (*tensors, *outs)],
    )
    lead = outs[0] if backward else tensors[2]
    plan = FAMILY.plan(key, lambda: _problem(backward, op, has_b, has_beta, tensors, lead), lambda: ())
    plan(*tensors, *outs, *scalars)


# ---------------------------------------------------------------------------------------------
# 4. torch.library op and autograd.


def _fake(a, b, c, op, alpha1, alpha2, beta):
    other = b if b is not None else a
    shape = broadcast_shapes(a.shape, other.shape)
    return a.new_empty(shape, dtype=torch.result_type(a, other))


@custom_op(
    "op_tensor",
    "(Tensor a, Tensor? b, Tensor? c, int op, float alpha1, float alpha2, float beta) -> Tensor",
    _fake,
)
def _forward(a, b, c, op, alpha1, alpha2, beta):
    """A fresh output (``c`` given: beta * c is added, ``c`` itself untouched)."""
    other = b if b is not None else a
    shape = broadcast_shapes(a.shape, other.shape)
    out = torch.empty(shape, dtype=torch.result_type(a, other), device=a.device)
    if c is not None and beta != 0.0:
        out.copy_(c)
    _into(a, b, out, op, alpha1, alpha2, beta)
    return out


def _into(a, b, out, op, alpha1, alpha2, beta) -> None:
    if out.numel() == 0:
        return
    shape = out.shape
    bb = b if b is not None else a
    _launch(
        False,
        op,
        b is not None,
        beta != 0.0,
        (a.expand(shape), bb.expand(shape), out),
        (),
        (alpha1, alpha2, beta),
    )
    increment_version(out)  # a kernel's write: autograd (and core.autocast) see it so


def _sum_to(t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``t`` (the broadcast shape) summed over the dimensions that broadcasting expanded to ``shape``."""
    lead = t.ndim - len(shape)
    dims = list(range(lead)) + [lead + i for i, s in enumerate(shape) if s == 1 and t.shape[lead + i] != 1]
    if not dims:
        return t.view(shape)
    return reduce_tensor(t, "add", dims).reshape(shape)


class _OpTensorFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, op, alpha1, alpha2):
        ctx.save_for_backward(a, b if b is not None else a)
        ctx.params = (op, alpha1, alpha2, b is not None)
        return _forward(a, b, None, op, alpha1, alpha2, 0.0)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        op, alpha1, alpha2, has_b = ctx.params
        shape = g.shape
        da = torch.empty(shape, dtype=a.dtype, device=g.device)
        db = torch.empty(shape, dtype=b.dtype, device=g.device) if has_b else da
        if g.numel():
            _launch(True, op, has_b, False, (g, a.expand(shape), b.expand(shape)), (da, db), (alpha1, alpha2))
        return _sum_to(da, a.shape), (_sum_to(db, b.shape) if has_b else None), None, None, None


# ---------------------------------------------------------------------------------------------
# 5. Public function.


def op_tensor(
    input: torch.Tensor,
    other: torch.Tensor | None = None,
    op: str = "add",
    *,
    alpha1: float = 1.0,
    alpha2: float = 1.0,
    beta: float = 0.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """cuDNN's OpTensor: ``op(alpha1 * input, alpha2 * other) + beta * out``.

    Args:
        input, other: fp16/bf16/fp32/fp64 tensors of any strides whose shapes broadcast; ``other``
            is required for the binary ops and must be None for the unary ones.
        op: ``"add"``, ``"sub"``, ``"mul"``, ``"div"``, ``"min"``, ``"max"`` (binary) or ``"sqrt"``,
            ``"neg"``, ``"not"`` (``1 - x``) (unary).
        alpha1, alpha2, beta: real scalars; ``beta != 0`` needs ``out`` (its old values are read).
        out: optional destination of the broadcast shape and the promoted dtype, any strides; it
            is written in place and returned (no autograd through ``out``).

    Returns a new tensor of the broadcast shape (contiguous) and promoted dtype, or ``out``.
    Gradients flow to ``input`` and ``other`` (summed over broadcast dimensions).
    """
    name = "tdnn.op_tensor"
    check_tensor(name, "input", input)
    check_choice(name, "op", op, OPS)
    kind = TensorOp[op.upper()]
    if kind in UNARY:
        if other is not None:
            raise ValueError(f"{name}: op {op!r} is unary; 'other' must be None")
    else:
        if other is None:
            raise ValueError(f"{name}: op {op!r} is binary; 'other' is required")
        check_tensor(name, "other", other)
        if other.device != input.device:
            raise ValueError(f"{name}: 'other' is on {other.device} but 'input' is on {input.device}")
    a1 = check_float(name, "alpha1", alpha1)
    a2 = check_float(name, "alpha2", alpha2)
    b = check_float(name, "beta", beta)
    bshape = other.shape if other is not None else input.shape
    try:
        shape = broadcast_shapes(input.shape, bshape)
    except RuntimeError:
        raise ValueError(
            f"{name}: shapes {tuple(input.shape)} and {tuple(bshape)} do not broadcast"
        ) from None
    dtype = torch.result_type(input, other) if other is not None else input.dtype
    if out is not None:
        check_tensor(name, "out", out)
        if out.shape != shape or out.dtype != dtype or out.device != input.device:
            raise ValueError(
                f"{name}: argument 'out' has shape {tuple(out.shape)} and dtype {out.dtype}; expected "
                f"{tuple(shape)} and {dtype} on {input.device}"
            )
        if torch.is_grad_enabled() and (input.requires_grad or (other is not None and other.requires_grad)):
            raise RuntimeError(f"{name}: 'out' does not support autograd; call without 'out'")
        _into(input, other, out, int(kind), a1, a2, b)
        return out
    if b != 0.0:
        raise ValueError(f"{name}: beta={b} needs 'out' (beta scales its previous values)")
    wants_grad = torch.is_grad_enabled() and (
        input.requires_grad or (other is not None and other.requires_grad)
    )
    if wants_grad:
        return _OpTensorFunction.apply(input, other, int(kind), a1, a2)
    return _forward(input, other, None, int(kind), a1, a2, 0.0)


__all__ = ["FAMILY", "OPS", "TensorOp", "op_tensor", "op_tensor_reference"]
