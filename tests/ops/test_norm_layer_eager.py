"""Layer and RMS norm's eager fast path: a call on plain tensors whose key was validated before
skips the argument checks and runs prepared plans, forward and backward. It must give what
PyTorch gives call after call (fresh data each time), the same bits as the general path, take a
new key after a config change or for another shape, stride or dtype, and still refuse bad input."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from test_autograd_outputs import _OpCounter
from test_norm_layer import _compare, _grads

import tritondnn as tdnn
from helpers import DEVICE, assert_close, randn
from tritondnn.ops.norm import layer as L

ACT = {None: lambda y: y, "relu": F.relu, "silu": F.silu}


@pytest.fixture
def counted(monkeypatch):
    """A fresh fast-path cache, and the calls that went through the checks or the general path's
    ops: {"checks": n, "general": n}."""
    monkeypatch.setattr(L, "_eager", {})
    counts = {"checks": 0, "general": 0}
    check, forward, backward = L.check_eps, L._forward, L._backward

    def counting_check(*args):
        counts["checks"] += 1
        return check(*args)

    def counting(fn):
        def run(*args):
            counts["general"] += 1
            return fn(*args)

        return run

    monkeypatch.setattr(L, "check_eps", counting_check)
    monkeypatch.setattr(L, "_forward", counting(forward))
    monkeypatch.setattr(L, "_backward", counting(backward))
    return counts


def _ours(op, shape, activation=None):
    """The call under test as a function of (x, weight, bias, residual)."""
    if op == "layer_norm":
        return lambda x, w, b, r: L.layer_norm(x, shape, w, b, activation=activation)
    if op == "rms_norm":
        return lambda x, w, b, r: L.rms_norm(x, shape, w, 1e-5, activation=activation)
    if op == "add_layer_norm":
        return lambda x, w, b, r: L.add_layer_norm(x, r, shape, w, b)
    return lambda x, w, b, r: L.add_rms_norm(x, r, shape, w, 1e-5)


def _theirs(op, shape, activation=None):
    dims = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)

    def same(t, x):
        return None if t is None else t.to(x.dtype)

    def ref(x, w, b, r):
        s = x + r if r is not None else x
        if "rms" in op:
            y = F.rms_norm(s, dims, same(w, x), 1e-5)
        else:
            y = F.layer_norm(s, dims, same(w, x), same(b, x))
        y = ACT[activation](y)
        return (y, s) if op.startswith("add") else y

    return ref


# (op, dtype, normalized_shape, weight, bias, activation, input maker)
CASES = [
    ("layer_norm", torch.float32, 24, True, True, None, "3d"),
    ("layer_norm", torch.bfloat16, (24,), True, False, "relu", "3d"),
    ("layer_norm", torch.float16, [4, 6], True, False, None, "4d"),
    ("layer_norm", torch.float32, 24, True, True, "silu", "strided rows"),
    ("rms_norm", torch.float32, 24, True, False, None, "2d"),
    ("rms_norm", torch.bfloat16, 24, False, False, "silu", "3d"),
    ("add_layer_norm", torch.float32, 24, True, True, None, "3d"),
    ("add_rms_norm", torch.bfloat16, 24, True, False, None, "2d"),
]


def _input(kind, dtype):
    if kind == "3d":
        return randn(3, 5, 24, dtype=dtype, scale=2.0) + 1.0
    if kind == "4d":
        return randn(3, 5, 4, 6, dtype=dtype, scale=2.0) + 1.0
    if kind == "2d":
        # 64 rows: with 7, the residual sum's bf16 rounding (PyTorch normalizes the rounded sum,
        # we the fp32 one) left add_rms_norm's weight gradient, a max over 24 sums of 7, noisy
        # enough that ours passed twice PyTorch's error in 1 draw of 300, though smaller in the
        # median (0.0104 against 0.0157); 0 of 600 with 64 rows (0.0295 against 0.0439).
        return randn(64, 24, dtype=dtype, scale=2.0) + 1.0
    return randn(6, 2, 24, dtype=dtype, scale=2.0)[:, 1]  # rows 48 elements apart: still a view


@pytest.mark.parametrize(("op", "dtype", "shape", "has_w", "has_b", "activation", "kind"), CASES)
def test_repeated_calls_match_torch(op, dtype, shape, has_w, has_b, activation, kind, counted):
    """Three calls of one key, fresh data each: values and every gradient against float64 and
    PyTorch's error; only the first call is checked, none takes the general path's ops."""
    for _ in range(3):
        x = _input(kind, dtype)
        dy = [randn(*x.shape, dtype=dtype)] * (2 if op.startswith("add") else 1)
        dims = x.shape[-2:] if kind == "4d" else x.shape[-1:]
        w, b = randn(*dims) if has_w else None, randn(*dims) if has_b and "rms" not in op else None
        r = randn(*x.shape, dtype=dtype) if op.startswith("add") else None
        _compare(_ours(op, shape, activation), _theirs(op, shape, activation), [x, w, b, r], dy, op)
    assert counted == {"checks": 1, "general": 0}
    assert len(L._eager) == 1


def test_repeated_calls_with_a_narrower_residual(counted):
    """fp32 input plus a bf16 residual (autocast's residual stream and branch), three calls of one
    key: the fast path's plans are bound to both dtypes."""
    for _ in range(3):
        x, r = _input("3d", torch.float32), randn(3, 5, 24, dtype=torch.bfloat16)
        w, b, dy = randn(24), randn(24), [randn(3, 5, 24)] * 2
        _compare(_ours("add_layer_norm", 24), _theirs("add_layer_norm", 24), [x, w, b, r], dy, "fp32 + bf16")
    assert counted == {"checks": 1, "general": 0}


@pytest.mark.parametrize("op", ["add_layer_norm", "add_rms_norm"])
def test_fused_add_under_autocast_stores_the_products_copy_and_a_narrow_residuals_gradient(op, counted):
    """Under autocast (fp16: the interpreter's bf16 products are wrong) an fp32 input's fused add
    and norm also stores the output in fp16, kept for the product it feeds (the bits of a cast),
    and a residual narrower than the input gets its gradient in its own dtype from the backward
    kernel: the bits of the input's gradient rounded, as the autograd engine's cast gave them.
    Without autocast no copy is kept."""
    from tritondnn.core.autocast import lowered

    w = randn(24)
    b = randn(24) if op == "add_layer_norm" else None
    for _ in range(3):
        x, r = (
            randn(3, 5, 24, scale=2.0).requires_grad_(),
            randn(3, 5, 24, dtype=torch.float16).requires_grad_(),
        )
        with torch.autocast(DEVICE, dtype=torch.float16):
            y, total = _ours(op, 24)(x, w, b, r)
            low = lowered(y, torch.float16)
        assert y.dtype == total.dtype == torch.float32
        assert low is lowered(y, torch.float16) and torch.equal(low, y.detach().half())
        dy, ds = randn(3, 5, 24), randn(3, 5, 24)
        with _OpCounter() as ops:
            dx, dr = torch.autograd.grad((y, total), (x, r), (dy, ds))
        assert not ops.seen["_to_copy"]  # no cast of the engine's
        assert dr.dtype == torch.float16 and torch.equal(dr, dx.half())
        wide = [t.double().requires_grad_() for t in (x, r)]
        ref = _theirs(op, 24)(wide[0], w.double(), None if b is None else b.double(), wide[1])
        for got, want in zip(
            (y, total, dx), (*ref, torch.autograd.grad(ref, wide[0], (dy.double(), ds.double()))[0])
        ):
            torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    assert counted == {"checks": 1, "general": 0}
    y, _ = _ours(op, 24)(x, w, b, r)
    assert lowered(y, torch.float16) is not lowered(y, torch.float16)  # cast each time


def test_without_autograd(counted):
    """The forward alone (no_grad, and inputs that need no gradient): the same values, no graph."""
    w, b = randn(24), randn(24)
    for _ in range(2):
        x = randn(4, 24)
        with torch.no_grad():
            y = L.layer_norm(x, 24, w.requires_grad_(True), b)
        assert_close(y, F.layer_norm(x.double(), (24,), w.double(), b.double()), F.layer_norm(x, (24,), w, b))
        assert y.grad_fn is None
        y, s = L.add_layer_norm(x, x, 24)
        assert s.grad_fn is None and torch.equal(s, x + x)
    assert counted == {"checks": 2, "general": 0}


@pytest.mark.parametrize("op", ["layer_norm", "add_rms_norm"])
def test_fast_path_gives_the_general_paths_bits(op, monkeypatch):
    x, w, b = randn(3, 5, 24), randn(24), randn(24)
    r = randn(3, 5, 24) if op.startswith("add") else None
    b = b if op == "layer_norm" else None
    dys = [randn(3, 5, 24), randn(3, 5, 24)]
    runs = []
    for general in (False, True):
        monkeypatch.setattr(L, "_eager", {})
        if general:
            monkeypatch.setattr(L, "_eager_program", lambda *args: None)
        outs, grads = _grads(_ours(op, 24, "silu" if op == "layer_norm" else None), [x, w, b, r], dys)
        runs.append((*outs, *grads))
    assert all(torch.equal(a, c) for a, c in zip(*runs))


def test_gradients_in_other_layouts_and_of_the_sum_alone(counted):
    """An output gradient with other strides than the output's (the gradient of .sum(), stride 0)
    takes the general backward; the sum's gradient alone passes to both inputs."""
    x, w, r = randn(5, 24), randn(24), randn(5, 24)
    for _ in range(2):
        _compare(_ours("layer_norm", 24), _theirs("layer_norm", 24), [x, w, None, None],
                 [torch.ones((), device=DEVICE).expand(5, 24)], "stride-0 gradient")  # fmt: skip
    assert counted == {"checks": 1, "general": 2}  # the two backward passes
    xs, rs = x.detach().requires_grad_(True), r.detach().requires_grad_(True)
    for _ in range(2):
        _, total = L.add_rms_norm(xs, rs, 24, w)
        dx, dr = torch.autograd.grad(total, (xs, rs), 2 * x)
        assert torch.equal(dx, 2 * x) and torch.equal(dr, 2 * x)


def test_one_key_with_other_gradients_wanted(counted):
    """Calls of one key that want other gradients (the weight's, the bias's, through the sum or
    not) run the backward plans those need, and leave the inputs as they were."""
    x, w, b, r = randn(5, 24), randn(24), randn(24), randn(5, 24)
    kept = [t.clone() for t in (x, w, b, r)]
    for wanted in ("wbs", "w", "", "bs", "wbs"):
        xs, rs = x.detach().requires_grad_(True), r.detach().requires_grad_(True)
        ws, bs = w.detach().requires_grad_("w" in wanted), b.detach().requires_grad_("b" in wanted)
        wide = [t.double().requires_grad_(t.requires_grad) for t in (xs, rs, ws, bs)]
        s = wide[0] + wide[1]
        outs = [L.add_layer_norm(xs, rs, 24, ws, bs), (F.layer_norm(s, (24,), wide[2], wide[3]), s)]
        dys = [randn(5, 24), randn(5, 24)]
        n = 2 if "s" in wanted else 1
        got, want = (
            torch.autograd.grad(
                out[:n], [t for t in leaves if t.requires_grad], [d.to(out[0].dtype) for d in dys[:n]]
            )
            for out, leaves in zip(outs, [(xs, rs, ws, bs), wide])
        )
        for a, c in zip(got, want):
            assert_close(a, c, what=f"wanted {wanted!r}")
    assert all(torch.equal(a, c) for a, c in zip(kept, (x, w, b, r)))
    assert counted == {"checks": 1, "general": 0}


def test_config_change_shape_and_dtype_take_new_keys(counted):
    w, b = randn(24), randn(24)

    def call_and_check(x):
        y = L.layer_norm(x, 24, w, b)
        same = (w.to(x.dtype), b.to(x.dtype))
        assert_close(
            y, F.layer_norm(x.double(), (24,), w.double(), b.double()), F.layer_norm(x, (24,), *same)
        )

    call_and_check(randn(4, 24))
    call_and_check(randn(4, 24))
    assert counted["checks"] == 1
    with tdnn.config.flags(deterministic=not tdnn.config.deterministic):
        call_and_check(randn(4, 24))
    assert counted["checks"] == 2
    tdnn.config.invalidate_plans()
    call_and_check(randn(4, 24))
    call_and_check(randn(4, 24, dtype=torch.float16))
    call_and_check(randn(6, 24))
    call_and_check(randn(4, 2, 24)[:, 0])
    assert counted["checks"] == 6 and len(L._eager) == 6 and counted["general"] == 0


def test_backward_after_a_config_change(counted):
    x, w, dy = randn(4, 24), randn(24), randn(4, 24)
    xs, ws = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
    y = L.layer_norm(xs, 24, ws)
    with tdnn.config.flags(deterministic=not tdnn.config.deterministic):
        got = torch.autograd.grad(y, (xs, ws), dy)
    wide = [t.double().requires_grad_(True) for t in (x, w)]
    want = torch.autograd.grad(F.layer_norm(wide[0], (24,), wide[1]), wide, dy.double())
    same = [t.detach().requires_grad_(True) for t in (x, w)]
    theirs = torch.autograd.grad(F.layer_norm(same[0], (24,), same[1]), same, dy)
    for a, c, t in zip(got, want, theirs):
        assert_close(a, c, t)


class _Str(str):
    pass


# Bad calls made after a good call cached the key of its shapes: (change, error, match). Each
# differs from the cached call in something the key holds.
BAD = [
    ({"weight": "randn(5)"}, ValueError, "'weight' has shape"),
    ({"weight": [1.0] * 6}, TypeError, "'weight' must be a torch.Tensor"),
    ({"bias": "int64"}, TypeError, "'bias' has dtype torch.int64"),
    ({"bias": "meta"}, ValueError, "'bias' is on"),
    ({"normalized_shape": 5}, ValueError, "does not match the trailing dimensions"),
    ({"normalized_shape": (2, 6)}, ValueError, "does not match the trailing dimensions"),
    ({"normalized_shape": "6"}, TypeError, "'normalized_shape'"),
    ({"normalized_shape": (True,)}, TypeError, "'normalized_shape'"),
    ({"eps": -1.0}, ValueError, "'eps'=-1.0"),
    ({"eps": True}, ValueError, "'eps'=True"),
    ({"eps": math.nan}, ValueError, "'eps'=nan"),
    ({"activation": "swish"}, ValueError, "'activation'='swish'"),
    ({"activation": _Str("relu")}, ValueError, "'activation'='relu'"),
]


@pytest.mark.parametrize(("change", "error", "match"), BAD, ids=[m for _, _, m in BAD])
def test_bad_input_on_a_cached_key_still_raises(change, error, match, counted):
    good = {"normalized_shape": 6, "weight": randn(6), "bias": randn(6), "eps": 1e-5, "activation": None}
    x = randn(3, 6)
    L.layer_norm(x, **good)
    L.layer_norm(x, **good)
    assert counted["checks"] == 1 and len(L._eager) == 1
    special = {
        "randn(5)": randn(5),
        "int64": torch.zeros(6, dtype=torch.int64, device=DEVICE),
        "meta": torch.zeros(6, device="meta"),
    }
    bad = {**good, **{k: special.get(v, v) if type(v) is str else v for k, v in change.items()}}
    with pytest.raises(error, match=match):
        L.layer_norm(x, **bad)


def test_bad_residual_on_a_cached_key_still_raises(counted):
    x, r = randn(3, 6), randn(3, 6)
    L.add_layer_norm(x, r, 6)
    L.add_layer_norm(x, r, 6)
    for bad in (randn(3, 6, dtype=torch.float64), randn(2, 6)):
        with pytest.raises(ValueError, match="'residual'"):
            L.add_layer_norm(x, bad, 6)


@pytest.mark.parametrize("case", ["empty", "copied rows", "strided weight"])
def test_calls_the_fast_path_does_not_take(case, counted):
    """An empty input, rows that need a copy and a strided weight take the general path on every
    call, and are right (the strided weight read as the values it holds)."""
    x = {"empty": randn(0, 8), "copied rows": randn(3, 16)[:, ::2], "strided weight": randn(3, 8)}[case]
    wide = randn(16)
    w = wide[::2] if case == "strided weight" else wide[:8]
    for _ in range(2):
        _compare(
            _ours("layer_norm", 8), _theirs("layer_norm", 8), [x, w, None, None], [randn(*x.shape)], case
        )
    assert counted["checks"] == 2 and counted["general"] == 4 and not L._eager


def test_functorch_transforms_take_the_general_path():
    keys = []

    def f(x):
        keys.append(L._eager_key("tdnn.layer_norm", x, None, 3, None, None, 1e-5, None))
        return x.sum()

    x = randn(4, 3)
    torch.func.grad(f)(x)
    assert keys == [None]
    assert L._eager_key("tdnn.layer_norm", x, None, 3, None, None, 1e-5, None) is not None


def _lowered_norm(x, w, b):
    """The output of ``layer_norm``'s path under CUDA autocast (called here directly with fp16:
    the CPU's autocast keeps norms in the input dtype, and the interpreter's bf16 products are
    wrong), its fp16 copy kept."""
    return L._norm("tdnn.layer_norm", x, None, x.shape[-1], w, b, 1e-5, False, None, torch.float16)[0]


def _product(y, weight):
    """``linear(y, weight)`` as under an fp16 autocast: y cast inside the product's node."""
    from tritondnn.ops.matmul import _linear

    return _linear(y, weight, None, None, (), None, None, torch.float16)


def test_lowered_copy_for_the_next_product(counted):
    """An fp32 layer norm's output stored in fp16 as well, as it is written: the same bits as
    casting the output; a linear's cast inside its node takes it (marked, the mark shows in the
    product), with or without autograd recording; gradients flow through as before."""
    from tritondnn.core.autocast import lowered

    x, w, b, weight = (randn(*s).requires_grad_() for s in ((37, 96), (96,), (96,), (24, 96)))
    for _ in range(2):  # the validated call, then the fast path
        y = _lowered_norm(x, w, b)
        low = lowered(y, torch.float16)
        assert low.dtype == torch.float16 and low is lowered(y, torch.float16)  # kept, not cast
        assert torch.equal(low, y.detach().half())
        assert lowered(y, torch.bfloat16).dtype == torch.bfloat16  # another dtype: a cast
        ln = F.layer_norm(x.double(), (96,), w.double(), b.double())
        torch.testing.assert_close(y.double(), ln, rtol=1e-5, atol=1e-5)
        out = _product(y, weight)
        assert torch.equal(out, _product(y.detach().clone(), weight))
        grads = torch.autograd.grad(out.float().sum(), (x, w, b, weight))
        ref = F.linear(ln.half().double(), weight.half().double())  # the autocast product's operands
        ref_grads = torch.autograd.grad(ref.sum(), (x, w, b, weight))
        for g, r in zip(grads, ref_grads):
            assert g.dtype == torch.float32
            # fp16 operands rounded as the reference rounds them, fp32 sums: ~3e-4 of the largest
            assert (g.double() - r).abs().max() <= 2e-3 * r.abs().max()
    assert counted["checks"] == 1
    ones = _product(torch.ones(37, 96, device=DEVICE), weight.detach())
    for grad in (True, False):
        y = _lowered_norm(x, w, b)
        lowered(y, torch.float16).fill_(1.0)  # a mark only the kept copy carries
        with torch.set_grad_enabled(grad):
            assert torch.equal(_product(y, weight), ones)


def _write_with_tdnn_relu(y):
    tdnn.relu(y, inplace=True)


def _write_with_op_tensor(y):
    tdnn.op_tensor(y, y, "mul", out=y)


def _write_under_no_grad(y):
    with torch.no_grad():
        y.mul_(2)


@pytest.mark.parametrize("write", [_write_with_tdnn_relu, _write_with_op_tensor, _write_under_no_grad])
def test_lowered_copy_is_not_taken_after_a_write(write, counted):
    """A write to the output after the norm (tritondnn's in-place kernels count theirs in its
    version counter, as PyTorch's ops do) makes the product cast the new values."""
    from tritondnn.core.autocast import lowered

    x, w, b, weight = randn(37, 96), randn(96), randn(96), randn(24, 96)  # y requires no grad
    for _ in range(2):
        y = _lowered_norm(x, w, b)
        lowered(y, torch.float16).fill_(1.0)
        write(y)
        assert torch.equal(_product(y, weight), _product(y.clone(), weight))


def test_lowered_copy_only_where_autograd_records_and_only_the_latest():
    """No copy without grad mode (evaluation casts in the product's no-grad path anyway) or in
    inference mode (no version counter); one copy kept, the latest norm's, dropped with its
    output."""
    from tritondnn.core import autocast as A

    x, w, b = randn(8, 32), randn(32), randn(32)
    with torch.no_grad():
        assert L._layer_norm_autocast(torch.float16, x, 32, w, b) is NotImplemented
    with torch.inference_mode():
        assert L._layer_norm_autocast(torch.float16, x, 32, w, b) is NotImplemented
        t = torch.ones(4)
        A.attach_lowered(t, t.half())
        assert A._lowered[0] is None or A._lowered[0][0]() is not t
    first, second = _lowered_norm(x, w, b), _lowered_norm(x * 2, w, b)
    assert A.lowered(second, torch.float16) is A._lowered[0][3]
    assert A.lowered(first, torch.float16) is not A._lowered[0][3]  # replaced: a cast
    del second
    assert A._lowered[0] is None


@pytest.mark.skipif(
    DEVICE == "cpu", reason="CUDA autocast runs layer norm in fp32 (the CPU's keeps the dtype)"
)
def test_autocast_layer_norm_then_linear_takes_the_lowered_copy():
    """Under CUDA autocast tdnn.layer_norm on fp32 returns fp32 as F.layer_norm does, its bf16
    copy kept; tdnn.linear on it gives the bits it gives on a plain copy of the output, and takes
    the kept copy (marked, the mark shows)."""
    from tritondnn.core.autocast import lowered

    x, w, b, weight = randn(64, 768).requires_grad_(), randn(768), randn(768), randn(256, 768)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        for _ in range(2):
            y = tdnn.layer_norm(x, 768, w, b)
            assert y.dtype == torch.float32
            assert lowered(y, torch.bfloat16) is lowered(y, torch.bfloat16)
            out, plain = tdnn.linear(y, weight), tdnn.linear(y.detach().clone().requires_grad_(), weight)
            assert out.dtype == torch.bfloat16 and torch.equal(out, plain)
        lowered(y, torch.bfloat16).fill_(1.0)
        ones = torch.ones_like(y).requires_grad_()  # the same (recorded) path
        assert torch.equal(tdnn.linear(y, weight), tdnn.linear(ones, weight))
    torch.testing.assert_close(
        y.double(), F.layer_norm(x.double(), (768,), w.double(), b.double()), rtol=1e-5, atol=1e-5
    )
