"""tdnn.nn layers: each against its torch.nn class — outputs, every gradient (input and
parameters) against a float64 copy, buffers, state_dict and repr."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import tritondnn as tdnn
import tritondnn.nn as tnn
from helpers import DEVICE, assert_close, randn
from tritondnn.core.errors import NotSupportedError
from tritondnn.nn.containers import _fusable_activation


def _as_ours(module: nn.Module) -> nn.Module:
    """A tritondnn module with ``module``'s constructor state, built through state_dict as a user
    loading a checkpoint would."""
    ours = type(module).__new__(tnn.SUPPORTED[type(module)])
    ours.__dict__ = copy.deepcopy(module).__dict__  # the constructor's state, torch's class swapped
    ours.load_state_dict(module.state_dict())
    return ours


def _run(module: nn.Module, x: torch.Tensor, dy_seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    x = x.detach().requires_grad_(True)
    out = module(x)
    out = out[0] if isinstance(out, tuple) else out
    gen = torch.Generator(device="cpu").manual_seed(dy_seed)
    dy = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(device=out.device, dtype=out.dtype)
    leaves = [x, *(p for p in module.parameters() if p.requires_grad)]
    grads = torch.autograd.grad(out, leaves, dy, allow_unused=True)
    return out.detach(), [g if g is not None else torch.zeros_like(t) for g, t in zip(grads, leaves)]


def _check(module: nn.Module, x: torch.Tensor, what: str, train: bool = True) -> None:
    """``module`` (torch's) vs its tritondnn class on the same weights, with a float64 copy as the
    reference; buffers (running statistics) compared after the step."""
    module = module.to(DEVICE).train(train)
    ours = _as_ours(module)
    assert type(ours).__name__ == type(module).__name__ and repr(ours) == repr(module)
    assert list(ours.state_dict()) == list(module.state_dict())
    wide = copy.deepcopy(module).double()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="tritondnn falls back")  # tritondnn's path, not torch's
        got, dgot = _run(ours, x, 1)
    same, dsame = _run(module, x, 1)
    ref, dref = _run(wide, x.double(), 1)
    assert_close(got, ref, same, f"{what} output")
    for i, (a, b, c) in enumerate(zip(dgot, dref, dsame)):
        assert_close(a, b, c, f"{what} gradient {i}")
    for (name, a), b, c in zip(ours.named_buffers(), wide.buffers(), module.buffers()):
        if a.is_floating_point():
            assert_close(a, b, c, f"{what} buffer {name}")
        else:
            assert torch.equal(a, c), f"{what} buffer {name}"


CASES = {
    "Conv1d": (lambda: nn.Conv1d(3, 4, 3, padding=1), (2, 3, 7)),
    "Conv1d circular": (lambda: nn.Conv1d(3, 4, 3, padding=1, padding_mode="circular"), (2, 3, 7)),
    "Conv2d": (lambda: nn.Conv2d(2, 3, 3, stride=2, padding=1), (2, 2, 5, 6)),
    "Conv2d unbatched": (lambda: nn.Conv2d(2, 3, 2, bias=False), (2, 4, 5)),
    "Conv2d same": (lambda: nn.Conv2d(2, 2, 3, padding="same", groups=2), (1, 2, 5, 5)),
    "Conv3d": (lambda: nn.Conv3d(2, 2, 2), (1, 2, 3, 4, 3)),
    "ConvTranspose1d": (lambda: nn.ConvTranspose1d(3, 2, 3, stride=2), (2, 3, 5)),
    "ConvTranspose2d": (
        lambda: nn.ConvTranspose2d(2, 3, 3, stride=2, padding=1, output_padding=1),
        (1, 2, 4, 3),
    ),
    "ConvTranspose3d": (lambda: nn.ConvTranspose3d(2, 2, 2), (1, 2, 2, 3, 2)),
    "Linear": (lambda: nn.Linear(12, 7), (3, 5, 12)),
    "Linear no bias": (lambda: nn.Linear(9, 4, bias=False), (9,)),
    "BatchNorm1d": (lambda: nn.BatchNorm1d(5), (6, 5)),
    "BatchNorm1d momentum None": (lambda: nn.BatchNorm1d(3, momentum=None), (4, 3, 5)),
    "BatchNorm2d": (lambda: nn.BatchNorm2d(3), (2, 3, 4, 5)),
    "BatchNorm2d no stats": (
        lambda: nn.BatchNorm2d(3, track_running_stats=False, affine=False),
        (2, 3, 3, 3),
    ),
    "BatchNorm3d": (lambda: nn.BatchNorm3d(2), (2, 2, 3, 2, 3)),
    "InstanceNorm1d": (lambda: nn.InstanceNorm1d(3, affine=True), (2, 3, 7)),
    "InstanceNorm2d stats": (lambda: nn.InstanceNorm2d(3, track_running_stats=True), (2, 3, 4, 4)),
    "InstanceNorm2d unbatched": (lambda: nn.InstanceNorm2d(3), (3, 4, 5)),
    "InstanceNorm3d": (lambda: nn.InstanceNorm3d(2, affine=True), (1, 2, 3, 3, 3)),
    "LayerNorm": (lambda: nn.LayerNorm((4, 6)), (3, 4, 6)),
    "LayerNorm no bias": (lambda: nn.LayerNorm(8, bias=False), (5, 8)),
    "RMSNorm": (lambda: nn.RMSNorm(8, eps=1e-6), (3, 8)),
    "GroupNorm": (lambda: nn.GroupNorm(2, 4), (2, 4, 3, 5)),
    "LocalResponseNorm": (lambda: nn.LocalResponseNorm(3), (2, 5, 3, 3)),
    "MaxPool1d": (lambda: nn.MaxPool1d(3, 2, 1), (2, 3, 9)),
    "MaxPool2d": (lambda: nn.MaxPool2d(2, ceil_mode=True), (2, 3, 5, 5)),
    "MaxPool2d indices": (lambda: nn.MaxPool2d(3, 2, 1, return_indices=True), (1, 2, 6, 6)),
    "MaxPool3d": (lambda: nn.MaxPool3d(2), (1, 2, 4, 4, 4)),
    "AvgPool1d": (lambda: nn.AvgPool1d(3, 2, 1, count_include_pad=False), (2, 3, 8)),
    "AvgPool2d": (lambda: nn.AvgPool2d(3, 2, 1, divisor_override=4), (2, 2, 6, 5)),
    "AvgPool3d": (lambda: nn.AvgPool3d(2), (1, 2, 4, 4, 2)),
    "AdaptiveAvgPool1d": (lambda: nn.AdaptiveAvgPool1d(3), (2, 3, 7)),
    "AdaptiveAvgPool2d": (lambda: nn.AdaptiveAvgPool2d((2, None)), (2, 3, 5, 4)),
    "AdaptiveAvgPool3d": (lambda: nn.AdaptiveAvgPool3d(2), (1, 2, 3, 4, 5)),
    "AdaptiveMaxPool1d": (lambda: nn.AdaptiveMaxPool1d(3), (2, 3, 7)),
    "AdaptiveMaxPool2d": (lambda: nn.AdaptiveMaxPool2d(2, return_indices=True), (2, 3, 5, 4)),
    "AdaptiveMaxPool3d": (lambda: nn.AdaptiveMaxPool3d(2), (1, 2, 3, 4, 5)),
    "Upsample nearest": (lambda: nn.Upsample(scale_factor=2), (1, 2, 3, 4)),
    "Upsample bilinear": (
        lambda: nn.Upsample(size=(5, 7), mode="bilinear", align_corners=True),
        (1, 2, 3, 4),
    ),
    "ReLU": (lambda: nn.ReLU(), (4, 9)),
    "LeakyReLU": (lambda: nn.LeakyReLU(0.2), (4, 9)),
    "GELU tanh": (lambda: nn.GELU("tanh"), (4, 9)),
    "SiLU": (lambda: nn.SiLU(), (4, 9)),
    "Sigmoid": (lambda: nn.Sigmoid(), (4, 9)),
    "Tanh": (lambda: nn.Tanh(), (4, 9)),
    "ELU": (lambda: nn.ELU(0.5), (4, 9)),
    "Softplus": (lambda: nn.Softplus(2.0, 5.0), (4, 9)),
    "Softmax": (lambda: nn.Softmax(dim=1), (3, 5, 4)),
    "LogSoftmax": (lambda: nn.LogSoftmax(dim=-1), (3, 7)),
    "Dropout eval": (lambda: nn.Dropout(0.3), (4, 9)),
    "Sequential": (lambda: nn.Sequential(nn.Linear(9, 6), nn.Tanh()), (4, 9)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_layer_matches_torch(name):
    make, shape = CASES[name]
    torch.manual_seed(0)  # the same weights for every engine's run of this case
    module = make()
    _check(module, randn(*shape), name, train="eval" not in name)


@pytest.mark.parametrize(
    "kwargs", [{}, {"reduction": "none", "ignore_index": 1}, {"label_smoothing": 0.1, "weight": True}]
)
def test_cross_entropy_loss_matches_torch(kwargs):
    """CrossEntropyLoss (two inputs, a weight buffer): loss and logits' gradient against torch's
    and a float64 copy; the same state_dict and repr."""
    torch.manual_seed(0)
    weight = torch.rand(7) + 0.5 if kwargs.pop("weight", False) else None
    module = nn.CrossEntropyLoss(weight, **kwargs).to(DEVICE)
    ours = _as_ours(module)
    assert repr(ours) == repr(module) and list(ours.state_dict()) == list(module.state_dict())
    x, target = randn(9, 7, 2, scale=2.0), torch.randint(0, 7, (9, 2), device=DEVICE)
    results = []
    for loss_fn, logits in ((ours, x), (module, x), (copy.deepcopy(module).double(), x.double())):
        leaf = logits.detach().requires_grad_(True)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="tritondnn falls back")
            out = loss_fn(leaf, target)
        (grad,) = torch.autograd.grad(out, leaf, torch.ones_like(out))
        results.append((out.detach(), grad))
    (got, dgot), (same, dsame), (ref, dref) = results
    assert_close(got, ref, same, "CrossEntropyLoss loss")
    assert_close(dgot, dref, dsame, "CrossEntropyLoss gradient")


@pytest.mark.parametrize("padding_idx", [None, 2])
def test_embedding_matches_torch(padding_idx):
    """Embedding (integer input): lookups equal torch's, the weight gradient against torch's and
    a float64 copy; the same state_dict and repr."""
    torch.manual_seed(0)
    module = nn.Embedding(20, 6, padding_idx=padding_idx).to(DEVICE)
    ours = _as_ours(module)
    assert repr(ours) == repr(module) and list(ours.state_dict()) == list(module.state_dict())
    idx = torch.randint(0, 7, (4, 5), device=DEVICE)
    dy = randn(4, 5, 6)
    results = []
    for layer in (ours, module, copy.deepcopy(module).double()):
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="tritondnn falls back")
            out = layer(idx)
        (grad,) = torch.autograd.grad(out, layer.weight, dy.to(out.dtype))
        results.append((out.detach(), grad))
    (got, dgot), (same, dsame), (ref, dref) = results
    assert torch.equal(got, same) and torch.equal(got.double(), ref)
    assert_close(dgot, dref, dsame, "Embedding weight gradient")


def test_every_supported_class_is_tested():
    tested = {type(make()).__name__ for make, _ in CASES.values()}
    covered = tested | {
        "MultiheadAttention",
        "Dropout",
        "SyncBatchNorm",
        "LSTM",
        "GRU",
        "RNN",
        "CrossEntropyLoss",
        "Embedding",
    }
    missing = {cls.__name__ for cls in tnn.SUPPORTED} - covered
    assert not missing, f"tdnn.nn classes without a test: {sorted(missing)}"
    unexported = [
        cls.__name__ for cls in tnn.SUPPORTED.values() if getattr(tnn, cls.__name__, None) is not cls
    ]
    assert not unexported, f"tdnn.nn classes not exported: {unexported}"


def test_dropout_trains_with_tritondnn_masks():
    """Training-mode dropout: zeros or x / (1 - p), the kept fraction near 1 - p, the gradient
    through the same mask."""
    drop = tnn.Dropout(0.25)
    x = randn(64, 64).abs() + 0.5
    x.requires_grad_(True)
    y = drop(x)
    kept = y != 0
    assert torch.allclose(y[kept], x[kept] / 0.75)
    assert abs(kept.float().mean().item() - 0.75) < 0.05
    (g,) = torch.autograd.grad(y, x, torch.ones_like(y))
    assert torch.equal(g != 0, kept)


def test_batch_norm_running_statistics_over_steps():
    """num_batches_tracked and a cumulative average (momentum None) over three steps, then eval."""
    torch.manual_seed(0)
    theirs = nn.BatchNorm2d(3, momentum=None).to(DEVICE)
    ours = _as_ours(theirs)
    for _ in range(3):
        x = randn(2, 3, 4, 4) * 3 + 1
        ours(x), theirs(x)
    assert ours.num_batches_tracked.item() == theirs.num_batches_tracked.item() == 3
    torch.testing.assert_close(ours.running_mean, theirs.running_mean)
    torch.testing.assert_close(ours.running_var, theirs.running_var)
    x = randn(2, 3, 4, 4)
    torch.testing.assert_close(ours.eval()(x), theirs.eval()(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_batch_norm_training_steps_then_eval(dtype, momentum):
    """Repeated steps of one shape (the functional op's cached path after the first): each step's
    output and gradients against a float64 copy, the buffers after each; then eval steps, with
    gradients still flowing to the input and the parameters."""
    torch.manual_seed(0)
    theirs = nn.BatchNorm2d(6, momentum=momentum).to(DEVICE)
    ours = _as_ours(theirs)
    wide = copy.deepcopy(theirs).double()
    for step in range(4):
        if step == 3:
            for m in (ours, theirs, wide):
                m.eval()
        x = (randn(3, 6, 4, 5) * 3 + 1).to(dtype=dtype, memory_format=torch.channels_last)
        got, dgot = _run(ours, x, step)
        same, dsame = _run(theirs, x, step)
        ref, dref = _run(wide, x.double(), step)
        assert got.stride() == x.stride()
        assert_close(got, ref, same, f"step {step} output")
        for i, (a, b, c) in enumerate(zip(dgot, dref, dsame)):
            assert_close(a, b, c, f"step {step} gradient {i}")
        for name in ("running_mean", "running_var"):
            a, b, c = (getattr(m, name) for m in (ours, wide, theirs))
            assert_close(a, b, c, f"step {step} {name}")
        assert ours.num_batches_tracked.item() == theirs.num_batches_tracked.item() == min(step + 1, 3)


def test_batch_norm_parametrized_or_replaced_weight():
    """A parametrization (a property on the module's class) and a weight deleted then set as a
    plain attribute: the module reads them as attributes, as torch's forward does."""
    import torch.nn.utils.parametrize as parametrize

    class Double(nn.Module):
        def forward(self, w):
            return 2 * w

    torch.manual_seed(0)
    theirs = nn.BatchNorm2d(3).to(DEVICE)
    ours = _as_ours(theirs)
    for m in (theirs, ours):
        parametrize.register_parametrization(m, "weight", Double())
    x = randn(2, 3, 4, 4)
    for _ in range(2):
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)
    for m in (theirs, ours):
        parametrize.remove_parametrizations(m, "weight")
        del m.bias
        m.bias = torch.full((3,), 5.0, device=DEVICE)
    for _ in range(2):
        y = ours(x)
        torch.testing.assert_close(y, theirs(x), rtol=1e-5, atol=1e-5)
    assert abs(y.mean().item() - 5.0) < 1e-4


def test_relu_in_place_steps():
    """ReLU(inplace=True) called step after step on one shape: it writes into its input and
    returns it, and the gradient is torch's."""
    relu = tnn.ReLU(inplace=True)
    for _ in range(3):
        leaf = randn(2, 5, 3, 3).to(memory_format=torch.channels_last).requires_grad_(True)
        dy = randn(2, 5, 3, 3)
        h = leaf * 1.0
        y = relu(h)
        assert y is h
        (dx,) = torch.autograd.grad(y, leaf, dy)
        torch.testing.assert_close(y.detach(), torch.relu(leaf.detach()))
        torch.testing.assert_close(dx, dy * (leaf.detach() > 0))


def test_unsupported_problem_falls_back_to_torch(monkeypatch):
    """An engine-less problem runs torch's forward with a warning, once per reason."""

    def decline(*args, **kwargs):
        raise NotSupportedError("layer_norm", "test-problem", {"test-engine": ["declines"]})

    monkeypatch.setattr(tdnn.ops.norm, "layer_norm", decline)
    ln = tnn.LayerNorm(6).to(DEVICE)
    x = randn(2, 6)
    with pytest.warns(UserWarning, match="falls back to torch"):
        y = ln(x)
    torch.testing.assert_close(y, nn.LayerNorm.forward(ln, x))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ln(x)  # the same reason again: no second warning


def test_constructors_and_state_dict_interchange():
    """The constructor is torch's: a tritondnn module loads a torch state_dict and back."""
    torch.manual_seed(0)
    theirs = nn.Conv2d(3, 4, 3, padding=1, bias=True)
    ours = tnn.Conv2d(3, 4, 3, padding=1, bias=True)
    ours.load_state_dict(theirs.state_dict())
    back = nn.Conv2d(3, 4, 3, padding=1)
    back.load_state_dict(ours.state_dict())
    assert torch.equal(back.weight, theirs.weight) and isinstance(ours, nn.Conv2d)


def _quiet(module: nn.Module, x: torch.Tensor):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="tritondnn falls back")
        return module(x)


@pytest.mark.parametrize(
    "make, shape, error",
    [
        (lambda: nn.LayerNorm(5), (3, 4), RuntimeError),
        (lambda: nn.GroupNorm(2, 4), (3, 6, 2), RuntimeError),
        (lambda: nn.Linear(3, 2), (4, 4), RuntimeError),
        (lambda: nn.Conv2d(2, 3, 3), (1, 3, 5, 5), RuntimeError),
        (lambda: nn.InstanceNorm2d(3), (2, 3, 1, 1), ValueError),  # one value per instance
        (lambda: nn.InstanceNorm1d(3, track_running_stats=True), (3, 1), ValueError),
    ],
    ids=["LayerNorm", "GroupNorm", "Linear", "Conv2d", "InstanceNorm2d", "InstanceNorm1d unbatched"],
)
def test_bad_input_raises_torchs_error(make, shape, error):
    """Input torch.nn rejects raises torch.nn's error (type and message), not a different one."""
    theirs = make().to(DEVICE)
    with pytest.raises(error) as expected:
        theirs(randn(*shape))
    ours = _as_ours(theirs)
    with pytest.raises(error) as got:
        _quiet(ours, randn(*shape))
    assert str(got.value) == str(expected.value)


@pytest.mark.parametrize("mode", ["bicubic", "nearest-exact", "area"])
def test_upsample_modes_without_kernel_run_torchs(mode):
    torch.manual_seed(0)
    theirs = nn.Upsample(scale_factor=2, mode=mode).to(DEVICE)
    x = randn(1, 2, 3, 4)
    torch.testing.assert_close(_quiet(_as_ours(theirs), x), theirs(x))


def test_integer_input_runs_torchs():
    x = torch.arange(-3, 4, device=DEVICE)
    got = _quiet(tnn.ReLU(), x)
    assert got.dtype == torch.int64 and torch.equal(got, torch.relu(x))


@pytest.mark.parametrize("activation", ["GELU tanh", "GELU", "ReLU", "SiLU", "Sigmoid", "Tanh"])
def test_sequential_fuses_linear_and_activation(monkeypatch, activation):
    """A patched Sequential runs Linear + activation as one tdnn.linear with the activation fused
    (no activation op runs); outputs and gradients as torch's, against float64."""
    make = {
        "GELU tanh": lambda: nn.GELU("tanh"),
        "GELU": nn.GELU,
        "ReLU": lambda: nn.ReLU(inplace=True),
        "SiLU": nn.SiLU,
        "Sigmoid": nn.Sigmoid,
        "Tanh": nn.Tanh,
    }[activation]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), make(), nn.Linear(16, 5), make()).to(DEVICE)
    ours = copy.deepcopy(model)
    report = tnn.patch(ours)
    assert ("", "Sequential") in report.replaced and repr(ours) == repr(model)
    fused = []
    real_linear = tdnn.ops.matmul.linear
    monkeypatch.setattr(tdnn.ops.matmul, "linear", lambda *a, **k: fused.append(k) or real_linear(*a, **k))
    for name in ("gelu", "relu", "silu", "sigmoid", "tanh"):
        monkeypatch.setattr(tdnn.ops.activation, name, None)  # an unfused activation would fail
    x = randn(3, 4, 12)
    got, dgot = _run(ours, x, 2)
    assert [k.get("activation") for k in fused] == [_fusable_activation(ours[1])] * 2
    same, dsame = _run(model, x, 2)
    ref, dref = _run(copy.deepcopy(model).double(), x.double(), 2)
    assert_close(got, ref, same, f"{activation} output")
    for i, (a, b, c) in enumerate(zip(dgot, dref, dsame)):
        assert_close(a, b, c, f"{activation} gradient {i}")


