"""``advise --policies``: the tree model's invariants, the config checks, the per-stage pricing.

That the model *is* sglang's tree (every eviction call) is tests/integrations/test_sglang_policies.py,
which drives sglang's real ``UnifiedRadixCache``; here, without sglang: every policy stays at or
below Belady and reaches the infinite cache once nothing is evicted; bad configs are refused as
sglang refuses them; and each stage's bytes per page are the plan's own device-byte growth.
"""

from __future__ import annotations

import pytest
from fast25 import fast25_views
from stagecache.runtime.cache.pages import page_view
from stagecache.runtime.errors import ConfigError
from stagecache.runtime.model.config_file import PRESETS
from stagecache.runtime.model.families import load_spec
from stagecache.runtime.plan.plan import Sizing, build_plan
from stagecache.runtime.sizing import policies as P
from stagecache.runtime.sizing.bounds import CeilingTracker, belady_curve
from stagecache.runtime.sizing.curves import trace_curves
from stagecache.runtime.sizing.policy_advice import Evaluator, stage_pricing
from stagecache.runtime.traces.block_workload import BlockWorkloadConfig, generate_blocks
from stagecache.runtime.traces.workload import WorkloadConfig, generate


@pytest.fixture(scope="module")
def block_views():
    return [page_view(r, 16) for r in generate_blocks(
        BlockWorkloadConfig(seed=7, requests=600, block_tokens=16, live=100))]


@pytest.fixture(scope="module")
def token_views():
    return [page_view(r, 32) for r in generate(WorkloadConfig(
        seed=2, requests=200, system_prompt_len=(64, 256), user_len=(16, 96), assistant_len=(16, 96)))]


def _run(views, spec, cap, tier="device"):
    return P.run_policy(views, P.own_strategy(spec), cap, tier, views[0].page_size,
                        spec.name == "tlru")


