"""The fusion partitioner: which nodes run together in one kernel.

In order, on a validated graph:

1. Epilogues: a matmul or forward convolution absorbs the single-consumer pointwise chain after
   it when ``Epilogue`` can express it: a constant scale (alpha), a full-shape add before the
   activation (C), a bias (per column for matmul, per channel for convolution), one activation,
   a full-shape add after it (residual), a cast. Prologues: a forward convolution then absorbs
   the chain producing its input when it is cuDNN's scale-bias-relu (batch norm's apply and a
   ReLU): a per-channel scale, a per-channel shift, ReLU, in that order, each optional.
2. Norms: a residual add before layernorm/rmsnorm becomes ``add_layer_norm``/``add_rms_norm``;
   one activation after a norm folds into it.
3. Pointwise groups: pointwise nodes merge (along edges, and siblings reading the same tensor)
   while the group stays convex (no path leaves it and comes back), every tensor it writes has
   the group's iteration shape (smaller nodes used only inside are recomputed per element), and
   no operand viewed with another shape is produced inside. Each group is one generated kernel.
4. Reductions: a reduction or genstats whose input comes from a pointwise group of its shape
   joins it (one generated kernel that also stores the group's outputs); several reductions over
   the same dimensions of one group share it.
5. Everything else is a step of its own; steps are ordered topologically.

``"fallback"`` mode skips 1-4; prologues fold in ``"prologue"`` mode only (plan.VARIANTS says why).
Every decision not to fuse is kept as a note for ``explain``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from .graph import Graph
from .pointwise import ADDITIVE, MULTIPLICATIVE, OPS
from .types import GraphTensor, Node, broadcast

# Activations a norm kernel can apply, with the parameters it applies them with.
_NORM_ACTIVATIONS = {
    "relu": [0.0, math.inf],
    "silu": [1.0],
    "swish": [1.0],
    "gelu": [],
    "gelu_tanh": [],
    "sigmoid": [],
    "tanh": [],
}
_NORM_ACT_NAME = {"swish": "silu"}


@dataclasses.dataclass(eq=False)
class Step:
    """One kernel (or library call) of a plan.

    Attributes:
        kind: ``"pointwise"`` or ``"reduce"`` (generated kernels), else the library operation
            (``"matmul"``, ``"conv_fprop"``, ``"layernorm"``, ``"reduction"``, ``"view"``...).
        nodes: the graph nodes it computes, in topological order.
        main: the library node of a library step.
        fold: what folded into a library step: ``alpha``, ``c``, ``bias``, ``activation``,
            ``params``, ``residual`` (epilogues), ``add`` (the add node of add+norm), ``final``.
        dims: reduced dimensions of a reduce step.
        notes: explain lines about this step.
    """

    kind: str
    nodes: list[Node]
    main: Node | None = None
    fold: dict[str, Any] = dataclasses.field(default_factory=dict)
    dims: tuple[int, ...] = ()
    notes: list[str] = dataclasses.field(default_factory=list)

    def writes(self, cons: dict[int, list[Node]]) -> list[GraphTensor]:
        """Tensors this step leaves in the plan's environment (``cons``: ``consumers_of``)."""
        inside = {n.uid for n in self.nodes}
        out = []
        for n in self.nodes:
            for t in n.outputs:
                if t.is_output or any(c.uid not in inside for c in cons.get(t.uid, ())):
                    out.append(t)
        return out

    def reads(self) -> list[GraphTensor]:
        produced = {t.uid for n in self.nodes for t in n.outputs}
        seen: dict[int, GraphTensor] = {}
        for n in self.nodes:
            for t in n.inputs:
                if t is not None and t.uid not in produced and not (t.is_scalar and t.value is not None):
                    seen.setdefault(t.uid, t)
        return list(seen.values())


def consumers_of(graph: Graph) -> dict[int, list[Node]]:
    table: dict[int, list[Node]] = {}
    for n in graph.nodes:
        for t in n.inputs:
            if t is not None and n not in table.setdefault(t.uid, []):
                table[t.uid].append(n)
    return table


