"""Library steps: nodes (with what folded into them) run by tritondnn's existing ops.

``library_runner(step, ...)`` returns ``run(env, device, presets)`` calling the op with every
argument that does not change between executes worked out at build (``Epilogue`` objects, shapes,
flags), and ``predict_layouts`` says which strides each op's outputs will have, so the
generated kernels after them can be bound at build.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ..core.engine import engines
from ..ops import attention, conv, matmul, norm, pool, reduce
from ..ops.epilogue import Epilogue

# The norm ops' custom ops, private to ops/norm: the public layer_norm / rms_norm / instance_norm
# return only y, and no public function runs the layer/RMS/group norm backward from given
# statistics; these are what their autograd Functions call (_LayerNormFunction, _GroupNormFunction).
from ..ops.norm import group as _group_ops
from ..ops.norm import layer as _layer_ops
from ..ops.norm.common import NO_ACTIVATION, activation_kind
from .partition import Step, empty_fold
from .types import GraphTensor, contiguous_strides, layout_strides

Run = Callable[[list, torch.device, "dict | None"], None]
_CONV = {1: conv.conv1d, 2: conv.conv2d, 3: conv.conv3d}
_ENGINE_ACTIVATION = {"leaky_relu": "relu", "swish": "silu"}


def _channels_last(t: GraphTensor, stride: tuple[int, ...]) -> bool:
    return t.ndim >= 3 and stride == layout_strides(t.shape, "channels_last") and t.shape[1] > 1


def predict_layouts(step: Step, layouts: dict) -> dict[int, tuple[int, ...]]:
    """The strides each output of a library step is expected to have (checked again per call by
    the generated kernels reading them)."""
    node = step.main
    assert node is not None
    lead = node.inputs[1] if node.kind == "norm_backward" else node.inputs[0]  # dx follows x
    if "prologue" in step.fold:  # the convolution reads the chain's input
        lead = step.fold["prologue"]["x"]
    first = lead if step.fold.get("add") is None else step.fold["add"].inputs[0]
    assert first is not None
    keep = _channels_last(first, layouts[first.uid][0]) and node.op in (
        "conv_fprop",
        "conv_dgrad",
        "batchnorm",
        "batchnorm_backward",
        "instancenorm",
        "instancenorm_backward",
        "pool",
        "resample",
    )
    y = node.outputs[0]
    out = {}
    for t in node.outputs:  # statistics and parameter gradients are contiguous
        cl = keep and t is y and t.ndim == first.ndim
        out[t.uid] = layout_strides(t.shape, "channels_last") if cl else contiguous_strides(t.shape)
    final = step.nodes[-1].outputs[0] if step.nodes[-1] is not node else y
    if final is not y:
        out[final.uid] = out.pop(y.uid)
    if step.fold.get("add") is not None:
        out[step.fold["add"].outputs[0].uid] = contiguous_strides(first.shape)
    return out


def _env(t: GraphTensor | None) -> int | None:
    return None if t is None else t.uid


def library_runner(step: Step, algo: str | None = None) -> Run:
    """The runner of a library step (see the module docstring); ``algo`` forces a convolution engine."""
    node = step.main
    assert node is not None
    op, a, fold = node.op, node.attrs, step.fold
    ins = [_env(t) for t in node.inputs]
    outs = [t.uid for t in node.outputs]

    def get(env: list, i: int | None) -> Any:
        return None if i is None else env[i]

    if op in ("matmul", "conv_fprop"):
        fold = {**empty_fold(node), **fold}  # empty in the fallback mode
        final = fold["final"].uid
        c, bias, res = _env(fold["c"]), _env(fold["bias"]), _env(fold["residual"])
        act = fold["activation"]
        epi = Epilogue(
            alpha=fold["alpha"],
            beta=1.0 if c is not None else 0.0,
            bias="col" if bias is not None and op == "matmul" else "none",
            activation=_ENGINE_ACTIVATION.get(act, act) if act else None,
            activation_params=tuple(fold["params"]),
            residual=res is not None,
            out_dtype=fold["final"].dtype,
        )
        x, w = ins[0], ins[1]
        if op == "matmul":

            def run(env: list, device: torch.device, presets: dict | None) -> None:
                b = None if bias is None else env[bias].reshape(-1)
                env[final] = matmul.matmul(
                    env[x], env[w], epilogue=epi, c=get(env, c), bias=b, residual=get(env, res)
                )

            return run
        nd = len(node.inputs[0].shape) - 2  # type: ignore[union-attr]
        geo = (a["stride"], a["padding"], a["dilation"], a["groups"])
        # A prologue (partition._fold_prologue): the convolution reads the chain's input x and
        # applies its per-channel scale and shift ((C,) and contiguous, as the kernel reads them:
        # a strided feed or view is copied) and ReLU.
        pro = fold.get("prologue")
        if pro is not None:
            x = _env(pro["x"])
        per_channel_ids = () if pro is None else (_env(pro["scale"]), _env(pro["shift"]))
        # The convolution's plan bound once per tensor signature: a plan executes many times on
        # the same shapes, and conv{nd}d's checks and dispatch cost more host time than a 3x3
        # 64 @56 kernel takes (118-159 us an execute on slower hosts for ~70 us of kernel).
        bound: dict[tuple, Callable[..., torch.Tensor] | None] = {}

        def run(env: list, device: torch.device, presets: dict | None) -> None:
            b = None if bias is None else env[bias].reshape(-1)
            per_channel = [None if i is None else env[i].reshape(-1).contiguous() for i in per_channel_ids]
            tensors = (env[x], env[w], b, get(env, c), get(env, res), *per_channel)
            options = {"algo": algo, "epilogue": epi, "c": tensors[3], "residual": tensors[4]}
            program = None
            if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)):
                key = tuple(None if t is None else (t.shape, t.stride(), t.dtype, t.device) for t in tensors)
                if key not in bound:
                    prologue = None if pro is None else (*per_channel, pro["relu"])
                    bound[key] = conv.bound_forward(nd, *tensors[:3], *geo, **options, prologue=prologue)
                program = bound[key]
            if program is not None:
                env[final] = program(*tensors)
                return
            # Autograd, or arguments the checks adapt per call: conv{nd}d, after the prologue in
            # torch where there is one.
            xin = tensors[0] if pro is None else _torch_prologue(tensors[0], *per_channel, pro["relu"])
            env[final] = _CONV[nd](xin, *tensors[1:3], *geo, **options)

        return run
    if op == "conv_dgrad":
        geo = (a["stride"], a["padding"], a["dilation"], a["groups"])
        return _simple(
            lambda e: conv.conv_backward_data(e[ins[0]], e[ins[1]], a["x_shape"], *geo, algo=algo), outs
        )
    if op == "conv_wgrad":
        geo = (a["stride"], a["padding"], a["dilation"], a["groups"])
        return _simple(
            lambda e: conv.conv_backward_weight(e[ins[0]], e[ins[1]], a["w_shape"], *geo, algo=algo), outs
        )
    if op == "reduction":
        dims, keep = a["dim"], a["keepdim"]
        return _simple(lambda e: reduce.reduce_tensor(e[ins[0]], a["mode"], dims, keep), outs)
    act = fold.get("activation")
    final = step.nodes[-1].outputs[0].uid if act else outs[0]
    if op == "batchnorm":
        x, w, b, rm, rv = ins
        mom, eps = a["momentum"], a["eps"]

        def run(env: list, device: torch.device, presets: dict | None) -> None:
            xt = env[x]
            c = xt.shape[1]
            ch = [None if i is None else env[i].reshape(c) for i in (w, b, rm, rv)]
            sums = norm.batch_norm_stats(xt)
            y, mean, rstd = norm.batch_norm_apply(xt, *sums, *ch, momentum=mom, eps=eps, activation=act)
            env[final], env[outs[1]], env[outs[2]] = y, mean, rstd

        return run
    if a.get("training") or node.kind == "norm_backward":
        return _norm_stats_runner(step, ins, outs, final, act)
    if op in ("layernorm", "rmsnorm"):
        shape, eps = a["normalized_shape"], a["eps"]
        add = fold.get("add")
        if add is not None:
            r1, r2 = add.inputs[0].uid, add.inputs[1].uid
            total = add.outputs[0].uid
            if op == "layernorm":
                call = lambda e: norm.add_layer_norm(e[r1], e[r2], shape, get(e, ins[1]), get(e, ins[2]), eps)
            else:
                call = lambda e: norm.add_rms_norm(e[r1], e[r2], shape, get(e, ins[1]), eps)

            def run(env: list, device: torch.device, presets: dict | None) -> None:
                env[final], env[total] = call(env)

            return run
        if op == "layernorm":
            return _simple(
                lambda e: norm.layer_norm(
                    e[ins[0]], shape, get(e, ins[1]), get(e, ins[2]), eps, activation=act
                ),
                [final],
            )
        return _simple(
            lambda e: norm.rms_norm(e[ins[0]], shape, get(e, ins[1]), eps, activation=act), [final]
        )
    if op == "instancenorm":
        return _simple(
            lambda e: norm.instance_norm(
                e[ins[0]], None, None, get(e, ins[1]), get(e, ins[2]), True, 0.1, a["eps"], activation=act
            ),
            [final],
        )
    if op == "sdpa":
        flags = (0.0, a["is_causal"], a["scale"], a["enable_gqa"])

        def run(env: list, device: torch.device, presets: dict | None) -> None:
            r = attention.sdpa(
                env[ins[0]], env[ins[1]], env[ins[2]], get(env, ins[3]), *flags, return_lse=a["return_stats"]
            )
            if a["return_stats"]:
                env[outs[0]], env[outs[1]] = r
            else:
                env[outs[0]] = r

        return run
    if op == "sdpa_backward":
        flags = (0.0, a["is_causal"], a["scale"], a["enable_gqa"])

        def run(env: list, device: torch.device, presets: dict | None) -> None:
            g = attention.sdpa_backward(*(env[i] for i in ins[:6]), get(env, ins[6]), *flags)
            env[outs[0]], env[outs[1]], env[outs[2]] = g.dq, g.dk, g.dv

        return run
    if op == "pool":
        nd = len(node.outputs[0].shape) - 2
        k, s, p, d = a["kernel_size"], a["stride"], a["padding"], a["dilation"]
        if a["mode"] == "max":
            fn = (pool.max_pool1d, pool.max_pool2d, pool.max_pool3d)[nd - 1]
            return _simple(lambda e: fn(e[ins[0]], k, s, p, d, a["ceil_mode"]), outs)
        fn = (pool.avg_pool1d, pool.avg_pool2d, pool.avg_pool3d)[nd - 1]
        return _simple(lambda e: fn(e[ins[0]], k, s, p, a["ceil_mode"], a["count_include_pad"]), outs)
    if op == "resample":
        args = (a["size"], a["scale_factor"], a["mode"], a["align_corners"])
        return _simple(lambda e: pool.interpolate(e[ins[0]], *args), outs)
    if step.kind == "view":
        if op == "reshape":
            shape = tuple(a["shape"])
            view = lambda t: t.reshape(shape)
        elif op == "transpose":
            dims = tuple(a["dims"])
            view = lambda t: t.permute(dims)
        else:
            index = (slice(None),) * a["dim"] + (slice(a["start"], a["end"], a["step"]),)
            view = lambda t: t[index]
        if node.outputs[0].is_output:  # an output never aliases an input or another output
            return _simple(lambda e: view(e[ins[0]]).clone(), outs)
        return _simple(lambda e: view(e[ins[0]]), outs)
    raise NotImplementedError(f"tdnn.Graph: no runner for {op}")  # every builder's op is listed above


def _flat_stats(t: torch.Tensor) -> torch.Tensor:
    """Saved statistics as the ops take them: one contiguous fp32 value per row."""
    return t.reshape(-1).to(torch.float32).contiguous()


def _norm_stats_runner(step: Step, ins: list, outs: list[int], final: int, act: str | None) -> Run:
    """Norms in training (y and the saved statistics) and the norm backward nodes."""
    node = step.main
    assert node is not None
    op, a = node.op, node.attrs
    if op in ("layernorm", "rmsnorm", "instancenorm"):
        kind, p0, p1 = activation_kind(act)
        stats = node.outputs[1].shape
        add = step.fold.get("add")
        if op == "instancenorm":

            def run(env: list, device: torch.device, presets: dict | None) -> None:
                x = env[ins[0]]
                w, b = (None if i is None else env[i] for i in ins[1:])
                y, mean, rstd = _group_ops._forward(x, w, b, x.shape[1], a["eps"], kind, p0, p1)
                env[final], env[outs[1]], env[outs[2]] = y, mean.view(stats), rstd.view(stats)

            return run
        rms, eps, n_cols = op == "rmsnorm", a["eps"], math.prod(a["normalized_shape"])
        x_in, b_in = (ins[0], None) if add is None else (add.inputs[0].uid, add.inputs[1].uid)
        total = None if add is None else add.outputs[0].uid

        def run(env: list, device: torch.device, presets: dict | None) -> None:
            res = None if b_in is None else env[b_in]
            w, b = (None if i is None else env[i] for i in (ins[1], None if rms else ins[2]))
            y, s, moments = _layer_ops._forward(env[x_in], res, w, b, n_cols, eps, rms, kind, p0, p1)
            env[final] = y
            if total is not None:
                env[total] = s
            if rms:
                env[outs[1]] = moments[1].view(stats)
            else:
                env[outs[1]], env[outs[2]] = moments[0].view(stats), moments[1].view(stats)

        return run
    dy_i, x_i, w_i = ins[:3]
    pshape, pdtype = node.outputs[1].shape, node.outputs[1].dtype
    constants: dict[tuple, torch.Tensor] = {}  # made once per device, never written

    def constant(value: float, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        key = (value, device)
        if key not in constants:
            constants[key] = torch.full(shape, value, dtype=dtype, device=device)
        return constants[key]

    def weight(env: list, device: torch.device) -> torch.Tensor:
        # Without a scale, a unit one: the ops return dweight only for a weight they are given.
        return env[w_i] if w_i is not None else constant(1.0, pshape, pdtype, device)

    if op == "batchnorm_backward":

        def run(env: list, device: torch.device, presets: dict | None) -> None:
            dy, x = env[dy_i], env[x_i]
            c = x.shape[1]
            w, mean, rstd = (None if i is None else env[i].reshape(c) for i in ins[2:])
            sum_dy, sum_dy_xhat = norm.batch_norm_backward_reduce(dy, x, mean, rstd, w)
            count = max(x.numel() // max(c, 1), 1)
            env[outs[0]] = norm.batch_norm_backward_apply(dy, x, mean, rstd, w, sum_dy, sum_dy_xhat, count)
            env[outs[1]] = sum_dy_xhat.to(pdtype).reshape(pshape)  # dscale = sum(dy * x_hat)
            env[outs[2]] = sum_dy.to(pdtype).reshape(pshape)

        return run
    # The bias operand is read only by a fused activation (none here): the weight stands in for
    # it so that the op also returns dbias.
    if op == "instancenorm_backward":

        def run(env: list, device: torch.device, presets: dict | None) -> None:
            x, w = env[x_i], weight(env, device)
            mean, rstd = _flat_stats(env[ins[3]]), _flat_stats(env[ins[4]])
            grads = _group_ops._backward(
                env[dy_i], x, w, w, mean, rstd, x.shape[1], NO_ACTIVATION, 0.0, 0.0, True, True
            )
            for i, g in zip(outs, grads):
                env[i] = g

        return run
    rms = op == "rmsnorm_backward"
    n_cols = math.prod(a["normalized_shape"])

    def run(env: list, device: torch.device, presets: dict | None) -> None:
        w = weight(env, device)
        rstd = _flat_stats(env[ins[-1]])
        # RMS: a zero mean (x_hat = x * rstd), as the forward saves for the autograd backward;
        # the kernel reads both from one (2, rows) buffer.
        mean = constant(0.0, rstd.shape, rstd.dtype, rstd.device) if rms else _flat_stats(env[ins[3]])
        grads = _layer_ops._backward(
            env[dy_i], env[x_i], w, None if rms else w, torch.stack((mean, rstd)), None, n_cols, rms,
            NO_ACTIVATION, 0.0, 0.0, True, not rms,
        )  # fmt: skip
        for i, g in zip(outs, grads):
            env[i] = g

    return run


def _simple(fn: Callable[[list], Any], outs: list[int]) -> Run:
    if len(outs) == 1:
        (o,) = outs

        def run(env: list, device: torch.device, presets: dict | None) -> None:
            env[o] = fn(env)

        return run

    def run_many(env: list, device: torch.device, presets: dict | None) -> None:
        for i, r in zip(outs, fn(env)):
            env[i] = r

    return run_many


def _torch_prologue(x: torch.Tensor, scale, shift, relu: bool) -> torch.Tensor:
    """``relu(x * scale + shift)`` per channel in torch (fp32, fp64 for fp64), rounded once to x's
    dtype: what the implicit GEMM's prologue computes, differentiable."""
    v = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    shape = (1, -1, *([1] * (x.ndim - 2)))
    if scale is not None:
        v = v * scale.view(shape)
    if shift is not None:
        v = v + shift.view(shape)
    return (torch.relu(v) if relu else v).to(x.dtype)


def conv_engines(step: Step, env: list) -> list[str]:
    """Names of the engines that can run a convolution step on ``env``'s tensors (benchmark mode)."""
    node = step.main
    assert node is not None
    if "prologue" in step.fold:
        return ["implicit_gemm"]  # the one engine that applies it
    a = node.attrs
    x, w = (env[t.uid] for t in node.inputs[:2])  # type: ignore[union-attr]
    geo = (a["stride"], a["padding"], a["dilation"], a["groups"])
    if node.op == "conv_fprop":
        reports = engines("conv", x, w, None, *geo)
    elif node.op == "conv_dgrad":
        reports = engines("conv_dgrad", x, w, a["x_shape"], *geo)
    else:
        reports = engines("conv_wgrad", x, w, a["w_shape"], *geo)
    return [r.name for r in reports if r.supported]
