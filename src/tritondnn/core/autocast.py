"""torch.autocast for the public functional ops.

The kernels run in whatever dtype they are given, and an eager call skips the dispatcher (see
``library``), where autocast would otherwise cast. So each public function that PyTorch's autocast
would cast declares its policy with ``@autocast_policy``:

- ``"lower"``: matrix products (matmul, linear, convolution, attention, RNNs) run in the autocast
  dtype, like ``torch.mm``/``F.conv2d``/``F.scaled_dot_product_attention`` do;
- ``"fp16"``: like ``"lower"`` but always float16, as PyTorch's CUDA autocast runs cuDNN's RNNs
  (an LSTM under a bf16 autocast returns fp16 there);
- ``"fp32"``: ops PyTorch's CUDA autocast runs in float32 (layer/group norm, softmax and
  log-softmax without ``dtype``, softplus): fp16/bf16 inputs are widened to float32.

Policies are per device type, as PyTorch's are (CPU autocast keeps norms and softmax in the input
dtype). Outside autocast a call pays one flag check.
"""

from __future__ import annotations

import functools
import inspect
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])

LOWER = "lower"
FP16 = "fp16"
FP32 = "fp32"
_LOW_PRECISION = (torch.float16, torch.bfloat16)
_CAST_TO_LOWER = (torch.float32, *_LOW_PRECISION)  # float64 and non-floating tensors are never cast


def _device_type(values: Any) -> str | None:
    """The device type of the first tensor among ``values``, looking inside lists and tuples."""
    for a in values:
        if isinstance(a, torch.Tensor):
            return a.device.type
        if isinstance(a, (list, tuple)):
            found = _device_type(a)
            if found is not None:
                return found
    return None


def _cast(value: Any, policy: str, dtype: torch.dtype) -> Any:
    """Autocast's rule: float64 tensors are never cast; other floating tensors are, also inside a
    list or tuple (an RNN's flat weights, its (h0, c0)) or a named tuple (a PackedSequence's data;
    its integer batch sizes stay)."""
    if isinstance(value, torch.Tensor):
        # Tensors already in the target dtype skip ``.to`` (a no-op that still costs a C call).
        have = value.dtype
        if policy in (LOWER, FP16):
            return value.to(dtype) if have != dtype and have in _CAST_TO_LOWER else value
        return value.float() if have in _LOW_PRECISION else value
    if isinstance(value, (list, tuple)):
        items = (_cast(v, policy, dtype) for v in value)
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value


# A norm under autocast runs in fp32 and returns fp32, which the product after it casts down again
# (a kernel of its own, reading the fp32 tensor back). A kernel can store its output's rounded copy
# as it writes the output (``attach_lowered``), and the products' casts (``lowered``) take the copy
# instead of casting. One copy is kept, the latest, and only while its output lives and is
# unchanged: same version counter and storage. A write that bypasses the version counter (through
# ``.data``, DLPack, an in-place collective, a custom kernel) between the norm and the product
# would go unseen, as it would by autograd's checks of saved tensors.
_lowered: list[tuple | None] = [None]  # (weak reference to the output, its version, address, copy)


def attach_lowered(t: torch.Tensor, low: torch.Tensor) -> None:
    """Keep ``low`` (``t`` rounded to ``low.dtype``, same shape, written by the kernel that wrote
    ``t``) as the copy ``lowered`` hands out for ``t``, in place of the one kept before."""
    if t.is_inference():  # no version counter to check later
        return
    _lowered[0] = (weakref.ref(t, _forget_lowered), t._version, t.data_ptr(), low)


def _forget_lowered(ref: weakref.ref) -> None:
    """Drop the kept copy with its output (called when the output is freed)."""
    entry = _lowered[0]
    if entry is not None and entry[0] is ref:
        _lowered[0] = None


