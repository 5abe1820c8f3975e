"""Batch norm over the batch of several processes: the device work between the collectives.

``SyncBatchNorm`` (tdnn.nn) runs, per layer and step:

* forward: this rank's statistics pass, then one kernel packing its per-channel
  (count, mean, M2) — M2 the sum of squared deviations from its own mean — into a (3, C) buffer;
  an all-gather of the buffers; one kernel combining the ranks' moments with Chan's parallel
  formula in rank order (exact, and free of the cancellation that summing raw squares across
  ranks would suffer for large means), updating the running statistics and writing the global
  count; then the finalize + apply pass, which may add a residual and apply an activation
  (ResNet's BN + ReLU and BN + add + ReLU, as the one-process batch norm fuses them).
* backward: the reduction of ``sum(dy)`` and ``sum(dy * x_hat)`` into one (2, C) buffer, divided
  by the global count, one all-reduce of it, and the elementwise pass; an activation's gradient
  is taken inside both passes from the recomputed pre-activation values (with a residual, the
  caller takes it from the saved output first, as that gradient is also the residual's).

The collectives are passed in as callables, so this module needs no process group. Counts stay on
the device: no host synchronization. A rank may hold no rows; it still joins both collectives.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from ...core.launcher import cdiv, launcher
from ...core.numerics import convert
from .batch import _finalize_apply
from .batch_engine import _default_shift, _partial_stats, _plan, _stats_dtype
from .common import NO_ACTIVATION, dense_ncs, in_layout, sum_partials

BLOCK_C = 128


@triton.jit
def _moments_kernel(part_ptr, shift_ptr, out_ptr, count, n_channels, splits, BLOCK: tl.constexpr):
    """This rank's (count, mean, M2) per channel into rows 0, 1, 2 of the (3, C) buffer ``out``,
    from the (2, splits, C) partial sums S1, S2 of x - shift: mean = shift + S1 / n and
    M2 = S2 - S1^2 / n. All buffers in the statistics dtype (fp32; fp64 for fp64 inputs)."""
    c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cm = c < n_channels
    acc = part_ptr.dtype.element_ty
    s1 = tl.zeros([BLOCK], acc)
    s2 = tl.zeros([BLOCK], acc)
    for k in range(0, splits):  # a fixed order: the same bits on every run
        s1 += tl.load(part_ptr + k * n_channels + c, mask=cm, other=0.0)
        s2 += tl.load(part_ptr + (splits + k) * n_channels + c, mask=cm, other=0.0)
    centred = s1 / count
    shift = tl.load(shift_ptr + c, mask=cm, other=0.0)
    tl.store(out_ptr + c, tl.full([BLOCK], count, acc), mask=cm)
    tl.store(out_ptr + n_channels + c, shift + centred, mask=cm)
    tl.store(out_ptr + 2 * n_channels + c, tl.maximum(s2 - s1 * centred, 0.0), mask=cm)


@triton.jit
def _combine_kernel(
    gathered_ptr, rmean_ptr, rvar_ptr, part_ptr, mean_ptr, count_ptr,
    momentum,
    n_channels, world,
    UPDATE_RUNNING: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Chan's combination of the ranks' (count, mean, M2) in the (world * 3, C) buffer
    ``gathered``, in rank order. Writes what the finalize + apply pass reads for statistics
    already reduced — partial sums (2, 1, C) = (0, biased variance) about the shift ``mean``,
    with a count of 1 — and the global count per channel; updates the running statistics
    (unbiased variance, as PyTorch). Arithmetic in ``gathered``'s dtype."""
    c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cm = c < n_channels
    acc = gathered_ptr.dtype.element_ty
    n = tl.zeros([BLOCK], acc)
    mean = tl.zeros([BLOCK], acc)
    m2 = tl.zeros([BLOCK], acc)
    for r in range(0, world):
        at = gathered_ptr + r * 3 * n_channels + c
        n_r = tl.load(at, mask=cm, other=0.0)
        mean_r = tl.load(at + n_channels, mask=cm, other=0.0)
        m2_r = tl.load(at + 2 * n_channels, mask=cm, other=0.0)
        total = n + n_r
        weight_r = tl.where(total > 0, n_r / tl.maximum(total, 1.0), 0.0)
        delta = mean_r - mean
        mean += delta * weight_r
        m2 += m2_r + delta * delta * n * weight_r
        n = total
    var = m2 / n
    tl.store(part_ptr + c, tl.zeros([BLOCK], acc), mask=cm)
    tl.store(part_ptr + n_channels + c, var, mask=cm)
    tl.store(mean_ptr + c, mean, mask=cm)
    tl.store(count_ptr + c, n, mask=cm)
    if UPDATE_RUNNING:
        unbiased = m2 / tl.maximum(n - 1.0, 1.0)
        rm = convert(tl.load(rmean_ptr + c, mask=cm, other=0.0), acc)
        rv = convert(tl.load(rvar_ptr + c, mask=cm, other=0.0), acc)
        rm = (1.0 - momentum) * rm + momentum * mean
        rv = (1.0 - momentum) * rv + momentum * unbiased
        tl.store(rmean_ptr + c, convert(rm, rmean_ptr.dtype.element_ty), mask=cm)
        tl.store(rvar_ptr + c, convert(rv, rvar_ptr.dtype.element_ty), mask=cm)


_LAUNCHERS: dict[tuple, Callable[..., None]] = {}


