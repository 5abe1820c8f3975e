"""tdnn.config: attributes, validation, the flags context manager, the state's version."""

from __future__ import annotations

import pytest

import tritondnn as tdnn


def test_defaults_and_attributes():
    cfg = tdnn.config
    assert cfg.as_dict() == {"deterministic": False, "allow_tf32": False, "benchmark": False}
    version = cfg.version
    cfg.deterministic = True
    try:
        assert cfg.deterministic is True and cfg.version != version
    finally:
        cfg.deterministic = False
    assert cfg.version == version  # the same state, the same key: cached plans come back
    cfg.invalidate_plans()
    assert cfg.version != version and cfg.as_dict()["deterministic"] is False
    assert "deterministic=False" in repr(cfg)


@pytest.mark.parametrize("name", ["deterministic", "allow_tf32", "benchmark"])
def test_flags_context_restores_even_on_error(name):
    before = tdnn.config.as_dict()
    with pytest.raises(KeyError), tdnn.config.flags(**{name: True}) as cfg:
        assert getattr(cfg, name) is True
        assert all(getattr(cfg, other) == before[other] for other in before if other != name)
        raise KeyError("boom")
    assert tdnn.config.as_dict() == before


def test_nested_flags():
    with tdnn.config.flags(benchmark=True):
        with tdnn.config.flags(benchmark=False, allow_tf32=True):
            assert not tdnn.config.benchmark and tdnn.config.allow_tf32
        assert tdnn.config.benchmark and not tdnn.config.allow_tf32
    assert not tdnn.config.benchmark


@pytest.mark.parametrize("value", [1, "yes", None])
def test_non_bool_is_refused(value):
    with pytest.raises(TypeError, match="must be a bool"):
        tdnn.config.deterministic = value
    with pytest.raises(TypeError, match="must be a bool"), tdnn.config.flags(benchmark=value or 0):
        pass


def test_unknown_attribute_is_refused():
    with pytest.raises(AttributeError):
        tdnn.config.determinstic = True  # a typo must not pass silently
