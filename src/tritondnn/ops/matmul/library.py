"""The matmul family's torch.library ops: the product with its epilogue, and the epilogue's backward.

Operands have rank >= 2; c and residual have the output's full shape. Eager calls on plain
tensors run the implementations directly (``core.library.custom_op``); ``autograd`` calls their
plans directly where it can.
"""

from __future__ import annotations

import torch

from ...core.library import custom_op
from ...core.strides import broadcast_shapes
from .engines import preactivation_dtype
from .plans import as_batches, backward_plan, forward_plan


def _out_shape(a: torch.Tensor, b: torch.Tensor) -> tuple[int, ...]:
    return (*broadcast_shapes(a.shape[:-2], b.shape[:-2]), a.shape[-2], b.shape[-1])


def _fake_forward(a, b, c, bias, residual, scale_a, scale_b, alpha, beta, bias_kind, activation, p0, p1,
                  store_pre, amax, out_dtype, fast_accum=False, tf32x3=False):  # fmt: skip
    shape = _out_shape(a, b)
    return (
        a.new_empty(shape, dtype=out_dtype),
        a.new_empty(shape, dtype=preactivation_dtype(a.dtype, out_dtype))
        if store_pre
        else a.new_empty(0, dtype=out_dtype),
        a.new_empty(() if amax else (0,), dtype=torch.float32),
    )


@custom_op(
    "matmul",
    "(Tensor a, Tensor b, Tensor? c, Tensor? bias, Tensor? residual, Tensor? scale_a, Tensor? scale_b, "
    "float alpha, float beta, int bias_kind, int activation, float p0, float p1, bool store_pre, bool amax, "
    "ScalarType out_dtype, bool fast_accum=False, bool tf32x3=False) -> (Tensor, Tensor, Tensor)",
    _fake_forward,
)
def _forward(a, b, c, bias, residual, scale_a, scale_b, alpha, beta, bias_kind, activation, p0, p1,
             store_pre, amax, out_dtype, fast_accum=False, tf32x3=False):  # fmt: skip
    """The product and its epilogue (see ``matmul``); absent pre-activation and amax come back as
    empty tensors (an op returns tensors only). ``tf32x3``: fp32 products as three TF32 products
    (see ``engines.MatmulProblem``)."""
    run = forward_plan(
        a, b, c, bias, residual, scale_a is not None, out_dtype, bias_kind, activation, store_pre, amax,
        fast_accum, tf32x3,
    )  # fmt: skip
    out, pre, am = run(a, b, c, bias, residual, scale_a, scale_b, alpha, beta, p0, p1)
    return (
        out,
        out.new_empty(0) if pre is None else pre,
        out.new_empty(0, dtype=torch.float32) if am is None else am,
    )


def _fake_backward(grad, pre, activation, p0, p1, bias_kind, bias_dtype):
    m, n = grad.shape[-2:]
    return (
        grad.new_empty(
            grad.shape if activation >= 0 else (0,), dtype=grad.dtype if pre is None else pre.dtype
        ),
        grad.new_empty((n if bias_kind == 1 else m) if bias_kind else 0, dtype=bias_dtype),
    )


@custom_op(
    "matmul_epilogue_backward",
    "(Tensor grad, Tensor? pre, int activation, float p0, float p1, int bias_kind, ScalarType bias_dtype) "
    "-> (Tensor, Tensor)",
    _fake_backward,
)
def _epilogue_backward(grad, pre, activation, p0, p1, bias_kind, bias_dtype):
    """(dpre, dbias) from the output gradient and the stored pre-activation, both (..., M, N)."""
    dpre, dbias = epilogue_grads(grad, pre, activation, p0, p1, bias_kind, bias_dtype)
    return (
        grad.new_empty(0) if dpre is None else dpre,
        grad.new_empty(0, dtype=bias_dtype) if dbias is None else dbias,
    )


def epilogue_grads(grad, pre, activation, p0, p1, bias_kind, bias_dtype):
    """``_epilogue_backward``'s implementation with absent results as None: (dpre in grad's shape
    where there is an activation, dbias where there is a bias kind)."""
    m, n = grad.shape[-2:]
    g3, pre3 = as_batches(grad, m, n), None if pre is None else as_batches(pre, m, n)
    dpre, dbias = backward_plan(g3, pre3, activation, bias_kind, bias_dtype)(g3, pre3, p0, p1)
    return None if dpre is None else dpre.view(grad.shape), dbias
