"""Versioned JSON for graphs and plans.

A graph is written as its inputs and scalars (``tensors``), its nodes in order (operation,
operands by tensor name, attributes, the names of the outputs they make) and its outputs; virtual
tensors are not written, they are made again by the builders. A plan adds the variant and, per
step, its nodes, generated-kernel configuration and engine.

Reading is defensive: the text is parsed by ``json`` (no pickle, no eval, NaN/Infinity literals
refused), every field is checked against the schema below by hand (types, sizes, names, known
operations and attribute names), then each node goes through its builder so every graph rule is
checked as when it was first built. Generated kernels are regenerated from the validated
structure; no code is ever read from the file. Anything wrong raises ``GraphError`` with rule
``"format"`` (or the graph rule the content breaks).
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

import torch

from .graph import MODES, Graph
from .nodes import OPS
from .partition import partition
from .types import DTYPE_NAMES, MAX_RANK, GraphError, dtype_name, error

if TYPE_CHECKING:
    from .plan import Plan

VERSION = 1
MAX_BYTES = 16 << 20
MAX_ITEMS = 100_000
MAX_NAME = 256
MAX_DIM = 1 << 48

# Attribute names each library operation's record may carry (pointwise: params, views).
ATTRS: dict[str, tuple[str, ...]] = {
    "matmul": (),
    "conv_fprop": ("stride", "padding", "dilation", "groups"),
    "conv_dgrad": ("stride", "padding", "dilation", "groups", "x_shape"),
    "conv_wgrad": ("stride", "padding", "dilation", "groups", "w_shape"),
    "reduction": ("mode", "dim", "keepdim"),
    "batchnorm": ("eps", "momentum"),
    "batchnorm_inference": ("params", "views"),
    "layernorm": ("normalized_shape", "eps", "training"),
    "rmsnorm": ("normalized_shape", "eps", "training"),
    "instancenorm": ("eps", "training"),
    "layernorm_backward": ("normalized_shape",),
    "rmsnorm_backward": ("normalized_shape",),
    "batchnorm_backward": (),
    "instancenorm_backward": (),
    "genstats": ("dim",),
    "sdpa": ("is_causal", "scale", "enable_gqa", "return_stats"),
    "sdpa_backward": ("is_causal", "scale", "enable_gqa"),
    "pool": ("mode", "kernel_size", "stride", "padding", "dilation", "ceil_mode", "count_include_pad"),
    "resample": ("mode", "size", "scale_factor", "align_corners"),
    "reshape": ("shape",),
    "transpose": ("dims",),
    "slice": ("dim", "start", "end", "step"),
    "concatenate": ("dim",),
}
_TYPED = ("matmul", "conv_fprop", "reduction", "batchnorm_inference")  # builders taking dtype=

_NAME = {"type": "string", "minLength": 1, "maxLength": MAX_NAME}
_INTS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "maxItems": MAX_RANK}
GRAPH_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "tritondnn graph",
    "type": "object",
    "required": [
        "format",
        "version",
        "name",
        "io_dtype",
        "compute_dtype",
        "intermediate_dtype",
        "tensors",
        "nodes",
        "outputs",
    ],
    "additionalProperties": False,
    "properties": {
        "format": {"const": "tritondnn.graph"},
        "version": {"const": VERSION},
        "name": _NAME,
        "io_dtype": {"enum": list(DTYPE_NAMES)},
        "compute_dtype": {"enum": ["float32", "float64"]},
        "intermediate_dtype": {"enum": list(DTYPE_NAMES)},
        "tensors": {
            "type": "array",
            "maxItems": MAX_ITEMS,
            "items": {
                "type": "object",
                "required": ["name", "kind", "dtype"],
                "additionalProperties": False,
                "properties": {
                    "name": _NAME,
                    "kind": {"enum": ["input", "scalar"]},
                    "dtype": {"enum": list(DTYPE_NAMES)},
                    "shape": _INTS,
                    "stride": _INTS,
                    "value": {"type": ["number", "null"]},
                },
            },
        },
        "nodes": {
            "type": "array",
            "maxItems": MAX_ITEMS,
            "items": {
                "type": "object",
                "required": ["name", "op", "inputs", "attrs", "outputs"],
                "additionalProperties": False,
                "properties": {
                    "name": _NAME,
                    "op": {"enum": sorted(set(OPS) | set(ATTRS))},
                    "inputs": {
                        "type": "object",
                        "additionalProperties": {"anyOf": [_NAME, {"type": "null"}]},
                    },
                    "attrs": {"type": "object"},
                    "dtype": {"enum": list(DTYPE_NAMES)},
                    "outputs": {"type": "array", "items": _NAME},
                },
            },
        },
        "outputs": {"type": "array", "items": _NAME},
    },
}
PLAN_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "tritondnn plan",
    "type": "object",
    "required": ["format", "version", "graph", "mode", "variant", "steps"],
    "additionalProperties": False,
    "properties": {
        "format": {"const": "tritondnn.plan"},
        "version": {"const": VERSION},
        "graph": GRAPH_SCHEMA,
        "mode": {"enum": list(MODES)},
        "variant": {"enum": ["fused", "unfused", "fused_prologue"]},
        "steps": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["kind", "nodes", "config", "engine"],
                "additionalProperties": False,
                "properties": {
                    "kind": {"type": "string"},
                    "nodes": {"type": "array", "items": _NAME},
                    "config": {"type": ["object", "null"], "additionalProperties": {"type": "integer"}},
                    "engine": {"type": ["string", "null"]},
                },
            },
        },
    },
}


def _fail(message: str) -> GraphError:
    return error("format", message)


# ---------------------------------------------------------------------------------------------
# Writing.


def _encode(value: Any) -> Any:
    """Attributes as JSON values: non-finite floats as {"float": "inf" | "-inf" | "nan"}."""
    if isinstance(value, float) and not math.isfinite(value):
        return {"float": repr(value)}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    return value


def graph_to_dict(g: Graph) -> dict[str, Any]:
    tensors = []
    for t in g.tensors:
        if t.kind == "input":
            tensors.append(
                {
                    "name": t.name,
                    "kind": "input",
                    "dtype": dtype_name(t.dtype),
                    "shape": list(t.shape),
                    "stride": list(t.stride),
                }
            )
        elif t.is_scalar:
            tensors.append({"name": t.name, "kind": "scalar", "dtype": dtype_name(t.dtype), "value": t.value})
    nodes = []
    for n in g.nodes:
        record = {
            "name": n.name,
            "op": n.op,
            "inputs": {s: (t.name if t is not None else None) for s, t in zip(n.slots, n.inputs)},
            "attrs": _encode(n.attrs),
            "outputs": [t.name for t in n.outputs],
        }
        if n.kind == "pointwise" or n.op in _TYPED:
            record["dtype"] = dtype_name(n.outputs[0].dtype)
        nodes.append(record)
    return {
        "format": "tritondnn.graph",
        "version": VERSION,
        "name": g.name,
        "io_dtype": dtype_name(g.io_dtype),
        "compute_dtype": dtype_name(g.compute_dtype),
        "intermediate_dtype": dtype_name(g.intermediate_dtype),
        "tensors": tensors,
        "nodes": nodes,
        "outputs": [t.name for t in g.outputs],
    }


def graph_to_json(g: Graph) -> str:
    return json.dumps(graph_to_dict(g), indent=1, allow_nan=False)


def plan_to_json(plan: Plan) -> str:
    steps = [
        {"kind": s.kind, "nodes": [n.name for n in s.nodes], "config": cfg, "engine": eng}
        for s, cfg, eng in zip(plan.steps, plan._configs, plan._engines)
    ]
    payload = {
        "format": "tritondnn.plan",
        "version": VERSION,
        "graph": graph_to_dict(plan.graph),
        "mode": plan.mode,
        "variant": plan.variant,
        "steps": steps,
    }
    return json.dumps(payload, indent=1, allow_nan=False)


# ---------------------------------------------------------------------------------------------
# Reading.


def _parse(text: str | bytes, what: str) -> Any:
    if isinstance(text, bytes):
        if len(text) > MAX_BYTES:
            raise _fail(f"{what} is {len(text)} bytes; at most {MAX_BYTES}")
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _fail(f"{what} is not UTF-8 text: {exc}") from None
    if not isinstance(text, str):
        raise _fail(f"{what} must be a str or bytes, got {type(text).__name__}")
    if len(text) > MAX_BYTES:
        raise _fail(f"{what} is {len(text)} characters; at most {MAX_BYTES}")

    def no_constants(name: str) -> Any:
        raise ValueError(f"the non-standard JSON constant {name} is not accepted")

    try:
        return json.loads(text, parse_constant=no_constants)
    except RecursionError:
        raise _fail(f"{what} nests too deeply") from None
    except ValueError as exc:  # JSONDecodeError included: truncated or malformed text
        raise _fail(f"{what} is not valid JSON: {exc}") from None


def _obj(value: Any, where: str, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _fail(f"{where} must be an object, got {type(value).__name__}")
    missing = [k for k in required if k not in value]
    extra = [k for k in value if k not in required and k not in optional]
    if missing or extra:
        raise _fail(f"{where}: missing fields {missing}, unknown fields {extra}")
    return value


def _str(value: Any, where: str, choices: Any = None) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_NAME:
        raise _fail(f"{where} must be a non-empty string of at most {MAX_NAME} characters")
    if choices is not None and value not in choices:
        raise _fail(f"{where}={value!r} is not one of {sorted(choices)}")
    return value


def _list(value: Any, where: str, limit: int = MAX_ITEMS) -> list[Any]:
    if not isinstance(value, list) or len(value) > limit:
        raise _fail(f"{where} must be a list of at most {limit} items")
    return value


def _int_list(value: Any, where: str) -> list[int]:
    items = _list(value, where, MAX_RANK)
    if not all(type(v) is int and 0 <= v < MAX_DIM for v in items):
        raise _fail(f"{where} must be a list of ints in [0, 2**48)")
    return items


def _version(data: dict[str, Any], fmt: str) -> None:
    if data.get("format") != fmt:
        raise _fail(f"not a {fmt} document (format={data.get('format')!r})")
    version = data.get("version")
    if type(version) is not int or version != VERSION:
        raise _fail(f"unsupported version {version!r}; this tritondnn reads version {VERSION}")


def _decode(value: Any, depth: int = 0) -> Any:
    """Attribute values: JSON scalars, lists of them (two levels deep at most), encoded floats."""
    if depth > 3:
        raise _fail("attribute values nest too deeply")
    if isinstance(value, dict):
        if set(value) == {"float"} and value["float"] in ("inf", "-inf", "nan"):
            return float(value["float"])
        raise _fail(f"unexpected object {value!r} in attributes")
    if isinstance(value, list):
        return [_decode(v, depth + 1) for v in _list(value, "attribute list", 64)]
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, str) and len(value) <= MAX_NAME:
        return value
    raise _fail(f"unexpected attribute value {value!r}")


def graph_from_dict(data: Any) -> Graph:
    data = _obj(
        data,
        "graph",
        (
            "format",
            "version",
            "name",
            "io_dtype",
            "compute_dtype",
            "intermediate_dtype",
            "tensors",
            "nodes",
            "outputs",
        ),
    )
    _version(data, "tritondnn.graph")
    dt = {
        k: DTYPE_NAMES[_str(data[k], k, DTYPE_NAMES)]
        for k in ("io_dtype", "compute_dtype", "intermediate_dtype")
    }
    g = Graph(dt["io_dtype"], dt["compute_dtype"], dt["intermediate_dtype"], _str(data["name"], "name"))
    for i, rec in enumerate(_list(data["tensors"], "tensors")):
        where = f"tensors[{i}]"
        kind = _str(
            _obj(rec, where, ("name", "kind", "dtype"), ("shape", "stride", "value"))["kind"],
            f"{where}.kind",
            ("input", "scalar"),
        )
        name, dtype = (
            _str(rec["name"], f"{where}.name"),
            DTYPE_NAMES[_str(rec["dtype"], f"{where}.dtype", DTYPE_NAMES)],
        )
        if kind == "input":
            _obj(rec, where, ("name", "kind", "dtype", "shape", "stride"))
            g.tensor(
                _int_list(rec["shape"], f"{where}.shape"),
                _int_list(rec["stride"], f"{where}.stride"),
                dtype,
                name,
            )
        else:
            _obj(rec, where, ("name", "kind", "dtype", "value"))
            value = rec["value"]
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise _fail(f"{where}.value must be a number or null")
            g.scalar(value, dtype, name)
    for i, rec in enumerate(_list(data["nodes"], "nodes")):
        _node(g, rec, f"nodes[{i}]")
    for i, name in enumerate(_list(data["outputs"], "outputs")):
        t = _tensor(g, _str(name, f"outputs[{i}]"), f"outputs[{i}]")
        g.set_output(t)
    return g


def _tensor(g: Graph, name: str, where: str) -> Any:
    try:
        return g[name]
    except KeyError:
        raise _fail(
            f"{where} names tensor {name!r}, which no input or earlier node makes "
            "(a reference to a later node's output would be a cycle)"
        ) from None


def _node(g: Graph, rec: Any, where: str) -> None:
    rec = _obj(rec, where, ("name", "op", "inputs", "attrs", "outputs"), ("dtype",))
    name = _str(rec["name"], f"{where}.name")
    op = _str(rec["op"], f"{where}.op", set(OPS) | set(ATTRS))
    inputs = _obj(
        rec["inputs"], f"{where}.inputs", tuple(rec["inputs"]) if isinstance(rec["inputs"], dict) else ()
    )
    if len(inputs) > 64:
        raise _fail(f"{where}.inputs has too many operands")
    ins = {
        s: None if v is None else _tensor(g, _str(v, f"{where}.inputs.{s}"), f"{where}.inputs.{s}")
        for s, v in inputs.items()
    }
    attrs = rec["attrs"]
    if not isinstance(attrs, dict):
        raise _fail(f"{where}.attrs must be an object")
    allowed = ("params",) if op in OPS and op != "batchnorm_inference" else ATTRS[op]
    extra = set(attrs) - set(allowed)
    if extra:
        raise _fail(f"{where}: unknown attributes {sorted(extra)} for {op}; accepted: {list(allowed)}")
    a = {k: _decode(v) for k, v in attrs.items()}
    dtype = DTYPE_NAMES[_str(rec["dtype"], f"{where}.dtype", DTYPE_NAMES)] if "dtype" in rec else None
    try:
        outs = _build(g, op, name, list(ins.values()), ins, a, dtype)
    except GraphError:
        raise
    except (TypeError, ValueError, KeyError, IndexError) as exc:
        raise _fail(f"{where} ({op}) cannot be rebuilt: {type(exc).__name__}: {exc}") from None
    outs = outs if isinstance(outs, tuple) else (outs,)
    names = _list(rec["outputs"], f"{where}.outputs", 16)
    if [t.name for t in outs] != names:
        raise _fail(f"{where}: rebuilt outputs {[t.name for t in outs]} differ from the recorded {names}")


def _build(g: Graph, op: str, name: str, ops: list, ins: dict, a: dict, dtype: torch.dtype | None) -> Any:
    """Call the builder the record describes."""
    if op in OPS and op != "batchnorm_inference":
        spec = OPS[op]
        params = a.get("params", list(spec.defaults))
        if not isinstance(params, list) or len(params) != len(spec.params):
            raise _fail(f"node '{name}': {op} takes parameters {list(spec.params)}")
        return g.pointwise(op, *ops, dtype=dtype, name=name, **dict(zip(spec.params, params)))
    if op == "batchnorm_inference":
        return g.batchnorm_inference(*ops, dtype=dtype, name=name)
    geo = {k: a[k] for k in ("stride", "padding", "dilation", "groups") if k in a}
    if op == "matmul":
        return g.matmul(*ops, dtype=dtype, name=name)
    if op == "conv_fprop":
        return g.conv_fprop(*ops, **geo, dtype=dtype, name=name)
    if op == "conv_dgrad":
        return g.conv_dgrad(*ops, a.get("x_shape"), **geo, name=name)
    if op == "conv_wgrad":
        return g.conv_wgrad(*ops, _int_list(a.get("w_shape"), "w_shape")[2:], **geo, name=name)
    if op == "reduction":
        return g.reduction(
            *ops, a.get("mode"), a.get("dim"), keepdim=a.get("keepdim"), dtype=dtype, name=name
        )
    if op == "batchnorm":
        return g.batchnorm(*ops, eps=a.get("eps"), momentum=a.get("momentum"), name=name)
    # "training" is absent from documents written before it existed (and whenever it is false).
    training = a.get("training", False)
    if op in ("layernorm", "rmsnorm"):
        fn = g.layernorm if op == "layernorm" else g.rmsnorm
        return fn(
            *ops, normalized_shape=a.get("normalized_shape"), eps=a.get("eps"), training=training, name=name
        )
    if op == "instancenorm":
        return g.instancenorm(*ops, eps=a.get("eps"), training=training, name=name)
    if op in ("layernorm_backward", "rmsnorm_backward"):
        fn = g.layernorm_backward if op == "layernorm_backward" else g.rmsnorm_backward
        return fn(*ops, normalized_shape=a.get("normalized_shape"), name=name)
    if op in ("batchnorm_backward", "instancenorm_backward"):
        return (g.batchnorm_backward if op == "batchnorm_backward" else g.instancenorm_backward)(
            *ops, name=name
        )
    if op == "genstats":
        return g.genstats(*ops, name=name)
    if op in ("sdpa", "sdpa_backward"):
        fn = g.sdpa if op == "sdpa" else g.sdpa_backward
        return fn(*ops, **{k: a[k] for k in ATTRS[op] if k in a}, name=name)
    if op == "pool":
        return g.pool(
            *ops,
            a.get("mode"),
            a.get("kernel_size"),
            a.get("stride"),
            a.get("padding"),
            **{k: a[k] for k in ("dilation", "ceil_mode", "count_include_pad") if k in a},
            name=name,
        )
    if op == "resample":
        return g.resample(
            *ops,
            a.get("size"),
            a.get("scale_factor"),
            mode=a.get("mode"),
            align_corners=a.get("align_corners"),
            name=name,
        )
    if op == "reshape":
        return g.reshape(
            *ops,
            _int_list(a.get("shape"), "shape") if -1 not in (a.get("shape") or []) else a["shape"],
            name=name,
        )
    if op == "transpose":
        return g.permute(*ops, a.get("dims"), name=name)
    if op == "slice":
        return g.slice(*ops, a.get("dim"), a.get("start"), a.get("end"), a.get("step", 1), name=name)
    return g.concatenate(ops, a.get("dim"), name=name)


def graph_from_json(text: str | bytes) -> Graph:
    return graph_from_dict(_parse(text, "graph JSON"))


_CONFIG_KEYS = {"pointwise": ("BLOCK", "num_warps"), "reduce": ("BLOCK_M", "BLOCK_K", "num_warps")}
_CONFIG_RANGE = {"BLOCK": (64, 65536), "BLOCK_M": (1, 4096), "BLOCK_K": (1, 4096), "num_warps": (1, 32)}


def plan_from_json(text: str | bytes) -> Plan:
    from ..ops.conv import DGRAD_FAMILY, FAMILY, WGRAD_FAMILY
    from .plan import VARIANTS, Plan

    data = _obj(_parse(text, "plan JSON"), "plan", ("format", "version", "graph", "mode", "variant", "steps"))
    _version(data, "tritondnn.plan")
    mode = _str(data["mode"], "mode", MODES)
    variant = _str(data["variant"], "variant", VARIANTS)
    g = graph_from_dict(data["graph"])
    g.validate()
    records = _list(data["steps"], "steps")
    configs, engines = [], []
    conv_engines = {"conv_fprop": FAMILY, "conv_dgrad": DGRAD_FAMILY, "conv_wgrad": WGRAD_FAMILY}
    for i, rec in enumerate(records):
        where = f"steps[{i}]"
        rec = _obj(rec, where, ("kind", "nodes", "config", "engine"))
        kind = _str(rec["kind"], f"{where}.kind")
        cfg = rec["config"]
        if cfg is not None:
            keys = _CONFIG_KEYS.get(kind)
            if keys is None or not isinstance(cfg, dict) or sorted(cfg) != sorted(keys):
                raise _fail(f"{where}.config must be null or {{{', '.join(keys or ())}}} for a {kind} step")
            for k, v in cfg.items():
                lo, hi = _CONFIG_RANGE[k]
                if type(v) is not int or not lo <= v <= hi or v & (v - 1):
                    raise _fail(f"{where}.config.{k}={v!r} must be a power of two in [{lo}, {hi}]")
        engine = rec["engine"]
        if engine is not None:
            family = conv_engines.get(kind)
            names = [e.name for e in family.engines] if family is not None else []
            if _str(engine, f"{where}.engine") not in names:
                raise _fail(f"{where}.engine={engine!r}; a {kind} step accepts {names or 'none'}")
        configs.append(cfg)
        engines.append(engine)
    steps, _ = partition(g, VARIANTS[variant])
    got = [(s.kind, [n.name for n in s.nodes]) for s in steps]
    want = [(r["kind"], r["nodes"]) for r in records]
    if got != want:
        raise _fail(f"the recorded steps {want} do not match the graph's partition {got}")
    for i, (step, engine) in enumerate(zip(steps, engines)):
        if "prologue" in step.fold and engine not in (None, "implicit_gemm"):
            raise _fail(
                f"steps[{i}].engine={engine!r}; a convolution with a prologue runs on 'implicit_gemm' only"
            )
    return Plan(g, mode, variant, configs, engines)
