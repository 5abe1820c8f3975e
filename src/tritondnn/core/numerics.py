"""Elementary functions for kernels, accurate to a few ulps in fp32 and fp64.

Triton's ``libdevice`` bindings do not run under the interpreter, and the obvious formulas lose
precision where it matters (``exp(x) - 1`` and ``log(1 + x)`` near zero, ``tanh`` of small x), so
the few functions the activations and recurrent cells need are written here from ``exp``/``log``
with the classic corrections. They compile to the same handful of instructions on a GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def upcast(x):
    """The arithmetic type for ``x``: fp64 stays fp64, everything else computes in fp32."""
    if x.dtype == tl.float64:
        return x
    else:
        return x.to(tl.float32)


@triton.jit
def convert(x, dtype: tl.constexpr):
    """``x.to(dtype)``, through fp32 between bf16 and fp64: exact on a GPU up to one rare double
    rounding, and needed under the interpreter, which converts those pairs bit-wrongly."""
    if (x.dtype == tl.bfloat16 and dtype == tl.float64) or (x.dtype == tl.float64 and dtype == tl.bfloat16):
        return x.to(tl.float32).to(dtype)
    else:
        return x.to(dtype)


@triton.jit
def expm1(x):
    """exp(x) - 1 without cancellation near 0 (Kahan: scale by x / log(exp(x)))."""
    u = tl.exp(x)
    um1 = u - 1.0
    # u == 1: x is below half an ulp, expm1(x) == x. u - 1 == -1: exp underflowed, the result is -1.
    # Large x: u is inf and so is the result; guard the inf/inf that the correction would form.
    corrected = um1 * (x / tl.log(u))
    return tl.where(u == 1.0, x, tl.where((um1 == -1.0) | (u == float("inf")), um1, corrected))


@triton.jit
def log1p(x):
    """log(1 + x) without cancellation near 0 (Goldberg: scale by x / ((1 + x) - 1))."""
    u = 1.0 + x
    d = u - 1.0
    corrected = tl.log(u) * (x / d)
    return tl.where(d == 0.0, x, tl.where(u == float("inf"), u, corrected))


@triton.jit
def sigmoid(x):
    """1 / (1 + exp(-x)); exact limits 0 and 1, no overflow warning paths."""
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def tanh(x):
    """tanh(x): an odd Taylor polynomial below |x| = 0.3, (1 - e) / (1 + e) with e = exp(-2|x|) above.

    Below 0.3 the series through x**11 is exact to 2e-9 relative; above it the quotient loses at most
    a bit to cancellation. ``exp`` of a non-positive argument never overflows.
    """
    ax = tl.abs(x)
    e = tl.exp(-2.0 * ax)
    big = (1.0 - e) / (1.0 + e)
    big = tl.where(x < 0, -big, big)
    x2 = x * x
    poly = -1382.0 / 155925.0
    poly = poly * x2 + 62.0 / 2835.0
    poly = poly * x2 - 17.0 / 315.0
    poly = poly * x2 + 2.0 / 15.0
    poly = poly * x2 - 1.0 / 3.0
    small = x + x * x2 * poly
    return tl.where(ax < 0.3, small, big)
