"""docs/metrics.md's reference section is generated from the collector, so it cannot drift."""

from __future__ import annotations

import subprocess
import sys

import pytest
from stagecache.exporters import reference
from stagecache.exporters.metrics import METRIC_NAMES


def test_the_doc_is_up_to_date():
    r = subprocess.run([sys.executable, "-m", "stagecache.exporters.reference", "--check"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr + "\nrun: python -m stagecache.exporters.reference"


def test_every_family_is_in_the_doc():
    text = reference.DOC.read_text()
    section = text.split(reference.BEGIN)[1].split(reference.END)[0]
    for name in METRIC_NAMES:
        assert f"| `{name}` |" in section, name


def test_a_drifted_doc_is_caught(tmp_path):
    doc = tmp_path / "metrics.md"
    doc.write_text(reference.DOC.read_text().replace("| `stagecache_requests_total` |", "| `old_name` |"))
    assert reference.main(["--check", "--doc", str(doc)]) == 1
    assert reference.main(["--doc", str(doc)]) == 0  # the writer repairs it
    assert reference.main(["--check", "--doc", str(doc)]) == 0
    assert doc.read_text() == reference.DOC.read_text()


def test_missing_markers_are_a_clear_error(tmp_path):
    doc = tmp_path / "metrics.md"
    doc.write_text("# Metrics\n")
    with pytest.raises(ValueError, match="expected the markers"):
        reference.main(["--check", "--doc", str(doc)])
