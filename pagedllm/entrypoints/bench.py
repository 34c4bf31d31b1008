"""`pagedllm bench <kind>`: benchmarks are entrypoints too, so nothing below imports them.

The CLI owner wires `add_bench_parser` into `pagedllm`'s subparsers and calls `main(args)`;
`python -m pagedllm.entrypoints.bench throughput ...` runs the same parser standalone.
A new kind (e.g. `serve`, against a running HTTP server) is one entry in `SUBCOMMANDS`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from pagedllm.entrypoints.bench_serve import add_serve_args, run_serve
from pagedllm.entrypoints.bench_throughput import add_throughput_args, run_throughput

# name -> (help, adds the flags, runs with the parsed args and returns the result dict)
SUBCOMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None],
                             Callable[[argparse.Namespace], dict]]] = {
    "throughput": ("offline throughput of the engine (and the HF baseline), as "
                   "`vllm bench throughput`", add_throughput_args, run_throughput),
    "serve": ("latency (TTFT, TPOT, ITL) and throughput of a running server, as "
              "`vllm bench serve`", add_serve_args, run_serve),
}


def _add_kinds(parser: argparse.ArgumentParser) -> None:
    kinds = parser.add_subparsers(dest="bench_command", metavar="{" + ",".join(SUBCOMMANDS) + "}")
    kinds.required = True
    for name, (help_, add_args, run) in SUBCOMMANDS.items():
        p = kinds.add_parser(name, help=help_, description=help_)
        add_args(p)
        p.set_defaults(bench_run=run)


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Register `bench` (with its kinds) on the `pagedllm` CLI's subparsers."""
    parser = subparsers.add_parser("bench", help="benchmark the engine",
                                   description="Benchmark the engine.")
    _add_kinds(parser)
    parser.set_defaults(func=main)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pagedllm.entrypoints.bench",
                                     description="Benchmark the engine.")
    _add_kinds(parser)
    return parser


def main(args: argparse.Namespace) -> int:
    """Run the chosen benchmark kind; 0 on success (errors propagate as exceptions)."""
    args.bench_run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main(build_parser().parse_args()))
