"""The partitioner: what fuses into one kernel, what does not and why, the kernel cache, and the
strides generated kernels are bound to."""

from __future__ import annotations

import pytest
import torch
from graph_check import check_plan, feeds_for

from helpers import assert_close, randn
from tritondnn.graph import KERNEL_CACHE_STATS, Graph, GraphError, Plan, reference
from tritondnn.graph import runners as graph_runners


def _kinds(plan) -> list[tuple[str, list[str]]]:
    return [(s.kind, [n.name for n in s.nodes]) for s in plan.steps]


def _dag(g: Graph, shape=(6, 33)):
    """The bench suite's 6-op DAG over 3 inputs with two outputs."""
    x, y, z = (g.tensor(shape, name=n) for n in "xyz")
    h = g.mul(x, y, name="h")
    s = g.sigmoid(z, name="s")
    u = g.add(h, s, name="u")
    out1 = g.gelu(u, name="out1")
    out2 = g.mul(g.tanh(u, name="t"), x, name="out2")
    g.set_output(out1)
    g.set_output(out2)


def test_pointwise_dag_is_one_kernel_with_two_outputs(poison):
    g = Graph()
    _dag(g)
    plan, _ = check_plan(g, feeds_for(g))
    assert _kinds(plan) == [("pointwise", ["h", "s", "u", "out1", "t", "out2"])]
    assert plan.workspace_size == 0
    assert "out1, out2" in plan.explain() and "generated pointwise kernel" in plan.explain()


def test_second_graph_of_the_same_structure_compiles_nothing():
    g1 = Graph(io_dtype=torch.bfloat16)
    _dag(g1, (5, 7))
    g1.build()
    before = KERNEL_CACHE_STATS["generated"]
    g2 = Graph(io_dtype=torch.bfloat16, name="another")
    _dag(g2, (5, 7))
    plan = g2.build()
    assert KERNEL_CACHE_STATS["generated"] == before
    check_plan(g2, feeds_for(g2), plan)
    g3 = Graph(io_dtype=torch.float16)  # another dtype is another kernel
    _dag(g3, (5, 7))
    g3.build()
    assert KERNEL_CACHE_STATS["generated"] == before + 1


def test_small_node_used_inside_is_recomputed_but_an_output_one_is_not():
    g = Graph()
    x = g.tensor((4, 3, 5), name="x")
    b1, b2 = g.tensor((3, 1), name="b1"), g.tensor((3, 1), name="b2")
    bsum = g.add(b1, b2, name="bsum")
    y = g.set_output(g.relu(x + bsum, name="y"))
    plan, _ = check_plan(g, feeds_for(g))
    assert len(plan.steps) == 1
    g.set_output(bsum)  # now it must be stored at its own shape: its own kernel
    plan, _ = check_plan(g, feeds_for(g))
    assert len(plan.steps) == 2 and "bsum" in plan.explain().split("not fused:")[1]
    assert y.shape == (4, 3, 5)


def test_fusion_never_makes_a_cycle():
    """a -> matmul -> sigmoid -> b and a -> b: a and b cannot share a kernel."""
    g = Graph()
    x, w = g.tensor((8, 8), name="x"), g.tensor((8, 8), name="w")
    a = g.mul(x, 2.0, name="a")
    m = g.set_output(g.matmul(a, w, name="m"))
    b = g.set_output(g.mul(g.sigmoid(m, name="sg"), a, name="b"))
    plan, _ = check_plan(g, feeds_for(g))
    assert _kinds(plan) == [("pointwise", ["a"]), ("matmul", ["m"]), ("pointwise", ["sg", "b"])]
    assert "cycle" in plan.explain()
    assert b.shape == (8, 8)


def test_matmul_epilogue_alpha_c_bias_activation_residual():
    g = Graph()
    a, w = g.tensor((2, 9, 16), name="a"), g.tensor((16, 12), name="w")
    c, bias, r = g.tensor((9, 12), name="c"), g.tensor((12,), name="bias"), g.tensor((2, 9, 12), name="r")
    mm = g.matmul(a, w, name="mm")
    y = g.add(g.relu(g.bias(g.add(g.scale(mm, 0.5), c), bias), negative_slope=0.1), r, name="y")
    g.set_output(y)
    plan, _ = check_plan(g, feeds_for(g))
    assert len(plan.steps) == 1 and plan.steps[0].kind == "matmul"
    fold = plan.steps[0].fold
    assert fold["alpha"] == 0.5 and fold["c"].name == "c" and fold["bias"].name == "bias"
    assert fold["residual"].name == "r" and fold["activation"] == "relu"


