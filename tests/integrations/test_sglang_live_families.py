"""Every family live: a real sglang 0.5.23 PP deployment of a Mamba hybrid, a DSA model and an SWA
hybrid (and, healthy, a dense MHA model), validated as one instrument (CPU, gloo, real processes).

Runs in .venv-sglang (test_sglang_venv.py launches it, in a pytest process of its own: the ranks
are forked from it).  Each test is one launch of N real ranks (tests/support/sglang_ranks.py with
tests/support/sglang_family_ranks.py's build): sglang's distributed state over gloo, its own
``load_plugins()``, the family's real pools sized from a byte budget by sglang's configurator (the
capacity MIN-reduced over the ranks) and the HiCache assembler's own strategy ``build`` -- the
record exchange runs inside it, as for DeepSeek V4.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

sglang = pytest.importorskip("sglang", reason="sglang not installed (runs in .venv-sglang)")
if sglang.__version__ != "0.5.23":  # the release the families' pools are modelled on
    pytest.skip(f"the families' pools are modelled on sglang 0.5.23, this is {sglang.__version__}",
                allow_module_level=True)

from sglang.srt.distributed.utils import get_pp_indices  # noqa: E402
from sglang_family_ranks import DENSE, FAMILIES, build_family, gates  # noqa: E402
from sglang_ranks import free_port, launch  # noqa: E402
from stagecache.runtime.model.families import load_spec  # noqa: E402

pytestmark = pytest.mark.timeout(240)

CASES = [(family, pp) for family in FAMILIES for pp in (2, 4)]
IDS = [f"{FAMILIES[f].preset}-pp{pp}" for f, pp in CASES]
#: What each family's seeded fault is named by, on every rank: the pool kind it breaks.
FAULT_POOLS = {"linear_hybrid": "mamba", "dsa": "kv", "swa_hybrid": "swa"}


@pytest.fixture(autouse=True)
def _gpu_gates():
    with gates():  # set before the ranks fork: every rank inherits them
        yield


def _launch(tmp_path: Any, family: str, pp: int, common_env: dict[str, str] | None = None, **kw: Any) -> Any:
    case = DENSE if family == DENSE.family else FAMILIES[family]
    env = {"STAGECACHE_SGLANG_EXCHANGE_TIMEOUT_S": "20", **(common_env or {})}  # a rank that crashes: 20 s
    return launch(tmp_path, pp, server=case.server, budget=case.budget, preset=case.preset,
                  build=build_family, common_env=env, **kw)


def _metric(metrics: str, name: str, label: str = "pp_rank") -> dict[str, float]:
    return {s.labels[label]: s.value for f in text_string_to_metric_families(metrics)
            for s in f.samples if s.name == name}


def _traffic(ctx: dict[str, Any], rank: int, family: str) -> dict[str, Any]:
    """On this rank: one request matched through sglang's (hooked) ``UnifiedRadixCache.match_prefix``,
    and one page backed up and loaded back by sglang's real ``HybridCacheController`` (with the
    page pools that move with it: DSA's indexer), whose acks sglang's own ``writing_check`` /
    ``loading_check`` count into its ``RadixCacheMetricsCollector``."""
    from array import array
    from types import SimpleNamespace

    import torch
    from prometheus_client import REGISTRY
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams, MatchResult
    from sglang.srt.mem_cache.hicache_storage import PoolTransfer
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.srt.observability.metrics_collector import RadixCacheMetricsCollector
    from sglang_real import AckLedger
    from stagecache.runtime.integrations.sglang.agreement import PAGE_POOLS

    group, ctl = ctx["stack"]
    page = int(ctl.page_size)
    result = MatchResult(device_prefix_len=2 * page, last_device_node=None, last_host_node=None,
                         best_match_node=None, host_hit_length=page)
    cache = SimpleNamespace(session=SimpleNamespace(try_match_prefix=lambda params: result))
    params = MatchPrefixParams(key=RadixKey(array("l", range(4 * page))), req=SimpleNamespace(rid="r1"))
    for _ in range(2):  # a waiting request matched twice: counted once
        assert UnifiedRadixCache.match_prefix(cache, params) is result
    names = [e.name for e in group.entries if str(e.name.value) in PAGE_POOLS.get(family, {})]
    src, dst = torch.arange(page, 2 * page), torch.arange(2 * page, 3 * page)
    host = ctl.write(src, node_id=1, flush=False,
                     extra_pools=[PoolTransfer(name=n, device_indices=src.clone()) for n in names])
    assert host is not None
    hosts = {t.name: t.host_indices for t in ctl.write_queue[-1].pool_transfers or ()}
    ctl.start_writing()
    assert ctl.load(host, node_id=2, device_indices=dst, extra_pools=[
        PoolTransfer(name=n, host_indices=h, device_indices=dst.clone()) for n, h in hosts.items()]) is not None
    ctl.start_loading()
    AckLedger(ctl, RadixCacheMetricsCollector(labels={"pp_rank": str(rank)})).drain()
    own = {s.name: s.value for f in REGISTRY.collect() for s in f.samples if s.labels.get("pp_rank") == str(rank)}
    return {"page": page, "backup": own["sglang:hicache_backup_bytes_total"],
            "load": own["sglang:load_back_bytes_total"], "moved": sorted(str(n.value) for n in hosts)}


def _look(family: str, pp: int) -> Any:
    def after(rank: int, ctx: dict[str, Any]) -> dict[str, Any]:
        dep = ctx["deployment"]
        if "pools" not in ctx or dep is None:
            return {}
        if rank == 1:
            return {"traffic": _traffic(ctx, rank, family)}
        if rank != 0:
            time.sleep(2 * dep.options.push_interval_s)
            return {}
        url, end = dep.url, time.monotonic() + 60
        while True:  # every stage pushed, and rank 1's traffic arrived (bounded; a loaded machine is slow)
            try:
                ready = httpx.get(f"{url}/readyz", timeout=10)
                one = next((s for s in httpx.get(f"{url}/api/metrics/summary", timeout=10).json()["stages"]
                            if s["stage"] == 1), None)
            except httpx.TimeoutException:
                if time.monotonic() > end:
                    raise
                continue
            if (ready.status_code == 200 and one and one["transfer_bytes"]["h2d"]) or time.monotonic() > end:
                break
            time.sleep(0.2)
        return {"look": {"ready": ready.status_code, "reasons": ready.json().get("reasons"),
                         "startup": httpx.get(f"{url}/api/startup", timeout=10).json(),
                         "summary": httpx.get(f"{url}/api/metrics/summary", timeout=10).json(),
                         "metrics": httpx.get(f"{url}/metrics", timeout=10).text}}
    return after


@pytest.mark.parametrize(("family", "pp"), [*CASES, (DENSE.family, 2)], ids=[*IDS, f"{DENSE.preset}-pp2"])
def test_a_healthy_deployment_is_one_endpoint_with_every_stage_and_sglangs_numbers(tmp_path, family, pp):
    port = free_port()
    run = _launch(tmp_path, family, pp, common_env={"STAGECACHE_SGLANG_DASHBOARD_PORT": str(port)},
                  after=_look(family, pp))
    assert sorted(run.results) == list(range(pp)), run.results
    for rank, res in run.results.items():
        assert "crash" not in res and "error" not in res, (rank, res)
    look = run.results[0]["look"]
    assert look["ready"] == 200, look["reasons"]
    startup = look["startup"]
    spec = load_spec((DENSE if family == DENSE.family else FAMILIES[family]).preset)
    assert (startup["ok"], startup["family"], startup["pp_size"]) == (True, family, pp), startup["errors"]
    assert [(s["start_layer"], s["end_layer"]) for s in startup["stages"]] == \
        [tuple(get_pp_indices(spec.num_layers, r, pp)) for r in range(pp)]
    assert all(s["ok"] for s in startup["stages"]) and startup["errors"] == []
    for s in startup["stages"]:  # the layer kinds the family module names, one entry per stage layer
        assert [e["global"] for e in s["layers"]] == list(range(s["start_layer"], s["end_layer"]))
    metrics = look["metrics"]
    assert _metric(metrics, "stagecache_stage_up") == {str(k): 1.0 for k in range(pp)}
    # the capacity ledger: each stage alone, and sglang's MIN over the ranks
    alone = _metric(metrics, "stagecache_capacity_tokens_alone")
    tokens = _metric(metrics, "stagecache_capacity_tokens")
    assert sorted(alone) == [str(k) for k in range(pp)] and set(tokens.values()) == {min(alone.values())}
    stages = {s["stage"]: s for s in look["summary"]["stages"]}
    assert sorted(stages) == list(range(pp))
    for k in range(pp):  # every stage's device bytes, measured on its own rank's tensors
        assert sum(b["device"] for b in stages[k]["pool_bytes"].values()) > 0, k
    # rank 1's match and transfers, on rank 0's endpoint, equal sglang's own counters on rank 1
    moved = run.results[1]["traffic"]
    page = moved["page"]
    one = stages[1]
    assert (one["cache_tokens"]["device"], one["cache_tokens"]["host"], one["cache_tokens"]["miss"]) == \
        (2 * page, page, page)
    assert moved["backup"] > 0 and one["transfer_bytes"] == {"d2h": moved["backup"], "h2d": moved["load"]}
    assert one["transfer_count"] == {"d2h": 1, "h2d": 1}
    assert stages[0]["transfer_bytes"] == {"d2h": 0, "h2d": 0}
    if family == "dsa":  # the index keys moved with the KV page
        assert moved["moved"] == ["indexer"], moved
    hits = {(s.labels["pp_rank"], s.labels["tier"]): s.value for f in text_string_to_metric_families(metrics)
            for s in f.samples if s.name == "stagecache_prefix_hit_tokens_total"}
    assert hits[("1", "device")] == 2 * page and hits[("1", "host")] == page


def _refusals(run: Any, pp: int) -> str:
    """Every rank refused with the same message; that message."""
    errors = {r: res.get("error") for r, res in run.results.items()}
    assert sorted(errors) == list(range(pp)), run.results
    first = errors[0]
    assert first and first.startswith("StageMappingInvalid:"), errors
    assert set(errors.values()) == {first}, errors  # the same message on every rank
    return first


@pytest.mark.parametrize(("family", "pp"), CASES, ids=IDS)
def test_the_familys_seeded_fault_on_rank_1_is_refused_on_every_rank_naming_stage_1(tmp_path, family, pp):
    fault = FAMILIES[family].fault
    run = _launch(tmp_path, family, pp, env={1: {"STAGECACHE_TEST_FAULT": fault}})
    text = _refusals(run, pp)
    named = {line.strip().split("]")[0] + "]" for line in text.splitlines()[1:]}
    assert named == {"[stage 1]"}, text  # every error names stage 1, and only it
    assert f"[stage 1] {FAULT_POOLS[family]}:" in text, text


def _other_partition(n: int, pp: int) -> str:
    """sglang's even split with one layer moved from the last stage to the first."""
    sizes = [e - s for s, e in (get_pp_indices(n, r, pp) for r in range(pp))]
    sizes[0] += 1
    sizes[-1] -= 1
    return ",".join(map(str, sizes))


