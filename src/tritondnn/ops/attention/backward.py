"""Flash-attention backward: the probabilities are recomputed block by block from the forward's
log-sum-exp (never stored), in three kernels:

1. ``attention_bwd_preprocess_kernel``: delta = rowsum(dO * O) per query row (and the sinks'
   gradient, per query block, summed on the host in a fixed order);
2. ``attention_bwd_dkdv_kernel``: one program per (key block, batch * kv head) walks every query
   head of its GQA group and every query block that sees its keys, accumulating dK and dV in
   registers: each kv head's gradient is summed in one program in a fixed order, with no atomics,
   so it is deterministic and needs no per-query-head copies of dK/dV;
3. ``attention_bwd_dq_kernel``: one program per (query block, batch * query head) walks the key
   blocks as the forward does and accumulates dQ; deterministic too. The ``atomic-dq`` engine
   instead adds each dQ block from the dkdv kernel with fp32 atomics (two fewer matrix products
   per block, not deterministic), then converts.

Arguments follow the forward's (``forward`` module docstring, conventions in ``common``), plus
``DO, DQ, DK, DV`` (BHSD strides), ``DELTA`` (laid out as ``LSE``), ``DBIAS`` (the full
[B, Hq, Sq, Skv] fp32 gradient of the scores, zero-filled, reduced over broadcast dims on the host)
and ``sm_scale`` (the plain softmax scale, the derivative of the scores in q.k).
"""

from __future__ import annotations

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
    kv_range,
    load_tile,
    modify,
    q_range,
    row_offset,
    seq_bounds,
    softcap_scores,
    window_flags,
)


