"""Flash attention options, each forward and backward against the float64 reference: sliding
windows, bool and float masks, broadcast bias (dBias), ALiBi, soft-capping, sinks (dSinks),
per-batch lengths, packed sequences, split-KV decode, paged KV caches, dropout replay; fp8 on a GPU."""

from __future__ import annotations

import pytest
import torch
from test_attention_core import check, rand, ref_bhsd

import tritondnn as tdnn
from helpers import DEVICE, assert_close
from tritondnn.ops import attention as att
from tritondnn.ops.attention import dropout_keep_mask, sdpa, sdpa_backward, sdpa_reference
from tritondnn.ops.attention.forward import bind_keys_last

QKV = lambda b=1, hq=2, hkv=1, sq=37, skv=45, d=32, dtype=torch.float16: {
    "q": rand(b, hq, sq, d, dtype=dtype),
    "k": rand(b, hkv, skv, d, dtype=dtype),
    "v": rand(b, hkv, skv, d, dtype=dtype),
}


@pytest.mark.parametrize(
    "window, causal, align",
    [
        ((7, 3), False, "top_left"),
        ((5, -1), True, "bottom_right"),
        ((-1, 4), False, "bottom_right"),
        ((0, 0), False, "top_left"),
    ],
)
def test_sliding_window(window, causal, align, poison):
    ours = lambda q, k, v: sdpa(
        q, k, v, is_causal=causal, causal_alignment=align, window=window, enable_gqa=True
    )
    ref = ref_bhsd(is_causal=causal, bottom_right=align == "bottom_right", window=window)
    check(ours, ref, QKV(), f"window {window}")


@pytest.mark.parametrize(
    "window, align", [((20, -1), "top_left"), ((-1, 5), "bottom_right"), ((10, 3), "top_left")]
)
def test_sliding_window_whole_blocks(window, align, poison):
    """Lengths that are whole key and query blocks: the kernels mask only the window's edges
    (no key-range checks), each bound alone and both."""
    ours = lambda q, k, v: sdpa(q, k, v, causal_alignment=align, window=window, enable_gqa=True)
    ref = ref_bhsd(bottom_right=align == "bottom_right", window=window)
    check(ours, ref, QKV(sq=64, skv=128), f"window {window}")


def test_bool_mask(poison):
    inputs = QKV(b=2)
    mask = torch.rand(2, 1, 37, 45, device=DEVICE) > 0.5
    ours = lambda q, k, v: sdpa(q, k, v, mask, enable_gqa=True, is_causal=True)
    check(ours, ref_bhsd(attn_mask=mask, is_causal=True), inputs, "bool mask")


@pytest.mark.parametrize("shape", [(2, 2, 37, 45), (1, 2, 1, 45), (37, 1), (45,)], ids=str)
def test_bias_and_its_gradient(shape, poison):
    """A float mask / bias broadcast over batch, heads or rows: dBias is summed over them."""
    inputs = {**QKV(b=2), "bias": rand(*shape, dtype=torch.float16)}
    ours = lambda q, k, v, bias: sdpa(q, k, v, bias, enable_gqa=True)
    ref = lambda q, k, v, bias, compute_dtype: sdpa_reference(
        q, k, v, bias=bias, compute_dtype=compute_dtype
    )[0]
    check(ours, ref, inputs, f"bias {shape}")


def test_bias_keyword_with_bool_mask():
    inputs = {**QKV(dtype=torch.float32), "bias": rand(2, 37, 45)}
    mask = torch.rand(37, 45, device=DEVICE) > 0.3
    ours = lambda q, k, v, bias: sdpa(q, k, v, mask, bias=bias, enable_gqa=True)
    ref = lambda q, k, v, bias, compute_dtype: sdpa_reference(
        q, k, v, attn_mask=mask, bias=bias, compute_dtype=compute_dtype
    )[0]
    check(ours, ref, inputs, "bias + mask")


@pytest.mark.parametrize("per_batch", [False, True])
def test_alibi(per_batch, poison):
    slopes = torch.rand((2, 2) if per_batch else (2,), device=DEVICE)
    ours = lambda q, k, v: sdpa(
        q, k, v, alibi_slopes=slopes, is_causal=True, causal_alignment="bottom_right", enable_gqa=True
    )
    check(ours, ref_bhsd(alibi_slopes=slopes, is_causal=True, bottom_right=True), QKV(b=2), "alibi")


