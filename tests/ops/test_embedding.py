"""Embedding: lookups and weight gradients against float64 for every index dtype, padding_idx,
repeated indices, both gradient engines (atomic and deterministic), max_norm, the fallbacks,
errors, the torch.library ops and torch.compile."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tritondnn as tdnn
from helpers import DEVICE, ON_GPU, assert_close, grads, randn
from tritondnn.ops import embedding as em


def _indices(shape: tuple[int, ...], rows: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Random indices with repeats (a few rows drawn often: the gradient sums several tokens),
    the first and the last row among them."""
    t = torch.randint(0, rows, shape, device=DEVICE).remainder(max(1, rows // 3))
    if t.numel() >= 2:
        t.view(-1)[:2] = torch.tensor([0, rows - 1])
    return t.to(dtype)


def _check(idx: torch.Tensor, weight: torch.Tensor, what: str = "", **kwargs) -> None:
    out = tdnn.embedding(idx, weight, **kwargs)
    dy = torch.randn(out.shape, device=weight.device, dtype=weight.dtype)
    ours, dw = grads(lambda w: tdnn.embedding(idx, w, **kwargs), weight, dy)
    theirs, dw_torch = grads(lambda w: F.embedding(idx, w, **kwargs), weight, dy)
    ref, dw_ref = grads(
        lambda w: em.embedding_reference(idx, w, kwargs.get("padding_idx")), weight.double(), dy.double()
    )
    assert ours.dtype == weight.dtype and dw.dtype == weight.dtype and ours.shape == ref.shape
    assert torch.equal(ours, theirs), f"lookup {what}"
    assert_close(dw, dw_ref, dw_torch, f"weight gradient {what} {kwargs}")


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32], ids=str)
def test_values_and_gradients(index_dtype, dtype, deterministic, monkeypatch):
    monkeypatch.setattr(tdnn.config, "deterministic", deterministic)
    weight = randn(40, 24, dtype=dtype)
    _check(_indices((5, 7), 40, index_dtype), weight, "2-D indices")
    _check(_indices((13,), 40, index_dtype), weight, "padding_idx", padding_idx=3)
    _check(_indices((2, 3, 4), 40, index_dtype), weight, "negative padding_idx", padding_idx=-40)


def test_engines_by_mode(monkeypatch):
    """The atomic scatter normally; deterministic mode takes the sorted engine, whose bits
    repeat (a check with teeth on a GPU only: the interpreter's atomics add in order)."""
    idx, weight = _indices((300,), 20), randn(20, 40)
    reports = {r.name: r for r in tdnn.engines("embedding", idx, weight, backward=True)}
    assert reports["atomic-scatter"].chosen and not reports["gather"].supported
    monkeypatch.setattr(tdnn.config, "deterministic", True)
    reports = {r.name: r for r in tdnn.engines("embedding", idx, weight, backward=True)}
    assert reports["sorted-segments"].chosen and not reports["atomic-scatter"].supported
    dy = randn(300, 40)
    first, second = (grads(lambda w: tdnn.embedding(idx, w), weight, dy)[1] for _ in range(2))
    assert torch.equal(first, second)


def test_weight_and_gradient_layouts():
    """A weight whose rows are further apart than their width (a slice) is read in place; one
    with strided columns is copied; a gradient with strided rows or broadcast (expanded) is read
    as it is."""
    wide = randn(30, 40)
    _check(_indices((4, 5), 30), wide[:, 3:19], "sliced weight", padding_idx=1)
    _check(_indices((4, 5), 30), randn(16, 30).t(), "transposed weight")
    idx, weight = _indices((6,), 30), randn(30, 16).requires_grad_(True)
    for dy in (randn(6, 32)[:, ::2], randn(1, 16).expand(6, 16)):
        (dw,) = torch.autograd.grad(tdnn.embedding(idx, weight), weight, dy)
        (ref,) = torch.autograd.grad(F.embedding(idx, weight.double()), weight, dy.double())
        assert_close(dw, ref.float())


def test_benchmark_mode_times_into_scratch(cache_dir, monkeypatch):
    """Benchmark mode times every engine on the call's own tensors but a scratch gradient table:
    the atomic engine adds into the table it is given."""
    monkeypatch.setattr(tdnn.config, "benchmark", True)
    monkeypatch.setattr(em.FAMILY, "_plans", {})
    monkeypatch.setattr(em.FAMILY, "_chosen", {})
    _check(_indices((7, 3), 9), randn(9, 12), "benchmark mode")