@pytest.mark.parametrize(("family", "pp"), CASES, ids=IDS)
def test_a_rank_with_another_partition_is_refused_on_every_rank(tmp_path, family, pp):
    n = load_spec(FAMILIES[family].preset).num_layers
    run = _launch(tmp_path, family, pp, env={1: {"SGLANG_PP_LAYER_PARTITION": _other_partition(n, pp)}})
    text = _refusals(run, pp)
    assert "[stage 1] fingerprint: stage 1 runs another deployment than the other stages" in text, text
    assert "gap: layers" in text or "overlap: layers" in text, text


@pytest.mark.parametrize(("family", "pp"), CASES, ids=IDS)
def test_a_live_pools_record_is_the_offline_plans_record(tmp_path, family, pp):
    """What a rank exchanges is the record ``stagecache check`` builds offline for its stage: the
    same layer map (kinds and every id, read from sglang's pool) and the same buffers per kind,
    for every rank of the layout -- one record type, one report, whichever path made it."""
    from stagecache.runtime.integrations.sglang.cpu_stage import (
        FAMILY_MODELS,
        _PPGroup,
        family_configurator,
        model_dir,
        published,
        size_pools,
    )
    from stagecache.runtime.integrations.sglang.reader import read_family_pool
    from stagecache.runtime.plan.inputs import resolve_plan
    from stagecache.runtime.validation.record import stage_record

    model = FAMILY_MODELS[family]
    plan = resolve_plan(model.preset, pp_size=pp, page_size=model.server["page_size"])
    with published(model_dir(tmp_path, model.preset), pp_size=pp, max_total_tokens=2048, max_running_requests=4,
                   hicache_io_backend="direct", **model.server) as (sa, mc):
        for rank in range(pp):
            kvc = family_configurator(sa, mc, rank, pp, _PPGroup(), "cpu")
            _, config = size_pools(kvc)
            pools = kvc._init_pools(sizes=kvc._derive_pool_sizes(config=config), req_to_token_pool=None,
                                    token_to_kv_pool_allocator=None)
            view = read_family_pool(pools.token_to_kv_pool, rank, pp, req_pool=pools.req_to_token_pool,
                                    name=model.preset, page_size=model.server["page_size"])
            live, offline = view.record(pp_size=pp, model_name=model.preset), stage_record(plan.stage(rank))
            assert (live.family, live.num_layers) == (offline.family, offline.num_layers) == (family, plan.spec.num_layers)
            assert live.layer_map == offline.layer_map, rank
            assert {k: v for k, v in live.inventory.items() if v} == {k: v for k, v in offline.inventory.items() if v}
            assert live.fingerprint.config_hash == offline.fingerprint.config_hash
            assert live.fingerprint.partition == offline.fingerprint.partition
            assert view.findings == ()
            assert sum(live.device_bytes.values()) == sum(
                t.nbytes for t in _tensors(pools.token_to_kv_pool, pools.req_to_token_pool))


