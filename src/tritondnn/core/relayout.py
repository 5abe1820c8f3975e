"""Copies between layouts of (N, C, H, W) tensors: NCHW <-> NHWC (and dtype casts) as one kernel
whose loads and stores are both coalesced, for engines that stage an operand in another layout."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import triton
import triton.language as tl

from .launcher import cdiv, launcher


@triton.jit
def _relayout_kernel(
    src_ptr,
    dst_ptr,
    C,
    H,
    W,
    ss_n,
    ss_c,
    ss_h,
    ss_w,
    ds_n,
    ds_c,
    ds_h,
    ds_w,
    BLOCK_C: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """dst = src converted to dst's dtype, both (N, C, H, W) with any strides (ss_*, ds_*): the
    NCHW <-> NHWC copies. Program (S block, C block, n) in that order of its
    flat id, S = H * W; Triton gives the loads and the stores each their own coalesced layout
    (along whichever of c or s has stride 1) and transposes the tile in shared memory between."""
    pid = tl.program_id(0)
    ns = tl.cdiv(H * W, BLOCK_S)
    nc = tl.cdiv(C, BLOCK_C)
    s = (pid % ns) * BLOCK_S + tl.arange(0, BLOCK_S)
    c = ((pid // ns) % nc) * BLOCK_C + tl.arange(0, BLOCK_C)
    n = (pid // (ns * nc)).to(tl.int64)
    h = (s // W).to(tl.int64)[None, :]
    w = (s % W).to(tl.int64)[None, :]
    cl = c.to(tl.int64)[:, None]
    mask = (c < C)[:, None] & (s < H * W)[None, :]
    v = tl.load(src_ptr + n * ss_n + cl * ss_c + h * ss_h + w * ss_w, mask=mask)
    tl.store(dst_ptr + n * ds_n + cl * ds_c + h * ds_h + w * ds_w, v.to(dst_ptr.dtype.element_ty), mask=mask)


def relayout(n: int, c: int, h: int, w: int, src: Sequence[int], dst: Sequence[int]) -> Callable[..., None]:
    """A launch ``(src, dst)`` copying an (n, c, h, w) tensor at strides ``src`` into one at strides
    ``dst`` (any dtypes: the values are converted to dst's)."""
    bc = min(64, triton.next_power_of_2(c))
    bs = min(triton.next_power_of_2(h * w), 4096 // bc)
    programs = cdiv(h * w, bs) * cdiv(c, bc) * n
    return launcher(
        _relayout_kernel, (programs,), num_tensors=2, ints=(c, h, w, *src, *dst), constexprs=(bc, bs)
    )
