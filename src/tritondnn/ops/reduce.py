"""Tensor reductions over any set of dimensions: cuDNN's ReduceTensor.

Operations (cuDNN's names): ``add`` (sum), ``mul`` (product), ``min``, ``max``, ``amax`` (max of
absolute values), ``avg`` (mean), ``norm1`` (sum of absolute values), ``norm2`` (Euclidean norm),
``mul_no_zeros`` (product of the non-zero elements); ``min``, ``max`` and ``amax`` can also return
the index of the chosen element.

The reduced dimensions and the kept dimensions are each merged (``core.strides.collapse``); when
both merge into one the input is read in place as an (M kept, K reduced) strided matrix, otherwise
it is first permuted to that form by a copy. A program reduces a tile of rows with fp32 (fp64)
accumulators per lane, so rows along the contiguous dimension and columns (reductions over an
outer dimension) both load coalesced with 16-byte vectors. When the rows (or column blocks) give
fewer than two programs per SM, for instance a reduction over all dimensions, each row is split
over several programs (a few per SM in all), each writing an fp32 (fp64) partial, and a second
launch combines them in a fixed order: the result has the same bits on every run on a given GPU
model (no atomics; the split count follows its SM count), in and out of
``tdnn.config.deterministic``.

NaN propagates as in PyTorch. Ties for min/max pick the lowest index. Indices count over the
reduced dimensions flattened in row-major order (for one dimension, torch.max(dim)'s index).
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import math
from collections.abc import Callable, Sequence

import torch
import triton
import triton.language as tl

from ..core.backend import INTERPRET, multiprocessor_count
from ..core.checks import FLOAT_DTYPES, check_choice, check_tensor
from ..core.engine import Engine, Family, LaunchConfig, Problem
from ..core.launcher import cdiv, launcher
from ..core.library import custom_op
from ..core.numerics import convert
from ..core.strides import collapse


class ReduceOp(enum.IntEnum):
    ADD = 0
    MUL = 1
    MIN = 2
    MAX = 3
    AMAX = 4
    AVG = 5
    NORM1 = 6
    NORM2 = 7
    MUL_NO_ZEROS = 8


OPS = tuple(op.name.lower() for op in ReduceOp)
_INTERPRET = tl.constexpr(INTERPRET)
_INDEXED = (ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AMAX)

# How each op runs in the kernel: (PRE transform, COMBINE, POST transform).
# PRE: 0 x, 1 |x|, 2 x*x, 3 x (zeros read as 1). COMBINE: 0 sum, 1 product, 2 min, 3 max.
# POST: 0 none, 1 divide by the reduced count, 2 sqrt.
_PLAN = {
    ReduceOp.ADD: (0, 0, 0),
    ReduceOp.MUL: (0, 1, 0),
    ReduceOp.MIN: (0, 2, 0),
    ReduceOp.MAX: (0, 3, 0),
    ReduceOp.AMAX: (1, 3, 0),
    ReduceOp.AVG: (0, 0, 1),
    ReduceOp.NORM1: (1, 0, 0),
    ReduceOp.NORM2: (2, 0, 2),
    ReduceOp.MUL_NO_ZEROS: (3, 1, 0),
}

# ---------------------------------------------------------------------------------------------
# 1. Reference.


def reduce_reference(x: torch.Tensor, op: str, dims: Sequence[int], keepdim: bool = False) -> torch.Tensor:
    """The reduction in float64 with plain PyTorch."""
    x = x.double()
    dims = tuple(dims) or tuple(range(x.ndim))
    if op == "add":
        return x.sum(dims, keepdim)
    if op == "avg":
        return x.mean(dims, keepdim)
    if op == "norm1":
        return x.abs().sum(dims, keepdim)
    if op == "norm2":
        return x.square().sum(dims, keepdim).sqrt()
    if op == "amax":
        return x.abs().amax(dims, keepdim)
    if op in ("min", "max"):
        return x.amin(dims, keepdim) if op == "min" else x.amax(dims, keepdim)
    flat = _to_matrix_reference(x, dims)
    if op == "mul_no_zeros":
        flat = torch.where(flat == 0, 1.0, flat)
    return flat.prod(1).view(_out_shape(x.shape, dims, keepdim))


def _to_matrix_reference(x: torch.Tensor, dims: Sequence[int]) -> torch.Tensor:
    kept = [d for d in range(x.ndim) if d not in dims]
    return x.permute(*kept, *dims).reshape(math.prod(x.shape[d] for d in kept), -1)


def _out_shape(shape: Sequence[int], dims: Sequence[int], keepdim: bool) -> tuple[int, ...]:
    if keepdim:
        return tuple(1 if d in dims else s for d, s in enumerate(shape))
    return tuple(s for d, s in enumerate(shape) if d not in dims)


# ---------------------------------------------------------------------------------------------
# 2. Kernel.


@triton.jit
def _pre(x, PRE: tl.constexpr):
    if PRE == 1:
        x = tl.abs(x)
    elif PRE == 2:
        x = x * x
    elif PRE == 3:
        x = tl.where(x == 0.0, 1.0, x)
    return x


@triton.jit
def _accumulate(
    acc,
    best,
    x_ptr,
    idx_in_ptr,
    offs,
    k0,
    mask,
    PRE: tl.constexpr,
    COMBINE: tl.constexpr,
    HAS_IDX_IN: tl.constexpr,
    WRITE_IDX: tl.constexpr,
    TAIL: tl.constexpr,
):
    """Combine the [BLOCK_M, BLOCK_K] tile starting at reduced index k0 into the per-lane
    accumulators and choices: without idx_in a lane's choice is kept as the k0 of its tile (the
    lane's own offset is added once at the end), with idx_in as the loaded index.

    ``mask`` covers rows past M, and past K when TAIL: masked lanes load the combine's identity
    after ``_pre`` (0 for sums, 1 for products), so only min/max test it, and those only in the
    tail (lanes of rows past M are never stored).
    """
    if COMBINE == 0:
        acc += _pre(convert(tl.load(x_ptr + offs, mask=mask, other=0.0), acc.dtype), PRE)
    elif COMBINE == 1:
        acc *= _pre(convert(tl.load(x_ptr + offs, mask=mask, other=1.0), acc.dtype), PRE)
    else:
        x = _pre(convert(tl.load(x_ptr + offs, mask=mask, other=0.0), acc.dtype), PRE)
        if WRITE_IDX:
            if HAS_IDX_IN:
                xi = tl.load(idx_in_ptr + offs, mask=mask, other=0).to(best.dtype)
            else:
                xi = k0
            # A later element replaces the lane's choice only when strictly better (never when
            # the choice is NaN: comparisons with NaN are false), or when it is NaN and the choice
            # is not: the first NaN (then the lowest index) wins, as in PyTorch.
            if COMBINE == 2:
                take = (x < acc) | ((x != x) & (acc == acc))
            else:
                take = (x > acc) | ((x != x) & (acc == acc))
            if TAIL:
                take = take & mask
            acc = tl.where(take, x, acc)
            best = tl.where(take, xi, best)
        else:
            if TAIL:
                x = tl.where(mask, x, acc)
            if COMBINE == 2:
                acc = tl.minimum(acc, x, propagate_nan=tl.PropagateNan.ALL)
            else:
                acc = tl.maximum(acc, x, propagate_nan=tl.PropagateNan.ALL)
    return acc, best


@triton.jit
def _init(
    COMBINE: tl.constexpr,
    ACC: tl.constexpr,
    INDEX_64: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Per-lane accumulators at the combine's identity, and choices at "none" (above every index)."""
    if COMBINE == 0:
        acc = tl.zeros([BLOCK_M, BLOCK_K], ACC)
    elif COMBINE == 1:
        acc = tl.full([BLOCK_M, BLOCK_K], 1.0, ACC)
    elif COMBINE == 2:
        acc = tl.full([BLOCK_M, BLOCK_K], float("inf"), ACC)
    else:
        acc = tl.full([BLOCK_M, BLOCK_K], -float("inf"), ACC)
    if INDEX_64:
        best = tl.full([BLOCK_M, BLOCK_K], 2**62, tl.int64)
    else:
        best = tl.full([BLOCK_M, BLOCK_K], 2**31 - 1, tl.int32)
    return acc, best


