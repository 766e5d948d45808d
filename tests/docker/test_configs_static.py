"""Static checks of docker/: no Docker engine here or on CI, so nothing is built or run.

What is checked instead, with real tools where one exists:
* The Dockerfile and compose files: ``tests/docker/test_compose_static.py``.
* Grafana: the provisioned datasource uid is the one every panel uses; every metric a
  panel queries is one the exporter really exposes (fails when a metric is renamed and
  the dashboard is not); the same for docker/alerts.yml.
"""

from __future__ import annotations

import re
import subprocess
import sys

from docker_files import DATASOURCES, DOCKER, dashboard, dashboard_exprs, load_yaml, panels

METRIC_RE = re.compile(r"\bstagecache_[a-z0-9_]+")
RECORDED_RE = re.compile(r"\bstagecache:[a-zA-Z0-9_:]+")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")

# ---------------------------------------------------------------- what the exporter exposes

def exporter_families() -> set[str]:
    from stagecache.exporters.metrics import METRIC_NAMES

    return set(METRIC_NAMES)


def exported_sample_names() -> set[str]:
    """Sample names of a real registry over a tiny-v4 pp=4 report with live numbers."""
    from live_helpers import blank_live
    from plans import report as plan_report
    from stagecache.exporters.metrics import make_registry
    from stagecache.runtime.live.numbers import StageLive
    from stagecache.runtime.live.source import StaticSource
    from stagecache.runtime.model.families.deepseek_v4 import POOLS

    report = plan_report("tiny-v4", 4)
    stages = {}
    for k in range(4):
        n = blank_live(k, POOLS)
        n.update(steps=3, requests=2, cache_tokens={"device": 10, "host": 30, "miss": 60},
                 transfer_bytes={"d2h": 4096, "h2d": 8192},
                 transfer_seconds={"d2h": 0.001, "h2d": 0.002}, transfer_count={"d2h": 1, "h2d": 2})
        n.update(host_tier={"status": ["ok"], "mem_available_bytes": 1 << 33, "reserve_bytes": 1 << 30},
                 pool_occupancy=[{"pool": p, "tier": "device", "unit": "slot" if p == "c128_state" else "page",
                                  "capacity": 8} for p in POOLS])
        stages[k] = StageLive.model_validate(n)
    registry = make_registry(StaticSource(report, stages))
    return {s.name for fam in registry.collect() for s in fam.samples}


def family_of(name: str, families: set[str]) -> str | None:
    """The exporter family a PromQL series name belongs to (histogram/counter suffixes allowed)."""
    if name in families:
        return name
    for suffix in (*HISTOGRAM_SUFFIXES, "_total"):
        if name.endswith(suffix) and name[: -len(suffix)] in families:
            return name[: -len(suffix)]
    return None


def unknown_metrics(exprs: dict[str, str]) -> dict[str, list[str]]:
    families, samples = exporter_families(), exported_sample_names()
    bad: dict[str, list[str]] = {}
    for where, expr in exprs.items():
        for name in METRIC_RE.findall(expr):
            if family_of(name, families) is None or name not in samples:
                bad.setdefault(where, []).append(name)
    return bad


# ---------------------------------------------------------------- the dashboard

def alert_exprs() -> dict[str, str]:
    return {r.get("alert") or r["record"]: r["expr"]
            for g in load_yaml(DOCKER / "alerts.yml")["groups"] for r in g["rules"]}


def recorded_names() -> set[str]:
    return {r["record"] for g in load_yaml(DOCKER / "alerts.yml")["groups"]
            for r in g["rules"] if "record" in r}


def test_dashboard_queries_only_metrics_the_exporter_exposes() -> None:
    exprs = dashboard_exprs(dashboard())
    assert len(exprs) >= 12
    bad = unknown_metrics(exprs)
    assert not bad, f"dashboard queries metrics the exporter does not expose: {bad}"


def test_alert_rules_use_only_metrics_the_exporter_exposes() -> None:
    bad = unknown_metrics(alert_exprs())
    assert not bad, f"docker/alerts.yml uses metrics the exporter does not expose: {bad}"


def test_the_name_check_catches_a_renamed_metric() -> None:
    bad = unknown_metrics({"renamed": "rate(stagecache_cache_tokens_total[1m]) + stagecache_requests_total"})
    assert bad == {"renamed": ["stagecache_cache_tokens_total"]}


