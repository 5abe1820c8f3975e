"""Convolution backward: data and weight gradient engines against float64 references, autograd
through every convolution and its fused epilogue, gradcheck in fp64, determinism, bad input."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import tritondnn as tdnn
from helpers import DEVICE, ON_GPU, assert_close
from tritondnn.bench.conv import RESNET50
from tritondnn.ops import conv
from tritondnn.ops.conv import conv_backward_reference, conv_reference, conv_transpose_reference
from tritondnn.ops.conv.engines import wgrad_staged as staged
from tritondnn.ops.conv.problem import channels_last as is_channels_last
from tritondnn.ops.conv.spacedepth import SpaceToDepthDgradEngine
from tritondnn.ops.epilogue import Epilogue

FNS = {1: conv.conv1d, 2: conv.conv2d, 3: conv.conv3d}


def channels_last(t: torch.Tensor) -> torch.Tensor:
    return t.movedim(1, -1).contiguous().movedim(-1, 1)


# (x shape, cout, kernel, stride, (pre, post) pads, dilation, groups)
CASES = [
    ((2, 6, 9, 8), 6, (3, 3), (2, 2), ((1, 1), (0, 2)), (1, 1), 2),
    ((2, 5, 9, 8), 4, (3, 3), (2, 3), ((1, 1), (1, 1)), (2, 1), 1),
    ((3, 8, 13), 8, (5,), (3,), ((2, 1),), (2,), 4),
    ((1, 4, 5, 6, 7), 6, (3, 2, 3), (2, 1, 2), ((1, 1), (0, 1), (1, 0)), (1, 1, 1), 1),
    ((2, 6, 9, 8), 6, (3, 3), (2, 1), ((1, 1), (1, 1)), (1, 2), 6),
    ((2, 6, 8, 7), 6, (3, 3), (1, 1), ((1, 3), (3, 0)), (1, 2), 6),  # depthwise rows
    ((2, 3, 7, 7), 16, (1, 1), (1, 1), ((0, 0), (0, 0)), (1, 1), 1),
    ((2, 3, 15, 14), 8, (7, 7), (2, 2), ((3, 3), (3, 2)), (1, 1), 1),  # a ResNet stem
]


def _in_layout_of(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``w`` channels-last where ``x`` is, else contiguous."""
    return channels_last(w) if is_channels_last(x) else w.contiguous()


def _steps(t: torch.Tensor) -> list[int]:
    """The strides that place elements (those of dimensions longer than 1)."""
    return [s for s, n in zip(t.stride(), t.shape) if n > 1]


