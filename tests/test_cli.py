"""The command line: info, bench (JSON schema, chart), demo, autotune."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from helpers import ON_GPU


def _cli(*args: str, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(
        [sys.executable, "-m", "tritondnn", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=timeout,
    )


def test_info():
    result = _cli("info")
    assert result.returncode == 0, result.stderr
    for field in ("backend:", "device:", "torch:", "triton:", "config:", "cache:", "family softmax"):
        assert field in result.stdout


def test_bench_writes_the_results_schema(tmp_path):
    out, chart = tmp_path / "r.json", tmp_path / "r.png"
    result = _cli(
        "bench", "softmax", "--quick", "--json", str(out), "--plot", str(chart), TRITONDNN_COMMIT="0cafe42"
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    assert set(data) == {"device", "torch", "triton", "cuda", "date", "commit", "rows"}
    assert data["commit"] == "0cafe42"  # given: the GPU machines' copies of .git lag their files
    assert len(data["date"]) == 10 and data["rows"]
    for row in data["rows"]:
        assert set(row) == {"suite", "case", "provider", "ms", "tflops", "gbps"}
        assert row["suite"] == "softmax" and row["ms"] > 0
    cases = {r["case"] for r in data["rows"]}
    assert any(c.startswith("copy ") for c in cases)
    for case in cases - {c for c in cases if c.startswith("copy ")}:
        providers = {r["provider"] for r in data["rows"] if r["case"] == case}
        assert {"tritondnn", "torch"} <= providers, case
    assert chart.read_bytes()[:4] == b"\x89PNG"
    assert "x torch" in result.stdout  # the ratio column


def test_bench_match_selects_cases(tmp_path):
    out = tmp_path / "r.json"
    result = _cli("bench", "softmax", "--quick", "--match", "COPY", "--json", str(out))
    assert result.returncode == 0, result.stderr
    cases = {r["case"] for r in json.loads(out.read_text())["rows"]}
    assert cases and all(c.startswith("copy ") for c in cases)


def test_bench_kernels_prints_each_providers_kernels():
    """``--kernels N``: after each case, each provider's device time a call and its N longest
    kernels (from the profiler, on a GPU; the interpreter says it has none)."""
    result = _cli("bench", "softmax", "--quick", "--match", "COPY", "--kernels", "2")
    assert result.returncode == 0, result.stderr
    if ON_GPU:
        assert "ms of device work a call in" in result.stdout
    else:
        assert "kernel profiles need a GPU" in result.stdout


def test_kernel_summary_sums_by_name_per_call():
    from tritondnn.bench import summarize_kernels

    events = [("gemm", 30.0), ("add", 2.0), ("gemm", 34.0), ("add", 2.0), ("add", 4.0), ("copy", 1.0)]
    profile = summarize_kernels(events, calls=2)
    assert profile.ms == pytest.approx(73.0 / 2 / 1e3) and profile.count == 3.0
    assert profile.kernels == [("gemm", 32.0, 1.0), ("add", 4.0, 1.5), ("copy", 0.5, 0.5)]


def test_bench_launches_the_distributed_suite(tmp_path):
    if ON_GPU and torch.cuda.device_count() < 2:
        pytest.skip("one process per GPU: needs two GPUs")
    out = tmp_path / "r.json"
    result = _cli(
        "bench", "distributed", "--quick", "--match", "sync_batch", "--json", str(out), OMP_NUM_THREADS="1"
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    shape = "64x256x56x56" if ON_GPU else "4x8x6x6"
    assert {r["case"].split(" per rank")[0] for r in rows} == {f"sync_batch_norm {shape}"}
    assert rows and all(r["suite"] == "distributed" and r["ms"] > 0 for r in rows)
    assert "fwd+bwd" in result.stdout  # the ranks' table reaches the caller's output


def test_bench_unknown_suite():
    result = _cli("bench", "nosuch")
    assert result.returncode == 2 and "unknown suite(s) nosuch" in result.stderr


def test_demo_checks_every_primitive():
    # Every primitive through the interpreter, then three tiny models trained: 10-15 minutes on
    # the slower CPU hosts CI may get (an AMD EPYC one ran out of a 10-minute limit).
    result = _cli("demo", timeout=1800)
    assert result.returncode == 0, result.stdout + result.stderr
    for name in ("relu", "gelu", "silu", "softplus", "softmax", "log_softmax"):
        assert f"\n{name} " in result.stdout
    assert "all checks passed" in result.stdout and "FAIL" not in result.stdout


@pytest.mark.slow
def test_autotune_fills_the_cache(tmp_path):
    result = _cli("autotune", "softmax", "--quick", TRITONDNN_CACHE_DIR=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert list(tmp_path.glob("autotune-*.json"))
