"""CTC loss: values and gradients against float64, reductions, blank index, padded and
concatenated targets, repeated labels, long targets, strided inputs, forward without a gradient,
zero_infinity and impossible alignments, NaN, determinism, errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tritondnn.ops.ctc as ctc
from helpers import DEVICE, assert_close


def _case(T=14, N=4, C=6, S=5, blank=0, dtype=torch.float32):
    lp = torch.randn(T, N, C, device=DEVICE, dtype=dtype).log_softmax(-1)
    labels = [c for c in range(C) if c != blank]
    tg = torch.tensor(labels, device=DEVICE)[torch.randint(0, C - 1, (N, S), device=DEVICE)]
    il = [T, T - 3, T - 5, 4][:N]
    tl = [S, 3, 0, 2][:N]
    return lp, tg, il, tl


def _check(lp, tg, il, tl, **kw):
    dtype = lp.dtype
    x = lp.clone().requires_grad_(True)
    y = ctc.ctc_loss(x, tg, il, tl, **kw)
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, dy)
    xt = lp.clone().requires_grad_(True)
    yt = F.ctc_loss(xt, tg, il, tl, **kw)
    (dxt,) = torch.autograd.grad(yt, xt, dy)
    xr = lp.double().requires_grad_(True)
    yr = F.ctc_loss(xr, tg, il, tl, **kw)
    (dxr,) = torch.autograd.grad(yr, xr, dy.double())
    assert y.dtype == dtype
    assert_close(y, yr, yt, "loss")
    assert_close(dx, dxr, dxt, "gradient")
    return y, dx


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_reductions(reduction, dtype):
    _check(*_case(dtype=dtype), reduction=reduction)


def test_reference_recursion():
    lp, tg, il, tl = _case()
    assert_close(ctc.ctc_loss(lp, tg, il, tl, reduction="none"), ctc.ctc_loss_reference(lp, tg, il, tl))


def test_blank_last_concatenated_targets_and_tensor_lengths():
    lp, tg, il, tl = _case(blank=5)
    flat = torch.cat([tg[n, : tl[n]] for n in range(len(tl))])
    _check(lp, flat, torch.tensor(il), torch.tensor(tl), blank=5)


def test_repeated_labels_and_unbatched():
    lp = torch.randn(10, 4, device=DEVICE).log_softmax(-1)
    tg = torch.tensor([2, 2, 3, 3], device=DEVICE)
    y = ctc.ctc_loss(lp, tg, 10, 4, reduction="sum")
    assert_close(y, F.ctc_loss(lp.double(), tg, [10], [4], reduction="sum"))
    _check(lp, tg, [10], [4], reduction="sum")


def test_runs_of_repeats_variable_lengths():
    # Two classes besides the blank: runs of equal labels (no blank skip) next to changes (skip).
    T, N = 23, 5
    lp = torch.randn(T, N, 3, device=DEVICE).log_softmax(-1)
    tg = torch.randint(1, 3, (N, 9), device=DEVICE, dtype=torch.int32)
    _check(lp, tg, [23, 22, 17, 9, 1], [9, 8, 5, 1, 0], reduction="sum")


def test_long_targets():
    # More than 128 labels: the recursion spreads over several warps on a GPU.
    T, S = 140, 131
    lp = torch.randn(T, 2, 7, device=DEVICE).log_softmax(-1)
    tg = (torch.arange(S, device=DEVICE) % 6 + 1).repeat(2, 1)
    tg[:, 10] = tg[:, 9]
    tg[1] = tg[1].flip(0)
    _check(lp, tg, [T, T - 3], [S, S - 2], reduction="sum")


@pytest.mark.parametrize("layout", ["batch_major", "sliced"])
def test_strided_log_probs(layout):
    lp, tg, il, tl = _case(C=5)
    if layout == "batch_major":
        lp = lp.transpose(0, 1).contiguous().transpose(0, 1)
    else:
        lp = torch.cat([lp, torch.randn_like(lp)], -1)[..., ::2]
    assert not lp.is_contiguous()
    x = lp.requires_grad_(True)
    y = ctc.ctc_loss(x, tg, il, tl, reduction="sum")
    (dx,) = torch.autograd.grad(y, x)
    xr = lp.detach().double().requires_grad_(True)
    yr = F.ctc_loss(xr, tg, il, tl, reduction="sum")
    (dxr,) = torch.autograd.grad(yr, xr)
    assert_close(y, yr, what="loss")
    assert_close(dx, dxr, what="gradient")


def test_forward_without_gradient():
    # No gradient can follow: only alpha runs and no table is kept.
    lp, tg, il, tl = _case()
    ref = ctc.ctc_loss_reference(lp, tg, il, tl)
    assert_close(ctc.ctc_loss(lp, tg, il, tl, reduction="none"), ref)
    with torch.no_grad():
        assert_close(ctc.ctc_loss(lp.requires_grad_(True), tg, il, tl, reduction="none"), ref)


def test_lengths_as_tensor_and_list():
    lp, tg, il, tl = _case()
    y = ctc.ctc_loss(lp, tg, torch.tensor(il, device=DEVICE, dtype=torch.int32), tl)
    assert_close(y, F.ctc_loss(lp.double(), tg, il, tl), F.ctc_loss(lp, tg, il, tl))


@pytest.mark.parametrize("zero_infinity", [False, True])
def test_impossible_alignment(zero_infinity):
    # Sample 0 needs 7 steps for 4 repeated labels but has 3 (infinite loss; NaN gradient as
    # PyTorch's, or 0 and 0 with zero_infinity); sample 1 is possible.
    lp = torch.randn(3, 2, 5, device=DEVICE).log_softmax(-1)
    tg = torch.tensor([[1, 1, 1, 1], [1, 2, 0, 0]], device=DEVICE)
    x = lp.clone().requires_grad_(True)
    y = ctc.ctc_loss(x, tg, [3, 3], [4, 2], reduction="none", zero_infinity=zero_infinity)
    (dx,) = torch.autograd.grad(y.sum(), x)
    xr = lp.double().requires_grad_(True)
    ref = F.ctc_loss(xr, tg, [3, 3], [4, 2], reduction="none", zero_infinity=zero_infinity)
    (dxr,) = torch.autograd.grad(ref.sum(), xr)
    assert bool(torch.isinf(ref[0])) != zero_infinity
    assert_close(y, ref, what="loss")
    assert_close(dx, dxr, what="gradient")
    if zero_infinity:
        assert y[0].item() == 0.0 and bool((dx[:, 0] == 0).all())


def test_label_out_of_range_is_impossible():
    lp, tg, il, tl = _case(C=5)
    tg[1, 1] = 5
    y = ctc.ctc_loss(lp, tg, il, tl, reduction="none")
    ref = ctc.ctc_loss_reference(lp, tg.clamp(max=4), il, tl)
    assert bool(torch.isinf(y[1])) and y[1].item() > 0
    assert_close(y[[0, 2, 3]], ref[[0, 2, 3]])


def test_nan_propagates():
    lp, tg, il, tl = _case()
    lp[2, 1, 0] = float("nan")  # the blank of sample 1 at step 2: every alignment reads it
    x = lp.clone().requires_grad_(True)
    y = ctc.ctc_loss(x, tg, il, tl, reduction="none")
    ref = F.ctc_loss(lp.double(), tg, il, tl, reduction="none")
    assert bool(torch.isnan(ref[1]))
    assert_close(y, ref)


def test_deterministic():
    lp, tg, il, tl = _case()
    runs = []
    for _ in range(2):
        x = lp.clone().requires_grad_(True)
        y = ctc.ctc_loss(x, tg, il, tl, reduction="sum")
        runs.append((y.detach(), torch.autograd.grad(y, x)[0]))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


@pytest.mark.slow
def test_issue_size():
    lp = torch.randn(500, 32, 50, device=DEVICE).log_softmax(-1)
    tg = torch.randint(1, 50, (32, 100), device=DEVICE)
    _check(lp, tg, [500] * 32, [100] * 32)


def test_errors():
    lp, tg, il, tl = _case()
    with pytest.raises(TypeError, match="dtype"):
        ctc.ctc_loss(lp.half(), tg, il, tl)
    with pytest.raises(ValueError, match="reduction"):
        ctc.ctc_loss(lp, tg, il, tl, reduction="max")
    with pytest.raises(ValueError, match="blank"):
        ctc.ctc_loss(lp, tg, il, tl, blank=6)
    with pytest.raises(ValueError, match="input_lengths"):
        ctc.ctc_loss(lp, tg, [0, 1, 1, 1], tl)
    with pytest.raises(ValueError, match="input_lengths"):
        ctc.ctc_loss(lp, tg, [1, 2], tl)
    with pytest.raises(ValueError, match="padded"):
        ctc.ctc_loss(lp, tg, il, [9, 1, 1, 1])
    with pytest.raises(ValueError, match="1-D targets"):
        ctc.ctc_loss(lp, tg.reshape(-1), il, tl)
    with pytest.raises(TypeError, match="dtype"):
        ctc.ctc_loss(lp, tg.float(), il, tl)
