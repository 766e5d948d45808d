"""``stagecache bench http`` end to end on a small scale: the figures it reports are all there.

No latency is asserted here (speed is the benchmark's job); a short run checks
that every request is counted, that no response is an error on a healthy server,
and that the idle keep-alive connection is seen closed.
"""

from __future__ import annotations

import json

from live_helpers import blank_live
from plans import report as plan_report
from stagecache.dashboard.server import dashboard_in_thread
from stagecache.runtime.bench.http_load import HttpBenchOptions, percentiles, run_bench
from stagecache.runtime.cli.main import main
from stagecache.runtime.live.numbers import StageLive
from stagecache.runtime.live.source import StaticSource
from stagecache.runtime.model.families.deepseek_v4 import POOLS


def test_percentiles_are_nearest_rank():
    xs = [float(i) for i in range(1, 101)]
    p = percentiles(xs)
    assert (p["p50_ms"], p["p90_ms"], p["p99_ms"], p["max_ms"], p["mean_ms"]) == (50, 90, 99, 100, 50.5)


def test_bench_http_counts_every_request_over_every_route(free_port, tmp_path, capsys):
    report = plan_report("tiny-v4", 2)
    source = StaticSource(report, {k: StageLive.model_validate(blank_live(k, POOLS)) for k in range(2)})
    with dashboard_in_thread(source, port=free_port) as url:
        res = run_bench(HttpBenchOptions(url=url, clients=3, requests=90, idle_requests=20,
                                         while_serving=False, baseline=False, keep_alive_check=False))
        code = main(["bench", "http", "--url", url, "--clients", "2", "--requests", "10",
                     "--idle-requests", "5", "--no-baseline", "--no-keep-alive-check",
                     "--out", str(tmp_path / "out.json")])
    load = res["load"]
    assert load["requests"] == 90 and load["errors"] == 0 and load["status_counts"] == {"200": 90}
    assert set(load["per_path"]) == {"/healthz", "/metrics", "/api/startup", "/api/stages",
                                     "/api/metrics/summary", "/api/stages/0/layer-map",
                                     "/api/stages/1/layer-map"}
    assert sum(p["requests"] for p in load["per_path"].values()) == 90
    for mode in ("keepalive", "fresh"):
        assert res["idle_healthz"][mode]["requests"] == 20 and res["idle_healthz"][mode]["errors"] == 0
    assert set(res["checks"]) == {"healthz_keepalive_p50", "healthz_keepalive_p99", "healthz_fresh_p50",
                                  "healthz_fresh_p99", "load_errors", "load_p99"}
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads((tmp_path / "out.json").read_text())
    assert code == (0 if printed["ok"] else 1) and printed["load"]["requests"] == 10
