"""Arguments of ``sdpa``: validation, and the call reduced to BHSD views and option flags.

``_prepare`` checks every argument of a call (dtypes, shapes, layouts, options, lengths, offsets
and block tables) and returns a ``_Call``: the tensors as the kernels take them and a ``_Meta`` of
the call's static options (the custom ops' ``int[] meta``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ...core.backend import INTERPRET
from ...core.checks import check_choice, check_float, check_tensor, check_values
from ...core.strides import broadcast_shapes

OP = "tdnn.sdpa"
MAX_HEAD_DIM = 256
INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn)
OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LAYOUTS = ("bhsd", "bshd")


class _Meta(NamedTuple):
    """The static options of a call, as ints (the custom ops' ``int[] meta``)."""

    layout: int  # 0 bhsd, 1 bshd, 2 packed (total, heads, dim)
    left: int
    right: int
    bottom_right: int
    varlen: int
    seqlen_q: int  # max over the batch for packed sequences
    seqlen_kv: int
    out_dtype: int  # index into OUT_DTYPES
    squeeze: int  # 1: the inputs were 3-D (N, L, E) and got a head dim of 1


class _Call(NamedTuple):
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None
    bias: torch.Tensor | None
    alibi: torch.Tensor | None
    sinks: torch.Tensor | None
    lens_q: torch.Tensor | None
    lens_kv: torch.Tensor | None
    block_table: torch.Tensor | None
    rng: torch.Tensor | None
    descale: torch.Tensor | None
    scale: float
    softcap: float
    dropout_p: float
    meta: _Meta
    bias_grad: bool

    def tensors(self) -> tuple:
        return (
            self.q, self.k, self.v, self.mask, self.bias, self.alibi, self.sinks, self.lens_q,
            self.lens_kv, self.block_table, self.rng, self.descale,
        )  # fmt: skip


def _bhsd(t: torch.Tensor, layout: int) -> torch.Tensor:
    """A BHSD view: bhsd as is, bshd transposed, packed (total, heads, dim) as (1, heads, total, dim)."""
    if layout == 0:
        return t
    if layout == 1:
        return t.transpose(1, 2)
    return t.unsqueeze(0).transpose(1, 2)


def _kv_view(t: torch.Tensor, layout: int, paged: bool) -> torch.Tensor:
    # A paged cache is (pages, page size, heads, dim): viewed as BHSD, its "batch" is the page.
    return t.transpose(1, 2) if paged else _bhsd(t, layout)


def _lengths(op, name, t, batch, limit):
    t = check_tensor(op, name, t, dtypes=(torch.int32, torch.int64), min_ndim=1, max_ndim=1)
    if t.shape[0] != batch:
        raise ValueError(
            f"{op}: argument '{name}' has {t.shape[0]} entries; expected {batch} (one per batch)"
        )
    check_values(op, name, t, 0, limit, "lengths")
    return t.to(torch.int32).contiguous()


def _offsets(op, name, t, total):
    t = check_tensor(op, name, t, dtypes=(torch.int32, torch.int64), min_ndim=1, max_ndim=1)
    if t.shape[0] < 2:
        raise ValueError(f"{op}: argument '{name}' needs at least 2 entries (cumulative offsets from 0)")
    diff = t[1:] - t[:-1]
    if int(t[0]) != 0 or bool((diff < 0).any()) or int(t[-1]) > total:
        raise ValueError(
            f"{op}: argument '{name}' must start at 0, not decrease, and end at most at {total} "
            "(the packed length)"
        )
    return t.to(torch.int32).contiguous(), int(diff.max())


def _broadcasts(shape: torch.Size, target: tuple[int, ...]) -> bool:
    """Whether ``shape`` broadcasts to ``target`` without growing it."""
    try:
        return tuple(broadcast_shapes(shape, target)) == target
    except RuntimeError:
        return False


def _prepare(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *,
    layout="bhsd", causal_alignment="top_left", window=None, bias=None, alibi_slopes=None, softcap=None,
    sinks=None, seqlens_q=None, seqlens_kv=None, cu_seqlens_q=None, cu_seqlens_kv=None, block_table=None,
    dropout_seed=None, dropout_offset=0, descale_q=None, descale_k=None, descale_v=None, out_dtype=None,
    op=OP,
) -> _Call:  # fmt: skip
    q = check_tensor(op, "query", query, dtypes=INPUT_DTYPES)
    k = check_tensor(op, "key", key, dtypes=INPUT_DTYPES)
    v = check_tensor(op, "value", value, dtypes=INPUT_DTYPES)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{op}: query, key and value must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"{op}: query, key and value must be on one device; got {q.device}, {k.device}, {v.device}"
        )
    check_choice(op, "layout", layout, LAYOUTS)
    check_choice(op, "causal_alignment", causal_alignment, ("top_left", "bottom_right"))
    packed = cu_seqlens_q is not None or cu_seqlens_kv is not None
    paged = block_table is not None
    squeeze = 0
    if packed:
        if cu_seqlens_q is None or cu_seqlens_kv is None:
            raise ValueError(f"{op}: packed sequences need both 'cu_seqlens_q' and 'cu_seqlens_kv'")
        if paged or seqlens_q is not None or seqlens_kv is not None:
            raise ValueError(f"{op}: 'cu_seqlens_*' cannot be combined with 'seqlens_*' or 'block_table'")
        for name, t in (("query", q), ("key", k), ("value", v)):
            if t.ndim != 3:
                raise ValueError(
                    f"{op}: packed '{name}' must be (total, heads, dim); got shape {tuple(t.shape)}"
                )
        lay = 2
    else:
        if q.ndim == 3 and k.ndim == 3 and v.ndim == 3 and layout == "bhsd" and not paged:
            q, k, v, squeeze = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), 1
        for name, t in (("query", q), ("key", k), ("value", v)):
            if t.ndim != 4:
                raise ValueError(
                    f"{op}: argument '{name}' has {t.ndim} dimensions; accepted: 4 ({layout.upper()})"
                )
        lay = LAYOUTS.index(layout)
    q4 = _bhsd(q, lay)
    k4, v4 = _kv_view(k, lay, paged), _kv_view(v, lay, paged)
    b, hq, sq, d = q4.shape
    hkv, skv, dv = k4.shape[1], k4.shape[2], v4.shape[-1]
    if k4.shape[:3] != v4.shape[:3]:
        raise ValueError(
            f"{op}: key {tuple(k.shape)} and value {tuple(v.shape)} differ in more than the head dim"
        )
    if k4.shape[-1] != d:
        raise ValueError(f"{op}: query head dim {d} != key head dim {k4.shape[-1]}")
    if not paged and lay != 2 and k4.shape[0] != b:
        raise ValueError(f"{op}: query batch {b} != key/value batch {k4.shape[0]}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"{op}: query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    if hq != hkv and not enable_gqa:
        raise ValueError(
            f"{op}: query has {hq} heads but key/value {hkv}; pass enable_gqa=True for grouped-query "
            "attention"
        )
    if max(d, dv) > MAX_HEAD_DIM:
        raise ValueError(f"{op}: head dims {d}/{dv} are not supported; accepted: 1..{MAX_HEAD_DIM}")
    fp8 = q.dtype == torch.float8_e4m3fn
    if out_dtype is None:
        out_dtype = torch.bfloat16 if fp8 else q.dtype
    if out_dtype not in OUT_DTYPES or (not fp8 and out_dtype != q.dtype):
        raise TypeError(f"{op}: out_dtype={out_dtype} is not accepted for {q.dtype} inputs")
    if scale is None:
        scale = 1.0 / math.sqrt(d) if d else 1.0
    scale = check_float(op, "scale", scale)
    cap = 0.0 if softcap is None else check_float(op, "softcap", softcap, positive=True)
    dropout_p = check_float(op, "dropout_p", dropout_p)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"{op}: argument 'dropout_p'={dropout_p} must be in [0, 1)")
    left, right = -1, -1
    if window is not None:
        if len(window) != 2 or any(isinstance(w, bool) or not isinstance(w, int) or w < -1 for w in window):
            raise ValueError(
                f"{op}: argument 'window'={window!r} must be (left, right) ints >= -1 (-1 unbounded)"
            )
        left, right = window
    if is_causal:
        right = 0 if right < 0 else min(right, 0)

    # Lengths.
    lens_q = lens_kv = None
    varlen = 0
    if packed:
        lens_q, max_q = _offsets(op, "cu_seqlens_q", cu_seqlens_q, q.shape[0])
        lens_kv, max_kv = _offsets(op, "cu_seqlens_kv", cu_seqlens_kv, k.shape[0])
        if lens_q.shape != lens_kv.shape:
            raise ValueError(f"{op}: 'cu_seqlens_q' and 'cu_seqlens_kv' must have the same length")
        b, sq, skv, varlen = lens_q.shape[0] - 1, max_q, max_kv, 2
    if paged:
        bt = check_tensor(
            op, "block_table", block_table, dtypes=(torch.int32, torch.int64), min_ndim=2, max_ndim=2
        )
        if bt.shape[0] != b:
            raise ValueError(f"{op}: 'block_table' has {bt.shape[0]} rows; expected the batch {b}")
        check_values(op, "block_table", bt, 0, k.shape[0] - 1, "pages")
        block_table = bt.to(torch.int32)
        skv = bt.shape[1] * k.shape[1]
    if not packed and (seqlens_q is not None or seqlens_kv is not None):
        lens_q = _lengths(op, "seqlens_q", seqlens_q, b, sq) if seqlens_q is not None else None
        lens_kv = _lengths(op, "seqlens_kv", seqlens_kv, b, skv) if seqlens_kv is not None else None
        if lens_q is None:
            lens_q = torch.full((b,), sq, dtype=torch.int32, device=q.device)
        if lens_kv is None:
            lens_kv = torch.full((b,), skv, dtype=torch.int32, device=q.device)
        varlen = 1

    # Masks and score terms.
    mask = None
    if attn_mask is not None:
        attn_mask = check_tensor(op, "attn_mask", attn_mask, dtypes=(torch.bool, *OUT_DTYPES), max_ndim=4)
        if packed:
            raise ValueError(f"{op}: 'attn_mask' is not accepted with packed sequences (cu_seqlens)")
        ok = _broadcasts(attn_mask.shape, (b, hq, sq, skv))
        if not ok:
            raise ValueError(
                f"{op}: 'attn_mask' of shape {tuple(attn_mask.shape)} does not broadcast to "
                f"{(b, hq, sq, skv)}"
            )
        if attn_mask.dtype == torch.bool:
            mask = attn_mask
        else:
            if bias is not None:
                raise ValueError(f"{op}: give one additive term: a float 'attn_mask' or 'bias', not both")
            bias = attn_mask
    if bias is not None:
        bias = check_tensor(op, "bias", bias, dtypes=OUT_DTYPES, max_ndim=4)
        if packed:
            raise ValueError(f"{op}: 'bias' is not accepted with packed sequences (cu_seqlens)")
        if not _broadcasts(bias.shape, (b, hq, sq, skv)):
            raise ValueError(
                f"{op}: 'bias' of shape {tuple(bias.shape)} does not broadcast to {(b, hq, sq, skv)}"
            )
        if bias.ndim < 4:
            bias = bias.view(*([1] * (4 - bias.ndim)), *bias.shape)
    if mask is not None and mask.ndim < 4:
        mask = mask.view(*([1] * (4 - mask.ndim)), *mask.shape)
    alibi = None
    if alibi_slopes is not None:
        alibi = check_tensor(
            op, "alibi_slopes", alibi_slopes, dtypes=(torch.float32,), min_ndim=1, max_ndim=2
        )
        if alibi.shape not in ((hq,), (b, hq)):
            raise ValueError(
                f"{op}: 'alibi_slopes' of shape {tuple(alibi.shape)}; accepted: ({hq},) or ({b}, {hq})"
            )
        if alibi.stride(-1) != 1:
            alibi = alibi.contiguous()
    if sinks is not None:
        sinks = check_tensor(op, "sinks", sinks, dtypes=OUT_DTYPES, min_ndim=1, max_ndim=1)
        if sinks.shape != (hq,):
            raise ValueError(
                f"{op}: 'sinks' of shape {tuple(sinks.shape)}; expected ({hq},) (one per query head)"
            )
        if sinks.stride(0) != 1:
            sinks = sinks.contiguous()

    rng = None
    if dropout_p > 0:
        if dropout_seed is None:
            dropout_seed = int(torch.randint(0, 2**62, (1,)).item())
        rng = torch.tensor([int(dropout_seed), int(dropout_offset)], dtype=torch.int64, device=q.device)
    descale = None
    if fp8:
        if INTERPRET:
            raise TypeError(f"{op}: fp8 attention needs a GPU (Triton's interpreter has no fp8)")
        if mask is not None or bias is not None or dropout_p > 0 or softcap is not None:
            raise ValueError(f"{op}: fp8 inputs support no mask, bias, dropout or soft-capping")
        vals = [1.0 if x is None else x for x in (descale_q, descale_k, descale_v)]
        for name, x in zip(("descale_q", "descale_k", "descale_v"), vals):
            # Kernels take a row's max over raw products when the scale is positive.
            if not isinstance(x, torch.Tensor) and not float(x) > 0:
                raise ValueError(f"{op}: argument '{name}' must be a positive factor, got {x}")
        descale = torch.stack(
            [torch.as_tensor(x, dtype=torch.float32, device=q.device).reshape(()) for x in vals]
        )
    elif any(x is not None for x in (descale_q, descale_k, descale_v)):
        raise ValueError(f"{op}: descale factors apply to fp8 inputs only")
    meta = _Meta(lay, left, right, int(causal_alignment == "bottom_right"), varlen, sq, skv,
                 OUT_DTYPES.index(out_dtype), squeeze)  # fmt: skip
    return _Call(q, k, v, mask, bias, alibi, sinks, lens_q, lens_kv, block_table, rng, descale,
                 scale, cap, dropout_p, meta, False)  # fmt: skip
