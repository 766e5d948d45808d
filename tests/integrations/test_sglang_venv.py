"""The sglang integration from the main environment (no sglang here).

* the core package never imports sglang;
* ``stagecache.runtime.integrations.sglang`` fails with an install hint when sglang is missing;
* the real-sglang suites (tests/integrations/test_sglang_live*.py) run in ``.venv-sglang``, which
  tests/setup.d/50-sglang.sh builds (torch 2.14.1 + sglang 0.5.23 --no-deps: sglang's
  torchvision import does not work with this environment's CPU torch 2.13.0).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from sglang_env import PREVIOUS_VERSION, TIMEOUT_S, checkout_on_path, sglang_python

ROOT = Path(__file__).resolve().parents[2]

# A meta-path hook that makes `import sglang` fail even where sglang is installed.
BLOCK_SGLANG = textwrap.dedent("""
    import sys
    class _NoSglang:
        def find_spec(self, name, path=None, target=None):
            if name == "sglang" or name.startswith("sglang."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    sys.meta_path.insert(0, _NoSglang())
""")


def _run(code: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", BLOCK_SGLANG + textwrap.dedent(code)],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT,
    )


def test_core_imports_without_sglang():
    proc = _run("""
        import importlib, pkgutil, sys
        names = []
        for pkg in ("stagecache.runtime", "stagecache.exporters", "stagecache.dashboard"):
            mod = importlib.import_module(pkg)
            names.append(pkg)
            for info in pkgutil.walk_packages(mod.__path__, pkg + "."):
                if info.name.startswith("stagecache.runtime.integrations.sglang") or info.name.endswith("__main__"):
                    continue
                importlib.import_module(info.name)
                names.append(info.name)
        assert not [m for m in sys.modules if m.split(".")[0] == "sglang"]
        print(len(names), "modules imported")
    """)
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout.split()[0]) >= 10, proc.stdout


def test_integration_without_sglang_says_how_to_install():
    proc = _run("""
        try:
            import stagecache.runtime.integrations.sglang
        except ImportError as exc:
            print("IMPORTERROR", exc)
    """)
    assert proc.returncode == 0, proc.stderr
    assert "IMPORTERROR stagecache.runtime.integrations.sglang needs sglang: " \
           "pip install '.[sglang]' in a stagecache checkout" in proc.stdout


#: The plugin's live suites: run on every release the plugin says it was tested with.
LIVE_SUITES = ("tests/integrations/test_sglang_live.py", "tests/integrations/test_sglang_live_server.py",
               "tests/integrations/test_sglang_live_pools.py")
#: Its ranks are forked from the pytest process, so it runs in a pytest process of its own: sglang
#: state the other suites publish in-process must not leak into the ranks.
DEPLOYMENT_SUITE = "tests/integrations/test_sglang_live_deployment.py"
#: The ranks that stop agreeing (its own process too, for the same reason).
AGREEMENT_SUITE = "tests/integrations/test_sglang_live_agreement.py"
#: Every other family live (a Mamba hybrid, DSA, an SWA hybrid at pp 2 and 4, a dense model; its own process too):
#: their pools are modelled on the pinned release, so it runs there.
FAMILIES_SUITE = "tests/integrations/test_sglang_live_families.py"
#: Comparisons with the pinned release's own objects (model families' pools, the eviction order, L3 keys):
#: stagecache claims them for that release, so they run on it alone, beside the live suites.
PINNED_SUITES = ("tests/integrations/test_sglang_policies.py",
                 "tests/integrations/test_sglang_dsa.py", "tests/integrations/test_sglang_dense.py",
                 "tests/integrations/test_sglang_swa_hybrid.py",
                 "tests/integrations/test_sglang_linear_hybrid.py",
                 "tests/integrations/test_sglang_storage_keys.py")
#: One pytest run per suite set: (suites, the fewest tests that must pass).
#: The agreement suite (about a minute) runs on the pinned release, beside the comparisons.
RUNS = {"live": ((LIVE_SUITES, 50), ((DEPLOYMENT_SUITE,), 8)),
        "pinned": ((PINNED_SUITES, 150), ((AGREEMENT_SUITE,), 6), ((FAMILIES_SUITE,), 26))}
#: One pytest run of a suite set (the families' suites take about 2.5 minutes on a loaded 2-core machine).
SUITE_TIMEOUT_S = 900
#: (release, suite set, which run of it): each pytest run is a test of its own, so the runs (one
#: to a few minutes each) spread over the xdist workers (tests/conftest.py schedules them one by one).
CASES = [(release, runs, i) for release, runs in ((None, "live"), (None, "pinned"), (PREVIOUS_VERSION, "live"))
         for i in range(len(RUNS[runs]))]
#: "pinned-live-0" (the live suites on the pinned release), "pinned-families-1" (the agreement suite), ...
CASE_IDS = [f"{release or 'pinned'}-{'families' if runs == 'pinned' else runs}-{i}" for release, runs, i in CASES]


@pytest.mark.sglang_venv
@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize(("release", "runs", "index"), CASES, ids=CASE_IDS)
def test_real_sglang_suite_in_its_venv(tmp_path, release, runs, index):
    """Run the real-sglang suites in .venv-sglang: the live suites on the pinned release and again on
    the release before (``SGLANG_TESTED_VERSIONS``: every release the plugin says it was tested
    with), the comparisons with sglang's own objects on the pinned release; one pytest run (of
    RUNS) per test."""
    venv_py = sglang_python(release)
    env = {**os.environ, "PYTHONPATH": str(checkout_on_path(tmp_path))}
    suites, least = RUNS[runs][index]
    proc = subprocess.run(
        [str(venv_py), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore", *suites],
        capture_output=True, text=True, timeout=SUITE_TIMEOUT_S, cwd=ROOT, env=env,
    )
    tail = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= least, tail
    assert "failed" not in proc.stdout.splitlines()[-1], tail
    # the suites imported this checkout, not the venv's own install
    where = subprocess.run([str(venv_py), "-c", "import stagecache.runtime as r; print(r.__file__)"],
                           capture_output=True, text=True, timeout=60, env=env)
    assert where.stdout.strip().startswith(str(tmp_path)), where.stdout + where.stderr
