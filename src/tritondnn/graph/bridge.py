"""``compile_graph``: run a PyTorch function of tensors as a fused operation-graph plan.

>>> def block(x, w, b, gamma, beta):
...     return F.layer_norm(x + F.gelu(F.linear(x, w, b)), (x.shape[-1],), gamma, beta)
>>> fast = tdnn.compile_graph(block)
>>> y = fast(x, w, b, gamma, beta)          # first call per signature: trace, translate, build
>>> y = fast(x, w, b, gamma, beta)          # later calls: a dict lookup and plan.execute
>>> print(fast.explain(x, w, b, gamma, beta))

How it works, per *signature* (the shapes, strides, dtypes and devices of the arguments):

1. Trace ``fn`` with ``torch.fx`` (``_Tracer``). Every traced value carries a meta tensor (shape,
   dtype; no data), so ``x.shape``, ``x.size()``, ``x.ndim`` and ``x.dtype`` are concrete Python
   values during tracing: code that branches on shapes traces, code that branches on data does not.
   tritondnn's functional ops (``tdnn.relu``, ``tdnn.linear``...) are recorded as calls, not traced
   into.
2. Translate each traced call into graph nodes (``_Translator``; the table in ``bridge_ops``). Every
   node's shape and dtype are checked against what PyTorch gives on the meta tensors, so a
   translation never silently changes the result's shape or dtype.
3. ``Graph.build(mode)``; the plan is cached for the signature.

Anything that cannot be translated or built (an op outside the table, in-place ops, data-dependent
control flow, a dtype the graph lacks, bf16 matrix products under the interpreter...) makes that
signature run ``fn`` eagerly instead: a ``GraphFallbackWarning`` says why once, and
``compiled.reason(*args)`` / ``compiled.explain(*args)`` say it again. ``strict=True`` raises
``NotSupportedError`` instead.

Autograd: when grad mode is on and an argument requires grad, the fused plan runs inside a
``torch.autograd.Function`` whose backward *recomputes* ``fn`` eagerly with PyTorch autograd on
detached copies of the saved inputs (fused forward, recomputed backward; double backward works
through the eager recomputation).

Numerics: a fused kernel keeps intermediates in its compute dtype (fp32, fp64 when an input is
fp64) instead of rounding after every op as eager PyTorch does, so low-precision results can
differ from eager ones within the usual tolerance (usually closer to the exact value). Outputs
have PyTorch's shapes and dtypes; their strides are the plan's (contiguous for computed tensors).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from ..core.backend import DEVICE_TYPE, ON_DEVICE_ATTR
from ..core.errors import NotSupportedError
from ..core.library import dynamo_rules_built
from .bridge_ops import _HANDLERS, _META_EQUIVALENT, _T, _Unsupported
from .graph import MODES, Graph
from .plan import Plan
from .types import FLOATS, GraphError, GraphTensor


class GraphFallbackWarning(UserWarning):
    """``compile_graph`` runs a signature eagerly (the message says why)."""


# ---------------------------------------------------------------------------------------------
# Tracing: torch.fx with meta tensors riding along.


def _meta_of(value: Any) -> Any:
    if isinstance(value, fx.Proxy):
        if "error" in value.node.meta:
            raise _Unsupported(value.node.meta["error"])
        return value.node.meta["val"]
    return value


class _ShapedProxy(fx.Proxy):
    """An fx proxy whose shape queries answer with concrete values from its meta tensor."""

    def __getattr__(self, k: str) -> Any:
        meta = self.node.meta.get("val")
        if isinstance(meta, torch.Tensor) and k in ("shape", "ndim", "dtype", "size", "dim", "numel"):
            return getattr(meta, k)
        return super().__getattr__(k)

    def __len__(self) -> int:
        meta = self.node.meta.get("val")
        if isinstance(meta, (torch.Tensor, tuple, list)):
            return len(meta)
        raise _Unsupported("len() of a traced value of unknown length")


class _Tracer(fx.Tracer):
    """Symbolic tracing over meta tensors of the call's arguments (see the module docstring).

    ``tritondnn``'s public functions are wrapped like ``math``'s (recorded, not traced into)."""

    def __init__(self, metas: list[torch.Tensor]) -> None:
        import tritondnn

        super().__init__(autowrap_modules=(math, tritondnn))
        self._metas = metas
        self._placeholders = 0

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _ShapedProxy(node, self)

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None, proxy_factory_fn=None):
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        meta = proxy.node.meta
        try:
            if kind == "placeholder":
                i = self._placeholders
                self._placeholders += 1
                if str(target).startswith("**"):
                    meta["val"] = {}
                elif str(target).startswith("*"):
                    meta["val"] = tuple(self._metas[i:])
                elif i < len(self._metas):
                    meta["val"] = self._metas[i]
                else:
                    meta["val"] = args[0] if args else None  # a parameter left to its default
            elif kind in ("call_function", "call_method"):
                a = fx.node.map_aggregate(args, _meta_of)
                kw = fx.node.map_aggregate(kwargs, _meta_of)
                if kind == "call_method":
                    meta["val"] = getattr(a[0], target)(*a[1:], **kw)
                else:
                    meta["val"] = _META_EQUIVALENT.get(target, target)(*a, **kw)
            else:
                meta["error"] = f"{kind} {target} (module attributes: pass tensors as arguments)"
        except Exception as exc:  # recorded; the translator reports it if the value is used
            meta["error"] = f"{_op_name(kind, target)}: {type(exc).__name__}: {str(exc).splitlines()[0]}"
        return proxy


def _op_name(kind: str, target: Any) -> str:
    if kind == "call_method":
        return f"Tensor.{target}"
    mod = getattr(target, "__module__", None) or ""
    name = getattr(target, "__name__", str(target))
    if mod in ("_operator", "operator"):
        return f"operator.{name}"
    if "tritondnn" in mod:
        return f"tdnn.{name}"
    if mod.startswith("torch.nn.functional") or mod == "torch._C._nn":
        return f"F.{name}"
    return f"{mod}.{name}" if mod else name


# ---------------------------------------------------------------------------------------------
# Compiled functions.


@dataclasses.dataclass
class _Entry:
    """One signature's result: a plan and how to feed it and read it back, or a fallback reason."""

    plan: Plan | None
    feeds: list[tuple[int, str]]  # (argument index, graph input name)
    outputs: list[tuple[str, Any]]  # ("graph", name) | ("input", index) | ("const", value)
    tuple_out: bool
    reason: str | None = None
    fx_graph: fx.Graph | None = None

    def run(self, args: tuple) -> list[torch.Tensor]:
        """The tensor outputs, in order (constants left out)."""
        assert self.plan is not None
        feeds = {}
        for i, name in self.feeds:
            a = args[i]
            feeds[name] = a if type(a) is torch.Tensor and not a.requires_grad else a.detach()
        out = self.plan.execute(feeds)
        return [out[v] if kind == "graph" else args[v] for kind, v in self.outputs if kind != "const"]

    def assemble(self, tensors) -> Any:
        it = iter(tensors)
        values = [v if kind == "const" else next(it) for kind, v in self.outputs]
        return tuple(values) if self.tuple_out else values[0]


