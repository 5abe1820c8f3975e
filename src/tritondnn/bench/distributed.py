"""The ``distributed`` suite: data-parallel training over several processes, run under torchrun.

    torchrun --nproc_per_node=2 -m tritondnn.bench.distributed --json out/distributed.json
    python -m tritondnn bench distributed --json out/distributed.json   # launches the above

One process per GPU (NCCL); on a CPU, ``--tiny`` runs small models over gloo through Triton's
interpreter. Every rank must make the same collective calls, so each timed call runs a fixed
number of times on every rank (no adaptive repetition) and a case's time is the slowest rank's
median.

Cases:

* ``sync_batch_norm``: ``tdnn.nn.SyncBatchNorm`` against ``torch.nn.SyncBatchNorm``, forward
  and forward+backward, on each rank's share of the batch (GB/s counts each rank's minimal bytes).
* Whole models (``bench.models``'s ResNet-50 and GPT-2 small): one training step on one GPU with
  the global batch, and with the batch split over the ranks under ``DistributedDataParallel``
  (BatchNorm converted to SyncBatchNorm) and under FSDP2 (``fully_shard`` on four groups of
  blocks, then the rest; parameters kept gathered from forward to backward: see ``FSDP_UNITS``); tritondnn
  patched against plain PyTorch. The losses of the split runs are compared with the one-GPU run
  on the same data (``--losses`` writes them), beside two controls: rank 1 trains the one-GPU
  model on the same batches with their rows reversed, which changes nothing but the order of
  every batch reduction, and each rank trains on its share with no communication at all. The
  run fails where a split run's losses differ by more than that tolerance, or where the
  uncommunicating control stays within it too (a check that could not have failed). The
  tolerance is ``LossCheck.bound``: the larger of a fixed floor and a multiple of the reversed
  rows' difference, since a model whose training amplifies rounding (ResNet-50 in bf16) moves
  its losses by percents under a mere change of summation order.
* The same training runs (one GPU, DDP, FSDP2) with each whole step captured in a CUDA graph
  (``bench.models.graphed_training_step``): the step's device time, without the host's launches
  and hooks, which bound these models' eager steps on the hosts measured; and the SyncBatchNorm
  cases captured the same way. ``--no-graph`` skips them.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..core.backend import DEVICE_TYPE, INTERPRET
from . import Case, Row, Table, graphed, run_cases, write_json
from .models import GPT, ResNet, graphed_training_step, relative_difference, training_step

SUITE = "distributed"
WRAPPERS = ("ddp", "fsdp2")
# FSDP2 sharding units (groups of blocks). Each unit costs host time in hooks every step (about
# 1 ms per block in backward for GPT-2 small on an H200 host, under the profiler): per-block
# units make the hooks the bottleneck at these sizes; four units still overlap gathers with
# compute. Gathered parameters stay from forward to backward (no second all-gather): these
# models fit unsharded.
FSDP_UNITS = 4


def _sync() -> None:
    if not INTERPRET:
        torch.cuda.synchronize()


def _slowest(value: float) -> float:
    """The largest ``value`` over the ranks (a step is as slow as its slowest rank)."""
    t = torch.tensor([value], dtype=torch.float64, device=DEVICE_TYPE)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def lockstep_ms(fn: Callable[[], object], reps: int, warmup: int = 3) -> float:
    """Median milliseconds of one call of ``fn`` (which may make collective calls), every rank
    calling it the same number of times; the slowest rank's median."""
    for _ in range(warmup):
        fn()
    _sync()
    dist.barrier()
    if INTERPRET:
        samples = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e3)
    else:
        timer = lambda: torch.cuda.Event(enable_timing=True)
        events = [(timer(), timer()) for _ in range(reps)]
        for begin, end in events:
            begin.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        samples = [begin.elapsed_time(end) for begin, end in events]
    return _slowest(statistics.median(samples))


# ---------------------------------------------------------------------------------------------
# SyncBatchNorm.


