"""Cross entropy over class logits (``F.cross_entropy``), fused: one read of the logits forward,
one read and one write of their gradient backward.

PyTorch computes ``cross_entropy`` as ``log_softmax`` (which writes a log-probability tensor as
large as the logits) then ``nll_loss``; its backward zero-fills a gradient of that size, scatters
the targets into it, and runs ``log_softmax``'s backward over both. A language model's head makes
this large: 8192 tokens over a 50257-word vocabulary is 1.6 GB of fp32 logits, each pass over
which costs about as much as a layer's matmul. Here each row's maximum and log-sum-exp come from
one online pass (a running maximum and a sum rescaled to it) and are all the backward keeps: it
recomputes the probabilities from the logits and writes the gradient in one pass. The two are
kept apart, not as their sum, so ``x - max`` stays exact for large logits (1e4 in fp32: their sum
would be rounded to 1e-3 and every probability with it).

Targets are class indices. Probability targets (a float tensor shaped like the input) take a
composed path, ``tdnn.log_softmax`` and a weighted sum, with PyTorch's meaning. Arithmetic is
fp32 (fp64 for fp64 logits) whatever the logits' dtype, so bf16 logits need no cast first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..core.checks import FLOAT_DTYPES, check_choice, check_float, check_tensor
from ..core.engine import Engine, Family, LaunchConfig, Problem
from ..core.launcher import cdiv, launcher
from ..core.library import custom_op
from ..core.numerics import convert, online_exp_sum
from ..core.strides import empty_aligned_rows
from .softmax import log_softmax

OP = "tdnn.cross_entropy"
REDUCTIONS = ("none", "mean", "sum")

# ---------------------------------------------------------------------------------------------
# 1. Reference.


def cross_entropy_reference(
    input: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """PyTorch's ``F.cross_entropy`` in float64: the meaning of the op."""
    if target.is_floating_point():
        target = target.double()
    weight = weight.double() if weight is not None else None
    return F.cross_entropy(
        input.double(),
        target,
        weight,
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=label_smoothing,
    )


# ---------------------------------------------------------------------------------------------
# 2. Kernels. Rows are the (rows, classes) view of the logits, each with a row and a class stride.
# Per row, with m the row's maximum and l = log(sum_c exp(x[c] - m)): ``nll = w[t] * (m - x[t] +
# l)`` and, with label smoothing, ``smooth = sum_c w[c] * (m - x[c] + l) = A + W * l`` where A =
# sum_c w[c] * (m - x[c]) (kept online: a sum of non-negative terms, rescaled when m grows, with
# no cancellation) and W is the sum of the class weights, or the class count. Rows whose target
# is ``ignore_index`` give zeros; a target outside [0, classes) gives NaN (a device cannot raise;
# a NaN loss cannot go unnoticed, and no memory is read for it).


@triton.jit
def _target_terms(
    t_ptr, w_ptr, rows, row_mask, n_cols, ignore_index, HAS_WEIGHT: tl.constexpr, ACC: tl.constexpr
):
    """(the row's target clamped into range, whether the row counts, whether its target is in
    range, the target's class weight)."""
    t = tl.load(t_ptr + rows, mask=row_mask, other=ignore_index)
    counted = row_mask & (t != ignore_index)
    inside = (t >= 0) & (t < n_cols)
    t_safe = tl.where(counted & inside, t, 0)
    if HAS_WEIGHT:
        w_t = convert(tl.load(w_ptr + t_safe, mask=counted & inside, other=0.0), ACC)
    else:
        w_t = tl.full(t.shape, 1.0, ACC)
    return t_safe, counted, inside, w_t