class _FusedForward(torch.autograd.Function):
    """Forward: the fused plan. Backward: ``fn`` recomputed eagerly under PyTorch autograd."""

    @staticmethod
    def forward(ctx, fn, entry, *args):
        outs = entry.run(args)
        ctx.fn = fn
        ctx.save_for_backward(*args)
        ctx.mark_non_differentiable(*[o for o in outs if not (o.is_floating_point() or o.is_complex())])
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        saved = ctx.saved_tensors
        needs = ctx.needs_input_grad[2:]
        with torch.enable_grad():
            leaves = [
                x.detach().requires_grad_(bool(n and x.is_floating_point())) for x, n in zip(saved, needs)
            ]
            result = ctx.fn(*leaves)
        outs = [
            o
            for o in (result if isinstance(result, (tuple, list)) else (result,))
            if isinstance(o, torch.Tensor)
        ]
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        wrt = [x for x in leaves if x.requires_grad]
        got: list[torch.Tensor | None] = [None] * len(wrt)
        if pairs and wrt:
            got = list(
                torch.autograd.grad(
                    [o for o, _ in pairs],
                    wrt,
                    [g for _, g in pairs],
                    allow_unused=True,
                    create_graph=torch.is_grad_enabled(),
                )
            )
        it = iter(got)
        dx = []
        for x in leaves:
            g = next(it) if x.requires_grad else None
            dx.append(torch.zeros_like(x) if g is None and x.requires_grad else g)
        return (None, None, *dx)


