"""Which machine runs the kernels: a CUDA GPU (compiled Triton) or Triton's interpreter on the CPU.

The choice is made once, when tritondnn is imported, and before any ``@triton.jit`` kernel of ours
is defined: Triton decides at decoration time whether a kernel is compiled or interpreted, so the
``TRITON_INTERPRET`` variable must be set before the first ``ops`` module is imported.

``TRITONDNN_BACKEND`` overrides the automatic choice:

* ``auto`` (default): ``gpu`` when PyTorch sees a CUDA device, otherwise ``interpret``;
* ``gpu``: compiled kernels on CUDA tensors (an error if no CUDA device is visible);
* ``interpret``: Triton's interpreter on CPU tensors, even where a GPU exists (for debugging).
"""

from __future__ import annotations

import os

import torch

BACKENDS = ("auto", "gpu", "interpret")


def _truthy(value: str | None) -> bool:
    return value is not None and value.strip().lower() in ("1", "true", "yes", "on")


def _choose() -> str:
    requested = os.environ.get("TRITONDNN_BACKEND", "auto").strip().lower()
    if requested not in BACKENDS:
        raise ValueError(f"TRITONDNN_BACKEND={requested!r} is not one of {', '.join(BACKENDS)}")
    triton_interpret = _truthy(os.environ.get("TRITON_INTERPRET"))
    if requested == "auto":
        requested = "interpret" if triton_interpret or not torch.cuda.is_available() else "gpu"
    if requested == "gpu":
        if triton_interpret:
            raise RuntimeError(
                "TRITONDNN_BACKEND=gpu conflicts with TRITON_INTERPRET=1 in the environment; unset one"
            )
        if not torch.cuda.is_available():
            raise RuntimeError("TRITONDNN_BACKEND=gpu but PyTorch sees no CUDA device")
    else:
        os.environ["TRITON_INTERPRET"] = "1"
    return requested


_BACKEND = _choose()
# Tensors the kernels accept live on this device type.
DEVICE_TYPE = "cuda" if _BACKEND == "gpu" else "cpu"
# The tensor attribute that is True on that device; cheaper to read than ``tensor.device``.
ON_DEVICE_ATTR = "is_cuda" if _BACKEND == "gpu" else "is_cpu"
INTERPRET = _BACKEND == "interpret"


def backend() -> str:
    """The backend chosen at import: ``"gpu"`` (compiled Triton) or ``"interpret"`` (CPU)."""
    return _BACKEND


_SM_COUNT: dict[int, int] = {}


def multiprocessor_count(device: int = 0) -> int:
    """Streaming multiprocessors of a GPU, for persistent grids (4 under the interpreter, where a
    small grid keeps the CPU run short and still exercises every program's loop)."""
    if INTERPRET:
        return 4
    if device not in _SM_COUNT:
        _SM_COUNT[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNT[device]


def sm_count() -> int:
    """Streaming multiprocessors of the current GPU (a nominal 4 under the interpreter)."""
    return multiprocessor_count(0 if INTERPRET else torch.cuda.current_device())


def hopper() -> bool:
    """Whether the current GPU has Hopper's tensor descriptors (TMA) and warp-group MMAs (compute
    capability 9.0 or newer); False under the interpreter."""
    if INTERPRET:
        return False
    device = torch.cuda.current_device()
    if device not in _HOPPER:
        _HOPPER[device] = torch.cuda.get_device_capability(device) >= (9, 0)
    return _HOPPER[device]


_HOPPER: dict[int, bool] = {}


def device_name() -> str:
    """A human-readable name of the device kernels run on, used to key the autotune cache."""
    if INTERPRET:
        return "cpu-interpreter"
    return torch.cuda.get_device_name()
