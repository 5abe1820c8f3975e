"""Recurrent networks (cuDNN's RNN API): LSTM (with projection), GRU and Elman RNN (tanh or ReLU),
multi-layer, bidirectional, over padded or packed variable-length batches, forward and backward.

Each layer runs in three parts:

1. the input projection of every step and both directions as one GEMM (the matmul op on
   ``(T * B, I) x (D * G, I)^T``), differentiated into the input gradient and the W_ih / b_ih
   gradients, themselves GEMMs over all steps;
2. the recurrence, a custom op with a Triton kernel per engine (``engines``): the gate
   products with W_hh, the gate nonlinearities, the cell update, the projection and the length
   masking fused, step after step;
3. backward, the same engines run back through time, computing the gate gradients fused with
   the cell's backward; the W_hh, b_hh and W_hr gradients are then GEMMs over all steps.

Dropout between layers (training) uses ``ops.dropout``'s stateless Philox mask.

Files: ``reference`` (the float64 meaning), ``kernels`` (Triton), ``engines`` (problem, engines,
cost model); this module holds the custom ops, autograd, validation and the public functions.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence

import torch
from torch.autograd.function import once_differentiable
from torch.nn.utils.rnn import PackedSequence

from ...core.autocast import FP16, LOWER, autocast_policy
from ...core.checks import check_tensor
from ...core.config import config
from ...core.library import custom_op
from ..dropout import counters_used
from ..dropout import dropout as _dropout
from ..matmul.library import _forward as _matmul
from .engines import FAMILY, RNNProblem
from .reference import GATES, rnn_reference, split_weights, weights_per_layer

__all__ = ["FAMILY", "RNNProblem", "gru", "lstm", "rnn", "rnn_reference"]


# ---------------------------------------------------------------------------------------------
# torch.library ops: one layer's recurrence, forward and backward. Shapes as in ``kernels``.

_plans: dict[tuple, Callable[..., None]] = {}


def _plan(key: tuple, problem: Callable[[], RNNProblem], algo: str | None, args: Callable) -> Callable:
    key = (config.version, algo, *key)
    run = _plans.get(key)
    if run is None:
        p = problem()
        choice = FAMILY.choose(p, algo, args, f"tdnn.{p.cell.split('_')[0]}")
        run = _plans[key] = choice.engine.bind(p, choice.config)
    return run


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _dims(x: torch.Tensor, h0: torch.Tensor, cell: str) -> tuple[int, int, int, int, int]:
    steps, batch, directions, g = x.shape
    return steps, batch, directions, g // GATES[cell], h0.shape[-1]


def _fake_forward(x, whh, bhh, whr, h0, c0, lengths, cell, save, algo):
    T, B, D, H, P = _dims(x, h0, cell)
    acc = _acc(x.dtype)
    slots = T + 1 if save else 2

    def empty(shape, dtype=x.dtype):  # torch.empty: the tests' poison fixture fills it with NaN
        return torch.empty(shape, dtype=dtype, device=x.device)

    return (
        empty((T, B, D, P)),
        empty((D, B, P)),
        empty((D, B, H) if cell == "lstm" else (0,)),
        empty((T, B, D, H if cell.startswith("rnn") else 4 * H) if save else (0,), acc),
        empty((D, slots, B, P)),
        empty((D, slots, B, H) if cell == "lstm" else (0,), acc),
        empty((T if save else 1, B, D, H) if P != H else (0,)),
    )


@custom_op(
    "rnn_forward",
    "(Tensor x, Tensor whh, Tensor? bhh, Tensor? whr, Tensor h0, Tensor? c0, Tensor? lengths, str cell, "
    "bool save, str? algo) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    _fake_forward,
)
def _forward(x, whh, bhh, whr, h0, c0, lengths, cell, save, algo):
    """(y, h_n, c_n, saved gates, state slots, cell slots, o * tanh(c)); the last four are what the
    backward pass reads (``save``), else scratch or empty."""
    out = _fake_forward(x, whh, bhh, whr, h0, c0, lengths, cell, save, algo)
    T, B, D, H, P = _dims(x, h0, cell)
    if B == 0:
        return out
    key = (cell, save, x.dtype, T, B, H, P, D, bhh is not None, lengths is not None)

    def problem() -> RNNProblem:
        dtype = str(x.dtype).removeprefix("torch.")
        tf32 = config.allow_tf32 and x.dtype == torch.float32
        return RNNProblem(cell, False, save, dtype, T, B, H, P, D, bhh is not None, lengths is not None, tf32)

    args = (x, whh, x if bhh is None else bhh, x if whr is None else whr, h0, x if c0 is None else c0,
            x if lengths is None else lengths, *out)  # fmt: skip
    _plan(key, problem, algo, lambda: args)(*args)
    return out


def _fake_backward(dy, dhn, dcn, whh, whr, lengths, sv, hbuf, cbuf, ht, cell, algo):
    T, B, D, P = dy.shape
    H = whh.shape[1] // GATES[cell]

    def empty(shape):
        return torch.empty(shape, dtype=dy.dtype, device=dy.device)

    return (
        empty((T, B, D, GATES[cell] * H)),
        empty((T, B, D, H) if cell == "gru" else (0,)),
        empty((T, B, D, P) if P != H else (0,)),
        empty((D, B, P)),
        empty((D, B, H) if cell == "lstm" else (0,)),
    )


@custom_op(
    "rnn_backward",
    "(Tensor dy, Tensor dhn, Tensor? dcn, Tensor whh, Tensor? whr, Tensor? lengths, Tensor sv, Tensor hbuf, "
    "Tensor cbuf, Tensor ht, str cell, str? algo) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    _fake_backward,
)
def _backward(dy, dhn, dcn, whh, whr, lengths, sv, hbuf, cbuf, ht, cell, algo):
    """(gate gradients, GRU hidden-side n gradients, projected state gradients, dh0, dc0)."""
    out = _fake_backward(dy, dhn, dcn, whh, whr, lengths, sv, hbuf, cbuf, ht, cell, algo)
    T, B, D, P = dy.shape
    H = whh.shape[1] // GATES[cell]
    if B == 0:
        return out
    key = (cell, dy.dtype, T, B, H, P, D, lengths is not None)

    def problem() -> RNNProblem:
        dtype = str(dy.dtype).removeprefix("torch.")
        tf32 = config.allow_tf32 and dy.dtype == torch.float32
        return RNNProblem(cell, True, True, dtype, T, B, H, P, D, False, lengths is not None, tf32)

    args = (dy, dhn, dy if dcn is None else dcn, whh, dy if whr is None else whr,
            dy if lengths is None else lengths, sv, hbuf, cbuf, ht, *out)  # fmt: skip
    _plan(key, problem, algo, lambda: args)(*args)
    return out


# The longest reduction ``_product`` takes as three TF32 products in fp32 (see there).
_TF32X3_MAX_K = 16384


def _product(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b`` (plus ``bias`` per column) through the matmul op. fp32 without TF32 as three TF32
    products (the precision the recurrence runs in: ``engines.dot_constexprs``; the persistent
    kernel on TF32 planes) up to K = 16384, the FMA units' "ieee" product over longer reductions.
    H200, the benchmark's GEMMs, us, ieee against tf32x3 (``scratch/x3_op.py``, the planes' pass
    included; cuBLAS without TF32 660-720): input projections and input gradients (K 256-4096)
    745-810 against 376-470; weight gradients over all steps 714 against 395 at K = 4096, 782 /
    530 at K = 16384 (the planes pass there 133 us: the operands are large beside the product),
    792 / 1429 at K = 65536 (a 1024 x 256 output: too few tiles for the SMs, and no split over K
    for the planes)."""
    kind = 0 if bias is None else 1
    x3 = a.shape[-1] <= _TF32X3_MAX_K
    return _matmul(a, b, None, bias, None, None, None, 1.0, 0.0, kind, -1, 0.0, 0.0, False, False, a.dtype,
                   False, x3)[0]  # fmt: skip


