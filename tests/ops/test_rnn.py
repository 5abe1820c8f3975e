"""tdnn.lstm / gru / rnn against torch.nn.LSTM / GRU / RNN in float64: outputs, final states and
the gradients of the input, the initial states and every weight, for every engine and mode."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import tritondnn as tdnn
import tritondnn.ops.rnn as R
from helpers import DEVICE, ON_GPU, assert_close, torch_or_skip
from tritondnn.ops.dropout import counters_used, dropout_mask_reference

MODULES = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU, "rnn_tanh": torch.nn.RNN, "rnn_relu": torch.nn.RNN}
FUNCS = {
    "lstm": R.lstm,
    "gru": R.gru,
    "rnn_tanh": partial(R.rnn, nonlinearity="tanh"),
    "rnn_relu": partial(R.rnn, nonlinearity="relu"),
}
ENGINES = ("persistent", "persistent-tiled", "persistent-spread", "per-step")


def _module(cell: str, input_size: int, hidden: int, dtype=torch.float32, **kw) -> torch.nn.RNNBase:
    """A float64 torch module on the CPU whose weights are exactly representable in ``dtype``."""
    extra = {"nonlinearity": cell[4:]} if cell.startswith("rnn") else {}
    m = MODULES[cell](input_size, hidden, dtype=torch.float64, **extra, **kw)
    with torch.no_grad():
        for w in m._flat_weights:
            w.copy_(w.to(dtype))
    return m


def _states(cell, m, batch, dtype, unbatched=False):
    layers = m.num_layers * (2 if m.bidirectional else 1)
    shape = (layers, batch) if not unbatched else (layers,)
    h0 = torch.randn(*shape, m.proj_size or m.hidden_size).to(dtype)
    if cell != "lstm":
        return h0
    return h0, torch.randn(*shape, m.hidden_size).to(dtype)


def _flat(out, h):
    outs = [out.data if isinstance(out, torch.nn.utils.rnn.PackedSequence) else out]
    return outs + (list(h) if isinstance(h, tuple) else [h])


def _leaves(x, hx, weights):
    hx = [] if hx is None else list(hx) if isinstance(hx, tuple) else [hx]
    return [x, *hx, *weights]


def _run_ours(
    cell, m, x, hx, dtype, dys, *, lengths=None, enforce_sorted=True, packed=False, grad=True, **kw
):
    """(outputs, gradients of x, hx, weights) of the tdnn function on ``dtype`` copies."""
    x = x.detach().to(DEVICE, dtype).requires_grad_(grad)
    hx = None if hx is None else (
        tuple(t.detach().to(DEVICE, dtype).requires_grad_(grad) for t in hx) if isinstance(hx, tuple)
        else hx.detach().to(DEVICE, dtype).requires_grad_(grad)
    )  # fmt: skip
    ws = [w.detach().to(DEVICE, dtype).requires_grad_(grad) for w in m._flat_weights]
    inp = pack_padded_sequence(x, lengths, m.batch_first, enforce_sorted) if packed else x
    extra = {"proj_size": m.proj_size} if cell == "lstm" else {}
    if lengths is not None and not packed:
        extra.update(lengths=lengths, enforce_sorted=enforce_sorted)
    out, h = FUNCS[cell](inp, hx, ws, m.bias, m.num_layers, m.dropout, m.training, m.bidirectional,
                         m.batch_first, **extra, **kw)  # fmt: skip
    outs = _flat(out, h)
    if not grad:
        return [o.detach() for o in outs], []
    leaves = _leaves(x, hx, ws)
    grads = torch.autograd.grad(outs, leaves, [d.to(o) for d, o in zip(dys, outs)])
    return [o.detach() for o in outs], list(grads)


def _run_torch(m, x, hx, dtype, dys, *, lengths=None, enforce_sorted=True, packed=False):
    """The same with the torch module in ``dtype`` (float64 for the reference)."""
    m = m.to(dtype)
    x = x.detach().to(dtype).requires_grad_()
    hx = None if hx is None else (
        tuple(t.detach().to(dtype).requires_grad_() for t in hx) if isinstance(hx, tuple)
        else hx.detach().to(dtype).requires_grad_()
    )  # fmt: skip
    inp = pack_padded_sequence(x, lengths, m.batch_first, enforce_sorted) if lengths is not None else x
    out, h = m(inp, hx)
    if lengths is not None and not packed:
        total = x.shape[1 if m.batch_first else 0]
        out = pad_packed_sequence(out, m.batch_first, total_length=total)[0]
    outs = _flat(out, h)
    grads = torch.autograd.grad(outs, _leaves(x, hx, m._flat_weights), [d.to(o) for d, o in zip(dys, outs)])
    return [o.detach() for o in outs], list(grads)


def _check(cell, m, x, hx, dtype=torch.float32, *, what="", grad=True, **kw):
    """Compare outputs (and gradients) with the float64 module (and the module in ``dtype``)."""
    tkw = _torch_kw(kw)
    dys = [torch.randn_like(o) for o in _run_torch_outputs(m, x, hx, **tkw)]
    ref, dref = _run_torch(m, x, hx, torch.float64, dys, **tkw)
    same, dsame = (None, [None] * len(dref))
    if dtype != torch.float32:
        same, dsame = _run_torch(m, x, hx, dtype, dys, **tkw)
    got, dgot = _run_ours(cell, m, x, hx, dtype, dys, grad=grad, **kw)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert_close(a.cpu(), b, None if same is None else same[i], f"{what} output {i}")
    for i, (a, b) in enumerate(zip(dgot, dref)):
        assert_close(a.cpu(), b, dsame[i], f"{what} gradient {i}")
    m.double()


def _torch_kw(kw):
    return {k: v for k, v in kw.items() if k in ("lengths", "enforce_sorted", "packed")}


def _run_torch_outputs(m, x, hx, **kw):
    with torch.no_grad():
        inp = x.double()
        lengths = kw.get("lengths")
        if lengths is not None:
            inp = pack_padded_sequence(inp, lengths, m.batch_first, kw.get("enforce_sorted", True))
        hxd = None if hx is None else tuple(t.double() for t in hx) if isinstance(hx, tuple) else hx.double()
        out, h = m.double()(inp, hxd)
        if lengths is not None and not kw.get("packed"):
            out = pad_packed_sequence(out, m.batch_first, total_length=x.shape[1 if m.batch_first else 0])[0]
        return _flat(out, h)


# ---------------------------------------------------------------------------------------------
# Every cell and mode, fp32, on the heuristic's engine (resident weights at these sizes).


@pytest.mark.parametrize(
    "cell, options, given_state",
    [
        ("lstm", dict(num_layers=2, bidirectional=True), True),
        ("lstm", dict(proj_size=3, bidirectional=True, bias=False), False),
        ("gru", dict(num_layers=2, batch_first=True), True),
        ("rnn_tanh", dict(bidirectional=True), True),
        ("rnn_relu", dict(num_layers=2, bias=False), False),
    ],
    ids=[
        "lstm-2layer-bidir",
        "lstm-proj-bidir-nobias",
        "gru-2layer-batchfirst",
        "rnn_tanh-bidir",
        "rnn_relu-2layer",
    ],
)
def test_matches_torch(cell, options, given_state, poison):
    m = _module(cell, 5, 8, **options)
    batch_first = options.get("batch_first", False)
    x = torch.randn(3, 4, 5) if batch_first else torch.randn(4, 3, 5)
    hx = _states(cell, m, 3, torch.float32) if given_state else None
    _check(cell, m, x, hx, what=cell)


@pytest.mark.parametrize("algo", ENGINES[1:])
@pytest.mark.parametrize(
    "cell, options",
    [("lstm", dict(proj_size=9, bidirectional=True)), ("gru", dict(bidirectional=True)), ("rnn_relu", {})],
    ids=["lstm-proj-bidir", "gru-bidir", "rnn_relu"],
)
def test_tiled_engines(cell, options, algo, poison):
    """H = 20 spans two hidden tiles, P = 9 (projection) or 20 two state tiles: the tile loops,
    the in-program barriers and the per-step launches all take part."""
    m = _module(cell, 6, 20, **options)
    _check(cell, m, torch.randn(3, 2, 6), _states(cell, m, 2, torch.float32), algo=algo, what=algo)


_SHARED = pytest.mark.gpu_only("on the CPU every multiprocessor count runs one program a group")


@pytest.mark.parametrize("sms", [pytest.param(4, marks=_SHARED), pytest.param(6, marks=_SHARED), 132])
@pytest.mark.parametrize(
    "cell, options",
    [
        ("lstm", dict(proj_size=9, bidirectional=True)),
        ("lstm", dict(bidirectional=True)),
        ("gru", dict(bidirectional=True)),
    ],
    ids=["lstm-proj-bidir", "lstm-bidir", "gru-bidir"],
)
def test_spread_engine_shares_tiles(cell, options, sms, monkeypatch, poison):
    """The spread engine's programs of a batch block and direction share its hidden tiles: with
    2 groups (directions) and 4, 6 or 132 multiprocessors, 2, 3 or all 7 programs a group split
    H = 100's 7 tiles of 16 (a program taking two where they outnumber the programs), meeting on
    counters after each phase; the unprojected cells' backward in one phase (``OWNED``) even with
    fewer programs than tiles, where it does not come first. On the CPU one program a group runs
    them all (the interpreter runs programs one after another)."""
    monkeypatch.setattr(R.engines, "sm_count", lambda: sms)
    monkeypatch.setattr(R.engines, "_owned_first", lambda p: R.engines._owned(p) and p.dtype == "float32")
    monkeypatch.setattr(R, "_plans", {})
    m = _module(cell, 6, 100, **options)
    _check(cell, m, torch.randn(4, 5, 6), _states(cell, m, 5, torch.float32), algo="persistent-spread",
           what=f"{sms} multiprocessors")  # fmt: skip


@pytest.mark.parametrize("unit", [4, 8, 16])
@pytest.mark.parametrize(
    "cell, options",
    [("lstm", dict(bidirectional=True)), ("lstm", dict(proj_size=9)), ("gru", dict(bidirectional=True))],
    ids=["lstm-bidir", "lstm-proj", "gru-bidir"],
)
def test_spread_engine_gathered_gates(cell, options, unit, monkeypatch, poison):
    """The spread engine's forward with the gates of ``unit`` hidden units gathered into one
    product (``GATHER``; a GRU's fourth gate zeros): H = 20 in tiles of 4, 8 or 16 (the GPU's),
    the last one partial; the backward as before."""
    cfg = {"BLOCK_B": 16, "BLOCK_H": unit, "BLOCK_P": 16, "BLOCK_K": 16, "SPLIT": 1, "GATHER": True,
           "num_warps": 4}  # fmt: skip
    real = R.engines.PersistentSpreadEngine.configs
    monkeypatch.setattr(
        R.engines.PersistentSpreadEngine, "configs", lambda self, p: real(self, p) if p.backward else [cfg]
    )
    monkeypatch.setattr(R, "_plans", {})
    m = _module(cell, 6, 20, **options)
    _check(cell, m, torch.randn(4, 5, 6), _states(cell, m, 5, torch.float32), algo="persistent-spread",
           what=f"gathered {unit}")  # fmt: skip


@pytest.mark.parametrize(
    "unit, owned", [(8, True), (16, True), (16, False)], ids=["owned-8", "owned-16", "two-phase"]
)
@pytest.mark.parametrize("cell", ["lstm", "gru"])
@pytest.mark.parametrize("lengths", [None, [2, 5, 3]], ids=["full", "lengths"])
def test_spread_engine_backward_kernels(cell, unit, owned, lengths, monkeypatch, poison):
    """The spread engine's two backward kernels for a gated cell without projection: one phase a
    step (``OWNED``, the fp32 default: a program's unit tiles pass their share of the state
    gradient, ``da @ W_hh`` over the tiles' gathered gate rows, through a buffer the next step's
    owners add up; tiles of 8, three shares, the last one partial, or 16) and two (the 16-bit
    default); bidirectional, H = 20, sequences of their own lengths (stopped ones pass their
    gradient on as is)."""
    cfg = {"BLOCK_B": 16, "BLOCK_H": unit, "BLOCK_P": 16, "BLOCK_K": 16, "SPLIT": 1, "OWNED": owned,
           "num_warps": 4}  # fmt: skip
    real = R.engines.PersistentSpreadEngine.configs
    monkeypatch.setattr(
        R.engines.PersistentSpreadEngine, "configs", lambda self, p: [cfg] if p.backward else real(self, p)
    )
    monkeypatch.setattr(R, "_plans", {})
    m = _module(cell, 3, 20, bidirectional=True)
    x = torch.randn(5, 3, 3)
    kw = {} if lengths is None else dict(lengths=torch.tensor(lengths), enforce_sorted=False)
    hx = _states(cell, m, 3, torch.float32)
    _check(cell, m, x, hx, algo="persistent-spread", what=f"owned {owned} {unit}", **kw)


@pytest.mark.parametrize("algo", ENGINES)
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_inference_double_buffer(cell, algo, poison):
    """Without autograd the state goes through a two-slot buffer (and a one-row scratch for the
    projection): values as the float64 module's, for every engine."""
    m = _module(cell, 4, 20, bidirectional=True, **(dict(proj_size=5) if cell == "lstm" else {}))
    x = torch.randn(5, 3, 4)
    hx = _states(cell, m, 3, torch.float32)
    with torch.no_grad():
        ref = _run_torch_outputs(m, x, hx)
        got, _ = _run_ours(cell, m, x, hx, torch.float32, [], grad=False, algo=algo)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert_close(a.cpu(), b, None, f"{algo} output {i}")


