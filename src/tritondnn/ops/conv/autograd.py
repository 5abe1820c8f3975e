"""Autograd for convolutions and transposed convolutions with their fused epilogues."""

from __future__ import annotations

import torch

from .plans import _dgrad_op, _forward_op, _wgrad_op
from .problem import channels_last, in_layout

# ---------------------------------------------------------------------------------------------
# Autograd.


def _as3(t: torch.Tensor, last: bool) -> torch.Tensor:
    """(1, pixels, C) for channels-last, (N, C, pixels) otherwise: views of a tensor in that layout."""
    if last:
        return t.movedim(1, -1).reshape(1, -1, t.shape[1])
    return t.reshape(t.shape[0], t.shape[1], -1)


def epilogue_grads(grad, pre, activation, p0, p1, want_bias, bias_dtype, last):
    """(dpre, dbias or None): the output gradient through the fused activation, and its channel sums."""
    if activation < 0 and not want_bias:
        return grad, None
    from ..matmul.library import _epilogue_backward

    grad = in_layout(grad, last)
    pre = None if pre is None else in_layout(pre, last)
    bias_kind = (1 if last else 2) if want_bias else 0
    g3 = _as3(grad, last)
    dpre3, dbias = _epilogue_backward(
        g3, None if pre is None else _as3(pre, last), activation, p0, p1, bias_kind, bias_dtype or grad.dtype
    )
    dpre = grad
    if activation >= 0:
        if last:
            dpre = dpre3.view(grad.shape[0], *grad.shape[2:], grad.shape[1]).movedim(-1, 1)
        else:
            dpre = dpre3.view(grad.shape)
    return dpre, (dbias if want_bias else None)


def _bias_dtype(bias):
    return None if bias is None else bias.dtype


class _ConvFunction(torch.autograd.Function):
    """y = act(alpha * conv(x, w) + beta * c + bias) + residual. Backward: dpre = dy * act'(pre)
    with its channel sums for the bias (one kernel), dx = alpha * dgrad(dpre), dw = alpha *
    wgrad(x, dpre), dc = beta * dpre, dresidual = dy."""

    @staticmethod
    def forward(
        ctx, x, w, bias, c, residual, geometry, alpha, beta, activation, p0, p1, store_pre, out_dtype, algo
    ):
        stride, pad_pre, pad_post, dilation, groups = geometry
        keep = activation >= 0
        y, pre = _forward_op(
            x,
            w,
            bias,
            c,
            residual,
            stride,
            pad_pre,
            pad_post,
            dilation,
            groups,
            alpha,
            beta,
            activation,
            p0,
            p1,
            store_pre or keep,
            out_dtype,
            algo,
        )
        ctx.save_for_backward(x, w, pre if keep else None)
        ctx.geometry = geometry
        ctx.params = (alpha, beta, activation, p0, p1, _bias_dtype(bias))
        ctx.dtypes = (None if c is None else c.dtype, None if residual is None else residual.dtype)
        ctx.mark_non_differentiable(pre)
        ctx.set_materialize_grads(False)  # no zeros for the pre-activation's (absent) gradient
        return y, pre

    @staticmethod
    def backward(ctx, grad, _grad_pre):
        if grad is None:
            return (None,) * 14
        x, w, pre = ctx.saved_tensors
        stride, pad_pre, _, dilation, groups = ctx.geometry
        alpha, beta, activation, p0, p1, bias_dtype = ctx.params
        need_x, need_w, need_bias, need_c, need_res = ctx.needs_input_grad[:5]
        last = channels_last(x)
        dpre, dbias = epilogue_grads(grad, pre, activation, p0, p1, need_bias, bias_dtype, last)
        dx = dw = dc = dres = None
        d = dpre.to(x.dtype)
        if need_x:
            dx = _dgrad_op(
                d,
                w,
                None,
                None,
                None,
                list(x.shape),
                stride,
                pad_pre,
                dilation,
                groups,
                alpha,
                0.0,
                -1,
                0.0,
                0.0,
                False,
                x.dtype,
                last,
                None,
            )[0]
        if need_w:
            dw = _wgrad_op(x, d, list(w.shape), stride, pad_pre, dilation, groups, None)
            dw = _like_param(dw if alpha == 1.0 else dw * alpha, w)
        if need_c:
            dc = (dpre * beta).to(ctx.dtypes[0])
        if need_res:
            dres = grad.to(ctx.dtypes[1])
        return dx, dw, dbias, dc, dres, *(None,) * 9