@triton.jit
def _finish(
    acc,
    best,
    out_ptr,
    idx_out_ptr,
    rows,
    row_mask,
    split,
    n_split,
    count,
    COMBINE: tl.constexpr,
    POST: tl.constexpr,
    HAS_IDX_IN: tl.constexpr,
    WRITE_IDX: tl.constexpr,
    INDEX_64: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Reduce the lanes of each row and store out[row * n_split + split] (and its index)."""
    if INDEX_64:
        NONE = 2**62
    else:
        NONE = 2**31 - 1
    if COMBINE == 0:
        result = tl.sum(acc, 1)
    elif COMBINE == 1:
        result = _product(acc)
    else:
        # tl.max/tl.min may drop NaN on a GPU: reduce with NaN set aside, then put it back.
        is_nan = acc != acc
        has_nan = tl.max(is_nan.to(tl.int32), 1) > 0
        if COMBINE == 2:
            result = tl.min(tl.where(is_nan, float("inf"), acc), 1)
        else:
            result = tl.max(tl.where(is_nan, -float("inf"), acc), 1)
        result = tl.where(has_nan, float("nan"), result)
        if WRITE_IDX:
            chosen = tl.where(has_nan[:, None], is_nan, acc == result[:, None])
            if not HAS_IDX_IN:
                best = tl.where(best == NONE, NONE, best + tl.arange(0, BLOCK_K)[None, :])
            index = tl.min(tl.where(chosen, best, NONE), 1)
            # No lane chose anything only when every element is the initial +-inf: the first
            # element is the answer (a split's partial of +-inf is never chosen by the second pass).
            index = tl.where(index == NONE, 0, index)
            tl.store(idx_out_ptr + rows * n_split + split, index.to(tl.int64), mask=row_mask)
    if POST == 1:
        result = result / count
    elif POST == 2:
        result = tl.sqrt(result)
    tl.store(out_ptr + rows * n_split + split, convert(result, out_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def _reduce_kernel(
    x_ptr,
    out_ptr,
    idx_in_ptr,
    idx_out_ptr,
    count,
    M,
    K,
    sm,
    sk,
    tile0,
    span,
    stride,
    PRE: tl.constexpr,
    COMBINE: tl.constexpr,
    POST: tl.constexpr,
    HAS_IDX_IN: tl.constexpr,
    WRITE_IDX: tl.constexpr,
    ACC: tl.constexpr,
    INDEX_64: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    ONE_TILE: tl.constexpr,
):
    """out[m * S + s] = combine of pre(x[m*sm + k*sk]) over the k of split s's tiles (tiles of
    BLOCK_K reduced elements; S = the grid's second extent, 1 without splitting): tile numbers
    s * tile0, s * tile0 + stride, ... below s * tile0 + span. Contiguous chunks are
    (tile0, span, stride) = (n, n, 1); interleaved tiles (1, all tiles, S); no split (0, all, 1).

    count: the divisor of POST == 1 (float). idx_in: int64 indices of the x values (the partials
    of a first pass) when HAS_IDX_IN; else an element's index is its k. idx_out: int64 index of
    the chosen element (min/max) when WRITE_IDX. Accumulators are per lane ([BLOCK_M, BLOCK_K])
    and reduced across lanes once per row block. Whole tiles load unmasked along k (wide vectors
    whatever K is); the masked last tile goes to the split it falls to.

    ONE_TILE (K <= BLOCK_K, S = 1): a row is one tile, and the grid's programs loop over row
    blocks (i, i + programs, ...), the next blocks' loads in flight while one is reduced.
    INDEX_64: offsets and indices in int64 (else int32). STAGES: tiles (ONE_TILE: row blocks) in
    flight (> 1: Triton prefetches them through shared memory with asynchronous copies).
    """
    pid = tl.program_id(0)
    split = tl.program_id(1)
    n_split = tl.num_programs(1)
    if INDEX_64:
        pid = pid.to(tl.int64)
        split = split.to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    if ONE_TILE:
        for block in tl.range(pid, tl.cdiv(M, BLOCK_M), tl.num_programs(0), num_stages=STAGES):
            rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
            row_mask = rows < M
            acc, best = _init(COMBINE, ACC, INDEX_64, BLOCK_M, BLOCK_K)
            offs = rows[:, None] * sm + cols[None, :].to(rows.dtype) * sk
            mask = row_mask[:, None] & (cols < K)[None, :]
            acc, best = _accumulate(
                acc, best, x_ptr, idx_in_ptr, offs, 0, mask, PRE, COMBINE, HAS_IDX_IN, WRITE_IDX, True
            )
            _finish(
                acc, best, out_ptr, idx_out_ptr, rows, row_mask, 0, 1, count,
                COMBINE, POST, HAS_IDX_IN, WRITE_IDX, INDEX_64, BLOCK_K,
            )  # fmt: skip
    else:
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        row_offs = rows[:, None] * sm
        acc, best = _init(COMBINE, ACC, INDEX_64, BLOCK_M, BLOCK_K)
        whole = K // BLOCK_K
        t0 = split * tile0
        for t in tl.range(t0, tl.minimum(t0 + span, whole), stride, num_stages=STAGES):
            k0 = t * BLOCK_K
            offs = row_offs + (k0 + cols)[None, :].to(rows.dtype) * sk
            acc, best = _accumulate(
                acc,
                best,
                x_ptr,
                idx_in_ptr,
                offs,
                k0,
                row_mask[:, None],
                PRE,
                COMBINE,
                HAS_IDX_IN,
                WRITE_IDX,
                False,
            )
        # The masked last tile (number ``whole``), in the split whose tiles include it.
        if (whole * BLOCK_K < K) & (whole < t0 + span) & ((whole - t0) % stride == 0):
            k0 = whole * BLOCK_K
            k = k0 + cols
            offs = row_offs + k[None, :].to(rows.dtype) * sk
            mask = row_mask[:, None] & (k < K)[None, :]
            acc, best = _accumulate(
                acc, best, x_ptr, idx_in_ptr, offs, k0, mask, PRE, COMBINE, HAS_IDX_IN, WRITE_IDX, True
            )
        _finish(
            acc, best, out_ptr, idx_out_ptr, rows, row_mask, split, n_split, count,
            COMBINE, POST, HAS_IDX_IN, WRITE_IDX, INDEX_64, BLOCK_K,
        )  # fmt: skip


@triton.jit
def _multiply(a, b):
    return a * b


@triton.jit
def _product(acc):
    """Product along axis 1. Under the interpreter tl.reduce with a combine function of ours runs
    element by element: halving the lanes with elementwise products first keeps that short.
    Compiled, the halving would move the tile through shared memory at every step: not done."""
    if _INTERPRET:
        for _ in tl.static_range(16):
            if acc.shape[1] > 1:
                a, b = tl.split(tl.reshape(acc, [acc.shape[0], acc.shape[1] // 2, 2]))
                acc = a * b
    return tl.reduce(acc, 1, _multiply)


# ---------------------------------------------------------------------------------------------
# 3. Engines.


@dataclasses.dataclass(frozen=True)
class ReduceProblem(Problem):
    """One reduction of an (M, K) strided matrix: ``sm``/``sk`` are the input's strides over rows
    and along the reduced dimension."""

    op: int
    M: int
    K: int
    sm: int
    sk: int
    dtype: str
    out_dtype: str
    indices: bool
    index_64: bool


_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


def _describe(input: torch.Tensor, op: str = "add", dim: Sequence[int] | int | None = None) -> ReduceProblem:
    """The problem ``reduce_tensor(input, op, dim)`` poses (for an input read in place)."""
    dims = _norm_dims("tdnn.engines", dim, input.ndim)
    _, problem = _matrix(input, ReduceOp[op.upper()], dims, False, input.dtype)
    return problem


FAMILY: Family[ReduceProblem] = Family("reduce", _describe)


def _acc(problem: ReduceProblem):
    return tl.float64 if problem.dtype == "float64" else tl.float32


# Partials per row of the split engine at most.
MAX_SPLITS = 8192


def _columns(problem: ReduceProblem) -> bool:
    """Whether the reduction runs over an outer dimension: neighbouring rows are neighbours in
    memory, so tiles put rows along the vector lanes."""
    return problem.sm == 1 and problem.sk != 1


def _fit(problem: ReduceProblem, bm: int, bk: int, warps: int, stages: int, per_sm: int) -> LaunchConfig:
    """A [bm, bk] tile with bm cut to the rows there are; a column tile keeps its size (it trades
    rows for reduced elements), so few wide columns still load enough per step."""
    fit = min(bm, triton.next_power_of_2(max(problem.M, 1)))
    if _columns(problem):
        bk *= bm // fit
    return {"BLOCK_M": fit, "BLOCK_K": bk, "num_warps": warps, "STAGES": stages, "PER_SM": per_sm}


# Configs below: (BLOCK_M, BLOCK_K, num_warps, STAGES, PER_SM), the first measured fastest on an
# H100 for the shapes named (bf16; bench/misc.py's reduce cases).


@FAMILY.register
class TileEngine(Engine[ReduceProblem]):
    """Every row reduced by one program, over [BLOCK_M, BLOCK_K] tiles: one read of the input.
    Rows of one tile run on PER_SM programs per SM, each looping over row blocks."""

    name = "tile"

    def cost(self, problem: ReduceProblem) -> float:
        # Fewer programs than two per SM leave bandwidth unused (the split engine takes over).
        programs = cdiv(max(problem.M, 1), self.configs(problem)[0]["BLOCK_M"])
        return max(1.0, 2 * multiprocessor_count() / programs)

    def configs(self, problem: ReduceProblem) -> list[LaunchConfig]:
        if _columns(problem):
            shapes = [(128, 32, 4, 1, 8), (128, 64, 4, 3, 8), (256, 32, 8, 3, 4)]
        elif problem.K <= 4096:  # 16384 x 3136 (avg over HW): 79% of a copy, the best of 12 by 1%
            bk = triton.next_power_of_2(max(problem.K, 1))
            shapes = [
                (max(1, 4096 // bk), bk, 8, 1, 8),
                (max(1, 4096 // bk), bk, 8, 3, 4),
                (max(1, 2048 // bk), bk, 4, 2, 8),
            ]
        else:  # 16384 x 8192 (max with indices: 4 stages of 1024 beat one 8192 tile by 2x)
            shapes = [(1, 1024, 4, 4, 8), (1, 4096, 8, 1, 8), (1, 1024, 4, 6, 8)]
        out = []
        for shape in shapes:
            cfg = _fit(problem, *shape)
            if cfg not in out:
                out.append(cfg)
        return out

    def bind(self, problem: ReduceProblem, config: LaunchConfig) -> Callable[..., None]:
        return _launch(problem, config, 1)


@FAMILY.register
class SplitEngine(Engine[ReduceProblem]):
    """Few rows: each split over several programs (PER_SM programs per SM in all, up to
    MAX_SPLITS a row) writing fp32 (fp64) partials, which a second launch combines in order (no
    atomics: the same bits on every run on a given GPU model; the split count follows its SM
    count). Splits take interleaved tiles (INTERLEAVE; columns always), so the programs running at
    once read one band of the input, or contiguous chunks (measured on an H100: 8192 columns of
    16384, 106 us interleaved against 114 in chunks; a 2**27-element row, 113.0 against 115.6)."""

    name = "split"

    def not_supported_reasons(self, problem: ReduceProblem) -> list[str]:
        shortest = 64 if _columns(problem) else 8192
        if shortest > problem.K:
            return [f"rows of {problem.K} elements are short enough for one program"]
        return []

    def cost(self, problem: ReduceProblem) -> float:
        return 1.25

    def configs(self, problem: ReduceProblem) -> list[LaunchConfig]:
        if _columns(problem):  # 16384 x 8192 over dim 0
            shapes = [(128, 32, 4, 1, 8), (128, 64, 4, 3, 8), (64, 64, 4, 3, 8)]
        else:
            # 2**27 elements (norm2) on an H100, one run: 8192 splits of interleaved 1024-element
            # tiles, 113.0 us (80% of a copy, torch 113.0); in contiguous chunks, 115.6; 1056
            # splits, 118.6 interleaved and 119.5 in chunks; one-stage 8192-element tiles, 125-151.
            return [
                {**_fit(problem, 1, 1024, 4, 4, 64), "INTERLEAVE": True},
                {**_fit(problem, 1, 1024, 4, 4, 8), "INTERLEAVE": False},
                {**_fit(problem, 1, 8192, 8, 1, 8), "INTERLEAVE": False},
            ]
        return [_fit(problem, *shape) for shape in shapes]

    def bind(self, problem: ReduceProblem, config: LaunchConfig) -> Callable[..., None]:
        bm, bk = config["BLOCK_M"], config["BLOCK_K"]
        target = config["PER_SM"] * multiprocessor_count()
        tiles = cdiv(problem.K, bk)
        # At least a tile per split; the partials' offsets stay within 32 bits.
        limit = min(tiles, MAX_SPLITS, (2**31 - 1) // max(problem.M, 1))
        splits = max(1, min(cdiv(target, cdiv(problem.M, bm)), limit))
        if config.get("INTERLEAVE", _columns(problem)):
            tiling = (1, tiles, splits)
        else:
            per = cdiv(tiles, splits)
            splits = cdiv(tiles, per)
            tiling = (per, per, 1)
        acc_dtype = "float64" if problem.dtype == "float64" else "float32"
        first = dataclasses.replace(problem, out_dtype=acc_dtype)
        stage1 = _launch(first, config, splits, tiling=tiling, post=0)
        second = dataclasses.replace(problem, K=splits, sm=splits, sk=1, dtype=acc_dtype)
        # The second pass combines partials: already transformed (no PRE), indices from idx_in.
        bk2 = triton.next_power_of_2(splits)
        stage2 = _launch(
            second,
            _fit(second, max(1, 2048 // bk2), bk2, 4 if bk2 <= 2048 else 8, 1, 8),
            1,
            pre=0,
            has_idx_in=problem.indices,  # without indices the partials buffer stands in: never read
        )
        acc_torch = getattr(torch, acc_dtype)

        def run(x, out, _idx_in, idx_out, count):
            part = torch.empty((problem.M, splits), dtype=acc_torch, device=x.device)
            pidx = (
                torch.empty((problem.M, splits), dtype=torch.int64, device=x.device)
                if problem.indices
                else part
            )
            stage1(x, part, x, pidx, count)
            stage2(part, out, pidx, idx_out, count)

        return run


def _launch(
    problem: ReduceProblem,
    config: LaunchConfig,
    splits: int,
    *,
    tiling: tuple[int, int, int] | None = None,
    post: int | None = None,
    pre: int | None = None,
    has_idx_in: bool = False,
) -> Callable[..., None]:
    """A launch taking (x, out, idx_in, idx_out, count). tiling: the kernel's (tile0, span,
    stride), by default every tile in one split."""
    p_pre, combine, p_post = _PLAN[ReduceOp(problem.op)]
    bm, bk = config["BLOCK_M"], config["BLOCK_K"]
    programs = cdiv(max(problem.M, 1), bm)
    one_tile = splits == 1 and bk >= problem.K
    if one_tile:
        programs = min(programs, config["PER_SM"] * multiprocessor_count())
    return launcher(
        _reduce_kernel,
        (programs, splits),
        num_tensors=4,
        ints=(problem.M, problem.K, problem.sm, problem.sk, *(tiling or (0, cdiv(problem.K, bk), 1))),
        constexprs=(
            p_pre if pre is None else pre,
            combine,
            p_post if post is None else post,
            has_idx_in,
            problem.indices,
            _acc(problem),
            problem.index_64,
            bm,
            bk,
            config["STAGES"],
            one_tile,
        ),
        num_warps=config["num_warps"],
    )


# ---------------------------------------------------------------------------------------------
# 4. Running a reduction, and the torch.library op.


def _norm_dims(op: str, dim: object, ndim: int) -> tuple[int, ...]:
    if dim is None:
        return tuple(range(ndim))
    items = (dim,) if isinstance(dim, int) else dim
    if not isinstance(items, (tuple, list)):
        raise TypeError(
            f"{op}: argument 'dim' must be an int, a sequence of ints or None, got {type(dim).__name__}"
        )
    rank = max(ndim, 1)
    out = []
    for d in items:
        if isinstance(d, bool) or not isinstance(d, int):
            raise TypeError(f"{op}: argument 'dim' must hold ints, got {type(d).__name__}")
        if not -rank <= d < rank:
            raise ValueError(f"{op}: dim {d} is out of range for a tensor of {ndim} dimensions")
        if d % rank in out:
            raise ValueError(f"{op}: dim {d % rank} appears more than once in 'dim'")
        out.append(d % rank)
    if ndim == 0:
        return ()
    return tuple(sorted(out)) if out else tuple(range(ndim))


def _matrix(
    x: torch.Tensor, op: ReduceOp, dims: tuple[int, ...], indices: bool, out_dtype: torch.dtype
) -> tuple[torch.Tensor, ReduceProblem]:
    """``x`` as an (M, K) strided matrix (a copy only when the dimensions do not merge) and its problem."""
    kept = [d for d in range(x.ndim) if d not in dims]
    M = math.prod(x.shape[d] for d in kept)
    K = math.prod(x.shape[d] for d in dims)
    sk_sizes, (sk_strides,) = collapse([x.shape[d] for d in dims], [x.stride(d) for d in dims])
    sm_sizes, (sm_strides,) = collapse([x.shape[d] for d in kept], [x.stride(d) for d in kept])
    # Indices count over the reduced dimensions in row-major order: a merge must keep that order.
    ordered = not indices or (
        all(dims[i] < dims[i + 1] for i in range(len(dims) - 1))
        and _row_major([x.shape[d] for d in dims], [x.stride(d) for d in dims])
    )
    # The output is row-major over the kept dimensions: their merged walk must keep that order.
    ordered = ordered and _row_major([x.shape[d] for d in kept], [x.stride(d) for d in kept])
    if len(sk_sizes) == 1 and len(sm_sizes) == 1 and ordered:
        sm, sk = sm_strides[0], sk_strides[0]
    else:
        x = x.permute(*kept, *dims).contiguous()
        sm, sk = K, 1
    reach = (M - 1) * abs(sm) + (K - 1) * abs(sk) + 1
    problem = ReduceProblem(
        op=int(op),
        M=M,
        K=K,
        sm=sm,
        sk=sk,
        dtype=str(x.dtype).removeprefix("torch."),
        out_dtype=str(out_dtype).removeprefix("torch."),
        indices=indices,
        index_64=reach > 2**31 - 1,
    )
    return x, problem


def _row_major(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether the non-trivial dimensions' strides decrease (a flat walk is row-major order)."""
    s = [st for n, st in zip(shape, strides) if n != 1]
    return all(a >= b for a, b in itertools.pairwise(s))


