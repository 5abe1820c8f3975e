"""tdnn.nn.patch / unpatch on whole models, autocast, and torch.compile tracing of patched models."""

from __future__ import annotations

import copy
import gc
import math
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tritondnn as tdnn
import tritondnn.nn as tnn
import tritondnn.nn.attention as tattn
from helpers import DEVICE, ON_GPU, randn, torch_or_skip


class Block(nn.Module):
    """A small conv net with a residual path, a norm, pooling and a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.act = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flat = nn.Flatten()
        self.head = nn.Sequential(nn.Linear(4, 6), nn.GELU(), nn.LayerNorm(6), nn.Linear(6, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.bn(self.conv(x))) + x.mean(1, keepdim=True)
        return self.head(self.flat(self.pool(h)))


class MyLinear(nn.Linear):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return super().forward(input) * 2


def test_patch_replaces_in_place_and_trains_like_torch():
    torch.manual_seed(0)
    model = Block().to(DEVICE)
    reference = copy.deepcopy(model)
    params_before = [id(p) for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    report = tnn.patch(model)
    replaced = dict(report.replaced)
    assert replaced == {
        "conv": "Conv2d", "bn": "BatchNorm2d", "act": "ReLU", "pool": "AdaptiveAvgPool2d",
        "head": "Sequential", "head.0": "Linear", "head.1": "GELU", "head.2": "LayerNorm",
        "head.3": "Linear",
    }  # fmt: skip
    assert ("flat", "Flatten", "no tritondnn module for this class") in report.skipped
    assert isinstance(model.conv, tnn.Conv2d) and [id(p) for p in model.parameters()] == params_before
    assert "9 replaced" in str(report)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        x, target = randn(4, 3, 5, 5), torch.randint(0, 3, (4,), device=DEVICE)
        losses = []
        for m, o in ((model, opt), (reference, ref_opt)):
            loss = F.cross_entropy(m(x), target)
            o.zero_grad()
            loss.backward()
            o.step()
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], rel=1e-4, abs=1e-5), f"step {step}"
    torch.testing.assert_close(model.bn.running_mean, reference.bn.running_mean)
    assert tnn.unpatch(model) == 9 and type(model.conv) is nn.Conv2d and type(model.head[0]) is nn.Linear


def test_include_exclude_and_user_subclasses():
    model = nn.Sequential(nn.Conv1d(2, 2, 1), MyLinear(3, 3), nn.ReLU(), nn.Sequential(nn.Linear(3, 3)))
    report = tnn.patch(model, include=["Conv*", nn.Linear, "3.*"], exclude=["3.0"])
    assert dict(report.replaced) == {"0": "Conv1d"}
    skipped = {name: why for name, _, why in report.skipped}
    assert skipped["1"].startswith("subclass of torch.nn.Linear")
    assert skipped["2"] == "not included" and skipped["3.0"] == "excluded"
    again = [("", "Sequential"), ("2", "ReLU"), ("3", "Sequential"), ("3.0", "Linear")]
    assert tnn.patch(model).replaced == again  # already-patched ones kept
    assert tnn.unpatch(model) == 5


def test_patched_state_dict_round_trips():
    torch.manual_seed(0)
    model = Block()
    state = copy.deepcopy(model.state_dict())
    tnn.patch(model)
    assert list(model.state_dict()) == list(state)
    fresh = Block()
    fresh.load_state_dict(model.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), state.values()))


def test_patch_routes_sdpa_during_forward(monkeypatch):
    calls = []
    real = tattn.sdpa
    monkeypatch.setattr(tattn, "sdpa", lambda *a, **k: calls.append(1) or real(*a, **k))

    class Attend(nn.Module):
        def forward(self, q):
            return F.scaled_dot_product_attention(q, q, q, is_causal=True)

    model = Attend()
    report = tnn.patch(model, sdpa=True)
    assert report.sdpa and "routed" in str(report)
    q = randn(1, 2, 4, 8)
    torch.testing.assert_close(model(q), F.scaled_dot_product_attention(q, q, q, is_causal=True))
    assert calls == [1]  # only the call inside the model's forward
    tnn.unpatch(model)
    model(q)
    assert calls == [1]


# ---------------------------------------------------------------------------------------------
# Autocast: the output dtype PyTorch gives, per op, on the device the suite runs on.

_LSTM_FLAGS = (True, 1, 0.0, False, False, False)  # bias, layers, dropout, train, bidirectional, batch_first


def _lstm_weights() -> list[torch.Tensor]:
    return [randn(16, 8), randn(16, 4), randn(16), randn(16)]


AUTOCAST_CASES = {
    "linear": (lambda x: tdnn.linear(x, randn(5, 8)), lambda x: F.linear(x, randn(5, 8))),
    "matmul": (lambda x: tdnn.matmul(x, randn(8, 4)), lambda x: torch.matmul(x, randn(8, 4))),
    "conv2d": (
        lambda x: tdnn.conv2d(x.view(1, 2, 4, 4), randn(3, 2, 3, 3)),
        lambda x: F.conv2d(x.view(1, 2, 4, 4), randn(3, 2, 3, 3)),
    ),
    "layer_norm": (lambda x: tdnn.layer_norm(x, (8,)), lambda x: F.layer_norm(x, (8,))),
    "group_norm": (lambda x: tdnn.group_norm(x.view(2, 4, 4), 2), lambda x: F.group_norm(x.view(2, 4, 4), 2)),
    "softmax": (lambda x: tdnn.softmax(x, -1), lambda x: F.softmax(x, -1)),
    "log_softmax": (lambda x: tdnn.log_softmax(x, -1), lambda x: F.log_softmax(x, -1)),
    "softplus": (lambda x: tdnn.softplus(x), lambda x: F.softplus(x)),
    "lstm": (
        lambda x: tdnn.lstm(x.view(4, 1, 8), None, _lstm_weights())[0],
        lambda x: torch.lstm(x.view(4, 1, 8), (x.new_zeros(1, 1, 4),) * 2, _lstm_weights(), *_LSTM_FLAGS)[0],
    ),
    "max_pool3d": (
        lambda x: tdnn.max_pool3d(x.view(1, 1, 2, 4, 4), 2),
        lambda x: F.max_pool3d(x.view(1, 1, 2, 4, 4), 2),
    ),
    "adaptive_avg_pool3d": (
        lambda x: tdnn.adaptive_avg_pool3d(x.view(1, 1, 2, 4, 4), 1),
        lambda x: F.adaptive_avg_pool3d(x.view(1, 1, 2, 4, 4), 1),
    ),
    "interpolate": (
        lambda x: tdnn.interpolate(x.view(1, 2, 4, 4), scale_factor=2),
        lambda x: F.interpolate(x.view(1, 2, 4, 4), scale_factor=2),
    ),
    "local_response_norm 4-D": (
        lambda x: tdnn.local_response_norm(x.view(1, 4, 2, 4), 3),
        lambda x: F.local_response_norm(x.view(1, 4, 2, 4), 3),
    ),
    "local_response_norm 3-D": (
        lambda x: tdnn.local_response_norm(x.view(2, 4, 4), 3),
        lambda x: F.local_response_norm(x.view(2, 4, 4), 3),
    ),
    "sdpa": (
        lambda x: tdnn.sdpa(*(x.view(1, 1, 4, 8),) * 3),
        lambda x: F.scaled_dot_product_attention(*(x.view(1, 1, 4, 8),) * 3),
    ),
}


@pytest.mark.parametrize("name", list(AUTOCAST_CASES))
@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16])
def test_autocast_casts_as_pytorch(name, input_dtype):
    ours, theirs = AUTOCAST_CASES[name]
    x = randn(4, 8, dtype=input_dtype)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        expected = torch_or_skip(lambda: theirs(x))
        got = ours(x)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if got.dtype == torch.float32:  # fp32 math: the values must agree too
        torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)


MODULE_AUTOCAST_CASES = {
    "MaxPool3d": (lambda: nn.MaxPool3d(2), (1, 2, 4, 4, 4)),
    "AvgPool3d": (lambda: nn.AvgPool3d(2), (1, 2, 4, 4, 4)),
    "AdaptiveAvgPool3d": (lambda: nn.AdaptiveAvgPool3d(2), (1, 2, 3, 4, 4)),
    "AdaptiveMaxPool3d": (lambda: nn.AdaptiveMaxPool3d(2, return_indices=True), (1, 2, 3, 4, 4)),
    "LocalResponseNorm 4-D": (lambda: nn.LocalResponseNorm(3), (1, 5, 3, 3)),
    "LocalResponseNorm 3-D": (lambda: nn.LocalResponseNorm(3), (2, 5, 3)),
    "MaxPool2d": (lambda: nn.MaxPool2d(2), (1, 2, 4, 4)),
    "Upsample nearest": (lambda: nn.Upsample(scale_factor=2), (1, 2, 3, 3)),
    "Upsample bilinear": (lambda: nn.Upsample(scale_factor=2, mode="bilinear"), (1, 2, 3, 3)),
    "RMSNorm": (lambda: nn.RMSNorm(8), (3, 8)),
    "BatchNorm2d": (lambda: nn.BatchNorm2d(2), (2, 2, 3, 3)),
}


@pytest.mark.parametrize("name", list(MODULE_AUTOCAST_CASES))
def test_autocast_modules_give_torchs_dtypes(name):
    """Ops whose autocast policy differs between CPU and CUDA (the 3-D poolings are fp32 on CPU,
    upsampling and local_response_norm on CUDA): each module's outputs have torch's dtypes."""
    make, shape = MODULE_AUTOCAST_CASES[name]
    theirs = make().to(DEVICE)
    ours = copy.deepcopy(theirs)
    ours.__class__ = tnn.SUPPORTED[type(theirs)]
    x = randn(*shape, dtype=torch.bfloat16)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        expected, got = theirs(x), ours(x)
    for e, g in zip(
        expected if isinstance(expected, tuple) else (expected,), got if isinstance(got, tuple) else (got,)
    ):
        assert g.dtype == e.dtype and g.shape == e.shape, name


def test_autocast_policy_finds_tensors_in_lists_and_positional_skip():
    """The decorator reads the device from a list of tensors, and an explicit ``skip_if`` argument
    given by position turns the cast off as one given by keyword does."""
    from tritondnn.core.autocast import FP32, LOWER, autocast_policy

    @autocast_policy(LOWER, LOWER)
    def dtypes_of(tensors):
        return [t.dtype for t in tensors]

    @autocast_policy(FP32, FP32, skip_if="dtype")
    def input_dtype(x, dim, dtype=None):
        return x.dtype

    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        assert dtypes_of([randn(2), randn(2, dtype=torch.float64)]) == [torch.bfloat16, torch.float64]
        low = randn(2, dtype=torch.bfloat16)
        assert input_dtype(low, 0) == torch.float32
        assert input_dtype(low, 0, dtype=torch.bfloat16) == torch.bfloat16
        assert input_dtype(low, 0, torch.bfloat16) == torch.bfloat16


def test_autocast_module_gradients_reach_fp32_weights():
    torch.manual_seed(0)
    lin = tnn.Linear(8, 4).to(DEVICE)
    x = randn(3, 8)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        y = lin(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert lin.weight.grad.dtype == torch.float32 and lin.weight.grad.abs().sum() > 0


# ---------------------------------------------------------------------------------------------
# torch.compile


@pytest.mark.skipif(
    not ON_GPU, reason="GPU only: inductor's CPU code generation needs a C++ compiler run (slow)"
)
def test_compiled_patched_model_matches_eager_inductor():
    torch.manual_seed(0)
    model = Block().to(DEVICE)
    tnn.patch(model)
    compiled = torch.compile(model, fullgraph=True)
    x = randn(4, 3, 5, 5)
    torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)


def test_patched_model_traces_in_one_graph():
    """fullgraph=True: tritondnn adds no graph break; aot_eager runs the fake kernels' shapes and
    then the real ops, forward and backward."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Block().to(DEVICE)
    reference = copy.deepcopy(model)
    tnn.patch(model)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = randn(4, 3, 5, 5)
    out = compiled(x)
    out.sum().backward()
    expected = reference(x)
    expected.sum().backward()
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(model.conv.weight.grad, reference.conv.weight.grad, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Whole models and CUDA graphs.


@pytest.mark.parametrize("index", [0, 1, 2], ids=["resnet", "gpt", "lstm_lm"])
def test_tiny_models_train_like_torch(index):
    """Two fp32 training steps of each model of the ``models`` suite, patched vs plain, from the
    same seed on the same batches: the losses agree to rounding."""
    from tritondnn.bench.models import agreement, compare, loss_tolerance, workloads

    w = workloads(tiny=True)[index]
    result = compare(w, 2, low_precision=False)
    for a, b in zip(result["tritondnn loss"], result["torch loss"]):
        assert a == pytest.approx(b, rel=1e-4)
    # The third run starts from moved weights; in fp32 the tolerance is the floor regardless.
    assert result["torch perturbed loss"] != result["torch loss"]
    worst, tolerance = agreement(result, low_precision=False)
    assert worst <= tolerance == loss_tolerance(False) == 1e-3
    assert loss_tolerance(True) == 2.0**-8 and loss_tolerance(True, 0.1) == 0.2


@pytest.mark.gpu_only("bf16 training at GPT-2 small's width")
def test_gpt_at_gpt2_width_trains_like_torch_in_bf16():
    """Four decoder layers at GPT-2 small's width (its products: 8192 tokens against 768 x 2304
    and 768 x 3072 weights), eight bf16 AdamW steps patched and plain from one seed: every loss
    finite and within the models' tolerance of PyTorch's. (Flattened matmul configs, then with
    device-made descriptors, made these layers' data gradients NaN now and then on an H200.)"""
    from tritondnn.bench.models import GPT, Workload, agreement, compare

    def batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, 2048, (8, 1025), generator=g).to(DEVICE)
        return ids[:, :-1], ids[:, 1:]

    adamw = lambda m: torch.optim.AdamW(m.parameters(), lr=3e-4, fused=True)
    result = compare(Workload("gpt 4x768", lambda: GPT(2048, 768, 4, 12, 1024), batch, adamw), 8, True)
    assert all(math.isfinite(loss) for loss in result["tritondnn loss"] + result["torch loss"])
    worst, tolerance = agreement(result, low_precision=True)
    assert worst <= tolerance