def test_softcap(poison):
    inputs = QKV(dtype=torch.float32)
    inputs["q"] = inputs["q"] * 3
    ours = lambda q, k, v: sdpa(q, k, v, softcap=5.0, enable_gqa=True, window=(9, 2))
    check(ours, ref_bhsd(softcap=5.0, window=(9, 2)), inputs, "softcap")


def test_bias_gradient_with_softcap(poison):
    """The bias is added after the soft-cap: dBias is dS without the tanh's derivative."""
    inputs = {**QKV(dtype=torch.float32), "bias": rand(1, 2, 37, 45)}
    inputs["q"] = inputs["q"] * 3
    ours = lambda q, k, v, bias: sdpa(q, k, v, bias=bias, softcap=2.0, is_causal=True, enable_gqa=True)
    ref = lambda q, k, v, bias, compute_dtype: sdpa_reference(
        q, k, v, bias=bias, softcap=2.0, is_causal=True, compute_dtype=compute_dtype
    )[0]
    check(ours, ref, inputs, "bias + softcap")


def test_sinks_and_their_gradient(poison):
    inputs = {**QKV(), "sinks": rand(2, dtype=torch.float16)}
    ours = lambda q, k, v, sinks: sdpa(q, k, v, sinks=sinks, is_causal=True, enable_gqa=True)
    ref = lambda q, k, v, sinks, compute_dtype: sdpa_reference(
        q, k, v, sinks=sinks, is_causal=True, compute_dtype=compute_dtype
    )[0]
    check(ours, ref, inputs, "sinks")


@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
def test_seqlens_over_padded_tensors(align, poison):
    lens_q, lens_kv = [20, 37, 0], [45, 9, 30]
    ours = lambda q, k, v: sdpa(
        q, k, v, seqlens_q=torch.tensor(lens_q, device=DEVICE),
        seqlens_kv=torch.tensor(lens_kv, device=DEVICE), is_causal=True,
        causal_alignment=align, enable_gqa=True,
    )  # fmt: skip
    ref = ref_bhsd(seqlens_q=lens_q, seqlens_kv=lens_kv, is_causal=True, bottom_right=align == "bottom_right")
    out, _ = check(ours, ref, QKV(b=3), f"seqlens {align}")
    assert (out[0, :, 20:] == 0).all() and (out[2] == 0).all()


def test_packed_sequences(poison):
    cu_q, cu_k = [0, 5, 25, 37], [0, 7, 10, 40]
    qp, kp, vp = rand(40, 2, 32), rand(44, 1, 32), rand(44, 1, 32)

    def ours(q, k, v):
        return sdpa(
            q, k, v, cu_seqlens_q=torch.tensor(cu_q, device=DEVICE),
            cu_seqlens_kv=torch.tensor(cu_k, device=DEVICE), is_causal=True,
            causal_alignment="bottom_right", enable_gqa=True, window=(6, -1),
        )  # fmt: skip

    def ref(q, k, v, compute_dtype):
        out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=compute_dtype, device=q.device)
        parts = []
        for n in range(3):
            a, b, c, e = cu_q[n], cu_q[n + 1], cu_k[n], cu_k[n + 1]
            o, _ = sdpa_reference(
                q[a:b].transpose(0, 1)[None], k[c:e].transpose(0, 1)[None], v[c:e].transpose(0, 1)[None],
                is_causal=True, bottom_right=True, window=(6, -1), compute_dtype=compute_dtype,
            )  # fmt: skip
            parts.append(o[0].transpose(0, 1))
        return torch.cat([*parts, out[cu_q[-1] :]])

    out, grads = check(ours, ref, {"q": qp, "k": kp, "v": vp}, "packed")
    assert (out[37:] == 0).all() and (grads[1][40:] == 0).all()
    _, lse = sdpa(
        qp,
        kp,
        vp,
        cu_seqlens_q=torch.tensor(cu_q, device=DEVICE),
        cu_seqlens_kv=torch.tensor(cu_k, device=DEVICE),
        enable_gqa=True,
        return_lse=True,
    )
    assert lse.shape == (2, 40)