class CompiledGraph:
    """What ``compile_graph`` returns: call it like ``fn``. See ``explain``, ``plan``, ``reason``,
    ``stats`` (builds, cache hits, fallbacks) and ``clear``."""

    def __init__(self, fn: Callable[..., Any], mode: str, strict: bool) -> None:
        self.fn = fn
        self.mode = mode
        self.strict = strict
        self.stats = {"builds": 0, "hits": 0, "fallbacks": 0}
        self._cache: dict[tuple, _Entry] = {}
        functools.update_wrapper(self, fn)

    def __call__(self, *args: torch.Tensor) -> Any:
        entry = self._entry(args)
        if entry.plan is None:
            return self.fn(*args)
        if torch.is_grad_enabled() and any(a.requires_grad for a in args):
            outs = _FusedForward.apply(self.fn, entry, *args)
        else:
            outs = entry.run(args)
        return entry.assemble(outs)

    def _entry(self, args: tuple) -> _Entry:
        try:
            key = tuple((a.shape, a.stride(), a.dtype, a.device) for a in args)
        except AttributeError:
            bad = next(i for i, a in enumerate(args) if not isinstance(a, torch.Tensor))
            raise TypeError(
                f"compile_graph({self._name}): argument {bad} is a {type(args[bad]).__name__}; "
                "compiled functions take tensors only (bind other arguments with functools.partial "
                "or a closure)"
            ) from None
        entry = self._cache.get(key)
        if entry is not None:
            self.stats["hits"] += 1
            return entry
        entry = self._build(args)
        self._cache[key] = entry
        return entry

    @property
    def _name(self) -> str:
        return getattr(self.fn, "__qualname__", None) or type(self.fn).__name__

    def _build(self, args: tuple) -> _Entry:
        self.stats["builds"] += 1
        fx_graph = None
        try:
            fx_graph = _trace(self.fn, args)
            entry = _Translator(fx_graph, args).translate(self.mode)
        except (_Unsupported, GraphError, NotSupportedError) as exc:
            entry = _Entry(None, [], [], False, str(exc), fx_graph)
        except Exception as exc:  # anything else while translating or building: run eagerly, say why
            entry = _Entry(None, [], [], False, f"{type(exc).__name__}: {exc}", fx_graph)
        if entry.reason is None:
            return entry
        self.stats["fallbacks"] += 1
        if self.strict:
            raise NotSupportedError(
                "graph", f"compile_graph({self._name})", {"compile_graph": [entry.reason]}
            )
        warnings.warn(
            f"compile_graph({self._name}): running eagerly for this signature: {entry.reason}",
            GraphFallbackWarning,
            stacklevel=4,
        )
        return entry

    def plan(self, *args: torch.Tensor) -> Plan | None:
        """The plan for these arguments' signature (built if needed), or None when it runs eagerly."""
        return self._entry(args).plan

    def reason(self, *args: torch.Tensor) -> str | None:
        """Why this signature runs eagerly, or None when it runs a fused plan."""
        return self._entry(args).reason

    def explain(self, *args: torch.Tensor) -> str:
        """The plan's ``explain`` for this signature, or why it runs eagerly."""
        entry = self._entry(args)
        if entry.plan is None:
            return f"compile_graph({self._name}): eager fallback: {entry.reason}"
        return f"compile_graph({self._name}): fused forward, recomputed backward\n{entry.plan.explain()}"

    def clear(self) -> None:
        """Forget every signature's plan."""
        self._cache.clear()

    def __repr__(self) -> str:
        return f"CompiledGraph({self._name}, mode={self.mode!r}, signatures={len(self._cache)})"


