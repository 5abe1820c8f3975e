"""Batch normalization's engine: the problem a step poses, the tiled engine that binds its launches,
and the per-step plans (see batch.py for the algorithm and the public functions)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from ...core.arrival import arrival_counters
from ...core.backend import multiprocessor_count
from ...core.engine import Engine, Family, LaunchConfig, Problem
from ...core.launcher import cdiv, launcher
from .batch_kernels import (
    _apply_kernel,
    _backward_apply_kernel,
    _backward_reduce_kernel,
    _backward_sums_kernel,
    _finalize_kernel,
    _stats_finalize_kernel,
    _stats_kernel,
)
from .common import NO_ACTIVATION, dtype_name, ncs_layout, sum_partials

# ---------------------------------------------------------------------------------------------
# Engine: one tiled algorithm; the problem says which step (statistics, finalize + apply,
# backward) a plan runs.


@dataclasses.dataclass(frozen=True)
class BatchNormProblem(Problem):
    """One step over an (N, C, S) view with strides (n, c, s) shared by the step's tensors."""

    # "stats", "forward" (statistics, finalize and apply), "apply", "backward", the backward's halves
    # "backward_reduce" / "backward_apply"; "forward_packed", "apply_packed" and "backward_packed"
    # for the eager fast path (see PACKED at the kernels)
    step: str
    training: bool
    update_running: bool
    has_w: bool
    has_b: bool
    act: int
    dtypes: tuple[str, ...]
    n: int
    channels: int
    spatial: int
    strides: tuple[int, int, int]
    has_r: bool = False  # a residual added before the activation (forward steps)

    @property
    def acc(self) -> tl.dtype:
        return tl.float64 if self.dtypes[0] == "float64" else tl.float32

    @property
    def rows(self) -> int:
        return self.n * self.spatial

    @property
    def channels_last(self) -> bool:
        return self.strides[1] == 1 and self.channels > 1


def _describe(input: torch.Tensor, step: str = "stats", training: bool = True) -> BatchNormProblem:
    """The problem a step of ``batch_norm(input, ..., training)`` poses (affine, running statistics)."""
    n, c, s, strides = ncs_layout(torch.empty_like(input))
    names = (dtype_name(input.dtype),) * 3
    return BatchNormProblem(step, training, training, True, True, NO_ACTIVATION, names, n, c, s, strides)


FAMILY: Family[BatchNormProblem] = Family("batch_norm", _describe)


