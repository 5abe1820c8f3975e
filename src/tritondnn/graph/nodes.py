"""Node builders: one method per cuDNN operation, each checking its operands and inferring the
shapes and dtypes of its outputs. ``Graph`` inherits them: pointwise nodes, matrix products and
convolutions here, the library nodes from ``library_nodes``.

Every builder takes ``name=`` (the node's name; its single output takes the same name, several
outputs ``name.field``) and returns the output tensor(s); rule violations raise ``GraphError``
naming node and operand.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .library_nodes import LibraryNodes
from .pointwise import OPS
from .rules import _ints, _number
from .types import FLOATS, GraphTensor, Node, error

Operand = GraphTensor | float | int | bool


class NodeBuilders(LibraryNodes):
    """The node-building half of ``Graph`` (see the module docstring)."""

    # -----------------------------------------------------------------------------------------
    # Pointwise.

    def pointwise(
        self,
        op: str,
        *operands: Operand,
        dtype: torch.dtype | None = None,
        name: str | None = None,
        **params: float,
    ) -> GraphTensor:
        """A pointwise node of mode ``op`` (see ``graph.pointwise.OPS``) over tensors or numbers,
        broadcast as in PyTorch; ``params`` are the mode's float parameters by name.

        The output dtype is ``dtype``, else bool for comparisons and logical ops, else the graph's
        intermediate dtype. Arithmetic runs in the graph's compute dtype.
        """
        spec = OPS.get(op) if isinstance(op, str) else None
        if spec is None:
            raise error(
                "argument",
                f"node '{name or op}': unknown pointwise mode {op!r}; known: {', '.join(sorted(OPS))}",
            )
        tensors = [o if isinstance(o, GraphTensor) else self.scalar(o) for o in operands]
        slots = _POINTWISE_SLOTS.get(op, ("a", "b", "c")[: spec.arity])
        node = self._begin(op, "pointwise", name, list(zip(slots, tensors)))
        if len(tensors) != spec.arity:
            raise error("argument", f"takes {spec.arity} operand(s), got {len(tensors)}", node)
        for t in tensors:
            if t.dtype not in (*FLOATS, torch.bool):
                raise error("dtype", f"has dtype {t.dtype}; accepted: float16/32/64, bfloat16, bool", node, t)
        shape = self._broadcast(node, tensors)
        unknown = set(params) - set(spec.params)
        if unknown:
            raise error(
                "argument", f"unknown parameter(s) {sorted(unknown)}; accepted: {list(spec.params)}", node
            )
        values = []
        for pname, default in zip(spec.params, spec.defaults):
            value = params.get(pname, default)
            if pname == "clip" and value is None:
                value = math.inf
            values.append(_number(node, pname, value, finite=pname != "clip"))
        if op.startswith("softplus") and values[0] == 0:
            raise error("argument", "'beta' must be non-zero", node)
        out_dtype = dtype or (torch.bool if spec.bool_result else self.intermediate_dtype)
        if out_dtype not in (*FLOATS, torch.bool):
            raise error("dtype", f"output dtype {out_dtype} is not a float dtype or bool", node)
        return self._commit(node, [("", shape, out_dtype)], {"params": values})[0]

    def add(self, a: Operand, b: Operand, **kw) -> GraphTensor:
        """``a + b``."""
        return self.pointwise("add", a, b, **kw)

    def sub(self, a: Operand, b: Operand, **kw) -> GraphTensor:
        """``a - b``."""
        return self.pointwise("sub", a, b, **kw)

    def mul(self, a: Operand, b: Operand, **kw) -> GraphTensor:
        """``a * b``."""
        return self.pointwise("mul", a, b, **kw)

    def div(self, a: Operand, b: Operand, **kw) -> GraphTensor:
        """``a / b``."""
        return self.pointwise("div", a, b, **kw)

    def max(self, a: Operand, b: Operand, **kw) -> GraphTensor:
        """``torch.maximum(a, b)`` (NaN propagates)."""
        return self.pointwise("max", a, b, **kw)

    def min(self, a: Operand, b: Operand, **kw) -> GraphTensor:
        """``torch.minimum(a, b)`` (NaN propagates)."""
        return self.pointwise("min", a, b, **kw)

    def pow(self, a: Operand, b: Operand, **kw) -> GraphTensor:
        """``torch.pow(a, b)``."""
        return self.pointwise("pow", a, b, **kw)

    def bias(self, x: Operand, bias: Operand, **kw) -> GraphTensor:
        """``x + bias`` with ``bias`` broadcast (e.g. (C, 1, 1) per channel, (N,) per column);
        folds into a matmul/convolution epilogue."""
        return self.pointwise("bias", x, bias, **kw)

    def scale(self, x: Operand, scale: Operand, **kw) -> GraphTensor:
        """``x * scale`` (a constant scalar folds into a matmul/convolution's alpha)."""
        return self.pointwise("scale", x, scale, **kw)

    def select(self, cond: Operand, a: Operand, b: Operand, **kw) -> GraphTensor:
        """``torch.where(cond, a, b)``; a float ``cond`` is true where non-zero."""
        return self.pointwise("select", cond, a, b, **kw)

    def relu(
        self, x: Operand, *, negative_slope: float = 0.0, clip: float | None = None, **kw
    ) -> GraphTensor:
        """cuDNN's RELU_FWD: ``min(x, clip)`` for x > 0, ``negative_slope * x`` otherwise."""
        return self.pointwise("relu", x, negative_slope=negative_slope, clip=clip, **kw)

    def leaky_relu(self, x: Operand, negative_slope: float = 0.01, **kw) -> GraphTensor:
        """``F.leaky_relu``."""
        return self.pointwise("leaky_relu", x, negative_slope=negative_slope, **kw)

    def elu(self, x: Operand, alpha: float = 1.0, **kw) -> GraphTensor:
        """``F.elu``."""
        return self.pointwise("elu", x, alpha=alpha, **kw)

    def silu(self, x: Operand, **kw) -> GraphTensor:
        """``F.silu``: ``x * sigmoid(x)``."""
        return self.pointwise("silu", x, **kw)

    def swish(self, x: Operand, beta: float = 1.0, **kw) -> GraphTensor:
        """Swish: ``x * sigmoid(beta * x)``."""
        return self.pointwise("swish", x, beta=beta, **kw)

    def softplus(self, x: Operand, beta: float = 1.0, threshold: float = 20.0, **kw) -> GraphTensor:
        """``F.softplus``."""
        return self.pointwise("softplus", x, beta=beta, threshold=threshold, **kw)

    def cmp_eq(self, a: Operand, b: Operand, **kw) -> GraphTensor:
        """``a == b`` (bool unless ``dtype`` is given, then 1.0/0.0)."""
        return self.pointwise("cmp_eq", a, b, **kw)

    def cmp_neq(self, a: Operand, b: Operand, **kw) -> GraphTensor:
        """``a != b``."""
        return self.pointwise("cmp_neq", a, b, **kw)

    def cmp_gt(self, a: Operand, b: Operand, **kw) -> GraphTensor:
        """``a > b``."""
        return self.pointwise("cmp_gt", a, b, **kw)

    def cmp_ge(self, a: Operand, b: Operand, **kw) -> GraphTensor:
        """``a >= b``."""
        return self.pointwise("cmp_ge", a, b, **kw)

    def cmp_lt(self, a: Operand, b: Operand, **kw) -> GraphTensor:
        """``a < b``."""
        return self.pointwise("cmp_lt", a, b, **kw)

    def cmp_le(self, a: Operand, b: Operand, **kw) -> GraphTensor:
        """``a <= b``."""
        return self.pointwise("cmp_le", a, b, **kw)

    def logical_and(self, a: Operand, b: Operand, **kw) -> GraphTensor:
        """``a & b`` of truth values."""
        return self.pointwise("logical_and", a, b, **kw)

    def logical_or(self, a: Operand, b: Operand, **kw) -> GraphTensor:
        """``a | b`` of truth values."""
        return self.pointwise("logical_or", a, b, **kw)

    def cast(self, x: Operand, dtype: torch.dtype, **kw) -> GraphTensor:
        """``x.to(dtype)`` (cuDNN's IDENTITY with another output type)."""
        return self.pointwise("identity", x, dtype=dtype, **kw)

    def relu_backward(
        self, dy: Operand, x: Operand, *, negative_slope: float = 0.0, clip: float | None = None, **kw
    ) -> GraphTensor:
        """cuDNN's RELU_BWD: ``dy * relu'(x)`` (x the forward input)."""
        return self.pointwise("relu_backward", dy, x, negative_slope=negative_slope, clip=clip, **kw)

    def leaky_relu_backward(self, dy: Operand, x: Operand, negative_slope: float = 0.01, **kw) -> GraphTensor:
        """``dy * leaky_relu'(x)``."""
        return self.pointwise("leaky_relu_backward", dy, x, negative_slope=negative_slope, **kw)

    def elu_backward(self, dy: Operand, x: Operand, alpha: float = 1.0, **kw) -> GraphTensor:
        """``dy * elu'(x)``."""
        return self.pointwise("elu_backward", dy, x, alpha=alpha, **kw)

    def swish_backward(self, dy: Operand, x: Operand, beta: float = 1.0, **kw) -> GraphTensor:
        """``dy * swish'(x)``."""
        return self.pointwise("swish_backward", dy, x, beta=beta, **kw)

    def softplus_backward(
        self, dy: Operand, x: Operand, beta: float = 1.0, threshold: float = 20.0, **kw
    ) -> GraphTensor:
        """``dy * softplus'(x)``."""
        return self.pointwise("softplus_backward", dy, x, beta=beta, threshold=threshold, **kw)

    def batchnorm_inference(
        self,
        x: GraphTensor,
        mean: GraphTensor,
        inv_variance: GraphTensor,
        scale: GraphTensor | None = None,
        bias: GraphTensor | None = None,
        *,
        dtype: torch.dtype | None = None,
        name: str | None = None,
    ) -> GraphTensor:
        """cuDNN's batchnorm inference: ``(x - mean) * inv_variance * scale + bias`` with per-channel
        operands of shape (C,) or (1, C, 1, ...). A pointwise node: it fuses with its neighbours."""
        scale = self.scalar(1.0) if scale is None else scale
        bias = self.scalar(0.0) if bias is None else bias
        slots = [("x", x), ("mean", mean), ("inv_variance", inv_variance), ("scale", scale), ("bias", bias)]
        node = self._begin("batchnorm_inference", "pointwise", name, slots)
        self._rank(node, x, 2, 5)
        self._same_dtype(node, [x])
        for slot, t in slots[1:]:
            if not t.is_scalar:
                self._channel_param(node, slot, t, x)
        views = [None] + [
            None if t.is_scalar or t.ndim == x.ndim else [1, x.shape[1], *([1] * (x.ndim - 2))]
            for _, t in slots[1:]
        ]
        attrs = {"params": [], "views": views}
        return self._commit(
            node, [("", x.shape, self._out_dtype(node, dtype, self.intermediate_dtype))], attrs
        )[0]

    # -----------------------------------------------------------------------------------------
    # Matrix products and convolutions.

    def matmul(
        self, a: GraphTensor, b: GraphTensor, *, dtype: torch.dtype | None = None, name: str | None = None
    ) -> GraphTensor:
        """``torch.matmul(a, b)`` for operands of 2 or more dimensions (batch dimensions broadcast),
        output in ``dtype`` (default: the operands'). A pointwise tail of bias, scale, activation and
        residual adds folds into its epilogue."""
        node = self._begin("matmul", "matmul", name, [("a", a), ("b", b)])
        self._same_dtype(node, [a, b])
        for t in (a, b):
            self._rank(node, t, 2, 6)
        if a.shape[-1] != b.shape[-2]:
            raise error(
                "shape",
                f"dimension -2 ({b.shape[-2]}) must equal a's last dimension ({a.shape[-1]})",
                node,
                b,
            )
        out = self._infer(node, torch.matmul, a, b)
        return self._commit(node, [("", tuple(out.shape), self._out_dtype(node, dtype, a.dtype))], {})[0]

    def _conv_attrs(self, node: Node, nd: int, stride, padding, dilation, groups) -> dict[str, Any]:
        attrs: dict[str, Any] = {
            "stride": _ints(node, "stride", stride, nd),
            "dilation": _ints(node, "dilation", dilation, nd),
            "padding": padding if padding in ("same", "valid") else _ints(node, "padding", padding, nd),
            "groups": _ints(node, "groups", groups)[0],
        }
        if any(v < 1 for v in attrs["stride"] + attrs["dilation"]) or attrs["groups"] < 1:
            raise error("argument", "stride, dilation and groups must be >= 1", node)
        if isinstance(attrs["padding"], list) and any(p < 0 for p in attrs["padding"]):
            raise error("argument", f"padding {attrs['padding']} must be >= 0", node)
        return attrs

    def conv_fprop(
        self,
        x: GraphTensor,
        w: GraphTensor,
        *,
        stride=1,
        padding=0,
        dilation=1,
        groups: int = 1,
        dtype: torch.dtype | None = None,
        name: str | None = None,
    ) -> GraphTensor:
        """cuDNN's convolution forward, ``F.conv{1,2,3}d(x, w, None, stride, padding, dilation, groups)``
        by the rank of x ((N, C, *spatial), contiguous or channels_last). A bias, activation,
        residual add and scale after it fold into its epilogue."""
        node = self._begin("conv_fprop", "conv", name, [("x", x), ("w", w)])
        self._same_dtype(node, [x, w])
        self._rank(node, x, 3, 5)
        if w.ndim != x.ndim:
            raise error("shape", f"must have as many dimensions as x ({x.ndim})", node, w)
        attrs = self._conv_attrs(node, x.ndim - 2, stride, padding, dilation, groups)
        conv = (F.conv1d, F.conv2d, F.conv3d)[x.ndim - 3]
        out = self._infer(
            node,
            conv,
            x,
            w,
            stride=attrs["stride"],
            padding=attrs["padding"],
            dilation=attrs["dilation"],
            groups=attrs["groups"],
        )
        return self._commit(node, [("", tuple(out.shape), self._out_dtype(node, dtype, x.dtype))], attrs)[0]

    def conv_dgrad(
        self,
        dy: GraphTensor,
        w: GraphTensor,
        x_shape: Sequence[int] | None = None,
        *,
        stride=1,
        padding=0,
        dilation=1,
        groups: int = 1,
        name: str | None = None,
    ) -> GraphTensor:
        """cuDNN's convolution backward-data: the gradient for the input of shape ``x_shape``
        (default: the smallest input giving dy's shape) of ``conv_fprop(x, w, ...)``."""
        node = self._begin("conv_dgrad", "conv", name, [("dy", dy), ("w", w)])
        self._same_dtype(node, [dy, w])
        self._rank(node, dy, 3, 5)
        nd = dy.ndim - 2
        attrs = self._conv_attrs(node, nd, stride, padding, dilation, groups)
        if not isinstance(attrs["padding"], list):
            raise error("argument", "padding must be ints for conv_dgrad", node)
        if x_shape is None:
            spatial = [
                (o - 1) * s - 2 * p + d * (k - 1) + 1
                for o, s, p, d, k in zip(
                    dy.shape[2:], attrs["stride"], attrs["padding"], attrs["dilation"], w.shape[2:]
                )
            ]
            x_shape = (dy.shape[0], w.shape[1] * attrs["groups"], *spatial)
        attrs["x_shape"] = _ints(node, "x_shape", list(x_shape), dy.ndim)
        self._check_conv_geometry(node, attrs["x_shape"], w.shape, dy, attrs)
        return self._commit(node, [("", tuple(attrs["x_shape"]), dy.dtype)], attrs)[0]

    def conv_wgrad(
        self,
        x: GraphTensor,
        dy: GraphTensor,
        kernel_size,
        *,
        stride=1,
        padding=0,
        dilation=1,
        groups: int = 1,
        name: str | None = None,
    ) -> GraphTensor:
        """cuDNN's convolution backward-filter: the weight gradient, of shape
        (dy's channels, x's channels / groups, *kernel_size)."""
        node = self._begin("conv_wgrad", "conv", name, [("x", x), ("dy", dy)])
        self._same_dtype(node, [x, dy])
        self._rank(node, x, 3, 5)
        nd = x.ndim - 2
        attrs = self._conv_attrs(node, nd, stride, padding, dilation, groups)
        if not isinstance(attrs["padding"], list):
            raise error("argument", "padding must be ints for conv_wgrad", node)
        if dy.ndim != x.ndim or x.shape[1] % attrs["groups"]:
            raise error("shape", f"does not match x {x.describe()} with groups={attrs['groups']}", node, dy)
        w_shape = [dy.shape[1], x.shape[1] // attrs["groups"], *_ints(node, "kernel_size", kernel_size, nd)]
        attrs["w_shape"] = w_shape
        self._check_conv_geometry(node, list(x.shape), w_shape, dy, attrs)
        return self._commit(node, [("", tuple(w_shape), x.dtype)], attrs)[0]

    def _check_conv_geometry(self, node: Node, x_shape, w_shape, dy: GraphTensor, attrs) -> None:
        conv = (F.conv1d, F.conv2d, F.conv3d)[len(x_shape) - 3]
        try:
            out = conv(
                torch.empty(x_shape, device="meta"),
                torch.empty(tuple(w_shape), device="meta"),
                stride=attrs["stride"],
                padding=attrs["padding"],
                dilation=attrs["dilation"],
                groups=attrs["groups"],
            )
        except (RuntimeError, ValueError) as exc:
            raise error("shape", f"invalid convolution geometry: {str(exc).splitlines()[0]}", node) from None
        if tuple(out.shape) != dy.shape:
            raise error(
                "shape",
                f"an input {tuple(x_shape)} and weight {tuple(w_shape)} give {tuple(out.shape)}, "
                "not dy's shape",
                node,
                dy,
            )


_POINTWISE_SLOTS = {
    "select": ("cond", "a", "b"),
    **{f"{op}": ("dy", "x") for op in OPS if op.endswith("_backward")},
}


_SIMPLE = {
    "sqrt": "``torch.sqrt``.",
    "rsqrt": "``torch.rsqrt``.",
    "exp": "``torch.exp``.",
    "log": "``torch.log``.",
    "abs": "``torch.abs``.",
    "neg": "``-x``.",
    "reciprocal": "``1 / x``.",
    "square": "``x * x``.",
    "erf": "``torch.erf``.",
    "sin": "``torch.sin``.",
    "cos": "``torch.cos``.",
    "floor": "``torch.floor``.",
    "ceil": "``torch.ceil``.",
    "identity": "``x`` (a copy; with ``dtype``, a cast).",
    "logical_not": "``~x`` of truth values.",
    "sigmoid": "``torch.sigmoid``.",
    "tanh": "``torch.tanh``.",
    "gelu": "``F.gelu`` (exact, with erf).",
    "gelu_tanh": "``F.gelu(x, approximate='tanh')``.",
    "sigmoid_backward": "``dy * sigmoid'(x)``.",
    "tanh_backward": "``dy * tanh'(x)``.",
    "gelu_backward": "``dy * gelu'(x)``.",
    "gelu_tanh_backward": "``dy * gelu_tanh'(x)``.",
    "silu_backward": "``dy * silu'(x)``.",
}


def _simple(op: str, doc: str) -> Callable[..., GraphTensor]:
    def method(self: NodeBuilders, *operands: Operand, **kw: Any) -> GraphTensor:
        return self.pointwise(op, *operands, **kw)

    method.__name__ = method.__qualname__ = op
    method.__doc__ = f"Pointwise {doc} Keywords: ``dtype``, ``name``."
    return method


for _op, _doc in _SIMPLE.items():
    setattr(NodeBuilders, _op, _simple(_op, _doc))