def _tensors(case, dtype=torch.float32, last=False):
    shape, cout, kernel, stride, pads, dilation, groups = case
    x = torch.randn(shape, device=DEVICE, dtype=dtype)
    x = channels_last(x) if last else x
    w = torch.randn(cout, shape[1] // groups, *kernel, device=DEVICE, dtype=dtype) / 3
    y = conv_reference(x, w, None, stride, pads, dilation, groups)
    dy = torch.randn(y.shape, device=DEVICE, dtype=dtype)
    return x, w, channels_last(dy) if last else dy


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{len(c[0]) - 2}d-{c[0]}-s{c[3]}-g{c[6]}")
@pytest.mark.parametrize("last", [False, True], ids=["contiguous", "channels_last"])
def test_dgrad_wgrad_engines(case, last, poison):
    shape, _, _, stride, pads, dilation, groups = case
    x, w, dy = _tensors(case, last=last)
    rx, rw = conv_backward_reference(x, w, dy, stride, pads, dilation, groups)
    # Every data-gradient engine that takes the problem (im2col_gemm: 2-D, one group).
    reports = tdnn.engines("conv_dgrad", dy, w, list(x.shape), stride, pads, dilation, groups)
    engines = sorted({"implicit_gemm", *(r.name for r in reports if r.supported)})
    assert "depthwise" in engines or groups != shape[1]
    assert "im2col_gemm" in engines or len(shape) != 4 or groups != 1
    for engine in engines:
        dx = conv.conv_backward_data(dy, w, x.shape, stride, pads, dilation, groups, algo=engine)
        assert_close(dx, rx, what=f"dgrad {engine}")
        assert (dx.stride(1) == 1) == (dy.stride(1) == 1 and dy.shape[1] > 1 and last)
    # Every weight-gradient engine that takes the problem (the row-window engine: channels-last
    # few-channel cases; 'poison' fills fresh outputs with NaN, so an unwritten element fails).
    reports = tdnn.engines("conv_wgrad", x, dy, list(w.shape), stride, pads, dilation, groups)
    for engine in sorted({"implicit_gemm", *(r.name for r in reports if r.supported)}):
        dw = conv.conv_backward_weight(x, dy, w.shape, stride, pads, dilation, groups, algo=engine)
        assert_close(dw, rw, what=f"wgrad {engine}")
        assert _steps(dw) == _steps(_in_layout_of(w, x))  # x's layout, as PyTorch's


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{len(c[0]) - 2}d-{c[0]}-s{c[3]}-g{c[6]}")
@pytest.mark.parametrize("last", [False, True], ids=["contiguous", "channels_last"])
def test_wgrad_engines_store_fp32_from_16_bit(case, last, poison):
    """Every weight-gradient engine stores an fp32 dw from fp16 operands (what an fp32 master
    weight's gradient under autocast takes): the fp32 sums themselves, which round to the fp16
    dw of the same engine."""
    from tritondnn.ops.conv.plans import wgrad_plan

    _, _, _, stride, pads, dilation, groups = case
    x, w, dy = _tensors(case, torch.float16, last)
    _, rw = conv_backward_reference(x, w, dy, stride, pads, dilation, groups)
    geometry = (list(w.shape), stride, [p[0] for p in pads], dilation, groups)
    reports = tdnn.engines("conv_wgrad", x, dy, list(w.shape), stride, pads, dilation, groups)
    for engine in sorted({"implicit_gemm", *(r.name for r in reports if r.supported)}):
        wide = wgrad_plan(x, dy, *geometry, engine, torch.float32)(x, dy)
        narrow = wgrad_plan(x, dy, *geometry, engine)(x, dy)
        assert wide.dtype == torch.float32 and narrow.dtype == torch.float16
        assert wide.stride() == narrow.stride()
        assert_close(wide, rw.float(), what=f"fp32 wgrad {engine}")
        assert torch.equal(wide.half(), narrow), f"wgrad {engine}: fp16 dw is not the fp32 one rounded"


WINOGRAD_PADS = [((1, 1), (1, 1)), ((0, 2), (2, 1))]


def _torch_padded_grads(x, w, dy, pads):
    """PyTorch's own fp32 (dx, dw) for (pre, post) padding: its conv over x padded explicitly."""
    xg, wg = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    (ph, pw) = pads
    F.conv2d(F.pad(xg, (*pw, *ph)), wg).backward(dy)
    return xg.grad, wg.grad


def _assert_winograd_bound(ours, ref, torch_same):
    """F(4x4, 3x3)'s bound (see ``winograd``): 30x PyTorch's own fp32 error plus 1e-5 relative."""
    torch_err = float((torch_same.double() - ref).abs().max())
    err = float((ours.double() - ref).abs().max())
    assert err <= 30 * torch_err + 1e-5 * float(ref.abs().max()), (err, torch_err)


@pytest.mark.parametrize("last", [False, True], ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("pads", WINOGRAD_PADS, ids=["same", "uneven"])
def test_winograd_4x4_dgrad(pads, last):
    """The data gradient by F(4x4, 3x3): the forward engine over dy and the flipped, transposed
    weights read in place through negative strides; 'same' and uneven padding (pre 0 and 2: the
    equivalent forward's padding 2 and 0)."""
    case = ((2, 6, 9, 7), 6, (3, 3), (1, 1), pads, (1, 1), 1)
    x, w, dy = _tensors(case, last=last)
    rx, _ = conv_backward_reference(x, w, dy, (1, 1), pads, (1, 1), 1)
    dx = conv.conv_backward_data(dy, w, x.shape, 1, pads, 1, 1, algo="winograd_4x4")
    _assert_winograd_bound(dx, rx, _torch_padded_grads(x, w, dy, pads)[0])
    with pytest.raises(tdnn.NotSupportedError, match="groups == 1"):
        conv.conv_backward_data(dy, w[:, :3], x.shape, 1, pads, 1, 2, algo="winograd_4x4")
    with pytest.raises(tdnn.NotSupportedError, match="16-bit"):
        conv.conv_backward_data(dy.half(), w.half(), x.shape, 1, pads, 1, 1, algo="winograd_4x4")


@pytest.mark.parametrize("last", [False, True], ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("pads", WINOGRAD_PADS, ids=["same", "uneven"])
def test_winograd_4x4_wgrad(pads, splits, last, monkeypatch):
    """The weight gradient by F(4x4, 3x3): dy's 4x4 tiles (partial at the edges: 13 x 11 or 13 x
    12 outputs) by A, x's patches by B^T, 36 products over the 36 tiles in one or three splits (of
    16 under the interpreter), G^T dU G; dw in x's layout, as PyTorch's."""
    from tritondnn.ops.conv import describe_wgrad, winograd

    monkeypatch.setattr(winograd, "_wgrad_splits", lambda *args: splits)
    case = ((3, 6, 13, 11), 5, (3, 3), (1, 1), pads, (1, 1), 1)
    x, w, dy = _tensors(case, last=last)
    _, rw = conv_backward_reference(x, w, dy, (1, 1), pads, (1, 1), 1)
    # Bound here, not through the public call, whose plan cache would keep the first split count.
    problem = describe_wgrad(x, dy, w.shape, 1, pads, 1, 1)
    engine = winograd.Winograd4WgradEngine()
    dw = _in_layout_of(torch.full(w.shape, float("nan"), device=DEVICE), x)
    engine.bind(problem, engine.configs(problem)[0])(x, dy, dw)
    _assert_winograd_bound(dw, rw, _torch_padded_grads(x, w, dy, pads)[1])
    public = conv.conv_backward_weight(x, dy, w.shape, 1, pads, 1, 1, algo="winograd_4x4")
    assert public.stride() == dw.stride()
    with pytest.raises(tdnn.NotSupportedError, match="groups == 1"):
        conv.conv_backward_weight(x, dy[:, :4], (4, 3, 3, 3), 1, pads, 1, 2, algo="winograd_4x4")


@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[4]], ids=str)
def test_fp16_gradients(case):
    x, w, dy = _tensors(case, torch.float16, last=True)
    _, _, _, stride, pads, dilation, groups = case
    rx, rw = conv_backward_reference(x, w, dy, stride, pads, dilation, groups)
    tx, tw = conv_backward_reference(x.float(), w.float(), dy.float(), stride, pads, dilation, groups)
    dx = conv.conv_backward_data(dy, w, x.shape, stride, pads, dilation, groups)
    dw = conv.conv_backward_weight(x, dy, w.shape, stride, pads, dilation, groups)
    assert_close(dx, rx, tx.half(), "dgrad fp16")
    assert_close(dw, rw, tw.half(), "wgrad fp16")


@pytest.mark.gpu_only("a grid's limits exist on a GPU only (and 65536 interpreted programs are slow)")
def test_im2col_dgrad_many_channels():
    """The fold's programs per (sample, channel) pass the 65535 a grid's second dimension takes
    (ResNet-50's 1x1 stride-2 1024->2048 at N=64 failed to launch)."""
    x, w, dy = _tensors(((2, 32800, 2, 3), 4, (1, 1), (2, 2), ((0, 0), (0, 0)), (1, 1), 1))
    rx, _ = conv_backward_reference(x, w, dy, (2, 2), ((0, 0), (0, 0)), (1, 1), 1)
    assert_close(conv.conv_backward_data(dy, w, x.shape, 2, 0, algo="im2col_gemm"), rx, what="im2col dgrad")


@pytest.mark.gpu_only("Triton's interpreter computes bf16 tl.dot wrongly")
@pytest.mark.parametrize("case", CASES, ids=str)
def test_bf16_gradients(case):
    x, w, dy = _tensors(case, torch.bfloat16, last=True)
    _, _, _, stride, pads, dilation, groups = case
    rx, rw = conv_backward_reference(x, w, dy, stride, pads, dilation, groups)
    tx, tw = conv_backward_reference(x.float(), w.float(), dy.float(), stride, pads, dilation, groups)
    assert_close(conv.conv_backward_data(dy, w, x.shape, stride, pads, dilation, groups), rx, tx.bfloat16())
    assert_close(conv.conv_backward_weight(x, dy, w.shape, stride, pads, dilation, groups), rw, tw.bfloat16())


@pytest.mark.parametrize("activation", ["relu", "gelu", "sigmoid"])
@pytest.mark.parametrize("last", [False, True], ids=["contiguous", "channels_last"])
def test_autograd_fused_epilogue(activation, last):
    x = torch.randn(2, 6, 7, 6, device=DEVICE)
    x = channels_last(x) if last else x
    w = torch.randn(8, 3, 3, 3, device=DEVICE) / 3
    b = torch.randn(8, device=DEVICE)
    c = torch.randn(2, 8, 4, 3, device=DEVICE)
    r = torch.randn(2, 8, 4, 3, device=DEVICE)
    leaves = [t.clone().requires_grad_(True) for t in (x, w, b, c, r)]
    epi = Epilogue(alpha=1.5, beta=0.5, activation=activation, residual=True)
    y = conv.conv2d(
        leaves[0], leaves[1], leaves[2], 2, 1, 1, 2, epilogue=epi, c=leaves[3], residual=leaves[4]
    )
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, leaves, dy)
    ref_leaves = [t.double().requires_grad_(True) for t in (x, w, b, c, r)]
    xd, wd, bd, cd, rd = ref_leaves
    pre = 1.5 * conv_reference(xd, wd, None, (2, 2), ((1, 1), (1, 1)), (1, 1), 2) + 0.5 * cd
    act = {"relu": F.relu, "gelu": F.gelu, "sigmoid": torch.sigmoid}[activation]
    ref = act(pre + bd.view(1, -1, 1, 1)) + rd
    ref_grads = torch.autograd.grad(ref, ref_leaves, dy.double())
    assert_close(y.detach(), ref.detach(), what="out")
    for name, g, rg in zip(("x", "w", "bias", "c", "residual"), grads, ref_grads):
        assert_close(g, rg, what=f"d{name}")


