"""The launch path: a launcher is built for one set of tensor dtypes."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from helpers import DEVICE
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


@pytest.mark.skipif(not INTERPRET, reason="the check runs under the interpreter (compiled calls skip it)")
def test_other_dtypes_are_refused():
    """A compiled launcher would reuse the kernel of its first dtypes; the interpreter refuses, so
    a cache of launchers keyed without dtypes fails in CI."""
    run = launcher(_copy_kernel, (1,), 2, (5,), (8,))
    x = torch.randn(5, device=DEVICE)
    run(x, torch.empty(5, device=DEVICE))
    with pytest.raises(RuntimeError, match="must include the dtypes"):
        run(x, torch.empty(5, device=DEVICE, dtype=torch.float16))
