"""Pointwise nodes: every mode in generated kernels against PyTorch, broadcasting, bool values,
runtime scalars, compute dtypes, operators on tensors."""

from __future__ import annotations

import math

import pytest
import torch
from graph_check import check_plan, feeds_for

from helpers import DEVICE, randn
from tritondnn.graph import KERNEL_CACHE_STATS, POINTWISE_OPS, Graph

UNARY = [
    "identity",
    "neg",
    "abs",
    "sqrt",
    "rsqrt",
    "exp",
    "log",
    "reciprocal",
    "square",
    "erf",
    "sin",
    "cos",
    "floor",
    "ceil",
    "sigmoid",
    "tanh",
    "gelu",
    "gelu_tanh",
    "silu",
]
BINARY = ["add", "sub", "mul", "div", "max", "min", "bias", "scale", "pow"]
# Each activation (and its backward) with non-default parameters where it has some.
PARAMS = {
    "relu": {"negative_slope": 0.125, "clip": 1.5},
    "leaky_relu": {"negative_slope": 0.25},
    "elu": {"alpha": 0.5},
    "swish": {"beta": 1.5},
    "softplus": {"beta": 2.0, "threshold": 1.0},
}


def test_table_covers_the_documented_modes():
    documented = UNARY + BINARY + list(PARAMS) + ["select", "logical_and", "logical_or", "logical_not"]
    documented += ["cmp_eq", "cmp_neq", "cmp_gt", "cmp_ge", "cmp_lt", "cmp_le", "batchnorm_inference"]
    documented += [
        f"{a}_backward"
        for a in [
            "relu",
            "leaky_relu",
            "elu",
            "sigmoid",
            "tanh",
            "gelu",
            "gelu_tanh",
            "silu",
            "swish",
            "softplus",
        ]
    ]
    assert sorted(POINTWISE_OPS) == sorted(documented)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_every_mode_in_one_kernel(dtype, poison):
    """All unary, binary and parameterized modes over broadcast operands: one generated kernel
    with one store per mode."""
    g = Graph(io_dtype=dtype)
    a = g.tensor((3, 1, 13), name="a")
    b = g.tensor((5, 13), name="b")
    # A positive operand, away from 0, for sqrt, log, rsqrt, pow and reciprocal (1/a of an fp16
    # sample below 1.5e-5 overflows fp16 where the float64 reference stays finite).
    pos = g.add(g.abs(a), 0.25, name="pos")
    for op in UNARY:
        g.set_output(
            g.pointwise(op, pos if op in ("sqrt", "rsqrt", "log", "reciprocal") else a, name=f"u_{op}")
        )
    b_away = g.add(g.abs(b), 0.25, name="b_away")  # a divisor away from 0 (fp16 overflow, as above)
    for op in BINARY:
        g.set_output(g.pointwise(op, pos if op == "pow" else a, b_away if op == "div" else b, name=f"b_{op}"))
    for op, params in PARAMS.items():
        g.set_output(g.pointwise(op, a, name=f"p_{op}", **params))
        g.set_output(g.pointwise(f"{op}_backward", b, a, name=f"g_{op}", **params))
    for op in ("sigmoid", "tanh", "gelu", "gelu_tanh", "silu"):
        g.set_output(g.pointwise(f"{op}_backward", b, a, name=f"g_{op}"))
    plan, _ = check_plan(g, feeds_for(g))
    # Two kernels: outputs of a's shape (3, 1, 13) cannot be stored by a kernel over (3, 5, 13).
    small, large = len(UNARY) + 2 + len(PARAMS), len(BINARY) + len(PARAMS) + 5 + 2
    assert sorted(len(s.nodes) for s in plan.steps) == sorted([small, large])


def test_comparisons_logical_and_select():
    g = Graph()
    a, b = g.tensor((4, 9), name="a"), g.tensor((9,), name="b")
    outs = [g.pointwise(op, a, b) for op in ("cmp_eq", "cmp_neq", "cmp_gt", "cmp_ge", "cmp_lt", "cmp_le")]
    gt, le = outs[2], outs[5]
    both = g.logical_and(gt, g.cmp_gt(a, 0.0))
    either = g.logical_or(le, g.logical_not(gt))
    as_float = g.cmp_gt(a, b, dtype=torch.float32)  # 1.0 / 0.0
    picked = g.select(gt, a, g.neg(b))
    float_cond = g.select(as_float, b, 2.0)  # a float condition: true where non-zero
    for t in [*outs, both, either, as_float, picked, float_cond]:
        g.set_output(t)
    feeds = feeds_for(g)
    feeds["a"][0, :] = feeds["b"]  # some equal elements
    _, out = check_plan(g, feeds)
    assert out[outs[0]].dtype == torch.bool and out[outs[0]][0].all()