@pytest.mark.parametrize("proj_size", [0, 5])
@pytest.mark.parametrize("algo", ENGINES)
def test_padded_with_lengths(algo, proj_size, poison):
    """Unsorted lengths (enforce_sorted=False): outputs zero past each length, final states at
    each sequence's own end, the reverse direction starting there; as torch on packed input."""
    hidden = 20 if algo != "persistent" else 7
    m = _module("lstm", 3, hidden, bidirectional=True, proj_size=proj_size)
    x = torch.randn(5, 3, 3)
    lengths = torch.tensor([2, 5, 3])
    _check("lstm", m, x, _states("lstm", m, 3, torch.float32), lengths=lengths, enforce_sorted=False,
           algo=algo, what=algo)  # fmt: skip


@pytest.mark.parametrize("cell", ["gru", "rnn_tanh"])
def test_packed_sequence(cell, poison):
    """PackedSequence in, PackedSequence out (same batch_sizes and indices), h_n in input order."""
    m = _module(cell, 3, 6, num_layers=2, batch_first=True, bidirectional=cell == "gru")
    x = torch.randn(3, 4, 3)
    lengths = torch.tensor([3, 4, 1])
    _check(cell, m, x, _states(cell, m, 3, torch.float32), lengths=lengths, enforce_sorted=False, packed=True,
           what="packed")  # fmt: skip
    packed = pack_padded_sequence(x.to(DEVICE), lengths, True, False)
    out, _ = FUNCS[cell](packed, None, [w.detach().float().to(DEVICE) for w in m._flat_weights], True, 2,
                         batch_first=True, bidirectional=cell == "gru")  # fmt: skip
    assert isinstance(out, torch.nn.utils.rnn.PackedSequence)
    assert torch.equal(out.batch_sizes, packed.batch_sizes)
    assert torch.equal(out.unsorted_indices, packed.unsorted_indices)


