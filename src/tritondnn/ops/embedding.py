"""Embedding lookup (``F.embedding``): a gather of weight rows forward, a scatter-add of the
output gradient's rows into the weight gradient backward.

PyTorch's CUDA backward of a dense embedding sorts the indices, finds the distinct ones, sums the
rows of each and writes them: about a dozen launches, 0.25 ms of GPT-2 small's training step on
an H200 for 8192 tokens, where the scatter itself moves 25 MB. Here the gradient is a zeroed
fp32 table (fp64 for fp64 gradients) into which one kernel adds each token's row with atomics
(summation order varies between runs where an index repeats), or, with
``tdnn.config.deterministic``, a sort of the indices (``torch.sort``, stable) after which each
run of equal indices is summed by one program in token order, with no atomics: the same bits
every run.

Indices outside [0, num_embeddings) raise ``IndexError`` for host tensors (outside
torch.compile, which cannot branch on values); on a device (which cannot raise, and reading the
indices back would stall every call) their rows come out NaN and they add no gradient.
``max_norm`` renormalizes the weight rows in place first, as PyTorch does; ``scale_grad_by_freq``
and ``sparse`` gradients run PyTorch's ``F.embedding``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..core.checks import FLOAT_DTYPES, check_tensor
from ..core.config import config
from ..core.engine import Engine, Family, LaunchConfig, Problem
from ..core.launcher import cdiv, launcher
from ..core.library import custom_op

OP = "tdnn.embedding"
INDEX_DTYPES = (torch.int64, torch.int32)

# ---------------------------------------------------------------------------------------------
# 1. Reference.


def embedding_reference(
    input: torch.Tensor, weight: torch.Tensor, padding_idx: int | None = None
) -> torch.Tensor:
    """PyTorch's ``F.embedding`` in float64: the meaning of the op (and of its gradient)."""
    return F.embedding(input, weight.double(), padding_idx)


# ---------------------------------------------------------------------------------------------
# 2. Kernels. Tokens are the flattened indices; a weight row is ``dim`` elements at unit stride,
# rows ``w_row`` apart; the output and its gradient are (tokens, dim) at row stride ``dim``
# (the output) or ``g_row`` (the gradient, unit column stride).


