"""Patch-time fusion: batch norm with the convolution before it and the ReLU after it (with a
residual add between them or not) as one call: cuDNN's conv-BN, BN-ReLU and BN-add-ReLU; and an
add into a layer or RMS norm (a pre-norm transformer's residual stream) as one call.

A model's own modules (a ResNet block, say) call their children from Python: which module's
output feeds which is only visible in ``forward``'s code. ``fuse_norms`` traces each
such module's forward with torch.fx, its children left as calls (not traced into), finds

    y = relu(bn(x))            and        y = relu(bn(x) + r)   (or r + bn(x), or bn(x) += r)

with x = conv(z) or not, and bn(conv(z)) alone, where nothing else reads the intermediate
values, and replaces the module's forward with the rewritten graph: one autograd node instead of
two to four, forward and backward, and no intermediate tensors between batch norm and ReLU
(``tdnn.batch_norm(..., activation="relu", residual=r)``; conv_bn.py for the convolution). A
block's conv + batch norm calls that feed only each other (a projected skip's Sequential of the
two among them) become one call, one autograd node for the block (``_rewrite_chains``).
``tdnn.nn.SyncBatchNorm`` takes the ReLU and the residual the same way (its finalize pass applies
them between its collectives) but not the convolution before it. ``norm(a + b)`` of a
tritondnn LayerNorm or RMSNorm becomes ``add_norm``: the norm and the sum, which nodes after the
norm may read too, from one pass (``tdnn.add_layer_norm``/``add_rms_norm``) where the operands
allow at run time, the add and the norm as written otherwise. A transformer's stack (a Sequential
of such blocks, a child of a module whose own forward is traced) is traced through: each block's
last add and the next block's first norm (or the model's final norm) meet in the model's graph
and fuse too, so no residual-stream add is left on its own, forward or backward (autograd's sum of
the two gradients of a block's input). Where the norm's output feeds an MLP alone (a tritondnn
``Sequential`` of Linear, activation, Linear), ``add_norm_mlp`` runs the add, the norm and both
products as one autograd node (``norm_mlp``) once the separate calls have been validated. While a
block has hooks (FSDP2 registers its own after patching), or the stack no longer holds the blocks
it was traced with (a block removed, replaced or wrapped), the model's forward calls the blocks
instead, each fused on its own. Only modules
whose forward is straight-line code are traced for it (no branches, loops or ``with`` blocks, no
default arguments): a trace would bake in the branches taken and drop context managers such as
``torch.no_grad()``, which transformer blocks often use; nor is a module that calls a child
inside ``torch.utils.checkpoint``, which would leave no node in the graph. The graph calls the same
child modules (their parameters, buffers, train/eval state), so ``state_dict``, the optimizer and
``train()``/``eval()`` are unaffected.

The traced graph fixes the Python control flow of the forward it recorded: a module whose traced
code differs between train and eval mode, or that cannot be traced, is left alone and reported.
Tracing also records ``a += b`` as ``a = a + b`` (an augmented assignment on a traced value), so
a forward that relies on such an add changing a tensor seen elsewhere must not be fused. Hooks
registered after patching on a fused norm after an add are called (the add and the norm then run
as written), and on a fused convolution (its pair then runs unfused); on the modules of the other
fused patterns (a batch norm, the ReLU after it, a block's skip) they are not.
"""

from __future__ import annotations

import ast
import inspect
import operator
import sys
import textwrap
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import fx, nn

from ..core.library import dynamo_rules_built
from . import norm_mlp
from .containers import Sequential
from .conv_bn import conv_batch_norm, conv_batch_norm_chain
from .layers import Conv2d, LayerNorm, ReLU, RMSNorm, _hooked, fusable_batch_norm, relu_fusable_batch_norm

# The marker on a module whose forward was replaced: unpatch deletes the instance attribute.
FUSED_FORWARD = "_tdnn_fused_forward"

_RELU_FUNCTIONS = (F.relu, torch.relu, torch.relu_, F.relu_)
_SEQUENTIAL_FORWARDS = (nn.Sequential.forward, Sequential.forward)
_ADD_FUNCTIONS = (operator.add, torch.add)


class _Checkpointed(Exception):
    """A module call made inside ``torch.utils.checkpoint``: a trace would drop the checkpoint."""


_CHECKPOINT_FILE = torch.utils.checkpoint.__file__


def _inside_checkpoint() -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename == _CHECKPOINT_FILE:
            return True
        frame = frame.f_back
    return False


