"""Every script under examples/ runs to the end (on a CPU through the interpreter, small sizes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import ON_GPU

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]

RUNS = {
    "quickstart": [sys.executable, "quickstart.py"],
    "graph_api": [sys.executable, "graph_api.py"],
    "train_models": [sys.executable, "train_models.py", "--steps", "2", "--match", "gpt"],
    "ddp_train": [*TORCHRUN, "ddp_train.py", "--tiny", "--steps", "1"],
    "ddp_train fsdp2": [*TORCHRUN, "ddp_train.py", "--tiny", "--steps", "1", "--fsdp2"],
}


@pytest.mark.parametrize("name", list(RUNS))
def test_example_runs(name):
    if name.startswith("ddp_train") and ON_GPU and torch.cuda.device_count() < 2:
        pytest.skip("one NCCL process per GPU: needs two GPUs")
    scripts = {p.name for p in EXAMPLES.glob("*.py")}
    run = {arg for command in RUNS.values() for arg in command if arg.endswith(".py")}
    assert scripts == run, f"every example is run here: {sorted(scripts ^ run)}"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(RUNS[name], cwd=EXAMPLES, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "FAIL" not in done.stdout
