"""Max, average and adaptive pooling: the problem, its engines and the torch.library ops.

Engines (cuDNN's pooling algorithms, chosen per problem by ``Family.select``):

* ``unrolled``: direct kernels with the window size (forward) or the candidate-window count
  (backward) compiled in, for windows of at most ``MAX_UNROLLED`` taps or candidates; with
  non-overlapping windows the backward is a one-to-one gather.
* ``plane``: the unrolled kernels over [rows x columns] tiles of one plane, for tensors with
  contiguous rows (NCHW): geometry per row and column instead of per lane.
* ``direct``: the same kernels with those counts as runtime ints: any geometry, one compiled
  kernel for all.
* ``window-reduce``: forward only; a program reduces one window of many taps for a block of
  channels (global pooling, adaptive pooling to small sizes, large kernels); when the outputs
  are few, several programs share a window and a second kernel merges their partial results.

All are deterministic: backward passes gather per input element in a fixed order.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from ...core.engine import Engine, Family, LaunchConfig, Problem
from ...core.launcher import cdiv, launcher
from ...core.library import custom_op
from . import kernels as K
from .common import (
    INDEX_DTYPE,
    INDEX_NONE,
    check_input,
    check_pool_args,
    empty_output,
    grad_input,
    needs_int64,
    pad3,
    plane_configs,
    plane_cost,
    sizes3,
    strides5,
    taps_and_candidates,
)

# Most taps (forward) or candidate windows (backward) the unrolled kernels compile in.
MAX_UNROLLED = 64
# Windows with at least this many taps are reduced by one program each (when outputs are few).
WINDOW_REDUCE_TAPS = 32
# Window reductions split a window over several programs until about this many run.
REDUCE_PROGRAMS = 2048


@dataclasses.dataclass(frozen=True)
class PoolProblem(Problem):
    """One pooling launch over (N, C, D, H, W) views; 1-D and 2-D problems have size-1 dimensions.

    ``strides`` holds the (n, c, d, h, w) strides of the tensors of the launch: forward (x, y);
    backward (dx, dy, indices or dy again). ``kernel``, ``stride``, ``padding`` and ``dilation``
    are those of regular windows; adaptive problems have ``kernel`` = the largest window's taps.
    """

    backward: bool
    is_max: bool
    adaptive: bool
    index: int
    count_include_pad: bool
    divisor_override: bool
    dtype: str
    n: int
    channels: int
    in_size: tuple[int, int, int]
    out_size: tuple[int, int, int]
    kernel: tuple[int, int, int]
    stride: tuple[int, int, int]
    padding: tuple[int, int, int]
    dilation: tuple[int, int, int]
    candidates: tuple[int, int, int]
    strides: tuple[tuple[int, ...], ...]
    index_64: bool

    @property
    def acc(self) -> tl.dtype:
        return tl.float64 if self.dtype == "float64" else tl.float32

    @property
    def taps(self) -> int:
        return math.prod(self.kernel)

    @property
    def clamp(self) -> bool:
        """Whether padding taps may read the nearest input (see ``kernels._window``)."""
        return self.is_max and self.index == INDEX_NONE and not self.adaptive and max(self.dilation) == 1

    @property
    def flat(self) -> bool:
        """Whether every window is the whole input (global pooling) and the input's positions are
        evenly strided, so tap s of a window lies s * (w stride) after its first."""
        (d, h, w), (_, _, sd, sh, sw) = self.in_size, self.strides[0]
        packed = (d == 1 or sd == h * sh) and (h == 1 or sh == w * sw)
        return not self.backward and self.adaptive and self.out_size == (1, 1, 1) and packed

    @property
    def lane_sizes(self) -> tuple[int, int, int]:
        """The (D, H, W) sizes a program's lanes walk: outputs forward, inputs backward."""
        return self.in_size if self.backward else self.out_size

    @property
    def positions(self) -> int:
        return math.prod(self.lane_sizes)

    @property
    def geometry(self) -> tuple[int, ...]:
        """ID, IH, IW, OD, OH, OW, then stride, padding and dilation per dimension, as kernels take them."""
        return (*self.in_size, *self.out_size, *self.stride, *self.padding, *self.dilation)

    @property
    def tensor_strides(self) -> tuple[int, ...]:
        """The (n, c, d, h, w) strides of each tensor of the launch, in a row."""
        return tuple(s for t in self.strides for s in t)

    @property
    def flags(self) -> tuple:
        """IS_MAX, ADAPTIVE, COUNT_PAD, OVERRIDE, INDEX, ACC: the kernels' common constexprs."""
        p = self
        return (p.is_max, p.adaptive, p.count_include_pad, p.divisor_override, p.index, p.acc)

    @property
    def channels_last(self) -> bool:
        """Whether the input-side tensor (x read forward, dx written backward) has unit channel
        stride: tiles then run wide in channels. (Outputs have the input's memory format, except
        that a 1x1 output has unit channel stride whatever the input's.)"""
        return self.strides[0][1] == 1 and self.channels > 1