@pytest.mark.parametrize("last", [None, "ReLU"])
def test_sequential_runs_a_linear_pair_as_one_node(last):
    """Sequential(Linear, GELU, Linear[, activation]) (a transformer's MLP): where autograd
    records, from its second call on, both products run as one node (``layers.linear_pair_call``)
    with the same kernels as the two nodes of the first call: the same bits, outputs and every
    gradient, on the same data, in fp32 and under autocast (fp16 under the interpreter, whose
    bf16 products are wrong); against float64 and torch's error on fresh data. A new weight
    (another layout) takes the two calls again once."""
    from helpers import ON_GPU

    low = torch.bfloat16 if ON_GPU else torch.float16
    torch.manual_seed(0)
    tail = [nn.ReLU()] if last else []
    model = nn.Sequential(nn.Linear(12, 16), nn.GELU("tanh"), nn.Linear(16, 5), *tail).to(DEVICE)
    ours = copy.deepcopy(model)
    tnn.patch(ours)
    wide = copy.deepcopy(model).double()

    def step(m, x, autocast):
        with torch.autocast(DEVICE.split(":")[0], dtype=low, enabled=autocast):
            out, grads = _run(m, x, 3)
        return out, grads

    for autocast in (False, True):
        x = randn(3, 4, 12)
        runs = [step(ours, x, autocast) for _ in range(2)]
        for a, b in zip([runs[0][0], *runs[0][1]], [runs[1][0], *runs[1][1]]):
            assert torch.equal(a, b), f"autocast={autocast}: the pair's node against the two nodes"
        for _ in range(2):  # fresh data
            x = randn(3, 4, 12)
            with torch.autocast(DEVICE.split(":")[0], dtype=low, enabled=autocast):
                node = type(ours(x.requires_grad_()).grad_fn).__name__
            assert node == "_LinearPairFunctionBackward", node
            (got, dgot), (same, dsame) = step(ours, x, autocast), step(model, x, autocast)
            ref, dref = _run(wide, x.double(), 3)
            assert_close(got, ref, same, f"autocast={autocast} output")
            if not autocast:  # (the two nodes' casts and kernels: test_linear_autocast's float64 checks)
                for i, (a, b, c) in enumerate(zip(dgot, dref, dsame)):
                    assert_close(a, b, c, f"gradient {i}")
    with torch.no_grad():
        assert_close(ours(x), wide(x.double()), model(x), what="no_grad")
    ours[2].weight = nn.Parameter(ours[2].weight.detach().t().contiguous().t())  # another layout
    wide[2].weight.data = ours[2].weight.detach().double()
    x = randn(3, 4, 12).requires_grad_()
    assert type(ours(x).grad_fn).__name__ != "_LinearPairFunctionBackward"  # validated again first
    assert type(ours(x).grad_fn).__name__ == "_LinearPairFunctionBackward"
    got, dgot = _run(ours, x, 4)
    ref, dref = _run(wide, x.double(), 4)
    same, dsame = _run(model, x, 4)
    assert_close(got, ref, same, "new weight output")
    with pytest.raises(RuntimeError, match="no double backward.*unpatch the model"):
        torch.autograd.grad(ours(x).sum(), x, create_graph=True)


