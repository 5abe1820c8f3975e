"""Dropout with a counter-based Philox generator, and dropout fused with a residual add.

The mask is a pure function of ``(seed, offset, element index)``: no state is kept between calls,
the same seed and offset give the same mask on every device and run, and the backward pass
regenerates the mask instead of storing it (one bit per element is never written unless asked for).

Random numbers: Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3"),
keyed by the 64-bit ``seed``. One Philox counter yields four 32-bit words, so elements are taken
in groups of ``GROUP = 4096``: element ``e`` uses word ``(e % 4096) // 1024`` of counter
``offset + (e // 4096) * 1024 + e % 1024``. A call on ``n`` elements therefore uses the counters
``offset .. offset + counters_used(n) - 1``; to draw an independent mask with the same seed,
advance ``offset`` by at least that (as PyTorch advances its Philox offset). An element is kept
when the top 24 bits of its word are ``>= round(p * 2**24)``: the keep probability is ``1 - p``
to within 6e-8. Elements are numbered in row-major (logical) order, whatever the input's layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from ..core import numerics
from ..core.checks import check_float, check_tensor
from ..core.engine import Engine, Family, LaunchConfig, Problem
from ..core.launcher import cdiv, launcher
from ..core.library import custom_op
from ..core.strides import broadcast_shapes

# Elements per Philox group and counters per group: fixed, since they define the mask.
GROUP = 4096
QUARTER = GROUP // 4
_P_BITS = 24

# ---------------------------------------------------------------------------------------------
# 1. Reference.


def _philox_words(seed: int, counters: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Philox-4x32-10 on int64 ``counters`` (c0 = low word, c1 = high word, c2 = c3 = 0), in plain
    PyTorch int64 arithmetic: the four uint32 output words, as int64 tensors."""
    mask32 = 0xFFFFFFFF
    c0, c1 = counters & mask32, (counters >> 32) & mask32
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    k0, k1 = seed & mask32, (seed >> 32) & mask32
    a, b = 0xD2511F53, 0xCD9E8D57
    for _ in range(10):
        # 32x32 -> 64-bit products in int64 overflow for large values: split one factor in halves.
        pa_hi, pa_lo = _mul64(a, c0)
        pb_hi, pb_lo = _mul64(b, c2)
        c0, c1, c2, c3 = (pb_hi ^ c1 ^ k0, pb_lo, pa_hi ^ c3 ^ k1, pa_lo)
        k0, k1 = (k0 + 0x9E3779B9) & mask32, (k1 + 0xBB67AE85) & mask32
    return c0, c1, c2, c3