@triton.jit
def _forward_kernel(
    x_ptr, t_ptr, w_ptr, loss_ptr, stats_ptr,
    n_rows, n_cols, ignore_index, xs_row, xs_col,
    HAS_WEIGHT: tl.constexpr, SMOOTH: tl.constexpr, ACC: tl.constexpr, INDEX_64: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Per row of BLOCK_R rows a program: ``loss[0, row] = nll``, ``loss[1, row] = smooth`` (with
    SMOOTH), ``stats[:, row] = (m, l)``. x: (n_rows, n_cols) logits of any float dtype; t:
    (n_rows,) int64 targets; w: (n_cols,) class weights in ACC (HAS_WEIGHT); loss: (1 or 2,
    n_rows) and stats: (2, n_rows) in ACC (fp32, or fp64 for fp64)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    if INDEX_64:
        rows = rows.to(tl.int64)
    row_mask = rows < n_rows
    x_rows = x_ptr + rows[:, None] * xs_row
    cols = tl.arange(0, BLOCK_N)[None, :]
    m = tl.full([BLOCK_R], -float("inf"), ACC)
    s = tl.zeros([BLOCK_R], ACC)
    below_max = tl.zeros([BLOCK_R], ACC)  # A over the classes seen, against the running maximum
    seen_weight = tl.zeros([BLOCK_R], ACC)
    for start in range(0, n_cols, BLOCK_N):
        c = start + cols
        mask = row_mask[:, None] & (c < n_cols)
        x = convert(tl.load(x_rows + c * xs_col, mask=mask, other=-float("inf")), ACC)
        m_new, s = online_exp_sum(m, s, x)
        if SMOOTH:
            if HAS_WEIGHT:
                w = tl.load(w_ptr + c, mask=c < n_cols, other=0.0)
            else:
                w = tl.where(c < n_cols, 1.0, 0.0).to(ACC)
            grown = tl.where(seen_weight > 0, seen_weight * (m_new - m), 0.0)
            below_max += grown + tl.sum(tl.where(mask, w * (m_new[:, None] - x), 0.0), 1)
            seen_weight += tl.sum(tl.where(mask, w, 0.0), 1)
        m = m_new
    log_sum = tl.log(s)
    t_safe, counted, inside, w_t = _target_terms(
        t_ptr, w_ptr, rows, row_mask, n_cols, ignore_index, HAS_WEIGHT, ACC
    )
    x_t = convert(tl.load(x_ptr + rows * xs_row + t_safe * xs_col, mask=counted & inside, other=0.0), ACC)
    nan = float("nan")
    nll = tl.where(counted, tl.where(inside, w_t * (m - x_t + log_sum), nan), 0.0)
    tl.store(loss_ptr + rows, nll, mask=row_mask)
    tl.store(stats_ptr + rows, m, mask=row_mask)
    tl.store(stats_ptr + n_rows + rows, log_sum, mask=row_mask)
    if SMOOTH:
        smooth = tl.where(counted, tl.where(inside, below_max + seen_weight * log_sum, nan), 0.0)
        tl.store(loss_ptr + n_rows + rows, smooth, mask=row_mask)


@triton.jit
def _backward_kernel(
    x_ptr, t_ptr, w_ptr, wsum_ptr, stats_ptr, g_ptr, dx_ptr,
    n_rows, n_cols, ignore_index, xs_row, xs_col, ds_row, ds_col,
    HAS_WEIGHT: tl.constexpr, SMOOTH: tl.constexpr, ACC: tl.constexpr, INDEX_64: tl.constexpr,
    VECTOR: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """dx[row, c] = p[c] * (a + b * W) - a * [c == t] - b * w[c], with p = exp(x - m - l), a =
    g_nll * w[t] and b = g_smooth (the gradients of the forward's two rows, g: (1 or 2, n_rows)
    in ACC, contiguous); wsum: W, one element (HAS_WEIGHT and SMOOTH); other arguments as the
    forward's, dx shaped as x. VECTOR > 1: dx starts on 16 bytes, its rows are a multiple of
    VECTOR elements apart and padded to whole vectors of VECTOR elements, which are stored whole
    (the padding as zeros): Triton knows only strides that are multiples of 16 elements, so
    rows 50264 apart (GPT-2's padded 50257 classes) would be stored one element at a time."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    if INDEX_64:
        rows = rows.to(tl.int64)
    row_mask = rows < n_rows
    t_safe, counted, inside, w_t = _target_terms(
        t_ptr, w_ptr, rows, row_mask, n_cols, ignore_index, HAS_WEIGHT, ACC
    )
    nan = float("nan")
    m = tl.load(stats_ptr + rows, mask=row_mask, other=0.0)
    log_sum = tl.load(stats_ptr + n_rows + rows, mask=row_mask, other=0.0)
    a = tl.where(counted, tl.where(inside, tl.load(g_ptr + rows, mask=row_mask, other=0.0) * w_t, nan), 0.0)
    coef = a
    if SMOOTH:
        b = tl.where(
            counted, tl.where(inside, tl.load(g_ptr + n_rows + rows, mask=row_mask, other=0.0), nan), 0.0
        )
        if HAS_WEIGHT:
            total = convert(tl.load(wsum_ptr), ACC)
        else:
            total = tl.full([BLOCK_R], 1.0, ACC) * n_cols  # (n_cols may be a constexpr: 1)
        coef += b * total
    x_rows = x_ptr + rows[:, None] * xs_row
    if VECTOR > 1:
        d_rows = dx_ptr + tl.multiple_of(rows * ds_row, VECTOR)[:, None]
        width = tl.multiple_of((n_cols + VECTOR - 1) // VECTOR * VECTOR, VECTOR)
    else:
        d_rows = dx_ptr + rows[:, None] * ds_row
    cols = tl.arange(0, BLOCK_N)[None, :]
    for start in range(0, n_cols, BLOCK_N):
        c = start + cols
        mask = row_mask[:, None] & (c < n_cols)
        x = convert(tl.load(x_rows + c * xs_col, mask=mask, other=0.0), ACC)
        p = tl.exp(x - m[:, None] - log_sum[:, None])
        dx = p * coef[:, None] - tl.where(c == t_safe[:, None], a[:, None], 0.0)
        if SMOOTH:
            if HAS_WEIGHT:
                dx -= b[:, None] * tl.load(w_ptr + c, mask=c < n_cols, other=0.0)
            else:
                dx -= b[:, None]
        if VECTOR > 1:
            dx = tl.where(mask, dx, 0.0)
            mask = row_mask[:, None] & (c < width)
        tl.store(d_rows + c * ds_col, convert(dx, dx_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------
# 3. Engine.


@dataclasses.dataclass(frozen=True)
class CrossEntropyProblem(Problem):
    """One launch over ``n_rows`` rows of ``n_cols`` classes. Tensors in launch order: forward
    ``(x, target, weight, loss, stats)``, backward ``(x, target, weight, weight_sum, stats,
    grad, dx)`` (absent weights passed as ``x``)."""

    backward: bool
    dtype: str
    n_rows: int
    n_cols: int
    x_strides: tuple[int, int]
    dx_strides: tuple[int, int]
    weighted: bool
    smoothing: bool
    ignore_index: int
    index_64: bool
    dx_vectors: bool = False


def _whole_vectors(dx: torch.Tensor, n_cols: int) -> bool:
    """Whether the gradient ``dx``'s (rows, classes) matrix can be stored in whole 16-byte
    vectors: unit class stride, starting on 16 bytes, rows a whole number of vectors apart and
    padded to whole vectors (the padding inside its storage, which is written)."""
    size = dx.element_size()
    vector = 16 // size
    if dx.device.type == "meta" or vector == 1 or dx.stride(1) != 1 or dx.data_ptr() % 16:
        return False
    n_rows, row = dx.shape[0], dx.stride(0)
    width = -(-n_cols // vector) * vector
    if row % vector or row < width:
        return False
    storage = dx.untyped_storage()
    end = dx.data_ptr() + ((n_rows - 1) * row + width) * size
    return end <= storage.data_ptr() + storage.nbytes()


def _problem(
    backward: bool,
    x: torch.Tensor,
    weighted: bool,
    smoothing: bool,
    ignore_index: int,
    dx: torch.Tensor | None,
) -> CrossEntropyProblem:
    n_rows, n_cols = x.shape
    reach = (n_rows - 1) * abs(x.stride(0)) + (n_cols - 1) * abs(x.stride(1)) + 1
    if dx is not None:  # the gradient's padded rows reach further (and its vectors to 16 bytes)
        reach = max(reach, (n_rows - 1) * abs(dx.stride(0)) + (n_cols - 1) * abs(dx.stride(1)) + 16)
    return CrossEntropyProblem(
        backward=backward,
        dtype=str(x.dtype).removeprefix("torch."),
        n_rows=n_rows,
        n_cols=n_cols,
        x_strides=(x.stride(0), x.stride(1)),
        dx_strides=(dx.stride(0), dx.stride(1)) if dx is not None else (0, 0),
        weighted=weighted,
        smoothing=smoothing,
        ignore_index=ignore_index,
        index_64=max(reach, x.numel()) > 2**31 - 1,
        dx_vectors=dx is not None and _whole_vectors(dx, n_cols),
    )


def _describe(input: torch.Tensor, backward: bool = False) -> CrossEntropyProblem:
    """The problem ``cross_entropy`` on the (rows, classes) logits ``input`` poses (unweighted,
    no smoothing, the default ignore_index), or its backward with a gradient shaped as the input."""
    return _problem(backward, input, False, False, -100, torch.empty_like(input) if backward else None)


FAMILY: Family[CrossEntropyProblem] = Family("cross_entropy", _describe)


@FAMILY.register
class OnlineRowEngine(Engine[CrossEntropyProblem]):
    """Rows in blocks of classes: a running maximum and rescaled sum forward (one read of the
    logits); the probabilities recomputed from them and the log-sum-exp backward (one read, one
    write). Short rows go several to a program."""

    name = "online-row"

    def cost(self, problem: CrossEntropyProblem) -> float:
        return 1.0

    def configs(self, problem: CrossEntropyProblem) -> list[LaunchConfig]:
        width = triton.next_power_of_2(problem.n_cols)
        vectors = [problem.dx_vectors and width >= 4096, False] if problem.backward else [False]
        if width >= 4096:
            # A vocabulary-sized row: one row a program, blocks of 4K-8K classes; 16 warps keep 8 or
            # 16 values a thread in flight.
            shapes = [(1, 4096, 8), (1, 8192, 16), (1, 4096, 16), (1, 2048, 8)]
            if vectors[0]:
                # H200, 8192 x 50257 bf16 (GPT-2 small's), do_bench medians: 539.7 us as the
                # first shape, 525.0 in 16 warps, 472.2 so storing dx in vectors (3.5 TB/s).
                shapes.insert(0, shapes.pop(2))
        else:
            rows = max(1, min(64, 2048 // width))
            warps = max(1, min(8, rows * width // 256))
            shapes = [
                (rows, width, warps),
                (rows * 2, width, min(8, warps * 2)),
                (rows, width, max(1, warps // 2)),
            ]
        out = []
        for vector in dict.fromkeys(vectors):
            for block_r, block_n, warps in shapes:
                config = {
                    "BLOCK_R": min(block_r, triton.next_power_of_2(problem.n_rows)),
                    "BLOCK_N": block_n,
                    "VECTOR": 16 // getattr(torch, problem.dtype).itemsize if vector else 1,
                    "num_warps": warps,
                }
                if config not in out:
                    out.append(config)
        return out

    def bind(self, problem: CrossEntropyProblem, config: LaunchConfig) -> Callable[..., None]:
        acc = tl.float64 if problem.dtype == "float64" else tl.float32
        block_r = config["BLOCK_R"]
        strides = problem.x_strides + (problem.dx_strides if problem.backward else ())
        return launcher(
            _backward_kernel if problem.backward else _forward_kernel,
            (cdiv(problem.n_rows, block_r),),
            num_tensors=7 if problem.backward else 5,
            ints=(problem.n_rows, problem.n_cols, problem.ignore_index, *strides),
            constexprs=(
                problem.weighted,
                problem.smoothing,
                acc,
                problem.index_64,
                *((config["VECTOR"],) if problem.backward else ()),
                block_r,
                config["BLOCK_N"],
            ),
            num_warps=config["num_warps"],
        )


def _accumulator(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _weights(x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """The class weights in the logits' arithmetic dtype, as the kernels take them (``x`` stands
    in for none)."""
    return x if weight is None else weight.to(_accumulator(x))


def _plan(
    backward: bool,
    x: torch.Tensor,
    weighted: bool,
    smoothing: bool,
    ignore_index: int,
    dx: torch.Tensor | None,
    timing_args: Callable[[], tuple],
) -> Callable[..., None]:
    key = (
        backward,
        x.shape,
        x.dtype,
        x.stride(),
        # (Whether dx goes in vectors is not in the key: dx is always ``_gradient_like(x)``,
        # whose layout follows from x's shape, strides and dtype.)
        dx.stride() if dx is not None else None,
        weighted,
        smoothing,
        ignore_index,
    )
    return FAMILY.plan(key, lambda: _problem(backward, x, weighted, smoothing, ignore_index, dx), timing_args)


# ---------------------------------------------------------------------------------------------
# 4. torch.library ops and autograd.


def _fake_forward(
    x: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None, ignore_index: int, smoothing: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    acc = _accumulator(x)
    loss = torch.empty((2 if smoothing else 1, x.shape[0]), dtype=acc, device=x.device)
    return loss, torch.empty((2, x.shape[0]), dtype=acc, device=x.device)


@custom_op(
    "cross_entropy",
    "(Tensor x, Tensor target, Tensor? weight, int ignore_index, bool smoothing) -> (Tensor, Tensor)",
    _fake_forward,
)
def _forward(
    x: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None, ignore_index: int, smoothing: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of the (rows, classes) logits: (nll and, with ``smoothing``, the smoothing term,
    stacked), and (maximum, log-sum-exp below it) stacked; see the kernels."""
    loss, stats = _fake_forward(x, target, weight, ignore_index, smoothing)
    if x.shape[0]:
        args = (x, target, _weights(x, weight), loss, stats)
        plan = _plan(False, x, weight is not None, smoothing, ignore_index, None, lambda: args)
        plan(*args)
    return loss, stats


def _fake_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    stats: torch.Tensor,
    ignore_index: int,
) -> torch.Tensor:
    return _gradient_like(x)


