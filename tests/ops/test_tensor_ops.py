"""OpTensor: every op and dtype with broadcasting, alpha/beta, out=, layouts, gradients, errors."""

from __future__ import annotations

import pytest
import torch

import tritondnn.ops.tensor_ops as to
from helpers import DEVICE, DTYPES, LAYOUTS, assert_close, randn

BINARY = ["add", "sub", "mul", "div", "min", "max"]
UNARY = ["sqrt", "neg", "not"]


def _torch(a, b, op, a1, a2):
    """PyTorch in the operands' own dtype (the accuracy baseline)."""
    x = a * a1
    y = b * a2 if b is not None else None
    return {
        "add": lambda: x + y, "sub": lambda: x - y, "mul": lambda: x * y, "div": lambda: x / y,
        "min": lambda: torch.minimum(x, y), "max": lambda: torch.maximum(x, y),
        "sqrt": lambda: torch.sqrt(x), "neg": lambda: -x, "not": lambda: 1 - x,
    }[op]()  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", BINARY + UNARY)
def test_values_and_gradients(op, dtype, poison):
    a = randn(4, 1, 7, 3, dtype=dtype)
    b = randn(5, 1, 3, dtype=dtype) if op in BINARY else None
    if op == "sqrt":
        a = a.abs() + 0.1
    if op == "div":
        b = b.sign() * (b.abs() + 0.5)
    a1, a2 = 0.5, -1.5
    ag = a.clone().requires_grad_(True)
    bg = b.clone().requires_grad_(True) if b is not None else None
    y = to.op_tensor(ag, bg, op, alpha1=a1, alpha2=a2)
    a64 = a.double().requires_grad_(True)
    b64 = b.double().requires_grad_(True) if b is not None else None
    ref = to.op_tensor_reference(a64, b64, op, a1, a2)
    assert y.dtype == dtype
    assert_close(y, ref, _torch(a, b, op, a1, a2), f"{op} forward")
    dy = randn(*y.shape, dtype=dtype)
    ins = (ag, bg) if b is not None else (ag,)
    ins64 = (a64, b64) if b is not None else (a64,)
    ours = torch.autograd.grad(y, ins, dy)
    refs = torch.autograd.grad(ref, ins64, dy.double())
    at = a.clone().requires_grad_(True)
    bt = b.clone().requires_grad_(True) if b is not None else None
    tins = (at, bt) if b is not None else (at,)
    theirs = torch.autograd.grad(_torch(at, bt, op, a1, a2), tins, dy)
    for g, r, t in zip(ours, refs, theirs):
        assert_close(g, r, t, f"{op} backward")


def test_beta_out_and_promotion(poison):
    a, b = randn(6, 5, dtype=torch.float16), randn(5, dtype=torch.float32)
    c = randn(5, 6).t()  # a transposed destination
    c0 = c.clone()
    out = to.op_tensor(a, b, "mul", alpha1=2.0, beta=0.5, out=c)
    assert out is c and c.dtype == torch.float32
    assert_close(c, to.op_tensor_reference(a, b, "mul", 2.0, 1.0, 0.5, c0))
    y = to.op_tensor(a, b, "add")
    assert y.dtype == torch.float32


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts(layout):
    a = LAYOUTS[layout](randn(3, 5, 7, 11))
    b = randn(1, 5, 1, 11)
    y = to.op_tensor(a, b, "max")
    assert_close(y, to.op_tensor_reference(a, b, "max"))


def test_many_dims_fallback():
    a = randn(2, 3, 4, 5, 6, 7)[:, ::2, :, ::2, :, ::2]
    b = randn(1, 1, 4, 1, 6, 1)
    assert_close(to.op_tensor(a, b, "sub"), to.op_tensor_reference(a, b, "sub"))


def test_nan_propagates():
    a = torch.tensor([1.0, float("nan"), 2.0, 0.0], device=DEVICE)
    b = torch.tensor([float("nan"), 1.0, 3.0, -0.5], device=DEVICE)
    for op, fn in (("min", torch.minimum), ("max", torch.maximum)):
        assert torch.equal(to.op_tensor(a, b, op).isnan(), fn(a, b).isnan())


def test_empty():
    assert to.op_tensor(randn(0, 3), randn(3), "add").shape == (0, 3)


def test_errors():
    a = randn(3, 4)
    with pytest.raises(ValueError, match="binary"):
        to.op_tensor(a, None, "add")
    with pytest.raises(ValueError, match="unary"):
        to.op_tensor(a, a, "sqrt")
    with pytest.raises(ValueError, match="broadcast"):
        to.op_tensor(a, randn(5), "add")
    with pytest.raises(ValueError, match="beta"):
        to.op_tensor(a, a, "add", beta=1.0)
    with pytest.raises(ValueError, match="out"):
        to.op_tensor(a, a, "add", out=randn(4, 3))
    with pytest.raises(ValueError, match="op"):
        to.op_tensor(a, a, "pow")
    with pytest.raises(TypeError, match="dtype"):
        to.op_tensor(torch.ones(3, dtype=torch.int32, device=DEVICE), None, "neg")
    with pytest.raises(RuntimeError, match="autograd"):
        to.op_tensor(a.requires_grad_(True), a, "add", out=randn(3, 4))
