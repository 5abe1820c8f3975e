"""Shared by the graph tests: random feeds for a graph, and running a plan against the reference."""

from __future__ import annotations

import torch

from helpers import DEVICE, assert_close
from tritondnn.graph import Graph, Plan, reference


def feeds_for(g: Graph, **given) -> dict:
    """Random tensors for every input of ``g`` with its declared shape, strides and dtype (given
    ones kept); runtime scalars get 0.75."""
    feeds = {}
    for t in g.inputs:
        if t.name in given:
            feeds[t.name] = given[t.name]
        elif t.is_scalar:
            feeds[t.name] = 0.75
        else:
            size = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride)) if t.numel else 0
            base = torch.randn(size, device=DEVICE)
            base = base > 0 if t.dtype == torch.bool else base.to(t.dtype)
            feeds[t.name] = base.as_strided(t.shape, t.stride)
    return feeds


def check_plan(g: Graph, feeds: dict, plan: Plan | None = None, mode: str = "fast") -> tuple[Plan, dict]:
    """Execute (building if needed) and compare every output with the float64 reference, within
    twice PyTorch's own error in the graph's dtypes (bool outputs exactly)."""
    plan = plan or g.build(mode)
    out = plan.execute(feeds)
    ref = reference(g, feeds, torch.float64)
    base = reference(g, feeds)
    for t in g.outputs:
        ours = out[t.name]
        assert tuple(ours.shape) == t.shape, t.name
        assert ours.dtype == t.dtype, t.name
        if t.dtype == torch.bool:
            assert torch.equal(ours, ref[t.name]), t.name
        else:
            assert_close(ours, ref[t.name], base[t.name], f"{t.name} ({t.producer.op})")
    return plan, out
