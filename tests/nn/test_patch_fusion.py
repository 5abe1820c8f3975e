"""patch(model, fuse=True): batch norm + ReLU, with a residual add or without, rewritten into one
tdnn.batch_norm call in a model's own modules; Sequential's BatchNorm + ReLU. Values, gradients
and running statistics as the unfused model's (against float64), what is left alone and why,
unpatch, copies."""

from __future__ import annotations

import copy
import operator
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
from test_layers import _run
from torch import nn

import tritondnn as tdnn
import tritondnn.nn as tnn
from helpers import DEVICE, ON_GPU, assert_close, randn
from tritondnn.nn import conv_bn, norm_mlp

# How a block may apply the ReLU and add the residual: all are fused.
RELUS = {
    "module": lambda block, t: block.relu(t),
    "F.relu": lambda block, t: F.relu(t, inplace=True),
    "torch.relu": lambda block, t: torch.relu(t),
    "method": lambda block, t: t.relu(),
}
ADDS = {
    "a + r": operator.add,
    "r + a": lambda a, r: r + a,
    "torch.add": torch.add,
    "a += r": operator.iadd,
    "a.add_(r)": lambda a, r: a.add_(r),
}


class Block(nn.Module):
    """A ResNet bottleneck-like block: relu(bn1(conv1(x))), then relu(bn2(conv2(y)) + skip)."""

    def __init__(self, channels: int, relu: str = "module", add: str = "a + r") -> None:
        super().__init__()
        self.conv1, self.bn1 = (
            nn.Conv2d(channels, channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(channels),
        )
        self.conv2, self.bn2 = nn.Conv2d(channels, channels, 1, bias=False), nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.relu_fn, self.add_fn = RELUS[relu], ADDS[add]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu_fn(self, self.bn1(self.conv1(x)))
        return self.relu_fn(self, self.add_fn(self.bn2(self.conv2(y)), x))


def _pair(make, **patch_args):
    torch.manual_seed(0)
    model = make().to(DEVICE)
    ours = copy.deepcopy(model)
    return model, ours, tnn.patch(ours, fuse=True, **patch_args)


@pytest.fixture
def fused_calls(monkeypatch):
    """The (activation, has residual) of every tdnn.batch_norm call; unfused ReLUs would fail."""
    calls = []
    real = tdnn.ops.norm.batch_norm
    monkeypatch.setattr(conv_bn, "_programs", {})  # the first call of each pair runs unfused

    def recording(*args, **kwargs):
        calls.append((kwargs.get("activation"), kwargs.get("residual") is not None))
        return real(*args, **kwargs)

    monkeypatch.setattr(tdnn.ops.norm, "batch_norm", recording)
    monkeypatch.setattr(tdnn.ops.activation, "relu", None)
    return calls


def _compare_steps(model, ours, x, what, steps=3):
    """Train-mode steps (fresh data), then eval: outputs, every gradient and the running
    statistics against the float64 model and torch's error."""
    wide = copy.deepcopy(model).double()
    for step in range(steps):
        xs = x + step
        got, dgot = _run(ours, xs, step)
        same, dsame = _run(model, xs, step)
        ref, dref = _run(wide, xs.double(), step)
        assert_close(got, ref, same, f"{what} step {step} output")
        for i, (a, b, c) in enumerate(zip(dgot, dref, dsame)):
            assert_close(a, b, c, f"{what} step {step} gradient {i}")
    for a, b, c in zip(ours.buffers(), wide.buffers(), model.buffers()):
        if a.is_floating_point():
            assert_close(a, b, c, f"{what} buffers")
        else:
            assert torch.equal(a, c), f"{what} num_batches_tracked"
    for m in (model, ours, wide):
        m.eval()
    assert_close(ours(x), wide(x.double()), model(x), f"{what} eval")


@pytest.mark.parametrize("relu", list(RELUS))
def test_block_relu_forms_are_fused(relu, fused_calls):
    model, ours, report = _pair(lambda: Block(4, relu=relu))
    assert report.fused == [("bn1", "conv+batch_norm+relu"), ("bn2", "conv+batch_norm+add+relu")]
    _compare_steps(model, ours, randn(2, 4, 6, 5), relu)
    assert fused_calls[:2] == [("relu", False), ("relu", True)]


def test_sync_batch_norm_takes_relu_and_residual(fused_calls):
    """A block whose batch norms are tritondnn's SyncBatchNorm: ReLU and residual add join them
    (their forward_relu), the convolutions stay apart. In one process SyncBatchNorm is batch
    norm, so the values match the plain model (the synchronized forms: test_sync_batchnorm.py)."""
    torch.manual_seed(0)
    model = Block(4).to(DEVICE)
    ours = tnn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(model))
    report = tnn.patch(ours, fuse=True)
    assert type(ours.bn1) is tnn.SyncBatchNorm
    assert report.fused == [("bn1", "batch_norm+relu"), ("bn2", "batch_norm+add+relu")]
    _compare_steps(model, ours, randn(2, 4, 6, 5), "sync")
    assert fused_calls[:2] == [("relu", False), ("relu", True)]


@pytest.mark.parametrize("add", list(ADDS))
def test_block_add_forms_are_fused(add, fused_calls):
    model, ours, report = _pair(lambda: Block(4, add=add))
    assert ("bn2", "conv+batch_norm+add+relu") in report.fused
    _compare_steps(model, ours, randn(2, 4, 6, 5), add)


def test_channels_last_resnet_blocks(fused_calls):
    """The bench's ResNet (stem Sequential, bottlenecks with projected and identity skips) in
    channels_last: every batch norm but the projections' is fused."""
    from tritondnn.bench.models import ResNet

    model, ours, report = _pair(lambda: ResNet((1, 1), 4, 10).to(memory_format=torch.channels_last))
    assert len(report.fused) == 6 and all(name.startswith("layers.") for name, _ in report.fused)
    assert ("layers.0.skip.1", "conv+batch_norm") not in report.fused  # a Sequential's own fusion
    x = randn(2, 3, 16, 16).contiguous(memory_format=torch.channels_last)
    _compare_steps(model, ours, x, "resnet")
    assert ("relu", False) in fused_calls  # the stem's BatchNorm + ReLU, in its Sequential
    assert len(conv_bn._programs) >= 9  # every conv + batch norm pair took the fused node


