"""A live sglang PP deployment as one instrument, on real sglang 0.5.23 ranks (CPU, gloo, real processes).

Runs in .venv-sglang (test_sglang_venv.py launches it).  Each test is one launch of N real
ranks (tests/support/sglang_ranks.py): sglang's distributed state over gloo, sglang's own
``load_plugins()``, the real DeepSeek-V4-Flash pool (44 ratio entries) sized from a byte budget
by sglang's configurator, and the real ``build_deepseek_v4_hicache_stack`` -- the plan
exchange runs inside it.  All assertions of a case share its one launch.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytest.importorskip("sglang", reason="sglang not installed (runs in .venv-sglang)")

from sglang_ranks import free_port, launch  # noqa: E402

pytestmark = pytest.mark.timeout(240)

EVEN4 = [(0, 10), (10, 21), (21, 32), (32, 43)]


def _wait_ready(url: str, stages: int, deadline_s: float = 30.0) -> httpx.Response:
    """/readyz until every stage pushed (200), bounded."""
    end = time.monotonic() + deadline_s
    while True:
        r = httpx.get(f"{url}/readyz", timeout=2)
        if r.status_code == 200 or time.monotonic() > end:
            return r
        time.sleep(0.2)


def _pp_ranks(metrics: str, family: str) -> dict[str, float]:
    return {s.labels["pp_rank"]: s.value for f in text_string_to_metric_families(metrics)
            for s in f.samples if s.name == family}


def _sglang_traffic_on_rank_1(ctx: dict[str, Any]) -> dict[str, Any]:
    """Rank 1 uses its real host pool and sglang's (hooked) ``UnifiedRadixCache.match_prefix``;
    sglang's own ``_log_hicache_stats`` says how many host tokens are in use."""
    from array import array
    from types import SimpleNamespace

    from sglang.srt.managers.scheduler_components.metrics_reporter import SchedulerMetricsReporter
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams, MatchResult
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    group = ctx["stack"][0]
    assert group.alloc(3 * group.page_size) is not None  # 3 host pages taken, as a backup would
    result = MatchResult(device_prefix_len=512, last_device_node=None, last_host_node=None,
                         best_match_node=None, host_hit_length=256)
    cache = SimpleNamespace(session=SimpleNamespace(try_match_prefix=lambda params: result))
    params = MatchPrefixParams(key=RadixKey(array("l", range(1024))), req=SimpleNamespace(rid="r1"))
    for _ in range(2):  # the same waiting request matched twice: counted once
        assert UnifiedRadixCache.match_prefix(cache, params) is result
    hooked = hasattr(UnifiedRadixCache.match_prefix, "__wrapped__")
    reporter = SimpleNamespace(stats=SimpleNamespace(), scheduler=SimpleNamespace(
        enable_hierarchical_cache=True, tree_cache=SimpleNamespace(token_to_kv_pool_host=group)))
    SchedulerMetricsReporter._log_hicache_stats(reporter)
    return {"hooked": hooked, "sglang_host_used_tokens": reporter.stats.hicache_host_used_tokens,
            "sglang_host_total_tokens": reporter.stats.hicache_host_total_tokens}


def _backup_and_load(ctx: dict[str, Any], rank: int, pages: int) -> dict[str, Any]:
    """sglang's real ``HybridCacheController`` backs up ``pages`` pages of the rank's C4, indexer
    and C128 pools to its host pools and loads them back (``write`` / ``start_writing``, ``load`` /
    ``start_loading``, real copies); sglang's own ``writing_check`` / ``loading_check`` consume the
    acks and count them into sglang's ``RadixCacheMetricsCollector``."""
    import torch
    from prometheus_client import REGISTRY
    from sglang.srt.observability.metrics_collector import RadixCacheMetricsCollector
    from sglang_real import AckLedger, round_trip

    group, ctl = ctx["stack"]
    tokens = pages * group.page_size
    src, dst = torch.arange(256, 256 + tokens), torch.arange(256 + tokens, 256 + 2 * tokens)
    round_trip(group, ctl, src, dst, node=1)
    AckLedger(ctl, RadixCacheMetricsCollector(labels={"pp_rank": str(rank)})).drain()
    sglang = {s.name: s.value for f in REGISTRY.collect() for s in f.samples if s.labels.get("pp_rank") == str(rank)}
    return {"sglang_backup_bytes": sglang["sglang:hicache_backup_bytes_total"],
            "sglang_load_bytes": sglang["sglang:load_back_bytes_total"],
            "queues_drained": not ctl.ack_write_queue and not ctl.ack_load_queue}