@triton.jit
def _gather_kernel(
    idx_ptr, w_ptr, out_ptr, n_tokens, dim, num_embeddings, w_row,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """out[t, :] = w[idx[t], :] for BLOCK_T tokens and BLOCK_D columns a program; NaN for an
    index out of range. Grid: (token blocks, column blocks)."""
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    t_ok = t < n_tokens
    i = tl.load(idx_ptr + t, mask=t_ok, other=0).to(tl.int64)
    inside = (i >= 0) & (i < num_embeddings)
    mask = t_ok[:, None] & (d < dim)[None, :]
    row = tl.load(w_ptr + (i * w_row)[:, None] + d[None, :], mask=mask & inside[:, None], other=float("nan"))
    tl.store(out_ptr + t[:, None] * dim + d[None, :], row, mask=mask)


@triton.jit
def _scatter_add_kernel(
    idx_ptr, g_ptr, dw_ptr, n_tokens, dim, num_embeddings, g_row, padding_idx,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """dw[idx[t], :] += g[t, :] (atomics in dw's dtype) for BLOCK_T tokens and BLOCK_D columns a
    program; tokens at ``padding_idx`` or out of range add nothing. dw: (num_embeddings, dim),
    fp32 (fp64 for fp64 gradients)."""
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    t_ok = t < n_tokens
    i = tl.load(idx_ptr + t, mask=t_ok, other=0).to(tl.int64)
    adds = t_ok & (i >= 0) & (i < num_embeddings) & (i != padding_idx)
    mask = adds[:, None] & (d < dim)[None, :]
    g = tl.load(g_ptr + t[:, None] * g_row + d[None, :], mask=mask, other=0.0)
    acc = dw_ptr.dtype.element_ty
    tl.atomic_add(dw_ptr + (i * dim)[:, None] + d[None, :], g.to(acc), mask=mask, sem="relaxed")


@triton.jit
def _segment_sum_kernel(
    sorted_ptr, order_ptr, g_ptr, dw_ptr, n_tokens, dim, num_embeddings, g_row, padding_idx,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Deterministic: the program at a sorted position where a run of equal indices starts sums
    the run's gradient rows in token order (``order``: the stable sort's permutation) and stores
    dw[index, :]; the other programs end at once. Grid: (tokens, column blocks)."""
    pos = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < dim
    i = tl.load(sorted_ptr + pos).to(tl.int64)
    before = tl.load(sorted_ptr + pos - 1, mask=pos > 0, other=-1).to(tl.int64)
    starts = (pos == 0) | (before != i)
    if starts & (i >= 0) & (i < num_embeddings) & (i != padding_idx):
        acc = tl.zeros([BLOCK_D], dw_ptr.dtype.element_ty)
        j = pos
        at = i
        while at == i:
            token = tl.load(order_ptr + j).to(tl.int64)
            acc += tl.load(g_ptr + token * g_row + d, mask=d_ok, other=0.0).to(acc.dtype)
            j += 1
            at = tl.load(sorted_ptr + j, mask=j < n_tokens, other=-1).to(tl.int64)
        tl.store(dw_ptr + i * dim + d, acc, mask=d_ok)


# ---------------------------------------------------------------------------------------------
# 3. Engines.


@dataclasses.dataclass(frozen=True)
class EmbeddingProblem(Problem):
    """Forward: (indices, weight, out), ``row_stride`` the weight's; backward: (indices, grad, dw)
    and, deterministic, (sorted indices, order, grad, dw), ``row_stride`` the gradient's and
    ``dtype`` its dtype."""

    backward: bool
    dtype: str
    n_tokens: int
    dim: int
    num_embeddings: int
    row_stride: int
    padding_idx: int
    deterministic: bool


def _describe(
    input: torch.Tensor, weight: torch.Tensor, backward: bool = False, padding_idx: int = -1
) -> EmbeddingProblem:
    """The problem ``embedding(input, weight)`` poses, or its weight gradient's (from a contiguous
    output gradient in weight's dtype)."""
    rows, dim = weight.shape
    return EmbeddingProblem(
        backward,
        str(weight.dtype).removeprefix("torch."),
        input.numel(),
        dim,
        rows,
        dim if backward else weight.stride(0),
        padding_idx,
        config.deterministic if backward else False,
    )


FAMILY: Family[EmbeddingProblem] = Family("embedding", _describe)


def _tiles(problem: EmbeddingProblem) -> list[LaunchConfig]:
    """Token x column tiles of 2-4K elements; columns no wider than a row needs."""
    block_d = min(256, triton.next_power_of_2(problem.dim))
    out = []
    for elements, warps in ((4096, 4), (2048, 4), (8192, 8)):
        block_t = min(max(1, elements // block_d), triton.next_power_of_2(problem.n_tokens))
        config = {"BLOCK_T": block_t, "BLOCK_D": block_d, "num_warps": warps}
        if config not in out:
            out.append(config)
    return out


class _TiledEngine(Engine[EmbeddingProblem]):
    """A tile of tokens and columns a program, over ``kernel``: its ints are the problem's
    sizes and row stride, and for the backward the padding index."""

    kernel: Any

    def cost(self, problem: EmbeddingProblem) -> float:
        return 1.0

    def configs(self, problem: EmbeddingProblem) -> list[LaunchConfig]:
        return _tiles(problem)

    def bind(self, problem: EmbeddingProblem, config: LaunchConfig) -> Callable[..., None]:
        block_t, block_d = config["BLOCK_T"], config["BLOCK_D"]
        sizes = (problem.n_tokens, problem.dim, problem.num_embeddings, problem.row_stride)
        return launcher(
            type(self).kernel,
            (cdiv(problem.n_tokens, block_t), cdiv(problem.dim, block_d)),
            num_tensors=3,
            ints=(*sizes, problem.padding_idx) if problem.backward else sizes,
            constexprs=(block_t, block_d),
            num_warps=config["num_warps"],
        )


@FAMILY.register
class GatherEngine(_TiledEngine):
    """Forward: weight rows copied to the output."""

    name = "gather"
    kernel = _gather_kernel

    def not_supported_reasons(self, problem: EmbeddingProblem) -> list[str]:
        return ["computes the forward only"] if problem.backward else []


@FAMILY.register
class AtomicScatterEngine(_TiledEngine):
    """Weight gradient: each token's gradient row added into its weight row with atomics."""

    name = "atomic-scatter"
    kernel = _scatter_add_kernel

    def not_supported_reasons(self, problem: EmbeddingProblem) -> list[str]:
        if not problem.backward:
            return ["computes the weight gradient only"]
        if problem.deterministic:
            return ["tdnn.config.deterministic is set (atomics add in any order)"]
        return []


@FAMILY.register
class SortedSegmentsEngine(Engine[EmbeddingProblem]):
    """Weight gradient, deterministic: the indices sorted (stable), then each run of equal
    indices summed in token order by one program; no atomics."""

    name = "sorted-segments"

    def not_supported_reasons(self, problem: EmbeddingProblem) -> list[str]:
        return [] if problem.backward else ["computes the weight gradient only"]

    def cost(self, problem: EmbeddingProblem) -> float:
        return 4.0  # a sort, and one program a token

    def configs(self, problem: EmbeddingProblem) -> list[LaunchConfig]:
        block_d = min(1024, triton.next_power_of_2(problem.dim))
        return [{"BLOCK_D": block_d, "num_warps": max(1, min(8, block_d // 256))}]

    def bind(self, problem: EmbeddingProblem, config: LaunchConfig) -> Callable[..., None]:
        block_d = config["BLOCK_D"]
        run = launcher(
            _segment_sum_kernel,
            (problem.n_tokens, cdiv(problem.dim, block_d)),
            num_tensors=4,
            ints=(
                problem.n_tokens,
                problem.dim,
                problem.num_embeddings,
                problem.row_stride,
                problem.padding_idx,
            ),
            constexprs=(block_d,),
            num_warps=config["num_warps"],
        )

        def scatter(idx: torch.Tensor, g: torch.Tensor, dw: torch.Tensor) -> None:
            ordered, order = torch.sort(idx, stable=True)
            run(ordered, order, g, dw)

        return scatter


# ---------------------------------------------------------------------------------------------
# 4. torch.library ops and autograd.


def _fake_forward(input: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight.new_empty(*input.shape, weight.shape[1])


@custom_op("embedding", "(Tensor input, Tensor weight) -> Tensor", _fake_forward)
def _forward(input: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Rows of ``weight`` (unit column stride) picked by the flat, contiguous ``input``."""
    out = _fake_forward(input, weight)
    if out.numel():
        idx = input.reshape(-1)
        key = (False, idx.dtype, idx.numel(), weight.shape, weight.stride(0), weight.dtype)
        args = (idx, weight, out)
        FAMILY.plan(key, lambda: _describe(idx, weight), lambda: args)(*args)
    return out


def _accumulator(grad: torch.Tensor) -> torch.dtype:
    return torch.float64 if grad.dtype == torch.float64 else torch.float32


def _fake_backward(
    grad: torch.Tensor, input: torch.Tensor, num_embeddings: int, padding_idx: int
) -> torch.Tensor:
    return grad.new_empty(num_embeddings, grad.shape[-1], dtype=_accumulator(grad))


@custom_op(
    "embedding_backward",
    "(Tensor grad, Tensor input, int num_embeddings, int padding_idx) -> Tensor",
    _fake_backward,
)
def _backward(grad: torch.Tensor, input: torch.Tensor, num_embeddings: int, padding_idx: int) -> torch.Tensor:
    """The weight gradient, fp32 (fp64 for an fp64 ``grad``): ``grad`` (*input.shape, dim) summed
    into rows by index."""
    dim = grad.shape[-1]
    dw = torch.zeros(num_embeddings, dim, dtype=_accumulator(grad), device=grad.device)
    g = grad.reshape(-1, dim)
    if g.stride(-1) != 1:
        g = g.contiguous()
    idx = input.reshape(-1)
    if idx.numel() and dim:
        deterministic = config.deterministic
        key = (True, deterministic, idx.dtype, idx.numel(), dw.shape, g.dtype, g.stride(0), padding_idx)
        dtype = str(g.dtype).removeprefix("torch.")
        problem = lambda: EmbeddingProblem(
            True, dtype, idx.numel(), dim, num_embeddings, g.stride(0), padding_idx, deterministic
        )
        # Timed (benchmark mode) into a scratch table: the atomic engine adds to what is there.
        plan = FAMILY.plan(key, problem, lambda: (idx, g, torch.zeros_like(dw)))
        plan(idx, g, dw)
    return dw


class _EmbeddingFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, padding_idx):
        ctx.save_for_backward(input)
        ctx.num_embeddings, ctx.padding_idx, ctx.dtype = weight.shape[0], padding_idx, weight.dtype
        return _forward(input, weight)

    @staticmethod
    def backward(ctx, grad):
        (input,) = ctx.saved_tensors
        dw = _backward(grad, input, ctx.num_embeddings, ctx.padding_idx)
        return None, dw.to(ctx.dtype), None


# ---------------------------------------------------------------------------------------------
# 5. Public function.


def embedding(
    input: torch.Tensor,
    weight: torch.Tensor,
    padding_idx: int | None = None,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
) -> torch.Tensor:
    """``F.embedding``: the rows of ``weight`` that ``input`` indexes.

    Args:
        input: int64 or int32 indices, any shape.
        weight: (num_embeddings, dim) fp16/bf16/fp32/fp64 table.
        padding_idx: an index whose rows get no gradient (negative counts from the end).
        max_norm, norm_type: rows looked up are first rescaled in place to at most this norm.
        scale_grad_by_freq, sparse: as PyTorch's (those calls run ``F.embedding``).

    Returns (*input.shape, dim) in weight's dtype. The weight gradient is summed in fp32 (fp64 for
    fp64) and returned in weight's dtype; see the module docstring for the order of that sum and for
    indices out of range.
    """
    check_tensor(OP, "input", input, dtypes=INDEX_DTYPES)
    check_tensor(OP, "weight", weight, dtypes=FLOAT_DTYPES, min_ndim=2, max_ndim=2)
    if input.device != weight.device:
        raise ValueError(f"{OP}: argument 'input' is on {input.device}, 'weight' on {weight.device}")
    num_embeddings = weight.shape[0]
    if padding_idx is not None:
        if not -num_embeddings <= padding_idx < num_embeddings:
            raise ValueError(f"{OP}: argument 'padding_idx'={padding_idx} must be within num_embeddings")
        padding_idx %= num_embeddings
    if scale_grad_by_freq or sparse:
        return F.embedding(input, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse)
    if input.device.type == "cpu" and input.numel() and not torch.compiler.is_compiling():
        low, high = int(input.min()), int(input.max())
        if low < 0 or high >= num_embeddings:
            bad = low if low < 0 else high
            raise IndexError(f"{OP}: index {bad} is out of range for {num_embeddings} rows")
    input = input.contiguous()
    if max_norm is not None:
        with torch.no_grad():
            torch.embedding_renorm_(weight, input, max_norm, norm_type)
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    padding = -1 if padding_idx is None else padding_idx
    if weight.requires_grad and torch.is_grad_enabled():
        return _EmbeddingFunction.apply(input, weight, padding)
    return _forward(input, weight)


__all__ = ["FAMILY", "embedding", "embedding_reference"]
