"""The ``distributed`` bench suite end to end under torchrun with two processes: gloo through the
interpreter on a CPU, NCCL on a machine with two GPUs. Its loss check is the acceptance test of
data-parallel training: DDP and FSDP2 over the split batch against one process on all of it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import ON_GPU
from tritondnn.bench.distributed import LossCheck


@pytest.mark.skipif(ON_GPU and torch.cuda.device_count() < 2, reason="needs two GPUs (one process each)")
def test_suite_trains_data_parallel_like_one_process(tmp_path):
    results, losses = tmp_path / "distributed.json", tmp_path / "losses.json"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        "-m", "tritondnn.bench.distributed", "--tiny", "--steps", "3", "--warmup", "1",
        "--json", str(results), "--losses", str(losses),
    ]  # fmt: skip
    # One thread a process: the ranks share CI's two cores.
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]

    rows = json.loads(results.read_text())["rows"]
    timed = {(r["case"], r["provider"]) for r in rows if r["ms"] > 0}
    for direction in ("fwd", "fwd+bwd"):
        assert any(c.startswith("sync_batch_norm") and c.endswith(direction) for c, _ in timed)
    for run in ("1 GPU", "ddp 2 GPUs", "fsdp2 2 GPUs"):
        for provider in ("tritondnn", "torch"):
            assert (f"gpt tiny B4 {run} train step", provider) in timed

    checks = json.loads(losses.read_text())
    assert len(checks) == (8 if ON_GPU else 4)  # (ddp, fsdp2) x (tritondnn, torch) x models
    for check in checks:
        assert check["ok"], check
        # The check tells synchronized training from ranks training alone on their shares.
        assert check["unsynced_error"] > LossCheck.TOLERANCE > check["error"], check
        assert len(check["split"]) == len(check["one_gpu"]) == 3
        # The model learns: a check of constant losses would prove nothing about synced gradients.
        assert len(set(check["one_gpu"])) == 3
