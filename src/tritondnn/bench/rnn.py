"""Recurrent benchmarks (issue 10): tdnn.lstm / tdnn.gru against torch.nn.LSTM / GRU on cuDNN
(``torch.backends.cudnn.benchmark = True``), forward and forward+backward, on the issue's shapes:
T256 B64 I512 H512 2 layers (fp32 and bf16), T128 B32 I1024 H1024 and T512 B128 I256 H256 (fp32).

TFLOP/s count the matrix products: per layer and direction ``2 * T * B * G * (I_l + H)`` with G
= 4H (LSTM) or 3H (GRU); forward+backward counts 3x the forward. Forward cases also time
``tritondnn.recurrence``: the recurrent kernels alone (the input projections left out), whose
ratio to ``tritondnn`` is the fraction of the time spent in the recurrence.

fp32 cases compare like with like twice: ``tritondnn`` (fp32 products) against
``cudnn-no-tf32``, and ``tritondnn.tf32`` (``tdnn.config.allow_tf32``) against ``cudnn``, which
PyTorch runs on TF32 tensor cores by default (``torch.backends.cudnn.allow_tf32``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial

import torch
from torch import nn

from ..core.backend import DEVICE_TYPE, INTERPRET
from ..core.config import config
from ..ops import rnn as ops_rnn
from . import Case, providers

# (T, B, I, H, layers)
SHAPES = [(256, 64, 512, 512, 2), (128, 32, 1024, 1024, 1), (512, 128, 256, 256, 1)]
_DT = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def _flops(cell: str, steps: int, batch: int, inputs: int, hidden: int, layers: int) -> int:
    gates = (4 if cell == "lstm" else 3) * hidden
    total = 0
    for layer in range(layers):
        width = inputs if layer == 0 else hidden
        total += 2 * steps * batch * gates * (width + hidden)
    return total


def _forward(fn: Callable, *args) -> object:
    with torch.no_grad():
        return fn(*args)


def _cudnn_without_tf32(fn: Callable, *args) -> object:
    allowed = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        return fn(*args)
    finally:
        torch.backends.cudnn.allow_tf32 = allowed


def _ours_with_tf32(fn: Callable, *args) -> object:
    with config.flags(allow_tf32=True):
        return fn(*args)


def _fwd_bwd(fn: Callable, x: torch.Tensor, params: list[torch.Tensor]) -> tuple:
    out, h = fn(x)
    outs = [out, *(h if isinstance(h, tuple) else (h,))]
    return torch.autograd.grad(outs, [x, *params], [torch.ones_like(o) for o in outs])


def _recurrence(cell: str, module: nn.RNNBase, x: torch.Tensor) -> Callable[[], None]:
    """The recurrent kernels of every layer on stand-in input projections (no GEMMs)."""
    steps, batch = x.shape[:2]
    gates = (4 if cell == "lstm" else 3) * module.hidden_size
    layers = []
    for layer in range(module.num_layers):
        whh = getattr(module, f"weight_hh_l{layer}").detach().unsqueeze(0).contiguous()
        bhh = getattr(module, f"bias_hh_l{layer}").detach().unsqueeze(0).contiguous()
        xp = torch.randn(steps, batch, 1, gates, device=x.device, dtype=x.dtype)
        h0 = torch.zeros(1, batch, module.hidden_size, device=x.device, dtype=x.dtype)
        layers.append((xp, whh, bhh, None, h0, h0 if cell == "lstm" else None, None, cell, False, None))

    def run() -> None:
        for args in layers:
            ops_rnn._forward(*args)

    return run


def _cases(cell: str, steps: int, batch: int, inputs: int, hidden: int, layers: int, dtype: torch.dtype):
    cls = nn.LSTM if cell == "lstm" else nn.GRU
    ours_fn = ops_rnn.lstm if cell == "lstm" else ops_rnn.gru
    module = cls(inputs, hidden, layers).to(DEVICE_TYPE, dtype)
    x = torch.randn(steps, batch, inputs, device=DEVICE_TYPE, dtype=dtype)
    weights = [w.detach() for w in module._flat_weights]
    anchor = "torch" if INTERPRET else "cudnn"
    label = f"{cell} T{steps} B{batch} I{inputs} H{hidden} L{layers} {_DT[dtype]}"
    flops = _flops(cell, steps, batch, inputs, hidden, layers)

    def ours(x: torch.Tensor, weights=weights) -> tuple:
        return ours_fn(x, None, weights, True, layers)

    tf32 = dtype == torch.float32 and not INTERPRET
    anchors = {anchor: partial(_forward, module, x)}
    if tf32:
        anchors["cudnn-no-tf32"] = partial(_cudnn_without_tf32, _forward, module, x)
    yield Case(
        f"{label} fwd",
        providers(
            tritondnn=partial(_forward, ours, x),
            tritondnn_tf32=partial(_ours_with_tf32, _forward, ours, x) if tf32 else None,
            tritondnn_recurrence=_recurrence(cell, module, x),
            **anchors,
        ),
        flops=flops,
    )
    xg = x.detach().clone().requires_grad_(True)
    params = [w.detach().clone().requires_grad_(True) for w in weights]

    def ours_grad(x: torch.Tensor) -> tuple:
        return ours_fn(x, None, params, True, layers)

    theirs = list(module.parameters())
    yield Case(
        f"{label} fwd+bwd",
        providers(
            tritondnn=partial(_fwd_bwd, ours_grad, xg, params),
            tritondnn_tf32=partial(_ours_with_tf32, _fwd_bwd, ours_grad, xg, params) if tf32 else None,
            **{anchor: partial(_fwd_bwd, module, xg, theirs)},
            **({"cudnn-no-tf32": partial(_cudnn_without_tf32, _fwd_bwd, module, xg, theirs)} if tf32 else {}),
        ),
        flops=3 * flops,
    )


def cases(quick: bool) -> Iterator[Case]:
    if not INTERPRET:
        torch.backends.cudnn.benchmark = True
    shapes = [(4, 2, 8, 8, 2), (3, 2, 8, 20, 1)] if INTERPRET else SHAPES
    for cell in ("lstm", "gru"):
        for i, (steps, batch, inputs, hidden, layers) in enumerate(shapes):
            dtypes = (torch.float32, torch.bfloat16) if i == 0 else (torch.float32,)
            for dtype in dtypes:
                yield from _cases(cell, steps, batch, inputs, hidden, layers, dtype)
            if quick:
                break