class _ChildrenAsLeaves(fx.Tracer):
    """Records calls of every child module as single nodes: only the traced module's own code,
    and the code of the modules in ``through`` (ids): a sequence of blocks (``_block_sequence``)
    and its blocks, whose calls are replaced by what they run, so that the add ending one block
    and the norm starting the next meet in one graph."""

    def __init__(self, through: frozenset[int] = frozenset()) -> None:
        super().__init__()
        self.through = through

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return id(m) not in self.through

    def call_module(self, m: nn.Module, forward: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        # torch.utils.checkpoint runs its function under the trace like any other code and leaves
        # no node of its own: a rewritten forward would store what the checkpoint recomputes.
        if _inside_checkpoint():
            raise _Checkpointed(f"{type(m).__name__} is called inside torch.utils.checkpoint")
        if id(m) in self.through and isinstance(m, nn.Sequential):
            # Each block on the last one's output, as torch's Sequential runs them (tritondnn's
            # fuses neighbouring pairs, which a sequence of blocks does not have).
            (value,) = args
            for block in m:
                value = block(value)
            return value
        return super().call_module(m, forward, args, kwargs)


def batch_norm_relu(module: nn.Module, input: torch.Tensor, residual: torch.Tensor | None) -> Any:
    """``relu(module(input) + residual)`` (or without the residual) as one op: what a fused graph
    calls in place of the batch norm node and the nodes it absorbed."""
    return module.forward_relu(input, residual)


def _add_norm_operands_at_run_time(module: nn.Module, a: Any, b: Any) -> tuple[Any, Any] | None:
    """(the norm's input, its residual) where ``module``'s ``forward_add`` may take ``a + b``:
    tensors of one shape and device, the sum in the dtype of one of them (that one is the input),
    no hooks on the module (registered after patching: they must see its call); else None."""
    tensors = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    if tensors and a.shape == b.shape and a.device == b.device and not _hooked(module):
        wide = torch.promote_types(a.dtype, b.dtype)
        if a.is_floating_point() and b.is_floating_point() and wide in (a.dtype, b.dtype):
            return (a, b) if wide == a.dtype else (b, a)
    return None


def add_norm(module: nn.Module, a: Any, b: Any) -> tuple[Any, Any]:
    """``(module(a + b), a + b)`` for a tritondnn LayerNorm or RMSNorm ``module``: one pass of its
    ``forward_add`` where the operands allow (``_add_norm_operands_at_run_time``), else the add
    as written (broadcasting, promotion) and then the module."""
    operands = _add_norm_operands_at_run_time(module, a, b)
    if operands is not None:
        return module.forward_add(*operands)
    total = a + b
    return module(total), total


def add_norm_mlp(norm: nn.Module, mlp: nn.Module, a: Any, b: Any) -> tuple[Any, Any]:
    """``(mlp(norm(a + b)), a + b)``, the norm's output read by the MLP alone: one autograd node
    (``norm_mlp``) where it was kept for such a call, else ``add_norm`` and then the MLP's call,
    after which the node is kept if both ran their cached paths."""
    operands = _add_norm_operands_at_run_time(norm, a, b)
    if operands is None:
        total = a + b
        return mlp(norm(total)), total
    fused = norm_mlp.fused_call(norm, mlp, *operands)
    if fused is not None:
        return fused
    normalized, total = norm.forward_add(*operands)
    out = mlp(normalized)
    norm_mlp.remember(norm, mlp, *operands, normalized)
    return out, total


def _is_relu(node: fx.Node, source: fx.Node, root: nn.Module) -> bool:
    """Whether ``node`` is relu of ``source`` alone: a ReLU module without hooks, F.relu /
    torch.relu (in place or not), or ``source.relu()``."""
    if node.args[:1] != (source,):
        return False
    if node.op == "call_module":
        m = root.get_submodule(node.target)
        return type(m) in (nn.ReLU, ReLU) and len(node.args) == 1 and not node.kwargs and not _hooked(m)
    if node.op == "call_function" and node.target in _RELU_FUNCTIONS:
        return len(node.args) == 1 and set(node.kwargs) <= {"inplace"}
    return node.op == "call_method" and node.target in ("relu", "relu_") and len(node.args) == 1


def _residual_of(node: fx.Node, source: fx.Node) -> fx.Node | None:
    """The other operand where ``node`` adds ``source`` and one other node (no alpha); an in-place
    ``add_`` only with ``source`` as the one written (the residual must not change). (``a += b``
    reaches the graph as ``operator.add``: fx's proxies have no in-place operators.)"""
    if len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    other = b if a is source else a if b is source else None
    if not isinstance(other, fx.Node) or other is source:
        return None
    if node.op == "call_function" and node.target in _ADD_FUNCTIONS:
        return other
    if node.op == "call_method" and node.target in ("add", "add_") and a is source:
        return other
    return None


def _tail(node: fx.Node, root: nn.Module) -> tuple[fx.Node | None, fx.Node | None, fx.Node | None]:
    """(relu node, add node, residual) of ``relu(node)`` or ``relu(node + residual)`` where
    nothing else reads the intermediate values; Nones where neither follows."""
    if len(node.users) != 1:
        return None, None, None
    (user,) = node.users
    if _is_relu(user, node, root):
        return user, None, None
    residual = _residual_of(user, node)
    if residual is None or len(user.users) != 1:
        return None, None, None
    (last,) = user.users
    return (last, user, residual) if _is_relu(last, user, root) else (None, None, None)


def _conv_before(node: fx.Node, root: nn.Module) -> fx.Node | None:
    """The node of a Conv2d (tritondnn's, no hooks) whose output only this batch norm reads."""
    src = node.args[0]
    if not isinstance(src, fx.Node) or src.op != "call_module" or len(src.users) != 1:
        return None
    if len(src.args) != 1 or src.kwargs:
        return None
    conv = root.get_submodule(src.target)
    return src if type(conv) is Conv2d and not _hooked(conv) else None


def _rewrite(graph: fx.Graph, root: nn.Module) -> list[tuple[str, str]]:
    """Replace each fusable pattern in ``graph`` (a batch norm, the convolution before it and the
    ReLU after it with or without a residual add, at least two of them) with one call; returns
    the (batch norm's name, pattern) of each."""
    fused = []
    for node in list(graph.nodes):
        if node.op != "call_module" or len(node.args) != 1 or node.kwargs:
            continue
        bn = root.get_submodule(node.target)
        if not relu_fusable_batch_norm(bn) or _hooked(bn):
            continue
        relu, add, residual = _tail(node, root)
        # A synchronized batch norm takes the ReLU (and residual) but not the convolution.
        conv = _conv_before(node, root) if fusable_batch_norm(bn) else None
        if relu is None and conv is None:
            continue
        pattern = "+".join(
            part
            for part, present in (("conv", conv), ("batch_norm", True), ("add", add), ("relu", relu))
            if present
        )
        # The residual may be computed after the batch norm: the fused call goes where the last
        # absorbed node was, after every operand.
        last = relu or node
        with graph.inserting_before(last):
            bn_ref = graph.get_attr(node.target)
            if conv is None:
                call = graph.call_function(batch_norm_relu, (bn_ref, node.args[0], residual))
            else:
                conv_ref = graph.get_attr(conv.target)
                args = (conv_ref, bn_ref, conv.args[0], residual, relu is not None)
                call = graph.call_function(conv_batch_norm, args)
        last.replace_all_uses_with(call)
        for dead in (relu, add, node, conv):  # users before what they read
            if dead is not None:
                graph.erase_node(dead)
        fused.append((str(node.target), pattern))
    graph.lint()
    return fused


def _inline_skips(graph: fx.Graph, root: nn.Module) -> None:
    """A ResNet block's skip, a call whose output only fused conv + batch norm calls read: of an
    Identity (gone: its input read instead) or of a tritondnn Sequential of a Conv2d and a batch
    norm (and a ReLU), which its own forward would run as one ``conv_batch_norm`` call (that call
    in the graph instead, where chains find it). Hooks registered on them after patching are
    not called, as on the other modules a fused pattern absorbs."""
    for node in list(graph.nodes):
        if node.op != "call_module" or len(node.args) != 1 or node.kwargs or not node.users:
            continue
        if any(user.op != "call_function" or user.target is not conv_batch_norm for user in node.users):
            continue
        module = root.get_submodule(node.target)
        if _hooked(module):
            continue
        if type(module) is nn.Identity:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            continue
        children = list(module.children())
        if type(module) is not Sequential or len(children) not in (2, 3) or any(map(_hooked, children)):
            continue
        relu = len(children) == 3
        if type(children[0]) is not Conv2d or not fusable_batch_norm(children[1]):
            continue
        if relu and type(children[2]) is not ReLU:
            continue
        names = list(module._modules)
        with graph.inserting_before(node):
            conv, bn = (graph.get_attr(f"{node.target}.{name}") for name in names[:2])
            call = graph.call_function(conv_batch_norm, (conv, bn, node.args[0], None, relu))
        node.replace_all_uses_with(call)
        graph.erase_node(node)


def _closed(members: list[fx.Node]) -> bool:
    """Whether only later members read the members' outputs (the last's aside)."""
    inside = set(members)
    return all(set(m.users) <= inside for m in members[:-1])


def _rewrite_chains(graph: fx.Graph, root: nn.Module) -> None:
    """Replace runs of ``conv_batch_norm`` calls (nothing but module references between them)
    whose outputs only later calls of the run read, the last's aside, with one
    ``conv_batch_norm_chain`` call: a ResNet block's three or four pairs as one autograd node.
    A chain is a block's at most: the model's data-parallel wrappers see each block's gradients
    when its node's backward returns."""
    _inline_skips(graph, root)
    runs, run = [], []
    for node in graph.nodes:
        if node.op == "call_function" and node.target is conv_batch_norm:
            run.append(node)
        elif node.op != "get_attr":
            runs.append(run)
            run = []
    runs.append(run)
    for run in runs:
        start = 0
        while start < len(run) - 1:
            end = next((e for e in range(len(run), start + 1, -1) if _closed(run[start:e])), None)
            if end is None:
                start += 1
                continue
            _replace_chain(graph, run[start:end])
            start = end
    graph.lint()


def _replace_chain(graph: fx.Graph, members: list[fx.Node]) -> None:
    produced = {m: j for j, m in enumerate(members)}
    externals: list[fx.Node] = []
    for m in members:
        for value in m.args[2:4]:
            if value is not None and value not in produced and value not in externals:
                externals.append(value)

    def slot(value: Any) -> int:
        if value is None:
            return -1
        return len(externals) + produced[value] if value in produced else externals.index(value)

    layout = tuple((slot(m.args[2]), slot(m.args[3]), m.args[4]) for m in members)
    modules = [ref for m in members for ref in m.args[:2]]
    with graph.inserting_before(members[-1]):
        call = graph.call_function(conv_batch_norm_chain, (layout, *modules, *externals))
    members[-1].replace_all_uses_with(call)
    for m in reversed(members):
        graph.erase_node(m)


def _add_norm_operands(
    node: fx.Node, root: nn.Module, order: dict[fx.Node, int]
) -> tuple[fx.Node, fx.Node] | None:
    """The two operands of ``a + b`` where ``node`` calls a tritondnn LayerNorm or RMSNorm (no
    hooks) on that sum alone, an out-of-place add of two traced values with no ``alpha``, whose
    other readers all come after the norm (``order``: the nodes' positions). The fused call
    runs where the add was: a reader between the two could change the sum in place (``clamp_``,
    an in-place dropout) before the norm reads it."""
    if node.op != "call_module" or len(node.args) != 1 or node.kwargs:
        return None
    if not _is_norm_after_add(root.get_submodule(node.target)):
        return None
    (src,) = node.args
    if not isinstance(src, fx.Node) or src.kwargs or len(src.args) != 2:
        return None
    if any(order[user] < order[node] for user in src.users if user is not node):
        return None
    a, b = src.args
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
        return None
    plain_add = src.op == "call_function" and src.target in _ADD_FUNCTIONS
    return (a, b) if plain_add or (src.op == "call_method" and src.target == "add") else None


def _rewrite_add_norm(graph: fx.Graph, root: nn.Module) -> list[tuple[str, str]]:
    """Replace each ``norm(a + b)`` (the sum read after the norm too, or not) with one
    ``add_norm`` call giving both; returns the (norm's name, pattern) of each."""
    fused = []
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        operands = _add_norm_operands(node, root, order)
        if operands is None:
            continue
        src = node.args[0]
        assert isinstance(src, fx.Node)
        with graph.inserting_before(src):
            pair = graph.call_function(add_norm, (graph.get_attr(node.target), *operands))
            normalized = graph.call_function(operator.getitem, (pair, 0))
            total = graph.call_function(operator.getitem, (pair, 1))
        node.replace_all_uses_with(normalized)
        graph.erase_node(node)
        src.replace_all_uses_with(total)
        graph.erase_node(src)
        kind = "rms_norm" if isinstance(root.get_submodule(node.target), RMSNorm) else "layer_norm"
        fused.append((str(node.target), f"add+{kind}"))
    graph.lint()
    return fused


def _rewrite_norm_mlp(graph: fx.Graph, root: nn.Module) -> list[tuple[str, str]]:
    """Replace each ``add_norm`` of a LayerNorm whose normalized output only an MLP reads (a
    tritondnn Sequential of Linear, activation, Linear and an optional activation, ``mlp_parts``)
    with one ``add_norm_mlp`` call where the add_norm was (the MLP reads nothing else); returns
    the (MLP's name, pattern) of each."""
    fused = []
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not add_norm:
            continue
        items = {user.args[1]: user for user in node.users if user.target is operator.getitem}
        normalized = items.get(0)
        if normalized is None or len(normalized.users) != 1 or len(items) != len(node.users):
            continue
        (mlp,) = normalized.users
        if mlp.op != "call_module" or mlp.args != (normalized,) or mlp.kwargs:
            continue
        if norm_mlp.mlp_parts(root.get_submodule(mlp.target)) is None:
            continue
        norm, a, b = node.args
        if type(root.get_submodule(norm.target)) is not LayerNorm:
            continue  # (the node runs a layer norm's program)
        with graph.inserting_before(node):
            fused_call = graph.call_function(add_norm_mlp, (norm, graph.get_attr(mlp.target), a, b))
            out = graph.call_function(operator.getitem, (fused_call, 0))
            total = graph.call_function(operator.getitem, (fused_call, 1))
        mlp.replace_all_uses_with(out)
        graph.erase_node(mlp)
        graph.erase_node(normalized)
        if 1 in items:
            items[1].replace_all_uses_with(total)
            graph.erase_node(items[1])
        graph.erase_node(node)
        fused.append((str(mlp.target), "add+layer_norm+linear+activation+linear"))
    graph.lint()
    return fused


def _is_norm_after_add(module: nn.Module) -> bool:
    return type(module) in (LayerNorm, RMSNorm) and not _hooked(module)


def _straight_line(module: nn.Module) -> bool:
    """Whether the module's forward takes its arguments without defaults or ``*args``/``**kwargs``
    and has no branch, loop, ``with`` or ``try`` in its body: code a trace records whole. (A
    trace bakes in the branches taken with default arguments and drops ``torch.no_grad()`` and
    other context managers; transformer blocks often have both.)"""
    forward = type(module).forward
    try:
        signature = inspect.signature(forward)
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, ValueError, SyntaxError):
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    for param in list(signature.parameters.values())[1:]:
        if param.default is not param.empty or param.kind not in positional:
            return False
    control = (ast.If, ast.IfExp, ast.For, ast.While, ast.With, ast.Try, ast.Match, ast.comprehension)
    return not any(isinstance(n, control) for n in ast.walk(tree.body[0]))


