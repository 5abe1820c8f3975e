"""Tensor reductions over any set of dimensions: cuDNN's ReduceTensor.

Operations (cuDNN's names): ``add`` (sum), ``mul`` (product), ``min``, ``max``, ``amax`` (max of
absolute values), ``avg`` (mean), ``norm1`` (sum of absolute values), ``norm2`` (Euclidean norm),
``mul_no_zeros`` (product of the non-zero elements); ``min``, ``max`` and ``amax`` can also return
the index of the chosen element.

The reduced dimensions and the kept dimensions are each merged (``core.strides.collapse``); when
both merge into one the input is read in place as an (M kept, K reduced) strided matrix, otherwise
it is first permuted to that form by a copy. A program reduces a tile of rows with fp32 (fp64)
accumulators per lane, so rows along the contiguous dimension and columns (reductions over an
outer dimension) both load coalesced. Few long rows are split over several programs, each writing
a partial result, and a second launch combines them in a fixed order: the result has the same bits
on every run (no atomics), in and out of ``tdnn.config.deterministic``.

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
    chunk,
    PRE: tl.constexpr,
    COMBINE: tl.constexpr,
    POST: tl.constexpr,
    HAS_IDX_IN: tl.constexpr,
    WRITE_IDX: tl.constexpr,
    ACC: tl.constexpr,
    INDEX_64: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[m * S + s] = combine over k in [s * chunk, min((s + 1) * chunk, K)) of pre(x[m*sm + k*sk]).

    S = the grid's second extent (1 without splitting). count: the divisor of POST == 1 (float).
    idx_in: int64 indices of the x values (the partials of a first pass) when HAS_IDX_IN; else an
    element's index is its k. idx_out: int64 index of the chosen element (min/max) when WRITE_IDX.
    Accumulators are per lane ([BLOCK_M, BLOCK_K]) and reduced across lanes once at the end.
    """
    pid_m = tl.program_id(0)
    split = tl.program_id(1)
    n_split = tl.num_programs(1)
    if INDEX_64:
        pid_m = pid_m.to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    cols = tl.arange(0, BLOCK_K)
    k_start = split * chunk
    k_end = tl.minimum(k_start + chunk, K)
    if COMBINE == 0:
        acc = tl.zeros([BLOCK_M, BLOCK_K], ACC)
    elif COMBINE == 1:
        acc = tl.full([BLOCK_M, BLOCK_K], 1.0, ACC)
    elif COMBINE == 2:
        acc = tl.full([BLOCK_M, BLOCK_K], float("inf"), ACC)
    else:
        acc = tl.full([BLOCK_M, BLOCK_K], -float("inf"), ACC)
    best = tl.full([BLOCK_M, BLOCK_K], 2**62, tl.int64)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + cols
        mask = row_mask[:, None] & (k < k_end)[None, :]
        offs = rows[:, None] * sm + k[None, :].to(rows.dtype) * sk
        if COMBINE == 0:
            x = _pre(convert(tl.load(x_ptr + offs, mask=mask, other=0.0), ACC), PRE)
            acc += tl.where(mask, x, 0.0)
        elif COMBINE == 1:
            x = _pre(convert(tl.load(x_ptr + offs, mask=mask, other=1.0), ACC), PRE)
            acc *= tl.where(mask, x, 1.0)
        else:
            x = _pre(convert(tl.load(x_ptr + offs, mask=mask, other=0.0), ACC), PRE)
            if HAS_IDX_IN:
                xi = tl.load(idx_in_ptr + offs, mask=mask, other=2**62)
            else:
                xi = tl.broadcast_to(k[None, :].to(tl.int64), [BLOCK_M, BLOCK_K])
            # A later element replaces the lane's choice only when strictly better, or when it is
            # NaN and the choice is not: the first NaN (then the lowest index) wins, as in PyTorch.
            x_nan = x != x
            acc_nan = acc != acc
            if COMBINE == 2:
                better = x < acc
            else:
                better = x > acc
            take = mask & ((better & ~acc_nan) | (x_nan & ~acc_nan))
            acc = tl.where(take, x, acc)
            best = tl.where(take, xi, best)
    if COMBINE == 0:
        result = tl.sum(acc, 1)
    elif COMBINE == 1:
        result = tl.reduce(acc, 1, _multiply)
    else:
        # tl.max/tl.min may drop NaN on a GPU: reduce with NaN set aside, then put it back.
        is_nan = acc != acc
        has_nan = tl.max(is_nan.to(tl.int32), 1) > 0
        if COMBINE == 2:
            result = tl.min(tl.where(is_nan, float("inf"), acc), 1)
        else:
            result = tl.max(tl.where(is_nan, -float("inf"), acc), 1)
        chosen = tl.where(has_nan[:, None], is_nan, acc == result[:, None])
        result = tl.where(has_nan, float("nan"), result)
        if WRITE_IDX:
            index = tl.min(tl.where(chosen, best, 2**62), 1)
            # A row of only masked lanes (possible only for empty splits) points at 0.
            index = tl.where(index == 2**62, 0, index)
            tl.store(idx_out_ptr + rows * n_split + split, index, mask=row_mask)
    if POST == 1:
        result = result / count
    elif POST == 2:
        result = tl.sqrt(result)
    tl.store(out_ptr + rows * n_split + split, convert(result, out_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def _multiply(a, b):
    return a * b


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


@FAMILY.register
class TileEngine(Engine[ReduceProblem]):
    """Every row reduced by one program, over [BLOCK_M, BLOCK_K] tiles: one read of the input."""

    name = "tile"

    def cost(self, problem: ReduceProblem) -> float:
        # Few rows leave most of the GPU idle: the split engine takes over.
        return 1.0 if problem.M >= 512 or problem.K <= 4096 else 4.0

    def configs(self, problem: ReduceProblem) -> list[LaunchConfig]:
        if problem.sm == 1 and problem.sk != 1:  # columns: neighbouring rows are neighbours in memory
            shapes = [(128, 16, 4), (256, 8, 4), (64, 32, 4)]
        else:
            bk = min(triton.next_power_of_2(max(problem.K, 1)), 2048)
            shapes = [(max(1, 2048 // bk), bk, 4 if bk <= 1024 else 8), (max(1, 4096 // bk), bk, 8)]
        out = []
        for bm, bk, w in shapes:
            cfg = {"BLOCK_M": min(bm, triton.next_power_of_2(problem.M)), "BLOCK_K": bk, "num_warps": w}
            if cfg not in out:
                out.append(cfg)
        return out

    def bind(self, problem: ReduceProblem, config: LaunchConfig) -> Callable[..., None]:
        return _launch(problem, config, 1)


@FAMILY.register
class SplitEngine(Engine[ReduceProblem]):
    """Few long rows: each split over up to 512 programs writing fp32 (fp64) partials, which a second
    launch combines in order (no atomics, the same bits every run)."""

    name = "split"

    def not_supported_reasons(self, problem: ReduceProblem) -> list[str]:
        if problem.K < 8192:
            return [f"rows of {problem.K} elements are short enough for one program"]
        return []

    def cost(self, problem: ReduceProblem) -> float:
        return 2.0

    def configs(self, problem: ReduceProblem) -> list[LaunchConfig]:
        return [{"CHUNK": 8192}, {"CHUNK": 16384}, {"CHUNK": 4096}]

    def bind(self, problem: ReduceProblem, config: LaunchConfig) -> Callable[..., None]:
        chunk = config["CHUNK"]
        splits = min(cdiv(problem.K, chunk), 512)
        chunk = cdiv(cdiv(problem.K, splits), 1024) * 1024
        splits = cdiv(problem.K, chunk)
        acc_dtype = "float64" if problem.dtype == "float64" else "float32"
        first = dataclasses.replace(problem, out_dtype=acc_dtype)
        # Columns: rows side by side (coalesced), as many reduced elements as fill a 2K tile.
        bm = min(triton.next_power_of_2(problem.M), 1 if problem.sk == 1 else 128)
        bk = 1024 if problem.sk == 1 else max(16, 2048 // bm)
        stage1 = _launch(first, {"BLOCK_M": bm, "BLOCK_K": bk, "num_warps": 4}, splits, chunk=chunk, post=0)
        second = dataclasses.replace(problem, K=splits, sm=splits, sk=1, dtype=acc_dtype)
        # The second pass combines partials: already transformed (no PRE), indices from idx_in.
        bk2 = triton.next_power_of_2(splits)
        stage2 = _launch(
            second,
            {
                "BLOCK_M": max(1, min(triton.next_power_of_2(problem.M), 2048 // bk2)),
                "BLOCK_K": bk2,
                "num_warps": 4,
            },
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
    chunk: int | None = None,
    post: int | None = None,
    pre: int | None = None,
    has_idx_in: bool = False,
) -> Callable[..., None]:
    """A launch taking (x, out, idx_in, idx_out, count)."""
    p_pre, combine, p_post = _PLAN[ReduceOp(problem.op)]
    bm = config["BLOCK_M"]
    return launcher(
        _reduce_kernel,
        (cdiv(max(problem.M, 1), bm), splits),
        num_tensors=4,
        ints=(problem.M, problem.K, problem.sm, problem.sk, problem.K if chunk is None else chunk),
        constexprs=(
            p_pre if pre is None else pre,
            combine,
            p_post if post is None else post,
            has_idx_in,
            problem.indices,
            tl.float64 if problem.dtype == "float64" else tl.float32,
            problem.index_64,
            bm,
            config["BLOCK_K"],
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
        index_64=max(reach, M * 512) > 2**31 - 1,
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
        return out, idx

    @staticmethod
    def backward(ctx, dy, _didx):
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
