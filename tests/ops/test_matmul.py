"""Matmul and linear: torch.matmul's shapes, layouts read in place, every epilogue option, every
engine and config, gradients of every input, determinism, errors, the library ops, torch.compile."""

from __future__ import annotations

import contextlib
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import tritondnn as tdnn
from helpers import DEVICE, ON_GPU, assert_close, randn
from tritondnn.ops import matmul as mm
from tritondnn.ops.epilogue import Epilogue
from tritondnn.ops.matmul import engines as mm_engines
from tritondnn.ops.matmul import plans as mm_plans

CPU_DTYPES = (torch.float16, torch.float32)
BF16_ON_GPU = "Triton's interpreter computes bf16 tl.dot wrongly"
FP8_ON_GPU = "fp8 tl.dot needs a Hopper GPU; the interpreter has no fp8"

# The activations in the operands' own dtype, as PyTorch computes them (for its error bound).
TORCH_ACT = {
    "relu": lambda x, p0, p1: torch.where(x > 0, torch.where(x >= p1, p1, x), x * p0),
    "elu": lambda x, p0, p1: F.elu(x, alpha=p0),
    "sigmoid": lambda x, p0, p1: torch.sigmoid(x),
    "tanh": lambda x, p0, p1: torch.tanh(x),
    "gelu": lambda x, p0, p1: F.gelu(x),
    "gelu_tanh": lambda x, p0, p1: F.gelu(x, approximate="tanh"),
    "silu": lambda x, p0, p1: x * torch.sigmoid(p0 * x),
    "softplus": lambda x, p0, p1: F.softplus(x, beta=p0, threshold=p1),
}


def _torch_matmul(a, b, epi: Epilogue, c=None, bias=None, residual=None, out_dtype=None):
    """The same computation composed of PyTorch ops in the operands' dtype."""
    y = torch.matmul(a, b) * epi.alpha
    if c is not None:
        y = y + epi.beta * c
    if bias is not None:
        y = y + (bias[:, None] if epi.bias == "row" and a.ndim > 1 and b.ndim > 1 else bias)
    if epi.activation is not None:
        y = TORCH_ACT[epi.activation](y, *epi.params)
    if residual is not None:
        y = y + residual
    return y.to(out_dtype or a.dtype)


def _check(a, b, epi=None, c=None, bias=None, residual=None, out_dtype=None, grads=True, what=""):
    """Output (and pre-activation) against the float64 reference, and every input's gradient."""
    epi = epi or Epilogue()
    named = {"a": a, "b": b, "c": c, "bias": bias, "residual": residual}
    inputs = {k: v for k, v in named.items() if v is not None}
    leaves = {k: v.detach().requires_grad_(grads) for k, v in inputs.items()}
    leaves64 = {k: v.detach().double().requires_grad_(grads) for k, v in inputs.items()}
    kw = {k: leaves.get(k) for k in ("c", "bias", "residual")}
    result = mm.matmul(leaves["a"], leaves["b"], epilogue=epi, out_dtype=out_dtype, **kw)
    out, pre = (result.out, result.preactivation) if epi.store_preactivation else (result, None)
    torch_out = _torch_matmul(*(inputs.get(k) for k in ("a", "b")), epi, c, bias, residual, out_dtype)
    kw64 = {k: leaves64.get(k) for k in ("c", "bias", "residual")}
    ref, ref_pre = mm.matmul_reference(leaves64["a"], leaves64["b"], epilogue=epi, **kw64)
    assert out.dtype == (out_dtype or epi.out_dtype or a.dtype) and out.shape == ref.shape
    assert_close(out.detach(), ref.detach(), torch_out, f"{what} forward")
    if pre is not None:
        assert_close(pre, ref_pre.detach(), what=f"{what} pre-activation")
    if not grads:
        return
    dy = torch.randn(out.shape, device=DEVICE, dtype=out.dtype)
    ours = torch.autograd.grad(out, list(leaves.values()), dy)
    theirs = torch.autograd.grad(ref, list(leaves64.values()), dy.double())
    torch_leaves = {k: v.detach().requires_grad_(True) for k, v in inputs.items()}
    torch_y = _torch_matmul(
        torch_leaves["a"],
        torch_leaves["b"],
        epi,
        *(torch_leaves.get(k) for k in ("c", "bias", "residual")),
        out_dtype,
    )
    torch_grads = torch.autograd.grad(torch_y, list(torch_leaves.values()), dy)
    for name, g, g_ref, g_torch in zip(leaves, ours, theirs, torch_grads):
        assert g.dtype == inputs[name].dtype and g.shape == inputs[name].shape
        assert_close(g, g_ref, g_torch, f"{what} d{name}")


# ---------------------------------------------------------------------------------------------
# Values, shapes and layouts.


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("mnk", [(37, 41, 29), (64, 64, 64), (3, 70, 131), (97, 5, 23)], ids=str)
def test_values_and_gradients(mnk, dtype, poison):
    m, n, k = mnk
    _check(randn(m, k, dtype=dtype), randn(k, n, dtype=dtype), what=f"{mnk}")


@pytest.mark.gpu_only(BF16_ON_GPU)
@pytest.mark.parametrize("mnk", [(37, 41, 29), (128, 256, 64), (3, 70, 131), (300, 7, 515)], ids=str)
def test_bf16(mnk, poison):
    m, n, k = mnk
    a, b = randn(m, k, dtype=torch.bfloat16), randn(k, n, dtype=torch.bfloat16)
    _check(a, b, what=f"bf16 {mnk}")
    epi = Epilogue(bias="col", activation="gelu", residual=True)
    _check(a, b, epi, bias=randn(n, dtype=torch.bfloat16), residual=randn(m, n, dtype=torch.bfloat16))


LAYOUTS = {
    "contiguous": lambda t: t,
    "transposed": lambda t: t.mT.contiguous().mT,  # column-major: the matrix's rows are strided
    "sliced": lambda t: torch.cat([t, t], -1)[..., ::2],  # every second element of a wider buffer
    "row-sliced": lambda t: torch.cat([t, t], -2)[..., 1::2, :],
}


@pytest.mark.parametrize("layout_b", list(LAYOUTS))
@pytest.mark.parametrize("layout_a", list(LAYOUTS))
def test_layouts_are_read_in_place(layout_a, layout_b, poison):
    a = LAYOUTS[layout_a](randn(33, 20))
    b = LAYOUTS[layout_b](randn(20, 47))
    problem = mm.FAMILY.describe(a, b)
    assert problem.a_strides[2:] == a.stride() and problem.b_strides[2:] == b.stride(), "no copy"
    _check(a, b, grads=layout_a == "transposed", what=f"{layout_a} @ {layout_b}")


SHAPES = [
    ((7,), (7,)),  # dot product: a 0-d result
    ((5, 7), (7,)),  # matrix @ vector
    ((7,), (7, 6)),
    ((7,), (3, 7, 6)),  # 1-D @ batched
    ((2, 5, 7), (7,)),
    ((3, 5, 7), (7, 6)),  # B without a batch: the batch folds into A's rows
    ((5, 7), (3, 7, 6)),  # A broadcast over B's batch
    ((2, 1, 5, 7), (3, 7, 6)),  # both broadcast: two batch dimensions
    ((1, 3, 5, 7), (2, 1, 7, 6)),
    ((120, 9), (9, 3)),  # few columns, many rows: solved transposed
]


@pytest.mark.parametrize(("shape_a", "shape_b"), SHAPES, ids=str)
def test_torch_matmul_shapes(shape_a, shape_b, poison):
    _check(randn(*shape_a), randn(*shape_b), what=f"{shape_a} @ {shape_b}")


def test_batch_dimensions_that_do_not_merge_are_copied(poison):
    """Three batch dimensions that no stride pattern merges: the operands are copied into one."""
    a = randn(2, 3, 4, 5, 6).permute(1, 0, 2, 3, 4)[:, :, ::2]  # (3, 2, 2, 5, 6)
    b = randn(1, 2, 1, 6, 4)
    _check(a, b)


def test_batched_with_transposed_batch_strides(poison):
    a = randn(5, 4, 9).permute(1, 0, 2)  # batch is not the outermost dimension in memory
    b = randn(4, 3, 9).mT
    _check(a, b)


@pytest.mark.parametrize(
    ("shape_a", "shape_b"),
    [((0, 5), (5, 4)), ((3, 5), (5, 0)), ((0, 3, 5), (5, 4)), ((4, 0), (0, 6))],
    ids=str,
)
def test_empty_dimensions(shape_a, shape_b, poison):
    """M, N or the batch of size 0 give an empty output; K = 0 gives zeros, and the epilogue of zeros."""
    a, b = randn(*shape_a), randn(*shape_b)
    _check(a, b)
    if a.shape[-1] == 0:
        n = b.shape[-1]
        bias = randn(n)
        out = mm.matmul(a, b, epilogue=Epilogue(bias="col", activation="sigmoid"), bias=bias)
        assert_close(out, torch.sigmoid(bias.double()).expand(4, n))


# ---------------------------------------------------------------------------------------------
# Epilogues.

EPILOGUES = {
    "alpha": Epilogue(alpha=0.5),
    "alpha-beta-c": Epilogue(alpha=-1.5, beta=0.75),
    "bias-col": Epilogue(bias="col"),
    "bias-row": Epilogue(bias="row"),
    "residual": Epilogue(residual=True),
    "bias-gelu-residual": Epilogue(bias="col", activation="gelu", residual=True),
    "beta-c-relu-pre": Epilogue(beta=1.0, activation="relu", store_preactivation=True),
    "leaky-clipped-relu": Epilogue(activation="relu", activation_params=(0.1, 1.5)),
    **{name: Epilogue(bias="row", activation=name, store_preactivation=True) for name in TORCH_ACT},
    "swish-beta": Epilogue(activation="silu", activation_params=(1.7,)),
    "softplus-params": Epilogue(activation="softplus", activation_params=(2.0, 3.0)),
}


