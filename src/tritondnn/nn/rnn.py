"""torch.nn.LSTM, GRU and RNN whose forward runs tritondnn's recurrent kernels (``ops.rnn``).

Each class subclasses its torch.nn namesake and adds no state: constructor, parameters (the same
``_flat_weights`` in the same order), ``state_dict`` and ``repr`` are torch's. ``forward`` takes
what torch's does (a padded or packed input, ``hx``) and returns the same structure. An input on
another device than the backend's, or a problem no engine takes, runs torch's own forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from ..ops import rnn as ops_rnn
from .layers import run_or_fallback


class _RNNMixin:
    """Forward through ``ops.rnn``: the module's flags and flat weights passed as they are."""

    def _tdnn_call(self, input: Any, hx: Any) -> Any:
        raise NotImplementedError

    def forward(self, input: torch.Tensor | PackedSequence, hx: Any = None) -> Any:
        update = getattr(self, "_update_flat_weights", None)
        if update is not None:  # weights swapped in by torch.func.functional_call
            update()
        data = input.data if isinstance(input, PackedSequence) else input
        theirs = super().forward  # type: ignore[misc]
        return run_or_fallback(self, data, lambda: self._tdnn_call(input, hx), lambda: theirs(input, hx))  # type: ignore[arg-type]

    def _flags(self) -> tuple:
        m: nn.RNNBase = self  # type: ignore[assignment]
        return (list(m._flat_weights), m.bias, m.num_layers, float(m.dropout), m.training, m.bidirectional,
                m.batch_first)  # fmt: skip


class LSTM(_RNNMixin, nn.LSTM):
    """``torch.nn.LSTM`` (with ``proj_size``) through ``tdnn.lstm``."""

    def _tdnn_call(self, input: Any, hx: Any) -> Any:
        return ops_rnn.lstm(input, hx, *self._flags(), proj_size=self.proj_size)


class GRU(_RNNMixin, nn.GRU):
    """``torch.nn.GRU`` through ``tdnn.gru``."""

    def _tdnn_call(self, input: Any, hx: Any) -> Any:
        return ops_rnn.gru(input, hx, *self._flags())


class RNN(_RNNMixin, nn.RNN):
    """``torch.nn.RNN`` (tanh or relu) through ``tdnn.rnn``."""

    def _tdnn_call(self, input: Any, hx: Any) -> Any:
        return ops_rnn.rnn(input, hx, *self._flags(), nonlinearity=self.nonlinearity)


__all__ = ["GRU", "LSTM", "RNN"]
