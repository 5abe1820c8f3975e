"""Autograd for matmul and linear: the backward pass runs the same product kernels on transposed
operands, and the epilogue's backward (activation gradient, bias gradient) in one kernel."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ...core.autocast import lowered, lowered_weight
from ...core.library import direct_call, functorch_active, raw_apply
from .engines import padded_rows
from .library import _epilogue_backward, _forward, epilogue_grads
from .plans import as_batches, backward_plan, forward_plan


def _product(a, b, c, bias, residual, alpha, beta, bias_kind, activation, p0, p1, store_pre, out_dtype,
             shape=None):  # fmt: skip
    """(out, pre or None) of the matmul op with no fp8 scales or amax: its plan called directly in
    eager mode (no placeholder tensors for the absent outputs), the op when tracing. ``shape``:
    the output's shape if not the product's (the same elements, e.g. rows split into a batch)."""
    if direct_call(a):
        run = forward_plan(a, b, c, bias, residual, False, out_dtype, bias_kind, activation, store_pre, False)
        out, pre, _ = run(a, b, c, bias, residual, None, None, alpha, beta, p0, p1, shape)
        return out, pre
    flags = (bias_kind, activation, p0, p1, store_pre, False, out_dtype)
    out, pre, _ = _forward(a, b, c, bias, residual, None, None, alpha, beta, *flags)
    return (out if shape is None else out.reshape(shape)), (pre if store_pre else None)


def _grad_epilogue(grad, pre, activation, p0, p1, bias_kind, bias_dtype):
    """``_epilogue_backward``'s (dpre or None, dbias or None), its plan called directly in eager mode."""
    if direct_call(grad):
        return epilogue_grads(grad, pre, activation, p0, p1, bias_kind, bias_dtype)
    dpre, dbias = _epilogue_backward(grad, pre, activation, p0, p1, bias_kind, bias_dtype)
    return (dpre if activation >= 0 else None), (dbias if bias_kind else None)