def _epilogue_inputs(epi: Epilogue, m: int, n: int, dtype: torch.dtype, c_shape=None) -> dict:
    return {
        "c": randn(*(c_shape or (m, n)), dtype=dtype) if epi.beta else None,
        "bias": randn({"col": n, "row": m}[epi.bias], dtype=dtype) if epi.bias != "none" else None,
        "residual": randn(m, n, dtype=dtype) if epi.residual else None,
    }


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("name", list(EPILOGUES))
def test_epilogue(name, dtype, poison):
    epi = EPILOGUES[name]
    m, n, k = 19, 37, 24
    a, b = randn(m, k, dtype=dtype), randn(k, n, dtype=dtype)
    _check(a, b, epi, **_epilogue_inputs(epi, m, n, dtype), what=name)


def test_epilogue_with_broadcast_inputs_and_batch(poison):
    """C broadcast along rows, a residual broadcast over the batch, bias per row of each matrix."""
    epi = Epilogue(alpha=2.0, beta=-1.0, bias="row", activation="tanh", residual=True)
    a, b = randn(3, 6, 10), randn(3, 10, 8)
    _check(a, b, epi, c=randn(8), bias=randn(6), residual=randn(6, 8))
    _check(a, b.mT.contiguous().mT, epi, c=randn(3, 1, 8), bias=randn(6), residual=randn(3, 6, 8))


@pytest.mark.parametrize(
    ("shape_a", "shape_b"), [((7,), (7, 6)), ((5, 7), (7,)), ((120, 9), (9, 3))], ids=str
)
def test_epilogue_on_vectors_and_transposed_problems(shape_a, shape_b, poison):
    """Per-column and per-row bias keep their meaning when a vector operand or a transposed
    (few-columns) problem moves rows and columns around."""
    a, b = randn(*shape_a), randn(*shape_b)
    m = shape_a[0] if len(shape_a) == 2 else 1
    n = shape_b[1] if len(shape_b) == 2 else 1
    shape = torch.matmul(a, b).shape
    for bias_kind in ("col", "row"):
        epi = Epilogue(bias=bias_kind, activation="silu", residual=True)
        bias = randn(n if bias_kind == "col" else m)
        _check(a, b, epi, bias=bias, residual=randn(*shape), what=bias_kind)


@pytest.mark.parametrize(
    ("dtype", "out_dtype"), [(torch.float16, torch.float32), (torch.float32, torch.float16)]
)
def test_output_dtype(dtype, out_dtype, poison):
    a, b = randn(21, 30, dtype=dtype), randn(30, 11, dtype=dtype)
    _check(
        a, b, Epilogue(bias="col", activation="gelu_tanh"), bias=randn(11, dtype=dtype), out_dtype=out_dtype
    )
    out = mm.matmul(a, b, epilogue=Epilogue(out_dtype=out_dtype))
    assert out.dtype == out_dtype


def test_amax_output(poison):
    a, b = randn(30, 20), randn(20, 50)
    out, pre, amax = mm.matmul(
        a, b, epilogue=Epilogue(bias="col", activation="elu"), bias=randn(50), amax=True
    )
    assert pre is None and amax.shape == () and amax.dtype == torch.float32
    assert float(amax) == float(out.abs().max())


# ---------------------------------------------------------------------------------------------
# Engines: each one, with each of its configs, on a problem it accepts.


def _launch_args(problem, lay, a, b, c, bias, residual, alpha, beta, p0, p1):
    out = torch.empty(lay.out_shape, dtype=a.dtype, device=DEVICE)
    pre = torch.empty_like(out) if problem.store_pre else out
    amax = torch.zeros((), device=DEVICE) if problem.amax else out
    first, second = (b, a) if lay.swapped else (a, b)
    fill = lambda t: out if t is None else t
    return (
        out,
        pre,
        amax,
        (first, second, out, fill(c), fill(bias), fill(residual), pre, out, out, amax, alpha, beta, p0, p1),
    )


ENGINE_PROBLEMS = {
    "square": (20, 50, 300),
    "decode": (1, 70, 300),
    "skinny": (16, 40, 200),
    "odd": (37, 29, 131),
}


@pytest.mark.parametrize(
    "dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.gpu_only(BF16_ON_GPU))], ids=str
)
@pytest.mark.parametrize("problem_name", list(ENGINE_PROBLEMS))
def test_every_engine_and_config(problem_name, dtype, poison, cache_dir):
    """Benchmark mode may pick any engine and config: each must be right on every problem it takes."""
    m, n, k = ENGINE_PROBLEMS[problem_name]
    epi = Epilogue(
        alpha=0.5, beta=1.0, bias="col", activation="silu", residual=True, store_preactivation=True
    )
    a, b = randn(m, k, dtype=dtype), randn(k, n, dtype=dtype).mT.contiguous().mT
    extra = _epilogue_inputs(epi, m, n, dtype)
    ref, ref_pre = mm.matmul_reference(a, b, epilogue=epi, **extra)
    torch_out = _torch_matmul(a, b, epi, **extra)
    lay = mm_engines.layout(
        a,
        b,
        extra["c"],
        extra["bias"],
        extra["residual"],
        out_dtype=a.dtype,
        bias_kind=epi.bias_kind,
        activation=epi.activation_kind,
        store_pre=True,
        scaled=False,
        amax=True,
    )
    tried = set()
    for engine in mm.FAMILY.engines:
        if engine.not_supported_reasons(lay.problem):
            continue
        for config in engine.configs(lay.problem):
            out, pre, amax, args = _launch_args(
                lay.problem, lay, a, b, *extra.values(), epi.alpha, epi.beta, *epi.params
            )
            engine.launch(lay.problem, config, *args)
            what = f"{engine.name} {config}"
            assert_close(out, ref, torch_out, what=what)
            assert_close(pre, ref_pre, what=what)
            # amax is taken before the output's rounding: exact in fp32, within a rounding in bf16.
            tol = 0.0 if dtype == torch.float32 else 8e-3 * float(amax)
            assert abs(float(amax) - float(out.float().abs().max())) <= tol, what
            tried.add(engine.name)
    assert "tiled" in tried and ("skinny" in tried or m > mm_engines.SKINNY_M)


