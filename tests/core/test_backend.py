"""Backend selection: automatic, overridden by TRITONDNN_BACKEND, reported by tdnn.backend()."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import tritondnn as tdnn


def _import(env: dict[str, str]) -> subprocess.CompletedProcess:
    code = "import os, tritondnn; print(tritondnn.backend(), os.environ.get('TRITON_INTERPRET'))"
    full = {k: v for k, v in os.environ.items() if k not in ("TRITONDNN_BACKEND", "TRITON_INTERPRET")}
    return subprocess.run([sys.executable, "-c", code], env={**full, **env}, capture_output=True, text=True)


def test_backend_matches_the_machine():
    expected = "gpu" if torch.cuda.is_available() and not os.environ.get("TRITONDNN_BACKEND") else None
    assert tdnn.backend() in ("gpu", "interpret")
    if expected:
        assert tdnn.backend() == expected
    if tdnn.backend() == "interpret":
        assert os.environ["TRITON_INTERPRET"] == "1"


def test_auto_and_interpret_override():
    auto = _import({})
    assert auto.returncode == 0, auto.stderr
    assert auto.stdout.split()[0] == ("gpu" if torch.cuda.is_available() else "interpret")
    forced = _import({"TRITONDNN_BACKEND": "interpret"})
    assert forced.stdout.split() == ["interpret", "1"]


def test_unknown_backend_is_an_error():
    result = _import({"TRITONDNN_BACKEND": "tpu"})
    assert result.returncode != 0
    assert "TRITONDNN_BACKEND='tpu' is not one of auto, gpu, interpret" in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_gpu_without_gpu_is_an_error():
    result = _import({"TRITONDNN_BACKEND": "gpu"})
    assert result.returncode != 0 and "sees no CUDA device" in result.stderr


def test_gpu_conflicts_with_triton_interpret():
    result = _import({"TRITONDNN_BACKEND": "gpu", "TRITON_INTERPRET": "1"})
    assert result.returncode != 0 and "conflicts with TRITON_INTERPRET=1" in result.stderr
