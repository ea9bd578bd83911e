"""``python -m bench SUBCOMMAND``: dispatch to the benchmark modules.

A subcommand is a module with ``HELP`` (one line), ``add_arguments(parser)``
and ``run(args) -> exit code``; adding one is one line in ``SUBCOMMANDS``.
Modules keep heavy imports (torch, transformers) inside functions, so
building the parser stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "serve": "bench.serve",
    "sweep": "bench.sweep",
    "throughput": "bench.throughput",
    "ipc": "bench.ipc",
    "sched": "bench.sched",
    "sampling": "bench.sampling",
    "structured": "bench.structured",
    "gpu": "bench.gpu",
    "startup": "bench.startup",
    "compare": "bench.compare",
    "soak": "bench.soak",
    "embed": "bench.embed",
    "lora": "bench.lora",
    "membw": "bench.membw",
    "int8peak": "bench.int8peak",
    "kv-quality": "bench.kv_quality",
}


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description="ringllm benchmarks (see bench/README.md).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND")
    for name, module_name in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(
            name, help=module.HELP, description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(p)
        p.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
