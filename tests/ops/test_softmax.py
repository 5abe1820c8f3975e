"""Softmax and log-softmax: every dim, layout and dtype, long rows, extremes, autograd, errors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import tritondnn as tdnn
from helpers import DEVICE, DTYPES, LAYOUTS, ON_GPU, assert_close, grads, randn
from tritondnn.ops import softmax as sm


def _ours(log: bool):
    return tdnn.log_softmax if log else tdnn.softmax


def _torch(log: bool):
    return torch.log_softmax if log else torch.softmax


def _check(x: torch.Tensor, dim: int, log: bool, dtype: torch.dtype | None = None) -> None:
    ours = lambda t: _ours(log)(t, dim, dtype=dtype)
    ref = lambda t: _torch(log)(t, dim, dtype=dtype)
    out_dtype = dtype or x.dtype
    dy = torch.randn(x.shape, device=x.device, dtype=out_dtype)
    y, dx = grads(ours, x, dy)
    y_torch, dx_torch = grads(ref, x, dy)
    y_ref, dx_ref = grads(lambda t: _torch(log)(t, dim), x.double(), dy.double())
    assert y.dtype == out_dtype and dx.dtype == x.dtype
    assert_close(y, y_ref, y_torch, f"forward dim={dim} log={log}")
    assert_close(dx, dx_ref, dx_torch, f"backward dim={dim} log={log}")


@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_values_and_gradients(dim, dtype, log, poison):
    _check(randn(3, 37, 65, dtype=dtype, scale=4.0), dim, log)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dim", [1, 3])
def test_layouts(layout, dim, poison):
    x = LAYOUTS[layout](randn(2, 6, 5, 7, scale=3.0))
    _check(x, dim, log=False)
    _check(x, dim, log=True)
    if layout != "sliced":
        assert tdnn.softmax(x, dim).stride() == x.stride(), "a dense input's layout is kept"


@pytest.mark.parametrize("log", [False, True])
def test_rows_longer_than_one_block(log, poison):
    """Rows beyond the one-block engine's limit go to the two-pass engine."""
    x = randn(2, sm.MAX_ONE_BLOCK + 1, scale=5.0)
    assert {r.name: r for r in tdnn.engines("softmax", x, dim=1)}["two-pass"].chosen
    _check(x, 1, log)


@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("n", [300, 1001])
def test_two_pass_along_either_axis(n, log, poison, monkeypatch):
    """The same, with the limit lowered so long rows stay cheap under the interpreter."""
    monkeypatch.setattr(sm, "MAX_ONE_BLOCK", 256)
    monkeypatch.setattr(sm, "_plans", {})
    monkeypatch.setattr(sm.FAMILY, "_chosen", {})
    x = randn(3, n, scale=5.0)
    assert {r.name: r for r in tdnn.engines("softmax", x, dim=1)}["two-pass"].chosen
    _check(x, 1, log)
    _check(randn(n, 3, scale=5.0), 0, log)


def test_two_pass_engine_on_short_rows(cache_dir, poison):
    """Benchmark mode may pick either engine: both must be right on every problem they accept."""
    x = randn(6, 300, scale=4.0)
    problem = sm.FAMILY.describe(x, dim=1)
    for engine in sm.FAMILY.engines:
        if engine.not_supported_reasons(problem):
            continue
        for config in engine.configs(problem):
            y = torch.empty_like(x)
            engine.launch(problem, config, x, y)
            assert_close(y, torch.softmax(x.double(), 1), torch.softmax(x, 1), f"{engine.name} {config}")


def test_rows_that_do_not_merge_into_two_dims(poison):
    x = randn(4, 5, 6, 7, 8)[::2, :, ::2, :, ::2].permute(0, 2, 1, 3, 4)
    reports = {r.name: r for r in tdnn.engines("softmax", x, dim=2)}
    assert reports["contiguous-copy"].chosen and not reports["one-block"].supported
    _check(x, 2, log=False)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_large_logits_are_safe(dtype):
    """+-1e4 logits (the fp16 range) must not overflow: the maximum is subtracted first."""
    x = (torch.rand(8, 50, device=DEVICE) * 2e4 - 1e4).to(dtype)  # log_softmax stays within fp16 range
    _check(x, -1, log=False)
    _check(x, -1, log=True)


def test_large_offset():
    x = randn(4, 33, scale=1.0) + 1e4
    _check(x, 1, log=False)


