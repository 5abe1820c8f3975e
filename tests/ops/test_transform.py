"""Layout/type transforms and fp8 quantization: every format change, dtype, padding, gradients, errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tritondnn.ops.transform as tf
from helpers import DEVICE, DTYPES, ON_GPU, assert_close, randn


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rank,fmt", [(4, torch.channels_last), (5, torch.channels_last_3d)])
def test_layout_round_trip(rank, fmt, dtype, poison):
    x = randn(*(2, 5, 3, 7, 4)[:rank], dtype=dtype)
    y = tf.transform_tensor(x, memory_format=fmt)
    assert y.is_contiguous(memory_format=fmt) and torch.equal(y, x)
    z = tf.transform_tensor(y, memory_format=torch.contiguous_format)
    assert z.is_contiguous() and torch.equal(z, x)
    engines = {r.name: r.supported for r in tf.FAMILY.report(tf._problem(x, y, [0] * rank))}
    assert engines["tiled-transpose"]


@pytest.mark.parametrize("src", DTYPES, ids=str)
@pytest.mark.parametrize("dst", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_dtype_and_scale(src, dst, poison):
    x = randn(3, 4, 5, 6, dtype=src).to(memory_format=torch.channels_last)
    y = tf.transform_tensor(x, dtype=dst, alpha=1.5)
    assert y.dtype == dst and y.is_contiguous(memory_format=torch.channels_last)
    assert_close(y, tf.transform_reference(x, 1.5), (x.to(dst) * 1.5).to(dst) if dst != src else x * 1.5)


def _chosen(x: torch.Tensor, y: torch.Tensor) -> str:
    return next(r.name for r in tf.FAMILY.report(tf._problem(x, y, [0] * x.ndim)) if r.chosen)


@pytest.mark.parametrize("dst", [torch.bfloat16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize(
    "layout", ["contiguous", "channels_last", "permuted", "sliced"], ids=lambda s: s.replace("_", "-")
)
def test_flat_same_layout(layout, dst, poison):
    """Same-layout conversions run flat (an odd size leaves a partial last block); a sliced input
    cannot and is gathered."""
    x = randn(3, 5, 7, 41, dtype=torch.float16)
    if layout == "channels_last":
        x = x.to(memory_format=torch.channels_last)
    elif layout == "permuted":  # dense, neither format: the output is contiguous, so not flat
        x = x.permute(3, 2, 1, 0).contiguous().permute(3, 2, 1, 0)
    elif layout == "sliced":
        x = x[..., ::2]
    y = tf.transform_tensor(x, dtype=dst, alpha=-0.75)
    flat = layout in ("contiguous", "channels_last")
    assert _chosen(x, y) == ("flat" if flat else "gather")
    assert_close(
        y, tf.transform_reference(x, -0.75), (x.to(dst) * -0.75).to(dst) if dst != x.dtype else x * -0.75
    )


def test_padding_cropping_and_gradient(poison):
    x = randn(2, 3, 5, 6)
    pad = [1, 2, -1, 3, 0, 1]
    xg = x.clone().requires_grad_(True)
    y = tf.transform_tensor(xg, pad=pad, value=-2.0, alpha=0.5, memory_format=torch.channels_last)
    assert torch.equal(y, F.pad(x * 0.5, pad, value=-2.0))
    dy = randn(*y.shape)
    (dx,) = torch.autograd.grad(y, xg, dy)
    x64 = x.double().requires_grad_(True)
    (ref,) = torch.autograd.grad(F.pad(x64 * 0.5, pad, value=-2.0), x64, dy.double())
    assert_close(dx, ref)


def test_strided_input():
    x = randn(4, 6, 8)[:, ::2, 1::3]
    assert torch.equal(tf.transform_tensor(x), x.contiguous())


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("src", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_fp8_quantize_dequantize(dtype, src):
    x = randn(33, 65, dtype=src, scale=5.0)
    q, scale, amax = tf.quantize_fp8(x, dtype=dtype)
    assert q.dtype == dtype and q.shape == x.shape
    assert amax.item() == x.float().abs().max().item()
    assert scale.item() == pytest.approx(torch.finfo(dtype).max / amax.item(), rel=1e-6)
    ref = tf.quantize_fp8_reference(x.float(), scale.item(), dtype)
    # fp32 x * scale may round across an fp8 tie differently from the fp64 product: one ulp at most.
    diff = (q.float() - ref.float()).abs()
    ulp = ref.float().abs() * (2.0**-3 if dtype == torch.float8_e4m3fn else 2.0**-2)
    assert bool((diff <= ulp + 1e-6).all())
    y = tf.dequantize_fp8(q, scale, dtype=torch.float32)
    assert torch.allclose(y, q.float() / scale)


def test_fp8_given_scale_saturates():
    x = randn(1000, scale=3.0)
    x[0] = 1e6
    q, scale, amax = tf.quantize_fp8(x, scale=torch.tensor(2.0, device=DEVICE))
    assert scale.item() == 2.0 and amax.item() == 1e6
    assert q.float()[0].item() == torch.finfo(torch.float8_e4m3fn).max
    assert torch.equal(q.float()[1:], (x[1:] * 2).to(torch.float8_e4m3fn).float())
    q2, s2, a2 = tf.quantize_fp8(torch.zeros(10, device=DEVICE), margin=1)
    assert s2.item() == 1.0 and a2.item() == 0.0 and bool((q2.float() == 0).all())


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_fp8_float_scale_many_blocks_and_nan(dtype):
    """A float scale (returned as a tensor the kernels write), more blocks than programs (each
    program loops, the last block partial), NaN kept in q and counted as amax inf."""
    x = randn(100_003, scale=50.0)
    q, scale, amax = tf.quantize_fp8(x, 3.0, dtype)
    assert scale.item() == 3.0 and scale.dtype == torch.float32
    assert amax.item() == x.abs().max().item()
    assert torch.equal(q.float(), (x * 3.0).clamp(-tf._fmax(dtype), tf._fmax(dtype)).to(dtype).float())
    x[77_777] = float("nan")
    q, scale, amax = tf.quantize_fp8(x, 3.0, dtype)
    assert amax.item() == float("inf") and bool(q.float()[77_777].isnan())
    assert tf.quantize_fp8(x[:100], 2, dtype)[1].item() == 2.0  # an int scale, as a float
    e = tf.quantize_fp8(x[:0], 3.0, dtype)
    assert e[0].shape == (0,) and e[1].item() == 3.0 and e[2].item() == 0.0


@pytest.mark.gpu_only("the fp8 tensors are written by the compiled kernel (no fp8 in the interpreter)")
def test_fp8_large_on_gpu():
    x = randn(4096, 4097, dtype=torch.bfloat16)
    q, scale, _ = tf.quantize_fp8(x)
    assert torch.equal(q.float(), (x.float() * scale).clamp(-448, 448).to(torch.float8_e4m3fn).float())
    assert ON_GPU


def test_errors():
    x = randn(2, 3, 4)
    with pytest.raises(ValueError, match="4-D"):
        tf.transform_tensor(x, memory_format=torch.channels_last)
    with pytest.raises(ValueError, match="pad"):
        tf.transform_tensor(x, pad=[1, 2, 3])
    with pytest.raises(ValueError, match="negative size"):
        tf.transform_tensor(x, pad=[-5, 0])
    with pytest.raises(TypeError, match="dtype"):
        tf.transform_tensor(x, dtype=torch.int32)
    with pytest.raises(ValueError, match="dimensions"):
        tf.transform_tensor(randn(1, 1, 1, 1, 1, 2))
    with pytest.raises(TypeError, match="dtype"):
        tf.quantize_fp8(x, dtype=torch.float16)
    with pytest.raises(ValueError, match="scale"):
        tf.quantize_fp8(x, scale=-1.0)
    with pytest.raises(TypeError, match="dtype"):
        tf.dequantize_fp8(x, 1.0)
