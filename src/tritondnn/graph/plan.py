"""``Plan``: a partitioned graph with every kernel prepared, ready to execute.

Everything that does not depend on the data is done in ``Plan.create``: the partition, the
generated kernels (source, compilation, launch arguments for the planned strides), the library
calls' fixed arguments. ``execute`` checks the feeds, then calls each step's runner on a list
indexed by tensor id: per launched kernel a few list reads, the outputs' allocation and the
launch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from ..core.backend import DEVICE_TYPE, INTERPRET, ON_DEVICE_ATTR
from ..core.timing import median_ms
from .graph import Graph
from .lowering import GeneratedRunner, concat_runner, lower, output_layouts
from .partition import Step, consumers_of, partition
from .runners import conv_engines, library_runner, predict_layouts
from .types import GraphTensor, dtype_name, error

# The partitions a plan may run (name -> the partitioner's mode): fast mode runs "fused", fallback
# mode "unfused"; benchmark mode times each (the third where it differs from "fused") and keeps the
# fastest. "fused_prologue" also folds a per-channel scale, shift and ReLU into the next forward
# convolution's input (the implicit GEMM's prologue): not in fast mode, because it measured slower
# than the two kernels apart on an H200 (3x3 64 @56 N64 bf16 NHWC: 132.9 us folded against 87.6
# for four unfused kernels; the implicit GEMM alone 77.0, the boxed GEMM 47.7): every tap
# transforms the pixels it reads again, where a separate pass transforms each once.
VARIANTS = {"fused": "fast", "unfused": "fallback", "fused_prologue": "prologue"}
_LIB_BYTES_PER_US = 2.0e6  # a nominal HBM rate for the cost model (2 TB/s)
_FLOPS_PER_US = 4.0e8  # a nominal tensor-core rate (400 TFLOP/s)
_LAUNCH_US = 4.0
# Input elements a convolution prologue transforms a microsecond: an H200's implicit GEMM took 56
# us longer with one (3x3 64 @56 N64 bf16: 12.8M elements, each read by 9 taps).
_PROLOGUE_PER_US = 2.0e6


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One way to run the graph: ``plan.candidates()`` lists them, best first.

    Attributes:
        name: ``"fused"`` (the partitioner's kernels), ``"unfused"`` (one kernel per node) or
            ``"fused_prologue"`` (``"fused"`` with convolution input prologues, see ``VARIANTS``).
        kernels: steps it launches.
        estimated_us: the cost model's time (bytes moved, flops, launches).
        measured_ms: the median time measured in benchmark mode, else None.
        chosen: this plan runs it.
    """

    name: str
    kernels: int
    estimated_us: float
    measured_ms: float | None
    chosen: bool


class Outputs(dict):
    """``plan.execute``'s result: output tensors by name; a ``GraphTensor`` works as a key too."""

    def __getitem__(self, key: Any) -> torch.Tensor:
        return super().__getitem__(key.name if isinstance(key, GraphTensor) else key)


def _bytes(t: GraphTensor) -> int:
    return 0 if t.is_scalar else t.numel * t.dtype.itemsize


def _flops(step: Step) -> float:
    node = step.main
    if node is None:
        return 0.0
    if node.op == "matmul":
        a = node.inputs[0]
        return 2.0 * node.outputs[0].numel * a.shape[-1]  # type: ignore[union-attr]
    if node.op.startswith("conv"):
        w = node.inputs[1] if node.op != "conv_wgrad" else node.outputs[0]
        y = node.outputs[0] if node.op == "conv_fprop" else node.inputs[0]
        taps = w.numel // max(w.shape[0], 1)  # type: ignore[union-attr]
        return 2.0 * y.numel * taps  # type: ignore[union-attr]
    if node.op.startswith("sdpa"):
        q, k = node.inputs[0], node.inputs[1]
        return 4.0 * q.numel * k.shape[-2] * (2.5 if node.op == "sdpa_backward" else 1.0)  # type: ignore[union-attr]
    return 0.0


