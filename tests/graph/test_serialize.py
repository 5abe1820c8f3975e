"""JSON for graphs and plans: round trips for every node kind, and malformed, truncated,
wrong-version and hostile documents rejected with a clear error."""

from __future__ import annotations

import json

import pytest
import torch
from graph_check import check_plan, feeds_for

from tritondnn.graph import GRAPH_SCHEMA, PLAN_SCHEMA, Graph, GraphError, Plan


def _every_kind() -> Graph:
    g = Graph(io_dtype=torch.float32, name="zoo")
    x = g.tensor((2, 4, 6, 6), layout="channels_last", name="x")
    w = g.tensor((4, 4, 3, 3), name="w")
    b = g.tensor((4, 1, 1), name="b")
    alpha = g.scalar(name="alpha")
    y = g.conv_fprop(x, w, padding=1, name="conv")
    y = g.relu(g.bias(y, b), clip=6.0, name="act")
    g.set_output(y)
    g.set_output(g.conv_dgrad(y, w, padding=1, name="dgrad"))
    g.set_output(g.conv_wgrad(x, y, 3, padding=1, name="wgrad"))
    bn, mean, inv = g.batchnorm(x, name="bn")
    g.set_output(g.batchnorm_inference(bn, mean, inv, name="bni"))
    g.set_output(g.instancenorm(x, name="inorm"))
    flat = g.reshape(y, (2, 4, 36), name="flat")
    g.set_output(g.layernorm(flat, name="ln"))
    g.set_output(g.rmsnorm(flat, normalized_shape=[36], eps=1e-5, name="rms"))
    g.set_output(g.pool(x, "avg", 2, name="pool"))
    g.set_output(g.resample(x, scale_factor=0.5, mode="nearest", name="rs"))
    s1, s2 = g.genstats(x * alpha, name="gs")
    g.set_output(s1)
    g.set_output(g.reduction(s2, "norm2", dim=1, keepdim=False, name="red"))
    q = g.reshape(g.slice(flat, 2, 0, 32), (2, 4, 4, 8), name="q")
    o, st = g.sdpa(q, q, q, return_stats=True, name="att")
    g.set_output(
        g.concatenate([g.permute(o, (0, 1, 3, 2), name="pt"), g.transpose(q, 2, 3, name="tq")], 2, name="cat")
    )
    g.set_output(g.sdpa_backward(q, q, q, o, o, st, name="attb")[0])
    g.set_output(g.select(g.cmp_gt(flat, 0.0), flat, g.softplus(flat, beta=2.0), name="sel"))
    g.set_output(g.leaky_relu(flat, name="leaky"))
    g.set_output(g.matmul(flat, g.transpose(flat, 1, 2, name="ft"), dtype=torch.float16, name="mm"))
    return g


def test_graph_round_trip_every_node_kind():
    g = _every_kind()
    text = g.serialize()
    data = json.loads(text)
    assert data["format"] == "tritondnn.graph" and data["version"] == 1
    assert {"inf"} <= {
        a["float"] for n in data["nodes"] for a in n["attrs"].get("params", []) if isinstance(a, dict)
    }
    g2 = Graph.deserialize(text)
    assert g2.serialize() == text
    assert [repr(n) for n in g2.nodes] == [repr(n) for n in g.nodes]
    feeds = feeds_for(g)
    check_plan(g2, feeds)


def test_plan_round_trip_keeps_configs_and_engines():
    g = _every_kind()
    plan = g.build()
    plan._engines[0] = "im2col_gemm"  # as benchmark mode would record a measured choice
    plan._configs[[s.kind for s in plan.steps].index("pointwise")] = {"BLOCK": 256, "num_warps": 2}
    text = plan.serialize()
    again = Plan.deserialize(text)
    assert again.serialize() == text
    assert again._engines[0] == "im2col_gemm" and "im2col_gemm" in again.explain()
    feeds = feeds_for(g)
    a, b = plan.execute(feeds), again.execute(feeds)
    assert set(a) == set(b)
    for k in a:  # the engine and block size changed: the same values up to rounding
        assert torch.allclose(a[k].double(), b[k].double(), rtol=1e-4, atol=1e-4, equal_nan=True), k


def test_schemas_describe_the_documents():
    assert GRAPH_SCHEMA["properties"]["version"]["const"] == 1
    assert set(json.loads(_every_kind().serialize())) == set(GRAPH_SCHEMA["required"])
    assert set(json.loads(_every_kind().build().serialize())) == set(PLAN_SCHEMA["required"])


