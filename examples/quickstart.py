"""tritondnn in ten lines: functional ops that drop in for torch.nn.functional, with autograd."""

import torch

import tritondnn as tdnn

device = "cuda" if tdnn.backend() == "gpu" else "cpu"  # the CPU runs Triton's interpreter
x = torch.randn(8, 1024, device=device, requires_grad=True)
hidden = tdnn.gelu(x, approximate="tanh")  # same names and defaults as F.gelu
probs = tdnn.softmax(hidden, dim=-1)
loss = -(probs.clamp_min(1e-9).log()).mean()
loss.backward()  # gradients flow through tritondnn's backward kernels
print(f"loss {loss.item():.4f}, |grad| {x.grad.norm().item():.4f}")
for report in tdnn.engines("softmax", hidden, dim=-1):  # which algorithms could run, and why not
    print(report.name, "chosen" if report.chosen else report.reasons or "supported")
