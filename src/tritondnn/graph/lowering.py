"""From a generated step (pointwise group, reduction group, concatenation) to its runner.

``lower`` turns a step's nodes into a ``codegen.Structure`` (what the kernel computes) plus the
tensors it loads and stores and where its float arguments come from. ``GeneratedRunner`` binds
the kernel to the planned strides at build time and runs it per execute: a list lookup per
operand, the outputs' allocation and the launch. Operands produced by library calls have
predicted strides only; the runner compares them per call and binds again (once per new
layout) if the prediction was wrong.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from ..core.timing import median_ms
from . import codegen
from .codegen import Structure, bind_pointwise, bind_reduce, broadcast_strides, dtype_str, view_strides
from .partition import Step, _iteration_shape
from .types import GraphTensor, Node, contiguous_strides, is_dense

Layouts = dict[int, tuple[tuple[int, ...], bool]]  # tensor uid -> (strides, known for sure)


@dataclasses.dataclass
class Lowered:
    """A generated step, ready to bind: see the module docstring."""

    structure: Structure
    loads: list[tuple[GraphTensor, tuple[int, ...] | None]]  # tensor and the shape it is viewed as
    floats: list[tuple[str, Any]]  # ("const", value) or ("feed", tensor uid)
    stores: list[GraphTensor]
    reduce_outs: list[GraphTensor]
    shape: tuple[int, ...]
    dims: tuple[int, ...]


def lower(step: Step, writes: list[GraphTensor], compute: torch.dtype) -> Lowered:
    """The structure of a ``"pointwise"`` or ``"reduce"`` step; ``writes`` are the tensors it must
    leave in memory (``Step.writes``)."""
    refs: dict[int, codegen.Ref] = {}
    loads: list[tuple[GraphTensor, tuple[int, ...] | None]] = []
    load_index: dict[tuple, int] = {}
    floats: list[tuple[str, Any]] = []
    body: list[tuple[str, tuple[codegen.Ref, ...], tuple[int, ...]]] = []
    reducers: list[tuple[codegen.Ref, str, str]] = []
    reduce_outs: list[GraphTensor] = []

    def float_ref(kind: str, value: Any) -> codegen.Ref:
        floats.append((kind, value))
        return ("float", len(floats) - 1)

    def operand(t: GraphTensor, view: list[int] | None) -> codegen.Ref:
        if t.uid in refs:
            return refs[t.uid]
        if t.is_scalar:
            return float_ref("const", t.value) if t.value is not None else float_ref("feed", t.uid)
        key = (t.uid, tuple(view) if view else None)
        if key not in load_index:
            load_index[key] = len(loads)
            loads.append((t, key[1]))
        return ("load", load_index[key])

    def emit(op: str, args: tuple[codegen.Ref, ...], params: list[float]) -> codegen.Ref:
        body.append((op, args, tuple(float_ref("const", p)[1] for p in params)))
        return ("value", len(body) - 1)

    for node in step.nodes:
        views = node.attrs.get("views") or [None] * len(node.inputs)
        args = tuple(operand(t, v) for t, v in zip(node.inputs, views) if t is not None)
        if node.kind == "pointwise":
            refs[node.outputs[0].uid] = emit(node.op, args, node.attrs["params"])
        elif node.op == "reduction":
            reducers.append((args[0], node.attrs["mode"], dtype_str(node.outputs[0].dtype)))
            reduce_outs.append(node.outputs[0])
        else:  # genstats: sum(x) and sum(x * x)
            square = emit("square", args, [])
            reducers += [
                (args[0], "add", dtype_str(node.outputs[0].dtype)),
                (square, "add", dtype_str(node.outputs[1].dtype)),
            ]
            reduce_outs += list(node.outputs)
    written = {t.uid for t in writes}
    stores = [n.outputs[0] for n in step.nodes if n.kind == "pointwise" and n.outputs[0].uid in written]
    structure = Structure(
        compute=dtype_str(compute),
        loads=tuple(dtype_str(t.dtype) for t, _ in loads),
        n_floats=len(floats),
        body=tuple(body),
        stores=tuple((refs[t.uid], dtype_str(t.dtype)) for t in stores),
        reducers=tuple(reducers),
    )
    if reducers:
        x = next(n for n in step.nodes if n.kind == "reduction").inputs[0]
        assert x is not None
        shape = x.shape
    else:
        shape = _iteration_shape(step.nodes)
    return Lowered(structure, loads, floats, stores, reduce_outs, shape, step.dims)


def output_layouts(low: Lowered, layouts: Layouts) -> dict[int, tuple[int, ...]]:
    """Strides of the tensors a generated step allocates: full-shape outputs take the layout of a
    dense full-shape input (channels_last stays channels_last), else contiguous; reduction
    outputs are contiguous."""
    like = None
    for t, view in low.loads:
        stride = layouts[t.uid][0]
        if view is None and t.shape == low.shape and is_dense(t.shape, stride):
            like = stride
            break
    out = {t.uid: like or contiguous_strides(t.shape) for t in low.stores}
    out.update({t.uid: contiguous_strides(t.shape) for t in low.reduce_outs})
    return out


class GeneratedRunner:
    """Runs one generated step: ``run(env, device, presets)`` reads its operands from ``env``
    (a list indexed by tensor uid), allocates its outputs (or takes ``presets[uid]``) and
    launches. See the module docstring for strides that are only predicted."""

    def __init__(
        self,
        low: Lowered,
        layouts: Layouts,
        out_strides: dict[int, tuple[int, ...]],
        config: dict[str, int] | None = None,
    ) -> None:
        self.low = low
        # Stored tensors have the iteration shape (the partition's rule; a concatenation's part is a slice).
        self.out_specs = [(t.uid, low.shape, out_strides[t.uid], t.dtype) for t in low.stores]
        self.out_specs += [(t.uid, t.shape, out_strides[t.uid], t.dtype) for t in low.reduce_outs]
        self.load_uids = [t.uid for t, _ in low.loads]
        self.unverified = [i for i, (t, _) in enumerate(low.loads) if not layouts[t.uid][1]]
        self.planned_key = tuple(layouts[t.uid][0] for t, _ in low.loads)
        # Pointwise launch configurations (reductions choose theirs from the shape when binding).
        self.configs = [] if low.structure.reducers else codegen.pointwise_configs(low.structure)
        self.config = config
        self._bound: dict[tuple, Callable[..., None] | None] = {}
        self.access: codegen.Access | None = None
        self.launch = self._bind(self.planned_key)
        self.run = self._make_run()

    def _strides(self, load_strides: tuple) -> list[list[int]]:
        low = self.low
        out = []
        for (t, view), stride in zip(low.loads, load_strides):
            if view is not None:
                out.append(broadcast_strides(low.shape, view, view_strides(view, t.shape, stride)))
            else:
                out.append(broadcast_strides(low.shape, t.shape, stride))
        for uid, shape, stride, _ in self.out_specs:
            if len(shape) == len(low.shape) or not low.dims:
                full = broadcast_strides(low.shape, shape, stride)
            else:  # keepdim=False: the same memory as the keepdim shape
                keep = [1 if d in low.dims else n for d, n in enumerate(low.shape)]
                full = list(contiguous_strides(keep))
            out.append(
                [0 if d in low.dims else s for d, s in enumerate(full)] if uid in self._red_uids else full
            )
        return out

    @property
    def _red_uids(self) -> set[int]:
        return {t.uid for t in self.low.reduce_outs}

    def _bind(self, load_strides: tuple) -> Callable[..., None] | None:
        if load_strides in self._bound:
            return self._bound[load_strides]
        strides = self._strides(load_strides)
        s = self.low.structure
        if s.reducers:
            self.access, launch, self.config = bind_reduce(
                s, self.low.shape, self.low.dims, strides, self.config
            )
        else:
            self.config = self.config or self.configs[0]
            self.access, launch = bind_pointwise(s, self.low.shape, strides, self.config)
        self._bound[load_strides] = launch
        return launch

    def kernel_source(self) -> str | None:
        """The generated Triton source this step launches (None for an empty shape)."""
        if self.access is None or self.launch is None:
            return None
        fn = codegen.cached(self.low.structure, self.access)
        return None if fn is None else fn.source

    def _make_run(self) -> Callable[..., None]:
        load_uids, unverified, out_specs = self.load_uids, self.unverified, self.out_specs
        consts = tuple(v for k, v in self.low.floats if k == "const")
        feeds = any(k == "feed" for k, _ in self.low.floats)
        float_specs = self.low.floats
        planned = self.planned_key
        empty_strided = torch.empty_strided
        launch_planned = self.launch
        allocs = [(shape, stride, dtype) for _, shape, stride, dtype in out_specs]
        out_uids = [uid for uid, _, _, _ in out_specs]

        def run_planned(env: list, device: torch.device, presets: dict | None) -> None:
            """The usual execute: strides as planned, no out= tensors, constant floats; kept
            to the bare allocations and the launch (plan.execute's host time is the bar here)."""
            if presets:
                return run(env, device, presets)
            outs = [empty_strided(size, stride, dtype=dtype, device=device) for size, stride, dtype in allocs]
            launch_planned(*[env[u] for u in load_uids], *outs, *consts)  # type: ignore[misc]
            for uid, o in zip(out_uids, outs):
                env[uid] = o

        def run(env: list, device: torch.device, presets: dict | None) -> None:
            ins = [env[u] for u in load_uids]
            launch = self.launch
            if unverified:
                key = tuple(ins[i].stride() if i in unverified else planned[i] for i in range(len(ins)))
                if key != planned:
                    launch = self._bind(key)
            outs = []
            for uid, shape, stride, dtype in out_specs:
                o = presets.get(uid) if presets else None
                if o is None or o.stride() != stride:
                    o = empty_strided(shape, stride, dtype=dtype, device=device)
                outs.append(o)
            if launch is not None:
                floats = tuple(env[v] if k == "feed" else v for k, v in float_specs) if feeds else consts
                launch(*ins, *outs, *floats)
            for (uid, _, _, _), o in zip(out_specs, outs):
                env[uid] = o

        return run_planned if launch_planned is not None and not unverified and not feeds else run

    def tune(self, env: list, device: torch.device) -> list[tuple[dict[str, int], float]]:
        """Benchmark mode: time every configuration on ``env``'s operands, keep the fastest;
        returns (config, ms) for each that ran."""
        ins = [env[u] for u in self.load_uids]
        key = tuple(t.stride() for t in ins)
        outs = [
            torch.empty_strided(shape, stride, dtype=dtype, device=device)
            for _, shape, stride, dtype in self.out_specs
        ]
        floats = tuple(1.0 if k == "feed" else v for k, v in self.low.floats)
        s = self.low.structure
        configs = self.configs
        if s.reducers:
            dims = self.low.dims
            kept = codegen_numel(tuple(n for d, n in enumerate(self.low.shape) if d not in dims))
            red = codegen_numel(tuple(self.low.shape[d] for d in dims))
            configs = codegen.reduce_configs(s, kept, red, False) + codegen.reduce_configs(s, kept, red, True)
        results = []
        for cfg in configs:
            self.config, self._bound = cfg, {}
            launch = self._bind(key)
            if launch is None:
                return []
            results.append(
                (cfg, median_ms(lambda launch=launch: launch(*ins, *outs, *floats), warmup_ms=2, rep_ms=10))
            )
        best = min(results, key=lambda r: r[1])[0]
        self.config, self._bound = best, {}
        self.launch = self._bind(self.planned_key)
        self.run = self._make_run()
        return results


def codegen_numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def concat_runner(node: Node, layouts: Layouts) -> Callable[..., None]:
    """Concatenation: the output allocated contiguous, one generated copy kernel per operand into
    its slice (strided stores; predicted operand layouts checked per call as above)."""
    out = node.outputs[0]
    dim = node.attrs["dim"]
    out_stride = contiguous_strides(out.shape)
    parts = []
    offset = 0
    for t in node.inputs:
        assert t is not None
        d = dtype_str(t.dtype)
        s = Structure(
            d if d == "float64" else "float32",
            (d,),
            0,
            (("identity", (("load", 0),), ()),),
            ((("value", 0), dtype_str(out.dtype)),),
        )
        low = Lowered(s, [(t, None)], [], [out], [], t.shape, ())
        runner = GeneratedRunner(low, layouts, {out.uid: out_stride})
        parts.append((t.uid, offset, t.shape[dim], runner))
        offset += t.shape[dim]

    def run(env: list, device: torch.device, presets: dict | None) -> None:
        y = presets.get(out.uid) if presets else None
        if y is None or y.stride() != out_stride:
            y = torch.empty_strided(out.shape, out_stride, dtype=out.dtype, device=device)
        for _, start, length, runner in parts:
            runner.run(env, device, {out.uid: y.narrow(dim, start, length)})
        env[out.uid] = y

    run.runners = [p[3] for p in parts]  # type: ignore[attr-defined]
    return run
