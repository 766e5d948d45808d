"""End to end: a generated chat trace under device-memory pressure, every reused byte verified.

Also the ``stagecache bench hicache`` command itself (small, real pools, JSON
output) and its refusal of a malformed trace (exit 2, line number, nothing run).
"""

from __future__ import annotations

import json

import pytest
from plans import pools as make_pools
from stagecache.runtime.bench.hicache import replay
from stagecache.runtime.cache.hicache import HiCache
from stagecache.runtime.cache.kv_writer import KvWriter
from stagecache.runtime.cache.pages import page_view
from stagecache.runtime.cli.main import main
from stagecache.runtime.memory.host_pools import HostPools
from stagecache.runtime.model.families import load_spec
from stagecache.runtime.model.layer_map import build_layout
from stagecache.runtime.sizing.bounds import CeilingTracker
from stagecache.runtime.traces.readers import WorkloadConfig, generate, write_trace
from stagecache.runtime.transfer.controller import TransferController
from stagecache.runtime.transfer.stats import TransferStats

PAGE = 128
TRACE = WorkloadConfig(seed=11, requests=1200, system_prompts=3, system_prompt_len=(128, 512),
                       turns=(2, 8), user_len=(16, 200), assistant_len=(16, 200),
                       think_time_s=20.0, session_gap_s=1.0)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("policy, layout", [("write_back", "layer_first"),
                                            ("write_through", "page_first")])
def test_replay_under_pressure_reloads_exact_bytes(policy, layout):
    spec = load_spec("tiny-v4")
    stage = build_layout(spec, 4).stages[2]  # C4 + C128 + SWA layers: every pool kind
    reqs = generate(TRACE)
    pools = make_pools(spec, stage, PAGE, 40, hicache_ratio=2.0)
    host = HostPools(pools, layout=layout)
    cache = HiCache(pools, host, TransferController(pools, host, TransferStats()), write_policy=policy)
    writer = KvWriter(pools)
    res = replay(reqs, cache, writer, verify=True, concurrency=3, check_every=100)
    s = cache.stats
    assert res.mismatch_count == 0, [str(m) for m in res.mismatches]
    assert s.requests == len(reqs) == res.requests
    # the run really was under pressure and really reloaded from host
    assert s.device_evicted_pages > 200 and s.host_evicted_pages > 0 and s.load_pages > 100
    assert s.host_hit_tokens > 0 and res.pages_verified > s.load_pages
    assert all(cache.tree.lock[s] == 0 for s in cache.tree.nodes())
    ceiling = CeilingTracker()
    for r in reqs:
        ceiling.observe(page_view(r, PAGE))
    assert s.host_hit_tokens + s.device_hit_tokens <= ceiling.hit_tokens
    assert s.looked_up_tokens == ceiling.input_tokens == sum(r.input_len for r in reqs)


