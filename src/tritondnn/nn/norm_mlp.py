"""A pre-norm transformer block's second half, ``mlp(norm(a + b))`` with the sum ``a + b``, as one
autograd node: the fused add + layer norm's plans (``ops.norm.layer``'s eager program) and the
MLP's two products (``ops.matmul.autograd.pair_forward``/``pair_backward``), forward and backward.
Where the separate calls record three nodes a block (add + norm, the MLP's pair of products) and
the norm's output passes between them, this records one.

The node runs only what the separate calls validated: the norm's cached call for its key (the
fused op's key: shapes, strides, dtypes, eps, autocast's lowered copy, config version) and the
MLP's pair of products kept on its first Linear (``layers.linear_pair_call``), whose print is
checked against the norm's output as it will be (its dtype and layout follow from the norm's
key). Anything else, and any call without autograd recording, goes the separate way.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..core.library import functorch_active, raw_apply
from ..ops.matmul.autograd import no_double_backward, pair_backward, pair_forward
from ..ops.norm import layer as layer_norm_ops
from . import cache
from .containers import Sequential, linear_pair_at
from .layers import (
    _LINEAR_PAIR,
    LayerNorm,
    _hooked,
    _linear_print,
    _own_print,
    add_norm_keeps_dtype,
    linear_print_of,
)


class _NormLinearPairFunction(torch.autograd.Function):
    """``(pair(layer_norm(x + residual)), x + residual)``: the norm's program forward (its
    output's lowered copy kept for the first product under autocast), then the pair's products;
    backward the pair's programs, then the norm's with the sum's own gradient added."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, w1, b1, w2, b2, program, first, second, cast):
        y, total, stats = program[0](x, residual, weight, bias)
        out, saved, ctx.chain = pair_forward(y, w1, b1, w2, b2, first, second, cast)
        ctx.save_for_backward(total, weight, bias, stats, *saved)
        ctx.program = program
        ctx.set_materialize_grads(False)
        return out, total

    @staticmethod
    def backward(ctx, grad, grad_total):
        no_double_backward("layer norm + linear pair")
        total, weight, bias, stats, *saved = ctx.saved_tensors
        need_x, need_res, need_w, need_b, *need_pair = ctx.needs_input_grad[:8]
        need_y = need_x or need_res or need_w or need_b
        dy = dw1 = db1 = dw2 = db2 = None
        if grad is not None:
            dy, dw1, db1, dw2, db2 = pair_backward(grad, saved, ctx.chain, need_y, *need_pair)
        if dy is None:  # the sum's gradient alone (or none) reaches the inputs
            dx = dres = grad_total
            dw = db = None
        else:
            wanted = (need_w, need_b, need_res)
            dx, dres, dw, db = ctx.program[1](dy, total, weight, bias, stats, grad_total, *wanted)
        return dx, dres if need_res else None, dw, db, dw1, db1, dw2, db2, None, None, None, None


_apply = raw_apply(_NormLinearPairFunction)

# On the norm: (its key, (dtype, requires_grad, print) of its output, the pair's entry on the first
# Linear (that Linear's print on the output, the second's own print, (first, second, cast)), the
# norm's program)
_NORM_PAIR = "_tdnn_norm_linear_pair"


def mlp_parts(mlp: nn.Module) -> tuple | None:
    """``containers.linear_pair_at``'s parts (without the count) of a tritondnn Sequential that is
    exactly a Linear pair, no hooks on it; else None."""
    if type(mlp) is not Sequential or _hooked(mlp):
        return None
    modules = list(mlp._modules.values())
    parts = linear_pair_at(modules, 0)
    return None if parts is None or parts[-1] != len(modules) else parts[:-1]


def _norm_key(norm: nn.Module, input: torch.Tensor, residual: torch.Tensor) -> tuple | None:
    """The key ``tdnn.add_layer_norm`` gives ``norm``'s fused call on these tensors, None where
    ``LayerNorm.forward_add`` would not make that call."""
    if not add_norm_keeps_dtype(input):
        return None
    low = layer_norm_ops._low_for_products(input)
    params = norm._parameters
    args = (norm.normalized_shape, params.get("weight"), params.get("bias"), norm.eps, None, low)
    return layer_norm_ops._eager_key("tdnn.add_layer_norm", input, residual, *args)


def fused_call(norm: nn.Module, mlp: nn.Module, input: Any, residual: Any) -> tuple | None:
    """``(mlp(norm(input + residual)), input + residual)`` as one node where autograd records and
    ``remember`` kept the node for such a call (input the operand whose dtype the sum takes; the
    caller checked the norm for hooks), else None (the caller runs the fused add + norm and the
    MLP as they are)."""
    entry = cache.cached(norm, _NORM_PAIR)
    if entry is None or not torch.is_grad_enabled() or type(norm) is not LayerNorm:
        return None
    parts = mlp_parts(mlp)
    if parts is None:
        return None
    key = _norm_key(norm, input, residual)
    if key is None or key != entry[0]:
        return None
    first, act, _, second, last = parts
    _, spec, pair, program = entry
    if linear_print_of(first, *spec, act) != pair[0] or _own_print(second, last and last[0]) != pair[1]:
        return None
    p, q, n = first._parameters, second._parameters, norm._parameters
    args = (input, residual, n["weight"], n["bias"], p["weight"], p["bias"], q["weight"], q["bias"], program)
    args += pair[2]
    return _NormLinearPairFunction.apply(*args) if functorch_active() else _apply(*args)


def remember(norm: nn.Module, mlp: nn.Module, input: Any, residual: Any, normalized: Any) -> None:
    """After the separate calls: keep the node for calls like this one on ``norm`` where the
    norm's fused call and the MLP's pair both ran their cached paths (``normalized``: the norm's
    output the MLP was called on)."""
    if not torch.is_grad_enabled() or type(norm) is not LayerNorm or type(normalized) is not torch.Tensor:
        return
    parts = mlp_parts(mlp)
    key = None if parts is None else _norm_key(norm, input, residual)
    fast = None if key is None else layer_norm_ops._eager.get(key)
    if fast is None or not hasattr(fast, "program"):
        return
    first, act, _, second, last = parts
    mark = _linear_print(first, normalized, act)
    pair = cache.cached(first, _LINEAR_PAIR)
    if mark is None or not mark[1] or pair is None or pair[0] != mark:
        return
    if pair[1] != _own_print(second, last and last[0]):
        return
    spec = (normalized.dtype, normalized.requires_grad, cache.tensor_print(normalized))
    cache.store(norm, _NORM_PAIR, (key, spec, pair, fast.program))