def _moments(part: torch.Tensor, shift: torch.Tensor, out: torch.Tensor, count: int) -> None:
    channels, splits = part.shape[2], part.shape[1]
    key = ("moments", channels, splits, part.dtype)
    run = _LAUNCHERS.get(key)
    if run is None:
        run = _LAUNCHERS[key] = launcher(
            _moments_kernel, (cdiv(channels, BLOCK_C),), 3, (channels, splits), (BLOCK_C,)
        )
    run(part, shift, out, float(count))


def _combine(gathered, running_mean, running_var, part, mean, count, momentum: float) -> None:
    world, channels = gathered.shape[0] // 3, gathered.shape[1]
    update = running_mean is not None
    rm = running_mean if update else mean  # placeholders are never read
    rv = running_var if update else mean
    key = ("combine", world, channels, update, gathered.dtype, rm.dtype, rv.dtype)
    run = _LAUNCHERS.get(key)
    if run is None:
        run = _LAUNCHERS[key] = launcher(
            _combine_kernel, (cdiv(channels, BLOCK_C),), 6, (channels, world), (update, BLOCK_C)
        )
    run(gathered, rm, rv, part, mean, count, momentum)


def sync_batch_norm_forward(
    input: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    momentum: float,
    eps: float,
    world: int,
    all_gather: Callable[[torch.Tensor, torch.Tensor], object],
    act: int = NO_ACTIVATION,
    act_p0: float = 0.0,
    act_p1: float = 0.0,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Training batch norm over the batches of ``world`` processes, then ``residual`` added and
    the activation ``act`` (with its parameters) applied where given: ``(y, mean, invstd,
    count)``, the last three per channel in the statistics dtype (fp32; fp64 for fp64 input),
    ``count`` the global number of values per channel.

    ``all_gather(out, local)`` must fill the (world * 3, C) ``out`` with every rank's (3, C)
    ``local`` in rank order (``torch.distributed.all_gather_into_tensor``). The running
    statistics, if given, are updated in place. The caller validates ``input`` and ``residual``
    (input's shape and dtype; no checks here: this is the per-layer, per-step path)."""
    y = torch.empty_like(input)
    x, y = dense_ncs(input, y)
    residual = None if residual is None else in_layout(residual, y)
    channels = x.shape[1]
    rows = x.numel() // channels if channels else 0
    stats = _stats_dtype(x)
    local = x.new_empty((3, channels), dtype=stats)
    if rows:
        shift = _default_shift(x)
        _moments(_partial_stats(x, shift), shift, local, rows)
    else:
        local.zero_()
    gathered = x.new_empty((world * 3, channels), dtype=stats)  # the ranks' buffers stacked
    all_gather(gathered, local)
    part = x.new_empty((2, 1, channels), dtype=stats)
    centre = x.new_empty(channels, dtype=stats)
    count = torch.empty_like(centre)
    _combine(gathered, running_mean, running_var, part, centre, count, momentum)
    mean = x.new_empty(channels, dtype=stats)
    invstd = torch.empty_like(mean)
    if rows:
        _finalize_apply(
            x, part, centre, weight, bias, None, None, y, mean, invstd, 1, True, momentum, eps,
            act, act_p0, act_p1, residual,
        )  # fmt: skip
    return y, mean, invstd, count


def sync_batch_norm_backward(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    count: torch.Tensor,
    all_reduce: Callable[[torch.Tensor], object],
    need_input_grad: bool = True,
    bias: torch.Tensor | None = None,
    act: int = NO_ACTIVATION,
    act_p0: float = 0.0,
    act_p1: float = 0.0,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """The backward of ``sync_batch_norm_forward``: ``(dx or None, sum_dy, sum_dy_xhat)``, the
    sums this rank's own (they are its bias and weight gradients, as with torch's SyncBatchNorm;
    data parallelism averages them), of the gradient through the activation ``act`` where one
    followed without a residual (``bias`` then as in the forward: the pre-activation values are
    recomputed). ``all_reduce(t)`` must sum ``t`` over the ranks in place."""
    channels = input.shape[1]
    local = input.new_empty((2, channels), dtype=_stats_dtype(input))
    sum_dy, sum_dy_xhat = local.unbind(0)
    x = dx = None
    if input.numel():
        x, dx = dense_ncs(input, torch.empty_like(input))
        dy = in_layout(grad_output, x)
        w = weight if weight is not None else x  # absent tensors are passed as x and never read
        b = bias if bias is not None and act != NO_ACTIVATION else None  # read for the activation only
        args = (dy, x, mean, invstd, w, x if b is None else b, act_p0, act_p1)
        part = _plan("backward_reduce", x, True, False, weight, b, act, lambda: args)(*args)
        sum_partials(part, sum_dy, sum_dy_xhat)
    else:
        local.zero_()
    # Each rank's sums over the global count: their all-reduced sum is what dx needs.
    means = local / count
    all_reduce(means)
    if not need_input_grad:
        return None, sum_dy, sum_dy_xhat
    if x is None:
        return torch.empty_like(input), sum_dy, sum_dy_xhat
    args = (dy, x, mean, invstd, w, x if b is None else b, means[0], means[1], dx, 1.0, act_p0, act_p1)
    _plan("backward_apply", dx, True, False, weight, b, act, lambda: args)(*args)
    return dx, sum_dy, sum_dy_xhat
