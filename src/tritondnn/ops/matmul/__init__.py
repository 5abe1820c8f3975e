"""Matrix products with fused epilogues: cuDNN's matmul operation and the GEMM other families use.

``matmul`` follows ``torch.matmul`` (1-D operands, broadcast batch dimensions) and ``linear``
follows ``F.linear``; both fuse an epilogue (``ops.epilogue.Epilogue``: alpha/beta with a C
input, a per-column or per-row bias, an activation, a residual, the output dtype, the stored
pre-activation) into the GEMM kernel. Operands are read in place through their strides: transposed
views (``W.T``), batch-broadcast and sliced matrices cost no copy.

Numerics: fp16 and bf16 multiply on tensor cores and accumulate in fp32; fp32 is true fp32 unless
``tdnn.config.allow_tf32``; fp64 accumulates in fp64; fp8 (e4m3, e5m2, on Hopper) takes per-tensor
scales and can report the output's amax. Engines (see ``engines``): a tiled kernel for any GPU, a
persistent TMA kernel on Hopper, split-K for few output tiles over a long K, and a skinny-M
kernel for decode-style products. All are deterministic: split-K adds its partial sums in a
fixed order, never with atomics.

Files: ``reference`` (float64 meaning), ``kernels`` and ``tma`` (Triton), ``engines`` (problem,
engines), ``plans`` (per-shape caches), ``library`` (the custom ops), ``autograd``; this module
holds the public functions.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import NamedTuple

import torch

from ...core.autocast import LOWER, autocast_policy, lowered, lowered_weight
from ...core.checks import FLOAT_DTYPES, check_dtype, check_tensor
from ...core.config import config
from ...core.library import eager_tensor
from ...core.strides import broadcast_shapes
from ..epilogue import Epilogue
from .autograd import _MatmulFunction, apply_eager
from .engines import FAMILY, FP8_DTYPES, INPUT_DTYPES, MatmulProblem, merged_batch_dims
from .library import _forward
from .plans import forward_plan
from .reference import linear_reference, matmul_reference

__all__ = [
    "FAMILY",
    "Epilogue",
    "MatmulOutput",
    "MatmulProblem",
    "linear",
    "linear_reference",
    "matmul",
    "matmul_reference",
]

_T = torch.Tensor


# ---------------------------------------------------------------------------------------------
# The public layer: validation, torch.matmul's shape rules, fast path.


class MatmulOutput(NamedTuple):
    """What ``matmul`` returns when the pre-activation or the amax is asked for (None otherwise)."""

    out: torch.Tensor
    preactivation: torch.Tensor | None
    amax: torch.Tensor | None


def _shape_error(op: str, names: tuple[str, str], a: torch.Tensor, b: torch.Tensor) -> ValueError:
    return ValueError(
        f"{op}: argument '{names[1]}' has shape {tuple(b.shape)}; its dimension {0 if b.ndim == 1 else -2} "
        f"({b.shape[0 if b.ndim == 1 else -2]}) must equal the last dimension of '{names[0]}' of shape "
        f"{tuple(a.shape)} ({a.shape[-1]})"
    )


def _check_scale(op: str, name: str, scale: object, fp8: bool) -> torch.Tensor | None:
    if not fp8:
        if scale is not None:
            raise ValueError(f"{op}: argument '{name}' applies to fp8 operands only")
        return None
    if scale is None:
        raise ValueError(
            f"{op}: argument '{name}' is required for fp8 operands: a float32 tensor of one element, the "
            "per-tensor scale the operand is multiplied by"
        )
    check_tensor(op, name, scale, dtypes=(torch.float32,))
    if scale.numel() != 1:  # type: ignore[union-attr]
        raise ValueError(f"{op}: argument '{name}' must have one element, got shape {tuple(scale.shape)}")  # type: ignore[union-attr]
    return scale  # type: ignore[return-value]


def _check_broadcast(op: str, name: str, t: object, shape: tuple[int, ...]) -> torch.Tensor:
    tensor = check_tensor(op, name, t)
    try:
        ok = broadcast_shapes(tensor.shape, shape) == shape
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(
            f"{op}: argument '{name}' has shape {tuple(tensor.shape)}; it must broadcast to the "
            f"output's shape {shape}"
        )
    return tensor


def _rows_merge(t: torch.Tensor) -> bool:
    """Whether ``t``'s batch dimensions and its rows can be viewed as one dimension."""
    dims = [(size, stride) for size, stride in zip(t.shape[:-1], t.stride()[:-1]) if size != 1]
    return all(outer[1] == inner[0] * inner[1] for outer, inner in itertools.pairwise(dims))


