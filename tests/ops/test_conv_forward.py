"""Convolution forward: every engine against the float64 reference, layouts, padding forms,
groups, dilation, 1-D/2-D/3-D, the fused epilogue, conv_transpose, engine selection and bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tritondnn as tdnn
from helpers import DEVICE, assert_close
from tritondnn.ops import conv
from tritondnn.ops.conv import conv_backward_reference, conv_reference, conv_transpose_reference
from tritondnn.ops.epilogue import Epilogue

FNS = {1: conv.conv1d, 2: conv.conv2d, 3: conv.conv3d}
TFNS = {1: conv.conv_transpose1d, 2: conv.conv_transpose2d, 3: conv.conv_transpose3d}
CL = {4: torch.channels_last, 5: torch.channels_last_3d}


def layout(t: torch.Tensor, name: str) -> torch.Tensor:
    if name == "contiguous":
        return t
    if name == "channels_last":  # NLC / NHWC / NDHWC, read in place
        return t.movedim(1, -1).contiguous().movedim(-1, 1)
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)  # any other strides


def pairs(padding, nd):
    if isinstance(padding, int):
        return ((padding, padding),) * nd
    return tuple(p if isinstance(p, tuple) else (p, p) for p in padding)


def torch_conv(x, w, b, stride, padding, dilation, groups):
    """PyTorch's result in x's dtype (fp32 compute for fp16 on CPU, as its kernels do)."""
    nd = x.ndim - 2
    pads = [v for p in reversed(pairs(padding, nd)) for v in p]
    xp = F.pad(x.float(), pads)
    y = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[nd](
        xp, w.float(), None if b is None else b.float(), stride, 0, dilation, groups
    )
    return y.to(x.dtype)


# (shape, cout, kernel, stride, padding, dilation, groups): odd sizes, asymmetric padding, groups.
CASES = [
    ((2, 5, 9, 7), 6, (3, 3), 1, 1, 1, 1),
    ((2, 6, 9, 8), 6, (3, 2), (2, 1), ((1, 0), (2, 1)), (1, 2), 2),
    ((1, 20, 6, 7), 17, (1, 1), 2, 0, 1, 1),
    ((3, 3, 11, 10), 8, (5, 5), 2, 2, 1, 1),
    ((2, 8, 13), 8, (5,), 3, ((2, 1),), 2, 4),
    ((1, 4, 5, 6, 7), 6, (3, 2, 3), (2, 1, 2), ((1, 1), (0, 1), (1, 0)), 1, 2),
]


def _run_case(case, engine, layout_name, dtype):
    shape, cout, kernel, stride, padding, dilation, groups = case
    nd = len(shape) - 2
    x = layout(torch.randn(shape, device=DEVICE, dtype=dtype), layout_name)
    w = torch.randn(cout, shape[1] // groups, *kernel, device=DEVICE, dtype=dtype) / 3
    b = torch.randn(cout, device=DEVICE, dtype=dtype)
    y = FNS[nd](x, w, b, stride, padding, dilation, groups, algo=engine)
    st = (stride,) * nd if isinstance(stride, int) else stride
    dl = (dilation,) * nd if isinstance(dilation, int) else dilation
    ref = conv_reference(x, w, b, st, pairs(padding, nd), dl, groups)
    assert_close(y, ref, torch_conv(x, w, b, st, padding, dl, groups), f"{engine} {case}")
    return x, y


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{len(c[0]) - 2}d-{c[0]}-g{c[6]}")
@pytest.mark.parametrize("engine", ["implicit_gemm", "im2col_gemm"])
def test_engines_fp32(case, engine, poison):
    _run_case(case, engine, "contiguous", torch.float32)


@pytest.mark.parametrize("case", CASES[:2] + CASES[4:], ids=str)
@pytest.mark.parametrize("layout_name", ["channels_last", "strided"])
def test_layouts_output_format(case, layout_name):
    x, y = _run_case(case, "implicit_gemm", layout_name, torch.float32)
    if x.stride(1) == 1:  # the output keeps the input's layout (channels innermost or not)
        assert y.stride(1) == 1 and y.movedim(1, -1).is_contiguous()
    else:
        assert y.is_contiguous()


@pytest.mark.parametrize("case", [CASES[0], CASES[3], CASES[4]], ids=str)
def test_fp16(case):
    _run_case(case, "implicit_gemm", "channels_last", torch.float16)


@pytest.mark.gpu_only("Triton's interpreter computes bf16 tl.dot wrongly")
@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("engine", ["implicit_gemm", "im2col_gemm"])
def test_bf16(case, engine):
    _run_case(case, engine, "channels_last", torch.bfloat16)


@pytest.mark.parametrize("layout_name", ["channels_last", "contiguous", "strided"])
@pytest.mark.parametrize(
    "case",
    [
        ((2, 3, 15, 14), 16, (7, 7), 2, 3, 1, 1),
        ((1, 5, 9, 10), 6, (3, 3), 1, 1, (2, 1), 1),
        ((2, 3, 20), 4, (5,), 2, 2, 1, 1),
    ],
    ids=str,
)
def test_few_channels_k_walks(case, layout_name):
    """Fewer input channels than a K step: channels-last inputs walk K by row windows (the W taps'
    channels side by side), contiguous ones too after a channels-last copy, other layouts by flat
    (tap, channel) gathers."""
    from tritondnn.ops.conv import describe_forward
    from tritondnn.ops.conv.engines import ImplicitGemmEngine, row_window, window_staged

    x, _ = _run_case(case, "implicit_gemm", layout_name, torch.float32)
    w = torch.empty(case[1], case[0][1], *case[2], device=DEVICE)
    problem = describe_forward(x, w, None, case[3], case[4], case[5])
    assert row_window(problem) == (x.stride(1) == 1)  # (a 1-D "strided" x is channels-last)
    assert window_staged(problem, ImplicitGemmEngine().configs(problem)[0]) == (layout_name == "contiguous")


def test_fp64_and_tf32():
    _run_case(CASES[1], "implicit_gemm", "contiguous", torch.float64)
    x = torch.randn(2, 16, 6, 6, device=DEVICE)
    w = torch.randn(8, 16, 3, 3, device=DEVICE)
    with tdnn.config.flags(allow_tf32=True):
        y = conv.conv2d(x, w, padding=1)
    ref = conv_reference(x, w, None, (1, 1), ((1, 1), (1, 1)), (1, 1), 1)
    # TF32 keeps 10 mantissa bits: about 1e-3 relative per product.
    assert (y.double() - ref).abs().max() <= 2e-3 * ref.abs().max() + 1e-3


@pytest.mark.parametrize("mult", [1, 2])
@pytest.mark.parametrize("layout_name", ["contiguous", "channels_last"])
def test_depthwise(mult, layout_name):
    case = ((2, 6, 9, 8), 6 * mult, (3, 3), (2, 1), ((1, 1), (1, 0)), (1, 2), 6)
    _run_case(case, "depthwise", layout_name, torch.float32)
    _run_case(((2, 5, 11), 5 * mult, (3,), 1, 1, 1, 5), "depthwise", layout_name, torch.float16)


@pytest.mark.parametrize(
    "case",
    [
        ((2, 6, 9, 8), 6, (3, 3), 1, 1, 1, 6),
        ((2, 6, 9, 8), 6, (3, 2), (2, 1), ((1, 0), (2, 1)), (1, 2), 6),
        ((1, 20, 7, 11), 20, (3, 3), (1, 2), ((3, 1), (0, 4)), 1, 20),
        ((2, 5, 13), 5, (5,), 3, ((2, 1),), 2, 5),
    ],
    ids=str,
)
def test_depthwise_rows(case):
    """The row-streaming engine: strides, dilations, asymmetric padding (wider than the taps reach
    on one side), strips and H chunks that end inside the image, 1-D."""
    _run_case(case, "depthwise_rows", "channels_last", torch.float32)
    _run_case(case, "depthwise_rows", "channels_last", torch.float16)


def test_depthwise_rows_epilogue():
    x = torch.randn(2, 8, 7, 9, device=DEVICE).to(memory_format=torch.channels_last)
    w = torch.randn(8, 1, 3, 3, device=DEVICE)
    b = torch.randn(8, device=DEVICE)
    r = torch.randn(2, 8, 7, 9, device=DEVICE).to(memory_format=torch.channels_last)
    epi = Epilogue(activation="silu", residual=True)
    y = conv.conv2d(x, w, b, padding=1, groups=8, algo="depthwise_rows", epilogue=epi, residual=r)
    ref = F.silu(conv_reference(x, w, b, (1, 1), ((1, 1), (1, 1)), (1, 1), 8)) + r.double()
    assert_close(y, ref)


@pytest.mark.parametrize("layout_name", ["contiguous", "channels_last"])
def test_depthwise_chosen_by_heuristic(layout_name):
    x = layout(torch.randn(2, 8, 6, 6, device=DEVICE), layout_name)
    w = torch.randn(8, 1, 3, 3, device=DEVICE)
    reports = {r.name: r for r in tdnn.engines("conv", x, w, None, 1, 1, 1, 8)}
    chosen = [name for name, r in reports.items() if r.chosen]
    assert chosen == ["depthwise_rows" if layout_name == "channels_last" else "depthwise"]
    if layout_name == "contiguous":
        assert "channels-last" in reports["depthwise_rows"].reasons[0]
    else:
        w5 = torch.randn(8, 1, 5, 5, device=DEVICE)
        reports = {r.name: r for r in tdnn.engines("conv", x, w5, None, 1, 2, 1, 8)}
        assert "taps" in reports["depthwise_rows"].reasons[0] and reports["depthwise"].chosen


def _tolerance_check(y, ref, torch_out, factor, rel):
    """Winograd and FFT: ``factor`` x PyTorch's own fp32 error plus ``rel`` relative (see their docs)."""
    scale = max(1.0, float(ref.abs().max()))
    torch_err = float((torch_out.double() - ref).abs().max())
    err = float((y.double() - ref).abs().max())
    assert err <= factor * torch_err + rel * scale, (err, torch_err)


