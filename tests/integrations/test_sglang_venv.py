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


#: The plugin's live suites, in-process (they publish sglang's server args in the pytest process).
LIVE_SUITES = ("tests/integrations/test_sglang_live.py", "tests/integrations/test_sglang_live_server.py",
               "tests/integrations/test_sglang_live_pools.py")
#: Suites whose ranks are forked from the pytest process: a deployment of the plugin, ranks that
#: stop agreeing, and every other family live (a Mamba hybrid, DSA, an SWA hybrid at pp 2 and 4, a
#: dense model).  They run first in their pytest process, before an in-process suite has published
#: any sglang state that the forks would inherit.
DEPLOYMENT_SUITE = "tests/integrations/test_sglang_live_deployment.py"
AGREEMENT_SUITE = "tests/integrations/test_sglang_live_agreement.py"
FAMILIES_SUITE = "tests/integrations/test_sglang_live_families.py"
#: Comparisons with the pinned release's own objects (model families' pools, the eviction order, L3 keys):
#: stagecache claims them for that release, so they run on it alone.
PINNED_SUITES = ("tests/integrations/test_sglang_policies.py",
                 "tests/integrations/test_sglang_dsa.py", "tests/integrations/test_sglang_dense.py",
                 "tests/integrations/test_sglang_swa_hybrid.py",
                 "tests/integrations/test_sglang_linear_hybrid.py",
                 "tests/integrations/test_sglang_storage_keys.py")
#: Left out of the run on the release before: the pp 8 deployment reaches the hooks the pp 4 one
#: does, with twice the ranks (the pinned release runs it).
PREVIOUS_LEFT_OUT = ("--deselect", f"{DEPLOYMENT_SUITE}::test_pp8")
#: One pytest run each (a test of its own, so the runs spread over the xdist workers; each imports
#: sglang once, about 12 CPU seconds): (id, release (None: the pinned one), suites in the order they
#: run, the fewest tests that must pass).  The plugin's suites run on every release it says it was
#: tested with (``SGLANG_TESTED_VERSIONS``); the families and comparisons on the pinned release, in
#: the same run as its plugin suites (every suite that forks ranks first, then the in-process ones).
RUNS = [("pinned", None, (DEPLOYMENT_SUITE, AGREEMENT_SUITE, FAMILIES_SUITE, *LIVE_SUITES, *PINNED_SUITES),
         8 + 6 + 26 + 50 + 150),
        (f"{PREVIOUS_VERSION}-live", PREVIOUS_VERSION, (DEPLOYMENT_SUITE, *LIVE_SUITES, *PREVIOUS_LEFT_OUT), 7 + 50)]
#: One pytest run (the largest takes about 5 minutes on a loaded 2-core machine).
SUITE_TIMEOUT_S = 900


@pytest.mark.sglang_venv
@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize(("release", "suites", "least"), [r[1:] for r in RUNS], ids=[r[0] for r in RUNS])
def test_real_sglang_suite_in_its_venv(tmp_path, release, suites, least):
    """Run the real-sglang suites in .venv-sglang (one pytest run of RUNS per test): the plugin's
    suites on the pinned release and again on the release before, the families live and the
    comparisons with sglang's own objects on the pinned release."""
    venv_py = sglang_python(release)
    env = {**os.environ, "PYTHONPATH": str(checkout_on_path(tmp_path))}
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
