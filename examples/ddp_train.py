"""Data-parallel training with tritondnn inside torch.distributed.

Launch one process per GPU (NCCL), or two CPU processes (gloo, tiny model, Triton's interpreter):

    torchrun --nproc_per_node=2 examples/ddp_train.py            # GPUs: ResNet-50, N=64 per GPU
    torchrun --nproc_per_node=2 examples/ddp_train.py --fsdp2    # the same, sharded with FSDP2
    torchrun --nproc_per_node=2 examples/ddp_train.py --tiny     # CPU or a quick GPU check

On GPUs the model's BatchNorm layers become ``tdnn.nn.SyncBatchNorm`` (statistics over the global
batch); every other supported layer is patched to tritondnn's, and DistributedDataParallel averages the
gradients (or, with ``--fsdp2``, ``fully_shard`` shards parameters, gradients and optimizer state
over the ranks, one unit per stage of blocks). Rank 0 prints the loss and the step time.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import tritondnn as tdnn
from tritondnn.bench.models import ResNet


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true", help="a small ResNet on 16x16 images")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--fsdp2", action="store_true", help="shard with fully_shard instead of DDP")
    args = parser.parse_args()

    on_gpu = tdnn.backend() == "gpu"
    dist.init_process_group("nccl" if on_gpu else "gloo")
    rank = dist.get_rank()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if on_gpu else "cpu")
    if on_gpu:
        torch.cuda.set_device(device)

    torch.manual_seed(0)  # the same initial weights on every rank
    model = ResNet((1, 1), 4, 10) if args.tiny else ResNet()
    if on_gpu:  # DDP accepts SyncBatchNorm on GPU modules only (tests/nn covers it over gloo)
        model = tdnn.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    report = tdnn.nn.patch(model)
    # Channels-last weights suit the convolutions; FSDP2 shards contiguous parameters only (the
    # activations stay channels-last either way: the input is).
    model = model.to(device) if args.fsdp2 else model.to(device, memory_format=torch.channels_last)
    if rank == 0:
        print(f"{len(report.replaced)} modules run tritondnn; world size {dist.get_world_size()}")
    if args.fsdp2:
        from torch.distributed.fsdp import fully_shard

        blocks = list(model.layers)
        size = -(-len(blocks) // 4)
        for i in range(0, len(blocks), size):
            fully_shard(blocks[i : i + size])
        wrapped = fully_shard(model)
    else:
        wrapped = DistributedDataParallel(model, device_ids=[device.index] if on_gpu else None)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.05, momentum=0.9)

    batch, size = (4, 16) if args.tiny else (64, 224)
    gen = torch.Generator().manual_seed(1 + rank)  # each rank its own shard of the data
    for step in range(args.steps):
        x = torch.randn(batch, 3, size, size, generator=gen).to(device, memory_format=torch.channels_last)
        target = torch.randint(0, 10 if args.tiny else 1000, (batch,), generator=gen).to(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=on_gpu):
            loss = F.cross_entropy(wrapped(x).float(), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss = loss.detach()
        dist.all_reduce(loss)
        if rank == 0:
            mean_loss = loss.item() / dist.get_world_size()
            print(f"step {step}: loss {mean_loss:.4f}, {time.perf_counter() - start:.3f} s")
    dist.barrier()  # leave together: a rank whose peers still communicate can abort at exit (gloo)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