@pytest.mark.parametrize("a_t", [False, True])
@pytest.mark.parametrize("b_t", [False, True])
def test_tma_kernel_with_small_tiles(a_t, b_t, poison):
    """The Hopper kernel's indexing, persistence and epilogue with tiles small enough that each
    program loops over several; under the interpreter (which emulates tensor descriptors) its
    engine declines, so it is bound directly."""
    m, n, k = 40, 72, 36  # several tiles per program, a K tail the descriptors zero-fill
    a = randn(k, m).mT if a_t else randn(m, k)
    b = randn(n, k).mT if b_t else randn(k, n)
    epi = Epilogue(bias="row", activation="gelu", residual=True, store_preactivation=True)
    extra = _epilogue_inputs(epi, m, n, torch.float32)
    lay = mm_engines.layout(
        a,
        b,
        None,
        extra["bias"],
        extra["residual"],
        out_dtype=torch.float32,
        bias_kind=2,
        activation=epi.activation_kind,
        store_pre=True,
        scaled=False,
        amax=False,
    )
    engine = next(e for e in mm.FAMILY.engines if e.name == "tma-persistent")
    assert engine.not_supported_reasons(lay.problem)  # fp32 without TF32 is declined: bound directly
    ref, ref_pre = mm.matmul_reference(a, b, epilogue=epi, **extra)
    first = engine.configs(lay.problem)[0]
    # The paired variant: two programs per SM, the output stored through pointers, its epilogue
    # whole and over column halves; the epilogue over column halves, stored through a descriptor
    # and through pointers.
    paired = {**first, "CTAS": 2, "STORE_DESC": False, "FLATTEN": True}
    halves = [{**first, "SUBTILE": True}, {**first, "SUBTILE": True, "STORE_DESC": False}]
    for config in [*engine.configs(lay.problem)[:2], paired, {**paired, "SUBTILE": True}, *halves]:
        config = {**config, "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16}
        out, pre, _, args = _launch_args(
            lay.problem, lay, a, b, None, extra["bias"], extra["residual"], 1.0, 0.0, *epi.params
        )
        engine.bind(lay.problem, config)(*args)
        assert_close(out, ref, what=f"tma {config}")
        assert_close(pre, ref_pre, what=f"tma {config}")


@pytest.mark.gpu_only("tensor descriptors compile for Hopper GPUs only")
@pytest.mark.parametrize("k", [768, 1536])
@pytest.mark.parametrize("b_t", [False, True])
@pytest.mark.parametrize("m, n, block_n", [(4000, 1544, 128), (2000, 4000, 256)])
def test_flattened_lead_with_every_epilogue(m, n, block_n, b_t, k, poison):
    """The flattened configs over column halves that lead products over a wave of 128x128 tiles (128x128 and
    128x256 tiles), bf16, with every epilogue at once (bias, GELU storing its pre-activation,
    residual, amax), B either way round, ragged edges: what the reference gives, call after call
    (new inputs at new addresses, fresh outputs)."""
    a = randn(m, k).bfloat16()
    b = (randn(n, k).mT if b_t else randn(k, n)).bfloat16()
    epi = Epilogue(bias="col", activation="gelu_tanh", residual=True, store_preactivation=True)
    extra = _epilogue_inputs(epi, m, n, torch.bfloat16)
    lay = mm_engines.layout(
        a, b, None, extra["bias"], extra["residual"], out_dtype=torch.bfloat16, bias_kind=epi.bias_kind,
        activation=epi.activation_kind, store_pre=True, scaled=False, amax=True,
    )  # fmt: skip
    config = mm_engines.PersistentTmaEngine().configs(lay.problem)[0]
    assert config.get("FLATTEN") and config.get("SUBTILE") and config["BLOCK_N"] == block_n, config
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a config that fails to build falls back with a warning
        run = mm_engines.PersistentTmaEngine().bind(lay.problem, config)
        for call in range(3):
            if call == 2:
                a, b = a.clone(), b.clone() if not b_t else b.mT.clone().mT  # other addresses
                a.normal_()
            ref, ref_pre = mm.matmul_reference(a, b, epilogue=epi, **extra)
            out, pre, amax, args = _launch_args(
                lay.problem, lay, a, b, None, extra["bias"], extra["residual"], 1.0, 0.0, *epi.params
            )
            run(*args)
            what = f"{config}, call {call}"
            assert_close(out, ref, what=what)
            assert_close(pre, ref_pre, what=what)
            assert abs(float(amax) - float(out.float().abs().max())) <= 8e-3 * float(amax), what


def test_no_flattened_lead_for_an_m_major_a(monkeypatch):
    """A weight gradient's M-major A (dy^T) is not given the flattened lead (measured at one shape)."""
    monkeypatch.setattr(mm_engines, "sm_count", lambda: 132)
    a = torch.empty(2048, 4096, device="meta", dtype=torch.bfloat16).t()
    b = torch.empty(2048, 4096, device="meta", dtype=torch.bfloat16)
    problem = mm_engines.layout(
        a, b, None, None, None, out_dtype=torch.bfloat16, bias_kind=0, activation=-1, store_pre=False,
        scaled=False, amax=False,
    ).problem  # fmt: skip
    assert problem.a_strides[2] == 1 and mm_engines._flattened_lead(problem) is None
    assert mm_engines._flattened_lead(_meta_problem(4096, 4096, 2048)) is not None  # K-major A


# (M, N, K, SMs) in 16x32x16 tiles: 9 tiles of 7 K steps with whole tiles first and the rest shared
# (2, 4 SMs), every tile shared (16), one K step a program (64: 63 programs); 7 tiles of 7 steps on
# 4 SMs, where a program's span holds the end of one tile, a whole one and the start of a third.
_STREAM_K_CASES = {
    "9x7 on 2": (40, 72, 100, 2, (6, 11)),
    "9x7 on 4": (40, 72, 100, 4, (4, 9)),
    "9x7 on 16": (40, 72, 100, 16, (0, 4)),
    "9x7 on 64": (40, 72, 100, 64, (0, 1)),
    "7x7 on 4": (112, 32, 112, 4, (0, 13)),
}


@pytest.mark.parametrize("case", list(_STREAM_K_CASES))
@pytest.mark.parametrize("a_t", [False, True])
@pytest.mark.parametrize("sums_after", [False, True])
def test_stream_k_kernel(case, a_t, sums_after, poison, monkeypatch):
    """The stream-K variant of the Hopper kernel over the schedules above, with the epilogue,
    bound directly (a fallback to another kernel fails the test), its split tiles summed by their
    last program to arrive or by a second kernel (SUMS_AFTER). The same bits on a second run
    (on a GPU, where the programs race to arrive last; the interpreter runs them in order)."""
    m, n, k, sms, schedule = _STREAM_K_CASES[case]
    a = randn(k, m).mT if a_t else randn(m, k)
    b = randn(k, n)
    epi = Epilogue(bias="col", activation="gelu", residual=True, store_preactivation=True)
    extra = _epilogue_inputs(epi, m, n, torch.float32)
    lay = mm_engines.layout(
        a, b, None, extra["bias"], extra["residual"], out_dtype=torch.float32, bias_kind=1,
        activation=epi.activation_kind, store_pre=True, scaled=False, amax=False,
    )  # fmt: skip
    monkeypatch.setattr(mm_engines, "sm_count", lambda: sms)
    tiles, steps = math.ceil(m / 16) * math.ceil(n / 32), math.ceil(k / 16)
    whole, span, slots = mm_engines.stream_k_schedule(tiles, steps, min(sms, tiles * steps))
    assert (whole, span) == schedule and slots >= 2
    engine = next(e for e in mm.FAMILY.engines if e.name == "tma-persistent")
    config = {**engine.configs(lay.problem)[0], "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16}
    config = {**config, "FLATTEN": False, "STREAM_K": True, "SUMS_AFTER": sums_after}
    ref, ref_pre = mm.matmul_reference(a, b, epilogue=epi, **extra)
    results = []
    for _ in range(2):
        out, pre, _, args = _launch_args(
            lay.problem, lay, a, b, None, extra["bias"], extra["residual"], 1.0, 0.0, *epi.params
        )
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # a build failure warns, then falls back
            engine.bind(lay.problem, config)(*args)
        results.append(out)
        assert_close(out, ref, what=f"stream-K, {case}")
        assert_close(pre, ref_pre, what=f"stream-K, {case}, pre-activation")
    assert torch.equal(*results)


@pytest.mark.parametrize("split", [2, 3])
@pytest.mark.parametrize("a_t", [False, True])
def test_split_k_persistent_kernel(split, a_t, poison):
    """The Hopper kernel over (K chunk, tile) units, each chunk's partial product to a workspace,
    then the reduction with the epilogue (alpha and beta applied once, by the reduction), bound
    directly (a fallback to another kernel fails the test); ragged edges and a ragged last chunk."""
    m, n, k = 40, 72, 100
    a = randn(k, m).mT if a_t else randn(m, k)
    b = randn(k, n)
    epi = Epilogue(
        alpha=0.5, beta=2.0, bias="col", activation="gelu", residual=True, store_preactivation=True
    )
    extra = _epilogue_inputs(epi, m, n, torch.float32)
    lay = mm_engines.layout(
        a, b, extra["c"], extra["bias"], extra["residual"], out_dtype=torch.float32, bias_kind=1,
        activation=epi.activation_kind, store_pre=True, scaled=False, amax=False,
    )  # fmt: skip
    engine = next(e for e in mm.FAMILY.engines if e.name == "tma-persistent")
    config = {**engine.configs(lay.problem)[0], "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16}
    config = {**config, "FLATTEN": True, "SPLIT": split}
    ref, ref_pre = mm.matmul_reference(a, b, epilogue=epi, **extra)
    out, pre, _, args = _launch_args(
        lay.problem, lay, a, b, extra["c"], extra["bias"], extra["residual"], epi.alpha, epi.beta, *epi.params
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a build failure warns, then falls back
        engine.bind(lay.problem, config)(*args)
    assert_close(out, ref, what=f"split-K persistent, {split}")
    assert_close(pre, ref_pre, what=f"split-K persistent, {split}, pre-activation")


def test_stream_k_leads_where_128x128_tiles_leave_the_last_wave_part_empty(monkeypatch):
    """On 132 SMs, long 16-bit reductions: stream-K leads where 128x128 tiles fill the SMs once
    and leave the last wave under 90% busy (GPT-2 small's MLP weight gradients: 144 tiles), not
    with fewer tiles than SMs (its 2304x768: 108), full waves (1536x1408: 132) or short K."""
    monkeypatch.setattr(mm_engines, "sm_count", lambda: 132)

    def leads(m, n, k):
        return bool(mm_engines.PersistentTmaEngine().configs(_meta_problem(m, n, k))[0].get("STREAM_K"))

    assert leads(768, 3072, 8192) and leads(3072, 768, 8192)
    assert not leads(2304, 768, 8192) and not leads(1536, 1408, 8192) and not leads(768, 3072, 2048)
    second = mm_engines.PersistentTmaEngine().configs(_meta_problem(768, 3072, 8192))[1]
    assert second == {**mm_engines._STREAM_K, "SUMS_AFTER": True}  # for benchmark mode to time


def test_split_k_leads_where_128x128_tiles_fill_at_most_half_the_sms(monkeypatch):
    """On 132 SMs, long 16-bit reductions over at most 66 128x128 tiles: the persistent kernel
    split over K leads, in as many chunks as keep one wave (GPT-2 small's 768 x 768 weight
    gradient: 36 tiles in 3), and is the engine picked; not with more tiles, nor a short K."""
    monkeypatch.setattr(mm_engines, "sm_count", lambda: 132)
    monkeypatch.setattr(mm_engines, "hopper", lambda: True)
    monkeypatch.setattr(mm_engines, "INTERPRET", False)
    engine = mm_engines.PersistentTmaEngine()
    weight_gradient = _meta_problem(768, 768, 8192)
    assert engine.configs(weight_gradient)[0].get("SPLIT") == 3
    assert mm.FAMILY.select(weight_gradient).engine.name == "tma-persistent"
    assert mm_engines._tma_split(_meta_problem(512, 512, 8192)) == 4  # chunks of 32 K steps at least
    assert mm_engines._tma_split(_meta_problem(2304, 768, 8192)) == 1  # 108 tiles
    assert mm_engines._tma_split(_meta_problem(768, 768, 2048)) == 1  # short K


def test_tf32_operands_not_k_major_are_copied_not_read_in_place(monkeypatch):
    """On Hopper, TF32 (and three-TF32) products with an operand that is not K-major run a quarter
    as fast read in place, in the tiled and split-K kernels alike: a weight gradient over all
    steps (A = da^T, M-major; 4096 x 1024 over K = 4096) goes to the persistent kernel, which
    copies it K-major first; K-major operands keep their rate."""
    monkeypatch.setattr(mm_engines, "sm_count", lambda: 132)
    monkeypatch.setattr(mm_engines, "hopper", lambda: True)
    monkeypatch.setattr(mm_engines, "INTERPRET", False)

    def problem(a_t: bool, tf32x3: bool) -> mm_engines.MatmulProblem:
        a = torch.empty(4096, 4096, device="meta").t() if a_t else torch.empty(4096, 4096, device="meta")
        b = torch.empty(1024, 4096, device="meta").t()
        with tdnn.config.flags(allow_tf32=not tf32x3):
            return mm_engines.layout(
                a, b, None, None, None, out_dtype=torch.float32, bias_kind=0, activation=-1,
                store_pre=False, scaled=False, amax=False, tf32x3=tf32x3,
            ).problem  # fmt: skip

    for tf32x3 in (False, True):
        split_in_registers = 0.55 if tf32x3 else 1.0  # Triton's "tf32x3" dots, see below
        assert mm_engines._in_place_rate(problem(True, tf32x3)) == 0.25 * split_in_registers
        assert mm_engines._in_place_rate(problem(False, tf32x3)) == split_in_registers
        assert mm.FAMILY.select(problem(True, tf32x3)).engine.name == "tma-persistent"
    # Three TF32 products go to the persistent kernel on TF32 planes whatever the layouts.
    assert mm.FAMILY.select(problem(False, True)).engine.name == "tma-persistent"
    assert mm_engines._repacks(problem(False, True)) == ("planes", "planes")


@pytest.mark.parametrize("transposed", [False, True])
def test_tf32_planes_split_each_value_into_head_and_tail(transposed):
    """``tf32_planes``: rows [0, R) hold each value's TF32 head (the low 13 mantissa bits zero, so
    a TF32 MMA reads it exactly), rows [R, 2R) the rest; head + tail is the value, bit for bit;
    rows start on 16-byte boundaries; an M-major input too."""
    x = randn(37, 45).mT if transposed else randn(45, 37)
    x[0, 0], x[1, 1] = 0.0, -1.0e-30  # a zero and a value whose tail underflows to a subnormal
    planes = mm_engines.tf32_planes(x)
    rows = x.shape[0]
    assert planes.shape == (2 * rows, x.shape[1]) and planes.stride(0) % 4 == 0 and planes.stride(1) == 1
    head, tail = planes[:rows], planes[rows:]
    assert not (head.contiguous().view(torch.int32) & 8191).any()
    assert torch.equal(head + tail, x)
    assert (tail.abs() <= x.abs() * 2.0**-10).all()


@pytest.mark.parametrize("a_t", [False, True])
@pytest.mark.parametrize("b_t", [False, True])
@pytest.mark.parametrize("k", [1000, 37])
def test_tma_kernel_tf32x3_on_planes_keeps_fp32_accuracy(a_t, b_t, k):
    """The persistent kernel's three TF32 products on planes, every operand layout, edges that cut
    tiles (a tile's rows past M read the tails' first rows: their products land in rows that are
    not stored), K of many steps or a K whose rows the planes pad to 16 bytes: fp32's accuracy,
    better than the FMA units' product here."""
    m, n = 200, 136
    a = randn(k, m).mT if a_t else randn(m, k)
    b = randn(n, k).mT if b_t else randn(k, n)
    lay = mm_engines.layout(
        a, b, None, None, None, out_dtype=torch.float32, bias_kind=0, activation=-1, store_pre=False,
        scaled=False, amax=False, tf32x3=True,
    )  # fmt: skip
    engine = next(e for e in mm.FAMILY.engines if e.name == "tma-persistent")
    ref = a.double() @ b.double()
    for config in engine.configs(lay.problem):
        out, _, _, args = _launch_args(lay.problem, lay, a, b, None, None, None, 1.0, 0.0, 0.0, 0.0)
        engine.bind(lay.problem, config)(*args)
        assert float((out - ref).abs().max()) <= 1e-6 * float(ref.abs().max()), config


@pytest.mark.parametrize("a_t", [False, True])
@pytest.mark.parametrize("b_t", [False, True])
def test_tma_kernel_copies_tf32_operands_k_major(a_t, b_t, poison):
    """Hopper's TF32 MMAs take K-major operands only: an M-major A or an N-major B is copied
    K-major (through the tiled transpose) before the launch, and the product is unchanged."""
    m, n, k = 40, 72, 36
    a = randn(k, m).mT if a_t else randn(m, k)
    b = randn(n, k).mT if b_t else randn(k, n)
    with tdnn.config.flags(allow_tf32=True):
        lay = mm_engines.layout(
            a, b, None, None, None, out_dtype=torch.float32, bias_kind=0, activation=-1, store_pre=False,
            scaled=False, amax=False,
        )  # fmt: skip
    assert lay.problem.tf32
    assert mm_engines._tf32_repacks(lay.problem) == (a_t, not b_t)
    engine = next(e for e in mm.FAMILY.engines if e.name == "tma-persistent")
    config = {**engine.configs(lay.problem)[0], "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16}
    out, _, _, args = _launch_args(lay.problem, lay, a, b, None, None, None, 1.0, 0.0, 0.0, 0.0)
    engine.bind(lay.problem, config)(*args)
    ref = a.double() @ b.double()
    assert float((out - ref).abs().max()) <= 4e-3 * float(ref.abs().max())  # TF32's 10 mantissa bits


@pytest.mark.parametrize("tf32x3", [False, True])
def test_tma_engine_falls_back_to_tiled_on_the_operands_as_given(tf32x3, monkeypatch):
    """Where no persistent config builds, the tiled kernel runs, with a warning, on the operands as
    the call gave them: not on the K-major copy (TF32, an M-major A) or the TF32 planes made for
    the descriptors, whose strides it was not bound to; later calls too."""

    def unbuildable(problem, config):
        def launch(*args):
            raise RuntimeError("no build")

        return launch

    monkeypatch.setattr(mm_engines, "_persistent_launch", unbuildable)
    m, n, k = 40, 72, 36
    a, b = randn(k, m).mT, randn(k, n)
    with tdnn.config.flags(allow_tf32=not tf32x3):
        lay = mm_engines.layout(
            a, b, None, None, None, out_dtype=torch.float32, bias_kind=0, activation=-1, store_pre=False,
            scaled=False, amax=False, tf32x3=tf32x3,
        )  # fmt: skip
    assert mm_engines._repacks(lay.problem)[0] == ("planes" if tf32x3 else "k-major")
    engine = next(e for e in mm.FAMILY.engines if e.name == "tma-persistent")
    run = engine.bind(lay.problem, engine.configs(lay.problem)[0])
    ref = a.double() @ b.double()
    for call in range(2):
        out, _, _, args = _launch_args(lay.problem, lay, a, b, None, None, None, 1.0, 0.0, 0.0, 0.0)
        with pytest.warns(RuntimeWarning, match="failed to build") if call == 0 else contextlib.nullcontext():
            run(*args)
        assert float((out - ref).abs().max()) <= 4e-3 * float(ref.abs().max())


@pytest.mark.parametrize("a_t", [False, True])
@pytest.mark.parametrize("b_t", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_tma_kernel_copies_unaligned_operands(a_t, b_t, dtype, poison, monkeypatch):
    """Operands whose rows and columns are not 16-byte aligned (41 x 37 x 73 here, as logits over
    a vocabulary of 50257) are copied into padded storage, keeping their contiguous dimension
    (K-major for TF32), before the descriptors read them; the product is unchanged. A's base
    address is not 16-byte aligned either: the copy is, so no fallback to the tiled kernel."""
    m, n, k = 41, 73, 37
    a = randn(k, m + 1, dtype=dtype)[:, 1:].mT if a_t else randn(m, k + 1, dtype=dtype)[:, 1:]
    b = randn(n, k, dtype=dtype).mT if b_t else randn(k, n, dtype=dtype)
    with tdnn.config.flags(allow_tf32=True):
        lay = mm_engines.layout(
            a, b, None, None, None, out_dtype=torch.float32, bias_kind=0, activation=-1, store_pre=False,
            scaled=False, amax=False,
        )  # fmt: skip
    tf32 = dtype == torch.float32
    expect = (
        ("k-major", "k-major") if tf32 else ("m-major" if a_t else "k-major", "k-major" if b_t else "m-major")
    )
    assert mm_engines._repacks(lay.problem) == expect
    engine = next(e for e in mm.FAMILY.engines if e.name == "tma-persistent")
    config = {**engine.configs(lay.problem)[0], "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16}
    out, _, _, args = _launch_args(lay.problem, lay, a, b, None, None, None, 1.0, 0.0, 0.0, 0.0)

    def no_fallback(*_):
        raise AssertionError("fell back to the tiled kernel")

    monkeypatch.setattr(mm_engines.TiledEngine, "bind", lambda self, p, c: no_fallback)
    engine.bind(lay.problem, config)(*args)
    ref = a.double() @ b.double()
    assert float((out - ref).abs().max()) <= 4e-3 * float(ref.abs().max())


def test_unaligned_logits_products_cost_less_copied():
    """The gradients of a language model's head (vocabulary 50257): the copy into padded storage
    costs less than the per-value loads of the engines reading the logits in place."""
    logits = torch.empty(8192, 50257, device="meta", dtype=torch.bfloat16)
    weight = torch.empty(50257, 768, device="meta", dtype=torch.bfloat16)
    features = torch.empty(8192, 768, device="meta", dtype=torch.bfloat16)
    engine = next(e for e in mm.FAMILY.engines if e.name == "tma-persistent")
    for a, b in ((logits, weight), (logits.t(), features)):  # data gradient, weight gradient
        problem = mm_engines.layout(
            a, b, None, None, None, out_dtype=torch.bfloat16, bias_kind=0, activation=-1, store_pre=False,
            scaled=False, amax=False,
        ).problem  # fmt: skip
        assert mm_engines._unaligned(problem) == (True, False)
        in_place = [e for e in mm.FAMILY.engines if e is not engine and not e.not_supported_reasons(problem)]
        assert {e.name for e in in_place} >= {"tiled", "split-k"}
        for other in in_place:
            assert engine.cost(problem) < other.cost(problem), other.name


def test_repacked_copies_are_padded_and_equal():
    for x, how, strides in (
        (randn(5, 7, dtype=torch.float16), "k-major", (8, 1)),
        (randn(7, 5, dtype=torch.float16).t(), "m-major", (1, 8)),
        (randn(7, 5).t(), "k-major", (8, 1)),  # fp32 column-major to row-major, rows padded to 16 bytes
        (randn(4, 5).t(), "k-major", (4, 1)),  # transposed, already aligned: the transpose alone
    ):
        y = mm_engines._repack(x, how)
        assert y.stride() == strides == mm_engines._repacked_strides(*x.shape, how, str(x.dtype)[6:])
        assert torch.equal(y, x) and not y.data_ptr() % 16


def _meta_problem(m: int, n: int, k: int) -> mm_engines.MatmulProblem:
    a = torch.empty(m, k, device="meta", dtype=torch.bfloat16)
    b = torch.empty(n, k, device="meta", dtype=torch.bfloat16).t()
    return mm_engines.layout(
        a, b, None, None, None, out_dtype=torch.bfloat16, bias_kind=0, activation=-1, store_pre=False,
        scaled=False, amax=False,
    ).problem  # fmt: skip


def test_medium_problems_take_paired_or_flattened_tiles(monkeypatch):
    """With H100's 132 SMs: from K = 512 to 4096 over a wave of 128x128 tiles, a tile shape
    flattened over column halves goes first (128x256 tiles where they keep their waves 90% busy,
    else 128x128 with 5 stages for K > 1024 or four waves of tiles); below K = 512 where 128x256
    tiles would leave SMs idle, or K is a few steps, two 128x128 programs per SM; up to K = 2048
    with a K-major A whose 128x128 tiles fit in one wave, one; a longer K keeps the order; split-K
    declines a K it cannot split."""
    monkeypatch.setattr(mm_engines, "sm_count", lambda: 132)
    persistent = mm_engines.PersistentTmaEngine()
    shapes = {
        "few": (12544, 256, 1024),
        "short K": (50176, 512, 128),
        "long K": (3136, 512, 2048),
        "full waves": (4096, 4096, 512),
        "many": (8192, 8192, 8192),
    }
    first = {name: persistent.configs(_meta_problem(*shape))[0] for name, shape in shapes.items()}
    assert first["short K"] == mm_engines._PAIRED
    assert first["few"] == {  # a wave of 128x128 tiles, one of 128x256 not well filled
        **mm_engines._tile(128, 128, 64, 4, 4), "FLATTEN": True, "SUBTILE": True
    }  # fmt: skip
    assert mm_engines._medium_lead(_meta_problem(*shapes["few"])) == mm_engines._PAIRED  # next
    assert all(first[name].get("CTAS", 1) == 1 for name in ("long K", "full waves", "many"))
    assert (first["long K"]["BLOCK_M"], first["long K"]["BLOCK_N"]) == (128, 128)  # K-major A
    weight_gradient = _meta_problem(2048, 1024, 3136)  # K beyond 2048
    assert mm_engines._medium_lead(weight_gradient) is None
    assert (first["full waves"]["BLOCK_M"], first["full waves"]["BLOCK_N"]) == (128, 256)
    assert first["full waves"]["SUBTILE"] and not first["many"]["FLATTEN"]
    gpt2 = {
        (8192, 768, 768): (128, 4),
        (8192, 768, 3072): (128, 5),
        (8192, 3072, 768): (256, 3),
        (8192, 2304, 768): (128, 5),  # 128x256 tiles' waves 87% busy; 128x128 tiles 8.7 waves
    }
    for shape, (block_n, stages) in gpt2.items():
        lead = persistent.configs(_meta_problem(*shape))[0]
        assert (lead["BLOCK_M"], lead["BLOCK_N"], lead["num_stages"]) == (128, block_n, stages)
        assert lead["FLATTEN"] and lead["SUBTILE"]
    assert (
        "too short to split"
        in mm_engines.SplitKEngine().not_supported_reasons(_meta_problem(4096, 512, 128))[0]
    )


def test_activation_epilogues_of_short_reductions_lead_over_column_halves(monkeypatch):
    """Many 128x128 tiles over a short K with an activation (K = 384 here): the paired tiles with
    their epilogue over column halves go first, then whole; a residual alone keeps the whole
    epilogue first."""
    monkeypatch.setattr(mm_engines, "sm_count", lambda: 132)
    x = torch.empty(8192, 384, device="meta", dtype=torch.bfloat16)
    w = torch.empty(3072, 384, device="meta", dtype=torch.bfloat16)

    def first_two(**epilogue):
        problem = mm_engines.layout(
            x, w.t(), None, None, epilogue.get("residual"), out_dtype=torch.bfloat16, bias_kind=0,
            activation=epilogue.get("activation", -1), store_pre=epilogue.get("activation", -1) >= 0,
            scaled=False, amax=False,
        ).problem  # fmt: skip
        return mm_engines.PersistentTmaEngine().configs(problem)[:2]

    halves = {**mm_engines._PAIRED, "SUBTILE": True}
    assert first_two(activation=5) == [halves, mm_engines._PAIRED]
    residual = torch.empty(8192, 3072, device="meta", dtype=torch.bfloat16)
    assert first_two(residual=residual) == [mm_engines._PAIRED, halves]


def test_long_reductions_rank_tiles_by_their_rate(monkeypatch):
    """Weight gradients over 8192 tokens (GPT-2 small's, A = dy^T M-major) whose 128x256 tiles do
    not fill the 132 SMs: tiles are ranked by waves times area over their measured rate, not by
    how many SMs their last wave keeps busy (which picked 64x64 tiles at half the speed); short
    reductions keep the wave count's order."""
    monkeypatch.setattr(mm_engines, "sm_count", lambda: 132)

    def first_tile(m, n, k):
        a = torch.empty(k, m, device="meta", dtype=torch.bfloat16).t()
        b = torch.empty(k, n, device="meta", dtype=torch.bfloat16)
        lay = mm_engines.layout(
            a, b, None, None, None, out_dtype=torch.bfloat16, bias_kind=0, activation=-1, store_pre=False,
            scaled=False, amax=False,
        )  # fmt: skip
        c = mm_engines._tile_configs(lay.problem)[0]
        return c["BLOCK_M"], c["BLOCK_N"]

    assert first_tile(3072, 768, 8192) == first_tile(768, 3072, 8192) == (128, 256)  # 72 tiles
    assert first_tile(2304, 768, 8192) == (128, 128)  # 128x256 would fill 54 SMs
    assert first_tile(768, 768, 8192) == (64, 128)
    assert first_tile(3072, 768, 2048) == (64, 64)  # short: the wave count's pick


def test_gpt2_products_take_the_measured_best_engines(monkeypatch):
    """GPT-2 small's products over 8192 tokens as an H100 (132 SMs, descriptors) would pick them,
    against the best each measured (bf16, scratch sweeps): weight gradients over the tokens in
    whole 128x256 or 128x128 tiles (the tiled kernel), 768x768's 128x128 tiles split in three by
    the persistent kernel (H200: 22 us against 30 for the split-K engine's 64x64 tiles in two;
    split-K priced at small tiles' rates had taken 3072x768's, 125 us against 84), and where 144 128x128 tiles
    leave the last wave of SMs part-empty, stream-K (H200: 70 us against 80); 768 outputs over a
    K of 2304 or 3072 in 128x128 tiles with 4 warps (128x256 tiles' second wave half empty: 63-83 us against
    54-71), up to K = 4096 (the LM head's 50257 lost); a K of 768 keeps 128x256."""
    monkeypatch.setattr(mm_engines, "sm_count", lambda: 132)
    monkeypatch.setattr(mm_engines, "hopper", lambda: True)
    monkeypatch.setattr(mm_engines, "INTERPRET", False)

    def pick(m, n, k, a_m_major):
        a = (
            torch.empty(k, m, device="meta", dtype=torch.bfloat16).t()
            if a_m_major
            else torch.empty(m, k, device="meta", dtype=torch.bfloat16)
        )
        b = torch.empty(k, n, device="meta", dtype=torch.bfloat16)
        p = mm_engines.layout(
            a, b, None, None, None, out_dtype=torch.bfloat16, bias_kind=0, activation=-1, store_pre=False,
            scaled=False, amax=False,
        ).problem  # fmt: skip
        chosen = next(r.name for r in mm.FAMILY.report(p) if r.chosen)  # fast mode's pick, uncached
        engine = next(e for e in mm.FAMILY.engines if e.name == chosen)
        c = engine.configs(p)[0]
        return engine.name, c["BLOCK_M"], c["BLOCK_N"], c["num_warps"], c.get("SPLIT", 1)

    stream_k = ("tma-persistent", 128, 128, 4, 1)  # 144 tiles: the last wave's K loops shared
    assert pick(3072, 768, 8192, True) == pick(768, 3072, 8192, True) == stream_k
    assert mm_engines.PersistentTmaEngine().configs(_meta_problem(768, 3072, 8192))[0].get("STREAM_K")
    assert pick(2304, 768, 8192, True) == ("tiled", 128, 128, 4, 1)  # 108 tiles: no stream-K
    assert pick(768, 768, 8192, True) == ("tma-persistent", 128, 128, 4, 3)
    for k in (2304, 3072):
        assert pick(8192, 768, k, False) == ("tma-persistent", 128, 128, 4, 1)
    assert pick(8192, 768, 16384, False)[:3] == ("tma-persistent", 128, 256)  # longer K: measured slower
    assert pick(8192, 3072, 768, False)[:3] == ("tma-persistent", 128, 256)
    assert pick(8192, 4096, 4096, False)[:3] == ("tma-persistent", 128, 256)  # full waves


def test_fp32_long_reductions_split_where_few_tiles_would_run(monkeypatch):
    """fp32 without TF32 on an H100's FMA units (132 SMs): one program an SM ran at about half
    their rate, two shared it, so a long reduction with few output tiles (a recurrent network's
    weight gradients: 2048x512 over 16384 steps, 3072x1024 over 4096) splits K over more, smaller
    programs (785 us against 1366, 611 against 715); outputs with two programs an SM
    (4096x1024x4096: 715 against 810) or more (4096^3), and short reductions (K=512, where split-K
    ran 3.7x slower), stay whole."""
    monkeypatch.setattr(mm_engines, "sm_count", lambda: 132)
    monkeypatch.setattr(mm_engines, "INTERPRET", False)

    def pick(m, n, k):
        a = torch.empty(k, m, device="meta").t()
        b = torch.empty(k, n, device="meta")
        p = mm_engines.layout(
            a, b, None, None, None, out_dtype=torch.float32, bias_kind=0, activation=-1, store_pre=False,
            scaled=False, amax=False,
        ).problem  # fmt: skip
        return next(r.name for r in mm.FAMILY.report(p) if r.chosen)

    assert pick(2048, 512, 16384) == pick(3072, 1024, 4096) == "split-k"
    assert pick(4096, 1024, 4096) == pick(4096, 4096, 4096) == pick(16384, 2048, 512) == "tiled"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_tma_tiles_too_big_to_stage_their_output_store_it_from_registers(dtype):
    """A descriptor store stages the output tile in shared memory beside the pipeline: TF32's
    128x256x32 tiles, and 16-bit 128x256x64 ones with an fp32 output, leave no room for it, so
    they are kept and store through pointers (the latter in column halves). A 16-bit product's
    flattened lead stages half a tile (213 KB of shared memory in all, sm_90)."""
    a = torch.empty(4096, 4096, device="meta", dtype=dtype)
    b = torch.empty(4096, 4096, device="meta", dtype=dtype).t()
    with tdnn.config.flags(allow_tf32=True):
        lay = mm_engines.layout(
            a, b, None, None, None, out_dtype=torch.float32, bias_kind=0, activation=-1, store_pre=False,
            scaled=False, amax=False,
        )  # fmt: skip
    configs = mm_engines.PersistentTmaEngine().configs(lay.problem)
    if dtype == torch.bfloat16:
        lead = configs.pop(0)
        assert lead["FLATTEN"] and lead["SUBTILE"] and lead.get("STORE_DESC", True)
    assert (configs[0]["BLOCK_M"], configs[0]["BLOCK_N"], configs[0].get("STORE_DESC")) == (128, 256, False)
    for c in configs:
        pipeline = c["num_stages"] * (c["BLOCK_M"] + c["BLOCK_N"]) * c["BLOCK_K"] * a.element_size()
        fits = pipeline + c["BLOCK_M"] * c["BLOCK_N"] * 4 <= 216 * 1024
        assert c.get("STORE_DESC", True) == fits, c
        assert c.get("SUBTILE", False) == (not fits and dtype == torch.bfloat16), c


@pytest.mark.parametrize("a_t", [False, True])
@pytest.mark.parametrize("b_t", [False, True])
def test_tiled_kernel_copies_fp32_operands_to_its_layouts(a_t, b_t, monkeypatch, poison):
    """fp32 without TF32: the tiled FMA kernel runs fastest on an M-major A and an N-major B, so a
    row-major A or a K-major B is copied first (above a size, lowered to 0 here) and the product
    is unchanged."""
    monkeypatch.setattr(mm_engines, "FMA_REPACK_MIN", 0)
    m, n, k = 40, 72, 36
    a = randn(k, m).mT if a_t else randn(m, k)
    b = randn(n, k).mT if b_t else randn(k, n)
    lay = mm_engines.layout(
        a, b, None, None, None, out_dtype=torch.float32, bias_kind=0, activation=-1, store_pre=False,
        scaled=False, amax=False,
    )  # fmt: skip
    assert mm_engines._fma_repacks(lay.problem) == (not a_t, b_t)
    engine = mm_engines.TiledEngine()
    out, _, _, args = _launch_args(lay.problem, lay, a, b, None, None, None, 1.0, 0.0, 0.0, 0.0)
    engine.bind(lay.problem, engine.configs(lay.problem)[0])(*args)
    assert_close(out, a.double() @ b.double(), a @ b, what=f"fp32 a_t={a_t} b_t={b_t}")


def test_row_major_copy_of_a_column_major_matrix():
    x = randn(7, 5).t()  # 5 x 7, column-major
    y = mm_engines._row_major(x)
    assert y.stride() == (7, 1) and torch.equal(y, x)


def test_engine_choice_and_reasons():
    reports = {r.name: r for r in tdnn.engines("matmul", randn(300, 8), randn(8, 200))}
    assert reports["tiled"].supported
    assert "too short to split" in reports["split-k"].reasons[0]
    assert "exceed 64" in reports["skinny"].reasons[0]
    hopper = ON_GPU and torch.cuda.get_device_capability() >= (9, 0)
    assert any("fp32 without TF32" in r for r in reports["tma-persistent"].reasons) == hopper
    half = {
        r.name: r
        for r in tdnn.engines(
            "matmul", randn(300, 8, dtype=torch.bfloat16), randn(8, 200, dtype=torch.bfloat16)
        )
    }
    assert bool(half["tma-persistent"].reasons) != hopper
    decode = {r.name: r for r in tdnn.engines("matmul", randn(1, 512), randn(512, 256))}
    assert decode["skinny"].supported


def test_deterministic_mode_gives_the_same_bits(poison):
    """Every engine and config, twice: split-K and skinny reduce their partial sums in order."""
    a, b = randn(24, 512), randn(512, 40)
    with tdnn.config.flags(deterministic=True):
        problem = mm.FAMILY.describe(a, b)
        lay = mm_engines.layout(
            a,
            b,
            None,
            None,
            None,
            out_dtype=a.dtype,
            bias_kind=0,
            activation=-1,
            store_pre=False,
            scaled=False,
            amax=False,
        )
        for engine in mm.FAMILY.engines:
            if engine.not_supported_reasons(problem):
                continue
            config = engine.configs(problem)[0]
            outs = []
            for _ in range(2):
                out, _, _, args = _launch_args(problem, lay, a, b, None, None, None, 1.0, 0.0, 0.0, 0.0)
                engine.launch(problem, config, *args)
                outs.append(out)
            assert torch.equal(outs[0], outs[1]), engine.name
        assert torch.equal(mm.matmul(a, b), mm.matmul(a, b))


def test_allow_tf32_is_part_of_the_problem():
    a, b = randn(20, 30), randn(30, 10)
    assert not mm.FAMILY.describe(a, b).tf32
    with tdnn.config.flags(allow_tf32=True):
        assert mm.FAMILY.describe(a, b).tf32
        out, ref = mm.matmul(a, b), a.double() @ b.double()
    # TF32 keeps 10 mantissa bits (Triton's MMA truncates, cuBLAS rounds): a relative bound.
    assert float((out - ref).abs().max()) <= 4e-3 * float(ref.abs().max())
    assert not mm.FAMILY.describe(a.half(), b.half()).tf32


def test_tf32x3_products_keep_fp32_accuracy():
    """The op's ``tf32x3``: fp32 products as three TF32 products (the recurrent networks' GEMMs),
    where TF32 is not allowed; allow_tf32 takes one TF32 product. Accuracy near fp32's (the
    tail x tail term dropped: about 2^-21 of each product), against fp64, on the GPU too."""
    a, b = randn(70, 300), randn(300, 50)
    ref = a.double() @ b.double()
    lay = lambda: mm_engines.layout(
        a, b, None, None, None, out_dtype=a.dtype, bias_kind=0, activation=-1, store_pre=False,
        scaled=False, amax=False, tf32x3=True,
    ).problem  # fmt: skip
    p = lay()
    assert p.tf32 and p.tf32x3 and mm_engines._dot_constexprs(p)[1] == "tf32x3"
    out = mm.library._forward(a, b, None, None, None, None, None, 1.0, 0.0, 0, -1, 0.0, 0.0, False, False,
                              a.dtype, False, True)[0]  # fmt: skip
    assert float((out - ref).abs().max()) <= 1e-5 * float(ref.abs().max())
    with tdnn.config.flags(allow_tf32=True):
        p = lay()
        assert p.tf32 and not p.tf32x3 and mm_engines._dot_constexprs(p)[1] == "tf32"
    assert not mm_engines.layout(
        a.half(), b.half(), None, None, None, out_dtype=torch.half, bias_kind=0, activation=-1,
        store_pre=False, scaled=False, amax=False, tf32x3=True,
    ).problem.tf32x3  # fmt: skip


def test_benchmark_mode_times_and_caches(cache_dir):
    a, b = randn(16, 300), randn(300, 20)
    with tdnn.config.flags(benchmark=True):
        out = mm.matmul(a, b)
    assert_close(out, a.double() @ b.double(), a @ b)
    assert "MatmulProblem" in next(cache_dir.glob("autotune-*.json")).read_text()


def test_repeat_calls_take_the_cached_plan(monkeypatch):
    a, b, w, bias = randn(9, 12), randn(12, 7), randn(5, 12), randn(5)
    first, first_linear = mm.matmul(a, b), mm.linear(a, w, bias, activation="relu")
    monkeypatch.setattr(mm, "_run", None)  # a second call that validated again would fail here
    a2, b2 = randn(9, 12), randn(12, 7)
    assert_close(mm.matmul(a2, b2), a2.double() @ b2.double(), a2 @ b2)
    assert_close(
        mm.linear(a, w, bias, activation="relu"), F.relu(F.linear(a.double(), w.double(), bias.double()))
    )
    assert torch.equal(mm.matmul(a, b), first) and torch.equal(
        mm.linear(a, w, bias, activation="relu"), first_linear
    )


# ---------------------------------------------------------------------------------------------
# linear.


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize(
    ("shape_x", "shape_w", "bias"),
    [
        ((4, 6, 20), (9, 20), True),
        ((20,), (9, 20), True),
        ((7, 20), (20,), False),
        ((3, 20), (30, 20), False),
    ],
    ids=str,
)
@pytest.mark.parametrize("activation", [None, "gelu"])
def test_linear(shape_x, shape_w, bias, activation, dtype, poison):
    inputs = [randn(*shape_x, dtype=dtype), randn(*shape_w, dtype=dtype)]
    inputs += [randn(*shape_w[:-1], dtype=dtype)] if bias else []

    def torch_linear(x, w, b=None):
        y = F.linear(x, w, b)
        return F.gelu(y) if activation else y

    leaves = [t.detach().requires_grad_(True) for t in inputs]
    out = mm.linear(*leaves, activation=activation)
    torch_leaves = [t.detach().requires_grad_(True) for t in inputs]
    torch_out = torch_linear(*torch_leaves)
    leaves64 = [t.detach().double().requires_grad_(True) for t in inputs]
    ref = torch_linear(*leaves64)
    assert out.shape == torch_out.shape and out.dtype == dtype
    assert_close(out.detach(), ref.detach(), torch_out.detach(), "linear")
    dy = torch.randn_like(out)
    ours = torch.autograd.grad(out, leaves, dy)
    theirs = torch.autograd.grad(ref, leaves64, dy.double())
    torch_grads = torch.autograd.grad(torch_out, torch_leaves, dy)
    for g, g_ref, g_torch in zip(ours, theirs, torch_grads):
        assert_close(g, g_ref, g_torch, "linear gradient")


@pytest.mark.parametrize("activation", [None, "gelu"])
def test_bias_gradient_finalized_by_the_last_program(activation, monkeypatch):
    """The bias gradient's partial sums over row chunks are added by the last program of each
    column block to arrive (no second launch): several chunks and column blocks, the partials
    read two at a time, values against float64 and the same bits on a second call (the arrival
    counters reset themselves)."""
    monkeypatch.setattr(mm_plans, "sm_count", lambda: 132)
    monkeypatch.setattr(mm_plans, "BIAS_PARTIALS_A_LOAD", 2)
    monkeypatch.setattr(mm_plans, "_plans", {})
    x, w, b = randn(3, 500, 24), randn(130, 24), randn(130)
    dy = randn(3, 500, 130)
    grads = []
    for _ in range(2):
        leaves = [t.detach().requires_grad_(True) for t in (x, w, b)]
        out = mm.linear(*leaves, activation=activation)
        grads.append(torch.autograd.grad(out, leaves[2], dy)[0])

    def torch_bias_grad(x, w, b, dy):
        b = b.detach().requires_grad_(True)
        y = F.linear(x, w, b)
        return torch.autograd.grad(F.gelu(y) if activation else y, b, dy)[0]

    want = torch_bias_grad(x.double(), w.double(), b.double(), dy.double())
    assert_close(grads[0], want, torch_bias_grad(x, w, b, dy), "bias gradient")
    assert torch.equal(grads[0], grads[1])


def test_linear_weight_is_not_copied(monkeypatch):
    x, w = randn(6, 16), randn(10, 16)
    assert mm.FAMILY.describe(x, w.t()).b_strides[2:] == (1, 16)
    monkeypatch.setattr(torch.Tensor, "contiguous", None)  # any copy of an operand would fail
    assert_close(mm.linear(x, w), F.linear(x.double(), w.double()))


def test_linear_residual_and_activation_params(poison):
    x, w, bias, res = randn(5, 3, 12), randn(8, 12), randn(8), randn(3, 8)
    out = mm.linear(x, w, bias, activation="relu", activation_params=(0.2, 1.0), residual=res)
    ref = mm.linear_reference(x, w, bias, activation="relu", activation_params=(0.2, 1.0), residual=res)
    assert_close(out, ref)


@pytest.mark.parametrize(
    "case", ["batched input", "2-D input", "gelu", "frozen weight", "frozen input", "strided gradient"]
)
def test_linear_training_repeats(case, monkeypatch):
    """Repeat calls of one geometry take the cached training path and the backward program kept on
    the forward plan (views made inside autograd, plans looked up once): each call on fresh
    values must match float64, and the weight gradient must come in the weight's layout."""
    shape_x = (6, 20) if case == "2-D input" else (4, 6, 20)
    act = "gelu" if case == "gelu" else None
    counts = {"runs": 0, "plannings": 0}
    program = mm.autograd._Backward
    for name, what in (("__call__", "runs"), ("_plan_products", "plannings")):
        real = getattr(program, name)

        def spy(self, *args, _real=real, _what=what):
            counts[_what] += 1
            return _real(self, *args)

        monkeypatch.setattr(program, name, spy)
    planned = []
    for _ in range(3):
        before = counts["plannings"]
        x, w, bias = randn(*shape_x), randn(9, 20), randn(9)
        x.requires_grad_(case != "frozen input")
        w.requires_grad_(case != "frozen weight")
        bias.requires_grad_(True)
        out = mm.linear(x, w, bias, activation=act)
        dy = randn(*out.shape)
        if case == "strided gradient":  # the output read transposed: its gradient is not contiguous
            dy = randn(*out.shape[:-2], out.shape[-1], out.shape[-2]).mT
        out.backward(dy)
        xd, wd, bd = (t.detach().double().requires_grad_(t.requires_grad) for t in (x, w, bias))
        ref = F.linear(xd, wd, bd)
        (F.gelu(ref) if act else ref).backward(dy.double())
        for t, t64 in ((x, xd), (w, wd), (bias, bd)):
            assert (t.grad is None) == (t64.grad is None)
            if t.grad is not None:
                assert_close(t.grad, t64.grad, what=f"{case} gradient")
        if w.grad is not None:
            assert w.grad.stride() == w.stride()
        planned.append(counts["plannings"] > before)
    # Every backward ran a program. The first call (validated, general path) and the second
    # (cached path) may each look plans up; the third must reuse them, unless the gradient's rows
    # are a copy (no view of it to replay).
    assert counts["runs"] == 3
    assert planned[-1] == (case == "strided gradient")


# ---------------------------------------------------------------------------------------------
# Autograd.


def test_gradcheck_float64():
    epi = Epilogue(alpha=0.7, beta=0.5, bias="col", activation="gelu", residual=True)
    a, b = randn(4, 5, dtype=torch.float64), randn(5, 3, dtype=torch.float64)
    c, bias, res = (
        randn(4, 3, dtype=torch.float64),
        randn(3, dtype=torch.float64),
        randn(4, 3, dtype=torch.float64),
    )
    inputs = tuple(t.requires_grad_(True) for t in (a, b, c, bias, res))
    f = lambda a, b, c, bias, res: mm.matmul(a, b, epilogue=epi, c=c, bias=bias, residual=res)
    assert torch.autograd.gradcheck(f, inputs, fast_mode=True)
    row = Epilogue(bias="row", activation="softplus")
    g = lambda a, b, bias: mm.matmul(a, b, epilogue=row, bias=bias)
    assert torch.autograd.gradcheck(
        g,
        (
            inputs[0],
            randn(2, 5, 3, dtype=torch.float64).requires_grad_(True),
            randn(4, dtype=torch.float64).requires_grad_(True),
        ),
        fast_mode=True,
    )


def test_gradient_with_other_layouts():
    """The output gradient arrives expanded (from .sum()) or transposed."""
    a = randn(6, 9).requires_grad_(True)
    b = randn(9, 70).requires_grad_(True)
    bias = randn(70).requires_grad_(True)
    epi = Epilogue(bias="col", activation="tanh")
    weights = randn(70, 6).mT
    for reduce in (lambda y: y.sum(), lambda y: (y * weights).sum()):
        ours = torch.autograd.grad(reduce(mm.matmul(a, b, epilogue=epi, bias=bias)), (a, b, bias))
        leaves = [t.detach().double().requires_grad_(True) for t in (a, b, bias)]
        theirs = torch.autograd.grad(reduce(torch.tanh(leaves[0] @ leaves[1] + leaves[2])), leaves)
        for g, g_ref in zip(ours, theirs):
            assert_close(g, g_ref)


# ---------------------------------------------------------------------------------------------
# fp8 (Hopper).

F8 = torch.float8_e4m3fn


@pytest.mark.gpu_only(FP8_ON_GPU)
@pytest.mark.parametrize(
    "dtypes",
    [(torch.float8_e4m3fn,) * 2, (torch.float8_e5m2,) * 2, (torch.float8_e4m3fn, torch.float8_e5m2)],
    ids=str,
)
@pytest.mark.parametrize("mnk", [(64, 96, 128), (37, 50, 160), (1, 256, 512), (512, 512, 1024)], ids=str)
def test_fp8_with_scales_and_amax(mnk, dtypes):
    m, n, k = mnk
    a = randn(m, k).to(dtypes[0])
    b = randn(n, k).to(dtypes[1]).t()  # K-major B, as the fp8 tensor cores want it
    sa, sb = torch.tensor(0.5, device=DEVICE), torch.tensor(2.0, device=DEVICE)
    epi = Epilogue(bias="col", activation="gelu")
    bias = randn(n, dtype=torch.bfloat16)
    out, _, amax = mm.matmul(a, b, epilogue=epi, bias=bias, scale_a=sa, scale_b=sb, amax=True)
    ref, _ = mm.matmul_reference(a, b, epilogue=epi, bias=bias, scale_a=sa, scale_b=sb)
    assert out.dtype == torch.bfloat16
    # The products of fp8 values are exact in fp32; the bf16 output rounding dominates.
    assert_close(out, ref, ref.to(torch.bfloat16))
    assert abs(float(amax) - float(out.float().abs().max())) <= 1e-2 * float(amax)


@pytest.mark.gpu_only(FP8_ON_GPU)
def test_fp8_fast_accumulation_over_a_long_k():
    """use_fast_accum: the tensor cores accumulate the whole K loop themselves. Measured on H100
    (this shape, fp32 output): 1.3e-4 promoted every K tile (torch._scaled_mm: the same),
    3.4e-4 fast (torch._scaled_mm fast: 1.3e-3)."""
    m, n, k = 256, 256, 8192
    a, b = randn(m, k).to(F8), randn(n, k).to(F8).t()
    one = torch.ones((), device=DEVICE)
    ref = a.double() @ b.double()
    errors = {}
    for fast in (False, True):
        out = mm.matmul(a, b, scale_a=one, scale_b=one, out_dtype=torch.float32, use_fast_accum=fast)
        errors[fast] = float((out.double() - ref).norm() / ref.norm())
    assert errors[False] < 3e-4  # each K tile's 128 products are still summed inside the MMA
    assert errors[False] <= errors[True] < 3e-3  # the MMA's accumulator keeps about 14 bits


# ---------------------------------------------------------------------------------------------
# Bad input.


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (
            lambda: mm.matmul(randn(3, 4), randn(5, 6)),
            ValueError,
            "argument 'other' has shape .5, 6.*must equal",
        ),
        (
            lambda: mm.matmul(randn(2, 3, 4), randn(3, 4, 6)),
            ValueError,
            "batch dimensions .* do not broadcast",
        ),
        (lambda: mm.matmul(randn(3, 4), randn(4, 5, dtype=torch.float16)), TypeError, "'other' has dtype"),
        (lambda: mm.matmul(torch.ones(3, 4, dtype=torch.int32), randn(4, 5)), TypeError, "'input' has dtype"),
        (lambda: mm.matmul(randn(3, 4).to(F8), randn(4, 5)), TypeError, "'other' has dtype torch.float32"),
        (
            lambda: mm.matmul(randn(3, 4).to(F8), randn(4, 5).to(F8)),
            ValueError,
            "'scale_a' is required for fp8",
        ),
        (
            lambda: mm.matmul(randn(3, 4).to(F8), randn(4, 5).to(F8), scale_a=torch.ones((), device=DEVICE)),
            ValueError,
            "'scale_b' is required",
        ),
        (
            lambda: mm.matmul(randn(3, 4), randn(4, 5), scale_a=randn(1)),
            ValueError,
            "'scale_a' applies to fp8",
        ),
        (
            lambda: mm.matmul(torch.ones((), device=DEVICE), randn(4, 5)),
            ValueError,
            "'input' has 0 dimensions",
        ),
        (
            lambda: mm.matmul(randn(3, 4), randn(4, 5), bias=randn(5)),
            ValueError,
            "'bias' must be given exactly",
        ),
        (
            lambda: mm.matmul(randn(3, 4), randn(4, 5), epilogue=Epilogue(bias="row"), bias=randn(5)),
            ValueError,
            "'bias' has shape .5,.; a per-row bias needs .3,.",
        ),
        (lambda: mm.matmul(randn(3, 4), randn(4, 5), c=randn(3, 5)), ValueError, "'c' must be given exactly"),
        (
            lambda: mm.matmul(randn(3, 4), randn(4, 5), epilogue=Epilogue(beta=1.0), c=randn(2, 5)),
            ValueError,
            "'c' has shape .2, 5.; it must broadcast",
        ),
        (lambda: mm.matmul(randn(3, 4), randn(4, 5), epilogue="relu"), TypeError, "'epilogue' must be"),
        (lambda: mm.matmul(randn(3, 4), randn(4, 5), out_dtype=torch.int8), TypeError, "'out_dtype'"),
        (lambda: Epilogue(activation="swoosh"), ValueError, "'activation'='swoosh'"),
        (lambda: Epilogue(bias="both"), ValueError, "'bias'='both'"),
        (lambda: Epilogue(alpha=math.nan), ValueError, "'alpha'=nan must be finite"),
        (lambda: Epilogue(activation_params=(1.0,)), ValueError, "'activation' is None"),
        (lambda: mm.linear(randn(3, 4), randn(5, 6)), ValueError, "argument 'weight' has shape .5, 6."),
        (
            lambda: mm.linear(randn(3, 4), randn(5, 4), randn(4)),
            ValueError,
            "'bias' has shape .4,.; accepted: .5,.",
        ),
        (lambda: mm.matmul("a", randn(3)), TypeError, "must be a torch.Tensor"),
        (
            lambda: mm.matmul(randn(3, 4), randn(4, 5), use_fast_accum=True),
            ValueError,
            "'use_fast_accum'=True must be a bool, and True only for fp8",
        ),
        (
            lambda: mm.matmul(
                randn(3, 4).to(F8).requires_grad_(True),
                randn(4, 5).to(F8),
                scale_a=torch.ones((), device=DEVICE),
                scale_b=torch.ones((), device=DEVICE),
            ),
            ValueError,
            "fp8 operands have no backward",
        ),
    ],
)
def test_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.skipif(ON_GPU, reason="the fp8 refusal is the interpreter's")
def test_fp8_under_the_interpreter_is_not_supported():
    a, b, s = randn(3, 4).to(F8), randn(4, 5).to(F8), torch.ones((), device=DEVICE)
    with pytest.raises(tdnn.NotSupportedError, match="no fp8 arithmetic"):
        mm.matmul(a, b, scale_a=s, scale_b=s)


# ---------------------------------------------------------------------------------------------
# The torch.library boundary.


def test_library_ops_pass_opcheck():
    a, b, bias, res = randn(5, 7), randn(7, 6).mT.contiguous().mT, randn(6), randn(5, 6)
    args = (a, b, randn(5, 6), bias, res, None, None, 1.5, 0.5, 1, 4, 0.0, 0.0, True, True, torch.float32)
    torch.library.opcheck(mm.library._forward.op, args)
    torch.library.opcheck(
        mm.library._forward.op,
        (
            randn(2, 5, 7),
            b,
            None,
            None,
            None,
            None,
            None,
            1.0,
            0.0,
            0,
            -1,
            0.0,
            0.0,
            False,
            False,
            torch.float16,
        ),
    )
    pre = randn(2, 5, 6)
    op = mm.library._epilogue_backward.op
    torch.library.opcheck(op, (randn(2, 5, 6), pre, 6, 1.0, 0.0, 2, torch.float32))
    torch.library.opcheck(op, (randn(5, 6), None, -1, 0.0, 0.0, 1, torch.float16))


def test_torch_compile_fullgraph():
    def f(x, w, bias, a, b):
        h = mm.linear(x, w, bias, activation="gelu")
        return (h * mm.matmul(a, b, epilogue=Epilogue(bias="row"), bias=bias[:3])).sum()

    compiled = torch.compile(f, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    inputs = [randn(3, 8), randn(5, 8), randn(5), randn(3, 4), randn(4, 5)]
    leaves = [t.requires_grad_(True) for t in inputs]
    ours = torch.autograd.grad(compiled(*leaves), leaves)
    leaves64 = [t.detach().double().requires_grad_(True) for t in inputs]
    x, w, bias, a, b = leaves64
    ref = (F.gelu(F.linear(x, w, bias)) * (a @ b + bias[:3, None])).sum()
    for g, g_ref in zip(ours, torch.autograd.grad(ref, leaves64)):
        assert_close(g, g_ref)


def test_torch_compile_gradients_with_unaligned_rows():
    """Under torch.compile the output gradient of a product with unaligned rows (7 fp32 columns:
    28 bytes) reaches the backward pass contiguous; both products then read one 16-byte-aligned
    copy of it (the row-padded layout and its transpose)."""

    def f(x, w):
        return (mm.linear(x, w) * torch.arange(7.0, device=DEVICE)).sum()

    compiled = torch.compile(f, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    inputs = [randn(2, 5, 8), randn(7, 8)]
    leaves = [t.requires_grad_(True) for t in inputs]
    ours = torch.autograd.grad(compiled(*leaves), leaves)
    leaves64 = [t.detach().double().requires_grad_(True) for t in inputs]
    ref = (F.linear(*leaves64) * torch.arange(7.0, dtype=torch.float64, device=DEVICE)).sum()
    for g, g_ref in zip(ours, torch.autograd.grad(ref, leaves64)):
        assert_close(g, g_ref)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize(
    "mnk", [(4096, 4096, 4096), (1, 8192, 8192), (64, 8192, 8192), (256, 256, 16384)], ids=str
)
def test_large(mnk, dtype):
    m, n, k = mnk
    a, b = randn(m, k, dtype=dtype), randn(n, k, dtype=dtype).t()
    out = mm.matmul(a, b)
    assert_close(out, a.double() @ b.double(), a @ b)
