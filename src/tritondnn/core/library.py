"""torch.library registration with an eager fast path.

Every kernel entry point is a ``torch.library`` custom op (``torch.ops.tritondnn.<name>``) with a
fake implementation, so ``torch.compile(fullgraph=True)`` and ``torch.export`` trace through it. The
dispatcher costs tens of microseconds per call, so plain eager calls on ordinary tensors skip it and
run the implementation directly; tracing (dynamo, fake tensors, other tensor subclasses) goes
through the op.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from .backend import ON_DEVICE_ATTR

F = TypeVar("F", bound=Callable[..., Any])
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def plain_eager(x: object) -> bool:
    """Whether a call on ``x`` may take a family's cached fast path: an ordinary tensor on the
    backend's device, no autograd to record, no tracing under way."""
    return (
        type(x) is torch.Tensor
        and getattr(x, ON_DEVICE_ATTR)
        and not (x.requires_grad and torch.is_grad_enabled())
        and not torch.compiler.is_compiling()
    )


def custom_op(
    name: str, schema: str, fake: Callable[..., Any], mutates_args: tuple[str, ...] = ()
) -> Callable[[F], F]:
    """Register the decorated function as ``tritondnn::name`` with ``schema`` and its fake
    implementation; ``mutates_args`` names the arguments it writes in place (marked ``(a!)``).

    The returned callable runs the function directly when not tracing and its first argument is a
    plain tensor, and dispatches through ``torch.ops.tritondnn.name`` otherwise. The op is
    available as the callable's ``op`` attribute.
    """

    def decorate(impl: F) -> F:
        op = torch.library.custom_op(f"tritondnn::{name}", impl, mutates_args=mutates_args, schema=schema)
        op.register_fake(fake)

        @functools.wraps(impl)
        def call(*args: Any) -> Any:
            if type(args[0]) in _PLAIN and not torch.compiler.is_compiling():
                return impl(*args)
            return op(*args)

        call.op = op  # type: ignore[attr-defined]
        return call  # type: ignore[return-value]

    return decorate