def partition(graph: Graph, mode: str) -> tuple[list[Step], list[str]]:
    """The steps of ``graph`` in execution order and the notes on what did not fuse."""
    cons = consumers_of(graph)
    notes: list[str] = []
    claimed: dict[int, Step] = {}
    steps: list[Step] = []
    fuse = mode != "fallback"
    if fuse:
        for node in graph.nodes:
            if node.op in ("matmul", "conv_fprop"):
                steps.append(_fold_epilogue(node, cons, claimed))
        for step in steps:
            if step.kind == "conv_fprop":
                _fold_prologue(step, cons, claimed, mode == "prologue")
        for node in graph.nodes:
            if node.kind == "norm" and node.uid not in claimed:
                steps.append(_fold_norm(node, cons, claimed))
    pointwise = [n for n in graph.nodes if n.kind == "pointwise" and n.uid not in claimed]
    groups = _group_pointwise(graph, pointwise, cons, claimed, notes) if fuse else [[n] for n in pointwise]
    group_steps = [Step("pointwise", g) for g in groups]
    for s in group_steps:
        for n in s.nodes:
            claimed[n.uid] = s
    steps += group_steps
    for node in graph.nodes:
        if node.kind != "reduction" or node.uid in claimed:
            continue
        x = node.inputs[0]
        assert x is not None
        dims = tuple(node.attrs["dim"])
        host = claimed.get(x.producer.uid) if fuse and x.producer is not None else None
        if (
            host is not None
            and host.kind in ("pointwise", "reduce")
            and _iteration_shape(host.nodes) == x.shape
        ):
            if host.kind == "reduce" and host.dims != dims:
                notes.append(
                    f"{node.name}: reduces other dimensions than the reduction already fused into "
                    f"the kernel of {host.nodes[0].name}; runs on its own"
                )
            else:
                host.kind, host.dims = "reduce", dims
                host.nodes.append(node)
                claimed[node.uid] = host
                continue
        elif x.producer is not None and x.producer.kind == "pointwise" and fuse and host is not None:
            notes.append(
                f"{node.name}: its input '{x.name}' {x.describe()} is not the full iteration shape of the "
                f"pointwise kernel producing it; runs on its own"
            )
        library = node.op == "reduction" and node.outputs[0].dtype == x.dtype and x.dtype != torch.bool
        step = Step("reduction" if library else "reduce", [node], node if library else None, dims=dims)
        claimed[node.uid] = step
        steps.append(step)
    for node in graph.nodes:
        if node.uid not in claimed:
            kind = "view" if node.op in ("reshape", "transpose", "slice") else node.op
            step = Step(kind, [node], node)
            claimed[node.uid] = step
            steps.append(step)
    for s in steps:
        order = {n.uid: i for i, n in enumerate(graph.nodes)}
        s.nodes.sort(key=lambda n: order[n.uid])
    return _order(steps, claimed), notes


# ---------------------------------------------------------------------------------------------
# 1-2. Folding into library kernels.


def _descends(node: Node, t: GraphTensor) -> bool:
    """Whether tensor ``t`` depends on ``node``'s outputs."""
    stack, seen = [t], set()
    while stack:
        u = stack.pop()
        if u.producer is None or u.uid in seen:
            continue
        seen.add(u.uid)
        if u.producer is node:
            return True
        stack += [i for i in u.producer.inputs if i is not None]
    return False


def empty_fold(node: Node) -> dict[str, Any]:
    """The fold of a matmul or convolution step that absorbed nothing."""
    return {
        "alpha": 1.0,
        "c": None,
        "bias": None,
        "activation": None,
        "params": [],
        "residual": None,
        "final": node.outputs[0],
    }


def _fold_epilogue(node: Node, cons: dict[int, list[Node]], claimed: dict[int, Step]) -> Step:
    step = Step(node.op, [node], node)
    claimed[node.uid] = step
    out = node.outputs[0]
    conv = node.op == "conv_fprop"
    fold = empty_fold(node)
    stage, t = 0, out
    while True:
        users = cons.get(t.uid, [])
        stop = None
        if t.is_output:
            stop = f"'{t.name}' is a graph output"
        elif len(users) != 1:
            stop = f"'{t.name}' is read by {len(users)} nodes" if users else None
        elif users[0].kind != "pointwise" or users[0].uid in claimed:
            stop = f"'{t.name}' is read by {users[0].name} ({users[0].op}), not an epilogue operation"
        if stop or not users:
            if t.is_output and not users:
                pass  # the chain simply ends at an output
            elif stop and t is out:
                step.notes.append(f"epilogue: nothing folded ({stop})")
            elif stop:
                step.notes.append(f"epilogue stops: {stop}")
            break
        u = users[0]
        stop = _absorb(node, u, t, fold, stage, conv)
        if isinstance(stop, str):
            step.notes.append(f"epilogue stops at {u.name} ({u.op}): {stop}")
            break
        stage = stop
        step.nodes.append(u)
        claimed[u.uid] = step
        t = u.outputs[0]
    fold["final"] = t
    step.fold = fold
    return step


