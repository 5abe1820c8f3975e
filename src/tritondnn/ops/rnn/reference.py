"""The meaning of ``tdnn.lstm``, ``tdnn.gru`` and ``tdnn.rnn``: plain PyTorch in float64, one time
step at a time, every layer and direction on its own.

Cells (torch.nn's equations, gates in torch's order):

* LSTM: ``i, f, g, o = sigmoid, sigmoid, tanh, sigmoid of x W_ih^T + b_ih + h W_hh^T + b_hh``;
  ``c' = f c + i g``; ``h' = o tanh(c')``, then ``h' = h' W_hr^T`` with a projection.
* GRU: ``r, z = sigmoid(...)``; ``n = tanh(x W_in^T + b_in + r (h W_hn^T + b_hn))``;
  ``h' = (1 - z) n + z h``.
* RNN: ``h' = tanh or relu(x W_ih^T + b_ih + h W_hh^T + b_hh)``.

With ``lengths``, sequence ``b`` runs over its first ``lengths[b]`` steps (the reverse direction
starts at step ``lengths[b] - 1``); its state stops changing after that, and its output is zero
there, as ``pad_packed_sequence`` pads.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

CELLS = ("lstm", "gru", "rnn_tanh", "rnn_relu")
GATES = {"lstm": 4, "gru": 3, "rnn_tanh": 1, "rnn_relu": 1}


def weights_per_layer(bias: bool, proj_size: int) -> int:
    """Tensors per layer and direction in torch's ``_flat_weights`` order: w_ih, w_hh, [b_ih, b_hh],
    [w_hr]."""
    return 2 + 2 * bias + (proj_size > 0)


def split_weights(
    weights: Sequence[torch.Tensor], layer: int, direction: int, directions: int, bias: bool, proj_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(w_ih, w_hh, b_ih, b_hh, w_hr) of one layer and direction (None where absent)."""
    per = weights_per_layer(bias, proj_size)
    w = list(weights[(layer * directions + direction) * per :][:per])
    b_ih, b_hh = (w[2], w[3]) if bias else (None, None)
    return w[0], w[1], b_ih, b_hh, w[-1] if proj_size > 0 else None


def _cell(cell: str, x, h, c, w_ih, w_hh, b_ih, b_hh, w_hr):
    gx = x @ w_ih.T + (b_ih if b_ih is not None else 0)
    gh = h @ w_hh.T + (b_hh if b_hh is not None else 0)
    if cell == "lstm":
        i, f, g, o = (gx + gh).chunk(4, -1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        return (h @ w_hr.T if w_hr is not None else h), c
    if cell == "gru":
        xr, xz, xn = gx.chunk(3, -1)
        hr, hz, hn = gh.chunk(3, -1)
        r, z = torch.sigmoid(xr + hr), torch.sigmoid(xz + hz)
        n = torch.tanh(xn + r * hn)
        return (1 - z) * n + z * h, c
    pre = gx + gh
    return (torch.tanh(pre) if cell == "rnn_tanh" else torch.relu(pre)), c


def rnn_reference(
    cell: str,
    input: torch.Tensor,
    h0: torch.Tensor | None,
    c0: torch.Tensor | None,
    weights: Sequence[torch.Tensor],
    *,
    bias: bool = True,
    num_layers: int = 1,
    bidirectional: bool = False,
    proj_size: int = 0,
    lengths: Sequence[int] | torch.Tensor | None = None,
    dropout: float = 0.0,
    dropout_masks: Sequence[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(output (T, B, D * P), h_n (L * D, B, P), c_n (L * D, B, H) or None) in float64.

    ``input`` is time-major (T, B, I). ``dropout_masks[l - 1]`` is the boolean keep-mask of layer
    ``l``'s input, shape (T, B, D * P), applied with scale ``1 / (1 - dropout)``.
    """
    x = input.double()
    steps, batch = x.shape[:2]
    directions = 2 if bidirectional else 1
    hidden = weights[1].shape[0] // GATES[cell]
    state = proj_size or hidden
    lens = [steps] * batch if lengths is None else [int(n) for n in lengths]
    active = torch.tensor([[t < n for n in lens] for t in range(steps)], device=x.device)[..., None]
    h0 = x.new_zeros(num_layers * directions, batch, state) if h0 is None else h0.double()
    c0 = x.new_zeros(num_layers * directions, batch, hidden) if c0 is None else c0.double()
    hs, cs = [], []
    for layer in range(num_layers):
        if layer > 0 and dropout_masks is not None:
            x = x * dropout_masks[layer - 1].to(x.device) / (1 - dropout)
        outs = []
        for d in range(directions):
            w = [t.double() if t is not None else None for t in split_weights(
                weights, layer, d, directions, bias, proj_size)]  # fmt: skip
            h, c = h0[layer * directions + d], c0[layer * directions + d]
            out = x.new_zeros(steps, batch, state)
            for t in reversed(range(steps)) if d else range(steps):
                h_new, c_new = _cell(cell, x[t], h, c, *w)
                h = torch.where(active[t], h_new, h)
                c = torch.where(active[t], c_new, c)
                out[t] = torch.where(active[t], h_new, 0.0)
            outs.append(out)
            hs.append(h)
            cs.append(c)
        x = torch.cat(outs, -1)
    return x, torch.stack(hs), torch.stack(cs) if cell == "lstm" else None