def _mul64(const: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact product const * x of two uint32 values as its (high, low) 32-bit words, computed
    in int64 without overflow."""
    lo_c, hi_c = const & 0xFFFF, const >> 16
    low = lo_c * x  # < 2**48
    high = hi_c * x  # < 2**48
    # const * x = high * 2**16 + low; assemble the 64-bit result as hi:lo words.
    total_lo = (low & 0xFFFFFFFF) + ((high & 0xFFFF) << 16)
    carry = total_lo >> 32
    hi = (low >> 32) + (high >> 16) + carry
    return hi & 0xFFFFFFFF, total_lo & 0xFFFFFFFF


def dropout_mask_reference(shape: tuple[int, ...], p: float, seed: int, offset: int = 0) -> torch.Tensor:
    """The keep-mask ``dropout`` uses for ``(seed, offset)``, computed on the CPU in plain PyTorch."""
    n = 1
    for s in shape:
        n *= s
    e = torch.arange(n, dtype=torch.int64)
    counters = offset + (e // GROUP) * QUARTER + e % QUARTER
    words = torch.stack(_philox_words(seed, counters))
    word = words.gather(0, ((e % GROUP) // QUARTER).view(1, -1)).view(-1)
    return ((word >> (32 - _P_BITS)) >= _threshold(p)).view(shape)


def dropout_reference(
    x: torch.Tensor, p: float, seed: int, offset: int = 0, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """``x * mask / (1 - p) (+ residual)`` in float64, with ``dropout``'s mask."""
    keep = dropout_mask_reference(tuple(x.shape), p, seed, offset).to(x.device)
    y = torch.where(keep, x.double() * _scale(p), 0.0)
    return y if residual is None else y + residual.double()


def counters_used(numel: int) -> int:
    """How many Philox counters a call on ``numel`` elements consumes from its ``offset``."""
    return cdiv(numel, GROUP) * QUARTER


def _threshold(p: float) -> int:
    return round(p * 2**_P_BITS)


def _scale(p: float) -> float:
    return 0.0 if p >= 1.0 else 1.0 / (1.0 - p)


# ---------------------------------------------------------------------------------------------
# 2. Kernel.


@triton.jit(do_not_specialize=["seed_lo", "seed_hi", "off_lo", "off_hi", "threshold"])
def _dropout_kernel(
    x_ptr, r_ptr, y_ptr, m_ptr, scale, seed_lo, seed_hi, off_lo, off_hi, threshold, numel,
    HAS_RESIDUAL: tl.constexpr, WRITE_MASK: tl.constexpr, INDEX_64: tl.constexpr,
    GROUPS: tl.constexpr, Q: tl.constexpr,
):  # fmt: skip
    """y = where(keep, x * scale, 0) (+ r) over contiguous tensors of ``numel`` elements.

    x, r, y: input, residual (ignored unless HAS_RESIDUAL), output; m: bool keep-mask (written when
    WRITE_MASK). scale: 1 / (1 - p). seed_lo/hi, off_lo/hi: the 64-bit seed and counter offset as
    signed 32-bit halves (kept in int32 so the compiled signature never changes with the value).
    threshold: round(p * 2**24). GROUPS: Philox groups of 4 * Q elements a program; Q is the
    module's QUARTER (part of the mask's definition, not a tuning knob).
    """
    seed = (seed_hi.to(tl.int64) << 32) | (seed_lo.to(tl.uint32, bitcast=True).to(tl.int64))
    base = (off_hi.to(tl.int64) << 32) | (off_lo.to(tl.uint32, bitcast=True).to(tl.int64))
    pid = tl.program_id(0)
    if INDEX_64:
        pid = pid.to(tl.int64)
    lane = tl.arange(0, Q)
    for g in tl.static_range(GROUPS):
        group = pid * GROUPS + g
        # One Philox call gives the four words of four elements Q apart: four coalesced quarters.
        w0, w1, w2, w3 = tl.randint4x(seed, base + group.to(tl.int64) * Q + lane)
        start = group * (4 * Q)
        for k in tl.static_range(4):
            if k == 0:
                w = w0
            elif k == 1:
                w = w1
            elif k == 2:
                w = w2
            else:
                w = w3
            keep = (w >> (32 - 24)).to(tl.int32) >= threshold
            idx = start + k * Q + lane
            mask = idx < numel
            x = numerics.upcast(tl.load(x_ptr + idx, mask=mask))
            y = tl.where(keep, x * scale, 0.0)
            if HAS_RESIDUAL:
                y += numerics.upcast(tl.load(r_ptr + idx, mask=mask))
            tl.store(y_ptr + idx, y.to(y_ptr.dtype.element_ty), mask=mask)
            if WRITE_MASK:
                tl.store(m_ptr + idx, keep.to(tl.int8), mask=mask)


# ---------------------------------------------------------------------------------------------
# 3. Engine.


@dataclasses.dataclass(frozen=True)
class DropoutProblem(Problem):
    """One launch over contiguous tensors of ``numel`` elements."""

    numel: int
    dtype: str
    residual: bool
    write_mask: bool


def _describe(input: torch.Tensor, residual: bool = False, write_mask: bool = False) -> DropoutProblem:
    """The problem ``dropout(input)`` (``dropout_add`` with ``residual``) poses."""
    return DropoutProblem(input.numel(), str(input.dtype).removeprefix("torch."), residual, write_mask)


FAMILY: Family[DropoutProblem] = Family("dropout", _describe)


@FAMILY.register
class PhiloxEngine(Engine[DropoutProblem]):
    """One pass: Philox words, mask, scale, residual add and store, 4 * QUARTER elements a group."""

    name = "philox"

    def cost(self, problem: DropoutProblem) -> float:
        return 1.0

    def configs(self, problem: DropoutProblem) -> list[LaunchConfig]:
        # A group is 4096 elements (8 KB of bf16): one group a program with 4 warps keeps 16-byte
        # accesses per thread and enough programs in flight; Philox's 10 rounds are shared by four.
        return [{"GROUPS": 1, "num_warps": 4}, {"GROUPS": 1, "num_warps": 8}, {"GROUPS": 2, "num_warps": 8}]

    def bind(self, problem: DropoutProblem, config: LaunchConfig) -> Callable[..., None]:
        groups = config["GROUPS"]
        return launcher(
            _dropout_kernel,
            (max(1, cdiv(problem.numel, GROUP * groups)),),
            num_tensors=4,
            ints=(problem.numel,),
            constexprs=(
                problem.residual,
                problem.write_mask,
                problem.numel + GROUP > 2**31 - 1,
                groups,
                QUARTER,
            ),
            num_warps=config["num_warps"],
        )


def _signed32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - 2**32 if v >= 2**31 else v


def _halves(v: int) -> tuple[int, int]:
    return _signed32(v), _signed32(v >> 32)


def _run(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    y: torch.Tensor,
    mask: torch.Tensor | None,
    p: float,
    seed: int,
    offset: int,
) -> None:
    """Launch on contiguous tensors (``y`` may be ``x``: each element is read before it is written)."""
    has_res, write_mask = residual is not None, mask is not None
    m = mask.view(torch.int8) if mask is not None else y
    args = (x, residual if has_res else x, y, m, _scale(p), *_halves(seed), *_halves(offset), _threshold(p))
    plan = FAMILY.plan(
        (x.numel(), x.dtype, has_res, write_mask),
        lambda: _describe(x, has_res, write_mask),
        lambda: (args[0], args[1], torch.empty_like(y), torch.empty_like(m), *args[4:]),
    )
    plan(*args)


# ---------------------------------------------------------------------------------------------
# 4. torch.library op and autograd.


def _fake(
    x: torch.Tensor, residual: torch.Tensor | None, p: float, seed: int, offset: int, write_mask: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return y, torch.empty(x.shape if write_mask else (0,), dtype=torch.bool, device=x.device)


@custom_op(
    "dropout",
    "(Tensor x, Tensor? residual, float p, int seed, int offset, bool write_mask) -> (Tensor, Tensor)",
    _fake,
)
def _forward(
    x: torch.Tensor, residual: torch.Tensor | None, p: float, seed: int, offset: int, write_mask: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.contiguous()
    residual = residual.contiguous() if residual is not None else None
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    mask = torch.empty(x.shape if write_mask else (0,), dtype=torch.bool, device=x.device)
    if x.numel():
        _run(x, residual, y, mask if write_mask else None, p, seed, offset)
    return y, mask


class _DropoutFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, p, seed, offset, write_mask):
        ctx.params = (p, seed, offset)
        ctx.has_residual = residual is not None
        y, mask = _forward(x, residual, p, seed, offset, write_mask)
        ctx.mark_non_differentiable(mask)
        ctx.set_materialize_grads(False)  # no zeros for the mask's (absent) gradient
        return y, mask

    @staticmethod
    def backward(ctx, dy, _dmask):
        if dy is None:
            return (None,) * 6
        p, seed, offset = ctx.params
        # dx = dy * mask * scale: the forward kernel on dy replays the mask from (seed, offset).
        dx, _ = _forward(dy, None, p, seed, offset, False)
        dr = dy if ctx.has_residual else None
        return dx, dr, None, None, None, None


# ---------------------------------------------------------------------------------------------
# 5. Public functions.


def _draw_seed() -> int:
    """A fresh 63-bit seed from torch's default (CPU) generator: ``torch.manual_seed`` makes it
    reproducible, and no GPU synchronization is needed."""
    return int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64))


