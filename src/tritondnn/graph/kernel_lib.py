"""Jitted element functions generated graph kernels call (their globals are this module's names).

Generated code sees exactly ``GLOBALS``: Triton, ``tl`` and these functions, nothing else.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..core.numerics import convert
from ..ops.activation import activation_gradient, activation_value


@triton.jit
def nan_max(a, b):
    """torch.maximum: NaN in either operand gives NaN."""
    return tl.where((a > b) | (a != a), a, b)


@triton.jit
def nan_min(a, b):
    """torch.minimum: NaN in either operand gives NaN."""
    return tl.where((a < b) | (a != a), a, b)


@triton.jit
def power(a, b):
    """torch.pow for real operands: |a|**b through exp/log (fp32: about |b log a| * 6e-8 relative
    error), the sign of a negative base restored for integral exponents (NaN otherwise), and the
    special cases exact (0**0 = 1, 0**-1 = inf, 1**nan = 1)."""
    mag = tl.exp(b * tl.log(tl.abs(a)))
    integral = b == tl.floor(b)
    odd = integral & ((tl.abs(b) - 2.0 * tl.floor(tl.abs(b) * 0.5)) == 1.0)
    neg = tl.where(integral, tl.where(odd, -mag, mag), float("nan"))
    r = tl.where(a < 0, neg, mag)
    zero = tl.where(b > 0, 0.0, tl.where(b == 0, 1.0, tl.where(b < 0, float("inf"), float("nan"))))
    zero = tl.where(odd & (b < 0) & (a == 0) & (1.0 / a < 0), -zero, zero)  # (-0.0) ** -1 = -inf
    r = tl.where(a == 0, zero, r)
    return tl.where((b == 0) | (a == 1.0), 1.0, r)  # 1 ** nan == nan ** 0 == 1


@triton.jit
def multiply(a, b):
    """The combine function of product reductions."""
    return a * b


@triton.jit
def reduce_nan_max(acc, AXIS: tl.constexpr):
    """max over ``AXIS`` propagating NaN (tl.max may drop it on a GPU)."""
    is_nan = acc != acc
    has_nan = tl.max(is_nan.to(tl.int32), AXIS) > 0
    return tl.where(has_nan, float("nan"), tl.max(tl.where(is_nan, -float("inf"), acc), AXIS))


@triton.jit
def reduce_nan_min(acc, AXIS: tl.constexpr):
    """min over ``AXIS`` propagating NaN."""
    is_nan = acc != acc
    has_nan = tl.max(is_nan.to(tl.int32), AXIS) > 0
    return tl.where(has_nan, float("nan"), tl.min(tl.where(is_nan, float("inf"), acc), AXIS))


GLOBALS = {
    "triton": triton,
    "tl": tl,
    "convert": convert,
    "activation_value": activation_value,
    "activation_gradient": activation_gradient,
    "nan_max": nan_max,
    "nan_min": nan_min,
    "power": power,
    "multiply": multiply,
    "reduce_nan_max": reduce_nan_max,
    "reduce_nan_min": reduce_nan_min,
}