def _run(x: torch.Tensor, op: ReduceOp, dims: tuple[int, ...], indices: bool, out_dtype: torch.dtype):
    """Values (and int64 indices) of the reduction, shaped as the kept dimensions (no keepdim)."""
    kept_shape = [x.shape[d] for d in range(x.ndim) if d not in dims]
    out = torch.empty(kept_shape, dtype=out_dtype, device=x.device)
    idx = torch.empty(kept_shape, dtype=torch.int64, device=x.device) if indices else out
    if out.numel() == 0:
        return out, idx
    xm, problem = _matrix(x, op, dims, indices, out_dtype)
    if problem.K == 0 and op in _INDEXED:
        raise IndexError(
            f"tdnn.reduce_tensor: cannot take {op.name.lower()} over reduced dimensions of size 0"
        )
    plan = FAMILY.plan(
        (problem,), lambda: problem, lambda: (xm, torch.empty_like(out), xm, torch.empty_like(idx), 1.0)
    )
    plan(xm, out, xm, idx, float(problem.K))
    return out, idx


def _fake(x: torch.Tensor, op: int, dims: list[int], indices: bool, out_dtype: torch.dtype):
    shape = [x.shape[d] for d in range(x.ndim) if d not in dims]
    out = x.new_empty(shape, dtype=out_dtype)
    return out, x.new_empty(shape if indices else [0], dtype=torch.int64)


