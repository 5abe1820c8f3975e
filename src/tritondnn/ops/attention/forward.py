"""Flash-attention forward: one program per (query block, batch * query head), streaming key/value
blocks through an online softmax in registers, so memory is O(B * H * S * D) and nothing of size
Sq x Skv is ever stored.

Kernel arguments (conventions in ``common``):

* Tensors: ``Q, K, V, O`` (BHSD strides), ``LSE`` [B, Hq, Sq] fp32 (strides ``slb, slh, sls``),
  ``MASK`` (bool, strides ``sm*``), ``BIAS`` (strides ``sb*``), ``ALIBI`` slopes (``sab`` batch
  stride, 1 per head), ``SINKS`` [Hq], ``LENS_Q/LENS_KV`` (int32 lengths or cumulative offsets),
  ``BT`` block table (``btb`` batch stride), ``RNG`` int64 [seed, offset], ``DESCALE`` fp32 [3]
  (fp8 q, k, v descales). Absent tensors are passed as ``Q`` and never read.
* Floats: ``qk_scale`` (log2 e * scale, or scale / cap with soft-capping), ``cap_scale``
  (cap * log2 e), ``dropout_p``.
* Ints: the max lengths, Hq and the GQA group size (query heads per kv head), strides, the window
  bounds, and the true head dims (``BLOCK_D``/``BLOCK_DV`` are their powers of 2).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from ...core.backend import INTERPRET
from ...core.launcher import cdiv, ensure_allocator, launcher
from .common import (
    aligned,
    block_d,
    descriptors_fit,
    dot,
    dropout_keep,
    key_mask,
    kv_range,
    kv_rows,
    load_tile,
    modify,
    row_offset,
    seq_bounds,
    softcap_scores,
    window_flags,
)


@triton.jit
def _fwd_loop(
    acc, l_i, m_i, q, K_HEAD, V_HEAD, K_DESC, V_DESC, BT_ROW, MASK_ROW, BIAS_ROW, lo, hi, offs_m, kv0,
    seqlen_q, seqlen_kv, diag, window_left, window_right, slope2, qk_scale, cap_scale,
    seed, rng_base, seqlen_kv_max, dropout_p, head_dim, head_dim_v,
    skb, sks, skd, svb, svs, svd, smq, smk, sbq, sbk,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_ALIBI: tl.constexpr, SOFTCAP: tl.constexpr, PAGE: tl.constexpr, DROPOUT: tl.constexpr,
    FP8: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, BOUNDARY: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, EVEN_D: tl.constexpr,
    EVEN_DV: tl.constexpr, DESC: tl.constexpr, VT: tl.constexpr, POS_SCALE: tl.constexpr,
    INDEX_64: tl.constexpr, RAGGED: tl.constexpr,
):  # fmt: skip
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    # Keys of one sequence (no pages): a block's tiles are the first block's pointers (made once)
    # moved by a scalar offset, in int32 where every offset fits (fresh 64-bit addresses per key
    # cost ~30 integer instructions a block).
    rows = row_offset(tl.arange(0, BLOCK_N), INDEX_64)
    kt_first = K_HEAD + rows[None, :] * sks + offs_d[:, None] * skd
    v_first = V_HEAD + rows[:, None] * svs + offs_dv[None, :] * svd
    for start_n in tl.range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        valid_n = offs_n < seqlen_kv
        if DESC:
            kt = tl.trans(K_DESC.load([start_n, 0]))
        else:
            if PAGE > 0:
                k_rows = kv_rows(BT_ROW, offs_n, kv0, skb, sks, valid_n, PAGE, BOUNDARY and RAGGED)
                kt_ptrs = K_HEAD + k_rows[None, :] + offs_d[:, None] * skd
            else:
                kt_ptrs = kt_first + row_offset(kv0 + start_n, INDEX_64) * sks
            kt = load_tile(
                kt_ptrs, valid_n[None, :], (offs_d < head_dim)[:, None], BOUNDARY and RAGGED, EVEN_D
            )
        qk = dot(q, kt, tl.zeros([q.shape[0], BLOCK_N], tl.float32), PRECISION, UPCAST)
        if POS_SCALE and not (HAS_MASK or HAS_BIAS or HAS_ALIBI or SOFTCAP):
            # Scores are the products times a positive scale: a row's max is taken over the raw
            # products and each probability costs one FFMA (scale and shift) before its exp2.
            if BOUNDARY:
                keep = key_mask(
                    offs_m[:, None], offs_n[None, :], seqlen_kv, diag, window_left, window_right,
                    HAS_LEFT, HAS_RIGHT, RAGGED,
                )  # fmt: skip
                qk = tl.where(keep, qk, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            shift = m_new
            if BOUNDARY:
                # A row that has seen only masked keys keeps m = -inf: shift by 0 so exp2 gives 0.
                shift = tl.where(m_new == -float("inf"), 0.0, m_new)
            alpha = tl.math.exp2(m_i - shift)
            p = tl.math.exp2(qk * qk_scale - shift[:, None])
        else:
            s, _ = softcap_scores(qk, qk_scale, cap_scale, SOFTCAP)
            s = modify(
                s, offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_kv, diag, window_left, window_right,
                slope2, MASK_ROW, smq, smk, BIAS_ROW, sbq, sbk,
                HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS, HAS_ALIBI, BOUNDARY,
            )  # fmt: skip
            m_new = tl.maximum(m_i, tl.max(s, 1))
            if BOUNDARY or HAS_MASK:
                # A row that has seen only masked keys keeps m = -inf: shift by 0 so exp2 gives 0,
                # not NaN.
                shift = tl.where(m_new == -float("inf"), 0.0, m_new)
            else:
                shift = m_new  # every score of an unmasked block is finite
            alpha = tl.math.exp2(m_i - shift)
            p = tl.math.exp2(s - shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:
            keep = dropout_keep(seed, rng_base, offs_m[:, None], offs_n[None, :], seqlen_kv_max, dropout_p)
            p = tl.where(keep, p, 0.0)
        if VT:
            v = tl.trans(V_DESC.load([0, start_n]))
        elif DESC:
            v = V_DESC.load([start_n, 0])
        else:
            if PAGE > 0:
                v_rows = kv_rows(BT_ROW, offs_n, kv0, svb, svs, valid_n, PAGE, BOUNDARY and RAGGED)
                v_ptrs = V_HEAD + v_rows[:, None] + offs_dv[None, :] * svd
            else:
                v_ptrs = v_first + row_offset(kv0 + start_n, INDEX_64) * svs
            v = load_tile(
                v_ptrs, valid_n[:, None], (offs_dv < head_dim_v)[None, :], BOUNDARY and RAGGED, EVEN_DV
            )
        if FP8:
            p = p.to(v.dtype)
        else:
            p = p.to(q.dtype)
        acc = dot(p, v, acc * alpha[:, None], PRECISION, UPCAST)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def attention_fwd_kernel(
    Q, K, V, OUT, LSE, MASK, BIAS, ALIBI, SINKS, LENS_Q, LENS_KV, BT, RNG, DESCALE,
    qk_scale, cap_scale, dropout_p,
    seqlen_q_max, seqlen_kv_max, hq, group,
    sqb, sqh, sqs, sqd, skb, skh, sks, skd, svb, svh, svs, svd, sob, soh, sos, sod,
    slb, slh, sls, smb, smh, smq, smk, sbb, sbh, sbq, sbk, sab, btb,
    window_left, window_right,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr, VARLEN: tl.constexpr, PAGE: tl.constexpr, DROPOUT: tl.constexpr,
    FP8: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    head_dim: tl.constexpr, head_dim_v: tl.constexpr, DESC: tl.constexpr, VT: tl.constexpr,
    RAGGED: tl.constexpr, INDEX_64: tl.constexpr, POS_SCALE: tl.constexpr,
):  # fmt: skip
    """OUT = softmax(scores) @ V for BLOCK_M queries of one (batch, query head); LSE of every row."""
    # The heaviest query blocks of a causal mask are the last ones: start them first.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // hq
    h = pid_bh % hq
    hk = h // group
    q0, seqlen_q, kv0, seqlen_kv = seq_bounds(LENS_Q, LENS_KV, b, seqlen_q_max, seqlen_kv_max, VARLEN)
    m0 = pid_m * BLOCK_M
    if VARLEN == 2:  # noqa: SIM102 (a constexpr test, then a runtime one)
        if m0 >= seqlen_q:  # past this packed sequence: those rows belong to the next one
            return
    diag = 0
    if BOTTOM_RIGHT:
        diag = seqlen_kv - seqlen_q
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    b64 = b.to(tl.int64)
    q_ptrs = (
        Q
        + b64 * sqb
        + h.to(tl.int64) * sqh
        + (q0 + offs_m).to(tl.int64)[:, None] * sqs
        + offs_d[None, :] * sqd
    )
    if DESC:
        q_desc = tl.make_tensor_descriptor(
            Q + b64 * sqb + h.to(tl.int64) * sqh + (b64 * 0 + q0) * sqs, [tl.maximum(seqlen_q, 1), head_dim],
            [sqs, 1], [BLOCK_M, BLOCK_D],
        )  # fmt: skip
        q = q_desc.load([m0, 0])
    else:
        q = tl.load(q_ptrs, mask=(offs_m < seqlen_q)[:, None] & (offs_d < head_dim)[None, :], other=0.0)
    if FP8:
        qk_scale = qk_scale * tl.load(DESCALE) * tl.load(DESCALE + 1)
    if PAGE > 0:
        k_head = K + hk.to(tl.int64) * skh
        v_head = V + hk.to(tl.int64) * svh
    else:
        k_head = K + b64 * skb + hk.to(tl.int64) * skh
        v_head = V + b64 * svb + hk.to(tl.int64) * svh
    bt_row = BT + b64 * btb
    k_desc = k_head
    v_desc = v_head
    if DESC:
        # Tiles through the copy engine: rows past this sequence's keys load as zeros (the boundary
        # blocks mask their scores), so no address arithmetic or bounds checks per block.
        k_desc = tl.make_tensor_descriptor(
            k_head + (b64 * 0 + kv0) * sks, [tl.maximum(seqlen_kv, 1), head_dim], [sks, 1], [BLOCK_N, BLOCK_D]
        )
        if VT:
            # fp8: V stored transposed (keys contiguous), the K-major operand fp8 products need.
            v_desc = tl.make_tensor_descriptor(
                v_head, [head_dim_v, tl.maximum(seqlen_kv, 1)], [svd, 1], [BLOCK_DV, BLOCK_N]
            )
        else:
            v_desc = tl.make_tensor_descriptor(
                v_head + (b64 * 0 + kv0) * svs,
                [tl.maximum(seqlen_kv, 1), head_dim_v],
                [svs, 1],
                [BLOCK_N, BLOCK_DV],
            )
    mask_row = MASK + b64 * smb + h.to(tl.int64) * smh
    bias_row = BIAS + b64 * sbb + h.to(tl.int64) * sbh
    slope2 = 0.0
    if HAS_ALIBI:
        slope2 = tl.load(ALIBI + b64 * sab + h).to(tl.float32) * 1.4426950408889634
    seed = 0
    rng_base = 0
    if DROPOUT:
        seed = tl.load(RNG)
        rng_base = tl.load(RNG + 1) + pid_bh.to(tl.int64) * seqlen_q_max * seqlen_kv_max

    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    lo, full_lo, full_hi, hi = kv_range(
        m0, seqlen_kv, diag, window_left, window_right, HAS_LEFT, HAS_RIGHT, BLOCK_M, BLOCK_N
    )
    if m0 >= seqlen_q:  # padded rows past this batch's length: no keys, zero output
        hi = lo
        full_lo = lo
        full_hi = lo
    # Blocks crossing a bound: the window's left edge (first loop) and the causal/right edge or the
    # last keys of a ragged sequence (last loop). Loops that cannot run are not compiled: an empty
    # pipelined loop still costs its prologue and drain.
    if HAS_LEFT:
        acc, l_i, m_i = _fwd_loop(
            acc, l_i, m_i, q, k_head, v_head, k_desc, v_desc, bt_row, mask_row, bias_row,
            lo, full_lo, offs_m, kv0,
            seqlen_q, seqlen_kv, diag, window_left, window_right, slope2, qk_scale, cap_scale,
            seed, rng_base, seqlen_kv_max, dropout_p, head_dim, head_dim_v,
            skb, sks, skd, svb, svs, svd, smq, smk, sbq, sbk,
            HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS, HAS_ALIBI, SOFTCAP, PAGE, DROPOUT, FP8, PRECISION,
            UPCAST, True, BLOCK_N, BLOCK_D, BLOCK_DV, head_dim == BLOCK_D, head_dim_v == BLOCK_DV,
            DESC, VT, POS_SCALE, INDEX_64, RAGGED,
        )  # fmt: skip
    acc, l_i, m_i = _fwd_loop(
        acc, l_i, m_i, q, k_head, v_head, k_desc, v_desc, bt_row, mask_row, bias_row,
        full_lo, full_hi, offs_m, kv0,
        seqlen_q, seqlen_kv, diag, window_left, window_right, slope2, qk_scale, cap_scale,
        seed, rng_base, seqlen_kv_max, dropout_p, head_dim, head_dim_v,
        skb, sks, skd, svb, svs, svd, smq, smk, sbq, sbk,
        HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS, HAS_ALIBI, SOFTCAP, PAGE, DROPOUT, FP8, PRECISION,
        UPCAST, False, BLOCK_N, BLOCK_D, BLOCK_DV, head_dim == BLOCK_D, head_dim_v == BLOCK_DV,
        DESC, VT, POS_SCALE, INDEX_64, RAGGED,
    )  # fmt: skip
    if HAS_RIGHT or RAGGED:
        acc, l_i, m_i = _fwd_loop(
            acc, l_i, m_i, q, k_head, v_head, k_desc, v_desc, bt_row, mask_row, bias_row,
            full_hi, hi, offs_m, kv0,
            seqlen_q, seqlen_kv, diag, window_left, window_right, slope2, qk_scale, cap_scale,
            seed, rng_base, seqlen_kv_max, dropout_p, head_dim, head_dim_v,
            skb, sks, skd, svb, svs, svd, smq, smk, sbq, sbk,
            HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS, HAS_ALIBI, SOFTCAP, PAGE, DROPOUT, FP8, PRECISION,
            UPCAST, True, BLOCK_N, BLOCK_D, BLOCK_DV, head_dim == BLOCK_D, head_dim_v == BLOCK_DV,
            DESC, VT, POS_SCALE, INDEX_64, RAGGED,
        )  # fmt: skip

    if HAS_SINKS:
        # The sink's logit joins the denominator (not the numerator): rescale to the larger max.
        sink = tl.load(SINKS + h).to(tl.float32) * 1.4426950408889634
        m_fin = tl.maximum(m_i, sink)
        alpha = tl.math.exp2(m_i - m_fin)
        l_i = l_i * alpha + tl.math.exp2(sink - m_fin)
        acc = acc * alpha[:, None]
        m_i = m_fin
    row_ok = (offs_m < seqlen_q) & (l_i > 0)
    l_safe = tl.where(row_ok, l_i, 1.0)
    inv = 1.0 / l_safe
    if DROPOUT:
        inv = inv * (1.0 / (1.0 - dropout_p))
    if FP8:
        inv = inv * tl.load(DESCALE + 2)
    out = tl.where(row_ok[:, None], acc * inv[:, None], 0.0)
    lse = tl.where(row_ok, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, -float("inf"))
    rows = offs_m < seqlen_q
    if VARLEN == 1:
        rows = offs_m < seqlen_q_max  # padded rows are written too (zeros, lse -inf)
    o_ptrs = (
        OUT
        + b64 * sob
        + h.to(tl.int64) * soh
        + (q0 + offs_m).to(tl.int64)[:, None] * sos
        + offs_dv[None, :] * sod
    )
    tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=rows[:, None] & (offs_dv < head_dim_v)[None, :])
    lse_ptrs = LSE + b64 * slb + h.to(tl.int64) * slh + (q0 + offs_m).to(tl.int64) * sls
    tl.store(lse_ptrs, lse, mask=rows)


# ---------------------------------------------------------------------------------------------
# Engine.


def forward_configs(problem, interpret: bool) -> list[dict]:
    """Tile shapes worth timing for the forward; the first is the heuristic's pick (measured on
    H100s and H200s: 128-query blocks, 64 under a causal mask at head dim 64; key blocks as wide
    as registers allow for the head dim; tiles through tensor descriptors where the layout
    allows)."""
    if interpret:
        return [{"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}]
    d = max(block_d(problem.head_dim), block_d(problem.head_dim_v))
    # (BLOCK_M, BLOCK_N, warps, stages, descriptors). H100, bf16, 2026-11: D128 128x128 tiles
    # through descriptors 481 TFLOP/s (B4 H32 S4096) against 447 for 128x64 pointer loads; D64
    # (B16 H16 S1024) pointer loads of 128x64 tiles with 8 warps 362 against 327 with 4 warps and
    # 315 through descriptors.
    # A mask, bias or dropout loads more per key block: the deeper 128x128 pipeline would exceed
    # shared memory, so those take the smaller tiles first.
    extra = problem.mask is not None or problem.bias is not None or problem.dropout
    if d <= 64:
        shapes = [
            (128, 64, 8, 3, False),
            (128, 64, 4, 3, False),
            (64, 64, 4, 3, False),
            (128, 64, 4, 3, True),
        ]
        if extra:
            shapes = shapes[1:]
        if problem.window[1] != -1:
            # A right bound (causal): query blocks on the diagonal do part work, less of it with
            # 64 rows. H200 B8 H12 S1024 causal: 52.8 us against 57.0 for 128x64 with 8 warps
            # (cuDNN 48.0); B4 H16 S4096 without a mask 633.6 against 630.5.
            shapes.sort(key=lambda s: s[:4] != (64, 64, 4, 3))
    elif d <= 128 and problem.fp8:
        # H100 fp8 B4 H32 S4096 (kernel and V transpose): 64x128 tiles, 4 warps, 3 stages (two
        # programs fit on an SM) 1.73 ms against 2.06 for 128x128 tiles with 8 warps, 1.78 for
        # 64x64; causal 1.03-1.06 ms against 1.31.
        shapes = [(64, 128, 4, 3, True), (64, 64, 4, 3, True), (64, 64, 4, 4, True), (128, 128, 8, 3, True)]
    elif d <= 128:
        shapes = [
            (128, 128, 8, 3, True),
            (128, 64, 8, 3, True),
            (128, 64, 8, 3, False),
            (64, 64, 4, 3, False),
        ]
        if extra:
            shapes = shapes[2:]
    else:
        shapes = [(64, 64, 4, 2, True), (64, 64, 4, 2, False), (128, 64, 8, 2, True), (64, 32, 4, 2, False)]
    small = max(16, triton.next_power_of_2(problem.seqlen_q))
    fits = descriptors_fit(problem, ("q", "k", "v"))
    out = []
    for bm, bn, w, s, desc in shapes:
        cfg = {
            "BLOCK_M": min(bm, small),
            "BLOCK_N": bn,
            "num_warps": w,
            "num_stages": s,
            "desc": desc and fits,
        }
        if cfg not in out:
            out.append(cfg)
    return out


def bind_forward(problem, config: dict):
    """The launcher of ``attention_fwd_kernel`` for ``problem``: call it with the 14 tensors
    (``Q, K, V, OUT, LSE, MASK, BIAS, ALIBI, SINKS, LENS_Q, LENS_KV, BT, RNG, DESCALE``) and the
    floats ``qk_scale, cap_scale, dropout_p``. Config keys: the tiles, ``num_warps``,
    ``num_stages``, ``desc`` (tensor descriptors; pointer loads for a call with unaligned bases)."""
    desc = bool(config.get("desc")) and descriptors_fit(problem, ("q", "k", "v"))
    plain = _bind_forward(problem, config, False)
    if not desc:
        return plain
    ensure_allocator()
    vt = bool(config.get("vt", problem.fp8)) and problem.varlen != 2
    fast = _bind_forward(problem, config, True, vt)
    if vt:
        # fp8 products take both operands K-major: one transposed copy of V (keys padded to 16
        # bytes) per call, a pass over V, instead of a transpose of every tile in the loop.
        pad = cdiv(problem.seqlen_kv, 16) * 16
        transpose = bind_keys_last(problem)

        def run_vt(q, k, v, *rest):
            if not aligned(q, k):
                return plain(q, k, v, *rest)
            ensure_allocator()
            t = torch.empty(v.shape[0], v.shape[1], v.shape[3], pad, dtype=v.dtype, device=v.device)
            transpose(v, t)
            fast(q, k, t, *rest)

        return run_vt

    def run(q, k, v, *rest):
        if aligned(q, k, v):
            ensure_allocator()
            fast(q, k, v, *rest)
        else:
            plain(q, k, v, *rest)

    return run


def _bind_forward(problem, config: dict, desc: bool, vt: bool = False):
    p = problem
    v_strides = p.stride("v")
    if vt:  # the transposed copy run_vt makes: (B, Hkv, Dv, keys padded to 16)
        pad = cdiv(p.seqlen_kv, 16) * 16
        v_strides = (p.heads_kv * p.head_dim_v * pad, p.head_dim_v * pad, 1, pad)
    bm, bn = config["BLOCK_M"], config["BLOCK_N"]
    has_left, has_right, left, right = window_flags(p.window)
    ints = (
        p.seqlen_q, p.seqlen_kv, p.heads_q, p.group,
        *p.stride("q"), *p.stride("k"), *v_strides, *p.stride("o"), *p.stride("lse"),
        *(p.mask or (0, 0, 0, 0)), *(p.bias or (0, 0, 0, 0)), p.alibi or 0, p.block_table_stride,
        left, right,
    )  # fmt: skip
    constexprs = (
        has_left, has_right, p.bottom_right, p.mask is not None, p.bias is not None, p.alibi is not None,
        p.softcap, p.sinks, p.varlen, p.page, p.dropout, p.fp8, "tf32" if p.tf32 else "ieee",
        INTERPRET and p.dtype == "bfloat16", bm, bn, block_d(p.head_dim), block_d(p.head_dim_v),
        p.head_dim, p.head_dim_v, desc, vt, p.varlen != 0 or p.seqlen_kv % bn != 0, p.index_64,
    )  # fmt: skip
    # The kernel is specialized on the sign of qk_scale (the float after the 14 tensors); each
    # launcher compiles on its first call, so a sign never used costs nothing.
    positive, negative = (
        launcher(
            attention_fwd_kernel,
            (cdiv(p.seqlen_q, bm), p.batch * p.heads_q),
            num_tensors=14,
            ints=ints,
            constexprs=(*constexprs, sign),
            num_warps=config["num_warps"],
            num_stages=config["num_stages"],
        )
        for sign in (True, False)
    )

    def run(*args):
        (positive if args[14] > 0 else negative)(*args)

    return run


@triton.jit
def _keys_last_kernel(
    V, T, heads, seqlen, head_dim, svb, svh, svs, svd, stb, sth, std,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """T[b, h, d, s] = V[b, h, s, d] (T's keys contiguous): tiles load along V's head dim and store
    along T's keys, Triton moving each tile through shared memory so both sides coalesce."""
    s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    b = (tl.program_id(2) // heads).to(tl.int64)
    h = (tl.program_id(2) % heads).to(tl.int64)
    inside = (s < seqlen)[:, None] & (d < head_dim)[None, :]
    x = tl.load(V + b * svb + h * svh + s[:, None].to(tl.int64) * svs + d[None, :] * svd, mask=inside)
    tl.store(T + b * stb + h * sth + d[None, :].to(tl.int64) * std + s[:, None], x, mask=inside)


def bind_keys_last(problem) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """``transpose(v, t)``: V (BHSD strides of ``problem``) into ``t`` (B, Hkv, Dv, keys padded),
    the keys-contiguous copy fp8 products read. H100, 64 MB of fp8: 53 us (2.55 TB/s, 85% of the
    copy rate) where a strided ``copy_`` took 450 us."""
    p = problem
    bs, bd = 128, 64
    pad = cdiv(p.seqlen_kv, 16) * 16
    launch = launcher(
        _keys_last_kernel,
        (cdiv(p.seqlen_kv, bs), cdiv(p.head_dim_v, bd), p.batch * p.heads_kv),
        num_tensors=2,
        ints=(
            p.heads_kv,
            p.seqlen_kv,
            p.head_dim_v,
            *p.stride("v"),
            p.heads_kv * p.head_dim_v * pad,
            p.head_dim_v * pad,
            pad,
        ),
        constexprs=(bs, bd),
        num_warps=4,
    )
    return launch


@triton.jit
def _dropout_mask_kernel(OUT, seed, offset, seqlen_q, seqlen_kv, dropout_p, BLOCK: tl.constexpr):
    """OUT[bh, i, j] = the forward's keep decision (see ``common.dropout_keep``)."""
    pid_bh = tl.program_id(1)
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = idx < seqlen_q * seqlen_kv
    i = idx // seqlen_kv
    j = idx % seqlen_kv
    base = offset + pid_bh.to(tl.int64) * seqlen_q * seqlen_kv
    keep = dropout_keep(seed, base, i, j, seqlen_kv, dropout_p)
    tl.store(OUT + pid_bh.to(tl.int64) * seqlen_q * seqlen_kv + idx, keep.to(tl.int8), mask=inside)


def dropout_mask(batch, heads, seqlen_q, seqlen_kv, dropout_p, seed, offset=0, device=None):
    """The bool keep mask of ``sdpa``'s dropout (see ``tritondnn.ops.attention.dropout_keep_mask``)."""
    from ...core.backend import DEVICE_TYPE

    out = torch.empty(batch, heads, seqlen_q, seqlen_kv, dtype=torch.int8, device=device or DEVICE_TYPE)
    if out.numel():
        block = 1024
        _dropout_mask_kernel[(cdiv(seqlen_q * seqlen_kv, block), batch * heads)](
            out, int(seed), int(offset), seqlen_q, seqlen_kv, float(dropout_p), BLOCK=block
        )
    return out.bool()