def test_dashboard_recording_rules_are_recorded_in_alerts_yml() -> None:
    used = {n for e in dashboard_exprs(dashboard()).values() for n in RECORDED_RE.findall(e)}
    assert used, "expected the dashboard to plot the recording rules (ceiling, 5m ratio)"
    assert {"stagecache:prefix_host_hit_ratio:rate5m", "stagecache:pipeline_bubble_ratio:rate1m",
            "stagecache:transfer_bandwidth_bytes_per_second:rate1m"} <= used
    assert used <= recorded_names(), f"not recorded by docker/alerts.yml: {used - recorded_names()}"


def test_dashboard_shows_every_required_view() -> None:
    exprs = " ".join(dashboard_exprs(dashboard()).values())
    for metric in ("stagecache_prefix_hit_tokens_total", "stagecache_prefix_lookup_tokens_total",
                   "stagecache_transfer_bytes_total", "stagecache_transfer_queue_wait_seconds_bucket",
                   "stagecache_transfer_queue_wait_seconds_sum", "stagecache_transfer_dma_seconds_sum",
                   "stagecache_transfers_total",
                   "stagecache_stage_buffers", "stagecache_stage_expected_buffers",
                   "stagecache_stage_local_layers", "stagecache_stage_mapping_ok",
                   "stagecache_page_space_used_pages", "stagecache_page_space_usage_ratio",
                   "stagecache_model_info", "stagecache_build_info", "stagecache_stage_phase"):
        assert metric in exprs, f"no dashboard panel queries {metric}"
    for metric in ("stagecache_host_tier_status", "stagecache_host_memory_available_bytes",
                   "stagecache_pool_usage_ratio", "stagecache_pool_used_bytes"):  # host tier, occupancy
        assert metric in exprs, f"no dashboard panel queries {metric}"
    for metric in ("stagecache_stage_disagreements_total", "stagecache_prefix_miss_tokens_total",
                   "stagecache_cache_entry_lifetime_seconds_bucket",
                   "stagecache_cache_entry_idle_seconds_bucket",
                   "stagecache_cache_entry_reuse_gap_seconds_bucket"):  # cache insight
        assert metric in exprs, f"no dashboard panel queries {metric}"
    legends = " ".join(t.get("legendFormat", "") for p in panels(dashboard()) for t in p.get("targets", []))
    assert "{{direction}}" in legends and "{{tier}}" in legends and "{{pp_rank}}" in legends
    assert "{{stage}}" not in legends and "$stage" not in exprs  # sglang's label names only


def test_dashboard_uses_the_provisioned_datasource_everywhere() -> None:
    (ds,) = load_yaml(DATASOURCES)["datasources"]
    dash = dashboard()
    assert dash["schemaVersion"] >= 36 and dash["uid"] and dash["title"]
    ids = [p["id"] for p in panels(dash)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in panels(dash):
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": ds["type"], "uid": ds["uid"]}, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == ds["uid"], (p["title"], t["refId"])
    for v in dash["templating"]["list"]:
        assert v["datasource"]["uid"] == ds["uid"]


def test_dashboard_panels_do_not_overlap() -> None:
    boxes = [(p["title"], p["gridPos"]) for p in panels(dashboard())]
    for i, (ta, a) in enumerate(boxes):
        assert 0 <= a["x"] and a["x"] + a["w"] <= 24, ta
        for tb, b in boxes[i + 1:]:
            apart = (a["x"] + a["w"] <= b["x"] or b["x"] + b["w"] <= a["x"]
                     or a["y"] + a["h"] <= b["y"] or b["y"] + b["h"] <= a["y"])
            assert apart, f"panels {ta!r} and {tb!r} overlap"


# ---------------------------------------------------------------- Prometheus config

def test_prometheus_scrapes_the_single_stagecache_endpoint() -> None:
    cfg = load_yaml(DOCKER / "prometheus.yml")
    g = cfg["global"]
    seconds = {"s": 1, "m": 60}
    interval = int(g["scrape_interval"][:-1]) * seconds[g["scrape_interval"][-1]]
    assert interval <= 15, "the demo wants a short scrape interval"
    assert cfg["rule_files"] == ["alerts.yml"]
    (job,) = [j for j in cfg["scrape_configs"] if j["job_name"] == "stagecache"]
    (static,) = job["static_configs"]
    assert static["targets"] == ["stagecache:8000"], "one endpoint carries every stage"
    assert job.get("metrics_path", "/metrics") == "/metrics"


# ---------------------------------------------------------------- Dockerfile


def test_dashboard_json_is_what_its_generator_writes() -> None:
    res = subprocess.run([sys.executable, str(DOCKER / "grafana" / "make_dashboard.py"), "--check"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
