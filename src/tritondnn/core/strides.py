"""Memory layout analysis: how many dimensions a kernel really has to walk, and how to walk them.

An elementwise or row-wise kernel does not care how a tensor was made, only which dimensions
it must step through separately. ``collapse`` merges every pair of adjacent dimensions that
all tensors of one launch step through as one (as PyTorch's TensorIterator does), so a
contiguous, channels_last or permuted-but-dense tensor becomes one dimension of stride 1, and a
sliced or expanded tensor becomes a few. Kernels take up to ``MAX_DIMS`` such dimensions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl  # noqa: F401  (the interpreter needs it in a kernel's globals)

MAX_DIMS = 4


def broadcast_shapes(*shapes: Sequence[int]) -> tuple[int, ...]:
    """``torch.broadcast_shapes`` for sizes that are plain ints, raising the same ``RuntimeError``.
    PyTorch's goes through its reference implementation and symbolic-shape checks: 20-50 us a
    call, several times in each eager matmul. Tracing and symbolic sizes take PyTorch's."""
    if torch.compiler.is_compiling():
        return tuple(torch.broadcast_shapes(*shapes))
    out = [1] * max([len(s) for s in shapes] + [0])
    for arg, shape in enumerate(shapes):
        offset = len(out) - len(shape)
        for i, size in enumerate(shape):
            if type(size) is not int:
                return tuple(torch.broadcast_shapes(*shapes))
            seen = out[offset + i]
            if size != seen and size != 1:
                if seen != 1:
                    raise RuntimeError(
                        f"shape mismatch: objects cannot be broadcast to a single shape (argument {arg}, "
                        f"{tuple(shape)}, against {tuple(out)})"
                    )
                out[offset + i] = size
    return tuple(out)


def collapse(shape: Sequence[int], *strides: Sequence[int]) -> tuple[list[int], list[list[int]]]:
    """Merge the dimensions of ``shape`` that every stride list walks as one.

    Dimensions are ordered by the first tensor's strides, largest first, so a flat index over the
    result walks the first tensor's memory in order (give the output first: its stores coalesce).
    Size-1 dimensions are dropped; a tensor with no dimension left gets one of size 1.

    Returns ``(sizes, [strides_of_tensor_0, strides_of_tensor_1, ...])``, outermost first.
    """
    dims = [d for d in range(len(shape)) if shape[d] != 1]
    # Stable sort: ties (possible only for stride-0 dims of the first tensor) keep their order.
    dims.sort(key=lambda d: -abs(strides[0][d]))
    sizes: list[int] = []
    out: list[list[int]] = [[] for _ in strides]
    for d in dims:
        if sizes and all(s[-1] == st[d] * shape[d] for s, st in zip(out, strides)):
            sizes[-1] *= shape[d]
            for s, st in zip(out, strides):
                s[-1] = st[d]
            continue
        sizes.append(shape[d])
        for s, st in zip(out, strides):
            s.append(st[d])
    if not sizes:
        return [1], [[1] for _ in strides]
    return sizes, out


def pad_dims(
    sizes: list[int], strides: list[list[int]], ndim: int = MAX_DIMS
) -> tuple[list[int], list[list[int]]]:
    """Prepend size-1 dimensions so a kernel with a fixed number of dimensions can take the layout."""
    extra = ndim - len(sizes)
    return [1] * extra + sizes, [[0] * extra + s for s in strides]


@triton.jit
def unravel4(idx, size1, size2, size3):
    """Split flat indices over a (size0, size1, size2, size3) row-major box into four coordinates."""
    i3 = idx % size3
    rest = idx // size3
    i2 = rest % size2
    rest = rest // size2
    i1 = rest % size1
    i0 = rest // size1
    return i0, i1, i2, i3


@triton.jit
def offset4(i0, i1, i2, i3, s0, s1, s2, s3):
    """Memory offset of the coordinates from ``unravel4`` in a tensor with strides s0..s3."""
    return i0 * s0 + i1 * s1 + i2 * s2 + i3 * s3


def empty_aligned_rows(like: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """An uninitialized rows x cols matrix of ``like``'s dtype and device, row-major, its rows
    starting on 16-byte boundaries (the row stride rounded up; the padding is never read): the
    layout tensor descriptors (TMA) read without a copy."""
    align = max(1, 16 // like.element_size())
    return like.new_empty(rows, -(-cols // align) * align)[:, :cols]