class _Backward:
    """The operand and bias gradients of one forward plan, for one gradient layout and one set of
    wanted gradients, in eager mode without c or residual. The plans it runs are looked up, on
    views of the saved tensors, on its first call; later calls hand the saved tensors to them
    directly (plans read only data pointers): no views, no lookups, tens of microseconds of host
    time less a call."""

    def __init__(self, rows, transposed, activation, bias_kind, bias_dtype, need_a, need_b, grad_dtypes):
        self.rows, self.transposed, self.activation = rows, transposed, activation
        self.bias_kind, self.bias_dtype = bias_kind, bias_dtype  # bias_kind 0: no bias gradient
        self.need_a, self.need_b = need_a, need_b
        self.grad_dtypes = grad_dtypes  # (dA's, dB's) where the operands were cast inside, else None
        self.epilogue = self.da = self.db = None
        self.cast = None  # the operands' dtype when the gradient through the epilogue is wider
        self.pad = False  # the gradient's rows are copied to 16-byte-aligned storage first
        self.db_order = ""  # "t": dB^T's kernel (rows of B^T contiguous); "tt": its transpose viewed
        self.ready = False

    def __call__(self, grad, x, y, pre, alpha, p0, p1):
        first = not self.ready
        if first:
            raw, grad = grad, self._plan_epilogue(grad, x, y, pre)
        d, dbias = grad, None
        if self.epilogue is not None:
            dpre, dbias = self.epilogue(grad, pre, p0, p1)
            d = grad if dpre is None else dpre
        if self.cast is not None:
            d = d.to(self.cast)
        if first:
            d = self._plan_products(d, x, y)
        elif self.pad:
            d = padded_rows(d.reshape(-1, d.shape[-1]))
        da = db = None
        if self.da is not None:
            shape = x.shape if self.rows is not None else None
            da = self.da(d, y, None, None, None, None, None, alpha, 0.0, 0.0, 0.0, shape)[0]
        if self.db is not None:
            operands = (x, d) if not self.db_order else (d, x)
            db = self.db(*operands, None, None, None, None, None, alpha, 0.0, 0.0, 0.0)[0]
            db = db.mT if self.db_order == "tt" else db
        if first:
            # Later calls pass the raw gradient: only if the one seen here was a view of it, not a copy.
            self.ready = grad.data_ptr() == raw.data_ptr()
        return da, db, dbias

    def _plan_epilogue(self, grad, x, y, pre):
        """The epilogue's plan and the dtype cast after it; returns the gradient as the product's
        rows (a view of ``grad`` where its layout allows)."""
        n = y.shape[-2] if self.transposed else y.shape[-1]
        g = grad if self.rows is None else grad.reshape(self.rows[0], n)
        if self.activation >= 0 or self.bias_kind:
            m = g.shape[-2]
            g3, pre3 = as_batches(g, m, n), None if pre is None else as_batches(pre, m, n)
            self.epilogue = backward_plan(g3, pre3, self.activation, self.bias_kind, self.bias_dtype)
        d_dtype = pre.dtype if self.activation >= 0 else g.dtype
        self.cast = x.dtype if d_dtype != x.dtype else None
        return g

    def _plan_products(self, d, x, y):
        """The two products' plans, on views of this call's tensors; returns ``d`` as they read it
        (one aligned copy for both where its rows are not 16-byte aligned: logits over a vocabulary)."""
        a = x if self.rows is None else x.view(self.rows)
        b = y.mT if self.transposed else y
        padded = padded_rows(d) if self.need_a and self.need_b else None
        if padded is not None:
            self.pad, d = True, padded
        da_dtype, db_dtype = self.grad_dtypes or (a.dtype, b.dtype)
        if self.need_a:
            self.da = forward_plan(d, b.mT, None, None, None, False, da_dtype, 0, -1, False, False)
        if self.need_b:
            # The gradient in the memory order of the B the caller has: a transposed weight's (or
            # a column-major B's) as (dpre^T A)^T, so it lands in the weight's own layout
            # (autograd copies a gradient whose strides differ from its parameter's).
            if _grad_transposed(b, self.transposed):
                self.db_order = "t" if self.transposed else "tt"
                operands = (d.mT, a)
            else:
                operands = (a.mT, d)
            self.db = forward_plan(*operands, None, None, None, False, db_dtype, 0, -1, False, False)
        return d


def _operand_grads(
    grad, x, y, pre, alpha, p0, p1, grad_dtypes, rows, transposed, activation, bias_kind, bias_dtype,
    need_a, need_b, need_bias,
):  # fmt: skip
    """(dA, dB, dbias, dpre, the gradient as the product's rows) through the matmul op's kernels:
    plans called directly in eager mode, the custom ops when tracing (compiled autograd, a
    gradient that is not a plain tensor), where ``_Backward`` needs plain tensors."""
    a = x if rows is None else x.view(rows)
    b = y.mT if transposed else y
    if rows is not None:  # the output was allocated in the caller's shape
        grad = grad.reshape(rows[0], b.shape[-1])
    dpre, dbias = grad, None
    if activation >= 0 or (need_bias and bias_kind):
        dpre_t, dbias = _grad_epilogue(
            grad, pre, activation, p0, p1, bias_kind if need_bias else 0, bias_dtype
        )
        dpre = grad if dpre_t is None else dpre_t
    da = db = None
    if need_a or need_b:
        d = dpre if dpre.dtype == a.dtype else dpre.to(a.dtype)
        # One 16-byte-aligned copy for both products where the rows are not (logits over a
        # vocabulary), as in _Backward: each product would repack its own. Under torch.compile
        # it matters most: dynamo hands an autograd.Function's backward contiguous gradients,
        # so the loss's aligned gradient rows arrive here unaligned, and inductor fuses its
        # contiguous copy into this one.
        padded = padded_rows(d) if need_a and need_b else None
        d = d if padded is None else padded
        none = (None,) * 3
        da_dtype, db_dtype = grad_dtypes or (a.dtype, b.dtype)
        if need_a:
            shape = x.shape if rows else None
            da = _product(d, b.mT, *none, alpha, 0.0, 0, -1, 0.0, 0.0, False, da_dtype, shape)[0]
        if need_b:  # in B's memory order, as in _Backward
            if _grad_transposed(b, transposed):
                db = _product(d.mT, a, *none, alpha, 0.0, 0, -1, 0.0, 0.0, False, db_dtype)[0]
                db = db if transposed else db.mT
            else:
                db = _product(a.mT, d, *none, alpha, 0.0, 0, -1, 0.0, 0.0, False, db_dtype)[0]
    return da, db, dbias, dpre, grad