def _run(op, names, input, other, epi, c, bias, residual, out_dtype, scale_a, scale_b, want_amax, fast_accum):
    """Validate, bring the call to the op's shapes and run it (through autograd when needed).

    Returns the result and, for a plain eager call that a later one may repeat without checks, a
    function ``fast(input, other, bias, p0, p1)`` doing the same: its plan reads only data
    pointers, which the views made here share with the raw tensors.
    """
    check_tensor(op, names[0], input, dtypes=INPUT_DTYPES, min_ndim=1)
    check_tensor(op, names[1], other, dtypes=INPUT_DTYPES, min_ndim=1)
    fp8 = input.dtype in FP8_DTYPES
    if (other.dtype in FP8_DTYPES) != fp8 or (not fp8 and other.dtype != input.dtype):
        raise TypeError(
            f"{op}: argument '{names[1]}' has dtype {other.dtype} but '{names[0]}' has {input.dtype}; "
            "accepted: equal dtypes among float16, bfloat16, float32, float64, or any two of "
            "float8_e4m3fn, float8_e5m2"
        )
    if input.device != other.device:
        raise ValueError(f"{op}: '{names[1]}' is on {other.device} but '{names[0]}' is on {input.device}")
    if epi is not None and not isinstance(epi, Epilogue):
        raise TypeError(
            f"{op}: argument 'epilogue' must be a tdnn.Epilogue or None, got {type(epi).__name__}"
        )
    epi = epi or Epilogue()
    a = input.unsqueeze(0) if input.ndim == 1 else input
    b = other.unsqueeze(-1) if other.ndim == 1 else other
    if a.shape[-1] != b.shape[-2]:
        raise _shape_error(op, names, input, other)
    try:
        batch = tuple(broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    except RuntimeError:
        raise ValueError(
            f"{op}: the batch dimensions of '{names[0]}' {tuple(input.shape[:-2])} and '{names[1]}' "
            f"{tuple(other.shape[:-2])} do not broadcast"
        ) from None
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    full = (*batch, m, n)
    shape = (*batch, *((m,) if input.ndim > 1 else ()), *((n,) if other.ndim > 1 else ()))
    if not isinstance(fast_accum, bool) or (fast_accum and not fp8):
        raise ValueError(
            f"{op}: argument 'use_fast_accum'={fast_accum!r} must be a bool, and True only for fp8 operands"
        )
    scale_a = _check_scale(op, "scale_a", scale_a, fp8)
    scale_b = _check_scale(op, "scale_b", scale_b, fp8)
    if out_dtype is not None and epi.out_dtype is not None and out_dtype != epi.out_dtype:
        raise ValueError(
            f"{op}: argument 'out_dtype'={out_dtype} contradicts epilogue.out_dtype={epi.out_dtype}"
        )
    out_dtype = out_dtype or epi.out_dtype or (torch.bfloat16 if fp8 else input.dtype)
    check_dtype(op, "out_dtype", out_dtype, FLOAT_DTYPES)
    if (c is None) != (epi.beta == 0.0):
        raise ValueError(
            f"{op}: argument 'c' must be given exactly when epilogue.beta is non-zero "
            f"(beta={epi.beta}, c {'given' if c is not None else 'missing'})"
        )
    if (residual is None) == epi.residual:
        raise ValueError(f"{op}: argument 'residual' must be given exactly when epilogue.residual is True")
    if (bias is None) != (epi.bias == "none"):
        raise ValueError(
            f"{op}: argument 'bias' must be given exactly when epilogue.bias is not 'none' "
            f"(it is {epi.bias!r})"
        )
    if bias is not None:
        length = n if epi.bias == "col" else m
        check_tensor(op, "bias", bias, min_ndim=1, max_ndim=1)
        if bias.shape[0] != length:
            raise ValueError(
                f"{op}: argument 'bias' has shape {tuple(bias.shape)}; a per-{epi.bias} bias needs "
                f"({length},)"
            )
    if c is not None:
        c = _check_broadcast(op, "c", c, shape).expand(shape).reshape(full)
    if residual is not None:
        residual = _check_broadcast(op, "residual", residual, shape).expand(shape).reshape(full)
    grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (input, other, c, bias, residual)
    )
    if grad and fp8:
        raise ValueError(f"{op}: fp8 operands have no backward; call it on tensors that do not require grad")
    # B without a batch over a batched A: the batch folds into A's rows (one bigger GEMM) when it
    # can be viewed so. A batch that does not merge into two dimensions is copied into one.
    others = [t for t in (c, residual) if t is not None]
    copied = False
    if b.ndim == 2 and a.ndim > 2 and epi.bias != "row" and all(_rows_merge(t) for t in (a, *others)):
        a = a.reshape(-1, k)
        c, residual = (None if t is None else t.reshape(-1, n) for t in (c, residual))
    elif batch and merged_batch_dims(a, b, c, residual) > 2:
        a = a.expand(*batch, m, k).reshape(-1, m, k)
        b = b.expand(*batch, k, n).reshape(-1, k, n)
        c, residual = (None if t is None else t.reshape(-1, m, n) for t in (c, residual))
        copied = True
    p0, p1 = epi.params
    act, bias_kind = epi.activation_kind, epi.bias_kind
    store_pre = epi.store_preactivation
    if grad:
        outs = _MatmulFunction.apply(
            a, b, c, bias, residual, epi.alpha, epi.beta, bias_kind, act, p0, p1, store_pre, out_dtype
        )
        (out, pre), am = (outs if store_pre else (outs, None)), None
    else:
        out, pre, am = _forward(
            a,
            b,
            c,
            bias,
            residual,
            scale_a,
            scale_b,
            epi.alpha,
            epi.beta,
            bias_kind,
            act,
            p0,
            p1,
            store_pre,
            want_amax,
            out_dtype,
            fast_accum,
        )
    out = out.view(shape)
    result = MatmulOutput(out, pre.view(shape) if store_pre else None, am if want_amax else None)
    fast = None
    if (
        not (copied or fp8 or store_pre or want_amax or others or epi.alpha != 1.0)
        and eager_tensor(input)
        and eager_tensor(other)
        and (bias is None or eager_tensor(bias))
    ):
        if not grad:
            run = forward_plan(a, b, None, bias, None, False, out_dtype, bias_kind, act, False, False)

            def fast(x: _T, y: _T, bias: _T | None, p0: float, p1: float, transposed: bool = False,
                     cast: torch.dtype | None = None) -> _T:  # fmt: skip
                # Only data pointers matter here: ``y`` may be B or the tensor B transposes.
                if cast is not None:  # autocast's, as ``_linear_autocast`` has them made here
                    x, y = lowered(x, cast), lowered_weight(y, cast)
                return run(x, y, None, bias, None, None, None, 1.0, 0.0, p0, p1)[0].view(shape)

        elif input.ndim > 1 and other.ndim > 1:
            rows = a.shape if a.ndim != input.ndim else None
            out_shape = shape if rows is not None else None
            plan = forward_plan(a, b, None, bias, None, False, out_dtype, bias_kind, act, act >= 0, False)

            def fast(x: _T, y: _T, bias: _T | None, p0: float, p1: float, transposed: bool = False,
                     cast: torch.dtype | None = None) -> _T:  # fmt: skip
                # ``y``: B, or the tensor whose transpose B is (``transposed``, a linear's weight).
                return apply_eager(
                    x, y, None, bias, None, 1.0, 0.0, bias_kind, act, p0, p1, False, out_dtype, rows,
                    transposed, out_shape, plan, cast,
                )  # fmt: skip

            # What a chain of products needs to run this call inside its own node (autograd.Product
            # with the activation's parameters).
            fast.product = (plan, rows, out_shape, bias_kind, act)  # type: ignore[attr-defined]

    return (result if store_pre or want_amax else out), fast