def _no_op_hook(module, inputs, output):
    return None


class Shared(nn.Module):
    """Patterns that must stay apart: a batch norm output read twice, an add that writes the
    residual, an add with alpha, a hooked ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.bn1, self.bn2, self.bn3, self.bn4 = (nn.BatchNorm1d(3) for _ in range(4))
        self.relu, self.hooked = nn.ReLU(), nn.ReLU()
        self.hooked.register_forward_hook(_no_op_hook)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.bn1(x)
        y = self.relu(a) + a
        r = x.clone().add_(self.bn2(x))  # writes into the other operand: not bn2's output + r
        y = y + self.relu(r) + torch.relu(torch.add(self.bn3(x), x, alpha=2.0))
        return y + self.hooked(self.bn4(x))


def test_patterns_that_are_not_fused():
    model, ours, report = _pair(Shared)
    assert report.fused == [] and "forward" not in vars(ours)
    _compare_steps(model, ours, randn(5, 3), "shared")


class ModeDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(x)
        return F.relu(y) if self.training else y


class DataDependent(ModeDependent):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(x)
        return F.relu(y) if x.abs().sum() > 0 else y  # a condition on values: fx cannot trace it


@pytest.mark.parametrize(
    ("make", "why"), [(ModeDependent, "depends on train/eval mode"), (DataDependent, "not traceable")]
)
def test_modules_left_alone_are_reported(make, why):
    model, ours, report = _pair(make)
    assert report.fused == [] and "forward" not in vars(ours)
    assert [name for name, _, _ in report.skipped] == [""] and why in report.skipped[0][2]
    _compare_steps(model, ours, randn(5, 3), make.__name__)


def test_broadcast_residual_is_added_unfused(fused_calls, monkeypatch):
    """A residual of another shape (broadcast by torch) or dtype: batch norm + ReLU stay right."""

    class Broadcast(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn, self.relu = nn.BatchNorm2d(4), nn.ReLU()
            self.scale = nn.Parameter(torch.randn(1, 4, 1, 1))

        def forward(self, x):
            return self.relu(self.bn(x) + self.scale)

    monkeypatch.setattr(tdnn.ops.activation, "relu", torch.relu)
    model, ours, report = _pair(Broadcast)
    assert report.fused == [("bn", "batch_norm+add+relu")]
    _compare_steps(model, ours, randn(2, 4, 3, 3), "broadcast")


def test_unpatch_copies_and_state_dict():
    model, ours, report = _pair(lambda: Block(4))
    assert set(ours.state_dict()) == set(model.state_dict())
    twin = copy.deepcopy(ours)  # the copy's forward uses the copy's modules
    assert twin.forward.__self__.bn1 is twin.bn1 and twin.bn1 is not ours.bn1
    x = randn(2, 4, 6, 5)
    assert_close(twin(x), ours(x), what="deep copy")
    assert tnn.unpatch(ours) > 0 and "forward" not in vars(ours)
    assert type(ours.bn1) is nn.BatchNorm2d
    assert_close(ours(x), model(x), what="unpatched")
    assert "fused    bn1 (conv+batch_norm+relu)" in str(report)


@pytest.fixture
def node_calls(monkeypatch):
    """The fused conv + batch norm autograd nodes run: 1 for a pair's, a chain's pair count for
    a chain's; a fresh program cache."""
    monkeypatch.setattr(conv_bn, "_programs", {})
    calls = []
    real, real_chain = conv_bn._apply, conv_bn._apply_chain
    monkeypatch.setattr(conv_bn, "_apply", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(
        conv_bn, "_apply_chain", lambda run, *a: calls.append(len(run.layout)) or real_chain(run, *a)
    )
    return calls


def test_conv_batch_norm_under_autocast(node_calls, monkeypatch):
    """Autocast (bf16 on the GPU, fp16 under the interpreter, whose bf16 dot is wrong): the fp32
    weight is cast inside the fused node and its gradient comes back in fp32. The node runs the
    same kernels as the two modules called one after the other, so outputs, gradients (dtypes,
    layouts) and running statistics match theirs bit for bit over three channels_last training
    steps, except the convolutions' weight gradients: the node stores them from the kernels' fp32
    sums, where the modules' path rounds them to the low dtype before autocast's cast back (the
    unfused path is checked against torch above)."""
    low = torch.bfloat16 if ON_GPU else torch.float16
    _, ours, _ = _pair(lambda: Block(8).to(memory_format=torch.channels_last))
    apart = copy.deepcopy(ours)
    trained = [name for name, p in ours.named_parameters() if p.requires_grad]
    conv_weights = {1 + i for i, name in enumerate(trained) if name.startswith("conv")}  # 0 is x's
    assert len(conv_weights) == 2
    for step in range(3):
        x = randn(2, 8, 6, 5, dtype=low).contiguous(memory_format=torch.channels_last)
        runs = []
        for model, fused in ((ours, True), (apart, False)):
            with monkeypatch.context() as m:
                if not fused:
                    m.setattr(conv_bn, "_key", lambda *args: None)  # every call runs the modules
                with torch.autocast(DEVICE.split(":")[0], dtype=low):
                    runs.append(_run(model, x, step))
        (got, dgot), (same, dsame) = runs
        assert torch.equal(got, same), f"step {step} output"
        for i, (a, b) in enumerate(zip(dgot, dsame)):
            assert a.dtype == b.dtype and a.stride() == b.stride(), f"step {step} gradient {i} layout"
            if i in conv_weights:
                assert torch.equal(a.to(low).to(a.dtype), b), f"step {step} gradient {i} rounded"
                assert step == 0 or not torch.equal(a, b), f"step {step} gradient {i} not rounded"
            else:
                assert torch.equal(a, b), f"step {step} gradient {i}"
    for a, b in zip(ours.buffers(), apart.buffers()):
        assert torch.equal(a, b)
    # Step 1 primes; step 2 runs each pair fused (and learns the block's chain), step 3 the chain.
    assert node_calls == [1, 1, 2]


class Twice(nn.Module):
    """A block run twice in one forward (its conv + batch norm pairs too); ``between``, where
    set, is called between the two."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Block(8)
        self.between = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        if self.between is not None:
            self.between()
        return self.block(y)


def test_fused_step_casts_weights_once_and_counts_batches(node_calls, monkeypatch):
    """A fused model's forward is one step (``conv_bn._Step``): from the second forward on its
    convolutions' weights are cast by one launch, and the batch norms' counters are
    added by one multi-tensor add as it returns, one each where a pair runs twice. A weight
    replaced within a forward (after the copy) or changed in place between forwards is what the
    next call uses; a forward that raises leaves no step open; unpatch removes the hooks."""
    low = torch.bfloat16 if ON_GPU else torch.float16
    device = DEVICE.split(":")[0]
    torch.manual_seed(0)
    model = Twice().to(DEVICE).to(memory_format=torch.channels_last)
    ours = copy.deepcopy(model)
    tnn.patch(ours, fuse=True)
    copies, adds = [], []
    real_cast, real_add = conv_bn._CastPlan.cast_all, torch._foreach_add_

    def cast_all(plan, *args):
        real_cast(plan, *args)
        if conv_bn.step_casts.table:
            copies.append(len(conv_bn.step_casts.table))

    monkeypatch.setattr(conv_bn._CastPlan, "cast_all", cast_all)
    monkeypatch.setattr(torch, "_foreach_add_", lambda t, v: adds.append(len(t)) or real_add(t, v))

    def forward(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        # Without autocast's cache, which would keep a weight's cast across a swap of its .data.
        with torch.autocast(device, dtype=low, cache_enabled=False):
            return m(x)

    x = randn(2, 8, 6, 5, dtype=low).contiguous(memory_format=torch.channels_last)

    # New weights keep the old strides: a 1x1 weight's size-one dimensions take any, and the GPU's
    # elementwise ops pick others than the CPU's, which would change the fast path's key.
    def new_weight(c: nn.Module) -> None:
        c.weight = nn.Parameter(torch.empty_like(c.weight).copy_(c.weight.detach() * 0.5))

    def new_storage(c: nn.Module) -> None:  # as FSDP's unsharding swaps it
        c.weight.data = torch.empty_like(c.weight).copy_(c.weight.detach().roll(1, 0))

    for step in range(5):
        for m in (ours, model):  # steps 2 and 4: conv2's weight changes between the block's calls
            conv = m.block.conv2
            change = {2: new_weight, 4: new_storage}.get(step)
            m.between = None if change is None else (lambda c=conv, f=change: f(c))
        if step == 3:
            with torch.no_grad():
                for m in (ours, model):
                    m.block.conv1.weight.data.mul_(-1)
        got, want = forward(ours, x), forward(model, x)
        assert_close(got, want, what=f"step {step}")
    # Forward 1's first block call primes the programs, its second learns the plan; 2-5 cast in
    # one launch each (3's and 5's second block calls cast conv2 alone: the launch had the old).
    assert copies == [2, 2, 2, 2] and conv_bn._local.step is None
    assert node_calls == [1, 1] + [2] * 8  # the block's chain, each call from forward 2 on
    counters = [int(m.num_batches_tracked) for m in (ours.block.bn1, ours.block.bn2)]
    assert counters == [10, 10] == [int(m.num_batches_tracked) for m in (model.block.bn1, model.block.bn2)]
    assert adds == [2]  # forward 1's fused call; then each counter twice a step: an add_ each
    # Running statistics of 16-bit activations that our convolutions and cuDNN's round apart (one
    # unit, 2^-8 in bf16, here and there): close, not equal; the counters are exact.
    for a, b in zip(ours.buffers(), model.buffers()):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)

    with pytest.raises(RuntimeError):
        forward(ours, randn(2, 5, 6, 5, dtype=low).contiguous(memory_format=torch.channels_last))
    assert conv_bn._local.step is None
    pickle.dumps(ours._tdnn_cast_plan)  # a model saved whole: the plan's launchers are left out
    assert copy.deepcopy(ours)._tdnn_cast_plan.convs == []  # a copy learns its own
    twin = copy.copy(ours)  # its __dict__'s values shared, as DataParallel's replicas have them
    forward(twin, x)
    assert twin._tdnn_cast_plan is not ours._tdnn_cast_plan
    assert tnn.unpatch(ours) > 0
    assert not ours._forward_pre_hooks and not ours._forward_hooks and "_tdnn_cast_plan" not in vars(ours)


class Products(nn.Module):
    """Linear layers, two in a Sequential with a GELU between; ``between``, where set, is called
    after the first."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 12)
        self.mlp = nn.Sequential(nn.Linear(12, 24), nn.GELU(), nn.Linear(24, 4))
        self.between = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        if self.between is not None:
            self.between()
        return self.mlp(self.b(y))


def test_fused_step_casts_product_weights_once(monkeypatch):
    """Under autocast a fused model's forward casts its products' weights in one launch from its
    second forward on (they join the plan as the first casts them one by one): outputs and
    gradients equal to the model patched without fusion (casts one by one) over training steps
    (SGD changes the weights in place between forwards); a weight changed in place within a
    forward, after the launch, is cast again by its product; a weight replaced by a new
    parameter joins the next forward's launch."""
    low = torch.bfloat16 if ON_GPU else torch.float16
    cast_weights = []
    real_cast = conv_bn._CastPlan.cast_all

    def cast_all(plan, *args):
        real_cast(plan, *args)
        cast_weights.append(len(conv_bn.step_casts.table or ()))

    monkeypatch.setattr(conv_bn._CastPlan, "cast_all", cast_all)
    torch.manual_seed(0)
    model = Products().to(DEVICE)
    ours, apart = copy.deepcopy(model), copy.deepcopy(model)
    tnn.patch(ours, fuse=True)
    tnn.patch(apart)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, apart)]
    for step in range(5):
        x = randn(6, 8)
        runs = []
        for m, opt in zip((ours, apart), optimizers):
            if step == 2:  # in place, after the step's launch read the weight
                m.between = lambda m=m: torch.no_grad()(m.b.weight.mul_)(0.5)
            elif step == 3:
                m.between = None
                m.a.weight = nn.Parameter(m.a.weight.detach() * 2)  # same layout, a new tensor
                opt.param_groups[0]["params"][0] = m.a.weight
            with torch.autocast(DEVICE.split(":")[0], dtype=low):
                out, grads = _run(m, x, step)
            runs.append((out, grads))
            for p, g in zip((p for p in m.parameters() if p.requires_grad), grads[1:]):
                p.grad = g
            opt.step()
        (got, dgot), (same, dsame) = runs
        assert torch.equal(got, same), f"step {step} output"
        for i, (a, b) in enumerate(zip(dgot, dsame)):
            assert a.dtype == b.dtype and torch.equal(a, b), f"step {step} gradient {i}"
    # The first forward casts one by one; then the four weights in one launch, at step 3 the
    # old parameter's place among them (the new one cast alone), at step 4 the new one's.
    assert cast_weights == [4, 4, 4, 4]
    assert conv_bn.step_casts.table is None and conv_bn.step_casts.seen is None
    # Without autograd nothing keeps the casts: each product casts its own, freed after it.
    with torch.no_grad(), torch.autocast(DEVICE.split(":")[0], dtype=low):
        assert torch.equal(ours(x), apart(x))
    assert cast_weights == [4, 4, 4, 4]


