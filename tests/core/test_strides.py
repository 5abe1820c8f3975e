"""core.strides: merged layouts walk exactly the same memory as the original; broadcast_shapes."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tritondnn.core.strides import broadcast_shapes, collapse, pad_dims


def _offsets(shape, *strides):
    """The (offset in tensor 0, offset in tensor 1, ...) of every element, as a sorted list."""
    out = []
    for idx in itertools.product(*(range(n) for n in shape)):
        out.append(tuple(sum(i * s for i, s in zip(idx, st)) for st in strides))
    return sorted(out)


def test_dense_layouts_merge_into_one_dimension():
    for t in (
        torch.empty(3, 4, 5),
        torch.empty(2, 3, 4, 5).to(memory_format=torch.channels_last),
        torch.empty(4, 5).t(),
        torch.empty(2, 3, 4).permute(2, 0, 1),
    ):
        assert collapse(t.shape, t.stride()) == ([t.numel()], [[1]])


def test_size_one_and_scalar():
    assert collapse([1, 1], [5, 1]) == ([1], [[1]])
    assert collapse([], []) == ([1], [[1]])
    assert collapse([3, 1, 4], [4, 99, 1]) == ([12], [[1]])


def test_sliced_and_expanded():
    assert collapse([4, 5], [10, 2]) == ([20], [[2]])  # every second element: one dim of stride 2
    assert collapse([4, 5], [10, 1]) == ([4, 5], [[10, 1]])  # rows of a wider matrix
    assert collapse([4, 5], [5, 1], [0, 1]) == ([4, 5], [[5, 1], [0, 1]])  # broadcast rows


@given(
    shape=st.lists(st.integers(1, 4), min_size=1, max_size=4),
    data=st.data(),
)
def test_collapse_preserves_every_offset(shape, data):
    ndim = len(shape)
    order = data.draw(st.permutations(range(ndim)), label="order")
    steps = data.draw(st.lists(st.integers(1, 3), min_size=ndim, max_size=ndim), label="steps")
    # The first tensor is dense in some dimension order; the second sliced, or broadcast.
    dense = torch.empty([shape[d] for d in order]).permute(*[order.index(d) for d in range(ndim)])
    big = torch.empty([n * s for n, s in zip(shape, steps)])
    sliced = big[tuple(slice(None, None, s) for s in steps)]
    broadcast = [0 if data.draw(st.booleans()) else s for s in sliced.stride()]
    sizes, strides = collapse(shape, dense.stride(), sliced.stride(), broadcast)
    assert _offsets(sizes, *strides) == _offsets(shape, dense.stride(), sliced.stride(), broadcast)
    assert strides[0][-1] == 1  # the first tensor's innermost dimension is its contiguous one
    padded_sizes, padded = pad_dims(sizes, strides, 6)
    assert _offsets(padded_sizes, *padded) == _offsets(sizes, *strides)


def test_broadcast_shapes_matches_torch():
    cases = [
        ((), ()),
        ((3,), ()),
        ((4, 1, 5), (3, 1)),
        ((1,), (2, 3), (4, 1, 1)),
        ((0, 1), (1, 7)),
        ((2, 3), (2, 3)),
        ((5,),),
    ]
    for shapes in cases:
        got = broadcast_shapes(*(torch.Size(s) for s in shapes))
        assert got == tuple(torch.broadcast_shapes(*shapes)) and type(got) is tuple, shapes
    for shapes in (((2, 3), (3, 2)), ((4,), (1, 5)), ((0,), (2,))):
        with pytest.raises(RuntimeError):
            torch.broadcast_shapes(*shapes)
        with pytest.raises(RuntimeError, match="cannot be broadcast"):
            broadcast_shapes(*shapes)
