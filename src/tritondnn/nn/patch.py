"""``patch(model)``: tritondnn's modules swapped into an existing model, in place.

A tritondnn module subclasses its torch.nn class and adds no state, so patching reassigns the live
module's ``__class__``: parameters, buffers, hooks, the optimizer's references and the parent's
registration all stay as they are (weights shared, never copied). ``unpatch`` assigns the torch
class back.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Iterable

from torch import nn

from . import attention, cache, containers, conv_bn, fusion, layers, rnn, sync_batchnorm

# torch.nn class -> tritondnn class, filled from the modules that subclass exactly one of torch's.
SUPPORTED: dict[type[nn.Module], type[nn.Module]] = {}


def register(*modules: type[nn.Module]) -> None:
    """Make each tritondnn module class the replacement for the torch.nn class it subclasses."""
    for cls in modules:
        base = next(b for b in cls.__mro__[1:] if b.__module__.startswith("torch.nn"))
        SUPPORTED[base] = cls


register(
    *(
        cls
        for cls in vars(layers).values()
        if isinstance(cls, type) and issubclass(cls, nn.Module) and cls.__module__ == layers.__name__
    ),
    containers.Sequential,
    attention.MultiheadAttention,
    rnn.LSTM,
    rnn.GRU,
    rnn.RNN,
    sync_batchnorm.SyncBatchNorm,
)
_ORIGINAL = {ours: theirs for theirs, ours in SUPPORTED.items()}

Selector = type[nn.Module] | str


@dataclasses.dataclass
class PatchReport:
    """What ``patch`` did: ``replaced`` (qualified name, class) and ``skipped`` (qualified name,
    class, reason), in module order; ``sdpa`` whether ``F.scaled_dot_product_attention`` is routed
    through ``tdnn.sdpa`` during the model's forward; ``fused`` (qualified name, pattern) for
    each batch norm that ``fuse=True`` joined with its convolution or ReLU, each layer or RMS norm
    it joined with the add before it, and each MLP it joined with the add and layer norm before
    it."""

    replaced: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    skipped: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)
    sdpa: bool = False
    fused: list[tuple[str, str]] = dataclasses.field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"tritondnn.nn.patch: {len(self.replaced)} replaced, {len(self.skipped)} skipped"]
        lines += [f"  replaced {name or '<root>'} ({cls})" for name, cls in self.replaced]
        lines += [f"  skipped  {name or '<root>'} ({cls}): {why}" for name, cls, why in self.skipped]
        if self.sdpa:
            lines.append("  F.scaled_dot_product_attention routed through tdnn.sdpa in forward")
        lines += [f"  fused    {name} ({pattern})" for name, pattern in self.fused]
        return "\n".join(lines)


def _matches(name: str, module: nn.Module, selectors: Iterable[Selector]) -> bool:
    """A selector is a torch.nn class (the module is an instance), or a pattern (fnmatch) of the
    module's class name or its qualified name in the model."""
    for s in selectors:
        if isinstance(s, type):
            if isinstance(module, s):
                return True
        elif fnmatch.fnmatchcase(type(module).__name__, s) or fnmatch.fnmatchcase(name, s):
            return True
    return False


