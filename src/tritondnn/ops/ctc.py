"""Connectionist temporal classification loss, forward and gradient (``F.ctc_loss``, cuDNN's CTC).

The forward pass runs the alpha recursion in log space over the extended label sequence (blanks
between and around the targets), one program per batch element walking time in order, and keeps
the log-alpha table for the backward pass. The backward pass runs the beta recursion the same way,
then one program per (time step, batch element) forms the gradient for every class from
``log(alpha * beta)`` grouped by label. Every sum has a fixed order and no atomics are used: the
same bits on every run, with or without ``tdnn.config.deterministic``.

The gradient with respect to ``log_probs`` is PyTorch's: ``exp(lp) - exp(log(sum alpha*beta) +
nll - lp)`` per class, the form that assumes ``log_probs`` came from ``log_softmax``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ..core.checks import check_choice, check_tensor
from ..core.launcher import launcher

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
# 2. Kernels. Shared arguments: lp (T, N, C) log-probabilities with strides lt, ln, lc; targets
# (int64) with ``tgt_off[n]`` the offset of sample n's labels; lengths int64 (N,); la/lb the
# log-alpha/log-beta tables, contiguous (N, T, S2) fp32 or fp64, S2 = 2 * max target length + 1.


@triton.jit
def _labels(tgt_ptr, off, s, L, blank):
    """Label of extended position s (blank at even s, target (s - 1) / 2 at odd s)."""
    odd = (s % 2) == 1
    j = (s - 1) // 2
    lab = tl.load(tgt_ptr + off + j, mask=odd & (s < 2 * L + 1) & (j >= 0), other=0).to(tl.int32)
    return tl.where(odd, lab, blank)


@triton.jit
def _lse3(a, b, c):
    m = tl.maximum(a, tl.maximum(b, c))
    safe = tl.where(m == -float("inf"), 0.0, m)
    return tl.log(tl.exp(a - safe) + tl.exp(b - safe) + tl.exp(c - safe)) + safe


@triton.jit
def _ctc_alpha_kernel(
    lp_ptr,
    tgt_ptr,
    off_ptr,
    in_len_ptr,
    tgt_len_ptr,
    la_ptr,
    nll_ptr,
    T,
    S2,
    lt,
    ln,
    lc,
    blank,
    ACC: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Program n: la[n, t, :] for t < input_length[n], and nll[n]."""
    n = tl.program_id(0).to(tl.int64)
    In = tl.load(in_len_ptr + n)
    L = tl.load(tgt_len_ptr + n)
    off = tl.load(off_ptr + n)
    S = 2 * L + 1
    s = tl.arange(0, BLOCK_S)
    valid = s < S
    lab = _labels(tgt_ptr, off, s, L, blank)
    lab2 = _labels(tgt_ptr, off, s - 2, L, blank)
    skip = (s % 2 == 1) & (s >= 3) & (lab != lab2)
    lp_n = lp_ptr + n * ln
    row = la_ptr + n * T * S2
    first = convert_acc(tl.load(lp_n + lab * lc, mask=valid, other=0.0), ACC)
    a0 = tl.where(valid & (s < 2), first, -float("inf"))
    tl.store(row + s, a0, mask=valid)
    for t in range(1, In):
        # Neighbours' values come from the row just stored: make it visible to every thread.
        tl.debug_barrier()
        prev = row + (t - 1) * S2
        a = tl.load(prev + s, mask=valid, other=-float("inf"))
        b = tl.load(prev + s - 1, mask=valid & (s >= 1), other=-float("inf"))
        c = tl.load(prev + s - 2, mask=valid & skip, other=-float("inf"))
        x = convert_acc(tl.load(lp_n + t * lt + lab * lc, mask=valid, other=0.0), ACC)
        tl.store(row + t * S2 + s, _lse3(a, b, c) + x, mask=valid)
    tl.debug_barrier()
    last = tl.load(row + (In - 1) * S2 + s, mask=valid & (s >= S - 2), other=-float("inf"))
    m = tl.max(last, 0)
    safe = tl.where(m == -float("inf"), 0.0, m)
    ll = tl.log(tl.sum(tl.exp(last - safe), 0)) + safe
    tl.store(nll_ptr + n, -ll)


@triton.jit
def convert_acc(x, ACC: tl.constexpr):
    return x.to(ACC)


