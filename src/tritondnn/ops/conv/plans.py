"""Per-shape plans and the torch.library ops of the convolution family.

A plan is built on the first call with given shapes, strides, dtypes and options: the problem is
described, an engine chosen (heuristic, benchmark mode or a forced ``algo``) and bound; later calls
cost a dictionary lookup, the output's allocation and the launches. The ops
(``torch.ops.tritondnn.conv_forward``, ``conv_dgrad``, ``conv_wgrad``) have fake implementations,
so ``torch.compile`` traces through them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...core.config import config
from ...core.errors import NotSupportedError
from ...core.library import custom_op
from .engines import DGRAD_FAMILY, FAMILY, WGRAD_FAMILY, ImplicitGemmEngine
from .problem import (
    ConvProblem,
    channels_last,
    dtype_name,
    empty_conv_tensor,
    in_layout,
    output_size,
    pad3,
    strides5,
)

# ---------------------------------------------------------------------------------------------
# Problems and per-shape plans.


def make_problem(
    direction: str,
    x: tuple[Sequence[int], tuple],
    w: tuple[Sequence[int], tuple],
    y: tuple[Sequence[int], tuple],
    stride: Sequence[int],
    pad: Sequence[int],
    dilation: Sequence[int],
    groups: int,
    dtype: torch.dtype,
    out_dtype: torch.dtype,
    **flags: Any,
) -> ConvProblem:
    """The problem of a convolution y = conv(x, w): each of x, w, y as (shape, 5-D strides)."""
    return ConvProblem(
        direction=direction,
        nd=len(x[0]) - 2,
        n=x[0][0],
        cin=x[0][1],
        cout=w[0][0],
        groups=groups,
        in_size=pad3(tuple(x[0][2:]), 1),
        out_size=pad3(tuple(y[0][2:]), 1),
        kernel=pad3(tuple(w[0][2:]), 1),
        stride=pad3(tuple(stride), 1),
        pad=pad3(tuple(pad), 0),
        dilation=pad3(tuple(dilation), 1),
        x_strides=x[1],
        w_strides=w[1],
        y_strides=y[1],
        dtype=dtype_name(dtype),
        out_dtype=dtype_name(out_dtype),
        tf32=config.allow_tf32 and dtype == torch.float32,
        deterministic=config.deterministic,
        **flags,
    )


_plans: dict[tuple, Callable[..., Any]] = {}


def _sig(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (t.shape, t.stride(), t.dtype)


def _epilogue_run(problem, family, algo, out_shape, out_dtype, pre_dtype, last, example):
    """The run function of a forward or data-gradient plan: allocate the output (and pre), then
    launch with epilogue tensors in the output's layout."""
    store_pre = problem.store_pre
    src, w, bias, c, residual = example

    def tensors(src, w, y, bias, c, residual, pre):
        fill = lambda t: y if t is None else t
        c = None if c is None else in_layout(c, last)
        residual = None if residual is None else in_layout(residual, last)
        return src, w, y, fill(c), fill(bias), fill(residual), fill(pre)

    launch = None
    if math.prod(out_shape):

        def timing_args():
            y = empty_conv_tensor(out_shape, out_dtype, src.device, last)
            pre = empty_conv_tensor(out_shape, pre_dtype, src.device, last) if store_pre else None
            return (*tensors(src, w, y, bias, c, residual, pre), 1.0, 1.0, 0.0, 0.0)

        if problem.prologue:  # only the implicit GEMM applies one (forward_plan checked algo)
            engine = ImplicitGemmEngine()
            launch = engine.bind(problem, engine.configs(problem)[0])
        else:
            choice = family.choose(problem, algo, timing_args, f"tdnn.{family.name}")
            launch = choice.engine.bind(problem, choice.config)

    if problem.prologue:

        def run_prologue(src, w, bias, c, residual, alpha, beta, p0, p1, scale, shift):
            y = empty_conv_tensor(out_shape, out_dtype, src.device, last)
            pre = empty_conv_tensor(out_shape, pre_dtype, src.device, last) if store_pre else None
            if launch is not None:
                read = (y if scale is None else scale, y if shift is None else shift)
                launch(*tensors(src, w, y, bias, c, residual, pre), *read, alpha, beta, p0, p1)
            return y, pre

        return run_prologue

    def run(src, w, bias, c, residual, alpha, beta, p0, p1):
        y = empty_conv_tensor(out_shape, out_dtype, src.device, last)
        pre = empty_conv_tensor(out_shape, pre_dtype, src.device, last) if store_pre else None
        if launch is not None:
            launch(*tensors(src, w, y, bias, c, residual, pre), alpha, beta, p0, p1)
        return y, pre

    return run


def _flags(bias, c, residual, activation, store_pre) -> dict[str, Any]:
    return {
        "bias": bias is not None,
        "has_c": c is not None,
        "residual": residual is not None,
        "activation": activation,
        "store_pre": store_pre,
    }


