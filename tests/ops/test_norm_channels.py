"""batch_norm, group_norm and instance_norm: values, running statistics and every gradient
against float64, in NCHW and channels_last, with fused activations; the statistics/apply split."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from test_norm_layer import _compare, _grads

import tritondnn.ops.norm as norm
from helpers import DEVICE, DTYPES, ON_GPU, assert_close, randn
from tritondnn.ops.norm import batch as B
from tritondnn.ops.norm import group as G
from tritondnn.ops.norm import group_pipeline

ACT = {None: lambda y: y, "relu": F.relu, "silu": F.silu, "sigmoid": torch.sigmoid, "tanh": torch.tanh}
LAYOUTS = {"nchw": lambda t: t, "channels_last": lambda t: t.to(memory_format=torch.channels_last)}


def _x(shape=(3, 8, 5, 7), dtype=torch.float32, layout="nchw", scale=2.0, offset=1.0):
    return LAYOUTS[layout](randn(*shape, dtype=dtype, scale=scale) + offset)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("groups", [1, 4, 8])
def test_group_norm(groups, dtype, layout, poison):
    x = _x(dtype=dtype, layout=layout)
    w, b, dy = randn(8, dtype=dtype), randn(8, dtype=dtype), LAYOUTS[layout](randn(3, 8, 5, 7, dtype=dtype))
    _compare(
        lambda x, w, b: norm.group_norm(x, groups, w, b),
        lambda x, w, b: F.group_norm(x, groups, w, b),
        [x, w, b],
        [dy],
        f"group_norm G={groups}",
    )
    assert norm.group_norm(x, groups, w, b).stride() == x.stride()


@pytest.mark.parametrize("activation", ["silu", "relu", "sigmoid", "tanh"])
def test_group_norm_with_fused_activation(activation, poison):
    x, w, b, dy = _x(layout="channels_last"), randn(8), randn(8), randn(3, 8, 5, 7)
    _compare(
        lambda x, w, b: norm.group_norm(x, 2, w, b, activation=activation),
        lambda x, w, b: ACT[activation](F.group_norm(x, 2, w, b)),
        [x, w, b],
        [dy],
        activation,
    )


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_group_norm_looped(layout, poison, monkeypatch):
    """Groups beyond the register tile: Chan's merge forward, two passes backward."""
    monkeypatch.setattr(G, "MAX_TILE", {False: 16, True: 16})
    monkeypatch.setattr(G.FAMILY, "_plans", {})
    monkeypatch.setattr(G.FAMILY, "_chosen", {})
    x, w, b, dy = _x(layout=layout, offset=50.0), randn(8), randn(8), randn(3, 8, 5, 7)
    _compare(
        lambda x, w, b: norm.group_norm(x, 4, w, b, activation="silu"),
        lambda x, w, b: F.silu(F.group_norm(x, 4, w, b)),
        [x, w, b],
        [dy],
        "looped",
    )


@pytest.mark.parametrize("engine", ["one-block", "looped", "split"])
@pytest.mark.parametrize("groups", [1, 4, 8])
def test_group_norm_channels_last_engines(engine, groups, poison, monkeypatch):
    """Each forward engine on channels_last input with a large mean (the split engine's shifted
    sums and per-group merge); the backward runs on one-block."""
    keep = {engine, "one-block"}
    monkeypatch.setattr(G.FAMILY, "engines", [e for e in G.FAMILY.engines if e.name in keep])
    monkeypatch.setattr(G.FAMILY, "_plans", {})
    monkeypatch.setattr(G.FAMILY, "_chosen", {})
    if engine != "one-block":
        monkeypatch.setattr(G.OneBlockEngine, "cost", lambda self, p: 2.0 if not p.backward else 1.0)
    x, w, b, dy = _x(layout="channels_last", offset=50.0), randn(8), randn(8), randn(3, 8, 5, 7)
    _compare(
        lambda x, w, b: norm.group_norm(x, groups, w, b, activation="silu"),
        lambda x, w, b: F.silu(F.group_norm(x, groups, w, b)),
        [x, w, b],
        [dy],
        engine,
    )
    used = {choice.engine.name for problem, choice in G.FAMILY._chosen.items() if not problem[0].backward}
    assert used == {engine}