@pytest.mark.parametrize(
    "act, params",
    [
        ("leaky_relu", {"negative_slope": 0.2}),
        ("elu", {"alpha": 0.7}),
        ("sigmoid", {}),
        ("tanh", {}),
        ("gelu", {}),
        ("gelu_tanh", {}),
        ("silu", {}),
        ("swish", {"beta": 1.3}),
        ("softplus", {"beta": 2.0, "threshold": 3.0}),
    ],
)
def test_matmul_epilogue_every_activation(act, params):
    g = Graph()
    a, w, b = g.tensor((7, 10), name="a"), g.tensor((10, 6), name="w"), g.tensor((1, 6), name="b")
    g.set_output(g.pointwise(act, g.bias(g.matmul(a, w), b), **params))
    plan, _ = check_plan(g, feeds_for(g))
    assert len(plan.steps) == 1


def test_epilogue_stops_where_it_must():
    g = Graph()
    a, w, b = g.tensor((5, 8), name="a"), g.tensor((8, 4), name="w"), g.tensor((4,), name="b")
    h = g.gelu(g.bias(g.matmul(a, w, name="mm"), b, name="hb"), name="h")
    g.set_output(g.exp(h, name="e1"))  # h read twice: the epilogue ends at h
    g.set_output(g.sub(h, 1.0, name="e2"))
    g.set_output(g.scale(g.matmul(a, w, name="mm2"), g.scalar(name="s"), name="runtime"))  # not a constant
    plan, _ = check_plan(g, feeds_for(g))
    assert ("matmul", ["mm", "hb", "h"]) in _kinds(plan)
    assert ("pointwise", ["e1", "e2"]) in _kinds(plan)
    text = plan.explain()
    assert "read by 2 nodes" in text and "constant scalar" in text


def test_conv_epilogue_channels_last(poison):
    g = Graph()
    x = g.tensor((2, 4, 7, 7), layout="channels_last", name="x")
    w = g.tensor((6, 4, 3, 3), layout="channels_last", name="w")
    b = g.tensor((6, 1, 1), name="b")
    r = g.tensor((2, 6, 7, 7), layout="channels_last", name="r")
    g.set_output(g.relu(g.bias(g.conv_fprop(x, w, padding=1), b)) + r)
    plan, out = check_plan(g, feeds_for(g))
    assert len(plan.steps) == 1 and plan.steps[0].fold["residual"].name == "r"
    assert next(iter(out.values())).is_contiguous(memory_format=torch.channels_last)
    check_plan(g, feeds_for(g), plan)  # fresh values through the convolution's bound plan


def _scale_bias_relu_conv(g: Graph, layout: str = "channels_last"):
    """relu(conv(relu(x * s + sh)) + b): batch norm's apply and ReLU before a convolution."""
    x = g.tensor((2, 5, 7, 6), layout=layout, name="x")
    w = g.tensor((6, 5, 3, 3), layout=layout, name="w")
    s, sh, b = g.tensor((1, 5, 1, 1), name="s"), g.tensor((5, 1, 1), name="sh"), g.tensor((6, 1, 1), name="b")
    h = g.relu(g.bias(g.scale(x, s, name="scaled"), sh, name="shifted"), name="act")
    return g.relu(g.bias(g.conv_fprop(h, w, padding=1, name="conv"), b, name="hb"), name="y")


@pytest.mark.parametrize("layout", ["channels_last", "contiguous"])
def test_scale_bias_relu_folds_into_the_next_convolution(poison, layout):
    """cuDNN's scale-bias-relu-conv (the "fused_prologue" variant): the per-channel scale, shift
    and ReLU before a convolution run as it reads its input (one kernel with the bias + ReLU
    epilogue), against the float64 reference, twice (fresh values through the bound plan). Fast
    mode keeps them a kernel of their own and says the fold exists; fallback runs a kernel a node."""
    g = Graph()
    g.set_output(_scale_bias_relu_conv(g, layout))
    plan, _ = check_plan(g, feeds_for(g), Plan(g, "fast", "fused_prologue"))
    assert _kinds(plan) == [("conv_fprop", ["scaled", "shifted", "act", "conv", "hb", "y"])]
    assert "folded into the convolution's input" in plan.explain()
    check_plan(g, feeds_for(g), plan)
    fast, _ = check_plan(g, feeds_for(g))
    assert _kinds(fast) == [("pointwise", ["scaled", "shifted", "act"]), ("conv_fprop", ["conv", "hb", "y"])]
    assert "could fold into the convolution's input" in fast.explain()
    assert len(check_plan(g, feeds_for(g), mode="fallback")[0].steps) == 6