def _users_code(module: nn.Module) -> bool:
    return not type(module).__module__.startswith(("torch.", f"{__package__}."))


def _own_module(module: nn.Module) -> bool:
    """A module whose forward is the user's code (not torch.nn's or tritondnn's) with a batch norm
    of tritondnn's among its direct children, or with a layer norm, an RMS norm or a sequence of
    blocks (``_block_sequence``) among them and a forward of straight-line code."""
    if not _users_code(module):
        return False
    if any(relu_fusable_batch_norm(c) for c in module.children()):
        return True
    children = list(module.children())
    return any(_is_norm_after_add(c) or _block_sequence(c) for c in children) and _straight_line(module)


def _norm_block(module: nn.Module) -> bool:
    """A pre-norm transformer block, as far as fusion can tell: the user's module, no hooks, a
    forward of straight-line code, a tritondnn layer or RMS norm among its children."""
    return (
        _users_code(module)
        and not _hooked(module)
        and any(_is_norm_after_add(c) for c in module.children())
        and _straight_line(module)
    )


def _block_sequence(module: nn.Module) -> bool:
    """A Sequential (torch's or tritondnn's, not a subclass with a forward of its own; no hooks)
    of ``_norm_block`` modules: a transformer's stack, where each block's last add feeds the next
    block's first norm."""
    return (
        type(module).forward in _SEQUENTIAL_FORWARDS
        and len(module) > 0
        and not _hooked(module)
        and all(_norm_block(m) for m in module)
    )