def _describe(
    input: torch.Tensor,
    kernel_size: int | tuple[int, ...],
    stride: int | tuple[int, ...] | None = None,
    padding: int | tuple[int, ...] = 0,
    dilation: int | tuple[int, ...] = 1,
    ceil_mode: bool = False,
    *,
    is_max: bool = True,
    backward: bool = False,
) -> PoolProblem:
    """The problem ``max_pool{1,2,3}d`` (or ``avg_pool`` with is_max=False) poses on ``input``."""
    dims = input.ndim - 2
    x, _ = check_input("tdnn.engines", input, dims)
    kernel, stride_, pad, dil, out = check_pool_args(
        "tdnn.engines", x, dims, kernel_size, stride, padding, dilation, ceil_mode
    )
    y = empty_output(x, (*x.shape[:2], *out))
    return _problem(
        backward, is_max, False, INDEX_NONE, True, False, x.dtype, x, y, y, out, kernel, stride_, pad, dil
    )


FAMILY: Family[PoolProblem] = Family("pool", _describe)


def _problem(
    backward, is_max, adaptive, index, count_pad, override, dtype, x_side, y_side, third, out, kernel,
    stride, padding, dilation,
) -> PoolProblem:  # fmt: skip
    """The problem of a launch on the given input-side and output-side tensors."""
    in3, out3 = sizes3(x_side), pad3(out, 1)
    kernel3, stride3, dil3 = pad3(kernel, 1), pad3(stride, 1), pad3(dilation, 1)
    taps, candidates = taps_and_candidates(adaptive, in3, out3, kernel3, stride3, dil3)
    tensors = (x_side, y_side, third) if backward else (x_side, y_side)
    return PoolProblem(
        backward, is_max, adaptive, index, count_pad, override, str(dtype).removeprefix("torch."),
        x_side.shape[0], x_side.shape[1], in3, out3, taps, stride3, pad3(padding, 0), dil3,
        candidates, tuple(strides5(t) for t in tensors), needs_int64(*tensors),
    )  # fmt: skip


def _unroll_reasons(problem: PoolProblem) -> list[str]:
    """Why the kernels with unrolled tap (forward) or candidate (backward) loops cannot run it."""
    if problem.backward:
        count = math.prod(problem.candidates)
        if count > MAX_UNROLLED:
            return [f"an input lies in up to {count} windows; unrolls at most {MAX_UNROLLED}"]
    elif problem.taps > MAX_UNROLLED:
        return [f"a window of {problem.taps} taps; unrolls at most {MAX_UNROLLED}"]
    return []


