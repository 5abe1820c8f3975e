"""Scaled dot-product attention (cuDNN's fused flash attention): ``sdpa`` and ``sdpa_backward``.

``sdpa`` takes the arguments of ``F.scaled_dot_product_attention`` plus cuDNN's options as keywords
(layouts, GQA, causal alignment, sliding windows, bias, ALiBi, soft-capping, sinks, variable
lengths, paged KV caches, reproducible dropout, fp8, the log-sum-exp). Everything below reduces
a call to BHSD strided views and an ``AttentionProblem``; the engines (``flash-fwd``,
``split-kv-decode``, ``flash-bwd``, ``flash-bwd-atomic-dq``) run it. The module is thin: kernels
live in ``forward``, ``backward`` and ``decode``, argument checks in ``arguments``, the meaning
in ``reference``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from ...core.autocast import LOWER, autocast_policy
from ...core.backend import INTERPRET
from ...core.checks import check_tensor, check_values
from ...core.config import config
from ...core.engine import Engine, Family, LaunchConfig
from ...core.library import custom_op, eager_tensor, functorch_active, plain_eager, raw_apply
from .arguments import (
    MAX_HEAD_DIM,
    OP,
    OUT_DTYPES,
    _bhsd,
    _Call,
    _kv_view,
    _Meta,
    _prepare,
)
from .backward import backward_configs, bind_backward
from .common import AttentionProblem
from .decode import bind_decode, decode_supported
from .forward import bind_forward, dropout_mask, forward_configs
from .reference import sdpa_reference

__all__ = ["AttentionGrads", "dropout_keep_mask", "sdpa", "sdpa_backward", "sdpa_reference"]


# ---------------------------------------------------------------------------------------------
# Engines.


def _describe(*args, **kwargs) -> AttentionProblem:
    """The forward problem ``sdpa(*args, **kwargs)`` poses (for ``tdnn.engines("attention", ...)``)."""
    call = _prepare(*args, **kwargs)
    return _problem("fwd", call.tensors(), call.meta, call.bias_grad)


FAMILY: Family[AttentionProblem] = Family("attention", _describe)


def _common_reasons(p: AttentionProblem) -> list[str]:
    reasons = []
    if max(p.head_dim, p.head_dim_v) > MAX_HEAD_DIM:
        reasons.append(f"head dims {p.head_dim}/{p.head_dim_v} exceed {MAX_HEAD_DIM}")
    return reasons


@FAMILY.register
class FlashForward(Engine[AttentionProblem]):
    """Query blocks in parallel, key blocks streamed through an online softmax (FlashAttention-2)."""

    name = "flash-fwd"

    def not_supported_reasons(self, p: AttentionProblem) -> list[str]:
        if p.kind != "fwd":
            return ["a forward engine"]
        return _common_reasons(p)

    def cost(self, p: AttentionProblem) -> float:
        return 1.0

    def configs(self, p: AttentionProblem) -> list[LaunchConfig]:
        return forward_configs(p, INTERPRET)

    def bind(self, p: AttentionProblem, config: LaunchConfig) -> Callable[..., None]:
        return bind_forward(p, config)


@FAMILY.register
class SplitKVDecode(Engine[AttentionProblem]):
    """Few queries (decode): the key range split over programs (flash-decoding), every query head
    of a GQA group in one program so each key is read once, then a combine kernel."""

    name = "split-kv-decode"

    def not_supported_reasons(self, p: AttentionProblem) -> list[str]:
        if p.kind != "fwd":
            return ["a forward engine"]
        return _common_reasons(p) + decode_supported(p)

    def cost(self, p: AttentionProblem) -> float:
        return 0.5

    def configs(self, p: AttentionProblem) -> list[LaunchConfig]:
        if INTERPRET:
            return [{"BLOCK_N": 16, "num_warps": 4, "num_stages": 1}]
        # H100, B8 Hq32 Hkv8 D128: 128-key blocks and 4 programs per SM read an 8K-key cache at
        # 2.4 TB/s, 64K at 2.9 (copy: 3.0); 2 programs per SM left bandwidth unused.
        return [
            {"BLOCK_N": n, "num_warps": w, "num_stages": s, "waves": wv}
            for n, w, s, wv in ((128, 4, 3, 4), (128, 4, 2, 8), (64, 4, 3, 2), (32, 4, 4, 4))
        ]

    def bind(self, p: AttentionProblem, config: LaunchConfig) -> Callable[..., None]:
        return bind_decode(p, config)


class _Backward(Engine[AttentionProblem]):
    atomic = False

    def not_supported_reasons(self, p: AttentionProblem) -> list[str]:
        if p.kind != "bwd":
            return ["a backward engine"]
        return _common_reasons(p)

    def configs(self, p: AttentionProblem) -> list[LaunchConfig]:
        return backward_configs(p, INTERPRET)

    def bind(self, p: AttentionProblem, config: LaunchConfig) -> Callable[..., None]:
        return bind_backward(p, config, self.atomic)


@FAMILY.register
class FlashBackward(_Backward):
    """dK/dV per key block (a kv head's whole GQA group in one program) and dQ per query block:
    no atomics, the same bits on every run."""

    name = "flash-bwd"

    def cost(self, p: AttentionProblem) -> float:
        return 1.0


@FAMILY.register
class FlashBackwardAtomicDQ(_Backward):
    """dQ added with fp32 atomics from the dK/dV kernel (no separate dQ pass); not deterministic."""

    name = "flash-bwd-atomic-dq"
    atomic = True

    def not_supported_reasons(self, p: AttentionProblem) -> list[str]:
        reasons = super().not_supported_reasons(p)
        if p.deterministic:
            reasons.append("tdnn.config.deterministic is set (fp32 atomics add in any order)")
        return reasons

    def cost(self, p: AttentionProblem) -> float:
        # Measured choice left to benchmark mode: the split kernel costs ~1.4x the products but
        # no atomic traffic; keep the deterministic one as the default.
        return 1.2


# ---------------------------------------------------------------------------------------------
# Problems and plans: a validated call (``arguments._prepare``) becomes an AttentionProblem.


def _strides(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.stride(d) if t.shape[d] != 1 else 0 for d in range(t.ndim))


def _empty_out(q: torch.Tensor, last: int, dtype: torch.dtype, zero: bool = False) -> torch.Tensor:
    """An output of q's shape with last dim ``last``, in q's memory order (a BSHD-in-memory query
    gives a BSHD-in-memory output), the last dim innermost. ``zero``: zero-filled (packed
    sequences: rows past the last offset belong to no sequence and are written by no kernel)."""
    shape = [*q.shape[:-1], last]
    if q.is_contiguous():  # the common case, without sorting strides (host time on every call)
        return (torch.zeros if zero else torch.empty)(shape, dtype=dtype, device=q.device)
    order = [*sorted(range(q.ndim - 1), key=lambda d: -q.stride(d)), q.ndim - 1]
    phys = (torch.zeros if zero else torch.empty)([shape[d] for d in order], dtype=dtype, device=q.device)
    return phys.permute([order.index(d) for d in range(q.ndim)])


def _lse_shape(q: torch.Tensor, meta: _Meta) -> tuple[int, ...]:
    if meta.layout == 2:
        return (q.shape[1], q.shape[0])
    if meta.layout == 1:
        return (q.shape[0], q.shape[2], q.shape[1])
    return (q.shape[0], q.shape[1], q.shape[2])


def _lse_view(lse: torch.Tensor, meta: _Meta) -> torch.Tensor:
    """LSE as (batch, heads, rows) for the kernels (packed: batch stride 0)."""
    return lse.unsqueeze(0) if meta.layout == 2 else lse


def _problem(
    kind: str, tensors: tuple, meta: _Meta, bias_grad: bool, views: dict | None = None
) -> AttentionProblem:
    q, k, v, mask, bias, alibi, sinks, lens_q, _, block_table, rng, _ = tensors
    paged = block_table is not None
    q4, k4, v4 = _bhsd(q, meta.layout), _kv_view(k, meta.layout, paged), _kv_view(v, meta.layout, paged)
    views = dict(views or {})
    views.setdefault("q", q4)
    views.setdefault("k", k4)
    views.setdefault("v", v4)
    if "o" not in views:
        views["o"] = _empty_out(q4, v4.shape[-1], q.dtype) if q4.dtype in OUT_DTYPES else q4
    if "lse" not in views:
        views["lse"] = _lse_view(torch.empty(_lse_shape(q, meta)), meta)
    strides = {n: _strides(t) for n, t in views.items()}
    strides["lse"] = tuple(views["lse"].stride())
    if meta.layout == 2:
        strides["lse"] = (0, *strides["lse"][1:])
        for n in strides:
            if n != "lse" and not (paged and n in ("k", "v", "dk", "dv")):
                strides[n] = (0, *strides[n][1:])
    batch = q4.shape[0] if meta.layout != 2 else lens_q.shape[0] - 1
    hq, d = q4.shape[1], q4.shape[-1]
    hkv, dv = k4.shape[1], v4.shape[-1]
    page = k.shape[1] if paged else 0
    mask4 = _broadcast(mask, batch, hq, meta) if mask is not None else None
    bias4 = _broadcast(bias, batch, hq, meta) if bias is not None else None
    reach = max(
        (t.shape[0] - 1) * abs(t.stride(0))
        + sum((n - 1) * abs(s) for n, s in zip(t.shape[1:], t.stride()[1:]))
        for t in views.values()
        if t.numel()
    )
    return AttentionProblem(
        kind=kind,
        batch=batch,
        heads_q=hq,
        heads_kv=hkv,
        seqlen_q=meta.seqlen_q,
        seqlen_kv=meta.seqlen_kv,
        head_dim=d,
        head_dim_v=dv,
        dtype=str(q.dtype).removeprefix("torch."),
        out_dtype=str(OUT_DTYPES[meta.out_dtype]).removeprefix("torch."),
        strides=tuple(sorted(strides.items())),
        window=(meta.left, meta.right),
        bottom_right=bool(meta.bottom_right),
        mask=_strides(mask4) if mask4 is not None else None,
        bias=_strides(bias4) if bias4 is not None else None,
        bias_grad=bias_grad,
        alibi=(alibi.stride(0) if alibi.ndim == 2 else 0) if alibi is not None else None,
        softcap=False,  # filled by the caller (a float decides the flag)
        sinks=sinks is not None,
        varlen=meta.varlen,
        page=page,
        block_table_stride=block_table.stride(0) if paged else 0,
        dropout=rng is not None,
        fp8=q.dtype == torch.float8_e4m3fn,
        tf32=config.allow_tf32,
        deterministic=config.deterministic,
        index_64=reach >= 2**31 - 1,
    )


def _broadcast(t: torch.Tensor, batch: int, hq: int, meta: _Meta) -> torch.Tensor:
    return t.expand(batch, hq, meta.seqlen_q, meta.seqlen_kv)


# Per-call plans: a repeat call with the same geometry costs one dictionary lookup.
_plans: dict[tuple, Callable] = {}


def _plan(kind: str, tensors: tuple, meta: _Meta, bias_grad: bool, softcap: bool, views: dict) -> Callable:
    key = (
        kind,
        config.version,
        meta,
        bias_grad,
        softcap,
        *((tuple(t.shape), t.stride(), t.dtype) if t is not None else None for t in tensors),
        *((n, tuple(t.shape), t.stride()) for n, t in views.items()),
    )
    plan = _plans.get(key)
    if plan is None:
        import dataclasses

        problem = dataclasses.replace(_problem(kind, tensors, meta, bias_grad, views), softcap=softcap)
        choice = FAMILY.select(problem)
        plan = _plans[key] = choice.engine.bind(problem, choice.config)
    return plan


def _floats(scale: float, softcap: float) -> tuple[float, float]:
    """(qk_scale, cap_scale) of the kernels: log2(e) is folded into the scale (or the cap)."""
    if softcap > 0:
        return scale / softcap, softcap * math.log2(math.e)
    return scale * math.log2(math.e), 0.0


# ---------------------------------------------------------------------------------------------
# torch.library ops.

_FWD_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor? mask, Tensor? bias, Tensor? alibi, Tensor? sinks, "
    "Tensor? lens_q, Tensor? lens_kv, Tensor? block_table, Tensor? rng, Tensor? descale, float scale, "
    "float softcap, float dropout_p, int[] meta) -> (Tensor, Tensor)"
)


def _fake_forward(q, k, v, mask, bias, alibi, sinks, lens_q, lens_kv, block_table, rng, descale,
                  scale, softcap, dropout_p, meta):  # fmt: skip
    meta = _Meta(*meta)
    out = _empty_out(q, v.shape[-1], OUT_DTYPES[meta.out_dtype])
    return out, q.new_empty(_lse_shape(q, meta), dtype=torch.float32)


@custom_op("attention_forward", _FWD_SCHEMA, _fake_forward)
def _forward(q, k, v, mask, bias, alibi, sinks, lens_q, lens_kv, block_table, rng, descale,
             scale, softcap, dropout_p, meta):  # fmt: skip
    """(output in q's layout, fp32 log-sum-exp)."""
    meta = _Meta(*meta)
    tensors = (q, k, v, mask, bias, alibi, sinks, lens_q, lens_kv, block_table, rng, descale)
    packed = meta.layout == 2
    out = _empty_out(q, v.shape[-1], OUT_DTYPES[meta.out_dtype], zero=packed)
    lse = (torch.full if packed else torch.empty)(
        _lse_shape(q, meta), *((-math.inf,) if packed else ()), dtype=torch.float32, device=q.device
    )
    if out.numel() == 0 and lse.numel() == 0:
        return out, lse
    if k.shape[0] == 0 or meta.seqlen_kv == 0 or q.shape[-1] == 0:
        out.zero_()
        lse.fill_(-math.inf)
        if sinks is not None and lse.numel():
            lse.copy_(
                sinks.float()[:, None] if meta.layout == 2 else sinks.float()[None, :, None].expand_as(lse)
            )
        return out, lse
    paged = block_table is not None
    views = {"o": _bhsd(out, meta.layout), "lse": _lse_view(lse, meta)}
    plan = _plan("fwd", tensors, meta, False, softcap > 0, views)
    q4, k4, v4 = _bhsd(q, meta.layout), _kv_view(k, meta.layout, paged), _kv_view(v, meta.layout, paged)
    batch = q4.shape[0] if meta.layout != 2 else lens_q.shape[0] - 1
    mask4 = _broadcast(mask, batch, q4.shape[1], meta) if mask is not None else q4
    bias4 = _broadcast(bias, batch, q4.shape[1], meta) if bias is not None else q4
    qk_scale, cap_scale = _floats(scale, softcap)
    absent = q4
    plan(
        q4, k4, v4, views["o"], views["lse"], mask4, bias4,
        *(t if t is not None else absent for t in (alibi, sinks, lens_q, lens_kv, block_table, rng, descale)),
        qk_scale, cap_scale, dropout_p,
    )  # fmt: skip
    return out, lse


_BWD_SCHEMA = (
    "(Tensor do, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor? mask, Tensor? bias, "
    "Tensor? alibi, Tensor? sinks, Tensor? lens_q, Tensor? lens_kv, Tensor? rng, float scale, "
    "float softcap, float dropout_p, int[] meta, bool bias_grad) -> (Tensor, Tensor, Tensor, Tensor, Tensor)"
)


def _grad_buffers(q, k, v, mask, bias, sinks, meta, bias_grad):
    packed = meta.layout == 2
    dq = _empty_out(q, q.shape[-1], q.dtype, zero=packed)
    dk = _empty_out(k, k.shape[-1], k.dtype, zero=packed)
    dv = _empty_out(v, v.shape[-1], v.dtype, zero=packed)
    if bias_grad:
        q4 = _bhsd(q, meta.layout)
        dbias = torch.zeros(q4.shape[0], q4.shape[1], meta.seqlen_q, meta.seqlen_kv, device=q.device)
    else:
        dbias = q.new_empty(0, dtype=torch.float32)
    dsinks = q.new_empty(sinks.shape if sinks is not None else (0,), dtype=torch.float32)
    return dq, dk, dv, dbias, dsinks


def _fake_backward(do, q, k, v, o, lse, mask, bias, alibi, sinks, lens_q, lens_kv, rng, scale, softcap,
                   dropout_p, meta, bias_grad):  # fmt: skip
    return _grad_buffers(q, k, v, mask, bias, sinks, _Meta(*meta), bias_grad)


@custom_op("attention_backward", _BWD_SCHEMA, _fake_backward)
def _backward(do, q, k, v, o, lse, mask, bias, alibi, sinks, lens_q, lens_kv, rng, scale, softcap,
              dropout_p, meta, bias_grad):  # fmt: skip
    """(dq, dk, dv, dbias over the full [B, Hq, Sq, Skv] or empty, dsinks fp32 or empty)."""
    meta = _Meta(*meta)
    dq, dk, dv, dbias, dsinks = _grad_buffers(q, k, v, mask, bias, sinks, meta, bias_grad)
    if q.numel() == 0 or k.numel() == 0 or v.numel() == 0:
        for t in (dq, dk, dv, dbias, dsinks):
            t.zero_()
        return dq, dk, dv, dbias, dsinks
    lse = lse.contiguous()
    views = {
        "o": _bhsd(o, meta.layout),
        "do": _bhsd(do, meta.layout),
        "dq": _bhsd(dq, meta.layout),
        "dk": _bhsd(dk, meta.layout),
        "dv": _bhsd(dv, meta.layout),
        "lse": _lse_view(lse, meta),
    }
    tensors = (q, k, v, mask, bias, alibi, sinks, lens_q, lens_kv, None, rng, None)
    plan = _plan("bwd", tensors, meta, bias_grad, softcap > 0, views)
    q4, k4, v4 = _bhsd(q, meta.layout), _bhsd(k, meta.layout), _bhsd(v, meta.layout)
    batch = q4.shape[0] if meta.layout != 2 else lens_q.shape[0] - 1
    mask4 = _broadcast(mask, batch, q4.shape[1], meta) if mask is not None else q4
    bias4 = _broadcast(bias, batch, q4.shape[1], meta) if bias is not None else q4
    qk_scale, cap_scale = _floats(scale, softcap)
    absent = q4
    dsink = plan(
        q4, k4, v4, views["o"], views["do"], views["lse"], views["dq"], views["dk"], views["dv"],
        dbias if bias_grad else absent, mask4, bias4,
        *(t if t is not None else absent for t in (alibi, sinks, lens_q, lens_kv, rng)),
        qk_scale, cap_scale, dropout_p, scale,
    )  # fmt: skip
    if dsink is not None:
        dsinks.copy_(dsink.view(batch, q4.shape[1], -1).sum((0, 2)))
    return dq, dk, dv, dbias, dsinks


class _AttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bias, sinks, call: _Call):
        args = call._replace(q=q, k=k, v=v, bias=bias, sinks=sinks)
        o, lse = _forward(*args.tensors(), call.scale, call.softcap, call.dropout_p, list(call.meta))
        ctx.save_for_backward(q, k, v, o, lse, bias, sinks)
        ctx.call = call
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # no zeros for the LSE's (absent) gradient
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        if do is None:
            return (None,) * 6
        q, k, v, o, lse, bias, sinks = ctx.saved_tensors
        c = ctx.call
        bias_grad = bias is not None and ctx.needs_input_grad[3]
        dq, dk, dv, dbias, dsinks = _backward(
            do.contiguous() if do.stride(-1) != 1 else do, q, k, v, o, lse, c.mask, bias, c.alibi, sinks,
            c.lens_q, c.lens_kv, c.rng, c.scale, c.softcap, c.dropout_p, list(c.meta), bias_grad,
        )  # fmt: skip
        db = _reduce_bias(dbias, bias) if bias_grad else None
        ds = dsinks.to(sinks.dtype) if sinks is not None and ctx.needs_input_grad[4] else None
        return dq, dk, dv, db, ds, None


def _reduce_bias(full: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The full score gradient summed over the dims ``bias`` was broadcast along, in its shape."""
    lead = full.ndim - bias.ndim
    dims = list(range(lead)) + [
        lead + d for d in range(bias.ndim) if bias.shape[d] == 1 and full.shape[lead + d] != 1
    ]
    out = full.sum(dims, keepdim=True) if dims else full
    return out.reshape(bias.shape).to(bias.dtype)


# ---------------------------------------------------------------------------------------------
# Public functions.


# Eager calls seen before with no tensor options but q, k, v and a block table run a closure cached
# under their shapes, strides, dtypes and options: validated once, plan looked up once. A decode
# step's host time is as long as its kernels (about 100 us on the H100 machines' hosts).
_eager: dict[tuple, Callable[..., torch.Tensor | tuple[torch.Tensor, torch.Tensor]]] = {}
_EAGER_LIMIT = 1024


def _eager_forward(call: _Call, out: torch.Tensor, lse: torch.Tensor, return_lse: bool) -> Callable:
    """The forward of ``call`` for new tensors of the same geometry (``out``/``lse``: its results,
    whose layouts every repeat call gets)."""
    meta = call.meta
    paged = call.block_table is not None
    views = {"o": _bhsd(out, meta.layout), "lse": _lse_view(lse, meta)}
    plan = _plan("fwd", call.tensors(), meta, False, call.softcap > 0, views)
    qk_scale, cap_scale = _floats(call.scale, call.softcap)
    make_out = _allocator(out)
    lse_shape, layout, pages = lse.shape, meta.layout, call.k.shape[0]
    descale = call.descale  # fp8 without descale arguments: the call's constant ones

    def run(q, k, v, block_table):
        if paged:
            check_values(OP, "block_table", block_table, 0, pages - 1, "pages")
            block_table = block_table.to(torch.int32)
        o = make_out()
        lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
        q4 = _bhsd(q, layout)
        absent = q4
        plan(
            q4, _kv_view(k, layout, paged), _kv_view(v, layout, paged), _bhsd(o, layout), lse,
            absent, absent, absent, absent, absent, absent, block_table if paged else absent, absent,
            absent if descale is None else descale, qk_scale, cap_scale, 0.0,
        )  # fmt: skip
        return (o, lse) if return_lse else o

    return run


class _EagerAttention(torch.autograd.Function):
    """``_AttentionFunction`` for the eager fast path of plain q, k, v: ``program`` (see
    ``_eager_training``) runs plans bound once, forward and backward."""

    @staticmethod
    def forward(ctx, q, k, v, program):
        o, lse = program[0](q, k, v, None)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.program = program
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # no zeros for the LSE's (absent) gradient
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        if do is None:
            return None, None, None, None
        return (*ctx.program[1](do, *ctx.saved_tensors), None)


_apply_eager = raw_apply(_EagerAttention)


class _EagerPackedAttention(torch.autograd.Function):
    """``_EagerAttention`` for q, k, v that together are one packed tensor (``_packed_base``): the
    base is the autograd input and its gradient is written whole, dQ, dK and dV in place, where
    q, k, v as inputs would each take a view's and a transpose's backward and the split's, a
    concatenation (GPT-2 small, H200: 0.22 ms of a 20 ms training step)."""

    @staticmethod
    def forward(ctx, base, views, program):
        o, lse = program[0](*views, None)
        ctx.save_for_backward(base, o, lse)
        offset = base.storage_offset()
        ctx.geometry = [(t.shape, t.stride(), t.storage_offset() - offset) for t in views]
        ctx.program = program
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        if do is None:
            return None, None, None
        base, o, lse = ctx.saved_tensors
        offset = base.storage_offset()
        q, k, v = (base.as_strided(shape, stride, offset + at) for shape, stride, at in ctx.geometry)
        dbase = torch.empty_like(base)
        grads = tuple(dbase.as_strided(*g) for g in ctx.geometry)
        ctx.program[1](do, q, k, v, o, lse, grads)
        return dbase, None, None


_apply_eager_packed = raw_apply(_EagerPackedAttention)


def _packed_base(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """The tensor q, k, v (BHSD) are views of if together they tile it exactly, as a fused qkv
    projection's output split in three and viewed as heads is: (..., 3 * H * D) rows holding the
    query, key and value heads in turn, each head's D contiguous; and if its gradient is theirs:
    it requires grad, each view was made from it differentiably (not a leaf of its own, not made
    under no_grad), and none has hooks or retains its gradient. Else None."""
    base = q._base
    if base is None or k._base is not base or v._base is not base or not base.is_contiguous():
        return None
    if not base.requires_grad or any(
        t.grad_fn is None or t._backward_hooks or t.retains_grad for t in (q, k, v)
    ):
        return None
    if q.ndim != 4 or not (q.shape == k.shape == v.shape) or not (q.stride() == k.stride() == v.stride()):
        return None
    batch, heads, seq, dim = q.shape
    s_b, s_h, s_s, s_d = q.stride()
    width = heads * dim
    if (s_d, s_h, s_s) != (1, dim, 3 * width) or (batch > 1 and s_b != seq * s_s):
        return None
    origin = base.storage_offset()
    offsets = tuple(t.storage_offset() - origin for t in (q, k, v))
    if offsets != (0, width, 2 * width) or base.numel() != 3 * q.numel():
        return None
    return base


def _allocator(like: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A function allocating tensors of ``like``'s shape, dtype, device and memory order (a
    dense one), the order worked out once."""
    order = sorted(range(like.ndim), key=lambda d: -like.stride(d))
    physical, back = [like.shape[d] for d in order], [order.index(d) for d in range(like.ndim)]
    dtype, device = like.dtype, like.device
    if order == list(range(like.ndim)):
        return lambda: torch.empty(*physical, dtype=dtype, device=device)
    return lambda: torch.empty(*physical, dtype=dtype, device=device).permute(back)


def _plannable(call: _Call, out: torch.Tensor) -> bool:
    """Whether a repeat of ``call`` (``out``: its output) can run a bound plan: a non-empty
    output, keys and head dimension (the op's special cases write zeros instead)."""
    return bool(out.numel() and call.k.numel() and call.meta.seqlen_kv and out.shape[-1])


def _eager_training(
    call: _Call, out: torch.Tensor, lse: torch.Tensor, return_lse: bool, packed_gradient: bool
) -> Callable:
    """The call through autograd for new q, k, v of the same geometry, validated once (``out`` and
    ``lse``: its results). Where the geometry allows, both passes run bound plans on the tensors
    as given (launches read only data pointers); the call kept holds none of this call's tensors
    (the options that would are absent here). ``packed_gradient``: q, k, v that tile one tensor
    differentiate through it (``sdpa``'s argument)."""
    template = call._replace(q=None, k=None, v=None)
    if not _plannable(call, out):

        def general(q, k, v, block_table):
            o, lse = _AttentionFunction.apply(q, k, v, None, None, template)
            return (o, lse) if return_lse else o

        return general
    meta, layout, scale, softcap = call.meta, call.meta.layout, call.scale, call.softcap
    qk_scale, cap_scale = _floats(scale, softcap)
    makers = [_allocator(_empty_out(t, t.shape[-1], t.dtype)) for t in (call.q, call.k, call.v)]
    out_strides = out.stride()
    # (config version, plan) for separate gradients and for gradients into a packed tensor's
    # views (their strides differ): each looked up on its first backward.
    backward_plans: dict[bool, list] = {False: [None, None], True: [None, None]}

    def backward(do, q, k, v, o, lse, into=None):
        """dq, dk, dv; ``into``: views to write them to (a packed tensor's), else new tensors."""
        if do.stride() != out_strides:  # the general op (it copies a gradient with strided rows)
            do = do.contiguous() if do.stride(-1) != 1 else do
            args = (do, q, k, v, o, lse, *(None,) * 7, scale, softcap, 0.0, list(meta), False)
            grads = _backward(*args)[:3]
            return grads if into is None else tuple(t.copy_(g) for t, g in zip(into, grads))
        dq, dk, dv = (make() for make in makers) if into is None else into
        cached = backward_plans[into is not None]
        if cached[0] != config.version:
            names = ("o", "do", "dq", "dk", "dv")
            views = {n: _bhsd(t, layout) for n, t in zip(names, (o, do, dq, dk, dv))}
            views["lse"] = _lse_view(lse, meta)
            plan = _plan("bwd", (q, k, v, *(None,) * 9), meta, False, softcap > 0, views)
            cached[:] = config.version, plan
        cached[1](q, k, v, o, do, lse, dq, dk, dv, *(q,) * 8, qk_scale, cap_scale, 0.0, scale)
        return dq, dk, dv

    program = (_eager_forward(call, out, lse, True), backward)
    packed = packed_gradient and layout == 0

    def run(q, k, v, block_table):
        if functorch_active():
            o, lse = _AttentionFunction.apply(q, k, v, None, None, template)
        elif (base := _packed_base(q, k, v) if packed else None) is not None:
            o, lse = _apply_eager_packed(base, (q, k, v), program)
        else:
            o, lse = _apply_eager(q, k, v, program)
        return (o, lse) if return_lse else o

    return run


def _cache(key: tuple, run: Callable) -> None:
    if len(_eager) >= _EAGER_LIMIT:  # e.g. a decode loop over a growing contiguous cache
        _eager.clear()
    _eager[key] = run


@autocast_policy(LOWER, LOWER)
def sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    layout: str = "bhsd",
    causal_alignment: str = "top_left",
    window: tuple[int, int] | None = None,
    bias: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    seqlens_q: torch.Tensor | None = None,
    seqlens_kv: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_kv: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    dropout_seed: int | None = None,
    dropout_offset: int = 0,
    descale_q: float | torch.Tensor | None = None,
    descale_k: float | torch.Tensor | None = None,
    descale_v: float | torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    return_lse: bool = False,
    packed_gradient: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``F.scaled_dot_product_attention`` as a flash-attention kernel, with cuDNN's options.

    ``softmax(scale * q @ k^T + bias) @ v`` without materializing the Sq x Skv scores (memory
    O(B * H * S * D)); differentiable in query, key, value, a float ``attn_mask``/``bias`` and
    ``sinks``.

    Args:
        query, key, value: fp16, bf16, fp32 (or fp8 e4m3 on a GPU), any strides. ``layout="bhsd"``:
            (B, H, S, D), as PyTorch (3-D (N, L, E) inputs are taken as one head);
            ``layout="bshd"``: (B, S, H, D). Head dims up to 256; value's may differ from query's.
            Packed sequences (``cu_seqlens_*``): (total, H, D). Paged cache (``block_table``): key
            and value are (pages, page_size, Hkv, D).
        attn_mask: bool (True = attend) or float (added to the scores, like ``bias``), broadcastable
            to (B, Hq, Sq, Skv).
        dropout_p: probability of zeroing an attention weight (kept ones scaled by 1/(1-p)); the
            Philox stream is ``dropout_seed``/``dropout_offset`` (a fresh seed from torch's
            generator when None), replayed exactly by the backward and by ``dropout_keep_mask``.
        is_causal: query i sees keys j <= i (``causal_alignment="top_left"``, PyTorch's) or
            j <= i + Skv - Sq (``"bottom_right"``, for a query block at the end of the keys).
        scale: the scores' factor, 1/sqrt(D) by default.
        enable_gqa: allow fewer key/value heads than query heads (a divisor): query head h reads kv
            head h // (Hq // Hkv), with no copy of key/value.
        window: (left, right) sliding window around the (aligned) diagonal: i + diag - left <= j <=
            i + diag + right, -1 unbounded; combines with ``is_causal`` (right <= 0).
        bias: an additive float term broadcastable to (B, Hq, Sq, Skv); its gradient is reduced over
            the broadcast dims.
        alibi_slopes: fp32 (Hq,) or (B, Hq): adds -slope * |i + diag - j|.
        softcap: the scores become softcap * tanh(scores / softcap) (before bias and masks).
        sinks: (Hq,) logits that join every softmax denominator (attention sinks), differentiable.
        seqlens_q, seqlens_kv: int (B,) valid lengths of padded tensors; output rows past a length
            are 0 and alignment uses each batch's lengths.
        cu_seqlens_q, cu_seqlens_kv: int (B + 1,) cumulative offsets of packed sequences.
        block_table: int (B, pages_per_seq) page indices of a paged KV cache (forward only);
            ``seqlens_kv`` gives each sequence's cached length (the table's capacity by default).
        descale_q, descale_k, descale_v: fp8 dequantization factors (positive floats or 1-element
            tensors; a float <= 0 is an error, a tensor is not read back to check).
        out_dtype: the output dtype for fp8 inputs (bf16 by default); others return their own.
        return_lse: also return the fp32 log-sum-exp of each row's scores ((B, Hq, Sq); packed:
            (Hq, total)), -inf for a row that sees no key.
        packed_gradient: where query, key and value are views that together tile one tensor (a
            fused qkv projection's output split in three and viewed as heads, BHSD), repeat
            training calls take that tensor as the autograd input and write its gradient whole
            (no concatenation of three gradients, fewer autograd nodes). The views then get no
            gradients of their own: ``torch.autograd.grad(out, query)`` fails and hooks on them
            do not run (views with hooks or ``retain_grad`` are left unpacked). ``patch(model,
            sdpa=True)`` routes with it on: there the views are the model's temporaries.

    Numerics: fp32 accumulation, online softmax with exp2; a row that sees no key gives zeros (not
    NaN) and zero gradients. Lengths and block tables on a GPU are checked there (a bad value is
    a device-side assert at the next synchronization); packed offsets are read on the host (their
    maximum sizes the grid).

    Raises:
        TypeError: unsupported or mismatched dtypes.
        ValueError: mismatched shapes, heads not a multiple, a mask or bias that does not
            broadcast, lengths outside the tensors, bad options.
    """
    eager = None
    if (
        attn_mask is None
        and not dropout_p
        and bias is None
        and alibi_slopes is None
        and softcap is None
        and sinks is None
        and seqlens_q is None
        and seqlens_kv is None
        and cu_seqlens_q is None
        and cu_seqlens_kv is None
        and descale_q is None
        and descale_k is None
        and descale_v is None
        and out_dtype is None
        and query.ndim == 4
        and eager_tensor(query)
        and eager_tensor(key)
        and eager_tensor(value)
        and (block_table is None or plain_eager(block_table))
    ):
        training = torch.is_grad_enabled() and (
            query.requires_grad or key.requires_grad or value.requires_grad
        )
        eager = (
            training, config.version, query.shape, query.stride(), query.dtype, key.shape, key.stride(),
            key.dtype, value.shape, value.stride(), value.dtype, query.device, is_causal, scale, enable_gqa,
            layout, causal_alignment, window, return_lse, packed_gradient,
            None if block_table is None else (block_table.shape, block_table.stride(), block_table.dtype),
        )  # fmt: skip
        fast = _eager.get(eager)
        if fast is not None:
            return fast(query, key, value, block_table)
    call = _prepare(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, layout=layout,
        causal_alignment=causal_alignment, window=window, bias=bias, alibi_slopes=alibi_slopes,
        softcap=softcap, sinks=sinks, seqlens_q=seqlens_q, seqlens_kv=seqlens_kv, cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_kv=cu_seqlens_kv, block_table=block_table, dropout_seed=dropout_seed,
        dropout_offset=dropout_offset, descale_q=descale_q, descale_k=descale_k, descale_v=descale_v,
        out_dtype=out_dtype,
    )  # fmt: skip
    grads = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (call.q, call.k, call.v, call.bias, call.sinks)
    )
    if grads:
        if call.block_table is not None:
            raise ValueError(
                f"{OP}: a paged KV cache (block_table) is forward-only; gradients are not supported"
            )
        if call.descale is not None:
            raise ValueError(f"{OP}: fp8 attention is forward-only")
        o, lse = _AttentionFunction.apply(call.q, call.k, call.v, call.bias, call.sinks, call)
        if eager is not None:
            _cache(eager, _eager_training(call, o, lse, return_lse, packed_gradient))
    else:
        o, lse = _forward(*call.tensors(), call.scale, call.softcap, call.dropout_p, list(call.meta))
        if eager is not None and _plannable(call, o):
            _cache(eager, _eager_forward(call, o, lse, return_lse))
    if call.meta.squeeze:
        o = o.squeeze(1)
        lse = lse.squeeze(1)
    return (o, lse) if return_lse else o


class AttentionGrads(NamedTuple):
    """Gradients from ``sdpa_backward``: dbias (in the bias's shape) and dsinks are None when not asked."""

    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dbias: torch.Tensor | None
    dsinks: torch.Tensor | None


def sdpa_backward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    grad_out: torch.Tensor,
    lse: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    **options,
) -> AttentionGrads:
    """cuDNN's sdpa_backward: gradients of ``sdpa`` from its output, the output's gradient and the
    log-sum-exp ``sdpa(..., return_lse=True)`` returned. Takes the forward's arguments (the same
    ``dropout_seed``/``dropout_offset`` replay its dropout; ``bias``/a float ``attn_mask`` gets
    ``dbias``, ``sinks`` gets ``dsinks``).

    The default engine is deterministic (dK/dV of each kv head summed in one program in a fixed
    order, dQ in a separate pass); with ``tdnn.config.benchmark`` an fp32-atomic dQ engine may be
    timed and chosen unless ``tdnn.config.deterministic`` is set.
    """
    op = "tdnn.sdpa_backward"
    call = _prepare(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, op=op, **options)
    if call.block_table is not None or call.descale is not None:
        raise ValueError("tdnn.sdpa_backward: paged KV caches and fp8 are forward-only")
    q, meta = call.q, call.meta
    o = out.unsqueeze(1) if meta.squeeze else out
    do = grad_out.unsqueeze(1) if meta.squeeze else grad_out
    lse = lse.unsqueeze(1) if meta.squeeze else lse
    expect = (*q.shape[:-1], call.v.shape[-1])
    for name, t in (("out", o), ("grad_out", do)):
        check_tensor("tdnn.sdpa_backward", name, t, dtypes=OUT_DTYPES)
        if tuple(t.shape) != expect:
            raise ValueError(f"tdnn.sdpa_backward: '{name}' has shape {tuple(t.shape)}; expected {expect}")
    check_tensor("tdnn.sdpa_backward", "lse", lse, dtypes=(torch.float32,))
    if tuple(lse.shape) != _lse_shape(q, meta):
        raise ValueError(
            f"tdnn.sdpa_backward: 'lse' has shape {tuple(lse.shape)}; expected {_lse_shape(q, meta)}"
        )
    bias_grad = call.bias is not None
    dq, dk, dv, dbias, dsinks = _backward(
        do, q, call.k, call.v, o, lse, call.mask, call.bias, call.alibi, call.sinks, call.lens_q,
        call.lens_kv, call.rng, call.scale, call.softcap, call.dropout_p, list(meta), bias_grad,
    )  # fmt: skip
    if meta.squeeze:
        dq, dk, dv = dq.squeeze(1), dk.squeeze(1), dv.squeeze(1)
    db = None
    if bias_grad:
        original = options.get("bias")
        original = original if original is not None else attn_mask
        db = _reduce_bias(dbias, call.bias).reshape(original.shape)
    return AttentionGrads(dq, dk, dv, db, dsinks.to(call.sinks.dtype) if call.sinks is not None else None)


def dropout_keep_mask(
    batch: int, heads: int, seqlen_q: int, seqlen_kv: int, dropout_p: float, seed: int, offset: int = 0,
    device: torch.device | str | None = None,
) -> torch.Tensor:  # fmt: skip
    """The (batch, heads, seqlen_q, seqlen_kv) bool mask of attention weights ``sdpa`` keeps for
    ``dropout_p``, ``dropout_seed=seed`` and ``dropout_offset=offset`` (padded lengths; for packed
    sequences use the max lengths and each sequence's index as the batch)."""
    return dropout_mask(batch, heads, seqlen_q, seqlen_kv, dropout_p, seed, offset, device)