@pytest.mark.parametrize("layout_name", ["contiguous", "channels_last"])
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("algo", ["winograd", "winograd_4x4"])
def test_winograd(algo, layout_name, groups):
    """F(2x2, 3x3) and F(4x4, 3x3) with the fused epilogue: uneven padding, a partial last tile in
    both directions (9 x 7 outputs), groups. Bounds: 20x PyTorch's own fp32 error plus 2e-5
    relative for F(2x2) (measured under 1x), 30x plus 1e-5 for F(4x4), whose transforms sum up to
    36 terms with coefficients up to 8 and 5 (B^T, A^T) and 1/24 (G) (measured 5-14x with 8-32
    channels); F(2x2) in fp16 within 4x plus 2e-3, F(4x4) refuses 16-bit."""
    x = layout(torch.randn(2, 8, 9, 7, device=DEVICE), layout_name)
    w = torch.randn(6, 8 // groups, 3, 3, device=DEVICE)
    b = torch.randn(6, device=DEVICE)
    padding = ((1, 0), (2, 1))
    epi = Epilogue(activation="relu")
    y = conv.conv2d(x, w, b, 1, padding, 1, groups, algo=algo, epilogue=epi)
    ref = F.relu(conv_reference(x, w, b, (1, 1), padding, (1, 1), groups))
    torch_out = F.relu(torch_conv(x, w, b, 1, padding, 1, groups))
    factor, rel = (20.0, 2e-5) if algo == "winograd" else (30.0, 1e-5)
    _tolerance_check(y, ref, torch_out, factor, rel)
    xh, wh, bh = x.half(), w.half(), b.half()
    if algo == "winograd_4x4":
        with pytest.raises(tdnn.NotSupportedError, match="16-bit"):
            conv.conv2d(xh, wh, None, 1, padding, 1, groups, algo=algo)
        return
    yh = conv.conv2d(xh, wh, bh, 1, padding, 1, groups, algo=algo)
    refh = conv_reference(xh, wh, bh, (1, 1), padding, (1, 1), groups)
    _tolerance_check(yh, refh, torch_conv(xh, wh, bh, 1, padding, 1, groups), 4.0, 2e-3)


def test_winograd_not_supported():
    x = torch.randn(1, 4, 6, 6, device=DEVICE)
    w = torch.randn(4, 4, 3, 3, device=DEVICE)
    with pytest.raises(tdnn.NotSupportedError, match="stride 1"):
        conv.conv2d(x, w, stride=2, algo="winograd")
    with pytest.raises(tdnn.NotSupportedError, match="3x3"):
        conv.conv2d(x, w[..., :2], algo="winograd")


@pytest.mark.parametrize("nd", [1, 2, 3])
def test_fft(nd):
    spatial = {1: (23,), 2: (12, 11), 3: (3, 4, 2)}[nd]
    kernel = {1: (9,), 2: (7, 7), 3: (2, 2, 2)}[nd]
    x = layout(torch.randn(2, 3, *spatial, device=DEVICE), "channels_last" if nd == 2 else "contiguous")
    w = torch.randn(5, 3, *kernel, device=DEVICE)
    b = torch.randn(5, device=DEVICE)
    dilation = (1,) * (nd - 1) + (2,)
    padding = ((3, 2),) * nd if nd < 3 else ((1, 0),) * nd
    y = FNS[nd](x, w, b, 1, padding, dilation, algo="fft", epilogue=Epilogue(activation="silu"))
    ref = F.silu(conv_reference(x, w, b, (1,) * nd, padding, dilation, 1))
    torch_out = F.silu(torch_conv(x, w, b, 1, padding, dilation, 1))
    _tolerance_check(y, ref, torch_out, 2.0, 1e-5 * w.shape[1] * w[0, 0].numel())
    with pytest.raises(tdnn.NotSupportedError, match="groups"):
        FNS[nd](x, w[:, :1].repeat(1, 1, *(1,) * nd)[:3].contiguous(), None, 1, 0, 1, 3, algo="fft")


@pytest.mark.parametrize("layout_name", ["contiguous", "channels_last"])
def test_epilogue_fused(layout_name, poison):
    x = layout(torch.randn(2, 6, 7, 6, device=DEVICE), layout_name)
    w = torch.randn(10, 6, 3, 3, device=DEVICE)
    b = torch.randn(10, device=DEVICE)
    c = torch.randn(2, 10, 4, 3, device=DEVICE)
    r = torch.randn(2, 10, 4, 3, device=DEVICE)
    for engine in ("implicit_gemm", "im2col_gemm"):
        epi = Epilogue(alpha=0.5, beta=2.0, activation="gelu", residual=True, store_preactivation=True)
        y, pre = conv.conv2d(x, w, b, 2, 1, algo=engine, epilogue=epi, c=c, residual=r)
        ref_pre = 0.5 * conv_reference(x, w, None, (2, 2), ((1, 1), (1, 1)), (1, 1), 1) + 2 * c.double()
        ref_pre = ref_pre + b.double().view(1, -1, 1, 1)
        assert_close(pre, ref_pre, what=f"{engine} pre")
        assert_close(y, F.gelu(ref_pre) + r.double(), what=f"{engine} out")
    y16 = conv.conv2d(x, w, b, 2, 1, epilogue=Epilogue(activation="relu", out_dtype=torch.float16))
    assert y16.dtype == torch.float16
    ref = F.relu(conv_reference(x, w, b, (2, 2), ((1, 1), (1, 1)), (1, 1), 1))
    assert_close(y16, ref, ref.half(), "out_dtype fp16")


@pytest.mark.parametrize("padding", ["same", "valid", 2, ((0, 3), (2, 0))])
def test_padding_forms(padding):
    x = torch.randn(2, 4, 7, 8, device=DEVICE)
    w = torch.randn(3, 4, 3, 4, device=DEVICE)
    y = conv.conv2d(x, w, None, 1, padding, (2, 1))
    expected = F.conv2d(x, w, None, 1, padding, (2, 1)) if isinstance(padding, (str, int)) else None
    pads = {"same": ((2, 2), (1, 2)), "valid": ((0, 0), (0, 0)), 2: ((2, 2), (2, 2))}.get(padding, padding)
    ref = conv_reference(x, w, None, (1, 1), pads, (2, 1), 1)
    assert_close(y, ref, expected)


def test_unbatched_and_empty():
    x = torch.randn(4, 9, device=DEVICE)
    w = torch.randn(5, 4, 3, device=DEVICE)
    y = conv.conv1d(x, w, padding=1)
    assert y.shape == (5, 9)
    assert_close(y, conv_reference(x[None], w, None, (1,), ((1, 1),), (1,), 1)[0])
    empty = conv.conv2d(torch.randn(0, 4, 5, 5, device=DEVICE), torch.randn(2, 4, 3, 3, device=DEVICE))
    assert empty.shape == (0, 2, 3, 3)


@pytest.mark.parametrize("nd", [1, 2, 3])
@pytest.mark.parametrize("engine", ["implicit_gemm", "depthwise"])
def test_conv_transpose(nd, engine, poison):
    groups = 4 if engine == "depthwise" else 2
    spatial = {1: (7,), 2: (5, 4), 3: (3, 4, 3)}[nd]
    x = torch.randn(2, 4, *spatial, device=DEVICE)
    if nd == 2:
        x = layout(x, "channels_last")
    cout_g = 1 if engine == "depthwise" else 3
    w = torch.randn(4, cout_g, *((3,) * nd), device=DEVICE)
    b = torch.randn(cout_g * groups, device=DEVICE)
    stride, padding, out_pad, dilation = (2,) * nd, (1,) * nd, (1,) * nd, (1,) * (nd - 1) + (2,)
    y = TFNS[nd](x, w, b, stride, padding, out_pad, groups, dilation, algo=engine)
    ref = conv_transpose_reference(x, w, b, stride, padding, out_pad, groups, dilation)
    torch_out = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}[nd](
        x, w, b, stride, padding, out_pad, groups, dilation
    )
    assert_close(y, ref, torch_out, f"conv_transpose{nd}d {engine}")


