"""A tritondnn-patched model trained with DistributedDataParallel and with FSDP2 (fully_shard) over
gloo, two processes each holding half the batch, against one process training the plain PyTorch
model on the whole batch: the same losses step after step (which needs the gradients synced)."""

from __future__ import annotations

import gc
import json
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import tritondnn.nn as tnn
from helpers import ON_GPU, run_processes
from tritondnn.bench.models import GPT

pytestmark = pytest.mark.skipif(
    ON_GPU, reason="gloo over CPU tensors runs in CI; on GPUs the NCCL runs use torchrun (2 GPUs)"
)

WORLD, STEPS, VOCAB = 2, 3, 64


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(VOCAB, 32, 2, 2, 16)


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2 * WORLD, 17), generator=torch.Generator().manual_seed(step))


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(ids[:, :-1]).reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def _train(model: torch.nn.Module, rows: slice, reduce=None) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        loss = _loss(model, _batch(step)[rows])
        opt.zero_grad()
        loss.backward()
        opt.step()
        value = loss.detach()
        if reduce is not None:
            value = reduce(value)
        losses.append(value.item())
    return losses


def _worker(rank: int, port: int, wrapper: str, out: str) -> None:
    # One thread a process: the ranks share CI's two cores with the other test worker.
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        model = _model()
        replaced = tnn.patch(model, sdpa=True).replaced
        assert len(replaced) > 10
        if wrapper == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model)
        else:
            from torch.distributed.fsdp import fully_shard

            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)

        def mean_over_ranks(t: torch.Tensor) -> torch.Tensor:
            dist.all_reduce(t)
            return t / WORLD

        losses = _train(model, slice(2 * rank, 2 * rank + 2), mean_over_ranks)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(losses, f)
        # FSDP2's module and state form a cycle: freed here, while the process group lives,
        # not during interpreter exit (where a gloo rank can abort).
        del model
        gc.collect()
        dist.barrier()  # leave together: a rank whose peers still communicate can abort at exit
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_data_parallel_training_matches_one_process(wrapper, tmp_path):
    out = tmp_path / "losses.json"
    run_processes(_worker, (_free_port(), wrapper, str(out)), WORLD)
    got = json.loads(out.read_text())
    expected = _train(_model(), slice(None))
    assert len(got) == STEPS
    assert got == pytest.approx(expected, rel=2e-4), f"{wrapper}: {got} vs one process {expected}"
