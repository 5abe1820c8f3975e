"""Launching Triton kernels with little host overhead.

``kernel[grid](*args)`` re-derives on every call what each argument specializes the compiled kernel
on and builds launch metadata for profiler hooks: about 7 µs of host time per launch on the H100
machines we measured, as much as PyTorch's whole eager call for a small tensor.

A family caches one launcher per problem (shapes, strides, dtypes fixed), so everything Triton
specializes on is fixed too, except the device and the 16-byte alignment of each tensor's address.
A launcher keeps the compiled kernel per device and alignment pattern; for aligned tensors on the
device it first ran on, it calls the compiled kernel's C launcher directly.

Conventions: a kernel's parameters are its tensors, then its floats (both given per call), then
its ints, then its ``tl.constexpr`` parameters (both fixed per problem); the kernel runs on the
first tensor's GPU. Profiler launch hooks (``triton.knobs.runtime.launch_enter_hook``) are not
called on these paths.

Leading tensors may reach the kernel as tensor descriptors made on the host (``descriptors``):
their shape, strides and block are fixed per launcher like the rest, so a descriptor depends only
on the tensor's address; each launcher encodes one per address it meets and keeps it. The kernel
gets it by value among its parameters: no device-side descriptor in global scratch memory, and
a CUDA graph keeps what it was captured with.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
import triton
from triton.runtime import _allocation
from triton.tools.tensor_descriptor import TensorDescriptor

from .backend import DEVICE_TYPE, INTERPRET


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for grids; ``triton.cdiv`` costs microseconds from Python (a constexpr function)."""
    return -(-a // b)


def _scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    return torch.empty(size, device=DEVICE_TYPE, dtype=torch.int8)


def ensure_allocator() -> None:
    """Install the global-memory allocator that device-side tensor descriptors
    (``tl.make_tensor_descriptor``) are written into, unless one is set. Triton keeps it in a
    context variable that every thread starts without (autograd runs the backward pass in threads
    of its own), so launchers of descriptor kernels call this before each launch."""
    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch)


class Described(NamedTuple):
    """How a tensor argument reaches the kernel as a host-made tensor descriptor: the shape and
    strides it covers (the last stride 1; the others and the address 16-byte aligned) and the
    block a load or store moves."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    block: tuple[int, ...]

    def of(self, t: torch.Tensor) -> TensorDescriptor:
        """Triton's host-side descriptor of ``t`` so described."""
        return TensorDescriptor(t, list(self.shape), list(self.strides), list(self.block))


# The descriptor arguments a launcher keeps, by the described tensors' addresses, before it starts
# over: a training step meets a few dozen address combinations per problem (one per layer and
# buffer), the same ones step after step once the caching allocator has settled.
_KEPT_DESCRIPTORS = 256


