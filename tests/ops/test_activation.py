"""Activations: values and gradients against float64 references, every layout and dtype, errors."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import tritondnn as tdnn
from helpers import DEVICE, DTYPES, LAYOUTS, ON_GPU, assert_close, grads, randn
from tritondnn.ops import activation as act

# name: (tritondnn, PyTorch). The PyTorch function is also the float64 reference.
CASES = {
    "relu": (tdnn.relu, F.relu),
    "relu slope+clip": (
        partial(tdnn.relu, negative_slope=0.1, clip=1.5),
        lambda x: torch.where(x > 0, torch.where(x >= 1.5, 1.5, x), 0.1 * x),  # gradient 0 at the clip
    ),
    "relu6": (partial(tdnn.relu, clip=6.0), F.relu6),
    "leaky_relu": (tdnn.leaky_relu, F.leaky_relu),
    "leaky_relu 0.2": (
        partial(tdnn.leaky_relu, negative_slope=0.2),
        partial(F.leaky_relu, negative_slope=0.2),
    ),
    "elu": (tdnn.elu, F.elu),
    "elu 0.5": (partial(tdnn.elu, alpha=0.5), partial(F.elu, alpha=0.5)),
    "sigmoid": (tdnn.sigmoid, torch.sigmoid),
    "tanh": (tdnn.tanh, torch.tanh),
    "gelu": (tdnn.gelu, F.gelu),
    "gelu tanh": (partial(tdnn.gelu, approximate="tanh"), partial(F.gelu, approximate="tanh")),
    "silu": (tdnn.silu, F.silu),
    "swish 1.7": (partial(tdnn.swish, beta=1.7), lambda x: x * torch.sigmoid(1.7 * x)),
    "softplus": (tdnn.softplus, F.softplus),
    "softplus beta2 thr5": (
        partial(tdnn.softplus, beta=2.0, threshold=5.0),
        partial(F.softplus, beta=2, threshold=5),
    ),
}
NAMES = list(CASES)


def _check(name: str, x: torch.Tensor, scale_dy: float = 1.0) -> None:
    ours, ref = CASES[name]
    dy = torch.randn(x.shape, device=x.device, dtype=x.dtype) * scale_dy
    y, dx = grads(ours, x, dy)
    y_torch, dx_torch = grads(ref, x, dy)
    y_ref, dx_ref = grads(ref, x.double(), dy.double())
    assert y.dtype == x.dtype and dx.dtype == x.dtype
    assert_close(y, y_ref, y_torch, f"{name} forward")
    assert_close(dx, dx_ref, dx_torch, f"{name} backward")


@pytest.mark.parametrize("shape", [(37, 129), (16, 256)], ids=["ragged", "whole-blocks"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", NAMES)
def test_values_and_gradients(name, dtype, shape, poison):
    _check(name, randn(*shape, dtype=dtype, scale=3.0))


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", ["relu slope+clip", "gelu", "silu", "tanh"])
def test_layouts(name, layout, poison):
    x = LAYOUTS[layout](randn(3, 5, 7, 11, scale=3.0))
    _check(name, x)
    ours, _ = CASES[name]
    y = ours(x)
    if layout in ("contiguous", "transposed", "channels_last"):
        assert y.stride() == x.stride(), "a dense input's layout is kept"


@pytest.mark.parametrize("name", ["relu", "gelu tanh", "elu", "sigmoid"])
def test_gradient_with_other_layout(name, poison):
    """The output gradient arrives in its own layout: expanded (from .sum()), transposed, channels_last."""
    ours, ref = CASES[name]
    x = randn(2, 3, 4, 5, scale=3.0).to(memory_format=torch.channels_last)
    for dy in (
        torch.ones((), device=DEVICE).expand(x.shape),
        randn(5, 4, 3, 2).permute(3, 2, 1, 0),
        randn(2, 3, 4, 5),
    ):
        _, dx = grads(ours, x, dy)
        _, dx_ref = grads(ref, x.double(), dy.double())
        assert_close(dx, dx_ref, what=name)


def test_many_dimensions_fall_back_to_a_copy(poison):
    """Six dimensions that cannot merge exceed the strided kernel: the copy engine serves them."""
    x = randn(4, 6, 4, 5, 4, 3, scale=2.0)[::2, ::2, ::2, ::2, ::2, ::2]
    reports = {r.name: r for r in tdnn.engines("activation", x)}
    assert not reports["dense"].supported and not reports["strided"].supported
    assert reports["contiguous-copy"].chosen
    assert "dimensions remain" in reports["strided"].reasons[0]
    _check("gelu", x)


@pytest.mark.parametrize("shape", [(), (0,), (1,), (5, 0, 3), (1, 1, 1)])
def test_degenerate_shapes(shape):
    x = randn(*shape)
    for name in ("silu", "relu"):
        _check(name, x)


@given(
    shape=st.lists(st.integers(1, 9), min_size=1, max_size=4),
    transpose=st.booleans(),
    name=st.sampled_from(NAMES),
)
def test_random_shapes(shape, transpose, name):
    x = randn(*shape, scale=3.0)
    if transpose and x.ndim > 1:
        x = x.transpose(0, -1)
    _check(name, x)


@pytest.mark.parametrize("name", NAMES)
def test_gradcheck_float64(name):
    ours, _ = CASES[name]
    x = randn(4, 6, dtype=torch.float64, scale=2.0).requires_grad_(True)
    assert torch.autograd.gradcheck(ours, (x,))


def test_extreme_values():
    x = torch.tensor([-1e4, -100.0, -20.0, -1e-6, 0.0, 1e-6, 20.0, 100.0, 1e4, math.inf, -math.inf, math.nan])
    x = x.to(DEVICE)
    for name in NAMES:
        ours, ref = CASES[name]
        assert_close(ours(x), ref(x.double()), ref(x), name)


def test_relative_accuracy_where_naive_formulas_lose_digits():
    """expm1 (elu near 0-), log1p (softplus far below 0), tanh near 0 and the normal CDF's lower tail
    (gelu far below 0) keep their relative accuracy."""
    for fn, ref, values in (
        (tdnn.tanh, torch.tanh, [1e-7, -3e-6, 2e-4, -1e-3, 0.29, -0.31]),
        (tdnn.elu, F.elu, [-1e-7, -3e-6, -2e-4, -1e-2]),
        (tdnn.softplus, F.softplus, [-30.0, -17.0, -5.0, 1e-4]),
        # x * Phi(x) in Phi's lower tail (F.gelu's float64 erf formula itself is 0 below -8.3)
        (
            tdnn.gelu,
            lambda x: x * 0.5 * torch.special.erfc(-x / math.sqrt(2)),
            [-9.0, -6.0, -4.0, -2.5, -1e-3, 1e-6],
        ),
    ):
        x = torch.tensor(values, device=DEVICE)
        got, want = fn(x).double(), ref(x.double())
        assert float(((got - want).abs() / want.abs()).max()) < 1e-5, fn  # naive: 1e-3 to 1


@pytest.mark.parametrize("name", ["relu", "leaky_relu", "elu", "silu"])
def test_inplace(name):
    fn = {"relu": tdnn.relu, "leaky_relu": tdnn.leaky_relu, "elu": tdnn.elu, "silu": tdnn.silu}[name]
    ref = {"relu": F.relu, "leaky_relu": F.leaky_relu, "elu": F.elu, "silu": F.silu}[name]
    x = randn(17, 33, scale=3.0)
    expected = ref(x.double())
    out = fn(x, inplace=True)
    assert out is x
    assert_close(x, expected)
    # Under autograd, on a non-leaf: the gradient matches PyTorch's in-place op.
    leaf = randn(17, 33, scale=3.0).requires_grad_(True)
    dy = randn(17, 33)
    (ours,) = torch.autograd.grad(fn(leaf * 1.0, inplace=True), leaf, dy)
    (theirs,) = torch.autograd.grad(ref(leaf.double() * 1.0, inplace=True), leaf, dy.double())
    assert_close(ours, theirs)


def test_inplace_on_a_leaf_requiring_grad_is_refused():
    with pytest.raises(RuntimeError, match="leaf"):
        tdnn.relu(randn(4).requires_grad_(True), inplace=True)


def test_activation_backward_direct():
    x, dy = randn(9, 10, scale=3.0), randn(9, 10)
    y = tdnn.sigmoid(x)
    dx = act.activation_backward(dy, y, "sigmoid", saved_is_output=True)
    assert_close(dx, act.activation_backward_reference(dy, x, act.Activation.SIGMOID))
    dx = act.activation_backward(dy, x, "softplus", p0=1.0, p1=20.0)
    assert_close(dx, act.activation_backward_reference(dy, x, act.Activation.SOFTPLUS, 1.0, 20.0))
    with pytest.raises(ValueError, match="cannot be computed from its output"):
        act.activation_backward(dy, y, "gelu", saved_is_output=True)
    with pytest.raises(ValueError, match="accepted"):
        act.activation_backward(dy, y, "swoosh")
    with pytest.raises(ValueError, match="must match"):
        act.activation_backward(dy[:, :3], y, "tanh", saved_is_output=True)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (
            lambda: tdnn.relu(torch.arange(4, device=DEVICE)),
            TypeError,
            "dtype torch.int64; accepted: float16",
        ),
        (lambda: tdnn.gelu([1.0, 2.0]), TypeError, "must be a torch.Tensor, got list"),
        (lambda: tdnn.gelu(torch.empty(3, device="meta")), ValueError, "is on device 'meta'"),
        (
            lambda: tdnn.gelu(randn(3), approximate="fast"),
            ValueError,
            "approximate.*accepted: 'none', 'tanh'",
        ),
        (lambda: tdnn.relu(randn(3), clip=0.0), ValueError, "'clip'=0.0 must be > 0"),
        (
            lambda: tdnn.relu(randn(3), negative_slope="a"),
            TypeError,
            "'negative_slope' must be a real number",
        ),
        (lambda: tdnn.elu(randn(3), alpha=math.nan), ValueError, "'alpha'=nan must be finite"),
        (lambda: tdnn.softplus(randn(3), beta=0), ValueError, "'beta' must be non-zero"),
    ],
)
def test_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.skipif(ON_GPU, reason="a CPU tensor is the wrong device only on the GPU backend")
def test_wrong_device_message_names_backend():
    with pytest.raises(ValueError, match="'interpret' backend runs on cpu tensors"):
        tdnn.relu(torch.empty(3, device="meta"))


def test_engines_report_dense_and_strided():
    x = randn(8, 16)
    dense = {r.name: r for r in tdnn.engines("activation", x)}
    assert dense["dense"].chosen and dense["dense"].cost == 1.0
    strided = {r.name: r for r in tdnn.engines("activation", x[:, ::2])}
    assert not strided["dense"].supported and strided["strided"].chosen
    assert "dense layout" in strided["dense"].reasons[0]


def test_benchmark_mode_times_and_caches(cache_dir):
    x = randn(33, 65, scale=2.0)
    with tdnn.config.flags(benchmark=True):
        y = tdnn.gelu(x)
    assert_close(y, F.gelu(x.double()), F.gelu(x))
    files = list(cache_dir.glob("autotune-*.json"))
    assert len(files) == 1 and "ActivationProblem" in files[0].read_text()


def test_library_ops_pass_opcheck():
    x = randn(5, 7)
    torch.library.opcheck(act._forward.op, (x, int(act.Activation.GELU), 0.0, 0.0))
    torch.library.opcheck(act._backward.op, (randn(5, 7), x, int(act.Activation.SILU), 1.0, 0.0, False))


def test_torch_compile_fullgraph():
    def f(x):
        return tdnn.gelu(tdnn.silu(x) * 2.0).sum()

    compiled = torch.compile(f, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    x = randn(6, 10, scale=2.0).requires_grad_(True)
    loss = compiled(x)
    (dx,) = torch.autograd.grad(loss, x)
    x64 = x.detach().double().requires_grad_(True)
    loss_ref = F.gelu(F.silu(x64) * 2.0).sum()
    (dx_ref,) = torch.autograd.grad(loss_ref, x64)
    assert_close(loss.detach().reshape(1), loss_ref.detach().reshape(1))
    assert_close(dx, dx_ref)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_large(dtype):
    _check("gelu", randn(4096, 4097, dtype=dtype, scale=3.0))


# ---------------------------------------------------------------------------------------------
# The eager fast path: a call whose key (kind, parameters, in place, autograd, type, shape,
# strides, dtype, config version) was checked before skips the check and runs a prepared plan.


@pytest.fixture
def counted(monkeypatch):
    """A fresh fast-path cache, and how many calls went through the argument check."""
    monkeypatch.setattr(act, "_eager", {})
    counts = {"checks": 0}
    check = act.check_tensor

    def counting(*args, **kwargs):
        counts["checks"] += 1
        return check(*args, **kwargs)

    monkeypatch.setattr(act, "check_tensor", counting)
    return counts


INPLACE = {
    "relu": (tdnn.relu, F.relu),
    "leaky_relu": (tdnn.leaky_relu, F.leaky_relu),  # saves the output: x > 0 read from y
    "leaky_relu -0.2": (
        partial(tdnn.leaky_relu, negative_slope=-0.2),
        partial(F.leaky_relu, negative_slope=-0.2),
    ),
    "silu": (tdnn.silu, F.silu),  # saves a copy of the input
    "elu": (tdnn.elu, F.elu),
}


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("name", list(INPLACE))
def test_repeated_calls_match_torch(name, inplace, grad, counted):
    """Three calls of one key on fresh data, channels_last: values (in place: into the input)
    and gradients against float64 and PyTorch; only the first call is checked."""
    fn, ref = INPLACE[name]
    for _ in range(3):
        x = randn(2, 6, 5, 3, scale=3.0).to(memory_format=torch.channels_last)
        want = ref(x.double())
        if not grad:
            inp = x.clone()
            out = fn(inp, inplace=inplace)
            assert (out is inp) == inplace and out.stride() == x.stride()
            assert_close(out, want, ref(x))
            continue
        dy = randn(2, 6, 5, 3)
        leaf = x.detach().requires_grad_(True)
        inp = leaf * 1.0  # a non-leaf: an in-place op on it is recorded
        out = fn(inp, inplace=inplace)
        assert (out is inp) == inplace
        (dx,) = torch.autograd.grad(out, leaf, dy)
        same = x.detach().requires_grad_(True)
        (dsame,) = torch.autograd.grad(ref(same), same, dy)  # (in place with a negative slope: refused)
        wide = x.double().requires_grad_(True)
        (dwide,) = torch.autograd.grad(ref(wide), wide, dy.double())
        assert_close(out.detach(), want, ref(x))
        assert_close(dx, dwide, dsame)
    assert counted["checks"] == 1 and len(act._eager) == 1


def test_gradients_of_other_layouts_on_one_key(counted):
    """The backward plan follows the incoming gradient's strides, call by call."""
    for dy_layout in ("contiguous", "transposed", "contiguous", "sliced"):
        x = randn(7, 9, scale=3.0).requires_grad_(True)
        dy = LAYOUTS[dy_layout](randn(7, 9))
        (dx,) = torch.autograd.grad(tdnn.gelu(x), x, dy)
        x64 = x.detach().double().requires_grad_(True)
        (dref,) = torch.autograd.grad(F.gelu(x64), x64, dy.double())
        assert_close(dx, dref, torch.autograd.grad(F.gelu(x), x, dy)[0], dy_layout)
    assert counted["checks"] == 1