def _wait_for(url: str, stage: int, check: Any, deadline_s: float = 10.0) -> dict[str, Any]:
    end = time.monotonic() + deadline_s
    while True:
        live = {s["stage"]: s for s in httpx.get(f"{url}/api/metrics/summary", timeout=5).json()["stages"]}
        if check(live.get(stage)) or time.monotonic() > end:
            return live
        time.sleep(0.2)


def _look(port: int, stages: int, traffic: bool = False) -> Any:
    """Rank 0's check of the one endpoint, as an operator would: ready, every stage, metrics."""
    def after(rank: int, ctx: dict[str, Any]) -> dict[str, Any]:
        dep = ctx["deployment"]
        if traffic and rank in (1, 2):  # stage 1 backs up and loads 2 pages, stage 2 one
            moved = {"transfers": _backup_and_load(ctx, rank, pages=3 - rank)}
            return {**moved, "traffic": _sglang_traffic_on_rank_1(ctx)} if rank == 1 else moved
        if rank != 0 and dep is not None and dep.pusher is not None:
            time.sleep(2 * dep.options.push_interval_s)
            return {"pusher": {"url": dep.pusher.url, "failures": dep.pusher.failures,
                               "last_error": dep.pusher.last_error}}
        if rank != 0 or "pools" not in ctx:
            return {}
        if dep is None or dep.url is None:
            return {"look": "no endpoint"}
        url = dep.url
        ready = _wait_ready(url, stages)
        if traffic:
            _wait_for(url, 1, lambda s: s and s["cache_tokens"]["device"] and s["page_spaces"]["host"]["used"]
                      and s["transfer_bytes"]["h2d"])
            _wait_for(url, 2, lambda s: s and s["transfer_bytes"]["h2d"])
        return {"look": {
            "url": url, "ready_status": ready.status_code, "ready": ready.json(),
            "startup": httpx.get(f"{url}/api/startup", timeout=5).json(),
            "summary": httpx.get(f"{url}/api/metrics/summary", timeout=5).json(),
            "page": httpx.get(f"{url}/", timeout=10).text,
            "metrics": httpx.get(f"{url}/metrics", timeout=5).text,
            "healthz": httpx.get(f"{url}/healthz", timeout=5).status_code,
            "startupz": httpx.get(f"{url}/startupz", timeout=5).status_code,
        }}
    return after


def _assert_healthy(run: Any, ranges: list[tuple[int, int]]) -> dict[str, Any]:
    pp = len(ranges)
    assert sorted(run.results) == list(range(pp)), run.results
    for rank, res in run.results.items():
        assert "crash" not in res and "error" not in res, (rank, res)
    look = run.results[0]["look"]
    assert look["ready_status"] == 200, look["ready"]["reasons"]
    assert look["healthz"] == 200 and look["startupz"] == 200
    startup = look["startup"]
    assert startup["ok"] is True and startup["num_layers"] == 43 and startup["pp_size"] == pp
    assert [(s["start_layer"], s["end_layer"]) for s in startup["stages"]] == ranges
    assert all(s["ok"] for s in startup["stages"]) and startup["errors"] == []
    ups = _pp_ranks(look["metrics"], "stagecache_stage_up")
    assert ups == {str(k): 1.0 for k in range(pp)}, ups
    return look


