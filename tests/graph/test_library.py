"""Library nodes (run by tritondnn's ops): convolutions, norms, attention, pooling, resampling,
layout nodes, genstats, reductions; each executed and compared with PyTorch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from graph_check import check_plan, feeds_for

from helpers import assert_close, randn
from tritondnn.graph import Graph, Plan


def test_conv_forward_and_gradients():
    g = Graph()
    x = g.tensor((2, 4, 6, 7), name="x")
    w = g.tensor((6, 2, 3, 3), name="w")
    y = g.set_output(g.conv_fprop(x, w, stride=(2, 1), padding=1, dilation=(1, 2), groups=2, name="y"))
    assert y.shape == (2, 6, 3, 5)
    dy = g.tensor((2, 6, 3, 5), name="dy")
    g.set_output(g.conv_dgrad(dy, w, (2, 4, 6, 7), stride=(2, 1), padding=1, dilation=(1, 2), groups=2))
    g.set_output(g.conv_wgrad(x, dy, 3, stride=(2, 1), padding=1, dilation=(1, 2), groups=2))
    x1 = g.tensor((2, 3, 9), name="x1")
    g.set_output(g.conv_fprop(x1, g.tensor((5, 3, 2), name="w1")))  # 1-D
    check_plan(g, feeds_for(g))


def test_batchnorm_training_updates_running_statistics():
    g = Graph()
    x = g.tensor((4, 3, 5, 2), layout="channels_last", name="x")
    scale, bias = g.tensor((3,), name="scale"), g.tensor((1, 3, 1, 1), name="bias")
    rm, rv = g.tensor((3,), name="rm"), g.tensor((3,), name="rv")
    y, mean, inv_var = g.batchnorm(x, scale, bias, rm, rv, eps=1e-3, momentum=0.2)
    for t in (g.relu(y), mean, inv_var):
        g.set_output(t)
    feeds = feeds_for(g, rm=randn(3), rv=randn(3).abs() + 0.5)
    rm0, rv0 = feeds["rm"].clone(), feeds["rv"].clone()
    plan, _ = check_plan(g, feeds)
    assert plan.steps[0].fold["activation"] == "relu"
    ref_rm, ref_rv = rm0.clone(), rv0.clone()
    F.batch_norm(feeds["x"], ref_rm, ref_rv, None, None, True, 0.2, 1e-3)
    assert_close(feeds["rm"], ref_rm.double(), ref_rm, "running_mean")  # updated once, in place
    assert_close(feeds["rv"], ref_rv.double(), ref_rv, "running_var")


@pytest.mark.parametrize("param_shape", [(5,), (1, 5, 1, 1)])
def test_batchnorm_inference_fuses_with_pointwise(param_shape):
    g = Graph()
    x = g.tensor((2, 5, 3, 4), name="x")
    mean, inv_var = g.tensor(param_shape, name="mean"), g.tensor(param_shape, name="inv_var")
    scale = g.tensor(param_shape, name="scale")
    g.set_output(g.relu(g.batchnorm_inference(x, mean, inv_var, scale) + 1.0))
    plan, _ = check_plan(g, feeds_for(g))
    assert len(plan.steps) == 1


def test_norms():
    g = Graph()
    x = g.tensor((3, 4, 10), name="x")
    w2, b2 = g.tensor((4, 10), name="w2"), g.tensor((4, 10), name="b2")
    g.set_output(g.layernorm(x, w2, b2, normalized_shape=(4, 10), eps=1e-4))
    g.set_output(g.rmsnorm(x))
    img = g.tensor((2, 4, 3, 5), name="img")
    g.set_output(g.sigmoid(g.instancenorm(img, g.tensor((4,), name="iw"), g.tensor((4,), name="ib"))))
    check_plan(g, feeds_for(g))


def test_attention_forward_stats_and_backward():
    g = Graph()
    q, k, v = (
        g.tensor((2, 4, 8, 16), name="q"),
        g.tensor((2, 2, 12, 16), name="k"),
        g.tensor((2, 2, 12, 8), name="v"),
    )
    o, stats = g.sdpa(q, k, v, scale=0.3, enable_gqa=True, return_stats=True, name="att")
    assert o.shape == (2, 4, 8, 8) and stats.shape == (2, 4, 8)
    do = g.tensor((2, 4, 8, 8), name="do")
    grads = g.sdpa_backward(q, k, v, o, do, stats, scale=0.3, enable_gqa=True, name="bwd")
    mask = g.tensor((8, 12), dtype=torch.bool, name="mask")
    for t in (o, stats, *grads, g.sdpa(q, k, v, mask, enable_gqa=True, name="masked")):
        g.set_output(t)
    feeds = feeds_for(g)
    feeds["mask"][:, 0] = True  # every row sees a key
    check_plan(g, feeds)


def test_causal_attention():
    g = Graph()
    q, k, v = (g.tensor((1, 2, 9, 8), name=n) for n in "qkv")
    g.set_output(g.sdpa(q, k, v, is_causal=True))
    check_plan(g, feeds_for(g))


def test_pool_and_resample():
    g = Graph()
    x = g.tensor((2, 3, 9, 8), layout="channels_last", name="x")
    for t in (
        g.pool(x, "max", 3, 2, 1, dilation=1, ceil_mode=True),
        g.pool(x, "avg", (2, 3), (2, 2), (1, 0), count_include_pad=False),
        g.resample(x, (5, 11), mode="bilinear", align_corners=True),
        g.resample(x, scale_factor=2.0),
        g.pool(g.tensor((2, 3, 10), name="x1"), "max", 2),
    ):
        g.set_output(t)
    check_plan(g, feeds_for(g))


def test_layout_nodes():
    g = Graph()
    x = g.tensor((2, 3, 4), name="x")
    r = g.reshape(x, (6, -1), name="r")
    assert r.shape == (6, 4)
    p = g.permute(x, (2, 0, 1), name="p")
    s = g.slice(x, -1, 1, None, 2, name="s")
    assert s.shape == (2, 3, 2)
    c = g.concatenate([x, g.exp(x), g.transpose(g.transpose(x, 0, 1), 0, 1)], dim=1, name="c")
    m = g.concatenate([g.cmp_gt(x, 0.0), g.cmp_lt(x, 0.0)], dim=0, name="m")
    for t in (r, p, s, c, m):
        g.set_output(t)
    _, out = check_plan(g, feeds_for(g))
    assert out["r"].data_ptr() != 0 and out["c"].shape == (2, 9, 4) and out["m"].dtype == torch.bool


def test_genstats_and_reductions_in_other_dtypes():
    g = Graph(io_dtype=torch.bfloat16)
    x = g.tensor((3, 4, 5), name="x")
    s, sq = g.genstats(x, name="gs")
    assert s.shape == (1, 4, 1) and s.dtype == torch.float32
    g.set_output(s)
    g.set_output(sq)
    g.set_output(g.reduction(x, "norm2", dim=(0, 2), dtype=torch.float32, name="n2"))  # generated: new dtype
    g.set_output(g.reduction(x, "max", dim=-1, keepdim=False, name="mx"))  # the library op
    plan, _ = check_plan(g, feeds_for(g))
    assert sorted(s.kind for s in plan.steps) == ["reduce", "reduce", "reduction"]


@pytest.mark.gpu_only("Triton's interpreter computes bf16 tl.dot wrongly")
def test_bf16_matmul_and_conv_epilogues():
    g = Graph(io_dtype=torch.bfloat16)
    a, w, b = g.tensor((64, 96), name="a"), g.tensor((96, 80), name="w"), g.tensor((80,), name="b")
    g.set_output(g.gelu(g.bias(g.matmul(a, w), b)))
    x = g.tensor((2, 16, 9, 9), layout="channels_last", name="x")
    k = g.tensor((16, 16, 3, 3), layout="channels_last", name="k")
    g.set_output(g.relu(g.bias(g.conv_fprop(x, k, padding=1), g.tensor((16, 1, 1), name="cb"))) + x)
    plan, _ = check_plan(g, feeds_for(g))
    assert len(plan.steps) == 2


@pytest.mark.gpu_only("Triton's interpreter computes bf16 tl.dot wrongly")
def test_bf16_scale_bias_relu_before_a_convolution():
    """Batch norm's apply and ReLU folded into a bf16 convolution's input (channels-last, 64
    channels: the K walk by tap and channel block; 3 channels: by row windows)."""
    g = Graph(io_dtype=torch.bfloat16)
    for c in (64, 3):
        x = g.tensor((4, c, 14, 14), layout="channels_last", name=f"x{c}")
        k = g.tensor((32, c, 3, 3), layout="channels_last", name=f"k{c}")
        s, sh = g.tensor((c, 1, 1), name=f"s{c}"), g.tensor((c, 1, 1), name=f"sh{c}")
        h = g.relu(g.bias(g.scale(x, s), sh))
        g.set_output(g.conv_fprop(h, k, padding=1, name=f"conv{c}"))
    plan, _ = check_plan(g, feeds_for(g), Plan(g, "fast", "fused_prologue"))
    assert [len(s.nodes) for s in plan.steps] == [4, 4]