class _InputProjection(torch.autograd.Function):
    """``x @ w^T + b``: every step's and direction's gate inputs, (T * B, I) x (D * G, I)^T; the
    gradients as GEMMs over all steps (no double backward, as the recurrence)."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        return _product(x, w.t(), b)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        need = ctx.needs_input_grad
        dx = _product(grad, w) if need[0] else None
        dw = _product(grad.t(), x) if need[1] else None
        db = grad.sum(0, dtype=_acc(grad.dtype)).to(grad.dtype) if ctx.has_bias and need[2] else None
        return dx, dw, db


def _hidden_weight_grads(da, dah, hbuf, cell):
    """(dW_hh, db_hh): the gate gradients of every step against the state each step read, one
    batched GEMM over directions with all T * B rows as the reduction."""
    T, B, D, G = da.shape
    P = hbuf.shape[-1]
    H = G // GATES[cell]
    # Direction d's states before times 0 .. T - 1 are its slots d .. d + T - 1: one strided view.
    hprev = hbuf.as_strided((D, T * B, P), ((T + 2) * B * P, P, 1))
    a = da.view(T * B, D, G)
    parts = [a[:, :, : 2 * H], dah.view(T * B, D, H)] if cell == "gru" else [a]
    dw = torch.cat([_product(q.permute(1, 2, 0), hprev) for q in parts], dim=1)
    db = torch.cat([q.sum(0, dtype=_acc(da.dtype)) for q in parts], dim=1).to(da.dtype)
    return dw, db


class _RecurrenceFunction(torch.autograd.Function):
    """One layer's recurrence: forward saving the gates and states, backward through time."""

    @staticmethod
    def forward(ctx, x, whh, bhh, whr, h0, c0, lengths, cell, algo):
        y, hn, cn, sv, hbuf, cbuf, ht = _forward(x, whh, bhh, whr, h0, c0, lengths, cell, True, algo)
        ctx.save_for_backward(whh, whr, lengths, sv, hbuf, cbuf, ht)
        ctx.meta = (cell, algo, bhh is not None)
        if cell != "lstm":
            ctx.mark_non_differentiable(cn)
        return y, hn, cn

    @staticmethod
    @once_differentiable
    def backward(ctx, dy, dhn, dcn):
        whh, whr, lengths, sv, hbuf, cbuf, ht = ctx.saved_tensors
        cell, algo, has_bias = ctx.meta
        lstm = cell == "lstm"
        da, dah, dhs, dh0, dc0 = _backward(
            dy.contiguous(), dhn.contiguous(), dcn.contiguous() if lstm else None, whh, whr, lengths, sv,
            hbuf, cbuf, ht, cell, algo,
        )  # fmt: skip
        need = ctx.needs_input_grad
        dwhh = dbhh = dwhr = None
        if need[1] or (need[2] and has_bias):
            dwhh, dbhh = _hidden_weight_grads(da, dah, hbuf, cell)
        if whr is not None and need[3]:
            T, B, D, P = dhs.shape
            dwhr = _product(dhs.view(T * B, D, P).permute(1, 2, 0), ht.view(T * B, D, -1).permute(1, 0, 2))
        return (
            da,
            dwhh if need[1] else None,
            dbhh if need[2] else None,
            dwhr,
            dh0 if need[4] else None,
            dc0 if lstm and need[5] else None,
            None,
            None,
            None,
        )


