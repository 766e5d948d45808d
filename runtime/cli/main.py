"""``stagecache`` command line: one subcommand per module, registered here.

Exit codes everywhere: 0 ok, 1 mapping errors (or a failed run), 2 bad input
(one line on stderr, never a traceback).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from ..errors import ConfigError, StageMappingInvalid

#: Subcommand modules; each has ``register(subparsers)`` and keeps heavy imports inside ``run``.
COMMAND_MODULES = (
    "stagecache.runtime.cli.check",
    "stagecache.runtime.cli.pools",
    "stagecache.runtime.cli.bench",
    "stagecache.runtime.cli.serve",
    "stagecache.runtime.cli.dashboard",
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse prints usage + error)
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="stagecache", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # not written yet / not installed: leave the command out
                continue
            raise
        module.register(sub)
    return parser


def _version() -> str:
    from .. import __version__

    return f"stagecache {__version__}"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"stagecache {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except StageMappingInvalid as exc:
        print(f"stagecache {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
