"""Cross entropy: every input rank and layout, weights, ignore_index, label smoothing, reductions,
probability targets, long rows, extremes, autograd, the torch.library ops, errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tritondnn as tdnn
from helpers import DEVICE, DTYPES, LAYOUTS, ON_GPU, assert_close, grads, randn
from tritondnn.core import strides as ce_strides
from tritondnn.ops import cross_entropy as ce


def _targets(shape: tuple[int, ...], classes: int, ignore_index: int = -100) -> torch.Tensor:
    """Random class indices, the first one ``ignore_index`` (a sample that must not count)."""
    t = torch.randint(0, classes, shape, device=DEVICE)
    if t.ndim:
        t.view(-1)[0] = ignore_index
    return t


def _check(x: torch.Tensor, target: torch.Tensor, what: str = "", **kwargs) -> None:
    """Loss and logits' gradient against float64, within 2x PyTorch's own error in x's dtype."""
    weight = kwargs.pop("weight", None)
    ours = lambda t: tdnn.cross_entropy(t, target, weight, **kwargs)
    theirs = lambda t: F.cross_entropy(
        t, target, weight.to(t.dtype) if weight is not None else None, **kwargs
    )
    out = ours(x)
    dy = torch.randn(out.shape, device=x.device, dtype=out.dtype)
    loss, dx = grads(ours, x, dy)
    loss_torch, dx_torch = grads(theirs, x, dy)
    loss_ref, dx_ref = grads(
        lambda t: ce.cross_entropy_reference(t, target, weight, **kwargs), x.double(), dy.double()
    )
    assert loss.dtype == x.dtype and dx.dtype == x.dtype and loss.shape == loss_ref.shape
    assert_close(loss, loss_ref, loss_torch, f"loss {what} {kwargs}")
    assert_close(dx, dx_ref, dx_torch, f"gradient {what} {kwargs}")


@pytest.mark.parametrize("label_smoothing", [0.0, 0.3])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_values_and_gradients(reduction, weighted, label_smoothing):
    x = randn(37, 29, scale=3.0)
    weight = torch.rand(29, device=DEVICE) + 0.25 if weighted else None
    _check(x, _targets((37,), 29), reduction=reduction, weight=weight, label_smoothing=label_smoothing)


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float64], ids=str)
def test_dtypes(dtype):
    x = randn(19, 53, dtype=dtype, scale=4.0)
    _check(x, _targets((19,), 53), str(dtype), reduction="none")
    _check(x, _targets((19,), 53), str(dtype), label_smoothing=0.1)


@pytest.mark.parametrize("shape", [(11,), (6, 11), (3, 11, 5), (2, 11, 3, 4)], ids=["C", "NC", "NCd", "NCdd"])
def test_input_ranks(shape):
    """(C,), (N, C) and (N, C, d...) logits with targets of the matching shape."""
    classes = shape[0] if len(shape) == 1 else shape[1]
    target_shape = () if len(shape) == 1 else (shape[0], *shape[2:])
    x = randn(*shape, scale=2.0)
    for reduction in ("none", "mean"):
        _check(x, _targets(target_shape, classes), str(shape), reduction=reduction, label_smoothing=0.2)


@pytest.mark.parametrize("layout", ["transposed", "sliced"])
def test_strided_logits(layout):
    """Logits read in place through their strides: classes along a non-unit stride, or every
    second element of a larger buffer."""
    x = LAYOUTS[layout](randn(23, 17, scale=3.0))
    _check(x, _targets((23,), 17), layout, weight=torch.rand(17, device=DEVICE) + 0.5)
    nchw = LAYOUTS[layout](randn(2, 7, 3, 5))
    _check(nchw, _targets((2, 3, 5), 7), f"{layout} NCHW", reduction="sum")


def test_one_class():
    """A single class: every loss is zero (a kernel argument of 1, which Triton specializes)."""
    _check(randn(5, 1), torch.zeros(5, dtype=torch.int64, device=DEVICE), label_smoothing=0.2)


