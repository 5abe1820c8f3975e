"""Split-KV decode (flash-decoding): few queries against a long key/value cache.

A forward program per query block has too little work when Sq is 1..16: the keys are split into
chunks over the grid's first axis instead, and every query head of a GQA group shares a program
(rows ``r = g * Sq + i`` of one tile), so each key and value is read from memory once. Each
program writes its chunk's unnormalized output, running max and sum (fp32, log2 domain); the
combine kernel merges the chunks (rescaling to the common max), adds the sinks and writes the
output and log-sum-exp. Supports GQA, causal/window in both alignments, ALiBi, soft-capping,
sinks, per-batch cache lengths and paged caches; masks, bias, dropout, packed sequences and fp8
take the general forward kernel. Arguments follow ``forward`` (conventions in ``common``), plus
``OP`` [splits, B, Hq, Sq, Dv] and ``ML`` [2, splits, B, Hq, Sq] partial results and ``chunk``
(keys per split, a multiple of BLOCK_N).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...core.backend import INTERPRET, multiprocessor_count
from ...core.launcher import cdiv, launcher
from .common import block_d, dot, kv_rows, modify, seq_bounds, softcap_scores, window_flags

MAX_ROWS = 128  # group size * Sq one program holds
MAX_QUERIES = 16
MAX_SPLIT_PAGES = 256  # block-table entries one split holds in registers (paged caches)


@triton.jit
def attention_decode_split_kernel(
    Q, K, V, OP, ML, ALIBI, LENS_Q, LENS_KV, BT,
    qk_scale, cap_scale,
    seqlen_q_max, seqlen_kv_max, hq, hkv, group, chunk, num_splits,
    sqb, sqh, sqs, sqd, skb, skh, sks, skd, svb, svh, svs, svd, sab, btb, window_left, window_right,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BOTTOM_RIGHT: tl.constexpr, HAS_ALIBI: tl.constexpr,
    SOFTCAP: tl.constexpr, VARLEN: tl.constexpr, PAGE: tl.constexpr, SPLIT_PAGES: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, head_dim: tl.constexpr,
    head_dim_v: tl.constexpr,
):  # fmt: skip
    """Partial attention of one key chunk for all queries of one (batch, kv head)."""
    split = tl.program_id(0)
    b = tl.program_id(1) // hkv
    hk = tl.program_id(1) % hkv
    batch = tl.num_programs(1) // hkv
    _, seqlen_q, _, seqlen_kv = seq_bounds(LENS_Q, LENS_KV, b, seqlen_q_max, seqlen_kv_max, VARLEN)
    diag = 0
    if BOTTOM_RIGHT:
        diag = seqlen_kv - seqlen_q
    r = tl.arange(0, BLOCK_M)
    g = r // seqlen_q_max
    i = r % seqlen_q_max
    row_ok = (g < group) & (i < seqlen_q)
    h = hk * group + g
    b64 = b.to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(
        Q + b64 * sqb + h.to(tl.int64)[:, None] * sqh + i.to(tl.int64)[:, None] * sqs + offs_d[None, :] * sqd,
        mask=row_ok[:, None] & (offs_d < head_dim)[None, :], other=0.0,
    )  # fmt: skip
    slope2 = tl.zeros([BLOCK_M, 1], tl.float32)
    if HAS_ALIBI:
        slope2 = (
            tl.load(ALIBI + b64 * sab + h, mask=g < group, other=0.0).to(tl.float32)[:, None]
            * 1.4426950408889634
        )
    if PAGE > 0:
        k_head = K + hk.to(tl.int64) * skh
        v_head = V + hk.to(tl.int64) * svh
    else:
        k_head = K + b64 * skb + hk.to(tl.int64) * skh
        v_head = V + b64 * svb + hk.to(tl.int64) * svh
    bt_row = BT + b64 * btb
    lo = split * chunk
    hi = tl.minimum(lo + chunk, seqlen_kv)
    if HAS_RIGHT:
        hi = tl.minimum(hi, seqlen_q + diag + window_right)
    if HAS_LEFT:
        lo = tl.maximum(lo, (tl.maximum(diag - window_left, 0) // BLOCK_N) * BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    if SPLIT_PAGES > 0:
        # The split's block-table entries, loaded once: a key's page is then gathered from registers,
        # so the key/value loads do not depend on a load in the loop and pipeline as deeply as a
        # contiguous cache's (a table load per block left one tile in flight).
        first_page = lo // PAGE
        slots = tl.arange(0, SPLIT_PAGES)
        split_pages = tl.load(
            bt_row + first_page + slots, mask=first_page + slots < tl.cdiv(hi, PAGE), other=0
        )
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        valid_n = offs_n < hi
        if SPLIT_PAGES > 0 and PAGE % BLOCK_N == 0:
            # The block lies in one page: its rows are a contiguous cache's, from one scalar page.
            page = tl.sum(tl.where(slots == start_n // PAGE - first_page, split_pages, 0), 0).to(tl.int64)
            in_page = (start_n % PAGE + tl.arange(0, BLOCK_N)).to(tl.int64)
            k_rows = page * skb + in_page * sks
            v_rows = page * svb + in_page * svs
        elif SPLIT_PAGES > 0:
            page = tl.gather(split_pages, tl.minimum(offs_n // PAGE - first_page, SPLIT_PAGES - 1), 0)
            k_rows = page.to(tl.int64) * skb + (offs_n % PAGE).to(tl.int64) * sks
            v_rows = page.to(tl.int64) * svb + (offs_n % PAGE).to(tl.int64) * svs
        else:
            k_rows = kv_rows(bt_row, offs_n, 0, skb, sks, valid_n, PAGE, True)
            v_rows = kv_rows(bt_row, offs_n, 0, svb, svs, valid_n, PAGE, True)
        kt = tl.load(
            k_head + k_rows[None, :] + offs_d[:, None] * skd,
            mask=valid_n[None, :] & (offs_d < head_dim)[:, None], other=0.0,
        )  # fmt: skip
        s = dot(q, kt, tl.zeros([BLOCK_M, BLOCK_N], tl.float32), PRECISION, UPCAST)
        s, _tanh = softcap_scores(s, qk_scale, cap_scale, SOFTCAP)
        s = modify(
            s, i[:, None], offs_n[None, :], seqlen_q, hi, diag, window_left, window_right, slope2,
            Q, 0, 0, Q, 0, 0, HAS_LEFT, HAS_RIGHT, False, False, HAS_ALIBI, True,
        )  # fmt: skip
        m_new = tl.maximum(m_i, tl.max(s, 1))
        shift = tl.where(m_new == -float("inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - shift)
        p = tl.math.exp2(s - shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_head + v_rows[:, None] + offs_dv[None, :] * svd,
            mask=valid_n[:, None] & (offs_dv < head_dim_v)[None, :], other=0.0,
        )  # fmt: skip
        acc = dot(p.to(q.dtype), v, acc * alpha[:, None], PRECISION, UPCAST)
        m_i = m_new
    # Partial results at [split, b, h, i]; rows of absent heads are not stored.
    row = ((split * batch + b) * hq + h).to(tl.int64) * seqlen_q_max + i
    store = (g < group) & (i < seqlen_q_max)
    tl.store(OP + row[:, None] * BLOCK_DV + offs_dv[None, :], acc, mask=store[:, None])
    total = num_splits * batch * hq * seqlen_q_max
    tl.store(ML + row, m_i, mask=store)
    tl.store(ML + total + row, l_i, mask=store)


@triton.jit
def attention_decode_combine_kernel(
    OP, ML, OUT, LSE, SINKS, LENS_Q, LENS_KV,
    seqlen_q_max, batch, hq, num_splits,
    sob, soh, sos, sod, slb, slh, sls,
    HAS_SINKS: tl.constexpr, VARLEN: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_DV: tl.constexpr,
    head_dim_v: tl.constexpr,
):  # fmt: skip
    """OUT and LSE of every query of one (batch, query head) from the splits' partial results."""
    pid = tl.program_id(0)
    b = pid // hq
    h = pid % hq
    _, seqlen_q, _, _ = seq_bounds(LENS_Q, LENS_KV, b, seqlen_q_max, 0, VARLEN)
    i = tl.arange(0, BLOCK_Q)
    offs_dv = tl.arange(0, BLOCK_DV)
    inside = i < seqlen_q_max
    m = tl.full([BLOCK_Q], -float("inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_DV], tl.float32)
    total = num_splits * batch * hq * seqlen_q_max
    for s in range(0, num_splits):
        row = ((s * batch + b) * hq + h).to(tl.int64) * seqlen_q_max + i
        m_s = tl.load(ML + row, mask=inside, other=-float("inf"))
        l_s = tl.load(ML + total + row, mask=inside, other=0.0)
        o_s = tl.load(OP + row[:, None] * BLOCK_DV + offs_dv[None, :], mask=inside[:, None], other=0.0)
        m_new = tl.maximum(m, m_s)
        shift = tl.where(m_new == -float("inf"), 0.0, m_new)
        a = tl.math.exp2(m - shift)
        c = tl.math.exp2(m_s - shift)
        l_sum = l_sum * a + l_s * c
        acc = acc * a[:, None] + o_s * c[:, None]
        m = m_new
    if HAS_SINKS:
        sink = tl.load(SINKS + h).to(tl.float32) * 1.4426950408889634
        m_fin = tl.maximum(m, sink)
        a = tl.math.exp2(m - m_fin)
        l_sum = l_sum * a + tl.math.exp2(sink - m_fin)
        acc = acc * a[:, None]
        m = m_fin
    ok = (i < seqlen_q) & (l_sum > 0)
    l_safe = tl.where(ok, l_sum, 1.0)
    out = tl.where(ok[:, None], acc / l_safe[:, None], 0.0)
    lse = tl.where(ok, (m + tl.math.log2(l_safe)) * 0.6931471805599453, -float("inf"))
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    tl.store(
        OUT + b64 * sob + h64 * soh + i[:, None].to(tl.int64) * sos + offs_dv[None, :] * sod,
        out.to(OUT.dtype.element_ty), mask=inside[:, None] & (offs_dv < head_dim_v)[None, :],
    )  # fmt: skip
    tl.store(LSE + b64 * slb + h64 * slh + i.to(tl.int64) * sls, lse, mask=inside)


def decode_supported(p) -> list[str]:
    """Why the decode engine cannot run problem ``p`` (empty: it can)."""
    reasons = []
    if p.seqlen_q > MAX_QUERIES:
        reasons.append(f"{p.seqlen_q} queries; decode takes 1..{MAX_QUERIES}")
    elif p.group * p.seqlen_q > MAX_ROWS:
        reasons.append(
            f"group size * queries = {p.group * p.seqlen_q} exceeds {MAX_ROWS} rows a program holds"
        )
    if p.mask is not None or p.bias is not None:
        reasons.append("masks and bias take the general forward kernel")
    if p.dropout:
        reasons.append("dropout takes the general forward kernel")
    if p.varlen == 2:
        reasons.append("packed sequences take the general forward kernel")
    if p.fp8:
        reasons.append("fp8 takes the general forward kernel")
    return reasons


def bind_decode(p, config: dict):
    """A callable taking the forward's 14 tensors and 3 floats (``forward.bind_forward``)."""
    bn = config["BLOCK_N"]
    has_left, has_right, left, right = window_flags(p.window)
    bd, bdv = block_d(p.head_dim), block_d(p.head_dim_v)
    rows = max(16, triton.next_power_of_2(p.group * p.seqlen_q))
    programs = p.batch * p.heads_kv
    # Enough programs to keep every SM streaming keys: ``waves`` programs per SM (config).
    waves = config.get("waves", 2)
    splits = max(1, min(cdiv(p.seqlen_kv, bn), cdiv(waves * multiprocessor_count(), programs), 256))
    if p.page:
        # A split's page list stays in registers: at most MAX_SPLIT_PAGES pages per split.
        splits = max(splits, cdiv(p.seqlen_kv, (MAX_SPLIT_PAGES - 1) * p.page))
    chunk = cdiv(cdiv(p.seqlen_kv, splits), bn) * bn
    splits = cdiv(p.seqlen_kv, chunk)
    # Pages one split's keys can touch: its chunk, plus one when the chunk starts inside a page.
    split_pages = triton.next_power_of_2(cdiv(chunk, p.page) + 1) if p.page else 0
    split_launch = launcher(
        attention_decode_split_kernel,
        (splits, programs),
        num_tensors=9,
        ints=(
            p.seqlen_q, p.seqlen_kv, p.heads_q, p.heads_kv, p.group, chunk, splits,
            *p.stride("q"), *p.stride("k"), *p.stride("v"), p.alibi or 0, p.block_table_stride, left, right,
        ),
        constexprs=(
            has_left, has_right, p.bottom_right, p.alibi is not None, p.softcap, p.varlen, p.page,
            split_pages, "tf32" if p.tf32 else "ieee", INTERPRET and p.dtype == "bfloat16",
            rows, bn, bd, bdv, p.head_dim, p.head_dim_v,
        ),
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )  # fmt: skip
    combine = launcher(
        attention_decode_combine_kernel,
        (p.batch * p.heads_q,),
        num_tensors=7,
        ints=(p.seqlen_q, p.batch, p.heads_q, splits, *p.stride("o"), *p.stride("lse")),
        constexprs=(p.sinks, p.varlen, max(16, triton.next_power_of_2(p.seqlen_q)), bdv, p.head_dim_v),
    )

    def run(q, k, v, o, lse, mask, bias, alibi, sinks, lens_q, lens_kv, bt, rng, descale,
            qk_scale, cap_scale, dropout_p):  # fmt: skip
        part = torch.empty(
            splits * p.batch * p.heads_q * p.seqlen_q, bdv, device=q.device, dtype=torch.float32
        )
        ml = torch.empty(2, splits * p.batch * p.heads_q * p.seqlen_q, device=q.device, dtype=torch.float32)
        split_launch(q, k, v, part, ml, alibi, lens_q, lens_kv, bt, qk_scale, cap_scale)
        combine(part, ml, o, lse, sinks, lens_q, lens_kv)

    return run
