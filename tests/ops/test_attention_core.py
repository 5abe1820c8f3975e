"""Flash attention: values and gradients of q, k, v against the float64 reference for layouts,
dtypes, head dims, GQA/MQA, causal alignments, scale; lse; the direct backward; determinism and
the engines; torch.compile; bad input. Options (masks, bias, varlen, decode...) are in
test_attention_options.py, which reuses ``check`` from here."""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

import tritondnn as tdnn
from helpers import DEVICE, ON_GPU, assert_close
from tritondnn.ops import attention as att
from tritondnn.ops.attention import backward as bwd
from tritondnn.ops.attention import sdpa, sdpa_backward, sdpa_reference


def rand(*shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, device=DEVICE) * scale).to(dtype)


def check(
    ours: Callable[..., torch.Tensor],
    ref: Callable[..., torch.Tensor],
    inputs: dict[str, torch.Tensor],
    what: str = "",
    grad: bool = True,
    anchor: Callable[..., torch.Tensor] | None = None,
) -> tuple[torch.Tensor, tuple]:
    """Output and gradients of every input of ``ours`` against ``ref`` (which takes the inputs and
    ``compute_dtype``): float64 is the reference, the inputs' own dtype PyTorch's error bar, as
    ``ref`` computes in it or, given, as ``anchor`` (PyTorch's own op on the inputs) does."""
    leaves = {n: t.detach().clone().requires_grad_(grad) for n, t in inputs.items()}
    out = ours(**leaves)
    dtype = next(iter(inputs.values())).dtype
    r64 = ref(
        **{n: t.detach().double().requires_grad_(grad) for n, t in inputs.items()},
        compute_dtype=torch.float64,
    )
    if anchor is None:
        anchor = lambda **t: ref(**t, compute_dtype=dtype)
    low = anchor(**{n: t.detach().clone().requires_grad_(grad) for n, t in inputs.items()})
    assert out.shape == r64.shape, what
    assert_close(out, r64, low.to(out.dtype), f"{what} output")
    if not grad:
        return out, ()
    dout = torch.randn_like(out)
    names = list(inputs)
    g = torch.autograd.grad(out, list(leaves.values()), dout)
    r64 = ref(
        **(rl := {n: t.detach().double().requires_grad_() for n, t in inputs.items()}),
        compute_dtype=torch.float64,
    )
    rg = torch.autograd.grad(r64, list(rl.values()), dout.double(), allow_unused=True)
    low = anchor(**(ll := {n: t.detach().clone().requires_grad_() for n, t in inputs.items()}))
    lg = torch.autograd.grad(low, list(ll.values()), dout.to(low.dtype), allow_unused=True)
    for n, a, r, lw in zip(names, g, rg, lg):
        r = torch.zeros_like(a, dtype=torch.float64) if r is None else r
        lw = torch.zeros_like(a) if lw is None else lw
        assert torch.isfinite(a).all(), f"{what} d{n} not finite"
        assert_close(a, r, lw.to(a.dtype), f"{what} d{n}")
    return out, g


def ref_bhsd(**opts):
    """A reference callable over BHSD q, k, v (and any differentiated extras named in opts)."""

    def fn(q, k, v, compute_dtype, **extra):
        return sdpa_reference(q, k, v, compute_dtype=compute_dtype, **opts, **extra)[0]

    return fn


SHAPES = [  # B, Hq, Hkv, Sq, Skv, D, Dv
    (2, 2, 1, 37, 45, 32, 32),
    (1, 3, 1, 50, 19, 64, 64),
]