def estimate_us(steps: list[Step], cons: dict) -> float:
    """The cost model ranking candidates: bytes each step reads and writes once at a nominal HBM
    rate, flops at a nominal tensor-core rate, plus a fixed cost per launch."""
    total = 0.0
    for s in steps:
        if s.kind == "view":
            continue
        moved = sum(_bytes(t) for t in s.reads()) + sum(_bytes(t) for t in s.writes(cons))
        total += max(moved / _LIB_BYTES_PER_US, _flops(s) / _FLOPS_PER_US) + _LAUNCH_US
        if "prologue" in s.fold:  # every tap transforms the input elements it reads again
            w = s.main.inputs[1]  # type: ignore[union-attr]
            taps = w.numel // max(w.shape[0] * w.shape[1], 1)  # type: ignore[union-attr]
            total += s.fold["prologue"]["x"].numel * taps / _PROLOGUE_PER_US
    return total


class Plan:
    """An executable plan (``Graph.build``). See ``execute``, ``explain``, ``candidates``,
    ``workspace_size``, ``serialize``."""

    def __init__(
        self, graph: Graph, mode: str, variant: str, configs: list | None = None, engines: list | None = None
    ) -> None:
        self.graph = graph
        self.mode = mode
        self.variant = variant
        self._cons = consumers_of(graph)
        self.steps, self.notes = partition(graph, VARIANTS[variant])
        n = len(self.steps)
        self._configs = list(configs) if configs is not None else [None] * n
        self._engines = list(engines) if engines is not None else [None] * n
        self._measured: dict[str, float] = {}
        self._prepare()

    # -----------------------------------------------------------------------------------------
    # Build.

    @classmethod
    def create(cls, graph: Graph, mode: str) -> Plan:
        if mode != "benchmark":
            return cls(graph, mode, "unfused" if mode == "fallback" else "fused")
        feeds = random_feeds(graph)
        timed = []
        for variant in VARIANTS:
            plan = cls(graph, mode, variant)
            if variant == "fused_prologue" and not any("prologue" in s.fold for s in plan.steps):
                continue  # the same partition as "fused"
            plan._tune(feeds)
            timed.append((median_ms(lambda p=plan: p.execute(feeds), warmup_ms=5, rep_ms=25), plan))
        best = min(timed, key=lambda r: r[0])[1]
        best._measured = {p.variant: ms for ms, p in timed}
        return best

    def _prepare(self) -> None:
        graph = self.graph
        layouts: dict[int, tuple[tuple[int, ...], bool]] = {
            t.uid: (t.stride, True) for t in graph.tensors if t.kind == "input"
        }
        self._runners: list[Any] = []
        for i, step in enumerate(self.steps):
            if step.kind in ("pointwise", "reduce"):
                low = lower(step, step.writes(self._cons), graph.compute_dtype)
                out_strides = output_layouts(low, layouts)
                runner = GeneratedRunner(low, layouts, out_strides, self._configs[i])
                self._configs[i] = runner.config
                layouts.update({uid: (st, True) for uid, st in out_strides.items()})
                self._runners.append(runner)
            elif step.kind == "concatenate":
                run = concat_runner(step.nodes[0], layouts)
                out = step.nodes[0].outputs[0]
                layouts[out.uid] = (run.runners[0].out_specs[0][2], True)  # type: ignore[attr-defined]
                self._runners.append(run)
            else:
                self._runners.append(library_runner(step, self._engines[i]))
                if step.kind == "view":
                    layouts.update(self._view_layout(step, layouts))
                else:
                    layouts.update({uid: (st, False) for uid, st in predict_layouts(step, layouts).items()})
        self._runs = tuple(r.run if isinstance(r, GeneratedRunner) else r for r in self._runners)
        # Feed key (name or tensor) -> what execute checks: (tensor, uid, scalar, shape, dtype, stride).
        self._inputs: dict[Any, tuple] = {}
        for t in graph.inputs:
            spec = (t, t.uid, t.is_scalar, torch.Size(t.shape), t.dtype, t.stride)
            self._inputs[t.name] = self._inputs[t] = spec
        self._n_inputs = len(graph.inputs)
        self._outputs = [(t.name, t.uid) for t in graph.outputs]
        self._n_slots = len(graph.tensors)
        self._consts = [(t.uid, t.value) for t in graph.tensors if t.is_scalar and t.value is not None]

    @staticmethod
    def _view_layout(step: Step, layouts: dict) -> dict:
        node = step.main
        assert node is not None
        x = node.inputs[0]
        assert x is not None
        stride, known = layouts[x.uid]
        meta = torch.empty_strided(x.shape, stride, device="meta")
        a = node.attrs
        if node.op == "reshape":
            y = meta.reshape(a["shape"])
        elif node.op == "transpose":
            y = meta.permute(a["dims"])
        else:
            y = meta[(slice(None),) * a["dim"] + (slice(a["start"], a["end"], a["step"]),)]
        out = node.outputs[0]
        return {out.uid: (tuple(y.stride()), known and not out.is_output)}

    def _tune(self, feeds: Mapping) -> None:
        """Benchmark mode: run the steps once on ``feeds``, timing each generated kernel's
        configurations and each convolution engine on the way, and keep the fastest."""
        env, device = self._start(feeds)
        for i, (step, runner) in enumerate(zip(self.steps, self._runners)):
            if isinstance(runner, GeneratedRunner):
                if runner.tune(env, device):
                    self._configs[i] = runner.config
                runner.run(env, device, None)
                continue
            if step.kind in ("conv_fprop", "conv_dgrad", "conv_wgrad"):
                best = None
                for name in conv_engines(step, env):
                    run = library_runner(step, name)
                    try:
                        ms = median_ms(lambda r=run: r(list(env), device, None), warmup_ms=2, rep_ms=10)
                    except Exception:  # an engine that fails to compile or launch is skipped
                        continue
                    if best is None or ms < best[0]:
                        best = (ms, name)
                if best is not None:
                    self._engines[i] = best[1]
                    runner = self._runners[i] = library_runner(step, best[1])
            runner(env, device, None)
        self._runs = tuple(r.run if isinstance(r, GeneratedRunner) else r for r in self._runners)

    # -----------------------------------------------------------------------------------------
    # Execute.

    def _start(self, feeds: Mapping) -> tuple[list, torch.device]:
        if not isinstance(feeds, Mapping):
            raise error(
                "feed", f"feeds must be a mapping of tensors (or names) to values, got {type(feeds).__name__}"
            )
        env: list[Any] = [None] * self._n_slots
        for uid, value in self._consts:
            env[uid] = value
        device = None
        index = -2
        count = 0
        inputs = self._inputs
        for key, value in feeds.items():
            spec = inputs.get(key)
            if spec is None:
                raise error(
                    "feed",
                    f"{getattr(key, 'name', key)!r} is not an input of graph '{self.graph.name}'; "
                    f"inputs: {[i.name for i in self.graph.inputs]}",
                )
            t, uid, scalar, shape, dtype, stride = spec
            if env[uid] is not None:
                raise error("feed", "fed twice (by name and by tensor)", tensor=t)
            if scalar:
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise error(
                        "feed", f"a scalar is fed a Python number, got {type(value).__name__}", tensor=t
                    )
                env[uid] = float(value)
            else:
                if type(value) is not torch.Tensor or value.dtype is not dtype or value.shape != shape:
                    _feed_error(t, value)
                if value.stride() != stride and not _same_layout(t, value):
                    raise error(
                        "layout", f"fed strides {tuple(value.stride())}; declared {t.stride}", tensor=t
                    )
                if not getattr(value, ON_DEVICE_ATTR):
                    raise error("feed", f"is on {value.device}; this backend runs on {DEVICE_TYPE}", tensor=t)
                where = value.get_device()
                if index == -2:
                    index, device = where, value.device
                elif where != index:
                    raise error("feed", f"is on {value.device} but other inputs are on {device}", tensor=t)
                env[uid] = value
            count += 1
        if count != self._n_inputs:
            missing = [t.name for t in self.graph.inputs if env[t.uid] is None]
            raise error("feed", f"missing feeds for inputs {missing}")
        return env, device or torch.device(DEVICE_TYPE)

    def execute(self, feeds: Mapping, out: Mapping | torch.Tensor | None = None) -> Outputs:
        """Run the plan.

        Args:
            feeds: every graph input (``GraphTensor`` or its name) to a torch tensor of its
                declared shape, dtype and strides (runtime scalars to Python numbers).
            out: optional destination tensors for outputs (a mapping, or a tensor when the graph
                has one output) of the outputs' shapes and dtypes; written in place.

        Returns the outputs by name (``Outputs``; a ``GraphTensor`` is a key too).
        Raises ``GraphError`` (rules "feed", "layout", "dtype", "shape") for bad feeds.
        """
        env, device = self._start(feeds)
        presets = self._presets(out) if out is not None else None
        for run in self._runs:
            run(env, device, presets)
        result = Outputs()
        for name, uid in self._outputs:
            result[name] = env[uid]
        if presets:
            for uid, dest in presets.items():
                t = self.graph.tensors[uid]
                if result[t.name] is not dest:
                    dest.copy_(result[t.name])
                    result[t.name] = dest
        return result

    __call__ = execute

    def _presets(self, out: Mapping | torch.Tensor) -> dict[int, torch.Tensor]:
        outputs = self.graph.outputs
        if isinstance(out, torch.Tensor):
            if len(outputs) != 1:
                raise error(
                    "feed", f"out= is one tensor but the graph has {len(outputs)} outputs; give a mapping"
                )
            out = {outputs[0]: out}
        presets = {}
        for key, value in out.items():
            name = key.name if isinstance(key, GraphTensor) else key
            t = next((o for o in outputs if o.name == name), None)
            if t is None:
                raise error("feed", f"out= names {name!r}, not an output of graph '{self.graph.name}'")
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != t.shape or value.dtype != t.dtype:
                _feed_error(t, value, "out= tensor")
            presets[t.uid] = value
        return presets

    # -----------------------------------------------------------------------------------------
    # Introspection.

    @property
    def workspace_size(self) -> int:
        """Bytes of intermediate tensors an execute allocates (virtual tensors written to memory
        that are not outputs; views cost nothing)."""
        total = 0
        for s in self.steps:
            if s.kind != "view":
                total += sum(_bytes(t) for t in s.writes(self._cons) if not t.is_output)
        return total

    def candidates(self) -> list[Candidate]:
        """The ranked ways to run the graph (measured in benchmark mode, else estimated);
        "fused_prologue" only where it folds something ("fused" otherwise)."""
        rows = []
        for variant in VARIANTS:
            steps = self.steps if variant == self.variant else partition(self.graph, VARIANTS[variant])[0]
            if variant == "fused_prologue" and not any("prologue" in s.fold for s in steps):
                continue
            rows.append(
                Candidate(
                    variant,
                    sum(s.kind != "view" for s in steps),
                    round(estimate_us(steps, self._cons), 2),
                    self._measured.get(variant),
                    variant == self.variant,
                )
            )
        return sorted(
            rows, key=lambda c: c.measured_ms if c.measured_ms is not None else c.estimated_us * 1e-3
        )

    def explain(self) -> str:
        """What runs: each kernel with the nodes it computes, its engine or generated kernel and
        configuration, and why nodes did not fuse."""
        kernels = sum(s.kind != "view" for s in self.steps)
        lines = [
            f"Plan for graph '{self.graph.name}': mode {self.mode}, {self.variant}, {kernels} kernel(s), "
            f"workspace {self.workspace_size} bytes"
        ]
        for i, (step, runner) in enumerate(zip(self.steps, self._runners)):
            names = ", ".join(n.name for n in step.nodes)
            writes = ", ".join(t.name for t in step.writes(self._cons))
            if isinstance(runner, GeneratedRunner):
                src = runner.kernel_source()
                kname = src.split("def ", 1)[1].split("(", 1)[0] if src else "(empty: no launch)"
                what = f"generated {step.kind} kernel {kname} {self._configs[i]}"
            elif step.kind == "view":
                what = "view (no kernel)"
            elif step.kind == "concatenate":
                what = f"generated copy kernels ({len(step.nodes[0].inputs)})"
            else:
                engine = self._engines[i] or ("implicit_gemm" if "prologue" in step.fold else "heuristic")
                what = f"{step.kind} [engine: {engine}]" + _fold_text(step)
            lines.append(f"  [{i}] {what}: nodes {names} -> {writes}")
            lines += [f"        {note}" for note in step.notes]
        if self.notes:
            lines.append("  not fused:")
            lines += [f"    {note}" for note in self.notes]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.explain()

    def support_reasons(self) -> list[str]:
        """Why this plan cannot run correctly on this backend (empty: it can)."""
        reasons = []
        if INTERPRET:
            for s in self.steps:
                node = s.main
                dot = node is not None and node.kind in ("matmul", "conv", "attention")
                if dot and any(t is not None and t.dtype == torch.bfloat16 for t in node.inputs):
                    reasons.append(
                        f"{node.name} ({node.op}): bfloat16 matrix products need a GPU (Triton's "
                        "interpreter computes bf16 tl.dot wrongly)"
                    )
        return reasons

    def kernel_sources(self) -> list[str]:
        """The generated Triton sources this plan launches."""
        return [src for r in self._runners if isinstance(r, GeneratedRunner) and (src := r.kernel_source())]

    def serialize(self) -> str:
        """The plan as versioned JSON: the graph, the variant, each step's nodes, generated-kernel
        configuration and engine (see ``graph.serialize.PLAN_SCHEMA``)."""
        from .serialize import plan_to_json

        return plan_to_json(self)

    @classmethod
    def deserialize(cls, text: str | bytes) -> Plan:
        """Rebuild a plan from ``serialize``'s JSON: the graph is rebuilt and partitioned again, the
        steps must match the recorded ones, and the recorded configurations and engines are
        validated and applied. Nothing in the text is executed."""
        from .serialize import plan_from_json

        return plan_from_json(text)


