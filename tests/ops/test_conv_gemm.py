"""The 1x1 convolution engines that run as one matrix product (``gemm_1x1``): forward with its
epilogue, data and weight gradients, every rank and stride, against the float64 reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import tritondnn as tdnn
from helpers import DEVICE, assert_close
from tritondnn.ops import conv
from tritondnn.ops.conv import conv_backward_reference, conv_reference
from tritondnn.ops.conv.problem import strides5
from tritondnn.ops.epilogue import Epilogue

FNS = {1: conv.conv1d, 2: conv.conv2d, 3: conv.conv3d}
ENGINE = "gemm_1x1"


def channels_last(t: torch.Tensor) -> torch.Tensor:
    return t.movedim(1, -1).contiguous().movedim(-1, 1)


# (x shape, cout, stride): narrow and wide outputs (the matmul may transpose a narrow product),
# strides that sample every other pixel, odd sizes.
CASES = [
    ((2, 16, 6, 5), 24, (1, 1)),
    ((2, 12, 7, 9), 40, (2, 2)),
    ((3, 40, 5, 4), 8, (1, 1)),
    ((2, 8, 11), 20, (3,)),
    ((1, 6, 3, 5, 4), 10, (1, 2, 2)),
]


def _ids(case) -> str:
    return f"{len(case[0]) - 2}d-{case[0]}-{case[1]}-s{case[2]}"


def _operands(case) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(rank, channels-last x, 1x1 weights) of a case."""
    shape, cout, _ = case
    nd = len(shape) - 2
    x = channels_last(torch.randn(shape, device=DEVICE))
    return nd, x, torch.randn(cout, shape[1], *(1,) * nd, device=DEVICE) / 3


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_forward_with_epilogue(case, poison):
    nd, x, w = _operands(case)
    stride = case[2]
    b = torch.randn(w.shape[0], device=DEVICE)
    ref = conv_reference(x, w, None, stride, ((0, 0),) * nd, (1,) * nd, 1)
    y = FNS[nd](x, w, None, stride, algo=ENGINE)
    assert_close(y, ref, what="plain")
    assert y.stride(1) == 1  # channels-last in, channels-last out
    c, r = torch.randn_like(y), torch.randn_like(y)
    epi = Epilogue(alpha=0.5, beta=2.0, activation="gelu", residual=True, store_preactivation=True)
    y, pre = FNS[nd](x, w, b, stride, algo=ENGINE, epilogue=epi, c=c, residual=r)
    ref_pre = 0.5 * ref + 2 * c.double() + b.double().view(1, -1, *(1,) * nd)
    assert_close(pre, ref_pre, what="pre-activation")
    assert_close(y, F.gelu(ref_pre) + r.double(), what="fused epilogue")


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_gradients(case, poison):
    nd, x, w = _operands(case)
    stride = case[2]
    pads, dilation = ((0, 0),) * nd, (1,) * nd
    dy = channels_last(
        torch.randn(conv_reference(x, w, None, stride, pads, dilation, 1).shape, device=DEVICE)
    )
    rx, rw = conv_backward_reference(x, w, dy, stride, pads, dilation, 1)
    dw = conv.conv_backward_weight(x, dy, w.shape, stride, pads, dilation, 1, algo=ENGINE)
    assert_close(dw, rw, what="wgrad")
    # Strided: the product over dy's pixels scattered into a zeroed dx ('poison' fills fresh
    # outputs with NaN, so pixels between the samples left unwritten fail).
    dx = conv.conv_backward_data(dy, w, x.shape, stride, pads, dilation, 1, algo=ENGINE)
    assert_close(dx, rx, what="dgrad")
    assert dx.stride(1) == 1