def sync_batch_norm_cases(tiny: bool) -> list[Case]:
    """tritondnn's and torch's SyncBatchNorm on each rank's (N, C, H, W) share, channels_last."""
    from ..nn import SyncBatchNorm

    n, c, hw = (4, 8, 6) if tiny else (64, 256, 56)
    dtype, dtype_name = (torch.float32, "fp32") if INTERPRET else (torch.bfloat16, "bf16")
    gen = torch.Generator(DEVICE_TYPE).manual_seed(dist.get_rank())
    x = torch.randn(n, c, hw, hw, generator=gen, device=DEVICE_TYPE, dtype=dtype)
    x = x.contiguous(memory_format=torch.channels_last).requires_grad_(True)
    dy = torch.randn(x.shape, generator=gen, device=DEVICE_TYPE, dtype=dtype)
    dy = dy.contiguous(memory_format=torch.channels_last)
    theirs = nn.SyncBatchNorm(c).to(DEVICE_TYPE)
    ours = copy.deepcopy(theirs)
    ours.__class__ = SyncBatchNorm

    def forward(bn: nn.Module) -> Callable[[], object]:
        def run() -> object:
            with torch.no_grad():
                return bn(x)

        return run

    def forward_backward(bn: nn.Module) -> Callable[[], object]:
        def run() -> object:
            x.grad = None
            bn.weight.grad = bn.bias.grad = None
            bn(x).backward(dy)

        return run

    def both(make: Callable[[nn.Module], Callable[[], object]]) -> dict[str, Callable[[], object]]:
        # torch's SyncBatchNorm refuses CPU tensors: no anchor under the interpreter.
        return {"tritondnn": make(ours)} if INTERPRET else {"tritondnn": make(ours), "torch": make(theirs)}

    def captured(name: str, calls: dict[str, Callable[[], object]], size: int) -> Case:
        # Replays of a CUDA graph (the collectives in it): the device's time alone, without the
        # host's launches. Captured when the case is selected, not for cases --match leaves out.
        case = Case(f"{name}, CUDA graph", {}, bytes=size)

        def capture() -> str:
            for provider, fn in calls.items():
                replay = graphed(fn)
                if replay is not None:
                    case.providers[provider] = replay
            return ""

        case.prepare = capture
        return case

    name = f"sync_batch_norm {n}x{c}x{hw}x{hw} per rank {dtype_name} NHWC"
    size = x.numel() * x.element_size()
    cases = [
        Case(f"{name} fwd", both(forward), bytes=2 * size),
        # x and dy read, dx written by the backward; x read and y written by the forward.
        Case(f"{name} fwd+bwd", both(forward_backward), bytes=5 * size),
    ]
    if not INTERPRET:
        cases += [
            captured(f"{name} fwd", both(forward), 2 * size),
            captured(f"{name} fwd+bwd", both(forward_backward), 5 * size),
        ]
    return cases


# ---------------------------------------------------------------------------------------------
# Whole models.