def test_unbatched_input():
    m = _module("lstm", 4, 6)
    x = torch.randn(3, 4)
    _check("lstm", m, x, _states("lstm", m, 1, torch.float32, unbatched=True), what="unbatched")


def test_without_gradients_needed_for_some_inputs():
    """Only the input requires grad: weight gradients are skipped, the input's still right."""
    m = _module("gru", 3, 5)
    x = torch.randn(4, 2, 3)
    ws = [w.detach().float().to(DEVICE) for w in m._flat_weights]
    xg = x.to(DEVICE).requires_grad_()
    out, _ = R.gru(xg, None, ws)
    dy = torch.randn_like(out)
    (dx,) = torch.autograd.grad(out, xg, dy)
    xr = x.double().requires_grad_()
    ref, _ = m(xr)
    (dxr,) = torch.autograd.grad(ref, xr, dy.double().cpu())
    assert_close(dx.cpu(), dxr, None, "dx")


# ---------------------------------------------------------------------------------------------
# Dropout between layers (training).


def _dropout_reference(m, x, seed, p):
    """tdnn.lstm's dropout in float64: the Philox keep-masks of the layer inputs it documents."""
    directions = 2 if m.bidirectional else 1
    shape = (x.shape[0], x.shape[1], directions * (m.proj_size or m.hidden_size))
    per_mask = counters_used(shape[0] * shape[1] * shape[2])
    masks = [
        dropout_mask_reference(shape, p, seed, (layer - 1) * per_mask) for layer in range(1, m.num_layers)
    ]
    weights = [w.double().requires_grad_() for w in m._flat_weights]
    xd = x.double().requires_grad_()
    out, hn, cn = R.rnn_reference("lstm", xd, None, None, weights, bias=True, num_layers=m.num_layers,
                                  bidirectional=m.bidirectional, dropout=p, dropout_masks=masks)  # fmt: skip
    return out, hn, cn, [xd, *weights], masks