def _absorb(node: Node, u: Node, t: GraphTensor, fold: dict[str, Any], stage: int, conv: bool) -> int | str:
    """Fold pointwise node ``u`` (reading ``t``) into the epilogue; the new stage (0 before the
    activation, 1 after it, 2 after the residual), or why it cannot."""
    if u.outputs[0].dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        return "its output is not a float tensor"
    if sum(i is t for i in u.inputs) != 1:
        return "it reads the product twice"
    spec = OPS[u.op]
    if u.op == "identity":
        return stage
    if spec.activation is not None:
        if stage != 0 or fold["activation"] is not None:
            return "a second activation, or an activation after the residual add"
        fold["activation"] = u.op
        fold["params"] = list(u.attrs["params"])
        return 1
    if spec.arity != 2:
        return f"{u.op} has no epilogue form"
    other = u.inputs[1] if u.inputs[0] is t else u.inputs[0]
    assert other is not None
    if u.op in MULTIPLICATIVE:
        if (
            other.is_scalar
            and other.value is not None
            and stage == 0
            and fold["c"] is None
            and fold["bias"] is None
        ):
            fold["alpha"] *= other.value
            return 0
        return "only a constant scalar scale before any add folds (into alpha)"
    if u.op not in ADDITIVE:
        return f"{u.op} has no epilogue form"
    if other.is_scalar:
        return "adding a scalar has no epilogue form"
    if _descends(node, other):
        return f"its other operand '{other.name}' depends on the {node.op} itself"
    shape = node.outputs[0].shape
    ones = all(s == 1 for s in other.shape[:-1])
    if conv:
        c = shape[1]
        per_channel = other.shape in ((c, *([1] * (len(shape) - 2))), (1, c, *([1] * (len(shape) - 2))))
        full = other.shape == shape
        bias_ok = per_channel and other.dtype == node.inputs[0].dtype  # type: ignore[union-attr]
    else:
        per_channel = ones and other.shape[-1:] == shape[-1:] and other.ndim <= len(shape) and shape[-1] != 1
        try:
            full = broadcast(other.shape, shape) == shape and not per_channel
        except ValueError:
            full = False
        bias_ok = per_channel
    if stage == 0 and bias_ok and fold["bias"] is None:
        fold["bias"] = other
        return 0
    if stage == 0 and full and fold["c"] is None:
        fold["c"] = other
        return 0
    if stage <= 1 and full and fold["residual"] is None:
        fold["residual"] = other
        return 2
    return (
        f"operand '{other.name}' {other.describe()} is neither a bias nor a full-shape tensor the epilogue "
        "still has room for"
    )


def _per_channel(t: GraphTensor, x: GraphTensor) -> bool:
    """Whether ``t`` broadcasts over ``x`` (N, C, spatial...) as one value per channel."""
    c, spatial = x.shape[1], [1] * (x.ndim - 2)
    return not t.is_scalar and t.shape in ((c, *spatial), (1, c, *spatial)) and t.dtype.is_floating_point


def _fold_prologue(step: Step, cons: dict[int, list[Node]], claimed: dict[int, Step], fold_it: bool) -> None:
    """Fold into convolution ``step`` the pointwise chain producing its input when every link is,
    walking from the input back, a ReLU, then a per-channel shift (add/bias), then a per-channel
    scale (mul/scale), each optional, each link's output read by the next link alone and no graph
    output; the chain's own input must have the convolution input's shape and dtype. The kernel
    computes ``relu(x * scale + shift)`` in fp32 (fp64) and rounds once, where the unfused chain
    rounds to each link's dtype. Unless ``fold_it`` (the "prologue" mode), only notes that it could
    (see ``plan.VARIANTS`` for why fast mode does not)."""
    node = step.main
    assert node is not None
    conv_in = node.inputs[0]
    assert conv_in is not None
    links: list[Node] = []
    fold: dict[str, Any] = {"scale": None, "shift": None, "relu": False}
    t, stage = conv_in, 3  # links still allowed: 3 any, 2 shift or scale, 1 scale
    while True:
        u = t.producer
        if (
            u is None
            or u.kind != "pointwise"
            or u.uid in claimed
            or t.is_output
            or len(cons.get(t.uid, [])) != 1
        ):
            break
        if u.op == "relu" and stage == 3 and u.attrs["params"] == _NORM_ACTIVATIONS["relu"]:
            fold["relu"], stage, t = True, 2, u.inputs[0]
        elif (u.op in ADDITIVE and stage >= 2) or (u.op in MULTIPLICATIVE and stage >= 1):
            a, b = u.inputs
            operand = b if a is not None and not a.is_scalar and a.shape == conv_in.shape else a
            source = a if operand is b else b
            if operand is None or source is None or not _per_channel(operand, conv_in):
                break
            if u.op in ADDITIVE:
                fold["shift"], stage = operand, 1
            else:
                fold["scale"], stage = operand, 0
            t = source
        else:
            break
        links.append(u)
        assert t is not None
        if stage == 0:
            break
    if not links:
        return
    if t.shape != conv_in.shape or t.dtype != conv_in.dtype or t.is_scalar:
        step.notes.append(
            f"prologue: {links[-1].name}..{links[0].name} not folded: its input '{t.name}' {t.describe()} "
            f"does not match the convolution's input {conv_in.describe()}"
        )
        return
    names = ", ".join(u.name for u in reversed(links))
    if not fold_it:
        step.notes.append(
            f"prologue: {names} could fold into the convolution's input (measured slower; benchmark mode "
            "times it)"
        )
        return
    fold["x"] = t
    step.fold["prologue"] = fold
    step.nodes[:0] = reversed(links)
    for u in links:
        claimed[u.uid] = step
    step.notes.append(
        f"prologue: {names} folded into the convolution's input (scale-bias-relu, implicit_gemm)"
    )