def test_infinities_as_pytorch():
    x = torch.tensor(
        [
            [-math.inf, -math.inf, -math.inf],
            [0.0, -math.inf, 1.0],
            [math.inf, 0.0, 1.0],
            [math.nan, 0.0, 1.0],
        ],
        device=DEVICE,
    )
    for log in (False, True):
        assert_close(_ours(log)(x, 1), _torch(log)(x.double(), 1), _torch(log)(x, 1), f"log={log}")


@pytest.mark.parametrize(
    ("dtype_in", "dtype_out"),
    [(torch.float16, torch.float32), (torch.bfloat16, torch.float64), (torch.float32, torch.float16)],
    ids=str,
)
def test_dtype_argument(dtype_in, dtype_out, poison):
    _check(randn(5, 40, dtype=dtype_in, scale=3.0), -1, log=False, dtype=dtype_out)
    _check(randn(5, 40, dtype=dtype_in, scale=3.0), 0, log=True, dtype=dtype_out)


@pytest.mark.parametrize("shape", [(), (1,), (0, 4), (4, 0), (3, 1, 5)])
def test_degenerate_shapes(shape):
    x = randn(*shape)
    for dim in range(-max(x.ndim, 1), max(x.ndim, 1)):
        for log in (False, True):
            y = _ours(log)(x, dim)
            assert y.shape == x.shape
            assert_close(y, _torch(log)(x.double(), dim))


@given(
    shape=st.lists(st.integers(1, 12), min_size=1, max_size=4),
    data=st.data(),
    log=st.booleans(),
)
def test_random_shapes(shape, data, log):
    x = randn(*shape, scale=3.0)
    if data.draw(st.booleans(), label="transpose") and x.ndim > 1:
        x = x.transpose(0, -1)
    dim = data.draw(st.integers(-x.ndim, x.ndim - 1), label="dim")
    _check(x, dim, log)


@pytest.mark.parametrize("log", [False, True])
def test_gradcheck_float64(log):
    x = randn(5, 9, dtype=torch.float64).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: _ours(log)(t, 1), (x,))
    assert torch.autograd.gradcheck(lambda t: _ours(log)(t, 0), (x,))


def test_implicit_dim_warns_like_pytorch():
    x = randn(2, 3, 4)
    with pytest.warns(UserWarning, match="Implicit dimension choice"):
        y = tdnn.softmax(x)
    assert_close(y, torch.softmax(x.double(), 0))


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (
            lambda: tdnn.softmax(torch.ones(3, dtype=torch.int32, device=DEVICE), 0),
            TypeError,
            "dtype torch.int32",
        ),
        (lambda: tdnn.softmax(randn(3, 4), 2), ValueError, "'dim'=2 is out of range"),
        (lambda: tdnn.softmax(randn(3, 4), 1.0), TypeError, "'dim' must be an int"),
        (lambda: tdnn.log_softmax(randn(3), 0, dtype=torch.int64), TypeError, "'dtype'=torch.int64"),
        (lambda: tdnn.softmax("x", 0), TypeError, "must be a torch.Tensor"),
        (lambda: tdnn.softmax(torch.ones(3, device="meta"), 0), ValueError, "device 'meta'"),
    ],
)
def test_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_benchmark_mode_times_and_caches(cache_dir):
    x = randn(9, 70, scale=2.0)
    with tdnn.config.flags(benchmark=True):
        y = tdnn.softmax(x, 1)
    assert_close(y, torch.softmax(x.double(), 1), torch.softmax(x, 1))
    assert "SoftmaxProblem" in next(cache_dir.glob("autotune-*.json")).read_text()


def test_library_ops_pass_opcheck():
    x = randn(4, 6)
    torch.library.opcheck(sm._forward.op, (x, 1, False, torch.float32))
    torch.library.opcheck(sm._backward.op, (randn(4, 6), torch.softmax(x, 0), 0, True, torch.float32))


def test_torch_compile_fullgraph():
    def f(x):
        return (tdnn.log_softmax(x, -1) * tdnn.softmax(x, 0)).sum()

    compiled = torch.compile(f, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    x = randn(5, 8, scale=2.0).requires_grad_(True)
    (dx,) = torch.autograd.grad(compiled(x), x)
    x64 = x.detach().double().requires_grad_(True)
    (dx_ref,) = torch.autograd.grad((torch.log_softmax(x64, -1) * torch.softmax(x64, 0)).sum(), x64)
    assert_close(dx, dx_ref)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape_dim", [((4096, 4096), -1), ((2, 32768), -1), ((16, 256, 28, 28), 1)])
def test_large(shape_dim, dtype):
    shape, dim = shape_dim
    _check(randn(*shape, dtype=dtype, scale=3.0), dim, log=False)