@triton.jit
def attention_bwd_preprocess_kernel(
    OUT, DO, DELTA, LSE, SINKS, DSINK_PART, LENS_Q, LENS_KV,
    seqlen_q_max, hq,
    sob, soh, sos, sod, sdob, sdoh, sdos, sdod, slb, slh, sls,
    VARLEN: tl.constexpr, HAS_SINKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
    head_dim_v: tl.constexpr,
):  # fmt: skip
    """DELTA[b, h, i] = sum_d dO * OUT (fp32); DSINK_PART[bh, block] = -sum_i P(sink) * delta."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // hq
    h = pid_bh % hq
    q0, seqlen_q, _, _ = seq_bounds(LENS_Q, LENS_KV, b, seqlen_q_max, 0, VARLEN)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    valid = offs_m < seqlen_q
    rows = (q0 + offs_m).to(tl.int64)
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    cols = (offs_dv < head_dim_v)[None, :]
    o = tl.load(
        OUT + b64 * sob + h64 * soh + rows[:, None] * sos + offs_dv[None, :] * sod,
        mask=valid[:, None] & cols,
        other=0.0,
    )
    do = tl.load(
        DO + b64 * sdob + h64 * sdoh + rows[:, None] * sdos + offs_dv[None, :] * sdod,
        mask=valid[:, None] & cols,
        other=0.0,
    )
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    store = valid
    if VARLEN == 1:
        store = offs_m < seqlen_q_max
    tl.store(DELTA + b64 * slb + h64 * slh + rows * sls, delta, mask=store)
    if HAS_SINKS:
        lse = tl.load(LSE + b64 * slb + h64 * slh + rows * sls, mask=valid, other=0.0)
        sink = tl.load(SINKS + h).to(tl.float32)
        p_sink = tl.where(valid, tl.math.exp2((sink - lse) * 1.4426950408889634), 0.0)
        tl.store(DSINK_PART + pid_bh * tl.num_programs(0) + pid_m, -tl.sum(p_sink * delta, 0))


@triton.jit
def _dkdv_loop(
    dk, dv, k, v, Q_HEAD, DO_HEAD, LSE_HEAD, DELTA_HEAD, MASK_ROW, BIAS_ROW, DBIAS_ROW, DQ_HEAD,
    lo, hi, offs_n, q0, seqlen_q, seqlen_kv, diag, window_left, window_right, slope2,
    qk_scale, cap_scale, sm_scale, seed, rng_base, seqlen_kv_max, dropout_p,
    sqs, sqd, sdos, sdod, sls, smq, smk, sbq, sbk, sdbq, sdbk, sdqs, sdqd,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
    BIAS_GRAD: tl.constexpr, HAS_ALIBI: tl.constexpr, SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr,
    ATOMIC_DQ: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, BOUNDARY: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    head_dim: tl.constexpr, head_dim_v: tl.constexpr, INDEX_64: tl.constexpr, DESC: tl.constexpr,
    DQ_DESC: tl.constexpr,
):  # fmt: skip
    # Tiles are transposed (keys along rows, queries along columns) so P^T and dS^T come out of the
    # products in the layout the dK and dV products take. With DESC, Q_HEAD, DO_HEAD, LSE_HEAD and
    # DELTA_HEAD are tensor descriptors (rows past the sequence read as zeros).
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    # The first query block's pointers, moved by a scalar row offset each block.
    first = row_offset(tl.arange(0, BLOCK_M), INDEX_64)
    if not DESC:
        qt_first = Q_HEAD + first[None, :] * sqs + offs_d[:, None] * sqd
        do_first = DO_HEAD + first[:, None] * sdos + offs_dv[None, :] * sdod
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        valid_m = offs_m < seqlen_q
        row0 = row_offset(q0 + start_m, INDEX_64)
        if DESC:
            qt = tl.trans(Q_HEAD.load([start_m, 0]))
        else:
            qt = load_tile(
                qt_first + row0 * sqs, valid_m[None, :], (offs_d < head_dim)[:, None], BOUNDARY,
                head_dim == BLOCK_D,
            )  # fmt: skip
        st = dot(k, qt, tl.zeros([BLOCK_N, BLOCK_M], tl.float32), PRECISION, UPCAST)
        st, t = softcap_scores(st, qk_scale, cap_scale, SOFTCAP)
        st = modify(
            st, offs_m[None, :], offs_n[:, None], seqlen_q, seqlen_kv, diag, window_left, window_right,
            slope2, MASK_ROW, smq, smk, BIAS_ROW, sbq, sbk,
            HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS, HAS_ALIBI, BOUNDARY,
        )  # fmt: skip
        if DESC:
            lse = LSE_HEAD.load([start_m])
            delta = DELTA_HEAD.load([start_m])
            if BOUNDARY:
                lse = tl.where(valid_m, lse, float("inf"))
        else:
            stats = (row0 + first) * sls
            if BOUNDARY:
                lse = tl.load(LSE_HEAD + stats, mask=valid_m, other=float("inf"))
                delta = tl.load(DELTA_HEAD + stats, mask=valid_m, other=0.0)
            else:
                lse = tl.load(LSE_HEAD + stats)
                delta = tl.load(DELTA_HEAD + stats)
        # A row with no key stored lse = -inf: read it as +inf so its probabilities are 0.
        lse2 = tl.where(lse == -float("inf"), float("inf"), lse) * 1.4426950408889634
        pt = tl.math.exp2(st - lse2[None, :])
        if DESC:
            do = DO_HEAD.load([start_m, 0])
        else:
            do = load_tile(
                do_first + row0 * sdos, valid_m[:, None], (offs_dv < head_dim_v)[None, :], BOUNDARY,
                head_dim_v == BLOCK_DV,
            )  # fmt: skip
        dpt = dot(v, tl.trans(do), tl.zeros([BLOCK_N, BLOCK_M], tl.float32), PRECISION, UPCAST)
        if DROPOUT:
            keep = dropout_keep(seed, rng_base, offs_m[None, :], offs_n[:, None], seqlen_kv_max, dropout_p)
            inv_keep = 1.0 / (1.0 - dropout_p)
            dv = dot(tl.where(keep, pt * inv_keep, 0.0).to(do.dtype), do, dv, PRECISION, UPCAST)
            dpt = tl.where(keep, dpt * inv_keep, 0.0)
        else:
            dv = dot(pt.to(do.dtype), do, dv, PRECISION, UPCAST)
        dst = pt * (dpt - delta[None, :])
        if BIAS_GRAD:
            # The bias is added after the soft-cap: its gradient is dS before the tanh's derivative.
            inside = valid_m[None, :] & (offs_n < seqlen_kv)[:, None]
            tl.store(
                DBIAS_ROW + offs_m[None, :].to(tl.int64) * sdbq + offs_n[:, None] * sdbk, dst, mask=inside
            )
        if SOFTCAP:
            dst = dst * (1.0 - t * t)
        dk = dot(dst.to(qt.dtype), tl.trans(qt), dk, PRECISION, UPCAST)
        if ATOMIC_DQ:
            dq = dot(
                tl.trans(dst).to(k.dtype), k, tl.zeros([BLOCK_M, BLOCK_D], tl.float32), PRECISION, UPCAST
            )
            if DQ_DESC:
                # One bulk reduce-add of the tile by the copy engine (TMA); element atomics cost
                # a request per value. Rows past the sequence fall outside the descriptor.
                DQ_HEAD.atomic_add([start_m, 0], dq * sm_scale)
            else:
                dq_mask = valid_m[:, None] & (offs_d < head_dim)[None, :]
                rows = (q0 + offs_m).to(tl.int64)
                tl.atomic_add(
                    DQ_HEAD + rows[:, None] * sdqs + offs_d[None, :] * sdqd, dq * sm_scale, mask=dq_mask
                )
    return dk, dv


@triton.jit
def attention_bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV, LSE, DELTA, MASK, BIAS, DBIAS, ALIBI, LENS_Q, LENS_KV, RNG, DQ,
    qk_scale, cap_scale, dropout_p, sm_scale,
    seqlen_q_max, seqlen_kv_max, hq, hkv, group,
    sqb, sqh, sqs, sqd, skb, skh, sks, skd, svb, svh, svs, svd, sdob, sdoh, sdos, sdod,
    sdkb, sdkh, sdks, sdkd, sdvb, sdvh, sdvs, sdvd, sdqb, sdqh, sdqs, sdqd, slb, slh, sls,
    smb, smh, smq, smk, sbb, sbh, sbq, sbk, sdbb, sdbh, sdbq, sdbk, sab, window_left, window_right,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_GRAD: tl.constexpr, HAS_ALIBI: tl.constexpr,
    SOFTCAP: tl.constexpr, VARLEN: tl.constexpr, DROPOUT: tl.constexpr, ATOMIC_DQ: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    head_dim: tl.constexpr, head_dim_v: tl.constexpr, RAGGED: tl.constexpr, INDEX_64: tl.constexpr,
    DESC: tl.constexpr, DQ_DESC: tl.constexpr,
):  # fmt: skip
    """dK, dV of BLOCK_N keys of one (batch, kv head), summed over its group's query heads."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // hkv
    hk = pid_bh % hkv
    q0, seqlen_q, kv0, seqlen_kv = seq_bounds(LENS_Q, LENS_KV, b, seqlen_q_max, seqlen_kv_max, VARLEN)
    n0 = pid_n * BLOCK_N
    if VARLEN == 2:  # noqa: SIM102 (a constexpr test, then a runtime one)
        if n0 >= seqlen_kv:
            return
    diag = 0
    if BOTTOM_RIGHT:
        diag = seqlen_kv - seqlen_q
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    valid_n = offs_n < seqlen_kv
    kv_rows = (kv0 + offs_n).to(tl.int64)
    b64 = b.to(tl.int64)
    hk64 = hk.to(tl.int64)
    k = tl.load(
        K + b64 * skb + hk64 * skh + kv_rows[:, None] * sks + offs_d[None, :] * skd,
        mask=valid_n[:, None] & (offs_d < head_dim)[None, :], other=0.0,
    )  # fmt: skip
    v = tl.load(
        V + b64 * svb + hk64 * svh + kv_rows[:, None] * svs + offs_dv[None, :] * svd,
        mask=valid_n[:, None] & (offs_dv < head_dim_v)[None, :], other=0.0,
    )  # fmt: skip
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    lo, full_lo, full_hi, hi = q_range(
        n0, seqlen_q, seqlen_kv, diag, window_left, window_right, HAS_LEFT, HAS_RIGHT, BLOCK_M, BLOCK_N
    )
    if n0 >= seqlen_kv:  # padded keys past this batch's length: zero gradients
        hi = lo
        full_lo = lo
        full_hi = lo
    seed = 0
    rng_offset = 0
    if DROPOUT:
        seed = tl.load(RNG)
        rng_offset = tl.load(RNG + 1)
    for g in range(0, group):
        h = hk * group + g
        h64 = h.to(tl.int64)
        q_head = Q + b64 * sqb + h64 * sqh
        do_head = DO + b64 * sdob + h64 * sdoh
        lse_head = LSE + b64 * slb + h64 * slh
        delta_head = DELTA + b64 * slb + h64 * slh
        mask_row = MASK + b64 * smb + h64 * smh
        bias_row = BIAS + b64 * sbb + h64 * sbh
        dbias_row = DBIAS + b64 * sdbb + h64 * sdbh
        dq_head = DQ + b64 * sdqb + h64 * sdqh
        if DESC:
            # Tiles through the copy engine: no address arithmetic or bounds checks per block.
            q_head = tl.make_tensor_descriptor(
                q_head + (b64 * 0 + q0) * sqs, [tl.maximum(seqlen_q, 1), head_dim], [sqs, 1],
                [BLOCK_M, BLOCK_D],
            )  # fmt: skip
            do_head = tl.make_tensor_descriptor(
                do_head + (b64 * 0 + q0) * sdos, [tl.maximum(seqlen_q, 1), head_dim_v], [sdos, 1],
                [BLOCK_M, BLOCK_DV],
            )  # fmt: skip
            lse_head = tl.make_tensor_descriptor(
                lse_head + (b64 * 0 + q0), [tl.maximum(seqlen_q, 1)], [1], [BLOCK_M]
            )
            delta_head = tl.make_tensor_descriptor(
                delta_head + (b64 * 0 + q0), [tl.maximum(seqlen_q, 1)], [1], [BLOCK_M]
            )
        if DQ_DESC:
            dq_head = tl.make_tensor_descriptor(
                dq_head + (b64 * 0 + q0) * sdqs, [tl.maximum(seqlen_q, 1), head_dim], [sdqs, 1],
                [BLOCK_M, BLOCK_D],
            )  # fmt: skip
        slope2 = 0.0
        if HAS_ALIBI:
            slope2 = tl.load(ALIBI + b64 * sab + h).to(tl.float32) * 1.4426950408889634
        rng_base = rng_offset + (b64 * hq + h) * seqlen_q_max * seqlen_kv_max
        # Query blocks crossing a bound: the causal/right edge (first loop), the window's left edge
        # or ragged lengths (last loop); loops that cannot run are not compiled.
        if HAS_RIGHT:
            dk, dv = _dkdv_loop(
                dk, dv, k, v, q_head, do_head, lse_head, delta_head, mask_row, bias_row, dbias_row, dq_head,
                lo, full_lo, offs_n, q0, seqlen_q, seqlen_kv, diag, window_left, window_right, slope2,
                qk_scale, cap_scale, sm_scale, seed, rng_base, seqlen_kv_max, dropout_p,
                sqs, sqd, sdos, sdod, sls, smq, smk, sbq, sbk, sdbq, sdbk, sdqs, sdqd,
                HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS, BIAS_GRAD, HAS_ALIBI, SOFTCAP, DROPOUT, ATOMIC_DQ,
                PRECISION, UPCAST, True, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, head_dim, head_dim_v, INDEX_64,
                DESC, DQ_DESC,
            )  # fmt: skip
        dk, dv = _dkdv_loop(
            dk, dv, k, v, q_head, do_head, lse_head, delta_head, mask_row, bias_row, dbias_row, dq_head,
            full_lo, full_hi, offs_n, q0, seqlen_q, seqlen_kv, diag, window_left, window_right, slope2,
            qk_scale, cap_scale, sm_scale, seed, rng_base, seqlen_kv_max, dropout_p,
            sqs, sqd, sdos, sdod, sls, smq, smk, sbq, sbk, sdbq, sdbk, sdqs, sdqd,
            HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS, BIAS_GRAD, HAS_ALIBI, SOFTCAP, DROPOUT, ATOMIC_DQ,
            PRECISION, UPCAST, False, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, head_dim, head_dim_v, INDEX_64,
            DESC, DQ_DESC,
        )  # fmt: skip
        if HAS_LEFT or RAGGED:
            dk, dv = _dkdv_loop(
                dk, dv, k, v, q_head, do_head, lse_head, delta_head, mask_row, bias_row, dbias_row, dq_head,
                full_hi, hi, offs_n, q0, seqlen_q, seqlen_kv, diag, window_left, window_right, slope2,
                qk_scale, cap_scale, sm_scale, seed, rng_base, seqlen_kv_max, dropout_p,
                sqs, sqd, sdos, sdod, sls, smq, smk, sbq, sbk, sdbq, sdbk, sdqs, sdqd,
                HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS, BIAS_GRAD, HAS_ALIBI, SOFTCAP, DROPOUT, ATOMIC_DQ,
                PRECISION, UPCAST, True, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, head_dim, head_dim_v, INDEX_64,
                DESC, DQ_DESC,
            )  # fmt: skip
    store = valid_n
    if VARLEN == 1:
        store = offs_n < seqlen_kv_max
    tl.store(
        DK + b64 * sdkb + hk64 * sdkh + kv_rows[:, None] * sdks + offs_d[None, :] * sdkd,
        (dk * sm_scale).to(DK.dtype.element_ty), mask=store[:, None] & (offs_d < head_dim)[None, :],
    )  # fmt: skip
    tl.store(
        DV + b64 * sdvb + hk64 * sdvh + kv_rows[:, None] * sdvs + offs_dv[None, :] * sdvd,
        dv.to(DV.dtype.element_ty), mask=store[:, None] & (offs_dv < head_dim_v)[None, :],
    )  # fmt: skip


