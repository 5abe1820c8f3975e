"""Builders of the library nodes: reductions, normalizations (forward, in training with their
saved statistics, and backward), genstats, attention, pooling, resampling and the layout nodes
(reshape, transpose, permute, slice, concatenate).

Every builder takes ``name=`` (the node's name; its single output takes the same name, several
outputs ``name.field``) and returns the output tensor(s).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .rules import Rules, _flag, _ints, _number
from .types import FLOATS, GraphTensor, Node, error

REDUCTIONS = ("add", "mul", "min", "max", "amax", "avg", "norm1", "norm2", "mul_no_zeros")
POOL_MODES = ("max", "avg")
RESAMPLE_MODES = ("nearest", "linear", "bilinear", "trilinear")
ATTENTION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
NORM_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def row_stats_shape(shape: Sequence[int], k: int) -> tuple[int, ...]:
    """The shape of per-row statistics of a norm over the last ``k`` dimensions of ``shape``:
    those dimensions kept as size 1 (cuDNN's and ``torch.native_layer_norm``'s)."""
    return (*shape[: len(shape) - k], *([1] * k))


class LibraryNodes(Rules):
    """Library-node builders (``Graph`` inherits them through ``NodeBuilders``)."""

    # -----------------------------------------------------------------------------------------
    # Reductions and normalizations.

    def reduction(
        self,
        x: GraphTensor,
        mode: str = "add",
        dim: int | Sequence[int] | None = None,
        *,
        keepdim: bool = True,
        dtype: torch.dtype | None = None,
        name: str | None = None,
    ) -> GraphTensor:
        """cuDNN's reduction: ``mode`` (add, mul, min, max, amax, avg, norm1, norm2, mul_no_zeros)
        over ``dim`` (None: all), keeping reduced dimensions as size 1 unless ``keepdim=False``.
        After pointwise nodes it runs in the same generated kernel."""
        node = self._begin("reduction", "reduction", name, [("x", x)])
        if mode not in REDUCTIONS:
            raise error("argument", f"mode {mode!r}; accepted: {', '.join(REDUCTIONS)}", node)
        self._same_dtype(node, [x])
        dims = list(range(x.ndim)) if dim is None else _ints(node, "dim", dim)
        if any(not -x.ndim <= d < max(x.ndim, 1) for d in dims):
            raise error("shape", f"dim {dims} is out of range for {x.ndim} dimensions", node, x)
        dims = sorted({d % max(x.ndim, 1) for d in dims})
        if mode in ("min", "max", "amax") and any(x.shape[d] == 0 for d in dims):
            raise error("shape", f"{mode} over an empty dimension", node, x)
        _flag(node, "keepdim", keepdim)
        shape = tuple(1 if d in dims else n for d, n in enumerate(x.shape))
        if not keepdim:
            shape = tuple(n for d, n in enumerate(x.shape) if d not in dims)
        attrs = {"mode": mode, "dim": dims, "keepdim": keepdim}
        return self._commit(node, [("", shape, self._out_dtype(node, dtype, x.dtype))], attrs)[0]

    def batchnorm(
        self,
        x: GraphTensor,
        scale: GraphTensor | None = None,
        bias: GraphTensor | None = None,
        running_mean: GraphTensor | None = None,
        running_var: GraphTensor | None = None,
        *,
        eps: float = 1e-5,
        momentum: float = 0.1,
        name: str | None = None,
    ) -> tuple[GraphTensor, GraphTensor, GraphTensor]:
        """cuDNN's batchnorm in training: ``(y, mean, inv_variance)`` with batch statistics (fp32,
        shape (C,)); the running statistics, if given (graph inputs), are updated in place as
        ``F.batch_norm`` does. An activation after it folds in."""
        slots = [
            ("x", x),
            ("scale", scale),
            ("bias", bias),
            ("running_mean", running_mean),
            ("running_var", running_var),
        ]
        node = self._begin("batchnorm", "norm", name, slots)
        self._same_dtype(node, [x], NORM_DTYPES)
        self._rank(node, x, 2, 5)
        for slot, t in slots[1:]:
            self._channel_param(node, slot, t, x)
        if (running_mean is None) != (running_var is None):
            raise error("argument", "give both running_mean and running_var, or neither", node)
        for t in (running_mean, running_var):
            if t is not None and t.kind != "input":
                raise error(
                    "argument", "running statistics are updated in place: they must be graph inputs", node, t
                )
        if x.numel // max(x.shape[1], 1) < 2:
            raise error("shape", "training needs more than one value per channel", node, x)
        attrs = {"eps": _number(node, "eps", eps), "momentum": _number(node, "momentum", momentum)}
        if attrs["eps"] <= 0:
            raise error("argument", "eps must be > 0", node)
        c = (x.shape[1],)
        outs = [("y", x.shape, x.dtype), ("mean", c, torch.float32), ("inv_variance", c, torch.float32)]
        return tuple(self._commit(node, outs, attrs))  # type: ignore[return-value]

    def layernorm(
        self,
        x: GraphTensor,
        scale: GraphTensor | None = None,
        bias: GraphTensor | None = None,
        *,
        normalized_shape: Sequence[int] | None = None,
        eps: float = 1e-5,
        training: bool = False,
        name: str | None = None,
    ) -> GraphTensor | tuple[GraphTensor, ...]:
        """``F.layer_norm`` over ``normalized_shape`` (default: the last dimension). A residual add
        before it and an activation after it fold in (``add_layer_norm``, fused activation).

        With ``training=True`` (cuDNN's training phase) it returns ``(y, mean, inv_variance)``, the
        fp32 statistics of each normalized row with the normalized dimensions kept as size 1
        (``torch.native_layer_norm``'s shape), for ``layernorm_backward``; else ``y``."""
        node = self._begin("layernorm", "norm", name, [("x", x), ("scale", scale), ("bias", bias)])
        self._same_dtype(node, [x], NORM_DTYPES)
        shape = self._normalized(node, x, normalized_shape)
        self._affine(node, "scale", scale, shape)
        self._affine(node, "bias", bias, shape)
        attrs: dict[str, Any] = {"normalized_shape": shape, "eps": _number(node, "eps", eps)}
        if attrs["eps"] <= 0:
            raise error("argument", "eps must be > 0", node)
        outs = [("y" if _flag(node, "training", training) else "", x.shape, x.dtype)]
        if training:  # written only when set: graphs without it serialize as before
            attrs["training"] = True
            stats = row_stats_shape(x.shape, len(shape))
            outs += [("mean", stats, torch.float32), ("inv_variance", stats, torch.float32)]
        result = self._commit(node, outs, attrs)
        return tuple(result) if training else result[0]

    def rmsnorm(
        self,
        x: GraphTensor,
        scale: GraphTensor | None = None,
        *,
        normalized_shape: Sequence[int] | None = None,
        eps: float | None = None,
        training: bool = False,
        name: str | None = None,
    ) -> GraphTensor | tuple[GraphTensor, ...]:
        """``F.rms_norm`` (eps defaults to the dtype's machine epsilon); folds a residual add before
        it (``add_rms_norm``) and an activation after it. With ``training=True`` it returns
        ``(y, inv_rms)``, ``inv_rms`` shaped as ``layernorm``'s statistics, for ``rmsnorm_backward``."""
        node = self._begin("rmsnorm", "norm", name, [("x", x), ("scale", scale)])
        self._same_dtype(node, [x], NORM_DTYPES)
        shape = self._normalized(node, x, normalized_shape)
        self._affine(node, "scale", scale, shape)
        eps = torch.finfo(x.dtype).eps if eps is None else _number(node, "eps", eps)
        if eps <= 0:
            raise error("argument", "eps must be > 0", node)
        attrs: dict[str, Any] = {"normalized_shape": shape, "eps": eps}
        outs = [("y" if _flag(node, "training", training) else "", x.shape, x.dtype)]
        if training:
            attrs["training"] = True
            outs.append(("inv_rms", row_stats_shape(x.shape, len(shape)), torch.float32))
        result = self._commit(node, outs, attrs)
        return tuple(result) if training else result[0]

    def instancenorm(
        self,
        x: GraphTensor,
        scale: GraphTensor | None = None,
        bias: GraphTensor | None = None,
        *,
        eps: float = 1e-5,
        training: bool = False,
        name: str | None = None,
    ) -> GraphTensor | tuple[GraphTensor, ...]:
        """``F.instance_norm`` with the input's statistics: each (sample, channel) over its spatial
        positions, then a per-channel scale and bias (shape (C,)). With ``training=True`` it
        returns ``(y, mean, inv_variance)``, fp32 of shape (N, C, 1, ...), for
        ``instancenorm_backward``."""
        node = self._begin("instancenorm", "norm", name, [("x", x), ("scale", scale), ("bias", bias)])
        self._same_dtype(node, [x], NORM_DTYPES)
        self._rank(node, x, 3, 5)
        self._affine(node, "scale", scale, (x.shape[1],))
        self._affine(node, "bias", bias, (x.shape[1],))
        eps_ = _number(node, "eps", eps)
        if eps_ <= 0:
            raise error("argument", "eps must be > 0", node)
        attrs: dict[str, Any] = {"eps": eps_}
        outs = [("y" if _flag(node, "training", training) else "", x.shape, x.dtype)]
        if training:
            attrs["training"] = True
            stats = row_stats_shape(x.shape, x.ndim - 2)
            outs += [("mean", stats, torch.float32), ("inv_variance", stats, torch.float32)]
        result = self._commit(node, outs, attrs)
        return tuple(result) if training else result[0]

    # -----------------------------------------------------------------------------------------
    # Normalization backward (cuDNN's norm backward operations): the gradients from the forward's
    # input, its saved statistics and the output's gradient ``dy``. Without a scale, ``dscale``
    # and ``dbias`` are the gradients a unit scale and a zero bias would get.

    def _norm_grad_operands(
        self, node: Node, dy: GraphTensor, x: GraphTensor, stats: list[tuple[str, GraphTensor | None]]
    ) -> None:
        for slot, t in stats:
            if t is None:
                raise error(
                    "argument", f"'{slot}' is required (the forward's statistics, from training=True)", node
                )
        self._same_dtype(node, [dy, x], NORM_DTYPES)
        if dy.shape != x.shape:
            raise error("shape", f"must have x's shape {x.shape}", node, dy)

    def _norm_stats(self, node: Node, slot: str, t: GraphTensor, shape: tuple[int, ...]) -> None:
        if t.shape != shape:
            raise error("shape", f"'{slot}' must have shape {shape}", node, t)
        if t.dtype not in FLOATS:
            raise error("dtype", f"'{slot}' must be a float tensor", node, t)

    def _param_grads(
        self, scale: GraphTensor | None, shape: Sequence[int], bias: bool = True
    ) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        dtype = scale.dtype if scale is not None else torch.float32
        out = [("dscale", tuple(shape), dtype)]
        return [*out, ("dbias", tuple(shape), dtype)] if bias else out

    def layernorm_backward(
        self,
        dy: GraphTensor,
        x: GraphTensor,
        scale: GraphTensor | None = None,
        mean: GraphTensor | None = None,
        inv_variance: GraphTensor | None = None,
        *,
        normalized_shape: Sequence[int] | None = None,
        name: str | None = None,
    ) -> tuple[GraphTensor, GraphTensor, GraphTensor]:
        """cuDNN's layernorm backward: ``(dx, dscale, dbias)`` from the forward's input ``x``, its
        ``scale`` (or None) and the ``mean``/``inv_variance`` of ``layernorm(..., training=True)``.
        ``normalized_shape`` defaults to scale's shape, else x's last dimension; dscale and dbias
        have that shape and scale's dtype (fp32 without a scale); dx is contiguous."""
        slots = [("dy", dy), ("x", x), ("scale", scale), ("mean", mean), ("inv_variance", inv_variance)]
        node = self._begin("layernorm_backward", "norm_backward", name, slots)
        self._norm_grad_operands(node, dy, x, slots[3:])
        if normalized_shape is None and scale is not None:
            normalized_shape = list(scale.shape)
        shape = self._normalized(node, x, normalized_shape)
        self._affine(node, "scale", scale, shape)
        for slot, t in slots[3:]:
            self._norm_stats(node, slot, t, row_stats_shape(x.shape, len(shape)))  # type: ignore[arg-type]
        outs = [("dx", x.shape, x.dtype), *self._param_grads(scale, shape)]
        return tuple(self._commit(node, outs, {"normalized_shape": shape}))  # type: ignore[return-value]

    def rmsnorm_backward(
        self,
        dy: GraphTensor,
        x: GraphTensor,
        scale: GraphTensor | None = None,
        inv_rms: GraphTensor | None = None,
        *,
        normalized_shape: Sequence[int] | None = None,
        name: str | None = None,
    ) -> tuple[GraphTensor, GraphTensor]:
        """cuDNN's rmsnorm backward: ``(dx, dscale)`` from the forward's input, ``scale`` (or None)
        and the ``inv_rms`` of ``rmsnorm(..., training=True)``; shapes as ``layernorm_backward``."""
        slots = [("dy", dy), ("x", x), ("scale", scale), ("inv_rms", inv_rms)]
        node = self._begin("rmsnorm_backward", "norm_backward", name, slots)
        self._norm_grad_operands(node, dy, x, slots[3:])
        if normalized_shape is None and scale is not None:
            normalized_shape = list(scale.shape)
        shape = self._normalized(node, x, normalized_shape)
        self._affine(node, "scale", scale, shape)
        self._norm_stats(node, "inv_rms", inv_rms, row_stats_shape(x.shape, len(shape)))  # type: ignore[arg-type]
        outs = [("dx", x.shape, x.dtype), *self._param_grads(scale, shape, bias=False)]
        return tuple(self._commit(node, outs, {"normalized_shape": shape}))  # type: ignore[return-value]

    def batchnorm_backward(
        self,
        dy: GraphTensor,
        x: GraphTensor,
        scale: GraphTensor | None = None,
        mean: GraphTensor | None = None,
        inv_variance: GraphTensor | None = None,
        *,
        name: str | None = None,
    ) -> tuple[GraphTensor, GraphTensor, GraphTensor]:
        """cuDNN's batchnorm backward (training): ``(dx, dscale, dbias)`` from the forward's input,
        ``scale`` (or None) and the batch ``mean``/``inv_variance`` ``batchnorm`` returned; the
        per-channel operands are (C,) or (1, C, 1, ...). dx keeps x's layout; dscale and dbias have
        scale's shape and dtype ((C,) fp32 without a scale)."""
        slots = [("dy", dy), ("x", x), ("scale", scale), ("mean", mean), ("inv_variance", inv_variance)]
        node = self._begin("batchnorm_backward", "norm_backward", name, slots)
        self._norm_grad_operands(node, dy, x, slots[3:])
        self._rank(node, x, 2, 5)
        for slot, t in slots[2:]:
            self._channel_param(node, slot, t, x)
        outs = [
            ("dx", x.shape, x.dtype),
            *self._param_grads(scale, (x.shape[1],) if scale is None else scale.shape),
        ]
        return tuple(self._commit(node, outs, {}))  # type: ignore[return-value]

    def instancenorm_backward(
        self,
        dy: GraphTensor,
        x: GraphTensor,
        scale: GraphTensor | None = None,
        mean: GraphTensor | None = None,
        inv_variance: GraphTensor | None = None,
        *,
        name: str | None = None,
    ) -> tuple[GraphTensor, GraphTensor, GraphTensor]:
        """cuDNN's instancenorm backward: ``(dx, dscale, dbias)`` from the forward's input, its
        (C,) ``scale`` (or None) and the (N, C, 1, ...) ``mean``/``inv_variance`` of
        ``instancenorm(..., training=True)``. dx keeps x's layout; dscale and dbias are (C,)."""
        slots = [("dy", dy), ("x", x), ("scale", scale), ("mean", mean), ("inv_variance", inv_variance)]
        node = self._begin("instancenorm_backward", "norm_backward", name, slots)
        self._norm_grad_operands(node, dy, x, slots[3:])
        self._rank(node, x, 3, 5)
        self._affine(node, "scale", scale, (x.shape[1],))
        for slot, t in slots[3:]:
            self._norm_stats(node, slot, t, row_stats_shape(x.shape, x.ndim - 2))  # type: ignore[arg-type]
        outs = [("dx", x.shape, x.dtype), *self._param_grads(scale, (x.shape[1],))]
        return tuple(self._commit(node, outs, {}))  # type: ignore[return-value]

    def genstats(self, x: GraphTensor, *, name: str | None = None) -> tuple[GraphTensor, GraphTensor]:
        """cuDNN's GenStats: per-channel ``sum(x)`` and ``sum(x * x)`` over all but dimension 1,
        shape (1, C, 1, ...), in fp32 (fp64 for fp64 x). Fuses after pointwise nodes."""
        node = self._begin("genstats", "reduction", name, [("x", x)])
        self._same_dtype(node, [x])
        self._rank(node, x, 2, 5)
        shape = (1, x.shape[1], *([1] * (x.ndim - 2)))
        dt = torch.float64 if x.dtype == torch.float64 else torch.float32
        dims = [d for d in range(x.ndim) if d != 1]
        return tuple(self._commit(node, [("sum", shape, dt), ("sq_sum", shape, dt)], {"dim": dims}))  # type: ignore[return-value]

    # -----------------------------------------------------------------------------------------
    # Attention, pooling, resampling.

    def sdpa(
        self,
        q: GraphTensor,
        k: GraphTensor,
        v: GraphTensor,
        attn_mask: GraphTensor | None = None,
        *,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
        return_stats: bool = False,
        name: str | None = None,
    ):
        """``F.scaled_dot_product_attention`` (q, k, v as (B, H, S, D)) through the flash kernel;
        with ``return_stats`` also the fp32 log-sum-exp of each row, (B, H, Sq): ``(o, stats)``."""
        slots = [("q", q), ("k", k), ("v", v), ("attn_mask", attn_mask)]
        node = self._begin("sdpa", "attention", name, slots)
        self._same_dtype(node, [q, k, v], ATTENTION_DTYPES)
        for t in (q, k, v):
            self._rank(node, t, 4, 4)
        if attn_mask is not None and attn_mask.dtype not in (*FLOATS, torch.bool):
            raise error("dtype", "the mask must be bool or float", node, attn_mask)
        attrs = {
            "is_causal": _flag(node, "is_causal", is_causal),
            "scale": None if scale is None else _number(node, "scale", scale),
            "enable_gqa": _flag(node, "enable_gqa", enable_gqa),
            "return_stats": _flag(node, "return_stats", return_stats),
        }
        metas = [q, k, v] + ([attn_mask] if attn_mask is not None else [])

        def shape_rule(q_, k_, v_, m_=None):
            return F.scaled_dot_product_attention(
                q_, k_, v_, m_, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
            )

        out = self._infer(node, shape_rule, *metas)
        outs = [("o", tuple(out.shape), q.dtype)]
        if return_stats:
            outs.append(("stats", tuple(q.shape[:3]), torch.float32))
        result = self._commit(node, outs, attrs)
        return tuple(result) if return_stats else result[0]

    def sdpa_backward(
        self,
        q: GraphTensor,
        k: GraphTensor,
        v: GraphTensor,
        o: GraphTensor,
        do: GraphTensor,
        stats: GraphTensor,
        attn_mask: GraphTensor | None = None,
        *,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
        name: str | None = None,
    ) -> tuple[GraphTensor, GraphTensor, GraphTensor]:
        """cuDNN's sdpa backward: ``(dq, dk, dv)`` from the forward's operands, its output ``o``,
        the output's gradient ``do`` and the forward's ``stats``."""
        slots = [
            ("q", q),
            ("k", k),
            ("v", v),
            ("o", o),
            ("do", do),
            ("stats", stats),
            ("attn_mask", attn_mask),
        ]
        node = self._begin("sdpa_backward", "attention", name, slots)
        self._same_dtype(node, [q, k, v, o, do], ATTENTION_DTYPES)
        for t in (q, k, v, o, do):
            self._rank(node, t, 4, 4)
        expect_o = (*q.shape[:3], v.shape[3])
        for t in (o, do):
            if t.shape != expect_o:
                raise error("shape", f"must have shape {expect_o}", node, t)
        if stats.shape != q.shape[:3] or stats.dtype != torch.float32:
            raise error("shape", f"stats must be float32 of shape {q.shape[:3]}", node, stats)
        attrs = {
            "is_causal": _flag(node, "is_causal", is_causal),
            "scale": None if scale is None else _number(node, "scale", scale),
            "enable_gqa": _flag(node, "enable_gqa", enable_gqa),
        }
        metas = [q, k, v] + ([attn_mask] if attn_mask is not None else [])
        self._infer(
            node,
            lambda q_, k_, v_, m_=None: F.scaled_dot_product_attention(
                q_, k_, v_, m_, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
            ),
            *metas,
        )
        outs = [("dq", q.shape, q.dtype), ("dk", k.shape, k.dtype), ("dv", v.shape, v.dtype)]
        return tuple(self._commit(node, outs, attrs))  # type: ignore[return-value]

    def pool(
        self,
        x: GraphTensor,
        mode: str = "max",
        kernel_size=2,
        stride=None,
        padding=0,
        *,
        dilation=1,
        ceil_mode: bool = False,
        count_include_pad: bool = True,
        name: str | None = None,
    ) -> GraphTensor:
        """Max or average pooling (``F.max_pool{1,2,3}d`` / ``F.avg_pool{1,2,3}d`` by x's rank)."""
        node = self._begin("pool", "pool", name, [("x", x)])
        if mode not in POOL_MODES:
            raise error("argument", f"mode {mode!r}; accepted: {', '.join(POOL_MODES)}", node)
        self._same_dtype(node, [x])
        self._rank(node, x, 3, 5)
        nd = x.ndim - 2
        attrs = {
            "mode": mode,
            "kernel_size": _ints(node, "kernel_size", kernel_size, nd),
            "stride": _ints(node, "stride", kernel_size if stride is None else stride, nd),
            "padding": _ints(node, "padding", padding, nd),
            "dilation": _ints(node, "dilation", dilation, nd),
            "ceil_mode": _flag(node, "ceil_mode", ceil_mode),
            "count_include_pad": _flag(node, "count_include_pad", count_include_pad),
        }
        if mode == "avg" and any(d != 1 for d in attrs["dilation"]):
            raise error("argument", "average pooling has no dilation", node)
        out = self._infer(node, pool_function(attrs, nd), x)
        return self._commit(node, [("", tuple(out.shape), x.dtype)], attrs)[0]

    def resample(
        self,
        x: GraphTensor,
        size=None,
        scale_factor=None,
        *,
        mode: str = "nearest",
        align_corners: bool | None = None,
        name: str | None = None,
    ) -> GraphTensor:
        """cuDNN's resample: ``F.interpolate`` (nearest, linear, bilinear, trilinear)."""
        node = self._begin("resample", "pool", name, [("x", x)])
        if mode not in RESAMPLE_MODES:
            raise error("argument", f"mode {mode!r}; accepted: {', '.join(RESAMPLE_MODES)}", node)
        self._same_dtype(node, [x])
        self._rank(node, x, 3, 5)
        if (size is None) == (scale_factor is None):
            raise error("argument", "give exactly one of size and scale_factor", node)
        nd = x.ndim - 2
        attrs = {
            "mode": mode,
            "size": None if size is None else _ints(node, "size", size, nd),
            "scale_factor": None
            if scale_factor is None
            else [
                _number(node, "scale_factor", s)
                for s in (scale_factor if isinstance(scale_factor, (list, tuple)) else [scale_factor] * nd)
            ],
            "align_corners": align_corners
            if align_corners is None
            else _flag(node, "align_corners", align_corners),
        }
        out = self._infer(
            node,
            lambda m: F.interpolate(m, attrs["size"], attrs["scale_factor"], mode, attrs["align_corners"]),
            x,
        )
        return self._commit(node, [("", tuple(out.shape), x.dtype)], attrs)[0]

    # -----------------------------------------------------------------------------------------
    # Layout: views and copies.

    def reshape(self, x: GraphTensor, shape: Sequence[int], *, name: str | None = None) -> GraphTensor:
        """``x.reshape(shape)`` (one -1 allowed): a view when the layout allows, else a copy."""
        node = self._begin("reshape", "layout", name, [("x", x)])
        out = self._infer(node, lambda m: m.reshape(_ints(node, "shape", list(shape))), x)
        return self._commit(node, [("", tuple(out.shape), x.dtype)], {"shape": list(out.shape)})[0]

    def transpose(self, x: GraphTensor, dim0: int, dim1: int, *, name: str | None = None) -> GraphTensor:
        """``x.transpose(dim0, dim1)`` (a view)."""
        node = self._begin("transpose", "layout", name, [("x", x)])
        d0, d1 = _ints(node, "dim0", dim0)[0], _ints(node, "dim1", dim1)[0]
        out = self._infer(node, lambda m: m.transpose(d0, d1), x)
        dims = list(range(x.ndim))
        dims[d0 % x.ndim], dims[d1 % x.ndim] = dims[d1 % x.ndim], dims[d0 % x.ndim]
        return self._commit(node, [("", tuple(out.shape), x.dtype)], {"dims": dims})[0]

    def permute(self, x: GraphTensor, dims: Sequence[int], *, name: str | None = None) -> GraphTensor:
        """``x.permute(dims)`` (a view)."""
        node = self._begin("transpose", "layout", name, [("x", x)])
        order = _ints(node, "dims", list(dims))
        out = self._infer(node, lambda m: m.permute(order), x)
        return self._commit(node, [("", tuple(out.shape), x.dtype)], {"dims": [d % x.ndim for d in order]})[0]

    def slice(
        self,
        x: GraphTensor,
        dim: int,
        start: int | None = None,
        end: int | None = None,
        step: int = 1,
        *,
        name: str | None = None,
    ) -> GraphTensor:
        """``x[..., start:end:step, ...]`` along ``dim`` (a view)."""
        node = self._begin("slice", "layout", name, [("x", x)])
        d = _ints(node, "dim", dim)[0]
        if not -x.ndim <= d < x.ndim:
            raise error("shape", f"dim {d} out of range", node, x)
        d %= x.ndim
        n = x.shape[d]
        st = _ints(node, "step", step)[0]
        if st < 1:
            raise error("argument", "step must be >= 1", node)
        s, e, _ = slice(start, end, st).indices(n)
        out_n = len(range(s, e, st))
        shape = (*x.shape[:d], out_n, *x.shape[d + 1 :])
        return self._commit(
            node, [("", shape, x.dtype)], {"dim": d, "start": s, "end": max(e, s), "step": st}
        )[0]

    def concatenate(
        self, tensors: Sequence[GraphTensor], dim: int = 0, *, name: str | None = None
    ) -> GraphTensor:
        """``torch.cat(tensors, dim)`` as one copy kernel per operand into the output."""
        tensors = list(tensors)
        node = self._begin("concatenate", "layout", name, [(f"in{i}", t) for i, t in enumerate(tensors)])
        if not tensors:
            raise error("argument", "needs at least one tensor", node)
        self._same_dtype(node, tensors, (*FLOATS, torch.bool))
        d = _ints(node, "dim", dim)[0]
        out = self._infer(node, lambda *ms: torch.cat(ms, d), *tensors)
        return self._commit(node, [("", tuple(out.shape), tensors[0].dtype)], {"dim": d % out.ndim})[0]


def pool_function(attrs: dict[str, Any], nd: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The ``torch.nn.functional`` pooling call a pool node's attributes describe."""
    if attrs["mode"] == "max":
        fn = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[nd - 1]
        return lambda x: fn(
            x, attrs["kernel_size"], attrs["stride"], attrs["padding"], attrs["dilation"], attrs["ceil_mode"]
        )
    fn = (F.avg_pool1d, F.avg_pool2d, F.avg_pool3d)[nd - 1]
    return lambda x: fn(
        x,
        attrs["kernel_size"],
        attrs["stride"],
        attrs["padding"],
        attrs["ceil_mode"],
        attrs["count_include_pad"],
    )
