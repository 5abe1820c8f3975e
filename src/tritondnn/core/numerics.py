"""Elementary functions for kernels, accurate to a few ulps in fp32 and fp64.

Triton's ``libdevice`` bindings do not run under the interpreter, and the obvious formulas lose
precision where it matters (``exp(x) - 1`` and ``log(1 + x)`` near zero, ``tanh`` of small x), so
the few functions the activations and recurrent cells need are written here from ``exp``/``log``.
In fp32 they avoid divisions and extra logs (short polynomials near 0), so pointwise kernels on
bf16 tensors stay memory-bound; fp64 (used for gradcheck) takes the classic exact corrections.
``online_exp_sum`` is the running max-and-sum step that softmax and cross entropy share.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .backend import INTERPRET

_COMPILED = tl.constexpr(not INTERPRET)


@triton.jit
def exp2_ftz(x):
    """2**x for fp32 x, subnormal results flushed to 0. Compiled, ``ex2.approx.ftz`` is one MUFU
    instruction, where ``tl.exp2`` adds a range test and two predicated multiplies to produce
    subnormals."""
    if _COMPILED:
        return tl.inline_asm_elementwise(
            "ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return tl.exp2(x)


@triton.jit
def reciprocal_ftz(x):
    """1 / x for fp32 x (about 1 ulp), flushing subnormals: one MUFU instruction compiled, where
    the division adds a range test and scaling for huge x."""
    if _COMPILED:
        return tl.inline_asm_elementwise(
            "rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return 1.0 / x


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
    rounding, and needed under the interpreter, which converts those pairs bit-wrongly. The
    interpreter also rounds fp32 to bf16 toward zero: there it is rounded to nearest even here,
    as a GPU and PyTorch round (a kernel's bf16 copy of a value must match ``.to``'s bits)."""
    if x.dtype == tl.bfloat16 and dtype == tl.float64:
        return x.to(tl.float32).to(dtype)
    elif (x.dtype == tl.float64 or x.dtype == tl.float32) and dtype == tl.bfloat16:
        x32 = x.to(tl.float32)
        if _COMPILED:
            low = x32.to(dtype)
        else:  # the rounded high half, as bits (the interpreter's conversion flushes subnormals)
            bits = x32.to(tl.uint32, bitcast=True)
            nearest = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
            nan = tl.full(bits.shape, 0x7FC0, tl.uint32)  # PyTorch's NaN in bf16
            low = tl.where(x32 != x32, nan, nearest).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return low
    else:
        return x.to(dtype)


@triton.jit
def online_exp_sum(m, s, x):
    """One block of a running maximum ``m`` and a sum ``s`` of ``exp(x - m)`` rescaled to it, over
    the rows of ``x`` (reduced along axis 1): returns the updated (m, s). Rows that have seen only
    -inf keep a sum of 0 instead of exp(-inf - -inf) = NaN."""
    m_new = tl.maximum(m, tl.max(x, 1))
    shift = tl.where(m_new == -float("inf"), 0.0, m_new)
    return m_new, s * tl.exp(m - shift) + tl.sum(tl.exp(x - shift[:, None]), 1)


@triton.jit
def expm1(x):
    """exp(x) - 1 without cancellation near 0.

    fp32: a degree-6 Taylor polynomial below |x| = 0.25 (error under 5e-8 relative), exp(x) - 1
    above (cancellation costs at most a factor 4.5 there): no division or log, so bf16 tensors
    stay memory-bound. fp64: Kahan's exp(x) - 1 scaled by x / log(exp(x)), exact to a few ulps.
    """
    u = tl.exp(x)
    um1 = u - 1.0
    if x.dtype == tl.float64:
        # u == 1: x is below half an ulp. u - 1 == -1: exp underflowed. u == inf: overflow.
        corrected = um1 * (x / tl.log(u))
        return tl.where(u == 1.0, x, tl.where((um1 == -1.0) | (u == float("inf")), um1, corrected))
    else:
        poly = 1.0 / 720.0
        poly = poly * x + 1.0 / 120.0
        poly = poly * x + 1.0 / 24.0
        poly = poly * x + 1.0 / 6.0
        poly = poly * x + 0.5
        small = x + x * x * poly
        return tl.where(tl.abs(x) < 0.25, small, um1)


