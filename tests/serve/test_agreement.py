"""Do the PP stages agree?  The comparison, the /readyz threshold, and a real ``serve`` with a
planted fault on one stage's radix tree.

``--fault radix-skew@2`` makes stage 2 of a real 4-process ``serve`` lose the deepest page of
every 4th request it caches: its matched prefixes drift from the other stages'.  Rank 0 sees
it in the per-request records, stage 2 counts it (and only stage 2), /readyz turns 503 while
the run is still serving, naming the count and the threshold, the dashboard lists the
requests, and stage 2 books the pages it missed below the agreed prefix as
``stage_disagreement``.  The clean run of tests/serve/test_serve_run.py keeps every count at 0.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
from metric_samples import series_by_name
from plans import report
from serve_helpers import SMALL, run_phase, start, stop, wait_for
from stagecache.runtime.live.liveness import assess
from stagecache.runtime.live.numbers import DECISION_NAMES, RunInfo, StageAgreement, StageLive
from stagecache.runtime.serve.agreement import Agreement, agreed_value, compare

PACED = list(SMALL)
PACED[PACED.index("--rate") + 1] = "8"
PACED[PACED.index("--requests") + 1] = "80"


# -- the comparison ------------------------------------------------------------------------------
def test_the_majority_value_is_agreed_and_a_tie_goes_to_the_longer_prefix():
    assert agreed_value([3, 3, 1, 3]) == 3
    assert agreed_value([2, 1]) == 2 and agreed_value([1, 1, 2, 2]) == 2


def test_compare_flags_each_stage_whose_value_is_not_the_agreed_one():
    # per stage, per request: device pages, host pages, backed up, cached, completed
    same = [4, 1, 0, 2, 1]
    records = [[same, same], [same, same], [[3, 1, 0, 2, 1], [4, 1, 1, 2, 0]], [same, same]]
    (agreed0, masks0), (agreed1, masks1) = compare(records)
    assert agreed0 == [5, 1, 0, 2] and masks0 == [0, 0, 1, 0]  # stage 2: matched_prefix only
    # request 1 on stage 2: backed up one page more, and did not complete
    assert agreed1 == [5, 1, 0, 2]
    assert masks1[2] == (1 << DECISION_NAMES.index("backed_up")) | (1 << DECISION_NAMES.index("completion"))


class _Mb:
    def __init__(self, index: int, n: int):
        self.index, self.requests = index, [f"s/{i}" for i in range(n)]


def test_records_and_verdicts_travel_down_the_pipe_and_back_without_loss():
    """Three stages in one process: the words each would send, handed on by hand."""
    verdicts: dict[int, list] = {0: [], 1: [], 2: []}
    stages = [Agreement(k, 3, on_verdict=lambda i, a, k=k: verdicts[k].append((i, a))) for k in range(3)]
    # device pages, host pages, backed up, cached, completed, L3 pages: stage 2 matched less
    recs = {0: [[2, 0, 0, 1, 1, 0]], 1: [[2, 0, 0, 1, 1, 0]], 2: [[1, 0, 0, 1, 1, 0]]}
    for mb in (_Mb(0, 1), _Mb(1, 1)):
        for k, st in enumerate(stages):
            st.local(mb.index, recs[k])
        stages[1].upstream(mb, stages[0].downstream(mb))
        stages[2].upstream(mb, stages[1].downstream(mb))
        words = stages[2].credit(mb)
        assert len(words) == stages[0].credit_words(mb)
        stages[0].on_credit(mb, words)
    owed = stages[0].owed()  # the final broadcast: every verdict rank 0 has not sent yet
    for st in stages[1:]:
        st.take_verdicts(owed, forward=False)
    assert [st.disagreements["matched_prefix"] for st in stages] == [0, 0, 2]
    assert all(st.compared_requests == 2 for st in stages)
    assert all(v == [(0, [2]), (1, [2])] for v in verdicts.values())
    recent = list(stages[0].recent)
    assert [(r["kind"], r["stages"], r["agreed"], r["values"]) for r in recent] == [
        ("matched_prefix", [2], 2, [2, 2, 1])] * 2


def test_l3_pages_count_as_matched_and_loaded_and_travel_to_later_stages():
    stages = [Agreement(k, 2) for k in range(2)]
    mb = _Mb(0, 2)
    stages[0].local(0, [[1, 1, 0, 2, 1, 3], [0, 0, 0, 1, 1, 0]])
    stages[1].upstream(mb, stages[0].downstream(mb))
    # what stage 1 follows: stage 0's device + host pages and its L3 pages, per request
    assert stages[1].head(0, 2) == [(2, 3), (0, 0)]
    assert stages[0].head(0, 2) is None
    [(agreed, _)] = compare([[[1, 1, 0, 2, 1, 3]], [[1, 1, 0, 2, 1, 3]]])
    assert agreed[:2] == [5, 4]  # matched = device + host + L3; loaded = host + L3


# -- /readyz ---------------------------------------------------------------------------------------
NOW = 1_800_000_000.0
REPORT = report("tiny-v4", 2)


def _stage(k: int, disagreements: int) -> StageLive:
    return StageLive(stage=k, pid=100 + k, phase="serving", heartbeat_at=NOW,
                     agreement=StageAgreement(disagreements={"matched_prefix": disagreements},
                                              compared_requests=10))


def test_readyz_fails_above_the_threshold_naming_the_count_and_the_limit():
    def verdict(limit: int, n: int):
        info = RunInfo(phase="serving", pp_size=2, pids={0: 100, 1: 101}, exit_codes={0: None, 1: None},
                       max_disagreements=limit)
        return assess(info, REPORT, {0: _stage(0, 0), 1: _stage(1, n)}, NOW)

    assert verdict(0, 0).ready
    v = verdict(0, 3)
    assert not v.ready and v.disagreements == 3 and v.max_disagreements == 0
    assert v.reasons == ["stages disagree: 3 disagreement(s) > --max-disagreements 0 "
                         "(by stage and kind: {1: {'matched_prefix': 3}})"]
    assert verdict(3, 3).ready and not verdict(2, 3).ready


# -- a real serve with one skewed stage ------------------------------------------------------------
def _get(url: str) -> httpx.Response | None:
    try:
        return httpx.get(url, timeout=5)
    except httpx.HTTPError:
        return None


def test_a_skewed_stage_is_counted_alerted_and_makes_the_run_not_ready(tmp_path: Path, free_port: int):
    run_dir, out = tmp_path / "run", tmp_path / "out.txt"
    base = f"http://127.0.0.1:{free_port}"
    proc = start([*PACED, "--port", str(free_port), "--run-dir", str(run_dir), "--fault", "radix-skew@2",
                  "--hold-seconds", "120", "--json"], out)
    try:
        def disagreeing() -> httpx.Response | None:
            r = _get(f"{base}/readyz")
            return r if r is not None and r.status_code == 503 and any(
                x.startswith("stages disagree") for x in r.json()["reasons"]) else None

        serving = wait_for(disagreeing, 90, "/readyz 503 naming the stage disagreements", proc, out).json()
        wait_for(lambda: run_phase(run_dir) == "done", 90, "the trace to finish", proc, out)
        metrics = _get(f"{base}/metrics").text
        summary = _get(f"{base}/api/metrics/summary").json()
        page = _get(f"{base}/").text
    finally:
        code = stop(proc)
    assert code == 143, out.read_text()  # SIGTERM while holding the finished run
    # while serving, the disagreements are the only reason
    assert serving["phase"] == "serving" and serving["max_disagreements"] == 0, serving
    (reason,) = serving["reasons"]
    assert reason.startswith(f"stages disagree: {serving['disagreements']} disagreement(s) > "
                             "--max-disagreements 0 (by stage and kind: {2: {"), reason
    # only stage 2 disagrees, and it does on matched prefixes
    counts = {(s.labels["pp_rank"], s.labels["kind"]): s.value
              for s in series_by_name(metrics)["stagecache_stage_disagreements_total"]}
    assert set(counts) == {(str(k), kind) for k in range(4) for kind in DECISION_NAMES}
    assert counts["2", "matched_prefix"] > 0
    assert all(v == 0 for (st, _), v in counts.items() if st != "2")
    # the dashboard: rank 0's recent disagreements name the request, the stage and the values
    stages = {s["stage"]: s for s in summary["stages"]}
    recent = stages[0]["agreement"]["recent"]
    assert recent and all(r["stages"] == [2] and len(r["values"]) == 4 for r in recent)
    assert all(r["values"][2] != r["agreed"] and r["values"][0] == r["agreed"] for r in recent)
    assert 'id="agreement-table"' in page and recent[-1]["request"] in page
    # every request compared on every stage; stage 2's shorter matches are stage_disagreement
    assert all(s["agreement"]["compared_requests"] == 80 for s in stages.values())
    for k, s in stages.items():
        m = s["insight"]["miss_tokens"]
        assert sum(m["host"].values()) == s["cache_tokens"]["miss"], (k, m)
        t = s["cache_tokens"]
        assert sum(m["device"].values()) == t["miss"] + t["host"] + t["storage"]
        assert (m["host"]["stage_disagreement"] > 0) == (k == 2), (k, m)
    assert stages[2]["insight"]["skewed_pages"] > 0
    text = out.read_text()
    result = json.loads(text[text.index("{\n"):])
    assert result["stages"][2]["disagreements"]["matched_prefix"] == counts["2", "matched_prefix"]
