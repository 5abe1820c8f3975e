"""The graph's vocabulary: tensors (edges), nodes, the error every rule raises, dtype and layout names."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .graph import Graph

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
DTYPE_NAMES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "bool": torch.bool,
}
LAYOUTS = ("contiguous", "channels_last")
MAX_RANK = 8


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class GraphError(ValueError):
    """A graph that breaks a rule: the message names the node, the tensor and the rule.

    Attributes:
        rule: ``"shape"``, ``"dtype"``, ``"layout"``, ``"cycle"``, ``"unused input"``,
            ``"missing output"``, ``"name"``, ``"argument"``, ``"graph"``, ``"feed"``, ``"format"``.
        node: the node's name, or None.
        tensor: the tensor's name, or None.
    """

    def __init__(self, rule: str, message: str, node: Node | None = None, tensor: GraphTensor | None = None):
        self.rule = rule
        self.node = node.name if node is not None else None
        self.tensor = tensor.name if tensor is not None else None
        where = []
        if node is not None:
            where.append(f"node '{node.name}' ({node.op})")
        if tensor is not None:
            where.append(f"tensor '{tensor.name}' {tensor.describe()}")
        prefix = "tdnn.Graph: " + (", ".join(where) + ": " if where else "")
        super().__init__(f"{prefix}{message} [rule: {rule}]")


class GraphDtypeError(GraphError, TypeError):
    """A ``GraphError`` for the dtype rule (also a TypeError, as every wrong dtype in tritondnn)."""


def error(rule: str, message: str, node: Node | None = None, tensor: GraphTensor | None = None) -> GraphError:
    cls = GraphDtypeError if rule == "dtype" else GraphError
    return cls(rule, message, node, tensor)


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def layout_strides(shape: Sequence[int], layout: str) -> tuple[int, ...]:
    """Strides of a dense tensor of ``shape`` in a named layout (channels_last: N, spatial..., C)."""
    if layout == "contiguous" or len(shape) < 3:
        return contiguous_strides(shape)
    order = [0, *range(2, len(shape)), 1]  # memory order, outermost first
    dense = contiguous_strides([shape[d] for d in order])
    strides = [0] * len(shape)
    for d, st in zip(order, dense):
        strides[d] = st
    return tuple(strides)


def broadcast(a: Sequence[int], b: Sequence[int]) -> tuple[int, ...]:
    """PyTorch's broadcast of two shapes (plain Python: cheaper than torch.broadcast_shapes);
    raises ValueError when they do not broadcast."""
    if len(a) < len(b):
        a, b = b, a
    out = list(a)
    pad = len(a) - len(b)
    for i, n in enumerate(b):
        m = out[pad + i]
        if m == 1:
            out[pad + i] = n
        elif n != 1 and n != m:
            raise ValueError(f"shapes {tuple(a)} and {tuple(b)} do not broadcast")
    return tuple(out)


def is_dense(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether the strides cover ``prod(shape)`` elements without gaps or overlap (any order)."""
    dims = sorted((st, n) for n, st in zip(shape, stride) if n != 1)
    step = 1
    for st, n in dims:
        if st != step:
            return False
        step *= n
    return True


class GraphTensor:
    """An edge of the graph: a tensor descriptor, not data.

    Attributes:
        name: unique in its graph; the key of ``plan.execute`` feeds and outputs.
        shape: sizes; () for scalars.
        stride: strides for graph inputs; None for virtual tensors (the plan decides).
        dtype: a torch dtype.
        kind: ``"input"`` (fed at execute), ``"virtual"`` (a node's output) or ``"scalar"``.
        value: a scalar's constant value, or None for a scalar fed at execute.
        producer: the node writing a virtual tensor.
        is_output: marked with ``Graph.set_output``.

    Arithmetic operators (``+ - * / ** -x``) add pointwise nodes to the tensor's graph.
    """

    __slots__ = ("dtype", "graph", "is_output", "kind", "name", "producer", "shape", "stride", "uid", "value")

    def __init__(
        self, graph: Graph, uid: int, name: str, shape: tuple[int, ...], stride, dtype, kind, value=None
    ):
        self.graph = graph
        self.uid = uid
        self.name = name
        self.shape = shape
        self.stride = stride
        self.dtype = dtype
        self.kind = kind
        self.value = value
        self.producer: Node | None = None
        self.is_output = False

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_virtual(self) -> bool:
        return self.kind == "virtual"

    @property
    def is_scalar(self) -> bool:
        return self.kind == "scalar"

    def describe(self) -> str:
        if self.is_scalar:
            return f"(scalar {dtype_name(self.dtype)}{'' if self.value is None else f' = {self.value}'})"
        sizes = ", ".join(map(str, self.shape)) + ("," if len(self.shape) == 1 else "")
        return f"({sizes}) {dtype_name(self.dtype)}"

    def __repr__(self) -> str:
        return f"GraphTensor('{self.name}' {self.kind} {self.describe()})"

    # Operators: pointwise nodes in the tensor's graph.
    def __add__(self, other: Any) -> GraphTensor:
        return self.graph.add(self, other)

    def __radd__(self, other: Any) -> GraphTensor:
        return self.graph.add(other, self)

    def __sub__(self, other: Any) -> GraphTensor:
        return self.graph.sub(self, other)

    def __rsub__(self, other: Any) -> GraphTensor:
        return self.graph.sub(other, self)

    def __mul__(self, other: Any) -> GraphTensor:
        return self.graph.mul(self, other)

    def __rmul__(self, other: Any) -> GraphTensor:
        return self.graph.mul(other, self)

    def __truediv__(self, other: Any) -> GraphTensor:
        return self.graph.div(self, other)

    def __rtruediv__(self, other: Any) -> GraphTensor:
        return self.graph.div(other, self)

    def __pow__(self, other: Any) -> GraphTensor:
        return self.graph.pow(self, other)

    def __neg__(self) -> GraphTensor:
        return self.graph.neg(self)


@dataclasses.dataclass(eq=False)
class Node:
    """A vertex: one operation.

    Attributes:
        name: unique in its graph.
        op: the operation (``"add"``, ``"matmul"``, ``"conv_fprop"``...).
        kind: its family: ``"pointwise"``, ``"matmul"``, ``"conv"``, ``"reduction"``, ``"norm"``,
            ``"norm_backward"``, ``"attention"``, ``"pool"``, ``"layout"``, ``"genstats"``.
        inputs: operand tensors (None for an absent optional operand), named by ``slots``.
        outputs: the tensors it writes.
        attrs: JSON-serializable parameters (``Graph.serialize`` writes them as they are).
    """

    uid: int
    name: str
    op: str
    kind: str
    inputs: tuple[GraphTensor | None, ...]
    slots: tuple[str, ...]
    outputs: tuple[GraphTensor, ...]
    attrs: dict[str, Any]

    def __repr__(self) -> str:
        ins = ", ".join(f"{s}={t.name}" for s, t in zip(self.slots, self.inputs) if t is not None)
        outs = ", ".join(t.name for t in self.outputs)
        return f"{self.name}: {self.op}({ins}) -> {outs}"
