"""The rest of cuDNN's primitives: dropout (and + residual), OpTensor, reductions, layout and type
transforms, fp8 quantization (memory-bound: GB/s and the fraction of a copy measured first), grid
sampling forward and backward, CTC loss (T=500, N=32, C=50, S=100), and embedding lookups with
their weight gradient (GPT-2 small's token table).

Bytes are the minimum read plus written once; a reduction counts its input only.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import torch
import torch.nn.functional as F

from ..core.backend import DEVICE_TYPE, INTERPRET
from ..ops import ctc, dropout, embedding, reduce, spatial, tensor_ops, transform
from . import Case, compiled, providers

BF16 = torch.bfloat16


def _fwd_bwd(fn, inputs, dy):
    y = fn(*inputs)
    return torch.autograd.grad(y, [t for t in inputs if t.requires_grad], dy)


def _torch_dropout_add(x, r, p):
    return r + F.dropout(x, p)


def _scaled_mul(a, b):
    return (2 * a) * b


def _torch_quantize(t):
    return (t.float() * 2.0).clamp(-448, 448).to(torch.float8_e4m3fn)


def _half_fp32(t):
    return t.float() * 0.5


def cases(quick: bool) -> Iterator[Case]:
    rows, cols = (64, 96) if INTERPRET else (16384, 8192)
    dev = DEVICE_TYPE
    x = torch.randn(rows, cols, device=dev, dtype=BF16)
    out = torch.empty_like(x)
    shape = f"{rows}x{cols} bf16"
    yield Case(f"copy {shape}", providers(torch=partial(out.copy_, x)), bytes=2 * x.nbytes)

    yield Case(
        f"dropout 0.1 {shape} fwd",
        providers(
            tritondnn=partial(dropout.dropout, x, 0.1, seed=1),
            torch=partial(F.dropout, x, 0.1),
            torch_compile=compiled(partial(F.dropout, p=0.1), x),
        ),
        bytes=2 * x.nbytes,
    )
    r = torch.randn_like(x)
    yield Case(
        f"dropout_add 0.1 {shape} fwd",
        providers(
            tritondnn=partial(dropout.dropout_add, x, r, 0.1, seed=1),
            torch=partial(_torch_dropout_add, x, r, 0.1),
            torch_compile=compiled(_torch_dropout_add, x, r, 0.1),
        ),
        bytes=3 * x.nbytes,
    )
    bias = torch.randn(cols, device=dev, dtype=BF16)
    yield Case(
        f"op_tensor add bcast-row {shape} fwd",
        providers(
            tritondnn=partial(tensor_ops.op_tensor, x, bias, "add"),
            torch=partial(torch.add, x, bias),
            torch_compile=compiled(torch.add, x, bias),
        ),
        bytes=2 * x.nbytes,
    )
    yield Case(
        f"op_tensor mul a1=2 {shape} fwd",
        providers(
            tritondnn=partial(tensor_ops.op_tensor, x, r, "mul", alpha1=2.0),
            torch=partial(_scaled_mul, x, r),
            torch_compile=compiled(_scaled_mul, x, r),
        ),
        bytes=3 * x.nbytes,
    )
    for dim, label in ((1, "rows"), (0, "columns")):
        yield Case(
            f"reduce add over {label} {shape}",
            providers(
                tritondnn=partial(reduce.reduce_tensor, x, "add", dim),
                torch=partial(torch.sum, x, dim),
                torch_compile=compiled(partial(torch.sum, dim=dim), x),
            ),
            bytes=x.nbytes,
        )
    yield Case(
        f"reduce max+indices over rows {shape}",
        providers(
            tritondnn=partial(reduce.reduce_tensor, x, "max", 1, return_indices=True),
            torch=partial(torch.max, x, 1),
        ),
        bytes=x.nbytes,
    )
    yield Case(
        f"reduce norm2 all {shape}",
        providers(
            tritondnn=partial(reduce.reduce_tensor, x, "norm2"), torch=partial(torch.linalg.vector_norm, x)
        ),
        bytes=x.nbytes,
    )
    yield Case(
        f"quantize_fp8 e4m3 given-scale {shape}",
        providers(
            tritondnn=partial(transform.quantize_fp8, x, 2.0),
            torch=partial(_torch_quantize, x),
            torch_compile=compiled(_torch_quantize, x),
        ),
        bytes=x.nbytes + x.numel(),
    )
    del x, out, r
    if quick:
        return

    image = (2, 16, 6, 6) if INTERPRET else (64, 256, 56, 56)
    img = torch.randn(*image, device=dev, dtype=BF16)
    name = "x".join(map(str, image))
    out = torch.empty_like(img)
    yield Case(f"copy {name} bf16", providers(torch=partial(out.copy_, img)), bytes=2 * img.nbytes)
    cl = torch.channels_last
    yield Case(
        f"transform NCHW->NHWC {name} bf16",
        providers(
            tritondnn=partial(transform.transform_tensor, img, memory_format=cl),
            torch=partial(img.contiguous, memory_format=cl),
        ),
        bytes=2 * img.nbytes,
    )
    nhwc = img.contiguous(memory_format=cl)
    yield Case(
        f"transform NHWC->NCHW {name} bf16",
        providers(
            tritondnn=partial(transform.transform_tensor, nhwc, memory_format=torch.contiguous_format),
            torch=nhwc.contiguous,
        ),
        bytes=2 * img.nbytes,
    )
    yield Case(
        f"transform bf16->fp32 x0.5 {name}",
        providers(
            tritondnn=partial(transform.transform_tensor, img, dtype=torch.float32, alpha=0.5),
            torch=partial(_half_fp32, img),
            torch_compile=compiled(_half_fp32, img),
        ),
        bytes=3 * img.nbytes,
    )
    yield Case(
        f"reduce avg over HW {name} bf16 NCHW",
        providers(
            tritondnn=partial(reduce.reduce_tensor, img, "avg", (2, 3)),
            torch=partial(torch.mean, img, (2, 3)),
        ),
        bytes=img.nbytes,
    )
    del img, out, nhwc

    n, c, h, w = (2, 4, 8, 8) if INTERPRET else (32, 64, 128, 128)
    x = torch.randn(n, c, h, w, device=dev)
    grid = (torch.rand(n, h, w, 2, device=dev) * 2 - 1).requires_grad_(True)
    xg = x.clone().requires_grad_(True)
    label = f"grid_sample bilinear {n}x{c}x{h}x{w} fp32"
    yield Case(
        f"{label} fwd",
        providers(
            tritondnn=partial(spatial.grid_sample, x, grid.detach(), align_corners=False),
            torch=partial(F.grid_sample, x, grid.detach(), align_corners=False),
        ),
        bytes=2 * x.nbytes + grid.nbytes,
    )
    dy = torch.randn_like(x)
    ours = partial(spatial.grid_sample, align_corners=False)
    theirs = partial(F.grid_sample, align_corners=False)
    yield Case(
        f"{label} fwd+bwd",
        providers(
            tritondnn=partial(_fwd_bwd, ours, (xg, grid), dy), torch=partial(_fwd_bwd, theirs, (xg, grid), dy)
        ),
        bytes=5 * x.nbytes + 3 * grid.nbytes,
    )
    del x, xg, grid, dy

    T, N, C, S = (30, 4, 10, 8) if INTERPRET else (500, 32, 50, 100)
    lp = torch.randn(T, N, C, device=dev).log_softmax(-1).requires_grad_(True)
    tg = torch.randint(1, C, (N, S), device=dev)
    il, tl = torch.full((N,), T, device=dev), torch.full((N,), S, device=dev)
    ones = torch.ones((), device=dev)
    label = f"ctc_loss T={T} N={N} C={C} S={S} fp32"

    def loss_grad(fn):
        return torch.autograd.grad(fn(lp, tg, il, tl), lp, ones)

    yield Case(
        f"{label} fwd+bwd",
        providers(tritondnn=partial(loss_grad, ctc.ctc_loss), torch=partial(loss_grad, F.ctc_loss)),
    )

    # GPT-2 small's token embedding: 8192 tokens into a 50257 x 768 fp32 table. The backward
    # writes the whole table's gradient (zeros where no token points) and reads the output's.
    rows, dim, tokens = (64, 32, 40) if INTERPRET else (50257, 768, 8192)
    table = torch.randn(rows, dim, device=dev, requires_grad=True)
    ids = torch.randint(0, rows, (tokens,), device=dev)
    dy = torch.randn(tokens, dim, device=dev)
    label = f"embedding {rows}x{dim} fp32, {tokens} tokens"
    yield Case(
        f"{label} fwd",
        providers(
            tritondnn=partial(embedding.embedding, ids, table),
            torch=partial(F.embedding, ids, table),
            torch_compile=compiled(F.embedding, ids, table),
        ),
        bytes=2 * dy.nbytes + ids.nbytes,
    )
    yield Case(
        f"{label} fwd+bwd",
        providers(
            tritondnn=partial(_fwd_bwd, lambda w: embedding.embedding(ids, w), (table,), dy),
            torch=partial(_fwd_bwd, lambda w: F.embedding(ids, w), (table,), dy),
        ),
        bytes=3 * dy.nbytes + 2 * ids.nbytes + table.nbytes,
    )