def test_config_layout_and_dtype_take_new_keys(counted):
    def call_and_check(x):
        assert_close(tdnn.relu(x), F.relu(x.double()), F.relu(x))

    call_and_check(randn(5, 8))
    call_and_check(randn(5, 8))
    assert counted["checks"] == 1
    with tdnn.config.flags(deterministic=not tdnn.config.deterministic):
        call_and_check(randn(5, 8))
    tdnn.config.invalidate_plans()
    call_and_check(randn(5, 8))
    call_and_check(randn(8, 5).t())
    call_and_check(randn(5, 8, dtype=torch.float16))
    call_and_check(randn(5, 8).requires_grad_(True))
    assert counted["checks"] == 6 and len(act._eager) == 6


def test_bad_input_on_a_cached_key_still_raises(counted):
    """What the check looks at is in the key: a call the check would refuse never matches a
    cached key. An in-place call on a leaf that requires grad is refused by autograd, cached
    key or not."""
    tdnn.relu(randn(4, 3), inplace=True)
    tdnn.relu(randn(4, 3).requires_grad_(True) * 1.0, inplace=True)
    assert counted["checks"] == 2
    with pytest.raises(TypeError, match="dtype torch.int64"):
        tdnn.relu(torch.arange(12, device=DEVICE).reshape(4, 3), inplace=True)
    with pytest.raises(ValueError, match="is on device 'meta'"):
        tdnn.relu(torch.empty(4, 3, device="meta"), inplace=True)
    with pytest.raises(RuntimeError, match="leaf"):
        tdnn.relu(randn(4, 3).requires_grad_(True), inplace=True)
    with pytest.raises(RuntimeError, match="leaf"):
        tdnn.relu(randn(4, 3).requires_grad_(True), inplace=True)
    # A parameter in place without grad: its own key, the op's copy path, the same values.
    p = torch.nn.Parameter(randn(4, 3), requires_grad=False)
    want = F.relu(p.detach().double())
    assert tdnn.relu(p, inplace=True) is p
    assert_close(p.detach(), want)
