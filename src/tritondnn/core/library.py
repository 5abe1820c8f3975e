"""torch.library registration with an eager fast path.

Every kernel entry point is a ``torch.library`` custom op (``torch.ops.tritondnn.<name>``) with a
fake implementation, so ``torch.compile(fullgraph=True)`` and ``torch.export`` trace through it. The
dispatcher costs tens of microseconds per call, so plain eager calls on ordinary tensors skip it and
run the implementation directly; tracing (dynamo, fake tensors, other tensor subclasses) goes
through the op.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from .backend import ON_DEVICE_ATTR

F = TypeVar("F", bound=Callable[..., Any])
# The tensor types calls take the direct (and cached) paths with; subclasses go through the op.
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def eager_tensor(x: object) -> bool:
    """Whether ``x`` is an ordinary tensor (or parameter) on the backend's device and no tracing is
    under way: a call on it may take a family's cached path, through autograd or not."""
    return direct_call(x) and getattr(x, ON_DEVICE_ATTR)


def plain_eager(x: object) -> bool:
    """Whether a call on ``x`` may take a family's cached fast path: ``eager_tensor`` with no
    autograd to record."""
    return eager_tensor(x) and not (x.requires_grad and torch.is_grad_enabled())  # type: ignore[union-attr]


def direct_call(x: object) -> bool:
    """Whether a ``custom_op`` called with ``x`` first runs its implementation directly (no
    dispatcher, no tracing)."""
    return type(x) in PLAIN_TENSORS and not torch.compiler.is_compiling()


# The ops' library. An op is defined on it with ``define`` + ``impl`` rather than with
# ``torch.library.custom_op``, whose Python autograd and device-dispatch wrappers (and output
# aliasing checks) run on every dispatched call: a matmul through the op cost 96 us of host time
# that way against 45 us so (2-core CPU, launch stubbed; 19 us called directly). That is the
# cost of every op inside a torch.compile'd graph. Ops that mutate arguments keep custom_op,
# which also bumps the mutated tensors' version counters.
_LIBRARY = torch.library.Library("tritondnn", "FRAGMENT")


def custom_op(
    name: str, schema: str, fake: Callable[..., Any], mutates_args: tuple[str, ...] = ()
) -> Callable[[F], F]:
    """Register the decorated function as ``tritondnn::name`` with ``schema`` and its fake
    implementation; ``mutates_args`` names the arguments it writes in place (marked ``(a!)``).

    The returned callable runs the function directly when not tracing and its first argument is a
    plain tensor, and dispatches through ``torch.ops.tritondnn.name`` otherwise. The op (an
    ``OpOverload``, or the ``CustomOpDef`` of a mutating one) is the callable's ``op`` attribute.
    The ops have no autograd kernel: autograd records the autograd.Functions around them.
    """

    def decorate(impl: F) -> F:
        op: Any
        if mutates_args:
            op = torch.library.custom_op(f"tritondnn::{name}", impl, mutates_args=mutates_args, schema=schema)
            op.register_fake(fake)
        else:
            _LIBRARY.define(name + schema, tags=(torch.Tag.pt2_compliant_tag,))
            _LIBRARY.impl(name, impl, "CompositeExplicitAutograd")
            torch.library.register_fake(f"tritondnn::{name}", fake, lib=_LIBRARY)
            op = getattr(torch.ops.tritondnn, name).default

        @functools.wraps(impl)
        def call(*args: Any) -> Any:
            if direct_call(args[0]):
                return impl(*args)
            return op(*args)

        call.op = op  # type: ignore[attr-defined]
        return call  # type: ignore[return-value]

    return decorate


# torch.autograd.Function.apply's Python wrapper looks for functorch transforms and unwraps dead
# functorch wrappers on every call (~10 us of host time), then calls the C implementation; with no
# transform active the fast paths call that directly.
functorch_active: Callable[[], bool] = torch._C._are_functorch_transforms_active


def raw_apply(cls: type[torch.autograd.Function]) -> Callable[..., Any]:
    """``cls.apply`` without its Python wrapper, for calls made while ``functorch_active()`` is
    False (``cls.apply`` itself where this torch lacks the C entry point). ``cls`` must not define
    ``setup_context`` (the wrapper binds default arguments for those)."""
    descriptor = vars(torch._C._FunctionBase).get("apply") if hasattr(torch._C, "_FunctionBase") else None
    return descriptor.__get__(None, cls) if descriptor is not None else cls.apply


@functools.cache
def dynamo_rules_built() -> None:
    """Build torch._dynamo's tables of known functions before the first torch.fx trace (the
    operation graph's and ``patch(fuse=True)``'s). fx replaces ``math``'s functions in the traced
    code while it traces; tables first built inside that window key the replacements, and every
    later ``torch.compile`` in the process then refuses ``math.isfinite`` & co. (seen: fullgraph
    compiles of tritondnn ops failing after a trace. A fused model's fullgraph compile has also
    failed so, in ``check_eps``, after other tests in the same process, now and then: built
    before fusion's traces too, not reproduced on demand either way.)"""
    import torch._dynamo.trace_rules as rules

    rules.lookup(math.isfinite)
