"""layer_norm, rms_norm and their fused variants: values and every gradient against float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tritondnn.ops.norm as norm
from helpers import DEVICE, DTYPES, ON_GPU, assert_close, randn
from tritondnn.ops.norm import layer as L


def _grads(fn, inputs, dys):
    """Outputs of ``fn(*inputs)`` (a tensor or a tuple) and the gradients of every input that
    requires grad, for output gradients ``dys``."""
    inputs = [t.detach().requires_grad_(True) if t is not None else None for t in inputs]
    out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    leaves = [t for t in inputs if t is not None]
    grads = torch.autograd.grad(outs, leaves, dys[: len(outs)])
    return [o.detach() for o in outs], list(grads)


def _compare(ours, ref, inputs, dys, what):
    """ours/ref: functions of the same inputs; ref also runs in float64 for the reference."""
    got, dgot = _grads(ours, inputs, dys)
    same, dsame = _grads(ref, inputs, dys)
    wide, dwide = _grads(
        ref, [t.double() if t is not None else None for t in inputs], [d.double() for d in dys]
    )
    for i, (a, b, c) in enumerate(zip(got, wide, same)):
        assert_close(a, b, c, f"{what} output {i}")
    for i, (a, b, c) in enumerate(zip(dgot, dwide, dsame)):
        assert_close(a, b, c, f"{what} gradient {i}")


def _torch_ln(x, w, b, shape, eps=1e-5, activation=None):
    y = F.layer_norm(x, shape, w, b, eps)
    acts = {"relu": F.relu, "silu": F.silu, "gelu": F.gelu, "sigmoid": torch.sigmoid, "tanh": torch.tanh}
    return y if activation is None else acts[activation](y)


@pytest.mark.parametrize("affine", ["weight+bias", "weight", "none"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layer_norm(dtype, affine, poison):
    x = randn(5, 7, 96, dtype=dtype, scale=3.0) + 1.0
    w = randn(96, dtype=dtype) if affine != "none" else None
    b = randn(96, dtype=dtype) if affine == "weight+bias" else None
    dy = randn(5, 7, 96, dtype=dtype)
    _compare(
        lambda x, w, b: norm.layer_norm(x, 96, w, b),
        lambda x, w, b: F.layer_norm(x, (96,), w, b),
        [x, w, b],
        [dy],
        f"layer_norm {affine}",
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm(dtype, poison):
    x, w, dy = (
        randn(9, 2, 33, dtype=dtype, scale=2.0),
        randn(2, 33, dtype=dtype),
        randn(9, 2, 33, dtype=dtype),
    )
    eps = torch.finfo(dtype).eps
    _compare(
        lambda x, w: norm.rms_norm(x, (2, 33), w),
        lambda x, w: F.rms_norm(x, (2, 33), w, eps=eps),
        [x, w],
        [dy],
        "rms_norm",
    )


def test_mixed_dtypes_fp32_parameters_with_bf16_input(poison):
    x, dy = randn(6, 64, dtype=torch.bfloat16, scale=2.0), randn(6, 64, dtype=torch.bfloat16)
    w, b = randn(64), randn(64)
    got, (dx, dw, _db) = _grads(lambda x, w, b: norm.layer_norm(x, 64, w, b), [x, w, b], [dy])
    assert got[0].dtype == torch.bfloat16 and dx.dtype == torch.bfloat16 and dw.dtype == torch.float32
    ref, dref = _grads(
        lambda x, w, b: F.layer_norm(x, (64,), w, b), [x.double(), w.double(), b.double()], [dy.double()]
    )
    assert_close(got[0], ref[0], F.layer_norm(x, (64,), w.bfloat16(), b.bfloat16()))
    assert_close(dw, dref[1].float())


@pytest.mark.parametrize("activation", ["relu", "silu", "gelu", "sigmoid", "tanh"])
def test_layer_norm_with_fused_activation(activation, poison):
    x, w, b, dy = randn(11, 40, scale=2.0), randn(40), randn(40), randn(11, 40)
    _compare(
        lambda x, w, b: norm.layer_norm(x, 40, w, b, activation=activation),
        lambda x, w, b: _torch_ln(x, w, b, (40,), activation=activation),
        [x, w, b],
        [dy],
        activation,
    )


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_residual_add(rms, dtype, poison):
    x, r = randn(8, 3, 80, dtype=dtype, scale=2.0), randn(8, 3, 80, dtype=dtype, scale=2.0)
    w, b = randn(80, dtype=dtype), randn(80, dtype=dtype)
    dy, ds = randn(8, 3, 80, dtype=dtype), randn(8, 3, 80, dtype=dtype)
    eps = torch.finfo(dtype).eps if rms else 1e-5

    def ref(x, r, w, b):
        s = x + r
        y = F.rms_norm(s, (80,), w, eps=eps) if rms else F.layer_norm(s, (80,), w, b, eps)
        return y, s

    def ours(x, r, w, b):
        return norm.add_rms_norm(x, r, 80, w) if rms else norm.add_layer_norm(x, r, 80, w, b)

    _compare(ours, ref, [x, r, w, b if not rms else None], [dy, ds], f"add+{'rms' if rms else 'layer'}_norm")


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("residual_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fused_residual_add_of_a_narrower_dtype(rms, residual_dtype, poison):
    """An fp32 residual stream plus a 16-bit branch's output (what autocast leaves): the sum in
    fp32, as PyTorch's type promotion forms it, and the branch's gradient in its own dtype."""
    x, r = randn(6, 40, scale=2.0), randn(6, 40, dtype=residual_dtype, scale=2.0)
    w, b, dy, ds = randn(40), randn(40), randn(6, 40), randn(6, 40)
    eps = 1e-5

    def ref(x, r, w, b):
        s = x + r
        y = F.rms_norm(s, (40,), w, eps=eps) if rms else F.layer_norm(s, (40,), w, b, eps)
        return y, s

    def ours(x, r, w, b):
        return norm.add_rms_norm(x, r, 40, w, eps) if rms else norm.add_layer_norm(x, r, 40, w, b, eps)

    _compare(ours, ref, [x, r, w, b if not rms else None], [dy, ds], f"fp32 + {residual_dtype}")
    with pytest.raises(ValueError, match="no wider"):  # the sum would be in the residual's dtype
        ours(r, x, w, b)


def test_fused_residual_gradient_of_the_sum_alone():
    x, r = randn(4, 16).requires_grad_(True), randn(4, 16)
    _, s = norm.add_rms_norm(x, r, 16)
    (dx,) = torch.autograd.grad(s.sum() * 3.0, x)
    assert torch.equal(dx, torch.full_like(dx, 3.0))


@pytest.mark.parametrize("rms", [False, True])
def test_long_rows_use_the_looped_engine(rms, poison, monkeypatch):
    """Rows beyond the one-block limit: Chan's merge forward, two passes backward."""
    monkeypatch.setattr(L, "MAX_ONE_BLOCK", {False: 64, True: 64})
    monkeypatch.setattr(L.FAMILY, "_plans", {})
    monkeypatch.setattr(L.FAMILY, "_chosen", {})
    x, w, b, dy = randn(5, 300, scale=3.0) + 20.0, randn(300), randn(300), randn(5, 300)
    assert {r.name: r for r in L.FAMILY.report(L._describe(x, 300))}["looped"].chosen
    if rms:
        _compare(
            lambda x, w: norm.rms_norm(x, 300, w, eps=1e-6),
            lambda x, w: F.rms_norm(x, (300,), w, 1e-6),
            [x, w],
            [dy],
            "rms",
        )
    else:
        _compare(
            lambda x, w, b: norm.layer_norm(x, 300, w, b),
            lambda x, w, b: F.layer_norm(x, (300,), w, b),
            [x, w, b],
            [dy],
            "ln",
        )
    r = randn(5, 300)
    _compare(
        lambda x, r, w: norm.add_layer_norm(x, r, 300, w),
        lambda x, r, w: (F.layer_norm(x + r, (300,), w), x + r),
        [x, r, w],
        [dy, randn(5, 300)],
        "looped add",
    )


