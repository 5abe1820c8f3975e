"""Operation-graph benchmarks: fused plans against the same computation in PyTorch eager and
torch.compile.

* a 6-op pointwise DAG over 3 inputs (16M elements, bf16, two outputs): one generated kernel;
  GB/s count the 3 inputs read and 2 outputs written once, against a copy measured in the run;
* conv 3x3 64 -> 64 @56x56 N=64 + bias + ReLU + residual add (bf16 channels_last): one
  convolution with the tail in its epilogue;
* matmul 8192^3 + bias + GELU (bf16): one GEMM with the tail in its epilogue;
* build time of a 20-node graph in fast mode with a warm kernel cache (host work only: the device
  is idle, so the timed interval is the host's);
* the host overhead of ``plan.execute`` on small tensors (host cases): the one-kernel plan of the
  DAG against its six eager ops, and the 20-node graph (five kernels) against its 20 eager ops.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import torch
import torch.nn.functional as F

from ..core.backend import DEVICE_TYPE, INTERPRET
from ..graph import Graph
from . import Case, compiled, providers

BF16 = torch.bfloat16


def _randn(*shape: int, channels_last: bool = False) -> torch.Tensor:
    t = torch.randn(shape, device=DEVICE_TYPE, dtype=BF16)
    return t.to(memory_format=torch.channels_last) if channels_last else t


def _dag(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The DAG in PyTorch: u = x * y + sigmoid(z); (gelu(u), tanh(u) * x)."""
    u = x * y + torch.sigmoid(z)
    return F.gelu(u), torch.tanh(u) * x


def _dag_graph(shape: tuple[int, ...]) -> Graph:
    g = Graph(io_dtype=BF16, name="pointwise_dag")
    x, y, z = (g.tensor(shape, name=n) for n in "xyz")
    u = g.add(g.mul(x, y), g.sigmoid(z))
    g.set_output(g.gelu(u, name="out1"))
    g.set_output(g.mul(g.tanh(u), x, name="out2"))
    return g


