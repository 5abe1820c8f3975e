"""What the attention kernels share: the problem, the score modifications and the block ranges.

Conventions of every attention kernel (documented once):

* Tensors are walked as logical BHSD with four strides each, ``s<x>b, s<x>h, s<x>s, s<x>d`` (batch,
  head, sequence, head dim), so BHSD, BSHD and any other strides need no copy. Packed sequences
  (``VARLEN == 2``) pass a batch stride of 0 and start sequence ``b`` at row ``cu_seqlens[b]``;
  per-batch lengths over padded tensors (``VARLEN == 1``) read ``lens[b]``. With a paged KV cache
  (``PAGE > 0``) k/v are (pages, PAGE, Hkv, D) and key ``j`` of batch ``b`` lives in page
  ``block_table[b, j // PAGE]`` at row ``j % PAGE``: the k/v batch stride is then the page stride.
* Scores are kept in the log2 domain: ``s2 = log2(e) * (scale * q.k + bias + alibi)`` (or with the
  tanh soft-cap ``cap * tanh(scale * q.k / cap)`` in place of ``scale * q.k``), so the softmax uses
  ``exp2`` and ``log2(e)`` is folded into the scale once. The log-sum-exp the kernels store is in
  natural units (what ``F.scaled_dot_product_attention``'s flash backend returns): -inf for a row
  with no key (its output is 0), which the backward reads as +inf so every probability is 0.
* Masks: query ``i`` may see key ``j`` iff ``i + diag - left <= j <= i + diag + right`` (``diag``
  is ``Skv - Sq`` of the batch's own lengths for bottom-right alignment, else 0; causal is
  ``right = 0``), ``j < Skv``, and the bool mask (if any) is True there. Blocks entirely inside
  these bounds run the unmasked loop body (``BOUNDARY=False``); only the blocks crossing a bound pay
  for the masks and the bounds checks of their loads.
* Dropout keeps a probability where ``tl.rand(seed, offset + (bh * Sq + i) * Skv + j) >= p``
  (Philox, int64 counters; ``bh`` the batch * Hq + query head; Sq/Skv the padded or max lengths), so
  the backward and ``dropout_keep_mask`` replay the forward's mask exactly.
"""

from __future__ import annotations

import dataclasses

import triton
import triton.language as tl

from ...core.backend import INTERPRET
from ...core.engine import Problem

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@dataclasses.dataclass(frozen=True)
class AttentionProblem(Problem):
    """One launch family member: the forward (``kind="fwd"``), split-KV decode (``"decode"``) or
    backward (``"bwd"``) of attention with fixed shapes, strides, dtypes and options.

    ``batch`` counts sequences (``len(cu_seqlens) - 1`` when packed); ``seqlen_q/kv`` are the padded
    or maximum lengths; ``strides`` maps each tensor name to its four BHSD strides; ``window`` is
    (left, right) with -1 unbounded (causal already folded into right); ``mask``/``bias`` are the
    four strides of a bool mask / additive float bias or None; ``varlen`` 0 none, 1 per-batch
    lengths, 2 packed; ``page`` the paged cache's page size or 0.
    """

    kind: str
    batch: int
    heads_q: int
    heads_kv: int
    seqlen_q: int
    seqlen_kv: int
    head_dim: int
    head_dim_v: int
    dtype: str
    out_dtype: str
    strides: tuple[tuple[str, tuple[int, ...]], ...]
    window: tuple[int, int]
    bottom_right: bool
    mask: tuple[int, ...] | None
    bias: tuple[int, ...] | None
    bias_grad: bool
    alibi: int | None  # the slopes' batch stride (0 for per-head slopes)
    softcap: bool
    sinks: bool
    varlen: int
    page: int
    block_table_stride: int
    dropout: bool
    fp8: bool
    tf32: bool
    deterministic: bool
    index_64: bool

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv

    def stride(self, name: str) -> tuple[int, ...]:
        return dict(self.strides)[name]

    @property
    def flops(self) -> float:
        """4 * B * Hq * Sq * Skv * D (QK^T and PV), halved for a causal mask (forward)."""
        f = (
            2.0
            * self.batch
            * self.heads_q
            * self.seqlen_q
            * self.seqlen_kv
            * (self.head_dim + self.head_dim_v)
        )
        return f / 2 if self.window[1] == 0 and self.window[0] < 0 else f


def descriptors_fit(problem, names, interpret: bool = INTERPRET, size: int = 0) -> bool:
    """Whether tensors ``names`` (of the problem's dtype, or of ``size``-byte elements) can be
    accessed through tensor descriptors: a GPU, no paged cache, a contiguous last dimension (the
    head dim; the sequence for the log-sum-exp) and 16-byte-aligned strides for the others (base
    addresses are checked per call)."""
    if interpret or problem.page:
        return False
    if not size:
        size = 1 if problem.fp8 else {"float16": 2, "bfloat16": 2, "float32": 4}.get(problem.dtype, 0)
    if not size:
        return False
    for n in names:
        st = problem.stride(n)  # (b, h, s, d), or (b, h, s) for the log-sum-exp
        if st[-1] not in (0, 1) or any(x * size % 16 for x in st[:-1]):
            return False
    return True


