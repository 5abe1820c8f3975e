"""tdnn.nn.MultiheadAttention against torch.nn.MultiheadAttention, and routing of
F.scaled_dot_product_attention through tdnn.sdpa."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tritondnn.nn as tnn
import tritondnn.nn.attention as tattn
from helpers import DEVICE, assert_close, randn

E, H, L, S, N = 16, 2, 5, 7, 3


def _pair(**kwargs):
    torch.manual_seed(0)
    theirs = nn.MultiheadAttention(E, H, **kwargs).to(DEVICE)
    ours = copy.deepcopy(theirs)
    ours.__class__ = tnn.MultiheadAttention
    return ours, theirs


def _outputs(module, q, k, v, dy, **kwargs):
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    self_attention = q is k and k is v
    args = (leaves[0], leaves[0], leaves[0]) if self_attention else leaves
    out, weights = module(*args, need_weights=False, **kwargs)
    params = [p for p in module.parameters() if p.requires_grad]
    grads = torch.autograd.grad(out, leaves[:1] + params if self_attention else leaves + params, dy)
    return out.detach(), weights, grads


def _compare(ours, theirs, q, k, v, what, **kwargs):
    """Output and every gradient of ours vs theirs and a float64 copy of theirs."""
    wide = copy.deepcopy(theirs).double()
    self_attention = q is k and k is v
    dy = randn(*(q.shape[:-1]), E)
    got, weights, dgot = _outputs(ours, q, k, v, dy, **kwargs)
    same, _, dsame = _outputs(theirs, q, k, v, dy, **kwargs)
    q64 = q.double()
    kv64 = (q64, q64) if self_attention else (k.double(), v.double())
    wkw = {
        n: (t.double() if t.is_floating_point() else t) if isinstance(t, torch.Tensor) else t
        for n, t in kwargs.items()
    }
    ref, _, dref = _outputs(wide, q64, *kv64, dy.double(), **wkw)
    assert weights is None
    assert_close(got, ref, same, f"{what} output")
    for i, (a, b, c) in enumerate(zip(dgot, dref, dsame)):
        assert_close(a, b, c, f"{what} gradient {i}")


@pytest.mark.parametrize("batch_first", [False, True])
def test_self_attention_with_masks(batch_first):
    ours, theirs = _pair(batch_first=batch_first)
    x = randn(N, L, E) if batch_first else randn(L, N, E)
    padding = torch.zeros(N, L, dtype=torch.bool, device=DEVICE)
    padding[0, -2:] = True
    causal = torch.triu(torch.ones(L, L, dtype=torch.bool, device=DEVICE), 1)
    _compare(ours, theirs, x, x, x, "plain")
    _compare(ours, theirs, x, x, x, "key padding (bool)", key_padding_mask=padding)
    _compare(ours, theirs, x, x, x, "causal hint", attn_mask=causal, is_causal=True)
    _compare(ours, theirs, x, x, x, "causal + padding", attn_mask=causal, key_padding_mask=padding)
    additive = randn(N * H, L, L)
    _compare(
        ours, theirs, x, x, x, "3-D float mask + bool padding", attn_mask=additive, key_padding_mask=padding
    )


def test_cross_attention_kdim_vdim_and_unbatched():
    ours, theirs = _pair(kdim=6, vdim=10, bias=False)
    q, k, v = randn(L, N, E), randn(S, N, 6), randn(S, N, 10)
    padding = randn(N, S)  # a float key_padding_mask is added
    _compare(ours, theirs, q, k, v, "kdim/vdim", key_padding_mask=padding)
    ours, theirs = _pair()
    q, k, v = randn(L, E), randn(S, E), randn(S, E)
    _compare(ours, theirs, q, k, v, "unbatched", attn_mask=randn(L, S))


def test_weights_requested_take_torchs_path():
    ours, theirs = _pair(add_bias_kv=True)
    x = randn(L, N, E)
    out, w = ours(x, x, x)  # need_weights=True by default
    expected, w_expected = theirs(x, x, x)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(w, w_expected)
    out, w = ours(x, x, x, need_weights=False)  # bias_k: torch's path too
    torch.testing.assert_close(out, theirs(x, x, x, need_weights=False)[0])


def test_route_sdpa(monkeypatch):
    """Inside route_sdpa, F.scaled_dot_product_attention calls tdnn.sdpa; outside, torch's."""
    calls = []
    real = tattn.sdpa

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(tattn, "sdpa", spy)
    q, k, v = randn(2, 2, 5, 8), randn(2, 2, 6, 8), randn(2, 2, 6, 8)
    mask = torch.rand(5, 6, device=DEVICE) > 0.3
    mask[:, 0] = True
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    with tnn.route_sdpa():
        got = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert calls == [1]
    wide = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
    assert_close(got, wide, expected)
    F.scaled_dot_product_attention(q, k, v)
    assert calls == [1]


