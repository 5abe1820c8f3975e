"""compile_graph: PyTorch functions traced with torch.fx into fused plans, against the functions
themselves (values in the 2x rule against float64, gradients in float64), the per-signature cache,
the eager fallback and its reasons."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tritondnn as tdnn
from helpers import DEVICE, assert_close, randn
from tritondnn.core.errors import NotSupportedError
from tritondnn.graph import KERNEL_CACHE_STATS, GraphFallbackWarning, compile_graph


def check_values(fn, *args):
    """The compiled function against fn in float64 (the reference) and in the args' dtypes."""
    compiled = compile_graph(fn)
    ours = compiled(*args)
    assert compiled.reason(*args) is None, compiled.reason(*args)
    ref = fn(*(a.double() if a.is_floating_point() else a for a in args))
    base = fn(*args)
    single = not isinstance(ours, tuple)
    ours, ref, base = ((ours,), (ref,), (base,)) if single else (ours, ref, base)
    assert len(ours) == len(base)
    for i, (o, r, b) in enumerate(zip(ours, ref, base)):
        if not isinstance(b, torch.Tensor):
            assert o == b, i
            continue
        assert o.shape == b.shape and o.dtype == b.dtype, i
        if o.dtype == torch.bool:
            assert torch.equal(o, b), i
        else:
            assert_close(o, r.to(o.dtype) if o.dtype == torch.float64 else r, b, f"output {i}")
    return compiled


def check_grads(fn, *args):
    """Float64 gradients of every input through the compiled function against torch autograd."""
    compiled = compile_graph(fn)
    xs = [a.double().requires_grad_(True) for a in args]
    refs = [a.double().requires_grad_(True) for a in args]
    ours, ref = compiled(*xs), fn(*refs)
    ours, ref = (ours if isinstance(ours, tuple) else (ours,)), (ref if isinstance(ref, tuple) else (ref,))
    dys = [torch.randn_like(r) for r in ref]
    got = torch.autograd.grad(ours, xs, dys)
    want = torch.autograd.grad(ref, refs, dys)
    for o, r in zip(ours, ref):
        torch.testing.assert_close(o.detach(), r.detach(), rtol=1e-10, atol=1e-10)
    for i, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10, msg=f"gradient of input {i}")
    assert compiled.plan(*xs) is not None
    return compiled


def pointwise_chain(x, y):
    z = torch.exp(-x.abs()) * 2.0 + y / (1.5 + y * y)
    z = torch.maximum(z, torch.sqrt(x * x + 0.25)) - torch.rsqrt(y.pow(2) + 1.0)
    z = torch.where(x > 0.1, z, 0.5 * torch.log(z.abs() + 1.0)) + torch.minimum(x, y) ** 3
    return F.silu(z) + torch.sigmoid(x) * torch.tanh(y) - F.softplus(y, beta=2.0) + F.elu(x, 0.5)


def linear_gelu(x, w, b):
    return F.gelu(F.linear(x, w, b), approximate="tanh")