@pytest.mark.parametrize("nd", [1, 2, 3])
def test_autograd_every_rank_and_transpose(nd):
    spatial = {1: (9,), 2: (6, 5), 3: (3, 4, 3)}[nd]
    x = torch.randn(2, 4, *spatial, device=DEVICE)
    w = torch.randn(6, 2, *((3,) * nd), device=DEVICE) / 3
    b = torch.randn(6, device=DEVICE)
    xg, wg, bg = (t.clone().requires_grad_(True) for t in (x, w, b))
    y = FNS[nd](xg, wg, bg, 2, 1, 1, 2)
    dy = torch.randn_like(y)
    gx, gw, gb = torch.autograd.grad(y, (xg, wg, bg), dy)
    rx, rw = conv_backward_reference(x, w, dy, (2,) * nd, ((1, 1),) * nd, (1,) * nd, 2)
    assert_close(gx, rx, what="dx")
    assert_close(gw, rw, what="dw")
    assert_close(gb, dy.double().sum([0, *range(2, dy.ndim)]), what="dbias")
    # conv_transpose: forward is a data gradient, backward a convolution and a weight gradient.
    wt = torch.randn(4, 3, *((2,) * nd), device=DEVICE)
    xg, wg = x.clone().requires_grad_(True), wt.clone().requires_grad_(True)
    fn = {1: conv.conv_transpose1d, 2: conv.conv_transpose2d, 3: conv.conv_transpose3d}[nd]
    y = fn(xg, wg, None, 2, 1, 1, 2, 1)
    dy = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (xg, wg), dy)
    xd, wd = x.double().requires_grad_(True), wt.double().requires_grad_(True)
    ref = conv_transpose_reference(xd, wd, None, (2,) * nd, (1,) * nd, (1,) * nd, 2, (1,) * nd)
    rx, rw = torch.autograd.grad(ref, (xd, wd), dy.double())
    assert_close(y.detach(), ref.detach(), what="conv_transpose")
    assert_close(gx, rx, what="conv_transpose dx")
    assert_close(gw, rw, what="conv_transpose dw")