@dataclasses.dataclass
class Workload:
    """A model trained data-parallel: ``per_rank`` samples on each rank, the global batch
    (``per_rank`` times the world size) on one GPU for the reference."""

    name: str
    make_model: Callable[[], nn.Module]
    make_batch: Callable[[int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    per_rank: int
    blocks: Callable[[nn.Module], Sequence[nn.Module]]  # the repeated blocks FSDP2 shards in groups
    channels_last: bool = False


def workloads(tiny: bool) -> list[Workload]:
    dev = DEVICE_TYPE

    def images(size: int, classes: int):
        def batch(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
            x = torch.randn(n, 3, size, size, generator=g, device=dev)
            return x.contiguous(memory_format=torch.channels_last), torch.randint(
                0, classes, (n,), generator=g, device=dev
            )

        return batch

    def tokens(s: int, vocab: int):
        def batch(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
            ids = torch.randint(0, vocab, (n, s + 1), generator=g, device=dev)
            return ids[:, :-1], ids[:, 1:]

        return batch

    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    # AdamW's fused kernel (one pass over the weights, states and gradients) on GPUs: the foreach
    # form's ten-odd passes took 3.6 ms of GPT-2 small's step at any batch on an H200 (measured
    # under the profiler), a cost a split batch does not shrink.
    adamw = lambda m: torch.optim.AdamW(m.parameters(), lr=3e-4, fused=not INTERPRET)
    blocks = lambda m: list(m.blocks)
    bottlenecks = lambda m: list(m.layers)
    if tiny:
        gpt = Workload("gpt tiny", lambda: GPT(64, 32, 2, 2, 16), tokens(16, 64), adamw, 2, blocks)
        small_resnet = lambda: ResNet((1, 1), 4, 10)
        resnet = Workload("resnet tiny", small_resnet, images(16, 10), sgd, 2, bottlenecks, True)
        # DDP refuses SyncBatchNorm in CPU modules (tests/nn/test_sync_batchnorm.py covers it on gloo).
        return [gpt] if INTERPRET else [gpt, resnet]
    return [
        Workload("gpt2-small S1024 bf16", GPT, tokens(1024, 50257), adamw, 8, blocks),
        Workload("resnet50 224 bf16 NHWC", ResNet, images(224, 1000), sgd, 64, bottlenecks, True),
    ]


def _prepare(w: Workload, provider: str, wrapper: str | None, graph: bool = False) -> nn.Module:
    """The workload's model (the same initial weights everywhere) on this rank's device, patched
    for ``tritondnn``. ``wrapper``: None (one process), ``"ddp"`` or ``"fsdp2"`` (BatchNorm
    synced, the model wrapped), or ``"unsynced"`` (the control: each rank trains alone).
    ``graph``: the model's steps will be captured in a CUDA graph (DDP is then built on a side
    stream, as PyTorch's notes on capturing DDP ask)."""
    from ..nn import SyncBatchNorm, patch

    torch.manual_seed(0)
    model = w.make_model()
    if wrapper in WRAPPERS:
        model = (SyncBatchNorm if provider == "tritondnn" else nn.SyncBatchNorm).convert_sync_batchnorm(model)
    if provider == "tritondnn":
        patch(model, sdpa=True, fuse=True)
    model = model.to(DEVICE_TYPE)
    if w.channels_last and wrapper != "fsdp2":  # FSDP2 refuses parameters that are not contiguous
        model = model.to(memory_format=torch.channels_last)
    if wrapper == "ddp":
        ids = None if INTERPRET else [torch.cuda.current_device()]
        # Gradients as views of the all-reduce buckets: no copy per parameter after the last
        # all-reduce (host time and a kernel each, between the backward pass and the optimizer).
        side = torch.cuda.Stream() if graph else None
        with torch.cuda.stream(side):  # None: the current stream
            return nn.parallel.DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=True)
    if wrapper == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        blocks = list(w.blocks(model))
        size = -(-len(blocks) // FSDP_UNITS)
        for i in range(0, len(blocks), size):
            fully_shard(blocks[i : i + size], reshard_after_forward=False)
        fully_shard(model, reshard_after_forward=False)
    return model


def train(
    w: Workload, provider: str, wrapper: str | None, steps: int, warmup: int, graph: bool = False
) -> tuple[list[float], float]:
    """Train ``steps`` steps; (the global batch's loss each step, the median step time in ms over
    the steps after ``warmup``). ``wrapper`` None: one process trains on the whole batch (rank 1
    and up on the same rows reversed); else each rank trains on its rows of it. ``graph``: each
    step is a CUDA graph's replay (captured after eager steps on the first batch, from which
    the model and optimizer are then reset: see ``graphed_training_step``)."""
    model = _prepare(w, provider, wrapper, graph)
    rank, world = dist.get_rank(), dist.get_world_size()

    def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, target = w.make_batch(w.per_rank * world, torch.Generator(DEVICE_TYPE).manual_seed(100 + i))
        if wrapper is not None:
            rows = slice(rank * w.per_rank, (rank + 1) * w.per_rank)
            x, target = x[rows], target[rows]
        elif rank > 0:
            x, target = x.flip(0), target.flip(0)
        if w.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x, target

    opt, low_precision, ours = w.make_optimizer(model), not INTERPRET, provider == "tritondnn"
    if graph:
        step = graphed_training_step(model, opt, low_precision, *batch(0), tdnn_loss=ours)
    else:
        step = training_step(model, opt, low_precision, tdnn_loss=ours)
    losses, times = [], []
    for i in range(steps):
        x, target = batch(i)
        _sync()
        if wrapper is not None:
            dist.barrier()  # a step starts together on every rank
        start = time.perf_counter()
        loss = step(x, target)
        if wrapper is not None:
            dist.all_reduce(loss)  # the mean of the ranks' means (gloo has no AVG)
            loss = loss / world
        losses.append(loss.item())  # waits for the step
        times.append((time.perf_counter() - start) * 1e3)
    del model, step, opt
    gc.collect()  # an FSDP2 model is a reference cycle: its memory and process-group hold go now
    if not INTERPRET:
        torch.cuda.empty_cache()
    return losses, statistics.median(times[warmup:])


@dataclasses.dataclass
class LossCheck:
    """A split run's losses against the one-GPU run's, beside two controls: the one-GPU run on the
    batches' rows reversed (the noise of reduction order alone) and the split run without any
    communication (what a check must tell apart from synchronized training).

    The split run passes within ``bound``, relative: ``TOLERANCE`` or ``NOISE_FACTOR`` times the
    reversed rows' difference (``noise``), whichever is larger. A split changes the order of
    the batch's sums and nothing else, as reversing the rows does, so its losses may move as far
    as that control's, with a margin for the control being one sample. Measured on H200s: GPT-2
    small in bf16 (8-12 steps), reversed rows moved the loss by 1-4e-6 and DDP/FSDP2 splits by
    1.5e-6 to 1.5e-5 (the floor decides); ResNet-50 in bf16 (8 steps, SGD at 0.05 with momentum)
    amplifies rounding, step by step: reversed rows 2.6e-4 at the first step's forward, 1.2-2.1e-2
    by the eighth; the splits 0.7-2.5e-2 (1.3-2.0x the reversed rows' difference); ranks
    training alone 1.1e-1. fp32 on a CPU: 1e-7 to 2e-7, and ranks alone (tiny GPT, 3 steps)
    3.8e-4. Every run reports its own controls (``noise``, ``unsynced_error``)."""

    TOLERANCE = 1e-4
    NOISE_FACTOR = 4.0

    case: str
    split: list[float]
    one_gpu: list[float]
    one_gpu_reversed: list[float]
    unsynced: list[float]

    @property
    def error(self) -> float:
        return relative_difference(self.split, self.one_gpu)

    @property
    def noise(self) -> float:
        return relative_difference(self.one_gpu_reversed, self.one_gpu)

    @property
    def unsynced_error(self) -> float:
        return relative_difference(self.unsynced, self.one_gpu)

    @property
    def bound(self) -> float:
        """The largest relative difference a split run may show: the floor, or the noise of the
        summation order with its margin."""
        return max(self.TOLERANCE, self.NOISE_FACTOR * self.noise)

    @property
    def verdict(self) -> str:
        """ "ok", "TOO LARGE", or "INCONCLUSIVE" where unsynchronized training also stays within
        the bound (the check could not have failed: train more steps, or fewer where the noise
        grows as fast as the ranks drift apart)."""
        if self.unsynced_error <= self.bound:
            return "INCONCLUSIVE"
        return "ok" if self.error <= self.bound else "TOO LARGE"

    @property
    def ok(self) -> bool:
        return self.verdict == "ok"


def model_cases(
    workload_list: Sequence[Workload],
    providers: Sequence[str],
    steps: int,
    warmup: int,
    table: Table,
    graphs: bool = False,
) -> tuple[list[Row], list[LossCheck]]:
    """Per workload: the one-GPU runs (and their reversed-rows controls on the other ranks), the
    unsynchronized control, then DDP and FSDP2 runs; with ``graphs``, then the one-GPU, DDP and
    FSDP2 runs again with each step captured in a CUDA graph. Rows for the table and the loss checks:
    every split run's, and every captured run's, against the eager one-GPU run's losses."""
    rows: list[Row] = []
    checks: list[LossCheck] = []
    for w in workload_list:
        _workload_cases(w, providers, steps, warmup, table, graphs, rows, checks)
    return rows, checks


def _workload_cases(
    w: Workload,
    providers: Sequence[str],
    steps: int,
    warmup: int,
    table: Table,
    graphs: bool,
    rows: list[Row],
    checks: list[LossCheck],
) -> None:
    """``model_cases`` for one workload, appending to ``rows`` and ``checks``."""
    world = dist.get_world_size()
    batch = w.per_rank * world
    one: dict[str, list[list[float]]] = {}  # provider: each rank's losses of the one-GPU run
    unsynced: dict[str, list[float]] = {}
    single_ms: dict[tuple[str, bool], float] = {}  # (provider, graph): the one-GPU step

    def measure(wrapper: str | None, graph: bool) -> None:
        where = "1 GPU" if wrapper is None else f"{wrapper} {world} GPUs"
        case = Case(f"{w.name} B{batch} {where} train step{', CUDA graph' if graph else ''}", {})
        measured = []
        for provider in providers:
            losses, ms = train(w, provider, wrapper, steps, warmup, graph)
            if wrapper is None:  # rank 0's time: the other ranks train on reversed rows
                each_rank: list[list[float]] = [[] for _ in range(world)]
                dist.all_gather_object(each_rank, losses)
                losses = each_rank[0]
                if not graph:
                    one[provider] = each_rank
                rank0_ms = torch.tensor([ms], dtype=torch.float64, device=DEVICE_TYPE)
                dist.broadcast(rank0_ms, 0)
                ms = single_ms[provider, graph] = float(rank0_ms.item())
            else:
                ms = _slowest(ms)
            measured.append(Row(SUITE, case.name, provider, ms, None, None))
            if wrapper is not None or graph:
                checks.append(
                    LossCheck(f"{case.name} {provider}", losses, *one[provider][:2], unsynced[provider])
                )
        table.add(case, measured)
        rows.extend(measured)
        if wrapper is not None:
            for row in measured:
                ratio = single_ms[row.provider, graph] / row.ms
                table.echo(f"  {row.provider}: {world} GPUs {ratio:.2f}x the throughput of one")

    measure(None, False)
    unsynced.update({p: train(w, p, "unsynced", steps, warmup)[0] for p in providers})
    for wrapper in WRAPPERS:
        measure(wrapper, False)
    if graphs:
        measure(None, True)
        for wrapper in WRAPPERS:
            measure(wrapper, True)


# ---------------------------------------------------------------------------------------------
# Entry points: ``launch`` (what ``tritondnn bench distributed`` calls) and ``main`` (each rank).


def launch(quick: bool = False, match: str | None = None, echo: Callable[[str], None] = print) -> list[Row]:
    """Run the suite under torchrun from one process: one rank per GPU (two gloo ranks through
    the interpreter on a CPU, with ``--tiny`` sizes); the ranks' output is shown as it comes, and
    rank 0's rows are returned. ``quick``: fewer training steps."""
    procs = 2 if INTERPRET else torch.cuda.device_count()
    if procs < 2:
        raise RuntimeError(f"the distributed suite needs two GPUs or more; this machine has {procs}")
    with tempfile.TemporaryDirectory() as folder:
        results = Path(folder) / "distributed.json"
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}",
            "-m", __name__, "--json", str(results),
        ]  # fmt: skip
        command += ["--match", match] if match else []
        command += ["--tiny"] if INTERPRET else []
        command += ["--steps", "6", "--warmup", "2"] if quick or INTERPRET else []
        done = subprocess.run(command)
        if not results.exists():
            raise RuntimeError(
                f"the distributed suite failed (exit {done.returncode}) before writing results"
            )
        if done.returncode:  # a loss check failed: the rows stand, the run says so
            print(f"the distributed suite exited with {done.returncode}: see its loss checks above")
        return [Row(**row) for row in json.loads(results.read_text())["rows"]]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results JSON here (rank 0)")
    parser.add_argument("--losses", help="write each split run's losses and their check here (rank 0)")
    parser.add_argument("--tiny", action="store_true", help="small models and tensors (CPU; quick check)")
    parser.add_argument("--match", help="only the cases whose name contains this text")
    parser.add_argument("--steps", type=int, default=12, help="training steps per run")
    parser.add_argument("--warmup", type=int, default=4, help="steps not timed")
    parser.add_argument("--no-torch", action="store_true", help="skip PyTorch's runs of the models")
    parser.add_argument(
        "--no-graph", action="store_true", help="skip the runs captured in CUDA graphs (GPU only)"
    )
    args = parser.parse_args(argv)

    if INTERPRET:
        dist.init_process_group("gloo")
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world < 2:
        dist.destroy_process_group()
        parser.error("run it under torchrun with two or more processes (--nproc_per_node=2)")
    table = Table(print if rank == 0 else lambda line: None)
    match = (args.match or "").lower()
    try:
        rows: list[Row] = []
        cases = [c for c in sync_batch_norm_cases(args.tiny) if match in c.name.lower()]
        reps = 5 if INTERPRET else 50
        run_cases(SUITE, cases, table, rows, timer=lambda case, fn: lockstep_ms(fn, reps))
        # The captured cases' CUDA graphs hold collectives: gone before the process group is
        # torn down (a run that kept them alive to the end never exited).
        cases.clear()
        gc.collect()
        providers = ("tritondnn",) if args.no_torch else ("tritondnn", "torch")
        chosen = [w for w in workloads(args.tiny) if match in w.name.lower()]
        graphs = not (INTERPRET or args.no_graph)
        model_rows, checks = model_cases(chosen, providers, args.steps, args.warmup, table, graphs)
        rows += model_rows
        for check in checks:
            table.echo(
                f"losses {check.case}: worst relative difference from one GPU {check.error:.2e}"
                f" (bound {check.bound:.2e}; rows reversed {check.noise:.2e},"
                f" unsynchronized {check.unsynced_error:.2e}) {check.verdict}"
            )
        if rank == 0 and args.json:
            write_json(rows, args.json)
        if rank == 0 and args.losses:
            payload = [
                dict(
                    dataclasses.asdict(c),
                    error=c.error,
                    noise=c.noise,
                    bound=c.bound,
                    unsynced_error=c.unsynced_error,
                    verdict=c.verdict,
                    ok=c.ok,
                )
                for c in checks
            ]
            with open(args.losses, "w") as f:
                json.dump(payload, f, indent=1)
        dist.barrier()  # leave together: a rank whose peers still communicate can abort at exit (gloo)
        return 0 if all(c.ok for c in checks) else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(main())
