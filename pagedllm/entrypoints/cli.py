"""The `pagedllm` command: one subcommand per way of running the engine.

A subcommand is a function that adds its parser to `pagedllm`'s subparsers and sets
`func`, which runs it with the parsed args and may return an exit code; a new one (such
as `bench`) is one more `add_*_parser` in SUBCOMMANDS.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from pagedllm import __version__
from pagedllm.entrypoints.bench import add_bench_parser
from pagedllm.entrypoints.openai.cli_args import make_arg_parser, parse_args
from pagedllm.entrypoints.plan import add_plan_parser


def _serve(args: argparse.Namespace) -> None:
    from pagedllm.entrypoints.openai.api_server import run_server

    run_server(args)


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """`pagedllm serve [MODEL] [flags]`: the flags of the api_server module, plus MODEL."""
    help_ = "start the OpenAI-compatible server"
    parser = subparsers.add_parser("serve", help=help_, description=help_)
    make_arg_parser(parser, positional_model=True)
    parser.set_defaults(func=_serve)
    return parser


SUBCOMMANDS: list[Callable[..., argparse.ArgumentParser | None]] = [add_serve_parser,
                                                                     add_bench_parser,
                                                                     add_plan_parser]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedllm", description="Serve open-source LLMs fast with a paged KV cache.")
    parser.add_argument("--version", action="version", version=f"pagedllm {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add_parser in SUBCOMMANDS:
        add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int | None:
    args = parse_args(build_parser(), argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
