"""Test configuration: one suite for both backends (interpreter on CPU in CI, compiled on a GPU).

Markers:
    gpu_only(reason): needs compiled kernels on a CUDA GPU; skipped under the interpreter, with
        the reason (e.g. Triton's interpreter computes bf16 ``tl.dot`` wrongly and has no fp8).
    slow: large shapes; skipped unless the ``-m`` expression selects ``slow``.
"""

from __future__ import annotations

import math
import os
import random
import zlib

import pytest
import torch
from hypothesis import HealthCheck, settings

import tritondnn as tdnn

ON_GPU = tdnn.backend() == "gpu"

settings.register_profile(
    "interpret", max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("gpu", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("gpu" if ON_GPU else "interpret")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    run_slow = "slow" in (config.option.markexpr or "")
    for item in items:
        gpu = item.get_closest_marker("gpu_only")
        if gpu is not None and not ON_GPU:
            why = gpu.args[0] if gpu.args else "needs compiled kernels"
            item.add_marker(pytest.mark.skip(reason=f"GPU only: {why}"))
        if item.get_closest_marker("slow") is not None and not run_slow:
            item.add_marker(pytest.mark.skip(reason="slow: select with -m slow"))


# Fresh random data on every run; TRITONDNN_TEST_SEED=<n> replays a run (the header prints n).
SEED = int(os.environ.get("TRITONDNN_TEST_SEED") or random.SystemRandom().randrange(2**31))
os.environ["TRITONDNN_TEST_SEED"] = str(SEED)  # pytest-xdist workers inherit it: one seed per run


def pytest_report_header(config: pytest.Config) -> str:
    return f"tritondnn {tdnn.__version__}, backend {tdnn.backend()}; TRITONDNN_TEST_SEED={SEED}"


@pytest.fixture(autouse=True)
def _seed(request: pytest.FixtureRequest) -> None:
    torch.manual_seed((SEED + zlib.crc32(request.node.nodeid.encode())) % 2**63)


@pytest.fixture
def poison(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every floating tensor ``torch.empty_like``/``torch.empty`` returns starts as NaN, so an
    element a kernel forgets to write shows up in the comparison."""
    empty_like, empty = torch.empty_like, torch.empty

    def fill(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(math.nan) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: fill(empty_like(*a, **k)))
    monkeypatch.setattr(torch, "empty", lambda *a, **k: fill(empty(*a, **k)))


@pytest.fixture
def cache_dir(tmp_path, monkeypatch: pytest.MonkeyPatch):
    """An empty autotune cache directory, and a cache object that will read it afresh."""
    from tritondnn.core import engine

    monkeypatch.setenv("TRITONDNN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(engine, "autotune_cache", engine.AutotuneCache())
    tdnn.config.invalidate_plans()  # plans chosen with another cache are not reused
    return tmp_path