def aligned(*tensors) -> bool:
    """All base addresses 16-byte aligned (what a tensor descriptor needs)."""
    ptrs = 0
    for t in tensors:
        ptrs |= t.data_ptr()
    return not ptrs & 15


@triton.jit
def dot(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ b in fp32. UPCAST: bf16 under the interpreter (its bf16 dot is wrong; products of
    bf16 values are exact in fp32). PRECISION: "ieee" or "tf32" for fp32 operands."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=PRECISION, out_dtype=tl.float32)


@triton.jit
def seq_bounds(LENS_Q, LENS_KV, b, seqlen_q_max, seqlen_kv_max, VARLEN: tl.constexpr):
    """(first row of q, Sq, first row of k/v, Skv) of batch b."""
    if VARLEN == 1:
        return 0, tl.load(LENS_Q + b), 0, tl.load(LENS_KV + b)
    elif VARLEN == 2:
        q0 = tl.load(LENS_Q + b)
        k0 = tl.load(LENS_KV + b)
        return q0, tl.load(LENS_Q + b + 1) - q0, k0, tl.load(LENS_KV + b + 1) - k0
    else:
        return 0, seqlen_q_max, 0, seqlen_kv_max


@triton.jit
def row_offset(row, INDEX_64: tl.constexpr):
    """A row index as the offsets' integer type: int64 only where some offset of the problem needs
    it (``AttentionProblem.index_64``); int32 address arithmetic is about half the instructions."""
    if INDEX_64:
        return row.to(tl.int64)
    return row


@triton.jit
def kv_rows(BT_ROW, j, kv0, skb, sks, valid, PAGE: tl.constexpr, BOUNDARY: tl.constexpr):
    """Memory offsets (int64) of keys ``j`` relative to the k/v head base: rows of one sequence, or
    rows of pages listed in the batch's block-table row ``BT_ROW``."""
    if PAGE > 0:
        if BOUNDARY:
            page = tl.load(BT_ROW + j // PAGE, mask=valid, other=0)
        else:
            page = tl.load(BT_ROW + j // PAGE)
        return page.to(tl.int64) * skb + (j % PAGE).to(tl.int64) * sks
    else:
        return (kv0 + j).to(tl.int64) * sks


@triton.jit
def key_mask(
    i, j, seqlen_kv, diag, window_left, window_right,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, CHECK_KV: tl.constexpr,
):  # fmt: skip
    """Where query ``i`` may see key ``j``: inside the window band, and ``j < seqlen_kv`` when
    CHECK_KV (callers whose keys are all in range leave it out; at least one bound must apply)."""
    if CHECK_KV:
        keep = j < seqlen_kv
        if HAS_RIGHT:
            keep &= j <= i + diag + window_right
    else:
        tl.static_assert(HAS_LEFT or HAS_RIGHT)
        if HAS_RIGHT:
            keep = j <= i + diag + window_right
        else:
            keep = j >= i + diag - window_left
    if HAS_LEFT and (CHECK_KV or HAS_RIGHT):
        keep &= j >= i + diag - window_left
    return keep


@triton.jit
def modify(
    x, i, j, seqlen_q, seqlen_kv, diag, window_left, window_right, slope2,
    MASK_ROW, smq, smk, BIAS_ROW, sbq, sbk,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_ALIBI: tl.constexpr, BOUNDARY: tl.constexpr,
):  # fmt: skip
    """Scores ``x`` (log2 domain, already scaled/capped) at queries ``i`` and keys ``j`` (broadcastable
    index tiles, either orientation) plus bias and ALiBi, with -inf where the key is masked.
    ``MASK_ROW``/``BIAS_ROW`` point at the (batch, head) of the mask/bias; ``slope2`` is
    log2(e) * the ALiBi slope. The band and bounds masks apply only on BOUNDARY blocks."""
    if HAS_BIAS:
        inside = (i < seqlen_q) & (j < seqlen_kv)
        bias = tl.load(BIAS_ROW + i.to(tl.int64) * sbq + j * sbk, mask=inside, other=0.0)
        x += bias.to(tl.float32) * 1.4426950408889634
    if HAS_ALIBI:
        x -= slope2 * tl.abs(i + diag - j).to(tl.float32)
    if BOUNDARY:
        keep = key_mask(i, j, seqlen_kv, diag, window_left, window_right, HAS_LEFT, HAS_RIGHT, True)
        if HAS_MASK:
            keep &= (
                tl.load(MASK_ROW + i.to(tl.int64) * smq + j * smk, mask=keep & (i < seqlen_q), other=0) != 0
            )
        x = tl.where(keep, x, -float("inf"))
    elif HAS_MASK:
        keep = tl.load(MASK_ROW + i.to(tl.int64) * smq + j * smk, mask=i < seqlen_q, other=0) != 0
        x = tl.where(keep, x, -float("inf"))
    return x


@triton.jit
def kv_range(
    m0, seqlen_kv, diag, window_left, window_right,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Key blocks queries [m0, m0 + BLOCK_M) see: (lo, full_lo, full_hi, hi). Blocks starting in
    [lo, full_lo) and [full_hi, hi) cross a bound (masked); [full_lo, full_hi) are entirely inside
    (unmasked). All are multiples of BLOCK_N except hi (exclusive end of the keys)."""
    lo = 0
    hi = seqlen_kv
    full_lo = 0
    full_hi = (seqlen_kv // BLOCK_N) * BLOCK_N
    if HAS_RIGHT:
        hi = tl.minimum(hi, m0 + BLOCK_M + diag + window_right)
        full_hi = tl.minimum(full_hi, (tl.maximum(m0 + diag + window_right + 1, 0) // BLOCK_N) * BLOCK_N)
    if HAS_LEFT:
        lo = (tl.maximum(m0 + diag - window_left, 0) // BLOCK_N) * BLOCK_N
        first_full = tl.maximum(m0 + BLOCK_M - 1 + diag - window_left, 0)
        full_lo = ((first_full + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
    hi = tl.maximum(hi, lo)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), ((hi + BLOCK_N - 1) // BLOCK_N) * BLOCK_N)
    full_hi = tl.maximum(full_hi, full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def q_range(
    n0, seqlen_q, seqlen_kv, diag, window_left, window_right,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Query blocks that see keys [n0, n0 + BLOCK_N): (lo, full_lo, full_hi, hi) as ``kv_range``,
    in multiples of BLOCK_M. A key block crossing Skv masks every query block."""
    lo = 0
    hi = seqlen_q
    full_lo = 0
    full_hi = (seqlen_q // BLOCK_M) * BLOCK_M
    if n0 + BLOCK_N > seqlen_kv:
        full_hi = 0
    if HAS_RIGHT:
        lo = (tl.maximum(n0 - diag - window_right, 0) // BLOCK_M) * BLOCK_M
        first_full = tl.maximum(n0 + BLOCK_N - 1 - diag - window_right, 0)
        full_lo = ((first_full + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
    if HAS_LEFT:
        hi = tl.minimum(hi, n0 + BLOCK_N + window_left - diag)
        full_hi = tl.minimum(full_hi, (tl.maximum(n0 + window_left - diag + 1, 0) // BLOCK_M) * BLOCK_M)
    hi = tl.maximum(hi, lo)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), ((hi + BLOCK_M - 1) // BLOCK_M) * BLOCK_M)
    full_hi = tl.maximum(full_hi, full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def dropout_keep(seed, base, i, j, seqlen_kv_max, p):
    """True where the probability at (i, j) is kept; ``base`` = offset + bh * Sq * Skv (int64)."""
    return tl.rand(seed, base + i.to(tl.int64) * seqlen_kv_max + j) >= p


@triton.jit
def softcap_scores(qk, qk_scale, cap_scale, SOFTCAP: tl.constexpr):
    """(log2-domain scores, tanh value or None): ``qk * qk_scale`` or ``cap_scale * tanh(qk * qk_scale)``
    where qk_scale is scale / cap (then cap_scale is cap * log2 e)."""
    if SOFTCAP:
        t = _tanh(qk * qk_scale)
        return t * cap_scale, t
    else:
        return qk * qk_scale, qk


@triton.jit
def _tanh(x):
    # 1 - 2 / (exp(2x) + 1): exact limits +-1, one exp2 and one division, fine to 1 ulp-ish in fp32
    # except tiny |x| (relative error there is bounded by the absolute error of ~1e-7, which the
    # scores' rounding dwarfs).
    return 1.0 - 2.0 / (tl.math.exp2(x * 2.8853900817779268) + 1.0)


@triton.jit
def load_tile(ptrs, rows_ok, cols_ok, CHECK_ROWS: tl.constexpr, EVEN_COLS: tl.constexpr):
    """A tile, bounds-checked only where needed: rows on boundary blocks, columns (the head dim)
    when it is not a power of 2."""
    if CHECK_ROWS:
        if EVEN_COLS:
            return tl.load(ptrs, mask=rows_ok, other=0.0)
        else:
            return tl.load(ptrs, mask=rows_ok & cols_ok, other=0.0)
    else:
        if EVEN_COLS:
            return tl.load(ptrs)
        else:
            return tl.load(ptrs, mask=cols_ok, other=0.0)


def block_d(d: int) -> int:
    """The power-of-2 tile width a head dim is padded to (at least 16, what tl.dot needs)."""
    return max(16, triton.next_power_of_2(d))


def window_flags(window: tuple[int, int]) -> tuple[bool, bool, int, int]:
    """(HAS_LEFT, HAS_RIGHT, left, right) for the kernels; -1 is unbounded."""
    left, right = window
    return left >= 0, right >= 0, max(left, 0), max(right, 0)
