"""The meaning of ``tdnn.sdpa``: plain PyTorch in float64, one option at a time, no fusion.

Every kernel of this package is tested against ``sdpa_reference``; its gradients (autograd through
it in float64) are the reference for the backward kernels. Tensors here are BHSD: (batch, heads,
sequence, head dim). Rows with no key to attend to give a zero output and a log-sum-exp of -inf
(``torch.softmax`` would give NaN).
"""

from __future__ import annotations

import torch


def band_mask(
    sq: int,
    skv: int,
    *,
    causal: bool = False,
    bottom_right: bool = False,
    window: tuple[int, int] | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """(sq, skv) bool, True where query i may see key j: ``i + diag - left <= j <= i + diag + right``
    with ``diag = skv - sq`` for bottom-right alignment, else 0; causal sets ``right = 0``; a
    bound of -1 (or None window) is unbounded."""
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0 if right < 0 else min(right, 0)
    diag = skv - sq if bottom_right else 0
    i = torch.arange(sq, device=device)[:, None] + diag
    j = torch.arange(skv, device=device)[None, :]
    keep = torch.ones(sq, skv, dtype=torch.bool, device=device)
    if right >= 0:
        keep &= j <= i + right
    if left >= 0:
        keep &= j >= i - left
    return keep


def alibi_bias(slopes: torch.Tensor, sq: int, skv: int, bottom_right: bool) -> torch.Tensor:
    """ALiBi: ``-slope * |i + diag - j|`` (diag as in ``band_mask``) for slopes of shape (H,) or
    (B, H); returns (1 or B, H, sq, skv) float64."""
    diag = skv - sq if bottom_right else 0
    i = torch.arange(sq, device=slopes.device, dtype=torch.float64)[:, None] + diag
    j = torch.arange(skv, device=slopes.device, dtype=torch.float64)[None, :]
    s = slopes.double()
    if s.ndim == 1:
        s = s[None]
    return -s[:, :, None, None] * (i - j).abs()


def sdpa_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    is_causal: bool = False,
    bottom_right: bool = False,
    window: tuple[int, int] | None = None,
    scale: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    seqlens_q: list[int] | None = None,
    seqlens_kv: list[int] | None = None,
    dropout_keep: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, log-sum-exp) of attention over BHSD tensors, in float64.

    k/v may have fewer heads than q (GQA: query head h reads kv head h // (Hq // Hkv)).
    ``attn_mask``: bool (True = attend) or float (added), broadcastable to (B, Hq, Sq, Skv);
    ``bias``: another additive float term. ``seqlens_q/kv``: per-batch valid lengths of the padded
    tensors (rows and keys beyond them take no part; output rows beyond them are 0). The
    alignment of causal masks, windows and ALiBi uses each batch's own lengths.
    ``dropout_keep``: (B, Hq, Sq, Skv) bool mask of kept probabilities, scaled by 1/(1-p).
    ``sinks``: (Hq,) logits added to each softmax denominator. Differentiable in every float input.
    ``compute_dtype``: float64 for the reference; the inputs' dtype gives PyTorch's own rounding
    error in that dtype (the bar of the accuracy rule).
    """
    cdt = compute_dtype
    b, hq, sq, _ = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    group = hq // hkv
    if scale is None:
        scale = q.shape[-1] ** -0.5
    q64, k64, v64 = q.to(cdt), k.to(cdt), v.to(cdt)
    k64 = k64.repeat_interleave(group, dim=1)
    v64 = v64.repeat_interleave(group, dim=1)
    s = torch.einsum("bhid,bhjd->bhij", q64, k64) * scale
    if softcap is not None and softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    lens_q = seqlens_q if seqlens_q is not None else [sq] * b
    lens_kv = seqlens_kv if seqlens_kv is not None else [skv] * b
    keep = torch.zeros(b, 1, sq, skv, dtype=torch.bool, device=q.device)
    extra = torch.zeros(b, hq, sq, skv, dtype=cdt, device=q.device)
    for n in range(b):
        lq, lk = lens_q[n], lens_kv[n]
        keep[n, 0, :lq, :lk] = band_mask(
            lq, lk, causal=is_causal, bottom_right=bottom_right, window=window, device=q.device
        )
        if alibi_slopes is not None:
            slopes = alibi_slopes if alibi_slopes.ndim == 1 else alibi_slopes[n]
            extra[n, :, :lq, :lk] = alibi_bias(slopes, lq, lk, bottom_right)[0].to(cdt)
    s = s + extra
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            keep = keep & attn_mask
        else:
            s = s + attn_mask.to(cdt)
    if bias is not None:
        s = s + bias.to(cdt)
    s = s.masked_fill(~keep, float("-inf"))
    m = s.amax(-1, keepdim=True)
    if sinks is not None:
        m = torch.maximum(m, sinks.to(cdt)[None, :, None, None])
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m).detach()
    e = torch.exp(s - m)
    z = e.sum(-1, keepdim=True)
    if sinks is not None:
        z = z + torch.exp(sinks.to(cdt)[None, :, None, None] - m)
    p = e / torch.where(z == 0, torch.ones_like(z), z)
    lse = (m + torch.log(z)).squeeze(-1)
    if dropout_keep is not None:
        p = torch.where(dropout_keep, p / (1.0 - dropout_p), torch.zeros_like(p))
    o = torch.einsum("bhij,bhjd->bhid", p, v64)
    rows = torch.zeros(b, 1, sq, 1, dtype=torch.bool, device=q.device)
    for n in range(b):
        rows[n, :, : lens_q[n]] = True
    o = o * rows
    lse = torch.where(rows.squeeze(-1), lse, torch.full_like(lse, float("-inf")))
    return o, lse