@pytest.mark.parametrize("lead_bytes", [0, 1 << 40], ids=["lead-one-sample", "statistics-first"])
@pytest.mark.parametrize(
    ("groups", "affine", "activation"),
    [(4, "weight+bias", "silu"), (8, "weight", None), (1, "bias", "relu"), (2, "none", None)],
)
def test_group_norm_pipelined_engine(groups, affine, activation, lead_bytes, poison, monkeypatch):
    """The one-launch channels_last engine, forward and backward, with several chunks a sample
    (the last one ragged), a large mean, and the apply items one sample behind the statistics
    items or after all of them; only the gradients asked for; the same bits on a second run."""

    config = {"ROWS": 4, "BLOCK_S": 2, "LEAD_BYTES": lead_bytes, "num_warps": 4}
    monkeypatch.setattr(G.FAMILY, "engines", [e for e in G.FAMILY.engines if e.name == "pipelined"])
    monkeypatch.setattr(G.FAMILY, "_plans", {})
    monkeypatch.setattr(G.FAMILY, "_chosen", {})
    monkeypatch.setattr(group_pipeline.PipelinedEngine, "configs", lambda self, p: [config])
    monkeypatch.setattr(group_pipeline, "rows_per_load", lambda *sizes: 2)  # 4 chunks in two loads
    shape = (3, 8, 5, 3)  # 15 positions: chunks of 4, 4, 4 and 3
    x, dy = _x(shape=shape, layout="channels_last", offset=300.0), randn(*shape)
    w = randn(8) if "weight" in affine else None
    b = randn(8) if "bias" in affine else None

    def reference(x, w, b):  # the bias added outside: torch's backward fails for a bias without weight
        y = F.group_norm(x, groups, w, None)
        return ACT[activation](y if b is None else y + b.to(x.dtype).view(1, -1, 1, 1))

    ours = lambda x, w, b: norm.group_norm(x, groups, w, b, activation=activation)
    _compare(ours, reference, [x, w, b], [dy], f"pipelined {affine} {activation}")
    runs = [_grads(ours, [x, w, b], [dy]) for _ in range(2)]
    assert all(torch.equal(p, q) for p, q in zip(runs[0][0] + runs[0][1], runs[1][0] + runs[1][1]))
    if w is not None and b is not None:  # dweight without dbias, then dbias without dweight
        _compare(lambda x, w: ours(x, w, b), lambda x, w: reference(x, w, b), [x, w], [dy], "dweight only")
        _compare(
            lambda x, b: ours(x, w, b),
            lambda x, b: reference(x, w.to(x.dtype), b),
            [x, b],
            [dy],
            "dbias only",
        )
    assert {choice.engine.name for choice in G.FAMILY._chosen.values()} == {"pipelined"}
    assert {problem[0].backward for problem in G.FAMILY._chosen} == {False, True}