def _sbr_conv_ref(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    c = scale.numel()
    return F.conv2d(F.relu(x * scale.view(1, c, 1, 1) + shift.view(1, c, 1, 1)), w, padding=1)


def _conv_ref(x, w, b, r):
    return F.relu(F.conv2d(x, w, b, padding=1)) + r


def _matmul_ref(a, w, b):
    return F.gelu(a @ w + b)


def _twenty_nodes(rows: int = 4096, cols: int = 1024) -> Graph:
    """20 nodes: pointwise chains around a layernorm and a reduction (five kernels)."""
    g = Graph(io_dtype=BF16, name="twenty")
    x, y, b = g.tensor((rows, cols), name="x"), g.tensor((rows, cols), name="y"), g.tensor((cols,), name="b")
    h = g.relu(g.bias(g.mul(x, y), b))
    for _ in range(3):
        h = g.tanh(g.add(g.mul(h, 0.5), x))
    n = g.layernorm(h)
    s = g.reduction(g.square(n), "avg", dim=1)
    g.set_output(g.mul(g.sigmoid(g.sub(n, s)), 2.0))
    g.set_output(g.exp(g.neg(s)))
    assert len(g.nodes) == 20
    return g


def _twenty_ref(x: torch.Tensor, y: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``_twenty_nodes`` in PyTorch eager: 20 ops."""
    h = torch.relu(x * y + b)
    for _ in range(3):
        h = torch.tanh(h * 0.5 + x)
    n = F.layer_norm(h, h.shape[-1:])
    s = torch.mean(torch.square(n), dim=1, keepdim=True)
    return torch.sigmoid(n - s) * 2.0, torch.exp(-s)


def cases(quick: bool) -> Iterator[Case]:
    n = 64 * 1024 if INTERPRET else 16 * 1024 * 1024
    shape = (n // 1024, 1024)
    x, y, z = _randn(*shape), _randn(*shape), _randn(*shape)
    out = torch.empty_like(x)
    label = f"{n >> 20}M" if n >= 1 << 20 else f"{n >> 10}K"
    yield Case(f"copy {label} bf16", providers(torch=partial(out.copy_, x)), bytes=2 * x.nbytes)
    plan = _dag_graph(shape).build()
    feeds = {"x": x, "y": y, "z": z}
    yield Case(
        f"pointwise dag 6 ops 3 in 2 out {shape[0]}x{shape[1]} bf16 fwd",
        providers(
            tritondnn=partial(plan.execute, feeds),
            torch=partial(_dag, x, y, z),
            torch_compile=compiled(_dag, x, y, z),
        ),
        bytes=5 * x.nbytes,
    )
    small = {k: v[:8, :64].contiguous() for k, v in feeds.items()}
    small_plan = _dag_graph((8, 64)).build()
    yield Case(
        "pointwise dag 6 ops 8x64 bf16 execute (host)",
        providers(tritondnn=partial(small_plan.execute, small), torch=partial(_dag, *small.values())),
        host=True,
    )
    twenty_feeds = {"x": small["x"], "y": small["y"], "b": small["z"][0]}
    twenty_plan = _twenty_nodes(8, 64).build()
    yield Case(
        f"graph 20 nodes {len(twenty_plan.steps)} kernels 8x64 bf16 execute (host)",
        providers(
            tritondnn=partial(twenty_plan.execute, twenty_feeds),
            torch=partial(_twenty_ref, *twenty_feeds.values()),
        ),
        host=True,
    )
    del x, y, z, out, feeds, plan
    if quick:
        return
    nb, c, hw = (2, 8, 10) if INTERPRET else (64, 64, 56)
    xc, r = _randn(nb, c, hw, hw, channels_last=True), _randn(nb, c, hw, hw, channels_last=True)
    w, b = _randn(c, c, 3, 3, channels_last=True), _randn(c)
    g = Graph(io_dtype=BF16, name="conv_block")
    gx = g.tensor_like(xc, name="x")
    gw, gb, gr = g.tensor_like(w, name="w"), g.tensor((c, 1, 1), name="b"), g.tensor_like(r, name="r")
    g.set_output(g.add(g.relu(g.bias(g.conv_fprop(gx, gw, padding=1), gb)), gr))
    conv_plan = g.build()
    feeds = {"x": xc, "w": w, "b": b.view(c, 1, 1), "r": r}
    yield Case(
        f"conv2d 3x3 {c} @{hw} N{nb} +bias+relu+residual bf16 NHWC fwd",
        providers(
            tritondnn=partial(conv_plan.execute, feeds),
            torch=partial(_conv_ref, xc, w, b, r),
            torch_compile=compiled(_conv_ref, xc, w, b, r),
        ),
        flops=2 * nb * c * hw * hw * c * 9,
    )
    # Batch norm's apply and ReLU before the convolution (cuDNN's scale-bias-relu-conv): folded
    # into the implicit GEMM's reading of x, against PyTorch's three ops and the convolution.
    scale, shift = _randn(c).abs() + 0.5, _randn(c)
    g = Graph(io_dtype=BF16, name="sbr_conv")
    gx, gw = g.tensor_like(xc, name="x"), g.tensor_like(w, name="w")
    gs, gsh = g.tensor((c, 1, 1), name="s"), g.tensor((c, 1, 1), name="sh")
    g.set_output(g.conv_fprop(g.relu(g.bias(g.scale(gx, gs), gsh)), gw, padding=1))
    sbr_plan = g.build()
    feeds = {"x": xc, "w": w, "s": scale.view(c, 1, 1), "sh": shift.view(c, 1, 1)}
    yield Case(
        f"scale+bias+relu then conv2d 3x3 {c} @{hw} N{nb} bf16 NHWC fwd",
        providers(
            tritondnn=partial(sbr_plan.execute, feeds),
            torch=partial(_sbr_conv_ref, xc, w, scale, shift),
            torch_compile=compiled(_sbr_conv_ref, xc, w, scale, shift),
        ),
        flops=2 * nb * c * hw * hw * c * 9,
    )
    del xc, r, w, b, feeds, conv_plan, sbr_plan
    m = 256 if INTERPRET else 8192
    a, wm, bm = _randn(m, m), _randn(m, m), _randn(m)
    g = Graph(io_dtype=BF16, name="gemm_gelu")
    ga, gw, gb = g.tensor((m, m), name="a"), g.tensor((m, m), name="w"), g.tensor((m,), name="b")
    g.set_output(g.gelu(g.bias(g.matmul(ga, gw), gb)))
    mm_plan = g.build()
    feeds = {"a": a, "w": wm, "b": bm}
    yield Case(
        f"matmul {m}x{m}x{m} +bias+gelu bf16 NN fwd",
        providers(tritondnn=partial(mm_plan.execute, feeds), torch=partial(_matmul_ref, a, wm, bm)),
        flops=2 * m**3,
    )
    del a, wm, bm, feeds, mm_plan
    twenty = _twenty_nodes()
    twenty.build()  # warm the kernel cache: later builds generate nothing
    yield Case("graph build 20 nodes fast warm-cache (host work)", providers(tritondnn=twenty.build))
