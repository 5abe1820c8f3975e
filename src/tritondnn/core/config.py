"""Global switches, like ``torch.backends.cudnn``: read and set as attributes, or scoped with ``flags``.

>>> import tritondnn as tdnn
>>> tdnn.config.deterministic = True          # from now on
>>> with tdnn.config.flags(benchmark=True):    # only inside the block
...     ...
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

_FLAGS = ("deterministic", "allow_tf32", "benchmark")


class Config:
    """tritondnn's switches. ``version`` is a small integer naming the switches' state, the key
    per-shape caches take to notice a change cheaply; a state seen before gets its number (and its
    cached plans) back, so toggling a flag around every call neither re-plans nor grows caches.

    Attributes:
        deterministic: same bits on every run; reductions are two-stage with no atomics
            (cuDNN's deterministic algorithms, ``torch.use_deterministic_algorithms``).
        allow_tf32: fp32 matrix products may use TF32 tensor cores (about 10 mantissa bits).
            Off by default: fp32 means fp32.
        benchmark: time every candidate engine and config the first time a problem is seen and keep
            the fastest, in memory and on disk (``cudnn.benchmark``). Off: pick by heuristic cost.
    """

    __slots__ = ("_allow_tf32", "_benchmark", "_deterministic", "_generation", "version")

    def __init__(self) -> None:
        self._deterministic = False
        self._allow_tf32 = False
        self._benchmark = False
        self._generation = 0
        self.version = 0

    def _set(self, name: str, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"tdnn.config.{name} must be a bool, got {type(value).__name__}")
        setattr(self, "_" + name, value)
        self._renumber()

    def _renumber(self) -> None:
        state = self._deterministic | self._allow_tf32 << 1 | self._benchmark << 2
        self.version = state + 8 * self._generation

    def invalidate_plans(self) -> None:
        """Make every per-shape plan be built again, its engine chosen again, on its next use
        (e.g. after pointing ``TRITONDNN_CACHE_DIR`` at another autotune cache): the version moves
        to a new range."""
        self._generation += 1
        self._renumber()

    @property
    def deterministic(self) -> bool:
        return self._deterministic

    @deterministic.setter
    def deterministic(self, value: bool) -> None:
        self._set("deterministic", value)

    @property
    def allow_tf32(self) -> bool:
        return self._allow_tf32

    @allow_tf32.setter
    def allow_tf32(self, value: bool) -> None:
        self._set("allow_tf32", value)

    @property
    def benchmark(self) -> bool:
        return self._benchmark

    @benchmark.setter
    def benchmark(self, value: bool) -> None:
        self._set("benchmark", value)

    @contextlib.contextmanager
    def flags(
        self,
        *,
        deterministic: bool | None = None,
        allow_tf32: bool | None = None,
        benchmark: bool | None = None,
    ) -> Iterator[Config]:
        """Set the given flags for the duration of a ``with`` block; the others keep their values."""
        wanted = {"deterministic": deterministic, "allow_tf32": allow_tf32, "benchmark": benchmark}
        saved = self.as_dict()
        try:
            for name, value in wanted.items():
                if value is not None:
                    self._set(name, value)
            yield self
        finally:
            for name in _FLAGS:
                if getattr(self, name) != saved[name]:
                    self._set(name, saved[name])

    def as_dict(self) -> dict[str, bool]:
        return {name: getattr(self, name) for name in _FLAGS}

    def __repr__(self) -> str:
        return "tdnn.config(" + ", ".join(f"{k}={v}" for k, v in self.as_dict().items()) + ")"


config = Config()