class _MatmulFunction(torch.autograd.Function):
    """Forward through the matmul op; backward: dpre = g * act'(pre), dA = alpha dpre B^T,
    dB = alpha A^T dpre (the same kernels, on transposed views), dbias = sum of dpre,
    dC = beta dpre, dresidual = g (each summed over the dimensions its input was broadcast on).
    Returns the output, and the pre-activation too when ``store_pre``.

    The cached eager path of ``linear`` passes the operands as the caller has them and makes the
    views inside, where autograd records none (each recorded view costs host time twice): A is
    viewed as ``rows`` (batch dimensions merged into its rows), B is read transposed when
    ``transposed`` (a weight), and the output is allocated as ``out_shape``. In eager mode the
    backward pass of a forward plan is kept on it (``_Backward``). That path also passes the
    forward ``plan`` it looked up once for its key (then A and B are not viewed here at all), and
    under autocast the dtype ``cast`` that A and B are cast to here, inside this node, rather than
    by cast nodes of their own: their gradients come out of the products in their own dtypes."""

    @staticmethod
    def forward(ctx, a, b, c, bias, residual, alpha, beta, bias_kind, activation, p0, p1, store_pre,
                out_dtype, rows=None, transposed=False, out_shape=None, plan=None, cast=None):  # fmt: skip
        keep = activation >= 0
        ctx.grad_dtypes = None
        if cast is not None:
            ctx.grad_dtypes = (a.dtype, b.dtype)
            a, b = lowered(a, cast), lowered_weight(b, cast)
        x, y = a, b
        ctx.plan = plan
        if plan is None:  # with a plan, the launches read only data pointers: no views needed
            a = a if rows is None else a.view(rows)
            b = b.mT if transposed else b
            if direct_call(a):
                flags = (out_dtype, bias_kind, activation, store_pre or keep, False)
                plan = ctx.plan = forward_plan(a, b, c, bias, residual, False, *flags)
        if plan is not None:
            out, pre, _ = plan(a, b, c, bias, residual, None, None, alpha, beta, p0, p1, out_shape)
        else:
            out, pre = _product(
                a, b, c, bias, residual, alpha, beta, bias_kind, activation, p0, p1, store_pre or keep,
                out_dtype, out_shape,
            )  # fmt: skip
        ctx.save_for_backward(x, y, pre if keep else None)
        ctx.params = (alpha, beta, bias_kind, activation, p0, p1, rows, transposed)
        ctx.meta = tuple(None if t is None else (t.shape, t.dtype) for t in (c, bias, residual))
        if not store_pre:
            return out
        ctx.mark_non_differentiable(pre)
        ctx.set_materialize_grads(False)  # no zeros for the pre-activation's (absent) gradient
        return out, pre

    @staticmethod
    def backward(ctx, grad, *_grad_pre):
        if grad is None:
            return (None,) * 18
        x, y, pre = ctx.saved_tensors
        alpha, beta, bias_kind, activation, p0, p1, rows, transposed = ctx.params
        c_meta, bias_meta, residual_meta = ctx.meta
        need_a, need_b, need_c, need_bias, need_residual = ctx.needs_input_grad[:5]
        bias_dtype = bias_meta[1] if bias_meta else grad.dtype
        grad_dtypes = ctx.grad_dtypes
        flags = (rows, transposed, activation, bias_kind, bias_dtype, need_a, need_b, need_bias)
        if ctx.plan is not None and c_meta is None and residual_meta is None and direct_call(grad):
            program = _backward_program(ctx.plan, grad, grad_dtypes, *flags)
            da, db, dbias = program(grad, x, y, pre, alpha, p0, p1)
            return _summed(da, x), _summed(db, y), None, dbias, None, *(None,) * 13
        da, db, dbias, dpre, grad = _operand_grads(grad, x, y, pre, alpha, p0, p1, grad_dtypes, *flags)
        dc = dres = None
        if need_c:
            dc = (dpre * beta).sum_to_size(c_meta[0]).to(c_meta[1])
        if need_residual:
            dres = grad.sum_to_size(residual_meta[0]).to(residual_meta[1])
        return _summed(da, x), _summed(db, y), dc, dbias, dres, *(None,) * 13