# Eager calls seen before (plain tensors, no c, residual, scales or extra outputs) run ``_run``'s
# ``fast`` function, keyed by the call's own shapes, strides and options.
_eager: dict[tuple, Callable[..., torch.Tensor]] = {}


@autocast_policy(LOWER, LOWER)
def matmul(
    input: torch.Tensor,
    other: torch.Tensor,
    *,
    epilogue: Epilogue | None = None,
    c: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    scale_a: torch.Tensor | None = None,
    scale_b: torch.Tensor | None = None,
    amax: bool = False,
    use_fast_accum: bool = False,
) -> torch.Tensor | MatmulOutput:
    """``torch.matmul`` with a fused epilogue: ``act(alpha * input @ other + beta * c + bias) + residual``.

    Args:
        input, other: fp16, bf16, fp32 or fp64 tensors of the same dtype, or fp8 (float8_e4m3fn,
            float8_e5m2, any pair; Hopper GPUs). Shapes as ``torch.matmul``: 1-D operands are
            vectors, batch dimensions broadcast. Any strides: transposed views are read in place.
        epilogue: what to do to the product (``tdnn.Epilogue``); None for a plain product.
        c: the C input scaled by ``epilogue.beta``; must broadcast to the output's shape.
        bias: a 1-D vector of length N (``epilogue.bias="col"``) or M (``"row"``).
        residual: added after the activation; must broadcast to the output's shape.
        out_dtype: the output dtype (default: the inputs', bf16 for fp8), also settable as
            ``epilogue.out_dtype``.
        scale_a, scale_b: fp8 only, required: float32 tensors of one element multiplying each operand.
        amax: also return max |output| (an fp32 scalar), for fp8 scaling recipes.
        use_fast_accum: fp8 only, as ``torch._scaled_mm``'s: let the tensor cores accumulate the
            whole K loop in their own reduced precision. By default the partial sums are added
            into fp32 every 128 (one K tile), as cuBLAS does. On H100 fast accumulation ran 1.2x
            faster (8192^3 e4m3); relative error at K = 8192 (fp32 output) 3.4e-4 against 1.3e-4.

    Returns the output, or a ``MatmulOutput(out, preactivation, amax)`` when
    ``epilogue.store_preactivation`` or ``amax`` asks for more.

    Numerics: fp32 accumulation (fp64 for fp64), TF32 for fp32 only with
    ``tdnn.config.allow_tf32``. Gradients flow to every tensor input but the fp8 ones.

    Raises TypeError for unsupported dtypes or dtype pairs, ValueError for mismatched inner
    dimensions, batch dimensions that do not broadcast, missing fp8 scales and epilogue tensors
    that do not match the epilogue.
    """
    plain = (
        epilogue is None
        and c is None
        and bias is None
        and residual is None
        and out_dtype is None
        and scale_a is None
        and scale_b is None
        and not amax
        and not use_fast_accum
    )
    key = None
    if plain and eager_tensor(input) and eager_tensor(other) and input.device == other.device:
        key = (
            "matmul",
            torch.is_grad_enabled() and (input.requires_grad or other.requires_grad),
            config.version,
            input.shape,
            input.stride(),
            input.dtype,
            other.shape,
            other.stride(),
            other.dtype,
        )
        fast = _eager.get(key)
        if fast is not None:
            return fast(input, other, None, 0.0, 0.0)
    names = ("input", "other")
    result, fast = _run(
        "tdnn.matmul", names, input, other, epilogue, c, bias, residual, out_dtype, scale_a, scale_b, amax,
        use_fast_accum,
    )  # fmt: skip
    if key is not None and fast is not None:
        _eager[key] = fast
    return result


