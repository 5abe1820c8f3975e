"""``core.numerics.convert``: a kernel's rounding to bf16 gives ``Tensor.to``'s bits, compiled and
under the interpreter (which itself rounds fp32 to bf16 toward zero)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from helpers import DEVICE
from tritondnn.core.numerics import convert


@triton.jit
def _to_bf16_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(y_ptr + i, convert(tl.load(x_ptr + i, mask=i < n), tl.bfloat16), mask=i < n)


def _special_fp32() -> torch.Tensor:
    """Halfway cases both ways, values just off them, the largest finite values (one rounds to
    inf), infinities, signed zeros, subnormals, NaNs with payloads only in the bits bf16 drops,
    and random values."""
    bits = [
        0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0xBF808000, 0xBF818000,  # ties, near ties
        0x7F7FFFFF, 0x7F7F7FFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000, 0x00000000, 0x80000000,
        0x00000001, 0x00008000, 0x00018000, 0x807FFFFF,  # subnormals
        0x7F800001, 0xFF800001, 0x7FC00000, 0x7F80FFFF,  # NaNs
    ]  # fmt: skip
    special = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
    return torch.cat([special, torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 1e3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_convert_to_bf16_rounds_as_torch(dtype):
    x = _special_fp32().to(dtype).to(DEVICE)
    y = torch.empty(x.shape, dtype=torch.bfloat16, device=DEVICE)
    _to_bf16_kernel[(1,)](x, y, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    # fp64 goes through fp32 (a double rounding where an fp64 value lies just off an fp32 tie);
    # these values are fp32's, so the rounding is torch's.
    want = x.to(torch.bfloat16)
    nan = want.isnan()
    assert torch.equal(y.isnan(), nan)
    assert torch.equal(y[~nan].view(torch.int16), want[~nan].view(torch.int16))
