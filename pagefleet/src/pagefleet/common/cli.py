"""The `pagefleet` command. Each installed role brings its subcommands through the
`pagefleet.commands` entry-point group (a function that adds its parser), so a router image
has `pagefleet router` and nothing that needs torch."""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import entry_points

from pagefleet.common import __version__

COMMANDS_GROUP = "pagefleet.commands"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagefleet", description="Kubernetes-native LLM serving with a paged KV cache."
    )
    parser.add_argument("--version", action="version", version=f"pagefleet {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    seen: set[str] = set()
    for command in sorted(entry_points(group=COMMANDS_GROUP), key=lambda e: e.name):
        if command.name not in seen:  # one dist per role, or the all-in-one dev dist
            seen.add(command.name)
            command.load()(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except ValueError as e:
        print(f"pagefleet {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