@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_values_and_gradients(shape, causal, poison):
    _values_and_gradients(shape, causal, torch.float16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_dtypes(dtype, poison):
    _values_and_gradients((1, 2, 1, 33, 40, 32, 32), "bottom_right", dtype)


def _values_and_gradients(shape, causal, dtype):
    b, hq, hkv, sq, skv, d, dv = shape
    q, k, v = (
        rand(b, hq, sq, d, dtype=dtype),
        rand(b, hkv, skv, d, dtype=dtype),
        rand(b, hkv, skv, dv, dtype=dtype),
    )
    align = causal or "top_left"
    ours = lambda q, k, v: sdpa(
        q, k, v, is_causal=causal is not None, causal_alignment=align, enable_gqa=True
    )
    ref = ref_bhsd(is_causal=causal is not None, bottom_right=causal == "bottom_right")
    check(ours, ref, {"q": q, "k": k, "v": v}, f"{shape} {causal} {dtype}")


def test_matches_torch_sdpa():
    q, k, v = rand(1, 4, 33, 32), rand(1, 2, 41, 32), rand(1, 2, 41, 32)
    for causal in (False, True):
        ours = sdpa(q, k, v, is_causal=causal, enable_gqa=True)
        theirs = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        torch.testing.assert_close(ours, theirs, atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("layout", ["bshd", "strided"])
def test_layouts(layout, poison):
    b, hq, hkv, sq, skv, d = 1, 2, 1, 29, 35, 32
    qs, ks, vs = rand(b, sq, hq, d), rand(b, skv, hkv, d), rand(b, skv, hkv, d)
    if layout == "bshd":
        ours = lambda q, k, v: sdpa(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            layout="bshd",
            is_causal=True,
            enable_gqa=True,
        ).transpose(1, 2)
        out = sdpa(qs, ks, vs, layout="bshd", enable_gqa=True)
        assert out.shape == (b, sq, hq, d) and out.is_contiguous()
    else:  # BHSD views of BSHD memory, and a sliced head dim
        big = rand(b, sq, hq, 2 * d)
        qs = big[..., ::2]
        ours = lambda q, k, v: sdpa(q, k, v, is_causal=True, enable_gqa=True)
        out = sdpa(qs.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2), enable_gqa=True)
        assert out.transpose(1, 2).is_contiguous(), "the output follows the query's memory order"
    check(
        ours,
        ref_bhsd(is_causal=True),
        {"q": qs.transpose(1, 2), "k": ks.transpose(1, 2), "v": vs.transpose(1, 2)},
        layout,
    )


@pytest.mark.parametrize("dims", [(16, 16), (48, 24), (96, 96), (192, 128), (256, 256)], ids=str)
def test_head_dims(dims, poison):
    d, dv = dims
    q, k, v = (
        rand(1, 2, 21, d, dtype=torch.float16),
        rand(1, 1, 27, d, dtype=torch.float16),
        rand(1, 1, 27, dv, dtype=torch.float16),
    )
    ours = lambda q, k, v: sdpa(q, k, v, is_causal=True, enable_gqa=True)
    check(ours, ref_bhsd(is_causal=True), {"q": q, "k": k, "v": v}, str(dims))


@pytest.mark.parametrize("scale", [0.7, -0.4])
def test_scale_sign(scale):
    """Either sign of the scale, on scores spanning more than fp32's exponent range (|s| past 88,
    up to a few hundred): the online softmax must shift by the row max of the scaled scores (a
    shift from the wrong end overflows). (Scores in the thousands, from q and k at 8x, made the
    fp32 rounding of the scores themselves exceed the bound on about one seed in 30.)"""
    q, k, v = rand(1, 2, 40, 32, scale=4.0), rand(1, 2, 100, 32, scale=4.0), rand(1, 2, 100, 32)
    inputs = {"q": q, "k": k, "v": v}
    check(lambda q, k, v: sdpa(q, k, v, scale=scale), ref_bhsd(scale=scale), inputs, "scale", grad=False)


def test_mqa_scale_and_3d_inputs():
    q, k, v = rand(1, 4, 19, 32), rand(1, 1, 23, 32), rand(1, 1, 23, 32)
    check(
        lambda q, k, v: sdpa(q, k, v, scale=0.3, enable_gqa=True),
        ref_bhsd(scale=0.3),
        {"q": q, "k": k, "v": v},
        "mqa",
    )
    q3, k3, v3 = rand(2, 17, 32), rand(2, 21, 32), rand(2, 21, 32)
    out = sdpa(q3, k3, v3, is_causal=True)
    torch.testing.assert_close(
        out, F.scaled_dot_product_attention(q3, k3, v3, is_causal=True), atol=2e-6, rtol=2e-5
    )


def test_lse_and_direct_backward():
    q, k, v = rand(1, 4, 30, 32), rand(1, 2, 38, 32), rand(1, 2, 38, 32)
    sinks = rand(4)
    o, lse = sdpa(q, k, v, is_causal=True, enable_gqa=True, sinks=sinks, return_lse=True)
    _, rl = sdpa_reference(q, k, v, is_causal=True, sinks=sinks)
    assert lse.shape == (1, 4, 30) and lse.dtype == torch.float32
    assert_close(lse, rl, None, "lse")
    do = torch.randn_like(o)
    grads = sdpa_backward(q, k, v, o, do, lse, is_causal=True, enable_gqa=True, sinks=sinks)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    auto = torch.autograd.grad(
        sdpa(*leaves[:3], is_causal=True, enable_gqa=True, sinks=leaves[3]), leaves, do
    )
    for a, b in zip((grads.dq, grads.dk, grads.dv, grads.dsinks), auto):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert grads.dbias is None


def test_edge_rows_are_zero_with_finite_gradients():
    """A fully masked row, a single query, and scores around -1e4: zeros, not NaN, and the
    reference's gradients."""
    q, k, v = rand(1, 2, 9, 32), rand(1, 2, 13, 32), rand(1, 2, 13, 32)
    mask = torch.rand(1, 1, 9, 13, device=DEVICE) > 0.4
    mask[..., 2, :] = False
    mask[..., 0, :] = False
    o, _ = check(
        lambda q, k, v: sdpa(q, k, v, mask), ref_bhsd(attn_mask=mask), {"q": q, "k": k, "v": v}, "masked rows"
    )
    assert (o[:, :, 2] == 0).all() and (o[:, :, 0] == 0).all()
    _, lse = sdpa(q, k, v, mask, return_lse=True)
    assert torch.isinf(lse[:, :, 2]).all() and (lse[:, :, 2] < 0).all()
    q1 = rand(1, 2, 1, 32)
    check(
        lambda q, k, v: sdpa(q, k, v, is_causal=True),
        ref_bhsd(is_causal=True),
        {"q": q1, "k": k, "v": v},
        "one query",
    )
    # Scores near -120: exp underflows to 0 in fp32 unless the row max is subtracted first.
    bias = torch.full((13,), -120.0, device=DEVICE) + rand(13)
    check(
        lambda q, k, v: sdpa(q, k, v, bias),
        ref_bhsd(attn_mask=bias),
        {"q": q, "k": k, "v": v},
        "very negative",
    )
    # Near -1e4 the fp32 rounding of the scores themselves (ulp 1e-3) dominates: finite and close.
    far = torch.full((13,), -1e4, device=DEVICE)
    o = sdpa(q, k, v, far)
    torch.testing.assert_close(o, sdpa(q, k, v), atol=1e-3, rtol=1e-3)
    # Logits of a few hundred: rows near one-hot. Flash attention's backward takes each row's
    # sum(dO * O) from the fp16-rounded output (as PyTorch's fused SDPA does), an error that such
    # rows carry into dq and dk, where an fp16 softmax backward gets exact zeros (P = 1): PyTorch's
    # own F.scaled_dot_product_attention sets the error bar here (our dq equals its to the bit on
    # the seeds where the naive fp16 reference's bar failed us).
    big = rand(1, 2, 9, 32, dtype=torch.float16, scale=8.0)
    check(
        lambda q, k, v: sdpa(q, k, v),
        ref_bhsd(),
        {"q": big, "k": k.half() * 8, "v": v.half()},
        "large logits fp16",
        anchor=lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
    )


def test_deterministic_and_atomic_engines(monkeypatch):
    q, k, v = rand(1, 2, 40, 32), rand(1, 1, 44, 32), rand(1, 1, 44, 32)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    do = torch.randn(1, 2, 40, 32, device=DEVICE)
    run = lambda: torch.autograd.grad(sdpa(*leaves, is_causal=True, enable_gqa=True), leaves, do)
    with tdnn.config.flags(deterministic=True):
        first, second = run(), run()
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    reports = {r.name: r for r in tdnn.engines("attention", q, k, v, is_causal=True, enable_gqa=True)}
    assert reports["flash-fwd"].chosen
    # The atomic-dQ engine: not allowed in deterministic mode, right otherwise.
    monkeypatch.setattr(att.FlashBackwardAtomicDQ, "cost", lambda self, p: 0.1)
    monkeypatch.setattr(att, "_plans", {})
    monkeypatch.setattr(att.FAMILY, "_chosen", {})
    atomic = run()
    for a, b in zip(atomic, first):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)
    problem = att._problem(
        "bwd",
        att._prepare(q, k, v, enable_gqa=True).tensors(),
        att._prepare(q, k, v, enable_gqa=True).meta,
        False,
    )
    with tdnn.config.flags(deterministic=True):
        import dataclasses

        det = dataclasses.replace(problem, deterministic=True)
        assert att.FlashBackwardAtomicDQ().not_supported_reasons(det)


