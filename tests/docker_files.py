"""Paths and readers both docker test modules use (the docker/ folder as files, nothing run)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli", reason="Python 3.10 needs tomli to read pyproject.toml")

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
DASHBOARD = DOCKER / "grafana" / "dashboards" / "stagecache.json"
DATASOURCES = DOCKER / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
DASHBOARD_PROVIDERS = DOCKER / "grafana" / "provisioning" / "dashboards" / "stagecache.yml"


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())