def _recurrence(x, whh, bhh, whr, h0, c0, lengths, cell, algo):
    tensors = (x, whh, bhh, whr, h0, c0)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return _RecurrenceFunction.apply(x, whh, bhh, whr, h0, c0, lengths, cell, algo)
    y, hn, cn, *_ = _forward(x, whh, bhh, whr, h0, c0, lengths, cell, False, algo)
    return y, hn, cn


# ---------------------------------------------------------------------------------------------
# Validation (messages and error types follow torch.nn's where it has them).

_NAMES = {"lstm": "LSTM", "gru": "GRU", "rnn_tanh": "RNN", "rnn_relu": "RNN"}


def _check_flag(op: str, name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{op}: {name} should be of type bool, got: {type(value).__name__}")
    return value


def _check_options(
    op, cell, weights, bias, num_layers, dropout, training, bidirectional, batch_first, proj_size
):
    for name, flag in (("bias", bias), ("training", training), ("bidirectional", bidirectional),
                       ("batch_first", batch_first)):  # fmt: skip
        _check_flag(op, name, flag)
    if isinstance(num_layers, bool) or not isinstance(num_layers, int):
        raise TypeError(f"{op}: num_layers should be of type int, got: {type(num_layers).__name__}")
    if num_layers <= 0:
        raise ValueError(f"{op}: num_layers must be greater than zero")
    if not isinstance(dropout, numbers.Number) or isinstance(dropout, bool) or not 0 <= dropout <= 1:
        raise ValueError(
            f"{op}: dropout should be a number in range [0, 1] representing the probability of an element "
            "being zeroed"
        )
    if isinstance(proj_size, bool) or not isinstance(proj_size, int):
        raise TypeError(f"{op}: proj_size should be of type int, got: {type(proj_size).__name__}")
    if proj_size < 0:
        raise ValueError(f"{op}: proj_size should be a positive integer or zero to disable projections")
    if not isinstance(weights, (list, tuple)) or not all(isinstance(w, torch.Tensor) for w in weights):
        raise TypeError(
            f"{op}: argument 'weights' must be a list or tuple of tensors (torch's _flat_weights)"
        )
    directions = 2 if bidirectional else 1
    expected = num_layers * directions * weights_per_layer(bias, proj_size)
    if len(weights) != expected:
        raise ValueError(
            f"{op}: expected {expected} weight tensors ({num_layers} layer(s) x {directions} direction(s) x "
            f"{weights_per_layer(bias, proj_size)}: w_ih, w_hh{', b_ih, b_hh' if bias else ''}"
            f"{', w_hr' if proj_size else ''}), got {len(weights)}"
        )
    hidden = weights[1].shape[0] // GATES[cell] if weights[1].ndim == 2 else 0
    if proj_size >= hidden > 0:
        raise ValueError(f"{op}: proj_size has to be smaller than hidden_size")
    return directions, hidden


def _check_weights(op, cell, weights, input, bias, num_layers, directions, hidden, proj_size):
    """Each weight's dtype, device and shape, as the layer and direction it belongs to needs."""
    state = proj_size or hidden
    gates = GATES[cell] * hidden
    for layer in range(num_layers):
        for d in range(directions):
            w_ih, w_hh, b_ih, b_hh, w_hr = split_weights(weights, layer, d, directions, bias, proj_size)
            suffix = f"_l{layer}{'_reverse' if d else ''}"
            inputs = input.shape[-1] if layer == 0 else directions * state
            named = [
                ("weight_ih" + suffix, w_ih, (gates, inputs)),
                ("weight_hh" + suffix, w_hh, (gates, state)),
            ]
            if bias:
                named += [("bias_ih" + suffix, b_ih, (gates,)), ("bias_hh" + suffix, b_hh, (gates,))]
            if proj_size:
                named.append(("weight_hr" + suffix, w_hr, (state, hidden)))
            for name, w, shape in named:
                if w.dtype != input.dtype:
                    raise ValueError(
                        f"{op}: RNN input dtype ({input.dtype}) does not match weight dtype ({w.dtype}). "
                        f"Convert input: input.to({w.dtype}), or convert model: model.to({input.dtype})"
                    )
                if w.device != input.device:
                    raise ValueError(
                        f"{op}: weight '{name}' is on {w.device} but 'input' is on {input.device}"
                    )
                if layer == 0 and name.startswith("weight_ih") and w.shape[-1] != input.shape[-1]:
                    raise RuntimeError(
                        f"{op}: input.size(-1) must be equal to input_size. Expected {w.shape[-1]}, got "
                        f"{input.shape[-1]}"
                    )
                if tuple(w.shape) != shape:
                    raise ValueError(f"{op}: weight '{name}' has shape {tuple(w.shape)}; expected {shape}")


def _check_hidden(op, name, hx, shape, input, message):
    check_tensor(op, name, hx)
    if tuple(hx.shape) != shape:
        raise RuntimeError(f"{op}: " + message.format(shape, list(hx.shape)))
    if hx.dtype != input.dtype or hx.device != input.device:
        raise TypeError(
            f"{op}: argument '{name}' has dtype {hx.dtype} on {hx.device}; it must match the input's "
            f"{input.dtype} on {input.device}"
        )
    return hx


def _check_lengths(op: str, lengths: object, steps: int, batch: int, enforce_sorted: bool) -> torch.Tensor:
    """``lengths`` as a CPU int64 tensor, checked as ``pack_padded_sequence`` does (and <= T)."""
    if isinstance(lengths, torch.Tensor):
        lens = lengths.detach().to("cpu", torch.int64)
    else:
        lens = torch.as_tensor(lengths, dtype=torch.int64)
    lens = lens.reshape(-1) if lens.ndim == 0 else lens
    if lens.ndim != 1 or lens.numel() != batch:
        raise RuntimeError(f"{op}: Expected `len(lengths)` to be equal to batch_size, but got {lens.numel()} "
                           f"(batch_size={batch})")  # fmt: skip
    if enforce_sorted and bool((lens[1:] > lens[:-1]).any()):
        raise RuntimeError(
            f"{op}: `lengths` array must be sorted in decreasing order when `enforce_sorted` is True. You "
            "can pass `enforce_sorted=False` to pack_padded_sequence and/or pack_sequence to sidestep this "
            "requirement if you do not need ONNX exportability."
        )
    if bool((lens <= 0).any()):
        raise RuntimeError(
            f"{op}: Length of all samples has to be greater than 0, but found an element in 'lengths' that "
            "is <= 0"
        )
    if int(lens.max()) > steps:
        raise ValueError(
            f"{op}: Expected total_length to be at least the length of the longest sequence in input, but "
            f"got total_length={steps} and max sequence length being {int(lens.max())}"
        )
    return lens


def _unpack(data: torch.Tensor, batch_sizes: torch.Tensor):
    """(padded (T, B, I), packed row -> padded row index, lengths) of a PackedSequence's data."""
    sizes = batch_sizes.to("cpu", torch.int64)
    steps, batch = sizes.numel(), int(sizes[0])
    mask = torch.arange(batch)[None, :] < sizes[:, None]
    index = mask.flatten().nonzero().squeeze(1).to(data.device)
    padded = data.new_zeros((steps * batch, data.shape[-1])).index_copy(0, index, data)
    return padded.view(steps, batch, -1), index, mask.sum(0)


# ---------------------------------------------------------------------------------------------
# The network: layers, directions, dropout, packing.


def _run(op, cell, input, hx, weights, *args):
    """The network with autocast off inside. Autocast still on here means the public function's
    policy left this device type alone (CPU GRU and RNN, which torch runs in fp32): left on, it
    could cast the input projection but not the recurrent weights, and the kernels
    would get mixed dtypes (and a launcher cached for them)."""
    data = input.data if isinstance(input, PackedSequence) else input
    device_type = data.device.type if isinstance(data, torch.Tensor) else None
    if device_type not in ("cuda", "cpu") or not torch.is_autocast_enabled(device_type):
        return _network(op, cell, input, hx, weights, *args)
    with torch.autocast(device_type, enabled=False):
        return _network(op, cell, input, hx, weights, *args)


def _network(op, cell, input, hx, weights, bias, num_layers, dropout, training, bidirectional, batch_first,
             proj_size, lengths, enforce_sorted, seed, algo):  # fmt: skip
    name = _NAMES[cell]
    if cell != "lstm" and proj_size:
        raise ValueError(f"{op}: proj_size argument is only supported for LSTM, not RNN or GRU")
    directions, hidden = _check_options(
        op, cell, weights, bias, num_layers, dropout, training, bidirectional, batch_first, proj_size
    )
    if algo is not None and not isinstance(algo, str):
        raise TypeError(f"{op}: argument 'algo' must be a str or None, got {type(algo).__name__}")
    packed = isinstance(input, PackedSequence)
    if packed:
        data, batch_sizes, sorted_indices, unsorted_indices = input
        check_tensor(op, "input", data)
        if data.ndim != 2:
            raise RuntimeError(f"{op}: input must have 2 dimensions, got {data.ndim}")
        if lengths is not None:
            raise ValueError(f"{op}: argument 'lengths' is for padded input; a PackedSequence has its own")
        batched = True
    else:
        check_tensor(op, "input", input)
        if input.ndim not in (2, 3):
            tail = " tensor instead" if name == "RNN" else " instead"
            raise ValueError(f"{name}: Expected input to be 2D or 3D, got {input.ndim}D{tail}")
        batched = input.ndim == 3
        data = input
    _check_weights(op, cell, weights, data, bias, num_layers, directions, hidden, proj_size)
    if packed:
        x, index, lens = _unpack(data, batch_sizes)
    else:
        x = input if batched else input.unsqueeze(1)
        x = x.transpose(0, 1) if batch_first and batched else x
    steps, batch = x.shape[:2]
    if steps == 0:
        raise RuntimeError(f"{op}: Expected sequence length to be larger than 0 in RNN")
    if not packed and lengths is not None:
        lens = _check_lengths(op, lengths, steps, batch, enforce_sorted)
    elif not packed:
        lens = None
    state = proj_size or hidden
    layers = num_layers * directions
    h_shape, c_shape = (layers, batch, state), (layers, batch, hidden)
    h0 = c0 = None
    lstm = cell == "lstm"
    if hx is not None:
        if lstm:
            if not isinstance(hx, (tuple, list)) or len(hx) != 2:
                raise TypeError(f"{op}: argument 'hx' must be None or a tuple (h0, c0) of tensors")
            h0, c0 = hx
            check_tensor(op, "hx[0]", h0)
            check_tensor(op, "hx[1]", c0)
            dims = 3 if batched else 2
            if h0.ndim != dims or c0.ndim != dims:
                kind = "batched 3-D" if batched else "unbatched 2-D"
                raise RuntimeError(f"{op}: For {kind} input, hx and cx should also be {dims}-D but got "
                                   f"({h0.ndim}-D, {c0.ndim}-D) tensors")  # fmt: skip
        else:
            h0 = check_tensor(op, "hx", hx)
            if h0.ndim != (3 if batched else 2):
                kind, dims = ("batched 3-D", 3) if batched else ("unbatched 2-D", 2)
                raise RuntimeError(
                    f"{op}: For {kind} input, hx should also be {dims}-D but got {h0.ndim}-D tensor"
                )
        if not batched:
            h0, c0 = h0.unsqueeze(1), (c0.unsqueeze(1) if lstm else None)
        if packed and sorted_indices is not None:
            h0 = h0.index_select(1, sorted_indices)
            c0 = c0.index_select(1, sorted_indices) if lstm else None
        message = "Expected hidden[0] size {}, got {}" if lstm else "Expected hidden size {}, got {}"
        h0 = _check_hidden(op, "hx[0]" if lstm else "hx", h0, h_shape, data, message)
        if lstm:
            c0 = _check_hidden(op, "hx[1]", c0, c_shape, data, "Expected hidden[1] size {}, got {}")
    if h0 is None:
        h0 = x.new_zeros(h_shape)
        c0 = x.new_zeros(c_shape) if lstm else None
    if batch == 0:
        out = x.new_zeros((steps, 0, directions * state))
        hn, cn = h0.detach().clone(), (c0.detach().clone() if lstm else None)
    else:
        out, hn, cn = _layers(cell, x, h0, c0, weights, bias, num_layers, dropout, training, directions,
                              proj_size, lens, seed, algo)  # fmt: skip
    if packed:
        data = out.reshape(-1, out.shape[-1]).index_select(0, index)
        out = PackedSequence(data, batch_sizes, sorted_indices, unsorted_indices)
        if unsorted_indices is not None:
            hn = hn.index_select(1, unsorted_indices)
            cn = cn.index_select(1, unsorted_indices) if lstm else None
    elif not batched:
        out, hn, cn = out.squeeze(1), hn.squeeze(1), (cn.squeeze(1) if lstm else None)
    elif batch_first:
        out = out.transpose(0, 1).contiguous()
    return out, (hn, cn) if lstm else hn


def _layers(cell, x, h0, c0, weights, bias, num_layers, dropout, training, directions, proj_size, lens, seed,
            algo):  # fmt: skip
    steps, batch = x.shape[:2]
    lengths = None if lens is None else lens.to(device=x.device, dtype=torch.int32)
    drop = training and dropout > 0 and num_layers > 1
    if drop and seed is None:
        seed = int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64))
    layer_in, hs, cs = x, [], []
    for layer in range(num_layers):
        if layer > 0 and drop:
            offset = (layer - 1) * counters_used(layer_in.numel())
            layer_in = _dropout(layer_in, float(dropout), True, seed=seed, offset=offset)
        parts = [split_weights(weights, layer, d, directions, bias, proj_size) for d in range(directions)]

        def stacked(i: int, parts=parts) -> torch.Tensor:
            return (
                parts[0][i].unsqueeze(0).contiguous()
                if directions == 1
                else torch.stack([q[i] for q in parts])
            )

        w_ih = parts[0][0] if directions == 1 else torch.cat([q[0] for q in parts])
        b_ih = None if not bias else parts[0][2] if directions == 1 else torch.cat([q[2] for q in parts])
        xp = _InputProjection.apply(layer_in.reshape(steps * batch, -1), w_ih, b_ih)
        xp = xp.view(steps, batch, directions, -1)
        rows = slice(layer * directions, (layer + 1) * directions)
        y, hn, cn = _recurrence(
            xp, stacked(1), stacked(3) if bias else None, stacked(4) if proj_size else None,
            h0[rows].contiguous(), c0[rows].contiguous() if c0 is not None else None, lengths, cell, algo,
        )  # fmt: skip
        layer_in = y.view(steps, batch, -1)
        hs.append(hn)
        cs.append(cn)
    return layer_in, torch.cat(hs), torch.cat(cs) if cell == "lstm" else None


