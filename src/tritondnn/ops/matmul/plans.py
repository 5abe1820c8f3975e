"""Per-shape plans: the second call with the same shapes, strides, dtypes and epilogue costs one
dictionary lookup, one allocation and the launches.

``forward_plan`` serves the matmul op, ``backward_plan`` the epilogue's backward (activation
gradient and bias gradient); the operand gradients are matmuls themselves.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import triton.language as tl

from ...core.arrival import arrival_counters
from ...core.backend import sm_count
from ...core.config import config
from ...core.launcher import cdiv, launcher
from .engines import FAMILY, layout, preactivation_dtype
from .kernels import _grad_epilogue_kernel

_plans: dict[tuple, Callable[..., tuple]] = {}


def signature(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (t.shape, t.stride(), t.dtype)


def forward_plan(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    scaled: bool,
    out_dtype: torch.dtype,
    bias_kind: int,
    activation: int,
    store_pre: bool,
    amax: bool,
    fast_accum: bool = False,
    tf32x3: bool = False,
) -> Callable[..., tuple]:
    """The plan for a matmul call on these tensors (as ``engines.layout`` takes them):
    ``run(a, b, c, bias, residual, scale_a, scale_b, alpha, beta, p0, p1, shape) -> (out, pre, amax)``,
    ``pre`` and ``amax`` None unless asked for; ``out`` has ``shape`` if given (another shape of the
    same contiguous elements; launches read only data pointers)."""
    key = (
        config.version,
        a.shape,
        a.stride(),
        a.dtype,
        b.shape,
        b.stride(),
        b.dtype,
        out_dtype,
        bias_kind,
        activation,
        store_pre,
        amax,
        scaled,
        fast_accum,
        tf32x3,
        signature(c),
        signature(bias),
        signature(residual),
    )
    found = _plans.get(key)
    if found is None:
        lay = layout(
            a,
            b,
            c,
            bias,
            residual,
            out_dtype=out_dtype,
            bias_kind=bias_kind,
            activation=activation,
            store_pre=store_pre,
            scaled=scaled,
            amax=amax,
            fast_accum=fast_accum,
            tf32x3=tf32x3,
        )
        found = _plans[key] = _forward_run(lay.problem, lay.out_shape, lay.swapped, (a, b, c, bias, residual))
    return found


def _forward_run(problem, out_shape, swapped, example) -> Callable[..., tuple]:
    out_dtype = getattr(torch, problem.dtypes[2])
    pre_dtype = preactivation_dtype(getattr(torch, problem.dtypes[0]), out_dtype)
    store_pre, want_amax = problem.store_pre, problem.amax

    def args(a, b, out, c, bias, residual, pre, scale_a, scale_b, amax) -> tuple:
        """Launch arguments: A and B in the problem's order, ``out`` for every absent tensor."""
        if swapped:
            a, b = b, a
        fill = lambda t: out if t is None else t
        return (
            a,
            b,
            out,
            fill(c),
            fill(bias),
            fill(residual),
            fill(pre),
            fill(scale_a),
            fill(scale_b),
            fill(amax),
        )

    launch = None
    if math.prod(out_shape):

        def timing_args() -> tuple:
            a, b, c, bias, residual = example
            out = torch.empty(out_shape, dtype=out_dtype, device=a.device)
            pre = torch.empty(out_shape, dtype=pre_dtype, device=a.device) if store_pre else None
            scale = torch.ones((), dtype=torch.float32, device=a.device) if problem.scaled else None
            amax = torch.zeros((), dtype=torch.float32, device=a.device) if want_amax else None
            return (*args(a, b, out, c, bias, residual, pre, scale, scale, amax), 1.0, 1.0, 0.0, 0.0)

        choice = FAMILY.select(problem, timing_args)
        launch = choice.engine.bind(problem, choice.config)

    def run(a, b, c, bias, residual, scale_a, scale_b, alpha, beta, p0, p1, shape=None) -> tuple:
        device = a.device
        # Sizes one by one: a tuple or torch.Size costs the argument parser microseconds more.
        size = out_shape if shape is None else shape
        if size:
            out = torch.empty(*size, dtype=out_dtype, device=device)
        else:  # a scalar: torch.empty needs a size
            out = torch.empty((), dtype=out_dtype, device=device)
        pre = torch.empty(*out_shape, dtype=pre_dtype, device=device) if store_pre else None
        amax = torch.zeros((), dtype=torch.float32, device=device) if want_amax else None
        if launch is not None:
            launch(*args(a, b, out, c, bias, residual, pre, scale_a, scale_b, amax), alpha, beta, p0, p1)
        return out, pre, amax

    run.backward = {}  # type: ignore[attr-defined]  # autograd's programs for this plan's backward
    return run


