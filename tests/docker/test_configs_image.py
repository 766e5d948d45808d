"""The image's install step, replayed without Docker: build the build context the way
docker/Dockerfile + Dockerfile.dockerignore define it, ``pip wheel`` it as the image's
``pip install .`` would, and run the installed CLI from that wheel alone.

This catches what a static read of the Dockerfile cannot: a file the package needs at
run time (presets, dashboard templates) that the COPY lines or the ignore file leave out.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"


def build_context(dest: Path, dockerfile_path: Path = DOCKER / "Dockerfile") -> Path:
    """Lay out /opt/stagecache as the Dockerfile's COPY lines fill it (ignore file applied)."""
    dockerfile = pytest.importorskip("dockerfile", reason="pip install dockerfile (test extra)")
    # Excludes of the ignore file below its leading "*" (the "!" lines are the COPY sources).
    excludes = [line.removeprefix("**/") for line in
                (DOCKER / "Dockerfile.dockerignore").read_text().split()
                if line not in ("*",) and not line.startswith(("!", "#"))]

    def skip(_dir: str, names: list[str]) -> list[str]:
        return [n for n in names if any(fnmatch.fnmatch(n, pat) for pat in excludes)]

    workdir = None
    for c in dockerfile.parse_file(str(dockerfile_path)):
        if c.cmd == "WORKDIR":
            workdir = c.value[0]
        if c.cmd != "COPY":
            continue
        assert workdir == "/opt/stagecache", "COPY lines are expected under WORKDIR /opt/stagecache"
        *sources, target = c.value
        for src in sources:
            path = ROOT / src
            if path.is_dir():  # Docker copies a folder's contents into the target
                shutil.copytree(path, dest / target, ignore=skip, dirs_exist_ok=True)
            else:
                out = dest / target / path.name if target.endswith("/") else dest / target
                out.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(path, out)
    return dest


def pip_wheel(ctx: Path, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "--no-index", "-q", "-w", str(out), str(ctx)],
                          capture_output=True, text=True, timeout=180)


@pytest.fixture(scope="module")
def wheel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("image")
    res = pip_wheel(build_context(tmp / "opt-stagecache"), tmp / "dist")
    assert res.returncode == 0, res.stdout + res.stderr
    (wheel,) = (tmp / "dist").glob("stagecache-*.whl")
    unpacked = tmp / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(unpacked)
    return unpacked


def run_from_wheel(site: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """python -S: no .pth files, so the editable install of the work tree is invisible;
    the dependencies still come from this interpreter's site-packages."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), sysconfig.get_paths()["purelib"]])}
    return subprocess.run([sys.executable, "-S", *argv], capture_output=True, text=True, timeout=120,
                          env=env, cwd=site)


def test_wheel_declares_the_stagecache_command(wheel_dir: Path) -> None:
    (info,) = wheel_dir.glob("stagecache-*.dist-info")
    assert "stagecache = stagecache.runtime.cli.main:entry" in (info / "entry_points.txt").read_text()


def test_cli_from_the_image_install_runs_check(wheel_dir: Path) -> None:
    res = run_from_wheel(wheel_dir, "-c",
                         "import stagecache.runtime.cli.main as c, sys; print(c.__file__); "
                         "sys.exit(c.main(['check', '--model', 'tiny-v4', '--pp-size', '4']))")
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.splitlines()[0].startswith(str(wheel_dir)), "ran the work tree, not the wheel"
    assert "all stages valid" in res.stdout


def test_image_install_ships_the_dashboard_assets_and_serve(wheel_dir: Path) -> None:
    code = (
        "import importlib.resources as r, importlib, sys\n"
        "d = r.files('stagecache.dashboard')\n"
        "assert (d / 'templates' / 'index.html').is_file(), 'templates/index.html'\n"
        "assert any(p.name.endswith('.js') for p in (d / 'static').iterdir()), 'static/*.js'\n"
        "for m in ('stagecache.runtime.cli.serve', 'stagecache.exporters.metrics',\n"
        "          'stagecache.dashboard.app'):\n"
        "    assert importlib.import_module(m).__file__.startswith(sys.argv[1]), m\n"
    )
    res = run_from_wheel(wheel_dir, "-c", code, str(wheel_dir))
    assert res.returncode == 0, res.stdout + res.stderr


def test_a_dockerfile_that_forgets_a_code_folder_cannot_install(tmp_path: Path) -> None:
    """The replay is not vacuous: drop one COPY line and the image's pip install breaks."""
    text = (DOCKER / "Dockerfile").read_text()
    line = "COPY dashboard ./dashboard\n"
    assert line in text, "update this test: the dashboard COPY line changed"
    broken = tmp_path / "Dockerfile"
    broken.write_text(text.replace(line, ""))
    res = pip_wheel(build_context(tmp_path / "ctx", broken), tmp_path / "dist")
    assert res.returncode != 0
    assert "dashboard" in res.stdout + res.stderr
