"""compile_graph's translation table: how each traced torch (or tritondnn) call becomes graph
nodes. A handler takes (translator, the call's expected meta result, *args, **kwargs) and returns
a GraphTensor (checked against the meta) or a ``_T`` (passed through); argument names follow the
torch functions', so binding is Python's."""

from __future__ import annotations

import dataclasses
import operator
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from .library_nodes import NORM_DTYPES
from .types import GraphTensor

if TYPE_CHECKING:
    from .bridge import _Translator


class _Unsupported(Exception):
    """A traced op or value the translator cannot express as graph nodes."""


@dataclasses.dataclass
class _T:
    """A traced tensor: its meta tensor, its graph tensor (made on first use for arguments)."""

    meta: torch.Tensor
    gt: GraphTensor | None = None
    arg: int | None = None


# ---------------------------------------------------------------------------------------------
# Handlers: (translator, expected meta result, *args, **kwargs) -> GraphTensor (checked against the
# meta) or _T (passed through). Argument names follow the torch functions', so binding is Python's.

_HANDLERS: dict[Any, Callable[..., Any]] = {}


def _register(*keys: Any) -> Callable:
    def deco(fn: Callable) -> Callable:
        for k in keys:
            _HANDLERS[k] = fn
        return fn

    return deco


def _method(*names: str) -> list[tuple[str, str]]:
    return [("method", n) for n in names]


def _pw(tr: _Translator, meta: torch.Tensor, op: str, *operands: Any, **params: float) -> GraphTensor:
    return tr.g.pointwise(op, *(tr.operand(o) for o in operands), dtype=meta.dtype, **params)


def _no_inplace(inplace: bool) -> None:
    if inplace:
        raise _Unsupported("in-place ops are not supported (the graph is functional)")


def _binary(op: str, *keys: Any) -> None:
    def h(tr, meta, input, other, *, alpha=1, out=None, rounding_mode=None):
        if out is not None or rounding_mode is not None:
            raise _Unsupported(f"{op} with out= or rounding_mode=")
        b = tr.operand(other)
        if alpha != 1:
            b = tr.g.mul(b, float(alpha), dtype=meta.dtype) if isinstance(b, GraphTensor) else b * alpha
        return tr.g.pointwise(op, tr.operand(input), b, dtype=meta.dtype)

    _register(*keys)(h)


_binary("add", operator.add, torch.add, *_method("add", "__add__", "__radd__"))
_binary("sub", operator.sub, torch.sub, torch.subtract, *_method("sub", "subtract", "__sub__"))
_binary("mul", operator.mul, torch.mul, torch.multiply, *_method("mul", "multiply", "__mul__", "__rmul__"))
_binary(
    "div",
    operator.truediv,
    torch.div,
    torch.divide,
    torch.true_divide,
    *_method("div", "divide", "__truediv__"),
)
_binary("max", torch.maximum, *_method("maximum"))
_binary("min", torch.minimum, *_method("minimum"))
for _name, _fn, _m in (
    ("cmp_eq", torch.eq, "eq"),
    ("cmp_neq", torch.ne, "ne"),
    ("cmp_gt", torch.gt, "gt"),
    ("cmp_ge", torch.ge, "ge"),
    ("cmp_lt", torch.lt, "lt"),
    ("cmp_le", torch.le, "le"),
):
    _binary(_name, _fn, getattr(operator, _m), *_method(_m, f"__{_m}__"))
_binary("logical_and", torch.logical_and, operator.and_, *_method("logical_and", "__and__"))
_binary("logical_or", torch.logical_or, operator.or_, *_method("logical_or", "__or__"))


def _unary(op: str, *keys: Any) -> None:
    def h(tr, meta, input, *, out=None):
        if out is not None:
            raise _Unsupported(f"{op} with out=")
        if op == "logical_not" and input.meta.dtype != torch.bool:
            raise _Unsupported("~ of a non-bool tensor")
        return _pw(tr, meta, op, input)

    _register(*keys)(h)


_UNARY = ("neg", "exp", "log", "sqrt", "rsqrt", "abs", "reciprocal", "square", "erf", "sin", "cos")
for _op in (*_UNARY, "floor", "ceil"):
    _unary(_op, getattr(torch, _op), *_method(_op))
