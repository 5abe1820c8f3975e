"""Benchmark harness: every case times tritondnn and its anchors in the same run.

A suite module (``activation``, ``softmax``, ...) yields ``Case`` objects; ``run`` times each
provider of each case with medians (``core.timing``) and prints a table with GB/s or TFLOP/s and
the ratio of tritondnn to each anchor. Memory-bound suites measure a device-to-device copy of the
same tensors (a case named ``copy ...``) before each dtype's cases: that rate, measured in the
same run, is the physical limit the following tritondnn rows are compared with. Results are
written as the JSON described in ARCHITECTURE.md and, on request, drawn as a chart.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import importlib
import json
import os
import subprocess
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch
import triton

from ..core.backend import INTERPRET, device_name
from ..core.timing import host_us_per_call, median_ms

SUITES = (
    "activation",
    "softmax",
    "norm",
    "pool",
    "matmul",
    "attention",
    "conv",
    "rnn",
    "graph",
    "misc",
    "models",
)
# Suites that run in several processes (torchrun), launched from here: named explicitly, never
# part of "all suites" (a machine with one GPU cannot run them).
LAUNCHED = ("distributed",)


@dataclasses.dataclass
class Case:
    """One benchmark case: the same work done by each provider.

    Attributes:
        name: shape, dtype, layout and direction, e.g. ``"gelu 16384x4096 bf16 fwd"``; cases
            named ``"copy ..."`` measure the memory-bound limit.
        providers: provider name (``"tritondnn"``, ``"torch"``, ``"torch.compile"``) to a callable
            doing the work once.
        bytes: bytes read plus bytes written once (memory-bound cases), or None.
        flops: floating-point operations (compute-bound cases), or None.
        host: time the host per call (launch overhead on a small tensor) instead of the device.
        warmup_calls: calls of each provider before it is timed, for work whose first calls
            compile and tune (a model's training step): the timer's own warmup sizes itself from
            its first calls, which would then include the compilation.
        rep_ms: how long the timer repeats the calls; the median is over that many milliseconds.
        prepare: run once when the case is selected, before it is timed; returns text appended
            to its name (what the run found out, such as the engine autotuning chose), so that
            work a case name depends on is not done for cases ``--match`` leaves out.
    """

    name: str
    providers: dict[str, Callable[[], object]]
    bytes: int | None = None
    flops: int | None = None
    host: bool = False
    warmup_calls: int = 0
    rep_ms: float = 100.0
    prepare: Callable[[], str] | None = None

    @property
    def is_limit(self) -> bool:
        return self.name.startswith("copy ")


@dataclasses.dataclass
class Row:
    suite: str
    case: str
    provider: str
    ms: float
    tflops: float | None
    gbps: float | None


def providers(**fns: Callable[[], object] | None) -> dict[str, Callable[[], object]]:
    """Provider names to callables, dropping anchors that do not apply (None); ``torch_compile``
    is spelled ``torch.compile``."""
    return {name.replace("_", "."): fn for name, fn in fns.items() if fn is not None}


def compiled(fn: Callable, *args: object) -> Callable[[], object] | None:
    """``torch.compile(fn)`` applied to ``args``, as an anchor where it applies (not under the
    interpreter, where inductor would compile C++ for the CPU instead)."""
    if INTERPRET:
        return None
    # Each case compiles afresh: dynamo's per-code-object recompile limit would otherwise send
    # later cases compiling the same wrapper back to eager.
    torch._dynamo.reset()
    return functools.partial(torch.compile(fn), *args)


class CapturedCall:
    """A call captured in a CUDA graph (``capture``); calling it replays the graph and returns
    what the captured call returned, which each replay rewrites in place.

    It holds the captured function, and so everything that function holds: a graph reads and
    writes memory by address, and a model's parameters, an optimizer's state or an input that only
    the function referenced would otherwise be freed under it (after PyTorch's ``empty_cache``,
    a replay then faults with an illegal memory access)."""

    def __init__(self, fn: Callable[[], object], graph: torch.cuda.CUDAGraph, out: object) -> None:
        self.fn, self.graph, self.out = fn, graph, out

    def __call__(self) -> object:
        self.graph.replay()
        return self.out


def capture(fn: Callable[[], object], warmup: int = 3) -> CapturedCall:
    """``fn`` called ``warmup`` times on a side stream (compiles, plans and allocator pools made
    off the capture), then captured in a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return CapturedCall(fn, graph, out)


def graphed(fn: Callable[[], object]) -> CapturedCall | None:
    """``fn`` captured in a CUDA graph, as its replay: the device work of a call with no host work
    per call (what a training step captured in a graph runs). None under the interpreter, or
    where ``fn`` cannot be captured (the failure is printed)."""
    if INTERPRET:
        return None
    try:
        return capture(fn)
    except RuntimeError as exc:
        print(f"  (not captured in a CUDA graph: {type(exc).__name__}: {str(exc)[:200]})")
        return None


def _time(case: Case, fn: Callable[[], object]) -> float:
    if case.host:
        return host_us_per_call(fn, calls=20 if INTERPRET else 2000, rounds=3 if INTERPRET else 7) / 1e3
    for _ in range(case.warmup_calls):
        fn()
    return median_ms(fn, rep_ms=case.rep_ms)


class Table:
    """Prints rows as they are measured, with ratios to the anchors and to the copy limit."""

    def __init__(self, echo: Callable[[str], None] = print) -> None:
        self.echo = echo
        self.limit_gbps: float | None = None
        echo(f"{'case':<46} {'provider':<14} {'time':>11} {'GB/s':>7} {'TFLOP/s':>8}  notes")

    def add(self, case: Case, rows: Sequence[Row]) -> None:
        if case.is_limit:  # suites measure a copy before each dtype's cases: the latest applies
            self.limit_gbps = max(r.gbps or 0.0 for r in rows)
        ours = next((r for r in rows if r.provider == "tritondnn"), None)
        for row in rows:
            notes = []
            if row is ours:
                notes += [f"{a.ms / row.ms:.2f}x {a.provider}" for a in rows if a is not ours]
                if row.gbps and self.limit_gbps:
                    notes.append(f"{row.gbps / self.limit_gbps:.0%} of copy")
            time = f"{row.ms * 1e3:.2f} us" if row.ms < 0.1 else f"{row.ms:.4f} ms"
            gbps = f"{row.gbps:.0f}" if row.gbps else "-"
            tflops = f"{row.tflops:.1f}" if row.tflops else "-"
            self.echo(
                f"{row.case:<46} {row.provider:<14} {time:>11} {gbps:>7} {tflops:>8}  {', '.join(notes)}"
            )


@dataclasses.dataclass
class KernelProfile:
    """The device work of one call, from the profiler: kernel (and memcpy/memset) time and count
    a call, and each kernel name's share, longest first."""

    ms: float
    count: float
    kernels: list[tuple[str, float, float]]  # (name, microseconds a call, launches a call)


def summarize_kernels(events: Iterable[tuple[str, float]], calls: int) -> KernelProfile:
    """``KernelProfile`` of ``calls`` calls' device events, given as (name, microseconds)."""
    time: dict[str, float] = {}
    count: dict[str, int] = {}
    for name, us in events:
        time[name] = time.get(name, 0.0) + us
        count[name] = count.get(name, 0) + 1
    kernels = sorted(((n, t / calls, count[n] / calls) for n, t in time.items()), key=lambda k: -k[1])
    return KernelProfile(sum(time.values()) / calls / 1e3, sum(count.values()) / calls, kernels)


def kernel_profile(fn: Callable[[], object], calls: int = 3) -> KernelProfile:
    """``fn``'s device work a call: torch.profiler over ``calls`` calls (after one unprofiled call),
    the device's activity only (kernels of CUDA graph replays included)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    device = torch.autograd.DeviceType.CUDA
    events = ((e.name, e.device_time) for e in prof.events() if e.device_type == device)
    return summarize_kernels(events, calls)


def print_kernels(provider: str, profile: KernelProfile, top: int, echo: Callable[[str], None]) -> None:
    echo(f"  {provider}: {profile.ms:.3f} ms of device work a call in {profile.count:.0f} kernels")
    for name, us, launches in profile.kernels[:top]:
        echo(f"    {us:10.1f} us {launches:6.0f}x  {name[:110]}")


def run_cases(
    suite: str,
    cases: Iterable[Case],
    table: Table,
    rows: list[Row] | None = None,
    timer: Callable[[Case, Callable[[], object]], float] = _time,
    kernels: int = 0,
) -> list[Row]:
    """Time every provider of every case with ``timer(case, fn)`` (milliseconds), appending to
    ``rows`` (returned) case by case; each case's tensors are freed before the next is made.
    ``kernels``: after each case, print that many of each provider's longest kernels (a GPU's
    profiler; host-timed cases have none)."""
    rows = [] if rows is None else rows
    for case in cases:
        if case.prepare is not None:
            case.name += case.prepare()
        measured = []
        for provider, fn in case.providers.items():
            ms = timer(case, fn)
            gbps = case.bytes / ms / 1e6 if case.bytes and not case.host else None
            tflops = case.flops / ms / 1e9 if case.flops and not case.host else None
            measured.append(Row(suite, case.name, provider, ms, tflops, gbps))
        table.add(case, measured)
        rows += measured
        if kernels and not case.host and not INTERPRET:
            for provider, fn in case.providers.items():
                print_kernels(provider, kernel_profile(fn), kernels, table.echo)
    return rows


def run(
    suites: Sequence[str],
    *,
    quick: bool = False,
    json_path: str | None = None,
    plot_path: str | None = None,
    match: str | None = None,
    echo: Callable[[str], None] = print,
    kernels: int = 0,
) -> list[Row]:
    """Run the named suites (all when empty), only their cases whose name contains ``match``
    (case-insensitive) if given, and write the results JSON and chart if asked. ``kernels``: print
    each provider's longest kernels after each case (``run_cases``); GPUs only."""
    unknown = [s for s in suites if s not in SUITES + LAUNCHED]
    if unknown:
        raise ValueError(f"unknown suite(s) {', '.join(unknown)}; available: {', '.join(SUITES + LAUNCHED)}")
    rows: list[Row] = []
    echo(f"device: {device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    if kernels and INTERPRET:
        echo("(--kernels: kernel profiles need a GPU; the interpreter has none)")
    try:
        for suite in suites or SUITES:
            module = importlib.import_module(f"{__name__}.{suite}")
            echo(f"\n[{suite}]")
            if suite in LAUNCHED:
                rows += module.launch(quick=quick, match=match, echo=echo)
                continue
            cases = module.cases(quick)
            if match:
                cases = (c for c in cases if match.lower() in c.name.lower())
            run_cases(suite, cases, Table(echo), rows, kernels=kernels)
    except KeyboardInterrupt:  # a time limit's SIGINT: keep what was measured
        echo(f"\ninterrupted: writing the {len(rows)} rows measured so far")
    if json_path:
        write_json(rows, json_path)
        echo(f"\nwrote {json_path}")
    if plot_path:
        plot(rows, plot_path)
        echo(f"wrote {plot_path}")
    return rows


def _commit() -> str:
    """The checkout's commit: ``$TRITONDNN_COMMIT`` if set (a copy of a working tree whose .git
    is older than its files, as on the lent GPU machines, cannot tell), else from git, else read
    from .git itself where git is missing or refuses (a copy owned by another user)."""
    given = os.environ.get("TRITONDNN_COMMIT")
    if given:
        return given
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    git = Path.cwd() / ".git"
    try:
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head[:7]
        ref = head.removeprefix("ref: ")
        if (git / ref).exists():
            return (git / ref).read_text().strip()[:7]
        for line in (git / "packed-refs").read_text().splitlines():
            if line.endswith(" " + ref):
                return line.split()[0][:7]
    except OSError:
        pass
    return "unknown"


def write_json(rows: Sequence[Row], path: str) -> None:
    """The results file of ARCHITECTURE.md: environment, then one row per case and provider."""
    payload = {
        "device": device_name() if not INTERPRET else "cpu (Triton interpreter)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda or "none",
        "date": datetime.date.today().isoformat(),
        "commit": _commit(),
        "rows": [dataclasses.asdict(r) for r in rows],
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=1) + "\n")


def plot(rows: Sequence[Row], path: str) -> None:
    """A bar chart per suite: each case's GB/s (or TFLOP/s) by provider."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    suites = list(dict.fromkeys(r.suite for r in rows))
    fig, axes = plt.subplots(len(suites), 1, figsize=(12, 0.3 * len(rows) + 2 * len(suites)), squeeze=False)
    for ax, suite in zip(axes[:, 0], suites):
        timed = [r for r in rows if r.suite == suite and (r.gbps or r.tflops)]
        cases = list(dict.fromkeys(r.case for r in timed))
        names = list(dict.fromkeys(r.provider for r in timed))
        height = 0.8 / max(len(names), 1)
        for i, provider in enumerate(names):
            values = {r.case: r.gbps or r.tflops for r in timed if r.provider == provider}
            ys = [c + i * height for c in range(len(cases)) if cases[c] in values]
            ax.barh(ys, [values[c] for c in cases if c in values], height=height, label=provider)
        ax.set_yticks([c + 0.4 - height / 2 for c in range(len(cases))], cases, fontsize=7)
        ax.invert_yaxis()
        ax.set_title(f"{suite} ({device_name()})")
        ax.set_xlabel("GB/s (memory-bound) or TFLOP/s (compute-bound)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