@pytest.mark.parametrize(
    "sq, hq, hkv, opts",
    [
        (1, 8, 2, {}),
        (5, 4, 1, {"is_causal": True, "causal_alignment": "bottom_right"}),
        (3, 4, 4, {"window": (20, 0), "causal_alignment": "bottom_right", "softcap": 4.0}),
        (1, 4, 2, {"alibi_slopes": "slopes", "seqlens_kv": [70, 13]}),
    ],
)
def test_decode(sq, hq, hkv, opts, poison):
    """Few queries take the split-KV engine (every split and the combine), with its options."""
    opts = dict(opts)
    if opts.get("alibi_slopes") == "slopes":
        opts["alibi_slopes"] = torch.rand(hq, device=DEVICE)
    sinks = rand(hq)
    q, k, v = rand(2, hq, sq, 32), rand(2, hkv, 70, 32), rand(2, hkv, 70, 32)
    lens = opts.pop("seqlens_kv", None)
    call = dict(opts, sinks=sinks, enable_gqa=True)
    if lens is not None:
        call["seqlens_kv"] = torch.tensor(lens, device=DEVICE)
    chosen = [r.name for r in tdnn.engines("attention", q, k, v, **call) if r.chosen]
    assert chosen == ["split-kv-decode"]
    out, lse = sdpa(q, k, v, **call, return_lse=True)
    ref_opts = dict(opts)
    ref_opts["bottom_right"] = ref_opts.pop("causal_alignment", "top_left") == "bottom_right"
    ro, rl = sdpa_reference(q, k, v, sinks=sinks, seqlens_kv=lens, **ref_opts)
    assert_close(out, ro, None, "decode")
    assert_close(lse, rl, None, "decode lse")


@pytest.mark.parametrize(
    "sq, page, lengths", [(2, 16, True), (2, 24, False), (40, 16, True), (40, 16, False)]
)
def test_paged_kv_cache(sq, page, lengths, poison):
    """Decode (split-KV) and prefill (flash forward) through a block table, with and without
    per-batch lengths; 24-row pages put block and split boundaries inside pages."""
    b, hq, hkv, d = 2, 4, 2, 32
    k_cache, v_cache = rand(10, page, hkv, d), rand(10, page, hkv, d)
    table = torch.tensor([[3, 7, 1, 0], [9, 2, 5, 4]], device=DEVICE)
    lens = torch.tensor([50, 23], device=DEVICE) if lengths else None
    q = rand(b, hq, sq, d)
    out = sdpa(q, k_cache, v_cache, block_table=table, seqlens_kv=lens, is_causal=True,
               causal_alignment="bottom_right", enable_gqa=True)  # fmt: skip
    dense_k = k_cache[table].reshape(b, -1, hkv, d).transpose(1, 2)
    dense_v = v_cache[table].reshape(b, -1, hkv, d).transpose(1, 2)
    ref, _ = sdpa_reference(
        q, dense_k, dense_v, seqlens_kv=lens.tolist() if lengths else None, is_causal=True, bottom_right=True
    )
    assert_close(out, ref, None, f"paged sq={sq}")
    with pytest.raises(ValueError, match="forward-only"):
        sdpa(q.requires_grad_(), k_cache, v_cache, block_table=table, enable_gqa=True)
    if DEVICE == "cpu":  # on a GPU a bad page is a device-side assert, which ends the process
        with pytest.raises(ValueError, match="pages outside"):
            sdpa(q, k_cache, v_cache, block_table=table + 7, enable_gqa=True)


