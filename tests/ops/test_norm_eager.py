"""Batch norm's eager fast path: a call on plain tensors whose key was validated before skips the
argument checks and runs prepared plans. It must give what PyTorch gives call after call (fresh
data each time), the same bits as the general path, take a new key after a config change or for
another layout or dtype, and still refuse bad input."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from test_norm_layer import _compare, _grads

import tritondnn as tdnn
from helpers import DEVICE, assert_close, randn
from tritondnn.ops.norm import batch as B

ACT = {None: lambda y: y, "relu": F.relu, "silu": F.silu, "tanh": torch.tanh}
LAYOUTS = {"nchw": lambda t: t, "channels_last": lambda t: t.to(memory_format=torch.channels_last)}


@pytest.fixture
def counted(monkeypatch):
    """A fresh fast-path cache, and the calls that went through the checks or the general path's
    op: {"checks": n, "general": n}."""
    monkeypatch.setattr(B, "_eager", {})
    counts = {"checks": 0, "general": 0}
    check, forward = B._check_channels, B._forward

    def counting_check(*args, **kwargs):
        counts["checks"] += 1
        return check(*args, **kwargs)

    def counting_forward(*args):
        counts["general"] += 1
        return forward(*args)

    monkeypatch.setattr(B, "_check_channels", counting_check)
    monkeypatch.setattr(B, "_forward", counting_forward)
    return counts


def _x(shape=(3, 8, 5, 7), dtype=torch.float32, layout="nchw"):
    return LAYOUTS[layout](randn(*shape, dtype=dtype, scale=2.0) + 1.0)


def _wide(t):
    return None if t is None else t.double()


def _same(t, x):
    return None if t is None else t.to(x.dtype)


# (layout, dtype, training, activation, weight, bias, running statistics)
CASES = [
    ("channels_last", torch.bfloat16, True, "relu", True, True, True),
    ("nchw", torch.float32, True, None, True, True, True),
    ("nchw", torch.float16, True, None, False, False, False),
    ("channels_last", torch.float32, True, "silu", True, False, True),
    ("channels_last", torch.float32, False, None, True, True, True),
    ("nchw", torch.bfloat16, False, "relu", True, True, True),
]


@pytest.mark.parametrize(("layout", "dtype", "training", "activation", "has_w", "has_b", "stats"), CASES)
def test_repeated_calls_match_torch(layout, dtype, training, activation, has_w, has_b, stats, counted):
    """Three calls of one key, fresh data each: values and every gradient against float64 and
    PyTorch's error; only the first call is checked, none takes the general path's op."""
    for _ in range(3):
        x, dy = _x(dtype=dtype, layout=layout), LAYOUTS[layout](randn(3, 8, 5, 7, dtype=dtype))
        w, b = randn(8) if has_w else None, randn(8) if has_b else None
        rm, rv = (randn(8), torch.rand(8, device=DEVICE) + 0.5) if stats else (None, None)

        def ours(x, w, b, rm=rm, rv=rv):
            rm_, rv_ = (rm.clone(), rv.clone()) if stats else (None, None)
            return B.batch_norm(x, rm_, rv_, w, b, training, activation=activation)

        def theirs(x, w, b, rm=rm, rv=rv):
            rm_, rv_ = (rm.to(x.dtype, copy=True), rv.to(x.dtype, copy=True)) if stats else (None, None)
            return ACT[activation](F.batch_norm(x, rm_, rv_, _same(w, x), _same(b, x), training))

        _compare(ours, theirs, [x, w, b], [dy], f"{layout} {dtype} training={training}")
        assert ours(x, w, b).stride() == x.stride()
    assert counted == {"checks": 1, "general": 0}
    assert len(B._eager) == 1


@pytest.mark.parametrize(
    ("layout", "dtype", "training", "activation"),
    [
        ("channels_last", torch.bfloat16, True, "relu"),
        ("nchw", torch.float32, True, "tanh"),
        ("channels_last", torch.float32, False, None),
        ("nchw", torch.float16, False, "relu"),
    ],
)
def test_residual_repeated_calls_match_torch(layout, dtype, training, activation, counted):
    """BN-add-activation: act(batch_norm(x) + r) with the residual's gradient, three calls of one
    key on fresh data, all on the fast path after the first check."""
    for _ in range(3):
        x, dy = _x(dtype=dtype, layout=layout), LAYOUTS[layout](randn(3, 8, 5, 7, dtype=dtype))
        r = LAYOUTS[layout](randn(3, 8, 5, 7, dtype=dtype))
        w, b = randn(8), randn(8)
        rm, rv = randn(8), torch.rand(8, device=DEVICE) + 0.5

        def ours(x, w, b, r, rm=rm, rv=rv):
            return B.batch_norm(x, rm.clone(), rv.clone(), w, b, training, activation=activation, residual=r)

        def theirs(x, w, b, r, rm=rm, rv=rv):
            rm_, rv_ = rm.to(x.dtype, copy=True), rv.to(x.dtype, copy=True)
            return ACT[activation](F.batch_norm(x, rm_, rv_, _same(w, x), _same(b, x), training) + r)

        _compare(ours, theirs, [x, w, b, r], [dy], f"{layout} {dtype} training={training} {activation}")
    assert counted == {"checks": 1, "general": 0}


@pytest.mark.parametrize("momentum", [0.1, 0.5, 1])
def test_running_statistics_over_calls(momentum, counted):
    """The running statistics' in-place update on every call of a cached key, the momentum
    (not part of the key) taken from each call, an int one too."""
    rm, rv = randn(8), torch.rand(8, device=DEVICE) + 0.5
    rm_ref, rv_ref = rm.double(), rv.double()
    for step in range(3):
        x, w, b = _x(layout="channels_last"), randn(8), randn(8)
        m = momentum if step < 2 else 0.25
        y = B.batch_norm(x, rm, rv, w, b, True, m)
        ref = F.batch_norm(x.double(), rm_ref, rv_ref, w.double(), b.double(), True, m)
        assert_close(y, ref, F.batch_norm(x, None, None, w, b, True), f"step {step}")
        assert_close(rm, rm_ref, what=f"running_mean step {step}")
        assert_close(rv, rv_ref, what=f"running_var step {step}")
    assert counted["checks"] == 1 and counted["general"] == 0


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fast_path_gives_the_general_paths_bits(layout, training, residual, monkeypatch):
    """The packed workspace changes where the statistics live, not the arithmetic: outputs,
    running statistics and gradients (the residual's too) are bit for bit the general path's."""
    x, w, b, dy = _x(layout=layout), randn(8), randn(8), LAYOUTS[layout](randn(3, 8, 5, 7))
    r = LAYOUTS[layout](randn(3, 8, 5, 7)) if residual else None
    rm, rv = randn(8), torch.rand(8, device=DEVICE) + 0.5
    runs = []
    for general in (False, True):
        monkeypatch.setattr(B, "_eager", {})
        if general:
            monkeypatch.setattr(B, "_eager_program", lambda *args: None)
        stats = [rm.clone(), rv.clone()]
        out = _grads(
            lambda x, w, b, r, stats=stats: B.batch_norm(
                x, *stats, w, b, training, activation="relu", residual=r
            ),
            [x, w, b, r],
            [dy],
        )
        runs.append((*out[0], *out[1], *stats))
    assert all(torch.equal(a, c) for a, c in zip(*runs))


def test_config_change_layout_and_dtype_take_new_keys(counted):
    """A key names the config version, the strides and the dtypes: each change is checked once
    and planned afresh, and gives the right values."""
    w, b = randn(8), randn(8)

    def call_and_check(x):
        y = B.batch_norm(x, None, None, w, b, True)
        assert_close(y, F.batch_norm(x.double(), None, None, w.double(), b.double(), True),
                     F.batch_norm(x, None, None, _same(w, x), _same(b, x), True))  # fmt: skip

    call_and_check(_x())
    call_and_check(_x())
    assert counted["checks"] == 1
    with tdnn.config.flags(deterministic=not tdnn.config.deterministic):
        call_and_check(_x())
        call_and_check(_x())
    assert counted["checks"] == 2
    call_and_check(_x())  # the first version again: its key is still cached
    assert counted["checks"] == 2
    tdnn.config.invalidate_plans()
    call_and_check(_x())
    assert counted["checks"] == 3
    call_and_check(_x(layout="channels_last"))
    call_and_check(_x(dtype=torch.float16))
    call_and_check(_x(shape=(2, 8, 3, 3)))
    assert counted["checks"] == 6 and len(B._eager) == 6
    assert counted["general"] == 0


def test_backward_after_a_config_change(counted):
    """The backward plan is looked up again when the config changed since the forward pass."""
    x, w, b, dy = _x(), randn(8), randn(8), randn(3, 8, 5, 7)
    xs = [t.detach().requires_grad_(True) for t in (x, w, b)]
    y = B.batch_norm(*xs[:1], None, None, *xs[1:], True)
    with tdnn.config.flags(deterministic=not tdnn.config.deterministic):
        got = torch.autograd.grad(y, xs, dy)
    wide = [t.double().requires_grad_(True) for t in (x, w, b)]
    want = torch.autograd.grad(F.batch_norm(wide[0], None, None, *wide[1:], True), wide, dy.double())
    same = [t.detach().requires_grad_(True) for t in (x, w, b)]
    theirs = torch.autograd.grad(F.batch_norm(same[0], None, None, *same[1:], True), same, dy)
    for a, c, t in zip(got, want, theirs):
        assert_close(a, c, t)


class _Str(str):
    pass


# Bad calls made after a good call cached the key of its shapes: (call, error, match). Each
# differs from the cached call in something the key holds (shape, dtype, device, a None, eps's
# value or type, activation) or in the momentum, which the fast path checks on every call.
_GOOD = dict(shape=(2, 3, 4), eps=1, momentum=0.1, activation=None)


def _args(**change):
    x = randn(*change.pop("shape", _GOOD["shape"]))
    c = x.shape[1]
    args = {
        "running_mean": torch.zeros(c, device=DEVICE),
        "running_var": torch.ones(c, device=DEVICE),
        "weight": randn(c),
        "bias": randn(c),
        "training": True,
        "eps": _GOOD["eps"],
        "momentum": _GOOD["momentum"],
        "activation": _GOOD["activation"],
    }
    args.update(change)
    return x, args


BAD = [
    ({"weight": "randn(5)"}, ValueError, "'weight' has shape"),
    ({"weight": [1.0, 2.0, 3.0]}, TypeError, "'weight' must be a torch.Tensor"),
    ({"running_mean": "int64"}, TypeError, "'running_mean' has dtype torch.int64"),
    ({"running_var": None}, ValueError, "give both"),
    ({"bias": "meta"}, ValueError, "'bias' is on"),
    ({"eps": -1.0}, ValueError, "'eps'=-1.0"),
    ({"eps": True}, ValueError, "'eps'=True"),
    ({"eps": math.nan}, ValueError, "'eps'=nan"),
    ({"momentum": math.nan}, ValueError, "'momentum'=nan must be finite"),
    ({"momentum": math.inf}, ValueError, "'momentum'=inf must be finite"),
    ({"momentum": True}, TypeError, "'momentum' must be a real number"),
    ({"momentum": "0.1"}, TypeError, "'momentum' must be a real number"),
    ({"activation": "swish"}, ValueError, "'activation'='swish'"),
    ({"activation": _Str("relu")}, ValueError, "'activation'='relu'"),
    ({"shape": (1, 3)}, ValueError, "more than 1 value per channel"),
    ({"training": False, "running_mean": None, "running_var": None}, ValueError, "required when training"),
]


@pytest.mark.parametrize(("change", "error", "match"), BAD, ids=[m for _, _, m in BAD])
def test_bad_input_on_a_cached_key_still_raises(change, error, match, counted):
    x, good = _args()
    B.batch_norm(x, **good)
    B.batch_norm(x, **good)
    assert counted["checks"] == 1 and len(B._eager) == 1
    c = x.shape[1]
    special = {
        "randn(5)": randn(5),
        "int64": torch.zeros(c, dtype=torch.int64, device=DEVICE),
        "meta": torch.zeros(c, device="meta"),
    }
    change = {k: special.get(v, v) if type(v) is str else v for k, v in change.items()}
    x, bad = _args(**change)
    with pytest.raises(error, match=match):
        B.batch_norm(x, **bad)


@pytest.mark.parametrize("case", ["empty", "sliced", "interleaved"])
def test_inputs_the_fast_path_does_not_take(case, counted):
    """An empty batch and inputs that need a copy into a dense layout take the general path on
    every call, and are right."""
    x = {
        "empty": randn(0, 4, 3),
        "sliced": randn(3, 4, 5, 14)[..., ::2],
        "interleaved": randn(3, 5, 6, 4).permute(0, 2, 1, 3),  # channels between the spatial dims
    }[case]
    rm, rv = torch.zeros(x.shape[1], device=DEVICE), torch.ones(x.shape[1], device=DEVICE)
    for _ in range(2):
        y = B.batch_norm(x, rm, rv, training=False)
        assert_close(y, F.batch_norm(x.double(), rm.double(), rv.double()), F.batch_norm(x, rm, rv))
    assert counted["checks"] == 2 and counted["general"] == 2 and not B._eager


def test_functorch_transforms_take_the_general_path():
    keys = []

    def f(x):
        keys.append(B._eager_key(x, None, None, None, None, True, 1e-5, None, None))
        return x.sum()

    torch.func.grad(f)(randn(4, 3))
    assert keys == [None]
    assert B._eager_key(randn(4, 3), None, None, None, None, True, 1e-5, None, None) is not None


def test_strided_weight_and_bias(counted):
    """A weight and bias sliced from wider tensors (stride 2) are read as the values they hold,
    on every call, with gradients into the wide tensors; a strided running statistic is refused
    (its in-place update would land in a copy)."""
    for _ in range(2):
        x, dy = _x(layout="channels_last"), LAYOUTS["channels_last"](randn(3, 8, 5, 7))
        wide_w, wide_b = randn(16), randn(16)

        def ours(x, wide_w, wide_b):
            return B.batch_norm(x, None, None, wide_w[::2], wide_b[1::2], True, activation="relu")

        def theirs(x, wide_w, wide_b):
            # Dense copies: PyTorch's CPU channels_last backward misreads a strided weight (torch 2.13).
            w, b = (t.to(x.dtype).contiguous() for t in (wide_w[::2], wide_b[1::2]))
            return F.relu(F.batch_norm(x, None, None, w, b, True))

        _compare(ours, theirs, [x, wide_w, wide_b], [dy], "strided weight and bias")
    assert counted["general"] == 2 and not B._eager  # the checked path on each call
    with pytest.raises(ValueError, match="'running_mean' must be contiguous"):
        B.batch_norm(_x(), randn(16)[::2], torch.ones(8, device=DEVICE), training=True)
