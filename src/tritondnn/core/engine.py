"""Engines and how one is chosen for a problem: cuDNN's heuristics and autotuning, for every family.

A family (softmax, conv, ...) describes each call as a ``Problem``: a frozen dataclass of everything
that decides which kernel runs. Its ``Engine`` subclasses each implement one algorithm and answer
four questions: why they cannot run a problem (``not_supported_reasons``, empty when they can), what
it would cost (``cost``, for the heuristic), which launch configurations are worth trying
(``configs``, the heuristic's pick first) and how to run it (``launch``, or ``bind`` to prepare a
launch once and call it per call).

``Family.select`` drops engines with reasons, then:

* fast mode (default): the lowest ``cost`` with its first config;
* benchmark mode (``tdnn.config.benchmark = True``): every config of every candidate is timed once
  on the call's own tensors; the fastest is kept in memory and in the on-disk cache
  (``$TRITONDNN_CACHE_DIR`` or ``~/.cache/tritondnn/``), one JSON file per device name and Triton
  version, keyed by problem key, written atomically.

The choice is remembered per problem, so a repeat call costs a dictionary lookup.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import tempfile
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

import triton

from .backend import device_name
from .config import config
from .errors import NotSupportedError
from .timing import median_ms


@dataclasses.dataclass(frozen=True)
class Problem:
    """Everything that decides which kernel runs. Subclasses add hashable fields."""

    def key(self) -> str:
        """A stable, readable string naming the problem (the autotune cache key)."""
        fields = ",".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))
        return f"{type(self).__name__}({fields})"


P = TypeVar("P", bound=Problem)
LaunchConfig = dict[str, Any]


class Engine(Generic[P]):
    """One algorithm of a family. Subclasses set ``name`` and override the four methods."""

    name: ClassVar[str] = ""

    def not_supported_reasons(self, problem: P) -> list[str]:
        """Why this engine cannot run ``problem``; an empty list means it can."""
        return []

    def cost(self, problem: P) -> float:
        """Heuristic estimate of the run time (any unit shared by the family's engines)."""
        raise NotImplementedError

    def configs(self, problem: P) -> list[LaunchConfig]:
        """Launch configurations worth timing; the first is the heuristic's choice."""
        return [{}]

    def launch(self, problem: P, config: LaunchConfig, *args: Any) -> None:
        """Run the problem on ``args`` (tensors and scalars, in the family's order)."""
        self.bind(problem, config)(*args)

    def bind(self, problem: P, config: LaunchConfig) -> Callable[..., None]:
        """A callable that runs the problem on ``args``, with all that the problem fixes worked out
        once: the per-call fast path that families cache per shape. Override this or ``launch``."""
        return functools.partial(self.launch, problem, config)


@dataclasses.dataclass(frozen=True, eq=False)
class Choice:
    """An engine and the launch configuration it will use."""

    engine: Engine
    config: LaunchConfig


@dataclasses.dataclass(frozen=True)
class EngineReport:
    """What ``tdnn.engines`` says of one engine for one problem: whether it can run it (and why
    not), its heuristic cost, whether fast mode chooses it (``chosen``), and whether benchmark
    mode's stored winner for this problem on this device is this engine (``tuned``: False for
    every engine until the problem was timed in benchmark mode, ``tdnn.config.benchmark``)."""

    name: str
    supported: bool
    reasons: list[str]
    cost: float | None
    chosen: bool
    tuned: bool = False


class AutotuneCache:
    """The on-disk store of benchmark-mode winners for this device and Triton version."""

    def __init__(self) -> None:
        self._path: Path | None = None
        self._entries: dict[str, dict[str, Any]] = {}

    def path(self) -> Path:
        root = os.environ.get("TRITONDNN_CACHE_DIR") or os.path.join(Path.home(), ".cache", "tritondnn")
        device = re.sub(r"[^A-Za-z0-9_.-]+", "_", device_name())
        return Path(root) / f"autotune-{device}-triton-{triton.__version__}.json"

    def _read(self, path: Path, *, warn: bool) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads(path.read_text())
            entries = data["entries"]
            if not isinstance(entries, dict) or not all(isinstance(v, dict) for v in entries.values()):
                raise ValueError("'entries' is not a mapping of problem keys to choices")
            return entries
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            if warn:
                warnings.warn(
                    f"tritondnn: ignoring unreadable autotune cache {path} ({exc}); it will be rewritten",
                    RuntimeWarning,
                    stacklevel=4,
                )
            return {}

    def _current(self) -> dict[str, dict[str, Any]]:
        path = self.path()
        if path != self._path:
            self._path, self._entries = path, self._read(path, warn=True)
        return self._entries

    def get(self, key: str) -> dict[str, Any] | None:
        return self._current().get(key)

    def put(self, key: str, value: dict[str, Any]) -> None:
        """Store one entry, merged with what other processes wrote, replacing the file atomically."""
        entries = self._current()
        path = self._path
        assert path is not None
        entries.update({k: v for k, v in self._read(path, warn=False).items() if k not in entries})
        entries[key] = value
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {"device": device_name(), "triton": triton.__version__, "entries": entries}
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(payload, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise


autotune_cache = AutotuneCache()


class Family(Generic[P]):
    """A primitive family: its engines, how a call becomes a problem, and the selection cache.

    Args:
        name: the family's name (``tdnn.engines(name, ...)``).
        describe: builds the ``Problem`` from the public function's arguments.
    """

    registry: ClassVar[dict[str, Family]] = {}

    def __init__(self, name: str, describe: Callable[..., P]) -> None:
        self.name = name
        self.describe = describe
        self.engines: list[Engine[P]] = []
        self._chosen: dict[tuple[P, int], Choice] = {}
        self._plans: dict[tuple, Callable[..., Any]] = {}
        Family.registry[name] = self

    def register(self, engine_cls: type[Engine[P]]) -> type[Engine[P]]:
        """Class decorator: add an engine (instantiated once) to the family."""
        self.engines.append(engine_cls())
        return engine_cls

    def _candidates(self, problem: P) -> list[Engine[P]]:
        reasons = {e.name: e.not_supported_reasons(problem) for e in self.engines}
        candidates = [e for e in self.engines if not reasons[e.name]]
        if not candidates:
            raise NotSupportedError(self.name, problem.key(), reasons)
        return candidates

    def _heuristic(self, problem: P, candidates: Sequence[Engine[P]]) -> Choice:
        engine = min(candidates, key=lambda e: e.cost(problem))
        return Choice(engine, engine.configs(problem)[0])

    def select(self, problem: P, make_args: Callable[[], Sequence[Any]] | None = None) -> Choice:
        """The engine and config for ``problem``.

        ``make_args`` gives arguments for timing candidates in benchmark mode (the call's own tensors,
        or copies where the call writes in place); without it benchmark mode uses the heuristic.
        Raises ``NotSupportedError`` listing every engine's reasons when none can run the problem.
        """
        # Under the config's version (its flags and generation): after ``invalidate_plans`` a
        # problem is chosen again, as its plans are built again.
        key = (problem, config.version)
        choice = self._chosen.get(key)
        if choice is None:
            candidates = self._candidates(problem)
            if config.benchmark and make_args is not None:
                choice = self._autotune(problem, candidates, make_args)
            else:
                choice = self._heuristic(problem, candidates)
            self._chosen[key] = choice
        return choice

    def choose(
        self, problem: P, algo: str | None, make_args: Callable[[], Sequence[Any]] | None, op: str
    ) -> Choice:
        """The engine named ``algo`` with its first config (``NotSupportedError`` with its reasons
        where it cannot run ``problem``; ``ValueError`` naming ``op`` for an unknown name), or
        ``select``'s choice when ``algo`` is None."""
        if algo is None:
            return self.select(problem, make_args)
        for engine in self.engines:
            if engine.name == algo:
                reasons = engine.not_supported_reasons(problem)
                if reasons:
                    raise NotSupportedError(self.name, problem.key(), {engine.name: reasons})
                return Choice(engine, engine.configs(problem)[0])
        names = ", ".join(repr(e.name) for e in self.engines)
        raise ValueError(f"{op}: argument 'algo'={algo!r}; accepted: None, {names}")

    def plan(
        self, key: tuple, problem: Callable[[], P], timing_args: Callable[[], Sequence[Any]]
    ) -> Callable[..., Any]:
        """The bound launch for a call, cached under ``key``: a tuple the caller builds cheaply
        from its arguments (shapes, strides, dtypes, flags) that determines the problem. Only the
        first call with a key builds the problem, selects an engine and binds it."""
        key = (config.version, *key)
        bound = self._plans.get(key)
        if bound is None:
            p = problem()
            choice = self.select(p, timing_args)
            bound = self._plans[key] = choice.engine.bind(p, choice.config)
        return bound

    def _autotune(
        self, problem: P, candidates: Sequence[Engine[P]], make_args: Callable[[], Sequence[Any]]
    ) -> Choice:
        cache_key = f"{self.name}:{problem.key()}"
        stored = autotune_cache.get(cache_key)
        if stored is not None:
            for engine in candidates:
                if engine.name == stored.get("engine") and stored.get("config") in engine.configs(problem):
                    return Choice(engine, stored["config"])
        args = make_args()
        best: tuple[float, Choice] | None = None
        failures = []
        for engine in candidates:
            for cfg in engine.configs(problem):
                try:
                    # Bound once, as a plan runs it: binding builds launchers and buffers on the
                    # host, which timed per call made host-heavy engines look slow.
                    bound = engine.bind(problem, cfg)
                    ms = median_ms(lambda run=bound: run(*args), warmup_ms=5, rep_ms=20)
                except Exception as exc:  # a config that cannot compile or launch is skipped
                    failures.append(f"{engine.name} {cfg}: {type(exc).__name__}: {exc}")
                    continue
                if best is None or ms < best[0]:
                    best = (ms, Choice(engine, cfg))
        if best is None:
            raise RuntimeError(
                f"every {self.name} candidate failed for {problem.key()}:\n" + "\n".join(failures)
            )
        ms, choice = best
        autotune_cache.put(cache_key, {"engine": choice.engine.name, "config": choice.config, "ms": ms})
        return choice

    def report(self, problem: P) -> list[EngineReport]:
        """Every engine's verdict on ``problem``, which one fast mode would choose, and which one
        benchmark mode chose (its autotune cache entry), if any."""
        reasons = {e.name: e.not_supported_reasons(problem) for e in self.engines}
        supported = [e for e in self.engines if not reasons[e.name]]
        chosen = self._heuristic(problem, supported).engine if supported else None
        stored = autotune_cache.get(f"{self.name}:{problem.key()}")
        tuned = stored.get("engine") if stored else None
        return [
            EngineReport(
                name=e.name,
                supported=not reasons[e.name],
                reasons=reasons[e.name],
                cost=None if reasons[e.name] else e.cost(problem),
                chosen=e is chosen,
                tuned=e.name == tuned,
            )
            for e in self.engines
        ]


def engines(family: str, *args: Any, **kwargs: Any) -> list[EngineReport]:
    """Which engines of ``family`` can run the call ``family(*args, **kwargs)`` would make, and why not.

    >>> for r in tdnn.engines("softmax", x, dim=-1):
    ...     print(r.name, r.supported, r.reasons, r.chosen, r.tuned)
    """
    if family not in Family.registry:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(sorted(Family.registry))}")
    fam = Family.registry[family]
    return fam.report(fam.describe(*args, **kwargs))
