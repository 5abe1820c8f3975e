"""Autograd Functions with a second, non-differentiable output (stored pre-activation, LSE,
indices, dropout mask): backward must not materialize zeros for that output's absent gradient
(for a stored pre-activation that was a full-size fill kernel per layer), and must accept an
absent gradient for the differentiable output too."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from tests.helpers import DEVICE
from torch.utils._python_dispatch import TorchDispatchMode

import tritondnn as tdnn

# Ops a materialized zero gradient would show up as.
_ZERO_OPS = {"zeros", "zeros_like", "new_zeros", "zero_", "fill_"}


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE, requires_grad=True)


# Each case: (inputs needing gradients, function of them returning the differentiable output).
CASES = {
    "linear gelu (stored pre-activation)": lambda: (
        (x := _randn(6, 8), w := _randn(5, 8), b := _randn(5)),
        lambda: tdnn.linear(x, w, b, activation="gelu_tanh"),
    ),
    "sdpa (LSE)": lambda: ((q := _randn(1, 2, 8, 16),), lambda: tdnn.sdpa(q, q, q, is_causal=True)),
    "max_pool2d (indices)": lambda: ((x := _randn(1, 2, 6, 6),), lambda: tdnn.max_pool2d(x, 2)),
    "dropout (mask)": lambda: ((x := _randn(4, 32),), lambda: tdnn.dropout(x, 0.25)),
    "reduce max (indices)": lambda: ((x := _randn(4, 6),), lambda: tdnn.reduce_tensor(x, "max", 1)),
    "conv2d relu (stored pre-activation)": lambda: (
        (x := _randn(1, 3, 6, 6), w := _randn(4, 3, 3, 3)),
        lambda: tdnn.conv2d(x, w, padding=1, epilogue=tdnn.Epilogue(activation="relu")),
    ),
    "conv_transpose2d relu (stored pre-activation)": lambda: (
        (x := _randn(1, 3, 5, 5), w := _randn(3, 4, 3, 3)),
        lambda: tdnn.conv_transpose2d(x, w, epilogue=tdnn.Epilogue(activation="relu")),
    ),
}


# reduce max's backward scatters into zeros of its own, which would hide a materialized one.
@pytest.mark.parametrize("case", [c for c in CASES if not c.startswith("reduce")])
def test_no_zeros_for_the_extra_output(case):
    inputs, fn = CASES[case]()
    # A first backward builds the plans, and with them one-time workspaces (the bias gradient's
    # zeroed arrival counters); the second shows what every backward does.
    y = fn()
    y.backward(torch.randn_like(y))
    y = fn()
    grad = torch.randn_like(y)
    with _OpCounter() as counter:
        y.backward(grad)
    assert not _ZERO_OPS & set(counter.seen), dict(counter.seen)
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in inputs)


class _NoGradient(torch.autograd.Function):
    """Identity whose backward gives its input no gradient."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return None


@pytest.mark.parametrize("case", CASES)
def test_absent_output_gradient(case):
    inputs, fn = CASES[case]()
    y = fn()
    # The op's backward runs with no gradient for its output: nothing flows to its inputs but
    # through the second term.
    (_NoGradient.apply(y).sum() + sum(t.sum() for t in inputs)).backward()
    for t in inputs:
        torch.testing.assert_close(t.grad, torch.ones_like(t))