@triton.jit
def _dq_loop(
    dq, q, do, lse2, delta, K_HEAD, V_HEAD, MASK_ROW, BIAS_ROW, lo, hi, offs_m, kv0,
    seqlen_q, seqlen_kv, diag, window_left, window_right, slope2, qk_scale, cap_scale,
    seed, rng_base, seqlen_kv_max, dropout_p, sks, skd, svs, svd, smq, smk, sbq, sbk,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_ALIBI: tl.constexpr, SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, BOUNDARY: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, head_dim: tl.constexpr, head_dim_v: tl.constexpr, INDEX_64: tl.constexpr,
):  # fmt: skip
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    # The first key block's pointers, moved by a scalar row offset each block.
    first = row_offset(tl.arange(0, BLOCK_N), INDEX_64)
    kt_first = K_HEAD + first[None, :] * sks + offs_d[:, None] * skd
    vt_first = V_HEAD + first[None, :] * svs + offs_dv[:, None] * svd
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        valid_n = offs_n < seqlen_kv
        row0 = row_offset(kv0 + start_n, INDEX_64)
        kt = load_tile(
            kt_first + row0 * sks, valid_n[None, :], (offs_d < head_dim)[:, None], BOUNDARY,
            head_dim == BLOCK_D,
        )  # fmt: skip
        vt = load_tile(
            vt_first + row0 * svs, valid_n[None, :], (offs_dv < head_dim_v)[:, None], BOUNDARY,
            head_dim_v == BLOCK_DV,
        )  # fmt: skip
        s = dot(q, kt, tl.zeros([q.shape[0], BLOCK_N], tl.float32), PRECISION, UPCAST)
        s, t = softcap_scores(s, qk_scale, cap_scale, SOFTCAP)
        s = modify(
            s, offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_kv, diag, window_left, window_right,
            slope2, MASK_ROW, smq, smk, BIAS_ROW, sbq, sbk,
            HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS, HAS_ALIBI, BOUNDARY,
        )  # fmt: skip
        p = tl.math.exp2(s - lse2[:, None])
        dp = dot(do, vt, tl.zeros([q.shape[0], BLOCK_N], tl.float32), PRECISION, UPCAST)
        if DROPOUT:
            keep = dropout_keep(seed, rng_base, offs_m[:, None], offs_n[None, :], seqlen_kv_max, dropout_p)
            dp = tl.where(keep, dp * (1.0 / (1.0 - dropout_p)), 0.0)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq = dot(ds.to(kt.dtype), tl.trans(kt), dq, PRECISION, UPCAST)
    return dq