def _gradient_like(x: torch.Tensor) -> torch.Tensor:
    """An uninitialized gradient for the (rows, classes) logits ``x``: x's shape and strides, but
    for row-major logits whose rows do not start on 16-byte boundaries (a vocabulary of 50257),
    rows padded to them. The logits' gradient feeds the output layer's two products, whose
    descriptors read 16-byte-aligned rows: written so, it is not copied again to the aligned
    layout (a copy the logits' size, 0.95 ms of GPT-2 small's training step on an H200)."""
    n_rows, n_cols = x.shape
    if x.stride(1) != 1 or n_rows < 2 or (n_cols * x.element_size()) % 16 == 0:
        return torch.empty_like(x)
    return empty_aligned_rows(x, n_rows, n_cols)


@custom_op(
    "cross_entropy_backward",
    "(Tensor grad, Tensor x, Tensor target, Tensor? weight, Tensor stats, int ignore_index) -> Tensor",
    _fake_backward,
)
def _backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    stats: torch.Tensor,
    ignore_index: int,
) -> torch.Tensor:
    """dx of the logits from the gradients of ``_forward``'s per-row terms (``grad``: shaped as
    its first output; two rows mean label smoothing)."""
    dx = _gradient_like(x)
    if x.shape[0]:
        smoothing = grad.shape[0] == 2
        grad = grad.to(stats.dtype).contiguous()
        w = _weights(x, weight)
        # W for the smoothing term's gradient (the forward sums it as it goes).
        wsum = w.sum().reshape(1) if smoothing and weight is not None else x
        args = (x, target, w, wsum, stats, grad, dx)
        plan = _plan(True, x, weight is not None, smoothing, ignore_index, dx, lambda: args)
        plan(*args)
    return dx