def test_a_healthy_pp4_is_one_endpoint_with_every_stage_and_the_capacity_ledger(tmp_path):
    port = free_port()
    run = launch(tmp_path, 4, common_env={"STAGECACHE_SGLANG_DASHBOARD_PORT": str(port)},
                 after=_look(port, 4, traffic=True))
    look = _assert_healthy(run, EVEN4)
    assert look["url"] == f"http://127.0.0.1:{port}"
    # capacity ledger: each stage alone vs sglang's MIN; stage 0 (10 layers) fits the most
    alone = _pp_ranks(look["metrics"], "stagecache_capacity_tokens_alone")
    tokens = _pp_ranks(look["metrics"], "stagecache_capacity_tokens")
    stranded = _pp_ranks(look["metrics"], "stagecache_capacity_stranded_bytes")
    deployment = min(alone.values())
    assert set(tokens.values()) == {deployment}, (alone, tokens)
    assert alone["0"] > alone["1"], alone  # 10 layers fit more tokens than 11
    for k, n in alone.items():  # the minimum strands nothing; every other stage strands some
        assert (stranded[k] == 0) == (n == deployment), (alone, stranded)
        assert stranded[k] < 48 << 20  # never more than the stage's budget
    stages = {s["stage"]: s for s in look["summary"]["stages"]}
    assert sorted(stages) == [0, 1, 2, 3]
    assert [stages[k]["capacity"]["tokens_alone"] for k in range(4)] == [alone[str(k)] for k in range(4)]
    assert stages[1]["pool_bytes"]["swa"]["device"] > 0  # pushed by rank 1, measured on its tensors
    # sglang's own numbers of rank 1, on rank 0's endpoint: its match results, its host pool use
    traffic = run.results[1]["traffic"]
    assert traffic["hooked"] and traffic["sglang_host_used_tokens"] == (2 + 3) * 256, traffic  # backup + alloc
    one = stages[1]
    assert one["cache_tokens"]["device"] == 512 and one["cache_tokens"]["host"] == 256
    assert one["cache_tokens"]["miss"] == 256 and one["host_hit_ratio"] == 0.25
    host = one["page_spaces"]["host"]
    assert (host["used"], host["total"]) == (traffic["sglang_host_used_tokens"],
                                             traffic["sglang_host_total_tokens"])
    hits = {(s.labels["pp_rank"], s.labels["tier"]): s.value
            for f in text_string_to_metric_families(look["metrics"]) for s in f.samples
            if s.name == "stagecache_prefix_hit_tokens_total"}
    assert hits[("1", "device")] == 512 and hits[("1", "host")] == 256 and hits[("2", "host")] == 0
    # backup and load bytes of sglang's real controller: stagecache's per-stage numbers on rank 0's
    # endpoint equal sglang's own hicache_backup_bytes_total / load_back_bytes_total on each rank
    moved = {k: run.results[k]["transfers"] for k in (1, 2)}
    assert all(m["queues_drained"] for m in moved.values()), moved
    assert moved[1]["sglang_backup_bytes"] == 2 * moved[2]["sglang_backup_bytes"] > 0, moved
    for k, m in moved.items():
        assert stages[k]["transfer_bytes"] == {"d2h": m["sglang_backup_bytes"], "h2d": m["sglang_load_bytes"]}, k
        assert stages[k]["transfer_count"] == {"d2h": 1, "h2d": 1}, k
    exported = {(s.labels["pp_rank"], s.labels["direction"]): s.value
                for f in text_string_to_metric_families(look["metrics"]) for s in f.samples
                if s.name == "stagecache_transfer_bytes_total"}
    assert exported[("1", "d2h")] == moved[1]["sglang_backup_bytes"]
    assert exported[("2", "h2d")] == moved[2]["sglang_load_bytes"]
    assert stages[3]["transfer_bytes"] == {"d2h": 0, "h2d": 0}
    page = look["page"]  # the one page: every stage's layer map and the ledger
    assert 'id="capacity-ledger"' in page and page.count('class="capacity-row') == 4
    for k in range(4):
        assert f'data-stage="{k}"' in page


def test_e_explicit_partition_11_11_11_10_and_a_rank_asking_another_page_size_are_valid_everywhere(tmp_path):
    """An explicit ``SGLANG_PP_LAYER_PARTITION`` on every rank is one healthy deployment, strict
    included.  And sglang 0.5.23 pins DeepSeek-V4's scheduler page to 256 tokens whatever
    ``--page-size`` says, so rank 3 started with ``--page-size 512`` builds the same pool: no
    false alarm.  (A record that does carry another page size is named: test_sglang_live_server.py.)"""
    port = free_port()
    look = _look(port, 4)

    def after(rank: int, ctx: dict[str, Any]) -> dict[str, Any]:
        from sglang.srt.runtime_context import get_schedule, get_server_args

        report = ctx["deployment"].report
        pages = {"asked": get_server_args().page_size, "scheduled": get_schedule().page_size,
                 "ok": report.ok, "page_size": report.page_size}
        return {**(look(rank, ctx) or {}), "pages": pages}

    run = launch(tmp_path, 4, env={3: {"STAGECACHE_TEST_PAGE_SIZE": "512"}},
                 common_env={"STAGECACHE_SGLANG_DASHBOARD_PORT": str(port), "STAGECACHE_SGLANG_STRICT": "1",
                             "SGLANG_PP_LAYER_PARTITION": "11,11,11,10"}, after=after)
    _assert_healthy(run, [(0, 11), (11, 22), (22, 33), (33, 43)])
    assert run.results[3]["pages"]["asked"] == 512 and run.results[0]["pages"]["asked"] is None
    for rank, res in run.results.items():
        pages = res["pages"]
        assert (pages["scheduled"], pages["ok"], pages["page_size"]) == (256, True, 256), (rank, res)


