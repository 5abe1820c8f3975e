"""The convolutions' eager fast path: a call on plain tensors whose key was validated before skips
the argument checks and runs the plans bound for it. It must give what PyTorch gives call after
call (fresh data each time), the general path's bits, take a new key after a config change or for
another layout, dtype or geometry, and still refuse bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_norm_layer import _compare, _grads

import tritondnn as tdnn
from helpers import randn
from tritondnn.ops import conv
from tritondnn.ops.conv import eager

FNS = {1: (conv.conv1d, F.conv1d), 2: (conv.conv2d, F.conv2d), 3: (conv.conv3d, F.conv3d)}
LAST = {3: torch.channels_last, 4: torch.channels_last, 5: torch.channels_last_3d}


def _count_checks(monkeypatch, cache: str, check: str) -> dict[str, int]:
    """A fresh ``eager.<cache>``, and the number of calls that go through ``conv.<check>``."""
    monkeypatch.setattr(eager, cache, {})
    counts = {"checks": 0}
    original = getattr(conv, check)

    def counting(*args):
        counts["checks"] += 1
        return original(*args)

    monkeypatch.setattr(conv, check, counting)
    return counts


@pytest.fixture
def counted(monkeypatch):
    """A fresh fast-path cache, and the number of calls that went through the checks."""
    return _count_checks(monkeypatch, "programs", "_parse")


def _torch_conv(nd, x, w, b, stride, padding, dilation, groups):
    """``F.conv{nd}d``, with (pre, post) padding pairs applied by ``F.pad`` (PyTorch has no such
    argument)."""
    if type(padding) is tuple and type(padding[0]) is tuple:
        x = F.pad(x, [v for pair in reversed(padding) for v in pair])
        padding = 0
    return FNS[nd][1](x, w, b, stride, padding, dilation, groups)


def _layout(t: torch.Tensor, last: bool) -> torch.Tensor:
    if not last:
        return t
    if t.dim() == 3:  # NLC: no memory format names it
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    return t.contiguous(memory_format=LAST[t.dim()])


# (x shape, cout, kernel, stride, padding, dilation, groups, bias, channels-last)
CASES = [
    ((2, 4, 9, 8), 6, (3, 3), 1, 1, 1, 1, False, True),  # a ResNet 3x3
    ((2, 3, 11, 10), 8, (7, 7), 2, 3, 1, 1, False, True),  # a stem
    ((2, 6, 9, 8), 6, (3, 3), (2, 1), ((1, 0), (1, 1)), (1, 2), 2, True, False),
    ((3, 4, 13), 8, (5,), 2, "valid", 1, 1, True, True),
    ((1, 4, 5, 6, 7), 4, (3, 1, 3), 1, "same", 1, 4, True, False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{len(c[0]) - 2}d-k{c[2]}-g{c[6]}-last{c[8]}")
def test_repeated_calls_match_torch(case, counted):
    """Three calls of one key, fresh data each: the output and every gradient against float64
    and PyTorch's error; only the first call is checked."""
    shape, cout, kernel, stride, padding, dilation, groups, has_bias, last = case
    nd = len(shape) - 2
    for _ in range(3):
        x = _layout(randn(*shape), last)
        w = randn(cout, shape[1] // groups, *kernel, scale=0.3)
        b = randn(cout) if has_bias else None
        y = _torch_conv(nd, x, w, b, stride, padding, dilation, groups)
        dy = _layout(randn(*y.shape), last)

        def ours(x, w, b=None):
            return FNS[nd][0](x, w, b, stride, padding, dilation, groups)

        def theirs(x, w, b=None):
            return _torch_conv(nd, x, w, b, stride, padding, dilation, groups)

        _compare(ours, theirs, [x, w, b], [dy], f"{case}")
        assert ours(x, w, b).stride() == _layout(y.contiguous(), last).stride()  # the input's layout
    assert counted["checks"] == 1 and len(eager.programs) == 1


@pytest.mark.parametrize("k", [1, 3])
def test_gradients_of_some_inputs_and_no_grad(k, counted):
    """Only the weight wanting a gradient, then only the input, then no autograd at all: one key,
    the right values each time, the weight's gradient in the weight's (channels-last) strides
    (for a 1x1 kernel a view of the contiguous result: the same element order)."""
    x, w = _layout(randn(2, 4, 6, 6), True), _layout(randn(5, 4, k, k, scale=0.3), True)
    dy = _layout(randn(2, 5, 6, 6), True)
    for wants in ("weight", "input", "none"):
        xi, wi = x.clone().requires_grad_(wants == "input"), w.clone().requires_grad_(wants == "weight")
        y = conv.conv2d(xi, wi, None, 1, k // 2)
        wide = [v.detach().double().requires_grad_(v.requires_grad) for v in (xi, wi)]
        ref = F.conv2d(*wide, None, 1, k // 2)
        torch.testing.assert_close(y.double(), ref.detach(), atol=1e-4, rtol=1e-4)
        if wants == "none":
            assert y.grad_fn is None
            continue
        leaf = xi if wants == "input" else wi
        (got,) = torch.autograd.grad(y, [leaf], dy)
        (expected,) = torch.autograd.grad(ref, [v for v in wide if v.requires_grad], dy.double())
        torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-4)
        assert got.stride() == leaf.stride()
    assert counted["checks"] == 1


@pytest.mark.parametrize("last", [False, True], ids=["contiguous", "channels_last"])
def test_fast_path_gives_the_general_paths_bits(last, monkeypatch):
    """The fast path binds the general path's plans: output and gradients bit for bit."""
    x, w, b = _layout(randn(2, 4, 7, 6), last), randn(6, 2, 3, 3), randn(6)
    dy = _layout(randn(2, 6, 4, 6), last)
    runs = []
    for general in (False, True):
        monkeypatch.setattr(eager, "programs", {})
        if general:
            monkeypatch.setattr(eager, "eager_program", lambda *args: None)
        fn = lambda x, w, b: conv.conv2d(x, w, b, (2, 1), 1, 1, 2)
        fn(x, w, b)  # the first call of the key
        out, grads = _grads(fn, [x, w, b], [dy])
        runs.append((*out, *grads))
    assert all(torch.equal(a, c) for a, c in zip(*runs))


def test_config_change_layout_dtype_and_geometry_take_new_keys(counted):
    """A key names the config version, the strides, the dtypes and the geometry: each change is
    checked once and planned afresh, and gives the right values."""
    w = randn(4, 3, 3, 3, scale=0.3)

    def call_and_check(x, w=w, stride=1, padding=1):
        y = conv.conv2d(x, w, None, stride, padding)
        wide = F.conv2d(x.double(), w.double(), None, stride, padding)
        torch.testing.assert_close(y.double(), wide, atol=1e-2, rtol=1e-2)

    x = randn(2, 3, 6, 5)
    call_and_check(x)
    call_and_check(x)
    assert counted["checks"] == 1
    call_and_check(_layout(x, True))
    call_and_check(x, stride=2)
    call_and_check(x, stride=(2, 2))  # the same geometry, another key
    call_and_check(x, padding=(1, 1))
    assert counted["checks"] == 5
    call_and_check(x.half(), w.half())
    assert counted["checks"] == 6
    with tdnn.config.flags(allow_tf32=not tdnn.config.allow_tf32):
        call_and_check(x)
    assert counted["checks"] == 7 and len(eager.programs) == 7


BAD = [
    # values equal to the cached key's (1.0 == True == 1) but of types the checks refuse
    ({"stride": 1.0}, TypeError, "'stride' must be an int or a tuple of 2 ints, got 1.0"),
    ({"stride": True}, TypeError, "'stride' must be an int or a tuple of 2 ints, got True"),
    ({"stride": (True, 1)}, ValueError, r"'stride'=\(True, 1\)"),
    ({"padding": 1.0}, TypeError, "'padding' must be an int or a tuple of 2 ints, got 1.0"),
    ({"dilation": (1, 1.0)}, ValueError, r"'dilation'=\(1, 1.0\)"),
    ({"groups": True}, TypeError, "'groups' must be an int"),
    ({"padding": "full"}, ValueError, "'padding'='full'"),
    ({"padding": "same", "stride": 2}, ValueError, "padding='same' is not supported"),
    ({"dilation": 0}, ValueError, "'dilation'=0 must be >= 1"),
    ({"groups": 2}, ValueError, "groups=2 must divide"),
    ({"groups": 1.0}, TypeError, "'groups' must be an int"),
    ({"weight": "half"}, TypeError, "'weight' has dtype torch.float16"),
    ({"weight": "wide"}, ValueError, "expects 4 input channels"),
    ({"bias": "long"}, ValueError, "'bias' has shape"),
    ({"bias": "half"}, TypeError, "'bias' has dtype torch.float16"),
    ({"input": "tiny"}, ValueError, "larger than the padded input"),
]


@pytest.mark.parametrize(("change", "error", "match"), BAD, ids=[m for _, _, m in BAD])
def test_bad_input_on_a_cached_key_still_raises(change, error, match, counted):
    good = {"input": randn(2, 3, 6, 6), "weight": randn(4, 3, 3, 3), "bias": randn(4),
            "stride": 1, "padding": 1, "dilation": 1, "groups": 1}  # fmt: skip
    conv.conv2d(**good)
    conv.conv2d(**good)
    assert counted["checks"] == 1 and len(eager.programs) == 1
    special = {
        ("weight", "half"): good["weight"].half(),
        ("weight", "wide"): randn(4, 4, 3, 3),
        ("bias", "long"): randn(5),
        ("bias", "half"): good["bias"].half(),
        ("input", "tiny"): randn(2, 3, 1, 6),
    }
    bad = dict(good)
    bad.update({k: special.get((k, v), v) if type(v) is str else v for k, v in change.items()})
    if change.get("input") == "tiny":
        bad["padding"] = 0
    with pytest.raises(error, match=match):
        conv.conv2d(**bad)


@pytest.mark.parametrize("case", ["unbatched", "epilogue", "algo", "strided bias", "empty"])
def test_calls_the_fast_path_does_not_take(case, counted):
    """Unbatched inputs, epilogues, forced engines, strided biases and empty batches take the
    checked path on every call, and are right."""
    x, w, b = randn(2, 3, 6, 6), randn(4, 3, 3, 3, scale=0.3), randn(4)
    kwargs = {}
    if case == "unbatched":
        x = x[0]
    elif case == "epilogue":
        kwargs["epilogue"] = tdnn.Epilogue(activation="relu")
    elif case == "algo":
        kwargs["algo"] = "implicit_gemm"
    elif case == "strided bias":
        b = randn(8)[::2]
    elif case == "empty":
        x = randn(0, 3, 6, 6)
    for _ in range(2):
        y = conv.conv2d(x, w, b, 1, 1, **kwargs)
        ref = F.conv2d(x.double(), w.double(), b.double(), 1, 1)
        ref = F.relu(ref) if case == "epilogue" else ref
        torch.testing.assert_close(y.double(), ref, atol=1e-4, rtol=1e-4)
    assert counted["checks"] == 2 and not eager.programs


def test_functorch_transforms_take_the_general_path():
    keys = []
    w = randn(4, 3, 3, 3)

    def f(x):
        keys.append(eager.eager_key(2, x, w, None, 1, 1, 1, 1))
        return x.sum()

    torch.func.grad(f)(randn(2, 3, 5, 5))
    assert keys == [None]
    assert eager.eager_key(2, randn(2, 3, 5, 5), w, None, 1, 1, 1, 1) is not None


@pytest.fixture
def counted_gradients(monkeypatch):
    """A fresh cache of standalone gradient calls, and the number of calls through the checks."""
    return _count_checks(monkeypatch, "gradient_programs", "check_tensor_pair")


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{len(c[0]) - 2}d-k{c[2]}-g{c[6]}-last{c[8]}")
def test_repeated_gradient_calls_match_torch(case, counted_gradients):
    """``conv_backward_data`` and ``conv_backward_weight`` three times with one key each, fresh
    data each time: both against float64 autograd of PyTorch's convolution; only each function's
    first call is checked."""
    shape, cout, kernel, stride, padding, dilation, groups, _, last = case
    nd = len(shape) - 2
    for _ in range(3):
        x = _layout(randn(*shape), last)
        w = randn(cout, shape[1] // groups, *kernel, scale=0.3)
        y = _torch_conv(nd, x, w, None, stride, padding, dilation, groups)
        dy = _layout(randn(*y.shape), last)
        x64, w64 = x.double().requires_grad_(True), w.double().requires_grad_(True)
        y64 = _torch_conv(nd, x64, w64, None, stride, padding, dilation, groups)
        rx, rw = torch.autograd.grad(y64, (x64, w64), dy.double())
        dx = conv.conv_backward_data(dy, w, x.shape, stride, padding, dilation, groups)
        dw = conv.conv_backward_weight(x, dy, w.shape, stride, padding, dilation, groups)
        torch.testing.assert_close(dx.double(), rx, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(dw.double(), rw, atol=1e-4, rtol=1e-4)
    assert counted_gradients["checks"] == 2 and len(eager.gradient_programs) == 2


def test_gradient_calls_take_new_keys_and_still_refuse_bad_input(counted_gradients):
    """Another layout, geometry or forced engine is checked and planned afresh; a call that wants
    autograd takes the general path (no key); bad input on a cached key still raises."""
    x, w = randn(2, 3, 6, 5), randn(4, 3, 3, 3)
    dy = randn(2, 4, 6, 5)
    for _ in range(2):
        conv.conv_backward_data(dy, w, x.shape, 1, 1)
    assert counted_gradients["checks"] == 1
    conv.conv_backward_data(_layout(dy, True), w, x.shape, 1, 1)
    conv.conv_backward_data(dy, w, x.shape, (1, 1), 1)
    conv.conv_backward_data(dy, w, x.shape, 1, 1, algo="implicit_gemm")
    conv.conv_backward_data(dy, w.requires_grad_(True), x.shape, 1, 1)
    assert counted_gradients["checks"] == 5 and len(eager.gradient_programs) == 4
    with pytest.raises(ValueError, match="'grad_output' has shape"):
        conv.conv_backward_data(dy, w.detach(), (2, 3, 7, 5), 1, 1)
    with pytest.raises(TypeError, match="'stride' must be an int"):
        conv.conv_backward_weight(x, dy, w.shape, 1.0, 1)
    with pytest.raises(TypeError, match="'grad_output' has dtype"):
        conv.conv_backward_weight(x, dy.half(), w.shape, 1, 1)
