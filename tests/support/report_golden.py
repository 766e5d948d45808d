"""What ``check --json``, ``pools --json``, the dashboard's JSON API and ``/metrics`` print for a
set of layouts and every ``--fault``: captured once before the stage report became one typed
model (``python tests/support/report_golden.py``, run at that commit), compared since
(tests/validation/test_report_golden.py).

Every output goes through the public surface a user sees: the CLI's stdout, and the dashboard
app over a saved ``check --json`` report (``stagecache dashboard --from-json``).
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import re
from pathlib import Path
from typing import Any

GOLDEN = Path(__file__).resolve().parent.parent / "data" / "report-golden.json.gz"

#: (model, pp, extra flags) layouts; every fault is applied to each where it makes sense.
LAYOUTS: tuple[tuple[str, int, tuple[str, ...]], ...] = (
    ("tiny-v4", 1, ()),
    ("tiny-v4", 2, ()),
    ("tiny-v4", 4, ()),
    ("tiny-v4", 4, ("--pp-partition", "3,2,4,3")),
    ("deepseek-v4-flash", 4, ()),
    ("deepseek-v4-flash", 8, ()),
)
FAULTS = (
    "global-swa", "missing-c4-state", "global-c4", "global-compress-ids", "duplicate-compress-id",
    "overlap", "gap", "radix-skew", "pin-refused", "host-ram-short", "missing-c4-state@0",
    "global-swa@1", "overlap@2", "gap@3",
)
#: /metrics lines that change from run to run or machine to machine.
_VOLATILE = re.compile(r"^(process_|python_|stagecache_build_info)")


def cases() -> list[tuple[str, list[str]]]:
    out = []
    for model, pp, extra in LAYOUTS:
        base = ["--model", model, "--pp-size", str(pp), *extra]
        out.append((" ".join(base), base))
        for fault in FAULTS:
            name, _, at = fault.partition("@")
            if pp < 2 and name in ("overlap", "gap", "radix-skew"):
                continue
            if at and int(at) >= pp:
                continue
            out.append((" ".join([*base, "--fault", fault]), [*base, "--fault", fault]))
    out.append(("flash pp4 budget", ["--model", "deepseek-v4-flash", "--pp-size", "4",
                                     "--mem-budget-gb", "20", "24", "22", "30"]))
    return out


def _cli(argv: list[str]) -> tuple[int, str]:
    from stagecache.runtime.cli.main import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(argv)
    return code, buf.getvalue()


def _api(report: dict[str, Any]) -> dict[str, Any]:
    """The dashboard over a saved ``check --json`` report, as ``dashboard --from-json`` reads it."""
    from fastapi.testclient import TestClient
    from stagecache.dashboard.app import create_app
    from stagecache.runtime.live.source import StaticSource
    from stagecache.runtime.validation.report import StartupReport

    out: dict[str, Any] = {}
    with TestClient(create_app(StaticSource(StartupReport.parse(report, "check --json")))) as client:
        for path in ["/api/startup", "/api/stages", "/startupz",
                     *(f"/api/stages/{s['stage']}/layer-map" for s in report["stages"])]:
            r = client.get(path)
            out[path] = [r.status_code, r.json()]
        r = client.get("/metrics")
        out["/metrics"] = [r.status_code, sorted(
            line for line in r.text.splitlines() if line and not _VOLATILE.match(line)
            and not line.startswith(("# HELP process_", "# TYPE process_", "# HELP python_",
                                     "# TYPE python_", "# HELP stagecache_build_info",
                                     "# TYPE stagecache_build_info")))]
    return out


def capture_case(argv: list[str], budget: bool = False) -> dict[str, Any]:
    """Every output of one layout: check, pools and the dashboard over the check report."""
    pools_argv = ["pools", *argv, "--json"]
    if budget:
        return {"pools": _cli(pools_argv)}
    code, text = _cli(["check", *argv, "--json"])
    report = json.loads(text)
    return {"check": [code, report], "pools": _cli(pools_argv), "api": _api(report)}


def capture() -> dict[str, Any]:
    return {name: capture_case(argv, budget="--mem-budget-gb" in argv) for name, argv in cases()}


def load() -> dict[str, Any]:
    with gzip.open(GOLDEN, "rt") as f:
        return json.load(f)


if __name__ == "__main__":  # python tests/support/report_golden.py: write the golden file anew
    data = capture()
    GOLDEN.parent.mkdir(exist_ok=True)
    with gzip.open(GOLDEN, "wt") as f:
        json.dump(data, f, sort_keys=True)
    print(f"{len(data)} cases -> {GOLDEN} ({GOLDEN.stat().st_size} bytes)")