# ---------------------------------------------------------------------------------------------
# Public functions.

_COMMON_DOC = """
    Args:
        input: (T, B, I) (``batch_first``: (B, T, I)), unbatched (T, I), or a ``PackedSequence``;
            fp16, bf16, fp32 or fp64.
        hx: initial state{hx}, or None for zeros. h0 is (num_layers * D, B, P) with D = 2 when
            bidirectional, layer-major as torch's; unbatched without the B dimension; with a
            PackedSequence in the original (unsorted) batch order.
        weights: torch's ``_flat_weights`` of the matching module, per layer and direction (the
            reverse one second): w_ih (G, I_l), w_hh (G, P), then b_ih (G,), b_hh (G,) when
            ``bias``{w_hr}; G = {gates} * hidden_size, P = {state}, I_l the input size of layer l
            (D * P above the first). Same dtype and device as the input.
        bias, num_layers, dropout, bidirectional, batch_first: as the torch.nn module's.
        training: apply ``dropout`` to the inputs of layers 2 and up (the module's ``training``).
        lengths: padded input only: the steps each sequence runs (B ints, a list or a tensor);
            sequence b's state stops after ``lengths[b]`` steps, the reverse direction starts at
            its last step, and the output past its length is zero (as ``pad_packed_sequence``).
        enforce_sorted: as ``pack_padded_sequence``: require ``lengths`` in decreasing order.
        seed: Philox seed of the dropout masks (``ops.dropout``; layer l's mask has offset
            ``(l - 1) * counters_used(T * B * D * P)``); None draws one from torch's generator.
        algo: force an engine ("persistent", "persistent-tiled", "per-step"); None lets the
            heuristics (or ``tdnn.config.benchmark``) choose.

    Returns ``(output, {returns})``: output (T, B, D * P) (batch-first, unbatched or packed as
    the input), the final states (num_layers * D, B, ...).

    Numerics: products accumulate in fp32 (fp64 for fp64); 16-bit states are rounded to the
    input dtype between steps, as PyTorch keeps them{cell_note}. Gradients flow to the input, the
    initial states and every weight (not twice: no double backward).

    Raises ValueError for a wrong input rank, weight count, shape or dtype, dropout outside
    [0, 1], lengths longer than the input; RuntimeError (PyTorch's messages) for an input size
    that does not match the weights, initial states of the wrong shape, unsorted lengths with
    ``enforce_sorted``, non-positive lengths; NotSupportedError when ``algo`` cannot run the
    problem.
"""


