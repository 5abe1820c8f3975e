"""``Graph``: tensors are edges, operations are nodes (cuDNN's operation graph).

>>> g = tdnn.Graph(io_dtype=torch.bfloat16)
>>> x = g.tensor((64, 64, 56, 56), layout="channels_last", name="x")
>>> w = g.tensor((64, 64, 3, 3), layout="channels_last", name="w")
>>> b = g.tensor((64, 1, 1), name="b")
>>> y = g.relu(g.bias(g.conv_fprop(x, w, padding=1), b))
>>> g.set_output(y)
>>> plan = g.build()                      # partition, fuse, generate kernels
>>> out = plan.execute({"x": x_t, "w": w_t, "b": b_t})[y]

Inputs are declared with shape, strides (or a layout name) and dtype; every node checks its
operands and infers its outputs' shapes (PyTorch's broadcasting and shape rules). ``validate``
checks the whole graph, ``check_support`` says why it cannot run instead of raising, ``build``
returns a ``Plan``, ``serialize``/``deserialize`` write and read versioned JSON.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..core.errors import NotSupportedError
from .nodes import NodeBuilders
from .types import (
    FLOATS,
    LAYOUTS,
    MAX_RANK,
    GraphTensor,
    Node,
    dtype_name,
    error,
    layout_strides,
)

if TYPE_CHECKING:
    from .plan import Plan

MODES = ("fast", "benchmark", "fallback")


class Graph(NodeBuilders):
    """An operation graph (see the module docstring).

    Args:
        io_dtype: the dtype of tensors declared without one (default float32).
        compute_dtype: the arithmetic of generated kernels: float32 (default) or float64.
        intermediate_dtype: the dtype of pointwise nodes' outputs given none (default: io_dtype).
        name: a label for ``explain`` and the JSON.
    """

    def __init__(
        self,
        io_dtype: torch.dtype = torch.float32,
        compute_dtype: torch.dtype = torch.float32,
        intermediate_dtype: torch.dtype | None = None,
        name: str = "graph",
    ) -> None:
        if io_dtype not in FLOATS:
            raise error("dtype", f"io_dtype={io_dtype}; accepted: {', '.join(map(dtype_name, FLOATS))}")
        if compute_dtype not in (torch.float32, torch.float64):
            raise error("dtype", f"compute_dtype={compute_dtype}; accepted: float32, float64")
        if intermediate_dtype is not None and intermediate_dtype not in FLOATS:
            raise error("dtype", f"intermediate_dtype={intermediate_dtype} is not a float dtype")
        if not isinstance(name, str) or not name:
            raise error("argument", f"name={name!r} must be a non-empty str")
        self.io_dtype = io_dtype
        self.compute_dtype = compute_dtype
        self.intermediate_dtype = intermediate_dtype or io_dtype
        self.name = name
        self._tensors: list[GraphTensor] = []
        self._nodes: list[Node] = []
        self._by_name: dict[str, GraphTensor] = {}
        self._node_names: set[str] = set()

    # -----------------------------------------------------------------------------------------
    # Tensors.

    def _new_tensor(self, name: str | None, shape, stride, dtype, kind: str, value=None) -> GraphTensor:
        if name is None:
            name = self._fresh(f"t{len(self._tensors)}" if kind != "scalar" else f"s{len(self._tensors)}")
        elif not isinstance(name, str) or not name:
            raise error("name", f"a tensor name must be a non-empty str, got {name!r}")
        elif name in self._by_name:
            raise error("name", f"a tensor named '{name}' already exists in graph '{self.name}'")
        t = GraphTensor(self, len(self._tensors), name, shape, stride, dtype, kind, value)
        self._tensors.append(t)
        self._by_name[name] = t
        return t

    def _fresh(self, base: str) -> str:
        name, i = base, 0
        while name in self._by_name or name in self._node_names:
            i += 1
            name = f"{base}_{i}"
        return name

    def tensor(
        self,
        shape: Sequence[int],
        stride: Sequence[int] | str | None = None,
        dtype: torch.dtype | None = None,
        name: str | None = None,
        *,
        layout: str | None = None,
    ) -> GraphTensor:
        """Declare a graph input: fed a torch tensor of this shape, strides and dtype at execute.

        Args:
            shape: sizes (up to 8 dimensions; 0 allowed).
            stride: explicit strides, or a layout name; None for ``layout`` (default contiguous).
            dtype: default the graph's io_dtype; float16/bfloat16/float32/float64 or bool.
            name: unique name, the key of feeds (default ``t<n>``).
            layout: ``"contiguous"`` or ``"channels_last"`` (N, spatial..., C in memory).
        """
        if isinstance(stride, str):
            layout, stride = stride, None
        shape_t = _shape(shape, name)
        dtype = dtype or self.io_dtype
        if dtype not in (*FLOATS, torch.bool):
            raise error("dtype", f"tensor '{name}': dtype {dtype}; accepted: float16/32/64, bfloat16, bool")
        if stride is not None:
            if layout is not None:
                raise error("layout", f"tensor '{name}': give stride or layout, not both")
            stride_t = _shape(stride, name, "stride")
            if len(stride_t) != len(shape_t):
                raise error(
                    "layout",
                    f"tensor '{name}': stride {stride_t} has {len(stride_t)} entries for "
                    f"{len(shape_t)} dimensions",
                )
        else:
            layout = layout or "contiguous"
            if layout not in LAYOUTS:
                raise error("layout", f"tensor '{name}': layout {layout!r}; accepted: {', '.join(LAYOUTS)}")
            if layout == "channels_last" and len(shape_t) not in (3, 4, 5):
                raise error(
                    "layout", f"tensor '{name}': channels_last needs 3 to 5 dimensions, got {shape_t}"
                )
            stride_t = layout_strides(shape_t, layout)
        return self._new_tensor(name, shape_t, stride_t, dtype, "input")

    def tensor_like(self, t: torch.Tensor, name: str | None = None) -> GraphTensor:
        """Declare a graph input with the shape, strides and dtype of a torch tensor."""
        if not isinstance(t, torch.Tensor):
            raise error("argument", f"tensor_like takes a torch.Tensor, got {type(t).__name__}")
        return self.tensor(tuple(t.shape), tuple(t.stride()), t.dtype, name)

    def scalar(
        self, value: float | None = None, dtype: torch.dtype = torch.float32, name: str | None = None
    ) -> GraphTensor:
        """A scalar operand of pointwise nodes: a constant ``value`` (part of the plan), or with
        ``value=None`` an input fed a Python number at execute (no recompilation per value)."""
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise error("argument", f"scalar value must be a real number or None, got {type(value).__name__}")
        if dtype not in FLOATS:
            raise error("dtype", f"scalar '{name}': dtype {dtype} is not a float dtype")
        return self._new_tensor(name, (), None, dtype, "scalar", None if value is None else float(value))

    def set_output(self, t: GraphTensor, dtype: torch.dtype | None = None) -> GraphTensor:
        """Mark a node's output as a graph output (returned by ``plan.execute``), optionally in
        another ``dtype`` (pointwise, matmul, convolution and reduction outputs, before use)."""
        self._check_member(t, "set_output")
        if t.producer is None:
            raise error("graph", "only a node's output can be a graph output", tensor=t)
        if dtype is not None and dtype != t.dtype:
            if t.producer.op not in _RETYPABLE and t.producer.kind != "pointwise":
                raise error(
                    "dtype", f"the output of {t.producer.op} keeps dtype {dtype_name(t.dtype)}", t.producer, t
                )
            if dtype not in (*FLOATS, torch.bool) or (dtype == torch.bool and t.producer.kind != "pointwise"):
                raise error("dtype", f"output dtype {dtype} is not accepted", t.producer, t)
            if self.consumers(t):
                raise error("dtype", "set the dtype before the tensor is used by other nodes", t.producer, t)
            t.dtype = dtype
        t.is_output = True
        return t

    def _check_member(self, t: object, what: str) -> None:
        if not isinstance(t, GraphTensor):
            raise error("argument", f"{what}: expected a GraphTensor, got {type(t).__name__}")
        if t.graph is not self:
            raise error(
                "graph", f"{what}: tensor belongs to graph '{t.graph.name}', not '{self.name}'", tensor=t
            )

    # -----------------------------------------------------------------------------------------
    # Nodes (the builders live in nodes.py and call these two).

    def _begin(
        self, op: str, kind: str, name: str | None, operands: list[tuple[str, GraphTensor | None]]
    ) -> Node:
        if name is None:
            name = self._fresh(f"{op}{len(self._nodes)}")
        elif not isinstance(name, str) or not name:
            raise error("name", f"a node name must be a non-empty str, got {name!r}")
        elif name in self._node_names:
            raise error("name", f"a node named '{name}' already exists in graph '{self.name}'")
        node = Node(
            len(self._nodes),
            name,
            op,
            kind,
            tuple(t for _, t in operands),
            tuple(s for s, _ in operands),
            (),
            {},
        )
        for slot, t in operands:
            if t is None:
                continue
            if not isinstance(t, GraphTensor):
                raise error(
                    "argument", f"operand '{slot}' must be a GraphTensor, got {type(t).__name__}", node
                )
            if t.graph is not self:
                raise error("graph", f"operand '{slot}' belongs to graph '{t.graph.name}'", node, t)
            if t.is_scalar and kind != "pointwise":
                raise error(
                    "shape", f"operand '{slot}' is a scalar; only pointwise nodes take scalars", node, t
                )
        return node

    def _commit(self, node: Node, outs: list[tuple[str, Sequence[int], torch.dtype]], attrs: dict[str, Any]):
        names = [node.name if len(outs) == 1 else f"{node.name}.{suffix}" for suffix, _, _ in outs]
        for n in names:
            if n in self._by_name:
                raise error("name", f"output tensor name '{n}' is taken by another tensor", node)
        node.attrs = attrs
        self._node_names.add(node.name)
        self._nodes.append(node)
        tensors = []
        for n, (_, shape, dtype) in zip(names, outs):
            t = self._new_tensor(n, tuple(int(s) for s in shape), None, dtype, "virtual")
            t.producer = node
            tensors.append(t)
        node.outputs = tuple(tensors)
        return tensors

    # -----------------------------------------------------------------------------------------
    # Queries.

    @property
    def nodes(self) -> list[Node]:
        """The nodes in the order they were added (a topological order)."""
        return list(self._nodes)

    @property
    def tensors(self) -> list[GraphTensor]:
        return list(self._tensors)

    @property
    def inputs(self) -> list[GraphTensor]:
        """Tensors and scalars fed at execute."""
        return [t for t in self._tensors if t.kind == "input" or (t.is_scalar and t.value is None)]

    @property
    def outputs(self) -> list[GraphTensor]:
        return [t for t in self._tensors if t.is_output]

    def __getitem__(self, name: str) -> GraphTensor:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"graph '{self.name}' has no tensor named {name!r}") from None

    def consumers(self, t: GraphTensor) -> list[Node]:
        return [n for n in self._nodes if any(i is t for i in n.inputs)]

    def __repr__(self) -> str:
        lines = [
            f"Graph '{self.name}' (io {dtype_name(self.io_dtype)}, compute {dtype_name(self.compute_dtype)})"
        ]
        lines += [f"  input {t.name} {t.describe()}" for t in self.inputs]
        lines += [f"  {n!r}" for n in self._nodes]
        lines += [f"  output {t.name} {t.describe()}" for t in self.outputs]
        return "\n".join(lines)

    # -----------------------------------------------------------------------------------------
    # Whole-graph rules, plans, JSON.

    def validate(self) -> None:
        """Check the rules that concern the whole graph; raises ``GraphError`` naming the node,
        the tensor and the rule: a cycle, an input no node uses, no output, or a node whose
        outputs go nowhere (rule "missing output")."""
        produced_at: dict[int, int] = {}
        for i, node in enumerate(self._nodes):
            for t in node.outputs:
                produced_at[t.uid] = i
        for i, node in enumerate(self._nodes):
            for t in node.inputs:
                if t is not None and t.is_virtual and produced_at.get(t.uid, math.inf) >= i:
                    raise error("cycle", "reads a tensor produced by itself or by a later node", node, t)
        if not self.outputs:
            raise error("missing output", f"graph '{self.name}' has no output: mark one with set_output")
        used = {t.uid for n in self._nodes for t in n.inputs if t is not None}
        for t in self.inputs:
            if t.uid not in used:
                raise error("unused input", "no node reads this input", tensor=t)
        for node in self._nodes:
            if not any(t.is_output or t.uid in used for t in node.outputs):
                raise error(
                    "missing output",
                    "its outputs are neither used nor marked with set_output",
                    node,
                    node.outputs[0],
                )

    def check_support(self, mode: str = "fast") -> list[str]:
        """Why this graph cannot be built and run here, as a list of reasons (empty: it can)."""
        try:
            plan = self.build(mode)
        except (ValueError, TypeError, NotSupportedError) as exc:
            return [str(exc)]
        return plan.support_reasons()

    def build(self, mode: str = "fast") -> Plan:
        """Validate, partition into kernels and prepare them: a ``Plan`` to execute.

        Modes: ``"fast"`` (heuristics: fused kernels, the ops' heuristic engines), ``"benchmark"``
        (as fast, then every candidate partition and generated-kernel configuration is timed on
        random inputs and the fastest kept), ``"fallback"`` (no fusion: one kernel per node).
        """
        from .plan import Plan

        if mode not in MODES:
            raise error("argument", f"mode={mode!r}; accepted: {', '.join(MODES)}")
        self.validate()
        return Plan.create(self, mode)

    def serialize(self) -> str:
        """The graph as versioned JSON (see ``graph.serialize.GRAPH_SCHEMA``)."""
        from .serialize import graph_to_json

        return graph_to_json(self)

    @classmethod
    def deserialize(cls, text: str | bytes) -> Graph:
        """Rebuild a graph from ``serialize``'s JSON. Every node goes through its builder again, so
        all rules are checked; nothing in the text is executed. Raises ``GraphError`` (rule
        "format") for malformed, truncated, wrong-version or hostile input."""
        from .serialize import graph_from_json

        return graph_from_json(text)


_RETYPABLE = ("matmul", "conv_fprop", "reduction")


def _shape(value: object, name: str | None, what: str = "shape") -> tuple[int, ...]:
    if not isinstance(value, (list, tuple, torch.Size)) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        raise error(
            "shape" if what == "shape" else "layout",
            f"tensor '{name}': {what} must be a sequence of ints >= 0, got {value!r}",
        )
    if len(value) > MAX_RANK:
        raise error("shape", f"tensor '{name}': {len(value)} dimensions; at most {MAX_RANK}")
    return tuple(value)


__all__ = ["MODES", "Graph"]