def _check_int(op: str, name: str, value: object, limit: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{op}: argument '{name}' must be an int, got {type(value).__name__}")
    if not 0 <= value < limit:
        raise ValueError(f"{op}: argument '{name}'={value} must be in [0, 2**{limit.bit_length() - 1})")
    return value


def _dropout(
    op: str,
    input: torch.Tensor,
    residual: torch.Tensor | None,
    p: float,
    training: bool,
    inplace: bool,
    seed: int | None,
    offset: int,
    return_mask: bool,
):
    check_tensor(op, "input", input)
    p = check_float(op, "p", p)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"{op}: dropout probability has to be between 0 and 1, but got {p}")
    if residual is not None:
        check_tensor(op, "residual", residual)
        if residual.dtype != input.dtype or residual.device != input.device:
            raise TypeError(
                f"{op}: argument 'residual' has dtype {residual.dtype} on {residual.device}; it must "
                f"match 'input' ({input.dtype} on {input.device})"
            )
        try:
            shape = broadcast_shapes(residual.shape, input.shape)
        except RuntimeError:
            shape = None
        if shape != input.shape:
            raise ValueError(
                f"{op}: argument 'residual' of shape {tuple(residual.shape)} does not broadcast to "
                f"'input' of shape {tuple(input.shape)}"
            )
        residual = residual.expand(input.shape)  # autograd sums the gradient back over the expansion
    seed = _draw_seed() if seed is None else _check_int(op, "seed", seed, 2**63)
    offset = _check_int(op, "offset", offset, 2**63)
    if not training or p == 0.0:
        out = input if residual is None else input + residual
        keep = torch.ones(input.shape, dtype=torch.bool, device=input.device)
        return (out, keep) if return_mask else out
    if (input.requires_grad and torch.is_grad_enabled()) or (residual is not None and residual.requires_grad):
        if inplace:
            raise RuntimeError(f"{op}: inplace=True is not supported on a tensor that requires grad")
        y, mask = _DropoutFunction.apply(input, residual, p, seed, offset, return_mask)
    else:
        y, mask = _forward(input, residual, p, seed, offset, return_mask)
        if inplace:
            input.copy_(y)
            y = input
    return (y, mask) if return_mask else y


