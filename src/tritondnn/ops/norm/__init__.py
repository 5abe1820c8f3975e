"""Normalization: layer, RMS, group, instance and batch norm, forward and backward, with fusions
(residual add before layer/RMS norm, an activation after any of them)."""

from .batch import (
    batch_norm,
    batch_norm_apply,
    batch_norm_backward_apply,
    batch_norm_backward_reduce,
    batch_norm_stats,
)
from .group import group_norm, instance_norm
from .layer import add_layer_norm, add_rms_norm, layer_norm, rms_norm

__all__ = [
    "add_layer_norm",
    "add_rms_norm",
    "batch_norm",
    "batch_norm_apply",
    "batch_norm_backward_apply",
    "batch_norm_backward_reduce",
    "batch_norm_stats",
    "group_norm",
    "instance_norm",
    "layer_norm",
    "rms_norm",
]
