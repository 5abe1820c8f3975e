"""The rules node builders share: argument parsing, dtype and rank checks, broadcasting, and shape
inference through PyTorch's own shape functions on meta tensors (so shapes agree with
``torch.nn.functional`` exactly). Every violation raises ``GraphError`` naming node and operand.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .types import FLOATS, GraphTensor, Node, broadcast, dtype_name, error


def _meta(t: GraphTensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def _ints(node: Node, name: str, value: Any, count: int | None = None) -> list[int]:
    """An int or a sequence of ints, as a list (``count`` copies of a single int)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return [value] * (count or 1)
    if isinstance(value, (list, tuple)) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        if count is not None and len(value) != count:
            raise error("argument", f"'{name}'={list(value)} needs {count} values", node)
        return list(value)
    raise error("argument", f"'{name}' must be an int or a sequence of ints, got {value!r}", node)


def _number(node: Node, name: str, value: Any, *, finite: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise error("argument", f"'{name}' must be a real number, got {type(value).__name__}", node)
    if finite and not math.isfinite(value):
        raise error("argument", f"'{name}'={value} must be finite", node)
    return float(value)


def _flag(node: Node, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise error("argument", f"'{name}' must be a bool, got {type(value).__name__}", node)
    return value


class Rules:
    """Checks the builders call on the node being made (its operands, its arguments)."""

    # Provided by Graph.
    intermediate_dtype: torch.dtype
    _begin: Callable[..., Node]
    _commit: Callable[..., Any]
    scalar: Callable[..., GraphTensor]

    def _broadcast(self, node: Node, tensors: Sequence[GraphTensor]) -> tuple[int, ...]:
        shape: tuple[int, ...] = ()
        for t in tensors:
            try:
                shape = broadcast(shape, t.shape)
            except ValueError:
                others = [u.describe() for u in tensors]
                raise error(
                    "shape", f"does not broadcast with the other operands {others}", node, t
                ) from None
        return shape

    def _same_dtype(self, node: Node, tensors: Sequence[GraphTensor | None], accepted=FLOATS) -> None:
        first = None
        for t in tensors:
            if t is None:
                continue
            if t.dtype not in accepted:
                names = ", ".join(dtype_name(d) for d in accepted)
                raise error("dtype", f"has dtype {dtype_name(t.dtype)}; accepted: {names}", node, t)
            if first is None:
                first = t
            elif t.dtype != first.dtype:
                raise error(
                    "dtype",
                    f"has dtype {dtype_name(t.dtype)} but '{first.name}' has {dtype_name(first.dtype)}",
                    node,
                    t,
                )

    def _rank(self, node: Node, t: GraphTensor, low: int, high: int) -> None:
        if not low <= t.ndim <= high:
            raise error("shape", f"has {t.ndim} dimensions; accepted: {low} to {high}", node, t)

    def _infer(self, node: Node, fn: Callable[..., torch.Tensor], *tensors: GraphTensor, **kw) -> Any:
        """Run PyTorch's shape rules for ``fn`` on meta tensors; their complaint becomes a GraphError."""
        try:
            return fn(*(_meta(t) for t in tensors), **kw)
        except (RuntimeError, ValueError, TypeError, IndexError) as exc:
            msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise error(
                "shape", f"operands {[t.describe() for t in tensors]} are invalid: {msg}", node
            ) from None

    def _out_dtype(self, node: Node, dtype: torch.dtype | None, default: torch.dtype) -> torch.dtype:
        if dtype is not None and dtype not in FLOATS:
            raise error("dtype", f"output dtype {dtype} is not a float dtype", node)
        return dtype or default

    def _channel_param(self, node: Node, slot: str, t: GraphTensor | None, x: GraphTensor) -> None:
        """A per-channel tensor: (C,) as PyTorch's or (1, C, 1, ...) as cuDNN's."""
        if t is None:
            return
        c = x.shape[1]
        if t.shape != (c,) and t.shape != (1, c, *([1] * (x.ndim - 2))):
            raise error(
                "shape", f"'{slot}' must have shape ({c},) or (1, {c}, 1, ...) for x {x.describe()}", node, t
            )
        if t.dtype not in FLOATS:
            raise error("dtype", f"'{slot}' must be a float tensor", node, t)

    def _normalized(self, node: Node, x: GraphTensor, normalized_shape) -> list[int]:
        shape = (
            [x.shape[-1]] if normalized_shape is None else _ints(node, "normalized_shape", normalized_shape)
        )
        if not shape or len(shape) > x.ndim or list(x.shape[x.ndim - len(shape) :]) != shape:
            raise error("shape", f"normalized_shape {shape} is not the trailing dimensions of x", node, x)
        return shape

    def _affine(self, node: Node, slot: str, t: GraphTensor | None, shape: Sequence[int]) -> None:
        if t is not None and list(t.shape) != list(shape):
            raise error("shape", f"'{slot}' must have shape {tuple(shape)}", node, t)
        if t is not None and t.dtype not in FLOATS:
            raise error("dtype", f"'{slot}' must be a float tensor", node, t)
