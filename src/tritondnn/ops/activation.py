"""Pointwise activations, forward and backward: cuDNN's activation modes as functional ops.

relu (with cuDNN's negative slope and upper clip), leaky_relu, elu, sigmoid, tanh, gelu (exact and
tanh approximation), silu/swish (with beta) and softplus, for fp16, bf16, fp32 and fp64 tensors of
any shape and strides. Arithmetic is fp32 (fp64 for fp64 tensors); the output has the input's dtype
and, for dense inputs, its layout. ``activation_value``/``activation_gradient`` are the jitted
element functions the matmul and convolution epilogues reuse.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.autograd.graph import increment_version

from ..core import numerics
from ..core.autocast import FP32, autocast_policy
from ..core.checks import check_choice, check_float, check_like, check_tensor
from ..core.config import config
from ..core.engine import Engine, Family, LaunchConfig, Problem
from ..core.launcher import cdiv, launcher
from ..core.library import custom_op, eager_tensor, functorch_active, raw_apply
from ..core.strides import MAX_DIMS, collapse, offset4, pad_dims, unravel4


class Activation(enum.IntEnum):
    """Activation kinds, with the meaning of the two scalar parameters each takes."""

    RELU = 0  # p0: slope below zero, p1: upper clip (inf for none)
    ELU = 1  # p0: alpha
    SIGMOID = 2
    TANH = 3
    GELU = 4  # exact, with erf
    GELU_TANH = 5  # tanh approximation
    SILU = 6  # p0: beta (swish)
    SOFTPLUS = 7  # p0: beta, p1: threshold above which the output is linear


def saves_output(kind: int, p0: float) -> bool:
    """Whether the backward pass is computed from the output (so the op may run in place)."""
    if kind in (Activation.SIGMOID, Activation.TANH):
        return True
    # relu and elu can tell x > 0 from y > 0 only when the negative side keeps its sign.
    return kind in (Activation.RELU, Activation.ELU) and p0 >= 0


# ---------------------------------------------------------------------------------------------
# 1. Reference: the meaning of each op, in float64.


def activation_math(x: torch.Tensor, kind: int, p0: float = 0.0, p1: float = 0.0) -> torch.Tensor:
    """The activation with plain PyTorch in x's own dtype (the graph API's reference computes in
    its compute dtype with it)."""
    if kind == Activation.RELU:
        # where, not clamp: the gradient at x == clip is 0, as hardtanh's (clamp's would be 1);
        # slope 0 gives 0 at -inf, as F.relu (not -inf * 0).
        neg = torch.zeros_like(x) if p0 == 0 else x * p0
        return torch.where(x > 0, torch.where(x >= p1, p1, x), torch.where(x < 0, neg, x))
    if kind == Activation.ELU:
        return torch.where(x > 0, x, p0 * torch.expm1(x))
    if kind == Activation.SIGMOID:
        return torch.sigmoid(x)
    if kind == Activation.TANH:
        return torch.tanh(x)
    if kind == Activation.GELU:
        return F.gelu(x)
    if kind == Activation.GELU_TANH:
        return F.gelu(x, approximate="tanh")
    if kind == Activation.SILU:
        return x * torch.sigmoid(p0 * x)
    if kind == Activation.SOFTPLUS:
        return F.softplus(x, beta=p0, threshold=p1)
    raise ValueError(f"unknown activation kind {kind}")


def activation_reference(x: torch.Tensor, kind: int, p0: float = 0.0, p1: float = 0.0) -> torch.Tensor:
    """The activation in float64 with plain PyTorch."""
    return activation_math(x.double(), kind, p0, p1)


def activation_backward_reference(
    grad: torch.Tensor, x: torch.Tensor, kind: int, p0: float = 0.0, p1: float = 0.0
) -> torch.Tensor:
    """d(activation)/dx times ``grad``, in float64, by autograd through the reference."""
    x64 = x.detach().double().requires_grad_(True)
    (dx,) = torch.autograd.grad(activation_reference(x64, kind, p0, p1), x64, grad.double())
    return dx


# ---------------------------------------------------------------------------------------------
# 2. Kernels.


_GELU_2K = tl.constexpr(1.5957691216057308)  # 2 sqrt(2 / pi)


@triton.jit
def activation_value(x, KIND: tl.constexpr, p0, p1):
    """y = act(x) elementwise, in x's (fp32 or fp64) arithmetic type."""
    if KIND == 0:
        # x < 0 alone is scaled (NaN and -0.0 pass through), and slope 0 gives 0 at -inf, not NaN.
        y = tl.where(x > 0, tl.minimum(x, p1), tl.where(x < 0, tl.where(p0 == 0.0, 0.0, x * p0), x))
    elif KIND == 1:
        y = tl.where(x > 0, x, p0 * numerics.expm1(x))
    elif KIND == 2:
        y = numerics.sigmoid(x)
    elif KIND == 3:
        y = numerics.tanh(x)
    elif KIND == 4:
        y = x * numerics.normal_cdf(x)[0]
    elif KIND == 5:
        # 0.5 x (1 + tanh(u)) is x * sigmoid(2u): an exponential and a reciprocal, where tanh's
        # exact form costs a division and a polynomial too (the matmul's GELU epilogue spilled).
        y = x * numerics.sigmoid(_GELU_2K * (x + 0.044715 * x * x * x))
    elif KIND == 6:
        y = x * numerics.sigmoid(p0 * x)
    else:
        bx = p0 * x
        # Above the threshold softplus is linear; exp(bx) may overflow to inf there, and log1p(inf)
        # is inf, so the unselected lane stays harmless. (No tl.minimum: it drops NaN on GPUs.)
        y = tl.where(bx > p1, x, numerics.log1p(tl.exp(bx)) / p0)
    return y