def test_float64_module_runs_like_torch():
    """sdpa has no fp64 kernel: a ``.double()`` model takes torch's path rather than failing."""
    ours, theirs = _pair()
    ours.double(), theirs.double()
    x = randn(L, N, E, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="tritondnn falls back")
        got = ours(x, x, x, need_weights=False)[0]
    torch.testing.assert_close(got, theirs(x, x, x, need_weights=False)[0])


def _bad(q_shape=(L, N, E), kv_shapes=((L, N, E), (L, N, E)), **kwargs):
    return lambda: (randn(*q_shape), randn(*kv_shapes[0]), randn(*kv_shapes[1]), kwargs)


BAD_CALLS = {
    "unbatched query, batched key": _bad((L, E), ((S, N, E), (S, N, E))),
    "embedding size": _bad((L, N, E + 1), ((L, N, E + 1), (L, N, E + 1))),
    "key/value lengths": _bad(kv_shapes=((S, N, E), (S + 1, N, E))),
    "integer attn_mask": _bad(attn_mask=torch.zeros(L, L, dtype=torch.int64)),
    "integer key_padding_mask": _bad(key_padding_mask=torch.zeros(N, L, dtype=torch.int64)),
    "2-D mask shape": _bad(attn_mask=torch.zeros(L, L + 1)),
    "3-D mask shape": _bad(attn_mask=torch.zeros(N, L, L)),
    "key_padding_mask shape": _bad(key_padding_mask=torch.zeros(N, L + 1)),
    "float64 mask": _bad(attn_mask=torch.zeros(L, L, dtype=torch.float64)),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_input_raises_torchs_error(case):
    """Input torch.nn.MultiheadAttention rejects raises its error (type and message)."""
    ours, theirs = _pair()
    q, k, v, kwargs = BAD_CALLS[case]()
    kwargs = {name: mask.to(DEVICE) for name, mask in kwargs.items()}
    with pytest.raises(Exception) as expected:
        theirs(q, k, v, need_weights=False, **kwargs)
    with pytest.raises(type(expected.value)) as got:
        ours(q, k, v, need_weights=False, **kwargs)
    assert str(got.value) == str(expected.value)


def test_batch_first_self_attention_projects_once(monkeypatch):
    """Self-attention with batch_first keeps query is key is value: one packed GEMM, as torch."""
    calls = []
    real = tattn.linear
    monkeypatch.setattr(tattn, "linear", lambda *a: calls.append(1) or real(*a))
    ours, theirs = _pair(batch_first=True)
    x = randn(N, L, E)
    got = ours(x, x, x, need_weights=False)[0]
    assert len(calls) == 2  # in-projection and out-projection
    torch.testing.assert_close(got, theirs(x, x, x, need_weights=False)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("batch_first", [False, True])
def test_masked_calls_take_tritondnns_path(monkeypatch, batch_first):
    """Well-formed masks of every kind run tdnn.sdpa (not torch's forward), in both layouts."""
    calls = []
    real = tattn.sdpa
    monkeypatch.setattr(tattn, "sdpa", lambda *a, **k: calls.append(1) or real(*a, **k))
    ours, _ = _pair(batch_first=batch_first)
    x = randn(N, L, E) if batch_first else randn(L, N, E)
    padding = torch.zeros(N, L, dtype=torch.bool, device=DEVICE)
    ours(x, x, x, need_weights=False, attn_mask=randn(N * H, L, L), key_padding_mask=randn(N, L))
    ours(x, x, x, need_weights=False, attn_mask=randn(L, L), key_padding_mask=padding)
    ours(x, x, x, need_weights=False, key_padding_mask=padding)
    assert len(calls) == 3
