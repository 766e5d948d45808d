"""Property-based API tests from the dashboard's own OpenAPI spec (schemathesis).

Three sources: a valid run (no 5xx at all, but /readyz: a static view has no
stage process alive, so it is documented 503 there), a failed validation and a run
still starting (503 is the documented answer of /startupz and the report
endpoints there, so those two only forbid 500s).  Every response must match
its documented status code, content type and schema.  Bounded: at most 20
examples per endpoint and source.
"""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, settings
from live_helpers import blank_live
from plans import report
from schemathesis.checks import not_a_server_error
from stagecache.dashboard.app import create_app
from stagecache.runtime.live.numbers import StageLive
from stagecache.runtime.live.source import StaticSource
from stagecache.runtime.model.families.deepseek_v4 import POOLS
from stagecache.runtime.validation.report import StartupReport


def _report(faults: list[str]) -> StartupReport:
    return report("tiny-v4", 4, list(faults))


def _live() -> dict[int, StageLive]:
    out = {}
    for s in range(4):
        d = blank_live(s, POOLS)
        d["cache_tokens"] = {"device": 10 * s, "host": 5, "miss": 1}
        d["host_hit_ratio"] = 0.5
        out[s] = StageLive.model_validate(d)
    return out


ok_schema = schemathesis.openapi.from_asgi("/openapi.json", create_app(StaticSource(_report([]), _live())))
fault_schema = schemathesis.openapi.from_asgi("/openapi.json", create_app(StaticSource(_report(["global-swa"]))))
starting_schema = schemathesis.openapi.from_asgi("/openapi.json", create_app(StaticSource(None)))

BOUNDED = settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))


def _no_500(response) -> None:
    assert response.status_code != 500, f"500 from {response.request.url}: {response.text[:300]}"


@ok_schema.parametrize()
@BOUNDED
def test_valid_run_never_5xx_and_matches_its_spec(case):
    if case.path == "/readyz":  # 503 is its documented answer: a static view runs no stage process
        _no_500(case.call_and_validate(excluded_checks=[not_a_server_error]))
        return
    case.call_and_validate()


@fault_schema.parametrize()
@BOUNDED
def test_failed_validation_run_matches_its_spec(case):
    _no_500(case.call_and_validate(excluded_checks=[not_a_server_error]))


@starting_schema.parametrize()
@BOUNDED
def test_starting_run_matches_its_spec(case):
    _no_500(case.call_and_validate(excluded_checks=[not_a_server_error]))