@pytest.mark.parametrize("shape", [(2, 6), (2, 6, 9), (2, 4, 3, 2, 5)])
def test_group_norm_ranks(shape, poison):
    x, w, b = randn(*shape, scale=2.0), randn(shape[1]), randn(shape[1])
    _compare(
        lambda x, w, b: norm.group_norm(x, 2, w, b),
        lambda x, w, b: F.group_norm(x, 2, w, b),
        [x, w, b],
        [randn(*shape)],
        str(shape),
    )


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_instance_norm_with_running_statistics(layout, poison):
    x, w, b, dy = _x(layout=layout), randn(8), randn(8), randn(3, 8, 5, 7)
    rm, rv = randn(8), torch.rand(8, device=DEVICE) + 0.5
    rm_ref, rv_ref = rm.double(), rv.double()
    _compare(
        lambda x, w, b: norm.instance_norm(x, None, None, w, b),
        lambda x, w, b: F.instance_norm(x, None, None, w, b),
        [x, w, b],
        [dy],
        "instance_norm",
    )
    y = norm.instance_norm(x, rm, rv, w, b, momentum=0.3)
    F.instance_norm(x.double(), rm_ref, rv_ref, w.double(), b.double(), momentum=0.3)
    assert_close(rm, rm_ref, what="running_mean")
    assert_close(rv, rv_ref, what="running_var")
    assert_close(y, F.instance_norm(x.double(), None, None, w.double(), b.double()))
    y_eval = norm.instance_norm(x, rm, rv, w, b, use_input_stats=False)
    assert_close(
        y_eval,
        F.instance_norm(x.double(), rm.double(), rv.double(), w.double(), b.double(), use_input_stats=False),
    )


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("training", [True, False])
def test_batch_norm(training, dtype, layout, poison):
    x, dy = _x(dtype=dtype, layout=layout), LAYOUTS[layout](randn(3, 8, 5, 7, dtype=dtype))
    w, b = randn(8), randn(8)  # fp32 parameters with low-precision activations, as AMP keeps them
    rm, rv = randn(8), torch.rand(8, device=DEVICE) + 0.5
    rm_ref, rv_ref = rm.double(), rv.double()
    _compare(
        lambda x, w, b: norm.batch_norm(x, rm.clone(), rv.clone(), w, b, training),
        lambda x, w, b: F.batch_norm(
            x, rm.to(x.dtype, copy=True), rv.to(x.dtype, copy=True), w.to(x.dtype), b.to(x.dtype), training
        ),
        [x, w, b],
        [dy],
        f"batch_norm training={training}",
    )
    y = norm.batch_norm(x, rm, rv, w, b, training, momentum=0.2)
    F.batch_norm(x.double(), rm_ref, rv_ref, w.double(), b.double(), training, momentum=0.2)
    assert y.stride() == x.stride()
    assert_close(rm, rm_ref, what="running_mean")
    assert_close(rv, rv_ref, what="running_var")


@pytest.mark.parametrize("activation", ["sigmoid", "tanh", "silu"])
@pytest.mark.parametrize("training", [True, False])
def test_batch_norm_with_fused_activation(training, activation, poison):
    """act(batch_norm(x)) without a residual: the backward takes the activation's gradient from the
    normalized values it recomputes (sigmoid's and tanh's are written in their outputs)."""
    x, dy = _x(layout="channels_last"), LAYOUTS["channels_last"](randn(3, 8, 5, 7))
    w, b = randn(8), randn(8)
    rm, rv = randn(8), torch.rand(8, device=DEVICE) + 0.5
    _compare(
        lambda x, w, b: norm.batch_norm(x, rm.clone(), rv.clone(), w, b, training, activation=activation),
        lambda x, w, b: ACT[activation](
            F.batch_norm(x, rm.to(x.dtype, copy=True), rv.to(x.dtype, copy=True), w, b, training)
        ),
        [x, w, b],
        [dy],
        activation,
    )


@pytest.mark.parametrize(
    ("layout", "residual_layout"), [("nchw", "channels_last"), ("channels_last", "nchw")]
)
@pytest.mark.parametrize("activation", [None, "relu", "sigmoid"])
@pytest.mark.parametrize("training", [True, False])
def test_batch_norm_with_residual(training, activation, layout, residual_layout, poison):
    """act(batch_norm(x) + r), the residual in the other layout (read through a copy in x's);
    the output keeps x's layout."""
    x, dy = _x(layout=layout), LAYOUTS[layout](randn(3, 8, 5, 7))
    r = LAYOUTS[residual_layout](randn(3, 8, 5, 7))
    w, b = randn(8), randn(8)
    rm, rv = randn(8), torch.rand(8, device=DEVICE) + 0.5
    _compare(
        lambda x, w, b, r: norm.batch_norm(
            x, rm.clone(), rv.clone(), w, b, training, activation=activation, residual=r
        ),
        lambda x, w, b, r: ACT[activation](
            F.batch_norm(x, rm.to(x.dtype, copy=True), rv.to(x.dtype, copy=True), w, b, training) + r
        ),
        [x, w, b, r],
        [dy],
        f"batch_norm + residual training={training} {activation}",
    )
    assert norm.batch_norm(x, None, None, training=True, residual=r).stride() == x.stride()


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("shape", [(7, 5), (64, 65), (4, 6, 9), (2, 3, 2, 3, 4)])
def test_batch_norm_ranks_without_running_stats(shape, affine, poison):
    x = randn(*shape, scale=2.0)
    params = [randn(shape[1]), randn(shape[1])] if affine else [None, None]
    _compare(
        lambda x, w, b: norm.batch_norm(x, None, None, w, b, training=True, activation="relu"),
        lambda x, w, b: F.relu(F.batch_norm(x, None, None, w, b, training=True)),
        [x, *params],
        [randn(*shape)],
        str(shape),
    )
    _compare(
        lambda x, w, b: norm.group_norm(x, 1, w, b),
        lambda x, w, b: F.group_norm(x, 1, w, b),
        [x, *params],
        [randn(*shape)],
        str(shape),
    )