def _fold_text(step: Step) -> str:
    f = step.fold
    parts = []
    if f.get("final") is not None:
        if f["alpha"] != 1.0:
            parts.append(f"alpha {f['alpha']}")
        for key in ("c", "bias", "residual"):
            if f.get(key) is not None:
                parts.append(f"{key} '{f[key].name}'")
        if f.get("activation"):
            parts.append(f"activation {f['activation']}")
    else:
        if f.get("add") is not None:
            parts.append(f"residual add {f['add'].name}")
        if f.get("activation"):
            parts.append(f"activation {f['activation']}")
    text = f" + epilogue ({', '.join(parts)})" if parts else ""
    pro = f.get("prologue")
    if pro is not None:
        what = [f"{key} '{pro[key].name}'" for key in ("scale", "shift") if pro[key] is not None]
        text = (
            f" + prologue on '{pro['x'].name}' ({', '.join(what + (['relu'] if pro['relu'] else []))})" + text
        )
    return text


def _same_layout(t: GraphTensor, value: torch.Tensor) -> bool:
    """Strides equal where they matter: size-1 dimensions' strides are arbitrary."""
    return all(n <= 1 or a == b for n, a, b in zip(t.shape, t.stride, value.stride()))


def _feed_error(t: GraphTensor, value: object, what: str = "feed") -> None:
    if not isinstance(value, torch.Tensor):
        raise error("feed", f"{what} must be a torch.Tensor, got {type(value).__name__}", tensor=t)
    if value.dtype != t.dtype:
        raise error(
            "dtype", f"{what} has dtype {dtype_name(value.dtype)}; declared {dtype_name(t.dtype)}", tensor=t
        )
    if tuple(value.shape) != t.shape:
        raise error("shape", f"{what} has shape {tuple(value.shape)}; declared {t.shape}", tensor=t)
    raise error("feed", f"{what} must be a plain torch.Tensor, got {type(value).__name__}", tensor=t)


def random_feeds(graph: Graph) -> dict[str, Any]:
    """Random inputs of the declared shapes, strides and dtypes (benchmark mode's timing data)."""
    feeds: dict[str, Any] = {}
    for t in graph.inputs:
        if t.is_scalar:
            feeds[t.name] = 0.5
            continue
        size = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride)) if t.numel else 0
        base = torch.randn(size, device=DEVICE_TYPE)
        base = base > 0 if t.dtype == torch.bool else base.to(t.dtype)
        feeds[t.name] = base.as_strided(t.shape, t.stride)
    return feeds
