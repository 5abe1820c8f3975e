"""Launching Triton kernels with little host overhead.

``kernel[grid](*args)`` re-derives on every call what each argument specializes the compiled kernel
on and builds launch metadata for profiler hooks: about 7 µs of host time per launch on the H100
machines we measured, as much as PyTorch's whole eager call for a small tensor.

A family caches one ``Launch`` per problem (shapes, strides, dtypes fixed), so everything Triton
specializes on is fixed too, except the device and the 16-byte alignment of each tensor's address.
A ``Launch`` keeps the compiled kernel per device and alignment pattern; for aligned tensors on
the device it first ran on, it calls the compiled kernel's C launcher directly.

Conventions: a kernel's parameters are its tensors, then its floats (both given per call), then
its ints, then its ``tl.constexpr`` parameters (both fixed per problem); the kernel runs on the
first tensor's GPU. Profiler launch hooks (``triton.knobs.runtime.launch_enter_hook``) are not
called on these paths.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .backend import INTERPRET


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for grids; ``triton.cdiv`` costs microseconds from Python (a constexpr function)."""
    return -(-a // b)


class Launch:
    """One kernel with its grid, ints, constexprs and launch options fixed; call it with the rest.

    Args:
        fn: the ``@triton.jit`` function; its parameters are the call's arguments (tensors, then
            floats), then ``ints``, then ``constexprs``.
        grid: up to three ints.
        num_tensors: how many leading parameters are tensors.
        ints, constexprs: the fixed parameters, in order.
    """

    __slots__ = ("_compiled", "_fast", "fn", "grid", "num_stages", "num_tensors", "num_warps", "tail")

    def __init__(
        self,
        fn: Any,
        grid: Sequence[int],
        num_tensors: int,
        ints: Sequence[int] = (),
        constexprs: Sequence[Any] = (),
        *,
        num_warps: int = 4,
        num_stages: int = 3,
    ) -> None:
        self.fn = fn
        self.grid = (*grid, 1, 1)[:3]
        self.num_tensors = num_tensors
        self.tail = (*ints, *constexprs)
        self.num_warps = num_warps
        self.num_stages = num_stages
        self._compiled: dict[tuple, Any] = {}
        # (device, C launch function, the arguments between the stream and the kernel's own):
        # the kernel compiled for 16-byte-aligned tensors on one device, launched without Python
        # in between (Triton's CudaLauncher.__call__ only adds scratch buffers, none needed here).
        self._fast: tuple | None = None

    def __call__(self, *args: Any) -> None:
        """Launch on ``args``: the tensors, then the floats, as the kernel lists them."""
        if INTERPRET:
            # Masked-off lanes compute on filler values (-inf - -inf, 0 / 0) as they do on a GPU,
            # where nothing notices; numpy would warn for each.
            with np.errstate(all="ignore"):
                self.fn[self.grid](*args, *self.tail)
            return
        fast = self._fast
        if fast is not None:
            ptrs = 0
            for t in args[: self.num_tensors]:
                ptrs |= t.data_ptr()
            device, launch, function, head = fast
            if not ptrs & 15 and args[0].get_device() == device == torch._C._cuda_getDevice():
                gx, gy, gz = self.grid
                launch(
                    gx, gy, gz, torch._C._cuda_getCurrentRawStream(device), function, *head, *args, *self.tail
                )
                return
        self._general(args)

    def _general(self, args: tuple) -> None:
        """Any alignment and device: compiled kernels keyed by both, launched through Triton's runner."""
        device = args[0].get_device()
        if device != torch._C._cuda_getDevice():
            with torch.cuda.device(device):
                return self._general(args)
        aligned = tuple(t.data_ptr() % 16 == 0 for t in args[: self.num_tensors])
        key = (device, aligned)
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._compiled[key] = self.fn[self.grid](
                *args, *self.tail, num_warps=self.num_warps, num_stages=self.num_stages
            )
            if all(aligned) and self._fast is None:
                self._fast = _direct_launcher(device, compiled)
            return
        gx, gy, gz = self.grid
        stream = torch._C._cuda_getCurrentRawStream(device)
        compiled.run(
            gx,
            gy,
            gz,
            stream,
            compiled.function,
            compiled.packed_metadata,
            None,
            None,
            None,
            *args,
            *self.tail,
        )


def _c_launcher_format() -> str | None:
    try:
        from triton.backends.nvidia import driver
    except ImportError:
        return None
    return getattr(driver, "_BASE_ARGS_FORMAT", None)


# The argument layout of the C launcher this code was written against (Triton 3.6): grid x/y/z,
# stream, function, cooperative, PDL, two scratch buffers, metadata, launch metadata, two hooks.
_DIRECT = not INTERPRET and _c_launcher_format() == "iiiKKppOOOOOO"


def _direct_launcher(device: int, compiled: Any) -> tuple | None:
    """What ``Launch`` needs to call the compiled kernel's C launcher itself, or None where this
    Triton's runner does more than forward its arguments (scratch buffers) or is another version."""
    runner = compiled.run
    if not _DIRECT or getattr(runner, "global_scratch_size", 1) or getattr(runner, "profile_scratch_size", 1):
        return None
    head = (runner.launch_cooperative_grid, runner.launch_pdl, None, None, compiled.packed_metadata)
    return device, runner.launch, compiled.function, (*head, None, None, None)