@pytest.mark.parametrize(
    "case",
    ["gqa-causal", "bshd-window-lse", "paged"],
)
def test_eager_repeat_calls(case):
    """A repeat call with the same geometry and options runs the cached closure: same results as
    the first (validated) call on fresh data, and a call differing in one option is not served
    from another's closure."""
    att._eager.clear()
    page = 16
    table = torch.tensor([[3, 7, 1, 0], [9, 2, 5, 4]], device=DEVICE)
    opts = {
        "gqa-causal": {"is_causal": True, "enable_gqa": True},
        "bshd-window-lse": {"layout": "bshd", "window": (9, 2), "return_lse": True},
        "paged": {"block_table": table, "enable_gqa": True},
    }[case]

    def inputs():
        if case == "paged":
            return rand(2, 4, 3, 32), rand(10, page, 2, 32), rand(10, page, 2, 32)
        if case == "bshd-window-lse":
            return rand(2, 37, 2, 32), rand(2, 45, 2, 32), rand(2, 45, 2, 32)
        return rand(2, 4, 37, 32), rand(2, 2, 45, 32), rand(2, 2, 45, 32)

    sdpa(*inputs(), **opts)
    assert len(att._eager) == 1
    q, k, v = inputs()
    fast = sdpa(q, k, v, **opts)
    att._eager.clear()
    slow = sdpa(q, k, v, **opts)
    for a, b in zip(
        fast if isinstance(fast, tuple) else (fast,), slow if isinstance(slow, tuple) else (slow,)
    ):
        assert a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)
    if case == "gqa-causal":
        other = sdpa(q, k, v, enable_gqa=True)  # not causal: its own closure
        assert len(att._eager) == 2
        ref, _ = sdpa_reference(q, k, v)
        assert_close(other, ref, None, "non-causal after causal")


@pytest.mark.parametrize("case", ["gqa-causal", "bshd-lse", "packed-qkv", "strided-gradient"])
def test_eager_training_repeat_calls(case):
    """Repeat training calls run bound plans for both passes (``_eager_training``): on fresh data
    each time, outputs and q, k, v gradients are the general path's bits and near float64's; the
    gradient's layout may differ from the output's (the general backward takes it)."""
    opts = {"is_causal": True, "enable_gqa": case == "gqa-causal"}
    if case == "bshd-lse":
        opts.update(layout="bshd", return_lse=True)

    def inputs():
        if case == "gqa-causal":
            return rand(2, 4, 37, 32), rand(2, 2, 45, 32), rand(2, 2, 45, 32)
        if case == "bshd-lse":
            return rand(2, 37, 2, 32), rand(2, 45, 2, 32), rand(2, 45, 2, 32)
        # GPT's: one projection split into q, k, v, viewed as heads and transposed (strided BHSD)
        qkv = rand(2, 37, 3 * 64)
        return tuple(t.view(2, 37, 2, 32).transpose(1, 2) for t in qkv.split(64, -1))

    def run(q, k, v):
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        out = sdpa(*leaves, **opts)
        o = out[0] if isinstance(out, tuple) else out
        if case == "strided-gradient":
            do = rand(*o.shape[:-1], 2 * o.shape[-1])[..., ::2]
        else:  # in the output's layout, as a transpose back to the model's rows gives it
            do = torch.empty_like(o).copy_(rand(*o.shape))
        return [t.detach() for t in (out if isinstance(out, tuple) else (out,))], do, leaves, o

    att._eager.clear()
    sdpa(*[t.requires_grad_(True) for t in inputs()], **opts)
    assert len(att._eager) == 1
    for _ in range(2):
        q, k, v = inputs()
        outs, do, leaves, o = run(q, k, v)
        fast = outs + list(torch.autograd.grad(o, leaves, do))
        saved = dict(att._eager)
        att._eager.clear()
        outs, _, leaves, o = run(q, k, v)
        slow = outs + list(torch.autograd.grad(o, leaves, do))
        att._eager.update(saved)
        for a, b in zip(fast, slow):
            assert a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)
        if case != "bshd-lse":
            wide = [t.double().requires_grad_(True) for t in (q, k, v)]
            ref, _ = sdpa_reference(*wide, is_causal=True)
            want = torch.autograd.grad(ref, wide, do.double())
            assert_close(fast[0], ref, None, case)
            for a, b in zip(fast[1:], want):
                assert_close(a, b, None, case)