_apply = raw_apply(_MatmulFunction)


def _backward_program(
    plan, grad, grad_dtypes, rows, transposed, activation, bias_kind, bias_dtype, need_a, need_b, need_bias
) -> _Backward:
    """The ``_Backward`` kept on forward ``plan`` for this gradient's layout and the gradients
    wanted (made on first use)."""
    key = (rows is None, transposed, need_a, need_b, need_bias, grad.shape, grad.stride(), grad.dtype)
    key += (grad_dtypes,)
    program = plan.backward.get(key)
    if program is None:
        bias = bias_kind if need_bias else 0
        program = plan.backward[key] = _Backward(
            rows, transposed, activation, bias, bias_dtype, need_a, need_b, grad_dtypes
        )
    return program


class Product(NamedTuple):
    """A linear's cached eager call as a chain of products runs it: the forward ``plan`` (its
    output allocated as ``out_shape`` where not None, A read as ``rows``), the bias kind and the
    epilogue's activation (stored pre-activation where >= 0) with its parameters."""

    plan: Any
    rows: tuple | None
    out_shape: tuple | None
    bias_kind: int
    activation: int
    p0: float
    p1: float


def pair_forward(x, w1, b1, w2, b2, first: Product, second: Product, cast) -> tuple:
    """``linear(act(linear(x, w1, b1)), w2, b2)`` through the two products' plans: (the output,
    the tensors the backward reads, what else it needs). Under autocast (``cast``) the operands
    are cast here, as each product's node casts them; the tensors kept are the two nodes'."""
    dtypes1 = dtypes2 = None
    if cast is not None:
        dtypes1 = (x.dtype, w1.dtype)
        x, w1 = lowered(x, cast), lowered_weight(w1, cast)
    h, pre1, _ = first.plan(x, w1, None, b1, None, None, None, 1.0, 0.0, first.p0, first.p1,
                            first.out_shape)  # fmt: skip
    if cast is not None:
        dtypes2 = (h.dtype, w2.dtype)
        h, w2 = lowered(h, cast), lowered_weight(w2, cast)
    out, pre2, _ = second.plan(h, w2, None, b2, None, None, None, 1.0, 0.0, second.p0, second.p1,
                               second.out_shape)  # fmt: skip
    bias_dtypes = tuple(None if b is None else b.dtype for b in (b1, b2))
    return out, (x, w1, pre1, h, w2, pre2), (first, second, dtypes1, dtypes2, *bias_dtypes)


