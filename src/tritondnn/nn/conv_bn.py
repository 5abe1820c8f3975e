"""A convolution and the batch norm after it (then a residual add and ReLU, or not) as one
autograd node: what ``patch(..., fuse=True)`` and ``Sequential`` run for Conv -> BatchNorm.

The two ops' kernels stay as they are (the eager programs both families bind per validated key);
what fusing saves is host time, which a training step of a convolutional network at PyTorch's
speed is short of: one ``autograd.Function`` node instead of two (plus autocast's weight cast
node), one module call chain, and autocast's cast of the weight done inside the node. A call
whose pieces have no eager program yet (the first of its shapes), or that the fast path does not
take (hooks, a conv bias, a padding mode, an input of another dtype than the computation's),
runs the two modules as they are; the first such call builds the programs the later ones use.
A call is validated by its print (``_call_print``: the modules' settings and the tensors' specs,
read again on each call, a few microseconds), kept on the convolution with the programs, or where
the print differs, by ``_key`` (about ten).

A model's block of such calls, one feeding the next (a ResNet bottleneck's three, four with a
projected skip), is one call of ``conv_batch_norm_chain`` (fusion.py rewrites the block's graph):
one autograd node for the block, validated by one print over its pairs and the values it reads,
the block's input gradient summed from the two paths inside its backward.

A model patched with ``fuse=True`` also opens a ``_Step`` for each of its forwards (``enter_step``
and ``exit_step``, hooks on the model), in which work that every fused call repeats is done once
for all of them: autocast's casts of the weights (one launch as the forward begins, or at its
first fused call, reading the weights through a table of addresses, for the convolutions the
model's previous forwards ran fused and the linear layers' weights the previous forward cast;
their calls take the casts through ``core.autocast.step_cast``) and the batch norms'
``num_batches_tracked += 1`` (one multi-tensor add as the forward returns). On an H200's host a
weight's ``.to()`` took 13.6 us and an ``add_(1)`` 10.2, 53 of each in a ResNet-50 step;
``torch._foreach_copy_`` from fp32 to bf16 took 0.93 ms for the 53.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from ..core.autocast import _any_autocast, step_cast, step_casts
from ..core.backend import DEVICE_TYPE
from ..core.config import config
from ..core.launcher import cdiv, launcher
from ..core.library import PLAIN_TENSORS, functorch_active, raw_apply
from ..ops.conv import eager as conv_eager
from ..ops.matmul.autograd import no_double_backward
from ..ops.norm import batch as batch_ops
from .cache import autocast_dtype, cached, store, tensor_print
from .layers import Conv2d, _bn_state, _hooked, fusable_batch_norm, on_backend


class _ConvBatchNorm(torch.autograd.Function):
    """y = bn(conv(x, cast(weight))) [+ residual, relu]; backward: batch norm's, then the
    convolution's data and weight gradients, the weight's stored in the (master) weight's dtype
    from the kernels' fp32 sums (no cast node, no cast launch)."""

    @staticmethod
    def forward(
        ctx, x, weight, bn_weight, bn_bias, running_mean, running_var, residual, momentum, programs, low, cast
    ):
        conv_program, bn_program = programs
        w = cast if cast is not None else weight if low is None else weight.to(low)
        h = conv_program[0](x, w, None)
        y, workspace = bn_program[0](h, bn_weight, bn_bias, residual, running_mean, running_var, momentum)
        ctx.save_for_backward(x, w, h, bn_weight, bn_bias, workspace, y if bn_program[2] else None)
        ctx.programs = programs
        ctx.weight_dtype = weight.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        no_double_backward("conv + batch norm")
        x, w, h, bn_weight, bn_bias, workspace, y = ctx.saved_tensors
        need_x, need_w, need_bn_w, need_bn_b = ctx.needs_input_grad[:4]
        conv_program, bn_program = ctx.programs
        dh, dbn_w, dbn_b, dr = bn_program[1](dy, h, bn_weight, bn_bias, workspace, y, need_bn_w, need_bn_b)
        dx, dw, _ = conv_program[1](dh, x, w, need_x, need_w, False, ctx.weight_dtype)
        dr = dr if ctx.needs_input_grad[6] else None
        return dx, dw, dbn_w, dbn_b, None, None, dr, None, None, None, None


