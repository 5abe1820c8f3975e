"""ops.norm.batch_sync, the device side of SyncBatchNorm, without a process group: the "ranks"
are threads of this process taking turns (one runs at a time; a collective hands over to the
next), so the compiled kernels are tested on one GPU, and through the interpreter in CI. The
global batch's float64 batch norm is the reference. tests/nn/test_sync_batchnorm.py runs the
module over gloo processes."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from helpers import DEVICE, ON_GPU, assert_close
from tritondnn.ops.norm.batch_sync import sync_batch_norm_backward, sync_batch_norm_forward


class TakingTurns:
    """Collectives between threads that run one at a time: a thread holds ``lock`` while it
    computes and gives it up only inside a collective, waiting there for the others."""

    def __init__(self, world: int) -> None:
        self.world, self.lock, self.barrier = world, threading.Lock(), threading.Barrier(world)
        self.slots: list[torch.Tensor | None] = [None] * world

    def _exchange(self, rank: int, t: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = t.clone()
        self.lock.release()
        self.barrier.wait()  # every rank has put its tensor
        self.lock.acquire()
        got = list(self.slots)
        self.lock.release()
        self.barrier.wait()  # every rank has read: the slots may be reused
        self.lock.acquire()
        return got

    def all_gather(self, rank: int) -> Callable[[torch.Tensor, torch.Tensor], None]:
        return lambda out, local: out.copy_(torch.cat(self._exchange(rank, local)))

    def all_reduce(self, rank: int) -> Callable[[torch.Tensor], None]:
        return lambda t: t.copy_(sum(self._exchange(rank, t)))

    def run(self, fn: Callable[[int], object]) -> list[object]:
        results: list[object] = [None] * self.world
        errors: list[BaseException] = []

        def body(rank: int) -> None:
            with self.lock:
                try:
                    results[rank] = fn(rank)
                except BaseException as exc:  # re-raised in the test's thread
                    errors.append(exc)
                    self.barrier.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        if errors:
            raise errors[0]
        return results


CASES = [
    ((3, 5), torch.float32, False),
    ((4, 4), torch.float32, True),
    ((0, 6), torch.float32, True),  # a rank with no rows joins both collectives
    ((2, 3, 4), torch.float32, True),
    ((3, 5), torch.float64, False),  # fp64 statistics before and after the fp32 exchange
]
if ON_GPU:  # the interpreter's bf16 is not worth its time here; the kernels are the same
    CASES.append(((5, 3), torch.bfloat16, True))


@pytest.mark.parametrize(("sizes", "dtype", "channels_last"), CASES, ids=str)
def test_ranks_together_match_batch_norm_of_the_whole_batch(sizes, dtype, channels_last):
    gen = torch.Generator().manual_seed(0)
    channels = 6
    x = (torch.randn(sum(sizes), channels, 3, 5, generator=gen) * 3 + 1e3).to(DEVICE)  # a large mean
    dy = torch.randn(x.shape, generator=gen).to(DEVICE)
    weight, bias = torch.rand(channels, generator=gen) + 0.5, torch.randn(channels, generator=gen)
    weight, bias = weight.to(DEVICE), bias.to(DEVICE)
    layout = (lambda t: t.contiguous(memory_format=torch.channels_last)) if channels_last else (lambda t: t)
    x, dy = layout(x.to(dtype)), layout(dy.to(dtype))
    momentum, eps = 0.3, 1e-5
    group = TakingTurns(len(sizes))
    starts = [sum(sizes[:r]) for r in range(len(sizes))]

    def rank_step(rank: int):
        xs, dys = x[starts[rank] : starts[rank] + sizes[rank]], dy[starts[rank] : starts[rank] + sizes[rank]]
        rm, rv = torch.zeros(channels, device=DEVICE), torch.ones(channels, device=DEVICE)
        y, mean, invstd, count = sync_batch_norm_forward(
            xs, weight, bias, rm, rv, momentum, eps, len(sizes), group.all_gather(rank)
        )
        dx, sum_dy, sum_dy_xhat = sync_batch_norm_backward(
            dys, xs, weight, mean, invstd, count, group.all_reduce(rank)
        )
        assert y.stride() == xs.stride() or not xs.numel(), "y in the input's layout"
        return y, dx, sum_dy, sum_dy_xhat, rm, rv, count

    ranks = group.run(rank_step)

    # The reference: float64 batch norm over the whole batch, its gradients by autograd.
    xr = x.double().requires_grad_(True)
    wr, br = weight.double().requires_grad_(True), bias.double().requires_grad_(True)
    rm, rv = torch.zeros(channels, device=DEVICE, dtype=torch.float64), torch.ones_like(wr)
    yr = F.batch_norm(xr, rm, rv, wr, br, training=True, momentum=momentum, eps=eps)
    dxr, dwr, dbr = torch.autograd.grad(yr, (xr, wr, br), dy.double())
    yt = F.batch_norm(x, None, None, weight.to(dtype), bias.to(dtype), training=True, eps=eps)

    y = torch.cat([r[0] for r in ranks])
    dx = torch.cat([r[1] for r in ranks])
    assert y.dtype == dtype and dx.dtype == dtype
    assert_close(y, yr.detach(), yt, "y")
    assert_close(dx, dxr, None if dtype == torch.float32 else dxr.to(dtype), "dx")
    # Each rank's sums are its share of the parameter gradients: their sum is the global one.
    # The reference reads the same (rounded) inputs; the sums are taken in fp32 (fp64 for fp64),
    # where x_hat carries the fp32 mean's rounding at |x| ~ 1e3: 6e-5, 2e-5 of the std of 3.
    tol = 1e-9 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(sum(r[3] for r in ranks).double(), dwr, rtol=tol, atol=tol)
    torch.testing.assert_close(sum(r[2] for r in ranks).double(), dbr, rtol=tol, atol=tol)
    for r in ranks:  # every rank: the global running statistics and count
        torch.testing.assert_close(r[4].double(), rm, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(r[5].double(), rv, rtol=1e-3, atol=1e-3)
        assert torch.all(r[6] == x.numel() // channels)


RELU_CASES = [((3, 5), torch.float32, False), ((0, 6), torch.float32, True)]
if ON_GPU:
    RELU_CASES.append(((5, 3), torch.bfloat16, True))


@pytest.mark.parametrize(("sizes", "dtype", "channels_last"), RELU_CASES, ids=str)
@pytest.mark.parametrize("with_residual", [False, True], ids=["relu", "add+relu"])
def test_fused_relu_and_residual(sizes, dtype, channels_last, with_residual):
    """relu(bn(x) [+ r]) over the ranks' batches: the forward applies both in its finalize pass;
    without a residual the backward takes the ReLU's gradient from the recomputed pre-activation
    values (with one, the module takes it from y first and calls the backward without it)."""
    from tritondnn.ops.norm.common import activation_kind

    relu = activation_kind("relu")
    gen = torch.Generator().manual_seed(1)
    channels = 5
    x = (torch.randn(sum(sizes), channels, 4, 3, generator=gen) * 2 + 30).to(DEVICE)
    dy, r = (torch.randn(x.shape, generator=gen).to(DEVICE) for _ in range(2))
    weight, bias = (
        (torch.rand(channels, generator=gen) + 0.5).to(DEVICE),
        torch.randn(channels, generator=gen).to(DEVICE),
    )
    layout = (lambda t: t.contiguous(memory_format=torch.channels_last)) if channels_last else (lambda t: t)
    x, dy, r = (layout(t.to(dtype)) for t in (x, dy, r))
    group = TakingTurns(len(sizes))
    starts = [sum(sizes[:k]) for k in range(len(sizes) + 1)]

    def rank_step(rank: int):
        rows = slice(starts[rank], starts[rank + 1])
        y, mean, invstd, count = sync_batch_norm_forward(
            x[rows], weight, bias, None, None, 0.1, 1e-5, len(sizes), group.all_gather(rank), *relu,
            r[rows] if with_residual else None,
        )  # fmt: skip
        if with_residual:  # the residual's gradient is ReLU's, taken from y as the module does
            dz = torch.where(y > 0, dy[rows], 0)
            dx = sync_batch_norm_backward(dz, x[rows], weight, mean, invstd, count, group.all_reduce(rank))[0]
        else:
            dx = sync_batch_norm_backward(
                dy[rows], x[rows], weight, mean, invstd, count, group.all_reduce(rank), True, bias, *relu
            )[0]
        return y, dx

    ranks = group.run(rank_step)
    xr = x.double().requires_grad_(True)
    z = F.batch_norm(xr, None, None, weight.double(), bias.double(), training=True, eps=1e-5)
    yr = torch.relu(z + r.double() if with_residual else z)
    assert 0.2 < (yr > 0).double().mean() < 0.8  # both sides of the ReLU
    (dxr,) = torch.autograd.grad(yr, xr, dy.double())
    zt = F.batch_norm(x, None, None, weight.to(dtype), bias.to(dtype), training=True, eps=1e-5)
    yt = torch.relu(zt + r if with_residual else zt)
    y, dx = (torch.cat([k[i] for k in ranks]) for i in (0, 1))
    assert_close(y, yr.detach(), yt, "y")
    assert_close(dx, dxr, None if dtype == torch.float32 else dxr.to(dtype), "dx")
