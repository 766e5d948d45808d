#!/usr/bin/env bash
# Install everything the test suite needs on a fresh Debian machine, then run it.
# Used as-is by .ci/run and by a newcomer:  bash tests/run.sh
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
# The CPU build of torch lies on local disk; a plain `torch` would pull a multi-GB CUDA build.
$PY -m pip install -q --disable-pip-version-check "torch==2.13.0"
$PY -m pip install -q --disable-pip-version-check -e ".[test]"

# Extra set-up steps, one script per concern (system packages, optional integrations).
for step in tests/setup.d/*.sh; do
    [ -e "$step" ] || continue
    echo "== set-up: $step"
    bash "$step"
done

echo "== ruff"
$PY -m ruff check runtime exporters dashboard tests
echo "== lint-imports (layers point one way, no cycles)"
$PY -c "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
echo "== pytest"
exec $PY -m pytest -q "$@"