def test_scale_bias_relu_fold_in_benchmark_mode_and_serialized():
    """Benchmark mode times the three partitions (whichever wins, the values are right) and lists
    them; a plan with the fold serializes and loads with it."""
    g = Graph()
    g.set_output(_scale_bias_relu_conv(g))
    plan, _ = check_plan(g, feeds_for(g), mode="benchmark")
    assert sorted(c.name for c in plan.candidates()) == ["fused", "fused_prologue", "unfused"]
    assert all(c.measured_ms is not None for c in plan.candidates())
    plan, _ = check_plan(g, feeds_for(g), Plan(g, "fast", "fused_prologue"))
    assert plan.steps[0].fold["prologue"]["relu"]
    again = Plan.deserialize(plan.serialize())
    assert again.variant == "fused_prologue" and _kinds(again) == _kinds(plan)
    check_plan(g, feeds_for(g), again)


def test_scale_bias_relu_fold_reads_strided_parameters():
    """A scale declared with strides (2, 1, 1) and a shift sliced out of a wider tensor reach the
    kernel as (C,) contiguous values."""
    g = Graph()
    x = g.tensor((2, 4, 6, 6), name="x")
    w = g.tensor((4, 4, 3, 3), name="w")
    s = g.tensor((4, 1, 1), stride=(2, 1, 1), name="s")
    wide = g.tensor((4, 2, 1), name="wide")
    sh = g.slice(wide, 1, 0, 1, name="sh")
    g.set_output(g.conv_fprop(g.relu(g.bias(g.scale(x, s), sh)), w, padding=1, name="conv"))
    plan, _ = check_plan(g, feeds_for(g), Plan(g, "fast", "fused_prologue"))
    assert "prologue" in next(s.fold for s in plan.steps if s.kind == "conv_fprop")


def test_a_serialized_prologue_step_runs_on_the_implicit_gemm_only():
    import json

    g = Graph()
    g.set_output(_scale_bias_relu_conv(g))
    data = json.loads(Plan(g, "fast", "fused_prologue").serialize())
    data["steps"][0]["engine"] = "boxed_gemm"
    with pytest.raises(GraphError, match="implicit_gemm"):
        Plan.deserialize(json.dumps(data))


def test_scale_bias_relu_fold_under_autograd():
    """Feeds that need gradients take the chain in torch, then conv2d: the same values, and x's
    gradient through the chain as the float64 reference's."""
    g = Graph()
    g.set_output(_scale_bias_relu_conv(g))
    feeds = feeds_for(g)
    x = feeds["x"].detach().requires_grad_(True)
    out = Plan(g, "fast", "fused_prologue").execute({**feeds, "x": x})["y"]
    x64 = feeds["x"].detach().double().requires_grad_(True)
    ref = reference(g, {**feeds, "x": x64}, torch.float64)["y"]
    assert_close(out.detach(), ref.detach(), reference(g, {**feeds, "x": x.detach()})["y"])
    dy = torch.randn_like(out)
    out.backward(dy)
    ref.backward(dy.double())
    x32 = feeds["x"].detach().requires_grad_(True)
    reference(g, {**feeds, "x": x32})["y"].backward(dy)
    assert_close(x.grad, x64.grad, x32.grad)


def test_what_does_not_fold_into_a_convolution_input():
    """The chain stops at a tensor read twice or a graph output (the ReLU after it folds alone),
    at a leaky ReLU, at a full-shape operand, and at links out of order (a scale after the ReLU
    folds alone)."""
    g = Graph()
    x = g.tensor((2, 4, 6, 6), name="x")
    w = g.tensor((4, 4, 3, 3), name="w")
    s = g.tensor((4, 1, 1), name="s")
    full = g.tensor((2, 4, 6, 6), name="full")
    shared = g.relu(g.scale(x, s, name="s1"), name="r1")
    g.set_output(g.conv_fprop(shared, w, padding=1, name="c1"))
    g.set_output(g.conv_fprop(shared, w, padding=1, name="c2"))  # r1 read twice
    g.set_output(g.conv_fprop(g.leaky_relu(x, 0.1, name="leaky"), w, name="c3"))
    g.set_output(g.conv_fprop(g.add(x, full, name="plus"), w, name="c4"))
    g.set_output(g.conv_fprop(g.scale(g.relu(x, name="r5"), s, name="s5"), w, name="c5"))
    shown = g.set_output(g.bias(x, s, name="b6"))  # a graph output
    g.set_output(g.conv_fprop(g.relu(shown, name="r6"), w, name="c6"))
    plan, _ = check_plan(g, feeds_for(g), Plan(g, "fast", "fused_prologue"))
    kinds = _kinds(plan)
    for name in ("c1", "c2", "c3", "c4"):
        assert ("conv_fprop", [name]) in kinds
    assert ("conv_fprop", ["s5", "c5"]) in kinds and ("conv_fprop", ["r6", "c6"]) in kinds
    assert any(kind == "pointwise" and "r5" in names for kind, names in kinds)