@pytest.mark.skipif(not ON_GPU, reason="GPU only: tensor descriptors (the interpreter has none)")
@pytest.mark.parametrize("atomic", [False, True])
def test_backward_descriptor_loads(monkeypatch, atomic):
    """The dK/dV kernel with q, dO, LSE and delta through tensor descriptors (rows past a ragged
    length read as zeros, head dim 96 padded to 128): right against the float64 reference and the
    same as its pointer loads; a misaligned base falls back to the pointer loads."""
    if atomic:
        monkeypatch.setattr(att.FlashBackwardAtomicDQ, "cost", lambda self, p: 0.1)
    first = att._Backward.configs

    def grads(q, k, v, do, desc):
        monkeypatch.setattr(att._Backward, "configs", lambda self, p: [dict(first(self, p)[0], desc=desc)])
        monkeypatch.setattr(att, "_plans", {})
        monkeypatch.setattr(att, "_eager", {})  # repeat calls keep their plans too
        monkeypatch.setattr(att.FAMILY, "_chosen", {})
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        return torch.autograd.grad(sdpa(*leaves, enable_gqa=True), leaves, do)

    # Which launcher the calls took: the descriptor one asks whether the bases are aligned.
    took = []
    aligned = bwd.aligned
    monkeypatch.setattr(bwd, "aligned", lambda *ts: took.append(aligned(*ts)) or took[-1])
    wide = rand(2, 4, 332, 104, dtype=torch.bfloat16)  # 332 rows: LSE rows 16-byte aligned, ragged blocks
    for q, fits in ((wide[..., :96], True), (wide[..., 1:97], False)):  # aligned base, then 2 bytes off
        k, v = rand(2, 2, 517, 96, dtype=torch.bfloat16), rand(2, 2, 517, 96, dtype=torch.bfloat16)
        do = torch.randn(2, 4, 332, 96, device=DEVICE, dtype=torch.bfloat16)
        plain = grads(q, k, v, do, False)
        assert not took
        desc = grads(q, k, v, do, True)
        assert took == [fits]
        took.clear()
        for a, b in zip(desc, plain):
            if atomic:
                torch.testing.assert_close(a, b, atol=4e-3, rtol=1e-2)
            else:
                assert torch.equal(a, b)
    monkeypatch.setattr(att._Backward, "configs", lambda self, p: [dict(first(self, p)[0], desc=True)])
    monkeypatch.setattr(att, "_plans", {})
    monkeypatch.setattr(att, "_eager", {})
    monkeypatch.setattr(att.FAMILY, "_chosen", {})
    check(
        lambda q, k, v: sdpa(q, k, v, enable_gqa=True),
        ref_bhsd(),
        {"q": wide[..., :96], "k": k, "v": v},
        "descriptor loads",
    )