def patch(
    model: nn.Module,
    include: Iterable[Selector] | None = None,
    exclude: Iterable[Selector] | None = None,
    sdpa: bool = False,
    fuse: bool = False,
) -> PatchReport:
    """Swap tritondnn's module for every supported torch.nn submodule of ``model`` (the model too).

    Args:
        model: any torch.nn.Module; changed in place.
        include: only modules matching one of these (torch.nn classes, or fnmatch patterns of class
            names like ``"Conv*"`` or qualified names like ``"encoder.*"``); None: all.
        exclude: modules matching one of these are left alone.
        sdpa: also route ``F.scaled_dot_product_attention`` calls made during ``model``'s forward
            through ``tdnn.sdpa`` (for models that call it directly, e.g. HuggingFace's).
        fuse: also rewrite the forward of the model's own modules (not torch.nn's) where it runs
            a convolution into a batch norm, or a batch norm into a ReLU with or without a
            residual add between them (a ResNet block's ``relu(bn(conv(x)))`` and
            ``relu(bn(conv(y)) + x)``), or an add into a LayerNorm or RMSNorm (``norm2(x +
            attn(norm1(x)))``), to run each chain as one autograd node; see
            ``tritondnn.nn.fusion`` for what tracing fixes; a block's conv + batch norm
            pairs run as one node, and so do an add + layer norm and the MLP (a patched
            ``Sequential`` of Linear, activation, Linear) reading its output alone. Patched
            ``Sequential`` containers fuse Conv2d + BatchNorm (+ ReLU), BatchNorm + ReLU, Linear +
            activation, and Linear, activation, Linear (one node where autograd records) either
            way. Under autocast, each forward of the model
            casts the fp32 weights of its fused convolutions and of its linear layers in one
            launch as it begins (those the previous forward used; with autograd on); a weight
            written in place later in the forward is cast again by its call, unless written
            through ``.data`` (which bypasses the version counter, as autograd's checks miss it).

    Returns:
        A ``PatchReport``: what was replaced, and what was skipped and why (excluded, a user
        subclass whose forward tritondnn would bypass, or no tritondnn module for the class).
    """
    include = None if include is None else tuple(include)
    exclude = () if exclude is None else tuple(exclude)
    report = PatchReport()
    for name, module in model.named_modules():
        cls = type(module)
        if cls in _ORIGINAL:
            continue  # already patched
        known = next((base for base in cls.__mro__ if base in SUPPORTED), None)
        if known is None:
            if not any(True for _ in module.children()) and cls.__module__.startswith("torch.nn"):
                report.skipped.append((name, cls.__name__, "no tritondnn module for this class"))
            continue
        if include is not None and not _matches(name, module, include):
            report.skipped.append((name, cls.__name__, "not included"))
        elif _matches(name, module, exclude):
            report.skipped.append((name, cls.__name__, "excluded"))
        elif known is not cls:
            why = f"subclass of torch.nn.{known.__name__}: its own code would be bypassed"
            report.skipped.append((name, cls.__name__, why))
        else:
            module.__class__ = SUPPORTED[cls]
            report.replaced.append((name, cls.__name__))
    if sdpa and not getattr(model, "_tdnn_sdpa_hooks", None):
        model._tdnn_sdpa_hooks = (
            model.register_forward_pre_hook(attention.enter_routing),
            model.register_forward_hook(attention.exit_routing, always_call=True),
        )
    report.sdpa = bool(getattr(model, "_tdnn_sdpa_hooks", None))
    if fuse:
        fused, skipped = fusion.fuse_norms(model, lambda name, m: not _matches(name, m, exclude))
        report.fused += fused
        report.skipped += skipped
        if not getattr(model, "_tdnn_step_hooks", None):  # see conv_bn's _Step
            model._tdnn_step_hooks = (
                model.register_forward_pre_hook(conv_bn.enter_step),
                model.register_forward_hook(conv_bn.exit_step, always_call=True),
            )
    return report


def unpatch(model: nn.Module) -> int:
    """Give every tritondnn module in ``model`` its torch.nn class back, every fused module its
    class's forward, and stop routing sdpa (and opening fused steps); returns how many modules
    changed."""
    count = fusion.unfuse(model)
    for module in model.modules():
        cache.clear(module)
        original = _ORIGINAL.get(type(module))
        if original is not None:
            module.__class__ = original
            count += 1
    for name in ("_tdnn_sdpa_hooks", "_tdnn_step_hooks"):
        for handle in model.__dict__.pop(name, None) or ():
            handle.remove()
    model.__dict__.pop("_tdnn_cast_plan", None)
    return count
