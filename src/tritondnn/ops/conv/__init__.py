"""Convolutions: cuDNN's forward, backward-data and backward-filter operations, and conv_transpose.

``conv1d/2d/3d`` follow ``torch.nn.functional`` (plus cuDNN's asymmetric (pre, post) padding)
and fuse an epilogue (``tdnn.Epilogue``: scale, C input, bias, activation, residual) into the
kernel's store; ``conv_transpose1d/2d/3d`` are data-gradient convolutions;
``conv_backward_data``/``conv_backward_weight``/``conv_backward_bias`` expose the gradients.
Every convolution differentiates (to input, weight, bias, C and residual, through the fused
activation).

Layouts: contiguous (NCHW) and channels-last (NHWC, NDHWC, NLC) inputs are read in place; outputs
and input gradients take the input's layout. Numerics: fp16 and bf16 multiply on tensor cores and
accumulate in fp32; fp32 is true fp32 unless ``tdnn.config.allow_tf32``; fp64 accumulates in fp64.
Weight gradients are split over the batch and pixels with the partial sums added in a fixed order:
the same bits on every run, with or without ``tdnn.config.deterministic``.

Engines (``tdnn.engines("conv", x, w, ...)`` lists them with their reasons): ``implicit_gemm``,
``boxed_gemm`` (Hopper, channels-last: image tiles as tensor-descriptor boxes, the padding filled
by the copy engine), ``im2col_gemm`` (fallback), ``depthwise``, ``depthwise_rows`` (channels-last
1-D/2-D, multiplier 1: image rows streamed with the taps unrolled), ``winograd`` (F(2x2, 3x3)),
``fft``, ``gemm_1x1`` (1x1 channels-last, one group, no padding: one ``tdnn.matmul`` product),
``space_to_depth`` (Hopper, 16-bit, strided with few input channels, as a stem: the stride-1
boxed GEMM over a space-to-depth copy of x; also in both gradient families);
the data-gradient family ``conv_dgrad`` has ``implicit_gemm``, ``boxed_gemm`` (stride 1),
``depthwise``, ``depthwise_rows`` and ``gemm_1x1`` (stride 1), the weight-gradient family ``conv_wgrad``
``implicit_gemm``, ``shifted_gemm`` (Hopper, stride-1 channels-last: per tap, pixel rows shifted
by a constant), ``padded_box`` (Hopper, stride 1, channels-last x: x's boxes against dy's rows
in a zero-padded copy; benchmark mode only until timed), ``row_window`` (channels-last with few
input channels, as a stem: a kernel row's taps and channels are one contiguous run of the image
row), ``depthwise`` and ``gemm_1x1``.

Files: ``problem`` and ``args`` (geometry, argument rules), ``kernels`` (implicit GEMM),
``engines``, ``boxed``, ``spacedepth``, ``shifted``, ``padded``, ``window``, ``gemm``, ``depthwise``,
``winograd``, ``fft``, ``plans`` (per-shape plans, torch.library ops), ``autograd``, ``eager``
(the eager fast path: calls seen before skip the checks), ``reference``; this module holds the
public functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ...core.autocast import LOWER, autocast_policy
from ...core.checks import check_tensor
from ..epilogue import Epilogue
from . import boxed as _boxed  # noqa: F401  (registers its engines)
from . import depthwise as _depthwise  # noqa: F401
from . import eager
from . import fft as _fft  # noqa: F401
from . import gemm as _gemm  # noqa: F401
from . import padded as _padded  # noqa: F401
from . import shifted as _shifted  # noqa: F401
from . import spacedepth as _spacedepth  # noqa: F401
from . import window as _window  # noqa: F401
from . import winograd as _winograd  # noqa: F401
from .args import (
    check_bias,
    check_epilogue,
    check_groups,
    check_input_weight,
    int_tuple,
    output_shape,
    padding_pairs,
)
from .autograd import _ConvFunction, _ConvTransposeFunction, epilogue_grads
from .engines import DGRAD_FAMILY, FAMILY, WGRAD_FAMILY
from .plans import _dgrad_op, _forward_op, _wgrad_op, forward_plan, make_problem
from .problem import (
    DTYPES,
    PROLOGUE_RELU,
    PROLOGUE_SCALE,
    PROLOGUE_SHIFT,
    ConvProblem,
    channels_last,
    empty_conv_tensor,
    strides5,
)
from .reference import conv_backward_reference, conv_reference, conv_transpose_reference

__all__ = [
    "DGRAD_FAMILY",
    "FAMILY",
    "WGRAD_FAMILY",
    "ConvProblem",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_backward_bias",
    "conv_backward_data",
    "conv_backward_reference",
    "conv_backward_weight",
    "conv_reference",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "conv_transpose_reference",
]

IntOrTuple = int | Sequence[int]


# ---------------------------------------------------------------------------------------------
# Public functions.


def _wants_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _check_algo(op: str, algo: Any) -> str | None:
    if algo is not None and not isinstance(algo, str):
        raise TypeError(f"{op}: argument 'algo' must be a str or None, got {type(algo).__name__}")
    return algo


def _parse(op, nd, input, weight, bias, stride, padding, dilation, groups):
    x, unbatched = check_input_weight(op, input, weight, nd)
    groups = check_groups(op, groups)
    stride_ = int_tuple(op, "stride", stride, nd, 1)
    dilation_ = int_tuple(op, "dilation", dilation, nd, 1)
    return x, unbatched, groups, stride_, dilation_


def _conv(
    op, nd, input, weight, bias, stride, padding, dilation, groups, algo, epilogue, c, residual, bind=False,
    prologue=None,
):  # fmt: skip
    given = (input, bias, c, residual)
    key = None
    if not bind and algo is None and epilogue is None and c is None and residual is None:
        key = eager.eager_key(nd, input, weight, bias, stride, padding, dilation, groups)
        fast = eager.programs.get(key) if key is not None else None
        if fast is not None:
            return fast(input, weight, bias, _wants_grad(input, weight, bias))
    x, unbatched, groups, stride_, dilation_ = _parse(
        op, nd, input, weight, bias, stride, padding, dilation, groups
    )
    pads = padding_pairs(op, padding, nd, weight.shape[2:], stride_, dilation_)
    cin, cout = x.shape[1], weight.shape[0]
    if cin % groups or cout % groups:
        raise ValueError(
            f"{op}: groups={groups} must divide the input channels ({cin}) and the output channels ({cout})"
        )
    if weight.shape[1] * groups != cin:
        raise ValueError(
            f"{op}: argument 'weight' of shape {tuple(weight.shape)} expects {weight.shape[1] * groups} "
            f"input channels (weight.shape[1] * groups), but 'input' of shape {tuple(input.shape)} has {cin}"
        )
    bias = check_bias(op, bias, cout, x)
    out_shape = output_shape(op, x, weight.shape, stride_, pads, dilation_)
    epi, c, residual = check_epilogue(op, epilogue, bias, c, residual, out_shape, x, unbatched)
    algo = _check_algo(op, algo)
    out_dtype = epi.out_dtype or x.dtype
    p0, p1 = epi.params
    pre_pad, post_pad = [p[0] for p in pads], [p[1] for p in pads]
    geometry = (list(stride_), pre_pad, post_pad, list(dilation_), groups)
    flags = (epi.alpha, epi.beta, epi.activation_kind, p0, p1)
    if bind:  # the caller calls the plan itself (see bound_forward)
        if (
            unbatched
            or epi.store_preactivation
            or any(a is not b for a, b in zip((x, bias, c, residual), given))
        ):
            return None  # the checks reshaped or copied a tensor: calls would need them again
        bits, per_channel = _check_prologue(op, prologue, x)
        run = forward_plan(
            x, weight, bias, c, residual, *geometry, epi.activation_kind, False, out_dtype, algo, bits,
            tuple(None if t is None else t.dtype for t in per_channel),
        )  # fmt: skip
        scalars = (epi.alpha, epi.beta, p0, p1)
        if bits:
            return lambda x, w, bias, c, residual, scale, shift: run(
                x, w, bias, c, residual, *scalars, scale, shift
            )[0]
        return lambda x, w, bias, c, residual: run(x, w, bias, c, residual, *scalars)[0]
    if key is not None:  # validated: later calls with this key skip the checks
        fast = eager.eager_program(x, weight, bias, geometry)
        if fast is not None:
            eager.programs[key] = fast
            return fast(x, weight, bias, _wants_grad(x, weight, bias))
    if _wants_grad(x, weight, bias, c, residual):
        y, pre = _ConvFunction.apply(
            x, weight, bias, c, residual, geometry, *flags, epi.store_preactivation, out_dtype, algo
        )
    else:
        y, pre = _forward_op(
            x, weight, bias, c, residual, *geometry, *flags, epi.store_preactivation, out_dtype, algo
        )
    if unbatched:
        y, pre = y.squeeze(0), (pre.squeeze(0) if epi.store_preactivation else pre)
    return (y, pre) if epi.store_preactivation else y


def _check_prologue(op: str, prologue: Any, x: torch.Tensor) -> tuple[int, tuple]:
    """(``PROLOGUE_*`` bits, (scale, shift)) of ``bound_forward``'s ``prologue`` argument: None,
    or (scale, shift, relu) with scale and shift None or (C_in,) contiguous float tensors on x's
    device."""
    if prologue is None:
        return 0, (None, None)
    scale, shift, relu = prologue
    for name, t in (("scale", scale), ("shift", shift)):
        if t is None:
            continue
        check_tensor(op, f"prologue {name}", t, min_ndim=1, max_ndim=1)
        if t.shape[0] != x.shape[1] or not t.is_contiguous() or t.device != x.device:
            raise ValueError(
                f"{op}: the prologue's {name} must be a contiguous ({x.shape[1]},) tensor on {x.device} "
                f"(one value per input channel), got {tuple(t.shape)} with strides {t.stride()} on {t.device}"
            )
    bits = (
        (PROLOGUE_SCALE if scale is not None else 0)
        | (PROLOGUE_SHIFT if shift is not None else 0)
        | (PROLOGUE_RELU if relu else 0)
    )
    return bits, (scale, shift)


def bound_forward(
    nd: int,
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: Any,
    padding: Any,
    dilation: Any,
    groups: int,
    *,
    algo: str | None = None,
    epilogue: Epilogue | None = None,
    c: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    prologue: tuple[torch.Tensor | None, torch.Tensor | None, bool] | None = None,
):
    """``run(input, weight, bias, c, residual) -> y``: the forward of ``conv{nd}d`` with these
    arguments, checked once here, then run straight on its plan for tensors of the same shapes,
    strides and dtypes (an operation graph's execute calls it every time; no autograd). None where
    a plan cannot be bound: unbatched input, a stored pre-activation, or a tensor that the checks
    reshape or copy. Raises what ``conv{nd}d`` raises for bad arguments.

    ``prologue``: (scale, shift, relu): the convolution reads ``relu(input * scale + shift)`` per
    input channel (scale or shift None: left out; relu False: no ReLU; cuDNN's scale-bias-relu
    before a convolution, e.g. batch norm's apply folded into the next convolution), computed in
    fp32 (fp64 for fp64) as the implicit GEMM reads the input, rounded once; the padding stays
    zero. scale and shift: (C_in,) contiguous float tensors on the input's device, checked here;
    ``run`` then takes ``scale, shift`` last, of the same dtypes, shapes and device (not checked
    per call). Only the implicit GEMM applies a prologue."""
    op = f"tdnn.conv{nd}d"
    return _conv(
        op, nd, input, weight, bias, stride, padding, dilation, groups, algo, epilogue, c, residual, True,
        prologue,
    )  # fmt: skip


_CONV_DOC = """``F.conv{nd}d``: cross-correlation of ``input`` with ``weight``, plus ``bias``, through
    the fused ``epilogue``.

    Args:
        input: (N, C_in, {dims}) or unbatched (C_in, {dims}); fp16, bf16, fp32 or fp64; contiguous
            or channels-last, read in place (the output takes the same layout).
        weight: (C_out, C_in / groups, {kdims}), the input's dtype.
        bias: (C_out,) or None.
        stride, dilation: an int or {nd} ints, >= 1.
        padding: an int, {nd} ints, {nd} (pre, post) pairs (cuDNN's asymmetric padding), 'valid'
            or 'same' (stride 1; an odd total pads one more after).
        groups: divides C_in and C_out.
        algo: force an engine ({engines}); None lets the heuristics (or ``tdnn.config.benchmark``)
            choose. A forced engine that cannot run the problem raises ``NotSupportedError``.
        epilogue: a ``tdnn.Epilogue``: ``alpha`` scales the convolution, ``beta`` scales ``c``,
            ``activation`` is applied after bias, then ``residual`` is added; ``out_dtype``;
            ``store_preactivation`` also returns the pre-activation: ``(out, pre)``.
        c, residual: tensors of the output's shape, required exactly when the epilogue uses them.

    Returns (N, C_out, {odims}) in the input's layout. Gradients flow to input, weight, bias, c and
    residual. Raises TypeError for bad dtypes, ValueError for bad shapes, channel or group
    mismatches, zero strides, kernels larger than the padded input.
    """

_ENGINES = (
    "'implicit_gemm', 'boxed_gemm', 'im2col_gemm', 'depthwise', 'depthwise_rows', 'winograd', 'fft', "
    "'gemm_1x1', 'space_to_depth'"
)


@autocast_policy(LOWER, LOWER)
def conv1d(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: IntOrTuple = 1,
    padding: Any = 0,
    dilation: IntOrTuple = 1,
    groups: int = 1,
    *,
    algo: str | None = None,
    epilogue: Epilogue | None = None,
    c: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> Any:
    return _conv(
        "tdnn.conv1d", 1, input, weight, bias, stride, padding, dilation, groups, algo, epilogue, c, residual
    )


@autocast_policy(LOWER, LOWER)
def conv2d(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: IntOrTuple = 1,
    padding: Any = 0,
    dilation: IntOrTuple = 1,
    groups: int = 1,
    *,
    algo: str | None = None,
    epilogue: Epilogue | None = None,
    c: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> Any:
    return _conv(
        "tdnn.conv2d", 2, input, weight, bias, stride, padding, dilation, groups, algo, epilogue, c, residual
    )


@autocast_policy(LOWER, LOWER)
def conv3d(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: IntOrTuple = 1,
    padding: Any = 0,
    dilation: IntOrTuple = 1,
    groups: int = 1,
    *,
    algo: str | None = None,
    epilogue: Epilogue | None = None,
    c: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> Any:
    return _conv(
        "tdnn.conv3d", 3, input, weight, bias, stride, padding, dilation, groups, algo, epilogue, c, residual
    )


for _nd, _fn in ((1, conv1d), (2, conv2d), (3, conv3d)):
    _dims = ", ".join(("D", "H", "W")[3 - _nd :])
    _fn.__doc__ = _CONV_DOC.format(
        nd=_nd,
        dims=_dims,
        kdims=", ".join(f"k{d}" for d in ("D", "H", "W")[3 - _nd :]),
        odims=", ".join(f"{d}_out" for d in ("D", "H", "W")[3 - _nd :]),
        engines=_ENGINES,
    )


def _conv_transpose(
    op,
    nd,
    input,
    weight,
    bias,
    stride,
    padding,
    output_padding,
    groups,
    dilation,
    algo,
    epilogue,
    c,
    residual,
):
    x, unbatched, groups, stride_, dilation_ = _parse(
        op, nd, input, weight, bias, stride, padding, dilation, groups
    )
    pad = int_tuple(op, "padding", padding, nd, 0)
    out_pad = int_tuple(op, "output_padding", output_padding, nd, 0)
    for op_, s, d in zip(out_pad, stride_, dilation_):
        if op_ >= max(s, d):
            raise ValueError(
                f"{op}: output_padding={out_pad} must be smaller than stride or dilation in every dimension"
            )
    cin = x.shape[1]
    if weight.shape[0] != cin:
        raise ValueError(
            f"{op}: argument 'weight' of shape {tuple(weight.shape)} expects {weight.shape[0]} input "
            f"channels (weight.shape[0]), but 'input' of shape {tuple(input.shape)} has {cin}"
        )
    if cin % groups:
        raise ValueError(f"{op}: groups={groups} must divide the input channels ({cin})")
    cout = weight.shape[1] * groups
    bias = check_bias(op, bias, cout, x)
    spatial = [
        (i - 1) * s - 2 * p + d * (k - 1) + o + 1
        for i, s, p, d, k, o in zip(x.shape[2:], stride_, pad, dilation_, weight.shape[2:], out_pad)
    ]
    if any(o < 1 for o in spatial):
        raise ValueError(
            f"{op}: the output size {tuple(spatial)} is not positive; padding={pad} is too large"
        )
    out_shape = (x.shape[0], cout, *spatial)
    epi, c, residual = check_epilogue(op, epilogue, bias, c, residual, out_shape, x, unbatched)
    algo = _check_algo(op, algo)
    out_dtype = epi.out_dtype or x.dtype
    p0, p1 = epi.params
    geometry = (list(out_shape), list(stride_), list(pad), list(dilation_), groups)
    flags = (epi.alpha, epi.beta, epi.activation_kind, p0, p1)
    if _wants_grad(x, weight, bias, c, residual):
        y, pre = _ConvTransposeFunction.apply(
            x, weight, bias, c, residual, geometry, *flags, epi.store_preactivation, out_dtype, algo
        )
    else:
        y, pre = _dgrad_op(
            x,
            weight,
            bias,
            c,
            residual,
            list(out_shape),
            list(stride_),
            list(pad),
            list(dilation_),
            groups,
            *flags,
            epi.store_preactivation,
            out_dtype,
            channels_last(x),
            algo,
        )
    if unbatched:
        y, pre = y.squeeze(0), (pre.squeeze(0) if epi.store_preactivation else pre)
    return (y, pre) if epi.store_preactivation else y


_CONV_T_DOC = """``F.conv_transpose{nd}d``: the data gradient of a convolution with this geometry
    (cuDNN's way), bias and the fused ``epilogue`` included.

    Args:
        input: (N, C_in, ...) or unbatched; weight: (C_in, C_out / groups, *kernel).
        stride, padding, output_padding, dilation: ints or {nd} ints; output_padding smaller than
            stride or dilation.
        algo: 'implicit_gemm', 'boxed_gemm', 'depthwise', 'depthwise_rows', 'gemm_1x1' or
            'space_to_depth' (the data-gradient engines), or None.
        epilogue, c, residual: as ``conv{nd}d``.

    Returns (N, C_out, *out) with out = (in - 1) * stride - 2 * padding + dilation * (k - 1) +
    output_padding + 1, in the input's layout. Stride > 1 runs as stride phases: no multiply
    touches an inserted zero.
    """


@autocast_policy(LOWER, LOWER)
def conv_transpose1d(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: IntOrTuple = 1,
    padding: IntOrTuple = 0,
    output_padding: IntOrTuple = 0,
    groups: int = 1,
    dilation: IntOrTuple = 1,
    *,
    algo: str | None = None,
    epilogue: Epilogue | None = None,
    c: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> Any:
    return _conv_transpose(
        "tdnn.conv_transpose1d",
        1,
        input,
        weight,
        bias,
        stride,
        padding,
        output_padding,
        groups,
        dilation,
        algo,
        epilogue,
        c,
        residual,
    )


@autocast_policy(LOWER, LOWER)
def conv_transpose2d(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: IntOrTuple = 1,
    padding: IntOrTuple = 0,
    output_padding: IntOrTuple = 0,
    groups: int = 1,
    dilation: IntOrTuple = 1,
    *,
    algo: str | None = None,
    epilogue: Epilogue | None = None,
    c: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> Any:
    return _conv_transpose(
        "tdnn.conv_transpose2d",
        2,
        input,
        weight,
        bias,
        stride,
        padding,
        output_padding,
        groups,
        dilation,
        algo,
        epilogue,
        c,
        residual,
    )


@autocast_policy(LOWER, LOWER)
def conv_transpose3d(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: IntOrTuple = 1,
    padding: IntOrTuple = 0,
    output_padding: IntOrTuple = 0,
    groups: int = 1,
    dilation: IntOrTuple = 1,
    *,
    algo: str | None = None,
    epilogue: Epilogue | None = None,
    c: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> Any:
    return _conv_transpose(
        "tdnn.conv_transpose3d",
        3,
        input,
        weight,
        bias,
        stride,
        padding,
        output_padding,
        groups,
        dilation,
        algo,
        epilogue,
        c,
        residual,
    )


for _nd, _fn in ((1, conv_transpose1d), (2, conv_transpose2d), (3, conv_transpose3d)):
    _fn.__doc__ = _CONV_T_DOC.format(nd=_nd)


def _grad_args(op, grad_output, weight_like, nd_from, stride, padding, dilation, groups):
    nd = nd_from - 2
    stride_ = int_tuple(op, "stride", stride, nd, 1)
    dilation_ = int_tuple(op, "dilation", dilation, nd, 1)
    groups = check_groups(op, groups)
    return nd, stride_, dilation_, groups


def conv_backward_data(
    grad_output: torch.Tensor,
    weight: torch.Tensor,
    input_size: Sequence[int],
    stride: IntOrTuple = 1,
    padding: Any = 0,
    dilation: IntOrTuple = 1,
    groups: int = 1,
    *,
    algo: str | None = None,
) -> torch.Tensor:
    """cuDNN's backward-data (``torch.nn.grad.conv{1,2,3}d_input``): the gradient of
    ``conv(input, weight, ...)`` with respect to an input of ``input_size`` (N, C_in, *spatial),
    for the output gradient ``grad_output`` (N, C_out, *out). Padding as ``conv2d`` (pairs allowed).
    The result takes grad_output's layout (contiguous or channels-last). Stride > 1 runs as
    stride phases (sub-pixel decomposition): no work on inserted zeros. ``algo`` forces an engine
    ('implicit_gemm', 'boxed_gemm', 'depthwise', 'depthwise_rows', 'gemm_1x1', 'space_to_depth').
    Differentiable."""
    op = "tdnn.conv_backward_data"
    key = eager.gradient_key(
        "dgrad", grad_output, weight, input_size, stride, padding, dilation, groups, algo
    )
    run = eager.gradient_programs.get(key) if key is not None else None
    if run is not None:
        return run(grad_output, weight)
    check_tensor_pair(op, grad_output, "grad_output", weight, "weight")
    input_size = tuple(int(s) for s in input_size)
    nd = weight.ndim - 2
    if len(input_size) != nd + 2 or grad_output.ndim != nd + 2:
        raise ValueError(
            f"{op}: 'input_size' {input_size} and 'grad_output' {tuple(grad_output.shape)} must have "
            f"{nd + 2} dimensions, as 'weight' {tuple(weight.shape)} implies"
        )
    _, stride_, dilation_, groups = _grad_args(
        op, grad_output, weight, weight.ndim, stride, padding, dilation, groups
    )
    pads = padding_pairs(op, padding, nd, weight.shape[2:], stride_, dilation_)
    x_like = torch.empty(input_size, device="meta")
    expected = output_shape(op, x_like, weight.shape, stride_, pads, dilation_)
    if weight.shape[1] * groups != input_size[1] or tuple(grad_output.shape) != expected:
        raise ValueError(
            f"{op}: 'grad_output' has shape {tuple(grad_output.shape)}; an input of size {input_size} with "
            f"'weight' {tuple(weight.shape)} and groups={groups} gives {expected}"
        )
    pre = [p[0] for p in pads]
    algo = _check_algo(op, algo)
    last = channels_last(grad_output)
    args = (list(input_size), list(stride_), pre, list(dilation_), groups)
    if _wants_grad(grad_output, weight):
        # conv_transpose of grad_output with the same geometry: reuse its autograd.
        y, _ = _ConvTransposeFunction.apply(
            grad_output,
            weight,
            None,
            None,
            None,
            args,
            1.0,
            0.0,
            -1,
            0.0,
            0.0,
            False,
            grad_output.dtype,
            algo,
        )
        return y
    if key is not None:  # validated: later calls with this key skip the checks
        run = eager.gradient_programs[key] = eager.gradient_program("dgrad", grad_output, weight, *args, algo)
        return run(grad_output, weight)
    return _dgrad_op(
        grad_output,
        weight,
        None,
        None,
        None,
        *args,
        1.0,
        0.0,
        -1,
        0.0,
        0.0,
        False,
        grad_output.dtype,
        last,
        algo,
    )[0]


def conv_backward_weight(
    input: torch.Tensor,
    grad_output: torch.Tensor,
    weight_size: Sequence[int],
    stride: IntOrTuple = 1,
    padding: Any = 0,
    dilation: IntOrTuple = 1,
    groups: int = 1,
    *,
    algo: str | None = None,
) -> torch.Tensor:
    """cuDNN's backward-filter (``torch.nn.grad.conv{1,2,3}d_weight``): the gradient of
    ``conv(input, weight, ...)`` with respect to a weight of ``weight_size`` (C_out, C_in / groups,
    *kernel). Split over N * pixels, partial sums added in a fixed order (deterministic).
    ``algo`` forces an engine ('implicit_gemm', 'shifted_gemm', 'padded_box', 'row_window',
    'depthwise', 'gemm_1x1', 'space_to_depth'). Returns a tensor in the input's dtype and layout
    (channels-last for a channels-last input, as PyTorch's; contiguous otherwise)."""
    op = "tdnn.conv_backward_weight"
    key = eager.gradient_key(
        "wgrad", input, grad_output, weight_size, stride, padding, dilation, groups, algo
    )
    run = eager.gradient_programs.get(key) if key is not None else None
    if run is not None:
        return run(input, grad_output)
    check_tensor_pair(op, input, "input", grad_output, "grad_output")
    weight_size = tuple(int(s) for s in weight_size)
    nd = len(weight_size) - 2
    if input.ndim != nd + 2 or grad_output.ndim != nd + 2:
        raise ValueError(
            f"{op}: 'input' {tuple(input.shape)} and 'grad_output' {tuple(grad_output.shape)} must have "
            f"{nd + 2} dimensions, as 'weight_size' {weight_size} implies"
        )
    _, stride_, dilation_, groups = _grad_args(
        op, grad_output, input, input.ndim, stride, padding, dilation, groups
    )
    pads = padding_pairs(op, padding, nd, weight_size[2:], stride_, dilation_)
    expected = output_shape(op, input, weight_size, stride_, pads, dilation_)
    if (
        weight_size[1] * groups != input.shape[1]
        or weight_size[0] % groups
        or tuple(grad_output.shape) != expected
    ):
        raise ValueError(
            f"{op}: 'grad_output' has shape {tuple(grad_output.shape)}; 'input' {tuple(input.shape)} with "
            f"a weight of size {weight_size} and groups={groups} gives {expected}"
        )
    algo = _check_algo(op, algo)
    args = (list(weight_size), list(stride_), [p[0] for p in pads], list(dilation_), groups, algo)
    if key is not None:  # validated: later calls with this key skip the checks
        run = eager.gradient_programs[key] = eager.gradient_program("wgrad", input, grad_output, *args)
        return run(input, grad_output)
    return _wgrad_op(input, grad_output, *args)


def conv_backward_bias(grad_output: torch.Tensor) -> torch.Tensor:
    """The bias gradient: ``grad_output`` (N, C, *spatial) summed over all but the channel
    dimension, in a fixed order (fp32 accumulation), in grad_output's dtype."""
    from ...core.checks import check_tensor

    check_tensor("tdnn.conv_backward_bias", "grad_output", grad_output, dtypes=DTYPES, min_ndim=2)
    last = channels_last(grad_output)
    return epilogue_grads(grad_output, None, -1, 0.0, 0.0, True, grad_output.dtype, last)[1]


def check_tensor_pair(op: str, a: Any, a_name: str, b: Any, b_name: str) -> None:
    from ...core.checks import check_tensor

    check_tensor(op, a_name, a, dtypes=DTYPES, min_ndim=3, max_ndim=5)
    check_tensor(op, b_name, b, dtypes=DTYPES, min_ndim=3, max_ndim=5)
    if a.dtype != b.dtype:
        raise TypeError(f"{op}: argument '{b_name}' has dtype {b.dtype} but '{a_name}' has {a.dtype}")
    if a.device != b.device:
        raise ValueError(f"{op}: argument '{b_name}' is on {b.device} but '{a_name}' is on {a.device}")


# ---------------------------------------------------------------------------------------------
# Problems for ``tdnn.engines``.


def describe_forward(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1) -> ConvProblem:
    """The problem ``conv{1,2,3}d(input, weight, bias, ...)`` poses (for ``tdnn.engines("conv", ...)``)."""
    nd = weight.ndim - 2
    op = f"tdnn.conv{nd}d"
    x, _, groups, stride_, dilation_ = _parse(op, nd, input, weight, bias, stride, padding, dilation, groups)
    pads = padding_pairs(op, padding, nd, weight.shape[2:], stride_, dilation_)
    out_shape = output_shape(op, x, weight.shape, stride_, pads, dilation_)
    y = empty_conv_tensor(out_shape, x.dtype, x.device, channels_last(x))
    return make_problem(
        "fwd",
        (x.shape, strides5(x)),
        (weight.shape, strides5(weight)),
        (out_shape, strides5(y)),
        stride_,
        [p[0] for p in pads],
        dilation_,
        groups,
        x.dtype,
        x.dtype,
        bias=bias is not None,
    )


def describe_dgrad(grad_output, weight, input_size, stride=1, padding=0, dilation=1, groups=1) -> ConvProblem:
    """The problem ``conv_backward_data(grad_output, weight, input_size, ...)`` poses."""
    nd = weight.ndim - 2
    stride_ = int_tuple("tdnn.conv_backward_data", "stride", stride, nd, 1)
    dilation_ = int_tuple("tdnn.conv_backward_data", "dilation", dilation, nd, 1)
    pads = padding_pairs("tdnn.conv_backward_data", padding, nd, weight.shape[2:], stride_, dilation_)
    dx = empty_conv_tensor(input_size, grad_output.dtype, grad_output.device, channels_last(grad_output))
    return make_problem(
        "dgrad",
        (dx.shape, strides5(dx)),
        (weight.shape, strides5(weight)),
        (grad_output.shape, strides5(grad_output)),
        stride_,
        [p[0] for p in pads],
        dilation_,
        groups,
        grad_output.dtype,
        grad_output.dtype,
    )


def describe_wgrad(input, grad_output, weight_size, stride=1, padding=0, dilation=1, groups=1) -> ConvProblem:
    """The problem ``conv_backward_weight(input, grad_output, weight_size, ...)`` poses."""
    nd = len(weight_size) - 2
    stride_ = int_tuple("tdnn.conv_backward_weight", "stride", stride, nd, 1)
    dilation_ = int_tuple("tdnn.conv_backward_weight", "dilation", dilation, nd, 1)
    pads = padding_pairs("tdnn.conv_backward_weight", padding, nd, weight_size[2:], stride_, dilation_)
    dw = empty_conv_tensor(tuple(weight_size), input.dtype, torch.device("meta"), channels_last(input))
    return make_problem(
        "wgrad",
        (input.shape, strides5(input)),
        (dw.shape, strides5(dw)),
        (grad_output.shape, strides5(grad_output)),
        stride_,
        [p[0] for p in pads],
        dilation_,
        groups,
        input.dtype,
        input.dtype,
    )