def test_dropout_between_layers_with_a_seed():
    p, seed = 0.4, 1234
    m = _module("lstm", 4, 6, num_layers=3, dropout=p).train()
    x = torch.randn(4, 3, 4)
    out_ref, hn_ref, cn_ref, leaves, masks = _dropout_reference(m, x, seed, p)
    assert 0 < sum(int((~mk).sum()) for mk in masks) < sum(mk.numel() for mk in masks)  # masks drop some
    dys = [torch.randn_like(t) for t in (out_ref, hn_ref, cn_ref)]
    dref = torch.autograd.grad((out_ref, hn_ref, cn_ref), leaves, dys)
    got, dgot = _run_ours("lstm", m, x, None, torch.float32, dys, seed=seed)
    for a, b in zip(got, (out_ref, hn_ref, cn_ref)):
        assert_close(a.cpu(), b.detach(), None, "dropout output")
    for a, b in zip([dgot[0], *dgot[1:]], dref):
        assert_close(a.cpu(), b, None, "dropout gradient")
    # training=False: no dropout at all, as the module in eval mode.
    _check("lstm", m.eval(), x, None, what="eval")


def test_dropout_draws_from_torch_generator():
    m = _module("gru", 3, 5, num_layers=2, dropout=0.5).train()
    x = torch.randn(3, 2, 3)
    ws = [w.detach().float().to(DEVICE) for w in m._flat_weights]
    torch.manual_seed(7)
    a, _ = R.gru(x.to(DEVICE), None, ws, True, 2, 0.5, True)
    torch.manual_seed(7)
    b, _ = R.gru(x.to(DEVICE), None, ws, True, 2, 0.5, True)
    c, _ = R.gru(x.to(DEVICE), None, ws, True, 2, 0.5, True)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