class _CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, target, weight, ignore_index, smoothing):
        loss, stats = _forward(x, target, weight, ignore_index, smoothing)
        ctx.save_for_backward(x, target, weight, stats)
        ctx.ignore_index = ignore_index
        return loss

    @staticmethod
    def backward(ctx, grad):
        x, target, weight, stats = ctx.saved_tensors
        return _backward(grad, x, target, weight, stats, ctx.ignore_index), None, None, None, None


# ---------------------------------------------------------------------------------------------
# 5. Public function.


def _reduction(size_average: bool | None, reduce: bool | None, reduction: str) -> str:
    if size_average is not None or reduce is not None:
        return torch.nn._reduction.legacy_get_string(size_average, reduce)
    return check_choice(OP, "reduction", reduction, REDUCTIONS)


def _rows(input: torch.Tensor) -> torch.Tensor:
    """The (rows, classes) view of (C,), (N, C) or (N, C, d1, ...) logits (a copy where the
    classes of an (N, C, d...) tensor do not line up as one stride)."""
    if input.ndim == 1:
        return input.unsqueeze(0)
    if input.ndim == 2:
        return input
    return input.movedim(1, -1).reshape(-1, input.shape[1])


def _check_target(input: torch.Tensor, target: object) -> torch.Tensor:
    check_tensor(OP, "target", target, dtypes=(torch.int64, *FLOAT_DTYPES))
    assert isinstance(target, torch.Tensor)
    if target.is_floating_point():
        if target.shape != input.shape:
            raise ValueError(
                f"{OP}: argument 'target' holds class probabilities of shape {tuple(target.shape)}; "
                f"they must match 'input' of shape {tuple(input.shape)}"
            )
        return target
    expected = (input.shape[0], *input.shape[2:]) if input.ndim >= 2 else ()
    if tuple(target.shape) != expected:
        raise ValueError(
            f"{OP}: argument 'target' has shape {tuple(target.shape)}; class indices for 'input' of "
            f"shape {tuple(input.shape)} have shape {expected}"
        )
    return target


