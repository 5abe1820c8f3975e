"""Attention for torch.nn models: ``MultiheadAttention`` and routing of
``F.scaled_dot_product_attention`` through ``tdnn.sdpa``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.attention import sdpa
from ..ops.matmul import linear
from .layers import on_backend, run_or_fallback


def _attend_mask(mask: torch.Tensor, attended_when: bool) -> torch.Tensor:
    """A bool mask as sdpa's (True = attend) from one whose True means ``attended_when``; float
    masks (additive) pass through."""
    if mask.dtype != torch.bool:
        return mask
    return mask if attended_when else ~mask


def _combine(a: torch.Tensor | None, b: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """One mask from two sdpa masks (bool True = attend, or additive float)."""
    if a is None or b is None:
        return a if b is None else b
    if a.dtype == torch.bool and b.dtype == torch.bool:
        return a & b

    def additive(m: torch.Tensor) -> torch.Tensor:
        if m.dtype != torch.bool:
            return m.to(dtype)
        return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, float("-inf"))

    return additive(a) + additive(b)


def _each(fn, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``fn`` of each, keeping ``query is key`` and ``key is value`` (one packed projection GEMM
    for self-attention, as torch keeps them)."""
    q = fn(query)
    k = q if key is query else fn(key)
    v = q if value is query else k if value is key else fn(value)
    return q, k, v