def as_batches(t: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """``t.reshape(-1, m, n)``, also where M or N is 0 (-1 would be ambiguous there): the batch is
    then the dimensions before the last two where those are (M, N), else one (the rows merged)."""
    if m * n:
        return t.reshape(-1, m, n)
    return t.reshape(math.prod(t.shape[:-2]) if tuple(t.shape[-2:]) == (m, n) else 1, m, n)


def backward_plan(
    grad: torch.Tensor, pre: torch.Tensor | None, activation: int, bias_kind: int, bias_dtype: torch.dtype
) -> Callable[..., tuple]:
    """The plan for the epilogue's backward on ``grad`` (batch, M, N) and the stored ``pre`` of the
    same shape: ``run(grad, pre, p0, p1) -> (dpre or None, dbias or None)``; ``dpre`` (contiguous,
    in pre's dtype) is computed for an activation (-1: none), ``dbias`` for a bias kind (0: none,
    1: per column, 2: per row)."""
    key = ("backward", config.version, signature(grad), signature(pre), activation, bias_kind, bias_dtype)
    found = _plans.get(key)
    if found is None:
        found = _plans[key] = _backward_run(grad, pre, activation, bias_kind, bias_dtype)
    return found


# Partial bias sums the finalizing program reads a load (a loop only past this many chunks).
BIAS_PARTIALS_A_LOAD = 64


def grad_tiles(activation: int, bias: bool) -> tuple[int, int, int, int]:
    """(rows, columns, warps, programs an SM) of a program of the epilogue's backward; with a
    bias, as many programs as that fills (a program may take a single tile), each adding a row
    of partial sums. H200, bf16, 8192 rows (GPT-2 small's tokens), do_bench medians with the L2
    flushed, us: the bias gradient alone over 768 and 2304 columns 14.8 and 26.2 in 128x64 tiles
    of 8 warps, at least 4 tiles a program (as before), 14.1 and 22.2 so; GELU's gradient with
    the bias's over 3072 columns 57.9 in 64x64 tiles of 8 warps, 50.2 so (3.0 TB/s). An
    activation's gradient without a bias keeps the 64x64 tiles of 8 warps (not measured again)."""
    if not bias:
        return 64, 64, 8, 4
    return (32, 64, 4, 8) if activation >= 0 else (64, 128, 4, 4)


def _backward_run(grad, pre, activation, bias_kind, bias_dtype) -> Callable[..., tuple]:
    batch, m, n = grad.shape
    dpre_dtype = grad.dtype if pre is None else pre.dtype
    fp64 = dpre_dtype == torch.float64
    ws_dtype = torch.float64 if fp64 else torch.float32
    # Rows are reduced for the bias: (batch, M) for a per-column bias, (batch, N) for a per-row one.
    rows_inner, cols = (n, m) if bias_kind == 2 else (m, n)
    rows = batch * rows_inner
    dbias = bias_kind != 0
    if not rows * cols:
        return lambda grad, pre, p0, p1: (
            torch.empty(grad.shape, dtype=dpre_dtype, device=grad.device) if activation >= 0 else None,
            torch.zeros(cols, dtype=bias_dtype, device=grad.device) if dbias else None,
        )
    reach = sum((size - 1) * abs(st) for size, st in zip(grad.shape, grad.stride()))
    index_64 = max(reach + 1, grad.numel()) > 2**31 - 1

    def strides3(t: torch.Tensor | None) -> tuple[int, int, int]:
        """(batch, row, col) strides with rows and cols as above."""
        so, sm, sn = t.stride() if t is not None else (0, 0, 0)
        return (so, sn, sm) if bias_kind == 2 else (so, sm, sn)

    dpre_strides = (m * n, 1, n) if bias_kind == 2 else (m * n, n, 1)
    block_r, block_c, warps, waves = grad_tiles(activation, dbias)
    col_blocks = cdiv(cols, block_c)
    if dbias:  # each chunk adds a row of partial sums: enough chunks to fill the SMs, no more
        chunks = min(cdiv(rows, block_r), cdiv(waves * sm_count(), col_blocks))
    else:
        chunks = cdiv(rows, 4 * block_r)
    chunks = max(1, min(chunks, 65535))
    rows_chunk = cdiv(cdiv(rows, chunks), block_r) * block_r
    chunks = cdiv(rows, rows_chunk)
    ws_acc = tl.float64 if fp64 else tl.float32
    launch = launcher(
        _grad_epilogue_kernel,
        (col_blocks, chunks),
        num_tensors=6,
        ints=(rows, cols, rows_inner, rows_chunk, *strides3(grad), *strides3(pre), *dpre_strides),
        constexprs=(activation, dbias, ws_acc, index_64, block_r, block_c, BIAS_PARTIALS_A_LOAD),
        num_warps=warps,
    )
    counters = arrival_counters(col_blocks)

    def run(grad, pre, p0, p1) -> tuple:
        device = grad.device
        dpre = torch.empty(*grad.shape, dtype=dpre_dtype, device=device) if activation >= 0 else None
        if dbias:
            db = torch.empty(cols, dtype=bias_dtype, device=device)
            ws = torch.empty(chunks, cols, dtype=ws_dtype, device=device)
            last = (ws, db, counters(grad))
        else:
            db, last = None, (grad,) * 3
        launch(grad, grad if pre is None else pre, grad if dpre is None else dpre, *last, p0, p1)
        return dpre, db

    return run