def test_fused_step_sees_weights_written_in_place_within_the_forward(node_calls):
    """A weight written in place during the forward, after the step's launch cast it (here
    between the block's two calls), is cast again by its call: the version counter moved."""
    low = torch.bfloat16 if ON_GPU else torch.float16
    torch.manual_seed(0)
    model = Twice().to(DEVICE).to(memory_format=torch.channels_last)
    ours = copy.deepcopy(model)
    tnn.patch(ours, fuse=True)
    for m in (ours, model):
        m.between = lambda m=m: torch.no_grad()(m.block.conv1.weight.mul_)(-1)
    x = randn(2, 8, 6, 5, dtype=low).contiguous(memory_format=torch.channels_last)
    for step in range(4):
        # Without autocast's cache, whose casts of leaf tensors do not see in-place writes.
        with torch.autocast(DEVICE.split(":")[0], dtype=low, cache_enabled=False):
            got, want = ours(x), model(x)
        assert_close(got, want, what=f"step {step}")
    assert sum(node_calls) >= 8  # fused from the second forward on


def test_fused_step_after_an_interrupted_forward(node_calls):
    """A KeyboardInterrupt skips the hook that closes the step (PyTorch runs it on Exception
    only): the model's next forward adds the open step's counts and starts a new one, casting
    the weights as they are then."""
    low = torch.bfloat16 if ON_GPU else torch.float16
    torch.manual_seed(0)
    model = Twice().to(DEVICE).to(memory_format=torch.channels_last)
    ours = copy.deepcopy(model)
    tnn.patch(ours, fuse=True)
    x = randn(2, 8, 6, 5, dtype=low).contiguous(memory_format=torch.channels_last)

    def interrupt() -> None:
        raise KeyboardInterrupt

    for step in range(5):
        outputs = []
        for m in (ours, model):
            m.between = interrupt if step == 2 else None
            with torch.autocast(DEVICE.split(":")[0], dtype=low):
                if step == 2:
                    with pytest.raises(KeyboardInterrupt):
                        m(x)
                else:
                    outputs.append(m(x))
            with torch.no_grad():
                m.block.conv1.weight.mul_(-0.5)
        if outputs:
            assert_close(outputs[0], outputs[1], what=f"step {step}")
    assert conv_bn._local.step is None
    for a, b in zip(ours.buffers(), model.buffers()):
        if not a.is_floating_point():
            assert torch.equal(a, b), "num_batches_tracked"


