"""Group norm's channels_last forward as three steps, like batch norm's: per-channel partial sums
of each sample over slices of its positions (rows of C contiguous channels, fully coalesced), a
per-sample finalize merging them into group statistics, and an elementwise apply (engine
``split`` of the ``group_norm`` family, registered when ``group`` is imported)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from ...core.backend import multiprocessor_count
from ...core.engine import Engine, LaunchConfig
from ...core.launcher import cdiv, launcher
from ...core.numerics import convert
from ..activation import activation_value
from .group import FAMILY, GroupNormProblem


@triton.jit
def _split_stats_kernel(
    x_ptr, part_ptr,
    spatial, rows_per_split, n_channels, stride_n, stride_s,
    ACC: tl.constexpr, INDEX_64: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Sums of (x - shift) and its square per channel over this program's positions of sample n,
    shift = x[n, c, position 0] (keeps the variance's digits for large means), into
    part[n, split, 0 or 1, c]. Channels are contiguous (stride 1). Grid: (splits, N)."""
    split = tl.program_id(0)
    n = tl.program_id(1)
    splits = tl.num_programs(0)
    if INDEX_64:
        n = n.to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    cm = c < n_channels
    base = x_ptr + n * stride_n
    shift = convert(tl.load(base + c, mask=cm, other=0.0), ACC)[None, :]
    acc = tl.zeros([BLOCK_S, BLOCK_C], ACC)
    acc_sq = tl.zeros([BLOCK_S, BLOCK_C], ACC)
    start = split * rows_per_split
    end = tl.minimum(start + rows_per_split, spatial)
    for s0 in range(start, end, BLOCK_S):
        pos = s0 + tl.arange(0, BLOCK_S)[:, None]
        mask = (pos < end) & cm[None, :]
        if INDEX_64:
            pos = pos.to(tl.int64)
        x = convert(tl.load(base + pos * stride_s + c[None, :], mask=mask, other=0.0), ACC)
        d = tl.where(mask, x - shift, 0.0)
        acc += d
        acc_sq += d * d
    out = part_ptr + (n * splits + split) * 2 * n_channels + c
    tl.store(out, tl.sum(acc, 0), mask=cm)
    tl.store(out + n_channels, tl.sum(acc_sq, 0), mask=cm)


@triton.jit
def group_channels(n_groups, cpg, BLOCK_G: tl.constexpr, BLOCK_J: tl.constexpr):
    """A sample's channels as a [BLOCK_G, BLOCK_J] tile, one group a row: (channel index, mask)."""
    g = tl.arange(0, BLOCK_G)[:, None]
    j = tl.arange(0, BLOCK_J)[None, :]
    return g * cpg + j, (g < n_groups) & (j < cpg)


@triton.jit
def sum_splits(
    part_ptr, first, splits, ch, m, n_channels,
    ACC: tl.constexpr, BLOCK_K: tl.constexpr, CACHE: tl.constexpr,
):  # fmt: skip
    """Sums over rows [first, first + splits) of a (rows, 2, C) buffer of per-channel partials, at
    the [G, J] channel indices ``ch`` (mask ``m``): (sum of part[:, 0], sum of part[:, 1]).
    BLOCK_K rows are loaded at once, one memory round trip per BLOCK_K rows (the finalize sits on
    the path between a sample's statistics and its apply pass). The rows are added in a fixed
    order: the same bits on every run."""
    k = tl.arange(0, BLOCK_K)[:, None, None]
    total = tl.zeros(ch.shape, ACC)
    total_sq = tl.zeros(ch.shape, ACC)
    for k0 in range(0, splits, BLOCK_K):
        mask = (k0 + k < splits) & m[None, :, :]
        at = part_ptr + (first + k0 + k) * 2 * n_channels + ch[None, :, :]
        total += tl.sum(tl.load(at, mask=mask, other=0.0, cache_modifier=CACHE), 0)
        total_sq += tl.sum(tl.load(at + n_channels, mask=mask, other=0.0, cache_modifier=CACHE), 0)
    return total, total_sq