def _break_c4_state_on_rank_2() -> dict[int, dict[str, str]]:
    return {2: {"STAGECACHE_TEST_FAULT": "missing-c4-state"}}


def test_b_the_seed_fault_on_rank_2_makes_every_rank_refuse_naming_stage_2(tmp_path):
    run = launch(tmp_path, 4, env=_break_c4_state_on_rank_2())
    assert sorted(run.results) == [0, 1, 2, 3], run.results
    errors = {r: res.get("error") for r, res in run.results.items()}
    first = errors[0]
    assert first and first.startswith("StageMappingInvalid: 1 mapping error(s)"), errors
    assert "[stage 2] c4_state: deepseek_v4_c4_state state_pools must not contain None" in first
    assert set(errors.values()) == {first}, errors  # the same message on every rank


def test_c_a_rank_with_another_partition_is_a_fingerprint_and_tiling_error(tmp_path):
    run = launch(tmp_path, 4, env={1: {"SGLANG_PP_LAYER_PARTITION": "11,11,11,10"}},
                 common_env={"STAGECACHE_SGLANG_STRICT": "1"})
    errors = {r: res.get("error") for r, res in run.results.items()}
    assert sorted(errors) == [0, 1, 2, 3] and len(set(errors.values())) == 1, errors
    text = errors[0]
    assert "[stage 1] fingerprint: stage 1 runs another deployment than the other stages" in text, text
    assert "partition: (11, 11, 11, 10) != (10, 11, 11, 11)" in text
    assert "gap: layers [10, 11) belong to no stage" in text and "overlap: layers [21, 22)" in text


def _kill_rank_2(port: int) -> Any:
    def after(rank: int, ctx: dict[str, Any]) -> dict[str, Any]:
        if rank != 0:
            return {}
        url = ctx["deployment"].url
        ready = _wait_ready(url, 4)
        if ready.status_code != 200:
            return {"kill": {"not_ready": ready.json()}}
        pid = ctx["deployment"].source.stages()[2].pid
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        while time.monotonic() - killed_at < 15:
            r = httpx.get(f"{url}/readyz", timeout=2)
            if r.status_code == 503:
                return {"kill": {"seconds": time.monotonic() - killed_at, "reasons": r.json()["reasons"],
                                 "pid": pid}}
            time.sleep(0.1)
        return {"kill": {"seconds": None}}
    return after


def test_d_a_killed_rank_turns_readyz_503_naming_it_within_10_s(tmp_path):
    port = free_port()
    run = launch(tmp_path, 4, common_env={"STAGECACHE_SGLANG_DASHBOARD_PORT": str(port)},
                 after=_kill_rank_2(port))
    kill = run.results[0]["kill"]
    print(f"readyz 503 after {kill.get('seconds')} s")
    assert kill.get("seconds") is not None and kill["seconds"] < 10, kill
    assert any(r.startswith("stage 2: crashed: pid ") for r in kill["reasons"]), kill  # seen gone by a rank on its host
    assert not any(r.startswith(("stage 0", "stage 1", "stage 3")) for r in kill["reasons"]), kill
    assert run.exit_codes[2] == -signal.SIGKILL


def test_pp2_without_hicache_exchanges_at_the_kv_pool_build(tmp_path):
    port = free_port()
    run = launch(tmp_path, 2, common_env={"STAGECACHE_SGLANG_DASHBOARD_PORT": str(port)},
                 server={"enable_hierarchical_cache": False}, budget=128 << 20, after=_look(port, 2))
    _assert_healthy(run, [(0, 21), (21, 43)])


def test_a_rank_that_never_reaches_the_exchange_is_named_within_the_timeout(tmp_path):
    """sglang's gloo timeout is 120 min; the exchange's own names the missing rank in seconds."""
    run = launch(tmp_path, 2, env={1: {"STAGECACHE_TEST_SKIP_BUILD": "1"}},
                 common_env={"STAGECACHE_SGLANG_EXCHANGE_TIMEOUT_S": "3"}, budget=128 << 20)
    error = run.results[0]["error"]
    assert error.startswith("ExchangeTimeout: stagecache record exchange (PP rank 0): PP rank(s) 1 did not "
                            "reach the HiCache stack build within 3 s"), error


def test_pp8(tmp_path):
    from sglang.srt.distributed.utils import get_pp_indices

    port = free_port()
    run = launch(tmp_path, 8, common_env={"STAGECACHE_SGLANG_DASHBOARD_PORT": str(port)}, budget=128 << 20,
                 after=_look(port, 8))
    _assert_healthy(run, [tuple(get_pp_indices(43, r, 8)) for r in range(8)])