def test_half_precision_and_autograd():
    x = channels_last(torch.randn(4, 32, 6, 6, device=DEVICE)).half().requires_grad_()
    w = (torch.randn(48, 32, 1, 1, device=DEVICE) / 4).half().requires_grad_()
    ref = conv_reference(x.detach(), w.detach(), None, (1, 1), ((0, 0), (0, 0)), (1, 1), 1)
    y = conv.conv2d(x, w, algo=ENGINE)
    assert_close(y, ref, ref.half(), what="fp16 forward")
    dy = torch.randn_like(y)
    y.backward(dy)
    rx, rw = conv_backward_reference(x.detach(), w.detach(), dy, (1, 1), ((0, 0), (0, 0)), (1, 1), 1)
    assert_close(x.grad, rx, rx.half(), what="fp16 dx")
    assert_close(w.grad, rw, rw.half(), what="fp16 dw")


def test_not_supported_reasons():
    x = channels_last(torch.randn(2, 8, 5, 5, device=DEVICE))
    reasons = {r.name: r for r in tdnn.engines("conv", x, torch.randn(8, 8, 1, 1, device=DEVICE))}
    assert reasons[ENGINE].supported
    for weight, kwargs, why in [
        (torch.randn(8, 8, 3, 3, device=DEVICE), {}, "1x1 kernel"),
        (torch.randn(8, 4, 1, 1, device=DEVICE), {"groups": 2}, "one group"),
        (torch.randn(8, 8, 1, 1, device=DEVICE), {"padding": 1}, "no padding"),
        (torch.randn(8, 8, 1, 1, device=DEVICE), {"padding": ((0, 1), (0, 0))}, "no padding"),
    ]:
        with pytest.raises(tdnn.NotSupportedError, match=why):
            conv.conv2d(x, weight, algo=ENGINE, **kwargs)
    with pytest.raises(tdnn.NotSupportedError, match="channels-last"):
        conv.conv2d(x.contiguous(), torch.randn(8, 8, 1, 1, device=DEVICE), algo=ENGINE)
    dy = channels_last(torch.randn(2, 8, 3, 3, device=DEVICE))
    strided = conv.describe_dgrad(dy, torch.randn(8, 8, 1, 1, device=DEVICE), x.shape, 2)
    engine = conv.gemm.GemmDgradEngine()
    assert not engine.not_supported_reasons(strided)
    # With the activation's gradient fused in (autograd's path), the zeros would not get it.
    fused = dataclasses.replace(strided, activation=0, store_pre=True)
    assert any("no fused epilogue" in r for r in engine.not_supported_reasons(fused))


# The weight gradient over an explicit column matrix (``im2col_gemm``): (x shape, cout, kernel,
# stride, padding, dilation), each rank, taps that fall in the padding, strides, dilation,
# asymmetric padding, a wide and a narrow product.
COLUMN_CASES = [
    ((2, 16, 7, 7), 24, (3, 3), (1, 1), ((1, 1), (1, 1)), (1, 1)),
    ((2, 12, 9, 8), 8, (3, 2), (2, 1), ((1, 0), (0, 1)), (1, 2)),
    ((3, 40, 5, 6), 48, (1, 3), (1, 1), ((0, 0), (2, 2)), (1, 1)),
    ((2, 8, 11), 20, (5,), (2,), ((2, 2),), (1,)),
    ((1, 6, 4, 5, 4), 10, (3, 3, 3), (1, 1, 1), ((1, 1),) * 3, (1, 1, 1)),
]
COLUMNS = "im2col_gemm"


