"""interpolate (nearest, linear, bilinear, trilinear) and local_response_norm: values and input
gradients against float64, NCHW and channels_last, determinism, ops and errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_norm_layer import _compare, _grads

import tritondnn.ops.pool as pool
from helpers import DEVICE, ON_GPU, assert_close, randn
from tritondnn.core.config import config
from tritondnn.ops.pool import lrn, resample

LAYOUTS = {"nchw": lambda t: t, "channels_last": lambda t: t.to(memory_format=torch.channels_last)}


def _check(fn, x, what, **kwargs):
    """``tdnn.<fn>`` against ``F.<fn>`` with the same keyword arguments: the output and the input
    gradient against float64, and PyTorch's output layout."""
    ours = lambda t: getattr(pool, fn)(t, **kwargs)
    ref = lambda t: getattr(F, fn)(t, **kwargs)
    y_ref = ref(x)
    _compare(ours, ref, [x], [randn(*y_ref.shape, dtype=x.dtype)], what)
    assert ours(x).stride() == y_ref.stride(), f"{what}: layout"


# Sizes and factors where PyTorch's CPU and CUDA kernels agree index for index (the CUDA kernels
# compute nearest indices in fp32 at every dtype; the CPU ones in fp64 for fp64 inputs).
RESIZES = {
    "x2": {"scale_factor": 2},
    "x1.7": {"scale_factor": 1.7},
    "down to 5x4": {"size": (5, 4)},
    "up to 8x17": {"size": (8, 17)},
    "x(0.5, 2.5) recomputed": {"scale_factor": (0.5, 2.5), "recompute_scale_factor": True},
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("resize", list(RESIZES))
def test_nearest2d(resize, layout, poison):
    x = LAYOUTS[layout](randn(2, 3, 7, 6))
    _check("interpolate", x, resize, **RESIZES[resize])


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("align_corners", [False, True])
@pytest.mark.parametrize("resize", list(RESIZES))
def test_bilinear(resize, align_corners, layout, poison):
    x = LAYOUTS[layout](randn(2, 3, 7, 6))
    kwargs = {**RESIZES[resize], "mode": "bilinear", "align_corners": align_corners}
    if align_corners and "scale_factor" in kwargs:
        kwargs["recompute_scale_factor"] = True  # PyTorch warns otherwise; the sizes decide anyway
    _check("interpolate", x, f"{resize} align_corners={align_corners}", **kwargs)


@pytest.mark.parametrize("engine", ["direct", "plane"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_engine(engine, layout, monkeypatch):
    """Each engine forward and backward, whatever the heuristic prefers for the layout; direct's
    backward unrolls up to 64 outputs reading one input and loops over more (10 x 10 here),
    plane's always loops."""
    monkeypatch.setattr(resample.FAMILY, "engines", [e for e in resample.FAMILY.engines if e.name == engine])
    monkeypatch.setattr(resample.FAMILY, "_plans", {})
    monkeypatch.setattr(resample.FAMILY, "_chosen", {})
    x = LAYOUTS[layout](randn(2, 3, 5, 6))
    _check("interpolate", x, f"{engine} nearest x2", scale_factor=2)
    _check("interpolate", x, f"{engine} bilinear", size=(7, 13), mode="bilinear")
    _check("interpolate", x, f"{engine} nearest runs of 10 x 10", size=(50, 60))
    _check("interpolate", randn(2, 3, 4, 5, 3), f"{engine} trilinear", size=(6, 4, 7), mode="trilinear")
    assert {c.engine.name for c in resample.FAMILY._chosen.values()} == {engine}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mode", ["nearest", "bilinear"])
def test_low_precision(mode, dtype, poison):
    x = LAYOUTS["channels_last"](randn(2, 4, 5, 7, dtype=dtype))
    _check("interpolate", x, f"{mode} {dtype}", scale_factor=2, mode=mode)


def test_1d_and_3d(poison):
    x = randn(2, 3, 9)
    _check("interpolate", x, "nearest 1d", scale_factor=2.5)
    _check("interpolate", x, "linear 1d", size=4, mode="linear")
    _check("interpolate", x, "linear 1d corners", size=13, mode="linear", align_corners=True)
    x = randn(1, 2, 3, 4, 5).to(memory_format=torch.channels_last_3d)
    _check("interpolate", x, "nearest 3d", size=(5, 3, 7))
    _check("interpolate", x, "trilinear", scale_factor=(1.5, 1, 0.6), mode="trilinear")


def test_edge_sizes(poison):
    """One-pixel inputs and outputs, and an unchanged size (a copy, as PyTorch's kernels)."""
    _check("interpolate", randn(1, 2, 1, 3), "from one row", size=(4, 3), mode="bilinear")
    _check("interpolate", randn(1, 2, 5, 3), "to one pixel", size=1, mode="bilinear", align_corners=True)
    _check("interpolate", randn(1, 2, 4, 3), "unchanged", scale_factor=1.1, mode="bilinear")
    x = randn(1, 2, 4, 3)
    x[0, 0, 1, 1] = float("inf")  # a copy leaves its neighbours finite (0 * inf would not)
    assert torch.equal(pool.interpolate(x, scale_factor=1.2, mode="bilinear"), x)


def test_deterministic_bits_twice():
    x, dy = randn(2, 4, 9, 7), randn(2, 4, 20, 15)
    with config.flags(deterministic=True):
        fn = lambda t: pool.interpolate(t, size=(20, 15), mode="bilinear")
        runs = [_grads(fn, [x], [dy])[1][0] for _ in range(2)]
    assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("size", [1, 2, 5])
def test_local_response_norm(size, layout, poison):
    x = LAYOUTS[layout](randn(2, 7, 5, 4, scale=3.0))
    _check("local_response_norm", x, f"size {size}", size=size, alpha=0.3, beta=0.75, k=2.0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_local_response_norm_low_precision(dtype, poison):
    """3-D, channels innermost (PyTorch's CPU LRN of 4-D fp16/bf16 needs avg_pool3d, which it lacks)."""
    x = randn(2, 15, 6, dtype=dtype, scale=3.0).transpose(1, 2)
    _check("local_response_norm", x, str(dtype), size=3)


def test_local_response_norm_ranks(poison):
    _check("local_response_norm", randn(3, 5, 7), "3d", size=4, alpha=0.5)
    _check("local_response_norm", randn(2, 3, 2, 3, 4), "5d", size=3, alpha=0.5, beta=1.5)
    x = randn(2, 6, 4, 5)[:, ::2]  # channels do not merge with the rest: read through strides
    _check("local_response_norm", x, "sliced", size=3, alpha=0.5)


def test_gradcheck_float64():
    x = randn(1, 3, 3, 4, dtype=torch.float64).requires_grad_(True)
    for fn in (
        lambda t: pool.interpolate(t, scale_factor=1.5, mode="bilinear"),
        lambda t: pool.interpolate(t, size=(4, 7), mode="bilinear", align_corners=True),
        lambda t: pool.interpolate(t, size=(5, 9)),
        lambda t: pool.local_response_norm(t, 2, alpha=0.5, beta=0.6, k=1.5),
    ):
        assert torch.autograd.gradcheck(fn, (x,), fast_mode=True)


def test_float64_scalars_keep_their_digits():
    """fp64 problems interpolate with fp64 tables and pass LRN's scalars as (hi, lo) fp32 pairs
    (kernels take fp32 scalars), so 1 / 1.3 and alpha keep their digits."""
    x = randn(1, 2, 5, 6, dtype=torch.float64)
    ref = pool.interpolate_reference(x, scale_factor=1.3, mode="bilinear")
    assert_close(pool.interpolate(x, scale_factor=1.3, mode="bilinear"), ref)
    assert_close(
        pool.local_response_norm(x, 2, alpha=0.1), pool.local_response_norm_reference(x, 2, alpha=0.1)
    )


def test_empty_batch():
    x = randn(0, 3, 4, 4)
    assert pool.interpolate(x, scale_factor=2, mode="bilinear").shape == (0, 3, 8, 8)
    assert pool.local_response_norm(x, 3).shape == x.shape


def _img():
    return randn(1, 2, 4, 4)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: pool.interpolate(_img(), scale_factor=2, mode="bicubic"), ValueError, "'mode'='bicubic'"),
        (
            lambda: pool.interpolate(randn(1, 2, 4), scale_factor=2, mode="bilinear"),
            ValueError,
            "needs a 4-D input",
        ),
        (lambda: pool.interpolate(_img(), size=3, scale_factor=2), ValueError, "exactly one of"),
        (lambda: pool.interpolate(_img()), ValueError, "exactly one of"),
        (lambda: pool.interpolate(_img(), scale_factor=0.1), ValueError, "output size .* positive"),
        (lambda: pool.interpolate(_img(), scale_factor=-2.0), ValueError, "'scale_factor'"),
        (lambda: pool.interpolate(_img(), scale_factor=(2, 2, 2)), TypeError, "'scale_factor'"),
        (lambda: pool.interpolate(_img(), size=(2, 0)), ValueError, "output size"),
        (lambda: pool.interpolate(_img(), size=2.5), TypeError, "'size'"),
        (lambda: pool.interpolate(_img(), size=2, align_corners=True), ValueError, "'align_corners'"),
        (lambda: pool.interpolate(_img(), size=2, mode="bilinear", antialias=True), ValueError, "antialias"),
        (lambda: pool.interpolate(randn(2, 4), size=2), ValueError, "'input' has 2 dimensions"),
        (lambda: pool.interpolate(_img().int(), size=2), TypeError, "dtype"),
        (lambda: pool.local_response_norm(randn(2, 3), 2), ValueError, "'input' has 2 dimensions"),
        (lambda: pool.local_response_norm(randn(2, 3, 4), 0), ValueError, "'size'=0"),
        (lambda: pool.local_response_norm(randn(2, 3, 4), 2, alpha=float("nan")), ValueError, "'alpha'"),
        (lambda: pool.local_response_norm(randn(2, 3, 4), 2, beta="x"), TypeError, "'beta'"),
    ],
)
def test_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_library_ops_pass_opcheck():
    x = LAYOUTS["channels_last"](randn(2, 3, 5, 4))
    ratios = [5 / 7, 4 / 9]
    torch.library.opcheck(resample.resample_forward.op, (x, [7, 9], True, False, ratios))
    dy = randn(2, 3, 7, 9)
    torch.library.opcheck(resample.resample_backward.op, (dy, list(x.shape), True, True, False, ratios))
    torch.library.opcheck(lrn.lrn_forward.op, (x, 3, 1e-2, 0.75, 1.0, True))
    _, scale = lrn.lrn_forward(x, 3, 1e-2, 0.75, 1.0, True)
    torch.library.opcheck(lrn.lrn_backward.op, (randn(2, 3, 5, 4), x, scale, 3, 1e-2, 0.75))


def test_torch_compile_fullgraph():
    def f(x, mod):
        y = mod.local_response_norm(x, 3, alpha=0.5)
        return (
            mod.interpolate(y, scale_factor=2, mode="bilinear") + mod.interpolate(y, scale_factor=2)
        ).sum()

    compiled = torch.compile(
        lambda x: f(x, pool), fullgraph=True, backend="inductor" if ON_GPU else "aot_eager"
    )
    x, one = randn(2, 3, 4, 5), torch.ones((), device=DEVICE)
    got, dgot = _grads(compiled, [x], [one])
    want, dwant = _grads(lambda t: f(t, F), [x.double()], [one.double()])
    assert_close(got[0], want[0])
    assert_close(dgot[0], dwant[0])


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_large(layout):
    x = LAYOUTS[layout](randn(16, 64, 56, 56, dtype=torch.bfloat16))
    _check("interpolate", x, "bilinear", scale_factor=2, mode="bilinear")
    _check("interpolate", x, "nearest", scale_factor=2)
    _check("local_response_norm", x, "lrn", size=5)