@pytest.mark.parametrize(
    "case", ["packed", "batch-1", "strided-gradient", "wider", "off", "retained", "views-are-leaves"]
)
def test_eager_training_of_a_packed_qkv(case):
    """q, k, v split from one projection's output and viewed as heads (GPT's attention), with
    ``packed_gradient=True``: repeat training calls take the projection's output as the autograd
    input and write its gradient whole (no concatenation of three); the bits of the general
    path's gradients (q, k, v inputs; the split's backward concatenating them), near float64's.
    Left unpacked, with the general path's bits too: a projection wider than q, k, v (its unused
    columns' gradient zeros), the option off (the views' own gradients can then be asked for), a
    view that retains its gradient, views made leaves of their own from a tensor without one."""
    width, batch = 64, 1 if case == "batch-1" else 2  # 2 heads of 32
    extra = 64 if case == "wider" else 0
    leaves = case == "views-are-leaves"

    def split(qkv):
        views = [t.view(batch, 37, 2, 32).transpose(1, 2) for t in qkv[..., : 3 * width].split(width, -1)]
        if leaves:
            views = [t.requires_grad_(True) for t in views]
        if case == "retained":
            views[1].retain_grad()
        return views

    def attend(views):
        return sdpa(*views, is_causal=True, packed_gradient=case != "off")

    def fresh():
        return rand(batch, 37, 3 * width + extra).requires_grad_(not leaves)

    att._eager.clear()
    attend(split(fresh()))
    for _ in range(2):
        qkv = fresh()
        views = split(qkv)
        o = attend(views)
        packed = type(o.grad_fn).__name__.startswith("_EagerPackedAttention")
        assert packed == (case in ("packed", "batch-1", "strided-gradient")), type(o.grad_fn).__name__
        if case == "strided-gradient":  # the general backward takes it, into the packed views
            do = rand(*o.shape[:-1], 2 * o.shape[-1])[..., ::2]
        else:
            do = rand(*o.shape)
        fast = torch.autograd.grad(o, views if leaves else [qkv], do)
        saved = dict(att._eager)
        att._eager.clear()
        again = views if leaves else split(qkv)
        slow = torch.autograd.grad(sdpa(*again, is_causal=True), again if leaves else [qkv], do)
        att._eager.update(saved)
        assert all(torch.equal(a, b) for a, b in zip(fast, slow))
        wide = qkv.detach().double().requires_grad_(True)
        ref, _ = sdpa_reference(
            *[t.view(batch, 37, 2, 32).transpose(1, 2) for t in wide[..., : 3 * width].split(width, -1)],
            is_causal=True,
        )
        (want,) = torch.autograd.grad(ref, wide, do.double())
        got = (
            torch.cat([g.transpose(1, 2).reshape(batch, 37, width) for g in fast], -1) if leaves else fast[0]
        )
        assert_close(got[..., : 3 * width], want[..., : 3 * width], None, case)
        assert leaves or not got[..., 3 * width :].any()  # the wider projection's unused columns
        if case == "off":  # the views stay in the graph
            views = split(qkv)
            assert torch.autograd.grad(attend(views), views[0], do)[0].shape == views[0].shape


def test_dropout_replay(poison):
    p, seed, offset = 0.3, 1234, 77
    keep = dropout_keep_mask(1, 2, 37, 45, p, seed, offset)
    assert 0.6 < keep.float().mean() < 0.8
    ours = lambda q, k, v: sdpa(
        q, k, v, dropout_p=p, dropout_seed=seed, dropout_offset=offset, enable_gqa=True
    )
    check(ours, ref_bhsd(dropout_keep=keep, dropout_p=p), QKV(), "dropout")
    inputs = QKV(dtype=torch.float32)
    same = [
        sdpa(
            **dict(zip(("query", "key", "value"), inputs.values())),
            dropout_p=p,
            dropout_seed=seed,
            enable_gqa=True,
        )
        for _ in range(2)
    ]
    other = sdpa(*inputs.values(), dropout_p=p, dropout_seed=seed + 1, enable_gqa=True)
    assert torch.equal(same[0], same[1]) and not torch.equal(same[0], other)


