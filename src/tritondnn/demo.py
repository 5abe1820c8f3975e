"""The main job: run every implemented primitive, check it against PyTorch, time both.

On a GPU the sizes are realistic (8192x4096, bf16 and fp32); under the interpreter they are tiny,
since the point there is that everything runs and agrees. Each primitive is checked forward and
backward against a float64 reference with the accuracy rule of ``core.accuracy``; the exit status
is non-zero if any check fails.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from . import __version__
from .bench.models import agreement, compare, workloads
from .core.accuracy import check
from .core.backend import DEVICE_TYPE, INTERPRET, backend, device_name
from .core.timing import median_ms
from .ops import activation as act
from .ops import attention as att
from .ops import conv, cross_entropy, ctc, norm, pool, rnn, spatial
from .ops import dropout as dr
from .ops import matmul as mm
from .ops import reduce as rd
from .ops import softmax as sm
from .ops import tensor_ops as to
from .ops import transform as tf
from .ops.epilogue import Epilogue


@functools.cache
def _keep_mask(shape: tuple[int, ...], device: str) -> torch.Tensor:
    """dropout(p=0.1, seed=0)'s keep-mask from the plain-PyTorch Philox (once per shape: it is slow)."""
    return dr.dropout_mask_reference(shape, 0.1, 0).to(device)


def _grid(x: torch.Tensor) -> torch.Tensor:
    theta = torch.tensor([[[0.9, 0.1, 0.05], [-0.1, 0.8, 0.0]]], device=x.device, dtype=x.dtype)
    return F.affine_grid(theta, [1, 1, 32, 64], align_corners=False)


def _w(*shape: int, like: torch.Tensor) -> torch.Tensor:
    """A fixed weight (seeded generator) scaled by 1/sqrt(fan-in), in ``like``'s dtype and device."""
    g = torch.Generator().manual_seed(0)
    return (torch.randn(*shape, generator=g) / math.sqrt(math.prod(shape[1:]))).to(like)


def _seq(x: torch.Tensor) -> torch.Tensor:
    """x as a sequence (T=16, B=4, I=64) for the recurrent primitives."""
    return x[:64, :64].reshape(16, 4, 64)


def _lstm_params(x: torch.Tensor) -> list[torch.Tensor]:
    """One LSTM layer's flat weights (hidden 32): w_ih, w_hh, b_ih, b_hh."""
    return [_w(128, 64, like=x), _w(128, 32, like=x), _w(128, like=x), _w(128, like=x)]


def _lstm_torch(x: torch.Tensor) -> torch.Tensor:
    h0 = x.new_zeros(1, 4, 32)
    return torch.lstm(_seq(x), (h0, h0), _lstm_params(x), True, 1, 0.0, False, False, False)[0]


RELU = Epilogue(activation="relu")


def _img(x: torch.Tensor) -> torch.Tensor:
    """x as a (2, 8, H, W) image: 8 channels, 4 rows of the input's width per sample."""
    return x[:64].reshape(2, 8, 4, x.shape[1])


