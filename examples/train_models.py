"""Whole models trained with tritondnn patched in, next to the same models in plain PyTorch.

    python examples/train_models.py                    # on a GPU: ResNet-50, GPT-2 small, LSTM LM
    python examples/train_models.py --match gpt2 --steps 50
    python examples/train_models.py --steps 3          # on a CPU: tiny versions, Triton's interpreter

The models are defined in tritondnn.bench.models (no weights downloaded). For each, two copies
start from the same weights (one seed); one is patched with ``tdnn.nn.patch(model, sdpa=True, fuse=True)``;
both train on the same random batches (bf16 autocast on a GPU, fp32 on a CPU). A third, plain copy
whose weights start moved by one rounding measures how far PyTorch parts from itself. The script
prints the loss curves and the median step times, and exits with 1 if tritondnn's losses part
from PyTorch's by more than ``loss_tolerance`` allows (see there for why).
"""

from __future__ import annotations

import argparse
import statistics
import sys

from tritondnn.bench.models import agreement, compare, workloads
from tritondnn.core.backend import INTERPRET


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50, help="training steps per model")
    parser.add_argument("--match", default="", help="only the models whose name contains this text")
    args = parser.parse_args()

    low_precision = not INTERPRET  # bf16 autocast on the GPU
    failures = 0
    for workload in workloads(tiny=INTERPRET):
        if args.match.lower() not in workload.name.lower():
            continue
        run = compare(workload, args.steps, low_precision)
        ours, theirs, perturbed = run["tritondnn loss"], run["torch loss"], run["torch perturbed loss"]
        worst, tolerance = agreement(run, low_precision)
        failures += worst > tolerance
        print(f"{workload.name}")
        for step, (a, b, c) in enumerate(zip(ours, theirs, perturbed)):
            print(f"  step {step:3d}: loss {a:.4f} tritondnn, {b:.4f} PyTorch, {c:.4f} PyTorch perturbed")
        # The first step compiles kernels and warms the allocator: medians skip it.
        t_ours = statistics.median(run["tritondnn s"][1:] or run["tritondnn s"]) * 1e3
        t_torch = statistics.median(run["torch s"][1:] or run["torch s"]) * 1e3
        verdict = "ok" if worst <= tolerance else "FAIL"
        print(f"  median step {t_ours:.1f} ms vs {t_torch:.1f} ms ({t_torch / t_ours:.2f}x PyTorch)")
        print(f"  largest relative loss difference {worst:.1e} (tolerance {tolerance:.0e}): {verdict}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