# ---------------------------------------------------------------------------------------------
# Low precision.


def test_fp16(poison):
    m = _module("lstm", 5, 8, torch.float16, num_layers=2)
    _check("lstm", m, torch.randn(4, 3, 5).half().float(), None, torch.float16, what="fp16")


@pytest.mark.parametrize("algo", ["persistent", "per-step"])
def test_fp64(algo):
    m = _module("gru", 5, 8 if algo == "persistent" else 20, torch.float64, bidirectional=True)
    _check(
        "gru",
        m,
        torch.randn(4, 3, 5),
        _states("gru", m, 3, torch.float64),
        torch.float64,
        algo=algo,
        what="fp64",
    )


@pytest.mark.gpu_only("Triton's interpreter computes bf16 tl.dot wrongly")
@pytest.mark.parametrize("algo", ENGINES)
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_bf16(cell, algo):
    m = _module(cell, 24, 40, torch.bfloat16, bidirectional=True)
    x = torch.randn(12, 8, 24).bfloat16().float()
    algo = algo if algo != "persistent" else None
    _check(cell, m, x, _states(cell, m, 8, torch.bfloat16), torch.bfloat16, algo=algo, what="bf16")


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_autocast_as_torch(cell, packed):
    """Under autocast, the output dtype is torch's (CUDA: fp16, as cuDNN's RNNs, for padded and
    packed input alike; CPU: an LSTM in the autocast dtype, GRU and RNN in fp32), and the
    recurrence never sees mixed dtypes (an input projection cast by autocast, the recurrent
    weights not). Torch's CPU autocast casts ``lstm.input`` but not ``lstm.data`` (a
    packed input stays fp32), and so does ours."""
    m = _module(cell, 3, 5).float().to(DEVICE)
    x = torch.randn(4, 2, 3, device=DEVICE)
    inp = pack_padded_sequence(x, [4, 3]) if packed else x
    ws = [w.detach() for w in m._flat_weights]
    with torch.no_grad():
        full = _flat(*m(inp))
        with torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16):
            theirs = _flat(*torch_or_skip(lambda: m(inp)))
            ours = _flat(*FUNCS[cell](inp, None, ws))
    for a, b, c in zip(ours, theirs, full):
        assert a.dtype == b.dtype, (a.dtype, b.dtype)
        assert (a.float() - c).abs().max() < 0.05


