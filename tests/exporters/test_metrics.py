"""The Prometheus collector over a SnapshotSource: names, labels, values, conventions, promtool."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from live_helpers import blank_live
from metric_samples import sample_value, series_by_name
from plans import report as plan_report
from prometheus_client import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.parser import text_string_to_metric_families
from stagecache.exporters.families import (
    LABEL_VALUES,
    LABELS,
    STAGE_LABELS,
    all_families,
    label_names,
)
from stagecache.exporters.metrics import METRIC_NAMES, make_registry
from stagecache.runtime.live.numbers import StageLive
from stagecache.runtime.live.source import StaticSource
from stagecache.runtime.model.families import load_spec
from stagecache.runtime.model.families.deepseek_v4 import POOLS
from stagecache.runtime.transfer.stats import TransferStats
from stagecache.runtime.validation.report import StartupReport

TINY = load_spec("tiny-v4")


def source_of(rep, stages=None) -> StaticSource:
    """A static source over a report and live numbers given as the JSON a stage writes."""
    return StaticSource(rep, {k: StageLive.model_validate(v) for k, v in (stages or {}).items()})


def report(faults=()):
    return plan_report(TINY, 4, list(faults))


def live(stage: int, scale: int = 1) -> dict:
    d = blank_live(stage, POOLS)
    d.update(
        model_name="tiny-v4", phase="serving", steps=5 * scale, requests=20 * scale, total_requests=64,
        cache_tokens={"device": 1000 * scale, "host": 300 * scale, "storage": 100 * scale,
                      "miss": 700 * scale},
        evictions={"device": 7, "host": 2},
        cache_pages={"backup": 11, "load": 4, "dropped": 1, "backup_skipped": 3},
        transfer_bytes={"d2h": 4096 * scale, "h2d": 2048 * scale},
        transfer_seconds={"d2h": 0.002, "h2d": 0.001},
        transfer_count={"d2h": 3, "h2d": 2},
        page_spaces={"device": {"tier": "device", "used": 10, "total": 64, "pools": list(POOLS)},
                     "host": {"tier": "host", "used": 30, "total": 128, "pools": ["swa", "c4"]}},
        pool_bytes={"swa": {"device": 1 << 20, "host": 2 << 20}},
        stage_seconds=1.5, bubble_seconds=0.5, activation_bytes_sent=100 * (3 - stage),
        activation_bytes_received=100 * stage,
    )
    d["l3"] = {"backend": "file", "prefetched_tokens": 256 * scale, "backuped_tokens": 512 * scale,
               "bytes": {"prefetch": 4096, "backup": 8192}, "seconds": {"prefetch": 0.01, "backup": 0.02},
               "errors": {"corrupt": 1, "failed": 0, "no_space": 0},
               "prefetch_bandwidth": {"le": [1.0, 2.0], "counts": [1, 2, 2], "sum": 2.5}}
    # host-tier sanity and pool occupancy
    d["host_tier"] = {"status": ["smaller_than_device"] if stage == 1 else ["ok"], "reasons": ["r"],
                      "mem_available_bytes": 8 << 30, "reserve_bytes": 1 << 30}
    d["pool_occupancy"] = [
        {"pool": "swa", "tier": "device", "unit": "page", "used": 10, "capacity": 64, "peak": 12,
         "used_bytes": 10 << 10, "capacity_bytes": 64 << 10},
        {"pool": "swa", "tier": "host", "unit": "page", "used": 30, "capacity": 128, "peak": 30,
         "used_bytes": 30 << 10, "capacity_bytes": 128 << 10},
        {"pool": "c128_state", "tier": "device", "unit": "slot", "used": 0, "capacity": 4, "peak": 4,
         "used_bytes": 0, "capacity_bytes": 4 << 12},
    ]
    return d


def scrape(source) -> str:
    return generate_latest(make_registry(source)).decode()


def full_scrape() -> dict[str, list]:
    source = source_of(report(), {s: live(s) for s in range(4)})
    source.write_failures = 2  # what a serving parent's source (RunDirSource) also counts
    source.divergence = _diverged  # what the sglang endpoint's source also compares
    return series_by_name(scrape(source))


def _diverged():
    """Two ranks' records, one request on which rank 1 found less on the host, one backup without
    its indexer."""
    from stagecache.runtime.live.divergence import DivergenceTracker, IncompleteBackup, RankBatch

    t = DivergenceTracker(2)
    t.add(0, RankBatch(requests=[("r1", 256, 256)], steps=[(1, 1, 0, 1, 0)]))
    bad = IncompleteBackup(time=1.0, stage=1, direction="d2h", page=3, pages=1, missing=["indexer"],
                           expected_bytes=10, got_bytes=8)
    t.add(1, RankBatch(requests=[("r1", 256, 0)], steps=[(1, 1, 0, 1, 0)], backups=[bad]))
    return t.live()


def test_every_family_is_exposed_with_sglang_stage_labels():
    smp = full_scrape()
    for name in METRIC_NAMES:
        assert any(n == name or n.startswith(name + "_") for n in smp), name
    stage_families = {f.name for scope, f in all_families() if scope in ("startup", "live")}
    for name, samples in smp.items():
        if not any(name == f or name.startswith(f + "_") for f in stage_families):
            continue
        assert {s.labels["pp_rank"] for s in samples} == {"0", "1", "2", "3"}, name
        assert {s.labels["model_name"] for s in samples} == {"tiny-v4"}, name
        assert {s.labels["tp_rank"] for s in samples} == {"0"}, name
    assert not any("stage" in s.labels for samples in smp.values() for s in samples)


def test_the_pp_agreement_families_exist_only_where_ranks_are_compared():
    """A ``serve`` run (its own per-request agreement) exposes none of them, not even empty."""
    plain = series_by_name(scrape(source_of(report(), {s: live(s) for s in range(2)})))
    assert not any(n.startswith(("stagecache_pp_", "stagecache_hicache_incomplete")) for n in plain)
    smp = full_scrape()
    div = {s.labels["quantity"]: s.value for s in smp["stagecache_pp_divergence_total"]}
    agree = {s.labels["quantity"]: s.value for s in smp["stagecache_pp_agreement_total"]}
    assert div["host_hit_length"] == 1 and div["device_prefix_len"] == 0 and agree["device_prefix_len"] == 1
    assert agree["load_acks"] == 1 and div["load_acks"] == 0
    assert {s.labels["pool"]: s.value for s in smp["stagecache_hicache_incomplete_transfers_total"]} == {"indexer": 1}


def test_every_label_has_one_documented_meaning_and_closed_values():
    smp = full_scrape()
    for name, samples in smp.items():
        for s in samples:
            for label, value in s.labels.items():
                if label == "le":
                    continue
                assert label in LABELS, (name, label)
                if label in LABEL_VALUES:
                    assert value in LABEL_VALUES[label], (name, label, value)
    # the "miss" tier is gone: a tier is where memory lives, a miss is no tier
    assert all(s.labels.get("tier") != "miss" for samples in smp.values() for s in samples)
    # direction means a host<->device copy wherever it appears
    directions = {s.labels["direction"] for samples in smp.values() for s in samples if "direction" in s.labels}
    assert directions == {"d2h", "h2d"}


def test_the_registry_matches_the_family_table():
    source = source_of(report(), {s: live(s) for s in range(4)})
    source.divergence = _diverged
    text = generate_openmetrics(make_registry(source))
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_parse

    got = {f.name: f for f in om_parse(text.decode())}
    for scope, fam in all_families():
        base = fam.name.removesuffix("_total") if fam.kind == "counter" else fam.name
        base = base.removesuffix("_info") if fam.kind == "info" else base
        metric = got[base]
        assert metric.type == fam.kind, fam.name
        labels = {k for s in metric.samples for k in s.labels} - {"le"}
        assert labels == set(label_names(scope, fam)), fam.name


def test_counters_for_everything_cumulative_gauges_for_states():
    source = source_of(report(), {0: live(0)})
    source.divergence = _diverged  # the sglang endpoint's families too
    text = scrape(source)
    types = {f.name: f.type for f in text_string_to_metric_families(text)}
    for name in METRIC_NAMES:
        if name.endswith("_total"):
            assert types[name[: -len("_total")]] == "counter", name
    assert types["stagecache_transfer_dma_seconds"] == types["stagecache_transfer_queue_wait_seconds"] == "histogram"
    cumulative = ("prefix_lookup_tokens", "prefix_hit_tokens", "transfer_bytes", "requests",
                  "evicted_pages", "bubble_seconds", "busy_seconds")
    for part in cumulative:
        assert any(part in n and n.endswith("_total") for n in METRIC_NAMES), part
    # no since-start ratio or mean bandwidth gauge: those are rate() in recording rules (sglang's
    # storage bandwidths are histograms of one observation per batch: kept under their names)
    assert not any(("hit_ratio" in n or "bandwidth" in n) and types[n] != "histogram"
                   for n in METRIC_NAMES)
    assert types["stagecache_prefetch_bandwidth"] == types["stagecache_backup_bandwidth"] == "histogram"
    assert not any("millis" in n or "_ms" in n or "kib" in n.lower() for n in METRIC_NAMES)


def test_startup_values_come_from_the_report():
    smp = series_by_name(scrape(source_of(report(["global-swa"]))))
    for st in "0123":
        assert sample_value(smp, "stagecache_stage_local_layers", pp_rank=st) == 3
        assert sample_value(smp, "stagecache_stage_buffers", pp_rank=st, pool="swa") == 12
        assert sample_value(smp, "stagecache_stage_expected_buffers", pp_rank=st, pool="swa") == 3
        assert sample_value(smp, "stagecache_stage_mapping_ok", pp_rank=st) == 0
        assert sample_value(smp, "stagecache_stage_mapping_errors", pp_rank=st) == 1
    assert sample_value(smp, "stagecache_startup_ok", model_name="tiny-v4") == 0
    ok = series_by_name(scrape(source_of(report())))
    assert sample_value(ok, "stagecache_startup_ok") == 1
    assert sample_value(ok, "stagecache_stage_mapping_ok", pp_rank="1") == 1
    assert sample_value(ok, "stagecache_stage_buffers", pp_rank="1", pool="c128") == 2


def test_build_and_model_info():
    from stagecache import runtime

    smp = series_by_name(scrape(source_of(report())))
    (build,) = smp["stagecache_build_info"]
    assert build.labels == {"version": runtime.__version__} and build.value == 1
    (model,) = smp["stagecache_model_info"]
    assert model.labels == {"model_name": "tiny-v4", "pp_size": "4", "tp_size": "1", "page_size": "256",
                            "num_layers": "12"}


def test_pool_names_come_from_the_data_not_a_fixed_list():
    raw = report().to_dict()
    for s in raw["stages"]:  # a pool kind this package has never heard of
        s["buffers"]["mystery"] = s["expected_buffers"]["mystery"] = 2
    d = live(0)
    d["pool_bytes"]["mystery"] = {"device": 5, "host": 6}
    smp = series_by_name(scrape(source_of(StartupReport.model_validate(raw), {0: d})))
    assert sample_value(smp, "stagecache_stage_buffers", pp_rank="2", pool="mystery") == 2
    assert sample_value(smp, "stagecache_pool_bytes", pp_rank="0", pool="mystery", tier="host") == 6


def test_shared_page_space_is_counted_once():
    smp = full_scrape()
    used = [s for s in smp["stagecache_page_space_used_pages"] if s.labels["pp_rank"] == "0"]
    assert {(s.labels["space"], s.labels["tier"], s.value) for s in used} == {
        ("device", "device", 10), ("host", "host", 30)}  # one series per space, not per pool
    assert sample_value(smp, "stagecache_page_space_capacity_pages", pp_rank="0", space="device") == 64
    assert sample_value(smp, "stagecache_page_space_usage_ratio", pp_rank="0", space="host") == 30 / 128
    pools = {(s.labels["pool"], s.labels["space"]) for s in smp["stagecache_pool_page_space_info"]
             if s.labels["pp_rank"] == "0"}
    assert pools == {(p, "device") for p in POOLS} | {("swa", "host"), ("c4", "host")}


def test_no_report_yet_means_no_startup_samples_but_live_numbers_still_export():
    smp = series_by_name(scrape(source_of(None, {2: live(2)})))
    assert "stagecache_startup_ok" not in smp and "stagecache_stage_local_layers" not in smp
    assert "stagecache_model_info" not in smp and "stagecache_build_info" in smp
    assert sample_value(smp, "stagecache_prefix_hit_tokens_total", pp_rank="2", tier="host") == 300


def test_live_values_per_stage_and_label():
    smp = series_by_name(scrape(source_of(report(), {0: live(0), 1: live(1, scale=2)})))
    assert sample_value(smp, "stagecache_prefix_lookup_tokens_total", pp_rank="1") == 4200
    assert sample_value(smp, "stagecache_prefix_hit_tokens_total", pp_rank="1", tier="device") == 2000
    assert sample_value(smp, "stagecache_prefix_hit_tokens_total", pp_rank="1", tier="storage") == 200
    # L3: sglang's storage metric names, with its storage_backend label and pp_rank
    assert sample_value(smp, "stagecache_storage_prefetch_hit_tokens_total", pp_rank="1",
                        storage_backend="file") == 200
    assert sample_value(smp, "stagecache_prefetched_tokens_total", pp_rank="1") == 512
    assert sample_value(smp, "stagecache_backuped_tokens_total", pp_rank="0") == 512
    assert sample_value(smp, "stagecache_l3_bytes_total", pp_rank="0", l3_direction="backup") == 8192
    assert sample_value(smp, "stagecache_l3_errors_total", pp_rank="0", error="corrupt") == 1
    assert sample_value(smp, "stagecache_l3_up", pp_rank="0") == 1
    assert sample_value(smp, "stagecache_prefetch_bandwidth_count", pp_rank="0") == 2
    assert sample_value(smp, "stagecache_transfer_bytes_total", pp_rank="0", direction="h2d") == 2048
    assert sample_value(smp, "stagecache_pool_bytes", pp_rank="0", pool="swa", tier="host") == 2 << 20
    assert sample_value(smp, "stagecache_evicted_pages_total", pp_rank="0", tier="device") == 7
    assert sample_value(smp, "stagecache_hicache_pages_total", pp_rank="0", operation="backup_skip") == 3
    assert sample_value(smp, "stagecache_stage_bubble_seconds_total", pp_rank="1") == 0.5
    assert sample_value(smp, "stagecache_micro_batches_total", pp_rank="1") == 10
    assert sample_value(smp, "stagecache_activation_sent_bytes_total", pp_rank="0") == 300
    assert sample_value(smp, "stagecache_activation_received_bytes_total", pp_rank="1") == 100
    assert sample_value(smp, "stagecache_stage_planned_requests", pp_rank="0") == 64
    phases = {s.labels["stagecache_stage_phase"]: s.value for s in smp["stagecache_stage_phase"]
              if s.labels["pp_rank"] == "0"}
    assert phases["serving"] == 1 and sum(phases.values()) == 1
    # a source without a per-kind split (the sglang hooks): its totals as pool "all", the
    # histogram without buckets still has the count (+Inf) and the sum
    h = "stagecache_transfer_dma_seconds"
    assert sample_value(smp, "stagecache_transfer_bytes_total", pp_rank="0", direction="h2d", pool="all") == 2048
    assert sample_value(smp, h + "_count", pp_rank="0", direction="d2h", pool="all") == 3
    assert sample_value(smp, h + "_bucket", pp_rank="0", direction="d2h", pool="all", le="+Inf") == 3
    assert sample_value(smp, h + "_sum", pp_rank="0", direction="d2h", pool="all") == 0.002
    assert sample_value(smp, "stagecache_transfers_total", pp_rank="0", direction="d2h") == 3


def test_histogram_buckets_come_from_transfer_stats():
    stats = TransferStats()
    kinds = (("swa", 3000), ("c4", 1000))  # DMA time split 3:1 by bytes
    for secs in (0.00005, 0.0003, 0.0003, 0.02, 3.0):
        stats.record("d2h", 4000, secs, 1, queue_seconds=secs / 2, kinds=kinds)
    d = live(0)
    d.update(stats.live().model_dump())
    smp = series_by_name(scrape(source_of(report(), {0: d})))
    h = "stagecache_transfer_dma_seconds_bucket"
    # swa's shares: 37.5 us, 225 us, 225 us, 15 ms, 2.25 s
    assert sample_value(smp, h, pp_rank="0", direction="d2h", pool="swa", le="5e-05") == 1
    assert sample_value(smp, h, pp_rank="0", direction="d2h", pool="swa", le="0.00025") == 3
    assert sample_value(smp, h, pp_rank="0", direction="d2h", pool="swa", le="0.025") == 4
    assert sample_value(smp, h, pp_rank="0", direction="d2h", pool="swa", le="2.5") == 5
    # c4's shares: 12.5 us, 75 us, 75 us, 5 ms, 0.75 s
    assert sample_value(smp, h, pp_rank="0", direction="d2h", pool="c4", le="2.5e-05") == 1
    assert sample_value(smp, h, pp_rank="0", direction="d2h", pool="c4", le="0.0001") == 3
    assert sample_value(smp, h, pp_rank="0", direction="d2h", pool="c4", le="1.0") == 5
    # queue wait: the whole wait for every kind (25 us, 150 us, 150 us, 10 ms, 1.5 s)
    q = "stagecache_transfer_queue_wait_seconds_bucket"
    for pool in ("swa", "c4"):
        assert sample_value(smp, q, pp_rank="0", direction="d2h", pool=pool, le="2.5e-05") == 1
        assert sample_value(smp, q, pp_rank="0", direction="d2h", pool=pool, le="0.01") == 4
        assert sample_value(smp, q, pp_rank="0", direction="d2h", pool=pool, le="+Inf") == 5
    dma_sum = sum(sample_value(smp, "stagecache_transfer_dma_seconds_sum", pp_rank="0", direction="d2h", pool=p)
                  for p in ("swa", "c4"))
    assert dma_sum == pytest.approx(0.00005 + 0.0003 + 0.0003 + 0.02 + 3.0)
    assert sample_value(smp, "stagecache_transfer_bytes_total", pp_rank="0", direction="d2h", pool="swa") == 15000
    assert sample_value(smp, "stagecache_transfers_total", pp_rank="0", direction="d2h") == 5
    assert "all" not in {s.labels["pool"] for s in smp["stagecache_transfer_bytes_total"]}


def test_the_source_is_read_on_every_scrape():
    class Growing:
        write_failures = None

        def __init__(self):
            self.n = 0

        def startup(self):
            return None

        def run(self):
            return None

        def stages(self):
            self.n += 1
            d = live(0)
            d["requests"] = self.n
            return {0: StageLive.model_validate(d)}

    registry = make_registry(Growing())
    first = series_by_name(generate_latest(registry).decode())
    second = series_by_name(generate_latest(registry).decode())
    name = "stagecache_requests_total"
    assert sample_value(second, name, pp_rank="0") > sample_value(first, name, pp_rank="0")


def test_stage_labels_are_sglangs():
    assert STAGE_LABELS == ("model_name", "pp_rank", "tp_rank")


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_promtool_lints_the_exposition_clean():
    text = scrape(source_of(report(), {s: live(s) for s in range(4)}))
    r = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), r.stdout + r.stderr