# A stack a trace runs through: the child's name, the Sequential, its blocks.
_Stack = tuple[str, nn.Module, tuple[nn.Module, ...]]


def _stacks(module: nn.Module, name: str, selected: Callable[[str, nn.Module], bool]) -> list[_Stack]:
    """The block sequences among ``module``'s children that its trace runs through (they and
    their blocks ``selected``); none unless ``module``'s forward is straight-line code."""
    if not _straight_line(module):
        return []
    stacks = []
    for child_name, child in module.named_children():
        path = f"{name}.{child_name}" if name else child_name
        if not (_block_sequence(child) and selected(path, child)):
            continue
        if all(selected(f"{path}.{n}", b) for n, b in child.named_children()):
            stacks.append((child_name, child, tuple(child.children())))
    return stacks


def _trace(module: nn.Module, stacks: Sequence[_Stack] = ()) -> tuple[fx.Graph | None, str]:
    """The module's forward graph (children as calls, except ``stacks``' Sequentials and blocks,
    run through), or None and why not."""
    dynamo_rules_built()
    through = frozenset(id(m) for _, stack, blocks in stacks for m in (stack, *blocks))
    modes = [(m, m.training) for m in module.modules()]
    graphs = []
    try:
        for training in (True, False):
            module.train(training)
            graphs.append(_ChildrenAsLeaves(through).trace(module))
    except Exception as e:
        return None, f"not traceable by torch.fx ({type(e).__name__}: {e})"
    finally:
        for m, training in modes:
            m.training = training
    if str(graphs[0]) != str(graphs[1]):
        return None, "its forward's code depends on train/eval mode"
    return graphs[0], ""