def test_ignore_index_may_be_a_class():
    """A valid class chosen as ignore_index: its samples count for nothing, gradient included."""
    x = randn(40, 6, scale=2.0)
    target = torch.arange(40, device=DEVICE) % 6
    _check(x, target, ignore_index=2)
    xg = x.clone().requires_grad_(True)
    tdnn.cross_entropy(xg, target, ignore_index=2).backward()
    assert torch.all(xg.grad[target == 2] == 0) and torch.any(xg.grad[target != 2] != 0)


def test_gradient_rows_padded_for_the_output_layer():
    """With a class count whose rows are not 16-byte aligned, the logits' gradient is written in
    rows padded to 16 bytes (the layout the output layer's products read; values unchanged), and
    flows back through a linear layer (a language model's head) to both of its gradients."""
    h = randn(2, 5, 12, scale=0.5).requires_grad_(True)
    w = randn(21, 12, scale=0.5).requires_grad_(True)
    target = _targets((10,), 21)
    logits = tdnn.linear(h, w).reshape(-1, 21)
    seen = []
    logits.register_hook(seen.append)  # the gradient as passed on (a retained .grad is re-laid out)
    tdnn.cross_entropy(logits, target).backward()
    assert seen[0].stride() == (24, 1)
    h_ref, w_ref = (t.detach().double().requires_grad_(True) for t in (h, w))
    logits_ref = F.linear(h_ref, w_ref).reshape(-1, 21)
    logits_ref.register_hook(seen.append)
    F.cross_entropy(logits_ref, target).backward()
    for ours, ref in ((seen[0], seen[1]), (h.grad, h_ref.grad), (w.grad, w_ref.grad)):
        torch.testing.assert_close(ours.double(), ref, rtol=1e-4, atol=1e-6)


def test_rows_longer_than_one_block():
    """A vocabulary-sized row takes several blocks of classes (a running max and rescaled sum),
    with the logits offset by 1e4 to catch a sum that is not rescaled."""
    classes = 5003
    x = randn(3, classes, scale=5.0) + 1e4
    _check(x, _targets((3,), classes), label_smoothing=0.1)
    _check(x, _targets((3,), classes), weight=torch.rand(classes, device=DEVICE) + 0.5, reduction="none")


@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
@pytest.mark.parametrize("vectors", [True, False])
def test_gradient_stored_in_whole_vectors(vectors, label_smoothing, monkeypatch):
    """Rows of 4099 fp16 classes: the gradient's rows, padded to 4104, are stored in whole
    16-byte vectors (the padding written zero) or one class at a time; both give the reference's
    loss and gradient."""
    n_rows, n_cols = 8, 4099
    x = randn(n_rows, n_cols, dtype=torch.float16, scale=3.0)
    configs = ce.OnlineRowEngine.configs

    def only(engine, problem):
        chosen = [c for c in configs(engine, problem) if (c["VECTOR"] > 1) == (problem.backward and vectors)]
        assert chosen and chosen[0]["BLOCK_R"] == 1
        return chosen[:1]

    monkeypatch.setattr(ce.OnlineRowEngine, "configs", only)
    # The gradient's buffer starts as NaN, so that padding the kernel leaves unwritten shows.
    monkeypatch.setattr(
        ce, "empty_aligned_rows", lambda *a: ce_strides.empty_aligned_rows(*a).fill_(float("nan"))
    )
    monkeypatch.setattr(ce.FAMILY, "_plans", {})
    monkeypatch.setattr(ce.FAMILY, "_chosen", {})
    target = _targets((n_rows,), n_cols)
    _check(x, target, str(vectors), label_smoothing=label_smoothing, reduction="none")
    seen = []
    xg = x.clone().requires_grad_(True)
    xg.register_hook(seen.append)
    tdnn.cross_entropy(xg, target, label_smoothing=label_smoothing).backward()
    dx = seen[0]
    assert dx.stride() == (4104, 1)
    if vectors:
        padding = torch.as_strided(dx, (n_rows, 5), (4104, 1), dx.storage_offset() + n_cols)
        assert torch.all(padding == 0)


