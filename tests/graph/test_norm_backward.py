"""Norm backward nodes (layernorm, rmsnorm, batchnorm, instancenorm) and the training-phase
forward nodes that save their statistics: each compared with ``torch.autograd`` of the
``torch.nn.functional`` norm in float64 (the 2x rule against the same in the graph's dtype), fed
from the forward node's statistics in one graph; their rules; their JSON, old documents included."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from graph_check import check_plan, feeds_for

from helpers import DEVICE, assert_close
from tritondnn.graph import Graph, GraphError


def autograd_grads(fn, dy: torch.Tensor, dtype: torch.dtype, **leaves: torch.Tensor) -> dict:
    """``torch.autograd`` gradients of ``fn(**leaves)`` for output gradient ``dy``, every tensor
    taken in ``dtype``: the meaning (float64) or PyTorch's own result (the graph's dtype)."""
    ts = {k: v.detach().to(dtype).requires_grad_(True) for k, v in leaves.items()}
    y = fn(**ts)
    return dict(zip(ts, torch.autograd.grad(y, list(ts.values()), dy.to(dtype))))


def check_grads(out, node: str, fn, feeds: dict, dy: str, params, **leaves) -> None:
    """The node's (dx, dscale[, dbias]) against autograd of ``fn`` in float64, within twice
    PyTorch's error in the graph's dtype; ``params`` maps dscale/dbias to leaf names."""
    ref = autograd_grads(fn, feeds[dy], torch.float64, **leaves)
    base = autograd_grads(fn, feeds[dy], feeds[dy].dtype, **leaves)  # PyTorch in the graph's dtype
    pairs = [("dx", "x"), *params.items()]
    for grad, leaf in pairs:
        ours = out[f"{node}.{grad}"]
        assert_close(ours, ref[leaf].reshape(ours.shape), base[leaf].reshape(ours.shape).to(ours.dtype), grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_layernorm_training_stats_feed_layernorm_backward(dtype):
    g = Graph(io_dtype=dtype)
    x, dy = g.tensor((3, 4, 10), name="x"), g.tensor((3, 4, 10), name="dy")
    w, b = g.tensor((4, 10), name="w"), g.tensor((4, 10), name="b")
    y, mean, inv = g.layernorm(x, w, b, normalized_shape=(4, 10), eps=1e-4, training=True, name="ln")
    assert mean.shape == inv.shape == (3, 1, 1) and mean.dtype == torch.float32
    grads = g.layernorm_backward(dy, x, w, mean, inv, name="lnb")
    assert [t.shape for t in grads] == [(3, 4, 10), (4, 10), (4, 10)] and grads[1].dtype == dtype
    for t in (y, mean, inv, *grads):
        g.set_output(t)
    feeds = feeds_for(g)
    plan, out = check_plan(g, feeds)
    assert "layernorm_backward" in plan.explain() and "lnb.dscale" in plan.explain()
    xs = feeds["x"]
    _, m64, r64 = torch.native_layer_norm(xs.double(), (4, 10), None, None, 1e-4)
    _, m32, r32 = torch.native_layer_norm(xs.float(), (4, 10), None, None, 1e-4)
    assert_close(out["ln.mean"], m64, m32, "mean")
    assert_close(out["ln.inv_variance"], r64, r32, "inv_variance")
    fn = lambda x, w, b: F.layer_norm(x, (4, 10), w, b, 1e-4)
    check_grads(out, "lnb", fn, feeds, "dy", {"dscale": "w", "dbias": "b"}, x=xs, w=feeds["w"], b=feeds["b"])


def test_layernorm_backward_without_scale_after_a_fused_residual_add():
    g = Graph()
    a, r, dy = (g.tensor((5, 16), name=n) for n in ("a", "r", "dy"))
    s = g.add(a, r, name="s")
    y, mean, inv = g.layernorm(s, training=True, name="ln")
    dx, dscale, dbias = g.layernorm_backward(dy, s, None, mean, inv, name="lnb")
    assert dscale.dtype == torch.float32 and dscale.shape == (16,)
    for t in (y, dx, dscale, dbias):
        g.set_output(t)
    feeds = feeds_for(g)
    plan, out = check_plan(g, feeds)
    assert plan.steps[0].fold["add"].name == "s"  # the add still folds into the norm's kernel
    # dscale, dbias: what a unit scale and a zero bias get
    ones, zeros = torch.ones(16, device=DEVICE), torch.zeros(16, device=DEVICE)
    fn = lambda x, w, b: F.layer_norm(x, (16,), w, b)
    x = feeds["a"] + feeds["r"]
    check_grads(out, "lnb", fn, feeds, "dy", {"dscale": "w", "dbias": "b"}, x=x, w=ones, b=zeros)


def test_rmsnorm_training_stats_feed_rmsnorm_backward():
    g = Graph()
    x, dy, w = g.tensor((2, 3, 24), name="x"), g.tensor((2, 3, 24), name="dy"), g.tensor((24,), name="w")
    y, inv_rms = g.rmsnorm(x, w, eps=1e-6, training=True, name="rms")
    assert inv_rms.shape == (2, 3, 1)
    dx, dscale = g.rmsnorm_backward(dy, x, w, inv_rms, name="rmsb")
    for t in (g.silu(y, name="act"), inv_rms, dx, dscale):  # silu folds into the norm
        g.set_output(t)
    feeds = feeds_for(g)
    plan, out = check_plan(g, feeds)
    assert plan.steps[0].fold["activation"] == "silu"
    fn = lambda x, w: F.rms_norm(x, (24,), w, 1e-6)
    check_grads(out, "rmsb", fn, feeds, "dy", {"dscale": "w"}, x=feeds["x"], w=feeds["w"])


def test_batchnorm_stats_feed_batchnorm_backward_channels_last():
    g = Graph()
    x = g.tensor((3, 5, 4, 3), layout="channels_last", name="x")
    dy = g.tensor((3, 5, 4, 3), layout="channels_last", name="dy")
    w, b = g.tensor((1, 5, 1, 1), name="w"), g.tensor((5,), name="b")
    y, mean, inv = g.batchnorm(x, w, b, eps=1e-3, name="bn")
    dx, dscale, dbias = g.batchnorm_backward(dy, x, w, mean, inv, name="bnb")
    assert dscale.shape == (1, 5, 1, 1) and dbias.shape == (1, 5, 1, 1)
    for t in (y, dx, dscale, dbias):
        g.set_output(t)
    feeds = feeds_for(g)
    _, out = check_plan(g, feeds)
    assert out["bnb.dx"].is_contiguous(memory_format=torch.channels_last)  # dx keeps x's layout
    fn = lambda x, w, b: F.batch_norm(x, None, None, w.reshape(5), b, True, 0.1, 1e-3)
    check_grads(
        out, "bnb", fn, feeds, "dy", {"dscale": "w", "dbias": "b"}, x=feeds["x"], w=feeds["w"], b=feeds["b"]
    )


def test_instancenorm_training_stats_feed_instancenorm_backward():
    g = Graph()
    x, dy = g.tensor((2, 3, 5, 4), name="x"), g.tensor((2, 3, 5, 4), name="dy")
    y, mean, inv = g.instancenorm(x, eps=1e-4, training=True, name="in")
    assert mean.shape == (2, 3, 1, 1)
    dx, dscale, dbias = g.instancenorm_backward(dy, x, None, mean, inv, name="inb")
    for t in (y, mean, inv, dx, dscale, dbias):
        g.set_output(t)
    feeds = feeds_for(g)
    _, out = check_plan(g, feeds)
    ones, zeros = torch.ones(3, device=DEVICE), torch.zeros(3, device=DEVICE)
    fn = lambda x, w, b: F.instance_norm(x, None, None, w, b, True, 0.1, 1e-4)
    check_grads(out, "inb", fn, feeds, "dy", {"dscale": "w", "dbias": "b"}, x=feeds["x"], w=ones, b=zeros)


def test_backward_from_fed_statistics():
    """Statistics as graph inputs (saved by an earlier forward graph), the scale in another dtype."""
    g = Graph()
    x, dy = g.tensor((4, 7, 6), name="x"), g.tensor((4, 7, 6), name="dy")
    w = g.tensor((7, 6), dtype=torch.float64, name="w")
    mean, inv = g.tensor((4, 1, 1), name="mean"), g.tensor((4, 1, 1), name="inv")
    grads = g.layernorm_backward(dy, x, w, mean, inv, name="lnb")
    assert grads[1].dtype == torch.float64
    for t in grads:
        g.set_output(t)
    # a large mean: x_hat must be taken about the saved mean
    xs = torch.randn(4, 7, 6, device=DEVICE) * 3 + 100
    _, m, r = torch.native_layer_norm(xs.double(), (7, 6), None, None, 1e-5)
    feeds = feeds_for(g, x=xs, mean=m.float(), inv=r.float())
    _, out = check_plan(g, feeds)
    ref = autograd_grads(
        lambda x, w: F.layer_norm(x, (7, 6), w), feeds["dy"], torch.float64, x=xs, w=feeds["w"]
    )
    base = autograd_grads(
        lambda x, w: F.layer_norm(x, (7, 6), w), feeds["dy"], torch.float32, x=xs, w=feeds["w"]
    )
    assert_close(out["lnb.dx"], ref["x"], base["x"], "dx")
    assert_close(out["lnb.dscale"], ref["w"], base["w"].double(), "dscale")


def _bad(build, rule: str, node: str, tensor: str | None) -> None:
    with pytest.raises(GraphError) as info:
        build()
    err = info.value
    assert (err.rule, err.node, err.tensor) == (rule, node, tensor), str(err)
    assert f"[rule: {rule}]" in str(err) and f"node '{node}'" in str(err)


def test_norm_backward_rules():
    g = Graph()
    x, dy = g.tensor((2, 3, 4), name="x"), g.tensor((2, 3, 4), name="dy")
    short = g.tensor((2, 3, 5), name="short")
    half = g.tensor((2, 3, 4), dtype=torch.float16, name="half")
    w4, w5 = g.tensor((4,), name="w4"), g.tensor((5,), name="w5")
    st, st_bad = g.tensor((2, 3, 1), name="st"), g.tensor((2, 1, 1), name="st_bad")
    flag = g.tensor((2, 3, 1), dtype=torch.bool, name="flag")
    ch, ch_bad = g.tensor((3,), name="ch"), g.tensor((4,), name="ch_bad")
    inst = g.tensor((2, 3, 1), name="inst")
    _bad(lambda: g.layernorm_backward(dy, x, w4, None, st, name="a"), "argument", "a", None)
    _bad(lambda: g.layernorm_backward(short, x, w4, st, st, name="b"), "shape", "b", "short")
    _bad(lambda: g.layernorm_backward(half, x, w4, st, st, name="c"), "dtype", "c", "x")
    _bad(lambda: g.layernorm_backward(dy, x, w4, st_bad, st, name="d"), "shape", "d", "st_bad")
    _bad(lambda: g.layernorm_backward(dy, x, w4, st, flag, name="e"), "dtype", "e", "flag")
    _bad(lambda: g.layernorm_backward(dy, x, w5, st, st, name="f"), "shape", "f", "x")
    _bad(lambda: g.rmsnorm_backward(dy, x, None, None, name="g"), "argument", "g", None)
    _bad(lambda: g.rmsnorm_backward(dy, x, w4, st_bad, name="h"), "shape", "h", "st_bad")
    _bad(lambda: g.batchnorm_backward(dy, x, ch_bad, ch, ch, name="i"), "shape", "i", "ch_bad")
    _bad(lambda: g.batchnorm_backward(dy, x, ch, st, ch, name="j"), "shape", "j", "st")
    _bad(lambda: g.instancenorm_backward(dy, x, None, inst, ch, name="k"), "shape", "k", "ch")
    _bad(lambda: g.instancenorm_backward(dy, x, ch_bad, inst, inst, name="l"), "shape", "l", "ch_bad")
    vec = g.tensor((4,), name="vec")
    _bad(lambda: g.instancenorm_backward(vec, vec, None, inst, inst, name="m"), "shape", "m", "vec")
    _bad(lambda: g.layernorm(x, training=1, name="n"), "argument", "n", None)
    wide = g.tensor((2, 3, 4), dtype=torch.float64, name="wide")
    _bad(lambda: g.batchnorm_backward(wide, wide, ch, ch, ch, name="o"), "dtype", "o", "wide")
    assert not g.nodes  # a builder that raises adds nothing


def _norm_zoo() -> Graph:
    g = Graph(name="norm_zoo")
    x, dy = g.tensor((2, 3, 4, 5), name="x"), g.tensor((2, 3, 4, 5), name="dy")
    c = g.tensor((3,), name="c")
    y, m, v = g.layernorm(x, normalized_shape=(4, 5), training=True, name="ln")
    g.set_output(y)
    g.set_output(g.layernorm_backward(dy, x, None, m, v, normalized_shape=(4, 5), name="lnb")[0])
    y, r = g.rmsnorm(x, training=True, name="rms")
    g.set_output(g.rmsnorm_backward(dy, x, None, r, name="rmsb")[1])
    y, m, v = g.batchnorm(x, c, c, name="bn")
    g.set_output(g.batchnorm_backward(dy, x, c, m, v, name="bnb")[2])
    y, m, v = g.instancenorm(x, c, training=True, name="in")
    g.set_output(g.instancenorm_backward(dy, x, c, m, v, name="inb")[1])
    return g


def test_norm_backward_round_trip():
    g = _norm_zoo()
    text = g.serialize()
    records = {n["name"]: n for n in json.loads(text)["nodes"]}
    assert records["ln"]["attrs"]["training"] is True and records["lnb"]["outputs"][0] == "lnb.dx"
    g2 = Graph.deserialize(text)
    assert g2.serialize() == text and [repr(n) for n in g2.nodes] == [repr(n) for n in g.nodes]
    plan = g2.build()
    assert plan.serialize() == type(plan).deserialize(plan.serialize()).serialize()
    check_plan(g2, feeds_for(g2), plan)
    bad = text.replace('"training": true', '"training": "yes"', 1)
    with pytest.raises(GraphError, match="'training' must be a bool"):
        Graph.deserialize(bad)


# Written by tritondnn before the training flag existed (version 1): it must still load and
# serialize to the same document.
OLD_DOCUMENT = (
    '{"format":"tritondnn.graph","version":1,"name":"v1norms","io_dtype":"float32","compute_dtype":"float32",'
    '"intermediate_dtype":"float32","tensors":[{"name":"x","kind":"input","dtype":"float32","shape":[2,3,4],'
    '"stride":[12,4,1]},{"name":"w","kind":"input","dtype":"float32","shape":[4],"stride":[1]}],"nodes":['
    '{"name":"ln","op":"layernorm","inputs":{"x":"x","scale":"w","bias":"w"},"attrs":{"normalized_shape":[4],'
    '"eps":0.0001},"outputs":["ln"]},{"name":"rms","op":"rmsnorm","inputs":{"x":"x","scale":"w"},"attrs":'
    '{"normalized_shape":[4],"eps":1.1920928955078125e-07},"outputs":["rms"]},{"name":"inorm","op":'
    '"instancenorm","inputs":{"x":"x","scale":null,"bias":null},"attrs":{"eps":1e-05},"outputs":["inorm"]},'
    '{"name":"bn","op":"batchnorm","inputs":{"x":"x","scale":null,"bias":null,"running_mean":null,'
    '"running_var":null},"attrs":{"eps":1e-05,"momentum":0.1},"outputs":["bn.y","bn.mean","bn.inv_variance"]}'
    '],"outputs":["ln","rms","inorm","bn.y"]}'
)


def test_documents_from_before_training_flag_still_load():
    g = Graph.deserialize(OLD_DOCUMENT)
    assert [t.name for t in g.outputs] == ["ln", "rms", "inorm", "bn.y"]
    assert all(len(n.outputs) == 1 for n in g.nodes if n.op != "batchnorm")
    assert json.loads(g.serialize()) == json.loads(OLD_DOCUMENT)