def test_cast_plan_casts_every_weight_through_its_table():
    """The one-launch cast: weights of several blocks' size and none, both layouts, each view
    equal to the weight's own ``.to``; a weight not fp32 is left to its call; a new storage under
    the same parameter is read from the next step on."""
    low = torch.bfloat16 if ON_GPU else torch.float16
    shapes = [(9000,), (3, 4, 1, 1), (70, 9, 3, 3), (5, 2, 3, 3)]
    convs = [nn.Module() for _ in shapes]
    for conv, shape in zip(convs, shapes):
        conv.weight = nn.Parameter(randn(*shape))
    convs[2].weight = nn.Parameter(convs[2].weight.detach().contiguous(memory_format=torch.channels_last))
    convs[3].weight = nn.Parameter(convs[3].weight.detach().double())
    plan = conv_bn._CastPlan()
    for conv in convs:
        plan.learn(conv)
    step_cast = tdnn.core.autocast.step_cast
    for step in range(2):
        plan.cast_all(low, convs[0].weight.device)
        for conv in convs[:3]:
            view = step_cast(conv.weight, low)
            assert view.stride() == conv.weight.stride() and view.data_ptr() % 16 == 0
            assert torch.equal(view, conv.weight.detach().to(low)), f"step {step}"
        assert step_cast(convs[3].weight, low) is None  # fp64: cast by its call
        assert step_cast(convs[0].weight, torch.float64) is None  # another dtype
        with torch.no_grad():
            convs[2].weight.mul_(2)  # written in place after the launch: cast again by its call
        assert step_cast(convs[2].weight, low) is None
        with torch.no_grad():
            convs[1].weight.data = randn(3, 4, 1, 1)  # new storage, same parameter
        assert step_cast(convs[1].weight, low) is None
    # A weight whose storage is freed for now (FSDP's unsharded parameters between forwards) is
    # left out of the launch, and taken again once it has storage.
    storage = convs[0].weight.untyped_storage()
    size = storage.nbytes()
    storage.resize_(0)
    plan.cast_all(low, convs[1].weight.device)
    assert id(convs[0]) not in plan.places and step_cast(convs[1].weight, low) is not None
    storage.resize_(size)
    plan.cast_all(low, convs[1].weight.device)
    assert step_cast(convs[0].weight, low) is not None
    conv_bn.step_casts.table = None


