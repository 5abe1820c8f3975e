"""Connectionist temporal classification loss, forward and gradient (``F.ctc_loss``, cuDNN's CTC).

The alpha and beta recursions run in log space over the extended label sequence (blanks between
and around the targets), each sample's in one program that walks time with the recursion in
registers. When a gradient may follow, the forward pass launches the beta programs beside the
alpha ones (the two are independent; a batch leaves most SMs idle) and keeps both tables; the
backward pass is then one parallel kernel forming the gradient of every class from
``log(alpha * beta)`` grouped by label. Every sum has a fixed order and no atomics are used: the
same bits on every run, with or without ``tdnn.config.deterministic``.

The gradient with respect to ``log_probs`` is PyTorch's: ``exp(lp) - exp(log(sum alpha*beta) +
nll - lp)`` per class, the form that assumes ``log_probs`` came from ``log_softmax``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..core.backend import INTERPRET
from ..core.checks import check_choice, check_tensor
from ..core.launcher import cdiv, launcher

REDUCTIONS = ("none", "mean", "sum")

# ---------------------------------------------------------------------------------------------
# 1. Reference.


def ctc_loss_reference(
    log_probs: torch.Tensor,
    targets: torch.Tensor,
    input_lengths: Sequence[int],
    target_lengths: Sequence[int],
    blank: int = 0,
) -> torch.Tensor:
    """Per-sample negative log-likelihoods in float64, by the plain alpha recursion (unbatched
    loops: slow, for small test cases). ``targets`` padded (N, S)."""
    lp = log_probs.double().cpu()
    out = []
    for n, (T, L) in enumerate(zip(input_lengths, target_lengths)):
        tgt = targets[n, :L].tolist()
        ext = [blank]
        for c in tgt:
            ext += [c, blank]
        S = len(ext)
        alpha = torch.full((S,), -torch.inf, dtype=torch.float64)
        alpha[0] = lp[0, n, blank]
        if S > 1:
            alpha[1] = lp[0, n, ext[1]]
        for t in range(1, T):
            prev = alpha.clone()
            for s in range(S):
                terms = [prev[s]]
                if s >= 1:
                    terms.append(prev[s - 1])
                if s >= 2 and ext[s] != blank and ext[s] != ext[s - 2]:
                    terms.append(prev[s - 2])
                alpha[s] = torch.logsumexp(torch.stack(terms), 0) + lp[t, n, ext[s]]
        tail = alpha[-2:] if S > 1 else alpha[-1:]
        out.append(-torch.logsumexp(tail, 0))
    return torch.stack(out)


# ---------------------------------------------------------------------------------------------
# 2. Kernels. The extended label sequence (blank, l0, blank, l1, ..., blank) is kept as two vectors
# indexed by k: ``B[k]`` for the blank at extended position 2k (k <= L) and ``A[k]`` for label k at
# 2k + 1 (k < L). A step of the alpha recursion then needs one shift, ``A[k - 1]``:
#   B'[k] = lse(B[k], A[k - 1]) + lp[blank]
#   A'[k] = lse(A[k], B[k], A[k - 1] if l_k != l_{k-1}) + lp[l_k]
# and beta (PyTorch's convention: beta_t includes the emission at t) is the alpha recursion of the
# problem reversed in time and in label order, so one kernel runs both.
#
# Shared arguments: lp (T, N, C) log-probabilities with strides lt, ln, lc; targets (int32/int64)
# with labels of sample n from ``off[n]``; ``lens`` int64 (3, N): input lengths, target lengths,
# target offsets; ``tab`` contiguous (2, N, T, 2, W) fp32/fp64 (accumulation dtype ACC): table 0
# holds log-alpha, table 1 log-beta, each row ``[B[0..W), A[0..W)]``, W = max target length + 1.
# FAST_MATH: the recursion's logs and exps as single ``lg2.approx`` / ``ex2.approx`` instructions
# (fp32 on a GPU: their ~2^-22 absolute error is below the rounding of alpha itself, whose
# magnitude grows to hundreds); the interpreter and fp64 use ``tl.log`` / ``tl.exp``.


@triton.jit
def _log(x, FAST_MATH: tl.constexpr):
    if FAST_MATH:
        return libdevice.fast_logf(x)
    else:
        return tl.log(x)


@triton.jit
def _exp(x, FAST_MATH: tl.constexpr):
    # exp2 is ex2.approx.ftz: no range fix-up for denormal results (tl.exp's), which only ever
    # meet the 1 they are added to.
    if FAST_MATH:
        return tl.math.exp2(x * 1.4426950408889634)
    else:
        return tl.exp(x)


@triton.jit
def _lse2(a, b, FAST_MATH: tl.constexpr):
    """log(exp(a) + exp(b)) with one exp: the larger term contributes exactly 1. NaN propagates
    (the max/min keep it); two -inf give -inf."""
    hi = tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)
    lo = tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)
    safe = tl.where(hi == -float("inf"), 0.0, hi)
    return hi + _log(1.0 + _exp(lo - safe, FAST_MATH), FAST_MATH)


@triton.jit
def _lse3(a, b, c, FAST_MATH: tl.constexpr):
    """log(exp(a) + exp(b) + exp(c)) with two exps, sorting the three with min/max."""
    ab_hi = tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)
    ab_lo = tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)
    hi = tl.maximum(ab_hi, c, propagate_nan=tl.PropagateNan.ALL)
    mid = tl.maximum(ab_lo, tl.minimum(ab_hi, c, propagate_nan=tl.PropagateNan.ALL))
    lo = tl.minimum(ab_lo, c, propagate_nan=tl.PropagateNan.ALL)
    safe = tl.where(hi == -float("inf"), 0.0, hi)
    return hi + _log(1.0 + _exp(mid - safe, FAST_MATH) + _exp(lo - safe, FAST_MATH), FAST_MATH)


@triton.jit
def _emissions(row, step, first, In, blank_off, lab_off, ok, D: tl.constexpr):
    """The blank's and each label's log-probabilities at the D steps from ``first`` (step s reads
    row ``row + s * step``, ``step`` int64), as two D-tuples; filler past the input length (never
    used)."""
    xb = ()
    xl = ()
    for j in tl.static_range(D):
        at = row + step * (first + j)
        live = first + j < In
        # Triton's compiler takes no starred tuples.
        xb = xb + (tl.load(at + blank_off, mask=live, other=0.0),)  # noqa: RUF005
        xl = xl + (tl.load(at + lab_off, mask=ok & live, other=-float("inf")),)  # noqa: RUF005
    return xb, xl


@triton.jit
def _ctc_recursion_kernel(
    lp_ptr,
    tgt_ptr,
    lens_ptr,
    tab_ptr,
    nll_ptr,
    N,
    T,
    C,
    W,
    lt,
    ln,
    lc,
    blank,
    ACC: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STORE: tl.constexpr,
    FAST_MATH: tl.constexpr,
    D: tl.constexpr,
):
    """Program (n, 0): log-alpha of sample n into table 0 (if STORE) and nll[n]; program (n, 1):
    log-beta into table 1. One program walks all input_length[n] steps with the recursion in
    registers. A step is the shift (shuffles in one warp, shared memory across warps) and a few
    exps and logs per position; its log-probabilities were loaded D steps earlier (a block of D
    steps is loaded while the previous block computes), so memory latency stays off the chain."""
    n = tl.program_id(0)
    direction = tl.program_id(1)
    rev = direction == 1
    In = tl.load(lens_ptr + n).to(tl.int32)
    L = tl.load(lens_ptr + N + n).to(tl.int32)
    off = tl.load(lens_ptr + 2 * N + n)
    k = tl.arange(0, BLOCK_K)
    has = k < L
    # Label k of the (possibly reversed) target and whether A[k - 1] may skip the blank into it.
    j = tl.where(rev, L - 1 - k, k)
    lab = tl.load(tgt_ptr + off + j, mask=has, other=0).to(tl.int64)
    prv = tl.load(tgt_ptr + off + tl.where(rev, j + 1, j - 1), mask=has & (k > 0), other=0)
    skip = (k > 0) & (lab != prv)
    # A label outside [0, C) is never read: it behaves as an impossible emission.
    ok = has & (lab >= 0) & (lab < C)
    lab_off = lab * lc
    blank_off = blank * lc
    t0 = tl.where(rev, In - 1, 0)
    row = lp_ptr + n.to(tl.int64) * ln + t0.to(tl.int64) * lt
    step = tl.where(rev, -lt, lt).to(tl.int64)
    neg_inf = tl.full([BLOCK_K], -float("inf"), ACC)
    B = tl.where(k == 0, tl.load(row + blank_off).to(ACC), neg_inf)
    A = tl.where(k == 0, tl.load(row + lab_off, mask=ok, other=-float("inf")).to(ACC), neg_inf)
    # Where this program's B[k] and A[k] sit in the table's row (the reversed order for beta).
    tab_row = tab_ptr + ((direction * N + n).to(tl.int64) * T + t0) * (2 * W)
    tab_step = tl.where(rev, -2 * W, 2 * W)
    at_b = tl.where(rev, L - k, k)
    at_a = W + tl.where(rev, L - 1 - k, k)
    if STORE:
        tl.store(tab_row + at_b, B, mask=k <= L)
        tl.store(tab_row + at_a, A, mask=has)
    shift = tl.maximum(k - 1, 0)
    next_b, next_l = _emissions(row, step, 1, In, blank_off, lab_off, ok, D)
    for t in range(1, In, D):
        xb, xl = next_b, next_l
        next_b, next_l = _emissions(row, step, t + D, In, blank_off, lab_off, ok, D)
        for i in tl.static_range(D):
            live = t + i < In
            prev_a = tl.where(k > 0, tl.gather(A, shift, 0), neg_inf)
            B_new = _lse2(B, prev_a, FAST_MATH) + xb[i].to(ACC)
            A_new = _lse3(A, B, tl.where(skip, prev_a, neg_inf), FAST_MATH) + xl[i].to(ACC)
            # The last block runs past the input length: those steps keep the state.
            B = tl.where(live, B_new, B)
            A = tl.where(live, A_new, A)
            if STORE:
                at = tab_row + (t + i) * tab_step
                tl.store(at + at_b, B, mask=(k <= L) & live)
                tl.store(at + at_a, A, mask=has & live)
    # Selecting by a sum (not a max) keeps a NaN.
    end_b = tl.sum(tl.where(k == L, B, 0.0), 0)
    end_a = tl.sum(tl.where(k == L - 1, A, 0.0), 0)
    end_a = tl.where(L > 0, end_a, -float("inf"))
    tl.store(nll_ptr + n, -_lse2(end_b, end_a, FAST_MATH), mask=direction == 0)


@triton.jit
def _ctc_grad_kernel(
    lp_ptr,
    tgt_ptr,
    lens_ptr,
    tab_ptr,
    nll_ptr,
    gout_ptr,
    grad_ptr,
    N,
    T,
    C,
    W,
    lt,
    ln,
    lc,
    blank,
    beta_off,
    ZERO_INF: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_C: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """Program (i, n): grad[t, n, :] for BLOCK_T steps t from i * BLOCK_T (grad contiguous
    (T, N, C)), 0 past input_length[n]; table 1 starts ``beta_off`` elements after table 0 (an
    argument: N * T * 2W can pass 2^31, and an N of 1 arrives as a constant). Per class c it needs
    log(sum of alpha * beta over the extended positions labelled c): the blank's is a row sum over
    B, the labels' a product of the rows of exp(A - row max) with the one-hot (label, class) matrix
    on tensor cores. SPLIT (fp32): the one-hot factor is exact in TF32, so two TF32 products of the
    rows' high and low parts carry ~2^-20 relative error (TF32 alone: 2^-11); fp64 takes an IEEE
    fp64 product."""
    i = tl.program_id(0)
    n = tl.program_id(1)
    In = tl.load(lens_ptr + n).to(tl.int32)
    L = tl.load(lens_ptr + N + n).to(tl.int32)
    off = tl.load(lens_ptr + 2 * N + n)
    nll = tl.load(nll_ptr + n)
    gout = tl.load(gout_ptr + n).to(ACC)
    t0 = i * BLOCK_T
    t = t0 + tl.arange(0, BLOCK_T)
    active = t < In
    k = tl.arange(0, BLOCK_K)
    # One int64 base per table and int32 offsets inside the tile: fewer live registers.
    alpha = tab_ptr + (n.to(tl.int64) * T + t0) * (2 * W)
    beta = alpha + beta_off
    cell = (tl.arange(0, BLOCK_T) * (2 * W))[:, None] + k[None, :]
    mb = active[:, None] & (k <= L)[None, :]
    ma = active[:, None] & (k < L)[None, :]
    eb = tl.load(alpha + cell, mask=mb, other=-float("inf")) + tl.load(
        beta + cell, mask=mb, other=-float("inf")
    )
    cell += W
    ea = tl.load(alpha + cell, mask=ma, other=-float("inf")) + tl.load(
        beta + cell, mask=ma, other=-float("inf")
    )
    m = tl.maximum(tl.max(eb, 1), tl.max(ea, 1))
    safe = tl.where(m == -float("inf"), 0.0, m)[:, None]
    blank_total = tl.sum(tl.exp(eb - safe), 1)[:, None]
    pa = tl.exp(ea - safe)
    if SPLIT:
        # The TF32 part: the top 10 mantissa bits (what the tensor cores read of an fp32 value).
        pa_hi = (pa.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
    lab = tl.load(tgt_ptr + off + k, mask=k < L, other=-1)
    kill = t >= In
    if ZERO_INF:
        kill = kill | (nll + tl.zeros([BLOCK_T], ACC) == float("inf"))
    lp_rows = lp_ptr + t.to(tl.int64)[:, None] * lt + n.to(tl.int64) * ln
    grad_rows = grad_ptr + (t.to(tl.int64) * N + n)[:, None] * C
    for c0 in range(0, C, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        cm = c < C
        hit = (lab[:, None] == c[None, :]).to(ACC)
        if SPLIT:
            total = tl.dot(pa_hi, hit, input_precision="tf32")
            total = tl.dot(pa - pa_hi, hit, total, input_precision="tf32")
        else:
            total = tl.dot(pa, hit, input_precision="ieee", out_dtype=ACC)
        total += tl.where(c == blank, blank_total, 0.0)
        x = tl.load(lp_rows + c * lc, mask=active[:, None] & cm, other=0.0).to(ACC)
        # PyTorch's form for log_softmax inputs: exp(lp) - exp(log(sum alpha * beta) + nll - lp).
        g = (tl.exp(x) - tl.exp(tl.log(total) + safe + nll - x)) * gout
        g = tl.where(kill[:, None], 0.0, g)
        tl.store(grad_rows + c, g.to(grad_ptr.dtype.element_ty), mask=(t < T)[:, None] & cm)


# ---------------------------------------------------------------------------------------------
# 3. Launch and autograd.

_launchers: dict[tuple, Callable[..., None]] = {}


def _recursion_warps(block_k: int) -> int:
    """Warps of a recursion program: one position per thread. The step's latency chain sets the
    pace, and spreading it over warps beats the shuffles of fewer, fuller threads despite two
    barriers a step (H100, 128 positions, alpha and beta of T=500 N=32: 78 us with 4 warps, 134
    with 2, 195-295 with 1, 92-95 with 8)."""
    return max(1, min(8, block_k // 32))


# Steps whose log-probabilities a recursion program loads together, a block ahead of their use:
# with one step ahead the recursion waited on memory at every step (200 us instead of 78 on H100;
# 4, 8 and 16 measured 79, 78 and 82 us).
_PREFETCH = 8


def _recursion(lp: torch.Tensor, tgt: torch.Tensor, blank: int, W: int, both: bool) -> Callable[..., None]:
    """The cached launch of the alpha recursion (and the beta one beside it when ``both``: the
    tables are then stored for the gradient) for this problem."""
    key = ("recursion", lp.dtype, tgt.dtype, lp.shape, lp.stride(), blank, W, both)
    launch = _launchers.get(key)
    if launch is None:
        T, N, C = lp.shape
        block_k = triton.next_power_of_2(W)
        launch = _launchers[key] = launcher(
            _ctc_recursion_kernel,
            (N, 2 if both else 1),
            5,
            ints=(N, T, C, W, *lp.stride(), blank),
            constexprs=(
                _acc(lp.dtype),
                block_k,
                both,
                not INTERPRET and lp.dtype == torch.float32,
                _PREFETCH,
            ),
            num_warps=_recursion_warps(block_k),
        )
    return launch


def _grad_warps(block_k: int, dtype: torch.dtype) -> int:
    """Warps of a gradient program: 4 up to 128 positions (no spills on sm_90 in fp32; fp64's
    product needs 8), more for longer targets (H100, T=500 N=32 S=100: 35 us with 4, 44 with 8)."""
    return min(16, max(8 if dtype == torch.float64 else 4, block_k // 32))


def _gradient(lp: torch.Tensor, tgt: torch.Tensor, blank: int, W: int, zero_infinity: bool):
    """The cached launch of the gradient kernel, one program per (block of time steps, sample)."""
    key = ("gradient", lp.dtype, tgt.dtype, lp.shape, lp.stride(), blank, W, zero_infinity)
    launch = _launchers.get(key)
    if launch is None:
        T, N, C = lp.shape
        # tl.dot needs every side of 16 or more. The (label, class) operand and the rows of a
        # program stay within registers: fewer classes and more warps for longer targets.
        block_k = max(16, triton.next_power_of_2(W))
        block_c = max(16, min(64, triton.next_power_of_2(C), 8192 // block_k))
        block_t = 16
        launch = _launchers[key] = launcher(
            _ctc_grad_kernel,
            (cdiv(T, block_t), N),
            7,
            ints=(N, T, C, W, *lp.stride(), blank, N * T * 2 * W),
            constexprs=(zero_infinity, _acc(lp.dtype), block_t, block_k, block_c, lp.dtype == torch.float32),
            num_warps=_grad_warps(block_k, lp.dtype),
        )
    return launch


def _acc(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


class _CTCFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, lp, tgt, lens, blank, max_len, zero_infinity, needs_grad):
        T, N, _C = lp.shape
        W = max_len + 1
        acc_dtype = torch.float64 if lp.dtype == torch.float64 else torch.float32
        nll = torch.empty((N,), dtype=acc_dtype, device=lp.device)
        # Beta runs beside alpha (its own programs, on otherwise idle SMs) when a gradient may
        # follow; the backward pass is then one parallel kernel.
        tab = torch.empty((2, N, T, 2, W), dtype=acc_dtype, device=lp.device) if needs_grad else nll
        if N:
            _recursion(lp, tgt, blank, W, needs_grad)(lp, tgt, lens, tab, nll)
        ctx.save_for_backward(lp, tgt, lens, tab, nll)
        ctx.params = (blank, W, zero_infinity)
        out = nll.to(lp.dtype)
        if zero_infinity:
            out = torch.where(torch.isinf(out), 0.0, out)
        return out

    @staticmethod
    def backward(ctx, gout):
        lp, tgt, lens, tab, nll = ctx.saved_tensors
        blank, W, zero_infinity = ctx.params
        T, N, C = lp.shape
        grad = torch.empty((T, N, C), dtype=lp.dtype, device=lp.device)
        if N:
            _gradient(lp, tgt, blank, W, zero_infinity)(lp, tgt, lens, tab, nll, gout.contiguous(), grad)
        return grad, None, None, None, None, None, None


# ---------------------------------------------------------------------------------------------
# 4. Public function.


def _host_lengths(name: str, input_lengths: object, target_lengths: object, n: int) -> tuple[list, list]:
    """Both length arguments as lists of ints; two tensors on one device cross to the host in one
    transfer (each transfer waits for the device)."""
    given = {"input_lengths": input_lengths, "target_lengths": target_lengths}
    for arg, value in given.items():
        if isinstance(value, torch.Tensor):
            if value.dtype not in (torch.int32, torch.int64) or value.ndim != 1:
                got = f"{value.dtype} {tuple(value.shape)}"
                raise TypeError(f"{name}: argument '{arg}' must be a 1-D int tensor, got {got}")
        elif not isinstance(value, (list, tuple)):
            raise TypeError(
                f"{name}: argument '{arg}' must be a tensor, list or tuple, got {type(value).__name__}"
            )
    a, b = input_lengths, target_lengths
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.device == b.device:
        both = torch.cat((a, b)).tolist()
        lists = [both[: len(a)], both[len(a) :]]
    else:
        lists = [v.tolist() if isinstance(v, torch.Tensor) else list(v) for v in (a, b)]
    for arg, items in zip(given, lists):
        if len(items) != n or not {type(v) for v in items} <= {int}:
            raise ValueError(f"{name}: argument '{arg}' must hold {n} ints, got {items}")
    return lists[0], lists[1]


def ctc_loss(
    log_probs: torch.Tensor,
    targets: torch.Tensor,
    input_lengths: torch.Tensor | Sequence[int],
    target_lengths: torch.Tensor | Sequence[int],
    blank: int = 0,
    reduction: str = "mean",
    zero_infinity: bool = False,
) -> torch.Tensor:
    """``F.ctc_loss``: the negative log-likelihood of the targets under all alignments.

    Args:
        log_probs: (T, N, C) or unbatched (T, C) log-probabilities (``log_softmax`` output), fp32
            or fp64, any strides.
        targets: (N, S) padded, or 1-D concatenated targets (``sum(target_lengths)``), int32/int64
            (unbatched: (S,)). Labels must be in [0, C) and differ from ``blank`` (a label outside
            [0, C) makes its sample's alignment impossible).
        input_lengths: (N,) lengths in [1, T]; target_lengths: (N,) lengths (at most S when padded).
            Tensors are read on the host (one transfer, which waits for the device).
        blank: the blank label.
        reduction: ``"none"`` (per sample), ``"mean"`` (each loss divided by its target length,
            then averaged) or ``"sum"``.
        zero_infinity: impossible alignments (infinite loss) give 0 loss and 0 gradient.

    Differentiable with respect to ``log_probs`` (PyTorch's gradient form); deterministic. Memory:
    with a gradient, two fp32 (fp64) tables of T * N * 2 * (max target length + 1) values.
    """
    name = "tdnn.ctc_loss"
    check_tensor(name, "log_probs", log_probs, dtypes=(torch.float32, torch.float64), min_ndim=2, max_ndim=3)
    check_tensor(name, "targets", targets, dtypes=(torch.int32, torch.int64), min_ndim=1, max_ndim=2)
    check_choice(name, "reduction", reduction, REDUCTIONS)
    unbatched = log_probs.ndim == 2
    if unbatched:
        log_probs = log_probs.unsqueeze(1)
        if targets.ndim != 1:
            raise ValueError(f"{name}: unbatched log_probs need 1-D targets, got {targets.ndim}-D")
        targets = targets.unsqueeze(0)
        if isinstance(input_lengths, int):
            input_lengths = [input_lengths]
        if isinstance(target_lengths, int):
            target_lengths = [target_lengths]
        if isinstance(input_lengths, torch.Tensor) and input_lengths.ndim == 0:
            input_lengths = input_lengths.reshape(1)
        if isinstance(target_lengths, torch.Tensor) and target_lengths.ndim == 0:
            target_lengths = target_lengths.reshape(1)
    T, N, C = log_probs.shape
    if isinstance(blank, bool) or not isinstance(blank, int) or not 0 <= blank < C:
        raise ValueError(f"{name}: argument 'blank'={blank!r} must be an int in [0, {C})")
    in_len, tgt_len = _host_lengths(name, input_lengths, target_lengths, N)
    if N and (min(in_len) < 1 or max(in_len) > T):
        raise ValueError(f"{name}: input_lengths {in_len} must be in [1, {T}]")
    max_len = max(tgt_len, default=0)
    if N and min(tgt_len) < 0:
        raise ValueError(f"{name}: target_lengths {tgt_len} must be non-negative")
    if targets.ndim == 2:
        if targets.shape[0] != N or max_len > targets.shape[1]:
            raise ValueError(
                f"{name}: padded targets of shape {tuple(targets.shape)} do not fit batch {N} and "
                f"target_lengths {tgt_len}"
            )
        offsets = range(0, N * targets.shape[1], targets.shape[1])
    else:
        if targets.shape[0] != sum(tgt_len):
            raise ValueError(
                f"{name}: 1-D targets hold {targets.shape[0]} labels; target_lengths sum to {sum(tgt_len)}"
            )
        offsets = itertools.accumulate(tgt_len[:-1], initial=0)
    lens = torch.tensor([in_len, tgt_len, list(offsets)], dtype=torch.int64, device=log_probs.device)
    nll = _CTCFunction.apply(
        log_probs,
        targets.contiguous(),
        lens,
        blank,
        max_len,
        bool(zero_infinity),
        torch.is_grad_enabled() and log_probs.requires_grad,
    )
    if reduction == "none":
        return nll[0] if unbatched else nll
    if reduction == "sum":
        return nll.sum()
    return (nll / lens[1].clamp(min=1).to(nll.dtype)).mean()


__all__ = ["ctc_loss", "ctc_loss_reference"]
