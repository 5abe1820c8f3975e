"""Attention benchmarks (issues 8 and 9): tdnn.sdpa against PyTorch's flash (FlashAttention-2) and
cuDNN SDPA backends, bf16 BHSD, forward, backward and a GPT-style training step, plus decode and
the fp8 forward (against our bf16).

TFLOP/s count 4 * B * H * Sq * Skv * D per forward (halved for causal); the backward counts 2.5x
the forward, fwd+bwd 3.5x. Decode cases are memory-bound: GB/s count the KV cache read once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial

import torch
import torch.nn.functional as F

from ..core.backend import DEVICE_TYPE, INTERPRET
from ..ops.attention import sdpa
from . import Case, graphed, providers


def _named(**fns: Callable[[], object] | None) -> dict[str, Callable[[], object]]:
    """Providers keyed as the issue names them (``torch-flash``, ``torch-cudnn``), dropping None."""
    return {name.replace("_", "-"): fn for name, fn in fns.items() if fn is not None}


BF16 = torch.bfloat16


def _backend(name: str) -> Callable | None:
    """F.scaled_dot_product_attention pinned to one PyTorch backend, or None where unavailable."""
    if INTERPRET:
        return None
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[name]

    def run(q, k, v, is_causal=False, enable_gqa=False):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=enable_gqa)

    return run


def _bwd(fn: Callable, q, k, v, causal: bool, do: torch.Tensor) -> Callable[[], object]:
    """A callable timing the backward alone: the forward graph is built once, then replayed."""
    out = fn(q, k, v, is_causal=causal)

    def run():
        return torch.autograd.grad(out, (q, k, v), do, retain_graph=True)

    return run


def _step(fn: Callable, q, k, v, causal: bool, do: torch.Tensor) -> Callable[[], object]:
    def run():
        out = fn(q, k, v, is_causal=causal)
        return torch.autograd.grad(out, (q, k, v), do)

    return run


def _usable(fn: Callable | None, *args, **kwargs) -> Callable | None:
    """``fn`` if it runs these arguments (a PyTorch backend may reject a shape), else None."""
    if fn is None:
        return None
    try:
        fn(*args, **kwargs)
        return fn
    except RuntimeError:
        return None


SHAPES = [(4, 32, 4096, 128), (16, 16, 1024, 64), (2, 16, 16384, 128)]


def cases(quick: bool) -> Iterator[Case]:
    shapes = [(1, 2, 64, 32)] if INTERPRET else (SHAPES[:2] if quick else SHAPES)
    flash, cudnn = _backend("flash"), _backend("cudnn")
    for b, h, s, d in shapes:
        q, k, v = (torch.randn(b, h, s, d, device=DEVICE_TYPE, dtype=BF16) for _ in range(3))
        for causal in (False, True):
            label = f"sdpa B{b} H{h} S{s} D{d} bf16 BHSD{' causal' if causal else ''}"
            flops = 4 * b * h * s * s * d / (2 if causal else 1)
            yield Case(
                f"{label} fwd",
                _named(
                    tritondnn=partial(sdpa, q, k, v, is_causal=causal),
                    torch_flash=_usable(flash, q, k, v, is_causal=causal)
                    and partial(flash, q, k, v, is_causal=causal),
                    torch_cudnn=_usable(cudnn, q, k, v, is_causal=causal)
                    and partial(cudnn, q, k, v, is_causal=causal),
                ),
                flops=int(flops),
            )
            if d == 128 and not INTERPRET:  # fp8 e4m3 forward (the bar: 1.4x our bf16 row above)
                q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
                yield Case(
                    f"{label.replace('bf16', 'fp8')} fwd",
                    {"tritondnn": partial(sdpa, q8, k8, v8, is_causal=causal)},
                    flops=int(flops),
                )
                del q8, k8, v8
            qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
            do = torch.randn_like(q)
            bwd = {"tritondnn": _bwd(sdpa, qg, kg, vg, causal, do)}
            for name, fn in (("torch-flash", flash), ("torch-cudnn", cudnn)):
                if _usable(fn, q, k, v, is_causal=causal) is not None:
                    bwd[name] = _bwd(fn, qg, kg, vg, causal, do)
            yield Case(f"{label} bwd", bwd, flops=int(2.5 * flops))
        del q, k, v
    # GPT-style training step of attention alone: forward + backward, causal.
    b, h, s, d = (1, 2, 64, 32) if INTERPRET else (8, 16, 2048, 64)
    qg, kg, vg = (
        torch.randn(b, h, s, d, device=DEVICE_TYPE, dtype=BF16, requires_grad=True) for _ in range(3)
    )
    do = torch.randn_like(qg)
    step = {"tritondnn": _step(sdpa, qg, kg, vg, True, do)}
    for name, fn in (("torch-flash", flash), ("torch-cudnn", cudnn)):
        if _usable(fn, qg.detach(), kg.detach(), vg.detach(), is_causal=True) is not None:
            step[name] = _step(fn, qg, kg, vg, True, do)
    yield Case(
        f"sdpa B{b} H{h} S{s} D{d} bf16 BHSD causal fwd+bwd", step, flops=int(3.5 * 4 * b * h * s * s * d / 2)
    )
    del qg, kg, vg
    if quick:
        return
    # Decode: B8, Hq 32, Hkv 8, D128, one query against KV caches of 8K..64K, contiguous and paged.
    b, hq, hkv, d = (2, 4, 2, 32) if INTERPRET else (8, 32, 8, 128)
    page = 16 if INTERPRET else 256
    for kv in (64,) if INTERPRET else (8192, 16384, 32768, 65536):
        q = torch.randn(b, hq, 1, d, device=DEVICE_TYPE, dtype=BF16)
        k, v = (torch.randn(b, hkv, kv, d, device=DEVICE_TYPE, dtype=BF16) for _ in range(2))
        cache_bytes = 2 * k.nbytes
        out = torch.empty_like(k)
        yield Case(
            f"copy KV cache B{b} Hkv{hkv} S{kv} D{d} bf16",
            providers(torch=partial(out.copy_, k)),
            bytes=2 * k.nbytes,
        )
        del out
        label = f"sdpa decode B{b} Hq{hq} Hkv{hkv} KV{kv} D{d} bf16"
        yield Case(
            f"{label} fwd",
            _named(
                tritondnn=partial(sdpa, q, k, v, enable_gqa=True),
                torch_flash=_usable(flash, q, k, v, enable_gqa=True)
                and partial(flash, q, k, v, enable_gqa=True),
                torch_cudnn=_usable(cudnn, q, k, v, enable_gqa=True)
                and partial(cudnn, q, k, v, enable_gqa=True),
            ),
            bytes=cache_bytes,
        )
        pages = kv // page
        perm = torch.randperm(b * pages, device=DEVICE_TYPE)
        table = perm.view(b, pages).to(torch.int32)
        k_cache = torch.empty(b * pages, page, hkv, d, device=DEVICE_TYPE, dtype=BF16)
        v_cache = torch.empty_like(k_cache)
        k_cache[perm] = k.transpose(1, 2).reshape(b * pages, page, hkv, d)
        v_cache[perm] = v.transpose(1, 2).reshape(b * pages, page, hkv, d)
        paged = partial(sdpa, q, k_cache, v_cache, block_table=table, enable_gqa=True)
        yield Case(f"{label} paged{page} fwd", _named(tritondnn=paged), bytes=cache_bytes)
        # The same calls captured in CUDA graphs, as decode loops run them: device time alone (a
        # decode step's host work is about as long as its kernels).
        yield Case(
            f"{label} fwd, CUDA graph",
            _named(
                tritondnn=graphed(partial(sdpa, q, k, v, enable_gqa=True)),
                torch_flash=_usable(flash, q, k, v, enable_gqa=True)
                and graphed(partial(flash, q, k, v, enable_gqa=True)),
                torch_cudnn=_usable(cudnn, q, k, v, enable_gqa=True)
                and graphed(partial(cudnn, q, k, v, enable_gqa=True)),
            ),
            bytes=cache_bytes,
        )
        yield Case(
            f"{label} paged{page} fwd, CUDA graph", _named(tritondnn=graphed(paged)), bytes=cache_bytes
        )
        del q, k, v, k_cache, v_cache, paged