def test_traces_in_one_graph():
    """torch.compile(fullgraph=True) of a two-layer bidirectional LSTM, forward and backward
    (aot_eager: the ops' fake shapes, then the real ops): no graph break from the input
    projection's or the recurrence's autograd; results as eager."""
    torch._dynamo.reset()
    m = _module("lstm", 3, 5, num_layers=2, bidirectional=True).float().to(DEVICE)
    x = torch.randn(4, 2, 3, device=DEVICE)
    runs = []
    for compiled in (False, True):
        ws = [w.detach().clone().requires_grad_() for w in m._flat_weights]
        f = lambda x, ws: R.lstm(x, None, ws, num_layers=2, bidirectional=True)[0]
        y = (torch.compile(f, backend="aot_eager", fullgraph=True) if compiled else f)(x, ws)
        y.square().sum().backward()
        runs.append([y, *(w.grad for w in ws)])
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Realistic sizes on a GPU.


@pytest.mark.gpu_only("realistic sizes take minutes under the interpreter")
@pytest.mark.parametrize("algo", [None, *ENGINES[1:]])
@pytest.mark.parametrize(
    "cell, hidden, options",
    [("lstm", 256, dict(num_layers=2)), ("gru", 384, dict(bidirectional=True)),
     ("lstm", 64, dict(bidirectional=True, proj_size=32)), ("rnn_tanh", 512, {})],
)  # fmt: skip
def test_realistic_sizes(cell, hidden, options, algo):
    m = _module(cell, 128, hidden, **options)
    lengths = torch.randint(20, 65, (48,)).sort(descending=True).values
    lengths[0] = 64
    _check(cell, m, torch.randn(64, 48, 128), None, lengths=lengths, algo=algo, what=f"{cell} {algo}")


@pytest.mark.gpu_only("the resident kernel at a realistic small size")
def test_resident_engine_realistic():
    m = _module("lstm", 64, 64, num_layers=2, bidirectional=True)
    _check("lstm", m, torch.randn(128, 64, 64), _states("lstm", m, 64, torch.float32), algo="persistent")


# ---------------------------------------------------------------------------------------------
# Engines and their reasons.


def test_engine_reports_and_forced_engines():
    x = torch.empty(8, 4, 16, device=DEVICE)
    small = {r.name: r for r in tdnn.engines("rnn", x, 32, "lstm")}
    assert small["persistent"].supported and small["persistent"].chosen
    big = {r.name: r for r in tdnn.engines("rnn", x, 1024, "lstm")}
    assert not big["persistent"].supported
    assert "exceed" in big["persistent"].reasons[0]
    assert big["per-step"].supported and big["persistent-tiled"].supported
    assert sum(r.chosen for r in big.values()) == 1
    m = _module("gru", 16, 200)
    ws = [w.detach().float().to(DEVICE) for w in m._flat_weights]
    with pytest.raises(tdnn.NotSupportedError, match="persistent"):
        R.gru(x, None, ws, algo="persistent")
    with pytest.raises(ValueError, match="algo"):
        R.gru(x, None, ws, algo="winograd")