def lowered(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)``: the copy ``attach_lowered`` keeps, where it is ``t``'s in that dtype and
    ``t`` is unchanged since, else a cast. The copy may be handed to several consumers (q, k and v
    projections of one norm's output): they must not write to it."""
    if t.dtype == dtype:
        return t  # what ``t.to(dtype)`` returns, without its call (a product's input often is)
    entry = _lowered[0]
    if entry is not None and entry[0]() is t:
        _, version, ptr, low = entry
        if low.dtype == dtype and t._version == version and t.data_ptr() == ptr:
            return low
    return t.to(dtype)


class _StepCasts(threading.local):
    """A patched model's open step (nn/conv_bn.py's ``_Step``) and the products' weights: the
    casts it made ahead of the forward, in one launch, and the weights its products cast, which
    its next forward casts that way. Per thread (DataParallel's replicas)."""

    # id(weight) -> (weight, its version, address, shape and strides when cast, the buffer
    # holding the cast, its offset there)
    table: dict[int, tuple] | None = None
    seen: list[torch.Tensor] | None = None  # None: no step open


step_casts = _StepCasts()


def step_cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """The open step's cast of ``t`` to ``dtype`` where its launch made one of ``t`` as ``t`` is
    now (same tensor, version counter, address, shape and strides: a write through ``.data``
    goes unseen, as by autograd's checks), else None."""
    table = step_casts.table
    entry = None if table is None else table.get(id(t))
    if entry is None or entry[0] is not t or entry[1] != t._version or entry[2] != t.data_ptr():
        return None
    _, _, _, shape, strides, flat, offset = entry
    if flat.dtype != dtype or t.shape != shape or t.stride() != strides:
        return None
    return flat.as_strided(shape, strides, offset)


def lowered_weight(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)`` for a product's weight: the open step's cast (``step_cast``) where there is
    one, else a cast; a parameter's (an fp32 leaf that requires grad) is noted for the step's
    next forwards."""
    seen = step_casts.seen
    if seen is None:
        return t.to(dtype)
    cast = step_cast(t, dtype)
    if cast is not None or (t.is_leaf and t.requires_grad and t.dtype == torch.float32):
        seen.append(t)
    return cast if cast is not None else t.to(dtype)


# One C call on the hot path of every decorated op outside autocast (torch.utils.checkpoint uses
# the same private query); the public per-device form where it is missing.
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None) or (
    lambda: torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu")
)

Policy = str | Callable[[torch.Tensor], str | None] | None


def autocast_policy(
    cuda: Policy, cpu: Policy = None, skip_if: str | None = None, inside: Callable[..., Any] | None = None
) -> Callable[[F], F]:
    """Decorate a public op with its autocast policy on CUDA and on CPU (None: no cast there; a
    function of the first argument where PyTorch's policy depends on it, e.g. on the rank).

    ``skip_if`` names a keyword argument that, when given (not None), turns the cast off, as an
    explicit ``dtype=`` does for PyTorch's softmax. Floating tensors among the arguments are cast,
    then the op runs with autocast off so no torch call inside it recasts.

    ``inside(dtype, *args, **kwargs)``, if given, is tried first in eager mode (autocast off): it
    runs the op with the casts to ``dtype`` inside the op's own autograd node (no cast nodes
    recorded: host time in both passes), or returns ``NotImplemented`` for the casts above.
    """
    policies = {"cuda": cuda, "cpu": cpu}

    def decorate(fn: F) -> F:
        # Where ``skip_if`` sits among the positional parameters (it may be passed by position).
        names = list(inspect.signature(fn).parameters)
        skip_at = names.index(skip_if) if skip_if in names else None

        def skipped(args: tuple, kwargs: dict) -> bool:
            if skip_if is None:
                return False
            if kwargs.get(skip_if) is not None:
                return True
            return skip_at is not None and len(args) > skip_at and args[skip_at] is not None

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if not _any_autocast():
                return fn(*args, **kwargs)
            first = args[0] if args else None
            if isinstance(first, torch.Tensor):  # the common case, without building a tuple
                device_type: str | None = first.device.type
            else:
                device_type = _device_type((*args, *kwargs.values()))
            policy = policies.get(device_type) if device_type is not None else None
            if callable(policy):
                policy = policy(first)
            if policy is None or not torch.is_autocast_enabled(device_type) or skipped(args, kwargs):
                return fn(*args, **kwargs)
            dtype = torch.float16 if policy == FP16 else torch.get_autocast_dtype(device_type)
            if torch.compiler.is_compiling():
                args = tuple(_cast(a, policy, dtype) for a in args)
                kwargs = {k: _cast(v, policy, dtype) for k, v in kwargs.items()}
                with torch.autocast(device_type, enabled=False):
                    return fn(*args, **kwargs)
            # The context manager costs ~10 us of host time a call; the flag alone is what matters.
            torch.set_autocast_enabled(device_type, False)
            try:
                if inside is not None:
                    out = inside(dtype, *args, **kwargs)
                    if out is not NotImplemented:
                        return out
                args = tuple(_cast(a, policy, dtype) for a in args)
                if kwargs:
                    kwargs = {k: _cast(v, policy, dtype) for k, v in kwargs.items()}
                return fn(*args, **kwargs)
            finally:
                torch.set_autocast_enabled(device_type, True)

        return call  # type: ignore[return-value]

    return decorate