_apply = raw_apply(_ConvBatchNorm)


# (conv key, batch norm's flags and parameter specs, residual spec, relu) -> (conv program,
# batch norm program), filled after a call of that key ran unfused.
_programs: dict[tuple, tuple] = {}


def _spec(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def conv_batch_norm(
    conv: torch.nn.Module, bn: torch.nn.Module, input: Any, residual: Any, relu: bool
) -> torch.Tensor:
    """``relu(bn(conv(input)) + residual)`` (without the residual where None, without the ReLU
    where ``relu`` is False), fused where the fast path takes the call."""
    return _pair(conv, bn, input, residual, relu)[0]


def _pair(conv, bn, input, residual, relu) -> tuple[torch.Tensor, tuple | None]:
    """``conv_batch_norm``'s output, and the (programs, cast dtype) it ran fused with, or None
    where it ran the two modules."""
    call = _call_print(conv, bn, input, residual, relu)
    entry = cached(conv, _PAIR) if call is not None else None
    if entry is not None and entry[0] == call:
        y = _run_pair(conv, bn, input, residual, entry[1], entry[2], conv._parameters["weight"])
        return y, entry[1:]
    key = _key(conv, bn, input, residual, relu)
    programs = _programs.get(key) if key is not None else None
    if programs is None:
        h = conv(input)
        y = bn.forward_relu(h, residual) if relu else bn(h)
        if key is not None:
            _remember(key, bn, h, residual, relu)
        return y, None
    if call is not None and call[0][3] is not None:  # the weight was read from its dict
        store(conv, _PAIR, (call, programs, key[1]))
    return _run_pair(conv, bn, input, residual, programs, key[1], conv.weight), (programs, key[1])


def _run_pair(conv, bn, input, residual, programs, low, weight) -> torch.Tensor:
    """A validated call (``_key`` took it, or its print matched one that ``_key`` took)."""
    step = _local.step
    # Counts the batch (or leaves it to the step), computes the momentum factor.
    rm, rv, bn_weight, bn_bias, _, momentum = bn._counted_statistics(None if step is None else step.counts)
    cast = None if low is None or step is None else step.cast_weight(conv, weight, low)
    grad = torch.is_grad_enabled() and (
        input.requires_grad
        or weight.requires_grad
        or (bn_weight is not None and bn_weight.requires_grad)
        or (bn_bias is not None and bn_bias.requires_grad)
        or (residual is not None and residual.requires_grad)
    )
    if grad:
        return _apply(
            input, weight, bn_weight, bn_bias, rm, rv, residual, float(momentum), programs, low, cast
        )
    w = cast if cast is not None else weight if low is None else weight.to(low)
    h = programs[0][0](input, w, None)
    return programs[1][0](h, bn_weight, bn_bias, residual, rm, rv, float(momentum))[0]


# ---------------------------------------------------------------------------------------------
# Prints: what a validated call's programs depend on, read again on each call in a few
# microseconds where ``_key`` takes about ten (it validates the geometry arguments and builds
# both families' keys). A print equal to one whose call ``_key`` took, with programs, is a call
# ``_key`` would take with the same programs: every value ``_key`` reads is in it or read again.

_PAIR = "_tdnn_conv_bn"  # a convolution's last fused call: (print, programs, low)
_CHAIN = "_tdnn_conv_bn_chain"  # on a chain's first convolution: (print, programs, lows)


def _layer_print(conv: torch.nn.Module, bn: torch.nn.Module, relu: bool) -> tuple | None:
    """The pair's part of a print (its modules' classes, settings and tensors' specs), or None
    where hooks would see the modules' calls."""
    if _hooked(conv) or _hooked(bn):
        return None
    rm, rv, weight, bias, batches = _bn_state(bn)
    params = conv._parameters
    return (
        type(conv), type(bn), relu, tensor_print(params.get("weight")), params.get("bias") is None,
        conv.stride, conv.padding, conv.dilation, conv.groups, conv.padding_mode,
        bn.training, bn.track_running_stats, bn.eps, batches is None,
        tensor_print(rm), tensor_print(rv), tensor_print(weight), tensor_print(bias),
    )  # fmt: skip


def _call_print(conv, bn, input, residual, relu) -> tuple | None:
    """A call's print, or None where none is kept (tracing, a functorch transform, a tensor
    subclass, hooks): such calls go through ``_key`` every time."""
    if torch.compiler.is_compiling() or functorch_active():
        return None
    if type(input) not in PLAIN_TENSORS or (residual is not None and type(residual) is not torch.Tensor):
        return None
    layer = _layer_print(conv, bn, relu)
    if layer is None:
        return None
    return layer, autocast_dtype(), config.version, tensor_print(input), tensor_print(residual)


# ---------------------------------------------------------------------------------------------
# Chains: a block's fused calls as one autograd node.


class _ChainRun:
    """One call of a chain: its layout, each pair's programs, cast dtype (or None), step cast
    (or None) and momentum factor, and how many values come from outside."""

    __slots__ = ("casts", "externals", "layout", "lows", "momenta", "programs")

    def __init__(self, layout, programs, lows, casts, momenta, externals) -> None:
        self.layout, self.programs, self.lows = layout, programs, lows
        self.casts, self.momenta, self.externals = casts, momenta, externals


def _chain_forward(run: _ChainRun, tensors: tuple, saved: list | None) -> torch.Tensor:
    """The chain's pairs one after another on ``tensors`` (the external values, then each pair's
    weight, batch norm weight and bias, running mean and variance); what the backward needs is
    appended to ``saved`` (seven per pair) where given, and intermediate values are dropped
    after their last reader where not."""
    count = run.externals
    values: list[Any] = list(tensors[:count])
    last = len(run.layout) - 1
    for j, (source, residual, _) in enumerate(run.layout):
        weight, bn_weight, bn_bias, rm, rv = tensors[count + 5 * j : count + 5 * j + 5]
        (conv_program, bn_program), low, cast = run.programs[j], run.lows[j], run.casts[j]
        w = cast if cast is not None else weight if low is None else weight.to(low)
        x = values[source]
        r = None if residual < 0 else values[residual]
        h = conv_program[0](x, w, None)
        y, workspace = bn_program[0](h, bn_weight, bn_bias, r, rm, rv, run.momenta[j])
        if saved is not None:
            saved += (x, w, h, bn_weight, bn_bias, workspace, y if bn_program[2] else None)
        elif j < last:
            for slot in (source, residual):  # no later pair reads an intermediate value again
                if slot >= count and all(slot not in later[:2] for later in run.layout[j + 1 :]):
                    values[slot] = None
        values.append(y)
    return values[-1]


class _ConvBatchNormChain(torch.autograd.Function):
    """A chain of ``_ConvBatchNorm``'s calls (a ResNet block's three or four) as one node:
    the pairs' forwards in order, their backwards in reverse, the gradients of values read twice
    (a block's input, by its first convolution and its skip) summed."""

    @staticmethod
    def forward(ctx, run, *tensors):
        saved: list = []
        y = _chain_forward(run, tensors, saved)
        ctx.save_for_backward(*saved)
        ctx.run = run
        ctx.weight_dtypes = [tensors[run.externals + 5 * j].dtype for j in range(len(run.layout))]
        return y

    @staticmethod
    def backward(ctx, dy):
        no_double_backward("conv + batch norm")
        run, saved, needs = ctx.run, ctx.saved_tensors, ctx.needs_input_grad[1:]
        count, pairs = run.externals, len(run.layout)
        # Whether each value (external, then each pair's output) needs a gradient.
        wanted = list(needs[:count])
        for j, (source, residual, _) in enumerate(run.layout):
            wanted.append(
                wanted[source]
                or (residual >= 0 and wanted[residual])
                or any(needs[count + 5 * j : count + 5 * j + 3])
            )
        grads: list[Any] = [None] * (count + pairs)
        grads[-1] = dy
        out: list[Any] = [None] * len(needs)
        for j in reversed(range(pairs)):
            dy_j = grads[count + j]
            if dy_j is None:
                continue
            source, residual, _ = run.layout[j]
            conv_program, bn_program = run.programs[j]
            x, w, h, bn_weight, bn_bias, workspace, y = saved[7 * j : 7 * j + 7]
            base = count + 5 * j
            dh, dbn_w, dbn_b, dr = bn_program[1](
                dy_j, h, bn_weight, bn_bias, workspace, y, needs[base + 1], needs[base + 2]
            )
            dx, dw, _ = conv_program[1](dh, x, w, wanted[source], needs[base], False, ctx.weight_dtypes[j])
            out[base], out[base + 1], out[base + 2] = dw, dbn_w, dbn_b
            for slot, grad in ((source, dx), (residual, dr)):
                if slot >= 0 and grad is not None and wanted[slot]:
                    grads[slot] = grad if grads[slot] is None else grads[slot] + grad
        out[:count] = grads[:count]
        return None, *out


_apply_chain = raw_apply(_ConvBatchNormChain)


def conv_batch_norm_chain(layout: tuple, *args: Any) -> torch.Tensor:
    """Fused calls ``conv_batch_norm(conv, bn, value, residual value, relu)`` one after another,
    each reading values from outside or earlier calls' outputs, as one autograd node; the last
    call's output. ``layout``: per call (its input's slot, its residual's slot or -1, relu), the
    slots being the external values in ``args`` (after a convolution and a batch norm per call),
    then the calls' outputs. What patch-time fusion makes of a block's fused calls (fusion.py)."""
    pairs = len(layout)
    modules, values = args[: 2 * pairs], args[2 * pairs :]
    key = _chain_print(layout, modules, values)
    entry = cached(modules[0], _CHAIN) if key is not None else None
    if entry is None or entry[0] != key:
        return _chain_apart(layout, modules, values, key)
    step = _local.step
    counts = None if step is None else step.counts
    grad = torch.is_grad_enabled()
    needs_grad = grad and any(v.requires_grad for v in values)
    tensors = list(values)
    momenta, casts = [], []
    for j, low in enumerate(entry[2]):
        conv, bn = modules[2 * j], modules[2 * j + 1]
        rm, rv, bn_weight, bn_bias, _, momentum = bn._counted_statistics(counts)
        weight = conv._parameters["weight"]
        casts.append(None if low is None or step is None else step.cast_weight(conv, weight, low))
        momenta.append(float(momentum))
        tensors += (weight, bn_weight, bn_bias, rm, rv)
        needs_grad = needs_grad or (
            grad
            and (
                weight.requires_grad
                or (bn_weight is not None and bn_weight.requires_grad)
                or (bn_bias is not None and bn_bias.requires_grad)
            )
        )
    run = _ChainRun(layout, entry[1], entry[2], casts, momenta, len(values))
    if needs_grad:
        return _apply_chain(run, *tensors)
    return _chain_forward(run, tuple(tensors), None)


def _chain_print(layout: tuple, modules: tuple, values: tuple) -> tuple | None:
    if torch.compiler.is_compiling() or functorch_active():
        return None
    if any(type(v) not in PLAIN_TENSORS for v in values):
        return None
    layers = []
    for j, (_, _, relu) in enumerate(layout):
        layer = _layer_print(modules[2 * j], modules[2 * j + 1], relu)
        if layer is None or layer[3] is None:
            return None
        layers.append(layer)
    return layout, autocast_dtype(), config.version, tuple(map(tensor_print, values)), tuple(layers)


def _chain_apart(layout: tuple, modules: tuple, values: tuple, key: tuple | None) -> torch.Tensor:
    """The chain's calls one by one (each fused where the pair's fast path takes it); where every
    call ran fused and the chain has a print (every weight read from its dict), the chain's
    programs are kept under it."""
    outputs = list(values)
    fused = []
    for j, (source, residual, relu) in enumerate(layout):
        x, r = outputs[source], None if residual < 0 else outputs[residual]
        y, ran = _pair(modules[2 * j], modules[2 * j + 1], x, r, relu)
        outputs.append(y)
        fused.append(ran)
    if key is not None and None not in fused:
        store(modules[0], _CHAIN, (key, tuple(f[0] for f in fused), tuple(f[1] for f in fused)))
    return outputs[-1]


def _key(conv, bn, input, residual, relu) -> tuple | None:
    """The fast path's key, or None where the call runs unfused every time (tracing included:
    torch.compile sees the two modules' ops)."""
    if torch.compiler.is_compiling():
        return None
    if type(conv) is not Conv2d or not fusable_batch_norm(bn) or not on_backend(input):
        return None
    if conv.bias is not None or conv.padding_mode != "zeros" or _hooked(conv) or _hooked(bn):
        return None
    if functorch_active() or (residual is not None and type(residual) is not torch.Tensor):
        return None
    weight = conv.weight
    low = None
    if _any_autocast() and torch.is_autocast_enabled(DEVICE_TYPE):
        low = torch.get_autocast_dtype(DEVICE_TYPE)
        if weight.dtype not in (torch.float32, low):
            return None
        low = None if weight.dtype == low else low
    if input.dtype != (low or weight.dtype):
        return None  # autocast would cast the input too: the unfused path does that
    conv_key = conv_eager.eager_key(
        2, input, weight, None, conv.stride, conv.padding, conv.dilation, conv.groups, low
    )
    if conv_key is None:
        return None
    # Which statistics and parameters the batch norm takes (its mode) and their layouts.
    params = tuple(_spec(t) for t in _bn_state(bn)[:4])
    return conv_key, low, bn.training, bn.track_running_stats, bn.eps, params, _spec(residual), relu


def _remember(key, bn, h, residual, relu) -> None:
    """After an unfused call: the two eager programs its key maps to, where both exist."""
    conv_fast = conv_eager.programs.get(key[0])
    rm, rv, weight, bias, batch_stats = bn._statistics()
    bn_key = batch_ops._eager_key(
        h, rm, rv, weight, bias, batch_stats, bn.eps, "relu" if relu else None, residual
    )
    bn_fast = batch_ops._eager.get(bn_key) if bn_key is not None else None
    conv_program = getattr(conv_fast, "program", None)
    bn_program = getattr(bn_fast, "program", None)
    if conv_program is not None and bn_program is not None:
        _programs[key] = (conv_program, bn_program)


# ---------------------------------------------------------------------------------------------
# A patched model's forward as one step.


@triton.jit
def _cast_many_kernel(table_ptr, out_ptr, count, BLOCK: tl.constexpr, COUNT: tl.constexpr):
    """out[offset_i + j] = source_i[j] (converted to out's dtype) for the ``count`` fp32 tensors
    of ``table``: int64 rows (first block, source address, offset in out, numel), a column a
    tensor. Grid: every tensor's blocks of BLOCK elements, one after another."""
    pid = tl.program_id(0)
    i = tl.arange(0, COUNT)
    firsts = tl.load(table_ptr + i, mask=i < count, other=2**62)
    which = tl.sum((firsts <= pid).to(tl.int32), 0) - 1
    first = tl.load(table_ptr + which)
    source = tl.load(table_ptr + count + which).to(tl.pointer_type(tl.float32))
    offset = tl.load(table_ptr + 2 * count + which)
    numel = tl.load(table_ptr + 3 * count + which)
    j = (pid - first) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(source + j, mask=j < numel)
    tl.store(out_ptr + offset + j, v.to(out_ptr.dtype.element_ty), mask=j < numel)


_CAST_BLOCK = 4096


class _CastPlan:
    """The weights a model's forward casts in one launch (kept on the model): those of the
    convolutions its earlier forwards ran fused under autocast and of the products (``linear``)
    its previous forward cast (``core.autocast.lowered_weight``), and the table the launch reads
    (made again when a weight joins or leaves, or a weight's tensor or storage changes)."""

    def __init__(self, owner: int | None = None) -> None:
        self.owner = owner  # id() of the model it is kept on
        self.convs: list[torch.nn.Module] = []
        self.known: set[int] = set()
        self.weights: dict[int, weakref.ref] = {}  # the products' weights, by id
        self.sources: list[torch.Tensor | None] = []
        self.signatures: tuple = ()
        self.places: dict[int, tuple] = {}
        self.table: torch.Tensor | None = None
        self.table_kept = False
        self.total = self.blocks = 0
        self.launches: dict[torch.dtype, Callable[..., None]] = {}

    def __getstate__(self) -> dict:
        return {}  # a pickled or copied model learns its own plan (launchers do not pickle)

    def __setstate__(self, state: dict) -> None:
        self.__init__()  # type: ignore[misc]

    def learn(self, conv: torch.nn.Module) -> None:
        if id(conv) not in self.known:
            self.known.add(id(conv))
            self.convs.append(conv)

    def learn_weights(self, weights: list[torch.Tensor]) -> None:
        """The products' weights the last forward cast (through the launch or on their own): the
        ones the next forward's launch casts."""
        self.weights = {id(w): weakref.ref(w) for w in weights}

    def cast_all(self, low: torch.dtype, device: torch.device | None = None) -> None:
        """Casts the plan's weights that are dense fp32 tensors on ``device`` (the first weight's
        where None), each at a 128-byte boundary of one new buffer (the convolutions' tensor
        descriptors need 16), and publishes the casts for ``core.autocast.step_cast``."""
        step_casts.table = None
        for key, ref in list(self.weights.items()):
            if ref() is None:
                del self.weights[key]
        owners = [id(conv) for conv in self.convs] + list(self.weights)
        sources = [conv._parameters.get("weight") for conv in self.convs]
        sources += [ref() for ref in self.weights.values()]
        if device is None:
            device = next((w.device for w in sources if w is not None), None)
            if device is None:
                return
        signatures = tuple(None if w is None else _signature(w) for w in sources)
        fresh = (
            len(sources) == len(self.sources)
            and all(a is b for a, b in zip(sources, self.sources))
            and signatures == self.signatures
            and self.table is not None
            and self.table.device == device
        )
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        if capturing and not (fresh and low in self.launches):
            return  # no table upload or kernel build while a graph is captured
        if not fresh:
            self._build(owners, sources, signatures, device)
        if not self.places:
            return
        if capturing and not self.table_kept:
            _CAPTURED_TABLES.append(self.table)  # the graph reads it on every replay
            self.table_kept = True
        launch = self.launches.get(low)
        if launch is None:
            count = len(self.places)
            consts = (_CAST_BLOCK, triton.next_power_of_2(count))
            launch = self.launches[low] = launcher(_cast_many_kernel, (self.blocks,), 2, (count,), consts)
        flat = torch.empty(self.total, dtype=low, device=device)
        launch(self.table, flat)
        step_casts.table = {
            id(w): (w, w._version, w.data_ptr(), w.shape, w.stride(), flat, offset)
            for w, offset in self.places.values()
        }

    def _build(self, owners: list, sources: list, signatures: tuple, device: torch.device) -> None:
        """The table over ``sources`` (``owners``: id() of the convolution, or of the weight for
        the products') and where each weight goes in the buffer."""
        rows: list[tuple[int, int, int, int]] = []
        self.places = {}
        offset = blocks = 0
        for owner, w in zip(owners, sources):
            if w is None or w.dtype != torch.float32 or w.device != device or not _dense(w):
                continue
            if w.untyped_storage().nbytes() < (w.storage_offset() + w.numel()) * w.element_size():
                continue  # storage freed for now (FSDP's unsharded parameters between forwards)
            rows.append((blocks, w.data_ptr(), offset, w.numel()))
            self.places[owner] = (w, offset)
            offset += cdiv(w.numel(), 64) * 64
            blocks += cdiv(w.numel(), _CAST_BLOCK)
        self.sources, self.signatures, self.total, self.blocks = sources, signatures, offset, blocks
        self.launches = {}
        self.table = torch.tensor(rows, dtype=torch.int64).t().contiguous().to(device) if rows else None
        self.table_kept = False


# Tables a captured CUDA graph launched the cast with: kept for as long as the process runs (a few
# hundred bytes each), since the graph may be replayed after its model's plan made a new one.
_CAPTURED_TABLES: list[torch.Tensor] = []


def _signature(t: torch.Tensor) -> tuple:
    return t.data_ptr(), t.shape, t.stride()


def _dense(t: torch.Tensor) -> bool:
    return t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last)