def test_engines_refuse_int32_offset_overflow():
    """The kernels index the weights (D * G * P elements) and the state slots' rows (D * NS * B)
    in int32 (activations in int64): a problem past 2**31 there gets a reason from every engine,
    never a launch that would wrap around. 4 * 23200 * 23200 > 2**31."""
    x = torch.empty(8, 4, 16, device=DEVICE)
    reports = {r.name: r for r in tdnn.engines("rnn", x, 23200, "lstm")}
    assert not any(r.supported for r in reports.values())
    for name in ("persistent-tiled", "per-step"):
        assert any("2**31" in reason for reason in reports[name].reasons), reports[name].reasons
    # Just below the limit (4 * 23170**2 < 2**31) the streaming engines still run it.
    reports = {r.name: r for r in tdnn.engines("rnn", x, 23170, "lstm")}
    assert reports["per-step"].supported and reports["persistent-tiled"].supported
    # Many rows of states: D * (T + 1) * B past 2**31 when saving for the backward pass.
    p = R.RNNProblem("gru", True, True, "float16", 2**20, 2**11, 8, 8, 1, True, False, False)
    assert all(engine.not_supported_reasons(p) for engine in R.FAMILY.engines)


def test_cost_model_prefers_resident_then_spread(monkeypatch):
    monkeypatch.setattr(R.engines, "sm_count", lambda: 132)  # an H100's: the model's GPU class

    def best(hidden, batch, dtype=torch.bfloat16):
        x = torch.empty(256, batch, 512, device=DEVICE, dtype=dtype)
        return next(r.name for r in tdnn.engines("rnn", x, hidden, "lstm") if r.chosen)

    # Small H: the weights held in one program's registers for the whole sequence; large H:
    # weight slices spread over the multiprocessors (H100 forward recurrence, spread against
    # per-step launches: bf16 H512 B64 1.7 / 2.5 ms, fp32 4.0 / 7.6; H1024 B32 bf16 1.1 / 1.9,
    # fp32 3.4 / 6.8).
    assert best(32, 64) == "persistent"
    for dtype in (torch.bfloat16, torch.float32):
        assert best(512, 64, dtype) == "persistent-spread"
        assert best(1024, 32, dtype) == "persistent-spread"


# ---------------------------------------------------------------------------------------------
# Bad input: PyTorch's error types and messages.


def _weights(cell="lstm", input_size=4, hidden=6, **kw):
    m = _module(cell, input_size, hidden, **kw)
    return m, [w.detach().float().to(DEVICE) for w in m._flat_weights]


def test_error_input_size():
    _, ws = _weights()
    with pytest.raises(
        RuntimeError, match=r"input.size\(-1\) must be equal to input_size. Expected 4, got 5"
    ):
        R.lstm(torch.randn(3, 2, 5, device=DEVICE), None, ws)
    with pytest.raises(ValueError, match="LSTM: Expected input to be 2D or 3D, got 4D instead"):
        R.lstm(torch.randn(3, 2, 1, 4, device=DEVICE), None, ws)
    with pytest.raises(ValueError, match="expected 4 weight tensors"):
        R.lstm(torch.randn(3, 2, 4, device=DEVICE), None, ws[:3])
    with pytest.raises(ValueError, match="does not match weight dtype"):
        R.lstm(torch.randn(3, 2, 4, device=DEVICE).double(), None, ws)
    with pytest.raises(TypeError, match="dtype torch.int64"):
        R.lstm(torch.ones(3, 2, 4, device=DEVICE, dtype=torch.int64), None, ws)


