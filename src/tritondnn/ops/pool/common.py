"""What the pooling and resampling modules share: argument checks in PyTorch's rules, output
sizes, window geometry, and how an (N, C, *spatial) tensor is addressed as 3-D.

Every kernel of the family sees 1-D, 2-D and 3-D problems as 3-D ones over (D, H, W): missing
spatial dimensions have size 1 (and stride 0). Outputs take the input's memory format as PyTorch
chooses it (``suggest_memory_format``: channels_last or channels_last_3d for inputs with those
strides, contiguous otherwise), so channels_last in gives channels_last out without a conversion.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np
import torch
import triton
import triton.language as tl
from torch._prims_common import suggest_memory_format

from ...core.checks import check_tensor

# The index tensors a max pool can store: none, PyTorch's flat int64 positions within each (n, c)
# plane (returned to the user), or the tap's int8 offset within its window (saved for backward
# only: one byte per output instead of eight, when a window has at most 127 taps).
INDEX_NONE, INDEX_FLAT, INDEX_LOCAL = 0, 1, 2
INDEX_DTYPE = {INDEX_FLAT: torch.int64, INDEX_LOCAL: torch.int8}
MAX_LOCAL_TAPS = 127


def output_format(x: torch.Tensor) -> torch.memory_format:
    """The memory format PyTorch gives a pooling or resampling output (and the input gradient)."""
    return suggest_memory_format(x)


def empty_output(x: torch.Tensor, shape: Sequence[int], dtype: torch.dtype | None = None) -> torch.Tensor:
    """An uninitialized tensor of ``shape`` in ``x``'s output memory format."""
    return torch.empty(tuple(shape), dtype=dtype or x.dtype, device=x.device, memory_format=output_format(x))


def channels_last_format(x: torch.Tensor) -> bool:
    """Whether ``x``'s outputs (and its gradient) are channels_last (or channels_last_3d)."""
    return output_format(x) != torch.contiguous_format


def grad_input(dy: torch.Tensor, input_size: Sequence[int], channels_last: bool) -> torch.Tensor:
    """An uninitialized input gradient: contiguous, or channels_last(_3d) as the input's format was."""
    formats = {4: torch.channels_last, 5: torch.channels_last_3d}
    fmt = formats[len(input_size)] if channels_last else torch.contiguous_format
    return torch.empty(tuple(input_size), dtype=dy.dtype, device=dy.device, memory_format=fmt)


def sizes3(t: torch.Tensor) -> tuple[int, int, int]:
    """The spatial sizes of an (N, C, *spatial) tensor as (D, H, W), 1 for missing dimensions."""
    return (1,) * (5 - t.ndim) + tuple(t.shape[2:])  # type: ignore[return-value]


def strides5(t: torch.Tensor) -> tuple[int, ...]:
    """(n, c, d, h, w) strides of an (N, C, *spatial) tensor; 0 for missing spatial dimensions."""
    s = t.stride()
    return (s[0], s[1], *((0,) * (5 - t.ndim)), *s[2:])


def pad3(values: Sequence[int], fill: int) -> tuple[int, int, int]:
    """Per-dimension parameters of a 1-D/2-D/3-D problem as (D, H, W) ones."""
    return (fill,) * (3 - len(values)) + tuple(values)  # type: ignore[return-value]


def needs_int64(*tensors: torch.Tensor) -> bool:
    """Whether some element offset of these tensors reaches 2**31 (kernels then index in int64)."""
    return any(sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride())) >= 2**31 - 1 for t in tensors)