@pytest.mark.parametrize("case", COLUMN_CASES, ids=lambda c: f"{len(c[0]) - 2}d-{c[0]}-k{c[2]}-s{c[3]}")
def test_im2col_wgrad(case, poison):
    shape, cout, kernel, stride, pads, dilation = case
    x = channels_last(torch.randn(shape, device=DEVICE))
    w = torch.randn(cout, shape[1], *kernel, device=DEVICE)
    dy = channels_last(
        torch.randn(conv_reference(x, w, None, stride, pads, dilation, 1).shape, device=DEVICE)
    )
    _, rw = conv_backward_reference(x, w, dy, stride, pads, dilation, 1)
    dw = conv.conv_backward_weight(x, dy, w.shape, stride, pads, dilation, 1, algo=COLUMNS)
    assert_close(dw, rw, what="im2col wgrad")
    assert dw.stride(1) == 1  # channels-last like x: columns ordered (tap, channel)
    # A contiguous dw (taps innermost) orders the columns (channel, tap).
    problem = conv.describe_wgrad(x, dy, w.shape, stride, pads, dilation, 1)
    dense = torch.empty(w.shape, device=DEVICE)
    problem = dataclasses.replace(problem, w_strides=strides5(dense))
    engine = conv.gemm.Im2colGemmWgradEngine()
    assert not engine.not_supported_reasons(problem)
    engine.bind(problem, engine.configs(problem)[0])(x, dy, dense)
    assert_close(dense, rw, what="im2col wgrad into a contiguous dw")


def test_im2col_wgrad_reasons():
    x = channels_last(torch.randn(2, 8, 5, 5, device=DEVICE))
    dy = channels_last(torch.randn(2, 8, 5, 5, device=DEVICE))
    for args, why in [
        ((x.contiguous(), dy), "channels-last activations"),
        ((x, dy.contiguous()), "output gradient is not dense"),
    ]:
        with pytest.raises(tdnn.NotSupportedError, match=why):
            conv.conv_backward_weight(*args, (8, 8, 3, 3), 1, 1, algo=COLUMNS)
    with pytest.raises(tdnn.NotSupportedError, match="one group"):
        conv.conv_backward_weight(x, dy, (8, 4, 3, 3), 1, 1, 1, 2, algo=COLUMNS)
    with pytest.raises(tdnn.NotSupportedError, match="gemm_1x1"):
        conv.conv_backward_weight(x, dy, (8, 8, 1, 1), algo=COLUMNS)
    engine = conv.gemm.Im2colGemmWgradEngine()
    problem = conv.describe_wgrad(x, dy, (8, 8, 3, 3), 1, 1)
    huge = dataclasses.replace(problem, n=1 << 20)
    assert any("GiB" in r for r in engine.not_supported_reasons(huge))
    # Timed in 16 bits only: other dtypes run it by name.
    assert engine.cost(problem) == 1e9 > engine.cost(dataclasses.replace(problem, dtype="float16"))


@pytest.mark.gpu_only("Hopper's persistent TMA kernel in 128 x 256 tiles (the interpreter runs none)")
def test_im2col_wgrad_wide_tiles():
    """3x3 512 @7: the product in ``_COLUMNS_TILE`` (its tiles fill half the GPU), into a bf16 dw
    and into an fp32 one (stored from registers in halves), against the float64 reference."""
    from tritondnn.ops.conv.plans import wgrad_plan

    x = channels_last(torch.randn(2, 512, 7, 7, device=DEVICE)).bfloat16()
    dy = channels_last(torch.randn(2, 512, 7, 7, device=DEVICE)).bfloat16()
    w_shape = (512, 512, 3, 3)
    problem = conv.describe_wgrad(x, dy, w_shape, 1, 1)
    assert conv.gemm._columns_product(problem)[2] is conv.gemm._COLUMNS_TILE
    w = torch.empty(w_shape, device=DEVICE)
    _, rw = conv_backward_reference(x, w, dy, (1, 1), ((1, 1), (1, 1)), (1, 1), 1)
    _, tw = conv_backward_reference(x.float(), w, dy.float(), (1, 1), ((1, 1), (1, 1)), (1, 1), 1)
    assert_close(
        conv.conv_backward_weight(x, dy, w_shape, 1, 1, algo=COLUMNS), rw, tw.bfloat16(), what="bf16 dw"
    )
    wide = wgrad_plan(x, dy, list(w_shape), [1, 1], [1, 1], [1, 1], 1, COLUMNS, torch.float32)(x, dy)
    assert_close(wide, rw.float(), what="fp32 dw")
