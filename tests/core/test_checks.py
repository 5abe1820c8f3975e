"""Argument validation messages: the op, the argument, what was given, what is accepted."""

from __future__ import annotations

import pytest
import torch

from helpers import DEVICE
from tritondnn.core import checks


def test_check_tensor():
    x = torch.ones(2, 3, device=DEVICE)
    assert checks.check_tensor("op", "x", x) is x
    with pytest.raises(ValueError, match="op: argument 'x' has 2 dimensions; accepted: 3..4"):
        checks.check_tensor("op", "x", x, min_ndim=3, max_ndim=4)
    with pytest.raises(ValueError, match="accepted: >= 3"):
        checks.check_tensor("op", "x", x, min_ndim=3)
    with pytest.raises(TypeError, match="op: argument 'x' has dtype torch.float32; accepted: float16"):
        checks.check_tensor("op", "x", x, dtypes=(torch.float16,))


def test_check_like():
    x = torch.ones(2, 3, device=DEVICE)
    with pytest.raises(
        ValueError, match=r"argument 'g' has shape \(3, 2\); it must match 'x' of shape \(2, 3\)"
    ):
        checks.check_like("op", "g", torch.ones(3, 2, device=DEVICE), "x", x)


def test_check_dim():
    assert checks.check_dim("op", "dim", -1, 3) == 2
    assert checks.check_dim("op", "dim", 0, 0) == 0
    with pytest.raises(ValueError, match="'dim'=3 is out of range for a tensor of 3 dimensions"):
        checks.check_dim("op", "dim", 3, 3)
    with pytest.raises(TypeError, match="must be an int, got bool"):
        checks.check_dim("op", "dim", True, 3)


def test_check_float_and_choice_and_dtype():
    assert checks.check_float("op", "a", 2) == 2.0
    with pytest.raises(ValueError, match="must be finite"):
        checks.check_float("op", "a", float("inf"))
    assert checks.check_float("op", "a", float("inf"), finite=False) == float("inf")
    with pytest.raises(ValueError, match="must be > 0"):
        checks.check_float("op", "a", -1.0, positive=True)
    with pytest.raises(ValueError, match="'mode'='x'; accepted: 'a', 'b'"):
        checks.check_choice("op", "mode", "x", ("a", "b"))
    with pytest.raises(TypeError, match="'dtype'=torch.int8; accepted"):
        checks.check_dtype("op", "dtype", torch.int8)