def test_large_mean_keeps_the_variance():
    """Mean 1e4, unit variance: sums of x - shift, and the mean subtracted before scaling."""
    x = randn(16, 4, 33) + 1e4
    assert_close(
        norm.batch_norm(x, None, None, training=True),
        F.batch_norm(x.double(), None, None, training=True),
        F.batch_norm(x, None, None, training=True),
    )
    assert_close(norm.group_norm(x, 2), F.group_norm(x.double(), 2), F.group_norm(x, 2))
    constant = torch.full((4, 3, 5), 2.5, device=DEVICE)
    assert torch.equal(norm.batch_norm(constant, None, None, training=True), torch.zeros_like(constant))
    assert torch.equal(norm.group_norm(constant, 3), torch.zeros_like(constant))


def test_statistics_and_apply_split_matches_batch_norm(poison):
    """cuDNN's genstats then finalize + apply, as a distributed wrapper would call them with
    sums added across two shards of the batch."""
    x, w, b = _x(shape=(6, 8, 4, 4), offset=100.0), randn(8), randn(8)
    rm, rv = torch.zeros(8, device=DEVICE), torch.ones(8, device=DEVICE)
    shift = x[0, :, 0, 0].clone()
    parts = [norm.batch_norm_stats(half, shift) for half in (x[:3], x[3:])]
    total, total_sq = parts[0][0] + parts[1][0], parts[0][1] + parts[1][1]
    assert parts[0][3] == 3 * 16
    y, mean, invstd = norm.batch_norm_apply(x, total, total_sq, shift, 6 * 16, w, b, rm, rv, momentum=0.5)
    rm_ref, rv_ref = (
        torch.zeros(8, device=DEVICE, dtype=torch.float64),
        torch.ones(8, device=DEVICE, dtype=torch.float64),
    )
    ref = F.batch_norm(x.double(), rm_ref, rv_ref, w.double(), b.double(), True, 0.5)
    assert_close(y, ref, F.batch_norm(x, None, None, w, b, True))
    assert_close(mean, x.double().mean((0, 2, 3)))
    assert_close(rm, rm_ref)
    assert_close(rv, rv_ref)
    assert invstd.shape == (8,)


def test_gradcheck_float64():
    x = randn(3, 4, 5, dtype=torch.float64).requires_grad_(True)
    w, b = (
        randn(4, dtype=torch.float64).requires_grad_(True),
        randn(4, dtype=torch.float64).requires_grad_(True),
    )
    assert torch.autograd.gradcheck(lambda x, w, b: norm.group_norm(x, 2, w, b, activation="silu"), (x, w, b))
    assert torch.autograd.gradcheck(
        lambda x, w, b: norm.batch_norm(x, None, None, w, b, True, activation="relu"), (x, w, b)
    )
    r = randn(3, 4, 5, dtype=torch.float64).requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda x, w, b, r: norm.batch_norm(x, None, None, w, b, True, activation="relu", residual=r),
        (x, w, b, r),
    )


@pytest.mark.parametrize("op", ["group_norm", "instance_norm"])
def test_strided_weight_and_bias(op):
    """A weight and bias sliced from wider tensors (stride 2) are read as the values they hold,
    with gradients into the wide tensors."""
    x, dy, wide_w, wide_b = _x(), randn(3, 8, 5, 7), randn(16), randn(16)
    if op == "group_norm":
        ours = lambda x, w, b: norm.group_norm(x, 4, w[::2], b[1::2])
        theirs = lambda x, w, b: F.group_norm(x, 4, w[::2], b[1::2])
    else:
        ours = lambda x, w, b: norm.instance_norm(x, weight=w[::2], bias=b[1::2])
        theirs = lambda x, w, b: F.instance_norm(x, weight=w[::2], bias=b[1::2])
    _compare(ours, theirs, [x, wide_w, wide_b], [dy], op)


