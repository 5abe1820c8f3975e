"""Plans: modes, candidates, explain, workspace, execute's feeds and out=, and its errors."""

from __future__ import annotations

import pytest
import torch
from graph_check import check_plan, feeds_for

from helpers import DEVICE, randn
from tritondnn.graph import Graph, GraphError
from tritondnn.graph import plan as graph_plan


def _graph() -> Graph:
    g = Graph(name="small")
    x, y = g.tensor((5, 6), name="x"), g.tensor((6,), name="y")
    h = g.relu(x * y, name="h")
    g.set_output(g.reduction(h, "add", dim=1, name="rowsum"))
    g.set_output(g.sigmoid(h, name="sg"))
    return g


def test_benchmark_mode_times_candidates_and_configs(monkeypatch):
    timed = []

    def fake_median(fn, **kw):  # deterministic "timings": the unfused variant is slower
        fn()
        timed.append(fn)
        return 1.0 + len(timed) % 3

    monkeypatch.setattr(graph_plan, "median_ms", fake_median)
    monkeypatch.setattr("tritondnn.graph.lowering.median_ms", fake_median)
    g = _graph()
    plan = g.build("benchmark")
    assert plan.mode == "benchmark" and len(timed) > 4
    cands = plan.candidates()
    assert {c.name for c in cands} == {"fused", "unfused"}
    assert all(c.measured_ms is not None for c in cands)
    assert next(c for c in cands if c.chosen).name == plan.variant
    assert cands[0].measured_ms <= cands[1].measured_ms
    check_plan(g, feeds_for(g), plan)


def test_fast_mode_candidates_are_estimated_and_ranked():
    g = _graph()
    plan = g.build()
    cands = plan.candidates()
    assert [c.name for c in cands] == ["fused", "unfused"]
    assert cands[0].chosen and cands[0].kernels == 1 and cands[1].kernels == 4
    assert cands[0].estimated_us < cands[1].estimated_us and cands[0].measured_ms is None


def test_explain_and_workspace():
    g = Graph()
    x = g.tensor((4, 8), name="x")
    ln = g.layernorm(g.exp(x, name="e"), name="ln")  # e is written to memory for the norm
    g.set_output(g.mul(ln, 2.0, name="m"))
    plan = g.build()
    assert plan.workspace_size == 2 * 4 * 8 * 4  # e and ln, fp32
    text = plan.explain()
    for piece in (
        "3 kernel(s)",
        "generated pointwise kernel",
        "layernorm [engine: heuristic]",
        "nodes e",
        "-> m",
    ):
        assert piece in text, piece
    assert len(plan.kernel_sources()) == 2 and all("@triton.jit" in s for s in plan.kernel_sources())
    assert repr(plan) == text


def test_feeds_by_tensor_and_outputs_by_tensor(poison):
    g = _graph()
    plan = g.build()
    feeds = {g["x"]: randn(5, 6), "y": randn(6)}
    out = plan.execute(feeds)
    assert set(out) == {"rowsum", "sg"}
    assert torch.equal(out[g["sg"]], out["sg"])
    assert torch.equal(plan(feeds)["rowsum"], out["rowsum"])


def test_out_argument():
    g = Graph()
    x = g.tensor((3, 4), name="x")
    g.set_output(g.exp(x, name="e"))
    g.set_output(g.layernorm(x, name="ln"))
    plan = g.build()
    xt = randn(3, 4)
    dest_e, dest_ln = torch.full((3, 4), float("nan"), device=DEVICE), torch.empty(3, 4, device=DEVICE)
    out = plan.execute({"x": xt}, out={"e": dest_e, g["ln"]: dest_ln})
    assert out["e"] is dest_e and out["ln"] is dest_ln
    assert torch.allclose(dest_e, xt.exp()) and torch.allclose(dest_ln, torch.layer_norm(xt, (4,)), atol=1e-5)
    strided = torch.empty(4, 3, device=DEVICE).t()  # other strides: filled by a copy
    out = plan.execute({"x": xt}, out={"e": strided})
    assert out["e"] is strided and torch.allclose(strided, xt.exp())
    single = Graph()
    single.set_output(single.neg(single.tensor((2,), name="a")))
    dest = torch.empty(2, device=DEVICE)
    assert single.build().execute({"a": torch.ones(2, device=DEVICE)}, out=dest)["neg0"] is dest
    with pytest.raises(GraphError, match="one tensor"):
        plan.execute({"x": xt}, out=dest)
    with pytest.raises(GraphError, match="not an output"):
        plan.execute({"x": xt}, out={"x": dest})
    with pytest.raises(GraphError, match="shape"):
        plan.execute({"x": xt}, out={"e": dest})


def test_feed_errors():
    g = _graph()
    plan = g.build()
    x, y = randn(5, 6), randn(6)
    cases = [
        ({"x": x}, "feed", "missing feeds"),
        ({"x": x, "y": y, "z": y}, "feed", "not an input"),
        ({"x": x, "y": y.double()}, "dtype", "dtype float64"),
        ({"x": x[:4], "y": y}, "shape", r"shape \(4, 6\)"),
        ({"x": x.t().contiguous().t(), "y": y}, "layout", "strides"),
        ({"x": x, "y": [1.0] * 6}, "feed", "torch.Tensor"),
        ({"x": x, g["x"]: x, "y": y}, "feed", "fed twice"),
    ]
    for feeds, rule, text in cases:
        with pytest.raises(GraphError, match=text) as info:
            plan.execute(feeds)
        assert info.value.rule == rule
    with pytest.raises(GraphError, match="mapping"):
        plan.execute([x, y])
    s = Graph()
    alpha = s.scalar(name="alpha")
    s.set_output(s.mul(s.tensor((2,), name="v"), alpha))
    with pytest.raises(GraphError, match="Python number"):
        s.build().execute({"v": randn(2), "alpha": torch.tensor(1.0)})


def test_size_one_dimensions_accept_any_stride():
    g = Graph()
    x = g.tensor((3, 1, 4), name="x")
    g.set_output(g.abs(x))
    odd = randn(3, 4).unsqueeze(1).as_strided((3, 1, 4), (4, 99, 1))
    check_plan(g, {"x": odd})


def test_build_rejects_unknown_mode():
    with pytest.raises(GraphError, match="mode"):
        _graph().build("fastest")