@triton.jit
def _ctc_beta_kernel(
    lp_ptr,
    tgt_ptr,
    off_ptr,
    in_len_ptr,
    tgt_len_ptr,
    lb_ptr,
    T,
    S2,
    lt,
    ln,
    lc,
    blank,
    ACC: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Program n: lb[n, t, :] for t < input_length[n], from the last step backwards."""
    n = tl.program_id(0).to(tl.int64)
    In = tl.load(in_len_ptr + n)
    L = tl.load(tgt_len_ptr + n)
    off = tl.load(off_ptr + n)
    S = 2 * L + 1
    s = tl.arange(0, BLOCK_S)
    valid = s < S
    lab = _labels(tgt_ptr, off, s, L, blank)
    lab2 = _labels(tgt_ptr, off, s + 2, L, blank)
    skip = (s % 2 == 1) & (s + 2 < S) & (lab != lab2)
    lp_n = lp_ptr + n * ln
    row = lb_ptr + n * T * S2
    x = convert_acc(tl.load(lp_n + (In - 1) * lt + lab * lc, mask=valid, other=0.0), ACC)
    tl.store(row + (In - 1) * S2 + s, tl.where(s >= S - 2, x, -float("inf")), mask=valid)
    for i in range(1, In):
        t = In - 1 - i
        tl.debug_barrier()
        nxt = row + (t + 1) * S2
        a = tl.load(nxt + s, mask=valid, other=-float("inf"))
        b = tl.load(nxt + s + 1, mask=(s + 1) < S, other=-float("inf"))
        c = tl.load(nxt + s + 2, mask=valid & skip, other=-float("inf"))
        x = convert_acc(tl.load(lp_n + t * lt + lab * lc, mask=valid, other=0.0), ACC)
        tl.store(row + t * S2 + s, _lse3(a, b, c) + x, mask=valid)


@triton.jit
def _ctc_grad_kernel(
    lp_ptr,
    tgt_ptr,
    off_ptr,
    in_len_ptr,
    tgt_len_ptr,
    la_ptr,
    lb_ptr,
    nll_ptr,
    gout_ptr,
    grad_ptr,
    T,
    S2,
    C,
    lt,
    ln,
    lc,
    blank,
    gt,
    gn,
    gc,
    ZERO_INF: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Program (t, n): grad[t, n, c] for every class (strides gt, gn, gc), 0 past input_length."""
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1).to(tl.int64)
    In = tl.load(in_len_ptr + n)
    L = tl.load(tgt_len_ptr + n)
    off = tl.load(off_ptr + n)
    nll = tl.load(nll_ptr + n)
    gout = tl.load(gout_ptr + n).to(ACC)
    S = 2 * L + 1
    s = tl.arange(0, BLOCK_S)
    active = t < In
    valid = (s < S) & active
    lab = _labels(tgt_ptr, off, s, L, blank)
    ab = tl.load(la_ptr + (n * T + t) * S2 + s, mask=valid, other=-float("inf"))
    ab += tl.load(lb_ptr + (n * T + t) * S2 + s, mask=valid, other=-float("inf"))
    m = tl.max(ab, 0)
    safe = tl.where(m == -float("inf"), 0.0, m)
    e = tl.exp(ab - safe)
    kill = active == 0
    if ZERO_INF:
        kill = kill | (nll == float("inf"))
    for c0 in range(0, C, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        cm = c < C
        hit = lab[None, :] == c[:, None]
        total = tl.sum(tl.where(hit, e[None, :], 0.0), 1)
        lcab = tl.log(total) + safe
        x = tl.load(lp_ptr + t * lt + n * ln + c * lc, mask=cm & active, other=0.0).to(ACC)
        g = (tl.exp(x) - tl.exp(lcab + nll - x)) * gout
        g = tl.where(kill, 0.0, g)
        tl.store(grad_ptr + t * gt + n * gn + c * gc, g.to(grad_ptr.dtype.element_ty), mask=cm)


# ---------------------------------------------------------------------------------------------
# 3. Launch and autograd.


def _acc(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


class _CTCFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, lp, tgt, offsets, in_len, tgt_len, blank, max_len, zero_infinity):
        T, N, _C = lp.shape
        S2 = 2 * max_len + 1
        block_s = triton.next_power_of_2(S2)
        acc_dtype = torch.float64 if lp.dtype == torch.float64 else torch.float32
        la = torch.empty((N, T, S2), dtype=acc_dtype, device=lp.device)
        nll = torch.empty((N,), dtype=acc_dtype, device=lp.device)
        if N:
            launcher(
                _ctc_alpha_kernel,
                (N,),
                7,
                constexprs=(_acc(lp.dtype), block_s),
                num_warps=max(1, min(8, block_s // 64)),
            )(lp, tgt, offsets, in_len, tgt_len, la, nll, T, S2, *lp.stride(), blank)
        ctx.save_for_backward(lp, tgt, offsets, in_len, tgt_len, la, nll)
        ctx.params = (blank, S2, block_s, zero_infinity)
        out = nll.to(lp.dtype)
        if zero_infinity:
            out = torch.where(torch.isinf(out), 0.0, out)
        return out

    @staticmethod
    def backward(ctx, gout):
        lp, tgt, offsets, in_len, tgt_len, la, nll = ctx.saved_tensors
        blank, S2, block_s, zero_infinity = ctx.params
        T, N, C = lp.shape
        lb = torch.empty_like(la)
        grad = torch.empty_like(lp)
        warps = max(1, min(8, block_s // 64))
        if N:
            launcher(_ctc_beta_kernel, (N,), 6, constexprs=(_acc(lp.dtype), block_s), num_warps=warps)(
                lp, tgt, offsets, in_len, tgt_len, lb, T, S2, *lp.stride(), blank
            )
            block_c = max(1, min(triton.next_power_of_2(C), 4096 // block_s))
            launcher(
                _ctc_grad_kernel,
                (T, N),
                10,
                constexprs=(zero_infinity, _acc(lp.dtype), block_s, block_c),
                num_warps=4,
            )(
                lp,
                tgt,
                offsets,
                in_len,
                tgt_len,
                la,
                lb,
                nll,
                gout.contiguous(),
                grad,
                T,
                S2,
                C,
                *lp.stride(),
                blank,
                *grad.stride(),
            )
        return grad, None, None, None, None, None, None, None


# ---------------------------------------------------------------------------------------------
# 4. Public function.


def _lengths(name: str, arg: str, value: object, n: int, device: torch.device) -> list[int]:
    if isinstance(value, torch.Tensor):
        if value.dtype not in (torch.int32, torch.int64) or value.ndim != 1:
            raise TypeError(
                f"{name}: argument '{arg}' must be a 1-D int tensor, got {value.dtype} {tuple(value.shape)}"
            )
        items = value.tolist()
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        raise TypeError(
            f"{name}: argument '{arg}' must be a tensor, list or tuple, got {type(value).__name__}"
        )
    if len(items) != n or not all(isinstance(v, int) and not isinstance(v, bool) for v in items):
        raise ValueError(f"{name}: argument '{arg}' must hold {n} ints, got {items}")
    return items


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
            (unbatched: (S,)). Labels must be in [0, C) and differ from ``blank``.
        input_lengths: (N,) lengths in [1, T]; target_lengths: (N,) lengths (at most S when padded).
        blank: the blank label.
        reduction: ``"none"`` (per sample), ``"mean"`` (each loss divided by its target length,
            then averaged) or ``"sum"``.
        zero_infinity: impossible alignments (infinite loss) give 0 loss and 0 gradient.

    Differentiable with respect to ``log_probs`` (PyTorch's gradient form); deterministic.
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
    in_len = _lengths(name, "input_lengths", input_lengths, N, log_probs.device)
    tgt_len = _lengths(name, "target_lengths", target_lengths, N, log_probs.device)
    if any(not 1 <= v <= T for v in in_len):
        raise ValueError(f"{name}: input_lengths {in_len} must be in [1, {T}]")
    if any(v < 0 for v in tgt_len):
        raise ValueError(f"{name}: target_lengths {tgt_len} must be non-negative")
    if targets.ndim == 2:
        if targets.shape[0] != N or any(v > targets.shape[1] for v in tgt_len):
            raise ValueError(
                f"{name}: padded targets of shape {tuple(targets.shape)} do not fit batch {N} and "
                f"target_lengths {tgt_len}"
            )
        tgt = targets.contiguous()
        offsets = [n * targets.shape[1] for n in range(N)]
    else:
        if targets.shape[0] != sum(tgt_len):
            raise ValueError(
                f"{name}: 1-D targets hold {targets.shape[0]} labels; target_lengths sum to {sum(tgt_len)}"
            )
        tgt = targets.contiguous()
        offsets = [sum(tgt_len[:n]) for n in range(N)]
    dev = log_probs.device
    as_tensor = lambda v: torch.tensor(v, dtype=torch.int64, device=dev)
    max_len = max(tgt_len, default=0)
    nll = _CTCFunction.apply(
        log_probs,
        tgt,
        as_tensor(offsets),
        as_tensor(in_len),
        as_tensor(tgt_len),
        blank,
        max_len,
        bool(zero_infinity),
    )
    if reduction == "none":
        return nll[0] if unbatched else nll
    if reduction == "sum":
        return nll.sum()
    divisor = as_tensor(tgt_len).clamp(min=1).to(nll.dtype)
    return (nll / divisor).mean()


__all__ = ["ctc_loss", "ctc_loss_reference"]