def test_norm_folds():
    g = Graph()
    x, r = g.tensor((6, 16), name="x"), g.tensor((6, 16), name="r")
    w, b = g.tensor((16,), name="w"), g.tensor((16,), name="b")
    total = g.add(x, r, name="total")
    ln = g.layernorm(total, w, b, name="ln")
    g.set_output(total)  # add_layer_norm returns the sum too
    g.set_output(ln)
    g.set_output(g.gelu_tanh(g.rmsnorm(x, w, eps=1e-6, name="rms"), name="act"))
    g.set_output(g.elu(g.layernorm(r, name="ln2"), name="elu"))  # elu does not fold
    plan, _ = check_plan(g, feeds_for(g))
    kinds = _kinds(plan)
    assert ("layernorm", ["total", "ln"]) in kinds and ("rmsnorm", ["rms", "act"]) in kinds
    assert ("pointwise", ["elu"]) in kinds


@pytest.mark.parametrize(
    "mode", ["add", "mul", "min", "max", "amax", "avg", "norm1", "norm2", "mul_no_zeros"]
)
def test_reduction_after_pointwise_is_one_kernel(mode):
    g = Graph()
    x, y = g.tensor((3, 5, 6), name="x"), g.tensor((5, 1), name="y")
    h = g.set_output(g.mul(x, y, name="h"))  # stored by the same kernel
    g.set_output(g.reduction(h, mode, dim=[0, 2], name="red"))
    g.set_output(g.reduction(h, "add", dim=[0, 2], keepdim=False, name="red2"))
    plan, _ = check_plan(g, feeds_for(g))
    assert _kinds(plan) == [("reduce", ["h", "red", "red2"])]


def test_reductions_over_other_dimensions_split_the_group():
    g = Graph()
    x = g.tensor((4, 3, 2, 5), name="x")
    e = g.exp(x * 0.5, name="e")
    g.set_output(g.reduction(e, "add", dim=[1, 3], name="r13"))
    s1, s2 = g.genstats(g.abs(x, name="ab"), name="gs")
    g.set_output(s1)
    g.set_output(s2)
    g.set_output(g.reduction(x, "avg", dim=0, name="plain"))  # no pointwise: the library op
    plan, _ = check_plan(g, feeds_for(g))
    kinds = _kinds(plan)
    assert ("reduce", ["ab", "gs"]) in kinds and ("reduction", ["plain"]) in kinds


def test_fallback_mode_runs_one_kernel_per_node():
    g = Graph()
    _dag(g)
    plan, _ = check_plan(g, feeds_for(g), mode="fallback")
    assert len(plan.steps) == 6 and plan.variant == "unfused"


def test_wrong_layout_prediction_rebinds(monkeypatch):
    """A library output with other strides than predicted: the kernel reading it binds again."""
    real = graph_runners.predict_layouts

    def wrong(step, layouts):  # column-major 2-D strides instead of row-major
        return {uid: (1, step.nodes[-1].outputs[0].shape[0]) for uid in real(step, layouts)}

    monkeypatch.setattr("tritondnn.graph.plan.predict_layouts", wrong)
    g = Graph()
    x, w = g.tensor((6, 16), name="x"), g.tensor((16,), name="w")
    g.set_output(g.exp(g.layernorm(x, w)) * 2.0)
    plan, _ = check_plan(g, feeds_for(g))
    runner = plan._runners[1]
    assert len(runner._bound) == 2  # the predicted layout, then the real one
    check_plan(g, feeds_for(g), plan)
    assert len(runner._bound) == 2


def test_view_operands_feed_kernels_in_place():
    g = Graph()
    x = g.tensor((4, 6), name="x")
    t = g.transpose(x, 0, 1, name="tr")
    s = g.slice(t, 0, 1, 6, 2, name="sl")
    g.set_output(g.sigmoid(s, name="out"))
    plan, _ = check_plan(g, feeds_for(g, x=randn(4, 6)))
    assert [s.kind for s in plan.steps] == ["view", "view", "pointwise"]
