"""The Prometheus collector over a SnapshotSource: names, labels, values, promtool lint."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from stagecache.exporters.metrics import METRIC_NAMES, make_registry
from stagecache.exporters.snapshot import StaticSource, empty_stage_numbers
from stagecache.runtime.model.layer_map import build_layout
from stagecache.runtime.model.pool_kinds import POOLS
from stagecache.runtime.model.spec import load_spec
from stagecache.runtime.transfer.stats import TransferStats
from stagecache.runtime.validation.faults import parse_faults
from stagecache.runtime.validation.report import preflight

TINY = load_spec("tiny-v4")


def report(faults=()):
    return preflight(build_layout(TINY, 4), 256, parse_faults(list(faults), 4)).to_dict()


def live(stage: int, scale: int = 1) -> dict:
    d = empty_stage_numbers(stage, POOLS)
    d.update(
        steps=5 * scale, requests=20 * scale,
        cache_tokens={"device": 1000 * scale, "host": 300 * scale, "miss": 700 * scale},
        host_hit_ratio=0.15,
        evictions={"device": 7, "host": 2},
        transfer_bytes={"d2h": 4096 * scale, "h2d": 2048 * scale},
        transfer_seconds={"d2h": 0.002, "h2d": 0.001},
        transfer_count={"d2h": 3, "h2d": 2},
        bandwidth_bytes_per_second={"d2h": 2048e3 * scale, "h2d": 2048e3 * scale},
        pool_pages={"swa": {"used": 10, "free": 54}},
        pool_bytes={"swa": {"device": 1 << 20, "host": 2 << 20}},
        stage_seconds=1.5, bubble_seconds=0.5,
    )
    return d


def scrape(source) -> str:
    return generate_latest(make_registry(source)).decode()


def by_name(text: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


def one(smp, name, **labels) -> float:
    hits = [s.value for s in smp.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(hits) == 1, (name, labels, hits)
    return hits[0]


def test_every_family_is_exposed_with_stage_labels():
    smp = by_name(scrape(StaticSource(report(), {s: live(s) for s in range(4)})))
    for name in METRIC_NAMES:
        assert any(n == name or n.startswith(name + "_") for n in smp), name
    for name, samples in smp.items():
        if name in ("stagecache_startup_ok", "stagecache_cross_stage_errors"):
            continue
        assert {s.labels["stage"] for s in samples} == {"0", "1", "2", "3"}, name


def test_counters_end_in_total_and_units_are_base_units():
    text = scrape(StaticSource(report(), {0: live(0)}))
    types = {f.name: f.type for f in text_string_to_metric_families(text)}
    for name in METRIC_NAMES:
        if name.endswith("_total"):
            assert types[name[: -len("_total")]] == "counter", name
    assert types["stagecache_transfer_seconds"] == "histogram"
    assert not any("millis" in n or "_ms" in n or "kib" in n.lower() for n in METRIC_NAMES)


def test_startup_values_come_from_the_report():
    smp = by_name(scrape(StaticSource(report(["global-swa"]))))
    for st in "0123":
        assert one(smp, "stagecache_stage_local_layers", stage=st) == 3
        assert one(smp, "stagecache_stage_buffers", stage=st, pool="swa") == 12
        assert one(smp, "stagecache_stage_expected_buffers", stage=st, pool="swa") == 3
        assert one(smp, "stagecache_stage_mapping_ok", stage=st) == 0
        assert one(smp, "stagecache_stage_mapping_errors", stage=st) == 1
    assert one(smp, "stagecache_startup_ok") == 0
    ok = by_name(scrape(StaticSource(report())))
    assert one(ok, "stagecache_startup_ok") == 1
    assert one(ok, "stagecache_stage_mapping_ok", stage="1") == 1
    assert one(ok, "stagecache_stage_buffers", stage="1", pool="c128") == 2


def test_no_report_yet_means_no_startup_samples_but_live_numbers_still_export():
    smp = by_name(scrape(StaticSource(None, {2: live(2)})))
    assert "stagecache_startup_ok" not in smp and "stagecache_stage_local_layers" not in smp
    assert one(smp, "stagecache_cache_tokens_total", stage="2", tier="host") == 300


def test_live_values_per_stage_and_label():
    smp = by_name(scrape(StaticSource(report(), {0: live(0), 1: live(1, scale=2)})))
    assert one(smp, "stagecache_cache_tokens_total", stage="1", tier="miss") == 1400
    assert one(smp, "stagecache_transfer_bytes_total", stage="0", direction="h2d") == 2048
    assert one(smp, "stagecache_transfer_bandwidth_bytes_per_second", stage="1", direction="d2h") == 4096e3
    assert one(smp, "stagecache_pool_pages", stage="0", pool="swa", state="free") == 54
    assert one(smp, "stagecache_pool_bytes", stage="0", pool="swa", tier="host") == 2 << 20
    assert one(smp, "stagecache_host_hit_ratio", stage="0") == 0.15
    assert one(smp, "stagecache_evictions_total", stage="0", tier="device") == 7
    assert one(smp, "stagecache_stage_bubble_seconds_total", stage="1") == 0.5
    # without reported buckets the histogram still has the count (+Inf) and the sum
    assert one(smp, "stagecache_transfer_seconds_count", stage="0", direction="d2h") == 3
    assert one(smp, "stagecache_transfer_seconds_bucket", stage="0", direction="d2h", le="+Inf") == 3
    assert one(smp, "stagecache_transfer_seconds_sum", stage="0", direction="d2h") == 0.002


def test_histogram_buckets_come_from_transfer_stats():
    stats = TransferStats()
    for secs in (0.00005, 0.0003, 0.0003, 0.02, 3.0):
        stats.record("d2h", 1000, secs, 1)
    snap = stats.snapshot()
    d = live(0)
    d["transfer_count"] = {"d2h": 5, "h2d": 0}
    d["transfer_seconds"] = {"d2h": snap["d2h"]["seconds"], "h2d": 0.0}
    d["transfer_seconds_buckets"] = {"le": snap["buckets_s"], "d2h": snap["d2h"]["bucket_counts"],
                                     "h2d": snap["h2d"]["bucket_counts"]}
    smp = by_name(scrape(StaticSource(report(), {0: d})))
    assert one(smp, "stagecache_transfer_seconds_bucket", stage="0", direction="d2h", le="0.0001") == 1
    assert one(smp, "stagecache_transfer_seconds_bucket", stage="0", direction="d2h", le="0.0005") == 3
    assert one(smp, "stagecache_transfer_seconds_bucket", stage="0", direction="d2h", le="0.025") == 4
    assert one(smp, "stagecache_transfer_seconds_bucket", stage="0", direction="d2h", le="2.5") == 4
    assert one(smp, "stagecache_transfer_seconds_bucket", stage="0", direction="d2h", le="+Inf") == 5
    assert one(smp, "stagecache_transfer_seconds_count", stage="0", direction="d2h") == 5


def test_the_source_is_read_on_every_scrape():
    class Growing:
        def __init__(self):
            self.n = 0

        def startup(self):
            return None

        def stages(self):
            self.n += 1
            d = live(0)
            d["requests"] = self.n
            return {0: d}

    registry = make_registry(Growing())
    first = by_name(generate_latest(registry).decode())
    second = by_name(generate_latest(registry).decode())
    assert one(second, "stagecache_requests_total", stage="0") > one(first, "stagecache_requests_total", stage="0")


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_promtool_lints_the_exposition_clean():
    text = scrape(StaticSource(report(), {s: live(s) for s in range(4)}))
    r = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), r.stdout + r.stderr