def launcher(
    fn: Any,
    grid: Sequence[int],
    num_tensors: int,
    ints: Sequence[int] = (),
    constexprs: Sequence[Any] = (),
    *,
    num_warps: int = 4,
    num_stages: int = 3,
    descriptors: Sequence[Described | None] = (),
) -> Callable[..., None]:
    """A function launching ``fn`` on ``grid`` with its ints, constexprs and options fixed.

    Call it with the tensors, then the floats, as the kernel lists them; ``num_tensors`` says how
    many leading parameters are tensors. ``descriptors[i]``, where given and not None, makes the
    i-th tensor a host-made tensor descriptor (the kernel's parameter is a ``tl.tensor_descriptor``
    with that block); described tensors come first. State lives in the closure (not instance
    attributes) to keep the per-call path to a few local-variable reads.
    """
    grid = (*grid, 1, 1)[:3]
    tail = (*ints, *constexprs)
    described = [d for d in descriptors if d is not None]
    leading = len(described)
    if None in descriptors[:leading] or len(descriptors) > num_tensors:
        raise ValueError("launcher: described tensors must be the leading ones")

    def wrapped(args: tuple) -> tuple:
        """``args`` with the described tensors as Triton's host-side descriptors."""
        if not described:
            return args
        return (*(d.of(t) for d, t in zip(described, args)), *args[leading:])

    if INTERPRET:
        first_dtypes: list[tuple] = []

        def run_interpreted(*args: Any) -> None:
            # A compiled launcher keeps the kernel built for its first call's dtypes; the
            # interpreter would quietly follow new ones. Refuse here, so that a cache of launchers
            # keyed without dtypes fails on the CPU instead of writing garbage on a GPU.
            dtypes = tuple(getattr(t, "dtype", None) for t in args[:num_tensors])
            if not first_dtypes:
                first_dtypes.append(dtypes)
            elif dtypes != first_dtypes[0]:
                raise RuntimeError(
                    f"launcher of {getattr(fn, '__name__', fn)} built for tensor dtypes {first_dtypes[0]} "
                    f"called with {dtypes}: its cache key must include the dtypes"
                )
            # Masked-off lanes compute on filler values (-inf - -inf, 0 / 0) as they do on a GPU,
            # where nothing notices; numpy would warn for each.
            with np.errstate(all="ignore"):
                fn[grid](*wrapped(args), *tail)

        return run_interpreted

    gx, gy, gz = grid
    current_device, stream_of = torch._C._cuda_getDevice, torch._C._cuda_getCurrentRawStream
    compiled: dict[tuple, Any] = {}
    # The kernel compiled for 16-byte-aligned tensors on one device, launched through its C
    # launcher with nothing in between (Triton's CudaLauncher.__call__ only adds scratch buffers):
    # the device, the C function, the kernel handle, the arguments between them. Kernels that make
    # tensor descriptors on the device (attention, convolution) write them into a global scratch
    # buffer; Triton allocates one per launch (tens of microseconds of host time), these get one
    # per stream, kept.
    fast_device, fast_launch, fast_function, fast_head = -1, None, None, ()
    scratch_bytes = 0
    stream_heads: dict[int, tuple] = {}
    stream_scratch: dict[int, torch.Tensor] = {}  # the buffers whose addresses the heads hold
    # Triton's layout metadata of each descriptor (from the compiled kernel), and the C
    # launcher's arguments for the described tensors (each one's encoded descriptor, shape and
    # strides) by their addresses.
    encodings: list[Any] = []
    kept: dict[tuple[int, ...], tuple] = {}
    data_ptr = torch.Tensor.data_ptr

    def general(args: tuple) -> None:
        """Any alignment and device: compiled kernels keyed by both, run through Triton's runner."""
        nonlocal fast_device, fast_launch, fast_function, fast_head, scratch_bytes
        device = args[0].get_device()
        if device != current_device():
            with torch.cuda.device(device):
                return general(args)
        aligned = tuple(t.data_ptr() % 16 == 0 for t in args[:num_tensors])
        kernel = compiled.get((device, aligned))
        args = wrapped(args)
        if kernel is None:
            kernel = compiled[device, aligned] = fn[grid](
                *args, *tail, num_warps=num_warps, num_stages=num_stages
            )
            direct = _direct_launcher(kernel, gx * gy * gz, bool(described))
            if all(aligned) and fast_launch is None and direct is not None:
                # The encodings first: another thread may take the fast path once it is set.
                encodings[:] = kernel.metadata.tensordesc_meta or ()
                fast_device, (fast_launch, fast_function, fast_head, scratch_bytes) = device, direct
            return
        kernel.run(
            gx,
            gy,
            gz,
            stream_of(device),
            kernel.function,
            kernel.packed_metadata,
            None,
            None,
            None,
            *args,
            *tail,
        )

    def scratch_head(stream: int) -> tuple:
        head = stream_heads.get(stream)
        if head is None:
            scratch = torch.empty(scratch_bytes, dtype=torch.int8, device=fast_device)
            stream_scratch[stream] = scratch
            head = stream_heads[stream] = (*fast_head[:2], scratch.data_ptr(), *fast_head[3:])
        return head

    def encode(addresses: tuple[int, ...], args: tuple) -> tuple:
        """The C launcher's arguments for the described tensors at ``addresses``, kept."""
        if len(kept) >= _KEPT_DESCRIPTORS:
            kept.clear()
        flat: list = []
        for d, t, encoding in zip(described, args, encodings):
            flat += make_tensordesc_arg(d.of(t), encoding)
        arguments = kept[addresses] = tuple(flat)
        return arguments

    def run(*args: Any) -> None:
        if fast_launch is not None:
            # The C launcher gets the addresses, not the tensors: for a tensor it would call
            # data_ptr() again and ask the driver whether the address is a device pointer
            # (cuPointerGetAttribute), once per tensor per launch. Only the first tensor's device
            # is checked here: a tensor after it on the CPU or another GPU would fault instead of
            # raising, so callers must have checked their tensors' devices (core.checks) before
            # binding a launcher to them.
            ptrs = tuple(map(data_ptr, args[:num_tensors]))
            bits = 0
            for ptr in ptrs:
                bits |= ptr
            if not bits & 15 and args[0].get_device() == fast_device == current_device():
                stream = stream_of(fast_device)
                head = scratch_head(stream) if scratch_bytes else fast_head
                if leading:
                    addresses = ptrs[:leading]
                    lead = kept.get(addresses) or encode(addresses, args)
                    rest = (*ptrs[leading:], *args[num_tensors:])
                    fast_launch(gx, gy, gz, stream, fast_function, *head, *lead, *rest, *tail)
                    return
                fast_launch(gx, gy, gz, stream, fast_function, *head, *ptrs, *args[num_tensors:], *tail)
                return
        general(args)

    return run