class _DirectEngine(Engine[PoolProblem]):
    """Tiles of positions x channels: wide in channels for channels_last, long in positions else."""

    unrolled = False

    def cost(self, problem: PoolProblem) -> float:
        return 2.0

    def configs(self, problem: PoolProblem) -> list[LaunchConfig]:
        out = []
        c = triton.next_power_of_2(problem.channels)
        positions = triton.next_power_of_2(problem.positions)
        for tile in (1024, 2048, 512):
            if problem.channels_last:
                block_c = min(c, 64)
                block_p = max(1, min(positions, tile // block_c))
            else:
                block_p = min(positions, tile)
                block_c = max(1, min(c, tile // block_p))
            for warps in (4, 8):
                config = {"BLOCK_P": block_p, "BLOCK_C": block_c, "num_warps": warps}
                if config not in out:
                    out.append(config)
        return out

    def bind(self, problem: PoolProblem, config: LaunchConfig) -> Callable[..., None]:
        p = problem
        block_p, block_c = config["BLOCK_P"], config["BLOCK_C"]
        grid = (p.n * cdiv(p.positions, block_p) * cdiv(p.channels, block_c),)
        counts = (*p.kernel, *p.candidates) if p.backward else p.kernel
        tail = (p.index_64, block_p, block_c)
        if p.backward:
            fn = K.backward_unrolled_kernel if self.unrolled else K.backward_kernel
        else:
            fn = K.forward_unrolled_kernel if self.unrolled else K.forward_kernel
        ints = (p.channels, *p.geometry, *p.tensor_strides)
        if self.unrolled:
            constexprs = (*counts, *p.flags, *tail)
        else:
            ints, constexprs = (*ints, *counts), (*p.flags, *tail)
        return launcher(fn, grid, 3, ints, constexprs, num_warps=config["num_warps"])


@FAMILY.register
class UnrolledEngine(_DirectEngine):
    """Direct kernels with the window (forward) or candidate count (backward) compiled in."""

    name = "unrolled"
    unrolled = True

    def not_supported_reasons(self, problem: PoolProblem) -> list[str]:
        return _unroll_reasons(problem)

    def cost(self, problem: PoolProblem) -> float:
        return 1.0


@FAMILY.register
class PlaneEngine(Engine[PoolProblem]):
    """Unrolled kernels over [rows x columns] tiles of one (n, c, d) plane, for contiguous rows;
    the geometry is compiled in (a kernel per pooling layer's shape)."""

    name = "plane"

    def not_supported_reasons(self, problem: PoolProblem) -> list[str]:
        reasons = _unroll_reasons(problem)
        if problem.adaptive and any(i % o for i, o in zip(problem.in_size, problem.out_size)):
            # Compiled on an H100 with the geometry as constants, the backward of such windows
            # (11x9 to 17x15) lost later candidates' shares in some lanes; with runtime sizes the
            # same code is right, so these problems go to the tile engines.
            reasons.append("adaptive windows that vary in size or overlap (geometry not compiled in)")
        return reasons

    def cost(self, problem: PoolProblem) -> float:
        return plane_cost(problem.channels_last, problem.lane_sizes)

    def configs(self, problem: PoolProblem) -> list[LaunchConfig]:
        # Measured on an H100 (3x3 stride 2 and global windows): small tiles where a lane issues
        # many loads (taps forward; candidates backward, two loads each for max pooling), large
        # tiles where it issues a few; 4 warps.
        if problem.backward:
            loads = math.prod(problem.candidates) * (2 if problem.is_max else 1)
        else:
            loads = problem.taps
        tiles = (2048, 1024, 512) if loads <= 4 else (512, 1024, 2048)
        return plane_configs(problem.lane_sizes, tiles, ("BLOCK_H", "BLOCK_W"))

    def bind(self, problem: PoolProblem, config: LaunchConfig) -> Callable[..., None]:
        p = problem
        block_h, block_w = config["BLOCK_H"], config["BLOCK_W"]
        d, h, w = p.lane_sizes
        grid = (p.n * p.channels * d * cdiv(h, block_h) * cdiv(w, block_w),)
        counts = (*p.kernel, *p.candidates) if p.backward else p.kernel
        if p.backward:
            fn, tail = K.plane_backward_kernel, (p.index_64,)
        else:
            fn, tail = K.plane_forward_kernel, (p.index_64, p.clamp)
        return launcher(
            fn,
            grid,
            3,
            (p.channels, *p.tensor_strides),
            (*p.geometry, *counts, *p.flags, *tail, block_h, block_w),
            num_warps=config["num_warps"],
        )


@FAMILY.register
class DirectEngine(_DirectEngine):
    """Direct kernels with runtime window and candidate counts: any geometry."""

    name = "direct"


@FAMILY.register
class WindowReduceEngine(Engine[PoolProblem]):
    """Forward only: one program per output position and channel block reduces its window."""

    name = "window-reduce"

    def not_supported_reasons(self, problem: PoolProblem) -> list[str]:
        if problem.backward:
            return ["a forward algorithm; backward passes gather per input element"]
        return []

    def cost(self, problem: PoolProblem) -> float:
        # Few, large windows: a program per window keeps every lane busy on its taps. Many small
        # windows: a program each would cost more in launches than the direct tiles.
        if problem.taps >= WINDOW_REDUCE_TAPS and problem.positions <= 256:
            return 0.5
        return 1.5 if problem.taps > MAX_UNROLLED else 3.0

    def configs(self, problem: PoolProblem) -> list[LaunchConfig]:
        out = []
        c = triton.next_power_of_2(problem.channels)
        taps = triton.next_power_of_2(problem.taps)
        for tile in (1024, 2048, 512):
            if problem.channels_last:
                block_c = min(c, 64)
                block_s = max(1, min(taps, tile // block_c))
            else:
                block_s = min(taps, tile)
                block_c = max(1, min(c, tile // block_s))
            programs = problem.n * problem.positions * cdiv(problem.channels, block_c)
            split = min(cdiv(REDUCE_PROGRAMS, programs), cdiv(problem.taps, block_s))
            chunk = cdiv(cdiv(problem.taps, split), block_s) * block_s
            for warps in (4, 8):
                config = {"BLOCK_S": block_s, "BLOCK_C": block_c, "CHUNK": chunk, "num_warps": warps}
                if config not in out:
                    out.append(config)
        return out

    def bind(self, problem: PoolProblem, config: LaunchConfig) -> Callable[..., None]:
        p = problem
        block_s, block_c, chunk = config["BLOCK_S"], config["BLOCK_C"], config["CHUNK"]
        split = cdiv(p.taps, chunk)
        positions = p.n * p.positions
        grid = (positions * cdiv(p.channels, block_c), split)
        flags = (*p.flags, p.index_64)
        ints = (p.channels, *p.geometry, *p.tensor_strides, *p.kernel, chunk, split)
        tail = (p.flat, block_s, block_c)
        warps = config["num_warps"]
        if split == 1:
            reduce = launcher(K.window_reduce_kernel, grid, 5, ints, (*flags, False, *tail), num_warps=warps)
            return lambda x, y, idx, divisor: reduce(x, y, idx, x, x, divisor)
        reduce = launcher(K.window_reduce_kernel, grid, 5, ints, (*flags, True, *tail), num_warps=warps)
        merge = launcher(K.window_merge_kernel, grid[:1], 5, ints, (*flags, True, *tail), num_warps=warps)
        acc = torch.float64 if p.acc == tl.float64 else torch.float32

        def run(x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor, divisor: float) -> None:
            part = torch.empty((split, positions, p.channels), device=x.device, dtype=acc)
            part_idx = torch.empty(part.shape, device=x.device, dtype=torch.int32) if p.is_max else part
            reduce(x, y, idx, part, part_idx, divisor)
            merge(x, y, idx, part, part_idx, divisor)

        return run


# ---------------------------------------------------------------------------------------------
# torch.library ops. Parameter lists have one entry per spatial dimension (1 to 3); adaptive
# problems pass empty kernel/stride/padding/dilation lists. ``divisor`` 0 means no override.


def _regular(kernel, stride, padding, dilation) -> tuple:
    """Regular-window parameters; placeholders for adaptive problems, which pass empty lists."""
    return kernel or (1,), stride or (1,), padding or (0,), dilation or (1,)


def _index_out(x: torch.Tensor, shape: tuple[int, ...], index: int) -> torch.Tensor:
    if index == INDEX_NONE:
        return x.new_empty(0, dtype=torch.int64)
    return empty_output(x, shape, INDEX_DTYPE[index])


def _fake_forward(x, output_size, kernel_size, stride, padding, dilation, adaptive, is_max,
                  count_include_pad, divisor, index):  # fmt: skip
    shape = (x.shape[0], x.shape[1], *output_size)
    return empty_output(x, shape), _index_out(x, shape, index)


@custom_op(
    "pool",
    "(Tensor x, int[] output_size, int[] kernel_size, int[] stride, int[] padding, int[] dilation, "
    "bool adaptive, bool is_max, bool count_include_pad, int divisor, int index) -> (Tensor, Tensor)",
    _fake_forward,
)
def pool_forward(
    x: torch.Tensor,
    output_size: list[int],
    kernel_size: list[int],
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    adaptive: bool,
    is_max: bool,
    count_include_pad: bool,
    divisor: int,
    index: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y in x's memory format, the max-pool indices in y's layout or an empty tensor)."""
    shape = (x.shape[0], x.shape[1], *output_size)
    y = empty_output(x, shape)
    idx = _index_out(x, shape, index)
    if y.numel() == 0:
        return y, idx
    flags = (adaptive, is_max, count_include_pad, divisor != 0, index)
    params = (tuple(output_size), tuple(kernel_size), tuple(stride), tuple(padding), tuple(dilation))
    key = (False, *flags, x.shape, x.stride(), x.dtype, *params)

    def problem() -> PoolProblem:
        return _problem(False, is_max, adaptive, index, count_include_pad, divisor != 0, x.dtype, x, y, y,
                        output_size, *_regular(kernel_size, stride, padding, dilation))  # fmt: skip

    args = (x, y, idx if index else y, float(divisor))
    FAMILY.plan(key, problem, lambda: args)(*args)
    return y, idx


def _fake_backward(dy, indices, input_size, kernel_size, stride, padding, dilation, adaptive, is_max,
                   count_include_pad, divisor, index, channels_last):  # fmt: skip
    return grad_input(dy, input_size, channels_last)


@custom_op(
    "pool_backward",
    "(Tensor dy, Tensor? indices, int[] input_size, int[] kernel_size, int[] stride, int[] padding, "
    "int[] dilation, bool adaptive, bool is_max, bool count_include_pad, int divisor, int index, "
    "bool channels_last) -> Tensor",
    _fake_backward,
)
def pool_backward(
    dy: torch.Tensor,
    indices: torch.Tensor | None,
    input_size: list[int],
    kernel_size: list[int],
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    adaptive: bool,
    is_max: bool,
    count_include_pad: bool,
    divisor: int,
    index: int,
    channels_last: bool,
) -> torch.Tensor:
    """The input gradient (channels_last or contiguous, as the input's format was); max pooling
    reads the forward's ``indices`` (of kind ``index``), average pooling none."""
    if is_max and indices is None:
        raise ValueError("tdnn.pool_backward: max pooling needs the forward's 'indices'")
    dx = grad_input(dy, input_size, channels_last)
    if dx.numel() == 0:
        return dx
    idx = indices if is_max else dy  # average pooling reads no indices: dy stands in
    flags = (adaptive, is_max, count_include_pad, divisor != 0, index)
    params = (tuple(kernel_size), tuple(stride), tuple(padding), tuple(dilation))
    key = (True, *flags, dx.shape, dx.stride(), dy.shape, dy.stride(), idx.stride(), dy.dtype, *params)

    def problem() -> PoolProblem:
        return _problem(True, is_max, adaptive, index, count_include_pad, divisor != 0, dy.dtype, dx, dy, idx,
                        dy.shape[2:], *_regular(kernel_size, stride, padding, dilation))  # fmt: skip

    args = (dy, idx, dx, float(divisor))
    FAMILY.plan(key, problem, lambda: args)(*args)
    return dx