def pair_backward(grad, saved, chain, need_x, need_w1, need_b1, need_w2, need_b2) -> tuple:
    """(dx, dw1, db1, dw2, db2) from the output's gradient and ``pair_forward``'s ``saved`` and
    ``chain``: the second product's ``_Backward`` program, then the first's on its input's
    gradient (Nones where not wanted)."""
    x, w1, pre1, h, w2, pre2 = saved
    first, second, dtypes1, dtypes2, b1_dtype, b2_dtype = chain
    need_h = need_x or need_w1 or need_b1
    flags = (second.activation, second.bias_kind, b2_dtype or grad.dtype, need_h, need_w2, need_b2)
    dh, dw2, db2 = _product_grads(second, grad, h, w2, pre2, dtypes2, *flags)
    dx = dw1 = db1 = None
    if need_h:
        flags = (first.activation, first.bias_kind, b1_dtype or dh.dtype, need_x, need_w1, need_b1)
        dx, dw1, db1 = _product_grads(first, dh, x, w1, pre1, dtypes1, *flags)
    return dx, dw1, db1, dw2, db2


def _product_grads(product: Product, grad, x, w, pre, grad_dtypes, activation, bias_kind, bias_dtype,
                   need_x, need_w, need_bias) -> tuple:  # fmt: skip
    """(dx, dw, dbias) of one product of a chain: its ``_Backward`` program, or where the gradient
    is not a plain tensor of an eager call (compiled autograd traces the backward) the op's
    traceable path."""
    flags = (activation, bias_kind, bias_dtype, need_x, need_w, need_bias)
    if direct_call(grad):
        program = _backward_program(product.plan, grad, grad_dtypes, product.rows, True, *flags)
        return program(grad, x, w, pre, 1.0, product.p0, product.p1)
    args = (grad, x, w, pre, 1.0, product.p0, product.p1, grad_dtypes, product.rows, True)
    return _operand_grads(*args, *flags)[:3]


def no_double_backward(what: str, remedy: str = "patch the model without fuse=True") -> None:
    """Fused nodes' backwards are not differentiable: autograd runs them with grad mode on only
    for ``create_graph=True``, whose gradients would silently treat them as constants."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"tritondnn: a fused {what} node has no double backward (create_graph=True); "
            f"{remedy} for higher-order gradients"
        )


class _LinearPairFunction(torch.autograd.Function):
    """``linear(act(linear(x, w1, b1)), w2, b2)`` as one node, where the first product's output
    feeds only the second (a ``Sequential(Linear, activation, Linear)``, a transformer's MLP):
    both products' plans forward, both ``_Backward`` programs backward (the second's gradient of
    its input is the first's output gradient), one node's host time in each pass instead of two."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, first, second, cast):
        out, saved, ctx.chain = pair_forward(x, w1, b1, w2, b2, first, second, cast)
        ctx.save_for_backward(*saved)
        return out

    @staticmethod
    def backward(ctx, grad):
        no_double_backward("pair of linear layers (a patched Sequential's)", "unpatch the model")
        return *pair_backward(grad, ctx.saved_tensors, ctx.chain, *ctx.needs_input_grad[:5]), None, None, None


_apply_pair = raw_apply(_LinearPairFunction)


def linear_pair(x, w1, b1, w2, b2, first: Product, second: Product, cast: torch.dtype | None) -> torch.Tensor:
    """``_LinearPairFunction``'s node (without its Python wrapper unless a functorch transform is
    active): for autograd-recorded calls of two linears whose cached calls gave ``first`` and
    ``second`` on tensors like these."""
    args = (x, w1, b1, w2, b2, first, second, cast)
    return _LinearPairFunction.apply(*args) if functorch_active() else _apply_pair(*args)


def apply_eager(*args):
    """``_MatmulFunction.apply`` for the cached eager paths: without its Python wrapper unless a
    functorch transform is active."""
    return _MatmulFunction.apply(*args) if functorch_active() else _apply(*args)


def _grad_transposed(b: torch.Tensor, transposed: bool) -> bool:
    """Whether B's gradient is computed as (dpre^T A)^T: for a weight read transposed, or a
    column-major B, so that it lands in the memory order of the tensor the caller has."""
    return transposed or (b.ndim == 2 and b.stride(0) == 1 and b.stride(1) != 1)


def _summed(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
    """``grad`` summed over the dimensions ``like`` was broadcast along."""
    return grad if grad is None or grad.shape == like.shape else grad.sum_to_size(like.shape)