def test_error_hidden_shapes():
    _, ws = _weights()
    x = torch.randn(3, 2, 4, device=DEVICE)
    h, c = torch.zeros(1, 2, 6, device=DEVICE), torch.zeros(1, 2, 6, device=DEVICE)
    with pytest.raises(RuntimeError, match=r"Expected hidden\[0\] size \(1, 2, 6\), got \[1, 3, 6\]"):
        R.lstm(x, (torch.zeros(1, 3, 6, device=DEVICE), c), ws)
    with pytest.raises(RuntimeError, match=r"Expected hidden\[1\] size \(1, 2, 6\), got \[2, 2, 6\]"):
        R.lstm(x, (h, torch.zeros(2, 2, 6, device=DEVICE)), ws)
    with pytest.raises(RuntimeError, match="For batched 3-D input, hx and cx should also be 3-D"):
        R.lstm(x, (h[0], c), ws)
    _, gws = _weights("gru")
    with pytest.raises(RuntimeError, match=r"Expected hidden size \(1, 2, 6\), got \[1, 2, 5\]"):
        R.gru(x, torch.zeros(1, 2, 5, device=DEVICE), gws)
    with pytest.raises(RuntimeError, match="For unbatched 2-D input, hx should also be 2-D"):
        R.gru(x[:, 0], h, gws)


def test_error_lengths():
    _, ws = _weights()
    x = torch.randn(3, 3, 4, device=DEVICE)
    with pytest.raises(
        RuntimeError, match="must be sorted in decreasing order when `enforce_sorted` is True"
    ):
        R.lstm(x, None, ws, lengths=[2, 3, 1])
    with pytest.raises(ValueError, match="max sequence length being 4"):
        R.lstm(x, None, ws, lengths=[4, 3, 1])
    with pytest.raises(RuntimeError, match="Length of all samples has to be greater than 0"):
        R.lstm(x, None, ws, lengths=[3, 0, 1], enforce_sorted=False)
    with pytest.raises(RuntimeError, match=r"Expected `len\(lengths\)` to be equal to batch_size"):
        R.lstm(x, None, ws, lengths=[3, 2])
    with pytest.raises(RuntimeError, match="Expected sequence length to be larger than 0"):
        R.lstm(x[:0], None, ws)


def test_error_options():
    _, ws = _weights(proj_size=2)
    x = torch.randn(3, 2, 4, device=DEVICE)
    with pytest.raises(ValueError, match="proj_size has to be smaller than hidden_size"):
        R.lstm(x, None, ws, proj_size=6)
    with pytest.raises(ValueError, match="proj_size should be a positive integer or zero"):
        R.lstm(x, None, ws, proj_size=-1)
    with pytest.raises(ValueError, match="has shape"):
        R.lstm(x, None, ws, proj_size=3)  # w_hr and w_hh do not fit 3
    with pytest.raises(ValueError, match="dropout should be a number in range"):
        R.lstm(x, None, ws, True, 1, 1.5, proj_size=2)
    with pytest.raises(ValueError, match="num_layers must be greater than zero"):
        R.lstm(x, None, ws, True, 0, proj_size=2)
    _, rws = _weights("rnn_tanh")
    with pytest.raises(ValueError, match="Unknown nonlinearity 'gelu'"):
        R.rnn(x, None, rws, nonlinearity="gelu")
    out, _ = R.lstm(x, None, ws, proj_size=2)
    assert out.shape == (3, 2, 2)


def test_empty_batch():
    _, ws = _weights("gru")
    out, h = R.gru(torch.randn(3, 0, 4, device=DEVICE), None, ws)
    assert out.shape == (3, 0, 6) and h.shape == (1, 0, 6)


@pytest.mark.skipif(ON_GPU, reason="checks the CPU backend's device rule")
def test_error_input_on_another_device():
    _, ws = _weights()
    with pytest.raises(ValueError, match="device"):
        R.lstm(torch.randn(3, 2, 4, device="meta"), None, ws)


def test_error_weights_on_another_device():
    """The input on the backend's device, one weight elsewhere: the weight is named."""
    _, ws = _weights(num_layers=2)
    ws[5] = ws[5].to("meta")  # w_hh of layer 1
    with pytest.raises(ValueError, match="weight 'weight_hh_l1' is on meta"):
        R.lstm(torch.randn(3, 2, 4, device=DEVICE), None, ws, True, 2)
