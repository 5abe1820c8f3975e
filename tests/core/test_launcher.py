"""The launch path: a launcher is built for one set of tensor dtypes."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from helpers import DEVICE, ON_GPU
from tritondnn.core.backend import INTERPRET
from tritondnn.core.launcher import launcher


@triton.jit
def _copy_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(y_ptr + i, tl.load(x_ptr + i, mask=i < n).to(y_ptr.dtype.element_ty), mask=i < n)


def test_copies_with_its_dtypes():
    run = launcher(_copy_kernel, (1,), 2, (5,), (8,))
    x = torch.randn(5, device=DEVICE)
    y = torch.empty(5, device=DEVICE, dtype=torch.float16)
    run(x, y)
    assert torch.equal(y, x.half())


def test_each_call_reads_its_own_tensors():
    """After a launcher's first (compiling) call, calls on 16-byte-aligned tensors go straight to
    the C launcher with the tensors' addresses: each call must still read and write the tensors
    it is given (new addresses, a view 12 bytes off that takes Triton's runner, aligned again).
    The direct path exists on a GPU only; under the interpreter this checks the launcher's
    results alone."""
    run = launcher(_copy_kernel, (1,), 2, (5,), (8,))
    base = torch.randn(64, device=DEVICE)
    for offset in (0, 16, 3, 32, 0):
        x = base[offset : offset + 5]
        y = torch.zeros(5, device=DEVICE, dtype=torch.float16)
        run(x, y)
        assert torch.equal(y, x.half())


@pytest.mark.skipif(not INTERPRET, reason="the check runs under the interpreter (compiled calls skip it)")
def test_other_dtypes_are_refused():
    """A compiled launcher would reuse the kernel of its first dtypes; the interpreter refuses, so
    a cache of launchers keyed without dtypes fails in CI."""
    run = launcher(_copy_kernel, (1,), 2, (5,), (8,))
    x = torch.randn(5, device=DEVICE)
    run(x, torch.empty(5, device=DEVICE))
    with pytest.raises(RuntimeError, match="must include the dtypes"):
        run(x, torch.empty(5, device=DEVICE, dtype=torch.float16))


@triton.jit
def _scale_rows_kernel(x_desc, y_ptr, scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """y = scale * x over one block of rows a program, x read through a host-made descriptor."""
    row = tl.program_id(0) * BLOCK_M
    x = x_desc.load([row, 0])
    offsets = (row + tl.arange(0, BLOCK_M))[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    tl.store(y_ptr + offsets, x * scale)


def test_host_descriptor_arguments(monkeypatch):
    """A described tensor reaches the kernel as a descriptor: a tensor met before with new values
    in it, another address, then both again each give what they hold, scaled. On a GPU each
    address is encoded once, on its first direct launch (the first call compiles through
    Triton's runner), and the kept arguments serve the calls after."""
    from tritondnn.core import launcher as L

    encodes = []
    if L.make_tensordesc_arg is not None:
        real = L.make_tensordesc_arg
        monkeypatch.setattr(L, "make_tensordesc_arg", lambda *args: encodes.append(1) or real(*args))
    rows, cols, block = 64, 16, 16
    run = L.launcher(
        _scale_rows_kernel, (rows // block,), 2, (), (block, cols),
        descriptors=[L.Described((rows, cols), (cols, 1), (block, cols))],
    )  # fmt: skip
    first = torch.randn(rows, cols, device=DEVICE)
    second = torch.randn(rows + 8, cols, device=DEVICE)[8:]  # another (aligned) address
    for x in (first, first, first, second, first, second):
        x.copy_(torch.randn(rows, cols, device=DEVICE))
        y = torch.empty(rows, cols, device=DEVICE)
        run(x, y, 0.5)
        assert torch.equal(y, x * 0.5)
    if ON_GPU and L._DIRECT_DESCRIPTORS:
        assert len(encodes) == 2


def test_described_tensors_come_first():
    from tritondnn.core.launcher import Described

    with pytest.raises(ValueError, match="leading"):
        launcher(
            _scale_rows_kernel,
            (1,),
            2,
            (),
            (16, 16),
            descriptors=[None, Described((16, 16), (16, 1), (16, 16))],
        )