def dropout(
    input: torch.Tensor,
    p: float = 0.5,
    training: bool = True,
    inplace: bool = False,
    *,
    seed: int | None = None,
    offset: int = 0,
    return_mask: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``F.dropout`` with a stateless Philox mask: zero each element with probability ``p`` and
    scale the rest by ``1 / (1 - p)``.

    Args:
        input: fp16/bf16/fp32/fp64 tensor of any shape and strides. The output is contiguous.
        p: drop probability in [0, 1]; ``p = 1`` gives zeros.
        training: when False (or ``p == 0``) the input is returned unchanged.
        inplace: write the result into ``input`` (not with autograd).
        seed: 64-bit Philox key in [0, 2**63); None draws one from torch's default generator
            (so ``torch.manual_seed`` makes runs reproducible).
        offset: Philox counter offset in [0, 2**63). Same ``(seed, offset)``, same mask; a call uses
            ``counters_used(input.numel())`` counters from ``offset``.
        return_mask: also return the boolean keep-mask (one extra byte written per element).

    The backward pass regenerates the mask from ``(seed, offset)``: nothing is stored.
    Returns the output, or ``(output, mask)`` with ``return_mask``.
    """
    return _dropout("tdnn.dropout", input, None, p, training, inplace, seed, offset, return_mask)


def dropout_add(
    input: torch.Tensor,
    residual: torch.Tensor,
    p: float = 0.5,
    training: bool = True,
    *,
    seed: int | None = None,
    offset: int = 0,
    return_mask: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``residual + dropout(input, p, training)`` in one pass (the transformer's residual branch).

    ``residual`` has ``input``'s dtype and a shape that broadcasts to ``input``'s. The sum is formed
    in fp32 (fp64 for fp64) and rounded once. Other arguments and the mask are those of ``dropout``.
    """
    check_tensor("tdnn.dropout_add", "residual", residual)
    return _dropout("tdnn.dropout_add", input, residual, p, training, False, seed, offset, return_mask)


__all__ = [
    "FAMILY",
    "counters_used",
    "dropout",
    "dropout_add",
    "dropout_mask_reference",
    "dropout_reference",
]
