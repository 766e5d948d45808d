"""The metrics reference of docs/metrics.md, generated from the collector's own families.

    python -m stagecache.exporters.reference           # rewrite the section in docs/metrics.md
    python -m stagecache.exporters.reference --check   # exit 1 if the section is stale
    python -m stagecache.exporters.reference --print   # the section on stdout

The section between the two markers is rendered from what the registry
describes (``StageCollector.describe()``: name, type, help) and the label
table of ``families.py``, so the documentation cannot drift from what
``/metrics`` serves; tests/exporters/test_metrics_reference.py fails when it does.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from stagecache.runtime.live.source import StaticSource

from .families import LABEL_VALUES, LABELS, all_families, label_names
from .metrics import StageCollector, exposed_name

BEGIN = "<!-- BEGIN GENERATED: python -m stagecache.exporters.reference -->"
END = "<!-- END GENERATED -->"
DOC = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"
SCOPES = {"build": "package", "run": "run (startup report)", "startup": "stage (startup report)", "liveness": "stage (liveness verdict, as /readyz)",
          "live": "stage (live numbers)", "parent": "serving parent",
          "deployment": "deployment (PP ranks compared, sglang endpoint)",
          "transfers": "deployment (every stage's HiCache transfers; serve and the sglang endpoint)"}


def render() -> str:
    """The generated Markdown: one row per family, then one row per label."""
    described = {m.name: m for m in StageCollector(StaticSource(None)).describe()}
    rows = ["| name | type | labels | from | help |", "| --- | --- | --- | --- | --- |"]
    for scope, fam in all_families():
        metric = described[exposed_name(fam)]
        labels = ", ".join(f"`{n}`" for n in label_names(scope, fam)) or "–"
        rows.append(f"| `{fam.name}` | {metric.type} | {labels} | {SCOPES[scope]} | "
                    f"{metric.documentation} |")
    label_rows = ["| label | meaning |", "| --- | --- |"]
    for name, meaning in LABELS.items():
        values = LABEL_VALUES.get(name)
        suffix = f" (one of {', '.join(values)})" if values and "`" not in meaning else ""
        label_rows.append(f"| `{name}` | {meaning}{suffix} |")
    return "\n".join([BEGIN, "", f"{len(rows) - 2} families.", "", *rows, "",
                      "Every label has one meaning across all families:", "", *label_rows, "", END])


def updated(text: str) -> str:
    """``text`` with its generated section replaced (markers must be present once)."""
    if text.count(BEGIN) != 1 or text.count(END) != 1:
        raise ValueError(f"{DOC}: expected the markers {BEGIN!r} and {END!r} once each")
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    return head + render() + tail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stagecache.exporters.reference",
                                     description="Write the metrics reference into docs/metrics.md.")
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/metrics.md is stale")
    parser.add_argument("--print", action="store_true", help="print the section instead")
    parser.add_argument("--doc", type=Path, default=DOC, help="the Markdown file (default docs/metrics.md)")
    args = parser.parse_args(argv)
    if args.print:
        print(render())
        return 0
    text = args.doc.read_text()
    new = updated(text)
    if args.check:
        stale = new != text
        print(f"{args.doc}: " + ("stale: run python -m stagecache.exporters.reference" if stale
                                 else "up to date"))
        return 1 if stale else 0
    args.doc.write_text(new)
    print(f"wrote the metrics reference into {args.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