def test_large_mean_and_constant_rows():
    """Mean 1e4 with unit variance keeps its digits (two-pass); constant rows give 0, not NaN."""
    x = randn(6, 512) + 1e4
    assert_close(norm.layer_norm(x, 512), F.layer_norm(x.double(), (512,)), F.layer_norm(x, (512,)))
    c = torch.full((3, 64), 7.5, device=DEVICE)
    y = norm.layer_norm(c, 64)
    assert torch.equal(y, torch.zeros_like(y))


def test_strided_input_and_gradient():
    base = randn(8, 2, 50, scale=2.0)
    x = base[:, 1]  # rows 100 elements apart
    dy = torch.ones((), device=DEVICE).expand(8, 50)  # the gradient of .sum(): stride 0
    _compare(lambda x: norm.layer_norm(x, 50), lambda x: F.layer_norm(x, (50,)), [x], [dy], "strided")


def test_gradcheck_float64():
    x = randn(3, 8, dtype=torch.float64).requires_grad_(True)
    w = randn(8, dtype=torch.float64).requires_grad_(True)
    b = randn(8, dtype=torch.float64).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x, w, b: norm.layer_norm(x, 8, w, b, activation="silu"), (x, w, b))
    assert torch.autograd.gradcheck(lambda x, w: norm.rms_norm(x, 8, w), (x, w))


