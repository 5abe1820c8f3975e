"""Shared test helpers: the device, dtypes, layouts and the accuracy assertion."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import tritondnn as tdnn
from tritondnn.core.accuracy import check
from tritondnn.core.backend import DEVICE_TYPE

DEVICE = DEVICE_TYPE
ON_GPU = tdnn.backend() == "gpu"
LOW_PRECISION = (torch.float16, torch.bfloat16)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def assert_close(
    ours: torch.Tensor, ref: torch.Tensor, torch_out: torch.Tensor | None = None, what: str = ""
):
    """The ARCHITECTURE.md rule: within 2x PyTorch's own error (same dtype) plus atol(dtype)."""
    assert ours.dtype == (torch_out.dtype if torch_out is not None else ours.dtype)
    verdict = check(ours, ref, torch_out)
    assert verdict.ok, f"{what}: error {verdict.error:.3e} > bound {verdict.bound:.3e} {verdict.detail}"


def randn(*shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(shape, device=DEVICE, dtype=dtype) * scale


# Layouts: functions from a contiguous tensor to the same values in another memory layout.
LAYOUTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "contiguous": lambda t: t,
    "transposed": lambda t: t.transpose(0, -1).contiguous().transpose(0, -1),
    "channels_last": lambda t: t.to(memory_format=torch.channels_last) if t.ndim == 4 else t,
    "sliced": lambda t: _sliced(t),
}


def _sliced(t: torch.Tensor) -> torch.Tensor:
    """The same values as a strided view into a larger buffer (every second element of the last dim)."""
    big = torch.empty(*t.shape[:-1], 2 * t.shape[-1], device=t.device, dtype=t.dtype)
    view = big[..., ::2]
    view.copy_(t)
    return view


def grads(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, dy: torch.Tensor):
    """(output, input gradient) of ``fn`` at ``x`` for output gradient ``dy``."""
    xg = x.detach().requires_grad_(True)  # a new leaf over the same memory: the layout is kept
    y = fn(xg)
    (dx,) = torch.autograd.grad(y, xg, dy)
    return y.detach(), dx


def run_processes(fn: Callable[..., None], args: tuple, nprocs: int, timeout: float = 300.0) -> None:
    """``fn(rank, *args)`` in ``nprocs`` spawned processes (gloo tests); a process that fails
    raises here, and one still running after ``timeout`` seconds fails the test instead of
    hanging the suite. Spawned, not forked: a forked child inherits whatever locks the parent's
    other threads held at the fork, and a CI run hung so (the DDP test, 300 s)."""
    import time

    import pytest
    import torch.multiprocessing as mp

    context = mp.start_processes(fn, args=args, nprocs=nprocs, start_method="spawn", join=False)
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in context.processes:
                p.kill()
            pytest.fail(f"{fn.__name__}: processes still running after {timeout:.0f} s")


def torch_or_skip(run: Callable[[], Any]) -> Any:
    """``run()``, a PyTorch reference; the test is skipped where PyTorch's own CPU kernel cannot
    run here (oneDNN has no bf16 LSTM on CPUs without bf16 instructions)."""
    try:
        return run()
    except RuntimeError as exc:
        if "primitive descriptor" not in str(exc):
            raise
        pytest.skip(f"PyTorch's own kernel does not run on this CPU: {str(exc)[:80]}")