def _fold_norm(node: Node, cons: dict[int, list[Node]], claimed: dict[int, Step]) -> Step:
    step = Step(node.op, [node], node)
    claimed[node.uid] = step
    x = node.inputs[0]
    assert x is not None
    p = x.producer
    if node.op in ("layernorm", "rmsnorm") and p is not None and p.op == "add" and p.uid not in claimed:
        a, b = p.inputs
        others = [t for t in node.inputs[1:] if t is not None]
        if any(_descends(p, t) for t in others):
            step.notes.append(f"residual add {p.name} not folded: the norm's parameters depend on it")
        elif all(
            t is not None and not t.is_scalar and t.shape == x.shape and t.dtype == x.dtype for t in (a, b)
        ):
            step.fold["add"] = p
            step.nodes.insert(0, p)
            claimed[p.uid] = step
        else:
            step.notes.append(
                f"residual add {p.name} not folded: its operands do not both match x's shape and dtype"
            )
    y = node.outputs[0]
    users = cons.get(y.uid, [])
    if len(users) == 1 and not y.is_output and users[0].uid not in claimed:
        u = users[0]
        if u.op in _NORM_ACTIVATIONS and u.attrs["params"] == _NORM_ACTIVATIONS[u.op]:
            if "add" in step.fold:
                step.notes.append(f"activation {u.name} not folded: add_{node.op} has no fused activation")
            elif u.outputs[0].dtype != y.dtype:
                step.notes.append(f"activation {u.name} not folded: it changes the dtype")
            else:
                step.fold["activation"] = _NORM_ACT_NAME.get(u.op, u.op)
                step.nodes.append(u)
                claimed[u.uid] = step
        elif u.kind == "pointwise" and OPS[u.op].activation is not None:
            step.notes.append(
                f"activation {u.name} not folded: norms fuse relu, silu, gelu, gelu_tanh, sigmoid "
                "and tanh with default parameters"
            )
    return step


# ---------------------------------------------------------------------------------------------
# 3. Pointwise groups.


def _iteration_shape(nodes: list[Node]) -> tuple[int, ...]:
    shape: tuple[int, ...] = ()
    for n in nodes:
        if n.kind == "pointwise":
            shape = broadcast(shape, n.outputs[0].shape)
    return shape


