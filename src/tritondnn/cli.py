"""``tritondnn demo | bench | info | autotune`` (also ``python -m tritondnn``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch
import triton

from . import __version__, bench
from .core.backend import backend, device_name
from .core.config import config
from .core.engine import Family, autotune_cache


def _info() -> int:
    print(f"tritondnn {__version__}")
    print(f"backend:   {backend()}")
    print(f"device:    {device_name()}")
    print(f"torch:     {torch.__version__} (cuda {torch.version.cuda or 'none'})")
    print(f"triton:    {triton.__version__}")
    print(f"config:    {config!r}")
    print(f"cache:     {autotune_cache.path()}")
    for name, family in sorted(Family.registry.items()):
        print(f"family {name}: engines {', '.join(e.name for e in family.engines)}")
    return 0


def _autotune(suites: Sequence[str], quick: bool) -> int:
    """Run each benchmark case's tritondnn call once in benchmark mode: the winners land in the cache."""
    import importlib

    unknown = [s for s in suites if s not in bench.SUITES]
    if unknown:  # the launched suites time whole training runs: nothing there to tune
        print(
            f"tritondnn autotune: unknown suite(s) {', '.join(unknown)}; available: {', '.join(bench.SUITES)}"
        )
        return 2
    with config.flags(benchmark=True):
        for suite in suites or bench.SUITES:
            module = importlib.import_module(f"{bench.__name__}.{suite}")
            for case in module.cases(quick):
                if "tritondnn" in case.providers:
                    case.providers["tritondnn"]()
                    print(f"tuned {suite}: {case.name}")
    print(f"cache: {autotune_cache.path()}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tritondnn", description="cuDNN-class primitives in Triton")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="run every primitive, check it against PyTorch and time both")
    b = sub.add_parser("bench", help="benchmark tritondnn against its anchors")
    b.add_argument(
        "suites",
        nargs="*",
        metavar="SUITE",
        help=f"any of {', '.join(bench.SUITES + bench.LAUNCHED)} (default: all but "
        f"{', '.join(bench.LAUNCHED)}, which runs one process per GPU under torchrun)",
    )
    b.add_argument("--json", metavar="FILE", help="write the results JSON here")
    b.add_argument("--plot", metavar="FILE", help="write a chart (PNG) here")
    b.add_argument("--quick", action="store_true", help="a few representative cases")
    b.add_argument("--match", metavar="TEXT", help="only the cases whose name contains TEXT")
    b.add_argument(
        "--kernels",
        metavar="N",
        type=int,
        default=0,
        help="after each case, each provider's device time a call and its N longest kernels (GPU)",
    )
    sub.add_parser("info", help="backend, device, versions, config, cache location, engines")
    a = sub.add_parser("autotune", help="fill the autotune cache for the benchmark cases")
    a.add_argument("suites", nargs="*", metavar="SUITE")
    a.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from . import demo

        return demo.main()
    if args.command == "bench":
        try:
            bench.run(
                args.suites,
                quick=args.quick,
                json_path=args.json,
                plot_path=args.plot,
                match=args.match,
                kernels=args.kernels,
            )
        except ValueError as exc:
            parser.error(str(exc))
        return 0
    if args.command == "autotune":
        return _autotune(args.suites, args.quick)
    return _info()


if __name__ == "__main__":
    sys.exit(main())