class _Step:
    """One forward of a patched model (see the module's docstring): the ``num_batches_tracked``
    counters its fused calls leave to it, and its weight casts."""

    __slots__ = ("cast", "counts", "depth", "owner", "plan")

    def __init__(self, owner: torch.nn.Module, plan: _CastPlan) -> None:
        self.owner = owner
        self.plan = plan
        self.counts: list[torch.Tensor] = []
        self.cast = False  # whether the plan's launch ran this step
        self.depth = 0

    def cast_weight(
        self, conv: torch.nn.Module, weight: torch.Tensor, low: torch.dtype
    ) -> torch.Tensor | None:
        """``weight`` in ``low`` from the step's cast, or None (cast it alone): a convolution the
        plan did not have (it will next time) or whose weight changed since the cast."""
        if not self.cast:
            self.cast = True
            self.plan.cast_all(low, weight.device)
        cast = step_cast(weight, low)
        if cast is None:
            self.plan.learn(conv)
        return cast

    def open(self) -> None:
        """Under autocast, casts the plan's weights now (the products read theirs through
        ``core.autocast.lowered_weight``, which notes the weights they cast)."""
        step_casts.seen = []
        step_casts.table = None
        low = autocast_dtype()
        # Without autograd nothing saves the casts: cast one by one, each freed after its product
        # (all of a large model's at once would raise the forward's peak memory).
        if low is None or not torch.is_grad_enabled() or not (self.plan.convs or self.plan.weights):
            return
        self.cast = True
        self.plan.cast_all(low)

    def finish(self) -> None:
        """Adds one to every counter left to the step (one launch; one per counter where a batch
        norm ran more than once, which the multi-tensor add must not see twice); the products'
        weights cast in this forward become the plan's."""
        seen = step_casts.seen
        step_casts.table = step_casts.seen = None
        if seen is not None and (seen or self.plan.weights):
            self.plan.learn_weights(seen)
        counts, self.counts = self.counts, []
        if not counts:
            return
        if len({id(t) for t in counts}) == len(counts):
            torch._foreach_add_(counts, 1)
        else:
            for t in counts:
                t.add_(1)