def compile_graph(fn: Callable[..., Any], *, mode: str = "fast", strict: bool = False) -> CompiledGraph:
    """Compile a function of tensors into fused operation-graph plans, one per signature.

    Args:
        fn: a function of tensor arguments returning a tensor or a tuple of tensors (numbers in
            the tuple are returned as they are). Other inputs: close over them.
        mode: ``Graph.build``'s mode (``"fast"``, ``"benchmark"``, ``"fallback"``).
        strict: raise ``NotSupportedError`` when a signature cannot be compiled, instead of running
            ``fn`` eagerly with a ``GraphFallbackWarning``.

    Supported inside ``fn``: ``+ - * / **`` (tensors and numbers), ``torch.add/sub/mul/div`` (alpha),
    neg, exp, log, sqrt, rsqrt, abs, reciprocal, square, erf, sin, cos, floor, ceil, pow,
    ``torch.maximum/minimum``, clamp, ``torch.where``, comparisons, logical and/or/not, the
    activations (``F.relu/relu6/leaky_relu/elu/gelu/silu/sigmoid/tanh/softplus``, their torch and
    ``tdnn`` forms), ``@``/``torch.matmul``/mm/bmm, ``F.linear`` (and ``tdnn.linear``/``tdnn.matmul``
    without extras), ``F.layer_norm``/``F.rms_norm`` (and ``tdnn``'s, with ``activation``),
    ``softmax``, sum/mean/amax/amin/max/min/prod over dims (``keepdim``), reshape/view/flatten/
    squeeze/unsqueeze, basic indexing (slices, ints, None, ...), transpose/permute/``.T``/``.mT``/``t``,
    contiguous, clone, dtype casts;
    shape queries are concrete. See the module docstring for fallback and autograd.
    """
    if not callable(fn):
        raise TypeError(f"compile_graph: fn must be callable, got {type(fn).__name__}")
    if mode not in MODES:
        raise ValueError(f"compile_graph: mode={mode!r}; accepted: {', '.join(MODES)}")
    if not isinstance(strict, bool):
        raise TypeError(f"compile_graph: strict must be a bool, got {type(strict).__name__}")
    return CompiledGraph(fn, mode, strict)