@triton.jit
def log1p(x):
    """log(1 + x) without cancellation near 0.

    fp32: a degree-5 Taylor polynomial below |x| = 0.05 (error under 5e-8 relative), log(1 + x)
    above (the rounding of 1 + x costs at most 1.2e-6 relative there). fp64: Goldberg's
    log(1 + x) scaled by x / ((1 + x) - 1), exact to a few ulps.
    """
    u = 1.0 + x
    if x.dtype == tl.float64:
        d = u - 1.0
        corrected = tl.log(u) * (x / d)
        return tl.where(d == 0.0, x, tl.where(u == float("inf"), u, corrected))
    else:
        poly = 1.0 / 5.0
        poly = poly * x - 1.0 / 4.0
        poly = poly * x + 1.0 / 3.0
        poly = poly * x - 0.5
        small = x + x * x * poly
        return tl.where(tl.abs(x) < 0.05, small, tl.log(u))


@triton.jit
def normal_cdf(x):
    """(Phi(x), exp(-x * x / 2)): the standard normal CDF and its density times sqrt(2 pi).

    fp32: the upper tail Q(z) = exp(-z * z / 2) * t * P(t) with z = |x|, t = 1 / (1 + 0.255 z)
    and P of degree 7, fitted for the least relative error over z <= 6 (1.1e-7; beyond, where Q
    is under 1e-9, under 5e-4); Phi is Q for x < 0 and 1 - Q above. The lower tail has no
    cancellation (0.5 * (1 + erf(x / sqrt 2)) loses every digit below x = -5.5), and the cost is
    two MUFU operations and about 16 instructions, where libdevice's erf took 32 and spilled
    registers in a GEMM epilogue. fp64: erf.
    """
    if x.dtype == tl.float64:
        return 0.5 * (1.0 + tl.erf(x * 0.7071067811865476)), tl.exp(-0.5 * x * x)
    else:
        e = exp2_ftz(x * x * -0.7213475204444817)  # log2(e) / 2; 0 below x = -13.2
        t = reciprocal_ftz(1.0 + 0.255 * tl.abs(x))
        p = -0.0849480856
        p = p * t + 0.293745581
        p = p * t - 0.199203528
        p = p * t + 0.234589836
        p = p * t + 0.0436633843
        p = p * t + 0.111148643
        p = p * t + 0.101004115
        q = e * (p * t)
        return tl.where(x < 0, q, 1.0 - q), e


@triton.jit
def sigmoid(x):
    """1 / (1 + exp(-x)); exact limits 0 and 1, no overflow warning paths."""
    return one_over_one_plus(tl.exp(-x))


@triton.jit
def one_over_one_plus(e):
    """1 / (1 + e). fp32 takes the reciprocal instruction (about 1 ulp) instead of the IEEE
    division's dozen: a fused GroupNorm + SiLU over bf16 is otherwise bound by the division's
    issue slots."""
    if e.dtype == tl.float32:
        return reciprocal_ftz(1.0 + e)
    else:
        return 1.0 / (1.0 + e)


@triton.jit
def tanh(x):
    """tanh(x), odd.

    fp32: a Taylor polynomial through x**11 below |x| = 0.3 (exact to 2e-9 relative), above it
    (1 - e) / (1 + e) with e = exp(-2|x|), which loses at most a bit to cancellation.
    fp64: -m / (2 + m) with m = expm1(-2|x|), exact to a few ulps everywhere.
    """
    ax = tl.abs(x)
    if x.dtype == tl.float64:
        m = expm1(-2.0 * ax)
        big = -m / (2.0 + m)
        return tl.where(x < 0, -big, big)
    else:
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