def fuse_norms(
    model: nn.Module, selected: Callable[[str, nn.Module], bool]
) -> tuple[list[tuple[str, str]], list[tuple[str, str, str]]]:
    """Rewrite the forward of each of ``model``'s own modules (``selected`` by name and module)
    whose code runs a convolution into a batch norm, a batch norm into a ReLU, or an add into a
    layer or RMS norm. Returns (fused: qualified norm name and pattern, skipped: module name,
    class and why)."""
    fused: list[tuple[str, str]] = []
    skipped: list[tuple[str, str, str]] = []
    for name, module in model.named_modules():
        if FUSED_FORWARD in vars(module) or not _own_module(module) or not selected(name, module):
            continue
        stacks = _stacks(module, name, selected)
        graph, why = _trace(module, stacks)
        if graph is None and stacks:  # the blocks may still be fused one by one
            stacks = []
            graph, why = _trace(module)
        if graph is None:
            skipped.append((name, type(module).__name__, why))
            continue
        sites = _rewrite(graph, module)
        if any(pattern.startswith("conv+") for _, pattern in sites):
            _rewrite_chains(graph, module)
        if _straight_line(module):
            sites += _rewrite_add_norm(graph, module)
            sites += _rewrite_norm_mlp(graph, module)
        if not sites:
            continue
        # The GraphModule holds the same child modules (not copies); the forward it compiled
        # becomes this instance's.
        rewritten = fx.GraphModule(module, graph, class_name=f"{type(module).__name__}Fused")
        module.forward = _WhileAsTraced(module, rewritten, stacks).forward if stacks else rewritten.forward
        setattr(module, FUSED_FORWARD, True)
        # The blocks run through are fused one by one too (what runs when they have hooks): each
        # site is reported once.
        for target, pattern in sites:
            site = (f"{name}.{target}" if name else target, pattern)
            if site not in fused:
                fused.append(site)
    return fused, skipped