def _trace(fn: Callable[..., Any], args: tuple) -> fx.Graph:
    dynamo_rules_built()
    metas = [torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta") for a in args]
    try:
        graph = _Tracer(metas).trace(fn)
    except _Unsupported:
        raise
    except Exception as exc:
        first = (str(exc).splitlines() or [""])[0]
        raise _Unsupported(f"torch.fx could not trace it ({type(exc).__name__}: {first})") from None
    graph.eliminate_dead_code()
    return graph


# ---------------------------------------------------------------------------------------------
# Translation.


class _Translator:
    def __init__(self, fx_graph: fx.Graph, args: tuple) -> None:
        self.fx_graph = fx_graph
        self.args = args
        floats = [a.dtype for a in args if a.dtype in FLOATS]
        compute = torch.float64 if torch.float64 in floats else torch.float32
        self.g = Graph(
            io_dtype=floats[0] if floats else torch.float32, compute_dtype=compute, name="compiled"
        )
        self.feeds: list[tuple[int, str]] = []

    def gt(self, v: Any) -> GraphTensor:
        if not isinstance(v, _T):
            raise _Unsupported(f"expected a tensor, got {type(v).__name__}")
        if v.gt is None:
            a = self.args[v.arg]
            if not getattr(a, ON_DEVICE_ATTR):
                raise _Unsupported(f"argument {v.arg} is on {a.device}; this backend runs on {DEVICE_TYPE}")
            if a.dtype not in (*FLOATS, torch.bool):
                raise _Unsupported(
                    f"argument {v.arg} has dtype {a.dtype}; the graph takes float and bool tensors"
                )
            v.gt = self.g.tensor(tuple(a.shape), tuple(a.stride()), a.dtype, name=f"arg{v.arg}")
            self.feeds.append((v.arg, v.gt.name))
        return v.gt

    def operand(self, v: Any) -> GraphTensor | float:
        if isinstance(v, _T):
            return self.gt(v)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return v
        if isinstance(v, bool):
            return float(v)
        raise _Unsupported(f"operand of type {type(v).__name__}")

    def translate(self, mode: str) -> _Entry:
        env: dict[fx.Node, Any] = {}
        output = None
        for node in self.fx_graph.nodes:
            if node.op == "output":
                output = node.args[0]
                break
            if "error" in node.meta:
                raise _Unsupported(node.meta["error"])
            if "val" not in node.meta:
                raise _Unsupported(
                    f"{node.op} {node.target}: a tensor captured from outside fn (pass it as an argument)"
                )
            meta = node.meta["val"]
            if node.op == "placeholder":
                env[node] = _wrap_placeholder(meta, len(env))
                continue
            args = fx.node.map_arg(node.args, lambda n: env[n])
            kwargs = fx.node.map_arg(node.kwargs, lambda n: env[n])
            env[node] = self.call(node, meta, args, kwargs)
        return self.finish(output, env, mode)

    def call(self, node: fx.Node, meta: Any, args: tuple, kwargs: dict) -> Any:
        has_t = any(isinstance(v, _T) for v in _flat((args, kwargs)))
        name = _op_name(node.op, node.target)
        if not has_t and not _holds_tensor(meta):
            return meta  # Python arithmetic on concrete values: already computed on the metas
        if node.target is operator.getitem and isinstance(args[0], (tuple, list)):
            return args[0][args[1]]
        key = ("method", node.target) if node.op == "call_method" else node.target
        handler = _HANDLERS.get(key)
        if handler is None:
            raise _Unsupported(f"{name} is not supported by compile_graph")
        if not isinstance(meta, torch.Tensor):
            raise _Unsupported(f"{name} returning {type(meta).__name__} is not supported")
        try:
            out = handler(self, meta, *args, **kwargs)
        except TypeError as exc:
            raise _Unsupported(f"{name}: {exc}") from None
        except GraphError as exc:
            raise _Unsupported(f"{name}: {exc}") from None
        if isinstance(out, _T):
            return out
        if out.shape != tuple(meta.shape) or out.dtype != meta.dtype:
            raise _Unsupported(
                f"{name}: the graph gives {out.describe()} where PyTorch gives "
                f"{tuple(meta.shape)} {str(meta.dtype).removeprefix('torch.')}"
            )
        return _T(meta, out)

    def finish(self, output: Any, env: dict, mode: str) -> _Entry:
        tuple_out = isinstance(output, (tuple, list))
        values = [env[v] if isinstance(v, fx.Node) else v for v in (output if tuple_out else [output])]
        outputs: list[tuple[str, Any]] = []
        for v in values:
            if isinstance(v, _T) and v.gt is not None and v.gt.producer is not None:
                self.g.set_output(v.gt)
                outputs.append(("graph", v.gt.name))
            elif isinstance(v, _T) and v.arg is not None:
                outputs.append(("input", v.arg))
            elif isinstance(v, (int, float, bool)) or v is None:
                outputs.append(("const", v))
            else:
                raise _Unsupported(f"fn returns a {type(v).__name__}; return a tensor or a tuple of tensors")
        if not self.g.outputs:
            raise _Unsupported("fn computes nothing to fuse (it returns its inputs or constants)")
        plan = self.g.build(mode)
        reasons = plan.support_reasons()
        if reasons:
            raise _Unsupported("; ".join(reasons))
        return _Entry(plan, list(self.feeds), outputs, tuple_out, None, self.fx_graph)


def _wrap_placeholder(meta: Any, index: int) -> Any:
    if isinstance(meta, torch.Tensor):
        return _T(meta, None, index)
    if isinstance(meta, tuple):  # *args: the remaining arguments
        return tuple(_T(m, None, index + i) for i, m in enumerate(meta))
    return meta


def _flat(value: Any) -> list:
    out: list = []
    fx.node.map_aggregate(value, lambda v: out.append(v) or v)
    return out


def _holds_tensor(meta: Any) -> bool:
    return any(isinstance(v, torch.Tensor) for v in _flat(meta))


__all__ = ["CompiledGraph", "GraphFallbackWarning", "compile_graph"]