def test_deterministic_bits_twice():
    x, w, b, dy = _x(shape=(8, 16, 9, 9)), randn(16), randn(16), randn(8, 16, 9, 9)
    for fn in (
        lambda x, w, b: norm.batch_norm(x, None, None, w, b, True),
        lambda x, w, b: norm.group_norm(x, 4, w, b),
    ):
        runs = [_grads(fn, [x, w, b], [dy])[1] for _ in range(2)]
        assert all(torch.equal(p, q) for p, q in zip(*runs))


def test_empty_batch():
    x = randn(0, 4, 3)
    assert norm.group_norm(x, 2).shape == x.shape
    assert norm.batch_norm(x, torch.zeros(4, device=DEVICE), torch.ones(4, device=DEVICE)).shape == x.shape


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (
            lambda: norm.group_norm(randn(2, 6, 4), 4),
            ValueError,
            "'num_groups'=4 does not divide the 6 channels",
        ),
        (lambda: norm.group_norm(randn(2, 6, 4), 0), ValueError, "'num_groups'=0 must be a positive int"),
        (lambda: norm.group_norm(randn(2, 6, 4), 2, randn(5)), ValueError, "'weight' has shape"),
        (lambda: norm.group_norm(randn(6), 2), ValueError, "dimensions"),
        (lambda: norm.batch_norm(randn(2, 3, 4), randn(4), randn(3)), ValueError, "'running_mean' has shape"),
        (lambda: norm.batch_norm(randn(2, 3, 4), randn(3), None), ValueError, "give both"),
        (lambda: norm.batch_norm(randn(2, 3), None, None), ValueError, "required when training=False"),
        (
            lambda: norm.batch_norm(randn(1, 3), None, None, training=True),
            ValueError,
            "more than 1 value per channel",
        ),
        (
            lambda: norm.batch_norm(
                randn(2, 3, 4), torch.zeros(3, dtype=torch.int64, device=DEVICE), torch.ones(3, device=DEVICE)
            ),
            TypeError,
            "'running_mean' has dtype torch.int64",
        ),
        (
            lambda: norm.batch_norm(randn(2, 3, 4), None, None, training=True, eps=-1.0),
            ValueError,
            "'eps'=-1.0",
        ),
        (
            lambda: norm.batch_norm(randn(2, 3, 4), None, None, training=True, residual=randn(2, 3, 5)),
            ValueError,
            "'residual' has shape",
        ),
        (
            lambda: norm.batch_norm(
                randn(2, 3, 4), None, None, training=True, residual=randn(2, 3, 4, dtype=torch.float64)
            ),
            TypeError,
            "'residual' has dtype torch.float64",
        ),
        (
            lambda: norm.batch_norm(
                randn(2, 3, 4), None, None, training=True, activation="silu", residual=randn(2, 3, 4)
            ),
            ValueError,
            "activation='silu' with a residual is not supported",
        ),
        (lambda: norm.instance_norm(randn(2, 3)), ValueError, "dimensions"),
        (
            lambda: norm.instance_norm(randn(2, 3, 4), use_input_stats=False),
            ValueError,
            "required when use_input_stats",
        ),
        (
            lambda: norm.batch_norm_apply(randn(2, 3, 4), randn(3), randn(3), randn(3), 0),
            ValueError,
            "'count'=0",
        ),
    ],
)
def test_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_library_ops_pass_opcheck():
    x, w, b = _x(shape=(2, 4, 3, 3)), randn(4), randn(4)
    torch.library.opcheck(G._forward.op, (x, w, b, 2, 1e-5, -1, 0.0, 0.0))
    _, mean, rstd = G._forward(x, w, b, 2, 1e-5, -1, 0.0, 0.0)
    torch.library.opcheck(
        G._backward.op, (randn(2, 4, 3, 3), x, w, b, mean, rstd, 2, -1, 0.0, 0.0, True, True)
    )
    rm, rv = torch.zeros(4, device=DEVICE), torch.ones(4, device=DEVICE)
    torch.library.opcheck(B._forward.op, (x, w, b, rm, rv, None, True, 0.1, 1e-5, -1, 0.0, 0.0))
    torch.library.opcheck(
        B._forward.op, (x, w, b, None, None, randn(2, 4, 3, 3), True, 0.1, 1e-5, 0, 0.0, math.inf)
    )
    _, mean, rstd = B._forward(x, w, b, None, None, None, True, 0.1, 1e-5, -1, 0.0, 0.0)
    torch.library.opcheck(
        B._backward.op, (randn(2, 4, 3, 3), x, w, b, mean, rstd, True, -1, 0.0, 0.0, True, True)
    )


