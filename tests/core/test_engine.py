"""Engine selection: heuristics, reasons, benchmark mode and its on-disk cache."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

import tritondnn as tdnn
from tritondnn.core import engine as E


@dataclasses.dataclass(frozen=True)
class ToyProblem(E.Problem):
    n: int
    flavor: str = "plain"


calls: list[tuple[str, dict]] = []


def _describe(n: int, flavor: str = "plain") -> ToyProblem:
    return ToyProblem(n, flavor)


TOY = E.Family("toy", _describe)


@TOY.register
class Small(E.Engine[ToyProblem]):
    """Cheap, but only for small problems."""

    name = "small"

    def not_supported_reasons(self, problem):
        return [] if problem.n < 10 else [f"n={problem.n} is not below 10"]

    def cost(self, problem):
        return 1.0

    def launch(self, problem, config, *args):
        calls.append((self.name, config))
        time.sleep(0.004)


@TOY.register
class Tuned(E.Engine[ToyProblem]):
    """Any size; config "fast" is truly faster, but the heuristic lists "slow" first."""

    name = "tuned"

    def not_supported_reasons(self, problem):
        return [] if problem.flavor == "plain" else [f"flavor {problem.flavor!r} is not plain"]

    def cost(self, problem):
        return 2.0

    def configs(self, problem):
        return [{"speed": "slow"}, {"speed": "fast"}]

    def launch(self, problem, config, *args):
        calls.append((self.name, config))
        time.sleep(0.003 if config["speed"] == "slow" else 0.0)


@pytest.fixture(autouse=True)
def _fresh():
    calls.clear()
    TOY._chosen.clear()


def test_problem_key_is_stable_and_readable():
    assert ToyProblem(3).key() == "ToyProblem(n=3,flavor='plain')"
    assert ToyProblem(3) == ToyProblem(3) and hash(ToyProblem(3)) == hash(ToyProblem(3))


def test_fast_mode_takes_the_cheapest_supported_engine():
    assert TOY.select(ToyProblem(3)).engine.name == "small"
    choice = TOY.select(ToyProblem(30))
    assert (choice.engine.name, choice.config) == ("tuned", {"speed": "slow"})
    assert TOY.select(ToyProblem(30)) is choice, "the second call is a lookup"


def test_invalidated_plans_are_chosen_again(monkeypatch):
    """``tdnn.config.invalidate_plans()`` (e.g. engines' costs or another autotune cache in
    between) makes a problem seen before be chosen again, not served its old choice."""
    assert TOY.select(ToyProblem(3)).engine.name == "small"
    monkeypatch.setattr(Small, "cost", lambda self, problem: 3.0)
    assert TOY.select(ToyProblem(3)).engine.name == "small", "chosen once per config version"
    tdnn.config.invalidate_plans()
    assert TOY.select(ToyProblem(3)).engine.name == "tuned"


def test_nothing_supports_the_problem():
    with pytest.raises(tdnn.NotSupportedError) as info:
        TOY.select(ToyProblem(30, "odd"))
    err = info.value
    assert err.reasons == {"small": ["n=30 is not below 10"], "tuned": ["flavor 'odd' is not plain"]}
    assert "no toy engine supports ToyProblem(n=30,flavor='odd')" in str(err)
    assert "small: n=30 is not below 10" in str(err)


def test_engines_report():
    reports = tdnn.engines("toy", 30)
    assert [(r.name, r.supported, r.chosen) for r in reports] == [
        ("small", False, False),
        ("tuned", True, True),
    ]
    assert reports[0].reasons == ["n=30 is not below 10"] and reports[0].cost is None
    with pytest.raises(ValueError, match="unknown family 'nope'; known: .*toy"):
        tdnn.engines("nope")


def test_benchmark_mode_times_every_config_and_caches_on_disk(cache_dir):
    with tdnn.config.flags(benchmark=True):
        choice = TOY.select(ToyProblem(30), lambda: ())
    assert (choice.engine.name, choice.config) == ("tuned", {"speed": "fast"})
    assert {c["speed"] for _, c in calls} == {"slow", "fast"}
    (path,) = cache_dir.glob("autotune-*.json")
    entry = json.loads(path.read_text())["entries"]["toy:ToyProblem(n=30,flavor='plain')"]
    assert entry["engine"] == "tuned" and entry["config"] == {"speed": "fast"} and entry["ms"] >= 0
    # A new process (a fresh cache object, an empty selection table) reads the winner without timing.
    calls.clear()
    TOY._chosen.clear()
    E.autotune_cache = E.AutotuneCache()
    with tdnn.config.flags(benchmark=True):
        again = TOY.select(ToyProblem(30), lambda: ())
    assert (again.engine.name, again.config) == ("tuned", {"speed": "fast"}) and not calls


BINDING = E.Family("toy_binding", _describe)


@BINDING.register
class SlowToBind(E.Engine[ToyProblem]):
    """Binding takes 10 ms (a plan does it once), running nothing."""

    name = "slow_to_bind"

    def cost(self, problem):
        return 2.0

    def bind(self, problem, config):
        time.sleep(0.01)
        return lambda *args: None


@BINDING.register
class SlowToRun(E.Engine[ToyProblem]):
    """Binding is free; each run takes 2 ms."""

    name = "slow_to_run"

    def cost(self, problem):
        return 1.0

    def launch(self, problem, config, *args):
        time.sleep(0.002)


def test_benchmark_mode_times_bound_runs(cache_dir):
    """Candidates are timed as plans run them: bound once, then called."""
    with tdnn.config.flags(benchmark=True):
        assert BINDING.select(ToyProblem(5), lambda: ()).engine.name == "slow_to_bind"


def test_benchmark_mode_without_arguments_uses_the_heuristic(cache_dir):
    with tdnn.config.flags(benchmark=True):
        assert TOY.select(ToyProblem(30)).config == {"speed": "slow"}
    assert not list(cache_dir.glob("*.json"))


@pytest.mark.parametrize("content", ["{not json", '{"entries": [1, 2]}', "", '{"device": "x"}'])
def test_corrupt_cache_is_ignored_with_one_warning_and_rewritten(cache_dir, content):
    path = E.autotune_cache.path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content)
    warns = pytest.warns(RuntimeWarning, match="ignoring unreadable autotune cache")
    with warns as record, tdnn.config.flags(benchmark=True):
        TOY.select(ToyProblem(40), lambda: ())
        TOY.select(ToyProblem(50), lambda: ())
    assert len([w for w in record if issubclass(w.category, RuntimeWarning)]) == 1
    entries = json.loads(path.read_text())["entries"]
    assert set(entries) == {"toy:ToyProblem(n=40,flavor='plain')", "toy:ToyProblem(n=50,flavor='plain')"}


def test_stale_cache_entry_is_ignored(cache_dir):
    E.autotune_cache.put("toy:ToyProblem(n=30,flavor='plain')", {"engine": "gone", "config": {}, "ms": 1.0})
    with tdnn.config.flags(benchmark=True):
        choice = TOY.select(ToyProblem(30), lambda: ())
    assert choice.engine.name == "tuned" and calls, "the stale entry was re-timed"


def test_cache_merges_entries_written_by_another_process(cache_dir):
    other = E.AutotuneCache()
    mine = E.autotune_cache
    mine.get("x")  # load (empty) before the other process writes
    other.put("a", {"engine": "small", "config": {}, "ms": 1.0})
    mine.put("b", {"engine": "small", "config": {}, "ms": 2.0})
    assert set(json.loads(mine.path().read_text())["entries"]) == {"a", "b"}
    assert not list(cache_dir.glob("*.tmp")), "no temporary file is left behind"


def test_a_failing_config_is_skipped(cache_dir):
    @dataclasses.dataclass(frozen=True)
    class P(E.Problem):
        n: int

    fam = E.Family("toy-failing", lambda n: P(n))

    @fam.register
    class Flaky(E.Engine[P]):
        name = "flaky"

        def cost(self, problem):
            return 1.0

        def configs(self, problem):
            return [{"ok": False}, {"ok": True}]

        def launch(self, problem, config, *args):
            if not config["ok"]:
                raise RuntimeError("out of shared memory")

    with tdnn.config.flags(benchmark=True):
        assert fam.select(P(1), lambda: ()).config == {"ok": True}