def _group_pointwise(
    graph: Graph, nodes: list[Node], cons: dict[int, list[Node]], claimed: dict[int, Step], notes: list[str]
) -> list[list[Node]]:
    unit: dict[int, Any] = {uid: ("step", id(s)) for uid, s in claimed.items()}
    for n in graph.nodes:
        unit.setdefault(n.uid, ("node", n.uid))
    members: dict[Any, list[Node]] = {}
    for n in graph.nodes:
        members.setdefault(unit[n.uid], []).append(n)
    pw = {n.uid for n in nodes}
    for n in nodes:
        members.pop(unit[n.uid], None)
        unit[n.uid] = ("group", n.uid)
        members[unit[n.uid]] = [n]
    pairs: list[tuple[Node, Node, str]] = []
    for c in nodes:
        for t in c.inputs:
            if t is not None and t.producer is not None and t.producer.uid in pw:
                pairs.append((t.producer, c, "edge"))
    readers: dict[int, list[Node]] = {}
    for n in nodes:
        for t in n.inputs:
            if t is not None and not t.is_scalar:
                readers.setdefault(t.uid, []).append(n)
    for rs in readers.values():
        first: dict[tuple[int, ...], Node] = {}
        for r in rs:
            head = first.setdefault(r.outputs[0].shape, r)
            if head is not r:
                pairs.append((head, r, "sibling"))
    failures: dict[tuple[int, int], str] = {}
    changed = True
    while changed:
        changed = False
        for a, b, why in pairs:
            ua, ub = unit[a.uid], unit[b.uid]
            if ua == ub:
                continue
            reason = _merge_reason(members[ua], members[ub], ua, ub, unit, members, cons)
            if reason is None:
                for n in members[ub]:
                    unit[n.uid] = ua
                members[ua] = members[ua] + members.pop(ub)
                changed = True
                failures.pop((a.uid, b.uid), None)
            elif why == "edge":
                failures[(a.uid, b.uid)] = f"{a.name} -> {b.name} not fused: {reason}"
    notes += [msg for (a, b), msg in failures.items() if unit[a] != unit[b]]
    groups: dict[Any, list[Node]] = {}
    for n in nodes:
        groups.setdefault(unit[n.uid], []).append(n)
    return list(groups.values())


def _merge_reason(
    ga: list[Node],
    gb: list[Node],
    ua: Any,
    ub: Any,
    unit: dict[int, Any],
    members: dict[Any, list[Node]],
    cons: dict[int, list[Node]],
) -> str | None:
    """Why groups ``ga`` and ``gb`` cannot be one kernel, or None."""
    union = ga + gb
    inside = {n.uid for n in union}
    shape = _iteration_shape(union)
    for n in union:
        t = n.outputs[0]
        stored = t.is_output or any(c.uid not in inside for c in cons.get(t.uid, ()))
        if stored and t.shape != shape:
            return f"'{t.name}' {t.describe()} is needed outside but the kernel would run over {shape}"
        views = n.attrs.get("views") or []
        for i, v in zip(n.inputs, views):
            if v is not None and i is not None and i.producer is not None and i.producer.uid in inside:
                return f"{n.name} reads '{i.name}' reshaped, so it must come from memory"
    reduced = {
        tuple(c.attrs["dim"])
        for n in union
        for c in cons.get(n.outputs[0].uid, ())
        if c.kind == "reduction" and c.inputs[0].shape == shape
    }  # type: ignore[union-attr]
    if len(reduced) > 1:
        return f"the group would feed reductions over different dimensions {sorted(reduced)}"
    succ: dict[Any, set] = {}
    for u_nodes in members.values():
        for n in u_nodes:
            for t in n.outputs:
                for c in cons.get(t.uid, ()):
                    if unit[c.uid] != unit[n.uid]:
                        succ.setdefault(unit[n.uid], set()).add(unit[c.uid])
    for src, dst in ((ua, ub), (ub, ua)):
        stack = [u for u in succ.get(src, ()) if u != dst]
        seen = set(stack)
        while stack:
            u = stack.pop()
            for v in succ.get(u, ()):
                if v == dst:
                    return "another kernel sits between them (fusing would make a cycle)"
                if v not in seen:
                    seen.add(v)
                    stack.append(v)
    return None


def _order(steps: list[Step], claimed: dict[int, Step]) -> list[Step]:
    """Steps in a topological order (Kahn's, earliest graph node first)."""
    index = {id(s): i for i, s in enumerate(steps)}
    deps: dict[int, set[int]] = {i: set() for i in range(len(steps))}
    for i, s in enumerate(steps):
        for t in s.reads():
            if t.producer is not None:
                j = index[id(claimed[t.producer.uid])]
                if j != i:
                    deps[i].add(j)
    done: list[int] = []
    ready = sorted((min(n.uid for n in steps[i].nodes), i) for i in deps if not deps[i])
    placed: set[int] = set()
    while ready:
        _, i = ready.pop(0)
        done.append(i)
        placed.add(i)
        for j, d in deps.items():
            if j not in placed and i in d:
                d.discard(i)
                if not d:
                    ready.append((min(n.uid for n in steps[j].nodes), j))
                    ready.sort()
    if len(done) != len(steps):  # cannot happen for a convex partition; guard against silent loss
        raise RuntimeError("tdnn.Graph: internal error: the partition has a cycle")
    return [steps[i] for i in done]