def test_fused_step_counts_with_one_add(node_calls, monkeypatch):
    """Each pair once a forward: the counters are added by one multi-tensor add."""
    adds = []
    real_add = torch._foreach_add_
    monkeypatch.setattr(torch, "_foreach_add_", lambda t, v: adds.append(len(t)) or real_add(t, v))
    model, ours, _ = _pair(lambda: Block(4))
    _compare_steps(model, ours, randn(2, 4, 6, 5), "counted by the step")
    assert adds == [2, 2]  # the first step primes (unfused, counted by the modules)


def test_sequential_conv_batch_norm_relu(node_calls):
    """Patched (fuse or not) Sequential: Conv2d + BatchNorm2d + ReLU and Conv2d + BatchNorm2d run
    as fused nodes; a conv with a bias runs unfused, right."""
    make = lambda: nn.Sequential(
        nn.Conv2d(4, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6), nn.ReLU(),
        nn.Conv2d(6, 6, 1, bias=False), nn.BatchNorm2d(6),
        nn.Conv2d(6, 6, 1), nn.BatchNorm2d(6), nn.ReLU(),
    )  # fmt: skip
    torch.manual_seed(0)
    model = make().to(DEVICE)
    ours = copy.deepcopy(model)
    tnn.patch(ours)
    _compare_steps(model, ours, randn(2, 4, 5, 5), "sequential")
    assert node_calls == [1] * 4


def test_block_runs_as_one_chain_node(node_calls):
    """A bottleneck with a projected skip: its four conv + batch norm pairs (the skip's
    Sequential inlined) run as one autograd node from its third forward on, against float64
    and torch: frozen batch norm parameters and an input without a gradient; a forward without
    autograd in training mode (running statistics); a hook registered after patching, which
    sees its module's call again (the chain gives way); a deep copy, which learns its own."""
    from tritondnn.bench.models import Bottleneck

    model, ours, report = _pair(lambda: Bottleneck(4, 3, 2).to(memory_format=torch.channels_last))
    assert "conv_batch_norm_chain" in ours.forward.__self__.code and "skip" not in report.skipped
    x = randn(2, 4, 7, 6).contiguous(memory_format=torch.channels_last)
    _compare_steps(model, ours, x, "chain", steps=4)
    assert node_calls[:4] == [1, 1, 1, 1] and node_calls[4:] == [4, 4]  # steps 3 and 4
    for m in (model, ours):
        m.train()
        m.bn1.weight.requires_grad_(False)
        m.bn3.bias.requires_grad_(False)
    wide = copy.deepcopy(model).double()
    got, dgot = _run(ours, x, 5)
    same, dsame = _run(model, x, 5)
    ref, dref = _run(wide, x.double(), 5)
    assert node_calls[-1] == 4 and len(dgot) == len(dref) == 1 + 4 + 6  # x, 4 convs, 6 of 8 bn params
    assert_close(got, ref, same, "frozen output")
    for i, (a, b, c) in enumerate(zip(dgot, dref, dsame)):
        assert_close(a, b, c, f"frozen gradient {i}")
    calls = len(node_calls)
    with torch.no_grad():
        got, ref, same = ours(x + 1), wide(x.double() + 1), model(x + 1)
    assert len(node_calls) == calls  # no node: the programs ran directly
    assert_close(got, ref, same, "no_grad output")
    for a, b, c in zip(ours.buffers(), wide.buffers(), model.buffers()):
        if a.is_floating_point():
            assert_close(a, b, c, "no_grad running statistics")
    seen = []
    hook = ours.conv2.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    calls = len(node_calls)
    assert_close(ours(x), wide(x.double()), model(x), "hooked")
    assert seen == [(2, 3, 4, 3)] and len(node_calls) == calls + 3  # the other three pairs
    hook.remove()
    twin = copy.deepcopy(ours)
    assert twin.conv1.__dict__[conv_bn._CHAIN].entry is None
    for _ in range(3):
        assert_close(twin(x), wide(x.double()), model(x), "copy")
    pickle.dumps(ours.conv1.__dict__[conv_bn._CHAIN])
    x = x.detach().requires_grad_(True)
    y = ours(x)
    assert node_calls[-1] == 4
    with pytest.raises(RuntimeError, match="no double backward"):
        torch.autograd.grad(y, x, torch.ones_like(y), create_graph=True)
    tnn.unpatch(ours)
    assert not any(type(v) is tnn.cache.Slot for m in ours.modules() for v in vars(m).values())


def test_fused_model_traces_in_one_graph():
    """torch.compile(fullgraph=True) of a fused block: the rewritten forward adds no graph break
    (the fused calls run the modules' ops while tracing); forward and backward as eager."""
    torch._dynamo.reset()
    model, ours, report = _pair(lambda: Block(4))
    assert report.fused
    compiled = torch.compile(ours, backend="aot_eager", fullgraph=True)
    x = randn(2, 4, 6, 5)
    ref, dref = _run(copy.deepcopy(model).double(), x.double(), 0)
    got, dgot = _run(compiled, x, 0)
    same, dsame = _run(model, x, 0)
    assert_close(got, ref, same, "compiled output")
    for i, (a, b, c) in enumerate(zip(dgot, dref, dsame)):
        assert_close(a, b, c, f"compiled gradient {i}")