def test_whole_vectors_only_where_rows_are_padded():
    """Vector stores need dx on 16 bytes, rows a whole number of vectors apart and padded to
    whole vectors inside the storage."""
    assert ce._whole_vectors(randn(8, 4104, dtype=torch.float16)[:, :4099], 4099)
    assert ce._whole_vectors(randn(8, 4104, dtype=torch.float16), 4104)
    assert not ce._whole_vectors(randn(8, 4099, dtype=torch.float16), 4099)  # rows 4099 apart
    assert not ce._whole_vectors(
        randn(8 * 4104 + 8, dtype=torch.float16)[1 : 8 * 4104 + 1].view(8, 4104), 4104
    )
    assert not ce._whole_vectors(randn(4104, 8, dtype=torch.float16).t(), 4104)
    short = randn(8 * 4104 - 5, dtype=torch.float16)  # the last row's padding missing
    assert not ce._whole_vectors(short.as_strided((8, 4099), (4104, 1)), 4099)
    assert ce._whole_vectors(randn(8, 4100, dtype=torch.float64)[:, :4099], 4099)  # vectors of 2


def test_extreme_logits():
    """fp16 logits of +-1e4 and -inf entries (masked classes) as PyTorch treats them."""
    x = randn(8, 9, dtype=torch.float16) * 1e4
    _check(x, _targets((8,), 9), "fp16 1e4")
    masked = randn(4, 9)
    masked[:, 0] = -float("inf")
    target = torch.tensor([1, 2, 3, 4], device=DEVICE)
    torch.testing.assert_close(tdnn.cross_entropy(masked, target), F.cross_entropy(masked, target))


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_probability_targets(reduction, weighted):
    x = randn(9, 7, 2, scale=2.0)
    target = torch.softmax(randn(9, 7, 2), 1)
    weight = torch.rand(7, device=DEVICE) + 0.5 if weighted else None
    _check(x, target, weight=weight, reduction=reduction, label_smoothing=0.25)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_empty_batch(reduction):
    x, target = randn(0, 5), torch.zeros(0, dtype=torch.int64, device=DEVICE)
    torch.testing.assert_close(
        tdnn.cross_entropy(x, target, reduction=reduction),
        F.cross_entropy(x, target, reduction=reduction),
        equal_nan=True,
    )


def test_legacy_reduction_arguments():
    x, target = randn(5, 4), _targets((5,), 4)
    for size_average, reduce in ((False, None), (None, False), (True, True)):
        torch.testing.assert_close(
            tdnn.cross_entropy(x, target, size_average=size_average, reduce=reduce),
            F.cross_entropy(x, target, size_average=size_average, reduce=reduce),
        )


def test_out_of_range_target_on_device_gives_nan():
    """The kernels' answer to a target they cannot check without a host sync: that sample's loss
    and gradient are NaN, the others exact; nothing is read out of bounds."""
    x = randn(4, 6)
    target = torch.tensor([1, 6, -3, 2], device=DEVICE)
    loss, stats = ce._forward(x, target, None, -100, False)
    expected = F.cross_entropy(x, target.clamp(0, 5), reduction="none")
    assert torch.isnan(loss[0, 1]) and torch.isnan(loss[0, 2])
    torch.testing.assert_close(loss[0, [0, 3]], expected[[0, 3]])
    dx = ce._backward(torch.ones(1, 4, device=DEVICE), x, target, None, stats, -100)
    assert torch.isnan(dx[1:3]).all() and not torch.isnan(dx[[0, 3]]).any()