def test_bench_command_json(capsys, tmp_path):
    trace = tmp_path / "t.jsonl"
    write_trace(trace, generate(WorkloadConfig(seed=2, requests=80, system_prompt_len=(128, 256),
                                               user_len=(16, 128), assistant_len=(16, 128),
                                               think_time_s=5.0, session_gap_s=0.5)))
    rc = main(["bench", "hicache", "--trace", str(trace), "--pp-size", "2", "--page-size", "128",
               "--device-pages", "30", "--hicache-ratio", "2", "--verify", "--check-every", "20",
               "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    hi, dev = out["summary"]["hicache"], out["summary"]["device_only"]
    assert out["trace"]["requests"] == 80 and out["stages"] == [0, 1]
    assert hi["mismatches"] == 0 and hi["stages_agree"] and dev["stages_agree"]
    assert dev["host_hit_tokens"] == 0 and dev["transfer_bytes"] == {"d2h": 0, "h2d": 0}
    assert hi["hit_tokens"] >= dev["hit_tokens"]
    assert hi["hit_tokens"] <= out["ceiling"]["hit_tokens"]
    assert 0 <= hi["host_share_of_ceiling"] <= hi["share_of_ceiling"] <= 1
    for row in out["per_stage"]["hicache"]:
        assert row["device_hit_tokens"] + row["host_hit_tokens"] + row["miss_tokens"] == \
            out["trace"]["input_tokens"]
        # miss reasons: per tier they sum exactly to the misses (host: computed; device: + host hits)
        reasons = row["insight"]["miss_tokens"]
        assert sum(reasons["host"].values()) == row["miss_tokens"]
        assert sum(reasons["device"].values()) == row["miss_tokens"] + row["host_hit_tokens"]
        assert reasons["host"]["never_seen"] > 0 and reasons["host"]["stage_disagreement"] == 0
        assert row["insight"]["histograms"]["device"]["lifetime"]["counts"][-1] > 0
    # what the insight costs the replay, measured in the same run (the figure: the bench, not here)
    ov, stage0 = out["insight_overhead"], out["per_stage"]["hicache"][0]
    assert ov["timed_seconds"] == stage0["insight"]["own_seconds"] > 0
    assert ov["calls"] == stage0["insight"]["timed_calls"] >= 80  # a lookup per request at least
    # the timer's own cost per call is measured (a timed no-op) and taken off, never below zero
    assert 0 < ov["timer_floor_us"] < 50
    assert ov["insight_seconds"] == pytest.approx(
        max(0.0, ov["timed_seconds"] - ov["calls"] * ov["timer_floor_us"] / 1e6), abs=2e-6)
    assert ov["replay_seconds"] == stage0["replay"]["seconds"] and ov["budget_percent"] == 1.0
    assert ov["overhead_percent"] == pytest.approx(
        100 * ov["insight_seconds"] / (ov["replay_seconds"] - ov["insight_seconds"]), abs=0.01)
    pair = ov["paired"]
    assert 3 <= pair["repeats"] <= 31  # 31 pairs at most, fewer once 5 s are spent
    assert pair["replay_seconds"] == stage0["replay"]["cpu_seconds"]
    assert pair["metadata_on_seconds"] > 0 and pair["metadata_off_seconds"] > 0
    assert pair["overhead_percent"] == pytest.approx(
        100 * pair["insight_seconds"] / (pair["replay_seconds"] - pair["insight_seconds"]), abs=0.01)
    assert pair["spread_percent"] >= 0 and pair["conclusive"] == (pair["spread_percent"] < 1.0)


def test_bench_without_insight_keeps_none_and_refuses_to_measure_it(capsys):
    argv = ["bench", "hicache", "--requests", "30", "--pp-size", "1", "--page-size", "128",
            "--metadata-only", "--no-insight", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["insight_overhead"] is None and "insight" not in out["per_stage"]["hicache"][0]
    assert main([*argv[:-2], "--insight-overhead", "0", "--json"]) == 0  # insight on, no pairs
    ov = json.loads(capsys.readouterr().out)["insight_overhead"]
    assert ov["paired"] is None and ov["insight_seconds"] > 0
    assert main([*argv, "--insight-overhead", "3"]) == 2
    err = capsys.readouterr().err
    assert "--insight-overhead compares runs with and without the insight" in err and err.count("\n") == 1


def test_bench_refuses_a_malformed_trace_before_replay(capsys, tmp_path):
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"session": "a", "turn": 0, "input_len": 300, "output_len": 4}\n'
                     '{"session": "a", "turn": 1, "input_len": "many", "output_len": 4}\n')
    rc = main(["bench", "hicache", "--trace", str(trace), "--pp-size", "1", "--page-size", "128"])
    err = capsys.readouterr().err
    assert rc == 2 and f"{trace}:2: field 'input_len' = 'many': accepted: an integer in [1, " in err
    assert "Traceback" not in err
    rc = main(["bench", "hicache", "--trace", str(trace), "--pp-size", "1", "--page-size", "128",
               "--skip-bad-lines", "--device-pages", "8", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["trace"]["requests"] == 1 and out["trace"]["skipped_lines"][0].startswith(f"{trace}:2:")


def test_bench_too_few_device_pages_is_a_clear_error(capsys):
    rc = main(["bench", "hicache", "--requests", "20", "--pp-size", "1", "--page-size", "128",
               "--device-pages", "4"])
    err = capsys.readouterr().err
    assert rc == 2 and "--device-pages 4 cannot hold the trace's longest request" in err