def test_conv_transpose_epilogue():
    x = torch.randn(1, 3, 4, 5, device=DEVICE)
    w = torch.randn(3, 4, 2, 2, device=DEVICE)
    r = torch.randn(1, 4, 8, 10, device=DEVICE)
    y = conv.conv_transpose2d(x, w, stride=2, epilogue=Epilogue(activation="tanh", residual=True), residual=r)
    ref = torch.tanh(conv_transpose_reference(x, w, None, (2, 2), (0, 0), (0, 0), 1, (1, 1))) + r.double()
    assert_close(y, ref)


def test_engines_report_and_forced(cache_dir):
    x = torch.randn(1, 4, 6, 6, device=DEVICE)
    w = torch.randn(4, 2, 3, 3, device=DEVICE)
    reports = {r.name: r for r in tdnn.engines("conv", x, w, None, 1, 1, 1, 2)}
    assert reports["implicit_gemm"].supported and reports["im2col_gemm"].supported
    assert not reports["depthwise"].supported and "groups" in reports["depthwise"].reasons[0]
    assert not reports["fft"].supported
    assert sum(r.chosen for r in reports.values()) == 1
    with pytest.raises(tdnn.NotSupportedError, match="depthwise"):
        conv.conv2d(x, w, groups=2, algo="depthwise")
    with pytest.raises(ValueError, match="algo"):
        conv.conv2d(x, w, groups=2, algo="nope")
    # Benchmark mode times every candidate and keeps the winner on disk (the data-gradient family:
    # the forward's im2col engine would autotune its matmul too, slow under the interpreter).
    dy = torch.randn(1, 4, 3, 3, device=DEVICE)
    dgrad_args = (dy, w, (1, 4, 6, 6), 2, 1, 1, 2)
    assert not any(r.tuned for r in tdnn.engines("conv_dgrad", *dgrad_args)), "nothing tuned yet"
    with tdnn.config.flags(benchmark=True):
        dx = conv.conv_backward_data(*dgrad_args)
    assert_close(dx, conv.conv_backward_reference(x, w, dy, (2, 2), ((1, 1), (1, 1)), (1, 1), 2)[0])
    assert any(cache_dir.iterdir())
    # The reports name the stored winner, one of the engines that can run the problem.
    tuned = [r for r in tdnn.engines("conv_dgrad", *dgrad_args) if r.tuned]
    assert len(tuned) == 1 and tuned[0].supported