@pytest.mark.parametrize(
    "groups, stride", [(1, 2), (2, 1), (4, 2)], ids=["implicit_gemm-s2", "implicit_gemm-g2", "depthwise-s2"]
)
def test_gradcheck_fp64(groups, stride):
    """fp64 gradcheck (fast mode: random projections, few evaluations under the interpreter)."""
    x = torch.randn(1, 4, 4, 3, device=DEVICE, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 4 // groups, 2, 2, device=DEVICE, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, device=DEVICE, dtype=torch.float64, requires_grad=True)
    epi = Epilogue(activation="silu")
    assert torch.autograd.gradcheck(
        lambda x, w, b: conv.conv2d(x, w, b, stride, ((1, 0), (1, 1)), 1, groups, epilogue=epi),
        (x, w, b),
        fast_mode=True,
    )
    wt = torch.randn(4, 2, 2, 2, device=DEVICE, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x, w: conv.conv_transpose2d(x, w, None, 2, 0, 1, 2), (x, wt), fast_mode=True
    )


def test_wgrad_split_deterministic():
    """Enough pixels for a split reduction: two runs give the same bits."""
    x = torch.randn(4, 4, 12, 12, device=DEVICE)
    w = torch.randn(4, 4, 3, 3, device=DEVICE)
    dy = torch.randn(4, 4, 12, 12, device=DEVICE)
    with tdnn.config.flags(deterministic=True):
        a = conv.conv_backward_weight(x, dy, w.shape, 1, 1)
        b = conv.conv_backward_weight(x, dy, w.shape, 1, 1)
    assert torch.equal(a, b)
    assert_close(a, conv_backward_reference(x, w, dy, (1, 1), ((1, 1), (1, 1)), (1, 1), 1)[1])


@pytest.mark.skipif(not ON_GPU, reason="the engines the GPU picks at the benchmark's sizes")
@pytest.mark.parametrize("layer", RESNET50, ids=[layer[0] for layer in RESNET50])
def test_resnet_gradients_deterministic(layer):
    """The issue's deterministic mode on the benchmark's layers (bf16 channels-last, N=64): two
    runs of dgrad and wgrad give the same bits, and dgrad + wgrad are close to fp64's."""
    _, cin, cout, k, stride, padding, size = layer
    x = channels_last(torch.randn(64, cin, size, size, device=DEVICE, dtype=torch.bfloat16))
    w = torch.randn(cout, cin, k, k, device=DEVICE, dtype=torch.bfloat16) / (cin * k * k) ** 0.5
    w = channels_last(w)
    out = (size + 2 * padding - k) // stride + 1
    dy = channels_last(torch.randn(64, cout, out, out, device=DEVICE, dtype=torch.bfloat16))
    with tdnn.config.flags(deterministic=True):
        runs = [
            (
                conv.conv_backward_data(dy, w, x.shape, stride, padding),
                conv.conv_backward_weight(x, dy, w.shape, stride, padding),
            )
            for _ in range(2)
        ]
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    pads = ((padding, padding),) * 2
    want = conv_backward_reference(x, w, dy, (stride,) * 2, pads, (1, 1), 1)
    for got, ref in zip(runs[0], want):
        scale = ref.abs().max().item()
        assert (got.double() - ref).abs().max().item() <= 2e-2 * scale


def test_bias_gradient():
    dy = channels_last(torch.randn(3, 5, 4, 6, device=DEVICE))
    assert_close(conv.conv_backward_bias(dy), dy.double().sum([0, 2, 3]))
    dy = torch.randn(3, 5, 7, device=DEVICE)
    assert_close(conv.conv_backward_bias(dy), dy.double().sum([0, 2]))


def test_bad_input():
    w = torch.randn(4, 2, 3, 3, device=DEVICE)
    dy = torch.randn(1, 4, 4, 4, device=DEVICE)
    x = torch.randn(1, 4, 6, 6, device=DEVICE)
    with pytest.raises(ValueError, match="grad_output"):
        conv.conv_backward_data(dy, w, (1, 4, 9, 9), 1, 0, 1, 2)
    with pytest.raises(TypeError, match="dtype"):
        conv.conv_backward_data(dy.half(), w, (1, 4, 6, 6), 1, 0, 1, 2)
    with pytest.raises(ValueError, match="dimensions"):
        conv.conv_backward_data(dy, w, (1, 4, 6), 1, 0, 1, 2)
    with pytest.raises(ValueError, match="grad_output"):
        conv.conv_backward_weight(x, dy, (4, 3, 3, 3), 1, 0, 1, 2)
    with pytest.raises(ValueError, match="stride"):
        conv.conv_backward_weight(x, dy, w.shape, 0, 0, 1, 2)
    with pytest.raises(tdnn.NotSupportedError, match="depthwise"):
        conv.conv_backward_weight(x, dy, w.shape, 1, 0, 1, 2, algo="depthwise")


# (x shape, cout, kernel, (pre, post) pads, dilation, groups): stride-1 'same' problems whose
# taps leave the image by up to two planes, rows or columns, on both sides or one.
WRAPPING = [
    ((3, 16, 7, 9), 16, (3, 3), ((1, 1), (1, 1)), (1, 1), 1),
    ((2, 16, 6, 5), 16, (5, 3), ((2, 2), (1, 1)), (1, 1), 1),
    ((2, 16, 8, 6), 16, (3, 3), ((2, 2), (2, 2)), (2, 2), 1),
    ((2, 16, 6, 7), 16, (4, 2), ((1, 2), (0, 1)), (1, 1), 1),
    ((2, 32, 5, 6), 32, (3, 3), ((1, 1), (1, 1)), (1, 1), 2),
    ((1, 16, 40), 16, (5,), ((2, 2),), (1,), 1),
    ((2, 16, 4, 5, 6), 16, (3, 3, 3), ((1, 1),) * 3, (1, 1, 1), 1),
    ((2, 16, 1, 1), 16, (3, 3), ((1, 1), (1, 1)), (1, 1), 1),
]


@pytest.mark.parametrize("case", WRAPPING, ids=str)
@pytest.mark.parametrize("splits", [1, 3, 7])
def test_shifted_wgrad_takes_back_wrapped_pixels(case, splits, monkeypatch):
    """The shifted weight gradient adds every pixel's product per tap and takes back those of the
    pixels whose tap leaves the image (margin rows, planes and columns); with the pixels split
    into ranges that start and end mid-image, each range takes back exactly its own."""
    from tritondnn.ops.conv import describe_wgrad, shifted

    monkeypatch.setattr(shifted, "reduction_splits", lambda *args: splits)
    shape, cout, kernel, pads, dilation, groups = case
    stride = (1,) * len(kernel)
    x, w, dy = _tensors((shape, cout, kernel, stride, pads, dilation, groups), torch.float16, True)
    dy = channels_last(dy)
    _, rw = conv_backward_reference(x, w, dy, stride, pads, dilation, groups)
    problem = describe_wgrad(x, dy, w.shape, 1, pads, dilation, groups)
    engine = shifted.ShiftedGemmWgradEngine()
    assert not engine.not_supported_reasons(problem)
    dw = _in_layout_of(torch.full(w.shape, float("nan"), device=DEVICE, dtype=torch.float16), x)
    engine.bind(problem, engine.configs(problem)[0])(x, dy, dw)
    assert_close(dw, rw, what=f"shifted wgrad {case}, {splits} splits")


PADDED = [
    ((2, 16, 7, 7), 16, (3, 3), ((1, 1), (1, 1)), (1, 1), 1),
    ((3, 16, 5, 6), 32, (3, 3), ((0, 0), (0, 0)), (1, 1), 1),
    ((2, 32, 6, 5), 32, (3, 3), ((2, 2), (1, 1)), (2, 1), 2),
    ((1, 16, 4, 5, 6), 16, (3, 3, 3), ((1, 1),) * 3, (1, 1, 1), 1),
    ((2, 16, 40), 16, (5,), ((2, 2),), (1,), 1),
    ((2, 16, 20, 9), 16, (1, 1), ((0, 0), (0, 0)), (1, 1), 1),
    ((2, 16, 7, 6), 16, (4, 4), ((1, 2), (2, 1)), (1, 1), 1),
    ((2, 16, 5, 5), 16, (3, 3), ((3, 2), (2, 3)), (1, 1), 1),
    ((2, 64, 5, 6), 64, (3, 3), ((1, 1), (1, 1)), (1, 1), 2),
]


@pytest.mark.parametrize("case", PADDED, ids=str)
@pytest.mark.parametrize("pixels, splits, tile", [(16, 1, 16), (16, 2, 32), (64, 2, 16)])
@pytest.mark.parametrize("dy_last", [True, False], ids=["dy_channels_last", "dy_contiguous"])
def test_padded_box_wgrad(case, pixels, splits, tile, dy_last, monkeypatch):
    """x's boxes (zeros outside the image) against dy's rows in a copy padded to whole boxes:
    'same', 'valid', uneven and over-padding (the output larger than x), even kernels, dilation,
    groups (tiles wider than a group's channels), 1D/2D/3D, boxes of part of a row, of whole rows,
    of several images; split over boxes; dy in either layout (it is copied)."""
    from tritondnn.ops.conv import describe_wgrad, padded

    monkeypatch.setattr(padded, "reduction_splits", lambda *args: splits)
    shape, cout, kernel, pads, dilation, groups = case
    stride = (1,) * len(kernel)
    x, w, dy = _tensors((shape, cout, kernel, stride, pads, dilation, groups), torch.float16, True)
    dy = channels_last(dy) if dy_last else dy.contiguous()
    _, rw = conv_backward_reference(x, w, dy, stride, pads, dilation, groups)
    problem = describe_wgrad(x, dy, w.shape, 1, pads, dilation, groups)
    engine = padded.PaddedBoxWgradEngine()
    assert not engine.not_supported_reasons(problem)
    dw = _in_layout_of(torch.full(w.shape, float("nan"), device=DEVICE, dtype=torch.float16), x)
    config = {**engine.configs(problem)[0], "BLOCK_K": pixels, "BLOCK_M": tile, "BLOCK_N": tile}
    engine.bind(problem, config)(x, dy, dw)
    assert_close(dw, rw, what=f"padded box wgrad {case}, {pixels}-pixel boxes, {splits} splits")


def test_padded_box_wgrad_by_name_only_until_timed():
    """The heuristic never picks the padded-box engine (not yet timed on a GPU); by name it runs,
    and it declines channels-first x and strides."""
    case = ((2, 16, 7, 7), 16, (3, 3), (1, 1), ((1, 1), (1, 1)), (1, 1), 1)
    x, w, dy = _tensors(case, torch.float16, True)
    reports = {r.name: r for r in tdnn.engines("conv_wgrad", x, dy, w.shape, 1, 1)}
    assert reports["padded_box"].supported and not reports["padded_box"].chosen
    rw = conv_backward_reference(x, w, dy, (1, 1), ((1, 1), (1, 1)), (1, 1), 1)[1]
    dw = conv.conv_backward_weight(x, dy, w.shape, 1, 1, algo="padded_box")
    assert_close(dw, rw, what="padded box by name")
    with pytest.raises(tdnn.NotSupportedError, match="channels innermost"):
        conv.conv_backward_weight(x.contiguous(), dy, w.shape, 1, 1, algo="padded_box")
    with pytest.raises(tdnn.NotSupportedError, match="stride 1"):
        conv.conv_backward_weight(x, dy[..., :4, :4], w.shape, 2, 1, algo="padded_box")
    with pytest.raises(tdnn.NotSupportedError, match="fp16 or bf16"):
        conv.conv_backward_weight(x.float(), dy.float(), w.shape, 1, 1, algo="padded_box")
    # x off 16 bytes (a view one channel in): the descriptors cannot read it, the implicit GEMM does.
    wide = channels_last(torch.randn(2, 24, 7, 7, device=DEVICE, dtype=torch.float16))[:, 1:17]
    rw = conv_backward_reference(wide, w, dy, (1, 1), ((1, 1), (1, 1)), (1, 1), 1)[1]
    assert_close(
        conv.conv_backward_weight(wide, dy, w.shape, 1, 1, algo="padded_box"), rw, what="x off 16 bytes"
    )


@pytest.mark.gpu_only("bf16 products (the interpreter's bf16 dot is wrong)")
def test_padded_box_wgrad_bf16():
    case = ((4, 64, 7, 7), 64, (3, 3), (1, 1), ((1, 1), (1, 1)), (1, 1), 1)
    x, w, dy = _tensors(case, torch.bfloat16, True)
    rw = conv_backward_reference(x, w, dy, (1, 1), ((1, 1), (1, 1)), (1, 1), 1)[1]
    assert_close(conv.conv_backward_weight(x, dy, w.shape, 1, 1, algo="padded_box"), rw, what="bf16")


def test_shifted_wgrad_splits_fill_one_wave(monkeypatch):
    """The split count: for 128 x 128 tiles one wave of programs where that beats two waves'
    shorter ranges plus their workspace, a direct store for a problem with a wave of tiles
    already; 64 x 64 ones (several a multiprocessor) two waves' worth; bf16 N=64, 132
    multiprocessors."""
    from tritondnn.ops.conv import describe_wgrad, shifted

    monkeypatch.setattr(shifted, "sm_count", lambda: 132)

    def split(channels, size, tile):
        x = torch.empty(64, channels, size, size, device="meta", dtype=torch.bfloat16)
        problem = describe_wgrad(channels_last(x), channels_last(x), [channels, channels, 3, 3], 1, 1)
        config = {"BLOCK_M": tile, "BLOCK_N": tile, "BLOCK_K": 64}
        tiles = 9 * (-(-channels // tile)) ** 2
        return tiles, shifted.reduction_splits(problem, tiles, 64 * size * size, config)

    for channels, size in ((256, 14), (128, 28)):
        tiles, n = split(channels, size, 128)
        assert 66 < tiles * n <= 132
    assert split(512, 7, 128) == (144, 1)
    assert split(64, 56, 64) == (9, 30)


@pytest.mark.parametrize(
    "case",
    [
        ((2, 16, 7, 9), 24, (3, 3), (1, 1), ((1, 1), (1, 1)), (1, 1), 1),
        ((1, 32, 6, 5), 32, (3, 3), (1, 1), ((2, 2), (1, 1)), (2, 1), 2),
        ((2, 16, 5, 6), 8, (1, 1), (1, 1), ((0, 0), (0, 0)), (1, 1), 1),
        ((1, 16, 4, 5, 6), 16, (3, 3, 3), (1, 1, 1), ((1, 1),) * 3, (1, 1, 1), 1),
        ((1, 128, 3, 8), 16, (3, 3), (1, 1), ((1, 1), (1, 1)), (1, 1), 1),
    ],
    ids=str,
)
@pytest.mark.parametrize("last", [True, False], ids=["channels_last", "contiguous"])
def test_boxed_dgrad_shifted_wgrad(case, last, poison):
    """Gradients of a stride-1 convolution on Hopper's engines (fp16): dx as the boxed GEMM of dy
    with the flipped weights (in place when channels-last, else packed; 'same' and 'valid'
    padding), dw per tap from dy and x's shifted rows, split over pixels. Contiguous x and dy are
    copied channels-last first (dy for dx only with 128 or more input channels); dx keeps dy's
    layout."""
    shape, _, kernel, stride, pads, dilation, groups = case
    x, w, dy = _tensors(case, torch.float16, last=last)
    dgrad = last or shape[1] // groups >= 128
    rx, rw = conv_backward_reference(x, w, dy, stride, pads, dilation, groups)
    torch_dx = torch.ops.aten.convolution_backward(
        dy.float(), x.float(), w.float(), None, stride, [p[0] for p in pads], dilation, False,
        [0] * len(stride), groups, [True, False, False],
    )[0].half()  # fmt: skip
    for weights in (w, channels_last(w)) if dgrad else ():
        dx = conv.conv_backward_data(dy, weights, x.shape, stride, pads, dilation, groups, algo="boxed_gemm")
        assert dx.stride(1) == 1 if last else dx.is_contiguous()
        assert_close(dx, rx, torch_dx, f"boxed dgrad {case}")
    dw = conv.conv_backward_weight(x, dy, w.shape, stride, pads, dilation, groups, algo="shifted_gemm")
    assert_close(dw, rw, what=f"shifted wgrad {case}")
    if not dgrad:
        with pytest.raises(tdnn.NotSupportedError, match="channels"):
            conv.conv_backward_data(dy, w, x.shape, stride, pads, dilation, groups, algo="boxed_gemm")
    if max(kernel) == 1 or not dgrad:
        return
    valid = ((0, 0),) * len(stride)
    dy_valid = conv_reference(x, w, None, stride, valid, dilation, groups).half()
    dy_valid = channels_last(dy_valid) if last else dy_valid.contiguous()
    rx, _ = conv_backward_reference(x, w, dy_valid, stride, valid, dilation, groups)
    dx = conv.conv_backward_data(dy_valid, w, x.shape, stride, valid, dilation, groups, algo="boxed_gemm")
    assert_close(dx, rx, what=f"boxed dgrad, valid padding {case}")


@pytest.mark.parametrize(
    "case",
    [
        ((2, 8, 7, 9), 12, (3, 3), (1, 1), ((1, 1), (1, 1)), (1, 1), 1),
        ((2, 16, 9, 8), 8, (3, 3), (2, 1), ((1, 0), (2, 1)), (1, 2), 2),
        ((3, 8, 13), 16, (5,), (2,), ((2, 1),), (1,), 1),
        ((1, 8, 4, 5, 6), 8, (3, 1, 3), (1, 2, 1), ((1, 1), (0, 0), (1, 1)), (1, 1, 1), 1),
        ((2, 8, 6, 6), 16, (1, 1), (2, 2), ((0, 0), (0, 0)), (1, 1), 1),
    ],
    ids=str,
)
def test_fp32_wgrad_stages_channels_first_operands(case, poison):
    """fp32 channels-first x and dy with a sector (8) of input channels per group are copied
    channels-last before the implicit GEMM (its channels-first loads do not vectorize); dw stays
    contiguous. Channels-last operands, and fewer channels, are read in place."""
    _, _, _, stride, pads, dilation, groups = case
    x, w, dy = _tensors(case)
    geometry = (stride, pads, dilation, groups)
    few = x[:, : 4 * groups].contiguous()  # 4 channels a group: 16 bytes
    assert not staged(conv.describe_wgrad(few, dy, [w.shape[0], 4, *w.shape[2:]], *geometry))
    assert staged(conv.describe_wgrad(x, dy, list(w.shape), *geometry))
    assert not staged(conv.describe_wgrad(channels_last(x), channels_last(dy), list(w.shape), *geometry))
    assert not staged(conv.describe_wgrad(x.half(), dy.half(), list(w.shape), *geometry))
    _, rw = conv_backward_reference(x, w, dy, stride, pads, dilation, groups)
    dw = conv.conv_backward_weight(x, dy, w.shape, *geometry, algo="implicit_gemm")
    assert_close(dw, rw, what=f"staged wgrad {case}")
    assert dw.is_contiguous()


def test_few_channel_gradients_engines():
    """ResNet-50's stem (3 input channels, 7x7 stride 2, N64): in 16-bit both gradients by
    space-to-depth (H100, bf16: dx 168 us against im2col_gemm's 1412, dw 260 against row_window's
    474); in fp32 the data gradient through one GEMM and a fold (its implicit GEMM's 3-column
    tiles ran at 6.3 TFLOP/s); a 64-channel 3x3 layer keeps a tiled engine (its columns' gradient
    alone would move ~1 GB)."""

    def chosen(family, cin, cout, k, stride, pad, size, dtype=torch.bfloat16):
        out = (size + 2 * pad - k) // stride + 1
        dy = channels_last(torch.empty(64, cout, out, out, device="meta", dtype=dtype))
        w = torch.empty(cout, cin, k, k, device="meta", dtype=dtype)
        if family == "conv_dgrad":
            reports = tdnn.engines(family, dy, w, [64, cin, size, size], stride, pad)
        else:
            x = channels_last(torch.empty(64, cin, size, size, device="meta", dtype=dtype))
            reports = tdnn.engines(family, x, dy, list(w.shape), stride, pad)
        return next(r.name for r in reports if r.chosen)

    assert chosen("conv_dgrad", 3, 64, 7, 2, 3, 224) == "space_to_depth"
    assert chosen("conv_wgrad", 3, 64, 7, 2, 3, 224) == "space_to_depth"
    assert chosen("conv_dgrad", 3, 64, 7, 2, 3, 224, torch.float32) == "im2col_gemm"
    assert chosen("conv_dgrad", 64, 64, 3, 1, 1, 56) != "im2col_gemm"


@pytest.mark.parametrize(
    "case",
    [
        ((2, 3, 17, 19), 16, (7, 7), (2, 2), ((3, 3), (3, 3)), (1, 1), 1),
        ((2, 4, 11, 10), 8, (5, 3), (2, 3), ((2, 2), (1, 1)), (1, 1), 1),
        ((2, 3, 11, 10), 8, (3, 3), (3, 2), ((1, 1), (1, 1)), (1, 1), 1),
        ((3, 3, 21), 8, (7,), (2,), ((3, 3),), (1,), 1),
        ((2, 3, 5, 9, 8), 8, (3, 3, 3), (2, 2, 2), ((1, 1),) * 3, (1, 1, 1), 1),
    ],
    ids=str,
)
def test_space_to_depth_gradients(case, poison):
    """Gradients of a strided few-channel convolution (fp16, channels-last): dx as the boxed GEMM's
    data gradient over the space-to-depth copy z, each x element's copies in z summed; dw as the
    shifted GEMM's weight gradient over z against dy padded to z's grid, gathered into w's order
    (in x's layout)."""
    shape, _, _, stride, pads, dilation, groups = case
    x, w, dy = _tensors(case, torch.float16, last=True)
    rx, rw = conv_backward_reference(x, w, dy, stride, pads, dilation, groups)
    torch_dx = torch.ops.aten.convolution_backward(
        dy.float(), x.float(), w.float(), None, stride, [p[0] for p in pads], dilation, False,
        [0] * len(stride), groups, [True, False, False],
    )[0].half()  # fmt: skip
    dw = conv.conv_backward_weight(x, dy, w.shape, stride, pads, dilation, groups, algo="space_to_depth")
    assert dw.stride() == channels_last(w).stride() or len(shape) == 3
    assert_close(dw, rw, what=f"space_to_depth wgrad {case}")
    dx = conv.conv_backward_data(dy, w, x.shape, stride, pads, dilation, groups, algo="space_to_depth")
    assert is_channels_last(dx) or len(shape) == 3
    assert_close(dx, rx, torch_dx, f"space_to_depth dgrad {case}")
    with pytest.raises(tdnn.NotSupportedError, match="channels-last"):
        conv.conv_backward_data(
            dy.contiguous(), w, x.shape, stride, pads, dilation, groups, algo="space_to_depth"
        )
    problem = conv.describe_dgrad(dy, w, x.shape, stride, pads, dilation, groups)
    assert not SpaceToDepthDgradEngine().not_supported_reasons(problem)
    fused = dataclasses.replace(problem, activation=0)
    assert "no fused epilogue" in SpaceToDepthDgradEngine().not_supported_reasons(fused)
