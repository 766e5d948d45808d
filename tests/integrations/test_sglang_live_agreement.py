"""PP ranks that stop agreeing, named live: real sglang 0.5.23 ranks (CPU, gloo, real processes).

Runs in .venv-sglang (test_sglang_venv.py launches it).  Each test is one launch of 4 real ranks
(tests/support/sglang_ranks.py) whose stack is sglang's real ``build_deepseek_v4_hicache_stack``;
each rank then drives the same request stream through sglang's hooked match, its real
``HybridCacheController``, its per-step ``check_hicache_events`` (``_pp_sync`` of the ack counts
over the real PP group) and its L3 MIN all-reduce (tests/support/sglang_agreement.py).  One rank
differs in one way per test; rank 0's one endpoint must name it, and a healthy run of 1,000
requests must name nothing.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytest.importorskip("sglang", reason="sglang not installed (runs in .venv-sglang)")

from sglang_ranks import free_port, launch  # noqa: E402

pytestmark = pytest.mark.timeout(300)

PUSH = {"STAGECACHE_SGLANG_PUSH_INTERVAL_S": "0.2"}
#: the ranks left waiting on a crashed rank give up after this long (sglang's own: 60 s here)
SHORT_GLOO = {"STAGECACHE_TEST_GLOO_TIMEOUT_S": "5"}
#: what rank 0's endpoint may take to answer what an operator reads, on a loaded 2-core machine
#: (a 5 s read timeout was hit there: the page renders every stage; the numbers are not timed here)
LOOK_TIMEOUT_S = 30


def _flush(pusher: Any, within_s: float = 20.0) -> bool:
    """Push until rank 0 took one push made after the traffic: it carries every record left (a
    fixed sleep of a few push intervals is no bound on a loaded machine, where the pusher
    thread's push may come late or time out before the rank's process ends).  False when rank 0
    took none: a case that named its divergence may have ended rank 0 already (its endpoint, up
    since before the traffic, refuses the connection: no use trying again)."""
    if pusher is None:
        return False
    end = time.monotonic() + within_s
    while True:
        try:
            pusher.push_once()
            return True
        except OSError as exc:
            if isinstance(getattr(exc, "reason", exc), ConnectionRefusedError) or time.monotonic() > end:
                return False
            time.sleep(0.2)


def _drive(requests: int, look_for: Any = None):
    """Every rank runs the traffic; rank 0 then waits (bounded) until its endpoint compared what
    ``look_for(divergence)`` wants and returns what an operator sees."""
    def after(rank: int, ctx: dict[str, Any]) -> dict[str, Any]:
        from sglang_agreement import Traffic

        if "stack" not in ctx:
            return {}
        dep = ctx["deployment"]
        out: dict[str, Any] = {"traffic": Traffic(rank, 4, ctx["stack"]).run(requests)}
        out["last_steps"] = dep.agreement.step  # steps the rank's hook counted
        if rank != 0:
            pusher = dep.pusher
            out["flushed"] = _flush(pusher)  # the last records leave with a push rank 0 took
            out["pusher"] = {"failures": pusher.failures, "last_error": pusher.last_error} if pusher else None
            return out
        end = time.monotonic() + 30
        while time.monotonic() < end:
            d = dep.source.divergence()
            if look_for(d):
                break
            time.sleep(0.1)
        url = dep.url
        wait = LOOK_TIMEOUT_S
        out["look"] = {
            "divergence": dep.source.divergence().model_dump(mode="json"),
            "readyz_status": (r := httpx.get(f"{url}/readyz", timeout=wait)).status_code, "readyz": r.json(),
            "metrics": httpx.get(f"{url}/metrics", timeout=wait).text,
            "page": httpx.get(f"{url}/", timeout=wait).text,
            "summary": httpx.get(f"{url}/api/metrics/summary", timeout=wait).json(),
        }
        return out
    return after


def _samples(metrics: str, family: str) -> dict[str, float]:
    return {next(iter(s.labels.values()), ""): s.value for f in text_string_to_metric_families(metrics)
            for s in f.samples if s.name == family}


def _run(tmp_path, requests: int, look_for: Any, env: dict[int, dict[str, str]] | None = None,
         common: dict[str, str] | None = None):
    port = free_port()
    run = launch(tmp_path, 4, env=env, common_env={"STAGECACHE_SGLANG_DASHBOARD_PORT": str(port), **PUSH,
                                                   "STAGECACHE_TEST_STOP_FILE": str(tmp_path / "stop"),
                                                   **(common or {})},
                 after=_drive(requests, look_for), timeout=240)
    assert sorted(run.results) == [0, 1, 2, 3], run.results
    for rank, res in run.results.items():
        assert "crash" not in res and "error" not in res, (rank, res)
    return run


def test_a_healthy_pp4_agrees_on_every_one_of_1000_requests(tmp_path):
    def complete(d):
        return d.compared["device_prefix_len"] == 1000 and d.compared["load_acks"] == 250
    run = _run(tmp_path, 1000, complete)
    for rank, res in run.results.items():
        assert res["traffic"]["error"] is None and res["traffic"]["steps"] == 250, (rank, res["traffic"]["error"])
    assert all(run.results[r]["flushed"] for r in (1, 2, 3))  # every rank's last records reached rank 0
    look = run.results[0]["look"]
    d = look["divergence"]
    assert d["compared"]["device_prefix_len"] == 1000 and d["compared"]["host_hit_length"] == 1000, (
        d["waiting"], d["unmatched"], d["dropped"], {r: run.results[r].get("pusher") for r in (1, 2, 3)})
    assert d["compared"]["write_acks"] == d["compared"]["load_pending"] == 250, (
        d["waiting"], d["unmatched"], d["dropped"], {r: run.results[r].get("pusher") for r in (1, 2, 3)},
        {r: run.results[r].get("last_steps") for r in range(4)})
    assert d["compared"]["l3_prefetch_tokens"] > 100
    assert sum(d["divergent"].values()) == 0 and d["first"] is None and d["unmatched"] == 0
    assert d["incomplete"] == {} and d["dropped"] == 0
    # the traffic was not trivial: host hits and loads on every rank (sglang's real host pool)
    hosts = [m[2] for m in run.results[0]["traffic"]["matches"]]
    assert sum(1 for h in hosts if h) > 50, hosts
    assert look["readyz_status"] == 200 and not any("PP ranks" in w for w in look["readyz"]["warnings"])
    div = _samples(look["metrics"], "stagecache_pp_divergence_total")
    agree = _samples(look["metrics"], "stagecache_pp_agreement_total")
    assert set(div.values()) == {0.0} and agree["device_prefix_len"] == 1000 and agree["load_acks"] == 250


def test_a_rank_with_a_smaller_host_pool_is_named_at_the_first_request_it_matches_differently(tmp_path):
    """Rank 2's host pool is smaller (``--hicache-ratio 1.2``), so it evicts other pages, finds less
    on the host and loads less: in that very step sglang's ``_pp_sync`` tells it to consume PP rank
    0's count of load acks, one more than it queued -- the crash of sglang #22607.  The request is
    named first, in the step of the crash."""
    run = _run(tmp_path, 400, lambda d: d.first is not None, env={2: {"STAGECACHE_TEST_HICACHE_RATIO": "1.2"}},
               common=SHORT_GLOO)
    t = {r: run.results[r]["traffic"] for r in range(4)}
    assert t[2]["host_tokens"] < t[0]["host_tokens"] == t[1]["host_tokens"]
    # where the ranks' own match results first differ (each rank's record of its sglang traffic)
    first = next(i for i, (a, b) in enumerate(zip(t[0]["matches"], t[2]["matches"], strict=False)) if a != b)
    rid, host0, host2 = t[0]["matches"][first][0], t[0]["matches"][first][2], t[2]["matches"][first][2]
    assert t[2]["error"].startswith("IndexError") and t[2]["steps"] == first // 4 + 1, t[2]
    look = run.results[0]["look"]
    d = look["divergence"]["first"]
    assert (d["request"], d["quantity"], d["ranks"]) == (rid, "host_hit_length", [2]), d
    assert d["values"] == [host0, host0, host2, host0] and d["agreed"] == host0
    warning = next(w for w in look["readyz"]["warnings"] if w.startswith("PP ranks diverged"))
    assert f"first at request {rid}: host_hit_length differs across PP ranks: rank 2 = {host2}" in warning
    assert _samples(look["metrics"], "stagecache_pp_divergence_total")["host_hit_length"] >= 1
    page = look["page"]
    assert 'id="pp-divergence"' in page and f"first at request {rid}" in page
    stage2 = next(s for s in look["summary"]["stages"] if s["stage"] == 2)
    assert stage2["agreement"]["disagreements"]["host_hit_length"] >= 1


def test_strict_agreement_turns_the_deployment_not_ready(tmp_path):
    run = _run(tmp_path, 40, lambda d: d.first_incomplete is not None,
               common={"STAGECACHE_FAULT": "backup-without-indexer@1", "STAGECACHE_SGLANG_STRICT_AGREEMENT": "1"})
    look = run.results[0]["look"]
    assert look["readyz_status"] == 503
    assert any("incomplete HiCache transfer" in r for r in look["readyz"]["reasons"]), look["readyz"]


def test_a_load_ack_one_step_late_on_rank_2_is_named_at_that_step(tmp_path):
    """Rank 2 submits step 40's load after the step's event check: sglang's ``_pp_sync`` tells it to
    consume PP rank 0's count of load acks from a queue that lacks one -- the #22607 crash.  The
    step is named before it."""
    run = _run(tmp_path, 160, lambda d: d.first is not None, env={2: {"STAGECACHE_TEST_DELAY_LOAD_AT": "40"}},
               common=SHORT_GLOO)
    assert run.results[2]["traffic"]["error"].startswith("IndexError"), run.results[2]["traffic"]
    look = run.results[0]["look"]
    d = look["divergence"]["first"]
    assert (d["step"], d["quantity"], d["ranks"]) == (40, "load_pending", [2]), d
    assert d["values"][2] == 0 and d["agreed"] > 0
    assert look["divergence"]["divergent"]["load_pending"] == 1


def test_a_shorter_l3_prefetch_on_rank_2_is_named_though_sglang_min_hides_it(tmp_path):
    rid = "s0.3-t4"
    run = _run(tmp_path, 160, lambda d: d.first is not None, env={2: {"STAGECACHE_TEST_SHORT_L3": rid}})
    mins = {r: {p[0]: p[2] for p in run.results[r]["traffic"]["prefetch"]} for r in range(4)}
    assert {mins[r][rid] for r in range(4)} == {2 * 256}  # sglang's MIN: every rank takes the shorter
    d = run.results[0]["look"]["divergence"]["first"]
    assert (d["request"], d["quantity"], d["ranks"], d["values"]) == (
        rid, "l3_prefetch_tokens", [2], [768, 768, 512, 768]), d


def test_a_backup_without_its_indexer_pool_is_flagged_with_the_kind_and_page(tmp_path):
    """The product's fault, as an operator plants it: the same environment on every rank,
    ``STAGECACHE_FAULT=backup-without-indexer@1``; only stage 1's backups lack the indexer."""
    run = _run(tmp_path, 40, lambda d: d.first_incomplete is not None,
               common={"STAGECACHE_FAULT": "backup-without-indexer@1"})
    look = run.results[0]["look"]
    d = look["divergence"]
    bad = d["first_incomplete"]
    # the step's four new pages go in one submission (sglang merges the queued writes): host pages 0-3
    assert (bad["stage"], bad["direction"], bad["missing"], bad["page"], bad["pages"]) == (
        1, "d2h", ["indexer"], 0, 4), bad
    assert bad["got_bytes"] < bad["expected_bytes"]
    assert d["incomplete"]["indexer"] >= 1 and set(d["incomplete"]) == {"indexer"}
    assert {b["stage"] for b in d["recent_incomplete"]} == {1}  # the fault's stage alone
    line = next(w for w in look["readyz"]["warnings"] if "incomplete HiCache transfer" in w)
    assert "stage 1: backup of host page 0 (4 page(s)) lacks pool kind(s) indexer" in line
    inc = _samples(look["metrics"], "stagecache_hicache_incomplete_transfers_total")
    assert inc["indexer"] >= 1
    assert sum(d["divergent"].values()) == 0  # every rank still agrees on what it did
