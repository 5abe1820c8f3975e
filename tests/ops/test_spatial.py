"""affine_grid and grid_sample: both align_corners, zeros/border padding, gradients of input, grid
and theta, deterministic mode, layouts, errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tritondnn as tdnn
import tritondnn.ops.spatial as sp
from helpers import DEVICE, DTYPES, LAYOUTS, assert_close, randn


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


def _check_grid_sample(x, grid, dy, padding="zeros", align=False, algo=None, deterministic=False):
    """Output and both gradients against float64 (2x PyTorch's own error); returns ours."""
    ours = lambda a, g: sp.grid_sample(a, g, padding_mode=padding, align_corners=align, algo=algo)
    ref = lambda a, g: F.grid_sample(a, g, padding_mode=padding, align_corners=align)
    with tdnn.config.flags(deterministic=deterministic):
        y, dx, dg = _grads(ours, [x, grid], dy)
    yt, dxt, dgt = _grads(ref, [x, grid], dy)
    yr, dxr, dgr = _grads(ref, [x.double(), grid.double()], dy.double())
    assert_close(y, yr, yt, "output")
    assert_close(dx, dxr, dxt, "input gradient")
    assert_close(dg, dgr, dgt, "grid gradient")
    return y, dx, dg


@pytest.mark.parametrize("algo", ["pixel-atomic", "nhwc-staged"])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("padding", ["zeros", "border"])
@pytest.mark.parametrize("align", [False, True])
def test_grid_sample(align, padding, deterministic, algo, poison):
    x = randn(2, 5, 6, 7)
    grid = torch.rand(2, 4, 3, 2, device=DEVICE) * 2.4 - 1.2  # some positions outside
    dy = randn(2, 5, 4, 3)
    _, dx, dg = _check_grid_sample(x, grid, dy, padding, align, algo, deterministic)
    assert dx.is_contiguous()  # the staged engine's NHWC gradient comes back in the input's layout
    if deterministic:
        with tdnn.config.flags(deterministic=True):
            ours = lambda a, g: sp.grid_sample(a, g, padding_mode=padding, align_corners=align, algo=algo)
            again = _grads(ours, [x, grid], dy)
        assert torch.equal(dx, again[1]) and torch.equal(dg, again[2])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("layout", ["channels_last", "sliced"])
def test_grid_sample_dtypes_and_layouts(dtype, layout, poison):
    x = LAYOUTS[layout](randn(2, 3, 5, 6, dtype=dtype))
    grid = (torch.rand(2, 3, 4, 2, device=DEVICE) * 2.2 - 1.1).to(dtype).transpose(1, 2)
    dy = randn(2, 3, 4, 3, dtype=dtype)
    _, dx, _ = _check_grid_sample(x, grid, dy, "border", align=True)
    # The input gradient keeps a channels-last input's layout; other layouts give contiguous NCHW.
    cl = layout == "channels_last"
    assert dx.is_contiguous(memory_format=torch.channels_last if cl else torch.contiguous_format)


@pytest.mark.parametrize("deterministic", [False, True])
def test_grid_sample_channel_chunks(deterministic):
    """More channels than one tile holds (64): the channel loop and its masked last chunk."""
    x = randn(1, 67, 4, 5)
    grid = torch.rand(1, 3, 2, 2, device=DEVICE) * 2.4 - 1.2
    _check_grid_sample(x, grid, randn(1, 67, 3, 2), deterministic=deterministic)
    _check_grid_sample(LAYOUTS["channels_last"](x), grid, randn(1, 67, 3, 2), deterministic=deterministic)


def test_grid_sample_layouts_share_shapes():
    """Same shapes and dtypes in NCHW, then NHWC, then NCHW again: a launch prepared for one layout
    (compiled for its unit strides) must not run on another."""
    x = randn(2, 4, 5, 6)
    grid = torch.rand(2, 3, 3, 2, device=DEVICE) * 2 - 1
    dy = randn(2, 4, 3, 3)
    for layout in ("contiguous", "channels_last", "contiguous"):
        _check_grid_sample(LAYOUTS[layout](x), grid, dy, algo="pixel-atomic")


def test_grid_sample_one_input_grad():
    x = randn(2, 3, 4, 5)
    grid = (torch.rand(2, 2, 3, 2, device=DEVICE) * 2 - 1).requires_grad_(True)
    (dg,) = torch.autograd.grad(sp.grid_sample(x, grid).sum(), grid)
    (dgr,) = torch.autograd.grad(F.grid_sample(x.double(), grid.double(), align_corners=False).sum(), grid)
    assert_close(dg, dgr.float(), None, "grid gradient")
    with torch.no_grad():
        assert_close(sp.grid_sample(x, grid), grid_sample_ref(x, grid), None, "no-grad output")


def grid_sample_ref(x, grid):
    return sp.grid_sample_reference(x, grid, "zeros", False).to(x.dtype)


def test_grid_sample_benchmark_mode(cache_dir):
    x = randn(1, 8, 5, 5)
    grid = torch.rand(1, 3, 3, 2, device=DEVICE) * 2 - 1
    with tdnn.config.flags(benchmark=True):
        _check_grid_sample(x, grid, randn(1, 8, 3, 3))


def test_engines_report_determinism():
    x, g = randn(1, 2, 3, 3), randn(1, 2, 2, 2)
    with tdnn.config.flags(deterministic=True):
        report = {r.name: r for r in tdnn.engines("grid_sample", x, g, backward=True)}
    assert not report["pixel-atomic"].supported and report["serial-deterministic"].chosen


def test_heuristics():
    """The bench shape: the staged forward, then atomics, unless deterministic; a channels-last
    input is gathered in place."""
    x = torch.empty(32, 64, 128, 128, device="meta")
    g = torch.empty(32, 128, 128, 2, device="meta")
    chosen = lambda *args, **kw: next(r.name for r in tdnn.engines("grid_sample", *args, **kw) if r.chosen)
    assert chosen(x, g) == "nhwc-staged"
    assert chosen(x, g, backward=True) == "pixel-atomic"
    assert chosen(x.to(memory_format=torch.channels_last), g) == "pixel-atomic"
    with tdnn.config.flags(deterministic=True):
        assert chosen(x, g, backward=True) == "serial-deterministic"


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
    with pytest.raises(ValueError, match="empty spatial"):
        sp.grid_sample(randn(1, 2, 0, 3), g)
    with pytest.raises(ValueError, match="algo"):
        sp.grid_sample(x, g, algo="fastest")
    with pytest.raises(tdnn.NotSupportedError, match="contiguous already"):
        sp.grid_sample(x.to(memory_format=torch.channels_last), g, algo="nhwc-staged")
    with pytest.raises(ValueError, match="theta"):
        sp.affine_grid(randn(2, 2, 3), [3, 1, 4, 4])
    with pytest.raises(ValueError, match="size"):
        sp.affine_grid(randn(2, 2, 3), [2, 4, 4])
