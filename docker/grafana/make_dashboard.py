"""Generates docker/grafana/dashboards/stagecache.json (Grafana loads the JSON; edit here).

    python docker/grafana/make_dashboard.py          # rewrite the JSON
    python docker/grafana/make_dashboard.py --check  # exit 1 if the JSON is stale

tests/test_docker_configs_static.py runs --check, so the JSON and this file never drift.
Panels are plain dicts in Grafana's dashboard JSON model (schemaVersion 39); every query
uses the provisioned datasource uid and the `stage` variable.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "dashboards" / "stagecache.json"

DS = {"type": "prometheus", "uid": "stagecache-prometheus"}
S = '{stage=~"$stage"}'
_id = [0]


def nid():
    _id[0] += 1
    return _id[0]


def tgt(expr, legend="", ref="A", instant=False, fmt="time_series"):
    t = {"datasource": DS, "refId": ref, "expr": expr, "legendFormat": legend or "__auto",
         "range": not instant, "instant": instant, "format": fmt}
    return t


def panel(kind, title, desc, grid, targets, unit=None, extra_defaults=None, options=None,
          custom=None, transformations=None):
    defaults = {"color": {"mode": "palette-classic"}, "mappings": [],
                "thresholds": {"mode": "absolute", "steps": [{"color": "green", "value": None}]}}
    if unit:
        defaults["unit"] = unit
    if custom:
        defaults["custom"] = custom
    defaults.update(extra_defaults or {})
    p = {"id": nid(), "type": kind, "title": title, "description": desc, "datasource": DS,
         "gridPos": dict(zip("xywh", grid, strict=True)), "targets": targets,
         "fieldConfig": {"defaults": defaults, "overrides": []}, "options": options or {}}
    if transformations:
        p["transformations"] = transformations
    return p


def row(title, y):
    return {"id": nid(), "type": "row", "title": title, "collapsed": False, "panels": [],
            "gridPos": {"x": 0, "y": y, "w": 24, "h": 1}}


TS_CUSTOM = {"drawStyle": "line", "lineWidth": 2, "fillOpacity": 10, "showPoints": "never",
             "spanNulls": False, "axisSoftMin": 0}
TS_OPTS = {"legend": {"displayMode": "table", "placement": "right", "showLegend": True,
                      "calcs": ["lastNotNull"]},
           "tooltip": {"mode": "multi", "sort": "desc"}}
STAT_OPTS = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
             "colorMode": "background", "graphMode": "none", "justifyMode": "auto",
             "orientation": "auto", "textMode": "value_and_name", "wideLayout": True}
RED_GREEN = {"mode": "absolute", "steps": [{"color": "red", "value": None}, {"color": "green", "value": 1}]}
GREEN_RED = {"mode": "absolute", "steps": [{"color": "green", "value": None}, {"color": "red", "value": 1}]}

panels = [row("Startup validation: does every stage's pool match its local layers?", 0)]
panels.append(panel(
    "stat", "Mapping status per stage",
    "stagecache_stage_mapping_ok: 1 when the stage passed startup validation (pools sized by the "
    "stage's local layers, global->local ids consistent), 0 when it did not.",
    (0, 1, 9, 5), [tgt(f"min by (stage) (stagecache_stage_mapping_ok{S})", "stage {{stage}}")],
    extra_defaults={"color": {"mode": "thresholds"}, "thresholds": RED_GREEN,
                    "mappings": [{"type": "value", "options": {
                        "0": {"text": "MAPPING ERROR", "color": "red", "index": 0},
                        "1": {"text": "OK", "color": "green", "index": 1}}}]},
    options=STAT_OPTS))
panels.append(panel(
    "stat", "Mapping errors", "Sum of stagecache_stage_mapping_errors over the selected stages.",
    (9, 1, 5, 5), [tgt(f"sum(stagecache_stage_mapping_errors{S})", "errors")],
    extra_defaults={"color": {"mode": "thresholds"}, "thresholds": GREEN_RED},
    options={**STAT_OPTS, "textMode": "value"}))
panels.append(panel(
    "bargauge", "Local layers per stage",
    "stagecache_stage_local_layers: how many layers each PP stage owns. Every per-layer pool "
    "(SWA at least) must hold exactly this many buffers.",
    (14, 1, 10, 5), [tgt(f"stagecache_stage_local_layers{S}", "stage {{stage}}")],
    extra_defaults={"min": 0, "decimals": 0},
    options={"orientation": "horizontal", "displayMode": "basic", "showUnfilled": True,
             "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}}))
panels.append(panel(
    "table", "Buffers vs expected, per stage and pool",
    "Actual buffers a stage allocated per pool (stagecache_stage_buffers) next to what its local "
    "layers require (stagecache_stage_expected_buffers). diff != 0 is the PP + HiCache bug family.",
    (0, 6, 14, 10),
    [tgt(f"stagecache_stage_buffers{S}", "", "A", instant=True, fmt="table"),
     tgt(f"stagecache_stage_expected_buffers{S}", "", "B", instant=True, fmt="table"),
     tgt(f"stagecache_stage_buffers{S} - stagecache_stage_expected_buffers{S}", "", "C",
         instant=True, fmt="table")],
    extra_defaults={"custom": {"align": "auto", "cellOptions": {"type": "auto"}}},
    options={"showHeader": True, "sortBy": [{"displayName": "stage", "desc": False}]},
    transformations=[
        {"id": "merge", "options": {}},
        {"id": "organize", "options": {
            "excludeByName": {"Time": True, "job": True, "instance": True, "deployment": True,
                              "__name__": True},
            "indexByName": {"stage": 0, "pool": 1, "Value #A": 2, "Value #B": 3, "Value #C": 4},
            "renameByName": {"Value #A": "buffers", "Value #B": "expected", "Value #C": "diff"}}},
    ]))
panels[-1]["fieldConfig"]["overrides"] = [{
    "matcher": {"id": "byName", "options": "diff"},
    "properties": [{"id": "custom.cellOptions", "value": {"type": "color-background"}},
                   {"id": "thresholds", "value": {"mode": "absolute", "steps": [
                       {"color": "red", "value": None}, {"color": "green", "value": 0},
                       {"color": "red", "value": 1}]}}]}]
panels.append(panel(
    "timeseries", "SWA buffers vs local layers",
    "The original bug: the SWA pool sized by the model's global layer count. Each stage's SWA "
    "buffer line must lie on its local-layers line.",
    (14, 6, 10, 10),
    [tgt('stagecache_stage_buffers{pool="swa",stage=~"$stage"}', "stage {{stage}} swa buffers", "A"),
     tgt(f"stagecache_stage_local_layers{S}", "stage {{stage}} local layers", "B")],
    unit="short", custom={**TS_CUSTOM, "fillOpacity": 0}, options=TS_OPTS))

panels.append(row("KV cache: where looked-up tokens were found", 16))
panels.append(panel(
    "timeseries", "Host hit rate per stage",
    "Share of looked-up tokens found in the host (HiCache) tier: stagecache_host_hit_ratio "
    "(cumulative since start) and the 5-minute window the collapse alert uses.",
    (0, 17, 12, 9),
    [tgt(f"stagecache_host_hit_ratio{S}", "stage {{stage}} since start", "A"),
     tgt(f"stagecache:host_hit_ratio:rate5m{S}", "stage {{stage}} last 5m", "B")],
    unit="percentunit", extra_defaults={"min": 0, "max": 1}, custom=TS_CUSTOM, options=TS_OPTS))
panels.append(panel(
    "timeseries", "Cache tokens by tier (tokens/s)",
    "rate of stagecache_cache_tokens_total by tier: device hit, host hit, miss.",
    (12, 17, 12, 9),
    [tgt(f"sum by (stage, tier) (rate(stagecache_cache_tokens_total{S}[$__rate_interval]))",
         "stage {{stage}} {{tier}}")],
    unit="short", custom={**TS_CUSTOM, "stacking": {"mode": "normal", "group": "A"}},
    options=TS_OPTS))

panels.append(row("Transfers: host <-> device page copies", 26))
panels.append(panel(
    "timeseries", "Transfer bandwidth by direction",
    "d2h = backup to host, h2d = load from host. Mean since start (exported gauge), last minute "
    "(recording rule) and the bench ceiling from docker/alerts.yml.",
    (0, 27, 12, 9),
    [tgt(f"stagecache_transfer_bandwidth_bytes_per_second{S}",
         "stage {{stage}} {{direction}} mean", "A"),
     tgt(f"stagecache:transfer_bandwidth_bytes_per_second:rate1m{S}",
         "stage {{stage}} {{direction}} 1m", "B"),
     tgt("stagecache:transfer_bandwidth_ceiling_bytes_per_second", "bench ceiling", "C")],
    unit="Bps", custom=TS_CUSTOM, options=TS_OPTS))
panels.append(panel(
    "timeseries", "Bytes moved by direction",
    "rate of stagecache_transfer_bytes_total: how much the host tier is actually used.",
    (12, 27, 12, 9),
    [tgt(f"sum by (direction) (rate(stagecache_transfer_bytes_total{S}[$__rate_interval]))",
         "{{direction}}")],
    unit="Bps", custom=TS_CUSTOM, options=TS_OPTS))
panels.append(panel(
    "timeseries", "Transfer duration p50 / p99",
    "From the stagecache_transfer_seconds histogram, per direction.",
    (0, 36, 12, 9),
    [tgt("histogram_quantile(0.5, sum by (le, direction) "
         f"(rate(stagecache_transfer_seconds_bucket{S}[$__rate_interval])))", "{{direction}} p50", "A"),
     tgt("histogram_quantile(0.99, sum by (le, direction) "
         f"(rate(stagecache_transfer_seconds_bucket{S}[$__rate_interval])))", "{{direction}} p99", "B"),
     tgt(f"sum by (direction) (rate(stagecache_transfer_seconds_sum{S}[$__rate_interval])) / "
         f"sum by (direction) (rate(stagecache_transfer_seconds_count{S}[$__rate_interval]))",
         "{{direction}} mean", "C")],
    unit="s", custom=TS_CUSTOM, options=TS_OPTS))
panels.append(panel(
    "table", "Firing stagecache alerts",
    "Prometheus' ALERTS series for the rules in docker/alerts.yml (the full list is on "
    "Prometheus' /alerts page).",
    (12, 36, 12, 9),
    [tgt('ALERTS{alertstate="firing", alertname=~"Stagecache.*"}', "", "A", instant=True,
         fmt="table")],
    options={"showHeader": True},
    transformations=[{"id": "organize", "options": {
        "excludeByName": {"Time": True, "__name__": True, "Value": True, "job": True,
                          "deployment": True, "alertstate": True}}}]))

panels.append(row("Pools: pages and bytes per stage", 45))
panels.append(panel(
    "timeseries", "Pool pages used / free",
    "stagecache_pool_pages by stage, pool and state.",
    (0, 46, 12, 9),
    [tgt(f"sum by (stage, pool, state) (stagecache_pool_pages{S})",
         "stage {{stage}} {{pool}} {{state}}")],
    unit="short", custom=TS_CUSTOM, options=TS_OPTS))
panels.append(panel(
    "bargauge", "Pool page usage",
    "used / (used + free) pages, per stage and pool.",
    (12, 46, 12, 9),
    [tgt(f'sum by (stage, pool) (stagecache_pool_pages{{state="used",stage=~"$stage"}}) / '
         f"sum by (stage, pool) (stagecache_pool_pages{S})", "stage {{stage}} {{pool}}")],
    unit="percentunit", extra_defaults={"min": 0, "max": 1, "color": {"mode": "thresholds"},
                                        "thresholds": {"mode": "absolute", "steps": [
                                            {"color": "green", "value": None},
                                            {"color": "orange", "value": 0.8},
                                            {"color": "red", "value": 0.95}]}},
    options={"orientation": "horizontal", "displayMode": "gradient", "showUnfilled": True,
             "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}}))
panels.append(panel(
    "timeseries", "Pool bytes by tier",
    "stagecache_pool_bytes: bytes each stage holds on the device and in the host tier.",
    (0, 55, 24, 8),
    [tgt(f"sum by (stage, tier) (stagecache_pool_bytes{S})", "stage {{stage}} {{tier}}")],
    unit="bytes", custom={**TS_CUSTOM, "stacking": {"mode": "normal", "group": "A"}},
    options=TS_OPTS))

panels.append(row("Pipeline: traffic, bubbles and evictions per stage", 63))
panels.append(panel(
    "timeseries", "Requests / s per stage",
    "rate of stagecache_requests_total: requests each PP stage processed.",
    (0, 64, 8, 8),
    [tgt(f"sum by (stage) (rate(stagecache_requests_total{S}[$__rate_interval]))", "stage {{stage}}")],
    unit="reqps", custom=TS_CUSTOM, options=TS_OPTS))
panels.append(panel(
    "timeseries", "Pipeline bubble fraction per stage",
    "Idle share of each stage: bubble / (busy + bubble) seconds over the window. The ideal "
    "1F1B bubble for pp stages and m micro-batches is (pp-1)/(m+pp-1).",
    (8, 64, 8, 8),
    [tgt(f"sum by (stage) (rate(stagecache_stage_bubble_seconds_total{S}[$__rate_interval])) / "
         f"(sum by (stage) (rate(stagecache_stage_busy_seconds_total{S}[$__rate_interval])) + "
         f"sum by (stage) (rate(stagecache_stage_bubble_seconds_total{S}[$__rate_interval])))",
         "stage {{stage}}")],
    unit="percentunit", extra_defaults={"min": 0, "max": 1}, custom=TS_CUSTOM, options=TS_OPTS))
panels.append(panel(
    "timeseries", "Evictions / s by tier",
    "rate of stagecache_evictions_total: pages pushed out of the device and host tiers.",
    (16, 64, 8, 8),
    [tgt(f"sum by (stage, tier) (rate(stagecache_evictions_total{S}[$__rate_interval]))",
         "stage {{stage}} {{tier}}")],
    unit="short", custom=TS_CUSTOM, options=TS_OPTS))

dash = {
    "uid": "stagecache", "title": "stagecache: PP stage-local KV cache",
    "description": "Per-stage mapping status, host hit rate, transfers and pools of stagecache serve "
                   "(one /metrics endpoint, all stages via the `stage` label).",
    "tags": ["stagecache", "kv-cache", "pipeline-parallel"],
    "schemaVersion": 39, "version": 1, "editable": True, "graphTooltip": 1,
    "time": {"from": "now-15m", "to": "now"}, "refresh": "5s", "timezone": "browser",
    "timepicker": {"refresh_intervals": ["5s", "10s", "30s", "1m", "5m"]},
    "annotations": {"list": [{"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                              "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
                              "name": "Annotations & Alerts", "type": "dashboard"}]},
    "templating": {"list": [{
        "name": "stage", "label": "stage", "type": "query", "datasource": DS,
        "definition": "label_values(stagecache_stage_local_layers, stage)",
        "query": {"query": "label_values(stagecache_stage_local_layers, stage)",
                  "refId": "StandardVariableQuery", "qryType": 1},
        "refresh": 2, "sort": 3, "multi": True, "includeAll": True, "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "options": [],
        "hide": 0, "regex": "", "skipUrlSync": False}]},
    "links": [], "liveNow": False, "fiscalYearStartMonth": 0, "weekStart": "",
    "panels": panels,
}


def render() -> str:
    return json.dumps(dash, indent=2) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] == ["--check"]:
        stale = not OUT.exists() or OUT.read_text() != render()
        print(f"{OUT} is stale: run {Path(__file__).name}" if stale else f"{OUT} is up to date")
        sys.exit(1 if stale else 0)
    OUT.write_text(render())
    print(f"wrote {OUT} ({len(panels)} panels)")