class _Local(threading.local):
    step: _Step | None = None  # the open step of this thread (DataParallel runs replicas in threads)


_local = _Local()


def enter_step(model: torch.nn.Module, *_: object) -> None:
    """Forward pre-hook opening the model's ``_Step`` (``patch(model, fuse=True)`` registers it);
    a nested patched model's forward joins the open one."""
    if torch.compiler.is_compiling():
        return  # traced calls take the unfused path (``_key``); nothing here for Dynamo to trace
    step = _local.step
    if step is not None:
        if step.owner is not model:
            step.depth += 1
            return
        # The model's own step still open: its forward ended without the closing hook (PyTorch
        # runs it on Exception, not on KeyboardInterrupt), or the model calls itself. Either
        # way the batches counted so far are added now and a new step begins.
        _local.step = None
        step.finish()
    plan = model.__dict__.get("_tdnn_cast_plan")
    if plan is None or plan.owner != id(model):  # new, or a copy's (DataParallel's replicas)
        plan = model.__dict__["_tdnn_cast_plan"] = _CastPlan(id(model))
    step = _local.step = _Step(model, plan)
    step.open()


def exit_step(model: torch.nn.Module, *_: object) -> None:
    """Forward hook closing ``enter_step``'s step (registered with ``always_call=True``: it runs
    when the forward raised, and when an earlier pre-hook raised and no step was opened)."""
    if torch.compiler.is_compiling():
        return
    step = _local.step
    if step is None:
        return
    if step.depth:
        step.depth -= 1
        return
    if step.owner is not model:
        return  # this model's enter_step did not run
    _local.step = None
    step.finish()