def test_backward_of_every_option_through_sdpa_backward():
    """The direct backward with bias (dbias in the bias's shape) and sinks matches autograd."""
    q, k, v = rand(1, 2, 20, 32), rand(1, 1, 26, 32), rand(1, 1, 26, 32)
    bias, sinks = rand(1, 2, 1, 26), rand(2)
    opts = dict(bias=bias, sinks=sinks, window=(8, 2), softcap=3.0, enable_gqa=True)
    o, lse = sdpa(q, k, v, **opts, return_lse=True)
    do = torch.randn_like(o)
    grads = sdpa_backward(q, k, v, o, do, lse, **opts)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, bias, sinks)]
    out = sdpa(*leaves[:3], **dict(opts, bias=leaves[3], sinks=leaves[4]))
    auto = torch.autograd.grad(out, leaves, do)
    for a, b in zip(grads, auto):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize(
    "opts, match",
    [
        ({"cu_seqlens_q": [0, 3, 8]}, "both"),
        ({"cu_seqlens_q": [0, 9, 8], "cu_seqlens_kv": [0, 3, 8]}, "not decrease"),
        ({"cu_seqlens_q": [0, 3, 30], "cu_seqlens_kv": [0, 3, 8]}, "at most"),
        ({"cu_seqlens_q": [0, 3], "cu_seqlens_kv": [0, 3, 8]}, "same length"),
    ],
)
def test_bad_packed_input(opts, match):
    q, k, v = rand(8, 2, 32), rand(8, 2, 32), rand(8, 2, 32)
    opts = {n: torch.tensor(x, device=DEVICE) for n, x in opts.items()}
    with pytest.raises(ValueError, match=match):
        sdpa(q, k, v, **opts)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_fp8_value_transpose(layout):
    """The keys-contiguous copy of V that fp8 products read (fp16 here: the interpreter has no fp8):
    every key and head dim in place, keys padded to 16, for both layouts' strides."""
    b, h, s, d = 2, 3, 37, 80
    v = rand(b, h, s, d, dtype=torch.float16)
    v_in = v if layout == "bhsd" else v.transpose(1, 2).contiguous()
    problem = att._describe(v_in, v_in, v_in, layout=layout)
    t = torch.full((b, h, d, 48), float("nan"), device=DEVICE, dtype=torch.float16)
    bind_keys_last(problem)(v if layout == "bhsd" else v_in.transpose(1, 2), t)
    assert torch.equal(t[..., :s], v.transpose(2, 3))
    assert t[..., s:].isnan().all()  # padding left alone (the descriptor reads zeros past the keys)


@pytest.mark.gpu_only("fp8 e4m3 needs Hopper-class tensor cores (no fp8 in the interpreter)")
def test_fp8_forward_with_descales():
    q, k, v = rand(2, 4, 256, 128), rand(2, 4, 300, 128), rand(2, 4, 300, 128)
    scales = [t.abs().max() / 448.0 for t in (q, k, v)]
    q8, k8, v8 = ((t / s).to(torch.float8_e4m3fn) for t, s in zip((q, k, v), scales))
    out = sdpa(q8, k8, v8, is_causal=True, descale_q=scales[0], descale_k=scales[1], descale_v=scales[2])
    assert out.dtype == torch.bfloat16
    deq = [t.float() * s for t, s in zip((q8, k8, v8), scales)]
    ref, _ = sdpa_reference(*deq, is_causal=True)
    err = (out.double() - ref).abs().max().item()
    assert err < 0.05 * ref.abs().max().item(), err
    with pytest.raises(ValueError, match="descale_k.*positive"):
        sdpa(q8, k8, v8, descale_k=-0.5)


@pytest.mark.gpu_only("bf16 options at a size where every engine's tiles are full")
@pytest.mark.slow
def test_options_bf16_large():
    inputs = QKV(b=2, hq=8, hkv=2, sq=1000, skv=1100, d=128, dtype=torch.bfloat16)
    inputs["bias"] = rand(1, 8, 1000, 1100, dtype=torch.bfloat16)
    ours = lambda q, k, v, bias: sdpa(
        q, k, v, bias=bias, is_causal=True, window=(300, -1), enable_gqa=True, softcap=20.0
    )
    ref = lambda q, k, v, bias, compute_dtype: sdpa_reference(
        q, k, v, bias=bias, is_causal=True, window=(300, -1), softcap=20.0, compute_dtype=compute_dtype
    )[0]
    check(ours, ref, inputs, "bf16 large options")