@triton.jit
def attention_bwd_dq_kernel(
    Q, K, V, DO, DQ, LSE, DELTA, MASK, BIAS, ALIBI, LENS_Q, LENS_KV, RNG,
    qk_scale, cap_scale, dropout_p, sm_scale,
    seqlen_q_max, seqlen_kv_max, hq, group,
    sqb, sqh, sqs, sqd, skb, skh, sks, skd, svb, svh, svs, svd, sdob, sdoh, sdos, sdod,
    sdqb, sdqh, sdqs, sdqd, slb, slh, sls, smb, smh, smq, smk, sbb, sbh, sbq, sbk, sab,
    window_left, window_right,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, SOFTCAP: tl.constexpr,
    VARLEN: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    head_dim: tl.constexpr, head_dim_v: tl.constexpr, RAGGED: tl.constexpr, INDEX_64: tl.constexpr,
):  # fmt: skip
    """dQ of BLOCK_M queries of one (batch, query head)."""
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // hq
    h = pid_bh % hq
    hk = h // group
    q0, seqlen_q, kv0, seqlen_kv = seq_bounds(LENS_Q, LENS_KV, b, seqlen_q_max, seqlen_kv_max, VARLEN)
    m0 = pid_m * BLOCK_M
    if VARLEN == 2:  # noqa: SIM102 (a constexpr test, then a runtime one)
        if m0 >= seqlen_q:
            return
    diag = 0
    if BOTTOM_RIGHT:
        diag = seqlen_kv - seqlen_q
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    valid_m = offs_m < seqlen_q
    rows = (q0 + offs_m).to(tl.int64)
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    hk64 = hk.to(tl.int64)
    q = tl.load(
        Q + b64 * sqb + h64 * sqh + rows[:, None] * sqs + offs_d[None, :] * sqd,
        mask=valid_m[:, None] & (offs_d < head_dim)[None, :], other=0.0,
    )  # fmt: skip
    do = tl.load(
        DO + b64 * sdob + h64 * sdoh + rows[:, None] * sdos + offs_dv[None, :] * sdod,
        mask=valid_m[:, None] & (offs_dv < head_dim_v)[None, :], other=0.0,
    )  # fmt: skip
    lse = tl.load(LSE + b64 * slb + h64 * slh + rows * sls, mask=valid_m, other=float("inf"))
    lse2 = tl.where(lse == -float("inf"), float("inf"), lse) * 1.4426950408889634
    delta = tl.load(DELTA + b64 * slb + h64 * slh + rows * sls, mask=valid_m, other=0.0)
    k_head = K + b64 * skb + hk64 * skh
    v_head = V + b64 * svb + hk64 * svh
    mask_row = MASK + b64 * smb + h64 * smh
    bias_row = BIAS + b64 * sbb + h64 * sbh
    slope2 = 0.0
    if HAS_ALIBI:
        slope2 = tl.load(ALIBI + b64 * sab + h).to(tl.float32) * 1.4426950408889634
    seed = 0
    rng_base = 0
    if DROPOUT:
        seed = tl.load(RNG)
        rng_base = tl.load(RNG + 1) + pid_bh.to(tl.int64) * seqlen_q_max * seqlen_kv_max
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, full_lo, full_hi, hi = kv_range(
        m0, seqlen_kv, diag, window_left, window_right, HAS_LEFT, HAS_RIGHT, BLOCK_M, BLOCK_N
    )
    if m0 >= seqlen_q:
        hi = lo
        full_lo = lo
        full_hi = lo
    # Key blocks crossing a bound, as the forward's: loops that cannot run are not compiled.
    if HAS_LEFT:
        dq = _dq_loop(
            dq, q, do, lse2, delta, k_head, v_head, mask_row, bias_row, lo, full_lo, offs_m, kv0,
            seqlen_q, seqlen_kv, diag, window_left, window_right, slope2, qk_scale, cap_scale,
            seed, rng_base, seqlen_kv_max, dropout_p, sks, skd, svs, svd, smq, smk, sbq, sbk,
            HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS, HAS_ALIBI, SOFTCAP, DROPOUT, PRECISION, UPCAST, True,
            BLOCK_N, BLOCK_D, BLOCK_DV, head_dim, head_dim_v, INDEX_64,
        )  # fmt: skip
    dq = _dq_loop(
        dq, q, do, lse2, delta, k_head, v_head, mask_row, bias_row, full_lo, full_hi, offs_m, kv0,
        seqlen_q, seqlen_kv, diag, window_left, window_right, slope2, qk_scale, cap_scale,
        seed, rng_base, seqlen_kv_max, dropout_p, sks, skd, svs, svd, smq, smk, sbq, sbk,
        HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS, HAS_ALIBI, SOFTCAP, DROPOUT, PRECISION, UPCAST, False,
        BLOCK_N, BLOCK_D, BLOCK_DV, head_dim, head_dim_v, INDEX_64,
    )  # fmt: skip
    if HAS_RIGHT or RAGGED:
        dq = _dq_loop(
            dq, q, do, lse2, delta, k_head, v_head, mask_row, bias_row, full_hi, hi, offs_m, kv0,
            seqlen_q, seqlen_kv, diag, window_left, window_right, slope2, qk_scale, cap_scale,
            seed, rng_base, seqlen_kv_max, dropout_p, sks, skd, svs, svd, smq, smk, sbq, sbk,
            HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS, HAS_ALIBI, SOFTCAP, DROPOUT, PRECISION, UPCAST, True,
            BLOCK_N, BLOCK_D, BLOCK_DV, head_dim, head_dim_v, INDEX_64,
        )  # fmt: skip
    store = valid_m
    if VARLEN == 1:
        store = offs_m < seqlen_q_max
    tl.store(
        DQ + b64 * sdqb + h64 * sdqh + rows[:, None] * sdqs + offs_d[None, :] * sdqd,
        (dq * sm_scale).to(DQ.dtype.element_ty), mask=store[:, None] & (offs_d < head_dim)[None, :],
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Launch plans.


def backward_configs(problem, interpret: bool) -> list[dict]:
    """(dkdv tile, dq tile) shapes worth timing; the first is the heuristic's pick. dK/dV programs
    hold a wide key block and stream narrow query blocks; dQ programs the reverse."""
    if interpret:
        return [{"M1": 32, "N1": 32, "W1": 4, "S1": 1, "M2": 32, "N2": 32, "W2": 4, "S2": 1}]
    d = max(block_d(problem.head_dim), block_d(problem.head_dim_v))
    if d <= 64:
        # H200, bf16, fwd+bwd CUDA-graph timed (bench/results/README.md, session 34). B8 H12
        # S1024 causal (GPT-2 small): 64x64 tiles in both passes 200.7 us against 219.0-240.1 with
        # 128-key dK/dV blocks (the first of which spills 1.3 KB a thread under ptxas for sm_90,
        # Triton 3.6: `scratch/attn/ptxas_check.py`); cuDNN 197.6. B4 H16 S4096 without a mask:
        # 32-query x 128-key dK/dV and 128 x 32 dQ tiles 2529.2 us against 2619.8 for 64x64.
        shapes = [
            (64, 64, 4, 3, 64, 64, 4, 3),
            (64, 128, 8, 3, 128, 64, 8, 3),
            (32, 128, 4, 3, 128, 32, 4, 3),
            (32, 128, 8, 2, 128, 64, 8, 3),
            (16, 128, 8, 3, 128, 64, 8, 3),
        ]
        if problem.window[1] == -1:  # no right bound: no part-empty diagonal blocks to keep small
            shapes.sort(key=lambda s: s != (32, 128, 4, 3, 128, 32, 4, 3))
    elif d <= 128:
        # H100 bf16 B4 H32 S4096: 395 TFLOP/s with 3 stages against 379 with 2. Tensor-descriptor
        # loads in the dK/dV kernel: 414 against 403 without a mask (S16384: 427 against 414),
        # 335 against 341 causal (and slower at D64: a barrier per copy issued).
        desc = problem.window == (-1, -1)
        shapes = [
            (64, 128, 8, 3, 128, 64, 8, 3, desc),
            (64, 128, 8, 2, 128, 64, 8, 2),
            (64, 64, 4, 3, 64, 64, 4, 3),
        ]
        if problem.mask is not None or problem.bias is not None or problem.dropout:
            shapes = shapes[1:]  # more loads per block: the 3-stage pipeline may not fit
    else:
        shapes = [(32, 64, 4, 2, 64, 32, 4, 2), (16, 64, 4, 2, 64, 16, 4, 2), (32, 32, 4, 2, 32, 32, 4, 2)]
    keys = ("M1", "N1", "W1", "S1", "M2", "N2", "W2", "S2", "desc")
    return [dict(zip(keys, s)) for s in shapes]


PRE_BLOCK_M = 32 if INTERPRET else 64


def bind_backward(problem, config: dict, atomic_dq: bool):
    """A callable running the three kernels: ``(q, k, v, o, do, lse, dq, dk, dv, dbias, mask, bias,
    alibi, sinks, lens_q, lens_kv, rng, qk_scale, cap_scale, dropout_p, sm_scale)`` (BHSD views;
    absent tensors given as ``q``); returns the per-block partial sums of the sinks' gradient (or
    None). ``dbias`` is a zero-filled fp32 [B, Hq, Sq, Skv] tensor when the problem asks for it."""
    p = problem
    has_left, has_right, left, right = window_flags(p.window)
    bd, bdv = block_d(p.head_dim), block_d(p.head_dim_v)
    precision = "tf32" if p.tf32 else "ieee"
    upcast = INTERPRET and p.dtype == "bfloat16"
    mask_s = p.mask or (0, 0, 0, 0)
    bias_s = p.bias or (0, 0, 0, 0)
    dbias_s = (
        (p.heads_q * p.seqlen_q * p.seqlen_kv, p.seqlen_q * p.seqlen_kv, p.seqlen_kv, 1)
        if p.bias_grad
        else (0, 0, 0, 0)
    )
    pre_blocks = cdiv(p.seqlen_q, PRE_BLOCK_M)
    pre = launcher(
        attention_bwd_preprocess_kernel,
        (pre_blocks, p.batch * p.heads_q),
        num_tensors=8,
        ints=(p.seqlen_q, p.heads_q, *p.stride("o"), *p.stride("do"), *p.stride("lse")),
        constexprs=(p.varlen, p.sinks, PRE_BLOCK_M, bdv, p.head_dim_v),
    )
    m1, n1 = config["M1"], config["N1"]
    # Atomic dQ through tensor descriptors where the fp32 accumulator (dq's strides) allows.
    dq_desc = atomic_dq and descriptors_fit(p, ("dq",), size=4)
    desc = (
        bool(config.get("desc"))
        and p.varlen != 2  # packed rows start anywhere: LSE rows would not be 16-byte aligned
        and descriptors_fit(p, ("q", "do"))
        and descriptors_fit(p, ("lse",), size=4)
    )

    def bind_dkdv(desc: bool):
        return launcher(
            attention_bwd_dkdv_kernel,
            (cdiv(p.seqlen_kv, n1), p.batch * p.heads_kv),
            num_tensors=16,
            ints=(
                p.seqlen_q, p.seqlen_kv, p.heads_q, p.heads_kv, p.group,
                *p.stride("q"), *p.stride("k"), *p.stride("v"), *p.stride("do"), *p.stride("dk"),
                *p.stride("dv"), *p.stride("dq"), *p.stride("lse"), *mask_s, *bias_s, *dbias_s, p.alibi or 0,
                left, right,
            ),
            constexprs=(
                has_left, has_right, p.bottom_right, p.mask is not None, p.bias is not None, p.bias_grad,
                p.alibi is not None, p.softcap, p.varlen, p.dropout, atomic_dq, precision, upcast,
                m1, n1, bd, bdv, p.head_dim, p.head_dim_v,
                p.varlen != 0 or p.seqlen_q % m1 != 0 or p.seqlen_kv % n1 != 0, p.index_64, desc, dq_desc,
            ),
            num_warps=config["W1"],
            num_stages=config["S1"],
        )  # fmt: skip

    dkdv_plain = bind_dkdv(False)
    dkdv_desc = bind_dkdv(True) if desc else dkdv_plain

    def dkdv(q, k, v, do, dk, dv, lse, *rest):
        # Descriptors need 16-byte-aligned base addresses, known only per call.
        if desc and aligned(q, do, lse):
            ensure_allocator()
            dkdv_desc(q, k, v, do, dk, dv, lse, *rest)
        else:
            if dq_desc:
                ensure_allocator()
            dkdv_plain(q, k, v, do, dk, dv, lse, *rest)

    m2, n2 = config["M2"], config["N2"]
    dq_kernel = launcher(
        attention_bwd_dq_kernel,
        (cdiv(p.seqlen_q, m2), p.batch * p.heads_q),
        num_tensors=13,
        ints=(
            p.seqlen_q, p.seqlen_kv, p.heads_q, p.group,
            *p.stride("q"), *p.stride("k"), *p.stride("v"), *p.stride("do"), *p.stride("dq"),
            *p.stride("lse"),
            *mask_s, *bias_s, p.alibi or 0, left, right,
        ),
        constexprs=(
            has_left, has_right, p.bottom_right, p.mask is not None, p.bias is not None, p.alibi is not None,
            p.softcap, p.varlen, p.dropout, precision, upcast, m2, n2, bd, bdv, p.head_dim, p.head_dim_v,
            p.varlen != 0 or p.seqlen_kv % n2 != 0, p.index_64,
        ),
        num_warps=config["W2"],
        num_stages=config["S2"],
    )  # fmt: skip

    def run(q, k, v, o, do, lse, dq, dk, dv, dbias, mask, bias, alibi, sinks, lens_q, lens_kv, rng,
            qk_scale, cap_scale, dropout_p, sm_scale):  # fmt: skip
        delta = torch.empty_like(lse)
        dsink = (
            torch.empty(p.batch * p.heads_q, pre_blocks, device=q.device, dtype=torch.float32)
            if p.sinks
            else lse
        )
        pre(o, do, delta, lse, sinks, dsink, lens_q, lens_kv)
        if atomic_dq:
            acc = torch.zeros_like(dq, dtype=torch.float32)
            assert acc.stride() == dq.stride()
            dkdv(q, k, v, do, dk, dv, lse, delta, mask, bias, dbias, alibi, lens_q, lens_kv, rng, acc,
                 qk_scale, cap_scale, dropout_p, sm_scale)  # fmt: skip
            dq.copy_(acc)
        else:
            dkdv(q, k, v, do, dk, dv, lse, delta, mask, bias, dbias, alibi, lens_q, lens_kv, rng, dq,
                 qk_scale, cap_scale, dropout_p, sm_scale)  # fmt: skip
            dq_kernel(q, k, v, do, dq, lse, delta, mask, bias, alibi, lens_q, lens_kv, rng,
                      qk_scale, cap_scale, dropout_p, sm_scale)  # fmt: skip
        return dsink if p.sinks else None

    return run
