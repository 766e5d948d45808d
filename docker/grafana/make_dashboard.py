"""Generates docker/grafana/dashboards/stagecache.json (Grafana loads the JSON; edit here).

    python docker/grafana/make_dashboard.py          # rewrite the JSON
    python docker/grafana/make_dashboard.py --check  # exit 1 if the JSON is stale

tests/docker/test_configs_static.py runs --check, so the JSON and this file never drift.
Panels are plain dicts in Grafana's dashboard JSON model (schemaVersion 39); every query
uses the provisioned datasource uid and the `pp_rank` variable (sglang's label for the
stage). The exporter exposes counters and states only; every ratio below is a rate()
of counters, or a recording rule of docker/alerts.yml.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from insight_panels import insight_panels
from panels import (
    DS,
    GREEN_RED,
    HOST,
    RED_GREEN,
    STACK,
    STAT_OPTS,
    S,
    bars,
    merged_table,
    panel,
    rate,
    row,
    tgt,
    ts,
)

OUT = Path(__file__).resolve().parent / "dashboards" / "stagecache.json"

panels = [row("Startup validation: does every stage's pool match its local layers?", 0)]
panels.append(panel(
    "stat", "Mapping status per stage",
    "stagecache_stage_mapping_ok: 1 when the stage passed startup validation (pools sized by the "
    "stage's local layers, global->local ids consistent), 0 when it did not.",
    (0, 1, 9, 5), [tgt(f"min by (pp_rank) (stagecache_stage_mapping_ok{S})", "stage {{pp_rank}}")],
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
    (14, 1, 10, 5), [tgt(f"stagecache_stage_local_layers{S}", "stage {{pp_rank}}")],
    extra_defaults={"min": 0, "decimals": 0},
    options=bars("basic")))
panels.append(merged_table(
    "Buffers vs expected, per stage and pool",
    "Actual buffers a stage allocated per pool (stagecache_stage_buffers) next to what its local "
    "layers require (stagecache_stage_expected_buffers). diff != 0 is the PP + HiCache bug family.",
    (0, 6, 14, 10),
    [(f"stagecache_stage_buffers{S}", "buffers"), (f"stagecache_stage_expected_buffers{S}", "expected"),
     (f"stagecache_stage_buffers{S} - stagecache_stage_expected_buffers{S}", "diff")],
    ("model_name", "pp_rank", "pool")))
panels[-1]["fieldConfig"]["overrides"] = [{
    "matcher": {"id": "byName", "options": "diff"},
    "properties": [{"id": "custom.cellOptions", "value": {"type": "color-background"}},
                   {"id": "thresholds", "value": {"mode": "absolute", "steps": [
                       {"color": "red", "value": None}, {"color": "green", "value": 0},
                       {"color": "red", "value": 1}]}}]}]
panels.append(ts("SWA buffers vs local layers",
    "The original bug: the SWA pool sized by the model's global layer count. Each stage's SWA "
    "buffer line must lie on its local-layers line.",
    (14, 6, 10, 10),
    [tgt('stagecache_stage_buffers{pool="swa",pp_rank=~"$pp_rank"}', "stage {{pp_rank}} swa buffers", "A"),
     tgt(f"stagecache_stage_local_layers{S}", "stage {{pp_rank}} local layers", "B")],
    unit="short", custom={"fillOpacity": 0}))

panels.append(row("Run: model, phase and progress", 16))
panels.append(panel(
    "table", "Model and build",
    "stagecache_model_info (model, pp size, tp size, page size, layers) and stagecache_build_info "
    "(version): info metrics, value 1, the information is in the labels.",
    (0, 17, 12, 5),
    [tgt("stagecache_model_info", "", "A", instant=True, fmt="table"),
     tgt("stagecache_build_info", "", "B", instant=True, fmt="table")],
    options={"showHeader": True},
    transformations=[{"id": "merge", "options": {}}, {"id": "organize", "options": {
        "excludeByName": {"Time": True, "__name__": True, "Value #A": True, "Value #B": True,
                          "job": True, "deployment": True}}}]))
panels.append(panel(
    "stat", "Stage phase",
    "stagecache_stage_phase: the phase each stage reports (starting, serving, done, refused, "
    "failed).",
    (12, 17, 6, 5),
    [tgt(f"max by (pp_rank, stagecache_stage_phase) (stagecache_stage_phase{S}) == 1",
         "stage {{pp_rank}}: {{stagecache_stage_phase}}")],
    options={**STAT_OPTS, "colorMode": "none", "textMode": "name"}))
panels.append(panel(
    "bargauge", "Progress per stage",
    "stagecache_requests_total / stagecache_stage_planned_requests: share of the trace served.",
    (18, 17, 6, 5),
    [tgt(f"max by (pp_rank) (stagecache_requests_total{S}) / "
         f"max by (pp_rank) (stagecache_stage_planned_requests{S} > 0)", "stage {{pp_rank}}")],
    unit="percentunit", extra_defaults={"min": 0, "max": 1},
    options=bars("basic")))

panels.append(row("KV cache: where looked-up tokens were found", 22))
panels.append(ts("Host hit rate per stage",
    "Share of looked-up tokens found in the host (HiCache) tier, from the token counters: over "
    "Grafana's rate interval, and the 5-minute recording rule the collapse alert uses.",
    (0, 23, 12, 9),
    [tgt(f'{rate("stagecache_prefix_hit_tokens_total", sel=HOST)} / '
         f'{rate("stagecache_prefix_lookup_tokens_total")}', "stage {{pp_rank}}", "A"),
     tgt(f"stagecache:prefix_host_hit_ratio:rate5m{S}", "stage {{pp_rank}} last 5m", "B")],
    unit="percentunit", extra_defaults={"min": 0, "max": 1}))
panels.append(ts("Prefix tokens/s by tier",
    "Looked-up tokens per second found on the device, in the host tier, and missed "
    "(lookups - hits).",
    (12, 23, 12, 9),
    [tgt(rate("stagecache_prefix_hit_tokens_total", "pp_rank, tier"), "stage {{pp_rank}} {{tier}}", "A"),
     tgt(f'{rate("stagecache_prefix_lookup_tokens_total")} - {rate("stagecache_prefix_hit_tokens_total")}',
         "stage {{pp_rank}} miss", "B")],
    unit="short", custom=STACK))

panels.append(row("Transfers: host <-> device page copies", 32))
panels.append(ts("Copy bandwidth by direction",
    "d2h = backup to host, h2d = load from host: bytes / seconds spent copying over the last "
    "minute (recording rule), and the bench ceiling from docker/alerts.yml.",
    (0, 33, 12, 9),
    [tgt(f"stagecache:transfer_bandwidth_bytes_per_second:rate1m{S}",
         "stage {{pp_rank}} {{direction}}", "A"),
     tgt("stagecache:transfer_bandwidth_ceiling_bytes_per_second", "bench ceiling", "B")],
    unit="Bps"))
panels.append(ts("Bytes moved by direction",
    "rate of stagecache_transfer_bytes_total: how much the host tier is actually used.",
    (12, 33, 12, 9),
    [tgt(rate("stagecache_transfer_bytes_total", "pp_rank, direction"),
         "stage {{pp_rank}} {{direction}}")],
    unit="Bps"))
panels.append(ts("Transfer queue wait p50 / p99, DMA time mean",
    "Per direction: queue wait (a transfer's call until its copy starts on the stream) quantiles "
    "from stagecache_transfer_queue_wait_seconds, and the mean DMA time (copy start to finish) of "
    "a transfer from stagecache_transfer_dma_seconds_sum / stagecache_transfers_total.",
    (0, 42, 12, 9),
    [tgt("histogram_quantile(0.5, " + rate("stagecache_transfer_queue_wait_seconds_bucket",
                                            "le, direction") + ")", "{{direction}} queue p50", "A"),
     tgt("histogram_quantile(0.99, " + rate("stagecache_transfer_queue_wait_seconds_bucket",
                                             "le, direction") + ")", "{{direction}} queue p99", "B"),
     tgt(f'{rate("stagecache_transfer_dma_seconds_sum", "direction")} / '
         f'{rate("stagecache_transfers_total", "direction")}', "{{direction}} DMA mean", "C")],
    unit="s"))
panels.append(panel(
    "table", "Firing stagecache alerts",
    "Prometheus' ALERTS series for the rules in docker/alerts.yml (the full list is on "
    "Prometheus' /alerts page).",
    (12, 42, 12, 9),
    [tgt('ALERTS{alertstate="firing", alertname=~"Stagecache.*"}', "", "A", instant=True,
         fmt="table")],
    options={"showHeader": True},
    transformations=[{"id": "organize", "options": {
        "excludeByName": {"Time": True, "__name__": True, "Value": True, "job": True,
                          "deployment": True, "alertstate": True}}}]))

panels.append(row("Page spaces and pools", 51))
panels.append(ts("Pages used / capacity per page space",
    "A page id names one token page in every pool of its space, so pages are counted per space "
    "(stagecache_page_space_*_pages), never per pool: sums over stages are exact.",
    (0, 52, 12, 9),
    [tgt(f"sum by (pp_rank, space) (stagecache_page_space_used_pages{S})",
         "stage {{pp_rank}} {{space}} used", "A"),
     tgt(f"sum by (pp_rank, space) (stagecache_page_space_capacity_pages{S})",
         "stage {{pp_rank}} {{space}} capacity", "B")],
    unit="short"))
panels.append(panel(
    "bargauge", "Page space usage",
    "stagecache_page_space_usage_ratio: used / capacity pages, per stage and space.",
    (12, 52, 12, 9),
    [tgt(f"stagecache_page_space_usage_ratio{S}", "stage {{pp_rank}} {{space}}")],
    unit="percentunit", extra_defaults={"min": 0, "max": 1, "color": {"mode": "thresholds"},
                                        "thresholds": {"mode": "absolute", "steps": [
                                            {"color": "green", "value": None},
                                            {"color": "orange", "value": 0.8},
                                            {"color": "red", "value": 0.95}]}},
    options=bars("gradient")))
panels.append(ts("Pool bytes by tier",
    "stagecache_pool_bytes: bytes each stage's pools hold on the device and in the host tier.",
    (0, 61, 24, 8),
    [tgt(f"sum by (pp_rank, tier) (stagecache_pool_bytes{S})", "stage {{pp_rank}} {{tier}}")],
    unit="bytes", custom=STACK))

panels.append(row("Pipeline: traffic, bubbles and evictions per stage", 69))
panels.append(ts("Requests / s per stage",
    "rate of stagecache_requests_total: requests each PP stage processed.",
    (0, 70, 8, 8), [tgt(rate("stagecache_requests_total"), "stage {{pp_rank}}")],
    unit="reqps"))
panels.append(ts("Pipeline bubble fraction per stage",
    "Share of each stage's pipeline time spent waiting on a peer: bubble / (busy + bubble) "
    "seconds over the last minute (recording rule). The ideal GPipe bubble for pp stages and m "
    "micro-batches is (pp-1)/(m+pp-1).",
    (8, 70, 8, 8), [tgt(f"stagecache:pipeline_bubble_ratio:rate1m{S}", "stage {{pp_rank}}")],
    unit="percentunit", extra_defaults={"min": 0, "max": 1}))
panels.append(ts("Evicted pages / s by tier",
    "rate of stagecache_evicted_pages_total: pages pushed out of the device and host tiers.",
    (16, 70, 8, 8),
    [tgt(rate("stagecache_evicted_pages_total", "pp_rank, tier"), "stage {{pp_rank}} {{tier}}")],
    unit="short"))

# -- transfers: queue wait vs DMA time, per stage and pool kind ----------------------------------
panels.append(row("Transfers: queue wait vs DMA time, per pool kind", 78))
_SPLIT = "pp_rank, direction"
panels.append(ts("Queue wait vs DMA time per transfer, stage $pp_rank",
    "Mean time of one transfer, stacked per direction: waiting (call until the copy starts on the "
    "stream) under copying (DMA, start to finish). A growing queue part with a flat DMA part is a "
    "queue (copies behind copies or behind the stage's compute), not a slow link. One panel per "
    "selected stage.",
    (0, 79, 24, 8),
    [tgt(f'{rate("stagecache_transfer_queue_wait_seconds_sum", _SPLIT)} / '
         f'{rate("stagecache_transfer_queue_wait_seconds_count", _SPLIT)}', "{{direction}} queue wait", "A"),
     tgt(f'{rate("stagecache_transfer_dma_seconds_sum", _SPLIT)} / '
         f'{rate("stagecache_transfers_total", _SPLIT)}', "{{direction}} DMA", "B")],
    unit="s", custom={"fillOpacity": 40}))
panels[-1].update({"repeat": "pp_rank", "repeatDirection": "v", "maxPerRow": 1})
panels[-1]["fieldConfig"]["overrides"] = [
    {"matcher": {"id": "byRegexp", "options": f"^{d} .*"},
     "properties": [{"id": "custom.stacking", "value": {"mode": "normal", "group": d}}]}
    for d in ("d2h", "h2d")]
panels.append(ts("Bytes/s by pool kind",
    "rate of stagecache_transfer_bytes_total by direction and pool kind: which KV pools the host "
    "tier traffic is made of (pool `all`: a source without a per-kind split).",
    (0, 87, 12, 8),
    [tgt(rate("stagecache_transfer_bytes_total", "direction, pool"), "{{direction}} {{pool}}")],
    unit="Bps", custom=STACK))
panels.append(ts("Copy bandwidth by pool kind",
    "bytes / DMA seconds per stage, direction and pool kind (recording rule). A stage move copies "
    "every kind in one launch whose DMA time is split by bytes, so there every kind shows the "
    "launch's bandwidth; a kind moved on its own shows its own.",
    (12, 87, 12, 8),
    [tgt(f"stagecache:transfer_pool_bandwidth_bytes_per_second:rate1m{S}",
         "stage {{pp_rank}} {{direction}} {{pool}}")],
    unit="Bps"))
# -- host-tier sanity and pool occupancy (their own band of rows, from y=120) ------------------------
HT = 120
panels.append(row("Host tier and pool occupancy", HT))
panels.append(panel(
    "stat", "Host tier status per stage",
    "stagecache_host_tier_status (a state set): the statuses that hold per stage. exceeds_ram "
    "(MemAvailable under the reserve the host tiers must leave free) makes /readyz 503; "
    "smaller_than_device (host pages < device pages) and pin_refused (pageable fallback) are "
    "warnings in /readyz's detail.",
    (0, HT + 1, 10, 6),
    [tgt(f"max by (pp_rank, stagecache_host_tier_status) (stagecache_host_tier_status{S}) == 1",
         "stage {{pp_rank}}: {{stagecache_host_tier_status}}")],
    extra_defaults={"color": {"mode": "fixed", "fixedColor": "green"}},
    options={**STAT_OPTS, "colorMode": "background", "textMode": "name"}))
panels[-1]["fieldConfig"]["overrides"] = [
    {"matcher": {"id": "byRegexp", "options": f".*{status}.*"},
     "properties": [{"id": "color", "value": {"mode": "fixed", "fixedColor": colour}}]}
    for status, colour in (("exceeds_ram", "red"), ("smaller_than_device", "orange"),
                           ("pin_refused", "orange"))]
panels.append(ts("Host RAM available vs reserve",
    "stagecache_host_memory_available_bytes (MemAvailable, re-read by each stage every few "
    "seconds) against stagecache_host_memory_reserve_bytes: below the reserve the host tier "
    "status turns exceeds_ram.",
    (10, HT + 1, 14, 6),
    [tgt(f"max by (pp_rank) (stagecache_host_memory_available_bytes{S})", "stage {{pp_rank}} available", "A"),
     tgt(f"max by (pp_rank) (stagecache_host_memory_reserve_bytes{S})", "stage {{pp_rank}} reserve", "B")],
    unit="bytes"))
panels.append(merged_table(
    "Pool occupancy per stage (pool kind x tier)",
    "stagecache_pool_usage_ratio: used / capacity of each pool kind's own space (pages; request "
    "slots for c128_state), device and host, with its peak. Ratios and pages are per pool: kinds "
    "of one page-id space show the same pages, so never sum them over pools.",
    (0, HT + 7, 14, 12),
    [(f"stagecache_pool_usage_ratio{S}", "used"), (f"stagecache_pool_peak_usage_ratio{S}", "peak"),
     (f"stagecache_pool_used_bytes{S}", "used bytes")],
    ("pp_rank", "pool", "tier"), hide=("model_name",)))
panels[-1]["fieldConfig"]["overrides"] = [
    {"matcher": {"id": "byName", "options": name},
     "properties": [{"id": "unit", "value": "percentunit"}, {"id": "min", "value": 0},
                    {"id": "max", "value": 1},
                    {"id": "custom.cellOptions", "value": {"type": "gauge", "mode": "gradient"}},
                    {"id": "thresholds", "value": {"mode": "absolute", "steps": [
                        {"color": "green", "value": None}, {"color": "orange", "value": 0.8},
                        {"color": "red", "value": 0.95}]}}]}
    for name in ("used", "peak")] + [
    {"matcher": {"id": "byName", "options": "used bytes"},
     "properties": [{"id": "unit", "value": "bytes"}]}]
panels.append(ts("Pool bytes used by tier",
    "sum of stagecache_pool_used_bytes (each pool kind's own bytes: these sum) against "
    "stagecache_pool_bytes (what the pools hold), per stage and tier.",
    (14, HT + 7, 10, 12),
    [tgt(f"sum by (pp_rank, tier) (stagecache_pool_used_bytes{S})", "stage {{pp_rank}} {{tier}} used", "A"),
     tgt(f"sum by (pp_rank, tier) (stagecache_pool_bytes{S})", "stage {{pp_rank}} {{tier}} capacity", "B")],
    unit="bytes"))
# -- stage agreement, miss reasons and tier lifetimes (their own band of rows, from y=140) --------
panels += insight_panels(140)

dash = {
    "uid": "stagecache", "title": "stagecache: PP stage-local KV cache",
    "description": "Per-stage mapping status, host hit rate, transfers and pools of stagecache serve "
                   "(one /metrics endpoint, all stages via the `pp_rank` label).",
    "tags": ["stagecache", "kv-cache", "pipeline-parallel"],
    "schemaVersion": 39, "version": 1, "editable": True, "graphTooltip": 1,
    "time": {"from": "now-15m", "to": "now"}, "refresh": "5s", "timezone": "browser",
    "timepicker": {"refresh_intervals": ["5s", "10s", "30s", "1m", "5m"]},
    "annotations": {"list": [{"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                              "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
                              "name": "Annotations & Alerts", "type": "dashboard"}]},
    "templating": {"list": [{
        "name": "pp_rank", "label": "pp_rank (stage)", "type": "query", "datasource": DS,
        "definition": "label_values(stagecache_stage_local_layers, pp_rank)",
        "query": {"query": "label_values(stagecache_stage_local_layers, pp_rank)",
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