_HANDLERS[operator.neg] = _HANDLERS[torch.negative] = _HANDLERS[("method", "__neg__")] = _HANDLERS[torch.neg]
_HANDLERS[operator.abs] = _HANDLERS[("method", "__abs__")] = _HANDLERS[torch.abs]
_unary("logical_not", torch.logical_not, operator.invert, *_method("logical_not", "__invert__"))
_unary("sigmoid", torch.sigmoid, F.sigmoid, *_method("sigmoid"))
_unary("tanh", torch.tanh, F.tanh, *_method("tanh"))


@_register(operator.pow, torch.pow, *_method("pow", "__pow__", "__rpow__"))
def _pow(tr, meta, input, exponent, *, out=None):
    if out is not None:
        raise _Unsupported("pow with out=")
    if isinstance(exponent, (int, float)) and isinstance(input, _T):
        if exponent == 2:
            return _pw(tr, meta, "square", input)
        if exponent == 1:
            return _pw(tr, meta, "identity", input)
        if exponent == 0.5:
            return _pw(tr, meta, "sqrt", input)
    return _pw(tr, meta, "pow", input, exponent)


@_register(torch.clamp, torch.clip, *_method("clamp", "clip"))
def _clamp(tr, meta, input, min=None, max=None, *, out=None):
    if out is not None or (min is None and max is None):
        raise _Unsupported("clamp with out= or without bounds")
    x = tr.operand(input)
    if min is not None:
        x = tr.g.max(x, tr.operand(min), dtype=meta.dtype)
    if max is not None:
        x = tr.g.min(x, tr.operand(max), dtype=meta.dtype)
    return x


@_register(torch.where, *_method("where"))
def _where(tr, meta, condition, input=None, other=None):
    if input is None or other is None:
        raise _Unsupported("torch.where with one argument")
    if not isinstance(condition, _T) or condition.meta.dtype != torch.bool:
        raise _Unsupported("torch.where needs a bool condition")
    return _pw(tr, meta, "select", condition, input, other)


def _max_min_handler(kind: str) -> Callable:
    def h(tr, meta, input, dim=None, keepdim=False, *, out=None):
        if out is not None:
            raise _Unsupported(f"{kind} with out=")
        if isinstance(dim, _T):  # torch.max(a, b): elementwise
            return _pw(tr, meta, kind, input, dim)
        if dim is not None:
            raise _Unsupported(f"torch.{kind} over a dim returns (values, indices): use amax/amin")
        return _reduce(tr, meta, kind, input, None, False)

    return h


_HANDLERS[torch.max] = _HANDLERS[("method", "max")] = _max_min_handler("max")
_HANDLERS[torch.min] = _HANDLERS[("method", "min")] = _max_min_handler("min")

# Activations.


@_register(F.relu, torch.relu, *_method("relu"))
def _relu(tr, meta, input, inplace=False):
    _no_inplace(inplace)
    return _pw(tr, meta, "relu", input)


@_register(F.relu6)
def _relu6(tr, meta, input, inplace=False):
    _no_inplace(inplace)
    return tr.g.max(tr.g.min(tr.gt(input), 6.0, dtype=meta.dtype), 0.0, dtype=meta.dtype)


@_register(F.leaky_relu)
def _leaky_relu(tr, meta, input, negative_slope=0.01, inplace=False):
    _no_inplace(inplace)
    return _pw(tr, meta, "leaky_relu", input, negative_slope=negative_slope)


@_register(F.elu)
def _elu(tr, meta, input, alpha=1.0, inplace=False):
    _no_inplace(inplace)
    return _pw(tr, meta, "elu", input, alpha=alpha)


@_register(F.gelu)
def _gelu(tr, meta, input, approximate="none"):
    ops = {"none": "gelu", "tanh": "gelu_tanh"}
    if approximate not in ops:
        raise _Unsupported(f"gelu approximate={approximate!r}")
    return _pw(tr, meta, ops[approximate], input)


@_register(F.silu)
def _silu(tr, meta, input, inplace=False):
    _no_inplace(inplace)
    return _pw(tr, meta, "silu", input)


@_register(F.softplus)
def _softplus(tr, meta, input, beta=1.0, threshold=20.0):
    return _pw(tr, meta, "softplus", input, beta=beta, threshold=threshold)


# Reductions.


