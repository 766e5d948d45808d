"""``serve``'s flag validation and documented defaults, without starting any process."""

from __future__ import annotations

import pytest
from stagecache.runtime.cli.main import build_parser
from stagecache.runtime.cli.serve import options_from_args
from stagecache.runtime.errors import ConfigError
from stagecache.runtime.serve.stage_cache import build_trace, check_trace_fits, request_pages


def opts(*argv: str):
    return options_from_args(build_parser().parse_args(["serve", *argv]))


def test_plain_serve_is_the_documented_demo():
    o = opts()
    assert (o.plan.spec.name, o.pp_size, o.plan.tp_size, o.page_size) == ("tiny-v4", 4, 1, 256)
    assert (o.host, o.port, o.dashboard) == ("127.0.0.1", 8000, True)
    assert o.requests == 960 and o.rate == 12.0 and o.micro_batch == 4  # 80 s of arrivals
    assert o.plan.stage(0).device_pages == 64 and o.plan.sizing.hicache_ratio == 2.0
    assert o.hicache_write_policy == "write_through"
    assert o.hidden_size == 256  # tiny-v4's hidden_size
    assert o.hold_seconds is None and not o.exit_after_run  # keep serving the dashboard after the run
    assert o.plan.faults == () and o.run_dir is None


def test_sizes_and_hold_flags():
    assert opts("--max-total-tokens", "16000").plan.stage(0).device_pages == 63  # 62.5 rounded up to pages
    assert opts("--exit-after-run").hold_seconds == 0
    assert opts("--hold-seconds", "7").hold_seconds == 7
    assert opts("--pp-partition", "2,4,3,3").plan.partition == (2, 4, 3, 3)
    assert opts("--model", "deepseek-v4-flash", "--device", "cpu").hidden_size == 512  # 4096 capped on CPU
    assert opts("--model", "deepseek-v4-flash", "--device", "cpu", "--hidden-size", "1024").hidden_size == 1024


@pytest.mark.parametrize("argv, message", [
    (["--device-pages", "3"], "raise --device-pages"),
    (["--pp-partition", "3,3,3"], "has 3 entries, expected pp_size=4"),
    (["--fault", "gap", "--pp-size", "1"], "needs --pp-size >= 2"),
    (["--rate", "0.01"], "raise --dist-timeout or --rate"),
    (["--device-pages", "500000"], "pools together need"),
])
def test_bad_flags_are_config_errors(argv, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        opts(*argv)


def test_trace_fit_check_uses_the_micro_batch_sum():
    trace = build_trace(None, 40, 0)
    worst = max(sum(request_pages(r, 256) for r in trace[i:i + 4]) for i in range(0, 40, 4))
    check_trace_fits(trace, 256, worst, 4)  # exactly enough
    with pytest.raises(ConfigError, match="needs up to"):
        check_trace_fits(trace, 256, worst - 1, 4)


def test_the_generated_trace_is_deterministic_and_shares_prefixes():
    a, b = build_trace(None, 30, 5), build_trace(None, 30, 5)
    assert [(r.session, r.turn, r.input_ids.tolist()) for r in a] == [
        (r.session, r.turn, r.input_ids.tolist()) for r in b]
    assert build_trace(None, 30, 6)[0].input_ids.tolist() != a[0].input_ids.tolist()
    later_turns = [r for r in a if r.turn > 0]
    assert later_turns, "multi-turn sessions re-send their history"
