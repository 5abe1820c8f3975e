"""tdnn.nn.LSTM / GRU / RNN: torch's constructor, parameters, state_dict and repr; forward and
every gradient (input, initial state, parameters) against the torch module in float64."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

from helpers import DEVICE, ON_GPU, assert_close
from tritondnn.nn.rnn import GRU, LSTM, RNN

CASES = [
    (LSTM, nn.LSTM, dict(num_layers=2, bidirectional=True, proj_size=3)),
    (GRU, nn.GRU, dict(batch_first=True, dropout=0.0)),
    (RNN, nn.RNN, dict(nonlinearity="relu", bias=False, num_layers=2)),
]


def _pair(ours_cls, torch_cls, options):
    theirs = torch_cls(4, 6, **options)
    ours = ours_cls(4, 6, **options)
    ours.load_state_dict(theirs.state_dict())
    return ours.to(DEVICE), theirs.double()


@pytest.mark.parametrize("ours_cls, torch_cls, options", CASES, ids=["LSTM", "GRU", "RNN"])
def test_same_module_as_torch(ours_cls, torch_cls, options):
    ours, theirs = _pair(ours_cls, torch_cls, options)
    assert isinstance(ours, torch_cls)
    assert repr(ours) == repr(theirs)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    assert [n for n, _ in ours.named_parameters()] == theirs._flat_weights_names


@pytest.mark.parametrize("ours_cls, torch_cls, options", CASES, ids=["LSTM", "GRU", "RNN"])
def test_forward_and_gradients(ours_cls, torch_cls, options):
    ours, theirs = _pair(ours_cls, torch_cls, options)
    x = torch.randn(3, 2, 4)
    xs = (x.to(DEVICE).requires_grad_(), x.double().requires_grad_())
    outs = [m(xi) for m, xi in zip((ours, theirs), xs)]
    flat = [[o, *(h if isinstance(h, tuple) else (h,))] for o, h in outs]
    dys = [torch.randn_like(t, dtype=torch.float64) for t in flat[1]]
    grads = [
        torch.autograd.grad(f, [xi, *m.parameters()], [d.to(t) for d, t in zip(dys, f)])
        for f, m, xi in zip(flat, (ours, theirs), xs)
    ]
    for i, (a, b) in enumerate(zip(*flat)):
        assert_close(a.detach().cpu(), b.detach(), None, f"output {i}")
    for i, (a, b) in enumerate(zip(*grads)):
        assert_close(a.cpu(), b, None, f"gradient {i}")


def test_packed_input_and_initial_state():
    ours, theirs = _pair(LSTM, nn.LSTM, dict(bidirectional=True))
    x = torch.randn(4, 3, 4)
    lengths = torch.tensor([2, 4, 3])
    h0, c0 = torch.randn(2, 3, 6), torch.randn(2, 3, 6)
    out, (hn, cn) = ours(pack_padded_sequence(x.to(DEVICE), lengths, enforce_sorted=False),
                         (h0.to(DEVICE), c0.to(DEVICE)))  # fmt: skip
    ref, (hr, cr) = theirs(
        pack_padded_sequence(x.double(), lengths, enforce_sorted=False), (h0.double(), c0.double())
    )
    assert torch.equal(out.batch_sizes, ref.batch_sizes)
    for a, b, what in ((out.data, ref.data, "output"), (hn, hr, "h_n"), (cn, cr, "c_n")):
        assert_close(a.detach().cpu(), b.detach(), None, what)


def test_dropout_in_training_only():
    ours = GRU(3, 5, num_layers=2, dropout=0.5).to(DEVICE)
    x = torch.randn(4, 2, 3, device=DEVICE)
    with torch.no_grad():
        a, b = ours(x)[0], ours(x)[0]
        ours.eval()
        c, d = ours(x)[0], ours(x)[0]
    assert not torch.equal(a, b)
    assert torch.equal(c, d)


def test_unbatched_input():
    ours, theirs = _pair(RNN, nn.RNN, {})
    x, h0 = torch.randn(5, 4), torch.randn(1, 6)
    out, hn = ours(x.to(DEVICE), h0.to(DEVICE))
    ref, hr = theirs(x.double(), h0.double())
    assert out.shape == ref.shape and hn.shape == hr.shape
    assert_close(out.detach().cpu(), ref.detach(), None, "output")


@pytest.mark.skipif(not ON_GPU, reason="needs a second device: CPU tensors beside the GPU backend")
def test_other_device_runs_torch():
    ours, _ = _pair(LSTM, nn.LSTM, {})
    ours = ours.cpu()
    x = torch.randn(3, 2, 4)
    out, _ = ours(x)
    ref, _ = nn.LSTM.forward(ours, x)
    assert torch.equal(out, ref)


def test_wrong_input_size_message():
    ours = LSTM(4, 6).to(DEVICE)
    with pytest.raises(
        RuntimeError, match=r"input.size\(-1\) must be equal to input_size. Expected 4, got 3"
    ):
        ours(torch.randn(2, 2, 3, device=DEVICE))