@pytest.mark.parametrize("shape", [(0, 8), (0, 5, 8), (2, 0, 8)])
def test_linear_layers_on_an_empty_batch(shape):
    """Linear, GELU, Linear on an input with no rows, call after call (the pair's node from the
    second): empty outputs and input gradients, zero weight and bias gradients, as torch's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).to(DEVICE)
    ours = copy.deepcopy(model)
    tnn.patch(ours)
    for _ in range(3):
        x = randn(*shape)
        (got, dgot), (want, dwant) = _run(ours, x, 5), _run(model, x, 5)
        assert got.shape == want.shape
        for a, b in zip(dgot, dwant):
            assert a.shape == b.shape and torch.equal(a, b)


def test_linear_pair_under_compiled_autograd():
    """Compiled autograd traces the pair node's backward (its gradient a traced tensor): the
    products' traceable path runs there, the gradients as torch's against float64."""
    from torch._dynamo import compiled_autograd

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).to(DEVICE)
    ours, wide = copy.deepcopy(model), copy.deepcopy(model).double()
    tnn.patch(ours)
    x = randn(3, 8)
    for _ in range(2):  # the second call records the pair's node
        ours(x.requires_grad_()).sum().backward()
    ours.zero_grad()
    out = ours(x)
    assert type(out.grad_fn).__name__ == "_LinearPairFunctionBackward"
    with compiled_autograd._enable(lambda gm: torch.compile(gm, backend="eager")):
        out.pow(2).sum().backward()
    model(x).pow(2).sum().backward()
    wide(x.double()).pow(2).sum().backward()
    for a, b, c in zip(ours.parameters(), wide.parameters(), model.parameters()):
        assert_close(a.grad, b.grad, c.grad, "compiled autograd")


def test_sequential_keeps_hooked_modules_apart():
    model = nn.Sequential(nn.Linear(6, 4), nn.GELU()).to(DEVICE)
    tnn.patch(model)
    seen = []
    model[1].register_forward_hook(lambda m, i, o: seen.append(o))
    out = model(randn(2, 6))
    assert len(seen) == 1 and torch.equal(seen[0], out)  # the GELU ran on its own, its hook saw it


def test_linear_repeat_calls_follow_their_print(monkeypatch):
    """A Linear's repeat calls run the linear family's cached call through the print kept on the
    module (``layers.linear_call``): outputs and gradients equal to ``tdnn.linear``'s on the same
    tensors as autocast, grad mode, requires_grad, the input's layout, the module's dtype and
    its weight change; each change's first call goes the family's way again, its second not.
    Calls off the backend's device and a bias that is not a parameter are not cached."""
    import torch.nn.utils.prune as prune

    from helpers import ON_GPU
    from tritondnn.nn import layers

    low = torch.bfloat16 if ON_GPU else torch.float16
    device = DEVICE.split(":")[0]
    slow = []
    real = layers.run_or_fallback
    monkeypatch.setattr(layers, "run_or_fallback", lambda *a: slow.append(1) or real(*a))
    torch.manual_seed(0)
    m = nn.Linear(8, 6).to(DEVICE)
    tnn.patch(m)

    def check(what, x, autocast=False, grad=True):
        for call in range(2):
            before = len(slow)
            leaves = [t for t in (x, m.weight, m.bias) if t.requires_grad]
            runs = []
            for f in (m, lambda t: tdnn.linear(t, m.weight, m.bias)):
                with torch.autocast(device, dtype=low, enabled=autocast), torch.set_grad_enabled(grad):
                    y = f(x)
                dy = torch.ones_like(y)
                grads = torch.autograd.grad(y, leaves, dy) if grad and leaves else ()
                runs.append((y, grads))
            (got, dgot), (want, dwant) = runs
            assert torch.equal(got, want) and all(map(torch.equal, dgot, dwant)), f"{what} call {call}"
            assert len(slow) - before == (1 if call == 0 else 0), f"{what} call {call}: cached path"

    x = randn(5, 8).requires_grad_(True)
    check("fp32", x)
    check("autocast", x, autocast=True)
    check("no_grad", x, grad=False)
    check("strided input", randn(8, 5).t().requires_grad_(True))
    m.weight.requires_grad_(False)
    check("frozen weight", x)
    m.weight.requires_grad_(True)
    m.weight = nn.Parameter(randn(6, 8).t().contiguous().t())  # another layout
    check("new weight", x)
    m.double()
    check("fp64", x.detach().double().requires_grad_(True))
    # An input off the backend's device runs torch's forward, and nothing is kept for it.
    meta = copy.deepcopy(m).to("meta")
    for _ in range(2):
        assert meta(torch.empty(5, 8, dtype=torch.float64, device="meta")).device.type == "meta"
    # A bias that is no longer a parameter (pruning's): each call reads it as the module has it.
    prune.l1_unstructured(m, "bias", amount=0.5)
    xd = x.detach().double()
    for _ in range(2):
        assert_close(m(xd), nn.functional.linear(xd, m.weight, m.bias), what="pruned bias")