# PyTorch's CPU autocast casts lstm's padded-input overload only (a packed input stays fp32).
@autocast_policy(FP16, lambda input: None if isinstance(input, PackedSequence) else LOWER)
def lstm(
    input: torch.Tensor | PackedSequence,
    hx: tuple[torch.Tensor, torch.Tensor] | None,
    weights: Sequence[torch.Tensor],
    bias: bool = True,
    num_layers: int = 1,
    dropout: float = 0.0,
    training: bool = False,
    bidirectional: bool = False,
    batch_first: bool = False,
    *,
    proj_size: int = 0,
    lengths: torch.Tensor | Sequence[int] | None = None,
    enforce_sorted: bool = True,
    seed: int | None = None,
    algo: str | None = None,
) -> tuple[torch.Tensor | PackedSequence, tuple[torch.Tensor, torch.Tensor]]:
    """A multi-layer LSTM: ``torch.nn.LSTM``'s forward as a function of its parameters, in the
    argument order of ``torch.lstm`` (``input, hx, params, has_biases, num_layers, dropout, train,
    bidirectional, batch_first``), plus ``proj_size``: with it, each step's output o * tanh(c) is
    multiplied by w_hr (proj_size, hidden_size), and h has proj_size columns.
    """
    return _run("tdnn.lstm", "lstm", input, hx, weights, bias, num_layers, dropout, training, bidirectional,
                batch_first, proj_size, lengths, enforce_sorted, seed, algo)  # fmt: skip