_CASTABLE = (torch.float32, torch.float16, torch.bfloat16)  # what autocast casts to a lower dtype


def _linear_autocast(
    dtype: torch.dtype,
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str | None = None,
    activation_params: tuple[float, ...] = (),
    residual: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``linear`` under autocast with the casts of input and weight to ``dtype`` inside its autograd
    node (their gradients come out of the products in their own dtypes, no cast nodes) and the
    bias read in its own dtype; ``NotImplemented`` (autocast's casts, then ``linear``) for calls
    with nothing to cast or outside the cached eager path's reach."""
    if residual is not None or out_dtype is not None or not (eager_tensor(input) and eager_tensor(weight)):
        return NotImplemented
    if not casts_inside(dtype, input.dtype, weight, bias):
        return NotImplemented
    return _linear(input, weight, bias, activation, activation_params, None, None, dtype)


def casts_inside(
    dtype: torch.dtype, input_dtype: torch.dtype, weight: torch.Tensor, bias: torch.Tensor | None
) -> bool:
    """Whether ``linear`` under autocast to ``dtype`` casts an input of ``input_dtype`` and
    ``weight`` inside its node (``_linear_autocast``): both castable, not all three already in
    ``dtype``."""
    if input_dtype not in _CASTABLE or weight.dtype not in _CASTABLE:
        return False
    return not (input_dtype == dtype and weight.dtype == dtype and (bias is None or bias.dtype == dtype))


@autocast_policy(LOWER, LOWER, inside=_linear_autocast)
def linear(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str | None = None,
    activation_params: tuple[float, ...] = (),
    residual: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``F.linear`` with a fused activation and residual: ``act(input @ weight.T + bias) + residual``.

    Args:
        input: (*, in_features), fp16/bf16/fp32/fp64.
        weight: (out_features, in_features) or (in_features,), the input's dtype; read in place
            (no transposed copy).
        bias: (out_features,), or one element for a 1-D weight.
        activation, activation_params: as ``tdnn.Epilogue`` (e.g. ``"gelu"``, ``"silu"``).
        residual: added after the activation; must broadcast to the output (*, out_features).
        out_dtype: the output dtype (default: the input's).

    Gradients flow to input, weight, bias and residual. Under autocast the product runs in the
    autocast dtype as ``F.linear``'s does; input and weight are cast inside the op (their
    gradients return in their own dtypes, from fp32 accumulators) and a bias is added in its own
    dtype (PyTorch rounds it to the autocast dtype first).
    """
    return _linear(input, weight, bias, activation, activation_params, residual, out_dtype, None)


def _linear(input, weight, bias, activation, activation_params, residual, out_dtype, cast):
    """``linear``; ``cast``: the dtype input and weight are cast to inside the op, or None."""
    key = None
    if (
        residual is None
        and out_dtype is None
        and eager_tensor(input)
        and eager_tensor(weight)
        and input.device == weight.device
        and (bias is None or (eager_tensor(bias) and bias.ndim == 1))
        and type(activation_params) is tuple
    ):
        grad = torch.is_grad_enabled() and (
            input.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
        )
        key = linear_key(input, weight, bias, activation, activation_params, cast, grad)
        fast = _eager.get(key)
        if fast is not None:
            return fast(input, weight, bias, *_params(activation, activation_params), True, cast)
    op = "tdnn.linear"
    given = (input, weight, bias)
    if cast is not None:  # checked and planned as the cast tensors, run with the casts inside
        input, weight = input.to(cast), weight.to(cast)
    check_tensor(op, "input", input, dtypes=INPUT_DTYPES, min_ndim=1)
    check_tensor(op, "weight", weight, dtypes=INPUT_DTYPES, min_ndim=1, max_ndim=2)
    if weight.shape[-1] != input.shape[-1]:
        raise ValueError(
            f"{op}: argument 'weight' has shape {tuple(weight.shape)}; its last dimension must equal "
            f"the last dimension of 'input' of shape {tuple(input.shape)}"
        )
    if bias is not None:
        check_tensor(op, "bias", bias)
        features = weight.shape[0] if weight.ndim == 2 else 1
        if bias.numel() != features or bias.ndim > 1:
            raise ValueError(f"{op}: argument 'bias' has shape {tuple(bias.shape)}; accepted: ({features},)")
        bias = bias.reshape(features)
    epi = Epilogue(
        bias="none" if bias is None else "col",
        activation=activation,
        activation_params=tuple(activation_params),
        residual=residual is not None,
    )
    b = weight.t() if weight.ndim == 2 else weight
    out, fast = _run(
        op, ("input", "weight"), input, b, epi, None, bias, residual, out_dtype, None, None, False, False
    )
    if key is not None and fast is not None:
        _eager[key] = fast
        if cast is not None:  # this call too, so that every call of the key computes alike
            return fast(*given, *_params(activation, activation_params), True, cast)
    return out


def linear_key(input, weight, bias, activation, activation_params, cast, grad: bool) -> tuple:
    """The key of ``linear``'s cached eager calls (``_eager``) for a call on plain tensors of one
    device without residual or out_dtype: ``grad``, whether autograd records it; ``cast``, the
    dtype input and weight are cast to inside the op, or None."""
    return (
        "linear", grad, config.version, input.shape, input.stride(), input.dtype,
        weight.shape, weight.stride(), weight.dtype,
        None if bias is None else (bias.shape, bias.stride(), bias.dtype),
        activation, activation_params, cast,
    )  # fmt: skip


@functools.cache
def _params(activation: str | None, activation_params: tuple[float, ...]) -> tuple[float, float]:
    return Epilogue(activation=activation, activation_params=activation_params).params