def _reduce(tr, meta, mode, input, dim, keepdim, dtype=None) -> GraphTensor:
    if dtype is not None and dtype != input.meta.dtype:
        raise _Unsupported("reductions with dtype=")
    if dim is None or (isinstance(dim, (tuple, list)) and len(dim) == 0):
        dim = None
    return tr.g.reduction(tr.gt(input), mode, dim, keepdim=bool(keepdim), dtype=meta.dtype)


for _keys, _mode, _default in (
    ((torch.sum, ("method", "sum")), "add", None),
    ((torch.mean, ("method", "mean")), "avg", None),
    ((torch.prod, ("method", "prod")), "mul", None),
    ((torch.amax, ("method", "amax")), "max", ()),
    ((torch.amin, ("method", "amin")), "min", ()),
):

    def _h(tr, meta, input, dim=_default, keepdim=False, *, dtype=None, out=None, _mode=_mode):
        if out is not None:
            raise _Unsupported("reductions with out=")
        return _reduce(tr, meta, _mode, input, dim, keepdim, dtype)

    _register(*_keys)(_h)


@_register(F.softmax, torch.softmax, *_method("softmax"))
def _softmax(tr, meta, input, dim=None, _stacklevel=3, dtype=None):
    if dim is None or (dtype is not None and dtype != input.meta.dtype):
        raise _Unsupported("softmax needs dim= and no dtype=")
    g, x = tr.g, tr.gt(input)
    shifted = g.sub(x, g.reduction(x, "max", dim, keepdim=True), dtype=meta.dtype)
    e = g.exp(shifted, dtype=meta.dtype)
    return g.div(e, g.reduction(e, "add", dim, keepdim=True), dtype=meta.dtype)


# Matrix products.


def _matmul_gt(tr: _Translator, meta: torch.Tensor, a: GraphTensor, b: GraphTensor) -> GraphTensor:
    g = tr.g
    if a.ndim == 1:
        a = g.reshape(a, (1, a.shape[0]))
    if b.ndim == 1:
        b = g.reshape(b, (b.shape[0], 1))
    out = g.matmul(a, b, dtype=meta.dtype)
    return out if out.shape == tuple(meta.shape) else g.reshape(out, tuple(meta.shape))


@_register(operator.matmul, torch.matmul, torch.mm, torch.bmm, *_method("matmul", "mm", "bmm", "__matmul__"))
def _matmul(tr, meta, input, other, *, out=None):
    if out is not None:
        raise _Unsupported("matmul with out=")
    return _matmul_gt(tr, meta, tr.gt(input), tr.gt(other))


def _linear_gt(tr, meta, input, weight, bias) -> GraphTensor:
    g = tr.g
    w = tr.gt(weight)
    wt = g.transpose(w, 0, 1) if w.ndim == 2 else w
    y = _matmul_gt(tr, meta, tr.gt(input), wt)
    return y if bias is None else g.bias(y, tr.gt(bias), dtype=meta.dtype)


@_register(F.linear)
def _linear(tr, meta, input, weight, bias=None):
    return _linear_gt(tr, meta, input, weight, bias)


# Normalizations: the graph's norm nodes where they take the dtypes, else reductions and pointwise
# nodes (float64, for instance).


def _norm(tr, meta, input, normalized_shape, weight, bias, eps, rms: bool) -> GraphTensor:
    g = tr.g
    shape = [normalized_shape] if isinstance(normalized_shape, int) else list(normalized_shape)
    x = tr.gt(input)
    w = tr.gt(weight) if weight is not None else None
    b = tr.gt(bias) if bias is not None else None
    if eps is None:
        eps = torch.finfo(x.dtype).eps
    if x.dtype in NORM_DTYPES and all(t is None or t.dtype == x.dtype for t in (w, b)):
        if rms:
            return g.rmsnorm(x, w, normalized_shape=shape, eps=eps)
        return g.layernorm(x, w, b, normalized_shape=shape, eps=eps)
    dims = list(range(x.ndim - len(shape), x.ndim))
    dt = meta.dtype
    centered = x if rms else g.sub(x, g.reduction(x, "avg", dims, keepdim=True), dtype=dt)
    var = g.reduction(g.square(centered, dtype=dt), "avg", dims, keepdim=True)
    y = g.mul(centered, g.rsqrt(g.add(var, float(eps), dtype=dt), dtype=dt), dtype=dt)
    if w is not None:
        y = g.mul(y, w, dtype=dt)
    if b is not None:
        y = g.add(y, b, dtype=dt)
    return y