def test_no_grad_path_and_empty():
    q, k, v = rand(2, 2, 0, 32), rand(2, 2, 5, 32), rand(2, 2, 5, 32)
    assert sdpa(q, k, v).shape == (2, 2, 0, 32)
    q = rand(2, 2, 3, 32)
    out, lse = sdpa(q, rand(2, 2, 0, 32), rand(2, 2, 0, 32), return_lse=True)
    assert (out == 0).all() and torch.isinf(lse).all()


def test_torch_compile_fullgraph():
    q, k, v = (rand(1, 2, 20, 32).requires_grad_() for _ in range(3))
    f = lambda q, k, v: sdpa(q, k, v, is_causal=True).square().sum()
    compiled = torch.compile(f, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    loss = compiled(q, k, v)
    grads = torch.autograd.grad(loss, (q, k, v))
    eager = torch.autograd.grad(f(q, k, v), (q, k, v))
    torch.testing.assert_close(loss, f(q, k, v))
    for a, b in zip(grads, eager):
        torch.testing.assert_close(a, b)


def _args(**over):
    base = {
        "query": rand(2, 4, 8, 32),
        "key": rand(2, 2, 9, 32),
        "value": rand(2, 2, 9, 32),
        "enable_gqa": True,
    }
    base.update(over)
    return base


@pytest.mark.parametrize(
    "over, error, match",
    [
        ({"query": rand(2, 4, 8, 32).int()}, TypeError, "dtype"),
        ({"key": rand(2, 2, 9, 32, dtype=torch.float16)}, TypeError, "share a dtype"),
        ({"query": rand(4, 8)}, ValueError, "dimensions"),
        ({"key": rand(3, 2, 9, 32), "value": rand(3, 2, 9, 32)}, ValueError, "batch"),
        ({"key": rand(2, 2, 9, 16)}, ValueError, "head dim"),
        ({"value": rand(2, 2, 7, 32)}, ValueError, "differ"),
        ({"key": rand(2, 3, 9, 32), "value": rand(2, 3, 9, 32)}, ValueError, "multiple"),
        ({"enable_gqa": False}, ValueError, "enable_gqa"),
        (
            {"query": rand(1, 1, 2, 300), "key": rand(1, 1, 2, 300), "value": rand(1, 1, 2, 300)},
            ValueError,
            "head dims",
        ),
        ({"attn_mask": torch.ones(3, 9, dtype=torch.bool, device=DEVICE)}, ValueError, "broadcast"),
        ({"attn_mask": torch.ones(8, 9, device=DEVICE).int()}, TypeError, "dtype"),
        ({"bias": rand(5, 8, 9)}, ValueError, "broadcast"),
        ({"attn_mask": rand(8, 9), "bias": rand(8, 9)}, ValueError, "one additive"),
        ({"dropout_p": 1.0}, ValueError, "dropout_p"),
        ({"layout": "sbhd"}, ValueError, "layout"),
        ({"causal_alignment": "middle"}, ValueError, "causal_alignment"),
        ({"window": (-2, 3)}, ValueError, "window"),
        ({"softcap": -1.0}, ValueError, "softcap"),
        ({"alibi_slopes": rand(3)}, ValueError, "alibi"),
        ({"sinks": rand(2)}, ValueError, "sinks"),
        pytest.param(
            {"seqlens_q": torch.tensor([3, 9], device=DEVICE)},
            ValueError,
            "outside",
            marks=pytest.mark.skipif(ON_GPU, reason="a device-side assert on a GPU (test_device_values)"),
        ),
        ({"seqlens_kv": torch.tensor([3], device=DEVICE)}, ValueError, "entries"),
        ({"descale_q": 2.0}, ValueError, "fp8"),
        ({"query": rand(2, 4, 8, 32).to(torch.float8_e4m3fn)}, TypeError, "share a dtype"),
    ],
)
def test_bad_input(over, error, match):
    with pytest.raises(error, match=match):
        sdpa(**_args(**over))


@pytest.mark.gpu_only("device-side checks of device values")
@pytest.mark.parametrize("bad", ["seqlens_kv", "block_table"])
def test_device_values(bad):
    """Lengths and page indices on the GPU are checked there (no host sync per call): a bad value
    ends the process with the message, so the call runs in a child process."""
    call = {
        "seqlens_kv": "sdpa(q, k, k, seqlens_kv=torch.tensor([3, 99], device='cuda'))",
        "block_table": "sdpa(q, k.view(8, 16, 1, 32), k.view(8, 16, 1, 32), "
        "block_table=torch.tensor([[0, 9], [1, 2]], device='cuda'))",
    }[bad]
    script = (
        "import torch\nfrom tritondnn.ops.attention import sdpa\n"
        "q = torch.randn(2, 1, 3, 32, device='cuda', dtype=torch.float16)\n"
        "k = torch.randn(2, 1, 64, 32, device='cuda', dtype=torch.float16)\n"
        f"{call}\ntorch.cuda.synchronize()\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode != 0
    assert "outside their range" in done.stderr, done.stderr[-2000:]


@pytest.mark.skipif(ON_GPU, reason="the interpreter has no fp8; on a GPU fp8 runs")
def test_fp8_needs_a_gpu():
    q, k, v = (rand(1, 1, 4, 32).to(torch.float8_e4m3fn) for _ in range(3))
    with pytest.raises(TypeError, match="fp8"):
        sdpa(q, k, v)


def test_bad_backward_input():
    q, k, v = rand(1, 2, 5, 32), rand(1, 2, 6, 32), rand(1, 2, 6, 32)
    o, lse = sdpa(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="lse"):
        sdpa_backward(q, k, v, o, o, lse[:, :1])
    with pytest.raises(ValueError, match="grad_out"):
        sdpa_backward(q, k, v, o, o[..., :3], lse)


@pytest.mark.gpu_only("bf16 at realistic sizes; no Sq x Skv buffer (peak memory)")
@pytest.mark.slow
def test_large_bf16_and_peak_memory():
    b, h, s, d = 2, 8, 4096, 128
    q, k, v = (rand(b, h, s, d, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = sdpa(q, k, v, is_causal=True)
    out.backward(torch.randn_like(out))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    scores = b * h * s * s * 2
    assert peak < scores / 4, f"peak {peak} bytes suggests an Sq x Skv buffer ({scores})"
    qs, ks, vs = (t[:, :, :1024].detach() for t in (q, k, v))
    ref = sdpa_reference(qs, ks, vs, is_causal=True)[0]
    theirs = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
    assert_close(sdpa(qs, ks, vs, is_causal=True), ref, theirs, "bf16 1024")


def test_flops_property():
    call = att._prepare(rand(1, 2, 8, 32), rand(1, 2, 8, 32), rand(1, 2, 8, 32), is_causal=True)
    p = att._problem("fwd", call.tensors(), call.meta, False)
    assert p.flops == 4 * 2 * 8 * 8 * 32 / 2
    assert math.isfinite(p.flops)


def test_head_dim_64_tile_heuristics():
    """At head dim 64 the heuristics lead with what measured fastest on an H200 (see the configs'
    comments): with a right bound (causal), which leaves diagonal blocks part empty, 64-row query
    blocks in the forward and 64x64 tiles in both backward passes; without one, 128 rows in the
    forward, 32x128 dK/dV and 128x32 dQ tiles."""
    from tritondnn.ops.attention.backward import backward_configs
    from tritondnn.ops.attention.forward import forward_configs

    q, k, v = (torch.randn(2, 4, 256, 64, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
    offers = []
    for causal, rows, warps, tiles in ((True, 64, 4, (64, 64, 64, 64)), (False, 128, 8, (32, 128, 128, 32))):
        call = att._prepare(q, k, v, is_causal=causal)
        problem = att._problem("fwd", call.tensors(), call.meta, False)
        fwd = forward_configs(problem, interpret=False)
        assert (fwd[0]["BLOCK_M"], fwd[0]["BLOCK_N"], fwd[0]["num_warps"]) == (rows, 64, warps)
        offers.append(sorted(map(str, fwd)))
        lead = backward_configs(problem, interpret=False)[0]
        assert (lead["M1"], lead["N1"], lead["M2"], lead["N2"]) == tiles
    assert offers[0] == offers[1]  # the order changes, not the offer