@custom_op(
    "reduce", "(Tensor x, int op, int[] dims, bool indices, ScalarType out_dtype) -> (Tensor, Tensor)", _fake
)
def _reduce_op(x: torch.Tensor, op: int, dims: list[int], indices: bool, out_dtype: torch.dtype):
    out, idx = _run(x, ReduceOp(op), tuple(dims), indices, out_dtype)
    return out, (idx if indices else x.new_empty([0], dtype=torch.int64))


# ---------------------------------------------------------------------------------------------
# 5. Autograd: gradients are broadcasts and scatters, formed with PyTorch ops.


def _expand(t: torch.Tensor, shape: Sequence[int], dims: tuple[int, ...]) -> torch.Tensor:
    view = list(shape)
    for d in dims:
        view[d] = 1
    return t.reshape(view).expand(*shape)


def _scatter(dy: torch.Tensor, idx: torch.Tensor, x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """dy placed at each row's chosen index (over the reduced dims in row-major order), zero elsewhere."""
    kept = [d for d in range(x.ndim) if d not in dims]
    perm = [*kept, *dims]
    shape = [x.shape[d] for d in perm]
    flat = torch.zeros(
        math.prod(x.shape[d] for d in kept),
        math.prod(x.shape[d] for d in dims),
        dtype=dy.dtype,
        device=dy.device,
    )
    flat.scatter_(1, idx.reshape(-1, 1), dy.reshape(-1, 1))
    return flat.view(shape).permute(*[perm.index(d) for d in range(x.ndim)])


class _ReduceFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, op, dims, out_dtype):
        needs_idx = op in _INDEXED
        out, idx = _reduce_op(x, int(op), list(dims), needs_idx, out_dtype)
        ctx.save_for_backward(x, out, idx if needs_idx else out)
        ctx.params = (op, dims)
        ctx.mark_non_differentiable(idx)
        ctx.set_materialize_grads(False)  # no zeros for the indices' (absent) gradient
        return out, idx

    @staticmethod
    def backward(ctx, dy, _didx):
        if dy is None:
            return (None,) * 4
        x, out, idx = ctx.saved_tensors
        op, dims = ctx.params
        shape = x.shape
        xd = x
        dyx = _expand(dy.to(x.dtype), shape, dims)
        if op == ReduceOp.ADD:
            dx = dyx
        elif op == ReduceOp.AVG:
            dx = dyx / max(1, math.prod(shape[d] for d in dims))
        elif op == ReduceOp.NORM1:
            dx = dyx * torch.sign(xd)
        elif op == ReduceOp.NORM2:
            n = _expand(out.to(x.dtype), shape, dims)
            dx = torch.where(n == 0, 0.0, dyx * xd / n)
        elif op in (ReduceOp.MIN, ReduceOp.MAX):
            dx = _scatter(dy.to(x.dtype), idx, x, dims)
        elif op == ReduceOp.AMAX:
            dx = _scatter(dy.to(x.dtype), idx, x, dims) * torch.sign(xd)
        else:
            prod = _expand(out.to(x.dtype), shape, dims)
            if op == ReduceOp.MUL_NO_ZEROS:
                dx = torch.where(xd == 0, 0.0, dyx * prod / xd)
            else:
                # Zeros: with one zero in a slice, its gradient is the product of the others
                # (mul_no_zeros of the slice); with more, every gradient is 0.
                zeros = _expand((xd == 0).sum(dims), shape, dims)
                nz_prod, _ = _reduce_op(x.detach(), int(ReduceOp.MUL_NO_ZEROS), list(dims), False, x.dtype)
                nz = _expand(nz_prod, shape, dims)
                dx = torch.where(zeros == 0, dyx * prod / torch.where(xd == 0, 1.0, xd), 0.0)
                dx = torch.where((zeros == 1) & (xd == 0), dyx * nz, dx)
        return dx.to(x.dtype), None, None, None