def _tensors(kv: Any, req_pool: Any) -> list[Any]:
    """Every device tensor of a rank's KV pools (and its Mamba state), as sglang holds them."""
    pools = [kv.full_kv_pool, kv.swa_kv_pool] if hasattr(kv, "swa_kv_pool") else \
        [kv.full_kv_pool] if hasattr(kv, "full_kv_pool") else [kv]
    out = [t for p in pools for attr in ("k_buffer", "v_buffer", "kv_buffer") for t in getattr(p, attr, None) or ()]
    out += list(getattr(getattr(kv, "index_key_cache", None), "buffer", None) or ())
    cache = getattr(getattr(req_pool, "mamba_pool", None), "mamba_cache", None)
    if cache is not None:
        out += [cache.temporal, *cache.conv]
    return out


def test_a_model_stagecache_does_not_read_leaves_the_plugin_off_with_one_line(tmp_path, monkeypatch, caplog):
    """A pool of a known class serving a model whose config.json no family reads: the rank logs one
    line and joins nothing (every rank reads the same config, so every rank stays off alike) --
    sglang starts as if stagecache were not installed."""
    import functools
    import json
    import logging

    from stagecache.runtime.integrations.sglang import deployment, reader

    folder = tmp_path / "unknown"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["FooForCausalLM"], "num_hidden_layers": 4}))
    monkeypatch.setattr(deployment, "sglang_model_spec",
                        functools.partial(reader.sglang_model_spec, model_path=str(folder)))
    dep = deployment.Deployment(deployment.DeploymentOptions(port=None))
    with caplog.at_level(logging.WARNING, logger="stagecache"):
        dep._join_family(object(), 16, None)
    assert dep.rank is None and dep.record is None
    [line] = [r.getMessage() for r in caplog.records if "stays off" in r.getMessage()]
    assert "sglang serves a model stagecache does not read" in line and "FooForCausalLM" in line, line
