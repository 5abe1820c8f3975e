"""Timing a callable the way every benchmark and the autotuner here do: medians, after a warm-up."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from .backend import INTERPRET


def median_ms(fn: Callable[[], object], *, warmup_ms: float = 25.0, rep_ms: float = 100.0) -> float:
    """Median time of one call of ``fn`` in milliseconds.

    On a GPU this is ``triton.testing.do_bench`` (CUDA events around each call, the L2 cache flushed
    between calls). Under the interpreter there is no device to time: ``fn`` runs once to warm up and
    three more times on the host clock, which is only good for exercising the machinery.
    """
    if not INTERPRET:
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    fn()
    samples = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def host_us_per_call(fn: Callable[[], object], calls: int = 2000, rounds: int = 7) -> float:
    """Host time of one call in microseconds: the median over ``rounds`` of ``calls`` back-to-back
    calls, each round closed by one synchronization.

    This is the launch overhead a small tensor sees, when the GPU finishes each kernel faster than
    the host can issue the next one. The median of rounds resists the host's own noise.
    """
    import torch

    sync = (lambda: None) if INTERPRET else torch.cuda.synchronize
    for _ in range(max(calls // 10, 1)):
        fn()
    per_call = []
    for _ in range(rounds):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        per_call.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(per_call)