def _small() -> dict:
    g = Graph()
    x = g.tensor((3,), name="x")
    g.set_output(g.relu(x, name="r"))
    return json.loads(g.serialize())


def _mutate(change) -> str:
    data = _small()
    change(data)
    return json.dumps(data)


HOSTILE = {
    "not json": "this is not json",
    "truncated": json.dumps(_small())[:-7],
    "empty": "",
    "list": "[1, 2, 3]",
    "nan literal": '{"format": NaN}',
    "deep nesting": "[" * 100_000 + "]" * 100_000,
    "huge": " " * ((16 << 20) + 1),
    "not utf-8": b"\xff\xfe{",
    "wrong version": _mutate(lambda d: d.update(version=2)),
    "bool version": _mutate(lambda d: d.update(version=True)),
    "wrong format": _mutate(lambda d: d.update(format="pickle")),
    "extra field": _mutate(lambda d: d.update(code="__import__('os').system('true')")),
    "unknown op": _mutate(lambda d: d["nodes"][0].update(op="eval")),
    "code as op": _mutate(lambda d: d["nodes"][0].update(op="__import__('os')")),
    "unknown attr": _mutate(lambda d: d["nodes"][0]["attrs"].update(source="def f(): pass")),
    "bad param type": _mutate(lambda d: d["nodes"][0]["attrs"].update(params=["0", "inf"])),
    "object attr": _mutate(lambda d: d["nodes"][0]["attrs"].update(params=[{"__class__": "x"}, 1.0])),
    "negative dim": _mutate(lambda d: d["tensors"][0].update(shape=[-3])),
    "huge dim": _mutate(lambda d: d["tensors"][0].update(shape=[2**60])),
    "float dim": _mutate(lambda d: d["tensors"][0].update(shape=[3.0])),
    "bad dtype": _mutate(lambda d: d["tensors"][0].update(dtype="object")),
    "unknown tensor": _mutate(lambda d: d["nodes"][0]["inputs"].update(a="nowhere")),
    "forward reference": _mutate(lambda d: d["nodes"][0]["inputs"].update(a="r")),
    "renamed output": _mutate(lambda d: d["nodes"][0].update(outputs=["other"])),
    "bad output": _mutate(lambda d: d.update(outputs=["x"])),
    "long name": _mutate(lambda d: d["tensors"][0].update(name="n" * 10_000)),
    "tensors not a list": _mutate(lambda d: d.update(tensors={"x": 1})),
    "rank too high": _mutate(lambda d: d["tensors"][0].update(shape=[1] * 9, stride=[1] * 9)),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_bad_graph_documents_raise_clearly(case):
    with pytest.raises(GraphError) as info:
        Graph.deserialize(HOSTILE[case])
    assert info.value.rule in ("format", "shape", "graph", "cycle", "layout", "argument"), str(info.value)
    assert len(str(info.value)) < 2000


def test_bad_plan_documents_raise_clearly():
    g = Graph()
    x = g.tensor((4, 4), name="x")
    g.set_output(g.exp(g.matmul(x, x, name="mm"), name="e"))
    good = json.loads(g.build().serialize())

    def bad(change) -> str:
        data = json.loads(json.dumps(good))
        change(data)
        return json.dumps(data)

    cases = {
        "steps differ": bad(lambda d: d["steps"].reverse()),
        "big block": bad(lambda d: d["steps"][1].update(config={"BLOCK": 2**20, "num_warps": 4})),
        "odd warps": bad(lambda d: d["steps"][1].update(config={"BLOCK": 1024, "num_warps": 3})),
        "config keys": bad(lambda d: d["steps"][1].update(config={"BLOCK": 1024, "exec": 1})),
        "engine on a kernel": bad(lambda d: d["steps"][1].update(engine="im2col_gemm")),
        "unknown engine": bad(lambda d: d["steps"][0].update(engine="os.system")),
        "bad variant": bad(lambda d: d.update(variant="turbo")),
        "graph version": bad(lambda d: d["graph"].update(version=0)),
        "plan version": bad(lambda d: d.update(version="1")),
        "a graph, not a plan": json.dumps(good["graph"]),
    }
    for name, text in cases.items():
        with pytest.raises(GraphError) as info:
            Plan.deserialize(text)
        assert info.value.rule == "format", (name, str(info.value))