@pytest.mark.parametrize("views_name", ["block_views", "token_views"])
def test_every_policy_is_below_belady_and_reaches_the_ceiling(views_name, request):
    views = request.getfixturevalue(views_name)
    longest = max(v.pages for v in views)
    curves = trace_curves(views)
    sizes = [longest + 2, 3 * longest, curves.total.full_pages // 2]
    belady = belady_curve(views, sizes)
    tracker = CeilingTracker()
    ceiling = sum(tracker.observe(v) for v in views)
    for spec in P.policy_specs(None):
        for cap in sizes:
            for tier in ("device", "host"):
                assert _run(views, spec, cap, tier).hit_tokens <= belady[cap], (spec, cap, tier)
        never = curves.distinct_pages + longest
        assert _run(views, spec, never).hit_tokens == ceiling
        assert _run(views, spec, never, "host").hit_tokens == ceiling


def test_policies_differ_and_the_lru_model_tracks_the_curve(block_views):
    """The policies are not one: at a size that evicts, LFU and LRU hit differently; the LRU model
    (whole-leaf eviction) stays within a point of the page-exact LRU curve."""
    curves = trace_curves(block_views)
    cap = curves.total.pages_for(0.5)
    rates = {s.name: _run(block_views, s, cap).hit_tokens for s in P.policy_specs(None)}
    assert rates["lfu"] != rates["lru"]
    assert rates["priority"] == rates["lru"]  # a block trace keeps only prompt pages
    assert abs(rates["lru"] - curves.device.at(cap)) / curves.input_tokens < 0.01


def test_no_two_nodes_tie(token_views):
    """sglang's clock gives every node its own time: the order never falls back on a tie."""
    tree = P.RadixModel(P.LRU(), 10 ** 9, 32)
    for v in token_views:
        _, node = tree.match(v.keys.tolist()[:v.max_hit])
        tree.insert(v.keys.tolist()[:v.cacheable])
    stamps, stack = [], [tree.root]
    while stack:
        n = stack.pop()
        stamps.append(n.last_access_time)
        stack.extend(n.children.values())
    assert len(stamps) == len(set(stamps)) > 100


def test_the_evaluator_bisects_to_one_percent(block_views):
    ev = Evaluator(block_views, P.own_strategy)
    curves = trace_curves(block_views)
    spec = P.PolicySpec("lfu")
    want = 0.9 * curves.device.ceiling_tokens
    top = curves.distinct_pages + max(v.pages for v in block_views)
    pages = ev.pages_for(spec, "device", want, curves.device.pages_for(0.9), top)
    assert ev.hits(spec, "device", pages) >= want
    below = pages - max(1, int(0.01 * pages))
    assert ev.hits(spec, "device", below) < want or below < 1
    assert ev.same_tiers  # a block trace: one run serves both tiers


@pytest.mark.parametrize("items,fragment", [
    (["bogus={}"], "expected POLICY=JSON"),
    (["slru"], "expected POLICY=JSON"),
    (["slru={"], "is not JSON"),
    (["slru=[1]"], "expected a JSON object"),
    (['slru={"protected": 3}'], "unknown key 'protected'"),
    (['slru={"protected_threshold": -1}'], "non-negative integer"),
    (['slru={"protected_threshold": true}'], "non-negative integer"),
    (['lru={"x": 1}'], "accepted: none"),
    (['tlru={"threshold": 100, "next_prompt_estimate": 100}'], "must exceed"),
    (['tlru={"threshold": 0}'], "must exceed"),
])
def test_bad_policy_configs_are_one_line(items, fragment):
    with pytest.raises(ConfigError) as exc:
        P.parse_policy_config(items)
    assert fragment in str(exc.value) and "\n" not in str(exc.value)


def test_policy_specs_defaults_and_flags():
    specs = P.policy_specs(None, P.parse_policy_config(['slru={"protected_threshold": 4}']))
    assert [s.name for s in specs] == list(P.POLICIES)
    assert specs[2].flags() == ("--radix-eviction-policy slru --radix-eviction-policy-config "
                                "'{\"protected_threshold\": 4}'")
    assert specs[4].config == P.TLRU_DEFAULT
    assert P.policy_specs(["LFU", "lfu"])[0].name == "lfu" and len(P.policy_specs(["lfu", "lfu"])) == 1
    with pytest.raises(ConfigError, match="unknown policy 'mru'"):
        P.policy_specs(["mru"])


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("pp", [1, 2, 4])
def test_bytes_per_page_are_the_plans_device_growth(preset, pp):
    """For every preset of every family: one more full-token page costs each stage what the plan's
    own device bytes grow by (paged kinds at their budget's share, per-request kinds not at all)."""
    spec = load_spec(preset)
    page = spec.family.sglang_page_size(256) if hasattr(spec.family, "sglang_page_size") else 256
    try:
        plans = [build_plan(spec, pp, page_size=page, sizing=Sizing.sglang(max_total_tokens=n * page))
                 for n in (4096, 8192)]
    except ConfigError as exc:  # a family sglang does not split under this PP
        pytest.skip(str(exc))
    for a, b in zip(plans[0].stages, plans[1].stages, strict=True):
        growth = (b.device_bytes - a.device_bytes) / (b.budget.full_pages - a.budget.full_pages)
        price = stage_pricing(a)
        assert price["device_page_bytes"] == pytest.approx(growth, rel=0.002), (preset, a.stage)
        per_slot = [p for p in a.pools if p.present and (not p.kind.paged or p.kind.budget in
                                                          ("request", "state"))]
        fixed = sum(u["bytes"] for u in price["unreduced_pools"] if u["reason"] == "per request")
        assert fixed == sum(p.device_bytes for p in per_slot)
        assert (b.device_bytes - a.device_bytes) > 0
        per_request = [p.pool for p in per_slot]
        assert {u["pool"] for u in price["unreduced_pools"]} >= set(per_request)


def test_fast25_all_policies_at_eight_sizes(tmp_path):
    """The FAST'25 synthetic trace: 8 sizes x 5 policies run, LRU within half a point of the curve."""
    views = fast25_views(tmp_path)
    curves = trace_curves(views)
    sizes = sorted({curves.device.pages_for(s) for s in (0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99)} | {512})
    assert len(sizes) == 8
    for cap in sizes:
        got = {s.name: _run(views, s, cap).hit_tokens for s in P.policy_specs(None)}
        assert abs(got["lru"] - curves.device.at(cap)) / curves.input_tokens < 0.005, cap
