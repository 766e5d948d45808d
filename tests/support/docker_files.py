"""Paths and readers both docker test modules use (the docker/ folder as files, nothing run)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli", reason="Python 3.10 needs tomli to read pyproject.toml")

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
DASHBOARD = DOCKER / "grafana" / "dashboards" / "stagecache.json"
DATASOURCES = DOCKER / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
DASHBOARD_PROVIDERS = DOCKER / "grafana" / "provisioning" / "dashboards" / "stagecache.yml"


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


# -- the Grafana dashboard: what both the static checks and the real-Prometheus test read
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # collapsed rows keep their panels inside
    return out


def dashboard_exprs(dash: dict[str, Any]) -> dict[str, str]:
    exprs = {}
    for p in panels(dash):
        for t in p.get("targets", []):
            exprs[f"panel {p['title']!r} target {t['refId']}"] = t["expr"]
    for v in dash.get("templating", {}).get("list", []):
        q = v.get("query")
        exprs[f"variable {v['name']!r}"] = q["query"] if isinstance(q, dict) else str(q)
    return exprs