def test_wide_rows_take_several_column_blocks(monkeypatch):
    """Rows wider than a program's columns (GPT-2's 768 of 256), in both engines."""
    for deterministic in (False, True):
        monkeypatch.setattr(tdnn.config, "deterministic", deterministic)
        _check(_indices((9,), 7), randn(7, 600), f"600 wide, deterministic {deterministic}")


def test_max_norm_renormalizes_in_place_as_torch():
    weight = randn(10, 6, scale=3.0)
    idx = _indices((8,), 10)
    ours, theirs = weight.clone(), weight.clone()
    out = tdnn.embedding(idx, ours, max_norm=1.5)
    ref = F.embedding(idx, theirs, max_norm=1.5)
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(out, ref)
    assert not torch.equal(ours, weight)


@pytest.mark.parametrize("kwargs", [{"scale_grad_by_freq": True}, {"sparse": True}])
def test_options_run_torchs(kwargs):
    """scale_grad_by_freq and sparse gradients are PyTorch's own."""
    weight = randn(12, 5).requires_grad_(True)
    idx = _indices((4, 3), 12)
    tdnn.embedding(idx, weight, **kwargs).sum().backward()
    ours = weight.grad
    weight.grad = None
    F.embedding(idx, weight, **kwargs).sum().backward()
    assert ours.is_sparse == weight.grad.is_sparse == kwargs.get("sparse", False)
    torch.testing.assert_close(ours.to_dense(), weight.grad.to_dense())


def test_out_of_range_on_device_gives_nan_rows():
    """The kernels' answer to an index they cannot check without a host sync: NaN rows and no
    gradient from those tokens; nothing is read or written out of bounds."""
    weight = randn(6, 4)
    idx = torch.tensor([1, 6, -2, 1], device=DEVICE)
    out = em._forward(idx, weight)
    assert torch.isnan(out[1:3]).all()
    torch.testing.assert_close(out[[0, 3]], weight[[1, 1]])
    for deterministic in (False, True):
        tdnn.config.deterministic = deterministic
        try:
            dw = em._backward(torch.ones(4, 4, device=DEVICE), idx, 6, -1)
        finally:
            tdnn.config.deterministic = False
        expected = torch.zeros(6, 4, device=DEVICE)
        expected[1] = 2.0
        torch.testing.assert_close(dw, expected)


def test_empty_input():
    weight = randn(5, 3).requires_grad_(True)
    out = tdnn.embedding(torch.zeros(0, 2, dtype=torch.int64, device=DEVICE), weight)
    assert out.shape == (0, 2, 3)
    out.sum().backward()
    assert torch.equal(weight.grad, torch.zeros_like(weight))


def test_errors():
    weight = randn(5, 3)
    with pytest.raises(TypeError, match="'input' has dtype torch.float32"):
        tdnn.embedding(randn(4), weight)
    with pytest.raises(ValueError, match="'weight'"):
        tdnn.embedding(_indices((4,), 5), randn(5))
    with pytest.raises(ValueError, match="'padding_idx'=5"):
        tdnn.embedding(_indices((4,), 5), weight, padding_idx=5)
    if DEVICE == "cpu":  # host indices are checked on the host, as PyTorch does
        with pytest.raises(IndexError, match="index 5 is out of range for 5 rows"):
            tdnn.embedding(torch.tensor([0, 5]), weight)
        with pytest.raises(IndexError, match="index -1 is out of range"):
            tdnn.embedding(torch.tensor([-1, 2]), weight)


def test_library_ops_pass_opcheck():
    idx, weight = _indices((3, 4), 9), randn(9, 5)
    torch.library.opcheck(em._forward.op, (idx, weight))
    torch.library.opcheck(em._backward.op, (randn(3, 4, 5), idx, 9, 2))


def test_torch_compile_fullgraph():
    idx = _indices((4, 6), 11)

    def f(w):
        return (tdnn.embedding(idx, w, padding_idx=1) * 2).sum()

    compiled = torch.compile(f, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    w = randn(11, 8).requires_grad_(True)
    (dw,) = torch.autograd.grad(compiled(w), w)
    w64 = w.detach().double().requires_grad_(True)
    (dw_ref,) = torch.autograd.grad((F.embedding(idx, w64, padding_idx=1) * 2).sum(), w64)
    assert_close(dw, dw_ref)