def cross_entropy(
    input: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None = None,
    size_average: bool | None = None,
    ignore_index: int = -100,
    reduce: bool | None = None,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """``F.cross_entropy``: ``-log(softmax(input)[target])`` per sample, class dimension 1.

    Args:
        input: logits, (C,), (N, C) or (N, C, d1, ...), fp16/bf16/fp32/fp64, any strides ((N, C)
            is read in place; (N, C, d...) inputs whose classes are not one stride apart are
            copied to (rows, C) first).
        target: class indices (int64) of shape (), (N,) or (N, d1, ...); or class probabilities
            shaped as ``input`` (a composed path: ``tdnn.log_softmax`` and a weighted sum).
        weight: (C,) rescaling weights of the classes.
        ignore_index: a target value that contributes nothing (not to the mean's count either).
        reduction: ``"none"`` | ``"mean"`` | ``"sum"`` (``size_average``/``reduce``: PyTorch's
            deprecated spellings of it).
        label_smoothing: in [0, 1]: the target mixed with the uniform distribution, as PyTorch.

    Returns the loss in the input's dtype (fp32 for fp16/bf16 logits under CUDA autocast, as
    PyTorch's autocast runs cross entropy; no cast of the logits is made, since the kernels
    compute in fp32 from any dtype). The gradient of the logits is in their dtype.

    A class index outside [0, C) (other than ``ignore_index``) raises ``IndexError`` for host
    tensors; on a GPU it makes its sample's loss, and so a reduced loss, NaN.
    """
    check_tensor(OP, "input", input, min_ndim=1)
    reduction = _reduction(size_average, reduce, reduction)
    label_smoothing = check_float(OP, "label_smoothing", label_smoothing)
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{OP}: argument 'label_smoothing'={label_smoothing} must be in [0, 1]")
    target = _check_target(input, target)
    classes = input.shape[1] if input.ndim >= 2 else input.shape[0]
    if classes == 0:
        raise ValueError(f"{OP}: argument 'input' has 0 classes (dimension {min(1, input.ndim - 1)})")
    if weight is not None:
        check_tensor(OP, "weight", weight, dtypes=FLOAT_DTYPES, min_ndim=1, max_ndim=1)
        if weight.numel() != classes or weight.device != input.device:
            raise ValueError(
                f"{OP}: argument 'weight' has {weight.numel()} elements on {weight.device}; "
                f"{classes} on {input.device} (one per class) are accepted"
            )
    out_dtype = input.dtype
    low_precision = input.dtype in (torch.float16, torch.bfloat16)
    if low_precision and input.device.type == "cuda" and torch.is_autocast_enabled("cuda"):
        out_dtype = torch.float32
    if target.is_floating_point():
        return _probability_targets(input, target, weight, reduction, label_smoothing, classes, out_dtype)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"{OP}: argument 'ignore_index' must be an int, got {type(ignore_index).__name__}")
    if target.device.type == "cpu" and target.numel() and not torch.compiler.is_compiling():
        # Host targets are checked here, as PyTorch does; on a device, reading them back would
        # stall every call (and cannot happen in a CUDA graph), and a traced graph cannot branch
        # on values: the kernels make the loss NaN.
        bad = (target != ignore_index) & ((target < 0) | (target >= classes))
        if bool(bad.any()):
            raise IndexError(f"{OP}: target {int(target[bad][0])} is out of bounds for {classes} classes")
    rows = _rows(input)
    flat_target = target.reshape(-1).contiguous()
    smoothing = label_smoothing > 0.0
    if input.requires_grad and torch.is_grad_enabled():
        loss = _CrossEntropyFunction.apply(rows, flat_target, weight, ignore_index, smoothing)
    else:
        loss, _ = _forward(rows, flat_target, weight, ignore_index, smoothing)
    nll = loss[0] if not smoothing else loss[0] * (1.0 - label_smoothing)
    smooth = loss[1] * (label_smoothing / classes) if smoothing else None
    if reduction == "none":
        out = nll if smooth is None else nll + smooth
        return out.reshape(target.shape).to(out_dtype)
    out = nll.sum() if smooth is None else nll.sum() + smooth.sum()
    if reduction == "mean":  # over the samples that count, weighted as their targets' classes
        counted = flat_target != ignore_index
        if weight is None:
            out = out / counted.sum()
        else:
            # Clamped: a target out of range made the loss NaN already; indexing with it would fault.
            picked = weight[flat_target.where(counted, 0).clamp(0, classes - 1)]
            out = out / (picked * counted).sum(dtype=loss.dtype)
    return out.to(out_dtype)


def _probability_targets(
    input: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    reduction: str,
    label_smoothing: float,
    classes: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Cross entropy against class probabilities, PyTorch's formula over tdnn.log_softmax."""
    acc = _accumulator(input)
    class_dim = 1 if input.ndim >= 2 else 0
    log_probs = log_softmax(input, class_dim, dtype=acc)
    target = target.to(acc)
    if label_smoothing > 0.0:
        target = target * (1.0 - label_smoothing) + label_smoothing / classes
    terms = log_probs * target
    if weight is not None:
        shape = [1] * input.ndim
        shape[class_dim] = classes
        terms = terms * weight.to(acc).view(shape)
    loss = -terms.sum(class_dim)
    if reduction == "none":
        return loss.to(out_dtype)
    if reduction == "sum":
        return loss.sum().to(out_dtype)
    return (loss.sum() / (input.numel() // classes)).to(out_dtype)


__all__ = ["FAMILY", "cross_entropy", "cross_entropy_reference"]
