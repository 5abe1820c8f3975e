"""tdnn.nn.SyncBatchNorm with the gloo backend and two processes: values, gradients and running
statistics against one BatchNorm over the concatenated batch, with uneven batch sizes."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
from torch import nn

import tritondnn.nn as tnn
from helpers import ON_GPU, run_processes

pytestmark = pytest.mark.skipif(
    ON_GPU, reason="gloo over CPU tensors runs in CI; on GPUs the NCCL runs use torchrun (2 GPUs)"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _data(sizes: tuple[int, ...], channels_last: bool):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(sum(sizes), 4, 3, 3, generator=gen) * 2 + 50  # a large mean
    dy = torch.randn(x.shape, generator=gen)
    residual = torch.randn(x.shape, generator=gen)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
        residual = residual.contiguous(memory_format=torch.channels_last)
    return x, dy, residual


def _worker(
    rank: int, port: int, out_dir: str, sizes: tuple[int, ...], channels_last: bool, tail: str
) -> None:
    torch.set_num_threads(1)  # one thread a process: the ranks share CI's two cores
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=len(sizes))
    try:
        torch.manual_seed(0)
        bn = nn.BatchNorm2d(4, momentum=0.3)
        with torch.no_grad():
            bn.weight.uniform_(0.5, 1.5), bn.bias.uniform_(-1, 1)
        model = tnn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(bn))
        assert type(model[0]) is tnn.SyncBatchNorm
        x, dy, residual = _data(sizes, channels_last)
        rows = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
        xs = x[rows].detach().requires_grad_(True)
        rs = residual[rows].detach().requires_grad_(True)
        if tail == "relu":
            y = model[0].forward_relu(xs)
        elif tail == "add+relu":
            y = model[0].forward_relu(xs, rs)
        else:
            y = model(xs)
        y.backward(dy[rows])
        torch.save(
            {"y": y.detach(), "dx": xs.grad, "dw": model[0].weight.grad, "db": model[0].bias.grad,
             "dr": rs.grad if tail == "add+relu" else torch.zeros(rs.shape),
             "rm": model[0].running_mean, "rv": model[0].running_var},
            os.path.join(out_dir, f"rank{rank}.pt"),
        )  # fmt: skip
        dist.barrier()  # leave together: a rank whose peers still communicate can abort at exit
    finally:
        dist.destroy_process_group()


# Rows per rank: uneven, and a rank with none (it still joins both collectives); the batch norm
# alone, with a fused ReLU, and with a fused residual add and ReLU (forward_relu).
@pytest.mark.parametrize(
    ("sizes", "channels_last", "tail"),
    [
        ((3, 5), False, ""),
        ((3, 5), True, ""),
        ((0, 6), True, ""),
        ((3, 5), False, "relu"),
        ((3, 5), True, "add+relu"),
        ((0, 6), False, "add+relu"),
    ],
)
def test_matches_batch_norm_over_the_global_batch(tmp_path, sizes, channels_last, tail):
    run_processes(_worker, (_free_port(), str(tmp_path), sizes, channels_last, tail), len(sizes))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(len(sizes))]
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(4, momentum=0.3)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5), bn.bias.uniform_(-1, 1)
    bn = bn.double()
    x, dy, residual = _data(sizes, channels_last)
    x = x.double().requires_grad_(True)
    residual = residual.double().requires_grad_(True)
    y = bn(x)
    if tail:
        y = torch.relu(y + residual if tail == "add+relu" else y)
        # Both signs reach the ReLU: the gradient's mask is exercised.
        assert 0.2 < (y > 0).double().mean() < 0.8
    y.backward(dy.double())
    got = {k: torch.cat([r[k] for r in ranks]) for k in ("y", "dx", "dr")}
    torch.testing.assert_close(got["y"].double(), y.detach(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got["dx"].double(), x.grad, rtol=1e-4, atol=1e-4)
    if tail == "add+relu":
        torch.testing.assert_close(got["dr"].double(), residual.grad, rtol=1e-4, atol=1e-4)
    # parameter gradients are per rank (DDP sums/averages them): their sum is the global one
    torch.testing.assert_close(sum(r["dw"] for r in ranks).double(), bn.weight.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(sum(r["db"] for r in ranks).double(), bn.bias.grad, rtol=1e-4, atol=1e-4)
    for r in ranks:  # every rank updates its running statistics with the global ones
        torch.testing.assert_close(r["rm"].double(), bn.running_mean, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r["rv"].double(), bn.running_var, rtol=1e-4, atol=1e-4)


def test_single_process_is_batch_norm():
    torch.manual_seed(0)
    theirs = nn.SyncBatchNorm(3)
    ours = tnn.SyncBatchNorm(3)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(4, 3, 5)
    torch.testing.assert_close(ours(x), nn.BatchNorm1d.forward(theirs, x), rtol=1e-5, atol=1e-5)
    assert repr(ours) == repr(theirs) and isinstance(ours, nn.SyncBatchNorm)