class _WhileAsTraced:
    """The forward of a module whose fused graph runs through stacks of blocks, while the stacks
    are as they were traced (the same Sequentials holding the same blocks: not
    shortened, replaced or wrapped, e.g. for activation checkpointing) and none of them has hooks;
    otherwise (FSDP2 registers hooks that gather a block's parameters before it runs, after
    patching) the module's class forward, which calls the blocks (each fused on its own). A bound
    method of this object is the module's forward: a deep copy of the model copies it along, as
    it copies a GraphModule's bound forward."""

    def __init__(self, module: nn.Module, fused: fx.GraphModule, stacks: Sequence[_Stack]) -> None:
        self.module, self.fused, self.stacks = module, fused, list(stacks)

    def _as_traced(self) -> bool:
        children = self.module._modules
        for name, stack, blocks in self.stacks:
            if children.get(name) is not stack or _hooked(stack):
                return False
            now = tuple(stack._modules.values())
            if len(now) != len(blocks) or any(a is not b or _hooked(a) for a, b in zip(now, blocks)):
                return False
        return True

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._as_traced():
            return self.fused.forward(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)


def unfuse(model: nn.Module) -> int:
    """Give every fused module its class's forward back; returns how many changed."""
    count = 0
    for module in model.modules():
        if vars(module).pop(FUSED_FORWARD, None):
            del module.forward
            count += 1
    return count
