"""Building and validating graphs: declarations, inferred shapes, and every rule's error, which
names the node, the tensor and the rule."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import ON_GPU
from tritondnn.graph import Graph, GraphDtypeError, GraphError


def _raises(rule: str, *names: str):
    """A context checking that a GraphError of ``rule`` is raised and its message names ``names``."""

    class Check:
        def __enter__(self):
            self.ctx = pytest.raises(GraphError)
            self.info = self.ctx.__enter__()
            return self

        def __exit__(self, *exc):
            handled = self.ctx.__exit__(*exc)
            err = self.info.value
            assert err.rule == rule, str(err)
            assert f"[rule: {rule}]" in str(err)
            for name in names:
                assert f"'{name}'" in str(err), (name, str(err))
            return handled

    return Check()


def test_declarations():
    g = Graph(io_dtype=torch.float16)
    x = g.tensor((2, 3, 4, 5), layout="channels_last", name="x")
    assert x.stride == (60, 1, 15, 3) and x.dtype == torch.float16 and x.kind == "input"
    y = g.tensor((4, 5), stride=(1, 4), dtype=torch.float32)
    assert y.name == "t1" and y.stride == (1, 4)
    z = g.tensor_like(torch.empty(3, 8)[:, ::2], name="z")
    assert z.shape == (3, 4) and z.stride == (8, 2)
    s = g.scalar(2.5)
    assert s.is_scalar and s.value == 2.5 and g["x"] is x
    fed = g.scalar(name="alpha")
    assert fed in g.inputs and s not in g.inputs


def test_inferred_shapes_and_dtypes():
    g = Graph(io_dtype=torch.bfloat16, intermediate_dtype=torch.float32)
    a, b = g.tensor((5, 1, 7, 3), name="a"), g.tensor((4, 3, 2), name="b")
    mm = g.matmul(a, b, name="mm")
    assert mm.shape == (5, 4, 7, 2) and mm.dtype == torch.bfloat16
    h = g.add(mm, g.tensor((2,), name="bias"))
    assert h.shape == mm.shape and h.dtype == torch.float32  # the intermediate dtype
    assert g.cmp_gt(h, 0.0).dtype == torch.bool
    x = g.tensor((2, 3, 10, 11), name="x")
    assert g.conv_fprop(x, g.tensor((8, 3, 3, 3), name="w"), stride=2, padding=1).shape == (2, 8, 5, 6)
    assert g.pool(x, "max", 3, 2, ceil_mode=True).shape == (2, 3, 5, 5)
    assert g.resample(x, scale_factor=1.5).shape == (2, 3, 15, 16)
    assert g.reduction(x, "avg", dim=(1, -1)).shape == (2, 1, 10, 1)
    assert g.reduction(x, "max", keepdim=False).shape == ()
    assert g.conv_dgrad(g.tensor((2, 8, 5, 6), name="dy"), g["w"], stride=2, padding=1).shape == (2, 3, 9, 11)


def test_every_error_names_node_tensor_and_rule():
    g = Graph()
    x, w = g.tensor((4, 5), name="x"), g.tensor((6, 7), name="w")
    with _raises("shape", "mm", "w"):
        g.matmul(x, w, name="mm")
    with _raises("shape", "sum", "w"):
        g.add(x, w, name="sum")
    with _raises("dtype", "mm2", "h") as check:
        g.matmul(x, g.tensor((5, 2), dtype=torch.float16, name="h"), name="mm2")
    assert isinstance(check.info.value, TypeError)
    with _raises("dtype", "bad"):
        g.layernorm(g.tensor((3, 4), dtype=torch.float64, name="d64"), name="bad")
    with _raises("shape", "conv"):
        g.conv_fprop(g.tensor((1, 3, 5, 5), name="img"), g.tensor((4, 2, 3, 3), name="k"), name="conv")
    with _raises("shape", "norm", "sc"):
        g.layernorm(x, g.tensor((4,), name="sc"), name="norm")
    with _raises("argument", "relu9"):
        g.relu(x, slope=1.0, name="relu9")
    with _raises("argument", "p"):
        g.pointwise("nope", x, name="p")
    with _raises("argument", "bn"):
        g.batchnorm(g.tensor((4, 2, 3), name="bx"), running_mean=g.tensor((2,), name="rm"), name="bn")
    with _raises("name"):
        g.tensor((1,), name="x")
    with _raises("name"):
        g.exp(x, name="x")  # the output tensor's name is taken
    other = Graph(name="other")
    with _raises("graph", "e", "y"):
        g.exp(other.tensor((2,), name="y"), name="e")
    with _raises("shape", "rd"):
        g.reduction(x, "max", dim=5, name="rd")
    with _raises("shape"):
        g.tensor((2, -1))
    with _raises("dtype"):
        g.tensor((2,), dtype=torch.int32)


def test_layout_rules():
    g = Graph()
    with _raises("layout"):
        g.tensor((2, 3), stride=(1,))
    with _raises("layout"):
        g.tensor((2, 3), layout="channels_last")
    with _raises("layout"):
        g.tensor((2, 3), layout="nhwc")
    with _raises("layout"):
        g.tensor((2, 3), stride=(3, 1), layout="contiguous")


def test_whole_graph_rules():
    g = Graph()
    x = g.tensor((3,), name="x")
    g.tensor((3,), name="unused")
    y = g.exp(x, name="y")
    with _raises("missing output"):
        g.validate()
    g.set_output(y)
    with _raises("unused input", "unused"):
        g.validate()
    g2 = Graph()
    a = g2.tensor((3,), name="a")
    g2.set_output(g2.exp(a, name="kept"))
    g2.sqrt(a, name="dead")
    with _raises("missing output", "dead"):
        g2.validate()
    g3 = Graph()
    a = g3.tensor((3,), name="a")
    b = g3.exp(a, name="b")
    c = g3.exp(b, name="c")
    g3.set_output(c)
    g3.nodes[0].inputs = (c,)  # b now reads c, which is made from b: a cycle
    with _raises("cycle", "b"):
        g3.validate()


def test_set_output_rules():
    g = Graph()
    x = g.tensor((3,), name="x")
    with _raises("graph"):
        g.set_output(x)
    y = g.exp(x, name="y")
    g.exp(y, name="z")
    with _raises("dtype", "y"):
        g.set_output(y, dtype=torch.float16)  # already used at its dtype
    n = g.set_output(g.layernorm(g.tensor((2, 3), name="v"), name="n"))
    with _raises("dtype", "n"):
        g.set_output(n, dtype=torch.float16)
    r = g.set_output(g.sigmoid(x, name="r"), dtype=torch.bfloat16)
    assert r.dtype == torch.bfloat16 and r.is_output


def test_check_support_returns_reasons():
    g = Graph()
    g.tensor((2,), name="x")
    reasons = g.check_support()
    assert len(reasons) == 1 and "missing output" in reasons[0]
    g.set_output(g.exp(g["x"]))
    assert g.check_support() == []
    h = Graph(io_dtype=torch.bfloat16)
    h.set_output(h.matmul(h.tensor((4, 4), name="a"), h.tensor((4, 4), name="b")))
    assert (h.check_support() == []) == ON_GPU  # the interpreter cannot do bf16 dot


def test_repr_and_params():
    g = Graph(name="demo")
    x = g.tensor((2, 2), name="x")
    y = g.set_output(g.relu(x, clip=None, name="r"))
    assert y.producer.attrs["params"] == [0.0, math.inf]
    text = repr(g)
    assert "Graph 'demo'" in text and "r: relu(a=x) -> r" in text and "output r" in text
    with pytest.raises(GraphDtypeError):
        Graph(compute_dtype=torch.float16)
