"""tritondnn's operation graph in a page: describe, build (fuse), explain, execute, serialize.

Tensors are edges, operations are nodes. ``build`` partitions the graph into kernels: the
per-channel scale, shift and ReLU before the convolution (batch norm's apply) become one generated
kernel (benchmark mode also times them folded into the convolution's reading of its input: the
"fused_prologue" candidate); the convolution takes its bias, ReLU and residual add into its
epilogue; the pointwise tail and the reduction after it become one generated Triton kernel.
"""

import torch

import tritondnn as tdnn
from tritondnn.graph import Graph, reference

device = "cuda" if tdnn.backend() == "gpu" else "cpu"  # the CPU runs Triton's interpreter

# 1. Describe: inputs with shape, layout and dtype; nodes named after cuDNN's operations.
g = Graph(io_dtype=torch.float32, name="block")
x = g.tensor((2, 8, 12, 12), layout="channels_last", name="x")
w = g.tensor((8, 8, 3, 3), name="w")
b = g.tensor((8, 1, 1), name="b")  # a per-channel bias, broadcast as in PyTorch
s, sh = g.tensor((8, 1, 1), name="s"), g.tensor((8, 1, 1), name="sh")
xa = g.relu(g.bias(g.scale(x, s), sh))  # batch norm's apply and a ReLU...
y = g.relu(g.bias(g.conv_fprop(xa, w, padding=1), b)) + x  # ...conv + bias + ReLU + residual
z = g.sigmoid(y * 0.5 - 1.0)  # a pointwise tail...
stats = g.reduction(z, "avg", dim=(2, 3))  # ...and a reduction after it
g.set_output(y)
g.set_output(stats)

# 2. Build: validation, fusion, generated kernels (a second graph like this one compiles nothing).
plan = g.build()  # or "benchmark" (time the candidates) / "fallback" (no fusion)
print(plan.explain())  # which nodes each kernel runs, and why anything did not fuse
print([(c.name, c.kernels, c.estimated_us) for c in plan.candidates()])

# 3. Execute: feed tensors by name (or by GraphTensor); outputs come back by name.
feeds = {
    "x": torch.randn(2, 8, 12, 12, device=device).to(memory_format=torch.channels_last),
    "w": torch.randn(8, 8, 3, 3, device=device),
    "b": torch.randn(8, 1, 1, device=device),
    "s": torch.rand(8, 1, 1, device=device) + 0.5,
    "sh": torch.randn(8, 1, 1, device=device),
}
out = plan.execute(feeds)
expected = reference(g, feeds, torch.float64)  # the same graph evaluated by PyTorch in float64
for name, value in out.items():
    print(f"{name}: {tuple(value.shape)}, max error {(value.double() - expected[name]).abs().max():.2e}")

# 4. Serialize: versioned JSON; loading rebuilds and re-validates, it never runs code from the file.
again = tdnn.graph.Plan.deserialize(plan.serialize())
assert torch.equal(again.execute(feeds)[y.name], out[y])
print("errors name the node, the tensor and the rule:")
try:
    g.matmul(x, w)
except tdnn.graph.GraphError as err:
    print(" ", err)