def _like_param(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``grad`` (contiguous) in ``param``'s strides (autograd's gradient layout contract: DDP's
    buckets and optimizers expect it), copied only where the element order differs: strides of
    size-1 dimensions place nothing (a 1x1 kernel's channels-last weight has contiguous order),
    so there a view with the param's strides is the same memory."""
    if grad.stride() == param.stride():
        return grad
    if all(g == w for g, w, n in zip(grad.stride(), param.stride(), param.shape) if n > 1):
        return grad.as_strided(param.shape, param.stride())
    return torch.empty_like(param, dtype=grad.dtype).copy_(grad)


class _ConvTransposeFunction(torch.autograd.Function):
    """y = act(alpha * dgrad(x, w) + beta * c + bias) + residual, dgrad of the convolution with
    this geometry. Backward: dx = alpha * conv(dpre, w), dw = alpha * wgrad(dpre, x)."""

    @staticmethod
    def forward(
        ctx, x, w, bias, c, residual, geometry, alpha, beta, activation, p0, p1, store_pre, out_dtype, algo
    ):
        out_size, stride, pad_pre, dilation, groups = geometry
        keep = activation >= 0
        last = channels_last(x)
        y, pre = _dgrad_op(
            x,
            w,
            bias,
            c,
            residual,
            list(out_size),
            stride,
            pad_pre,
            dilation,
            groups,
            alpha,
            beta,
            activation,
            p0,
            p1,
            store_pre or keep,
            out_dtype,
            last,
            algo,
        )
        ctx.save_for_backward(x, w, pre if keep else None)
        ctx.geometry = geometry
        ctx.params = (alpha, beta, activation, p0, p1, _bias_dtype(bias))
        ctx.dtypes = (None if c is None else c.dtype, None if residual is None else residual.dtype)
        ctx.mark_non_differentiable(pre)
        ctx.set_materialize_grads(False)  # no zeros for the pre-activation's (absent) gradient
        return y, pre

    @staticmethod
    def backward(ctx, grad, _grad_pre):
        if grad is None:
            return (None,) * 14
        x, w, pre = ctx.saved_tensors
        out_size, stride, pad_pre, dilation, groups = ctx.geometry
        alpha, beta, activation, p0, p1, bias_dtype = ctx.params
        need_x, need_w, need_bias, need_c, need_res = ctx.needs_input_grad[:5]
        last = channels_last(x)
        dpre, dbias = epilogue_grads(grad, pre, activation, p0, p1, need_bias, bias_dtype, last)
        d = dpre.to(x.dtype)
        dx = dw = dc = dres = None
        if need_x:
            # The convolution whose data gradient the forward was: its output is x's size.
            pad_post = [
                (i - 1) * s + dl * (k - 1) + 1 - o - a
                for i, s, dl, k, o, a in zip(
                    x.shape[2:], stride, dilation, w.shape[2:], out_size[2:], pad_pre
                )
            ]
            dx = _forward_op(
                d,
                w,
                None,
                None,
                None,
                stride,
                pad_pre,
                pad_post,
                dilation,
                groups,
                alpha,
                0.0,
                -1,
                0.0,
                0.0,
                False,
                x.dtype,
                None,
            )[0]
        if need_w:
            dw = _wgrad_op(d, x, list(w.shape), stride, pad_pre, dilation, groups, None)
            dw = _like_param(dw if alpha == 1.0 else dw * alpha, w)
        if need_c:
            dc = (dpre * beta).to(ctx.dtypes[0])
        if need_res:
            dres = grad.to(ctx.dtypes[1])
        return dx, dw, dbias, dc, dres, *(None,) * 9
