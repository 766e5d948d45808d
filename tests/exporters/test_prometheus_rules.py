"""promtool over the shipped Prometheus files: config, rule syntax, and rule unit tests.

``promtool test rules docker/alerts.test.yml`` feeds synthetic series with the
exporter's labels through docker/alerts.yml and checks which alerts fire, with
which labels and rendered annotations; the mutation check below makes sure that
those unit tests really depend on the thresholds in alerts.yml.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

DOCKER = Path(__file__).resolve().parents[2] / "docker"
PROMTOOL = shutil.which("promtool")

pytestmark = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool not installed (Debian package `prometheus`; tests/setup.d/10-system-packages.sh)",
)


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def test_prometheus_config_is_valid_and_finds_the_rule_file(tmp_path: Path) -> None:
    # A copy in a scratch folder: rule_files are resolved relative to the config's folder,
    # so this also proves the config expects alerts.yml right beside it (as compose mounts it).
    shutil.copy(DOCKER / "prometheus.yml", tmp_path)
    shutil.copy(DOCKER / "alerts.yml", tmp_path)
    res = promtool("check", "config", str(tmp_path / "prometheus.yml"))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "1 rule files found" in res.stdout + res.stderr


def test_prometheus_config_without_its_rule_file_is_rejected(tmp_path: Path) -> None:
    shutil.copy(DOCKER / "prometheus.yml", tmp_path)
    res = promtool("check", "config", str(tmp_path / "prometheus.yml"))
    assert res.returncode != 0
    assert "alerts.yml" in res.stdout + res.stderr


def test_alert_rules_are_valid() -> None:
    res = promtool("check", "rules", str(DOCKER / "alerts.yml"))
    assert res.returncode == 0, res.stdout + res.stderr
    rules = [r for g in yaml.safe_load((DOCKER / "alerts.yml").read_text())["groups"] for r in g["rules"]]
    assert f"{len(rules)} rules found" in res.stdout


def test_alert_rules_have_the_required_alerts() -> None:
    groups = yaml.safe_load((DOCKER / "alerts.yml").read_text())["groups"]
    alerts = {r["alert"]: r for g in groups for r in g["rules"] if "alert" in r}
    assert "stagecache_stage_mapping_ok == 0" in alerts["StagecacheMappingError"]["expr"]
    assert set(alerts) >= {"StagecacheMappingError", "StagecacheBufferCountMismatch",
                           "StagecacheStageFailed", "StagecacheHostHitRatioCollapse",
                           "StagecacheTransferBandwidthLow"}
    # host-tier sanity: the not-ready status is critical, the warnings are warnings
    assert 'stagecache_host_tier_status="exceeds_ram"' in alerts["StagecacheHostTierExceedsRam"]["expr"]
    assert alerts["StagecacheHostTierExceedsRam"]["labels"]["severity"] == "critical"
    assert "smaller_than_device|pin_refused" in alerts["StagecacheHostTierDegraded"]["expr"]
    assert "avg_over_time" in alerts["StagecacheHostHitRatioCollapse"]["expr"]
    assert "[30m]" in alerts["StagecacheHostHitRatioCollapse"]["expr"]
    assert "ceiling" in alerts["StagecacheTransferBandwidthLow"]["expr"]
    # stage agreement: any disagreement is critical (the stages' KV cannot be trusted)
    assert "stagecache_stage_disagreements_total" in alerts["StagecacheStageDisagreement"]["expr"]
    assert alerts["StagecacheStageDisagreement"]["labels"]["severity"] == "critical"
    for name, rule in alerts.items():
        assert rule["labels"]["severity"] in ("critical", "warning"), name
        assert rule["annotations"]["summary"], name


def test_alert_unit_tests_pass() -> None:
    res = promtool("test", "rules", "alerts.test.yml", cwd=DOCKER)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout


def test_every_alert_has_a_firing_and_a_silent_case() -> None:
    groups = yaml.safe_load((DOCKER / "alerts.yml").read_text())["groups"]
    alerts = {r["alert"] for g in groups for r in g["rules"] if "alert" in r}
    cases = [c for t in yaml.safe_load((DOCKER / "alerts.test.yml").read_text())["tests"]
             for c in t.get("alert_rule_test", [])]
    for name in alerts:
        mine = [c for c in cases if c["alertname"] == name]
        assert any(c["exp_alerts"] for c in mine), f"{name}: no case where it fires"
        silent = any(not c["exp_alerts"] for c in mine) or any(
            len(c["exp_alerts"]) < 2 for c in mine)  # fires for one stage, not the healthy one
        assert silent, f"{name}: no case where it must stay silent"


@pytest.mark.parametrize(
    ("original", "mutant", "alert"),
    [
        ("stagecache_stage_mapping_ok == 0", "stagecache_stage_mapping_ok == 2", "StagecacheMappingError"),
        ('stagecache_stage_phase="failed"} == 1', 'stagecache_stage_phase="done"} == 1',
         "StagecacheStageFailed"),
        ("stagecache_stage_buffers != stagecache_stage_expected_buffers",
         "stagecache_stage_buffers > 2 * stagecache_stage_expected_buffers + 100",
         "StagecacheBufferCountMismatch"),
        ("< 0.5 * avg_over_time", "< 0.01 * avg_over_time", "StagecacheHostHitRatioCollapse"),
        ("vector(55e9)", "vector(15e9)", "StagecacheTransferBandwidthLow"),
        ("increase(stagecache_stage_disagreements_total[5m]) > 0",
         "increase(stagecache_stage_disagreements_total[5m]) > 10", "StagecacheStageDisagreement"),
    ],
)
def test_alert_unit_tests_catch_a_broken_threshold(tmp_path: Path, original: str, mutant: str,
                                                   alert: str) -> None:
    """The unit tests are not vacuous: weakening one threshold makes exactly that alert fail."""
    text = (DOCKER / "alerts.yml").read_text()
    assert text.count(original) == 1, f"{original!r} no longer in alerts.yml: update this test"
    (tmp_path / "alerts.yml").write_text(text.replace(original, mutant))
    shutil.copy(DOCKER / "alerts.test.yml", tmp_path)
    res = promtool("test", "rules", "alerts.test.yml", cwd=tmp_path)
    assert res.returncode != 0, res.stdout
    assert f"alertname: {alert}" in res.stdout + res.stderr