def test_torch_compile_fullgraph():
    # The output is weighted by r: the gradient of a plain sum through batch norm is zero up to
    # rounding, which would compare noise against noise.
    r = randn(2, 4, 3, 3)

    def ours(x, w, b):
        return (
            norm.batch_norm(norm.group_norm(x, 2, w, b, activation="silu"), None, None, w, b, True) * r
        ).sum()

    def theirs(x, w, b):
        return (F.batch_norm(F.silu(F.group_norm(x, 2, w, b)), None, None, w, b, True) * r.to(x.dtype)).sum()

    compiled = torch.compile(ours, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    x, w, b = _x(shape=(2, 4, 3, 3)), randn(4), randn(4)
    one = torch.ones((), device=DEVICE)
    got = _grads(compiled, [x, w, b], [one])[1]
    torch_fp32 = _grads(theirs, [x, w, b], [one])[1]
    want = _grads(theirs, [x.double(), w.double(), b.double()], [one.double()])[1]
    for a, c, t in zip(got, want, torch_fp32):
        assert_close(a, c, t)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_large(layout):
    x, w, b, dy = (
        _x(shape=(32, 64, 56, 56), dtype=torch.bfloat16, layout=layout),
        randn(64),
        randn(64),
        randn(32, 64, 56, 56, dtype=torch.bfloat16),
    )
    _compare(
        lambda x, w, b: norm.batch_norm(x, None, None, w, b, True),
        lambda x, w, b: F.batch_norm(x, None, None, w.to(x.dtype), b.to(x.dtype), True),
        [x, w, b],
        [dy],
        "bn",
    )
    _compare(
        lambda x, w, b: norm.group_norm(x, 32, w, b),
        lambda x, w, b: F.group_norm(x, 32, w.to(x.dtype), b.to(x.dtype)),
        [x, w, b],
        [dy],
        "gn",
    )


def test_backward_reduce_and_apply_split_matches_batch_norm():
    """The backward's two halves as SyncBatchNorm calls them, with the sums pre-divided."""
    x = _x(shape=(5, 6, 3, 4), offset=20.0).to(memory_format=torch.channels_last)
    w, dy = randn(6), randn(5, 6, 3, 4)
    total, total_sq, shift, count = norm.batch_norm_stats(x)
    _, mean, invstd = norm.batch_norm_apply(x, total, total_sq, shift, count, w)
    sum_dy, sum_dy_xhat = norm.batch_norm_backward_reduce(dy, x, mean, invstd, w)
    dx = norm.batch_norm_backward_apply(dy, x, mean, invstd, w, sum_dy / count, sum_dy_xhat / count, 1.0)
    wide = [t.double().requires_grad_(True) for t in (x, w)]
    F.batch_norm(wide[0], None, None, wide[1], None, training=True).backward(dy.double())
    same = [t.detach().requires_grad_(True) for t in (x, w)]
    F.batch_norm(same[0], None, None, same[1], None, training=True).backward(dy)
    assert_close(dx, wide[0].grad, same[0].grad, "dx")
    assert_close(sum_dy_xhat, wide[1].grad, same[1].grad, "dweight")
    assert_close(sum_dy, dy.double().sum((0, 2, 3)), dy.sum((0, 2, 3)), "dbias")
    with pytest.raises(ValueError, match="'count'"):
        norm.batch_norm_backward_apply(dy, x, mean, invstd, w, sum_dy, sum_dy_xhat, 0.0)
    with pytest.raises(ValueError, match="grad_output"):
        norm.batch_norm_backward_reduce(dy[:, :3], x, mean, invstd, w)