def rows_per_load(splits: int, block_g: int, block_j: int) -> int:
    """BLOCK_K for sum_splits: rows of partials a 4096-element load covers."""
    return max(1, min(triton.next_power_of_2(splits), 4096 // (block_g * block_j)))


@triton.jit
def finalize_sample(
    x_ptr, part_ptr, w_ptr, mean_ptr, rstd_ptr, cmean_ptr, cscale_ptr, eps, n,
    spatial, splits, n_channels, n_groups, cpg, stride_n,
    ACC: tl.constexpr, HAS_W: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_J: tl.constexpr,
    BLOCK_K: tl.constexpr, CACHE: tl.constexpr,
):  # fmt: skip
    """Sample n's group statistics from its channels' partial sums ``part[n, split, 0 or 1, c]``:
    per channel mean and squared deviations (shift + S/count, SS - S**2/count), merged over a
    group's channels (Chan et al.). Writes mean and 1/std per (n, group), and per (n, channel)
    the group mean and w * rstd for the apply pass. ``CACHE`` is the partials' load cache
    modifier (".cg" where other programs of the same launch wrote them)."""
    ch, m = group_channels(n_groups, cpg, BLOCK_G, BLOCK_J)
    shift = convert(tl.load(x_ptr + n.to(tl.int64) * stride_n + ch, mask=m, other=0.0), ACC)
    total, total_sq = sum_splits(part_ptr, n * splits, splits, ch, m, n_channels, ACC, BLOCK_K, CACHE)
    count = tl.sum(tl.zeros([1], ACC), 0) + spatial  # spatial may be a constexpr (a size of 1)
    mean_c = shift + total / count
    m2_c = tl.where(m, tl.maximum(total_sq - total * total / count, 0.0), 0.0)
    mean_g = tl.sum(tl.where(m, mean_c, 0.0), 1) / cpg
    dev = tl.where(m, mean_c - mean_g[:, None], 0.0)
    var = (tl.sum(m2_c, 1) + count * tl.sum(dev * dev, 1)) / (cpg * count)
    rstd = 1.0 / tl.sqrt(var + eps)
    gm = tl.arange(0, BLOCK_G) < n_groups
    tl.store(mean_ptr + n * n_groups + tl.arange(0, BLOCK_G), mean_g, mask=gm)
    tl.store(rstd_ptr + n * n_groups + tl.arange(0, BLOCK_G), rstd, mask=gm)
    scale = tl.broadcast_to(rstd[:, None], [BLOCK_G, BLOCK_J])
    if HAS_W:
        scale = scale * convert(tl.load(w_ptr + ch, mask=m, other=0.0), ACC)
    tl.store(cmean_ptr + n * n_channels + ch, tl.broadcast_to(mean_g[:, None], [BLOCK_G, BLOCK_J]), mask=m)
    tl.store(cscale_ptr + n * n_channels + ch, scale, mask=m)


@triton.jit
def _split_finalize_kernel(
    x_ptr, part_ptr, w_ptr, mean_ptr, rstd_ptr, cmean_ptr, cscale_ptr,
    eps,
    spatial, splits, n_channels, n_groups, cpg, stride_n,
    ACC: tl.constexpr, HAS_W: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_J: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Grid (N,): finalize_sample for each sample."""
    finalize_sample(
        x_ptr, part_ptr, w_ptr, mean_ptr, rstd_ptr, cmean_ptr, cscale_ptr, eps, tl.program_id(0),
        spatial, splits, n_channels, n_groups, cpg, stride_n, ACC, HAS_W, BLOCK_G, BLOCK_J, BLOCK_K, "",
    )  # fmt: skip


@triton.jit
def _split_apply_kernel(
    x_ptr, cmean_ptr, cscale_ptr, b_ptr, y_ptr,
    act_p0, act_p1,
    spatial, n_channels, stride_n, stride_s,
    HAS_B: tl.constexpr, ACT: tl.constexpr, INDEX_64: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """y = act((x - mean[n, c]) * scale[n, c] + b[c]) on a [BLOCK_S, BLOCK_C] tile of sample n.
    Grid: (position blocks, N)."""
    n = tl.program_id(1)
    pos = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)[:, None]
    c = tl.arange(0, BLOCK_C)[None, :]
    cm = c < n_channels
    mask = (pos < spatial) & cm
    if INDEX_64:
        n = n.to(tl.int64)
        pos = pos.to(tl.int64)
    mean = tl.load(cmean_ptr + n * n_channels + c, mask=cm, other=0.0)
    scale = tl.load(cscale_ptr + n * n_channels + c, mask=cm, other=0.0)
    offs = n * stride_n + pos * stride_s + c
    y = (convert(tl.load(x_ptr + offs, mask=mask, other=0.0), mean.dtype) - mean) * scale
    if HAS_B:
        y = y + convert(tl.load(b_ptr + c, mask=cm, other=0.0), mean.dtype)
    if ACT >= 0:
        y = activation_value(y, ACT, act_p0, act_p1)
    tl.store(y_ptr + offs, convert(y, y_ptr.dtype.element_ty), mask=mask)


# Widest channel row the split and pipelined engines keep in one tile.
SPLIT_MAX_CHANNELS = 2048


def row_tile_reasons(problem: GroupNormProblem) -> list[str]:
    """Why the engines reading rows of all C channels (split, pipelined) cannot run a problem."""
    reasons = []
    if not problem.channels_last:
        reasons.append("reads rows of contiguous channels (channels_last)")
    if problem.channels > SPLIT_MAX_CHANNELS:
        reasons.append(f"{problem.channels} channels exceed a row tile of {SPLIT_MAX_CHANNELS}")
    return reasons


@FAMILY.register
class SplitEngine(Engine[GroupNormProblem]):
    """Channels-last forward: statistics, finalize and apply kernels over full channel rows (the
    other engines read a group's few channels per position, a fraction of each memory sector)."""

    name = "split"

    def not_supported_reasons(self, problem: GroupNormProblem) -> list[str]:
        return ["a forward algorithm"] * problem.backward + row_tile_reasons(problem)

    def cost(self, problem: GroupNormProblem) -> float:
        return 0.5

    def configs(self, problem: GroupNormProblem) -> list[LaunchConfig]:
        c = triton.next_power_of_2(problem.channels)
        positions = triton.next_power_of_2(problem.spatial)
        out = []
        for tile, per_sm in ((4096, 4), (8192, 4), (4096, 8), (2048, 8)):
            config = {"BLOCK_S": max(1, min(tile // c, positions)), "PER_SM": per_sm}
            if config not in out:
                out.append(config)
        return out

    def bind(self, problem: GroupNormProblem, config: LaunchConfig) -> Callable[..., None]:
        p = problem
        block_s, block_c = config["BLOCK_S"], triton.next_power_of_2(p.channels)
        index_64 = p.n * p.strides[0] > 2**31 - 1
        device = torch.cuda.current_device() if torch.cuda.is_available() else 0
        splits = max(1, min(cdiv(p.spatial, block_s), config["PER_SM"] * multiprocessor_count(device) // p.n))
        rows_per_split = cdiv(cdiv(p.spatial, splits), block_s) * block_s
        splits = cdiv(p.spatial, rows_per_split)
        stride_n, stride_s = p.strides[0], p.strides[2]
        warps = 4 if block_s * block_c <= 4096 else 8
        stats = launcher(
            _split_stats_kernel,
            (splits, p.n),
            2,
            (p.spatial, rows_per_split, p.channels, stride_n, stride_s),
            (p.acc, index_64, block_s, block_c),
            num_warps=warps,
        )
        block_g, block_j = triton.next_power_of_2(p.groups), triton.next_power_of_2(p.cpg)
        finalize = launcher(
            _split_finalize_kernel,
            (p.n,),
            7,
            (p.spatial, splits, p.channels, p.groups, p.cpg, stride_n),
            (p.acc, p.has_w, block_g, block_j, rows_per_load(splits, block_g, block_j)),
            num_warps=4,
        )
        apply = launcher(
            _split_apply_kernel,
            (cdiv(p.spatial, block_s), p.n),
            5,
            (p.spatial, p.channels, stride_n, stride_s),
            (p.has_b, p.act, index_64, block_s, block_c),
            num_warps=warps,
        )
        part_shape, channel_shape = (p.n, splits, 2, p.channels), (2, p.n, p.channels)

        def forward(x, w, b, y, mean, rstd, eps, p0, p1) -> None:
            part = mean.new_empty(part_shape)
            per_channel = mean.new_empty(channel_shape)  # the group mean and the scale, per (n, c)
            cmean, cscale = per_channel
            stats(x, part)
            finalize(x, part, w, mean, rstd, cmean, cscale, eps)
            apply(x, cmean, cscale, b, y, p0, p1)

        return forward
