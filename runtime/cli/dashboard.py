"""``stagecache dashboard``: the dashboard over a preflight report, without starting any stage.

``--from-check`` plans the stages exactly like ``stagecache check`` (same flags,
faults included); ``--from-json`` shows a saved ``stagecache check --json``
report.  Either way the source is a ``StaticSource``: layer maps and errors,
no live numbers (``stagecache serve`` mounts the same app over live stages).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from .. import defaults
from ..bounded_io import read_bounded_json
from ..errors import ConfigError
from .common import add_layout_args, add_listen_args, plan_from_args

if TYPE_CHECKING:
    from stagecache.dashboard.advise_models import AdviseReport

    from ..validation.report import StartupReport


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "dashboard",
        help="open the dashboard on a planned layout, without starting any stage",
        description="Serve the web dashboard (stage table, layer maps, /metrics, /docs) for a "
        "layout planned like `stagecache check` (--from-check, same flags) or for a saved "
        "`stagecache check --json` report (--from-json). No stage runs, so there are no live "
        "numbers: `stagecache serve` shows those. Runs until Ctrl-C: exit 130 (SIGTERM: 143); 2: bad input.",
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--from-check", action="store_true",
                      help="plan the stages from --model and the layout flags, exactly like `stagecache check`")
    what.add_argument("--from-json", metavar="FILE", type=Path,
                      help="show a report saved with `stagecache check --json > FILE`")
    # --from-check takes the layout flags exactly like `check` (the same defaults); with
    # --from-json they come from the file
    add_layout_args(p)
    p.add_argument("--advise", metavar="FILE", type=Path, default=None,
                   help="also show a saved `stagecache advise --json` report at /advise (hit rate "
                   "against host GiB per stage)")
    add_listen_args(p)
    p.set_defaults(func=run)


#: A ``stagecache check --json`` report of a 61-layer model at pp 8 is ~100 KB.
MAX_REPORT_BYTES = 16 << 20


def load_json_report(path: Path) -> StartupReport:
    """A saved check report, validated: a clear one-line ConfigError for anything else."""
    from ..validation.report import StartupReport

    raw = read_bounded_json(path, MAX_REPORT_BYTES, f"--from-json {path}",
                            "a `stagecache check --json` report")
    if not isinstance(raw, dict):
        raise ConfigError(f"--from-json {path}: expected a JSON object, got {type(raw).__name__}")
    return StartupReport.parse(raw, f"--from-json {path}")


def _advise(path: Path, report: StartupReport) -> AdviseReport:
    """The saved advise report, checked, for the same pipeline as the preflight view."""
    from stagecache.dashboard.advise_page import load_advise_report

    advise = load_advise_report(path)
    if advise.plan.pp_size != report.pp_size:
        raise ConfigError(f"--advise {path}: a report of pp={advise.plan.pp_size}, but the "
                          f"dashboard shows pp={report.pp_size}; expected the same --pp-size")
    return advise


def run(args: argparse.Namespace) -> int:
    from stagecache.runtime.live.source import StaticSource

    from ..validation.deployment import preflight

    if args.from_json is not None:
        if args.model != defaults.MODEL or args.fault:
            raise ConfigError("--from-json takes model, stages and faults from the file; "
                              "drop --model/--fault (or use --from-check)")
        report = load_json_report(args.from_json)
        what = f"{report.model} pp={report.pp_size} from {args.from_json}"
    else:
        report = preflight(plan_from_args(args))
        what = f"{report.model} pp={report.pp_size}" + (
            f" faults={','.join(report.faults)}" if report.faults else "")
    advise = _advise(args.advise, report) if args.advise is not None else None
    from stagecache.dashboard.server import BACKLOG, make_server

    from ..net import bind_listener, exposure_warning

    try:
        sock = bind_listener(args.host, args.port, backlog=BACKLOG)
    except OSError as exc:
        raise ConfigError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}; "
                          "expected a free --port (0 = any) on an address of this machine") from None
    warning = exposure_warning("--host", args.host, "the dashboard, its JSON API and /metrics")
    if warning:  # once the bind worked, so a bad address stays a one-line exit 2
        print(warning, file=sys.stderr, flush=True)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    status = "all stages valid" if report.ok else "MAPPING ERRORS"
    also = f"; advise: http://{shown}:{port}/advise" if advise is not None else ""
    print(f"stagecache dashboard: http://{shown}:{port}/  (preflight view of {what}: {status}{also}; "
          "Ctrl-C to stop)", flush=True)
    server = make_server(StaticSource(report), host, port, title=f"stagecache · {report.model}",
                         advise=advise)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0
