"""The meaning of a graph: every node evaluated with plain PyTorch, one after the other.

``reference(graph, feeds, torch.float64)`` computes every float tensor in float64 (the meaning
tests compare with); ``reference(graph, feeds)`` computes in the graph's own dtypes, each node's
output rounded to its declared dtype, as PyTorch eager would (the "same dtype" baseline of the
accuracy rule). Feeds are cloned: running statistics are updated on the copies.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from .graph import Graph
from .library_nodes import pool_function
from .pointwise import OPS
from .types import GraphTensor, Node

_GRAD_INPUT = {1: torch.nn.grad.conv1d_input, 2: torch.nn.grad.conv2d_input, 3: torch.nn.grad.conv3d_input}
_GRAD_WEIGHT = {
    1: torch.nn.grad.conv1d_weight,
    2: torch.nn.grad.conv2d_weight,
    3: torch.nn.grad.conv3d_weight,
}


def reference(graph: Graph, feeds: Mapping, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Every output of ``graph`` (by name) for ``feeds`` (as ``Plan.execute`` takes them)."""
    env: dict[int, Any] = {}
    by_name = {(k.name if isinstance(k, GraphTensor) else k): v for k, v in feeds.items()}
    for t in graph.tensors:
        if t.is_scalar:
            value = t.value if t.value is not None else float(by_name[t.name])
            env[t.uid] = torch.tensor(value, dtype=dtype or t.dtype)
        elif t.kind == "input":
            value = by_name[t.name].clone()
            env[t.uid] = value.to(dtype) if dtype is not None and value.is_floating_point() else value
    for node in graph.nodes:
        ins = [None if t is None else env[t.uid] for t in node.inputs]
        outs = _evaluate(node, ins, dtype)
        for t, value in zip(node.outputs, outs):
            keep = dtype is not None and t.dtype != torch.bool
            env[t.uid] = value.to(dtype if keep else t.dtype)
    return {t.name: env[t.uid] for t in graph.outputs}


def _reduce(x: torch.Tensor, mode: str, dims: list[int], keepdim: bool) -> torch.Tensor:
    if not dims:
        return x.clone()
    if mode in ("mul", "mul_no_zeros"):
        if mode == "mul_no_zeros":
            x = torch.where(x == 0, torch.ones_like(x), x)
        kept = [d for d in range(x.ndim) if d not in dims]
        flat = x.permute(*kept, *dims).reshape(*(x.shape[d] for d in kept), -1).prod(-1)
        return flat.reshape([1 if d in dims else n for d, n in enumerate(x.shape)]) if keepdim else flat
    fns = {
        "add": lambda: x.sum(dims, keepdim),
        "avg": lambda: x.mean(dims, keepdim),
        "min": lambda: x.amin(dims, keepdim),
        "max": lambda: x.amax(dims, keepdim),
        "amax": lambda: x.abs().amax(dims, keepdim),
        "norm1": lambda: x.abs().sum(dims, keepdim),
        "norm2": lambda: torch.linalg.vector_norm(x, 2, dims, keepdim),
    }
    return fns[mode]()


def _attention_inputs(node: Node, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any):
    a = node.attrs
    if a["enable_gqa"] and k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scale = a["scale"] if a["scale"] is not None else 1 / math.sqrt(q.shape[-1])
    scores = (q @ k.transpose(-1, -2)) * scale
    sq, skv = q.shape[-2], k.shape[-2]
    if a["is_causal"]:
        scores = scores.masked_fill(~torch.ones(sq, skv, dtype=torch.bool, device=q.device).tril(), -math.inf)
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else scores + mask
    return scores, v


