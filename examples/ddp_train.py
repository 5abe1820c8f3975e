"""Data-parallel training with tritondnn inside torch.distributed.

Launch one process per GPU (NCCL), or two CPU processes (gloo, tiny model, Triton's interpreter):

    torchrun --nproc_per_node=2 examples/ddp_train.py            # GPUs: ResNet-50, N=64 per GPU
    torchrun --nproc_per_node=2 examples/ddp_train.py --fsdp2    # the same, sharded with FSDP2
    torchrun --nproc_per_node=2 examples/ddp_train.py --cuda-graph  # DDP, each step a graph replay
    torchrun --nproc_per_node=2 examples/ddp_train.py --tiny     # CPU or a quick GPU check

On GPUs the model's BatchNorm layers become ``tdnn.nn.SyncBatchNorm`` (statistics over the global
batch); every other supported layer is patched to tritondnn's, and DistributedDataParallel averages the
gradients (or, with ``--fsdp2``, ``fully_shard`` shards parameters, gradients and optimizer state
over the ranks, one unit per stage of blocks). Rank 0 prints the loss and the step time.

``--cuda-graph`` captures the whole step (forward, backward with its collectives, optimizer) in a
CUDA graph after eager warm-up steps and replays it: no host work per step but copying the batch
in. A ResNet-50 step is host-bound on the hosts measured, so this is what lets two GPUs go
faster than one (bench/results/README.md, "whole steps in CUDA graphs").
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import tritondnn as tdnn
from tritondnn.bench.models import ResNet, graphed_training_step, training_step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true", help="a small ResNet on 16x16 images")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--fsdp2", action="store_true", help="shard with fully_shard instead of DDP")
    parser.add_argument("--cuda-graph", action="store_true", help="replay each step as a CUDA graph (GPUs)")
    args = parser.parse_args()

    on_gpu = tdnn.backend() == "gpu"
    if args.cuda_graph and not on_gpu:
        parser.error("--cuda-graph needs GPUs")
    if args.cuda_graph and args.fsdp2:  # the bench captures FSDP2 with units kept gathered only
        parser.error("--cuda-graph goes with DDP here")
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
        # A DDP step to be captured needs DDP built off the default stream (PyTorch's notes).
        with torch.cuda.stream(torch.cuda.Stream() if args.cuda_graph else None):
            wrapped = DistributedDataParallel(model, device_ids=[device.index] if on_gpu else None)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.05, momentum=0.9)

    batch, size = (4, 16) if args.tiny else (64, 224)
    gen = torch.Generator().manual_seed(1 + rank)  # each rank its own shard of the data

    def make_batch() -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(batch, 3, size, size, generator=gen).to(device, memory_format=torch.channels_last)
        return x, torch.randint(0, 10 if args.tiny else 1000, (batch,), generator=gen).to(device)

    # Forward under bf16 autocast on GPUs, the loss in fp32 (tdnn.cross_entropy), backward, the
    # optimizer's step.
    if args.cuda_graph:  # eager steps on a first batch, the capture, the weights put back
        step = graphed_training_step(wrapped, opt, on_gpu, *make_batch(), tdnn_loss=True)
    else:
        step = training_step(wrapped, opt, on_gpu, tdnn_loss=True)
    for i in range(args.steps):
        x, target = make_batch()
        start = time.perf_counter()
        loss = step(x, target)
        dist.all_reduce(loss)
        if rank == 0:
            mean_loss = loss.item() / dist.get_world_size()
            print(f"step {i}: loss {mean_loss:.4f}, {time.perf_counter() - start:.3f} s")
    # An FSDP2 module and its state refer to each other, so only the garbage collector frees
    # them, with their hold on the process group: now, not during interpreter exit, where a gloo
    # rank could abort ("terminate called without an active exception").
    del step, opt, wrapped, model
    gc.collect()
    dist.barrier()  # leave together: a rank whose peers still communicate can abort at exit (gloo)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