def int_tuple(op: str, name: str, value: object, dims: int) -> tuple[int, ...]:
    """An int, or a sequence of 1 or ``dims`` ints, as a ``dims``-tuple (PyTorch's _single/_pair/_triple)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,) * dims
    if isinstance(value, (tuple, list, torch.Size)) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        if len(value) == 1:
            return (value[0],) * dims
        if len(value) == dims:
            return tuple(value)
        raise ValueError(
            f"{op}: argument '{name}'={tuple(value)} must be a single int or a tuple of {dims} ints"
        )
    raise TypeError(f"{op}: argument '{name}' must be an int or a tuple of ints, got {value!r}")


def check_input(op: str, input: object, dims: int) -> tuple[torch.Tensor, bool]:
    """``input`` as an (N, C, *spatial) tensor with ``dims`` non-empty spatial dimensions, and
    whether it came without the batch dimension (PyTorch accepts (C, *spatial) too)."""
    x = check_tensor(op, "input", input, min_ndim=dims + 1, max_ndim=dims + 2)
    unbatched = x.ndim == dims + 1
    if unbatched:
        x = x.unsqueeze(0)
    if any(s == 0 for s in x.shape[1:]):
        raise ValueError(f"{op}: argument 'input' has an empty non-batch dimension: {tuple(x.shape[1:])}")
    return x, unbatched


def pool_output_size(
    size: int, kernel: int, padding: int, stride: int, dilation: int, ceil_mode: bool
) -> int:
    """PyTorch's ``pooling_output_shape``: floor (or ceil) of the window count, where a window
    must start inside the input or its left padding."""
    span = size + 2 * padding - dilation * (kernel - 1) - 1 + (stride - 1 if ceil_mode else 0)
    out = span // stride + 1
    if ceil_mode and (out - 1) * stride >= size + padding:
        out -= 1
    return out


def check_pool_args(
    op: str,
    x: torch.Tensor,
    dims: int,
    kernel_size: object,
    stride: object,
    padding: object,
    dilation: object,
    ceil_mode: object,
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(kernel, stride, padding, dilation, output size) of a pooling call, validated as PyTorch does."""
    kernel = int_tuple(op, "kernel_size", kernel_size, dims)
    if stride is None or (isinstance(stride, (list, tuple)) and not stride):  # PyTorch's default
        stride_ = kernel
    else:
        stride_ = int_tuple(op, "stride", stride, dims)
    pad = int_tuple(op, "padding", padding, dims)
    dil = int_tuple(op, "dilation", dilation, dims)
    if not isinstance(ceil_mode, bool):
        raise TypeError(f"{op}: argument 'ceil_mode' must be a bool, got {ceil_mode!r}")
    for name, values in (("kernel_size", kernel), ("stride", stride_), ("dilation", dil)):
        if min(values) < 1:
            raise ValueError(f"{op}: argument '{name}'={values} must be positive")
    if min(pad) < 0:
        raise ValueError(f"{op}: argument 'padding'={pad} must be non-negative")
    if any(p > k // 2 for p, k in zip(pad, kernel)):
        raise ValueError(f"{op}: argument 'padding'={pad} must be at most half of kernel_size={kernel}")
    spatial = tuple(x.shape[2:])
    out = tuple(pool_output_size(*args, ceil_mode) for args in zip(spatial, kernel, pad, stride_, dil))
    if min(out) < 1:
        raise ValueError(
            f"{op}: the output size {out} is too small: input {spatial} with kernel_size={kernel}, "
            f"stride={stride_}, padding={pad}, dilation={dil}"
        )
    return kernel, stride_, pad, dil, out


def check_output_size(op: str, output_size: object, x: torch.Tensor, dims: int) -> tuple[int, ...]:
    """An adaptive pool's ``output_size``: an int or ``dims`` entries, None keeping the input's size."""
    if output_size is None or isinstance(output_size, (int, bool)):
        values = [output_size] * dims
    elif isinstance(output_size, (tuple, list, torch.Size)) and len(output_size) in (1, dims):
        values = list(output_size) * (dims if len(output_size) == 1 else 1)
    else:
        raise ValueError(
            f"{op}: argument 'output_size'={output_size!r} must be an int or a tuple of {dims} ints"
        )
    out = []
    for value, size in zip(values, x.shape[2:]):
        if value is None:
            value = size
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{op}: argument 'output_size' must hold ints or None, got {output_size!r}")
        if value < 1:
            raise ValueError(f"{op}: argument 'output_size'={output_size!r} must be positive")
        out.append(value)
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# The [rows x columns] plane tiling (``kernels.plane_tile``) shared by pooling and resampling.

# Planes of fewer positions leave most of a [rows x columns] tile idle.
PLANE_POSITIONS = 64


def plane_cost(channels_last: bool, plane: Sequence[int]) -> float:
    """An engine cost for plane tiles over a (D, H, W) plane: channels_last rows are strided by C
    (a sector per lane), small planes leave lanes idle; otherwise below the tile engines' 1.0."""
    if channels_last:
        return 4.0
    return 0.8 if plane[1] * plane[2] >= PLANE_POSITIONS else 1.5


def plane_configs(plane: Sequence[int], tiles: Sequence[int], names: tuple[str, str]) -> list[dict]:
    """Launch configs of plane tiles: per tile size (elements, in order of preference) rows x
    columns with up to 128 columns, 4 then 8 warps; ``names`` are the kernel's block parameters."""
    block_w = min(triton.next_power_of_2(plane[2]), 128)
    out: list[dict] = []
    for tile in tiles:
        block_h = max(1, min(triton.next_power_of_2(plane[1]), tile // block_w))
        for warps in (4, 8):
            config = {names[0]: block_h, names[1]: block_w, "num_warps": warps}
            if config not in out:
                out.append(config)
    return out


# ---------------------------------------------------------------------------------------------
# Window geometry along one dimension. Regular windows: tap k of output o reads input
# o * stride - padding + k * dilation. Adaptive windows (PyTorch's): output o reads inputs
# floor(o * I / O) .. ceil((o + 1) * I / O) - 1.


@functools.lru_cache(maxsize=1024)
def adaptive_taps(size: int, out: int) -> int:
    """The longest adaptive window along a dimension of ``size`` inputs and ``out`` outputs."""
    return max(-(-((o + 1) * size) // out) - (o * size) // out for o in range(out))


@functools.lru_cache(maxsize=1024)
def adaptive_candidates(size: int, out: int) -> int:
    """The most adaptive windows one input lies in: outputs floor(i * O / I) .. ceil((i + 1) * O / I) - 1."""
    return max(-(-((i + 1) * out) // size) - (i * out) // size for i in range(size))


def regular_candidates(kernel: int, stride: int, dilation: int) -> int:
    """The most windows one input lies in: every stride-th output over the dilated window's extent."""
    return -(-((kernel - 1) * dilation + 1) // stride)


def taps_and_candidates(
    adaptive: bool,
    in_size: Sequence[int],
    out_size: Sequence[int],
    kernel: Sequence[int],
    stride: Sequence[int],
    dilation: Sequence[int],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per (D, H, W) dimension: taps of the largest window, and windows containing an input."""
    if adaptive:
        return (
            tuple(adaptive_taps(i, o) for i, o in zip(in_size, out_size)),
            tuple(adaptive_candidates(i, o) for i, o in zip(in_size, out_size)),
        )
    return tuple(kernel), tuple(regular_candidates(*a) for a in zip(kernel, stride, dilation))


def index_kind(return_indices: bool, needs_grad: bool, taps: Sequence[int]) -> int:
    """Which indices a max pool stores: flat int64 when returned, int8 window offsets when only
    the backward needs them and a window is small enough, none otherwise."""
    if return_indices:
        return INDEX_FLAT
    if not needs_grad:
        return INDEX_NONE
    return INDEX_LOCAL if math.prod(taps) <= MAX_LOCAL_TAPS else INDEX_FLAT


# ---------------------------------------------------------------------------------------------
# Float scalars. Triton passes Python floats to kernels as fp32, so an fp64 problem passes each
# as an (hi, lo) pair of fp32 values and its kernel adds them back in fp64 (48 significant bits,
# well inside fp64's accuracy bar); fp32 problems use hi, which is the value PyTorch's fp32
# arithmetic would use too.


def split_f32(value: float) -> tuple[float, float]:
    """(hi, lo): hi the fp32 value nearest ``value``, lo the fp32 value nearest the remainder."""
    with np.errstate(over="ignore"):
        hi = float(np.float32(value))
        return hi, (float(np.float32(value - hi)) if np.isfinite(hi) else 0.0)


@triton.jit
def wide(hi, lo, acc: tl.constexpr):
    """The scalar split by ``split_f32``, in the accumulation dtype ``acc``."""
    if acc == tl.float64:
        return tl.cast(hi, tl.float64) + tl.cast(lo, tl.float64)
    else:
        return tl.cast(hi, tl.float32)
