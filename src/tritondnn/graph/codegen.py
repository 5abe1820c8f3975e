"""Triton source generation for fused pointwise (and pointwise + reduction) groups.

A group's ``Structure`` says what the kernel computes: which tensors it loads (dtypes), its float
arguments, the pointwise ops in order with their operands, what it stores and what it reduces.
An ``Access`` says how it walks memory: how many (collapsed) dimensions, and which tensors are
read at the flat index itself. Both are plain hashable tuples, so ``kernel(structure, access)``
caches the generated function: a second graph of the same structure generates and compiles
nothing (``STATS`` counts both).

The source text is built here from those tuples only, registered with ``linecache`` (Triton
reads a kernel's source through ``inspect``) and compiled with ``exec`` into a fresh namespace
holding ``kernel_lib.GLOBALS``; no text from elsewhere is ever executed.

Kernel parameters follow ``core.launcher``'s order: tensors (loads, then stores, then reduction
outputs), floats (scalars and op parameters), ints (sizes and strides), constexprs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import linecache
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..core.backend import INTERPRET
from ..core.launcher import cdiv, launcher
from ..core.strides import collapse
from .kernel_lib import GLOBALS
from .pointwise import OPS

Ref = tuple[str, int]  # ("load", i) | ("float", i) | ("value", i)

# mode: (pre-transform template, combine, post) for reductions.
REDUCE_PLAN = {
    "add": ("{}", "sum", ""),
    "mul": ("{}", "prod", ""),
    "min": ("{}", "min", ""),
    "max": ("{}", "max", ""),
    "amax": ("tl.abs({})", "max", ""),
    "avg": ("{}", "sum", "avg"),
    "norm1": ("tl.abs({})", "sum", ""),
    "norm2": ("{0} * {0}", "sum", "sqrt"),
    "mul_no_zeros": ("tl.where({0} == 0, 1.0, {0})", "prod", ""),
}
_NEUTRAL = {"sum": "0.0", "prod": "1.0", "min": 'float("inf")', "max": '-float("inf")'}

STATS = {"generated": 0, "cache_hits": 0}
_CACHE: dict[tuple, Callable[..., Any]] = {}


@dataclasses.dataclass(frozen=True)
class Structure:
    """What a generated kernel computes (hashable; the cache key with ``Access``).

    Attributes:
        compute: ``"float32"`` or ``"float64"``.
        loads: dtype names of the tensors read.
        n_floats: float arguments (scalars, op parameters).
        body: ``(op, operand refs, float indices of its parameters)`` per pointwise op, in order;
            the result of body[i] is ``("value", i)``.
        stores: ``(ref, dtype name)`` per tensor written at the iteration shape.
        reducers: ``(ref, mode, dtype name)`` per reduction output (empty: a pointwise kernel).
    """

    compute: str
    loads: tuple[str, ...]
    n_floats: int
    body: tuple[tuple[str, tuple[Ref, ...], tuple[int, ...]], ...]
    stores: tuple[tuple[Ref, str], ...]
    reducers: tuple[tuple[Ref, str, str], ...] = ()

    @property
    def n_tensors(self) -> int:
        return len(self.loads) + len(self.stores) + len(self.reducers)


@dataclasses.dataclass(frozen=True)
class Access:
    """How a kernel walks memory: ``ndim`` collapsed dimensions (kept ones for reductions),
    ``red_ndim`` reduced ones, and per tensor whether its offset is the flat index (pointwise)."""

    ndim: int
    red_ndim: int
    dense: tuple[bool, ...]


def kernel(structure: Structure, access: Access) -> Callable[..., Any]:
    """The jitted kernel for a structure and an access pattern, generated on first request."""
    key = (structure, access)
    fn = _CACHE.get(key)
    if fn is not None:
        STATS["cache_hits"] += 1
        return fn
    src_body = reduce_source(structure, access) if structure.reducers else pointwise_source(structure, access)
    digest = hashlib.sha1(src_body.encode()).hexdigest()[:16]
    name = f"graph_kernel_{digest}"
    src = src_body.replace("def KERNEL(", f"def {name}(", 1)
    filename = f"<tritondnn-graph-{digest}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    namespace = dict(GLOBALS)
    exec(compile(src, filename, "exec"), namespace)  # our own generated text, never a file's
    fn = _CACHE[key] = namespace[name]
    fn.source = src  # type: ignore[attr-defined]
    STATS["generated"] += 1
    return fn


def cached(structure: Structure, access: Access) -> Callable[..., Any] | None:
    """The kernel if it was generated already (no counting, no generation)."""
    return _CACHE.get((structure, access))


def _kinds(s: Structure) -> dict[Ref, str]:
    """'b' for truth values (int1), 'f' for numbers in the compute dtype."""
    kinds: dict[Ref, str] = {("load", i): "b" if d == "bool" else "f" for i, d in enumerate(s.loads)}
    kinds.update({("float", i): "f" for i in range(s.n_floats)})
    for i, (op, _, _) in enumerate(s.body):
        kinds[("value", i)] = "b" if OPS[op].bool_result else "f"
    return kinds


def _name(ref: Ref) -> str:
    return {"load": "x", "float": "f", "value": "v"}[ref[0]] + str(ref[1])


def _body_lines(s: Structure, kinds: dict[Ref, str], compute: str) -> list[str]:
    lines = []
    for i, (op, refs, floats) in enumerate(s.body):
        spec = OPS[op]
        args = []
        for pos, ref in enumerate(refs):
            name, kind = _name(ref), kinds[ref]
            if pos in spec.bool_inputs:
                args.append(name if kind == "b" else f"({name} != 0)")
            else:
                args.append(f"{name}.to({compute})" if kind == "b" else name)
        lines.append(f"v{i} = {spec.emit(args, [f'f{k}' for k in floats])}")
    return lines


def _scalars(s: Structure) -> set[Ref]:
    """Refs whose value is a scalar (made of float arguments only): stores and reductions need
    them as blocks (``+ zero``)."""
    out: set[Ref] = {("float", i) for i in range(s.n_floats)}
    for i, (_, refs, _) in enumerate(s.body):
        if all(r in out for r in refs):
            out.add(("value", i))
    return out


def _store_value(ref: Ref, kind: str, dtype: str, compute: str, scalar: bool = False) -> str:
    name = f"({_name(ref)} + zero)" if scalar else _name(ref)
    if dtype == "bool":
        return name if kind == "b" else f"{name} != 0"
    value = f"{name}.to({compute})" if kind == "b" else name
    return f"convert({value}, tl.{dtype})"


def _header(s: Structure, ints: list[str], constexprs: list[str]) -> str:
    tensors = [f"p{i}" for i in range(s.n_tensors)]
    floats = [f"f{i}" for i in range(s.n_floats)]
    params = tensors + floats + ints + [f"{c}: tl.constexpr" for c in constexprs]
    return "@triton.jit\ndef KERNEL(" + ", ".join(params) + "):"


def _unravel(index: str, prefix: str, sizes: str, ndim: int) -> list[str]:
    """Coordinates {prefix}0..{prefix}{ndim-1} of a row-major flat index over sizes {sizes}1.. .
    The remainder's name carries the prefix: row and column unravels in one kernel have different
    shapes, and Triton refuses a variable that changes shape inside a loop."""
    if ndim == 1:
        return [f"{prefix}0 = {index}"]
    rest = f"_{prefix}_rest"
    lines = [f"{rest} = {index}"]
    for d in range(ndim - 1, 0, -1):
        lines += [f"{prefix}{d} = {rest} % {sizes}{d}", f"{rest} = {rest} // {sizes}{d}"]
    return [*lines, f"{prefix}0 = {rest}"]


def pointwise_source(s: Structure, a: Access) -> str:
    """The kernel of a pointwise group over ``a.ndim`` collapsed dimensions: one program per BLOCK
    elements of the flat index; tensors with ``a.dense`` set read at the index itself, others at
    sum(coordinate * stride) (stride 0 broadcasts)."""
    compute = f"tl.{s.compute}"
    strided = [t for t in range(len(s.loads) + len(s.stores)) if not a.dense[t]]
    ints = [
        "numel",
        *(f"size{d}" for d in range(1, a.ndim)),
        *(f"st{t}_{d}" for t in strided for d in range(a.ndim)),
    ]
    out = [_header(s, ints, ["INDEX_64", "EVEN", "BLOCK"])]
    lines = [
        "pid = tl.program_id(0)",
        "if INDEX_64:",
        "    pid = pid.to(tl.int64)",
        "idx = pid * BLOCK + tl.arange(0, BLOCK)",
        "mask = idx < numel",
        f"zero = tl.zeros([BLOCK], {compute})",
    ]
    if strided:
        lines += _unravel("idx", "i", "size", a.ndim)
        for t in strided:
            lines.append(f"o{t} = " + " + ".join(f"i{d} * st{t}_{d}" for d in range(a.ndim)))
    offset = {t: "idx" if a.dense[t] else f"o{t}" for t in range(len(s.loads) + len(s.stores))}
    kinds, scalars = _kinds(s), _scalars(s)
    for even in (True, False):
        block = []
        m = "" if even else ", mask=mask"
        for i, d in enumerate(s.loads):
            raw = f"tl.load(p{i} + {offset[i]}{m})"
            block.append(f"x{i} = {raw} != 0" if d == "bool" else f"x{i} = convert({raw}, {compute})")
        block += _body_lines(s, kinds, compute)
        for j, (ref, dtype) in enumerate(s.stores):
            t = len(s.loads) + j
            value = _store_value(ref, kinds[ref], dtype, compute, ref in scalars)
            block.append(f"tl.store(p{t} + {offset[t]}, {value}{m})")
        lines += ["if EVEN:" if even else "else:", *("    " + b for b in block)]
    out += ["    " + ln for ln in lines]
    return "\n".join(out) + "\n"


def reduce_source(s: Structure, a: Access) -> str:
    """The kernel of a group ending in reductions over the same dimensions: a program owns
    BLOCK_M rows (kept coordinates, ``a.ndim`` collapsed dims) and walks the K reduced elements
    (``a.red_ndim`` dims) in BLOCK_K columns, storing the group's full-shape outputs on the way
    and combining per-lane accumulators (compute dtype) reduced across lanes at the end."""
    compute = f"tl.{s.compute}"
    n = s.n_tensors
    ints = [
        "M",
        "K",
        *(f"ks{d}" for d in range(1, a.ndim)),
        *(f"rs{d}" for d in range(1, a.red_ndim)),
        *(f"kst{t}_{d}" for t in range(n) for d in range(a.ndim)),
        *(f"rst{t}_{d}" for t in range(len(s.loads) + len(s.stores)) for d in range(a.red_ndim)),
    ]
    out = [_header(s, ints, ["INDEX_64", "BLOCK_M", "BLOCK_K"])]
    lines = [
        "pid = tl.program_id(0)",
        "if INDEX_64:",
        "    pid = pid.to(tl.int64)",
        "rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)",
        "row_mask = rows < M",
    ]
    lines += _unravel("rows", "k", "ks", a.ndim)
    for t in range(n):
        lines.append(f"ro{t} = " + " + ".join(f"k{d} * kst{t}_{d}" for d in range(a.ndim)))
    for j, (_, mode, _) in enumerate(s.reducers):
        lines.append(f"acc{j} = tl.full([BLOCK_M, BLOCK_K], {_NEUTRAL[REDUCE_PLAN[mode][1]]}, {compute})")
    loop = [
        "cols = k_start + tl.arange(0, BLOCK_K)",
        "if INDEX_64:",
        "    cols = cols.to(tl.int64)",
        "mask = row_mask[:, None] & (cols < K)[None, :]",
        f"zero = tl.zeros([BLOCK_M, BLOCK_K], {compute})",
    ]
    loop += _unravel("cols", "c", "rs", a.red_ndim)
    kinds = _kinds(s)
    for t in range(len(s.loads) + len(s.stores)):
        col = " + ".join(f"c{d} * rst{t}_{d}" for d in range(a.red_ndim))
        loop.append(f"o{t} = ro{t}[:, None] + ({col})[None, :]")
    for i, d in enumerate(s.loads):
        raw = f"tl.load(p{i} + o{i}, mask=mask, other=0)"
        loop.append(f"x{i} = {raw} != 0" if d == "bool" else f"x{i} = convert({raw}, {compute})")
    loop += _body_lines(s, kinds, compute)
    scalars = _scalars(s)
    for j, (ref, dtype) in enumerate(s.stores):
        t = len(s.loads) + j
        value = _store_value(ref, kinds[ref], dtype, compute, ref in scalars)
        loop.append(f"tl.store(p{t} + o{t}, {value}, mask=mask)")
    for j, (ref, mode, _) in enumerate(s.reducers):
        pre, combine, _ = REDUCE_PLAN[mode]
        value = _name(ref) if kinds[ref] == "f" else f"{_name(ref)}.to({compute})"
        value = f"({value} + zero)" if ref in scalars else value
        neutral = _NEUTRAL[combine]
        loop.append(f"r{j} = tl.where(mask, {pre.format(value)}, {neutral})")
        loop.append(
            {
                "sum": f"acc{j} += r{j}",
                "prod": f"acc{j} *= r{j}",
                "min": f"acc{j} = nan_min(acc{j}, r{j})",
                "max": f"acc{j} = nan_max(acc{j}, r{j})",
            }[combine]
        )
    lines += ["for k_start in range(0, K, BLOCK_K):", *("    " + ln for ln in loop)]
    first_out = len(s.loads) + len(s.stores)
    for j, (_, mode, dtype) in enumerate(s.reducers):
        _, combine, post = REDUCE_PLAN[mode]
        total = {
            "sum": f"tl.sum(acc{j}, 1)",
            "prod": f"tl.reduce(acc{j}, 1, multiply)",
            "min": f"reduce_nan_min(acc{j}, 1)",
            "max": f"reduce_nan_max(acc{j}, 1)",
        }[combine]
        lines.append(f"res{j} = {total}")
        if post == "avg":
            lines.append(f"res{j} = res{j} / K")
        elif post == "sqrt":
            lines.append(f"res{j} = tl.sqrt(res{j})")
        t = first_out + j
        lines.append(f"tl.store(p{t} + ro{t}, convert(res{j}, tl.{dtype}), mask=row_mask)")
    out += ["    " + ln for ln in lines]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------
# Binding: from the tensors' strides to a launch.


def _reach(sizes: Sequence[int], strides: Sequence[Sequence[int]]) -> int:
    return max((sum((n - 1) * abs(st) for n, st in zip(sizes, s)) for s in strides), default=0)


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "bool": 1}


def pointwise_configs(s: Structure) -> list[dict[str, int]]:
    """Launch configurations, the heuristic's first: 16 bytes of the widest tensor per thread and
    4 warps (as the activation kernels), then the alternatives benchmark mode times."""
    width = max([ITEMSIZE[d] for d in s.loads] + [ITEMSIZE[d] for _, d in s.stores] + [1])
    first = {"BLOCK": max(4096 // width, 512), "num_warps": 4}
    others = [{"BLOCK": b, "num_warps": w} for b, w in ((1024, 4), (2048, 4), (2048, 8), (4096, 8))]
    return [first] + [c for c in others if c != first]


def bind_pointwise(
    s: Structure, shape: Sequence[int], strides: Sequence[Sequence[int]], config: dict[str, int]
) -> tuple[Access, Callable[..., None] | None]:
    """The access pattern and launch for a pointwise kernel over ``shape``; ``strides`` per tensor
    (loads, then stores) in the iteration shape's coordinates (0 where broadcast). The launch takes
    the tensors then the floats; None for an empty shape."""
    n_loads = len(s.loads)
    order = (
        [n_loads, *range(n_loads), *range(n_loads + 1, len(strides))]
        if s.stores
        else list(range(len(strides)))
    )
    sizes, st = collapse(shape, *(strides[t] for t in order))
    by_tensor = [st[order.index(t)] for t in range(len(strides))]
    numel = 1
    for n in shape:
        numel *= n
    dense_strides, step = [], 1
    for n in reversed(sizes):
        dense_strides.append(step)
        step *= n
    dense_strides.reverse()
    dense = tuple(list(x) == dense_strides for x in by_tensor)
    access = Access(len(sizes), 0, dense)
    if numel == 0:
        return access, None
    fn = kernel(s, access)
    strided = [t for t in range(len(strides)) if not dense[t]]
    ints = [numel, *sizes[1:], *(by_tensor[t][d] for t in strided for d in range(len(sizes)))]
    index_64 = max(numel, _reach(sizes, by_tensor) + 1) > 2**31 - 1
    block = config["BLOCK"]
    launch = launcher(
        fn,
        (cdiv(numel, block),),
        s.n_tensors,
        ints,
        (index_64, numel % block == 0, block),
        num_warps=config["num_warps"],
    )
    return access, launch


def reduce_configs(s: Structure, kept: int, reduced: int, inner_kept: bool) -> list[dict[str, int]]:
    """(BLOCK_M, BLOCK_K) tiles: long columns when the reduced dimension is contiguous, wide rows
    when a kept one is (a reduction over an outer dimension)."""
    cap = 64 if INTERPRET else 1024
    bk = min(_next_pow2(reduced), cap)
    bm = min(_next_pow2(kept), max(1, (cap * 4 if not INTERPRET else cap) // bk))
    first = {"BLOCK_M": bm, "BLOCK_K": bk, "num_warps": 4}
    if inner_kept:
        bm = min(_next_pow2(kept), 64)
        first = {"BLOCK_M": bm, "BLOCK_K": max(1, min(_next_pow2(reduced), (cap * 2) // bm)), "num_warps": 4}
    return [first, {**first, "num_warps": 8}]


def bind_reduce(
    s: Structure,
    shape: Sequence[int],
    dims: Sequence[int],
    strides: Sequence[Sequence[int]],
    config: dict[str, int] | None = None,
) -> tuple[Access, Callable[..., None] | None, dict]:
    """As ``bind_pointwise`` for a reduction group over ``shape`` reducing ``dims``; ``strides`` per
    tensor in the shape's coordinates (reduction outputs with 0 on reduced dimensions)."""
    kept = [d for d in range(len(shape)) if d not in dims]
    n_full = len(s.loads) + len(s.stores)
    out0 = n_full  # the first reduction output drives the row order; a full-shape tensor the columns
    korder = [out0, *(t for t in range(len(strides)) if t != out0)]
    ksizes, kst = collapse([shape[d] for d in kept], *([strides[t][d] for d in kept] for t in korder))
    full = next((t for t in range(n_full) if all(strides[t][d] for d in dims if shape[d] > 1)), 0)
    rorder = [full, *(t for t in range(n_full) if t != full)]
    rsizes, rst = collapse([shape[d] for d in dims], *([strides[t][d] for d in dims] for t in rorder))
    k_by = [kst[korder.index(t)] for t in range(len(strides))]
    r_by = [rst[rorder.index(t)] for t in range(n_full)]
    m = k = 1
    for n in ksizes:
        m *= n
    for n in rsizes:
        k *= n
    if not dims:
        rsizes, r_by, k = [1], [[0] for _ in range(n_full)], 1
    access = Access(len(ksizes), len(rsizes), ())
    inner_kept = bool(n_full) and k_by[full][-1] == 1
    config = config or reduce_configs(s, m, k, inner_kept)[0]
    if m == 0:
        return access, None, config
    fn = kernel(s, access)
    ints = [m, k, *ksizes[1:], *rsizes[1:], *(x for t in k_by for x in t), *(x for t in r_by for x in t)]
    index_64 = max(m * k, _reach(ksizes, k_by) + _reach(rsizes, r_by) + 1) > 2**31 - 1
    bm, bk = config["BLOCK_M"], config["BLOCK_K"]
    launch = launcher(
        fn, (cdiv(m, bm),), s.n_tensors, ints, (index_64, bm, bk), num_warps=config["num_warps"]
    )
    return access, launch, config


def broadcast_strides(shape: Sequence[int], t_shape: Sequence[int], t_stride: Sequence[int]) -> list[int]:
    """A tensor's strides in the coordinates of ``shape`` it broadcasts to (0 on broadcast dims)."""
    pad = len(shape) - len(t_shape)
    out = [0] * pad
    for n, tn, ts in zip(shape[pad:], t_shape, t_stride):
        out.append(0 if tn == 1 and n != 1 else ts)
    return out


def view_strides(view: Sequence[int], t_shape: Sequence[int], t_stride: Sequence[int]) -> list[int]:
    """Strides of ``t`` viewed as ``view``: the same sizes with size-1 dimensions inserted."""
    it = iter(zip(t_shape, t_stride))
    out = []
    for n in view:
        if n == 1:
            out.append(0)
            continue
        tn, ts = next(it)
        while tn == 1:
            tn, ts = next(it)
        out.append(ts)
    return out


def dtype_str(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