@triton.jit
def activation_gradient(dy, s, KIND: tl.constexpr, SAVED_OUTPUT: tl.constexpr, p0, p1):
    """dx = dy * act'(x); ``s`` is the output y when SAVED_OUTPUT, else the input x."""
    if KIND == 0:
        # Same test on x or y: the negative side keeps its sign (p0 >= 0) when the output is saved.
        g = tl.where(s > 0, tl.where(s < p1, 1.0, 0.0), p0)
    elif KIND == 1:
        if SAVED_OUTPUT:
            g = tl.where(s > 0, 1.0, s + p0)  # for x <= 0: alpha * exp(x) == y + alpha
        else:
            g = tl.where(s > 0, 1.0, p0 * tl.exp(s))
    elif KIND == 2:  # written in the output: sigmoid(x) from x first where x is given
        if not SAVED_OUTPUT:
            s = numerics.sigmoid(s)
        g = s * (1.0 - s)
    elif KIND == 3:
        if not SAVED_OUTPUT:
            s = numerics.tanh(s)
        g = 1.0 - s * s
    elif KIND == 4:
        cdf, kernel = numerics.normal_cdf(s)
        g = cdf + s * (kernel * 0.3989422804014327)
    elif KIND == 5:
        # With t = tanh(u) = 2r - 1, r = sigmoid(2u) = 1 / (1 + e), e = exp(-2u): 0.5 (1 + t) = r
        # and 0.5 (1 - t^2) = 2 r (1 - r), where 1 - r = e r (1 where e overflowed: inf * 0).
        e = tl.exp(-_GELU_2K * (s + 0.044715 * s * s * s))
        r = numerics.one_over_one_plus(e)
        g = r + _GELU_2K * s * r * tl.where(r > 0, e * r, 1.0) * (1.0 + 0.134145 * s * s)
    elif KIND == 6:
        sg = numerics.sigmoid(p0 * s)
        g = sg * (1.0 + p0 * s * (1.0 - sg))
    else:
        bx = p0 * s
        g = tl.where(bx > p1, 1.0, numerics.sigmoid(bx))
    return dy * g


@triton.jit
def _flat_indices(numel, INDEX_64: tl.constexpr, BLOCK: tl.constexpr):
    start = tl.program_id(0)
    if INDEX_64:  # numel may exceed 2**31: 32-bit offsets would wrap
        start = start.to(tl.int64)
    idx = start * BLOCK + tl.arange(0, BLOCK)
    return idx, idx < numel