# ---------------------------------------------------------------------------------------------
# An add into a layer or RMS norm (a pre-norm transformer block's residual stream).

NORM_ADDS = {
    "a + r": operator.add,
    "r + a": lambda a, r: r + a,
    "torch.add": torch.add,
    "a.add(r)": lambda a, r: a.add(r),
}


class PreNormBlock(nn.Module):
    """``x + f(norm1(x))``, then that plus ``g(norm2(.))``: the first sum feeds norm2 and the last
    add. ``branch_dtype``: f's output cast to it (a bf16 branch on an fp32 stream, as autocast
    leaves them)."""

    def __init__(self, dim: int = 24, norm: str = "layer", add: str = "a + r", branch_dtype=None) -> None:
        super().__init__()
        make = nn.LayerNorm if norm == "layer" else nn.RMSNorm
        self.norm1, self.norm2 = make(dim), make(dim)
        self.f, self.g = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.add_fn = NORM_ADDS[add]
        self.cast = (lambda t: t) if branch_dtype is None else (lambda t: t.to(branch_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.add_fn(x, self.cast(self.f(self.norm1(x))))
        return x + self.g(self.norm2(x))


@pytest.fixture
def add_norm_calls(monkeypatch):
    """The (input dtype, residual dtype) of every fused add + norm call."""
    calls = []
    for name in ("add_layer_norm", "add_rms_norm"):
        real = getattr(tdnn.ops.norm, name)

        def recording(x, r, *args, real=real, **kwargs):
            calls.append((x.dtype, r.dtype))
            return real(x, r, *args, **kwargs)

        monkeypatch.setattr(tdnn.ops.norm, name, recording)
    return calls


@pytest.mark.parametrize("add", list(NORM_ADDS))
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_add_into_norm_is_fused(norm, add, add_norm_calls):
    model, ours, report = _pair(lambda: PreNormBlock(norm=norm, add=add))
    assert report.fused == [("norm2", f"add+{norm}_norm")]
    _compare_steps(model, ours, randn(3, 5, 24), f"{norm} {add}")
    assert add_norm_calls == [(torch.float32, torch.float32)] * (3 + 1)  # three steps, then eval


def test_add_of_a_narrower_branch_into_norm(add_norm_calls):
    """fp32 stream + bf16 branch: one pass with the fp32 operand as the norm's input whichever
    side of the add it is on; the sum fp32 as PyTorch's promotion makes it."""
    model, ours, report = _pair(lambda: PreNormBlock(branch_dtype=torch.bfloat16, add="r + a"))
    assert report.fused == [("norm2", "add+layer_norm")]
    _compare_steps(model, ours, randn(3, 5, 24), "fp32 + bf16")
    assert set(add_norm_calls) == {(torch.float32, torch.bfloat16)}


class MLPBlock(nn.Module):
    """A GPT block's shape: ``x + f(norm1(x))``, then that plus ``mlp(norm2(.))``, the MLP a
    Sequential of Linear, GELU (tanh), Linear (and a ReLU with ``tail``)."""

    def __init__(self, dim: int = 24, tail: bool = False) -> None:
        super().__init__()
        self.norm1, self.norm2, self.f = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.Linear(dim, dim)
        layers = [nn.Linear(dim, 4 * dim), nn.GELU("tanh"), nn.Linear(4 * dim, dim)]
        self.mlp = nn.Sequential(*layers, *([nn.ReLU()] if tail else []))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.f(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class RMSNormMLPBlock(MLPBlock):
    """``MLPBlock`` with RMS norms: the add joins the norm, the MLP stays apart (the node runs a
    layer norm's program)."""

    def __init__(self, dim: int = 24) -> None:
        super().__init__(dim)
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)


class MLPBlockReadingTheNormTwice(MLPBlock):
    """``MLPBlock`` whose output also adds norm2's output: the MLP is not its only reader."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.f(self.norm1(x))
        h = self.norm2(x)
        return x + self.mlp(h) + h


def _node_names(out: torch.Tensor) -> set[str]:
    """The types of the autograd nodes ``out`` was computed through."""
    seen, stack, names = set(), [out.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(n for n, _ in node.next_functions)
    return names


@pytest.mark.parametrize("tail", [False, True])
def test_norm_and_mlp_as_one_node(tail):
    """The fused add + norm and the MLP reading its output alone as one autograd node
    (``norm_mlp``) from the second recorded call on: the same bits as the separate calls on the
    same data (fp32 and autocast: fp16 under the interpreter), values and gradients against
    float64 over steps; no-grad calls (eval) and an MLP with a hook take the separate calls."""
    low = torch.bfloat16 if ON_GPU else torch.float16
    model, ours, report = _pair(lambda: MLPBlock(tail=tail))
    assert ("mlp", "add+layer_norm+linear+activation+linear") in report.fused
    assert ("norm2", "add+layer_norm") in report.fused
    x = randn(3, 5, 24)
    for autocast in (False, True):
        with torch.autocast(DEVICE.split(":")[0], dtype=low, enabled=autocast):
            runs = [_run(ours, x, 7) for _ in range(2)]  # separate calls, then the node
            assert "_NormLinearPairFunctionBackward" in _node_names(ours(x.requires_grad_()))
        for a, b in zip([runs[0][0], *runs[0][1]], [runs[1][0], *runs[1][1]]):
            assert torch.equal(a, b), f"autocast={autocast}"
    _compare_steps(model, ours, randn(3, 5, 24), "norm + mlp")
    seen = []
    ours.mlp.register_forward_hook(lambda m, args, out: seen.append(out))
    out = ours(x)
    assert len(seen) == 1 and "_NormLinearPairFunctionBackward" not in _node_names(out)


def test_norm_and_mlp_node_gives_way_to_autocast_on_a_narrow_stream():
    """A model in bf16 (fp16 under the interpreter): the node runs from its second call; under
    autocast, where torch's norm runs in fp32 on the narrow sum, the add, the norm and the MLP
    run as written, whatever was kept for the calls before."""
    low = torch.bfloat16 if ON_GPU else torch.float16
    _, ours, _ = _pair(MLPBlock)
    ours.to(low)
    x = randn(3, 5, 24, dtype=low).requires_grad_()
    names = [_node_names(ours(x)) for _ in range(2)]
    assert "_NormLinearPairFunctionBackward" in names[1] - names[0]
    with torch.autocast(DEVICE.split(":")[0], dtype=low):
        assert "_NormLinearPairFunctionBackward" not in _node_names(ours(x))
        assert norm_mlp._norm_key(ours.norm2, x, x) is None  # not the fused add's call there
    assert norm_mlp._norm_key(ours.norm2, x, x) is not None


@pytest.mark.parametrize("make", [MLPBlockReadingTheNormTwice, RMSNormMLPBlock])
def test_mlp_apart_where_the_node_does_not_apply(make):
    """A norm output read by more than the MLP, or an RMS norm: the add + norm alone is fused."""
    model, ours, report = _pair(make)
    assert [pattern for _, pattern in report.fused] == [
        f"add+{'rms' if make is RMSNormMLPBlock else 'layer'}_norm"
    ]
    _compare_steps(model, ours, randn(3, 5, 24), make.__name__)


def test_add_into_norm_falls_back_quietly(add_norm_calls):
    """A broadcast operand, or a norm with a hook: the add and the norm as written, no warning."""

    class Broadcast(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.shift = nn.LayerNorm(8), nn.Parameter(torch.randn(8))

        def forward(self, x):
            return self.norm(x + self.shift)

    model, ours, report = _pair(Broadcast)
    assert report.fused == [("norm", "add+layer_norm")]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _compare_steps(model, ours, randn(4, 8), "broadcast")
    assert not [w for w in caught if "tritondnn falls back" in str(w.message)]
    assert add_norm_calls == []
    hooked = PreNormBlock()
    hooked.norm2.register_forward_hook(lambda *args: None)
    assert tnn.patch(hooked, fuse=True).fused == []


class Stack(nn.Module):
    """A pre-norm transformer's shape: an input plus a learned offset, a Sequential of
    ``PreNormBlock``s and a final norm. Each block's last add feeds the next block's first norm
    (and the last one's the final norm) across the blocks' boundaries."""

    def __init__(self, blocks: int = 3, dim: int = 24, branch_dtype=None) -> None:
        super().__init__()
        self.offset = nn.Parameter(torch.randn(dim))
        self.blocks = nn.Sequential(*(PreNormBlock(dim, branch_dtype=branch_dtype) for _ in range(blocks)))
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.blocks(x * 2.0 + self.offset))


STACK_SITES = [
    ("blocks.0.norm2", "add+layer_norm"),
    ("blocks.1.norm1", "add+layer_norm"),
    ("blocks.1.norm2", "add+layer_norm"),
    ("blocks.2.norm1", "add+layer_norm"),
    ("blocks.2.norm2", "add+layer_norm"),
    ("norm", "add+layer_norm"),
    ("blocks.0.norm1", "add+layer_norm"),
]


def test_add_into_norm_across_blocks(add_norm_calls):
    """The add ending each block of a Sequential and the norm starting the next one (or the model's
    final norm) as one call: the model's forward runs through the blocks' code (patch makes the
    Sequential tritondnn's). The first block's norm reads a broadcast sum: fused in the graph,
    added unfused at run time."""
    model, ours, report = _pair(Stack)
    assert type(ours.blocks) is tnn.containers.Sequential
    assert sorted(report.fused) == sorted(STACK_SITES)
    assert "forward" in vars(ours) and all("forward" in vars(b) for b in ours.blocks)
    _compare_steps(model, ours, randn(3, 5, 24), "stack")
    # Three steps and eval: the six sums of two tensors of one shape each time.
    assert add_norm_calls == [(torch.float32, torch.float32)] * 6 * 4
    assert tnn.unpatch(ours) and "forward" not in vars(ours)


def test_add_into_norm_across_blocks_left_to_each_block(add_norm_calls):
    """A block with a hook (which must see its call), or one excluded, keeps the stack from being
    run through: the blocks are fused one by one (the add inside each), as without a stack."""
    hooked = Stack()
    hooked.blocks[1].register_forward_pre_hook(lambda *args: None)
    assert sorted(tnn.patch(copy.deepcopy(hooked), fuse=True).fused) == [
        (f"blocks.{i}.norm2", "add+layer_norm") for i in range(3)
    ]
    model, ours, report = _pair(Stack, exclude=["blocks.1"])
    assert sorted(report.fused) == [(f"blocks.{i}.norm2", "add+layer_norm") for i in (0, 2)]
    _compare_steps(model, ours, randn(3, 5, 24), "stack, one block excluded")


def test_add_into_norm_across_blocks_gives_way_to_later_hooks(add_norm_calls):
    """Hooks registered on a block after patching (FSDP2 gathers a block's parameters in one) see
    its call: the model's forward calls the blocks again (each fused on its own) while a block
    has a hook, and runs through them once none has. Deep copies keep their own fused forward."""
    model, ours, _ = _pair(Stack)
    x = randn(3, 5, 24)
    seen = []
    handle = ours.blocks[2].register_forward_pre_hook(lambda m, args: seen.append(args[0].shape))
    _compare_steps(model, ours, x, "stack with a hooked block", steps=1)
    assert seen and len(add_norm_calls) == 3 * 2  # each block's own add, in a step and in eval
    handle.remove()
    add_norm_calls.clear()
    twin = copy.deepcopy(ours)
    assert twin.forward.__self__.module is twin and twin.forward.__self__.stacks[0][1] is twin.blocks
    assert_close(twin(x), model.double()(x.double()), model.float()(x), "deep copy")
    assert len(add_norm_calls) == 6 and len(seen) == 2


def _same_outputs(model, ours, x, what):
    with torch.no_grad():
        assert_close(ours(x), copy.deepcopy(model).double()(x.double()), model(x), what)


def test_add_into_norm_across_blocks_follows_the_stack_as_it_is(add_norm_calls):
    """A stack changed after patching (a block removed, replaced, or wrapped as activation
    checkpointing wraps them) runs as it is now: the model's forward calls its blocks."""
    x = randn(2, 3, 24)
    model, ours, _ = _pair(Stack)
    del model.blocks[2], ours.blocks[2]
    _same_outputs(model, ours, x, "a block removed")
    model, ours, _ = _pair(Stack)
    torch.manual_seed(1)
    model.blocks[1] = PreNormBlock().to(DEVICE)
    ours.blocks[1] = copy.deepcopy(model.blocks[1])
    _same_outputs(model, ours, x, "a block replaced")
    model.blocks = nn.Sequential(*model.blocks[:1])
    ours.blocks = copy.deepcopy(model.blocks)
    _same_outputs(model, ours, x, "the stack replaced")


def test_add_into_norm_hooks_after_patching_see_the_norm(add_norm_calls):
    """A hook registered after patching on a norm fused with the add before it sees the norm's
    call (the add and the norm run as written), here the model's final norm and a block's first."""
    model, ours, _ = _pair(Stack)
    seen = []
    for name in ("norm", "blocks.1.norm1"):
        ours.get_submodule(name).register_forward_hook(lambda m, args, out, name=name: seen.append(name))
    _same_outputs(model, ours, randn(2, 3, 24), "hooked norms")
    assert sorted(seen) == ["blocks.1.norm1", "norm"]


def test_stacks_left_alone(add_norm_calls):
    """Not run through: a Sequential subclass with a forward of its own (patch leaves it, and
    its code must run), and a stack called inside torch.utils.checkpoint (a trace would drop the
    checkpoint and keep what it recomputes)."""
    from torch.utils.checkpoint import checkpoint

    class Halving(nn.Sequential):
        def forward(self, x):
            for block in self:
                x = block(x) * 0.5
            return x

    class Checkpointed(Stack):
        def forward(self, x):
            return self.norm(checkpoint(self.blocks, x * 2.0 + self.offset, use_reentrant=False))

    def halving():
        stack = Stack()
        stack.blocks = Halving(*stack.blocks)
        return stack

    x = randn(2, 3, 24)
    model, ours, report = _pair(halving)
    assert sorted(report.fused) == [(f"blocks.{i}.norm2", "add+layer_norm") for i in range(3)]
    _same_outputs(model, ours, x, "Sequential subclass")
    model, ours, report = _pair(Checkpointed)
    assert "forward" not in vars(ours) and ("norm", "add+layer_norm") not in report.fused
    _same_outputs(model, ours, x, "checkpointed stack")


@pytest.mark.parametrize("model_name", ["block", "stack"])
def test_add_into_norm_traces_in_one_graph(model_name, add_norm_calls):
    """A fused block, and a stack fused across its blocks, compile whole (fullgraph)."""
    torch._dynamo.reset()
    make = (lambda: PreNormBlock(branch_dtype=torch.bfloat16)) if model_name == "block" else Stack
    model, ours, report = _pair(make)
    site = ("norm2", "add+layer_norm") if model_name == "block" else ("blocks.1.norm1", "add+layer_norm")
    assert site in report.fused
    compiled = torch.compile(ours, backend="aot_eager", fullgraph=True)
    x = randn(2, 3, 24)
    ref, _ = _run(copy.deepcopy(model).double(), x.double(), 0)
    got, _ = _run(compiled, x, 0)
    same, _ = _run(model, x, 0)
    assert_close(got, ref, same, f"compiled {model_name}")


def test_add_into_norm_across_blocks_with_a_narrower_branch(add_norm_calls):
    model, ours, report = _pair(lambda: Stack(branch_dtype=torch.bfloat16))
    assert sorted(report.fused) == sorted(STACK_SITES)
    _compare_steps(model, ours, randn(3, 5, 24), "stack, bf16 branches")
    # Each block's f branch is bf16 (its sum feeds norm2), its g branch fp32 (the next norm1).
    assert set(add_norm_calls) == {(torch.float32, torch.bfloat16), (torch.float32, torch.float32)}


def test_add_into_norm_left_alone_where_tracing_would_change_the_code(add_norm_calls):
    """Not fused: a sum changed in place before the norm reads it; modules whose forward has a
    default argument, a branch or a ``with`` block (not traced for this pattern at all)."""

    class InPlace(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.f = nn.LayerNorm(8), nn.Linear(8, 8)

        def forward(self, x):
            h = x + self.f(x)
            h.clamp_(min=0.0)
            return self.norm(h)

    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.f = nn.LayerNorm(8), nn.Linear(8, 8)

        def forward(self, x, mask=None):
            h = self.f(x)
            if mask is not None:
                h = h * mask
            return self.norm(x + h)

    class NoGrad(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.f = nn.LayerNorm(8), nn.Linear(8, 8)

        def forward(self, x):
            with torch.no_grad():
                h = self.f(x)
            return self.norm(x + h)

    model, ours, report = _pair(InPlace)
    assert report.fused == [] and report.skipped == []
    _compare_steps(model, ours, randn(4, 8), "in place")
    for make in (Masked, NoGrad):
        model, ours, report = _pair(make)
        assert report.fused == [] and report.skipped == [] and "forward" not in vars(ours)
    x, mask = randn(4, 8).requires_grad_(True), randn(4, 8)
    y = ours(x)
    assert_close(y, model(x), what="no_grad block")
    y.sum().backward()
    assert ours.f.weight.grad is None and x.grad is not None  # f ran without autograd, as written
    masked, masked_ours, _ = _pair(Masked)
    assert_close(masked_ours(x, mask), masked(x, mask), what="masked")
    assert add_norm_calls == []