def layer_norm_block(x, w, b, gamma, beta):
    h = x + F.gelu(x @ w.T + b)
    return F.layer_norm(h, (h.shape[-1],), gamma, beta, eps=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_pointwise_chain_values(dtype):
    x, y = randn(5, 17, dtype=dtype), randn(5, 17, dtype=dtype)
    compiled = check_values(pointwise_chain, x, y)
    assert compiled.plan(x, y).explain().count("generated") == 1  # one fused kernel


def test_activations_and_tdnn_functional():
    def fn(x):
        a = F.relu(x) + F.leaky_relu(x, 0.2) + F.gelu(x) + F.gelu(x, approximate="tanh")
        b = tdnn.relu(x, negative_slope=0.1) * tdnn.gelu(x) + tdnn.silu(x) - tdnn.sigmoid(x)
        return a, b + tdnn.tanh(x) + tdnn.softplus(x) + tdnn.elu(x) + tdnn.leaky_relu(x) + F.relu6(3 * x)

    x = randn(3, 2, 11)
    compiled = check_values(fn, x)
    assert "relu" in compiled.explain(x)


def test_comparisons_logic_scalars_and_tuple_outputs():
    def fn(x, y):
        m = (x > y) & ~(x <= -0.5) | (y == 0.25)
        return m, torch.where(m, x, 2.0 - y), 3, (1 - x) / 4 + x.shape[-1] ** -0.5

    x, y = randn(4, 9), randn(1, 9)
    compiled = check_values(fn, x, y)
    out = compiled(x, y)
    assert isinstance(out, tuple) and len(out) == 4 and out[2] == 3 and out[0].dtype == torch.bool


def test_reductions_and_layout():
    def fn(x):
        s = x.sum(dim=-1, keepdim=True) + x.mean(1, keepdim=True) - torch.amax(x, dim=(1, 2), keepdim=True)
        t = x.transpose(1, 2).reshape(x.shape[0], -1) * 2
        return s, t, torch.amin(x, 0), x.permute(2, 0, 1).sum(0), torch.softmax(x, dim=-1), x.mean()

    check_values(fn, randn(3, 5, 7))


def test_matmul_forms():
    def fn(a, b, v):
        return a @ b, torch.matmul(a, v), torch.bmm(a, b), (a.mT @ a).sum(-1)

    check_values(fn, randn(2, 6, 5), randn(2, 5, 3), randn(5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_linear_gelu_and_layer_norm_block_values(dtype):
    x, w, b = randn(2, 7, 16, dtype=dtype), randn(16, 16, dtype=dtype), randn(16, dtype=dtype)
    check_values(linear_gelu, x, w, b)
    gamma, beta = randn(16, dtype=dtype), randn(16, dtype=dtype)
    check_values(layer_norm_block, x, w, b, gamma, beta)
    check_values(lambda x, g: F.rms_norm(x * 0.5, (16,), g), x, gamma)
    check_values(lambda x, w, g: tdnn.layer_norm(tdnn.linear(x, w), (16,), g, activation="silu"), x, w, gamma)


@pytest.mark.gpu_only("Triton's interpreter computes bf16 tl.dot wrongly")
def test_bf16_linear_gelu():
    x, w, b = (randn(4, 33, 64, dtype=torch.bfloat16), randn(48, 64, dtype=torch.bfloat16), randn(48))
    check_values(linear_gelu, x, w, b.to(torch.bfloat16))


def test_gradients_pointwise_chain():
    check_grads(pointwise_chain, randn(4, 13), randn(4, 13))


def test_gradients_linear_gelu():
    check_grads(linear_gelu, randn(3, 9), randn(5, 9), randn(5))


def test_gradients_layer_norm_block():
    check_grads(layer_norm_block, randn(2, 3, 8), randn(8, 8), randn(8), randn(8), randn(8))


def test_gradients_some_inputs_and_tuple_outputs():
    compiled = compile_graph(lambda x, y: (x * y, (x + 1).exp(), y > 0))
    x = randn(6, dtype=torch.float64).requires_grad_(True)
    y = randn(6, dtype=torch.float64)
    a, b, m = compiled(x, y)
    assert a.requires_grad and not m.requires_grad
    (a.sum() + b.sum()).backward()
    torch.testing.assert_close(x.grad, y + (x.detach() + 1).exp())


def test_no_grad_mode_skips_autograd():
    compiled = compile_graph(lambda x: x * 3)
    x = randn(5).requires_grad_(True)
    with torch.no_grad():
        y = compiled(x)
    assert not y.requires_grad
    torch.testing.assert_close(y, x.detach() * 3)


def test_cache_second_call_builds_nothing():
    compiled = compile_graph(lambda x, y: F.gelu(x + y) * 0.5)
    x, y = randn(8, 9), randn(8, 9)
    first = compiled(x, y)
    kernels = dict(KERNEL_CACHE_STATS)
    plan = compiled.plan(x, y)
    x2, y2 = randn(8, 9), randn(8, 9)
    second = compiled(x2, y2)
    assert compiled.stats["builds"] == 1
    assert dict(KERNEL_CACHE_STATS) == kernels  # no kernel generated or even looked up
    assert compiled.plan(x2, y2) is plan
    torch.testing.assert_close(first, F.gelu(x + y) * 0.5)
    torch.testing.assert_close(second, F.gelu(x2 + y2) * 0.5)


def test_signature_change_rebuilds():
    compiled = compile_graph(lambda x: (x * 2).sum(-1))
    x = randn(4, 6)
    compiled(x)
    for other in (randn(5, 6), randn(6, 4).t(), randn(4, 6, dtype=torch.float64)):
        torch.testing.assert_close(compiled(other), (other * 2).sum(-1))
    assert compiled.stats["builds"] == 4
    compiled(x)
    assert compiled.stats["builds"] == 4


def test_shape_dependent_python_traces_with_concrete_shapes():
    def fn(x):
        if x.ndim == 3:
            x = x.flatten(0, 1)
        return x * (1.0 / x.size(-1))

    check_values(fn, randn(2, 3, 4))
    check_values(fn, randn(6, 4))


def test_unsupported_op_falls_back_with_reason():
    fn = lambda x: torch.cumsum(x, 0) + 1
    compiled = compile_graph(fn)
    x = randn(5, 3)
    with pytest.warns(GraphFallbackWarning, match="cumsum"):
        y = compiled(x)
    torch.testing.assert_close(y, fn(x))
    assert "cumsum" in compiled.reason(x) and compiled.plan(x) is None
    assert "eager fallback" in compiled.explain(x)
    assert compiled.stats["fallbacks"] == 1
    with pytest.raises(NotSupportedError, match="cumsum"):
        compile_graph(fn, strict=True)(x)


def test_data_dependent_control_flow_and_inplace_fall_back():
    def branchy(x):
        return x * 2 if x.sum() > 0 else x

    def inplace(x):
        return F.relu(x * 2, inplace=True)

    x = randn(4)
    for fn, why in ((branchy, "trace"), (inplace, "in-place")):
        compiled = compile_graph(fn)
        with pytest.warns(GraphFallbackWarning, match=why):
            torch.testing.assert_close(compiled(x), fn(x))


def test_bad_arguments():
    with pytest.raises(ValueError, match="mode"):
        compile_graph(lambda x: x, mode="turbo")
    with pytest.raises(TypeError, match="callable"):
        compile_graph(3)
    with pytest.raises(TypeError, match="argument 1"):
        compile_graph(lambda x, s: x * s)(randn(3), 2.0)


def test_device_of_outputs():
    out = compile_graph(lambda x: x + 1)(randn(3))
    assert out.device.type == torch.device(DEVICE).type


def test_indexing_clamp_alpha_and_casts():
    def fn(x, y):
        a = x[1, 2:] * x[-1, :-2] + x[None].sum(0)[0, 1:4:2].sum()
        b = torch.clamp(torch.add(x, y, alpha=2), -0.5, 0.5) - torch.sub(x, 1.5, alpha=3)
        return a, b.to(torch.float64), x[:, 0, ...].t() @ y[0, :4, 1:4]

    check_values(fn, randn(4, 8, 5), randn(1, 8, 5))


def test_captured_tensors_and_modules_fall_back():
    captured = randn(6)
    linear = torch.nn.Linear(6, 3).to(DEVICE)
    x = randn(2, 6)
    for fn, why in ((lambda x: x * captured, "captured"), (linear, "pass tensors as arguments")):
        compiled = compile_graph(fn)
        with pytest.warns(GraphFallbackWarning, match=why):
            torch.testing.assert_close(compiled(x), fn(x))


def test_torch_compile_still_traces_tritondnn_ops_after_a_bridge_trace():
    """fx's tracing must not leave torch._dynamo unable to trace math.isfinite (the argument
    checks of tritondnn's ops call it) in later fullgraph compiles."""
    x = randn(4, 8)
    compile_graph(lambda a: torch.relu(a) * 2)(x)
    torch._dynamo.reset()
    compiled = torch.compile(lambda a: tdnn.silu(a, beta=1.5).sum(), backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), tdnn.silu(x, beta=1.5).sum())