def forward_plan(
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
    activation,
    store_pre,
    out_dtype,
    algo,
    prologue=0,
    prologue_dtypes=(None, None),
):
    """``run(x, w, bias, c, residual, alpha, beta, p0, p1) -> (y, pre or None)`` for these shapes.
    With ``prologue`` bits (``problem.PROLOGUE_*``): ``run(..., p1, scale, shift)``, x transformed
    per input channel as the implicit GEMM reads it (scale, shift: (C_in,) contiguous of
    ``prologue_dtypes``, or None where their bit is clear); other engines apply none."""
    if prologue and algo not in (None, ImplicitGemmEngine.name):
        why = ["applies no input prologue (scale, shift, ReLU); only 'implicit_gemm' does"]
        raise NotSupportedError(
            "conv", f"a forward convolution of {tuple(x.shape)} with a prologue", {algo: why}
        )
    key = (
        "fwd",
        config.version,
        _sig(x),
        _sig(w),
        bias is not None,
        _sig(c),
        _sig(residual),
        tuple(stride),
        tuple(pad_pre),
        tuple(pad_post),
        tuple(dilation),
        groups,
        activation,
        store_pre,
        out_dtype,
        algo,
        prologue,
        prologue_dtypes,  # the launcher keeps the kernel compiled for the first call's dtypes
    )
    run = _plans.get(key)
    if run is None:
        last = channels_last(x)
        out_shape = (
            x.shape[0],
            w.shape[0],
            *(
                output_size(i, k, s, a, b, d)
                for i, k, s, a, b, d in zip(x.shape[2:], w.shape[2:], stride, pad_pre, pad_post, dilation)
            ),
        )
        y = empty_conv_tensor(out_shape, out_dtype, x.device, last)
        problem = make_problem(
            "fwd",
            (x.shape, strides5(x)),
            (w.shape, strides5(w)),
            (out_shape, strides5(y)),
            stride,
            pad_pre,
            dilation,
            groups,
            x.dtype,
            out_dtype,
            prologue=prologue,
            **_flags(bias, c, residual, activation, store_pre),
        )
        pre_dtype = torch.promote_types(x.dtype, out_dtype)
        run = _plans[key] = _epilogue_run(
            problem, FAMILY, algo, out_shape, out_dtype, pre_dtype, last, (x, w, bias, c, residual)
        )
    return run


def dgrad_plan(
    dy,
    w,
    bias,
    c,
    residual,
    input_size,
    stride,
    pad_pre,
    dilation,
    groups,
    activation,
    store_pre,
    out_dtype,
    last,
    algo,
):
    """``run(dy, w, bias, c, residual, alpha, beta, p0, p1) -> (dx, pre or None)``."""
    key = (
        "dgrad",
        config.version,
        _sig(dy),
        _sig(w),
        bias is not None,
        _sig(c),
        _sig(residual),
        tuple(input_size),
        tuple(stride),
        tuple(pad_pre),
        tuple(dilation),
        groups,
        activation,
        store_pre,
        out_dtype,
        last,
        algo,
    )
    run = _plans.get(key)
    if run is None:
        shape = tuple(input_size)
        dx = empty_conv_tensor(shape, out_dtype, dy.device, last)
        problem = make_problem(
            "dgrad",
            (shape, strides5(dx)),
            (w.shape, strides5(w)),
            (dy.shape, strides5(dy)),
            stride,
            pad_pre,
            dilation,
            groups,
            dy.dtype,
            out_dtype,
            **_flags(bias, c, residual, activation, store_pre),
        )
        pre_dtype = torch.promote_types(dy.dtype, out_dtype)
        run = _plans[key] = _epilogue_run(
            problem, DGRAD_FAMILY, algo, shape, out_dtype, pre_dtype, last, (dy, w, bias, c, residual)
        )
    return run


def empty_weight_grad(
    x: torch.Tensor, weight_size: Sequence[int], dtype: torch.dtype | None = None
) -> torch.Tensor:
    """An uninitialized weight gradient in x's layout and dtype (or ``dtype``): channels-last for
    a channels-last x (as PyTorch returns it; the kernels then store input channels innermost, in
    whole sectors, where contiguous taps innermost scatter them: ResNet-50's 3x3 layers' shifted
    weight gradient ran 1.2-1.4x faster on an H100), contiguous otherwise."""
    return empty_conv_tensor(weight_size, dtype or x.dtype, x.device, channels_last(x))