def _wide(x: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """Statistics and gradients of norms: float64 for the reference, else fp32 (as PyTorch's
    kernels accumulate), rounded to the declared dtypes afterwards."""
    return torch.float64 if dtype == torch.float64 or x.dtype == torch.float64 else torch.float32


def _norm_backward(node: Node, ins: list[Any], dtype: torch.dtype | None) -> list[torch.Tensor]:
    """cuDNN's norm backward from the given statistics (equal to the autograd of the forward when
    they are the input's own): with ``x_hat = (x - mean) * inv`` (``mean = 0`` for RMS) and
    ``g = dy * scale`` over the normalized dimensions, ``dx = inv * (g - mean(g) -
    x_hat * mean(g * x_hat))`` (RMS: no ``mean(g)`` term), ``dscale = sum(dy * x_hat)`` and
    ``dbias = sum(dy)`` over the other dimensions."""
    dy, x = ins[0], ins[1]
    acc = _wide(x, dtype)
    dy, x = dy.to(acc), x.to(acc)
    op = node.op
    if op in ("layernorm_backward", "rmsnorm_backward"):
        k = len(node.attrs["normalized_shape"])
        dims, view = list(range(x.ndim - k, x.ndim)), list(x.shape[x.ndim - k :])
        other = list(range(x.ndim - k))  # the dimensions the parameter gradients sum over
    else:
        spatial = list(range(2, x.ndim))
        dims = spatial if op == "instancenorm_backward" else [0, *spatial]
        view, other = [x.shape[1], *([1] * (x.ndim - 2))], [0, *spatial]
    stats = [t.to(acc) if t.ndim == x.ndim else t.to(acc).reshape(view) for t in ins[3:]]
    inv = stats[-1]
    mean = torch.zeros((), dtype=acc) if op == "rmsnorm_backward" else stats[0]
    scale = torch.ones((), dtype=acc) if ins[2] is None else ins[2].to(acc).reshape(view)
    xhat = (x - mean) * inv
    g = dy * scale
    inner = g - xhat * (g * xhat).mean(dims, keepdim=True)
    if op != "rmsnorm_backward":
        inner = inner - g.mean(dims, keepdim=True)
    shape = node.outputs[1].shape
    grads = [inv * inner, _sum(dy * xhat, other).reshape(shape)]
    if op != "rmsnorm_backward":
        grads.append(_sum(dy, other).reshape(shape))
    return grads


def _sum(t: torch.Tensor, dims: list[int]) -> torch.Tensor:
    return t.sum(dims) if dims else t  # sum([]) would reduce every dimension


def _evaluate(node: Node, ins: list[Any], dtype: torch.dtype | None) -> list[torch.Tensor]:
    a, op = node.attrs, node.op
    if node.kind == "pointwise":
        views = a.get("views") or [None] * len(ins)
        args = [x if v is None else x.reshape(v) for x, v in zip(ins, views)]
        return [OPS[op].reference(args, a["params"])]
    x = ins[0]
    nd = x.ndim - 2
    if op == "matmul":
        return [torch.matmul(x, ins[1])]
    if op == "conv_fprop":
        fn = (F.conv1d, F.conv2d, F.conv3d)[nd - 1]
        return [fn(x, ins[1], None, a["stride"], a["padding"], a["dilation"], a["groups"])]
    if op == "conv_dgrad":
        return [
            _GRAD_INPUT[nd](a["x_shape"], ins[1], x, a["stride"], a["padding"], a["dilation"], a["groups"])
        ]
    if op == "conv_wgrad":
        return [
            _GRAD_WEIGHT[nd](x, a["w_shape"], ins[1], a["stride"], a["padding"], a["dilation"], a["groups"])
        ]
    if op == "reduction":
        return [_reduce(x, a["mode"], a["dim"], a["keepdim"])]
    if op == "genstats":
        xf = x if x.dtype == torch.float64 else x.float()
        return [xf.sum(a["dim"], keepdim=True), (xf * xf).sum(a["dim"], keepdim=True)]
    if op == "batchnorm":
        c = x.shape[1]
        w, b, rm, rv = (None if t is None else t.reshape(c) for t in ins[1:])
        y = F.batch_norm(x, rm, rv, w, b, True, a["momentum"], a["eps"])
        dims = [d for d in range(x.ndim) if d != 1]
        xf = x.double()
        mean, var = xf.mean(dims), xf.var(dims, unbiased=False)
        return [y, mean, 1.0 / torch.sqrt(var + a["eps"])]
    if op in ("layernorm", "rmsnorm", "instancenorm"):
        if op == "layernorm":
            y = F.layer_norm(x, a["normalized_shape"], ins[1], ins[2], a["eps"])
        elif op == "rmsnorm":
            y = F.rms_norm(x, a["normalized_shape"], ins[1], a["eps"])
        else:
            y = F.instance_norm(x, None, None, ins[1], ins[2], True, 0.1, a["eps"])
        if not a.get("training"):
            return [y]
        first = x.ndim - len(a["normalized_shape"]) if op != "instancenorm" else 2  # normalized dims
        dims = list(range(first, x.ndim))
        xf = x.to(_wide(x, dtype))
        if op == "rmsnorm":
            return [y, torch.rsqrt(xf.square().mean(dims, keepdim=True) + a["eps"])]
        var = xf.var(dims, unbiased=False, keepdim=True)
        return [y, xf.mean(dims, keepdim=True), torch.rsqrt(var + a["eps"])]
    if node.kind == "norm_backward":
        return _norm_backward(node, ins, dtype)
    if op == "sdpa":
        scores, v = _attention_inputs(node, x, ins[1], ins[2], ins[3])
        o = torch.softmax(scores.float() if scores.dtype != torch.float64 else scores, -1).to(v.dtype) @ v
        return [o, torch.logsumexp(scores.float() if scores.dtype != torch.float64 else scores, -1)]
    if op == "sdpa_backward":
        q, k, v, _, do, _, mask = ins
        with torch.enable_grad():
            qkv = [t.detach().requires_grad_(True) for t in (q, k, v)]
            scores, vv = _attention_inputs(node, *qkv, mask)
            o = torch.softmax(scores, -1) @ vv
            return list(torch.autograd.grad(o, qkv, do))
    if op == "pool":
        return [pool_function(a, nd)(x)]
    if op == "resample":
        return [F.interpolate(x, a["size"], a["scale_factor"], a["mode"], a["align_corners"])]
    if op == "reshape":
        return [x.reshape(a["shape"])]
    if op == "transpose":
        return [x.permute(a["dims"])]
    if op == "slice":
        return [x[(slice(None),) * a["dim"] + (slice(a["start"], a["end"], a["step"]),)]]
    if op == "concatenate":
        return [torch.cat(ins, a["dim"])]
    raise NotImplementedError(op)