@FAMILY.register
class TiledEngine(Engine[BatchNormProblem]):
    """Row x channel tiles coalesced along the contiguous one; per-channel sums in two stages."""

    name = "tiled"

    def cost(self, problem: BatchNormProblem) -> float:
        return 1.0

    def configs(self, problem: BatchNormProblem) -> list[LaunchConfig]:
        c = triton.next_power_of_2(problem.channels)
        # First choices measured on H100 (bf16 64x256x56x56, forward / backward): channels_last
        # 128 x 32 tiles, 4 programs a multiprocessor (135 / 190 us; 64 x 64: 144 / 195); NCHW
        # 2 x 1024 tiles, 8 a multiprocessor (117 / 182 us; 1 x 2048 with 4: 139 / 193).
        if problem.channels_last:  # channels contiguous: wide in channels
            tiles = [(min(c, 128), 32), (min(c, 64), 64), (min(c, 32), 128), (min(c, 64), 32)]
            per_sms = (4, 8)
        else:  # positions contiguous: tall in rows, few channels
            tiles = [(2, 1024), (1, 2048), (1, 4096), (4, 512)]
            per_sms = (8, 4)
        out = []
        for block_c, block_r in tiles:
            for per_sm in per_sms:
                config = {"BLOCK_C": block_c, "BLOCK_R": block_r, "num_warps": 4, "PER_SM": per_sm}
                if config not in out:
                    out.append(config)
        return out

    def bind(self, problem: BatchNormProblem, config: LaunchConfig) -> Callable[..., object]:
        p = problem
        block_r, block_c = config["BLOCK_R"], config["BLOCK_C"]
        index_64 = p.n * max(p.strides) + p.channels * p.spatial > 2**31 - 1
        ints = (p.rows, p.channels, p.spatial, *p.strides)
        c_blocks = cdiv(p.channels, block_c)
        device = torch.cuda.current_device() if torch.cuda.is_available() else 0
        # Splits of the rows (interleaved row blocks): enough programs to fill the GPU.
        splits = max(
            1, min(cdiv(p.rows, block_r), config["PER_SM"] * multiprocessor_count(device) // c_blocks)
        )
        tiles_grid = (cdiv(p.rows, block_r) * c_blocks,)
        warps = config["num_warps"]
        tiles = (index_64, block_r, block_c)
        part_shape = (2, splits, p.channels)
        # The eager fast path's steps keep their per-channel buffers in one workspace (PACKED).
        packed = p.step.endswith("_packed")
        step = p.step.removesuffix("_packed")
        stats_dtype = torch.float64 if p.acc == tl.float64 else torch.float32
        # Training's statistics pass and the backward's sums finalize in their last programs
        # (one arrival counter per channel block), BLOCK_K partials per load.
        block_k = max(1, min(triton.next_power_of_2(splits), 2048 // block_c))
        counters = arrival_counters(c_blocks)
        if step == "stats":
            stats = launcher(
                _stats_kernel, (c_blocks, splits), 3, ints, (p.acc, packed, *tiles), num_warps=warps
            )

            def partial_stats(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
                part = x.new_empty(part_shape, dtype=_stats_dtype(x))
                stats(x, shift, part)
                return part

            return partial_stats
        if step == "forward" or (packed and p.training):
            stats_finalize = launcher(
                _stats_finalize_kernel,
                (c_blocks, splits),
                9,
                ints,
                (p.acc, p.update_running, p.has_w, packed, *tiles, block_k),
                num_warps=warps,
            )
        if step in ("apply", "forward"):
            apply = launcher(
                _apply_kernel, tiles_grid, 6, ints, (p.has_b, p.has_r, p.act, packed, *tiles), num_warps=warps
            )
            finalizers: dict[tuple[int, int], Callable[..., None]] = {}

            def finalizer(k: int, shift_stride: int) -> Callable[..., None]:
                """The finalize launch for partial sums of ``k`` rows and a shift ``shift_stride``
                elements apart (x's channel stride when the shift is x[0, :, 0])."""
                run = finalizers.get((k, shift_stride))
                if run is None:
                    run = finalizers[k, shift_stride] = launcher(
                        _finalize_kernel,
                        (cdiv(p.channels, 128),),
                        8,
                        (p.channels, k, shift_stride),
                        (p.acc, p.training, p.update_running, p.has_w, packed, 128),
                    )
                return run

            if packed:  # training: statistics (finalized) and apply; else apply the running statistics
                finalize = finalizer(1, 1)
                size = (4 + 2 * splits if p.training else 4) * p.channels

                def forward_packed(x, w, b, r, rm, rv, y, count, eps, momentum, p0, p1) -> torch.Tensor:
                    """Returns the workspace: its first two rows are the mean and 1/std."""
                    ws = x.new_empty(size, dtype=stats_dtype)
                    if p.training:
                        stats_finalize(x, w, rm, rv, ws, ws, ws, ws, counters(x), float(count), eps, momentum)
                    else:
                        finalize(ws, x, w, rm, rv, ws, ws, ws, float(count), eps, momentum)
                    apply(x, ws, ws, b, r, y, p0, p1)
                    return ws

                return forward_packed
            if step == "forward":

                def forward(x, w, b, r, rm, rv, y, mean, rstd, count, eps, momentum, p0, p1) -> None:
                    """Training: statistics (finalized) and apply; the shift is x[0, :, 0]."""
                    part = mean.new_empty(part_shape)
                    scale = mean.new_empty((2, p.channels))  # scale, mean_lo
                    stats_finalize(
                        x, w, rm, rv, part, mean, rstd, scale, counters(x), float(count), eps, momentum
                    )
                    apply(x, mean, scale, b, r, y, p0, p1)

                return forward

            def finalize_apply(x, part, shift, w, b, r, rm, rv, y, mean, rstd, count, eps, momentum, p0, p1):
                """``part``: (2, k, C) partial sums and ``shift`` (C,) (unread unless training)."""
                scale = mean.new_empty((2, p.channels))  # scale, mean_lo
                run = finalizer(part.shape[1] if p.training else 1, 1)
                run(part, shift, w, rm, rv, mean, rstd, scale, float(count), eps, momentum)
                apply(x, mean, scale, b, r, y, p0, p1)

            return finalize_apply
        reduce = launcher(
            _backward_reduce_kernel,
            (c_blocks, splits),
            7,
            ints,
            (p.acc, p.has_w, p.has_b, p.act, packed, *tiles),
            num_warps=warps,
        )
        reduce_sums = launcher(
            _backward_sums_kernel,
            (c_blocks, splits),
            10,
            ints,
            (p.acc, p.has_w, p.has_b, p.act, packed, *tiles, block_k),
            num_warps=warps,
        )
        apply_grad = launcher(
            _backward_apply_kernel,
            tiles_grid,
            9,
            ints,
            (p.acc, p.training, p.has_w, p.has_b, p.act, packed, *tiles),
            num_warps=warps,
        )

        def backward_reduce(dy, x, mean, rstd, w, b, p0, p1) -> torch.Tensor:
            part = mean.new_empty(part_shape)
            reduce(dy, x, mean, rstd, w, b, part, p0, p1)
            return part

        if step == "backward_reduce":
            return backward_reduce
        if step == "backward_apply":
            return lambda dy, x, mean, rstd, w, b, dsum, dxsum, dx, count, p0, p1: apply_grad(
                dy, x, mean, rstd, w, b, dsum, dxsum, dx, p0, p1, float(count)
            )

        def backward(dy, x, mean, rstd, w, b, dx, dw, db, count, p0, p1) -> None:
            """``dw``/``db``: the parameter gradients' buffers, or None where none is wanted."""
            part = mean.new_empty(part_shape)
            # A gradient in the statistics' dtype is the sum dx needs: summed in place (no copy);
            # others get an fp32 (fp64) buffer each and a copy, rounded once.
            dsum = db if db is not None and db.dtype == mean.dtype else mean.new_empty(p.channels)
            dxsum = dw if dw is not None and dw.dtype == mean.dtype else mean.new_empty(p.channels)
            reduce_sums(dy, x, mean, rstd, w, b, part, dsum, dxsum, counters(x), p0, p1)
            if dw is not None and dw is not dxsum:
                dw.copy_(dxsum)
            if db is not None and db is not dsum:
                db.copy_(dsum)
            apply_grad(dy, x, mean, rstd, w, b, dsum, dxsum, dx, p0, p1, float(count))

        return backward


def channel_sums(part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two (C,) sums over the splits of a (2, splits, C) partial buffer, in a fixed order."""
    sums = part.new_empty((2, part.shape[2]))
    first, second = sums.unbind(0)
    sum_partials(part, first, second)
    return first, second


def _stats_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _plan(
    step: str, x: torch.Tensor, training: bool, update: bool, weight, bias, act: int, timing_args,
    residual: torch.Tensor | None = None,
):  # fmt: skip
    """The bound launch of one step on ``x`` (an (N, C, S) layout); ``weight``/``bias`` and the
    ``residual`` (laid out as x; forward steps) may be None."""
    dtypes = (x.dtype, (weight if weight is not None else x).dtype, (bias if bias is not None else x).dtype)
    dtypes += () if residual is None else (residual.dtype,)
    flags = (step, training, update, weight is not None, bias is not None, act)

    def problem() -> BatchNormProblem:
        n, c, s, strides = ncs_layout(x)
        names = tuple(map(dtype_name, dtypes))
        return BatchNormProblem(*flags, names, n, c, s, strides, residual is not None)

    # Shape and strides determine the (N, C, S) view: the key needs no layout analysis per call.
    return FAMILY.plan((*flags, residual is not None, x.shape, x.stride(), *dtypes), problem, timing_args)


def _default_shift(x: torch.Tensor) -> torch.Tensor:
    """One sample of each channel, a value near the channel's data: sums of x - shift keep the
    variance's digits however large the mean."""
    if x.shape[0] == 0 or x[0, 0].numel() == 0:
        return torch.zeros(x.shape[1], dtype=_stats_dtype(x), device=x.device)
    first = x[(0, slice(None)) + (0,) * (x.dim() - 2)]  # x[0, :, 0, ...]: a view, copied once below
    return first.to(_stats_dtype(x)).contiguous()


def _partial_stats(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """(2, splits, C) partial sums of x - shift and of its square; x is in an (N, C, S) layout."""
    return _plan("stats", x, True, False, None, None, NO_ACTIVATION, lambda: (x, shift))(x, shift)