@triton.jit
def _load(ptrs, mask, EVEN: tl.constexpr):
    if EVEN:  # every block is full: no mask, which keeps the widest vector accesses
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=mask)


@triton.jit
def _store(ptrs, value, mask, EVEN: tl.constexpr):
    if EVEN:
        tl.store(ptrs, value.to(ptrs.dtype.element_ty))
    else:
        tl.store(ptrs, value.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _forward_dense_kernel(
    x_ptr, y_ptr, p0, p1, numel,
    KIND: tl.constexpr, INDEX_64: tl.constexpr, EVEN: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """x, y: dense tensors of one layout, walked as flat arrays of ``numel`` elements.
    EVEN: ``numel`` is a multiple of BLOCK."""
    idx, mask = _flat_indices(numel, INDEX_64, BLOCK)
    x = _load(x_ptr + idx, mask, EVEN)
    _store(y_ptr + idx, activation_value(numerics.upcast(x), KIND, p0, p1), mask, EVEN)


@triton.jit
def _forward_strided_kernel(
    x_ptr, y_ptr, p0, p1, numel, size1, size2, size3, xs0, xs1, xs2, xs3, ys0, ys1, ys2, ys3,
    KIND: tl.constexpr, INDEX_64: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """x, y: any strides over a (size0, size1, size2, size3) box, the collapsed shape (see core.strides)."""
    idx, mask = _flat_indices(numel, INDEX_64, BLOCK)
    i0, i1, i2, i3 = unravel4(idx, size1, size2, size3)
    x = tl.load(x_ptr + offset4(i0, i1, i2, i3, xs0, xs1, xs2, xs3), mask=mask)
    y = activation_value(numerics.upcast(x), KIND, p0, p1)
    tl.store(y_ptr + offset4(i0, i1, i2, i3, ys0, ys1, ys2, ys3), y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _backward_dense_kernel(
    dy_ptr, s_ptr, dx_ptr, p0, p1, numel,
    KIND: tl.constexpr, SAVED_OUTPUT: tl.constexpr, INDEX_64: tl.constexpr, EVEN: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """dy, s (saved x or y), dx: dense tensors of one layout."""
    idx, mask = _flat_indices(numel, INDEX_64, BLOCK)
    dy = numerics.upcast(_load(dy_ptr + idx, mask, EVEN))
    s = numerics.upcast(_load(s_ptr + idx, mask, EVEN))
    _store(dx_ptr + idx, activation_gradient(dy, s, KIND, SAVED_OUTPUT, p0, p1), mask, EVEN)


@triton.jit
def _backward_strided_kernel(
    dy_ptr, s_ptr, dx_ptr, p0, p1, numel, size1, size2, size3,
    gs0, gs1, gs2, gs3, ss0, ss1, ss2, ss3, ds0, ds1, ds2, ds3,
    KIND: tl.constexpr, SAVED_OUTPUT: tl.constexpr, INDEX_64: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """dy (strides gs*), s (ss*), dx (ds*) over the collapsed (size0..size3) box."""
    idx, mask = _flat_indices(numel, INDEX_64, BLOCK)
    i0, i1, i2, i3 = unravel4(idx, size1, size2, size3)
    dy = numerics.upcast(tl.load(dy_ptr + offset4(i0, i1, i2, i3, gs0, gs1, gs2, gs3), mask=mask))
    s = numerics.upcast(tl.load(s_ptr + offset4(i0, i1, i2, i3, ss0, ss1, ss2, ss3), mask=mask))
    dx = activation_gradient(dy, s, KIND, SAVED_OUTPUT, p0, p1)
    tl.store(dx_ptr + offset4(i0, i1, i2, i3, ds0, ds1, ds2, ds3), dx.to(dx_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------
# 3. Engines.


@dataclasses.dataclass(frozen=True)
class ActivationProblem(Problem):
    """One launch over a collapsed layout (see ``core.strides.collapse``).

    Tensors, in launch order: forward ``(x, y)``, backward ``(grad, saved, dx)``; ``dtypes`` and
    ``strides`` follow that order, ``sizes`` is the collapsed shape, outermost first.
    """

    backward: bool
    kind: int
    saved_output: bool
    dtypes: tuple[str, ...]
    sizes: tuple[int, ...]
    strides: tuple[tuple[int, ...], ...]
    index_64: bool

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def dense(self) -> bool:
        return len(self.sizes) == 1 and all(s == (1,) for s in self.strides)


def _needs_int64(sizes: list[int], strides: list[list[int]]) -> bool:
    reach = max(sum((n - 1) * abs(st) for n, st in zip(sizes, s)) for s in strides)
    return max(reach + 1, math.prod(sizes)) > 2**31 - 1


def _problem(
    backward: bool, kind: int, saved_output: bool, tensors: tuple[torch.Tensor, ...]
) -> ActivationProblem:
    out = tensors[-1]
    # The output goes first into collapse so the flat index walks its memory in order.
    sizes, strides = collapse(out.shape, out.stride(), *(t.stride() for t in tensors[:-1]))
    strides = strides[1:] + strides[:1]
    return ActivationProblem(
        backward=backward,
        kind=kind,
        saved_output=saved_output,
        dtypes=tuple(str(t.dtype).removeprefix("torch.") for t in tensors),
        sizes=tuple(sizes),
        strides=tuple(map(tuple, strides)),
        index_64=_needs_int64(sizes, strides),
    )


def _describe(input: torch.Tensor, activation: str = "relu", backward: bool = False) -> ActivationProblem:
    """The problem a call ``activation(input)`` (or its backward, for a contiguous gradient) poses."""
    kind = Activation[activation.upper()].value
    out = torch.empty_like(input)
    saved_output = saves_output(kind, 0.0)
    tensors = (torch.empty_like(input), input, out) if backward else (input, out)
    return _problem(backward, kind, saved_output, tensors)


FAMILY: Family[ActivationProblem] = Family("activation", _describe)


_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


class _Pointwise(Engine[ActivationProblem]):
    def configs(self, problem: ActivationProblem) -> list[LaunchConfig]:
        # 32 bytes of each tensor a thread, 4 warps: as fast as PyTorch's elementwise kernels and
        # a plain copy on H100 (a sweep of 1-16K blocks and 4-16 warps was within 1% of it).
        block = 4096 // _ITEMSIZE[problem.dtypes[-1]]
        first = {"BLOCK": block, "num_warps": 4}
        others = [
            {"BLOCK": b, "num_warps": w} for b, w in ((1024, 4), (2048, 4), (2048, 8), (4096, 8), (4096, 16))
        ]
        return [first] + [c for c in others if c != first]

    def _make_launch(
        self, problem: ActivationProblem, config: LaunchConfig, layout: tuple
    ) -> Callable[..., None]:
        """Arguments of the returned launch: the tensors in launch order, then p0 and p1."""
        block = config["BLOCK"]
        dense = not layout
        flags: tuple = (problem.kind, problem.saved_output) if problem.backward else (problem.kind,)
        flags += (problem.index_64, problem.numel % block == 0) if dense else (problem.index_64,)
        if problem.backward:
            fn = _backward_dense_kernel if dense else _backward_strided_kernel
        else:
            fn = _forward_dense_kernel if dense else _forward_strided_kernel
        return launcher(
            fn,
            (cdiv(problem.numel, block),),
            num_tensors=len(problem.dtypes),
            ints=(problem.numel, *layout),
            constexprs=(*flags, block),
            num_warps=config["num_warps"],
        )


@FAMILY.register
class DenseEngine(_Pointwise):
    """All tensors share one dense layout (contiguous, channels_last, any permutation): a flat loop."""

    name = "dense"

    def not_supported_reasons(self, problem: ActivationProblem) -> list[str]:
        if problem.dense:
            return []
        return ["the tensors do not share one dense layout (sliced, expanded or differently ordered)"]

    def cost(self, problem: ActivationProblem) -> float:
        return 1.0

    def bind(self, problem: ActivationProblem, config: LaunchConfig) -> Callable[..., None]:
        return self._make_launch(problem, config, ())


@FAMILY.register
class StridedEngine(_Pointwise):
    """Any strides, up to four dimensions after merging: index arithmetic instead of a copy."""

    name = "strided"

    def not_supported_reasons(self, problem: ActivationProblem) -> list[str]:
        if len(problem.sizes) > MAX_DIMS:
            return [f"{len(problem.sizes)} dimensions remain after merging; at most {MAX_DIMS}"]
        return []

    def cost(self, problem: ActivationProblem) -> float:
        return 1.5  # the division chain per element costs, but reads no more bytes than dense

    def bind(self, problem: ActivationProblem, config: LaunchConfig) -> Callable[..., None]:
        sizes, strides = pad_dims(list(problem.sizes), [list(s) for s in problem.strides])
        return self._make_launch(problem, config, (*sizes[1:], *(st for s in strides for st in s)))


@FAMILY.register
class ContiguousEngine(_Pointwise):
    """Fallback for layouts with more than four irreducible dimensions: copy to contiguous, run dense."""

    name = "contiguous-copy"

    def not_supported_reasons(self, problem: ActivationProblem) -> list[str]:
        if len(problem.sizes) <= MAX_DIMS:
            return ["only for layouts the strided engine cannot take; this one it reads in place"]
        return []

    def cost(self, problem: ActivationProblem) -> float:
        return 4.0  # a copy of every input and of the output

    def bind(self, problem: ActivationProblem, config: LaunchConfig):
        n = len(problem.dtypes)
        dense = dataclasses.replace(
            problem, sizes=(problem.numel,), strides=((1,),) * n, index_64=problem.numel > 2**31 - 1
        )
        launch = self._make_launch(dense, config, ())

        def run(*args: object) -> None:
            *tensors, p0, p1 = args
            out = tensors[-1]
            dense_out = torch.empty(out.shape, dtype=out.dtype, device=out.device)
            launch(*(t.contiguous() for t in tensors[:-1]), dense_out, p0, p1)
            out.copy_(dense_out)

        return run


# Per-shape plans: the second call with the same shapes, strides and dtypes costs one lookup.
_plans: dict[tuple, Callable[..., None]] = {}


def _plan(
    backward: bool, kind: int, saved_output: bool, tensors: tuple[torch.Tensor, ...]
) -> Callable[..., None]:
    problem = _problem(backward, kind, saved_output, tensors)
    out = tensors[-1]

    def timing_args() -> tuple:
        # In-place calls write their input: time them into a scratch output.
        scratch = torch.empty_strided(out.shape, out.stride(), dtype=out.dtype, device=out.device)
        return (*tensors[:-1], scratch, 1.0, 1.0)

    choice = FAMILY.select(problem, timing_args)
    return choice.engine.bind(problem, choice.config)


def _forward_plan(x: torch.Tensor, y: torch.Tensor, kind: int) -> Callable[..., None]:
    # y is x (in place) or empty_like(x), whose strides follow from x's: x's describe the problem.
    key = (kind, y is x, config.version, x.shape, x.stride(), x.dtype)
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = _plan(False, kind, False, (x, y))
    return plan


def _launch_forward(x: torch.Tensor, y: torch.Tensor, kind: int, p0: float, p1: float) -> None:
    _forward_plan(x, y, kind)(x, y, p0, p1)


def _backward_plan(
    grad: torch.Tensor, saved: torch.Tensor, dx: torch.Tensor, kind: int, saved_output: bool
) -> Callable[..., None]:
    # dx is empty_like(saved): saved's strides and grad's describe the problem.
    key = (
        kind,
        saved_output,
        config.version,
        saved.shape,
        saved.stride(),
        grad.stride(),
        saved.dtype,
        grad.dtype,
    )
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = _plan(True, kind, saved_output, (grad, saved, dx))
    return plan


def _launch_backward(
    grad: torch.Tensor,
    saved: torch.Tensor,
    dx: torch.Tensor,
    kind: int,
    p0: float,
    p1: float,
    saved_output: bool,
) -> None:
    _backward_plan(grad, saved, dx, kind, saved_output)(grad, saved, dx, p0, p1)


# ---------------------------------------------------------------------------------------------
# 4. torch.library ops and autograd.


def _fake_forward(x: torch.Tensor, kind: int, p0: float, p1: float) -> torch.Tensor:
    return torch.empty_like(x)


@custom_op("activation", "(Tensor x, int kind, float p0, float p1) -> Tensor", _fake_forward)
def _forward(x: torch.Tensor, kind: int, p0: float, p1: float) -> torch.Tensor:
    y = torch.empty_like(x)
    if x.numel():
        _launch_forward(x, y, kind, p0, p1)
    return y


def _fake_backward(
    grad: torch.Tensor, saved: torch.Tensor, kind: int, p0: float, p1: float, saved_output: bool
) -> torch.Tensor:
    return torch.empty_like(saved)


@custom_op(
    "activation_backward",
    "(Tensor grad, Tensor saved, int kind, float p0, float p1, bool saved_output) -> Tensor",
    _fake_backward,
)
def _backward(
    grad: torch.Tensor, saved: torch.Tensor, kind: int, p0: float, p1: float, saved_output: bool
) -> torch.Tensor:
    dx = torch.empty_like(saved)
    if saved.numel():
        _launch_backward(grad, saved, dx, kind, p0, p1, saved_output)
    return dx


def _forward_inplace(x: torch.Tensor, kind: int, p0: float, p1: float) -> torch.Tensor:
    if type(x) is torch.Tensor and not torch.compiler.is_compiling():
        if x.numel():
            _launch_forward(x, x, kind, p0, p1)
            increment_version(x)  # a kernel's write: autograd (and core.autocast) see it so
        return x
    return x.copy_(_forward(x, kind, p0, p1))


class _ActivationFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, kind: int, p0: float, p1: float, inplace: bool) -> torch.Tensor:
        saved_output = saves_output(kind, p0)
        ctx.params = (kind, p0, p1, saved_output)
        if inplace:
            saved_input = None if saved_output else x.clone()
            y = _forward_inplace(x, kind, p0, p1)
            ctx.mark_dirty(y)
        else:
            saved_input = x
            y = _forward(x, kind, p0, p1)
        ctx.save_for_backward(y if saved_output else saved_input)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        (saved,) = ctx.saved_tensors
        kind, p0, p1, saved_output = ctx.params
        return _backward(grad, saved, kind, p0, p1, saved_output), None, None, None, None


class _EagerActivation(torch.autograd.Function):
    """``_ActivationFunction`` for the eager fast path: ``program`` (see ``_eager_program``) holds
    the bound forward plan and the backward's parameters."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, program: tuple) -> torch.Tensor:
        run, inplace, saved_output, _ = program
        if inplace:
            saved = None if saved_output else x.clone()
            run(x, x)
            ctx.mark_dirty(x)
            y = x
        else:
            y = torch.empty_like(x)
            run(x, y)
            saved = x
        ctx.save_for_backward(y if saved_output else saved)
        ctx.program = program
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        (saved,) = ctx.saved_tensors
        return ctx.program[3](grad, saved), None


_apply_eager = raw_apply(_EagerActivation)


def _eager_program(
    x: torch.Tensor, kind: int, p0: float, p1: float, inplace: bool, grad: bool
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``fast(x) -> y`` for later calls of a validated call's key (see ``_apply``): the forward
    plan bound here, through ``_EagerActivation`` when autograd records the call; None for empty
    tensors and for in-place calls on a tensor subclass (which take the op's copy path)."""
    if not x.numel() or (inplace and type(x) is not torch.Tensor):
        return None
    plan = _forward_plan(x, x if inplace else torch.empty_like(x), kind)
    if not grad:
        if inplace:

            def fast(x: torch.Tensor) -> torch.Tensor:
                plan(x, x, p0, p1)
                increment_version(x)
                return x

        else:

            def fast(x: torch.Tensor) -> torch.Tensor:
                y = torch.empty_like(x)
                plan(x, y, p0, p1)
                return y

        return fast

    def run(x: torch.Tensor, y: torch.Tensor) -> None:
        plan(x, y, p0, p1)

    saved_output = saves_output(kind, p0)
    last: list = [None, None, None]  # the backward plan, for (gradient strides, config version)

    def backward(grad: torch.Tensor, saved: torch.Tensor) -> torch.Tensor:
        dx = torch.empty_like(saved)
        strides = grad.stride()
        if last[0] != strides or last[1] != config.version or grad.dtype != saved.dtype:
            plan = _backward_plan(grad, saved, dx, kind, saved_output)
            if grad.dtype != saved.dtype:  # not seen from autograd; not kept
                plan(grad, saved, dx, p0, p1)
                return dx
            last[:] = strides, config.version, plan
        last[2](grad, saved, dx, p0, p1)
        return dx

    program = (run, inplace, saved_output, backward)

    def fast_grad(x: torch.Tensor) -> torch.Tensor:
        return _apply_eager(x, program)

    return fast_grad


# Eager calls seen before run ``_eager_program``'s ``fast``, keyed by the call's kind and
# parameters, whether it is in place and recorded by autograd, the input's type, shape, strides
# and dtype, and the config version: everything the argument check and the plans depend on.
_eager: dict[tuple, Callable[[torch.Tensor], torch.Tensor]] = {}


def _apply(
    op: str, input: torch.Tensor, kind: int, p0: float = 0.0, p1: float = 0.0, inplace: bool = False
) -> torch.Tensor:
    key = None
    if eager_tensor(input) and not functorch_active():
        grad = input.requires_grad and torch.is_grad_enabled()
        key = (
            kind,
            p0,
            p1,
            inplace,
            grad,
            type(input),
            config.version,
            input.shape,
            input.stride(),
            input.dtype,
        )
        fast = _eager.get(key)
        if fast is not None:
            return fast(input)
    check_tensor(op, "input", input)
    if input.requires_grad and torch.is_grad_enabled():
        y = _ActivationFunction.apply(input, kind, p0, p1, inplace)
    elif inplace:
        y = _forward_inplace(input, kind, p0, p1)
    else:
        y = _forward(input, kind, p0, p1)
    if key is not None:
        fast = _eager_program(input, kind, p0, p1, inplace, key[4])
        if fast is not None:
            _eager[key] = fast
    return y


# ---------------------------------------------------------------------------------------------
# 5. Public functions.


def relu(
    input: torch.Tensor, inplace: bool = False, *, negative_slope: float = 0.0, clip: float | None = None
) -> torch.Tensor:
    """Rectified linear unit, ``F.relu`` with cuDNN's extras: ``max(x, 0)``, or with the options
    ``min(x, clip)`` for ``x > 0`` and ``negative_slope * x`` otherwise (CLIPPED_RELU, leaky relu).

    Args:
        input: fp16/bf16/fp32/fp64 tensor of any shape and strides.
        inplace: write the result into ``input`` and return it.
        negative_slope: slope for ``x <= 0``.
        clip: upper bound of the output for ``x > 0`` (``relu6`` is ``clip=6``); ``None`` for none.

    The gradient at ``x == 0`` is ``negative_slope`` and at ``x >= clip`` is 0, as PyTorch's
    leaky_relu and hardtanh.
    """
    if clip is None and type(negative_slope) is float and negative_slope == 0.0:  # plain relu: no checks
        return _apply("tdnn.relu", input, Activation.RELU.value, 0.0, math.inf, inplace)
    slope = check_float("tdnn.relu", "negative_slope", negative_slope)
    upper = math.inf if clip is None else check_float("tdnn.relu", "clip", clip, positive=True)
    return _apply("tdnn.relu", input, Activation.RELU.value, slope, upper, inplace)


def leaky_relu(input: torch.Tensor, negative_slope: float = 0.01, inplace: bool = False) -> torch.Tensor:
    """``F.leaky_relu``: ``x`` for ``x > 0``, ``negative_slope * x`` otherwise."""
    slope = check_float("tdnn.leaky_relu", "negative_slope", negative_slope)
    return _apply("tdnn.leaky_relu", input, Activation.RELU.value, slope, math.inf, inplace)


def elu(input: torch.Tensor, alpha: float = 1.0, inplace: bool = False) -> torch.Tensor:
    """``F.elu``: ``x`` for ``x > 0``, ``alpha * (exp(x) - 1)`` otherwise (expm1 accurate near 0)."""
    a = check_float("tdnn.elu", "alpha", alpha)
    return _apply("tdnn.elu", input, Activation.ELU.value, a, 0.0, inplace)


def sigmoid(input: torch.Tensor) -> torch.Tensor:
    """``torch.sigmoid``: ``1 / (1 + exp(-x))``."""
    return _apply("tdnn.sigmoid", input, Activation.SIGMOID.value)


def tanh(input: torch.Tensor) -> torch.Tensor:
    """``torch.tanh``, accurate to a few ulps including near 0."""
    return _apply("tdnn.tanh", input, Activation.TANH.value)


_GELU_KINDS = {"none": Activation.GELU.value, "tanh": Activation.GELU_TANH.value}


def gelu(input: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``F.gelu``: ``x * Phi(x)`` with the exact normal CDF (erf), or its tanh approximation."""
    kind = _GELU_KINDS.get(approximate) if type(approximate) is str else None
    if kind is None:
        check_choice("tdnn.gelu", "approximate", approximate, tuple(_GELU_KINDS))
    return _apply("tdnn.gelu", input, kind)


def silu(input: torch.Tensor, inplace: bool = False, *, beta: float = 1.0) -> torch.Tensor:
    """``F.silu`` and swish: ``x * sigmoid(beta * x)`` (``beta=1`` is SiLU)."""
    b = check_float("tdnn.silu", "beta", beta)
    return _apply("tdnn.silu", input, Activation.SILU.value, b, 0.0, inplace)


def swish(input: torch.Tensor, beta: float = 1.0) -> torch.Tensor:
    """Swish, ``x * sigmoid(beta * x)``; the same op as ``silu``."""
    return silu(input, beta=beta)


@autocast_policy(FP32)
def softplus(input: torch.Tensor, beta: float = 1.0, threshold: float = 20.0) -> torch.Tensor:
    """``F.softplus``: ``log(1 + exp(beta * x)) / beta``, and ``x`` where ``beta * x > threshold``."""
    b = check_float("tdnn.softplus", "beta", beta, nonzero=True)
    t = check_float("tdnn.softplus", "threshold", threshold)
    return _apply("tdnn.softplus", input, Activation.SOFTPLUS.value, b, t)


def activation_backward(
    grad_output: torch.Tensor,
    saved: torch.Tensor,
    activation: str,
    *,
    saved_is_output: bool = False,
    p0: float = 0.0,
    p1: float = 0.0,
) -> torch.Tensor:
    """cuDNN's activation backward: ``grad_output * act'(x)``, without autograd.

    Args:
        grad_output: gradient of the loss with respect to the activation's output.
        saved: the activation's input ``x``, or its output ``y`` with ``saved_is_output=True``
            (accepted for relu/leaky relu and elu with non-negative slope/alpha, sigmoid and tanh).
        activation: an ``Activation`` name, e.g. ``"gelu_tanh"``.
        p0, p1: the activation's parameters as listed in ``Activation``.
    """
    op = "tdnn.activation_backward"
    try:
        kind = Activation[activation.upper()].value
    except KeyError:
        check_choice(op, "activation", activation, [a.name.lower() for a in Activation])
        raise
    check_tensor(op, "saved", saved)
    check_like(op, "grad_output", grad_output, "saved", saved)
    if grad_output.dtype != saved.dtype:
        raise TypeError(f"{op}: 'grad_output' has dtype {grad_output.dtype} but 'saved' has {saved.dtype}")
    p0 = check_float(op, "p0", p0)
    p1 = check_float(op, "p1", p1, finite=False)
    if saved_is_output and not saves_output(kind, p0):
        raise ValueError(
            f"{op}: the gradient of {activation} with p0={p0} cannot be computed from its output"
        )
    return _backward(grad_output, saved, kind, p0, p1, saved_is_output)