@_register(F.layer_norm)
def _layer_norm(tr, meta, input, normalized_shape, weight=None, bias=None, eps=1e-5):
    return _norm(tr, meta, input, normalized_shape, weight, bias, eps, False)


@_register(F.rms_norm)
def _rms_norm(tr, meta, input, normalized_shape, weight=None, eps=None):
    return _norm(tr, meta, input, normalized_shape, weight, None, eps, True)


# Layout.


@_register(
    torch.reshape,
    torch.flatten,
    torch.squeeze,
    torch.unsqueeze,
    *_method("reshape", "view", "flatten", "squeeze", "unsqueeze", "view_as", "reshape_as"),
)
def _reshape(tr, meta, input, *args, **kwargs):
    x, shape = tr.gt(input), tuple(meta.shape)
    return x if x.shape == shape and x.producer is not None else tr.g.reshape(x, shape)


@_register(torch.transpose, torch.swapaxes, *_method("transpose", "swapaxes"))
def _transpose(tr, meta, input, dim0, dim1):
    return tr.g.transpose(tr.gt(input), dim0, dim1)


@_register(torch.permute, *_method("permute"))
def _permute(tr, meta, input, *dims):
    order = list(dims[0]) if len(dims) == 1 and isinstance(dims[0], (tuple, list)) else list(dims)
    return tr.g.permute(tr.gt(input), order)


@_register(torch.t, *_method("t"))
def _t(tr, meta, input):
    x = tr.gt(input)
    return tr.g.transpose(x, 0, 1) if x.ndim == 2 else input


@_register(getattr)
def _getattr(tr, meta, input, name):
    x = tr.gt(input)
    if name == "T":
        return tr.g.permute(x, list(reversed(range(x.ndim))))
    if name == "mT":
        return tr.g.transpose(x, -2, -1)
    raise _Unsupported(f"tensor attribute .{name}")


@_register(operator.getitem)
def _getitem(tr, meta, input, index):
    """Basic indexing: slices (step >= 1), ints, None and Ellipsis."""
    items = index if isinstance(index, tuple) else (index,)
    if any(not (i is None or i is Ellipsis or isinstance(i, (int, slice))) for i in items):
        raise _Unsupported("indexing with tensors or lists (only slices, ints, None, ...)")
    x = tr.gt(input)
    used = sum(1 for i in items if i is not None and i is not Ellipsis)
    d = 0
    for item in items:
        if item is Ellipsis:
            d += x.ndim - used
        elif isinstance(item, slice):
            if item != slice(None):
                if not all(v is None or isinstance(v, int) for v in (item.start, item.stop, item.step)):
                    raise _Unsupported("slices with non-int bounds")
                x = tr.g.slice(x, d, item.start, item.stop, item.step or 1)
            d += 1
        elif isinstance(item, int):
            i = item % x.shape[d]
            x = tr.g.slice(x, d, i, i + 1)
            d += 1
    return _reshape(tr, meta, _T(meta, x))


@_register(*_method("contiguous"))
def _contiguous(tr, meta, input, memory_format=torch.contiguous_format):
    return input  # values are what matters; the plan picks layouts


@_register(torch.clone, *_method("clone"))
def _clone(tr, meta, input, memory_format=None):
    return _pw(tr, meta, "identity", input)


@_register(*_method("to", "type_as", "float", "double", "half", "bfloat16", "type"))
def _cast(tr, meta, input, *args, **kwargs):
    if meta.dtype == input.meta.dtype:
        return input
    return tr.g.cast(tr.gt(input), meta.dtype)


# tritondnn's functional ops: recorded by the tracer (tritondnn is an autowrap module), translated
# here, and given their PyTorch meaning for the meta tensors in _META_EQUIVALENT.