def test_nan_and_inf_propagate():
    g = Graph()
    a, b = g.tensor((6,), name="a"), g.tensor((6,), name="b")
    for t in (g.max(a, b), g.min(a, b), g.relu(a), g.pow(a, b), g.sigmoid(a), g.exp(a)):
        g.set_output(t)
    nan, inf = math.nan, math.inf
    a_t = torch.tensor([nan, 1.0, -inf, inf, 0.0, -2.0], device=DEVICE)
    b_t = torch.tensor([1.0, nan, 2.0, -1.0, -1.0, 3.0], device=DEVICE)
    check_plan(g, {"a": a_t, "b": b_t})


def test_runtime_scalar_changes_without_recompiling():
    g = Graph()
    x = g.tensor((7, 5), name="x")
    alpha = g.scalar(name="alpha")
    g.set_output(g.relu(x * alpha + 1.0))
    plan = g.build()
    before = dict(KERNEL_CACHE_STATS)
    for value in (0.5, -2.0):
        check_plan(g, feeds_for(g, alpha=value), plan)
    assert KERNEL_CACHE_STATS["generated"] == before["generated"]


def test_float64_compute():
    g = Graph(io_dtype=torch.float64, compute_dtype=torch.float64)
    x, y = g.tensor((33,), name="x"), g.tensor((33,), name="y")
    g.set_output(g.gelu(x) * g.tanh(y) + g.softplus(x, beta=0.5) - g.elu(y) / (g.abs(x) + 1.0))
    check_plan(g, feeds_for(g))


def test_mixed_dtypes_and_cast():
    """Inputs of different dtypes, an fp32 intermediate, a bf16 output and a bool input."""
    g = Graph(io_dtype=torch.bfloat16)
    x = g.tensor((4, 6), dtype=torch.float16, name="x")
    y = g.tensor((4, 6), dtype=torch.float32, name="y")
    m = g.tensor((4, 6), dtype=torch.bool, name="m")
    h = g.mul(x, y, dtype=torch.float32)
    g.set_output(g.cast(g.select(m, h, -h), torch.bfloat16))
    g.set_output(g.add(h, m))
    check_plan(g, feeds_for(g))


def test_operators_on_tensors():
    g = Graph()
    x, y = g.tensor((3, 4), name="x"), g.tensor((4,), name="y")
    g.set_output(-(2.0 * x + y) / (y - 3.0) ** 2.0 - 1.0 / (1.0 + x * x))
    check_plan(g, feeds_for(g))


def test_strided_and_channels_last_operands(poison):
    base = randn(4, 6, 5, 5)
    g = Graph()
    x = g.tensor_like(base.to(memory_format=torch.channels_last), name="x")
    sliced = randn(4, 6, 5, 10)[..., ::2]
    y = g.tensor_like(sliced, name="y")
    z = g.tensor((6, 1, 5), name="z")
    out = g.set_output(g.sigmoid(x) * y + z)
    _, res = check_plan(g, feeds_for(g, x=base.to(memory_format=torch.channels_last), y=sliced))
    assert res[out].stride() == base.to(memory_format=torch.channels_last).stride()  # the input's layout


def test_empty_and_scalar_shapes():
    g = Graph()
    e = g.tensor((0, 5), name="e")
    s = g.tensor((), name="s")
    empty = g.set_output(g.exp(e) + 1.0)
    g.set_output(g.sqrt(g.abs(s)))
    fed = g.scalar(name="fed")
    g.set_output(g.mul(fed, 3.0))  # scalars only: a () tensor
    g.set_output(g.reduction(g.add(s, g.exp(fed)), "add"))
    _, out = check_plan(g, {"e": randn(0, 5), "s": randn(), "fed": -0.5})
    assert out[empty].shape == (0, 5)