def test_errors():
    x, target = randn(4, 5), _targets((4,), 5)
    with pytest.raises(TypeError, match="'target' has dtype torch.int32"):
        tdnn.cross_entropy(x, target.int())
    with pytest.raises(ValueError, match="'target' has shape"):
        tdnn.cross_entropy(x, target[:3])
    with pytest.raises(ValueError, match="class probabilities"):
        tdnn.cross_entropy(x, torch.rand(4, 6, device=DEVICE))
    with pytest.raises(ValueError, match="'weight' has 4 elements"):
        tdnn.cross_entropy(x, target, torch.ones(4, device=DEVICE))
    with pytest.raises(ValueError, match="'reduction'='avg'"):
        tdnn.cross_entropy(x, target, reduction="avg")
    with pytest.raises(ValueError, match="'label_smoothing'=1.5"):
        tdnn.cross_entropy(x, target, label_smoothing=1.5)
    with pytest.raises(TypeError, match="'ignore_index' must be an int"):
        tdnn.cross_entropy(x, target, ignore_index=1.0)
    with pytest.raises(ValueError, match="0 classes"):
        tdnn.cross_entropy(randn(3, 0), torch.zeros(3, dtype=torch.int64, device=DEVICE))
    with pytest.raises(TypeError, match="'input' has dtype torch.int64"):
        tdnn.cross_entropy(target, target)
    if DEVICE == "cpu":  # host targets are checked on the host, as PyTorch does
        with pytest.raises(IndexError, match="target 5 is out of bounds for 5 classes"):
            tdnn.cross_entropy(x, torch.tensor([0, 5, 1, 2]))


def test_library_ops_pass_opcheck():
    x, target = randn(6, 5), _targets((6,), 5)
    weight = torch.rand(5, device=DEVICE) + 0.5
    torch.library.opcheck(ce._forward.op, (x, target, weight, -100, True))
    _, stats = ce._forward(x, target, None, -100, False)
    torch.library.opcheck(ce._backward.op, (randn(1, 6), x, target, None, stats, -100))


def test_torch_compile_fullgraph():
    target = _targets((6,), 9)

    def f(x):
        return tdnn.cross_entropy(x, target, label_smoothing=0.1) * 2

    compiled = torch.compile(f, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    x = randn(6, 9, scale=2.0).requires_grad_(True)
    (dx,) = torch.autograd.grad(compiled(x), x)
    x64 = x.detach().double().requires_grad_(True)
    (dx_ref,) = torch.autograd.grad(F.cross_entropy(x64, target, label_smoothing=0.1) * 2, x64)
    assert_close(dx, dx_ref)


@pytest.mark.gpu_only("CUDA autocast")
def test_autocast_gives_fp32_loss_without_casting_the_logits():
    """Under CUDA autocast PyTorch returns cross entropy in fp32: the same dtype here, computed in
    fp32 from the bf16 logits (PyTorch's autocast result carries bf16's error, measured 1e-3 on
    these rows; ours is held to fp32's), with the gradient in bf16."""
    assert ON_GPU
    x = randn(64, 1000, dtype=torch.bfloat16, scale=3.0)
    target = _targets((64,), 1000)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ours, dx = grads(lambda t: tdnn.cross_entropy(t, target), x, torch.tensor(1.0, device=DEVICE))
        theirs = F.cross_entropy(x, target)
    assert ours.dtype == theirs.dtype == torch.float32 and dx.dtype == torch.bfloat16
    # PyTorch on the logits widened to fp32 (no autocast): fp32's error, and its gradient.
    fp32, dx_fp32 = grads(lambda t: F.cross_entropy(t.float(), target), x, torch.tensor(1.0, device=DEVICE))
    ref = ce.cross_entropy_reference(x.double(), target)
    assert_close(ours, ref, fp32, "autocast loss")
    torch.testing.assert_close(dx, dx_fp32.to(torch.bfloat16))
