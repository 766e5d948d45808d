"""The ``stagecache`` command: one subcommand per module, registered in ``build_parser``.

Exit codes, the same for every command (docs/serve.md lists them with examples):

* 0 ok; 1 mapping errors found, or a ``serve`` run failed (a stage died);
* 2 bad input: one line on stderr naming the flag or file, the value and what
  is accepted, never a traceback;
* 3 internal error (a bug): one line naming the error and the log file that
  holds the traceback;
* 130 / 143 interrupted (SIGINT / SIGTERM); 141 the reader of stdout went away
  (``stagecache pools --json | head``), quietly, like any Unix tool.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from .. import __version__
from ..errors import ConfigError, StageMappingInvalid

EXIT_MAPPING = 1
EXIT_BAD_INPUT = 2
EXIT_INTERNAL = 3
EXIT_BROKEN_PIPE = 141

DESCRIPTION = (
    "Check, size and run a pipeline-parallel, stage-local KV cache for DeepSeek-V4-style models. "
    "Start with `stagecache check --model deepseek-v4-flash --pp-size 4` (is every PP stage's "
    "layout valid?) or `stagecache serve` (a demo run with the dashboard)."
)
EPILOG = ("exit codes: 0 ok; 1 mapping errors found or a stage failed; 2 bad input; "
          "3 internal error (a log file is named); 130/143 interrupted; 141 stdout closed. "
          "`stagecache COMMAND --help` describes each command.")

#: Subcommand modules; each has ``register(subparsers)`` and keeps heavy imports inside ``run``.
COMMAND_MODULES = (
    "stagecache.runtime.cli.check",
    "stagecache.runtime.cli.pools",
    "stagecache.runtime.cli.advise",
    "stagecache.runtime.cli.bench",
    "stagecache.runtime.cli.serve",
    "stagecache.runtime.cli.dashboard",
)


def one_line(text: str) -> str:
    """``text`` with every character that is not printable escaped (``\\x1e``, ``\\n``): a user's
    value can neither break the message into lines nor send control sequences to the terminal."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse prints usage + error)
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {one_line(message)}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="stagecache", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"stagecache {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def _quiet_stdout() -> None:
    """stdout's reader is gone: point stdout at /dev/null so the exit flush cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def _internal_error(command: str, exc: BaseException) -> int:
    """One line naming the error and the traceback's log file (``$STAGECACHE_DEBUG``: print it).

    A crash-log directory that is not private (another user made it, or can write it) is not
    written into: that is exit 2, naming the directory and its owner, and the error it hid.
    """
    from ..crash_log import write_crash_log

    text = str(exc).splitlines()[0][:300] if str(exc) else ""
    try:
        log = write_crash_log(command, exc)
    except ConfigError as refused:
        print(f"stagecache {command}: error: {refused} (the internal error {type(exc).__name__}"
              f"{': ' + text if text else ''} was not logged)", file=sys.stderr)
        return EXIT_BAD_INPUT
    where = f"traceback in {log}" if log else "the traceback could not be written"
    print(f"stagecache {command}: internal error: {type(exc).__name__}"
          f"{': ' + text if text else ''} ({where}; set STAGECACHE_DEBUG=1 to print it)",
          file=sys.stderr)
    if os.environ.get("STAGECACHE_DEBUG"):
        import traceback

        traceback.print_exception(type(exc), exc, exc.__traceback__)
    return EXIT_INTERNAL


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record comes (not the stream of the first call)."""

    @property  # type: ignore[override]
    def stream(self):  # noqa: ANN201 - a text stream
        return sys.stderr

    @stream.setter
    def stream(self, _value: object) -> None:
        pass


def _configure_logging(command: str) -> None:
    """Library code reports through ``logging`` (a logger per package); the command shows WARNING
    and up on stderr, a benchmark its progress (INFO) too; ``STAGECACHE_LOG=debug|info|warning``
    sets the level of everything."""
    root = logging.getLogger("stagecache")
    if not any(isinstance(h, _StderrHandler) for h in root.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        root.addHandler(handler)
    wanted = os.environ.get("STAGECACHE_LOG", "").upper()
    root.setLevel(getattr(logging, wanted, None) if wanted in ("DEBUG", "INFO", "WARNING", "ERROR")
                  else logging.WARNING)
    if not wanted and command == "bench":
        logging.getLogger("stagecache.runtime.bench").setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns its exit code (Ctrl-C at any point, startup included: 130)."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        return 130


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    if not (sys.argv[1:] if argv is None else argv):  # a bare `stagecache`: what can I do here?
        parser.print_usage(sys.stderr)
        print("stagecache: error: name a command (check, pools, serve, dashboard, bench); "
              "`stagecache --help` describes them", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help / --version (0), a bad flag (2, one line from _Parser.error)
        return exc.code if isinstance(exc.code, int) else EXIT_BAD_INPUT
    _configure_logging(args.command)
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a reader that went away shows here, not in the exit-time flush
        return code
    except ConfigError as exc:
        print(f"stagecache {args.command}: error: {one_line(str(exc))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except StageMappingInvalid as exc:
        print(f"stagecache {args.command}: {exc}", file=sys.stderr)
        return EXIT_MAPPING
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        _quiet_stdout()
        return EXIT_BROKEN_PIPE
    except Exception as exc:  # noqa: BLE001 - the boundary: a bug, reported in one line + a log
        return _internal_error(args.command, exc)


#: Exit codes of an interrupt: the process ends at once, without the interpreter's teardown.
INTERRUPTED = (130, 143)


def entry() -> None:
    """The ``stagecache`` executable: ``main()``, then exit.

    After Ctrl-C or SIGTERM the command has already stopped its work and cleaned up (its
    ``finally`` blocks ran); what is left is the interpreter's own teardown of torch and
    friends, which takes about a second.  An interrupted command skips it (stdout and
    stderr are flushed first), so Ctrl-C ends any command well within a second.
    """
    code = main()
    if code in INTERRUPTED:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