@pytest.mark.gpu_only("CUDA graphs")
def test_training_step_captures_in_a_cuda_graph():
    """Forward and backward of a patched model captured once and replayed on new data: no host
    syncs or foreign allocations in the launch path. The replayed gradients match eager ones."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.LayerNorm(128), nn.GELU(), nn.Linear(128, 32)).to(DEVICE)
    tnn.patch(model)
    static_x = randn(16, 64)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm up: compile and pick every kernel before capture
            model.zero_grad(set_to_none=False)
            model(static_x).square().mean().backward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    model.zero_grad(set_to_none=False)
    with torch.cuda.graph(graph):
        static_loss = model(static_x).square().mean()
        static_loss.backward()
    x = randn(16, 64)
    static_x.copy_(x)
    model.zero_grad(set_to_none=False)
    graph.replay()
    replayed = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    expected_loss = model(x).square().mean()
    expected_loss.backward()
    torch.testing.assert_close(static_loss, expected_loss)
    for a, p in zip(replayed, model.parameters()):
        torch.testing.assert_close(a, p.grad)


OPTIMIZERS = {
    "sgd_momentum": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
}


def _bn_net() -> nn.Module:
    # No bias before the batch norm: its gradient would be rounding noise alone, which Adam
    # scales up to full steps of either sign (runs would then differ by lr however close).
    layers = nn.Linear(8, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4)
    return nn.Sequential(*layers).to(DEVICE)


def _batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(randn(6, 8), torch.randint(0, 4, (6,), device=DEVICE)) for _ in range(count)]


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_restored_training_state_trains_as_a_fresh_one(optimizer):
    """Steps taken after ``training_state_restorer``'s restore give the same bits as the same
    steps of a fresh copy: weights, batch norm's running statistics and the optimizer's state
    (momentum, moments, step count) all start over. Two steps, so the second uses the state the
    first left."""
    from tritondnn.bench.models import training_state_restorer, training_step

    torch.manual_seed(0)
    model = _bn_net()
    fresh = copy.deepcopy(model)
    opt, fresh_opt = OPTIMIZERS[optimizer](model), OPTIMIZERS[optimizer](fresh)
    restore = training_state_restorer(model, opt)
    step = training_step(model, opt, low_precision=False)
    for x, target in _batches(3):  # moves the weights, statistics and optimizer state
        step(x, target)
    restore()
    fresh_step = training_step(fresh, fresh_opt, low_precision=False)
    for x, target in _batches(2):
        assert torch.equal(step(x, target), fresh_step(x, target))
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.gpu_only("CUDA graphs")
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_graphed_training_step_replays_eager_training(optimizer):
    """A patched model's whole training step (forward, backward, optimizer) captured by
    ``graphed_training_step`` and replayed on new batches trains as the eager step does from
    the same weights. The replay keeps the optimizer (whose state the graph updates in place)
    alive when the caller keeps no reference to it, through an ``empty_cache``."""
    from tritondnn.bench.models import graphed_training_step, training_step

    torch.manual_seed(0)
    model = _bn_net()
    tnn.patch(model)
    eager = copy.deepcopy(model)
    first, *rest = _batches(4)
    opt = OPTIMIZERS[optimizer](model)
    opt_alive = weakref.ref(opt)
    step = graphed_training_step(model, opt, False, *first)
    del opt
    gc.collect()
    torch.cuda.empty_cache()
    assert opt_alive() is not None
    eager_step = training_step(eager, OPTIMIZERS[optimizer](eager), low_precision=False)
    for x, target in rest:
        torch.testing.assert_close(step(x, target), eager_step(x, target))
    for a, b in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(a, b)