def test_empty_and_degenerate():
    x = randn(0, 16)
    assert norm.layer_norm(x, 16).shape == (0, 16)
    w = randn(16).requires_grad_(True)
    (dw,) = torch.autograd.grad(norm.layer_norm(x, 16, w).sum(), w)
    assert torch.equal(dw, torch.zeros_like(dw))
    one = randn(4, 1)
    assert torch.equal(norm.layer_norm(one, 1), torch.zeros_like(one))


def test_deterministic_bits_twice():
    x, w, b, dy = randn(64, 96), randn(96), randn(96), randn(64, 96)
    runs = [_grads(lambda x, w, b: norm.layer_norm(x, 96, w, b), [x, w, b], [dy])[1] for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: norm.layer_norm(randn(3, 4), 5), ValueError, "does not match the trailing dimensions"),
        (lambda: norm.layer_norm(randn(3, 4), 4, randn(5)), ValueError, r"'weight' has shape \(5,\)"),
        (lambda: norm.layer_norm(randn(3, 4), 4, None, randn(2, 2)), ValueError, "'bias' has shape"),
        (
            lambda: norm.layer_norm(randn(3, 4), 4, eps=0.0),
            ValueError,
            "'eps'=0.0 must be a finite number > 0",
        ),
        (lambda: norm.layer_norm(randn(3, 4), "4"), TypeError, "'normalized_shape'"),
        (lambda: norm.layer_norm(randn(3, 4), 4, activation="swish"), ValueError, "'activation'='swish'"),
        (lambda: norm.add_rms_norm(randn(3, 4), randn(3, 5), 4), ValueError, "'residual'"),
        (lambda: norm.rms_norm(torch.ones(3, 4, dtype=torch.int32, device=DEVICE), 4), TypeError, "dtype"),
    ],
)
def test_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_library_ops_pass_opcheck():
    x, w, b = randn(4, 12), randn(12), randn(12)
    torch.library.opcheck(L._forward.op, (x, randn(4, 12), w, b, 12, 1e-5, False, -1, 0.0, 0.0))
    _, _, stats = L._forward(x, None, w, b, 12, 1e-5, False, -1, 0.0, 0.0)
    torch.library.opcheck(
        L._backward.op, (randn(4, 12), x, w, b, stats, None, 12, False, -1, 0.0, 0.0, True, True)
    )


def test_torch_compile_fullgraph():
    def f(x, r, w):
        y, s = norm.add_rms_norm(x, r, 24, w)
        return (norm.layer_norm(y, 24, w) * s).sum()

    compiled = torch.compile(f, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    x, r, w = randn(5, 24), randn(5, 24), randn(24)
    got = _grads(compiled, [x, r, w], [torch.ones((), device=DEVICE)])[1]
    want = _grads(
        lambda x, r, w: (
            F.layer_norm(F.rms_norm(x + r, (24,), w, 1.1920928955078125e-07), (24,), w) * (x + r)
        ).sum(),
        [x.double(), r.double(), w.double()],
        [torch.ones((), device=DEVICE, dtype=torch.float64)],
    )[1]
    for a, b in zip(got, want):
        assert_close(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_large(dtype):
    x, w, b, dy = (
        randn(4096, 4096, dtype=dtype),
        randn(4096, dtype=dtype),
        randn(4096, dtype=dtype),
        randn(4096, 4096, dtype=dtype),
    )
    _compare(
        lambda x, w, b: norm.layer_norm(x, 4096, w, b),
        lambda x, w, b: F.layer_norm(x, (4096,), w, b),
        [x, w, b],
        [dy],
        "large",
    )
