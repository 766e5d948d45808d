"""`stagecache advise --policies` as a user runs it: the report against the tree model, the
advice's pages and flags, the bytes per stage from the plan, the tables, and bad input."""

from __future__ import annotations

import json

import pytest
from cli_traces import advise_json, trace_fixtures
from stagecache.runtime.cli.main import main
from stagecache.runtime.plan.inputs import resolve_plan
from stagecache.runtime.plan.plan import Sizing
from stagecache.runtime.sizing import policies as P
from stagecache.runtime.sizing.advice import hicache_ratio_for
from stagecache.runtime.sizing.bounds import belady_curve
from stagecache.runtime.sizing.curves import page_views, trace_curves
from stagecache.runtime.sizing.policy_advice import POLICY_TARGETS, stage_pricing
from stagecache.runtime.traces.readers import load_requests

mooncake, tokens = trace_fixtures("pol", requests=120)


@pytest.fixture(scope="module")
def mooncake_report(mooncake):
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["advise", "--trace", str(mooncake), "--model", "deepseek-v4-flash", "--pp-size",
                     "4", "--max-total-tokens", "16384", "--policies", "--policy-order", "stagecache",
                     "--json"]) == 0
    return json.loads(out.getvalue())


def test_rates_are_the_tree_model_at_the_marked_sizes(mooncake, mooncake_report):
    pol = mooncake_report["policies"]
    assert pol["source"] == "stagecache"
    assert [p["name"] for p in pol["policies"]] == list(P.POLICIES)
    views = page_views(load_requests(mooncake).requests, 512)
    curves = trace_curves(views)
    total = curves.input_tokens
    for tier in pol["tiers"]:
        curve = curves.device if tier["tier"] == "device" else curves.total
        marks = [s["mark"] for s in tier["sizes"]]
        assert marks == ["configured", "50%", "90%", "95%", "99%"]
        conf = tier["sizes"][0]["pages"]
        assert conf == (32 if tier["tier"] == "device" else 64)
        assert [s["pages"] for s in tier["sizes"][1:]] == [curve.pages_for(x) for x in (0.5, 0.9, 0.95, 0.99)]
        belady = belady_curve(views, [s["pages"] for s in tier["sizes"]])
        for size in tier["sizes"]:
            assert size["belady_hit_rate"] == belady[size["pages"]] / total
            assert size["lru_curve_hit_rate"] == curve.rate(size["pages"])
            for spec in P.policy_specs(None):
                got = P.run_policy(views, P.own_strategy(spec), size["pages"], tier["tier"], 512,
                                   spec.name == "tlru").hit_tokens
                assert size["hit_rate"][spec.label] == got / total
                assert got <= belady[size["pages"]]
            best = max(size["hit_rate"].values())
            assert size["hit_rate"][size["best"]] == best


def test_advice_pages_flags_and_bytes(mooncake, mooncake_report):
    pol = mooncake_report["policies"]
    views = page_views(load_requests(mooncake).requests, 512)
    curves = trace_curves(views)
    plan = resolve_plan("deepseek-v4-flash", 4, 1, None, 512, None, Sizing.sglang(max_total_tokens=16384))
    for tier in pol["tiers"]:
        assert [t["share"] for t in tier["targets"]] == list(POLICY_TARGETS)
        curve = curves.device if tier["tier"] == "device" else curves.total
        for t in tier["targets"]:
            want = t["share"] * curve.ceiling_tokens
            best = t["best"]
            pages = t["pages"][best]
            assert pages == t["best_pages"] == min(p for p in t["pages"].values() if p is not None)
            assert t["pages_saved_vs_lru"] == t["pages"]["lru"] - pages >= 0
            spec = next(s for s in P.policy_specs(None) if s.label == best)
            hits = P.run_policy(views, P.own_strategy(spec), pages, tier["tier"], 512,
                                spec.name == "tlru").hit_tokens
            assert hits >= want
            flag = (f"--max-total-tokens {pages * 512}" if tier["tier"] == "device"
                    else f"--hicache-ratio {hicache_ratio_for(pages, 32):g}")
            assert t["flags"] == f"{spec.flags()} {flag}"
    for st, stage in zip(pol["stages"], plan.stages, strict=True):
        price = stage_pricing(stage)
        assert st["device_page_bytes"] == price["device_page_bytes"] > 0
        rows = {(r["tier"], r["share"]): r for r in st["targets"]}
        for tier in pol["tiers"]:
            per = st["device_page_bytes"] if tier["tier"] == "device" else st["host_page_bytes"]
            for t in tier["targets"]:
                r = rows[(tier["tier"], t["share"])]
                assert r["bytes"] == t["best_pages"] * per
                assert r["saved_bytes"] == t["pages_saved_vs_lru"] * per
    assert "c128_state" in pol["unreduced_pools"]  # DeepSeek V4's per-request state
    assert pol["same_tiers"] is True


def test_token_trace_tiers_and_configs(tokens, capsys, tmp_path):
    plot = tmp_path / "p.html"
    rep = advise_json(capsys, "--trace", str(tokens), "--plot", str(plot), "--policies", "lru", "slru",
                      "tlru", "--policy-config", 'slru={"protected_threshold": 3}', "--policy-config",
                      'tlru={"threshold": 2048, "next_prompt_estimate": 256}', "--policy-order", "stagecache")
    pol = rep["policies"]
    assert [p["label"] for p in pol["policies"]] == [
        "lru", 'slru {"protected_threshold": 3}', 'tlru {"next_prompt_estimate": 256, "threshold": 2048}']
    assert pol["same_tiers"] is False and [t["tier"] for t in pol["tiers"]] == ["device", "host"]
    assert "policies" in rep["seconds"]
    page = plot.read_text()
    assert page.count("plotly-graph-div") >= 2 and "sglang radix eviction policies" in page


def test_tables(tokens, capsys):
    assert main(["advise", "--trace", str(tokens), "--policies", "lru", "lfu", "--no-belady"]) == 0
    out = capsys.readouterr().out
    assert "eviction policies, device tier alone" in out and "device + host" in out
    assert "--radix-eviction-policy" in out and "pools the hit rate does not size" in out


@pytest.mark.parametrize("argv, message", [
    (["--policies", "mru"], "--policies: unknown policy 'mru'"),
    (["--policies", "--policy-config", "slru=[1]"], "--policy-config slru: expected a JSON object"),
    (["--policies", "--policy-config", 'slru={"x": 1}'], "unknown key 'x'"),
    (["--policies", "--policy-config", 'tlru={"threshold": 5, "next_prompt_estimate": 9}'],
     "threshold 5 must exceed next_prompt_estimate 9"),
    (["--policy-config", 'slru={"protected_threshold": 3}'], "--policy-config needs --policies"),
])
def test_bad_policy_flags_are_one_line_exit_2(tokens, capsys, argv, message):
    assert main(["advise", "--trace", str(tokens), "--no-belady", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and "Traceback" not in err, err


def test_policy_order_sglang_without_sglang(tokens, capsys):
    try:
        import sglang  # noqa: F401
        pytest.skip("sglang is installed here")
    except ImportError:
        pass
    assert main(["advise", "--trace", str(tokens), "--no-belady", "--policies", "lru",
                 "--policy-order", "sglang"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--policy-order sglang: sglang cannot be imported here" in err and len(err.splitlines()) == 1
    rep = advise_json(capsys, "--trace", str(tokens), "--no-belady", "--policies", "lru")
    assert rep["policies"]["source"] == "stagecache"  # auto falls back
