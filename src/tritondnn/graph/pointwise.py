"""The pointwise operations of the graph: cuDNN's pointwise modes, each with its meaning in PyTorch
and the Triton expression the code generator emits for it.

An op takes 1 to 3 operands (tensors or scalars, broadcast as in PyTorch) and 0 to 2 float
parameters. ``reference`` computes it with plain PyTorch in the operands' dtype (float64 operands
give the float64 meaning); ``emit`` returns the Triton expression over the operands' value names
and the names of the kernel's float arguments holding the parameters. Operands arrive in the
compute dtype (fp32 or fp64), or as int1 where ``bool_inputs`` says so; ``bool_result`` ops
produce int1.

The activations reuse ``ops.activation``'s jitted element functions (``activation_value``,
``activation_gradient``), so graph kernels and the functional ops compute the same values. The
backward forms take ``(dy, x)``, x being the forward input, as cuDNN's ``*_BWD`` modes do.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import torch

from ..ops.activation import Activation, activation_math

Ref = Callable[[Sequence[torch.Tensor], Sequence[float]], torch.Tensor]
Emit = Callable[[Sequence[str], Sequence[str]], str]


@dataclasses.dataclass(frozen=True)
class PointwiseOp:
    """One pointwise mode.

    Attributes:
        name: the mode's name (``"add"``, ``"relu"``, ``"gelu_backward"``...).
        arity: number of operands.
        params: names of the float parameters, in order; ``defaults`` their default values.
        reference: the meaning in PyTorch (see the module docstring).
        emit: the Triton expression.
        bool_result: the result is a truth value (comparisons, logical ops).
        bool_inputs: operand positions read as truth values (select's condition, logical ops).
        activation: the ``Activation`` kind when the op is a forward activation (epilogue folding).
    """

    name: str
    arity: int
    reference: Ref
    emit: Emit
    params: tuple[str, ...] = ()
    defaults: tuple[float, ...] = ()
    bool_result: bool = False
    bool_inputs: tuple[int, ...] = ()
    activation: int | None = None


OPS: dict[str, PointwiseOp] = {}


def _op(name: str, arity: int, reference: Ref, emit: Emit, **kw) -> None:
    OPS[name] = PointwiseOp(name, arity, reference, emit, **kw)


def _activation_ref(kind: int) -> Ref:
    def ref(x: Sequence[torch.Tensor], p: Sequence[float]) -> torch.Tensor:
        return activation_math(x[0], kind, *p)

    return ref


def _backward_ref(kind: int) -> Ref:
    def ref(t: Sequence[torch.Tensor], p: Sequence[float]) -> torch.Tensor:
        dy, x = t
        shape = torch.broadcast_shapes(dy.shape, x.shape)
        dtype = torch.promote_types(dy.dtype, x.dtype)
        with torch.enable_grad():
            xg = x.detach().to(dtype).expand(shape).clone().requires_grad_(True)
            (dx,) = torch.autograd.grad(activation_math(xg, kind, *p), xg, dy.to(dtype).expand(shape))
        return dx

    return ref


# Forward activations: (name, kind, parameter names, defaults). relu is cuDNN's RELU_FWD with
# its lower-clip slope and upper clip; the named variants fix some parameters.
_ACTIVATIONS = (
    ("relu", Activation.RELU, ("negative_slope", "clip"), (0.0, math.inf)),
    ("leaky_relu", Activation.RELU, ("negative_slope", "clip"), (0.01, math.inf)),
    ("elu", Activation.ELU, ("alpha",), (1.0,)),
    ("sigmoid", Activation.SIGMOID, (), ()),
    ("tanh", Activation.TANH, (), ()),
    ("gelu", Activation.GELU, (), ()),
    ("gelu_tanh", Activation.GELU_TANH, (), ()),
    ("silu", Activation.SILU, ("beta",), (1.0,)),
    ("swish", Activation.SILU, ("beta",), (1.0,)),
    ("softplus", Activation.SOFTPLUS, ("beta", "threshold"), (1.0, 20.0)),
)


def _pad(p: Sequence[str]) -> tuple[str, str]:
    return (*p, "0.0", "0.0")[:2]  # type: ignore[return-value]


for _name, _kind, _params, _defaults in _ACTIVATIONS:
    _k = int(_kind)
    _op(
        _name,
        1,
        _activation_ref(_k),
        lambda a, p, k=_k: f"activation_value({a[0]}, {k}, {', '.join(_pad(p))})",
        params=_params,
        defaults=_defaults,
        activation=_k,
    )
    _emit = lambda a, p, k=_k: f"activation_gradient({a[0]}, {a[1]}, {k}, False, {', '.join(_pad(p))})"
    _op(f"{_name}_backward", 2, _backward_ref(_k), _emit, params=_params, defaults=_defaults)


def _unary(name: str, ref: Callable[[torch.Tensor], torch.Tensor], emit: str) -> None:
    _op(name, 1, lambda t, p: ref(t[0]), lambda a, p: emit.format(a[0]))


_unary("identity", lambda x: x, "{}")
_unary("neg", torch.neg, "-{}")
_unary("abs", torch.abs, "tl.abs({})")
_unary("sqrt", torch.sqrt, "tl.sqrt({})")
_unary("rsqrt", torch.rsqrt, "1.0 / tl.sqrt({})")
_unary("exp", torch.exp, "tl.exp({})")
_unary("log", torch.log, "tl.log({})")
_unary("reciprocal", torch.reciprocal, "1.0 / {}")
_unary("square", torch.square, "{0} * {0}")
_unary("erf", torch.erf, "tl.erf({})")
_unary("sin", torch.sin, "tl.sin({})")
_unary("cos", torch.cos, "tl.cos({})")
_unary("floor", torch.floor, "tl.floor({})")
_unary("ceil", torch.ceil, "tl.ceil({})")


def _binary(name: str, ref: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], emit: str, **kw) -> None:
    _op(name, 2, lambda t, p: ref(t[0], t[1]), lambda a, p: emit.format(*a), **kw)


_binary("add", torch.add, "{} + {}")
_binary("bias", torch.add, "{} + {}")  # cuDNN's name for adding a broadcast (per-channel) tensor
_binary("sub", torch.sub, "{} - {}")
_binary("mul", torch.mul, "{} * {}")
_binary("scale", torch.mul, "{} * {}")
_binary("div", torch.div, "{} / {}")
# torch.maximum/minimum: NaN in either operand gives NaN (tl.maximum may drop it on a GPU).
_binary("max", torch.maximum, "nan_max({}, {})")
_binary("min", torch.minimum, "nan_min({}, {})")
# Both operands as blocks (``zero`` is the kernel's zero block): power's truth-value arithmetic
# wants tensors, not scalar arguments.
_binary("pow", torch.pow, "power({0} + zero, {1} + zero)")
for _name, _fn, _sym in (
    ("cmp_eq", torch.eq, "=="),
    ("cmp_neq", torch.ne, "!="),
    ("cmp_gt", torch.gt, ">"),
    ("cmp_ge", torch.ge, ">="),
    ("cmp_lt", torch.lt, "<"),
    ("cmp_le", torch.le, "<="),
):
    _binary(_name, _fn, "({} " + _sym + " {})", bool_result=True)
_binary("logical_and", torch.logical_and, "({} & {})", bool_result=True, bool_inputs=(0, 1))
_binary("logical_or", torch.logical_or, "({} | {})", bool_result=True, bool_inputs=(0, 1))
_op(
    "logical_not",
    1,
    lambda t, p: torch.logical_not(t[0]),
    lambda a, p: f"({a[0]} == 0)",
    bool_result=True,
    bool_inputs=(0,),
)
_op(
    "select",
    3,
    lambda t, p: torch.where(t[0].bool(), t[1], t[2]),
    lambda a, p: f"tl.where({a[0]}, {a[1]}, {a[2]})",
    bool_inputs=(0,),
)

# cuDNN's batchnorm inference, (x - mean) * inv_variance * scale + bias (a graph node of its own).
_op(
    "batchnorm_inference",
    5,
    lambda t, p: (t[0] - t[1]) * t[2] * t[3] + t[4],
    lambda a, p: "({} - {}) * {} * {} + {}".format(*a),
)

# Ops whose result does not depend on operand order (the epilogue folder looks on both sides).
COMMUTATIVE = frozenset({"add", "bias", "mul", "scale", "max", "min", "cmp_eq", "cmp_neq"})
ADDITIVE = frozenset({"add", "bias"})
MULTIPLICATIVE = frozenset({"mul", "scale"})

__all__ = ["ADDITIVE", "COMMUTATIVE", "MULTIPLICATIVE", "OPS", "PointwiseOp"]
