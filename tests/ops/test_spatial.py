"""affine_grid and grid_sample: both align_corners, zeros/border padding, gradients of input, grid
and theta, deterministic mode, layouts, errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tritondnn as tdnn
import tritondnn.ops.spatial as sp
from helpers import DEVICE, DTYPES, assert_close, randn


def _grads(fn, inputs, dy):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    y = fn(*leaves)
    return (y.detach(), *torch.autograd.grad(y, leaves, dy))


@pytest.mark.parametrize("align", [False, True])
@pytest.mark.parametrize("size", [[3, 2, 5, 7], [2, 1, 3, 4, 6], [2, 1, 1, 5]], ids=["2d", "3d", "h1"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.filterwarnings("ignore:Since version 1.3.0, affine_grid")
def test_affine_grid(size, align, dtype):
    dims = len(size) - 2
    theta = randn(size[0], dims, dims + 1, dtype=dtype)
    ours = lambda t: sp.affine_grid(t, size, align)
    ref = lambda t: F.affine_grid(t, size, align_corners=align)
    dy = randn(size[0], *size[2:], dims, dtype=dtype)
    y, dt = _grads(ours, [theta], dy)
    if 1 in size[2:] and dtype != torch.float32:
        # PyTorch's CPU affine_grid has no fp16/bf16 kernel for unit sizes: its fp32 result, rounded.
        yt, dtt = (t.to(dtype) for t in _grads(ref, [theta.float()], dy.float()))
    else:
        yt, dtt = _grads(ref, [theta], dy)
    yr, dtr = _grads(ref, [theta.double()], dy.double())
    assert_close(y, yr, yt, "grid")
    assert_close(dt, dtr, dtt, "theta gradient")


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("padding", ["zeros", "border"])
@pytest.mark.parametrize("align", [False, True])
def test_grid_sample(align, padding, deterministic, poison):
    x = randn(2, 5, 6, 7)
    grid = torch.rand(2, 4, 3, 2, device=DEVICE) * 2.4 - 1.2  # some positions outside
    dy = randn(2, 5, 4, 3)
    ours = lambda a, g: sp.grid_sample(a, g, padding_mode=padding, align_corners=align)
    ref = lambda a, g: F.grid_sample(a, g, padding_mode=padding, align_corners=align)
    with tdnn.config.flags(deterministic=deterministic):
        y, dx, dg = _grads(ours, [x, grid], dy)
        again = _grads(ours, [x, grid], dy)
    yt, dxt, dgt = _grads(ref, [x, grid], dy)
    yr, dxr, dgr = _grads(ref, [x.double(), grid.double()], dy.double())
    assert_close(y, yr, yt, "output")
    assert_close(dx, dxr, dxt, "input gradient")
    assert_close(dg, dgr, dgt, "grid gradient")
    if deterministic:
        assert torch.equal(dx, again[1]) and torch.equal(dg, again[2])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_grid_sample_dtypes_and_layouts(dtype):
    x = randn(2, 3, 5, 6, dtype=dtype).to(memory_format=torch.channels_last)
    grid = (torch.rand(2, 3, 4, 2, device=DEVICE) * 2 - 1).to(dtype).transpose(1, 2)
    dy = randn(2, 3, 4, 3, dtype=dtype)
    ours = lambda a, g: sp.grid_sample(a, g, align_corners=True)
    ref = lambda a, g: F.grid_sample(a, g, align_corners=True)
    y, dx, dg = _grads(ours, [x, grid], dy)
    yt, dxt, dgt = _grads(ref, [x, grid], dy)
    yr, dxr, dgr = _grads(ref, [x.double(), grid.double()], dy.double())
    assert_close(y, yr, yt, "output")
    assert_close(dx, dxr, dxt, "input gradient")
    assert_close(dg, dgr, dgt, "grid gradient")


def test_engines_report_determinism():
    x, g = randn(1, 2, 3, 3), randn(1, 2, 2, 2)
    with tdnn.config.flags(deterministic=True):
        report = {r.name: r for r in tdnn.engines("grid_sample", x, g, backward=True)}
    assert not report["pixel-atomic"].supported and report["serial-deterministic"].chosen


def test_errors():
    x, g = randn(1, 2, 3, 3), randn(1, 2, 2, 2)
    with pytest.raises(NotImplementedError, match="nearest"):
        sp.grid_sample(x, g, mode="nearest")
    with pytest.raises(NotImplementedError, match="reflection"):
        sp.grid_sample(x, g, padding_mode="reflection")
    with pytest.raises(ValueError, match="padding_mode"):
        sp.grid_sample(x, g, padding_mode="wrap")
    with pytest.raises(ValueError, match="grid"):
        sp.grid_sample(x, randn(1, 2, 2, 3))
    with pytest.raises(TypeError, match="grid"):
        sp.grid_sample(x, g.double())
    with pytest.raises(ValueError, match="dimensions"):
        sp.grid_sample(randn(2, 3, 4), g)
    with pytest.raises(ValueError, match="theta"):
        sp.affine_grid(randn(2, 2, 3), [3, 1, 4, 4])
    with pytest.raises(ValueError, match="size"):
        sp.affine_grid(randn(2, 2, 3), [2, 4, 4])