def wgrad_plan(x, dy, weight_size, stride, pad_pre, dilation, groups, algo, out_dtype=None):
    """``run(x, dy) -> dw`` (x's layout, ``empty_weight_grad``; x's dtype, or ``out_dtype``: an
    fp32 master weight's gradient stored from the fp32 sums of 16-bit operands, with no cast)."""
    out_dtype = out_dtype or x.dtype
    key = (
        "wgrad",
        config.version,
        _sig(x),
        _sig(dy),
        tuple(weight_size),
        tuple(stride),
        tuple(pad_pre),
        tuple(dilation),
        groups,
        algo,
        out_dtype,
    )
    run = _plans.get(key)
    if run is None:
        shape = tuple(weight_size)
        dw = empty_weight_grad(x, shape, out_dtype)
        dw_strides = dw.stride()
        problem = make_problem(
            "wgrad",
            (x.shape, strides5(x)),
            (shape, strides5(dw)),
            (dy.shape, strides5(dy)),
            stride,
            pad_pre,
            dilation,
            groups,
            x.dtype,
            out_dtype,
        )
        launch = None
        if dw.numel() and x.numel() and dy.numel():
            choice = WGRAD_FAMILY.choose(
                problem,
                algo,
                lambda: (x, dy, empty_weight_grad(x, shape, out_dtype)),
                "tdnn.conv_wgrad",
            )
            launch = choice.engine.bind(problem, choice.config)

        def run(x, dy):
            dw = torch.empty_strided(shape, dw_strides, dtype=out_dtype, device=x.device)
            if launch is None:
                return dw.zero_()
            launch(x, dy, dw)
            return dw

        _plans[key] = run
    return run


# ---------------------------------------------------------------------------------------------
# torch.library ops (batched tensors, normalized arguments).


def _fake_forward(
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
    store_pre,
    out_dtype,
    algo,
):
    shape = (
        x.shape[0],
        w.shape[0],
        *(
            output_size(i, k, s, a, b, d)
            for i, k, s, a, b, d in zip(x.shape[2:], w.shape[2:], stride, pad_pre, pad_post, dilation)
        ),
    )
    last = channels_last(x)
    y = empty_conv_tensor(shape, out_dtype, x.device, last)
    pre_dtype = torch.promote_types(x.dtype, out_dtype)
    pre = (
        empty_conv_tensor(shape, pre_dtype, x.device, last) if store_pre else x.new_empty(0, dtype=out_dtype)
    )
    return y, pre


_FWD_SCHEMA = (
    "(Tensor x, Tensor w, Tensor? bias, Tensor? c, Tensor? residual, int[] stride, int[] pad_pre, "
    "int[] pad_post, int[] dilation, int groups, float alpha, float beta, int activation, float p0, "
    "float p1, bool store_pre, ScalarType out_dtype, str? algo) -> (Tensor, Tensor)"
)


@custom_op("conv_forward", _FWD_SCHEMA, _fake_forward)
def _forward_op(
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
    store_pre,
    out_dtype,
    algo,
):
    """The convolution and its epilogue; an absent pre-activation comes back empty."""
    run = forward_plan(
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
        activation,
        store_pre,
        out_dtype,
        algo,
    )
    y, pre = run(x, w, bias, c, residual, alpha, beta, p0, p1)
    return y, (y.new_empty(0) if pre is None else pre)


def _fake_dgrad(
    dy,
    w,
    bias,
    c,
    residual,
    input_size,
    stride,
    pad_pre,
    dilation,
    groups,
    alpha,
    beta,
    activation,
    p0,
    p1,
    store_pre,
    out_dtype,
    last,
    algo,
):
    dx = empty_conv_tensor(input_size, out_dtype, dy.device, last)
    pre_dtype = torch.promote_types(dy.dtype, out_dtype)
    pre = (
        empty_conv_tensor(input_size, pre_dtype, dy.device, last)
        if store_pre
        else dy.new_empty(0, dtype=out_dtype)
    )
    return dx, pre


_DGRAD_SCHEMA = (
    "(Tensor dy, Tensor w, Tensor? bias, Tensor? c, Tensor? residual, int[] input_size, int[] stride, "
    "int[] pad_pre, int[] dilation, int groups, float alpha, float beta, int activation, float p0, float p1, "
    "bool store_pre, ScalarType out_dtype, bool last, str? algo) -> (Tensor, Tensor)"
)


@custom_op("conv_dgrad", _DGRAD_SCHEMA, _fake_dgrad)
def _dgrad_op(
    dy,
    w,
    bias,
    c,
    residual,
    input_size,
    stride,
    pad_pre,
    dilation,
    groups,
    alpha,
    beta,
    activation,
    p0,
    p1,
    store_pre,
    out_dtype,
    last,
    algo,
):
    """The data gradient with an epilogue (conv_transpose's forward)."""
    run = dgrad_plan(
        dy,
        w,
        bias,
        c,
        residual,
        input_size,
        stride,
        pad_pre,
        dilation,
        groups,
        activation,
        store_pre,
        out_dtype,
        last,
        algo,
    )
    dx, pre = run(dy, w, bias, c, residual, alpha, beta, p0, p1)
    return dx, (dx.new_empty(0) if pre is None else pre)


def _fake_wgrad(x, dy, weight_size, stride, pad_pre, dilation, groups, algo):
    return empty_weight_grad(x, weight_size)


@custom_op(
    "conv_wgrad",
    "(Tensor x, Tensor dy, int[] weight_size, int[] stride, int[] pad_pre, int[] dilation, int groups, "
    "str? algo) -> Tensor",
    _fake_wgrad,
)
def _wgrad_op(x, dy, weight_size, stride, pad_pre, dilation, groups, algo):
    """The weight gradient (x's layout)."""
    return wgrad_plan(x, dy, weight_size, stride, pad_pre, dilation, groups, algo)(x, dy)