def _c_launcher_format() -> str | None:
    try:
        from triton.backends.nvidia import driver
    except ImportError:
        return None
    return getattr(driver, "_BASE_ARGS_FORMAT", None)


try:  # encodes a host-side descriptor's arguments for the C launcher
    from triton.backends.nvidia.driver import make_tensordesc_arg
except ImportError:
    make_tensordesc_arg = None


# The argument layout of the C launcher this code was written against (Triton 3.6): grid x/y/z,
# stream, function, cooperative, PDL, two scratch buffers, metadata, launch metadata, two hooks.
_DIRECT = not INTERPRET and _c_launcher_format() == "iiiKKppOOOOOO"
# The fast path expands descriptors as Triton 3.6's wrapper of its C launcher does; another
# version launches described tensors through Triton's runner.
_DIRECT_DESCRIPTORS = _DIRECT and triton.__version__.startswith("3.6.") and make_tensordesc_arg is not None


def _direct_launcher(compiled: Any, programs: int, host_descriptors: bool) -> tuple | None:
    """(C launch function, kernel handle, the arguments between them and the kernel's own, bytes
    of global scratch the launch needs), or None where this Triton's runner does more than
    forward its arguments and a scratch buffer (profiling) or is another version than the one this
    was written against. With ``host_descriptors``, the C function under the runner's wrapper
    that encodes descriptors on every call (None where it is not found)."""
    runner = compiled.run
    scratch = getattr(runner, "global_scratch_size", None)
    if not _DIRECT or scratch is None or getattr(runner, "profile_scratch_size", 1):
        return None
    launch = runner.launch
    if host_descriptors:
        encodings = getattr(compiled.metadata, "tensordesc_meta", None)
        if not _DIRECT_DESCRIPTORS or not encodings or not all(isinstance(e, dict) for e in encodings):
            return None  # (an entry that is not a dict: a descriptor Triton did not lower to TMA)
        cells = [c.cell_contents for c in getattr(launch, "__closure__", None) or ()]
        c_functions = [c for c in cells if type(c).__name__ == "builtin_function_or_method"]
        if len(c_functions) != 1:
            return None
        launch = c_functions[0]
    head = (
        runner.launch_cooperative_grid,
        runner.launch_pdl,
        None,  # the global scratch buffer
        None,
        compiled.packed_metadata,
        None,
        None,
        None,
    )
    return launch, compiled.function, head, programs * runner.num_ctas * scratch