@autocast_policy(FP16)
def gru(
    input: torch.Tensor | PackedSequence,
    hx: torch.Tensor | None,
    weights: Sequence[torch.Tensor],
    bias: bool = True,
    num_layers: int = 1,
    dropout: float = 0.0,
    training: bool = False,
    bidirectional: bool = False,
    batch_first: bool = False,
    *,
    lengths: torch.Tensor | Sequence[int] | None = None,
    enforce_sorted: bool = True,
    seed: int | None = None,
    algo: str | None = None,
) -> tuple[torch.Tensor | PackedSequence, torch.Tensor]:
    """A multi-layer GRU: ``torch.nn.GRU``'s forward as a function of its parameters (gates r, z, n
    in torch's order; ``n = tanh(x W_in^T + b_in + r * (h W_hn^T + b_hn))``)."""
    return _run("tdnn.gru", "gru", input, hx, weights, bias, num_layers, dropout, training, bidirectional,
                batch_first, 0, lengths, enforce_sorted, seed, algo)  # fmt: skip


@autocast_policy(FP16)
def rnn(
    input: torch.Tensor | PackedSequence,
    hx: torch.Tensor | None,
    weights: Sequence[torch.Tensor],
    bias: bool = True,
    num_layers: int = 1,
    dropout: float = 0.0,
    training: bool = False,
    bidirectional: bool = False,
    batch_first: bool = False,
    *,
    nonlinearity: str = "tanh",
    lengths: torch.Tensor | Sequence[int] | None = None,
    enforce_sorted: bool = True,
    seed: int | None = None,
    algo: str | None = None,
) -> tuple[torch.Tensor | PackedSequence, torch.Tensor]:
    """A multi-layer Elman RNN: ``torch.nn.RNN``'s forward as a function of its parameters,
    ``h' = nonlinearity(x W_ih^T + b_ih + h W_hh^T + b_hh)`` with ``nonlinearity`` "tanh" or "relu"."""
    if nonlinearity not in ("tanh", "relu"):
        raise ValueError(f"Unknown nonlinearity '{nonlinearity}'. Select from 'tanh' or 'relu'.")
    return _run("tdnn.rnn", f"rnn_{nonlinearity}", input, hx, weights, bias, num_layers, dropout, training,
                bidirectional, batch_first, 0, lengths, enforce_sorted, seed, algo)  # fmt: skip


lstm.__doc__ += _COMMON_DOC.format(
    hx=" (h0, c0), c0 (num_layers * D, B, hidden_size)", state="proj_size or hidden_size", gates=4,
    w_hr=", then w_hr (proj_size, hidden_size) when ``proj_size``", returns="(h_n, c_n)",
    cell_note="; the cell state c stays fp32 within the layer",
)  # fmt: skip
gru.__doc__ += _COMMON_DOC.format(
    hx=" h0", state="hidden_size", gates=3, w_hr="", returns="h_n", cell_note=""
)
rnn.__doc__ += _COMMON_DOC.format(
    hx=" h0", state="hidden_size", gates=1, w_hr="", returns="h_n", cell_note=""
)