def test_bad_input():
    x = torch.randn(1, 4, 6, 6, device=DEVICE)
    w = torch.randn(4, 4, 3, 3, device=DEVICE)
    with pytest.raises(ValueError, match="input channels"):
        conv.conv2d(x, torch.randn(4, 3, 3, 3, device=DEVICE))
    with pytest.raises(ValueError, match="groups=3"):
        conv.conv2d(x, w[:, :1].repeat(1, 1, 1, 1)[:3], groups=3)
    with pytest.raises(ValueError, match="larger than the padded input"):
        conv.conv2d(x, torch.randn(4, 4, 9, 3, device=DEVICE))
    with pytest.raises(ValueError, match="stride"):
        conv.conv2d(x, w, stride=0)
    with pytest.raises(ValueError, match="dimensions"):
        conv.conv2d(x[0, 0], w)
    with pytest.raises(ValueError, match="dimensions"):
        conv.conv2d(x, w[0])
    with pytest.raises(TypeError, match="dtype"):
        conv.conv2d(x, w.half())
    with pytest.raises(TypeError, match="dtype"):
        conv.conv2d(x.int(), w)
    with pytest.raises(ValueError, match="same"):
        conv.conv2d(x, w, stride=2, padding="same")
    with pytest.raises(ValueError, match="bias"):
        conv.conv2d(x, w, torch.randn(3, device=DEVICE))
    with pytest.raises(ValueError, match="padding"):
        conv.conv2d(x, w, padding=-1)
    with pytest.raises(ValueError, match="residual"):
        conv.conv2d(x, w, epilogue=Epilogue(residual=True))
    with pytest.raises(TypeError, match="epilogue"):
        conv.conv2d(x, w, epilogue="relu")
    with pytest.raises(ValueError, match="output_padding"):
        conv.conv_transpose2d(x, w, stride=1, output_padding=1)