def _qkv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v) of shape (1, 8 heads, 64 positions, 32) from the first 64x256 block of x."""
    q = x[:64, :256].reshape(1, 64, 8, 32).transpose(1, 2)
    return q, q.flip(2), q


def _ctc_args(x: torch.Tensor) -> tuple:
    """(log-probabilities (T=64, N=1, 257 classes) from x in fp32 (fp64 for the reference's fp64
    x: ctc_loss takes no 16-bit input), targets, input and target lengths)."""
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    log_probs = x[:64, :257].to(dtype).reshape(64, 1, 257).log_softmax(-1)
    return log_probs, torch.arange(1, 11, device=x.device).view(1, 10), [64], [10]


def _classes(x: torch.Tensor) -> torch.Tensor:
    """A class index for each row of x (its columns are the classes)."""
    return torch.arange(x.shape[0], device=x.device) * 7 % x.shape[1]


# name: (tritondnn, PyTorch); both are applied to the same input and differentiated.
PRIMITIVES: dict[str, tuple[Callable, Callable]] = {
    "relu": (act.relu, F.relu),
    "relu6 (clip=6)": (partial(act.relu, clip=6.0), F.relu6),
    "leaky_relu": (act.leaky_relu, F.leaky_relu),
    "elu": (act.elu, F.elu),
    "sigmoid": (act.sigmoid, torch.sigmoid),
    "tanh": (act.tanh, torch.tanh),
    "gelu": (act.gelu, F.gelu),
    "gelu (tanh)": (partial(act.gelu, approximate="tanh"), partial(F.gelu, approximate="tanh")),
    "silu": (act.silu, F.silu),
    "softplus": (act.softplus, F.softplus),
    "softmax": (partial(sm.softmax, dim=-1), partial(torch.softmax, dim=-1)),
    "log_softmax": (partial(sm.log_softmax, dim=-1), partial(torch.log_softmax, dim=-1)),
    "matmul (x @ x.T)": (lambda x: mm.matmul(x, x.mT), lambda x: x @ x.mT),
    "linear+gelu": (lambda x: mm.linear(x, x[:64], activation="gelu"), lambda x: F.gelu(F.linear(x, x[:64]))),
    "layer_norm": (lambda x: norm.layer_norm(x, x.shape[-1]), lambda x: F.layer_norm(x, x.shape[-1:])),
    "rms_norm": (
        lambda x: norm.rms_norm(x, x.shape[-1], eps=1e-6),
        lambda x: F.rms_norm(x, x.shape[-1:], eps=1e-6),
    ),
    "group_norm": (
        lambda x: norm.group_norm(x, math.gcd(8, x.shape[1])),
        lambda x: F.group_norm(x, math.gcd(8, x.shape[1])),
    ),
    "max_pool2d 3x3/2": (
        lambda x: pool.max_pool2d(x.view(2, -1, 4, x.shape[1]), 3, 2, 1),
        lambda x: F.max_pool2d(x.view(2, -1, 4, x.shape[1]), 3, 2, 1),
    ),
    "avg_pool2d 3x3/2": (
        lambda x: pool.avg_pool2d(x.view(2, -1, 4, x.shape[1]), 3, 2, 1),
        lambda x: F.avg_pool2d(x.view(2, -1, 4, x.shape[1]), 3, 2, 1),
    ),
    "adaptive_avg_pool2d": (
        lambda x: pool.adaptive_avg_pool2d(x.view(2, -1, 4, x.shape[1]), 1),
        lambda x: F.adaptive_avg_pool2d(x.view(2, -1, 4, x.shape[1]), 1),
    ),
    "local_response_norm": (
        lambda x: pool.local_response_norm(x.view(2, -1, 4, x.shape[1]), 5),
        lambda x: F.local_response_norm(x.view(2, -1, 4, x.shape[1]), 5),
    ),
    "bilinear x2": (
        lambda x: pool.interpolate(x.view(2, -1, 4, x.shape[1]), scale_factor=2, mode="bilinear"),
        lambda x: F.interpolate(x.view(2, -1, 4, x.shape[1]), scale_factor=2, mode="bilinear"),
    ),
    "nearest x2": (
        lambda x: pool.interpolate(x.view(2, -1, 4, x.shape[1]), scale_factor=2),
        lambda x: F.interpolate(x.view(2, -1, 4, x.shape[1]), scale_factor=2),
    ),
    "conv1d k3": (
        lambda x: conv.conv1d(x[:64].reshape(4, 16, -1), _w(8, 16, 3, like=x), padding=1),
        lambda x: F.conv1d(x[:64].reshape(4, 16, -1), _w(8, 16, 3, like=x), padding=1),
    ),
    "conv2d 3x3/2+bias+relu": (
        lambda x: conv.conv2d(_img(x), _w(16, 8, 3, 3, like=x), _w(16, like=x), 2, 1, epilogue=RELU),
        lambda x: F.relu(F.conv2d(_img(x), _w(16, 8, 3, 3, like=x), _w(16, like=x), 2, 1)),
    ),
    "conv2d depthwise 3x3": (
        lambda x: conv.conv2d(_img(x), _w(8, 1, 3, 3, like=x), None, 1, 1, 1, 8),
        lambda x: F.conv2d(_img(x), _w(8, 1, 3, 3, like=x), None, 1, 1, 1, 8),
    ),
    "conv_transpose2d 2x2/2": (
        lambda x: conv.conv_transpose2d(_img(x), _w(8, 4, 2, 2, like=x), stride=2),
        lambda x: F.conv_transpose2d(_img(x), _w(8, 4, 2, 2, like=x), stride=2),
    ),
    "sdpa (causal)": (
        lambda x: att.sdpa(*_qkv(x), is_causal=True),
        lambda x: F.scaled_dot_product_attention(*_qkv(x), is_causal=True),
    ),
    "dropout (seed=0)": (
        lambda x: dr.dropout(x, 0.1, seed=0),
        lambda x: x * _keep_mask(tuple(x.shape), str(x.device)) / 0.9,
    ),
    "op_tensor mul": (lambda x: to.op_tensor(x, x[:1], "mul", alpha1=2.0), lambda x: 2 * x * x[:1]),
    "reduce norm2": (lambda x: rd.reduce_tensor(x, "norm2", 1), lambda x: torch.linalg.vector_norm(x, 2, 1)),
    "reduce max": (lambda x: rd.reduce_tensor(x, "max", 0), lambda x: x.amax(0)),
    "transform pad": (
        lambda x: tf.transform_tensor(x, alpha=0.5, pad=(1, 2)),
        lambda x: F.pad(0.5 * x, (1, 2)),
    ),
    "grid_sample": (
        lambda x: spatial.grid_sample(x[None, None], _grid(x)),
        lambda x: F.grid_sample(x[None, None], _grid(x), align_corners=False),
    ),
    "ctc_loss": (lambda x: ctc.ctc_loss(*_ctc_args(x)), lambda x: F.ctc_loss(*_ctc_args(x))),
    "cross_entropy": (
        lambda x: cross_entropy.cross_entropy(x, _classes(x), reduction="none"),
        lambda x: F.cross_entropy(x, _classes(x), reduction="none"),
    ),
    "batch_norm train": (
        partial(norm.batch_norm, running_mean=None, running_var=None, training=True),
        partial(F.batch_norm, running_mean=None, running_var=None, training=True),
    ),
    "lstm T16 B4 H32": (lambda x: rnn.lstm(_seq(x), None, _lstm_params(x))[0], _lstm_torch),
}


def _forward_backward(fn: Callable, x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xg = x.detach().clone().requires_grad_(True)
    y = fn(xg)
    (dx,) = torch.autograd.grad(y, xg, dy)
    return y.detach(), dx


def train_models(echo: Callable[[str], None]) -> int:
    """Train each model of the ``models`` suite (tiny ones under the interpreter) with tritondnn
    patched in and in plain PyTorch from the same seed; print both loss curves and step times.
    Losses must agree within ``bench.models.loss_tolerance``."""
    steps, low = (3, False) if INTERPRET else (20, True)
    failures = 0
    precision = "bf16 autocast" if low else "fp32"
    echo(f"\nmodels: {steps} training steps, tritondnn-patched vs PyTorch ({precision})")
    for w in workloads(tiny=INTERPRET):
        r = compare(w, steps, low)
        ours, theirs = r["tritondnn loss"], r["torch loss"]
        worst, tolerance = agreement(r, low)
        ok = worst <= tolerance
        failures += not ok
        t_ours, t_torch = sorted(r["tritondnn s"])[steps // 2], sorted(r["torch s"])[steps // 2]
        echo(f"  {w.name}: losses " + " ".join(f"{a:.4f}/{b:.4f}" for a, b in zip(ours, theirs)))
        echo(
            f"    median step {t_ours * 1e3:.1f} ms vs {t_torch * 1e3:.1f} ms ({t_torch / t_ours:.2f}x); "
            f"largest loss difference {worst:.1e} (tolerance {tolerance:.1e}) {'ok' if ok else 'FAIL'}"
        )
    return failures


def main(echo: Callable[[str], None] = print) -> int:
    shape = (64, 257) if INTERPRET else (8192, 4096)
    dtypes = (torch.float32,) if INTERPRET else (torch.bfloat16, torch.float32)
    echo(f"tritondnn {__version__} on {device_name()} ({backend()} backend), shape {shape[0]}x{shape[1]}")
    echo(f"{'primitive':<16} {'dtype':<9} {'fwd err':>9} {'torch':>9} {'bwd err':>9} {'torch':>9} "
         f"{'ours ms':>9} {'torch ms':>9} {'speedup':>8}  check")  # fmt: skip
    failures = 0
    # Fixed data: a run repeats the last one's checks.
    torch.manual_seed(0)
    for name, (ours, ref) in PRIMITIVES.items():
        for dtype in dtypes:
            x = torch.randn(shape, device=DEVICE_TYPE, dtype=dtype) * 3
            dy = torch.randn_like(ref(x))  # the output's shape: matmul and linear change it
            y, dx = _forward_backward(ours, x, dy)
            y_torch, dx_torch = _forward_backward(ref, x, dy)
            y_ref, dx_ref = _forward_backward(ref, x.double(), dy.double())
            fwd, bwd = check(y, y_ref, y_torch), check(dx, dx_ref, dx_torch)
            ok = fwd.ok and bwd.ok
            failures += not ok
            ms_ours, ms_torch = median_ms(partial(ours, x)), median_ms(partial(ref, x))
            torch_fwd, torch_bwd = check(y_torch, y_ref).error, check(dx_torch, dx_ref).error
            echo(
                f"{name:<16} {str(dtype).removeprefix('torch.'):<9} {fwd.error:>9.2e} "
                f"{torch_fwd:>9.2e} {bwd.error:>9.2e} {torch_bwd:>9.2e} "
                f"{ms_ours:>9.4f} {ms_torch:>9.4f} {ms_torch / ms_ours:>7.2f}x  {'ok' if ok else 'FAIL'}"
            )
    failures += train_models(echo)
    if INTERPRET:
        echo("(interpreter: times are the CPU interpreter's, not a GPU's)")
    echo("all checks passed" if not failures else f"{failures} check(s) failed")
    return 1 if failures else 0
