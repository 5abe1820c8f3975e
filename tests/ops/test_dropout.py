"""Dropout and dropout + residual add: the Philox mask against a plain-PyTorch Philox, statistics,
reproducibility, replayed backward, every dtype and layout, errors."""

from __future__ import annotations

import pytest
import torch

import tritondnn.ops.dropout as dr
from helpers import DEVICE, DTYPES, LAYOUTS, assert_close, randn


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(3, 4099), (8, 1024), (5,)], ids=["ragged", "whole-groups", "tiny"])
def test_values_mask_and_gradient(dtype, shape, poison):
    x = randn(*shape, dtype=dtype, scale=3.0)
    seed, offset, p = 2**40 + 12345, 2**33 + 7, 0.3
    xg = x.clone().requires_grad_(True)
    y, mask = dr.dropout(xg, p, seed=seed, offset=offset, return_mask=True)
    keep = dr.dropout_mask_reference(tuple(shape), p, seed, offset).to(DEVICE)
    assert torch.equal(mask, keep)
    ref = dr.dropout_reference(x, p, seed, offset)
    torch_out = torch.where(keep, x * (1 / (1 - p)), 0).to(dtype)
    assert y.dtype == dtype
    assert_close(y, ref, torch_out, "forward")
    dy = randn(*shape, dtype=dtype)
    (dx,) = torch.autograd.grad(y, xg, dy)
    dx_ref = torch.where(keep, dy.double() / (1 - p), 0.0)
    assert_close(dx, dx_ref, torch.where(keep, dy * (1 / (1 - p)), 0).to(dtype), "backward")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dropout_add(dtype, poison):
    x, r = randn(7, 1000, dtype=dtype), randn(7, 1000, dtype=dtype)
    xg, rg = x.clone().requires_grad_(True), r.clone().requires_grad_(True)
    y, keep = dr.dropout_add(xg, rg, 0.25, seed=99, return_mask=True)
    ref = dr.dropout_reference(x, 0.25, 99, 0, r)
    torch_out = (torch.where(keep, x * (1 / 0.75), 0) + r).to(dtype)
    assert_close(y, ref, torch_out, "forward")
    dy = randn(7, 1000, dtype=dtype)
    dx, drr = torch.autograd.grad(y, (xg, rg), dy)
    assert_close(dx, torch.where(keep, dy.double() / 0.75, 0.0), torch.where(keep, dy / 0.75, 0), "dx")
    assert torch.equal(drr, dy)


def test_dropout_add_broadcast_residual():
    x = randn(4, 6, 33)
    r = randn(33).requires_grad_(True)
    y = dr.dropout_add(x, r, 0.5, seed=3)
    keep = dr.dropout_mask_reference((4, 6, 33), 0.5, 3).to(DEVICE)
    assert_close(y, torch.where(keep, x.double() * 2, 0.0) + r.double())
    dy = randn(4, 6, 33)
    (g,) = torch.autograd.grad(y, r, dy)
    assert_close(g, dy.double().sum((0, 1)), dy.sum((0, 1)))


def test_reproducible_and_independent():
    x = randn(64, 513)
    a = dr.dropout(x, 0.5, seed=1, offset=0)
    assert torch.equal(a, dr.dropout(x, 0.5, seed=1, offset=0))
    b = dr.dropout(x, 0.5, seed=1, offset=dr.counters_used(x.numel()))
    c = dr.dropout(x, 0.5, seed=2, offset=0)
    agree_b = ((a != 0) == (b != 0)).float().mean().item()
    agree_c = ((a != 0) == (c != 0)).float().mean().item()
    assert 0.45 < agree_b < 0.55 and 0.45 < agree_c < 0.55  # independent masks agree half the time


def test_seed_from_torch_generator():
    x = randn(1000)
    torch.manual_seed(5)
    a = dr.dropout(x, 0.5)
    torch.manual_seed(5)
    b = dr.dropout(x, 0.5)
    c = dr.dropout(x, 0.5)
    assert torch.equal(a, b) and not torch.equal(b, c)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate(p):
    x = torch.ones(80_000, device=DEVICE)
    y, keep = dr.dropout(x, p, seed=11, return_mask=True)
    rate = keep.float().mean().item()
    sigma = (p * (1 - p) / x.numel()) ** 0.5
    assert abs(rate - (1 - p)) < 5 * sigma
    assert torch.allclose(y[keep], torch.full_like(y[keep], 1 / (1 - p)))


def test_edge_probabilities_and_eval():
    x = randn(10, 10)
    assert dr.dropout(x, 0.5, training=False) is x
    assert torch.equal(dr.dropout(x, 0.0, seed=1), x)
    assert torch.equal(dr.dropout(x, 1.0, seed=1), torch.zeros_like(x))
    r = randn(10, 10)
    assert torch.equal(dr.dropout_add(x, r, 0.5, training=False), x + r)
    _, keep = dr.dropout(x, 0.5, training=False, return_mask=True)
    assert bool(keep.all())
    empty = randn(0, 4)
    assert dr.dropout(empty, 0.5, seed=1).shape == (0, 4)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_use_logical_order(layout):
    base = randn(3, 5, 7, 11)
    x = LAYOUTS[layout](base)
    y = dr.dropout(x, 0.4, seed=8)
    assert torch.equal(y, dr.dropout(base, 0.4, seed=8))


def test_inplace():
    x = randn(5, 300)
    expected = dr.dropout(x, 0.5, seed=4)
    y = dr.dropout(x, 0.5, seed=4, inplace=True)
    assert y is x and torch.equal(x, expected)


def test_errors():
    x = randn(4, 4)
    with pytest.raises(ValueError, match="between 0 and 1"):
        dr.dropout(x, 1.5)
    with pytest.raises(TypeError, match="dtype"):
        dr.dropout(torch.ones(3, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="seed"):
        dr.dropout(x, seed=-1)
    with pytest.raises(TypeError, match="offset"):
        dr.dropout(x, offset=1.5)
    with pytest.raises(ValueError, match="broadcast"):
        dr.dropout_add(x, randn(3), 0.5)
    with pytest.raises(TypeError, match="residual"):
        dr.dropout_add(x, randn(4, 4, dtype=torch.float64), 0.5)
    with pytest.raises(RuntimeError, match="inplace"):
        dr.dropout(x.clone().requires_grad_(True), inplace=True)


def test_compiles_through_custom_op():
    out = torch.ops.tritondnn.dropout(randn(8, 8), None, 0.5, 1, 0, True)
    assert out[0].shape == (8, 8) and out[1].dtype == torch.bool
