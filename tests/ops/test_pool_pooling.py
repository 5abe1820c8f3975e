"""max, average and adaptive pooling (1-D, 2-D, 3-D): values, indices and every gradient against
float64, NCHW and channels_last, each engine, NaN and tie rules, determinism, ops and errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_norm_layer import _compare, _grads

import tritondnn.ops.pool as pool
from helpers import DEVICE, ON_GPU, assert_close, randn
from tritondnn.core.config import config
from tritondnn.ops.pool import pooling

LAYOUTS = {"nchw": lambda t: t, "channels_last": lambda t: t.to(memory_format=torch.channels_last)}
LOW = (torch.float16, torch.bfloat16)


def _x(shape=(2, 3, 11, 9), dtype=torch.float32, layout="nchw"):
    return LAYOUTS[layout](randn(*shape, dtype=dtype))


def _check(name, x, *args, what="", keeps_torch_strides=True, **kwargs):
    """``tdnn.<name>`` against ``F.<name>`` with the same arguments: values and the input gradient
    against float64, indices equal to PyTorch's (same dtype), the output in PyTorch's layout."""
    ours, ref = getattr(pool, name), getattr(F, name)
    indices = kwargs.get("return_indices", False) or (len(args) > 5 and args[5] is True and "max" in name)
    first = (lambda out: out[0]) if indices else (lambda out: out)
    y_ref = ref(x, *args, **kwargs)
    dy = randn(*first(y_ref).shape, dtype=x.dtype)
    ours_1 = lambda t: first(ours(t, *args, **kwargs))
    # PyTorch 2.11's CUDA avg_pool2d backward ignores the padding for channels_last inputs (its
    # gradient is shifted by it); the reference runs on a contiguous copy, which is the same math.
    ref_1 = lambda t: first(ref(t.contiguous(), *args, **kwargs))
    _compare(ours_1, ref_1, [x], [dy], f"{name} {what}")
    got = ours(x, *args, **kwargs)
    if indices:
        assert got[1].dtype == torch.int64 and torch.equal(got[1], y_ref[1]), f"{name} {what}: indices"
        assert got[1].stride() == got[0].stride()
    if keeps_torch_strides:
        assert first(got).stride() == first(y_ref).stride(), f"{name} {what}: layout"
    return first(got)


GEOMETRIES = {  # (kernel_size, stride, padding, dilation, ceil_mode)
    "overlap 3/2 pad 1": (3, 2, 1, 1, False),
    "disjoint 2": (2, None, 0, 1, False),
    "rect dilated ceil": ((3, 2), (2, 1), (1, 0), (2, 3), True),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_max_pool2d(geometry, dtype, layout, poison):
    """fp32 returns the indices (int64, saved for the backward too); fp16/bf16 do not (the
    backward then reads int8 window offsets)."""
    x = _x(dtype=dtype, layout=layout)
    _check("max_pool2d", x, *GEOMETRIES[geometry], what=geometry, return_indices=dtype == torch.float32)


AVG = {  # (kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)
    "include pad": (3, 2, 1, False, True, None),
    "exclude pad ceil": (3, 2, 1, True, False, None),
    "rect ceil include pad": ((2, 3), (3, 2), (1, 1), True, True, None),
    "divisor": ((3, 2), 1, (1, 0), False, True, 5),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("variant", list(AVG))
def test_avg_pool2d(variant, dtype, layout, poison):
    _check("avg_pool2d", _x(dtype=dtype, layout=layout), *AVG[variant], what=variant)


@pytest.mark.parametrize("layout", ["ncdhw", "channels_last_3d"])
def test_pool3d(layout, poison):
    """Every 3-D pool keeps the input's memory format (PyTorch's CPU kernels keep channels_last_3d
    only in max_pool3d; the values are the same either way)."""
    fmt = torch.channels_last_3d if layout != "ncdhw" else torch.contiguous_format
    x = randn(2, 3, 5, 7, 6).to(memory_format=fmt)
    for name, args, kwargs in (
        ("max_pool3d", (3, (2, 1, 2), 1, (1, 2, 1), True), {"return_indices": True}),
        ("adaptive_max_pool3d", (3,), {"return_indices": True}),
        ("adaptive_avg_pool3d", ((2, None, 4),), {}),
        ("avg_pool3d", ((2, 3, 3), 2, 1, False, False), {}),
    ):
        y = _check(name, x, *args, keeps_torch_strides=False, **kwargs)
        assert y.is_contiguous(memory_format=fmt), name


def test_pool1d_and_unbatched_inputs(poison):
    x = randn(2, 3, 17, dtype=torch.float16)
    _check("max_pool1d", x, 4, 3, 2, 2, True, return_indices=True)
    _check("avg_pool1d", x, 5, 2, 2, True, False)
    _check("adaptive_avg_pool1d", x, 5)
    _check("adaptive_max_pool1d", x, 6, return_indices=True)
    x = randn(3, 9, 8)  # (C, H, W)
    _check("max_pool2d", x, 3, 2, what="unbatched", return_indices=True)
    _check("adaptive_avg_pool2d", x, 2, what="unbatched")


ADAPTIVE = {"global": 1, "shrink 4x3": (4, 3), "grow 17x15": (17, 15), "keep rows": (None, 2)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("size", list(ADAPTIVE))
def test_adaptive_pool2d(size, layout, poison):
    out, x = ADAPTIVE[size], _x(layout=layout)
    _check("adaptive_avg_pool2d", x, out, what=size)
    _check("adaptive_max_pool2d", x, out, what=size)
    _check("adaptive_max_pool2d", x, out, what=size, return_indices=True)


def test_sliced_input_is_read_in_place(poison):
    big = randn(2, 4, 12, 22)
    x = big[:, 1:, :, ::2]  # strided in W and C
    _check("max_pool2d", x, 3, 2, 1, what="sliced")
    _check("avg_pool2d", x, 2, 1, what="sliced")
    x = big[:, 1:, :, 3:14]  # rows of 11 of 22: positions not evenly strided
    _check("adaptive_max_pool2d", x, 1, what="sliced global")
    _check("adaptive_avg_pool2d", x, 1, what="sliced global")
    y = x[:, :, :1, :1]
    assert not pooling._problem(False, True, True, 0, True, False, x.dtype, x, y, y, (1, 1), (12, 11),
                                (1, 1), (0, 0), (1, 1)).flat  # fmt: skip


def test_output_gradient_of_any_layout():
    """dy expanded (from a sum) or channels_last for a contiguous output: read through its strides."""
    x = _x(layout="channels_last").requires_grad_(True)
    (dx,) = torch.autograd.grad(pool.max_pool2d(x, 3, 2, 1).sum(), x)
    xr = x.detach().double().requires_grad_(True)
    (dx_ref,) = torch.autograd.grad(F.max_pool2d(xr, 3, 2, 1).sum(), xr)
    assert_close(dx, dx_ref)
    assert dx.stride() == x.stride()
    x = _x().requires_grad_(True)
    y = pool.avg_pool2d(x, 3, 2, 1)
    dy = randn(*y.shape).to(memory_format=torch.channels_last)
    (dx,) = torch.autograd.grad(y, x, dy)
    xr = x.detach().double().requires_grad_(True)
    (dx_ref,) = torch.autograd.grad(F.avg_pool2d(xr, 3, 2, 1), xr, dy.double())
    assert_close(dx, dx_ref)
    assert dx.is_contiguous()


@pytest.mark.parametrize("engine", ["plane", "unrolled", "direct", "window-reduce"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_engine_matches_pytorch_bit_for_bit(engine, layout, monkeypatch):
    """NaN (the last NaN's index wins), -inf windows, ties (the first maximum wins), in each engine;
    window-reduce runs forward only, so "direct" runs its backward; plane declines adaptive
    windows of varying size, which "unrolled" then runs."""
    names = {"window-reduce": [engine, "direct"], "plane": [engine, "unrolled"]}.get(engine, [engine])
    monkeypatch.setattr(pooling.FAMILY, "engines", [e for e in pooling.FAMILY.engines if e.name in names])
    monkeypatch.setattr(pooling.FAMILY, "_plans", {})
    monkeypatch.setattr(pooling.FAMILY, "_chosen", {})
    monkeypatch.setattr(pooling.WindowReduceEngine, "cost", lambda self, p: 0.0)
    monkeypatch.setattr(pooling.PlaneEngine, "cost", lambda self, p: 0.0)
    x = randn(2, 3, 6, 7)
    x[0, 1, 2, 3] = x[1, 2, 4, 4] = x[1, 2, 4, 5] = float("nan")
    x[0, 0, :4, :4] = float("-inf")
    x[1, 1] = x[1, 1].round()  # ties
    x = LAYOUTS[layout](x)
    for name, args in (
        ("max_pool2d", (3, 2, 1, 1, False, True)),
        ("max_pool2d", (3, 2, 1)),  # the value alone: no indices tracked
        ("max_pool2d", (3, 1, 1, 2, True, True)),
        ("adaptive_max_pool2d", ((3, 4), True)),
        ("avg_pool2d", (3, 2, 1, True, False)),
        ("adaptive_avg_pool2d", ((3, 4),)),
    ):
        # PyTorch's CPU kernels are the reference: its CUDA channels_last max-pool kernel breaks
        # NaN and tie cases differently from its own NCHW and CPU kernels.
        got, want = getattr(pool, name)(x, *args), getattr(F, name)(x.cpu(), *args)
        if isinstance(got, tuple):
            assert torch.equal(got[1].cpu(), want[1]), f"{engine} {name} indices"
            got, want = got[0], want[0]
        assert torch.allclose(got.cpu(), want, rtol=1e-6, atol=1e-6, equal_nan=True), f"{engine} {name}"
    half = x.to(torch.bfloat16)  # bf16 maxima may be taken two lanes at a time
    got, want = pool.max_pool2d(half, 3, 2, 1), F.max_pool2d(half.cpu().float(), 3, 2, 1)
    assert torch.allclose(got.cpu().float(), want, rtol=0, atol=0, equal_nan=True), f"{engine} bf16"
    clean = LAYOUTS[layout](randn(2, 3, 6, 7))
    _check("max_pool2d", clean, 3, 2, 1, what=engine)
    _check("adaptive_avg_pool2d", clean, 2, what=engine)
    assert {choice.engine.name for choice in pooling.FAMILY._chosen.values()} == set(names)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_window_reduce_splits_few_windows(layout):
    """Global pooling: several programs share each window, their partial results merge in tap
    order (ties keep the first maximum; the last NaN wins, here across programs)."""
    x = randn(2, 3, 40, 41)
    x[0, 1, 5, 6] = x[0, 1, 30, 2] = float("nan")
    x[1, 2] = x[1, 2].round()  # ties, in every program of the window
    x = LAYOUTS[layout](x)
    problem = pooling._problem(False, True, True, 2, True, False, x.dtype, x, x[:, :, :1, :1],
                               x[:, :, :1, :1], (1, 1), (40, 41), (1, 1), (0, 0), (1, 1))  # fmt: skip
    config = pooling.WindowReduceEngine().configs(problem)[0]
    assert problem.taps > config["CHUNK"]  # more than one program per window
    for name, args in (("adaptive_max_pool2d", (1, True)), ("adaptive_max_pool2d", (1,)),
                       ("adaptive_avg_pool2d", (1,))):  # fmt: skip
        got, want = getattr(pool, name)(x, *args), getattr(F, name)(x.cpu(), *args)
        if isinstance(got, tuple):
            assert torch.equal(got[1].cpu(), want[1]), name
            got, want = got[0], want[0]
        assert torch.allclose(got.cpu(), want, rtol=1e-5, atol=1e-6, equal_nan=True), name
    clean = LAYOUTS[layout](randn(2, 3, 40, 41))
    _check("adaptive_max_pool2d", clean, 1)
    _check("adaptive_avg_pool2d", clean, 1)
    ours = [c for (p, _), c in pooling.FAMILY._chosen.items() if not p.backward and p.in_size == (1, 40, 41)]
    assert {c.engine.name for c in ours} == {"window-reduce"}


def test_engine_reasons_and_choice():
    image = randn(2, 3, 24, 24)
    contiguous = {r.name: r for r in pooling.FAMILY.report(pooling.FAMILY.describe(image, 3, 2))}
    assert contiguous["plane"].chosen and contiguous["direct"].supported
    grow = {r.name: r for r in pooling.FAMILY.report(pooling._problem(
        True, False, True, 0, True, False, image.dtype, image, randn(2, 3, 37, 30), randn(2, 3, 37, 30),
        (37, 30), (1, 1), (1, 1), (0, 0), (1, 1)))}  # fmt: skip
    assert not grow["plane"].supported and "adaptive" in grow["plane"].reasons[0] and grow["unrolled"].chosen
    cl = image.to(memory_format=torch.channels_last)
    assert {r.name: r for r in pooling.FAMILY.report(pooling.FAMILY.describe(cl, 3, 2))}["unrolled"].chosen
    big = {r.name: r for r in pooling.FAMILY.report(pooling.FAMILY.describe(randn(1, 2, 20, 20), 9, 9))}
    assert not big["unrolled"].supported and "81 taps" in big["unrolled"].reasons[0]
    assert big["window-reduce"].chosen
    backward = pooling.FAMILY.describe(randn(1, 2, 20, 20), 2, 1, backward=True)
    reports = {r.name: r for r in pooling.FAMILY.report(backward)}
    assert not reports["window-reduce"].supported and "forward" in reports["window-reduce"].reasons[0]
    assert reports["plane"].chosen


def test_large_window_indices_and_gradients(poison):
    """Windows over 127 taps save int64 indices for the backward (int8 offsets below that)."""
    x = _x(shape=(2, 3, 12, 13), layout="channels_last")
    _check("adaptive_max_pool2d", x, 1)
    _check("max_pool2d", x, (12, 11), 1)
    assert_close(pool.adaptive_avg_pool2d(x, 1), pool.adaptive_avg_pool_reference(x, 2, 1))
    assert_close(pool.avg_pool2d(x, (12, 11), 1), pool.avg_pool_reference(x, 2, (12, 11), 1))


def test_indices_work_with_max_unpool():
    x = randn(2, 3, 10, 9)
    ours = F.max_unpool2d(*pool.max_pool2d(x, 2, return_indices=True), 2, output_size=x.shape[2:])
    assert torch.equal(
        ours, F.max_unpool2d(*F.max_pool2d(x, 2, return_indices=True), 2, output_size=x.shape[2:])
    )
    ours = F.max_unpool1d(*pool.max_pool1d(x[:, 0], 3, 2, return_indices=True), 3, 2)
    assert torch.equal(ours, F.max_unpool1d(*F.max_pool1d(x[:, 0], 3, 2, return_indices=True), 3, 2))


def test_nan_propagates_as_pytorch(poison):
    x = randn(1, 2, 6, 6)
    x[0, 0, 1, 1] = float("nan")
    for ours, ref in (
        (
            pool.max_pool2d(x, 3, 1, 1, return_indices=True),
            pool.max_pool_reference(x, 2, 3, 1, 1, return_indices=True),
        ),
        (pool.adaptive_max_pool2d(x, 1, True), pool.adaptive_max_pool_reference(x, 2, 1, True)),
    ):
        assert torch.equal(torch.isnan(ours[0]), torch.isnan(ref[0])) and torch.equal(ours[1], ref[1])
        assert_close(ours[0], ref[0])
    xg = x.clone().requires_grad_(True)
    (dx,) = torch.autograd.grad(pool.max_pool2d(xg, 3, 1, 1).sum(), xg)
    assert dx[0, 0, 1, 1] == 9 and dx[0, 0].sum() == 36  # the NaN took every window it lies in


def test_gradcheck_float64():
    """Distinct values (no ties for max); fast mode: one random projection, a few evaluations."""
    x = (torch.randperm(2 * 2 * 5 * 6, device=DEVICE).double().view(2, 2, 5, 6) / 10).requires_grad_(True)
    for fn in (
        lambda t: pool.max_pool2d(t, 3, 2, 1, 1, True),
        lambda t: pool.avg_pool2d(t, 3, 2, 1, True, False),
        lambda t: pool.adaptive_max_pool2d(t, (3, 4)),
        lambda t: pool.adaptive_avg_pool2d(t, (4, 5)),
    ):
        assert torch.autograd.gradcheck(fn, (x,), fast_mode=True)


def test_deterministic_bits_twice():
    """Overlapping windows: several output gradients meet at one input, always in the same order."""
    x = _x(shape=(2, 8, 9, 9), layout="channels_last")
    dy = randn(2, 8, 9, 9)
    with config.flags(deterministic=True):
        for fn in (lambda t: pool.max_pool2d(t, 3, 1, 1), lambda t: pool.avg_pool2d(t, 5, 1, 2)):
            runs = [_grads(fn, [x], [dy])[1][0] for _ in range(2)]
            assert torch.equal(runs[0], runs[1])


def test_empty_batch():
    x = randn(0, 3, 8, 8)
    assert pool.max_pool2d(x, 2).shape == (0, 3, 4, 4)
    y, idx = pool.adaptive_max_pool2d(x, 3, True)
    assert y.shape == idx.shape == (0, 3, 3, 3)
    xg = x.clone().requires_grad_(True)
    (dx,) = torch.autograd.grad(pool.avg_pool2d(xg, 2).sum(), xg)
    assert dx.shape == x.shape


def _img(n=1, c=2):
    return randn(n, c, 4, 4)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: pool.max_pool2d(randn(2, 3, 4), 2, padding=2), ValueError, "'padding'=.* at most half"),
        (lambda: pool.max_pool2d(_img(2, 3), 0), ValueError, "'kernel_size'=.* must be positive"),
        (lambda: pool.max_pool2d(_img(2, 3), 2, stride=0), ValueError, "'stride'=.* must be positive"),
        (lambda: pool.max_pool2d(_img(2, 3), 2, dilation=0), ValueError, "'dilation'"),
        (lambda: pool.max_pool2d(_img(2, 3), 2, padding=-1), ValueError, "'padding'=.* non-negative"),
        (lambda: pool.max_pool2d(_img(2, 3), (2, 2, 2)), ValueError, "'kernel_size'=.* tuple of 2"),
        (lambda: pool.max_pool2d(_img(2, 3), 2.0), TypeError, "'kernel_size' must be an int"),
        (lambda: pool.max_pool2d(_img(2, 3), 5), ValueError, "output size .* too small"),
        (lambda: pool.max_pool2d(randn(4, 4), 2), ValueError, "'input' has 2 dimensions"),
        (lambda: pool.max_pool3d(randn(2, 3, 4), 2), ValueError, "'input' has 3 dimensions; accepted: 4..5"),
        (lambda: pool.max_pool1d(_img(2, 3), 2), ValueError, "dimensions"),
        (lambda: pool.max_pool2d(randn(2, 0, 4, 4), 2), ValueError, "empty non-batch dimension"),
        (lambda: pool.max_pool2d(_img().int(), 2), TypeError, "dtype"),
        (lambda: pool.max_pool2d([1.0], 2), TypeError, "must be a torch.Tensor"),
        (lambda: pool.max_pool2d(_img(), 2, ceil_mode=1), TypeError, "'ceil_mode'"),
        (lambda: pool.max_pool2d(_img(), 2, return_indices=None), TypeError, "'return_indices'"),
        (lambda: pool.avg_pool2d(_img(), 2, divisor_override=0), ValueError, "'divisor_override'"),
        (lambda: pool.avg_pool2d(_img(), 2, divisor_override=1.5), TypeError, "'divisor_override'"),
        (lambda: pool.avg_pool2d(_img(), 2, count_include_pad=None), TypeError, "'count_include_pad'"),
        (lambda: pool.adaptive_avg_pool2d(_img(), 0), ValueError, "'output_size'=0 must be positive"),
        (lambda: pool.adaptive_avg_pool2d(_img(), (2, 2, 2)), ValueError, "'output_size'"),
        (lambda: pool.adaptive_max_pool2d(_img(), (2, 1.5)), TypeError, "'output_size' must hold ints"),
    ],
)
def test_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_library_ops_pass_opcheck():
    x = _x(shape=(2, 3, 7, 6), layout="channels_last")
    regular = ([3, 3], [2, 2], [1, 1], [1, 1])
    torch.library.opcheck(pooling.pool_forward.op, (x, [3, 3], *regular, False, True, False, 0, 2))
    torch.library.opcheck(pooling.pool_forward.op, (x, [2, 4], [], [], [], [], True, False, False, 0, 0))
    y, idx = pooling.pool_forward(x, [3, 3], *regular, False, True, False, 0, 2)
    dy = randn(*y.shape)
    shape = list(x.shape)
    torch.library.opcheck(
        pooling.pool_backward.op, (dy, idx, shape, *regular, False, True, False, 0, 2, True)
    )
    torch.library.opcheck(
        pooling.pool_backward.op, (dy, None, shape, *regular, False, False, True, 3, 0, False)
    )


def test_torch_compile_fullgraph():
    def f(x):
        y = pool.max_pool2d(x, 3, 2, 1) + pool.avg_pool2d(x, 3, 2, 1, count_include_pad=False)
        return pool.adaptive_avg_pool2d(y, 2).sum() + pool.adaptive_max_pool2d(y, 3).sum()

    def ref(x):
        y = F.max_pool2d(x, 3, 2, 1) + F.avg_pool2d(x, 3, 2, 1, count_include_pad=False)
        return F.adaptive_avg_pool2d(y, 2).sum() + F.adaptive_max_pool2d(y, 3).sum()

    compiled = torch.compile(f, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    x, one = _x(shape=(2, 3, 9, 8)), torch.ones((), device=DEVICE)
    got, dgot = _grads(compiled, [x], [one])
    want, dwant = _grads(ref, [x.double()], [one.double()])
    assert_close(got[0], want[0])
    assert_close(dgot[0], dwant[0])


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_large(layout):
    x = _x(shape=(32, 64, 112, 112), dtype=torch.bfloat16, layout=layout)
    _check("max_pool2d", x, 3, 2, 1)
    _check("avg_pool2d", x, 3, 2, 1)
    _check("adaptive_avg_pool2d", x, 1)
