"""Group normalization and instance normalization (groups of one channel), forward and backward,
in NCHW and channels_last layouts, with a fused activation (GroupNorm + SiLU in diffusion UNets).

An input (N, C, *spatial) is read as N x G groups of ``cpg = C / G`` channels by ``S`` spatial
positions: element (n, channel, s) sits at ``n * stride_n + channel * stride_c + s * stride_s``,
which covers contiguous tensors (stride_s = 1) and channels_last ones (stride_c = 1) without a
copy. A program normalizes BLOCK_G neighbouring groups of one sample as a 3-D tile (groups,
channels of a group, positions): one group a program for NCHW, many for channels_last, where
neighbouring channels are neighbours in memory. Statistics are fp32 and saved per (n, group);
weight and bias gradients are reduced per (n, channel) in the kernel, then over n.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ...core.autocast import FP32, autocast_policy
from ...core.checks import check_float, check_tensor
from ...core.engine import Engine, Family, LaunchConfig, Problem
from ...core.launcher import cdiv, launcher
from ...core.library import custom_op
from ...core.numerics import convert
from ..activation import activation_gradient, activation_reference, activation_value
from .common import (
    NO_ACTIVATION,
    activation_kind,
    check_affine,
    check_eps,
    dense_ncs,
    dtype_name,
    in_layout,
    ncs_layout,
    param_grads,
    sum_partials,
)

# ---------------------------------------------------------------------------------------------
# 1. Reference.


def group_norm_reference(
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    activation: str | None = None,
) -> torch.Tensor:
    """Group norm (then the activation) in float64."""
    y = F.group_norm(x.double(), num_groups, None if weight is None else weight.double(), None, eps)
    if bias is not None:
        y = y + bias.double().view(1, -1, *([1] * (x.ndim - 2)))
    if activation is not None:
        kind, p0, p1 = activation_kind(activation)
        y = activation_reference(y, kind, p0, p1)
    return y


# ---------------------------------------------------------------------------------------------
# 2. Kernels. Programs are (sample n, block of BLOCK_G groups); tiles are [BLOCK_G, BLOCK_C,
# BLOCK_S] = (groups, channels of a group, spatial positions). Unused tensors are passed as x.


@triton.jit
def _tile(pid, n_groups, cpg, stride_n, stride_c, stride_s, INDEX_64: tl.constexpr,
          BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr):  # fmt: skip
    """Program ``pid``'s tile at position 0: offsets [G, C, S]; positions [1, 1, S]; channel index
    and mask [G, C, 1]; n * n_groups + group and the group mask [G, 1, 1]; the sample n. The tile
    at position s0 is ``offsets + s0 * stride_s`` masked by ``ch_mask & (s0 + pos < spatial)``."""
    g_blocks = tl.cdiv(n_groups, BLOCK_G)
    n = pid // g_blocks
    if INDEX_64:
        n = n.to(tl.int64)
    g = (pid % g_blocks) * BLOCK_G + tl.arange(0, BLOCK_G)[:, None, None]
    c = tl.arange(0, BLOCK_C)[None, :, None]
    pos = tl.arange(0, BLOCK_S)[None, None, :]
    channel = g * cpg + c
    g_mask = g < n_groups
    ch_mask = g_mask & (c < cpg)
    offsets = n * stride_n + channel * stride_c + pos * stride_s
    return offsets, pos, channel, ch_mask, n * n_groups + g, g_mask, n


@triton.jit
def _sum_gc(x):
    """Sum a [G, C, S] tile over channels and positions: one value per group, shaped [G, 1, 1]."""
    return tl.sum(tl.sum(x, 2), 1)[:, None, None]


@triton.jit
def _add_pairs(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def _sum_gc_with_squares(x):
    """(_sum_gc(x), _sum_gc(x * x)) as one reduction: one exchange between warps, not two."""
    s, q = tl.reduce((x, x * x), 2, _add_pairs)
    s, q = tl.reduce((s, q), 1, _add_pairs)
    return s[:, None, None], q[:, None, None]


@triton.jit
def _forward_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr,
    eps, act_p0, act_p1,
    n_groups, cpg, spatial, stride_n, stride_c, stride_s,
    ACC: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACT: tl.constexpr,
    ONE_BLOCK: tl.constexpr, INDEX_64: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """y = act(group_norm(x) * w + b); mean and 1/std saved per (n, group) in ACC precision.

    ONE_BLOCK: all ``spatial`` positions fit in BLOCK_S (one read); the sums of x - shift and of
    its squares come from one reduction (the variance E[xs^2] - E[xs]^2 loses nothing: E[xs] is
    only the shift's rounding). Otherwise a first loop merges per-block means and squared
    deviations (Chan et al.) and a second loop writes.

    Statistics are of x - shift, shift the first block's mean rounded to ACC: for a mean far
    from 0 (1e4 with unit variance), x - shift is exact and the mean subtracted is small, where
    subtracting the mean rounded to fp32 would shift every output by up to half its ulp (5e-4).
    """
    offs, pos, channel, ch_mask, row, g_mask, _n = _tile(
        tl.program_id(0), n_groups, cpg, stride_n, stride_c, stride_s, INDEX_64, BLOCK_G, BLOCK_C, BLOCK_S
    )
    count = cpg * spatial
    mask = ch_mask & (pos < spatial)
    x = convert(tl.load(x_ptr + offs, mask=mask, other=0.0), ACC)
    shift = _sum_gc(x) / (cpg * tl.minimum(spatial, BLOCK_S)).to(ACC)
    if ONE_BLOCK:
        xs = tl.where(mask, x - shift, 0.0)
        total, squares = _sum_gc_with_squares(xs)
        mean = total / count  # of x - shift
        rstd = 1.0 / tl.sqrt(tl.maximum(squares / count - mean * mean, 0.0) + eps)
        xc = xs - mean
    else:
        seen = tl.zeros([BLOCK_G, 1, 1], ACC)
        mean = tl.zeros([BLOCK_G, 1, 1], ACC)
        m2 = tl.zeros([BLOCK_G, 1, 1], ACC)
        for s0 in range(0, spatial, BLOCK_S):
            mask = ch_mask & (s0 + pos < spatial)
            x = tl.where(
                mask, convert(tl.load(x_ptr + offs + s0 * stride_s, mask=mask, other=0.0), ACC) - shift, 0.0
            )
            n_block = (cpg * tl.minimum(spatial - s0, BLOCK_S)).to(ACC)
            block_mean = _sum_gc(x) / n_block
            d = tl.where(mask, x - block_mean, 0.0)
            total = seen + n_block
            delta = block_mean - mean
            mean += delta * (n_block / total)
            m2 += _sum_gc(d * d) + delta * delta * (seen * n_block / total)
            seen = total
        rstd = 1.0 / tl.sqrt(m2 / count + eps)
    if HAS_W:  # [G, C, 1] loads, broadcast over positions
        w = convert(tl.load(w_ptr + channel, mask=ch_mask, other=0.0), ACC)
    if HAS_B:
        b = convert(tl.load(b_ptr + channel, mask=ch_mask, other=0.0), ACC)
    # The output pass walks the blocks backwards: the statistics pass read the last ones most
    # recently, so they are still in L2.
    n_blocks = tl.cdiv(spatial, BLOCK_S)
    for i in range(0, n_blocks):
        s0 = (n_blocks - 1 - i) * BLOCK_S
        mask = ch_mask & (s0 + pos < spatial)
        if ONE_BLOCK:
            y = xc * rstd
        else:
            x = convert(tl.load(x_ptr + offs + s0 * stride_s, mask=mask, other=0.0), ACC)
            y = ((x - shift) - mean) * rstd
        if HAS_W:
            y = y * w
        if HAS_B:
            y = y + b
        if ACT >= 0:
            y = activation_value(y, ACT, act_p0, act_p1)
        tl.store(y_ptr + offs + s0 * stride_s, convert(y, y_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + row, shift + mean, mask=g_mask)
    tl.store(rstd_ptr + row, rstd, mask=g_mask)


@triton.jit
def grad_tile(
    dy_ptr, x_ptr, offs, mask, w, b, mean, rstd, act_p0, act_p1,
    ACC: tl.constexpr, HAS_B: tl.constexpr, ACT: tl.constexpr, POLICY: tl.constexpr,
):  # fmt: skip
    """(dy through the activation, x-hat, w * dy) of one tile; ``w`` is 1 without a weight.
    POLICY: the loads' L2 eviction policy."""
    x = convert(tl.load(x_ptr + offs, mask=mask, other=0.0, eviction_policy=POLICY), ACC)
    dy = convert(tl.load(dy_ptr + offs, mask=mask, other=0.0, eviction_policy=POLICY), ACC)
    xhat = tl.where(mask, (x - mean) * rstd, 0.0)
    if ACT >= 0:
        z = xhat * w
        if HAS_B:
            z = z + b
        dy = activation_gradient(dy, z, ACT, False, act_p0, act_p1)
    return dy, xhat, dy * w


@triton.jit
def _backward_kernel(
    dy_ptr, x_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_ptr, db_ptr,
    act_p0, act_p1,
    n_channels, n_groups, cpg, spatial, stride_n, stride_c, stride_s,
    ACC: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACT: tl.constexpr,
    NEED_DW: tl.constexpr, NEED_DB: tl.constexpr, ONE_BLOCK: tl.constexpr, INDEX_64: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """dx for BLOCK_G groups of one sample, and that sample's per-channel sums of dy * x-hat and
    dy into the (N, C) buffers ``dw_ptr``/``db_ptr`` (reduced over N afterwards)."""
    offs, pos, channel, ch_mask, row, g_mask, n = _tile(
        tl.program_id(0), n_groups, cpg, stride_n, stride_c, stride_s, INDEX_64, BLOCK_G, BLOCK_C, BLOCK_S
    )
    count = cpg * spatial
    mean = tl.load(mean_ptr + row, mask=g_mask, other=0.0)
    rstd = tl.load(rstd_ptr + row, mask=g_mask, other=0.0)
    w = tl.full([1, 1, 1], 1.0, ACC)
    b = tl.zeros([1, 1, 1], ACC)
    if HAS_W:
        w = convert(tl.load(w_ptr + channel, mask=ch_mask, other=0.0), ACC)
    if HAS_B:
        b = convert(tl.load(b_ptr + channel, mask=ch_mask, other=0.0), ACC)
    if ONE_BLOCK:
        mask = ch_mask & (pos < spatial)
        dy, xhat, wdy = grad_tile(
            dy_ptr, x_ptr, offs, mask, w, b, mean, rstd, act_p0, act_p1, ACC, HAS_B, ACT, ""
        )
        c1 = _sum_gc(xhat * wdy) / count
        c2 = _sum_gc(wdy) / count
        dx = (wdy - xhat * c1 - c2) * rstd
        tl.store(dx_ptr + offs, convert(dx, dx_ptr.dtype.element_ty), mask=mask)
        dw_c = tl.sum(dy * xhat, 2)[:, :, None]
        db_c = tl.sum(dy, 2)[:, :, None]
    else:
        # Elementwise sums in the loop, reduced once after it (a reduction a block made the warps
        # wait on each other every block: 183 -> 151 us on GN 64x256x56x56 bf16). The group sums
        # follow from the channel sums: sum(x-hat * w * dy) = sum over channels of w * dw_c.
        dw_e = tl.zeros([BLOCK_G, BLOCK_C, BLOCK_S], ACC)
        db_e = tl.zeros([BLOCK_G, BLOCK_C, BLOCK_S], ACC)
        for s0 in range(0, spatial, BLOCK_S):
            mask = ch_mask & (s0 + pos < spatial)
            at = offs + s0 * stride_s
            dy, xhat, _wdy = grad_tile(
                dy_ptr, x_ptr, at, mask, w, b, mean, rstd, act_p0, act_p1, ACC, HAS_B, ACT, ""
            )
            dw_e += dy * xhat
            db_e += dy
        dw_c = tl.sum(dw_e, 2)[:, :, None]
        db_c = tl.sum(db_e, 2)[:, :, None]
        c1 = tl.sum(w * dw_c, 1)[:, :, None] / count
        c2 = tl.sum(w * db_c, 1)[:, :, None] / count
        n_blocks = tl.cdiv(spatial, BLOCK_S)
        for i in range(0, n_blocks):  # backwards, as the forward's output pass (L2 hits)
            s0 = (n_blocks - 1 - i) * BLOCK_S
            mask = ch_mask & (s0 + pos < spatial)
            at = offs + s0 * stride_s
            dy, xhat, wdy = grad_tile(
                dy_ptr, x_ptr, at, mask, w, b, mean, rstd, act_p0, act_p1, ACC, HAS_B, ACT, ""
            )
            dx = (wdy - xhat * c1 - c2) * rstd
            tl.store(dx_ptr + at, convert(dx, dx_ptr.dtype.element_ty), mask=mask)
    if NEED_DW:
        tl.store(dw_ptr + n * n_channels + channel, dw_c, mask=ch_mask)
    if NEED_DB:
        tl.store(db_ptr + n * n_channels + channel, db_c, mask=ch_mask)


# ---------------------------------------------------------------------------------------------
# 3. Engines.


@dataclasses.dataclass(frozen=True)
class GroupNormProblem(Problem):
    """One launch over an (N, C, S) view with strides (n, c, s) shared by every tensor of it."""

    backward: bool
    has_w: bool
    has_b: bool
    act: int
    need_dw: bool
    need_db: bool
    dtypes: tuple[str, ...]
    n: int
    channels: int
    groups: int
    spatial: int
    strides: tuple[int, int, int]

    @property
    def cpg(self) -> int:
        return self.channels // self.groups

    @property
    def acc(self) -> tl.dtype:
        return tl.float64 if self.dtypes[0] == "float64" else tl.float32

    @property
    def channels_last(self) -> bool:
        return self.strides[1] == 1 and self.channels > 1


def _describe(input: torch.Tensor, num_groups: int, backward: bool = False) -> GroupNormProblem:
    """The problem ``group_norm(input, num_groups, weight, bias)`` (or its backward) poses."""
    n, c, s, strides = ncs_layout(torch.empty_like(input))
    name = dtype_name(input.dtype)
    return GroupNormProblem(
        backward, True, True, NO_ACTIVATION, backward, backward, (name,) * 3, n, c, num_groups, s, strides
    )


FAMILY: Family[GroupNormProblem] = Family("group_norm", _describe)

# Most elements a program keeps in registers (the backward holds more per element).
MAX_TILE = {False: 32768, True: 16384}


class _GroupEngine(Engine[GroupNormProblem]):
    one_block = True

    def _shapes(self, problem: GroupNormProblem) -> list[tuple[int, int]]:
        """(BLOCK_G, BLOCK_S) candidates; BLOCK_C always covers a group's channels."""
        raise NotImplementedError

    def _warps(self, problem: GroupNormProblem, tile: int) -> tuple[int, ...]:
        """num_warps candidates for a tile of ``tile`` elements, the heuristic's first."""
        return max(4, min(16, tile // 1024)), max(4, min(16, tile // 512))

    def configs(self, problem: GroupNormProblem) -> list[LaunchConfig]:
        block_c = triton.next_power_of_2(problem.cpg)
        out = []
        for block_g, block_s in self._shapes(problem):
            block_g = min(block_g, triton.next_power_of_2(problem.groups))
            tile = block_g * block_c * block_s
            for warps in self._warps(problem, tile):
                config = {"BLOCK_G": block_g, "BLOCK_C": block_c, "BLOCK_S": block_s, "num_warps": warps}
                if config not in out and (tile <= MAX_TILE[problem.backward] or not self.one_block):
                    out.append(config)
        return out

    def bind(self, problem: GroupNormProblem, config: LaunchConfig) -> Callable[..., None]:
        p = problem
        block_g = config["BLOCK_G"]
        grid = (p.n * cdiv(p.groups, block_g),)
        index_64 = (p.n * max(p.strides) * 2 + p.channels * p.spatial) > 2**31 - 1
        blocks = (index_64, block_g, config["BLOCK_C"], config["BLOCK_S"])
        if not p.backward:
            return launcher(
                _forward_kernel,
                grid,
                num_tensors=6,
                ints=(p.groups, p.cpg, p.spatial, *p.strides),
                constexprs=(p.acc, p.has_w, p.has_b, p.act, self.one_block, *blocks),
                num_warps=config["num_warps"],
            )
        run = launcher(
            _backward_kernel,
            grid,
            num_tensors=9,
            ints=(p.channels, p.groups, p.cpg, p.spatial, *p.strides),
            constexprs=(p.acc, p.has_w, p.has_b, p.act, p.need_dw, p.need_db, self.one_block, *blocks),
            num_warps=config["num_warps"],
        )

        shape = (p.need_dw + p.need_db, p.n, p.channels)

        def backward(dy, x, w, b, mean, rstd, dx, dw, db, p0, p1) -> None:
            # Per-(n, channel) partial sums, then a fixed-order sum over n: deterministic.
            if not (p.need_dw or p.need_db):
                run(dy, x, w, b, mean, rstd, dx, x, x, p0, p1)
                return
            part = mean.new_empty(shape)
            dw_nc = part if p.need_dw else x
            db_nc = part[1] if p.need_dw and p.need_db else (part if p.need_db else x)
            run(dy, x, w, b, mean, rstd, dx, dw_nc, db_nc, p0, p1)
            if p.need_dw:
                sum_partials(part, dw, db if p.need_db else None)
            else:
                sum_partials(part, db)

        return backward


@FAMILY.register
class OneBlockEngine(_GroupEngine):
    """A program's groups live in registers: one read of x (and dy), one write."""

    name = "one-block"

    def not_supported_reasons(self, problem: GroupNormProblem) -> list[str]:
        tile = triton.next_power_of_2(problem.cpg) * triton.next_power_of_2(problem.spatial)
        if tile > MAX_TILE[problem.backward]:
            return [
                f"a group of {problem.cpg} channels x {problem.spatial} positions exceeds the register tile"
            ]
        return []

    def cost(self, problem: GroupNormProblem) -> float:
        # Measured on H100, bf16 64x256x56x56 NCHW: a 1 x 3136 instance tile runs at 98% of the
        # copy bandwidth. An 8 x 3136 group tile takes the whole register file (8 warps, one
        # program a multiprocessor), so its loads, arithmetic and stores take turns: 97 us
        # alone, 158 with a fused SiLU, where the looped engine (two reads, the second from L2,
        # many programs a multiprocessor) runs 94 and 133.
        # In channels_last a program reads its groups' channels at every position: fewer than 16
        # contiguous channels waste most of each memory sector (instance norm's backward, 4
        # channels a program: 415 us against the looped engine's 278).
        tile = triton.next_power_of_2(problem.cpg) * triton.next_power_of_2(problem.spatial)
        if problem.channels_last:
            fit = min(MAX_TILE[problem.backward] // tile, problem.groups)
            return 1.0 if fit * problem.cpg >= 16 else 2.0
        return 2.0 if tile > 8192 else 1.0

    def _warps(self, problem: GroupNormProblem, tile: int) -> tuple[int, ...]:
        if tile >= 32768 and not problem.channels_last:  # 128 fp32 a thread at 8 warps: no
            return 8, 16  # spills, and faster than 16 warps (measured on NCHW groups only)
        return super()._warps(problem, tile)

    def _shapes(self, problem: GroupNormProblem) -> list[tuple[int, int]]:
        block_s = triton.next_power_of_2(problem.spatial)
        per_group = triton.next_power_of_2(problem.cpg) * block_s
        fit = max(1, MAX_TILE[problem.backward] // per_group)
        if problem.channels_last:  # neighbouring groups share memory transactions: take many
            return [(min(fit, g), block_s) for g in (max(1, 64 // problem.cpg), max(1, 16 // problem.cpg), 1)]
        return [(1, block_s), (min(fit, 2), block_s), (min(fit, 4), block_s)]


@FAMILY.register
class LoopedEngine(_GroupEngine):
    """Groups of any size in blocks of positions: statistics pass, then output pass (one extra read)."""

    name = "looped"
    one_block = False

    def cost(self, problem: GroupNormProblem) -> float:
        return 1.5

    def _warps(self, problem: GroupNormProblem, tile: int) -> tuple[int, ...]:
        # Several small programs a multiprocessor overlap one's loads with another's stores.
        if problem.backward:  # its elementwise sums take registers: more warps a tile
            return max(4, min(16, tile // 1024)), max(4, min(16, tile // 2048))
        return max(4, min(16, tile // 2048)), max(4, min(16, tile // 1024))

    def _shapes(self, problem: GroupNormProblem) -> list[tuple[int, int]]:
        block_c = triton.next_power_of_2(problem.cpg)
        if problem.channels_last:
            g = max(1, 64 // block_c)
            return [
                (g, max(1, 4096 // (g * block_c))),
                (max(1, g // 4), max(1, 4096 // (max(1, g // 4) * block_c))),
            ]
        # Measured (H100, 8 x 3136 groups): forward best at 8192-element tiles and 4 warps (94 us
        # against 104-113 for 2048-4096), backward at 8192 and 8 warps (151 us; 170 at 4096).
        return [(1, max(1, t // block_c)) for t in (8192, 4096, 2048)]


# The channels_last split engine (statistics, finalize, apply) lives in group_split.py, the
# pipelined one (both directions, one launch) in group_pipeline.py.
from . import group_pipeline, group_split  # noqa: E402, F401  (they register their engines on FAMILY)

# ---------------------------------------------------------------------------------------------
# 4. torch.library ops and autograd.


def _stats_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _fake_forward(x, weight, bias, groups, eps, act, act_p0, act_p1):
    stats = x.new_empty(x.shape[0] * groups, dtype=_stats_dtype(x))
    return torch.empty_like(x), stats, torch.empty_like(stats)


@custom_op(
    "group_norm",
    "(Tensor x, Tensor? weight, Tensor? bias, int groups, float eps, int act, float act_p0, float act_p1) "
    "-> (Tensor, Tensor, Tensor)",
    _fake_forward,
)
def _forward(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    groups: int,
    eps: float,
    act: int,
    act_p0: float,
    act_p1: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y in x's layout, mean and 1/std per (n, group))."""
    y = torch.empty_like(x)
    mean = x.new_empty(x.shape[0] * groups, dtype=_stats_dtype(x))
    rstd = torch.empty_like(mean)
    if x.numel() == 0:
        return y, mean, rstd
    x, y = dense_ncs(x, y)
    n, c, s, strides = ncs_layout(y)
    w = weight if weight is not None else x  # absent tensors are passed as x and never read
    b = bias if bias is not None else x
    flags = (False, weight is not None, bias is not None, act, False, False)
    key = (*flags, n, c, groups, s, strides, x.dtype, w.dtype, b.dtype)

    def problem() -> GroupNormProblem:
        names = (dtype_name(x.dtype), dtype_name(w.dtype), dtype_name(b.dtype))
        return GroupNormProblem(*flags, names, n, c, groups, s, strides)

    args = (x, w, b, y, mean, rstd, eps, act_p0, act_p1)
    FAMILY.plan(key, problem, lambda: args)(*args)
    return y, mean, rstd


def _fake_backward(dy, x, weight, bias, mean, rstd, groups, act, act_p0, act_p1, need_dw, need_db):
    return torch.empty_like(x), *param_grads(x, weight, bias, need_dw, need_db)


@custom_op(
    "group_norm_backward",
    "(Tensor dy, Tensor x, Tensor? weight, Tensor? bias, Tensor mean, Tensor rstd, int groups, int act, "
    "float act_p0, float act_p1, bool need_dw, bool need_db) -> (Tensor, Tensor, Tensor)",
    _fake_backward,
)
def _backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    groups: int,
    act: int,
    act_p0: float,
    act_p1: float,
    need_dw: bool,
    need_db: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx in x's layout, dweight or empty, dbias or empty)."""
    dx = torch.empty_like(x)
    dw, db = param_grads(x, weight, bias, need_dw, need_db)
    if x.numel() == 0:
        return dx, dw.zero_(), db.zero_()
    x, dx = dense_ncs(x, dx)
    dy = in_layout(dy, dx)
    n, c, s, strides = ncs_layout(dx)
    w = weight if weight is not None else x
    b = bias if bias is not None else x
    flags = (True, weight is not None, bias is not None, act, need_dw, need_db)
    key = (*flags, n, c, groups, s, strides, x.dtype, w.dtype, dy.dtype)

    def problem() -> GroupNormProblem:
        names = (dtype_name(x.dtype), dtype_name(w.dtype), dtype_name(dy.dtype))
        return GroupNormProblem(*flags, names, n, c, groups, s, strides)

    args = (dy, x, w, b, mean, rstd, dx, dw, db, act_p0, act_p1)
    FAMILY.plan(key, problem, lambda: args)(*args)
    return dx, dw, db


class _GroupNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, groups, eps, act, act_p0, act_p1, stats):
        y, mean, rstd = _forward(x, weight, bias, groups, eps, act, act_p0, act_p1)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.params = (groups, act, act_p0, act_p1)
        ctx.set_materialize_grads(False)
        if not stats:  # every output costs the autograd engine host time: only y unless asked
            return y
        # The statistics feed instance norm's running averages: no gradient.
        ctx.mark_non_differentiable(mean, rstd)
        return y, mean, rstd

    @staticmethod
    def backward(ctx, dy, _dmean=None, _drstd=None):
        if dy is None:  # the output was not used
            return (None,) * 9
        x, weight, bias, mean, rstd = ctx.saved_tensors
        groups, act, act_p0, act_p1 = ctx.params
        need_dw, need_db = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        dx, dw, db = _backward(dy, x, weight, bias, mean, rstd, groups, act, act_p0, act_p1, need_dw, need_db)
        return dx, dw if need_dw else None, db if need_db else None, None, None, None, None, None, None


def _group_norm(
    op: str,
    input: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    activation: str | None,
    stats: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Validated group norm; returns (y, mean, 1/std) with statistics per (n, group), or
    (y, None, None) for an autograd call that did not ask for ``stats``."""
    check_tensor(op, "input", input, min_ndim=2)
    channels = input.shape[1]
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups <= 0:
        raise ValueError(f"{op}: argument 'num_groups'={num_groups!r} must be a positive int")
    if channels % num_groups:
        raise ValueError(f"{op}: argument 'num_groups'={num_groups} does not divide the {channels} channels")
    weight = check_affine(op, "weight", weight, (channels,), input)
    bias = check_affine(op, "bias", bias, (channels,), input)
    eps = check_eps(op, eps)
    act, p0, p1 = activation_kind(activation, op)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (input, weight, bias)):
        out = _GroupNormFunction.apply(input, weight, bias, num_groups, eps, act, p0, p1, stats)
        return out if stats else (out, None, None)
    return _forward(input, weight, bias, num_groups, eps, act, p0, p1)


# ---------------------------------------------------------------------------------------------
# 5. Public function.


@autocast_policy(FP32)
def group_norm(
    input: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    activation: str | None = None,
) -> torch.Tensor:
    """``F.group_norm``: normalize each sample's channels in ``num_groups`` groups, then scale and
    shift per channel, then an optional fused ``activation`` ("silu" for diffusion UNets, "relu",
    "gelu", "gelu_tanh", "sigmoid", "tanh").

    Args:
        input: (N, C, *spatial) fp16/bf16/fp32, contiguous or channels_last (read in place; the
            output keeps the layout).
        num_groups: a divisor of C.
        weight, bias: (C,) tensors of any float dtype, or None.
        eps: added to the variance; must be > 0.
    """
    return _group_norm("tdnn.group_norm", input, num_groups, weight, bias, eps, activation)[0]


def instance_norm(
    input: torch.Tensor,
    running_mean: torch.Tensor | None = None,
    running_var: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    use_input_stats: bool = True,
    momentum: float = 0.1,
    eps: float = 1e-5,
    *,
    activation: str | None = None,
) -> torch.Tensor:
    """``F.instance_norm``: normalize each (sample, channel) over its spatial positions (group norm
    with one channel a group); then scale, shift and an optional fused ``activation``.

    With ``use_input_stats`` the running statistics, if given, are updated in place as PyTorch
    does (the batch average of the per-instance means and unbiased variances); without it the
    running statistics normalize instead, as batch norm in inference does.
    """
    op = "tdnn.instance_norm"
    check_tensor(op, "input", input, min_ndim=3)
    channels = input.shape[1]
    for name, value in (("running_mean", running_mean), ("running_var", running_var)):
        check_affine(op, name, value, (channels,), input)
    if (running_mean is None) != (running_var is None):
        raise ValueError(f"{op}: give both 'running_mean' and 'running_var', or neither")
    if not use_input_stats:
        if running_mean is None:
            raise ValueError(
                f"{op}: 'running_mean' and 'running_var' are required when use_input_stats=False"
            )
        from .batch import batch_norm

        return batch_norm(
            input, running_mean, running_var, weight, bias, False, momentum, eps, activation=activation
        )
    momentum = check_float(op, "momentum", momentum)
    stats = running_mean is not None
    y, mean, rstd = _group_norm(op, input, channels, weight, bias, eps, activation, stats)
    if running_mean is not None:
        with torch.no_grad():
            spatial = input[0, 0].numel()
            var = (rstd.double().pow(-2) - eps).clamp_min(0) * (spatial / max(spatial - 1, 1))
            running_mean.mul_(1 - momentum).add_(
                momentum * mean.view(-1, channels).double().mean(0).to(running_mean.dtype)
            )
            running_var.mul_(1 - momentum).add_(
                momentum * var.view(-1, channels).mean(0).to(running_var.dtype)
            )
    return y