# (shape, cout, kernel, stride, padding, dilation, groups): channels-last problems of the boxed-GEMM
# engine, channel counts multiples of 8 (16-byte pixel steps in fp16).
BOXED_CASES = [
    ((2, 16, 7, 9), 24, (3, 3), 1, 1, 1, 1),
    ((2, 16, 7, 9), 24, (3, 3), 1, 0, 1, 1),
    ((1, 32, 6, 5), 32, (3, 3), 1, (2, 1), (2, 1), 2),
    ((2, 8, 5, 6), 40, (1, 1), 1, 0, 1, 1),
    ((2, 16, 9, 10), 24, (1, 1), 2, 0, 1, 1),
    ((2, 16, 9, 10), 8, (3, 3), 2, 2, 2, 1),
    ((2, 16, 11), 16, (5,), 1, 2, 1, 1),
    ((1, 16, 4, 5, 6), 16, (3, 3, 3), 1, 1, 1, 1),
    # Small images: a box spans several, the last box partly past the batch.
    ((3, 16, 2, 2), 16, (3, 3), 1, 1, 1, 1),
    ((5, 8, 3), 16, (3,), 1, 1, 1, 1),
]


@pytest.mark.parametrize("layout_name", ["channels_last", "contiguous"])
@pytest.mark.parametrize("case", BOXED_CASES, ids=str)
def test_boxed_gemm(case, layout_name, poison):
    """Image tiles are descriptor boxes with the padding loaded as zeros: 'same' and 'valid'
    padding, dilation, groups, stride 2 where every tap lands on the strided view, 1-D/2-D/3-D,
    1x1, with the fused epilogue. A contiguous (channels-first) input is copied channels-last
    first, and the output written channels-first."""
    shape, cout, kernel, stride, padding, dilation, groups = case
    nd = len(shape) - 2
    x = layout(torch.randn(shape, device=DEVICE), layout_name).half()
    w = (torch.randn(cout, shape[1] // groups, *kernel, device=DEVICE) / 3).half()
    b = torch.randn(cout, device=DEVICE).half()
    pads, dl = pairs(padding, nd), (dilation,) * nd if isinstance(dilation, int) else dilation
    ref_pre = conv_reference(x, w, b, (stride,) * nd, pads, dl, groups)
    r = layout(torch.randn(ref_pre.shape, device=DEVICE), "channels_last").half()
    epi = Epilogue(activation="relu", residual=True)
    y = FNS[nd](x, w, b, stride, padding, dilation, groups, algo="boxed_gemm", epilogue=epi, residual=r)
    assert (y.stride(1) == 1) == (layout_name == "channels_last") and y.movedim(1, -1).is_contiguous() == (
        layout_name == "channels_last"
    ), "the output keeps the input's layout"
    ref = F.relu(ref_pre) + r.double()
    torch_out = (F.relu(torch_conv(x, w, b, stride, padding, dl, groups).float()) + r.float()).half()
    assert_close(y, ref, torch_out, f"boxed_gemm {case}")


def test_boxed_gemm_weights_packed_or_in_place():
    """Channels-last weights are read in place; other layouts are packed per call."""
    x = layout(torch.randn(2, 16, 6, 7, device=DEVICE), "channels_last").half()
    w = (torch.randn(24, 16, 3, 3, device=DEVICE) / 3).half()
    ref = conv_reference(x, w, None, (1, 1), ((1, 1), (1, 1)), (1, 1), 1)
    for weights in (w, layout(w, "channels_last"), layout(w, "strided")):
        y = conv.conv2d(x, weights, None, 1, 1, algo="boxed_gemm")
        assert_close(y, ref, torch_conv(x, w, None, 1, 1, (1, 1), 1), "weights")


def test_boxed_gemm_not_supported_and_heuristic():
    x = layout(torch.randn(2, 16, 6, 7, device=DEVICE), "channels_last").half()
    w = torch.randn(16, 16, 3, 3, device=DEVICE).half()
    with pytest.raises(tdnn.NotSupportedError, match="multiple of the stride"):
        conv.conv2d(x, w, stride=2, padding=1, algo="boxed_gemm")  # taps at offsets -1, 0, 1
    with pytest.raises(tdnn.NotSupportedError, match="channels-last"):
        conv.conv2d(layout(x, "strided"), w, algo="boxed_gemm")  # neither layout: not staged
    with pytest.raises(tdnn.NotSupportedError, match="fp16, bf16"):
        conv.conv2d(x.float(), w.float(), algo="boxed_gemm")
    x12 = layout(torch.randn(2, 12, 6, 7, device=DEVICE), "channels_last").half()
    with pytest.raises(tdnn.NotSupportedError, match="multiples of 16 bytes"):
        conv.conv2d(x12, w[:, :12], algo="boxed_gemm")  # 24-byte pixel steps
    with pytest.raises(tdnn.NotSupportedError, match="runs of channels"):
        conv.conv2d(x[:, :12], w[:, :12], algo="boxed_gemm")  # steps of 16, 12 channels per tap
    # The heuristic takes it for ResNet's 1x1 and 3x3 convolutions in channels-last fp16.
    x = layout(torch.randn(2, 64, 14, 14, device=DEVICE), "channels_last").half()
    w = torch.randn(64, 64, 3, 3, device=DEVICE).half()
    for weights, padding in ((w[:, :, :1, :1], 0), (w, 1)):
        chosen = {r.name for r in tdnn.engines("conv", x, weights, None, 1, padding) if r.chosen}
        assert chosen == {"boxed_gemm"}
    # Channels-first with several taps: staged channels-last beats the gathered GEMM; a 1x1 stride-1
    # product keeps the gathered one (its A tiles are runs of pixels).
    x = torch.empty(64, 64, 28, 28, device=DEVICE, dtype=torch.half)  # described, never run
    for weights, padding, engine in ((w, 1, "boxed_gemm"), (w[:, :, :1, :1], 0, "implicit_gemm")):
        chosen = {r.name for r in tdnn.engines("conv", x, weights, None, 1, padding) if r.chosen}
        assert chosen == {engine}


# (shape, cout, kernel, stride, padding): strided convolutions with few input channels for the
# space-to-depth engine: the ResNet stem's form, uneven strides and kernels not multiples of them,
# z padded to 16-byte pixels (3 x 2 strides, 3 channels: 36 channels, padded to 40), 1-D and 3-D.
SPACE_TO_DEPTH_CASES = [
    ((2, 3, 17, 19), 16, (7, 7), 2, 3),
    ((2, 4, 11, 10), 8, (5, 3), (2, 3), (2, 1)),
    ((2, 3, 11, 10), 8, (3, 3), (3, 2), 1),
    ((1, 2, 9, 9), 8, (3, 3), 2, 0),
    ((3, 3, 21), 8, (7,), 2, 3),
    ((2, 3, 5, 9, 8), 8, (3, 3, 3), 2, 1),
]


@pytest.mark.parametrize("layout_name", ["channels_last", "contiguous"])
@pytest.mark.parametrize("case", SPACE_TO_DEPTH_CASES, ids=str)
def test_space_to_depth(case, layout_name, poison):
    """A strided convolution as the stride-1 one over a space-to-depth copy of x, with the fused
    epilogue, in either layout."""
    shape, cout, kernel, stride, padding = case
    nd = len(shape) - 2
    x = layout(torch.randn(shape, device=DEVICE), layout_name).half()
    w = (torch.randn(cout, shape[1], *kernel, device=DEVICE) / 3).half()
    b = torch.randn(cout, device=DEVICE).half()
    st = (stride,) * nd if isinstance(stride, int) else stride
    ref_pre = conv_reference(x, w, b, st, pairs(padding, nd), (1,) * nd, 1)
    r = layout(torch.randn(ref_pre.shape, device=DEVICE), layout_name).half()
    epi = Epilogue(activation="relu", residual=True)
    y = FNS[nd](x, w, b, stride, padding, 1, 1, algo="space_to_depth", epilogue=epi, residual=r)
    assert (y.stride(1) == 1) == (layout_name == "channels_last"), "the output keeps the input's layout"
    ref = F.relu(ref_pre) + r.double()
    torch_out = (F.relu(torch_conv(x, w, b, stride, padding, (1,) * nd, 1).float()) + r.float()).half()
    assert_close(y, ref, torch_out, f"space_to_depth {case}")


def test_space_to_depth_not_supported_and_heuristic():
    x = layout(torch.randn(2, 3, 16, 16, device=DEVICE), "channels_last").half()
    w = torch.randn(9, 3, 3, 3, device=DEVICE).half()
    for kwargs, reason in (
        ({}, "stride > 1"),
        ({"stride": 2, "dilation": 2}, "dilation 1"),
        ({"stride": 2, "groups": 3, "weight": w[:, :1]}, "groups == 1"),
    ):
        weight = kwargs.pop("weight", w)
        with pytest.raises(tdnn.NotSupportedError, match=reason):
            conv.conv2d(x, weight, algo="space_to_depth", **kwargs)
    wide = layout(torch.randn(2, 32, 16, 16, device=DEVICE), "channels_last").half()
    with pytest.raises(tdnn.NotSupportedError, match="at most 64"):
        conv.conv2d(wide, torch.randn(9, 32, 3, 3, device=DEVICE).half(), stride=2, algo="space_to_depth")
    with pytest.raises(tdnn.NotSupportedError, match="fp16, bf16"):
        conv.conv2d(x.float(), w.float(), stride=2, algo="space_to_depth")
    with tdnn.config.flags(allow_tf32=True), pytest.raises(tdnn.NotSupportedError, match="with TF32"):
        conv.conv2d(x.float(), w.float(), stride=2, algo="space_to_depth")
    # The heuristic takes it for ResNet-50's stem in 16-bit, either layout (described, never run).
    w7 = torch.empty(64, 3, 7, 7, device=DEVICE, dtype=torch.half)
    for name in ("channels_last", "contiguous"):
        x = layout(torch.empty(64, 3, 224, 224, device=DEVICE, dtype=torch.half), name)
        chosen = {r.name for r in tdnn.engines("conv", x, w7, None, 2, 3) if r.chosen}
        assert chosen == {"space_to_depth"}, name


def test_descriptor_engines_fall_back_on_a_misaligned_base():
    """Descriptors need 16-byte-aligned base addresses, known only per call: a channel slice that
    starts 2 bytes in runs the gathered implicit GEMM, forward and in both gradients."""
    base = layout(torch.randn(2, 24, 6, 7, device=DEVICE), "channels_last").half()
    x = base[:, 1:17]  # 16 channels in rows of 24: aligned rows, base address 2 bytes off
    assert x.data_ptr() % 16 == 2
    w = (torch.randn(16, 16, 3, 3, device=DEVICE) / 3).half()
    pads = ((1, 1), (1, 1))
    y = conv.conv2d(x, w, None, 1, 1, algo="boxed_gemm")
    assert_close(
        y, conv_reference(x, w, None, (1, 1), pads, (1, 1), 1), torch_conv(x, w, None, 1, 1, (1, 1), 1)
    )
    dy = base[:, 2:18]
    rx, rw = conv_backward_reference(x, w, dy, (1, 1), pads, (1, 1), 1)
    dx = conv.conv_backward_data(dy, w, x.shape, 1, pads, 1, 1, algo="boxed_gemm")
    assert_close(dx, rx, what="dgrad")
    dw = conv.conv_backward_weight(x, dy, w.shape, 1, pads, 1, 1, algo="shifted_gemm")
    assert_close(dw, rw, what="wgrad")


def test_bound_forward_runs_the_plan_on_fresh_tensors():
    """``conv.bound_forward`` checks once and then runs the plan directly (an operation graph's
    execute): fresh values of the same signature against float64; None where the checks would
    adapt an argument per call (unbatched input, a strided bias) or a pre-activation is stored;
    bad arguments raise as conv2d does."""
    x, w, b, r = (torch.randn(*s, device=DEVICE) for s in ((2, 8, 9, 9), (6, 8, 3, 3), (6,), (2, 6, 9, 9)))
    epi = Epilogue(activation="relu", residual=True)
    run = conv.bound_forward(2, x, w, b, 1, 1, 1, 1, epilogue=epi, residual=r)
    assert run is not None
    for _ in range(2):
        x2, r2 = torch.randn_like(x), torch.randn_like(r)
        want = F.relu(F.conv2d(x2.double(), w.double(), b.double(), padding=1)) + r2.double()
        assert_close(run(x2, w, b, None, r2), want, F.relu(F.conv2d(x2, w, b, padding=1)) + r2)
    assert conv.bound_forward(2, x[0], w, b, 1, 1, 1, 1) is None
    assert conv.bound_forward(2, x, w, torch.randn(12, device=DEVICE)[::2], 1, 1, 1, 1) is None
    stored = Epilogue(activation="relu", store_preactivation=True)
    assert conv.bound_forward(2, x, w, b, 1, 1, 1, 1, epilogue=stored) is None
    with pytest.raises(ValueError, match="groups"):
        conv.bound_forward(2, x, w, b, 1, 1, 1, 3)


# (input channels, groups, layout, stride, padding, dilation): the implicit GEMM's three K walks
# under the interpreter's 16-wide K steps: by tap then channel block (20 channels: a partial
# block), flat over (tap, channel) (3 channels a group), row windows (5 channels, channels-last;
# and channels-first, copied channels-last first).
PROLOGUE_CASES = [
    (20, 1, "contiguous", 1, 1, 1),
    (6, 2, "contiguous", 2, ((1, 2), (0, 1)), 2),
    (5, 1, "channels_last", 1, 1, 1),
    (5, 1, "contiguous", 2, 2, 1),
]


def _prologue_ref(x, scale, shift, relu):
    """relu(x * scale + shift) per channel in float64 (parts left out where None / False)."""
    shape = (1, -1, *([1] * (x.ndim - 2)))
    t = x.double()
    t = t * scale.double().view(shape) if scale is not None else t
    t = t + shift.double().view(shape) if shift is not None else t
    return torch.where(t < 0, 0.0, t) if relu else t  # (NaN passes, as torch.relu's)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("parts", ["scale shift relu", "shift", "scale relu"])
@pytest.mark.parametrize("case", PROLOGUE_CASES)
def test_bound_forward_applies_the_prologue(case, parts, dtype):
    """cuDNN's scale-bias-relu before a convolution (``prologue=(scale, shift, relu)``):
    conv(relu(x * scale + shift)) per input channel against float64, the transformed input's
    padding zero (the shift would make a transformed padding nonzero), with a bias and ReLU
    epilogue; fresh values through the bound plan."""
    cin, groups, lay, stride, padding, dilation = case
    x = layout(torch.randn(2, cin, 9, 8, device=DEVICE, dtype=dtype), lay)
    w = torch.randn(4, cin // groups, 3, 3, device=DEVICE, dtype=dtype)
    b = torch.randn(4, device=DEVICE, dtype=dtype)

    def per_channel(name):
        return torch.rand(cin, device=DEVICE, dtype=dtype) + 0.5 if name in parts else None

    epi = Epilogue(activation="relu")
    prologue = (per_channel("scale"), per_channel("shift"), "relu" in parts)
    run = conv.bound_forward(2, x, w, b, stride, padding, dilation, groups, epilogue=epi, prologue=prologue)
    pads = [v for p in reversed(pairs(padding, 2)) for v in p]

    def conv_of(t, w, b):
        return F.relu(F.conv2d(F.pad(t, pads), w, b, stride, 0, dilation, groups))

    assert run is not None
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        scale, shift = per_channel("scale"), per_channel("shift")
        if shift is not None:
            shift -= 1.0  # both signs
        t = _prologue_ref(x, scale, shift, "relu" in parts)
        got = run(x, w, b, None, None, scale, shift)
        assert_close(got, conv_of(t, w.double(), b.double()), conv_of(t.to(dtype), w, b))


def test_prologue_parameters_of_other_dtypes_get_their_own_plan():
    """A plan keeps the kernel compiled for its first call's dtypes: a scale of another dtype on
    the same shapes binds another plan (under the interpreter, sharing one would raise)."""
    x, w = torch.randn(2, 20, 6, 6, device=DEVICE), torch.randn(4, 20, 3, 3, device=DEVICE)
    for dtype in (torch.float32, torch.float64, torch.float16):
        scale = torch.rand(20, device=DEVICE, dtype=dtype) + 0.5
        run = conv.bound_forward(2, x, w, None, 1, 1, 1, 1, prologue=(scale, None, False))
        want = F.conv2d(_prologue_ref(x, scale, None, False), w.double(), padding=1)
        assert_close(
            run(x, w, None, None, None, scale, None),
            want,
            F.conv2d(x * scale.float().view(1, -1, 1, 1), w, padding=1),
        )


def test_prologue_passes_nan_and_checks_its_parameters():
    x, w = torch.randn(1, 4, 6, 6, device=DEVICE), torch.randn(4, 4, 3, 3, device=DEVICE)
    shift = torch.zeros(4, device=DEVICE)
    run = conv.bound_forward(2, x, w, None, 1, 1, 1, 1, prologue=(None, shift, True))
    x[0, 1, 2, 3] = float("nan")
    y = run(x, w, None, None, None, None, shift)
    assert y.isnan().sum() == 9 * 4  # the 3x3 outputs that read the pixel, every channel
    with pytest.raises(ValueError, match="contiguous"):
        conv.bound_forward(
            2, x, w, None, 1, 1, 1, 1, prologue=(torch.ones(8, device=DEVICE)[::2], None, False)
        )
    with pytest.raises(ValueError, match="one value per input channel"):
        conv.bound_forward(2, x, w, None, 1, 1, 1, 1, prologue=(torch.ones(5, device=DEVICE), None, False))
    with pytest.raises(TypeError, match="dtype"):
        conv.bound_forward(
            2, x, w, None, 1, 1, 1, 1, prologue=(torch.ones(4, dtype=torch.int32, device=DEVICE), None, False)
        )


def test_problem_keys_name_a_prologue_only_where_there_is_one():
    """The autotune cache's keys of problems without a prologue are those from before the field."""
    from dataclasses import replace

    from tritondnn.ops.conv.plans import make_problem

    x, w, y = (
        ((2, 4, 6, 6), (1, 4, 36, 6, 1)),
        ((4, 4, 3, 3), (36, 9, 3, 1, 1)),
        ((2, 4, 6, 6), (1, 4, 36, 6, 1)),
    )
    p = make_problem("fwd", x, w, y, (1, 1), (1, 1), (1, 1), 1, torch.float32, torch.float32)
    assert "prologue" not in p.key() and p.key().endswith("deterministic=False)")
    assert replace(p, prologue=7).key().endswith("prologue=7)")


def test_only_the_implicit_gemm_takes_a_prologue():
    x, w = torch.randn(1, 4, 6, 6, device=DEVICE), torch.randn(4, 4, 3, 3, device=DEVICE)
    with pytest.raises(tdnn.NotSupportedError, match="prologue"):
        conv.bound_forward(2, x, w, None, 1, 1, 1, 1, algo="boxed_gemm", prologue=(None, None, True))
