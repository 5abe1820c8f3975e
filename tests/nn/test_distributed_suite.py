"""The ``distributed`` bench suite end to end under torchrun with two processes: gloo through the
interpreter on a CPU, NCCL on a machine with two GPUs. Its loss check is the acceptance test of
data-parallel training: DDP and FSDP2 over the split batch against one process on all of it."""

from __future__ import annotations

import dataclasses
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
        assert check["unsynced_error"] > check["bound"] > check["error"], check
        assert check["bound"] == max(LossCheck.TOLERANCE, LossCheck.NOISE_FACTOR * check["noise"])
        assert len(check["split"]) == len(check["one_gpu"]) == 3
        # The model learns: a check of constant losses would prove nothing about synced gradients.
        assert len(set(check["one_gpu"])) == 3


def test_loss_check_bound_follows_the_summation_order_noise():
    """The bound is the floor for a model whose losses barely move with the summation order, and
    a multiple of the reversed rows' difference for one that amplifies rounding (the ResNet-50
    losses below are the first steps of an H200 run: split, one GPU, reversed rows, unsynced)."""
    one = [7.08939, 7.16072, 7.29891, 7.58629]
    split = [7.09000, 7.14468, 7.30979, 7.58861]
    reversed_rows = [7.09122, 7.15276, 7.29547, 7.58903]
    resnet = LossCheck("resnet", split, one, reversed_rows, [7.08816, 7.29291, 7.66826, 8.23683])
    assert resnet.noise > LossCheck.TOLERANCE and resnet.bound == LossCheck.NOISE_FACTOR * resnet.noise
    assert resnet.error > LossCheck.TOLERANCE and resnet.verdict == "ok"
    # A split twice the bound away fails; ranks that drift no further than the noise prove nothing.
    drifted = [v * (1 + 2 * resnet.bound) for v in one]
    assert dataclasses.replace(resnet, split=drifted).verdict == "TOO LARGE"
    assert dataclasses.replace(resnet, unsynced=resnet.split).verdict == "INCONCLUSIVE"
    quiet = LossCheck("gpt", [1.0, 2.0 + 3e-5], [1.0, 2.0], [1.0, 2.0 + 2e-7], [1.0, 2.1])
    assert quiet.bound == LossCheck.TOLERANCE and quiet.verdict == "ok"
    assert dataclasses.replace(quiet, split=[1.0, 2.001]).verdict == "TOO LARGE"