def _tdnn_tables() -> tuple[dict, dict]:
    from ..ops import activation as act_ops
    from ..ops import matmul as matmul_ops
    from ..ops import norm as norm_ops

    names = ("relu", "leaky_relu", "elu", "sigmoid", "tanh", "gelu", "silu", "swish", "softplus")
    tdnn = types.SimpleNamespace(
        **{n: getattr(act_ops, n) for n in names},
        linear=matmul_ops.linear,
        matmul=matmul_ops.matmul,
        layer_norm=norm_ops.layer_norm,
        rms_norm=norm_ops.rms_norm,
    )
    acts = ("relu", "silu", "gelu", "gelu_tanh", "sigmoid", "tanh")
    meta_eq: dict[Any, Callable] = {
        tdnn.relu: lambda input, inplace=False, **kw: torch.relu(input),
        tdnn.leaky_relu: lambda input, *a, **kw: torch.empty_like(input),
        tdnn.elu: lambda input, *a, **kw: torch.empty_like(input),
        tdnn.sigmoid: torch.sigmoid,
        tdnn.tanh: torch.tanh,
        tdnn.gelu: lambda input, approximate="none": F.gelu(input, approximate=approximate),
        tdnn.silu: lambda input, *a, **kw: F.silu(input),
        tdnn.swish: lambda input, *a, **kw: F.silu(input),
        tdnn.softplus: lambda input, *a, **kw: F.softplus(input),
        tdnn.layer_norm: lambda input, normalized_shape, weight=None, bias=None, eps=1e-5, **kw: F.layer_norm(
            input, normalized_shape, weight, bias, eps
        ),
        tdnn.rms_norm: lambda input, normalized_shape, weight=None, eps=None, **kw: F.rms_norm(
            input, normalized_shape, weight, eps
        ),
        tdnn.linear: lambda input, weight, bias=None, *, residual=None, out_dtype=None, **kw: (
            F.linear(input, weight, bias) if residual is None else F.linear(input, weight, bias) + residual
        ).to(out_dtype or input.dtype),
        tdnn.matmul: lambda input, other, **kw: torch.matmul(input, other),
    }

    def act(tr, meta, y: GraphTensor, activation) -> GraphTensor:
        if activation is None:
            return y
        if activation not in acts:
            raise _Unsupported(f"activation={activation!r}")
        return tr.g.pointwise(activation, y, dtype=meta.dtype)

    def t_relu(tr, meta, input, inplace=False, *, negative_slope=0.0, clip=None):
        _no_inplace(inplace)
        return _pw(tr, meta, "relu", input, negative_slope=negative_slope, clip=clip)

    def t_silu(tr, meta, input, inplace=False, *, beta=1.0):
        _no_inplace(inplace)
        return _pw(tr, meta, "silu" if beta == 1.0 else "swish", input, beta=beta)

    def t_swish(tr, meta, input, beta=1.0):
        return _pw(tr, meta, "swish", input, beta=beta)

    def t_layer_norm(tr, meta, input, normalized_shape, weight=None, bias=None, eps=1e-5, *, activation=None):
        return act(tr, meta, _norm(tr, meta, input, normalized_shape, weight, bias, eps, False), activation)

    def t_rms_norm(tr, meta, input, normalized_shape, weight=None, eps=None, *, activation=None):
        return act(tr, meta, _norm(tr, meta, input, normalized_shape, weight, None, eps, True), activation)

    def t_linear(
        tr,
        meta,
        input,
        weight,
        bias=None,
        *,
        activation=None,
        activation_params=(),
        residual=None,
        out_dtype=None,
    ):
        if activation_params or (out_dtype is not None and out_dtype != input.meta.dtype):
            raise _Unsupported("tdnn.linear with activation_params or out_dtype")
        y = act(tr, meta, _linear_gt(tr, meta, input, weight, bias), activation)
        return y if residual is None else tr.g.add(y, tr.gt(residual), dtype=meta.dtype)

    def t_matmul(tr, meta, input, other, **extras):
        if any(v not in (None, False) for v in extras.values()):
            raise _Unsupported(
                f"tdnn.matmul with {sorted(k for k, v in extras.items() if v not in (None, False))}"
            )
        return _matmul_gt(tr, meta, tr.gt(input), tr.gt(other))

    handlers = {
        tdnn.relu: t_relu,
        tdnn.leaky_relu: _leaky_relu,
        tdnn.elu: _elu,
        tdnn.sigmoid: _HANDLERS[torch.sigmoid],
        tdnn.tanh: _HANDLERS[torch.tanh],
        tdnn.gelu: _gelu,
        tdnn.silu: t_silu,
        tdnn.swish: t_swish,
        tdnn.softplus: _softplus,
        tdnn.layer_norm: t_layer_norm,
        tdnn.rms_norm: t_rms_norm,
        tdnn.linear: t_linear,
        tdnn.matmul: t_matmul,
    }
    return meta_eq, handlers


_META_EQUIVALENT, _TDNN_HANDLERS = _tdnn_tables()
_HANDLERS.update(_TDNN_HANDLERS)