# ---------------------------------------------------------------------------------------------
# 6. Public function.


def reduce_tensor(
    input: torch.Tensor,
    op: str = "add",
    dim: int | Sequence[int] | None = None,
    keepdim: bool = False,
    *,
    return_indices: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """cuDNN's ReduceTensor: reduce ``input`` over ``dim`` with ``op``.

    Args:
        input: fp16/bf16/fp32/fp64 tensor of any shape and strides.
        op: ``"add"``, ``"mul"``, ``"min"``, ``"max"``, ``"amax"`` (max of ``|x|``), ``"avg"``,
            ``"norm1"`` (sum of ``|x|``), ``"norm2"`` (``sqrt(sum(x**2))``) or ``"mul_no_zeros"``.
        dim: a dimension, a sequence of them, or None (or empty) for all.
        keepdim: keep reduced dimensions with size 1.
        return_indices: with ``min``/``max``/``amax``, also return int64 indices of the chosen
            elements over the reduced dimensions flattened in row-major order (lowest on ties).

    The result has ``input``'s dtype and is accumulated in fp32 (fp64 for fp64). Gradients flow to
    ``input`` (min/max/amax: to the chosen element; mul: exact with zeros).
    Raises ``IndexError`` for min/max/amax over an empty dimension, as PyTorch.
    """
    name = "tdnn.reduce_tensor"
    check_tensor(name, "input", input, dtypes=FLOAT_DTYPES)
    check_choice(name, "op", op, OPS)
    kind = ReduceOp[op.upper()]
    if return_indices and kind not in _INDEXED:
        raise ValueError(f"{name}: return_indices=True needs op 'min', 'max' or 'amax', got {op!r}")
    dims = _norm_dims(name, dim, input.ndim)
    if input.requires_grad and torch.is_grad_enabled():
        out, idx = _ReduceFunction.apply(input, kind, dims, input.dtype)
    else:
        out, idx = _reduce_op(input, int(kind), list(dims), kind in _INDEXED and return_indices, input.dtype)
    if keepdim:
        shape = _out_shape(input.shape, dims, True)
        out = out.reshape(shape)
        idx = idx.reshape(shape) if return_indices else idx
    return (out, idx) if return_indices else out


__all__ = ["FAMILY", "OPS", "ReduceOp", "reduce_reference", "reduce_tensor"]