class MultiheadAttention(nn.MultiheadAttention):
    """``torch.nn.MultiheadAttention`` whose ``need_weights=False`` path runs the projections with
    ``tdnn.linear`` and the attention with ``tdnn.sdpa`` (flash attention: no (L, S) weights).

    ``batch_first`` both ways, unbatched inputs, ``key_padding_mask`` and ``attn_mask`` (bool:
    True = not allowed, as torch.nn's; or float, added), ``is_causal`` and dropout are taken.
    ``need_weights=True`` (the weights must exist), ``add_bias_kv`` and ``add_zero_attn`` run
    torch's forward, as do inputs torch rejects (so its errors are raised) and problems sdpa
    declines (float64, say). A query row that may see no key gives zeros where torch gives NaN.
    """

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        fused = (
            not need_weights
            and self.bias_k is None
            and not self.add_zero_attn
            and on_backend(query)
            and not (is_causal and attn_mask is None)  # torch raises: the mask is required
            and self._well_formed(query, key, value, key_padding_mask, attn_mask)
        )
        theirs = super().forward
        args = (query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal)
        if not fused:
            return theirs(*args)
        return run_or_fallback(
            self,
            query,
            lambda: self._fused(query, key, value, key_padding_mask, attn_mask, is_causal),
            lambda: theirs(*args),
        )

    def _well_formed(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None,
        attn_mask: torch.Tensor | None,
    ) -> bool:
        """Whether torch's forward would accept these inputs (else it runs, raising its error):
        ranks, embedding sizes, lengths and batch sizes, mask shapes and dtypes (bool, or floating
        in the query's dtype)."""
        rank = query.dim()
        if rank not in (2, 3) or key.dim() != rank or value.dim() != rank:
            return False
        if (query.shape[-1], key.shape[-1], value.shape[-1]) != (self.embed_dim, self.kdim, self.vdim):
            return False
        seq, bat = (1, 0) if rank == 3 and self.batch_first else (0, 1)
        if key.shape[:-1] != value.shape[:-1] or (rank == 3 and query.shape[bat] != key.shape[bat]):
            return False
        length, source = query.shape[seq], key.shape[seq]
        batch = query.shape[bat] if rank == 3 else 1
        heads_shape = (
            (batch * self.num_heads, length, source) if rank == 3 else (self.num_heads, length, source)
        )
        kpm_shape = (batch, source) if rank == 3 else (source,)
        for mask, shapes in ((key_padding_mask, (kpm_shape,)), (attn_mask, ((length, source), heads_shape))):
            if mask is None:
                continue
            if tuple(mask.shape) not in shapes or mask.dtype not in (torch.bool, query.dtype):
                return False
        return True

    def _fused(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None,
        attn_mask: torch.Tensor | None,
        is_causal: bool,
    ) -> tuple[torch.Tensor, None]:
        unbatched = query.dim() == 2
        if unbatched:
            query, key, value = _each(lambda t: t.unsqueeze(1), query, key, value)
            key_padding_mask = None if key_padding_mask is None else key_padding_mask.unsqueeze(0)
        elif self.batch_first:
            query, key, value = _each(lambda t: t.transpose(0, 1), query, key, value)
        # (L, N, E) from here, as torch's functional form.
        length, batch, embed = query.shape
        source = key.shape[0]
        heads, head_dim = self.num_heads, self.head_dim
        q, k, v = self._project(query, key, value)
        q = q.transpose(0, 1).reshape(batch, length, heads, head_dim)
        k = k.transpose(0, 1).reshape(batch, source, heads, head_dim)
        v = v.transpose(0, 1).reshape(batch, source, heads, head_dim)

        causal = is_causal and key_padding_mask is None
        mask = None
        if attn_mask is not None and not causal:
            am = _attend_mask(attn_mask, attended_when=False)
            mask = am.view(batch, heads, length, source) if am.dim() == 3 else am
        if key_padding_mask is not None:
            kpm = _attend_mask(key_padding_mask, attended_when=False).view(batch, 1, 1, source)
            mask = _combine(mask, kpm, q.dtype)
        dropout = self.dropout if self.training else 0.0
        out = sdpa(q, k, v, mask, dropout, causal, layout="bshd")
        out = out.reshape(batch, length, embed)
        out = linear(out, self.out_proj.weight, self.out_proj.bias)
        if unbatched:
            return out.squeeze(0), None
        return (out if self.batch_first else out.transpose(0, 1)), None

    def _project(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v: one GEMM for self-attention with packed weights, else one each."""
        bias = self.in_proj_bias
        b_q, b_k, b_v = bias.chunk(3) if bias is not None else (None, None, None)
        if self._qkv_same_embed_dim:
            if query is key and key is value:
                return linear(query, self.in_proj_weight, bias).chunk(3, dim=-1)
            w_q, w_k, w_v = self.in_proj_weight.chunk(3)
        else:
            w_q, w_k, w_v = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        return linear(query, w_q, b_q), linear(key, w_k, b_k), linear(value, w_v, b_v)


# ---------------------------------------------------------------------------------------------
# Routing F.scaled_dot_product_attention.

_TORCH_SDPA = F.scaled_dot_product_attention
_route_depth = 0  # > 0 while routing is on (process-wide: a plain global keeps dynamo tracing)


def _routed_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` that takes ``tdnn.sdpa`` while routing is on and the
    inputs are on the backend's device; torch's otherwise."""
    if _route_depth > 0 and on_backend(query):
        # The model's q, k, v are its own temporaries: a packed qkv takes the gradient whole.
        return sdpa(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, packed_gradient=True
        )
    return _TORCH_SDPA(
        query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
        enable_gqa=enable_gqa,
    )  # fmt: skip


def _install() -> None:
    """Point ``torch.nn.functional.scaled_dot_product_attention`` (looked up at call time by
    models, HuggingFace's included, and by ``F.multi_head_attention_forward``) at the router."""
    F.scaled_dot_product_attention = _routed_sdpa


@contextlib.contextmanager
def route_sdpa() -> Iterator[None]:
    """Within the block, ``F.scaled_dot_product_attention`` calls run ``tdnn.sdpa`` (a process-wide
    switch: calls from other threads meanwhile are routed too).

    >>> with tdnn.nn.route_sdpa():
    ...     logits = hf_model(input_ids).logits
    """
    enter_routing()
    try:
        yield
    finally:
        exit_routing()


def enter_routing(*_: object) -> None:
    """Forward pre-hook form of ``route_sdpa`` (``patch(model, sdpa=True)`` registers it)."""
    global _route_depth
    _install()
    _route_depth += 1


def exit_routing(*_: object) -> None:
    """Forward hook ending ``enter_routing`` (registered with ``always_call=True``)."""
    global _route_depth
    # max: when an earlier forward pre-hook raised, enter_routing never ran but this still does.
    _route_depth = max(0, _route_depth - 1)
